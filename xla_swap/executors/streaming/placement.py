"""Placement of a streaming runtime's arrays: where they go (:class:`Placement`, checked once), the shardings
and memory kinds of the weights, and the :class:`ActivationLayout` of the activations.

Imports only jax (no torch).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from ..pytrees import (DEVICE_KIND, HOST_KIND, as_aval, check_input_dtypes, check_memory_kinds, is_diff,
                       leaf_name)
from .config import given_or_default
from .stage_store import zeros_where_they_live

__all__ = ["ActivationLayout", "Placement", "activation_shardings", "check_placement_args", "checked_placement",
           "flatten_stage_params", "leaf_sharding_rule", "leaf_shardings", "num_stages_of", "zeros_where_they_live"]


def num_stages_of(stage_params) -> int:
    """``len(stage_params)``; ValueError unless it is a non-empty sequence."""
    if isinstance(stage_params, (str, bytes, dict)) or not isinstance(stage_params, Sequence):
        raise ValueError(f"stage_params must be a non-empty sequence (list/tuple) of per-stage pytrees, "
                         f"got {type(stage_params).__name__}")
    if len(stage_params) == 0:
        raise ValueError("stage_params is empty: need at least one stage")
    return len(stage_params)


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a ``StreamingRuntime`` puts its stages' weights and activations; checked once, here. ``None``
    (the runtime's default) is ``Placement()``: every stage on ``jax.devices()[0]``.

    Attributes:
      device: a ``jax.Device`` holding every stage (default ``jax.devices()[0]``). Not together
        with ``sharding``.
      sharding: for several devices: a ``jax.sharding.Sharding`` used for every parameter leaf, or a
        callable ``(stage_index, leaf_path, leaf) -> Sharding``. Its memory kind is ignored: the
        runtime uses ``pinned_host`` for the resident copy and ``device`` for the streamed copy.
      activation_sharding: sharding of ``h`` between stages (memory kind ``device``). Default:
        ``device`` itself, or for a ``NamedSharding`` the same mesh fully replicated. Required when
        ``sharding`` is a callable or another Sharding type.
      batch_axis: data parallelism: the name of a mesh axis of ``activation_sharding`` (a
        ``NamedSharding``) to split the activations' leading (batch or token) dimension over. Every
        activation leaf whose leading dimension is a multiple of that axis' size is sharded on it;
        other leaves (scalars, an attention mask of batch 1) keep ``activation_sharding``. With
        weights sharded over the same axis (``sharding``) this is FSDP / ZeRO-3. Default ``None``.

    Raises (at construction): ValueError: both ``device`` and ``sharding``; TypeError: ``device`` not a
      ``jax.Device``, ``sharding`` neither a ``Sharding`` nor callable, ``activation_sharding`` not a
      ``Sharding``, ``batch_axis`` not a str. The runtime raises ValueError for a device without
      ``pinned_host`` memory, a missing ``activation_sharding`` and a ``batch_axis`` not in its mesh.
    """

    device: jax.Device | None = None
    sharding: Sharding | Callable | None = None
    activation_sharding: Sharding | None = None
    batch_axis: str | None = None

    def __post_init__(self):
        check_placement_args(self.device, self.sharding, self.activation_sharding, self.batch_axis)


def checked_placement(placement) -> Placement:
    """``placement``, or ``Placement()`` for ``None``; TypeError naming ``placement`` otherwise."""
    return given_or_default(placement, Placement, "placement")


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


