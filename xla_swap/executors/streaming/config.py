"""The settings a streaming runtime is built with: one frozen :class:`RuntimeConfig`, checked once
when it is made, and the checks of the settings that are also given per call.

Imports numpy and jax only (no torch).
"""
from __future__ import annotations

import dataclasses
import enum
import types
from typing import Callable, Sequence

import jax
import numpy as np

from xla_swap.planning.policy import OffloadPolicy

from ..trace import TraceRecorder

__all__ = ["DEFAULT_MAX_SIGNATURES", "BackwardMode", "RuntimeConfig", "check_flag", "check_max_grad_norm",
           "check_max_signatures", "check_prefetch_depth", "check_trace", "check_train_args", "checked_resident", "remat_from_policy"]

#: Default bound of the per-input-signature executable cache (``max_signatures``).
DEFAULT_MAX_SIGNATURES = 8


def check_prefetch_depth(prefetch_depth) -> int:
    """``prefetch_depth`` as an int; TypeError unless it is an int (not a bool), ValueError unless >= 1."""
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, (int, np.integer)):
        raise TypeError(f"prefetch_depth must be an int >= 1, got {type(prefetch_depth).__name__}")
    if prefetch_depth < 1:
        raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
    return int(prefetch_depth)


def check_max_signatures(max_signatures) -> int:
    """``max_signatures`` as an int; ValueError unless it is an int (not a bool) >= 1."""
    m = max_signatures
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
        raise ValueError(f"max_signatures must be an int >= 1, got {m!r}")
    return int(m)


def check_flag(name: str, flag) -> None:
    """TypeError naming ``name`` unless ``flag`` is a bool."""
    if not isinstance(flag, bool):
        raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def check_max_grad_norm(max_grad_norm) -> float | None:
    """``max_grad_norm`` as a float, or ``None``; ValueError unless a finite number > 0 or ``None``."""
    if max_grad_norm is None:
        return None
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float, np.floating, np.integer)) \
            or not np.isfinite(max_grad_norm) or max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}")
    return float(max_grad_norm)


def checked_resident(resident, n: int) -> tuple[bool, ...]:
    """``resident`` as ``n`` bools (``None``: none resident); ValueError otherwise."""
    if resident is None:
        resident = [False] * n
    if isinstance(resident, (str, bytes)) or not isinstance(resident, Sequence) or len(resident) != n \
            or not all(isinstance(r, (bool, np.bool_)) for r in resident):
        raise ValueError(f"resident must be a sequence of {n} bools (one per stage), got {resident!r}")
    return tuple(bool(r) for r in resident)


class BackwardMode(enum.Enum):
    """What a training call's backward does with each stage's parameter gradients."""

    GRADS = "grads"     # returned (to host memory or device memory): no optimizer
    UPDATE = "update"   # the optimizer's update fused into the backward
    ACCUM = "accum"     # summed into the accumulated gradients (with their sum of squares)


def check_trace(trace) -> None:
    """Raise ``TypeError`` unless ``trace`` is a ``TraceRecorder`` or ``None``."""
    if trace is not None and not isinstance(trace, TraceRecorder):
        hint = " (pass trace=TraceRecorder() to record a trace)" if isinstance(trace, bool) else ""
        raise TypeError(f"trace must be an xla_swap.executors.TraceRecorder or None, got {type(trace).__name__}{hint}")


def check_train_args(loss_fn, cotangent, loss_args, trace, accumulate, skip_nonfinite, max_grad_norm) -> None:
    """Raise for ``train_step`` arguments of the wrong type or value (errors name the argument)."""
    if (loss_fn is None) == (cotangent is None):
        raise ValueError("train_step needs exactly one of loss_fn and cotangent")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(loss_args, tuple):
        raise TypeError(f"loss_args must be a tuple, got {type(loss_args).__name__}")
    check_trace(trace)
    check_flag("accumulate", accumulate)
    if skip_nonfinite is not None:
        check_flag("skip_nonfinite", skip_nonfinite)
    check_max_grad_norm(max_grad_norm)


