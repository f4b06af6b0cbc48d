"""The rows the time model simulates, read from the runtime's schedule (docs/reference/planner.md, "Time model").

One :class:`~xla_swap.planning.prefetch.PrefetchSchedule` per call describes it: each of its steps
(a stage's forward or backward) becomes one :class:`Row`, whose inbound bytes are the weights the
schedule fetches for that stage in that pass (the prologue's and the steps' ``fetch`` events), and
its copies for the next call (``fetch_next``) become rows without compute at the tail. The memory
model reads the same object's live set (``max_live_stages``). The separate update pass of a
schedule with ``update_pass`` (``max_grad_norm`` / ``skip_nonfinite``, after any accumulated
micro-batches) is not timed: its steps get no rows (the time model does not model gradient
accumulation or clipping). Pure Python.
"""
from __future__ import annotations

from typing import NamedTuple

from xla_swap.planning.costs import LayerCost
from xla_swap.planning.memory import activation_placements
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.planning.prefetch import PrefetchSchedule, ScheduleStep

__all__ = ["OPTIMIZER_MODES", "Row", "optimizer_modes_of", "schedule_for", "fetched_for", "state_fetched_for",
           "phase_rows",
           "offloaded_rows", "recompute_s", "activation_traffic"]

#: Where and how the optimizer step runs (docs/reference/planner.md, "Optimizer modes"): ``"device"`` - the
#: state lives in device memory (``OffloadPolicy.optimizer_state="device"``); ``"streamed"`` - the
#: state lives in host memory and each layer's state crosses PCIe in the backward, the update runs
#: on the device right after the layer's backward (``StreamingRuntime(..., RuntimeConfig(
#: optimizer_state_on_host=True), optimizer=...)``); ``"host"`` - the gradients go to host memory and the update runs
#: on the CPU, bounded by host memory bandwidth (ZeRO-Offload / FSDP2 ``CPUOffloadPolicy``).
OPTIMIZER_MODES = ("device", "streamed", "host")


class Row(NamedTuple):
    """One row of the time model, in execution order (bytes, seconds).

    Attributes:
      stage: the layer it computes, or whose weights it copies.
      compute_s: seconds of device compute.
      in_bytes / out_bytes: bytes copied host -> device before it computes / device -> host after.
      step: the :class:`ScheduleStep` it times; ``None`` for a row that is not a schedule step (a copy
        for the next call, or a layer's update in the ``"device"`` optimizer mode's own phase).
    """

    stage: int
    compute_s: float
    in_bytes: int
    out_bytes: int
    step: ScheduleStep | None = None


def optimizer_modes_of(policy: OffloadPolicy, optimizer_mode: str | None) -> tuple[str, ...]:
    """Optimizer modes a training policy allows, restricted to ``optimizer_mode`` when given (possibly none)."""
    allowed = ("device",) if policy.optimizer_state == "device" else ("streamed", "host")
    if optimizer_mode is None:
        return allowed
    return (optimizer_mode,) if optimizer_mode in allowed else ()


def schedule_for(policy: OffloadPolicy, num_layers: int, training: bool, mode: str | None,
                 steady_state: bool) -> PrefetchSchedule:
    """The runtime's schedule of one call of ``policy``: every layer streamed when ``params="host"``
    (else every layer resident: nothing moves), cyclic in the steady state except in the ``"host"``
    optimizer mode, whose CPU update rewrites the weights after the backward; in the ``"streamed"``
    mode the backward fetches each layer's optimizer state beside its weights (``optimizer``)."""
    cyclic = steady_state and not (training and mode == "host")
    return PrefetchSchedule(num_layers, policy.prefetch_depth, training=training,
                            resident=(policy.params != "host",) * num_layers, prefetch_next_call=cyclic,
                            optimizer=training and mode == "streamed")


def state_fetched_for(schedule: PrefetchSchedule) -> set[int]:
    """The stages whose optimizer state ``schedule``'s backward brings to the device (its ``fetch_state``
    events; those of a separate update pass are not timed)."""
    return {j for s in schedule.timeline if s.pass_name == "backward" for j in s.fetch_state}


def fetched_for(schedule: PrefetchSchedule, pass_name: str) -> set[int]:
    """The stages whose weights ``schedule`` fetches for this call during ``pass_name`` (its fetch events)."""
    return set(schedule.fetched(pass_name))


def recompute_s(layer: LayerCost, policy: OffloadPolicy, remat_names: list) -> float:
    """Seconds the layer's backward spends recomputing: one forward under ``remat``, else its
    ``"remat"``-placed activations (at most one forward)."""
    if policy.remat:
        return layer.forward_time_s
    return min(layer.forward_time_s,
               sum(layer.recompute_time_s(n) for n in remat_names if n in layer.activations))


