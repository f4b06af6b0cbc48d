"""The one-time RSS step of ``leak_cycles.py``'s runtime cases: CPython's table of interned strings.

Runs ``leak_cycles.py``'s cases (same ``build`` / ``call``, same ``--compile-cache``) and reads,
after each cycle, the state of CPython's interned-string table (the ``dict`` that
``sys.intern`` and ``pathlib`` use) beside the trimmed RSS: its live strings, its slots and the
insertions it can still take before it is rebuilt. A cycle that loads executables from jax's
persistent compilation cache interns one new string per executable (``pathlib`` interns the cache
file name jax builds with ``path / f"{key}-cache"``) and frees it after the cycle; the dict's free
insertions run out after a few hundred cycles and CPython rebuilds it at the smallest power of two
of at least 3x its live strings. With more than 21845 live strings a table of 2^16 slots
(keys object 961,216 bytes) is rebuilt at 2^17 (1,922,416 bytes, malloc'd with ``mmap``): a
one-time RSS step of 939 KiB, while the live strings stay flat. It stays at 2^17 until more than
43690 strings are live.

    JAX_PLATFORMS=cpu PYTHONPATH=. taskset -c 1 python benchmarks/leak_interned.py \\
        --plan runtime_forward:300 runtime_train:300 --compile-cache /tmp/jc --out /tmp/interned.json

The table is read by ``interned_table.py`` through ``ctypes``: CPython 3.11 on Linux only, with the
symbol table of ``libpython3.11.so`` (``nm``); ``interned_table_reader`` raises ``RuntimeError`` elsewhere.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import warnings

import leak_cycles
from interned_table import (BLIND_SETTLE_STRINGS, interned_table_reader, keys_object_nbytes,  # noqa: F401
                            settle_interned_table)

def run(plan: list, read) -> list:
    """Build / call / drop cycles per ``(case, cycles)`` of ``plan``; one row per cycle.

    Row: ``case``, ``cycle``, ``trimmed_rss_kib`` (RSS after ``malloc_trim(0)``, KiB), the
    table's state after the cycle (``live``, ``log2_slots``, ``free``) and ``inserted`` (strings the
    cycle added to the table; ``None`` for a cycle in which it was rebuilt).
    """
    rows = []
    for case, cycles in plan:
        build, call = leak_cycles._make(case)
        for c in range(cycles):
            before = read()
            obj = build()
            call(obj)
            del obj
            gc.collect()
            rss = leak_cycles.trimmed_rss_bytes()
            after = read()
            same = after["log2_slots"] == before["log2_slots"]
            rows.append({"case": case, "cycle": c, "trimmed_rss_kib": None if rss is None else rss >> 10, **after,
                         "inserted": before["free"] - after["free"] if same else None})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", nargs="+", default=["runtime_forward:300", "runtime_train:300"],
                    help="CASE:CYCLES, run in this order in one process")
    ap.add_argument("--compile-cache", default=None, metavar="DIR", help="jax's persistent compilation cache in DIR")
    ap.add_argument("--out", default=None, help="JSON path for the per-cycle rows")
    args = ap.parse_args(argv)
    plan = []
    for item in args.plan:
        case, _, n = item.partition(":")
        if case not in leak_cycles.CASES or not n.isdigit() or int(n) < 1:
            ap.error(f"--plan items must be CASE:CYCLES with CASE in {leak_cycles.CASES}, got {item!r}")
        plan.append((case, int(n)))
    read = interned_table_reader()
    import jax
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = run(plan, read)
    for prev, r in zip(rows, rows[1:]):
        if r["log2_slots"] != prev["log2_slots"] or (r["trimmed_rss_kib"] or 0) - (prev["trimmed_rss_kib"] or 0) > 300:
            print(f"{r['case']} cycle {r['cycle']}: trimmed RSS {r['trimmed_rss_kib'] - prev['trimmed_rss_kib']:+d} KiB, "
                  f"table 2^{prev['log2_slots']} -> 2^{r['log2_slots']} slots, live {prev['live']} -> {r['live']}")
    for case, _ in plan:
        ins = [r["inserted"] for r in rows if r["case"] == case and r["inserted"] is not None]
        live = [r["live"] for r in rows if r["case"] == case]
        print(f"{case}: live interned strings {min(live)}..{max(live)}, inserted per cycle (median) "
              f"{sorted(ins)[len(ins) // 2] if ins else '-'}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["leak_interned.py"] + list(sys.argv[1:] if argv is None else argv)),
                       "compile_cache": bool(args.compile_cache), "rows": rows}, f, indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
