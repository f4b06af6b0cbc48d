#!/usr/bin/env python
"""Fused attention through the stack on the GPU: kernels alone, then Llama training steps,
each against torch on the device in the same run.

Part A, attention alone (bf16, head dimension 128, grouped-query K/V, medians of ``--reps``):
torch's fused SDPA (causal, and with an additive mask) against the same torch call run through
the stack's GPU torchax environment (``xla_swap.torch_attention``: cuDNN) and through torchax's
default environment (XLA's unfused form), forward and forward+backward; the relative error of
each against torch's output. Cases: ``causal`` and ``mask`` with torch's ``[B, N, T, H]`` tensors;
``causal_hf`` as a ``transformers`` layer calls it (``[B, T, N, H]`` projections transposed in, the
output transposed back and made contiguous), where the layout changes around cuDNN's kernel cancel.

Part B, a ``transformers`` Llama (bf16, ``--d``/``--f``, 32/8 heads, ``--layers``) trained with
AdamW: torch on the device (fused AdamW, SDPA; gradient checkpointing where ``--ckpt-tokens``
says) against ``SwappedStack`` (weights, gradients, AdamW moments in ``pinned_host``, default
policy) with ``fused_attention=True`` and ``False``; with ``--saved-rows`` also without remat (each
layer's input and vjp residuals to ``pinned_host``) and under ``budget_bytes`` (``--budget-gib``), the
schedule the chooser picks, remat or not, after measuring the link and the layers (its row names the
choice). Each row: the median step time of
``--steps`` steps after one warm-up, the first step's time from construction (compilation
included), and model TFLOP/s = (6 x non-embedding parameters x tokens + 6 x layers x batch x
seq^2 x d) / step: the 6ND rule (Kaplan et al. 2020, training = 3 x forward) plus causal
attention's score and value products (half of 12 x L x B x S^2 x D), recomputation not counted.

    PYTHONPATH=/tmp/site:. python3 benchmarks/attention_gpu.py --out $OUT/attention_gpu.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

from step_timing import median_time


def attention_rows(b, n, kv, s, reps, res):
    import jax
    import torch
    from xla_swap import torch_attention
    from xla_swap._compat.torchax import import_torchax
    F = torch.nn.functional
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, n, s, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, kv, s, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    mask = torch.full((s, s), torch.finfo(torch.bfloat16).min, device=dev, dtype=torch.bfloat16).triu(1)[None, None]
    fns = {"causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
           "mask": lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
           # as a transformers layer calls it: q/k/v projected as [B, T, N, H], transposed to SDPA's
           # [B, N, T, H] and the output transposed back and made contiguous (sdpa_attention_forward)
           "causal_hf": lambda q, k, v: F.scaled_dot_product_attention(
               q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
               enable_gqa=True).transpose(1, 2).contiguous()}
    hf = tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))
    sync = torch.cuda.synchronize
    for case, fn in fns.items():
        args = hf if case == "causal_hf" else (q, k, v) + ((mask,) if case == "mask" else ())
        ref = fn(*args)
        row = {"shape": [b, n, kv, s], "case": case}
        row["torch_fwd_s"] = median_time(lambda: fn(*args), reps, sync)
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        gargs = (qg, kg, vg) + args[3:]
        row["torch_fwdbwd_s"] = median_time(lambda: fn(*gargs).sum().backward(), reps, sync)
        jargs = [jax.dlpack.from_dlpack(t) for t in args]
        for name, env in (("cudnn", torch_attention.torchax_env("gpu")), ("xla", import_torchax().default_env())):
            if name == "xla" and s > 4096:
                continue

            def f(*a, env=env, fn=fn):
                with env:
                    return env.t2j_iso(fn(*env.j2t_iso(a)))
            fwd = jax.jit(f)
            fb = jax.jit(lambda *a, f=f: jax.grad(lambda *a: f(*a).astype("float32").sum(), argnums=(0, 1, 2))(*a))
            out = fwd(*jargs)
            out_t = torch.from_dlpack(out)
            row[f"{name}_rel_err"] = float((out_t.float() - ref.float()).norm() / ref.float().norm())
            jsync = lambda: jax.block_until_ready(jargs[0])  # noqa: E731
            row[f"{name}_fwd_s"] = median_time(lambda: jax.block_until_ready(fwd(*jargs)), reps, jsync)
            row[f"{name}_fwdbwd_s"] = median_time(lambda: jax.block_until_ready(fb(*jargs)), reps, jsync)
        row["kernel_counts"] = torch_attention.kernel_counts()
        res["attention"].append(row)
        print(json.dumps(row), flush=True)


def llama(d, f, layers, heads=32, kv_heads=8, seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=16384,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def model_flops(model, b, s):
    cfg = model.config
    non_embed = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return 6 * non_embed * b * s + 6 * cfg.num_hidden_layers * b * s * s * cfg.hidden_size


def _batch(b, s):
    import torch
    ids = torch.randint(0, 32000, (b, s + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _ce(lo, y):
    import torch
    return torch.nn.functional.cross_entropy(lo.flatten(0, 1).float(), y.flatten())


def _tag(args, b, s, model_cpu):
    return {"b": b, "s": s, "tokens": b * s, "layers": args.layers, "d": args.d, "f": args.f,
            "heads": args.heads, "kv_heads": args.kv_heads,
            "model_flops": model_flops(model_cpu, b, s)}


def torch_row(args, b, s, model_cpu):
    """torch on the device: without gradient checkpointing below ``--ckpt-tokens`` unless that runs
    out of memory, then with it."""
    import torch
    x, y = _batch(b, s)
    tag = _tag(args, b, s, model_cpu)
    for ckpt in ((False, True) if b * s < args.ckpt_tokens else (True,)):
        m = opt = None
        try:
            m = copy.deepcopy(model_cpu).cuda()
            if ckpt:
                m.gradient_checkpointing_enable()
            m.train()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
            xc, yc = x.cuda(), y.cuda()
            losses = []

            def step():
                loss = _ce(m(xc).logits, yc)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
            torch.cuda.reset_peak_memory_stats()
            t = median_time(step, args.steps, torch.cuda.synchronize)
            row = dict(tag, row="torch_device" + ("_ckpt" if ckpt else ""), step_s=t,
                       tflops=tag["model_flops"] / t / 1e12, first_loss=float(losses[0]),
                       peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30)
        except torch.OutOfMemoryError as e:
            row = dict(tag, row="torch_device" + ("_ckpt" if ckpt else ""), error=f"OOM: {str(e)[:80]}")
        del m, opt
        torch.cuda.empty_cache()
        if "error" not in row:
            break
    print(json.dumps(row), flush=True)
    return row


def stack_rows(args, b, s, model_cpu):
    import torch
    import xla_swap
    x, y = _batch(b, s)
    tag = _tag(args, b, s, model_cpu)
    rows = []
    from xla_swap.planning.policy import OffloadPolicy
    # remat (the default policy) or, for "saved", no recompute: every stage's input and vjp
    # residuals go to pinned_host in the forward and come back for the backward
    saved = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=False, prefetch_depth=2)
    variants = [("cudnn", True, {}), ("xla", False, {})]
    if args.saved_rows:
        variants.append(("cudnn_saved", True, {"policy": saved, "offload_activations": True}))
        # the chooser's pick under a budget (remat or kept residuals, docs/planner.md "Remat or
        # residuals"): the first step measures the link and the layers, then runs the choice
        variants.append(("cudnn_chosen", True, {"budget_bytes": _budget_bytes(args)}))
    for name, fused, kw in variants:
        if not fused and b * s > args.unfused_max_tokens:
            continue
        t0 = time.perf_counter()
        m = copy.deepcopy(model_cpu)
        first, layers, last = xla_swap.causal_lm_stages(m)
        stack = xla_swap.SwappedStack(layers, first=first, last=last, loss_fn=_ce, fused_attention=fused,
                                      optimizer=torch.optim.AdamW(m.parameters(), lr=1e-5), **kw)
        try:
            first_loss = float(stack.train_step(x, y))
        except Exception as e:                             # e.g. the saved residuals exhaust device memory
            row = dict(tag, row="stack_" + name, error=f"{type(e).__name__}: {str(e)[:160]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
            del stack, m
            continue
        first_s = time.perf_counter() - t0
        t = median_time(lambda: stack.train_step(x, y), args.steps, lambda: None)
        row = dict(tag, row="stack_" + name, step_s=t, tflops=tag["model_flops"] / t / 1e12,
                   first_step_s=first_s, first_loss=first_loss,
                   offloaded_gib=stack.runtime.offloaded_activation_nbytes / 2 ** 30)
        if stack.schedule is not None:
            row.update(chosen=stack.schedule.describe(), chosen_remat=stack.schedule.remat,
                       predicted_step_s=stack.schedule.step_s, budget_gib=stack.schedule.budget_bytes / 2 ** 30,
                       predicted_by_remat={str(r): t for r, t in stack.schedule.best_step_s_by_remat.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)
        del stack, m
    return rows


def _budget_bytes(args) -> int:
    """``--budget-gib``, else 90 % of what jax may allocate on device 0 (its ``bytes_limit``)."""
    if args.budget_gib:
        return int(args.budget_gib * 2 ** 30)
    import jax
    return int(0.9 * jax.devices()[0].memory_stats()["bytes_limit"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attn-shapes", default="2,32,8,4096 1,32,8,8192")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--saved-rows", action="store_true", help="also the step without remat, activations to "
                    "pinned_host, and the step the chooser picks under --budget-gib (remat or not)")
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="device-memory budget of the chosen row (default: 90 %% of jax's bytes_limit)")
    ap.add_argument("--step-shapes", default="4,2048 2,4096 8,4096 4,8192 16,4096 8,8192")
    ap.add_argument("--ckpt-tokens", type=int, default=32768, help="torch uses gradient checkpointing from here")
    ap.add_argument("--unfused-max-tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention_gpu.json"))
    args = ap.parse_args(argv)
    import torch
    res = {"device": torch.cuda.get_device_name(0), "args": vars(args), "attention": [], "steps": []}
    shapes = [tuple(map(int, sh.split(","))) for sh in args.step_shapes.split()]
    try:
        model_cpu = llama(args.d, args.f, args.layers, args.heads, args.kv_heads) if not args.skip_steps else None
        for b, s in ([] if args.skip_steps else shapes):       # torch first: jax then takes the memory
            res["steps"].append(torch_row(args, b, s, model_cpu))
        for shape in args.attn_shapes.split():
            attention_rows(*map(int, shape.split(",")), args.reps, res)
        for b, s in ([] if args.skip_steps else shapes):
            res["steps"] += stack_rows(args, b, s, model_cpu)
    finally:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    print(f"\n{res['device']}")
    for r in res["attention"]:
        print(f"attn {r['shape']} {r['case']:6s} torch fwd {r['torch_fwd_s'] * 1e3:7.3f} ms fwd+bwd "
              f"{r['torch_fwdbwd_s'] * 1e3:7.3f} | cudnn {r['cudnn_fwd_s'] * 1e3:7.3f} / {r['cudnn_fwdbwd_s'] * 1e3:7.3f} "
              f"(x{r['cudnn_fwd_s'] / r['torch_fwd_s']:.2f} / x{r['cudnn_fwdbwd_s'] / r['torch_fwdbwd_s']:.2f}, "
              f"err {r['cudnn_rel_err']:.1e})"
              + (f" | xla {r['xla_fwd_s'] * 1e3:7.3f} / {r['xla_fwdbwd_s'] * 1e3:7.3f}" if "xla_fwd_s" in r else ""))
    for r in res["steps"]:
        print(f"step B{r['b']} S{r['s']} {r['row']:18s} " + (f"{r['step_s']:.3f} s {r['tflops']:6.1f} TFLOP/s"
              + (f" first {r['first_step_s']:.1f} s" if "first_step_s" in r else "")
              + (f" chosen: {r['chosen']}" if "chosen" in r else "") if "step_s" in r else r["error"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
