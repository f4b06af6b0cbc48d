#!/usr/bin/env python
"""The torch entry point on N GPUs: ``SwappedStack`` over the FFN stack with FSDP and tensor-parallel
shardings, against its on-device rows, the floors of the same run, the 1-GPU rows (scaling)
and FSDP2 with ``CPUOffloadPolicy`` on the same N GPUs.

Stack (the one of ``torch_stack.py`` / ``anchors.py``): ``L`` layers
``h + b(gelu(a(h), approximate="tanh"))``, ``a = nn.Linear(D, F)``, ``b = nn.Linear(F, D)`` without
bias, bf16 (``--dtype float32`` allowed), input ``(T, D)``, loss ``mean(out.float()**2)``. Inputs are
torch tensors: CUDA tensors on the first GPU on a GPU machine (shared with jax through DLPack; each
call under ``torch.cuda.device`` of that GPU), CPU tensors elsewhere. Policy of every streamed row: weights, gradients and optimizer state in
``pinned_host``, ``remat=True``, ``prefetch_depth=k=2``, ``accumulate_grads=False`` (the gradients
stay in ``pinned_host`` as ``stack.last_grads``).

Shardings over the n devices (``--shardings``):

* ``fsdp``: ``shard="fsdp"``, ``data_parallel=True``: each weight split over the devices (each
  device's host shard in its own ``pinned_host``), the activations' token dimension split too
  (each device runs T/n tokens; XLA all-gathers each stage's weights on the device): FSDP / ZeRO-3.
* ``tp``: tensor parallel, ``shard=tp_spec`` (``a.weight`` [F, D] -> ``("d", None)``, ``b.weight``
  [D, F] -> ``(None, "d")``), ``data_parallel=False`` (activations replicated).

Rows (seconds; medians of ``--reps`` after one warm-up, each rep a window of ``--window``
back-to-back calls synced at its end, divided by the window; default 1: per-call latency):

* per sharding and T: ``fwd_rt`` (diagnostic: the stack's runtime called alone, a jax array on
  the first device in, the jax output out: ``fwd`` minus it is the entry point's conversions),
  ``out_conv`` (diagnostic: ``SwappedStack._out`` alone, the runtime's output to a torch tensor,
  gathered on the first GPU when split over several),
  ``ondev_fwd`` / ``ondev_train`` (the same stack with every stage resident in
  device memory and the gradients left there: ``OffloadPolicy(params="device", grads="device")``,
  the on-device compute; not ``budget_bytes=``, whose residency keeps the default ``grads="host"``
  and would put W/n of gradient copies into this row), ``fwd`` / ``train`` (streamed; ``train`` = ``stack.train_step(x, loss_fn)``
  then ``jax.block_until_ready(stack.last_grads)``);
* per T, once: ``fwd_1gpu`` / ``train_1gpu`` / ``fwd_rt_1gpu`` / ``out_conv_1gpu`` (the streamed rows on
  ``jax.devices()[:1]``, the scaling reference), ``ondev_fwd_1gpu`` / ``ondev_train_1gpu`` (its on-device rows, for the
  1-GPU floors; ``--no-ondev-1gpu`` drops them), ``fwd_1dev_plain`` / ``fwd_1dev_mesh`` (the JAX
  ``StreamingRuntime`` with the JAX-written layer on ``device=jax.devices()[0]`` against the same
  runtime with ``sharding=NamedSharding(<1-device mesh>, P())``: the sharded code path's
  overhead; timed alternately, rep by rep).
* bandwidths (bytes/s, aggregate over the devices, best of 3 moves of all the weights): ``n``:
  pinned_host -> device with every device pulling its own fsdp shards at once (``h2d``), device
  -> pinned_host (``d2h``), both at once (``both``, 2W moved); ``1``: the same on one device.

Floors (W = weight bytes, k = 2, ``kept`` = 2k+2 stages kept on the device at the turns of a step:
k+1 forward to backward, k+1 backward to the next forward; per-GPU bandwidths ``bw / n``; each
device moves its own W/n):
forward ``max(ondev_fwd, (W/n) / h2d)``; training ``max(ondev_train, w_in / h2d, (W/n) / d2h,
(w_in + W/n) / both)`` with ``w_in = (2L - kept)/L * W/n``. The 1-GPU floors: the same with n=1,
the 1-GPU bandwidths and the 1-GPU on-device rows (transfer terms only when those were not run).

Ratios: ``fwd / floor``, ``train / floor``; scaling ``t_1gpu / t_ngpu`` (forward and training);
``fwd_1dev_mesh / fwd_1dev_plain``; the anchor's times over the xla_swap training row (fsdp
sharding at the first T: a training step without optimizer, gradients into ``pinned_host``)
for FSDP2's forward+backward (like for like) and FSDP2's whole step (with its host AdamW).
Targets (``TARGETS``): forward <= 1.05x, training <= 1.10x, scaling >= 1.85 on 2 GPUs
(0.925 n on n), mesh / plain <= 1.02.

    PYTHONPATH=. python3 benchmarks/multi_gpu.py --anchors fsdp2 --out-dir $OUT        # all GPUs
    python3 benchmarks/multi_gpu.py --render $OUT/multi_gpu.json                       # the table again
    XLA_FLAGS=--xla_force_host_platform_device_count=4 PJRT_DEVICE=CPU .venv/bin/python \\
        benchmarks/multi_gpu.py --gpus 4 --shape 64,128,2 --tokens 16 32 --reps 1     # CPU smoke test

Writes ``multi_gpu.json`` (``raw``: every sample, bandwidths, byte counts, the anchor's line;
``analysis``) into ``--out-dir`` only (nothing when not given) and prints one JSON line per row
as it goes, the table at the end and the total wall time. Anchors run first, before jax takes
the GPUs' memory. ``analyze`` is a pure function of
the raw dict; ``render`` of the analysis.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

from anchors import FFNLayer
from anchors import _shape as _shape3  # D,F,L
from torch_stack import _interleaved, _rand, _timeit, measure_bandwidth

#: Targets: forward and training over their floors (at most), scaling at n=2 (at least; 0.925 n
#: on n GPUs), the one-device mesh over the plain device path (at most).
TARGETS = {"fwd": 1.05, "train": 1.10, "scaling": 1.85, "mesh": 1.02}
SHARDINGS = ("fsdp", "tp")
_ROWS = ("ondev_fwd", "ondev_train", "fwd", "train", "fwd_rt", "out_conv")
_ROWS_1GPU = ("fwd_1gpu", "train_1gpu", "fwd_rt_1gpu", "out_conv_1gpu", "ondev_fwd_1gpu", "ondev_train_1gpu", "fwd_1dev_plain",
              "fwd_1dev_mesh")


def tp_spec(name: str, shape: tuple) -> tuple:
    """Tensor-parallel ``PartitionSpec`` of one FFN weight over the mesh axis ``"d"``.

    ``a.weight`` [F, D] -> ``("d", None)`` (column-parallel: each device computes F/n of the
    hidden units), ``b.weight`` [D, F] -> ``(None, "d")`` (row-parallel: partial sums reduced
    by XLA); anything else replicated (``()``).
    """
    if name.endswith("a.weight"):
        return ("d", None)
    if name.endswith("b.weight"):
        return (None, "d")
    return ()


def make_layers(D: int, F: int, L: int, dtype: str = "bfloat16", seed: int = 0) -> list:
    """``L`` ``anchors.FFNLayer`` torch modules (CPU) with weights N(0, 0.02^2) drawn by
    ``torch_stack._rand`` (numpy, fast: a random block tiled along the columns)."""
    import jax.numpy as jnp
    import torch

    from xla_swap.stack.torch_bridge import to_torch as _to_torch

    np_dt = jnp.bfloat16 if dtype == "bfloat16" else np.float32
    t_dt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(L):
        m = FFNLayer(D, F, t_dt, "meta")
        m.a.weight = torch.nn.Parameter(_to_torch(_rand(rng, (F, D), np_dt)))
        m.b.weight = torch.nn.Parameter(_to_torch(_rand(rng, (D, F), np_dt)))
        layers.append(m)
    return layers


def _spec_json(sharding):
    """A sharding's PartitionSpec as a JSON list (None: replicated dim; a list: several mesh axes)."""
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return None
    return [e if e is None or isinstance(e, str) else list(e) for e in spec]


