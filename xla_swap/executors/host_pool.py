"""PJRT GPU's pinned host memory pool sized from what a plan needs.

PJRT GPU allocates ``pinned_host`` buffers from a pool it caps at
``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` GiB (default 64), read once, when jax creates its GPU
client. A model whose weights (plus, in training, optimizer state; in serving, a KV cache kept
on the host) need more fails to place them on the default. :func:`ensure_host_memory_limit`
sets the variable from the bytes needed before the backend starts, and raises an error naming
the variable when the backend has started with a pool too small.

The module imports jax only (no torch).
"""
from __future__ import annotations

import math
import os
from typing import Callable, MutableMapping

from .pjrt.host_memory import DEFAULT_GPU_HOST_MEMORY_LIMIT_GB, HOST_MEMORY_LIMIT_ENV

__all__ = ["ensure_host_memory_limit", "pool_gib_needed", "HOST_MEMORY_LIMIT_ENV"]


def ensure_host_memory_limit(nbytes: int, *, headroom: float = 1.1, environ: MutableMapping[str, str] | None = None,
                             initialized: Callable[[], bool] | None = None) -> int:
    """Make PJRT GPU's pinned host pool hold ``nbytes``: set ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``.

    The pool is per device: with weights split over N GPUs, pass one device's share (a pool sized for
    the whole model is allocated N times, and the host runs out of memory).

    The pool needed is ``ceil(nbytes x headroom / 2**30)`` GiB. When the variable (or, unset, the
    default of 64 GiB) already allows that, nothing changes. Otherwise, before jax's backends
    exist, the variable is set to that many GiB; after, the pool can no longer change and the
    call raises.

    Args:
      nbytes: bytes the plan keeps in ``pinned_host`` (e.g. ``runtime.weight_nbytes`` plus the
        optimizer state or a host KV cache), an int >= 0.
      headroom: factor over ``nbytes`` for the pool (>= 1; default 1.1: transient copies, pool
        fragmentation).
      environ: the environment to read and write (default ``os.environ``; tests pass a dict).
      initialized: ``() -> bool``, whether jax's backends have started (default: jax's own
        answer, ``xla_swap._compat.jax.backends_initialized``; tests pass their own).

    Returns: the pool size in GiB in force for the next backend start (an int).

    Raises:
      ValueError: ``nbytes`` not an int >= 0; ``headroom < 1``; the variable holds something
        other than a number of GiB >= 0 (named).
      RuntimeError: the pool must grow but jax's backends have started already: the message names
        ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` and the GiB to set before jax starts (before the
        first ``jax.devices()`` or array, e.g. at the top of the script or in the shell).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0 (bytes), got {nbytes!r}")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not headroom >= 1 \
            or not math.isfinite(headroom):
        raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}")
    env = os.environ if environ is None else environ
    if initialized is None:
        from xla_swap._compat.jax import backends_initialized as initialized
    need = pool_gib_needed(nbytes, headroom)
    value = env.get(HOST_MEMORY_LIMIT_ENV)
    current = _pool_gib(value)
    if current >= need:
        return int(current)
    if initialized():
        raise RuntimeError(
            f"the plan keeps {nbytes} bytes in pinned_host, which needs a PJRT GPU host pool of {need} GiB, but jax's "
            f"backend has started with {HOST_MEMORY_LIMIT_ENV}={value if value is not None else 'unset'} "
            f"({int(current)} GiB); set {HOST_MEMORY_LIMIT_ENV}={need} before jax starts (in the shell, or "
            "before the first jax.devices() / array of the process)")
    env[HOST_MEMORY_LIMIT_ENV] = str(need)
    return need


def pool_gib_needed(nbytes: int, headroom: float) -> int:
    """The PJRT GPU pinned pool, in whole GiB (at least 1), that holds ``nbytes`` bytes with ``headroom``
    (a factor >= 1): ``ceil(nbytes x headroom / 2**30)``, what :func:`ensure_host_memory_limit` sets."""
    return max(1, math.ceil(nbytes * headroom / (1 << 30)))


def _pool_gib(value: str | None) -> float:
    """The pinned host pool, in GiB, that ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=value`` gives PJRT GPU
    (its default when unset). Raises ValueError: not a finite number >= 0."""
    if value is None:
        return float(DEFAULT_GPU_HOST_MEMORY_LIMIT_GB)
    try:
        gib = float(value)
    except ValueError:
        raise ValueError(f"{HOST_MEMORY_LIMIT_ENV}={value!r} is not a number of GiB") from None
    if gib >= 0 and math.isfinite(gib):
        return gib
    raise ValueError(f"{HOST_MEMORY_LIMIT_ENV}={value!r} must be a finite number of GiB >= 0")
