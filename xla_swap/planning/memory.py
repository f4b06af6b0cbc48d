"""The planner's memory model: the peak device bytes of a policy (docs/reference/planner.md, "Memory model").

The streamed weights' window is the live set of the runtime's schedule
(:attr:`~xla_swap.planning.prefetch.PrefetchSchedule.max_live_stages`). Pure Python.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

from xla_swap.planning.costs import LayerCost
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.planning.prefetch import PrefetchSchedule

__all__ = ["TARGETS", "DeviceMemory", "device_memory", "activation_placements"]

#: Compilers the memory model describes (docs/reference/planner.md, "Target"): ``"accelerator"`` - XLA:GPU /
#: XLA:TPU, whose host offloader turns placement annotations into copies (the default) - and
#: ``"xla_cpu"`` - XLA:CPU, which strips the annotations and materialises per-layer slices.
TARGETS = ("accelerator", "xla_cpu")


class DeviceMemory(NamedTuple):
    """The memory model's answer for one policy (bytes of one device).

    Attributes:
      peak_bytes: predicted peak device bytes.
      peak_phase: ``"forward/backward"`` or ``"optimizer"``: the phase that sets the peak.
      device_components: ``{component: bytes}`` on the device at the peak phase.
      host_components: ``{component: bytes}`` kept in host memory.
    """

    peak_bytes: int
    peak_phase: str
    device_components: dict
    host_components: dict


def _largest_sum(values: Iterable[int], n: int) -> int:
    """Sum of the ``n`` largest values."""
    return sum(sorted(values, reverse=True)[:n])


def activation_placements(policy: OffloadPolicy, layers: list[LayerCost], target: str = "accelerator") -> dict[str, str]:
    """``{name: "device" | "host" | "remat"}`` for every named activation of ``layers`` and ``policy``.

    Names the policy does not mention are saved on the device. On ``"xla_cpu"`` a ``"host"``
    placement keeps the device copy (its annotations are stripped).
    """
    names = sorted({n for layer in layers for n in layer.activations} | set(policy.activations))
    out = {n: policy.activations.get(n, "device") for n in names}
    if target == "xla_cpu":
        out = {n: "device" if where == "host" else where for n, where in out.items()}
    return out


def _saved_for_backward(policy: OffloadPolicy, layers: list[LayerCost], placed: dict, window: int,
                        device: dict, host: dict) -> None:
    """Add the training terms (gradients, optimizer state, saved activations, recompute) to ``device`` / ``host``."""
    grads_on_host, state_on_host = policy.grads == "host", policy.optimizer_state == "host"
    grad_bytes = [layer.grad_bytes for layer in layers]
    optimizer_bytes = [layer.optimizer_bytes for layer in layers]
    # host-placed: the in-flight gradient of one layer; none on XLA:CPU (window 0, nothing in flight)
    device["grads"] = (max(grad_bytes) if window else 0) if grads_on_host else sum(grad_bytes)
    device["optimizer_state"] = 0 if state_on_host else sum(optimizer_bytes)
    host["grads"] = sum(grad_bytes) if grads_on_host else 0
    host["optimizer_state"] = sum(optimizer_bytes) if state_on_host else 0
    for name, where in placed.items():
        per_layer = [layer.activations.get(name, 0) for layer in layers]
        device[f"activation {name}"] = {"device": sum(per_layer), "host": _largest_sum(per_layer, max(window, 1)),
                                        "remat": 0}[where]
        host[f"activation {name}"] = sum(per_layer) if where == "host" else 0
    device["intermediates"] = 0 if policy.remat else sum(layer.intermediate_bytes for layer in layers)
    device["saved layer inputs"] = sum(layer.carry_bytes for layer in layers)
    device["recompute"] = max((layer.intermediate_bytes if policy.remat else 0)
                              + sum(b for n, b in layer.activations.items() if placed[n] == "remat")
                              for layer in layers)


def _operand_copies(policy: OffloadPolicy, layers: list[LayerCost], placed: dict, training: bool) -> int:
    """XLA:CPU's dense copies of one layer's sliced operands (docs/reference/planner.md, "Target")."""
    def one(layer):
        saved = (layer.carry_bytes + (0 if policy.remat else layer.intermediate_bytes)
                 + sum(b for n, b in layer.activations.items() if placed[n] == "device")) if training else 0
        return max(layer.param_bytes, layer.grad_bytes if training else 0) + saved
    return max(one(layer) for layer in layers)


def _optimizer_phase(policy: OffloadPolicy, layers: list[LayerCost], window: int) -> dict:
    """``{component: bytes}`` on the device during the optimizer step: what stays, and the streamed window."""
    params_on_host = policy.params == "host"
    grads_on_host, state_on_host = policy.grads == "host", policy.optimizer_state == "host"
    streamed = [(layer.param_bytes if params_on_host else 0) + (layer.grad_bytes if grads_on_host else 0)
                + (layer.optimizer_bytes if state_on_host else 0) for layer in layers]
    return {"params": 0 if params_on_host else sum(layer.param_bytes for layer in layers),
            "grads": 0 if grads_on_host else sum(layer.grad_bytes for layer in layers),
            "optimizer_state": 0 if state_on_host else sum(layer.optimizer_bytes for layer in layers),
            "optimizer stream window": _largest_sum(streamed, max(window, 1))}


def _window(policy: OffloadPolicy, num_layers: int, training: bool, schedule: PrefetchSchedule | None) -> int:
    """Layers in the streaming window: the live set of the call's schedule (``min(k+1, L)``, a separate
    update pass's steps included). With every weight resident the window of host-placed activations
    is that of the schedule that streams them all."""
    if schedule is None or policy.params != "host":
        schedule = PrefetchSchedule(num_layers, policy.prefetch_depth, training=training)
    return schedule.max_live_stages


def device_memory(policy: OffloadPolicy, layers: list[LayerCost], training: bool,
                  target: str = "accelerator", schedule: PrefetchSchedule | None = None) -> DeviceMemory:
    """Peak device bytes of ``policy`` over ``layers`` (one :class:`LayerCost` per layer, already checked).

    Args:
      policy: the placement.
      layers: one cost per layer, of one device.
      training: forward + backward + optimizer (True) or forward only.
      target: one of :data:`TARGETS`.
      schedule: the call's :class:`PrefetchSchedule` whose live set is the window (the one the time
        model times, :func:`xla_swap.planning.rows.schedule_for`); default: built here.

    Returns: a :class:`DeviceMemory`; the terms are those of docs/reference/planner.md, "Memory model".
    """
    cpu = target == "xla_cpu"
    # XLA:CPU prefetches nothing (0: only the layer being computed, counted in its operand copies)
    window = 0 if cpu else _window(policy, len(layers), training, schedule)
    params_on_host = policy.params == "host"
    param_bytes = [layer.param_bytes for layer in layers]
    device = {"params": _largest_sum(param_bytes, window) if params_on_host else sum(param_bytes)}
    host = {"params": sum(param_bytes) if params_on_host else 0}
    placed = activation_placements(policy, layers, target)
    if training:
        _saved_for_backward(policy, layers, placed, window, device, host)
    if cpu:
        device["operand copies"] = _operand_copies(policy, layers, placed, training)
    device["working set"] = max(layer.working_bytes for layer in layers)
    device["carry"] = max(layer.carry_bytes for layer in layers)
    peak = DeviceMemory(sum(device.values()), "forward/backward", device, host)
    if training:
        optimizer_phase = _optimizer_phase(policy, layers, window)
        if sum(optimizer_phase.values()) > peak.peak_bytes:
            peak = DeviceMemory(sum(optimizer_phase.values()), "optimizer", optimizer_phase, host)
    return peak
