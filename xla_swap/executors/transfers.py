"""Moving arrays between memory kinds when several processes share a mesh (multi-controller jax).

In one process ``jax.device_put`` of a ``pinned_host`` array to memory kind ``device`` is one asynchronous
copy per device on the copy engines, overlapped with the executables queued on the compute stream. When
the array spans devices of several processes (not fully addressable), jax runs the same move as a
compiled program (a ``jit`` of an identity with the target sharding, dispatched per array) on the compute
stream, where nothing overlaps it; and a numpy value put to such a sharding is first checked equal on
every process (``multihost_utils.assert_equal``, a collective per call).

:func:`put` keeps ``jax.device_put``'s form and makes these moves what they are in one process:

* a jax array whose sharding differs from the target's only in memory kind: this process's shards moved
  by one ``jax.device_put`` to their own devices (the copy engines), the global array reassembled around
  them (``jax.make_array_from_single_device_arrays``, no copy);
* a numpy array or scalar (the same value on every process by the caller's contract: the optimizer's
  hyperparameters, a clipping coefficient): this process's slices placed
  (``jax.make_array_from_callback``), no collective;
* anything else, or one process: ``jax.device_put`` itself.

Imports numpy and jax only.
"""
from __future__ import annotations

import jax
import numpy as np

__all__ = ["put"]


def _is_sharding(s) -> bool:
    return isinstance(s, jax.sharding.Sharding)


def _leaf_shardings(x, shardings) -> list:
    """One sharding per leaf of ``x``: ``shardings`` is a sharding or a pytree prefix of ``x`` of them."""
    if _is_sharding(shardings):
        return [shardings] * len(jax.tree_util.tree_leaves(x))
    sdef = jax.tree_util.tree_structure(shardings, is_leaf=_is_sharding)
    subs = sdef.flatten_up_to(x)
    return [s for s, sub in zip(jax.tree_util.tree_leaves(shardings, is_leaf=_is_sharding), subs)
            for _ in jax.tree_util.tree_leaves(sub)]


def _by_shards(a, s) -> bool:
    """Whether ``a`` moves to ``s`` shard by shard: a jax array spanning other processes' devices, laid out
    like ``s`` but for the memory kind."""
    if not isinstance(a, jax.Array) or a.is_fully_addressable or s.is_fully_addressable:
        return False
    src = a.sharding
    return (src.memory_kind != s.memory_kind and src.device_set == s.device_set
            and src.with_memory_kind(s.memory_kind).is_equivalent_to(s, a.ndim))


def put(x, shardings, *, may_alias: bool | None = None):
    """``jax.device_put(x, shardings, may_alias=may_alias)``, with the moves of arrays that span several
    processes made as one process makes them (module docstring).

    Args:
      x: a pytree of jax arrays, numpy arrays or Python scalars.
      shardings: a ``jax.sharding.Sharding`` or a pytree prefix of ``x`` of them (as ``jax.device_put``).
      may_alias: as ``jax.device_put``'s (a move between memory kinds always copies).

    Returns: a pytree like ``x`` of jax arrays with the given shardings. Numpy leaves put to shardings that
    span several processes hold this process's slices of the value it passes (every process must pass the
    same value, which is not checked).

    Raises: what ``jax.device_put`` raises (e.g. ValueError: ``shardings`` does not match ``x``).
    """
    if jax.process_count() == 1:
        return jax.device_put(x, shardings, may_alias=may_alias)
    leaves, tree = jax.tree_util.tree_flatten(x)
    shs = _leaf_shardings(x, shardings)
    out: list = [None] * len(leaves)
    moved, targets, owners = [], [], []
    rest = []
    for k, (a, s) in enumerate(zip(leaves, shs)):
        if _by_shards(a, s):
            for shard in a.addressable_shards:
                moved.append(shard.data)
                targets.append(jax.sharding.SingleDeviceSharding(shard.device, memory_kind=s.memory_kind))
                owners.append(k)
        elif not isinstance(a, jax.Array) and not s.is_fully_addressable:
            v = np.asarray(a, dtype=jax.dtypes.canonicalize_dtype(np.asarray(a).dtype))
            out[k] = jax.make_array_from_callback(v.shape, s, lambda index, v=v: v[index])
        else:
            rest.append(k)
    if moved:
        got = jax.device_put(moved, targets, may_alias=may_alias)
        pieces: dict = {}
        for k, arr in zip(owners, got):
            pieces.setdefault(k, []).append(arr)
        for k, arrs in pieces.items():
            out[k] = jax.make_array_from_single_device_arrays(leaves[k].shape, shs[k], arrs)
    if rest:
        for k, arr in zip(rest, jax.device_put([leaves[k] for k in rest], [shs[k] for k in rest],
                                                may_alias=may_alias)):
            out[k] = arr
    return jax.tree_util.tree_unflatten(tree, out)
