#!/usr/bin/env python
"""GPU benchmark: the 8-layer bf16 FFN stack of DESIGN.md, host-offloaded in several ways.

Stack: ``layer(h) = h + gelu(h @ a) @ b`` with ``a: (D, F)``, ``b: (F, D)`` in bfloat16;
D=8192, F=32768 gives 1 GiB of weights per layer, 8 GiB for 8 layers. Inputs ``(T, D)``
bfloat16 for T in ``--tokens`` (default 8192 32768). The reference figures (DESIGN.md,
one H200, jax 0.11.2): pinned H2D/D2H 54-55 GB/s each way, ~93 GB/s both at once;
on-device forward 100 ms / 416 ms, per-layer streaming 167 ms / 438 ms, floor 159 / 419 ms.

Variants (same weights and inputs, generated deterministically from ``--seed``):

* ``bandwidth``: pinned_host->device, device->pinned_host and both at once (GB/s = 1e9 B/s,
  median of ``--reps``), ``jax.device_put`` between memory kinds, ``--bw-mib`` buffers.
* ``on-device-loop`` / ``on-device-jit``: weights in device memory; a per-layer jitted
  function called in a Python loop / the whole stack in one jit. The faster median is the
  forward compute time.
* ``xla-in-graph``: stacked ``pinned_host`` params ``(L, D, F)``, ``lax.scan`` with a
  ``device_put`` of the layer's slice in the body.
* ``xla-in-graph-unrolled``: per-layer separate ``pinned_host`` buffers, Python-unrolled loop
  in one jit, ``device_put`` of each layer inside the jit.
* ``torch_xla-lowered``: the same stack written in torch, scanned by
  ``xla_swap.frontend.scan(..., policy=OffloadPolicy(params="host"))`` and lowered by torch_xla
  on CPU (``benchmarks/export_torch_xla_stack.py`` wrote the ``HloModuleProto`` + JSON sidecar
  to ``--artifacts-dir``), run by ``xla_swap.executors.PjrtExecutor`` with the stacked weights
  (the ``xla-in-graph`` buffers) in ``pinned_host`` and x on the device; ``put_all`` once,
  untimed. Skipped, with a note, when the artifact for (D, F, L, bf16, T) is missing. The
  markdown adds its ratio to ``xla-in-graph`` (the JAX-lowered module of the same stacked form).
* ``xla_swap-k1`` / ``xla_swap-k2``: ``xla_swap.executors.streaming.StreamingRuntime`` with
  prefetch depth 1 / 2 (``throttle=True``: the host waits, without any data transfer, for
  stage i-1 before issuing stage i+k's transfer, so device memory stays bounded).
  ``...-nothrottle`` rows let the host run ahead.
* ``train-on-device``: forward + backward, per-layer jitted forward and ``vjp`` executables
  (per-layer remat), weights and gradients in device memory (the compute reference).
* ``train-xla_swap-k1`` / ``-k2``: ``StreamingRuntime.train_step``, gradients to pinned_host.
* ``accelerate`` (``--accelerate``): HF accelerate ``cpu_offload`` on torch CUDA, forward
  at the smallest token count. torch is imported only there (torch_xla nowhere).

``--variants`` takes variant names and presets: ``forward`` (bandwidth + forward variants),
``train`` (bandwidth + training variants), ``in-graph`` (bandwidth, on-device-loop,
xla-in-graph, torch_xla-lowered: the torch_xla-vs-JAX comparison alone), ``extras``, ``all``
(everything but accelerate, the default).

Weights: generated once per run by a separate ``weights`` subprocess (jax.random on the device,
one layer matrix per jitted call) into a cache of two ``.npy`` files in ``/dev/shm`` (else the
run's temporary directory; ``--no-weight-cache`` turns it off); every variant process maps
them (``np.load(mmap_mode="r")``) instead of generating 8 GiB itself (~10 s each before).
The values do not depend on the cache: both paths draw the same 64 MiB chunks of one key.

Floors: forward = max(compute, W / H2D); training = max(train-on-device, 2W / H2D, W / D2H,
3W / both-ways aggregate bandwidth), W = weight bytes (forward and backward each bring
every layer in, gradients go out once). Correctness: max |x - ref| / max |ref| against
the on-device per-layer loop (bf16; ~1e-2 is the tolerance).

Peak device memory: jax cannot reset ``peak_bytes_in_use``, so by default (``--isolate
process``) every (variant, tokens) runs in its own subprocess and gets its own peak
(it includes the input and the cotangent; without the weight cache also the 64 MiB
weight-generation chunks).
``--isolate none`` runs everything in one process: peaks are then cumulative high-water
marks and only ``bytes_in_use`` before/after are per variant.

Results: ``$OUT/gpu_stack.json`` and ``gpu_stack.md`` if env ``OUT`` is set, else
``benchmarks/results/``; saved after every variant, so a run cut short keeps what it did.
The markdown table is printed last.

Smoke test on CPU (ratios meaningless there: pinned_host and device are both host RAM)::

  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/gpu_stack.py --d 256 --f 512 --layers 4 \\
      --tokens 64 128 --reps 3
  # with the torch_xla variant: export small artifacts first (needs torch_xla), then
  PYTHONPATH=. PJRT_DEVICE=CPU python benchmarks/export_torch_xla_stack.py --d 256 --f 512 \\
      --layers 4 --tokens 64 128 --out-dir /tmp/xla_swap_artifacts
  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/gpu_stack.py --d 256 --f 512 --layers 4 \\
      --tokens 64 128 --reps 3 --variants in-graph --artifacts-dir /tmp/xla_swap_artifacts
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_torch_xla_stack import artifact_stem, load_artifact  # noqa: E402  (no torch imported)

GiB = 2 ** 30
MiB = 2 ** 20

FORWARD_CORE = ["on-device-loop", "on-device-jit", "xla_swap-k1", "xla_swap-k2",
                "xla-in-graph-unrolled", "xla-in-graph", "torch_xla-lowered"]
TRAIN_CORE = ["train-on-device", "train-xla_swap-k1", "train-xla_swap-k2"]
EXTRAS = ["xla_swap-k2-nothrottle", "train-xla_swap-k2-nothrottle"]
ALL_VARIANTS = ["bandwidth"] + FORWARD_CORE + TRAIN_CORE + EXTRAS + ["accelerate"]
PRESETS = {
    "forward": ["bandwidth"] + FORWARD_CORE,
    "train": ["bandwidth"] + TRAIN_CORE,
    "in-graph": ["bandwidth", "on-device-loop", "xla-in-graph", "torch_xla-lowered"],
    "extras": list(EXTRAS),
    "all": [v for v in ALL_VARIANTS if v != "accelerate"],
}
#: The stack's dtype as the torch_xla artifacts name it.
ARTIFACT_DTYPE = "bf16"
DEFAULT_ARTIFACTS = REPO / "benchmarks" / "artifacts"


def log(msg: str) -> None:
    print(f"[gpu_stack {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d", type=int, default=8192, help="model width D")
    p.add_argument("--f", type=int, default=32768, help="FFN width F")
    p.add_argument("--layers", type=int, default=8, help="number of layers L")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="token counts T")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bw-mib", type=int, default=None,
                   help="bandwidth buffer size in MiB (default min(1024, weight bytes))")
    p.add_argument("--variants", nargs="+", default=None, metavar="VARIANT|PRESET",
                   help="run only these variants / presets (default: all but accelerate; plus accelerate "
                        f"with --accelerate). Variants: {' '.join(ALL_VARIANTS)}. Presets: "
                        + "; ".join(f"{k} = {' '.join(v)}" for k, v in PRESETS.items()))
    p.add_argument("--accelerate", action="store_true", help="also run HF accelerate cpu_offload (torch CUDA)")
    p.add_argument("--isolate", choices=["process", "none"], default="process",
                   help="one subprocess per (variant, tokens) for per-variant peaks (default), or none")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip variants not started after this many seconds (keeps a GPU run under its limit)")
    p.add_argument("--child-timeout-s", type=float, default=120.0, help="limit for one subprocess")
    p.add_argument("--no-trace", action="store_true", help="skip the extra traced call of xla_swap variants")
    p.add_argument("--compile-cache", action="store_true",
                   help="share a persistent jax compilation cache between subprocesses (off by default: "
                        "cached executables with host memory kinds are less tested)")
    p.add_argument("--out-dir", default=None, help="default: $OUT, else benchmarks/results")
    p.add_argument("--artifacts-dir", default=str(DEFAULT_ARTIFACTS),
                   help="torch_xla-lowered protos + sidecars (benchmarks/export_torch_xla_stack.py); "
                        "default benchmarks/artifacts")
    p.add_argument("--no-weight-cache", action="store_true",
                   help="every variant process generates the weights itself (as before) instead of mapping "
                        "the run's shared .npy cache")
    # internal (subprocess mode)
    p.add_argument("--only", default=None, choices=ALL_VARIANTS + ["weights"], help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--weights-cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variants:
        wanted = []
        for v in args.variants:
            if v in PRESETS:
                wanted += PRESETS[v]
            elif v in ALL_VARIANTS:
                wanted.append(v)
            else:
                p.error(f"--variants: unknown {v!r}; variants: {', '.join(ALL_VARIANTS)}; "
                        f"presets: {', '.join(PRESETS)}")
        args.variants = list(dict.fromkeys(wanted))
    for name in ("d", "f", "layers", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if any(t < 1 for t in args.tokens):
        p.error("--tokens must be >= 1")
    return args


# ============================================================================ child side
class Bench:
    """State of one process: device, shardings, generated weights and inputs."""

    def __init__(self, args):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import SingleDeviceSharding

        self.jax, self.jnp, self.np = jax, jnp, np
        self.args = args
        self.dev = jax.devices()[0]
        self.DEV = SingleDeviceSharding(self.dev, memory_kind="device")
        self.HOST = SingleDeviceSharding(self.dev, memory_kind="pinned_host")
        self.L, self.D, self.F = args.layers, args.d, args.f
        self.weight_bytes = self.L * 2 * self.D * self.F * 2
        self._A = self._B = None
        self._host_w = None

        def layer(p, h):
            a, b = p
            return h + jax.nn.gelu(h @ a) @ b

        def bwd(p, h, g):
            _, vjp = jax.vjp(layer, p, h)
            gp, gh = vjp(g)
            return gh, gp

        self.layer = layer
        self.fwd_j = jax.jit(layer)
        self.bwd_j = jax.jit(bwd)

    # ---- data
    def mem(self):
        try:
            s = self.dev.memory_stats()
        except Exception:  # noqa: BLE001
            s = None
        return s or {}

    @staticmethod
    def _chunk_rows(rows, cols):
        chunk = max(1, min(rows, (64 * MiB) // (cols * 2)))
        while rows % chunk:
            chunk -= 1
        return chunk

    def _key(self, i, j):
        jax = self.jax
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.args.seed), i), j)

    def _scales(self):
        np = self.np
        return 1.0 / np.sqrt(self.D), 0.5 / np.sqrt(self.F)

    def _gen(self, arr, i, j, scale):
        """Fill numpy ``arr`` (rows, cols) bf16 with N(0, scale^2) in <= 64 MiB chunks on the device."""
        jax, np = self.jax, self.np
        rows, cols = arr.shape
        chunk = self._chunk_rows(rows, cols)
        gen = self._gen_fn(chunk, cols)
        key = self._key(i, j)
        for c in range(rows // chunk):
            arr[c * chunk:(c + 1) * chunk] = np.asarray(gen(jax.random.fold_in(key, c), scale))

    def _gen_matrix_fn(self, rows, cols):
        """One jitted call for a whole (rows, cols) matrix: the same values as the chunks of :meth:`_gen`."""
        jax, jnp = self.jax, self.jnp
        chunk = self._chunk_rows(rows, cols)
        n = rows // chunk

        def one(key, c, s):
            return (jax.random.normal(jax.random.fold_in(key, c), (chunk, cols), jnp.float32) * s).astype(jnp.bfloat16)

        return jax.jit(lambda k, s: jax.vmap(one, in_axes=(None, 0, None))(k, jnp.arange(n), s).reshape(rows, cols))

    def _cache_paths(self, cache_dir):
        tag = f"seed{self.args.seed}_L{self.L}_D{self.D}_F{self.F}"
        return Path(cache_dir) / f"A_{tag}.npy", Path(cache_dir) / f"B_{tag}.npy"

    def write_weight_cache(self, cache_dir) -> dict:
        """Generate the weights (one jitted call per layer matrix) into ``.npy`` files (uint16 bits of bf16)."""
        np = self.np
        t = time.perf_counter()
        sa, sb = self._scales()
        out = {}
        for j, (path, shape, scale) in enumerate(zip(self._cache_paths(cache_dir),
                                                      ((self.L, self.D, self.F), (self.L, self.F, self.D)),
                                                      (sa, sb))):
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint16, shape=shape)
            gen = self._gen_matrix_fn(shape[1], shape[2])
            for i in range(self.L):
                mm[i] = np.asarray(gen(self._key(i, j), scale)).view(np.uint16)
            mm.flush()
            del mm
            os.replace(tmp, path)
            out[path.name] = str(path)
        dt = time.perf_counter() - t
        log(f"wrote {self.weight_bytes / GiB:.2f} GiB of weights to {cache_dir} in {dt:.1f} s")
        return {"gen_s": dt, "files": out}

    def _gen_fn(self, rows, cols):
        jax, jnp = self.jax, self.jnp
        cache = self.__dict__.setdefault("_gen_cache", {})
        if (rows, cols) not in cache:
            cache[(rows, cols)] = jax.jit(
                lambda k, s: (jax.random.normal(k, (rows, cols), jnp.float32) * s).astype(jnp.bfloat16))
        return cache[(rows, cols)]

    def weights_np(self):
        """Per-layer numpy bf16 weights: A (L, D, F), B (L, F, D). Deterministic in --seed.

        Mapped read-only from the run's cache (``--weights-cache``) when it is there, else
        generated in this process in 64 MiB chunks.
        """
        if self._A is None:
            np, jnp = self.np, self.jnp
            t = time.perf_counter()
            cache = getattr(self.args, "weights_cache", None)
            paths = self._cache_paths(cache) if cache else None
            if paths and all(p.exists() for p in paths):
                A, B = (np.load(p, mmap_mode="r").view(jnp.bfloat16) for p in paths)
                log(f"mapped {self.weight_bytes / GiB:.2f} GiB of weights from {cache} "
                    f"in {time.perf_counter() - t:.1f} s")
            else:
                sa, sb = self._scales()
                A = np.empty((self.L, self.D, self.F), jnp.bfloat16)
                B = np.empty((self.L, self.F, self.D), jnp.bfloat16)
                for i in range(self.L):
                    self._gen(A[i], i, 0, sa)
                    self._gen(B[i], i, 1, sb)
                log(f"generated {self.weight_bytes / GiB:.2f} GiB of weights in {time.perf_counter() - t:.1f} s")
            self._A, self._B = A, B
        return self._A, self._B

    def stacked_host_weights(self):
        """Stacked ``pinned_host`` arrays A (L, D, F), B (L, F, D) (the in-graph variants' form)."""
        A, B = self.weights_np()
        SA = self.jax.device_put(A, self.HOST)
        SB = self.jax.device_put(B, self.HOST)
        return self.jax.block_until_ready((SA, SB))

    def host_weights(self):
        """Per-layer separate pinned_host buffers [(a, b)] * L."""
        if self._host_w is None:
            A, B = self.weights_np()
            self._host_w = [(self.jax.device_put(A[i], self.HOST), self.jax.device_put(B[i], self.HOST))
                            for i in range(self.L)]
            self.jax.block_until_ready(self._host_w)
        return self._host_w

    def device_weights(self):
        A, B = self.weights_np()
        w = [(self.jax.device_put(A[i], self.DEV), self.jax.device_put(B[i], self.DEV)) for i in range(self.L)]
        return self.jax.block_until_ready(w)

    def inputs(self, tokens):
        jax, jnp = self.jax, self.jnp
        key = jax.random.PRNGKey(self.args.seed + 10_000)
        x = jax.device_put(jax.random.normal(jax.random.fold_in(key, 0), (tokens, self.D), jnp.bfloat16), self.DEV)
        ct = jax.device_put(jax.random.normal(jax.random.fold_in(key, 1), (tokens, self.D), jnp.bfloat16), self.DEV)
        return jax.block_until_ready((x, ct))

    # ---- programs
    def ondev_forward(self, W, x):
        h = x
        for p in W:
            h = self.fwd_j(p, h)
        return h

    def ondev_train(self, W, x, ct):
        hs = [x]
        h = x
        for p in W:
            h = self.fwd_j(p, h)
            hs.append(h)
        out = hs.pop()
        g = ct
        grads = [None] * len(W)
        for i in reversed(range(len(W))):
            g, grads[i] = self.bwd_j(W[i], hs[i], g)
            hs[i] = None
        return out, g, grads

    def time_fn(self, fn):
        """Warm up, then time ``--reps`` calls; only the final block_until_ready syncs. Seconds."""
        jax = self.jax
        for _ in range(self.args.warmup):
            jax.block_until_ready(fn())
        times, out = [], None
        for _ in range(self.args.reps):
            out = None  # free the previous result before the next call
            t = time.perf_counter()
            out = fn()
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t)
        return times, out

    def rel_err(self, a, b) -> float:
        jnp, jax = self.jnp, self.jax
        a = jax.device_put(a, self.DEV).astype(jnp.float32)
        b = jax.device_put(b, self.DEV).astype(jnp.float32)
        return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def compiled_info(compiled) -> dict:
    info = {}
    try:
        m = compiled.memory_analysis()
        info["temp_bytes"] = int(m.temp_size_in_bytes)
        info["argument_bytes"] = int(m.argument_size_in_bytes)
        info["host_temp_bytes"] = int(getattr(m, "host_temp_size_in_bytes", 0))
    except Exception as e:  # noqa: BLE001
        info["memory_analysis_error"] = repr(e)
    try:
        text = compiled.as_text()
        info["copy_start_count"] = text.count("copy-start")
    except Exception:  # noqa: BLE001
        pass
    return info