def measure(n: int, D: int, F: int, L: int, tokens, shardings=SHARDINGS, reps: int = 5, window: int = 1,
            k: int = 2, dtype: str = "bfloat16", ondev_1gpu: bool = True, seed: int = 0) -> dict:
    """Every xla_swap row on ``n`` devices and on one (see the module docstring): the raw dict.

    Returns ``{"n", "shape": [D, F, L], "tokens", "dtype", "k", "kept_at_turns", "weight_bytes"
    (W, bytes), "reps", "window", "platform", "device_kind", "cuda_inputs", "bw": {"n": ..., "1":
    ...} (aggregate bytes/s, see ``measure_bandwidth``), "bw_sharding", "rows": {sharding: {str(T):
    {row: [seconds, ...]}}, "1gpu": {str(T): {...}}}, "layout": {sharding: {"data_parallel", "specs"
    (each weight's PartitionSpec), "memory_kind"}}, "max_abs_diff_vs_1gpu": {sharding: the forward
    output at the first T against the 1-GPU stack's}, "mesh_vs_plain_max_abs_diff", "wall_s"}``.
    Prints one JSON line per row.
    """
    import jax
    import jax.numpy as jnp
    import torch
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from xla_swap.executors import Placement, RuntimeConfig, StreamingRuntime
    from xla_swap.planning import OffloadPolicy
    from xla_swap.stack import SwappedStack
    from xla_swap.stack.config import ParallelConfig, TrainingConfig
    from xla_swap.stack.torch_bridge import to_torch as _to_torch

    devs = jax.devices()
    if not 1 <= n <= len(devs):
        raise ValueError(f"--gpus {n}: jax sees {len(devs)} devices")
    for s in shardings:
        if s not in SHARDINGS:
            raise ValueError(f"unknown sharding {s!r}; one of {SHARDINGS}")
    t_start = time.perf_counter()
    np_dt = jnp.bfloat16 if dtype == "bfloat16" else np.float32
    layers = make_layers(D, F, L, dtype, seed)
    W = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
    cuda = torch.cuda.is_available()
    res = {"n": n, "shape": [D, F, L], "tokens": list(tokens), "dtype": dtype, "k": k, "kept_at_turns": 2 * k + 2,
           "weight_bytes": W, "reps": reps, "window": window, "platform": devs[0].platform,
           "device_kind": devs[0].device_kind, "cuda_inputs": cuda, "bw": {}, "rows": {}}
    rng = np.random.default_rng(seed + 1)
    xs_np = {T: (rng.standard_normal((T, D), dtype=np.float32) * 0.5).astype(np_dt) for T in tokens}
    # CUDA inputs on the runtime's first GPU, named explicitly: jax's GPU client leaves the thread's
    # current CUDA device wherever its set-up ended, and torch's DLPack export wants the tensor's
    # device current (every call runs under torch.cuda.device(cuda:<first>))
    tdev = torch.device("cuda", devs[0].local_hardware_id if devs[0].local_hardware_id is not None else 0) \
        if cuda else None
    on_dev0 = (lambda: torch.cuda.device(tdev)) if cuda else contextlib.nullcontext
    xs = {}
    for T, x in xs_np.items():
        xt = _to_torch(x)
        xs[T] = xt.to(tdev) if cuda else xt
    sync_t = (lambda _: torch.cuda.synchronize(tdev)) if cuda else (lambda _: None)
    jbr = jax.block_until_ready

    def tloss(o):
        return (o.float() ** 2).mean()

    def note(group, T, name):
        v = res["rows"][group][str(T)].get(name)
        print(json.dumps({"group": group, "tokens": T, "row": name,
                          "median_s": statistics.median(v) if v else None,
                          "elapsed_s": round(time.perf_counter() - t_start, 1)}), flush=True)

    def rows_of(group, T):
        return res["rows"].setdefault(group, {}).setdefault(str(T), {})

    T0 = tokens[0]
    ref = {}  # the 1-GPU streamed forward output at the first T (float32 numpy)
    res["max_abs_diff_vs_1gpu"] = {}

    def compare(st, group):
        """The stack's forward output at the first T against the 1-GPU stack's (max abs difference)."""
        with on_dev0():
            out = st(xs[T0]).float().cpu().numpy()
        if "1gpu" not in ref:
            ref["1gpu"] = out
            res["output_max_abs"] = float(np.abs(out).max())
        else:
            res["max_abs_diff_vs_1gpu"][group] = float(np.abs(out - ref["1gpu"]).max())

    def run_stack(st, group, prefix="", suffix=""):
        """fwd and train rows of one stack at every T."""
        if not prefix:
            compare(st, group)
        for T in tokens:
            x = xs[T]

            def fwd():
                with on_dev0():
                    return st(x)

            def train():
                st.trainer.last_grads = None  # the previous step's gradients go first: their buffers are reused
                with on_dev0():
                    st.train_step(x, loss_fn=tloss)
                return st.last_grads
            r = rows_of(group, T)
            r[f"{prefix}fwd{suffix}"] = _timeit(fwd, reps, sync=sync_t, window=window)
            note(group, T, f"{prefix}fwd{suffix}")
            if not prefix:  # diagnostic: the runtime alone, a jax array on the first device in, jax out
                xj = jax.device_put(xs_np[T], devs[0])
                r[f"fwd_rt{suffix}"] = _timeit(lambda: st.runtime.forward((xj, {})), reps, sync=jbr, window=window)
                note(group, T, f"fwd_rt{suffix}")
                y = jbr(st.runtime.forward((xj, {})))  # and the output conversion alone (jax -> torch)
                out_dev = x.device if cuda else None  # the entry point returns on the input's GPU
                r[f"out_conv{suffix}"] = _timeit(lambda: st._out(y, out_dev), reps, sync=sync_t, window=window)
                note(group, T, f"out_conv{suffix}")
                del y
            r[f"{prefix}train{suffix}"] = _timeit(train, reps, sync=jbr, window=window)
            note(group, T, f"{prefix}train{suffix}")
            st.trainer.last_grads = None

    pol = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=True, prefetch_depth=k)
    ondev = OffloadPolicy(params="device", grads="device", optimizer_state="device", remat=True, prefetch_depth=k)

    # ---- one device: the scaling reference, its bandwidths and floors' compute ----
    st = SwappedStack(layers, policy=pol, parallel=ParallelConfig(devices=devs[:1]),
                      training=TrainingConfig(accumulate_grads=False))
    res["bw"]["1"] = measure_bandwidth(st.runtime.host_params)
    print(json.dumps({"bandwidth": "1", **res["bw"]["1"]}), flush=True)
    run_stack(st, "1gpu", suffix="_1gpu")
    st = None  # free its buffers before the next stack
    gc.collect()
    if ondev_1gpu:
        st = SwappedStack(layers, policy=ondev, parallel=ParallelConfig(devices=devs[:1]),
                          training=TrainingConfig(accumulate_grads=False))
        assert all(st.runtime.resident)
        run_stack(st, "1gpu", prefix="ondev_", suffix="_1gpu")
        st = None
        gc.collect()

    # ---- the sharded code path on a one-device mesh against the plain device path (JAX layer) ----
    def stage_jax(w, h):
        return h + jax.nn.gelu(h @ w["a"], approximate=True) @ w["b"]

    wj = [{"a": _rand(rng, (D, F), np_dt), "b": _rand(rng, (F, D), np_dt)} for _ in range(L)]
    mesh1 = NamedSharding(Mesh(np.array(devs[:1]), ("d",)), PartitionSpec())
    rt_plain = StreamingRuntime(stage_jax, wj, RuntimeConfig(prefetch_depth=k, track_residency=False),
                                placement=Placement(device=devs[0]))
    rt_mesh = StreamingRuntime(stage_jax, wj, RuntimeConfig(prefetch_depth=k, track_residency=False),
                               placement=Placement(sharding=mesh1))
    del wj
    for T in tokens:
        xp, xm = jax.device_put(xs_np[T], devs[0]), jax.device_put(xs_np[T], mesh1)
        r = rows_of("1gpu", T)
        r.update(_interleaved({"fwd_1dev_plain": lambda: rt_plain.forward(xp),
                               "fwd_1dev_mesh": lambda: rt_mesh.forward(xm)}, reps, jbr, window))
        if T == T0:
            res["mesh_vs_plain_max_abs_diff"] = float(np.abs(np.asarray(rt_mesh.forward(xm), np.float32)
                                                             - np.asarray(rt_plain.forward(xp), np.float32)).max())
        note("1gpu", T, "fwd_1dev_plain")
        note("1gpu", T, "fwd_1dev_mesh")
    rt_plain = rt_mesh = None
    gc.collect()

    # ---- n devices, per sharding: streamed, then on-device ----
    for s in shardings:
        split = dict(shard="fsdp", data_parallel=True) if s == "fsdp" else dict(shard=tp_spec, data_parallel=False)
        st = SwappedStack(layers, policy=pol, parallel=ParallelConfig(devices=devs[:n], **split),
                          training=TrainingConfig(accumulate_grads=False))
        hp = st.runtime.host_params[0]
        res.setdefault("layout", {})[s] = {
            "data_parallel": st.data_parallel,
            "specs": {name: _spec_json(hp[name].sharding) for name in sorted(hp)},  # of the host layout
            "held_transposed": sorted(st.transposed[0]),  # [in, out] on the host (transpose_linear)
            "memory_kind": hp["a.weight"].sharding.memory_kind}
        if "n" not in res["bw"] or s == "fsdp":  # each device pulling its own fsdp shards
            res["bw"]["n"] = measure_bandwidth(st.runtime.host_params)
            res["bw_sharding"] = s
            print(json.dumps({"bandwidth": "n", "sharding": s, **res["bw"]["n"]}), flush=True)
        run_stack(st, s)
        st = None
        gc.collect()
        st = SwappedStack(layers, policy=ondev, parallel=ParallelConfig(devices=devs[:n], **split),
                          training=TrainingConfig(accumulate_grads=False))
        assert all(st.runtime.resident)
        run_stack(st, s, prefix="ondev_")
        st = None
        gc.collect()
    res["wall_s"] = time.perf_counter() - t_start
    return res


