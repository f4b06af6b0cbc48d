"""What :func:`xla_swap.hf.causal_lm.causal_lm_stages` refuses, and how a failure inside a model's code is named.

* :func:`refuse_unsupported` checks a causal LM's modules before anything runs: the auxiliary router
  loss of mixture-of-experts blocks, router jitter noise, and rotary embeddings whose frequencies depend on earlier calls (``rope_type`` ``"dynamic"``).
* :func:`describe_failure` turns an exception raised inside a model's code (while its forward runs
  with the decoder layers replaced, or while a stage is traced) into a sentence naming the module
  and the function it was raised in, and the feature where the exception says which (a Python
  branch on a tensor's value, a conversion to host memory, a tensor kept across calls).
* :func:`refuse_extra_outputs` checks that a model reads nothing but the hidden state of its layers' outputs,
  :func:`refuse_state_between_layers` that it hands a layer nothing computed from earlier layers' outputs,
  :func:`refuse_output_from_earlier_layers` (where the stages' logits differ) that its output after the
  layers comes from the last layer's output alone.
* :class:`KeepTensorAttributes` restores the tensor attributes a forward sets on its modules (a
  lazily built cache such as longrope's ``long_inv_freq``), so a traced value never stays on a module.

Imports torch only.
"""
from __future__ import annotations

import os
import traceback

import torch

from xla_swap.hf.capture import Unused, holds, is_tensor_tree, leaves

__all__ = ["NEEDS_TRANSFORMERS", "refuse_old_transformers", "refuse_unsupported", "refuse_extra_outputs",
           "refuse_state_between_layers", "refuse_output_from_earlier_layers", "describe_failure", "failure_module",
           "is_tracer_error", "refuse_longrope_generation", "KeepTensorAttributes"]

#: jax's tracer errors (by class name: this module does not import jax) -> the feature they mean.
_TRACER_FEATURES = {
    "ConcretizationTypeError": "a Python branch, size or index computed from a tensor's value (data-dependent "
                               "control flow), which a traced stage cannot express",
    "TracerBoolConversionError": "a Python branch on a tensor's value (data-dependent control flow), which a "
                                 "traced stage cannot express",
    "TracerIntegerConversionError": "a Python integer taken from a tensor's value (a data-dependent size or "
                                    "index), which a traced stage cannot express",
    "TracerArrayConversionError": "a conversion of a tensor to numpy or host memory inside the forward, which a "
                                  "traced stage cannot express",
    "UnexpectedTracerError": "a tensor kept from one call to the next (module state written in the forward), "
                             "which a traced stage cannot express",
}


def _innermost(exc: BaseException) -> BaseException:
    """The exception at the bottom of ``exc``'s ``__cause__`` / ``__context__`` chain."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = exc.__cause__ or exc.__context__
        if nxt is None:
            break
        exc = nxt
    return exc


def _is_model_code(filename: str) -> bool:
    """Whether a frame's file is a model's code: ``transformers``, or a user's module outside the libraries."""
    if f"{os.sep}transformers{os.sep}" in filename:
        return True
    libs = tuple(f"{os.sep}{p}{os.sep}" for p in ("torch", "torchax", "jax", "jaxlib", "xla_swap", "numpy"))
    return not filename.startswith("<") and "site-packages" not in filename and not any(s in filename for s in libs)


def _short_path(filename: str) -> str:
    """``filename`` named from its package on: ``transformers/models/llama/modeling_llama.py`` wherever
    transformers is installed (``site-packages`` or a ``pip install --target`` folder), else the part after
    ``site-packages/``, else ``filename`` itself."""
    i = filename.rfind(f"{os.sep}transformers{os.sep}")
    return filename[i + 1:] if i >= 0 else filename.split("site-packages" + os.sep)[-1]


