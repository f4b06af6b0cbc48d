"""The passes of a ``StreamingRuntime`` call as :class:`~xla_swap.executors.streaming.executor.PassProgram` s:
what the forward, the backward and the separate update pass compute at one step, which the executor
(``executor.execute_pass``) runs step by step; with the call's weight source (the runtime's
``StageStore``) and its kept activations.

A stage's forward runs on the previous stage's output; in training its input is kept (on the device,
or offloaded to ``pinned_host``) for its backward. A stage's backward takes its input, saved residuals,
the cotangent and, by ``BackwardMode``, its accumulated gradients and moments, and sends its results
where they live (gradients or accumulated gradients to the host, or updated weights and moments). The
update pass applies the optimizer to each stage from its accumulated gradients.

Imports only jax (no torch).
"""
from __future__ import annotations

from typing import Any

import jax

from xla_swap.planning.prefetch import ScheduleStep

from .config import BackwardMode
from .executor import FetchedState, StageWeights
from ..transfers import put
from ..pytrees import HOST_KIND, tree_nbytes
from ..trace import StageEvent

__all__ = ["StoreWeights", "CallActivations", "ForwardProgram", "BackwardProgram", "UpdateProgram"]


def _event(recorder, pass_name: str, stage: int, kind: str):
    """A :class:`StageEvent` stamped now, where the call is traced (``recorder``), else ``None``."""
    return StageEvent(pass_name, stage, kind, recorder.now()) if recorder is not None else None


class StoreWeights:
    """The runtime's stage weights as a call's ``WeightSource``: ``store`` (``StageStore``), each copy counted
    by ``residency`` (``ResidencyTracker``) and stamped in ``recorder`` (a ``TraceRecorder`` or ``None``)."""

    def __init__(self, store, residency, recorder):
        self.store, self.residency, self.recorder = store, residency, recorder

    def resident(self, j: int) -> bool:
        """Whether stage ``j`` lives in device memory for good."""
        return self.store.resident[j]

    def host(self, j: int):
        """Stage ``j``'s ``host_params``."""
        return self.store.host_params[j]

    def copy(self, j: int, pass_name: str):
        """Start copying stage ``j``'s weights host -> device; returns the device copy (tracked)."""
        ev = _event(self.recorder, pass_name, j, "h2d")
        fetched = self.store.weights_in(j)
        self.residency.track(fetched, j)
        if self.recorder is not None:
            self.recorder.add(ev, fetched)
        return fetched

    def take(self, j: int):
        """Stage ``j``'s weights the previous call left on the device, or ``None``."""
        return self.store.take_carried(j)


class CallActivations:
    """A training call's stage inputs (``inputs[i]``: stage ``i``'s; ``inputs[n]`` the output until the loss
    takes it) and saved residuals, on the device or offloaded to ``pinned_host``.

    Args: ``layout`` (``ActivationLayout``), ``sig`` (the call's ``Signature``), ``save`` (the forward keeps
      residuals beyond the stage input), ``residual_shardings`` (per stage, the device shardings of its saved
      residuals, where they are offloaded; else ``None``), ``num_stages``.
    """

    def __init__(self, layout, sig, save: bool, residual_shardings: list | None, num_stages: int):
        self.layout, self.sig, self.save, self.residual_shardings = layout, sig, save, residual_shardings
        self.inputs: list = []
        self.saved: list = [None] * num_stages
        self.offloaded: list[bool] = [False] * num_stages
        #: bytes of stage inputs and saved residuals sent to ``pinned_host`` so far.
        self.offloaded_nbytes: int = 0

    def offload(self, i: int) -> None:
        """Stage ``i`` is dispatched: send its kept input (and saved residuals) to ``pinned_host``."""
        sig = self.sig
        self.offloaded_nbytes += tree_nbytes(self.inputs[i]) + (tree_nbytes(self.saved[i]) if self.save else 0)
        self.inputs[i] = put(self.inputs[i], self.layout.act_host(sig.chain[i], sig.replicated))
        if self.save:
            self.saved[i] = put(self.saved[i],
                                           [sh.with_memory_kind(HOST_KIND) for sh in self.residual_shardings[i]])
        self.offloaded[i] = True

    def fetch(self, j: int) -> None:
        """Backward: bring stage ``j``'s offloaded input (and saved residuals) back to the device."""
        if self.offloaded[j]:
            sig = self.sig
            self.inputs[j] = put(self.inputs[j], self.layout.act(sig.chain[j], sig.replicated))
            if self.save:
                self.saved[j] = put(self.saved[j], self.residual_shardings[j])
            self.offloaded[j] = False


