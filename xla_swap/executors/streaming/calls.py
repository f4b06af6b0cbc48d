"""A streaming runtime's calls: a ``forward`` or ``train_step`` call (and its separate update pass)
compiled, then run pass by pass by the executor (``executor.execute_pass``), weights (and optimizer
state, accumulated gradients, offloaded activations) fetched ``prefetch_depth`` stages ahead, results
sent back to host memory.

:class:`RuntimeCalls` decides nothing about what moves when: it builds the call's
``xla_swap.planning.PrefetchSchedule`` (``schedule()``) and the programs of its passes (``passes``),
and the executor performs the schedule's events, recorded in ``executed_events``. It holds the
runtime's components (configuration, stage store, compiler, activation layout, residency tracker,
optimizer progress) and owns the last call's record. Imports only jax (no torch).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from xla_swap.planning.prefetch import PrefetchSchedule

from .config import BackwardMode, RuntimeConfig
from .executor import FetchedState, StageWeights, execute_pass
from .passes import BackwardProgram, CallActivations, ForwardProgram, StoreWeights, UpdateProgram
from ..transfers import put
from ..pytrees import aval_key, merge_diff, split_diff, tree_aval, tree_nbytes

__all__ = ["RuntimeCalls"]

_GRADS, _UPDATE, _ACCUM = BackwardMode.GRADS, BackwardMode.UPDATE, BackwardMode.ACCUM


@dataclasses.dataclass
class _Call:
    """What one ``forward`` / ``train_step`` call holds while it streams."""

    sig: object
    recorder: object
    schedule: PrefetchSchedule    # the events this call executes
    weights: StageWeights         # its stages' device weights
    acts: CallActivations | None  # train_step: its kept stage inputs and residuals


class RuntimeCalls:
    """Runs a streaming runtime's calls: ``run`` compiles a call's executables, then runs its passes
    through the executor (``executor.execute_pass``).

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
            kept = {j for s in sched.pass_steps("backward") for j in s.keep_next}
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
            hyper_arr = put(np.asarray(hyper, np.float32), self.layout.activation_sharding)
        self.residency.start_call()
        self.executed_events = []
        self.last_schedule = sched
        if recorder is not None:
            recorder.start()
        try:
            acts = None
            if train:
                offloaded = c.offload_activations and save
                acts = CallActivations(self.layout, sig, save,
                                       [list(e.output_shardings[1]) for e in fwd] if offloaded else None, n)
            call = _Call(sig, recorder, sched, StageWeights(StoreWeights(store, self.residency, recorder)), acts)
            return self._stream(call, h, fwd, bwd, loss_exe, cotangent, loss_args, hyper_arr, mode)
        finally:
            if recorder is not None:
                recorder.stop()

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
        hyper_arr = put(np.asarray(hyper, np.float32), act)
        coef_arr = put(np.asarray(coef, np.float32), act)
        states, accs = FetchedState(store.state_in), FetchedState(store.acc_in)
        program = UpdateProgram(exes, hyper_arr, coef_arr, states, accs, store, self.residency, recorder)
        execute_pass(sched, "update", program, StageWeights(StoreWeights(store, self.residency, recorder)),
                     executed=self.executed_events, states=(states, accs), throttle=self.config.throttle,
                     residency=self.residency)
        store.set_carry({})  # the schedule's carried_out: the backward's keeps are taken (donated)
        store.drop_accumulated()
        self.steps.update_done()

    def _stream(self, call: _Call, h, fwd, bwd, loss_exe, cotangent, loss_args, hyper, mode):
        """Execute one call: the forward over every stage, then for training the loss (or the given
        cotangent) and the backward in reverse; returns ``(output,)`` or ``(loss or output, input
        cotangent, gradients or None)``."""
        store = self.store
        store.keep_carried(call.schedule.carried_in)  # a stale copy is dropped
        self.offloaded_activation_nbytes = 0
        x = put(h, self.layout.act(call.sig.chain[0], call.sig.replicated))
        forward = ForwardProgram(fwd, x, call.recorder, call.acts)
        del x
        execute_pass(call.schedule, "forward", forward, call.weights, executed=self.executed_events,
                     activations=call.acts, throttle=self.config.throttle, residency=self.residency)
        store.set_carry({})  # whatever the forward did not take is stale
        if call.acts is None:
            store.set_carry(call.weights.next_call)
            return (forward.x,)
        del forward
        self.offloaded_activation_nbytes = call.acts.offloaded_nbytes
        first, grad = self._first_cotangent(call, loss_exe, cotangent, loss_args)
        backward = self._stream_backward(call, bwd, grad, hyper, mode)
        store.set_carry(call.weights.next_call)
        input_cotangent = merge_diff(backward.grad, None, split_diff(call.sig.in_aval)[2])
        return first, input_cotangent, backward.host_grads

    def _first_cotangent(self, call: _Call, loss_exe, cotangent, loss_args):
        """Pop the output from ``call.acts.inputs`` (which then holds the stage inputs); returns the loss (or
        the output) and its cotangent (the loss's gradient, or the given one placed)."""
        sig = call.sig
        out = call.acts.inputs.pop()
        grad_sh = self.layout.act(split_diff(sig.chain[-1])[0], sig.replicated)
        if cotangent is None:   # the targets laid out like the output they meet (a no-op where they are)
            if loss_args:
                loss_args = put(loss_args, self.layout.act(tree_aval(loss_args, "loss_args"),
                                                                      sig.replicated))
            loss, grad = loss_exe(out, *loss_args)
            if self.layout.batch_sharding is not None:
                grad = put(grad, grad_sh)
            return loss, grad
        given = split_diff(cotangent)[0] if aval_key(tree_aval(cotangent, "cotangent")) == \
            aval_key(sig.chain[-1]) else jax.tree_util.tree_leaves(cotangent)
        return out, put(given, grad_sh, may_alias=False)

    def _stream_backward(self, call: _Call, bwd: list, grad, hyper, mode) -> BackwardProgram:
        """The backward: the schedule's backward prologue, then its backward steps (weights, optimizer
        state, accumulated gradients, offloaded activations fetched ``prefetch_depth`` stages ahead);
        records the step's results. Returns the pass's program (its ``host_grads``: the parameter
        gradients per stage with ``GRADS``, else ``None``; its ``grad``: the input's cotangent)."""
        store = self.store
        states = FetchedState(store.state_in) if mode is _UPDATE and self.steps.optimizer is not None else None
        accs = FetchedState(store.acc_in) if mode is not _GRADS and store.grad_acc is not None else None
        program = BackwardProgram(bwd, call.acts, grad, mode, hyper, call.weights, states, accs, store,
                                  self.residency, call.recorder)
        execute_pass(call.schedule, "backward", program, call.weights, executed=self.executed_events,
                     states=tuple(s for s in (states, accs) if s is not None), activations=call.acts,
                     throttle=self.config.throttle, residency=self.residency)
        if mode is _UPDATE:
            self.steps.fused_update_done()
            store.drop_accumulated()
        elif mode is _ACCUM:
            store.accumulate(program.new_acc)
            self.steps.accumulated(program.sumsq)
        return program
