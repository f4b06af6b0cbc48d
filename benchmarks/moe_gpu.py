#!/usr/bin/env python
"""A Mixtral-shaped mixture-of-experts model trained through the stack, both experts forms, beside torch on the device.

``transformers`` ``MixtralForCausalLM`` (``--dtype``, default bf16; ``--d`` / ``--f``,
``--num-experts`` experts, top ``--top-k``, 32/8 heads), one AdamW step per call on
``--batch`` x ``--seq`` tokens. One call gives, in this order:

1. ``torch_device``: the model at ``--compare-layers`` layers (default 2) on the GPU,
   ``torch.optim.AdamW(fused=True)``, transformers' default experts implementation (run before any
   jax work: jax preallocates the GPU's memory when it starts; freed before jax starts);
2. ``stack_<form>_<L>`` for each form of ``--experts`` (default ``dense,sorted``) at
   ``--compare-layers`` layers: ``SwappedStack`` over ``causal_lm_stages(model, experts=form)``
   (weights and bf16 AdamW moments in ``pinned_host``), each as a ratio to the link floor and to
   torch;
3. ``stack_<form>_<L>`` at ``--layers`` layers (default 8: 8 x 3 x 2.8 GB = 68 GB of ``pinned_host``
   state, weights and two bf16 moments, on a 128 GiB host; ``/proc/meminfo``'s MemTotal is recorded,
   not used, since some hosts report less at the start than they give) with ``--big-form``
   (default ``auto``: the faster form of step 2).

Every model has the same weights (uniform, std 0.02; norms 1), made once per parameter shape
and reused by every layer: the models are built on the meta device and the stack reads its
stages through ``SwappedStack(weights=...)``, so no torch copy of a layer is held beside the
stack's ``pinned_host`` state (3 x the layer's bf16 weight bytes: weights and two moments).
Torch's first loss and the stacks' first losses are therefore the same quantity (equal up to
bf16 rounding).

Medians of ``--steps`` after a warm-up (seconds). The link floor of a stack step, with W the
trainable weight bytes: host to device 4 W (the weights in for the forward and again for the
backward, the two AdamW moments in for the update fused into the backward), device to host 3 W
(the new weights and the two new moments; the gradients stay on the device), the two
directions at once 7 W. ``link_floor_s`` = max(4 W / h2d, 3 W / d2h) at the pinned-host
bandwidths measured in this run on a layer's own host buffers (``link_bandwidth``; the terms in
``link_floor_terms``; the duplex rate measured here, two ``device_put`` calls issued together, came
out below what the stack's own overlapped step reaches on an H100, so its 7 W / both term is
recorded but not part of that floor); ``link_floor_reference_s`` = max(4 W / 54, 3 W / 54,
7 W / 93 GB/s), the reference rates of ``docs/explanation/measured-facts.md``. Model TFLOP/s use the routed FLOPs:
6 x (parameters active per token: attention, router, ``top_k`` experts, norms, the head) x tokens
+ causal attention's 6 x B x S^2 x (heads x head_dim) per layer (forward and backward).

``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` (PJRT's pinned-host pool, 64 GiB by default) is set from
the largest stack's state before jax starts, unless already set.

    PYTHONPATH=/tmp/site:. python3 benchmarks/moe_gpu.py --out $OUT/moe_gpu.json
    python benchmarks/moe_gpu.py --smoke --out /tmp/moe_gpu.json     # CPU, tiny shapes, float32
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_timing import median_time  # noqa: E402

#: reference pinned-host bandwidths of an H100 (bytes/s: h2d, d2h, both), ``docs/explanation/measured-facts.md``.
REFERENCE_LINK = {"h2d": 54e9, "d2h": 54e9, "both": 93e9}
#: tiny shapes of ``--smoke`` (CPU, float32).
SMOKE = dict(d=64, f=128, num_experts=4, top_k=2, vocab=128, batch=2, seq=16, compare_layers=2, layers=3, steps=1,
             dtype="float32")


def layer_params(d: int, f: int, experts: int, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int]:
    """``(total, active per token)`` parameter counts of one Mixtral decoder layer."""
    attn = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2
    router, norms, expert = d * experts, 2 * d, 3 * d * f
    return attn + router + norms + experts * expert, attn + router + norms


def host_memory_bytes() -> int:
    """This host's physical memory (``/proc/meminfo``'s MemTotal), bytes; 0 if unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Values:
    """The benchmark's weights: one tensor per (parameter name without its layer index, shape, dtype),
    made once (uniform with std 0.02; norms 1) and reused by every layer and every model."""

    def __init__(self):
        self.cache = {}

    def __call__(self, name: str, shape, dtype):
        import torch
        parts = name.split(".")
        key = (".".join(p for p in parts if not p.isdigit()), tuple(shape), dtype)
        t = self.cache.get(key)
        if t is None:
            g = torch.Generator().manual_seed(len(self.cache) + 1)
            if len(parts) > 1 and "norm" in parts[-2]:
                t = torch.ones(shape, dtype=dtype)
            else:
                a = 0.02 * math.sqrt(3.0)
                t = torch.empty(shape, dtype=torch.float32).uniform_(-a, a, generator=g).to(dtype)
            self.cache[key] = t
        return t


