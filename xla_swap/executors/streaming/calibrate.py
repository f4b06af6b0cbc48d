"""Calibration on the device, and a ``StreamingRuntime`` reconfigured to the schedule chosen from it.

A short measurement (a few calls; seconds on a GPU) of what the planner needs to choose a
schedule for one runtime and one input signature:

* the host <-> device link: a stage's weights (the largest) copied ``pinned_host`` -> device,
  device -> ``pinned_host``, and both at once, as the runtime copies them (its shardings, its
  per-stage buffers): an :class:`xla_swap.planning.Link` in GB/s of logical (unsharded) bytes,
  the unit of the planner's :class:`~xla_swap.planning.LayerCost`;
* every *distinct* stage's compute with its weights in device memory (stages sharing one
  executable are measured once): its forward, and its backward as the runtime runs it in
  ``train_step`` (recompute under ``remat=True``, the optimizer update fused in with one);
  the runtime's :meth:`StreamingRuntime.layer_cost` gives the bytes and the forward time, this
  module adds the backward and its compiled temporaries.

:func:`autotune` then chooses with :func:`xla_swap.planning.chooser.choose_schedule` (cached in
memory per stage signatures, input signature, budget and mode) and :func:`reconfigure` builds the
runtime that runs it. Imports jax and numpy only.

Runtime choice: ``InGraphRuntime`` runs a forward only (no ``train_step``, no optimizer, no
residency), so for training, and for the torch entry point (``SwappedStack``), the runtime is
``StreamingRuntime`` and the chooser picks its parameters.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import statistics
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import numpy as np

from xla_swap.planning.chooser import CHOICES, ChoiceCache, ScheduleChoice, choose_schedule
from xla_swap.planning.planner import GB, LayerCost, Link
from xla_swap.planning.units import check_budget_bytes

from ..transfers import put
from ..pytrees import HOST_KIND, aval_key, probe, split_diff
from .. import optim as _optim
from .runtime import StreamingRuntime

#: Fewest timed copies per direction of :func:`calibrate`'s link measurement (medians): enough that
#: a stall of one copy does not move the median (docs/reference/benchmark-runs.md, "Planner and chooser
#: against H100 runs").
LINK_REPS = 7

__all__ = ["Calibration", "calibrate", "calibration_from_figures", "measure_link", "peak_bytes_in_use", "runtime_signature", "reconfigure",
           "autotune"]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured (seconds, bytes, GB/s).

    Attributes:
      link: the measured :class:`~xla_swap.planning.Link` (medians; ``host_memory_gbps`` the default).
      costs: one :class:`~xla_swap.planning.LayerCost` per stage: ``param_bytes``, ``grad_bytes``,
        ``optimizer_bytes``, ``carry_bytes`` (the stage input), ``intermediate_bytes`` (what
        ``remat=False`` would save), ``working_bytes`` (the compiled backward's temporaries, less
        the recomputed intermediates under ``remat=True``), ``forward_s``, ``backward_factor``
        (measured backward time, less the recompute under ``remat=True``, over ``forward_s``).
      forward_s / backward_s: per stage, the measured medians (the backward as run, recompute and
        fused update included); stages of one group carry the group's figures.
      groups: tuples of stage indices that share executables (measured once).
      remat: whether the runtime recomputes each stage in the backward (``remat is True``).
      link_samples: ``{"h2d" | "d2h" | "both": [GB/s, ...]}``.
      key: the :func:`runtime_signature` of the runtime and input measured.
      wall_s: seconds the calibration took (compilation included).
      forward_temp_bytes: per stage, the compiled forward's temporaries in bytes (``None`` where
        the backend reports none): what a stage holds beyond its weights, input and output while
        it runs a forward (:meth:`costs_for` uses it for a forward).
    """

    link: Link
    costs: tuple
    forward_s: tuple
    backward_s: tuple
    groups: tuple
    remat: bool
    link_samples: dict
    key: Hashable
    wall_s: float
    forward_temp_bytes: tuple = ()

    def costs_for(self, training: bool) -> list:
        """The per-stage costs to choose a schedule with (a list of ``LayerCost``).

        Training: ``costs`` (``working_bytes`` from the backward). A forward: each stage's
        ``working_bytes`` is its compiled forward's temporaries where measured: the backward's
        figure is not what a forward holds (docs/reference/benchmark-runs.md, "Planner and chooser against
        H100 runs").

        Raises: TypeError: ``training`` is not a bool.
        """
        if not isinstance(training, bool):
            raise TypeError(f"training must be a bool, got {type(training).__name__}")
        if training or not self.forward_temp_bytes:
            return list(self.costs)
        return [c if t is None else dataclasses.replace(c, working_bytes=int(t))
                for c, t in zip(self.costs, self.forward_temp_bytes)]


