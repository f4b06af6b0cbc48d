"""Streaming (swapping) runtime for layered models: the "CPU swapping runtime" of Alpa #694.

Each stage (layer) of a model is one jitted executable. Every stage's weights live in host
memory (memory kind ``pinned_host``) as *separate* per-stage buffers; while stage ``i``
computes, the weights of stages ``i+1 .. i+k`` are being copied to the device
asynchronously (``jax.device_put`` to memory kind ``device`` returns at once; the order in
which the host dispatches copies and executables is what makes them overlap). ``k`` is the
prefetch depth.

Why this shape (figures from ``DESIGN.md``, measured on one NVIDIA H200, jax 0.11.2):

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

The module imports only numpy and jax (no torch, no torch_xla).
"""
from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

__all__ = ["StreamingRuntime", "StageEvent", "tree_nbytes"]

HOST_KIND = "pinned_host"
DEVICE_KIND = "device"


def tree_nbytes(tree) -> int:
    """Total size in bytes of the array leaves of ``tree`` (logical, unsharded sizes).

    Args:
      tree: a pytree whose leaves have ``shape`` and ``dtype`` (numpy or jax arrays,
        ``jax.ShapeDtypeStruct``).

    Returns:
      int, bytes: ``sum(prod(leaf.shape) * leaf.dtype.itemsize)``.
    """
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


@dataclasses.dataclass
class StageEvent:
    """One transfer or computation of one stage, recorded when ``trace=True``.

    Times are host ``time.perf_counter()`` seconds relative to the start of the call
    (``StreamingRuntime.trace_t0`` holds the absolute start).

    Attributes:
      pass_name: ``"forward"`` or ``"backward"``.
      stage: the stage index, 0-based.
      kind: ``"h2d"`` (weights pinned_host -> device), ``"compute"`` (the stage's
        executable) or ``"d2h"`` (parameter gradients device -> pinned_host).
      issued_s: just before the host dispatched the operation.
      dispatched_s: when the (asynchronous) dispatch call returned.
      done_s: when ``block_until_ready`` on its result returned in the trace watcher
        thread (an upper bound of the completion time; ``None`` until known).
      error: the repr of an exception raised while waiting, else ``None``.
    """

    pass_name: str
    stage: int
    kind: str
    issued_s: float
    dispatched_s: float = float("nan")
    done_s: float | None = None
    error: str | None = None


class _Watcher:
    """Background thread that waits on results in dispatch order and stamps ``done_s``.

    ``block_until_ready`` releases the GIL, so the dispatching thread is not delayed. The
    thread holds references to the arrays it waits on until they are ready.
    """

    def __init__(self, t0: float):
        self._t0 = t0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.events: list[StageEvent] = []
        self._thread = threading.Thread(target=self._run, name="xla_swap-trace", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def add(self, event: StageEvent, arrays) -> None:
        event.dispatched_s = self.now()
        self.events.append(event)
        self._q.put((event, arrays))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            event, arrays = item
            try:
                jax.block_until_ready(arrays)
            except Exception as e:  # noqa: BLE001 - recorded, the main thread reports its own errors
                event.error = repr(e)
            event.done_s = self.now()
            del item, event, arrays

    def close(self) -> list[StageEvent]:
        self._q.put(None)
        self._thread.join()
        return self.events


def _leaf_name(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _as_aval(x, what: str) -> jax.ShapeDtypeStruct:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{what}: expected an array (numpy or jax), got {type(x).__name__}")
    return jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype))


def _tree_aval(tree, what: str):
    """Pytree of ``ShapeDtypeStruct`` for a pytree of arrays (one array is a pytree too).

    Raises:
      TypeError: a leaf is not an array, or the pytree has no leaves (the message names ``what``
        and the leaf path).
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not leaves:
        raise TypeError(f"{what}: expected an array or a pytree of arrays, got {tree!r} (no array leaves)")
    return jax.tree_util.tree_unflatten(
        treedef, [_as_aval(leaf, what + jax.tree_util.keystr(path)) for path, leaf in leaves])


def _aval_key(tree) -> tuple:
    """Hashable (tree structure, leaf shapes and dtypes) of a pytree of avals."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(a.shape), str(np.dtype(a.dtype))) for a in leaves)


