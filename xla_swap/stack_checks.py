"""The checks of ``SwappedStack``'s constructor arguments, each made once at the public boundary, before
anything is built: every error names the argument, the value and what was expected.

The module imports torch and jax.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
import torch

from xla_swap.budget import check_calibration_arg
from xla_swap.distributed import per_rank_batches
from xla_swap.planning.optimizer import AdamW
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.planning.units import check_budget_bytes
from xla_swap.stages import meta_tensor

__all__ = ["checked_layers", "check_options", "optimizer_config", "checked_devices", "with_prefetch_depth",
           "stages_in_order", "check_weights_source"]


def checked_layers(layers, first, last) -> list[torch.nn.Module]:
    """``layers`` as a list, checked with ``first`` and ``last``; raises TypeError / ValueError naming the argument."""
    if isinstance(layers, torch.nn.Module) and not isinstance(layers, (torch.nn.ModuleList, torch.nn.Sequential)):
        raise TypeError("layers must be a sequence of nn.Modules (e.g. model.model.layers), got one module")
    layers = list(layers) if isinstance(layers, (Sequence, torch.nn.ModuleList, torch.nn.Sequential)) else None
    if not layers:
        raise ValueError("layers must be a non-empty sequence of torch.nn.Module")
    for i, m in enumerate(layers):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"layers[{i}] must be a torch.nn.Module, got {type(m).__name__}")
    for name, m in (("first", first), ("last", last)):
        if m is not None and not isinstance(m, torch.nn.Module):
            raise TypeError(f"{name} must be a torch.nn.Module or None, got {type(m).__name__}")
    return layers


def check_options(*, policy, budget_bytes, data_parallel, accumulate_grads, transpose_linear, autotune,
                   fused_attention, calibration, loss_fn, skip_nonfinite, max_grad_norm, optimizer) -> int | None:
    """The scalar options of ``SwappedStack`` checked; returns ``budget_bytes`` as an int (or ``None``).
    Raises TypeError / ValueError naming the argument."""
    if policy is not None and budget_bytes is not None:
        raise ValueError("give either policy or budget_bytes, not both")
    if policy is not None and not isinstance(policy, OffloadPolicy):
        raise TypeError(f"policy must be an xla_swap.planning.OffloadPolicy, got {type(policy).__name__}")
    budget_bytes = check_budget_bytes(budget_bytes, optional=True)
    if data_parallel is not None and not isinstance(data_parallel, bool):
        raise TypeError(f"data_parallel must be a bool or None, got {type(data_parallel).__name__}")
    for name, value in (("accumulate_grads", accumulate_grads), ("transpose_linear", transpose_linear),
                        ("autotune", autotune)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if not isinstance(fused_attention, bool):
        raise TypeError(f"fused_attention must be a bool, got {fused_attention!r}")
    check_calibration_arg(calibration)
    if budget_bytes is not None and autotune and per_rank_batches():
        raise ValueError("autotune with per-rank batches: each process would measure and choose its own schedule; "
                         "give policy= or budget_bytes= with autotune=False")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(skip_nonfinite, bool):
        raise TypeError(f"skip_nonfinite must be a bool, got {type(skip_nonfinite).__name__}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                      or not np.isfinite(max_grad_norm) or max_grad_norm <= 0):
        raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}")
    if optimizer is None and (max_grad_norm is not None or skip_nonfinite):
        raise ValueError("max_grad_norm and skip_nonfinite need an optimizer; without one train_step fills .grad "
                         "(clip it with torch.nn.utils.clip_grad_norm_)")
    return budget_bytes


def optimizer_config(optimizer) -> tuple:
    """``(torch optimizer or None, AdamW / list of AdamW per param group / None)`` of the ``optimizer``
    argument. Raises TypeError naming it; the errors of ``AdamW.groups_from_torch``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, AdamW.groups_from_torch(optimizer)
    if optimizer is not None and not isinstance(optimizer, AdamW):
        raise TypeError("optimizer must be None, an xla_swap.planning.AdamW or a torch.optim.AdamW, "
                        f"got {type(optimizer).__name__}")
    return None, optimizer


def checked_devices(devices) -> list:
    """``devices`` (default ``jax.devices()``) checked; raises TypeError naming the argument."""
    devices = list(jax.devices()) if devices is None else devices
    if isinstance(devices, jax.Device) or not isinstance(devices, Sequence) or not devices or \
            not all(isinstance(d, jax.Device) for d in devices):
        raise TypeError(f"devices must be a non-empty sequence of jax.Device, got {devices!r}")
    processes = {d.process_index for d in devices}
    if per_rank_batches() and processes != set(range(jax.process_count())):
        raise ValueError("with per-rank batches (xla_swap.distributed.initialize) devices must span every process "
                         f"(default jax.devices()), got devices of processes {sorted(processes)}")
    return devices


def with_prefetch_depth(policy: OffloadPolicy, prefetch_depth: int | None) -> OffloadPolicy:
    """``policy`` with ``prefetch_depth`` when given (``None``: ``policy`` itself)."""
    if prefetch_depth is None:
        return policy
    return OffloadPolicy(params=policy.params, grads=policy.grads, activations=policy.activations,
                         remat=policy.remat, prefetch_depth=prefetch_depth, optimizer_state=policy.optimizer_state)


def stages_in_order(first, layers: list, last) -> tuple[list, list[str]]:
    """``(modules, names)`` of the stages in order: ``first`` and ``last`` where given, ``layers[i]`` between."""
    named = ([("first", first)] if first is not None else []) + [(f"layers[{i}]", m) for i, m in enumerate(layers)]
    named += [("last", last)] if last is not None else []
    return [m for _, m in named], [n for n, _ in named]


def check_weights_source(weights, modules: list, names: list[str], compute_dtype) -> None:
    """``weights`` (``None`` or a callable) against the modules: a meta tensor needs ``weights``;
    ``param_dtype`` needs float32 parameters. Raises TypeError / ValueError naming the tensor."""
    if weights is not None and not callable(weights):
        raise TypeError(f"weights must be None or a callable (module, names) -> {{name: torch.Tensor}}, "
                        f"got {type(weights).__name__}")
    on_meta = meta_tensor(modules, names)
    if on_meta is not None and weights is None:
        raise ValueError(f"{on_meta} is on the meta device (no values): give weights= (a source of the stages' "
                         "tensors) or build the stack with xla_swap.load_stack(model, checkpoint)")
    if compute_dtype is not None and weights is None:
        for name, m in zip(names, modules):
            for pn, p in m.named_parameters():
                if p.is_floating_point() and p.dtype != torch.float32:
                    raise ValueError(f"param_dtype keeps float32 master weights: {name}.{pn} is {p.dtype}; "
                                     "build the model in float32 (model.float())")
