"""The KV cache the decoder layers see while :mod:`xla_swap.hf.generate` runs them: :class:`LayerKV` (one
layer's static cache, shaped like ``transformers``' ``Cache``) and :class:`DecodeFirst` (the base
model's forward up to the first decoder layer, with a cache: the masks, position ids and keyword
tensors every layer gets, by the model's own code).

``update(key_states, value_states, ...)`` writes the new keys and values into the layer's
fixed-size ``[batch, kv_heads, cache_len, head_dim]`` tensors at the current offset
(``jax.lax.dynamic_update_slice``) and returns the whole tensors, as ``transformers``'
``StaticCache`` does.

The module imports torch and jax; torchax only through the environment it is given.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch

from xla_swap.hf.causal_lm import CausalLMFirst
from xla_swap.hf.capture import StopForward, Swapped, is_const, is_tensor_tree
from xla_swap.stack.stages import TIED

__all__ = ["OFFSET", "kv_cache_bytes", "LayerKV", "layer_kwargs", "DecodeFirst"]

#: carry key of the cache offset (int32 scalar: the cache slot of the step's first token).
OFFSET = "xla_swap.kv_offset"


def kv_cache_bytes(batch: int, kv_heads: int, head_dim: int, cache_len: int, itemsize: int) -> int:
    """Bytes of one layer's KV cache: ``2 x batch x kv_heads x head_dim x cache_len x itemsize`` (keys and values)."""
    return 2 * int(batch) * int(kv_heads) * int(head_dim) * int(cache_len) * int(itemsize)


class LayerKV:
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
        """``(cache_len, 0)``: the masks span the whole fixed-size cache (``transformers`` Cache interface)."""
        return self.cache_len, 0

    def get_query_offset(self, layer_idx: int = 0):
        """The position of the first new token in the cache (an int, or a 0-d torchax tensor while traced)."""
        return self.offset if isinstance(self.offset, int) else self._env.j2t_iso(self.offset)

    def get_seq_length(self, layer_idx: int = 0):
        """Tokens already in the cache: :meth:`get_query_offset` (``transformers`` Cache interface)."""
        return self.get_query_offset(layer_idx)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """``cache_len``, the fixed cache length (``transformers`` Cache interface)."""
        return self.cache_len

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        """Write ``key_states`` / ``value_states`` ``[batch, kv_heads, new, head_dim]`` into the cache at the
        query offset (a dynamic-update-slice) and return the whole cache ``(keys, values)``, as
        ``transformers``' ``Cache.update`` does. Raises ValueError when their shape or dtype differs
        from the cache's.
        """
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


def layer_kwargs(kw: dict, g) -> dict:
    """The keyword tensors of a layer of group ``g`` from the decode carry."""
    out = {}
    for name, v in kw.items():
        if name == OFFSET or name.startswith(TIED):
            continue
        base, _, grp = name.partition("@")
        if not grp or grp == str(g):
            out[base] = v
    return out


class DecodeFirst(torch.nn.Module):
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
        for name, p in first.named_parameters(recurse=False):   # the base's own tensors (own_<name>)
            self.register_parameter(name, p)
        for name, b in first.named_buffers(recurse=False):
            self.register_buffer(name, b)
        self._cache_kw, self._cache_len, self._n = cache_kw, cache_len, n_layers
        self._keys = layer_keys
        object.__setattr__(self, "_consts", consts)
        object.__setattr__(self, "_seen_kw", seen_kw)

    def forward(self, input_ids, attention_mask, position_ids, offset):
        """The model's own first stage for a prefill or decode step at cache ``offset``: the first layer's
        input and the keyword arguments each layer gets (``CausalLMFirst.run_layers`` with the cache)."""
        first = self._first
        record: list = []
        n = len(first.layer_signatures)
        caps = first.captures(record, stop=True)
        cache = LayerKV(self._env, None, self._env.t2j_iso(offset), self._cache_len, self._n)
        kw = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              self._cache_kw: cache}
        if "use_cache" in first.base_keywords:
            kw["use_cache"] = True
        if "cache_position" in first.base_keywords:
            kw["cache_position"] = torch.arange(input_ids.shape[1], dtype=torch.int32) + offset
        with Swapped((first.base_module, first.layer_attr, caps)), first.kept_attributes():
            try:
                first.call_base(kw, self)
            except StopForward:
                pass
        if len(record) != n:
            raise ValueError(f"{type(first.base_module).__name__}.forward called {len(record)} of its {n} decoder layers")
        h = record[0][0]
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(self._keys):
            groups.setdefault(g, []).append(i)
        carry: dict[str, Any] = {OFFSET: offset}
        for name in record[0][1]:
            values = [k[name] for _, k in record]
            if all(v is cache for v in values):   # the cache, under the layers' own name (past_key_values, layer_past)
                self._seen_kw["cache"] = name
                continue
            if all(is_const(v) for v in values):
                for g, idx in groups.items():
                    self._consts.setdefault(g, {})[name] = values[idx[0]]
                continue
            for i, v in enumerate(values):
                if not (v is None or is_tensor_tree(v)):
                    raise ValueError(f"{type(first.base_module).__name__}.forward passes decoder layer {i} {name}= a "
                                     f"{type(v).__name__} while generating: only tensors and constants are supported")
            if all(v is values[0] for v in values):
                carry[name] = values[0]
                continue
            for g, idx in groups.items():
                carry[f"{name}@{g}"] = values[idx[0]]
        return h, carry