def run_bandwidth(b: Bench) -> dict:
    jax, np = b.jax, b.np
    nbytes = (b.args.bw_mib * MiB) if b.args.bw_mib else min(GiB, max(MiB, b.weight_bytes))
    n = nbytes // 2
    buf = np.ones((n,), np.uint16)
    xh = jax.block_until_ready(jax.device_put(buf, b.HOST))
    xd = jax.block_until_ready(jax.device_put(buf, b.DEV))
    del buf

    def h2d():
        return jax.device_put(xh, b.DEV)

    def d2h():
        return jax.device_put(xd, b.HOST)

    def both():
        return jax.device_put(xh, b.DEV), jax.device_put(xd, b.HOST)

    out = {"bytes": int(n * 2)}
    for name, fn, moved in (("h2d", h2d, n * 2), ("d2h", d2h, n * 2), ("both", both, 2 * n * 2)):
        jax.block_until_ready(fn())  # first use allocates; time_fn adds --warmup more
        times, _ = b.time_fn(fn)
        out[name + "_times_s"] = times
        med = float(np.median(times))
        out[name + "_GBps"] = moved / med / 1e9
        log(f"bandwidth {name}: {out[name + '_GBps']:.2f} GB/s (median of {len(times)}, {moved / MiB:.0f} MiB)")
    return out


