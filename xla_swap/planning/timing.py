"""The planner's time model: a step's rows (:mod:`~xla_swap.planning.rows`, read from the runtime's
schedule) timed on one compute stream and two copy queues (docs/reference/planner.md, "Time model", "Steady
state", "Optimizer modes"). Pure Python.
"""
from __future__ import annotations

from xla_swap.planning.costs import LayerCost, Link
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.planning.prefetch import PrefetchSchedule
from xla_swap.planning.rows import (activation_traffic, fetched_for, offloaded_rows, recompute_s, schedule_for,
                                   state_fetched_for)
from xla_swap.planning.units import GB

__all__ = ["simulate_phase", "phase_times", "link_floor_s", "traffic_floor", "shared_rates", "simulate_shared_link", "per_layer_times",
           "time_offloaded_optimizer", "offloaded_floor"]

def simulate_phase(rows: list[tuple[float, int, int]], k: int, link: Link) -> float:
    """Seconds of one phase: ``rows = [(compute_s, in_bytes, out_bytes)]`` in execution order.

    One compute stream, one H2D and one D2H copy queue. In-copy j waits for the previous in-copy
    and for the buffer of layer j-k-1; compute j waits for compute j-1, in-copy j and out-copy j-2;
    out-copy j waits for compute j and out-copy j-1. Both directions in one phase share the
    both-at-once bandwidth in proportion to their bytes.
    """
    total_in, total_out = sum(r[1] for r in rows), sum(r[2] for r in rows)
    bw_in, bw_out = link.h2d_gbps * GB, link.d2h_gbps * GB
    if total_in and total_out:
        both = link.both_gbps * GB
        bw_in = min(bw_in, both * total_in / (total_in + total_out))
        bw_out = min(bw_out, both * total_out / (total_in + total_out))
    n = len(rows)
    in_end, compute_end, out_end = [0.0] * n, [0.0] * n, [0.0] * n
    for j, (compute_s, in_bytes, out_bytes) in enumerate(rows):
        start = max(in_end[j - 1] if j else 0.0, compute_end[j - k - 1] if j - k - 1 >= 0 else 0.0)
        in_end[j] = start + (in_bytes / bw_in if in_bytes else 0.0)
        start = max(compute_end[j - 1] if j else 0.0, in_end[j], out_end[j - 2] if j >= 2 else 0.0)
        compute_end[j] = start + compute_s
        out_end[j] = max(out_end[j - 1] if j else 0.0, compute_end[j]) + (out_bytes / bw_out if out_bytes else 0.0)
    return max(compute_end[-1], out_end[-1])


def phase_times(phases: dict, policy: OffloadPolicy, link: Link) -> dict[str, float]:
    """``{phase: seconds}`` of ``phases`` (:func:`~xla_swap.planning.rows.phase_rows`), each by :func:`simulate_phase`."""
    return {name: simulate_phase(_events(rows), policy.prefetch_depth, link) for name, rows in phases.items()}


def _events(rows) -> list[tuple[float, int, int]]:
    """``[(compute_s, in_bytes, out_bytes)]`` of ``rows``, what the simulators take."""
    return [(r.compute_s, r.in_bytes, r.out_bytes) for r in rows]


def link_floor_s(link: Link, in_bytes: float, out_bytes: float) -> float:
    """Least seconds any schedule needs to move ``in_bytes`` host -> device and ``out_bytes`` back:
    ``max(in / h2d, out / d2h, (in + out) / max(h2d, d2h, both))``.

    The link never moves more than ``max(h2d, d2h, both)`` bytes/s in all (one direction alone, or
    both together), so this bounds the simulators even for a link whose ``both_gbps`` is below a
    single direction's bandwidth; otherwise it equals ``link.transfer_s(in, out)``.
    """
    fastest = max(link.h2d_gbps, link.d2h_gbps, link.both_gbps) * GB
    return max(in_bytes / (link.h2d_gbps * GB), out_bytes / (link.d2h_gbps * GB), (in_bytes + out_bytes) / fastest)


def traffic_floor(phases: dict, link: Link) -> float:
    """``max(total compute, link_floor_s(total in, total out))`` of the phases' rows, seconds."""
    compute = sum(r[1] for rows in phases.values() for r in rows)
    total_in = sum(r[2] for rows in phases.values() for r in rows)
    total_out = sum(r[3] for rows in phases.values() for r in rows)
    return max(compute, link_floor_s(link, total_in, total_out))


