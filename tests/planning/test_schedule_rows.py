"""The planner times the events of one ``PrefetchSchedule`` and counts the live set of the same object.

For every (L, k, params placement, optimizer mode, steady / cold, training / inference) case: the
rows the time model simulates are the schedule's steps (the very objects, in order) followed by
its copies for the next call; each row's weight bytes in are the schedule's fetch events for that
stage and pass; the Plan carries that schedule, and its weight window is that schedule's live set.
"""
from __future__ import annotations

import itertools

import pytest

from xla_swap.planning import LayerCost, OffloadPolicy, PrefetchSchedule, evaluate
from xla_swap.planning.rows import fetched_for, offloaded_rows, phase_rows, schedule_for, state_fetched_for


def _layers(n):
    # distinct weight sizes, so that a row's bytes name its stage
    return [LayerCost(param_bytes=1000 * (i + 1), optimizer_bytes=7 * (i + 1), forward_s=0.01 * (i + 1),
                      carry_bytes=3) for i in range(n)]


def _check_rows(rows, schedule, layers, passes):
    steps = [r.step for r in rows if r.step is not None]
    assert len(steps) == len(schedule.steps)
    assert all(a is b for a, b in zip(steps, schedule.steps))            # the schedule's own step objects
    for r in rows:
        if r.step is not None:
            assert r.stage == r.step.stage
    for name in passes:                                                   # bytes in = the fetch events
        fetched = (set(schedule.prologue) if name == "forward" else set()) | {
            j for s in schedule.steps if s.pass_name == name for j in s.fetch}
        assert fetched_for(schedule, name) == fetched
        for r in rows:
            if r.step is not None and r.step.pass_name == name:
                assert (r.in_bytes >= layers[r.stage].param_bytes) == (r.stage in fetched), (name, r)


@pytest.mark.parametrize("num_layers, k, params, steady, training", [
    (L, k, p, s, t) for L, k, p, s, t in itertools.product((1, 2, 5), (1, 2, 4), ("host", "device"),
                                                          (True, False), (True, False))])
def test_device_mode_rows_are_the_schedule_steps(num_layers, k, params, steady, training):
    layers = _layers(num_layers)
    policy = OffloadPolicy(params=params, prefetch_depth=k)
    schedule = schedule_for(policy, num_layers, training, "device", steady)
    phases = phase_rows(policy, layers, training, steady, schedule)
    rows = phases["forward"] + phases.get("backward", [])
    _check_rows(rows, schedule, layers, ("forward", "backward") if training else ("forward",))
    last = phases["optimizer" if training else "forward"]               # ends with the next call's copies
    tail = last[len(last) - len(schedule.next_call_fetches):] if schedule.next_call_fetches else []
    assert [(r.stage, r.step, r.compute_s) for r in tail] == [(j, None, 0.0) for j in schedule.next_call_fetches]
    plan = evaluate(policy, layers, training=training, steady_state=steady)
    assert plan.schedule == schedule
    moved = sum(layers[j].param_bytes for name in (("forward", "backward") if training else ("forward",))
                for j in schedule.fetched(name)) + sum(layers[j].param_bytes for j in schedule.next_call_fetches)
    if params == "host":
        if plan.peak_phase != "optimizer":
            assert plan.device_components["params"] == sum(sorted((c.param_bytes for c in layers), reverse=True)
                                                           [:plan.schedule.max_live_stages])
        if not training:   # inference: the only bytes in are the schedule's weight copies
            assert sum(r.in_bytes for rows in phases.values() for r in rows) == moved
    else:
        assert moved == 0 and not schedule.next_call_fetches


@pytest.mark.parametrize("num_layers, k, mode, steady", [
    (L, k, m, s) for L, k, m, s in itertools.product((1, 3, 6), (1, 2, 3), ("streamed", "host"), (True, False))])
def test_offloaded_rows_are_the_schedule_steps(num_layers, k, mode, steady):
    layers = _layers(num_layers)
    policy = OffloadPolicy(params="host", grads="host", optimizer_state="host", prefetch_depth=k)
    schedule = schedule_for(policy, num_layers, True, mode, steady)
    rows = offloaded_rows(policy, layers, mode, steady, schedule)
    _check_rows(rows, schedule, layers, ("forward", "backward"))
    assert [r.stage for r in rows[2 * num_layers:]] == list(schedule.next_call_fetches)
    # the "streamed" mode's schedule brings each layer's moments beside its weights; the rows time them
    assert schedule.optimizer == (mode == "streamed")
    assert state_fetched_for(schedule) == (set(range(num_layers)) if mode == "streamed" else set())
    if mode == "streamed":
        fetched = fetched_for(schedule, "backward")
        for r in rows[num_layers:2 * num_layers]:
            assert r.in_bytes == layers[r.stage].optimizer_bytes + (
                layers[r.stage].param_bytes if r.stage in fetched else 0), r
    plan = evaluate(policy, layers, optimizer_mode=mode, steady_state=steady)
    assert plan.schedule == schedule and plan.optimizer_mode == mode
    assert plan.schedule.prefetch_next_call == (steady and mode != "host")
    window = plan.schedule.max_live_stages
    if plan.peak_phase == "optimizer":
        streamed = [c.param_bytes + c.grad_bytes + c.optimizer_bytes for c in layers]
        assert plan.device_components["optimizer stream window"] == sum(sorted(streamed, reverse=True)[:window])
    else:
        assert plan.device_components["params"] == sum(sorted((c.param_bytes for c in layers), reverse=True)[:window])


def test_a_changed_schedule_changes_the_timed_rows():
    """The rows follow the schedule they are given: a cold schedule fetches the first stages in its own
    forward, the steady one does not."""
    layers = _layers(4)
    policy = OffloadPolicy(params="host", prefetch_depth=2)
    cold = PrefetchSchedule(4, 2, training=False, prefetch_next_call=False)
    steady = PrefetchSchedule(4, 2, training=False)
    cold_in = [r.in_bytes for r in phase_rows(policy, layers, False, True, cold)["forward"]]
    steady_in = [r.in_bytes for r in phase_rows(policy, layers, False, True, steady)["forward"]]
    assert cold_in[:2] == [1000, 2000] and steady_in[:2] == [0, 0]


def test_the_streamed_rows_move_the_moments_the_schedule_fetches():
    layers = _layers(3)
    policy = OffloadPolicy(params="host", grads="host", optimizer_state="host", prefetch_depth=1)
    with_state = PrefetchSchedule(3, 1, training=True, optimizer=True)
    without = PrefetchSchedule(3, 1, training=True)
    a = [r.in_bytes for r in offloaded_rows(policy, layers, "streamed", True, with_state)[3:6]]
    b = [r.in_bytes for r in offloaded_rows(policy, layers, "streamed", True, without)[3:6]]
    assert [x - y for x, y in zip(a, b)] == [layers[i].optimizer_bytes for i in (2, 1, 0)]
