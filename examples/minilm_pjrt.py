"""The two non-torch_xla executors of ``minilm_embed.py``: PJRT (jaxlib) and the streaming runtime.

* :func:`run_lowered_with_pjrt` runs the HLO that torch_xla lowered (SPMD, 4 devices) through
  :class:`xla_swap.executors.PjrtExecutor`, with the stacked layer weights in ``pinned_host``
  memory when the policy swaps parameters.
* :func:`run_streaming` runs all-MiniLM-L6-v2's 6 encoder layers, written in jax, through
  :class:`xla_swap.executors.StreamingRuntime`: one stage per layer, each layer's weights in
  their own ``pinned_host`` buffers, streamed to the device ``k = 2`` layers ahead.

This module imports neither torch_xla nor torch at import time; :func:`run_streaming` only
uses torch to convert the CPU tensors it is given to numpy.
"""
from __future__ import annotations

import math

import numpy as np

#: Streaming prefetch depth: while layer i runs, layers i+1..i+k are being copied in.
PREFETCH_DEPTH = 2


# ---------------------------------------------------------------------------------------
# PJRT executor on torch_xla's HLO
# ---------------------------------------------------------------------------------------
def stacked_weight_ids(lowered, num_layers: int = 6) -> list:
    """Parameter ids of ``lowered`` that look like stacked per-layer weights (a shape heuristic).

    A fallback for callers that do not name the weights: a parameter counts as one when it is
    ``captured`` (not a caller input), has rank >= 2 and its leading dimension is
    ``num_layers`` (the ``[L, ...]`` stacks of ``minilm.load_weights``). Prefer passing the
    stacked tensors themselves to :func:`run_lowered_with_pjrt` (``weights=``).

    Returns:
      sorted list of int parameter ids.
    """
    return sorted(p.id for p in lowered.parameters
                  if p.kind == "captured" and len(p.shape) >= 2 and p.shape[0] == num_layers)


def run_lowered_with_pjrt(lowered, policy, *, weights=None, num_layers: int = 6):
    """Compile and run a torch_xla lowering with PJRT (jaxlib), placed by the policy it was lowered with.

    The executor is ``PjrtExecutor.from_policy(lowered, policy, weights=ids, grad_results=())``:
    every entry parameter keeps the HLO sharding string torch_xla reported for it
    (``HloParameter.sharding``), the stacked layer weights get memory kind ``pinned_host``
    when ``policy.params == "host"``, all others ``device``; the module is a forward, so it
    returns no gradients. Parameter values are read from their torch_xla tensors
    (``.cpu().numpy()``: a device-to-host copy, so call this outside a ``host_transfer_guard``).

    Args:
      lowered: ``xla_swap.frontend.lowering.LoweredComputation`` whose first output is the
        ``[B, 384]`` float32 sentence embedding (lowered with ``emit_annotations(True)``
        when the weights are to live in host memory).
      policy: the ``xla_swap.planning.OffloadPolicy`` the scan was lowered with.
      weights: the stacked layer weights: XLA tensors that feed the lowering (their ids come
        from ``lowered.parameter_id``) or int parameter ids. Default: :func:`stacked_weight_ids`
        (the shape heuristic).
      num_layers: leading dimension of the stacked weights for the heuristic (6 for MiniLM-L6).

    Returns:
      ``(embeddings, report)``: ``np.ndarray`` of the first output (``[B, 384]`` float32
      for MiniLM) and the executor's :class:`xla_swap.executors.MemoryReport` (its
      ``parameter_memory_spaces[i]`` is ``"pinned_host"`` for the host parameters).

    Raises:
      ValueError: a weight id the lowering does not have, or a tensor that feeds none of its
        parameters; the executor's errors (sharding strings, device count, e.g. fewer jax
        devices than the lowering's SPMD mesh).
      TypeError: a parameter tensor's dtype differs from the compiled parameter's.
      jax.errors.JaxRuntimeError: XLA failed to compile or run the module.
    """

    from xla_swap.executors.pjrt import PjrtExecutor

    if weights is None:
        ids = stacked_weight_ids(lowered, num_layers)
    else:
        ids = [w if isinstance(w, (int, np.integer)) else lowered.parameter_id(w) for w in weights]
    # torch_xla's HLO has s64 parameters (token ids, scalar constants): the executor places and
    # runs them with jax's x64 mode on.
    executor = PjrtExecutor.from_policy(lowered, policy, weights=ids, grad_results=())
    values = {p.id: p.tensor.detach().cpu().numpy() for p in lowered.parameters}
    placed = executor.put_all([values[i] for i in range(executor.num_parameters)])
    outputs = executor(*placed)
    embeddings = np.array(outputs[0])  # a writable host copy
    report = executor.memory_report()
    return embeddings, report


