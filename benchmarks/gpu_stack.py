#!/usr/bin/env python
"""GPU benchmark: the 8-layer bf16 FFN stack of docs/measured.md, host-offloaded in several ways.

Stack: ``layer(h) = h + gelu(h @ a) @ b`` with ``a: (D, F)``, ``b: (F, D)`` in bfloat16;
D=8192, F=32768 gives 1 GiB of weights per layer, 8 GiB for 8 layers. Inputs ``(T, D)``
bfloat16 for T in ``--tokens`` (default 8192 32768). The reference figures (docs/measured.md,
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
``out/`` (untracked; ``--out-dir benchmarks/results`` to update the committed results); saved after every variant, so a run cut short keeps what it did.
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

#: Process groups: one subprocess runs every member (they share the device-resident weights;
#: their peaks after the first member are high-water marks of the group).
GROUPS = {"on-device": ["on-device-loop", "on-device-jit"],
          "train-on-device-jit-all": ["train-on-device-jit", "train-on-device-saved-jit"]}
#: In order of priority (a --budget-s cut drops the tail).
FORWARD_CORE = ["on-device", "xla_swap-in-graph", "xla_swap-k2-chunked", "xla-in-graph", "torch_xla-lowered"]
TRAIN_CORE = ["train-on-device-jit-all", "train-xla_swap-k2-saved-chunked", "train-xla_swap-k2-saved"]
LATE = ["xla_swap-k3-chunked", "xla_swap-k2", "train-xla_swap-k2", "train-on-device"]
EXTRAS = ["xla_swap-k1", "xla-in-graph-unrolled", "xla_swap-k2-nothrottle",
          "train-xla_swap-k1", "train-xla_swap-k2-chunked", "train-xla_swap-k2-nothrottle"]
ALL_VARIANTS = ["bandwidth"] + FORWARD_CORE + TRAIN_CORE + ["accelerate"] + LATE + EXTRAS
#: XLA flag sets tried on the in-graph variants (unless ``--no-flag-search``): the program is
#: compiled again in the same process with these as ``compiler_options`` (DebugOptions, the
#: same names as the XLA_FLAGS flags) and timed as row ``variant@name``.
FLAG_SETS = {
    "pipelined": "--xla_gpu_enable_host_memory_offloading=true --xla_gpu_enable_pipelined_host_offloading=true",
    "lhs": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "all": "--xla_gpu_enable_host_memory_offloading=true --xla_gpu_enable_pipelined_host_offloading=true "
           "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_highest_priority_async_stream=true",
}
#: in-graph variants the flag search applies to.
IN_GRAPH = ["xla-in-graph", "xla_swap-in-graph"]
PRESETS = {
    "forward": ["bandwidth"] + FORWARD_CORE,
    "train": ["bandwidth"] + TRAIN_CORE,
    "in-graph": ["bandwidth", "on-device-loop", "xla-in-graph", "torch_xla-lowered"],
    "extras": list(EXTRAS),
    "all": ["bandwidth"] + FORWARD_CORE + TRAIN_CORE + ["accelerate"] + LATE,
}


def flag_options(flags: str) -> dict:
    """``"--a=true --b=1"`` -> ``{"a": True, "b": "1"}`` (compiler_options for ``Lowered.compile``)."""
    out = {}
    for item in flags.split():
        key, _, val = item.lstrip("-").partition("=")
        out[key] = {"true": True, "false": False}.get(val.lower(), val)
    return out
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
                   help="run only these variants / presets (default: the preset all). Variants: "
                        f"{' '.join(ALL_VARIANTS)} (groups: "
                        + "; ".join(f"{k} = {' '.join(v)}" for k, v in GROUPS.items()) + "). Presets: "
                        + "; ".join(f"{k} = {' '.join(v)}" for k, v in PRESETS.items()))
    p.add_argument("--no-flag-search", action="store_true",
                   help=f"do not time {' and '.join(IN_GRAPH)} again under each XLA flag set: "
                        + "; ".join(f"{k} = {v}" for k, v in FLAG_SETS.items()))
    p.add_argument("--chunks", nargs="+", default=["4"], metavar="SPEC",
                   help="column chunks of the first and last layer in the *-chunked and xla_swap-in-graph variants: "
                        "N (both ends, every token count) or TOKENS=FIRST,LAST per token count, e.g. "
                        "8192=1,2 32768=4,1 (chunk the last layer where the forward is transfer-bound: a shorter "
                        "drain; the first where it is compute-bound: a shorter fill; every extra chunk is one "
                        "more copy)")
    p.add_argument("--accelerate", action="store_true", help="also run HF accelerate cpu_offload (torch CUDA)")
    p.add_argument("--isolate", choices=["process", "none"], default="process",
                   help="one subprocess per variant (all token counts, ascending) for per-variant peaks "
                        "(default), or none")
    p.add_argument("--budget-s", type=float, default=500.0,
                   help="skip variants not started after this many seconds (keeps a GPU run under its limit)")
    p.add_argument("--child-timeout-s", type=float, default=150.0, help="limit for one subprocess")
    p.add_argument("--no-trace", action="store_true", help="skip the extra traced call of xla_swap variants")
    p.add_argument("--compile-cache", action="store_true",
                   help="share a persistent jax compilation cache between subprocesses (off by default: "
                        "cached executables with host memory kinds are less tested)")
    p.add_argument("--out-dir", default=None, help="default: $OUT, else out/ (untracked); pass benchmarks/results to update the committed results")
    p.add_argument("--artifacts-dir", default=str(DEFAULT_ARTIFACTS),
                   help="torch_xla-lowered protos + sidecars (benchmarks/export_torch_xla_stack.py); "
                        "default benchmarks/artifacts")
    p.add_argument("--no-weight-cache", action="store_true",
                   help="every variant process generates the weights itself (as before) instead of mapping "
                        "the run's shared .npy cache")
    # internal (subprocess mode)
    p.add_argument("--render", default=None, metavar="JSON",
                   help="only re-render gpu_stack.md (floors, targets, table) from a saved gpu_stack.json "
                        "into --out-dir (default: next to the JSON); runs nothing")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--weights-cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variants:
        wanted = []
        for v in args.variants:
            if v in PRESETS:
                wanted += PRESETS[v]
            elif v in ALL_VARIANTS or v in (m for g in GROUPS.values() for m in g):
                wanted.append(v)
            else:
                p.error(f"--variants: unknown {v!r}; variants: {', '.join(ALL_VARIANTS)}; "
                        f"presets: {', '.join(PRESETS)}")
        args.variants = list(dict.fromkeys(wanted))
    try:
        args.chunk_plan = parse_chunks(args.chunks, args.tokens)
    except ValueError as e:
        p.error(f"--chunks: {e}")
    for first, last in args.chunk_plan.values():
        if first < 1 or last < 1 or args.f % first or args.f % last:
            p.error(f"--chunks: chunk counts must be >= 1 and divide --f ({args.f}), got {args.chunks}")
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
        """Per-layer device-resident weights [(a, b)] * L (cached: loaded once per process)."""
        if getattr(self, "_dev_w", None) is None:
            A, B = self.weights_np()
            w = [(self.jax.device_put(A[i], self.DEV), self.jax.device_put(B[i], self.DEV)) for i in range(self.L)]
            self._dev_w = self.jax.block_until_ready(w)
        return self._dev_w

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
        info["output_bytes"] = int(m.output_size_in_bytes)
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
    """Time moving the stack's weight bytes W itself: H2D, D2H, and both at once.

    Buffers shaped like the weights (L x two per-layer matrices, separate ``pinned_host``
    / ``device`` buffers; ``--bw-mib`` instead uses one buffer of that size), all copies of
    a direction issued back to back, timed until all are done. ``*_GBps`` = bytes moved /
    median time; ``*_best_GBps`` = bytes / fastest time. The floors use the best figures:
    a floor must not be slower than what the link was seen to do (the median of a 1 GiB
    copy was measured at 45 GB/s on a host where the in-graph forward moved 8 GiB at 51.6).
    Values: zeros generated on the device (a device -> host copy makes the host copies).
    """
    jax, jnp = b.jax, b.jnp
    if b.args.bw_mib:
        shapes = [(b.args.bw_mib * MiB // 2,)]
    else:
        shapes = [s for _ in range(b.L) for s in ((b.D, b.F), (b.F, b.D))]
    dev = [jax.device_put(jnp.zeros(s, jnp.bfloat16), b.DEV) for s in shapes]
    host = jax.block_until_ready([jax.device_put(x, b.HOST) for x in dev])
    dev2 = jax.block_until_ready([jax.device_put(jnp.zeros(s, jnp.bfloat16), b.DEV) for s in shapes])
    nbytes = sum(int(x.size) * 2 for x in host)

    def h2d():
        return [jax.device_put(x, b.DEV) for x in host]

    def d2h():
        return [jax.device_put(x, b.HOST) for x in dev2]

    def both():
        return h2d(), d2h()

    out = {"bytes": nbytes, "buffers": len(shapes)}
    for name, fn, moved in (("h2d", h2d, nbytes), ("d2h", d2h, nbytes), ("both", both, 2 * nbytes)):
        jax.block_until_ready(fn())  # first use allocates; time_fn adds --warmup more
        times, _ = b.time_fn(fn)
        out[name + "_times_s"] = times
        out[name + "_GBps"] = moved / float(b.np.median(times)) / 1e9
        out[name + "_best_GBps"] = moved / min(times) / 1e9
        log(f"bandwidth {name}: median {out[name + '_GBps']:.2f} GB/s, best {out[name + '_best_GBps']:.2f} GB/s "
            f"({len(times)} x {moved / GiB:.2f} GiB in {len(shapes)} buffers)")
    return out


def parse_chunks(spec: list, tokens: list) -> dict:
    """``["4"]`` or ``["8192=1,2", "32768=4,1"]`` -> ``{T: (first, last)}`` for every T in ``tokens``.

    Raises: ValueError naming the bad item, or a token count without a chunk count.
    """
    if len(spec) == 1 and "=" not in spec[0]:
        n = int(spec[0])
        return {t: (n, n) for t in tokens}
    plan = {}
    for item in spec:
        t, _, fl = item.partition("=")
        try:
            first, last = (int(v) for v in fl.split(","))
            plan[int(t)] = (first, last)
        except ValueError:
            raise ValueError(f"expected N or TOKENS=FIRST,LAST, got {item!r}") from None
    missing = [t for t in tokens if t not in plan]
    if missing:
        raise ValueError(f"no chunk counts for token counts {missing}")
    return plan


def chunked_stages(b: Bench, W, chunks):
    """Stage list with the first and last layer split into column chunks over F.

    Inside a chunked layer the carry is ``(x, acc)``: the first chunk opens it
    (``x -> (x, x + gelu(x @ a_0) @ b_0)``), middle chunks add ``gelu(x @ a_c) @ b_c`` to
    ``acc``, the last closes it and returns one array again; whole layers take and return
    one array. The same function as the plain stack up to bf16 summation order. Smaller
    first and last transfers shorten the pipeline's start (32768 tokens: compute waits for
    the first transfer) and end (8192 tokens: the last layer's compute follows the last
    transfer). ``chunks`` = ``(first, last)`` counts (1: not split). Returns
    ``(stage_fns, stage_params)``; ``W`` = per-layer ``(a, b)`` arrays.
    """
    jax = b.jax

    def ffn(p, x):
        a, bb = p
        return jax.nn.gelu(x @ a) @ bb

    def opening(p, x):
        return x, x + ffn(p, x)

    def part(p, carry):
        x, acc = carry
        return x, acc + ffn(p, x)

    def closing(p, carry):
        x, acc = carry
        return acc + ffn(p, x)

    fns, params = [], []
    for i, (a, bb) in enumerate(W):
        n = chunks[0] if i == 0 else chunks[1] if i == len(W) - 1 else 1
        if n > 1:
            fc = b.F // n
            for c in range(n):
                fns.append(opening if c == 0 else closing if c == n - 1 else part)
                params.append((a[:, c * fc:(c + 1) * fc], bb[c * fc:(c + 1) * fc]))
        else:
            fns.append(b.layer)
            params.append((a, bb))
    return fns, params


def _base_variant(variant: str) -> str:
    """``name@flags`` (a flag-search row) -> ``name``."""
    return variant.partition("@")[0]


def run_variant(args, variant: str, tokens_list) -> list:
    """Run one variant for every token count (ascending) in this process; one result dict each."""
    b = Bench(args)
    jax = b.jax
    name = variant
    base = {"variant": variant, "device": getattr(b.dev, "device_kind", str(b.dev)),
            "platform": b.dev.platform, "jax_version": jax.__version__, "weight_bytes": b.weight_bytes,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if name == "bandwidth":
        return [dict(base, tokens=None, **run_bandwidth(b))]
    if name == "weights":
        return [dict(base, tokens=None, **b.write_weight_cache(args.weights_cache))]
    if name == "accelerate":
        return [run_accelerate(b, t, dict(base, tokens=t)) for t in tokens_list]
    out = []
    tokens_list = sorted(tokens_list)
    for j, member in enumerate(GROUPS.get(name, [name])):
        for i, tokens in enumerate(tokens_list):
            res = dict(base, variant=member, tokens=tokens, peak_is_cumulative=(i > 0 or j > 0), group_member=j)
            rows = []
            try:
                # the correctness check loads device weights: only after the last timed run
                rows = run_one(args, b, member, tokens, res, check=(i == len(tokens_list) - 1))
            except Exception as e:  # noqa: BLE001 - record, go on with the next token count
                res["error"] = f"{type(e).__name__}: {e}"
                log(f"{member} T={tokens} FAILED: {res['error'][:300]}")
            out += [res] + rows
    return out


def run_one(args, b: Bench, variant: str, tokens: int, res: dict, check: bool = True) -> list:
    """Time ``variant`` at ``tokens`` in this process, filling ``res`` (see the module docstring).

    ``check``: also compare with the on-device loop (loads the weights onto the device, so it
    runs after the timing and only for the last token count of a process). Returns extra
    rows: the XLA flag-set timings of the in-graph variants (``variant@set``).
    """
    jax, np = b.jax, b.np
    artifact = None
    if variant == "torch_xla-lowered":  # before anything is generated: a missing artifact is a skip
        proto, meta = load_artifact(args.artifacts_dir, b.D, b.F, b.L, ARTIFACT_DTYPE, tokens)
        if proto is None:
            res["skipped"] = meta
            log(f"skip torch_xla-lowered T={tokens}: {meta}")
            return []
        meta["_file"] = artifact_stem(b.D, b.F, b.L, ARTIFACT_DTYPE, tokens) + ".hlo.pb"
        artifact = (proto, meta)

    x, ct = b.inputs(tokens)
    hbytes = int(x.size) * x.dtype.itemsize
    train = variant.startswith("train-")
    extra = {}
    chunked = variant.endswith("-chunked")
    saved = "-saved" in variant
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    rt = None
    flagged = None  # in-graph variants: opts -> (compiled, call) under an XLA flag set
    if variant in ("on-device-loop", "train-on-device"):
        W = b.device_weights()
        fn = (lambda: b.ondev_train(W, x, ct)) if train else (lambda: b.ondev_forward(W, x))
        state = [W]
        one = (b.bwd_j.lower(W[0], x, ct) if train else b.fwd_j.lower(W[0], x)).compile()
        extra["layer_temp_bytes"] = compiled_info(one).get("temp_bytes")
    elif variant in ("on-device-jit", "train-on-device-jit", "train-on-device-saved-jit"):
        W = b.device_weights()
        if train:
            f = jax.checkpoint(b.layer, policy=policy if saved else jax.checkpoint_policies.nothing_saveable)

            def step(W, x, ct):
                def stack(W, h):
                    for p in W:
                        h = f(p, h)
                    return h
                y, vjp = jax.vjp(stack, W, x)
                gW, gx = vjp(ct)
                return y, gx, gW
            compiled = jax.jit(step).lower(W, x, ct).compile()
            fn = lambda: compiled(W, x, ct)  # noqa: E731
        else:
            compiled = jax.jit(b.ondev_forward).lower(W, x).compile()
            fn = lambda: compiled(W, x)  # noqa: E731
        extra.update(compiled_info(compiled))
        state = [W, compiled]
    elif variant == "xla-in-graph":
        SA, SB = b.stacked_host_weights()
        DEV = b.DEV

        def scanned(x, sa, sb):
            def body(h, ab):
                return b.layer(jax.device_put(ab, DEV), h), None
            return jax.lax.scan(body, x, (sa, sb))[0]

        lowered = jax.jit(scanned).lower(x, SA, SB)
        compiled = lowered.compile()
        extra.update(compiled_info(compiled))
        fn = lambda: compiled(x, SA, SB)  # noqa: E731
        state = [SA, SB, compiled]

        def flagged(opts):
            c = lowered.compile(compiler_options=opts)
            return c, (lambda: c(x, SA, SB))
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
    elif variant == "xla_swap-in-graph":
        from xla_swap.executors import InGraphRuntime

        fns, sp = chunked_stages(b, b.host_weights(), args.chunk_plan[tokens])
        igr = InGraphRuntime(fns, sp, device=b.dev)
        compiled = igr.compile(x)
        extra.update(compiled_info(compiled))
        extra.update({"stages": len(sp), "chunks": list(args.chunk_plan[tokens])})
        fn = lambda: igr.forward(x)  # noqa: E731
        state = [igr]

        def flagged(opts):
            r = InGraphRuntime(fns, igr.host_params, device=b.dev, compiler_options=opts)
            return r.compile(x), (lambda: r.forward(x))
    elif variant == "torch_xla-lowered":
        from export_torch_xla_stack import stack_policy
        from xla_swap.executors import PjrtExecutor

        proto, meta = artifact
        roles = meta["roles"]
        SA, SB = b.stacked_host_weights()
        t = time.perf_counter()
        exe = PjrtExecutor.from_policy(proto, stack_policy(), weights=[roles["w1"], roles["w2"]],
                                       parameters=len(roles))
        extra["compile_s"] = time.perf_counter() - t
        values = [None] * exe.num_parameters
        values[roles["w1"]], values[roles["w2"]], values[roles["x"]] = SA, SB, x
        placed = exe.put_all(values)  # untimed; the stacked host arrays are already placed (no copy)
        rep = exe.memory_report()
        text = exe.compiled_hlo_text()
        extra.update({"artifact": meta["_file"], "artifact_sha256": meta["sha256"], "roles": roles,
                      "put_all_copies": exe.transfer_count, "temp_bytes": rep.device_temp_bytes,
                      "output_bytes": rep.device_output_bytes,
                      "parameter_memory_spaces": list(rep.parameter_memory_spaces),
                      "copy_start_count": text.count("copy-start"),
                      "torch_xla_version": meta.get("torch_xla_version")})
        log(f"torch_xla-lowered T={tokens}: {meta['_file']}, parameter spaces {list(rep.parameter_memory_spaces)}, "
            f"put_all copies {exe.transfer_count}, device temp {_gib(rep.device_temp_bytes)} GiB")
        fn = lambda: exe(*placed)[0]  # noqa: E731
        state = [exe, placed, SA, SB]
    elif "xla_swap-k" in variant:
        from xla_swap.executors.streaming import StreamingRuntime

        k = int(variant.split("-k")[1][0])
        throttle = not variant.endswith("-nothrottle")
        plan_c = args.chunk_plan[tokens] if chunked else (1, 1)
        fns, sp = chunked_stages(b, b.host_weights(), plan_c) if chunked else (b.layer, b.host_weights())
        rt = StreamingRuntime(fns, sp, prefetch_depth=k, device=b.dev, throttle=throttle,
                              track_residency=False, remat=policy if saved else True)
        fn = (lambda: rt.train_step(x, cotangent=ct)) if train else (lambda: rt.forward(x))
        extra.update({"prefetch_depth": k, "throttle": throttle, "stages": rt.num_stages,
                      "remat": "dots_with_no_batch_dims_saveable" if saved else "per-stage recompute",
                      "chunks": list(plan_c)})
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
                "bytes_in_use_after": mem1.get("bytes_in_use"), "bytes_limit": mem1.get("bytes_limit"),
                "activation_bytes": hbytes})
    log(f"{variant} T={tokens}: median {res['median_ms']:.1f} ms, min {res['min_ms']:.1f} ms, "
        f"peak {_gib(res['peak_bytes'])} GiB")

    if rt is not None:
        mems = rt.executable_memory()
        temps = [m["temp_bytes"] for m in mems if m["temp_bytes"] is not None]
        res["temp_bytes"] = max(temps) if temps else None
        res["stage_nbytes"] = rt.stage_nbytes
        res["stage_input_nbytes"] = rt.stage_input_nbytes()
        # per-stage temporaries of the executables this call used (forward / backward)
        stage_temp = {"forward": [0] * rt.num_stages, "backward": [0] * rt.num_stages}
        for m in mems:
            which = "backward" if m["kind"].startswith("backward") else "forward"
            for st in m["stages"]:
                stage_temp[which][st] = max(stage_temp[which][st], m["temp_bytes"] or 0)
        res["stage_temp_bytes"] = stage_temp
        res["residual_nbytes"] = list(rt.residual_nbytes) if train else [0] * rt.num_stages
        if not args.no_trace:  # one extra, untimed call with event timestamps for a timeline plot
            out = None
            rt.trace = True
            out = jax.block_until_ready(fn())
            rt.trace = False
            res["trace"] = [dict(vars(e)) for e in rt.last_trace]
    res.update(predict_peak(res, variant, b, train))

    rows = []
    if flagged is not None and not args.no_flag_search and tokens == min(args.tokens):
        for fname, flags in FLAG_SETS.items():
            row = {k: v for k, v in res.items() if k in ("device", "platform", "jax_version", "weight_bytes",
                                                          "tokens", "activation_bytes")}
            row.update({"variant": f"{variant}@{fname}", "xla_flags": flags, "peak_is_cumulative": True})
            try:
                c, ffn = flagged(flag_options(flags))
                row.update(compiled_info(c))
                jax.block_until_ready(ffn())
                ftimes, _ = b.time_fn(ffn)
                row.update({"times_s": ftimes, "median_ms": float(np.median(ftimes)) * 1e3,
                            "min_ms": min(ftimes) * 1e3})
                log(f"{row['variant']} T={tokens}: median {row['median_ms']:.1f} ms, "
                    f"copy-start={row.get('copy_start_count')}")
                del c, ffn
            except Exception as e:  # noqa: BLE001 - an option this XLA does not know
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"{row['variant']} T={tokens} FAILED: {row['error']}")
            rows.append(row)
        flagged = None

    if not check:
        return rows
    # correctness against the on-device per-layer loop (after the peak was read)
    W = state[0] if variant in ("on-device-loop", "train-on-device", "on-device-jit", "train-on-device-jit",
                                "train-on-device-saved-jit") else None
    del fn
    state.clear()
    rt = None
    if W is None:
        W = b.device_weights()
    if train:
        r_out, r_gx, r_grads = b.ondev_train(W, x, ct)
        o_out, o_gx, o_grads = out
        if chunked:  # per-stage gradients: concatenate the chunks of the first and last layer back
            o_grads = _merge_chunk_grads(b, o_grads, args.chunk_plan[tokens])
        res["rel_err_out"] = b.rel_err(o_out, r_out)
        res["rel_err_dx"] = b.rel_err(o_gx, r_gx)
        res["rel_err_grads"] = max(b.rel_err(o, r) for og, rg in zip(o_grads, r_grads) for o, r in zip(og, rg))
        res["grads_memory_kind"] = o_grads[0][0].sharding.memory_kind
        res["rel_err"] = max(res["rel_err_out"], res["rel_err_dx"], res["rel_err_grads"])
    else:
        res["rel_err"] = b.rel_err(out, b.ondev_forward(W, x))
    log(f"{variant} T={tokens}: max rel err vs on-device {res['rel_err']:.2e}")
    return rows


def _merge_chunk_grads(b: Bench, grads, chunks):
    """Per-stage gradients of ``chunked_stages(chunks=(first, last))`` back to per-layer ``(da, db)``."""
    jnp = b.jnp
    out, i = [], 0
    for layer in range(b.L):
        n = chunks[0] if layer == 0 else chunks[1] if layer == b.L - 1 else 1
        if n > 1:
            parts = grads[i:i + n]
            i += n
            out.append((jnp.concatenate([jnp.asarray(p[0]) for p in parts], axis=1),
                        jnp.concatenate([jnp.asarray(p[1]) for p in parts], axis=0)))
        else:
            out.append(grads[i])
            i += 1
    return out


def predict_peak(res: dict, variant: str, b: Bench, train: bool) -> dict:
    """Predicted peak device bytes of ``variant`` (bytes in use before the call + the call's working set).

    * xla_swap streaming, throttled: the largest (k+1) consecutive stages' weights (forward;
      training: the backward's window, gradients reuse the streamed weights' buffers by
      donation) + activations: forward, the stage's input and output and its executable's
      temporaries; training, the L+1 kept stage inputs (x2 for a two-array carry), every
      stage's saved residuals (``residual_nbytes``), the cotangent in flight and the largest
      temporaries. The figure the runtime's docstring states as its bound.
    * no throttle: not bounded by the runtime (``None``).
    * in-graph programs (xla-in-graph, xla_swap-in-graph, torch_xla-lowered, on-device-jit):
      XLA's own plan: compiled ``memory_analysis`` temporaries + output (+ device-resident
      weights for on-device-jit).
    * on-device loops: all weights (+ all gradients in training) + activations as above.
    """
    before = res.get("bytes_in_use_before")
    h = res["activation_bytes"]
    W = b.weight_bytes
    if before is None:
        return {}
    if res.get("group_member"):
        return {"predicted_peak_bytes": None, "predicted_note": "peak is the group's high-water mark"}
    if "xla_swap-k" in variant:
        if not res.get("throttle", True):
            return {"predicted_peak_bytes": None, "predicted_note": "no throttle: not bounded"}
        k, sn = res["prefetch_depth"], res["stage_nbytes"]
        n = len(sn)
        ins, tf, tb = res["stage_input_nbytes"], res["stage_temp_bytes"]["forward"], res["stage_temp_bytes"]["backward"]
        outs = ins[1:] + [h]
        res_b = res["residual_nbytes"] if train else [0] * n
        steps = []  # (what, bytes) live while stage i runs, per the runtime's schedule
        for i in range(n):  # forward: weights of i..i+k, kept inputs/residuals so far, in + out, temp
            kept = (sum(ins[:i + 1]) + sum(res_b[:i])) if train else ins[i]
            steps.append((f"forward {i}", sum(sn[i:i + k + 1]) + kept + outs[i] + res_b[i] + tf[i]))
        if train:
            for i in range(n - 1, -1, -1):  # backward: weights of i-k..i (grads reuse i's), kept
                # inputs/residuals of stages <= i, cotangent in (outs[i]) and out (ins[i]), temp
                steps.append((f"backward {i}", sum(sn[max(0, i - k):i + 1]) + sum(ins[:i + 1]) + sum(res_b[:i + 1])
                              + outs[i] + ins[i] + tb[i]))
        what, work = max(steps, key=lambda t: t[1])
        return {"predicted_peak_bytes": before + work,
                "predicted_note": f"live set at {what}: {work / GiB:.2f} GiB (weights of k+1={k + 1} stages, "
                                  "activations, residuals, temporaries)"}
    if res.get("temp_bytes") is not None and variant not in ("on-device-loop", "train-on-device"):
        outb = res.get("output_bytes") or (h if not train else h + h + W)
        return {"predicted_peak_bytes": before + res["temp_bytes"] + outb,
                "predicted_note": "compiled temp + output"}
    if variant in ("on-device-loop", "train-on-device"):
        # weights already in use before; activations: stage in/out; training: L+1 inputs + grads
        work = (2 * h) if not train else ((b.L + 1) * h + W + 2 * h)
        work += res.get("layer_temp_bytes") or 0
        return {"predicted_peak_bytes": before + work, "predicted_note": "activations (+ gradients) + layer temp"}
    return {}


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
    """Ordered list of (variant, token counts); most important first (a budget cut drops the tail).

    Order: bandwidth, forward, training, accelerate (smallest token count), LATE, extras.
    """
    wanted = list(args.variants or PRESETS["all"])
    if args.accelerate and "accelerate" not in wanted:
        wanted.append("accelerate")
    tokens = sorted(args.tokens)
    out = []
    if "bandwidth" in wanted:
        out.append(("bandwidth", None))
    for group in (FORWARD_CORE, TRAIN_CORE):
        out += [(v, tokens) for v in group if v in wanted]
    if "accelerate" in wanted:
        out.append(("accelerate", tokens[:1]))
    out += [(v, tokens) for v in LATE + EXTRAS if v in wanted]
    # members of a group asked for by name, without their group
    out += [(v, tokens) for g, members in GROUPS.items() if g not in wanted for v in members if v in wanted]
    return out


def child_argv(args, variant, tokens, result_file):
    argv = [sys.executable, str(Path(__file__).resolve()), "--d", str(args.d), "--f", str(args.f),
            "--layers", str(args.layers), "--reps", str(args.reps), "--warmup", str(args.warmup),
            "--seed", str(args.seed), "--only", variant, "--result-file", result_file]
    argv += ["--tokens"] + [str(t) for t in (tokens or args.tokens)]   # the chunk plan is per token count
    argv += ["--chunks"] + list(args.chunks)
    if args.bw_mib:
        argv += ["--bw-mib", str(args.bw_mib)]
    if args.no_trace:
        argv.append("--no-trace")
    if args.no_flag_search:
        argv.append("--no-flag-search")
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
    res = res[0] if isinstance(res, list) else res
    info.update({k: res.get(k) for k in ("gen_s", "process_wall_s", "error") if res.get(k) is not None})
    if "error" in res:
        log("weight cache failed; every process generates its own weights")
        args.weights_cache = None


def run_isolated(args, variant, tokens, tmp, cache_dir) -> list:
    """Run ``variant`` for ``tokens`` (list or None) in a subprocess; its result dicts (an error dict per T on failure)."""
    result_file = os.path.join(tmp, f"{variant}.json")
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
            results = json.load(fh)
    else:
        results = [{"variant": variant, "tokens": t, "error": f"subprocess rc={rc}: {err[-2000:]}"}
                   for t in (tokens or [None])]
        log(f"{variant} T={tokens} FAILED (rc={rc}): {err.strip().splitlines()[-1] if err.strip() else ''}")
    for res in results:
        res["process_wall_s"] = wall
    return results


def compute_floors(data) -> None:
    """Add floor_ms, ratio and peak/predicted to every timed result (medians).

    forward floor = max(compute, W / H2D), compute = the faster of on-device-loop and
    on-device-jit; training floor = max(compute, 2W / H2D, W / D2H, 3W / both-ways): forward
    and backward each bring every layer in (2W), the gradients go out (W), and 3W cross the
    link while both directions run (the issue's "bytes each way / the bandwidth measured for
    simultaneous H2D+D2H"). Training compute: per-layer recompute rows (``train-*`` without
    ``-saved``) use the faster of train-on-device and train-on-device-jit; ``-saved`` rows
    (residuals kept, no recompute) use train-on-device-saved-jit: each family is held to the
    on-device time of the same algorithm.
    """
    bw = data.get("bandwidth") or {}
    h2d, d2h, both = (bw.get(k + "_best_GBps", bw.get(k + "_GBps")) for k in ("h2d", "d2h", "both"))
    W = data["meta"]["weight_bytes"]
    floors = {}
    by = {(r["variant"], r.get("tokens")): r for r in data["results"]}

    def fastest(t, names):
        got = [by[(v, t)]["median_ms"] for v in names if by.get((v, t), {}).get("median_ms") is not None]
        return min(got) if got else None

    for t in data["meta"]["tokens"]:
        f = {"compute_ms": fastest(t, ("on-device-loop", "on-device-jit")),
             "h2d_ms": W / (h2d * 1e9) * 1e3 if h2d else None}
        f["forward_ms"] = max([v for v in (f["compute_ms"], f["h2d_ms"]) if v is not None], default=None)
        transfer = []
        if h2d:
            transfer.append(2 * W / (h2d * 1e9) * 1e3)
        if d2h:
            transfer.append(W / (d2h * 1e9) * 1e3)
        if both:
            transfer.append(3 * W / (both * 1e9) * 1e3)
        f["train_transfer_ms"] = max(transfer, default=None)
        f["train_compute_ms"] = fastest(t, ("train-on-device", "train-on-device-jit"))
        f["train_saved_compute_ms"] = fastest(t, ("train-on-device-saved-jit",))
        for key, comp in (("train_ms", f["train_compute_ms"]), ("train_saved_ms", f["train_saved_compute_ms"])):
            f[key] = max(comp, f["train_transfer_ms"] or 0) if comp is not None else None
            # phase bound: the backward cannot start before the forward's last layer, whose
            # weights arrive after all W crossed H2D; then the backward computes and sends W
            # of gradients out: max(C_fwd, W/H2D) + max(C_train - C_fwd, W/D2H)
            cf = f["compute_ms"]
            if comp is not None and cf is not None and h2d and d2h:
                f[key.replace("_ms", "_phase_ms")] = (max(cf, W / (h2d * 1e9) * 1e3)
                                                      + max(comp - cf, W / (d2h * 1e9) * 1e3))
        floors[str(t)] = f
    data["floors"] = floors
    for r in data["results"]:
        if r.get("predicted_peak_bytes") and r.get("peak_bytes"):
            r["peak_over_predicted"] = r["peak_bytes"] / r["predicted_peak_bytes"]
        if "median_ms" not in r or r.get("tokens") is None:
            continue
        f = floors.get(str(r["tokens"]), {})
        name = _base_variant(r["variant"])
        if name.startswith("train-"):
            key = "train_saved_ms" if "-saved" in name else "train_ms"
            floor = f.get(key)
            phase = f.get(key.replace("_ms", "_phase_ms"))
            if phase:
                r["phase_bound_ms"] = phase
                r["ratio_phase"] = r["median_ms"] / phase
        else:
            floor = f.get("forward_ms")
        r["floor_ms"] = floor
        r["ratio"] = r["median_ms"] / floor if floor else None


#: Issue targets: forward and training ratios to the floor, speed-up over accelerate, peak vs prediction.
TARGETS = {"forward": 1.03, "train": 1.10, "accelerate_speedup": 3.0, "peak": 0.10}
#: The rows the targets are judged on: xla_swap's execution paths.
XLA_SWAP_FORWARD = ["xla_swap-k2-chunked", "xla_swap-k3-chunked", "xla_swap-k2", "xla_swap-in-graph"]
XLA_SWAP_TRAIN = ["train-xla_swap-k2-saved-chunked", "train-xla_swap-k2-saved", "train-xla_swap-k2"]


def markdown(data) -> str:
    m = data["meta"]
    bw = data.get("bandwidth") or {}
    lines = [f"## gpu_stack: {m['layers']}-layer bf16 FFN stack, D={m['d']}, F={m['f']}, "
             f"{m['weight_bytes'] / GiB:.2f} GiB of weights",
             "",
             f"device: {m.get('device')} ({m.get('platform')}), jax {m.get('jax_version')}, {m['date']}, "
             f"isolate={m['isolate']}, reps={m['reps']}, total {m.get('total_wall_s', float('nan')):.0f} s",
             "",
             f"command: `{m['command']}`",
             ""]
    if bw.get("h2d_GBps"):
        lines += [f"pinned bandwidth ({bw['bytes'] / GiB:.2f} GiB in {bw.get('buffers', 1)} buffers, median / best "
                  f"of {len(bw.get('h2d_times_s', []))}; floors use the best): H2D {bw['h2d_GBps']:.1f} / "
                  f"{bw.get('h2d_best_GBps', float('nan')):.1f} GB/s, D2H {bw['d2h_GBps']:.1f} / "
                  f"{bw.get('d2h_best_GBps', float('nan')):.1f} GB/s, both at once {bw['both_GBps']:.1f} / "
                  f"{bw.get('both_best_GBps', float('nan')):.1f} GB/s (aggregate)", ""]
    lines += targets_lines(data)
    lines += ["| variant | tokens | median ms | min ms | floor ms | x floor | peak dev GiB | predicted GiB "
              "| peak / pred | temp GiB | max rel err | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    for r in data["results"]:
        if r["variant"] == "bandwidth":
            continue
        note = r.get("error", "") or r.get("skipped", "")
        note = note.strip().splitlines()[-1][:80] if note else ""
        if "copy_start_count" in r:
            note = (note + f" copy-start={r['copy_start_count']}").strip()
        if r.get("grads_memory_kind"):
            note = (note + f" grads:{r['grads_memory_kind']}").strip()
        if r.get("predicted_note") and r.get("predicted_peak_bytes") is None:
            note = (note + " " + r["predicted_note"]).strip()
        if r.get("peak_is_cumulative"):
            note = (note + " peak cumulative").strip()
        lines.append("| " + " | ".join([
            r["variant"], str(r.get("tokens", "")), f(r.get("median_ms")), f(r.get("min_ms")),
            f(r.get("floor_ms")), f(r.get("ratio"), "{:.3f}"), _gib(r.get("peak_bytes")),
            _gib(r.get("predicted_peak_bytes")), f(r.get("peak_over_predicted"), "{:.2f}"),
            _gib(r.get("temp_bytes")), f(r.get("rel_err"), "{:.1e}"), note]) + " |")
    lines += torch_xla_vs_jax_lines(data)
    fl = data.get("floors", {})
    lines += ["", "Floors: forward = max(compute = min(on-device-loop, on-device-jit), W / H2D); training = "
              "max(compute, 2W / H2D, W / D2H, 3W / both-ways), W = weight bytes; training compute = the on-device "
              "time of the same algorithm: min(train-on-device, train-on-device-jit) for per-layer recompute rows, "
              "train-on-device-saved-jit for -saved rows (residuals kept: dots_with_no_batch_dims_saveable)."]
    for t, fv in fl.items():
        lines.append(f"- T={t}: forward floor {_fmt(fv.get('forward_ms'))} ms (compute {_fmt(fv.get('compute_ms'))}, "
                     f"W/H2D {_fmt(fv.get('h2d_ms'))}); training floor {_fmt(fv.get('train_ms'))} ms (compute "
                     f"{_fmt(fv.get('train_compute_ms'))}), -saved {_fmt(fv.get('train_saved_ms'))} ms (compute "
                     f"{_fmt(fv.get('train_saved_compute_ms'))}); transfer {_fmt(fv.get('train_transfer_ms'))} ms; "
                     f"phase bounds {_fmt(fv.get('train_phase_ms'))} / -saved {_fmt(fv.get('train_saved_phase_ms'))} ms")
    lines += ["", "Phase bound (training): max(C_fwd, W/H2D) + max(C_train - C_fwd, W/D2H): the backward starts after "
              "the forward's last layer, whose weights arrive only after all W crossed H2D, then computes and sends W "
              "of gradients out. The issue's floor treats the step as one pool of transfers and compute; where the "
              "forward is transfer-bound and the backward compute-bound, no schedule that streams every layer in "
              "the forward reaches it."]
    lines += ["", "Peak: one process per variant, token counts ascending; the first token count's peak is its own, "
              "later ones are the process's high-water mark (jax cannot reset it; activations grow with T). "
              "Predicted = bytes in use before the call + the working set: xla_swap streaming (throttled) = the "
              "largest live set over the runtime's schedule: at each stage, the weights of the k+1 stages it holds "
              "(the one computing + k prefetched; in the backward its gradients reuse its weights' buffers), the "
              "stage inputs and saved residuals kept so far (training), the stage's input and output (cotangents) "
              "and its executable's temporaries (compiled memory_analysis); in-graph = compiled temp + output; "
              "on-device loops = activations (+ gradients) + one layer's temporaries; rows after the first of a "
              "process group are not compared.",
              "xla_swap rows throttle (host waits on stage i-1, no data transfer) unless -nothrottle; -chunked: first "
              "and last layer split into column-chunk stages; rel err = max|x-ref|/max|ref| vs on-device loop."]
    if m.get("platform") == "cpu":
        lines.append("CPU run: pinned_host and device are both host RAM; ratios and bandwidths mean nothing.")
    return "\n".join(lines)


def targets_lines(data) -> list:
    """The issue's targets, met or not, from the best xla_swap rows (one line each)."""
    by = {(r["variant"], r.get("tokens")): r for r in data["results"]}
    out = ["Targets (best xla_swap path per token count, medians):", ""]

    def best(names, t):
        rows = [by[(v, t)] for v in names if by.get((v, t), {}).get("ratio") is not None]
        return min(rows, key=lambda r: r["ratio"]) if rows else None

    for label, names, target in (("forward", XLA_SWAP_FORWARD, TARGETS["forward"]),
                                 ("training step", XLA_SWAP_TRAIN, TARGETS["train"])):
        for t in data["meta"]["tokens"]:
            r = best(names, t)
            if r is None:
                out.append(f"- {label} T={t}: no result")
                continue
            ok = r["ratio"] <= target
            phase = (f"; {r['ratio_phase']:.3f}x the phase bound {r['phase_bound_ms']:.1f} ms"
                     if r.get("ratio_phase") else "")
            out.append(f"- {label} T={t}: {r['ratio']:.3f}x floor ({r['variant']}, {r['median_ms']:.1f} ms{phase}) - "
                       f"target <= {target:.2f}x {'MET' if ok else 'MISSED'}")
    for t in data["meta"]["tokens"]:  # the flag search: a favourable pick (best of several noisy medians)
        r = best([f"xla_swap-in-graph@{f}" for f in FLAG_SETS], t)
        if r is not None:
            out.append(f"- forward T={t}, xla_swap in-graph under the best XLA flag set of this run: "
                       f"{r['ratio']:.3f}x ({r['variant']}, {r['median_ms']:.1f} ms; the best of {len(FLAG_SETS)} "
                       f"medians, so biased low) - {'within' if r['ratio'] <= TARGETS['forward'] else 'above'} "
                       f"{TARGETS['forward']:.2f}x")
    acc = [r for r in data["results"] if r["variant"] == "accelerate" and r.get("median_ms")]
    if acc:
        t = acc[0]["tokens"]
        r = best(XLA_SWAP_FORWARD, t)
        if r is not None:
            sp = acc[0]["median_ms"] / r["median_ms"]
            out.append(f"- vs HF accelerate cpu_offload T={t}: {acc[0]['median_ms']:.1f} ms / {r['median_ms']:.1f} ms "
                       f"= {sp:.1f}x faster - target >= {TARGETS['accelerate_speedup']:.0f}x "
                       f"{'MET' if sp >= TARGETS['accelerate_speedup'] else 'MISSED'}")
    peaks = [r for r in data["results"] if r.get("peak_over_predicted") is not None
             and _base_variant(r["variant"]) in XLA_SWAP_FORWARD + XLA_SWAP_TRAIN]
    if peaks:
        worst = max(peaks, key=lambda r: abs(r["peak_over_predicted"] - 1))
        ok = abs(worst["peak_over_predicted"] - 1) <= TARGETS["peak"]
        out.append(f"- peak device memory vs prediction, xla_swap rows: worst {worst['peak_over_predicted']:.2f} "
                   f"({worst['variant']} T={worst['tokens']}) - target within {TARGETS['peak']:.0%} "
                   f"{'MET' if ok else 'MISSED'}")
    return out + [""]


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

    out_dir = Path(args.out_dir or os.environ.get("OUT") or REPO / "out")
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
                data["results"] += [{"variant": variant, "tokens": t,
                                     "skipped": f"time budget {args.budget_s:.0f} s used up"} for t in (tokens or [None])]
                log(f"skip {variant} T={tokens}: budget")
                continue
            log(f"run {variant} T={tokens} (elapsed {elapsed:.0f} s)")
            if args.isolate == "process":
                results = run_isolated(args, variant, tokens, tmp, cache_dir)
            else:
                try:
                    results = run_variant(args, variant, tokens)
                except Exception as e:  # noqa: BLE001 - keep going, record it
                    results = [{"variant": variant, "tokens": t, "error": repr(e)} for t in (tokens or [None])]
                    log(f"{variant} T={tokens} FAILED: {e!r}")
            for res in results:
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
    if args.render:
        src = Path(args.render)
        data = json.loads(src.read_text())
        out_dir = Path(args.out_dir) if args.out_dir else src.parent
        out_dir.mkdir(parents=True, exist_ok=True)
        compute_floors(data)
        (out_dir / "gpu_stack.md").write_text(markdown(data) + "\n")
        print(markdown(data))
        return
    if args.only:
        res = run_variant(args, args.only, args.tokens)
        if args.result_file:
            Path(args.result_file).write_text(json.dumps(res, default=str))
        else:
            print(json.dumps(res, default=str, indent=1))
        return
    driver(args)


if __name__ == "__main__":
    main()
