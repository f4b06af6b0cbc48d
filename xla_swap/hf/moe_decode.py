"""Routed experts in generation, the torch side: which layers of a stack can fetch only the experts their
tokens were routed to, the stage pieces :class:`xla_swap.executors.streaming.routed_experts.RoutedExperts` runs
them with, and the choice per call between that and streaming every expert.

* **Marker.** While a layer is traced for routed fetching, its ``@use_experts_implementation`` module
  runs :data:`MARKER` (registered in ``transformers``' ``ExpertsInterface``): one
  :func:`~xla_swap.executors.streaming.routed_experts.experts_call` on the router's outputs, where the trace is
  split. The routing (softmax, ``topk_like_torch``, normalisation, group limits, shared experts) is the
  model's own code, traced as for every stage.
* **Fetched experts.** After the split, the layer's own experts form (``causal_lm_stages(experts=
  "dense" | "sorted")``, :func:`xla_swap.hf.moe.form_function`) runs on the ``m`` fetched experts: the
  weights ``[m, ...]`` and each token's expert ids mapped to their slot (``searchsorted`` in the
  ascending fetched ids). Every routed expert is fetched (padding rows too), so the result is the
  model's, as with every expert on the device.
* **Layout** (:func:`resolve_layout`, ``generate(expert_layout=...)``): ``"stacked"``, ``"split"`` (one packed
  ``pinned_host`` buffer per expert, each expert held once) or ``"auto"``:
  :func:`xla_swap.planning.routing.choose_expert_layout` on the largest routable layer's bytes per expert.
* **Choice** (:func:`choose_fetch`, ``generate(expert_fetch=...)``): ``"routed"``, ``"all"``, or ``"auto"``:
  routed for the prefill and the decode steps while their token counts (``batch x`` bucketed prompt,
  ``batch``) are expected to reach at most :data:`xla_swap.planning.routing.ROUTED_MAX_FRACTION` of a
  layer's experts (:func:`xla_swap.planning.routing.routed_pays`, the smallest ``E`` and largest ``k`` of
  the stack's layers), and, for ``"auto"``, while the decode steps' measured distinct experts stay there
  (:func:`still_routed`).

Routed fetching needs one device, no ``param_dtype`` cast, and per layer one experts module whose weights
are all stacked per expert, with ``config.num_experts_per_tok``; other layers, and ``resident`` ones,
run whole. The module imports torch, jax and (through the stack) torchax.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import torch

from xla_swap.executors.streaming.routed_experts import LAYOUTS, RoutedSpec, experts_call
from xla_swap.hf.moe import experts_modules, form_function, traced_arrays, traced_form, traced_form_as
from xla_swap.planning.routing import (ROUTED_MAX_FRACTION, choose_expert_layout, expected_distinct_experts,
                                       routed_pays, routed_token_limit)
from xla_swap.stack.torch_bridge import module_fn

__all__ = ["MARKER", "FETCHES", "RoutingInfo", "routing_info", "routed_specs", "choose_fetch", "still_routed",
           "routed_batch", "step_bytes", "FetchPlan", "check_fetch_args", "resolve_layout"]

#: the name of the marker experts implementation in ``transformers``' ``ExpertsInterface``.
MARKER = "xla_swap_experts_call"
#: the values of ``generate(expert_fetch=...)``.
FETCHES = ("auto", "routed", "all")


def marker_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts implementation that stands for a layer's experts while it is traced for routed fetching:
    ``experts_call(hidden_states [N, D], top_k_index [N, k], top_k_weights [N, k]) -> [N, D]`` (torchax tensors)."""
    env, (h, i, w) = traced_arrays(hidden_states, top_k_index, top_k_weights)
    return env.j2t_iso(experts_call(h, i, w))


def check_fetch_args(expert_fetch, expert_layout) -> None:
    """Raise ValueError unless ``expert_fetch`` is one of :data:`FETCHES` and ``expert_layout`` one of
    :data:`xla_swap.executors.streaming.routed_experts.LAYOUTS`."""
    if expert_fetch not in FETCHES:
        raise ValueError(f"expert_fetch must be one of {FETCHES}, got {expert_fetch!r}")
    if expert_layout not in LAYOUTS:
        raise ValueError(f"expert_layout must be one of {LAYOUTS}, got {expert_layout!r}")


