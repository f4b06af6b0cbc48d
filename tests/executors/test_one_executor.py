"""One executor: every pass of a ``StreamingRuntime`` call (forward, backward, the separate update pass) and a
``StatefulStreamer`` run (a decode step's forward, its KV cache in device memory or fetched from
``pinned_host``) runs through ``executor.execute_pass``, and the events each pass performed there are that
pass's events of the call's schedule: together, its ``executed_events`` and ``schedule.events()``. The host's
dispatch order per step (the stage's executable, the throttle wait, then the copies ahead), on which the overlap
of copies and compute depends, is checked for a decode run and a forward."""
import jax
import numpy as np
import pytest

from streaming_cases import layer, loss_fn, make_input, make_params
from xla_swap.executors import RuntimeConfig, StreamingRuntime
from xla_swap.executors.streaming import calls, executor, stateful_streamer
from xla_swap.executors.streaming.stateful_streamer import StatefulStreamer
from xla_swap.planning import AdamW


@pytest.fixture
def passes(monkeypatch):
    """``[(pass_name, events performed by that execute_pass call)]`` of every pass run while the test runs."""
    seen = []

    def recording(schedule, pass_name, program, weights, *, executed, **kw):
        start = len(executed)
        executor.execute_pass(schedule, pass_name, program, weights, executed=executed, **kw)
        seen.append((pass_name, executed[start:]))

    monkeypatch.setattr(calls, "execute_pass", recording)
    monkeypatch.setattr(stateful_streamer, "execute_pass", recording)
    return seen


def _by_pass(events):
    """``events`` split into ``[(pass_name, its events)]``, in order."""
    out = []
    for e in events:
        if not out or out[-1][0] != e[0]:
            out.append((e[0], []))
        out[-1][1].append(e)
    return out


def _decode_streamer(on_host: bool):
    """Three stages of a toy KV cache (``y = x + tanh(sum of cached x @ wk)``, state ``k`` of 4 rows) and a head."""
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    dsh = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    rng = np.random.default_rng(0)
    params = [{"wk": rng.standard_normal((8, 8)).astype(np.float32) * 0.3} for _ in range(3)]
    params.append({"w": rng.standard_normal((8, 3)).astype(np.float32)})

    def cached(p, s, x):
        k = jax.lax.dynamic_update_slice_in_dim(s["k"], x @ p["wk"], s["n"], axis=0)
        return x + jax.numpy.tanh(k.sum(0, keepdims=True)), {"k": k, "n": s["n"] + 1}

    sav = {"k": jax.ShapeDtypeStruct((4, 8), np.float32), "n": jax.ShapeDtypeStruct((), np.int32)}
    st = StatefulStreamer([cached] * 3 + [lambda p, x: x @ p["w"]], [jax.device_put(p, host) for p in params],
                          [jax.tree_util.tree_map(lambda _: dsh, p) for p in params], state_avals=[sav] * 3 + [None],
                          activation_sharding=dsh, state_on_host=on_host, prefetch_depth=2)
    return st, params


@pytest.mark.parametrize("on_host", [False, True])
def test_decode_runs_its_schedule_through_the_executor(passes, on_host):
    """Each run is one forward pass of the executor, whose events are the schedule's (cold, then steady: the
    carried stages taken; the host KV cache fetched beside each stage's weights); values as a plain loop."""
    st, params = _decode_streamer(on_host)
    states = [{"k": np.zeros((4, 8), np.float32), "n": 0} for _ in range(3)]
    for call in range(3):
        x = np.random.default_rng(call).standard_normal((1, 8)).astype(np.float32)
        expect = st.schedule()
        passes.clear()
        got = np.asarray(st.run(x))
        assert st.last_schedule == expect
        assert passes == [("forward", list(expect.events()))]
        assert st.executed_events == list(expect.events())
        assert any(e[2] == "fetch_state" for e in st.executed_events) == on_host
        assert any(e[2] == "take" for e in st.executed_events) == (call > 0)
        for i in range(3):                               # the reference: the same stages in numpy
            k = states[i]["k"].copy()
            k[states[i]["n"]] = (x @ params[i]["wk"])[0]
            states[i] = {"k": k, "n": states[i]["n"] + 1}
            x = x + np.tanh(k.sum(0, keepdims=True))
        np.testing.assert_allclose(got, x @ params[-1]["w"], rtol=1e-5, atol=1e-5)


