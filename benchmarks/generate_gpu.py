#!/usr/bin/env python
"""Generation through the stack at the link floor: Llama shapes with random bf16 weights, one GPU.

Shapes (``--shapes``): ``8b`` (D=4096, F=14336, 32/8 heads, ``--layers-8b`` 16) and ``70b``
(D=8192, F=28672, 64/8 heads, ``--layers-70b`` 48: about 83 GB of bf16 weights, more than the
H100's 80 GB; skipped, with the reason in the JSON, when host memory cannot hold it). Vocabulary
``--vocab`` (32000), untied head.

* ``8b`` is built as a CPU torch model (random values generated on the GPU, copied once) and
  handed to ``SwappedStack`` (weights copied into ``pinned_host``); the same model then runs
  accelerate's offloaded generate (``accelerate.cpu_offload`` to the GPU: every module's weights
  copied at its call, no prefetch) on ``--accel-new-tokens`` tokens, and a stack with every
  stage resident on the device gives the decode compute (the compute floor).
* ``70b`` is built on the meta device: its ends (embedding, norm, head, rotary) are made real,
  its layers never exist in torch; ``SwappedStack(weights=...)`` receives random values per stage
  (generated on the GPU, one stage at a time) straight into ``pinned_host``. The pinned pool is
  sized first (``xla_swap.executors.host_pool.ensure_host_memory_limit``, before jax starts).

Per batch (``--batches``, default 1 and 32), prompt ``--prompt`` (512) tokens, greedy:
time to first token (the prefill's token ready, ``last_generation["first_token_s"]``), the decode
step (median of the intervals between steps of a ``--new-tokens`` run; ``--new-tokens-70b`` for the
70b shape, whose batches are ``--batches-70b``), and, with ``--plan-batch``, the batch
``xla_swap.hf.generate.choose_batch`` picks for the free device memory (at most ``--max-batch``);
tokens/s (batch / step) and the step over its floor. Floor: ``max(W / h2d, decode compute)``, with
``W`` the streamed weight bytes and ``h2d`` measured in the run (a ``pinned_host`` -> device copy
of ``--bw-mib`` MiB, median of 5); decode compute: the resident stack's step (``8b``), else
``W / hbm`` (one read of the weights at the device bandwidth measured by a copy: a lower bound).
With ``--kv-host`` (default on) the largest of ``--batches`` also runs with the KV cache in
``pinned_host`` at the 8b shape (``--kv-host-70b``: at the 70b shape too); its floor adds the cache's
bytes in and out. Then the device cache runs again, compiled again (``_recompiled``, the control).
Both rows compare their tokens and their decode executables' HLO with the first device-cache run
(:func:`compare_hlo`: the same arithmetic, and the same text with the kernels XLA chose);
``--xla-deterministic`` compiles with GEMM autotuning off (:func:`deterministic_xla_flags`), so
every compilation of a computation picks the same kernels.

    PYTHONPATH=/tmp/site:. python3 benchmarks/generate_gpu.py --out $OUT/generate_gpu.json
    python -m benchmarks.generate_gpu --cpu-smoke --out /tmp/gen.json    # tiny config on the CPU
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import statistics
import sys
import time

SHAPES = {"8b": dict(d=4096, f=14336, heads=32, kv=8), "70b": dict(d=8192, f=28672, heads=64, kv=8),
          "d5120": dict(d=5120, f=27648, heads=40, kv=8, layers=16), "d8192": dict(d=8192, f=28672, heads=64, kv=8,
                                                                                  layers=8)}
SMOKE = {"8b": dict(d=64, f=128, heads=4, kv=2), "70b": dict(d=64, f=160, heads=4, kv=2),
         "d5120": dict(d=64, f=192, heads=4, kv=2, layers=2), "d8192": dict(d=64, f=96, heads=4, kv=2, layers=2)}


def _config(shape: dict, layers: int, vocab: int, max_pos: int):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=vocab, hidden_size=shape["d"], intermediate_size=shape["f"],
                       num_hidden_layers=layers, num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv"], max_position_embeddings=max_pos,
                       tie_word_embeddings=False)


def _layers(name: str, shape: dict, args) -> int:
    """The layer count of shape ``name``: its own (``d5120``, ``d8192``) or ``--layers-8b`` / ``--layers-70b``."""
    return shape.get("layers") or (args.layers_8b if name == "8b" else args.layers_70b)


def _devices(args) -> list:
    """The first ``--gpus`` jax devices: the stack's weights split FSDP-style over them, each device's shard in
    its own ``pinned_host``."""
    import jax
    return jax.devices()[:args.gpus]


def _param_bytes(cfg, itemsize: int = 2) -> int:
    """bf16 bytes of a Llama of ``cfg`` (from a meta-device model: nothing allocated)."""
    import torch
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    return sum(p.numel() for p in m.parameters()) * itemsize


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class RandomWeights:
    """``SwappedStack(weights=...)``: random bf16 values per stage, generated on ``device`` one stage at a time
    (matrices ``N(0, std)``, 1-D weights (norms) ones); the ends' own tensors where they are real."""

    def __init__(self, device, std: float = 0.02, seed: int = 0):
        import torch
        self.device, self.std, self.gen = device, std, torch.Generator(device=device).manual_seed(seed)

    def __call__(self, mod, names):
        import torch
        own = {**dict(mod.named_buffers()), **dict(mod.named_parameters())}
        out = {}
        for n in names:
            t = own[n]
            if not t.is_meta:
                out[n] = t.detach()
            elif t.dim() == 1:
                out[n] = torch.ones(t.shape, dtype=t.dtype)
            else:   # generated as [in, out] and handed over as its transpose: the stack's [in, out] copy is free
                shape = tuple(t.shape)[::-1] if t.dim() == 2 else tuple(t.shape)
                r = (torch.randn(shape, generator=self.gen, device=self.device) * self.std).to(t.dtype).cpu()
                out[n] = r.t() if t.dim() == 2 else r
        return out


