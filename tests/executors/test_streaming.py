"""Tests of xla_swap.executors.streaming (numpy + jax only, on N virtual CPU devices).

References are monolithic ``jax.jit`` programs over the whole stack with every weight in
device memory; the streaming runtime must agree with them, keep at most k+1 stages'
weights on the device (and reach k+1, i.e. really prefetch), and leak no device buffers.
"""
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from streaming_cases import (D, F, L, T, check_close, chunk_stages, layer, live_device_arrays, loss_fn, make_input,
                             make_params, mono_forward, mono_loss, stacked)
from xla_swap.executors import Placement, RuntimeConfig, StageEvent, StreamingRuntime, TraceRecorder, tree_nbytes


def mesh_sharding(num_devices):
    """Shardings for the weights over all devices (F split), or None for one device."""
    if num_devices == 1:
        return None
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("x",))
    return lambda i, path, leaf: NamedSharding(mesh, P(None, "x") if "a" in jax.tree_util.keystr(path)
                                               else P("x", None))


def mesh_activation(num_devices):
    if num_devices == 1:
        return None
    return NamedSharding(Mesh(np.array(jax.devices()[:num_devices]), ("x",)), P())


# ---------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("k", [1, 2, 3])
def test_forward_matches_monolithic(params, x, k):
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k))
    y = rt.forward(x)
    check_close(y, mono_forward(stacked(params), x))
    assert y.sharding.memory_kind == "device"
    assert rt.num_executables == 1  # eight identical layers: one executable, reused
    for p in rt.host_params:
        assert all(leaf.sharding.memory_kind == "pinned_host" for leaf in jax.tree_util.tree_leaves(p))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_train_step_matches_grad(params, x, k):
    stack = stacked(params)
    ref_loss, (ref_gp, ref_gx) = jax.value_and_grad(mono_loss, argnums=(0, 1))(stack, x)
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k))
    loss, gx, grads = rt.train_step(x, loss_fn)
    check_close(loss, ref_loss, rtol=1e-5)
    check_close(gx, ref_gx, rtol=1e-5)
    assert len(grads) == L
    for i, g in enumerate(grads):
        assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(params[i])
        for name in ("a", "b"):
            assert g[name].sharding.memory_kind == "pinned_host"
            check_close(g[name], ref_gp[name][i], rtol=1e-5, atol=1e-5)
    # one forward, one backward donating the streamed weights, one keeping them (the first k
    # stages: the next call starts with them, prefetch_next_call)
    assert rt.num_executables == 3


def test_train_step_with_cotangent_keeps_user_arrays(params, x):
    """Donation never consumes the caller's arrays (input and cotangent on the device)."""
    stack = stacked(params)
    ct = np.random.default_rng(5).standard_normal((T, D)).astype(np.float32)
    out_ref, vjp = jax.vjp(mono_forward, stack, x)
    ref_gp, ref_gx = vjp(ct)
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2, donate=True))
    x_dev = jax.device_put(x, rt.activation_sharding)
    ct_dev = jax.device_put(ct, rt.activation_sharding)
    out, gx, grads = rt.train_step(x_dev, cotangent=ct_dev)
    check_close(out, out_ref)
    check_close(gx, ref_gx, rtol=1e-5)
    check_close(grads[3]["b"], ref_gp["b"][3], rtol=1e-5, atol=1e-5)
    assert not x_dev.is_deleted() and not ct_dev.is_deleted()
    check_close(ct_dev, ct, rtol=0, atol=0)


def test_sharded_weights_over_mesh(num_devices, params, x):
    """Weights sharded over all N devices (F split), activations replicated."""
    if num_devices == 1:
        pytest.skip("needs more than one device")
    k = 2
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k),
                          placement=Placement(sharding=mesh_sharding(num_devices),
                                              activation_sharding=mesh_activation(num_devices)))
    assert rt.host_params[0]["a"].sharding.spec == P(None, "x")
    assert rt.host_params[0]["a"].sharding.memory_kind == "pinned_host"
    y = rt.forward(x)
    check_close(y, mono_forward(stacked(params), x), rtol=1e-5, atol=1e-5)
    ref_loss, (ref_gp, ref_gx) = jax.value_and_grad(mono_loss, argnums=(0, 1))(stacked(params), x)
    loss, gx, grads = rt.train_step(x, loss_fn)
    check_close(loss, ref_loss, rtol=1e-5)
    check_close(gx, ref_gx, rtol=1e-5, atol=1e-5)
    assert grads[0]["a"].sharding.memory_kind == "pinned_host"
    assert grads[0]["a"].sharding.spec == P(None, "x")
    check_close(grads[0]["a"], ref_gp["a"][0], rtol=1e-5, atol=1e-5)
    assert rt.max_resident_stages == k + 1


