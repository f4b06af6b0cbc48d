#!/usr/bin/env python
"""The programs a ``SwappedStack`` runs on n GPUs, compiled on a machine with fewer (deviceless cross-compilation),
and what each compiled program spends without FLOPs: its transposes and copies, and its collectives.

The stack (an HF Llama of ``llama_model.SHAPES``, ``torch.optim.AdamW``, the default policy) is built on n of
the host's CPU devices and takes one step at a small token count (2n sequences of ``--seq-small``
tokens). Every program the runtime lowers there (``jax.jit(...).lower(*specs)``) is lowered again by
:class:`TargetCompiler` for the target devices: each sharding moved to the device at the same place of the
target's mesh, each activation's batch and sequence dimensions scaled to the target's (``b``, ``s``), and
compiled. While it traces for a GPU target, the stages' SDPA calls take the GPU environment's cuDNN path
(:func:`gpu_attention`), as they do on GPUs.

The target: ``--target cuda`` compiles for ``--devices`` H200s described by ``H200_TARGET_CONFIG``
(``jax.experimental.topologies.get_topology_desc(platform="cuda", topology="1x1xN")``). Where a CUDA backend
is present, jax compiles through it (kernels autotuned on the local GPU, as on a machine of n of them).
``--target cpu`` compiles for the CPU devices after the first n (a check of the mechanism, no GPU needed).

Per program (``programs`` in ``--out``): its function's name, the input shapes, the compiled program's
transposes and copies (``transposes``: HLO name, shape, bytes written; fusions named after a transpose or a
copy, and bare ``transpose``/``copy`` ops) and collectives (``collectives``: op, shape, dimensions), and
``--hlo-out`` the optimized HLO texts (gzip). Counts are of the program's text: an op inside a loop counts once.

    PYTHONPATH=/tmp/site:. JAX_PLATFORMS=cpu,cuda python3 benchmarks/cross_compile.py --devices 2 --layers 2 \\
        --batch 8 --seq 4096 --shard fsdp --out $OUT/xc_fsdp.json --hlo-out $OUT/xc_fsdp.txt.gz
    PYTHONPATH=. python3 benchmarks/cross_compile.py --target cpu --devices 2 --shape tiny --out /tmp/xc.json
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: an H200 SXM as XLA's GPU compiler sees it (``stream_executor::GpuDeviceInfoProto`` text): 132 SMs at
#: 1.98 GHz, 141 GB of HBM3e at 4.8 TB/s, 50 MiB of L2, compute capability 9.0 (NVIDIA's H200 datasheet).
#: The compiler takes its cost model from these; where a CUDA backend is present its kernels are tuned there.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""

#: the collectives listed per program.
COLLECTIVES = ("all-gather", "all-gather-start", "reduce-scatter", "all-reduce", "all-reduce-start", "all-to-all",
               "collective-permute", "collective-permute-start")
_ITEM = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8,
         "s64": 8}


def target_devices(target: str, n: int):
    """The ``n`` devices to compile for: ``"cuda"``, compile-only H200s (:data:`H200_TARGET_CONFIG`, one host);
    ``"cpu"``, the CPU devices ``[n, 2n)`` (ValueError naming ``--devices`` where the host has fewer)."""
    import jax
    if target == "cpu":
        cpus = jax.devices("cpu")
        if len(cpus) < 2 * n:
            raise ValueError(f"--target cpu needs 2 x --devices CPU devices, the host has {len(cpus)}")
        return cpus[n:2 * n]
    if target != "cuda":
        raise ValueError(f"target must be 'cuda' or 'cpu', got {target!r}")
    from jax.experimental import topologies
    return topologies.get_topology_desc("xla_swap", "cuda", target_config=H200_TARGET_CONFIG,
                                        topology=f"1x1x{n}").devices


def scaled_shape(shape: tuple, scale: dict) -> tuple:
    """``shape`` with its activation dimensions scaled: where it holds the small sequence length
    (``scale["s"] = (small, big)``), each such dimension becomes ``big`` and a leading dimension equal to the
    small batch becomes the big one (``scale["b"]``); a dimension of ``b x s`` tokens (flattened) scales as
    both. Every other shape is returned as it is."""
    (bs, bb), (ss, sb) = scale["b"], scale["s"]
    shape = tuple(shape)
    if ss not in shape and bs * ss not in shape:
        return shape
    out = [sb if d == ss else bb * sb if d == bs * ss else d for d in shape]
    if shape and shape[0] == bs:
        out[0] = bb
    return tuple(out)


def remap_sharding(sh, devices: dict):
    """``sh`` (a ``NamedSharding`` or ``SingleDeviceSharding``, or ``None``) on the devices ``devices``
    maps it to, with the same spec, mesh axes and memory kind. TypeError for any other sharding."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
    if sh is None:
        return None
    if isinstance(sh, NamedSharding):
        mesh = Mesh(np.vectorize(devices.__getitem__, otypes=[object])(sh.mesh.devices), sh.mesh.axis_names)
        return NamedSharding(mesh, sh.spec, memory_kind=sh.memory_kind)
    if isinstance(sh, SingleDeviceSharding):
        (d,) = sh.device_set
        return SingleDeviceSharding(devices[d], memory_kind=sh.memory_kind)
    raise TypeError(f"cannot move a {type(sh).__name__} to the target devices")


