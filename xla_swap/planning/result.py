"""What the planner returns: a :class:`Plan` (a policy with its predicted bytes and seconds), or
:class:`InfeasibleBudgetError` when no policy fits. Pure Python.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from xla_swap.planning.costs import Link
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.planning.prefetch import PrefetchSchedule
from xla_swap.planning.units import GiB, gib

__all__ = ["InfeasibleBudgetError", "Plan"]


class InfeasibleBudgetError(ValueError):
    """No policy fits the device-memory budget.

    Attributes:
      budget_bytes: the budget asked for, bytes.
      min_budget_bytes: the exact minimum over all policies of the predicted peak device bytes;
        ``plan(..., budget_bytes=min_budget_bytes)`` succeeds.
      min_policy: a policy reaching that minimum.
    """

    def __init__(self, budget_bytes: int, min_budget_bytes: int, min_policy: OffloadPolicy):
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.min_policy = min_policy
        super().__init__(
            f"device budget {budget_bytes} bytes ({gib(budget_bytes)}) is infeasible: the minimum feasible "
            f"budget is {min_budget_bytes} bytes ({gib(min_budget_bytes)}), reached by {min_policy}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A policy with its predictions (bytes, seconds).

    Attributes:
      policy: the chosen :class:`OffloadPolicy`.
      device_bytes: predicted peak device bytes of one device (memory model of
        docs/reference/planner.md); with ``num_devices > 1`` every byte count of a Plan is per device.
      host_bytes: bytes kept in host memory (one device's share).
      layer_transfer_s: per layer, transfer seconds summed over phases (``Link.transfer_s``).
      layer_compute_s: per layer, compute seconds summed over phases (incl. recompute, update).
      step_s: predicted step time, seconds.
      floor_s: ``max(total compute, total in/h2d, total out/d2h, total/max(h2d, d2h, both))``, seconds
        (and, in the ``"host"`` optimizer mode, the CPU update's total).
      phase_s: ``{phase: seconds}`` (``forward``; ``backward``, ``optimizer`` when training).
      device_components / host_components: ``{component: bytes}`` (device: at the peak phase).
      peak_phase: which phase sets ``device_bytes``.
      budget_bytes: the budget planned for (``None`` from :func:`evaluate`).
      min_budget_bytes: minimum feasible budget over the search space, as :func:`min_feasible_bytes`
        gives it (at least 1; ``None`` from evaluate).
      num_layers, training, link, target: the inputs (``target``: see :func:`evaluate`).
      phase_layers: per phase, ``((layer, (compute_s, transfer_s)), ...)`` in layer order (a layer's
        copy streamed for the next call, in the steady state, counted with its row); in the
        ``"host"`` optimizer mode also ``"host update"``: ``(layer, (CPU update seconds, 0.0))``.
      optimizer_mode: how the optimizer step runs, one of :data:`OPTIMIZER_MODES` (``None`` in
        inference): ``"device"`` when ``policy.optimizer_state == "device"``, else the faster (or
        the requested) of ``"streamed"`` and ``"host"``.
      optimizer_mode_s: ``{mode: predicted step seconds}`` for every mode the policy's placement
        allows (``{"device": ...}``, or ``{"streamed": ..., "host": ...}``); empty in inference.
      host_update_s: total seconds of CPU optimizer update, ``sum(host_update_bytes) /
        host_memory_gbps`` (0 unless ``optimizer_mode == "host"``).
      num_devices: the devices the stack is sharded over (docs/reference/planner.md, "Several devices").
      schedule: the :class:`~xla_swap.planning.prefetch.PrefetchSchedule` of one call whose steps the
        time model timed and whose live set the memory model counted (``None`` for a Plan built by hand).
      steady_state: whether ``step_s`` / ``floor_s`` / the per-layer times describe a call of a loop
        (the cyclic schedule's steady state, the default) or a single, cold call (see :func:`evaluate`).
    """

    policy: OffloadPolicy
    device_bytes: int
    host_bytes: int
    layer_transfer_s: tuple
    layer_compute_s: tuple
    step_s: float
    floor_s: float
    phase_s: Mapping[str, float]
    device_components: Mapping[str, int]
    host_components: Mapping[str, int]
    peak_phase: str
    num_layers: int
    training: bool
    link: Link
    phase_layers: Mapping[str, tuple] = dataclasses.field(repr=False, default_factory=dict)
    budget_bytes: int | None = None
    min_budget_bytes: int | None = None
    target: str = "accelerator"
    optimizer_mode: str | None = None
    optimizer_mode_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    host_update_s: float = 0.0
    steady_state: bool = True
    num_devices: int = 1
    schedule: PrefetchSchedule | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def slowdown(self) -> float:
        """``step_s / floor_s`` (1.0 when the floor is 0)."""
        return self.step_s / self.floor_s if self.floor_s else 1.0

    def explain(self) -> str:
        """A printable table: per component device / host bytes, per layer transfer / compute
        seconds (per phase), predicted step time against the floor."""
        policy = self.policy
        lines = [f"OffloadPolicy: params={policy.params} grads={policy.grads} optimizer_state={policy.optimizer_state} "
                 f"activations={dict(policy.activations)} remat={policy.remat} prefetch_depth={policy.prefetch_depth}",
                 f"mode: {'training' if self.training else 'inference'}, {self.num_layers} layers, "
                 + (f"{self.num_devices} devices (bytes and times per device), " if self.num_devices != 1 else "")
                 + "memory model "
                 f"for {self.target}, link "
                 f"h2d {self.link.h2d_gbps:g} / d2h {self.link.d2h_gbps:g} / both {self.link.both_gbps:g} GB/s"
                 + (f", optimizer mode {self.optimizer_mode}" if self.optimizer_mode else "")
                 + (", times of a call in a loop (steady state)" if self.steady_state
                    else ", times of a single cold call"),
                 "",
                 f"{'component':<34}{'device bytes':>16}{'device GiB':>12}{'host bytes':>16}{'host GiB':>12}"]
        names = list(dict.fromkeys([*self.device_components, *self.host_components]))
        for n in names:
            d, h = self.device_components.get(n, 0), self.host_components.get(n, 0)
            lines.append(f"{n:<34}{d:>16}{d / GiB:>12.3f}{h:>16}{h / GiB:>12.3f}")
        lines.append(f"{'total (peak: ' + self.peak_phase + ')':<34}{self.device_bytes:>16}"
                     f"{self.device_bytes / GiB:>12.3f}{self.host_bytes:>16}{self.host_bytes / GiB:>12.3f}")
        if self.budget_bytes is not None:
            lines.append(f"budget {self.budget_bytes} bytes ({gib(self.budget_bytes)}); minimum feasible "
                         f"{self.min_budget_bytes} bytes ({gib(self.min_budget_bytes)})")
        lines.append("")
        phases = list(self.phase_layers)
        hdr = f"{'layer':>5}{'transfer s':>12}{'compute s':>12}"
        for phase in phases:
            hdr += f"{phase[:3] + ' x s':>12}{phase[:3] + ' c s':>12}"
        lines.append(hdr)
        per_phase = {phase: {i: v for i, v in rows} for phase, rows in self.phase_layers.items()}
        for i in range(self.num_layers):
            row = f"{i:>5}{self.layer_transfer_s[i]:>12.4f}{self.layer_compute_s[i]:>12.4f}"
            for phase in phases:
                c, x = per_phase[phase][i]
                row += f"{x:>12.4f}{c:>12.4f}"
            lines.append(row)
        lines.append("")
        lines.append("phases: " + ", ".join(f"{k} {v:.4f} s" for k, v in self.phase_s.items()))
        if self.optimizer_mode is not None:
            modes = ", ".join(f"{m} {t:.4f} s" for m, t in self.optimizer_mode_s.items())
            lines.append(f"optimizer mode: {self.optimizer_mode} (predicted step per mode: {modes}; host memory "
                         f"{self.link.host_memory_gbps:g} GB/s, host update {self.host_update_s:.4f} s)")
        lines.append(f"predicted step {self.step_s:.4f} s / floor {self.floor_s:.4f} s = {self.slowdown:.3f}x")
        return "\n".join(lines)
