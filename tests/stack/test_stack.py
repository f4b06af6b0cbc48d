"""The torch entry point ``xla_swap.stack.swapped_stack.SwappedStack`` against plain torch.

A ``transformers`` Llama decoder (random init from a config) trained 20 steps through the
entry point (weights, gradients and AdamW state in ``pinned_host``, layers streamed) must
equal plain torch training with ``torch.optim.AdamW``; serving with several shapes must
equal the model's logits; without an optimizer the modules' ``.grad`` must equal torch's.
Runs on 1, 4 and 8 virtual CPU devices (weights FSDP-sharded over them).
"""
import copy
import dataclasses
import re

import jax
import numpy as np
import pytest
import torch

from llama_cases import V, ce, make_model, rel
from xla_swap.planning import AdamW, OffloadPolicy
from xla_swap.stack import SwappedStack, causal_lm_stages
from xla_swap.stack.config import AutotuneConfig, CompileConfig, ParallelConfig, TrainingConfig

pytestmark = pytest.mark.spmd


def batches(steps, b=2, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, V, (b, t + 1), generator=g)
        yield ids[:, :-1], ids[:, 1:]


def test_llama_20_steps_equal_torch_adamw(num_devices):
    ref = make_model(layers=4)
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce,
                         optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05))
    assert stack.runtime.num_stages == 6 and len(jax.devices()) == num_devices
    for x, y in batches(20):
        loss = stack.train_step(x, y)
        ref_loss = ce(ref(x).logits, y)
        opt_ref.zero_grad()
        ref_loss.backward()
        opt_ref.step()
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert stack.runtime.step == 20
    stack.sync_modules()
    worst = max(rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters()))
    assert worst <= 1e-4, worst
    # weights, optimizer state (and, streamed, nothing else) live in pinned_host
    rt = stack.runtime
    kinds = {a.sharding.memory_kind for tree in rt.host_params + rt.optimizer_state
             for a in jax.tree_util.tree_leaves(tree)}
    assert kinds == {"pinned_host"}
    if num_devices > 1:  # FSDP-style: each 2-D weight split over all devices, each shard in its own host memory
        # (held [in, out] = [32, 64]: transpose_linear; split on the held layout's major dimension)
        w = rt.host_params[1]["mlp.gate_proj.weight"]
        assert w.shape == (32, 64) and "mlp.gate_proj.weight" in stack.transposed[1]
        assert w.sharding.spec == jax.sharding.PartitionSpec("d", None) and len(w.addressable_shards) == num_devices
        assert w.addressable_shards[0].data.shape[0] * num_devices == w.shape[0]


def test_serving_several_shapes():
    model = make_model(layers=3, seed=1)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, compilation=CompileConfig(max_signatures=2))
    with torch.no_grad():
        for b, t in ((2, 16), (1, 9), (3, 16), (2, 16)):
            ids = torch.randint(0, V, (b, t))
            out = stack(ids)
            assert out.shape == (b, t, V)
            torch.testing.assert_close(out, model(ids).logits, rtol=2e-5, atol=2e-5)
    assert stack.runtime.num_signatures == 2


