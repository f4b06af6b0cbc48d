"""``xla_swap._compat.torch_xla``: one test per wrapper of a private torch_xla / torch API, each calling it for real.

Nothing here is mocked: a wrapper whose upstream API moved (a torch_xla or torch upgrade)
fails here first, with the API's name.
"""
import inspect

import pytest
import torch
import torch_xla

from xla_util import DEV, N, mesh_2d, to_xla
from xla_swap._compat import MissingUpstreamAPI
from xla_swap._compat import torch_xla as ctx


def _device_data(t: torch.Tensor) -> torch.Tensor:
    x = to_xla(t)
    torch_xla.sync()
    return x


# -- torch_xla._XLAC ------------------------------------------------------------------------
def test_needs_materialization_tells_device_data_from_pending():
    x = _device_data(torch.randn(4, 8))
    pending = x * 2
    assert ctx.needs_materialization([x, pending]) == [False, True]


def test_tensor_handles_identify_the_device_buffer():
    x, y = _device_data(torch.randn(4, 8)), _device_data(torch.randn(4, 8))
    hx, hd, hy = ctx.tensor_handles([x, x.detach(), y])
    assert isinstance(hx, int) and hx == hd and hx != hy


def test_sharding_spec_of_sharded_and_plain_tensors():
    plain = _device_data(torch.randn(4, 8))
    assert ctx.sharding_spec(plain) == ""
    sharded = to_xla(torch.randn(8, 8), mesh_2d(), ("x", None))
    torch_xla.sync()
    spec = ctx.sharding_spec(sharded)
    assert isinstance(spec, str)
    if N > 1:
        assert spec.startswith(f"{{devices=[{mesh_2d().mesh_shape[0]},1")


def test_sync_tensors_materializes_only_what_it_is_given():
    x = _device_data(torch.arange(8.0))
    a, b = x * 3, x + 1
    ctx.sync_tensors([a])
    assert ctx.needs_materialization([a, b]) == [False, True]
    torch.testing.assert_close(a.cpu(), torch.arange(8.0) * 3)


def test_lower_graph_maps_parameters_to_device_data():
    w = _device_data(torch.randn(8, 4))
    x, unused = _device_data(torch.randn(2, 8)), _device_data(torch.randn(3))
    graph = ctx.lower_graph("compat_lower", [torch.tanh(x @ w)], [x, unused])
    assert isinstance(graph.hlo_proto, bytes) and graph.hlo_proto
    x_id, unused_id = graph.input_parameter_ids
    assert x_id >= 0 and unused_id == -1
    by_handle = {ctx.tensor_handles([t])[0]: pid for pid, t in graph.device_parameters.items()}
    assert by_handle[ctx.tensor_handles([x])[0]] == x_id
    assert ctx.tensor_handles([w])[0] in by_handle           # captured: the same device buffer
    assert all(t.device.type == "xla" for t in graph.device_parameters.values())


# -- torch_xla.core.xla_builder, _xla_user_computation ----------------------------------------
def _double_graph():
    """``x -> x + x`` lowered (no scalar constant, so ``x`` is the one parameter)."""
    x = _device_data(torch.randn(4, 8))
    graph = ctx.lower_graph("compat_double", [x + x], [x])
    assert len(graph.device_parameters) == 1
    return graph


def test_computation_from_hlo_proto_builds_a_runnable_computation():
    comp = ctx.computation_from_hlo_proto("compat_double", _double_graph().hlo_proto)
    x_cpu = torch.randn(4, 8)
    (out,) = ctx.user_computation("xla_swap::compat_double", [to_xla(x_cpu)], comp)
    torch.testing.assert_close(out.cpu(), 2 * x_cpu)


def test_computation_hlo_text_prints_the_module():
    text = ctx.computation_hlo_text(ctx.computation_from_hlo_proto("compat_double", _double_graph().hlo_proto))
    assert "ENTRY" in text and "parameter(0)" in text and "add(" in text


