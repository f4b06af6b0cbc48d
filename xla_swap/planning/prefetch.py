"""The prefetch schedule of the streaming runtime, as data: which stage's weights move when, and the live set.

Pure Python (no torch, no jax): the one description of ``StreamingRuntime``'s weight traffic and
of how many stages' weights its device memory holds, read by the runtime (``StreamingRuntime.schedule()``,
``memory_report()``) and by the planner (its memory model's weight window and its time model's
per-layer copies). ``tests/executors/test_schedule_residency.py`` checks the runtime's measured
residency against it step by step.

The schedule (``L`` stages, prefetch depth ``k``; docs/design.md, "Streaming" and "The schedule is
cyclic across calls"):

* forward: before stage 0 computes, stages ``0..min(k, L)-1`` are fetched (the prologue); after
  stage ``i``'s computation is dispatched, stage ``i+k`` is fetched. In inference with
  ``prefetch_next_call``, where ``i+k`` is past the last stage, the next call's stage ``i+k-L``
  is fetched instead (a live copy when its weights are still on the device). In training the last
  ``k+1`` stages stay on the device for the backward (once the forward fetches nothing more, the
  window has room for them).
* backward (training): stages in reverse; after stage ``i``'s backward is dispatched, stage ``i-k``
  is fetched; with ``prefetch_next_call`` the stages ``0..k`` are kept for the next call (the
  copy the backward used, or the updated weights): ``k+1`` stages, stage ``k`` in the window slot
  that stage ``-1`` would have used.
* ``resident`` stages live in device memory for good: never fetched, never counted as live.
* a fetch of a stage that the previous call left on the device (``carried_in``) moves nothing.

A step's ``live`` set is what the runtime's ``track_residency`` counts after the step: the streamed
stages with weights (or their gradients / updated weights) in device memory once the step's fetches
are issued and before its own stage is released.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from xla_swap.planning.policy import as_int, check_bool, check_flags

__all__ = ["PASSES", "ScheduleStep", "PrefetchSchedule"]

#: The passes of a call, in order (``ScheduleStep.pass_name``); inference has only the first.
PASSES = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class ScheduleStep:
    """One stage's computation in a call, and the weight copies issued right after it is dispatched.

    Attributes:
      pass_name: ``"forward"`` or ``"backward"`` (:data:`PASSES`).
      stage: the stage computed (0-based).
      fetch: stages whose weights are copied host -> device at this step for this call (at most one).
      fetch_next: stages copied host -> device at this step for the next call (cyclic schedule).
      live: the streamed stages holding device memory at this step (sorted): the stage computed,
        the window fetched ahead, the stages kept (for the backward, or for the next call).
    """

    pass_name: str
    stage: int
    fetch: tuple[int, ...]
    fetch_next: tuple[int, ...]
    live: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PrefetchSchedule:
    """The weight schedule of one ``StreamingRuntime`` call, with its predicted live set per step.

    Args:
      num_stages: ``L >= 1``.
      prefetch_depth: ``k >= 1``: stages fetched ahead of the one computing.
      training: ``False``: a ``forward``; ``True``: a ``train_step`` (forward, then backward).
      resident: per stage, ``True`` when its weights live in device memory for good (never
        fetched, not live); a sequence of ``L`` bools, default none.
      prefetch_next_call: the cyclic schedule (``StreamingRuntime(prefetch_next_call=...)``): the
        call leaves the next call's first stages in device memory (``carried_out``).
      steady_state: the call follows one of the same kind, so it starts with that call's
        ``carried_out`` in device memory (``carried_in``); ``False``: a cold call (the first of a
        loop). Without ``prefetch_next_call`` both are the same.

    Derived attributes (computed at construction):
      carried_in: streamed stages on the device when the call starts (sorted).
      prologue: stages fetched before stage 0 computes (host -> device copies, in order).
      steps: the :class:`ScheduleStep` of every stage computation, in execution order (``L``
        forward steps, then in training ``L`` backward steps, stage ``L-1`` first).
      carried_out: streamed stages left in device memory for the next call (sorted).

    Units: stages (counts and indices); :meth:`peak_live_bytes` turns them into bytes.

    Raises:
      TypeError: ``num_stages`` / ``prefetch_depth`` not an int; a flag not a bool; ``resident``
        not a sequence of bools.
      ValueError: ``num_stages < 1``; ``prefetch_depth < 1``; ``resident`` not of length ``L``.
    """

    num_stages: int
    prefetch_depth: int
    training: bool = False
    resident: tuple[bool, ...] | None = None
    prefetch_next_call: bool = True
    steady_state: bool = True
    carried_in: tuple[int, ...] = dataclasses.field(init=False)
    prologue: tuple[int, ...] = dataclasses.field(init=False)
    steps: tuple[ScheduleStep, ...] = dataclasses.field(init=False, repr=False)
    carried_out: tuple[int, ...] = dataclasses.field(init=False)

    def __post_init__(self):
        n = as_int("num_stages", self.num_stages, 1)
        k = as_int("prefetch_depth", self.prefetch_depth, 1)
        for name in ("training", "prefetch_next_call", "steady_state"):
            check_bool(name, getattr(self, name))
        res = check_flags("resident", self.resident, n)
        flags = tuple(bool(getattr(self, f)) for f in ("training", "prefetch_next_call", "steady_state"))
        built = _build(n, k, flags[0], res, flags[1], flags[2])
        for name, value in (("num_stages", n), ("prefetch_depth", k), ("resident", res),
                            ("training", flags[0]), ("prefetch_next_call", flags[1]), ("steady_state", flags[2])) \
                + tuple(built.items()):
            object.__setattr__(self, name, value)

    @property
    def max_live_stages(self) -> int:
        """The most streamed stages holding device memory at any step (``min(k+1, L)`` without resident stages)."""
        return max((len(s.live) for s in self.steps), default=0)

    def fetched(self, pass_name: str) -> tuple[int, ...]:
        """Stages whose weights cross host -> device during ``pass_name`` for this call, in order.

        The forward's include the prologue; the copies for the next call are in :attr:`next_call_fetches`.

        Raises: ValueError: ``pass_name`` is not one of :data:`PASSES`.
        """
        if pass_name not in PASSES:
            raise ValueError(f"pass_name={pass_name!r}; expected one of {', '.join(map(repr, PASSES))}")
        own = tuple(j for s in self.steps if s.pass_name == pass_name for j in s.fetch)
        return (self.prologue + own) if pass_name == "forward" else own

    @property
    def next_call_fetches(self) -> tuple[int, ...]:
        """Stages copied host -> device at this call's tail for the next call, in order."""
        return tuple(j for s in self.steps for j in s.fetch_next)

    @property
    def num_fetches(self) -> int:
        """Host -> device copies of stage weights per call (prologue, both passes, next call's)."""
        return len(self.prologue) + sum(len(s.fetch) + len(s.fetch_next) for s in self.steps)

    def peak_live_bytes(self, stage_bytes: Sequence[int]) -> int:
        """The most bytes of streamed weights in device memory at any step.

        Args:
          stage_bytes: bytes per stage (``L`` non-negative ints), e.g. ``StreamingRuntime.stage_nbytes``.

        Returns: int, bytes: the largest sum of ``stage_bytes`` over a step's ``live`` set.

        Raises: ValueError: ``stage_bytes`` is not ``L`` non-negative ints.
        """
        if isinstance(stage_bytes, (str, bytes)) or not isinstance(stage_bytes, Sequence) \
                or len(stage_bytes) != self.num_stages:
            raise ValueError(f"stage_bytes must be a sequence of {self.num_stages} ints, got {stage_bytes!r}")
        b = [as_int(f"stage_bytes[{i}]", v, 0) for i, v in enumerate(stage_bytes)]
        return max((sum(b[j] for j in s.live) for s in self.steps), default=0)


