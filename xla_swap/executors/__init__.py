"""Executors that run lowered programs with real host-memory semantics. Import with jax alone (no torch)."""
from xla_swap.executors.pjrt.executor import (HostMemoryError, ParameterInfo, ParameterPlacement, PjrtExecutor,
                                              PolicyPlacements, compile_lowered, placements_for_policy)
from xla_swap.executors.report import MemoryReport
from xla_swap.executors.ingraph import InGraphRuntime
from xla_swap.executors.streaming.runtime import Placement, RuntimeConfig, StreamingRuntime, tree_nbytes
from xla_swap.executors.trace import StageEvent, TraceRecorder

__all__ = ["HostMemoryError", "MemoryReport", "ParameterInfo", "ParameterPlacement", "PjrtExecutor",
           "PolicyPlacements", "placements_for_policy", "compile_lowered", "InGraphRuntime", "Placement",
           "RuntimeConfig", "StreamingRuntime", "StageEvent", "TraceRecorder", "tree_nbytes"]
