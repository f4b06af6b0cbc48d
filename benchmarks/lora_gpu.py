#!/usr/bin/env python
"""LoRA fine-tuning through the stack on the GPU: the LoRA step against its link floor, the full
AdamW step and torch with PEFT on the device, all in one process.

The model: a ``transformers`` Llama (bf16, ``--d``/``--f``, ``--heads``/``--kv-heads``, ``--layers``,
vocab 32000; default the 8B-like D=4096, F=14336, 32/8 heads, 16 layers) wrapped by
``peft.get_peft_model`` with LoRA ``--r`` (default 16, alpha 2r, no dropout, peft's default
initialisation: fp32 adapters) on every projection. Rows per shape (``--shapes``, ``B,S`` pairs;
default 2 x 4096 and 8 x 4096 tokens):

* ``torch_peft`` / ``torch_peft_ckpt``: the PEFT model on the device, fused AdamW over its
  parameters, without (below ``--ckpt-tokens``; an out-of-memory error is recorded) and with
  gradient checkpointing (non-reentrant);
* ``stack_lora``: ``SwappedStack(causal_lm_stages(peft_model))`` with the default policy (remat);
* ``stack_lora_saved``: every stage streamed as in the default policy, but no remat (each layer's
  vjp residuals kept in device memory: the step the link floor bounds where they fit; up to
  ``--saved-max-tokens``, default 8192);
* ``stack_lora_chosen``: the same with ``budget_bytes`` (``--budget-gib``, default 90 % of what
  jax may allocate), as a user would: the first step measures the link and the layers and the
  chooser picks residency, prefetch depth and remat or kept residuals (the row names its choice;
  an 8B-like bf16 model fits an H100, so the chooser may keep every stage resident: nothing then
  crosses the link and the row has no floor);
* ``stack_full`` / ``stack_full_chosen``: the plain model, full AdamW, the same two policies.

Per row: the median step of ``--steps`` after one warm-up (the stack's first step timed from
construction), the policy that ran (``remat``, prefetch depth, resident stages), model TFLOP/s and,
for the stack, its floor from the link measured in bulk in the same process
(``attention_gpu.measure_link_bulk``, i.e. ``torch_stack.measure_bandwidth``) and ``step / floor``:

* ``floor_s`` (the target's): ``(2 x W + T + 2 x M + 2 x A) / h2d``, W = the streamed stages' weights
  (the frozen base and the adapters: a step brings them in for the forward and again for the
  backward), T = their trainable weights, which the update sends back, M = those weights' AdamW
  moments (in and out), A = offloaded activations (out and in; 0 unless the chooser offloads);
* ``schedule_floor_s``: the bytes the schedule moves (``attention_gpu.link_floor``'s rule, the
  weights kept across the forward-backward turn and for the next step not counted, T out instead
  of W), over the link's one-way and both-way rates: lower, so a stricter ratio.

Model FLOPs per step (recomputation not counted): full training ``6 N tokens``; LoRA ``4 N tokens
+ 6 n tokens`` (the frozen weights' forward and input gradient, no weight gradient; ``n`` the
adapter parameters); both plus causal attention's ``6 x layers x B x S^2 x D``. ``N``: the
non-embedding parameters. ``vs_torch`` divides a LoRA row's step by the fastest torch PEFT row's.
``--tiny`` runs a tiny shape on the CPU end to end (``tests/benchmarks_on_cpu/test_lora_gpu_cpu.py``).

    PYTHONPATH=/tmp/site:. python3 benchmarks/lora_gpu.py --out $OUT/lora_gpu.json
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import warnings

from attention_gpu import _batch, _budget_bytes, _ce, _device, _sync, llama, measure_link_bulk, torch_train_step
from step_timing import median_time

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS = ("torch_peft", "torch_peft_ckpt", "stack_lora", "stack_lora_saved", "stack_lora_chosen", "stack_full",
        "stack_full_chosen")


def lora_model(model, r: int, seed: int = 0):
    """``model`` (itself, changed in place) wrapped by ``peft.get_peft_model``: LoRA ``r`` on every projection."""
    import peft
    import torch
    torch.manual_seed(seed)
    return peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=PROJ))


def step_flops(model, b: int, s: int) -> float:
    """Model FLOPs of one training step of ``model`` (a PEFT model or not) on ``b x s`` tokens (module docstring)."""
    cfg = getattr(model, "get_base_model", lambda: model)().config
    named = [(n, p) for n, p in model.named_parameters() if "embed_tokens" not in n]
    frozen = sum(p.numel() for _, p in named if not p.requires_grad)
    trained = sum(p.numel() for _, p in named if p.requires_grad)
    return 4 * frozen * b * s + 6 * trained * b * s + 6 * cfg.num_hidden_layers * b * s * s * cfg.hidden_size


def floors(stack, link) -> dict:
    """The step's floors (module docstring) from the stack's weights, trainable leaves, moments and
    last schedule, and ``link`` (GB/s)."""
    import jax
    rt = stack.runtime
    streamed = [j for j in range(rt.num_stages) if not rt.resident[j]]   # a resident stage moves nothing
    W = sum(rt.stage_nbytes[j] for j in streamed)
    T = sum(a.nbytes for j in streamed
            for a, m in zip(jax.tree_util.tree_leaves(rt.host_params[j]), rt.trainable_mask[j]) if m)
    M = sum(rt.optimizer_state_nbytes[j] for j in streamed) \
        if rt.optimizer is not None and rt.optimizer_state_on_host else 0
    A = rt.offloaded_activation_nbytes
    w_in = sum(rt.stage_nbytes[j] for st in rt.last_schedule.timeline for j in st.fetch + st.fetch_next)
    h2d, d2h, both = (g * 1e9 for g in (link.h2d_gbps, link.d2h_gbps, link.both_gbps))
    return {"w_bytes": W, "trainable_bytes": T, "m_bytes": M, "act_bytes": A, "w_in_bytes": w_in,
            "link_gbps": [link.h2d_gbps, link.d2h_gbps, link.both_gbps],
            "floor_s": (2 * W + T + 2 * M + 2 * A) / h2d,
            "schedule_floor_s": max((w_in + M + A) / h2d, (T + M + A) / d2h, (w_in + T + 2 * M + 2 * A) / both)}


def policy_of(stack) -> dict:
    """What ran: remat, prefetch depth, resident and offloaded stages; the chooser's pick where it chose."""
    rt = stack.runtime
    out = {"remat": rt.remat is True, "prefetch_depth": rt.prefetch_depth, "resident_stages": sum(rt.resident),
           "offload_activations": rt.offload_activations}
    if stack.schedule is not None:
        out.update(chosen=stack.schedule.describe(), predicted_step_s=stack.schedule.step_s,
                   budget_gib=stack.schedule.budget_bytes / 2 ** 30,
                   predicted_by_remat={str(r): p for r, p in stack.schedule.best_step_s_by_remat.items()})
    return out