def test_grads_without_optimizer_fill_dot_grad():
    ref = make_model(layers=2, seed=2)
    model = copy.deepcopy(ref)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, compilation=CompileConfig(transpose_linear=False),
                         policy=OffloadPolicy(params="host", grads="host", remat=False, prefetch_depth=1))
    assert stack.transposed == [frozenset()] * 4
    x, y = next(batches(1, seed=3))
    loss = stack.train_step(x, y, loss_fn=ce)
    ref_loss = ce(ref(x).logits, y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, n
        assert rel(p.grad, q.grad) <= 1e-4, n
    # accumulate_grads=False: the gradients stay in pinned_host, one pytree per stage
    kept = SwappedStack(layers, first=first, last=last, training=TrainingConfig(accumulate_grads=False,
                                                                                offload_activations=True),
                        policy=OffloadPolicy(params="host", grads="host", remat=True, prefetch_depth=2))
    kept.train_step(x, y, loss_fn=ce)
    assert kept.runtime.offloaded_activation_nbytes > 0   # layer inputs went through pinned_host
    kinds = {a.sharding.memory_kind for g in kept.last_grads for a in jax.tree_util.tree_leaves(g)}
    assert kinds == {"pinned_host"}
    got = torch.from_numpy(np.asarray(kept.last_grads[1]["mlp.up_proj.weight"])).T  # held [in, out]
    assert rel(got, dict(ref.named_parameters())["model.layers.0.mlp.up_proj.weight"].grad) <= 1e-4


def test_budget_keeps_last_stages_resident():
    model = make_model(layers=4, seed=4)
    first, layers, last = causal_lm_stages(model)
    sizes = [sum(p.numel() * 4 for p in m.parameters()) for m in [first] + layers + [last]]
    opt = AdamW(lr=1e-3)
    # window: 3 largest stages (k=2) of weights + moments; then room for the last stage only
    per = [3 * s for s in sizes]
    budget = sum(sorted(per, reverse=True)[:3]) + per[-1]
    stack = SwappedStack(layers, first=first, last=last, budget_bytes=budget, optimizer=opt, loss_fn=ce,
                         autotune=AutotuneConfig(enabled=False))
    assert stack.runtime.resident == (False,) * 5 + (True,)
    x, y = next(batches(1))
    before = ce(model(x).logits, y)
    assert abs(float(stack.train_step(x, y)) - float(before)) <= 1e-5 * float(before)
    assert stack.runtime.host_params[-1]["lm_head.weight"].sharding.memory_kind == "device"
    with pytest.raises(ValueError, match="below the streaming window"):
        SwappedStack(layers, first=first, last=last, budget_bytes=1024, optimizer=opt)


def test_bad_arguments_are_named():
    model = make_model(layers=2)
    first, layers, last = causal_lm_stages(model)
    with pytest.raises(ValueError, match="layers must be a non-empty"):
        SwappedStack([])
    with pytest.raises(TypeError, match=r"layers\[1\] must be a torch.nn.Module"):
        SwappedStack([layers[0], "x"])
    with pytest.raises(TypeError, match="optimizer must be"):
        SwappedStack(layers, optimizer="adamw")
    with pytest.raises(ValueError, match="amsgrad"):
        SwappedStack(layers, optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True))
    with pytest.raises(ValueError, match="shard must be"):
        SwappedStack(layers, parallel=ParallelConfig(shard="zero3"))
    # each setting group checks its fields where it is written, the stack the group's type
    with pytest.raises(TypeError, match="devices must be a non-empty sequence of jax.Device"):
        ParallelConfig(devices=[])
    with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0"):
        TrainingConfig(max_grad_norm=float("nan"))
    with pytest.raises(TypeError, match="enabled must be a bool"):
        AutotuneConfig(enabled="yes")
    with pytest.raises(ValueError, match="max_signatures must be an int >= 1"):
        CompileConfig(max_signatures=0)
    with pytest.raises(TypeError, match="training must be an xla_swap.TrainingConfig, got dict"):
        SwappedStack(layers, training={"max_grad_norm": 1.0})
    with pytest.raises(TypeError, match="param_dtype"):   # mixed precision has one form: mp_policy
        SwappedStack(layers, param_dtype=torch.bfloat16)
    # a keyword that moved into a group is refused with where it goes now; the group does have that field
    from xla_swap.stack.checks import MOVED_KEYWORDS
    groups = {"parallel": ParallelConfig, "training": TrainingConfig, "autotune": AutotuneConfig,
              "compilation": CompileConfig, "policy": OffloadPolicy}
    for k, where in MOVED_KEYWORDS.items():
        group = groups.get(where.split("=", 1)[0])
        assert group is None or k in {f.name for f in dataclasses.fields(group)}, (k, where)
        with pytest.raises(TypeError, match=re.escape(f"{k}= (now {where})")):
            SwappedStack(layers, **{k: 1})
    with pytest.raises(TypeError, match=re.escape("devices= (now parallel=xla_swap.ParallelConfig(devices=...)); "
                                                  "colour= (unknown)")):
        SwappedStack(layers, devices=jax.devices(), colour="red")
    streamed = SwappedStack(layers, policy=OffloadPolicy(params="host", prefetch_depth=1), budget_bytes=10 ** 12,
                            autotune=AutotuneConfig(enabled=False))   # the budget picks residency, the policy the rest
    assert streamed.runtime.prefetch_depth == 1 and all(streamed.runtime.resident)
    with pytest.raises(ValueError, match="either policy or budget_bytes"):
        SwappedStack(layers, policy=OffloadPolicy(), budget_bytes=10)
    emb = torch.nn.Embedding(V, 32)
    head = torch.nn.Linear(32, V, bias=False)
    head.weight = emb.weight
    assert SwappedStack(layers, first=emb, last=head).tied == {"weight": "weight"}   # tied embeddings: one weight
    with pytest.raises(ValueError, match="shared between stages are supported between first and last only"):
        SwappedStack([layers[0], layers[0]], first=emb, last=head)
    stack = SwappedStack(layers, first=first, last=last)
    with pytest.raises(TypeError, match="needs a loss_fn"):
        stack.train_step(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="inputs must be a torch.Tensor"):
        stack.forward(np.zeros((1, 4), np.int64))
    out = stack(torch.zeros(1, 4, dtype=torch.long))  # still usable
    assert out.shape == (1, 4, V)


