"""The one executor of the streaming runtime: it runs a pass of an ``xla_swap.planning.PrefetchSchedule``
(forward, backward, update, or a decode step's forward) step by step, and performs the schedule's events.

:func:`execute_pass` holds the only loop over a schedule's steps in the package. It performs the pass's
prologue, then per step: the step's stage dispatched (a :class:`PassProgram`, which knows what the pass
computes and holds no loop), the throttle wait, the step's events in ``EVENT_KINDS`` order, the
residency count, the release. Each event moves one stage's per-stage arrays:

* weights (:class:`StageWeights`, from a :class:`WeightSource`): copied for this call or the next one,
  taken from the previous call, kept for the next one, released;
* per-stage state (:class:`FetchedState`): the optimizer's moments and accumulated gradients of
  training, a decode step's KV cache in ``pinned_host``: brought to the device by ``fetch_state``,
  taken (donated) by the stage's dispatch;
* kept activations (training, :class:`ActivationMover`): offloaded to ``pinned_host``, brought back.

Every performed event is appended to the caller's ``executed`` list as ``(pass_name, step's stage or
None, kind, stage)``: a call's record equals its schedule's ``events()``.

The order in which the host dispatches copies and executables is what makes them overlap on the
device; this loop fixes it for every pass. Imports only jax (no torch).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import jax

from xla_swap.planning.prefetch import EVENT_KINDS, PrefetchSchedule, ScheduleStep

__all__ = ["execute_pass", "PassProgram", "WeightSource", "StageWeights", "FetchedState", "ActivationMover"]

#: the events of a step before its own stage's release, and the release (performed after the residency count).
_RELEASE = ("release",)
_BEFORE_RELEASE = tuple(k for k in EVENT_KINDS if k not in _RELEASE)


class PassProgram(Protocol):
    """What one pass computes at each of its steps (no loop: :func:`execute_pass` calls it step by step)."""

    def dispatch(self, step: ScheduleStep, weights) -> None:
        """Dispatch ``step.stage`` on its device ``weights`` (asynchronous) and start moving its results where
        they live; hold what must stay referenced until the step's release."""

    def throttle_on(self) -> Any:
        """What the host waits for before the step's events when the pass throttles (``None``: nothing)."""

    def finish(self, step: ScheduleStep) -> None:
        """After the step's events: drop what the step held; its output becomes the next step's input."""


class WeightSource(Protocol):
    """Where a call's stage weights come from."""

    def resident(self, j: int) -> bool:
        """Whether stage ``j``'s weights live in device memory for good (``host(j)`` is what it runs on)."""

    def host(self, j: int) -> Any:
        """Stage ``j``'s weights where they live (the identity a copy kept for the next call is checked by)."""

    def copy(self, j: int, pass_name: str) -> Any:
        """Start copying stage ``j``'s weights to the device (``pass_name``: the pass, or ``"next"``); the copy."""

    def take(self, j: int) -> Any:
        """Stage ``j``'s device copy the previous call left (removed from what it left), or ``None``."""


class StageWeights:
    """The device weights one call holds, per stage.

    Args: ``source``: a :class:`WeightSource`.

    Attributes: ``weights`` (stage -> its device weights for this call, from its ``fetch`` / ``take`` to its
      ``release``); ``next_call`` (stage -> ``(source.host(stage), device weights)`` held for the next call);
      ``replaced`` (stage -> the weights a step left in place of its own, e.g. its updated weights: its
      ``keep_next`` holds those).
    """

    def __init__(self, source: WeightSource):
        self.source = source
        self.weights: dict[int, Any] = {}
        self.next_call: dict[int, tuple[Any, Any]] = {}
        self.replaced: dict[int, Any] = {}

    def of(self, i: int):
        """Stage ``i``'s weights on the device: its resident weights, or those the schedule brought."""
        return self.source.host(i) if self.source.resident(i) else self.weights[i]

    def fetch(self, step: ScheduleStep, j: int) -> None:
        """``fetch``: stage ``j``'s weights copied for this call."""
        self.weights[j] = self.source.copy(j, step.pass_name)

    def fetch_next(self, step: ScheduleStep, j: int) -> None:
        """``fetch_next``: stage ``j``'s weights copied for the next call."""
        self.next_call[j] = (self.source.host(j), self.source.copy(j, "next"))

    def keep_next(self, step: ScheduleStep, j: int) -> None:
        """``keep_next``: stage ``j``'s weights held for the next call: those its step left in place
        (``replaced``, overriding a copy held before), else a live copy unless one is held already."""
        if j in self.replaced:
            self.next_call[j] = (self.source.host(j), self.replaced.pop(j))
        elif j not in self.next_call:
            self.next_call[j] = (self.source.host(j), self.weights[j])

    def take(self, step: ScheduleStep, j: int) -> None:
        """``take``: stage ``j``'s weights acquired without a copy (still here, or left by the previous call).

        Raises: RuntimeError: they are not on the device.
        """
        if j not in self.weights:
            carried = self.source.take(j)
            if carried is None:
                raise RuntimeError(f"the schedule takes stage {j}'s weights at {step.pass_name} step "
                                   f"{step.stage}, but they are not on the device")
            self.weights[j] = carried

    def release(self, step: ScheduleStep, j: int) -> None:
        """``release``: this call drops stage ``j``'s weights."""
        del self.weights[j]


