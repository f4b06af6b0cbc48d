#!/usr/bin/env python
"""Host time of one streamed call on the CPU: ``SwappedStack``'s runtime ``forward`` and the output's
conversion to torch (``torch_stack``'s ``torch_fwd_out`` row), for a stack of tiny layers, where the host's
work (schedule, executable lookup, dispatch, copies issued) is most of the call.

The layers: ``L`` torch FFNs (``h + b(gelu(a(h)))``, D=256, F=512, bf16), 64 rows of input, the policy of
``torch_stack`` (weights, gradients and optimizer state in ``pinned_host``, remat, prefetch depth 2). Prints
the median over 7 windows of 50 back-to-back calls, in microseconds per call. Run it with the tree to measure
on ``PYTHONPATH``; the constructor of trees before ``ParallelConfig`` existed is used where that import fails.

    PYTHONPATH=. taskset -c 0,1 python benchmarks/host_overhead_cpu.py --layers 8 32
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
import torch

from xla_swap.planning import OffloadPolicy
from xla_swap.stack import SwappedStack

D, F, T = 256, 512, 64


class FFN(torch.nn.Module):
    """``h + down(gelu(up(h)))``, bias-free, hidden ``d``, inner ``f`` (``torch_stack``'s layer)."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, f, bias=False), torch.nn.Linear(f, d, bias=False)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(h), approximate="tanh"))


def build(layers: int):
    """``(stack, modules)``: a ``SwappedStack`` of ``layers`` bf16 FFNs on the first jax device, and the FFNs."""
    torch.manual_seed(0)
    mods = [FFN(D, F).to(torch.bfloat16) for _ in range(layers)]
    pol = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=True, prefetch_depth=2)
    try:
        from xla_swap.stack.config import ParallelConfig, TrainingConfig
    except ImportError:   # a tree from before the configs
        return SwappedStack(mods, policy=pol, devices=jax.devices()[:1], accumulate_grads=False), mods
    return SwappedStack(mods, policy=pol, parallel=ParallelConfig(devices=jax.devices()[:1]),
                        training=TrainingConfig(accumulate_grads=False)), mods


def the_call(st, x):
    """The timed call: the runtime's ``forward`` on jax array ``x`` [T, D] and its output converted to a torch
    tensor (``torch_stack``'s ``torch_fwd_out``)."""
    return st._out(st.runtime.forward((x, {})), None)


def per_call_us(layers: int, windows: int = 7, calls: int = 50, warmup: int = 20) -> float:
    """Median microseconds per ``forward`` + output conversion, over ``windows`` windows of ``calls`` calls."""
    st, _ = build(layers)
    x = jax.device_put(np.random.default_rng(0).standard_normal((T, D)).astype(jax.numpy.bfloat16))

    def call():
        return the_call(st, x)

    for _ in range(warmup):
        call()
    times = []
    for _ in range(windows):
        t = time.perf_counter()
        for _ in range(calls):
            out = call()
        times.append((time.perf_counter() - t) / calls)
    del out
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    args = p.parse_args(argv)
    for L in args.layers:
        print(json.dumps({"layers": L, "us_per_call": round(per_call_us(L), 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