def _floors(med: dict, W: float, L: int, kept: int, n: int, bw: dict, ondev: str = "ondev_{}") -> dict:
    """Forward and training floors (seconds) of one device count: per device W/n bytes at bw/n."""
    per = {k_: bw[k_] / n for k_ in ("h2d", "d2h", "both")}
    wn = W / n
    w_in = max(0, 2 * L - kept) / L * wn
    terms = {
        "fwd": {"compute": med.get(ondev.format("fwd"), 0.0), "h2d": wn / per["h2d"]},
        "train": {"compute": med.get(ondev.format("train"), 0.0), "h2d": w_in / per["h2d"],
                  "d2h": wn / per["d2h"], "both": (w_in + wn) / per["both"]},
    }
    out = {}
    for name, t in terms.items():
        bound = max(t, key=t.get)
        out[name] = t[bound]
        out[f"{name}_bound"] = bound
    return out


def analyze(raw: dict) -> dict:
    """Medians, floors, ratios, targets and the anchor of one ``measure`` raw dict (pure: JSON in, JSON out).

    Floors in seconds (see the module docstring), bandwidths in bytes/s (``bw``: aggregate and
    per GPU). ``checks`` lists every target with its value and ``met``.
    """
    n, (D, F, L), W = raw["n"], raw["shape"], raw["weight_bytes"]
    kept = raw.get("kept_at_turns", 2 * raw["k"])
    tokens = [str(T) for T in raw["tokens"]]
    shardings = [s for s in raw["rows"] if s != "1gpu"]
    med = {g: {T: {r: statistics.median(v) for r, v in rows.items()} for T, rows in by_t.items()}
           for g, by_t in raw["rows"].items()}
    bw_n, bw_1 = raw["bw"]["n"], raw["bw"]["1"]
    floors, ratio = {}, {}
    targets = {"fwd": TARGETS["fwd"], "train": TARGETS["train"], "scaling": TARGETS["scaling"] * n / 2,
               "mesh": TARGETS["mesh"]}
    checks = []

    def check(what, T, value, target, op):
        met = value <= target if op == "<=" else value >= target
        checks.append({"what": what, "tokens": int(T), "value": value, "target": target, "op": op, "met": met})

    one = med.get("1gpu", {})
    for T in tokens:
        m1 = one.get(T, {})
        f1 = _floors(m1, W, L, kept, 1, bw_1, ondev="ondev_{}_1gpu")
        floors.setdefault("1gpu", {})[T] = f1
        r1 = {"fwd": m1["fwd_1gpu"] / f1["fwd"], "train": m1["train_1gpu"] / f1["train"]}
        if "fwd_1dev_mesh" in m1:
            r1["mesh"] = m1["fwd_1dev_mesh"] / m1["fwd_1dev_plain"]
            check("1-device mesh / plain forward", T, r1["mesh"], targets["mesh"], "<=")
        ratio.setdefault("1gpu", {})[T] = r1
    for s in shardings:
        for T in tokens:
            m = med[s][T]
            f = _floors(m, W, L, kept, n, bw_n)
            floors.setdefault(s, {})[T] = f
            r = {"fwd": m["fwd"] / f["fwd"], "train": m["train"] / f["train"]}
            if T in one:
                r["scaling_fwd"] = one[T]["fwd_1gpu"] / m["fwd"]
                r["scaling_train"] = one[T]["train_1gpu"] / m["train"]
            ratio.setdefault(s, {})[T] = r
            check(f"{s} forward / floor", T, r["fwd"], targets["fwd"], "<=")
            check(f"{s} training / floor", T, r["train"], targets["train"], "<=")
            if "scaling_fwd" in r:
                check(f"{s} forward scaling (1 GPU / {n})", T, r["scaling_fwd"], targets["scaling"], ">=")
                check(f"{s} training scaling (1 GPU / {n})", T, r["scaling_train"], targets["scaling"], ">=")
    bw = {"aggregate": {k_: bw_n[k_] for k_ in ("h2d", "d2h", "both")},
          "per_gpu": {k_: bw_n[k_] / n for k_ in ("h2d", "d2h", "both")},
          "1gpu": {k_: bw_1[k_] for k_ in ("h2d", "d2h", "both")}, "sharding": raw.get("bw_sharding")}
    anchors = {}
    for name, a in raw.get("anchors", {}).items():
        anchors[name] = analyze_anchor(a, med, shardings, raw["tokens"])
    return {"n": n, "shape": raw["shape"], "tokens": raw["tokens"], "dtype": raw.get("dtype"), "weight_bytes": W,
            "k": raw["k"], "kept_at_turns": kept, "device_kind": raw.get("device_kind"), "median_s": med,
            "floor_s": floors, "ratio": ratio, "bw": bw, "targets": targets, "checks": checks, "anchors": anchors,
            "layout": raw.get("layout", {}), "max_abs_diff_vs_1gpu": raw.get("max_abs_diff_vs_1gpu", {}),
            "mesh_vs_plain_max_abs_diff": raw.get("mesh_vs_plain_max_abs_diff"),
            "output_max_abs": raw.get("output_max_abs")}