def test_user_computation_runs_lazily_on_new_inputs():
    comp = ctx.computation_from_hlo_proto("compat_double", _double_graph().hlo_proto)
    x_cpu = torch.randn(4, 8)
    outs = ctx.user_computation("xla_swap::compat_double", [_device_data(x_cpu)], comp)
    assert len(outs) == 1 and ctx.needs_materialization(outs) == [True]    # a lazy IR node
    torch.testing.assert_close(outs[0].cpu(), 2 * x_cpu)


# -- torch_xla.experimental.scan_layers helpers ---------------------------------------------
class _Scaled(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, h):
        return self.lin(h) * self.scale


def test_layer_weights_and_buffers_splits_by_kind():
    params, buffers = ctx.layer_weights_and_buffers(_Scaled(4))
    assert sorted(params) == ["lin.bias", "lin.weight"] and sorted(buffers) == ["scale"]


def test_ensure_same_structure_names_a_mismatch():
    a, b, c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 5)
    ctx.ensure_same_structure([dict(a.named_parameters()), dict(b.named_parameters())])
    with pytest.raises(ValueError, match="layer 1"):
        ctx.ensure_same_structure([dict(a.named_parameters()), dict(c.named_parameters())])


def test_one_layer_fn_runs_a_layer_with_given_weights():
    template, other = _Scaled(4), _Scaled(4)
    fn = ctx.one_layer_fn(template)
    h = torch.randn(2, 4)
    out, extra = fn(h, ctx.layer_weights_and_buffers(other))
    assert extra is None
    torch.testing.assert_close(out, other(h))           # the weights passed in, not the template's


# -- torch internals ------------------------------------------------------------------------
def test_default_partition_fn_is_torch_xla_scans_default():
    from torch_xla.experimental.scan import scan
    assert inspect.signature(scan).parameters["partition_fn"].default is ctx.default_partition_fn()


def test_extract_fwd_bwd_modules_splits_a_joint_graph():
    from functorch.compile import aot_function, make_boxed_func

    def partition(joint_module, joint_inputs, *, num_fwd_outputs, **kwargs):
        primals = [n for n in joint_module.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
        fwd, bwd = ctx.extract_fwd_bwd_modules(joint_module, primals, num_fwd_outputs=num_fwd_outputs)
        seen.append((fwd, bwd))
        return fwd, bwd

    seen = []
    f = aot_function(lambda x, w: torch.tanh(x @ w).sum(), fw_compiler=lambda gm, _: make_boxed_func(gm),
                     bw_compiler=lambda gm, _: make_boxed_func(gm),
                     partition_fn=partition)
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    f(x, w).backward()
    assert len(seen) == 1 and all(isinstance(m, torch.fx.GraphModule) for m in seen[0])
    x2, w2 = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    torch.tanh(x2 @ w2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_tree_flatten_and_unflatten_round_trip():
    tree = {"a": torch.ones(1), "b": (torch.zeros(2), [torch.ones(3)])}
    leaves, spec = ctx.tree_flatten(tree)
    assert [t.shape[0] for t in leaves] == [1, 2, 3]
    back = ctx.tree_unflatten([t + 1 for t in leaves], spec)
    assert set(back) == {"a", "b"} and isinstance(back["b"], tuple) and isinstance(back["b"][1], list)
    torch.testing.assert_close(back["b"][1][0], torch.full((3,), 2.0))


def test_tree_unflatten_rebuilds_the_structure():
    _, spec = ctx.tree_flatten((torch.ones(1), {"k": torch.ones(1)}))
    a, b = torch.zeros(1), torch.ones(1)
    out = ctx.tree_unflatten([a, b], spec)
    assert out[0] is a and out[1]["k"] is b


def test_tree_map_over_several_trees():
    out = ctx.tree_map(lambda a, b: a + b, {"x": torch.ones(2)}, {"x": torch.full((2,), 3.0)})
    torch.testing.assert_close(out["x"], torch.full((2,), 4.0))


def test_a_missing_api_names_itself_and_the_versions():
    with pytest.raises(MissingUpstreamAPI, match=r"torch_xla\._XLAC\._no_such_binding") as e:
        ctx._lookup("torch_xla", "_XLAC._no_such_binding")
    assert torch_xla.__version__ in str(e.value) and ctx.VERIFIED in str(e.value)
    assert DEV.type == "xla"
