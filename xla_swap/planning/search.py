"""The planner's search: the policy space, and the fastest predicted policy that fits a budget
(docs/reference/planner.md, "Search"). Pure Python.
"""
from __future__ import annotations

import itertools
import math

from xla_swap.planning.costs import LayerCost, Link
from xla_swap.planning.memory import device_memory
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.planning.rows import optimizer_modes_of, phase_rows
from xla_swap.planning.timing import offloaded_floor, phase_times, time_offloaded_optimizer, traffic_floor
from xla_swap.planning.units import REL_TIE, as_prefetch_depth

__all__ = ["MAX_NAMED_ACTIVATIONS", "candidates", "complexity", "search_space", "fastest_fitting"]

#: Maximum number of named activations the exhaustive search enumerates (3**6 placements).
MAX_NAMED_ACTIVATIONS = 6


def candidates(layers: list[LayerCost], training: bool, max_depth: int):
    """Every policy of the search space, in a fixed order (docs/reference/planner.md, "Search", rules 1-2).

    Raises: ValueError: more than :data:`MAX_NAMED_ACTIVATIONS` distinct named activations.
    """
    names = sorted({n for layer in layers for n in layer.activations}) if training else []
    if len(names) > MAX_NAMED_ACTIVATIONS:
        raise ValueError(f"activations: at most {MAX_NAMED_ACTIVATIONS} distinct named activations can be "
                         f"searched exhaustively, got {len(names)}; group some under one name")
    placements = ([("device",) * 3, ("host", "device", "device"), ("host", "host", "device"), ("host",) * 3]
                  if training else [("device",) * 3, ("host", "device", "device")])
    for (params, grads, state), acts, remat, depth in itertools.product(
            placements, itertools.product(("device", "host", "remat"), repeat=len(names)),
            (False, True) if training else (False,), range(1, max_depth + 1)):
        streams = params == "host" or state == "host" or "host" in acts
        if depth > 1 and not streams:
            continue  # prefetch depth is meaningless when nothing streams
        yield OffloadPolicy(params=params, grads=grads, optimizer_state=state, activations=dict(zip(names, acts)),
                            remat=remat, prefetch_depth=depth)


def complexity(policy: OffloadPolicy) -> int:
    """Non-default choices of ``policy`` (a tie-break: the simpler policy wins)."""
    return ((policy.params == "host") + (policy.grads == "host") + (policy.optimizer_state == "host")
            + sum(where != "device" for where in policy.activations.values()) + policy.remat
            + (policy.prefetch_depth - 1))


def search_space(layers: list[LayerCost], training: bool, max_prefetch_depth, target: str = "accelerator") -> list:
    """``[(index, policy, peak device bytes)]`` for every candidate, in enumeration order.

    Raises: ValueError: ``max_prefetch_depth`` not an int in 1..16 (named), or too many named activations.
    """
    max_depth = as_prefetch_depth("max_prefetch_depth", max_prefetch_depth)
    return [(index, policy, device_memory(policy, layers, training, target).peak_bytes)
            for index, policy in enumerate(candidates(layers, training, max_depth))]


def _lower_bounds(feasible: list, layers: list[LayerCost], training: bool, link: Link, mode: str | None,
                  steady_state: bool) -> list:
    """``[(floor_s, index, policy, peak, how)]`` sorted by floor: ``how`` is the optimizer mode of a
    policy with its state on the host (one candidate per allowed mode), else its phase rows."""
    scored = []
    for index, policy, peak in feasible:
        if training and policy.optimizer_state == "host":
            for m in optimizer_modes_of(policy, mode):
                scored.append((offloaded_floor(policy, layers, link, m, steady_state), index, policy, peak, m))
        else:
            phases = phase_rows(policy, layers, training, steady_state)
            scored.append((traffic_floor(phases, link), index, policy, peak, phases))
    scored.sort(key=lambda t: (t[0], t[1], isinstance(t[4], str) and t[4] != "streamed"))
    return scored


def fastest_fitting(feasible: list, layers: list[LayerCost], training: bool, link: Link, target: str,
                    mode: str | None, host_overlap: bool, steady_state: bool) -> tuple[OffloadPolicy, str | None]:
    """The policy (and optimizer mode, ``None`` unless its state is on the host) with the lowest
    predicted step among ``feasible`` (``[(index, policy, peak)]``, non-empty).

    Branch and bound on the floor (a lower bound of the step time): candidates are timed in floor
    order until the floor passes the best time. Ties (within :data:`~xla_swap.planning.units.REL_TIE`)
    go to fewer host bytes, the simpler policy, fewer device bytes, enumeration order, the
    ``"streamed"`` mode.
    """
    best = math.inf
    timed = []
    for floor, index, policy, peak, how in _lower_bounds(feasible, layers, training, link, mode, steady_state):
        if floor > best * (1 + REL_TIE):
            break
        if isinstance(how, str):
            step_s = time_offloaded_optimizer(policy, layers, link, how, host_overlap, steady_state)["step_s"]
        else:
            step_s = sum(phase_times(how, policy, link).values())
        best = min(best, step_s)
        timed.append((step_s, index, policy, peak, how if isinstance(how, str) else None))
    near = [c for c in timed if c[0] <= best * (1 + REL_TIE)]

    def host_bytes(policy):
        return sum(device_memory(policy, layers, training, target).host_components.values())

    _, _, chosen, _, how = min(near, key=lambda c: (host_bytes(c[2]), complexity(c[2]), c[3], c[1],
                                                     c[4] not in (None, "streamed")))
    return chosen, how
