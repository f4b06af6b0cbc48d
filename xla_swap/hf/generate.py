"""Text generation through a ``SwappedStack`` of ``causal_lm_stages(model)``: prefill, then decode
steps that reuse per-layer KV caches (``SwappedStack.generate`` calls :func:`generate`).

How it runs the model's own code:

* **Cache.** Each decoder layer, unmodified, gets a small cache object (:class:`xla_swap.hf.kv_cache.LayerKV`, shaped
  like ``transformers``' ``Cache`` as the layers and ``transformers.masking_utils`` call it) in
  its ``cache`` / ``past_key_values`` argument. Its ``update(key_states, value_states, ...)``
  writes the new keys and values into the layer's fixed-size ``[batch, kv_heads, cache_len,
  head_dim]`` tensors at the current offset (``jax.lax.dynamic_update_slice``) and returns the
  whole tensors, as ``transformers``' ``StaticCache`` does.
* **Masks.** The first stage runs the base model's forward (as :class:`xla_swap.hf.causal_lm.CausalLMFirst`
  does) with the 2-D attention mask over the whole cache (``[batch, cache_len]``: the prompt's
  mask, 1 for every generated token, 0 for slots not written yet), explicit position ids
  (``cumsum(mask) - 1``, as ``GenerationMixin`` builds them) and the cache object: every
  layer's mask (full or sliding window, by the model's config) is built by the model's own
  mask code for a key length of ``cache_len``. A sliding-window layer keeps the whole
  ``cache_len`` of keys; its mask hides those outside the window.
* **Shapes.** Prompts are left-padded to a multiple of ``prompt_bucket`` and the cache has a
  fixed length (``max_cache_len``), so one prefill executable per bucket and one decode
  executable per stage signature serve every step (``num_executables``).
* **Tokens.** Greedy (argmax) or sampling (temperature, then top-k, then top-p, as
  ``transformers``' logits warpers apply them; ``jax.random`` keyed by ``seed`` and the step:
  reproducible); stop tokens end a row, which then gets ``pad_token_id``, as in
  ``GenerationMixin``; the loop ends when every row has stopped or after ``max_new_tokens``.

KV cache placement (``kv_cache=``): bytes of cache per layer are ``2 x batch x kv_heads x head_dim x
cache_len x itemsize`` (keys and values; ``itemsize`` of the dtype the layer computes K in).
``"device"`` keeps every layer's cache in device memory (updated in place); ``"host"`` keeps it in
``pinned_host`` and streams it with the layer's weights (``prefetch_depth`` layers ahead, written
back after the layer: ``2 x`` its bytes over the link per layer and step). ``"auto"`` (default)
chooses ``"device"`` when the whole cache plus the streaming window (``prefetch_depth + 1`` of
the largest stage's weights, plus the resident stages') fits ``device_budget_bytes``, or, without
a budget, the device's free memory (``memory_stats()``: ``bytes_limit - bytes_in_use``; a
platform without memory statistics, the CPU, counts as fitting); else ``"host"``.
``stack.last_generation`` holds the choice and its figures.

The cache objects live in :mod:`xla_swap.hf.kv_cache`, the token choice in :mod:`xla_swap.hf.sampling`, what a
stack keeps between calls in :mod:`xla_swap.hf.generators`. The module imports torch, torchax (through the
stack's modules) and jax; not :mod:`xla_swap.stack` (the stack calls it).
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from xla_swap.distributed import gather_ints, gather_prompts, per_rank_batches
from xla_swap.hf.causal_lm import CausalLMFirst, CausalLMLast
from xla_swap.stack.checks import check_index_range, token_id_bounds
from xla_swap.hf.refusals import refuse_longrope_generation
from xla_swap.hf.generators import Generator, Generators, memory_stats
from xla_swap.hf.kv_cache import kv_cache_bytes
from xla_swap.hf.moe_decode import FetchPlan, check_fetch_args, routed_batch, routing_info
from xla_swap.planning.units import check_budget_bytes

__all__ = ["generate", "choose_batch", "release_generation", "prefill_temps", "kv_cache_bytes", "FROM_CONFIG"]

_PLACEMENTS = ("auto", "device", "host")


class _FromConfig:
    """Default of ``eos_token_id`` / ``pad_token_id``: the model's ``generation_config`` value (``None`` means none)."""

    def __repr__(self) -> str:
        return "FROM_CONFIG"


