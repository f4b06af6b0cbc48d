#!/usr/bin/env python
"""The torch entry point on the GPU: a torch-written FFN stack through ``SwappedStack``
against the JAX-written ``StreamingRuntime`` row and the physical floor, with and without
the AdamW step, and the torch CPU-offload anchors.

Stack: ``L`` layers ``h + b(gelu(a(h), approximate="tanh"))``, ``a = nn.Linear(D, F)``,
``b = nn.Linear(F, D)`` without bias, bf16, input ``(T, D)`` bf16; loss ``mean(out.float()**2)``.
Inputs and outputs stay on the device: the JAX rows take a device array and return one;
the torch rows take a CUDA torch tensor and return one (shared with jax through DLPack; on a
machine without CUDA, CPU tensors), so both do the same work but for the bridge.

Rows per shape (medians of ``--reps`` after one warm-up; seconds):

* ``ondev_*``: the same StreamingRuntime with every stage ``resident`` (weights, and for
  ``ondev_adamw`` the moments, in device memory, nothing transferred): on-device compute.
* ``jax_fwd`` / ``jax_train``: the JAX-written layer, weights in ``pinned_host``, k=2.
* ``torch_fwd`` / ``torch_train`` / ``torch_adamw``: ``SwappedStack`` over ``nn.Module``
  layers (default policy, k=2); ``torch_train`` keeps the gradients in ``pinned_host``
  (``accumulate_grads=False``); ``torch_adamw`` applies torch AdamW's update per stage on the
  device with bf16 moments (torch's choice for bf16 parameters) in ``pinned_host``;
  ``torch_fwd_rt`` calls the same runtime as the JAX row is called (diagnostic of the
  entry point's per-call conversion); ``torch_train_actoff`` is ``torch_train`` with ``offload_activations=True`` (layer inputs
  through ``pinned_host``); ``torch_adamw_devstate`` keeps the moments in device memory (``optimizer_state="device"``,
  the placement a planner picks when they fit): only the weights cross PCIe.

Diagnostic rows: ``jax_fwd_nocarry`` / ``jax_train_nocarry`` (the JAX rows with
``prefetch_next_call=False``: every call streams stage 0 before computing), ``torch_ondev_fwd``
(the torch stages all resident: their compute against ``ondev_fwd``), ``torch_in_conv`` /
``torch_out_conv`` (host time of the entry point's input and output conversion alone),
``torch_fwd_k3`` / ``torch_train_k3`` (prefetch depth k+1: one more stage of device memory),
``torch_fwd_nt`` / ``torch_train_nt`` (``SwappedStack(transpose_linear=False)``: the ``nn.Linear``
weights held in torch's ``[out, in]``, so each matmul contracts the weight's minor dimension;
the other torch rows hold them ``[in, out]``, the default).

Every row is the steady-state time per call of a loop: after one warm-up call, ``--reps``
windows of ``--window`` back-to-back calls (default 3), each synced once at its end, divided by
the window (a step's trailing copies overlap the next step, as in a training loop; the runtime's
cyclic schedule, ``prefetch_next_call``, has the next call's first k stages in device memory when
it starts). ``--window 1`` times each call synced on its own (per-call latency). The rows compared
with each other are timed in turn, window by window, with both stacks built (``_interleaved``:
``jax_fwd`` / ``torch_fwd`` / ``torch_fwd_rt``, then ``jax_train`` / ``torch_train``), so that
drift of the machine hits them alike; ``bw_torch_stack`` is the bulk bandwidth of the torch
stack's own ``pinned_host`` buffers (``bw``: the JAX stack's).
``torch_fwd_in`` / ``torch_fwd_out`` split the entry point: torch input with a jax sync, and jax
input with the torch output and ``torch.cuda.synchronize``.

Floors (W = weight bytes, M = moment bytes, k = 2; bandwidths measured in the same run by
moving the weights themselves): forward ``max(ondev_fwd, W/H2D)``; training
``max(ondev_train, w_in/H2D, W/D2H, (w_in + W)/both)`` with ``w_in = (2L-c)/L*W``, ``c`` the raw
file's ``kept_at_turns``: the stages that stay on the device at the turns of a step (k+1 forward
to backward, k+1 backward to the next forward: ``c = 2k+2``; files measured before record ``2k+1``
or ``2k``, before the cyclic schedule none, read as ``k``);
AdamW step ``max(ondev_adamw, in/H2D, out/D2H, (in+out)/both)`` with ``in = w_in + M`` and
``out = W + M`` (the host-memory term is 0: no arithmetic runs on the host).

    PYTHONPATH=. python3 benchmarks/torch_stack.py --out-dir /tmp/out              # GPU, both shapes
    PYTHONPATH=. python3 benchmarks/torch_stack.py --shapes 64,128,2,16 --reps 1   # CPU smoke test

Writes ``torch_stack.json`` (raw samples and analysis) into ``--out-dir`` (nothing when not
given) and prints the table. ``analyze`` is a pure function of the raw JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

TARGETS = {"torch_fwd": 1.05, "torch_train": 1.10, "torch_vs_jax": 1.03}


def _shape(s):
    parts = [int(v) for v in s.split(",")]
    if len(parts) != 4 or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"a shape is D,F,L,T (positive ints), got {s!r}")
    return tuple(parts)


def _rand(rng, shape, dtype):
    """Random N(0, 0.02^2) weights fast: a random [rows, 1024] block tiled along the columns (cut
    to ``shape[1]`` columns, which need not be a multiple of 1024)."""
    cols = min(shape[1], 1024)
    blk = (rng.standard_normal((shape[0], cols), dtype=np.float32) * 0.02).astype(dtype)
    return np.ascontiguousarray(np.tile(blk, (1, -(-shape[1] // cols)))[:, :shape[1]])


def _timeit(call, reps, sync=None, window=1):
    """Seconds per call: one warm-up call, then ``reps`` windows of ``window`` back-to-back calls,
    each window synced once at its end (``sync(last result)``) and divided by ``window``.

    ``window=1`` with ``sync`` is per-call latency; a larger window is the steady-state time per
    call of a loop (a call's trailing copies, e.g. the last stages' updated weights going to the
    host, overlap the next call, as in a training loop that does not wait for them).
    """
    return _interleaved({"call": call}, reps, sync or (lambda r: r), window)["call"]


def _interleaved(calls: dict, reps: int, sync, window: int = 1, mark=None) -> dict:
    """``_timeit`` of several calls at once, alternating window by window, so that drift (clocks,
    the host) hits each alike: one warm-up call each, then ``reps`` rounds of one window per call.
    ``calls``: ``{name: call}``; ``mark(text)``, where given, is told each warm-up call's end (the
    first, compiling, call). Returns ``{name: [seconds per call, ...]}``."""
    out = {name: [] for name in calls}
    for name, c in calls.items():
        sync(c())
        if mark is not None:
            mark(f"{name} warmed up")
    for _ in range(reps):
        for name, c in calls.items():
            out[name].append(_window(c, sync, window))
    return out


def _window(call, sync, window: int) -> float:
    """Seconds per call of ``window`` back-to-back calls synced once at the end (``sync(last result)``)."""
    t = time.perf_counter()
    r = None
    for _ in range(window):
        r = call()
    sync(r)
    return (time.perf_counter() - t) / window


def measure_bandwidth(host_params, reps: int = 3) -> dict:
    """Aggregate pinned-host bandwidths (bytes/s, best of ``reps``) moving ``host_params`` itself.

    ``host_params``: a pytree of ``pinned_host`` jax arrays (a runtime's ``host_params``, sharded
    or not). ``h2d``: every array to device memory with the same sharding (each device pulls its
    own shards, all at once), W / seconds; ``d2h``: a device copy back to ``pinned_host``, W /
    seconds; ``both``: the two at once, 2W / seconds. W = the arrays' total (logical) bytes.

    ``both`` dispatches the two directions alternately, one array per ``jax.device_put`` call (array
    k in, then its device copy out, then k+1 ...). Each direction as one list call leaves the other
    waiting behind it: on one H200 that reads 83 GB/s, against 100 GB/s alternating
    (``benchmarks/copy_order.py``; docs/explanation/measured-facts.md, section 4), and the
    runtime's own steps move faster than the lower figure.
    """
    import jax

    leaves = jax.tree_util.tree_leaves(host_params)
    W = sum(a.nbytes for a in leaves)
    hsh = [a.sharding for a in leaves]
    dsh = [s.with_memory_kind("device") for s in hsh]
    on_dev = jax.block_until_ready(jax.device_put(leaves, dsh))

    def both_ways():
        moved = []
        for a, d, to_dev, to_host in zip(leaves, on_dev, dsh, hsh):
            moved += [jax.device_put(a, to_dev), jax.device_put(d, to_host)]
        return moved

    h2d, d2h, both = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(leaves, dsh))
        h2d.append(W / (time.perf_counter() - t))
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(on_dev, hsh))
        d2h.append(W / (time.perf_counter() - t))
        t = time.perf_counter()
        jax.block_until_ready(both_ways())
        both.append(2 * W / (time.perf_counter() - t))
    del on_dev
    return {"h2d": max(h2d), "d2h": max(d2h), "both": max(both), "bytes": W}


def _link(bw: dict) -> dict:
    """The bandwidths of a ``measure_bandwidth`` result (bytes/s), as the raw JSON keeps them."""
    return {k: bw[k] for k in ("h2d", "d2h", "both")}


def _host_memory_gb() -> dict:
    """This process's resident set and peak (``VmRSS`` / ``VmHWM``) and the machine's ``MemAvailable``, in GB
    (Linux ``/proc``; empty elsewhere): where a row's host memory goes (pinned pools, numpy copies)."""
    out = {}
    try:
        for path, keys in (("/proc/self/status", ("VmRSS", "VmHWM")), ("/proc/meminfo", ("MemAvailable",))):
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(":")
                    if name in keys:
                        out[f"{name}_GB"] = round(int(value.split()[0]) * 1024 / 1e9, 1)
    except OSError:
        pass
    return out


