"""The pinned host memory pool of :class:`xla_swap.executors.PjrtExecutor`: its limit and its errors.

PJRT GPU allocates ``pinned_host`` arrays from a pool of ``$XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``
GiB (default 64); the CPU client has no such pool. The executor checks its placements against
that limit before placing, and turns the runtime's out-of-memory errors into
:class:`HostMemoryError`. Imports jax and numpy only.
"""
from __future__ import annotations

import math
import os

import jax
import numpy as np

from xla_swap.planning.policy import PINNED_HOST

#: The environment variable that caps PJRT GPU's pinned host memory pool (in GiB, default 64).
HOST_MEMORY_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
#: The PJRT GPU default of :data:`HOST_MEMORY_LIMIT_ENV`, in GiB.
DEFAULT_GPU_HOST_MEMORY_LIMIT_GB = 64
#: The jax platform names whose PJRT client has the pinned pool above.
GPU_PLATFORMS = ("cuda", "rocm", "gpu")
#: The ``host_memory_limit_bytes`` value that means "the platform's pool size".
AUTO = "auto"


class HostMemoryError(MemoryError):
    """Placing arrays in ``pinned_host`` memory would exceed (or did exceed) the pinned pool.

    Attributes:
      requested_bytes: bytes the failed operation needed in pinned host memory (all devices).
      in_use_bytes: bytes of live ``pinned_host`` arrays of this platform before it (or None
        when the error came from the runtime).
      limit_bytes: the limit checked against (None when the error came from the runtime).
    """

    def __init__(self, message: str, requested_bytes: int, in_use_bytes: int | None = None,
                 limit_bytes: int | None = None):
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.in_use_bytes = in_use_bytes
        self.limit_bytes = limit_bytes


def is_resource_exhausted(error: Exception) -> bool:
    """Whether a runtime error says that an allocation ran out of memory (any memory)."""
    msg = str(error)
    return "RESOURCE_EXHAUSTED" in msg or "Out of memory" in msg or "out of memory" in msg.lower()


def is_host_oom(error: Exception) -> bool:
    """Whether a runtime error says that pinned host memory ran out."""
    msg = str(error).lower()
    return is_resource_exhausted(error) and ("host" in msg or "pinned" in msg)


def default_host_limit(platform: str) -> int | None:
    """PJRT GPU's pinned pool size in bytes (``$XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` GiB); None on CPU.

    Args:
      platform: a jax platform name (``"cpu"``, ``"cuda"``, ...).

    Raises:
      ValueError: the variable is not a finite number of GiB >= 0 (the message names it).
    """
    if platform not in GPU_PLATFORMS:
        return None
    value = os.environ.get(HOST_MEMORY_LIMIT_ENV, str(DEFAULT_GPU_HOST_MEMORY_LIMIT_GB))
    try:
        gib = float(value)
    except ValueError:
        raise ValueError(f"{HOST_MEMORY_LIMIT_ENV}={value!r} is not a number of GiB") from None
    if not gib >= 0 or gib == float("inf"):
        raise ValueError(f"{HOST_MEMORY_LIMIT_ENV}={value!r} must be a finite number of GiB >= 0")
    return int(gib * (1 << 30))


def check_host_limit_arg(value) -> None:
    """ValueError naming ``host_memory_limit_bytes`` unless ``value`` is None, ``"auto"`` or an int >= 0."""
    if not (value is None or isinstance(value, str) and value == AUTO or isinstance(value, (int, np.integer))
            and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"host_memory_limit_bytes: expected None, 'auto' or a non-negative int, got {value!r}")


def pinned_host_bytes_in_use(platform: str) -> int:
    """Bytes of live ``pinned_host`` jax arrays of ``platform``, over all devices."""
    total = 0
    for array in jax.live_arrays(platform):
        sharding = array.sharding
        if sharding.memory_kind != PINNED_HOST:
            continue
        total += (int(math.prod(sharding.shard_shape(array.shape))) * array.dtype.itemsize
                  * len(sharding.addressable_devices))
    return total