def remap_tree(tree, devices: dict, scale: dict):
    """The specs ``tree`` (arrays, ``ShapeDtypeStruct``s, shardings, other leaves) for the target: each array
    or struct a ``ShapeDtypeStruct`` of :func:`scaled_shape` with :func:`remap_sharding`; each sharding moved."""
    import jax

    def leaf(x):
        if isinstance(x, jax.sharding.Sharding):
            return remap_sharding(x, devices)
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(scaled_shape(x.shape, scale), x.dtype,
                                        sharding=remap_sharding(getattr(x, "sharding", None), devices))
        return x
    return jax.tree_util.tree_map(leaf, tree)


def _unfused_lines(text: str):
    """The instruction lines of an HLO module's ``text`` outside fused computations (the entry's, loop bodies',
    called computations'): a fusion counts as one instruction, not as its insides."""
    fused = set(re.findall(r"fusion\(.*calls=%?([\w.\-]+)", text))
    skip = False
    for line in text.splitlines():
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            skip = head.group(1) in fused
            continue
        if not skip:
            yield line


def _nbytes(shapes: list) -> int:
    n_all = 0
    for dtype, dims in shapes:
        n = 1
        for x in dims.split(","):
            n *= int(x) if x else 1
        n_all += n * _ITEM.get(dtype, 4)
    return n_all


