"""The prefetch schedule of the streaming runtime, as data: which stage's weights move when, and the live set.

Pure Python (no torch, no jax): the one description of a ``StreamingRuntime`` call, which the
streaming executor (``executors.streaming.executor``) performs event by event (``executed_events``
records them), the planner times (its rows are the steps) and the memory model sums (``max_live_stages``).
``tests/executors/test_schedule_residency.py`` checks the runtime's measured residency against it,
``tests/executors/test_schedule_one_object.py`` its executed events.

The schedule (``L`` stages, prefetch depth ``k``; docs/explanation/design.md, "Streaming" and "The schedule is
cyclic across calls"):

* forward: before stage 0 computes, stages ``0..min(k, L)-1`` are fetched (the prologue); after
  stage ``i``'s computation is dispatched, stage ``i+k`` is fetched. In inference with
  ``prefetch_next_call``, where ``i+k`` is past the last stage, the next call's stage ``i+k-L``
  is kept for it (copied when its weights are no longer on the device). In training the last
  ``k+1`` stages stay on the device for the backward; with ``offload_activations`` the other
  stages' inputs go to host memory after their forward.
* backward (training): stages in reverse; its prologue takes the last ``min(k, L)`` stages; after
  stage ``i``'s backward is dispatched, stage ``i-k`` is fetched (with ``optimizer``, its optimizer
  state beside it; its offloaded input comes back); with ``prefetch_next_call`` the stages
  ``0..k`` are kept for the next call: ``k+1`` stages, stage ``k`` in the slot stage ``-1`` would use.
* update (``update_pass``: ``train_step`` with ``max_grad_norm`` or ``skip_nonfinite``, the
  gradients summed over any ``accumulate`` micro-batches before): stages in order; its prologue
  brings stages ``0..min(k, L)-1``, stage ``i``'s update is followed by stage ``i+k``'s; each
  brought stage's moments and accumulated gradients come beside its weights, which are taken where
  the backward kept them. Nothing is kept for the next call.
* ``resident`` stages live in device memory for good: never fetched, taken, released or live.
* a fetch of a stage on the device (carried in from the previous call, or kept) is a ``take``.

A step's ``live`` set is what the runtime's ``track_residency`` counts after the step: the streamed
stages with weights (or their gradients / updated weights) in device memory once the step's fetches
are issued and before its own stage is released.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from xla_swap.planning.policy import as_int, check_bool, check_flags

__all__ = ["PASSES", "EVENT_KINDS", "ScheduleStep", "PrefetchSchedule"]

#: The passes of a call, in order (``ScheduleStep.pass_name``); inference has only the first, the
#: ``"update"`` pass is the separate update pass (``PrefetchSchedule(update_pass=True)``).
PASSES = ("forward", "backward", "update")

#: The events of a step, in the order the runtime performs them (the :class:`ScheduleStep` fields of
#: that name): a forward step has either ``fetch`` / ``take`` or ``fetch_next`` / ``keep_next``.
EVENT_KINDS = ("fetch_next", "keep_next", "fetch_state", "fetch", "take", "fetch_activations", "offload",
               "release")


@dataclasses.dataclass(frozen=True)
class ScheduleStep:
    """One stage's computation in a call (or a pass's prologue), and the events issued right after it.

    The event fields are tuples of stage indices, in the order issued (:data:`EVENT_KINDS`).

    Attributes:
      pass_name: ``"forward"``, ``"backward"`` or ``"update"`` (:data:`PASSES`).
      stage: the stage computed (0-based); ``None`` for a prologue (the events before the pass's
        first stage computes).
      fetch: stages whose weights are copied host -> device at this step for this call.
      fetch_next: stages copied host -> device at this step for the next call (cyclic schedule).
      live: the streamed stages holding device memory at this step (sorted): the stage computed,
        the window fetched ahead, the stages kept (for the backward, the update pass or the next call).
      take: stages whose weights this call acquires at this step without a copy: carried in from
        the previous call, or still on the device (kept from the forward for the backward, or by the
        backward for the update pass).
      keep_next: stages whose device weights are held for the next call from this step on (a live
        copy; those in ``fetch_next``; in the backward the copy it used, or the updated weights); with
        an update pass, held for it (it takes them; nothing reaches the next call).
      release: stages whose weights this call drops after this step (held on only by ``keep_next``).
      offload: stages whose kept input (and saved residuals) go to host memory after this step.
      fetch_activations: stages whose offloaded input comes back to the device at this step.
      fetch_state: stages whose state is brought to the device at this step: in the backward their
        optimizer state (and accumulated gradients), ahead of it (``optimizer``; resident stages
        too), a copy host -> device where it lives in host memory (``optimizer_state_on_host``); in
        the update pass every stage's moments and accumulated gradients, ahead of its update; in
        the forward their per-stage state in host memory (``host_state``: a decode step's KV
        cache), beside the stage's weights.
    """

    pass_name: str
    stage: int | None
    fetch: tuple[int, ...]
    fetch_next: tuple[int, ...]
    live: tuple[int, ...]
    take: tuple[int, ...] = ()
    keep_next: tuple[int, ...] = ()
    release: tuple[int, ...] = ()
    offload: tuple[int, ...] = ()
    fetch_activations: tuple[int, ...] = ()
    fetch_state: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class PrefetchSchedule:
    """The schedule of one ``StreamingRuntime`` call: its events step by step, with the live set per step.

    Args:
      num_stages: ``L >= 1``.
      prefetch_depth: ``k >= 1``: stages fetched ahead of the one computing.
      training: ``False``: a ``forward``; ``True``: a ``train_step`` (forward, then backward).
      resident: per stage, ``True`` when its weights live in device memory for good (never
        fetched, not live); a sequence of ``L`` bools, default none.
      prefetch_next_call: the cyclic schedule (``RuntimeConfig(prefetch_next_call=...)``): the
        call leaves the next call's first stages in device memory (``carried_out``).
      steady_state: the call follows one of the same kind, so it starts with that call's
        ``carried_out`` in device memory (``carried_in``); ``False``: a cold call (the first of a
        loop). Without ``prefetch_next_call`` both are the same.
      offload_activations: in training, the stage inputs not kept for the backward (all but the
        last ``k+1``) go to host memory after their forward and come back ``k`` stages ahead of
        their backward (``RuntimeConfig(offload_activations=True)``); no effect in inference.
      optimizer: the backward copies each stage's optimizer state (moments, accumulated gradients)
        to the device beside its weights (``train_step`` with an optimizer; in an ``accumulate``
        micro-batch or with ``update_pass``, only the accumulated gradients of the micro-batches
        before: ``False`` for the first). Needs ``training``.
      update_pass: after the backward, a third pass (``"update"``) applies the optimizer to every
        stage from the accumulated gradients (``train_step`` with an optimizer and ``max_grad_norm``
        or ``skip_nonfinite``): weights taken where the backward
        kept them, else copied; moments and accumulated gradients copied beside them (``fetch_state``);
        ``carried_out`` is empty (the updated weights stay in host memory), so a ``steady_state`` call
        of this kind starts with nothing. Needs ``training``.
      carry: the streamed stages the previous call left in device memory, where they are not what
        ``steady_state`` implies (a ``train_step`` after a ``forward``, a stage whose weights were
        replaced): a sequence of distinct stage indices, not resident; default ``None``.
      host_state: per stage, ``True`` when it has a state in host memory that the forward brings to
        the device with its weights (``fetch_state``, resident stages too; the decode loop's KV cache
        in ``pinned_host``, ``StatefulStreamer``); a sequence of ``L`` bools, default none. Inference only.

    Derived attributes (computed at construction):
      carried_in: streamed stages on the device when the call starts (sorted).
      prologue: stages fetched before stage 0 computes (host -> device copies, in order).
      prologues: one :class:`ScheduleStep` per pass (``stage=None``): the events before its first
        stage computes.
      steps: the :class:`ScheduleStep` of every stage computation, in execution order (``L``
        forward steps, then in training ``L`` backward steps, stage ``L-1`` first, then with
        ``update_pass`` ``L`` update steps, stage 0 first).
      carried_out: streamed stages left in device memory for the next call (sorted).

    Units: stages (counts and indices); :meth:`peak_live_bytes` turns them into bytes.

    Raises:
      TypeError: ``num_stages`` / ``prefetch_depth`` / a ``carry`` entry not an int; a flag not a
        bool; ``resident`` not a sequence of bools.
      ValueError: ``num_stages < 1``; ``prefetch_depth < 1``; ``resident`` not of length ``L``;
        ``optimizer`` or ``update_pass`` without ``training``; ``carry`` not distinct streamed stages
        below ``L``; ``host_state`` not of length ``L``, or a stage with ``host_state`` in training.
    """

    num_stages: int
    prefetch_depth: int
    training: bool = False
    resident: tuple[bool, ...] | None = None
    prefetch_next_call: bool = True
    steady_state: bool = True
    offload_activations: bool = False
    optimizer: bool = False
    carry: tuple[int, ...] | None = None
    host_state: tuple[bool, ...] | None = None
    update_pass: bool = False
    carried_in: tuple[int, ...] = dataclasses.field(init=False)
    prologue: tuple[int, ...] = dataclasses.field(init=False)
    prologues: tuple[ScheduleStep, ...] = dataclasses.field(init=False, repr=False)
    steps: tuple[ScheduleStep, ...] = dataclasses.field(init=False, repr=False)
    carried_out: tuple[int, ...] = dataclasses.field(init=False)

    def __post_init__(self):
        n = as_int("num_stages", self.num_stages, 1)
        k = as_int("prefetch_depth", self.prefetch_depth, 1)
        names = ("training", "prefetch_next_call", "steady_state", "offload_activations", "optimizer", "update_pass")
        for name in names:
            check_bool(name, getattr(self, name))
        res = check_flags("resident", self.resident, n)
        flags = tuple(bool(getattr(self, f)) for f in names)
        if flags[4] and not flags[0]:
            raise ValueError("optimizer=True needs training=True (the optimizer state moves in the backward)")
        if flags[5] and not flags[0]:
            raise ValueError("update_pass=True needs training=True (the update pass follows the backward)")
        carry = _checked_carry(self.carry, n, res)
        state = check_flags("host_state", self.host_state, n)
        if flags[0] and any(state):
            raise ValueError("host_state is for inference: training=True moves optimizer state (optimizer=True)")
        built = _build(n, k, res, carry, state, *flags)
        for name, value in (("num_stages", n), ("prefetch_depth", k), ("resident", res), ("carry", carry),
                            ("host_state", state)) \
                + tuple(zip(names, flags)) + tuple(built.items()):
            object.__setattr__(self, name, value)

    @property
    def max_live_stages(self) -> int:
        """The most streamed stages holding device memory at any step (``min(k+1, L)`` without resident stages)."""
        return max((len(s.live) for s in self.steps), default=0)

    @property
    def timeline(self) -> tuple[ScheduleStep, ...]:
        """The prologues and the steps in execution order: per pass its prologue, then its steps."""
        return tuple(s for pro in self.prologues for s in (pro,) + self.pass_steps(pro.pass_name))

    def pass_steps(self, pass_name: str) -> tuple[ScheduleStep, ...]:
        """The steps of ``pass_name`` (one of :data:`PASSES`), in execution order; empty for a pass
        the call does not run."""
        return tuple(s for s in self.steps if s.pass_name == pass_name)

    def prologue_of(self, pass_name: str) -> ScheduleStep:
        """The prologue of ``pass_name`` (``stage=None``).

        Raises: ValueError: the call does not run ``pass_name``.
        """
        for pro in self.prologues:
            if pro.pass_name == pass_name:
                return pro
        raise ValueError(f"pass_name={pass_name!r}: not a pass of this call "
                         f"({', '.join(repr(p.pass_name) for p in self.prologues)})")

    def events(self) -> tuple[tuple[str, int | None, str, int], ...]:
        """Every event of the call in execution order: ``(pass_name, step's stage or None, kind, stage)``
        tuples, ``kind`` one of :data:`EVENT_KINDS` (in that order within a step). A
        ``StreamingRuntime`` call's ``executed_events`` equal them."""
        return tuple((s.pass_name, s.stage, kind, j) for s in self.timeline for kind in EVENT_KINDS
                     for j in getattr(s, kind))

    def fetched(self, pass_name: str) -> tuple[int, ...]:
        """Stages whose weights cross host -> device during ``pass_name`` for this call, in order.

        Each pass's include its prologue's; the copies for the next call are in :attr:`next_call_fetches`.

        Raises: ValueError: ``pass_name`` is not one of :data:`PASSES`.
        """
        if pass_name not in PASSES:
            raise ValueError(f"pass_name={pass_name!r}; expected one of {', '.join(map(repr, PASSES))}")
        return tuple(j for s in self.timeline if s.pass_name == pass_name for j in s.fetch)

    @property
    def next_call_fetches(self) -> tuple[int, ...]:
        """Stages copied host -> device at this call's tail for the next call, in order."""
        return tuple(j for s in self.steps for j in s.fetch_next)

    @property
    def num_fetches(self) -> int:
        """Host -> device copies of stage weights per call (every pass's prologue and steps, next call's)."""
        return sum(len(s.fetch) + len(s.fetch_next) for s in self.timeline)

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


def _checked_carry(carry, n: int, res: tuple) -> tuple[int, ...] | None:
    """``carry`` as a sorted tuple of distinct streamed stage indices (``None`` stays ``None``)."""
    if carry is None:
        return None
    if isinstance(carry, (str, bytes)) or not isinstance(carry, Sequence):
        raise ValueError(f"carry must be a sequence of stage indices, got {carry!r}")
    out = [as_int(f"carry[{i}]", j, 0) for i, j in enumerate(carry)]
    if len(set(out)) != len(out) or any(j >= n or res[j] for j in out):
        raise ValueError(f"carry must be distinct streamed stages below {n}, got {carry!r}")
    return tuple(sorted(out))


class _State:
    """The schedule being built: the live set, the carried stages not taken yet, the next call's keeps."""

    def __init__(self, res: tuple, carried_in: set):
        self.res, self.live, self.waiting, self.nxt = res, set(carried_in), set(carried_in), set()

    def acquire(self, j: int, ev: dict, state: bool = False) -> None:
        """Stage j's weights for this call: a copy (``fetch``), or a ``take`` when on the device;
        ``state``: its host state first (``fetch_state``)."""
        if state:
            ev["fetch_state"].append(j)
        if self.res[j]:
            return
        if j in self.waiting or j in self.live:   # carried in by the previous call, or kept
            self.waiting.discard(j)
            self.live.add(j)
            ev["take"].append(j)
            return
        self.live.add(j)
        ev["fetch"].append(j)

    def step(self, pass_name: str, stage: int | None, ev: dict) -> ScheduleStep:
        """The step of these events, its live set as it is now."""
        return ScheduleStep(pass_name, stage, tuple(ev["fetch"]), tuple(ev["fetch_next"]), tuple(sorted(self.live)),
                            **{kind: tuple(ev[kind]) for kind in EVENT_KINDS if kind not in ("fetch", "fetch_next")})


def _events() -> dict:
    return {kind: [] for kind in EVENT_KINDS}


@functools.lru_cache(maxsize=256)
def _build(n: int, k: int, res: tuple, carry: tuple | None, state: tuple, training: bool, cyclic: bool,
           steady: bool, offload: bool, optimizer: bool, update: bool) -> dict:
    """The derived fields of :class:`PrefetchSchedule` (cached: the planner asks for the same ones often)."""
    nc = min(k, n)
    if carry is not None:
        carried_in = set(carry)
    elif cyclic and steady and not update:  # what a call of the same kind leaves (see carried_out below)
        carried_in = {j for j in range(n) if not res[j] and (j < nc or (training and j == k))}
    else:
        carried_in = set()
    st = _State(res, carried_in)
    ev = _events()
    for j in range(nc):
        st.acquire(j, ev, state[j])
    prologues, steps = [st.step("forward", None, ev)], []
    keep = set(range(max(0, n - k - 1), n)) if training else set()
    for i in range(n):
        ev = _events()
        if i + k < n:
            st.acquire(i + k, ev, state[i + k])
        elif cyclic and not training:
            for c in range(min(i + k - n + 1, nc)):
                if c in st.nxt or res[c]:
                    continue
                if c not in st.live:
                    st.live.add(c)
                    ev["fetch_next"].append(c)
                ev["keep_next"].append(c)
                st.nxt.add(c)
        if training and offload and i not in keep:
            ev["offload"].append(i)
        if not res[i] and i not in keep:
            ev["release"].append(i)
        steps.append(st.step("forward", i, ev))
        if i not in keep and i not in st.nxt:
            st.live.discard(i)
    st.live -= st.waiting           # a carried copy the forward did not use is dropped
    if training:
        _build_backward(n, k, res, cyclic, offload, optimizer, keep, st, prologues, steps)
    if update:
        _build_update(n, k, res, st, prologues, steps)
    return {"carried_in": tuple(sorted(carried_in)), "prologue": prologues[0].fetch, "prologues": tuple(prologues),
            "steps": tuple(steps), "carried_out": tuple(sorted(st.nxt)) if cyclic else ()}


def _build_backward(n: int, k: int, res: tuple, cyclic: bool, offload: bool, optimizer: bool, keep: set,
                    st: _State, prologues: list, steps: list) -> None:
    """Append the backward's prologue and steps (``keep``: the stages the forward kept for it)."""
    def bring(j: int, ev: dict) -> None:
        if optimizer:
            ev["fetch_state"].append(j)
        st.acquire(j, ev)
        if offload and j not in keep:
            ev["fetch_activations"].append(j)

    ev = _events()
    for j in range(n - 1, max(-1, n - 1 - k), -1):
        bring(j, ev)
    prologues.append(st.step("backward", None, ev))
    for i in range(n - 1, -1, -1):
        ev = _events()
        if cyclic and i <= k and not res[i]:
            st.nxt.add(i)           # kept (the updated or streamed weights) for the next call
            ev["keep_next"].append(i)
        if i - k >= 0:
            bring(i - k, ev)
        if not res[i]:
            ev["release"].append(i)
        steps.append(st.step("backward", i, ev))
        if i not in st.nxt:
            st.live.discard(i)


def _build_update(n: int, k: int, res: tuple, st: _State, prologues: list, steps: list) -> None:
    """Append the update pass's prologue and steps: stage ``i+k`` brought after stage ``i``'s update
    (taken where the backward kept it), its moments and accumulated gradients beside it; the
    backward's keeps are consumed, nothing is left for the next call."""
    def bring(j: int, ev: dict) -> None:
        ev["fetch_state"].append(j)
        st.acquire(j, ev)

    ev = _events()
    for j in range(min(k, n)):
        bring(j, ev)
    prologues.append(st.step("update", None, ev))
    for i in range(n):
        ev = _events()
        if i + k < n:
            bring(i + k, ev)
        if not res[i]:
            ev["release"].append(i)
        steps.append(st.step("update", i, ev))
        st.live.discard(i)
    st.nxt.clear()