@dataclasses.dataclass(frozen=True)
class RoutingInfo:
    """A stack's routed-fetching set-up.

    Attributes:
      layers: ``{layer index: (experts module name in the layer, E, k)}`` of the layers that can fetch
        their routed experts.
      reason: why routed fetching is unavailable (``None``: available, ``layers`` non-empty).
      whole: ``{layer index: why}`` of mixture-of-experts layers that run whole anyway.
    """
    layers: dict
    reason: str | None
    whole: dict

    @property
    def shape(self) -> tuple[int, int]:
        """``(E, k)`` the choice is made for: the smallest ``E`` and the largest ``k`` of the layers."""
        return min(e for _, e, _ in self.layers.values()), max(k for _, _, k in self.layers.values())


def _layer_reason(stack, i: int, layer) -> tuple[tuple | None, str | None]:
    """``((name, E, k), None)`` when layer ``i`` can fetch its routed experts, else ``(None, why)``."""
    found = experts_modules(layer)
    if len(found) != 1:
        return None, f"{len(found)} experts modules (one is needed)"
    name, mod = found[0]
    form = traced_form(layer)
    try:
        form_function(form)
    except ValueError:
        return None, f"its experts run {form!r} while traced, not an xla_swap.hf.moe form"
    e = int(getattr(mod, "num_experts", 0) or 0)
    k = getattr(getattr(mod, "config", None), "num_experts_per_tok", None)
    if not isinstance(k, int) or not 1 <= k <= e:
        return None, f"{type(mod).__name__}.config.num_experts_per_tok is {k!r} (an int in [1, {e}] is needed)"
    params = stack.runtime.host_params[1 + i]
    for pn, t in list(mod.named_parameters()) + list(mod.named_buffers()):
        if t.dim() == 0 or t.shape[0] != e or f"{name}.{pn}" not in params:
            return None, f"{name}.{pn} of shape {list(t.shape)} is not stacked per expert ({e} rows)"
    if stack.runtime.resident[1 + i]:
        return None, "resident on the device"
    return (name, e, k), None


def routing_info(stack) -> RoutingInfo:
    """Which layers of ``stack`` can fetch their routed experts, or why none can (:class:`RoutingInfo`)."""
    layers = stack.modules[1:-1]
    moe = [i for i, m in enumerate(layers) if experts_modules(m)]
    if not moe:
        return RoutingInfo({}, "the model has no mixture-of-experts layers", {})
    n_dev = len(stack.runtime.activation_sharding.device_set)
    if n_dev != 1:
        return RoutingInfo({}, f"the stack runs on {n_dev} devices (routed experts run on one)", {})
    if stack.param_dtype is not None:
        return RoutingInfo({}, f"param_dtype={stack.param_dtype} casts the weights in the stages", {})
    ok, whole = {}, {}
    for i in moe:
        got, why = _layer_reason(stack, i, layers[i])
        if got is None:
            whole[i] = why
        else:
            ok[i] = got
    reason = None if ok else "no layer can: " + "; ".join(f"layers[{i}]: {w}" for i, w in whole.items())
    return RoutingInfo(ok, reason, whole)


class _FetchedExperts(torch.nn.Module):
    """``forward(hidden, index, routing)``: the form ``impl`` of ``experts``, whose weights the caller swaps
    for the fetched ones."""

    def __init__(self, experts: torch.nn.Module, impl):
        super().__init__()
        self.experts = experts
        object.__setattr__(self, "impl", impl)

    def forward(self, hidden, index, routing):
        return self.impl(self.experts, hidden, index, routing)


