"""``torch.distributed.checkpoint`` (DCP) planners over jax arrays, used by :mod:`xla_swap.stack.checkpoint`.

* :func:`shard_chunks`: the pieces of a (possibly multi-process) jax array this process writes, in
  torch's layout; each distinct piece is written by one process only (a replicated one once).
* :func:`streaming_save_planner`: a DCP save planner that copies each piece out of its host buffer
  only when the writer asks for it.
* :func:`shard_regions` / :func:`region_load_planner` / :func:`assembled`: the regions of a checkpoint
  tensor this process's devices hold, a DCP load planner that reads only those regions (DCP
  reshards: a region may span several saved chunks), and the jax array built from them.
* :func:`quiet_dcp`: silences DCP's warnings about running in one process and its writer's use of the
  deprecated ``tensor.storage()``.

The module imports torch (``torch.distributed.checkpoint`` when a planner is built) and jax.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import jax
import torch

from xla_swap.stack.torch_bridge import to_numpy, to_torch

__all__ = ["shard_chunks", "shard_regions", "assembled", "quiet_dcp", "streaming_save_planner",
           "region_load_planner"]


def _start(index: tuple) -> tuple:
    return tuple(s.start or 0 for s in index)


def shard_regions(a: jax.Array, transposed: bool) -> dict:
    """The distinct pieces of ``a`` held by this process's devices: ``{start in a's layout: (offsets,
    sizes)}`` with ``offsets`` / ``sizes`` in torch's layout (reversed for a ``transposed`` 2-d
    ``nn.Linear`` weight, which jax holds as ``[in, out]``)."""
    out = {}
    for sh in a.addressable_shards:
        start, sizes = _start(sh.index), tuple(sh.data.shape)
        out.setdefault(start, (start[::-1], sizes[::-1]) if transposed else (start, sizes))
    return out


def shard_chunks(a: jax.Array, transposed: bool) -> tuple[list[tuple[tuple, tuple, Callable]], int]:
    """The pieces of ``a`` this process writes, in torch's layout, and the number of distinct pieces
    of ``a`` over all processes.

    Returns ``([(offsets, sizes, load)], count)``: ``load()`` copies the piece into a CPU torch tensor.
    Each distinct piece (a shard, or a replicated array) is written by the process of the lowest
    device id holding it, so every process calling this for the same array writes disjoint pieces
    that together cover it.
    """
    owner: dict = {}
    for d, index in a.sharding.devices_indices_map(tuple(a.shape)).items():
        start = _start(index)
        if start not in owner or d.id < owner[start].id:
            owner[start] = d
    mine = {d for d in owner.values() if d.process_index == jax.process_index()}
    out = []
    for sh in a.addressable_shards:
        if sh.device not in mine:
            continue
        start, sizes = _start(sh.index), tuple(sh.data.shape)

        def load(data=sh.data):
            t = to_torch(data)
            return t.t().contiguous() if transposed else t
        out.append((start[::-1], sizes[::-1], load) if transposed else (start, sizes, load))
    return out, len(owner)


def assembled(a: jax.Array, transposed: bool, pieces: dict) -> jax.Array:
    """A jax array of ``a``'s shape and sharding whose shards are ``pieces`` (``{offsets in torch's
    layout: CPU torch tensor of that piece}``, as :func:`shard_regions` names them); ``transposed``
    pieces are ``[out, in]`` and become ``a``'s ``[in, out]``. Raises KeyError for a missing piece."""
    regions = shard_regions(a, transposed)
    arrays = {start: to_numpy(pieces[off].t() if transposed else pieces[off]) for start, (off, _) in regions.items()}
    return jax.make_array_from_callback(tuple(a.shape), a.sharding, lambda index: arrays[_start(index)])


@contextlib.contextmanager
def quiet_dcp():
    """Silence DCP's warnings that it runs in one process (``no_dist=True``) and that its writer
    calls the deprecated ``tensor.storage()``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # DCP's own writer calls it
        yield


def streaming_save_planner(tensors: dict, objects: dict):
    """A ``torch.distributed.checkpoint`` save planner whose tensors are copied from the host
    buffers only when the writer asks for each one (``resolve_data``), one piece at a time.

    Args:
      tensors: ``{fqn: (global torch shape, torch dtype, [(offsets, sizes, load), ...], count)}``: the
        pieces this process writes (:func:`shard_chunks`) and the number over all processes.
      objects: ``{fqn: picklable object}`` this process writes (saved as bytes).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class StreamingSavePlanner(dcp.DefaultSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._load = {}

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
            self.state_dict, self.is_coordinator = objects, is_coordinator

        def create_local_plan(self) -> dcp.SavePlan:
            items = []
            for fqn, (shape, dtype, chunks, count) in tensors.items():
                for offsets, sizes, load in chunks:
                    self._load[(fqn, tuple(offsets))] = load
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, torch.Size(offsets)),
                        type=WriteItemType.SHARD if count > 1 else WriteItemType.TENSOR,
                        tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dtype),
                                                    size=torch.Size(shape))))
            items += [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in objects]
            self.plan = dcp.SavePlan(items)
            return self.plan

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return self._load[(write_item.index.fqn, tuple(write_item.index.offset))]()

    return StreamingSavePlanner()


def region_load_planner(regions: dict):
    """A ``torch.distributed.checkpoint`` load planner that reads regions of the checkpoint's
    tensors into given CPU tensors, whatever chunks they were saved in.

    Args:
      regions: ``{fqn: {offsets: tensor}}``: each ``tensor`` (its shape the region's sizes) receives
        the checkpoint tensor ``fqn``'s region starting at ``offsets``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionLoadPlanner(dcp.DefaultLoadPlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> dcp.LoadPlan:
            items = []
            for fqn, dest in regions.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape) for off, t in dest.items()]
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
            return dcp.LoadPlan(items)

        def lookup_tensor(self, index):
            return regions[index.fqn][tuple(index.offset)]

    return RegionLoadPlanner()
