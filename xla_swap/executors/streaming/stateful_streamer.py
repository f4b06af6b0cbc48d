"""Stages with per-stage state (a KV cache) streamed with their weights: the decode loop's runtime.

A :class:`StatefulStreamer` runs stages ``0..n-1`` in order, as ``StreamingRuntime.forward`` does
(weights copied from ``pinned_host`` to the device ``prefetch_depth`` stages ahead, the first
stages of the next call prefetched at the tail of this one), and gives chosen stages a *state*
that persists across calls: ``f(params, state, x) -> (y, new_state)``. The state (e.g. a decoder
layer's KV cache) lives either

* in device memory (``state_on_host=False``): updated in place (the old buffer is donated to
  the stage's executable), never copied; or
* in ``pinned_host`` memory (``state_on_host=True``): copied to the device ``prefetch_depth``
  stages ahead next to the stage's weights, and the updated state copied back to
  ``pinned_host`` once the stage has run (the activation offload of training, applied to the
  cache). The link then carries ``2 x state bytes`` per stage and call beyond the weights.

Both placements run the same executables on the same values: they give equal results. A run is the
forward pass of its ``PrefetchSchedule``, run by the streaming runtime's one executor
(``executor.execute_pass``); the KV cache in ``pinned_host`` is per-stage state it fetches
(``fetch_state``) beside the weights.

The module imports only numpy and jax (no torch).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Sharding

from xla_swap.planning.prefetch import PrefetchSchedule, ScheduleStep

from .config import check_max_signatures, check_prefetch_depth
from .executor import FetchedState, StageWeights, execute_pass
from .signatures import ExeKey, Signature, SignatureCache, StageKey, distinct_ids
from ..transfers import put
from ..pytrees import DEVICE_KIND, HOST_KIND, aval_key, param_key, tree_aval
from .stage_programs import gathered

__all__ = ["StageCalls", "StatefulStreamer", "state_nbytes"]


def state_nbytes(avals) -> int:
    """Bytes of a pytree of ``jax.ShapeDtypeStruct`` (or arrays): the sum of ``prod(shape) x itemsize``."""
    return int(sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(avals)))


class StageCalls:
    """How a :class:`StatefulStreamer` runs each stage: the stage's own weights and executable, dispatched
    as they are. A streamer holds one (``stage_calls``); a variant (e.g. routed experts,
    ``routed_experts.RoutedExperts``) overrides these steps and reads the streamer only through its public
    attributes."""

    def attach(self, streamer: "StatefulStreamer") -> None:
        """Take ``streamer`` as the one this object runs (called by its constructor); raise ValueError when it
        cannot run this way."""

    def start(self, streamer: "StatefulStreamer") -> None:
        """A :meth:`StatefulStreamer.run` begins."""

    def weights(self, streamer: "StatefulStreamer", i: int) -> tuple[Any, Any]:
        """``(host weights, device shardings)`` stage ``i`` streams: ``host_params[i]`` and its shardings."""
        return streamer.host_params[i], streamer.device_shardings[i]

    def copy(self, streamer: "StatefulStreamer", i: int):
        """Start copying stage ``i``'s weights to the device (asynchronous); returns the copy: :meth:`weights`
        put in their device shardings."""
        return put(*self.weights(streamer, i))

    def executable(self, streamer: "StatefulStreamer", sig: Signature, i: int):
        """Stage ``i``'s executable for ``sig``: :meth:`StatefulStreamer.stage_executable`."""
        return streamer.stage_executable(sig, i)

    def call(self, streamer: "StatefulStreamer", i: int, exe, p, x, states: dict):
        """Dispatch stage ``i`` on weights ``p`` and input ``x`` (asynchronous); its state updated in place."""
        if streamer.state_avals[i] is None:
            return exe(p, x)
        y, s = exe(p, streamer.take_state(i, states), x)
        streamer.put_state(i, s)
        return y

    def output(self, streamer: "StatefulStreamer", i: int, y):
        """Stage ``i``'s output as the next stage takes it, once the events after its dispatch ran: ``y``."""
        return y