def hlo_summary(text: str) -> dict:
    """What an optimized HLO module's ``text`` spends without FLOPs, outside fused computations:
    ``transposes`` (``[name, shape, bytes written]`` of each instruction named after a transpose or a copy,
    fusions included) and ``collectives`` (``[op, shape, dimensions]``), the bytes the transposes write
    (``transpose_bytes``) and the count of cuDNN attention calls (``cudnn_attention``). Shapes as HLO writes
    them (``bf16[4096,7168]{0,1}``): a tuple-shaped fusion gives its first element and the bytes of all, an
    asynchronous collective (``*-start``) its result."""
    transposes, collectives = [], []
    for line in _unfused_lines(text):
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|[^\s(]+) ([\w\-]+)\(", line)
        if not m:
            continue
        name, out, op = m.groups()
        shapes = re.findall(r"(\w+)\[([\d,]*)\](\{[\d,]*\})?", out)
        if not shapes:
            continue
        if op in COLLECTIVES:
            dtype, dims, layout = shapes[-1]
            d = re.search(r"dimensions=\{([\d,]*)\}", line)
            collectives.append([op, f"{dtype}[{dims}]{layout}", d.group(1) if d else ""])
        elif ("transpose" in name or name.startswith("copy") or op in ("transpose", "copy")) \
                and op not in ("parameter", "get-tuple-element", "bitcast", "copy-start", "copy-done"):
            dtype, dims, layout = shapes[0]
            transposes.append([name, f"{dtype}[{dims}]{layout}", _nbytes([sh[:2] for sh in shapes])])
    return {"transposes": transposes, "transpose_bytes": sum(t[2] for t in transposes), "collectives": collectives,
            "cudnn_attention": len(re.findall(r"custom_call_target=\"__cudnn\$fmha", text))}


_GPU_SDPA = [False]   # within gpu_attention(True)
_TARGET = [None]      # while TargetCompiler lowers for the target: the function moving a sharding there


@contextlib.contextmanager
def gpu_attention(on: bool):
    """Within it (``on``), SDPA calls traced in the stages' CPU environment take the GPU environment's path
    (cuDNN's fused attention, ``xla_swap.stack.torch_attention._sdpa_cudnn``), inside :func:`target_hooks`."""
    old = _GPU_SDPA[0]
    _GPU_SDPA[0] = on
    try:
        yield
    finally:
        _GPU_SDPA[0] = old


def _switched_sdpa(reference):
    from xla_swap.stack import torch_attention as ta

    def sdpa(*args, **kwargs):
        if not _GPU_SDPA[0]:
            return reference(*args, **kwargs)
        with gpu_attention(False):   # the cuDNN path's own fallback calls the reference
            return ta._sdpa_cudnn(ta.torchax_env("cpu"), *args, **kwargs)
    return sdpa


def _movable_gathered(own):
    """``stage_programs.gathered`` (``own``) whose weight constraint (closed over, not an argument) moves to the
    target devices while :class:`TargetCompiler` lowers for them."""
    def gathered(f, sharding):
        if sharding is None:
            return f

        def g(p, *args):
            return own(f, sharding if _TARGET[0] is None else _TARGET[0](sharding))(p, *args)
        g.__qualname__ = getattr(f, "__qualname__", g.__qualname__)
        return g
    return gathered


def _gathered_everywhere(own):
    from jax.sharding import NamedSharding, PartitionSpec

    def gathered_sharding(self, replicated: bool):
        if self.batch_sharding is None:
            return own(self, replicated)
        return NamedSharding(self.batch_sharding.mesh, PartitionSpec())
    return gathered_sharding


@contextlib.contextmanager
def target_hooks(gather: bool = False):
    """Within it, stacks built and stepped can be compiled for a target by :class:`TargetCompiler`: the CPU
    environment's SDPA follows :func:`gpu_attention`, the stages' weight constraint moves to the target, and,
    with ``gather``, every stage over a data-parallel mesh constrains its weights to replicated first (as
    ``stage_programs.gathered`` does for a batch that runs replicated: the weights all-gathered whatever split
    the rule gave them). Everything is as it was on exit."""
    from xla_swap.executors.streaming import compilation
    from xla_swap.executors.streaming.placement import ActivationLayout
    from xla_swap.stack import torch_attention as ta
    saved = ta.sdpa_reference, compilation.gathered, ActivationLayout.gathered_sharding
    ta.sdpa_reference = _switched_sdpa(saved[0])
    compilation.gathered = _movable_gathered(saved[1])
    if gather:
        ActivationLayout.gathered_sharding = _gathered_everywhere(saved[2])
    ta.torchax_env.cache_clear()   # each platform's environment takes its SDPA when made
    try:
        yield
    finally:
        ta.sdpa_reference, compilation.gathered, ActivationLayout.gathered_sharding = saved
        ta.torchax_env.cache_clear()


class _Jitted:
    """``jax.jit(fun, ...)`` as :class:`TargetCompiler` hands it out: the same object in every use, whose
    ``lower`` also compiles for the target."""

    def __init__(self, compiler: "TargetCompiler", fun, args: tuple, kwargs: dict, jitted):
        self._compiler, self._fun, self._args, self._kwargs, self._jitted = compiler, fun, args, kwargs, jitted

    def __call__(self, *args, **kwargs):
        return self._jitted(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._jitted, name)

    def lower(self, *args, **kwargs):
        lowered = self._jitted.lower(*args, **kwargs)
        self._compiler.compile(self._fun, self._args, self._kwargs, args)
        return lowered


class TargetCompiler:
    """Within it, each ``jax.jit(fun, ...).lower(*specs)`` also lowers ``fun`` for the target devices (specs
    and ``in_shardings``/``out_shardings`` through :func:`remap_tree`, ``devices`` mapping each local device to
    its target, ``scale`` as :func:`scaled_shape` takes it) and compiles it there, SDPA on the GPU path where
    ``gpu``. ``records``: per program ``{"fn", "inputs", "compile_s", "temp_bytes", ...hlo_summary}``, or
    ``"error"`` where the target's lowering or compilation raised; ``texts``: the optimized HLO texts."""

    def __init__(self, devices: dict, scale: dict, gpu: bool):
        self.devices, self.scale, self.gpu = devices, scale, gpu
        self.records: list[dict] = []
        self.texts: list[str] = []

    def __enter__(self):
        import jax
        self._jit = jax.jit

        def jit(fun, *args, **kwargs):
            return _Jitted(self, fun, args, kwargs, self._jit(fun, *args, **kwargs))
        jax.jit = jit
        return self

    def __exit__(self, *exc):
        import jax
        jax.jit = self._jit
        return False

    def compile(self, fun, jit_args: tuple, jit_kwargs: dict, specs: tuple) -> None:
        """Lower and compile ``fun`` for the target; appends its record (errors recorded, not raised)."""
        import jax
        name = getattr(fun, "__qualname__", type(fun).__name__)
        target = remap_tree(specs, self.devices, self.scale)
        rec = {"fn": name, "inputs": [f"{s.dtype}{list(s.shape)}" for s in jax.tree_util.tree_leaves(target)
                                      if isinstance(s, jax.ShapeDtypeStruct)][:12]}
        try:
            kwargs = {k: remap_tree(v, self.devices, self.scale) if k.endswith("shardings") else v
                      for k, v in jit_kwargs.items()}
            t = time.perf_counter()
            _TARGET[0] = lambda sh: remap_sharding(sh, self.devices)
            try:
                with gpu_attention(self.gpu):
                    compiled = self._jit(fun, *jit_args, **kwargs).lower(*target).compile()
            finally:
                _TARGET[0] = None
            rec["compile_s"] = round(time.perf_counter() - t, 2)
            text = compiled.as_text()
            mem = compiled.memory_analysis()
            rec["temp_bytes"] = getattr(mem, "temp_size_in_bytes", None)
            rec.update(hlo_summary(text))
            self.texts.append(f"# program {len(self.records)}: {name}\n{text}")
        except Exception as e:  # noqa: BLE001 -- one program's failure is its record
            msg = str(e)
            rec["error"] = f"{type(e).__name__}: {msg[:300]}{' ... ' + msg[-1500:] if len(msg) > 300 else ''}"
        self.records.append(rec)


def run(args) -> dict:
    """Build the stack on ``args.devices`` CPU devices, take one step under :class:`TargetCompiler`; the
    result (module docstring)."""
    import jax
    import llama_model as lm
    from llama_scaling import build_stack
    n = args.devices
    cpus = jax.devices("cpu")
    targets = target_devices(args.target, n)
    shape = lm.shape_of(args.shape, args.layers)
    scale = {"b": (2 * n, args.batch), "s": (args.seq_small, args.seq)}   # 2n: never a broadcast's 1
    x, y = lm.batch(2 * n, args.seq_small, shape["vocab"])
    with target_hooks(args.gather):
        stack, build_s = build_stack(shape, cpus[:n], "cpu", shard=args.shard)
        with TargetCompiler(dict(zip(cpus[:n], targets)), scale, gpu=args.target == "cuda") as tc:
            loss = float(stack.train_step(x, y))
    return {"args": vars(args), "target_devices": [str(d) for d in targets], "build_s": round(build_s, 2),
            "loss": loss, "programs": tc.records}, tc.texts


def _print(result: dict, min_bytes: int) -> None:
    """One line per program, and its transposes of at least ``min_bytes``."""
    for i, r in enumerate(result["programs"]):
        if "error" in r:
            print(f"{i:2d} {r['fn'][:48]:48s} ERROR {r['error'][:200]}")
            continue
        kinds = sorted({c[0] for c in r["collectives"]})
        print(f"{i:2d} {r['fn'][:48]:48s} {len(r['transposes']):3d} transposes {r['transpose_bytes'] / 1e6:9.1f} MB"
              f"  {len(r['collectives']):3d} collectives {','.join(kinds)}  ({r['compile_s']} s)")
        for t in r["transposes"]:
            if t[2] >= min_bytes:
                print(f"      {t[0]:40s} {t[1]:32s} {t[2] / 1e6:9.1f} MB")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--devices", type=int, default=2, help="devices of the target (and CPU devices built on)")
    p.add_argument("--shape", default="8b", help="llama_model.SHAPES name")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--shard", default="fsdp", choices=("fsdp", "largest"),
                   help="llama_scaling.build_stack's shard")
    p.add_argument("--gather", action="store_true", help="gather the weights in every stage program "
                   "(target_hooks)")
    p.add_argument("--batch", type=int, default=8, help="target global batch (sequences)")
    p.add_argument("--seq", type=int, default=4096, help="target sequence length (tokens)")
    p.add_argument("--seq-small", type=int, default=48, help="sequence length of the CPU step")
    p.add_argument("--out", required=True, help="JSON file")
    p.add_argument("--hlo-out", help="gzip file of the optimized HLO texts")
    p.add_argument("--min-mb", type=float, default=1.0, help="print transposes of at least this many MB")
    args = p.parse_args(argv)
    if args.devices < 1 or args.batch % args.devices:
        p.error(f"--batch ({args.batch}) must split over --devices ({args.devices}) >= 1")
    flag = f"--xla_force_host_platform_device_count={2 * args.devices}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    result, texts = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.hlo_out:
        with gzip.open(args.hlo_out, "wt") as f:
            f.write("\n".join(texts))
    _print(result, int(args.min_mb * 1e6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
