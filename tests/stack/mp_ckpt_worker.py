"""Worker of tests/stack/test_multiprocess_checkpoint.py: one process of a run on CPU, 1 or
several processes (``jax.distributed``, gloo collectives).

``python mp_ckpt_worker.py PROCESS_ID NUM_PROCESSES JAX_PORT TORCH_PORT DEVICES_PER_PROCESS OUT_JSON SAVE LOAD``

``SAVE`` (a folder, or ``-``): a ``SwappedStack`` of torch layers (FSDP-sharded over all processes'
devices) trains 2 ``torch.optim.AdamW`` steps and saves a checkpoint there. With several processes
it first calls ``save_checkpoint`` before ``torch.distributed`` is initialized (the error is
recorded, with whether the folder was created), then initializes it (gloo) and saves. Then a 3rd
step. ``LOAD`` (a folder, or ``-``): a stack over other weights loads that checkpoint (without
``torch.distributed``) and takes the same 3rd step. Process 0 writes, as JSON, the gathered weights,
moments and step at each point, and the 3rd step's loss.
"""
import json
import os
import sys

from mp_common import D, block_class, gather, start_jax

pid, nproc, port, tport, ndev = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
out_path, save_dir, load_dir = sys.argv[6], sys.argv[7], sys.argv[8]
jax = start_jax(pid, nproc, port, ndev)

import torch  # noqa: E402

from xla_swap.stack import SwappedStack  # noqa: E402

Block = block_class()


def make_stack(seed):
    torch.manual_seed(seed)
    blocks = [Block() for _ in range(3)]
    opt = torch.optim.AdamW([p for b in blocks for p in b.parameters()], lr=1e-2, weight_decay=0.1)
    return SwappedStack(blocks, optimizer=opt, loss_fn=lambda o, t: ((o - t) ** 2).mean())


def state(stack):
    """The whole training state, gathered from every process (a collective: all processes call it):
    ``{"stage.name": weight, "stage.leaf.m" / ".v": moment, "step": step}``."""
    rt, out = stack.runtime, {"step": stack.runtime.step}
    for i, p in enumerate(rt.host_params):
        out.update({f"{i}.{n}": gather(a).tolist() for n, a in p.items()})
        for j, mv in enumerate(rt.optimizer_state[i]):
            out.update({f"{i}.{j}.{k}": gather(a).tolist() for k, a in zip("mv", mv)})
    return out


torch.manual_seed(1)
data = [(torch.randn(8, D), torch.randn(8, D)) for _ in range(3)]
result = {}
if save_dir != "-":
    stack = make_stack(0)
    for x, t in data[:2]:
        stack.train_step(x, t)
    if nproc > 1:
        try:
            stack.save_checkpoint(save_dir)
        except RuntimeError as e:
            result["no_dist_error"] = str(e)
        result["no_dist_wrote"] = os.path.exists(save_dir)
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tport}", rank=pid,
                                             world_size=nproc)
    result["saved"] = state(stack)
    stack.save_checkpoint(save_dir, extra={"scheduler": {"last_epoch": 2}})
    loss = float(stack.train_step(*data[2]))
    result["step3"] = {"loss": loss, **state(stack)}
if load_dir != "-":
    stack = make_stack(5)
    result["fresh"] = state(stack)
    result["extra"] = stack.load_checkpoint(load_dir)
    result["loaded"] = state(stack)
    loss = float(stack.train_step(*data[2]))
    result["loaded_step3"] = {"loss": loss, **state(stack)}
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()

if pid == 0:
    with open(out_path, "w") as f:
        json.dump(result, f)
print("OK", pid, flush=True)
