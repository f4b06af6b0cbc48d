"""The JAX side of the optimizer configurations in ``xla_swap.planning.optimizer``.

The streaming runtime applies an optimizer per stage, on the device, right after that
stage's backward: the stage's weights and moments come from ``pinned_host`` (prefetched
with the weights), the update runs in the same executable as the backward, and the new
weights and moments go back to ``pinned_host``. Gradients then never leave the device.
Imports jax and numpy only.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from xla_swap.planning.optimizer import AdamW

__all__ = ["init_state", "apply_update", "check_optimizer"]


def check_optimizer(optimizer):
    """Return ``optimizer`` if it is a supported configuration, else raise ``TypeError`` naming it."""
    if optimizer is not None and not isinstance(optimizer, AdamW):
        raise TypeError(f"optimizer must be an xla_swap.planning.AdamW or None, got {type(optimizer).__name__}")
    return optimizer


def state_dtype(opt: AdamW, param_dtype) -> np.dtype:
    """dtype of the moments of a parameter of ``param_dtype``."""
    return np.dtype(param_dtype) if opt.state_dtype is None else jnp.dtype(opt.state_dtype)


def init_state(opt: AdamW, param_avals: list) -> list:
    """Zero moments for a list of parameter avals: ``[(m, v), ...]`` of numpy arrays (host)."""
    out = []
    for a in param_avals:
        dt = state_dtype(opt, a.dtype)
        out.append((np.zeros(a.shape, dt), np.zeros(a.shape, dt)))
    return out


def apply_update(opt: AdamW, params: list, grads: list, state: list, hyper):
    """One AdamW step on lists of arrays (traced inside the backward executable).

    Args:
      opt: the configuration (betas, eps are compiled in).
      params, grads: lists of arrays of equal shapes; the update runs in float32.
      state: list of ``(m, v)`` pairs.
      hyper: float32 array of shape ``(3,)``: ``AdamW.hyper(step, lr)``, so that the step
        number and the learning rate change without a recompile.

    Returns: ``(new_params, new_state)``, the dtypes of the inputs.
    """
    b1, b2 = opt.betas
    decay, step_size, bc2_sqrt = hyper[0], hyper[1], hyper[2]
    new_p, new_s = [], []
    for p, g, (m, v) in zip(params, grads, state):
        g32 = g.astype(jnp.float32)
        m32 = m.astype(jnp.float32) * b1 + (1.0 - b1) * g32
        v32 = v.astype(jnp.float32) * b2 + (1.0 - b2) * g32 * g32
        p32 = p.astype(jnp.float32) * decay
        p32 = p32 - step_size * m32 / (jnp.sqrt(v32) / bc2_sqrt + opt.eps)
        new_p.append(p32.astype(p.dtype))
        new_s.append((m32.astype(m.dtype), v32.astype(v.dtype)))
    return new_p, new_s

