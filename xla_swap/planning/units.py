"""Units and number checks shared by the planning modules.

Bytes for sizes, seconds for times, GB/s (1e9 bytes/s) for link bandwidths; GiB (2**30 bytes)
appears only in messages and tables. Pure Python.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Mapping

__all__ = ["GB", "GiB", "MAX_BYTES", "REL_TIE", "MAX_PREFETCH_DEPTH", "as_prefetch_depth", "as_bytes", "check_budget_bytes", "as_float", "as_amount", "from_dict", "gib"]

#: Bytes per GB (link bandwidths are in GB/s, as in docs/explanation/measured-facts.md).
GB = 1_000_000_000
#: Bytes per GiB (used in messages and tables only).
GiB = 1 << 30

#: Largest byte count accepted anywhere (2**63 - 1, what an int64 byte counter holds): larger
#: values are typos, and would overflow the float arithmetic of the time model.
MAX_BYTES = (1 << 63) - 1

#: Relative tolerance under which two predicted step times count as equal (the planner's and the
#: chooser's tie-breaks).
REL_TIE = 1e-9

#: Largest prefetch depth the planner and the chooser search.
MAX_PREFETCH_DEPTH = 16


def as_prefetch_depth(name: str, value) -> int:
    """``value`` as a prefetch depth, an ``int`` in ``1..MAX_PREFETCH_DEPTH``.

    Raises: ValueError: not an int (or a bool), or out of range; the message names ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= MAX_PREFETCH_DEPTH:
        raise ValueError(f"{name} must be an int in 1..{MAX_PREFETCH_DEPTH}, got {value!r}")
    return int(value)


def as_bytes(owner: str, field: str, value) -> int:
    """``value`` as a whole number of bytes in ``0..MAX_BYTES`` (an int, or a float with no fraction).

    Args:
      owner, field: name the value in messages as ``owner.field``.
      value: the byte count to check.

    Returns: int, bytes.

    Raises:
      TypeError: ``value`` is not a real number (or is a bool).
      ValueError: negative, fractional, not finite, or above ``MAX_BYTES``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}.{field} must be a non-negative integer number of bytes, got {value!r}")
    if isinstance(value, numbers.Integral):
        value = int(value)
    else:
        try:
            value = float(value)
        except OverflowError:
            raise ValueError(f"{owner}.{field} must be <= 2**63 - 1 bytes, got {value!r}") from None
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{owner}.{field} must be a whole number of bytes, got {value!r}")
        value = int(value)
    if value < 0:
        raise ValueError(f"{owner}.{field} must be >= 0 bytes, got {value}")
    if value > MAX_BYTES:
        raise ValueError(f"{owner}.{field} must be <= 2**63 - 1 bytes, got a number with {len(str(value))} digits")
    return value


def check_budget_bytes(value, name: str = "budget_bytes", *, optional: bool = False) -> int | None:
    """``value`` as a device-memory budget: an ``int`` number of bytes in ``1..MAX_BYTES``.

    The one check of every entry point that takes a budget (``plan``, ``choose_schedule``,
    ``xla_swap.executors.streaming.calibrate.autotune``, ``SwappedStack(budget_bytes=...)`` and its
    ``autotune``, ``generate``'s ``device_budget_bytes``), so a bad value fails alike at each.

    Args:
      value: the budget; any integral number (``numpy.int64`` too), not a bool or a float.
      name: the argument's name in messages.
      optional: ``None`` is accepted (and returned) instead of a budget.

    Returns: ``int(value)``, bytes (``None`` for ``None`` when ``optional``).

    Raises: the message names ``name`` and what it must be:
      TypeError: a bool, or not a real number (``"1GB"``).
      ValueError: ``None`` when not ``optional`` (required); a real number that is not a whole
        ``int`` > 0 (``0``, ``-1``, ``1.5``, ``2.0``); above ``MAX_BYTES``.
    """
    what = f"{name} must be a positive int (bytes), got {value!r}"   # the same words, optional or not
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name} is required: a positive int (bytes), got None")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(what)
    if not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(what)
    if value > MAX_BYTES:
        raise ValueError(f"{name} must be <= 2**63 - 1 bytes, got a number with {len(str(int(value)))} digits")
    return int(value)


def as_float(owner: str, field: str, value, *, positive: bool) -> float:
    """``value`` as a finite float ``>= 0`` (``> 0`` when ``positive``).

    Raises: TypeError: not a real number (or a bool); ValueError: not finite or out of range
    (the message names ``owner.field``).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}.{field} must be a real number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "> 0" if positive else ">= 0"
        raise ValueError(f"{owner}.{field} must be finite and {need}, got {value!r}")
    return value


def as_amount(owner: str, field: str, value) -> float:
    """``value`` as a finite number >= 0; an int or float in range passes as it is (the planner's hot path).

    Raises: as :func:`as_float`.
    """
    if type(value) in (int, float) and 0 <= value <= MAX_BYTES:
        return value
    return as_float(owner, field, value, positive=False)


def from_dict(cls, data: Mapping):
    """``cls(**data)`` for a dataclass ``cls``.

    Raises: TypeError: ``data`` is not a mapping; ValueError: a key is not a field of ``cls``
    (the message names the unknown keys and lists the known ones).
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__}.from_dict expects a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(map(repr, unknown))}; "
                         f"known fields: {', '.join(sorted(known))}")
    return cls(**data)


def gib(n: float) -> str:
    """``n`` bytes as text in GiB with three decimals, e.g. ``"1.500 GiB"``."""
    return f"{n / GiB:.3f} GiB"