def measure_shape(D, F, L, T, reps, k=2, window=1):
    """Every xla_swap row of one shape: {row: [seconds, ...]} plus bandwidths (bytes/s) and byte counts."""
    import jax
    import jax.numpy as jnp
    import torch

    from xla_swap.executors import RuntimeConfig, StreamingRuntime
    from xla_swap.planning import AdamW, OffloadPolicy
    from xla_swap.stack.swapped_stack import DEFAULT_POLICY
    from xla_swap.stack import SwappedStack
    from xla_swap.stack.config import AutotuneConfig, CompileConfig, ParallelConfig, TrainingConfig
    from xla_swap.stack.torch_bridge import to_torch as _to_torch

    bf16 = jnp.bfloat16
    rng = np.random.default_rng(0)
    wt = [{"a": _rand(rng, (F, D), bf16), "b": _rand(rng, (D, F), bf16)} for _ in range(L)]  # torch layout
    wj = [{"a": np.ascontiguousarray(w["a"].T), "b": np.ascontiguousarray(w["b"].T)} for w in wt]
    x_np = (rng.standard_normal((T, D), dtype=np.float32) * 0.5).astype(bf16)
    x_t = _to_torch(x_np)
    W = sum(a.nbytes for w in wt for a in w.values())
    # stages that stay on the device at the turns of a step: k+1 forward -> backward, k+1 backward ->
    # next forward (prefetch_next_call); results recorded before the cyclic schedule lack the key (k)
    res = {"shape": [D, F, L, T], "weight_bytes": W, "moment_bytes": 2 * W, "k": k, "kept_at_turns": 2 * k + 2,
           "rows": {}}
    rows = res["rows"]
    res["window"] = window
    t_start = time.perf_counter()
    jbr = jax.block_until_ready

    def timed(call, sync=jbr):
        return _timeit(call, reps, sync, window)

    def note(name):
        host = _host_memory_gb()
        res.setdefault("host_memory_GB", {})[name] = host
        print(json.dumps({"row": name, "median_s": statistics.median(rows[name]) if name in rows else None,
                          "elapsed_s": round(time.perf_counter() - t_start, 1), **host}), flush=True)

    def mark(what):   # progress between rows: where a slow or stalled run is
        print(json.dumps({"mark": what, "elapsed_s": round(time.perf_counter() - t_start, 1)}), flush=True)

    def stage_jax(w, h):
        return h + jax.nn.gelu(h @ w["a"], approximate=True) @ w["b"]

    def jloss(o):
        return jnp.mean(o.astype(jnp.float32) ** 2)

    def tloss(o):
        return (o.float() ** 2).mean()

    class FFN(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.a = torch.nn.Linear(D, F, bias=False)
            self.b = torch.nn.Linear(F, D, bias=False)
            with torch.no_grad():
                self.a.weight = torch.nn.Parameter(_to_torch(w["a"]))
                self.b.weight = torch.nn.Parameter(_to_torch(w["b"]))

        def forward(self, h):
            return h + self.b(torch.nn.functional.gelu(self.a(h), approximate="tanh"))

    layers = [FFN(w) for w in wt]

    # ---- on-device (every stage resident): first, while the host holds only the weights (the pinned
    # pool the streamed rows grow stays allocated; at the end the process was killed for host memory)
    dev = jax.devices()[0]
    x_dev = jax.device_put(x_np, dev)
    rt = StreamingRuntime(stage_jax, wj,
                          RuntimeConfig(prefetch_depth=k, track_residency=False, resident=[True] * L,
                                        grads_to_host=False))
    rows["ondev_fwd"] = timed(lambda: rt.forward(x_dev))
    rows["ondev_train"] = timed(lambda: rt.train_step(x_dev, jloss)[::2])
    note("ondev_train")
    rt = None  # free its buffers before the next row
    gc.collect()
    rt = StreamingRuntime(stage_jax, wj,
                          RuntimeConfig(prefetch_depth=k, track_residency=False, resident=[True] * L,
                                        optimizer_state_on_host=False), optimizer=AdamW(lr=1e-5))
    rows["ondev_adamw"] = timed(lambda: (rt.train_step(x_dev, jloss)[0], rt.host_params, rt.optimizer_state))
    note("ondev_adamw")
    rt = None  # free its buffers before the next row
    gc.collect()
    # ---- bandwidths: move the weights themselves ----
    rt = StreamingRuntime(stage_jax, wj, RuntimeConfig(prefetch_depth=k, track_residency=False))
    dev = jax.devices()[0]
    res["bw"] = _link(measure_bandwidth(rt.host_params))

    note("bandwidth")
    x_dev = jax.device_put(x_np, dev)
    # ---- the JAX-written and the torch-written stack, timed window by window in turn ----
    pol = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=True, prefetch_depth=k)
    st = SwappedStack(layers, policy=pol, parallel=ParallelConfig(devices=jax.devices()[:1]),
                      training=TrainingConfig(accumulate_grads=False))
    mark("torch stack built")
    res["bw_torch_stack"] = _link(measure_bandwidth(st.runtime.host_params))  # its own pinned buffers
    mark("torch stack's bandwidth measured")
    cuda = torch.cuda.is_available()
    x_c = x_t.cuda() if cuda else x_t
    mark("torch input on the GPU" if cuda else "torch input on the CPU")
    out_dev = x_c.device if cuda else None  # where the entry point puts its output
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def tsync(_):
        sync()

    def sync_any(r):  # a jax result (its arrays) or a torch one (the whole device)
        jbr([a for a in jax.tree_util.tree_leaves(r) if isinstance(a, jax.Array)])
        sync()

    def torch_fwd():
        return st(x_c)

    def torch_train():
        st.train_step(x_c, loss_fn=tloss)
        return st.last_grads
    # torch_fwd_rt: the torch stack's runtime called as the JAX row is (jax array in, jax array
    # out): torch_fwd - torch_fwd_rt is the entry point's per-call conversion (DLPack in and out)
    rows.update(_interleaved({"jax_fwd": lambda: rt.forward(x_dev), "torch_fwd": torch_fwd,
                              "torch_fwd_rt": lambda: st.runtime.forward((x_dev, {}))}, reps, sync_any, window,
                             mark))
    note("torch_fwd")
    rows.update(_interleaved({"jax_train": lambda: rt.train_step(x_dev, jloss)[::2], "torch_train": torch_train},
                             reps, sync_any, window, mark))
    note("torch_train")
    ref_out = np.asarray(rt.forward(x_dev)).astype(np.float32)
    rt = None  # free its buffers before the next row
    gc.collect()
    # halves of the entry point: the torch input only (jax sync), the torch output only (torch sync)
    rows["torch_fwd_in"] = timed(lambda: st.runtime.forward(st._carry_in((x_c,))))
    rows["torch_fwd_out"] = timed(lambda: st._out(st.runtime.forward((x_dev, {})), out_dev), tsync)
    note("torch_fwd_out")
    # host time of the entry point's conversions alone: torch in -> jax, jax out -> torch
    y_rt = jax.block_until_ready(st.runtime.forward((x_dev, {})))
    rows["torch_in_conv"] = _timeit(lambda: st._carry_in((x_c,)), reps, jbr)
    rows["torch_out_conv"] = _timeit(lambda: st._out(y_rt, out_dev), reps, tsync)
    del y_rt
    note("torch_out_conv")
    out_t = torch_fwd().float().cpu().numpy()
    sync()
    res["torch_output_device"] = str(torch_fwd().device)
    res["torch_vs_jax_max_abs_diff"] = float(np.abs(out_t - ref_out).max())
    st = None  # free its buffers before the next row
    gc.collect()
    # the same calls with a non-cyclic schedule: every call streams stage 0 first (what the cycle saves)
    rt = StreamingRuntime(stage_jax, wj,
                          RuntimeConfig(prefetch_depth=k, track_residency=False, prefetch_next_call=False))
    rows["jax_fwd_nocarry"] = timed(lambda: rt.forward(x_dev))
    rows["jax_train_nocarry"] = timed(lambda: rt.train_step(x_dev, jloss)[::2])
    note("jax_train_nocarry")
    rt = None
    gc.collect()
    # ---- more torch-written rows through the entry point ----
    # the torch stages' own compute: every stage resident in device memory (budget above the model)
    st = SwappedStack(layers, budget_bytes=10 ** 15, autotune=AutotuneConfig(enabled=False),
                      policy=dataclasses.replace(DEFAULT_POLICY,
                                                 prefetch_depth=k), parallel=ParallelConfig(devices=jax.devices()[:1]),
                      training=TrainingConfig(accumulate_grads=False))
    assert all(st.runtime.resident)
    rows["torch_ondev_fwd"] = timed(torch_fwd, tsync)
    note("torch_ondev_fwd")
    st = None
    gc.collect()
    # torch's own weight layout [out, in] kept on the host and the device (what transpose_linear saves)
    st = SwappedStack(layers, policy=pol, parallel=ParallelConfig(devices=jax.devices()[:1]),
                      training=TrainingConfig(accumulate_grads=False),
                      compilation=CompileConfig(transpose_linear=False))
    rows["torch_fwd_nt"] = timed(torch_fwd, tsync)
    rows["torch_train_nt"] = timed(torch_train)
    note("torch_train_nt")
    st = None
    gc.collect()
    # one more stage of device memory: k+1 stages carried across each turn
    pol3 = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=True, prefetch_depth=k + 1)
    st = SwappedStack(layers, policy=pol3, parallel=ParallelConfig(devices=jax.devices()[:1]),
                      training=TrainingConfig(accumulate_grads=False))
    rows["torch_fwd_k3"] = timed(torch_fwd, tsync)
    rows["torch_train_k3"] = timed(torch_train)
    note("torch_train_k3")
    st = None
    gc.collect()
    st = SwappedStack(layers, policy=pol, parallel=ParallelConfig(devices=jax.devices()[:1]),
                      training=TrainingConfig(accumulate_grads=False, offload_activations=True))
    rows["torch_train_actoff"] = timed(torch_train)
    res["actoff_bytes"] = st.runtime.offloaded_activation_nbytes
    note("torch_train_actoff")
    st = None  # free its buffers before the next row
    gc.collect()
    st = SwappedStack(layers, policy=pol, parallel=ParallelConfig(devices=jax.devices()[:1]),
                      optimizer=AdamW(lr=1e-5), loss_fn=tloss)

    def torch_adamw():
        st.train_step(x_c)
        return st.runtime.host_params, st.runtime.optimizer_state
    rows["torch_adamw"] = timed(torch_adamw)
    note("torch_adamw")
    res["adamw_moment_dtype"] = str(jax.tree_util.tree_leaves(st.runtime.optimizer_state[0])[0].dtype)
    st = None  # free its buffers before the next row
    gc.collect()
    dpol = OffloadPolicy(params="host", grads="host", optimizer_state="device", remat=True, prefetch_depth=k)
    st = SwappedStack(layers, policy=dpol, parallel=ParallelConfig(devices=jax.devices()[:1]),
                      optimizer=AdamW(lr=1e-5), loss_fn=tloss)
    rows["torch_adamw_devstate"] = timed(torch_adamw)
    note("torch_adamw_devstate")
    st = None  # free its buffers before the next row
    gc.collect()
    return res


