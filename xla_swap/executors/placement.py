"""Placement of a streaming runtime's arrays: shardings and memory kinds of the weights, their
gradients, the optimizer state and the activations, and loading a stage's weights in place.

Imports only jax (no torch).
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from . import optim as _optim
from ._stages import (DEVICE_KIND, HOST_KIND, as_aval, check_input_dtypes, check_memory_kinds, is_diff,
                      leaf_name)

__all__ = ["RuntimePlacement", "activation_shardings", "check_placement_args", "checked_resident", "checked_state",
           "flatten_stage_params", "leaf_sharding_rule", "leaf_shardings", "num_stages_of", "zeros_where_they_live"]


def num_stages_of(stage_params) -> int:
    """``len(stage_params)``; ValueError unless it is a non-empty sequence."""
    if isinstance(stage_params, (str, bytes, dict)) or not isinstance(stage_params, Sequence):
        raise ValueError(f"stage_params must be a non-empty sequence (list/tuple) of per-stage pytrees, "
                         f"got {type(stage_params).__name__}")
    if len(stage_params) == 0:
        raise ValueError("stage_params is empty: need at least one stage")
    return len(stage_params)


def checked_resident(resident, n: int) -> list[bool]:
    """``resident`` as ``n`` bools (``None``: none resident); ValueError otherwise."""
    if resident is None:
        resident = [False] * n
    if isinstance(resident, (str, bytes)) or not isinstance(resident, Sequence) or len(resident) != n \
            or not all(isinstance(r, (bool, np.bool_)) for r in resident):
        raise ValueError(f"resident must be a sequence of {n} bools (one per stage), got {resident!r}")
    return [bool(r) for r in resident]


def flatten_stage_params(stage_params, shared: bool) -> list:
    """Per stage ``(leaves_with_path, treedef)`` of ``stage_params``, every leaf checked to be an array
    of a dtype jax keeps; with a ``shared`` stage function every stage must match stage 0's tree
    structure, leaf shapes and dtypes.

    Raises: TypeError: a leaf is not an array or has a dtype jax would narrow; ValueError: with
      ``shared``, a stage differs from stage 0 (the message names the stage and leaf).
    """
    flat = []
    for i, p in enumerate(stage_params):
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(p)
        for path, leaf in leaves_with_path:
            as_aval(leaf, f"stage_params[{i}]{leaf_name(path)}")
        check_input_dtypes(p, f"stage_params[{i}]")
        flat.append((leaves_with_path, treedef))
    if shared:
        leaves0, treedef0 = flat[0]
        for i in range(1, len(flat)):
            leaves_with_path, treedef = flat[i]
            if treedef != treedef0:
                raise ValueError(f"stage_params[{i}] has tree structure {treedef}, but stage_params[0] has "
                                 f"{treedef0}; a shared stage_fn needs the same structure for every stage")
            for (path, leaf), (_, leaf0) in zip(leaves_with_path, leaves0):
                if tuple(leaf.shape) != tuple(leaf0.shape) or np.dtype(leaf.dtype) != np.dtype(leaf0.dtype):
                    raise ValueError(
                        f"stage_params[{i}]{leaf_name(path)} has shape {tuple(leaf.shape)} dtype "
                        f"{np.dtype(leaf.dtype)}, but stage_params[0]{leaf_name(path)} has shape "
                        f"{tuple(leaf0.shape)} dtype {np.dtype(leaf0.dtype)}; a shared stage_fn needs "
                        "identical parameter shapes and dtypes in every stage")
    return flat


def check_placement_args(device, sharding, activation_sharding, batch_axis) -> None:
    """Raise for the constructor's placement arguments of the wrong type, or ``device`` and
    ``sharding`` both given (errors name the argument)."""
    if device is not None and sharding is not None:
        raise ValueError("give either device or sharding, not both")
    if device is not None and not isinstance(device, jax.Device):
        raise TypeError(f"device must be a jax.Device, got {type(device).__name__}")
    if sharding is not None and not (isinstance(sharding, Sharding) or callable(sharding)):
        raise TypeError(f"sharding must be a jax.sharding.Sharding or a callable, got {type(sharding).__name__}")
    if batch_axis is not None and not isinstance(batch_axis, str):
        raise TypeError(f"batch_axis must be a mesh axis name (str) or None, got {type(batch_axis).__name__}")
    if activation_sharding is not None and not isinstance(activation_sharding, Sharding):
        raise TypeError(f"activation_sharding must be a jax.sharding.Sharding, "
                        f"got {type(activation_sharding).__name__}")


def leaf_sharding_rule(device, sharding) -> tuple[Sharding | None, Callable]:
    """``(base, rule)``: the one sharding every leaf gets (``None`` for a callable ``sharding``) and
    ``rule(stage_index, leaf_path, leaf) -> Sharding``. Default: ``jax.devices()[0]``.

    Raises: ValueError: a device has no ``pinned_host`` memory.
    """
    if callable(sharding) and not isinstance(sharding, Sharding):
        return None, sharding
    if sharding is None:
        dev = device if device is not None else jax.devices()[0]
        check_memory_kinds(dev, "the streaming runtime")
        base = SingleDeviceSharding(dev)
    else:
        base = sharding
        for d in sharding.device_set:
            check_memory_kinds(d, "the streaming runtime")

    def same_for_every_leaf(i, path, leaf):
        return base
    return base, same_for_every_leaf


def activation_shardings(base, sharding, activation_sharding, batch_axis) -> tuple[Sharding, Sharding | None]:
    """``(activation sharding, batch sharding or None)``, both of memory kind ``device``: the given
    ``activation_sharding``, or by default ``base`` (one device) or ``base``'s mesh replicated; the
    batch sharding splits the leading dimension over mesh axis ``batch_axis``.

    Raises: ValueError: no default for a callable or another ``Sharding`` type; ``batch_axis`` not
      an axis of a ``NamedSharding`` activation sharding.
    """
    if activation_sharding is None:
        if isinstance(base, SingleDeviceSharding):
            activation_sharding = base
        elif isinstance(base, NamedSharding):
            activation_sharding = NamedSharding(base.mesh, PartitionSpec())
        else:
            raise ValueError("activation_sharding is required when sharding is a callable or a "
                             f"{type(sharding).__name__}")
    act = activation_sharding.with_memory_kind(DEVICE_KIND)
    batch_sh = None
    if batch_axis is not None:
        if not isinstance(act, NamedSharding) or batch_axis not in act.mesh.shape:
            raise ValueError(f"batch_axis={batch_axis!r} needs a NamedSharding activation_sharding whose mesh has "
                             f"that axis, got {activation_sharding}")
        batch_sh = NamedSharding(act.mesh, PartitionSpec(batch_axis), memory_kind=DEVICE_KIND)
    return act, batch_sh


def _leaf_group(group_of, groups, i: int, path) -> int:
    """The parameter group of stage ``i``'s trainable leaf at ``path``; ValueError naming it otherwise."""
    group = 0 if group_of is None else group_of(i, path)
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or not 0 <= group < len(groups):
        raise ValueError(f"group_of({i}, {leaf_name(path)}) returned {group!r}, not a group index in "
                         f"[0, {len(groups)})")
    return int(group)