@functools.lru_cache(maxsize=256)
def _build(n: int, k: int, training: bool, res: tuple, cyclic: bool, steady: bool) -> dict:
    """The derived fields of :class:`PrefetchSchedule` (cached: the planner asks for the same ones often)."""
    nc = min(k, n)
    streamed = [j for j in range(n) if not res[j]]
    carried_in: set[int] = set()
    if cyclic and steady:           # what a call of the same kind leaves (see carried_out below)
        carried_in = {j for j in streamed if j < nc or (training and j == k)}
    live = set(carried_in)
    waiting = set(carried_in)       # carried in, not fetched yet

    def fetch(j: int) -> bool:
        """Bring stage j's weights to the device; True when that is a copy."""
        if res[j]:
            return False
        if j in waiting:            # carried in by the previous call
            waiting.discard(j)
            live.add(j)
            return False
        if j in live:               # still on the device (kept across the turn)
            return False
        live.add(j)
        return True

    prologue = tuple(j for j in range(nc) if fetch(j))
    steps: list[ScheduleStep] = []
    nxt: set[int] = set()
    keep = set(range(max(0, n - k - 1), n)) if training else set()
    for i in range(n):
        own, ahead = (), []
        if i + k < n:
            own = (i + k,) if fetch(i + k) else ()
        elif cyclic and not training:
            for c in range(min(i + k - n + 1, nc)):
                if c in nxt or res[c]:
                    continue
                if c not in live:
                    live.add(c)
                    ahead.append(c)
                nxt.add(c)
        steps.append(ScheduleStep("forward", i, own, tuple(ahead), tuple(sorted(live))))
        if i not in keep and i not in nxt:
            live.discard(i)
    live -= waiting                 # a carried copy the forward did not use is dropped
    if training:
        for i in range(n - 1, -1, -1):
            own = ()
            if cyclic and i <= k and not res[i]:
                nxt.add(i)          # kept (the updated or streamed weights) for the next call
            if i - k >= 0:
                own = (i - k,) if fetch(i - k) else ()
            steps.append(ScheduleStep("backward", i, own, (), tuple(sorted(live))))
            if i not in nxt:
                live.discard(i)
    return {"carried_in": tuple(sorted(carried_in)), "prologue": prologue, "steps": tuple(steps),
            "carried_out": tuple(sorted(nxt)) if cyclic else ()}