def run_variant(args, variant: str, tokens: int | None) -> dict:
    """Run one variant in this process; returns its result dict."""
    b = Bench(args)
    jax, np = b.jax, b.np
    res = {"variant": variant, "tokens": tokens, "device": getattr(b.dev, "device_kind", str(b.dev)),
           "platform": b.dev.platform, "jax_version": jax.__version__, "weight_bytes": b.weight_bytes}
    if variant == "bandwidth":
        res.update(run_bandwidth(b))
        return res
    if variant == "weights":
        res.update(b.write_weight_cache(args.weights_cache))
        return res
    if variant == "accelerate":
        return run_accelerate(b, tokens, res)
    artifact = None
    if variant == "torch_xla-lowered":  # before anything is generated: a missing artifact is a skip
        proto, meta = load_artifact(args.artifacts_dir, b.D, b.F, b.L, ARTIFACT_DTYPE, tokens)
        if proto is None:
            res["skipped"] = meta
            log(f"skip torch_xla-lowered T={tokens}: {meta}")
            return res
        meta["_file"] = artifact_stem(b.D, b.F, b.L, ARTIFACT_DTYPE, tokens) + ".hlo.pb"
        artifact = (proto, meta)

    x, ct = b.inputs(tokens)
    train = variant.startswith("train-")
    extra = {}
    if variant in ("on-device-loop", "train-on-device"):
        W = b.device_weights()
        fn = (lambda: b.ondev_train(W, x, ct)) if train else (lambda: b.ondev_forward(W, x))
        state = [W]
    elif variant == "on-device-jit":
        W = b.device_weights()
        compiled = jax.jit(b.ondev_forward).lower(W, x).compile()
        extra.update(compiled_info(compiled))
        fn = lambda: compiled(W, x)  # noqa: E731
        state = [W, compiled]
    elif variant == "xla-in-graph":
        SA, SB = b.stacked_host_weights()
        DEV = b.DEV

        def scanned(x, sa, sb):
            def body(h, ab):
                return b.layer(jax.device_put(ab, DEV), h), None
            return jax.lax.scan(body, x, (sa, sb))[0]

        compiled = jax.jit(scanned).lower(x, SA, SB).compile()
        extra.update(compiled_info(compiled))
        fn = lambda: compiled(x, SA, SB)  # noqa: E731
        state = [SA, SB, compiled]
    elif variant == "xla-in-graph-unrolled":
        HW = b.host_weights()
        DEV = b.DEV

        def unrolled(x, ws):
            h = x
            for p in ws:
                h = b.layer(jax.device_put(p, DEV), h)
            return h

        compiled = jax.jit(unrolled).lower(x, HW).compile()
        extra.update(compiled_info(compiled))
        fn = lambda: compiled(x, HW)  # noqa: E731
        state = [compiled]
    elif variant == "torch_xla-lowered":
        from xla_swap.executors import ParameterPlacement, PjrtExecutor

        proto, meta = artifact
        roles = meta["roles"]
        SA, SB = b.stacked_host_weights()
        t = time.perf_counter()
        exe = PjrtExecutor(proto, placements={roles["w1"]: ParameterPlacement("pinned_host"),
                                              roles["w2"]: ParameterPlacement("pinned_host"),
                                              roles["x"]: ParameterPlacement("device")})
        extra["compile_s"] = time.perf_counter() - t
        values = [None] * exe.num_parameters
        values[roles["w1"]], values[roles["w2"]], values[roles["x"]] = SA, SB, x
        placed = exe.put_all(values)  # untimed; the stacked host arrays are already placed (no copy)
        rep = exe.memory_report()
        text = exe.compiled_hlo_text()
        extra.update({"artifact": meta["_file"], "artifact_sha256": meta["sha256"], "roles": roles,
                      "put_all_copies": exe.transfer_count, "temp_bytes": rep.device_temp_bytes,
                      "parameter_memory_spaces": list(rep.parameter_memory_spaces),
                      "copy_start_count": text.count("copy-start"),
                      "torch_xla_version": meta.get("torch_xla_version")})
        log(f"torch_xla-lowered T={tokens}: {meta['_file']}, parameter spaces {list(rep.parameter_memory_spaces)}, "
            f"put_all copies {exe.transfer_count}, device temp {_gib(rep.device_temp_bytes)} GiB")
        fn = lambda: exe(*placed)[0]  # noqa: E731
        state = [exe, placed, SA, SB]
    elif "xla_swap" in variant:
        from xla_swap.executors.streaming import StreamingRuntime

        k = int(variant.split("-k")[1][0])
        throttle = not variant.endswith("-nothrottle")
        rt = StreamingRuntime(b.layer, b.host_weights(), prefetch_depth=k, device=b.dev,
                              throttle=throttle, track_residency=False)
        fn = (lambda: rt.train_step(x, cotangent=ct)) if train else (lambda: rt.forward(x))
        extra.update({"prefetch_depth": k, "throttle": throttle})
        state = [rt]
    else:
        raise ValueError(f"unknown variant {variant}")

    mem0 = b.mem()
    t = time.perf_counter()
    jax.block_until_ready(fn())  # compile (first call) + first run, untimed
    extra["first_call_s"] = time.perf_counter() - t
    times, out = b.time_fn(fn)
    mem1 = b.mem()
    res.update(extra)
    res.update({"times_s": times, "median_ms": float(np.median(times)) * 1e3, "min_ms": min(times) * 1e3,
                "peak_bytes": mem1.get("peak_bytes_in_use"), "bytes_in_use_before": mem0.get("bytes_in_use"),
                "bytes_in_use_after": mem1.get("bytes_in_use"), "bytes_limit": mem1.get("bytes_limit")})
    log(f"{variant} T={tokens}: median {res['median_ms']:.1f} ms, min {res['min_ms']:.1f} ms, "
        f"peak {_gib(res['peak_bytes'])} GiB")

    if "xla_swap" in variant:
        rt = state[0]
        temps = [m["temp_bytes"] for m in rt.executable_memory() if m["temp_bytes"] is not None]
        res["temp_bytes"] = max(temps) if temps else None
        if not args.no_trace:  # one extra, untimed call with event timestamps for a timeline plot
            out = None
            rt.trace = True
            out = jax.block_until_ready(fn())
            rt.trace = False
            res["trace"] = [dict(vars(e)) for e in rt.last_trace]

    # correctness against the on-device per-layer loop (after the peak was read)
    W = state[0] if variant in ("on-device-loop", "train-on-device", "on-device-jit") else None
    del fn
    state.clear()
    if W is None:
        W = b.device_weights()
    if train:
        r_out, r_gx, r_grads = b.ondev_train(W, x, ct)
        o_out, o_gx, o_grads = out
        res["rel_err_out"] = b.rel_err(o_out, r_out)
        res["rel_err_dx"] = b.rel_err(o_gx, r_gx)
        res["rel_err_grads"] = max(b.rel_err(o, r) for og, rg in zip(o_grads, r_grads) for o, r in zip(og, rg))
        res["grads_memory_kind"] = o_grads[0][0].sharding.memory_kind
        res["rel_err"] = max(res["rel_err_out"], res["rel_err_dx"], res["rel_err_grads"])
    else:
        res["rel_err"] = b.rel_err(out, b.ondev_forward(W, x))
    log(f"{variant} T={tokens}: max rel err vs on-device {res['rel_err']:.2e}")
    return res