def torch_row(args, b, s, peft_cpu, ckpt: bool) -> dict:
    """The PEFT model on the device: fused AdamW over its parameters (torch skips the frozen ones), with
    or without gradient checkpointing."""
    import torch
    x, y = _batch(b, s)
    dev = _device()
    m = opt = None
    try:
        m = copy.deepcopy(peft_cpu).to(dev)
        if ckpt:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)   # renamed activation_checkpointing_enable in 5.2x
                m.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5, fused=dev.type == "cuda")
        xc, yc = x.to(dev), y.to(dev)
        losses = []
        step = torch_train_step(lambda: m(input_ids=xc).logits, yc, opt, losses)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = median_time(step, args.steps, _sync)
        row = dict(step_s=t, first_loss=float(losses[0]), remat=ckpt,
                   peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if dev.type == "cuda" else None)
    except torch.OutOfMemoryError as e:
        row = {"error": f"OOM: {str(e)[:80]}"}
    del m, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def stack_row(args, b, s, model_cpu, link, kind: str) -> dict:
    """One ``SwappedStack`` row: a copy of ``model_cpu`` (a PEFT model or not) with a torch AdamW over its
    parameters; ``kind``: the default policy (``""``), ``"saved"`` (no remat) or ``"chosen"``
    (``budget_bytes``); its first step timed from construction."""
    import torch
    import xla_swap
    from xla_swap.planning import OffloadPolicy
    x, y = _batch(b, s)
    t0 = time.perf_counter()
    m = copy.deepcopy(model_cpu)
    first, layers, last = xla_swap.causal_lm_stages(m)
    kw = {"chosen": {"budget_bytes": _budget_bytes(args)} if kind == "chosen" else {},
          "saved": {"policy": OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=False,
                                            prefetch_depth=2)}, "": {}}[kind]
    stack = xla_swap.SwappedStack(layers, first=first, last=last, loss_fn=_ce,
                                  optimizer=torch.optim.AdamW(m.parameters(), lr=1e-5), **kw)
    first_loss = float(stack.train_step(x, y))
    first_s = time.perf_counter() - t0
    t = median_time(lambda: stack.train_step(x, y), args.steps, lambda: None)
    row = dict(step_s=t, first_step_s=first_s, first_loss=first_loss, **policy_of(stack), **floors(stack, link))
    for key in ("floor_s", "schedule_floor_s"):   # no floor where every stage is resident (nothing moves)
        row["ratio_to_" + key[:-2]] = t / row[key] if row[key] else None
    del stack, first, layers, last, m
    gc.collect()
    return row


