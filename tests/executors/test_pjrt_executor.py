"""PJRT executor: JAX- and HLO-proto-lowered layered models with stacked weights in pinned_host.

Runs on the virtual CPU devices of conftest.py (``XLA_SWAP_NUM_DEVICES``: 1, 4 or 8).
The reference is always plain jax with the same shardings and every array on the device.
"""
import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from xla_swap.executors.pjrt import executor as pjrt, host_memory as pjrt_host_memory
from xla_swap.executors.pjrt.executor import HOST_MEMORY_LIMIT_ENV, MemoryReport
from xla_swap.executors.pjrt import HostMemoryError, ParameterPlacement, PjrtExecutor, compile_lowered

L, D, B = 3, 16, 4          # layers, width (divisible by 1, 4 and 8), batch
W_BYTES = L * D * D * 4     # the stacked fp32 weights, global


def layered(w, x):
    """``L`` tanh layers; each layer's weights are moved to the device inside the scan body."""
    def body(h, wi):
        wi = jax.device_put(wi, jax.memory.Space.Device)
        return jnp.tanh(h @ wi), None
    h, _ = jax.lax.scan(body, x, w)
    return h


def loss(w, x):
    return jnp.sum(layered(w, x) ** 2)


grad_loss = jax.grad(loss)


@pytest.fixture(scope="module")
def setup(num_devices):
    assert len(jax.devices()) == num_devices
    mesh = Mesh(np.array(jax.devices()), ("x",))
    w_dev = NamedSharding(mesh, P(None, "x", None))          # weights sharded on dim 1
    w_host = w_dev.with_memory_kind("pinned_host")
    x_sh = NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((L, D, D)) / np.sqrt(D)).astype(np.float32)
    x = rng.standard_normal((B, D)).astype(np.float32)
    return dict(mesh=mesh, w_dev=w_dev, w_host=w_host, x_sh=x_sh, w=w, x=x)


def reference(fn, s):
    """Plain jax, everything on the device, same shardings."""
    return np.asarray(jax.jit(fn, in_shardings=(s["w_dev"], s["x_sh"]))(s["w"], s["x"]))


def lower_host(fn, s, platform=None):
    traced = jax.jit(fn, in_shardings=(s["w_host"], s["x_sh"])).trace(s["w"], s["x"])
    return traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()


def entry_layout(ex: PjrtExecutor) -> str:
    header = ex.compiled_hlo_text().split("\n", 1)[0]
    return header[header.index("entry_computation_layout"):]


# ---------------------------------------------------------------------------------------
@pytest.mark.spmd
@pytest.mark.parametrize("platform", [None, "cuda"], ids=["cpu-lowering", "cuda-lowering"])
def test_jax_layered_model_forward_and_grad_with_pinned_host_weights(setup, num_devices, platform):
    """cuda-lowering: the module carries annotate_device_placement custom calls (jax emits them
    only for TPU/GPU), and the CPU compiler still has to honour the S(5) entry parameter."""
    s = setup
    for fn in (layered, grad_loss):
        lowered = lower_host(fn, s, platform)
        if platform == "cuda":
            assert "annotate_device_placement" in lowered.as_text()
        ex = compile_lowered(lowered)
        assert ex.parameter_memory_kinds == ("pinned_host", "device")
        assert len(ex.devices) == num_devices
        shard = f"f32[{L},{D // num_devices},{D}]{{2,1,0:S(5)}}"
        assert entry_layout(ex).startswith(f"entry_computation_layout={{({shard}, f32[{B},{D}]{{1,0}})")
        w = ex.put(0, s["w"])
        assert w.sharding.memory_kind == "pinned_host"
        assert w.sharding.is_equivalent_to(s["w_host"], 3)
        (out,) = ex(w, s["x"])
        expected = reference(fn, s)
        assert out.shape == expected.shape and out.dtype == np.float32
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-7)
        assert np.abs(expected).max() > 1e-3     # not a trivially zero comparison


