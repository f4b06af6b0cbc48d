"""``xla_swap.executors.pjrt`` still offers every public name it offered before it was split into the
``pjrt*.py`` modules (the shape rules of every module of ``xla_swap/`` are in test_package_shape.py)."""
from __future__ import annotations

#: What ``from xla_swap.executors.pjrt import ...`` offers to callers (tests, benchmarks, examples, host_pool).
PJRT_PUBLIC_NAMES = ("PjrtExecutor", "ParameterPlacement", "ParameterInfo", "MemoryReport", "HostMemoryError",
                     "PolicyPlacements", "placements_for_policy", "compile_lowered", "MEMORY_KINDS", "DEVICE",
                     "PINNED_HOST", "HOST_MEMORY_LIMIT_ENV", "HOST_MEMORY_SPACE", "DEFAULT_GPU_HOST_MEMORY_LIMIT_GB")


def test_pjrt_keeps_its_public_names():
    from xla_swap import executors
    from xla_swap.executors.pjrt import executor as pjrt
    missing = [n for n in PJRT_PUBLIC_NAMES if not hasattr(pjrt, n)]
    assert not missing, missing
    assert all(getattr(executors, n) is getattr(pjrt, n) for n in executors.__all__ if hasattr(pjrt, n))
