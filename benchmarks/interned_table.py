"""CPython 3.11's table of interned strings, read and settled: what ``leak_interned.py`` reports and
``leak_cycles.py`` settles before it measures (both import it from here).

Reads interpreter memory through ``ctypes``: CPython 3.11 on Linux only, with the symbol table of
``libpython3.11.so`` (``nm``); :func:`interned_table_reader` raises ``RuntimeError`` elsewhere.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

__all__ = ["keys_object_nbytes", "interned_table_reader", "BLIND_SETTLE_STRINGS", "settle_interned_table"]


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
