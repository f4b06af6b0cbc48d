"""A training step whose stacked layer weights live in host memory (the README's policy example).

Run: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python examples/policy_example.py
"""
import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from xla_swap.lowering import emit_annotations, lower_fn, offload_name, scan
from xla_swap.planning import OffloadPolicy

xr.use_spmd()
n = xr.global_runtime_device_count()
mesh = xs.Mesh(np.arange(n), (n,), ("model",))
dev = torch_xla.device()

L, D = 4, 64
w_in = (torch.randn(L, D, 4 * D) * 0.05).to(dev).requires_grad_(True)    # stacked per-layer weights
w_out = (torch.randn(L, 4 * D, D) * 0.05).to(dev).requires_grad_(True)
xs.mark_sharding(w_in, mesh, (None, None, "model"))                        # never shard the layer dim
xs.mark_sharding(w_out, mesh, (None, "model", None))


def layer(h, w):
    a = offload_name(torch.nn.functional.gelu(h @ w["in"]), "ffn_act")     # a named activation
    return h + a @ w["out"], None


policy = OffloadPolicy(
    params="host",                       # stacked weights in pinned_host; one layer slice moved per iteration
    grads="host",                        # each layer's gradient slice goes back to the host
    activations={"ffn_act": "host"},     # saved for backward in host memory
    remat=True,                          # everything untagged is recomputed in the backward
)

x = torch.randn(8, D).to(dev)
h, _ = scan(layer, x, {"in": w_in, "out": w_out}, policy=policy)
h.pow(2).mean().backward()
torch_xla.sync()
print("loss grads:", w_in.grad.shape, w_out.grad.shape)


# The same step lowered with the annotations, for the PJRT executor (real pinned_host memory):
def step(x, w_in, w_out):
    w_in, w_out = w_in.detach().requires_grad_(True), w_out.detach().requires_grad_(True)
    with torch.enable_grad():
        h, _ = scan(layer, x, {"in": w_in, "out": w_out}, policy=policy)
        return torch.autograd.grad(h.pow(2).mean(), [w_in, w_out])


with emit_annotations(True):
    lowered = lower_fn(step, x, w_in.detach(), w_out.detach())
print(lowered.hlo_text.count('_xla_buffer_placement="device"'), "to-device and",
      lowered.hlo_text.count('_xla_buffer_placement="pinned_host"'), "to-host annotations")
