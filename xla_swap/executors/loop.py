"""The loop of a streaming runtime: a ``forward`` or ``train_step`` call executed stage by stage,
weights (and optimizer state, accumulated gradients, offloaded activations) fetched
``prefetch_depth`` stages ahead, results sent back to host memory.

The loop decides nothing about what moves when: it executes the call's
``xla_swap.planning.PrefetchSchedule`` (``schedule()``) event by event and records each in
``executed_events``. Imports only jax (no torch).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from xla_swap.planning.prefetch import PrefetchSchedule, ScheduleStep

from .trace import StageEvent
from ._stages import HOST_KIND, aval_key, merge_diff, split_diff, tree_aval, tree_nbytes

__all__ = ["RuntimeLoop"]


class RuntimeLoop:
    """The loop part of :class:`xla_swap.executors.StreamingRuntime` (a base class of it, not used
    alone): ``_run`` compiles a call's executables, then streams it."""

    def schedule(self, training: bool = False, *, steady_state: bool = True, optimizer: bool | None = None,
                 carry: Sequence[int] | None = None, update_pass: bool = False) -> PrefetchSchedule:
        """This runtime's schedule for one call: its events step by step, with the predicted live set.

        Args:
          training: ``False`` for ``forward``, ``True`` for ``train_step``.
          steady_state: the call follows one of the same kind (it starts with the stages that
            call left in device memory, ``prefetch_next_call``); ``False``: a cold call (the first,
            or after ``release_prefetched()``).
          optimizer: the backward copies optimizer state (or accumulated gradients) beside the
            weights; default: ``training`` with an ``optimizer`` (a ``train_step`` that updates;
            pass ``False`` for the first micro-batch of ``accumulate``).
          carry: the stages the previous call left on the device, where they are not what
            ``steady_state`` implies (e.g. a ``train_step`` after a ``forward``).
          update_pass: the call ends with the separate update pass (``train_step`` with an
            optimizer and ``max_grad_norm`` or ``skip_nonfinite``; ``optimizer`` then says whether
            the backward brings accumulated gradients: ``False`` unless ``accumulate`` micro-batches
            came before). A call whose update is skipped (``last_step_skipped``) executes the
            schedule without it.

        Returns: an ``xla_swap.planning.PrefetchSchedule`` over ``num_stages``, ``prefetch_depth``,
          ``resident``, ``prefetch_next_call`` and ``offload_activations``: which stage's weights
          are copied, taken, kept and released at which step, and the stages live at each step. A
          call's ``executed_events`` equal its ``events()``; with ``track_residency`` the call's
          ``residency_trace`` equals ``[(s.pass_name, s.stage, len(s.live)) for s in
          schedule.steps]`` and ``max_resident_stages`` its ``max_live_stages``.

        Raises: TypeError: a flag is not a bool. ValueError: ``optimizer`` or ``update_pass``
          without ``training``; ``carry`` not distinct streamed stages.
        """
        if optimizer is None:
            optimizer = training is True and self.optimizer is not None
        return PrefetchSchedule(self.num_stages, self.prefetch_depth, training=training, resident=self.resident,
                                prefetch_next_call=self.prefetch_next_call, steady_state=steady_state,
                                offload_activations=self.offload_activations, optimizer=optimizer, carry=carry,
                                update_pass=update_pass)

    def _call_schedule(self, train: bool, mode, update_pass: bool) -> PrefetchSchedule:
        """The schedule of this call: cold, steady, or from the stages actually carried in (a carried
        copy of weights replaced since is stale: not carried in)."""
        carried = tuple(sorted(j for j, c in self._carry.items() if c[0] is self.host_params[j]))
        optimizer = train and (mode == "update" or (mode is not None and self.grad_acc is not None))
        sched = self.schedule(train, steady_state=bool(carried), optimizer=optimizer, update_pass=update_pass)
        if sched.carried_in != carried:
            sched = self.schedule(train, steady_state=True, optimizer=optimizer, carry=carried,
                                  update_pass=update_pass)
        return sched

    def _run(self, h, *, train: bool, loss_exe=None, cotangent=None, loss_args=(), hyper=None, trace=None,
             mode=None, update_pass: bool = False):
        sig = self._signature(h)
        n = self.num_stages
        recorder = trace if trace is not None else self.trace
        donate = self.donate and recorder is None
        sched = self._call_schedule(train, mode, update_pass)
        # compile everything before the first transfer (errors surface before state changes)
        save = train and self.remat is not True
        fwd = [self._exe(sig, "forward-save" if save else "forward", i, False) for i in range(n)]
        bwd = None
        if train:
            # a resident stage's weights are not donated unless the optimizer replaces them; without
            # an optimizer, neither are those the backward keeps for the next call
            kept = {j for s in sched.steps if s.pass_name == "backward" for j in s.keep_next}
            has_acc = mode is not None and self.grad_acc is not None
            bwd = [self._exe(sig, "backward-saved" if save else "backward", i,
                             donate and (mode == "update" or not (self.resident[i] or i in kept)), mode=mode,
                             acc=has_acc)
                   for i in range(n)]
        if save:
            self.residual_nbytes = [tree_nbytes(e.out_info[1]) for e in fwd]
        elif train:
            self.residual_nbytes = [0] * n
        self._warn_replicated(sig)
        hyper_arr = None
        if hyper is not None:
            hyper_arr = jax.device_put(np.asarray(hyper, np.float32), self.activation_sharding)

        self.residency_trace = []
        self.executed_events = []
        self.last_schedule = sched
        if recorder is not None:
            recorder.start()
        try:
            call = _Call(sig=sig, recorder=recorder, save=save, offload=train and self.offload_activations,
                         schedule=sched)
            return self._stream(call, h, fwd, bwd, train, loss_exe, cotangent, loss_args, hyper_arr,
                                mode if train else None)
        finally:
            if recorder is not None:
                recorder.stop()

    def _copy_weights(self, j: int, pass_name: str, recorder):
        """Start copying stage j's weights host -> device; returns the device copy (tracked)."""
        ev = StageEvent(pass_name, j, "h2d", recorder.now()) if recorder is not None else None
        fetched = jax.device_put(self.host_params[j], self._dev_sh[j])
        self._track(fetched, j)
        if recorder is not None:
            recorder.add(ev, fetched)
        return fetched

    def _fetch_state(self, j: int, states: dict | None, accs: dict | None) -> None:
        """Start moving stage j's optimizer state into ``states`` and its accumulated gradients into
        ``accs`` (each where given and not there yet)."""
        if states is not None and self.optimizer is not None and j not in states:
            states[j] = jax.device_put(self.optimizer_state[j], self._state_dev_sh[j])
        if accs is not None and j not in accs:
            accs[j] = jax.device_put(self.grad_acc[j], self._acc_dev_sh[j])

    def _did(self, step: ScheduleStep, kind: str, j: int) -> None:
        self.executed_events.append((step.pass_name, step.stage, kind, j))

    def _bring(self, call: "_Call", step: ScheduleStep) -> None:
        """Execute ``step``'s inbound events for this call (any pass): optimizer state and accumulated
        gradients, weights copied or taken, offloaded activations."""
        for j in step.fetch_state:
            self._fetch_state(j, call.states, call.accs)
            self._did(step, "fetch_state", j)
        for j in step.fetch:
            call.weights[j] = self._copy_weights(j, step.pass_name, call.recorder)
            self._did(step, "fetch", j)
        for j in step.take:
            if j not in call.weights:
                carried = self._carry.pop(j, None)
                if carried is None:
                    raise RuntimeError(f"the schedule takes stage {j}'s weights at {step.pass_name} step "
                                       f"{step.stage}, but they are not on the device")
                call.weights[j] = carried[1]  # left in device memory by the previous call
            self._did(step, "take", j)
        for j in step.fetch_activations:
            if call.offloaded[j]:
                self._fetch_activations(call, j)
                self._did(step, "fetch_activations", j)

    def _update_call(self, recorder) -> "_Call":
        """The state of the last call's update pass (``last_schedule``'s ``"update"`` steps): weights,
        optimizer states and accumulated gradients brought by stage."""
        return _Call(sig=None, recorder=recorder, save=False, offload=False, schedule=self.last_schedule,
                     states={}, accs={})

    def _release(self, call: "_Call", step: ScheduleStep) -> None:
        for j in step.release:
            del call.weights[j]
            self._did(step, "release", j)

    def _weights(self, call: "_Call", i: int):
        """Stage ``i``'s weights on the device: its resident weights, or those the schedule brought."""
        return self.host_params[i] if self.resident[i] else call.weights[i]

    def _stream(self, call: "_Call", h, fwd, bwd, train, loss_exe, cotangent, loss_args, hyper, mode):
        """Execute one call: the forward over every stage, then for ``train`` the loss (or the given
        cotangent) and the backward in reverse; returns ``(output,)`` or ``(loss or output, input
        cotangent, gradients or None)``."""
        n = self.num_stages
        self._carry = {j: self._carry[j] for j in call.schedule.carried_in}  # a stale copy is dropped
        if call.offload and call.save:
            call.residual_dev_sh = [list(e.output_shardings[1]) for e in fwd]
        call.offloaded = [False] * n
        call.saved = [None] * n
        self.offloaded_activation_nbytes = 0
        x = self._stream_forward(call, h, fwd, train)
        self._carry = {}  # whatever the forward did not take is stale
        if not train:
            self._carry = call.next_call
            return (x,)
        del x
        first = self._first_cotangent(call, loss_exe, cotangent, loss_args)
        host_grads = self._stream_backward(call, bwd, hyper, mode)
        self._carry = call.next_call
        input_cotangent = merge_diff(call.grad, None, split_diff(call.sig.in_aval)[2])
        return first, input_cotangent, host_grads

    def _stream_forward(self, call: "_Call", h, fwd: list, train: bool):
        """The forward: the schedule's prologue, then its forward steps; in training the stage inputs
        are kept in ``call.acts`` (``acts[n]`` the output). Returns the output."""
        x = jax.device_put(h, self._act(call.sig.chain[0], call.sig.replicated))
        self._bring(call, call.schedule.prologue_of("forward"))
        call.acts = [x] if train else None
        for step in call.schedule.pass_steps("forward"):
            y = self._forward_stage(call, fwd[step.stage], step, x)
            x = y
            if train:
                call.acts.append(y)
        return x

    def _forward_stage(self, call: "_Call", exe, step: ScheduleStep, x):
        """Dispatch the step's stage's forward on input ``x``, then execute the step's events (weights
        fetched ahead or kept for the next call, the input offloaded, weights released); returns the
        stage's output."""
        i, recorder = step.stage, call.recorder
        p = self._weights(call, i)
        ev = StageEvent("forward", i, "compute", recorder.now()) if recorder is not None else None
        if call.save:
            y, call.saved[i] = exe(p, x)
        else:
            y = exe(p, x)
        if recorder is not None:
            recorder.add(ev, y)
        if self.throttle:
            jax.block_until_ready(x)  # stage i-1 done: its weights' memory is free
        for c in step.fetch_next:
            call.next_call[c] = (self.host_params[c], self._copy_weights(c, "next", recorder))
            self._did(step, "fetch_next", c)
        for c in step.keep_next:
            if c not in call.next_call:
                call.next_call[c] = (self.host_params[c], call.weights[c])  # a live copy
            self._did(step, "keep_next", c)
        self._bring(call, step)
        for j in step.offload:
            self._offload_activations(call, j)
            self._did(step, "offload", j)
        self._record("forward", i)
        self._release(call, step)
        del p
        return y

    def _offload_activations(self, call: "_Call", i: int) -> None:
        """Stage ``i`` is dispatched: send its kept input (and saved residuals) to ``pinned_host``."""
        self.offloaded_activation_nbytes += tree_nbytes(call.acts[i]) + (
            tree_nbytes(call.saved[i]) if call.save else 0)
        call.acts[i] = jax.device_put(call.acts[i], self._act_host(call.sig.chain[i], call.sig.replicated))
        if call.save:
            call.saved[i] = jax.device_put(call.saved[i],
                                           [sh.with_memory_kind(HOST_KIND) for sh in call.residual_dev_sh[i]])
        call.offloaded[i] = True

    def _fetch_activations(self, call: "_Call", j: int) -> None:
        """Backward: bring stage ``j``'s offloaded input (and saved residuals) back to the device."""
        if call.offloaded[j]:
            call.acts[j] = jax.device_put(call.acts[j], self._act(call.sig.chain[j], call.sig.replicated))
            if call.save:
                call.saved[j] = jax.device_put(call.saved[j], call.residual_dev_sh[j])
            call.offloaded[j] = False

    def _first_cotangent(self, call: "_Call", loss_exe, cotangent, loss_args):
        """Pop the output from ``call.acts`` (which then holds the stage inputs), set ``call.grad`` to
        its cotangent (the loss's gradient, or the given one placed); returns the loss (or the output)."""
        sig = call.sig
        out = call.acts.pop()
        grad_sh = self._act(split_diff(sig.chain[-1])[0], sig.replicated)
        if cotangent is None:   # the targets laid out like the output they meet (a no-op where they are)
            if loss_args:
                loss_args = jax.device_put(loss_args, self._act(tree_aval(loss_args, "loss_args"), sig.replicated))
            loss, grad = loss_exe(out, *loss_args)
            if self._batch_sh is not None:
                grad = jax.device_put(grad, grad_sh)
            first = loss
        else:
            given = split_diff(cotangent)[0] if aval_key(tree_aval(cotangent, "cotangent")) == \
                aval_key(sig.chain[-1]) else jax.tree_util.tree_leaves(cotangent)
            grad = jax.device_put(given, grad_sh, may_alias=False)
            first = out
        call.grad = grad
        return first

    def _stream_backward(self, call: "_Call", bwd: list, hyper, mode):
        """The backward: the schedule's backward prologue, then its backward steps (weights, optimizer
        state, accumulated gradients, offloaded activations fetched ``prefetch_depth`` stages ahead);
        records the step's results. Returns the parameter gradients per stage (``mode=None``), else ``None``."""
        n = self.num_stages
        call.host_grads = [None] * n if mode is None else None
        call.states = {} if mode == "update" else None
        call.accs = {} if mode is not None and self.grad_acc is not None else None
        call.new_acc, call.sumsq = [None] * n, [None] * n
        self._bring(call, call.schedule.prologue_of("backward"))
        for step in call.schedule.pass_steps("backward"):
            self._backward_stage(call, bwd[step.stage], step, hyper, mode)
        if mode == "update":
            self.step += 1
            self.grad_acc, self.micro_batches = None, 0
        elif mode == "accum":
            self.grad_acc, self.micro_batches = call.new_acc, self.micro_batches + 1
            self._sumsq = call.sumsq
        return call.host_grads

    def _backward_stage(self, call: "_Call", exe, step: ScheduleStep, hyper, mode) -> None:
        """Dispatch the step's stage's backward, send its results (gradients, accumulated gradients, or
        updated weights and moments) to where they live, then execute the step's events."""
        i, recorder = step.stage, call.recorder
        p = self._weights(call, i)
        stage_input = call.acts[i]
        call.acts[i] = None
        ev = StageEvent("backward", i, "compute", recorder.now()) if recorder is not None else None
        args = (p, stage_input)
        if call.save:
            args += (call.saved[i],)
            call.saved[i] = None
        args += (call.grad,)
        if call.accs is not None:
            args += (call.accs.pop(i),)
        if mode == "update":
            args += (call.states.pop(i), hyper)
        res = exe(*args)
        del args, stage_input
        call.grad, results = res[0], res[1:]
        del res
        if recorder is not None:
            recorder.add(ev, call.grad)
        ev = StageEvent("backward", i, "d2h", recorder.now()) if recorder is not None else None
        on_device, moved = self._store_stage_results(call, step, p, results, mode)
        del results
        if recorder is not None:
            recorder.add(ev, moved)
        if self.throttle and call.prev_host is not None:
            jax.block_until_ready(call.prev_host)  # stage i+1's results are on the host
        self._bring(call, step)
        self._record("backward", i)
        self._release(call, step)
        del p, on_device
        call.prev_host = moved

    def _store_stage_results(self, call: "_Call", step: ScheduleStep, p, results: tuple, mode):
        """Send the step's stage's backward results where they live: gradients (``mode=None``),
        accumulated gradients (``"accum"``) or updated weights and moments (``"update"``); hold the
        step's ``keep_next`` for the next call. Returns ``(device-side results, what moves to the host)``."""
        i = step.stage
        keeps_next = i in step.keep_next
        if mode == "update":
            new_p, new_s = results
            self._track(results, i)
            self.host_params[i] = self._updated_host_params(i, new_p)
            self.optimizer_state[i] = jax.device_put(new_s, self._state_host_sh[i])
            kept = new_p  # the updated weights, already on the device
            out = results, (self.host_params[i], self.optimizer_state[i])
        else:
            kept = p      # not donated (see _run): the next call's forward starts with it
            out = self._store_grads(call, i, results, mode)
        if keeps_next:
            call.next_call[i] = (self.host_params[i], kept)
            self._did(step, "keep_next", i)
        return out

    def _store_grads(self, call: "_Call", i: int, results: tuple, mode):
        """Stage ``i``'s gradients to the host (``mode=None``) or its accumulated gradients (``"accum"``)."""
        if mode is None:
            (grads,) = results
            self._track(grads, i)
            host = jax.device_put(grads, self._grad_out_sh[i])
            leaves, treedef = jax.tree_util.tree_flatten(self._param_avals[i])
            it = iter(host)   # None at the leaves that get no gradient (integers, frozen weights)
            call.host_grads[i] = jax.tree_util.tree_unflatten(treedef, [next(it) if m else None
                                                                        for m in self._train_mask[i]])
            return grads, host
        acc, call.sumsq[i] = results
        self._track(acc, i)
        call.new_acc[i] = moved = jax.device_put(acc, self._acc_host_sh[i])
        return acc, moved


@dataclasses.dataclass
class _Call:
    """What one ``forward`` / ``train_step`` call holds while it streams (stage -> device arrays)."""

    sig: Any
    recorder: Any
    save: bool                 # train_step keeps residuals beyond the stage input (remat other than True)
    offload: bool              # train_step offloads kept activations (offload_activations)
    schedule: PrefetchSchedule  # the events this call executes
    next_call: dict = dataclasses.field(default_factory=dict)  # stage -> (host_params copied from, device copy)
    weights: dict = dataclasses.field(default_factory=dict)  # stage -> its streamed weights on the device
    states: dict | None = None  # stage -> its optimizer state on the device
    accs: dict | None = None    # stage -> its accumulated gradients on the device
    acts: list | None = None   # train_step: stage i's input (on the device or offloaded)
    saved: list | None = None  # per stage, the residuals kept for its backward
    offloaded: list | None = None
    residual_dev_sh: list | None = None  # per stage, the device shardings of its saved residuals
    grad: Any = None           # the cotangent flowing backward
    prev_host: Any = None      # the previous stage's results moving to the host
    host_grads: list | None = None
    new_acc: list | None = None
    sumsq: list | None = None
