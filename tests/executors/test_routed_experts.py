"""The pieces of routed-expert fetching, jax alone: ``split_at`` cuts a trace at its ``experts_call`` into
halves that compute what the whole computes (an independent branch written after the call lands before
it), refuses what it cannot cut; ``ExpertStore`` copies exactly the chosen experts' slices of a stacked
``pinned_host`` weight, in both layouts, and leaves the host array whole."""
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from xla_swap.executors.streaming.jaxpr_split import split_at
from xla_swap.executors.streaming.routed_experts import EXPERTS_CALL, ExpertStore, experts_call

E, N, K, D = 6, 5, 2, 4


def layer(p, x, idx, wts):
    """A stand-in layer: a pre-norm, the experts call, a 'shared expert' written after it, a residual."""
    h = x * p["norm"]
    routed = experts_call(h, idx, wts)
    shared = jnp.tanh(x @ p["shared"])      # independent of the call: belongs before it
    return routed + shared + x, h.sum()


def experts(w, h, idx, wts):
    """What the call stands for: each token's k experts (rows of w), weighted."""
    return jnp.einsum("nk,nkd->nd", wts, h[:, None, :] * w[idx])


def avals():
    f = jax.ShapeDtypeStruct
    return ({"experts": f((E, D), jnp.float32), "norm": f((D,), jnp.float32), "shared": f((D, D), jnp.float32)},
            f((N, D), jnp.float32), f((N, K), jnp.int32), f((N, K), jnp.float32))


def test_split_halves_compute_the_whole():
    rng = np.random.default_rng(0)
    p = {"experts": rng.standard_normal((E, D), np.float32), "norm": rng.standard_normal(D).astype(np.float32),
         "shared": rng.standard_normal((D, D), np.float32)}
    x = rng.standard_normal((N, D), np.float32)
    idx = rng.integers(0, E, (N, K)).astype(np.int32)
    wts = rng.random((N, K), np.float32)
    closed = jax.make_jaxpr(layer)(*avals())
    flat = jax.tree_util.tree_leaves((p, x, idx, wts))
    sp = split_at(closed, EXPERTS_CALL, drop=[0])   # the experts' weight: not read before the call
    assert sp.kept == (1, 2, 3, 4, 5) and sp.n_marker_in == 3
    assert "tanh" in str(sp.before.jaxpr) and "tanh" not in str(sp.after.jaxpr)
    outs = jcore.jaxpr_as_fun(sp.before)(*[flat[k] for k in sp.kept])
    h, i, w = outs[:3]
    boundary, early = outs[3:3 + sp.n_boundary], outs[3 + sp.n_boundary:]
    late = jcore.jaxpr_as_fun(sp.after)(experts(p["experts"], h, i, w), *boundary)
    got = sp.assemble(early, late)
    want_y = experts(p["experts"], x * p["norm"], idx, wts) + np.tanh(x @ p["shared"]) + x
    np.testing.assert_allclose(got[0], want_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], (x * p["norm"]).sum(), rtol=1e-6)


def test_split_refuses_what_it_cannot_cut():
    closed = jax.make_jaxpr(layer)(*avals())
    with pytest.raises(ValueError, match=r"inputs \[2\] of the trace are read outside"):
        split_at(closed, EXPERTS_CALL, drop=[2])   # the norm weight is read before the call

    def twice(p, x, idx, wts):
        return experts_call(experts_call(x, idx, wts), idx, wts)
    with pytest.raises(ValueError, match="calls xla_swap_experts_call 2 times"):
        split_at(jax.make_jaxpr(twice)(*avals()), EXPERTS_CALL)
    with pytest.raises(ValueError, match="calls xla_swap_experts_call 0 times"):
        split_at(jax.make_jaxpr(lambda p, x, i, w: x * 2)(*avals()), EXPERTS_CALL)


@pytest.mark.parametrize("layout", ["stacked", "split"])
def test_expert_store_copies_the_chosen_slices(layout):
    d = jax.devices()[0]
    host = SingleDeviceSharding(d, memory_kind="pinned_host")
    dev = SingleDeviceSharding(d, memory_kind="device")
    rng = np.random.default_rng(1)
    w = {"a": rng.standard_normal((E, 3, 2), np.float32), "b": rng.standard_normal((E, 2), np.float32)}
    params = jax.device_put(w, host)
    store = ExpertStore(layout, dev)
    ids = np.array([1, 4, 5], np.int32)
    got = store.fetch(0, params, {"a", "b"}, ids, jax.device_put(ids, dev))
    for n in w:
        v = jnp.stack(got[n]) if isinstance(got[n], list) else got[n]
        assert all(a.sharding.memory_kind == "device" for a in (got[n] if isinstance(got[n], list) else [v]))
        np.testing.assert_array_equal(np.asarray(v), w[n][ids])
        assert params[n].shape[0] == E and params[n].sharding.memory_kind == "pinned_host"
    assert store.host_nbytes() == (sum(v.nbytes for v in w.values()) if layout == "split" else 0)
    with pytest.raises(ValueError, match="expert layout must be one of"):
        ExpertStore("rows", dev)
