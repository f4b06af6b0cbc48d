"""A ``StreamingRuntime`` configuration chosen from measured costs and a device-memory budget.

:func:`choose_schedule` picks ``prefetch_depth``, the ``resident`` stages, ``offload_activations``,
``optimizer_state_on_host`` and, in training, ``remat`` (a :class:`ScheduleChoice`) for one stack and one input
signature: every candidate is mapped onto the planner's streaming policy over per-stage
:class:`LayerCost` s rewritten for it and timed by :func:`xla_swap.planning.evaluate`; the
fastest predicted candidate that fits wins. :func:`evaluate_choice` predicts one configuration;
:class:`ChoiceCache` keeps choices in memory. The mapping, the search order and the tie-breaks
are in docs/reference/planner.md, "The chooser".

Framework-neutral: pure Python, imports neither torch, torch_xla nor jax (the measurement that
feeds it, :func:`xla_swap.executors.streaming.calibrate.calibrate`, lives on the executor side).
Units: bytes, seconds, GB/s (1e9 bytes/s).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import statistics
from typing import Hashable, Mapping, Sequence

from xla_swap.planning.cache import LRUCache
from xla_swap.planning.costs import LayerCost, Link
from xla_swap.planning.planner import evaluate
from xla_swap.planning.policy import OffloadPolicy, check_bool, check_flags
from xla_swap.planning.result import InfeasibleBudgetError, Plan
from xla_swap.planning.units import REL_TIE, GiB, as_bytes, as_prefetch_depth, check_budget_bytes

__all__ = ["ScheduleChoice", "evaluate_choice", "choose_schedule", "ChoiceCache", "CHOICES",
           "STAGE_INPUT", "STAGE_RESIDUALS", "DEFAULT_MAX_PREFETCH_DEPTH"]

#: The name under which an offloaded stage input appears in the planner's costs.
STAGE_INPUT = "stage input"
#: The name under which a stage's offloaded vjp residuals (``remat=False``) appear in the planner's costs.
STAGE_RESIDUALS = "stage residuals"
#: Largest prefetch depth the chooser tries by default.
DEFAULT_MAX_PREFETCH_DEPTH = 4


@dataclasses.dataclass
class ScheduleChoice:
    """A ``StreamingRuntime`` configuration with its predictions (bytes, seconds).

    Attributes:
      prefetch_depth: ``k``, stages streamed ahead.
      resident: per stage, ``True`` keeps its weights (and optimizer state) in device memory.
      offload_activations: training: stage inputs (and with ``remat=False`` the saved residuals)
        through ``pinned_host``.
      optimizer_state_on_host: the streamed stages' optimizer state in ``pinned_host`` (``True``)
        or in device memory.
      remat: training: ``True`` recomputes each stage's forward in its backward; ``False`` keeps
        its vjp residuals from the forward (in device memory, or with ``offload_activations`` in
        ``pinned_host``). In a forward: the ``remat`` the prediction was asked for (unused).
      training: whether the predictions are of a training step (else of a forward).
      device_bytes: predicted peak device bytes.
      step_s: predicted time of a call in a loop (the cyclic schedule's steady state), seconds.
      floor_s: the planner's floor of that call: ``max(compute, bytes / bandwidth)``, seconds.
      plan: the planner's :class:`Plan` of the rewritten costs (docs/reference/planner.md, "The chooser").
      extra_device_bytes: ``{component: bytes}`` added to ``plan.device_bytes`` (resident stages,
        device moments, live carry).
      budget_bytes: the budget it was chosen for (``None`` from :func:`evaluate_choice`).
      candidates: how many candidates the chooser evaluated (0 from :func:`evaluate_choice`).
      best_step_s_by_remat: ``{remat: seconds}``, the fastest predicted step that fits for each
        ``remat`` setting the chooser tried (empty from :func:`evaluate_choice`); a setting with no
        fitting candidate is absent.
      measured_step_s / measured_peak_bytes: the medians of what :meth:`observe` recorded
        (``None`` until then).
    """

    prefetch_depth: int
    resident: tuple
    offload_activations: bool
    optimizer_state_on_host: bool
    remat: bool
    training: bool
    device_bytes: int
    step_s: float
    floor_s: float
    plan: Plan = dataclasses.field(repr=False)
    extra_device_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    budget_bytes: int | None = None
    candidates: int = 0
    best_step_s_by_remat: Mapping[bool, float] = dataclasses.field(default_factory=dict)
    measured_step_s: float | None = None
    measured_peak_bytes: int | None = None
    _step_samples: list = dataclasses.field(default_factory=list, repr=False)
    _peak_samples: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def num_resident(self) -> int:
        """Number of resident stages."""
        return sum(self.resident)

    def runtime_kwargs(self) -> dict:
        """The ``RuntimeConfig`` fields this schedule decides (``config.replace(**choice.runtime_kwargs())``,
        ``runtime.reconfigured(**...)``): ``prefetch_depth``,
        ``resident`` (a list of bools), ``offload_activations``, ``optimizer_state_on_host`` and,
        for a training step, ``remat`` (a bool; a forward does not use it)."""
        kw = {"prefetch_depth": self.prefetch_depth, "resident": list(self.resident),
              "offload_activations": self.offload_activations,
              "optimizer_state_on_host": self.optimizer_state_on_host}
        if self.training:
            kw["remat"] = self.remat
        return kw

    def same_config(self, other: "ScheduleChoice | Mapping") -> bool:
        """Whether ``other`` (a choice, or ``StreamingRuntime`` keyword arguments as
        :meth:`runtime_kwargs` gives them) runs the same schedule: equal arguments, where with
        every stage resident ``prefetch_depth`` and ``optimizer_state_on_host`` do not matter
        (nothing streams; a resident stage's optimizer state is in device memory either way),
        ``remat`` counts only for a training choice and a mapping without it means ``True``
        (the runtime's default)."""
        kw = other.runtime_kwargs() if isinstance(other, ScheduleChoice) else dict(other)
        return _config_key(self.runtime_kwargs(), self.training) == _config_key(kw, self.training)

    def observe(self, step_s: float | None = None, peak_bytes: int | None = None) -> None:
        """Record a measured step (seconds per call in a loop) and/or peak device bytes;
        ``measured_*`` become the medians of everything recorded.

        Raises: TypeError / ValueError: ``step_s`` not a finite number > 0, ``peak_bytes`` not an
        int >= 0 (nothing is recorded then).
        """
        if step_s is not None:
            if isinstance(step_s, bool) or not isinstance(step_s, numbers.Real):
                raise TypeError(f"step_s must be a number of seconds, got {step_s!r}")
            if not (math.isfinite(step_s) and step_s > 0):
                raise ValueError(f"step_s must be finite and > 0 seconds, got {step_s!r}")
        if peak_bytes is not None:
            peak_bytes = as_bytes("ScheduleChoice.observe", "peak_bytes", peak_bytes)
        if step_s is not None:
            self._step_samples.append(float(step_s))
            self.measured_step_s = statistics.median(self._step_samples)
        if peak_bytes is not None:
            self._peak_samples.append(peak_bytes)
            self.measured_peak_bytes = int(statistics.median(self._peak_samples))

    def describe(self) -> str:
        """One line: ``k``, resident stages, offload, where the moments live, ``remat`` (training)."""
        res = [i for i, r in enumerate(self.resident) if r]
        return (f"k={self.prefetch_depth}, resident {len(res)}/{len(self.resident)} {res}, "
                f"offload_activations={self.offload_activations}, "
                f"optimizer state {'pinned_host' if self.optimizer_state_on_host else 'device'}"
                + (f", remat={self.remat}" if self.training else ""))

    def explain(self) -> str:
        """Printable: the configuration, predicted against measured (step, peak, ratios), the
        budget, then the planner's own table (:meth:`Plan.explain`) of the rewritten costs."""
        lines = [f"schedule: {self.describe()}",
                 f"{'training step' if self.training else 'forward'}: predicted {self.step_s:.4f} s "
                 f"(floor {self.floor_s:.4f} s, {self.step_s / self.floor_s if self.floor_s else 1.0:.3f}x), "
                 f"peak {self.device_bytes} bytes ({self.device_bytes / GiB:.3f} GiB)"]
        if self.budget_bytes is not None:
            lines.append(f"budget {self.budget_bytes} bytes ({self.budget_bytes / GiB:.3f} GiB), "
                         f"{self.candidates} candidates evaluated")
        if len(self.best_step_s_by_remat) > 1:
            lines.append("fastest predicted that fits: " + ", ".join(
                f"remat={r} {t:.4f} s" for r, t in sorted(self.best_step_s_by_remat.items(), reverse=True)))
        if self.measured_step_s is not None:
            lines.append(f"measured step {self.measured_step_s:.4f} s = {self.measured_step_s / self.step_s:.3f}x "
                         f"predicted ({len(self._step_samples)} samples)")
        else:
            lines.append("measured step: not yet (ScheduleChoice.observe)")
        if self.measured_peak_bytes is not None:
            lines.append(f"measured peak {self.measured_peak_bytes} bytes ({self.measured_peak_bytes / GiB:.3f} GiB)"
                         f" = {self.measured_peak_bytes / self.device_bytes:.3f}x predicted")
        else:
            lines.append("measured peak: not yet (ScheduleChoice.observe)")
        if self.extra_device_bytes:
            lines.append("device bytes beside the planner's: " + ", ".join(
                f"{k} {v} ({v / GiB:.3f} GiB)" for k, v in self.extra_device_bytes.items()))
        return "\n".join(lines + ["", self.plan.explain()])


def _config_key(kw: Mapping, training: bool = True) -> tuple:
    res = tuple(bool(r) for r in kw["resident"])
    everything = all(res)
    return (res, bool(kw["offload_activations"]), None if everything else int(kw["prefetch_depth"]),
            None if everything else bool(kw["optimizer_state_on_host"]),
            bool(kw.get("remat", True)) if training else None)


def _check_costs(costs) -> list:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence) or not costs:
        raise TypeError("costs must be a non-empty sequence of LayerCost (one per stage)")
    for i, c in enumerate(costs):
        if not isinstance(c, LayerCost):
            raise TypeError(f"costs[{i}] must be a LayerCost, got {type(c).__name__}")
    return list(costs)


def _rewrite(costs: list, resident: tuple, offload: bool, moments_on_host: bool,
             remat: bool = True) -> tuple[list, dict]:
    """The per-stage costs the planner sees for a candidate, and the device bytes taken out of its sight."""
    out, extra = [], {}
    for c, r in zip(costs, resident):
        kw = {"param_bytes": 0 if r else c.param_bytes, "update_bytes": 0 if r else c.update_bytes,
              "optimizer_bytes": 0 if (r or not moments_on_host) else c.optimizer_bytes,
              "working_bytes": c.working_bytes}
        if offload:
            kw["activations"] = {**c.activations, STAGE_INPUT: c.carry_bytes}
            kw["carry_bytes"] = 0
            if not remat:   # the residuals go with the input: out in the forward, back k ahead in the backward
                kw["activations"][STAGE_RESIDUALS] = c.intermediate_bytes
                kw["intermediate_bytes"] = 0
        out.append(dataclasses.replace(c, grad_bytes=c.grad_bytes, host_update_bytes=c.host_update_bytes, **kw))
    res_w = sum(c.param_bytes + c.optimizer_bytes for c, r in zip(costs, resident) if r)
    if res_w:
        extra["resident stages (weights + optimizer state)"] = res_w
    if not moments_on_host:
        dev_m = sum(c.optimizer_bytes for c, r in zip(costs, resident) if not r)
        if dev_m:
            extra["optimizer state of streamed stages"] = dev_m
    if offload:
        extra["carry"] = max(c.carry_bytes for c in costs)
    return out, extra


def evaluate_choice(costs: Sequence[LayerCost], link: Link, *, prefetch_depth: int,
                      resident: Sequence[bool] | None = None, offload_activations: bool = False,
                      optimizer_state_on_host: bool = True, training: bool = True, remat: bool = True) -> ScheduleChoice:
    """Predict peak device bytes and step time of one ``StreamingRuntime`` configuration.

    Args:
      costs: one :class:`LayerCost` per stage (e.g. ``Calibration.costs``): ``optimizer_bytes``
        is the stage's optimizer state (0 without an optimizer), ``forward_s`` / ``backward_factor``
        the measured compute (the backward's time excluding the recompute that ``remat`` adds).
      link: the measured :class:`Link` (GB/s).
      prefetch_depth: ``k`` (1..16).
      resident: per stage, kept in device memory (default: none).
      offload_activations: training: stage inputs (and with ``remat=False`` the saved residuals,
        ``intermediate_bytes``) through ``pinned_host``.
      optimizer_state_on_host: streamed stages' optimizer state in ``pinned_host``.
      training: a training step (forward + backward + fused update) or a forward.
      remat: whether the runtime recomputes each stage in its backward (``remat=True``: one more
        ``forward_s`` per stage) or keeps its residuals (``False``: ``intermediate_bytes`` per
        stage in device memory, or with ``offload_activations`` out in the forward and in during
        the backward over the link).

    Returns: a :class:`ScheduleChoice` (``budget_bytes`` ``None``).

    Raises: TypeError / ValueError naming the argument (``costs`` not LayerCosts, ``resident``
      of the wrong length, ``prefetch_depth`` out of range, a flag not a bool).
    """
    costs = _check_costs(costs)
    if not isinstance(link, Link):
        raise TypeError(f"link must be a Link, got {type(link).__name__}")
    k = as_prefetch_depth("prefetch_depth", prefetch_depth)
    resident = check_flags("resident", resident, len(costs))
    for name, v in (("offload_activations", offload_activations), ("optimizer_state_on_host",
                    optimizer_state_on_host), ("training", training), ("remat", remat)):
        check_bool(name, v)
    return _evaluate(costs, link, k, resident, bool(offload_activations and training), bool(optimizer_state_on_host),
                     bool(training), bool(remat))


def _evaluate(costs, link, k, resident, offload, moments_on_host, training, remat) -> ScheduleChoice:
    rewritten, extra = _rewrite(costs, resident, offload, moments_on_host, remat or not training)
    offloaded = ({STAGE_INPUT: "host"} if remat else {STAGE_INPUT: "host", STAGE_RESIDUALS: "host"}) \
        if offload else {}
    policy = OffloadPolicy(params="host", grads="host" if training else "device",
                           optimizer_state="host" if training else "device",
                           activations=offloaded, remat=remat and training, prefetch_depth=k)
    p = evaluate(policy, rewritten, link=link, training=training,
                 optimizer_mode="streamed" if training else None)
    return ScheduleChoice(prefetch_depth=k, resident=resident, offload_activations=offload,
                    optimizer_state_on_host=moments_on_host, remat=remat, training=training,
                    device_bytes=p.device_bytes + sum(extra.values()), step_s=p.step_s, floor_s=p.floor_s, plan=p,
                    extra_device_bytes=extra)


def _ranking(costs: list) -> list[int]:
    """A forward's stages in the order the chooser makes them resident: the weight bytes a call
    would not move, per byte held (ties: the later stage first)."""
    gain = [(c.param_bytes / (c.param_bytes + c.optimizer_bytes) if c.param_bytes + c.optimizer_bytes else 0.0, i)
            for i, c in enumerate(costs)]
    return [i for _, i in sorted(gain, key=lambda t: (-t[0], -t[1]))]


def _order(costs: list, training: bool) -> list[int]:
    """The stage order whose prefixes are tried as residency sets: in training the last stage
    first (the stages the backward needs first); in a forward :func:`_ranking` (docs/reference/planner.md, "The chooser")."""
    return list(reversed(range(len(costs)))) if training else _ranking(costs)


def _prefixes(order: list[int]):
    """Every prefix of ``order`` as a residency tuple (``L + 1`` of them, the empty set first)."""
    resident = [False] * len(order)
    yield tuple(resident)
    for i in order:
        resident[i] = True
        yield tuple(resident)


def choose_schedule(costs: Sequence[LayerCost], link: Link, budget_bytes: int, *, training: bool = True,
                    remat: bool = True, max_prefetch_depth: int = DEFAULT_MAX_PREFETCH_DEPTH,
                    allow_offload: bool = True, allow_device_optimizer_state: bool = True,
                    allow_no_remat: bool = False) -> ScheduleChoice:
    """The fastest predicted ``StreamingRuntime`` configuration whose predicted peak fits ``budget_bytes``.

    Prefetch depth 1 is a last resort: it is chosen only when no configuration with ``k >= 2``
    fits (docs/reference/planner.md, "The chooser").

    Args:
      costs, link, training: as for :func:`evaluate_choice`.
      remat: as for :func:`evaluate_choice`: the setting every candidate runs with, unless
        ``allow_no_remat`` adds ``remat=False``.
      budget_bytes: device memory in bytes (int > 0) for everything the runtime holds: weights,
        optimizer state, activations, temporaries.
      max_prefetch_depth: largest ``k`` tried (1..16; capped at the number of stages).
      allow_offload: try ``offload_activations=True`` (training).
      allow_device_optimizer_state: try the streamed stages' optimizer state in device memory.
      allow_no_remat: training: try ``remat=False`` too (each stage keeps its vjp residuals,
        ``intermediate_bytes``, instead of recomputing its forward), with the residuals in device
        memory or, with ``offload_activations``, in ``pinned_host`` beside the stage input
        (docs/reference/planner.md, "Remat or residuals"). Needs ``costs`` whose ``backward_factor`` excludes
        the recompute (``Calibration.costs`` does). Default ``False``: ``remat`` as given.

    Returns: the chosen :class:`ScheduleChoice` (``budget_bytes`` and ``candidates`` set). Everything
      fits: every stage resident. Nothing but the streaming window fits: no stage resident.

    Raises:
      InfeasibleBudgetError: no candidate's predicted peak fits; ``.min_budget_bytes`` is the
        smallest predicted peak (bytes) of the search space.
      TypeError / ValueError: bad arguments, naming them; a bad ``budget_bytes`` as
        :func:`~xla_swap.planning.units.check_budget_bytes` words it.
    """
    costs = _check_costs(costs)
    if not isinstance(link, Link):
        raise TypeError(f"link must be a Link, got {type(link).__name__}")
    budget_bytes = check_budget_bytes(budget_bytes)
    kmax = as_prefetch_depth("max_prefetch_depth", max_prefetch_depth)
    for name, v in (("training", training), ("remat", remat), ("allow_offload", allow_offload),
                    ("allow_device_optimizer_state", allow_device_optimizer_state), ("allow_no_remat", allow_no_remat)):
        check_bool(name, v)
    training, remat = bool(training), bool(remat)
    remats = (remat, False) if (training and allow_no_remat and remat) else (remat,)
    L = len(costs)
    has_state = training and any(c.optimizer_bytes for c in costs)
    best, smallest, n, by_remat = None, None, 0, {}
    depths = [k for k in range(2, min(kmax, L) + 1)] + [1]   # k = 1 only if no k >= 2 fits (docstring)
    for k in depths:
        if k == 1 and best is not None:
            break
        for offload in ((False, True) if (training and allow_offload) else (False,)):
            for on_host in ((True, False) if (has_state and allow_device_optimizer_state) else (True,)):
                for resident in _prefixes(_order(costs, training)):
                    for r in remats:
                        s = _evaluate(costs, link, k, resident, offload, on_host, training, r)
                        n += 1
                        if smallest is None or s.device_bytes < smallest.device_bytes:
                            smallest = s
                        if s.device_bytes > budget_bytes:
                            continue
                        by_remat[r] = min(by_remat.get(r, math.inf), s.step_s)
                        if best is None or _better(s, best):
                            best = s
    if best is None:
        pol = smallest.plan.policy
        raise InfeasibleBudgetError(budget_bytes, smallest.device_bytes, pol)
    best.budget_bytes, best.candidates, best.best_step_s_by_remat = budget_bytes, n, by_remat
    return best


def _better(a: ScheduleChoice, b: ScheduleChoice) -> bool:
    if a.step_s < b.step_s * (1 - REL_TIE):
        return True
    if a.step_s > b.step_s * (1 + REL_TIE):
        return False
    ka = (not a.remat, a.offload_activations, not a.optimizer_state_on_host, a.prefetch_depth, a.device_bytes)
    kb = (not b.remat, b.offload_activations, not b.optimizer_state_on_host, b.prefetch_depth, b.device_bytes)
    return ka < kb


class ChoiceCache(LRUCache):
    """Chosen schedules kept in memory, keyed by ``(stage signatures, input signature, budget bytes,
    training)`` (any hashables the caller derives; ``xla_swap.executors.streaming.calibrate`` uses the
    stages' parameter and input shapes and dtypes, the input's with the chooser's options), least
    recently used dropped beyond ``maxsize`` (:class:`~xla_swap.planning.cache.LRUCache`).

    Raises: ValueError: ``maxsize`` not an int >= 1.
    """

    @staticmethod
    def key(stage_signatures: Hashable, input_signature: Hashable, budget_bytes: int, training: bool) -> tuple:
        """The cache key; raises TypeError when a part is not hashable."""
        k = (stage_signatures, input_signature, int(budget_bytes), bool(training))
        hash(k)
        return k

    def get(self, key) -> ScheduleChoice | None:
        """The schedule cached under ``key`` (marked most recently used), or ``None``."""
        return super().get(key)

    def put(self, key, schedule: ScheduleChoice) -> None:
        """Cache ``schedule`` under ``key``. Raises TypeError: not a :class:`ScheduleChoice`."""
        if not isinstance(schedule, ScheduleChoice):
            raise TypeError(f"schedule must be a ScheduleChoice, got {type(schedule).__name__}")
        super().put(key, schedule)


#: The process-wide cache used by ``xla_swap.executors.streaming.calibrate.autotune`` and ``SwappedStack.autotune``.
CHOICES = ChoiceCache()
