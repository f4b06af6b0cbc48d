"""Placement of a streaming runtime's arrays: shardings and memory kinds of the weights, their
gradients, the optimizer state and the activations, and loading a stage's weights in place.

Imports only jax (no torch).
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Sharding

from . import optim as _optim
from ._stages import HOST_KIND, _leaf_name

__all__ = ["RuntimePlacement", "checked_state"]


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
                    raise ValueError(f"stage_params[{stage}]{_leaf_name(path)}: got shape {shape} dtype {dtype}, "
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

    def _check_stage(self, stage) -> None:
        if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) or not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be an int in [0, {self.num_stages}), got {stage!r}")

    def _act(self, aval):
        """The device sharding of an activation ``aval`` (pytree): ``activation_sharding``, or with
        ``batch_axis`` a pytree with the batch sharding on leaves whose leading dim splits evenly."""
        if self._batch_sh is None:
            return self.activation_sharding
        n = self._batch_sh.mesh.shape[self.batch_axis]
        return jax.tree_util.tree_map(
            lambda a: self._batch_sh if len(a.shape) and a.shape[0] % n == 0 else self.activation_sharding, aval)

    def _act_host(self, aval):
        sh = self._act(aval)
        if isinstance(sh, Sharding):
            return sh.with_memory_kind(HOST_KIND)
        return jax.tree_util.tree_map(lambda s: s.with_memory_kind(HOST_KIND), sh)
