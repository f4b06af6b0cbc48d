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
  torchax (:mod:`xla_swap.stack.torch_bridge`, :mod:`xla_swap.stack.stages`); layers that compute the same
  thing share one function (one forward and one backward executable). Weights go to host memory directly.
* **Runtime.** :class:`xla_swap.executors.StreamingRuntime`: each stage's weights live in their own
  ``pinned_host`` buffers, streamed ``prefetch_depth`` stages ahead in the forward and the backward.
* **Optimizer.** With an optimizer (an :class:`xla_swap.planning.AdamW`, or a
  ``torch.optim.AdamW`` whose param groups are read at every step: schedulers and per-group
  weight decay work), each stage is updated on the device right after its backward: its moments
  come from ``pinned_host`` with its weights, and the new weights and moments go back. Gradients
  never leave the device; AdamW state never lives on it beyond the prefetch window. The update
  is ``torch.optim.AdamW``'s (:mod:`xla_swap.stack.training`). Without an optimizer, ``train_step``
  writes the gradients into the modules' ``.grad``.
* **Carry.** ``first(*inputs)`` returns the hidden state ``h``, or ``(h, layer_kwargs)``
  where ``layer_kwargs`` is a dict of tensors every layer gets as keyword arguments
  (attention mask, rotary ``position_embeddings``); each layer is called
  ``layer(h, **layer_kwargs)`` (a tuple result's first element is the new ``h``); ``last(h)``
  gives the output. Integer tensors (token ids) are constants: they get no gradient.
  Layers that get different keyword values (a sliding-window and a full mask) are told apart
  by ``first.layer_keys`` (one hashable key per layer) and ``first.select_layer_kwargs(key,
  layer_kwargs) -> kwargs``: layer ``i`` is then called with ``select_layer_kwargs(layer_keys[i],
  layer_kwargs)``; only layers of one key share a function (``xla_swap.hf.causal_lm.CausalLMFirst``).
* **Parts.** The stack holds its ``StreamingRuntime`` and calls its parts, each with the runtime it works
  on: ``trainer`` (:class:`xla_swap.stack.training.Trainer`), ``autotuner`` (:class:`xla_swap.stack.budget.Autotuner`),
  ``checkpointer`` (:class:`xla_swap.stack.checkpoint.Checkpointer`), ``generators``
  (:class:`xla_swap.hf.generators.Generators`). Dropping the stack frees them (by reference counting); the
  modules are the caller's; what outlives it: :mod:`xla_swap.executors.streaming`.

Imports torch, torchax, jax; not torch_xla (``docs/explanation/design.md`` lists the modules beside it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import torch

from xla_swap.stack.budget import Autotuner, build_runtime
from xla_swap.stack.checkpoint import Checkpointer, model_parameter_names
from xla_swap.distributed import per_rank_batches
from xla_swap.executors.streaming.runtime import RuntimeConfig, StreamingRuntime
from xla_swap.hf.generate import generate
from xla_swap.hf.generators import Generators
from xla_swap.hf.causal_lm import causal_lm_stages  # noqa: F401  (re-exported: the entry point's splitter)
from xla_swap.hf.refusals import describe_failure
from xla_swap.stack.checks import token_id_bounds
from xla_swap.stack.mixed_precision import cast_floats, check_mixed_precision, stage_functions_in
from xla_swap.planning import InfeasibleBudgetError
from xla_swap.planning.optimizer import AdamW
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.stack.sharding import StageSharding
from xla_swap.stack.checks import (check_moved_keywords, check_options, check_weights_source, checked_devices,
                                   checked_layers, optimizer_config, stages_in_order)
from xla_swap.stack.config import AutotuneConfig, CompileConfig, ParallelConfig, TrainingConfig
from xla_swap.stack.stages import StageLayout, host_stages, linear_weights, stage_functions, tied_parameters
from xla_swap.stack.torch_attention import torchax_env, warn_eager_attention
from xla_swap.stack.torch_bridge import (inputs_to_jax, output_to_torch, rank_rows_to_torch, to_torch,
                                         torch_matmul_precision)
from xla_swap.stack.training import Trainer, torch_param_groups

__all__ = ["SwappedStack", "causal_lm_stages", "DEFAULT_POLICY", "torch_matmul_precision", "AutotuneConfig",
           "CompileConfig", "ParallelConfig", "TrainingConfig"]

log = logging.getLogger(__name__)

#: The policy used when none is given: weights, gradients and optimizer state in host
#: memory, each stage recomputed in the backward, two stages prefetched.
DEFAULT_POLICY = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=True, prefetch_depth=2)


class SwappedStack:
    """A stack of torch layers whose weights, gradients and optimizer state live in host memory.

    Args:
      layers: a non-empty sequence of ``torch.nn.Module`` (e.g. ``model.model.layers`` of a
        Hugging Face decoder, unmodified). Called ``layer(h, **layer_kwargs)``.
      first: optional module run before the layers on the user's inputs, e.g. the embedding:
        ``first(*inputs) -> h`` or ``(h, layer_kwargs)`` (see the module docstring). Without
        it, the first input is ``h``.
      last: optional module run after the layers, e.g. final norm and LM head: ``last(h) -> out``.
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
      policy: the schedule, an :class:`xla_swap.planning.OffloadPolicy` (default ``DEFAULT_POLICY``):
        ``params`` host/device, ``grads``, ``optimizer_state``, ``remat``, ``prefetch_depth``. With
        ``budget_bytes`` it must stream (``params="host"``): the budget chooses the stages kept resident.
      budget_bytes: device memory (bytes) for the stack. With ``autotune`` enabled (the default) it bounds
        everything the stack holds on the device (weights, optimizer state, activations, temporaries): the
        first ``forward`` or ``train_step`` measures the link and each layer on the device (a few calls:
        seconds) and switches to the schedule predicted fastest for the budget and that call's input shape
        (:meth:`autotune`; ``schedule`` then holds the choice), for a training step when there is an
        ``optimizer``, else for that call's mode. Until then every stage streams. With several devices the
        bytes are counted unsharded (the planner's logical bytes). With ``autotune`` disabled it bounds
        weights and optimizer state only: stages are kept resident from the last one backwards while they
        fit beside the streaming window of ``prefetch_depth + 1`` stages (the last stages are the first the
        backward needs), at construction, and the rest are streamed.
      autotune: an :class:`xla_swap.stack.config.AutotuneConfig`: whether ``budget_bytes`` is chosen for at
        the first call, and what from (``calibration``).
      parallel: a :class:`xla_swap.stack.config.ParallelConfig`: the devices (default every local one), the
        ``shard`` rule of the weights over them (default ``"fsdp"``) and ``data_parallel``.
      weights: where the stages' values come from: ``None`` (default) the modules' own parameters
        and buffers, or a callable ``weights(module, names) -> {name: torch.Tensor}`` called once
        per stage, in order, with the stage's module and the names of its buffers and parameters
        (as ``named_buffers()`` / ``named_parameters()`` give them), returning CPU tensors of the
        modules' shapes in torch's layout, in the dtype the stage is to hold (the modules' own
        dtype is not used). The modules may then be on the meta device (``torch.device("meta")``):
        only their structure is used. :class:`xla_swap.hf.loading.SafetensorsWeights` reads a
        Hugging Face safetensors checkpoint this way; :func:`xla_swap.load_stack` builds a stack
        from a causal LM and its checkpoint.
      mp_policy: mixed precision, a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (default ``None``:
        compute in the dtypes held): ``param_dtype=torch.bfloat16`` keeps float32 master weights and
        moments in ``pinned_host``, each stage computing in bf16 inside its executable
        (:mod:`xla_swap.stack.mixed_precision` says how, what it costs and which fields are honoured).
      training: a :class:`xla_swap.stack.config.TrainingConfig`: ``max_grad_norm``, ``skip_nonfinite``,
        ``accumulate_grads`` (without an optimizer), ``offload_activations``.
      compilation: a :class:`xla_swap.stack.config.CompileConfig`: ``transpose_linear``, ``fused_attention``,
        ``max_signatures``.

    Host memory at construction: one stage's transient copies beyond the stack's own buffers; with an
    optimizer the modules' storage may be released once it is built (``docs/explanation/design.md``).

    Raises:
      TypeError: a layer / ``first`` / ``last`` is not an ``nn.Module``; ``policy``,
        ``optimizer``, ``loss_fn``, ``mp_policy`` or a config has the wrong type; a
        parameter or buffer is ``float64`` with ``jax_enable_x64`` off (it would run as ``float32``;
        the message names the stage and the tensor).
      ValueError: ``layers`` is empty; ``budget_bytes`` with a policy that keeps every stage resident; a
        ``budget_bytes`` that is not an int > 0 (a bool or a non-number: TypeError; the words of
        ``xla_swap.planning.units.check_budget_bytes``) or is below the streaming window of weights
        and optimizer state (with ``autotune`` enabled or not);
        a parameter shared by two stages other than ``first`` and ``last`` (tied embeddings: held once
        by ``first``, carried to ``last``; ``tied``); a stage that fails to trace on
        ``first.example_inputs()`` (when ``first`` has it: the message names the stage's module); a torch
        optimizer with options AdamW here does not implement (``amsgrad``, ``maximize``,
        ``Adam``'s L2 ``weight_decay``; the message names the group), a stage parameter with
        ``requires_grad`` in none of its groups, or a group's parameter in no stage (the
        message names it); ``max_grad_norm`` or ``skip_nonfinite`` without an optimizer. TypeError: a torch
        optimizer other than ``AdamW`` / ``Adam`` (e.g. SGD).
      ValueError: a parameter or buffer on the meta device without ``weights``; what ``weights`` gives lacks a
        name, has an unexpected one or a tensor of another shape (the message names the stage and tensor).
        TypeError: ``weights`` not callable, or it returns something other than a dict of tensors.
      ValueError / TypeError: an ``mp_policy`` field not honoured (named); a floating parameter (or what
        ``weights`` gives for one) that is not float32 with ``mp_policy.param_dtype``.
      ValueError: with per-rank batches (:mod:`xla_swap.distributed`), ``parallel.devices`` not spanning every
        process, or ``budget_bytes`` with ``autotune`` enabled (each process would choose its own schedule).
      ImportError: torchax is not installed.
    The configs check their own fields when built (:mod:`xla_swap.stack.config`). A keyword the constructor
    took before the groups (``devices=``, ``max_grad_norm=``, ``prefetch_depth=``, ``param_dtype=``, ...) raises
    TypeError naming the group it now belongs to.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], *, first: torch.nn.Module | None = None,
                 last: torch.nn.Module | None = None, optimizer=None, loss_fn: Callable | None = None,
                 policy: OffloadPolicy | None = None, budget_bytes: int | None = None,
                 autotune: AutotuneConfig = AutotuneConfig(), parallel: ParallelConfig = ParallelConfig(),
                 weights: Callable | None = None, mp_policy=None, training: TrainingConfig = TrainingConfig(),
                 compilation: CompileConfig = CompileConfig(), **moved):
        # ---- validation (no state changes) ----
        check_moved_keywords(moved)
        layers = checked_layers(layers, first, last)
        budget_bytes = check_options(policy=policy, budget_bytes=budget_bytes, loss_fn=loss_fn, optimizer=optimizer,
                                     autotune=autotune, parallel=parallel, training=training, compilation=compilation)
        torch_optimizer, optimizer = optimizer_config(optimizer)
        devices = checked_devices(parallel.devices)
        compute_dtype, cast_inputs = check_mixed_precision(mp_policy, len(devices))
        policy = policy or DEFAULT_POLICY
        modules, names = stages_in_order(first, layers, last)
        owner, tied = tied_parameters(names, modules)
        check_weights_source(weights, modules, names, compute_dtype)
        group_of = torch_param_groups(torch_optimizer, names, modules, owner) if torch_optimizer is not None else {}
        platform = devices[0].platform if compilation.fused_attention else "xla"   # "gpu": SDPA on cuDNN
        env = torchax_env(platform)
        warn_eager_attention(modules, names, platform)

        # ---- stage functions: one per group of layers that compute the same thing ----
        transposed = [linear_weights(m) if compilation.transpose_linear else frozenset() for m in modules]
        if tied:
            transposed[-1] = transposed[-1] - set(tied)
        fns, layer_groups = stage_functions(first, layers, last, env, transposed, tied)

        # ---- weights: torch (or `weights`) -> pinned_host, one stage at a time (never through the device) ----
        placement = StageSharding(devices, parallel.shard, transposed)
        stage_params, trainable, updated, groups = host_stages(names, modules, transposed, tied, weights,
                                                               placement.host, compute_dtype, group_of)
        if compute_dtype is not None:   # one wrapper per distinct stage function (shared layers stay shared)
            fns = stage_functions_in(fns, trainable, jnp.bfloat16, cast_inputs)
        self._hold_stages(StageLayout(modules, names, transposed, trainable, model_parameter_names(modules, first),
                                      first is not None, last is not None), env, tied, layer_groups)
        self._hold_precision(compute_dtype, cast_inputs)
        #: the device mesh of the stages' weights (``None`` on one device).
        self.mesh = placement.mesh
        #: whether activations are split over the devices on their leading dimension.
        self.data_parallel: bool = parallel.splits_batch() and placement.mesh is not None

        # ---- the runtime and the parts that use it ----
        config = RuntimeConfig(track_residency=False, max_signatures=compilation.max_signatures,
                               offload_activations=training.offload_activations,
                               max_grad_norm=training.max_grad_norm, skip_nonfinite=training.skip_nonfinite)
        common = dict(optimizer=optimizer, trainable=lambda i, path: path[0].key in updated[i], own_params=True,
                      group_of=lambda i, path: groups[i][path[0].key],
                      placement=placement.runtime_placement(self.data_parallel))
        #: the :class:`~xla_swap.executors.StreamingRuntime` that runs the stages.
        self.runtime: StreamingRuntime = build_runtime(fns, stage_params, updated, policy, budget_bytes,
                                                       autotune.enabled, config, common)
        #: the policy in force (``budget_bytes`` given: ``params`` reads "host", see ``runtime.resident``;
        #: ``remat`` and ``prefetch_depth`` follow ``autotune``'s choice).
        self.policy: OffloadPolicy = policy
        #: the optimizer's configuration (group 0's with a torch optimizer), or ``None``.
        self.optimizer: AdamW | None = self.runtime.optimizer
        #: the parts the stack calls (module docstring): training, the schedule, checkpoints, generation.
        self.trainer = Trainer(self.layout, env, self.optimizer, torch_optimizer, loss_fn, training)
        self.autotuner = Autotuner(budget_bytes if autotune.enabled else None, autotune.calibration)
        self.checkpointer = Checkpointer(self.layout, self.optimizer, torch_optimizer)
        self.generators = Generators()
        example = getattr(first, "example_inputs", None)
        if callable(example):  # refuse at construction what does not trace (e.g. an op torchax lacks)
            self._check_trace(example())

    def _hold_stages(self, layout: StageLayout, env, tied: dict, layer_groups: list) -> None:
        """The attributes that describe the stages (their names and layouts, as ``layout`` holds them)."""
        #: the stages' modules, names and layouts (:class:`xla_swap.stack.stages.StageLayout`), read by the stack's parts;
        #: ``modules``, ``stage_names``, ``checkpoint_names``, ``has_first`` / ``has_last``, ``transposed``
        #: (per stage the ``nn.Linear`` weights held ``[in, out]``, ``transpose_linear``) and ``trainable_names``
        #: (per stage the names the optimizer updates) are its fields.
        self.layout: StageLayout = layout
        self.modules: list[torch.nn.Module] = layout.modules
        self.stage_names: list[str] = layout.names
        self.checkpoint_names: dict = layout.checkpoint_names
        self.has_first, self.has_last = layout.has_first, layout.has_last
        self.transposed: list[frozenset[str]] = layout.transposed
        self.trainable_names: list = layout.trainable
        #: the torchax environment the stages are traced in (``xla_swap.stack.torch_attention.torchax_env``).
        self.torch_env = env
        #: ``{name in last: name in first}``: the weights ``first`` and ``last`` share (tied embeddings): held
        #: once, by the first stage (one gradient and optimizer state), carried to the last on the device.
        self.tied: dict[str, str] = dict(tied)
        #: per layer, its group: layers of one group share one stage function (``stages.layer_groups``).
        self.layer_groups: tuple[int, ...] = tuple(layer_groups)

    def _hold_precision(self, compute_dtype: torch.dtype | None, cast_inputs: bool) -> None:
        #: the dtype the stages compute in (``param_dtype``): each stage casts its floating parameters
        #: (and with ``cast_forward_inputs`` its floating inputs) to it; ``None``: as held.
        self.param_dtype: torch.dtype | None = compute_dtype
        #: with ``param_dtype``: whether the stages also cast their floating inputs (``cast_forward_inputs``).
        self.cast_inputs: bool = cast_inputs
        #: jax's fp32 matmul precision the executables were traced with: torch's setting
        #: (:func:`torch_matmul_precision`), read again at every call.
        self.matmul_precision: str = torch_matmul_precision()

    def _check_trace(self, inputs: tuple) -> None:
        """Trace the forward of every stage (shapes only, nothing compiled or run) on ``inputs``.

        Raises: ValueError naming the stage and its module when a stage fails to trace, and where in the
        model's code and why (``xla_swap.hf.refusals.describe_failure``), the tracer's own message after.
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

    def _whole_runtime(self) -> StreamingRuntime:
        """``runtime``, every stage's weights in the stack's own form: expert weights a generator packed (the
        ``"split"`` expert layout) put back first (:meth:`xla_swap.hf.generators.Generators.give_back`)."""
        self.generators.give_back()
        return self.runtime

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
            ``causal_lm_stages`` first stage or an ``nn.Embedding``: :mod:`xla_swap.stack.checks`),
            as torch's embedding raises; the message names the tensor, the value and the range.
          ValueError: a stage fails to trace (the message names it).
        """
        self.generators.give_back()
        with self.torch_precision():
            self._maybe_autotune(tuple(inputs), training=False)
            x = self._carry_in(inputs)
            out_dev = next((t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"),
                           None)
            return self._out(self.runtime.forward(x), out_dev)

    __call__ = forward

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Generate tokens with a KV cache, as ``model.generate`` (a stack of ``causal_lm_stages(model)``):
        ``input_ids`` int ``[batch, prompt]``, ``attention_mask`` ``None`` or left-padded 0/1 of its shape,
        ``max_new_tokens`` (required) and the keywords of :func:`xla_swap.hf.generate.generate` (sampling, stop
        tokens, KV cache placement, experts), which gives the arguments, placement and errors. Returns int64
        ``[batch, prompt + n]`` on the CPU; ``last_generation`` holds the placement and figures.
        """
        return generate(self, input_ids, attention_mask, **kwargs)

    @property
    def last_generation(self) -> dict:
        """The last :meth:`generate` call's KV cache placement, its explanation and figures
        (:func:`xla_swap.hf.generate.generate`). Raises AttributeError before the first call."""
        if self.generators.last is None:
            raise AttributeError("last_generation: generate has not run on this stack")
        return self.generators.last

    # ------------------------------------------------------------------ training
    def train_step(self, inputs, targets=(), *, loss_fn: Callable | None = None, lr: float | None = None,
                   accumulate: bool = False) -> torch.Tensor:
        """One training step: forward, ``loss_fn(output, *targets)``, backward, optimizer step.

        With ``accumulate=True`` (and an optimizer) it is one micro-batch: its gradients are added
        to the accumulated ones and nothing is updated; the next call with ``accumulate=False``
        adds its own and updates with the sum, as torch's ``loss.backward()`` per micro-batch and
        one ``optimizer.step()`` do (``.grad`` sums: divide the loss by the number of
        micro-batches, as torch's loop does, for their mean). An update clips and skips as the
        constructor's ``max_grad_norm`` / ``skip_nonfinite`` say (``last_grad_norm``,
        ``last_step_skipped``).

        Args:
          inputs: a torch tensor or a tuple of them (the arguments of ``first``).
          targets: a torch tensor or a tuple of them (CPU, or CUDA on any local GPU), passed to the
            loss after the output, laid out like it: split on the batch over the data-parallel
            devices where the output is, replicated (or on the stack's one device) otherwise. With
            per-rank batches (:mod:`xla_swap.distributed`) ``inputs`` and ``targets`` are this rank's.
          loss_fn: a torch function ``(output, *targets) -> scalar`` (default: the constructor's).
            Converted and compiled once per :func:`xla_swap.stack.training.loss_key`: a lambda recreated each
            step with the same code, reading the same numbers, modules and functions, compiles once; one
            reading a tensor or an ``nn.Module`` compiles at each new function object (keep it,
            and pass per-step data as ``targets``).
          lr: this step's learning rate for every parameter group, overriding the optimizer's for
            this step only (a torch optimizer's ``param_groups`` are not changed). Default: each
            group's own ``lr`` (with a torch optimizer, read now: a ``torch.optim.lr_scheduler``
            stepping it is followed). Unused by an ``accumulate=True`` call (no update).
          accumulate: see above (a bool; needs an optimizer).

        Returns: the loss, a 0-d float32 CPU torch tensor. With an optimizer the weights are
        updated (in host memory: ``sync_modules()`` copies them into the modules); without
        one the gradients are added to the modules' ``.grad`` (CPU tensors).

        Raises (before any state changes):
          TypeError: ``inputs``/``targets`` not tensors; no ``loss_fn``; an input's dtype
            refused as in :meth:`forward`; a ``float64`` target with ``jax_enable_x64`` off;
            ``accumulate`` not a bool.
          IndexError: a token id outside the input embedding's rows, as in :meth:`forward`; a class
            index outside ``[0, C)`` other than the loss's ignore index, as ``cross_entropy`` raises:
            integer targets shaped like the output without its last dimension ``C`` (or that shape
            flattened) are class indices; the ignore index is ``-100`` unless ``loss_fn`` has an
            ``ignore_index`` (``nn.CrossEntropyLoss(ignore_index=...)``, a ``functools.partial``'s
            keyword, an attribute set on the function; ``None``: no target checked). Float targets and
            other shapes are not checked (:mod:`xla_swap.stack.checks`).
          ValueError: the loss is not a floating scalar; a stage fails to trace; ``lr < 0``; the
            torch optimizer's groups hold other parameters than at construction, or an option
            the update does not implement (``AdamW.groups_from_torch``); ``accumulate=True``
            without an optimizer (``.grad`` accumulates already); without an optimizer and with
            ``accumulate_grads``, a parameter on the meta device (no ``.grad`` to add to).
        """
        loss_fn = self.trainer.checked_loss(loss_fn, accumulate)
        self.generators.give_back()
        with self.torch_precision():
            inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
            x = self._carry_in(inputs)   # token ids checked, dtypes, the trace: nothing changes yet
            jax_targets = self.trainer.targets_in(self.runtime, targets, x, loss_fn)
            groups = self.trainer.param_groups()
            if groups is not None:
                self.runtime.param_groups = groups
            runtime = self.runtime
            self._maybe_autotune(inputs, training=True)
            if self.runtime is not runtime:   # autotune chose a new runtime: the input as that one places it
                x = self._carry_in(inputs)
            return self.trainer.step(self.runtime, x, jax_targets, loss_fn, lr, accumulate)

    @property
    def last_grads(self) -> list | None:
        """Without an optimizer and with ``TrainingConfig(accumulate_grads=False)``: the last step's gradients
        (per stage, ``{name: jax.Array}`` in ``pinned_host``; the names in ``transposed`` as ``[in, out]``), else
        ``None``."""
        return self.trainer.last_grads

    @property
    def last_grad_norm(self) -> float | None:
        """The global 2-norm of the gradients of the last update (over every trainable parameter of
        every stage, before clipping: ``clip_grad_norm_``'s return value; a float, possibly inf or
        nan), or ``None`` when neither ``max_grad_norm`` nor ``skip_nonfinite`` is set."""
        return self.runtime.last_grad_norm

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last update was skipped for a non-finite gradient (``skip_nonfinite``)."""
        return self.runtime.last_step_skipped

    # ------------------------------------------------------------------ schedule
    def autotune(self, inputs, *, budget_bytes: int, training: bool = True, reps: int = 3, calibration=None,
                 **choose_kwargs):
        """Choose prefetch depth, resident stages, activation offload, where the optimizer state lives and, for
        training, ``remat`` for ``budget_bytes`` of device memory (for *everything* the stack holds there) from a
        short measurement on the device (or ``calibration``), and run the stack with that choice from now on:
        ``self.runtime`` is replaced (weights, optimizer state and step carried over) and the choice kept as
        ``self.schedule``. A stack built with ``budget_bytes`` (and ``autotune`` enabled) calls it at its first
        ``forward`` / ``train_step``.

        ``inputs`` as for ``train_step`` (their shapes matter); ``training``: for ``train_step`` (default) or
        ``forward``; ``reps``: timed calls per figure; ``choose_kwargs``: ``max_prefetch_depth``,
        ``allow_offload``, ``allow_device_optimizer_state``, ``allow_no_remat``. Returns the
        ``xla_swap.planning.chooser.ScheduleChoice`` (``.explain()``). Arguments and errors (the stack is
        unchanged after one): :meth:`xla_swap.stack.budget.Autotuner.choose`.
        """
        self.autotuner.check_call(calibration)
        self.generators.give_back()
        x = self._carry_in(inputs if isinstance(inputs, (tuple, list)) else (inputs,))
        with self.torch_precision():
            # the stack drops its old runtime: the new one takes its weights and moments, no copy
            self.runtime = self.autotuner.choose(self.runtime, x, budget_bytes, training=training, reps=reps,
                                                 calibration=calibration, **choose_kwargs)
        if isinstance(self.runtime.remat, bool):   # the policy in force follows the choice
            self.policy = dataclasses.replace(self.policy, remat=self.runtime.remat,
                                              prefetch_depth=self.runtime.prefetch_depth)
        return self.autotuner.schedule

    @property
    def schedule(self):
        """The schedule chosen by :meth:`autotune` (a ``ScheduleChoice``: ``.explain()``), or ``None``."""
        return self.autotuner.schedule

    def _maybe_autotune(self, inputs: tuple, training: bool) -> None:
        """At the first call of a stack built with ``budget_bytes`` and ``autotune`` enabled: :meth:`autotune`,
        for training whenever the stack has an optimizer (its device memory then holds the resident
        stages' optimizer state, which a forward's choice does not count), else for that call's mode."""
        if not self.autotuner.due:
            return
        try:
            self.autotune(inputs, budget_bytes=self.autotuner.first_call_budget,
                          training=training or self.optimizer is not None)
        except InfeasibleBudgetError as e:
            raise self.autotuner.infeasible(e, inputs) from e

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The whole training state as CPU torch tensors (copies), in torch's layout and names:
        ``{"model": {fqn: weight}, "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}},
        "param_groups": [...]}}``, the form of ``torch.distributed.checkpoint.state_dict.get_state_dict``.
        Names, dtypes and errors: :meth:`xla_swap.stack.checkpoint.Checkpointer.state_dict`."""
        return self.checkpointer.state_dict(self._whole_runtime())

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the training state from a :meth:`state_dict` (of this stack or another built the same
        way), everything checked before anything changes: :meth:`xla_swap.stack.checkpoint.Checkpointer.load_state_dict`."""
        self.checkpointer.load_state_dict(self._whole_runtime(), state_dict)

    def save_checkpoint(self, path, *, extra: dict | None = None) -> None:
        """Write :meth:`state_dict` as a ``torch.distributed.checkpoint`` checkpoint into the folder ``path``,
        streaming one shard at a time; ``extra``: ``None`` or ``{str: picklable}`` saved beside it (with several
        jax processes every process calls it). Keys, memory and errors:
        :meth:`xla_swap.stack.checkpoint.Checkpointer.save`."""
        self.checkpointer.save(self._whole_runtime(), path, extra=extra)

    def load_checkpoint(self, path) -> dict:
        """Restore the training state from a :meth:`save_checkpoint` folder (of any number of processes and
        devices), one stage at a time; returns its ``extra`` dict (``{}`` without one). Errors:
        :meth:`xla_swap.stack.checkpoint.Checkpointer.load`."""
        return self.checkpointer.load(self._whole_runtime(), path)

    # ------------------------------------------------------------------ weights
    def state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """The current weights of every stage as CPU torch tensors: ``[{name: tensor}, ...]`` (copies).

        With several processes every process must call it (the sharded weights are gathered).
        """
        return [{n: self.layout.torch_layout(i, n, to_torch(p[n])) for n in names}
                for i, (p, names) in enumerate(zip(self._whole_runtime().host_params, self.trainable_names))]

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