class ForwardProgram:
    """The forward: stage ``i`` on ``x``, the previous stage's output; in training (``acts``, a
    :class:`CallActivations`) the stage inputs are kept and, with ``acts.save``, the residuals.

    Args: ``exes`` (per stage, its forward executable), ``x`` (the input on the device), ``recorder``
      (a ``TraceRecorder`` or ``None``), ``acts`` (or ``None`` for inference).
    """

    def __init__(self, exes: list, x, recorder, acts: CallActivations | None):
        self.exes, self.x, self.recorder, self.acts = exes, x, recorder, acts
        self.y = None
        if acts is not None:
            acts.inputs = [x]

    def dispatch(self, step: ScheduleStep, p) -> None:
        """Dispatch the step's stage's forward on weights ``p``; its output is ``y``."""
        i = step.stage
        ev = _event(self.recorder, "forward", i, "compute")
        if self.acts is not None and self.acts.save:
            self.y, self.acts.saved[i] = self.exes[i](p, self.x)
        else:
            self.y = self.exes[i](p, self.x)
        if self.recorder is not None:
            self.recorder.add(ev, self.y)

    def throttle_on(self):
        """The stage's input: stage ``i-1`` done, its weights' memory is free."""
        return self.x

    def finish(self, step: ScheduleStep) -> None:
        """The output is the next stage's input (and kept, in training)."""
        self.x, self.y = self.y, None
        if self.acts is not None:
            self.acts.inputs.append(self.x)


