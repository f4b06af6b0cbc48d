"""The variant registry: every row the benchmark can run, as frozen data (standard library only).

A :class:`Variant` says what a row runs (its ``kind``, which ``measure.BUILDERS`` dispatches
on) and with which settings (training, kept residuals, prefetch depth, throttle, chunked end
layers, XLA flag search). Names are the row labels of the result files; nothing decodes a
name: code reads the fields. Groups run several variants in one process, presets name sets
of variants, and the order lists say what runs first (a ``--budget-s`` cut drops the tail).
"""
from __future__ import annotations

import dataclasses

__all__ = ["Variant", "VARIANTS", "GROUPS", "PRESETS", "FLAG_SETS", "KINDS", "FORWARD_CORE", "TRAIN_CORE", "LATE",
           "EXTRAS", "ALL_NAMES", "base_name", "lookup", "expand", "compute_reference_names"]

#: What a variant runs (one builder each in ``measure.BUILDERS``; ``bandwidth``, ``weights``
#: and ``accelerate`` have their own code paths).
KINDS = ("bandwidth", "weights", "accelerate", "on-device-loop", "on-device-jit", "xla-in-graph",
         "xla-in-graph-unrolled", "xla_swap-in-graph", "torch_xla-lowered", "streaming")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the benchmark.

    Attributes:
      name: the row label in the results (e.g. ``"train-xla_swap-k2-saved-chunked"``).
      kind: one of :data:`KINDS`: the program that runs (see the package docstring).
      train: a training step (forward + backward, cotangent given) rather than a forward.
      saved: training keeps residuals (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``)
        instead of recomputing each layer in the backward.
      prefetch_depth: ``kind="streaming"`` only: the runtime's prefetch depth k (>= 1).
      throttle: ``kind="streaming"``: the host waits for stage i-1 before issuing stage i+k's
        transfer (device memory bounded); ``False``: the host runs ahead.
      chunked: the first and last layer are split into column-chunk stages (``--chunks``).
      flag_search: the compiled program is timed again under every XLA flag set of
        :data:`FLAG_SETS` (rows ``name@set``), at the smallest token count.
      compute_reference: an on-device row whose median is the compute part of the floors.

    Raises:
      ValueError: ``kind`` not in :data:`KINDS`; ``prefetch_depth`` given for a kind other
        than ``streaming``, or missing / < 1 for ``streaming``; ``saved`` without ``train``.
    """

    name: str
    kind: str
    train: bool = False
    saved: bool = False
    prefetch_depth: int | None = None
    throttle: bool = True
    chunked: bool = False
    flag_search: bool = False
    compute_reference: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "streaming") != (self.prefetch_depth is not None):
            raise ValueError(f"{self.name}: prefetch_depth is for kind 'streaming' only, and required there")
        if self.prefetch_depth is not None and self.prefetch_depth < 1:
            raise ValueError(f"{self.name}: prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if self.saved and not self.train:
            raise ValueError(f"{self.name}: saved (kept residuals) needs train")


def _streaming(k: int, *, train: bool = False, saved: bool = False, chunked: bool = False,
               throttle: bool = True) -> Variant:
    name = (("train-" if train else "") + f"xla_swap-k{k}" + ("-saved" if saved else "")
            + ("-chunked" if chunked else "") + ("" if throttle else "-nothrottle"))
    return Variant(name, "streaming", train=train, saved=saved, prefetch_depth=k, throttle=throttle, chunked=chunked)


_ALL = [
    Variant("bandwidth", "bandwidth"),
    Variant("weights", "weights"),
    Variant("accelerate", "accelerate"),
    Variant("on-device-loop", "on-device-loop", compute_reference=True),
    Variant("on-device-jit", "on-device-jit", compute_reference=True),
    Variant("train-on-device", "on-device-loop", train=True, compute_reference=True),
    Variant("train-on-device-jit", "on-device-jit", train=True, compute_reference=True),
    Variant("train-on-device-saved-jit", "on-device-jit", train=True, saved=True, compute_reference=True),
    Variant("xla-in-graph", "xla-in-graph", flag_search=True),
    Variant("xla-in-graph-unrolled", "xla-in-graph-unrolled"),
    Variant("xla_swap-in-graph", "xla_swap-in-graph", chunked=True, flag_search=True),
    Variant("torch_xla-lowered", "torch_xla-lowered"),
    _streaming(1), _streaming(2), _streaming(2, throttle=False),
    _streaming(2, chunked=True), _streaming(3, chunked=True),
    _streaming(1, train=True), _streaming(2, train=True), _streaming(2, train=True, throttle=False),
    _streaming(2, train=True, chunked=True), _streaming(2, train=True, saved=True),
    _streaming(2, train=True, saved=True, chunked=True),
]
#: Every variant by name (``weights`` is internal: the run's weight-cache generator).
VARIANTS: dict[str, Variant] = {v.name: v for v in _ALL}

#: Process groups: one subprocess runs every member (they share the device-resident weights;
#: their peaks after the first member are high-water marks of the group).
GROUPS: dict[str, tuple[str, ...]] = {"on-device": ("on-device-loop", "on-device-jit"),
                                      "train-on-device-jit-all": ("train-on-device-jit", "train-on-device-saved-jit")}
#: In order of priority (a --budget-s cut drops the tail). Names of variants or groups.
FORWARD_CORE = ("on-device", "xla_swap-in-graph", "xla_swap-k2-chunked", "xla-in-graph", "torch_xla-lowered")
TRAIN_CORE = ("train-on-device-jit-all", "train-xla_swap-k2-saved-chunked", "train-xla_swap-k2-saved")
LATE = ("xla_swap-k3-chunked", "xla_swap-k2", "train-xla_swap-k2", "train-on-device")
EXTRAS = ("xla_swap-k1", "xla-in-graph-unrolled", "xla_swap-k2-nothrottle",
          "train-xla_swap-k1", "train-xla_swap-k2-chunked", "train-xla_swap-k2-nothrottle")
#: What ``--variants`` accepts by name (groups included, ``weights`` not).
ALL_NAMES = ("bandwidth",) + FORWARD_CORE + TRAIN_CORE + ("accelerate",) + LATE + EXTRAS
PRESETS: dict[str, tuple[str, ...]] = {
    "forward": ("bandwidth",) + FORWARD_CORE,
    "train": ("bandwidth",) + TRAIN_CORE,
    "in-graph": ("bandwidth", "on-device-loop", "xla-in-graph", "torch_xla-lowered"),
    "extras": EXTRAS,
    "all": ("bandwidth",) + FORWARD_CORE + TRAIN_CORE + ("accelerate",) + LATE,
}
#: XLA flag sets tried on the ``flag_search`` variants (unless ``--no-flag-search``): the program
#: is compiled again in the same process with these as ``compiler_options`` (DebugOptions, the
#: same names as the XLA_FLAGS flags) and timed as row ``variant@name``.
FLAG_SETS: dict[str, str] = {
    "pipelined": "--xla_gpu_enable_host_memory_offloading=true --xla_gpu_enable_pipelined_host_offloading=true",
    "lhs": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "all": "--xla_gpu_enable_host_memory_offloading=true --xla_gpu_enable_pipelined_host_offloading=true "
           "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_highest_priority_async_stream=true",
}


def base_name(name: str) -> str:
    """``"name@flags"`` (a flag-search row) -> ``"name"``; other names unchanged."""
    return name.partition("@")[0]


def lookup(name: str) -> Variant | None:
    """The :class:`Variant` of a row name (a flag-search row ``name@set`` maps to ``name``), or
    ``None`` for a name the registry does not know (rows of older result files)."""
    return VARIANTS.get(base_name(name))


def expand(names) -> list[str]:
    """``--variants`` items (variant, group or preset names) -> the variant and group names, in
    the order given, presets expanded, duplicates dropped.

    Raises:
      ValueError: an item is none of those (the message names it and lists the valid ones).
    """
    members = {m for g in GROUPS.values() for m in g}
    wanted = []
    for n in names:
        if n in PRESETS:
            wanted += PRESETS[n]
        elif n in ALL_NAMES or n in members:
            wanted.append(n)
        else:
            raise ValueError(f"unknown {n!r}; variants: {', '.join(ALL_NAMES)}; presets: {', '.join(PRESETS)}")
    return list(dict.fromkeys(wanted))


def compute_reference_names(*, train: bool, saved: bool = False) -> tuple[str, ...]:
    """The on-device rows whose fastest median is the compute time of a family's floor:
    forward (``train=False``), training with per-layer recompute, or training with kept
    residuals (``saved=True``): each family is held to the on-device time of the same algorithm."""
    return tuple(v.name for v in _ALL if v.compute_reference and v.train == train and v.saved == saved)
