"""Mixture-of-experts layers of Hugging Face models inside the stages: dense dispatch or sorted segments, traced.

``transformers`` 5 computes the experts of its MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...)
in a ``@use_experts_implementation`` module, ``(hidden_states [N, D], top_k_index [N, k],
top_k_weights [N, k]) -> [N, D]``; none of the library's own implementations traces into the
stages (data-dependent shapes, ``torch._grouped_mm``, or an expert weight copied per routed token).
Two traceable implementations, equal to the eager one in values and gradients, are registered in
``transformers``' ``ExpertsInterface`` and picked by name (``causal_lm_stages(model,
experts="dense" | "sorted")``, :data:`FORMS`):

* ``"dense"`` (:func:`dense_experts_forward`, the default): every expert computes every token, the
  outputs summed with the routing weights; ``E / k`` times the routed expert FLOPs;
* ``"sorted"`` (:func:`sorted_experts_forward`): the (token, expert) pairs sorted by expert, each
  expert's matmuls over its segment with ``jax.lax.ragged_dot_general``; the routed FLOPs only, as
  fast as the backend's ragged-dot kernel.

The routing (softmax, top-k, normalisation, shared experts) stays the model's own code; the expert
weights are parameters of their decoder layer and stream with it. Its ``torch.topk`` breaks ties as
torch does (:func:`topk_like_torch`: equal scores, as a zero-initialised router gives, pick torch's
experts). :func:`experts_while_traced`
switches the model to a form while the stages are traced only. Costs, the measured choice between
the forms and the hooks: ``docs/explanation/mixture-of-experts.md``. The module imports torch; ``transformers``, ``torchax``
and ``jax`` where called.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["DENSE", "SORTED", "FORMS", "dense_experts_forward", "sorted_experts_forward", "experts_modules",
           "experts_while_traced", "dense_experts_while_traced", "topk_like_torch", "traced_form", "traced_form_as",
           "form_function", "traced_arrays"]

#: the name :func:`dense_experts_forward` is registered under in ``transformers``' ``ExpertsInterface``.
DENSE = "xla_swap_dense"
#: the name :func:`sorted_experts_forward` is registered under in ``transformers``' ``ExpertsInterface``.
SORTED = "xla_swap_sorted"
#: the forms a user names (``causal_lm_stages(model, experts=...)``) -> their registered names.
FORMS = {"dense": DENSE, "sorted": SORTED}

#: attributes ``@use_experts_implementation`` gives an experts module (``transformers`` >= 5.17).
_FLAGS = ("has_gate", "has_bias", "is_transposed")


def _project(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """``[E, N, out]``: ``x [N, in]`` (or ``[E, N, in]``) through every expert's weight ``w``."""
    eq = ("nd,edo->eno" if transposed else "nd,eod->eno") if x.dim() == 2 else \
        ("end,edo->eno" if transposed else "end,eod->eno")
    out = torch.einsum(eq, x, w)
    return out if bias is None else out + bias[:, None, :]


