"""The command line: ``python -m benchmarks.gpu_stack [options]`` -> a run, a re-render, or a child.

Options map onto a :class:`~.spec.RunSpec` (what every process measures) and
:class:`~.runner.DriverOptions` (how the driver runs them). ``--render JSON`` only re-renders
a saved result; ``--child SPEC`` (internal) is one measuring process started by the driver.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .analysis import compute_floors
from .report import markdown
from .runner import DriverOptions, default_out_dir, drive, run_child
from .spec import DEFAULT_ARTIFACTS, ChildSpec, RunSpec, parse_chunks
from .variants import ALL_NAMES, FLAG_SETS, GROUPS, PRESETS, VARIANTS, expand

__all__ = ["parse_args", "main", "render"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_stack",
                                description="GPU benchmark: an L-layer bf16 FFN stack, host-offloaded in several ways "
                                            "(see the package docstring).")
    p.add_argument("--d", type=int, default=8192, help="model width D")
    p.add_argument("--f", type=int, default=32768, help="FFN width F")
    p.add_argument("--layers", type=int, default=8, help="number of layers L")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="token counts T")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bw-mib", type=int, default=None,
                   help="bandwidth buffer size in MiB (default: buffers shaped like the weights)")
    p.add_argument("--variants", nargs="+", default=None, metavar="VARIANT|PRESET",
                   help="run only these variants / presets (default: the preset all). Variants: "
                        f"{' '.join(ALL_NAMES)} (groups: "
                        + "; ".join(f"{k} = {' '.join(v)}" for k, v in GROUPS.items()) + "). Presets: "
                        + "; ".join(f"{k} = {' '.join(v)}" for k, v in PRESETS.items()))
    p.add_argument("--no-flag-search", action="store_true",
                   help="do not time " + " and ".join(v.name for v in VARIANTS.values() if v.flag_search)
                        + " again under each XLA flag set: " + "; ".join(f"{k} = {v}" for k, v in FLAG_SETS.items()))
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
    p.add_argument("--out-dir", default=None,
                   help="where gpu_stack.json and gpu_stack.md go (default: $OUT, else out/, untracked); "
                        "pass benchmarks/results to update the committed results")
    p.add_argument("--artifacts-dir", default=str(DEFAULT_ARTIFACTS),
                   help="torch_xla-lowered protos + sidecars (benchmarks/export_torch_xla_stack.py); "
                        "default benchmarks/artifacts")
    p.add_argument("--no-weight-cache", action="store_true",
                   help="every variant process generates the weights itself instead of mapping "
                        "the run's shared .npy cache")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="only re-render the markdown (floors, targets, table) of a saved gpu_stack.json: print "
                        "it and write gpu_stack.md into the output directory (--out-dir, else $OUT, else out/); "
                        "runs nothing")
    p.add_argument("--child", default=None, metavar="SPEC", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):
    """Parse the command line into ``(args, RunSpec, DriverOptions)``.

    Exits through ``argparse`` (status 2, the message naming the option) for an unknown
    variant, bad ``--chunks``, or a size / count < 1.
    """
    p = _parser()
    args = p.parse_args(argv)
    variants = None
    if args.variants:
        try:
            variants = tuple(expand(args.variants))
        except ValueError as e:
            p.error(f"--variants: {e}")
    try:
        plan = parse_chunks(args.chunks, args.tokens)
    except ValueError as e:
        p.error(f"--chunks: {e}")
    for first, last in plan.values():
        if first < 1 or last < 1 or args.f % first or args.f % last:
            p.error(f"--chunks: chunk counts must be >= 1 and divide --f ({args.f}), got {args.chunks}")
    for name in ("d", "f", "layers", "reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if any(t < 1 for t in args.tokens):
        p.error("--tokens must be >= 1")
    try:
        spec = RunSpec(d=args.d, f=args.f, layers=args.layers, tokens=tuple(args.tokens), reps=args.reps,
                       warmup=args.warmup, seed=args.seed, bw_mib=args.bw_mib,
                       chunks=tuple((t, *plan[t]) for t in args.tokens), flag_search=not args.no_flag_search,
                       trace=not args.no_trace, artifacts_dir=str(args.artifacts_dir))
    except ValueError as e:
        p.error(str(e))
    opts = DriverOptions(variants=variants, accelerate=args.accelerate, isolate=args.isolate, budget_s=args.budget_s,
                         child_timeout_s=args.child_timeout_s, compile_cache=args.compile_cache,
                         weight_cache=not args.no_weight_cache, out_dir=str(default_out_dir(args.out_dir)))
    return args, spec, opts


def render(json_path, out_dir) -> str:
    """Re-render a saved result: the markdown (no trailing newline), also written to
    ``out_dir/gpu_stack.md``. The JSON file is only read.

    Raises: OSError (unreadable file), ValueError (not JSON), KeyError (not a gpu_stack result).
    """
    data = json.loads(Path(json_path).read_text())
    compute_floors(data)
    text = markdown(data)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_stack.md").write_text(text + "\n")
    return text


def main(argv=None) -> None:
    """The entry point of ``python -m benchmarks.gpu_stack``."""
    args, spec, opts = parse_args(argv)
    if args.child:
        run_child(ChildSpec.from_json(Path(args.child).read_text()))
        return
    if args.render:
        print(render(args.render, opts.out_dir))
        return
    drive(spec, opts, argv)
