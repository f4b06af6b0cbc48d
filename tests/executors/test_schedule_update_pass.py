"""The separate update pass (``train_step`` with ``max_grad_norm`` or ``skip_nonfinite``, after any
``accumulate`` micro-batches) is the ``"update"`` pass of the call's ``PrefetchSchedule(update_pass=True)``.

For (L, k, resident stages) cases and each option: every call's ``executed_events`` are the
``events()`` of ``runtime.schedule(...)`` built from the carry the call found (``last_schedule`` is
that object), the measured residency is its live set step by step, the stages left for the next
call are its ``carried_out`` (none after an update pass); the updated weights and moments equal
those of a runtime with every stage resident (which streams nothing). A skipped update (non-finite
norm) executes the schedule without the update pass and leaves the backward's keeps.
"""
import jax
import numpy as np
import pytest

from streaming_cases import SCHEDULE_SHAPES as SHAPES, check_close, layer, loss_fn, make_input, make_params
from xla_swap.executors import RuntimeConfig, StreamingRuntime
from xla_swap.planning import AdamW, LayerCost, OffloadPolicy, PrefetchSchedule
from xla_swap.planning.memory import device_memory
from xla_swap.planning.rows import offloaded_rows

OPTIONS = ("accumulate", "accumulate+clip", "max_grad_norm", "skip_nonfinite")
GRID = [(n, k, res, opt) for n, k, res in SHAPES for opt in OPTIONS]


def _ids(case):
    n, k, res, opt = case
    return f"L{n}-k{k}-{'res' if res else 'stream'}-{opt}"


def _runtime(params, **kw):
    return StreamingRuntime(layer, params, RuntimeConfig(**kw), optimizer=AdamW(lr=1e-2))


def _calls(option):
    """The ``train_step`` keyword arguments of one optimizer step, one dict per call."""
    if option == "accumulate":                  # the last micro-batch's update is fused into its backward
        return [dict(accumulate=True), dict(accumulate=False)]
    if option == "accumulate+clip":
        return [dict(accumulate=True), dict(max_grad_norm=0.5)]
    if option == "max_grad_norm":
        return [dict(max_grad_norm=0.5)]
    return [dict(skip_nonfinite=True)]


def _expected(rt, carry, **kw):
    """The schedule of a call that found ``carry``: cold, steady, or of that carry (``carry=``)."""
    sched = rt.schedule(True, steady_state=bool(carry), **kw)
    if sched.carried_in != carry:
        sched = rt.schedule(True, carry=carry, **kw)
    assert sched.carried_in == carry
    return sched


def _check_same_state(rt, ref):
    for a, b in zip(rt.host_params + rt.optimizer_state, ref.host_params + ref.optimizer_state):
        for leaf_a, leaf_b in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            check_close(leaf_a, leaf_b, rtol=1e-5, atol=1e-5)


def _check_planner_reads(rt, sched, x):
    """The planner times the forward and backward steps of a schedule with an update pass (not the
    update pass); the memory model's window is its live set, update steps included."""
    layers = [LayerCost(param_bytes=b, optimizer_bytes=s, forward_s=0.01, carry_bytes=x.nbytes)
              for b, s in zip(rt.stage_nbytes, rt.optimizer_state_nbytes)]
    policy = OffloadPolicy(params="host", grads="host", optimizer_state="host", prefetch_depth=rt.prefetch_depth)
    rows = offloaded_rows(policy, layers, "streamed", True, sched)
    timed = [r.step for r in rows if r.step is not None]
    assert timed == [s for s in sched.steps if s.pass_name != "update"]
    mem = device_memory(policy, layers, False, schedule=sched)
    assert mem.device_components["params"] == sched.peak_live_bytes(rt.stage_nbytes)


@pytest.mark.parametrize("case", GRID, ids=_ids)
def test_the_update_pass_executes_the_schedule(case):
    n, k, resident, option = case
    _check_steps(n, option, prefetch_depth=k, resident=resident)


@pytest.mark.parametrize("option", OPTIONS[1:3])
def test_the_update_pass_without_the_cycle_and_with_activation_offload(option):
    """Without ``prefetch_next_call`` the backward keeps nothing: the update pass copies every stage."""
    _check_steps(4, option, prefetch_depth=2, prefetch_next_call=False, offload_activations=True,
                 remat=False)


def _check_steps(n, option, **kw):
    """Two optimizer steps of ``option`` on a runtime built with ``kw``, checked call by call against
    its schedule and against a runtime with every stage resident."""
    params, x, resident = make_params(n), make_input(), kw.get("resident")
    rt = _runtime(params, **kw)
    ref = _runtime(params, prefetch_depth=1, resident=[True] * n)
    for _ in range(2):                          # the second step starts from what the first left
        for i, kw in enumerate(_calls(option)):
            carry = tuple(rt.prefetched_stages)
            out = rt.train_step(x, loss_fn, **kw)
            jax.block_until_ready(out)
            update = "max_grad_norm" in kw or "skip_nonfinite" in kw
            sched = _expected(rt, carry, optimizer=i > 0, update_pass=update)
            assert rt.last_schedule == sched
            assert rt.executed_events == list(sched.events()), sched
            assert rt.residency_trace == [(s.pass_name, s.stage, len(s.live)) for s in sched.steps]
            assert rt.prefetched_stages == list(sched.carried_out)
            if update:
                assert sched.update_pass and sched.carried_out == ()
                assert rt.grad_acc is None and not rt.last_step_skipped
                # each stage's moments and accumulated gradients come once, its weights taken or copied once
                ups = [e for e in rt.executed_events if e[0] == "update"]
                assert sorted(e[3] for e in ups if e[2] == "fetch_state") == list(range(n))
                streamed = [j for j in range(n) if not (resident and resident[j])]
                assert sorted(e[3] for e in ups if e[2] in ("fetch", "take")) == streamed
                assert {e[3] for e in ups if e[2] == "take"} == set(
                    j for s in sched.pass_steps("backward") for j in s.keep_next)
                assert rt.prefetch_next_call or sched.fetched("update") == tuple(streamed)
                _check_planner_reads(rt, sched, x)
            check_close(out[0], ref.train_step(x, loss_fn, **kw)[0], rtol=1e-5, atol=1e-5)
            _check_same_state(rt, ref)
    assert rt.step == ref.step == 2


