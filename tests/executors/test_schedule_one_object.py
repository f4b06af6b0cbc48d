"""One ``PrefetchSchedule`` per call: the runtime executes it, the planner times it, the memory model sums it.

For a grid of (L, k, resident stages, activation offload, optimizer, forward / train_step, cold /
steady call) cases: the events the runtime's loop performed (``executed_events``: weight copies,
takes, next-call keeps, releases, activation offloads and fetches, optimizer-state copies) are the
``events()`` of ``runtime.schedule(...)``, and ``last_schedule`` (the object the loop iterated)
equals it; the planner's rows built from that object are its very step objects, with weight bytes
in where it fetches; the memory model's weight window is its ``max_live_stages`` / live set
(``peak_live_bytes``), which is also what the runtime measured. Outputs, gradients and updated
weights are checked against a reference that streams nothing.
"""
import jax
import numpy as np
import pytest

from streaming_cases import SCHEDULE_SHAPES as SHAPES
from streaming_cases import check_close, layer, loss_fn, make_input, make_params, mono_forward, mono_loss, stacked
from xla_swap.executors import RuntimeConfig, StreamingRuntime
from xla_swap.planning import AdamW, LayerCost, OffloadPolicy
from xla_swap.planning.memory import device_memory
from xla_swap.planning.rows import offloaded_rows, phase_rows

GRID = [(n, k, res, False, False, False) for n, k, res in SHAPES] + [
    (n, k, res, True, offload, opt) for n, k, res in SHAPES for offload in (False, True) for opt in (False, True)]


def _ids(case):
    n, k, res, training, offload, opt = case
    return f"L{n}-k{k}-{'res' if res else 'stream'}-{'train' if training else 'fwd'}" \
           f"{'-offload' if offload else ''}{'-adamw' if opt else ''}"


def _runtime(params, **kw):
    opt = kw.pop("optimizer", False)
    return StreamingRuntime(layer, params, RuntimeConfig(**kw), optimizer=AdamW(lr=1e-2) if opt else None)


def _call(rt, x, training):
    if training:
        out = rt.train_step(x, loss_fn)
        jax.block_until_ready(out)
        return out
    y = rt.forward(x)
    jax.block_until_ready(y)
    return y


def _check_planner_reads(rt, sched, training, optimizer, x):
    """The planner's rows and the memory model's window, read from ``sched`` itself."""
    layers = [LayerCost(param_bytes=b, optimizer_bytes=s or 1, forward_s=0.01, carry_bytes=x.nbytes)
              for b, s in zip(rt.stage_nbytes, rt.optimizer_state_nbytes)]
    k = rt.prefetch_depth
    if optimizer:
        policy = OffloadPolicy(params="host", grads="host", optimizer_state="host", prefetch_depth=k)
        rows = offloaded_rows(policy, layers, "streamed", True, sched)
        # the moments the rows move in are the schedule's optimizer-state copies
        moved_state = sum(layers[e[3]].optimizer_bytes for e in sched.events() if e[2] == "fetch_state")
        assert sum(layers[r.stage].optimizer_bytes for r in rows if r.step is not None and
                   r.step.pass_name == "backward") == moved_state
    else:
        policy = OffloadPolicy(params="host", prefetch_depth=k)
        phases = phase_rows(policy, layers, training, True, sched)
        rows = [r for rows in phases.values() for r in rows]
    timed = [r.step for r in rows if r.step is not None]
    assert len(timed) == len(sched.steps) and all(a is b for a, b in zip(timed, sched.steps))
    for r in rows:                            # weight bytes in exactly where the schedule copies them
        if r.step is not None:
            fetched = set(sched.fetched(r.step.pass_name))
            state = layers[r.stage].optimizer_bytes if optimizer and r.step.pass_name == "backward" else 0
            assert r.in_bytes == (layers[r.stage].param_bytes if r.stage in fetched else 0) + state, r
    tail = sched.next_call_fetches            # the call's last rows: its copies for the next call
    assert [(r.stage, r.step) for r in rows[len(rows) - len(tail):]] == [(j, None) for j in tail]
    mem = device_memory(policy, layers, False, schedule=sched)
    assert mem.device_components["params"] == sched.peak_live_bytes(rt.stage_nbytes)
    assert rt.memory_report(training).predicted_live_stages == sched.max_live_stages


