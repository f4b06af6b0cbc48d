"""Fuzzing the public entry points of the executors and the torch entry point.

Each entry point gets one generated bad (or odd) argument in one position; only ``ValueError``,
``TypeError`` or a documented error class may come out, the user's arrays and modules are
unchanged, and the process stays usable (a runtime built afterwards still computes right).

Needs torch (``SwappedStack`` is fuzzed here too): skipped in the jax-only venv of
``make test-jax-only``.
"""
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from xla_swap.executors import InGraphRuntime, PjrtExecutor, Placement, RuntimeConfig, StreamingRuntime  # noqa: E402
from xla_swap.planning import AdamW  # noqa: E402
from xla_swap.stack import SwappedStack  # noqa: E402
from xla_swap.stack.config import ParallelConfig

D = 8

_JUNK = st.one_of(st.none(), st.integers(-3, 3), st.booleans(), st.floats(allow_nan=True), st.text(max_size=4),
                  st.lists(st.integers(), max_size=2), st.just(10 ** 400), st.just(np.int64(2)),
                  st.just(float("inf")), st.just(print), st.just(np.zeros((2, 3), np.float32)),
                  st.just([{"a": np.ones((D, D), np.int8)}]), st.just(jax.devices()[0]),
                  st.just({"params": "host"}), st.just(torch.nn.Linear(2, 2)), st.just(torch.zeros(2, 2)))
_ALLOWED = (ValueError, TypeError)


def layer(p, h):
    return h + jnp.tanh(h @ p["a"])


def _params():
    return [{"a": np.full((D, D), 0.1, np.float32)} for _ in range(3)]


def _entry_points(params, x, mods):
    rt = StreamingRuntime(layer, params)
    opt_rt = StreamingRuntime(layer, params, optimizer=AdamW())
    stack = SwappedStack(mods)
    return {
        "StreamingRuntime.stage_fn": lambda a: StreamingRuntime(a, params),
        "StreamingRuntime.stage_params": lambda a: StreamingRuntime(layer, a),
        "StreamingRuntime.prefetch_depth": lambda a: StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=a)),
        "StreamingRuntime.device": lambda a: StreamingRuntime(layer, params, placement=Placement(device=a)),
        "StreamingRuntime.sharding": lambda a: StreamingRuntime(layer, params, placement=Placement(sharding=a)),
        "StreamingRuntime.remat": lambda a: StreamingRuntime(layer, params, RuntimeConfig(remat=a)),
        "StreamingRuntime.resident": lambda a: StreamingRuntime(layer, params, RuntimeConfig(resident=a)),
        "StreamingRuntime.optimizer": lambda a: StreamingRuntime(layer, params, optimizer=a),
        "StreamingRuntime.trainable": lambda a: StreamingRuntime(layer, params, trainable=a),
        "StreamingRuntime.max_signatures": lambda a: StreamingRuntime(layer, params, RuntimeConfig(max_signatures=a)),
        "StreamingRuntime.from_policy": lambda a: StreamingRuntime.from_policy(layer, params, a),
        "forward.h": lambda a: rt.forward(a),
        "train_step.loss_fn": lambda a: rt.train_step(x, a),
        "train_step.cotangent": lambda a: rt.train_step(x, cotangent=a),
        "train_step.loss_args": lambda a: rt.train_step(x, lambda o, *r: jnp.sum(o), loss_args=a),
        "train_step.lr": lambda a: opt_rt.train_step(x, lambda o: jnp.sum(o), lr=a),
        "InGraphRuntime.stage_params": lambda a: InGraphRuntime(layer, a),
        "InGraphRuntime.forward": lambda a: InGraphRuntime(layer, params).forward(a),
        "PjrtExecutor.module": lambda a: PjrtExecutor(a),
        "AdamW.lr": lambda a: AdamW(lr=a),
        "AdamW.betas": lambda a: AdamW(betas=a),
        "AdamW.from_torch": lambda a: AdamW.from_torch(a),
        "SwappedStack.layers": lambda a: SwappedStack(a),
        "SwappedStack.first": lambda a: SwappedStack(mods, first=a),
        "SwappedStack.policy": lambda a: SwappedStack(mods, policy=a),
        "SwappedStack.budget_bytes": lambda a: SwappedStack(mods, budget_bytes=a),
        "SwappedStack.optimizer": lambda a: SwappedStack(mods, optimizer=a),
        "SwappedStack.devices": lambda a: SwappedStack(mods, parallel=ParallelConfig(devices=a)),
        "SwappedStack.shard": lambda a: SwappedStack(mods, parallel=ParallelConfig(shard=a)),
        "SwappedStack.forward": lambda a: stack(a),
        "SwappedStack.train_step.inputs": lambda a: stack.train_step(a, loss_fn=lambda o: o.sum()),
        "SwappedStack.train_step.loss_fn": lambda a: stack.train_step(torch.ones(2, D), loss_fn=a),
    }