def run_accelerate(b: Bench, tokens: int, res: dict) -> dict:
    """HF accelerate ``cpu_offload`` forward on torch CUDA (weights pageable, per-module hooks)."""
    try:
        import accelerate
        import torch
        from accelerate import cpu_offload
    except Exception as e:  # noqa: BLE001 - a jax-only machine
        res["skipped"] = f"torch/accelerate not importable: {e!r}"
        return res
    if not torch.cuda.is_available():
        res["skipped"] = "torch.cuda is not available"
        return res
    np = b.np
    x, _ = b.inputs(tokens)
    W = b.device_weights()
    ref = np.asarray(b.ondev_forward(W, x).astype(b.jnp.float32))
    x_np = np.asarray(x)
    del W, x
    A, B = b.weights_np()

    def t_bf16(a):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)

    class FFN(torch.nn.Module):
        def __init__(self, a, b_):
            super().__init__()
            self.a = torch.nn.Parameter(a, requires_grad=False)
            self.b = torch.nn.Parameter(b_, requires_grad=False)

        def forward(self, h):
            return h + torch.nn.functional.gelu(h @ self.a, approximate="tanh") @ self.b

    model = torch.nn.Sequential(*[FFN(t_bf16(np.array(A[i])), t_bf16(np.array(B[i]))) for i in range(b.L)])
    cuda = torch.device("cuda:0")
    cpu_offload(model, execution_device=cuda)
    xt = t_bf16(x_np).to(cuda)
    with torch.no_grad():
        for _ in range(b.args.warmup + 1):
            model(xt)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        y = None
        for _ in range(b.args.reps):
            y = None
            t = time.perf_counter()
            y = model(xt)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    y32 = y.float().cpu().numpy()
    res.update({"times_s": times, "median_ms": float(np.median(times)) * 1e3, "min_ms": min(times) * 1e3,
                "peak_bytes": int(torch.cuda.max_memory_allocated()),
                "peak_note": "torch.cuda.max_memory_allocated (torch allocator, not jax)",
                "torch_version": torch.__version__, "accelerate_version": accelerate.__version__,
                "rel_err": float(np.max(np.abs(y32 - ref)) / max(float(np.max(np.abs(ref))), 1e-30))})
    log(f"accelerate T={tokens}: median {res['median_ms']:.1f} ms, rel err {res['rel_err']:.2e}")
    return res


