#!/usr/bin/env python
"""torch whole beside ``SwappedStack`` on the GPU, and torch's fp32 matmul setting honoured.

One process, in this order:

1. torch alone on the device: an MLP's forward and backward (CUDA autograd), one FSDP2
   ``fully_shard`` step (world size 1) and a ``torch.compile``-d forward and backward;
2. a ``SwappedStack`` over a ``transformers`` Llama: forward and two AdamW ``train_step``s;
3. step 1 again on freshly seeded copies: every call must succeed and give bitwise the same
   loss and gradients as before the stack ran;
4. precision: an fp32 Llama (``--d``, ``--layers``) in torch on the device with TF32 off is the
   reference; the stack's logits with TF32 off must be within ``1e-5`` (relative Frobenius
   norm) of it; with TF32 on (``torch.backends.cuda.matmul.fp32_precision = "tf32"``) both
   torch and the stack move away by the same order (TF32's ~1e-3);
5. the cost of the mapping on bf16 work: a bf16 ``[T, D] @ [D, F]`` matmul timed under jax's
   ``highest`` and ``default`` precision (medians of 20; the setting applies to 32-bit operands,
   so the two should be equal).

Prints a table and writes JSON to ``--out`` (default ``$OUT/torch_interop_gpu.json``). Exit
status 1 if any check fails. On a machine without CUDA it runs on the CPU (gloo for FSDP2,
no ``torch.compile``) as a smoke test of the script.

    PYTHONPATH=/tmp/site:. python3 benchmarks/torch_interop_gpu.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _mlp(seed, dev):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(dev)


def torch_alone(dev, compile_ok: bool) -> dict:
    """Loss and gradient sums of CUDA autograd, an FSDP2 step and a compiled step (seeded)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    out = {}
    m = _mlp(0, dev)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(dev)
    loss = m(x).square().mean()
    loss.backward()
    out["autograd"] = [loss.item(), sum(p.grad.double().sum().item() for p in m.parameters())]

    m = _mlp(0, dev)
    fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    out["fsdp2"] = [loss.item(), sum(p.full_tensor().double().sum().item() for p in m.parameters())]

    if compile_ok:
        m = _mlp(0, dev)
        f = torch.compile(m)
        loss = f(x).square().mean()
        loss.backward()
        out["compile"] = [loss.item(), sum(p.grad.double().sum().item() for p in m.parameters())]
    return out


def llama(d, layers, dtype, seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=1024, hidden_size=d, intermediate_size=int(d * 3.5) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=max(1, d // 128),
                      num_key_value_heads=max(1, d // 512), max_position_embeddings=2048,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "torch_interop_gpu.json"))
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    res: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "checks": {}}
    checks = res["checks"]

    # 1. torch alone
    res["before"] = torch_alone(dev, compile_ok=cuda)

    # 2. the stack
    import xla_swap
    m = llama(256, 2, torch.bfloat16 if cuda else torch.float32)
    first, layers, last = xla_swap.causal_lm_stages(m)
    ce = lambda lo, y: torch.nn.functional.cross_entropy(lo.flatten(0, 1).float(), y.flatten())  # noqa: E731
    stack = xla_swap.SwappedStack(layers, first=first, last=last, loss_fn=ce,
                                  optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3))
    ids = torch.randint(0, 1024, (2, 65), generator=torch.Generator().manual_seed(2))
    stack(ids[:, :-1])
    res["stack_losses"] = [float(stack.train_step(ids[:, :-1], ids[:, 1:])) for _ in range(2)]
    checks["stack ran"] = all(l == l for l in res["stack_losses"])

    # 3. torch alone again
    res["after"] = torch_alone(dev, compile_ok=cuda)
    checks["torch unchanged after the stack"] = res["before"] == res["after"]
    checks["privateuse1 unregistered"] = torch._C._get_privateuse1_backend_name() == "privateuseone"

    # 4. precision
    mm = torch.backends.cuda.matmul
    saved = mm.fp32_precision
    ref_model = llama(args.d, args.layers, torch.float32, seed=3)
    x = torch.randint(0, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        gpu_model = ref_model.to(dev)
        mm.fp32_precision = "ieee"
        ref = gpu_model(x.to(dev)).logits.float().cpu()
        mm.fp32_precision = "tf32"
        torch_tf32 = gpu_model(x.to(dev)).logits.float().cpu()
        gpu_model.cpu()
    first, layers, last = xla_swap.causal_lm_stages(ref_model)
    stack = xla_swap.SwappedStack(layers, first=first, last=last)
    mm.fp32_precision = "ieee"
    stack_fp32 = stack(x).float()
    mm.fp32_precision = "tf32"
    stack_tf32 = stack(x).float()
    mm.fp32_precision = saved
    res["precision"] = {"torch_tf32_vs_fp32": rel(torch_tf32, ref), "stack_fp32_vs_torch_fp32": rel(stack_fp32, ref),
                        "stack_tf32_vs_torch_fp32": rel(stack_tf32, ref)}
    checks["stack fp32 within 1e-5 of torch fp32"] = res["precision"]["stack_fp32_vs_torch_fp32"] < 1e-5
    if cuda:
        t, s = res["precision"]["torch_tf32_vs_fp32"], res["precision"]["stack_tf32_vs_torch_fp32"]
        checks["stack tf32 moves like torch tf32 (0.2x-5x)"] = 0.2 * t < s < 5 * t

    # 5. bf16 matmul under both settings
    import jax
    import jax.numpy as jnp
    T, D, F = (8192, 4096, 14336) if cuda else (256, 256, 512)
    a = jnp.ones((T, D), jnp.bfloat16)
    b = jnp.ones((D, F), jnp.bfloat16)
    times = {}
    for p in ("highest", "default"):
        with jax.default_matmul_precision(p):
            f = jax.jit(lambda a, b: a @ b)
            jax.block_until_ready(f(a, b))
            ts = []
            for _ in range(20 if cuda else 2):
                t0 = time.perf_counter()
                jax.block_until_ready(f(a, b))
                ts.append(time.perf_counter() - t0)
        times[p] = statistics.median(ts)
    res["bf16_matmul_s"] = times
    res["bf16_matmul_tflops"] = {p: 2 * T * D * F / t / 1e12 for p, t in times.items()}

    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"device: {res['device']}")
    print(f"torch before: {res['before']}\ntorch after:  {res['after']}")
    for k, v in res["precision"].items():
        print(f"{k:28s} {v:.3e}")
    for p, t in times.items():
        print(f"bf16 matmul {T}x{D}x{F} under {p:8s} {t * 1e3:8.3f} ms  {res['bf16_matmul_tflops'][p]:6.1f} TFLOP/s")
    for k, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {k}")
    dist.destroy_process_group()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