@pytest.mark.spmd
@pytest.mark.parametrize("remat,offload,opt", [(True, False, False), (False, True, False), (True, False, True)])
def test_data_parallel_batch_axis(num_devices, params, x, remat, offload, opt):
    """FSDP / ZeRO-3: weights sharded over the mesh in pinned_host, activations split on their
    leading (token) dim (``batch_axis``): values, gradients and AdamW updates equal the
    single-device runtime; activations, cotangents and the output are batch-sharded."""
    from xla_swap.planning import AdamW
    if num_devices == 1 or T % num_devices:
        pytest.skip("needs several devices dividing T")
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("x",))
    config = RuntimeConfig(prefetch_depth=2, remat=remat, offload_activations=offload)
    kw = dict(optimizer=AdamW(lr=1e-2) if opt else None)
    ref = StreamingRuntime(layer, params, config, placement=Placement(device=jax.devices()[0]), **kw)
    rt = StreamingRuntime(layer, params, config, placement=Placement(sharding=NamedSharding(mesh, P("x", None)),
                          activation_sharding=NamedSharding(mesh, P()), batch_axis="x"), **kw)
    assert rt.host_params[0]["a"].sharding.spec == P("x", None)
    assert rt.host_params[0]["a"].sharding.memory_kind == "pinned_host"
    y = rt.forward(x)
    assert y.sharding.spec == P("x") and y.sharding.memory_kind == "device"
    check_close(y, ref.forward(x), rtol=1e-5, atol=1e-5)
    for _ in range(2 if opt else 1):
        loss, gx, grads = rt.train_step(x, loss_fn)
        rloss, rgx, rgrads = ref.train_step(x, loss_fn)
        check_close(loss, rloss, rtol=1e-5)
        assert gx.sharding.spec == P("x")
        check_close(gx, rgx, rtol=1e-5, atol=1e-5)
    if opt:
        for i in (0, L - 1):
            check_close(rt.host_params[i]["b"], ref.host_params[i]["b"], rtol=1e-5, atol=1e-6)
            assert rt.host_params[i]["b"].sharding.memory_kind == "pinned_host"
            assert rt.host_params[i]["b"].sharding.spec == P("x", None)
    else:
        assert grads[3]["a"].sharding.memory_kind == "pinned_host" and grads[3]["a"].sharding.spec == P("x", None)
        check_close(grads[3]["a"], rgrads[3]["a"], rtol=1e-5, atol=1e-5)
    # a leaf whose leading dim does not split keeps the replicated activation sharding
    assert rt._act(jax.ShapeDtypeStruct((T + 1, D), np.float32)) == rt.activation_sharding


def test_batch_axis_checked(params):
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    with pytest.raises(ValueError, match="batch_axis='y'"):
        StreamingRuntime(layer, params, placement=Placement(sharding=NamedSharding(mesh, P()), batch_axis="y"))
    with pytest.raises(TypeError, match="batch_axis"):
        StreamingRuntime(layer, params, placement=Placement(sharding=NamedSharding(mesh, P()), batch_axis=0))


def test_named_sharding_default_activation(num_devices, params, x):
    """A plain NamedSharding for every leaf; activation sharding defaults to replicated."""
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("x",))
    rt = StreamingRuntime(layer, params, placement=Placement(sharding=NamedSharding(mesh, P())))
    assert rt.activation_sharding.spec == P()
    check_close(rt.forward(x), mono_forward(stacked(params), x), rtol=1e-5, atol=1e-5)


