"""Worker of tests/stack/test_multiprocess.py: one process of a ``jax.distributed`` run on CPU.

``python tests/stack/mp_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS OUT_JSON``

Runs, over all processes' devices as one mesh: ``StreamingRuntime`` (weights sharded FSDP-style,
forward and a training step) and ``SwappedStack`` (torch ``nn.Module`` layers, 4 AdamW steps).
Asserts that each process's pinned_host buffers hold only its own devices' shards, and writes the
gathered results (process 0) as JSON for the test to compare with the single-process run.
"""
import json
import sys

from mp_common import D, F, block_class, gather, start_jax

pid, nproc, port, ndev, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
jax = start_jax(pid, nproc, port, ndev)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from xla_swap.executors import Placement, RuntimeConfig, StreamingRuntime  # noqa: E402
from xla_swap.planning import AdamW  # noqa: E402
from xla_swap.stack import SwappedStack  # noqa: E402

devices = jax.devices()
mesh = Mesh(np.array(devices), ("d",))
local = set(jax.local_devices())


def only_local_shards(tree):
    for a in jax.tree_util.tree_leaves(tree):
        assert a.sharding.memory_kind == "pinned_host", a.sharding
        assert {s.device for s in a.addressable_shards} <= local
        assert len(a.addressable_shards) == ndev  # this process pins exactly its own devices' shards


# --- StreamingRuntime, FSDP-style: each weight split over every device of every process ---
rng = np.random.default_rng(0)
params = [{"a": rng.standard_normal((D, F)).astype(np.float32) * 0.3,
           "b": rng.standard_normal((F, D)).astype(np.float32) * 0.3} for _ in range(3)]


def layer(p, h):
    return h + jnp.tanh(h @ p["a"]) @ p["b"]


def sharding(i, path, leaf):
    return NamedSharding(mesh, P(None, "d") if "a" in jax.tree_util.keystr(path) else P("d", None))


rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2, track_residency=False),
                      placement=Placement(sharding=sharding, activation_sharding=NamedSharding(mesh, P())))
for p in rt.host_params:
    only_local_shards(p)
x = rng.standard_normal((4, D)).astype(np.float32)
y = rt.forward(x)
loss, gx, grads = rt.train_step(x, lambda o: jnp.sum(o ** 2))
result = {"y": gather(y).tolist(), "loss": float(gather(loss)), "gx": gather(gx).tolist(),
          "grads": [{k: gather(v).tolist() for k, v in g.items()} for g in grads]}
for g in grads:
    only_local_shards(g)

# --- SwappedStack: torch layers, AdamW, weights and moments sharded over all processes ---
torch.manual_seed(0)


Block = block_class()


blocks = [Block() for _ in range(3)]
stack = SwappedStack(blocks, optimizer=AdamW(lr=1e-2), loss_fn=lambda o, t: ((o - t) ** 2).mean())
only_local_shards(stack.runtime.host_params[1]["up.weight"])
only_local_shards(stack.runtime.optimizer_state[1])
xt, tt = torch.randn(6, D), torch.randn(6, D)
losses = [float(stack.train_step(xt, tt)) for _ in range(4)]
stack.sync_modules()
result["stack_losses"] = losses
result["stack_params"] = [{n: p.detach().numpy().tolist() for n, p in b.named_parameters()} for b in blocks]

# --- transfers.put: memory-kind moves of arrays that span processes, shard by shard (no program traced, no
# collective), against jax.device_put (which traces a resharding program, or checks a numpy value equal on
# every process, the first time per shape) ---
from xla_swap.executors.transfers import put  # noqa: E402

traced = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: traced.append(event) if event == "/jax/core/compile/jaxpr_trace_duration" else None)
rows = NamedSharding(mesh, P("d", None))
on_host, on_dev = rows.with_memory_kind("pinned_host"), rows.with_memory_kind("device")
w = np.arange(4 * nproc * ndev * 3, dtype=np.float32).reshape(-1, 3)   # a shape nothing has traced
h = put(w, on_host)
d = put(h, on_dev)
back, half = put({"b": d, "c": np.float32(0.5)}, {"b": on_host, "c": NamedSharding(mesh, P())}).values()
n_put = len(traced)
ref = jax.device_put(jax.device_put(w * 2, on_host), on_dev)
result["put"] = {"traced": n_put, "device_put_traced": len(traced) - n_put,
                 "shardings": [a.sharding == s for a, s in ((h, on_host), (d, on_dev), (back, on_host))],
                 "equal": [bool(np.array_equal(gather(a), w)) for a in (h, d, back)] + [float(gather(half)) == 0.5,
                           bool(np.array_equal(gather(ref), w * 2))]}

if pid == 0:
    with open(out_path, "w") as f:
        json.dump(result, f)
print("OK", pid, flush=True)