# ============================================================================ driver side
def _gib(x):
    return "-" if x is None else f"{x / GiB:.2f}"


def plan(args):
    """Ordered list of (variant, tokens); most important first (a budget cut drops the tail)."""
    wanted = args.variants or [v for v in ALL_VARIANTS if v != "accelerate"]
    if args.accelerate and "accelerate" not in wanted:
        wanted = wanted + ["accelerate"]
    out = []
    if "bandwidth" in wanted:
        out.append(("bandwidth", None))
    for group in (FORWARD_CORE, TRAIN_CORE, EXTRAS):
        for v in group:
            if v in wanted:
                out += [(v, t) for t in args.tokens]
    if "accelerate" in wanted:
        out.append(("accelerate", min(args.tokens)))
    return out


def child_argv(args, variant, tokens, result_file):
    argv = [sys.executable, str(Path(__file__).resolve()), "--d", str(args.d), "--f", str(args.f),
            "--layers", str(args.layers), "--reps", str(args.reps), "--warmup", str(args.warmup),
            "--seed", str(args.seed), "--only", variant, "--result-file", result_file]
    if tokens is not None:
        argv += ["--tokens", str(tokens)]
    if args.bw_mib:
        argv += ["--bw-mib", str(args.bw_mib)]
    if args.no_trace:
        argv.append("--no-trace")
    argv += ["--artifacts-dir", str(args.artifacts_dir)]
    if args.weights_cache:
        argv += ["--weights-cache", str(args.weights_cache)]
    return argv