def test_different_stage_functions():
    """A list of stage functions that change the activation shape; one executable each."""
    rng = np.random.default_rng(3)
    p0 = {"w": rng.standard_normal((D, 2 * D)).astype(np.float32)}
    p1 = make_params(1, d=2 * D, f=F)[0]
    p2 = {"w": rng.standard_normal((2 * D, 3)).astype(np.float32)}
    fns = [lambda p, h: jnp.tanh(h @ p["w"]), layer, layer, lambda p, h: h @ p["w"]]
    ps = [p0, p1, p1, p2]
    x = make_input()

    def ref(h):
        for f, p in zip(fns, ps):
            h = f(p, h)
        return h

    rt = StreamingRuntime(fns, ps, RuntimeConfig(prefetch_depth=1))
    y = rt.forward(x)
    assert y.shape == (T, 3)
    check_close(y, jax.jit(ref)(x), rtol=1e-5, atol=1e-5)
    assert rt.num_executables == 3  # stages 1 and 2 share one executable
    def ref_loss(ps, h):
        for f, p in zip(fns, ps):
            h = f(p, h)
        return loss_fn(h)

    ref_gps, ref_gx = jax.grad(ref_loss, argnums=(0, 1))(ps, x)
    loss, gx, grads = rt.train_step(x, loss_fn)
    check_close(gx, ref_gx, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_gps):
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(r)):
            check_close(a, b, rtol=1e-5, atol=1e-5)


def test_loss_args_and_throttle_off(params, x):
    target = make_input(seed=9)

    def mse(out, t):
        return jnp.mean((out - t) ** 2)

    ref = jax.value_and_grad(lambda s, h: mse(mono_forward(s, h), target), argnums=(0, 1))
    ref_loss, (ref_gp, ref_gx) = ref(stacked(params), x)
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2, throttle=False))
    loss, gx, grads = rt.train_step(x, mse, loss_args=(target,))
    check_close(loss, ref_loss, rtol=1e-5)
    check_close(gx, ref_gx, rtol=1e-5, atol=1e-6)
    check_close(grads[7]["a"], ref_gp["a"][7], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- residency
@pytest.mark.parametrize("k", [1, 2, 3])
def test_residency_bounded_and_prefetching(params, x, k):
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k))
    rt.forward(x).block_until_ready()
    fwd = [r for (pname, _, r) in rt.residency_trace]
    assert len(fwd) == L
    assert max(fwd) == k + 1 == rt.max_resident_stages  # bounded, and it did prefetch
    rt.reset_stats()
    rt.train_step(x, loss_fn)
    steps = rt.residency_trace
    assert [s for (pn, s, _) in steps] == list(range(L)) + list(reversed(range(L)))
    assert max(r for (pname, _, r) in steps if pname == "forward") <= k + 1
    bwd = [r for (pname, _, r) in steps if pname == "backward"]
    assert max(bwd) == k + 1 == rt.max_resident_stages
    # between calls only the next call's first k+1 stages stay (prefetch_next_call: the backward keeps
    # stages 0..k-1 and streams stage k into its free window slot); all gone once released
    gc.collect()
    assert rt.resident_stages() == len(rt.prefetched_stages) == min(k + 1, L)
    rt.release_prefetched()
    gc.collect()
    assert rt.resident_stages() == 0


def test_prefetch_deeper_than_stack(params, x):
    rt = StreamingRuntime(layer, params[:3], RuntimeConfig(prefetch_depth=5))
    check_close(rt.forward(x), mono_forward(stacked(params[:3]), x))
    assert rt.max_resident_stages == 3


def test_no_leak_over_100_forward_calls(params, x):
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2))
    rt.forward(x).block_until_ready()
    before = live_device_arrays()
    for _ in range(100):
        y = rt.forward(x)
    y.block_until_ready()
    del y
    rt.forward(x).block_until_ready()  # result dropped at once, as in the first call
    assert live_device_arrays() == before
    assert rt.num_executables == 1


def test_no_leak_train_step(params, x):
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=1))
    jax.block_until_ready(rt.train_step(x, loss_fn))
    before = live_device_arrays()
    for _ in range(10):
        jax.block_until_ready(rt.train_step(x, loss_fn))
    assert live_device_arrays() == before


