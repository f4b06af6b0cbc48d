"""The checks of the torch entry point, each made once at the public boundary before anything is built or
dispatched: every error names the argument, the value and what was expected.

* ``SwappedStack``'s constructor arguments (:func:`check_options`, :func:`checked_layers`, ...), and
  :func:`meta_tensor`, which finds a tensor without values.
* Index inputs checked as torch checks them: token ids into an embedding, class indices into a loss.

On the device an out-of-range index does not fail: XLA's gather clamps it or fills NaN, so an id
past the vocabulary gives NaN logits (and a NaN update of every weight) and a label past the
classes trains toward a clamped one. Torch's CPU kernels raise ``IndexError`` instead
(``nn.Embedding``: "index out of range in self"; ``cross_entropy`` / ``nll_loss``: "Target 700 is
out of bounds"). ``SwappedStack`` and ``generate`` call these checks on the torch tensors before
anything is dispatched, so a bad value raises ``IndexError`` with the state untouched:

* **Token ids** (:func:`token_id_bounds`): the inputs of ``first`` that index an embedding, when
  ``first`` says which (``index_input_bounds()``, as :class:`xla_swap.hf.causal_lm.CausalLMFirst` does for
  ``input_ids``) or is an ``nn.Embedding`` itself; other ``first`` modules are not checked.
* **Class indices** (:func:`class_target_bounds`): integer targets shaped like an output of 2 or
  more dimensions without its last one (or that shape flattened) are the class indices of a
  ``cross_entropy``-style loss: each must lie in ``[0, C)``, ``C`` the output's last dimension, or
  equal the loss's ignore index (:func:`loss_ignore_index`: ``-100``, ``cross_entropy``'s default,
  unless the loss names another; ``loss_fn.ignore_index = None`` turns the check off). Float
  targets and integer targets of other shapes are not checked.

Cost (:func:`check_index_range`): one ``torch.aminmax`` over the tensor and one read of its two
values, which also serves the int32 check of an int64 tensor (``xla_swap.stack.torch_bridge``: int64
ids cost one read in all). For a CPU tensor that is a host pass before dispatch; for a CUDA
tensor the reduction runs on the tensor's device in torch's current stream and the read waits for
that stream only (the work that produced the tensor), never for the work the stack queued on jax's.

The module imports torch and jax.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import torch

from xla_swap.distributed import per_rank_batches
from xla_swap.planning.optimizer import AdamW
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.planning.units import check_budget_bytes
from xla_swap.stack.config import AutotuneConfig, CompileConfig, ParallelConfig, TrainingConfig

__all__ = ["checked_layers", "check_moved_keywords", "MOVED_KEYWORDS", "check_options", "optimizer_config",
           "checked_devices", "stages_in_order", "check_weights_source", "meta_tensor", "check_index_range",
           "token_id_bounds", "class_target_bounds", "loss_ignore_index", "IGNORE_INDEX"]


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


def meta_tensor(modules, names) -> str | None:
    """The name (``stage.tensor``) of the first parameter or buffer of ``modules`` on the meta device, or ``None``."""
    for stage, m in zip(names, modules):
        for n, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.is_meta:
                return f"{stage}.{n}"
    return None


#: the ignore index of ``torch.nn.functional.cross_entropy`` / ``nll_loss`` by default.
IGNORE_INDEX = -100


def check_index_range(t: torch.Tensor, name: str, size: int, ignore_index: int | None = None,
                      what: str = "") -> tuple[int, int] | None:
    """Check that the integer tensor ``t`` holds indices into ``size`` entries, as torch's kernels do.

    Every value must lie in ``[0, size)`` or equal ``ignore_index`` (``None``: none is ignored).

    Args:
      t: an integer torch tensor of any shape, on the CPU or a CUDA device (module docstring: cost).
      name: how the message names ``t`` (``"input_ids"``, ``"targets[0]"``).
      size: the number of entries indexed (int >= 0).
      ignore_index: a value let through although outside the range, or ``None``.
      what: what the range is, for the message (``"the rows of the input embedding"``).

    Returns: ``(min, max)`` of the values, those equal to ``ignore_index`` counted as 0; ``None``
      for an empty tensor or one of a floating, complex or bool dtype (not indices: not checked here).

    Raises: IndexError naming ``name``, the offending value (the smallest if any is negative, else
      the largest), the range and the ignore index.
    """
    if t.numel() == 0 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        return None
    v = t.detach()
    if ignore_index is not None:
        v = torch.where(v == ignore_index, torch.zeros((), dtype=v.dtype, device=v.device), v)
    lo, hi = torch.stack(torch.aminmax(v)).tolist()   # one read
    if lo < 0 or hi >= size:
        bad = lo if lo < 0 else hi
        ignored = "" if ignore_index is None else f" and is not the ignore index {ignore_index}"
        raise IndexError(f"{name} holds {bad}, outside [0, {size}){' (' + what + ')' if what else ''}{ignored}")
    return lo, hi


def token_id_bounds(first: torch.nn.Module | None) -> dict[int, tuple]:
    """``{input position: (name, embedding rows, None, what)}`` (the arguments of :func:`check_index_range`
    after the tensor): the inputs of ``first`` that are token ids.

    From ``first.index_input_bounds()`` (``{position: (name, rows)}``) when ``first`` defines it
    (:class:`xla_swap.hf.causal_lm.CausalLMFirst`: ``input_ids`` and its input embedding's rows); for an
    ``nn.Embedding`` itself, its first input and ``num_embeddings``; else ``{}``: nothing is checked
    (which input of a module of one's own feeds which embedding is not known without running it).
    """
    if first is None:
        return {}
    bounds = getattr(first, "index_input_bounds", None)
    if callable(bounds):
        found = dict(bounds())
    elif isinstance(first, torch.nn.Embedding):
        found = {0: ("inputs[0]", int(first.num_embeddings))}
    else:
        return {}
    what = "the rows of the input embedding"
    return {i: (name, int(rows), None, what) for i, (name, rows) in found.items()}


def loss_ignore_index(loss_fn: Callable) -> int | None:
    """The ignore index of ``loss_fn``'s class targets: its ``ignore_index`` attribute (a
    ``torch.nn.CrossEntropyLoss`` / ``NLLLoss`` module, or one set on a function), a
    ``functools.partial``'s ``ignore_index`` keyword, else ``IGNORE_INDEX`` (``-100``, the default
    of ``cross_entropy``). An attribute set to ``None`` means the loss's integer targets are not
    class indices: nothing is checked (``None`` is returned and :func:`class_target_bounds` gives ``{}``)."""
    if isinstance(loss_fn, functools.partial) and "ignore_index" in (loss_fn.keywords or {}):
        return loss_fn.keywords["ignore_index"]
    if hasattr(loss_fn, "ignore_index"):
        return loss_fn.ignore_index
    return IGNORE_INDEX


def class_target_bounds(targets, out_shape: tuple | None, loss_fn: Callable) -> dict:
    """``{target position: (name, C, ignore index, what)}`` for the targets that are class indices.

    ``targets``: a torch tensor (named ``targets``) or a tuple / list of them (``targets[i]``). A
    target is one when it is an integer torch tensor shaped like the output without its last
    dimension, or that shape flattened (``out_shape[:-1]``, or ``(prod(out_shape[:-1]),)``), as
    ``cross_entropy(logits.flatten(0, -2), labels.flatten())`` takes it; ``C = out_shape[-1]``. None
    are when ``out_shape`` is ``None`` or has fewer than 2 dimensions (no batch of class scores: a
    0-d integer target beside a 1-d output is more often a count than a class), or
    ``loss_ignore_index(loss_fn)`` is ``None``.
    """
    ignore = loss_ignore_index(loss_fn)
    if out_shape is None or len(out_shape) < 2 or ignore is None or isinstance(ignore, bool) or \
            not isinstance(ignore, int):
        return {}
    single = isinstance(targets, torch.Tensor)
    targets = (targets,) if single else tuple(targets)
    lead = tuple(out_shape[:-1])
    shapes = {lead, (math.prod(lead),)}
    what = f"the {out_shape[-1]} classes of the output's last dimension"
    return {i: ("targets" if single else f"targets[{i}]", int(out_shape[-1]), ignore, what)
            for i, t in enumerate(targets) if isinstance(t, torch.Tensor) and not t.is_floating_point()
            and not t.is_complex() and t.dtype != torch.bool and tuple(t.shape) in shapes}