@pytest.mark.spmd
def test_memory_report_moves_exactly_the_weights_to_host(setup, num_devices):
    lowered = lower_host(grad_loss, setup)
    on_host = compile_lowered(lowered).memory_report()
    on_device = compile_lowered(lowered, placements={0: "device"}).memory_report()
    assert isinstance(on_host, MemoryReport)
    shard = W_BYTES // num_devices                       # per device
    x_bytes = B * D * 4                                  # replicated: full size on every device
    assert on_host.parameter_memory_spaces == ("pinned_host", "device")
    assert on_device.parameter_memory_spaces == ("device", "device")
    assert on_host.parameter_bytes == on_device.parameter_bytes == (shard, x_bytes)
    assert on_host.host_argument_bytes == shard and on_device.host_argument_bytes == 0
    assert on_device.device_argument_bytes == shard + x_bytes
    assert on_device.device_argument_bytes - on_host.device_argument_bytes == shard
    # the CPU client counts both placements in argument_size_in_bytes; the split is the layout's
    assert on_host.raw_stats["argument_size_in_bytes"] == on_device.raw_stats["argument_size_in_bytes"] == shard + x_bytes
    assert on_host.split_source == "entry_layout"
    text = str(on_host)
    assert "pinned_host" in text and f"{num_devices} device(s)" in text and str(shard) in text


@pytest.mark.spmd
def test_raw_hlo_module_proto_with_torch_xla_style_sharding_string(setup, num_devices):
    s = setup
    proto = jax.jit(layered).lower(s["w"], s["x"]).compiler_ir("hlo").as_serialized_hlo_module_proto()
    assert isinstance(proto, bytes)
    ids = ",".join(map(str, range(num_devices)))
    spec = f"{{devices=[1,{num_devices},1]{ids}}}" if num_devices > 1 else "{replicated}"
    ex = PjrtExecutor(proto, placements={0: ParameterPlacement("pinned_host", spec)})
    assert len(ex.devices) == num_devices                  # devices inferred from the sharding
    assert ex.parameters[0].hlo_sharding == spec
    assert ex.memory_report().parameter_memory_spaces == ("pinned_host", "device")
    (out,) = ex(s["w"], s["x"])
    np.testing.assert_allclose(np.asarray(out), reference(layered, s), rtol=1e-6, atol=1e-7)


@pytest.mark.spmd
def test_stablehlo_text_keeps_jax_memory_kinds_and_shardings(setup, num_devices):
    s = setup
    text = lower_host(layered, s).as_text()                # sdy.sharding + mhlo.memory_kind
    assert 'mhlo.memory_kind = "pinned_host"' in text
    ex = PjrtExecutor(text)
    assert ex.parameter_memory_kinds == ("pinned_host", "device")
    report = ex.memory_report()
    assert report.parameter_memory_spaces == ("pinned_host", "device")
    assert report.parameter_bytes[0] == W_BYTES // num_devices
    (out,) = ex(s["w"], s["x"])
    np.testing.assert_allclose(np.asarray(out), reference(layered, s), rtol=1e-6, atol=1e-7)


@pytest.mark.spmd
def test_host_parameters_stay_resident_across_calls(setup):
    s = setup
    ex = compile_lowered(lower_host(layered, s))
    w = ex.put(0, s["w"])
    x = ex.put(1, s["x"])
    assert w.sharding.memory_kind == "pinned_host" and x.sharding.memory_kind == "device"
    assert ex.transfer_count == 2
    pointers = [sh.data.unsafe_buffer_pointer() for sh in w.addressable_shards]
    assert ex.put(0, w) is w                                 # already placed: no copy
    expected = reference(layered, s)
    for _ in range(3):
        (out,) = ex(w, x)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-7)
    assert ex.transfer_count == 2                            # nothing was placed again
    assert not w.is_deleted()
    assert [sh.data.unsafe_buffer_pointer() for sh in w.addressable_shards] == pointers
    assert w.sharding.memory_kind == "pinned_host"
    # a numpy argument is placed on every call; a device-memory copy of w is moved to pinned_host
    ex(s["w"], x)
    assert ex.transfer_count == 3
    ex(jax.device_put(s["w"], s["w_dev"]), x)
    assert ex.transfer_count == 4
    placed = ex.put_all([s["w"], s["x"]])
    assert [a.sharding.memory_kind for a in placed] == ["pinned_host", "device"]