def shared_rates(link: Link, in_running: bool, out_running: bool) -> tuple[float, float]:
    """(H2D, D2H) bytes/s while an in-copy / out-copy runs: alone, a direction gets its own
    bandwidth; together they split ``both_gbps`` in proportion to their own bandwidths (each capped
    at it, the other taking what is left)."""
    h2d, d2h, both = link.h2d_gbps * GB, link.d2h_gbps * GB, link.both_gbps * GB
    if not (in_running and out_running):
        return (h2d if in_running else 0.0), (d2h if out_running else 0.0)
    rate_in = min(h2d, both * h2d / (h2d + d2h))
    rate_out = min(d2h, both - rate_in)
    return min(h2d, both - rate_out), rate_out


def simulate_shared_link(rows: list[tuple[float, int, int]], k: int, link: Link) -> tuple[list[float], list[float]]:
    """:func:`simulate_phase`'s schedule over ``rows = [(compute_s, in_bytes, out_bytes)]``, with the link
    shared *as the copies overlap*: an event simulation in which a copy moves at its own direction's
    full bandwidth while it runs alone and at its share of ``both_gbps`` while copies run in both
    directions (:func:`shared_rates`).

    Dependencies as in :func:`simulate_phase`. Returns ``(compute end times, out-copy end times)``,
    seconds from the start, one per row.
    """
    n = len(rows)
    in_end: list = [None] * n
    compute_end: list = [None] * n
    out_end: list = [None] * n
    t = 0.0
    done = lambda ends, j: j < 0 or (ends[j] is not None and ends[j] <= t)  # noqa: E731
    next_in = next_compute = next_out = 0      # the next row whose in-copy / compute / out-copy starts
    copy_in = copy_out = None                  # the running copy: [row, remaining bytes]
    while True:
        started = True
        while started:                         # start whatever is ready at time t
            started = False
            if copy_in is None and next_in < n and done(in_end, next_in - 1) and done(compute_end, next_in - k - 1):
                copy_in = _start_copy(rows[next_in][1], next_in, in_end, t)
                next_in += 1
                started = True
            if next_compute < n and done(compute_end, next_compute - 1) and done(in_end, next_compute) \
                    and done(out_end, next_compute - 2):
                compute_end[next_compute] = t + rows[next_compute][0]
                next_compute += 1
                started = True
            if copy_out is None and next_out < n and done(compute_end, next_out) and done(out_end, next_out - 1):
                copy_out = _start_copy(rows[next_out][2], next_out, out_end, t)
                next_out += 1
                started = True
        if next_out == n and copy_out is None and next_compute == n:
            return compute_end, out_end
        t = _advance(t, link, copy_in, copy_out, compute_end, in_end, out_end)
        if copy_in is not None and in_end[copy_in[0]] is not None:
            copy_in = None
        if copy_out is not None and out_end[copy_out[0]] is not None:
            copy_out = None


def _start_copy(nbytes, row: int, ends: list, t: float):
    """Row ``row``'s copy of ``nbytes`` starts at ``t``: ``[row, bytes left]``, or ``None`` with the
    copy's end set to ``t`` when nothing moves."""
    if nbytes:
        return [row, float(nbytes)]
    ends[row] = t
    return None


def _advance(t: float, link: Link, copy_in, copy_out, compute_end: list, in_end: list, out_end: list) -> float:
    """Move the running copies to the next event after ``t`` (a compute or a copy ending); returns its time.

    A copy that ends at that event gets its end time in ``in_end`` / ``out_end``; the others lose
    the bytes moved meanwhile.
    """
    rate_in, rate_out = shared_rates(link, copy_in is not None, copy_out is not None)
    events = [e for e in compute_end if e is not None and e > t]
    if copy_in is not None:
        events.append(t + copy_in[1] / rate_in)
    if copy_out is not None:
        events.append(t + copy_out[1] / rate_out)
    t_next = min(events)
    for copy, rate, ends in ((copy_in, rate_in, in_end), (copy_out, rate_out, out_end)):
        if copy is not None:
            if t + copy[1] / rate <= t_next:   # the same expression as its event: it ends now
                ends[copy[0]] = t_next
            else:
                copy[1] = max(copy[1] - rate * (t_next - t), 0.0)
    return t_next


def per_layer_times(rows, link: Link) -> list:
    """``[(layer, (compute_s, transfer_s))]`` by layer, a layer's rows merged (its copy for the next call with its row)."""
    per_layer: dict[int, list] = {}
    for i, compute_s, in_bytes, out_bytes, _ in rows:
        acc = per_layer.setdefault(i, [0.0, 0, 0])
        acc[0] += compute_s
        acc[1] += in_bytes
        acc[2] += out_bytes
    return [(i, (c, link.transfer_s(b_in, b_out))) for i, (c, b_in, b_out) in sorted(per_layer.items())]


