"""The pieces of routed-expert fetching, jax alone: ``split_at`` cuts a trace at its ``experts_call`` into
halves that compute what the whole computes (an independent branch written after the call lands before
it), refuses what it cannot cut; ``ExpertStore`` copies exactly the chosen experts of a stacked
``pinned_host`` weight, in both layouts (``"split"``: one packed buffer, one copy, per chosen expert, the
stacked arrays deleted and put back bit-exact by ``restore``); ``Packing`` round-trips mixed dtypes on the
device; the layout choice follows the expert size."""
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from xla_swap.executors.streaming.jaxpr_split import split_at
from xla_swap.executors.streaming.expert_store import PACKED, Packing
from xla_swap.executors.streaming.routed_experts import EXPERTS_CALL, ExpertStore, experts_call
from xla_swap.planning.routing import SPLIT_MIN_EXPERT_BYTES, choose_expert_layout

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
def test_expert_store_copies_the_chosen_experts(layout):
    d = jax.devices()[0]
    host = SingleDeviceSharding(d, memory_kind="pinned_host")
    dev = SingleDeviceSharding(d, memory_kind="device")
    rng = np.random.default_rng(1)
    w = {"a": rng.standard_normal((E, 3, 2), np.float32), "b": rng.standard_normal((E, 2), np.float32)}
    params = jax.device_put(w, host)
    store = ExpertStore(layout, dev)
    per_expert = sum(v.nbytes for v in w.values()) // E
    for ids in (np.array([1, 4, 5], np.int32), np.array([0], np.int32)):
        got = store.fetch(0, params, {"a", "b"}, ids)
        if layout == "split":   # one packed buffer per chosen expert, unpacked on the device
            assert set(got) == {PACKED} and len(got[PACKED]) == len(ids)
            packing = Packing.of(params)
            rows = [jax.jit(packing.unpack)(b) for b in got[PACKED]]
            got = {n: [r[n] for r in rows] for n in w}
            assert store.copies[-1] == (0, len(ids), len(ids) * per_expert)
        else:
            assert store.copies[-1] == (0, 2 * len(ids), len(ids) * per_expert)
        for n in w:
            assert all(a.sharding.memory_kind == "device" for a in got[n])
            np.testing.assert_array_equal(np.stack([np.asarray(a) for a in got[n]]), w[n][ids])
    assert store.host_nbytes() == 0   # each expert held once
    assert all(v.is_deleted() for v in params.values()) == (layout == "split")
    holder = [params]
    store.restore(holder)
    assert (holder[0] is params) == (layout == "stacked")
    for n in w:
        assert holder[0][n].sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(holder[0][n]), w[n])
    with pytest.raises(ValueError, match="expert layout must be one of"):
        ExpertStore("rows", dev)


def test_packing_round_trips_mixed_dtypes_on_the_device():
    rng = np.random.default_rng(2)
    w = {"w": rng.standard_normal((E, 4, 3)).astype(jnp.bfloat16), "bias": rng.standard_normal((E, 4), np.float32),
         "scale": rng.integers(0, 255, (E, 5)).astype(np.uint8)}
    packing = Packing.of(w)
    assert packing.dtype == np.uint8 and packing.nbytes == sum(v.nbytes for v in w.values()) // E
    for e in (0, E - 1):
        buf = packing.pack({n: v[e] for n, v in w.items()})
        assert buf.shape == (packing.length,)
        on_dev = jax.jit(packing.unpack)(jnp.asarray(buf))
        for n, v in w.items():
            assert on_dev[n].dtype == v.dtype
            np.testing.assert_array_equal(np.asarray(on_dev[n]), v[e])
            np.testing.assert_array_equal(packing.unpack(buf)[n], v[e])
    same = Packing.of({"a": w["w"], "b": w["w"][:, :2]})
    assert same.dtype == jnp.bfloat16 and same.offsets == (0, 12)


def test_layout_follows_the_expert_size():
    assert choose_expert_layout(SPLIT_MIN_EXPERT_BYTES) == "split"
    assert choose_expert_layout(SPLIT_MIN_EXPERT_BYTES - 1) == "stacked"
    assert choose_expert_layout(9_437_184) == "stacked"     # Qwen3-30B-A3B: 3 x 2048 x 768 bf16
    assert choose_expert_layout(352_321_536) == "split"     # Mixtral-8x7B: 3 x 4096 x 14336 bf16
    assert choose_expert_layout(1 << 20, min_split=1 << 20) == "split"
    with pytest.raises(ValueError, match="expert_nbytes must be an int >= 0"):
        choose_expert_layout(-1)
