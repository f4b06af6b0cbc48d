"""Text generation through a ``SwappedStack`` of ``causal_lm_stages(model)``: prefill, then decode
steps that reuse per-layer KV caches (``SwappedStack.generate`` calls :func:`generate`).

How it runs the model's own code:

* **Cache.** Each decoder layer, unmodified, gets a small cache object (:class:`_LayerKV`, shaped
  like ``transformers``' ``Cache`` as the layers and ``transformers.masking_utils`` call it) in
  its ``cache`` / ``past_key_values`` argument. Its ``update(key_states, value_states, ...)``
  writes the new keys and values into the layer's fixed-size ``[batch, kv_heads, cache_len,
  head_dim]`` tensors at the current offset (``jax.lax.dynamic_update_slice``) and returns the
  whole tensors, as ``transformers``' ``StaticCache`` does.
* **Masks.** The first stage runs the base model's forward (as :class:`xla_swap.hf.CausalLMFirst`
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

The module imports torch, torchax (through :mod:`xla_swap.stack`) and jax.
"""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from xla_swap.executors.decode import StatefulStreamer, state_nbytes
from xla_swap.hf import CausalLMFirst, CausalLMLast, _Capture, _is_const, _is_tensor_tree, _Stop, _Swapped

__all__ = ["generate", "choose_batch", "release_generation", "kv_cache_bytes", "FROM_CONFIG"]

#: carry key of the cache offset (int32 scalar: the cache slot of the step's first token).
_OFFSET = "xla_swap.kv_offset"
_PLACEMENTS = ("auto", "device", "host")


class _FromConfig:
    """Default of ``eos_token_id`` / ``pad_token_id``: the model's ``generation_config`` value (``None`` means none)."""

    def __repr__(self) -> str:
        return "FROM_CONFIG"


FROM_CONFIG = _FromConfig()


def kv_cache_bytes(batch: int, kv_heads: int, head_dim: int, cache_len: int, itemsize: int) -> int:
    """Bytes of one layer's KV cache: ``2 x batch x kv_heads x head_dim x cache_len x itemsize`` (keys and values)."""
    return 2 * int(batch) * int(kv_heads) * int(head_dim) * int(cache_len) * int(itemsize)


class _LayerKV:
    """What a decoder layer gets as its cache inside a stage: its own keys and values.

    ``update(key_states, value_states, ...)`` (``[batch, kv_heads, T, head_dim]`` torchax tensors)
    writes them at slot ``offset`` of the ``[batch, kv_heads, cache_len, head_dim]`` cache and
    returns the whole keys and values. ``get_mask_sizes`` / ``get_query_offset`` tell
    ``transformers.masking_utils`` the key length (``cache_len``) and the query offset.
    Without a cache (``kv=None``: the first stage, which only builds masks, and the trace that
    finds the cache's shape) ``update`` starts from zeros.
    """

    is_compileable = True   # masking_utils: never skip the decode mask for SDPA's is_causal

    def __init__(self, env, kv, offset, cache_len: int, n_layers: int):
        self._env, self.kv, self.offset, self.cache_len = env, kv, offset, int(cache_len)
        self.is_sliding = [False] * n_layers
        self.is_linear = [False] * n_layers
        self.is_dummy = [False] * n_layers
        self.updated = False

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.cache_len, 0

    def get_query_offset(self, layer_idx: int = 0):
        return self.offset if isinstance(self.offset, int) else self._env.j2t_iso(self.offset)

    def get_seq_length(self, layer_idx: int = 0):
        return self.get_query_offset(layer_idx)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.cache_len

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        k, v = self._env.t2j_iso((key_states, value_states))
        if self.kv is None:
            shape = k.shape[:2] + (self.cache_len,) + k.shape[3:]
            self.kv = (jnp.zeros(shape, k.dtype), jnp.zeros(v.shape[:2] + (self.cache_len,) + v.shape[3:], v.dtype))
        ck, cv = self.kv
        for name, new, old in (("keys", k, ck), ("values", v, cv)):
            if new.ndim != 4 or new.shape[:2] != old.shape[:2] or new.shape[3:] != old.shape[3:] \
                    or new.dtype != old.dtype:
                raise ValueError(f"the layer gives its cache {name} of {new.shape} {new.dtype}, the cache holds "
                                 f"{old.shape} {old.dtype}: not the [batch, kv_heads, T, head_dim] layout of "
                                 "transformers' caches")
        start = self.offset
        self.kv = (jax.lax.dynamic_update_slice_in_dim(ck, k, start, axis=2),
                   jax.lax.dynamic_update_slice_in_dim(cv, v, start, axis=2))
        self.updated = True
        return self._env.j2t_iso(self.kv)


