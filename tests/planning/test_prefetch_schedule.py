"""Tests of ``xla_swap.planning.prefetch.PrefetchSchedule``: pure Python, no torch / jax needed.

The runtime side (measured residency = the predicted live set) is
``tests/executors/test_schedule_residency.py``.
"""
import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from xla_swap.planning import PrefetchSchedule, ScheduleStep
from xla_swap.planning.prefetch import EVENT_KINDS, PASSES


def test_inference_steady_state_moves_every_stage_once_and_keeps_k():
    s = PrefetchSchedule(6, 2)
    assert s.carried_in == (0, 1) and s.prologue == ()
    assert s.fetched("forward") == (2, 3, 4, 5)
    assert s.next_call_fetches == (0, 1) and s.carried_out == (0, 1)
    assert s.num_fetches == 6
    assert [len(st.live) for st in s.steps] == [3] * 6
    assert s.steps[-1] == ScheduleStep("forward", 5, (), (1,), (0, 1, 5), keep_next=(1,), release=(5,))


def test_training_steady_state_moves_2L_minus_2k_minus_2():
    n, k = 8, 2
    s = PrefetchSchedule(n, k, training=True)
    assert s.carried_in == (0, 1, 2) and s.carried_out == (0, 1, 2)
    assert s.fetched("forward") == (3, 4, 5, 6, 7)                # L - k - 1: stage k came with the carry
    assert s.fetched("backward") == (4, 3, 2, 1, 0)               # L - k - 1: the last k+1 stayed from the forward
    assert s.next_call_fetches == ()                              # stages 0..k kept from the backward
    assert s.num_fetches == 2 * n - 2 * k - 2
    assert [st.pass_name for st in s.steps] == ["forward"] * n + ["backward"] * n
    assert [st.stage for st in s.steps] == list(range(n)) + list(reversed(range(n)))
    assert s.max_live_stages == k + 1


def test_cold_call_and_no_cycle():
    n, k = 8, 2
    cold = PrefetchSchedule(n, k, training=True, steady_state=False)
    assert cold.carried_in == () and cold.prologue == (0, 1)
    assert cold.num_fetches == 2 * n - k - 1                      # 2L - k - 1; stages 0..k stay for the next call
    off = PrefetchSchedule(n, k, training=True, prefetch_next_call=False)
    assert off.carried_out == () and off.num_fetches == 2 * n - k - 1
    assert off.steps == PrefetchSchedule(n, k, training=True, prefetch_next_call=False, steady_state=False).steps


@pytest.mark.parametrize("training", [False, True])
def test_depth_at_least_L_keeps_everything(training):
    s = PrefetchSchedule(3, 5, training=training)
    assert s.num_fetches == 0 and s.carried_out == (0, 1, 2) and s.max_live_stages == 3


def test_resident_stages_are_never_fetched_nor_live():
    res = (False, True, False, False, True)
    for training in (False, True):
        s = PrefetchSchedule(5, 1, training=training, resident=res)
        moved = s.prologue + s.fetched("forward") + s.fetched("backward") + s.next_call_fetches
        assert not {1, 4} & set(moved)
        assert all(not {1, 4} & set(st.live) for st in s.steps)
    assert PrefetchSchedule(3, 1, resident=[True] * 3).max_live_stages == 0


def test_peak_live_bytes():
    s = PrefetchSchedule(4, 1)
    assert s.peak_live_bytes([10, 20, 30, 40]) == 70               # stages 2 and 3
    assert PrefetchSchedule(4, 1, training=True).peak_live_bytes([1, 1, 1, 1]) == 2
    with pytest.raises(ValueError, match="stage_bytes"):
        s.peak_live_bytes([1, 2])
    with pytest.raises(ValueError, match=r"stage_bytes\[1\]"):
        s.peak_live_bytes([1, -2, 3, 4])


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), k=st.integers(1, 14), training=st.booleans(), cyclic=st.booleans(),
       steady=st.booleans(), data=st.data())
