"""``xla_swap._compat.jax``: one test per wrapper of a private jax / jaxlib API, each calling it for real.

Runs with jax alone (no torch): in ``make test`` (jax 0.10.2) and ``make test-jax-only``
(jax 0.11.2). Nothing here is mocked: a wrapper whose upstream API moved fails here first.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.extend.mlir import ir
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from xla_swap._compat import MissingUpstreamAPI
from xla_swap._compat import jax as cj

ADD_TEXT = """
module @m {
  func.func public @main(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %0 = stablehlo.add %arg0, %arg0 : tensor<4x8xf32>
    return %0 : tensor<4x8xf32>
  }
}
"""


def _sharded_text(n: int) -> str:
    """``x -> x + x`` over ``n`` devices, rows split ``n`` ways (replicated for one device)."""
    sh = f"{{devices=[{n},1]{','.join(map(str, range(n)))}}}" if n > 1 else "{replicated}"
    return f"""
module @m attributes {{mhlo.num_partitions = {n} : i32}} {{
  func.func public @main(%arg0: tensor<4x8xf32> {{mhlo.sharding = "{sh}"}})
      -> (tensor<4x8xf32> {{mhlo.sharding = "{sh}"}}) {{
    %0 = stablehlo.add %arg0, %arg0 : tensor<4x8xf32>
    return %0 : tensor<4x8xf32>
  }}
}}
"""


def _devices(n_max: int = 2) -> tuple:
    return tuple(jax.devices()[:n_max])


def _bytecode(text: str) -> bytes:
    with cj.make_ir_context():
        return cj.module_to_bytecode(ir.Module.parse(text))


@pytest.fixture(scope="module")
def compiled():
    """``(exe, devices, x)``: :data:`_sharded_text` compiled by ``compile_spmd`` over up to 2 devices."""
    devices = _devices()
    exe = cj.compile_spmd(_bytecode(_sharded_text(len(devices))), devices, num_parameters=1,
                          result_has_sharding=[True])
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    return exe, devices, x


def _placed(x, devices):
    n = len(devices)
    hs = cj.parse_hlo_sharding(f"{{devices=[{n},1]{','.join(map(str, range(n)))}}}" if n > 1 else "{replicated}")
    return jax.device_put(x, cj.gspmd_sharding(devices, hs))


# -- MLIR modules ---------------------------------------------------------------------------
def test_make_ir_context_parses_stablehlo():
    with cj.make_ir_context() as ctx:
        assert isinstance(ctx, ir.Context)
        mod = ir.Module.parse(ADD_TEXT)   # needs jax's dialects registered in the context
        assert "stablehlo.add" in str(mod)


def test_module_to_bytecode_round_trips():
    data = _bytecode(ADD_TEXT)
    assert isinstance(data, bytes) and data.startswith(b"ML\xefR")
    with cj.make_ir_context():
        assert "stablehlo.add" in str(ir.Module.parse(data))


def test_ir_element_type_factories_cover_the_dtypes_used():
    table = cj.ir_element_type_factories()
    with cj.make_ir_context():
        names = {np.dtype(dt): str(f()) for dt, f in table.items() if dt is not None}
    assert names[np.dtype(np.float32)] == "f32"
    assert names[np.dtype(jnp.bfloat16)] == "bf16"
    assert names[np.dtype(np.int8)] == "i8"
    assert names[np.dtype(np.uint8)] == "ui8"


def test_hlo_to_stablehlo_reads_a_jax_hlo_proto():
    proto = jax.jit(lambda a: a * 2).lower(jnp.zeros((4, 8), jnp.float32)).compiler_ir("hlo") \
        .as_serialized_hlo_module_proto()
    data = cj.hlo_to_stablehlo(proto)
    with cj.make_ir_context():
        text = str(ir.Module.parse(data))
    assert "tensor<4x8xf32>" in text and "stablehlo.multiply" in text
    with pytest.raises(Exception) as e:      # not an HloModuleProto: jaxlib's own error, not a missing API
        cj.hlo_to_stablehlo(b"not a proto")
    assert not isinstance(e.value, MissingUpstreamAPI)


def test_stablehlo_to_hlo_proto_round_trips():
    proto = cj.stablehlo_to_hlo_proto(ADD_TEXT)
    assert isinstance(proto, bytes) and proto
    with cj.make_ir_context():
        text = str(ir.Module.parse(cj.hlo_to_stablehlo(proto)))
    assert "stablehlo.add" in text and "tensor<4x8xf32>" in text
    assert cj.stablehlo_to_hlo_proto(_bytecode(ADD_TEXT))   # bytecode is accepted too


# -- shardings ------------------------------------------------------------------------------
def test_parse_hlo_sharding_prints_back_and_rejects_garbage():
    assert str(cj.parse_hlo_sharding("{devices=[2,1]0,1}")) == "{devices=[2,1]0,1}"
    with pytest.raises(Exception) as e:
        cj.parse_hlo_sharding("{devices=[2,1")
    assert not isinstance(e.value, MissingUpstreamAPI)


def test_replicated_hlo_sharding():
    hs = cj.replicated_hlo_sharding()
    assert str(hs) == "{replicated}"
    assert cj.hlo_sharding_layout(hs).kind == "replicated"


def test_hlo_sharding_layout_reads_every_kind():
    tiled = cj.hlo_sharding_layout(cj.parse_hlo_sharding("{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"))
    assert (tiled.kind, tiled.num_devices, tiled.tile_dims, tiled.device_ids) == ("tiled", 4, (2, 1, 2), (0, 1, 2, 3))
    assert tiled.replicate_on_last_tile_dim and tiled.num_subgroup_dims == 0 and tiled.tiled_rank == 2
    plain = cj.hlo_sharding_layout(cj.parse_hlo_sharding("{devices=[1,4]3,2,1,0}"))
    assert plain.tile_dims == (1, 4) and plain.device_ids == (3, 2, 1, 0) and plain.tiled_rank == 2
    maximal = cj.hlo_sharding_layout(cj.parse_hlo_sharding("{maximal device=3}"))
    assert (maximal.kind, maximal.device_ids, maximal.num_devices) == ("maximal", (3,), 0)
    assert cj.hlo_sharding_layout(cj.parse_hlo_sharding("{manual}")).kind == "manual"


def test_sharding_to_hlo_of_a_named_sharding():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(devices[:2]), ("x",))
    layout = cj.hlo_sharding_layout(cj.sharding_to_hlo(NamedSharding(mesh, P(None, "x")), 2))
    assert (layout.kind, layout.tile_dims, layout.num_devices) == ("tiled", (1, 2), 2)
    assert cj.hlo_sharding_layout(cj.sharding_to_hlo(NamedSharding(mesh, P()), 2)).kind == "replicated"


def test_sharding_devices_keeps_the_assignment_order():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    order = (devices[1], devices[0])
    sharding = NamedSharding(Mesh(np.array(order), ("x",)), P("x"))
    assert cj.sharding_devices(sharding) == order
    assert cj.sharding_devices(jax.sharding.SingleDeviceSharding(devices[0])) == (devices[0],)


def test_gspmd_sharding_places_arrays():
    devices = _devices()
    n = len(devices)
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    hs = cj.parse_hlo_sharding(f"{{devices=[{n},1]{','.join(map(str, range(n)))}}}" if n > 1 else "{replicated}")
    s = cj.gspmd_sharding(devices, hs, memory_kind="pinned_host")
    assert isinstance(s, jax.sharding.Sharding) and s.memory_kind == "pinned_host"
    assert s.shard_shape(x.shape) == (4 // n, 8)
    a = jax.device_put(x, s)
    assert a.sharding.memory_kind == "pinned_host"
    assert [tuple(sh.data.shape) for sh in a.addressable_shards] == [(4 // n, 8)] * n
    np.testing.assert_array_equal(np.asarray(a), x)


# -- lowerings, x64 -------------------------------------------------------------------------
def test_lowered_const_args_of_a_lowering():
    c = jnp.arange(8, dtype=jnp.float32)
    lowered = jax.jit(lambda a: a + c).lower(jnp.zeros(8, jnp.float32))
    assert cj.lowered_const_args(lowered) == ()   # .lower() does not hoist constants
    assert isinstance(cj.lowered_const_args(lowered), tuple)


def test_enable_x64_keeps_64_bit_types():
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on process-wide")
    assert jnp.asarray(np.int64(3)).dtype == jnp.int32
    with cj.enable_x64():
        assert jnp.asarray(np.int64(3)).dtype == jnp.int64
        assert jnp.asarray(np.float64(1.5)).dtype == jnp.float64
    assert jnp.asarray(np.int64(3)).dtype == jnp.int32


# -- the PJRT client and loaded executables -------------------------------------------------
def test_compile_spmd_partitions_over_the_devices(compiled):
    exe, devices, _ = compiled
    n = len(devices)
    assert len(exe.local_devices()) == n
    other = cj.compile_spmd(_bytecode(ADD_TEXT), devices[:1], num_parameters=1, result_has_sharding=[False])
    assert "f32[4,8]" in cj.compiled_hlo_text(other)


def test_compiled_hlo_text_is_the_partitioned_module(compiled):
    exe, devices, _ = compiled
    text = cj.compiled_hlo_text(exe)
    assert "entry_computation_layout" in text.split("\n", 1)[0]
    assert f"f32[{4 // len(devices)},8]" in text      # what one device runs


def test_compiled_memory_stats_are_per_device(compiled):
    exe, devices, _ = compiled
    stats = cj.compiled_memory_stats(exe)
    assert all(isinstance(v, int) for v in stats.values())
    per_device = 4 // len(devices) * 8 * 4
    assert stats["argument_size_in_bytes"] == per_device
    assert stats["output_size_in_bytes"] == per_device


def test_output_memory_kinds_follow_the_module():
    """A result jax lowered into ``pinned_host`` (its HLO carries the placement annotation), compiled the
    way PjrtExecutor compiles it: through HLO, ``mhlo.memory_kind`` set again on the result."""
    (device,) = _devices(1)
    kind = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    proto = jax.jit(lambda a: a * 2, out_shardings=kind).lower(jnp.zeros((4, 8), jnp.float32)) \
        .compiler_ir("hlo").as_serialized_hlo_module_proto()
    with cj.make_ir_context():
        mod = ir.Module.parse(cj.hlo_to_stablehlo(proto))
        main = next(op for op in mod.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
        main.attributes["res_attrs"] = ir.ArrayAttr.get(
            [ir.DictAttr.get({"mhlo.memory_kind": ir.StringAttr.get("pinned_host")})])
        data = cj.module_to_bytecode(mod)
    exe = cj.compile_spmd(data, (device,), num_parameters=1, result_has_sharding=[False])
    assert cj.output_memory_kinds(exe) == ["pinned_host"]


def test_output_hlo_shardings_of_a_partitioned_result(compiled):
    exe, devices, _ = compiled
    ops = cj.output_hlo_shardings(exe)
    if len(devices) == 1 and not ops:   # one device: jaxlib reports no result shardings
        return
    (op,) = ops
    sharding = cj.gspmd_sharding(devices, op)          # what PjrtExecutor builds from it
    assert sharding.shard_shape((4, 8)) == (4 // len(devices), 8)


def test_execute_sharded_returns_per_device_shards(compiled):
    exe, devices, x = compiled
    n = len(devices)
    (shards,) = cj.execute_sharded(exe, [_placed(x, devices)])
    assert len(shards) == n
    for i, s in enumerate(shards):
        np.testing.assert_array_equal(np.asarray(s), 2 * x[i * 4 // n:(i + 1) * 4 // n])
    out = jax.make_array_from_single_device_arrays(x.shape, _placed(x, devices).sharding, list(shards))
    np.testing.assert_array_equal(np.asarray(out), 2 * x)


# -- a missing API --------------------------------------------------------------------------
def test_a_missing_api_names_itself_and_the_versions():
    with pytest.raises(MissingUpstreamAPI, match=r"jax\._src\.lib\.xla_client\.no_such_api") as e:
        cj._lookup("jax._src.lib", "xla_client.no_such_api")
    assert e.value.api == "jax._src.lib.xla_client.no_such_api"
    assert jax.__version__ in str(e.value) and cj.VERIFIED in str(e.value)
    assert isinstance(e.value, ImportError)
    with pytest.raises(MissingUpstreamAPI, match="no_such_module"):
        cj._lookup("jax.no_such_module", "f")


def test_tracing_cache_entries_counts_entries_of_a_live_function_only():
    import gc

    def compile_new():
        def f(x):
            return jnp.sin(x) * 2
        jax.jit(f).lower(jax.ShapeDtypeStruct((3,), np.float32)).compile()
        return f

    compile_new()                       # fills jax's strong-keyed caches (shapes, shardings, lowering rules)
    gc.collect()
    before = cj.tracing_cache_entries()
    f = compile_new()
    assert cj.tracing_cache_entries() > before
    del f
    gc.collect()
    assert cj.tracing_cache_entries() == before   # the weak-keyed entries went with the function


def test_backends_initialized_after_jax_started():
    jax.devices()
    assert cj.backends_initialized() is True


# -- cuDNN fused attention -------------------------------------------------------------------
def _attention_operands():
    r = np.random.default_rng(0)
    q = jnp.asarray(r.standard_normal((2, 256, 8, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(r.standard_normal((2, 256, 2, 64)), jnp.bfloat16) for _ in range(2))
    bias = jnp.asarray(r.standard_normal((1, 1, 256, 256)), jnp.bfloat16)
    return q, k, v, bias


def _cuda_plugin() -> bool:
    import importlib.util
    return any(importlib.util.find_spec(f"jax_cuda{v}_plugin") is not None for v in (12, 13))


@pytest.mark.skipif(_cuda_plugin(), reason="a machine without jax's CUDA plugin (no cuDNN)")
def test_cudnn_attention_fixed_bias_refuses_without_cudnn():
    q, k, v, bias = _attention_operands()
    with pytest.raises(RuntimeError, match="cuDNN"):
        cj.cudnn_attention_fixed_bias(q, k, v, bias, scale=0.125, is_causal=False)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's kernel needs an NVIDIA GPU (JAX_PLATFORMS=cuda)")
def test_cudnn_attention_fixed_bias_equals_jax_and_has_no_bias_gradient():
    q, k, v, bias = _attention_operands()

    def ours(q, k, v):
        return cj.cudnn_attention_fixed_bias(q, k, v, bias, scale=0.125, is_causal=True)

    def public(q, k, v, b):
        return jax.nn.dot_product_attention(q, k, v, bias=b, scale=0.125, is_causal=True, implementation="cudnn")
    np.testing.assert_array_equal(np.asarray(ours(q, k, v), np.float32), np.asarray(public(q, k, v, bias), np.float32))
    g = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.bfloat16)
    mine = jax.vjp(ours, q, k, v)[1](g)
    ref = jax.vjp(public, q, k, v, bias)[1](g)
    for a, b in zip(mine, ref[:3]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
    # the backward kernel's results: dq, dk, dv and its workspace here; dbias too in jax's public call
    text = jax.jit(lambda q, k, v: jax.vjp(ours, q, k, v)[1](g)).lower(q, k, v).as_text()
    text_public = jax.jit(lambda q, k, v: jax.vjp(public, q, k, v, bias)[1](g)).lower(q, k, v).as_text()
    assert _backward_results(text) == _backward_results(text_public) - 1


def _backward_results(stablehlo: str) -> int:
    """How many results the one cuDNN attention backward custom call of a lowered module has."""
    import re
    calls = re.findall(r'%[\w.#]+(?::(\d+))? = stablehlo\.custom_call @"?__cudnn\$fmha\w*Backward', stablehlo)
    assert len(calls) == 1, calls
    return int(calls[0] or 1)
