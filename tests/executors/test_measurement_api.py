"""``StreamingRuntime``'s public measurement API (what ``executors/streaming/calibrate.py`` reads).

On the virtual CPU devices: the read-only views describe the runtime's own arrays; a stage
executable got through ``stage_executable`` computes the stage (forward against the layer in jax,
backward against ``jax.vjp`` of it, the fused AdamW update against the runtime's own
``train_step``); ``stage_cost_bytes`` equals ``layer_cost``'s bytes; bad arguments are refused
with errors naming them, before anything is compiled.
"""
import jax
import numpy as np
import pytest

from streaming_cases import check_close, layer, loss_fn
from xla_swap.executors import RuntimeConfig, StreamingRuntime, optim
from xla_swap.executors.streaming.compilation import Signature
from xla_swap.planning import AdamW


def test_views_describe_the_runtime(params, x):
    shared = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=AdamW(lr=1e-3),
                              trainable=lambda i, path: jax.tree_util.keystr(path) != "['b']" or i % 2 == 0)
    assert shared.stage_fns == (layer,) * len(params) and shared.stage_fn_ids == (0,) * len(params)
    for i, p in enumerate(shared.host_params):
        avals = shared.param_avals[i]
        assert jax.tree_util.tree_structure(avals) == jax.tree_util.tree_structure(p)
        assert [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(avals)] == \
            [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(p)]
        shardings = jax.tree_util.tree_leaves(shared.device_shardings[i])
        assert all(s.memory_kind == "device" for s in shardings)
        assert all(a.sharding.with_memory_kind("device") == s
                   for a, s in zip(jax.tree_util.tree_leaves(p), shardings))
        assert shared.trainable_mask[i] == (True, i % 2 == 0)
        assert len(shared.optimizer_state_device_shardings[i]) == sum(shared.trainable_mask[i])
        assert [path for path, m in zip(["['a']", "['b']"], shared.trainable_mask[i]) if m] == \
            shared.trainable_paths(i)
    other = StreamingRuntime([layer, lambda p, h: layer(p, h)] * (len(params) // 2), params)
    assert other.stage_fn_ids == (0, 1) * (len(params) // 2)
    assert other.optimizer_state_device_shardings == ([],) * len(params)
    sig = other.signature(x)
    assert isinstance(sig, Signature) and len(sig.chain) == len(params) + 1
    assert other.activation_sharding_of(sig.chain[0]) == other.activation_sharding


def test_stage_executables_compute_the_stage(params, x):
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2, remat=False))
    sig = rt.signature(x)
    i = 3
    p = jax.device_put(rt.host_params[i], rt.device_shardings[i])
    h = jax.device_put(x, rt.activation_sharding_of(sig.chain[i]))
    want = layer(params[i], x)
    check_close(rt.stage_executable(sig, "forward", i)(p, h), want)
    y, saved = rt.stage_executable(sig, "forward-save", i)(p, h)
    check_close(y, want)
    g = np.cos(np.asarray(want))
    gx_want, gp_want = jax.vjp(lambda xx, pp: layer(pp, xx), x, params[i])[1](g)[0], \
        jax.vjp(lambda pp: layer(pp, x), params[i])[1](g)[0]
    for kind, args in (("backward", (p, h, [g])), ("backward-saved", (p, h, saved, [g]))):
        gx, gp = rt.stage_executable(sig, kind, i)(*args)
        check_close(gx[0], gx_want, rtol=1e-5, atol=1e-5)
        check_close(gp[0], gp_want["a"], rtol=1e-5, atol=1e-5)
        check_close(gp[1], gp_want["b"], rtol=1e-5, atol=1e-5)
    bytes_ = rt.stage_cost_bytes(sig, i)
    assert bytes_["param_bytes"] == rt.stage_nbytes[i] and bytes_["carry_bytes"] == x.nbytes
    assert bytes_["intermediate_bytes"] == sum(a.nbytes for a in jax.tree_util.tree_leaves(saved)) > 0
    cost = rt.layer_cost(x, i, measure_reps=1)
    assert (cost.param_bytes, cost.grad_bytes, cost.carry_bytes, cost.intermediate_bytes, cost.working_bytes) == \
        tuple(bytes_[k] for k in ("param_bytes", "grad_bytes", "carry_bytes", "intermediate_bytes", "working_bytes"))


def test_fused_update_executable_matches_train_step(params, x):
    """The optimizer-fused backward got through the API gives the weights ``train_step`` gives."""
    one = [params[0]]
    rt = StreamingRuntime(layer, one, optimizer=AdamW(lr=1e-2))
    ref = StreamingRuntime(layer, one, optimizer=AdamW(lr=1e-2))
    sig = rt.signature(x)
    p = jax.device_put(rt.host_params[0], rt.device_shardings[0])
    h = jax.device_put(x, rt.activation_sharding_of(sig.chain[0]))
    g = jax.grad(loss_fn)(layer(params[0], x))
    state = jax.device_put(rt.optimizer_state[0], rt.optimizer_state_device_shardings[0])
    hyper = jax.device_put(optim.hyper_rows(rt.param_groups, 1), rt.activation_sharding)
    _, new_p, _ = rt.stage_executable(sig, "backward", 0)(p, h, [g], state, hyper)
    ref.train_step(x, loss_fn)
    for a, b in zip(jax.tree_util.tree_leaves(new_p), jax.tree_util.tree_leaves(ref.host_params[0])):
        check_close(a, b)
    assert not all(np.allclose(a, b) for a, b in zip(jax.tree_util.tree_leaves(new_p),
                                                      jax.tree_util.tree_leaves(params[0])))


def test_bad_arguments_are_refused_before_compiling(params, x):
    rt = StreamingRuntime(layer, params)
    sig = rt.signature(x)
    with pytest.raises(ValueError, match="kind"):
        rt.stage_executable(sig, "sideways", 0)
    with pytest.raises(ValueError, match="stage"):
        rt.stage_executable(sig, "forward", len(params))
    with pytest.raises(TypeError, match="sig"):
        rt.stage_executable(x, "forward", 0)
    with pytest.raises(ValueError, match="stage"):
        rt.stage_cost_bytes(sig, -1)
    with pytest.raises(TypeError, match="inputs"):
        rt.signature("text", what="inputs")
    assert rt.num_executables == 0
