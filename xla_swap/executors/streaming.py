"""Streaming (swapping) runtime for layered models: the "CPU swapping runtime" of Alpa #694.

Each stage (layer) of a model is one jitted executable. Every stage's weights live in host
memory (memory kind ``pinned_host``) as *separate* per-stage buffers; while stage ``i``
computes, the weights of stages ``i+1 .. i+k`` are being copied to the device
asynchronously (``jax.device_put`` to memory kind ``device`` returns at once; the order in
which the host dispatches copies and executables is what makes them overlap). ``k`` is the
prefetch depth.

Why this shape (figures in ``docs/measured.md``, measured on one NVIDIA H200, jax 0.11.2):

* pinned host<->device copies reach 54-55 GB/s each way and ~93 GB/s both ways at once;
  pageable host memory only 8-14 GB/s. So host weights are kept in ``pinned_host``.
* XLA:GPU overlaps host->device copies of *whole buffers* but not dynamic slices of one
  stacked host buffer (stacked ``lax.scan`` offload: 240 ms vs a 159 ms floor for the
  8-layer, 1 GiB/layer bf16 FFN stack at 8192 tokens). A Python loop over a per-layer
  executable with an async ``device_put`` of the next layer ran in 167 ms (1.05x floor);
  at 32768 tokens 438 ms vs a 419 ms floor. So stage weights are kept as separate buffers.
* A naive streaming training step of the same stack (per-layer forward and ``vjp``
  executables, gradients sent to ``pinned_host``) ran at 1.30x (8192 tokens) and 1.04x
  (32768 tokens) of the on-device per-layer loop.

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

import collections
import dataclasses
import time
import types
import warnings
import weakref
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from xla_swap.planning.optimizer import HYPER_WIDTH, AdamW
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.planning.prefetch import PrefetchSchedule

from . import optim as _optim
from .report import MemoryReport, compiled_report, stats_dict
from .trace import StageEvent, TraceRecorder
from ._stages import (DEVICE_KIND, HOST_KIND, _aval_key, _as_aval, _check_carry_dtypes, _check_input_dtypes,  # noqa: F401
                      _check_memory_kinds, _describe, _index_by_identity, _is_diff, _leaf_name, _merge_diff, _own_fns,
                      _probe, _split_diff, _stage_fns, _tree_aval,
                      tree_nbytes)

__all__ = ["StreamingRuntime", "StageEvent", "TraceRecorder", "tree_nbytes"]

#: Default bound of the per-input-signature executable cache (``max_signatures``).
DEFAULT_MAX_SIGNATURES = 8
#: Bound of the cache of jitted loss functions (one per distinct ``loss_fn`` object).
MAX_LOSS_FNS = 8


@dataclasses.dataclass
class _Signature:
    """Everything compiled for one input signature (tree structure, shapes and dtypes of ``h``)."""

    in_aval: Any
    chain: list  # avals (pytrees) of the input of stage i, i = 0..n (chain[n] is the output)
    stage_exe: dict = dataclasses.field(default_factory=dict)  # (kind, stage) -> compiled
    compiled: dict = dataclasses.field(default_factory=dict)   # dedupe key -> compiled
    saved_layout: dict = dataclasses.field(default_factory=dict)  # dedupe base -> (vjp treedef, sources)
    residual_nbytes: list | None = None


def _check_trace(trace) -> None:
    """Raise ``TypeError`` unless ``trace`` is a ``TraceRecorder`` or ``None``."""
    if trace is not None and not isinstance(trace, TraceRecorder):
        hint = " (trace=True was replaced by trace=TraceRecorder())" if isinstance(trace, bool) else ""
        raise TypeError(f"trace must be an xla_swap.executors.TraceRecorder or None, got {type(trace).__name__}{hint}")


def _remat_from_policy(policy: OffloadPolicy):
    """The ``remat`` argument of the runtime for a policy's ``remat`` and ``activations``."""
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