@pytest.mark.parametrize("case", GRID, ids=_ids)
def test_runtime_planner_and_memory_model_read_one_schedule(case):
    n, k, resident, training, offload, optimizer = case
    params, x = make_params(n), make_input()
    rt = _runtime(params, prefetch_depth=k, resident=resident, offload_activations=offload, optimizer=optimizer,
                  remat=not offload)
    # the reference streams nothing: every stage resident, same optimizer
    ref = _runtime(params, prefetch_depth=1, resident=[True] * n, optimizer=optimizer)
    for steady in (False, True, True):
        out = _call(rt, x, training)
        sched = rt.schedule(training, steady_state=steady)
        assert rt.last_schedule == sched
        assert rt.executed_events == list(sched.events()), (steady, sched)
        assert rt.residency_trace == [(s.pass_name, s.stage, len(s.live)) for s in sched.steps]
        assert rt.max_resident_stages <= sched.max_live_stages
        assert rt.prefetched_stages == list(sched.carried_out)
        _check_planner_reads(rt, sched, training, optimizer, x)
        expect = _call(ref, x, training)
        if not training:
            check_close(out, mono_forward(stacked(params), x))
            continue
        check_close(out[0], expect[0], rtol=1e-5, atol=1e-5)
        check_close(out[1], expect[1], rtol=1e-5, atol=1e-5)
        if optimizer:                         # the updated weights
            for a, b in zip(rt.host_params, ref.host_params):
                for leaf_a, leaf_b in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
                    check_close(leaf_a, leaf_b, rtol=1e-5, atol=1e-5)
        else:
            grads = jax.grad(mono_loss)(stacked(params), x)
            check_close(stacked(out[2])["a"], grads["a"], rtol=1e-5, atol=1e-5)


def test_a_call_after_one_of_another_kind_executes_the_carry_it_finds():
    """A train_step after a forward starts with the forward's k stages, not the k+1 a train_step
    leaves: the loop's schedule is the one of that carry (``carry=``), and the forward after it
    takes stage k from the train_step's carry."""
    n, k = 5, 2
    params, x = make_params(n), make_input()
    rt = _runtime(params, prefetch_depth=k)
    _call(rt, x, False)
    carry = tuple(rt.prefetched_stages)
    assert carry == (0, 1)
    _call(rt, x, True)
    sched = rt.schedule(True, carry=carry)
    assert rt.last_schedule == sched and sched.carried_in == carry
    assert rt.executed_events == list(sched.events())
    assert ("forward", 0, "fetch", 2) in rt.executed_events        # stage k was not carried
    carry = tuple(rt.prefetched_stages)
    assert carry == (0, 1, 2)
    out = _call(rt, x, False)
    sched = rt.schedule(False, carry=carry)
    assert rt.executed_events == list(sched.events())
    assert ("forward", 0, "take", 2) in rt.executed_events         # stage k came with the carry
    assert rt.residency_trace == [(s.pass_name, s.stage, len(s.live)) for s in sched.steps]
    check_close(out, mono_forward(stacked(params), x))


def test_replaced_weights_are_copied_not_taken():
    n, k = 4, 1
    params, x = make_params(n), make_input()
    rt = _runtime(params, prefetch_depth=k)
    _call(rt, x, False)
    new = make_params(n, seed=3)
    rt.load_stage(0, params=new[0])              # the carried copy of stage 0 is stale
    out = _call(rt, x, False)
    assert rt.executed_events == list(rt.schedule(False, steady_state=False).events())
    check_close(out, mono_forward(stacked([new[0]] + params[1:]), x))


@pytest.mark.parametrize("clip", [False, True], ids=["fused-update", "update-pass"])
def test_accumulation_fetches_the_accumulated_gradients_from_the_second_micro_batch(clip):
    """Two micro-batches accumulate, the third updates: fused into its backward (which brings
    moments and accumulated gradients), or with ``max_grad_norm`` in the separate update pass
    (its backward brings the accumulated gradients; the update pass, every stage's moments and
    gradients; nothing is carried out)."""
    n, k = 4, 1
    params, x = make_params(n), make_input()
    rt = _runtime(params, prefetch_depth=k, optimizer=True)
    for i in range(3):
        carry = tuple(rt.prefetched_stages)
        rt.train_step(x, loss_fn, accumulate=i < 2, max_grad_norm=1.0 if clip and i == 2 else None)
        sched = rt.schedule(True, optimizer=i > 0, carry=carry, update_pass=clip and i == 2)
        assert rt.executed_events == list(sched.events()), i
        assert sum(e[2] == "fetch_state" for e in rt.executed_events) == (0, n, 2 * n if clip else n)[i]
    assert rt.prefetched_stages == list(rt.last_schedule.carried_out) == ([] if clip else [0, 1])


def test_schedule_arguments_are_checked():
    rt = _runtime(make_params(3), prefetch_depth=1)
    with pytest.raises(ValueError, match="optimizer=True needs training"):
        rt.schedule(False, optimizer=True)
    with pytest.raises(ValueError, match="carry must be distinct streamed stages"):
        rt.schedule(True, carry=(0, 0))
    with pytest.raises(TypeError, match="offload_activations"):
        from xla_swap.planning import PrefetchSchedule
        PrefetchSchedule(3, 1, offload_activations="yes")
    assert np.isfinite(float(rt.train_step(make_input(), loss_fn)[0]))
