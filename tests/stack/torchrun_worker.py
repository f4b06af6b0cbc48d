"""Worker of tests/stack/test_torchrun.py: one rank of a ``torchrun`` job with per-rank batches, or the
single-process reference on the whole batch.

    torchrun --nproc-per-node 2 tests/stack/torchrun_worker.py OUT_DIR   # RANK etc. from torchrun
    python tests/stack/torchrun_worker.py OUT_DIR                          # one process, whole batch

The device count per process comes from ``XLA_FLAGS`` (the test sets it); ``WORKER_CUDA=1`` on GPUs
passes the batches as CUDA tensors on each process's GPU. A small HF ``LlamaForCausalLM``
through ``causal_lm_stages`` and a ``SwappedStack`` with ``torch.optim.AdamW``: forward (a batch that
splits over the devices, and one of a row per rank, which runs replicated), 3 training steps, the AdamW
moments, ``sync_modules``, greedy ``generate`` (same prompt lengths, and a shorter prompt on the last
rank). Each rank passes its own rows of one global batch and writes what it got back to
``OUT_DIR/rank{r}.json``. Asserted here: each process pins only its own devices' shards of the split
weights and moments; the forward of a row per rank warns that it runs replicated; ranks passing other
shapes, a token id out of range on rank 0 (IndexError there), and a stack built from weights that differ
on the last rank, raise on every rank; building places each process's own slices without gathering any
whole array from every process.
"""
import faulthandler
import json
import os
import sys
import warnings

faulthandler.dump_traceback_later(float(os.environ.get("WORKER_HANG_S", "240")), exit=True)   # a hang: stacks, fail

per_rank = "RANK" in os.environ
if per_rank:
    import xla_swap.distributed as xd
    xd.initialize()

import jax  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from xla_swap.hf import causal_lm_stages  # noqa: E402
from xla_swap.stack import SwappedStack  # noqa: E402
from xla_swap.stack.torch_bridge import to_torch  # noqa: E402

r, n = (xd.rank(), xd.world_size()) if per_rank else (0, 1)
# WORKER_CUDA=1 (on GPUs): the batches as CUDA tensors on this process's GPU
dev = torch.device("cuda", xd.local_rank() if per_rank else 0) if os.environ.get("WORKER_CUDA") else None
assert dev is not None or len(jax.devices()) == 4, jax.devices()
if per_rank:
    assert xd.per_rank_batches() and jax.process_index() == r and jax.process_count() == n
    assert torch.distributed.is_initialized() and torch.distributed.get_rank() == r
    xd.initialize()   # a second call with the same settings does nothing


def mine(t):
    """This rank's rows of a global batch (the whole batch in the single-process run)."""
    k = t.shape[0] // n
    return t[r * k:(r + 1) * k].to(dev or "cpu")


def ce(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


V = 96
cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).float().eval()
first, layers, last = causal_lm_stages(model)
from jax.experimental import multihost_utils  # noqa: E402
whole_array_checks, assert_equal = [], multihost_utils.assert_equal
multihost_utils.assert_equal = lambda *a, **k: (whole_array_checks.append(1), assert_equal(*a, **k))[1]
stack = SwappedStack(layers, first=first, last=last, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                     loss_fn=ce)
multihost_utils.assert_equal = assert_equal
# each process placed its own slices of the weights: no array was gathered whole from every process to check it
assert not whole_array_checks, len(whole_array_checks)
split = [a for tree in (stack.runtime.host_params, stack.runtime.optimizer_state)
         for a in jax.tree_util.tree_leaves(tree) if not a.sharding.is_fully_replicated]
assert len(split) > 10 and all(a.sharding.memory_kind == "pinned_host" for a in split)
# each process pins only its own devices' shards: its share of every split weight and moment
assert all(sum(s.data.size for s in a.addressable_shards) * len(jax.devices()) == a.size * len(jax.local_devices())
           for a in split)
ids = torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(0))   # the global batch
x, y = ids[:, :-1], ids[:, 1:]

res = {"forward": stack(mine(x)).tolist()}
if 2 % n == 0 and len(jax.devices()) == 4:   # a row per rank (2 x 2 devices): splits over no process's devices
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res["forward_replicated"] = stack(mine(x[:2])).tolist()
    assert any("replicated" in str(w.message) for w in caught), [str(w.message) for w in caught]
res["losses"] = [float(stack.train_step(mine(x), mine(y))) for _ in range(3)]
res["moments"] = {f"{i}{path}": [to_torch(m).tolist(), to_torch(v).tolist()]
                  for i, state in enumerate(stack.runtime.optimizer_state)
                  for path, (m, v) in zip(stack.runtime.trainable_paths(i), state)}
stack.sync_modules()
res["weights"] = {k: p.detach().tolist() for k, p in model.named_parameters()}
gen = dict(max_new_tokens=4, eos_token_id=None, pad_token_id=0)
res["generate"] = stack.generate(mine(x[:, :5]), **gen).tolist()
# the last rank's prompts one token shorter: the global batch left-pads them (mask 0), as the reference does
if per_rank:
    short = mine(x[:, :5])[:, 1:] if r == n - 1 else mine(x[:, :5])
    res[f"generate_short_{n}"] = stack.generate(short, **gen)[:, -4:].tolist()
else:
    for k in (2, 4):   # the last of k ranks holds the last 4 // k rows
        mask = torch.ones(4, 5, dtype=torch.int64)
        mask[4 - 4 // k:, 0] = 0
        res[f"generate_short_{k}"] = stack.generate(x[:, :5] * mask, mask, **gen)[:, -4:].tolist()

if per_rank:   # refusals raise on every rank (none is left waiting in a collective)
    other_length = mine(x) if r == 0 else mine(x)[:, :4]
    try:
        stack(other_length)
        raise AssertionError("ranks of other shapes ran")
    except ValueError as e:
        assert "same shapes" in str(e), e
    out_of_range = mine(x).clone()
    out_of_range[0, 0] = V if r == 0 else 0
    try:
        stack.train_step(out_of_range, mine(y))
        raise AssertionError("a token id out of range ran")
    except (IndexError if r == 0 else ValueError) as e:
        assert ("input_ids" if r == 0 else "rank(s) [0] refused") in str(e), e
    # ranks that read other weights are refused at construction, on every rank, the tensor named
    other = LlamaForCausalLM(cfg).float().eval()
    other.load_state_dict(model.state_dict())
    if r == n - 1:
        with torch.no_grad():
            other.model.layers[1].mlp.up_proj.weight.add_(1.0)
    f2, l2, t2 = causal_lm_stages(other)
    try:
        SwappedStack(l2, first=f2, last=t2, optimizer=torch.optim.AdamW(other.parameters()), loss_fn=ce)
        raise AssertionError("ranks holding other weights built a stack")
    except ValueError as e:
        assert f"rank(s) [{n - 1}]" in str(e) and "layers[1].mlp.up_proj.weight" in str(e), e
    res["refusals"] = "checked"

with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w") as f:
    json.dump(res, f)
print("OK", r, flush=True)
