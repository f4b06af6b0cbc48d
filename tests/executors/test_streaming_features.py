"""StreamingRuntime features beyond the plain stack: several input signatures, integer
(constant) leaves, the per-stage AdamW update with its state in ``pinned_host``, resident
stages, ``from_policy``, and the bounded loss-function cache.

References: a monolithic ``jax`` program over the whole stack with every weight in device
memory, and a numpy AdamW written from ``torch.optim.AdamW``'s update rule.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xla_swap.executors import TraceRecorder
from xla_swap.executors.streaming.runtime import MAX_LOSS_FNS
from xla_swap.executors.streaming import RuntimeConfig, StreamingRuntime
from xla_swap.planning import AdamW, OffloadPolicy

L, D, F, T = 4, 16, 32, 8


def layer(p, h):
    return h + jax.nn.gelu(h @ p["a"]) @ p["b"]


def make_params(n=L, seed=0):
    rng = np.random.default_rng(seed)
    return [{"a": (rng.standard_normal((D, F)) / np.sqrt(D)).astype(np.float32),
             "b": (rng.standard_normal((F, D)) / np.sqrt(F) * 0.5).astype(np.float32)} for _ in range(n)]


def make_input(t=T, seed=1):
    return np.random.default_rng(seed).standard_normal((t, D)).astype(np.float32)


def loss_fn(out, target):
    return jnp.mean((out - target) ** 2)


def ref_loss(params, x, target):
    h = x
    for p in params:
        h = layer(p, h)
    return loss_fn(h, target)


def numpy_adamw(params, grads, state, step, opt: AdamW):
    """torch.optim.AdamW's single-tensor update, in float64 numpy."""
    b1, b2 = opt.betas
    out_p, out_s = [], []
    for p, g, (m, v) in zip(params, grads, state):
        p = p * (1 - opt.lr * opt.weight_decay)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        denom = np.sqrt(v) / np.sqrt(1 - b2 ** step) + opt.eps
        out_p.append(p - opt.lr / (1 - b1 ** step) * m / denom)
        out_s.append((m, v))
    return out_p, out_s


def test_several_input_shapes_bounded_cache():
    params, x = make_params(), make_input()
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2, max_signatures=2))
    ref = jax.jit(lambda x: jax.tree_util.tree_reduce(lambda h, p: layer(p, h), params, x,
                                                      is_leaf=lambda n: isinstance(n, dict)))
    for t in (8, 4, 8, 2):  # 8 is reused, 2 evicts the least recently used signature (4)
        xt = make_input(t, seed=t)
        np.testing.assert_allclose(np.asarray(rt.forward(xt)), np.asarray(ref(xt)), rtol=1e-5, atol=1e-5)
    assert rt.num_signatures == 2
    assert rt.num_executables == 2  # one forward executable per cached signature
    # a bf16 input would be computed in float32 by the shared float32 layers: refused, nothing cached
    with pytest.raises(TypeError, match=r"h: stage 0 gets dtype bfloat16 and returns float32.*pass float32"):
        rt.forward(x.astype(jnp.bfloat16))
    assert rt.num_signatures == 2


def test_integer_leaves_are_constants():
    """An int32 carry leaf (position ids) and an int32 parameter leaf (an index buffer) get no gradient."""
    params, x = make_params(), make_input()
    sp = [dict(p, idx=np.arange(D, dtype=np.int32)[::-1].copy()) for p in params]

    def stage(p, carry):
        h, pos = carry
        return layer(p, h)[:, p["idx"]] + pos[:, None].astype(h.dtype) * 0.01, pos

    def mono(params, x, pos):
        h = x
        for p in params:
            h, pos = stage(p, (h, pos))
        return jnp.sum(jnp.sin(h))

    pos = np.arange(T, dtype=np.int32)
    rt = StreamingRuntime(stage, sp, RuntimeConfig(prefetch_depth=2))
    loss, (gx, gpos), grads = rt.train_step((x, pos), lambda out: jnp.sum(jnp.sin(out[0])))
    floats = [{"a": p["a"], "b": p["b"]} for p in sp]
    ref_val, (ref_gp, ref_gx) = jax.value_and_grad(
        lambda fp, x: mono([dict(f, idx=p["idx"]) for f, p in zip(fp, sp)], x, pos), argnums=(0, 1))(floats, x)
    np.testing.assert_allclose(float(loss), float(ref_val), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(ref_gx), rtol=1e-5, atol=1e-5)
    assert gpos is None and grads[1]["idx"] is None
    np.testing.assert_allclose(np.asarray(grads[2]["a"]), np.asarray(ref_gp[2]["a"]), rtol=1e-5, atol=1e-5)
    assert grads[2]["a"].sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("remat,k,on_host", [(True, 1, True), (False, 2, True), (True, 2, False)])