def test_tensor_parallel_shard_rule(num_devices):
    """A Megatron-style rule through ``shard=``: column-parallel q/k/v/gate/up, row-parallel o/down."""
    ref = make_model(layers=2, seed=5)
    model = copy.deepcopy(ref)
    first, layers, last = causal_lm_stages(model)

    def tp(name, shape):
        if len(shape) != 2 or not name.startswith(("self_attn", "mlp")):
            return ()
        column = name.split(".")[1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        dim = 0 if column else 1
        return ("d", None) if dim == 0 and shape[0] % num_devices == 0 else \
            (None, "d") if dim == 1 and shape[1] % num_devices == 0 else ()

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    stack = SwappedStack(layers, first=first, last=last, parallel=ParallelConfig(shard=tp), loss_fn=ce,
                         optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    if num_devices > 1:
        # the rule speaks torch's [out, in]; the host holds [in, out] (transpose_linear), so the specs turn
        assert stack.runtime.host_params[1]["mlp.down_proj.weight"].sharding.spec == jax.sharding.PartitionSpec("d", None)
        assert stack.runtime.host_params[1]["self_attn.q_proj.weight"].sharding.spec == jax.sharding.PartitionSpec(None, "d")
    for x, y in batches(3, seed=6):
        loss = stack.train_step(x, y)
        ref_loss = ce(ref(x).logits, y)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
    stack.sync_modules()
    assert max(rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())) <= 1e-4


def test_data_parallel_llama_equals_torch(num_devices):
    """FSDP as torch users know it: weights sharded, the batch split over the devices
    (``data_parallel``, on by default for ``shard="fsdp"``): 5 AdamW steps equal torch, and the
    activations really are batch-sharded (the rotary tables of batch 1 stay replicated)."""
    ref = make_model(layers=2, seed=11)
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce,
                         optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    assert stack.data_parallel == (num_devices > 1)
    assert stack.runtime.batch_axis == ("d" if num_devices > 1 else None)
    for x, y in batches(5, b=8, seed=12):
        loss = stack.train_step(x, y)
        ref_loss = ce(ref(x).logits, y)
        opt_ref.zero_grad()
        ref_loss.backward()
        opt_ref.step()
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    stack.sync_modules()
    assert max(rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())) <= 1e-4
    x = next(batches(1, b=8, seed=13))[0]
    logits = stack.runtime.forward(stack._carry_in((x,)))
    if num_devices > 1:
        assert logits.sharding.spec == jax.sharding.PartitionSpec("d")
        carry = stack.runtime._act(stack.runtime._signature(stack._carry_in((x,))).chain[1])
        assert carry[0].spec == jax.sharding.PartitionSpec("d")                          # h [8, t, D]
        assert carry[1]["attention_mask"] is None      # unpadded, SDPA: the model's own (is_causal, no mask)
        assert carry[1]["position_embeddings"][0].spec == jax.sharding.PartitionSpec()  # cos [1, t, hd]
    with torch.no_grad():
        torch.testing.assert_close(stack(x), model(x).logits, rtol=1e-4, atol=1e-5)
    replicated = SwappedStack(layers, first=first, last=last, parallel=ParallelConfig(data_parallel=False))
    assert replicated.runtime.batch_axis is None


def test_linear_weights_held_in_out_contract_like_matmul():
    """``transpose_linear`` (default): ``nn.Linear`` weights live as ``[in, out]`` and the stage's
    compiled matmuls contract the weight's major dimension (``h @ w``, as a JAX-written layer),
    with no transpose left; ``False`` keeps torch's ``[out, in]`` ("NT"). Both give torch's values."""
    import re

    class FFN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 64, bias=False)
            self.b = torch.nn.Linear(64, 16, bias=False)

        def forward(self, h):
            return h + self.b(torch.nn.functional.gelu(self.a(h)))

    torch.manual_seed(0)
    layers = [FFN(), FFN()]
    h = torch.randn(8, 16)
    dims = {}
    for tl in (True, False):
        stack = SwappedStack(layers, compilation=CompileConfig(transpose_linear=tl),
                             parallel=ParallelConfig(devices=jax.devices()[:1]))
        w = {n: jax.numpy.asarray(jax.device_get(a)) for n, a in stack.runtime.host_params[0].items()}
        assert w["a.weight"].shape == ((16, 64) if tl else (64, 16))
        stage = stack.runtime._fns[0]  # the stage function the runtime compiles
        hlo = jax.jit(lambda w, h: stage(w, (h, {}))[0]).lower(w, jax.numpy.asarray(h.numpy())).compile().as_text()
        dims[tl] = sorted(set(re.findall(r"rhs_contracting_dims=\{(\d)\}", hlo)))
        assert "transpose(" not in hlo
        torch.testing.assert_close(stack(h), layers[1](layers[0](h)), rtol=1e-5, atol=1e-5)
        sd = stack.state_dicts()[0]
        assert sd["a.weight"].shape == (64, 16) and torch.equal(sd["a.weight"], layers[0].a.weight.detach())
    assert dims == {True: ["0"], False: ["1"]}