FROM_CONFIG = _FromConfig()


def _round_up(x: int, m: int) -> int:
    return -(-int(x) // int(m)) * int(m)


def release_generation(stack) -> None:
    """Free what :func:`generate` keeps in ``stack`` between calls: the KV cache (device or ``pinned_host``), the
    weights prefetched for the next step and the decode executables. The next ``generate`` builds them again."""
    stack.generators.release()


def choose_batch(stack, prompt_len: int, max_new_tokens: int, *, device_budget_bytes: int | None = None,
                 max_batch: int = 1024, prompt_bucket: int = 16, expert_fetch: str = "auto") -> tuple[int, str]:
    """The batch that maximises tokens/s for a device budget: the largest whose KV cache on the device and
    prefill temporaries fit beside the streaming window.

    A decode step streams every weight once whatever the batch (its floor ``W / h2d`` is the same at batch
    1 and 256 until the batch's decode compute exceeds it), so tokens/s grows with the batch until device
    memory runs out: ``batch = floor((budget - window) / (kv + temp))`` with ``kv`` the KV cache bytes of one
    sequence (every layer: ``2 x kv_heads x head_dim x cache_len x itemsize``), ``temp`` the largest stage
    executable's temporaries for one sequence's prefill (XLA's ``memory_analysis`` of the batch-1 prefill,
    compiled here), ``window`` ``prefetch_depth + 1`` of the largest stage's weights plus resident stages.
    Over ``n`` data-parallel devices (``runtime.batch_axis``) every device holds ``B / n`` sequences and
    ``1 / n`` of the prefetched weights: the prefill is compiled at ``n`` and ``2n`` rows, its temporaries split
    into a fixed part (the gathered weights) and a part per sequence, and ``batch = n x floor((budget -
    window / n - fixed) / (kv + temp))``, a multiple of ``n`` (``budget`` per device).

    Args:
      stack: as for :func:`generate`.
      prompt_len, max_new_tokens: ints >= 1 (the cache is ``prompt_len`` bucketed plus ``max_new_tokens``,
        rounded up to ``prompt_bucket``, as :func:`generate` sizes it).
      device_budget_bytes: bytes for the stack on the device; default the free device memory.
      max_batch: upper bound of the answer (int >= 1).
      expert_fetch: ``"auto"``: for a stack that can fetch routed experts, the better in tokens per streamed
        byte of that batch and the largest routed one (:func:`xla_swap.hf.moe_decode.routed_batch`); ``"all"``: not.

    Returns: ``(batch, explanation)`` (``batch >= 1``, the explanation giving the figures). With per-rank
    batches (:mod:`xla_swap.distributed`; every rank calls it) the batch of each rank.

    Raises:
      ValueError: a bad argument; no budget given on a platform without memory statistics (the CPU).
      TypeError: ``stack`` not built from ``causal_lm_stages``; ``device_budget_bytes`` a bool or not a number.
    """
    if expert_fetch not in ("auto", "all"):
        raise ValueError(f"expert_fetch must be 'auto' or 'all', got {expert_fetch!r}")
    for name, v in (("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens), ("max_batch", max_batch),
                    ("prompt_bucket", prompt_bucket)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    ids = torch.zeros((1, prompt_len), dtype=torch.int64)
    _, _, _, p_len, cache_len, device_budget_bytes = _check_args(
        stack, ids, None, max_new_tokens, False, 1.0, None, None, None, None, None, "device", device_budget_bytes,
        None, prompt_bucket)
    n = _data_parallel_width(stack)
    with stack.torch_precision():
        gen = Generator(stack, 1, cache_len, "device", device_budget_bytes)
        temps = [prefill_temps(Generator(stack, b * n, cache_len, "device", device_budget_bytes) if b * n > 1
                                else gen, b * n, p_len, cache_len) for b in ((1, 2) if n > 1 else (1,))]
    if n > 1:   # per device: a fixed part (the gathered weights) and a part per sequence (each device holds B / n)
        marginal = max(t2 - t1 for t1, t2 in zip(*temps))
        fixed = max(max(0, t1 - (t2 - t1)) for t1, t2 in zip(*temps))
    else:       # one device: the batch-1 prefill's temporaries counted per sequence (an upper bound)
        marginal, fixed = max(temps[0]), 0
    budget, source = device_budget_bytes, "device_budget_bytes"
    if budget is None:
        stats = memory_stats(stack.runtime.activation_sharding)
        if stats is None:
            raise ValueError("device_budget_bytes is needed on a platform without memory statistics (the CPU)")
        budget, source = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0), "free device memory"
    per_seq = gen.kv_total + marginal
    window = gen.window if n == 1 else -(-gen.window // n)   # each device prefetches its 1/n shards
    per_device = max(1, (budget - window - fixed) // max(1, per_seq))
    batch = int(max(1, min(max_batch // n * n or 1, n * per_device)))
    why = (f"batch {batch}: {n} x ({source} {budget} B - streaming window {window} B - fixed temporaries {fixed} B) "
           f"/ (KV cache {gen.kv_total} B + prefill temporaries {marginal} B per sequence, cache_len {cache_len}), "
           f"at most max_batch {max_batch}" + (f", a multiple of the {n} data-parallel devices" if n > 1 else ""))
    info = routing_info(stack)
    if expert_fetch == "auto" and info.reason is None:
        batch, routed_why = routed_batch(stack, info, budget, per_seq, batch, max_batch)
        why = f"{routed_why}; {why}"
    if per_rank_batches():   # every rank's batch is a part of the global one
        batch = max(1, int(gather_ints([batch]).min()) // jax.process_count())
        why += f"; per rank {batch}: the least over the ranks / {jax.process_count()} ranks"
    return batch, why


def _data_parallel_width(stack) -> int:
    """How many devices a batch splits over: the activation sharding's devices when the stack splits the batch
    (``runtime.batch_axis``), else 1."""
    rt = stack.runtime
    return len(rt.activation_sharding.device_set) if rt.batch_axis is not None else 1


def prefill_temps(gen: Generator, batch: int, p_len: int, cache_len: int) -> list[int]:
    """Per stage executable of a ``batch``-row prefill: its temporaries plus outputs, bytes per device (XLA's
    ``memory_analysis``; compiled here, nothing runs)."""
    z = np.zeros
    exes = gen.streamer.executables((z((batch, p_len), np.int32), z((batch, cache_len), np.int32),
                                     z((batch, p_len), np.int32), np.int32(0)))
    out = []
    for exe in exes:
        mem = exe.memory_analysis()
        out.append(int(getattr(mem, "temp_size_in_bytes", 0) or 0) + int(getattr(mem, "output_size_in_bytes", 0) or 0))
    return out


def _check_args(stack, input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p,
                eos_token_id, pad_token_id, seed, kv_cache, device_budget_bytes, max_cache_len, prompt_bucket):
    """Every argument of :func:`generate` checked (nothing runs); returns the normalised values."""
    if not isinstance(getattr(stack, "generators", None), Generators):   # what a SwappedStack holds for generation
        raise TypeError(f"stack must be a SwappedStack, got {type(stack).__name__}")
    if not (stack.has_first and stack.has_last and isinstance(stack.modules[0], CausalLMFirst)
            and isinstance(stack.modules[-1], CausalLMLast)):
        raise TypeError("generate needs a SwappedStack built from xla_swap.causal_lm_stages(model) "
                        "(first=CausalLMFirst, last=CausalLMLast)")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() \
            or input_ids.dtype == torch.bool or input_ids.numel() == 0:
        raise TypeError(f"input_ids must be a non-empty integer torch.Tensor [batch, seq], got "
                        f"{type(input_ids).__name__}{tuple(getattr(input_ids, 'shape', ()))}")
    vocab = stack.modules[0].vocab_size
    check_index_range(input_ids, *token_id_bounds(stack.modules[0])[0])   # as forward and train_step check it
    if attention_mask is None:
        mask = torch.ones(tuple(input_ids.shape), dtype=torch.int64)   # on the host, as a given mask is
    else:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask must be a torch.Tensor of input_ids' shape {tuple(input_ids.shape)}, "
                             f"got {tuple(getattr(attention_mask, 'shape', ())) or type(attention_mask).__name__}")
        mask = attention_mask.to(torch.int64).cpu()
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError("attention_mask must be left-padded (every 0 before the row's first 1): right padding "
                             "would put the new tokens after the pads")
        if bool((mask.sum(1) == 0).any()):
            raise ValueError("attention_mask has a row without any token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    refuse_longrope_generation(stack.modules[0].causal_lm, input_ids.shape[1], max_new_tokens)
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {type(do_sample).__name__}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    gen_cfg = getattr(stack.modules[0].causal_lm, "generation_config", None)
    if eos_token_id is FROM_CONFIG:
        eos_token_id = getattr(gen_cfg, "eos_token_id", None)
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab for e in eos):
        raise ValueError(f"eos_token_id must be None, an int or a list of ints in [0, {vocab}), got {eos_token_id!r}")
    if pad_token_id is FROM_CONFIG:
        pad_token_id = getattr(gen_cfg, "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = eos[0] if eos else 0
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or not 0 <= pad_token_id < vocab:
        raise ValueError(f"pad_token_id must be an int in [0, {vocab}), got {pad_token_id!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be None or an int, got {type(seed).__name__}")
    if kv_cache not in _PLACEMENTS:
        raise ValueError(f"kv_cache must be one of {_PLACEMENTS}, got {kv_cache!r}")
    device_budget_bytes = check_budget_bytes(device_budget_bytes, "device_budget_bytes", optional=True)
    if isinstance(prompt_bucket, bool) or not isinstance(prompt_bucket, int) or prompt_bucket < 1:
        raise ValueError(f"prompt_bucket must be an int >= 1, got {prompt_bucket!r}")
    p_len = _round_up(input_ids.shape[1], prompt_bucket)
    need = p_len + max_new_tokens
    if max_cache_len is None:
        max_cache_len = _round_up(need, prompt_bucket)
    elif isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < need:
        raise ValueError(f"max_cache_len must be an int >= the bucketed prompt ({p_len}) + max_new_tokens "
                         f"({max_new_tokens}) = {need}, got {max_cache_len!r}")
    return mask, eos, pad_token_id, p_len, max_cache_len, device_budget_bytes


def generate(stack, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | Sequence[int] | None = FROM_CONFIG, pad_token_id: int | None = FROM_CONFIG,
             seed: int | None = None,
             kv_cache: str = "auto", device_budget_bytes: int | None = None, max_cache_len: int | None = None,
             prompt_bucket: int = 16, expert_fetch: str = "auto", expert_layout: str = "auto") -> torch.Tensor:
    """Generate tokens with ``stack`` (built from :func:`xla_swap.causal_lm_stages`), as ``model.generate``.

    See the module docstring for the design and how ``kv_cache="auto"`` places the cache.

    Args:
      stack: a ``SwappedStack(layers, first=first, last=last)`` of ``causal_lm_stages(model)``.
      input_ids: int ``[batch, prompt]`` token ids (CPU or CUDA torch tensor).
      attention_mask: ``None`` or ``[batch, prompt]`` of 0/1, left-padded (zeros before each
        row's first token), as a tokenizer with ``padding_side="left"`` gives it.
      max_new_tokens: tokens to generate at most (>= 1).
      do_sample: ``False``: greedy (argmax); ``True``: sample from the warped distribution.
      temperature, top_k, top_p: the warpers of ``transformers`` (used with ``do_sample``).
      eos_token_id: stop token(s), or ``None`` for none; default the model's
        ``generation_config.eos_token_id`` (as ``model.generate``).
      pad_token_id: what a stopped row gets; default ``generation_config.pad_token_id``; where that
        (or the value given) is ``None``, the first stop token, else 0.
      seed: the sampling seed (``None``: drawn from torch's generator, so ``torch.manual_seed``
        makes a call reproducible).
      kv_cache: ``"auto"`` (default), ``"device"`` or ``"host"`` (module docstring).
      device_budget_bytes: the device memory ``"auto"`` may fill (bytes; default: what is free).
      max_cache_len: the cache length (default the bucketed prompt plus ``max_new_tokens``, rounded
        up to ``prompt_bucket``); a fixed value keeps one set of decode executables for every call.
      prompt_bucket: prompts are left-padded to a multiple of it (one prefill executable per bucket).
      expert_fetch, expert_layout: mixture-of-experts layers: ``"auto"``, ``"routed"`` (copy only the experts a
        step's tokens were routed to) or ``"all"``; the routed slices cut from the stacked ``pinned_host`` weights
        (``"stacked"``), a buffer per expert (``"split"``) or by size (``"auto"``); :mod:`xla_swap.hf.moe_decode`,
        ``docs/how-to/mixture-of-experts-serving.md``.

    Returns: int64 ``[batch, prompt + n]`` CPU tensor: ``input_ids`` and the ``n <= max_new_tokens``
      generated tokens (``n < max_new_tokens`` when every row stopped; stopped rows padded). With per-rank
      batches (:mod:`xla_swap.distributed`): this rank's prompts in, its rows out (same batch size on every rank).
      ``stack.last_generation`` holds the placement, its explanation, the KV cache bytes,
      ``first_token_s`` (seconds from the start of the prefill to its token) and ``step_done_s``
      (per step, seconds to the read of its flag, one step late: use the median difference; a streamed step's
      first spans two steps, its last none). A mixture-of-experts model adds ``"experts"``: per step whether it
      was routed, the ``(layer, expert ids)`` it copied and why (:class:`xla_swap.hf.moe_decode.FetchPlan`).

    Raises (before anything runs):
      TypeError: ``stack`` not built from ``causal_lm_stages``; ``input_ids`` not an integer
        ``[batch, seq]`` tensor; ``do_sample`` not a bool; ``seed`` not an int.
      IndexError: an id outside ``[0, num_embeddings)`` of the input embedding, as torch's embedding
        raises (:func:`xla_swap.stack.checks.check_index_range`: the message names ``input_ids``, the
        value and the range).
      ValueError: ``attention_mask`` of another shape, not 0/1, right
        padded or with an empty row; ``max_new_tokens < 1``; ``temperature <= 0``; ``top_k < 1``;
        ``top_p`` outside (0, 1]; bad ``eos_token_id`` / ``pad_token_id``; unknown ``kv_cache``;
        ``device_budget_bytes`` not None or an int > 0 (TypeError for a bool or a non-number);
        ``max_cache_len`` below the bucketed prompt plus
        ``max_new_tokens``; ``prompt_bucket < 1``; a decoder layer that does not keep a
        ``transformers``-style KV cache (message names it); ``expert_fetch`` or ``expert_layout`` unknown;
        ``expert_fetch="routed"`` for a stack that cannot (no experts, several devices, ``param_dtype``).
    """
    check_fetch_args(expert_fetch, expert_layout)
    def check(ids, m, seed=seed):
        return _check_args(stack, ids, m, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
                           pad_token_id, seed, kv_cache, device_budget_bytes, max_cache_len, prompt_bucket)
    own = None   # with per-rank batches: (this rank's prompts, its rows of the global batch)
    if per_rank_batches():
        own, input_ids, attention_mask, seed = gather_prompts(check, input_ids, attention_mask, max_new_tokens,
                                                              do_sample, seed)
    mask, eos, pad, p_len, cache_len, device_budget_bytes = check(input_ids, attention_mask, seed)
    plan = FetchPlan(routing_info(stack), expert_fetch, input_ids.shape[0], p_len)
    if do_sample and seed is None:
        seed = int(torch.randint(0, 2 ** 31 - 1, ()).item())
    ids_cpu = input_ids.detach().to("cpu", torch.int64)
    sampling = (do_sample, float(temperature), top_k, None if top_p is None else float(top_p))
    out, info = _run(stack, ids_cpu, mask, sampling, (eos, pad, seed), (p_len, cache_len, max_new_tokens),
                     (kv_cache, device_budget_bytes, expert_layout), plan)
    if own is not None:
        ids_cpu, out = own[0], out[own[1]]
    if plan.has_experts:
        info["experts"] = plan.summary()
    stack.generators.record(info)
    return torch.cat([ids_cpu, torch.from_numpy(out.astype(np.int64))], dim=1)


def _run(stack, ids_cpu: torch.Tensor, mask: torch.Tensor, sampling: tuple, stops: tuple, lengths: tuple,
         placement: tuple, plan) -> tuple[np.ndarray, dict]:
    """The prefill and decode steps of :func:`generate` on checked arguments: ``(the generated tokens [B, n],
    the figures stack.last_generation gives)``. ``stops`` is ``(eos, pad, seed)``, ``lengths`` ``(p_len, cache_len,
    max_new_tokens)``, ``placement`` ``(kv_cache, device_budget_bytes, expert_layout)``."""
    (eos, pad, seed), (p_len, cache_len, max_new_tokens) = stops, lengths
    kv_cache, device_budget_bytes, expert_layout = placement
    expert_layout = plan.resolve_layout(stack, expert_layout)
    with stack.torch_precision():
        stack.runtime.release_prefetched()   # the streamer prefetches its own first stages
        gen = stack.generators.get(stack, ids_cpu.shape[0], cache_len, kv_cache, device_budget_bytes, plan.routing,
                                   expert_layout)
        select = gen.select_exe(sampling, len(eos), max_new_tokens, pad)
        st, prompt = _initial_state(ids_cpu, mask, p_len, cache_len, max_new_tokens, eos, pad, seed,
                                    stack.runtime.activation_sharding)
        out, n_done, first_s, done_s = _decode(gen, select, st, prompt, max_new_tokens, plan)
    info = dict(placement=gen.placement, explanation=gen.explanation, kv_cache_bytes=gen.kv_total,
                kv_cache_bytes_per_layer=gen.kv_nbytes, cache_len=cache_len, prompt_len=p_len,
                new_tokens=int(n_done), first_token_s=first_s, step_done_s=done_s)
    return out, info


def _initial_state(ids_cpu: torch.Tensor, mask: torch.Tensor, p_len: int, cache_len: int, max_new_tokens: int,
                   eos: list, pad: int, seed: int | None, act) -> tuple[dict, jax.Array]:
    """``(state, prompt)`` on the devices of ``act``: the decode state (the mask over the cache,
    position ids ``cumsum(mask) - 1`` as ``GenerationMixin`` builds them, and what
    :func:`xla_swap.hf.sampling.next_token_step` reads) and the prompt ids left-padded to ``p_len``."""
    b, t0 = ids_cpu.shape
    pad_left = p_len - t0
    ids = np.zeros((b, p_len), np.int32)
    ids[:, pad_left:] = ids_cpu.numpy()
    full_mask = np.zeros((b, cache_len), np.int32)
    full_mask[:, pad_left:p_len] = mask.numpy()
    pos = np.cumsum(full_mask[:, :p_len], axis=1) - 1
    pos = np.where(full_mask[:, :p_len] == 0, 0, pos).astype(np.int32)
    st = jax.device_put(dict(
        mask=full_mask, pos=pos, offset=np.int32(0), t=np.int32(p_len), running=np.ones((b,), bool),
        step=np.int32(0), out=np.full((b, max_new_tokens), pad, np.int32),
        eos=np.asarray(eos or [0], np.int32), key=np.asarray(jax.random.PRNGKey(seed or 0)),
        ids=np.zeros((b, 1), np.int32),
        any_running=np.bool_(True)), act)
    return st, jax.device_put(ids, act)


def _decode(gen: Generator, select, st: dict, prompt: jax.Array, max_new_tokens: int, plan=None) -> tuple:
    """Prefill and decode steps until every row stopped or ``max_new_tokens``: ``(tokens int32 [B, n],
    n, first_token_s, step_done_s)`` (seconds from the start; each step's flag is read one step late,
    so the device never waits for the host). ``plan``: a :class:`xla_swap.hf.moe_decode.FetchPlan` (applied
    to the generator's ``routed_experts``) or ``None``."""
    plan = plan if gen.routed_experts is not None else None
    t_start = time.perf_counter()
    x = (prompt, st["mask"], st["pos"], st["offset"])
    done_s: list[float] = []
    first_s = float("nan")
    pending = None   # the previous step's any_running flag (read one step late: the device never waits)
    n_done = max_new_tokens
    for step in range(max_new_tokens):
        if plan is not None:
            plan.before_step(gen.routed_experts, step)
        logits = gen.streamer.run(x)
        if plan is not None:
            plan.after_step(gen.routed_experts)
        st = select(logits, st)
        x = (st["ids"], st["mask"], st["pos"], st["offset"])
        if step >= 1:   # step - 1 is done once its flag is read (after step is dispatched: no device idle)
            alive = bool(pending)
            if step >= 2:
                done_s.append(time.perf_counter() - t_start)
            if not alive:
                n_done = step
                break
        pending = st["any_running"]
        if step == 0:   # the prefill's token: time to first token (the next step's weights are already in flight)
            jax.block_until_ready(pending)
            first_s = time.perf_counter() - t_start
            done_s.append(first_s)
    else:
        jax.block_until_ready(st["out"])
        done_s.append(time.perf_counter() - t_start)
    return np.asarray(st["out"])[:, :n_done], n_done, first_s, done_s
