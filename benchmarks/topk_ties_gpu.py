#!/usr/bin/env python
"""Ties in ``torch.topk``: torch on the device against the stages' ``topk``, and a tied MoE router.

What it checks (``docs/explanation/mixture-of-experts.md``, "Ties in the routers' top-k"):

1. ``torch.topk`` on the torch device (CUDA if there is one, else the CPU) against ``torch.topk``
   traced in the stages' environment for the first jax device (``xla_swap.hf.moe.topk_like_torch``:
   ``lax.top_k`` on a GPU, torch's own CPU kernel through a host callback on the CPU), on rows of
   router scores with ties: every score equal, and scores drawn from 3 values. Per ``(experts, k)``:
   whether every row picks the same set of experts, and whether in the same order.
2. A Mixtral (fp32, ``--experts`` experts, top-2) with its routers zeroed, so that every score ties
   at the first step: the stack's logits and its weights after one AdamW step against torch's on
   the torch device, in both experts forms (rel: ``||a - b|| / ||b||``).

Prints one line per row and writes JSON to ``--out`` (default ``$OUT/topk_ties_gpu.json``, or
nothing without ``$OUT``). Exit status 1 if a set of experts differs or a rel exceeds 1e-4; an order
that differs among equal scores is reported, not failed (it changes no value of the dense form).

    PYTHONPATH=/tmp/site:. python3 benchmarks/topk_ties_gpu.py
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys


def compare_topk(dev, tokens: int, shapes) -> list:
    """Rows ``{"experts", "k", "scores", "same_set", "same_order"}``: torch on ``dev`` against the stages' topk."""
    import jax
    import torch

    from xla_swap.stack.torch_attention import torchax_env
    env = torchax_env(jax.devices()[0].platform)
    rows = []
    for n, k in shapes:
        g = torch.Generator().manual_seed(n * 31 + k)
        for name, x in (("equal", torch.zeros(tokens, n)),
                        ("3 values", torch.randint(0, 3, (tokens, n), generator=g).float())):
            want = torch.topk(x.to(dev), k).indices.cpu()
            with env:
                got = jax.jit(lambda a: env.t2j_iso(torch.topk(env.j2t_iso(a), k).indices))(env.t2j_copy(x))
            got = torch.from_numpy(jax.numpy.asarray(got).__array__().copy()).long()
            rows.append({"experts": n, "k": k, "scores": name,
                         "same_set": bool(torch.equal(got.sort(-1).values, want.sort(-1).values)),
                         "same_order": bool(torch.equal(got, want))})
    return rows


def tied_mixtral(dev, experts_n: int, form: str) -> dict:
    """A Mixtral with zeroed routers through the stack against torch on ``dev``: logits and one AdamW step."""
    import jax
    import torch
    import transformers

    import xla_swap
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts_n,
                                     num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for m in model.modules():
            if "Router" in type(m).__name__:
                for p in m.parameters(recurse=False):
                    p.zero_()
    ref = copy.deepcopy(model).to(dev)
    ce = lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    first, layers, last = xla_swap.causal_lm_stages(model, experts=form)
    stack = xla_swap.SwappedStack(layers, first=first, last=last, loss_fn=ce,
                                  parallel=xla_swap.ParallelConfig(devices=jax.devices()[:1]),
                                  optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    rel = lambda a, b: float((a.detach().cpu() - b.detach().cpu()).norm() / b.detach().cpu().norm())
    with torch.no_grad():
        logits = rel(stack(x), ref(x.to(dev)).logits)
    stack.train_step(x, y)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ce(ref(x.to(dev)).logits, y.to(dev)).backward()
    opt.step()
    stack.sync_modules()
    weights = rel(torch.cat([p.flatten() for p in model.parameters()]),
                  torch.cat([p.flatten().cpu() for p in ref.parameters()]))
    return {"form": form, "experts": experts_n, "logits_rel": logits, "weights_rel": weights}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--experts", type=int, default=8, help="experts of the tied Mixtral (part 2)")
    p.add_argument("--out", default=os.path.join(os.environ["OUT"], "topk_ties_gpu.json") if os.environ.get("OUT")
                   else None)
    args = p.parse_args(argv)
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(n, k) for n in (4, 8, 16, 64, 128, 256) for k in (1, 2, 4, 8) if k < n]
    topk = compare_topk(dev, args.tokens, shapes)
    for r in topk:
        print(f"topk {r['experts']:4d} experts top-{r['k']} {r['scores']:9s} same set {r['same_set']!s:5s} "
              f"same order {r['same_order']}")
    models = [tied_mixtral(dev, args.experts, form) for form in ("dense", "sorted")]
    for r in models:
        print(f"tied mixtral {r['form']:6s} logits rel {r['logits_rel']:.2e} weights rel {r['weights_rel']:.2e}")
    ok = all(r["same_set"] for r in topk) and all(max(r["logits_rel"], r["weights_rel"]) <= 1e-4 for r in models)
    result = {"torch_device": dev, "torch": torch.__version__, "topk": topk, "tied_mixtral": models, "ok": ok}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
