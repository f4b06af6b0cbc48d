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

from xla_swap.planning.optimizer import HYPER_WIDTH, AdamW

__all__ = ["init_state", "apply_update", "check_optimizer", "hyper_rows", "sum_squares"]


def check_optimizer(optimizer) -> list | None:
    """The parameter groups' configurations: ``None`` for no optimizer, ``[optimizer]`` for one
    ``AdamW``, the list for a non-empty sequence of them (one per group; equal ``state_dtype``).

    Raises: TypeError naming ``optimizer`` for anything else; ValueError for an empty sequence
    or groups with different ``state_dtype``.
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, AdamW):
        return [optimizer]
    if isinstance(optimizer, (list, tuple)) and all(isinstance(o, AdamW) for o in optimizer):
        if not optimizer:
            raise ValueError("optimizer: an empty sequence of parameter groups")
        if len({o.state_dtype for o in optimizer}) != 1:
            raise ValueError("optimizer: every parameter group needs the same state_dtype, got "
                             f"{[o.state_dtype for o in optimizer]}")
        return list(optimizer)
    raise TypeError("optimizer must be an xla_swap.planning.AdamW, a sequence of them (one per parameter group) "
                    f"or None, got {type(optimizer).__name__}")


def state_dtype(opt: AdamW, param_dtype) -> np.dtype:
    """dtype of the moments of a parameter of ``param_dtype``."""
    return jnp.dtype(opt.state_dtype_for(np.dtype(param_dtype).name))


def init_state(opt: AdamW, param_avals: list) -> list:
    """Zero moments for a list of parameter avals: ``[(m, v), ...]`` of numpy arrays (host)."""
    out = []
    for a in param_avals:
        dt = state_dtype(opt, a.dtype)
        out.append((np.zeros(a.shape, dt), np.zeros(a.shape, dt)))
    return out


def hyper_rows(groups: list, step: int, lr: float | None = None) -> np.ndarray:
    """The traced step scalars of every parameter group: float32 ``[len(groups), HYPER_WIDTH]``.

    Each row is ``groups[g].hyper(step, lr)`` (computed in float64, then rounded once).

    Raises: the ``ValueError`` of ``AdamW.hyper`` (bad ``step`` or ``lr``).
    """
    return np.asarray([g.hyper(step, lr) for g in groups], np.float64).astype(np.float32)


def apply_update(params: list, grads: list, state: list, hyper, groups: list, scale=None):
    """One AdamW step on lists of arrays (traced inside the backward or update executable).

    Args:
      params, grads: lists of arrays of equal shapes; the update runs in float32.
      state: list of ``(m, v)`` pairs.
      hyper: float32 array ``[G, HYPER_WIDTH]``: one row of ``AdamW.hyper(step, lr)`` per
        parameter group, so that the step number and every hyperparameter change without a
        recompile.
      groups: per parameter, its row of ``hyper`` (Python ints: static).
      scale: ``None`` or a float32 scalar array the gradients are multiplied by first (in their
        own dtype, as ``clip_grad_norm_`` scales ``.grad``).

    Returns: ``(new_params, new_state)``, the dtypes of the inputs.
    """
    new_p, new_s = [], []
    for p, g, (m, v), gi in zip(params, grads, state, groups):
        decay, step_size, bc2_sqrt, b1, c1, b2, c2, eps = (hyper[gi, c] for c in range(HYPER_WIDTH))
        if scale is not None:
            g = g * scale.astype(g.dtype)
        g32 = g.astype(jnp.float32)
        m32 = m.astype(jnp.float32) * b1 + c1 * g32
        v32 = v.astype(jnp.float32) * b2 + c2 * g32 * g32
        p32 = p.astype(jnp.float32) * decay
        p32 = p32 - step_size * m32 / (jnp.sqrt(v32) / bc2_sqrt + eps)
        new_p.append(p32.astype(p.dtype))
        new_s.append((m32.astype(m.dtype), v32.astype(v.dtype)))
    return new_p, new_s


def sum_squares(grads: list):
    """float32 scalar: the sum of the squares of every element of ``grads`` (computed in float32)."""
    total = jnp.zeros((), jnp.float32)
    for g in grads:
        g32 = g.astype(jnp.float32)
        total = total + jnp.sum(g32 * g32)
    return total