def _fill_random(model, device, std=0.02, seed=0):
    """Random values into a real (CPU) model: generated on ``device``, copied once."""
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_((torch.randn(p.shape, generator=g, device=device) * std).to(p.dtype).cpu())


def _real_ends(model, cfg):
    """Make the ends of a meta-device Llama real (embedding, final norm, head, rotary buffers) on the CPU."""
    import torch
    base = model.model
    for m in (base.embed_tokens, base.norm, model.lm_head):
        m.to_empty(device="cpu")
    base.rotary_emb = type(base.rotary_emb)(config=cfg).to("cpu")
    return model


def measure_bandwidth(nbytes: int, reps: int = 5, gpus: int = 1) -> dict:
    """``{"h2d_GBps", "hbm_GBps"}``: a ``pinned_host`` -> device copy of ``nbytes`` and an on-device copy (read + write).

    With ``gpus > 1`` the buffer is split over the first ``gpus`` devices and every device copies its part at
    once: ``h2d_GBps`` is the aggregate over the devices' host links (the N-GPU floor is ``W / h2d``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:gpus]), ("d",))
    host = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"), memory_kind="pinned_host")
    dsh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"), memory_kind="device")
    n = nbytes // 2 * gpus
    x = jax.device_put(np.ones((n,), jnp.bfloat16), host)
    ts = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        y = jax.device_put(x, dsh)
        y.block_until_ready()
        ts.append(time.perf_counter() - t)
        del y
    h2d = nbytes / statistics.median(ts[1:])
    y = jax.device_put(x, dsh)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    copy(y).block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        copy(y).block_until_ready()
        ts.append(time.perf_counter() - t)
    hbm = 2 * nbytes / statistics.median(ts)
    del x, y
    return {"h2d_GBps": h2d * gpus / 1e9, "hbm_GBps": hbm * gpus / 1e9, "buffer_bytes": nbytes * gpus, "gpus": gpus}


def stream_only(rt, reps: int = 3) -> float:
    """Seconds to copy every streamed stage's weights ``pinned_host`` -> device in order, ``rt.prefetch_depth``
    copies in flight, nothing computed (median of ``reps`` after one warm-up): what the link gives the
    stack's own arrays, leaf by leaf, against the one-buffer copy of :func:`measure_bandwidth`."""
    import jax
    ts = []
    for _ in range(reps + 1):
        t, window = time.perf_counter(), collections.deque()
        for i, p in enumerate(rt.host_params):
            if rt.resident[i]:
                continue
            window.append(jax.device_put(p, rt.device_shardings[i]))
            if len(window) > rt.prefetch_depth:
                jax.block_until_ready(window.popleft())
        for a in window:
            jax.block_until_ready(a)
        ts.append(time.perf_counter() - t)
        del window
    return statistics.median(ts[1:])


