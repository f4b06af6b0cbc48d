"""Routed-expert fetching: a mixture-of-experts layer's decode stage in two executables, with only the
experts its tokens were routed to copied from ``pinned_host`` between them.

A layer given a :class:`RoutedSpec` is traced once per input signature with its experts replaced by one
:data:`EXPERTS_CALL` (``experts_call(hidden [N, D], index int [N, k], weights [N, k]) -> [N, D]``) and
split there (:func:`xla_swap.executors.streaming.jaxpr_split.split_at`):

1. **before** (attention, router, shared experts: the layer's weights less its experts, streamed
   ``prefetch_depth`` stages ahead as every stage's are) runs and returns the call's inputs;
2. the host reads ``index`` (``N k`` int32: the one device -> host read of the layer; the weights of
   the stages ahead were dispatched before it), takes the distinct experts ``ids`` (ascending), and
   :class:`ExpertStore` copies those experts' slices of the stacked ``[E, ...]`` weights to the device;
3. **after** computes the experts on the ``m`` fetched slices (``RoutedSpec.experts_fn``) and the rest
   of the layer (the residual add, ...); it is compiled per bucket of ``m``
   (:func:`xla_swap.planning.routing.expert_bucket`: ``k``, ``2k``, ``4k``, ... up to ``E``), the spare
   slots repeating the last fetched expert (no copy) with no token routed to them.

Expert weights stay whole in ``pinned_host``: layout ``"stacked"`` slices them inside one jitted program
per weight shape and ``m`` (dynamic slices of the host arrays moved to the device: no extra host memory; on
XLA:GPU a fusion reads the host slices on the compute stream), layout ``"split"`` keeps a second copy as
one ``pinned_host`` array per expert (built on first use: the experts' bytes once more in host memory)
and copies the chosen ones with one ``jax.device_put`` (the copy engines, as whole stages are moved).
``RoutedExperts.routed`` switches a call between this and the whole layer (every expert streamed with
its stage, one executable); both give the layer's own result. One device only.

The module imports only numpy and jax (no torch).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from .stateful_streamer import StageCalls
from xla_swap.planning.routing import expert_bucket

from .jaxpr_split import JaxprSplit, split_at
from ..pytrees import DEVICE_KIND, aval_key

__all__ = ["EXPERTS_CALL", "experts_call", "RoutedSpec", "ExpertStore", "RoutedExperts", "LAYOUTS"]

#: the expert-weight layouts of :class:`ExpertStore`.
LAYOUTS = ("stacked", "split")

#: the marker that stands for a layer's experts while it is traced for routed fetching.
EXPERTS_CALL = jcore.Primitive("xla_swap_experts_call")
EXPERTS_CALL.def_abstract_eval(lambda hidden, index, weights: hidden)   # [N, D] of hidden's dtype


def experts_call(hidden, index, weights):
    """Bind :data:`EXPERTS_CALL`: ``hidden`` ``[N, D]``, ``index`` int ``[N, k]`` (expert ids), ``weights``
    ``[N, k]`` (routing weights) -> ``[N, D]`` of ``hidden``'s dtype. Only traced, never run: a trace
    holding it is split by :func:`xla_swap.executors.streaming.jaxpr_split.split_at`."""
    return EXPERTS_CALL.bind(hidden, index, weights)


@dataclasses.dataclass(frozen=True, eq=False)
class RoutedSpec:
    """How to run one group of mixture-of-experts layers by routed experts.

    Attributes:
      marked_fn: the stage function in :class:`StatefulStreamer`'s form, ``f(params, state, x) -> (y,
        new_state)``, that while traced calls :func:`experts_call` once in place of its experts.
      expert_names: the keys of the stage's params dict holding the experts' weights, each stacked on
        axis 0 (``num_experts`` rows, one per expert).
      experts_fn: ``(weights {name: list of M arrays}, ids int32 [M] ascending, hidden, index, routing) -> [N, D]``:
        the experts computed on the fetched ones, slot ``j`` holding expert ``ids[j]``'s slice of each weight
        (``index`` holds global ids, all in ``ids``; spare slots, at the end, hold ``num_experts``).
      num_experts: ``E``.
    """
    marked_fn: Callable
    expert_names: frozenset
    experts_fn: Callable
    num_experts: int


class _Hole:
    """Stands for an expert weight in the flat inputs of the first executable (which never reads it)."""


@dataclasses.dataclass(frozen=True, eq=False)
class _Program:
    """A routed stage's executables for one signature: ``before`` compiled, ``after`` jitted (one per ``m``)."""
    split: JaxprSplit
    spec: RoutedSpec
    before: Any
    after: Callable
    out_tree: Any
    k: int          # experts per token (the routing's last axis)


