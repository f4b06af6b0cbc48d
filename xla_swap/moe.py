"""Mixture-of-experts layers of Hugging Face models inside the stages: dense dispatch, traced.

``transformers`` 5 computes the experts of its MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, ...) in a module decorated with ``@use_experts_implementation``, whose forward
``(hidden_states [N, D], top_k_index [N, k], top_k_weights [N, k]) -> [N, D]`` dispatches
by the model's experts implementation (``model.set_experts_implementation``). None of the
library's implementations runs in the stages: ``"eager"`` loops over the experts hit, with
data-dependent shapes (``nonzero``, ``torch.where``); ``"grouped_mm"`` (the default) calls
``torch._grouped_mm``, which torchax does not lower; ``"batched_mm"`` traces but gathers one
copy of an expert's weights per (token, expert) pair (``[N k, 2 I, D]``: terabytes at
Mixtral's sizes).

:func:`dense_experts_forward` is a traceable implementation equal to the eager one: every
expert computes every token, and the outputs are summed with the routing weights scattered to
``[N, E]`` (zero for an expert the token is not routed to; an unrouted expert's output is
selected away, not multiplied by zero, so it adds exactly nothing and gets no gradient). The
routing itself (softmax, top-k, normalisation, shared experts) stays the model's own code. It
costs ``E / k`` times the expert FLOPs of the routed computation and an ``[E, N, max(2 I, D)]``
activation per layer; a sorted-segment form (``torch._grouped_mm`` lowered to
``jax.lax.ragged_dot``) is the follow-up for the GPU. The expert weights are parameters of
their decoder layer, so they stream with it.

:func:`dense_experts_while_traced` installs it on a causal LM's decoder layers for the time
the stages are traced only: a forward pre-hook on each layer that holds experts switches the
model to :func:`dense_experts_forward` (``set_experts_implementation``) when the layer is
called with torchax tensors, and a forward hook switches it back. Eager torch calls of the
model keep its own implementation.

The module imports torch; ``transformers`` and ``torchax`` where called.
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["DENSE", "dense_experts_forward", "experts_modules", "dense_experts_while_traced"]

#: the name :func:`dense_experts_forward` is registered under in ``transformers``' ``ExpertsInterface``.
DENSE = "xla_swap_dense"

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
    num_experts = int(self.num_experts)
    if self.has_gate:
        w_in, b_in = self.gate_up_proj, (self.gate_up_proj_bias if self.has_bias else None)
    else:
        w_in, b_in = self.up_proj, (self.up_proj_bias if self.has_bias else None)
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


def experts_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every ``@use_experts_implementation`` experts module in ``module``."""
    return [(n, m) for n, m in module.named_modules()
            if all(hasattr(m, a) for a in _FLAGS) and hasattr(m, "down_proj") and hasattr(m, "config")]


def _register() -> None:
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(DENSE, dense_experts_forward)


def _traced(args, kwargs) -> bool:
    import torchax.tensor
    return any(isinstance(a, torchax.tensor.Tensor) for a in (*args, *kwargs.values()))


def dense_experts_while_traced(model: torch.nn.Module, layers) -> list:
    """Make the experts of ``layers`` (decoder layers of ``model``) run :func:`dense_experts_forward`
    while they are called with torchax tensors (the stages being traced), the model's own
    implementation otherwise. Idempotent per layer.

    Returns: the hook handles added (``handle.remove()`` undoes them).
    """
    _register()
    ref = weakref.ref(model)
    state = {"depth": 0, "saved": None}
    handles = []

    def pre(mod, args, kwargs):
        if not _traced(args, kwargs):
            return None
        m = ref()
        if state["depth"] == 0 and m is not None:
            state["saved"] = m.get_experts_implementation()
            m.set_experts_implementation(DENSE)
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
        if getattr(layer, "_xla_swap_dense_experts", False) or not experts_modules(layer):
            continue
        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True, always_call=True))
        layer._xla_swap_dense_experts = True
    return handles