def _round_up(x: int, m: int) -> int:
    return -(-int(x) // int(m)) * int(m)


class _Generator:
    """The stage functions and the :class:`StatefulStreamer` of one (batch, cache length, placement)."""

    def __init__(self, stack, batch: int, cache_len: int, kv_cache: str, budget: int | None):
        from xla_swap.stack import _TIED, _compute_in, _module_fn, _signature
        first, last = stack.modules[0], stack.modules[-1]
        env = stack._env
        rt = stack.runtime
        n_layers = len(stack.modules) - 2
        self.batch, self.cache_len = batch, cache_len
        self.runtime = rt   # (not the stack: no reference cycle through stack._generators)
        self.matmul_precision = stack.matmul_precision
        base_params = set(first._accepts)
        cache_kw = "cache" if "cache" in base_params else "past_key_values"
        self.cache_kw = cache_kw
        layer_keys = list(first.layer_keys)
        tied = dict(stack.tied)
        tr_first = stack.transposed[0]
        consts: dict[int, dict] = {}   # per group: the constant keyword values the model passes (found while tracing)
        seen_kw: dict[str, str] = {}    # "cache": the keyword the model hands its layers the cache in (found while tracing)

        ffn = _module_fn(_DecodeFirst(first, env, cache_kw, cache_len, n_layers, layer_keys, consts, seen_kw), env,
                         tr_first)

        def first_stage(w, inputs):
            h, kw = ffn(w, tuple(inputs))
            kw = dict(kw)
            for nl, nf in tied.items():
                kw[_TIED + nl] = jnp.swapaxes(w[nf], 0, 1) if nf in tr_first else w[nf]
            return h, kw

        fns = [first_stage]
        shared: dict = {}
        for i, m in enumerate(stack.modules[1:-1]):
            key = (_signature(m), layer_keys[i])
            if key not in shared:
                lfn = _module_fn(m, env, stack.transposed[1 + i])

                def layer_stage(w, x, lfn=lfn, g=layer_keys[i], cls=type(m).__name__):
                    kv, (h, kw) = x
                    cache = _LayerKV(env, kv, kw[_OFFSET], cache_len, n_layers)
                    kwargs = _select(kw, g)
                    kwargs.update(consts.get(g, {}))
                    kwargs[seen_kw.get("cache", cache_kw)] = cache
                    out = lfn(w, (h,), kwargs)
                    if isinstance(out, (tuple, list)):
                        out = out[0]
                    if not cache.updated:
                        name = seen_kw.get("cache", cache_kw)
                        raise ValueError(f"{cls} did not call {name}.update(keys, values, ...): "
                                         "generation needs decoder layers that keep a transformers-style KV cache")
                    return (out, kw), cache.kv
                shared[key] = layer_stage
            fns.append(shared[key])
        tr_last = stack.transposed[-1]
        lastfn = _module_fn(last, env, tr_last)

        def last_stage(w, carry):
            h, kw = carry
            if tied:
                w = {**w, **{nl: kw[_TIED + nl] for nl in tied}}
            logits = lastfn(w, (h[:, -1:],))
            return logits[:, 0].astype(jnp.float32)
        fns.append(last_stage)

        if stack.param_dtype is not None:
            wrapped: dict[int, Any] = {}
            for i, f in enumerate(fns):
                if id(f) not in wrapped:
                    wrapped[id(f)] = _compute_in(f, frozenset(stack._trainable[i]), jnp.bfloat16, stack._cast_inputs)
                fns[i] = wrapped[id(f)]
        # the streamer's form: layers take (params, state, x)
        stage_fns: list = []
        adapted: dict[int, Any] = {}
        for i, f in enumerate(fns):
            if 0 < i < len(fns) - 1:
                if id(f) not in adapted:
                    adapted[id(f)] = (lambda p, s, x, f=f: f(p, (s, x)))
                stage_fns.append(adapted[id(f)])
            else:
                stage_fns.append(f)
        self._stage_fns = stage_fns

        # the cache's shape and dtype: a trace of each distinct layer function from a zero cache
        act = rt.activation_sharding
        prefill_in = self._inputs_aval(1)
        pav = [jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), p) for p in rt.host_params]
        with jax.default_matmul_precision(stack.matmul_precision):
            try:
                carry = jax.eval_shape(stage_fns[0], pav[0], prefill_in)
            except ValueError:   # ours (names the base model and the keyword)
                raise
            except Exception as e:  # noqa: BLE001 - re-raised naming the stage
                raise ValueError(f"first ({type(first._base).__name__}.forward with a KV cache) does not trace: "
                                 f"{type(e).__name__}: {e}") from e
            avals: list = [None]
            seen: dict[int, Any] = {}
            for i in range(1, len(stage_fns) - 1):
                f = stage_fns[i]
                if id(f) not in seen:
                    try:
                        seen[id(f)] = jax.eval_shape(f, pav[i], None, carry)[1]
                    except ValueError:   # ours (names the layer class) or the model's own check
                        raise
                    except Exception as e:  # noqa: BLE001 - re-raised naming the layer
                        raise ValueError(f"layers[{i - 1}] ({type(stack.modules[i]).__name__}) does not trace with a "
                                         f"KV cache: {type(e).__name__}: {e}") from e
                avals.append(seen[id(f)])
            avals.append(None)
        #: per layer, bytes of its KV cache.
        self.kv_nbytes = [state_nbytes(a) for a in avals[1:-1]]
        kv_total = sum(self.kv_nbytes)
        window = (rt.prefetch_depth + 1) * max(rt.stage_nbytes) + sum(
            b for b, r in zip(rt.stage_nbytes, rt.resident) if r)
        if kv_cache == "auto":
            free, source = budget, "device_budget_bytes"
            if free is None:
                stats = _memory_stats(act)
                free = None if stats is None else stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
                source = "free device memory" if free is not None else "no memory statistics (CPU): fits"
            fits = free is None or kv_total + window <= free
            placement = "device" if fits else "host"
            why = (f"KV cache {kv_total} B ({len(self.kv_nbytes)} layers x 2 x batch {batch} x cache_len {cache_len} "
                   f"x kv_heads x head_dim x itemsize) + streaming window {window} B "
                   f"{'<=' if fits else '>'} {source}" + (f" {free} B" if free is not None else ""))
        else:
            placement, why = kv_cache, f"kv_cache={kv_cache!r} given"
        self.placement, self.explanation = placement, why
        self.kv_total, self.window = kv_total, window
        self.streamer = StatefulStreamer(stage_fns, rt.host_params, rt.device_shardings, state_avals=avals,
                                         activation_sharding=act, state_on_host=placement == "host",
                                         prefetch_depth=rt.prefetch_depth, resident=rt.resident)
        self._select_exes: dict = {}

    def _inputs_aval(self, t: int):
        b, L = self.batch, self.cache_len
        i32 = jnp.int32
        return (jax.ShapeDtypeStruct((b, t), i32), jax.ShapeDtypeStruct((b, L), i32),
                jax.ShapeDtypeStruct((b, t), i32), jax.ShapeDtypeStruct((), i32))

    def select_exe(self, sampling: tuple, n_eos: int, max_new: int, pad: int):
        """``(logits, state) -> state``: the next token, the rows still running and the next step's inputs."""
        key = (sampling, n_eos, max_new, pad)
        exe = self._select_exes.get(key)
        if exe is None:
            do_sample, temperature, top_k, top_p = sampling

            def step(logits, st):
                scores = logits
                if do_sample:
                    scores = _warp(scores, temperature, top_k, top_p)
                    tok = jax.random.categorical(jax.random.fold_in(st["key"], st["step"]), scores, axis=-1)
                else:
                    tok = jnp.argmax(scores, axis=-1)
                tok = tok.astype(jnp.int32)
                running = st["running"]
                tok = jnp.where(running, tok, pad)
                if n_eos:
                    running = running & ~jnp.isin(tok, st["eos"])
                slot = st["offset"] + st["t"]
                mask = jax.lax.dynamic_update_slice_in_dim(st["mask"], jnp.ones((tok.shape[0], 1), jnp.int32), slot,
                                                           axis=1)
                out = jax.lax.dynamic_update_slice_in_dim(st["out"], tok[:, None], st["step"], axis=1)
                return dict(st, ids=tok[:, None], mask=mask, pos=st["pos"][:, -1:] + 1, offset=slot,
                            t=jnp.int32(1), running=running, step=st["step"] + 1, out=out,
                            any_running=jnp.any(running))
            exe = jax.jit(step)
            self._select_exes[key] = exe
        return exe