# ---------------------------------------------------------------------------------------
# streaming runtime, the encoder written in jax
# ---------------------------------------------------------------------------------------
def _layer_norm(x, w, b, eps):
    import jax.numpy as jnp
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * w + b


def encoder_layer_jax(w: dict, h, mask_bias, num_heads: int = 12, eps: float = 1e-12):
    """One BERT encoder layer (post-LN) in jax, the same math as ``minilm.encoder_layer``.

    Args:
      w: one layer's weights, keys as ``minilm._LAYER_KEYS`` (``q_w [H, H]``, ``i_w [I, H]``,
        ... in torch's ``[out, in]`` layout), float32.
      h: ``[B, S, H]`` float32 hidden states.
      mask_bias: additive attention bias broadcastable to ``[B, heads, S, S]``
        (``[B, 1, 1, S]``: 0 for tokens, -1e9 for padding).

    Returns:
      ``[B, S, H]`` float32.
    """
    import jax
    import jax.numpy as jnp
    b, s, hid = h.shape
    d = hid // num_heads

    def heads(x):
        return x.reshape(b, s, num_heads, d).transpose(0, 2, 1, 3)

    q = heads(h @ w["q_w"].T + w["q_b"])
    k = heads(h @ w["k_w"].T + w["k_b"])
    v = heads(h @ w["v_w"].T + w["v_b"])
    att = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / math.sqrt(d) + mask_bias, axis=-1)
    ctx = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, hid)
    a = _layer_norm(ctx @ w["o_w"].T + w["o_b"] + h, w["ln1_w"], w["ln1_b"], eps)
    f = jax.nn.gelu(a @ w["i_w"].T + w["i_b"], approximate=False)
    return _layer_norm(f @ w["f_w"].T + w["f_b"] + a, w["ln2_w"], w["ln2_b"], eps)


def _make_stage(num_heads: int, eps: float):
    """A stage function ``(layer_weights, x) -> x`` over the packed activation ``x [B, S, H+1]``.

    The streaming runtime carries ONE array between stages (a stage must return one array,
    not a pytree), so the attention mask rides along as an extra feature channel: ``x[..., :H]``
    are the hidden states, ``x[..., H]`` the 0/1 attention mask of each token. Every stage
    rebuilds the additive bias from it and passes the channel through unchanged.
    """
    import jax.numpy as jnp

    def stage(w, x):
        h, m = x[..., :-1], x[..., -1]
        bias = ((1.0 - m) * -1e9)[:, None, None, :].astype(h.dtype)
        out = encoder_layer_jax(w, h, bias, num_heads, eps)
        return jnp.concatenate([out, m[..., None].astype(out.dtype)], axis=-1)

    return stage


