"""A streaming runtime's per-stage state: each stage's layout (:class:`StageLayout`: shapes, shardings of
its weights, gradients and moments, trainable mask, parameter groups) and the :class:`StageStore` that
holds every stage's weights, optimizer state and accumulated gradients where they live, the copies kept
on the device for the next call, and loads or replaces a stage.

Imports only jax (no torch).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Sharding

from ..transfers import put
from .. import optim as _optim
from ..pytrees import DEVICE_KIND, HOST_KIND, leaf_name, param_key, tree_nbytes

__all__ = ["StageLayout", "StageStore", "checked_state", "stage_layouts", "zeros_where_they_live"]


def _spec(a, sh):
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Where one stage's arrays live and which of its leaves train (fixed at construction).

    ``param_aval``, ``host_sharding`` and ``device_sharding`` are pytrees like the stage's weights (its
    ``jax.ShapeDtypeStruct`` s; the shardings between calls, ``pinned_host`` or device memory for a
    resident stage; and when streamed in). The other fields are per leaf (``train_mask``) or per
    trainable leaf in leaf order: its parameter group, the shardings of its gradient (on the device,
    and where it is sent), of its moments ``(m, v)`` and of its accumulated gradient (on the device and
    between steps; empty without an optimizer).
    """

    param_aval: Any
    host_sharding: Any
    device_sharding: Any
    train_mask: tuple
    groups: tuple
    grad_device: tuple = ()
    grad_out: tuple = ()
    state_device: tuple = ()
    state_host: tuple = ()
    acc_device: tuple = ()
    acc_host: tuple = ()

    @property
    def trained(self) -> list[int]:
        """Indices (leaf order) of the trainable leaves."""
        return [j for j, m in enumerate(self.train_mask) if m]

    def trainable_avals(self) -> list:
        """The ``jax.ShapeDtypeStruct`` of each trainable leaf, in leaf order."""
        leaves = jax.tree_util.tree_leaves(self.param_aval)
        return [leaves[j] for j in self.trained]

    def param_key(self) -> tuple:
        """A hashable key of the weights' structure, shapes, dtypes, device shardings, mask and groups."""
        return param_key(self.param_aval, self.device_sharding) + (self.train_mask, self.groups)

    def param_spec(self):
        """The weights as streamed in: a pytree of ``jax.ShapeDtypeStruct`` with device shardings."""
        return jax.tree_util.tree_map(_spec, self.param_aval, self.device_sharding)

    def acc_spec(self) -> list:
        """The accumulated gradients on the device: one ``jax.ShapeDtypeStruct`` per trainable leaf."""
        return [_spec(a, sh) for a, sh in zip(self.trainable_avals(), self.acc_device)]

    def state_spec(self, state) -> list:
        """The moments ``state`` (``[(m, v), ...]``) as specs with their device shardings."""
        return jax.tree_util.tree_map(_spec, list(state), list(self.state_device))


def stage_layouts(avals: list, host_sh: list, dev_sh: list, train_mask: list, group_idx: list, *,
                  resident: tuple, grads_to_host: bool, optimizer_state_on_host: bool,
                  has_optimizer: bool) -> list[StageLayout]:
    """One :class:`StageLayout` per stage from the per-stage lists of ``placement.leaf_shardings`` and the
    weights' avals; gradients, accumulators and moments placed as the flags say (a resident stage keeps
    its moments and accumulators in device memory)."""
    grad_kind = HOST_KIND if grads_to_host else DEVICE_KIND
    out = []
    for i, aval in enumerate(avals):
        dev_leaf_sh = jax.tree_util.tree_leaves(dev_sh[i])
        grads = tuple(s for s, m in zip(dev_leaf_sh, train_mask[i]) if m)
        trained = [j for j, m in enumerate(train_mask[i]) if m] if has_optimizer else []
        state_kind = HOST_KIND if optimizer_state_on_host and not resident[i] else DEVICE_KIND
        acc_kind = HOST_KIND if grads_to_host and not resident[i] else DEVICE_KIND
        out.append(StageLayout(
            aval, host_sh[i], dev_sh[i], tuple(train_mask[i]), tuple(group_idx[i]), grad_device=grads,
            grad_out=tuple(s.with_memory_kind(grad_kind) for s in grads),
            state_device=tuple((dev_leaf_sh[j], dev_leaf_sh[j]) for j in trained),
            state_host=tuple((dev_leaf_sh[j].with_memory_kind(state_kind),) * 2 for j in trained),
            acc_device=tuple(dev_leaf_sh[j] for j in trained),
            acc_host=tuple(dev_leaf_sh[j].with_memory_kind(acc_kind) for j in trained)))
    return out