# -- errors ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def host_executor(setup):
    return compile_lowered(lower_host(layered, setup))


def _still_works(ex, s):
    (out,) = ex(s["w"], s["x"])
    np.testing.assert_allclose(np.asarray(out), reference(layered, s), rtol=1e-6, atol=1e-7)


def test_placement_errors(setup):
    lowered = lower_host(layered, setup)
    with pytest.raises(ValueError, match=r"parameter index 5 does not exist; the module has 2 entry parameter"):
        compile_lowered(lowered, placements={5: "pinned_host"})
    with pytest.raises(ValueError, match=r"placements\[1\]: unknown memory kind 'hbm'"):
        compile_lowered(lowered, placements={1: "hbm"})
    with pytest.raises(ValueError, match=r"placements\[0\]: invalid HLO sharding string '\{devices=\[4,1\}': .*error"):
        compile_lowered(lowered, placements={0: ParameterPlacement("pinned_host", "{devices=[4,1}")})
    with pytest.raises(ValueError, match=r"placements\[1\]: sharding .* tiles 3 dimension\(s\), but the parameter has rank 2"):
        compile_lowered(lowered, placements={1: ParameterPlacement("device", "{devices=[2,1,1]0,1}")})
    with pytest.raises(TypeError, match=r"placements\[0\]: expected 'device', 'pinned_host'"):
        compile_lowered(lowered, placements={0: 3})
    with pytest.raises(TypeError, match="module: expected HloModuleProto bytes"):
        PjrtExecutor(12345)
    with pytest.raises(ValueError, match="could not read the bytes as a serialized HloModuleProto"):
        PjrtExecutor(b"\x01\x02not a proto")
    _still_works(compile_lowered(lowered), setup)


@pytest.mark.spmd
def test_device_count_errors(setup, num_devices):
    s = setup
    available = len(jax.devices())
    too_many = f"{{devices=[1,{available + 1},1]<=[{available + 1}]}}"
    proto = jax.jit(layered).lower(s["w"], s["x"]).compiler_ir("hlo").as_serialized_hlo_module_proto()
    with pytest.raises(ValueError, match=rf"partitioned over {available + 1} devices, but only {available} cpu"):
        PjrtExecutor(proto, placements={0: ParameterPlacement("pinned_host", too_many)})
    if num_devices > 1:
        spec = f"{{devices=[1,{num_devices},1]{','.join(map(str, range(num_devices)))}}}"
        with pytest.raises(ValueError, match=rf"parameter 0 is sharded \{{devices=\[1,{num_devices},1\].* over "
                                             rf"{num_devices} devices, but {num_devices - 1} device\(s\) were given"):
            PjrtExecutor(proto, placements={0: ParameterPlacement("pinned_host", spec)}, devices=jax.devices()[:-1])
        with pytest.raises(ValueError, match=rf"mhlo.num_partitions={num_devices}, but {num_devices - 1} device"):
            compile_lowered(lower_host(layered, s), devices=jax.devices()[:-1])
    with pytest.raises(ValueError, match="duplicate devices"):
        PjrtExecutor(proto, devices=[jax.devices()[0]] * 2)
    with pytest.raises(ValueError, match="expected a non-empty sequence of jax devices"):
        PjrtExecutor(proto, devices=[0])
    _still_works(compile_lowered(lower_host(layered, s)), s)


def test_call_errors_name_the_parameter(setup, host_executor):
    s, ex = setup, host_executor
    before = ex.transfer_count
    with pytest.raises(ValueError, match=r"call: argument 1: parameter 1 expects shape \[4, 16\], got \[3, 16\]"):
        ex(s["w"], np.zeros((3, D), np.float32))
    with pytest.raises(TypeError, match=r"call: argument 1: parameter 1 expects dtype float32, got float64"):
        ex(s["w"], s["x"].astype(np.float64))
    with pytest.raises(ValueError, match=r"the module has 2 parameter\(s\), got 1 argument"):
        ex(s["w"])
    with pytest.raises(ValueError, match=r"index: parameter 2 does not exist; the module has 2 entry parameter"):
        ex.put(2, s["x"])
    with pytest.raises(TypeError, match=r"put: parameter 0 expects dtype float32, got int32"):
        ex.put(0, s["w"].astype(np.int32))
    with pytest.raises(ValueError, match=r"put_all: expected 2 arrays"):
        ex.put_all([s["w"]])
    # a bad second argument: nothing was placed for the good first one
    with pytest.raises(ValueError, match="parameter 1 expects shape"):
        ex.put_all([s["w"], np.zeros((1,), np.float32)])
    assert ex.transfer_count == before
    _still_works(ex, s)