def _checked_state(optimizer, state, avals: list, stage: int) -> list:
    """``state`` (a stage's ``[(m, v), ...]``) as a list of pairs, checked against the trainable
    leaves' shapes and the optimizer's state dtype; ValueError naming the stage otherwise."""
    ok = isinstance(state, Sequence) and not isinstance(state, (str, bytes)) and len(state) == len(avals)
    pairs = list(state) if ok else []
    for pair, a in zip(pairs, avals):
        dt = np.dtype(_optim.state_dtype(optimizer, a.dtype))
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                and all(tuple(getattr(x, "shape", ())) == tuple(a.shape) and getattr(x, "dtype", None) == dt
                        for x in pair)):
            ok = False
    if not ok:
        raise ValueError(f"optimizer_state[{stage}] must be {len(avals)} (m, v) pairs of the trainable leaves' shapes "
                         f"{[tuple(a.shape) for a in avals]} and dtype "
                         f"{[str(np.dtype(_optim.state_dtype(optimizer, a.dtype))) for a in avals]}")
    return [tuple(p) for p in pairs]


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
      prefetch_depth: k >= 1: how many stages ahead weights are transferred. While stage i
        computes, stages i+1..i+k are being copied in; at most k+1 stages' weights are held
        on the device. k >= L holds every stage.
      device: a ``jax.Device`` holding every stage (default ``jax.devices()[0]``). Not
        together with ``sharding``.
      sharding: for several devices: a ``jax.sharding.Sharding`` used for every parameter
        leaf, or a callable ``(stage_index, leaf_path, leaf) -> Sharding``. Its memory
        kind is ignored: the runtime uses ``pinned_host`` for the resident copy and
        ``device`` for the streamed copy.
      activation_sharding: sharding of ``h`` between stages (memory kind ``device``).
        Default: ``device`` itself, or for a ``NamedSharding`` the same mesh fully
        replicated. Required when ``sharding`` is a callable or another Sharding type.
      batch_axis: data parallelism: the name of a mesh axis of ``activation_sharding`` (a
        ``NamedSharding``) to split the activations' leading (batch or token) dimension
        over. Every activation leaf (stage inputs and outputs, kept inputs, cotangents)
        whose leading dimension is a multiple of that axis' size is sharded on it; other
        leaves (scalars, an attention mask of batch 1) keep ``activation_sharding``. With
        weights sharded over the same axis (``sharding``) this is FSDP / ZeRO-3: each
        device pulls its own weight shard from host memory and XLA all-gathers the stage's
        weights on the device. Default ``None``: activations as ``activation_sharding``.
      donate: donate buffers the runtime owns to the backward executables: a stage's
        streamed device weights (their memory then holds that stage's parameter
        gradients or updated weights) and the output cotangent (when it has the stage
        input's shape and dtype). The user's arrays are never donated. Off for a call
        that is traced (``trace``).
      own_params: the leaves of ``stage_params`` become the runtime's: a leaf that already is a
        jax array placed where the runtime keeps it (``pinned_host``, or device memory for a
        ``resident`` stage, with the leaf's sharding) is used as is even with an ``optimizer``
        (which otherwise copies it, so that its updates never touch the caller's arrays). The
        caller must not use those arrays afterwards. A caller that places each stage in
        ``pinned_host`` as it reads it (``SwappedStack``) thus holds the weights once, not twice.
        Default ``False``.
      throttle: bound device memory for real, not only the runtime's references: after
        dispatching stage i's computation, the host waits until stage i-1's computation
        (forward) or the copy of stage i+1's gradients to host (backward) is complete
        before issuing the next weight transfer. The device is never idle for it (stage
        i is already queued). ``False`` lets the host run ahead.
      track_residency: after each stage, count the stages whose runtime-created device
        buffers are alive (``jax.live_arrays()``); see ``max_resident_stages``. Costs a scan
        of all live arrays per stage; turn off for timing.
      trace: a ``TraceRecorder`` (``xla_swap.executors.TraceRecorder``) that records every
        call's transfers and computations as ``StageEvent`` s (seconds since the call's start);
        ``forward`` / ``train_step`` also take one per call. ``None`` (default): no tracing.
        A traced call does not donate buffers.
      remat: what ``train_step`` keeps from each stage's forward for its backward.
        ``True`` (default): only the stage input; the backward recomputes the stage's
        forward. ``False``: every residual of ``jax.vjp(stage_fn)`` except the stage's
        weights and input. A ``jax.checkpoint_policies`` policy: the residuals that
        ``jax.checkpoint(stage_fn, policy=remat)`` saves. The saved residuals stay in
        device memory (``residual_nbytes`` has the bytes kept per stage).
      resident: per stage, ``True`` keeps that stage's weights (and optimizer state) in
        device memory for good: it is never transferred (partial residency). Default: no
        stage resident.
      grads_to_host: ``True`` (default) sends each stage's parameter gradients to
        ``pinned_host`` as soon as its backward produced them; ``False`` returns them in
        device memory (they then add up on the device). Unused with ``optimizer``.
      optimizer: an ``xla_swap.planning.AdamW``, or a sequence of them (one per parameter group,
        equal ``state_dtype``; ``group_of`` assigns the leaves): ``train_step`` then applies the update
        per stage on the device right after the stage's backward (weights and moments
        prefetched with the weights, the update fused into the backward executable) and
        sends the new weights and moments back; ``host_params`` and ``optimizer_state``
        hold them. Gradients do not leave the device. ``param_groups`` holds the groups'
        configurations; every one of their hyperparameters (lr, weight decay, betas, eps) is a
        traced input of the update, read at each ``train_step``: assign new configurations (a
        schedule) between steps without a recompile.
      optimizer_state_on_host: where the moments live between steps: ``pinned_host``
        (default, streamed with the weights) or device memory.
      optimizer_state: with ``optimizer``, the initial moments instead of zeros: per stage a
        list of ``(m, v)`` pairs, one per trainable leaf, as ``optimizer_state`` holds them
        (numpy or jax arrays, any memory; e.g. another runtime's). They are copied into place
        (never aliased or donated); no zero state is allocated first, so carrying a state over
        (``xla_swap.executors.calibrate.reconfigure``) does not hold it twice in device memory.
      group_of: with ``optimizer``: ``(stage_index, leaf_path) -> int``, the parameter group
        (index into ``param_groups``) of each trainable leaf (default: every leaf in group 0).
      trainable: ``(stage_index, leaf_path) -> bool``: which floating leaves the optimizer
        updates (default: all). Non-trainable floating leaves (e.g. a rotary frequency
        buffer) still get gradients in ``train_step`` without an optimizer.
      max_signatures: how many input signatures (structure, shapes, dtypes of ``h``) keep
        their compiled executables; the least recently used is dropped beyond it (a bounded
        cache: serving several batch sizes and sequence lengths with one runtime).
      offload_activations: in ``train_step``, send each stage's kept input (and, with
        ``remat`` other than ``True``, its saved residuals) to ``pinned_host`` once the stage
        has been dispatched, and bring it back ``prefetch_depth`` stages ahead in the backward,
        next to the weights (activation offload; the last k+1 stages keep theirs on the device).
        Device memory for kept activations drops from L stages to about 2k+1.
      prefetch_next_call: treat the schedule as cyclic across calls (default ``True``): a
        ``forward`` keeps streaming at its tail and leaves the first ``min(k, L)`` stages'
        weights in device memory for the next call; a ``train_step`` leaves them there
        from its backward (with ``optimizer``, the updated weights it just computed; without
        one, the streamed copy its backward used, which is then not donated). The next call
        (``forward`` or ``train_step``) starts computing at once instead of waiting for
        stage 0's transfer, and in a serving or training loop the link and the device never
        idle at a call boundary. A ``train_step``'s backward keeps stage k's weights too
        (its backward's copy, or the updated weights), in the window slot that stage -1 would
        have used, so the next forward starts with k+1 stages and a training step moves
        2L-2k-2 stages of weights in (the last k+1 stay on the device at the turn from forward to
        backward). The live set during a call stays at k+1 stages; between calls up to k
        (k+1 after a ``train_step``) stages' weights stay in device memory (``prefetched_stages``,
        ``release_prefetched()``). A carried stage is used only while ``host_params[i]`` is
        the same object it was copied from (replacing it invalidates the copy).

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
        array with values beyond 32 bits, with ``jax_enable_x64`` off); ``device``/``sharding``/``activation_sharding`` has the wrong type;
        ``prefetch_depth`` is not an int; a flag is not a bool; ``trace`` is not a
        ``TraceRecorder``; ``remat`` is neither a
        bool nor callable; ``optimizer`` is not an ``AdamW`` (or a sequence of them);
        ``trainable`` or ``group_of`` not callable.
      ValueError: ``prefetch_depth < 1``; ``stage_params`` is empty or not a sequence;
        the number of stage functions differs from the number of stages; with one shared
        ``stage_fn``, a stage's params differ from stage 0's in structure, shape or dtype
        (the message names the stage and leaf); both ``device`` and ``sharding`` are
        given; the device has no ``pinned_host`` memory; ``activation_sharding`` is
        needed but missing; ``resident`` has the wrong length; ``max_signatures < 1``;
        ``batch_axis`` is not an axis of ``activation_sharding``'s mesh; ``optimizer_state``
        given without ``optimizer``, or not one list of ``(m, v)`` pairs per stage of the
        trainable leaves' shapes and the optimizer's state dtype (the message names the stage);
        ``group_of`` returns no valid group index (the message names the stage and leaf);
        parameter groups with different ``state_dtype``.
    """

    def __init__(
        self,
        stage_fn: Callable | Sequence[Callable],
        stage_params: Sequence[Any],
        *,
        prefetch_depth: int = 1,
        device: jax.Device | None = None,
        sharding: Sharding | Callable | None = None,
        activation_sharding: Sharding | None = None,
        batch_axis: str | None = None,
        donate: bool = True,
        throttle: bool = True,
        track_residency: bool = True,
        trace: TraceRecorder | None = None,
        remat: bool | Callable = True,
        resident: Sequence[bool] | None = None,
        grads_to_host: bool = True,
        optimizer: AdamW | Sequence[AdamW] | None = None,
        optimizer_state_on_host: bool = True,
        optimizer_state: Sequence | None = None,
        trainable: Callable | None = None,
        group_of: Callable | None = None,
        max_signatures: int = DEFAULT_MAX_SIGNATURES,
        offload_activations: bool = False,
        prefetch_next_call: bool = True,
        own_params: bool = False,
    ):
        # ---- validation, no state change before all of it passed ----
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, (int, np.integer)):
            raise TypeError(f"prefetch_depth must be an int >= 1, got {type(prefetch_depth).__name__}")
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        for flag_name, flag in (("donate", donate), ("throttle", throttle),
                                ("track_residency", track_residency),
                                ("grads_to_host", grads_to_host),
                                ("optimizer_state_on_host", optimizer_state_on_host),
                                ("offload_activations", offload_activations),
                                ("prefetch_next_call", prefetch_next_call),
                                ("own_params", own_params)):
            if not isinstance(flag, bool):
                raise TypeError(f"{flag_name} must be a bool, got {type(flag).__name__}")
        if not (isinstance(remat, bool) or callable(remat)) or isinstance(remat, (type, types.BuiltinFunctionType)):
            raise TypeError(f"remat must be a bool or a jax.checkpoint_policies policy (a function), "
                            f"got {remat!r}")
        _check_trace(trace)
        groups = _optim.check_optimizer(optimizer)
        optimizer = groups[0] if groups else None
        if group_of is not None and not callable(group_of):
            raise TypeError(f"group_of must be a callable (stage_index, leaf_path) -> int, got {type(group_of).__name__}")
        if trainable is not None and not callable(trainable):
            raise TypeError(f"trainable must be a callable (stage_index, leaf_path) -> bool, "
                            f"got {type(trainable).__name__}")
        if isinstance(max_signatures, bool) or not isinstance(max_signatures, (int, np.integer)) or max_signatures < 1:
            raise ValueError(f"max_signatures must be an int >= 1, got {max_signatures!r}")
        if isinstance(stage_params, (str, bytes, dict)) or not isinstance(stage_params, Sequence):
            raise ValueError(f"stage_params must be a non-empty sequence (list/tuple) of per-stage pytrees, "
                             f"got {type(stage_params).__name__}")
        if len(stage_params) == 0:
            raise ValueError("stage_params is empty: need at least one stage")
        n = len(stage_params)
        fns, shared = _stage_fns(stage_fn, n)
        if resident is None:
            resident = [False] * n
        if isinstance(resident, (str, bytes)) or not isinstance(resident, Sequence) or len(resident) != n \
                or not all(isinstance(r, (bool, np.bool_)) for r in resident):
            raise ValueError(f"resident must be a sequence of {n} bools (one per stage), got {resident!r}")
        resident = [bool(r) for r in resident]

        flat = []  # per stage: (leaves_with_path, treedef)
        for i, p in enumerate(stage_params):
            lp, treedef = jax.tree_util.tree_flatten_with_path(p)
            for path, leaf in lp:
                _as_aval(leaf, f"stage_params[{i}]{_leaf_name(path)}")
            _check_input_dtypes(p, f"stage_params[{i}]")
            flat.append((lp, treedef))
        if shared:
            lp0, td0 = flat[0]
            for i in range(1, n):
                lp, td = flat[i]
                if td != td0:
                    raise ValueError(f"stage_params[{i}] has tree structure {td}, but stage_params[0] has {td0}; "
                                     "a shared stage_fn needs the same structure for every stage")
                for (path, leaf), (_, leaf0) in zip(lp, lp0):
                    if tuple(leaf.shape) != tuple(leaf0.shape) or np.dtype(leaf.dtype) != np.dtype(leaf0.dtype):
                        raise ValueError(
                            f"stage_params[{i}]{_leaf_name(path)} has shape {tuple(leaf.shape)} dtype "
                            f"{np.dtype(leaf.dtype)}, but stage_params[0]{_leaf_name(path)} has shape "
                            f"{tuple(leaf0.shape)} dtype {np.dtype(leaf0.dtype)}; a shared stage_fn needs "
                            "identical parameter shapes and dtypes in every stage")

        if device is not None and sharding is not None:
            raise ValueError("give either device or sharding, not both")
        if device is not None and not isinstance(device, jax.Device):
            raise TypeError(f"device must be a jax.Device, got {type(device).__name__}")
        if sharding is not None and not (isinstance(sharding, Sharding) or callable(sharding)):
            raise TypeError(f"sharding must be a jax.sharding.Sharding or a callable, got {type(sharding).__name__}")
        if batch_axis is not None and not isinstance(batch_axis, str):
            raise TypeError(f"batch_axis must be a mesh axis name (str) or None, got {type(batch_axis).__name__}")
        if activation_sharding is not None and not isinstance(activation_sharding, Sharding):
            raise TypeError(f"activation_sharding must be a jax.sharding.Sharding, "
                            f"got {type(activation_sharding).__name__}")
        if sharding is None:
            dev = device if device is not None else jax.devices()[0]
            _check_memory_kinds(dev, "the streaming runtime")
            base = SingleDeviceSharding(dev)

            def leaf_sharding(i, path, leaf):
                return base
        elif isinstance(sharding, Sharding):
            base = sharding
            for d in sharding.device_set:
                _check_memory_kinds(d, "the streaming runtime")

            def leaf_sharding(i, path, leaf):
                return base
        else:
            base = None
            leaf_sharding = sharding
        if activation_sharding is None:
            if isinstance(base, SingleDeviceSharding):
                activation_sharding = base
            elif isinstance(base, NamedSharding):
                activation_sharding = NamedSharding(base.mesh, PartitionSpec())
            else:
                raise ValueError("activation_sharding is required when sharding is a callable or a "
                                 f"{type(sharding).__name__}")
        act = activation_sharding.with_memory_kind(DEVICE_KIND)
        batch_sh = None
        if batch_axis is not None:
            if not isinstance(act, NamedSharding) or batch_axis not in act.mesh.shape:
                raise ValueError(f"batch_axis={batch_axis!r} needs a NamedSharding activation_sharding whose mesh has "
                                 f"that axis, got {activation_sharding}")
            batch_sh = NamedSharding(act.mesh, PartitionSpec(batch_axis), memory_kind=DEVICE_KIND)

        host_sh, dev_sh, train_mask, group_idx = [], [], [], []
        for i, (lp, treedef) in enumerate(flat):
            hs_, ds_, tm_, gi_ = [], [], [], []
            for path, leaf in lp:
                s = leaf_sharding(i, path, leaf)
                if not isinstance(s, Sharding):
                    raise TypeError(f"sharding({i}, {_leaf_name(path)}) returned {type(s).__name__}, "
                                    "not a jax.sharding.Sharding")
                try:
                    s.shard_shape(tuple(leaf.shape))
                except ValueError as e:
                    raise ValueError(f"stage_params[{i}]{_leaf_name(path)}: sharding {s} does not split shape "
                                     f"{tuple(leaf.shape)} evenly: {e}") from None
                hs_.append(s.with_memory_kind(DEVICE_KIND if resident[i] else HOST_KIND))
                ds_.append(s.with_memory_kind(DEVICE_KIND))
                tm_.append(_is_diff(leaf) and (trainable is None or bool(trainable(i, path))))
                if tm_[-1] and groups is not None:
                    gi = 0 if group_of is None else group_of(i, path)
                    if isinstance(gi, bool) or not isinstance(gi, (int, np.integer)) or not 0 <= gi < len(groups):
                        raise ValueError(f"group_of({i}, {_leaf_name(path)}) returned {gi!r}, not a group index in "
                                         f"[0, {len(groups)})")
                    gi_.append(int(gi))
            host_sh.append(jax.tree_util.tree_unflatten(treedef, hs_))
            dev_sh.append(jax.tree_util.tree_unflatten(treedef, ds_))
            train_mask.append(tm_)
            group_idx.append(tuple(gi_))

        # ---- state ----
        self.num_stages: int = n
        self.prefetch_depth: int = int(prefetch_depth)
        self.donate = donate
        self.throttle = throttle
        self.track_residency = track_residency
        self.trace = trace
        self.remat = remat
        self.resident: tuple[bool, ...] = tuple(resident)
        self.grads_to_host = grads_to_host
        #: the configuration of parameter group 0 (its ``state_dtype`` is every group's), or ``None``.
        self.optimizer: AdamW | None = optimizer
        #: one ``AdamW`` per parameter group, read at every ``train_step`` (assign new ones between
        #: steps: a schedule); ``None`` without an optimizer.
        self.param_groups: list[AdamW] | None = groups
        #: per stage, the parameter group of each trainable leaf (in leaf order).
        self.group_idx: list[tuple[int, ...]] = group_idx
        self.optimizer_state_on_host = optimizer_state_on_host
        self.max_signatures = int(max_signatures)
        self.offload_activations = offload_activations
        self.prefetch_next_call = prefetch_next_call
        # stage -> (host_params[stage] it was copied from, device copy): the next call's first stages
        self._carry: dict[int, tuple[Any, Any]] = {}
        #: bytes of stage inputs and saved residuals the last ``train_step`` sent to ``pinned_host``.
        self.offloaded_activation_nbytes: int = 0
        self.activation_sharding: Sharding = act
        #: the mesh axis activations are split over (data parallelism), or ``None``.
        self.batch_axis: str | None = batch_axis
        self._batch_sh = batch_sh
        self._fns = fns  # the caller's stage functions
        self._traced_fns = _own_fns(fns)  # what this runtime traces and compiles (see _own_fns)
        self._fn_ids: list[int] = []
        uniq: list[Callable] = []
        for f in fns:  # dedupe by identity
            for j, u in enumerate(uniq):
                if u is f:
                    self._fn_ids.append(j)
                    break
            else:
                uniq.append(f)
                self._fn_ids.append(len(uniq) - 1)
        self._host_sh = host_sh
        self._dev_sh = dev_sh
        self._train_mask = train_mask
        #: per-stage pytrees of ``pinned_host`` arrays (device memory for ``resident`` stages):
        #: the weights. With ``optimizer``, replaced by the updated weights after each step.
        self.host_params: list = [jax.device_put(p, s, may_alias=None if own_params
                                                 else (False if (optimizer or r) else None))
                                  for p, s, r in zip(stage_params, host_sh, resident)]
        self._param_avals = [jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), p)
                             for p in self.host_params]
        # per stage: shardings of the differentiable leaves (the gradients), as lists
        gk = HOST_KIND if grads_to_host else DEVICE_KIND
        self._diff_dev_sh, self._diff_grad_sh = [], []
        #: per stage, the optimizer state: a list of ``(m, v)`` pairs, one per trainable leaf,
        #: in ``pinned_host`` (or device memory); empty lists without an optimizer.
        self.optimizer_state: list = []
        self._state_dev_sh, self._state_host_sh = [], []
        self._acc_dev_sh, self._acc_host_sh = [], []
        if optimizer_state is not None and (optimizer is None or isinstance(optimizer_state, (str, bytes))
                                            or not isinstance(optimizer_state, Sequence)
                                            or len(optimizer_state) != n):
            raise ValueError(f"optimizer_state must be None or, with an optimizer, one list of (m, v) pairs per "
                             f"stage ({n} stages), got {type(optimizer_state).__name__}"
                             + ("" if optimizer is not None else " without an optimizer"))
        states = []
        for i in range(n):
            leaves = jax.tree_util.tree_leaves(self._param_avals[i])
            ds = jax.tree_util.tree_leaves(dev_sh[i])
            diff = [s_ for s_, a in zip(ds, leaves) if _is_diff(a)]
            self._diff_dev_sh.append(diff)
            self._diff_grad_sh.append([s_.with_memory_kind(gk) for s_ in diff])
            sel = [j for j, m in enumerate(train_mask[i]) if m] if optimizer is not None else []
            on_host = optimizer_state_on_host and not resident[i]
            self._state_dev_sh.append([(ds[j], ds[j]) for j in sel])
            self._acc_dev_sh.append([ds[j] for j in sel])
            self._acc_host_sh.append([ds[j].with_memory_kind(HOST_KIND if grads_to_host and not resident[i]
                                                             else DEVICE_KIND) for j in sel])
            self._state_host_sh.append([(ds[j].with_memory_kind(HOST_KIND if on_host else DEVICE_KIND),) * 2
                                        for j in sel])
            if optimizer is not None:
                if optimizer_state is None:
                    states.append(_optim.init_state(optimizer, [leaves[j] for j in sel]))
                else:
                    states.append(_checked_state(optimizer, optimizer_state[i], [leaves[j] for j in sel], i))
        # copies (may_alias=False): a given state stays its owner's
        self.optimizer_state = [jax.device_put(st, sh, may_alias=False if optimizer_state is not None else None)
                                for st, sh in zip(states, self._state_host_sh)]
        #: number of optimizer steps applied so far.
        self.step: int = 0
        self._groups0 = list(groups) if groups else []
        #: with ``optimizer``: the gradients summed over the micro-batches since the last update
        #: (``train_step(accumulate=True)``): per stage a list, one array per trainable leaf, in
        #: ``pinned_host`` (``grads_to_host``, streamed stages) or device memory; ``None`` when empty.
        self.grad_acc: list | None = None
        #: micro-batches summed in ``grad_acc``.
        self.micro_batches: int = 0
        #: the global gradient norm of the last update that computed one (``max_grad_norm`` or
        #: ``skip_nonfinite``; a float, possibly inf/nan), else ``None``.
        self.last_grad_norm: float | None = None
        #: whether the last update was skipped for a non-finite gradient (``skip_nonfinite``).
        self.last_step_skipped: bool = False
        self._update_exes: dict = {}
        self._sumsq: list | None = None  # per stage, the last accumulating backward's sum of squares
        #: bytes of each stage's weights (logical sizes), and their sum.
        self.stage_nbytes: list[int] = [tree_nbytes(p) for p in self.host_params]
        self.weight_nbytes: int = sum(self.stage_nbytes)
        #: bytes of each stage's optimizer state (logical sizes).
        self.optimizer_state_nbytes: list[int] = [tree_nbytes(s) for s in self.optimizer_state] or [0] * n
        self._sigs: collections.OrderedDict = collections.OrderedDict()  # input key -> _Signature
        self._last_sig: _Signature | None = None
        #: bytes of the residuals each stage keeps from its forward for its backward in
        #: ``train_step`` beyond its input (0 with ``remat=True``); set by each training call.
        self.residual_nbytes: list[int] = [0] * n
        self._loss_jits: collections.OrderedDict = collections.OrderedDict()
        self._loss_shapes: dict = {}
        self._tracked: dict[int, tuple[weakref.ref, int]] = {}
        #: highest number of stages with live device buffers seen at any step since the
        #: last ``reset_stats()`` (only with ``track_residency``).
        self.max_resident_stages: int = 0
        #: ``[(pass_name, stage, resident_stages), ...]`` of the last call.
        self.residency_trace: list[tuple[str, int, int]] = []

    @classmethod
    def from_policy(cls, stage_fn, stage_params, policy: OffloadPolicy, *, optimizer: AdamW | None = None,
                    **kwargs) -> "StreamingRuntime":
        """A runtime that applies ``policy`` (the planner's ``Plan.policy`` or one written by hand).

        The policy's fields map as follows: ``params="host"`` streams every stage,
        ``"device"`` keeps every stage resident; ``grads`` -> ``grads_to_host``;
        ``optimizer_state`` -> ``optimizer_state_on_host``; ``prefetch_depth``;
        ``remat`` and ``activations``: ``remat=True`` recomputes each stage in the
        backward, keeping the activations named ``"device"`` in ``policy.activations``
        (``jax.ad_checkpoint.checkpoint_name``) through
        ``jax.checkpoint_policies.save_only_these_names``; ``remat=False`` keeps every
        residual.

        Args:
          stage_fn, stage_params: as for the constructor.
          policy: an ``xla_swap.planning.OffloadPolicy``.
          optimizer: an ``xla_swap.planning.AdamW`` or ``None``.
          **kwargs: the other constructor arguments (``device``, ``sharding``, ...); those
            the policy decides may not be given.

        Raises:
          TypeError: ``policy`` is not an ``OffloadPolicy``.
          ValueError: ``policy.activations`` offloads names to the host (kept in device
            memory by this runtime: not supported here); a keyword the policy decides is
            also given; the constructor's errors.
        """
        if not isinstance(policy, OffloadPolicy):
            raise TypeError(f"policy must be an xla_swap.planning.OffloadPolicy, got {type(policy).__name__}")
        decided = {"prefetch_depth", "resident", "grads_to_host", "optimizer_state_on_host", "remat"}
        clash = sorted(decided & set(kwargs))
        if clash:
            raise ValueError(f"{', '.join(clash)}: decided by the policy; change the policy instead")
        try:
            n = len(stage_params)
        except TypeError:
            n = None
        resident = None if n is None or policy.params == "host" else [True] * n
        return cls(stage_fn, stage_params, prefetch_depth=policy.prefetch_depth, resident=resident,
                   grads_to_host=policy.grads == "host", optimizer=optimizer,
                   optimizer_state_on_host=policy.optimizer_state == "host", remat=_remat_from_policy(policy),
                   **kwargs)

    # ------------------------------------------------------------------ public API
    @property
    def num_executables(self) -> int:
        """Number of distinct stage executables compiled and cached now (forward and backward, all signatures)."""
        return sum(len(s.compiled) for s in self._sigs.values())

    @property
    def num_signatures(self) -> int:
        """Number of input signatures whose executables are cached (at most ``max_signatures``)."""
        return len(self._sigs)

    def clear_executables(self) -> None:
        """Drop every compiled executable and traced loss function; the next call traces and compiles again.

        For a change of a setting read at trace time (``jax.default_matmul_precision``, say)
        that the executables' cache keys do not hold. Weights, optimizer state and the
        weights prefetched for the next call are kept.
        """
        self._sigs.clear()
        self._last_sig = None
        self._loss_jits.clear()
        self._loss_shapes.clear()
        self._update_exes.clear()

    @property
    def prefetched_stages(self) -> list[int]:
        """Stages whose weights are held in device memory for the next call (``prefetch_next_call``), sorted."""
        return sorted(self._carry)

    def schedule(self, training: bool = False, *, steady_state: bool = True) -> PrefetchSchedule:
        """This runtime's weight schedule for one call, with its predicted live set per step.

        Args:
          training: ``False`` for ``forward``, ``True`` for ``train_step``.
          steady_state: the call follows one of the same kind (it starts with the stages that
            call left in device memory, ``prefetch_next_call``); ``False``: a cold call (the
            first, or after ``release_prefetched()``).

        Returns: an ``xla_swap.planning.PrefetchSchedule`` over ``num_stages``, ``prefetch_depth``,
          ``resident`` and ``prefetch_next_call``: which stage's weights are copied at which step,
          and the stages live at each step. With ``track_residency`` the runtime's
          ``residency_trace`` of such a call equals ``[(s.pass_name, s.stage, len(s.live)) for s in
          schedule.steps]`` and ``max_resident_stages`` its ``max_live_stages``.

        Raises: TypeError: a flag is not a bool.
        """
        return PrefetchSchedule(self.num_stages, self.prefetch_depth, training=training, resident=self.resident,
                                prefetch_next_call=self.prefetch_next_call, steady_state=steady_state)

    def release_prefetched(self) -> None:
        """Drop the weights held in device memory for the next call (frees up to k stages' weights;
        the next call then streams its first stages again)."""
        self._carry = {}

    def trainable_paths(self, stage: int) -> list[str]:
        """The key paths (``jax.tree_util.keystr``, e.g. ``"['w']"``) of ``stage``'s trainable leaves,
        in the order of ``optimizer_state[stage]`` (and of ``grad_acc[stage]``).

        Raises: ValueError: ``stage`` is not an int in ``[0, num_stages)``.
        """
        self._check_stage(stage)
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(self._param_avals[stage])[0]]
        return [p for p, m in zip(paths, self._train_mask[stage]) if m]

    def load_stage(self, stage: int, params=None, state: Sequence | None = None) -> None:
        """Replace ``stage``'s weights and/or optimizer state by copies of the given arrays, placed
        where the current ones are (same shardings and memory kinds: ``pinned_host``, or device
        memory for a resident stage). The stage's weights held in device memory for the next call
        are dropped.

        Args:
          stage: the stage index.
          params: ``None`` (weights unchanged) or a pytree of ``host_params[stage]``'s structure
            whose leaves (numpy or jax arrays) have its shapes and dtypes.
          state: ``None`` (moments unchanged) or, with an optimizer, a list of ``(m, v)`` pairs as
            ``optimizer_state[stage]`` holds them (one per trainable leaf, ``trainable_paths``
            order; the leaf's shape, the optimizer's state dtype).

        Raises (before anything changes): ValueError: a bad ``stage``; ``params`` of another
          structure, or a leaf of another shape or dtype (the message names the leaf); ``state``
          as the constructor's ``optimizer_state`` refuses it, or given without an optimizer; the
          runtime holds accumulated gradients (``grad_acc``: update first).
        """
        self._check_stage(stage)
        if self.grad_acc is not None:
            raise ValueError(f"the runtime holds the gradients of {self.micro_batches} accumulated micro-batches; "
                             "load after the update (train_step with accumulate=False)")
        if params is not None:
            lp, td = jax.tree_util.tree_flatten_with_path(params)
            ref_lp, ref_td = jax.tree_util.tree_flatten_with_path(self._param_avals[stage])
            if td != ref_td:
                raise ValueError(f"params for stage {stage} have tree structure {td}, the stage has {ref_td}")
            for (path, leaf), (_, a) in zip(lp, ref_lp):
                shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
                if shape != tuple(a.shape) or dtype is None or np.dtype(dtype) != np.dtype(a.dtype):
                    raise ValueError(f"stage_params[{stage}]{_leaf_name(path)}: got shape {shape} dtype {dtype}, "
                                     f"the stage holds shape {tuple(a.shape)} dtype {np.dtype(a.dtype)}")
        if state is not None:
            if self.optimizer is None:
                raise ValueError("state given to a runtime without an optimizer")
            leaves = jax.tree_util.tree_leaves(self._param_avals[stage])
            sel = [leaves[j] for j, m in enumerate(self._train_mask[stage]) if m]
            state = _checked_state(self.optimizer, state, sel, stage)
        self._carry.pop(stage, None)
        if params is not None:
            self.host_params[stage] = jax.device_put(params, self._host_sh[stage], may_alias=False)
        if state is not None:
            self.optimizer_state[stage] = jax.device_put(state, self._state_host_sh[stage], may_alias=False)

    def _check_stage(self, stage) -> None:
        if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) or not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be an int in [0, {self.num_stages}), got {stage!r}")

    def reset_stats(self) -> None:
        """Reset ``max_resident_stages`` and ``residency_trace``."""
        self.max_resident_stages = 0
        self.residency_trace = []

    def resident_stages(self) -> int:
        """Number of distinct stages that have runtime-created device buffers alive right now.

        Counts ``jax.live_arrays()`` of memory kind ``device`` that this runtime created
        (streamed weights, device-side parameter gradients), grouped by stage. Deleted
        (donated) arrays are not live. Stages in ``resident`` are not counted.

        Returns:
          int, 0..num_stages.
        """
        tracked = self._tracked
        if not tracked:
            return 0
        stages = set()
        for arr in jax.live_arrays():
            entry = tracked.get(id(arr))
            if entry is not None and entry[0]() is arr and arr.sharding.memory_kind == DEVICE_KIND:
                stages.add(entry[1])
        for key in [k for k, (r, _) in tracked.items() if r() is None]:
            del tracked[key]
        return len(stages)

    def memory_report(self, training: bool = False) -> MemoryReport:
        """Device and host memory of this runtime, per device: compiled, predicted by the schedule, measured.

        Args:
          training: predict for ``train_step`` (``True``) or ``forward`` (``False``).

        Returns: :class:`xla_swap.executors.MemoryReport` with ``executor="streaming"``: the compiled
          figures are, per field, the largest over the stage executables cached now (one stage's
          call; ``split_source="none"`` and zeros before any is compiled);
          ``predicted_live_stages`` / ``predicted_live_weight_bytes`` from ``schedule(training)``
          over the stages' per-device weight bytes; ``resident_weight_bytes`` and
          ``host_weight_bytes`` (weights plus optimizer state, per device, from the arrays);
          ``measured_live_stages`` = ``max_resident_stages`` with ``track_residency``, else ``None``.

        Raises: TypeError: ``training`` is not a bool.
        """
        sched = self.schedule(training)
        n = self.num_stages
        weights = [_device_nbytes(p) for p in self.host_params]
        state = [_device_nbytes(s) for s in self.optimizer_state] or [0] * n
        resident = sum(weights[i] + state[i] for i in range(n) if self.resident[i])
        host = sum(weights[i] + (state[i] if self.optimizer_state_on_host else 0)
                   for i in range(n) if not self.resident[i])
        extra = dict(predicted_live_stages=sched.max_live_stages,
                     predicted_live_weight_bytes=sched.peak_live_bytes(weights),
                     resident_weight_bytes=resident, host_weight_bytes=host,
                     measured_live_stages=self.max_resident_stages if self.track_residency else None)
        stats = [stats_dict(_memory_analysis(exe)) for sig in self._sigs.values() for exe in sig.compiled.values()]
        num_devices = len(self.activation_sharding.device_set)
        if not stats:
            return MemoryReport("streaming", num_devices, split_source="none", **extra)
        largest = {key: max(s.get(key, 0) for s in stats) for key in set().union(*stats)}
        return compiled_report("streaming", num_devices, largest, [], [], **extra)

    def executable_memory(self) -> list[dict]:
        """Compiled memory analysis of every executable cached now.

        Returns:
          list of dicts ``{"kind": "forward"|"backward"|..., "stages": [int], "argument_bytes",
          "output_bytes", "alias_bytes", "temp_bytes"}`` (bytes, device memory, per call of
          the executable; ``None`` where the backend reports nothing).
        """
        out = []
        for sig in self._sigs.values():
            for key, exe in sig.compiled.items():
                stages = [i for (k, i), e in sig.stage_exe.items() if e is exe and k == key[1]]
                m = _memory_analysis(exe)
                get = (lambda a: getattr(m, a, None)) if m is not None else (lambda a: None)
                out.append({"kind": key[1], "stages": stages,
                            "argument_bytes": get("argument_size_in_bytes"),
                            "output_bytes": get("output_size_in_bytes"),
                            "alias_bytes": get("alias_size_in_bytes"),
                            "temp_bytes": get("temp_size_in_bytes")})
        return out

    def executable_hlo(self) -> list[tuple[str, str]]:
        """``(kind, HLO text)`` of every executable cached now (``kind`` as in :meth:`executable_memory`).

        The optimized HLO module (``Compiled.as_text()``), for checks of what was compiled:
        the precision of the contractions, the memory kinds, the collectives.
        """
        return [(key[1], exe.as_text()) for sig in self._sigs.values() for key, exe in sig.compiled.items()]

    def stage_input_nbytes(self) -> list[int]:
        """Bytes of each stage's input activation (the carry), for the last call's input signature.

        ``train_step`` keeps every stage's input on the device until that stage's backward,
        so their sum is the kept-activation part of its device memory.

        Returns: list of ``num_stages`` ints (bytes). Raises: ``RuntimeError`` before the
        first ``forward``/``train_step``/``output_aval`` (the shapes are not known yet).
        """
        if self._last_sig is None:
            raise RuntimeError("stage_input_nbytes: call forward, train_step or output_aval first")
        return [tree_nbytes(a) for a in self._last_sig.chain[:-1]]

    def output_aval(self, h):
        """Shape and dtype of ``forward(h)`` without running anything (traces on first use of a signature).

        Returns: a ``jax.ShapeDtypeStruct`` (or a pytree of them for a pytree carry).

        Raises: as ``forward``.
        """
        return self._signature(h).chain[-1]

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
        _check_trace(trace)
        return self._run(h, train=False, trace=trace)[0]

    __call__ = forward

    def train_step(self, h, loss_fn: Callable | None = None, *, cotangent=None, loss_args: tuple = (),
                   lr: float | None = None, trace: TraceRecorder | None = None, accumulate: bool = False,
                   max_grad_norm: float | None = None, skip_nonfinite: bool = False):
        """Forward and backward pass; each stage's parameter gradients go to ``pinned_host``
        (or, with ``optimizer``, each stage is updated right after its backward).

        The forward keeps every stage's input on the device (L activations) and the last
        ``prefetch_depth + 1`` stages' weights (the backward starts with them). The backward
        runs one ``jax.vjp`` executable per stage in reverse (it recomputes the stage's
        forward: per-stage rematerialisation; see ``remat`` for keeping residuals instead)
        with the same k-deep prefetch. Weight traffic per step: 2L-2k-2 stages in in a loop
        (the last k+1 stay on the device from the forward to the backward; with
        ``prefetch_next_call`` the call starts with stages 0..k, the backward keeps them for the
        next call; 2L-k-1 in a cold call), and L
        stages of gradients out (or, with ``optimizer``, L stages of weights and moments out
        and the moments in). Gradients are taken w.r.t. the floating leaves of the
        parameters and of ``h``; integer and bool leaves are constants.

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
            leaf of every stage (``torch.nn.utils.clip_grad_norm_``).
          skip_nonfinite: with ``optimizer``, at an update: when that norm is not finite, skip the
            update (weights, moments and ``step`` unchanged; the accumulated gradients dropped), as
            torch's ``GradScaler`` skips ``optimizer.step()``; ``last_step_skipped`` says so.
            With either of the two the update needs every gradient first, so it is not fused
            into the backward: the backward sends each stage's gradients to ``grad_acc`` and a
            third pass streams weights, gradients and moments in and weights and moments out
            (beyond the fused step: the gradients out and in, one more pass of the weights in,
            and one host sync for the norm, ``last_grad_norm``).

        Returns:
          ``(loss_or_output, input_cotangent, grads)``: the scalar loss (``loss_fn`` given)
          or the forward output (``cotangent`` given), as device arrays; the cotangent of
          ``h`` (device, shaped like ``h``, ``None`` at integer leaves); a list of
          ``num_stages`` pytrees shaped like ``stage_params[i]`` (``None`` at integer
          leaves) in ``pinned_host`` (``grads_to_host``) or device memory, or ``None`` with
          ``optimizer`` (the update is applied: ``host_params`` and ``optimizer_state``
          hold the new values, ``step`` is incremented). All asynchronous.

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
        if (loss_fn is None) == (cotangent is None):
            raise ValueError("train_step needs exactly one of loss_fn and cotangent")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not isinstance(loss_args, tuple):
            raise TypeError(f"loss_args must be a tuple, got {type(loss_args).__name__}")
        _check_trace(trace)
        for flag_name, flag in (("accumulate", accumulate), ("skip_nonfinite", skip_nonfinite)):
            if not isinstance(flag, bool):
                raise TypeError(f"{flag_name} must be a bool, got {type(flag).__name__}")
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float, np.floating, np.integer)) \
                    or not np.isfinite(max_grad_norm) or max_grad_norm <= 0:
                raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}")
        hyper = None
        if self.optimizer is not None:
            hyper = _optim.hyper_rows(self._checked_groups(), self.step + 1, lr)  # ValueError for a bad lr
        elif lr is not None:
            raise ValueError("lr is only used with an optimizer; this runtime has none")
        elif accumulate or max_grad_norm is not None or skip_nonfinite:
            raise ValueError("accumulate, max_grad_norm and skip_nonfinite need an optimizer; without one the "
                             "gradients are returned (add or clip them yourself)")
        if cotangent is not None:   # checked before h's signature is traced and cached
            _tree_aval(cotangent, "cotangent")
            _check_input_dtypes(cotangent, "cotangent")
        for j, a in enumerate(loss_args):
            _tree_aval(a, f"loss_args[{j}]")
            _check_input_dtypes(a, f"loss_args[{j}]")
        sig = self._signature(h)
        if not any(_split_diff(a)[0] for a in self._param_avals):
            raise TypeError("train_step: no stage has a floating parameter; nothing to differentiate")
        out_aval = sig.chain[-1]
        out_diff = _split_diff(out_aval)[0]
        if not out_diff:
            raise TypeError(f"train_step: the output ({_describe(out_aval)}) has no floating leaf; "
                            "gradients need a floating output")
        if cotangent is not None:
            c = _tree_aval(cotangent, "cotangent")
            if _aval_key(c) != _aval_key(out_diff) and _aval_key(c) != _aval_key(out_aval):
                raise ValueError(f"cotangent has {_describe(c)}, but the output has {_describe(out_aval)}")
            loss_exe = None
        else:
            loss_exe = self._loss_exe(loss_fn, out_aval, loss_args)
        if self.optimizer is None:
            mode = None
        elif accumulate or max_grad_norm is not None or skip_nonfinite:
            mode = "accum"
        else:
            mode = "update"
        two_pass = mode == "accum" and not accumulate
        if two_pass:  # compile the update pass before anything moves
            self._update_exe_list()
        out = self._run(h, train=True, loss_exe=loss_exe, cotangent=cotangent, loss_args=loss_args,
                        hyper=hyper if mode == "update" else None, trace=trace, mode=mode)
        if mode == "update":
            self.last_grad_norm, self.last_step_skipped = None, False
        if two_pass:
            sumsq = jax.device_get(self._sumsq)
            self._sumsq = None
            norm = float(np.sqrt(np.sum(np.asarray(sumsq, np.float64))))
            self.last_grad_norm = norm
            self.last_step_skipped = bool(skip_nonfinite and not np.isfinite(norm))
            if self.last_step_skipped:
                self.grad_acc, self.micro_batches = None, 0
            else:
                coef = np.float32(1.0)
                if max_grad_norm is not None:  # clip_grad_norm_'s float32 arithmetic
                    coef = np.minimum(np.float32(max_grad_norm) / (np.float32(norm) + np.float32(1e-6)),
                                      np.float32(1.0))
                self._update_pass(hyper, coef, None)  # not traced: a recorder covers one pass pair
        return out

    # ------------------------------------------------------------------ internals
    def _checked_groups(self) -> list[AdamW]:
        """``param_groups``, checked against what the executables were built for (count, state dtype)."""
        groups = self.param_groups
        if not isinstance(groups, (list, tuple)) or len(groups) != len(self._groups0) or \
                not all(isinstance(g, AdamW) and g.state_dtype == self.optimizer.state_dtype for g in groups):
            raise ValueError(f"param_groups must stay a list of {len(self._groups0)} xla_swap.planning.AdamW with "
                             f"state_dtype={self.optimizer.state_dtype!r}, got {groups!r}")
        return list(groups)

    def _signature(self, h, what: str = "h") -> _Signature:
        """The cached signature of ``h`` (LRU), or a new one traced stage by stage (no state change on error).

        ``what`` names ``h`` in error messages (``SwappedStack`` passes ``"inputs"``).
        """
        a = _tree_aval(h, what)
        _check_input_dtypes(h, what)
        key = _aval_key(a)
        sig = self._sigs.get(key)
        if sig is not None:
            self._sigs.move_to_end(key)
            self._last_sig = sig
            return sig
        chain = [a]
        for i, (f, pav) in enumerate(zip(self._traced_fns, self._param_avals)):
            try:
                out = jax.eval_shape(f, pav, chain[-1])
            except Exception as e:  # noqa: BLE001 - re-raised with the stage named
                raise ValueError(f"stage {i}: stage_fn(params, h) failed to trace for h of {_describe(chain[-1])}: "
                                 f"{type(e).__name__}: {e}") from e
            leaves = jax.tree_util.tree_leaves(out)
            if not leaves or not all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
                raise TypeError(f"stage {i}: stage_fn must return an array or a pytree of arrays, "
                                f"got {jax.tree_util.tree_structure(out)}")
            chain.append(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out))
            _check_carry_dtypes(self._fns, self._param_avals, i, chain[-2], chain[-1], what)
        sig = _Signature(a, chain)
        self._sigs[key] = sig
        while len(self._sigs) > self.max_signatures:
            self._sigs.popitem(last=False)
        self._last_sig = sig
        return sig

    def _spec(self, aval, sharding):
        """``ShapeDtypeStruct`` (pytree) of ``aval`` with ``sharding`` (one, or a pytree like ``aval``) on its leaves."""
        if isinstance(sharding, Sharding):
            return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), aval)
        return jax.tree_util.tree_map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), aval, sharding)

    def _act(self, aval):
        """The device sharding of an activation ``aval`` (pytree): ``activation_sharding``, or with
        ``batch_axis`` a pytree with the batch sharding on leaves whose leading dim splits evenly."""
        if self._batch_sh is None:
            return self.activation_sharding
        n = self._batch_sh.mesh.shape[self.batch_axis]
        return jax.tree_util.tree_map(
            lambda a: self._batch_sh if len(a.shape) and a.shape[0] % n == 0 else self.activation_sharding, aval)

    def _act_host(self, aval):
        sh = self._act(aval)
        if isinstance(sh, Sharding):
            return sh.with_memory_kind(HOST_KIND)
        return jax.tree_util.tree_map(lambda s: s.with_memory_kind(HOST_KIND), sh)

    def _exe(self, sig: _Signature, kind: str, i: int, donate: bool, mode: str | None = None, acc: bool = False):
        """Stage ``i``'s executable of ``kind`` (``forward``, ``forward-save``, ``backward``,
        ``backward-saved``); for a backward, ``mode`` is ``None`` (gradients out), ``"update"``
        (the optimizer fused in) or ``"accum"`` (gradients summed into the accumulator, and their
        sum of squares), and ``acc`` whether it takes the accumulated gradients."""
        if mode is None and self.optimizer is not None and kind.startswith("backward"):
            mode = "update"
        kind = kind + ("-accum" if mode == "accum" else "") + ("+acc" if acc else "")
        key_stage = (kind + ("-donate" if donate else ""), i)
        exe = sig.stage_exe.get(key_stage)
        if exe is not None:
            return exe
        f = self._traced_fns[i]
        pkey = (jax.tree_util.tree_structure(self._param_avals[i]),
                tuple((a.shape, str(a.dtype), s) for a, s in zip(jax.tree_util.tree_leaves(self._param_avals[i]),
                                                                   jax.tree_util.tree_leaves(self._dev_sh[i]))),
                tuple(self._train_mask[i]), self.group_idx[i])
        hin, hout = sig.chain[i], sig.chain[i + 1]
        base = (self._fn_ids[i], pkey, _aval_key(hin), _aval_key(hout))
        key = (base[0], key_stage[0]) + base[1:]
        exe = sig.compiled.get(key)
        if exe is None:
            act = self.activation_sharding
            pspec = jax.tree_util.tree_map(self._spec, self._param_avals[i], self._dev_sh[i])
            hspec = self._spec(hin, self._act(hin))
            gout = _split_diff(hout)[0]
            gspec = self._spec(gout, self._act(gout))
            gin_sh = self._act(_split_diff(hin)[0])  # the input cotangent's
            # the output cotangent may reuse the input cotangent's buffer (same avals)
            same = _aval_key(_split_diff(hin)[0]) == _aval_key(_split_diff(hout)[0])
            opt = self.optimizer
            if kind == "forward":
                exe = jax.jit(f, out_shardings=self._act(hout)).lower(pspec, hspec).compile()
            elif kind == "forward-save":
                exe = self._compile_forward_save(sig, f, base, pspec, hspec, self._act(hout))
            else:
                saved = kind.startswith("backward-saved")
                if saved:
                    fwd_save = self._exe(sig, "forward-save", i, False)
                    core = _saved_vjp(*sig.saved_layout[base])
                    sspec = jax.tree_util.tree_map(
                        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        fwd_save.out_info[1], fwd_save.output_shardings[1])
                    specs = (pspec, hspec, sspec, gspec)
                else:
                    core = _recompute_vjp(f)
                    specs = (pspec, hspec, gspec)
                g_arg = len(specs) - 1
                if opt is None:
                    fn = core
                    donate_argnums = ((0, g_arg) if same else (0,)) if donate else ()
                    out_sh = (gin_sh, self._diff_dev_sh[i])
                else:
                    base_donate = ((0, g_arg) if same else (0,))
                    if acc:
                        sel = [j for j, m in enumerate(self._train_mask[i]) if m]
                        leaves = jax.tree_util.tree_leaves(self._param_avals[i])
                        specs = specs + ([jax.ShapeDtypeStruct(leaves[j].shape, leaves[j].dtype, sharding=sh)
                                          for j, sh in zip(sel, self._acc_dev_sh[i])],)
                        if mode == "accum":  # the sum reuses the accumulator's buffer (not the weights')
                            base_donate = tuple(a for a in base_donate if a != 0) + (len(specs) - 1,)
                    if mode == "accum":
                        fn = _with_accum(core, self._train_mask[i], acc)
                        out_sh = (gin_sh, self._acc_dev_sh[i], act)
                    else:
                        fn = _with_update(core, self._train_mask[i], self.group_idx[i], acc)
                        st_spec = jax.tree_util.tree_map(
                            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                            self.optimizer_state[i], self._state_dev_sh[i])
                        specs = specs + (st_spec, jax.ShapeDtypeStruct((len(self._groups0), HYPER_WIDTH), np.float32,
                                                                       sharding=act))
                        base_donate += (len(specs) - 2,)
                        out_sh = (gin_sh, self._dev_sh[i], self._state_dev_sh[i])
                    donate_argnums = base_donate if donate else ()
                exe = jax.jit(fn, out_shardings=out_sh, donate_argnums=donate_argnums).lower(*specs).compile()
            sig.compiled[key] = exe
        sig.stage_exe[key_stage] = exe
        return exe

    def _compile_forward_save(self, sig, f, base, pspec, hspec, out_sh):
        """Compile ``(p, x) -> (y, saved)``: the stage's output and its vjp residuals minus ``p`` and ``x``.

        ``jax.vjp`` returns its residuals as the leaves of the vjp function (a pytree); while
        tracing, residuals that *are* the traced weights or stage input (identity) are
        recorded as such in ``sig.saved_layout[base]`` and not returned, so the weights
        are not kept on the device between the passes.
        """
        box = {}
        fwd_save = _forward_save_fn(f, self.remat, box)
        try:
            exe = jax.jit(fwd_save, out_shardings=(out_sh, None)).lower(pspec, hspec).compile()
        except ValueError as e:
            # The partitioner may pick a residual sharding that jax cannot express over the mesh
            # (IndivisibleError, seen for a [1, 4, 1, 2] attention residual over 8 devices): keep
            # those residuals in the activation sharding instead.
            if "divisible" not in str(e):
                raise
            exe = jax.jit(fwd_save, out_shardings=(out_sh, self.activation_sharding)
                          ).lower(pspec, hspec).compile()
        sig.saved_layout[base] = box["layout"]
        return exe

    def layer_cost(self, h, stage: int, *, measure_reps: int = 0, flops_per_s: float | None = None):
        """A planner ``LayerCost`` for one stage, derived from its compiled executables (and, optionally, timed).

        Args:
          h: an input of the stack (its signature fixes the shapes).
          stage: the stage index.
          measure_reps: > 0 times the stage's forward that many times on the device (weights
            copied there first; median, seconds) as ``forward_s``.
          flops_per_s: instead of ``measure_reps``: the achieved FLOP/s to divide the compiled
            forward's FLOPs (XLA's cost analysis) by. Exactly one of the two.

        Returns: ``xla_swap.planning.LayerCost`` with ``param_bytes`` (the stage's weights),
          ``grad_bytes`` (its floating leaves), ``optimizer_bytes`` (this runtime's optimizer
          state of the stage, 0 without one), ``carry_bytes`` (the stage input),
          ``intermediate_bytes`` (the residuals ``jax.vjp`` keeps beyond weights and input,
          with ``remat`` other than ``True``: what ``remat=False`` would save),
          ``working_bytes`` (the compiled backward's temporaries), and ``forward_s`` or ``flops``.

        Raises: ValueError: ``stage`` out of range; neither or both of ``measure_reps`` and
          ``flops_per_s``; the backend reports no FLOPs; the checks of ``forward``.
        """
        from xla_swap.planning import LayerCost
        if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) or not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be an int in [0, {self.num_stages}), got {stage!r}")
        if isinstance(measure_reps, bool) or not isinstance(measure_reps, int) or measure_reps < 0:
            raise ValueError(f"measure_reps must be an int >= 0, got {measure_reps!r}")
        if (measure_reps > 0) == (flops_per_s is not None):
            raise ValueError("layer_cost needs exactly one of measure_reps > 0 (time the stage) and flops_per_s")
        sig = self._signature(h)
        hin = sig.chain[stage]
        fwd = self._exe(sig, "forward", stage, False)
        kw = self._stage_cost_bytes(sig, stage)
        if measure_reps:
            p = jax.device_put(self.host_params[stage], self._dev_sh[stage])
            x = jax.device_put(jax.tree_util.tree_map(_probe, hin), self._act(hin))
            jax.block_until_ready(fwd(p, x))
            ts = []
            for _ in range(measure_reps):
                t = time.perf_counter()
                jax.block_until_ready(fwd(p, x))
                ts.append(time.perf_counter() - t)
            kw["forward_s"] = float(np.median(ts))
        else:
            cost = fwd.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            flops = float((cost or {}).get("flops", 0.0))
            if not flops > 0:
                raise ValueError("the backend's cost analysis reports no FLOPs for this stage; pass measure_reps")
            kw.update(flops=flops, flops_per_s=flops_per_s)
        return LayerCost(**kw)

    def _stage_cost_bytes(self, sig, stage: int) -> dict:
        """The byte fields of :meth:`layer_cost` for ``stage`` under input signature ``sig``, from
        the compiled executables alone (nothing runs, no clock is read)."""
        f, pav, hin = self._traced_fns[stage], self._param_avals[stage], sig.chain[stage]
        saved = jax.eval_shape(_forward_save_fn(f, False, {}), pav, hin)[1]
        bwd = self._exe(sig, "backward", stage, False) if self.optimizer is None else None
        try:
            working = int(bwd.memory_analysis().temp_size_in_bytes) if bwd is not None else None
        except Exception:  # noqa: BLE001 - not every backend reports it
            working = None
        return dict(param_bytes=self.stage_nbytes[stage], grad_bytes=tree_nbytes(_split_diff(pav)[0]),
                    optimizer_bytes=self.optimizer_state_nbytes[stage], carry_bytes=tree_nbytes(hin),
                    intermediate_bytes=tree_nbytes(saved), working_bytes=working)

    def _loss_exe(self, loss_fn, out_aval, loss_args):
        args_aval = tuple(_tree_aval(a, f"loss_args[{j}]") for j, a in enumerate(loss_args))
        skey = (loss_fn, _aval_key(out_aval), tuple(_aval_key(a) for a in args_aval))
        try:
            known = self._loss_shapes.get(skey)
        except TypeError:  # an unhashable loss_fn
            known, skey = None, None
        if not known:
            try:
                val = jax.eval_shape(_own_fns([loss_fn])[0], out_aval, *args_aval)  # see _own_fns
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"loss_fn(out, *loss_args) failed to trace for out of {_describe(out_aval)}: "
                                 f"{type(e).__name__}: {e}") from e
            if not isinstance(val, jax.ShapeDtypeStruct) or val.shape != () or \
                    not jnp.issubdtype(val.dtype, jnp.inexact):
                raise ValueError(f"loss_fn must return a floating scalar (shape ()), got {val}")
            if skey is not None:
                if len(self._loss_shapes) >= 4 * MAX_LOSS_FNS:
                    self._loss_shapes.clear()
                self._loss_shapes[skey] = True
        jitted = self._loss_jits.get(loss_fn) if skey is not None else None
        if jitted is None:
            def vg(out, *args, loss_fn=loss_fn):
                od, oc, os_ = _split_diff(out)
                return jax.value_and_grad(lambda od: loss_fn(_merge_diff(od, oc, os_), *args))(od)

            # with batch_axis the gradient keeps the output's sharding (placed by the caller)
            jitted = jax.jit(vg, out_shardings=(None, self.activation_sharding if self._batch_sh is None else None))
            if skey is not None:
                self._loss_jits[loss_fn] = jitted
                while len(self._loss_jits) > MAX_LOSS_FNS:
                    evicted, _ = self._loss_jits.popitem(last=False)
                    self._loss_shapes = {k: v for k, v in self._loss_shapes.items() if k[0] is not evicted}
                    if not getattr(self, "_warned_loss", False):
                        self._warned_loss = True
                        warnings.warn("StreamingRuntime.train_step: more than "
                                      f"{MAX_LOSS_FNS} distinct loss_fn objects; each new one compiles again. "
                                      "Pass per-step data through loss_args instead of a new closure.",
                                      stacklevel=3)
        else:
            self._loss_jits.move_to_end(loss_fn)
        return jitted

    def _track(self, tree, stage: int) -> None:
        """Count ``tree``'s device buffers as ``stage``'s in ``resident_stages()`` (not for a ``resident`` stage)."""
        if not self.track_residency or self.resident[stage]:
            return
        for leaf in jax.tree_util.tree_leaves(tree):
            self._tracked[id(leaf)] = (weakref.ref(leaf), stage)

    def _record(self, pass_name: str, stage: int) -> None:
        if not self.track_residency:
            return
        r = self.resident_stages()
        self.residency_trace.append((pass_name, stage, r))
        if r > self.max_resident_stages:
            self.max_resident_stages = r

    def _run(self, h, *, train: bool, loss_exe=None, cotangent=None, loss_args=(), hyper=None, trace=None,
             mode=None):
        sig = self._signature(h)
        n, k = self.num_stages, self.prefetch_depth
        recorder = trace if trace is not None else self.trace
        donate = self.donate and recorder is None
        # compile everything before the first transfer (errors surface before state changes)
        save = train and self.remat is not True
        fwd = [self._exe(sig, "forward-save" if save else "forward", i, False) for i in range(n)]
        bwd = None
        if train:
            # a resident stage's weights are not donated unless the optimizer replaces them; without
            # an optimizer, neither are the first k+1 stages' with prefetch_next_call (kept for the next call)
            keep_w = [self.resident[i] or (self.prefetch_next_call and i <= k) for i in range(n)]
            has_acc = mode is not None and self.grad_acc is not None
            bwd = [self._exe(sig, "backward-saved" if save else "backward", i,
                             donate and (mode == "update" or not keep_w[i]), mode=mode, acc=has_acc)
                   for i in range(n)]
        if save:
            self.residual_nbytes = [tree_nbytes(e.out_info[1]) for e in fwd]
        elif train:
            self.residual_nbytes = [0] * n
        hyper_arr = None
        if hyper is not None:
            hyper_arr = jax.device_put(np.asarray(hyper, np.float32), self.activation_sharding)

        self.residency_trace = []
        if recorder is not None:
            recorder.start()
        try:
            return self._stream(sig, h, fwd, bwd, recorder, n, k, train, loss_exe, cotangent, loss_args, hyper_arr,
                                mode if train else None)
        finally:
            if recorder is not None:
                recorder.stop()

    def _update_exe_list(self) -> list:
        """The update pass's executables, one per stage (compiled on first use, shared by stages of
        equal parameter signature): ``(p, acc, state, hyper, coef) -> (new_p, new_state)``."""
        exes = []
        donate = self.donate
        for i in range(self.num_stages):
            key = (jax.tree_util.tree_structure(self._param_avals[i]),
                   tuple((a.shape, str(a.dtype), sh) for a, sh in zip(jax.tree_util.tree_leaves(self._param_avals[i]),
                                                                      jax.tree_util.tree_leaves(self._dev_sh[i]))),
                   tuple(self._train_mask[i]), self.group_idx[i], donate)
            exe = self._update_exes.get(key)
            if exe is None:
                act = self.activation_sharding
                pspec = jax.tree_util.tree_map(self._spec, self._param_avals[i], self._dev_sh[i])
                sel = [j for j, m in enumerate(self._train_mask[i]) if m]
                leaves = jax.tree_util.tree_leaves(self._param_avals[i])
                aspec = [jax.ShapeDtypeStruct(leaves[j].shape, leaves[j].dtype, sharding=sh)
                         for j, sh in zip(sel, self._acc_dev_sh[i])]
                st_spec = jax.tree_util.tree_map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                                 self.optimizer_state[i], self._state_dev_sh[i])
                hspec = jax.ShapeDtypeStruct((len(self._groups0), HYPER_WIDTH), np.float32, sharding=act)
                cspec = jax.ShapeDtypeStruct((), np.float32, sharding=act)
                exe = jax.jit(_update_only(self._train_mask[i], self.group_idx[i]),
                              out_shardings=(self._dev_sh[i], self._state_dev_sh[i]),
                              donate_argnums=(0, 2) if donate else ()).lower(
                                  pspec, aspec, st_spec, hspec, cspec).compile()
                self._update_exes[key] = exe
            exes.append(exe)
        return exes

    def _update_pass(self, hyper, coef, recorder) -> None:
        """Apply the optimizer to every stage from ``grad_acc`` (scaled by ``coef``), streaming weights,
        accumulated gradients and moments in ``prefetch_depth`` stages ahead, weights and moments out.

        Stages 0..k come from the weights the backward left in device memory (``prefetch_next_call``).
        """
        exes = self._update_exe_list()
        n, k = self.num_stages, self.prefetch_depth
        act = self.activation_sharding
        hyper_arr = jax.device_put(np.asarray(hyper, np.float32), act)
        coef_arr = jax.device_put(np.asarray(coef, np.float32), act)
        q, qs, qa = {}, {}, {}
        for j in range(min(k, n)):
            self._fetch(q, j, "update", recorder, qs, qa)
        prev = None
        for i in range(n):
            ev = StageEvent("update", i, "compute", recorder.now()) if recorder is not None else None
            new_p, new_s = exes[i](q.pop(i), qa.pop(i), qs.pop(i), hyper_arr, coef_arr)
            if recorder is not None:
                recorder.add(ev, new_p)
            self._track((new_p, new_s), i)
            self.host_params[i] = jax.device_put(new_p, self._host_sh[i])
            self.optimizer_state[i] = jax.device_put(new_s, self._state_host_sh[i])
            moved = (self.host_params[i], self.optimizer_state[i])
            del new_p, new_s
            if self.throttle and prev is not None:
                jax.block_until_ready(prev)  # stage i-1's results are on the host
            if i + k < n:
                self._fetch(q, i + k, "update", recorder, qs, qa)
            prev = moved
        self._carry = {}  # what the backward left is consumed (donated)
        self.grad_acc, self.micro_batches = None, 0
        self.step += 1

    def _fetch(self, q: dict, j: int, pass_name: str, recorder, qs: dict | None = None,
               qa: dict | None = None) -> None:
        """Start moving stage j's weights (and, into ``qs``, its optimizer state; into ``qa``, its
        accumulated gradients) to the device."""
        if qs is not None and self.optimizer is not None and j not in qs:
            qs[j] = jax.device_put(self.optimizer_state[j], self._state_dev_sh[j])
        if qa is not None and j not in qa:
            qa[j] = jax.device_put(self.grad_acc[j], self._acc_dev_sh[j])
        if j in q:
            return
        if self.resident[j]:
            q[j] = self.host_params[j]
            return
        carried = self._carry.pop(j, None)
        if carried is not None and carried[0] is self.host_params[j]:
            q[j] = carried[1]  # left in device memory by the previous call
            return
        ev = StageEvent(pass_name, j, "h2d", recorder.now()) if recorder is not None else None
        p = jax.device_put(self.host_params[j], self._dev_sh[j])
        self._track(p, j)
        q[j] = p
        if recorder is not None:
            recorder.add(ev, p)

    def _stream(self, sig, h, fwd, bwd, recorder, n, k, train, loss_exe, cotangent, loss_args, hyper, mode):
        throttle = self.throttle
        save = train and self.remat is not True
        opt = self.optimizer if mode == "update" else None
        offload = train and self.offload_activations
        res_dev = [list(e.output_shardings[1]) for e in fwd] if (offload and save) else None
        offloaded = [False] * n
        self.offloaded_activation_nbytes = 0
        saved: list = [None] * n
        x = jax.device_put(h, self._act(sig.chain[0]))
        # Forward. In training, the last k+1 stages stay for the start of the backward: once the
        # forward fetches nothing more, stage n-k-1's slot of the (k+1)-stage window would idle.
        keep = set(range(max(0, n - k - 1), n)) if train else set()
        q: dict[int, Any] = {}
        nc = min(k, n)
        for j in range(nc):
            self._fetch(q, j, "forward", recorder)
        # the next call's first stages, filled at this call's tail (cyclic schedule)
        nxt: dict[int, tuple[Any, Any]] | None = {} if self.prefetch_next_call else None

        def carry_next(upto: int) -> None:
            """Forward: hold stages 0..upto (< nc) in device memory for the next call (a live copy, or streamed)."""
            for c in range(min(upto + 1, nc)):
                if c in nxt or self.resident[c]:
                    continue
                if c in q:
                    nxt[c] = (self.host_params[c], q[c])
                else:
                    tmp: dict[int, Any] = {}
                    self._fetch(tmp, c, "next", recorder)
                    nxt[c] = (self.host_params[c], tmp[c])
        acts = [x] if train else None
        for i in range(n):
            p = q[i]
            ev = StageEvent("forward", i, "compute", recorder.now()) if recorder is not None else None
            if save:
                y, saved[i] = fwd[i](p, x)
            else:
                y = fwd[i](p, x)
            if recorder is not None:
                recorder.add(ev, y)
            if throttle:
                jax.block_until_ready(x)  # stage i-1 done: its weights' memory is free
            if i + k < n:
                self._fetch(q, i + k, "forward", recorder)
            elif nxt is not None and not train:
                carry_next(i + k - n)
            if offload and i not in keep:  # stage i is dispatched: its kept input (and residuals) go to the host
                self.offloaded_activation_nbytes += tree_nbytes(acts[i]) + (tree_nbytes(saved[i]) if save else 0)
                acts[i] = jax.device_put(acts[i], self._act_host(sig.chain[i]))
                if save:
                    saved[i] = jax.device_put(saved[i], [sh.with_memory_kind(HOST_KIND) for sh in res_dev[i]])
                offloaded[i] = True
            self._record("forward", i)
            if i not in keep:
                del q[i]
            del p
            x = y
            if train:
                acts.append(y)
        self._carry = {}  # whatever the forward did not take is stale
        if not train:
            if nxt is not None:
                self._carry = nxt
            return (x,)

        out = acts.pop()  # acts[i] is now the input of stage i
        if cotangent is None:
            loss, g = loss_exe(out, *loss_args)
            if self._batch_sh is not None:
                g = jax.device_put(g, self._act(_split_diff(sig.chain[-1])[0]))
            first = loss
        else:
            cd = _split_diff(cotangent)[0] if _aval_key(_tree_aval(cotangent, "cotangent")) == \
                _aval_key(sig.chain[-1]) else jax.tree_util.tree_leaves(cotangent)
            g = jax.device_put(cd, self._act(_split_diff(sig.chain[-1])[0]), may_alias=False)
            first = out
        del out
        host_grads: list | None = [None] * n if mode is None else None
        qs: dict[int, Any] | None = {} if mode == "update" else None
        qa: dict[int, Any] | None = {} if mode is not None and self.grad_acc is not None else None
        new_acc: list = [None] * n
        sumsq: list = [None] * n
        prev_host = None
        def fetch_acts(j):
            if offloaded[j]:
                acts[j] = jax.device_put(acts[j], self._act(sig.chain[j]))
                if save:
                    saved[j] = jax.device_put(saved[j], res_dev[j])
                offloaded[j] = False

        for j in range(n - 1, max(-1, n - 1 - k), -1):
            self._fetch(q, j, "backward", recorder, qs, qa)
            fetch_acts(j)
        for i in range(n - 1, -1, -1):
            p = q.pop(i)
            xi = acts[i]
            acts[i] = None
            ev = StageEvent("backward", i, "compute", recorder.now()) if recorder is not None else None
            args = (p, xi)
            if save:
                args += (saved[i],)
                saved[i] = None
            args += (g,)
            if qa is not None:
                args += (qa.pop(i),)
            if mode == "update":
                args += (qs.pop(i), hyper)
            res = bwd[i](*args)
            del args, xi
            if mode is None:
                g, dp = res
            elif mode == "accum":
                g, acc_i, sumsq[i] = res
            else:
                g, new_p, new_s = res
            del res
            if recorder is not None:
                recorder.add(ev, g)
            ev = StageEvent("backward", i, "d2h", recorder.now()) if recorder is not None else None
            if mode != "update":
                if nxt is not None and i <= k and not self.resident[i]:  # stages 0..k: kept for the next call
                    nxt[i] = (self.host_params[i], p)  # not donated (keep_w): the next call's forward starts with it
                if mode is None:
                    self._track(dp, i)
                    hg = jax.device_put(dp, self._diff_grad_sh[i])
                    host_grads[i] = _merge_diff(hg, None, _split_diff(self._param_avals[i])[2])
                    moved = hg
                else:
                    dp = acc_i
                    self._track(dp, i)
                    new_acc[i] = moved = jax.device_put(acc_i, self._acc_host_sh[i])
                    del acc_i
            else:
                dp = (new_p, new_s)  # the device-side results, alive until this stage is recorded
                self._track(dp, i)
                self.host_params[i] = jax.device_put(new_p, self._host_sh[i])
                self.optimizer_state[i] = jax.device_put(new_s, self._state_host_sh[i])
                if nxt is not None and i <= k and not self.resident[i]:
                    nxt[i] = (self.host_params[i], new_p)  # the updated weights, already on the device
                moved = (self.host_params[i], self.optimizer_state[i])
                del new_p, new_s
            if recorder is not None:
                recorder.add(ev, moved)
            if throttle and prev_host is not None:
                jax.block_until_ready(prev_host)  # stage i+1's results are on the host
            if i - k >= 0:
                self._fetch(q, i - k, "backward", recorder, qs, qa)
                fetch_acts(i - k)
            self._record("backward", i)
            del p, dp
            prev_host = moved
        if mode == "update":
            self.step += 1
            self.grad_acc, self.micro_batches = None, 0
        elif mode == "accum":
            self.grad_acc, self.micro_batches = new_acc, self.micro_batches + 1
            self._sumsq = sumsq
        if nxt is not None:
            self._carry = nxt
        gx = _merge_diff(g, None, _split_diff(sig.in_aval)[2])
        return first, gx, host_grads