def _select(kw: dict, g) -> dict:
    """The keyword tensors of a layer of group ``g`` from the decode carry."""
    out = {}
    for name, v in kw.items():
        if name == _OFFSET or name.startswith("xla_swap.tied:"):
            continue
        base, _, grp = name.partition("@")
        if not grp or grp == str(g):
            out[base] = v
    return out


def _warp(scores, temperature: float, top_k: int | None, top_p: float | None):
    """``transformers``' temperature, top-k and top-p logits warpers, in that order (float32 ``[B, V]``)."""
    if temperature != 1.0:
        scores = scores / temperature
    if top_k is not None:
        k = min(int(top_k), scores.shape[-1])
        kth = jax.lax.top_k(scores, k)[0][..., -1:]
        scores = jnp.where(scores < kth, -jnp.inf, scores)
    if top_p is not None and top_p < 1.0:
        # ascending sort; drop the tokens whose cumulative probability is <= 1 - top_p (keep at least one)
        order = jnp.argsort(scores, axis=-1)
        s_sorted = jnp.take_along_axis(scores, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(s_sorted, axis=-1), axis=-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted = remove_sorted.at[..., -1].set(False)
        remove = jnp.zeros_like(remove_sorted).at[jnp.arange(scores.shape[0])[:, None], order].set(remove_sorted)
        scores = jnp.where(remove, -jnp.inf, scores)
    return scores


def _memory_stats(sharding) -> dict | None:
    try:
        d = next(iter(sharding.device_set))
        return d.memory_stats()
    except Exception:  # noqa: BLE001 - a platform without statistics
        return None


class _DecodeFirst(torch.nn.Module):
    """The base model's forward up to the first decoder layer, with a cache: ``forward(input_ids [B, T],
    attention_mask [B, cache_len], position_ids [B, T], offset [])`` returns ``(h, carry)``, the carry
    holding the keyword tensors the model passes its layers (a key ``name@g`` for group ``g``'s
    layers only) and the offset. Parameters are ``first``'s."""

    def __init__(self, first: CausalLMFirst, env, cache_kw: str, cache_len: int, n_layers: int, layer_keys: list,
                 consts: dict, seen_kw: dict):
        super().__init__()
        object.__setattr__(self, "_first", first)
        object.__setattr__(self, "_env", env)
        for name, child in first.named_children():
            self.add_module(name, child)
        self._cache_kw, self._cache_len, self._n = cache_kw, cache_len, n_layers
        self._keys = layer_keys
        object.__setattr__(self, "_consts", consts)
        object.__setattr__(self, "_seen_kw", seen_kw)

    def forward(self, input_ids, attention_mask, position_ids, offset):
        first = self._first
        record: list = []
        n = len(first._signatures)
        caps = torch.nn.ModuleList([_Capture(i, s, record, i == n - 1) for i, s in enumerate(first._signatures)])
        cache = _LayerKV(self._env, None, self._env.t2j_iso(offset), self._cache_len, self._n)
        kw = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              self._cache_kw: cache}
        if "use_cache" in first._accepts:
            kw["use_cache"] = True
        if "cache_position" in first._accepts:
            kw["cache_position"] = torch.arange(input_ids.shape[1], dtype=torch.int32) + offset
        with _Swapped((first._base, first._layer_attr, caps)):
            try:
                first._base(**kw)
            except _Stop:
                pass
        if len(record) != n:
            raise ValueError(f"{type(first._base).__name__}.forward called {len(record)} of its {n} decoder layers")
        h = record[0][0]
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(self._keys):
            groups.setdefault(g, []).append(i)
        carry: dict[str, Any] = {_OFFSET: offset}
        for name in record[0][1]:
            values = [k[name] for _, k in record]
            if all(v is cache for v in values):   # the cache, under the layers' own name (past_key_values, layer_past)
                self._seen_kw["cache"] = name
                continue
            if all(_is_const(v) for v in values):
                for g, idx in groups.items():
                    self._consts.setdefault(g, {})[name] = values[idx[0]]
                continue
            for i, v in enumerate(values):
                if not (v is None or _is_tensor_tree(v)):
                    raise ValueError(f"{type(first._base).__name__}.forward passes decoder layer {i} {name}= a "
                                     f"{type(v).__name__} while generating: only tensors and constants are supported")
            if all(v is values[0] for v in values):
                carry[name] = values[0]
                continue
            for g, idx in groups.items():
                carry[f"{name}@{g}"] = values[idx[0]]
        return h, carry