def _describe(tree) -> str:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if treedef == jax.tree_util.tree_structure(0):
        return f"shape {tuple(leaves[0].shape)} dtype {np.dtype(leaves[0].dtype)}"
    return f"{treedef} with leaves " + ", ".join(f"{np.dtype(a.dtype)}{list(a.shape)}" for a in leaves)


def _stage_fns(stage_fn, n: int) -> tuple[list, bool]:
    """``stage_fn`` (one callable or one per stage) -> (list of n callables, shared?).

    Raises:
      TypeError: not a callable or a sequence of callables (an element is named).
      ValueError: a sequence whose length is not ``n``.
    """
    if callable(stage_fn):
        return [stage_fn] * n, True
    if isinstance(stage_fn, Sequence) and not isinstance(stage_fn, (str, bytes)):
        fns = list(stage_fn)
        if len(fns) != n:
            raise ValueError(f"stage_fn has {len(fns)} functions but stage_params has {n} stages")
        for i, f in enumerate(fns):
            if not callable(f):
                raise TypeError(f"stage_fn[{i}] is not callable: {type(f).__name__}")
        return fns, False
    raise TypeError(f"stage_fn must be a callable or a sequence of callables, got {type(stage_fn).__name__}")


def _check_memory_kinds(dev, who: str) -> None:
    """Raise ``ValueError`` unless ``dev`` has the ``pinned_host`` and ``device`` memory kinds."""
    kinds = {m.kind for m in dev.addressable_memories()}
    if HOST_KIND not in kinds or DEVICE_KIND not in kinds:
        raise ValueError(f"device {dev} has memory kinds {sorted(kinds)}; {who} needs {HOST_KIND!r} and "
                         f"{DEVICE_KIND!r}")


def _index_by_identity(items, x):
    for j, item in enumerate(items):
        if item is x:
            return j
    return None