def test_adamw_update_matches_numpy_reference(remat, k, on_host):
    params, x = make_params(), make_input()
    target = make_input(seed=7)
    opt = AdamW(lr=1e-2, weight_decay=0.1)
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k, remat=remat, optimizer_state_on_host=on_host),
                          optimizer=opt)
    ref_p = [[np.float64(p["a"]), np.float64(p["b"])] for p in params]
    ref_s = [[(np.zeros((D, F)), np.zeros((D, F))), (np.zeros((F, D)), np.zeros((F, D)))] for _ in params]
    grad = jax.jit(jax.grad(ref_loss))
    for step in range(1, 4):
        cur = [{"a": jnp.asarray(a, jnp.float32), "b": jnp.asarray(b, jnp.float32)} for a, b in ref_p]
        g = grad(cur, x, target)
        loss, _, grads = rt.train_step(x, loss_fn, loss_args=(target,))
        assert grads is None and rt.step == step
        np.testing.assert_allclose(float(loss), float(ref_loss(cur, x, target)), rtol=1e-5)
        for i in range(L):
            ref_p[i], ref_s[i] = numpy_adamw(ref_p[i], [np.float64(g[i]["a"]), np.float64(g[i]["b"])],
                                             ref_s[i], step, opt)
    for i in range(L):
        np.testing.assert_allclose(np.asarray(rt.host_params[i]["a"]), ref_p[i][0], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.asarray(rt.optimizer_state[i][1][1]), ref_s[i][1][1], rtol=1e-3, atol=1e-9)
        kind = "pinned_host" if on_host else "device"
        assert rt.host_params[i]["a"].sharding.memory_kind == "pinned_host"
        assert {a.sharding.memory_kind for a in jax.tree_util.tree_leaves(rt.optimizer_state[i])} == {kind}
    # the user's arrays were copied, never donated or changed
    np.testing.assert_array_equal(params[0]["a"], make_params()[0]["a"])


def test_resident_stages_and_from_policy():
    params, x = make_params(), make_input()
    target = make_input(seed=7)
    policy = OffloadPolicy(params="device", grads="device", prefetch_depth=2, remat=True)
    rt = StreamingRuntime.from_policy(layer, params, policy)
    assert rt.resident == (True,) * L and rt.prefetch_depth == 2 and rt.remat is True
    assert rt.host_params[0]["a"].sharding.memory_kind == "device"
    loss, _, grads = rt.train_step(x, loss_fn, loss_args=(target,))
    ref_g = jax.grad(ref_loss)(params, x, target)
    np.testing.assert_allclose(np.asarray(grads[3]["b"]), np.asarray(ref_g[3]["b"]), rtol=1e-5, atol=1e-6)
    assert grads[3]["b"].sharding.memory_kind == "device"
    resident_a = rt.host_params[0]["a"]
    rt.train_step(x, loss_fn, loss_args=(target,))  # resident weights are neither copied nor donated
    assert rt.host_params[0]["a"] is resident_a and not resident_a.is_deleted()
    # a policy with an optimizer on the host, no recompute
    host = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=False, prefetch_depth=1)
    rt2 = StreamingRuntime.from_policy(layer, params, host, optimizer=AdamW())
    assert rt2.resident == (False,) * L and rt2.remat is False and rt2.optimizer_state_on_host
    with pytest.raises(ValueError, match="activations offloads"):
        StreamingRuntime.from_policy(layer, params, OffloadPolicy(params="host", activations={"a": "host"}))
    with pytest.raises(ValueError, match="prefetch_depth: decided by the policy"):
        StreamingRuntime.from_policy(layer, params, host, RuntimeConfig(prefetch_depth=3))
    with pytest.raises(TypeError, match="policy must be"):
        StreamingRuntime.from_policy(layer, params, {"params": "host"})


