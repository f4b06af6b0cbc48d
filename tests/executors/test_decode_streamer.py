"""``StatefulStreamer``: stages with a persistent per-stage state (a toy KV cache), weights streamed from
``pinned_host``; results equal a plain jax loop, with the state in device memory and in ``pinned_host``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xla_swap.executors.streaming.stateful_streamer import StatefulStreamer, state_nbytes
from xla_swap.planning.prefetch import PrefetchSchedule

D, L, N = 8, 6, 5


def layer(p, s, x):
    """Append x's rows at slot s['n'] of the cache, attend over the filled slots (a toy KV cache)."""
    slot = s["n"]
    k = jax.lax.dynamic_update_slice_in_dim(s["k"], x @ p["wk"], slot, axis=0)
    mask = (jnp.arange(L) <= slot)[:, None]
    y = x + jnp.tanh(jnp.sum(jnp.where(mask, k, 0), axis=0, keepdims=True) @ p["wo"])
    return y, {"k": k, "n": slot + 1}


def head(p, x):
    return x @ p["w"]


def _setup(on_host, prefetch_depth=2, resident=None):
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    dsh = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    rng = np.random.default_rng(0)
    params = [{"wk": rng.standard_normal((D, D)).astype(np.float32) * 0.3,
               "wo": rng.standard_normal((D, D)).astype(np.float32) * 0.3} for _ in range(N)]
    params.append({"w": rng.standard_normal((D, 3)).astype(np.float32)})
    host_params = [jax.device_put(p, host) for p in params]
    shardings = [jax.tree_util.tree_map(lambda _: dsh, p) for p in params]
    sav = {"k": jax.ShapeDtypeStruct((L, D), np.float32), "n": jax.ShapeDtypeStruct((), np.int32)}
    fns = [layer] * N + [head]
    st = StatefulStreamer(fns, host_params, shardings, state_avals=[sav] * N + [None], activation_sharding=dsh,
                          state_on_host=on_host, prefetch_depth=prefetch_depth, resident=resident)
    if resident is not None:                  # a resident stage's weights are in device memory already
        for i, r in enumerate(resident):
            if r:
                host_params[i] = jax.device_put(params[i], dsh)
    return st, params


def _reference(params, xs):
    states = [{"k": jnp.zeros((L, D)), "n": jnp.int32(0)} for _ in range(N)]
    outs = []
    for x in xs:
        for i in range(N):
            x, states[i] = layer(params[i], states[i], x)
        outs.append(head(params[-1], x))
    return outs


@pytest.mark.parametrize("on_host", [False, True])
def test_equals_a_plain_loop(on_host):
    st, params = _setup(on_host)
    xs = [np.random.default_rng(i).standard_normal((1, D)).astype(np.float32) for i in range(4)]
    ref = _reference(params, xs)
    for x, r in zip(xs, ref):
        np.testing.assert_allclose(np.asarray(st.run(x)), np.asarray(r), rtol=1e-5, atol=1e-5)
    kinds = {st.states[i]["k"].sharding.memory_kind for i in range(N)}
    assert kinds == {"pinned_host" if on_host else "device"}
    assert st.num_executables == 2          # one layer executable shared by every layer, one head
    assert st.state_nbytes[:N] == [L * D * 4 + 4] * N
    assert state_nbytes(st.state_avals[0]) == L * D * 4 + 4


def test_state_avals_checked():
    st, _ = _setup(False)
    st.state_avals[0] = {"k": jax.ShapeDtypeStruct((L + 1, D), np.float32), "n": jax.ShapeDtypeStruct((), np.int32)}
    with pytest.raises(ValueError, match="stage 0"):
        st.run(np.zeros((1, D), np.float32))
    with pytest.raises(TypeError, match="state_on_host"):
        StatefulStreamer([head], [{}], [{}], state_avals=[None], activation_sharding=st.activation_sharding,
                         state_on_host="yes")


@pytest.mark.parametrize("on_host", [False, True])
def test_executables_read_only(on_host):
    """``executables(x)``: the compiled stage executables of x's signature, shared where stages share one; nothing runs."""
    st, params = _setup(on_host)
    x = np.ones((1, D), np.float32)
    st.run(x)
    before = [jax.device_get(s) for s in st.states[:N]]
    exes = st.executables(jax.ShapeDtypeStruct((1, D), np.float32))
    assert len(exes) == N + 1 and all(e is exes[0] for e in exes[:N]) and exes[-1] is not exes[0]
    assert st.num_executables == 2                    # the run's executables, none compiled again
    for s, b in zip(st.states[:N], before):           # the states are untouched (not donated, not advanced)
        np.testing.assert_array_equal(np.asarray(s["k"]), b["k"])
        assert int(s["n"]) == int(b["n"]) == 1
    assert "dot" in exes[0].as_text()
    st.executables(np.ones((2, D), np.float32))       # a new signature compiles, still runs nothing
    assert st.num_executables == 4 and int(st.states[0]["n"]) == 1
    with pytest.raises(TypeError, match="x"):
        st.executables({})


@pytest.mark.parametrize("k,resident", [(1, None), (2, None), (N + 1, None), (N + 3, None),
                                        (2, (False, True, False, False, True, False))])
@pytest.mark.parametrize("on_host", [False, True])
def test_run_executes_one_prefetch_schedule(on_host, k, resident):
    """Every run performs exactly the events of its ``PrefetchSchedule`` (forward, cyclic next-call
    keeps, host states fetched beside their stage's weights), cold and in steady state, and after a
    stage's weights are replaced (that stage is fetched again, not taken); values equal a plain loop."""
    st, params = _setup(on_host, prefetch_depth=k, resident=resident)
    xs = [np.random.default_rng(i).standard_normal((1, D)).astype(np.float32) for i in range(4)]
    ref = _reference(params, xs)
    state = tuple(on_host and i < N for i in range(N + 1))
    res = resident or (False,) * (N + 1)
    for call, (x, r) in enumerate(zip(xs, ref)):
        expect = st.schedule()
        if call == 0:                                  # cold: nothing carried in
            assert expect == PrefetchSchedule(N + 1, k, resident=res, carry=(), host_state=state)
        elif call == 3:                                # stage 0's weights replaced (same values): fetched again
            st.host_params[0] = jax.device_put(params[0], jax.tree_util.tree_leaves(st.host_params[0])[0].sharding)
            expect = st.schedule()
            assert 0 not in expect.carried_in
        np.testing.assert_allclose(np.asarray(st.run(x)), np.asarray(r), rtol=1e-5, atol=1e-5)
        assert st.last_schedule == expect
        assert st.executed_events == list(expect.events())
        fetched_state = [e[3] for e in st.executed_events if e[2] == "fetch_state"]
        assert fetched_state == (list(range(N)) if on_host else [])
        takes = [e[3] for e in st.executed_events if e[2] == "take"]
        if call in (1, 2):                             # steady state: the carried-in stages are taken, not copied
            assert takes and set(takes) == set(expect.carried_in) == set(j for j in range(min(k, N + 1)) if not res[j])