def leaf_shardings(flat: list, rule: Callable, resident: list, trainable, groups, group_of) -> tuple:
    """Per stage: the weights' resident shardings (``pinned_host``, device memory for a ``resident``
    stage), their device shardings (pytrees like the stage's params), the trainable flag of each
    leaf and the parameter group of each trainable leaf.

    Args: ``flat`` from :func:`flatten_stage_params`; ``rule`` from :func:`leaf_sharding_rule`;
      ``trainable``, ``group_of``: the constructor's callables or ``None``; ``groups``: the
      optimizer's parameter groups or ``None``.

    Returns: ``(host_sh, dev_sh, train_mask, group_idx)``, lists of one entry per stage.

    Raises: TypeError: ``rule`` returns no ``Sharding``; ValueError: a sharding does not split its
      leaf evenly; ``group_of`` returns no valid group index (messages name the stage and leaf).
    """
    host_sh, dev_sh, train_mask, group_idx = [], [], [], []
    for i, (leaves_with_path, treedef) in enumerate(flat):
        host_leaf_sh, dev_leaf_sh, leaf_trainable, leaf_groups = [], [], [], []
        for path, leaf in leaves_with_path:
            s = rule(i, path, leaf)
            if not isinstance(s, Sharding):
                raise TypeError(f"sharding({i}, {leaf_name(path)}) returned {type(s).__name__}, "
                                "not a jax.sharding.Sharding")
            try:
                s.shard_shape(tuple(leaf.shape))
            except ValueError as e:
                raise ValueError(f"stage_params[{i}]{leaf_name(path)}: sharding {s} does not split shape "
                                 f"{tuple(leaf.shape)} evenly: {e}") from None
            host_leaf_sh.append(s.with_memory_kind(DEVICE_KIND if resident[i] else HOST_KIND))
            dev_leaf_sh.append(s.with_memory_kind(DEVICE_KIND))
            leaf_trainable.append(is_diff(leaf) and (trainable is None or bool(trainable(i, path))))
            if leaf_trainable[-1] and groups is not None:
                leaf_groups.append(_leaf_group(group_of, groups, i, path))
        host_sh.append(jax.tree_util.tree_unflatten(treedef, host_leaf_sh))
        dev_sh.append(jax.tree_util.tree_unflatten(treedef, dev_leaf_sh))
        train_mask.append(leaf_trainable)
        group_idx.append(tuple(leaf_groups))
    return host_sh, dev_sh, train_mask, group_idx


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