def test_new_loss_closure_each_step_is_bounded():
    params, x = make_params(2), make_input()
    rt = StreamingRuntime(layer, params)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for s in range(MAX_LOSS_FNS + 3):
            t = make_input(seed=s)
            rt.train_step(x, lambda out, t=t: loss_fn(out, t))
    assert len(rt._loss_jits) == MAX_LOSS_FNS
    assert any("distinct loss_fn" in str(m.message) for m in w)


def test_bad_optimizer_arguments():
    params = make_params(2)
    with pytest.raises(TypeError, match="optimizer must be"):
        StreamingRuntime(layer, params, optimizer="adamw")
    with pytest.raises(ValueError, match="AdamW lr must be >= 0"):
        AdamW(lr=-1e-3)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        AdamW(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="resident must be"):
        StreamingRuntime(layer, params, RuntimeConfig(resident=[True]))
    rt = StreamingRuntime(layer, params)
    with pytest.raises(ValueError, match="lr is only used with an optimizer"):
        rt.train_step(make_input(), lambda o: jnp.sum(o), lr=0.1)


def test_layer_cost_from_the_compiled_stage():
    """``layer_cost`` gives the planner a stage's bytes from the runtime itself."""
    params, x = make_params(), make_input()
    rt = StreamingRuntime(layer, params, RuntimeConfig(remat=False), optimizer=None)
    cost = rt.layer_cost(x, 1, flops_per_s=1e9)
    assert cost.param_bytes == cost.grad_bytes == 4 * (D * F + F * D)
    assert cost.carry_bytes == 4 * T * D and cost.optimizer_bytes == 0
    assert cost.flops >= 2 * 2 * T * D * F                    # the two matmuls at least
    rt.train_step(x, lambda o: jnp.sum(o))
    assert cost.intermediate_bytes == rt.residual_nbytes[1] > 0  # what remat=False keeps, as trained
    timed = StreamingRuntime(layer, params, optimizer=AdamW()).layer_cost(x, 0, measure_reps=2)
    assert timed.forward_s > 0 and timed.optimizer_bytes == 2 * cost.param_bytes
    with pytest.raises(ValueError, match="exactly one of measure_reps"):
        rt.layer_cost(x, 0)
    with pytest.raises(ValueError, match="stage must be"):
        rt.layer_cost(x, L, flops_per_s=1e9)


@pytest.mark.parametrize("remat,k", [(True, 1), (False, 2)])
def test_activation_offload_keeps_values_and_gradients(remat, k):
    """Stage inputs (and saved residuals) through pinned_host and back k stages ahead: same loss and gradients."""
    params, x = make_params(), make_input()
    target = make_input(seed=7)
    ref = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k, remat=remat))
    off = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k, remat=remat, offload_activations=True))
    l0, gx0, g0 = ref.train_step(x, loss_fn, loss_args=(target,))
    l1, gx1, g1 = off.train_step(x, loss_fn, loss_args=(target,))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l0))
    np.testing.assert_array_equal(np.asarray(gx1), np.asarray(gx0))
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # every stage but the last k+1 (kept on the device across the turn) sent its input (and residuals) to the host
    per_stage = 4 * T * D + (off.residual_nbytes[0] if not remat else 0)
    assert off.offloaded_activation_nbytes == (L - k - 1) * per_stage > 0
    assert ref.offloaded_activation_nbytes == 0


