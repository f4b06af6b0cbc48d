"""Tests of xla_swap.executors.ingraph (numpy + jax only, on a virtual CPU device).

On CPU the compiler strips the placement annotations (no host offloader), so what is
checked here is the program: values against the monolithic device-resident reference,
the weights as ``pinned_host`` entry parameters, pytree carries, errors. Whether XLA
overlaps the copies is a GPU property, measured by ``python -m benchmarks.gpu_stack``
(``copy_start_count`` there).
"""
import jax
import jax.numpy as jnp
import pytest

from streaming_cases import L, check_close, chunk_stages, layer, mono_forward, stacked
from xla_swap.executors import InGraphRuntime, MemoryReport, RuntimeConfig, StreamingRuntime


def test_forward_matches_monolithic(params, x):
    rt = InGraphRuntime(layer, params)
    y = rt.forward(x)
    check_close(y, mono_forward(stacked(params), x))
    assert y.sharding.memory_kind == "device"
    assert rt.weight_nbytes == sum(p["a"].nbytes + p["b"].nbytes for p in params)
    for p in rt.host_params:
        assert all(leaf.sharding.memory_kind == "pinned_host" for leaf in jax.tree_util.tree_leaves(p))
    # the weights are entry parameters of the one program, in host memory space S(5)
    text = rt.compile(x).as_text()
    assert text.count("S(5)") >= 2 * L
    rep = rt.memory_report()
    assert isinstance(rep, MemoryReport) and rep.executor == "ingraph" and rep.num_devices == 1
    # on CPU the split comes from the entry layout: the weights in pinned_host, h and the output on the device
    weights = sum(p["a"].nbytes + p["b"].nbytes for p in params)
    assert rep.parameter_memory_spaces.count("pinned_host") == 2 * L
    assert rep.host_argument_bytes == weights and rep.device_argument_bytes == x.nbytes
    assert rep.output_memory_spaces == ("device",) and rep.device_output_bytes == x.nbytes
    check_close(rt(jnp.asarray(x)), y, rtol=0, atol=0)   # second call: same executable


def test_shares_streaming_host_buffers_and_chunked_stages(params, x):
    """The pinned_host buffers of a StreamingRuntime are used as they are; pytree carry works."""
    fns, sp = chunk_stages(params, 2)
    srt = StreamingRuntime(fns, sp, RuntimeConfig(prefetch_depth=2))
    rt = InGraphRuntime(fns, srt.host_params)
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(rt.host_params),
                                      jax.tree_util.tree_leaves(srt.host_params)))
    y, _ = rt.forward((x, x))
    check_close(y, mono_forward(stacked(params), x), rtol=1e-5, atol=1e-5)
    check_close(y, srt.forward((x, x))[0], rtol=1e-6, atol=1e-6)


def test_bad_input(params, x):
    with pytest.raises(ValueError, match="non-empty sequence"):
        InGraphRuntime(layer, [])
    with pytest.raises(ValueError, match="stage_fn has 2 functions but stage_params has 8"):
        InGraphRuntime([layer, layer], params)
    with pytest.raises(TypeError, match=r"stage_params\[0\]\['a'\]: expected an array"):
        InGraphRuntime(layer, [{"a": "w", "b": params[0]["b"]}])
    with pytest.raises(TypeError, match="device must be a jax.Device"):
        InGraphRuntime(layer, params, device="gpu:0")
    with pytest.raises(TypeError, match="compiler_options must be a dict"):
        InGraphRuntime(layer, params, compiler_options="--xla_foo")
    rt = InGraphRuntime(layer, params)
    rt.forward(x)
    with pytest.raises(ValueError, match=r"h has shape \(4, 16\).*compiled for shape \(8, 16\)"):
        rt.forward(x[:4])
    check_close(rt.forward(x), mono_forward(stacked(params), x))   # still usable


def test_compiler_options_reach_xla(params, x):
    """A known XLA debug option compiles (same values); an unknown one fails at compile, naming it."""
    rt = InGraphRuntime(layer, params, compiler_options={"xla_cpu_enable_fast_math": False})
    check_close(rt.forward(x), mono_forward(stacked(params), x))
    bad = InGraphRuntime(layer, params, compiler_options={"xla_no_such_option": True})
    with pytest.raises(Exception, match="xla_no_such_option"):
        bad.forward(x)


def test_stage_errors_name_the_stage_and_deleted_arrays_are_refused(params, x):
    """A shape mismatch inside one stage names that stage; deleted arrays give a ValueError; no state changes."""
    bad = list(params)
    bad[3] = {"a": params[3]["a"][:8], "b": params[3]["b"]}           # [8, F] instead of [D, F]
    rt = InGraphRuntime(layer, bad)
    with pytest.raises(TypeError, match=r"stage 3: stage_fn\(stage_params\[3\], h\) failed while tracing, with h "
                                        r"of shape \(8, 16\) dtype float32 and stage_params\[3\] of .*float32\[8, 32\]"):
        rt.forward(x)
    assert rt.copy_start_count() == 0                                    # nothing compiled
    with pytest.raises(RuntimeError, match="nothing is compiled yet"):
        rt.memory_report()
    two = InGraphRuntime([layer, lambda p, h: h @ p["b"]], params[:2])
    with pytest.raises(TypeError, match=r"stage 1: stage_fn\[1\]\(stage_params\[1\], h\)"):
        two.forward(x)

    rt = InGraphRuntime(layer, params)
    dead = jnp.asarray(x)
    dead.delete()
    with pytest.raises(ValueError, match="h: the jax array has been deleted"):
        rt.forward(dead)
    gone = jnp.asarray(params[0]["a"])
    gone.delete()
    with pytest.raises(ValueError, match=r"stage_params\[0\]\['a'\]: the jax array has been deleted"):
        InGraphRuntime(layer, [{"a": gone, "b": params[0]["b"]}] + list(params[1:]))
    check_close(rt.forward(x), mono_forward(stacked(params), x))   # still usable
    rt.host_params[5]["b"].delete()
    with pytest.raises(ValueError, match=r"host_params\[5\]\['b'\]: the pinned_host weight array has been deleted"):
        rt.forward(x)