def remat_from_policy(policy: OffloadPolicy):
    """The runtime's ``remat`` argument for a policy's ``remat`` and ``activations``: ``False``,
    ``True``, or ``jax.checkpoint_policies.save_only_these_names`` of the activations named
    ``"device"``.

    Raises: ValueError: ``policy.activations`` offloads names to the host (not supported here).
    """
    host = policy.offloaded_activations
    if host:
        raise ValueError(f"policy.activations offloads {list(host)} to the host by name; the streaming runtime "
                         "offloads whole stage inputs and residuals instead (offload_activations=True); named "
                         "activation offload runs in the torch_xla scan helpers. Use 'device' or 'remat' here")
    keep = tuple(n for n, w in policy.activations.items() if w == "device")
    if not policy.remat:
        return False
    if keep:
        return jax.checkpoint_policies.save_only_these_names(*keep)
    return True


def _check_remat(remat) -> None:
    if not (isinstance(remat, bool) or callable(remat)) or isinstance(remat, (type, types.BuiltinFunctionType)):
        raise TypeError(f"remat must be a bool or a jax.checkpoint_policies policy (a function), got {remat!r}")


_FLAGS = ("offload_activations", "grads_to_host", "optimizer_state_on_host", "donate", "throttle",
          "track_residency", "prefetch_next_call", "skip_nonfinite")


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How a ``StreamingRuntime`` moves and keeps its arrays: fixed at construction, checked once here.

    Attributes (the ``StreamingRuntime`` constructor keywords of the same names document them):
      num_stages: L >= 1.
      prefetch_depth: k >= 1, stages whose weights are copied ahead.
      resident: L bools, the stages kept in device memory for good.
      remat: ``True``, ``False`` or a ``jax.checkpoint_policies`` policy.
      offload_activations, grads_to_host, optimizer_state_on_host, donate, throttle, track_residency,
        prefetch_next_call, skip_nonfinite: bools.
      max_signatures: int >= 1, input signatures whose executables stay cached.
      max_grad_norm: ``None`` or a finite float > 0: the gradient clip of every update.
      skip_nonfinite: bool: every update whose gradient norm is not finite is skipped.

    Raises (at construction): TypeError: ``prefetch_depth`` not an int, a flag not a
      bool, ``remat`` neither a bool nor a policy; ValueError: ``prefetch_depth < 1``, ``resident`` not
      ``num_stages`` bools, ``max_signatures`` not an int >= 1, ``max_grad_norm`` not a finite number > 0.
    """

    num_stages: int
    prefetch_depth: int = 1
    resident: tuple | None = None
    remat: bool | Callable = True
    offload_activations: bool = False
    grads_to_host: bool = True
    optimizer_state_on_host: bool = True
    donate: bool = True
    throttle: bool = True
    track_residency: bool = True
    prefetch_next_call: bool = True
    max_signatures: int = DEFAULT_MAX_SIGNATURES
    max_grad_norm: float | None = None
    skip_nonfinite: bool = False

    @property
    def needs_norm(self) -> bool:
        """Whether an update needs the global gradient norm first (``max_grad_norm`` or ``skip_nonfinite``)."""
        return self.max_grad_norm is not None or self.skip_nonfinite

    def step_norm_settings(self, max_grad_norm: float | None, skip_nonfinite: bool | None) -> tuple:
        """``(max_grad_norm, skip_nonfinite)`` of one step: its own values, ``None`` standing for this config's."""
        return (self.max_grad_norm if max_grad_norm is None else max_grad_norm,
                self.skip_nonfinite if skip_nonfinite is None else skip_nonfinite)

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen: set once here
        set_("prefetch_depth", check_prefetch_depth(self.prefetch_depth))
        for name in _FLAGS:
            check_flag(name, getattr(self, name))
        _check_remat(self.remat)
        set_("resident", checked_resident(self.resident, self.num_stages))
        set_("max_signatures", check_max_signatures(self.max_signatures))
        set_("max_grad_norm", check_max_grad_norm(self.max_grad_norm))

    def replace(self, **changes) -> "RuntimeConfig":
        """A copy with ``changes`` (checked as at construction)."""
        return dataclasses.replace(self, **changes)