@functools.lru_cache(maxsize=64)
def _schedule(n: int, k: int, resident: tuple, carry: tuple, host_state: tuple) -> PrefetchSchedule:
    """The decode run's (frozen) schedule, built once per arguments: a step's schedule is the same at every token."""
    return PrefetchSchedule(n, k, resident=resident, carry=carry, host_state=host_state)


class StatefulStreamer:
    """Run stages in order with weights streamed from ``pinned_host`` and per-stage persistent state.

    Args:
      stage_fns: one callable per stage. A stage without state (``state_avals[i] is None``) is
        ``f(params, x) -> y``; a stage with state is ``f(params, state, x) -> (y, new_state)``,
        ``new_state`` of ``state_avals[i]``'s structure, shapes and dtypes. Stages given the same
        callable object share compiled executables where their parameter, state and input
        signatures agree.
      host_params: the per-stage weights: a list of pytrees of ``jax.Array`` (``pinned_host``,
        or device memory for ``resident`` stages), read at every call (a caller that replaces
        an element, e.g. after an optimizer step, is followed; the prefetched copy of a replaced
        element is not used).
      param_shardings: per stage, a pytree like ``host_params[i]`` of device shardings (memory
        kind ``device``) the weights are copied to.
      state_avals: per stage, ``None`` or a pytree of ``jax.ShapeDtypeStruct``: the state's shapes
        and dtypes (allocated as zeros by :meth:`reset_states`, or at the first call).
      state_on_host: where the states live between stages: ``pinned_host`` (``True``) or device
        memory (``False``, default). A bool for every stage, or one per stage.
      activation_sharding: the device sharding of ``x``, of every stage's output and of the states.
      prefetch_depth: ``k >= 1``: stages whose weights (and host states) are copied ahead.
      resident: per stage, whether ``host_params[i]`` is already in device memory (not copied).
      max_signatures: input signatures (shapes and dtypes of ``x``) whose executables stay cached.
      gather_weights: each stage's weights are constrained to ``activation_sharding`` (replicated)
        inside its executable: the computation stays replicated over the mesh, as the activations
        are, instead of being split along a sharded weight's dimension (what a data-parallel
        stack wants; ``executors.stage_programs.gathered``). Default ``False``: as XLA partitions it.
      stage_calls: how each stage is run (:class:`StageCalls`, the default, or a variant of it).

    Raises:
      TypeError: a stage function is not callable; ``state_on_host`` not a bool or a sequence of bools;
        ``prefetch_depth`` not an int.
      ValueError: the per-stage sequences differ in length; ``prefetch_depth < 1``;
        ``max_signatures`` not an int >= 1; what ``stage_calls.attach`` raises.
    """

    def __init__(self, stage_fns: Sequence[Callable], host_params: list, param_shardings: Sequence[Any], *,
                 state_avals: Sequence[Any], activation_sharding: Sharding, state_on_host: bool | Sequence[bool] = False,
                 prefetch_depth: int = 2, resident: Sequence[bool] | None = None, max_signatures: int = 8,
                 gather_weights: bool = False, stage_calls: StageCalls | None = None):
        n = len(stage_fns)
        for i, f in enumerate(stage_fns):
            if not callable(f):
                raise TypeError(f"stage_fns[{i}] must be callable, got {type(f).__name__}")
        if len(host_params) != n or len(param_shardings) != n or len(state_avals) != n:
            raise ValueError(f"stage_fns ({n}), host_params ({len(host_params)}), param_shardings "
                             f"({len(param_shardings)}) and state_avals ({len(state_avals)}) must have one entry per stage")
        if isinstance(state_on_host, bool):
            state_on_host = [state_on_host] * n
        if isinstance(state_on_host, (str, bytes)) or not isinstance(state_on_host, Sequence) \
                or len(state_on_host) != n or not all(isinstance(b, bool) for b in state_on_host):
            raise TypeError(f"state_on_host must be a bool or {n} bools, got {state_on_host!r}")
        prefetch_depth, max_signatures = check_prefetch_depth(prefetch_depth), check_max_signatures(max_signatures)
        resident = [False] * n if resident is None else [bool(r) for r in resident]
        if len(resident) != n:
            raise ValueError(f"resident must have {n} entries, got {len(resident)}")
        self.num_stages = n
        self.prefetch_depth = int(prefetch_depth)
        self.host_params = host_params
        self.resident = tuple(resident)
        self.state_avals = list(state_avals)
        #: per stage, whether its state lives in ``pinned_host`` between calls.
        self.state_on_host: tuple[bool, ...] = tuple(bool(b) and s is not None
                                                     for b, s in zip(state_on_host, state_avals))
        self.activation_sharding = activation_sharding
        self.max_signatures = int(max_signatures)
        self._gather = activation_sharding.with_memory_kind(DEVICE_KIND) if gather_weights else None
        self._fns = list(stage_fns)
        self._fn_ids = distinct_ids(stage_fns)
        #: per stage, the device shardings (a pytree like ``host_params[i]``) its weights are copied to.
        self.device_shardings: list = list(param_shardings)
        #: where a state is in device memory (``activation_sharding`` in memory kind ``device``).
        self.state_sharding = activation_sharding.with_memory_kind(DEVICE_KIND)
        self._host_state_sh = activation_sharding.with_memory_kind(HOST_KIND)
        #: per stage, the state (``None`` for stateless stages, or before the first call).
        self.states: list = [None] * n
        # per input signature (LRU), the stages' input avals and the executables compiled for them
        self._cache = SignatureCache(self.max_signatures)
        self._carry: dict[int, tuple[Any, Any]] = {}   # stage -> (its host weights, device copy) for the next call
        #: the :class:`PrefetchSchedule` the last :meth:`run` executed (``None`` before the first).
        self.last_schedule: PrefetchSchedule | None = None
        #: the events the last :meth:`run` performed, ``(pass_name, step's stage, kind, stage)`` as
        #: ``PrefetchSchedule.events()`` lists them.
        self.executed_events: list[tuple] = []
        #: bytes of each stage's state (0 without state).
        self.state_nbytes: list[int] = [0 if s is None else state_nbytes(s) for s in state_avals]
        #: how each stage is run (:class:`StageCalls`).
        self.stage_calls: StageCalls = StageCalls() if stage_calls is None else stage_calls
        self.stage_calls.attach(self)

    # ---------------------------------------------------------------- public
    @property
    def num_executables(self) -> int:
        """Distinct stage executables cached now (all input signatures; a signature dropped from the
        cache, beyond ``max_signatures``, takes its executables with it)."""
        return self._cache.num_executables

    def executables(self, x) -> list:
        """The compiled executables a :meth:`run` on ``x``'s signature runs, one per stage, in order.

        Read-only: nothing runs and no state changes; an executable not compiled yet is compiled
        (and cached, as :meth:`run` would). Both state placements compile the same function per
        stage (the state enters and leaves it in device memory; the copies to and from
        ``pinned_host`` are separate transfers), so their ``as_text()`` differ only in names.

        Args:
          x: a pytree of arrays or ``jax.ShapeDtypeStruct`` with the shapes and dtypes ``run``
            gets (e.g. a decode step's inputs).

        Returns: a list of ``num_stages`` ``jax.stages.Compiled`` (stages that share an executable
          give the same object): ``as_text()`` is its optimized HLO, ``memory_analysis()`` its
          buffer sizes in bytes.

        Raises: TypeError: ``x`` has no array leaves. ValueError naming the stage when one fails
          to trace or returns a state unlike ``state_avals`` (as :meth:`run`).
        """
        sig = self._signature(x)
        return [self.stage_calls.executable(self, sig, i) for i in range(self.num_stages)]

    def reset_states(self) -> None:
        """(Re)allocate every state as zeros where it lives (``pinned_host`` or device memory)."""
        for i, av in enumerate(self.state_avals):
            if av is None:
                continue
            self.states[i] = None
            sh = self._host_state_sh if self.state_on_host[i] else self.state_sharding
            self.states[i] = jax.tree_util.tree_map(
                lambda a, sh=sh: put(np.zeros(a.shape, a.dtype), sh), av)

    def release_prefetched(self) -> None:
        """Drop the weights held in device memory for the next call."""
        self._carry = {}

    def output_aval(self, x):
        """Shape and dtype of :meth:`run`'s output for ``x`` (traces on first use of a signature)."""
        return self._signature(x).chain[-1]

    def schedule(self) -> PrefetchSchedule:
        """The schedule of the next :meth:`run` (read-only): a forward over the stages with the cyclic
        next-call prefetch, the weights the previous call left valid as ``carry`` (those whose
        ``host_params`` element was not replaced since), each host state fetched beside its
        stage's weights (``host_state``)."""
        calls = self.stage_calls
        carry = tuple(j for j, (src, _) in sorted(self._carry.items()) if src is calls.weights(self, j)[0])
        return _schedule(self.num_stages, self.prefetch_depth, self.resident, carry, self.state_on_host)

    def run(self, x):
        """Run every stage once on ``x`` (a pytree of arrays); the states are updated in place.

        The executor (``executor.execute_pass``) runs :meth:`schedule`'s forward pass event by event
        (``executed_events`` records them; ``last_schedule`` is the object executed).

        Returns the last stage's output (device memory, ``activation_sharding``; asynchronous).

        Raises: ValueError naming the stage when one fails to trace, or returns a state of another
          structure, shape or dtype than ``state_avals`` says (before anything runs).
        """
        calls = self.stage_calls
        calls.start(self)
        sig = self._signature(x)
        exes = [calls.executable(self, sig, i) for i in range(self.num_stages)]   # every compile before the first copy
        if any(s is None and a is not None for s, a in zip(self.states, self.state_avals)):
            self.reset_states()
        x = put(x, self.activation_sharding)
        sched = self.schedule()
        self.last_schedule, self.executed_events = sched, []
        states = FetchedState(lambda j: put(self.states[j], self.state_sharding))
        weights = StageWeights(_StreamedWeights(self, self._carry))
        program = _DecodeProgram(self, exes, x, states)
        del x
        # throttled: stage i-1 is done before stage i+k's copies, its weights' (and state's) memory is free
        execute_pass(sched, "forward", program, weights, executed=self.executed_events, states=(states,),
                     throttle=True)
        self._carry = weights.next_call
        return program.x

    def take_state(self, i: int, states: dict):
        """Stage ``i``'s state on the device (fetched from ``pinned_host`` into ``states``, or in place), given up
        (its buffer is donated to the stage's executable)."""
        s = states.pop(i) if self.state_on_host[i] else self.states[i]
        self.states[i] = None   # donated
        return s

    def put_state(self, i: int, s) -> None:
        """Keep stage ``i``'s new state ``s`` where it lives (back to ``pinned_host``, or in place)."""
        self.states[i] = put(s, self._host_state_sh) if self.state_on_host[i] else s

    def stage_executable(self, sig: Signature, i: int):
        """Stage ``i``'s own executable for ``sig`` (shared by the stages of equal function, weights, state and
        input avals): ``(p, x) -> y``, or ``(p, s, x) -> (y, s)`` with the state donated."""
        sav = self.state_avals[i]

        def base_of() -> StageKey:
            return StageKey(self._fn_ids[i], param_key(self.host_params[i], self.device_shardings[i]),
                            aval_key(sig.chain[i]), state=() if sav is None else aval_key(sav))
        return self._cache.executable(sig, i, ExeKey("forward", donate=sav is not None), base_of,
                                      lambda base: self._compile(i, sig.chain[i]))

    # ---------------------------------------------------------------- internals
    def _signature(self, x) -> Signature:
        """The cached :class:`Signature` of ``x`` (its stages' input avals, ``chain``), or a new one traced."""
        return self._cache.signature(tree_aval(x, "x"), self._trace_chain)

    def _trace_chain(self, a) -> list:
        """The avals of every stage's input for an input of avals ``a`` (``chain[n]`` the output).
        Raises: ValueError naming a stage that fails to trace or returns a state unlike ``state_avals``."""
        chain = [a]
        for i, f in enumerate(self._fns):
            pav = jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), self.host_params[i])
            sav = self.state_avals[i]
            try:
                out = jax.eval_shape(f, pav, chain[-1]) if sav is None else jax.eval_shape(f, pav, sav, chain[-1])
            except Exception as e:  # noqa: BLE001 - re-raised with the stage named
                raise ValueError(f"stage {i} failed to trace: {type(e).__name__}: {e}") from e
            if sav is not None:
                out, new_s = out
                if aval_key(new_s) != aval_key(sav):
                    raise ValueError(f"stage {i} returns a state of {new_s}, not of its state_avals {sav}")
            chain.append(jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), out))
        return chain

    def _compile(self, i: int, in_aval):
        pav = self.host_params[i]
        sav = self.state_avals[i]
        spec = lambda av, sh: jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), av)
        pspec = jax.tree_util.tree_map(lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh),
                                       pav, self.device_shardings[i])
        act = self.activation_sharding
        xspec = spec(in_aval, act)
        f = gathered(self._fns[i], self._gather)
        if sav is None:
            return jax.jit(lambda p, x: f(p, x), out_shardings=act).lower(pspec, xspec).compile()
        return jax.jit(lambda p, s, x: f(p, s, x), out_shardings=(act, self.state_sharding),
                       donate_argnums=(1,)).lower(pspec, spec(sav, self.state_sharding), xspec).compile()


