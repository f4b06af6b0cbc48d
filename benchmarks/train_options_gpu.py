#!/usr/bin/env python
"""What the fine-tuning loop's options cost on the GPU: clipping and gradient accumulation
against the plain fused AdamW step, in the same run.

A ``transformers`` Llama (bf16, 32/8 heads, ``--layers``, per ``--shapes`` entry ``D,F,B,S``)
through ``SwappedStack`` (default policy: weights, gradients, bf16 AdamW moments in
``pinned_host``), per shape:

* ``plain``: ``train_step`` (the update fused into the backward);
* ``accum4``: 4 micro-batches of the same size, three ``train_step(accumulate=True)`` and one
  update: the time of the 4 calls, and per micro-batch;
* ``clip``: ``SwappedStack(training=TrainingConfig(max_grad_norm=1.0))``: backward, the norm, then an update pass;
* ``mp``: the same model in float32 with ``SwappedStack(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))``: fp32 master
  weights and fp32 AdamW moments in ``pinned_host``, bf16 compute (``--no-mp`` skips it); its
  floor is the plain one with every byte doubled (fp32 weights and moments cross the link).

Medians of ``--steps`` after one warm-up, seconds; ratios to ``plain`` of the same run. The
fused step's transfer floor is printed beside it: weights W in twice (forward and backward) and
the two bf16 moments in (4 W host to device), weights and moments out (3 W), at 54 GB/s each
way and 93 GB/s both at once (the H100 figures of ``docs/explanation/measured-facts.md``; not measured here), the
prefetched stages kept across the turns not subtracted.

Also: a bf16 ``[8192, 4096] @ [4096, 14336]`` matmul under jax's ``highest`` and ``default``
precision, 5 interleaved rounds of 20 (the stack traces fp32 contractions at ``highest`` by
default, torch's setting; bf16 operands should not care).

    PYTHONPATH=/tmp/site:. python3 benchmarks/train_options_gpu.py --out $OUT/train_options_gpu.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

from step_timing import median_time


def llama(d, f, layers):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=16384,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def ce(lo, y):
    import torch
    return torch.nn.functional.cross_entropy(lo.flatten(0, 1).float(), y.flatten())


def shape_rows(d, f, layers, b, s, steps, mp=True):
    import torch
    import xla_swap
    model = llama(d, f, layers)
    ids = torch.randint(0, 32000, (b, s + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    w = sum(p.numel() * p.element_size() for n, p in model.named_parameters())
    # h2d: weights twice and the two bf16 moments (4 W); d2h: weights and moments (3 W); both at once 93 GB/s
    floor = max(4 * w / 54e9, 3 * w / 54e9, 7 * w / 93e9)
    rows = {"d": d, "f": f, "layers": layers, "b": b, "s": s, "weight_bytes": w, "link_floor_s": floor}

    def build(model=model, **kw):
        m = copy.deepcopy(model)
        first, mid, last = xla_swap.causal_lm_stages(m)
        st = xla_swap.SwappedStack(mid, first=first, last=last, loss_fn=ce,
                                   optimizer=torch.optim.AdamW(m.parameters(), lr=1e-5), **kw)
        st.train_step(x, y)
        return st

    st = build()
    rows["plain_s"] = median_time(lambda: st.train_step(x, y), steps)

    def accum():
        for _ in range(3):
            st.train_step(x, y, accumulate=True)
        st.train_step(x, y)
    rows["accum4_s"] = median_time(accum, steps)
    del st
    st = build(training=xla_swap.TrainingConfig(max_grad_norm=1.0))
    rows["clip_s"] = median_time(lambda: st.train_step(x, y), steps)
    rows["clip_norm"] = st.last_grad_norm
    del st
    rows["accum4_per_micro_ratio"] = rows["accum4_s"] / 4 / rows["plain_s"]
    rows["clip_ratio"] = rows["clip_s"] / rows["plain_s"]
    rows["plain_floor_ratio"] = rows["plain_s"] / floor
    if mp:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        st = build(model.float(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        rows["mp_s"] = median_time(lambda: st.train_step(x, y), steps)
        del st
        rows["mp_ratio"] = rows["mp_s"] / rows["plain_s"]
        rows["mp_floor_s"] = 2 * floor
        rows["mp_floor_ratio"] = rows["mp_s"] / (2 * floor)
    tokens, params = b * s, w / 2
    rows["plain_tflops"] = (6 * params * tokens + 6 * layers * b * s * s * d) / rows["plain_s"] / 1e12
    print(json.dumps(rows), flush=True)
    return rows


def matmul_precision(rounds=5, reps=20):
    import jax
    import jax.numpy as jnp
    a = jnp.ones((8192, 4096), jnp.bfloat16)
    b = jnp.ones((4096, 14336), jnp.bfloat16)
    fns = {}
    for p in ("highest", "default"):
        with jax.default_matmul_precision(p):
            fns[p] = jax.jit(lambda a, b: a @ b).lower(a, b).compile()
    out = {p: [] for p in fns}
    for _ in range(rounds):
        for p, f in fns.items():
            out[p].append(median_time(lambda: jax.block_until_ready(f(a, b)), reps))
    return {p: {"rounds_s": v, "median_s": statistics.median(v)} for p, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096,14336,16,4,2048 5120,13824,8,2,4096")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-mp", action="store_true", help="skip the mixed-precision row")
    ap.add_argument("--skip-matmul", action="store_true", help="skip the bf16 matmul precision rounds")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "train_options_gpu.json"))
    args = ap.parse_args(argv)
    import jax
    res = {"device": str(jax.devices()[0].device_kind), "shapes": []}
    try:
        if not args.skip_matmul:
            res["bf16_matmul_precision"] = matmul_precision()
            print(json.dumps(res["bf16_matmul_precision"]), flush=True)
        for sh in args.shapes.split():
            d, f, layers, b, s = map(int, sh.split(","))
            res["shapes"].append(shape_rows(d, f, layers, b, s, args.steps, mp=not args.no_mp))
    finally:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    print(f"\n{res['device']}")
    for p, v in res.get("bf16_matmul_precision", {}).items():
        print(f"bf16 matmul under {p:8s}: median {v['median_s'] * 1e3:.3f} ms, rounds "
              + " ".join(f"{t * 1e3:.3f}" for t in v["rounds_s"]))
    for r in res["shapes"]:
        print(f"L{r['layers']} D{r['d']} F{r['f']} B{r['b']} S{r['s']}: plain {r['plain_s']:.3f} s "
              f"({r['plain_s'] / r['link_floor_s']:.2f}x link floor {r['link_floor_s']:.3f}); accum4 {r['accum4_s']:.3f} s "
              f"({r['accum4_per_micro_ratio']:.2f}x plain per micro-batch); clip {r['clip_s']:.3f} s "
              f"({r['clip_ratio']:.2f}x plain); {r['plain_tflops']:.0f} model TFLOP/s plain"
              + (f"; mp {r['mp_s']:.3f} s ({r['mp_ratio']:.2f}x plain, {r['mp_floor_ratio']:.2f}x its floor)"
                 if "mp_s" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
