"""``SwappedStack`` checkpoint and resume against plain torch on the same weights and data.

A small ``transformers`` Llama decoder in float32 on the CPU, trained with ``torch.optim.AdamW``
(two param groups: decay on matrices, none on norms) and a warm-up + cosine ``LambdaLR``. The
stack saves after 3 steps (``save_checkpoint``: a ``torch.distributed.checkpoint`` folder); a
fresh stack over a differently initialised model loads it and trains 3 more steps: its weights
equal torch's uninterrupted run and the first stack's to a relative 1e-5 per parameter. On all
of jax's devices (FSDP-sharded weights with several), so marked ``spmd``.
"""
import copy

import jax
import pytest
import torch
import torch.distributed.checkpoint as dcp

from llama_cases import batches, ce, hf_groups, make_model, rel, warmup_cosine
from xla_swap.stack import SwappedStack, causal_lm_stages

TOL = 1e-5


def worst_rel(model, ref):
    return max(rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters()))


def fqn(torch_name):
    """The stack's name of a ``LlamaForCausalLM`` parameter (``causal_lm_stages``' stages)."""
    if torch_name.startswith("model.layers."):
        return torch_name[len("model."):]
    if torch_name.startswith("model.embed_tokens."):
        return "first." + torch_name[len("model."):]
    return "last." + torch_name.removeprefix("model.")


def train(model, opt, sched, stack, data):
    for x, y in data:
        if stack is None:
            opt.zero_grad()
            ce(model(x).logits, y).backward()
            opt.step()
        else:
            stack.train_step(x, y)
        sched.step()


def optimizer_for(model):
    opt = torch.optim.AdamW(hf_groups(model, 0.1), lr=3e-3, eps=1e-6)  # eps: see test_stack_optim.ADAM
    return opt, warmup_cosine(opt)


def stack_of(model, opt):
    first, layers, last = causal_lm_stages(model)
    return SwappedStack(layers, first=first, last=last, loss_fn=ce, optimizer=opt)


@pytest.mark.spmd
def test_resume_equals_the_uninterrupted_run(tmp_path):
    """Save after 3 of 6 steps, load into a stack over other weights, 3 more steps: the weights
    equal torch's and the uninterrupted stack's; the checkpoint holds torch's layout and moments."""
    data = batches(6)
    ref = make_model()
    model = copy.deepcopy(ref)
    opt_ref, sched_ref = optimizer_for(ref)
    opt, sched = optimizer_for(model)
    stack = stack_of(model, opt)
    train(ref, opt_ref, sched_ref, None, data[:3])
    train(model, opt, sched, stack, data[:3])
    stack.save_checkpoint(tmp_path / "ckpt", extra={"scheduler": sched.state_dict()})
    lrs = [g["lr"] for g in opt.param_groups]

    # the checkpoint, read by torch alone: torch's names, layout ([out, in]) and moments at step 3
    names = {n: fqn(n) for n, _ in ref.named_parameters()}
    plain = {f"model.{f}": torch.empty(p.shape) for n, p in ref.named_parameters() for f in [names[n]]}
    plain.update({f"optim.state.{names[n]}.{k}": torch.empty(() if k == "step" else p.shape)
                  for n, p in ref.named_parameters() for k in ("exp_avg", "exp_avg_sq", "step")})
    dcp.load(plain, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    md = dcp.FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata
    assert len(md["model.layers.0.mlp.up_proj.weight"].chunks) == len(jax.devices())  # one per FSDP shard
    for n, p in ref.named_parameters():
        assert rel(plain[f"model.{names[n]}"], p.detach()) <= TOL, n
        st = opt_ref.state[p]
        assert float(plain[f"optim.state.{names[n]}.step"]) == float(st["step"]) == 3
        for k in ("exp_avg", "exp_avg_sq"):   # gradients agree to ~1e-6; a wrong layout would be ~1 off
            assert rel(plain[f"optim.state.{names[n]}.{k}"], st[k]) <= 1e-4, (n, k)

    train(ref, opt_ref, sched_ref, None, data[3:])
    train(model, opt, sched, stack, data[3:])
    stack.sync_modules()

    fresh = make_model(seed=1)
    assert worst_rel(fresh, ref) > 0.5
    opt2, sched2 = optimizer_for(fresh)
    resumed = stack_of(fresh, opt2)
    extra = resumed.load_checkpoint(tmp_path / "ckpt")
    sched2.load_state_dict(extra["scheduler"])
    assert resumed.runtime.step == 3 and [g["lr"] for g in opt2.param_groups] == lrs
    train(fresh, opt2, sched2, resumed, data[3:])
    assert resumed.runtime.step == 6
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt_ref.param_groups]
    resumed.sync_modules()
    assert worst_rel(fresh, ref) <= TOL
    assert worst_rel(fresh, model) <= TOL
    # the weights and moments stay where the runtime keeps them, with the same shardings
    for a, b in zip(jax.tree_util.tree_leaves((resumed.runtime.host_params, resumed.runtime.optimizer_state)),
                    jax.tree_util.tree_leaves((stack.runtime.host_params, stack.runtime.optimizer_state))):
        assert a.sharding.memory_kind == "pinned_host" and a.sharding.is_equivalent_to(b.sharding, a.ndim)
    assert not opt2.state   # the torch optimizer's own state stays unused