class BackwardProgram:
    """The backward: stage ``i``'s vjp on its kept input (and residuals) and the cotangent ``grad``; by
    ``mode`` its gradients go to the host (``GRADS``, into ``host_grads``), are summed into its accumulated
    gradients (``ACCUM``, into ``new_acc`` with their squares' sum in ``sumsq``), or update its weights and
    moments (``UPDATE``).

    Args: ``exes`` (per stage, its backward executable), ``acts`` (the call's :class:`CallActivations`),
      ``grad`` (the output's cotangent on the device), ``mode``, ``hyper`` (the update's rows on the device, or
      ``None``), ``weights`` (the call's ``StageWeights``: an updated or used stage kept for the next call
      goes to its ``replaced``), ``states`` / ``accs`` (:class:`FetchedState` of moments / accumulated
      gradients, or ``None``), ``store``, ``residency``, ``recorder``.
    """

    def __init__(self, exes: list, acts: CallActivations, grad, mode: BackwardMode, hyper, weights: StageWeights,
                 states: FetchedState | None, accs: FetchedState | None, store, residency, recorder):
        self.exes, self.acts, self.grad, self.mode, self.hyper = exes, acts, grad, mode, hyper
        self.weights, self.states, self.accs = weights, states, accs
        self.store, self.residency, self.recorder = store, residency, recorder
        n = len(exes)
        self.host_grads: list | None = [None] * n if mode is BackwardMode.GRADS else None
        self.new_acc: list = [None] * n
        self.sumsq: list = [None] * n
        self.held: Any = None        # the step's device-side results
        self.moved: Any = None       # what the step sends to the host
        self.prev_host: Any = None   # what the step before sent

    def dispatch(self, step: ScheduleStep, p) -> None:
        """Dispatch the step's stage's backward on weights ``p``; send its results where they live."""
        i, acts, recorder = step.stage, self.acts, self.recorder
        stage_input = acts.inputs[i]
        acts.inputs[i] = None
        ev = _event(recorder, "backward", i, "compute")
        args = (p, stage_input)
        if acts.save:
            args += (acts.saved[i],)
            acts.saved[i] = None
        args += (self.grad,)
        if self.accs is not None:
            args += (self.accs.take(i),)
        if self.mode is BackwardMode.UPDATE:
            args += (self.states.take(i), self.hyper)
        res = self.exes[i](*args)
        del args, stage_input
        self.grad, results = res[0], res[1:]
        del res
        if recorder is not None:
            recorder.add(ev, self.grad)
        ev = _event(recorder, "backward", i, "d2h")
        self.held, self.moved = self._store_results(step, p, results)
        del results
        if recorder is not None:
            recorder.add(ev, self.moved)

    def throttle_on(self):
        """Stage ``i+1``'s results on their way to the host (``None`` at the first step)."""
        return self.prev_host

    def finish(self, step: ScheduleStep) -> None:
        """The step's device results dropped; what it sent to the host is what the next step waits for."""
        self.held = None
        self.prev_host, self.moved = self.moved, None

    def _store_results(self, step: ScheduleStep, p, results: tuple):
        """Send the stage's results where they live; the weights kept for the next call (the updated ones, or
        ``p``: not donated then) go to ``weights.replaced``. Returns ``(device results, what moves to the host)``."""
        i = step.stage
        if self.mode is BackwardMode.UPDATE:
            new_p, new_s = results
            self.residency.track(results, i)
            kept = new_p  # the updated weights, already on the device
            out = results, self.store.store_update(i, new_p, new_s)
        else:
            kept = p
            out = self._store_grads(i, results)
        if i in step.keep_next:
            self.weights.replaced[i] = kept   # the step's keep_next event holds it for the next call
        return out

    def _store_grads(self, i: int, results: tuple):
        """Stage ``i``'s gradients to the host (``GRADS``) or its accumulated gradients (``ACCUM``)."""
        lay = self.store.layouts[i]
        if self.mode is BackwardMode.GRADS:
            (grads,) = results
            self.residency.track(grads, i)
            host = put(grads, list(lay.grad_out))
            # None at the leaves that get no gradient (integers, frozen weights)
            self.host_grads[i] = self.store.grads_tree(i, host)
            return grads, host
        acc, self.sumsq[i] = results
        self.residency.track(acc, i)
        self.new_acc[i] = moved = put(acc, list(lay.acc_host))
        return acc, moved


class UpdateProgram:
    """The separate update pass: stage ``i``'s weights, accumulated gradients (``accs``) and moments
    (``states``) through its update executable (``exes[i]``, with ``hyper`` and the clip coefficient ``coef``
    on the device); the new weights and moments kept where they live (``store.store_update``)."""

    def __init__(self, exes: list, hyper, coef, states: FetchedState, accs: FetchedState, store, residency,
                 recorder):
        self.exes, self.hyper, self.coef, self.states, self.accs = exes, hyper, coef, states, accs
        self.store, self.residency, self.recorder = store, residency, recorder
        self.held: Any = None
        self.moved: Any = None
        self.prev_host: Any = None

    def dispatch(self, step: ScheduleStep, p) -> None:
        """Dispatch the step's stage's update on weights ``p``; its new weights and moments to where they live."""
        i = step.stage
        ev = _event(self.recorder, "update", i, "compute")
        acc, state = self.accs.take(i), self.states.take(i)
        new_p, new_s = self.exes[i](p, acc, state, self.hyper, self.coef)
        del acc, state
        if self.recorder is not None:
            self.recorder.add(ev, new_p)
        self.residency.track((new_p, new_s), i)
        self.held = (new_p, new_s)
        self.moved = self.store.store_update(i, new_p, new_s)

    def throttle_on(self):
        """Stage ``i-1``'s results on their way to the host (``None`` at the first step)."""
        return self.prev_host

    def finish(self, step: ScheduleStep) -> None:
        """The step's new weights and moments dropped from the device side; the next step waits for their copy."""
        self.held = None
        self.prev_host, self.moved = self.moved, None
