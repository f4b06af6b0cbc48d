"""PEFT models (``peft.PeftModel``) as :func:`xla_swap.hf.causal_lm.causal_lm_stages` takes them.

A LoRA ``PeftModel`` wraps a ``transformers`` causal LM whose targeted modules ``peft`` replaced,
in place, by its own ``lora.Linear`` (``lora.Embedding``, ...) modules: base layer, ``lora_A``,
``lora_B``, dropout and scaling. Its forward (``PeftModelForCausalLM.forward`` -> ``LoraModel.forward``)
is the wrapped model's, so the stages are cut from that model (``get_base_model()``) and run
``peft``'s own modules, DoRA's weight-norm arithmetic included. The base weights are frozen
(``requires_grad=False``): ``SwappedStack`` computes no gradient for them, keeps no optimizer
state for them and never moves them back to host memory.

:func:`peft_causal_lm` checks the model first and refuses, naming the module and the feature,
what the stages would not compute as torch does:

* a PEFT type other than LoRA, prompt learning, a ``PeftMixedModel``;
* a LoRA variant other than DoRA (aLoRA, Arrow, ...), a LoRA module type other than ``Linear``
  and ``Embedding`` (convolutions, quantized base layers, ``target_parameters``), DoRA with
  ``peft``'s DoRA caching on (it would keep traced values);
* adapter dropout in training mode (random: it cannot equal torch's);
* adapters merged into the base weights; adapters disabled, or not active, while their weights
  (or a ``modules_to_save`` copy's) require grad (torch gives such a weight no gradient and AdamW
  skips it; the stages would give it a zero gradient and AdamW's weight decay would change it).

Several active adapters are summed by ``peft``'s forward and run as they are. The names of the
parameters in the PEFT model (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``)
are what ``SwappedStack``'s checkpoints use for such a stack (``CausalLMFirst.parameter_names``).

The module imports torch; ``peft`` only where it is imported already (a PEFT model exists).
"""
from __future__ import annotations

import sys

import torch

__all__ = ["is_peft_model", "peft_causal_lm"]

#: the ``peft`` LoRA module types the stages run (class names in ``peft.tuners.lora``).
SUPPORTED_LAYERS = ("Linear", "Embedding")
#: the LoRA variants the stages run (class names): DoRA's.
SUPPORTED_VARIANTS = ("DoraLinearVariant", "DoraEmbeddingVariant")


def is_peft_model(model) -> bool:
    """Whether ``model`` is a ``peft`` model (``PeftModel`` or ``PeftMixedModel``); ``False`` when
    ``peft`` was never imported."""
    peft = sys.modules.get("peft")
    if peft is None:
        return False
    kinds = tuple(k for k in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None)) if k)
    return isinstance(model, kinds)


def peft_causal_lm(model) -> tuple:
    """``(causal_lm, names)``: the ``transformers`` model to cut into stages and ``{id(parameter): its
    name in model}`` for a PEFT model; ``(model, None)`` for any other model.

    Raises: ValueError naming the PEFT model's module and the feature (module docstring) for what
      the stages cannot compute as torch does.
    """
    if not is_peft_model(model):
        return model, None
    import peft
    name = type(model).__name__
    if not isinstance(model, peft.PeftModel):
        raise ValueError(f"{name}: a PeftMixedModel (adapters of several PEFT types) is not supported; "
                         "use a PeftModel with LoRA adapters")
    active = list(model.active_adapters)
    for a in active:
        cfg = model.peft_config[a]
        kind = getattr(cfg.peft_type, "value", cfg.peft_type)
        if cfg.is_prompt_learning or kind != "LORA":
            raise ValueError(f"{name}: adapter {a!r} is PEFT type {kind}"
                             f"{' (prompt learning: it changes the inputs)' if cfg.is_prompt_learning else ''}; "
                             "only LoRA (and DoRA) adapters are supported")
    base = model.get_base_model()
    for mod_name, mod in base.named_modules():
        where = f"{name}: {mod_name} ({type(mod).__name__})"
        if isinstance(mod, peft.tuners.tuners_utils.BaseTunerLayer):
            _check_tuner_layer(where, mod, active)
        elif isinstance(mod, peft.utils.other.ModulesToSaveWrapper):   # modules_to_save: trained copies
            _check_unused(where, {"modules_to_save": mod.modules_to_save}, [] if mod.disable_adapters else active,
                          mod.disable_adapters)
    return base, {id(p): n for n, p in model.named_parameters()}


def _check_unused(where: str, dicts: dict, used: list, disabled: bool) -> None:
    """Raise ValueError naming ``where`` for a parameter of ``dicts`` (``{name: ModuleDict or
    ParameterDict of adapters}``) that requires grad while its adapter is not in ``used``."""
    for dict_name, adapters in dicts.items():
        for a, sub in adapters.items():
            params = [sub] if isinstance(sub, torch.nn.Parameter) else list(sub.parameters())
            if a not in used and any(p.requires_grad for p in params):
                why = "adapters are disabled" if disabled else f"adapter {a!r} is not active"
                raise ValueError(f"{where}: {dict_name}[{a!r}] requires grad but {why}: torch gives it no "
                                 "gradient and AdamW skips it; freeze it (requires_grad_(False)) or activate it")


def _check_tuner_layer(where: str, mod, active: list) -> None:
    """Raise ValueError naming ``where`` for a feature of ``peft`` module ``mod`` the stages cannot run."""
    from peft.tuners import lora
    from peft.tuners.lora import dora
    if not isinstance(mod, lora.LoraLayer) or type(mod).__name__ not in SUPPORTED_LAYERS \
            or type(mod).__module__ != lora.layer.__name__:
        raise ValueError(f"{where} is not a LoRA Linear or Embedding module of peft.tuners.lora.layer: "
                         "not supported (LoRA on nn.Linear and nn.Embedding is)")
    if mod.merged:
        raise ValueError(f"{where} has adapters {mod.merged_adapters} merged into its base weight; "
                         "call unmerge_adapter() before building the stages")
    used = [] if mod.disable_adapters else [a for a in active if a in mod.lora_A or a in mod.lora_embedding_A]
    _check_unused(where, {n: getattr(mod, n) for n in mod.adapter_layer_names}, used, mod.disable_adapters)
    for a in used:
        variant = mod.lora_variant.get(a)
        if variant is not None and type(variant).__name__ not in SUPPORTED_VARIANTS:
            raise ValueError(f"{where}: adapter {a!r} is a {type(variant).__name__} (a LoRA variant other than "
                             "DoRA): not supported")
        if variant is not None and dora.ENABLE_DORA_CACHING:
            raise ValueError(f"{where}: adapter {a!r} is DoRA and peft.tuners.lora.dora.ENABLE_DORA_CACHING is on "
                             "(it would keep traced values): turn it off")
        drop = mod.lora_dropout[a] if a in mod.lora_dropout else None
        if isinstance(drop, torch.nn.Dropout) and drop.p > 0 and drop.training:
            raise ValueError(f"{where}: adapter {a!r} has lora_dropout={drop.p} in training mode, random: it cannot "
                             "equal torch's; set LoraConfig(lora_dropout=0.0) or call model.eval()")