def routed_specs(stack, info: RoutingInfo, stage_fns: list) -> dict:
    """``{stage: RoutedSpec}`` for the routable layers of ``info``, from the decode stage functions
    ``stage_fns`` (:class:`~xla_swap.executors.streaming.stateful_streamer.StatefulStreamer`'s form; layers sharing one function
    share one spec). Registers :data:`MARKER` in ``transformers``' ``ExpertsInterface``."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(MARKER, marker_experts_forward)
    layers = stack.modules[1:-1]
    specs, by_fn = {}, {}
    for i, (name, e, _) in sorted(info.layers.items()):
        fn = stage_fns[1 + i]
        if id(fn) not in by_fn:
            mod = dict(layers[i].named_modules())[name]
            call = module_fn(_FetchedExperts(mod, form_function(traced_form(layers[i]))), stack.torch_env)
            names = frozenset(f"{name}.{pn}" for pn, _ in list(mod.named_parameters()) + list(mod.named_buffers()))

            def marked(p, s, x, fn=fn):
                with traced_form_as(layers, MARKER):
                    return fn(p, s, x)

            def experts_fn(w, ids, hidden, index, routing, call=call, cut=len(name)):
                w = {"experts" + n[cut:]: jnp.stack(v) if isinstance(v, (list, tuple)) else v for n, v in w.items()}
                local = jnp.searchsorted(ids, index).astype(index.dtype)
                return call(w, (hidden, local, routing))
            by_fn[id(fn)] = RoutedSpec(marked, names, experts_fn, e)
        specs[1 + i] = by_fn[id(fn)]
    return specs


def choose_fetch(info: RoutingInfo, expert_fetch: str, batch: int, prompt_tokens: int) -> tuple[bool, bool, str]:
    """``(prefill routed, decode routed, explanation)`` for a call of ``batch`` rows and a bucketed prompt of
    ``prompt_tokens`` (module docstring). Raises ValueError: ``expert_fetch="routed"`` and ``info.reason``."""
    if expert_fetch == "all" or (info.reason is not None and expert_fetch == "auto"):
        why = "expert_fetch='all' given" if expert_fetch == "all" else f"every expert streamed: {info.reason}"
        return False, False, why
    if info.reason is not None:
        raise ValueError(f"expert_fetch='routed' cannot run: {info.reason}")
    if expert_fetch == "routed":
        return True, True, "expert_fetch='routed' given"
    e, k = info.shape
    pre, dec = batch * prompt_tokens, batch
    pays = [routed_pays(e, k, t) for t in (pre, dec)]
    why = "; ".join(f"{what} of {t} tokens: expected {expected_distinct_experts(e, k, t):.1f} of {e} experts "
                    f"(top-{k}) {'<=' if p else '>'} {ROUTED_MAX_FRACTION} x {e}: {'routed' if p else 'all'}"
                    for what, t, p in (("prefill", pre, pays[0]), ("decode", dec, pays[1])))
    return pays[0], pays[1], why


def still_routed(info: RoutingInfo, fetches: list) -> bool:
    """Whether a decode step that fetched ``fetches`` (``(stage, expert ids)``) stayed at most
    :data:`~xla_swap.planning.routing.ROUTED_MAX_FRACTION` of the experts (mean over its layers)."""
    if not fetches:
        return True
    frac = [len(ids) / info.layers[stage - 1][1] for stage, ids in fetches]
    return sum(frac) / len(frac) <= ROUTED_MAX_FRACTION


class FetchPlan:
    """One ``generate`` call's choice (:func:`choose_fetch`), applied step by step (step 0 is the prefill),
    and what each step fetched. With ``expert_fetch="auto"`` routing stops once a decode step's fetched
    experts pass the fraction (:func:`still_routed`).

    Args: ``info`` (:class:`RoutingInfo`), ``expert_fetch``, ``batch``, ``prompt_tokens`` (bucketed).
    Raises: ValueError as :func:`choose_fetch`.
    """

    def __init__(self, info: RoutingInfo, expert_fetch: str, batch: int, prompt_tokens: int):
        self.prefill, self.decode, self.explanation = choose_fetch(info, expert_fetch, batch, prompt_tokens)
        self.info, self.measured = info, expert_fetch == "auto"
        #: whether the model has mixture-of-experts layers.
        self.has_experts: bool = bool(info.layers or info.whole)
        #: ``info`` when the stack can fetch routed experts (its generator's streamer then runs by ``RoutedExperts``, which
        #: runs whole steps too: one generator serves every choice), else ``None``.
        self.routing: RoutingInfo | None = info if info.reason is None else None
        #: per step run, whether it fetched only the routed experts.
        self.routed_steps: list[bool] = []
        #: per step run, ``[(layer index, expert ids), ...]`` it copied (empty for a whole step).
        self.fetched: list[list[tuple[int, tuple[int, ...]]]] = []
        #: per step run, ``[(layer index, arrays copied host -> device, bytes), ...]`` of its expert fetches.
        self.copies: list[list[tuple[int, int, int]]] = []
        #: per step run, ``[(stage, row blocks copied behind the experts, blocks copied at its turn), ...]`` of the
        #: tail stages whose weights it copied in blocks (``RoutedExperts.tail``; empty for a whole step).
        self.tail_blocks: list[list[tuple[int, int, int]]] = []
        #: the expert layout the call ran with, and why (:func:`resolve_layout`; set by :meth:`resolve_layout`).
        self.layout: tuple[str, str] | None = None

    def resolve_layout(self, stack, expert_layout: str) -> str:
        """The layout ``expert_layout`` stands for on ``stack`` (:func:`resolve_layout`), kept in :attr:`layout`."""
        self.layout = resolve_layout(stack, self.info, expert_layout)
        return self.layout[0]

    def before_step(self, experts, step: int) -> None:
        """Set ``experts.routed`` (a ``RoutedExperts``) for step ``step``."""
        routed = self.prefill if step == 0 else self.decode
        if routed and step >= 2 and self.measured and not still_routed(self.info, experts.expert_fetches):
            self.decode = routed = False
            self.explanation += (f"; step {step - 1} fetched more than {ROUTED_MAX_FRACTION} of the experts: "
                                 "all after it")
        experts.routed = routed
        self.routed_steps.append(routed)

    def after_step(self, experts) -> None:
        """Record what the step just run fetched (``experts``: the ``RoutedExperts`` it ran by)."""
        self.fetched.append([(stage - 1, ids) for stage, ids in experts.expert_fetches])
        self.copies.append([(stage - 1, n, b) for stage, n, b in experts.expert_copies])
        self.tail_blocks.append(list(experts.tail.copied))

    def summary(self) -> dict:
        """``{"routed_steps", "fetched", "copies", "tail_blocks", "explanation", "layout", "layout_explanation"}``
        for ``stack.last_generation["experts"]``."""
        layout, why = self.layout or (None, "")
        return dict(routed_steps=list(self.routed_steps), fetched=list(self.fetched), copies=list(self.copies),
                    tail_blocks=list(self.tail_blocks), explanation=self.explanation, layout=layout,
                    layout_explanation=why)


def resolve_layout(stack, info: RoutingInfo, expert_layout: str) -> tuple[str, str]:
    """``(layout, why)``: ``expert_layout`` itself unless ``"auto"``; then ``"split"`` or ``"stacked"`` by the
    bytes of one expert of the routable layers (the largest), or ``"stacked"`` when none can route."""
    if expert_layout != "auto":
        return expert_layout, f"expert_layout={expert_layout!r} given"
    if info.reason is not None:
        return "stacked", "expert_layout='auto': no routed fetching, 'stacked' (nothing to split)"
    per = max(nb // info.layers[i][1] for i, nb in _expert_nbytes(stack, info).items())
    layout = choose_expert_layout(int(per))
    return layout, f"expert_layout='auto': {per} B per expert -> {layout!r}"


def routed_batch(stack, info: RoutingInfo, budget: int, per_seq: int, batch_all: int, max_batch: int) -> tuple:
    """``(batch, why)`` of ``choose_batch`` for a stack that can fetch routed experts: the better in tokens/s
    (the batch over the bytes a decode step streams, :func:`step_bytes`) of ``batch_all`` with every expert
    streamed and the largest batch ``"auto"`` routes (at most ``routed_token_limit``) whose KV cache and
    temporaries (``per_seq`` bytes each) fit ``budget`` beside the routed window (``prefetch_depth + 1`` of
    the largest stage less its experts, plus one layer's experts)."""
    rt = stack.runtime
    experts = _expert_nbytes(stack, info)
    streamed = [b - experts.get(s - 1, 0) for s, (b, r) in enumerate(zip(rt.stage_nbytes, rt.resident)) if not r]
    resident = sum(b for b, r in zip(rt.stage_nbytes, rt.resident) if r)
    window = (rt.prefetch_depth + 1) * max(streamed) + max(experts.values()) + resident
    limit = routed_token_limit(*info.shape)
    b_r = int(min(limit, max_batch, (budget - window) // max(1, per_seq)))
    full = step_bytes(stack, info, None)
    if b_r < 1 or b_r * full <= batch_all * step_bytes(stack, info, b_r):
        return batch_all, (f"every expert streamed ({full} B a step): batch {batch_all} gives more tokens per byte "
                           f"than routed fetching at batch {max(b_r, 0)} (at most {limit} for auto to route)")
    return b_r, (f"batch {b_r}, routed experts: {step_bytes(stack, info, b_r):.0f} B expected a step (uniform "
                 f"routing) against {full} B at batch {batch_all} with every expert; routed window {window} B")


def _expert_nbytes(stack, info: RoutingInfo) -> dict:
    """``{layer: bytes of its experts' weights}`` of the routable layers."""
    params = stack.runtime.host_params
    return {i: sum(v.nbytes for n, v in params[1 + i].items() if n.startswith(name + "."))
            for i, (name, _, _) in info.layers.items()}


def step_bytes(stack, info: RoutingInfo, batch: int | None) -> float:
    """Bytes a decode step of ``batch`` rows streams with routed experts, expected under uniform routing
    (:func:`xla_swap.planning.routing.expected_distinct_experts` per layer); ``batch=None``: every expert."""
    rt = stack.runtime
    total = sum(b for b, r in zip(rt.stage_nbytes, rt.resident) if not r)
    if batch is None:
        return total
    for i, nb in _expert_nbytes(stack, info).items():
        _, e, k = info.layers[i]
        total -= nb * (1.0 - expected_distinct_experts(e, k, batch) / e)
    return total
