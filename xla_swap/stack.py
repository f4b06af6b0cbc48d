"""The torch entry point: train and serve a stack of ``nn.Module`` layers larger than device
memory, with weights, gradients and AdamW state in host memory.

    stack = SwappedStack(model.model.layers, first=embed, last=head,
                         optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4))
    loss = stack.train_step(input_ids, labels, loss_fn=torch.nn.functional.cross_entropy)
    logits = stack(input_ids)          # serving: torch tensors in and out
    stack.sync_modules()               # the trained weights back into the nn.Modules
    stack.save_checkpoint("ckpt/")     # weights, AdamW moments, step (torch.distributed.checkpoint)

Design (``docs/explanation/design.md``):

* **Bridge.** Each stage (``first``, every layer, ``last``) is turned into a JAX function by
  torchax (:mod:`xla_swap.torch_bridge`, :mod:`xla_swap.stages`); layers that compute the same
  thing share one function (one forward and one backward executable). Weights go to host memory directly.
* **Runtime.** :class:`xla_swap.executors.StreamingRuntime`: each stage's weights live in their own
  ``pinned_host`` buffers, streamed ``prefetch_depth`` stages ahead in the forward and the backward.
* **Optimizer.** With an optimizer (an :class:`xla_swap.planning.AdamW`, or a
  ``torch.optim.AdamW`` whose param groups are read at every step: schedulers and per-group
  weight decay work), each stage is updated on the device right after its backward: its moments
  come from ``pinned_host`` with its weights, and the new weights and moments go back. Gradients
  never leave the device; AdamW state never lives on it beyond the prefetch window. The update
  is ``torch.optim.AdamW``'s (:mod:`xla_swap.training`). Without an optimizer, ``train_step``
  writes the gradients into the modules' ``.grad``.
* **Carry.** ``first(*inputs)`` returns the hidden state ``h``, or ``(h, layer_kwargs)``
  where ``layer_kwargs`` is a dict of tensors every layer gets as keyword arguments
  (attention mask, rotary ``position_embeddings``); each layer is called
  ``layer(h, **layer_kwargs)`` (a tuple result's first element is the new ``h``); ``last(h)``
  gives the output. Integer tensors (token ids) are constants: they get no gradient.
  Layers that get different keyword values (a sliding-window and a full mask) are told apart
  by ``first.layer_keys`` (one hashable key per layer) and ``first.select_layer_kwargs(key,
  layer_kwargs) -> kwargs``: layer ``i`` is then called with ``select_layer_kwargs(layer_keys[i],
  layer_kwargs)``; only layers of one key share a function (``xla_swap.hf.CausalLMFirst``).
* **Release.** A stack holds its stage functions, its ``StreamingRuntime`` (executables,
  weights, optimizer state) and at most 8 converted loss functions; dropping it frees them (by
  reference counting). The modules are the caller's. What outlives it is listed in
  :mod:`xla_swap.executors.streaming` (jax's own bounded caches; ``benchmarks/leak_cycles.py``).

Beside it: :mod:`xla_swap.sharding`, :mod:`xla_swap.mixed_precision`, :mod:`xla_swap.budget`,
:mod:`xla_swap.checkpoint` (docs/explanation/design.md lists them). Imports torch, torchax, jax; not torch_xla.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from xla_swap.budget import AutotuneMixin, check_calibration_arg, resident_for_budget
from xla_swap.distributed import per_rank_batches
from xla_swap.checkpoint import CheckpointMixin, model_parameter_names
from xla_swap.executors.streaming import StreamingRuntime, remat_from_policy
from xla_swap.hf import causal_lm_stages  # noqa: F401  (re-exported: the entry point's splitter)
from xla_swap.hf_refusals import describe_failure
from xla_swap.index_checks import token_id_bounds
from xla_swap.mixed_precision import cast_floats, check_mixed_precision, stage_functions_in
from xla_swap.planning.optimizer import AdamW
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.planning.units import check_budget_bytes
from xla_swap.sharding import StageSharding, check_shard
from xla_swap.stages import host_stages, linear_weights, meta_tensor, stage_functions, tied_parameters
from xla_swap.torch_attention import torchax_env, warn_eager_attention
from xla_swap.torch_bridge import inputs_to_jax, output_to_torch, rank_rows_to_torch, to_torch, torch_matmul_precision
from xla_swap.training import TrainingMixin

__all__ = ["SwappedStack", "causal_lm_stages", "DEFAULT_POLICY", "torch_matmul_precision"]

log = logging.getLogger(__name__)

#: The policy used when none is given: weights, gradients and optimizer state in host
#: memory, each stage recomputed in the backward, two stages prefetched.
DEFAULT_POLICY = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=True, prefetch_depth=2)


def _checked_layers(layers, first, last) -> list[torch.nn.Module]:
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


def _check_options(*, policy, budget_bytes, data_parallel, accumulate_grads, transpose_linear, autotune,
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


def _optimizer_config(optimizer) -> tuple:
    """``(torch optimizer or None, AdamW / list of AdamW per param group / None)`` of the ``optimizer``
    argument. Raises TypeError naming it; the errors of ``AdamW.groups_from_torch``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer, AdamW.groups_from_torch(optimizer)
    if optimizer is not None and not isinstance(optimizer, AdamW):
        raise TypeError("optimizer must be None, an xla_swap.planning.AdamW or a torch.optim.AdamW, "
                        f"got {type(optimizer).__name__}")
    return None, optimizer


