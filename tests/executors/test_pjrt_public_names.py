"""``xla_swap.executors.pjrt.executor`` still offers every public name the executor module offered before it
was split into the modules of ``xla_swap/executors/pjrt/`` (the shape rules of every module of ``xla_swap/`` are
in test_package_shape.py)."""
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


def test_the_executor_packages_offer_their_runtimes():
    """``xla_swap.executors.pjrt`` and ``xla_swap.executors.streaming`` (packages) export the executor module's
    and the runtime module's own objects, and ``xla_swap.executors`` the same ones."""
    import importlib

    from xla_swap import executors
    from xla_swap.executors.pjrt import executor
    from xla_swap.executors.streaming import runtime
    pjrt_pkg = importlib.import_module("xla_swap.executors.pjrt")
    streaming_pkg = importlib.import_module("xla_swap.executors.streaming")
    assert pjrt_pkg.__all__ and all(getattr(pjrt_pkg, n) is getattr(executor, n) for n in pjrt_pkg.__all__)
    assert streaming_pkg.StreamingRuntime is runtime.StreamingRuntime is executors.StreamingRuntime
    assert all(getattr(executors, n) is getattr(pjrt_pkg, n) for n in pjrt_pkg.__all__)
