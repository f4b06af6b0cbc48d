"""Choosing the next token in :mod:`xla_swap.hf.generate`: greedy (argmax) or sampling after
``transformers``' temperature, top-k and top-p logits warpers (:func:`warp_logits`), keyed by
``jax.random`` from the seed and the step (reproducible); stop tokens end a row, which then gets
the pad token, as in ``GenerationMixin`` (:func:`next_token_step`).

The module imports jax.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

__all__ = ["warp_logits", "next_token_step"]


def warp_logits(scores, temperature: float, top_k: int | None, top_p: float | None):
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


def next_token_step(sampling: tuple, n_eos: int, pad: int) -> Callable:
    """``step(logits, state) -> state``: the next token of each row and the next decode step's inputs.

    Args:
      sampling: ``(do_sample, temperature, top_k, top_p)``.
      n_eos: the number of stop tokens (``state["eos"]`` holds them; 0: none).
      pad: the token a stopped row gets.

    ``logits`` float32 ``[B, V]``; ``state`` a dict of device arrays: ``key`` (PRNG key), ``step``,
    ``running`` bool ``[B]``, ``eos``, ``offset`` and ``t`` (cache slot and tokens of this step),
    ``mask`` int32 ``[B, cache_len]``, ``pos``, ``out`` int32 ``[B, max_new_tokens]``; the result
    also sets ``ids`` int32 ``[B, 1]`` and ``any_running``.
    """
    do_sample, temperature, top_k, top_p = sampling

    def step(logits, st):
        scores = logits
        if do_sample:
            scores = warp_logits(scores, temperature, top_k, top_p)
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
    return step
