"""Byte units and the log line shared by the benchmark's modules (standard library only)."""
from __future__ import annotations

import time

GiB = 2 ** 30
MiB = 2 ** 20


def log(msg: str) -> None:
    """Print ``[gpu_stack HH:MM:SS] msg`` to stdout, flushed (the run's progress log)."""
    print(f"[gpu_stack {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def gib(nbytes) -> str:
    """``nbytes`` (int or None) as GiB with two decimals, ``"-"`` for None."""
    return "-" if nbytes is None else f"{nbytes / GiB:.2f}"
