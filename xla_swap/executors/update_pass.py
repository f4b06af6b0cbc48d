"""The separate update pass of a streaming runtime: the optimizer applied to every stage from the
accumulated gradients (``train_step`` with ``max_grad_norm`` or ``skip_nonfinite``, after any
``accumulate`` micro-batches), streaming weights, accumulated gradients and moments in and weights
and moments out (the ``"update"`` pass of the call's ``PrefetchSchedule``, executed by the loop's
machinery); and each step's hyperparameter rows.

Imports only jax (no torch).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from xla_swap.planning.optimizer import HYPER_WIDTH, AdamW

from . import optim as _optim
from .stage_programs import update_only
from .trace import StageEvent

__all__ = ["RuntimeUpdatePass"]


class RuntimeUpdatePass:
    """The update-pass part of :class:`xla_swap.executors.StreamingRuntime` (a base class of it,
    not used alone)."""

    def _checked_groups(self) -> list[AdamW]:
        """``param_groups``, checked against what the executables were built for (count, state dtype)."""
        groups = self.param_groups
        if not isinstance(groups, (list, tuple)) or len(groups) != len(self._groups0) or \
                not all(isinstance(g, AdamW) and g.state_dtype == self.optimizer.state_dtype for g in groups):
            raise ValueError(f"param_groups must stay a list of {len(self._groups0)} xla_swap.planning.AdamW with "
                             f"state_dtype={self.optimizer.state_dtype!r}, got {groups!r}")
        return list(groups)

    def _step_hyper(self, lr, separate_update: bool):
        """The hyperparameter rows of the next step (``None`` without an optimizer).

        Raises: ValueError: a bad ``lr`` or ``param_groups``; ``lr`` or a ``separate_update`` option
          (``accumulate``, ``max_grad_norm``, ``skip_nonfinite``) without an optimizer.
        """
        if self.optimizer is not None:
            return _optim.hyper_rows(self._checked_groups(), self.step + 1, lr)  # ValueError for a bad lr
        if lr is not None:
            raise ValueError("lr is only used with an optimizer; this runtime has none")
        if separate_update:
            raise ValueError("accumulate, max_grad_norm and skip_nonfinite need an optimizer; without one the "
                             "gradients are returned (add or clip them yourself)")
        return None

    def _finish_step(self, mode, accumulate: bool, hyper, max_grad_norm, skip_nonfinite: bool) -> None:
        """After a training call's backward: a fused update (``mode="update"``) computed no norm; the
        last micro-batch of an ``"accum"`` step runs the separate update pass."""
        if mode == "update":
            self.last_grad_norm, self.last_step_skipped = None, False
        elif mode == "accum" and not accumulate:
            self._apply_accumulated_update(hyper, max_grad_norm, skip_nonfinite)

    def _apply_accumulated_update(self, hyper, max_grad_norm, skip_nonfinite: bool) -> None:
        """After the last micro-batch's backward: the global gradient norm (one host sync), then the
        update pass with the gradients clipped to ``max_grad_norm``, or skipped for a non-finite norm
        (``last_schedule`` is then the call's schedule without the update pass: the backward's keeps
        stay for the next call)."""
        sumsq = jax.device_get(self._sumsq)
        self._sumsq = None
        norm = float(np.sqrt(np.sum(np.asarray(sumsq, np.float64))))
        self.last_grad_norm = norm
        self.last_step_skipped = bool(skip_nonfinite and not np.isfinite(norm))
        if self.last_step_skipped:  # the call ran its schedule without the update pass
            self.grad_acc, self.micro_batches = None, 0
            self.last_schedule = dataclasses.replace(self.last_schedule, update_pass=False)
            return
        coef = np.float32(1.0)
        if max_grad_norm is not None:  # clip_grad_norm_'s float32 arithmetic
            coef = np.minimum(np.float32(max_grad_norm) / (np.float32(norm) + np.float32(1e-6)),
                              np.float32(1.0))
        self._update_pass(hyper, coef, None)  # not traced: a recorder covers one pass pair

    def _update_exe_list(self) -> list:
        """The update pass's executables, one per stage (compiled on first use, shared by stages of
        equal parameter signature): ``(p, acc, state, hyper, coef) -> (new_p, new_state)``."""
        exes = []
        donate = self.donate
        for i in range(self.num_stages):
            key = (jax.tree_util.tree_structure(self._param_avals[i]),
                   tuple((a.shape, str(a.dtype), sh) for a, sh in zip(jax.tree_util.tree_leaves(self._param_avals[i]),
                                                                      jax.tree_util.tree_leaves(self._dev_sh[i]))),
                   tuple(self._train_mask[i]), self.group_idx[i], donate)
            exe = self._update_exes.get(key)
            if exe is None:
                act = self.activation_sharding
                pspec = jax.tree_util.tree_map(self._spec, self._param_avals[i], self._dev_sh[i])
                sel = [j for j, m in enumerate(self._train_mask[i]) if m]
                leaves = jax.tree_util.tree_leaves(self._param_avals[i])
                aspec = [jax.ShapeDtypeStruct(leaves[j].shape, leaves[j].dtype, sharding=sh)
                         for j, sh in zip(sel, self._acc_dev_sh[i])]
                st_spec = jax.tree_util.tree_map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                                 self.optimizer_state[i], self._state_dev_sh[i])
                hspec = jax.ShapeDtypeStruct((len(self._groups0), HYPER_WIDTH), np.float32, sharding=act)
                cspec = jax.ShapeDtypeStruct((), np.float32, sharding=act)
                exe = jax.jit(update_only(self._train_mask[i], self.group_idx[i]),
                              out_shardings=(self._dev_sh[i], self._state_dev_sh[i]),
                              donate_argnums=(0, 2) if donate else ()).lower(
                                  pspec, aspec, st_spec, hspec, cspec).compile()
                self._update_exes.put(key, exe)
            exes.append(exe)
        return exes

    def _update_pass(self, hyper, coef, recorder) -> None:
        """Apply the optimizer to every stage from ``grad_acc`` (scaled by ``coef``): execute the
        ``"update"`` pass of the call's schedule (``last_schedule``, built with ``update_pass``) event by
        event, as the loop does the forward and backward (recorded in ``executed_events``): weights
        taken where the backward kept them or copied, moments and accumulated gradients copied
        beside them, ``prefetch_depth`` stages ahead; weights and moments out to host memory.

        Raises: RuntimeError: the call's schedule has no update pass.
        """
        sched = self.last_schedule
        if sched is None or not sched.update_pass:
            raise RuntimeError(f"the update pass runs the call's schedule's update pass; {sched!r} has none")
        exes = self._update_exe_list()
        act = self.activation_sharding
        hyper_arr = jax.device_put(np.asarray(hyper, np.float32), act)
        coef_arr = jax.device_put(np.asarray(coef, np.float32), act)
        call = self._update_call(recorder)
        self._bring(call, sched.prologue_of("update"))
        prev = None
        for step in sched.pass_steps("update"):
            i = step.stage
            ev = StageEvent("update", i, "compute", recorder.now()) if recorder is not None else None
            p, acc, state = self._weights(call, i), call.accs.pop(i), call.states.pop(i)
            new_p, new_s = exes[i](p, acc, state, hyper_arr, coef_arr)
            del p, acc, state
            if recorder is not None:
                recorder.add(ev, new_p)
            self._track((new_p, new_s), i)
            self.host_params[i] = self._updated_host_params(i, new_p)
            self.optimizer_state[i] = jax.device_put(new_s, self._state_host_sh[i])
            moved = (self.host_params[i], self.optimizer_state[i])
            if self.throttle and prev is not None:
                jax.block_until_ready(prev)  # stage i-1's results are on the host
            self._bring(call, step)
            self._record("update", i)   # stage i counted by its new weights, as in the backward
            self._release(call, step)
            del new_p, new_s
            prev = moved
        self._carry = {}  # the schedule's carried_out: the backward's keeps are taken (donated)
        self.grad_acc, self.micro_batches = None, 0
        self.step += 1