# ---------------------------------------------------------------------------- trace
def test_trace_events(params, x):
    rec = TraceRecorder()
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), trace=rec)
    rt.train_step(x, loss_fn)
    assert not rec.recording and rec.t0 <= time.perf_counter()
    ev = rec.events
    assert all(isinstance(e, StageEvent) and e.error is None for e in ev)
    kinds = {(e.pass_name, e.kind) for e in ev}
    assert kinds == {("forward", "h2d"), ("forward", "compute"), ("backward", "h2d"),
                     ("backward", "compute"), ("backward", "d2h")}
    # the backward keeps its first k+1 stages' weights for the next call (prefetch_next_call; stage k
    # in the window slot stage -1 would have used): nothing is streamed for it
    assert rt.prefetched_stages == [0, 1, 2]
    assert sorted(e.stage for e in ev if e.kind == "compute" and e.pass_name == "forward") == list(range(L))
    assert sorted(e.stage for e in ev if e.kind == "d2h") == list(range(L))
    # the last k+1 stages stay on the device from the forward: the backward re-fetches the other L-k-1
    assert sorted(e.stage for e in ev if e.kind == "h2d" and e.pass_name == "backward") == list(range(L - 3))
    for e in ev:
        assert 0 <= e.issued_s <= e.dispatched_s <= e.done_s
    # a stage's computation is issued after its weights' transfer
    h2d = {(e.pass_name, e.stage): e for e in ev if e.kind == "h2d"}
    for e in ev:
        if e.kind == "compute" and (e.pass_name, e.stage) in h2d:
            assert e.issued_s >= h2d[(e.pass_name, e.stage)].issued_s
    # prefetch: stage 2's transfer is issued before stage 0's computation finished being issued
    comp0 = next(e for e in ev if e.kind == "compute" and e.stage == 0 and e.pass_name == "forward")
    assert h2d[("forward", 1)].issued_s < comp0.issued_s


def test_executable_memory_and_sizes(params, x):
    rt = StreamingRuntime(layer, params)
    rt.train_step(x, loss_fn)
    mem = rt.executable_memory()
    assert {m["kind"] for m in mem} == {"forward", "backward-donate", "backward"}
    assert rt.stage_nbytes == [2 * D * F * 4] * L
    assert rt.weight_nbytes == tree_nbytes(params) == L * 2 * D * F * 4
    bwd = next(m for m in mem if m["kind"] == "backward-donate")
    assert bwd["stages"] == list(range(2, L))  # k=1: stages 0 and 1 keep their weights for the next call
    assert next(m for m in mem if m["kind"] == "backward")["stages"] == [0, 1]
    assert bwd["alias_bytes"] is None or bwd["alias_bytes"] >= 2 * D * F * 4  # weights reused for grads


# ---------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("kwargs, exc, match", [
    ({"prefetch_depth": 0}, ValueError, "prefetch_depth"),
    ({"prefetch_depth": -2}, ValueError, "prefetch_depth"),
    ({"prefetch_depth": 1.5}, TypeError, "prefetch_depth"),
    ({"prefetch_depth": True}, TypeError, "prefetch_depth"),
    ({"donate": 1}, TypeError, "donate"),
    ({"device": "cpu:0"}, TypeError, "device"),
    ({"sharding": 3}, TypeError, "sharding"),
    ({"activation_sharding": "x"}, TypeError, "activation_sharding"),
])
def test_bad_constructor_arguments(params, kwargs, exc, match):
    placed = ("device", "sharding", "activation_sharding")
    with pytest.raises(exc, match=match):
        StreamingRuntime(layer, params, RuntimeConfig(**{k: v for k, v in kwargs.items() if k not in placed}),
                         placement=Placement(**{k: v for k, v in kwargs.items() if k in placed}))


def test_bad_stage_lists(params):
    with pytest.raises(ValueError, match="stage_params is empty"):
        StreamingRuntime(layer, [])
    with pytest.raises(ValueError, match="stage_params must be"):
        StreamingRuntime(layer, params[0])
    with pytest.raises(ValueError, match="stage_fn has 2 functions but stage_params has 8"):
        StreamingRuntime([layer, layer], params)
    with pytest.raises(TypeError, match=r"stage_fn\[1\] is not callable"):
        StreamingRuntime([layer, None], params[:2])
    with pytest.raises(TypeError, match="stage_fn must be"):
        StreamingRuntime(42, params)
    with pytest.raises(TypeError, match=r"stage_params\[1\]\['a'\]: expected an array"):
        StreamingRuntime(layer, [params[0], {"a": 1.0, "b": params[0]["b"]}])
    with pytest.raises(ValueError, match="device or sharding"):
        StreamingRuntime(layer, params,
                         placement=Placement(device=jax.devices()[0],
                                             sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])))
    with pytest.raises(ValueError, match="activation_sharding is required"):
        StreamingRuntime(layer, params, placement=Placement(
            sharding=lambda i, path, leaf: jax.sharding.SingleDeviceSharding(jax.devices()[0])))


