"""Host-memory leak check of construct / call / drop cycles.

Builds, calls and drops the same model ``--cycles`` times, one case after another in one
process, and samples the process RSS (``/proc/self/statm``, bytes) after each cycle (after
``gc.collect()``); on a backend with memory statistics (GPU) also the device's
``bytes_in_use``. The figure is the least-squares slope over the second half of the cycles
(KiB per cycle; the first half is warm-up: allocator pools, jax's bounded caches filling). With
glibc each sample is taken after ``malloc_trim(0)``, so it counts memory in use rather than free
heap that malloc keeps for reuse (a one-off arena growth of the raw RSS is not a leak); the raw
RSS and its slope are recorded too, and per cycle the Python heap's block count and the entries of
jax's in-memory caches (``xla_swap._compat.jax.tracing_cache_entries``): they tell a leak of Python
objects or of jax cache entries from native memory; where it can be read (CPython 3.11 with libpython's
symbols, ``interned_table.interned_table_reader``), the size of CPython's interned-string table, whose
one-time rebuild at twice its slots is a ~0.9 MiB RSS step with no string more alive (see
``benchmarks/results/leak_cycles/README.md``). Two settings make the samples count memory in use
(both recorded in the JSON, both can be turned off): glibc's trim and mmap thresholds are fixed at
128 KiB (``--malloc-thresholds``: the top of a thread's arena is returned, which ``malloc_trim``
does not do), and after each case's first cycle the interned-string table is rebuilt at the size
it keeps (``--no-settle-interned``: its one-time growth then falls at an arbitrary cycle).
Target: below 1 KiB per cycle for every case. Cases:

* ``runtime_forward``: ``StreamingRuntime`` of a 4-stage ``h + tanh(h @ a) @ b`` stack
  (module-level stage function, as a user writes it), one ``forward``.
* ``runtime_train``: the same with ``AdamW``: one ``forward`` and one ``train_step``
  (module-level loss, targets in ``loss_args``).
* ``stack``: ``SwappedStack`` of a tiny ``transformers`` Llama (``LlamaConfig``: 2 layers,
  hidden 32) with ``torch.optim.AdamW``: one ``forward`` and one ``train_step``. The model and
  its torch optimizer are built once; every cycle builds a new stack from its modules.

Per case it also counts the dropped objects still alive after ``gc.collect()`` (weak
references; must be 0) and those freed by reference counting alone, before any collection
(a reference cycle delays freeing the host buffers until the collector runs).

    JAX_PLATFORMS=cpu PYTHONPATH=. taskset -c 1 python benchmarks/leak_cycles.py --cycles 300 \\
        --compile-cache /tmp/jax_cache --out benchmarks/results/leak_cycles/leak_cycles.json
    # GPU (unchanged): PYTHONPATH=. python benchmarks/leak_cycles.py --cycles 300 --out $OUT/leak_cycles.json

Nothing is written without ``--out``; the table is printed either way. Exit status 0 when every
case's RSS slope (and device slope, where measured) is below the target, else 1.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import sys
import time
import warnings
import weakref

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")
#: Target RSS (and device memory) slope, KiB per cycle.
TARGET_KIB = 1.0
CASES = ("runtime_forward", "runtime_train", "stack")


def rss_bytes() -> int:
    """Resident set size of this process (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _libc_malloc_trim():
    """glibc's ``malloc_trim`` (returns free heap memory to the OS), or ``None`` elsewhere."""
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def trimmed_rss_bytes() -> int | None:
    """RSS after ``malloc_trim(0)``: memory in use, without the free heap malloc keeps for reuse
    (a one-off jump of the raw RSS when malloc grows an arena is not a leak). ``None`` without glibc."""
    if _MALLOC_TRIM is None:
        return None
    _MALLOC_TRIM(0)
    return rss_bytes()


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (every field ``size_t``)."""
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc_mallinfo2():
    """glibc's ``mallinfo2`` (glibc >= 2.33), or ``None`` elsewhere."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    return fn


_MALLINFO2 = _libc_mallinfo2()


def malloc_in_use_bytes() -> int | None:
    """Bytes malloc has handed out and not had back, over all arenas (``mallinfo2``: ``uordblks``
    + ``hblkhd``, the mmap'd chunks); ``None`` without glibc >= 2.33. Unlike the RSS it does not
    move with fragmentation or with free memory malloc keeps; it does not count Python's small
    objects (pymalloc's own arenas: ``python_blocks``) nor memory mapped without malloc."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return int(m.uordblks + m.hblkhd)


#: glibc's ``mallopt`` parameters (``malloc.h``).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: ``--malloc-thresholds``' default: glibc's initial trim and mmap thresholds (128 KiB).
MALLOC_THRESHOLDS = 128 * 1024


def fix_malloc_thresholds(nbytes: int) -> bool:
    """Fix glibc's trim and mmap thresholds at ``nbytes`` (``mallopt``), which turns their dynamic raising off.

    glibc raises the mmap threshold (up to 32 MiB) and the trim threshold (twice it) each time a
    chunk it had mmap'd is freed;
    free memory at the top of a thread's arena below the trim threshold then stays resident, and
    ``malloc_trim(0)`` does not return it (it returns the top of the main arena only). With the
    thresholds fixed, ``free`` returns the top of every arena above ``nbytes`` and chunks of
    ``nbytes`` or more are mmap'd, so the trimmed RSS counts memory in use in the threads' arenas too.
    Returns whether both calls succeeded (``False`` without glibc). ``ValueError`` for ``nbytes < 1``.
    """
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, nbytes)) and bool(mallopt(M_MMAP_THRESHOLD, nbytes))


def device_bytes_in_use() -> int | None:
    """``bytes_in_use`` of the first jax device, or ``None`` where the backend has no statistics (CPU)."""
    import jax
    stats = jax.devices()[0].memory_stats()
    return None if not stats or "bytes_in_use" not in stats else int(stats["bytes_in_use"])


def slope_per_cycle(samples: list) -> float:
    """Least-squares slope of the second half of ``samples`` (units per cycle); 0.0 for < 4 samples."""
    y = np.asarray(samples[len(samples) // 2:], np.float64)
    if len(y) < 2:
        return 0.0
    return float(np.polyfit(np.arange(len(y)), y, 1)[0])


# ---------------------------------------------------------------- the cases
def _layer(p, h):
    import jax.numpy as jnp
    return h + jnp.tanh(h @ p["a"]) @ p["b"]


def _mse(out, t):
    import jax.numpy as jnp
    return jnp.mean((out - t) ** 2)


def _runtime_case(train: bool):
    """``(build, call)`` of a small ``StreamingRuntime`` (with ``AdamW`` when ``train``)."""
    import jax
    from xla_swap.executors import RuntimeConfig, StreamingRuntime
    from xla_swap.planning import AdamW
    rng = np.random.default_rng(0)
    params = [{"a": rng.standard_normal((32, 64), np.float32) * 0.1,
               "b": rng.standard_normal((64, 32), np.float32) * 0.1} for _ in range(4)]
    x = rng.standard_normal((16, 32), np.float32)
    t = rng.standard_normal((16, 32), np.float32)

    def build():
        return StreamingRuntime(_layer, params, RuntimeConfig(prefetch_depth=2, track_residency=False),
                                optimizer=AdamW(lr=1e-3) if train else None)

    def call(rt):
        out = [rt.forward(x)]
        if train:
            out.append(rt.train_step(x, _mse, loss_args=(t,))[0])
        jax.block_until_ready(out)
    return build, call


def _stack_case():
    """``(build, call)`` of a ``SwappedStack`` over a tiny ``transformers`` Llama with ``torch.optim.AdamW``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from xla_swap.stack import SwappedStack, causal_lm_stages
    vocab = 64
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    first, layers, last = causal_lm_stages(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 9), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]

    def ce(logits, labels):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    def build():
        return SwappedStack(layers, first=first, last=last, loss_fn=ce, optimizer=opt)

    def call(stack):
        stack(x)
        stack.train_step(x, y)
    return build, call