class RuntimePlacement:
    """The placement part of :class:`xla_swap.executors.StreamingRuntime` (a base class of it, not
    used alone): where each array lives, and replacing a stage's weights in place."""

    def _place_weights(self, stage_params, host_sh, dev_sh, train_mask, *, own_params: bool, copy: bool) -> None:
        """Put each stage's weights where ``host_sh`` says (a copy unless ``own_params``; always a copy
        for a resident stage or with ``copy``: updates never touch the caller's arrays)."""
        self._host_sh = host_sh
        self._dev_sh = dev_sh
        self._train_mask = train_mask
        #: per-stage pytrees of ``pinned_host`` arrays (device memory for ``resident`` stages):
        #: the weights. With ``optimizer``, replaced by the updated weights after each step.
        self.host_params: list = [jax.device_put(p, s, may_alias=None if own_params
                                                 else (False if (copy or r) else None))
                                  for p, s, r in zip(stage_params, host_sh, self.resident)]
        self._param_avals = [jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), p)
                             for p in self.host_params]

    def _place_optimizer_state(self, optimizer, optimizer_state, own_state: bool = False) -> None:
        """The shardings of the gradients, accumulators and moments, and the moments themselves
        (zeros, or copies of ``optimizer_state``; with ``own_state`` its arrays as they are where
        they are already placed).

        Raises: ValueError: ``optimizer_state`` given without ``optimizer``, or not one list of
          ``(m, v)`` pairs per stage as :func:`checked_state` wants them.
        """
        n = self.num_stages
        if optimizer_state is not None and (optimizer is None or isinstance(optimizer_state, (str, bytes))
                                            or not isinstance(optimizer_state, Sequence)
                                            or len(optimizer_state) != n):
            raise ValueError(f"optimizer_state must be None or, with an optimizer, one list of (m, v) pairs per "
                             f"stage ({n} stages), got {type(optimizer_state).__name__}"
                             + ("" if optimizer is not None else " without an optimizer"))
        self._place_state_shardings(optimizer is not None)
        states = []
        for i in range(n if optimizer is not None else 0):
            leaves = jax.tree_util.tree_leaves(self._param_avals[i])
            trained = [leaves[j] for j, m in enumerate(self._train_mask[i]) if m]
            if optimizer_state is None:
                states.append(_optim.init_state(optimizer, trained))
            else:
                states.append(checked_state(optimizer, optimizer_state[i], trained, i))
        #: per stage, the optimizer state: a list of ``(m, v)`` pairs, one per trainable leaf,
        #: in ``pinned_host`` (or device memory); empty lists without an optimizer.
        # fresh zeros are made where they live; a given state is copied (may_alias=False: it stays its
        # owner's) unless handed over (own_state)
        place = zeros_where_they_live if optimizer_state is None else \
            (lambda st, sh: jax.device_put(st, sh, may_alias=None if own_state else False))
        self.optimizer_state: list = [place(st, sh) for st, sh in zip(states, self._state_host_sh)]

    def _place_state_shardings(self, has_optimizer: bool) -> None:
        """Per stage, the shardings of the trainable leaves' gradients and, with an optimizer, of their
        moments and accumulated gradients, on the device and between steps."""
        grad_kind = HOST_KIND if self.grads_to_host else DEVICE_KIND
        self._grad_dev_sh, self._grad_out_sh = [], []
        self._state_dev_sh, self._state_host_sh = [], []
        self._acc_dev_sh, self._acc_host_sh = [], []
        for i in range(self.num_stages):
            dev_leaf_sh = jax.tree_util.tree_leaves(self._dev_sh[i])
            grads = [s for s, m in zip(dev_leaf_sh, self._train_mask[i]) if m]
            self._grad_dev_sh.append(grads)
            self._grad_out_sh.append([s.with_memory_kind(grad_kind) for s in grads])
            trained = [j for j, m in enumerate(self._train_mask[i]) if m] if has_optimizer else []
            state_kind = HOST_KIND if self.optimizer_state_on_host and not self.resident[i] else DEVICE_KIND
            acc_kind = HOST_KIND if self.grads_to_host and not self.resident[i] else DEVICE_KIND
            self._state_dev_sh.append([(dev_leaf_sh[j], dev_leaf_sh[j]) for j in trained])
            self._acc_dev_sh.append([dev_leaf_sh[j] for j in trained])
            self._acc_host_sh.append([dev_leaf_sh[j].with_memory_kind(acc_kind) for j in trained])
            self._state_host_sh.append([(dev_leaf_sh[j].with_memory_kind(state_kind),) * 2 for j in trained])

    @property
    def param_avals(self) -> tuple:
        """Per stage, the weights' shapes and dtypes: a pytree of ``jax.ShapeDtypeStruct`` like
        ``host_params[i]`` (read-only)."""
        return tuple(self._param_avals)

    @property
    def device_shardings(self) -> tuple:
        """Per stage, the shardings (memory kind ``device``) its weights get when streamed in: a
        pytree of ``jax.sharding.Sharding`` like ``host_params[i]`` (read-only)."""
        return tuple(self._dev_sh)

    @property
    def optimizer_state_device_shardings(self) -> tuple:
        """Per stage, the device shardings of its optimizer state: a list of ``(m, v)`` sharding
        pairs like ``optimizer_state[i]`` (a copy; empty lists without an optimizer)."""
        return tuple(list(pairs) for pairs in self._state_dev_sh)

    @property
    def trainable_mask(self) -> tuple:
        """Per stage, a tuple of bools, one per leaf of ``host_params[i]`` in leaf order: whether
        the optimizer updates it (the floating leaves ``trainable`` selects)."""
        return tuple(tuple(mask) for mask in self._train_mask)

    def activation_sharding_of(self, aval, sig=None):
        """The device sharding of an activation with avals ``aval`` (a pytree of
        ``jax.ShapeDtypeStruct``): ``activation_sharding``, or with ``batch_axis`` a pytree like
        ``aval`` with the batch sharding on leaves whose leading dimension splits evenly.
        ``sig``: the input signature (``signature(h)``) it belongs to; one that runs replicated
        (:meth:`runs_replicated`) places every activation at ``activation_sharding``."""
        return self._act(aval, sig is not None and sig.replicated)

    def runs_replicated(self, h_aval) -> bool:
        """Whether an input of avals ``h_aval`` (a pytree) runs replicated: with ``batch_axis``, when
        the leading dimension of its first leaf (the batch, or the tokens of a flat input) does not
        split over the axis' devices. Every device then computes the whole batch, each stage's
        weights gathered on the device (exact, no data parallelism); otherwise ``False``."""
        if self._batch_sh is None:
            return False
        first = jax.tree_util.tree_leaves(h_aval)[:1]
        n = self._batch_sh.mesh.shape[self.batch_axis]
        return not (first and len(first[0].shape) and first[0].shape[0] % n == 0)

    def input_sharding_of(self, h_aval):
        """Where ``forward`` / ``train_step`` place an input of avals ``h_aval`` (a pytree of
        ``jax.ShapeDtypeStruct``): a pytree like it of device shardings."""
        return self._act_tree(h_aval, self.runs_replicated(h_aval))

    def loss_args_sharding_of(self, h_aval, args_aval):
        """Where ``train_step`` places ``loss_args`` of avals ``args_aval`` for an input of avals
        ``h_aval`` (pytrees of ``jax.ShapeDtypeStruct``): laid out like the output they meet (with
        ``batch_axis``, split on the leading dimension as the output is; else, or for an input that
        runs replicated, ``activation_sharding``). A pytree like ``args_aval`` of device shardings."""
        return self._act_tree(args_aval, self.runs_replicated(h_aval))

    def trainable_paths(self, stage: int) -> list[str]:
        """The key paths (``jax.tree_util.keystr``, e.g. ``"['w']"``) of ``stage``'s trainable leaves,
        in the order of ``optimizer_state[stage]`` (and of ``grad_acc[stage]``).

        Raises: ValueError: ``stage`` is not an int in ``[0, num_stages)``.
        """
        self._check_stage(stage)
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(self._param_avals[stage])[0]]
        return [p for p, m in zip(paths, self._train_mask[stage]) if m]

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

        Raises (before anything changes): ValueError: a bad ``stage``; ``params`` of another
          structure, or a leaf of another shape or dtype (the message names the leaf); ``state``
          as the constructor's ``optimizer_state`` refuses it, or given without an optimizer; the
          runtime holds accumulated gradients (``grad_acc``: update first).
        """
        self._check_stage(stage)
        if self.grad_acc is not None:
            raise ValueError(f"the runtime holds the gradients of {self.micro_batches} accumulated micro-batches; "
                             "load after the update (train_step with accumulate=False)")
        if params is not None:
            lp, td = jax.tree_util.tree_flatten_with_path(params)
            ref_lp, ref_td = jax.tree_util.tree_flatten_with_path(self._param_avals[stage])
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
            leaves = jax.tree_util.tree_leaves(self._param_avals[stage])
            sel = [leaves[j] for j, m in enumerate(self._train_mask[stage]) if m]
            state = checked_state(self.optimizer, state, sel, stage)
        self._carry.pop(stage, None)
        if params is not None:
            self.host_params[stage] = jax.device_put(params, self._host_sh[stage], may_alias=False)
        if state is not None:
            self.optimizer_state[stage] = jax.device_put(state, self._state_host_sh[stage], may_alias=False)

    def _updated_host_params(self, stage: int, new_p) -> dict:
        """``host_params[stage]`` after an update that returned ``new_p`` (device arrays, ``host_params``'
        structure): the trainable leaves copied to where the weights live; a streamed stage keeps its
        other leaves' arrays as they are (a frozen weight never moves back), a resident one takes
        ``new_p``'s (its own, aliased: the update donated them)."""
        if self.resident[stage]:
            return jax.device_put(new_p, self._host_sh[stage])
        old, treedef = jax.tree_util.tree_flatten(self.host_params[stage])
        new, host_sh = jax.tree_util.tree_leaves(new_p), jax.tree_util.tree_leaves(self._host_sh[stage])
        sel = [j for j, m in enumerate(self._train_mask[stage]) if m]
        for j, a in zip(sel, jax.device_put([new[j] for j in sel], [host_sh[j] for j in sel])):
            old[j] = a
        return jax.tree_util.tree_unflatten(treedef, old)

    def _check_stage(self, stage) -> None:
        if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) or not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be an int in [0, {self.num_stages}), got {stage!r}")

    def _act(self, aval, replicated: bool = False):
        """The device sharding of an activation ``aval`` (pytree): ``activation_sharding``, or with
        ``batch_axis`` a pytree with the batch sharding on leaves whose leading dim splits evenly
        (unless its signature runs ``replicated``: :meth:`runs_replicated`)."""
        if self._batch_sh is None or replicated:
            return self.activation_sharding
        n = self._batch_sh.mesh.shape[self.batch_axis]
        return jax.tree_util.tree_map(
            lambda a: self._batch_sh if len(a.shape) and a.shape[0] % n == 0 else self.activation_sharding, aval)

    def _act_tree(self, aval, replicated: bool):
        """:meth:`_act` as a pytree like ``aval`` (one sharding per leaf, also where one serves all)."""
        sh = self._act(aval, replicated)
        return jax.tree_util.tree_map(lambda _: sh, aval) if isinstance(sh, Sharding) else sh

    def _gathered_sharding(self, replicated: bool) -> Sharding | None:
        """The sharding a stage's weights are constrained to inside a signature that runs replicated
        (the mesh, replicated: every device holds the whole weight), else ``None`` (as placed)."""
        return NamedSharding(self._batch_sh.mesh, PartitionSpec()) if replicated else None

    def _act_host(self, aval, replicated: bool = False):
        sh = self._act(aval, replicated)
        if isinstance(sh, Sharding):
            return sh.with_memory_kind(HOST_KIND)
        return jax.tree_util.tree_map(lambda s: s.with_memory_kind(HOST_KIND), sh)


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
        return jax.device_put(z, sh)
    return jax.tree_util.tree_map(one, zeros, shardings)


@functools.lru_cache(maxsize=64)
def _zeros_program(shape: tuple, dtype: np.dtype, sharding: Sharding):
    """A jitted ``() -> zeros(shape, dtype)`` placed at ``sharding`` (one per distinct leaf: layers share it)."""
    return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)