@dataclasses.dataclass(frozen=True, eq=False)
class _Pending:
    """A routed stage dispatched up to its routing: ``before``'s outputs."""
    program: _Program
    outs: list


class ExpertStore:
    """Copies the chosen experts' slices of stacked ``pinned_host`` weights to the device.

    Args:
      layout: ``"stacked"`` or ``"split"`` (module docstring).
      device_sharding: where the slices go (memory kind ``device``).

    Raises: ValueError: an unknown ``layout``.
    """

    def __init__(self, layout: str, device_sharding):
        if layout not in LAYOUTS:
            raise ValueError(f"expert layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        self._dev = device_sharding.with_memory_kind(DEVICE_KIND)
        self._slicers: dict = {}
        self._parts: dict[int, tuple[dict, dict]] = {}   # stage -> (its source params, per-expert arrays)

    def fetch(self, stage: int, params: dict, names, ids: np.ndarray, ids_dev) -> dict:
        """``{name: [m device arrays]}``: expert ``ids[j]``'s slice of each weight ``params[name]`` (stage
        ``stage``'s ``pinned_host`` weights, stacked on axis 0), asynchronous. ``ids_dev``: ``ids`` on the device.
        Raises RuntimeError (``"stacked"``) when the slicing program does not compile on the platform."""
        names = sorted(names)
        m = len(ids)
        if self.layout == "split":
            parts = self._split(stage, params, names)
            got = jax.device_put([parts[n][int(e)] for n in names for e in ids], self._dev)
            return {n: list(got[j * m:(j + 1) * m]) for j, n in enumerate(names)}
        w = {n: params[n] for n in names}
        key = (aval_key(w), m, tuple(str(v.sharding) for v in w.values()))
        slicer = self._slicers.get(key)
        if slicer is None:   # one program per count: dynamic slices of the host arrays, each moved to the device
            dev = self._dev

            def take(w, ids):
                return {n: [jax.device_put(jax.lax.dynamic_index_in_dim(v, ids[j], keepdims=False), dev)
                            for j in range(m)] for n, v in w.items()}
            try:
                slicer = jax.jit(take, out_shardings=dev).lower(w, ids_dev).compile()
            except Exception as e:  # noqa: BLE001 - re-raised naming the other layout
                raise RuntimeError(f"slicing experts out of the stacked pinned_host weights does not compile here "
                                   f"({type(e).__name__}: {e}); expert_layout='split' copies whole per-expert "
                                   "arrays instead") from e
            self._slicers[key] = slicer
        return slicer(w, ids_dev)

    def _split(self, stage: int, params: dict, names: list) -> dict:
        src, parts = self._parts.get(stage, (None, None))
        if src is not params:
            parts = {}
            for n in names:
                whole = np.asarray(params[n])   # a host copy of one weight at a time
                parts[n] = [jax.device_put(whole[e], params[n].sharding) for e in range(whole.shape[0])]
                del whole
            self._parts[stage] = (params, parts)
        return parts

    def host_nbytes(self) -> int:
        """Bytes of the per-expert copies held in ``pinned_host`` (``"split"``; 0 for ``"stacked"``)."""
        return int(sum(a.nbytes for _, parts in self._parts.values() for arrs in parts.values() for a in arrs))


class RoutedExperts(StageCalls):
    """How a :class:`StatefulStreamer`'s mixture-of-experts stages fetch only their routed experts: pass one
    as its ``stage_calls``.

    Args:
      routed_specs: ``{stage: RoutedSpec}``: stages (with state, not ``resident``) that can run by routed
        experts; stages given the same spec object share executables.
      expert_layout: ``"stacked"`` (default) or ``"split"`` (:class:`ExpertStore`).

    :attr:`routed` (default ``False``) chooses, per run of the streamer, whether those stages fetch their
    routed experts or stream whole (as :class:`StageCalls` runs them); :attr:`expert_fetches` lists what
    the last run copied.

    Raises: ValueError: an unknown ``expert_layout``; from the streamer's constructor (:meth:`attach`): its
      ``activation_sharding`` spans several devices; a stage of ``routed_specs`` out of range, without
      state or resident.
    """

    def __init__(self, routed_specs: dict, expert_layout: str = "stacked"):
        if expert_layout not in LAYOUTS:
            raise ValueError(f"expert layout must be one of {LAYOUTS}, got {expert_layout!r}")
        self._specs: dict[int, RoutedSpec] = dict(routed_specs)
        self._layout = expert_layout
        self._store: ExpertStore | None = None   # made by attach(), on the streamer's device
        self._views: dict[int, tuple] = {}
        self._programs: dict = {}
        #: whether the next run fetches only the routed experts of the routed stages.
        self.routed: bool = False
        #: the expert copies of the last run: ``(stage, expert ids)`` per routed stage, in order.
        self.expert_fetches: list[tuple[int, tuple[int, ...]]] = []

    @property
    def routed_stages(self) -> tuple[int, ...]:
        """The stages that can run by routed experts."""
        return tuple(sorted(self._specs))

    @property
    def expert_layout(self) -> str:
        """``"stacked"`` or ``"split"`` (:class:`ExpertStore`)."""
        return self._layout

    def expert_host_nbytes(self) -> int:
        """Bytes of ``pinned_host`` held beyond the stages' weights (the ``"split"`` layout's copies)."""
        return 0 if self._store is None else self._store.host_nbytes()

    def attach(self, streamer) -> None:
        """Take ``streamer`` (its device holds the fetched experts); raise ValueError unless it runs on one device
        and every routed stage has state and streams."""
        if len(streamer.activation_sharding.device_set) != 1:
            raise ValueError("routed experts run on one device; activation_sharding spans "
                             f"{len(streamer.activation_sharding.device_set)}")
        for i in self._specs:
            if not 0 <= i < streamer.num_stages or streamer.state_avals[i] is None or streamer.resident[i]:
                raise ValueError(f"routed_specs: stage {i} must be a stage with state, streamed (not resident)")
        self._store = ExpertStore(self._layout, streamer.activation_sharding)

    def start(self, streamer) -> None:
        """A run begins: :attr:`expert_fetches` starts empty."""
        self.expert_fetches = []

    def weights(self, streamer, i: int) -> tuple[Any, Any]:
        """A routed stage's weights less its experts (those are fetched by id); other stages' as they are."""
        if not (self.routed and i in self._specs):
            return super().weights(streamer, i)
        src = streamer.host_params[i]
        view = self._views.get(i)
        if view is None or view[0] is not src:
            names = self._specs[i].expert_names
            sh = streamer.device_shardings[i]
            view = (src, {n: v for n, v in src.items() if n not in names},
                    {n: v for n, v in sh.items() if n not in names})
            self._views[i] = view
        return view[1], view[2]

    def executable(self, streamer, sig, i: int):
        """A routed stage's two-part program for ``sig`` (traced, split at the experts, cached); else the stage's own."""
        if not (self.routed and i in self._specs):
            return super().executable(streamer, sig, i)
        in_aval = sig.chain[i]
        spec = self._specs[i]
        pav = jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), streamer.host_params[i])
        key = (id(spec), aval_key(pav), aval_key(streamer.state_avals[i]), aval_key(in_aval))
        prog = self._programs.get(key)
        if prog is None:
            prog = self._program(streamer, i, spec, pav, in_aval)
            self._programs[key] = prog
        return prog

    def call(self, streamer, i: int, exe, p, x, states: dict):
        """A routed stage dispatched up to its routing (the first executable); others as :class:`StageCalls` does."""
        if not isinstance(exe, _Program):
            return super().call(streamer, i, exe, p, x, states)
        return _Pending(exe, exe.before(p, streamer.take_state(i, states), x))

    def output(self, streamer, i: int, y):
        """A routed stage finished: its routing read, the routed experts copied in, the second executable run,
        its state put back; other stages' outputs as they are."""
        if not isinstance(y, _Pending):
            return y
        prog, outs = y.program, y.outs
        sp = prog.split
        marker_in = outs[:sp.n_marker_in]
        boundary = outs[sp.n_marker_in:sp.n_marker_in + sp.n_boundary]
        ids = np.unique(np.asarray(marker_in[1])).astype(np.int32)   # the layer's one device -> host read
        self.expert_fetches.append((i, tuple(int(e) for e in ids)))
        ids_dev = jax.device_put(ids, streamer.state_sharding)
        w = self._store.fetch(i, streamer.host_params[i], prog.spec.expert_names, ids, ids_dev)
        slots = expert_bucket(len(ids), prog.k, prog.spec.num_experts)   # spare slots: the last expert again, no token
        w = {n: v + [v[-1]] * (slots - len(ids)) for n, v in w.items()}
        if slots > len(ids):
            ids_dev = jax.device_put(np.concatenate([ids, np.full(slots - len(ids), prog.spec.num_experts, np.int32)]),
                                     streamer.state_sharding)
        late = prog.after(w, ids_dev, tuple(marker_in), tuple(boundary))
        flat = sp.assemble(outs[sp.n_marker_in + sp.n_boundary:], late)
        out, s = jax.tree_util.tree_unflatten(prog.out_tree, flat)
        streamer.put_state(i, s)
        return out

    def _program(self, streamer, i: int, spec: RoutedSpec, pav: dict, in_aval) -> _Program:
        """Trace stage ``i`` with :data:`EXPERTS_CALL`, split it there and compile its first half."""
        sav = streamer.state_avals[i]
        try:
            closed, out_shape = jax.make_jaxpr(spec.marked_fn, return_shape=True)(pav, sav, in_aval)
            paths = jax.tree_util.tree_flatten_with_path((pav, sav, in_aval))[0]
            drop = [k for k, (path, _) in enumerate(paths) if path[0].idx == 0 and path[1].key in spec.expert_names]
            split = split_at(closed, EXPERTS_CALL, drop)
        except Exception as e:  # noqa: BLE001 - re-raised with the stage named
            raise ValueError(f"stage {i} cannot run by routed experts: {type(e).__name__}: {e}") from e
        names = spec.expert_names
        before_fn = jcore.jaxpr_as_fun(split.before)
        after_fn = jcore.jaxpr_as_fun(split.after)

        def before(p, s, x):
            flat = jax.tree_util.tree_leaves(({**p, **{n: _Hole() for n in names}}, s, x))
            return before_fn(*[flat[k] for k in split.kept])

        def after(w, ids, marker_in, boundary):
            return after_fn(spec.experts_fn(w, ids, *marker_in), *boundary)

        dev, act, state_sh = streamer.device_shardings[i], streamer.activation_sharding, streamer.state_sharding
        spec_of = lambda av, sh: jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), av)
        pspec = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=dev[n]) for n, v in pav.items() if n not in names}
        exe = jax.jit(before, out_shardings=state_sh, donate_argnums=(1,)).lower(
            pspec, spec_of(sav, state_sh), spec_of(in_aval, act)).compile()
        return _Program(split, spec, exe, jax.jit(after, out_shardings=state_sh),
                        jax.tree_util.tree_structure(out_shape), int(split.before.out_avals[1].shape[-1]))
