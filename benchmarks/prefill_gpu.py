#!/usr/bin/env python
"""Time to first token through the stack against torch on the device: the prefill of a long prompt.

A Llama of shape ``--shape`` (``generate_gpu.SHAPES``; default ``d5120``: D=5120, F=27648, 40/8 heads,
16 layers, vocab 32000, about 16.3 GB of bf16 weights), random values. Two models of that shape in one
process, one GPU:

* **torch on the device**: ``LlamaForCausalLM`` built on the GPU (bf16, ``attn_implementation="sdpa"``),
  its prefill ``model(ids, use_cache=True)`` and the argmax of the last position, under
  ``torch.no_grad()``; the whole model in device memory (the reference, as a torch user serves a model
  that fits);
* **the stack**: built on the meta device, random weights per stage straight into ``pinned_host``
  (``generate_gpu.RandomWeights``); ``stack.generate(ids, max_new_tokens=1)``, its time to first token
  ``last_generation["first_token_s"]`` (weights streamed once, prefill computed, first token sampled).

Per prompt length (``--prompts``, default 512, 4096 and 16384 tokens, batch 1): medians of ``--reps`` after
one warm-up (the compile), the ratio stack / torch, and the link floor ``W / h2d`` (h2d from a
``pinned_host`` -> device copy of 2 GiB, jax, in the same process). Expectation: at 512 tokens the
prefill is the link's (about W / h2d, several times torch, which reads its weights from HBM); past a few
thousand tokens the compute (2 x params x tokens plus attention) exceeds the stream and the stack
approaches torch (target <= 1.10x).

With ``--check-path``, once the timings are done, the stack's generation is released and each prompt runs once
more with the causal prefill path counting its runs (``xla_swap.stack.torch_attention.count_causal_prefill_runs``; a
host callback per layer, so not timed), unpadded and left-padded by 5 tokens (the bucket pads them): each row's
``causal_prefill_runs`` / ``causal_prefill_runs_padded`` should be the layer count (every layer's prefill ran cuDNN's
causal kernel over the prompt's keys, no mask). ``causal_prefill_traced``: the causal path traced in the timed
calls (``xla_swap.stack.torch_attention.kernel_counts``).

    PYTHONPATH=/tmp/site:. python3 benchmarks/prefill_gpu.py --check-path --out $OUT/prefill_gpu.json
    PYTHONPATH=. PJRT_DEVICE=CPU python3 benchmarks/prefill_gpu.py --cpu-smoke --out /tmp/prefill.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.generate_gpu import SHAPES, SMOKE, RandomWeights, _config, _layers, _real_ends, measure_bandwidth  # noqa: E402


def torch_ttft(model, ids, reps: int) -> float:
    """Median seconds of ``model(ids, use_cache=True)`` and the argmax of its last position (synchronised)."""
    import torch
    cuda = ids.is_cuda
    ts = []
    with torch.no_grad():
        for _ in range(reps + 1):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(ids, use_cache=True)
            tok = out.logits[:, -1].argmax(-1)
            if cuda:
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
            del out, tok
    return statistics.median(ts[1:])


def stack_ttft(stack, ids, reps: int) -> float:
    """Median ``first_token_s`` of ``stack.generate(ids, max_new_tokens=1)`` after one warm-up call."""
    ts = []
    for _ in range(reps + 1):
        stack.generate(ids, max_new_tokens=1, eos_token_id=None, prompt_bucket=64)
        ts.append(stack.last_generation["first_token_s"])
    return statistics.median(ts[1:])


def check_path(stack, ids, pad: int = 5) -> dict:
    """Runs of the causal prefill path in one ``generate(ids)`` and one of ``ids`` less its first ``pad`` tokens
    (left-padded by the bucket), counted by a host callback in executables compiled afresh."""
    from xla_swap.stack import torch_attention
    from xla_swap.hf.generate import release_generation
    out = {}
    torch_attention.count_causal_prefill_runs(True)
    try:
        release_generation(stack)   # compiled again: with the counting callback
        for key, x in (("causal_prefill_runs", ids), ("causal_prefill_runs_padded", ids[:, pad:])):
            before = torch_attention.kernel_counts().get("causal_prefill_run", 0)
            stack.generate(x, max_new_tokens=1, eos_token_id=None, prompt_bucket=64)
            out[key] = torch_attention.kernel_counts().get("causal_prefill_run", 0) - before
    finally:
        torch_attention.count_causal_prefill_runs(False)
        release_generation(stack)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="d5120")
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's own (8b: 16)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", default="512,4096,16384")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--check-path", action="store_true", help="count the causal prefill path's runs (untimed)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "prefill_gpu.json"))
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.vocab, args.prompts, args.reps = 128, "16,32", 1
    import torch
    from transformers import LlamaForCausalLM
    import xla_swap
    import xla_swap.stack.torch_attention
    shape = (SMOKE if args.cpu_smoke else SHAPES)[args.shape]
    layers = args.layers or _layers(args.shape, shape, argparse.Namespace(layers_8b=16, layers_70b=48))
    prompts = [int(p) for p in args.prompts.split(",")]
    cfg = _config(shape, layers, args.vocab, max_pos=max(prompts) + 128)
    cfg._attn_implementation = "sdpa"
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    bw = measure_bandwidth(16 << 20 if args.cpu_smoke else 2 << 30)
    torch.manual_seed(0)
    with torch.device(dev):
        ref = LlamaForCausalLM(cfg).to(dtype).eval()
    w = sum(p.numel() * p.element_size() for n, p in ref.named_parameters())
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    meta.to(dtype)
    _real_ends(meta, cfg)
    with torch.no_grad():
        for m, r in ((meta.model.embed_tokens, ref.model.embed_tokens), (meta.lm_head, ref.lm_head),
                     (meta.model.norm, ref.model.norm)):
            m.weight.copy_(r.weight.cpu())
    first, lyr, last = xla_swap.causal_lm_stages(meta.eval())
    stack = xla_swap.SwappedStack(lyr, first=first, last=last, weights=RandomWeights(dev))
    data = {"device": torch.cuda.get_device_name() if cuda else "cpu", "shape": dict(shape, layers=layers,
            vocab=args.vocab), "weight_bytes": w, "bandwidth": bw, "link_floor_s": w / (bw["h2d_GBps"] * 1e9),
            "rows": []}
    for p in prompts:
        ids = torch.randint(3, args.vocab, (1, p), generator=torch.Generator().manual_seed(p))
        row = {"prompt": p}
        try:
            row["torch_s"] = torch_ttft(ref, ids.to(dev), args.reps)
        except torch.OutOfMemoryError as e:   # recorded: the stack's row still runs
            row["torch_s"], row["torch_error"] = None, str(e).splitlines()[0]
        gc.collect()
        torch.cuda.empty_cache() if cuda else None
        traced = xla_swap.stack.torch_attention.kernel_counts().get("causal_prefill", 0)
        row["stack_s"] = stack_ttft(stack, ids, args.reps)
        row["causal_prefill_traced"] = xla_swap.stack.torch_attention.kernel_counts().get("causal_prefill", 0) - traced
        if args.check_path:
            row.update(check_path(stack, ids))
        row["stack_over_torch"] = row["stack_s"] / row["torch_s"] if row["torch_s"] else None
        row["stack_over_link_floor"] = row["stack_s"] / data["link_floor_s"]
        data["rows"].append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print(f"{data['device']}: W {w / 1e9:.2f} GB, h2d {bw['h2d_GBps']:.1f} GB/s, link floor {data['link_floor_s']:.3f} s")
    print("| prompt | torch on the device s | stack TTFT s | stack / torch | stack / link floor | causal prefill "
          "traced / runs / runs padded |")
    print("|---|---|---|---|---|---|")
    for r in data["rows"]:
        ratio = "" if r["stack_over_torch"] is None else f"{r['stack_over_torch']:.3f}"
        ts = "OOM" if r["torch_s"] is None else f"{r['torch_s']:.4f}"
        path = f"{r['causal_prefill_traced']} / {r.get('causal_prefill_runs', '-')} / {r.get('causal_prefill_runs_padded', '-')}"
        print(f"| {r['prompt']} | {ts} | {r['stack_s']:.4f} | {ratio} | {r['stack_over_link_floor']:.3f} | {path} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