def _device_nbytes(tree) -> int:
    """Bytes one device holds of a pytree of jax arrays (a shard of each leaf; a replicated leaf in full)."""
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize
               for a in jax.tree_util.tree_leaves(tree))


def _memory_analysis(exe):
    """``exe.memory_analysis()``, or ``None`` where the backend does not implement it."""
    try:
        return exe.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None


def _forward_save_fn(f, remat, box: dict):
    """``(p, x) -> (y, saved)``: a stage's output and its vjp residuals minus ``p`` and ``x``.

    ``jax.vjp`` returns its residuals as the leaves of the vjp function (a pytree); while
    tracing, residuals that *are* the traced weights or stage input (identity) are recorded as
    such in ``box["layout"] = (vjp treedef, sources)`` and not returned, so the weights are not
    kept on the device between the passes. ``remat``: ``False`` keeps every residual, a
    ``jax.checkpoint_policies`` policy those ``jax.checkpoint`` saves.
    """
    fs = f if remat is False else jax.checkpoint(f, policy=remat)

    def fwd_save(p, x):
        pd, pc, ps = _split_diff(p)
        xd, xc, xs = _split_diff(x)

        def f2(pd, xd):
            yd, yc, ys = _split_diff(fs(_merge_diff(pd, pc, ps), _merge_diff(xd, xc, xs)))
            return yd, (yc, ys)

        yd, vjp, (yc, ys) = jax.vjp(f2, pd, xd, has_aux=True)
        res, treedef = jax.tree_util.tree_flatten(vjp)
        pl, xl = jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(x)
        sources, saved = [], []
        for r in res:
            j = _index_by_identity(pl, r)
            if j is not None:
                sources.append(("p", j))
                continue
            j = _index_by_identity(xl, r)
            if j is not None:
                sources.append(("x", j))
                continue
            sources.append(("s", len(saved)))
            saved.append(r)
        box["layout"] = (treedef, tuple(sources))
        return _merge_diff(yd, yc, ys), saved
    return fwd_save


