"""Offload planner: choose an :class:`OffloadPolicy` for a layered model under a device-memory budget.

:func:`evaluate` predicts one policy's peak device bytes (:mod:`~xla_swap.planning.memory`) and step
time (:mod:`~xla_swap.planning.timing`); :func:`plan` searches the policy space
(:mod:`~xla_swap.planning.search`) for the fastest one that fits, or raises
:class:`InfeasibleBudgetError` with the exact minimum budget; :func:`min_feasible_bytes` gives that
minimum. The model, its terms and the order in which a shrinking budget moves things to the host
are in docs/reference/planner.md.

Bytes for sizes, seconds for times, GB/s (1e9 bytes/s) for link bandwidths. Pure Python: imports
neither torch, torch_xla nor jax. Invalid inputs raise ``ValueError`` / ``TypeError`` naming the
argument.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

from xla_swap.planning.costs import H200_PINNED, HOST_MEMORY_GBPS, LayerCost, Link, adam_state_bytes
from xla_swap.planning.memory import TARGETS, device_memory
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.planning.result import InfeasibleBudgetError, Plan
from xla_swap.planning.rows import OPTIMIZER_MODES, optimizer_modes_of, phase_rows, schedule_for
from xla_swap.planning.search import MAX_NAMED_ACTIVATIONS, complexity, fastest_fitting, search_space
from xla_swap.planning.timing import per_layer_times, phase_times, time_offloaded_optimizer, traffic_floor
from xla_swap.planning.units import GB, MAX_BYTES, GiB, check_budget_bytes

__all__ = [
    "GB", "GiB", "Link", "H200_PINNED", "LayerCost", "Plan", "InfeasibleBudgetError",
    "adam_state_bytes", "evaluate", "plan", "min_feasible_bytes", "TARGETS", "OPTIMIZER_MODES",
    "HOST_MEMORY_GBPS", "MAX_BYTES", "MAX_LAYERS", "MAX_NAMED_ACTIVATIONS",
]

#: Largest number of layers the model accepts (the search simulates every layer).
MAX_LAYERS = 10_000


def _resolve_layers(layers, num_layers) -> list[LayerCost]:
    if isinstance(layers, LayerCost):
        if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral) or not \
                1 <= num_layers <= MAX_LAYERS:
            raise ValueError(f"num_layers must be an int in 1..{MAX_LAYERS}, got {num_layers!r}")
        return [layers] * int(num_layers)
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise TypeError("layers must be a LayerCost or a non-empty sequence of LayerCost")
    for i, layer in enumerate(layers):
        if not isinstance(layer, LayerCost):
            raise TypeError(f"layers[{i}] must be a LayerCost, got {type(layer).__name__}")
    if len(layers) > MAX_LAYERS:
        raise ValueError(f"layers: at most {MAX_LAYERS} LayerCost, got {len(layers)}")
    if num_layers is not None and num_layers != len(layers):
        raise ValueError(f"num_layers={num_layers!r} does not match the {len(layers)} LayerCost given")
    return list(layers)


def _check_num_devices(num_devices) -> int:
    if isinstance(num_devices, bool) or not isinstance(num_devices, numbers.Integral) or num_devices < 1:
        raise ValueError(f"num_devices must be an int >= 1 (the devices the stack is sharded over), "
                         f"got {num_devices!r}")
    return int(num_devices)


def _per_device(layers: list[LayerCost], n: int) -> list[LayerCost]:
    """One device's share of each layer over ``n`` devices: weights, gradients, optimizer state, the
    weights an update writes back and the CPU update's bytes divided by ``n``, rounded up; the rest as given (docs/reference/planner.md,
    "Several devices")."""
    if n == 1:
        return layers
    shard = lambda b: -(-b // n)  # noqa: E731  (ceil: the largest shard)
    cache = {}
    for layer in layers:
        if id(layer) not in cache:
            cache[id(layer)] = dataclasses.replace(
                layer, param_bytes=shard(layer.param_bytes), grad_bytes=shard(layer.grad_bytes),
                optimizer_bytes=shard(layer.optimizer_bytes), host_update_bytes=shard(layer.host_update_bytes),
                update_bytes=shard(layer.update_bytes))
    return [cache[id(layer)] for layer in layers]


def _check_link(link) -> Link:
    if not isinstance(link, Link):
        raise TypeError(f"link must be a Link, got {type(link).__name__}")
    return link


def _check_training(training) -> bool:
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {training!r}")
    return training


def _check_target(target) -> str:
    if not isinstance(target, str) or target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(map(repr, TARGETS))}, got {target!r}")
    return target


def _check_optimizer_mode(optimizer_mode) -> str | None:
    if optimizer_mode is not None and (not isinstance(optimizer_mode, str) or optimizer_mode not in OPTIMIZER_MODES):
        raise ValueError(f"optimizer_mode must be None (the faster) or one of {', '.join(map(repr, OPTIMIZER_MODES))}, "
                         f"got {optimizer_mode!r}")
    return optimizer_mode


def _check_host_overlap(host_overlap) -> bool:
    if not isinstance(host_overlap, bool):
        raise ValueError(f"host_overlap must be a bool (True: the CPU update of a layer overlaps the backward of the "
                         f"layers before it, as in ZeRO-Offload), got {host_overlap!r}")
    return host_overlap


def _check_steady_state(steady_state) -> bool:
    if not isinstance(steady_state, bool):
        raise ValueError(f"steady_state must be a bool (True: a call of a loop, the cyclic schedule's steady state; "
                         f"False: a single, cold call), got {steady_state!r}")
    return steady_state


def _plan_offloaded(policy, layers, link, optimizer_mode, host_overlap, steady_state, **inputs) -> Plan:
    """The :class:`Plan` of a training policy with its optimizer state on the host: timed in both modes,
    the requested (or the faster) one reported, its memory from the schedule that mode timed."""
    timed = {m: time_offloaded_optimizer(policy, layers, link, m, host_overlap, steady_state)
             for m in ("streamed", "host")}
    mode = optimizer_mode or min(timed, key=lambda m: (timed[m]["step_s"], m != "streamed"))
    chosen = timed[mode]
    memory = device_memory(policy, layers, True, inputs["target"], chosen["schedule"])
    return Plan(policy=policy, device_bytes=memory.peak_bytes, host_bytes=sum(memory.host_components.values()),
                layer_transfer_s=chosen["layer_transfer_s"], layer_compute_s=chosen["layer_compute_s"],
                step_s=chosen["step_s"], floor_s=chosen["floor_s"], phase_s=chosen["phase_s"],
                device_components=memory.device_components, host_components=memory.host_components,
                peak_phase=memory.peak_phase, num_layers=len(layers), training=True, link=link,
                phase_layers=chosen["phase_layers"], optimizer_mode=mode,
                optimizer_mode_s={m: v["step_s"] for m, v in timed.items()},
                host_update_s=chosen["host_update_s"] if mode == "host" else 0.0, steady_state=steady_state,
                schedule=chosen["schedule"], **inputs)


def _build(policy, layers, training, link, budget=None, min_budget=None, target="accelerator",
           optimizer_mode=None, host_overlap=True, steady_state=True, num_devices=1) -> Plan:
    """The :class:`Plan` of one checked ``policy``: its memory and its time in ``optimizer_mode``, both
    read from one schedule of the call."""
    inputs = dict(budget_bytes=budget, min_budget_bytes=min_budget, target=target, num_devices=num_devices)
    if training and policy.optimizer_state == "host":
        return _plan_offloaded(policy, layers, link, optimizer_mode, host_overlap, steady_state, **inputs)
    schedule = schedule_for(policy, len(layers), training, "device", steady_state)
    memory = device_memory(policy, layers, training, target, schedule)
    phases = phase_rows(policy, layers, training, steady_state, schedule)
    phase_s = phase_times(phases, policy, link)
    transfer, compute = [0.0] * len(layers), [0.0] * len(layers)
    phase_layers = {}
    for name, rows in phases.items():
        merged = per_layer_times(rows, link)        # a layer may have two rows (its copy for the next call)
        for i, (c, x) in merged:
            transfer[i] += x
            compute[i] += c
        phase_layers[name] = tuple(merged)
    return Plan(policy=policy, device_bytes=memory.peak_bytes, host_bytes=sum(memory.host_components.values()),
                layer_transfer_s=tuple(transfer), layer_compute_s=tuple(compute), step_s=sum(phase_s.values()),
                floor_s=traffic_floor(phases, link), phase_s=phase_s, device_components=memory.device_components,
                host_components=memory.host_components, peak_phase=memory.peak_phase, num_layers=len(layers),
                training=training, link=link, phase_layers=phase_layers,
                optimizer_mode="device" if training else None,
                optimizer_mode_s={"device": sum(phase_s.values())} if training else {}, steady_state=steady_state,
                schedule=schedule, **inputs)


def evaluate(policy: OffloadPolicy, layers: LayerCost | Sequence[LayerCost], num_layers: int | None = None,
             link: Link = H200_PINNED, *, training: bool = True, target: str = "accelerator",
             optimizer_mode: str | None = None, host_overlap: bool = True, steady_state: bool = True,
             num_devices: int = 1) -> Plan:
    """Predict device bytes and step time of one ``policy`` (no budget, no search).

    Args:
      policy: the :class:`OffloadPolicy` to evaluate.
      layers: one :class:`LayerCost` repeated ``num_layers`` times, or one per layer.
      num_layers: number of layers (required with a single LayerCost).
      link: host link bandwidths (GB/s); default :data:`H200_PINNED` (docs/explanation/measured-facts.md).
      training: forward + backward + optimizer step (True) or forward only (False).
      target: the compiler the memory model describes, one of :data:`TARGETS`: ``"accelerator"``
        (default; XLA:GPU / XLA:TPU with host offloading) or ``"xla_cpu"`` (XLA:CPU strips the
        placement annotations, prefetches nothing and materialises per-layer slices;
        docs/reference/planner.md, "Target").  The time model is the same for both.
      optimizer_mode: ``None`` (default: with ``policy.optimizer_state == "host"`` the faster of
        ``"streamed"`` and ``"host"``), or one of :data:`OPTIMIZER_MODES`, which must match the
        policy's ``optimizer_state`` (``"device"`` for ``"device"``; ``"streamed"`` / ``"host"`` for
        ``"host"``).  Ignored in inference.  docs/reference/planner.md, "Optimizer modes".
      host_overlap: in the ``"host"`` mode, whether each layer's CPU update starts as soon as its
        gradient reached host memory, overlapping the backward of the layers before it (True,
        ZeRO-Offload; default) or only after the whole backward (False, FSDP2's
        ``optimizer.step()`` after ``loss.backward()``).
      steady_state: ``True`` (default): the time of one call in a loop of calls, the steady state of
        ``StreamingRuntime``'s cyclic schedule (``prefetch_next_call=True``): the call starts with its
        first ``k`` layers' weights on the device (``k+1`` in training), streamed or kept by the call
        before.  ``False``: a single, cold call (the first of a loop, or ``prefetch_next_call=False``):
        every weight it uses streams in during the call.
        docs/reference/planner.md, "Steady state".  The memory model is the same for both.
      num_devices: the devices the stack is sharded over, FSDP-style or tensor-parallel (default 1):
        each holds and moves ``1/n`` of every layer's weights, gradients and optimizer state; the
        other LayerCost fields (compute, activations) and ``link`` are per device as given, and so
        is every byte and time of the result (docs/reference/planner.md, "Several devices").

    Named activations of the layers that ``policy.activations`` does not mention are treated as
    ``"device"`` (saved on the device); in inference activation placements are ignored.

    Returns: a :class:`Plan` (``budget_bytes`` / ``min_budget_bytes`` are ``None``).
    Raises: TypeError / ValueError for invalid arguments, naming them; ``ValueError`` when
    ``policy.activations`` names an activation no layer has (as the scan helpers do when no
    ``offload_name`` tagged it), when ``optimizer_mode`` is not in :data:`OPTIMIZER_MODES` or does
    not match ``policy.optimizer_state``, or when ``host_overlap`` or ``steady_state`` is not a bool.
    """
    n_dev = _check_num_devices(num_devices)
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"policy must be an OffloadPolicy, got {type(policy).__name__}")
    layers = _per_device(_resolve_layers(layers, num_layers), n_dev)
    known = {n for layer in layers for n in layer.activations}
    unknown = sorted(set(policy.activations) - known)
    if unknown:
        raise ValueError(f"policy.activations names {unknown}, which no layer's LayerCost.activations has; "
                         f"known names: {sorted(known) or 'none'}")
    training = _check_training(training)
    mode = _check_optimizer_mode(optimizer_mode)
    overlap = _check_host_overlap(host_overlap)
    steady = _check_steady_state(steady_state)
    if training and mode is not None and not optimizer_modes_of(policy, mode):
        raise ValueError(f"optimizer_mode={mode!r} does not match policy.optimizer_state="
                         f"{policy.optimizer_state!r}: use {' or '.join(map(repr, optimizer_modes_of(policy, None)))}")
    return _build(policy, layers, training, _check_link(link), target=_check_target(target),
                  optimizer_mode=mode if training else None, host_overlap=overlap, steady_state=steady,
                  num_devices=n_dev)


def min_feasible_bytes(layers: LayerCost | Sequence[LayerCost], num_layers: int | None = None, *,
                       training: bool = True, max_prefetch_depth: int = 4, target: str = "accelerator",
                       num_devices: int = 1) -> int:
    """The smallest budget :func:`plan` accepts: the exact minimum, over its search space, of the
    predicted peak device bytes (``target`` and ``num_devices`` as in :func:`evaluate`; per
    device), or 1 when that minimum is 0 (layers of zero bytes; a budget is a positive int).
    ``plan(..., budget_bytes=min_feasible_bytes(...))`` with the same arguments succeeds.

    Raises: TypeError / ValueError for invalid arguments, naming them.
    """
    n_dev = _check_num_devices(num_devices)
    layers = _per_device(_resolve_layers(layers, num_layers), n_dev)
    space = search_space(layers, _check_training(training), max_prefetch_depth, _check_target(target))
    return max(1, min(peak for _, _, peak in space))


def plan(layers: LayerCost | Sequence[LayerCost], num_layers: int | None = None, budget_bytes: int | None = None,
         link: Link = H200_PINNED, *, training: bool = True, max_prefetch_depth: int = 4,
         target: str = "accelerator", optimizer_mode: str | None = None, host_overlap: bool = True,
         steady_state: bool = True, num_devices: int = 1) -> Plan:
    """Choose the policy with the lowest predicted step time whose predicted device bytes fit.

    Args:
      layers: one :class:`LayerCost` repeated ``num_layers`` times, or a sequence, one per layer.
      num_layers: number of layers (required with a single LayerCost; must match a sequence).
      budget_bytes: device-memory budget in bytes, an int > 0 (required); layers of zero bytes fit
        any (:func:`min_feasible_bytes` is then 1).
      link: host link bandwidths in GB/s; default :data:`H200_PINNED` (54/54/93 GB/s, docs/explanation/measured-facts.md).
      training: True for forward + backward + optimizer step, False for inference (forward only:
        no gradients, optimizer state or saved activations; the policy's activations are empty).
      max_prefetch_depth: largest ``prefetch_depth`` considered (1..16, default 4).
      target: the compiler the memory model describes (:data:`TARGETS`; see :func:`evaluate`).
      optimizer_mode: ``None`` (default): every policy; one with its optimizer state in host memory
        is timed in the faster of the ``"streamed"`` and ``"host"`` modes.  One of
        :data:`OPTIMIZER_MODES`: only the policies that allow it (``"device"``: state on the
        device; ``"streamed"`` / ``"host"``: state on the host), timed in that mode.  Ignored in
        inference.
      host_overlap: as in :func:`evaluate` (the ``"host"`` mode's overlap with the backward).
      steady_state: as in :func:`evaluate`: time a call of a loop (default) or a single, cold call.
      num_devices: as in :func:`evaluate` (default 1): the stack sharded over ``n`` devices; the
        budget is one device's memory and the Plan's bytes and times are per device.

    Returns: a :class:`Plan` (its ``optimizer_mode`` says how the optimizer step runs). Search,
    tie-breaking and the order in which shrinking budgets move components to the host:
    docs/reference/planner.md, "Search".

    Raises:
      InfeasibleBudgetError: no policy fits; ``.min_budget_bytes`` is the exact minimum (bytes),
        stated in the message in bytes and GiB.
      TypeError / ValueError: invalid arguments, naming them; a bad ``budget_bytes`` as
        :func:`~xla_swap.planning.units.check_budget_bytes` words it.
    """
    n_dev = _check_num_devices(num_devices)
    layers = _per_device(_resolve_layers(layers, num_layers), n_dev)
    training = _check_training(training)
    link = _check_link(link)
    target = _check_target(target)
    mode = _check_optimizer_mode(optimizer_mode) if training else _check_optimizer_mode(optimizer_mode) and None
    overlap = _check_host_overlap(host_overlap)
    steady = _check_steady_state(steady_state)
    budget = check_budget_bytes(budget_bytes)
    space = search_space(layers, training, max_prefetch_depth, target)
    if mode is not None:
        space = [c for c in space if optimizer_modes_of(c[1], mode)]
    _, min_policy, min_peak = min(space, key=lambda t: (t[2], complexity(t[1]), t[0]))
    feasible = [(index, policy, peak) for index, policy, peak in space if peak <= budget]
    if not feasible:
        raise InfeasibleBudgetError(budget, min_peak, min_policy)
    chosen, how = fastest_fitting(feasible, layers, training, link, target, mode, overlap, steady)
    return _build(chosen, layers, training, link, budget, max(1, min_peak), target, optimizer_mode=how,
                  host_overlap=overlap, steady_state=steady, num_devices=n_dev)