def peak_bytes_in_use(device: jax.Device | None = None) -> int | None:
    """``device.memory_stats()['peak_bytes_in_use']`` (bytes; default ``jax.devices()[0]``): the
    process's high-water mark of device memory, which jax cannot reset; ``None`` where the
    backend reports no statistics (XLA:CPU)."""
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats()
    return None if not stats or "peak_bytes_in_use" not in stats else int(stats["peak_bytes_in_use"])


def runtime_signature(runtime: StreamingRuntime, h) -> tuple:
    """``(stage signatures, input signature)``, hashable: per stage its function's qualified name and
    parameter shapes / dtypes, with whether an optimizer runs, the ``remat`` checkpoint policy
    (``None`` for a bool ``remat``: :func:`autotune` chooses between ``True`` and ``False``, from
    figures that predict both) and the devices; the input's structure, shapes and dtypes. The key
    (with budget, mode and the chooser's options) of cached choices.

    Raises: TypeError: ``runtime`` is not a ``StreamingRuntime``; ``h`` is not an array pytree.
    """
    _check_runtime(runtime)
    stages = tuple((getattr(f, "__qualname__", type(f).__name__), aval_key(a))
                   for f, a in zip(runtime.stage_fns, runtime.param_avals))
    sig = runtime.signature(h)
    devices = tuple(sorted(d.id for d in runtime.activation_sharding.device_set))
    policy = None if isinstance(runtime.remat, bool) else runtime.remat
    return (stages, runtime.optimizer is not None, policy, devices), aval_key(sig.in_aval)


def _check_runtime(runtime) -> None:
    if not isinstance(runtime, StreamingRuntime):
        raise TypeError(f"runtime must be an xla_swap.executors.StreamingRuntime, got {type(runtime).__name__}")


def _check_reps(reps) -> int:
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")
    return reps


def _median_time(call, reps: int) -> float:
    """Median seconds of ``reps`` synced calls of ``call`` after one warm-up call."""
    jax.block_until_ready(call())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(call())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure_link(runtime: StreamingRuntime, *, reps: int = 3) -> tuple[Link, dict]:
    """Measure the host <-> device link with the runtime's largest stage's weights.

    Copies that stage's weights (logical bytes ``P``) from ``pinned_host`` to the device, back, and
    both at once (``2P`` bytes), each ``reps`` times after a warm-up (copies until the rate stops
    rising, at most :data:`LINK_WARMUP_MAX`), synced.

    Returns: ``(Link(h2d_gbps, d2h_gbps, both_gbps), {"h2d": [...], "d2h": [...], "both": [...]})``,
      medians and samples in GB/s of logical bytes.

    Raises: TypeError: ``runtime`` is not a ``StreamingRuntime``; ValueError: ``reps < 1``.
    """
    _check_runtime(runtime)
    reps = _check_reps(reps)
    i = max(range(runtime.num_stages), key=lambda j: runtime.stage_nbytes[j])
    nbytes = runtime.stage_nbytes[i]
    dev_sh = runtime.device_shardings[i]
    host_sh = jax.tree_util.tree_map(lambda s: s.with_memory_kind(HOST_KIND), dev_sh)
    src = jax.block_until_ready(put(runtime.host_params[i], host_sh))
    on_dev = jax.block_until_ready(put(src, dev_sh, may_alias=False))
    samples: dict[str, list] = {"h2d": [], "d2h": [], "both": []}
    moves = {"h2d": (lambda: put(src, dev_sh, may_alias=False), nbytes),
             "d2h": (lambda: put(on_dev, host_sh, may_alias=False), nbytes),
             "both": (lambda: (put(src, dev_sh, may_alias=False),
                               put(on_dev, host_sh, may_alias=False)), 2 * nbytes)}
    for name, (move, b) in moves.items():
        _warm_up(move, b)
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(move())
            samples[name].append(b / max(time.perf_counter() - t, 1e-9) / GB)
    del on_dev, src
    med = {k: statistics.median(v) for k, v in samples.items()}
    return Link(h2d_gbps=med["h2d"], d2h_gbps=med["d2h"], both_gbps=med["both"]), samples