def test_pinned_host_limit_raises_memory_error_before_placing(setup, host_executor):
    s, ex = setup, host_executor
    gc.collect()
    in_use = ex.host_bytes_in_use()
    old = ex.host_memory_limit_bytes
    try:
        ex.host_memory_limit_bytes = in_use + W_BYTES - 1
        before = ex.transfer_count
        with pytest.raises(HostMemoryError, match=rf"placing {W_BYTES} bytes in pinned_host.*{HOST_MEMORY_LIMIT_ENV}") as err:
            ex.put(0, s["w"])
        assert isinstance(err.value, MemoryError)
        assert err.value.requested_bytes == W_BYTES and err.value.limit_bytes == in_use + W_BYTES - 1
        with pytest.raises(HostMemoryError, match=HOST_MEMORY_LIMIT_ENV):
            ex(s["w"], s["x"])
        assert ex.transfer_count == before and ex.host_bytes_in_use() == in_use
        ex.host_memory_limit_bytes = in_use + W_BYTES
        w = ex.put(0, s["w"])                                   # exactly fits
        assert ex.host_bytes_in_use() == in_use + W_BYTES
        (out,) = ex(w, s["x"])
        np.testing.assert_allclose(np.asarray(out), reference(layered, s), rtol=1e-6, atol=1e-7)
    finally:
        ex.host_memory_limit_bytes = old


def test_runtime_pinned_host_exhaustion_becomes_memory_error(setup, host_executor, monkeypatch):
    s, ex = setup, host_executor
    msg = ("RESOURCE_EXHAUSTED: Out of host memory while trying to allocate 123 bytes "
           "with allocator xla_gpu_host_bfc on device 0.")

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(msg)

    monkeypatch.setattr(pjrt.jax, "device_put", exhausted)
    with pytest.raises(HostMemoryError, match=rf"parameter 0: .*could not allocate {W_BYTES} bytes .*"
                                              rf"{HOST_MEMORY_LIMIT_ENV}") as err:
        ex.put(0, s["w"])
    assert err.value.requested_bytes == W_BYTES
    assert "RESOURCE_EXHAUSTED" in str(err.value.__cause__)
    monkeypatch.undo()
    _still_works(ex, s)


def test_gpu_default_limit_comes_from_the_env_var(setup, monkeypatch):
    ex = compile_lowered(lower_host(layered, setup))
    assert ex.host_memory_limit_bytes is None                # CPU: unlimited by default
    monkeypatch.setenv(HOST_MEMORY_LIMIT_ENV, "2")
    monkeypatch.setattr(pjrt_host_memory, "GPU_PLATFORMS", pjrt_host_memory.GPU_PLATFORMS + ("cpu",))  # CPU as a GPU
    ex = compile_lowered(lower_host(layered, setup))
    assert ex.host_memory_limit_bytes == 2 * 2**30
    with pytest.raises(ValueError, match="host_memory_limit_bytes: expected None, 'auto' or a non-negative int"):
        compile_lowered(lower_host(layered, setup), host_memory_limit_bytes=-1)


def test_imports_without_torch():
    code = ("import sys, xla_swap.executors.pjrt as p; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_xla')]; "
            "assert not bad, bad; print(p.PjrtExecutor.__name__)")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "PjrtExecutor"


