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

__all__ = ["DEFAULT_MAX_SIGNATURES", "BackwardMode", "POLICY_FIELDS", "RuntimeConfig", "check_flag",
           "check_max_grad_norm", "check_max_signatures", "check_prefetch_depth", "check_trace", "check_train_args",
           "checked_config", "checked_resident", "config_from_policy", "remat_from_policy"]

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


def checked_resident(resident, n: int | None) -> tuple[bool, ...] | None:
    """``resident`` as ``n`` bools (``None``: none resident); ValueError otherwise. With ``n=None`` (the
    number of stages not known yet): any number of bools, and ``None`` stays ``None``."""
    if resident is None:
        resident = None if n is None else [False] * n
    if resident is None:
        return None
    if isinstance(resident, (str, bytes)) or not isinstance(resident, Sequence) \
            or (n is not None and len(resident) != n) or not all(isinstance(r, (bool, np.bool_)) for r in resident):
        raise ValueError(f"resident must be a sequence of {'' if n is None else f'{n} '}bools (one per stage), "
                         f"got {resident!r}")
    return tuple(bool(r) for r in resident)


def _check_num_stages(num_stages) -> None:
    if num_stages is None:
        return
    if isinstance(num_stages, bool) or not isinstance(num_stages, (int, np.integer)):
        raise TypeError(f"num_stages must be an int >= 1 or None, got {type(num_stages).__name__}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1 or None, got {num_stages}")


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """How a ``StreamingRuntime`` moves and keeps its arrays: fixed at construction, checked once here.
    ``RuntimeConfig()`` is the default of every setting; give the fields by keyword:
    ``StreamingRuntime(stage_fn, stage_params, RuntimeConfig(prefetch_depth=2, remat=False))``.

    Attributes:
      num_stages: L >= 1, or ``None`` (default): the runtime fills it from its ``stage_params``.
      prefetch_depth: k >= 1: how many stages ahead weights are transferred. While stage i computes,
        stages i+1..i+k are being copied in; at most k+1 stages' weights are held on the device.
        k >= L holds every stage. Default 1.
      resident: per stage, ``True`` keeps that stage's weights (and optimizer state) in device memory
        for good: it is never transferred (partial residency). Default ``None``: no stage resident.
      remat: what ``train_step`` keeps from each stage's forward for its backward. ``True``
        (default): only the stage input; the backward recomputes the stage's forward. ``False``:
        every residual of ``jax.vjp(stage_fn)`` except the stage's weights and input. A
        ``jax.checkpoint_policies`` policy: the residuals that ``jax.checkpoint(stage_fn,
        policy=remat)`` saves. The saved residuals stay in device memory (``residual_nbytes``).
      offload_activations: in ``train_step``, send each stage's kept input (and, with ``remat``
        other than ``True``, its saved residuals) to ``pinned_host`` once the stage has been
        dispatched, and bring it back ``prefetch_depth`` stages ahead in the backward, next to the
        weights (the last k+1 stages keep theirs on the device). Device memory for kept activations
        drops from L stages to about 2k+1. Default ``False``.
      grads_to_host: ``True`` (default) sends each stage's parameter gradients to ``pinned_host``
        as soon as its backward produced them; ``False`` returns them in device memory. Unused
        with an optimizer.
      optimizer_state_on_host: where the moments live between steps: ``pinned_host`` (default,
        streamed with the weights) or device memory.
      donate: donate buffers the runtime owns to the backward executables: a stage's streamed
        device weights and the output cotangent (when it has the stage input's shape and dtype).
        The user's arrays are never donated; a traced call does not donate. Default ``True``.
      throttle: bound device memory for real: after dispatching stage i's computation, the host
        waits until stage i-1's computation (forward) or the copy of stage i+1's gradients to host
        (backward) is complete before issuing the next weight transfer. ``False`` lets the host run
        ahead. Default ``True``.
      track_residency: after each stage, count the stages whose runtime-created device buffers are
        alive (``max_resident_stages``); a scan of all live arrays per stage: turn off for timing.
      prefetch_next_call: treat the schedule as cyclic across calls (default ``True``): a call
        leaves the first ``min(k, L)`` stages' weights (k+1 after a ``train_step``) in device memory
        for the next call, which starts computing at once (``prefetched_stages``,
        ``release_prefetched()``). A carried stage is used only while ``host_params[i]`` is the
        same object it was copied from.
      max_signatures: int >= 1: how many input signatures (structure, shapes, dtypes of ``h``)
        keep their compiled executables; the least recently used is dropped beyond it. Default 8.
      max_grad_norm: with an optimizer: ``None`` (default) or a finite float > 0, the gradient clip
        of every update (``train_step``'s keyword of this name does it for one step).
      skip_nonfinite: with an optimizer: every update whose gradient norm is not finite is
        skipped (``train_step``'s keyword for one step). Default ``False``.

    Raises (at construction): TypeError: ``num_stages`` or ``prefetch_depth`` not an int, a flag not
      a bool, ``remat`` neither a bool nor a policy, a positional argument; ValueError:
      ``num_stages < 1``, ``prefetch_depth < 1``, ``resident`` not a sequence of bools (of
      ``num_stages`` when given), ``max_signatures`` not an int >= 1, ``max_grad_norm`` not a finite
      number > 0.
    """

    num_stages: int | None = None
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
        _check_num_stages(self.num_stages)
        if self.num_stages is not None:
            set_("num_stages", int(self.num_stages))
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

    def for_stages(self, num_stages: int) -> "RuntimeConfig":
        """This config with ``num_stages`` filled in (``resident`` then checked against it).

        Raises: ValueError: ``num_stages`` was given and differs (the message names both); ``resident``
          has another length.
        """
        if self.num_stages is None:
            return self.replace(num_stages=num_stages)
        if self.num_stages != num_stages:
            raise ValueError(f"config.num_stages={self.num_stages} but stage_params has {num_stages} stages")
        return self