def dense_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts implementation for ``transformers``' ``ExpertsInterface``: every expert on every token.

    ``self`` is a ``@use_experts_implementation`` experts module (``gate_up_proj`` or
    ``up_proj``, ``down_proj``, their biases, ``has_gate``, ``has_bias``, ``is_transposed``,
    ``_apply_gate`` / ``act_fn``); ``hidden_states`` ``[N, D]``, ``top_k_index`` int ``[N, k]``
    and ``top_k_weights`` ``[N, k]`` as the model's router gives them. Returns ``[N, D]`` in
    ``hidden_states``' dtype: the sum over a token's ``k`` experts of the routing weight times the
    expert's output, as the eager implementation computes it (see the module docstring).
    """
    if self.has_gate:
        w_in, b_in = self.gate_up_proj, (self.gate_up_proj_bias if self.has_bias else None)
    else:
        w_in, b_in = self.up_proj, (self.up_proj_bias if self.has_bias else None)
    num_experts = int(w_in.shape[0])   # the module's experts, or those a routed fetch brought (their ids remapped)
    h = _project(hidden_states, w_in, b_in, self.is_transposed)            # [E, N, 2I] or [E, N, I]
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = _project(h, self.down_proj, self.down_proj_bias if self.has_bias else None, self.is_transposed)
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    # routing weights as [E, N]: a token's weight for each expert it is routed to, else 0
    routed = top_k_index[None, :, :] == torch.arange(num_experts, device=top_k_index.device)[:, None, None]
    weight = (routed.to(top_k_weights.dtype) * top_k_weights[None]).sum(-1)          # [E, N]
    hit = routed.any(-1)[..., None]                                                  # [E, N, 1]
    weighted = torch.where(hit, out * weight[..., None], torch.zeros((), dtype=out.dtype, device=out.device))
    return weighted.sum(0).to(hidden_states.dtype)


def _torchax_env(*tensors):
    """The torchax environment of the first torchax tensor among ``tensors``, else ``None`` (eager torch)."""
    import sys
    mod = sys.modules.get("torchax.tensor")
    if mod is None:
        return None
    t = next((t for t in tensors if isinstance(t, mod.Tensor)), None)
    if t is None:
        return None
    env = getattr(t, "_env", None)   # the environment the tensor was made in (the stack's own)
    return env if env is not None else sys.modules["torchax"].default_env()


def traced_arrays(*tensors) -> tuple:
    """``(env, arrays)``: the torchax environment of ``tensors`` (torchax tensors, as a traced stage holds
    them) and their jax arrays. Raises ValueError when none of them is a torchax tensor."""
    env = _torchax_env(*tensors)
    if env is None:
        raise ValueError("traced_arrays needs torchax tensors (a stage being traced), got eager torch tensors")
    return env, tuple(_to_jax(env, t) for t in tensors)


def _to_jax(env, t: torch.Tensor):
    import torchax.tensor
    return env.t2j_iso(t) if isinstance(t, torchax.tensor.Tensor) else env.t2j_copy(t)


def _torch_cpu_topk_indices(k: int, largest: bool, ordered: bool):
    """A host function: ``torch.topk``'s indices (int32) along the last axis of a NumPy array, by
    torch's own CPU kernel."""
    def indices(a):
        import numpy as np
        return torch.topk(torch.from_numpy(np.array(a)), k, -1, largest, ordered).indices.to(torch.int32).numpy()
    return indices


def topk_like_torch(env, input, k, dim=-1, largest=True, sorted=True):
    """``torch.topk`` inside the stages (the torchax environment's ``aten.topk``), with ties broken
    as torch breaks them on the platform the stage is compiled for.

    Equal scores (a zero-initialised router ties every expert) leave the choice to the kernel:
    ``jax.lax.top_k`` takes the lowest indices first; torch's CPU kernel takes what libstdc++'s
    ``std::nth_element`` or ``std::partial_sort`` leaves in front (of four equal scores, top-2 is
    ``[2, 3]``); torch's CUDA kernel (a radix select) takes the equal values in index order, as
    ``lax.top_k`` does. Compiled for the CPU, the indices are computed by torch's CPU kernel on the
    host (``jax.pure_callback``), so they equal eager torch's everywhere; on other platforms by
    ``lax.top_k``. The values are gathered from ``input`` at those indices (differentiable, as torch's).

    Args: ``env``: the torchax environment; ``input``: a torchax tensor of any shape and a real
    dtype; ``k``, ``dim``, ``largest``, ``sorted`` as ``torch.topk``'s. Returns ``(values,
    indices)``, ``input``'s shape with ``k`` along ``dim`` (indices int32 inside the stages, int64
    in torch's view). Raises what ``torch.topk`` raises for ``k`` out of range, when the stage runs
    on the CPU (the callback), else ``ValueError`` while tracing.
    """
    import jax
    import jax.numpy as jnp
    x = _to_jax(env, input)
    if x.ndim == 0:
        return env.j2t_iso((x, jnp.zeros((), jnp.int32)))
    xs = jnp.moveaxis(x, dim, -1)
    k = int(k)
    host = jax.lax.stop_gradient(xs.astype(jnp.float32) if xs.dtype in (jnp.bfloat16, jnp.float16) else xs)
    out = jax.ShapeDtypeStruct((*xs.shape[:-1], k), jnp.int32)
    on_cpu = lambda a: jax.pure_callback(_torch_cpu_topk_indices(k, bool(largest), bool(sorted)), out, a,
                                         vmap_method="broadcast_all")
    on_xla = lambda a: jax.lax.top_k(a if largest else -a, k)[1]
    idx = jax.lax.platform_dependent(host, cpu=on_cpu, default=on_xla)
    values = jnp.take_along_axis(xs, idx, -1)
    return env.j2t_iso((jnp.moveaxis(values, -1, dim), jnp.moveaxis(idx, -1, dim)))