def analyze_anchor(anchor: dict, med: dict, shardings: list, tokens: list) -> dict:
    """An anchor's times over xla_swap's training row (pure).

    The xla_swap row: the ``fsdp`` sharding's ``train`` (else the first sharding's) at the anchor's
    token count (else the first T): a training step without optimizer, gradients into
    ``pinned_host``. ``fb_over_xla_swap_train``: anchor forward+backward / that row (like for
    like; > 1 means xla_swap is faster); ``step_over_xla_swap_train``: anchor whole step (with its
    optimizer) / that row; ``fwd_over_xla_swap_fwd``: anchor forward / xla_swap's ``fwd``.
    """
    if "error" in anchor or "step_s" not in anchor:
        return {"error": str(anchor.get("error", "no step_s"))[:2000]}
    s = "fsdp" if "fsdp" in shardings else shardings[0]
    T = str(anchor.get("T", tokens[0]))
    if T not in med.get(s, {}):
        return {"error": f"no xla_swap {s} rows at T={T}"}
    ours = med[s][T]
    out = {"world_size": anchor.get("world_size", 1), "tokens": int(T), "xla_swap_row": f"{s} train",
           "forward_s": anchor["forward_s"], "forward_backward_s": anchor["forward_backward_s"],
           "step_s": anchor["step_s"], "optimizer": anchor.get("optimizer"),
           "xla_swap_train_s": ours["train"], "xla_swap_fwd_s": ours["fwd"],
           "fb_over_xla_swap_train": anchor["forward_backward_s"] / ours["train"],
           "step_over_xla_swap_train": anchor["step_s"] / ours["train"],
           "fwd_over_xla_swap_fwd": anchor["forward_s"] / ours["fwd"]}
    if anchor.get("after_result"):   # every rank gave its result; a rank's exit after it (anchors.rank_verdict)
        out["after_result"] = anchor["after_result"]
    return out


