"""torch's ``scaled_dot_product_attention`` inside the stages: torch's result, fused on the GPU.

torchax lowers ``torch.nn.functional.scaled_dot_product_attention`` (what Hugging Face's
``sdpa`` attention calls) to XLA's unfused form, which materialises the ``[B, N, T, S]``
scores, several times slower than torch's fused kernel on a GPU
(docs/explanation/measured-facts.md, section 10). torchax 0.0.6 also returns NaN for a query row whose
keys are all masked (a padding query of a left-padded batch), which the next layer spreads to
every row; torch returns zeros there.

:func:`torchax_env` returns the torchax environment the stages of one platform run in, with
``torch.topk`` breaking ties as torch does (:func:`xla_swap.hf.moe.topk_like_torch`) and SDPA replaced:

* everywhere: :func:`sdpa_reference`, torch's math (``softmax(q k^T * scale + mask) v``) with
  torch's zeros for fully masked rows;
* on ``"gpu"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (cuDNN's fused flash
  attention, forward and backward) for bf16 / fp16 operands, with torch's layout
  (``[B, N, T, H]``), ``is_causal``, boolean or additive ``attn_mask`` broadcastable to
  ``[B, N, T, S]``, grouped-query K/V and ``scale``; fully masked rows give zeros as torch's
  CPU kernels do (torch 2.11's CUDA SDPA returns other, unspecified values there: a loss over
  padded positions differs, one that leaves them out does not).
  fp32 operands, and any case cuDNN refuses at trace time, run :func:`sdpa_reference`.
  The kernel takes ``[B, T, N, H]``: the transposes around it cancel against a ``transformers``
  layer's own, so it runs as fast as torch's SDPA; contiguous ``[B, N, T, H]`` operands are
  copied around it (docs/explanation/measured-facts.md, section 11).
  A float ``attn_mask`` is cuDNN's ``bias``. Its gradient is computed only where it is
  differentiated (a ``jax.custom_vjp`` reads that at trace time); otherwise the backward leaves
  that output off (:func:`xla_swap._compat.jax.cudnn_attention_fixed_bias`). In a stack, a float
  mask carried between stages is differentiated like every floating leaf of the carry.
  Generation's stages trace within :func:`prefill_attention`: a prefill's mask over the whole cache is
  checked on the device and, where causal with left padding, cuDNN's causal kernel runs over the prompt's keys
  only, with no mask (half the tiles skipped, no ``[B, 1, T, S]`` bias read).

A ``transformers`` model built with ``attn_implementation="eager"`` multiplies q and k itself
and does not call SDPA: its attention runs as XLA's unfused form on every platform
(:func:`eager_attention_modules` finds it; ``SwappedStack`` warns on a GPU).

``dropout_p > 0`` is refused (random: it cannot equal torch's). :func:`kernel_counts` says how
many calls took each path while tracing.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import warnings

import jax
import jax.numpy as jnp

from xla_swap._compat import jax as _compat_jax

__all__ = ["torchax_env", "kernel_counts", "sdpa_reference", "eager_attention_modules", "warn_eager_attention",
           "prefill_attention", "count_causal_prefill_runs"]

#: SDPA calls traced per implementation ("cudnn", "reference"), over the process.
_COUNTS: collections.Counter = collections.Counter()
#: operand dtypes that run cuDNN's kernel (others run the reference).
_FUSED_DTYPES = (jnp.bfloat16, jnp.float16)
#: whether SDPA calls being traced may take the checked causal prefill path (:func:`prefill_attention`).
_PREFILL: contextvars.ContextVar = contextvars.ContextVar("xla_swap_prefill_attention", default=False)
#: whether the causal prefill path counts its runs (:func:`count_causal_prefill_runs`).
_COUNT_RUNS = [False]


def kernel_counts() -> dict:
    """``{"cudnn": n, "reference": m, ...}``: SDPA calls traced by the environments so far (for checks);
    ``"causal_prefill"`` / ``"causal_prefill_run"``: the causal prefill path traced / run (:func:`prefill_attention`)."""
    return dict(_COUNTS)


def _refuse_dropout(dropout_p) -> None:
    if dropout_p:
        raise ValueError("scaled_dot_product_attention with dropout_p > 0 cannot equal torch's (random); "
                         "set the model's attention dropout to 0 or call model.eval()")


def sdpa_reference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` in torch ops (run by torchax as XLA's form).

    Torch's reference math, and torch's result where a query row has no key left (every key
    masked): zeros, and no gradient through that row.

    Raises: ValueError: ``dropout_p > 0``.
    """
    import torch
    _refuse_dropout(dropout_p)
    _COUNTS["reference"] += 1
    L, S = query.shape[-2], key.shape[-2]
    keep = torch.ones(L, S, dtype=torch.bool).tril() if is_causal else None
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask if keep is None else keep & attn_mask
        else:
            bias = attn_mask
            finite = attn_mask > float("-inf")
            keep = finite if keep is None else keep & finite
    dead = None
    if keep is not None:
        dead = ~keep.any(-1, keepdim=True)
        keep = keep | dead
    if enable_gqa:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
    scale = _scale(query, scale)
    w = query @ key.transpose(-2, -1) * scale
    if bias is not None:
        w = w + bias.masked_fill(dead, 0.0) if dead is not None else w + bias
    if keep is not None:
        w = w.masked_fill(~keep, float("-inf"))
    out = torch.softmax(w, dim=-1).to(value.dtype) @ value   # torch keeps bf16 / fp16 here; torchax's softmax upcasts
    return out if dead is None else out.masked_fill(dead, 0.0)