def weight_cache_parent(nbytes: int, tmp: str):
    """``/dev/shm`` when it has room for the weights (+1 GiB), else ``tmp`` when it has, else None."""
    import shutil

    for d in ("/dev/shm", tmp):
        try:
            if os.path.isdir(d) and shutil.disk_usage(d).free >= nbytes + GiB:
                return d
        except OSError:
            continue
    return None


def make_weight_cache(args, data, tmp, stack) -> None:
    """Run the ``weights`` generator once (subprocess or in-process); sets ``args.weights_cache`` or leaves it None."""
    W = data["meta"]["weight_bytes"]
    parent = weight_cache_parent(W, tmp)
    info = {"parent": parent}
    data["meta"]["weight_cache"] = info
    if parent is None:
        info["note"] = "no room for a weight cache in /dev/shm or the temporary directory: every process generates"
        log(info["note"])
        return
    args.weights_cache = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu_stack_weights_", dir=parent))
    log(f"generating the weights once into {args.weights_cache}")
    if args.isolate == "process":
        res = run_isolated(args, "weights", None, tmp, None)
    else:
        try:
            res = run_variant(args, "weights", None)
        except Exception as e:  # noqa: BLE001
            res = {"error": repr(e)}
    info.update({k: res.get(k) for k in ("gen_s", "process_wall_s", "error") if res.get(k) is not None})
    if "error" in res:
        log("weight cache failed; every process generates its own weights")
        args.weights_cache = None