def build(cfg, dtype, values: Values, device: str):
    """A ``MixtralForCausalLM`` made on the meta device and given ``values``' weights: every tensor on
    ``device`` (``"cuda"``: the torch reference), or (``"meta"``) only the ends outside the decoder
    layers on the CPU (what ``causal_lm_stages``' probe runs), the layers left on the meta device."""
    import torch
    from transformers import MixtralForCausalLM
    with torch.device("meta"):
        model = MixtralForCausalLM(cfg)
    model.to(dtype)
    base = model.model
    dev = "cpu" if device == "meta" else device
    ends = [base.embed_tokens, base.norm, model.lm_head]
    mods = ends if device == "meta" else [model]
    for m in mods:
        m.to_empty(device=dev)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not p.is_meta:
                p.copy_(values(n, p.shape, p.dtype))
    with torch.device("cpu"):
        rotary = type(base.rotary_emb)(config=cfg)
    base.rotary_emb = rotary.to(dtype).to(dev)
    return model


def stack_weights(model, values: Values):
    """``SwappedStack(weights=...)``: a decoder layer's tensors from ``values`` (by their name in
    ``model``), the ends' own (real) tensors."""
    prefix = {id(m): n for n, m in model.named_modules()}

    def weights(module, names):
        own = {**dict(module.named_buffers()), **dict(module.named_parameters())}
        p = prefix.get(id(module))
        out = {}
        for n in names:
            t = own[n]
            out[n] = values(f"{p}.{n}", t.shape, t.dtype) if t.is_meta else t.detach()
        return out
    return weights


def measure_link(host_tree, reps: int = 3) -> dict:
    """Pinned-host bandwidths (bytes/s, best of ``reps``) moving ``host_tree`` (``pinned_host`` jax
    arrays): ``torch_stack.measure_bandwidth``'s ``h2d``, ``d2h`` and ``both`` (2 x bytes)."""
    from torch_stack import measure_bandwidth
    return measure_bandwidth(host_tree, reps)


def floor_terms(w: int, link: dict) -> dict:
    """The terms (seconds) of the stack step's link floor for ``w`` trainable weight bytes: ``h2d_s`` =
    4 w / h2d, ``d2h_s`` = 3 w / d2h, ``duplex_s`` = 7 w / both (see the module docstring)."""
    return {"h2d_s": 4 * w / link["h2d"], "d2h_s": 3 * w / link["d2h"], "duplex_s": 7 * w / link["both"]}


