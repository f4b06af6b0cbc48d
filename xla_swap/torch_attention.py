"""torch's ``scaled_dot_product_attention`` as a fused attention kernel on the GPU.

torchax lowers ``torch.nn.functional.scaled_dot_product_attention`` (what Hugging Face's
``sdpa`` attention calls) to XLA's unfused form: it materialises the ``[B, N, T, S]`` scores, and
an H100 spent 3.70 / 10.5 ms (forward / forward+backward) where torch's fused kernel spent
0.52 / 2.33 ms (B=2, 32 query and 8 K/V heads, S=4096, bf16, causal;
``benchmarks/results/attention_gpu/``). :func:`torchax_env` returns a torchax environment for one platform: on
``gpu`` its SDPA is ``jax.nn.dot_product_attention(implementation="cudnn")`` (cuDNN's fused
flash attention, forward and backward), with torch's semantics:

* layout: torch's ``[B, N, T, H]`` in and out (jax's ``[B, T, N, H]`` inside);
* ``is_causal``, a boolean ``attn_mask`` (``True`` attends) or an additive floating one,
  broadcastable to ``[B, N, T, S]``; grouped-query K/V (fewer heads, ``enable_gqa``);
* ``scale`` (default ``1/sqrt(H)``).

Where cuDNN cannot take the case (fp32 operands, ``dropout_p > 0``, a head dimension or mask
cuDNN refuses at trace time), the call runs jax's XLA form (``implementation="xla"``, the same
math unfused). On every other platform the environment is torchax's own, unchanged.
:func:`kernel_counts` says how many calls took each path while tracing.
"""
from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp

__all__ = ["torchax_env", "kernel_counts"]

#: calls traced per implementation ("cudnn", "xla"), over the process.
_COUNTS: collections.Counter = collections.Counter()


def kernel_counts() -> dict:
    """``{"cudnn": n, "xla": m}``: SDPA calls traced by the GPU environments so far (for checks)."""
    return dict(_COUNTS)


def _to_jax(env, t):
    """A torchax tensor's array; a plain torch tensor (a constant built on the CPU) copied."""
    import torchax.tensor
    return env.t2j_iso(t) if isinstance(t, torchax.tensor.Tensor) else env.t2j_copy(t)


def _sdpa(env, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    q, k, v = (jnp.swapaxes(_to_jax(env, t), 1, 2) for t in (query, key, value))   # [B, T, N, H]
    mask = bias = None
    if attn_mask is not None:
        m = _to_jax(env, attn_mask)
        if m.dtype == jnp.bool_:
            mask = m
        else:
            bias = m.astype(q.dtype)
    if dropout_p:
        raise NotImplementedError("scaled_dot_product_attention: dropout_p > 0 is not supported by xla_swap "
                                  "(train with attention dropout 0, or call model.eval())")
    kw = dict(bias=bias, mask=mask, scale=scale, is_causal=bool(is_causal))
    out, impl = None, "xla"
    if q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            out = jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
            impl = "cudnn"
        except (ValueError, NotImplementedError, TypeError, RuntimeError):
            out = None
    if out is None:
        out = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
    _COUNTS[impl] += 1
    return env.j2t_iso(jnp.swapaxes(out, 1, 2))


@functools.lru_cache(maxsize=None)
def torchax_env(platform: str):
    """The torchax environment stages run in on ``platform`` (``"gpu"``, ``"cpu"``, ...).

    One per platform, for the process. ``"gpu"`` gets its own environment with SDPA on cuDNN
    (module docstring); every other platform gets ``torchax.default_env()``.
    """
    from xla_swap._compat.torchax import import_torchax, override_op
    tx = import_torchax()
    if platform != "gpu":
        return tx.default_env()
    import torch
    import torchax.tensor
    env = torchax.tensor.Environment()
    impl = functools.partial(_sdpa, env)
    override_op(env, torch.nn.functional.scaled_dot_product_attention, impl)
    override_op(env, torch.ops.aten.scaled_dot_product_attention, impl)
    return env
