#!/usr/bin/env python
"""Fused attention through the stack on the GPU: kernels alone, then Llama training steps,
each against torch on the device in the same run.

Part A, attention alone (bf16, head dimension 128, grouped-query K/V): torch's fused SDPA
against the same torch call run through the stack's GPU torchax environment
(``xla_swap.stack.torch_attention``: cuDNN) and through torchax's default environment (XLA's unfused
form), forward and forward+backward (gradients of q, k, v); the relative error of each against
torch's output, and of its q, k, v gradients (the largest). Each figure is the median over
``--reps`` samples of the time per call of ``--window`` calls issued back to back and synced
once (the device's time per call, as inside a layer's executable; a sync per call would add the
host's launch latency). Cases:

* ``causal``: torch's ``[B, N, T, H]`` contiguous tensors (the stack transposes them to cuDNN's
  ``[B, T, N, H]`` and back: two layout copies torch does not make);
* ``causal_hf``: as a ``transformers`` layer calls it (``[B, T, N, H]`` projections transposed in,
  the output transposed back and made contiguous), where those layout changes cancel;
* ``mask``: ``causal_hf``'s layout with the boolean ``[B, 1, T, S]`` mask transformers' ``sdpa_mask``
  builds for a left-padded batch (:func:`attention_masks`);
* ``mask_float``: an additive ``[1, 1, S, S]`` causal mask on ``[B, N, T, H]`` tensors, not
  differentiated (the stack's backward leaves the mask's gradient off).

Part B, a ``transformers`` Llama (bf16, ``--d``/``--f``, ``--heads``/``--kv-heads``, ``--layers``):
torch on the device (SDPA; forward+backward, then the fused AdamW step; gradient checkpointing
where ``--ckpt-tokens`` says or where without it runs out of memory) against ``SwappedStack``
(weights, gradients, AdamW moments in ``pinned_host``, default policy, fused attention): the AdamW
step (``stack_cudnn``), forward+backward with the gradients to ``pinned_host`` and no optimizer
(``stack_cudnn_fwdbwd``), the AdamW step with XLA's attention (``stack_xla``, up to
``--unfused-max-tokens``); with ``--saved-rows`` (up to ``--saved-max-tokens``) also without remat
(``stack_cudnn_saved``: each layer's input and vjp residuals to ``pinned_host``) and under
``budget_bytes`` (``--budget-gib``) the schedule the chooser picks, remat or not, after measuring
the link and the layers (``stack_cudnn_chosen``, naming its choice).

Each step row: the median step time of ``--steps`` steps after one warm-up; for the stack the
first step's time from construction (compilation included; with ``--compilation-cache`` a second
run reads the executables the first wrote), the link floor of its schedule
(:func:`link_floor`, the link measured in the run) and the ratios of :func:`compare` (to torch, to
the floor, which bounds the step); model TFLOP/s = (6 x non-embedding parameters x tokens + 6 x
layers x batch x seq^2 x d) / step: the 6ND rule (Kaplan et al. 2020, training = 3 x forward)
plus causal attention's score and value products (half of 12 x L x B x S^2 x D), recomputation
not counted. Without a GPU everything runs on the CPU (a smoke test of the script). With
``--saved-rows`` on the 8B-like shape set ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=100`` before it starts:
the offloaded activations pass PJRT GPU's default pinned host pool of 64 GiB.

    PYTHONPATH=/tmp/site:. python3 benchmarks/attention_gpu.py --out $OUT/attention_gpu.json
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time

from step_timing import median_time, median_window_time


def _device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def attention_masks(b, s, dev):
    """The two masks of the masked cases, ``[B, 1, S, S]`` / ``[1, 1, S, S]``.

    ``mask``: boolean, as transformers' ``sdpa_mask`` builds it for a left-padded batch (sequence 0
    padded by ``S // 8``, the others not): causal and the padding, with the rows left without a
    key given every key (the fix transformers applies for torch's kernels). ``mask_float``: an
    additive causal mask (0 / the dtype's min), as older models build it.
    """
    import torch
    i = torch.arange(s, device=dev)
    pad = torch.zeros(b, dtype=torch.long, device=dev)
    pad[0] = s // 8
    keep = (i[None, :, None] >= i[None, None, :]) & (i[None, None, :] >= pad[:, None, None])
    keep = keep | ~keep.any(-1, keepdim=True)
    add = torch.full((s, s), torch.finfo(torch.bfloat16).min, device=dev, dtype=torch.bfloat16).triu(1)[None, None]
    return keep[:, None], add


def torch_kernels(fn) -> list:
    """Names of the GPU kernels one call of ``fn`` launches (torch's profiler), e.g. which SDPA backend ran."""
    import torch
    if not torch.cuda.is_available():
        return []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    return sorted({e.name[:120] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def hlo_summary(text: str) -> dict:
    """Of an optimized HLO module's entry computation: the custom-call targets and how many
    transposes, copies and fusions it runs (layout changes around a kernel show as these)."""
    import re
    entry = text[text.index("ENTRY"):]
    return {"custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))),
            **{op: len(re.findall(rf"= \S+ {op}\(", entry)) for op in ("transpose", "copy", "fusion")}}


def attention_rows(b, n, kv, s, reps, window, res):
    import jax
    import torch
    from xla_swap.stack import torch_attention
    from xla_swap._compat.torchax import import_torchax
    F = torch.nn.functional
    dev = _device()
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, n, s, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, kv, s, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    mask, add = attention_masks(b, s, dev)
    fns = {"causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
           # as a transformers layer calls it: q/k/v projected as [B, T, N, H], transposed to SDPA's
           # [B, N, T, H] and the output transposed back and made contiguous (sdpa_attention_forward)
           "causal_hf": lambda q, k, v: F.scaled_dot_product_attention(
               q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
               enable_gqa=True).transpose(1, 2).contiguous(),
           "mask": lambda q, k, v, m: F.scaled_dot_product_attention(
               q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m,
               enable_gqa=True).transpose(1, 2).contiguous(),
           "mask_float": lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)}
    hf = tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))
    for case, fn in fns.items():
        args = {"causal": (q, k, v), "causal_hf": hf, "mask": hf + (mask,), "mask_float": (q, k, v, add)}[case]
        ref = fn(*args)
        row = {"shape": [b, n, kv, s], "case": case, "window": window}
        row["torch_fwd_s"] = median_window_time(lambda: fn(*args), reps, window, _sync)
        row["torch_fwd_kernels"] = torch_kernels(lambda: fn(*args))
        qg, kg, vg = (t.clone().requires_grad_(True) for t in args[:3])
        gargs = (qg, kg, vg) + args[3:]
        row["torch_fwdbwd_s"] = median_window_time(
            lambda: torch.autograd.grad(fn(*gargs).sum(), (qg, kg, vg)), reps, window, _sync)
        ref_grads = torch.autograd.grad(fn(*gargs).float().sum(), (qg, kg, vg))
        jargs = [jax.dlpack.from_dlpack(t) for t in args]
        for name, env in (("cudnn", torch_attention.torchax_env("gpu")), ("xla", import_torchax().default_env())):
            if name == "xla" and s > 4096:
                continue

            def f(*a, env=env, fn=fn):
                with env:
                    return env.t2j_iso(fn(*env.j2t_iso(a)))
            fwd = jax.jit(f)
            fb = jax.jit(lambda *a, f=f: jax.grad(lambda *a: f(*a).astype("float32").sum(), argnums=(0, 1, 2))(*a))
            out_t = torch.from_dlpack(fwd(*jargs))
            row[f"{name}_fwd_hlo"] = hlo_summary(fwd.lower(*jargs).compile().as_text())
            row[f"{name}_grad_rel_err"] = max(float((torch.from_dlpack(gj).float() - gt.float()).norm() / gt.float().norm())
                                             for gj, gt in zip(fb(*jargs), ref_grads))
            row[f"{name}_rel_err"] = float((out_t.float() - ref.float()).norm() / ref.float().norm())
            last = [None]
            jsync = lambda: jax.block_until_ready(last[0])  # noqa: E731
            row[f"{name}_fwd_s"] = median_window_time(lambda: last.__setitem__(0, fwd(*jargs)), reps, window, jsync)
            row[f"{name}_fwdbwd_s"] = median_window_time(lambda: last.__setitem__(0, fb(*jargs)), reps, window, jsync)
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


def torch_train_step(logits_fn, y, opt, losses: list):
    """A torch training step ``() -> None``: cross-entropy of ``logits_fn()`` against ``y``, backward, the
    optimizer's step, gradients dropped; each loss appended (detached) to ``losses``."""
    def step():
        loss = _ce(logits_fn(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return step


def _tag(args, b, s, model_cpu):
    return {"b": b, "s": s, "tokens": b * s, "layers": args.layers, "d": args.d, "f": args.f,
            "heads": args.heads, "kv_heads": args.kv_heads,
            "model_flops": model_flops(model_cpu, b, s)}


def torch_rows(args, b, s, model_cpu) -> list:
    """torch on the device: forward+backward (``fwdbwd_s``) and the fused AdamW step (``step_s``),
    with gradient checkpointing (``torch_device_ckpt``) and, below ``--ckpt-tokens``, also without
    (``torch_device``; an out-of-memory error is recorded as the row's ``error``)."""
    import torch
    x, y = _batch(b, s)
    tag = _tag(args, b, s, model_cpu)
    dev = _device()
    rows = []
    for ckpt in ((False, True) if b * s < args.ckpt_tokens else (True,)):
        m = opt = None
        name = "torch_device" + ("_ckpt" if ckpt else "")
        try:
            m = copy.deepcopy(model_cpu).to(dev)
            if ckpt:
                m.gradient_checkpointing_enable()
            m.train()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=dev.type == "cuda")
            xc, yc = x.to(dev), y.to(dev)
            losses = []

            def fwdbwd():
                _ce(m(xc).logits, yc).backward()
                m.zero_grad(set_to_none=True)

            step = torch_train_step(lambda: m(xc).logits, yc, opt, losses)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            tb = median_time(fwdbwd, args.steps, _sync)
            t = median_time(step, args.steps, _sync)
            row = dict(tag, row=name, step_s=t, fwdbwd_s=tb, tflops=tag["model_flops"] / t / 1e12,
                       fwdbwd_tflops=tag["model_flops"] / tb / 1e12, first_loss=float(losses[0]),
                       peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if dev.type == "cuda" else None)
        except torch.OutOfMemoryError as e:
            row = dict(tag, row=name, error=f"OOM: {str(e)[:80]}")
        del m, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def measure_link_bulk(nbytes: int = 4 << 30, reps: int = 3):
    """The link as a whole step's traffic sees it: ``nbytes`` in 256 MiB ``pinned_host`` arrays
    moved by ``torch_stack.measure_bandwidth`` (to the device, back, both at once; best of ``reps``
    after a warm-up round), as an ``xla_swap.planning.Link`` (GB/s). One stage's weights
    (``calibrate.measure_link``) read 49-51 GB/s each way and 52-72 GB/s both ways on an H100,
    below what a training step's copies reach."""
    import jax
    import jax.numpy as jnp
    from torch_stack import measure_bandwidth
    from xla_swap.planning.costs import Link
    n = max(1, nbytes // (256 << 20))
    host_kind = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    host = jax.block_until_ready([jax.device_put(jnp.zeros((128 << 20,), jnp.bfloat16) + i, host_kind)
                                  for i in range(n)])
    bw = measure_bandwidth(host, reps + 1)
    del host
    return Link(h2d_gbps=bw["h2d"] / 1e9, d2h_gbps=bw["d2h"] / 1e9, both_gbps=bw["both"] / 1e9)


def link_floor(stack, link) -> dict:
    """Seconds the link needs per step of ``stack``'s last schedule (steady state).

    Bytes: ``w_in`` = the weights its schedule fetches in a call (every pass's and the next call's);
    ``W`` = the streamed stages' weights (gradients out of the backward, updated weights out of an
    AdamW step: same dtype); ``M`` = the optimizer state in ``pinned_host`` (in and out; 0 without
    an optimizer); ``A`` = the activations offloaded in the call (out in the forward, in for the
    backward). The floor is the largest of the one-way times and of both directions at once
    (``link`` in GB/s, measured in the run): ``max((w_in+M+A)/h2d, (W+M+A)/d2h, (w_in+W+2M+2A)/both)``.
    """
    rt, sched = stack.runtime, stack.runtime.last_schedule
    nb = rt.stage_nbytes
    w_in = sum(nb[j] for st in sched.timeline for j in st.fetch + st.fetch_next)
    W = sum(nb[j] for j in range(rt.num_stages) if not rt.resident[j])
    M = sum(rt.optimizer_state_nbytes) if rt.optimizer is not None and rt.optimizer_state_on_host else 0
    A = rt.offloaded_activation_nbytes
    h2d, d2h, both = (g * 1e9 for g in (link.h2d_gbps, link.d2h_gbps, link.both_gbps))
    return {"w_in_bytes": w_in, "w_bytes": W, "m_bytes": M, "act_bytes": A,
            "link_gbps": [link.h2d_gbps, link.d2h_gbps, link.both_gbps],
            "floor_s": max((w_in + M + A) / h2d, (W + M + A) / d2h, (w_in + W + 2 * M + 2 * A) / both)}


def stack_rows(args, b, s, model_cpu, link):
    """The stack's rows at ``(b, s)`` (module docstring), each judged against ``link`` (GB/s)."""
    import xla_swap
    from xla_swap.planning.policy import OffloadPolicy
    tag = _tag(args, b, s, model_cpu)
    # remat (the default policy) or, for "saved", no recompute: every stage's input and vjp
    # residuals go to pinned_host in the forward and come back for the backward
    saved = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=False, prefetch_depth=2)
    # (row, fused attention, whether an optimizer, keywords): "fwdbwd" has no optimizer and keeps
    # the gradients in pinned_host (last_grads) rather than adding them to the modules' .grad
    variants = [("cudnn", True, True, {}),
                ("cudnn_fwdbwd", True, False, {"training": xla_swap.TrainingConfig(accumulate_grads=False)})]
    if b * s <= args.unfused_max_tokens:
        variants.append(("xla", False, True, {}))
    if args.saved_rows and b * s <= args.saved_max_tokens:
        variants.append(("cudnn_saved", True, True,
                         {"policy": saved, "training": xla_swap.TrainingConfig(offload_activations=True)}))
        # the chooser's pick under a budget (remat or kept residuals, docs/reference/planner.md "Remat or
        # residuals"): the first step measures the link and the layers, then runs the choice
        variants.append(("cudnn_chosen", True, True, {"budget_bytes": _budget_bytes(args)}))
    rows = []
    for name, fused, with_opt, kw in variants:
        if args.stack_rows and name not in args.stack_rows.split(","):
            continue
        try:                                # e.g. saved residuals that exhaust host or device memory
            row = stack_row(args, b, s, model_cpu, link, fused, with_opt, kw)
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(dict(tag, row="stack_" + name, **row))
        print(json.dumps(rows[-1]), flush=True)
        gc.collect()
    return rows


def stack_row(args, b, s, model_cpu, link, fused, with_opt, kw) -> dict:
    """One ``SwappedStack`` row at ``(b, s)``: built from a copy of ``model_cpu`` (``fused``
    attention, a torch AdamW if ``with_opt``, constructor keywords ``kw``), its first step timed
    from construction, then the median of ``--steps`` steps, beside its link floor (GB/s ``link``)."""
    import torch
    import xla_swap
    x, y = _batch(b, s)
    flops = model_flops(model_cpu, b, s)
    t0 = time.perf_counter()
    m = copy.deepcopy(model_cpu)
    first, layers, last = xla_swap.causal_lm_stages(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5) if with_opt else None
    stack = xla_swap.SwappedStack(layers, first=first, last=last, loss_fn=_ce,
                                  compilation=xla_swap.CompileConfig(fused_attention=fused),
                                  optimizer=opt, **kw)
    first_loss = float(stack.train_step(x, y))
    first_s = time.perf_counter() - t0
    m.to("meta")                                           # the stack holds its own copies (host memory)
    t = median_time(lambda: stack.train_step(x, y), args.steps, lambda: None)
    row = dict(step_s=t, tflops=flops / t / 1e12, first_step_s=first_s, first_loss=first_loss,
               offloaded_gib=stack.runtime.offloaded_activation_nbytes / 2 ** 30, **link_floor(stack, link))
    row["ratio_to_floor"] = t / row["floor_s"] if row["floor_s"] else None
    if stack.schedule is not None:
        row.update(chosen=stack.schedule.describe(), chosen_remat=stack.schedule.remat,
                   predicted_step_s=stack.schedule.step_s, budget_gib=stack.schedule.budget_bytes / 2 ** 30,
                   predicted_by_remat={str(r): p for r, p in stack.schedule.best_step_s_by_remat.items()})
    return row


def compare(steps: list) -> list:
    """Each stack row against torch's rows of its shape: ``vs_torch`` against the fastest torch row
    that ran (the AdamW step against its step, fwd+bwd against its fwd+bwd), ``vs_torch_ckpt``
    against torch with gradient checkpointing (the recompute the stack's remat also does);
    ``bound``: ``"link"`` where the link floor is above torch's checkpointed time, else
    ``"compute"``; ``target_ratio``: the ratio the issue bounds, to the floor where link-bound, to
    torch with checkpointing where compute-bound."""
    by_shape: dict = {}
    for r in steps:
        if r["row"].startswith("torch") and "step_s" in r:
            by_shape.setdefault((r["b"], r["s"]), {})[r["row"]] = r
    for r in steps:
        tr = by_shape.get((r["b"], r["s"]))
        if not r["row"].startswith("stack") or "step_s" not in r or not tr:
            continue
        key = "fwdbwd_s" if r["row"].endswith("fwdbwd") else "step_s"
        best = min(tr.values(), key=lambda q: q[key])
        ck = tr.get("torch_device_ckpt", best)
        r.update(torch_row=best["row"], vs_torch=r["step_s"] / best[key], vs_torch_ckpt=r["step_s"] / ck[key])
        r["bound"] = "link" if r["floor_s"] > ck[key] else "compute"
        r["target_ratio"] = r["ratio_to_floor"] if r["bound"] == "link" else r["vs_torch_ckpt"]
    return steps


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
    ap.add_argument("--ckpt-tokens", type=int, default=32768, help="below this many tokens torch also runs without checkpointing")
    ap.add_argument("--unfused-max-tokens", type=int, default=8192)
    ap.add_argument("--saved-max-tokens", type=int, default=8192,
                    help="the --saved-rows up to this many tokens (the residuals of every layer go to host memory)")
    ap.add_argument("--link-gib", type=float, default=4.0, help="bytes of the link measurement (GiB)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--window", type=int, default=20, help="back-to-back attention calls per timed sample")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--torch-only", action="store_true", help="of the step rows, torch's alone")
    ap.add_argument("--no-torch", action="store_true", help="of the step rows, the stack's alone")
    ap.add_argument("--stack-rows", default="", help="comma-separated stack rows to run (cudnn, cudnn_fwdbwd, "
                    "xla, cudnn_saved, cudnn_chosen; default all that apply)")
    ap.add_argument("--compilation-cache", default=None, help="a directory: xla_swap.use_compilation_cache "
                    "before the stack rows (the first step of a second run reads the executables)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention_gpu.json"))
    args = ap.parse_args(argv)
    import torch
    res = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "args": vars(args),
           "attention": [], "steps": []}
    shapes = [tuple(map(int, sh.split(","))) for sh in args.step_shapes.split()]
    try:
        model_cpu = llama(args.d, args.f, args.layers, args.heads, args.kv_heads) if not args.skip_steps else None
        for b, s in ([] if args.skip_steps or args.no_torch else shapes):   # torch first: jax then takes the memory
            res["steps"] += torch_rows(args, b, s, model_cpu)
        for shape in args.attn_shapes.split():
            attention_rows(*map(int, shape.split(",")), args.reps, args.window, res)
        if shapes and not args.skip_steps and not args.torch_only:
            if args.compilation_cache:
                import xla_swap
                res["compilation_cache_before"] = xla_swap.use_compilation_cache(args.compilation_cache)
                res["compilation_cache_files"] = len(os.listdir(args.compilation_cache))
            link = measure_link_bulk(int(args.link_gib * 2 ** 30))
            res["link_gbps"] = [link.h2d_gbps, link.d2h_gbps, link.both_gbps]
            print(json.dumps({"link_gbps": res["link_gbps"]}), flush=True)
            for b, s in shapes:
                res["steps"] += stack_rows(args, b, s, model_cpu, link)
        compare(res["steps"])
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
              + (f" fwd+bwd {r['fwdbwd_s']:.3f} s" if "fwdbwd_s" in r else "")
              + (f" floor {r['floor_s']:.3f} s (x{r['ratio_to_floor']:.3f}) x{r['vs_torch']:.3f} torch"
                 f" x{r['vs_torch_ckpt']:.3f} torch ckpt, {r['bound']}-bound"
                 if "vs_torch" in r else "")
              + (f" first {r['first_step_s']:.1f} s" if "first_step_s" in r else "")
              + (f" chosen: {r['chosen']}" if "chosen" in r else "") if "step_s" in r else r["error"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