@pytest.mark.parametrize("n,k,resident", SHAPES[:2] + SHAPES[4:5])
def test_a_skipped_update_executes_the_schedule_without_the_update_pass(n, k, resident):
    params, x = make_params(n), make_input()
    rt = _runtime(params, prefetch_depth=k, resident=resident)
    rt.train_step(x, loss_fn, skip_nonfinite=True)
    before = [np.asarray(leaf) for p in rt.host_params for leaf in jax.tree_util.tree_leaves(p)]
    jax.block_until_ready(rt.train_step(x * np.inf, loss_fn, skip_nonfinite=True))
    assert rt.last_step_skipped and rt.step == 1
    sched = rt.schedule(True, steady_state=False, optimizer=False)    # no update pass
    assert rt.last_schedule == sched and not sched.update_pass
    assert rt.executed_events == list(sched.events())
    assert rt.prefetched_stages == list(sched.carried_out) != []       # the backward's keeps stay
    after = [np.asarray(leaf) for p in rt.host_params for leaf in jax.tree_util.tree_leaves(p)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    carry = tuple(rt.prefetched_stages)
    rt.train_step(x, loss_fn, skip_nonfinite=True)                    # takes the kept stages
    sched = _expected(rt, carry, optimizer=False, update_pass=True)
    assert rt.last_schedule == sched and rt.executed_events == list(sched.events()) and rt.step == 2
    assert ("forward", None, "take", 0) in rt.executed_events or (resident and resident[0])


def test_the_update_pass_schedule():
    """L=5, k=2, streamed: the update pass takes the k+1 stages the backward kept, copies the rest,
    moments and accumulated gradients beside each; nothing carries out."""
    s = PrefetchSchedule(5, 2, training=True, optimizer=True, update_pass=True, carry=(0, 1, 2))
    assert s.carried_in == (0, 1, 2) and s.carried_out == ()
    pro = s.prologue_of("update")
    assert (pro.fetch_state, pro.take, pro.fetch, pro.live) == ((0, 1), (0, 1), (), (0, 1, 2))
    ups = s.pass_steps("update")
    assert [u.stage for u in ups] == list(range(5))
    assert [(u.fetch_state, u.take, u.fetch, u.release) for u in ups] == [
        ((2,), (2,), (), (0,)), ((3,), (), (3,), (1,)), ((4,), (), (4,), (2,)), ((), (), (), (3,)),
        ((), (), (), (4,))]
    assert s.fetched("update") == (3, 4) and s.max_live_stages == 3
    assert s.steps[:10] == PrefetchSchedule(5, 2, training=True, optimizer=True, carry=(0, 1, 2)).steps
    # without the next-call cycle the backward keeps nothing: every stage is copied
    cold = PrefetchSchedule(5, 2, training=True, prefetch_next_call=False, update_pass=True)
    assert cold.fetched("update") == (0, 1, 2, 3, 4) and cold.carried_out == ()
    # a steady call of this kind follows one that left nothing
    assert PrefetchSchedule(5, 2, training=True, update_pass=True).carried_in == ()
    # resident stages: state fetched, no weight events
    res = PrefetchSchedule(3, 1, training=True, resident=(True, False, False), update_pass=True, carry=(1,))
    assert [(u.fetch_state, u.take + u.fetch, u.release) for u in res.timeline if u.pass_name == "update"] == [
        ((0,), (), ()), ((1,), (1,), ()), ((2,), (2,), (1,)), ((), (), (2,))]


def test_update_pass_argument_checks():
    with pytest.raises(TypeError, match="update_pass"):
        PrefetchSchedule(3, 1, training=True, update_pass="yes")
    with pytest.raises(ValueError, match="update_pass=True needs training"):
        PrefetchSchedule(3, 1, update_pass=True)
    rt = _runtime(make_params(3), prefetch_depth=1)
    with pytest.raises(ValueError, match="update_pass=True needs training"):
        rt.schedule(False, update_pass=True)
    with pytest.raises(TypeError, match="update_pass"):
        rt.schedule(True, update_pass=1)
    with pytest.raises(ValueError, match="'update'"):
        PrefetchSchedule(3, 1, training=True).prologue_of("update")
    with pytest.raises(ValueError, match="'forward', 'backward', 'update'"):
        PrefetchSchedule(3, 1).fetched("optimizer")