def _checked_devices(devices) -> list:
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


def _with_prefetch_depth(policy: OffloadPolicy, prefetch_depth: int | None) -> OffloadPolicy:
    """``policy`` with ``prefetch_depth`` when given (``None``: ``policy`` itself)."""
    if prefetch_depth is None:
        return policy
    return OffloadPolicy(params=policy.params, grads=policy.grads, activations=policy.activations,
                         remat=policy.remat, prefetch_depth=prefetch_depth, optimizer_state=policy.optimizer_state)


def _stages_in_order(first, layers: list, last) -> tuple[list, list[str]]:
    """``(modules, names)`` of the stages in order: ``first`` and ``last`` where given, ``layers[i]`` between."""
    named = ([("first", first)] if first is not None else []) + [(f"layers[{i}]", m) for i, m in enumerate(layers)]
    named += [("last", last)] if last is not None else []
    return [m for _, m in named], [n for n, _ in named]


def _check_weights_source(weights, modules: list, names: list[str], compute_dtype) -> None:
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


def _build_runtime(fns: list, stage_params: list, updated: list, policy: OffloadPolicy, budget_bytes: int | None,
                   autotune: bool, common: dict) -> StreamingRuntime:
    """The ``StreamingRuntime`` of the stages: ``policy``'s, or with ``budget_bytes`` the residency
    :func:`xla_swap.budget.resident_for_budget` gives (every stage streamed until the first call
    chooses, with ``autotune``). Raises ValueError for a budget below the streaming window."""
    if budget_bytes is None:
        return StreamingRuntime.from_policy(fns, stage_params, policy, **common)
    optimizer = common["optimizer"]
    k = policy.prefetch_depth
    resident = resident_for_budget(stage_params, updated, optimizer[0] if isinstance(optimizer, list) else optimizer,
                                   budget_bytes, k)   # raises below the streaming window, before anything is built
    if autotune:   # stream everything until the first call chooses (the least device memory)
        resident = [False] * len(stage_params)
    return StreamingRuntime(fns, stage_params, prefetch_depth=k, resident=resident,
                            grads_to_host=policy.grads == "host",
                            optimizer_state_on_host=policy.optimizer_state == "host",
                            remat=remat_from_policy(policy), **common)