def _scale(query, scale) -> float:
    """SDPA's factor of ``q k^T``: ``scale``, or ``1 / sqrt(head dim)`` where it is ``None`` (torch's default)."""
    return 1 / float(query.shape[-1]) ** 0.5 if scale is None else float(scale)


def _to_jax(env, t):
    """A torchax tensor's array; a plain torch tensor (a constant built on the CPU) copied."""
    import torchax.tensor
    return env.t2j_iso(t) if isinstance(t, torchax.tensor.Tensor) else env.t2j_copy(t)


def _cudnn(q, k, v, bias, scale, causal):
    """cuDNN's attention on ``[B, T, N, H]`` arrays with an additive float ``bias`` (its backward
    also computes the bias gradient)."""
    return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale, is_causal=causal, implementation="cudnn")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _biased(q, k, v, bias, scale, causal):
    """:func:`_cudnn`, whose backward computes the bias gradient only where the bias is differentiated."""
    return _cudnn(q, k, v, bias, scale, causal)


def _biased_fwd(q, k, v, bias, scale, causal):
    # symbolic_zeros: each operand comes as a CustomVJPPrimal, ``perturbed`` when differentiated
    qkv = (q.value, k.value, v.value)
    if not bias.perturbed:
        try:
            fixed = functools.partial(_compat_jax.cudnn_attention_fixed_bias, bias=bias.value, scale=scale,
                                      is_causal=causal)
            return jax.vjp(fixed, *qkv)
        except _compat_jax.MissingUpstreamAPI:   # this jax lacks the private call: the gradient is made and dropped
            pass
    return jax.vjp(lambda q, k, v, b: _cudnn(q, k, v, b, scale, causal), *qkv, bias.value)


def _biased_bwd(scale, causal, vjp, g):
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        g = jnp.zeros(g.shape, g.dtype)
    grads = vjp(g)
    return grads if len(grads) == 4 else (*grads, None)    # None: no cotangent for a fixed bias


_biased.defvjp(_biased_fwd, _biased_bwd, symbolic_zeros=True)