def _sorted_order(top_k_index: torch.Tensor, num_experts: int) -> tuple:
    """``(perm [S], inverse [S], expert_ids [S], group_sizes [E] int32)`` of the ``S = N k`` routed
    pairs of ``top_k_index [N, k]``: ``perm`` the stable argsort of the flattened expert ids (pair
    ``perm[j]`` is the ``j``-th in expert order), ``inverse`` its inverse permutation,
    ``expert_ids`` the sorted ids, ``group_sizes`` the number of pairs per expert."""
    env = _torchax_env(top_k_index)
    if env is None:
        flat = top_k_index.reshape(-1)
        perm = torch.argsort(flat, stable=True)
        inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
        sizes = torch.bincount(flat, minlength=num_experts).to(torch.int32)
        return perm, inverse, flat[perm], sizes
    import jax.numpy as jnp
    flat = _to_jax(env, top_k_index).reshape(-1)
    perm = jnp.argsort(flat, stable=True)
    inverse = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))
    sizes = (flat[:, None] == jnp.arange(num_experts, dtype=flat.dtype)[None, :]).sum(0, dtype=jnp.int32)
    return env.j2t_iso((perm, inverse, flat[perm], sizes))


def _ragged_linear(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, bias: torch.Tensor | None,
                   expert_ids: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``[S, out]``: the rows of ``x [S, in]``, in contiguous per-expert segments of ``group_sizes [E]``
    rows, each through its expert's weight ``w`` (``[E, in, out]`` if ``transposed``, else
    ``[E, out, in]``) plus ``bias[expert_ids]`` (``bias`` ``[E, out]`` or ``None``). Traced:
    ``jax.lax.ragged_dot_general`` (no copy of ``w``); eager torch: one matmul per segment."""
    x = x.to(w.dtype)
    env = _torchax_env(x, w)
    if env is None:
        segments = torch.split(x, [int(n) for n in group_sizes.tolist()])
        out = torch.cat([seg @ (w[e] if transposed else w[e].transpose(0, 1)) for e, seg in enumerate(segments)])
    else:
        import jax
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [1 if transposed else 2]), ([], [])),
            lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        xj, wj, gj = (_to_jax(env, t) for t in (x, w, group_sizes))
        out = env.j2t_iso(jax.lax.ragged_dot_general(xj, wj, gj, dims))
    return out if bias is None else out + bias[expert_ids]


def sorted_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts implementation for ``transformers``' ``ExpertsInterface``: each expert on its routed tokens only.

    Same arguments and result as :func:`dense_experts_forward` (``hidden_states`` ``[N, D]``,
    ``top_k_index`` int ``[N, k]`` with ids in ``[0, E)``, ``top_k_weights`` ``[N, k]``; returns
    ``[N, D]`` in ``hidden_states``' dtype). The ``N k`` (token, expert) pairs are sorted by expert
    and each expert's matmuls run over its contiguous segment (``jax.lax.ragged_dot_general`` when
    called with torchax tensors, i.e. inside the stages; a loop over the segments in eager torch),
    then weighted, put back in token order and summed over each token's ``k`` experts, as
    ``transformers``' ``grouped_mm`` implementation computes it. Shapes are static (``N k`` rows);
    see the module docstring for the costs.
    """
    if self.has_gate:
        w_in, b_in = self.gate_up_proj, (self.gate_up_proj_bias if self.has_bias else None)
    else:
        w_in, b_in = self.up_proj, (self.up_proj_bias if self.has_bias else None)
    n, k = top_k_index.shape
    perm, inverse, expert_ids, sizes = _sorted_order(top_k_index, int(w_in.shape[0]))
    x = hidden_states[perm // k]                                            # [N k, D], expert order
    routing = top_k_weights.reshape(-1)[perm]                               # [N k]
    h = _ragged_linear(x, w_in, sizes, b_in, expert_ids, self.is_transposed)    # [N k, 2I] or [N k, I]
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = _ragged_linear(h, self.down_proj, sizes, self.down_proj_bias if self.has_bias else None, expert_ids,
                         self.is_transposed)                                  # [N k, D]
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    out = (out * routing[:, None])[inverse]                                 # token order: pair (t, j) at t k + j
    return out.reshape(n, k, out.shape[-1]).sum(1).to(hidden_states.dtype)


def experts_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every ``@use_experts_implementation`` experts module in ``module``."""
    return [(n, m) for n, m in module.named_modules()
            if all(hasattr(m, a) for a in _FLAGS) and hasattr(m, "down_proj") and hasattr(m, "config")]


def _register() -> None:
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(DENSE, dense_experts_forward)
    ExpertsInterface.register(SORTED, sorted_experts_forward)


def _traced(args, kwargs) -> bool:
    import torchax.tensor
    return any(isinstance(a, torchax.tensor.Tensor) for a in (*args, *kwargs.values()))


def experts_while_traced(model: torch.nn.Module, layers, experts: str = "dense") -> list:
    """Make the experts of ``layers`` (decoder layers of ``model``) run the form ``experts`` while
    they are called with torchax tensors (the stages being traced), the model's own implementation
    otherwise. Calling it again with another form switches those layers to it.

    Args:
      model: the ``transformers`` model whose ``set_experts_implementation`` is switched.
      layers: its decoder layers (``nn.Module``); those without experts are left alone.
      experts: ``"dense"`` (:func:`dense_experts_forward`) or ``"sorted"``
        (:func:`sorted_experts_forward`); see the module docstring for what each costs.

    Returns: the hook handles added (``handle.remove()`` undoes them).

    Raises: ValueError: ``experts`` is not a key of :data:`FORMS` (nothing changed).
    """
    if experts not in FORMS:
        raise ValueError(f"experts must be one of {sorted(FORMS)}, got {experts!r}")
    _register()
    name = FORMS[experts]
    ref = weakref.ref(model)
    state = {"depth": 0, "saved": None}
    handles = []

    def pre(mod, args, kwargs):
        if not _traced(args, kwargs):
            return None
        m = ref()
        if state["depth"] == 0 and m is not None:
            state["saved"] = m.get_experts_implementation()
            m.set_experts_implementation(mod._xla_swap_experts)
        state["depth"] += 1
        return None

    def post(mod, args, kwargs, output):
        if not _traced(args, kwargs) or state["depth"] == 0:
            return None
        state["depth"] -= 1
        m = ref()
        if state["depth"] == 0 and m is not None and state["saved"] is not None:
            m.set_experts_implementation(state["saved"])
            state["saved"] = None
        return None

    for layer in layers:
        if not experts_modules(layer):
            continue
        hooked = getattr(layer, "_xla_swap_experts", None) is not None
        layer._xla_swap_experts = name
        if hooked:
            continue
        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True, always_call=True))
    return handles


def traced_form(layer: torch.nn.Module) -> str | None:
    """The name (in ``transformers``' ``ExpertsInterface``) of the form ``layer``'s experts run in while traced
    (:func:`experts_while_traced`), or ``None`` for a layer without experts or hooks."""
    return getattr(layer, "_xla_swap_experts", None)


@contextlib.contextmanager
def traced_form_as(layers, name: str):
    """While the block runs, the experts of ``layers`` (those :func:`experts_while_traced` hooked) run the
    implementation registered in ``transformers``' ``ExpertsInterface`` as ``name`` when traced; restored after."""
    hooked = [layer for layer in layers if traced_form(layer) is not None]
    saved = [traced_form(layer) for layer in hooked]
    for layer in hooked:
        layer._xla_swap_experts = name
    try:
        yield
    finally:
        for layer, old in zip(hooked, saved):
            layer._xla_swap_experts = old


def form_function(name: str):
    """The experts implementation registered as ``name`` by this module (:data:`DENSE` or :data:`SORTED`).
    Raises ValueError for another name."""
    funcs = {DENSE: dense_experts_forward, SORTED: sorted_experts_forward}
    if name not in funcs:
        raise ValueError(f"no experts form of xla_swap.hf.moe is registered as {name!r}")
    return funcs[name]


def dense_experts_while_traced(model: torch.nn.Module, layers) -> list:
    """:func:`experts_while_traced` with ``experts="dense"``.

    Returns: the hook handles added (``handle.remove()`` undoes them).
    """
    return experts_while_traced(model, layers, "dense")