@pytest.mark.spmd
def test_torch_xla_lowering_runs_with_its_sharding_strings(num_devices):
    """The real front end: torch_xla's HloModuleProto, sharding strings as torch_xla reports them."""
    pytest.importorskip("torch_xla")
    import torch
    import torch_xla
    from xla_util import mesh_2d, to_xla
    from xla_swap.lowering.computation import lower_fn

    g = torch.Generator().manual_seed(0)
    cpu = {"w1": torch.randn(16, 32, generator=g), "w2": torch.randn(32, 16, generator=g),
           "b": torch.randn(32, generator=g)}
    mesh = mesh_2d()
    xla = {"w1": to_xla(cpu["w1"], mesh, ("x", None)), "w2": to_xla(cpu["w2"], mesh, ("x", "y")),
           "b": to_xla(cpu["b"])}
    torch_xla.sync()
    x_cpu = torch.randn(4, 16, generator=g)
    lowered = lower_fn(lambda x: torch.tanh(x @ xla["w1"] + xla["b"]) @ xla["w2"] * 0.5, to_xla(x_cpu))
    weights = {lowered.parameter_id(t): name for name, t in xla.items()}
    x_id = lowered.input_parameters[0].id
    assert len(weights) == 3 and x_id not in weights
    host = {pid: ParameterPlacement("pinned_host", lowered.parameters[pid].sharding) for pid in weights}
    ex = PjrtExecutor(lowered.hlo_proto, placements=host)
    assert len(ex.devices) == num_devices
    report = ex.memory_report()
    for p in lowered.parameters:
        assert report.parameter_memory_spaces[p.id] == ("pinned_host" if p.id in weights else "device"), report
        assert ex.parameters[p.id].hlo_sharding == p.sharding          # torch_xla's own strings
    # weights from the CPU copies, other captured constants from their device data, x from the caller
    values = [cpu[weights[p.id]].numpy() if p.id in weights else x_cpu.numpy() if p.id == x_id
              else p.tensor.cpu().numpy() for p in lowered.parameters]
    placed = ex.put_all(values)
    assert all(placed[pid].sharding.memory_kind == "pinned_host" for pid in weights)
    (out,) = ex(*placed)
    expected = (torch.tanh(x_cpu @ cpu["w1"] + cpu["b"]) @ cpu["w2"] * 0.5).numpy()
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


# -- host callbacks, bool dtypes, donation, argument checks, result memory kinds, policies ---------
_CALLBACK_SCRIPT = r"""
import numpy as np, jax, jax.numpy as jnp
from jax.experimental import io_callback
from xla_swap.executors.pjrt import PjrtExecutor, compile_lowered

def dbg(x):
    jax.debug.print("x={x}", x=x)
    return x * 2

def pure(x):
    return jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1

def io(x):
    return io_callback(lambda a: np.asarray(a) + 1, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 3

x = np.arange(4, dtype=np.float32)
for fn in (dbg, pure, io):
    low = jax.jit(fn).lower(x)
    for build in (lambda: compile_lowered(low),
                  lambda: PjrtExecutor(low.compiler_ir("hlo").as_serialized_hlo_module_proto())):
        try:
            ex = build()
            ex(x)
            print("NOT REFUSED", fn.__name__)
        except ValueError as e:
            print("REFUSED", fn.__name__, str(e).splitlines()[0][:300])
(out,) = compile_lowered(jax.jit(lambda a: a * 2).lower(x))(x)   # the process is still usable
print("STILL WORKS", np.asarray(out).tolist())
"""