#: Most warm-up copies of :func:`measure_link` per direction.
LINK_WARMUP_MAX = 20


def _warm_up(move, nbytes: int) -> int:
    """Copies until the rate stops rising (a copy no more than 5 % above the best so far, after
    at least 2), at most :data:`LINK_WARMUP_MAX`; returns how many ran. The first copies of a
    process can run far below the link (docs/reference/benchmark-runs.md, "Planner and chooser against
    H100 runs")."""
    best = 0.0
    for n in range(1, LINK_WARMUP_MAX + 1):
        t = time.perf_counter()
        jax.block_until_ready(move())
        rate = nbytes / max(time.perf_counter() - t, 1e-9)
        if n >= 2 and rate <= best * 1.05:
            return n
        best = max(best, rate)
    return LINK_WARMUP_MAX


def calibrate(runtime: StreamingRuntime, h, *, reps: int = 3) -> Calibration:
    """Measure the link and every distinct stage's forward and backward on the device.

    Args:
      runtime: the ``StreamingRuntime`` whose stages are measured (its weights, optimizer,
        ``remat`` and shardings; nothing of its state changes: the measured copies are its own
        buffers copied, not donated).
      h: an input of the stack (its signature fixes every stage's shapes), numpy or jax arrays.
      reps: timed calls per measurement (medians), after one warm-up each; the link takes at
        least :data:`LINK_REPS`.

    Returns: a :class:`Calibration`. Every time is positive and finite on a working device.

    Raises: TypeError: ``runtime`` is not a ``StreamingRuntime``; ValueError: ``reps < 1``; the
      input checks of ``runtime.forward`` (before anything runs).
    """
    _check_runtime(runtime)
    reps = _check_reps(reps)
    t0 = time.perf_counter()
    rt = runtime
    sig = rt.signature(h)        # raises for a bad input before anything runs
    key = runtime_signature(rt, h)
    link, samples = measure_link(rt, reps=max(reps, LINK_REPS))

    def timed(i: int) -> tuple[float, float]:
        return rt.layer_cost(h, i, measure_reps=reps).forward_s, _median_time(_backward_call(rt, sig, i), reps)

    return _assemble(rt, sig, key, link, samples, timed, lambda: time.perf_counter() - t0, per_stage=False)