def _make(case: str):
    if case == "runtime_forward":
        return _runtime_case(train=False)
    if case == "runtime_train":
        return _runtime_case(train=True)
    if case == "stack":
        return _stack_case()
    raise ValueError(f"case must be one of {CASES}, got {case!r}")


def _sample(samples: dict, c: int, interned) -> None:
    """Write cycle ``c``'s samples into ``samples``' arrays (left at -1 where one is not available)."""
    from xla_swap._compat.jax import tracing_cache_entries
    for k, v in (("rss", rss_bytes()), ("trimmed", trimmed_rss_bytes()), ("in_use", malloc_in_use_bytes()),
                 ("dev", device_bytes_in_use()), ("blocks", sys.getallocatedblocks()),
                 ("entries", tracing_cache_entries())):
        if v is not None:
            samples[k][c] = v
    if interned is not None:
        t = interned()
        samples["table_live"][c], samples["table_log2"][c] = t["live"], t["log2_slots"]


def run_case(case: str, cycles: int, settle_interned: bool = True) -> dict:
    """``cycles`` build / call / drop cycles of ``case``; RSS (and device memory) after each.

    ``settle_interned``: after the first cycle's samples, have CPython rebuild its interned-string
    table at the size it keeps for the strings live then (``interned_table.settle_interned_table``),
    so that its one-time growth falls between the first and the second sample, not at an arbitrary
    cycle (``interned_settle``: the strings it took, the table before and after, the trimmed RSS
    before and after; ``None`` when off).

    Returns: a dict with ``rss_bytes`` (one sample per cycle) and its ``raw_rss_slope_kib_per_cycle``
    (second half), ``trimmed_rss_bytes`` (after ``malloc_trim(0)``; ``None`` without glibc),
    ``rss_slope_kib_per_cycle`` (the figure the target applies to: the trimmed samples' slope where
    there are some, else the raw), ``python_blocks`` (``sys.getallocatedblocks()``) and
    ``jax_cache_entries`` (entries of jax's in-memory caches) per cycle with their slopes,
    ``malloc_in_use_bytes`` (:func:`malloc_in_use_bytes`; ``None`` without glibc >= 2.33) and its
    ``malloc_in_use_slope_kib_per_cycle``,
    ``interned_live`` / ``interned_log2_slots`` (CPython's interned-string table per cycle: live
    strings, log2 of its slots; ``None`` where it cannot be read),
    ``device_bytes_in_use`` / ``device_slope_kib_per_cycle`` (``None`` without
    memory statistics), ``alive_after_gc`` (dropped objects still alive: should be 0),
    ``freed_by_refcount`` (dropped objects dead before ``gc.collect()``), ``live_arrays_start`` /
    ``live_arrays_end`` (``jax.live_arrays()`` after the first cycle and after the last),
    ``interned_settle`` and ``seconds``.
    """
    import jax
    build, call = _make(case)
    from interned_table import interned_table_reader, settle_interned_table
    try:
        interned = interned_table_reader()
    except RuntimeError:
        interned = None
    settle = None
    # Samples go to arrays allocated before the cycles (-1: not available), so that sampling allocates
    # nothing per cycle; a dropped object's weak reference is kept only while the object is alive.
    names = ("rss", "trimmed", "in_use", "dev", "blocks", "entries", "table_live", "table_log2")
    samples = {k: np.full(cycles, -1, np.int64) for k in names}
    alive, by_refcount, live_start = [], 0, None
    gc.collect()
    t0 = time.perf_counter()
    for c in range(cycles):
        obj = build()
        call(obj)
        ref = weakref.ref(obj)
        del obj
        by_refcount += ref() is None
        gc.collect()
        if ref() is not None:
            alive.append(ref)
        del ref
        _sample(samples, c, interned)
        if c == 0:
            live_start = len(jax.live_arrays())
            if settle_interned:
                before = int(samples["trimmed"][0])
                settle = settle_interned_table(interned)
                settle.update(trimmed_rss_before=None if before < 0 else before, trimmed_rss_after=trimmed_rss_bytes())
    seconds = time.perf_counter() - t0
    rss, trimmed, in_use, dev, blocks, entries, table_live, table_log2 = (
        None if (samples[k] < 0).any() else samples[k].tolist() for k in names)
    return {"case": case, "cycles": cycles, "seconds": seconds,
            "rss_bytes": rss, "rss_first": rss[0], "rss_last": rss[-1],
            "raw_rss_slope_kib_per_cycle": slope_per_cycle(rss) / 1024,
            "trimmed_rss_bytes": trimmed,
            "rss_slope_kib_per_cycle": slope_per_cycle(trimmed if trimmed is not None else rss) / 1024,
            "malloc_in_use_bytes": in_use,
            "malloc_in_use_slope_kib_per_cycle": None if in_use is None else slope_per_cycle(in_use) / 1024,
            "python_blocks": blocks, "python_blocks_slope_per_cycle": slope_per_cycle(blocks),
            "jax_cache_entries": entries, "jax_cache_entries_slope_per_cycle": slope_per_cycle(entries),
            "interned_live": table_live, "interned_log2_slots": table_log2,
            "device_bytes_in_use": dev,
            "device_slope_kib_per_cycle": None if dev is None else slope_per_cycle(dev) / 1024,
            "alive_after_gc": sum(r() is not None for r in alive), "freed_by_refcount": by_refcount,
            "live_arrays_start": live_start, "live_arrays_end": len(jax.live_arrays()), "interned_settle": settle}


