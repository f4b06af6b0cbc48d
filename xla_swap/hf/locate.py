"""Where a Hugging Face causal LM keeps its parts: the base model (found by ``transformers``' own
accessors), its decoder layer list and its final norm (by name; ``xla_swap.hf`` checks the norm
against what the base's forward does). Imports torch only."""
from __future__ import annotations

import torch

__all__ = ["NORM_NAMES", "LAYER_NAMES", "base_candidates", "locate"]

#: attribute names of the base model's final norm, in the layouts of the installed ``transformers`` (a
#: base model whose forward applies another of its children after the layers has it found by the probe).
NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm", "norm_f", "embedding_norm")
#: attribute names of the decoder layer list.
LAYER_NAMES = ("layers", "h", "blocks", "layer", "decoder_layers")


def _find(obj, names, pred):
    """The first of ``names`` that ``obj`` has as an attribute satisfying ``pred``, or ``None``."""
    for n in names:
        v = getattr(obj, n, None)
        if v is not None and pred(v):
            return n
    return None


def base_candidates(model) -> list:
    """The modules that may be a causal LM's base model, by ``transformers``' own accessors: the one at
    ``base_model_prefix``, ``get_decoder()``, and the child holding ``get_input_embeddings()``."""
    found = [getattr(model, getattr(model, "base_model_prefix", "") or "", None)]
    for accessor in ("get_decoder", "get_input_embeddings"):
        try:
            v = getattr(model, accessor)() if callable(getattr(model, accessor, None)) else None
        except Exception:   # noqa: BLE001 - an accessor a model does not implement
            v = None
        if accessor == "get_input_embeddings" and v is not None:
            v = next((c for _, c in model.named_children() if any(m is v for m in c.modules())), None)
        found.append(v)
    return [m for m in found if isinstance(m, torch.nn.Module) and m is not model]


def locate(model, layers_attr, norm_attr) -> tuple:
    """``(base, path of the base in model, layers_attr, norm_attr or None)`` of a causal LM; TypeError when
    not one. The base is the first of :func:`base_candidates` holding the decoder layer list."""
    name = type(model).__name__
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    cands = base_candidates(model) if isinstance(model, torch.nn.Module) else []
    if not cands or head is None:
        raise TypeError(f"model must be a Hugging Face causal LM with a base model and an output embedding, got {name}")
    cfg = getattr(model, "config", None)
    counts = {getattr(cfg, k, None) for k in ("num_hidden_layers", "decoder_layers", "num_decoder_layers",
                                                "num_layers", "num_blocks")} - {None}
    is_list = lambda v: isinstance(v, torch.nn.ModuleList) and len(v) > 0 and (not counts or len(v) in counts)
    for base in cands:
        attr = layers_attr if layers_attr is not None else _find(base, LAYER_NAMES, is_list)
        if attr is not None and is_list(getattr(base, attr, None)):
            break
    else:
        base, attr = cands[0], layers_attr
    path = next(n for n, m in model.named_modules() if m is base)
    if attr is None or not is_list(getattr(base, attr, None)):
        nested = next((n for n, m in base.named_modules() if n and n.rsplit(".", 1)[-1] in LAYER_NAMES and is_list(m)),
                      None)
        if nested is not None and layers_attr is None:
            raise TypeError(f"{name}: its decoder layers are at {path}.{nested}, inside a child module of the base "
                            f"model {type(base).__name__} rather than one of its attributes (an encoder-style layout): "
                            "the stages replace the layer list of the module whose forward runs the embedding; "
                            "not supported")
        raise TypeError(f"{name}: no decoder layer list (a ModuleList of config.num_hidden_layers or decoder_layers "
                        f"modules) found at "
                        f"{path}.{attr or '/'.join(LAYER_NAMES)}; pass layers_attr=")
    if norm_attr is None:
        norm_attr = _find(base, NORM_NAMES, lambda v: isinstance(v, torch.nn.Module))
    return base, path, attr, norm_attr or None