#: The ``RuntimeConfig`` fields an ``OffloadPolicy`` decides (:func:`config_from_policy`).
POLICY_FIELDS = ("prefetch_depth", "resident", "grads_to_host", "optimizer_state_on_host", "remat")


def config_from_policy(policy: OffloadPolicy, num_stages: int | None, config: RuntimeConfig | None = None
                       ) -> RuntimeConfig:
    """``config`` (default ``RuntimeConfig()``) with the fields ``policy`` decides: ``params="host"``
    streams every stage, ``"device"`` keeps every stage resident (needs ``num_stages``); ``grads`` ->
    ``grads_to_host``; ``optimizer_state`` -> ``optimizer_state_on_host``; ``prefetch_depth``;
    ``remat`` and ``activations`` -> ``remat`` (:func:`remat_from_policy`).

    Raises: TypeError: ``policy`` not an ``OffloadPolicy``, ``config`` not a ``RuntimeConfig``; ValueError:
      ``config`` sets a field the policy decides (other than its default); :func:`remat_from_policy`'s errors.
    """
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"policy must be an xla_swap.planning.OffloadPolicy, got {type(policy).__name__}")
    config = checked_config(config)
    default = RuntimeConfig()
    clash = [f for f in POLICY_FIELDS if getattr(config, f) != getattr(default, f)]
    if clash:
        raise ValueError(f"{', '.join(clash)}: decided by the policy; change the policy instead")
    resident = None if num_stages is None or policy.params == "host" else [True] * num_stages
    return config.replace(prefetch_depth=policy.prefetch_depth, resident=resident, grads_to_host=policy.grads == "host",
                          optimizer_state_on_host=policy.optimizer_state == "host", remat=remat_from_policy(policy))


def given_or_default(value, cls: type, what: str):
    """``value``, or ``cls()`` for ``None`` (``cls``: a frozen config of ``xla_swap.executors``); TypeError
    naming ``what`` otherwise."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{what} must be an xla_swap.executors.{cls.__name__} or None, got {type(value).__name__}")
    return value


def checked_config(config) -> RuntimeConfig:
    """``config``, or ``RuntimeConfig()`` for ``None``; TypeError naming ``config`` otherwise."""
    return given_or_default(config, RuntimeConfig, "config")