class ActivationLayout:
    """Where a runtime's activations live: ``activation_sharding`` (memory kind ``device``) or, with
    ``batch_axis``, the batch sharding on leaves whose leading dimension splits over that mesh axis.

    Args: ``activation_sharding``, ``batch_axis`` and ``batch_sharding`` as :func:`activation_shardings`
      returns them (``batch_sharding`` ``None`` without ``batch_axis``).
    """

    def __init__(self, activation_sharding: Sharding, batch_axis: str | None, batch_sharding: Sharding | None):
        #: the device sharding of the activations between stages.
        self.activation_sharding: Sharding = activation_sharding
        #: the mesh axis activations are split over (data parallelism), or ``None``.
        self.batch_axis: str | None = batch_axis
        #: the sharding of a batch-split leaf, or ``None``.
        self.batch_sharding: Sharding | None = batch_sharding

    def act(self, aval, replicated: bool = False):
        """The device sharding of an activation ``aval`` (pytree): ``activation_sharding``, or with
        ``batch_axis`` a pytree with the batch sharding on leaves whose leading dim splits evenly
        (unless its signature runs ``replicated``: :meth:`runs_replicated`)."""
        if self.batch_sharding is None or replicated:
            return self.activation_sharding
        n = self.batch_sharding.mesh.shape[self.batch_axis]
        return jax.tree_util.tree_map(
            lambda a: self.batch_sharding if len(a.shape) and a.shape[0] % n == 0 else self.activation_sharding, aval)

    def act_tree(self, aval, replicated: bool):
        """:meth:`act` as a pytree like ``aval`` (one sharding per leaf, also where one serves all)."""
        sh = self.act(aval, replicated)
        return jax.tree_util.tree_map(lambda _: sh, aval) if isinstance(sh, Sharding) else sh

    def act_host(self, aval, replicated: bool = False):
        """:meth:`act` in memory kind ``pinned_host`` (an offloaded activation's)."""
        sh = self.act(aval, replicated)
        if isinstance(sh, Sharding):
            return sh.with_memory_kind(HOST_KIND)
        return jax.tree_util.tree_map(lambda s: s.with_memory_kind(HOST_KIND), sh)

    def gathered_sharding(self, replicated: bool) -> Sharding | None:
        """The sharding a stage's weights are constrained to inside a signature that runs replicated
        (the mesh, replicated: every device holds the whole weight), else ``None`` (as placed)."""
        return NamedSharding(self.batch_sharding.mesh, PartitionSpec()) if replicated else None

    def runs_replicated(self, h_aval) -> bool:
        """Whether an input of avals ``h_aval`` (a pytree) runs replicated: with ``batch_axis``, when
        the leading dimension of its first leaf (the batch, or the tokens of a flat input) does not
        split over the axis' devices. Every device then computes the whole batch, each stage's
        weights gathered on the device (exact, no data parallelism); otherwise ``False``."""
        if self.batch_sharding is None:
            return False
        first = jax.tree_util.tree_leaves(h_aval)[:1]
        n = self.batch_sharding.mesh.shape[self.batch_axis]
        return not (first and len(first[0].shape) and first[0].shape[0] % n == 0)

    def activation_sharding_of(self, aval, sig=None):
        """The device sharding of an activation with avals ``aval`` (a pytree of
        ``jax.ShapeDtypeStruct``): ``activation_sharding``, or with ``batch_axis`` a pytree like
        ``aval`` with the batch sharding on leaves whose leading dimension splits evenly.
        ``sig``: the input signature (``signature(h)``) it belongs to; one that runs replicated
        (:meth:`runs_replicated`) places every activation at ``activation_sharding``."""
        return self.act(aval, sig is not None and sig.replicated)

    def input_sharding_of(self, h_aval):
        """Where ``forward`` / ``train_step`` place an input of avals ``h_aval`` (a pytree of
        ``jax.ShapeDtypeStruct``): a pytree like it of device shardings."""
        return self.act_tree(h_aval, self.runs_replicated(h_aval))

    def loss_args_sharding_of(self, h_aval, args_aval):
        """Where ``train_step`` places ``loss_args`` of avals ``args_aval`` for an input of avals
        ``h_aval`` (pytrees of ``jax.ShapeDtypeStruct``): laid out like the output they meet (with
        ``batch_axis``, split on the leading dimension as the output is; else, or for an input that
        runs replicated, ``activation_sharding``). A pytree like ``args_aval`` of device shardings."""
        return self.act_tree(args_aval, self.runs_replicated(h_aval))