_NAMES = sorted(_entry_points(_params(), np.ones((2, D), np.float32), [torch.nn.Linear(D, D)]))


@given(entry=st.sampled_from(_NAMES), arg=_JUNK)
@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_fuzz_executor_entry_points_raise_only_documented_errors(entry, arg):
    params = _params()
    x = np.linspace(-1, 1, 2 * D, dtype=np.float32).reshape(2, D)
    torch.manual_seed(0)
    mods = [torch.nn.Linear(D, D) for _ in range(2)]
    before = [m.weight.detach().clone() for m in mods]
    try:
        _entry_points(params, x, mods)[entry](arg)
    except _ALLOWED:
        pass
    # the user's arrays and modules are unchanged, and the process still computes right
    np.testing.assert_array_equal(params[0]["a"], np.full((D, D), 0.1, np.float32))
    for m, w in zip(mods, before):
        torch.testing.assert_close(m.weight.detach(), w, rtol=0, atol=0)
    ref = x
    for p in params:
        ref = ref + np.tanh(ref @ p["a"])
    np.testing.assert_allclose(np.asarray(StreamingRuntime(layer, params).forward(x)), ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------- more bad inputs
def _ref(params, x):
    for p in params:
        x = x + np.tanh(x @ p["a"])
    return x


def test_put_all_refuses_a_non_sequence_and_keeps_the_executor_usable():
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    ex = PjrtExecutor(jax.jit(lambda x, y: x @ y).lower(a, a))
    for bad in (None, a, "ab", {0: a}):
        with pytest.raises(TypeError, match="arrays: expected a list or tuple"):
            ex.put_all(bad)
    assert ex.transfer_count == 0
    np.testing.assert_allclose(np.asarray(ex(*ex.put_all([a, a]))[0]), a @ a)


def test_a_value_that_is_no_array_is_named_by_put_put_all_and_call():
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    ex = PjrtExecutor(jax.jit(lambda x, y: x @ y).lower(a, a))
    for bad in (None, "abc", [[1.0], [1.0, 2.0]]):
        with pytest.raises(TypeError, match=r"put: parameter 1 expects a numpy array or jax.Array of float32 \[4, 4\], "
                                            rf"got {type(bad).__name__}"):
            ex.put(1, bad)
        with pytest.raises(TypeError, match=r"put_all: argument 1: parameter 1 expects a numpy array"):
            ex.put_all([a, bad])
        with pytest.raises(TypeError, match=r"call: argument 0: parameter 0 expects a numpy array"):
            ex(bad, a)
    assert ex.transfer_count == 0
    np.testing.assert_allclose(np.asarray(ex(a, a)[0]), a @ a)


@pytest.mark.parametrize("spec, msg", [("{devices=[4,1]0,1,2,7}", "names device 7, but its 4 tiles"),
                                       ("{devices=[2,1]0,5}", "names device 5, but its 2 tiles"),
                                       ("{devices=[4,1]0,0,1,2}", "lists device 0 twice")])
def test_pjrt_sharding_string_with_bad_device_ids_is_named(spec, msg):
    from xla_swap.executors import ParameterPlacement
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    a = np.ones((4, 4), np.float32)
    low = jax.jit(lambda x: x * 2).lower(a)
    with pytest.raises(ValueError, match=r"placements\[0\]: HLO sharding .*" + msg):
        PjrtExecutor(low, {0: ParameterPlacement("device", spec)})
    np.testing.assert_array_equal(np.asarray(PjrtExecutor(low)(a)[0]), a * 2)


def test_parameter_placement_checks_its_fields():
    from xla_swap.executors import ParameterPlacement
    with pytest.raises(ValueError, match="memory_kind: unknown memory kind 'host'"):
        ParameterPlacement("host")
    with pytest.raises(TypeError, match="memory_kind: expected one of"):
        ParameterPlacement(None)
    with pytest.raises(TypeError, match="sharding: expected None, an HLO sharding string or a jax Sharding, got int"):
        ParameterPlacement("device", 3)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_streaming_refuses_a_dtype_jax_would_narrow(dtype):
    params = _params()
    x = np.linspace(-1, 1, 2 * D).reshape(2, D)
    rt = StreamingRuntime(layer, params)
    with pytest.raises(TypeError, match=f"h: got dtype {np.dtype(dtype)}, which jax would compute as"):
        rt.forward(x.astype(dtype))
    with pytest.raises(TypeError, match=f"h: got dtype {np.dtype(dtype)}"):
        rt.train_step(x.astype(dtype), lambda o: jnp.sum(o))
    x32 = x.astype(np.float32)
    with pytest.raises(TypeError, match="cotangent: got dtype float64"):
        rt.train_step(x32, cotangent=np.ones((2, D)))
    with pytest.raises(TypeError, match=r"loss_args\[0\]: got dtype float64"):
        rt.train_step(x32, lambda o, t: jnp.sum(o * t), loss_args=(np.ones((2, D)),))
    with pytest.raises(TypeError, match=r"h: got dtype"):
        InGraphRuntime(layer, params).forward(x.astype(dtype))
    assert rt.num_signatures == 0 and rt.step == 0
    np.testing.assert_allclose(np.asarray(rt.forward(x32)), _ref(params, x32), rtol=1e-5, atol=1e-6)


def test_streaming_int64_ids_in_int32_range_pass_and_beyond_are_refused():
    emb = np.linspace(-1, 1, 10 * D, dtype=np.float32).reshape(10, D)

    def stage(p, h):
        return p["e"][h] if h.dtype.kind == "i" else h + jnp.tanh(h @ p["a"])
    params = [{"e": emb, "a": np.zeros((D, D), np.float32)}, {"e": emb, "a": np.full((D, D), .1, np.float32)}]
    rt = StreamingRuntime([stage, lambda p, h: stage(p, h)], params)   # an embedding stage, then a layer
    ids = np.array([[1, 2], [3, 4]], np.int64)
    out = np.asarray(rt.forward(ids))
    np.testing.assert_allclose(out, emb[ids] + np.tanh(emb[ids] @ params[1]["a"]), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="h: dtype int64 holds values outside int32"):
        rt.forward(np.array([[1, 2 ** 40]], np.int64))


@pytest.mark.parametrize("dtype", [np.int32, np.float16, jnp.bfloat16, np.bool_])
def test_streaming_refuses_an_input_the_shared_layers_compute_in_another_dtype(dtype):
    params = _params()
    x = np.ones((2, D), np.float32)
    rt = StreamingRuntime(layer, params)
    got = np.dtype(dtype)
    with pytest.raises(TypeError, match=f"h: stage 0 gets dtype {got} and returns float32.*pass float32"):
        rt.forward(x.astype(dtype))
    with pytest.raises(TypeError, match=f"h: stage 0 gets dtype {got}"):
        rt.train_step(x.astype(dtype), lambda o: jnp.sum(o))
    ing = InGraphRuntime(layer, params)
    with pytest.raises(TypeError, match=f"h: stage 0 gets dtype {got} and returns float32"):
        ing.forward(x.astype(dtype))
    assert rt.num_signatures == 0
    np.testing.assert_allclose(np.asarray(rt.forward(x)), _ref(params, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ing.forward(x)), _ref(params, x), rtol=1e-5, atol=1e-6)


def test_float64_stage_params_and_torch_tensors_are_refused_by_name():
    with pytest.raises(TypeError, match=r"stage_params\[1\]\['a'\]: got dtype float64"):
        StreamingRuntime(layer, [{"a": np.zeros((D, D), np.float32)}, {"a": np.zeros((D, D))}])
    with pytest.raises(TypeError, match=r"stage_params\[0\]\['a'\]: got dtype float64"):
        InGraphRuntime(layer, [{"a": np.zeros((D, D))}])
    rt = StreamingRuntime(layer, _params())
    with pytest.raises(TypeError, match=r"h: expected an array \(numpy or jax\), got torch.Tensor"):
        rt.forward(torch.ones(2, D))
    with pytest.raises(TypeError, match=r"stage_params\[0\]\['a'\]: expected an array \(numpy or jax\), got torch"):
        StreamingRuntime(layer, [{"a": torch.zeros(D, D)}])
    x = np.ones((2, D), np.float32)
    np.testing.assert_allclose(np.asarray(rt.forward(x)), _ref(_params(), x), rtol=1e-5, atol=1e-6)


def test_swapped_stack_refuses_input_target_and_weight_dtypes_it_would_change():
    torch.manual_seed(0)
    mods = [torch.nn.Linear(D, D) for _ in range(2)]
    before = [m.weight.detach().clone() for m in mods]
    stack = SwappedStack(mods)
    loss = lambda o, *t: o.sum()  # noqa: E731
    for dt in (torch.float64, torch.int32, torch.float16):
        with pytest.raises(TypeError, match=rf"inputs\[0\]: .*{str(dt).removeprefix('torch.')}"):
            stack(torch.ones(2, D, dtype=dt))
        with pytest.raises(TypeError, match=r"inputs\[0\]: "):
            stack.train_step(torch.ones(2, D, dtype=dt), loss_fn=loss)
    with pytest.raises(TypeError, match=r"targets\[0\]: got dtype float64"):
        stack.train_step(torch.ones(2, D), torch.ones(2, D, dtype=torch.float64), loss_fn=loss)
    with pytest.raises(TypeError, match=r"layers\[0\]\['(weight|bias)'\]: got dtype float64"):
        SwappedStack([torch.nn.Linear(D, D).double()])
    for m, w in zip(mods, before):
        torch.testing.assert_close(m.weight.detach(), w, rtol=0, atol=0)
        assert m.weight.grad is None
    x = torch.linspace(-1, 1, 2 * D).reshape(2, D)
    torch.testing.assert_close(stack(x), mods[1](mods[0](x)).detach(), rtol=1e-5, atol=1e-5)
    # integer token ids into an embedding first stage stay legitimate
    emb_stack = SwappedStack(mods, first=torch.nn.Embedding(10, D))
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(emb_stack(ids), mods[1](mods[0](emb_stack.modules[0](ids))).detach(),
                               rtol=1e-5, atol=1e-5)


def test_link_amounts_are_checked():
    from xla_swap.planning import Link
    link = Link(10.0, 10.0)
    for bad, err in ((None, TypeError), ("1", TypeError), (-1, ValueError), (float("nan"), ValueError),
                     (float("inf"), ValueError), (10 ** 400, ValueError)):
        with pytest.raises(err, match="Link.transfer_s.in_bytes"):
            link.transfer_s(bad, 0)
        with pytest.raises(err, match="Link.transfer_s.out_bytes"):
            link.transfer_s(0, bad)
        with pytest.raises(err, match="Link.host_update_s.touched_bytes"):
            link.host_update_s(bad)
    assert link.transfer_s(1e9, 0) == pytest.approx(0.1) and link.transfer_s(np.float32(0), 0) == 0