def test_host_callbacks_are_refused_before_compiling():
    """jax.debug.print / pure_callback / io_callback: a ValueError naming the callback, not a segfault."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _CALLBACK_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"exit code {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    refused = [ln for ln in r.stdout.splitlines() if ln.startswith("REFUSED")]
    assert len(refused) == 6, r.stdout
    assert all("calls back into Python on the host" in ln and "python" in ln and "callback" in ln for ln in refused)
    assert "NOT REFUSED" not in r.stdout
    assert "STILL WORKS [0.0, 2.0, 4.0, 6.0]" in r.stdout


def test_bool_parameters_and_results(setup):
    """i1 (HLO pred) is numpy bool, not jax's float0: calls work and byte counts are 1 per element."""
    def fn(m, x):
        return jnp.where(m, x, 0.0), jnp.logical_and(m, x > 0)

    m = np.array([[True, False, True, True]] * B)
    x = np.linspace(-1, 1, B * 4, dtype=np.float32).reshape(B, 4)
    ex = compile_lowered(jax.jit(fn).lower(m, x))
    assert ex.parameters[0].dtype == np.dtype(bool) and ex.output_dtypes == (np.dtype(np.float32), np.dtype(bool))
    assert ex.parameters[0].nbytes == B * 4
    report = ex.memory_report()
    assert report.parameter_bytes == (B * 4, B * 4 * 4)
    assert report.output_bytes == (B * 4 * 4, B * 4)
    got = ex(ex.put(0, m), x)
    want = fn(m, x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_bfloat16_and_float8_parameters(setup):
    """bfloat16 (and fp8) are void-kind numpy dtypes like float0, but real types: they must stay supported."""
    def fn(x, y):
        return (x.astype(jnp.float32) * 2).astype(jnp.bfloat16), y.astype(jnp.float32)

    x = (np.arange(B * 4, dtype=np.float32).reshape(B, 4) / 7).astype(jnp.bfloat16)
    y = np.ones((B, 4), jnp.float8_e4m3fn)
    ex = compile_lowered(jax.jit(fn).lower(x, y))
    assert ex.parameters[0].dtype == jnp.bfloat16 and ex.parameters[1].dtype == jnp.float8_e4m3fn
    assert ex.memory_report().parameter_bytes == (B * 4 * 2, B * 4)
    got = ex(x, y)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(fn(x, y)[0]))


@pytest.mark.spmd
def test_donating_lowering_never_deletes_the_callers_arrays(setup, num_devices):
    """A module that aliases inputs to outputs (donation) is compiled without it: put() results survive."""
    s = setup

    def step(w, x):
        return w * 0.5, layered(w, x)

    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(s["w"], s["x"])
    proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
    assert "input_output_alias" in lowered.compiler_ir("hlo").as_hlo_text().split("\n", 1)[0]   # it donates
    ids = ",".join(map(str, range(num_devices)))
    spec = f"{{devices=[1,{num_devices},1]{ids}}}" if num_devices > 1 else "{replicated}"
    for ex in (compile_lowered(lowered),                                               # one device
               PjrtExecutor(proto, placements={0: ParameterPlacement("device", spec)})):  # SPMD, torch_xla style
        assert ex.donated_parameters == (0, 1)                     # w aliases result 0, x result 1
        assert "input_output_alias" not in ex.compiled_hlo_text().split("\n", 1)[0]
        w, x = ex.put(0, s["w"]), ex.put(1, s["x"])
        for _ in range(2):
            w_half, out = ex(w, x)
            assert not w.is_deleted() and not x.is_deleted()
            np.testing.assert_allclose(np.asarray(out), reference(layered, s), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(w_half), s["w"] * 0.5)
        np.testing.assert_array_equal(np.asarray(w), s["w"])       # the user's buffer is unchanged


