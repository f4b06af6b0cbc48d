"""Annotated SPMD scan modules (torch_xla-lowered) run through the PJRT executor.

The executor is built from the same ``OffloadPolicy`` the scan was lowered with
(``PjrtExecutor.from_policy``): the stacked weights are placed in pinned_host and, with
``grads="host"``, their gradient results are written to pinned_host. Values and gradients
must equal CPU torch, and the compiled memory report must show the weights (and gradients)
on the host and the device argument bytes reduced by exactly the weights' per-device size.
"""
import numpy as np
import pytest
import torch

from scan_cases import POLICIES, loop_reference, lower_train_step, make_weights
from xla_util import N
from xla_swap.executors.pjrt import PjrtExecutor
from xla_swap.planning import OffloadPolicy

GRAD_RESULTS = (2, 3)    # lower_train_step's outputs: out, grad h, grad a, grad b


def run_with_executor(lowered, policy, weight_ids):
    exe = PjrtExecutor.from_policy(lowered, policy, weights=weight_ids, grad_results=GRAD_RESULTS)
    values = [p.tensor.detach().cpu().numpy() for p in lowered.parameters]
    outs = exe(*exe.put_all(values))
    return exe, outs, [torch.from_numpy(np.asarray(o)) for o in outs]


@pytest.mark.spmd
@pytest.mark.parametrize("policy", [POLICIES[2], POLICIES[3], POLICIES[5]], ids=str)
def test_swapping_scan_runs_on_pjrt_with_host_weights(policy):
    cpu, W = make_weights(3, 16, 11, two_d=True)
    lowered = lower_train_step(policy, W)
    w_ids = {lowered.parameter_id(W["a"]), lowered.parameter_id(W["b"])}
    x_param = lowered.input_parameters[0]
    h0 = x_param.tensor.detach().cpu()

    exe, results, (out, g_h, g_a, g_b) = run_with_executor(lowered, policy, w_ids)
    # every parameter keeps torch_xla's sharding string; the gradients go where the policy says
    assert all(exe.parameters[p.id].hlo_sharding == p.sharding for p in lowered.parameters)
    grad_kind = "pinned_host" if policy.grads == "host" else "device"
    assert [results[i].sharding.memory_kind for i in range(4)] == ["device", "device", grad_kind, grad_kind]

    # Reference: the Python loop on CPU torch with the same loss ((out**2).sum() + ys.sum()).
    h = h0.clone().requires_grad_(True)
    w = {k: v.clone().requires_grad_(True) for k, v in cpu.items()}
    ref_out, ys = loop_reference(h, w)
    ref = torch.autograd.grad((ref_out ** 2).sum() + ys.sum(), [h, w["a"], w["b"]])
    torch.testing.assert_close(out, ref_out.detach(), rtol=1e-5, atol=1e-5)
    for name, got, want in zip(["grad h", "grad a", "grad b"], [g_h, g_a, g_b], ref):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")

    report = exe.memory_report()
    for i in w_ids:
        assert report.parameter_memory_spaces[i] == "pinned_host"
    assert all(report.parameter_memory_spaces[p.id] == "device" for p in lowered.parameters if p.id not in w_ids)
    assert report.output_memory_spaces == ("device", "device", grad_kind, grad_kind)
    if policy.grads == "host":
        assert report.host_output_bytes == weight_shard_bytes(lowered, w_ids)
    # Same module, everything on the device: the device argument bytes grow by the weights' shards.
    exe_dev, _, _ = run_with_executor(lowered, OffloadPolicy(), w_ids)
    dev_report = exe_dev.memory_report()
    assert dev_report.output_memory_spaces == ("device",) * 4
    shard_bytes = weight_shard_bytes(lowered, w_ids)
    assert sum(report.parameter_bytes[i] for i in w_ids) == shard_bytes
    assert dev_report.device_argument_bytes - report.device_argument_bytes == shard_bytes
    assert report.host_argument_bytes == shard_bytes


def weight_shard_bytes(lowered, w_ids) -> int:
    """Per-device bytes of the stacked weights (sharded over all N devices)."""
    return sum(lowered.parameters[i].nbytes for i in w_ids) // N