def calibration_from_figures(runtime: StreamingRuntime, h, *, link: Link, forward_s, backward_s) -> Calibration:
    """A :class:`Calibration` of ``runtime`` and input ``h`` with the given times and link instead of measured ones.

    The bytes are the runtime's, as :func:`calibrate` reads them (weights, optimizer state, stage
    inputs, saved intermediates, the compiled forward's and backward's temporaries: executables are
    compiled, nothing runs); the times and the link are the figures given. No clock is read, so a
    choice made from it (``autotune(..., calibration=...)``, ``SwappedStack(calibration=...)``) is
    the same on every machine: the way to test a choice, or to choose from figures measured elsewhere.

    Args:
      runtime: the ``StreamingRuntime`` the calibration describes (left unchanged).
      h: an input of the stack (its signature fixes every stage's shapes), numpy or jax arrays.
      link: the host <-> device :class:`~xla_swap.planning.Link` (GB/s).
      forward_s: seconds of one stage's forward with its weights in device memory: one number for
        every stage, or a sequence of one per stage.
      backward_s: seconds of one stage's backward as ``train_step`` runs it (the recompute under
        ``remat=True`` and the fused optimizer update included), as :attr:`Calibration.backward_s`:
        one number or one per stage; it must be at least ``forward_s`` under ``remat=True``.

    Returns: a :class:`Calibration` (``link_samples`` holds the one given figure per direction,
      ``wall_s`` is 0.0).

    Raises: TypeError: ``runtime`` is not a ``StreamingRuntime``, ``link`` is not a ``Link``, a time
      is not a number; ValueError: a time not finite and > 0, a sequence of another length than the
      number of stages, ``backward_s < forward_s`` under ``remat=True``; the input checks of
      ``runtime.forward``. All before anything is compiled.
    """
    _check_runtime(runtime)
    if not isinstance(link, Link):
        raise TypeError(f"link must be an xla_swap.planning.Link, got {type(link).__name__}")
    n = runtime.num_stages
    fwd = _per_stage("forward_s", forward_s, n)
    bwd = _per_stage("backward_s", backward_s, n)
    remat = runtime.remat is True
    if remat:
        for i, (f, b) in enumerate(zip(fwd, bwd)):
            if b < f:
                raise ValueError(f"backward_s[{i}]={b!r} is below forward_s[{i}]={f!r}: under remat=True the "
                                 "backward recomputes the forward, so it takes at least as long")
    sig = runtime.signature(h)   # raises for a bad input before anything is compiled
    key = runtime_signature(runtime, h)
    samples = {"h2d": [link.h2d_gbps], "d2h": [link.d2h_gbps], "both": [link.both_gbps]}
    return _assemble(runtime, sig, key, link, samples, lambda i: (fwd[i], bwd[i]), lambda: 0.0, per_stage=True)


def _per_stage(name: str, v, n: int) -> list[float]:
    """``v`` (one number, or a sequence of ``n``) as ``n`` finite positive floats; errors name ``name``."""
    if isinstance(v, (str, bytes)):
        raise TypeError(f"{name} must be seconds (a number or one per stage), got {v!r}")
    if isinstance(v, Sequence) or isinstance(v, np.ndarray):
        vals = list(v)
        if len(vals) != n:
            raise ValueError(f"{name} has {len(vals)} entries, the runtime {n} stages")
    else:
        vals = [v] * n
    out = []
    for i, t in enumerate(vals):
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise TypeError(f"{name}[{i}] must be a number of seconds, got {t!r}")
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"{name}[{i}] must be finite and > 0 seconds, got {t!r}")
        out.append(float(t))
    return out


