"""The PJRT executor: a lowered XLA module run through PJRT with its entry parameters in ``pinned_host``."""
from xla_swap.executors.pjrt.executor import (HostMemoryError, ParameterInfo, ParameterPlacement, PjrtExecutor,
                                              PolicyPlacements, compile_lowered, placements_for_policy)

__all__ = ["HostMemoryError", "ParameterInfo", "ParameterPlacement", "PjrtExecutor", "PolicyPlacements",
           "compile_lowered", "placements_for_policy"]
