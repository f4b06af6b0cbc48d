"""Routed-expert fetching: a mixture-of-experts layer's decode stage in two executables, with only the
experts its tokens were routed to copied from ``pinned_host`` between them.

A layer given a :class:`RoutedSpec` is traced once per input signature with its experts replaced by one
:data:`EXPERTS_CALL` (``experts_call(hidden [N, D], index int [N, k], weights [N, k]) -> [N, D]``) and
split there (:func:`xla_swap.executors.streaming.jaxpr_split.split_at`):

1. **before** (attention, router, shared experts: the layer's weights less its experts) runs and returns
   the call's inputs;
2. the host reads ``index`` (``N k`` int32: the one device -> host read of the layer), takes the distinct
   experts ``ids`` (ascending), and the :class:`~xla_swap.executors.streaming.expert_store.ExpertStore`
   copies those experts to the device; right behind them, the weights less the experts of the routed stages
   up to ``prefetch_depth`` ahead (cyclically: the next run's first ones too) are copied, so that the link
   stays busy while the experts compute, the next layer's router runs and the host waits on its routing
   (the streamer itself moves nothing for a routed stage); then a row block of the large weights of the
   streamed stages after the last routed one (:mod:`~xla_swap.executors.streaming.tail_pieces`);
3. **after** computes the experts on the ``m`` fetched ones (``RoutedSpec.experts_fn``; packed buffers
   unpacked there) and the rest of the layer (the residual add, ...); it is compiled per bucket of ``m``
   (:func:`xla_swap.planning.routing.expert_bucket`: ``k``, ``2k``, ``4k``, ... up to ``E``), the spare
   slots repeating the last fetched expert (no copy) with no token routed to them.

Expert layouts (``expert_layout``): ``"stacked"``, ``"split"`` (one packed ``pinned_host`` buffer per
expert, the stacked arrays deleted: each expert held once; :meth:`RoutedExperts.close` puts them back), or
``"auto"`` (:func:`xla_swap.planning.routing.choose_expert_layout` by the size of one expert).
``RoutedExperts.routed`` switches a call between this and the whole layer (every expert streamed with its
stage, one executable; in the ``"split"`` layout the ``E`` packed buffers are streamed and unpacked in it);
both give the layer's own result. One device only.

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
from xla_swap.planning.routing import choose_expert_layout, expert_bucket

from .expert_store import PACKED, STORE_LAYOUTS, ExpertStore, Packing

from .jaxpr_split import JaxprSplit, split_at
from .tail_pieces import TailPieces
from ..pytrees import DEVICE_KIND, aval_key

__all__ = ["EXPERTS_CALL", "experts_call", "RoutedSpec", "ExpertStore", "RoutedExperts", "LAYOUTS"]

#: the expert-weight layouts :class:`RoutedExperts` takes (``"auto"`` resolves to one of ``STORE_LAYOUTS``).
LAYOUTS = ("auto",) + STORE_LAYOUTS

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
    whole: Callable  # () -> the compiled whole stage on the E packed buffers ("split" layout, not routed)


@dataclasses.dataclass(frozen=True, eq=False)
class _Pending:
    """A routed stage dispatched up to its routing: ``before``'s outputs."""
    program: _Program
    outs: list


