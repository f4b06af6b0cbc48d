"""The streaming runtime against its schedule as data (``xla_swap.planning.PrefetchSchedule``).

For several stage counts, prefetch depths and resident stages, in ``forward`` and ``train_step``,
cold (the first call) and in the steady state (later calls): the residency the runtime measures
after every step (``track_residency``: its device buffers alive, by stage) is the schedule's
predicted live set at that step, and the stages it leaves on the device for the next call are the
schedule's ``carried_out``.
"""
import jax
import numpy as np
import pytest

from streaming_cases import check_close, layer, loss_fn, make_input, make_params, mono_forward, stacked
from xla_swap.executors import MemoryReport, Placement, RuntimeConfig, StreamingRuntime
from xla_swap.planning import PrefetchSchedule

CASES = [  # (L, k, resident)
    (4, 1, None),
    (5, 2, None),
    (3, 3, None),                               # k = L: every stage stays
    (2, 4, None),                               # k > L
    (5, 1, (False, True, False, False, True)),  # partial residency
    (4, 2, (True, False, False, False)),
    (4, 2, (False, False, True, False)),        # stage k resident: nothing to stream into the free slot
]


def _run(rt, x, training):
    if training:
        loss, gx, grads = rt.train_step(x, loss_fn)
        jax.block_until_ready((loss, gx, grads))
        return loss
    y = rt.forward(x)
    jax.block_until_ready(y)
    return y


def _predicted(sched: PrefetchSchedule):
    return [(s.pass_name, s.stage, len(s.live)) for s in sched.steps]


@pytest.mark.parametrize("training", [False, True], ids=["forward", "train_step"])
@pytest.mark.parametrize("n,k,resident", CASES)
def test_measured_residency_is_the_schedules_live_set(n, k, resident, training):
    params, x = make_params(n), make_input()
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k, resident=resident))
    ref = mono_forward(stacked(params), x)
    for steady in (False, True, True):
        rt.reset_stats()
        out = _run(rt, x, training)
        sched = rt.schedule(training, steady_state=steady)
        assert rt.residency_trace == _predicted(sched), (steady, sched)
        assert rt.max_resident_stages == sched.max_live_stages
        assert rt.prefetched_stages == list(sched.carried_out)
        if not training:
            check_close(out, ref)
    # the steady state reaches k+1 streamed stages (or every streamed stage) and no more
    streamed = n - sum(resident or ())
    if resident is None:
        assert rt.max_resident_stages == min(k + 1, n)
    assert rt.max_resident_stages <= min(k + 1, streamed)


@pytest.mark.parametrize("training", [False, True], ids=["forward", "train_step"])
def test_without_prefetch_next_call_every_call_is_cold(training):
    n, k = 5, 2
    rt = StreamingRuntime(layer, make_params(n), RuntimeConfig(prefetch_depth=k, prefetch_next_call=False))
    x = make_input()
    for _ in range(2):
        rt.reset_stats()
        _run(rt, x, training)
        sched = rt.schedule(training)
        cold = rt.schedule(training, steady_state=False)
        assert (sched.carried_in, sched.prologue, sched.steps) == ((), cold.prologue, cold.steps)  # nothing carries
        assert rt.residency_trace == _predicted(sched)
        assert rt.prefetched_stages == [] == list(sched.carried_out)


def test_release_prefetched_makes_the_next_call_cold():
    n, k = 4, 1
    rt = StreamingRuntime(layer, make_params(n), RuntimeConfig(prefetch_depth=k))
    x = make_input()
    _run(rt, x, True)
    rt.release_prefetched()
    rt.reset_stats()
    _run(rt, x, True)
    assert rt.residency_trace == _predicted(rt.schedule(True, steady_state=False))


def test_schedule_argument_errors_leave_the_runtime_usable():
    rt = StreamingRuntime(layer, make_params(2), RuntimeConfig(prefetch_depth=1))
    with pytest.raises(TypeError, match="training"):
        rt.schedule("yes")
    with pytest.raises(TypeError, match="steady_state"):
        rt.schedule(True, steady_state=1)
    x = make_input()
    check_close(rt.forward(x), mono_forward(stacked(make_params(2)), x))
    assert np.isfinite(float(rt.train_step(x, loss_fn)[0]))


@pytest.mark.parametrize("training", [False, True], ids=["forward", "train_step"])
def test_memory_report_predicted_matches_measured(training):
    n, k = 5, 2
    params, x = make_params(n), make_input()
    resident = (False, False, False, False, True)
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k, resident=resident))
    before = rt.memory_report(training)
    assert isinstance(before, MemoryReport) and before.executor == "streaming"
    assert before.split_source == "none" and before.device_total_bytes == 0      # nothing compiled yet
    assert before.measured_live_stages == 0
    stage = params[0]["a"].nbytes + params[0]["b"].nbytes
    assert before.predicted_live_stages == k + 1 and before.predicted_live_weight_bytes == (k + 1) * stage
    assert before.resident_weight_bytes == stage and before.host_weight_bytes == (n - 1) * stage
    for _ in range(2):
        _run(rt, x, training)
    rep = rt.memory_report(training)
    assert rep.measured_live_stages == rep.predicted_live_stages == k + 1
    assert rep.split_source == "compiled_memory_stats" and rep.num_devices == 1
    # the largest stage executable takes at least one stage's weights and its input, in device memory
    assert rep.device_argument_bytes >= stage + x.nbytes and rep.host_argument_bytes == 0
    assert rep.parameter_memory_spaces == ()
    off = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k, track_residency=False)).memory_report()
    assert off.measured_live_stages is None
    with pytest.raises(TypeError, match="training"):
        rt.memory_report("yes")


def test_memory_report_is_per_device_under_sharding():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    nd = len(jax.devices())
    params = make_params(3, f=8 * nd)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=1), placement=Placement(
        sharding=lambda i, path, leaf: NamedSharding(mesh, P(None, "x") if "a" in jax.tree_util.keystr(path)
                                                     else P("x", None)),
        activation_sharding=NamedSharding(mesh, P())))
    rep = rt.memory_report()
    stage = params[0]["a"].nbytes + params[0]["b"].nbytes
    assert rep.num_devices == nd
    assert rep.host_weight_bytes == 3 * stage // nd and rep.predicted_live_weight_bytes == 2 * stage // nd


def test_memory_report_type_checks_its_fields():
    with pytest.raises(ValueError, match="executor='tpu'; expected one of 'pjrt', 'ingraph', 'streaming'"):
        MemoryReport("tpu", 1)
    with pytest.raises(ValueError, match="device_temp_bytes"):
        MemoryReport("pjrt", 1, device_temp_bytes=-1)
    with pytest.raises(ValueError, match="split_source"):
        MemoryReport("pjrt", 1, split_source="guess")
    rep = MemoryReport("pjrt", 2, raw_stats={"b": 1, "a": 2})
    with pytest.raises(TypeError):
        rep.raw_stats["c"] = 3
    assert hash(rep) == hash(MemoryReport("pjrt", 2, raw_stats={"a": 2, "b": 1}))
