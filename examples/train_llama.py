"""Train a ``transformers`` Llama decoder on real English text through ``xla_swap.stack.swapped_stack.SwappedStack``.

The model is ``LlamaForCausalLM`` built from a config (random init), unmodified; its decoder
layers are streamed from host memory: weights in ``pinned_host``, gradients consumed on the
device by the per-layer AdamW step, AdamW moments in ``pinned_host``. Text and tokenizer as in
``train_decoder.py`` (CPython's licence and stdlib docstrings, the all-MiniLM-L6-v2 tokenizer).
Runs on whatever jax sees (4 virtual CPU devices here by default, weights FSDP-sharded over
them; one GPU on a GPU machine).

    python examples/train_llama.py --steps 40 --layers 4 --dim 128 --out out/
    python examples/train_llama.py --budget-mib 64 ...   # a device-memory budget: the first step
                                                          # measures and picks what stays on the device
    python examples/train_llama.py --steps 20 --save ckpt/          # save the training state at the end
    python examples/train_llama.py --steps 40 --resume ckpt/ ...    # go on from it (steps 21..40)
    python examples/train_llama.py --clip 1.0 --accumulate 4 --warmup 4 --bf16 ...
        # clip_grad_norm_ at 1.0, 4 micro-batches per AdamW step, a warm-up + cosine schedule,
        # fp32 master weights with bf16 compute (FSDP2's param_dtype)

The optimizer is torch's AdamW over two param groups (weight decay on matrices, none on norms, as
the Hugging Face Trainer builds them), stepped by ``transformers.get_cosine_schedule_with_warmup``
(constant after ``--warmup`` 0 warm-up steps, the default): the stack reads both at every step.

Writes ``train_llama_loss.png`` and ``.json`` into ``--out`` and exits non-zero unless the loss
went down and the weights and moments were where the schedule puts them (``pinned_host``; with
``--budget-mib``, device memory for the stages the first step chose to keep resident).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import train_decoder  # noqa: E402  (corpus and token windows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--budget-mib", type=int, default=None,
                    help="device-memory budget (MiB): SwappedStack(budget_bytes=) chooses the schedule at the first step")
    ap.add_argument("--out", default="out", help="folder for the loss PNG and JSON (not tracked)")
    ap.add_argument("--save", default=None, help="folder to save the training state into at the end "
                    "(SwappedStack.save_checkpoint: a torch.distributed.checkpoint)")
    ap.add_argument("--resume", default=None, help="folder of a --save checkpoint to go on from (same --layers, "
                    "--dim; it skips the steps already taken)")
    ap.add_argument("--clip", type=float, default=None, help="max_grad_norm: clip the global gradient norm")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--warmup", type=int, default=0,
                    help="warm-up steps of a cosine schedule over --steps (0: a constant learning rate)")
    ap.add_argument("--bf16", action="store_true", help="fp32 master weights, bf16 compute (param_dtype)")
    args = ap.parse_args(argv)

    import jax
    from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

    from xla_swap.stack import SwappedStack, causal_lm_stages
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from xla_swap.stack.config import TrainingConfig

    cfg = LlamaConfig(vocab_size=30522, hidden_size=args.dim, intermediate_size=4 * args.dim,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    n = args.accumulate
    batches = train_decoder.token_batches(
        train_decoder.Config(seq=args.seq, batch=args.batch), args.steps * n)  # [steps * n, batch, seq + 1]

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    params = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for _, p in params if p.ndim >= 2], "weight_decay": 0.01},
                             {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0}], lr=args.lr)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, args.steps) if args.warmup else None

    # --- the xla_swap part: one object, torch in and out ---
    first, layers, last = causal_lm_stages(model)
    budget = None if args.budget_mib is None else args.budget_mib << 20
    stack = SwappedStack(layers, first=first, last=last, loss_fn=lambda lo, y: loss_fn(lo, y) / n,
                         budget_bytes=budget, optimizer=opt, training=TrainingConfig(max_grad_norm=args.clip),
                         mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) if args.bf16 else None)
    losses = []
    if args.resume:   # weights, AdamW moments and step; the losses and the schedule ride along as `extra`
        extra = stack.load_checkpoint(args.resume)
        losses = extra["losses"]
        if sched is not None:
            sched.load_state_dict(extra["scheduler"])
        print(f"resumed from {args.resume} at step {stack.runtime.step}")
    for step in (bar := tqdm(range(stack.runtime.step, args.steps), desc="train_llama", unit="step",
                             file=sys.stdout)):
        micro = [float(stack.train_step(b[:, :-1], b[:, 1:], accumulate=i < n - 1))   # one AdamW step per n
                 for i, b in enumerate(batches[step * n:(step + 1) * n])]
        if sched is not None:
            sched.step()
        losses.append(sum(micro))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    if args.save:
        stack.save_checkpoint(args.save, extra={"losses": losses,
                                                "scheduler": None if sched is None else sched.state_dict()})
    stack.sync_modules()  # the trained weights back into `model`

    rt = stack.runtime
    if stack.schedule is not None:
        print(stack.schedule.explain().split("\n\n")[0])
    want = ["device" if r else "pinned_host" for r in rt.resident]
    kinds_ok = all({a.sharding.memory_kind for a in jax.tree_util.tree_leaves((p, s))} == {w}
                   for p, s, w in zip(rt.host_params, rt.optimizer_state, want))
    with torch.no_grad():  # the synced torch model gives the same loss as the stack
        x, y = batches[-1][:, :-1], batches[-1][:, 1:]
        torch_loss, stack_loss = float(loss_fn(model(x).logits, y)), float(loss_fn(stack(x).float(), y))
    checks = {
        "loss went down": losses[-1] < losses[0],
        "one loss per step, resumed steps included": len(losses) == rt.step == args.steps,
        "weights and AdamW moments in pinned_host (resident stages: device memory)": kinds_ok,
        "the schedule fits the budget (predicted)": budget is None or (
            stack.schedule is not None and stack.schedule.device_bytes <= budget),
        # bf16 compute (--bf16) against the synced fp32 model: bf16 rounding, so 2e-2
        "synced torch model agrees with the stack (rel 1e-4; 2e-2 with --bf16)":
            abs(torch_loss - stack_loss) <= (2e-2 if args.bf16 else 1e-4) * abs(torch_loss),
    }

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_decoder.save_loss_plot(losses, f"LlamaForCausalLM {args.layers}x{args.dim} via SwappedStack "
                                 f"({rt.num_stages} stages, weights + AdamW state in pinned_host)",
                                 out / "train_llama_loss.png")
    (out / "train_llama_loss.json").write_text(json.dumps(
        {"args": vars(args), "policy": str(stack.policy), "devices": len(jax.devices()), "losses": losses,
         "schedule": None if stack.schedule is None else stack.schedule.describe(),
         "weight_bytes": rt.weight_nbytes, "optimizer_state_bytes": sum(rt.optimizer_state_nbytes),
         "command": " ".join(sys.argv)}, indent=1))
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {rt.weight_nbytes} bytes of weights and "
          f"{sum(rt.optimizer_state_nbytes)} of AdamW state, {sum(rt.resident)} of {rt.num_stages} stages resident "
          f"in device memory, the rest in pinned_host; saved {out / 'train_llama_loss.png'}")
    for name, ok in checks.items():
        print(f"[{'PASS' if ok else 'FAIL'}] {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
