"""Lowering: device-backed, sharded parameter table; execution; host-transfer guard; bad input."""
import pytest
import torch
import torch_xla

from xla_util import DEV, N, mesh_2d, to_xla
from xla_swap.lowering.computation import (HostTransferError, data_handle, host_transfer_guard, lower, lower_fn,
                                           sharding_spec)


def make_model(seed=0):
    """A 2-layer MLP with a 1D-sharded, a 2D-sharded and a replicated parameter (CPU + XLA copies)."""
    g = torch.Generator().manual_seed(seed)
    cpu = {"w1": torch.randn(16, 32, generator=g), "w2": torch.randn(32, 16, generator=g),
           "b": torch.randn(32, generator=g)}
    mesh = mesh_2d()
    xla = {"w1": to_xla(cpu["w1"], mesh, ("x", None)),      # 1D-sharded
           "w2": to_xla(cpu["w2"], mesh, ("x", "y")),       # 2D-sharded
           "b": to_xla(cpu["b"])}                            # replicated
    torch_xla.sync()
    return cpu, xla


def mlp(p, x):
    return torch.tanh(x @ p["w1"] + p["b"]) @ p["w2"] * 0.5


@pytest.mark.spmd
def test_table_is_device_backed_and_keeps_shardings():
    cpu, p = make_model()
    x = to_xla(torch.randn(8, 16))
    torch_xla.sync()
    with host_transfer_guard() as seen:
        lowered = lower_fn(lambda x: mlp(p, x), x)
    assert seen == {"TransferFromDeviceTime": 0, "ReplicateShardedData": 0}
    by_id = {p_.id: p_ for p_ in lowered.parameters}
    assert sorted(by_id) == list(range(len(lowered.parameters)))
    for name, src in p.items():
        entry = by_id[lowered.parameter_id(src)]
        assert entry.kind == "captured"
        assert data_handle(entry.tensor) == data_handle(src), name      # same device buffer
        assert entry.sharding == sharding_spec(src), name
        assert entry.tensor.device.type == "xla"
        assert entry.shape == tuple(src.shape) and entry.nbytes == src.numel() * 4
    assert by_id[lowered.parameter_id(x)].kind == "input"
    if N > 1:  # 1D: tiled on dim 0 only; 2D: tiled on both dims
        rows, cols = mesh_2d().mesh_shape
        assert by_id[lowered.parameter_id(p["w1"])].sharding.startswith(f"{{devices=[{rows},1")
        assert by_id[lowered.parameter_id(p["w2"])].sharding.startswith(f"{{devices=[{rows},{cols}]")
    # every parameter of the HLO text appears in the table
    assert lowered.hlo_text.count("parameter(") == len(lowered.parameters)


@pytest.mark.spmd
def test_old_host_mapping_does_transfer():
    """The contrast: torch_xla's parameter_id_tensor_mapping() copies parameters to the host."""
    _, p = make_model()
    x = to_xla(torch.randn(8, 16))
    torch_xla.sync()
    out = mlp(p, x)
    ctx = torch_xla._XLAC.lowering.LoweringContext("old_mapping")
    ctx.build([out])
    with host_transfer_guard(raise_on_transfer=False) as seen:
        ctx.parameter_id_tensor_mapping()
    assert seen["TransferFromDeviceTime"] > 0
    if N > 1:
        assert seen["ReplicateShardedData"] > 0
    with pytest.raises(HostTransferError, match="TransferFromDeviceTime"):
        with host_transfer_guard():
            ctx.parameter_id_tensor_mapping()


@pytest.mark.spmd
def test_execute_matches_eager_and_cpu_values_and_grads():
    cpu, p = make_model(1)
    lowered = lower_fn(lambda x: mlp(p, x), to_xla(torch.randn(8, 16)))
    x_cpu = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))
    x = to_xla(x_cpu).requires_grad_(True)
    out = lowered(x)[0]
    eager = mlp(p, x)
    x_ref = x_cpu.clone().requires_grad_(True)
    ref = mlp(cpu, x_ref)
    torch.testing.assert_close(out.cpu(), eager.cpu(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-6)
    gy = torch.randn_like(ref)
    g, = torch.autograd.grad(out, x, gy.to(DEV))
    g_eager, = torch.autograd.grad(eager, x, gy.to(DEV))
    g_ref, = torch.autograd.grad(ref, x_ref, gy)
    torch.testing.assert_close(g.cpu(), g_eager.cpu(), rtol=1e-6, atol=1e-6)
    # Against CPU torch the backward's sharded contractions sum in another order: ~4e-6 absolute.
    torch.testing.assert_close(g.cpu(), g_ref, rtol=1e-5, atol=1e-5)


def test_lower_from_tensors_then_execute_on_new_inputs():
    cpu, p = make_model(2)
    x = to_xla(torch.randn(8, 16))
    torch_xla.sync()
    lowered = lower([mlp(p, x)], [x])
    x2 = torch.randn(8, 16)
    torch.testing.assert_close(lowered(to_xla(x2))[0].cpu(), mlp(cpu, x2), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="forward-only"):
        lowered(to_xla(x2).requires_grad_(True))


def test_bad_input_is_named_and_process_stays_usable():
    cpu, p = make_model(3)
    x = to_xla(torch.randn(8, 16))
    with pytest.raises(ValueError, match="outputs: expected at least one"):
        lower([])
    with pytest.raises(TypeError, match=r"outputs\[0\].*XLA device.*cpu"):
        lower([torch.randn(3)])
    with pytest.raises(TypeError, match=r"example_inputs\[0\]"):
        lower_fn(lambda t: t * 2, torch.randn(3))
    unrelated = to_xla(torch.randn(5))
    torch_xla.sync()
    with pytest.raises(ValueError, match=r"inputs\[1\].*not read"):
        lower([mlp(p, x)], [x, unrelated])
    lowered = lower_fn(lambda x: mlp(p, x), x)
    with pytest.raises(ValueError, match="tensor: .*not part of the lowering"):
        lowered.parameter_id(unrelated)
    with pytest.raises(ValueError, match=r"inputs\[0\]: expected shape \[8, 16\], got \[4, 16\]"):
        lowered(to_xla(torch.randn(4, 16)))
    with pytest.raises(TypeError, match=r"inputs\[0\]: expected dtype torch.float32"):
        lowered(to_xla(torch.randn(8, 16, dtype=torch.float64)))
    with pytest.raises(TypeError, match=r"inputs\[0\]: expected a tensor on an XLA device"):
        lowered(torch.randn(8, 16))
    with pytest.raises(ValueError, match="inputs: expected 1 tensors, got 2"):
        lowered(x, x)
    # A following valid lowering in the same process still works.
    x2 = torch.randn(8, 16)
    again = lower_fn(lambda x: mlp(p, x), to_xla(x2))
    torch.testing.assert_close(again(to_xla(x2))[0].cpu(), mlp(cpu, x2), rtol=1e-6, atol=1e-6)