class RoutedExperts(StageCalls):
    """How a :class:`StatefulStreamer`'s mixture-of-experts stages fetch only their routed experts: pass one
    as its ``stage_calls``.

    Args:
      routed_specs: ``{stage: RoutedSpec}``: stages (with state, not ``resident``) that can run by routed
        experts; stages given the same spec object share executables.
      expert_layout: ``"auto"`` (default: :func:`xla_swap.planning.routing.choose_expert_layout` on the
        largest routed stage's bytes per expert, when attached), ``"stacked"`` or ``"split"`` (module docstring).
      store: an :class:`ExpertStore` to hold the experts (one a previous instance on the same weights left,
        :attr:`expert_store`): kept when its layout is the one resolved, else its weights put back (default: a new one).
      tail_piece_min_bytes: the smallest weight (bytes) of the stages after the last routed one that a routed
        run copies in row blocks behind the experts (``None``: ``tail_pieces.TAIL_PIECE_MIN_BYTES``, 16 MiB).

    :attr:`routed` (default ``False``) chooses, per run of the streamer, whether those stages fetch their
    routed experts or stream whole; :attr:`expert_fetches` and :attr:`expert_copies` list what the last run
    copied. :meth:`close` puts the ``"split"`` layout's stacked weights back.

    Raises: ValueError: an unknown ``expert_layout``; ``tail_piece_min_bytes`` not an int >= 0; from the
      streamer's constructor (:meth:`attach`): its ``activation_sharding`` spans several devices; a stage of
      ``routed_specs`` out of range, without state or resident.
    """

    def __init__(self, routed_specs: dict, expert_layout: str = "auto", store: ExpertStore | None = None,
                 tail_piece_min_bytes: int | None = None):
        if expert_layout not in LAYOUTS:
            raise ValueError(f"expert layout must be one of {LAYOUTS}, got {expert_layout!r}")
        if store is not None and not isinstance(store, ExpertStore):
            raise TypeError(f"store must be an ExpertStore or None, got {type(store).__name__}")
        #: the weights of the streamed stages after the last routed one, copied in row blocks behind the routed
        #: layers' experts in a routed run (:mod:`~xla_swap.executors.streaming.tail_pieces`).
        self.tail = TailPieces(tail_piece_min_bytes)
        self._specs: dict[int, RoutedSpec] = dict(routed_specs)
        self._layout = expert_layout
        self._given = store
        self._store: ExpertStore | None = None   # set by attach(), on the streamer's device
        self._views: dict[int, tuple] = {}       # stage -> (host params, its weights less experts, shardings)
        self._whole: dict[int, tuple] = {}       # stage -> (host params, "split" whole weights, shardings)
        self._empty: dict[int, tuple] = {}       # stage -> (host params, {}): what the streamer moves when routed
        self._ahead: dict[int, tuple] = {}       # stage -> (host params, device weights less experts)
        self._programs: dict = {}
        self._last_program: dict[int, tuple] = {}   # stage -> (signature, host params, program) of its last run
        #: whether the next run fetches only the routed experts of the routed stages.
        self.routed: bool = False
        #: the expert copies of the last run: ``(stage, expert ids)`` per routed stage, in order.
        self.expert_fetches: list[tuple[int, tuple[int, ...]]] = []
        #: per routed stage of the last run: ``(stage, arrays copied host -> device, bytes)``.
        self.expert_copies: list[tuple[int, int, int]] = []
        #: why the layout is what it is.
        self.layout_explanation: str = f"expert_layout={expert_layout!r} given"

    @property
    def routed_stages(self) -> tuple[int, ...]:
        """The stages that can run by routed experts."""
        return tuple(sorted(self._specs))

    @property
    def expert_layout(self) -> str:
        """``"stacked"`` or ``"split"`` (``"auto"`` until :meth:`attach` resolves it)."""
        return self._layout

    @property
    def expert_store(self) -> ExpertStore | None:
        """The :class:`ExpertStore` holding the experts (``None`` before :meth:`attach`)."""
        return self._store

    def expert_host_nbytes(self) -> int:
        """Bytes of ``pinned_host`` held beyond the stages' weights: the tail's row blocks (the experts add none:
        the ``"split"`` layout replaces the stacked arrays)."""
        return self.tail.host_nbytes() + (0 if self._store is None else self._store.host_nbytes())

    def attach(self, streamer) -> None:
        """Take ``streamer`` (its device holds the fetched experts) and resolve ``"auto"``; raise ValueError unless
        it runs on one device and every routed stage has state and streams."""
        if len(streamer.activation_sharding.device_set) != 1:
            raise ValueError("routed experts run on one device; activation_sharding spans "
                             f"{len(streamer.activation_sharding.device_set)}")
        for i in self._specs:
            if not 0 <= i < streamer.num_stages or streamer.state_avals[i] is None or streamer.resident[i]:
                raise ValueError(f"routed_specs: stage {i} must be a stage with state, streamed (not resident)")
        if self._layout == "auto":
            per = max((sum(streamer.host_params[i][n].nbytes for n in s.expert_names) // s.num_experts
                       for i, s in self._specs.items()), default=0)
            self._layout = choose_expert_layout(int(per))
            self.layout_explanation = f"expert_layout='auto': {per} B per expert -> {self._layout!r}"
        given, self._given = self._given, None
        if given is not None and given.layout != self._layout:
            given.restore(streamer.host_params)
            given = None
        self._store = ExpertStore(self._layout, streamer.activation_sharding) if given is None else given

    def close(self, streamer) -> None:
        """Put the stacked expert weights back into ``streamer.host_params`` (``"split"``: rebuilt from the packed
        buffers) and drop the weights copied ahead; a later run packs again."""
        if self._store is not None:
            self._store.restore(streamer.host_params)
        self._views, self._whole, self._empty, self._ahead = {}, {}, {}, {}
        self.tail.clear()

    def start(self, streamer) -> None:
        """A run begins: :attr:`expert_fetches` starts empty; routed, the first stages' weights less experts are
        copied (unless the last run left them)."""
        self.expert_fetches, self.expert_copies = [], []
        if not self.routed:
            self._ahead = {}
            self.tail.start(streamer.host_params, (), 1, 1)
        else:
            self._prefetch(streamer, range(streamer.prefetch_depth + 1))
            tail = [j for j in range(max(self._specs) + 1, streamer.num_stages) if not streamer.resident[j]]
            # one block per routed layer whose routing is read before the first tail stage's copy is due
            # (the schedule copies stage t at stage t - prefetch_depth's step, before that stage's output)
            due = min(tail, default=0) - streamer.prefetch_depth
            calls = sum(1 for r in self._specs if r < due)
            self.tail.start(streamer.host_params, tail if calls else (), calls, calls)

    def copy(self, streamer, i: int):
        """Stage ``i``'s weights copied to the device: a tail stage's from the row blocks copied behind the routed
        layers (the rest now); other stages' as :class:`StageCalls` copies them."""
        if self.routed and self.tail.holds(i):
            return self.tail.assemble(i, *self.weights(streamer, i))
        return super().copy(streamer, i)

    def _active(self, i: int) -> bool:
        """Whether stage ``i`` runs by this class's steps (routed, or whole from the ``"split"`` layout)."""
        return i in self._specs and (self.routed or self._layout == "split")

    def weights(self, streamer, i: int) -> tuple[Any, Any]:
        """What the streamer copies for stage ``i``: nothing for a routed stage (this class copies its weights
        less experts behind the experts), a ``"split"`` stage's weights less experts and its ``E`` packed
        buffers when it runs whole; other stages' weights as they are."""
        if not self._active(i):
            return super().weights(streamer, i)
        src = streamer.host_params[i]
        if self.routed:
            got = self._empty.get(i)
            if got is None or got[0] is not src:
                got = self._empty[i] = (src, {}, {})
            return got[1], got[2]
        got = self._whole.get(i)
        if got is None or got[0] is not src:
            p, sh = self._rest(streamer, i)
            bufs = self._store.packed(i, src, self._specs[i].expert_names)
            got = self._whole[i] = (src, {**p, PACKED: list(bufs)},
                                    {**sh, PACKED: [streamer.state_sharding] * len(bufs)})
        return got[1], got[2]

    def _rest(self, streamer, i: int) -> tuple[dict, dict]:
        """Stage ``i``'s host weights less its experts and their device shardings (cached per weights dict)."""
        src = streamer.host_params[i]
        view = self._views.get(i)
        if view is None or view[0] is not src:
            names = self._specs[i].expert_names
            sh = streamer.device_shardings[i]
            view = self._views[i] = (src, {n: v for n, v in src.items() if n not in names},
                                     {n: v for n, v in sh.items() if n not in names})
        return view[1], view[2]

    def _prefetch(self, streamer, stages) -> None:
        """Copy the weights less experts of the routed ``stages`` not already on the device."""
        for j in stages:
            if j in self._specs:
                src = streamer.host_params[j]
                held = self._ahead.get(j)
                if held is None or held[0] is not src:
                    self._ahead[j] = (src, jax.device_put(*self._rest(streamer, j)))

    def executable(self, streamer, sig, i: int):
        """A routed stage's two-part program for ``sig`` (traced, split at the experts, cached); a ``"split"``
        stage run whole: that program on every packed expert, in one executable; else the stage's own."""
        if not self._active(i):
            return super().executable(streamer, sig, i)
        last = self._last_program.get(i)   # the same signature and weights as this stage's last run: no key
        if last is not None and last[0] is sig and last[1] is streamer.host_params[i]:
            prog = last[2]
        else:
            in_aval = sig.chain[i]
            spec = self._specs[i]
            pav = jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), streamer.host_params[i])
            key = (id(spec), aval_key(pav), aval_key(streamer.state_avals[i]), aval_key(in_aval))
            prog = self._programs.get(key)
            if prog is None:
                prog = self._program(streamer, i, spec, pav, in_aval)
                self._programs[key] = prog
            self._last_program[i] = (sig, streamer.host_params[i], prog)
        return prog if self.routed else prog.whole()

    def call(self, streamer, i: int, exe, p, x, states: dict):
        """A routed stage dispatched up to its routing (the first executable, on its weights copied ahead); others
        as :class:`StageCalls` does."""
        if not isinstance(exe, _Program):
            return super().call(streamer, i, exe, p, x, states)
        held = self._ahead.pop(i, None)
        if held is None or held[0] is not streamer.host_params[i]:
            held = (None, jax.device_put(*self._rest(streamer, i)))
        outs = exe.before(held[1], streamer.take_state(i, states), x)
        outs[1].copy_to_host_async()   # the routing, on its way to the host while the host goes on
        return _Pending(exe, outs)

    def output(self, streamer, i: int, y):
        """A routed stage finished: its routing read, the routed experts copied in, the second executable run,
        the next routed stages' weights less experts copied behind the experts, its state put back; other
        stages' outputs as they are."""
        if not isinstance(y, _Pending):
            return y
        prog, outs = y.program, y.outs
        sp = prog.split
        marker_in = outs[:sp.n_marker_in]
        boundary = outs[sp.n_marker_in:sp.n_marker_in + sp.n_boundary]
        ids = np.unique(np.asarray(marker_in[1])).astype(np.int32)   # the layer's one device -> host read
        w = self._store.fetch(i, streamer.host_params[i], prog.spec.expert_names, ids)
        self.expert_fetches.append((i, tuple(int(e) for e in ids)))
        self.expert_copies.append(self._store.copies[-1])
        slots = expert_bucket(len(ids), prog.k, prog.spec.num_experts)   # spare slots: the last expert again, no token
        w = {n: v + [v[-1]] * (slots - len(ids)) for n, v in w.items()}
        late = prog.after(w, tuple(marker_in), tuple(boundary))
        self._prefetch(streamer, [(i + d) % streamer.num_stages for d in range(1, streamer.prefetch_depth + 1)])
        self.tail.dispatch_next(streamer.state_sharding)
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
        before_fn, after_fn = jcore.jaxpr_as_fun(split.before), jcore.jaxpr_as_fun(split.after)
        packing = Packing.of({n: pav[n] for n in names})
        out_tree = jax.tree_util.tree_structure(out_shape)

        def before(p, s, x):
            flat = jax.tree_util.tree_leaves(({**p, **{n: _Hole() for n in names}}, s, x))
            return before_fn(*[flat[k] for k in split.kept])

        def after(w, marker_in, boundary, ids=None):
            if ids is None:   # the host's fetch order: the distinct routed ids ascending, spare slots E
                slots = len(next(iter(w.values())))
                ids = jnp.unique(marker_in[1].ravel(), size=slots, fill_value=spec.num_experts).astype(jnp.int32)
            if PACKED in w:   # packed buffers -> {name: [m arrays]}, on the device
                parts = [packing.unpack(b) for b in w[PACKED]]
                w = {n: [q[n] for q in parts] for n in packing.names}
            return after_fn(spec.experts_fn(w, ids, *marker_in), *boundary)

        def whole(p, s, x):   # every expert, from its packed buffer: the layer's own result in one executable
            outs = before({n: v for n, v in p.items() if n != PACKED}, s, x)
            n_in, n_b = split.n_marker_in, split.n_boundary
            late = after({PACKED: p[PACKED]}, tuple(outs[:n_in]), tuple(outs[n_in:n_in + n_b]),
                         jnp.arange(spec.num_experts, dtype=jnp.int32))
            return jax.tree_util.tree_unflatten(out_tree, split.assemble(outs[n_in + n_b:], late))

        dev, act, state_sh = streamer.device_shardings[i], streamer.activation_sharding, streamer.state_sharding
        spec_of = lambda av, sh: jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), av)
        pspec = {n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=dev[n]) for n, v in pav.items() if n not in names}
        args = (spec_of(sav, state_sh), spec_of(in_aval, act))
        exe = jax.jit(before, out_shardings=state_sh, donate_argnums=(1,)).lower(pspec, *args).compile()
        packed = [jax.ShapeDtypeStruct((packing.length,), packing.dtype, sharding=state_sh)] * spec.num_experts
        whole_exe: list = []

        def compiled_whole():
            if not whole_exe:
                whole_exe.append(jax.jit(whole, out_shardings=(act, state_sh), donate_argnums=(1,)).lower(
                    {**pspec, PACKED: packed}, *args).compile())
            return whole_exe[0]
        return _Program(split, spec, exe, jax.jit(after, out_shardings=state_sh), out_tree,
                        int(split.before.out_avals[1].shape[-1]), compiled_whole)