def analyze(raw: dict) -> dict:
    """Medians, floors and ratios of one shape's raw measurement (pure: JSON in, JSON out)."""
    med = {k: statistics.median(v) for k, v in raw["rows"].items()}
    D, F, L, T = raw["shape"]
    W, M, k, bw = raw["weight_bytes"], raw["moment_bytes"], raw["k"], raw["bw"]
    # weights in per step: what the runtime moves, (2L - kept_at_turns)/L of W (module docstring)
    w_in = (2 * L - raw.get("kept_at_turns", k)) / L * W
    floors = {
        "fwd": max(med["ondev_fwd"], W / bw["h2d"]),
        "train": max(med["ondev_train"], w_in / bw["h2d"], W / bw["d2h"], (w_in + W) / bw["both"]),
        "adamw": max(med["ondev_adamw"], (w_in + M) / bw["h2d"], (W + M) / bw["d2h"],
                     (w_in + M + W + M) / bw["both"]),
        # moments in device memory: the weight traffic of training, compute of the on-device AdamW step
        "adamw_devstate": max(med["ondev_adamw"], w_in / bw["h2d"], W / bw["d2h"], (w_in + W) / bw["both"]),
    }
    ratio = {
        "jax_fwd": med["jax_fwd"] / floors["fwd"], "torch_fwd": med["torch_fwd"] / floors["fwd"],
        "jax_train": med["jax_train"] / floors["train"], "torch_train": med["torch_train"] / floors["train"],
        "torch_adamw": med["torch_adamw"] / floors["adamw"],
        "torch_adamw_devstate": med["torch_adamw_devstate"] / floors["adamw_devstate"],
        "torch_vs_jax_fwd": med["torch_fwd"] / med["jax_fwd"],
        "torch_vs_jax_train": med["torch_train"] / med["jax_train"],
    }
    if "torch_fwd_rt" in med:
        ratio["torch_fwd_conversion_s"] = med["torch_fwd"] - med["torch_fwd_rt"]
    if "jax_fwd_nocarry" in med:  # the same runtime with a non-cyclic schedule (stage 0 streamed every call)
        ratio["jax_fwd_nocarry"] = med["jax_fwd_nocarry"] / floors["fwd"]
        ratio["jax_train_nocarry"] = med["jax_train_nocarry"] / floors["train"]
    if "torch_ondev_fwd" in med:  # torch stages' compute against the JAX stages' (both resident)
        ratio["torch_vs_jax_ondev_fwd"] = med["torch_ondev_fwd"] / med["ondev_fwd"]
        # against the floor of the computation the torch layers themselves are (nn.Linear's [out, in]
        # weights: cuBLAS runs their matmuls in another layout than the JAX layer's)
        floors["fwd_torch"] = max(med["torch_ondev_fwd"], W / bw["h2d"])
        ratio["torch_fwd_own_floor"] = med["torch_fwd"] / floors["fwd_torch"]
    if "torch_train_k3" in med:
        ratio["torch_fwd_k3"] = med["torch_fwd_k3"] / floors["fwd"]
        ratio["torch_train_k3"] = med["torch_train_k3"] / floors["train"]
    if "torch_train_nt" in med:  # nn.Linear weights in torch's [out, in] layout
        ratio["torch_fwd_nt"] = med["torch_fwd_nt"] / floors["fwd"]
        ratio["torch_train_nt"] = med["torch_train_nt"] / floors["train"]
    if "torch_train_actoff" in med:  # activation offload: overhead against the same step without it
        ratio["actoff_overhead"] = med["torch_train_actoff"] / med["torch_train"]
    out = {"shape": raw["shape"], "median_s": med, "floor_s": floors, "ratio": ratio,
           "bw_GBps": {k_: v / 1e9 for k_, v in bw.items()}}
    if "bw_torch_stack" in raw:
        out["bw_GBps_torch_stack"] = {k_: v / 1e9 for k_, v in raw["bw_torch_stack"].items()}
    return out


