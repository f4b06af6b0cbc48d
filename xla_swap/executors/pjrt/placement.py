"""Where the entry parameters and results of :class:`xla_swap.executors.PjrtExecutor` live.

* :class:`ParameterPlacement`: a requested memory kind and sharding for one parameter;
* :class:`ParameterInfo`: one compiled parameter (shape, dtype, memory kind, sharding);
* :func:`requested_placements`, :func:`check_supported_kinds`: the executor's ``placements`` and
  ``result_memory_kinds`` arguments resolved against the module and checked against the devices;
* the checks of the executor's mapping and device arguments (:func:`check_mapping`, ...).

Imports jax and numpy only.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import numpy as np

from xla_swap.planning.policy import DEVICE, MEMORY_KINDS

from .module import EntryFunction, ModuleSource


@dataclasses.dataclass(frozen=True)
class ParameterPlacement:
    """Where one entry parameter lives.

    Attributes:
      memory_kind: ``"device"`` or ``"pinned_host"``.
      sharding: ``None`` (keep the sharding the module's parameter carries, replicated if
        none), an HLO sharding string as torch_xla reports it (``"{devices=[4,1]0,1,2,3}"``,
        ``"{replicated}"``), or a :class:`jax.sharding.Sharding` over exactly the executor's
        devices, in order (its memory kind is replaced by ``memory_kind``).

    Raises:
      TypeError: ``memory_kind`` is not a str; ``sharding`` is none of the above.
      ValueError: ``memory_kind`` is not one of ``MEMORY_KINDS``.
    """
    memory_kind: str = DEVICE
    sharding: Any = None

    def __post_init__(self):
        if not isinstance(self.memory_kind, str):
            raise TypeError(f"memory_kind: expected one of {MEMORY_KINDS}, got {type(self.memory_kind).__name__}")
        if self.memory_kind not in MEMORY_KINDS:
            raise ValueError(f"memory_kind: unknown memory kind {self.memory_kind!r}; expected one of {MEMORY_KINDS}")
        if self.sharding is not None and not isinstance(self.sharding, (str, jax.sharding.Sharding)):
            raise TypeError(f"sharding: expected None, an HLO sharding string or a jax Sharding, "
                            f"got {type(self.sharding).__name__}")


@dataclasses.dataclass(frozen=True)
class ParameterInfo:
    """One entry parameter of a compiled :class:`xla_swap.executors.PjrtExecutor`.

    Attributes:
      index: position in the entry computation (0-based).
      shape: global (unpartitioned) shape.
      dtype: numpy dtype.
      memory_kind: ``"device"`` or ``"pinned_host"`` (as requested at compile time).
      hlo_sharding: the HLO sharding string it was compiled with.
      sharding: the :class:`jax.sharding.Sharding` (with memory kind) that ``PjrtExecutor.put``
        places arrays with.
    """
    index: int
    shape: tuple
    dtype: np.dtype
    memory_kind: str
    hlo_sharding: str
    sharding: Any

    @property
    def nbytes(self) -> int:
        """Global size in bytes (all shards together, counting a replicated array once)."""
        return int(math.prod(self.shape)) * self.dtype.itemsize

    @property
    def shard_nbytes(self) -> int:
        """Bytes of one device's shard."""
        return int(math.prod(self.sharding.shard_shape(self.shape))) * self.dtype.itemsize