def run_isolated(args, variant, tokens, tmp, cache_dir) -> dict:
    result_file = os.path.join(tmp, f"{variant}-{tokens}.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cache_dir and "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    if variant == "accelerate":
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # leave GPU memory to torch
    t = time.perf_counter()
    try:
        p = subprocess.run(child_argv(args, variant, tokens, result_file), env=env,
                           timeout=args.child_timeout_s, stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    wall = time.perf_counter() - t
    if rc == 0 and os.path.exists(result_file):
        with open(result_file) as fh:
            res = json.load(fh)
    else:
        res = {"variant": variant, "tokens": tokens, "error": f"subprocess rc={rc}: {err[-2000:]}"}
        log(f"{variant} T={tokens} FAILED (rc={rc}): {err.strip().splitlines()[-1] if err.strip() else ''}")
    res["process_wall_s"] = wall
    return res


def compute_floors(data) -> None:
    """Add floor_ms and ratio to every timed result (medians)."""
    bw = data.get("bandwidth") or {}
    h2d, d2h, both = (bw.get(k) for k in ("h2d_GBps", "d2h_GBps", "both_GBps"))
    W = data["meta"]["weight_bytes"]
    floors = {}
    by = {(r["variant"], r.get("tokens")): r for r in data["results"]}
    for t in data["meta"]["tokens"]:
        comp = [by[(v, t)]["median_ms"] for v in ("on-device-loop", "on-device-jit")
                if (v, t) in by and "median_ms" in by[(v, t)]]
        f = {"compute_ms": min(comp) if comp else None,
             "h2d_ms": W / (h2d * 1e9) * 1e3 if h2d else None}
        f["forward_ms"] = max([v for v in (f["compute_ms"], f["h2d_ms"]) if v is not None], default=None)
        tr = by.get(("train-on-device", t), {}).get("median_ms")
        terms = [tr]
        if h2d:
            terms.append(2 * W / (h2d * 1e9) * 1e3)
        if d2h:
            terms.append(W / (d2h * 1e9) * 1e3)
        if both:
            terms.append(3 * W / (both * 1e9) * 1e3)
        f["train_compute_ms"] = tr
        f["train_ms"] = max([v for v in terms if v is not None], default=None)
        floors[str(t)] = f
    data["floors"] = floors
    for r in data["results"]:
        if "median_ms" not in r or r.get("tokens") is None:
            continue
        f = floors.get(str(r["tokens"]), {})
        floor = f.get("train_ms") if r["variant"].startswith("train-") else f.get("forward_ms")
        r["floor_ms"] = floor
        r["ratio"] = r["median_ms"] / floor if floor else None


def markdown(data) -> str:
    m = data["meta"]
    bw = data.get("bandwidth") or {}
    lines = [f"## gpu_stack: {m['layers']}-layer bf16 FFN stack, D={m['d']}, F={m['f']}, "
             f"{m['weight_bytes'] / GiB:.2f} GiB of weights",
             "",
             f"device: {m.get('device')} ({m.get('platform')}), jax {m.get('jax_version')}, {m['date']}, "
             f"isolate={m['isolate']}, reps={m['reps']}",
             ""]
    if bw.get("h2d_GBps"):
        lines += [f"pinned bandwidth ({bw['bytes'] / MiB:.0f} MiB buffers, median): H2D {bw['h2d_GBps']:.1f} GB/s, "
                  f"D2H {bw['d2h_GBps']:.1f} GB/s, both at once {bw['both_GBps']:.1f} GB/s (aggregate)", ""]
    lines += ["| variant | tokens | median ms | min ms | floor ms | x floor | peak dev GiB | in-use before/after GiB "
              "| temp GiB | max rel err | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        if r["variant"] == "bandwidth":
            continue
        note = r.get("error", "") or r.get("skipped", "")
        note = note.strip().splitlines()[-1][:80] if note else ""
        if "copy_start_count" in r:
            note = (note + f" copy-start={r['copy_start_count']}").strip()
        if r.get("grads_memory_kind"):
            note = (note + f" grads:{r['grads_memory_kind']}").strip()

        def f(x, fmt="{:.1f}"):
            return "-" if x is None else fmt.format(x)

        lines.append("| " + " | ".join([
            r["variant"], str(r.get("tokens", "")), f(r.get("median_ms")), f(r.get("min_ms")),
            f(r.get("floor_ms")), f(r.get("ratio"), "{:.2f}"), _gib(r.get("peak_bytes")),
            f"{_gib(r.get('bytes_in_use_before'))}/{_gib(r.get('bytes_in_use_after'))}",
            _gib(r.get("temp_bytes")), f(r.get("rel_err"), "{:.1e}"), note]) + " |")
    lines += torch_xla_vs_jax_lines(data)
    fl = data.get("floors", {})
    lines += ["", "Floors: forward = max(compute = min(on-device-loop, on-device-jit), W / H2D); training = "
              "max(train-on-device, 2W / H2D, W / D2H, 3W / both-ways), W = weight bytes."]
    for t, f in fl.items():
        lines.append(f"- T={t}: forward floor {_fmt(f.get('forward_ms'))} ms (compute {_fmt(f.get('compute_ms'))}, "
                     f"W/H2D {_fmt(f.get('h2d_ms'))}); training floor {_fmt(f.get('train_ms'))} ms")
    cached = bool((m.get("weight_cache") or {}).get("gen_s"))
    lines += ["", "Peak: " + ("each (variant, tokens) in its own process, so each peak is its own "
                              + ("(includes input and cotangent; weights mapped from a cache generated once)."
                                 if cached else "(includes input, cotangent and 64 MiB weight-generation chunks).")
                              if m["isolate"] == "process" else
                              "one process: peaks are cumulative high-water marks, not per variant."),
              "xla_swap rows throttle (host waits on stage i-1, no data transfer) unless -nothrottle; "
              "in-graph temp = compiled memory_analysis temp_size; rel err = max|x-ref|/max|ref| vs on-device loop."]
    if m.get("platform") == "cpu":
        lines.append("CPU run: pinned_host and device are both host RAM; ratios and bandwidths mean nothing.")
    return "\n".join(lines)


def _fmt(x):
    return "-" if x is None else f"{x:.1f}"


#: torch_xla-lowered must be within this fraction of the JAX-lowered xla-in-graph (issue target).
TORCH_XLA_TARGET = 0.02


def torch_xla_vs_jax_lines(data) -> list:
    """The line after the table: torch_xla-lowered / xla-in-graph medians per token count."""
    by = {(r["variant"], r.get("tokens")): r for r in data["results"]}
    parts = []
    for t in data["meta"]["tokens"]:
        tx, jx = by.get(("torch_xla-lowered", t)), by.get(("xla-in-graph", t))
        if not tx or not jx:
            continue
        if tx.get("median_ms") is None or jx.get("median_ms") is None:
            why = (tx.get("skipped") or tx.get("error") or jx.get("skipped") or jx.get("error") or "no timing")
            parts.append(f"T={t}: n/a ({why.strip().splitlines()[-1][:100]})")
            continue
        ratio = tx["median_ms"] / jx["median_ms"]
        ok = ratio <= 1 + TORCH_XLA_TARGET
        parts.append(f"T={t}: {ratio:.3f} ({tx['median_ms']:.1f} / {jx['median_ms']:.1f} ms; min/min "
                     f"{tx['min_ms'] / jx['min_ms']:.3f}) {'within' if ok else 'NOT within'} "
                     f"{TORCH_XLA_TARGET:.0%}")
    if not parts:
        return []
    return ["", "torch_xla-lowered / xla-in-graph (JAX-lowered, same stacked pinned_host form), median: "
            + "; ".join(parts) + "."]


def save(data, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    compute_floors(data)
    (out_dir / "gpu_stack.json").write_text(json.dumps(data, indent=1, default=str))
    (out_dir / "gpu_stack.md").write_text(markdown(data) + "\n")


def driver(args) -> None:
    import jax  # version only: the backend is not initialised in this process in isolate=process mode

    out_dir = Path(args.out_dir or os.environ.get("OUT") or REPO / "benchmarks" / "results")
    data = {"meta": {"command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
                     "argv": sys.argv, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                     "host": platform.node(), "python": platform.python_version(), "jax_version": jax.__version__,
                     "d": args.d, "f": args.f, "layers": args.layers, "tokens": args.tokens, "reps": args.reps,
                     "warmup": args.warmup, "seed": args.seed, "isolate": args.isolate,
                     "weight_bytes": args.layers * 2 * args.d * args.f * 2,
                     "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "JAX_PLATFORMS",
                                                            "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
                                                            "XLA_PYTHON_CLIENT_MEM_FRACTION")}},
            "bandwidth": None, "results": []}
    t0 = time.perf_counter()
    todo = plan(args)
    log(f"{len(todo)} runs planned, isolate={args.isolate}, results to {out_dir}")
    args.weights_cache = None
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu_stack_"))
        cache_dir = os.path.join(tmp, "jax_cache") if args.compile_cache else None
        for variant, tokens in todo:
            if variant != "bandwidth" and not args.no_weight_cache and "weight_cache" not in data["meta"]:
                make_weight_cache(args, data, tmp, stack)
            elapsed = time.perf_counter() - t0
            if elapsed > args.budget_s:
                data["results"].append({"variant": variant, "tokens": tokens,
                                        "skipped": f"time budget {args.budget_s:.0f} s used up"})
                log(f"skip {variant} T={tokens}: budget")
                continue
            log(f"run {variant} T={tokens} (elapsed {elapsed:.0f} s)")
            if args.isolate == "process":
                res = run_isolated(args, variant, tokens, tmp, cache_dir)
            else:
                try:
                    res = run_variant(args, variant, tokens)
                except Exception as e:  # noqa: BLE001 - keep going, record it
                    res = {"variant": variant, "tokens": tokens, "error": repr(e)}
                    log(f"{variant} T={tokens} FAILED: {e!r}")
            if "device" in res:
                data["meta"].setdefault("device", res["device"])
                data["meta"].setdefault("platform", res["platform"])
            if variant == "bandwidth":
                data["bandwidth"] = res
            else:
                data["results"].append(res)
            save(data, out_dir)
    data["meta"]["total_wall_s"] = time.perf_counter() - t0
    save(data, out_dir)
    log(f"done in {data['meta']['total_wall_s']:.0f} s; wrote {out_dir / 'gpu_stack.json'} and gpu_stack.md")
    print(markdown(data), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.only:
        tokens = args.tokens[0] if args.only not in ("bandwidth", "weights") else None
        res = run_variant(args, args.only, tokens)
        if args.result_file:
            Path(args.result_file).write_text(json.dumps(res, default=str))
        else:
            print(json.dumps(res, default=str, indent=1))
        return
    driver(args)


if __name__ == "__main__":
    main()
