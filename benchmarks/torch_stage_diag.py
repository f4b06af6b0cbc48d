#!/usr/bin/env python
"""Why is a torch-written stage slower than the JAX-written one when streamed? A diagnostic.

At a compute-bound shape the torch FFN stage (``nn.Linear`` weights ``[out, in]``, so each matmul
contracts the weight's minor dimension) ran 1.8 % slower than the JAX stage (weights ``[in, out]``)
with every weight resident, and 5 % slower streamed (``benchmarks/results/torch_stack_cyclic``).
This script separates the candidates, at one shape, in one process:

* the optimized HLO of each stage's forward executable (op counts: fusions, custom calls,
  copies, transposes; the texts are written to ``--out-dir``);
* windowed forward times (``torch_stack._timeit``) of four stacks, streamed and resident:
  ``jax`` (JAX layer), ``torch`` (``nn.Linear`` through ``SwappedStack``), ``torch_t`` (a torch
  layer holding its weights ``[in, out]`` and using ``h @ w``: the JAX layout written in torch);
* one traced call of each streamed stack (a ``TraceRecorder`` passed to the call): per-stage
  compute time (from its ``StageEvent`` stamps:
  a stage's ``done_s`` minus the later of its dispatch and the previous stage's ``done_s``).

    PYTHONPATH=. python3 benchmarks/torch_stage_diag.py --out-dir $OUT          # GPU
    PYTHONPATH=. python3 benchmarks/torch_stage_diag.py --shape 64,128,2,16 --reps 1   # CPU smoke

Prints one JSON object (medians in seconds) and writes ``torch_stage_diag.json`` and the HLO
texts into ``--out-dir`` when given.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys

import numpy as np

from torch_stack import _rand, _shape, _timeit


def _op_counts(hlo: str) -> dict:
    """Counts of a few op kinds in an optimized HLO text (ENTRY and fused computations alike)."""
    return {name: len(re.findall(pat, hlo)) for name, pat in
            (("fusion", r"= \S+ fusion\("), ("custom_call", r"custom-call\("), ("copy", r"= \S+ copy\("),
             ("transpose", r"transpose\("), ("dot", r" dot\("))}


def _stage_compute_s(events) -> list[float]:
    comp = sorted((e for e in events if e.kind == "compute"), key=lambda e: e.stage)
    out, prev = [], 0.0
    for e in comp:
        out.append(e.done_s - max(prev, e.dispatched_s))
        prev = e.done_s
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=_shape, default=(4096, 14336, 16, 16384), help="D,F,L,T")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import torch

    from xla_swap.executors import RuntimeConfig, StreamingRuntime, TraceRecorder
    from xla_swap.planning import OffloadPolicy
    import dataclasses

    from xla_swap.stack.swapped_stack import DEFAULT_POLICY
    from xla_swap.stack import SwappedStack
    from xla_swap.stack.config import AutotuneConfig, ParallelConfig
    from xla_swap.stack.torch_bridge import to_torch as _to_torch

    D, F, L, T = args.shape
    k = 2
    bf16 = jnp.bfloat16
    rng = np.random.default_rng(0)
    wt = [{"a": _rand(rng, (F, D), bf16), "b": _rand(rng, (D, F), bf16)} for _ in range(L)]
    wj = [{"a": np.ascontiguousarray(w["a"].T), "b": np.ascontiguousarray(w["b"].T)} for w in wt]
    x_np = (rng.standard_normal((T, D), dtype=np.float32) * 0.5).astype(bf16)
    cuda = torch.cuda.is_available()
    x_t = _to_torch(x_np).cuda() if cuda else _to_torch(x_np)
    x_dev = jax.device_put(x_np, jax.devices()[0])

    def stage_jax(w, h):
        return h + jax.nn.gelu(h @ w["a"], approximate=True) @ w["b"]

    class Linear(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.a = torch.nn.Linear(D, F, bias=False)
            self.b = torch.nn.Linear(F, D, bias=False)
            with torch.no_grad():
                self.a.weight = torch.nn.Parameter(_to_torch(w["a"]))
                self.b.weight = torch.nn.Parameter(_to_torch(w["b"]))

        def forward(self, h):
            return h + self.b(torch.nn.functional.gelu(self.a(h), approximate="tanh"))

    class Transposed(torch.nn.Module):  # the JAX layout, written in torch
        def __init__(self, w):
            super().__init__()
            self.wa = torch.nn.Parameter(_to_torch(np.ascontiguousarray(w["a"].T)))
            self.wb = torch.nn.Parameter(_to_torch(np.ascontiguousarray(w["b"].T)))

        def forward(self, h):
            return h + torch.nn.functional.gelu(h @ self.wa, approximate="tanh") @ self.wb

    pol = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=True, prefetch_depth=k)
    out: dict = {"shape": [D, F, L, T], "k": k, "rows": {}, "ops": {}, "stage_compute_s": {}}

    def runtime_of(name, resident):
        if name == "jax":
            return StreamingRuntime(stage_jax, wj,
                                    RuntimeConfig(prefetch_depth=k, track_residency=False, resident=[resident] * L)), x_dev
        mods = [(Linear if name == "torch" else Transposed)(w) for w in wt]
        kw = dict(budget_bytes=10 ** 15, autotune=AutotuneConfig(enabled=False),
                  policy=dataclasses.replace(DEFAULT_POLICY, prefetch_depth=k)) if resident else dict(policy=pol)
        st = SwappedStack(mods, parallel=ParallelConfig(devices=jax.devices()[:1]), **kw)
        return st.runtime, (x_dev, {})

    for name in ("jax", "torch", "torch_t"):
        for resident in (False, True):
            rt, h = runtime_of(name, resident)
            row = f"{name}_{'resident' if resident else 'streamed'}"
            out["rows"][row] = _timeit(lambda: rt.forward(h), args.reps, jax.block_until_ready, 3)
            if not resident:
                sig = rt.signature(h)
                hlo = rt.stage_executable(sig, "forward", 0).as_text()
                out["ops"][name] = _op_counts(hlo)
                if args.out_dir:
                    os.makedirs(args.out_dir, exist_ok=True)
                    with open(os.path.join(args.out_dir, f"hlo_{name}.txt"), "w") as f:
                        f.write(hlo)
                rec = TraceRecorder()
                jax.block_until_ready(rt.forward(h, trace=rec))
                out["stage_compute_s"][name] = _stage_compute_s(rec.events)
            print(json.dumps({"row": row, "median_s": statistics.median(out["rows"][row])}), flush=True)
            rt = None
            gc.collect()
    summary = {r: statistics.median(v) for r, v in out["rows"].items()}
    summary.update({f"stage_median_s_{n}": statistics.median(v[1:] or v) for n, v in out["stage_compute_s"].items()})
    out["summary"] = summary
    print(json.dumps({"summary": summary, "ops": out["ops"]}, indent=1))
    if args.out_dir:
        with open(os.path.join(args.out_dir, "torch_stage_diag.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
