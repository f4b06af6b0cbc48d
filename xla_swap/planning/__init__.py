"""Framework-neutral planning: placement policy, planner, HLO inspection. Imports neither torch nor torch_xla."""
from xla_swap.planning.optimizer import AdamW
from xla_swap.planning.policy import ALL_DEVICE, OffloadPolicy
from xla_swap.planning.planner import (H200_PINNED, HOST_MEMORY_GBPS, OPTIMIZER_MODES, InfeasibleBudgetError, LayerCost,
                                       Link, Plan, adam_state_bytes, evaluate, min_feasible_bytes, plan)
from xla_swap.planning.prefetch import PrefetchSchedule, ScheduleStep

__all__ = ["AdamW", "OffloadPolicy", "ALL_DEVICE", "LayerCost", "Link", "H200_PINNED", "Plan", "InfeasibleBudgetError", "plan",
           "evaluate", "min_feasible_bytes", "adam_state_bytes", "OPTIMIZER_MODES", "HOST_MEMORY_GBPS",
           "PrefetchSchedule", "ScheduleStep"]