def _model_frame(exc: BaseException):
    """``(module class name or None, function, file, line)`` of the innermost frame of ``exc`` in a model's
    code (``_is_model_code``), or ``None``."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if _is_model_code(code.co_filename):
            owner = tb.tb_frame.f_locals.get("self")
            cls = type(owner).__name__ if isinstance(owner, torch.nn.Module) else None
            found = (cls, code.co_name, _short_path(code.co_filename), tb.tb_lineno)
        tb = tb.tb_next
    return found


def failure_module(exc: BaseException) -> str | None:
    """The class name of the module whose method raised ``exc`` (the innermost frame of the bottom of its
    cause chain in a model's code), or ``None``."""
    site = _model_frame(_innermost(exc))
    return site[0] if site is not None else None


def is_tracer_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or the bottom of its cause chain) is one of jax's tracer errors (a model's code
    doing what a traced function cannot: ``ConcretizationTypeError`` and the like)."""
    return type(_innermost(exc)).__name__ in _TRACER_FEATURES


def describe_failure(exc: BaseException) -> str:
    """A sentence for an exception raised inside a model's code: what was raised, where (the module's
    class and function, file and line, when the traceback reaches model code; a file of ``transformers``
    named from its package on, ``transformers/models/...``, wherever it is installed), and for jax's tracer
    errors the feature of the model that caused it. Never raises."""
    root = _innermost(exc)
    kind = type(root).__name__
    text = str(root).split("\n")[0][:300]
    site = _model_frame(root)
    where = ""
    if site is not None:
        cls, fn, path, line = site
        where = f" in {cls + '.' if cls else ''}{fn} ({path}:{line})"
    feature = _TRACER_FEATURES.get(kind)
    if feature is not None:
        return f"the model's code{where} uses {feature}"
    if site is None:
        last = traceback.extract_tb(root.__traceback__)[-1:] if root.__traceback__ else []
        where = f" in {last[0].name} ({_short_path(last[0].filename)}:{last[0].lineno})" \
            if last else ""
    return f"{kind}: {text}, raised{where}"


class KeepTensorAttributes:
    """Context manager: on exit, every plain tensor attribute (``module.__dict__`` entries, not
    parameters or buffers) of ``modules`` that the body added or replaced is put back as it was
    (added ones removed). A forward that caches a tensor on a module (longrope's ``long_inv_freq``)
    thus leaves no traced value behind; eager results are unchanged (the cache is rebuilt)."""

    def __init__(self, modules):
        self.modules = list(modules)
        self.saved: list = []

    def __enter__(self):
        self.saved = [(m, {k: v for k, v in vars(m).items() if isinstance(v, torch.Tensor)}) for m in self.modules]
        return self

    def __exit__(self, *exc):
        for m, before in self.saved:
            for k, v in list(vars(m).items()):
                if isinstance(v, torch.Tensor) and before.get(k) is not v:
                    if k in before:
                        object.__setattr__(m, k, before[k])
                    else:
                        delattr(m, k)
        self.saved = []


def _rope_types(module) -> list[str]:
    v = getattr(module, "rope_type", None)
    if isinstance(v, str):
        return [v]
    if isinstance(v, dict):
        return [t for t in v.values() if isinstance(t, str)]
    return []


def refuse_longrope_generation(model, prompt_len: int, max_new_tokens: int) -> None:
    """Raise ValueError where ``model`` has rotary embeddings with ``rope_type`` ``"longrope"`` and a
    generation of ``max_new_tokens`` after a prompt of ``prompt_len`` positions (padding included) grows past
    ``config.original_max_position_embeddings``: ``transformers``' generate then drops its KV cache and runs
    the whole sequence again (every key rotated with the long factors), which a cached generation does not."""
    orig = getattr(getattr(model, "config", None), "original_max_position_embeddings", None)
    if not isinstance(orig, int) or not prompt_len <= orig < prompt_len + max_new_tokens - 1:
        return
    for path, sub in model.named_modules():
        if "longrope" in _rope_types(sub):
            raise ValueError(
                f"{type(model).__name__}: {path} ({type(sub).__name__}) rope_type 'longrope' switches to its long "
                f"factors past original_max_position_embeddings={orig}, and transformers' generate then drops its "
                "KV cache and runs the whole sequence again (every key rotated with the long factors), which the "
                f"stack's cached generation does not: keep prompt + max_new_tokens within {orig + 1} positions "
                f"(got {prompt_len} + {max_new_tokens}), or start from a prompt longer than {orig}")


#: causal LMs the stages give torch's results for only from a ``transformers`` version on:
#: ``{class name: (version, what goes wrong below it)}``.
NEEDS_TRANSFORMERS = {"CodeGenForCausalLM": ((5, 24), "its stages give NaN logits under transformers 5.17")}


def refuse_old_transformers(name: str) -> None:
    """Raise ValueError when the installed ``transformers`` is older than :data:`NEEDS_TRANSFORMERS` asks for
    causal LM class ``name``: the message names the class, the version needed and the one installed."""
    import transformers
    need = NEEDS_TRANSFORMERS.get(name)
    have = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if need is not None and have < need[0]:
        raise ValueError(f"{name} needs transformers >= {'.'.join(map(str, need[0]))} in the stages ({need[1]}); "
                         f"installed {transformers.__version__}")


def refuse_unsupported(model, name: str, prefix: str, layers_attr: str, layers) -> None:
    """Raise ValueError naming the first module with a feature the stages cannot run.

    * rotary embeddings with ``rope_type`` ``"dynamic"`` (any module of ``model``): their
      frequencies are recomputed in Python from the largest position id of each call and kept
      across calls, so torch's result depends on the calls before;
    * mixture-of-experts blocks of ``layers`` with what the stages leave out asked for: the auxiliary
      load-balancing loss (``output_router_logits``: the stages return logits, the loss is the
      caller's) and router jitter noise (random: cannot equal torch's).

    Experts in ``transformers``' experts interface (``@use_experts_implementation``) run as
    :func:`xla_swap.hf.moe.dense_experts_forward` or :func:`xla_swap.hf.moe.sorted_experts_forward` in the
    stages; other experts run their own code, and one whose routing has data-dependent shapes is
    refused when ``SwappedStack`` traces it (the message names the module, :func:`describe_failure`).
    """
    from xla_swap.hf.moe import experts_modules
    for path, sub in model.named_modules():
        kinds = [t for t in _rope_types(sub) if "dynamic" in t]
        if kinds:
            raise ValueError(
                f"{name}: {path} ({type(sub).__name__}) rope_type {kinds[0]!r} is not supported: it recomputes its "
                "frequencies in Python from the largest position id of each call and keeps them across calls "
                "(torch's result depends on the calls before), which a traced stage cannot reproduce; use a "
                "fixed scaling (rope_type 'linear', 'yarn', 'longrope' or 'llama3') or none")
    cfg = getattr(model, "config", None)
    for i, layer in enumerate(layers):
        known = {id(m) for _, m in experts_modules(layer)}
        for sub_name, sub in layer.named_modules():
            cls = type(sub).__name__
            where = f"{name}: {prefix}.{layers_attr}.{i}.{sub_name} ({cls})"
            is_moe = id(sub) in known or sub_name.split(".")[-1] == "experts" or \
                cls.endswith(("Experts", "SparseMoeBlock", "MoE", "Moe", "MoeBlock"))
            if is_moe and getattr(cfg, "output_router_logits", False):
                raise ValueError(f"{where} is a mixture-of-experts block and config.output_router_logits=True "
                                 "asks for the auxiliary load-balancing loss, which the stages do not compute "
                                 "(they return logits); set config.output_router_logits=False")
            if float(getattr(sub, "jitter_noise", 0) or 0) > 0:
                raise ValueError(f"{where} multiplies its input by random router jitter noise "
                                 "(config.router_jitter_noise > 0), which cannot equal torch's; set it to 0")


def refuse_extra_outputs(model, first, ids, mask) -> None:
    """For a model that unpacks its layers' outputs (``first.output_form`` >= 2, an
    :class:`xla_swap.hf.causal_lm.CausalLMFirst`): run its forward on ``ids`` / ``mask`` (the probe input) with the
    stand-ins' entries after the hidden state an :class:`~xla_swap.hf.capture.Unused` marker, and raise
    ValueError naming what it does with one (computes with it, or passes it to the next layer: a state
    carried from layer to layer besides the hidden state, which the stages do not carry)."""
    marker, base = Unused(), type(first.base_module).__name__
    try:
        with torch.no_grad():
            record, out = first.run_layers(ids, mask, None, stop=False, fill=marker)
    except Exception as e:   # noqa: BLE001 - named
        raise ValueError(f"{type(model).__name__}: {base}.forward computes with its decoder layers' outputs after "
                         f"the hidden state (of {first.output_form}): {describe_failure(e)}; the stages carry only "
                         "the hidden state from layer to layer: not supported") from e
    for i, (_, kw) in enumerate(record):
        for name, v in kw.items():
            if holds(v, marker):
                raise ValueError(f"{type(model).__name__}: {base}.forward passes decoder layer {i - 1}'s output "
                                 f"after the hidden state to decoder layer {i} as {name}= (a state carried from "
                                 "layer to layer besides the hidden state); the stages carry only the hidden "
                                 "state: not supported")


def _tainted_run(model, first, ids, mask, embedding: bool = False):
    """``first.run_layers`` on the probe input with stand-ins returning a leaf requiring grad (and, with
    ``embedding``, the input embedding's output one too), the model's parameters held out of autograd
    meanwhile: ``(record, out)``, or ``None`` where the forward raises (it runs untainted: no verdict)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    emb, hook = None, None
    if embedding:
        try:
            emb = model.get_input_embeddings()
        except Exception:   # noqa: BLE001 - no embedding to taint
            emb = None
    if isinstance(emb, torch.nn.Module):
        hook = emb.register_forward_hook(lambda m, a, out: out.detach().requires_grad_()
                                         if isinstance(out, torch.Tensor) and out.is_floating_point() else out)
    try:
        with torch.enable_grad():
            return first.run_layers(ids, mask, None, stop=False, taint=True)
    except Exception:   # noqa: BLE001 - see the docstring
        return None
    finally:
        if hook is not None:
            hook.remove()
        for p in params:
            p.requires_grad_(True)


def refuse_state_between_layers(model, first, ids, mask) -> None:
    """Run ``first``'s base forward (an :class:`xla_swap.hf.causal_lm.CausalLMFirst`) on the probe input with stand-ins
    returning a leaf requiring grad (the model's parameters held out of autograd meanwhile), and raise
    ValueError naming the first keyword argument of a layer computed from an earlier layer's output
    (e.g. states gathered from layer to layer, ``block_states``): the stages compute every layer's keyword
    arguments in the first stage, from the embedding alone."""
    found = _tainted_run(model, first, ids, mask)
    if found is None:
        return
    base = type(first.base_module).__name__
    for i, (_, kw) in enumerate(found[0]):
        for name, v in kw.items():
            if is_tensor_tree(v) and any(t.requires_grad for t in leaves(v)):
                raise ValueError(f"{type(model).__name__}: {base}.forward passes decoder layer {i} {name}= computed "
                                 "from earlier decoder layers' outputs (a state carried from layer to layer besides "
                                 "the hidden state); the stages compute every layer's arguments from the embedding: "
                                 "not supported")


def refuse_output_from_earlier_layers(model, first, ids, mask) -> None:
    """For a model whose stages' logits differ from its own forward: run ``first``'s base forward on the probe
    input with the input embedding's output and the stand-ins' outputs leaves requiring grad
    (:func:`_tainted_run`), and raise ValueError naming the first decoder layer whose input (the embedding,
    or an earlier layer's output) the base model's output depends on other than through the layers (states
    gathered over the layers and combined after them, as Inkling-2's ``final_input``): the last stage gets
    the last layer's output alone. Returns quietly where that is not the cause."""
    found = _tainted_run(model, first, ids, mask, embedding=True)
    if found is None:
        return
    record, out = found
    h = getattr(out, "last_hidden_state", None)
    h = out[0] if h is None and isinstance(out, (tuple, list)) and out else h
    inputs = [(i, x) for i, (x, _) in enumerate(record) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not isinstance(h, torch.Tensor) or not h.requires_grad or not inputs:
        return
    grads = torch.autograd.grad(h.float().sum(), [x for _, x in inputs], allow_unused=True)
    used = [i for (i, _), g in zip(inputs, grads) if g is not None and bool(g.ne(0).any())]
    if used:
        what = "the embedding" if used[0] == 0 else f"decoder layer {used[0] - 1}'s output"
        raise ValueError(f"{type(model).__name__}: {type(first.base_module).__name__}.forward computes its output "
                         f"after the decoder layers from decoder layer {used[0]}'s input ({what}) besides the last "
                         "layer's output (states gathered over the layers and combined after them); the last stage "
                         "gets the last layer's output alone: not supported")