class SwappedStack(TrainingMixin, AutotuneMixin, CheckpointMixin):
    """A stack of torch layers whose weights, gradients and optimizer state live in host memory.

    Args:
      layers: a non-empty sequence of ``torch.nn.Module`` (e.g. ``model.model.layers`` of a
        Hugging Face decoder, unmodified). Called ``layer(h, **layer_kwargs)``.
      first: optional module run before the layers on the user's inputs, e.g. the embedding:
        ``first(*inputs) -> h`` or ``(h, layer_kwargs)`` (see the module docstring). Without
        it, the first input is ``h``.
      last: optional module run after the layers, e.g. final norm and LM head: ``last(h) -> out``.
      policy: an :class:`xla_swap.planning.OffloadPolicy` (default ``DEFAULT_POLICY``):
        ``params`` host/device, ``grads``, ``optimizer_state``, ``remat``, ``prefetch_depth``.
        Not together with ``budget_bytes``.
      budget_bytes: instead of ``policy``: device memory (bytes) for the stack. With
        ``autotune=True`` (the default) it bounds everything the stack holds on the device
        (weights, optimizer state, activations, temporaries): the first ``forward`` or
        ``train_step`` measures the link and each layer on the device (a few calls: seconds)
        and switches to the schedule predicted fastest for the budget and that call's input
        shape (:meth:`autotune`; ``schedule`` then holds the choice), for a training step when
        there is an ``optimizer``, else for that call's mode. Until then every stage streams.
        With several devices the bytes are counted unsharded (the planner's logical bytes). With ``autotune=False`` it bounds weights and optimizer state only: stages
        are kept resident from the last one backwards while they fit beside the streaming
        window of ``prefetch_depth + 1`` stages (the last stages are the first the backward
        needs), at construction, and the rest are streamed.
      autotune: with ``budget_bytes``, choose the schedule from a measurement at the first
        call (default ``True``; see ``budget_bytes``). Without ``budget_bytes`` it does
        nothing (call :meth:`autotune` to choose for a budget).
      calibration: what :meth:`autotune` (the first call's choice included) chooses from instead of
        measuring: a callable ``(runtime, h) -> xla_swap.executors.calibrate.Calibration`` called
        with the stack's runtime and the call's input as the runtime sees it, e.g.
        ``functools.partial(xla_swap.executors.calibrate.calibration_from_figures, link=...,
        forward_s=..., backward_s=...)`` (figures measured elsewhere, or a test's: no clock read),
        or a ``Calibration`` of this stack's stages and input signature. Default ``None``: measure.
      fused_attention: on a GPU, run ``torch.nn.functional.scaled_dot_product_attention`` (what
        Hugging Face's ``sdpa`` attention calls) as cuDNN's fused attention
        (``xla_swap.torch_attention``; default ``True``). ``False``: XLA's unfused form, which
        materialises the ``[B, N, T, S]`` scores. Other platforms always run XLA's form.
      optimizer: ``None`` (``train_step`` fills ``.grad``), an ``xla_swap.planning.AdamW``, or
        a ``torch.optim.AdamW`` (or ``Adam``) over the stages' parameters: the lr, weight decay,
        betas and eps of each of its ``param_groups`` are read at every ``train_step`` and applied
        to that group's parameters as traced inputs of the per-layer update, so a
        ``torch.optim.lr_scheduler`` stepping it works unchanged (and never recompiles) and groups
        with other weight decay (none on norms and biases, as the Hugging Face Trainer builds
        them) are honoured. Its own state is not used: the moments live in
        ``runtime.optimizer_state`` and the step count in ``runtime.step``, so
        ``optimizer.state_dict()`` holds the groups but no moments: checkpoint with
        :meth:`save_checkpoint` / :meth:`state_dict`, which hold both. After each update its
        ``step()`` is called while none of its parameters has a ``.grad`` (a no-op on them that
        runs its step hooks and keeps a scheduler from warning that it stepped first).
        Parameters with ``requires_grad=False`` are not updated, as in torch.
      loss_fn: default ``loss_fn(output, *targets) -> scalar`` torch function for
        ``train_step`` (e.g. ``torch.nn.functional.cross_entropy``).
      devices: the ``jax`` devices to run on (default: ``jax.devices()``, all local devices).
      shard: with several devices: ``"fsdp"`` (default; each weight with >= 2 dimensions is
        split over all devices on its largest evenly divisible dimension, others replicated;
        each device keeps its shard in its own host memory), ``"replicate"``, or a callable
        ``(name, shape) -> tuple`` giving a ``PartitionSpec`` over the mesh axis ``"d"``.
      data_parallel: with several devices, split the activations' leading (batch or token)
        dimension over them (each device computes its part of the batch; XLA all-gathers
        each layer's weight shards on the device): FSDP / ZeRO-3 as torch users know it.
        Inputs whose leading dimension does not split evenly stay replicated. Default
        ``None``: on for ``shard="fsdp"``, off otherwise (tensor parallelism with a
        ``shard`` callable wants replicated activations).
      transpose_linear: hold every ``nn.Linear`` weight in host (and device) memory as
        ``[in, out]``, the transpose of torch's ``[out, in]`` (default ``True``). The stage hands
        the module the transpose, which XLA folds into the matmul: it then contracts like
        ``h @ w`` ("NN") instead of ``F.linear``'s "NT", which costs more compute per stage
        (docs/explanation/design.md, "``nn.Linear`` weights held ``[in, out]``"). Everything
        the user sees stays in torch's layout: ``shard`` callables get torch's shape and return
        torch's spec, ``state_dicts()``, ``sync_modules()`` and ``.grad`` are ``[out, in]``;
        only ``runtime.host_params`` and ``last_grads`` hold the names in ``transposed`` as
        ``[in, out]``.
      prefetch_depth: overrides ``policy.prefetch_depth`` when given.
      max_signatures: input shapes whose executables stay cached (serving several batch
        sizes and sequence lengths).
      offload_activations: in training, each layer's kept input goes to ``pinned_host`` during the
        forward and comes back ``prefetch_depth`` layers ahead in the backward (activation offload).
      accumulate_grads: without an optimizer, add each step's gradients to the modules'
        ``.grad`` (default; a host copy of every gradient per step). ``False`` leaves them in
        ``pinned_host`` as ``last_grads`` (one pytree of jax arrays per stage) instead.

      max_grad_norm: with an optimizer: clip the gradients at every update to this global 2-norm
        (over every trainable parameter of every stage, ``torch.nn.utils.clip_grad_norm_``'s
        semantics: scale by ``min(1, max_grad_norm / (norm + 1e-6))``). Default ``None``.
      skip_nonfinite: with an optimizer: skip an update whose gradient norm is inf or nan
        (weights, moments and step unchanged, the gradients dropped), as torch's ``GradScaler``
        skips ``optimizer.step()``. Default ``False``.
        With either, the update needs every stage's gradients first, so it is no longer fused
        into the backward: the backward sends each layer's gradients to ``pinned_host`` and an
        update pass streams weights, gradients and moments in and the new weights and moments
        out. Per update that moves, beyond the fused step, the gradients out and in (2 x the
        trainable weight bytes) and the weights in once more (less the ``prefetch_depth + 1``
        layers the backward leaves on the device), and waits once for the norm.
      weights: where the stages' values come from: ``None`` (default) the modules' own parameters
        and buffers, or a callable ``weights(module, names) -> {name: torch.Tensor}`` called once
        per stage, in order, with the stage's module and the names of its buffers and parameters
        (as ``named_buffers()`` / ``named_parameters()`` give them), returning CPU tensors of the
        modules' shapes in torch's layout, in the dtype the stage is to hold (the modules' own
        dtype is not used). The modules may then be on the meta device (``torch.device("meta")``):
        only their structure is used. :class:`xla_swap.loading.SafetensorsWeights` reads a
        Hugging Face safetensors checkpoint this way; :func:`xla_swap.load_stack` builds a stack
        from a causal LM and its checkpoint.
      param_dtype: ``torch.bfloat16`` for mixed precision as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``
        gives it on one device (default ``None``: compute in the dtypes held). The parameters stay in
        ``pinned_host`` in the model's float32 (the master weights; AdamW moments float32 too, unless
        the optimizer's ``state_dtype`` says otherwise); each stage casts its floating parameters (not
        its buffers) and its floating inputs to bf16 on the device, inside its executable, so forward
        and backward compute in bf16, the gradient w.r.t. the master is the bf16 gradient cast to
        float32 by the cast's transpose, and AdamW updates the float32 master. Outputs, the carry
        and ``.grad`` (without an optimizer: float32) are as computed. Cost: the weights cross the link
        as float32, twice the bytes of bf16 weights (``runtime.stage_nbytes`` counts them so, and the
        planner and :meth:`autotune` with it); the bf16 copy is a temporary of the stage's executable.
        ``float16`` is refused (it needs loss scaling, which the stack does not implement).
      mp_policy: instead of ``param_dtype``: a ``torch.distributed.fsdp.MixedPrecisionPolicy``. Its
        ``param_dtype`` and ``cast_forward_inputs`` are honoured; ``output_dtype`` must be ``None``;
        ``reduce_dtype`` ``None`` or ``param_dtype``, or ``torch.float32`` on one device (no reduction
        there: the cast of the bf16 gradient to the float32 master is exact).

    Host memory at construction: each stage is read (from the modules, or ``weights``), copied into
    its ``pinned_host`` buffers (with an optimizer, zero moments beside them) and released before
    the next, so beyond the stack's own buffers construction holds one stage's transient copies.
    The stack never aliases the modules' storage and needs it only for :meth:`sync_modules` and,
    without an optimizer, for the ``.grad`` it writes (``accumulate_grads``): with an optimizer
    the caller may release it once the stack is built, keeping the modules' structure, e.g.
    ``model.to("meta")`` (the parameter objects stay the same, so a torch optimizer's groups
    still match; ``sync_modules`` then refuses).

    Raises:
      TypeError: a layer / ``first`` / ``last`` is not an ``nn.Module``; ``policy``,
        ``optimizer``, ``loss_fn``, ``devices``, ``shard`` or ``calibration`` has the wrong type; a
        parameter or buffer is ``float64`` with ``jax_enable_x64`` off (it would run as ``float32``;
        the message names the stage and the tensor).
      ValueError: ``layers`` is empty; both ``policy`` and ``budget_bytes``; a ``budget_bytes`` that is
        not an int > 0 (a bool or a non-number: TypeError; the words of
        ``xla_swap.planning.units.check_budget_bytes``) or is below the streaming window of weights
        and optimizer state (``autotune=False`` and ``True`` alike);
        a parameter shared by two stages other than ``first`` and ``last`` (tied embeddings: held once
        by ``first``, carried to ``last``; ``tied``); a stage that fails to trace on
        ``first.example_inputs()`` (when ``first`` has it: the message names the stage's module); a torch
        optimizer with options AdamW here does not implement (``amsgrad``, ``maximize``,
        ``Adam``'s L2 ``weight_decay``; the message names the group), a stage parameter with
        ``requires_grad`` in none of its groups, or a group's parameter in no stage (the
        message names it); ``shard`` is unknown; ``max_grad_norm`` not a finite number > 0;
        ``max_grad_norm`` or ``skip_nonfinite`` without an optimizer. TypeError: a torch optimizer other than
        ``AdamW`` / ``Adam`` (e.g. SGD).
      ValueError: a parameter or buffer on the meta device without ``weights``; what ``weights`` gives lacks a name, has an
        unexpected one or a tensor of another shape (the message names the stage and tensor).
        TypeError: ``weights`` not callable, or it returns something other than a dict of tensors.
      ValueError: ``param_dtype`` other than ``torch.bfloat16`` (TypeError: not a ``torch.dtype``), both
        ``param_dtype`` and ``mp_policy``, an ``mp_policy`` field not honoured (named), a floating
        parameter (or what ``weights`` gives for one) that is not float32 with ``param_dtype``.
        TypeError: ``mp_policy`` not a ``MixedPrecisionPolicy``.
      ValueError: with per-rank batches (:mod:`xla_swap.distributed`), ``devices`` not spanning every process,
        or ``budget_bytes`` with ``autotune`` (each process would choose its own schedule).
      ImportError: torchax is not installed.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], *, first: torch.nn.Module | None = None,
                 last: torch.nn.Module | None = None, policy: OffloadPolicy | None = None,
                 budget_bytes: int | None = None, optimizer=None, loss_fn: Callable | None = None,
                 devices: Sequence[jax.Device] | None = None, shard: str | Callable = "fsdp",
                 prefetch_depth: int | None = None, max_signatures: int = 8, accumulate_grads: bool = True,
                 offload_activations: bool = False, data_parallel: bool | None = None,
                 transpose_linear: bool = True, autotune: bool = True, calibration=None,
                 fused_attention: bool = True, max_grad_norm: float | None = None,
                 skip_nonfinite: bool = False, weights: Callable | None = None,
                 param_dtype: torch.dtype | None = None, mp_policy=None):
        # ---- validation (no state changes) ----
        layers = _checked_layers(layers, first, last)
        budget_bytes = _check_options(policy=policy, budget_bytes=budget_bytes, data_parallel=data_parallel,
                                      accumulate_grads=accumulate_grads, transpose_linear=transpose_linear,
                                      autotune=autotune, fused_attention=fused_attention, calibration=calibration,
                                      loss_fn=loss_fn, skip_nonfinite=skip_nonfinite, max_grad_norm=max_grad_norm,
                                      optimizer=optimizer)
        torch_optimizer, optimizer = _optimizer_config(optimizer)
        check_shard(shard)
        devices = _checked_devices(devices)
        compute_dtype, cast_inputs = check_mixed_precision(param_dtype, mp_policy, len(devices))
        policy = _with_prefetch_depth(policy or DEFAULT_POLICY, prefetch_depth)
        modules, names = _stages_in_order(first, layers, last)
        owner, tied = tied_parameters(names, modules)
        _check_weights_source(weights, modules, names, compute_dtype)
        group_of = self._torch_groups(torch_optimizer, names, modules, owner) if torch_optimizer is not None else {}
        env = torchax_env(platform := devices[0].platform if fused_attention else "xla")  # "gpu": SDPA on cuDNN
        warn_eager_attention(modules, names, platform)

        # ---- stage functions: one per group of layers that compute the same thing ----
        self.modules: list[torch.nn.Module] = modules
        self.stage_names: list[str] = names
        #: ``{(stage, name): fqn}``: checkpoint names from ``first.parameter_names`` (a PEFT model's), else stage-based.
        self.checkpoint_names: dict = model_parameter_names(modules, first)
        self.has_first, self.has_last = first is not None, last is not None
        #: the torchax environment the stages are traced in (``xla_swap.torch_attention.torchax_env``).
        self.torch_env = env
        #: per stage, the names of the ``nn.Linear`` weights held as ``[in, out]`` on the host
        #: and the device (``transpose_linear``).
        self.transposed: list[frozenset[str]] = [linear_weights(m) if transpose_linear else frozenset() for m in modules]
        if tied:
            self.transposed[-1] = self.transposed[-1] - set(tied)
        #: ``{name in last: name in first}``: the weights ``first`` and ``last`` share (tied embeddings): held
        #: once, by the first stage (one gradient and optimizer state), carried to the last on the device.
        self.tied: dict[str, str] = dict(tied)
        fns, layer_groups = stage_functions(first, layers, last, env, self.transposed, tied)
        #: per layer, its group: layers of one group share one stage function (``stages.layer_groups``).
        self.layer_groups: tuple[int, ...] = tuple(layer_groups)

        # ---- weights: torch (or `weights`) -> pinned_host, one stage at a time (never through the device) ----
        placement = StageSharding(devices, shard, self.transposed)
        self.mesh = placement.mesh
        stage_params, trainable, updated, groups = host_stages(names, modules, self.transposed, tied, weights,
                                                               placement.host, compute_dtype, group_of)
        #: per stage, the names of the parameters the optimizer updates (``requires_grad``).
        self.trainable_names: list = trainable
        #: the dtype the stages compute in (``param_dtype``): each stage casts its floating parameters
        #: (and with ``cast_forward_inputs`` its floating inputs) to it; ``None``: as held.
        self.param_dtype: torch.dtype | None = compute_dtype
        if compute_dtype is not None:   # one wrapper per distinct stage function (shared layers stay shared)
            fns = stage_functions_in(fns, trainable, jnp.bfloat16, cast_inputs)
        #: with ``param_dtype``: whether the stages also cast their floating inputs (``cast_forward_inputs``).
        self.cast_inputs: bool = cast_inputs
        if data_parallel is None:
            data_parallel = shard == "fsdp"
        #: whether activations are split over the devices on their leading dimension.
        self.data_parallel: bool = bool(data_parallel and placement.mesh is not None)

        # ---- the runtime ----
        common = dict(optimizer=optimizer, trainable=lambda i, path: path[0].key in updated[i], own_params=True,
                      group_of=lambda i, path: groups[i][path[0].key],
                      track_residency=False, max_signatures=max_signatures,
                      offload_activations=offload_activations, **placement.runtime_kwargs(self.data_parallel))
        rt = _build_runtime(fns, stage_params, updated, policy, budget_bytes, autotune, common)
        self._set_state(rt, policy, torch_optimizer, loss_fn, accumulate_grads, max_grad_norm, skip_nonfinite,
                        budget_bytes if autotune else None, calibration)
        example = getattr(first, "example_inputs", None)
        if callable(example):  # refuse at construction what does not trace (e.g. an op torchax lacks)
            self._check_trace(example())

    def _set_state(self, rt: StreamingRuntime, policy: OffloadPolicy, torch_optimizer, loss_fn, accumulate_grads: bool,
                   max_grad_norm, skip_nonfinite: bool, autotune_budget: int | None, calibration) -> None:
        """The attributes of a stack running ``rt`` (the constructor's arguments, checked)."""
        #: the :class:`~xla_swap.executors.StreamingRuntime` that runs the stages.
        self.runtime: StreamingRuntime = rt
        #: the policy in force (``budget_bytes`` given: ``params`` reads "host", see ``runtime.resident``;
        #: ``remat`` and ``prefetch_depth`` follow ``autotune``'s choice).
        self.policy: OffloadPolicy = policy
        #: the optimizer's configuration (group 0's with a torch optimizer), or ``None``.
        self.optimizer: AdamW | None = rt.optimizer
        #: the torch optimizer given, whose ``param_groups`` are read at every ``train_step``, or ``None``.
        self.torch_optimizer = torch_optimizer
        self._group_ids = [tuple(id(p) for p in g["params"]) for g in torch_optimizer.param_groups] \
            if torch_optimizer is not None else None
        self.loss_fn = loss_fn
        self.accumulate_grads = accumulate_grads
        #: the global gradient-norm clip applied at each update (``None``: none).
        self.max_grad_norm: float | None = None if max_grad_norm is None else float(max_grad_norm)
        #: whether an update whose gradient norm is not finite is skipped.
        self.skip_nonfinite: bool = skip_nonfinite
        #: without an optimizer and with ``accumulate_grads=False``: the last step's gradients
        #: (per stage, ``{name: jax.Array}`` in ``pinned_host``; the names in ``transposed`` as ``[in, out]``).
        self.last_grads: list | None = None
        self._jax_losses: dict = {}
        #: the schedule chosen by :meth:`autotune` (a ``ScheduleChoice``: ``.explain()``), or ``None``.
        self.schedule = None
        self._autotune_budget: int | None = autotune_budget
        #: what :meth:`autotune` chooses from when given no ``calibration`` (``None``: it measures).
        self.calibration = calibration
        #: jax's fp32 matmul precision the executables were traced with: torch's setting
        #: (:func:`torch_matmul_precision`), read again at every call.
        self.matmul_precision: str = torch_matmul_precision()

    def _check_trace(self, inputs: tuple) -> None:
        """Trace the forward of every stage (shapes only, nothing compiled or run) on ``inputs``.

        Raises: ValueError naming the stage and its module when a stage fails to trace, and where in the
        model's code and why (``xla_swap.hf_refusals.describe_failure``), the tracer's own message after.
        """
        try:
            with self.torch_precision():
                self.runtime.output_aval(self._carry_in(tuple(inputs), per_rank=False))
        except (ValueError, TypeError) as e:
            msg = str(e)
            i = int(msg.split(":")[0].split()[1]) if msg.startswith("stage ") else None
            where = f"{self.stage_names[i]} ({type(self.modules[i]).__name__})" if i is not None else "a stage"
            raise ValueError(f"{where} does not trace with torchax on an example input: {describe_failure(e)}"
                             f"\n(details: {msg})") from e

    @contextlib.contextmanager
    def torch_precision(self):
        """Context manager: trace and run under torch's fp32 matmul setting (``torch_matmul_precision()``,
        read on entry); a setting changed since the last call clears the compiled executables."""
        p = torch_matmul_precision()
        if p != self.matmul_precision:
            self.runtime.clear_executables()
            self.matmul_precision = p
        with jax.default_matmul_precision(p):
            yield

    # ------------------------------------------------------------------ serving
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Run the stack on ``inputs``; returns a torch tensor.

        Inputs on the CPU give a CPU output (copied from the device); CUDA inputs, on any local
        GPU, are laid out where the runtime places them (split over the data-parallel devices, or
        on the stack's one device) by peer-to-peer copies and DLPack, and give a CUDA output on the
        first CUDA input's device (no copy through the host: the way to serve at the floor). A
        batch that does not split over the data-parallel devices runs replicated (exact; a warning).
        With per-rank batches (:mod:`xla_swap.distributed`): this rank's batch in, its rows out.

        Each new input shape compiles once (bounded cache, ``max_signatures``).

        Raises:
          TypeError: an input is not a torch.Tensor; an input's dtype jax would narrow
            (``float64`` with ``jax_enable_x64`` off), or one the layers would compute in another
            dtype (an ``int32`` or ``float16`` hidden state into ``float32`` layers shared by
            several stages): the message names ``inputs[i]``, the dtype got and the one expected.
          IndexError: a token id outside the input embedding's rows (``first`` a
            ``causal_lm_stages`` first stage or an ``nn.Embedding``: :mod:`xla_swap.index_checks`),
            as torch's embedding raises; the message names the tensor, the value and the range.
          ValueError: a stage fails to trace (the message names it).
        """
        with self.torch_precision():
            self._maybe_autotune(tuple(inputs), training=False)
            x = self._carry_in(inputs)
            out_dev = next((t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"),
                           None)
            return self._out(self.runtime.forward(x), out_dev)

    __call__ = forward

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Generate tokens with a KV cache, as ``model.generate`` (a stack of ``causal_lm_stages(model)``).

        ``input_ids`` int ``[batch, prompt]``, ``attention_mask`` ``None`` or left-padded 0/1 of its
        shape; keywords ``max_new_tokens`` (required), ``do_sample``, ``temperature``, ``top_k``,
        ``top_p``, ``eos_token_id``, ``pad_token_id``, ``seed``, ``kv_cache`` (``"auto"`` /
        ``"device"`` / ``"host"``), ``device_budget_bytes``, ``max_cache_len``, ``prompt_bucket``,
        ``expert_fetch`` (``"auto"`` / ``"routed"`` / ``"all"``), ``expert_layout``. Returns int64 ``[batch, prompt + n]`` on the CPU. Arguments, placement and errors:
        :func:`xla_swap.generate.generate`.
        """
        from xla_swap.generate import generate
        return generate(self, input_ids, attention_mask, **kwargs)

    # ------------------------------------------------------------------ weights
    def state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """The current weights of every stage as CPU torch tensors: ``[{name: tensor}, ...]`` (copies).

        With several processes every process must call it (the sharded weights are gathered).
        """
        return [{n: self._torch_layout(i, n, to_torch(p[n])) for n in names}
                for i, (p, names) in enumerate(zip(self.runtime.host_params, self.trainable_names))]

    def _torch_layout(self, stage: int, name: str, t: torch.Tensor) -> torch.Tensor:
        """A host-layout tensor of ``name`` in stage ``stage`` in torch's layout (``transposed`` ones back to ``[out, in]``)."""
        return t.t().contiguous() if name in self.transposed[stage] else t

    def sync_modules(self) -> None:
        """Copy the current (trained) weights into the ``nn.Module`` parameters, in place.

        Raises: ValueError naming the parameter, before anything is copied: a parameter is on the
          meta device (a stack built by :func:`xla_swap.load_stack`, or whose modules were released
          with ``model.to("meta")``): use :meth:`state_dicts` or :meth:`save_checkpoint` instead.
        """
        for name, m in zip(self.stage_names, self.modules):
            for n, p in m.named_parameters():
                if p.is_meta:
                    raise ValueError(f"sync_modules: {name}.{n} is on the meta device (the module holds no storage); "
                                     "read the weights with state_dicts() or save_checkpoint()")
        with torch.no_grad():
            for m, sd in zip(self.modules, self.state_dicts()):
                params = dict(m.named_parameters())
                for n, t in sd.items():
                    params[n].copy_(t)

    # ------------------------------------------------------------------ internals
    def _carry_in(self, inputs, per_rank: bool | None = None):
        """The inputs as the runtime takes them (this rank's batch with per-rank batches, unless ``per_rank=False``)."""
        if not inputs:
            raise TypeError("forward/train_step need at least one input tensor")
        if not self.has_first and len(inputs) != 1:
            raise TypeError(f"without a `first` stage the layers take one input (h), got {len(inputs)}")
        x = inputs_to_jax(tuple(inputs), "inputs", self.runtime.input_sharding_of,
                          token_id_bounds(self.modules[0] if self.has_first else None),   # IndexError first
                          per_rank=per_rank_batches() if per_rank is None else per_rank)
        if self.param_dtype is not None and self.cast_inputs and not self.has_first:
            x = cast_floats(x, jnp.bfloat16)   # h as the layers compute it (the carry check wants it so)
        x = x if self.has_first else (x[0], {})
        self.runtime.signature(x, "inputs")   # dtype checks (and the trace, cached) before anything runs
        return x

    def _out(self, y, device: torch.device | None):
        if isinstance(y, tuple) and len(y) == 2 and isinstance(y[1], dict):
            y = y[0]
        convert = rank_rows_to_torch if per_rank_batches() else output_to_torch
        return jax.tree_util.tree_map(lambda a: convert(a, device), y)
