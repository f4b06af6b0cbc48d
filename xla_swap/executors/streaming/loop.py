"""The executor of a streaming runtime: a ``forward`` or ``train_step`` call (and its separate update
pass) executed stage by stage, weights (and optimizer state, accumulated gradients, offloaded
activations) fetched ``prefetch_depth`` stages ahead, results sent back to host memory.

The :class:`StreamExecutor` decides nothing about what moves when: it executes the call's
``xla_swap.planning.PrefetchSchedule`` (``schedule()``) event by event and records each in
``executed_events``. It holds the runtime's components (configuration, stage store, compiler,
activation layout, residency tracker, optimizer progress) and owns the last call's record.
Imports only jax (no torch).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from xla_swap.planning.prefetch import EVENT_KINDS, PrefetchSchedule, ScheduleStep

from .config import BackwardMode, RuntimeConfig
from ..trace import StageEvent
from ..pytrees import HOST_KIND, aval_key, merge_diff, split_diff, tree_aval, tree_nbytes

__all__ = ["StreamExecutor", "perform_events"]

_GRADS, _UPDATE, _ACCUM = BackwardMode.GRADS, BackwardMode.UPDATE, BackwardMode.ACCUM
#: the events that bring a stage's arrays in for this call, in ``EVENT_KINDS`` order.
_INBOUND = ("fetch_state", "fetch", "take", "fetch_activations")


def perform_events(step: ScheduleStep, kinds: tuple, handle: Callable[[str, int], None], executed: list) -> None:
    """Perform ``step``'s events of ``kinds`` in ``EVENT_KINDS`` order: ``handle(kind, stage)`` for each
    stage the step lists under that kind, then ``(pass_name, step's stage, kind, stage)`` appended to
    ``executed`` (so a call's record equals its schedule's ``events()``)."""
    for kind in EVENT_KINDS:
        if kind in kinds:
            for j in getattr(step, kind):
                handle(kind, j)
                executed.append((step.pass_name, step.stage, kind, j))


class StreamExecutor:
    """Runs a streaming runtime's calls: ``run`` compiles a call's executables, then streams it.

    Args: the runtime's components: ``config`` (a ``RuntimeConfig``), ``store`` (``StageStore``),
      ``compiler`` (``StageCompiler``), ``layout`` (``ActivationLayout``), ``residency``
      (``ResidencyTracker``), ``steps`` (``OptimizerSteps``).
    """

    def __init__(self, config: RuntimeConfig, store, compiler, layout, residency, steps):
        self.config, self.store, self.compiler = config, store, compiler
        self.layout, self.residency, self.steps = layout, residency, steps
        n = config.num_stages
        #: the schedule the last call executed (an ``xla_swap.planning.PrefetchSchedule``), and its
        #: events as executed: ``(pass_name, step's stage or None, kind, stage)``, = ``events()``.
        self.last_schedule: PrefetchSchedule | None = None
        self.executed_events: list[tuple[str, int | None, str, int]] = []
        #: bytes of stage inputs and saved residuals the last ``train_step`` sent to ``pinned_host``.
        self.offloaded_activation_nbytes: int = 0
        #: bytes of the residuals each stage keeps from its forward for its backward in
        #: ``train_step`` beyond its input (0 with ``remat=True``); set by each training call.
        self.residual_nbytes: list[int] = [0] * n

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
        c = self.config
        if optimizer is None:
            optimizer = training is True and self.steps.optimizer is not None
        return PrefetchSchedule(c.num_stages, c.prefetch_depth, training=training, resident=c.resident,
                                prefetch_next_call=c.prefetch_next_call, steady_state=steady_state,
                                offload_activations=c.offload_activations, optimizer=optimizer, carry=carry,
                                update_pass=update_pass)

    def _call_schedule(self, train: bool, mode: BackwardMode, update_pass: bool) -> PrefetchSchedule:
        """The schedule of this call: cold, steady, or from the stages actually carried in (a carried
        copy of weights replaced since is stale: not carried in)."""
        carried = self.store.carried()
        optimizer = train and (mode is _UPDATE or (mode is _ACCUM and self.store.grad_acc is not None))
        sched = self.schedule(train, steady_state=bool(carried), optimizer=optimizer, update_pass=update_pass)
        if sched.carried_in != carried:
            sched = self.schedule(train, steady_state=True, optimizer=optimizer, carry=carried,
                                  update_pass=update_pass)
        return sched

    def run(self, h, *, train: bool, recorder=None, loss_exe=None, cotangent=None, loss_args=(), hyper=None,
            mode: BackwardMode = _GRADS, update_pass: bool = False):
        """One call: ``(output,)`` for ``train=False``, else ``(loss or output, input cotangent, gradients
        or None)``; ``mode`` says what the backward does with the gradients, ``hyper`` the fused update's
        rows, ``update_pass`` whether the schedule ends with the separate update pass. Every executable is
        compiled before the first transfer (errors surface before state changes)."""
        c, store = self.config, self.store
        sig = self.compiler.signature(h)
        n = c.num_stages
        donate = c.donate and recorder is None
        sched = self._call_schedule(train, mode, update_pass)
        save = train and c.remat is not True
        fwd = [self.compiler.exe(sig, self.compiler.exe_key("forward-save" if save else "forward"), i)
               for i in range(n)]
        bwd = None
        if train:
            # a resident stage's weights are not donated unless the optimizer replaces them; without
            # an optimizer, neither are those the backward keeps for the next call
            kept = {j for s in sched.steps if s.pass_name == "backward" for j in s.keep_next}
            has_acc = mode is not _GRADS and store.grad_acc is not None
            bwd = [self.compiler.exe(sig, self.compiler.exe_key(
                "backward-saved" if save else "backward",
                donate and (mode is _UPDATE or not (c.resident[i] or i in kept)), mode, has_acc), i)
                   for i in range(n)]
        if save:
            self.residual_nbytes = [tree_nbytes(e.out_info[1]) for e in fwd]
        elif train:
            self.residual_nbytes = [0] * n
        self.compiler.warn_replicated(sig)
        hyper_arr = None
        if hyper is not None:
            hyper_arr = jax.device_put(np.asarray(hyper, np.float32), self.layout.activation_sharding)
        self.residency.start_call()
        self.executed_events = []
        self.last_schedule = sched
        if recorder is not None:
            recorder.start()
        try:
            call = _Call(sig=sig, recorder=recorder, save=save, offload=train and c.offload_activations,
                         schedule=sched)
            return self._stream(call, h, fwd, bwd, train, loss_exe, cotangent, loss_args, hyper_arr, mode)
        finally:
            if recorder is not None:
                recorder.stop()

    def _copy_weights(self, j: int, pass_name: str, recorder):
        """Start copying stage j's weights host -> device; returns the device copy (tracked)."""
        ev = StageEvent(pass_name, j, "h2d", recorder.now()) if recorder is not None else None
        fetched = self.store.weights_in(j)
        self.residency.track(fetched, j)
        if recorder is not None:
            recorder.add(ev, fetched)
        return fetched

    def _fetch_state(self, j: int, states: dict | None, accs: dict | None) -> None:
        """Start moving stage j's optimizer state into ``states`` and its accumulated gradients into
        ``accs`` (each where given and not there yet)."""
        if states is not None and self.steps.optimizer is not None and j not in states:
            states[j] = self.store.state_in(j)
        if accs is not None and j not in accs:
            accs[j] = self.store.acc_in(j)

    def _perform(self, call: "_Call", step: ScheduleStep, kinds: tuple) -> None:
        """Execute ``step``'s events of ``kinds`` for this call (:func:`perform_events`)."""
        perform_events(step, kinds, lambda kind, j: self._event(call, step, kind, j), self.executed_events)

    def _event(self, call: "_Call", step: ScheduleStep, kind: str, j: int) -> None:
        """One event: stage ``j``'s weights copied for this call or the next, taken from the previous call,
        kept for the next (a backward's own stage: the weights it just used or updated, ``call.kept``);
        its optimizer state / accumulated gradients copied in; its kept activations offloaded or brought
        back; its weights released."""
        if kind == "fetch":
            call.weights[j] = self._copy_weights(j, step.pass_name, call.recorder)
        elif kind == "fetch_next":
            call.next_call[j] = (self.store.host_params[j], self._copy_weights(j, "next", call.recorder))
        elif kind == "keep_next":
            if j in call.kept:   # overrides a copy the forward kept
                call.next_call[j] = (self.store.host_params[j], call.kept.pop(j))
            elif j not in call.next_call:
                call.next_call[j] = (self.store.host_params[j], call.weights[j])  # a live copy
        elif kind == "fetch_state":
            self._fetch_state(j, call.states, call.accs)
        elif kind == "take":
            self._take(call, step, j)
        elif kind == "fetch_activations":
            self._fetch_activations(call, j)
        elif kind == "offload":
            self._offload_activations(call, j)
        elif kind == "release":
            del call.weights[j]
        else:
            raise AssertionError(f"no such event: {kind}")

    def _take(self, call: "_Call", step: ScheduleStep, j: int) -> None:
        """Stage ``j``'s weights for this call from those the previous call left on the device."""
        if j not in call.weights:
            carried = self.store.take_carried(j)
            if carried is None:
                raise RuntimeError(f"the schedule takes stage {j}'s weights at {step.pass_name} step "
                                   f"{step.stage}, but they are not on the device")
            call.weights[j] = carried  # left in device memory by the previous call

    def finish_step(self, mode: BackwardMode, accumulate: bool, hyper, max_grad_norm, skip_nonfinite: bool) -> None:
        """After a training call's backward: the last micro-batch of an ``ACCUM`` step computes the
        gradient norm and runs the separate update pass (clipped to ``max_grad_norm``), or skips it for a
        non-finite norm (``last_schedule`` is then the call's schedule without the update pass: the
        backward's keeps stay for the next call)."""
        if mode is not _ACCUM or accumulate:
            return
        coef = self.steps.clip_coefficient(max_grad_norm, skip_nonfinite)
        if coef is None:  # the call ran its schedule without the update pass
            self.store.drop_accumulated()
            self.last_schedule = dataclasses.replace(self.last_schedule, update_pass=False)
            return
        self.update_pass(hyper, coef, None)  # not traced: a recorder covers one pass pair

    def update_pass(self, hyper, coef, recorder) -> None:
        """Apply the optimizer to every stage from ``grad_acc`` (scaled by ``coef``): execute the
        ``"update"`` pass of the call's schedule (``last_schedule``, built with ``update_pass``) event by
        event, as the forward and backward are (recorded in ``executed_events``): weights taken where the
        backward kept them or copied, moments and accumulated gradients copied beside them,
        ``prefetch_depth`` stages ahead; weights and moments out to host memory.

        Raises: RuntimeError: the call's schedule has no update pass.
        """
        sched, store = self.last_schedule, self.store
        if sched is None or not sched.update_pass:
            raise RuntimeError(f"the update pass runs the call's schedule's update pass; {sched!r} has none")
        exes = self.compiler.update_exes(self.config.donate)
        act = self.layout.activation_sharding
        hyper_arr = jax.device_put(np.asarray(hyper, np.float32), act)
        coef_arr = jax.device_put(np.asarray(coef, np.float32), act)
        call = _Call(sig=None, recorder=recorder, save=False, offload=False, schedule=sched, states={}, accs={})
        self._perform(call, sched.prologue_of("update"), _INBOUND)
        prev = None
        for step in sched.pass_steps("update"):
            i = step.stage
            ev = StageEvent("update", i, "compute", recorder.now()) if recorder is not None else None
            p, acc, state = self._weights(call, i), call.accs.pop(i), call.states.pop(i)
            new_p, new_s = exes[i](p, acc, state, hyper_arr, coef_arr)
            del p, acc, state
            if recorder is not None:
                recorder.add(ev, new_p)
            self.residency.track((new_p, new_s), i)
            moved = store.store_update(i, new_p, new_s)
            if self.config.throttle and prev is not None:
                jax.block_until_ready(prev)  # stage i-1's results are on the host
            self._perform(call, step, _INBOUND)
            self.residency.record("update", i)   # stage i counted by its new weights, as in the backward
            self._perform(call, step, ("release",))
            del new_p, new_s
            prev = moved
        store.set_carry({})  # the schedule's carried_out: the backward's keeps are taken (donated)
        store.drop_accumulated()
        self.steps.update_done()

    def _weights(self, call: "_Call", i: int):
        """Stage ``i``'s weights on the device: its resident weights, or those the schedule brought."""
        return self.store.host_params[i] if self.config.resident[i] else call.weights[i]

    def _stream(self, call: "_Call", h, fwd, bwd, train, loss_exe, cotangent, loss_args, hyper, mode):
        """Execute one call: the forward over every stage, then for ``train`` the loss (or the given
        cotangent) and the backward in reverse; returns ``(output,)`` or ``(loss or output, input
        cotangent, gradients or None)``."""
        n, store = self.config.num_stages, self.store
        store.keep_carried(call.schedule.carried_in)  # a stale copy is dropped
        if call.offload and call.save:
            call.residual_dev_sh = [list(e.output_shardings[1]) for e in fwd]
        call.offloaded = [False] * n
        call.saved = [None] * n
        self.offloaded_activation_nbytes = 0
        x = self._stream_forward(call, h, fwd, train)
        store.set_carry({})  # whatever the forward did not take is stale
        if not train:
            store.set_carry(call.next_call)
            return (x,)
        del x
        first = self._first_cotangent(call, loss_exe, cotangent, loss_args)
        host_grads = self._stream_backward(call, bwd, hyper, mode)
        store.set_carry(call.next_call)
        input_cotangent = merge_diff(call.grad, None, split_diff(call.sig.in_aval)[2])
        return first, input_cotangent, host_grads

    def _stream_forward(self, call: "_Call", h, fwd: list, train: bool):
        """The forward: the schedule's prologue, then its forward steps; in training the stage inputs
        are kept in ``call.acts`` (``acts[n]`` the output). Returns the output."""
        x = jax.device_put(h, self.layout.act(call.sig.chain[0], call.sig.replicated))
        self._perform(call, call.schedule.prologue_of("forward"), _INBOUND)
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
        if self.config.throttle:
            jax.block_until_ready(x)  # stage i-1 done: its weights' memory is free
        self._perform(call, step, EVENT_KINDS[:-1])
        self.residency.record("forward", i)
        self._perform(call, step, ("release",))
        del p
        return y

    def _offload_activations(self, call: "_Call", i: int) -> None:
        """Stage ``i`` is dispatched: send its kept input (and saved residuals) to ``pinned_host``."""
        self.offloaded_activation_nbytes += tree_nbytes(call.acts[i]) + (
            tree_nbytes(call.saved[i]) if call.save else 0)
        call.acts[i] = jax.device_put(call.acts[i], self.layout.act_host(call.sig.chain[i], call.sig.replicated))
        if call.save:
            call.saved[i] = jax.device_put(call.saved[i],
                                           [sh.with_memory_kind(HOST_KIND) for sh in call.residual_dev_sh[i]])
        call.offloaded[i] = True

    def _fetch_activations(self, call: "_Call", j: int) -> None:
        """Backward: bring stage ``j``'s offloaded input (and saved residuals) back to the device."""
        if call.offloaded[j]:
            call.acts[j] = jax.device_put(call.acts[j], self.layout.act(call.sig.chain[j], call.sig.replicated))
            if call.save:
                call.saved[j] = jax.device_put(call.saved[j], call.residual_dev_sh[j])
            call.offloaded[j] = False

    def _first_cotangent(self, call: "_Call", loss_exe, cotangent, loss_args):
        """Pop the output from ``call.acts`` (which then holds the stage inputs), set ``call.grad`` to
        its cotangent (the loss's gradient, or the given one placed); returns the loss (or the output)."""
        sig = call.sig
        out = call.acts.pop()
        grad_sh = self.layout.act(split_diff(sig.chain[-1])[0], sig.replicated)
        if cotangent is None:   # the targets laid out like the output they meet (a no-op where they are)
            if loss_args:
                loss_args = jax.device_put(loss_args, self.layout.act(tree_aval(loss_args, "loss_args"),
                                                                      sig.replicated))
            loss, grad = loss_exe(out, *loss_args)
            if self.layout.batch_sharding is not None:
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
        records the step's results. Returns the parameter gradients per stage (``GRADS``), else ``None``."""
        n, store = self.config.num_stages, self.store
        call.host_grads = [None] * n if mode is _GRADS else None
        call.states = {} if mode is _UPDATE else None
        call.accs = {} if mode is not _GRADS and store.grad_acc is not None else None
        call.new_acc, call.sumsq = [None] * n, [None] * n
        self._perform(call, call.schedule.prologue_of("backward"), _INBOUND)
        for step in call.schedule.pass_steps("backward"):
            self._backward_stage(call, bwd[step.stage], step, hyper, mode)
        if mode is _UPDATE:
            self.steps.fused_update_done()
            store.drop_accumulated()
        elif mode is _ACCUM:
            store.accumulate(call.new_acc)
            self.steps.accumulated(call.sumsq)
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
        if mode is _UPDATE:
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
        if self.config.throttle and call.prev_host is not None:
            jax.block_until_ready(call.prev_host)  # stage i+1's results are on the host
        self._perform(call, step, EVENT_KINDS[:-1])
        self.residency.record("backward", i)
        self._perform(call, step, ("release",))
        del p, on_device
        call.prev_host = moved

    def _store_stage_results(self, call: "_Call", step: ScheduleStep, p, results: tuple, mode):
        """Send the step's stage's backward results where they live: gradients (``GRADS``),
        accumulated gradients (``ACCUM``) or updated weights and moments (``UPDATE``); hold the
        step's ``keep_next`` for the next call. Returns ``(device-side results, what moves to the host)``."""
        i = step.stage
        keeps_next = i in step.keep_next
        if mode is _UPDATE:
            new_p, new_s = results
            self.residency.track(results, i)
            kept = new_p  # the updated weights, already on the device
            out = results, self.store.store_update(i, new_p, new_s)
        else:
            kept = p      # not donated (see _run): the next call's forward starts with it
            out = self._store_grads(call, i, results, mode)
        if keeps_next:
            call.kept[i] = kept   # the step's keep_next event holds it for the next call
        return out

    def _store_grads(self, call: "_Call", i: int, results: tuple, mode):
        """Stage ``i``'s gradients to the host (``GRADS``) or its accumulated gradients (``ACCUM``)."""
        lay = self.store.layouts[i]
        if mode is _GRADS:
            (grads,) = results
            self.residency.track(grads, i)
            host = jax.device_put(grads, list(lay.grad_out))
            # None at the leaves that get no gradient (integers, frozen weights)
            call.host_grads[i] = self.store.grads_tree(i, host)
            return grads, host
        acc, call.sumsq[i] = results
        self.residency.track(acc, i)
        call.new_acc[i] = moved = jax.device_put(acc, list(lay.acc_host))
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
    kept: dict = dataclasses.field(default_factory=dict)  # stage -> what its backward leaves for the next call
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