def test_invariants(n, k, training, cyclic, steady, data):
    res = tuple(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    s = PrefetchSchedule(n, k, training=training, resident=res, prefetch_next_call=cyclic, steady_state=steady)
    streamed = [j for j in range(n) if not res[j]]
    assert s.max_live_stages <= min(k + 1, len(streamed))
    for step in s.steps:                      # the stage computing is on the device, unless resident
        assert res[step.stage] or step.stage in step.live
    # every streamed stage is brought in (or was carried) before each pass that uses it
    fwd = set(s.carried_in) | set(s.fetched("forward"))
    assert fwd == set(streamed)
    if cyclic:
        assert set(s.carried_out) == {j for j in streamed if j < min(k, n) or (training and j == k)}
    if cyclic and steady:                     # the steady state starts with what it leaves
        assert s.carried_in == s.carried_out
    if training and not (cyclic and steady):
        assert len(s.fetched("backward")) == len([j for j in streamed if j < n - k - 1])


def test_immutable_and_hashable():
    s = PrefetchSchedule(4, 2, training=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.prefetch_depth = 3
    assert s == PrefetchSchedule(4, 2, training=True, resident=[False] * 4) and hash(s) == hash(
        PrefetchSchedule(4, 2, training=True))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_stages"):
        PrefetchSchedule(0, 1)
    with pytest.raises(TypeError, match="prefetch_depth"):
        PrefetchSchedule(3, 1.5)
    with pytest.raises(ValueError, match="prefetch_depth"):
        PrefetchSchedule(3, 0)
    with pytest.raises(TypeError, match="training"):
        PrefetchSchedule(3, 1, training="yes")
    with pytest.raises(ValueError, match="resident must be a sequence of 3 bools"):
        PrefetchSchedule(3, 1, resident=[True])
    with pytest.raises(ValueError, match="'forward', 'backward'"):
        PrefetchSchedule(3, 1).fetched("optimizer")
    assert PASSES == ("forward", "backward", "update")


def test_events_of_a_training_step_with_offload_and_optimizer():
    s = PrefetchSchedule(5, 1, training=True, offload_activations=True, optimizer=True)
    assert s.carried_in == (0, 1) and s.carried_out == (0, 1)
    pro_f, pro_b = s.prologues
    assert (pro_f.stage, pro_f.take, pro_f.fetch) == (None, (0,), ())
    fwd, bwd = s.steps[:5], s.steps[5:]
    assert [st.take + st.fetch for st in fwd] == [(1,), (2,), (3,), (4,), ()]
    assert [st.fetch for st in fwd] == [(), (2,), (3,), (4,), ()]          # stage 1 came with the carry
    assert [st.offload for st in fwd] == [(0,), (1,), (2,), (), ()]         # the last k+1 inputs stay
    assert [st.release for st in fwd] == [(0,), (1,), (2,), (), ()]
    assert (pro_b.take, pro_b.fetch_state) == ((4,), (4,))
    assert [st.stage for st in bwd] == [4, 3, 2, 1, 0]
    assert [st.take + st.fetch for st in bwd] == [(3,), (2,), (1,), (0,), ()]
    assert [st.fetch for st in bwd] == [(), (2,), (1,), (0,), ()]
    assert [st.fetch_state for st in bwd] == [(3,), (2,), (1,), (0,), ()]
    assert [st.fetch_activations for st in bwd] == [(), (2,), (1,), (0,), ()]
    assert [st.keep_next for st in bwd] == [(), (), (), (1,), (0,)]
    assert [st.release for st in bwd] == [(4,), (3,), (2,), (1,), (0,)]
    assert s.events()[:2] == (("forward", None, "take", 0), ("forward", 0, "take", 1))
    assert ("backward", 3, "fetch_state", 2) in s.events()


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 10), k=st.integers(1, 12), training=st.booleans(), cyclic=st.booleans(),
       steady=st.booleans(), offload=st.booleans(), data=st.data())
def test_event_invariants(n, k, training, cyclic, steady, offload, data):
    res = tuple(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    opt = training and data.draw(st.booleans())
    s = PrefetchSchedule(n, k, training=training, resident=res, prefetch_next_call=cyclic, steady_state=steady,
                         offload_activations=offload, optimizer=opt)
    streamed = {j for j in range(n) if not res[j]}
    for name in PASSES[:2 if training else 1]:   # every streamed stage: acquired once, released once per pass
        timeline = [t for t in s.timeline if t.pass_name == name]
        acquired = [j for t in timeline for j in t.fetch + t.take]
        assert sorted(acquired) == sorted(streamed) and len(set(acquired)) == len(acquired)
        assert sorted(j for t in timeline for j in t.release) == sorted(j for j in streamed if not (
            name == "forward" and training and j >= n - k - 1))
        assert [j for t in timeline for j in t.fetch] == list(s.fetched(name))
    assert sorted(j for t in s.timeline for j in t.keep_next) == list(s.carried_out)
    assert set(s.next_call_fetches) <= set(s.carried_out)
    offloaded = [j for t in s.steps for j in t.offload]
    assert offloaded == (list(range(max(0, n - k - 1))) if training and offload else [])
    assert sorted(j for t in s.timeline for j in t.fetch_activations) == offloaded
    assert sorted(j for t in s.timeline for j in t.fetch_state) == (list(range(n)) if opt else [])
    assert len(s.events()) == sum(len(getattr(t, kind)) for t in s.timeline for kind in EVENT_KINDS)


def test_carry_and_optimizer_arguments():
    s = PrefetchSchedule(5, 2, training=True, carry=[1, 0])
    assert s.carry == (0, 1) and s.carried_in == (0, 1) and s.steps[0].fetch == (2,)
    assert PrefetchSchedule(5, 2, carry=(0, 1, 2)).steps[0].take == (2,)
    with pytest.raises(ValueError, match="optimizer=True needs training"):
        PrefetchSchedule(3, 1, optimizer=True)
    with pytest.raises(ValueError, match="carry must be distinct streamed stages below 3"):
        PrefetchSchedule(3, 1, resident=(True, False, False), carry=(0,))
    with pytest.raises(ValueError, match="carry must be distinct"):
        PrefetchSchedule(3, 1, carry=(3,))
    with pytest.raises(TypeError, match=r"carry\[0\]"):
        PrefetchSchedule(3, 1, carry=("0",))
    with pytest.raises(TypeError, match="optimizer"):
        PrefetchSchedule(3, 1, training=True, optimizer=1)
