"""Framework-neutral planning: placement policy, planner, HLO inspection. Imports neither torch nor torch_xla."""
from xla_swap.planning.policy import OffloadPolicy, ALL_DEVICE

__all__ = ["OffloadPolicy", "ALL_DEVICE"]