def torch_h2d(nbytes: int, reps: int = 5, gpus: int = 1) -> float | None:
    """GB/s of pinned torch CPU tensors of ``nbytes`` copied to each of the first ``gpus`` CUDA devices at once
    (aggregate; ``None`` without CUDA)."""
    import torch
    if not torch.cuda.is_available():
        return None
    pairs = [(torch.empty(nbytes, dtype=torch.uint8).pin_memory(), torch.empty(nbytes, dtype=torch.uint8,
                                                                           device=f"cuda:{g}")) for g in range(gpus)]
    ts = []
    for _ in range(reps + 1):
        for g in range(gpus):
            torch.cuda.synchronize(g)
        t = time.perf_counter()
        for src, dst in pairs:
            dst.copy_(src, non_blocking=True)
        for g in range(gpus):
            torch.cuda.synchronize(g)
        ts.append(time.perf_counter() - t)
    del pairs
    torch.cuda.empty_cache()
    return gpus * nbytes / statistics.median(ts[1:]) / 1e9


def _prompt(batch: int, prompt: int, vocab: int):
    import torch
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, vocab, (batch, prompt), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, : prompt // 4] = 0   # one left-padded row
    return ids, mask


def time_stack(stack, batch: int, prompt: int, new: int, vocab: int, kv_cache: str = "auto") -> dict:
    """Time to first token, the decode step (median of the intervals between steps; ``decode_mean_s``: the
    decode time over the steps, which holds where the step reads land one step late, see
    ``xla_swap.hf.generate.generate``'s ``step_done_s``) and the tokens of a greedy run of ``new`` tokens, after
    a 2-token run that compiles the prefill and decode executables."""
    ids, mask = _prompt(batch, prompt, vocab)
    up = lambda x: -(-x // 64) * 64   # noqa: E731
    kw = dict(eos_token_id=None, kv_cache=kv_cache, max_cache_len=up(up(prompt) + new), prompt_bucket=64)
    stack.generate(ids, mask, max_new_tokens=2, **kw)
    t = time.perf_counter()
    out = stack.generate(ids, mask, max_new_tokens=new, **kw)
    total = time.perf_counter() - t
    info = stack.last_generation
    done = info["step_done_s"]
    steps = [b - a for a, b in zip(done, done[1:])]
    step = statistics.median(steps) if steps else float("nan")
    mean = (done[-1] - done[0]) / len(steps) if steps else float("nan")   # exact even where reads land a step late
    return {"batch": batch, "new_tokens": new, "ttft_s": info["first_token_s"], "decode_step_s": step,
            "decode_mean_s": mean, "decode_steps_s": steps, "total_s": total, "tokens_per_s": batch / step,
            "placement": info["placement"], "placement_why": info["explanation"],
            "kv_cache_bytes": info["kv_cache_bytes"], "tokens": out[:, prompt:].tolist(),
            "hlo": decode_hlo(stack, batch, info["cache_len"])}


def _divergence(a: list, b: list) -> list[int]:
    """Per row, the index of the first token where ``a`` and ``b`` differ (-1: equal)."""
    return [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), -1 if len(ra) == len(rb) else min(len(ra), len(rb)))
            for ra, rb in zip(a, b)]


#: HLO opcodes that move, name or group values without computing: left out of :func:`hlo_arithmetic`.
PLUMBING = frozenset({"parameter", "copy", "copy-start", "copy-done", "bitcast", "tuple", "get-tuple-element",
                      "fusion", "call", "async-start", "async-update", "async-done", "opt-barrier"})
#: custom-call targets that only move a value between memory spaces (``pinned_host`` <-> device).
MEMORY_SPACE_CALLS = frozenset({"MoveToHost", "MoveToDevice", "annotate_device_placement"})
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*")
_LAYOUT = re.compile(r"\]\{[^}]*\}")           # the layout after a shape, memory space (S(5)) included
_KEPT_ATTRS = re.compile(r"\b((?:lhs_|rhs_)?(?:batch|contracting)_dims|dimensions|custom_call_target|"
                         r"comparison_direction|operand_precision|slice|padding|window|dim_labels|"
                         r"feature_group_count|batch_group_count|iota_dimension|exponent_bits|mantissa_bits|"
                         r"distribution|is_stable|largest|k)=(\{[^}]*\}|\"[^\"]*\"|[\w.\-]+)")


