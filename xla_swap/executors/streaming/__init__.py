"""The streaming runtime: one jitted executable per stage, weights fetched from ``pinned_host`` a prefetch
depth ahead; its configuration, per-stage store, compilation, its one executor (every pass, the decode streamer's
too) and calibration."""
from xla_swap.executors.streaming.runtime import Placement, RuntimeConfig, StreamingRuntime

__all__ = ["Placement", "RuntimeConfig", "StreamingRuntime"]