def _h2d(rt, pass_name=None):
    return [(e.pass_name, e.stage) for e in rt.trace.events
            if e.kind == "h2d" and (pass_name is None or e.pass_name == pass_name)]


@pytest.mark.parametrize("k", [1, 2, 5])
def test_prefetch_next_call_forward_streams_fewer_stages(k):
    """Serving loop: the second call takes its first min(k, L) stages from device memory."""
    params, x = make_params(), make_input()
    ref = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k, prefetch_next_call=False))
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k), trace=TraceRecorder())
    want = np.asarray(ref.forward(x))
    nc = min(k, L)
    np.testing.assert_array_equal(np.asarray(rt.forward(x)), want)
    assert len(_h2d(rt, "forward")) == L and len(_h2d(rt, "next")) == (nc if k < L else 0)
    assert rt.prefetched_stages == list(range(nc))
    for a in jax.tree_util.tree_leaves(rt._carry[0][1]):
        assert a.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(rt.forward(x)), want)
    assert len(_h2d(rt, "forward")) == L - nc  # the carried stages are not streamed again
    rt.release_prefetched()
    assert rt.prefetched_stages == []
    np.testing.assert_array_equal(np.asarray(rt.forward(x)), want)
    assert len(_h2d(rt, "forward")) == L


def test_prefetch_next_call_bounds_live_stages():
    k = 2
    rt = StreamingRuntime(layer, make_params(), RuntimeConfig(prefetch_depth=k))
    x = make_input()
    for _ in range(3):
        jax.block_until_ready(rt.forward(x))
        jax.block_until_ready(rt.train_step(x, loss_fn, loss_args=(x,))[:2])
    assert rt.max_resident_stages <= k + 1
    assert rt.resident_stages() <= k + 1  # between calls: the carried stages only


def test_prefetch_next_call_without_optimizer_matches_reference():
    """train_step -> forward -> train_step: values and gradients equal the non-cyclic runtime."""
    params, x = make_params(), make_input()
    tgt = make_input(seed=3)
    ref = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2, prefetch_next_call=False))
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), trace=TraceRecorder())
    for _ in range(2):
        a, b = ref.train_step(x, loss_fn, loss_args=(tgt,)), rt.train_step(x, loss_fn, loss_args=(tgt,))
        np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
        for ga, gb in zip(a[2], b[2]):
            for la, lb in zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb)):
                np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
        # the backward kept stages 0, 1 and 2 (not donated, not streamed again; stage 2 in the free
        # slot of its window) for the next call
        assert _h2d(rt, "next") == [] and rt.prefetched_stages == [0, 1, 2]
        np.testing.assert_array_equal(np.asarray(ref.forward(x)), np.asarray(rt.forward(x)))
        assert len(_h2d(rt, "forward")) == L - 3


@pytest.mark.parametrize("on_host", [True, False])
def test_prefetch_next_call_carries_updated_weights(on_host):
    """With the optimizer the carried copies are the updated weights: every step and the final
    forward equal a runtime that streams everything (a stale copy would differ after step 1)."""
    params, x = make_params(), make_input()
    tgt = make_input(seed=3)
    opt = AdamW(lr=1e-2)
    ref = StreamingRuntime(layer, params,
                           RuntimeConfig(prefetch_depth=2, optimizer_state_on_host=on_host, prefetch_next_call=False),
                           optimizer=opt)
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2, optimizer_state_on_host=on_host),
                          optimizer=opt, trace=TraceRecorder())
    for _ in range(3):
        la = ref.train_step(x, loss_fn, loss_args=(tgt,))[0]
        lb = rt.train_step(x, loss_fn, loss_args=(tgt,))[0]
        np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
        # stages 0, 1, 2: the updated weights stay on the device, nothing streamed for the next call
        assert _h2d(rt, "next") == []
    assert len(_h2d(rt, "forward")) == L - 3
    assert rt.prefetched_stages == [0, 1, 2]
    assert rt._carry[0][0] is rt.host_params[0]
    np.testing.assert_array_equal(np.asarray(ref.forward(x)), np.asarray(rt.forward(x)))