def activation_traffic(policy: OffloadPolicy, layers: list[LayerCost], training: bool) -> tuple[list, list]:
    """``(per-layer bytes of host-placed named activations, names placed "remat")``."""
    placed = activation_placements(policy, layers)
    host_names = [n for n, where in placed.items() if where == "host"] if training else []
    remat_names = [n for n, where in placed.items() if where == "remat"]
    return [sum(layer.activations.get(n, 0) for n in host_names) for layer in layers], remat_names


def _steps(schedule: PrefetchSchedule, pass_name: str):
    """``(step, weights fetched for its stage in this pass)`` for the steps of ``pass_name``, in order."""
    fetched = fetched_for(schedule, pass_name)
    return [(s, s.stage in fetched) for s in schedule.steps if s.pass_name == pass_name]


def _next_call_rows(schedule: PrefetchSchedule, layers: list[LayerCost]) -> list[Row]:
    return [Row(j, 0.0, layers[j].param_bytes, 0) for j in schedule.next_call_fetches]


def _forward_rows(schedule: PrefetchSchedule, layers: list[LayerCost], activation_bytes: list) -> list[Row]:
    return [Row(s.stage, layers[s.stage].forward_time_s, layers[s.stage].param_bytes if fetched else 0,
                activation_bytes[s.stage], s) for s, fetched in _steps(schedule, "forward")]


def phase_rows(policy: OffloadPolicy, layers: list[LayerCost], training: bool, steady_state: bool = True,
               schedule: PrefetchSchedule | None = None) -> dict[str, list[Row]]:
    """``{phase: [Row]}`` in execution order, optimizer state on the device.

    ``schedule``: the call's schedule (default :func:`schedule_for` in the ``"device"`` mode). The
    forward and backward rows are its steps; the optimizer phase runs in the backward's order; the
    call's last phase ends with the copies for the next call.
    """
    schedule = schedule or schedule_for(policy, len(layers), training, "device", steady_state)
    params_on_host = policy.params == "host"
    grads_on_host, state_on_host = policy.grads == "host", policy.optimizer_state == "host"
    activation_bytes, remat_names = activation_traffic(policy, layers, training)
    forward = _forward_rows(schedule, layers, activation_bytes)
    if not training:
        return {"forward": forward + _next_call_rows(schedule, layers)}
    backward, optimizer = [], []
    for s, fetched in _steps(schedule, "backward"):   # the last k stay from the forward
        layer = layers[s.stage]
        backward.append(Row(s.stage, layer.backward_time_s + recompute_s(layer, policy, remat_names),
                            (layer.param_bytes if fetched else 0) + activation_bytes[s.stage],
                            layer.grad_bytes if grads_on_host else 0, s))
    for i in reversed(range(len(layers))):   # the backward's order: it ends with the layers the forward starts with
        layer = layers[i]
        in_bytes = ((layer.param_bytes if params_on_host else 0) + (layer.grad_bytes if grads_on_host else 0)
                    + (layer.optimizer_bytes if state_on_host else 0))
        out_bytes = (layer.update_bytes if params_on_host else 0) + (layer.optimizer_bytes if state_on_host else 0)
        optimizer.append(Row(i, layer.optimizer_s, in_bytes, out_bytes))
    return {"forward": forward, "backward": backward, "optimizer": optimizer + _next_call_rows(schedule, layers)}


def offloaded_rows(policy: OffloadPolicy, layers: list[LayerCost], mode: str, steady_state: bool,
                   schedule: PrefetchSchedule | None = None) -> list[Row]:
    """The rows of a training step whose optimizer state lives in host memory: the forward's and the
    backward's steps of ``schedule`` (default :func:`schedule_for` in ``mode``; in ``"streamed"`` a
    backward step carries its fused update, and its layer's moments in where the schedule fetches
    them: ``fetch_state``), then the copies for the next step."""
    schedule = schedule or schedule_for(policy, len(layers), True, mode, steady_state)
    grads_on_host = policy.grads == "host"
    activation_bytes, remat_names = activation_traffic(policy, layers, True)
    rows = _forward_rows(schedule, layers, activation_bytes)
    state_in = state_fetched_for(schedule)
    for s, fetched in _steps(schedule, "backward"):   # the last k stay across the turn
        layer = layers[s.stage]
        compute = layer.backward_time_s + recompute_s(layer, policy, remat_names)
        weights_in = layer.param_bytes if fetched else 0
        if mode == "streamed":   # moments in; new (trainable) weights + moments out; the gradient stays on the device
            rows.append(Row(s.stage, compute + layer.optimizer_s, weights_in + activation_bytes[s.stage]
                            + (layer.optimizer_bytes if s.stage in state_in else 0),
                            layer.update_bytes + layer.optimizer_bytes, s))
        else:                    # the gradient goes to host memory; the update runs on the CPU
            rows.append(Row(s.stage, compute, weights_in + activation_bytes[s.stage],
                            layer.grad_bytes if grads_on_host else 0, s))
    return rows + _next_call_rows(schedule, layers)