def _fused(q, k, v, mask, scale, causal):
    """cuDNN's attention on ``[B, T, N, H]`` arrays with an optional boolean ``mask`` (no bias)."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal, implementation="cudnn")


def _left_padded_causal(keep):
    """Whether a boolean mask ``keep [Bm, 1, T, S]`` (``S >= T``) is causal with left padding: ``keep[b, 0, i, j]``
    is ``j <= i and kp[b, j]`` for ``j < T``, with ``kp[b]`` zeros then ones, and false for every ``j >= T``.

    Returns ``(ok, shift)``: a traced bool scalar and int32 ``[Bm]``, the padding keys of each row (``T - sum(kp[b])``).
    """
    t = keep.shape[2]
    kp = keep[:, 0, t - 1, :t]                      # the last query's keys: the row's padding
    want = jnp.tril(jnp.ones((t, t), jnp.bool_))[None] & kp[:, None, :]
    ok = jnp.all(keep[:, 0, :, :t] == want) & jnp.all(kp[:, 1:] >= kp[:, :-1])
    if keep.shape[3] > t:
        ok = ok & ~jnp.any(keep[:, 0, :, t:])
    return ok, (t - kp.sum(-1)).astype(jnp.int32)


def _rolled_causal(qt, kt, vt, shift, scale):
    """Causal attention with no mask over keys ``[0, T)`` of ``[B, T, N, H]`` arrays whose row ``b`` starts with
    ``shift[b]`` padding tokens: each row rolled so that its tokens come first (a padding key then follows every
    token, out of a causal query's reach), attended, and rolled back. Padding queries get values the caller zeros."""
    b, t = qt.shape[:2]
    shift = jnp.broadcast_to(shift, (b,))

    def roll(x, s):
        idx = (jnp.arange(t, dtype=jnp.int32)[None, :] + s[:, None]) % t
        return jnp.take_along_axis(x, idx[:, :, None, None], axis=1)
    out = _fused(roll(qt, shift), roll(kt[:, :t], shift), roll(vt[:, :t], shift), None, scale, True)
    _COUNTS["causal_prefill"] += 1
    if _COUNT_RUNS[0]:
        jax.debug.callback(_count_run)
    return roll(out, -shift)


def _count_run() -> None:
    _COUNTS["causal_prefill_run"] += 1


def _checked_prefill(qt, kt, keep) -> bool:
    """Whether the call may take the checked causal path: inside :func:`prefill_attention`, several queries,
    a boolean mask ``[B or 1, 1, T, S]`` with ``S >= T`` keys."""
    b, t = qt.shape[:2]
    return _PREFILL.get() and t > 1 and keep.ndim == 4 and keep.shape[0] in (1, b) and keep.shape[1] == 1 \
        and keep.shape[2] == t and keep.shape[3] == kt.shape[1] >= t


def _fused_attention(q, k, v, m, is_causal: bool, scale):
    """cuDNN's attention on torch's ``[B, N, T, H]`` layout with torch's mask ``m`` (``None``, boolean or additive
    float, broadcastable to ``[B, N, T, S]``) and ``is_causal``; rows with no key give zeros. Within
    :func:`prefill_attention`, a boolean mask over several queries is checked on the device
    (:func:`_left_padded_causal`): causal with left padding, it runs :func:`_rolled_causal`, else the masked call."""
    mask = bias = dead = keep = None
    if m is not None:
        keep = m if m.dtype == jnp.bool_ else m > -jnp.inf
        if is_causal:
            keep = keep & jnp.tril(jnp.ones(keep.shape[-2:], jnp.bool_))
        dead = ~keep.any(-1, keepdims=True)             # rows with no key: zeros, as in torch
        if m.dtype == jnp.bool_:
            mask = keep | dead
        else:
            bias = jnp.where(dead, 0, m).astype(q.dtype)
    qt, kt, vt = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))
    causal = is_causal and m is None
    if mask is not None and _checked_prefill(qt, kt, keep):
        ok, shift = _left_padded_causal(keep)
        out = jax.lax.cond(ok, lambda: _rolled_causal(qt, kt, vt, shift, scale),
                           lambda: _fused(qt, kt, vt, mask, scale, False))
    elif bias is None:
        out = _fused(qt, kt, vt, mask, scale, causal)
    else:
        out = _biased(qt, kt, vt, bias, _scale(q, scale), causal)
    out = jnp.swapaxes(out, 1, 2)                       # [B, N, T, H], torch's layout
    return out if dead is None else jnp.where(dead, 0, out)


