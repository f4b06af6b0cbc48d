"""The torch entry point: ``SwappedStack`` and its parts (training, autotuning under a budget,
checkpoints, mixed precision, sharding, the torch <-> jax bridge, the stage split, the setting groups in
:mod:`xla_swap.stack.config`). Imports nothing heavy itself: ``SwappedStack`` (torch, torchax, jax) loads on
first use, so ``import xla_swap.stack.config`` needs no torch."""
import importlib

_LAZY = {"SwappedStack": "xla_swap.stack.swapped_stack", "causal_lm_stages": "xla_swap.hf.causal_lm"}
__all__ = sorted(_LAZY)


def __getattr__(name):
    """``SwappedStack`` and ``causal_lm_stages``, imported on first use; AttributeError for any other name."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'xla_swap.stack' has no attribute {name!r}")