def test_runtime_passes_run_through_the_executor(passes):
    """A forward, a fused-update step and a clipped step (with its separate update pass): each pass of each
    call runs through the executor, in the schedule's order, with the schedule's events."""
    rt = StreamingRuntime(layer, make_params(4), RuntimeConfig(prefetch_depth=2), optimizer=AdamW(lr=1e-2))
    x = make_input()
    for kw, names in ((None, ["forward"]), ({}, ["forward", "backward"]),
                      (dict(max_grad_norm=0.5), ["forward", "backward", "update"])):
        passes.clear()
        if kw is None:
            rt.forward(x)
        else:
            rt.train_step(x, loss_fn, **kw)
        assert [p for p, _ in passes] == names == [pro.pass_name for pro in rt.last_schedule.prologues]
        assert passes == _by_pass(rt.executed_events)
        assert rt.executed_events == list(rt.last_schedule.events())


@pytest.fixture
def dispatches(monkeypatch):
    """The host's dispatch order while the test runs: ``("exe",)`` per executable call, ``("block",)`` per
    ``jax.block_until_ready`` and ``("put", arg)`` per ``jax.device_put`` (``arg`` the object copied)."""
    log = []
    put, block, call = jax.device_put, jax.block_until_ready, jax.stages.Compiled.__call__

    def logged_put(x, *a, **kw):
        log.append(("put", x))
        return put(x, *a, **kw)

    def logged_block(x):
        log.append(("block",))
        return block(x)

    def logged_call(self, *a, **kw):
        log.append(("exe",))
        return call(self, *a, **kw)

    monkeypatch.setattr(jax, "device_put", logged_put)
    monkeypatch.setattr(jax, "block_until_ready", logged_block)
    monkeypatch.setattr(jax.stages.Compiled, "__call__", logged_call)
    return log


def _weight_order(log, host_params):
    """``log`` with the copies of stage weights as ``("put", stage)`` and every other copy left out."""
    out = []
    for e in log:
        if e[0] != "put":
            out.append(e)
        else:
            out += [("put", j) for j, p in enumerate(host_params) if e[1] is p]
    return out


def _expected_order(sched, throttle: bool):
    """The prologue's weight copies, then per step: the stage's executable, the throttle wait, the step's copies
    (for the next call, then for this one, as ``EVENT_KINDS`` orders them)."""
    out = [("put", j) for j in sched.prologues[0].fetch]
    for s in sched.pass_steps("forward"):
        out += [("exe",)] + [("block",)] * throttle + [("put", j) for j in s.fetch_next + s.fetch]
    return out


@pytest.mark.parametrize("on_host", [False, True])
def test_decode_dispatch_order(dispatches, on_host):
    """A decode run dispatches stage ``i``, waits for stage ``i-1``, then issues the copies ``k`` stages ahead (the
    order that lets copies overlap compute), cold and steady."""
    st, _ = _decode_streamer(on_host)
    for call in range(3):
        sched = st.schedule()
        dispatches.clear()
        st.run(np.ones((1, 8), np.float32))
        assert _weight_order(dispatches, st.host_params) == _expected_order(sched, throttle=True), call


@pytest.mark.parametrize("throttle", [False, True])
def test_forward_dispatch_order(dispatches, throttle):
    """A runtime forward dispatches in the same order (the wait only with ``throttle``), cold and steady."""
    rt = StreamingRuntime(layer, make_params(4), RuntimeConfig(prefetch_depth=2, throttle=throttle))
    x = make_input()
    rt.forward(x)   # compiled
    rt.release_prefetched()
    for steady in (False, True):
        sched = rt.schedule(False, steady_state=steady)
        dispatches.clear()
        rt.forward(x)
        assert rt.last_schedule == sched
        assert _weight_order(dispatches, rt.host_params) == _expected_order(sched, throttle), steady


@pytest.mark.parametrize("which", ["runtime", "decode"])
def test_warm_calls_build_no_stage_keys(monkeypatch, which):
    """A call whose input signature ran before finds each stage's executable by stage: it builds no stage key
    (a walk over the stage's weights, on the host's critical path of every call), compiles nothing, and
    returns what the first call returned."""
    from xla_swap.executors.streaming import stage_store
    if which == "runtime":
        obj = StreamingRuntime(layer, make_params(4), RuntimeConfig(prefetch_depth=2))
        x, call = make_input(), obj.forward
    else:
        obj, _ = _decode_streamer(on_host=False)
        x, call = np.ones((1, 8), np.float32), obj.run
    built, compiled = [], []
    real_key, real_compile = stage_store.param_key, jax.stages.Lowered.compile
    monkeypatch.setattr(stage_store, "param_key", lambda *a: built.append(a) or real_key(*a))
    monkeypatch.setattr(stateful_streamer, "param_key", lambda *a: built.append(a) or real_key(*a))
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda *a, **k: compiled.append(a) or real_compile(*a, **k))
    first = np.asarray(call(x))
    assert built and compiled   # the first call keys and compiles its stages
    built.clear()
    compiled.clear()
    again = np.asarray(call(x))
    assert built == [] and compiled == []
    if which == "runtime":   # a stateless forward: the same output; the decode step advanced its KV cache
        np.testing.assert_array_equal(again, first)