def _generator(stack, batch: int, cache_len: int, kv_cache: str, budget) -> _Generator:
    """The stack's generator for these shapes (one at a time: a new one drops the previous KV cache)."""
    key = (batch, cache_len, kv_cache, budget, stack.matmul_precision, id(stack.runtime))
    gens = stack.__dict__.setdefault("_generators", {})
    gen = gens.get(key)
    if gen is None or gen.runtime is not stack.runtime:
        gens.clear()
        gen = _Generator(stack, batch, cache_len, kv_cache, budget)
        gens[key] = gen
    return gen


def release_generation(stack) -> None:
    """Free what :func:`generate` keeps in ``stack`` between calls: the KV cache (device or ``pinned_host``), the
    weights prefetched for the next step and the decode executables. The next ``generate`` builds them again."""
    stack.__dict__.pop("_generators", None)


def choose_batch(stack, prompt_len: int, max_new_tokens: int, *, device_budget_bytes: int | None = None,
                 max_batch: int = 1024, prompt_bucket: int = 16) -> tuple[int, str]:
    """The batch that maximises tokens/s for a device budget: the largest whose KV cache on the device and
    prefill temporaries fit beside the streaming window.

    A decode step streams every weight once whatever the batch (its floor ``W / h2d`` is the same at batch
    1 and 256 until the batch's decode compute exceeds it), so tokens/s grows with the batch until device
    memory runs out: ``batch = floor((budget - window) / (kv + temp))`` with ``kv`` the KV cache bytes of one
    sequence (every layer: ``2 x kv_heads x head_dim x cache_len x itemsize``), ``temp`` the largest stage
    executable's temporaries for one sequence's prefill (XLA's ``memory_analysis`` of the batch-1 prefill,
    compiled here), ``window`` ``prefetch_depth + 1`` of the largest stage's weights plus resident stages.

    Args:
      stack: as for :func:`generate`.
      prompt_len, max_new_tokens: ints >= 1 (the cache is ``prompt_len`` bucketed plus ``max_new_tokens``,
        rounded up to ``prompt_bucket``, as :func:`generate` sizes it).
      device_budget_bytes: bytes for the stack on the device; default the free device memory.
      max_batch: upper bound of the answer (int >= 1).

    Returns: ``(batch, explanation)`` (``batch >= 1``, the explanation giving the figures).

    Raises:
      ValueError: a bad argument; no budget given on a platform without memory statistics (the CPU).
      TypeError: ``stack`` not built from ``causal_lm_stages``.
    """
    for name, v in (("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens), ("max_batch", max_batch),
                    ("prompt_bucket", prompt_bucket)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    ids = torch.zeros((1, prompt_len), dtype=torch.int64)
    _, _, _, p_len, cache_len = _check_args(stack, ids, None, max_new_tokens, False, 1.0, None, None, None, None,
                                            None, "device", device_budget_bytes, None, prompt_bucket)
    with stack._torch_precision():
        gen = _Generator(stack, 1, cache_len, "device", device_budget_bytes)
        streamer = gen.streamer
        chain = streamer._signature((np.zeros((1, p_len), np.int32), np.zeros((1, cache_len), np.int32),
                                     np.zeros((1, p_len), np.int32), np.int32(0)))
        temp = 0
        for i in range(streamer.num_stages):
            exe = streamer._exe(i, chain[i])
            mem = exe.memory_analysis()
            temp = max(temp, int(getattr(mem, "temp_size_in_bytes", 0) or 0) + int(
                getattr(mem, "output_size_in_bytes", 0) or 0))
    budget, source = device_budget_bytes, "device_budget_bytes"
    if budget is None:
        stats = _memory_stats(stack.runtime.activation_sharding)
        if stats is None:
            raise ValueError("device_budget_bytes is needed on a platform without memory statistics (the CPU)")
        budget, source = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0), "free device memory"
    per_seq = gen.kv_total + temp
    batch = int(max(1, min(max_batch, (budget - gen.window) // max(1, per_seq))))
    why = (f"batch {batch}: ({source} {budget} B - streaming window {gen.window} B) / (KV cache {gen.kv_total} B + "
           f"prefill temporaries {temp} B per sequence, cache_len {cache_len}), at most max_batch {max_batch}")
    return batch, why


def _check_args(stack, input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p,
                eos_token_id, pad_token_id, seed, kv_cache, device_budget_bytes, max_cache_len, prompt_bucket):
    """Every argument of :func:`generate` checked (nothing runs); returns the normalised values."""
    from xla_swap.stack import SwappedStack
    if not isinstance(stack, SwappedStack):
        raise TypeError(f"stack must be a SwappedStack, got {type(stack).__name__}")
    if not (stack.has_first and stack.has_last and isinstance(stack.modules[0], CausalLMFirst)
            and isinstance(stack.modules[-1], CausalLMLast)):
        raise TypeError("generate needs a SwappedStack built from xla_swap.causal_lm_stages(model) "
                        "(first=CausalLMFirst, last=CausalLMLast)")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() \
            or input_ids.dtype == torch.bool or input_ids.numel() == 0:
        raise TypeError(f"input_ids must be a non-empty integer torch.Tensor [batch, seq], got "
                        f"{type(input_ids).__name__}{tuple(getattr(input_ids, 'shape', ()))}")
    vocab = stack.modules[0]._vocab
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids holds ids outside [0, {vocab})")
    if attention_mask is None:
        mask = torch.ones_like(input_ids, dtype=torch.int64)
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
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {type(do_sample).__name__}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    gen_cfg = getattr(stack.modules[0]._model, "generation_config", None)
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
    if device_budget_bytes is not None and (isinstance(device_budget_bytes, bool)
                                            or not isinstance(device_budget_bytes, int) or device_budget_bytes <= 0):
        raise ValueError(f"device_budget_bytes must be None or a positive int (bytes), got {device_budget_bytes!r}")
    if isinstance(prompt_bucket, bool) or not isinstance(prompt_bucket, int) or prompt_bucket < 1:
        raise ValueError(f"prompt_bucket must be an int >= 1, got {prompt_bucket!r}")
    p_len = _round_up(input_ids.shape[1], prompt_bucket)
    need = p_len + max_new_tokens
    if max_cache_len is None:
        max_cache_len = _round_up(need, prompt_bucket)
    elif isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < need:
        raise ValueError(f"max_cache_len must be an int >= the bucketed prompt ({p_len}) + max_new_tokens "
                         f"({max_new_tokens}) = {need}, got {max_cache_len!r}")
    return mask, eos, pad_token_id, p_len, max_cache_len


def generate(stack, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | Sequence[int] | None = FROM_CONFIG, pad_token_id: int | None = FROM_CONFIG,
             seed: int | None = None,
             kv_cache: str = "auto", device_budget_bytes: int | None = None, max_cache_len: int | None = None,
             prompt_bucket: int = 16) -> torch.Tensor:
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

    Returns: int64 ``[batch, prompt + n]`` CPU tensor: ``input_ids`` and the ``n <= max_new_tokens``
      generated tokens (``n < max_new_tokens`` when every row stopped; stopped rows padded).
      ``stack.last_generation`` holds the placement, its explanation, the KV cache bytes,
      ``first_token_s`` (seconds from the start of the prefill to its token) and ``step_done_s``
      (per step, seconds from that start to the step's token, read one step late: differences
      are decode step times).

    Raises (before anything runs):
      TypeError: ``stack`` not built from ``causal_lm_stages``; ``input_ids`` not an integer
        ``[batch, seq]`` tensor; ``do_sample`` not a bool; ``seed`` not an int.
      ValueError: an id outside the vocabulary; ``attention_mask`` of another shape, not 0/1, right
        padded or with an empty row; ``max_new_tokens < 1``; ``temperature <= 0``; ``top_k < 1``;
        ``top_p`` outside (0, 1]; bad ``eos_token_id`` / ``pad_token_id``; unknown ``kv_cache``;
        ``device_budget_bytes <= 0``; ``max_cache_len`` below the bucketed prompt plus
        ``max_new_tokens``; ``prompt_bucket < 1``; a decoder layer that does not keep a
        ``transformers``-style KV cache (message names it).
    """
    mask, eos, pad, p_len, cache_len = _check_args(
        stack, input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id,
        pad_token_id, seed, kv_cache, device_budget_bytes, max_cache_len, prompt_bucket)
    if do_sample and seed is None:
        seed = int(torch.randint(0, 2 ** 31 - 1, ()).item())
    b, t0 = input_ids.shape
    ids_cpu = input_ids.detach().to("cpu", torch.int64)
    with stack._torch_precision():
        stack.runtime.release_prefetched()   # the streamer prefetches its own first stages
        gen = _generator(stack, b, cache_len, kv_cache, device_budget_bytes)
        pad_left = p_len - t0
        ids = np.zeros((b, p_len), np.int32)
        ids[:, pad_left:] = ids_cpu.numpy()
        full_mask = np.zeros((b, cache_len), np.int32)
        full_mask[:, pad_left:p_len] = mask.numpy()
        pos = np.cumsum(full_mask[:, :p_len], axis=1) - 1
        pos = np.where(full_mask[:, :p_len] == 0, 0, pos).astype(np.int32)
        act = stack.runtime.activation_sharding
        sampling = (do_sample, float(temperature), top_k, None if top_p is None else float(top_p))
        select = gen.select_exe(sampling, len(eos), max_new_tokens, pad)
        st = jax.device_put(dict(
            mask=full_mask, pos=pos, offset=np.int32(0), t=np.int32(p_len), running=np.ones((b,), bool),
            step=np.int32(0), out=np.full((b, max_new_tokens), pad, np.int32),
            eos=np.asarray(eos or [0], np.int32), key=np.asarray(jax.random.PRNGKey(seed or 0)),
            ids=np.zeros((b, 1), np.int32),
            any_running=np.bool_(True)), act)
        t_start = time.perf_counter()
        x = (jax.device_put(ids, act), st["mask"], st["pos"], st["offset"])
        done_s: list[float] = []
        first_s = float("nan")
        pending = None   # the previous step's any_running flag (read one step late: the device never waits)
        n_done = max_new_tokens
        for step in range(max_new_tokens):
            logits = gen.streamer.run(x)
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
        out = np.asarray(st["out"])[:, :n_done]
    stack.last_generation = dict(placement=gen.placement, explanation=gen.explanation, kv_cache_bytes=gen.kv_total,
                                 kv_cache_bytes_per_layer=gen.kv_nbytes, cache_len=cache_len, prompt_len=p_len,
                                 new_tokens=int(n_done), first_token_s=first_s, step_done_s=done_s)
    return torch.cat([ids_cpu, torch.from_numpy(out.astype(np.int64))], dim=1)