def hlo_arithmetic(hlo_text: str) -> collections.Counter:
    """The arithmetic of an HLO module as a multiset: ``Counter`` of ``"opcode type attrs"`` strings.

    Every instruction of every computation (fused ones included) counts once, written as its opcode,
    its result type without layouts or memory spaces (``f32[4,64]``, not ``f32[4,64]{1,0:S(5)}``) and
    the attributes that change what it computes (dimensions, contracting dims, precision, comparison,
    custom-call target; not names, metadata or ``backend_config``). Plumbing (:data:`PLUMBING`:
    parameters, copies, bitcasts, tuples, fusion wrappers) and copies between memory spaces
    (:data:`MEMORY_SPACE_CALLS`) are left out. Two executables computing the same values in the same
    operations give equal multisets, whatever their names, layouts or kernels chosen (``as_text()``
    of a GPU executable names its GEMM algorithm in ``backend_config``, which is not counted).

    Args: hlo_text: ``jax.stages.Compiled.as_text()`` (or any HLO module text).
    Returns: ``collections.Counter`` of ``str`` (empty for a text without instructions).
    """
    ops: collections.Counter = collections.Counter()
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            continue
        rest = line[m.end():]
        if rest.startswith("("):              # a tuple type: up to its closing parenthesis
            depth, end = 0, 0
            for end, ch in enumerate(rest):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    break
            typ, rest = rest[:end + 1], rest[end + 1:].lstrip()
        else:
            typ, _, rest = rest.partition(" ")
        opcode = rest.split("(", 1)[0].strip()
        if not opcode or opcode in PLUMBING:
            continue
        attrs = " ".join(f"{k}={v}" for k, v in _KEPT_ATTRS.findall(rest.split("metadata=", 1)[0]))
        if opcode == "custom-call" and any(f'"{t}"' in attrs for t in MEMORY_SPACE_CALLS):
            continue
        ops[f"{opcode} {_LAYOUT.sub(']', typ)} {attrs}".strip()] += 1
    return ops


def hlo_without_names(hlo_text: str) -> str:
    """``hlo_text`` without metadata, stack-frame tables and instruction / computation names: equal for two
    compilations that chose the same kernels (``backend_config`` kept, so a GEMM algorithm picked by
    autotuning shows)."""
    text = re.sub(r",?\s*metadata=\{[^}]*\}", "", hlo_text)
    text = re.split(r"\n\s*FileNames\s*\n", text)[0]
    text = re.sub(r"%[\w.\-]+", "%_", text)
    return re.sub(r"^HloModule \S+", "HloModule _", text)


def decode_hlo(stack, batch: int, cache_len: int) -> list[str]:
    """``as_text()`` of the executables of the stack's current generator for a decode step (``batch`` rows,
    ``cache_len`` slots), one per distinct stage executable in stage order."""
    import jax
    import jax.numpy as jnp
    gen = stack.generators.current
    i32 = jnp.int32
    x = (jax.ShapeDtypeStruct((batch, 1), i32), jax.ShapeDtypeStruct((batch, cache_len), i32),
         jax.ShapeDtypeStruct((batch, 1), i32), jax.ShapeDtypeStruct((), i32))
    out, seen = [], set()
    for exe in gen.streamer.executables(x):
        if id(exe) not in seen:
            seen.add(id(exe))
            out.append(exe.as_text())
    return out


def compare_hlo(a: list[str], b: list[str]) -> dict:
    """Two runs' :func:`decode_hlo`: whether their arithmetic (:func:`hlo_arithmetic`) and their texts without
    names (:func:`hlo_without_names`, kernels' ``backend_config`` included) are equal, the operations only one
    of them has (``-`` in ``a``, ``+`` in ``b``: on a GPU a GEMM that autotuning gave to cuBLAS in one and to a
    Triton fusion in the other shows here as a ``custom-call`` against a ``dot``) and the first differing lines."""
    ops_diff = [] if len(a) == len(b) else [f"executables {len(a)} != {len(b)}"]
    for x, y in zip(a, b):
        ox, oy = hlo_arithmetic(x), hlo_arithmetic(y)
        ops_diff += [f"- {n} x {op}" for op, n in (ox - oy).items()] + [f"+ {n} x {op}" for op, n in (oy - ox).items()]
    diff = []
    for x, y in zip(a, b):
        lx, ly = hlo_without_names(x).splitlines(), hlo_without_names(y).splitlines()
        diff += [f"- {u}\n+ {v}" for u, v in zip(lx, ly) if u != v]
        if len(lx) != len(ly):
            diff.append(f"line counts {len(lx)} != {len(ly)}")
    return {"arithmetic_equal": not ops_diff, "arithmetic_differences": ops_diff[:16],
            "text_equal": len(a) == len(b) and not diff, "differing_lines": len(diff), "first_differences": diff[:8]}


def time_accelerate(model, batch: int, prompt: int, new: int, vocab: int) -> dict:
    """accelerate's ``cpu_offload`` to the GPU, ``model.generate`` greedy: TTFT and (T(new) - T(1)) / (new - 1)."""
    import torch
    import accelerate
    ids, mask = _prompt(batch, prompt, vocab)
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, max_new_tokens=2, **kw)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    torch.cuda.synchronize()
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, **kw)
    torch.cuda.synchronize()
    tn = time.perf_counter() - t
    step = (tn - t1) / max(1, new - 1)
    return {"batch": batch, "new_tokens": new, "ttft_s": t1, "decode_step_s": step, "tokens_per_s": batch / step,
            "accelerate": accelerate.__version__, "tokens": out[:, prompt:].cpu().tolist()}


