"""Mixed precision of the torch entry point (``SwappedStack(mp_policy=MixedPrecisionPolicy(param_dtype=
torch.bfloat16))``, FSDP2's policy): float32 master weights in host memory, each stage computing in bfloat16
inside its executable. Of the policy, ``param_dtype`` and ``cast_forward_inputs`` are honoured;
``output_dtype`` must be ``None``; ``reduce_dtype`` ``None`` or ``param_dtype``, or ``torch.float32`` on one
device (no reduction there: the cast of the bf16 gradient to the float32 master is exact).

:func:`check_mixed_precision` reads and checks the arguments; :func:`compute_in` wraps one stage
function; :func:`stage_functions_in` wraps every stage function of a stack (shared ones stay shared).

What it does: the parameters stay in ``pinned_host`` in the model's float32 (the master weights; AdamW
moments float32 too, unless the optimizer's ``state_dtype`` says otherwise); each stage casts its floating
parameters (not its buffers) and its floating inputs to bf16 on the device, inside its executable, so
forward and backward compute in bf16, the gradient w.r.t. the master is the bf16 gradient cast to float32
by the cast's transpose, and AdamW updates the float32 master. Outputs, the carry and ``.grad`` (without
an optimizer: float32) are as computed. Cost: the weights cross the link as float32, twice the bytes of
bf16 weights (``runtime.stage_nbytes`` counts them so, and the planner and ``autotune`` with it); the bf16
copy is a temporary of the stage's executable. ``float16`` is refused (it needs loss scaling, which the
stack does not implement).

The module imports torch and jax.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import torch

__all__ = ["check_mixed_precision", "is_float", "cast_floats", "compute_in", "stage_functions_in"]


def check_mixed_precision(mp_policy, n_devices: int) -> tuple[torch.dtype | None, bool]:
    """``(compute dtype or None, cast floating inputs)`` of ``SwappedStack``'s ``mp_policy`` argument (a
    ``torch.distributed.fsdp.MixedPrecisionPolicy`` or ``None``), checked (no state changes).

    Raises: TypeError / ValueError naming the ``mp_policy`` field not honoured.
    """
    if mp_policy is None:
        return None, True
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # torch built without distributed
        MixedPrecisionPolicy = None
    if MixedPrecisionPolicy is None or not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError("mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
                        f"got {type(mp_policy).__name__}")
    dtype, cast_inputs = mp_policy.param_dtype, bool(mp_policy.cast_forward_inputs)
    if mp_policy.output_dtype is not None:
        raise ValueError(f"mp_policy.output_dtype={mp_policy.output_dtype} is not implemented: the stack "
                         "returns the last stage's output as it computes it (leave output_dtype=None)")
    red = mp_policy.reduce_dtype
    if red is not None and red != dtype and not (red == torch.float32 and n_devices == 1):
        raise ValueError(f"mp_policy.reduce_dtype={red} is not implemented: gradients are reduced in "
                         f"param_dtype ({dtype}); reduce_dtype=torch.float32 is honoured on one device only "
                         "(no reduction: the bf16 gradient's cast to the fp32 master is exact)")
    if dtype is None:
        return None, cast_inputs
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"mp_policy.param_dtype must be a torch.dtype or None, got {type(dtype).__name__}")
    if dtype != torch.bfloat16:
        raise ValueError(f"mp_policy.param_dtype must be torch.bfloat16 or None, got {dtype}: float16 compute needs "
                         "loss scaling, which the stack does not implement")
    return dtype, cast_inputs


def is_float(dt) -> bool:
    """Whether dtype ``dt`` is a floating dtype (``jnp.issubdtype(dt, jnp.floating)``)."""
    return jnp.issubdtype(dt, jnp.floating)


def cast_floats(tree, dtype):
    """``tree`` with its floating leaves cast to ``dtype`` (others unchanged)."""
    return jax.tree_util.tree_map(lambda v: v.astype(dtype) if is_float(v.dtype) else v, tree)


def compute_in(fn: Callable, pnames: frozenset, dtype, cast_inputs: bool) -> Callable:
    """``fn(w, h)`` computing with its floating parameters (the names in ``pnames``; buffers stay
    as held) cast to ``dtype`` inside the stage, and with ``cast_inputs`` the floating leaves of
    ``h`` too: the gradient w.r.t. the held (master) parameter is the cast's transpose of the
    gradient w.r.t. the cast copy, in the master's dtype."""
    def stage(w, h):
        w = {n: (_round_to(v, dtype) if n in pnames and is_float(v.dtype) else v) for n, v in w.items()}
        return fn(w, cast_floats(h, dtype) if cast_inputs else h)
    return stage


def _round_to(v, dtype):
    """``v.astype(dtype)``, rounded by ``reduce_precision`` first: XLA's CPU backend computes bf16 dots in
    f32 and, allowed excess precision, drops an f32 -> bf16 -> f32 convert pair, which would hand the dot
    the unrounded master; ``reduce_precision`` is kept. Its transpose rounds the cotangent, which the
    convert's transpose already gives in ``dtype``: the gradient is unchanged."""
    fi = jnp.finfo(dtype)
    return jax.lax.reduce_precision(v, exponent_bits=fi.nexp, mantissa_bits=fi.nmant).astype(dtype)

def stage_functions_in(fns: list, trainable: list, dtype, cast_inputs: bool) -> list:
    """``fns`` (one JAX function ``f(w, h)`` per stage) each wrapped by :func:`compute_in` with that
    stage's parameter names ``trainable[i]``; a function shared by several stages gets one wrapper
    (shared layers keep sharing their executables). Returns a new list of ``len(fns)``."""
    wrapped: dict[int, Callable] = {}
    out = []
    for f, names in zip(fns, trainable):
        if id(f) not in wrapped:
            wrapped[id(f)] = compute_in(f, frozenset(names), dtype, cast_inputs)
        out.append(wrapped[id(f)])
    return out