def checked_state(optimizer, state, avals: list, stage: int) -> list:
    """``state`` (a stage's ``[(m, v), ...]``) as a list of pairs, checked against the trainable
    leaves' shapes and the optimizer's state dtype; ValueError naming the stage otherwise."""
    ok = isinstance(state, Sequence) and not isinstance(state, (str, bytes)) and len(state) == len(avals)
    pairs = list(state) if ok else []
    for pair, a in zip(pairs, avals):
        dt = np.dtype(_optim.state_dtype(optimizer, a.dtype))
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                and all(tuple(getattr(x, "shape", ())) == tuple(a.shape) and getattr(x, "dtype", None) == dt
                        for x in pair)):
            ok = False
    if not ok:
        raise ValueError(f"optimizer_state[{stage}] must be {len(avals)} (m, v) pairs of the trainable leaves' shapes "
                         f"{[tuple(a.shape) for a in avals]} and dtype "
                         f"{[str(np.dtype(_optim.state_dtype(optimizer, a.dtype))) for a in avals]}")
    return [tuple(p) for p in pairs]


class StageStore:
    """Every stage's arrays where they live between calls, and the copies kept for the next call.

    Args:
      stage_params: the per-stage pytrees of arrays (checked by the caller).
      layouts: one :class:`StageLayout` per stage.
      resident: per stage, whether its weights stay in device memory.
      optimizer: the ``AdamW`` of parameter group 0 (its ``state_dtype`` is every group's) or ``None``.
      own_params: the leaves become the store's where already placed (no copy); ``copy``: always copy.

    ``host_params`` and ``optimizer_state`` are plain lists, one entry per stage, replaced element by
    element (never rebound: a caller that holds the list follows the updates).
    """

    def __init__(self, stage_params, layouts: list[StageLayout], resident: tuple, optimizer, *,
                 own_params: bool, copy: bool):
        self.layouts: tuple[StageLayout, ...] = tuple(layouts)
        self.num_stages: int = len(layouts)
        self.resident: tuple[bool, ...] = tuple(resident)
        self.optimizer = optimizer
        #: per-stage pytrees of ``pinned_host`` arrays (device memory for ``resident`` stages): the weights.
        self.host_params: list = [put(p, lay.host_sharding, may_alias=None if own_params
                                                 else (False if (copy or r) else None))
                                  for p, lay, r in zip(stage_params, layouts, resident)]
        #: per stage, the optimizer state: ``(m, v)`` pairs, one per trainable leaf (empty without one).
        self.optimizer_state: list = []
        #: the gradients summed over the micro-batches since the last update, per stage, or ``None``.
        self.grad_acc: list | None = None
        #: micro-batches summed in ``grad_acc``.
        self.micro_batches: int = 0
        #: stage -> (``host_params[stage]`` it was copied from, its device copy): the next call's first stages.
        self.carry: dict[int, tuple[Any, Any]] = {}
        #: bytes of each stage's weights (logical sizes), and their sum.
        self.stage_nbytes: list[int] = [tree_nbytes(p) for p in self.host_params]
        self.weight_nbytes: int = sum(self.stage_nbytes)
        self.optimizer_state_nbytes: list[int] = [0] * self.num_stages

    def place_optimizer_state(self, optimizer_state, own_state: bool = False) -> None:
        """The moments: zeros made where they live, or copies of ``optimizer_state`` (its arrays as they are
        with ``own_state``).

        Raises: ValueError: ``optimizer_state`` given without an optimizer, or not one list of ``(m, v)``
          pairs per stage as :func:`checked_state` wants them.
        """
        n, optimizer = self.num_stages, self.optimizer
        if optimizer_state is not None and (optimizer is None or isinstance(optimizer_state, (str, bytes))
                                            or not isinstance(optimizer_state, Sequence)
                                            or len(optimizer_state) != n):
            raise ValueError(f"optimizer_state must be None or, with an optimizer, one list of (m, v) pairs per "
                             f"stage ({n} stages), got {type(optimizer_state).__name__}"
                             + ("" if optimizer is not None else " without an optimizer"))
        states = []
        for i in range(n if optimizer is not None else 0):
            trained = self.layouts[i].trainable_avals()
            if optimizer_state is None:
                states.append(_optim.init_state(optimizer, trained))
            else:
                states.append(checked_state(optimizer, optimizer_state[i], trained, i))
        place = zeros_where_they_live if optimizer_state is None else \
            (lambda st, sh: put(st, sh, may_alias=None if own_state else False))
        self.optimizer_state[:] = [place(st, list(lay.state_host)) for st, lay in zip(states, self.layouts)]
        self.optimizer_state_nbytes = [tree_nbytes(s) for s in self.optimizer_state] or [0] * n

    def check_stage(self, stage) -> None:
        """ValueError unless ``stage`` is an int in ``[0, num_stages)``."""
        if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) or not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be an int in [0, {self.num_stages}), got {stage!r}")

    def trainable_paths(self, stage: int) -> list[str]:
        """The key paths of ``stage``'s trainable leaves (``optimizer_state[stage]`` order).

        Raises: ValueError: ``stage`` is not an int in ``[0, num_stages)``.
        """
        self.check_stage(stage)
        lay = self.layouts[stage]
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(lay.param_aval)[0]]
        return [p for p, m in zip(paths, lay.train_mask) if m]

    def load_stage(self, stage: int, params=None, state: Sequence | None = None) -> None:
        """Replace ``stage``'s weights and/or optimizer state by copies of the given arrays, placed
        where the current ones are (same shardings and memory kinds: ``pinned_host``, or device
        memory for a resident stage). The stage's weights held in device memory for the next call
        are dropped.

        Args:
          stage: the stage index.
          params: ``None`` (weights unchanged) or a pytree of ``host_params[stage]``'s structure
            whose leaves (numpy or jax arrays) have its shapes and dtypes.
          state: ``None`` (moments unchanged) or, with an optimizer, a list of ``(m, v)`` pairs as
            ``optimizer_state[stage]`` holds them (one per trainable leaf, ``trainable_paths``
            order; the leaf's shape, the optimizer's state dtype).

        Raises (before anything changes): ValueError: a bad ``stage``; ``params`` of another structure,
          or a leaf of another shape or dtype (the message names the leaf); a bad ``state``, or one given
          without an optimizer; accumulated gradients are pending (``grad_acc``).
        """
        self.check_stage(stage)
        if self.grad_acc is not None:
            raise ValueError(f"the runtime holds the gradients of {self.micro_batches} accumulated micro-batches; "
                             "load after the update (train_step with accumulate=False)")
        lay = self.layouts[stage]
        if params is not None:
            lp, td = jax.tree_util.tree_flatten_with_path(params)
            ref_lp, ref_td = jax.tree_util.tree_flatten_with_path(lay.param_aval)
            if td != ref_td:
                raise ValueError(f"params for stage {stage} have tree structure {td}, the stage has {ref_td}")
            for (path, leaf), (_, a) in zip(lp, ref_lp):
                shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
                if shape != tuple(a.shape) or dtype is None or np.dtype(dtype) != np.dtype(a.dtype):
                    raise ValueError(f"stage_params[{stage}]{leaf_name(path)}: got shape {shape} dtype {dtype}, "
                                     f"the stage holds shape {tuple(a.shape)} dtype {np.dtype(a.dtype)}")
        if state is not None:
            if self.optimizer is None:
                raise ValueError("state given to a runtime without an optimizer")
            state = checked_state(self.optimizer, state, lay.trainable_avals(), stage)
        self.carry.pop(stage, None)
        if params is not None:
            self.host_params[stage] = put(params, lay.host_sharding, may_alias=False)
        if state is not None:
            self.optimizer_state[stage] = put(state, list(lay.state_host), may_alias=False)

    def keep_carried(self, stages) -> None:
        """Keep only the copies for the next call of ``stages`` (the others are stale or taken: dropped)."""
        self.carry = {j: self.carry[j] for j in stages}

    def take_carried(self, stage: int):
        """``stage``'s weights kept on the device by the previous call (removed from the carry), or ``None``."""
        carried = self.carry.pop(stage, None)
        return None if carried is None else carried[1]

    def set_carry(self, next_call: dict) -> None:
        """The copies the call leaves for the next one: ``stage -> (host_params[stage], device copy)``."""
        self.carry = next_call

    def accumulate(self, new_acc: list) -> None:
        """One more micro-batch summed: ``new_acc`` (per stage, the sums where they live) is ``grad_acc``."""
        self.grad_acc, self.micro_batches = new_acc, self.micro_batches + 1

    def drop_accumulated(self) -> None:
        """The accumulated gradients are spent (an update) or dropped (a skipped one)."""
        self.grad_acc, self.micro_batches = None, 0

    def weights_in(self, stage: int):
        """Start copying ``stage``'s weights to the device (asynchronous); returns the device copy."""
        return put(self.host_params[stage], self.layouts[stage].device_sharding)

    def state_in(self, stage: int):
        """Start copying ``stage``'s moments to the device; returns them."""
        return put(self.optimizer_state[stage], list(self.layouts[stage].state_device))

    def acc_in(self, stage: int):
        """Start copying ``stage``'s accumulated gradients to the device; returns them."""
        return put(self.grad_acc[stage], list(self.layouts[stage].acc_device))

    def carried(self) -> tuple[int, ...]:
        """The stages whose copy kept for the next call is still valid (its ``host_params`` not replaced)."""
        return tuple(sorted(j for j, c in self.carry.items() if c[0] is self.host_params[j]))

    def store_update(self, stage: int, new_p, new_s) -> tuple:
        """Keep an update's new weights and moments (device arrays) where they live; returns them there."""
        self.host_params[stage] = self._updated_host_params(stage, new_p)
        self.optimizer_state[stage] = put(new_s, list(self.layouts[stage].state_host))
        return self.host_params[stage], self.optimizer_state[stage]

    def _updated_host_params(self, stage: int, new_p):
        """``host_params[stage]`` after an update that returned ``new_p``: the trainable leaves copied to
        where the weights live; a streamed stage keeps its other leaves' arrays as they are, a resident
        one takes ``new_p``'s (its own, aliased: the update donated them)."""
        lay = self.layouts[stage]
        if self.resident[stage]:
            return put(new_p, lay.host_sharding)
        old, treedef = jax.tree_util.tree_flatten(self.host_params[stage])
        new, host_sh = jax.tree_util.tree_leaves(new_p), jax.tree_util.tree_leaves(lay.host_sharding)
        sel = lay.trained
        for j, a in zip(sel, put([new[j] for j in sel], [host_sh[j] for j in sel])):
            old[j] = a
        return jax.tree_util.tree_unflatten(treedef, old)

    def grads_tree(self, stage: int, host: list):
        """``host`` (one gradient per trainable leaf) as a pytree like the stage's weights, ``None`` elsewhere."""
        lay = self.layouts[stage]
        treedef = jax.tree_util.tree_structure(lay.param_aval)
        it = iter(host)
        return jax.tree_util.tree_unflatten(treedef, [next(it) if m else None for m in lay.train_mask])


def zeros_where_they_live(zeros, shardings):
    """Zero arrays (a pytree of numpy zeros, e.g. a stage's fresh AdamW moments) put at ``shardings``
    (a pytree of the same structure): those in device memory or ``pinned_host`` made by a jitted
    ``zeros`` whose output lives there, the others (any other memory kind) copied from ``zeros``.

    A host array's copy goes through PJRT's host-side copies (single-threaded, and staged in the
    pinned pool on GPU); a zero made on the device moves no byte from the host, and one made for
    ``pinned_host`` reaches it as the program's output, by one device-to-host DMA per shard.

    Returns: the pytree of ``jax.Array`` (values all zero, shapes and dtypes of ``zeros``).
    """
    def one(z, sh):
        if sh.memory_kind in (DEVICE_KIND, HOST_KIND):
            return _zeros_program(tuple(z.shape), np.dtype(z.dtype), sh)()
        return put(z, sh)
    return jax.tree_util.tree_map(one, zeros, shardings)


@functools.lru_cache(maxsize=64)
def _zeros_program(shape: tuple, dtype: np.dtype, sharding: Sharding):
    """A jitted ``() -> zeros(shape, dtype)`` placed at ``sharding`` (one per distinct leaf: layers share it)."""
    return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)
