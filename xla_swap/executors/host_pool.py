"""PJRT GPU's pinned host memory pool sized from what a plan needs.

PJRT GPU allocates ``pinned_host`` buffers from a pool it caps at
``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` GiB (default 64), read once, when jax creates its GPU
client. A model whose weights (plus, in training, optimizer state; in serving, a KV cache kept
on the host) need more fails to place them on the default. :func:`ensure_host_memory_limit`
sets the variable from the bytes needed before the backend starts, and raises an error naming
the variable when the backend has started with a pool too small.

By default the pool grows on demand, in regions that double in size, and a region allocated
during a step pins its pages then: on 4 H200s the first timed steps of a training run took
1.06 and 1.28 s against 0.150 s after (``benchmarks/results/four_gpu/run3/pool_stall.md``).
``preallocate=True`` sets ``XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE`` too: PJRT pins the whole pool
when its client starts (there, 4 x 16 GiB in 25 s) and no step waits for it.

The module imports jax only (no torch).
"""
from __future__ import annotations

import math
import os
from typing import Callable, MutableMapping

from .pjrt.host_memory import DEFAULT_GPU_HOST_MEMORY_LIMIT_GB, HOST_MEMORY_LIMIT_ENV

__all__ = ["ensure_host_memory_limit", "pool_gib_needed", "HOST_MEMORY_LIMIT_ENV", "HOST_MEMORY_PREALLOCATE_ENV"]

#: The environment variable that makes PJRT GPU pin its whole pinned host pool when its client starts.
HOST_MEMORY_PREALLOCATE_ENV = "XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE"


def ensure_host_memory_limit(nbytes: int, *, headroom: float = 1.1, preallocate: bool = False,
                             environ: MutableMapping[str, str] | None = None,
                             initialized: Callable[[], bool] | None = None) -> int:
    """Make PJRT GPU's pinned host pool hold ``nbytes``: set ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``.

    The pool is per device: with weights split over N GPUs, pass one device's share (a pool sized for
    the whole model is allocated N times, and the host runs out of memory).

    The pool needed is ``ceil(nbytes x headroom / 2**30)`` GiB. When the variable (or, unset, the
    default of 64 GiB) already allows that, nothing changes. Otherwise, before jax's backends
    exist, the variable is set to that many GiB; after, the pool can no longer change and the
    call raises.

    With ``preallocate``, ``XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=true`` is set as well, and an unset
    limit is set to the pool needed (not left at the default): the whole pool is pinned once, when
    the client starts, so no step stalls while it grows (module docstring). Pinning takes time and
    host memory up front: size ``nbytes`` to what this process's devices hold.

    Args:
      nbytes: bytes the plan keeps in ``pinned_host`` (e.g. ``runtime.weight_nbytes`` plus the
        optimizer state or a host KV cache), an int >= 0.
      headroom: factor over ``nbytes`` for the pool (>= 1; default 1.1: transient copies, pool
        fragmentation).
      preallocate: pin the whole pool when jax's GPU client starts (a bool; default False: it grows
        on demand).
      environ: the environment to read and write (default ``os.environ``; tests pass a dict).
      initialized: ``() -> bool``, whether jax's backends have started (default: jax's own
        answer, ``xla_swap._compat.jax.backends_initialized``; tests pass their own).

    Returns: the pool size in GiB in force for the next backend start (an int).

    Raises:
      ValueError: ``nbytes`` not an int >= 0; ``headroom < 1``; ``preallocate`` not a bool; a
        variable holds something other than a number of GiB >= 0 or a boolean (named).
      RuntimeError: the pool must grow, or be preallocated and is not, but jax's backends have
        started already: the message names the variable and the value to set before jax starts
        (before the first ``jax.devices()`` or array, e.g. at the top of the script or in the shell).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0 (bytes), got {nbytes!r}")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not headroom >= 1 \
            or not math.isfinite(headroom):
        raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}")
    if not isinstance(preallocate, bool):
        raise ValueError(f"preallocate must be a bool, got {preallocate!r}")
    env = os.environ if environ is None else environ
    if initialized is None:
        from xla_swap._compat.jax import backends_initialized as initialized
    need = pool_gib_needed(nbytes, headroom)
    value = env.get(HOST_MEMORY_LIMIT_ENV)
    current = _pool_gib(value)
    pinned_at_start = _preallocated(env.get(HOST_MEMORY_PREALLOCATE_ENV))
    grow = current < need
    if initialized():
        if grow or preallocate and not pinned_at_start:
            late = f"{HOST_MEMORY_LIMIT_ENV}={need}" if grow else f"{HOST_MEMORY_PREALLOCATE_ENV}=true"
            raise RuntimeError(
                f"the plan keeps {nbytes} bytes in pinned_host, which needs a PJRT GPU host pool of {need} GiB"
                f"{' pinned at start' if preallocate else ''}, but jax's backend has started with "
                f"{HOST_MEMORY_LIMIT_ENV}={value if value is not None else 'unset'} ({int(current)} GiB) and "
                f"{HOST_MEMORY_PREALLOCATE_ENV}={env.get(HOST_MEMORY_PREALLOCATE_ENV, 'unset')}; set {late} "
                "before jax starts (in the shell, or before the first jax.devices() / array of the process)")
        return int(current)
    if preallocate:
        env[HOST_MEMORY_PREALLOCATE_ENV] = "true"
        grow = grow or value is None   # unset, PJRT would pin its own default rather than the need
    if grow:
        env[HOST_MEMORY_LIMIT_ENV] = str(need)
        return need
    return int(current)


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


def _preallocated(value: str | None) -> bool:
    """Whether ``XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=value`` pins the pool at start (unset: no).
    Raises ValueError: not a boolean (``true``/``false``/``1``/``0``, any case)."""
    if value is None:
        return False
    if value.strip().lower() in ("1", "true"):
        return True
    if value.strip().lower() in ("0", "false"):
        return False
    raise ValueError(f"{HOST_MEMORY_PREALLOCATE_ENV}={value!r} is not a boolean (true, false, 1 or 0)")