def test_state_dict_round_trip_and_refusals(tmp_path):
    """``state_dict()`` / ``load_state_dict`` in memory; a checkpoint of another config, a tensor of
    another shape and pending micro-batches are refused with a named error, the stack unchanged and
    usable."""
    data = batches(3, seed=4)
    model = make_model(layers=2)
    opt, _ = optimizer_for(model)
    stack = stack_of(model, opt)
    stack.train_step(*data[0])
    sd = stack.state_dict()
    assert set(sd) == {"model", "optim"} and sd["optim"]["state"]["layers.0.mlp.up_proj.weight"]["step"] == 1
    assert sd["model"]["layers.0.mlp.up_proj.weight"].shape == (64, 32)   # torch's [out, in]
    groups = sd["optim"]["param_groups"]
    assert "layers.0.mlp.up_proj.weight" in groups[0]["params"] and groups[1]["weight_decay"] == 0.0
    assert "layers.0.input_layernorm.weight" in groups[1]["params"]

    other = make_model(layers=2, ffn=48)
    oopt, _ = optimizer_for(other)
    other_stack = stack_of(other, oopt)
    other_stack.save_checkpoint(tmp_path / "other")
    before = stack.state_dict()

    def unchanged():
        now = stack.state_dict()
        return all(torch.equal(now["model"][k], before["model"][k]) for k in now["model"]) and \
            stack.runtime.step == 1

    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.(down|gate|up)_proj\.weight has shape \[48, 32\]|"
                                         r"shape \[32, 48\]"):
        stack.load_checkpoint(tmp_path / "other")
    assert unchanged()
    fewer = make_model(layers=1)
    fopt, _ = optimizer_for(fewer)
    few = stack_of(fewer, fopt)
    few.save_checkpoint(tmp_path / "fewer")
    with pytest.raises(ValueError, match=r"keys missing \['model\.layers\.1\."):
        stack.load_checkpoint(tmp_path / "fewer")
    with pytest.raises(FileNotFoundError, match="no .metadata"):
        stack.load_checkpoint(tmp_path / "nothing")
    bad = copy.deepcopy(sd)
    bad["optim"]["state"]["layers.1.self_attn.k_proj.weight"]["exp_avg"] = torch.zeros(32, 16)
    with pytest.raises(ValueError, match=r"optim\.state\.layers\.1\.self_attn\.k_proj\.weight\.exp_avg has shape"):
        stack.load_state_dict(bad)
    assert unchanged()

    stack.train_step(*data[1], accumulate=True)
    for call in (lambda: stack.save_checkpoint(tmp_path / "pending"), lambda: stack.load_state_dict(sd)):
        with pytest.raises(ValueError, match="1 accumulated micro-batches are pending"):
            call()
    assert not (tmp_path / "pending").exists()
    stack.train_step(*data[1])
    assert stack.runtime.step == 2

    stack.load_state_dict(sd)   # back to step 1: the next step repeats the same update
    assert stack.runtime.step == 1
    stack.train_step(*data[1])
    again = stack.state_dict()
    stack.load_state_dict(sd)
    stack.train_step(*data[1])
    assert all(torch.equal(v, stack.state_dict()["model"][k]) for k, v in again["model"].items())
