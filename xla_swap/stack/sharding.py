"""The sharding rules of the torch entry point (``SwappedStack(shard=...)``): where each weight of each
stage lives over the devices, in ``pinned_host`` and on the device.

``"fsdp"`` splits each weight with >= 2 dimensions on the first dimension of the layout it is held in that
divides evenly over the devices (FSDP2's ``Shard(0)``, on the held layout), ``"replicate"`` copies it to
every device, a callable ``(name, torch shape) -> PartitionSpec`` gives the spec over the mesh axis ``"d"``.
Callables see torch's shapes and give torch's specs; a weight held transposed (``[in, out]``,
``SwappedStack.transposed``) gets the spec reversed.

The module imports jax and numpy.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xla_swap.executors.streaming.placement import Placement

__all__ = ["SHARD_RULES", "check_shard", "partition_spec", "StageSharding"]

#: the named rules of ``shard`` (besides a callable).
SHARD_RULES = ("fsdp", "replicate")


def check_shard(shard) -> None:
    """Raises ValueError naming ``shard`` unless it is one of :data:`SHARD_RULES` or a callable."""
    if not (callable(shard) or shard in SHARD_RULES):
        raise ValueError(f"shard must be one of {SHARD_RULES} or a callable (name, shape) -> spec, got {shard!r}")


def partition_spec(shard: str | Callable, name: str, shape: tuple, n_devices: int, transposed: bool = False) -> tuple:
    """The ``PartitionSpec`` entries (over mesh axis ``"d"``) of weight ``name`` of host ``shape`` under ``shard``.

    ``transposed``: the weight is held as the transpose of torch's 2-D layout; a callable ``shard``
    is asked with torch's shape and its spec is reversed. ``()``: replicated.

    ``"fsdp"`` takes the held layout's major dimension first: its all-gather and its gradient's reduce-scatter
    then move contiguous rows, where a split on the minor dimension (``gate_proj``'s ``F`` of a ``[D, F]``
    weight) makes XLA's GPU compiler reduce-scatter the gradient transposed and transpose it back in the
    optimizer update (``benchmarks/results/llama_multi_gpu/README.md``, "eighth run").
    """
    if callable(shard):
        if not transposed:
            return tuple(shard(name, tuple(shape)) or ())
        spec = tuple(shard(name, tuple(shape)[::-1]) or ())  # torch's shape and spec
        return tuple((spec + (None,) * (2 - len(spec)))[::-1])
    if shard == "replicate" or len(shape) < 2:
        return ()
    for d in range(len(shape)):
        if shape[d] % n_devices == 0:
            return tuple("d" if j == d else None for j in range(len(shape)))
    return ()


class StageSharding:
    """The shardings of a stack's weights over ``devices`` under rule ``shard``.

    Args:
      devices: the jax devices (one: no mesh; several: a 1-D mesh of axis ``"d"``).
      shard: one of :data:`SHARD_RULES` or a callable (module docstring).
      transposed: per stage, the names of the weights held transposed.
    """

    def __init__(self, devices: Sequence[jax.Device], shard: str | Callable, transposed: list[frozenset]):
        self.devices = list(devices)
        self.shard = shard
        self.transposed = transposed
        #: the ``Mesh`` over the devices (axis ``"d"``), or ``None`` on one device.
        self.mesh: Mesh | None = Mesh(np.array(self.devices), ("d",)) if len(self.devices) > 1 else None

    def spec(self, stage: int, name: str, shape: tuple) -> PartitionSpec:
        """The ``PartitionSpec`` of weight ``name`` (host ``shape``) of stage ``stage``."""
        return PartitionSpec(*partition_spec(self.shard, name, shape, len(self.devices),
                                             name in self.transposed[stage]))

    def host(self, stage: int, name: str, shape: tuple) -> jax.sharding.Sharding:
        """Where weight ``name`` of ``stage`` lives in ``pinned_host`` memory."""
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(self.devices[0], memory_kind="pinned_host")
        return NamedSharding(self.mesh, self.spec(stage, name, shape), memory_kind="pinned_host")

    def runtime_placement(self, data_parallel: bool) -> Placement:
        """The ``StreamingRuntime``'s ``Placement``: ``device`` on one device; else ``sharding``
        (``(stage, path, leaf) -> NamedSharding`` of a weight on the device), a replicated
        ``activation_sharding`` and ``batch_axis`` (``"d"`` with ``data_parallel``)."""
        if self.mesh is None:
            return Placement(device=self.devices[0])

        def sharding(stage, path, leaf):
            return NamedSharding(self.mesh, self.spec(stage, path[0].key, leaf.shape))
        return Placement(sharding=sharding, activation_sharding=NamedSharding(self.mesh, PartitionSpec()),
                         batch_axis="d" if data_parallel else None)