def floor_s(w: int, link: dict, duplex: bool = True) -> float:
    """The stack step's link floor (seconds): the largest of :func:`floor_terms` (without the duplex
    term when ``duplex`` is false)."""
    t = floor_terms(w, link)
    return max(t["h2d_s"], t["d2h_s"], *((t["duplex_s"],) if duplex else ()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=14336)
    ap.add_argument("--num-experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--experts", default="dense,sorted", help="forms compared at --compare-layers (comma-separated)")
    ap.add_argument("--compare-layers", type=int, default=2, help="layers of torch and of the forms' comparison")
    ap.add_argument("--layers", type=int, default=8,
                    help="layers of the largest stack (default 8: 68 GB of pinned_host state; 0: none)")
    ap.add_argument("--big-form", default="auto", help="form of the largest stack: dense, sorted or auto (the faster)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU in float32 (a test runs it)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe_gpu.json"))
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    forms = [f for f in args.experts.split(",") if f]
    if not forms or any(f not in ("dense", "sorted") for f in forms):
        ap.error(f"--experts: a comma-separated list of dense, sorted; got {args.experts!r}")
    if args.big_form not in ("auto", "dense", "sorted"):
        ap.error(f"--big-form: dense, sorted or auto; got {args.big_form!r}")
    heads = max(1, args.d // 128)
    kv_heads = max(1, heads // 4)
    head_dim = args.d // heads
    elt = 2 if args.dtype == "bfloat16" else 4
    per_layer, per_layer_active = layer_params(args.d, args.f, args.num_experts, heads, kv_heads, head_dim)
    per_layer_active += args.top_k * 3 * args.d * args.f
    ends = 2 * args.vocab * args.d + args.d
    mem = host_memory_bytes()
    state_per_layer = 3 * per_layer * elt               # weights + two AdamW moments in pinned_host
    largest = max(args.layers, args.compare_layers)
    limit_gb = math.ceil((1.1 * (largest * state_per_layer + 3 * ends * elt)) / 2 ** 30) + 8
    os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(limit_gb))

    import torch
    from transformers import MixtralConfig
    cuda = torch.cuda.is_available()
    dtype = getattr(torch, args.dtype)
    values = Values()

    def config(layers):
        return MixtralConfig(vocab_size=args.vocab, hidden_size=args.d, intermediate_size=args.f,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim, num_local_experts=args.num_experts, num_experts_per_tok=args.top_k,
                             max_position_embeddings=max(4096, args.seq), tie_word_embeddings=False,
                             router_jitter_noise=0.0, output_router_logits=False)

    tokens = args.batch * args.seq

    def flops(layers):
        attn = 6 * args.batch * args.seq ** 2 * heads * head_dim
        return 6 * (layers * per_layer_active + args.vocab * args.d + args.d) * tokens + layers * attn

    def weight_bytes(layers):
        return (layers * per_layer + ends) * elt

    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    ce = lambda lo, t: torch.nn.functional.cross_entropy(lo.flatten(0, 1).float(), t.flatten())  # noqa: E731
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "args": vars(args), "forms": forms,
           "host_memory_bytes": mem, "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"],
           "params_per_layer": per_layer, "active_params_per_layer": per_layer_active,
           "pinned_state_bytes_per_layer": state_per_layer}
    rows = res["rows"] = {}

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)

    # 1. torch on the device, before jax starts
    L = args.compare_layers
    rows["torch_device"] = {"layers": L, "model_flops": flops(L), "weight_bytes": weight_bytes(L)}
    try:
        t0 = time.perf_counter()
        model = build(config(L), dtype, values, "cuda" if cuda else "cpu")
        rows["torch_device"]["build_s"] = time.perf_counter() - t0
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
        dev = next(model.parameters()).device
        xc, yc = x.to(dev), y.to(dev)
        losses = []

        def torch_step():
            loss = ce(model(xc).logits, yc)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = median_time(torch_step, args.steps, torch.cuda.synchronize if cuda else (lambda: None))
        rows["torch_device"].update(step_s=t, tflops=flops(L) / t / 1e12, first_loss=losses[0])
        if cuda:
            rows["torch_device"]["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    except Exception as e:   # e.g. out of device memory: recorded, the stack rows still run
        rows["torch_device"]["error"] = f"{type(e).__name__}: {e}"[:2000]
    print("torch_device", json.dumps(rows["torch_device"]), flush=True)
    model = opt = xc = yc = torch_step = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    save()

    # 2. / 3. the stack (jax starts here)
    import xla_swap

    def stack_row(form, layers):
        key = f"stack_{form}_{layers}"
        row = rows[key] = {"form": form, "layers": layers, "weight_bytes": weight_bytes(layers),
                           "model_flops": flops(layers)}
        stack = None
        try:
            t0 = time.perf_counter()
            m = build(config(layers), dtype, values, "meta")
            first, lays, last = xla_swap.causal_lm_stages(m, experts=form)
            stack = xla_swap.SwappedStack(lays, first=first, last=last, loss_fn=ce, weights=stack_weights(m, values),
                                          optimizer=torch.optim.AdamW(m.parameters(), lr=1e-5))
            row["build_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            row["first_loss"] = float(stack.train_step(x, y))
            row["first_step_s"] = time.perf_counter() - t0
            t = median_time(lambda: stack.train_step(x, y), args.steps)
            row.update(step_s=t, tflops=flops(layers) / t / 1e12)
            if "link_bandwidth" not in res and cuda:
                try:
                    res["link_bandwidth"] = measure_link(stack.runtime.host_params[1])
                except Exception as e:   # the floor then uses the reference bandwidths only
                    res["link_bandwidth_error"] = f"{type(e).__name__}: {e}"[:500]
            link = res.get("link_bandwidth")
            if link is not None:   # measured: each direction's term (the measured duplex rate is recorded, not used)
                row["link_floor_terms"] = floor_terms(row["weight_bytes"], link)
                row["link_floor_s"] = floor_s(row["weight_bytes"], link, duplex=False)
                row["ratio_to_link_floor"] = t / row["link_floor_s"]
            row["link_floor_reference_s"] = floor_s(row["weight_bytes"], REFERENCE_LINK)
            row["ratio_to_link_floor_reference"] = t / row["link_floor_reference_s"]
            if rows["torch_device"]["layers"] == layers and "step_s" in rows["torch_device"]:
                row["ratio_to_torch"] = t / rows["torch_device"]["step_s"]
        except Exception as e:   # a form that does not compile or run here: recorded, the run goes on
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(key, json.dumps(row), flush=True)
        del stack
        gc.collect()
        save()
        return row

    for form in forms:
        stack_row(form, L)
    timed = {f: rows[f"stack_{f}_{L}"].get("step_s") for f in forms}
    timed = {f: s for f, s in timed.items() if s is not None}
    big_form = args.big_form if args.big_form != "auto" else (min(timed, key=timed.get) if timed else "dense")
    res["big_form"] = big_form
    if args.layers and args.layers != L:
        stack_row(big_form, args.layers)
    save()

    link = res.get("link_bandwidth")
    print(f"{res['device']}: {L}-layer W {weight_bytes(L) / 2 ** 30:.2f} GiB; XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="
          f"{res['XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB']}"
          + (f"; link h2d {link['h2d'] / 1e9:.1f} d2h {link['d2h'] / 1e9:.1f} both {link['both'] / 1e9:.1f} GB/s"
             if link else ""))
    for k, r in rows.items():
        if "error" in r:
            print(f"{k:18s} ERROR {r['error'][:300]}")
            continue
        print(f"{k:18s} L={r['layers']:<3d} {r['step_s']:.3f} s  {r['tflops']:6.1f} TFLOP/s  first loss "
              f"{r['first_loss']:.4f}"
              + (f"  x{r['ratio_to_link_floor']:.2f} floor ({r['link_floor_s']:.3f} s)" if "ratio_to_link_floor" in r
                 else "")
              + (f"  x{r['ratio_to_link_floor_reference']:.2f} ref floor" if "ratio_to_link_floor_reference" in r
                 else "")
              + (f"  x{r['ratio_to_torch']:.2f} torch" if "ratio_to_torch" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