def analyze_anchor(anchor: dict, ours_s: float, ours_devstate_s: float) -> dict:
    """Whole-step ratio anchor / xla_swap (pure)."""
    if "error" in anchor or "step_s" not in anchor:
        return {"error": anchor.get("error", "no step_s")}
    return {"step_s": anchor["step_s"], "speedup_of_xla_swap": anchor["step_s"] / ours_s,
            "speedup_devstate": anchor["step_s"] / ours_devstate_s,
            "optimizer": anchor.get("optimizer", "torch AdamW (foreach)")}


def render(results: list[dict], anchors: dict) -> str:
    """The markdown table of ``analyze`` results and anchors."""
    lines = ["| shape D,F,L,T | torch fwd / floor | JAX fwd / floor | torch/JAX fwd | torch train / floor | "
             "JAX train / floor | torch/JAX train | torch AdamW step / floor (median s) | "
             "AdamW, moments on device / floor (median s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for a in results:
        r, m = a["ratio"], a["median_s"]
        lines.append(f"| {','.join(map(str, a['shape']))} | {r['torch_fwd']:.3f}x | {r['jax_fwd']:.3f}x | "
                     f"{r['torch_vs_jax_fwd']:.3f} | {r['torch_train']:.3f}x | {r['jax_train']:.3f}x | "
                     f"{r['torch_vs_jax_train']:.3f} | {r['torch_adamw']:.3f}x ({m['torch_adamw']:.3f} s) | "
                     f"{r['torch_adamw_devstate']:.3f}x ({m['torch_adamw_devstate']:.3f} s) |")
    diag = [a for a in results if "jax_fwd_nocarry" in a["ratio"]]
    if diag:
        lines += ["", "| shape D,F,L,T | JAX fwd, no cycle / floor | JAX train, no cycle / floor | "
                  "torch/JAX on-device fwd | torch fwd / its own floor | torch fwd - runtime call (ms) | "
                  "input conv (ms) | output conv (ms) | torch fwd k+1 / floor | torch train k+1 / floor |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for a in diag:
            r, m = a["ratio"], a["median_s"]
            lines.append(f"| {','.join(map(str, a['shape']))} | {r['jax_fwd_nocarry']:.3f}x | "
                         f"{r['jax_train_nocarry']:.3f}x | {r['torch_vs_jax_ondev_fwd']:.3f} | "
                         f"{r['torch_fwd_own_floor']:.3f}x | "
                         f"{1e3 * r['torch_fwd_conversion_s']:.1f} | {1e3 * m['torch_in_conv']:.2f} | "
                         f"{1e3 * m['torch_out_conv']:.2f} | {r['torch_fwd_k3']:.3f}x | {r['torch_train_k3']:.3f}x |")
    nt = [a for a in results if "torch_fwd_nt" in a["ratio"]]
    if nt:
        lines += ["", "| shape D,F,L,T | torch fwd, nn.Linear held [out, in] / floor | torch fwd, held [in, out] "
                  "(default) / floor | torch train, [out, in] / floor | torch train, [in, out] / floor |",
                  "|---|---|---|---|---|"]
        for a in nt:
            r = a["ratio"]
            lines.append(f"| {','.join(map(str, a['shape']))} | {r['torch_fwd_nt']:.3f}x | {r['torch_fwd']:.3f}x | "
                         f"{r['torch_train_nt']:.3f}x | {r['torch_train']:.3f}x |")
    for name, a in anchors.items():
        if "error" in a:
            lines.append(f"\n{name}: not measured ({a['error'][:200]})")
        else:
            lines.append(f"\n{name}: whole step {a['step_s']:.3f} s; xla_swap's whole step (AdamW, moments in "
                         f"pinned_host) is {a['speedup_of_xla_swap']:.1f}x faster; with the moments on the device "
                         f"{a['speedup_devstate']:.1f}x ({a['optimizer']})")
    return "\n".join(lines)


def run_anchor(name, shape, reps, timeout):
    D, F, L, T = shape
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "anchors.py"),
           "--anchor", name, "--shape", f"{D},{F},{L}", "--tokens", str(T), "--reps", str(reps)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    last = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not last:
        return {"error": f"rc {p.returncode}: {p.stderr[-800:]}"}
    return json.loads(last[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=_shape, nargs="+", default=[(8192, 32768, 8, 8192), (4096, 14336, 16, 16384)],
                   help="D,F,L,T ...")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--window", type=int, default=3,
                   help="calls per timed window (synced once at its end): the steady-state time per call")
    p.add_argument("--anchors", nargs="*", default=[], choices=["fsdp2", "deepspeed"],
                   help="anchors to run at the first shape, each in its own process")
    p.add_argument("--anchor-reps", type=int, default=2)
    p.add_argument("--anchor-timeout-s", type=int, default=300)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--render", default=None, help="re-render the table of a torch_stack.json, run nothing")
    p.add_argument("--anchor-files", nargs="*", default=[],
                   help="with --render: NAME=PATH of an anchors.py output (its last JSON line) to compare with")
    args = p.parse_args(argv)
    if args.render:
        data = json.load(open(args.render))
        results = [analyze(r) for r in data["raw"]]
        anchors = dict(data["anchors"])
        for spec in args.anchor_files:
            name, path = spec.split("=", 1)
            lines = [ln for ln in open(path).read().splitlines() if ln.startswith("{")]
            raw = json.loads(lines[-1]) if lines else {"error": f"no JSON line in {path}"}
            anchors[name] = analyze_anchor(raw, results[0]["median_s"]["torch_adamw"],
                                           results[0]["median_s"]["torch_adamw_devstate"])
        print(render(results, anchors))
        return 0
    raws = []
    for shape in args.shapes:
        t = time.perf_counter()
        raws.append(measure_shape(*shape, reps=args.reps, window=args.window))
        a = analyze(raws[-1])
        print(json.dumps({"shape": shape, "ratio": a["ratio"], "bw_GBps": a["bw_GBps"],
                          "wall_s": time.perf_counter() - t}), flush=True)
    results = [analyze(r) for r in raws]
    anchors = {}
    for name in args.anchors:
        raw = run_anchor(name, args.shapes[0], args.anchor_reps, args.anchor_timeout_s)
        print(json.dumps({"anchor": name, **{k: raw.get(k) for k in ("step_s", "forward_s", "optimizer_s",
                                                                       "optimizer", "error")}}), flush=True)
        anchors[name] = analyze_anchor(raw, results[0]["median_s"]["torch_adamw"],
                                           results[0]["median_s"]["torch_adamw_devstate"])
        anchors[name]["raw"] = raw
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "torch_stack.json"), "w") as f:
            json.dump({"raw": raws, "anchors": anchors, "argv": sys.argv}, f, indent=1)
    print(render(results, anchors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
