"""The runner: plan the runs, start one process per variant with a spec, collect and save results.

:func:`plan` orders the (variant, token counts) runs; :func:`drive` runs them within a time
budget, by default each in its own subprocess (``python -m benchmarks.gpu_stack --child
SPEC``, a :class:`~.spec.ChildSpec` JSON file) so that every variant gets its own peak device
memory, and saves ``gpu_stack.json`` and ``gpu_stack.md`` after every run (a run cut short
keeps what it did). Imports jax only for its version (the driver does not start a backend).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ._util import GiB, log
from .analysis import DEFAULT_TARGETS, compute_floors
from .report import markdown
from .spec import ChildSpec, RunSpec
from .variants import EXTRAS, FORWARD_CORE, GROUPS, LATE, PRESETS, TRAIN_CORE

__all__ = ["DriverOptions", "plan", "drive", "run_child", "save", "default_out_dir", "REPO"]

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class DriverOptions:
    """How the driver runs the planned variants (the child processes do not need these).

    Attributes:
      variants: variant / group names (presets expanded), or ``None`` for the preset ``all``.
      accelerate: also run HF accelerate ``cpu_offload``.
      isolate: ``"process"`` (one subprocess per variant) or ``"none"`` (all in this process).
      budget_s: variants not started after this many seconds are recorded as skipped.
      child_timeout_s: limit for one subprocess (seconds).
      compile_cache: share a persistent jax compilation cache between subprocesses.
      weight_cache: generate the weights once into a ``.npy`` cache every process maps.
      out_dir: where ``gpu_stack.json`` / ``.md`` go.
    """

    variants: tuple | None = None
    accelerate: bool = False
    isolate: str = "process"
    budget_s: float = 500.0
    child_timeout_s: float = 150.0
    compile_cache: bool = False
    weight_cache: bool = True
    out_dir: str = "out"


def default_out_dir(out_dir: str | None) -> Path:
    """``out_dir`` when given, else ``$OUT`` when set, else ``out/`` at the repository root (untracked)."""
    return Path(out_dir or os.environ.get("OUT") or REPO / "out")


def plan(variants, tokens, accelerate: bool = False) -> list:
    """Ordered list of ``(name, token counts)``; most important first (a budget cut drops the tail).

    Order: bandwidth, forward, training, accelerate (smallest token count), late, extras, then
    members of a group asked for by name without their group. ``variants``: names (``None``: the
    preset ``all``); bandwidth's token counts are ``None``.
    """
    wanted = list(variants or PRESETS["all"])
    if accelerate and "accelerate" not in wanted:
        wanted.append("accelerate")
    tokens = sorted(tokens)
    out = []
    if "bandwidth" in wanted:
        out.append(("bandwidth", None))
    for group in (FORWARD_CORE, TRAIN_CORE):
        out += [(v, tokens) for v in group if v in wanted]
    if "accelerate" in wanted:
        out.append(("accelerate", tokens[:1]))
    out += [(v, tokens) for v in LATE + EXTRAS if v in wanted]
    out += [(v, tokens) for g, members in GROUPS.items() if g not in wanted for v in members if v in wanted]
    return out


def save(data: dict, out_dir: Path) -> None:
    """Analyse ``data`` (floors, ratios) and write ``gpu_stack.json`` and ``gpu_stack.md`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    compute_floors(data)
    (out_dir / "gpu_stack.json").write_text(json.dumps(data, indent=1, default=str))
    (out_dir / "gpu_stack.md").write_text(markdown(data) + "\n")


def run_child(spec: ChildSpec) -> None:
    """The child side: run ``spec.variant`` in this process and write its rows to ``spec.result_file``."""
    from .measure import run_variant

    rows = run_variant(spec.run, spec.variant, spec.tokens)
    Path(spec.result_file).write_text(json.dumps(rows, default=str))


def _run_here(spec: RunSpec, variant: str, tokens) -> list:
    from .measure import run_variant

    try:
        return run_variant(spec, variant, tokens)
    except Exception as e:  # noqa: BLE001 - keep going, record it
        log(f"{variant} T={tokens} FAILED: {e!r}")
        return [{"variant": variant, "tokens": t, "error": repr(e)} for t in (tokens or [None])]


def run_isolated(spec: RunSpec, opts: DriverOptions, variant: str, tokens, tmp: str, cache_dir) -> list:
    """Run ``variant`` for ``tokens`` (list or None) in a subprocess given a :class:`ChildSpec`
    file; its result dicts (an error dict per token count on failure or timeout)."""
    result_file = os.path.join(tmp, f"{variant}.json")
    spec_file = os.path.join(tmp, f"{variant}.spec.json")
    Path(spec_file).write_text(ChildSpec(spec, variant, None if tokens is None else tuple(tokens),
                                         result_file).to_json())
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
        p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_stack", "--child", spec_file], env=env,
                           cwd=str(REPO), timeout=opts.child_timeout_s, stdout=None, stderr=subprocess.PIPE,
                           text=True)
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


def weight_cache_parent(nbytes: int, tmp: str):
    """``/dev/shm`` when it has room for the weights (+1 GiB), else ``tmp`` when it has, else None."""
    for d in ("/dev/shm", tmp):
        try:
            if os.path.isdir(d) and shutil.disk_usage(d).free >= nbytes + GiB:
                return d
        except OSError:
            continue
    return None


def make_weight_cache(spec: RunSpec, opts: DriverOptions, data: dict, tmp: str, stack) -> RunSpec:
    """Run the ``weights`` generator once (subprocess or in-process); the spec with its cache
    directory, or unchanged (every process then generates its own weights)."""
    parent = weight_cache_parent(spec.weight_bytes, tmp)
    info = {"parent": parent}
    data["meta"]["weight_cache"] = info
    if parent is None:
        info["note"] = "no room for a weight cache in /dev/shm or the temporary directory: every process generates"
        log(info["note"])
        return spec
    cached = spec.replace(weights_cache=stack.enter_context(
        tempfile.TemporaryDirectory(prefix="gpu_stack_weights_", dir=parent)))
    log(f"generating the weights once into {cached.weights_cache}")
    if opts.isolate == "process":
        res = run_isolated(cached, opts, "weights", None, tmp, None)
    else:
        res = _run_here(cached, "weights", None)
    res = res[0]
    info.update({k: res.get(k) for k in ("gen_s", "process_wall_s", "error") if res.get(k) is not None})
    if "error" in res:
        log("weight cache failed; every process generates its own weights")
        return spec
    return cached


def drive(spec: RunSpec, opts: DriverOptions, argv=None) -> dict:
    """Run every planned variant; save after each; print the markdown table last. Returns the result.

    ``argv``: the options recorded in ``meta`` (default ``sys.argv[1:]``), after
    ``python -m benchmarks.gpu_stack``.
    """
    import jax  # version only: the backend is not initialised in this process in isolate=process mode

    argv = ["-m", "benchmarks.gpu_stack"] + list(sys.argv[1:] if argv is None else argv)
    out_dir = Path(opts.out_dir)
    data = {"meta": {"command": " ".join(shlex.quote(a) for a in [sys.executable] + argv),
                     "argv": argv, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                     "host": platform.node(), "python": platform.python_version(), "jax_version": jax.__version__,
                     "d": spec.d, "f": spec.f, "layers": spec.layers, "tokens": list(spec.tokens), "reps": spec.reps,
                     "warmup": spec.warmup, "seed": spec.seed, "isolate": opts.isolate,
                     "weight_bytes": spec.weight_bytes, "spec": spec.to_dict(), "targets": DEFAULT_TARGETS.to_dict(),
                     "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "JAX_PLATFORMS",
                                                            "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
                                                            "XLA_PYTHON_CLIENT_MEM_FRACTION")}},
            "bandwidth": None, "results": []}
    t0 = time.perf_counter()
    todo = plan(opts.variants, spec.tokens, opts.accelerate)
    log(f"{len(todo)} runs planned, isolate={opts.isolate}, results to {out_dir}")
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu_stack_"))
        cache_dir = os.path.join(tmp, "jax_cache") if opts.compile_cache else None
        for variant, tokens in todo:
            if variant != "bandwidth" and opts.weight_cache and "weight_cache" not in data["meta"]:
                spec = make_weight_cache(spec, opts, data, tmp, stack)
            elapsed = time.perf_counter() - t0
            if elapsed > opts.budget_s:
                data["results"] += [{"variant": variant, "tokens": t,
                                     "skipped": f"time budget {opts.budget_s:.0f} s used up"} for t in (tokens or [None])]
                log(f"skip {variant} T={tokens}: budget")
                continue
            log(f"run {variant} T={tokens} (elapsed {elapsed:.0f} s)")
            if opts.isolate == "process":
                results = run_isolated(spec, opts, variant, tokens, tmp, cache_dir)
            else:
                results = _run_here(spec, variant, tokens)
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
    return data
