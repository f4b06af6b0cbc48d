"""The checks of ``SwappedStack``'s constructor arguments, each made once at the public boundary, before
anything is built: every error names the argument, the value and what was expected.

The module imports torch and jax.
"""
from __future__ import annotations

from typing import Sequence

import jax
import torch

from xla_swap.distributed import per_rank_batches
from xla_swap.planning.optimizer import AdamW
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.planning.units import check_budget_bytes
from xla_swap.stack.config import AutotuneConfig, CompileConfig, ParallelConfig, TrainingConfig
from xla_swap.stack.stages import meta_tensor

__all__ = ["checked_layers", "check_moved_keywords", "MOVED_KEYWORDS", "check_options", "optimizer_config",
           "checked_devices", "stages_in_order", "check_weights_source"]


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


#: the constructor keywords that moved into a settings group: where each one goes now.
MOVED_KEYWORDS = {
    **{k: f"parallel=xla_swap.ParallelConfig({k}=...)" for k in ("devices", "shard", "data_parallel")},
    **{k: f"training=xla_swap.TrainingConfig({k}=...)" for k in ("max_grad_norm", "skip_nonfinite",
                                                                  "accumulate_grads", "offload_activations")},
    "calibration": "autotune=xla_swap.AutotuneConfig(calibration=...)",
    **{k: f"compilation=xla_swap.CompileConfig({k}=...)" for k in ("transpose_linear", "fused_attention",
                                                                   "max_signatures")},
    "prefetch_depth": "policy=xla_swap.planning.OffloadPolicy(prefetch_depth=...)",
    "param_dtype": "mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=...)",
}


def check_moved_keywords(kwargs: dict) -> None:
    """Refuse keywords ``SwappedStack`` does not take. Raises TypeError naming each one and, for one that
    moved into a settings group (:data:`MOVED_KEYWORDS`), where it goes now."""
    if kwargs:
        said = [f"{k}= (now {MOVED_KEYWORDS[k]})" if k in MOVED_KEYWORDS else f"{k}= (unknown)" for k in kwargs]
        raise TypeError("SwappedStack got unexpected keyword arguments: " + "; ".join(said))


def check_options(*, policy, budget_bytes, loss_fn, optimizer, autotune, parallel, training,
                  compilation) -> int | None:
    """The options of ``SwappedStack`` beyond the stages checked, each group's own fields already checked by the
    group (:mod:`xla_swap.stack.config`); what joins two settings is checked here. Returns ``budget_bytes`` as an
    int (or ``None``). Raises TypeError / ValueError naming the argument."""
    if policy is not None and not isinstance(policy, OffloadPolicy):
        raise TypeError(f"policy must be an xla_swap.planning.OffloadPolicy, got {type(policy).__name__}")
    for name, value, kind in (("autotune", autotune, AutotuneConfig), ("parallel", parallel, ParallelConfig),
                              ("training", training, TrainingConfig), ("compilation", compilation, CompileConfig)):
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be an xla_swap.{kind.__name__}, got {type(value).__name__}")
    budget_bytes = check_budget_bytes(budget_bytes, optional=True)
    if policy is not None and budget_bytes is not None and policy.params != "host":
        raise ValueError(f"give either policy or budget_bytes, not both, unless the policy streams (params='host'; "
                         f"got params={policy.params!r}): budget_bytes chooses the stages kept resident")
    if budget_bytes is not None and autotune.enabled and per_rank_batches():
        raise ValueError("autotune with per-rank batches: each process would measure and choose its own schedule; "
                         "give policy= or budget_bytes= with autotune=AutotuneConfig(enabled=False)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if optimizer is None and training.needs_norm:
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
    """``ParallelConfig.devices`` (its type checked there) as a list, ``None`` read as ``jax.devices()``; raises
    ValueError naming it with per-rank batches when the devices do not span every process."""
    devices = list(jax.devices()) if devices is None else list(devices)
    processes = {d.process_index for d in devices}
    if per_rank_batches() and processes != set(range(jax.process_count())):
        raise ValueError("with per-rank batches (xla_swap.distributed.initialize) devices must span every process "
                         f"(default jax.devices()), got devices of processes {sorted(processes)}")
    return devices


def stages_in_order(first, layers: list, last) -> tuple[list, list[str]]:
    """``(modules, names)`` of the stages in order: ``first`` and ``last`` where given, ``layers[i]`` between."""
    named = ([("first", first)] if first is not None else []) + [(f"layers[{i}]", m) for i, m in enumerate(layers)]
    named += [("last", last)] if last is not None else []
    return [m for _, m in named], [n for n, _ in named]


def check_weights_source(weights, modules: list, names: list[str], compute_dtype) -> None:
    """``weights`` (``None`` or a callable) against the modules: a meta tensor needs ``weights``;
    ``mp_policy.param_dtype`` needs float32 parameters. Raises TypeError / ValueError naming the tensor."""
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
                    raise ValueError(f"mp_policy.param_dtype keeps float32 master weights: {name}.{pn} is {p.dtype}; "
                                     "build the model in float32 (model.float())")