def _bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _ms(s: float) -> str:
    return f"{1e3 * s:.1f}"


def render(a: dict) -> str:
    """The markdown tables of one ``analyze`` result (times in ms, ratios x, bandwidths GB/s)."""
    n = a["n"]
    shape = ",".join(map(str, a["shape"]))
    lines = [f"{n} x {a.get('device_kind')}, D,F,L = {shape}, {a.get('dtype')}, W = {_bytes(a['weight_bytes'])}, "
             f"k = {a['k']}", "",
             "| sharding | T | fwd ms | floor ms (bound) | fwd / floor | train ms | floor ms (bound) | train / floor | "
             "scaling fwd | scaling train | on-device fwd / train ms | runtime alone fwd ms | output conversion ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, by_t in a["ratio"].items():
        if s == "1gpu":
            continue
        for T, r in by_t.items():
            m, f = a["median_s"][s][T], a["floor_s"][s][T]
            sc = (f"{r['scaling_fwd']:.3f}", f"{r['scaling_train']:.3f}") if "scaling_fwd" in r else ("-", "-")
            lines.append(f"| {s} | {T} | {_ms(m['fwd'])} | {_ms(f['fwd'])} ({f['fwd_bound']}) | {r['fwd']:.3f}x | "
                         f"{_ms(m['train'])} | {_ms(f['train'])} ({f['train_bound']}) | {r['train']:.3f}x | "
                         f"{sc[0]} | {sc[1]} | {_ms(m['ondev_fwd'])} / {_ms(m['ondev_train'])} | "
                         f"{_ms(m['fwd_rt']) if 'fwd_rt' in m else '-'} | "
                         f"{_ms(m['out_conv']) if 'out_conv' in m else '-'} |")
    lines += ["", "| 1 GPU, T | fwd ms | floor ms (bound) | fwd / floor | train ms | floor ms (bound) | train / floor | "
              "1-device mesh / plain fwd (ms) | runtime alone fwd ms | output conversion ms |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for T, r in a["ratio"].get("1gpu", {}).items():
        m, f = a["median_s"]["1gpu"][T], a["floor_s"]["1gpu"][T]
        mesh = (f"{r['mesh']:.3f} ({_ms(m['fwd_1dev_mesh'])} / {_ms(m['fwd_1dev_plain'])})" if "mesh" in r else "-")
        lines.append(f"| {T} | {_ms(m['fwd_1gpu'])} | {_ms(f['fwd'])} ({f['fwd_bound']}) | {r['fwd']:.3f}x | "
                     f"{_ms(m['train_1gpu'])} | {_ms(f['train'])} ({f['train_bound']}) | {r['train']:.3f}x | {mesh} | "
                     f"{_ms(m['fwd_rt_1gpu']) if 'fwd_rt_1gpu' in m else '-'} | "
                     f"{_ms(m['out_conv_1gpu']) if 'out_conv_1gpu' in m else '-'} |")
    b = a["bw"]
    g = {k_: {x: v / 1e9 for x, v in d.items()} for k_, d in b.items() if isinstance(d, dict)}
    lines += ["", f"Pinned-host bandwidth, GB/s, {n} GPUs ({b.get('sharding')} shards) per GPU / aggregate: "
              f"H2D {g['per_gpu']['h2d']:.1f} / {g['aggregate']['h2d']:.1f}, D2H {g['per_gpu']['d2h']:.1f} / "
              f"{g['aggregate']['d2h']:.1f}, both {g['per_gpu']['both']:.1f} / {g['aggregate']['both']:.1f}; "
              f"1 GPU: H2D {g['1gpu']['h2d']:.1f}, D2H {g['1gpu']['d2h']:.1f}, both {g['1gpu']['both']:.1f}."]
    for s, lay in a.get("layout", {}).items():
        specs = ", ".join(f"{k_} P({', '.join(map(repr, v))})" if v is not None else f"{k_} one device"
                          for k_, v in lay["specs"].items())
        diff = a.get("max_abs_diff_vs_1gpu", {}).get(s)
        held = f" (held [in, out]: {', '.join(lay['held_transposed'])})" if lay.get("held_transposed") else ""
        lines.append(f"{s}: data_parallel={lay['data_parallel']}, {specs}{held} in {lay['memory_kind']}"
                     + (f"; forward output at T={a['tokens'][0]} vs 1 GPU: max abs diff {diff:.3g} "
                        f"(max abs output {a.get('output_max_abs') or 0:.3g})" if diff is not None else ""))
    if a.get("mesh_vs_plain_max_abs_diff") is not None:
        lines.append(f"1-device mesh vs plain forward output: max abs diff {a['mesh_vs_plain_max_abs_diff']:.3g}")
    lines += ["", "Targets:"]
    for c in a["checks"]:
        lines.append(f"- {c['what']}, T={c['tokens']}: {c['value']:.3f} (target {c['op']} {c['target']:.3f}): "
                     f"{'met' if c['met'] else '**missed**'}")
    for name, x in a.get("anchors", {}).items():
        if "error" in x:
            lines.append(f"\n{name}: not measured ({x['error'][:200]})")
        else:
            lines.append(f"\n{name} on {x['world_size']} GPUs, T={x['tokens']}: forward+backward "
                         f"{_ms(x['forward_backward_s'])} ms = {x['fb_over_xla_swap_train']:.2f}x xla_swap's "
                         f"{x['xla_swap_row']} ({_ms(x['xla_swap_train_s'])} ms, no optimizer, gradients to "
                         f"pinned_host); whole step with {x['optimizer']} {_ms(x['step_s'])} ms = "
                         f"{x['step_over_xla_swap_train']:.2f}x that row; forward {_ms(x['forward_s'])} ms = "
                         f"{x['fwd_over_xla_swap_fwd']:.2f}x xla_swap's fwd.")
            if x.get("after_result"):
                lines.append(f"(every rank gave its result, then the ranks exited with codes "
                             f"{x['after_result']['return_codes']}: stderr in the raw JSON)")
    return "\n".join(lines)


def run_anchor(name: str, n: int, shape, T: int, reps: int, timeout_s: float) -> dict:
    """``anchors.py --anchor NAME --world-size n`` at ``T`` tokens in a subprocess: its last JSON line.

    The subprocess gets its own process group, killed as a whole after ``timeout_s`` seconds (the
    ranks it started included). Returns ``{"error": ...}`` when it printed no JSON line.
    """
    D, F, L = shape
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "anchors.py"),
           "--anchor", name, "--shape", f"{D},{F},{L}", "--tokens", str(T), "--reps", str(reps),
           "--world-size", str(n), "--timeout-s", str(timeout_s)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the group of the process started here
        p.communicate()
        return {"error": f"timed out after {timeout_s} s"}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": f"rc {p.returncode}: {err[-800:]}"}
    return json.loads(lines[-1])


def _device_count() -> int:
    """Visible GPUs (torch's count, without starting jax's GPU client), else jax's device count."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    import jax
    return jax.device_count()


def main(argv=None) -> int:
    """The CLI (see the module docstring); returns the exit status (0)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=None, help="devices n (default: all visible)")
    p.add_argument("--shape", type=_shape3, default=(8192, 32768, 8), help="D,F,L")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--shardings", nargs="+", default=list(SHARDINGS), choices=SHARDINGS)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--window", type=int, default=1, help="calls per timed window (synced once at its end)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--no-ondev-1gpu", action="store_true", help="skip the 1-GPU on-device rows (1-GPU floors: "
                   "transfer terms only)")
    p.add_argument("--anchors", nargs="*", default=[], choices=["fsdp2"],
                   help="anchors on the same n GPUs at the first T, in a subprocess, before the xla_swap rows")
    p.add_argument("--anchor-reps", type=int, default=2)
    p.add_argument("--anchor-timeout-s", type=float, default=300)
    p.add_argument("--out-dir", default=None, help="write multi_gpu.json here (nothing written without it)")
    p.add_argument("--render", default=None, help="re-render the table of a multi_gpu.json, run nothing")
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(render(analyze(json.load(f)["raw"])))
        return 0
    t0 = time.perf_counter()
    n = args.gpus or _device_count()
    anchors = {}
    for name in args.anchors:  # first: jax has not claimed the GPUs' memory yet
        a = run_anchor(name, n, args.shape, args.tokens[0], args.anchor_reps, args.anchor_timeout_s)
        print(json.dumps({"anchor": name, **{k_: a.get(k_) for k_ in ("world_size", "T", "forward_s",
                                                                        "forward_backward_s", "step_s", "error")}}),
              flush=True)
        anchors[name] = a
    raw = measure(n, *args.shape, args.tokens, args.shardings, args.reps, args.window, dtype=args.dtype,
                  ondev_1gpu=not args.no_ondev_1gpu)
    raw["anchors"] = anchors
    raw["argv"] = sys.argv if argv is None else list(argv)
    analysis = analyze(raw)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "multi_gpu.json"), "w") as f:
            json.dump({"raw": raw, "analysis": analysis}, f, indent=1)
    print(render(analysis))
    print(f"total wall time {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