class StreamingRuntime:
    """Run a stack of stages with host-resident weights streamed to the device k stages ahead.

    Args:
      stage_fn: ``stage_fn(params_i, h) -> h``: one stage (layer). ``params_i`` is the
        pytree ``stage_params[i]`` (in device memory) and ``h`` the activation (the carry
        between stages): one array or a pytree of arrays; it returns the next stage's
        ``h`` (an array or a pytree of arrays; a pytree carry lets one layer be split
        into several stages, e.g. an FFN's column chunks with ``(x, partial_sum)``, so
        that smaller transfers start the pipeline and end it sooner). Either one callable shared by every stage
        (then every stage's params must have the same tree structure, leaf shapes and
        dtypes), or a sequence with one callable per stage. One executable is compiled per
        distinct (callable, params signature, input signature): an L-layer stack of
        identical layers compiles one forward (and, for training, one backward) executable.
      stage_params: non-empty sequence of per-stage pytrees of arrays (numpy arrays or
        ``jax.Array``, any dtype; floating dtypes for ``train_step``). Each leaf is copied
        once into its own ``pinned_host`` buffer (a leaf that already is a jax array with
        the target ``pinned_host`` sharding is used as is, without a copy).
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
      donate: donate buffers the runtime owns to the backward executables: a stage's
        streamed device weights (their memory then holds that stage's parameter
        gradients) and the output cotangent (when it has the stage input's shape and
        dtype). The user's arrays are never donated. Ignored (off) when ``trace=True``.
      throttle: bound device memory for real, not only the runtime's references: after
        dispatching stage i's computation, the host waits until stage i-1's computation
        (forward) or the copy of stage i+1's gradients to host (backward) is complete
        before issuing the next weight transfer. The device is never idle for it (stage
        i is already queued). ``False`` lets the host run ahead: every transfer may be
        issued at once and device memory is bounded only by when XLA frees buffers.
      track_residency: after each stage, count the stages whose runtime-created device
        buffers (streamed weights, device-side gradients) are alive
        (``jax.live_arrays()`` with memory kind ``device``); see ``max_resident_stages``.
        Costs a scan of all live arrays per stage; turn off for timing.
      trace: record a ``StageEvent`` for every transfer and computation (``last_trace``);
        a watcher thread waits on each result. Holds extra references while waiting, so
        residency counts may read higher; disables donation.
      remat: what ``train_step`` keeps from each stage's forward for its backward.
        ``True`` (default): only the stage input; the backward recomputes the stage's
        forward (per-stage rematerialisation, least memory). ``False``: every residual
        of ``jax.vjp(stage_fn)`` except the stage's weights and input (no recompute; the
        most memory). A ``jax.checkpoint_policies`` policy (e.g.
        ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``): the residuals
        that ``jax.checkpoint(stage_fn, policy=remat)`` saves, the rest is recomputed in
        the backward. The weights are never kept: the backward streams them in again and
        gets them back from the forward's trace by identity (``residual_nbytes`` has the
        bytes kept per stage). The saved residuals stay in device memory.

    Device memory (bytes), with S = the largest stage's weight bytes (``stage_nbytes``):
      forward: at most (k+1)*S of weights plus two activations; ``train_step``: at most
      (k+1)*S of weights and parameter gradients (a stage's device-side gradients count as
      that stage; with ``donate`` they reuse its weight buffers, without it add S), plus the
      L+1 stage inputs kept for the backward and the stage executables' temporaries
      (``executable_memory()``), plus with ``remat`` other than ``True`` the saved
      residuals (``residual_nbytes``). The bound is physical with ``throttle=True``; with
      ``throttle=False`` it holds for the runtime's references only. Host memory:
      ``weight_nbytes`` of ``pinned_host`` (plus the same again for the returned gradients).

    Raises:
      TypeError: ``stage_fn`` (or an element) is not callable; a parameter leaf is not an
        array; ``device``/``sharding``/``activation_sharding`` has the wrong type;
        ``prefetch_depth`` is not an int; a flag is not a bool; ``remat`` is neither a
        bool nor callable.
      ValueError: ``prefetch_depth < 1``; ``stage_params`` is empty or not a sequence;
        the number of stage functions differs from the number of stages; with one shared
        ``stage_fn``, a stage's params differ from stage 0's in structure, shape or dtype
        (the message names the stage and leaf); both ``device`` and ``sharding`` are
        given; the device has no ``pinned_host`` memory; ``activation_sharding`` is
        needed but missing.
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
        donate: bool = True,
        throttle: bool = True,
        track_residency: bool = True,
        trace: bool = False,
        remat: bool | Callable = True,
    ):
        # ---- validation, no state change before all of it passed ----
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, (int, np.integer)):
            raise TypeError(f"prefetch_depth must be an int >= 1, got {type(prefetch_depth).__name__}")
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        for flag_name, flag in (("donate", donate), ("throttle", throttle),
                                ("track_residency", track_residency), ("trace", trace)):
            if not isinstance(flag, bool):
                raise TypeError(f"{flag_name} must be a bool, got {type(flag).__name__}")
        if not (isinstance(remat, bool) or callable(remat)):
            raise TypeError(f"remat must be a bool or a jax.checkpoint_policies policy (callable), "
                            f"got {type(remat).__name__}")
        if isinstance(stage_params, (str, bytes, dict)) or not isinstance(stage_params, Sequence):
            raise ValueError(f"stage_params must be a non-empty sequence (list/tuple) of per-stage pytrees, "
                             f"got {type(stage_params).__name__}")
        if len(stage_params) == 0:
            raise ValueError("stage_params is empty: need at least one stage")
        n = len(stage_params)
        fns, shared = _stage_fns(stage_fn, n)

        flat = []  # per stage: (leaves_with_path, treedef)
        for i, p in enumerate(stage_params):
            lp, treedef = jax.tree_util.tree_flatten_with_path(p)
            for path, leaf in lp:
                _as_aval(leaf, f"stage_params[{i}]{_leaf_name(path)}")
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

        host_sh, dev_sh = [], []
        for i, (lp, treedef) in enumerate(flat):
            hs_, ds_ = [], []
            for path, leaf in lp:
                s = leaf_sharding(i, path, leaf)
                if not isinstance(s, Sharding):
                    raise TypeError(f"sharding({i}, {_leaf_name(path)}) returned {type(s).__name__}, "
                                    "not a jax.sharding.Sharding")
                hs_.append(s.with_memory_kind(HOST_KIND))
                ds_.append(s.with_memory_kind(DEVICE_KIND))
            host_sh.append(jax.tree_util.tree_unflatten(treedef, hs_))
            dev_sh.append(jax.tree_util.tree_unflatten(treedef, ds_))

        # ---- state ----
        self.num_stages: int = n
        self.prefetch_depth: int = int(prefetch_depth)
        self.donate = donate
        self.throttle = throttle
        self.track_residency = track_residency
        self.trace = trace
        self.remat = remat
        self.activation_sharding: Sharding = act
        self._fns = fns
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
        #: per-stage pytrees of ``pinned_host`` arrays (the resident weights).
        self.host_params: list = [jax.device_put(p, s) for p, s in zip(stage_params, host_sh)]
        self._param_avals = [jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), p)
                             for p in self.host_params]
        #: bytes of each stage's weights (logical sizes), and their sum.
        self.stage_nbytes: list[int] = [tree_nbytes(p) for p in self.host_params]
        self.weight_nbytes: int = sum(self.stage_nbytes)
        self._in_aval = None  # pytree of ShapeDtypeStruct of h (first call)
        self._chain: list | None = None  # avals (pytrees) of the input of stage i, i = 0..n
        self._compiled: dict = {}
        self._saved_layout: dict = {}  # compile key -> (vjp treedef, residual sources) (remat != True)
        #: bytes of the residuals each stage keeps from its forward for its backward in
        #: ``train_step`` beyond its input (0 with ``remat=True``); filled by the first training call.
        self.residual_nbytes: list[int] = [0] * n
        self._stage_exe: dict = {}  # (kind, stage) -> compiled
        self._loss_jits: dict = {}
        self._tracked: dict[int, tuple[weakref.ref, int]] = {}
        #: highest number of stages with live device buffers seen at any step since the
        #: last ``reset_stats()`` (only with ``track_residency``).
        self.max_resident_stages: int = 0
        #: ``[(pass_name, stage, resident_stages), ...]`` of the last call.
        self.residency_trace: list[tuple[str, int, int]] = []
        #: events of the last call with ``trace=True``.
        self.last_trace: list[StageEvent] = []
        #: absolute ``time.perf_counter()`` at the start of the last traced call.
        self.trace_t0: float = float("nan")

    # ------------------------------------------------------------------ public API
    @property
    def num_executables(self) -> int:
        """Number of distinct stage executables compiled so far (forward and backward)."""
        return len(self._compiled)

    def reset_stats(self) -> None:
        """Reset ``max_resident_stages``, ``residency_trace`` and ``last_trace``."""
        self.max_resident_stages = 0
        self.residency_trace = []
        self.last_trace = []

    def resident_stages(self) -> int:
        """Number of distinct stages that have runtime-created device buffers alive right now.

        Counts ``jax.live_arrays()`` of memory kind ``device`` that this runtime created
        (streamed weights, device-side parameter gradients), grouped by stage. Deleted
        (donated) arrays are not live.

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
        # forget dead entries
        for key in [k for k, (r, _) in tracked.items() if r() is None]:
            del tracked[key]
        return len(stages)

    def executable_memory(self) -> list[dict]:
        """Compiled memory analysis of every executable compiled so far.

        Returns:
          list of dicts ``{"kind": "forward"|"backward", "stages": [int], "argument_bytes",
          "output_bytes", "alias_bytes", "temp_bytes"}`` (bytes, device memory, per call of
          the executable; ``None`` where the backend reports nothing).
        """
        out = []
        for key, exe in self._compiled.items():
            stages = [i for (k, i), e in self._stage_exe.items() if e is exe and k == key[1]]
            try:
                m = exe.memory_analysis()
            except Exception:  # noqa: BLE001 - not every backend implements it
                m = None
            get = (lambda a: getattr(m, a, None)) if m is not None else (lambda a: None)
            out.append({"kind": key[1], "stages": stages,
                        "argument_bytes": get("argument_size_in_bytes"),
                        "output_bytes": get("output_size_in_bytes"),
                        "alias_bytes": get("alias_size_in_bytes"),
                        "temp_bytes": get("temp_size_in_bytes")})
        return out

    def stage_input_nbytes(self) -> list[int]:
        """Bytes of each stage's input activation (the carry), from the shapes of the first call.

        ``train_step`` keeps every stage's input on the device until that stage's backward,
        so their sum is the kept-activation part of its device memory.

        Returns: list of ``num_stages`` ints (bytes). Raises: ``RuntimeError`` before the
        first ``forward``/``train_step``/``output_aval`` (the shapes are not known yet).
        """
        if self._chain is None:
            raise RuntimeError("stage_input_nbytes: call forward, train_step or output_aval first")
        return [tree_nbytes(a) for a in self._chain[:-1]]

    def output_aval(self, h):
        """Shape and dtype of ``forward(h)`` without running anything (traces on first use).

        Returns: a ``jax.ShapeDtypeStruct`` (or a pytree of them for a pytree carry).

        Raises: as ``forward``.
        """
        self._check_input(h)
        return self._chain[-1]

    def forward(self, h):
        """Run every stage in order, streaming weights ``prefetch_depth`` stages ahead.

        Args:
          h: the input activation: a numpy or jax array, or a pytree of them. The first
            call fixes its structure, shapes and dtypes (executables are compiled for them,
            before any transfer).

        Returns:
          ``jax.Array`` (or pytree) on the device (``activation_sharding``), shaped like
          the last stage's output. Asynchronous: call ``jax.block_until_ready`` to wait.

        Raises:
          TypeError: a leaf of ``h`` is not an array; a stage returns no array or a
            non-array leaf.
          ValueError: ``h``'s structure, shapes or dtypes differ from the first call's; a
            stage function fails to trace (message names the stage).
        """
        return self._run(h, train=False)[0]

    __call__ = forward

    def train_step(self, h, loss_fn: Callable | None = None, *, cotangent=None, loss_args: tuple = ()):
        """Forward and backward pass; each stage's parameter gradients go to ``pinned_host``.

        The forward keeps every stage's input on the device (L activations) and the last
        ``prefetch_depth`` stages' weights (the backward starts with them). The backward
        runs one ``jax.vjp`` executable per stage in reverse (it recomputes the stage's
        forward: per-stage rematerialisation; see ``remat`` for keeping residuals instead)
        with the same k-deep prefetch, and sends each
        stage's parameter gradients to host memory as soon as they are produced. With
        ``throttle=True`` the host waits until stage i+1's gradients have reached host memory
        before issuing stage i-k's weight transfer, so with k=1 a transfer cannot overlap the
        whole of a stage's backward; k=2 leaves room (DESIGN.md: both directions together
        reach ~93 GB/s on an H200, not 2x54). Weight traffic per step: (2L-k) stages in, L
        stages of gradients out.

        Args:
          h: input activation, as for ``forward``.
          loss_fn: ``loss_fn(out, *loss_args) -> scalar`` (shape ``()``, floating). Its
            value and gradient w.r.t. ``out`` are computed by one jitted executable.
          cotangent: instead of ``loss_fn``: the cotangent of the output (same structure,
            shapes and dtypes as the output), numpy or jax arrays.
          loss_args: extra arguments (e.g. targets) passed to ``loss_fn``.

        Returns:
          ``(loss_or_output, input_cotangent, grads)``: the scalar loss (``loss_fn`` given)
          or the forward output (``cotangent`` given), as device arrays; the cotangent of
          ``h`` (device, shape/dtype of ``h``); a list of ``num_stages`` pytrees shaped like
          ``stage_params[i]`` with memory kind ``pinned_host``. All asynchronous.

        Raises:
          ValueError: not exactly one of ``loss_fn`` / ``cotangent``; the cotangent's shape
            or dtype differs from the output's; ``loss_fn`` does not return a scalar; the
            input checks of ``forward``.
          TypeError: ``loss_fn`` not callable; parameters, ``h`` or the output not floating.
        """
        if (loss_fn is None) == (cotangent is None):
            raise ValueError("train_step needs exactly one of loss_fn and cotangent")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not isinstance(loss_args, tuple):
            raise TypeError(f"loss_args must be a tuple, got {type(loss_args).__name__}")
        self._check_input(h)
        for i, avals in enumerate(self._param_avals):
            for path, a in jax.tree_util.tree_flatten_with_path(avals)[0]:
                if not jnp.issubdtype(a.dtype, jnp.inexact):
                    raise TypeError(f"train_step: stage_params[{i}]{_leaf_name(path)} has dtype {a.dtype}; "
                                    "gradients need floating parameters")
        for i, av in enumerate(self._chain):
            for a in jax.tree_util.tree_leaves(av):
                if not jnp.issubdtype(a.dtype, jnp.inexact):
                    raise TypeError(f"train_step: the input of stage {i} has dtype {a.dtype}; gradients need "
                                    "floating activations" if i < self.num_stages else
                                    f"train_step: the output has dtype {a.dtype}; gradients need floating outputs")
        out_aval = self._chain[-1]
        if cotangent is not None:
            c = _tree_aval(cotangent, "cotangent")
            if _aval_key(c) != _aval_key(out_aval):
                raise ValueError(f"cotangent has {_describe(c)}, but the output has {_describe(out_aval)}")
            loss_exe = None
        else:
            loss_exe = self._loss_exe(loss_fn, out_aval, loss_args)
        return self._run(h, train=True, loss_exe=loss_exe, cotangent=cotangent, loss_args=loss_args)

    # ------------------------------------------------------------------ internals
    def _check_input(self, h) -> None:
        a = _tree_aval(h, "h")
        if self._in_aval is not None:
            if _aval_key(a) != _aval_key(self._in_aval):
                raise ValueError(f"h has {_describe(a)}, but this runtime was compiled for {_describe(self._in_aval)} "
                                 "on its first call; make a new StreamingRuntime (it may share host_params) for "
                                 "another shape")
            return
        chain = [a]
        for i, (f, pav) in enumerate(zip(self._fns, self._param_avals)):
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
        self._in_aval, self._chain = a, chain

    def _spec(self, aval, sharding):
        """``ShapeDtypeStruct`` (pytree) of ``aval`` with ``sharding`` on every leaf."""
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), aval)

    def _exe(self, kind: str, i: int, donate: bool):
        key_stage = (kind + ("-donate" if donate else ""), i)
        exe = self._stage_exe.get(key_stage)
        if exe is not None:
            return exe
        f = self._fns[i]
        pkey = (jax.tree_util.tree_structure(self._param_avals[i]),
                tuple((a.shape, str(a.dtype), s) for a, s in zip(jax.tree_util.tree_leaves(self._param_avals[i]),
                                                                   jax.tree_util.tree_leaves(self._dev_sh[i]))))
        hin, hout = self._chain[i], self._chain[i + 1]
        base = (self._fn_ids[i], pkey, _aval_key(hin), _aval_key(hout))
        key = (base[0], key_stage[0]) + base[1:]
        exe = self._compiled.get(key)
        if exe is None:
            pspec = jax.tree_util.tree_map(self._spec, self._param_avals[i], self._dev_sh[i])
            hspec = self._spec(hin, self.activation_sharding)
            gspec = self._spec(hout, self.activation_sharding)
            # the gradient of the output may reuse the input's buffer (same avals) and the
            # streamed weights' buffers hold the weight gradients
            same = _aval_key(hin) == _aval_key(hout)
            if kind == "forward":
                exe = jax.jit(f, out_shardings=self.activation_sharding).lower(pspec, hspec).compile()
            elif kind == "forward-save":
                exe = self._compile_forward_save(f, base, pspec, hspec)
            elif kind == "backward":
                def bwd(p, x, g, f=f):
                    _, vjp = jax.vjp(f, p, x)
                    gp, gx = vjp(g)
                    return gx, gp

                donate_argnums = ((0, 2) if same else (0,)) if donate else ()
                exe = jax.jit(bwd, out_shardings=(self.activation_sharding, self._dev_sh[i]),
                              donate_argnums=donate_argnums).lower(pspec, hspec, gspec).compile()
            else:  # "backward-saved": the vjp from the forward's residuals, no recompute
                fwd_save = self._exe("forward-save", i, False)
                treedef, sources = self._saved_layout[base]
                sspec = jax.tree_util.tree_map(
                    lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                    fwd_save.out_info[1], fwd_save.output_shardings[1])

                def bwd_saved(p, x, saved, g, treedef=treedef, sources=sources):
                    src = {"p": jax.tree_util.tree_leaves(p), "x": jax.tree_util.tree_leaves(x), "s": saved}
                    vjp = jax.tree_util.tree_unflatten(treedef, [src[kind][j] for kind, j in sources])
                    gp, gx = vjp(g)
                    return gx, gp

                donate_argnums = ((0, 3) if same else (0,)) if donate else ()
                exe = jax.jit(bwd_saved, out_shardings=(self.activation_sharding, self._dev_sh[i]),
                              donate_argnums=donate_argnums).lower(pspec, hspec, sspec, gspec).compile()
            self._compiled[key] = exe
        self._stage_exe[key_stage] = exe
        return exe

    def _compile_forward_save(self, f, base, pspec, hspec):
        """Compile ``(p, x) -> (y, saved)``: the stage's output and its vjp residuals minus ``p`` and ``x``.

        ``jax.vjp`` returns its residuals as the leaves of the vjp function (a pytree); while
        tracing, residuals that *are* the traced weights or stage input (identity) are
        recorded as such in ``self._saved_layout[base]`` and not returned, so the weights
        are not kept on the device between the passes.
        """
        fs = f if self.remat is False else jax.checkpoint(f, policy=self.remat)
        box = {}

        def fwd_save(p, x):
            y, vjp = jax.vjp(fs, p, x)
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
            return y, saved

        exe = jax.jit(fwd_save, out_shardings=(self.activation_sharding, None)).lower(pspec, hspec).compile()
        self._saved_layout[base] = box["layout"]
        return exe

    def _loss_exe(self, loss_fn, out_aval, loss_args):
        try:
            val = jax.eval_shape(loss_fn, out_aval, *loss_args)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"loss_fn(out, *loss_args) failed to trace for out of shape {out_aval.shape} "
                             f"dtype {out_aval.dtype}: {type(e).__name__}: {e}") from e
        if not isinstance(val, jax.ShapeDtypeStruct) or val.shape != () or not jnp.issubdtype(val.dtype, jnp.inexact):
            raise ValueError(f"loss_fn must return a floating scalar (shape ()), got {val}")
        jitted = self._loss_jits.get(loss_fn)
        if jitted is None:
            vg = jax.value_and_grad(loss_fn)
            jitted = jax.jit(vg, out_shardings=(None, self.activation_sharding))
            self._loss_jits[loss_fn] = jitted
        return jitted

    def _track(self, tree, stage: int) -> None:
        if not self.track_residency:
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

    def _run(self, h, *, train: bool, loss_exe=None, cotangent=None, loss_args=()):
        self._check_input(h)
        n, k = self.num_stages, self.prefetch_depth
        donate = self.donate and not self.trace
        # compile everything before the first transfer (errors surface before state changes)
        save = train and self.remat is not True
        fwd = [self._exe("forward-save" if save else "forward", i, False) for i in range(n)]
        bwd = [self._exe("backward-saved" if save else "backward", i, donate) for i in range(n)] if train else None
        if save:
            self.residual_nbytes = [tree_nbytes(e.out_info[1]) for e in fwd]

        self.residency_trace = []
        watcher = None
        if self.trace:
            self.trace_t0 = time.perf_counter()
            watcher = _Watcher(self.trace_t0)
        try:
            return self._stream(h, fwd, bwd, watcher, n, k, train, donate, loss_exe, cotangent, loss_args)
        finally:
            if watcher is not None:
                self.last_trace = watcher.close()

    def _fetch(self, q: dict, j: int, pass_name: str, watcher) -> None:
        ev = StageEvent(pass_name, j, "h2d", watcher.now()) if watcher else None
        p = jax.device_put(self.host_params[j], self._dev_sh[j])
        self._track(p, j)
        q[j] = p
        if watcher:
            watcher.add(ev, p)

    def _stream(self, h, fwd, bwd, watcher, n, k, train, donate, loss_exe, cotangent, loss_args):
        throttle = self.throttle
        save = train and self.remat is not True
        saved: list = [None] * n
        x = jax.device_put(h, self.activation_sharding)
        # Forward. In training, the last k stages stay resident for the start of the backward.
        keep = set(range(max(0, n - k), n)) if train else set()
        q: dict[int, Any] = {}
        for j in range(min(k, n)):
            self._fetch(q, j, "forward", watcher)
        acts = [x] if train else None
        for i in range(n):
            p = q[i]
            ev = StageEvent("forward", i, "compute", watcher.now()) if watcher else None
            if save:
                y, saved[i] = fwd[i](p, x)
            else:
                y = fwd[i](p, x)
            if watcher:
                watcher.add(ev, y)
            if throttle:
                jax.block_until_ready(x)  # stage i-1 done: its weights' memory is free
            if i + k < n:
                self._fetch(q, i + k, "forward", watcher)
            self._record("forward", i)
            if i not in keep:
                del q[i]
            del p
            x = y
            if train:
                acts.append(y)
        if not train:
            return (x,)

        out = acts.pop()  # acts[i] is now the input of stage i
        if cotangent is None:
            loss, g = loss_exe(out, *loss_args)
            first = loss
        else:
            g = jax.device_put(cotangent, self.activation_sharding, may_alias=False)
            first = out
        del out
        host_grads: list = [None] * n
        prev_host = None
        for j in range(n - 1, max(-1, n - 1 - k), -1):
            if j not in q:
                self._fetch(q, j, "backward", watcher)
        for i in range(n - 1, -1, -1):
            p = q.pop(i)
            xi = acts[i]
            acts[i] = None
            ev = StageEvent("backward", i, "compute", watcher.now()) if watcher else None
            if save:
                si, saved[i] = saved[i], None
                g, dp = bwd[i](p, xi, si, g)
                del si
            else:
                g, dp = bwd[i](p, xi, g)
            del xi
            if watcher:
                watcher.add(ev, (g, dp))
            self._track(dp, i)
            ev = StageEvent("backward", i, "d2h", watcher.now()) if watcher else None
            hg = jax.device_put(dp, self._host_sh[i])
            host_grads[i] = hg
            if watcher:
                watcher.add(ev, hg)
            if throttle and prev_host is not None:
                jax.block_until_ready(prev_host)  # stage i+1's gradients are on the host
            if i - k >= 0:
                self._fetch(q, i - k, "backward", watcher)
            self._record("backward", i)
            del p, dp
            prev_host = hg
        return first, g, host_grads
