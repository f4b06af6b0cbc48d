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

Reads interpreter memory through ``ctypes``: CPython 3.11 on Linux only, with the symbol table of
``libpython3.11.so`` (``nm``); :func:`interned_table_reader` raises ``RuntimeError`` elsewhere.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import warnings

import leak_cycles

def keys_object_nbytes(log2: int) -> int:
    """Bytes of a CPython 3.11 str-keyed dict's keys object with ``2 ** log2`` slots.

    A 32-byte header, 4-byte indices (one per slot, from 2^16 slots on) and 16-byte entries (two
    thirds of the slots). ``ValueError`` for ``log2`` below 16 (smaller indices) or above 31.
    """
    if not 16 <= log2 <= 31:
        raise ValueError(f"log2 must be in 16..31 (4-byte indices), got {log2}")
    slots = 1 << log2
    return 32 + 4 * slots + 16 * ((slots << 1) // 3)


def interned_table_reader():
    """A function returning the interned-string table's state as ``{"live", "log2_slots", "free"}`` (ints).

    ``live``: strings in the table; ``log2_slots``: log2 of its slots; ``free``: insertions left
    before CPython rebuilds it (a freed string leaves its entry used until then). Reads the static
    ``interned`` of ``Objects/unicodeobject.c`` at the address ``nm`` gives for the loaded
    ``libpython3.11.so``. Raises ``RuntimeError`` naming what is missing when this is not
    CPython 3.11 on Linux with a shared libpython that has its symbol table.
    """
    if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11):
        raise RuntimeError(f"needs CPython 3.11 (the dict layout is read directly), got "
                           f"{sys.implementation.name} {sys.version.split()[0]}")
    lib = base = None
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()
            if len(p) >= 6 and os.path.basename(p[5]).startswith("libpython3.11.so") and int(p[2], 16) == 0:
                lib, base = p[5], int(p[0].split("-")[0], 16)
                break
    if lib is None:
        raise RuntimeError("needs a Python linked to a shared libpython3.11.so (none is mapped)")
    try:
        out = subprocess.run(["nm", lib], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"needs `nm` and the symbol table of {lib}: {e}") from None
    offs = [int(p[0], 16) for p in (ln.split() for ln in out.splitlines()) if len(p) == 3 and p[2] == "interned"]
    if len(offs) != 1:
        raise RuntimeError(f"{lib} has {len(offs)} symbols named 'interned' (stripped?)")
    addr = base + offs[0]

    def read() -> dict:
        d = ctypes.c_void_p.from_address(addr).value        # PyDictObject *
        keys = ctypes.c_void_p.from_address(d + 32).value    # ma_keys
        return {"live": ctypes.c_ssize_t.from_address(d + 16).value,          # ma_used
                "log2_slots": ctypes.c_uint8.from_address(keys + 8).value,    # dk_log2_size
                "free": ctypes.c_ssize_t.from_address(keys + 16).value}       # dk_usable
    return read


#: Strings :func:`settle_interned_table` interns and frees where the table cannot be read: more
#: than the free insertions of any table of up to 2^19 slots (349525), so at least one rebuild.
BLIND_SETTLE_STRINGS = 1 << 19


def settle_interned_table(read=None) -> dict:
    """Have CPython rebuild its interned-string table now, at the size it keeps for the strings live now.

    Interns and frees fresh strings one at a time, as a cycle that loads executables from jax's
    persistent compilation cache does a few times (pathlib interns the cache file's name), until
    the table has been rebuilt once: CPython rebuilds it at the smallest power of two of at least 3x
    its live strings, so later rebuilds with the same live strings keep that size and the one-time
    growth (0.9 MiB from 2^16 to 2^17 slots, 3.7 MiB from 2^18 to 2^19) happens here instead of at
    an arbitrary cycle. No string stays interned. ``read``: :func:`interned_table_reader`'s function;
    with ``None`` (the table cannot be read) :data:`BLIND_SETTLE_STRINGS` strings are interned and
    freed, which rebuilds any table whose free insertions are fewer.

    Returns ``{"strings": int, "before": state, "after": state}`` (states as ``read`` returns them,
    ``None`` without ``read``). Raises ``RuntimeError`` if no rebuild is seen after
    :data:`BLIND_SETTLE_STRINGS` strings with ``read`` given.
    """
    prefix = f"leak-interned-settle-{os.getpid()}-"
    if read is None:
        for i in range(BLIND_SETTLE_STRINGS):
            sys.intern(prefix + str(i))
        return {"strings": BLIND_SETTLE_STRINGS, "before": None, "after": None}
    before = prev = read()
    for i in range(BLIND_SETTLE_STRINGS):
        sys.intern(prefix + str(i))
        now = read()
        if now["log2_slots"] != prev["log2_slots"] or now["free"] > prev["free"]:
            return {"strings": i + 1, "before": before, "after": now}
        prev = now
    raise RuntimeError(f"the interned-string table was not rebuilt after {BLIND_SETTLE_STRINGS} strings")


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