def _assemble(rt: StreamingRuntime, sig, key, link: Link, samples: dict, times, wall, *,
              per_stage: bool) -> Calibration:
    """A :class:`Calibration` from the runtime's bytes and ``times(i) -> (forward_s, backward_s)``:
    called for every stage (``per_stage``), else once per group of stages sharing executables (its
    first member's figures for all); ``wall()`` gives ``wall_s`` once everything ran."""
    remat = rt.remat is True
    groups: dict[Any, list[int]] = {}
    fn_ids, param_avals = rt.stage_fn_ids, rt.param_avals
    for i in range(rt.num_stages):
        group_key = (fn_ids[i], aval_key(param_avals[i]), aval_key(sig.chain[i]), rt.resident[i])
        groups.setdefault(group_key, []).append(i)
    fwd_s, bwd_s, costs = [0.0] * rt.num_stages, [0.0] * rt.num_stages, [None] * rt.num_stages
    fwd_temp: list = [None] * rt.num_stages
    for members in groups.values():
        i = members[0]
        base = LayerCost(forward_s=1.0, **rt.stage_cost_bytes(sig, i))     # bytes; the time is set below
        f_temp = _temp_bytes(rt.stage_executable(sig, "forward", i))
        temp = _temp_bytes(_backward_exe(rt, sig, i))
        shared = None if per_stage else times(i)
        for j in members:
            t_f, t_b = times(j) if per_stage else shared
            t_f = max(t_f, 1e-9)
            factor = max(t_b - (t_f if remat else 0.0), 0.0) / t_f
            working = max(temp - (base.intermediate_bytes if remat else 0), 0) if temp is not None \
                else base.working_bytes
            fwd_s[j], bwd_s[j], fwd_temp[j] = t_f, t_b, f_temp
            costs[j] = dataclasses.replace(base, forward_s=t_f, backward_factor=factor, working_bytes=working,
                                           param_bytes=rt.stage_nbytes[j], optimizer_bytes=rt.optimizer_state_nbytes[j])
    return Calibration(link=link, costs=tuple(costs), forward_s=tuple(fwd_s), backward_s=tuple(bwd_s),
                       groups=tuple(tuple(m) for m in groups.values()), remat=remat, link_samples=samples,
                       key=key, wall_s=wall(), forward_temp_bytes=tuple(fwd_temp))