class _StreamedWeights:
    """A streamer's stage weights as a run's ``WeightSource``: as its ``stage_calls`` streams them, ``carry``
    (stage -> ``(host weights, device copy)``) what the previous run left on the device."""

    def __init__(self, streamer: StatefulStreamer, carry: dict):
        self.streamer, self.carry = streamer, carry

    def resident(self, j: int) -> bool:
        """Whether stage ``j``'s weights are in device memory for good."""
        return self.streamer.resident[j]

    def host(self, j: int):
        """Stage ``j``'s weights as its stage calls stream them (``StageCalls.weights``)."""
        return self.streamer.stage_calls.weights(self.streamer, j)[0]

    def copy(self, j: int, pass_name: str):
        """Start copying stage ``j``'s weights to the device (``StageCalls.copy``); returns the copy."""
        return self.streamer.stage_calls.copy(self.streamer, j)

    def take(self, j: int):
        """Stage ``j``'s copy the previous run left, or ``None``."""
        return self.carry.pop(j, (None, None))[1]


class _DecodeProgram:
    """A run's forward as a ``PassProgram``: stage ``i`` dispatched by the streamer's stage calls on ``x``, the
    previous stage's output (``exes``: per stage, its executable; ``states``: the host states brought in)."""

    def __init__(self, streamer: StatefulStreamer, exes: list, x, states: FetchedState):
        self.streamer, self.exes, self.x, self.states = streamer, exes, x, states
        self.y = None

    def dispatch(self, step: ScheduleStep, p) -> None:
        """Dispatch the step's stage (``StageCalls.call``) on weights ``p``; its state updated in place."""
        i = step.stage
        self.y = self.streamer.stage_calls.call(self.streamer, i, self.exes[i], p, self.x, self.states.arrays)

    def throttle_on(self):
        """The stage's input: stage ``i-1`` done."""
        return self.x

    def finish(self, step: ScheduleStep) -> None:
        """The stage's output (``StageCalls.output``, once the step's copies are issued) is the next input."""
        self.x = self.streamer.stage_calls.output(self.streamer, step.stage, self.y)
        self.y = None