def test_mismatched_params_with_shared_fn(params):
    bad_shape = list(params)
    bad_shape[5] = {"a": params[5]["a"][:, :-1], "b": params[5]["b"]}
    with pytest.raises(ValueError, match=r"stage_params\[5\]\['a'\] has shape \(16, 31\)"):
        StreamingRuntime(layer, bad_shape)
    bad_dtype = list(params)
    bad_dtype[2] = {"a": params[2]["a"].astype(np.float16), "b": params[2]["b"]}
    with pytest.raises(ValueError, match=r"stage_params\[2\]\['a'\].*float16"):
        StreamingRuntime(layer, bad_dtype)
    bad_tree = list(params)
    bad_tree[1] = {"a": params[1]["a"]}
    with pytest.raises(ValueError, match=r"stage_params\[1\] has tree structure"):
        StreamingRuntime(layer, bad_tree)
    # different structures are fine with one function per stage
    StreamingRuntime([layer] * L, params)


def test_bad_call_inputs_raise_before_state_change(params, x):
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2))
    rt.forward(x).block_until_ready()
    trace, peak, nexe = list(rt.residency_trace), rt.max_resident_stages, rt.num_executables
    before = live_device_arrays()
    with pytest.raises(TypeError, match=r"h\[0\]\[0\]: expected an array \(numpy or jax\), got float"):
        rt.forward([[1.0] * D] * T)       # a nested list is a pytree of Python floats, not an array
    with pytest.raises(ValueError, match="exactly one of loss_fn and cotangent"):
        rt.train_step(x)
    with pytest.raises(ValueError, match="exactly one of loss_fn and cotangent"):
        rt.train_step(x, loss_fn, cotangent=x)
    with pytest.raises(ValueError, match=r"cotangent has shape \(8, 15\)"):
        rt.train_step(x, cotangent=x[:, :-1])
    with pytest.raises(ValueError, match="loss_fn must return a floating scalar"):
        rt.train_step(x, lambda out: out * 2)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        rt.train_step(x, "mse")
    assert rt.residency_trace == trace and rt.max_resident_stages == peak
    assert rt.num_executables == nexe
    assert live_device_arrays() == before


def test_stage_fn_errors_name_the_stage(params, x):
    rt = StreamingRuntime([layer] * 3 + [lambda p, h: h @ p["b"]], params[:4])
    with pytest.raises(ValueError, match="stage 3: stage_fn"):
        rt.forward(x)
    rt2 = StreamingRuntime(lambda p, h: None, params[:2])
    with pytest.raises(TypeError, match="stage 0: stage_fn must return an array or a pytree of arrays"):
        rt2.forward(x)
    with pytest.raises(TypeError, match=r"h\[1\]: expected an array"):
        rt.forward((x, "not an array"))
    rt3 = StreamingRuntime(layer, [{"a": np.ones((D, F), np.int32), "b": np.ones((F, D), np.int32)}])
    with pytest.raises(TypeError, match=r"no stage has a floating parameter"):
        rt3.train_step(x.astype(np.int32), lambda o: jnp.sum(o).astype(jnp.float32))


def test_bfloat16_train_step():
    """bf16 weights and activations (as in the GPU benchmark): train_step accepts them."""
    ps = [jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p) for p in make_params(4)]
    xb = jnp.asarray(make_input(), jnp.bfloat16)
    rt = StreamingRuntime(layer, ps, RuntimeConfig(prefetch_depth=1))
    ref_loss, (ref_gp, ref_gx) = jax.value_and_grad(
        lambda s, h: jnp.sum(jnp.sin(mono_forward(s, h).astype(jnp.float32))), argnums=(0, 1))(stacked(ps), xb)
    loss, gx, grads = rt.train_step(xb, lambda o: jnp.sum(jnp.sin(o.astype(jnp.float32))))
    assert gx.dtype == jnp.bfloat16 and grads[0]["a"].dtype == jnp.bfloat16
    check_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    check_close(gx.astype(jnp.float32), ref_gx.astype(jnp.float32), rtol=5e-2, atol=5e-2)
    check_close(grads[2]["b"].astype(jnp.float32), ref_gp["b"][2].astype(jnp.float32), rtol=5e-2, atol=5e-2)