def passed(r: dict) -> bool:
    """Whether a case's result meets the target (slopes below ``TARGET_KIB``, nothing left alive)."""
    ok = r["rss_slope_kib_per_cycle"] < TARGET_KIB and r["alive_after_gc"] == 0
    if r["device_slope_kib_per_cycle"] is not None:
        ok = ok and r["device_slope_kib_per_cycle"] < TARGET_KIB
    return ok


def table(results: list) -> str:
    """The printed summary: one row per case."""
    head = ("| case | cycles | s/cycle | RSS first -> last (MiB) | RSS slope, 2nd half (KiB/cycle) "
            "| raw RSS slope | malloc in use slope | device slope (KiB/cycle) | Python blocks / cycle | jax cache entries (last; / cycle) "
            "| interned strings: slots first -> last (live last) | alive after gc | freed by refcount | live arrays | pass |")
    rows = [head, "|" + "---|" * 15]
    for r in results:
        dslope = "-" if r["device_slope_kib_per_cycle"] is None else f"{r['device_slope_kib_per_cycle']:.2f}"
        lg, live = r.get("interned_log2_slots"), r.get("interned_live")
        mslope = r.get("malloc_in_use_slope_kib_per_cycle")
        mslope = "-" if mslope is None else f"{mslope:.2f}"
        table_s = "-" if not lg else f"2^{lg[0]} -> 2^{lg[-1]} ({live[-1]})"
        rows.append(f"| {r['case']} | {r['cycles']} | {r['seconds'] / r['cycles']:.3f} "
                    f"| {r['rss_first'] / 2 ** 20:.1f} -> {r['rss_last'] / 2 ** 20:.1f} "
                    f"| {r['rss_slope_kib_per_cycle']:.2f} | {r['raw_rss_slope_kib_per_cycle']:.2f} | {mslope} | {dslope} "
                    f"| {r['python_blocks_slope_per_cycle']:.1f} "
                    f"| {r['jax_cache_entries'][-1]}; {r['jax_cache_entries_slope_per_cycle']:.1f} | {table_s} "
                    f"| {r['alive_after_gc']} "
                    f"| {r['freed_by_refcount']}/{r['cycles']} | {r['live_arrays_start']} -> {r['live_arrays_end']} "
                    f"| {'yes' if passed(r) else 'NO'} |")
    return "\n".join(rows)