def test_prefetch_next_call_invalidated_by_new_host_params():
    params, x = make_params(), make_input()
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2))
    rt.forward(x)
    assert rt.prefetched_stages == [0, 1]
    new = make_params(seed=7)
    rt.host_params[0] = jax.device_put(new[0], jax.tree_util.tree_map(lambda a: a.sharding, rt.host_params[0]))
    want = StreamingRuntime(layer, [new[0]] + params[1:], RuntimeConfig(prefetch_depth=2)).forward(x)
    np.testing.assert_array_equal(np.asarray(rt.forward(x)), np.asarray(want))


def test_prefetch_next_call_flag_checked():
    with pytest.raises(TypeError, match="prefetch_next_call"):
        StreamingRuntime(layer, make_params(), RuntimeConfig(prefetch_next_call=1))


def test_load_stage_resumes_exactly_and_refuses_mismatches():
    """Weights, moments and step copied out of one runtime and loaded into a fresh one (other
    weights) resume its training exactly; a leaf of another shape or dtype, another structure or
    pending accumulated gradients are refused before anything changes."""
    opt = AdamW(lr=1e-2, weight_decay=0.1)
    x, y = make_input(), make_input(seed=2)
    a = StreamingRuntime(layer, make_params(), RuntimeConfig(prefetch_depth=1), optimizer=opt)
    b = StreamingRuntime(layer, make_params(seed=5), RuntimeConfig(prefetch_depth=1), optimizer=opt)
    for _ in range(2):
        a.train_step(x, loss_fn, loss_args=(y,))
    b.train_step(x, loss_fn, loss_args=(y,))   # b's device copies for the next call are stale after the load
    assert a.trainable_paths(0) == ["['a']", "['b']"]
    for i in range(L):
        b.load_stage(i, {k: np.asarray(v) for k, v in a.host_params[i].items()},
                     [tuple(np.asarray(t) for t in mv) for mv in a.optimizer_state[i]])
    b.step = a.step
    for rt in (a, b):
        rt.train_step(x, loss_fn, loss_args=(y,))
    for pa, pb in zip(a.host_params, b.host_params):
        for k in pa:
            np.testing.assert_array_equal(np.asarray(pa[k]), np.asarray(pb[k]))
    assert {s.memory_kind for s in jax.tree_util.tree_leaves(
        jax.tree_util.tree_map(lambda t: t.sharding, (b.host_params, b.optimizer_state)))} == {"pinned_host"}
    before = [np.asarray(b.host_params[0]["a"]), np.asarray(b.optimizer_state[0][0][0])]
    good = {k: np.asarray(v) for k, v in b.host_params[0].items()}
    with pytest.raises(ValueError, match=r"stage_params\[0\]\['a'\]: got shape \(16, 16\)"):
        b.load_stage(0, {**good, "a": np.zeros((D, D), np.float32)})
    with pytest.raises(ValueError, match=r"stage_params\[0\]\['b'\].*dtype float16"):
        b.load_stage(0, {**good, "b": good["b"].astype(np.float16)})
    with pytest.raises(ValueError, match="tree structure"):
        b.load_stage(0, {"a": good["a"]})
    with pytest.raises(ValueError, match=r"optimizer_state\[0\] must be 2 \(m, v\) pairs"):
        b.load_stage(0, good, [(np.zeros((D, F), np.float32),) * 2])
    with pytest.raises(ValueError, match="stage must be an int"):
        b.load_stage(L, good)
    b.train_step(x, loss_fn, loss_args=(y,), accumulate=True)
    with pytest.raises(ValueError, match="accumulated micro-batches"):
        b.load_stage(0, good)
    np.testing.assert_array_equal(np.asarray(b.optimizer_state[0][0][0]), before[1])
    b.train_step(x, loss_fn, loss_args=(y,))   # still usable
    assert b.step == a.step + 1