def _sdpa_cudnn(env, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    _refuse_dropout(dropout_p)
    q, k, v = (_to_jax(env, t) for t in (query, key, value))
    if q.dtype in _FUSED_DTYPES:
        m = None if attn_mask is None else _to_jax(env, attn_mask)
        try:
            out = _fused_attention(q, k, v, m, bool(is_causal), scale)
        except (ValueError, NotImplementedError, TypeError, RuntimeError):
            out = None
        if out is not None:
            _COUNTS["cudnn"] += 1
            return env.j2t_iso(out)
    return sdpa_reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@contextlib.contextmanager
def prefill_attention():
    """Within it, the GPU environment's SDPA calls traced with several queries and a boolean mask
    ``[B or 1, 1, T, S]`` (``S >= T``; what ``transformers`` builds for a prefill into a fixed-size cache) check
    the mask on the device: where it is causal with left padding (each row's keys ``[0, T)`` hidden up to its
    first token, every key past ``T`` hidden), cuDNN's causal attention runs over keys ``[0, T)`` only, with no
    mask (each row rolled so its tokens come first); any other mask (a sliding window, a cache offset > 0, a
    custom mask) runs the masked call as outside. Both give torch's result; :func:`kernel_counts` counts the
    causal path as ``"causal_prefill"`` (traced) and ``"causal_prefill_run"`` (runs, while
    :func:`count_causal_prefill_runs` is on). Never differentiated (the generation stages enter it)."""
    token = _PREFILL.set(True)
    try:
        yield
    finally:
        _PREFILL.reset(token)


def count_causal_prefill_runs(on: bool) -> None:
    """Whether executables traced from now on count each run of the causal prefill path in
    :func:`kernel_counts` (``"causal_prefill_run"``, a host callback per call: for checks, not timings)."""
    _COUNT_RUNS[0] = bool(on)


@functools.lru_cache(maxsize=None)
def torchax_env(platform: str):
    """The torchax environment the stages run in on ``platform`` (``"gpu"``, ``"cpu"``, ...).

    One per platform for the process, each its own ``torchax.tensor.Environment`` (torchax's
    default environment is left as it is), with SDPA and ``torch.topk`` as the module docstring says.
    """
    from xla_swap._compat.torchax import import_torchax, override_op
    import_torchax()
    import torch
    import torchax.tensor
    env = torchax.tensor.Environment()
    impl = functools.partial(_sdpa_cudnn, env) if platform == "gpu" else sdpa_reference
    for op in (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention):
        override_op(env, op, impl)
    from xla_swap.hf.moe import topk_like_torch
    override_op(env, torch.ops.aten.topk, functools.partial(topk_like_torch, env))
    return env


def eager_attention_modules(modules, names) -> list:
    """The attention submodules of ``modules`` whose ``config`` asks ``transformers`` for its eager attention.

    Args:
      modules: ``nn.Module`` stages; names: their names (``"layers[0]"``, ...), as many.

    Returns: ``["layers[0].self_attn", ...]``, the first such submodule of each stage: a module
      whose class name ends in ``Attention`` (``LlamaAttention``, ...) and whose ``config`` has
      ``_attn_implementation == "eager"``; empty when none.
    """
    found = []
    for name, module in zip(names, modules):
        for sub, m in module.named_modules():
            if type(m).__name__.endswith("Attention") and \
                    getattr(getattr(m, "config", None), "_attn_implementation", None) == "eager":
                found.append(f"{name}.{sub}" if sub else name)
                break
    return found


def warn_eager_attention(modules, names, platform: str) -> None:
    """On ``platform == "gpu"``, a ``UserWarning`` naming the stages :func:`eager_attention_modules`
    finds (their attention runs as XLA's unfused form there, not cuDNN's); nothing elsewhere."""
    eager = eager_attention_modules(modules, names) if platform == "gpu" else []
    if eager:
        warnings.warn(f"{', '.join(eager[:3])}{', ...' if len(eager) > 3 else ''}: attn_implementation='eager' runs "
                      "XLA's unfused attention (the [B, N, T, S] scores in device memory); a model built with "
                      "attn_implementation='sdpa' runs cuDNN's fused kernel", stacklevel=3)
