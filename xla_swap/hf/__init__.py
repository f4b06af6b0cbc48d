"""Hugging Face models through ``SwappedStack``: ``causal_lm_stages`` (a causal LM as stages, from the model's
own code), the refusals, mixture-of-experts layers, the KV cache and generation, and ``load_stack`` from a
safetensors checkpoint. ``causal_lm_stages`` loads on first use (torch, transformers)."""
import importlib

_LAZY = {"causal_lm_stages": "xla_swap.hf.causal_lm"}
__all__ = sorted(_LAZY)


def __getattr__(name):
    """``causal_lm_stages``, imported on first use; AttributeError for any other name."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'xla_swap.hf' has no attribute {name!r}")
