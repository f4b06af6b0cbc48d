#!/usr/bin/env python
"""A Mixtral-shaped mixture-of-experts model trained through the stack, beside torch on the device.

``transformers`` ``MixtralForCausalLM`` (bf16, ``--d`` / ``--f``, ``--experts`` experts, top
``--top-k``, 32/8 heads, ``--layers``), one AdamW step per call on ``--batch`` x ``--seq`` tokens:

* ``torch_device``: the model on the GPU, ``torch.optim.AdamW(fused=True)``, the model's own
  experts implementation (transformers' default);
* ``stack``: ``SwappedStack`` over ``causal_lm_stages`` (weights, gradients, bf16 AdamW moments in
  ``pinned_host``; the experts as ``xla_swap.moe.dense_experts_forward``: every expert on every
  token, ``E / k`` times the routed expert FLOPs).

Medians of ``--steps`` after a warm-up (seconds). The stack's transfer floor, with W the weight
bytes: ``max(4 W / h2d, 3 W / d2h, 7 W / both)`` (the weights in for the forward and the backward
and the two bf16 moments in; the weights and moments out) at 54 / 54 / 93 GB/s, the H100's pinned
rates of ``docs/measured.md``. Model TFLOP/s use the routed FLOPs: 6 x (non-embedding parameters
active per token) x tokens, attention not counted.

    PYTHONPATH=/tmp/site:. python3 benchmarks/moe_gpu.py --out $OUT/moe_gpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from step_timing import median_time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=14336)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe_gpu.json"))
    args = ap.parse_args(argv)
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    import xla_swap
    cuda = torch.cuda.is_available()
    heads = max(1, args.d // 128)
    cfg = MixtralConfig(vocab_size=args.vocab, hidden_size=args.d, intermediate_size=args.f,
                        num_hidden_layers=args.layers, num_attention_heads=heads,
                        num_key_value_heads=max(1, heads // 4), num_local_experts=args.experts,
                        num_experts_per_tok=args.top_k, max_position_embeddings=max(4096, args.seq),
                        tie_word_embeddings=False)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    init_s = time.perf_counter() - t0
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    ce = lambda lo, t: torch.nn.functional.cross_entropy(lo.flatten(0, 1).float(), t.flatten())  # noqa: E731
    w = sum(p.numel() * p.element_size() for p in model.parameters())
    per_expert = 3 * args.d * args.f
    non_embed = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    active = non_embed - args.layers * (args.experts - args.top_k) * per_expert + args.d * args.vocab
    tokens = args.batch * args.seq
    flops = 6 * active * tokens
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "args": vars(args), "weight_bytes": w,
           "init_s": init_s, "model_flops": flops,
           "link_floor_s": max(4 * w / 54e9, 3 * w / 54e9, 7 * w / 93e9)}
    rows = res["rows"] = {}
    if cuda:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        xc, yc = x.cuda(), y.cuda()
        losses = []

        def step():
            loss = ce(model(xc).logits, yc)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        t = median_time(step, args.steps, torch.cuda.synchronize)
        rows["torch_device"] = {"step_s": t, "tflops": flops / t / 1e12, "first_loss": losses[0],
                                "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30}
        print(json.dumps(rows["torch_device"]), flush=True)
        del opt
        model = model.cpu()
        torch.manual_seed(0)
        torch.cuda.empty_cache()
    model.eval()
    t0 = time.perf_counter()
    first, layers, last = xla_swap.causal_lm_stages(model)
    stack = xla_swap.SwappedStack(layers, first=first, last=last, loss_fn=ce,
                                  optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5))
    first_loss = float(stack.train_step(x, y))
    first_s = time.perf_counter() - t0
    t = median_time(lambda: stack.train_step(x, y), args.steps, lambda: None)
    rows["stack"] = {"step_s": t, "tflops": flops / t / 1e12, "first_step_s": first_s, "first_loss": first_loss,
                     "ratio_to_link_floor": t / res["link_floor_s"]}
    if "torch_device" in rows:
        rows["stack"]["ratio_to_torch"] = t / rows["torch_device"]["step_s"]
    print(json.dumps(rows["stack"]), flush=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"{res['device']}: W {w / 2 ** 30:.2f} GiB, link floor {res['link_floor_s']:.3f} s, init {init_s:.1f} s")
    for k, r in rows.items():
        print(f"{k:14s} {r['step_s']:.3f} s  {r['tflops']:6.1f} TFLOP/s  first loss {r['first_loss']:.4f}"
              + (f"  x{r['ratio_to_link_floor']:.2f} floor" if "ratio_to_link_floor" in r else "")
              + (f"  x{r['ratio_to_torch']:.2f} torch" if "ratio_to_torch" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