def _version(package: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=300, help="build / call / drop cycles per case (>= 2)")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--out", default=None, help="JSON path for the results (nothing written without it)")
    ap.add_argument("--compile-cache", default=None, metavar="DIR",
                    help="use jax's persistent compilation cache in DIR (every executable cached): each cycle "
                         "still builds, traces, lowers and loads its executables, but loads them from DIR instead "
                         "of compiling them again (on a small CPU a cycle of the stack compiles for seconds)")
    ap.add_argument("--no-settle-interned", action="store_true",
                    help="do not rebuild CPython's interned-string table after each case's first cycle (its "
                         "one-time growth then falls at whichever cycle uses up its free insertions)")
    ap.add_argument("--malloc-thresholds", type=int, default=MALLOC_THRESHOLDS, metavar="BYTES",
                    help="fix glibc's trim and mmap thresholds at BYTES before the cases (default: glibc's initial "
                         "128 KiB, without their dynamic raising; 0: leave them dynamic); see fix_malloc_thresholds")
    args = ap.parse_args(argv)
    if args.cycles < 2:
        ap.error(f"--cycles must be >= 2, got {args.cycles}")
    if args.malloc_thresholds < 0:
        ap.error(f"--malloc-thresholds must be >= 0, got {args.malloc_thresholds}")
    thresholds = None
    if args.malloc_thresholds and fix_malloc_thresholds(args.malloc_thresholds):
        thresholds = args.malloc_thresholds
    import jax
    cache_opts = {"jax_compilation_cache_dir": args.compile_cache,
                  "jax_persistent_cache_min_compile_time_secs": 0.0,
                  "jax_persistent_cache_min_entry_size_bytes": 0} if args.compile_cache else {}
    saved = {k: getattr(jax.config, k) for k in cache_opts}
    try:
        for k, v in cache_opts.items():
            jax.config.update(k, v)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = [run_case(c, args.cycles, not args.no_settle_interned) for c in args.cases]
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
    ok = all(passed(r) for r in results)
    print(table(results))
    print(("PASS" if ok else "FAIL") + f": slope < {TARGET_KIB} KiB/cycle and nothing alive after gc.collect()")
    if args.out:
        d = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(d, exist_ok=True)
        out = {"command": " ".join(sys.argv if argv is None else ["leak_cycles.py"] + list(argv)),
               "env": {k: os.environ[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS", "PJRT_DEVICE") if k in os.environ},
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
               "versions": {p: _version(p) for p in ("jax", "jaxlib", "torch", "torchax", "transformers")},
               "cpu_affinity": sorted(os.sched_getaffinity(0)), "target_kib_per_cycle": TARGET_KIB,
               "compile_cache": bool(args.compile_cache), "settle_interned": not args.no_settle_interned,
               "malloc_thresholds": thresholds,
               "pass": ok, "results": results}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