def test_bad_arguments_name_the_argument_before_any_state_change(setup, host_executor, num_devices):
    s, ex = setup, host_executor
    lowered = lower_host(layered, s)
    with pytest.raises(TypeError, match=r"placements: expected a mapping .* got list"):
        compile_lowered(lowered, placements=["pinned_host", "device"])
    with pytest.raises(TypeError, match=r"placements: expected a mapping .* got str"):
        compile_lowered(lowered, placements="pinned_host")
    with pytest.raises(TypeError, match=r"result_memory_kinds: expected a mapping .* got tuple"):
        compile_lowered(lowered, result_memory_kinds=("pinned_host",))
    with pytest.raises(TypeError, match=r"devices: expected a sequence of jax devices, got one Device"):
        PjrtExecutor(jax.jit(layered).lower(s["w"], s["x"]).compiler_ir("hlo").as_serialized_hlo_module_proto(),
                     devices=jax.devices()[0])
    with pytest.raises(TypeError, match=r"devices: expected a sequence of jax devices, got int"):
        compile_lowered(lowered, devices=3)
    with pytest.raises(ValueError, match=r"result_memory_kinds: result index 4 does not exist; the module has 1"):
        compile_lowered(lowered, result_memory_kinds={4: "pinned_host"})
    with pytest.raises(ValueError, match=r"result_memory_kinds\[0\]: unknown memory kind 'hbm'"):
        compile_lowered(lowered, result_memory_kinds={0: "hbm"})
    # an uneven sharding is refused at construction, not at call time
    odd = np.ones((num_devices + 2, D), np.float32) if num_devices > 1 else None
    if odd is not None:
        proto = jax.jit(jnp.tanh).lower(odd).compiler_ir("hlo").as_serialized_hlo_module_proto()
        spec = f"{{devices=[{num_devices},1]{','.join(map(str, range(num_devices)))}}}"
        with pytest.raises(ValueError, match=rf"placements\[0\]: sharding .* splits dimension 0 of size "
                                             rf"{num_devices + 2} into {num_devices} shards"):
            PjrtExecutor(proto, placements={0: ParameterPlacement("device", spec)})
    # deleted jax arrays: a ValueError naming the parameter, nothing placed
    before = ex.transfer_count
    dead = jnp.asarray(s["x"])
    dead.delete()
    with pytest.raises(ValueError, match=r"call: argument 1: parameter 1 got a deleted jax.Array"):
        ex(s["w"], dead)
    with pytest.raises(ValueError, match=r"put: parameter 1 got a deleted jax.Array"):
        ex.put(1, dead)
    with pytest.raises(ValueError, match=r"put_all: argument 1: parameter 1 got a deleted jax.Array"):
        ex.put_all([s["w"], dead])
    assert ex.transfer_count == before
    _still_works(ex, s)


@pytest.mark.spmd
def test_result_memory_kinds_for_a_module_without_them(setup, num_devices):
    """An HloModuleProto (no memory kinds, as torch_xla's): gradients written to pinned_host on request."""
    s = setup
    proto = jax.jit(grad_loss).lower(s["w"], s["x"]).compiler_ir("hlo").as_serialized_hlo_module_proto()
    ids = ",".join(map(str, range(num_devices)))
    spec = f"{{devices=[1,{num_devices},1]{ids}}}" if num_devices > 1 else "{replicated}"
    plain = PjrtExecutor(proto, placements={0: ParameterPlacement("pinned_host", spec)})
    assert plain.output_shardings[0].memory_kind == "device"
    ex = PjrtExecutor(proto, placements={0: ParameterPlacement("pinned_host", spec)},
                      result_memory_kinds={0: "pinned_host"})
    assert ex.output_shardings[0].memory_kind == "pinned_host"
    report = ex.memory_report()
    assert report.output_memory_spaces == ("pinned_host",)
    assert report.host_output_bytes == report.output_bytes[0] > 0
    (g,) = ex(ex.put(0, s["w"]), s["x"])
    assert g.sharding.memory_kind == "pinned_host"
    np.testing.assert_allclose(np.asarray(g), reference(grad_loss, s), rtol=1e-5, atol=1e-6)
    # and back to the device for a JAX lowering that put it on the host
    lowered = jax.jit(lambda w, x: jax.device_put(grad_loss(w, x), jax.memory.Space.Host),
                      in_shardings=(s["w_host"], s["x_sh"])).lower(s["w"], s["x"])
    assert compile_lowered(lowered).output_shardings[0].memory_kind == "pinned_host"
    ex_dev = compile_lowered(lowered, result_memory_kinds={0: "device"})
    assert ex_dev.memory_report().output_memory_spaces == ("device",)
    (g_dev,) = ex_dev(s["w"], s["x"])
    assert g_dev.sharding.memory_kind == "device"
    np.testing.assert_allclose(np.asarray(g_dev), reference(grad_loss, s), rtol=1e-5, atol=1e-6)