def compare(rows: list) -> list:
    """Each LoRA stack row against the fastest torch PEFT row of its shape (``vs_torch``) and the checkpointed one."""
    for r in rows:
        if not r["row"].startswith("stack_lora") or "step_s" not in r:
            continue
        tr = [q for q in rows if q["row"].startswith("torch") and q["tokens"] == r["tokens"] and "step_s" in q]
        if tr:
            best = min(tr, key=lambda q: q["step_s"])
            r.update(torch_row=best["row"], vs_torch=r["step_s"] / best["step_s"])
            ck = [q for q in tr if q["row"] == "torch_peft_ckpt"]
            if ck:
                r["vs_torch_ckpt"] = r["step_s"] / ck[0]["step_s"]
    return rows


def run(args, res: dict) -> None:
    """Every row of every shape into ``res["rows"]`` (torch first: jax then takes the device's memory)."""
    rows = [r for r in args.rows.split(",") if r]
    shapes = [tuple(map(int, sh.split(","))) for sh in args.shapes.split()]
    model_cpu = llama(args.d, args.f, args.layers, args.heads, args.kv_heads)
    peft_cpu = lora_model(copy.deepcopy(model_cpu), args.r)
    res["adapter_params"] = sum(p.numel() for p in peft_cpu.parameters() if p.requires_grad)
    res["frozen_params"] = sum(p.numel() for p in peft_cpu.parameters() if not p.requires_grad)

    def add(name, b, s, row):
        flops = step_flops(peft_cpu if "lora" in name or "peft" in name else model_cpu, b, s)
        row = dict({"row": name, "b": b, "s": s, "tokens": b * s, "model_flops": flops}, **row)
        if "step_s" in row:
            row["tflops"] = flops / row["step_s"] / 1e12
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    for b, s in shapes:
        for name, ckpt in (("torch_peft", False), ("torch_peft_ckpt", True)):
            if name in rows and (ckpt or b * s < args.ckpt_tokens):
                add(name, b, s, torch_row(args, b, s, peft_cpu, ckpt))
    if not any(r.startswith("stack") for r in rows):
        return
    link = measure_link_bulk(int(args.link_gib * 2 ** 30))
    res["link_gbps"] = [link.h2d_gbps, link.d2h_gbps, link.both_gbps]
    print(json.dumps({"link_gbps": res["link_gbps"]}), flush=True)
    for b, s in shapes:
        for name in [r for r in rows if r in ROWS[2:]]:   # in the order given
            if name in rows and (name != "stack_lora_saved" or b * s <= args.saved_max_tokens):
                src = peft_cpu if "lora" in name else model_cpu
                try:
                    row = stack_row(args, b, s, src, link, name.split("_")[2] if name.count("_") == 2 else "")
                except Exception as e:   # e.g. a schedule that exhausts host or device memory
                    row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                add(name, b, s, row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--r", type=int, default=16, help="LoRA rank")
    ap.add_argument("--shapes", default="2,4096 8,4096", help="B,S pairs")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows to run, of {', '.join(ROWS)}")
    ap.add_argument("--ckpt-tokens", type=int, default=32768, help="below this many tokens torch also runs without "
                    "gradient checkpointing")
    ap.add_argument("--saved-max-tokens", type=int, default=8192, help="stack_lora_saved up to this many tokens (every "
                    "layer's residuals in device memory)")
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="device-memory budget of the chosen rows (default: 90 %% of jax's bytes_limit)")
    ap.add_argument("--link-gib", type=float, default=4.0, help="bytes of the bulk link measurement (GiB)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (D=64, 2 layers, r=4, 1 x 64 tokens): the CPU check")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "lora_gpu.json"))
    args = ap.parse_args(argv)
    if args.tiny:
        args.d, args.f, args.layers, args.heads, args.kv_heads, args.r = 64, 128, 2, 4, 2, 4
        args.shapes, args.ckpt_tokens, args.steps = "1,64", 1000, 1
        args.link_gib, args.budget_gib = 0.25, args.budget_gib or 4.0
    import torch
    res = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "args": vars(args),
           "rows": []}
    try:
        run(args, res)
        compare(res["rows"])
    finally:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
    print(f"\n{res['device']}")
    for r in res["rows"]:
        print(f"B{r['b']} S{r['s']} {r['row']:18s} " + (r["error"] if "step_s" not in r else
              f"{r['step_s']:.3f} s {r['tflops']:6.1f} TFLOP/s remat={r['remat']}"
              + (f" floor {r['floor_s']:.3f} s (x{r['ratio_to_floor'] or 0:.3f}; schedule floor "
                 f"{r['schedule_floor_s']:.3f} s, x{r['ratio_to_schedule_floor'] or 0:.3f})" if "floor_s" in r else "")
              + (f" x{r['vs_torch']:.3f} torch ({r['torch_row']})" if "vs_torch" in r else "")
              + (f" first {r['first_step_s']:.1f} s" if "first_step_s" in r else "")
              + (f" chosen: {r['chosen']}" if "chosen" in r else "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