def check_mapping(value, name: str) -> dict:
    """``dict(value)`` for a mapping (``{}`` for None); TypeError naming ``name`` otherwise."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}: expected a mapping {{index: ...}} (a dict) or None, got {type(value).__name__} "
                        f"{value!r:.80}")
    return dict(value)


def check_index_keys(mapping: dict, name: str, count: int, what: str, plural: str) -> None:
    """ValueError naming ``name`` for a key of ``mapping`` that is not an int in ``0..count-1``."""
    for key in mapping:
        if not isinstance(key, (int, np.integer)) or isinstance(key, bool) or not 0 <= key < count:
            raise ValueError(f"{name}: {what} index {key!r} does not exist; the module has {count} {plural}"
                             + (f" (valid indices 0..{count - 1})" if count else ""))


def check_devices_arg(devices):
    """None, or ``devices`` as a tuple; TypeError for a lone Device, a string or a non-iterable."""
    if devices is None:
        return None
    if isinstance(devices, jax.Device):
        raise TypeError(f"devices: expected a sequence of jax devices, got one Device ({devices}); pass [device]")
    if isinstance(devices, (str, bytes, Mapping)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"devices: expected a sequence of jax devices, got {type(devices).__name__} {devices!r:.80}")
    return tuple(devices)


def _requested_placement(index: int, placement, declared_kind) -> tuple:
    """``(memory kind, sharding spec)`` of one parameter from its ``placements`` value (None: not given)."""
    kind, spec = declared_kind or DEVICE, None
    if placement is not None:
        if isinstance(placement, str):
            kind = placement
        elif isinstance(placement, ParameterPlacement):
            kind, spec = placement.memory_kind, placement.sharding
        elif isinstance(placement, jax.sharding.Sharding):
            kind, spec = placement.memory_kind or DEVICE, placement
        else:
            raise TypeError(f"placements[{index}]: expected 'device', 'pinned_host', a ParameterPlacement "
                            f"or a jax Sharding, got {type(placement).__name__}")
    if kind not in MEMORY_KINDS:
        where = f"placements[{index}]" if placement is not None else f"parameter {index} (memory kind set by the module)"
        raise ValueError(f"{where}: unknown memory kind {kind!r}; expected one of {MEMORY_KINDS}")
    if spec is not None and not isinstance(spec, (str, jax.sharding.Sharding)):
        raise TypeError(f"placements[{index}]: sharding must be an HLO sharding string or a jax Sharding, "
                        f"got {type(spec).__name__}")
    return kind, spec


def requested_placements(source: ModuleSource, entry: EntryFunction, placements: dict,
                         result_memory_kinds: dict) -> tuple:
    """Per parameter, the requested memory kind and sharding spec (HLO string, jax Sharding or ``None``).

    A parameter not in ``placements`` keeps the memory kind the module declares (a jax lowering's),
    else ``"device"``, and its own sharding (spec ``None``).

    Returns: ``(kinds, shard_specs)``, two lists with one entry per entry parameter.

    Raises:
      ValueError: an index of ``placements`` / ``result_memory_kinds`` that does not exist; an
        unknown memory kind (requested or declared by the module).
      TypeError: a placement value or its sharding of the wrong type.
    """
    n_in, n_out = len(entry.metas), len(entry.out_metas)
    check_index_keys(placements, "placements", n_in, "parameter", "entry parameter(s)")
    check_index_keys(result_memory_kinds, "result_memory_kinds", n_out, "result", "result(s)")
    for i, kind in result_memory_kinds.items():
        if not isinstance(kind, str) or kind not in MEMORY_KINDS:
            raise ValueError(f"result_memory_kinds[{i}]: unknown memory kind {kind!r}; expected one of "
                             f"{MEMORY_KINDS}")
    kinds, shard_specs = [], []
    for i in range(n_in):
        declared = source.arg_memory_kinds[i] if i < len(source.arg_memory_kinds) else None
        kind, spec = _requested_placement(i, placements.get(i), declared)
        kinds.append(kind)
        shard_specs.append(spec)
    return kinds, shard_specs


def check_supported_kinds(source: ModuleSource, entry: EntryFunction, devices: tuple, kinds: list,
                          result_memory_kinds: dict) -> list:
    """Check that ``devices`` have every parameter's and result's memory kind.

    Returns: per result, its memory kind (requested, else declared by the module, else ``None``).

    Raises: ValueError: a memory kind the devices lack (naming the parameter or result).
    """
    mem_kinds = {m.kind for m in devices[0].addressable_memories()}
    for i, kind in enumerate(kinds):
        if kind not in mem_kinds:
            raise ValueError(f"placements[{i}]: memory kind {kind!r} is not supported by "
                             f"{devices[0].platform} devices (they have {sorted(mem_kinds)})")
    res_kinds = [result_memory_kinds.get(i) or (source.result_memory_kinds[i]
                                                if i < len(source.result_memory_kinds) else None)
                 for i in range(len(entry.out_metas))]
    for i, kind in enumerate(res_kinds):
        if kind is not None and kind not in mem_kinds:
            where = f"result_memory_kinds[{i}]" if i in result_memory_kinds else f"result {i}"
            raise ValueError(f"{where}: memory kind {kind!r} is not supported by {devices[0].platform} "
                             f"devices (they have {sorted(mem_kinds)})")
    return res_kinds