@pytest.mark.spmd
def test_from_policy_places_weights_and_gradients(setup, num_devices):
    """An OffloadPolicy plus a framework-neutral parameter table gives the placements."""
    from types import SimpleNamespace
    from xla_swap.executors.pjrt import placements_for_policy
    from xla_swap.planning import OffloadPolicy
    s = setup

    def step(w, x):
        return loss(w, x), grad_loss(w, x)

    proto = jax.jit(step).lower(s["w"], s["x"]).compiler_ir("hlo").as_serialized_hlo_module_proto()
    ids = ",".join(map(str, range(num_devices)))
    spec = f"{{devices=[1,{num_devices},1]{ids}}}" if num_devices > 1 else "{replicated}"
    lowering = SimpleNamespace(hlo_proto=proto, parameters=[SimpleNamespace(id=0, sharding=spec, kind="input"),
                                                            SimpleNamespace(id=1, sharding="{replicated}", kind="input")])
    policy = OffloadPolicy(params="host", grads="host")
    p = placements_for_policy(policy, lowering.parameters, weights=[0], grad_results=[1])
    assert p.placements == {0: ParameterPlacement("pinned_host", spec), 1: ParameterPlacement("device", "{replicated}")}
    assert p.result_memory_kinds == {1: "pinned_host"}
    ex = PjrtExecutor.from_policy(lowering, policy, weights=[0], grad_results=[1])
    assert ex.parameter_memory_kinds == ("pinned_host", "device")
    assert ex.parameters[0].hlo_sharding == spec
    report = ex.memory_report()
    assert report.parameter_memory_spaces == ("pinned_host", "device")
    assert report.output_memory_spaces == ("device", "pinned_host")
    lval, g = ex(ex.put(0, s["w"]), s["x"])
    assert g.sharding.memory_kind == "pinned_host" and lval.sharding.memory_kind == "device"
    np.testing.assert_allclose(np.asarray(g), reference(grad_loss, s), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(lval), float(reference(loss, s)), rtol=1e-5)
    # the all-device policy: everything on the device, shardings still from the table
    ex_dev = PjrtExecutor.from_policy(lowering, OffloadPolicy(), weights=[0])
    assert ex_dev.memory_report().parameter_memory_spaces == ("device", "device")
    assert ex_dev.memory_report().output_memory_spaces == ("device", "device")
    # errors name the argument, before compiling
    with pytest.raises(ValueError, match="weights: policy.params='host' needs the indices"):
        PjrtExecutor.from_policy(lowering, policy, grad_results=[1])
    with pytest.raises(ValueError, match="grad_results: policy.grads='host' needs the result indices"):
        PjrtExecutor.from_policy(lowering, policy, weights=[0])
    with pytest.raises(ValueError, match=r"weights: parameter index 7 does not exist; the module has 2"):
        PjrtExecutor.from_policy(lowering, policy, weights=[7], grad_results=[1])
    with pytest.raises(ValueError, match=r"result_memory_kinds: result index 5 does not exist"):
        PjrtExecutor.from_policy(lowering, policy, weights=[0], grad_results=[5])
    with pytest.raises(TypeError, match="policy: expected an xla_swap.planning.OffloadPolicy"):
        PjrtExecutor.from_policy(lowering, "host", weights=[0])
    with pytest.raises(TypeError, match="weights: expected int parameter indices"):
        PjrtExecutor.from_policy(lowering, policy, weights=["w"], grad_results=[1])
    # without a table (a jax Lowered): weights by index, shardings from the module
    ex_j = PjrtExecutor.from_policy(jax.jit(step, in_shardings=(s["w_dev"], s["x_sh"])).lower(s["w"], s["x"]),
                                    policy, weights=[0], grad_results=[1])
    assert ex_j.memory_report().parameter_memory_spaces == ("pinned_host", "device")
    assert ex_j.output_shardings[1].memory_kind == "pinned_host"


def test_negative_gpu_host_memory_limit_env_is_refused(monkeypatch):
    """A negative or non-finite XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB is an error naming the variable, not a negative pool."""
    gpu = next(iter(pjrt_host_memory.GPU_PLATFORMS))
    for bad in ("-1", "nan", "inf"):
        monkeypatch.setenv(pjrt_host_memory.HOST_MEMORY_LIMIT_ENV, bad)
        with pytest.raises(ValueError, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"):
            pjrt_host_memory.default_host_limit(gpu)
    monkeypatch.setenv(pjrt_host_memory.HOST_MEMORY_LIMIT_ENV, "2")
    assert pjrt_host_memory.default_host_limit(gpu) == 2 << 30
