#!/usr/bin/env python
"""Mixture-of-experts decode by routed experts on one GPU: tokens/s with only the routed experts fetched
against every expert streamed, the decode step against the routed-bytes floor, and the batch where
routed fetching stops paying.

Shapes (``--shapes``), bf16, random weights (std 0.02, norms 1) generated on the GPU one stage at a time
straight into ``pinned_host`` (layers on the meta device, ``SwappedStack(weights=...)``):

* ``mixtral``: Mixtral-8x7B-shaped (D=4096, F=14336, 32/8 heads, 8 experts top-2, vocab 32000),
  ``--layers-mixtral`` (8) of its 32 layers: 2.9 GB per layer, of which 2.8 GB experts;
* ``qwen3``: Qwen3-30B-A3B-shaped (D=2048, expert F=768, 32/4 heads of 128, 128 experts top-8,
  vocab 151936), ``--layers-qwen3`` (12) of its 48: 1.25 GB per layer, 1.21 GB experts.

Per shape, first the copy rates of one layer's top-k experts alone (``fetch``: ``split_arrays``, one
``jax.device_put`` of one ``pinned_host`` array per expert and weight; ``packed``, of one packed buffer per
expert, the ``"split"`` layout; ``stacked``, the ``"stacked"`` layout's slicing program; GB/s against
``h2d``). Then prompt ``--prompt`` (32) tokens, greedy, ``--new-tokens`` (16) new tokens after a run that
compiles (2 tokens, or for a routed row the same run: its buckets of fetched experts compile then):
``routed_b1`` (``"routed"``, layout ``stacked``), ``all_stacked_b1`` (``expert_fetch="all"``, stacked), ``all_b1``
(``"all"``, layout ``"auto"``, what a user gets), ``auto_b1`` (``"auto"`` both), ``routed_split_b1`` (layout
``split``): one switch of layout, one packing. Then each batch of ``--batches-<shape>`` routed, layout auto
(``--sweep-new-tokens``, 8; with ``--sweep-all`` every expert too, else batch 1's whole step is the reference:
it streams the same bytes): ``stops_paying_batch`` is the first batch whose routed step is not faster than the
whole one (against ``routed_token_limit``, the batch the ``"auto"`` choice stops at). Each step's routed bytes
are counted from what it fetched (``last_generation["experts"]["fetched"]``, copies per layer from its
``"copies"``): the streamed weights less the experts, plus the fetched experts; floors: those bytes, or every
weight, over ``h2d`` measured in this process (a 2 GiB ``pinned_host`` -> device copy).

    python3 benchmarks/moe_generate_gpu.py --shapes qwen3 mixtral --out $OUT/moe_generate_gpu.json
    python benchmarks/moe_generate_gpu.py --cpu-smoke --out /tmp/moe_gen.json     # tiny shapes, CPU, float32
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_gpu import (RandomWeights, _host_available, _real_ends, measure_bandwidth,  # noqa: E402
                          per_shape, torch_h2d)

SHAPES = {"mixtral": dict(family="mixtral", d=4096, f=14336, heads=32, kv=8, head_dim=128, experts=8, k=2,
                          vocab=32000),
          "qwen3": dict(family="qwen3_moe", d=2048, f=768, heads=32, kv=4, head_dim=128, experts=128, k=8,
                        vocab=151936)}
SMOKE = {"mixtral": dict(family="mixtral", d=64, f=32, heads=4, kv=2, head_dim=16, experts=8, k=2, vocab=128),
         "qwen3": dict(family="qwen3_moe", d=64, f=16, heads=4, kv=2, head_dim=16, experts=16, k=4, vocab=128)}


def config(shape: dict, layers: int, max_pos: int):
    """The ``transformers`` config of ``shape`` with ``layers`` layers."""
    import transformers
    common = dict(vocab_size=shape["vocab"], hidden_size=shape["d"], num_hidden_layers=layers,
                  num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"], head_dim=shape["head_dim"],
                  max_position_embeddings=max_pos, tie_word_embeddings=False, num_experts_per_tok=shape["k"])
    if shape["family"] == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=shape["f"], num_local_experts=shape["experts"])
    return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=shape["f"], intermediate_size=3 * shape["f"],
                                       num_experts=shape["experts"], norm_topk_prob=True, decoder_sparse_step=1,
                                       mlp_only_layers=[])


def build(shape: dict, layers: int, args, device: str):
    """``(model, stack)``: a meta-device model with real ends and random weights per stage (GPU), or a real
    random-init float32 model (``--cpu-smoke``: ``model.generate`` checks the tokens)."""
    import torch
    import transformers
    import xla_swap
    cfg = config(shape, layers, args.prompt + args.new_tokens + 64)
    if args.cpu_smoke:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
        first, lyr, last = xla_swap.causal_lm_stages(model)
        return model, xla_swap.SwappedStack(lyr, first=first, last=last,
                                            parallel=xla_swap.ParallelConfig(devices=_one_device()))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.to(torch.bfloat16)
    _real_ends(model, cfg)
    with torch.no_grad():
        for m in (model.model.embed_tokens, model.lm_head):
            m.weight.copy_((torch.randn(m.weight.shape, device=device) * 0.02).to(torch.bfloat16).cpu())
        model.model.norm.weight.fill_(1.0)
    model.eval()
    first, lyr, last = xla_swap.causal_lm_stages(model)
    return model, xla_swap.SwappedStack(lyr, first=first, last=last, weights=RandomWeights(device),
                                        parallel=xla_swap.ParallelConfig(devices=_one_device()))


def _one_device():
    import jax
    return jax.devices()[:1]


def expert_bytes(stack) -> tuple[int, int]:
    """``(bytes of one expert's slices in one layer, bytes of every expert weight streamed)``."""
    from xla_swap.hf.moe_decode import routing_info
    info = routing_info(stack)
    per, total = 0, 0
    for i, (name, e, _) in info.layers.items():
        w = [v for n, v in stack.runtime.host_params[1 + i].items() if n.startswith(name + ".")]
        per = max(per, sum(v.nbytes for v in w) // e)
        total += sum(v.nbytes for v in w)
    return per, total


def _prompt(batch: int, prompt: int, vocab: int):
    import torch
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, vocab, (batch, prompt), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, : prompt // 4] = 0
    return ids, mask


def time_generate(stack, batch: int, args, new: int, fetch: str, layout: str = "auto") -> dict:
    """One greedy run after one that compiles (2 tokens for ``"all"``; else the same run, whose routing, hence
    buckets of fetched experts, the timed one repeats): the median decode step, tokens/s, the experts fetched."""
    ids, mask = _prompt(batch, args.prompt, stack.modules[0].vocab_size)
    kw = dict(eos_token_id=None, pad_token_id=0, expert_fetch=fetch, expert_layout=layout, prompt_bucket=16)
    stack.generate(ids, mask, max_new_tokens=2 if fetch == "all" else new, **kw)
    t = time.perf_counter()
    out = stack.generate(ids, mask, max_new_tokens=new, **kw)
    total = time.perf_counter() - t
    info = stack.last_generation
    done = info["step_done_s"]
    steps = [b - a for a, b in zip(done, done[1:])]
    step = statistics.median(steps) if steps else float("nan")
    ex = info.get("experts", {})
    fetched = ex.get("fetched", [])[1:]   # decode steps (step 0 is the prefill)
    per_layer = [len(e) for s in fetched for _, e in s]
    copies = [c[1] for s in ex.get("copies", [])[1:] for c in s]
    return {"batch": batch, "expert_fetch": fetch, "layout": ex.get("layout") or layout, "ttft_s": info["first_token_s"],
            "layout_explanation": ex.get("layout_explanation", ""),
            "copies_per_layer_mean": statistics.mean(copies) if copies else None,
            "decode_step_s": step, "tokens_per_s": batch / step, "total_s": total,
            "routed_steps": ex.get("routed_steps", []), "choice": ex.get("explanation", ""),
            "experts_per_layer_mean": statistics.mean(per_layer) if per_layer else None,
            "fetched_per_step": [sum(len(e) for _, e in s) for s in fetched],
            "tokens": out[:, args.prompt:].tolist()}


def add_floor(row: dict, w: int, per_expert: int, all_experts: int, h2d: float) -> None:
    """The row's bytes per decode step and floor: every weight, or the weights less the experts plus those fetched."""
    if row["fetched_per_step"] and all(row["routed_steps"][1:]):
        nbytes = w - all_experts + per_expert * statistics.median(row["fetched_per_step"])
    else:
        nbytes = w
    row["step_bytes"] = int(nbytes)
    row["floor_s"] = nbytes / h2d
    row["ratio_to_floor"] = row["decode_step_s"] / row["floor_s"]


def fetch_rates(stack, k: int, h2d: float, reps: int = 10) -> dict:
    """GB/s of bringing ``k`` experts of the first routed layer to the device alone (the same ids for every way,
    new ones each repetition): ``split_arrays``, one ``jax.device_put`` of one ``pinned_host`` array per expert and
    weight (``len(names) x k`` copies); ``packed``, one ``jax.device_put`` of ``k`` packed per-expert buffers (the
    ``"split"`` layout's ``ExpertStore``, on a copy of the layer's experts); ``stacked``, the ``"stacked"``
    layout's program slicing the stacked arrays. Run while the stack holds its stacked arrays."""
    import jax
    import numpy as np
    from xla_swap.executors.streaming.routed_experts import ExpertStore
    from xla_swap.hf.moe_decode import routing_info
    info = routing_info(stack)
    i, (name, e, _) = next(iter(sorted(info.layers.items())))
    params = stack.runtime.host_params[1 + i]
    names = sorted(n for n in params if n.startswith(name + "."))
    act = stack.runtime.activation_sharding
    host, dev = params[names[0]].sharding, act.with_memory_kind("device")
    whole = {n: np.asarray(params[n]) for n in names}
    arrays = {n: [jax.device_put(whole[n][j], host) for j in range(e)] for n in names}
    own = {n: jax.device_put(whole[n], host) for n in names}   # the packed store's source (its arrays deleted)
    del whole
    packed, stacked = ExpertStore("split", act), ExpertStore("stacked", act)
    packed.packed(0, own, names)
    ways = {"split_arrays": lambda ids, ids_dev: jax.device_put([arrays[n][int(j)] for n in names for j in ids], dev),
            "packed": lambda ids, ids_dev: packed.fetch(0, own, names, ids),
            "stacked": lambda ids, ids_dev: stacked.fetch(0, params, names, ids)}
    rng = np.random.default_rng(0)
    draws = [np.sort(rng.choice(e, k, replace=False)).astype(np.int32) for _ in range(reps + 1)]
    nbytes = sum(params[n].nbytes for n in names) // e * k
    out = {}
    for way, fn in ways.items():
        ts = []
        for ids in draws:
            ids_dev = jax.device_put(ids, act)
            jax.block_until_ready(ids_dev)
            t = time.perf_counter()
            jax.block_until_ready(fn(ids, ids_dev))
            ts.append(time.perf_counter() - t)
        sec = statistics.median(ts[1:])
        out[way] = {"bytes": nbytes, "s": sec, "GBps": nbytes / sec / 1e9, "of_h2d": nbytes / sec / h2d,
                    "copies": {"split_arrays": k * len(names), "packed": k, "stacked": None}[way]}
    del arrays, own, packed, stacked
    return out


def profile_routed(stack, args, name: str) -> dict:
    """A perfetto trace (``--profile-dir``/``NAME_routed_LAYOUT``) of a routed greedy run at batch 1 with
    ``--profile-tokens`` new tokens per layout (stacked, then split), after one untraced run that compiles;
    returns each trace's :func:`trace_summary.summarise` and the traced run's decode step."""
    import jax
    from trace_summary import load, render, summarise
    out = {}
    for layout in ("stacked", "split"):
        time_generate(stack, 1, args, args.profile_tokens, "routed", layout)
        where = os.path.join(args.profile_dir, f"{name}_routed_{layout}")
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0   # Python's own calls untraced: they would slow the host path measured
        with jax.profiler.trace(where, create_perfetto_trace=True, profiler_options=opts):
            r = time_generate(stack, 1, args, args.profile_tokens, "routed", layout)
        try:
            out[layout] = {"decode_step_s": r["decode_step_s"], "summary": summarise(load(where))}
            print(f"{name} routed {layout}: decode step {r['decode_step_s']:.4f} s\n"
                  f"{render(out[layout]['summary'])}", flush=True)
        except Exception as e:  # noqa: BLE001 - the trace is kept for reading elsewhere
            out[layout] = {"decode_step_s": r["decode_step_s"], "error": f"{type(e).__name__}: {e}"}
    return out


def run_shape(name: str, args, bw: dict, device: str) -> dict:
    from xla_swap.planning.routing import routed_token_limit
    shape = (SMOKE if args.cpu_smoke else SHAPES)[name]
    layers = getattr(args, f"layers_{name}")
    t0 = time.perf_counter()
    model, stack = build(shape, layers, args, device)
    res: dict = {"shape": dict(shape, layers=layers), "build_s": time.perf_counter() - t0, "rows": {}}
    w = stack.runtime.weight_nbytes
    per, all_e = expert_bytes(stack)
    h2d = bw["h2d_GBps"] * 1e9
    res.update(weight_bytes=w, expert_bytes=all_e, bytes_per_expert_layer=per, all_floor_s=w / h2d,
               routed_token_limit=routed_token_limit(shape["experts"], shape["k"]))
    rows, errors = res["rows"], res.setdefault("errors", {})

    def row(key, batch, new, fetch, layout):   # one row; a failure is recorded, the others still run
        try:
            rows[key] = time_generate(stack, batch, args, new, fetch, layout)
            add_floor(rows[key], w, per, all_e, h2d)
        except Exception as e:  # noqa: BLE001
            import traceback
            errors[key] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
    if args.profile_dir:   # traces of routed decoding at batch 1, each layout, then nothing else
        res["profiles"] = profile_routed(stack, args, name)
        return res
    try:   # first: the stack holds its stacked arrays until a "split" generator packs them
        if not args.no_fetch_rates:
            res["fetch"] = fetch_rates(stack, shape["k"], h2d)
    except Exception as e:  # noqa: BLE001
        errors["fetch"] = f"{type(e).__name__}: {e}"
    for key, fetch, layout in (("routed_b1", "routed", "stacked"), ("all_stacked_b1", "all", "stacked"),
                               ("all_b1", "all", "auto"), ("auto_b1", "auto", "auto"),   # one switch of layout
                               ("routed_split_b1", "routed", "split")):
        if args.rows is None or key in args.rows:
            row(key, 1, args.new_tokens, fetch, layout)
    tps = {k: r["tokens_per_s"] for k, r in rows.items()}
    if "all_b1" in tps:
        for key in ("routed_b1", "routed_split_b1", "auto_b1"):
            res[key.replace("_b1", "_speedup_b1")] = tps.get(key, float("nan")) / tps["all_b1"]
        res["routed_tokens_equal_all_b1"] = {k: rows.get(k, {}).get("tokens") == rows["all_b1"]["tokens"]
                                             for k in ("routed_b1", "all_stacked_b1", "routed_split_b1", "auto_b1")}
    stop = None
    for b in getattr(args, f"batches_{name}"):   # every expert's step barely grows with the batch: batch 1's stands
        for fetch in ("routed", "all") if args.sweep_all else ("routed",):
            row(f"{fetch}_b{b}_sweep", b, args.sweep_new_tokens, fetch, "auto")
        r, a = rows.get(f"routed_b{b}_sweep"), rows.get(f"all_b{b}_sweep", rows.get("all_b1"))
        if stop is None and r and a and r["decode_step_s"] >= a["decode_step_s"]:
            stop = b
    res["stops_paying_batch"] = stop
    if args.cpu_smoke:   # the tokens of the stack (routed and all) against transformers' generate
        ids, mask = _prompt(1, args.prompt, shape["vocab"])
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        res["hf_tokens_equal"] = {k: rows[k]["tokens"] == ref[:, args.prompt:].tolist()
                                  for k in ("all_b1", "all_stacked_b1", "routed_b1", "routed_split_b1", "auto_b1")
                                  if k in rows}
    for r in rows.values():
        r.pop("tokens", None)
    return res


def render(data: dict) -> str:
    bw = data["bandwidth"]
    lines = [f"h2d {bw['h2d_GBps']:.1f} GB/s (torch pinned copy: {bw.get('torch_h2d_GBps') or float('nan'):.1f}) "
             f"({data.get('device', '?')})",
             "| shape | row | layout | batch | decode step s | tokens/s | experts/layer | copies/layer | step GB | floor s "
             "| step / floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in data["shapes"].items():
        if "skipped" in s:
            lines.append(f"| {name} | skipped: {s['skipped']} | | | | | | | | | |")
            continue
        for row, r in s["rows"].items():
            ex, cp = (("" if r[c] is None else f"{r[c]:.1f}") for c in ("experts_per_layer_mean", "copies_per_layer_mean"))
            lines.append(f"| {name} | {row} | {r['layout']} | {r['batch']} | {r['decode_step_s']:.4f} | "
                         f"{r['tokens_per_s']:.2f} | {ex} | {cp} | {r['step_bytes'] / 1e9:.2f} | {r['floor_s']:.4f} | "
                         f"{r['ratio_to_floor']:.3f} |")
        nan = float("nan")
        f = {k: (s.get("fetch") or {}).get(k, {"GBps": nan}) for k in ("split_arrays", "packed", "stacked")}
        lines.append(f"{name}: routed / all tokens/s at batch 1: stacked {s.get('routed_speedup_b1', nan):.2f}, split "
                     f"{s.get('routed_split_speedup_b1', nan):.2f}, auto {s.get('auto_speedup_b1', nan):.2f}; routed "
                     f"stops paying at batch {s.get('stops_paying_batch')} (auto's limit {s['routed_token_limit']}); top-k "
                     f"fetch alone (GB/s): split arrays {f['split_arrays']['GBps']:.1f}, packed {f['packed']['GBps']:.1f}"
                     f", stacked {f['stacked']['GBps']:.1f}")
        lines += [f"{name} {k}: {v.splitlines()[0]}" for k, v in s.get("errors", {}).items()]
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(b) for b in text.split(",") if b]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, float32 (what the test runs)")
    ap.add_argument("--shapes", nargs="+", default=["mixtral,qwen3"], help="qwen3 mixtral (or comma-separated)")
    ap.add_argument("--layers-mixtral", type=int, default=8)
    ap.add_argument("--layers-qwen3", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--sweep-new-tokens", type=int, default=8)
    ap.add_argument("--batches-mixtral", default="2,4,8")
    ap.add_argument("--batches-qwen3", default="8,16,32")
    ap.add_argument("--sweep-all", action="store_true",
                    help="also stream every expert at each sweep batch (default: batch 1's step is the reference)")
    ap.add_argument("--bw-mib", type=int, default=2048)
    ap.add_argument("--in-process", action="store_true", help="every shape in this process (default: one each)")
    ap.add_argument("--rows", nargs="*", default=None, help="the batch-1 rows to run (default: routed_b1 "
                    "all_stacked_b1 all_b1 auto_b1 routed_split_b1)")
    ap.add_argument("--no-fetch-rates", action="store_true", help="skip the copy rates of one layer's experts")
    ap.add_argument("--profile-dir", default=None, help="only trace a routed run per layout (jax profiler) there")
    ap.add_argument("--profile-tokens", type=int, default=6, help="new tokens of each traced run")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "moe_generate_gpu.json"))
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    shapes = [s for arg in args.shapes for s in arg.split(",") if s]
    if len(shapes) > 1 and not (args.in_process or args.cpu_smoke):
        return _per_shape(raw, shapes, args.out)
    if args.cpu_smoke:
        args.layers_mixtral = args.layers_qwen3 = 2
        args.prompt, args.new_tokens, args.sweep_new_tokens, args.bw_mib = 8, 4, 3, 16
        args.batches_mixtral, args.batches_qwen3, args.sweep_all = "6", "8", True
    args.batches_mixtral, args.batches_qwen3 = _ints(args.batches_mixtral), _ints(args.batches_qwen3)
    import torch
    from xla_swap.executors.host_pool import ensure_host_memory_limit
    data: dict = {"args": vars(args), "shapes": {}}
    need = max(_weight_bytes((SMOKE if args.cpu_smoke else SHAPES)[s], getattr(args, f"layers_{s}")) for s in shapes)
    data["host_pool_GiB"] = ensure_host_memory_limit(int(1.5 * need))   # the weights once, plus transient copies
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    import jax
    data["device"] = str(jax.devices()[0].device_kind)
    data["bandwidth"] = bw = measure_bandwidth(args.bw_mib << 20)
    bw["torch_h2d_GBps"] = torch_h2d(4 << 30) if cuda else None
    for s in shapes:
        t = time.perf_counter()
        shape = (SMOKE if args.cpu_smoke else SHAPES)[s]
        host = 1.5 * _weight_bytes(shape, getattr(args, f"layers_{s}"))   # the weights once (packing: one layer more)
        if host > _host_available():
            data["shapes"][s] = {"skipped": f"needs {host / 1e9:.0f} GB of host memory, "
                                            f"{_host_available() / 1e9:.0f} GB available"}
            continue
        try:
            data["shapes"][s] = run_shape(s, args, bw, "cuda" if cuda else "cpu")
        except Exception as e:  # noqa: BLE001 - recorded, the next shape still runs
            import traceback
            data["shapes"][s] = {"skipped": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        data["shapes"][s]["wall_s"] = time.perf_counter() - t
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    print(render(data))
    return 0 if all("skipped" not in s and not s.get("errors") for s in data["shapes"].values()) else 1


def _weight_bytes(shape: dict, layers: int) -> int:
    """bf16 bytes of the model (float32 for the smoke shapes), from a meta-device build."""
    import torch
    import transformers
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(config(shape, layers, 4096))
    return sum(p.numel() for p in m.parameters()) * (4 if shape["d"] < 512 else 2)


def _per_shape(raw: list, shapes: list, out: str) -> int:
    """Each shape in its own process (``generate_gpu.per_shape``), the merged table printed."""
    data, rc = per_shape(__file__, raw, shapes, out)
    if data and data.get("bandwidth"):
        print(render(data))
    return rc

if __name__ == "__main__":
    sys.exit(main())
