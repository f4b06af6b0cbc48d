"""Streaming (swapping) runtime for layered models: the "CPU swapping runtime" of Alpa #694.

Each stage (layer) of a model is one jitted executable. Every stage's weights live in host
memory (memory kind ``pinned_host``) as *separate* per-stage buffers; while stage ``i``
computes, the weights of stages ``i+1 .. i+k`` are being copied to the device
asynchronously (``jax.device_put`` to memory kind ``device`` returns at once; the order in
which the host dispatches copies and executables is what makes them overlap). ``k`` is the
prefetch depth.

Why this shape: docs/explanation/design.md, "One ``pinned_host`` buffer per layer" and "Streaming: one
executable per stage, prefetch depth k" (figures in docs/explanation/measured-facts.md, sections 4-6). The runtime
holds its parts (``RuntimeParts``, parts.py), each owning its own state; this module holds its constructor
and entry points.

What outlives a runtime: nothing of its own. Its executables (per input signature, at most
``max_signatures``), its jitted loss functions (at most :data:`MAX_LOSS_FNS`), its weights,
optimizer state and the stages carried to the next call are held by the runtime alone and
freed when it is dropped, by reference counting (it holds no reference cycle). It traces and
compiles its own wrappers of the caller's stage and loss functions, never the caller's
function objects: jax keys its tracing caches weakly on the traced function and on each
``jax.jit`` instance, so tracing a long-lived (module-level) function from every new runtime
would add entries that live as long as that function. What stays are jax's own caches, bounded
by jax (its jit-parameter cache holds 2048 entries in jax 0.10; ``jnp.einsum``, which torchax's
``F.linear`` calls, adds entries there keyed on jax's own function, kept until evicted), and in
``xla_swap.planning`` the chooser's ``CHOICES`` (64 choices) and ``PrefetchSchedule``'s derived
fields (256). ``tests/executors/test_release.py`` checks this; ``benchmarks/leak_cycles.py``
measures RSS over construct / call / drop cycles. With jax's persistent compilation cache on,
every executable loaded from it interns its cache file name (``pathlib``) for the call: the
live interned strings do not grow, but CPython's interned-string table is rebuilt once at twice
its slots (about 0.9 MiB at 2^17; ``benchmarks/leak_interned.py``).

The module imports only numpy and jax (no torch, no torch_xla).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from xla_swap.planning.optimizer import AdamW
from xla_swap.planning.policy import OffloadPolicy

from .. import optim as _optim
from .compilation import MAX_LOSS_FNS, Signature, StageCompiler
from .config import (DEFAULT_MAX_SIGNATURES, BackwardMode, RuntimeConfig, check_flag, check_trace, check_train_args,
                     checked_config, config_from_policy, remat_from_policy)
from .forwarding import Forwarded
from .instrumentation import ResidencyTracker, RuntimeInspector
from .calls import RuntimeCalls
from .parts import RuntimeParts
from .placement import (ActivationLayout, Placement, activation_shardings, checked_placement, flatten_stage_params,
                        leaf_sharding_rule, leaf_shardings, num_stages_of)
from .stage_store import StageStore
from ..trace import StageEvent, TraceRecorder
from .optimizer_steps import OptimizerSteps
from ..pytrees import stage_fns, tree_nbytes

__all__ = ["StreamingRuntime", "RuntimeConfig", "Placement", "StageEvent", "TraceRecorder", "tree_nbytes",
           "DEFAULT_MAX_SIGNATURES", "MAX_LOSS_FNS", "Signature", "remat_from_policy"]


class StreamingRuntime:
    """Run a stack of stages with host-resident weights streamed to the device k stages ahead.

    Args:
      stage_fn: ``stage_fn(params_i, h) -> h``: one stage (layer). ``params_i`` is the
        pytree ``stage_params[i]`` (in device memory) and ``h`` the activation (the carry
        between stages): one array or a pytree of arrays; it returns the next stage's
        ``h`` (an array or a pytree of arrays; a pytree carry lets one layer be split
        into several stages, e.g. an FFN's column chunks with ``(x, partial_sum)``, or
        carry per-call constants such as an attention mask or integer position ids
        alongside the hidden state). Either one callable shared by every stage
        (then every stage's params must have the same tree structure, leaf shapes and
        dtypes), or a sequence with one callable per stage. One executable is compiled per
        distinct (callable, params signature, input signature): an L-layer stack of
        identical layers compiles one forward (and, for training, one backward) executable.
      stage_params: non-empty sequence of per-stage pytrees of arrays (numpy arrays or
        ``jax.Array``, any dtype). Each leaf is copied once into its own ``pinned_host``
        buffer (a leaf that already is a jax array with the target ``pinned_host`` sharding
        is used as is, without a copy, unless ``optimizer`` is given). Integer and bool
        leaves are constants: they get no gradient and no update.
      config: a :class:`~xla_swap.executors.RuntimeConfig`: how the runtime moves and keeps its arrays
        (``prefetch_depth``, ``resident``, ``remat``, ``offload_activations``, ``grads_to_host``,
        ``optimizer_state_on_host``, ``donate``, ``throttle``, ``track_residency``,
        ``prefetch_next_call``, ``max_signatures``, ``max_grad_norm``, ``skip_nonfinite``; its
        docstring documents each). Default ``None``: ``RuntimeConfig()``. Its ``num_stages`` may be
        left ``None`` (filled from ``stage_params``); ``config`` reads the filled-in one.
      placement: a :class:`~xla_swap.executors.Placement`: ``device``, or ``sharding``,
        ``activation_sharding`` and ``batch_axis`` for several devices. Default ``None``: every stage
        on ``jax.devices()[0]``.
      optimizer: an ``xla_swap.planning.AdamW``, or a sequence of them (one per parameter group,
        equal ``state_dtype``; ``group_of`` assigns the leaves): ``train_step`` then applies the update
        per stage on the device right after the stage's backward (weights and moments
        prefetched with the weights, the update fused into the backward executable) and
        sends the new weights and moments back; ``host_params`` and ``optimizer_state``
        hold them. Gradients do not leave the device. ``param_groups`` holds the groups'
        configurations; every one of their hyperparameters (lr, weight decay, betas, eps) is a
        traced input of the update, read at each ``train_step``: assign new configurations (a
        schedule) between steps without a recompile.
      optimizer_state: with ``optimizer``, the initial moments instead of zeros: per stage a
        list of ``(m, v)`` pairs, one per trainable leaf, as ``optimizer_state`` holds them
        (numpy or jax arrays, any memory; e.g. another runtime's). They are copied into place
        (never aliased or donated); no zero state is allocated first, so carrying a state over
        (``xla_swap.executors.streaming.calibrate.reconfigure``) does not hold it twice in device memory.
      trainable: ``(stage_index, leaf_path) -> bool``: which floating leaves get gradients and
        the optimizer's update (default: all). The others (frozen weights, e.g. a LoRA model's
        base, or a rotary frequency buffer) are constants of every vjp: no gradient of theirs is
        computed or returned, and an update never sends them back to host memory.
      group_of: with ``optimizer``: ``(stage_index, leaf_path) -> int``, the parameter group
        (index into ``param_groups``) of each trainable leaf (default: every leaf in group 0).
      trace: a ``TraceRecorder`` (``xla_swap.executors.TraceRecorder``) that records every
        call's transfers and computations as ``StageEvent`` s (seconds since the call's start);
        ``forward`` / ``train_step`` also take one per call. ``None`` (default): no tracing.
        A traced call does not donate buffers.
      own_params: the leaves of ``stage_params`` become the runtime's: a leaf that already is a
        jax array placed where the runtime keeps it (``pinned_host``, or device memory for a
        ``resident`` stage, with the leaf's sharding) is used as is even with an ``optimizer``
        (which otherwise copies it, so that its updates never touch the caller's arrays). The
        caller must not use those arrays afterwards. A caller that places each stage in
        ``pinned_host`` as it reads it (``SwappedStack``) thus holds the weights once, not twice.
        The same holds for the arrays of a given ``optimizer_state``. Default ``False``.

    Device memory (bytes), with S = the largest stage's weight bytes (``stage_nbytes``). Which
      stage's weights are on the device at each step is ``schedule(training)`` (an
      ``xla_swap.planning.PrefetchSchedule``, the model the planner uses too): its
      ``max_live_stages`` is at most k+1 streamed stages, what ``max_resident_stages`` measures,
      and ``peak_live_bytes(stage_nbytes)`` their bytes (at most (k+1)*S). Forward: those
      weights plus two activations; ``train_step``: those weights and their parameter gradients
      (plus, with ``optimizer``, their moments), plus the L+1 stage inputs kept for the backward
      and the stage executables' temporaries (``executable_memory()``), plus with ``remat``
      other than ``True`` the saved residuals (``residual_nbytes``), plus resident stages. The
      bound is physical with ``throttle=True``. Between calls: the schedule's ``carried_out``
      (k stages, k+1 after a ``train_step``; ``prefetch_next_call``). Host memory:
      ``weight_nbytes`` of ``pinned_host`` (plus the moments, plus the returned gradients).

    Raises:
      TypeError: ``stage_fn`` (or an element) is not callable; a parameter leaf is not an
        array, or has a dtype jax would narrow (``float64``/``complex128``, or a 64-bit integer
        array with values beyond 32 bits, with ``jax_enable_x64`` off); ``config`` not a
        ``RuntimeConfig``; ``placement`` not a ``Placement``; ``own_params`` not a bool; ``trace`` is
        not a ``TraceRecorder``; ``optimizer`` is not an ``AdamW`` (or a sequence of them);
        ``trainable`` or ``group_of`` not callable.
      ValueError: ``stage_params`` is empty or not a sequence; ``config.num_stages`` given and not
        the number of stages (the message names both); ``config.resident`` of another length; the
        number of stage functions differs from the number of stages; with one shared
        ``stage_fn``, a stage's params differ from stage 0's in structure, shape or dtype
        (the message names the stage and leaf); the device has no ``pinned_host`` memory;
        ``activation_sharding`` is needed but missing; ``batch_axis`` is not an axis of
        ``activation_sharding``'s mesh; ``optimizer_state`` given without ``optimizer``, or not one
        list of ``(m, v)`` pairs per stage of the trainable leaves' shapes and the optimizer's state
        dtype (the message names the stage); ``group_of`` returns no valid group index (the message
        names the stage and leaf); parameter groups with different ``state_dtype``;
        ``config.max_grad_norm`` or ``config.skip_nonfinite`` without ``optimizer``. The settings'
        own errors are raised when the ``RuntimeConfig`` / ``Placement`` is made.
    """

    def __init__(
        self,
        stage_fn: Callable | Sequence[Callable],
        stage_params: Sequence[Any],
        config: RuntimeConfig | None = None,
        *,
        placement: Placement | None = None,
        optimizer: AdamW | Sequence[AdamW] | None = None,
        optimizer_state: Sequence | None = None,
        trainable: Callable | None = None,
        group_of: Callable | None = None,
        trace: TraceRecorder | None = None,
        own_params: bool = False,
    ):
        # validation first: no state changes before all of it passed
        config, placement = checked_config(config), checked_placement(placement)
        check_flag("own_params", own_params)
        check_trace(trace)
        groups = _optim.check_optimizer(optimizer)
        if group_of is not None and not callable(group_of):
            raise TypeError(f"group_of must be a callable (stage_index, leaf_path) -> int, got {type(group_of).__name__}")
        if trainable is not None and not callable(trainable):
            raise TypeError(f"trainable must be a callable (stage_index, leaf_path) -> bool, "
                            f"got {type(trainable).__name__}")
        n = num_stages_of(stage_params)
        config = config.for_stages(n)
        if config.needs_norm and groups is None:
            raise ValueError("max_grad_norm and skip_nonfinite need an optimizer; without one the gradients are "
                             "returned (clip them yourself)")
        fns, shared = stage_fns(stage_fn, n)
        flat = flatten_stage_params(stage_params, shared)
        base, leaf_sharding = leaf_sharding_rule(placement.device, placement.sharding)
        act, batch_sh = activation_shardings(base, placement.sharding, placement.activation_sharding,
                                             placement.batch_axis)
        host_sh, dev_sh, train_mask, group_idx = leaf_shardings(flat, leaf_sharding, config.resident, trainable,
                                                                groups, group_of)
        avals = [jax.tree_util.tree_unflatten(td, [jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in leaves])
                 for leaves, td in flat]
        self._adopt(RuntimeParts.build(config, fns, stage_params, avals, (host_sh, dev_sh, train_mask, group_idx),
                                       ActivationLayout(act, placement.batch_axis, batch_sh), groups, optimizer_state,
                                       own_params=own_params))
        #: the ``TraceRecorder`` every call records into (``None``: no tracing).
        self.trace = trace

    def _adopt(self, parts: RuntimeParts) -> None:
        """Hold ``parts``: each part is the attribute of its name (``config``, ``store``, ``calls``, ...)."""
        #: the runtime's parts, made together (``RuntimeParts``); ``config`` is its frozen ``RuntimeConfig``.
        self.parts: RuntimeParts = parts
        self.config, self.layout, self.steps, self.store = parts.config, parts.layout, parts.steps, parts.store
        self.compiler, self.residency, self.calls = parts.compiler, parts.residency, parts.calls
        self.inspector = parts.inspector

    def reconfigured(self, config: RuntimeConfig | None = None, *, own_params: bool = False,
                     **settings) -> "StreamingRuntime":
        """A new runtime over this one's stages under another configuration: the same stage functions,
        current weights and optimizer state (its step count too), shardings, trainable leaves, parameter
        groups and ``trace``; its ``config`` is ``config`` (default: this one's) with ``settings`` changed
        (``RuntimeConfig`` fields: ``prefetch_depth``, ``resident``, ``remat``, ``offload_activations``, ...).

        ``own_params=False``: this runtime is left as it was (the new one holds copies where the
        optimizer updates them); ``True``: the new runtime takes the arrays where they already sit, and this
        one must not be called afterwards.

        Raises: TypeError: an unknown setting, ``own_params`` not a bool, ``config`` not a ``RuntimeConfig``;
          the ``RuntimeConfig`` errors for a bad value; ValueError: ``config.num_stages`` not this runtime's;
          accumulated gradients are pending (``grad_acc``: update first).
        """
        check_flag("own_params", own_params)
        if "num_stages" in settings:
            raise TypeError("num_stages: a reconfigured runtime runs the same stages")
        config = self.config if config is None else checked_config(config).for_stages(self.num_stages)
        parts = self.parts.reconfigured(config.replace(**settings), own_params=own_params)
        return type(self).adopting(parts, trace=self.trace)

    @classmethod
    def adopting(cls, parts: RuntimeParts, *, trace: TraceRecorder | None = None) -> "StreamingRuntime":
        """A runtime holding ``parts`` (made by ``RuntimeParts.build`` or ``reconfigured``), recording into ``trace``."""
        check_trace(trace)
        rt = cls.__new__(cls)
        cls._adopt(rt, parts)
        rt.trace = trace
        return rt

    # the settings (RuntimeConfig)
    num_stages = Forwarded("config")
    prefetch_depth = Forwarded("config")
    resident = Forwarded("config")
    remat = Forwarded("config")
    donate = Forwarded("config")
    throttle = Forwarded("config")
    track_residency = Forwarded("config")
    grads_to_host = Forwarded("config")
    optimizer_state_on_host = Forwarded("config")
    max_signatures = Forwarded("config")
    offload_activations = Forwarded("config")
    prefetch_next_call = Forwarded("config")
    max_grad_norm = Forwarded("config")
    skip_nonfinite = Forwarded("config")
    # where activations live (ActivationLayout)
    activation_sharding = Forwarded("layout", of=ActivationLayout)
    batch_axis = Forwarded("layout", of=ActivationLayout)
    activation_sharding_of = Forwarded("layout", of=ActivationLayout)
    runs_replicated = Forwarded("layout", of=ActivationLayout)
    input_sharding_of = Forwarded("layout", of=ActivationLayout)
    loss_args_sharding_of = Forwarded("layout", of=ActivationLayout)
    _act = Forwarded("layout", "act", of=ActivationLayout)
    # the stages' arrays (StageStore)
    host_params = Forwarded("store", of=StageStore)
    optimizer_state = Forwarded("store", of=StageStore)
    grad_acc = Forwarded("store", of=StageStore)
    micro_batches = Forwarded("store", of=StageStore)
    stage_nbytes = Forwarded("store", of=StageStore)
    weight_nbytes = Forwarded("store", of=StageStore)
    optimizer_state_nbytes = Forwarded("store", of=StageStore)
    trainable_paths = Forwarded("store", of=StageStore)
    load_stage = Forwarded("store", of=StageStore)
    _carry = Forwarded("store", "carry", of=StageStore)
    # the optimizer (OptimizerSteps)
    optimizer = Forwarded("steps", of=OptimizerSteps)
    param_groups = Forwarded("steps", settable=True, of=OptimizerSteps)
    step = Forwarded("steps", settable=True, of=OptimizerSteps)
    last_grad_norm = Forwarded("steps", of=OptimizerSteps)
    last_step_skipped = Forwarded("steps", of=OptimizerSteps)
    # the executables (StageCompiler)
    STAGE_KINDS = StageCompiler.STAGE_KINDS
    num_executables = Forwarded("compiler", of=StageCompiler)
    num_signatures = Forwarded("compiler", of=StageCompiler)
    clear_executables = Forwarded("compiler", of=StageCompiler)
    stage_fns = Forwarded("compiler", of=StageCompiler)
    stage_fn_ids = Forwarded("compiler", of=StageCompiler)
    signature = Forwarded("compiler", of=StageCompiler)
    stage_executable = Forwarded("compiler", of=StageCompiler)
    _signature = Forwarded("compiler", "signature", of=StageCompiler)
    _fns = Forwarded("compiler", "fns", of=StageCompiler)
    _traced_fns = Forwarded("compiler", "traced_fns", of=StageCompiler)
    _sigs = Forwarded("compiler", "sigs", of=StageCompiler)
    _loss_jits = Forwarded("compiler", "loss_jits", of=StageCompiler)
    _loss_shapes = Forwarded("compiler", "loss_shapes", of=StageCompiler)
    # the calls (RuntimeCalls) and what they leave to read
    schedule = Forwarded("calls", of=RuntimeCalls)
    last_schedule = Forwarded("calls", of=RuntimeCalls)
    executed_events = Forwarded("calls", of=RuntimeCalls)
    offloaded_activation_nbytes = Forwarded("calls", of=RuntimeCalls)
    residual_nbytes = Forwarded("calls", of=RuntimeCalls)
    max_resident_stages = Forwarded("residency", of=ResidencyTracker)
    residency_trace = Forwarded("residency", of=ResidencyTracker)
    resident_stages = Forwarded("residency", of=ResidencyTracker)
    reset_stats = Forwarded("residency", of=ResidencyTracker)
    memory_report = Forwarded("inspector", of=RuntimeInspector)
    executable_memory = Forwarded("inspector", of=RuntimeInspector)
    executable_hlo = Forwarded("inspector", of=RuntimeInspector)
    stage_input_nbytes = Forwarded("inspector", of=RuntimeInspector)
    layer_cost = Forwarded("inspector", of=RuntimeInspector)
    stage_cost_bytes = Forwarded("inspector", of=RuntimeInspector)

    @property
    def param_avals(self) -> tuple:
        """Per stage, the weights' shapes and dtypes: a pytree of ``jax.ShapeDtypeStruct`` like
        ``host_params[i]`` (read-only)."""
        return tuple(lay.param_aval for lay in self.store.layouts)

    @property
    def device_shardings(self) -> tuple:
        """Per stage, the shardings (memory kind ``device``) its weights get when streamed in: a
        pytree of ``jax.sharding.Sharding`` like ``host_params[i]`` (read-only)."""
        return tuple(lay.device_sharding for lay in self.store.layouts)

    @property
    def optimizer_state_device_shardings(self) -> tuple:
        """Per stage, the device shardings of its optimizer state: a list of ``(m, v)`` sharding
        pairs like ``optimizer_state[i]`` (a copy; empty lists without an optimizer)."""
        return tuple(list(lay.state_device) for lay in self.store.layouts)

    @property
    def trainable_mask(self) -> tuple:
        """Per stage, a tuple of bools, one per leaf of ``host_params[i]`` in leaf order: whether
        the optimizer updates it (the floating leaves ``trainable`` selects)."""
        return tuple(lay.train_mask for lay in self.store.layouts)

    @property
    def group_idx(self) -> list[tuple[int, ...]]:
        """Per stage, the parameter group of each trainable leaf (in leaf order)."""
        return [lay.groups for lay in self.store.layouts]

    @classmethod
    def from_policy(cls, stage_fn, stage_params, policy: OffloadPolicy, config: RuntimeConfig | None = None,
                    **kwargs) -> "StreamingRuntime":
        """A runtime that applies ``policy`` (the planner's ``Plan.policy`` or one written by hand).

        The policy decides ``config``'s ``prefetch_depth``, ``resident`` (``params="host"`` streams
        every stage, ``"device"`` keeps every stage resident), ``grads_to_host``,
        ``optimizer_state_on_host`` and ``remat`` (``remat=True`` recomputes each stage in the
        backward, keeping the activations named ``"device"`` in ``policy.activations``
        (``jax.ad_checkpoint.checkpoint_name``) through
        ``jax.checkpoint_policies.save_only_these_names``; ``remat=False`` keeps every residual):
        ``xla_swap.executors.streaming.config.config_from_policy``.

        Args:
          stage_fn, stage_params: as for the constructor.
          policy: an ``xla_swap.planning.OffloadPolicy``.
          config: the other settings (a ``RuntimeConfig`` whose policy-decided fields keep their defaults).
          **kwargs: the constructor's keywords (``placement``, ``optimizer``, ...).

        Raises:
          TypeError: ``policy`` is not an ``OffloadPolicy``; ``config`` not a ``RuntimeConfig``.
          ValueError: ``policy.activations`` offloads names to the host (kept in device
            memory by this runtime: not supported here); ``config`` sets a field the policy decides;
            the constructor's errors.
        """
        try:
            n = len(stage_params)
        except TypeError:
            n = None
        return cls(stage_fn, stage_params, config_from_policy(policy, n, config), **kwargs)

    # ------------------------------------------------------------------ public API
    @property
    def prefetched_stages(self) -> list[int]:
        """Stages whose weights are held in device memory for the next call (``prefetch_next_call``), sorted."""
        return sorted(self.store.carry)

    def release_prefetched(self) -> None:
        """Drop the weights held in device memory for the next call (frees up to k stages' weights;
        the next call then streams its first stages again)."""
        self.store.set_carry({})

    def output_aval(self, h):
        """Shape and dtype of ``forward(h)`` without running anything (traces on first use of a signature).

        Returns: a ``jax.ShapeDtypeStruct`` (or a pytree of them for a pytree carry).

        Raises: as ``forward``.
        """
        return self.compiler.signature(h).chain[-1]

    def forward(self, h, *, trace: TraceRecorder | None = None):
        """Run every stage in order, streaming weights ``prefetch_depth`` stages ahead.

        Args:
          h: the input activation: a numpy or jax array, or a pytree of them. Each new
            structure/shape/dtype signature is traced and compiled once (before any
            transfer) and cached (at most ``max_signatures``, least recently used dropped).
          trace: a ``TraceRecorder`` for this call (instead of the constructor's ``trace``).

        Returns:
          ``jax.Array`` (or pytree) on the device (``activation_sharding``), shaped like
          the last stage's output. Asynchronous: call ``jax.block_until_ready`` to wait.

        Raises:
          TypeError: a leaf of ``h`` is not an array; a leaf's dtype is one jax would narrow
            (``float64``/``complex128``, or a 64-bit integer array with values beyond 32 bits,
            with ``jax_enable_x64`` off); a stage whose ``stage_fn`` and parameters the next
            stage shares returns the carry in other dtypes than it got (e.g. an ``int32`` or
            ``float16`` ``h`` promoted by ``float32`` weights): the message names the leaf,
            the dtype got and the one expected; a stage returns no array or a non-array leaf;
            ``trace`` is not a ``TraceRecorder``.
          ValueError: a leaf of ``h`` is a deleted jax array; a stage function fails to
            trace (message names the stage).
        """
        check_trace(trace)
        return self.calls.run(h, train=False, recorder=trace if trace is not None else self.trace)[0]

    __call__ = forward

    def train_step(self, h, loss_fn: Callable | None = None, *, cotangent=None, loss_args: tuple = (),
                   lr: float | None = None, trace: TraceRecorder | None = None, accumulate: bool = False,
                   max_grad_norm: float | None = None, skip_nonfinite: bool | None = None):
        """Forward and backward pass; each stage's parameter gradients go to ``pinned_host``
        (or, with ``optimizer``, each stage is updated right after its backward).

        The forward keeps every stage's input on the device (L activations) and the last
        ``prefetch_depth + 1`` stages' weights (the backward starts with them). The backward
        runs one ``jax.vjp`` executable per stage in reverse (it recomputes the stage's
        forward: per-stage rematerialisation; see ``remat`` for keeping residuals instead)
        with the same k-deep prefetch. Weight traffic per step: 2L-2k-2 stages in in a loop
        (the last k+1 stay on the device from the forward to the backward; with
        ``prefetch_next_call`` the call starts with stages 0..k, the backward keeps them for the
        next call; 2L-k-1 in a cold call), and L stages of gradients out (or, with ``optimizer``,
        L stages of weights and moments out and the moments in). Gradients are taken w.r.t. the
        ``trainable`` leaves of the parameters and the floating leaves of ``h``; the rest are constants.

        Args:
          h: input activation, as for ``forward``.
          loss_fn: ``loss_fn(out, *loss_args) -> scalar`` (shape ``()``, floating). Its
            value and gradient w.r.t. ``out`` are computed by one jitted executable, cached
            per ``loss_fn`` object (bounded: pass per-step data such as targets through
            ``loss_args``, not a new closure per step, or every step compiles again).
          cotangent: instead of ``loss_fn``: the cotangent of the output (same structure,
            shapes and dtypes as the output's floating leaves), numpy or jax arrays.
          loss_args: extra arguments (e.g. targets) passed to ``loss_fn``.
          lr: with ``optimizer``: this step's learning rate for every parameter group (default:
            each group's ``param_groups[g].lr``); changing it does not recompile.
          trace: a ``TraceRecorder`` for this call (instead of the constructor's ``trace``).
          accumulate: with ``optimizer``: add this micro-batch's gradients to ``grad_acc`` and do
            not update (``lr`` is then unused). The next call with ``accumulate=False`` adds its
            own and updates with the sum (torch's ``.grad`` accumulation: divide the loss by the
            number of micro-batches for their mean). Per micro-batch this moves the weights in
            (forward and backward, as any step) and the accumulators in (all but the first) and
            out, never the moments; the moments move once per update.
          max_grad_norm: with ``optimizer``, at an update: scale the (summed) gradients by
            ``min(1, max_grad_norm / (norm + 1e-6))``, ``norm`` their 2-norm over every trainable
            leaf of every stage (``clip_grad_norm_``). Default: the runtime's ``max_grad_norm``.
          skip_nonfinite: with ``optimizer``, at an update: when that norm is not finite, skip the
            update (weights, moments and ``step`` unchanged; the accumulated gradients dropped), as
            torch's ``GradScaler`` skips ``optimizer.step()`` (default: the runtime's; ``last_step_skipped``).
            With either, the update needs every gradient first: the backward sends them to ``grad_acc`` and
            the ``"update"`` pass of ``schedule(True, update_pass=True)`` streams weights, gradients and moments
            in and weights and moments out (one host sync for ``last_grad_norm``).

        Returns:
          ``(loss_or_output, input_cotangent, grads)``: the scalar loss (``loss_fn`` given) or the
          forward output (``cotangent`` given), as device arrays; the cotangent of ``h`` (device,
          shaped like ``h``, ``None`` at integer leaves); a list of ``num_stages`` pytrees shaped
          like ``stage_params[i]`` (``None`` at integer leaves and those ``trainable`` leaves out) in
          ``pinned_host`` (``grads_to_host``) or device memory, or ``None`` with ``optimizer`` (the update is
          applied: ``host_params`` and ``optimizer_state`` hold the new values, ``step`` is
          incremented). All asynchronous.

        Raises:
          ValueError: not exactly one of ``loss_fn`` / ``cotangent``; the cotangent's shape
            or dtype differs from the output's; ``loss_fn`` does not return a scalar; the
            input checks of ``forward``; ``lr < 0``; ``param_groups`` was replaced by a list of
            another length or state dtype; ``accumulate``, ``max_grad_norm`` or
            ``skip_nonfinite`` without an optimizer; ``max_grad_norm`` not a finite number > 0.
          TypeError: ``loss_fn`` not callable; ``loss_args`` not a tuple; no floating
            parameter or output leaf; ``trace`` is not a ``TraceRecorder``; a dtype of ``h``
            refused as in ``forward``, or a ``cotangent`` / ``loss_args`` leaf that jax would
            narrow (``float64`` with ``jax_enable_x64`` off).
        """
        check_train_args(loss_fn, cotangent, loss_args, trace, accumulate, skip_nonfinite, max_grad_norm)
        max_grad_norm, skip_nonfinite = self.config.step_norm_settings(max_grad_norm, skip_nonfinite)
        separate_update = accumulate or max_grad_norm is not None or skip_nonfinite
        hyper = self.steps.hyper(lr, separate_update)
        loss_exe = self._train_loss_exe(h, loss_fn, cotangent, loss_args)
        mode = BackwardMode.GRADS if hyper is None else (BackwardMode.ACCUM if separate_update else BackwardMode.UPDATE)
        if mode is BackwardMode.ACCUM and not accumulate:  # compile the update pass before anything moves
            self.compiler.update_exes(self.config.donate)
        out = self.calls.run(h, train=True, recorder=trace if trace is not None else self.trace, loss_exe=loss_exe,
                             cotangent=cotangent, loss_args=loss_args, mode=mode, update_pass=mode is
                             BackwardMode.ACCUM and not accumulate, hyper=hyper if mode is BackwardMode.UPDATE else None)
        self.calls.finish_step(mode, accumulate, hyper, max_grad_norm, skip_nonfinite)
        return out

    def _train_loss_exe(self, h, loss_fn, cotangent, loss_args):
        """``train_step``'s input, cotangent and loss arguments checked against ``h``'s signature; the jitted
        loss (``None`` with a ``cotangent``): ``StageCompiler.train_loss_exe``."""
        return self.compiler.train_loss_exe(h, loss_fn, cotangent, loss_args)