def run_streaming(emb: dict, layers: dict, cfg: dict, ids, mask, steps):
    """Embed a batch with the encoder layers run by ``StreamingRuntime`` (jax + numpy only).

    Embedding lookup + LayerNorm, and mean pooling + L2 normalisation, run as jitted jax on
    the same device; the ``L`` encoder layers run as ``L`` stages of one shared stage
    function, each layer's weights resident in ``pinned_host`` memory and streamed to the
    device ``PREFETCH_DEPTH`` (2) layers ahead.

    Args:
      emb: embedding tensors of ``minilm.load_weights()`` (CPU torch float32):
        ``word_embeddings.weight``, ``position_embeddings.weight``,
        ``token_type_embeddings.weight``, ``LayerNorm.weight``, ``LayerNorm.bias``.
      layers: stacked layer weights ``{name: [L, ...]}`` (CPU torch float32).
      cfg: the BERT config dict (``num_attention_heads``, ``layer_norm_eps``).
      ids, mask: int64 ``[B, S]`` token ids and 0/1 attention mask (CPU torch tensors or numpy).
      steps: a tqdm bar; advanced twice (after placing the weights, after running).

    Returns:
      ``(embeddings, checks)``: ``np.ndarray [B, H]`` float32 (unit rows), and
      ``{check name: bool}`` with the streaming checks (at most k+1 layers' weights on the
      device at any time; every layer's resident weights in ``pinned_host``; one compiled
      executable shared by the layers).

    Raises:
      ValueError: ``ids`` and ``mask`` shapes differ, or the stacked weights disagree on ``L``;
        the runtime's errors (e.g. the device lacks ``pinned_host`` memory).
    """
    import jax
    import jax.numpy as jnp

    from xla_swap.executors import StreamingRuntime

    def to_np(t):
        return t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)

    ids_np, mask_np = to_np(ids), to_np(mask)
    if ids_np.shape != mask_np.shape or ids_np.ndim != 2:
        raise ValueError(f"ids and mask must both be [B, S], got {ids_np.shape} and {mask_np.shape}")
    stacked = {k: to_np(v) for k, v in layers.items()}
    num_layers = {v.shape[0] for v in stacked.values()}
    if len(num_layers) != 1:
        raise ValueError(f"layers: stacked weights disagree on the number of layers: {sorted(num_layers)}")
    num_layers = num_layers.pop()
    heads, eps = int(cfg["num_attention_heads"]), float(cfg["layer_norm_eps"])
    k = PREFETCH_DEPTH
    device = jax.devices()[0]

    steps.set_postfix_str(f"streaming: {num_layers} layers to pinned_host, prefetch depth {k}")
    rt = StreamingRuntime(_make_stage(heads, eps),
                          [{n: v[i] for n, v in stacked.items()} for i in range(num_layers)],
                          prefetch_depth=k, device=device)
    emb_dev = {n: jax.device_put(to_np(v), device) for n, v in emb.items()}
    steps.update()

    steps.set_postfix_str(f"streaming: running {num_layers} stages on {device}")

    @jax.jit
    def embed(e, input_ids, m):
        s = input_ids.shape[1]
        h = (e["word_embeddings.weight"][input_ids] + e["position_embeddings.weight"][:s]
             + e["token_type_embeddings.weight"][0])
        h = _layer_norm(h, e["LayerNorm.weight"], e["LayerNorm.bias"], eps)
        return jnp.concatenate([h, m[..., None].astype(h.dtype)], axis=-1)

    @jax.jit
    def pool(x):
        h, m = x[..., :-1], x[..., -1:]
        pooled = (h * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)
        return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)

    x0 = embed(emb_dev, jax.device_put(ids_np, device), jax.device_put(mask_np, device))
    rt.reset_stats()
    out = np.array(pool(rt.forward(x0)), dtype=np.float32)  # a writable copy
    steps.update()

    expected = k + 1 if num_layers > k + 1 else num_layers
    host_kinds = {leaf.sharding.memory_kind for p in rt.host_params for leaf in jax.tree_util.tree_leaves(p)}
    print(f"\nstreaming runtime: {num_layers} stages of {rt.stage_nbytes[0]} bytes "
          f"({rt.weight_nbytes} in pinned_host), prefetch depth {k}, max resident stages "
          f"{rt.max_resident_stages}, {rt.num_executables} executable(s); residency "
          f"{[r for _, _, r in rt.residency_trace]}")
    checks = {
        "streaming: at most k+1 layers' weights on the device":
            rt.max_resident_stages == expected,
        "streaming: layer weights resident in pinned_host": host_kinds == {"pinned_host"},
        "streaming: one executable shared by all layers": rt.num_executables == 1,
    }
    return out, checks