def _progress(name: str, what: str, t0: float, **kw) -> None:
    """One line on stderr as each phase of a shape ends (a run cut off by its time limit says how far it got)."""
    print(json.dumps({"shape": name, "done": what, "elapsed_s": round(time.perf_counter() - t0, 1), **kw}),
          file=sys.stderr, flush=True)


def run_shape(name: str, args, bw: dict, cuda: bool) -> dict:
    import torch
    import xla_swap
    from xla_swap.planning.policy import OffloadPolicy
    shape = (SMOKE if args.cpu_smoke else SHAPES)[name]
    layers = _layers(name, shape, args)
    new = args.new_tokens_70b if name == "70b" else args.new_tokens
    cfg = _config(shape, layers, args.vocab, max_pos=args.prompt + max(new, args.accel_new_tokens) + 128)
    gdev = "cuda" if cuda else "cpu"
    res: dict = {"shape": dict(shape, layers=layers, vocab=args.vocab), "rows": {}}
    t0 = time.perf_counter()
    from transformers import LlamaForCausalLM
    if name == "8b":   # a real torch model (also accelerate's)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        model.to(args.dtype)
        model.to_empty(device="cpu")
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)   # float32 inv_freq, as built
        _fill_random(model, gdev)
        model.eval()
        first, lyr, last = xla_swap.causal_lm_stages(model)
        stack = xla_swap.SwappedStack(lyr, first=first, last=last,
                                      parallel=xla_swap.ParallelConfig(devices=_devices(args)))
    else:              # layers only ever on the meta device; weights straight into pinned_host per stage
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        model.to(args.dtype)
        _real_ends(model, cfg)
        with torch.no_grad():
            for m in (model.model.embed_tokens, model.lm_head):
                m.weight.copy_((torch.randn(m.weight.shape, device=gdev) * 0.02).to(args.dtype).cpu())
            model.model.norm.weight.fill_(1.0)
        model.eval()
        first, lyr, last = xla_swap.causal_lm_stages(model)
        stack = xla_swap.SwappedStack(lyr, first=first, last=last, weights=RandomWeights(gdev),
                                      parallel=xla_swap.ParallelConfig(devices=_devices(args)))
    res["build_s"] = time.perf_counter() - t0
    _progress(name, "built", t0, build_s=round(res["build_s"], 1))
    rt = stack.runtime
    w = rt.weight_nbytes
    res["weight_bytes"] = w
    res["link_floor_s"] = w / (bw["h2d_GBps"] * 1e9)
    res["hbm_floor_s"] = w / (bw["hbm_GBps"] * 1e9)
    batches = list(args.batches_70b if name == "70b" else args.batches)
    if args.plan_batch:   # the batch that maximises tokens/s for the free device memory (xla_swap.hf.generate.choose_batch)
        from xla_swap.hf.generate import choose_batch, release_generation
        up = lambda x: -(-x // 64) * 64   # noqa: E731
        planned, why = choose_batch(stack, args.prompt, up(up(args.prompt) + new) - up(args.prompt),
                                    max_batch=args.max_batch, prompt_bucket=64)
        release_generation(stack)
        res["planned_batch"], res["planned_why"] = planned, why
        _progress(name, "batch chosen", t0, batch=planned)
        if planned not in batches:
            batches.append(planned)
    res["stream_only_s"] = stream_only(rt)
    _progress(name, "streamed once", t0, stream_only_s=round(res["stream_only_s"], 3))
    compute: dict = {}
    if not args.no_resident and (name == "8b" or (name != "70b" and w < args.resident_max_gb * 1e9)):   # the decode compute: resident
        wkw = {} if name == "8b" else {"weights": RandomWeights(gdev)}
        res_stack = xla_swap.SwappedStack(lyr, first=first, last=last, policy=OffloadPolicy(params="device"),
                                          parallel=xla_swap.ParallelConfig(devices=_devices(args)), **wkw)
        for b in batches:
            r = time_stack(res_stack, b, args.prompt, min(new, args.resident_new_tokens), args.vocab)
            compute[b] = r["decode_step_s"]
            res["rows"][f"resident_b{b}"] = {k: v for k, v in r.items() if k not in ("tokens", "hlo")}
        del res_stack
        gc.collect()
    if args.profile_dir:   # a perfetto trace of a short run at the first batch (the compile run first)
        import jax
        time_stack(stack, batches[0], args.prompt, 4, args.vocab)
        with jax.profiler.trace(os.path.join(args.profile_dir, f"{name}_b{batches[0]}"), create_perfetto_trace=True):
            time_stack(stack, batches[0], args.prompt, 4, args.vocab)
    for b in batches:
        r = time_stack(stack, b, args.prompt, new, args.vocab)
        c = compute.get(b, res["hbm_floor_s"])
        r["compute_floor_s"], r["compute_floor_from"] = c, "resident stack" if b in compute else "W / hbm"
        r["floor_s"] = max(res["link_floor_s"], c)
        r["ratio_to_floor"] = r["decode_step_s"] / r["floor_s"]
        res["rows"][f"stack_b{b}"] = r
        _progress(name, f"row b{b}", t0, decode_step_s=round(r["decode_step_s"], 4), ttft_s=round(r["ttft_s"], 3))
    if args.kv_host and (name == "8b" or args.kv_host_70b):
        b = max(args.batches_70b if name == "70b" else args.batches)
        r = time_stack(stack, b, args.prompt, new, args.vocab, kv_cache="host")
        r["floor_s"] = max(res["link_floor_s"] + 2 * r["kv_cache_bytes"] / (bw["h2d_GBps"] * 1e9),
                           compute.get(b, res["hbm_floor_s"]))
        r["ratio_to_floor"] = r["decode_step_s"] / r["floor_s"]
        first_run = res["rows"][f"stack_b{b}"]["tokens"]
        r["tokens_equal_device_cache"] = r["tokens"] == first_run
        r["first_divergence_from_device_cache"] = _divergence(r["tokens"], first_run)
        # the same arithmetic (expected: the executables take the cache in device memory either way); the same
        # text too unless the compilations chose other kernels (GEMM algorithms in backend_config)
        r["hlo_vs_device_cache"] = compare_hlo(r["hlo"], res["rows"][f"stack_b{b}"]["hlo"])
        res["rows"][f"stack_b{b}_kvhost"] = r
        # control: the device cache again, its executables compiled again (the host row replaced them): on a
        # GPU, XLA's autotuning may pick other kernels per compilation, which can flip a near-tied bf16 argmax
        c = time_stack(stack, b, args.prompt, new, args.vocab)
        c["tokens_equal_first_run"] = c["tokens"] == first_run
        c["first_divergence_from_first_run"] = _divergence(c["tokens"], first_run)
        c["hlo_vs_first_run"] = compare_hlo(c["hlo"], res["rows"][f"stack_b{b}"]["hlo"])
        c["floor_s"] = res["rows"][f"stack_b{b}"]["floor_s"]
        c["ratio_to_floor"] = c["decode_step_s"] / c["floor_s"]
        res["rows"][f"stack_b{b}_recompiled"] = c
    if name == "8b" and not args.no_accelerate:
        if not cuda:
            res["accelerate"] = {"skipped": "no CUDA device (accelerate's cpu_offload needs an execution GPU)"}
        else:
            try:
                import accelerate
                del stack
                gc.collect()
                accelerate.cpu_offload(model, execution_device=torch.device("cuda"))
                for b in args.accel_batches:
                    r = time_accelerate(model, b, args.prompt, args.accel_new_tokens, args.vocab)
                    mine = res["rows"].get(f"stack_b{b}")
                    if mine is not None:
                        k = min(len(r["tokens"][0]), len(mine["tokens"][0]))
                        same = sum(a[:k] == m[:k] for a, m in zip(r["tokens"], mine["tokens"]))
                        r["rows_equal_to_stack"] = f"{same}/{b} over {k} tokens"
                        r["stack_speedup"] = r["decode_step_s"] / mine["decode_step_s"]
                    res["rows"][f"accelerate_b{b}"] = r
            except ImportError as e:
                res["accelerate"] = {"skipped": f"accelerate not installed: {e}"}
    if args.check_hf and name == "8b":   # the smoke's correctness check: the stack's greedy tokens = transformers' generate
        b = max(args.batches)
        ids, mask = _prompt(b, args.prompt, args.vocab)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        res["hf_tokens_equal"] = ref[:, args.prompt:].tolist() == res["rows"][f"stack_b{b}"]["tokens"]
    for r in res["rows"].values():
        r.pop("tokens", None)
        r.pop("hlo", None)
    return res


def render(data: dict) -> str:
    bw = data.get("bandwidth") or {"h2d_GBps": float("nan"), "hbm_GBps": float("nan")}
    th2d = bw.get("torch_h2d_GBps")
    lines = [f"h2d {bw['h2d_GBps']:.1f} GB/s (torch pinned copy: {th2d or float('nan'):.1f}), "
             f"hbm {bw['hbm_GBps']:.0f} GB/s ({data.get('device', '?')})",
             "| shape | row | batch | TTFT s | decode step s | floor s | step / floor | tokens/s | KV cache |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in data["shapes"].items():
        if "skipped" in s:
            lines.append(f"| {name} | skipped: {s['skipped']} | | | | | | | |")
            continue
        for row, r in s["rows"].items():
            fl = r.get("floor_s")
            floor = "" if fl is None else f"{fl:.4f}"
            ratio = "" if fl is None else f"{r['ratio_to_floor']:.3f}"
            lines.append(f"| {name} ({s['weight_bytes'] / 1e9:.1f} GB, {data['args'].get('gpus', 1)} GPU) | {row} | {r['batch']} | {r['ttft_s']:.3f} | "
                         f"{r['decode_step_s']:.4f} | {floor} | {ratio} | {r['tokens_per_s']:.1f} | "
                         f"{r.get('placement', '')} |")
        if "stream_only_s" in s:
            lines.append(f"{name}: the weights alone streamed in {s['stream_only_s']:.4f} s "
                         f"({s['weight_bytes'] / s['stream_only_s'] / 1e9:.1f} GB/s)")
        for row, r in s["rows"].items():   # the host-cache question: tokens, arithmetic, kernels
            for key, what in (("hlo_vs_device_cache", "tokens_equal_device_cache"),
                              ("hlo_vs_first_run", "tokens_equal_first_run")):
                if key in r:
                    h = r[key]
                    lines.append(f"{name} {row}: {what} {r[what]}, HLO arithmetic equal {h['arithmetic_equal']}, "
                                 f"HLO text equal {h['text_equal']} ({h['differing_lines']} lines differ)")
    if data.get("xla_flags"):
        lines.append(f"XLA_FLAGS={data['xla_flags']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (what the test runs)")
    ap.add_argument("--shapes", default="8b,70b")
    ap.add_argument("--layers-8b", type=int, default=16)
    ap.add_argument("--layers-70b", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--new-tokens-70b", type=int, default=16)
    ap.add_argument("--resident-new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--batches-70b", default="1,32")
    ap.add_argument("--plan-batch", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the batch xla_swap.hf.generate.choose_batch picks for the free device memory")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--accel-batches", default="1")
    ap.add_argument("--accel-new-tokens", type=int, default=8)
    ap.add_argument("--bw-mib", type=int, default=2048)
    ap.add_argument("--kv-host", action=argparse.BooleanOptionalAction, default=True,
                    help="8b: the largest of --batches again with the KV cache in pinned_host")
    ap.add_argument("--kv-host-70b", action="store_true", help="the same row for the 70b shape")
    ap.add_argument("--no-accelerate", action="store_true")
    ap.add_argument("--no-resident", action="store_true")
    ap.add_argument("--resident-max-gb", type=float, default=40.0,
                    help="d5120, d8192: the resident (compute floor) rows when the weights are smaller")
    ap.add_argument("--gpus", type=int, default=1, help="devices the stack spans (weights split FSDP-style, "
                                                         "each GPU pulling its W/N; floors from all of them at once)")
    ap.add_argument("--profile-dir", default=None, help="write a perfetto trace of 4 tokens at each shape's first batch")
    ap.add_argument("--check-hf", action="store_true", help="compare the stack's tokens with transformers' generate")
    ap.add_argument("--xla-deterministic", action="store_true",
                    help="compile with GEMM autotuning off (XLA_FLAGS += --xla_gpu_autotune_level=0): every "
                         "compilation of a computation picks the same kernels (the control for the host-cache row)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "generate_gpu.json"))
    ap.add_argument("--in-process", action="store_true",
                    help="run every shape in this process (default: one subprocess per shape when several are asked "
                         "for, so each starts with the host memory free; --cpu-smoke runs in process)")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    shapes = [s for s in args.shapes.split(",") if s]
    if len(shapes) > 1 and not (args.in_process or args.cpu_smoke):
        return _per_shape(raw, shapes, args.out)
    if args.cpu_smoke:
        args.layers_8b, args.layers_70b, args.vocab = 2, 3, 128
        args.prompt, args.new_tokens, args.new_tokens_70b = 16, 6, 4
        args.resident_new_tokens, args.accel_new_tokens, args.bw_mib = 4, 3, 16
        if args.batches == "1,32":
            args.batches = "1,2"
        if args.batches_70b == "1,32":
            args.batches_70b = "1,2"
        args.plan_batch = False   # no memory statistics on the CPU
        args.check_hf = True
    args.batches = [int(b) for b in args.batches.split(",")]
    args.batches_70b = [int(b) for b in args.batches_70b.split(",")]
    args.accel_batches = [int(b) for b in args.accel_batches.split(",")]
    if args.xla_deterministic:   # before jax starts its backend (XLA reads the flags once)
        os.environ["XLA_FLAGS"] = deterministic_xla_flags(os.environ.get("XLA_FLAGS", ""))
    import torch
    args.dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    data: dict = {"args": {k: (str(v) if k == "dtype" else v) for k, v in vars(args).items()}, "shapes": {},
                  "xla_flags": os.environ.get("XLA_FLAGS", "")}
    # the pinned pool from the largest plan, before jax starts (PJRT GPU caps it at 64 GiB otherwise)
    from xla_swap.executors.host_pool import ensure_host_memory_limit
    need = {}
    for s in shapes:
        shape = (SMOKE if args.cpu_smoke else SHAPES)[s]
        cfg = _config(shape, _layers(s, shape, args),
                      args.vocab, 4096)
        need[s] = _param_bytes(cfg, 4 if args.cpu_smoke else 2)
    # the pool is per device: each of --gpus devices pins its 1/N of the weights
    data["host_pool_GiB"] = ensure_host_memory_limit(-(-max(need.values()) // args.gpus))
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    import jax
    data["device"] = str(jax.devices()[0].device_kind)
    data["bandwidth"] = bw = measure_bandwidth(args.bw_mib << 20, gpus=args.gpus)
    bw["torch_h2d_GBps"] = torch_h2d(4 << 30, gpus=args.gpus) if cuda else None
    for s in shapes:
        avail = _host_available()
        if need[s] * 1.15 > avail:
            data["shapes"][s] = {"skipped": f"needs {need[s] * 1.15 / 1e9:.1f} GB of host memory, "
                                            f"{avail / 1e9:.1f} GB available"}
            continue
        t = time.perf_counter()
        try:
            data["shapes"][s] = run_shape(s, args, bw, cuda)
        except Exception as e:  # noqa: BLE001 - recorded, the next shape still runs
            import traceback
            data["shapes"][s] = {"skipped": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        data["shapes"][s]["wall_s"] = time.perf_counter() - t
        gc.collect()
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    print(render(data))
    return 0 if all("skipped" not in s or "needs" in s["skipped"] for s in data["shapes"].values()) else 1


def deterministic_xla_flags(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with GEMM and convolution autotuning off (``--xla_gpu_autotune_level=0``,
    "0 = off" in the flag's help of jaxlib 0.11.2; an earlier level given in ``flags`` is replaced): XLA then takes
    each GEMM's default algorithm instead of the fastest measured one, so two compilations of one computation run
    the same kernels (and round the same way). Returns the new value (str)."""
    kept = [f for f in flags.split() if not f.startswith("--xla_gpu_autotune_level")]
    return " ".join(kept + ["--xla_gpu_autotune_level=0"])


def per_shape(script: str, raw: list, shapes: list, out: str) -> tuple:
    """Run ``script`` once per shape in its own process (``raw`` plus ``--shapes s --out OUT.s.json
    --in-process``: argparse keeps the last of a repeated option; the host memory freed between shapes) and
    merge the JSONs into ``out``, each shape with the bandwidth its process measured. Returns ``(merged
    data, or None without shapes; the OR of the return codes)``; a shape whose process wrote nothing is
    recorded as skipped."""
    import subprocess
    data, rc = None, 0
    for s in shapes:
        part = f"{out}.{s}.json"
        rc |= subprocess.call([sys.executable, os.path.abspath(script), *raw, "--shapes", s, "--out", part,
                               "--in-process"])
        try:
            with open(part) as f:
                got = json.load(f)
        except (OSError, ValueError) as e:
            got = {"shapes": {s: {"skipped": f"the subprocess wrote no result: {e}"}}, "bandwidth": {}}
        for v in got["shapes"].values():
            v["bandwidth"] = got.get("bandwidth")
        if data is None:
            data = got
        else:
            data["shapes"].update(got["shapes"])
        with open(out, "w") as f:
            json.dump(data, f, indent=1)
    return data, rc


def _per_shape(raw: list, shapes: list, out: str) -> int:
    """:func:`per_shape` of this script, the merged table printed."""
    data, rc = per_shape(__file__, raw, shapes, out)
    print(render(data))
    return rc

if __name__ == "__main__":
    sys.exit(main())