def _temp_bytes(exe) -> int | None:
    """A compiled executable's temporaries in bytes, ``None`` where the backend reports none."""
    try:
        return int(exe.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def _backward_exe(rt: StreamingRuntime, sig, i: int):
    """Stage ``i``'s backward executable as ``train_step`` runs it (saved residuals unless ``remat=True``)."""
    return rt.stage_executable(sig, "backward" if rt.remat is True else "backward-saved", i)


def _backward_call(rt: StreamingRuntime, sig, i: int):
    """A call of stage ``i``'s backward as ``train_step`` runs it (weights on the device, no donation)."""
    save = rt.remat is not True
    exe = _backward_exe(rt, sig, i)
    p = put(rt.host_params[i], rt.device_shardings[i], may_alias=False)
    hin, hout = sig.chain[i], sig.chain[i + 1]
    x = put(jax.tree_util.tree_map(probe, hin), rt.activation_sharding_of(hin, sig))
    gout = split_diff(hout)[0]
    g = put([probe(a, 1) for a in gout], rt.activation_sharding_of(gout, sig))
    args: tuple = (p, x)
    if save:
        args += (rt.stage_executable(sig, "forward-save", i)(p, x)[1],)
    args += (g,)
    if rt.optimizer is not None:
        state = put(rt.optimizer_state[i], rt.optimizer_state_device_shardings[i], may_alias=False)
        hyper = put(_optim.hyper_rows(rt.param_groups, 1), rt.activation_sharding)
        args += (state, hyper)
    return lambda: exe(*args)


def reconfigure(runtime: StreamingRuntime, choice: ScheduleChoice, *, own_params: bool = False) -> StreamingRuntime:
    """A new ``StreamingRuntime`` running ``choice`` over ``runtime``'s stages: the same stage
    functions, current weights, shardings, optimizer (its state and step count carried over),
    trainable leaves and flags; ``prefetch_depth``, ``resident``, ``offload_activations``,
    ``optimizer_state_on_host`` and, for a training choice, ``remat`` from
    ``choice.runtime_kwargs()``. A forward's choice keeps ``runtime.remat``; so does a training
    choice with ``remat=False`` when ``runtime.remat`` is a ``jax.checkpoint_policies`` policy
    (its calibration's figures are that policy's: :func:`autotune` does not choose ``remat`` for it).

    ``own_params=False``: ``runtime`` is left as it was (its buffers stay until it is dropped):
    while both exist, host memory holds the weights (and optimizer state) twice. ``own_params=True``:
    the new runtime takes ``runtime``'s weights and optimizer state where they already sit
    with no copy; ``runtime`` must not be called afterwards (the new runtime's updates may donate what
    they share). The optimizer state is placed straight into its new place: no zero state is allocated
    first, so a choice with the moments in device memory holds them there once. This is
    ``runtime.reconfigured(runtime.config.replace(**choice.runtime_kwargs()))``: the same stages, another
    ``RuntimeConfig``.

    Raises: TypeError: ``runtime`` not a ``StreamingRuntime``, ``choice`` not a
      ``ScheduleChoice`` or ``own_params`` not a bool; ValueError: ``choice.resident`` has another
      number of stages; the runtime holds accumulated gradients (``grad_acc``: update first).
    """
    _check_runtime(runtime)
    if not isinstance(own_params, bool):
        raise TypeError(f"own_params must be a bool, got {type(own_params).__name__}")
    if not isinstance(choice, ScheduleChoice):
        raise TypeError(f"choice must be an xla_swap.planning.chooser.ScheduleChoice, got {type(choice).__name__}")
    rt = runtime
    if len(choice.resident) != rt.num_stages:
        raise ValueError(f"choice.resident has {len(choice.resident)} stages, the runtime {rt.num_stages}")
    kw = choice.runtime_kwargs()
    remat = kw.pop("remat", rt.remat)
    if remat is False and not isinstance(rt.remat, bool):
        remat = rt.remat
    return rt.reconfigured(rt.config.replace(remat=remat, **kw), own_params=own_params)


def autotune(runtime: StreamingRuntime, h, budget_bytes: int, *, training: bool = True, reps: int = 3,
             cache: ChoiceCache = CHOICES,
             calibration: "Calibration | Callable[[StreamingRuntime, Any], Calibration] | None" = None,
             allow_no_remat: bool = True, own_params: bool = False,
             **choose_kwargs) -> tuple[StreamingRuntime, ScheduleChoice]:
    """Choose a schedule for ``runtime`` and input ``h`` under ``budget_bytes``, and the runtime that runs it.

    Without ``calibration`` the choice is looked up in ``cache`` under
    ``(runtime_signature(runtime, h), the chooser's options, budget_bytes, training)``; on a miss :func:`calibrate`
    measures (``reps`` calls per figure) and :func:`~xla_swap.planning.chooser.choose_schedule`
    chooses, and the choice is cached. With ``calibration`` nothing is measured and the cache is
    not read: the choice is made from that calibration's figures (and cached under the same key).

    Args:
      runtime: the ``StreamingRuntime`` to tune (left unchanged).
      h: an input of the stack (numpy or jax arrays).
      budget_bytes: device memory in bytes (int > 0) for everything the runtime holds.
      training: choose for ``train_step`` (default) or for ``forward``.
      reps: timed calls per figure of the calibration (unused with ``calibration``).
      cache: the :class:`~xla_swap.planning.chooser.ChoiceCache` (default the process-wide one).
      calibration: a :class:`Calibration` of this runtime and input signature to choose from
        instead of measuring (e.g. one calibration for several budgets, or
        :func:`calibration_from_figures`), or a callable ``(runtime, h) -> Calibration`` called
        instead of :func:`calibrate` (e.g. ``functools.partial(calibration_from_figures,
        link=..., forward_s=..., backward_s=...)``).
      allow_no_remat: for a training step, choose ``remat`` too: ``True`` (recompute each stage's
        forward in its backward) or ``False`` (keep its residuals, offloaded with the stage inputs
        when the choice offloads): default ``True``; ``False`` keeps ``remat=True``. A runtime whose
        ``remat`` is a ``jax.checkpoint_policies`` policy keeps it either way (its calibration
        measured that policy's backward).
      own_params: a new runtime takes ``runtime``'s weights and optimizer state without a copy
        (:func:`reconfigure`); ``runtime`` must then not be called again. Default ``False``.
      **choose_kwargs: ``max_prefetch_depth``, ``allow_offload``, ``allow_device_optimizer_state``.

    Returns: ``(runtime to use, choice)``: ``runtime`` itself when it already runs the choice, else
      :func:`reconfigure`'s new runtime. ``choice.explain()`` shows the prediction (and, once
      ``choice.observe(...)`` recorded them, the measured figures).

    Raises: the errors of :func:`calibrate` and of ``choose_schedule`` (``InfeasibleBudgetError``
      when nothing fits); ``TypeError`` / ``ValueError`` for a bad budget (the words of
      :func:`~xla_swap.planning.units.check_budget_bytes`); ``TypeError`` for a ``calibration`` that
      is neither a ``Calibration`` nor callable, or a callable that returns no ``Calibration``;
      ``ValueError`` for a calibration of another runtime or input signature; ``TypeError`` for an
      ``allow_no_remat`` or ``own_params`` that is not a bool; all before the runtime changes.
    """
    _check_runtime(runtime)
    for name, flag in (("allow_no_remat", allow_no_remat), ("own_params", own_params)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    budget_bytes = check_budget_bytes(budget_bytes)
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {type(training).__name__}")
    if not isinstance(cache, ChoiceCache):
        raise TypeError(f"cache must be a ChoiceCache, got {type(cache).__name__}")
    if calibration is not None and not isinstance(calibration, Calibration) and not callable(calibration):
        raise TypeError(f"calibration must be a Calibration, a callable (runtime, h) -> Calibration or None, "
                        f"got {type(calibration).__name__}")
    sig = runtime_signature(runtime, h)
    if isinstance(calibration, Calibration):
        _check_calibration(calibration, sig)
    # the chooser's options are part of the input's key: a choice made with other options is another choice
    options = tuple(sorted({**choose_kwargs, "allow_no_remat": allow_no_remat}.items()))
    key = cache.key(sig[0], (sig[1], options), budget_bytes, training)
    choice = None if calibration is not None else cache.get(key)
    if choice is None:
        cal = _calibration_for(runtime, h, calibration, reps, sig)
        # a bool remat: the calibration's backward_factor excludes the recompute, so both settings
        # can be predicted; a checkpoint policy's figures are that policy's (cal.remat False)
        choosable = isinstance(runtime.remat, bool)
        choice = choose_schedule(cal.costs_for(training), cal.link, budget_bytes, training=training,
                                 remat=choosable or cal.remat, allow_no_remat=allow_no_remat and choosable,
                                 **choose_kwargs)
        cache.put(key, choice)
    current = {"prefetch_depth": runtime.prefetch_depth, "resident": list(runtime.resident),
               "offload_activations": runtime.offload_activations,
               "optimizer_state_on_host": runtime.optimizer_state_on_host, "remat": runtime.remat is True}
    if choice.same_config(current):
        return runtime, choice
    return reconfigure(runtime, choice, own_params=own_params), choice


def _calibration_for(runtime: StreamingRuntime, h, calibration, reps: int, sig) -> Calibration:
    """:func:`autotune`'s calibration: measured (``calibration=None``), the one given, or the given
    callable's (checked against ``sig``, ``runtime_signature(runtime, h)``)."""
    if calibration is None:
        return calibrate(runtime, h, reps=reps)
    if isinstance(calibration, Calibration):
        return calibration
    cal = calibration(runtime, h)
    if not isinstance(cal, Calibration):
        raise TypeError(f"calibration returned a {type(cal).__name__}, expected a Calibration")
    _check_calibration(cal, sig)
    return cal


def _check_calibration(cal: Calibration, sig) -> None:
    if cal.key != sig:
        raise ValueError("calibration was measured for other stages or another input signature than runtime and h")