def _recompute_vjp(f):
    """``(p, x, g) -> (gx, gp)``: the stage's vjp by recomputing its forward, over floating leaves only."""
    def core(p, x, g):
        pd, pc, ps = _split_diff(p)
        xd, xc, xs = _split_diff(x)

        def f2(pd, xd):
            return _split_diff(f(_merge_diff(pd, pc, ps), _merge_diff(xd, xc, xs)))[0]

        _, vjp = jax.vjp(f2, pd, xd)
        gp, gx = vjp(g)
        return gx, gp
    return core


def _saved_vjp(treedef, sources):
    """``(p, x, saved, g) -> (gx, gp)``: the stage's vjp rebuilt from the forward's residuals."""
    def core(p, x, saved, g):
        src = {"p": jax.tree_util.tree_leaves(p), "x": jax.tree_util.tree_leaves(x), "s": saved}
        vjp = jax.tree_util.tree_unflatten(treedef, [src[kind][j] for kind, j in sources])
        gp, gx = vjp(g)
        return gx, gp
    return core


def _trainable_grads(p, gp, train_mask: list, acc) -> list:
    """The gradients of the trainable leaves of ``p`` (from ``gp``, over the floating leaves), plus ``acc``."""
    leaves = jax.tree_util.tree_leaves(p)
    grad_of = dict(zip([j for j, a in enumerate(leaves) if _is_diff(a)], gp))
    grads = [grad_of[j] for j, m in enumerate(train_mask) if m]
    if acc is not None:
        grads = [a + g for a, g in zip(acc, grads)]
    return grads