# ---------------------------------------------------------------------------- pytree carry, remat
@pytest.mark.parametrize("k", [1, 3])
def test_pytree_carry_chunked_layers(params, x, k):
    """Layers split into 4 column-chunk stages with a (x, partial sum) carry: forward and grads match."""
    fns, sp = chunk_stages(params, 4)
    rt = StreamingRuntime(fns, sp, RuntimeConfig(prefetch_depth=k))
    y, y2 = rt.forward((x, x))
    check_close(y, mono_forward(stacked(params), x), rtol=1e-5, atol=1e-5)
    check_close(y2, y, rtol=0, atol=0)
    assert rt.num_executables == 2          # partial + closing

    stack = stacked(params)
    ref_loss, (ref_gp, ref_gx) = jax.value_and_grad(mono_loss, argnums=(0, 1))(stack, x)
    loss, (gx, gacc), grads = rt.train_step((x, x), lambda out: loss_fn(out[0]))
    check_close(loss, ref_loss, rtol=1e-5)
    check_close(gx + gacc, ref_gx, rtol=1e-5, atol=1e-5)   # x feeds both carry slots of stage 0
    got_a = np.concatenate([np.asarray(grads[4 * 5 + c]["a"]) for c in range(4)], axis=1)
    check_close(got_a, ref_gp["a"][5], rtol=1e-5, atol=1e-5)
    assert grads[0]["b"].sharding.memory_kind == "pinned_host"
    # every stage's input is an (x, acc) pair of (T, D) fp32
    assert rt.stage_input_nbytes() == [2 * T * D * 4] * (4 * L)
    with pytest.raises(RuntimeError, match="call forward"):
        StreamingRuntime(fns, sp).stage_input_nbytes()
    with pytest.raises(ValueError, match="stage 0: stage_fn"):
        rt.forward(x)                        # the stages take an (x, acc) pair
    with pytest.raises(ValueError, match="cotangent has"):
        rt.train_step((x, x), cotangent=np.zeros((T, D), np.float32))


@pytest.mark.parametrize("remat", [False, jax.checkpoint_policies.dots_with_no_batch_dims_saveable],
                         ids=["no-remat", "dots-saveable"])
@pytest.mark.parametrize("k", [1, 2])
def test_train_step_saved_residuals(params, x, remat, k):
    """remat=False / a checkpoint policy: same loss and gradients, residuals kept instead of recompute."""
    stack = stacked(params)
    ref_loss, (ref_gp, ref_gx) = jax.value_and_grad(mono_loss, argnums=(0, 1))(stack, x)
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=k, remat=remat))
    loss, gx, grads = rt.train_step(x, loss_fn)
    check_close(loss, ref_loss, rtol=1e-5)
    check_close(gx, ref_gx, rtol=1e-5, atol=1e-5)
    for i in (0, L - 1):
        for name in ("a", "b"):
            assert grads[i][name].sharding.memory_kind == "pinned_host"
            check_close(grads[i][name], ref_gp[name][i], rtol=1e-5, atol=1e-5)
    # the weights (D*F*4 bytes each) are never among the kept residuals; what is kept is
    # activation-sized: with the dots policy exactly the pre-activation h @ a (T x F fp32)
    if remat is False:
        assert rt.residual_nbytes[0] >= T * F * 4
    else:
        assert rt.residual_nbytes == [T * F * 4] * L
    assert rt.max_resident_stages <= k + 1
    assert rt.num_executables == 3          # forward-save, backward-saved (donating, and not: first k stages)
    # a plain forward still works (its own executable) and agrees
    check_close(rt.forward(x), mono_forward(stack, x))


def test_remat_argument_checked(params):
    with pytest.raises(TypeError, match="remat must be a bool or a jax.checkpoint_policies policy"):
        StreamingRuntime(layer, params, RuntimeConfig(remat="dots"))