def time_offloaded_optimizer(policy: OffloadPolicy, layers: list[LayerCost], link: Link, mode: str,
                             host_overlap: bool = True, steady_state: bool = True,
                             schedule: PrefetchSchedule | None = None) -> dict:
    """Time a training step whose optimizer state lives in host memory, in ``mode`` ``"streamed"`` or
    ``"host"`` (docs/reference/planner.md, "Optimizer modes"), the whole step as one stream on a shared link.

    Returns a dict: ``step_s``, ``floor_s``, ``phase_s`` (forward, backward, optimizer: the exposed
    part of the host update), ``phase_layers``, ``layer_transfer_s``, ``layer_compute_s`` (device
    only), ``host_update_s`` (seconds of CPU update, summed), ``schedule`` (the
    :class:`PrefetchSchedule` timed: ``schedule``, default :func:`~xla_swap.planning.rows.schedule_for`).
    """
    schedule = schedule or schedule_for(policy, len(layers), True, mode, steady_state)
    streamed = mode == "streamed"
    num_layers = len(layers)
    rows = offloaded_rows(policy, layers, mode, steady_state, schedule)
    compute_end, out_end = simulate_shared_link(_events(rows), policy.prefetch_depth, link)
    device_end = max(compute_end[-1], out_end[-1])
    host_s = [0.0 if streamed else link.host_update_s(layer.host_update_bytes) for layer in layers]
    end = device_end
    if not streamed:
        update_end = 0.0 if host_overlap else device_end
        for j in range(num_layers, 2 * num_layers):          # backward rows, in execution order
            update_end = max(update_end, out_end[j]) + host_s[rows[j][0]]
        end = max(device_end, update_end)
    transfer, compute = [0.0] * num_layers, [0.0] * num_layers
    phase_layers = {"forward": per_layer_times(rows[:num_layers], link),
                    "backward": per_layer_times(rows[num_layers:], link)}
    for i, (c, x) in phase_layers["forward"] + phase_layers["backward"]:
        transfer[i] += x
        compute[i] += c
    if not streamed:
        phase_layers["host update"] = [(i, (host_s[i], 0.0)) for i in range(num_layers)]
    total_in, total_out = sum(r[2] for r in rows), sum(r[3] for r in rows)
    floor = max(sum(r[1] for r in rows), link_floor_s(link, total_in, total_out), sum(host_s))
    forward_s = compute_end[num_layers - 1]
    return {"step_s": end, "floor_s": floor,
            "phase_s": {"forward": forward_s, "backward": device_end - forward_s, "optimizer": end - device_end},
            "phase_layers": {name: tuple(sorted(v)) for name, v in phase_layers.items()},
            "layer_transfer_s": tuple(transfer), "layer_compute_s": tuple(compute), "host_update_s": sum(host_s),
            "schedule": schedule}


def offloaded_floor(policy: OffloadPolicy, layers: list[LayerCost], link: Link, mode: str,
                    steady_state: bool = True) -> float:
    """A lower bound of :func:`time_offloaded_optimizer`'s step time (its ``floor_s``), without simulating."""
    grads_on_host = policy.grads == "host"
    streamed = mode == "streamed"
    schedule = schedule_for(policy, len(layers), True, mode, steady_state)
    forward_in, backward_in = fetched_for(schedule, "forward"), fetched_for(schedule, "backward")
    tail = schedule.next_call_fetches
    activation_bytes, remat_names = activation_traffic(policy, layers, True)
    activations = sum(activation_bytes)
    compute = sum(layer.forward_time_s + layer.backward_time_s + recompute_s(layer, policy, remat_names)
                  + (layer.optimizer_s if streamed else 0.0) for layer in layers)
    weights_in = sum(layers[i].param_bytes for i in forward_in)      # forward: all but the kept first layers
    weights_in += sum(layers[i].param_bytes for i in backward_in)    # backward: all but the last k
    weights_in += sum(layers[i].param_bytes for i in tail)           # and the next step's first layers
    if streamed:
        total_in = weights_in + activations + sum(layers[i].optimizer_bytes for i in state_fetched_for(schedule))
        total_out = activations + sum(layer.update_bytes + layer.optimizer_bytes for layer in layers)
        host = 0.0
    else:
        total_in = weights_in + activations
        total_out = activations + (sum(layer.grad_bytes for layer in layers) if grads_on_host else 0)
        host = sum(link.host_update_s(layer.host_update_bytes) for layer in layers)
    return max(compute, link_floor_s(link, total_in, total_out), host)