def _with_accum(core, train_mask: list, has_acc: bool):
    """Wrap a vjp ``core``: ``(..., [acc]) -> (gx, acc + grads of the trainable leaves, their sum of squares)``."""
    def fn(*args):
        core_args, acc = (args[:-1], args[-1]) if has_acc else (args, None)
        gx, gp = core(*core_args)
        grads = _trainable_grads(core_args[0], gp, train_mask, acc)
        return gx, grads, _optim.sum_squares(grads)
    return fn


def _update_only(train_mask: list, groups: tuple):
    """``(p, grads, state, hyper, coef) -> (new_p, new_state)``: AdamW on the trainable leaves with ``grads * coef``."""
    def fn(p, grads, state, hyper, coef):
        leaves, treedef = jax.tree_util.tree_flatten(p)
        sel = [j for j, m in enumerate(train_mask) if m]
        new_sel, new_state = _optim.apply_update([leaves[j] for j in sel], grads, state, hyper, list(groups),
                                                 scale=coef)
        new_leaves = list(leaves)
        for j, v in zip(sel, new_sel):
            new_leaves[j] = v
        return jax.tree_util.tree_unflatten(treedef, new_leaves), new_state
    return fn


def _with_update(core, train_mask: list, groups: tuple, has_acc: bool = False):
    """Wrap a vjp ``core`` so that it also applies AdamW to the trainable leaves: ``(..., [acc], state, hyper) ->
    (gx, new_params, new_state)`` (``groups``: each trainable leaf's row of ``hyper``; ``acc``: gradients
    accumulated by earlier micro-batches, added first)."""
    def fn(*args):
        *core_args, state, hyper = args
        acc = core_args.pop() if has_acc else None
        gx, gp = core(*core_args)
        p = core_args[0]
        leaves, treedef = jax.tree_util.tree_flatten(p)
        sel = [j for j, m in enumerate(train_mask) if m]
        new_sel, new_state = _optim.apply_update([leaves[j] for j in sel], _trainable_grads(p, gp, train_mask, acc),
                                                 state, hyper, list(groups))
        new_leaves = list(leaves)
        for j, v in zip(sel, new_sel):
            new_leaves[j] = v
        return gx, jax.tree_util.tree_unflatten(treedef, new_leaves), new_state
    return fn