class FetchedState:
    """One kind of per-stage state a pass brings to the device (``fetch_state``) and its stages' dispatch takes.

    Args: ``copy``: ``copy(j)`` starts moving stage ``j``'s state to the device and returns it there.

    Attributes: ``arrays``: stage -> its state on the device, from its ``fetch_state`` until taken.
    """

    def __init__(self, copy: Callable[[int], Any]):
        self.copy = copy
        self.arrays: dict[int, Any] = {}

    def fetch(self, j: int) -> None:
        """Start moving stage ``j``'s state to the device, unless it is there."""
        if j not in self.arrays:
            self.arrays[j] = self.copy(j)

    def take(self, j: int):
        """Stage ``j``'s state on the device, given up to its dispatch (which donates it)."""
        return self.arrays.pop(j)


class ActivationMover(Protocol):
    """A training call's kept activations, per stage."""

    def offload(self, j: int) -> None:
        """Stage ``j`` is dispatched: send its kept input (and saved residuals) to ``pinned_host``."""

    def fetch(self, j: int) -> None:
        """Bring stage ``j``'s offloaded input (and saved residuals) back to the device."""


def _handlers(weights: StageWeights, states: Sequence[FetchedState], activations: ActivationMover | None) -> dict:
    """``kind -> handle(step, stage)`` for every event kind of ``EVENT_KINDS``."""
    def fetch_state(step, j):
        for s in states:
            s.fetch(j)

    def no_activations(step, j):
        raise AssertionError(f"{step.pass_name} step {step.stage} moves stage {j}'s activations; this pass keeps none")

    return {"fetch_next": weights.fetch_next, "keep_next": weights.keep_next, "fetch_state": fetch_state,
            "fetch": weights.fetch, "take": weights.take,
            "fetch_activations": (lambda step, j: activations.fetch(j)) if activations else no_activations,
            "offload": (lambda step, j: activations.offload(j)) if activations else no_activations,
            "release": weights.release}


def _perform(step: ScheduleStep, kinds: tuple, handlers: dict, executed: list) -> None:
    """Perform ``step``'s events of ``kinds`` in ``EVENT_KINDS`` order, each appended to ``executed``."""
    for kind in kinds:
        handle = handlers[kind]
        for j in getattr(step, kind):
            handle(step, j)
            executed.append((step.pass_name, step.stage, kind, j))


def execute_pass(schedule: PrefetchSchedule, pass_name: str, program: PassProgram, weights: StageWeights, *,
                 executed: list, states: Sequence[FetchedState] = (), activations: ActivationMover | None = None,
                 throttle: bool = False, residency=None) -> None:
    """Run the ``pass_name`` pass of ``schedule``: its prologue's events, then per step, in order: the step's
    stage dispatched (``program.dispatch`` on ``weights.of(stage)``); with ``throttle``, the host waits for
    ``program.throttle_on()`` (stage ``i-1``'s computation or results: their memory is then free); the
    step's events but its release; ``residency.record(pass_name, stage)`` (a ``ResidencyTracker``, where
    given); the release; ``program.finish``.

    Args:
      schedule: the call's schedule; pass_name: one of its passes (``PASSES``).
      program: the pass's :class:`PassProgram`; weights: the call's :class:`StageWeights`.
      executed: the call's record: each event performed is appended (``(pass_name, step's stage, kind, stage)``).
      states: the per-stage states its ``fetch_state`` events bring, in order (:class:`FetchedState`).
      activations: what its ``offload`` / ``fetch_activations`` events move (training), else ``None``.

    Raises: ValueError: ``schedule`` has no pass ``pass_name``. RuntimeError: a ``take`` of weights that are
      not on the device. AssertionError: an activation event without ``activations``.
    """
    handlers = _handlers(weights, states, activations)
    _perform(schedule.prologue_of(pass_name), EVENT_KINDS, handlers, executed)
    for step in schedule.pass_steps(pass_name):
        program.dispatch(step, weights.of(step.stage))
        if throttle:
            wait = program.throttle_on()
            if wait is not None:
                jax.block_until_ready(wait)
        _perform(step, _BEFORE_RELEASE, handlers, executed)
        if residency is not None:
            residency.record(pass_name, step.stage)
        _perform(step, _RELEASE, handlers, executed)
        program.finish(step)
