"""Lower part of a torch_xla program and map every HLO parameter to its device-backed tensor.

torch_xla's ``LoweringContext`` (``torch_xla._XLAC.lowering``) has two ways to ask which tensor feeds an HLO
parameter. ``parameter_id_tensor_mapping()`` copies every parameter to the host (and runs
``ReplicateShardedData`` for every sharded one first); ``device_parameter_id_tensor_mapping()``
(pytorch/xla #8460) returns the device data itself. This module only uses the latter, and
:func:`host_transfer_guard` lets tests and scripts prove it. The private torch_xla calls go
through :mod:`xla_swap._compat.torch_xla`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from typing import Callable, Iterator, Sequence

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch.overrides import TorchFunctionMode

from xla_swap._compat import torch_xla as _ctx   # every private torch_xla / torch API used here
from xla_swap.lowering._checks import (buffer_deleted, check_bool, check_callable, check_name, check_tensor_list,
                                       check_xla_tensor, describe_fn, needs_materialization)
from xla_swap.lowering.offload import ANNOTATION_TARGETS, lowering_scope, runtime_supports_annotations

log = logging.getLogger(__name__)

#: torch_xla metrics that mean data went from the device to the host.
HOST_TRANSFER_COUNTERS = ("TransferFromDeviceTime", "ReplicateShardedData")

_names = itertools.count()


class HostTransferError(RuntimeError):
    """A device-to-host transfer happened inside :func:`host_transfer_guard`."""


def _metric_count(name: str) -> int:
    """Number of times torch_xla recorded ``name`` (a counter or a timing metric); 0 if never."""
    value = met.counter_value(name)
    if value is not None:
        return int(value)
    data = met.metric_data(name)
    return int(data[0]) if data is not None else 0


def _check_counters(counters) -> tuple:
    if isinstance(counters, (str, bytes)) or not isinstance(counters, (list, tuple)):
        raise TypeError(f"counters: expected a list or tuple of metric names, got {type(counters).__name__} "
                        f"{counters!r}")
    if not counters:
        raise ValueError("counters: expected at least one metric name, got an empty sequence")
    known = set(HOST_TRANSFER_COUNTERS) | set(met.counter_names()) | set(met.metric_names())
    for i, c in enumerate(counters):
        if not isinstance(c, str):
            raise TypeError(f"counters[{i}]: expected a metric name (str), got {type(c).__name__}")
        if c not in known:
            raise ValueError(f"counters[{i}]: {c!r} is not a torch_xla metric this process knows; expected one of "
                             f"{', '.join(HOST_TRANSFER_COUNTERS)} or a recorded metric "
                             f"(torch_xla.debug.metrics.counter_names() / metric_names())")
    return tuple(counters)


@contextlib.contextmanager
def host_transfer_guard(counters: Sequence[str] = HOST_TRANSFER_COUNTERS, *, raise_on_transfer: bool = True
                        ) -> Iterator[dict]:
    """Fail if torch_xla moves data from the device to the host inside the ``with`` block.

    Reads torch_xla's metrics (``torch_xla.debug.metrics``) on entry and exit; it does not
    clear them, so other metric readers in the process are unaffected.

    Args:
      counters: a list or tuple of torch_xla counter or metric names to watch (one name is
        not accepted: ``("TransferFromDeviceTime",)``). Default: ``TransferFromDeviceTime``
        (any device-to-host copy) and ``ReplicateShardedData`` (an SPMD-sharded tensor
        gathered to one device, the step before a host copy). A name must be one of
        :data:`HOST_TRANSFER_COUNTERS` or a metric torch_xla has already recorded in this
        process, so a misspelt name cannot make the guard silently never fire.
      raise_on_transfer: if False, only record; the caller inspects the yielded dict.

    Yields:
      A dict ``{counter_name: increments seen inside the block}``, filled on exit.

    Raises:
      TypeError: ``counters`` is a string or not a list/tuple of strings;
        ``raise_on_transfer`` is not a bool (on entry).
      ValueError: ``counters`` is empty or names an unknown metric (on entry).
      HostTransferError: on exit, when any watched counter increased; the message names
        each offending counter and by how much.
    """
    counters = _check_counters(counters)
    check_bool(raise_on_transfer, "raise_on_transfer")
    before = {c: _metric_count(c) for c in counters}
    seen: dict = {}
    yield seen
    for c in counters:
        seen[c] = _metric_count(c) - before[c]
    offending = {c: n for c, n in seen.items() if n}
    if offending and raise_on_transfer:
        what = ", ".join(f"{c} +{n}" for c, n in offending.items())
        raise HostTransferError(f"device-to-host transfer inside host_transfer_guard: {what}")


_check_xla_tensor = check_xla_tensor


def sharding_spec(t: torch.Tensor) -> str:
    """The OpSharding string torch_xla reports for ``t`` (e.g. ``'{devices=[4,1]0,1,2,3}'``).

    Returns ``'{replicated}'`` for a tensor without a sharding annotation.
    """
    return _ctx.sharding_spec(t) or "{replicated}"


def data_handle(t: torch.Tensor) -> int:
    """The runtime handle of the device data behind ``t``: equal handles mean the same device buffer."""
    return _ctx.tensor_handles([t])[0]


@dataclasses.dataclass(frozen=True)
class HloParameter:
    """One entry parameter of a lowered HLO module.

    Attributes:
      id: the HLO parameter number (``parameter(id)`` in the HLO).
      tensor: the device-backed ``torch.Tensor`` (XLA device) that feeds it: the same device
        buffer as the source tensor (same :func:`data_handle`), never a host copy.
      shape: the global (unsharded) shape.
      dtype: the torch dtype.
      nbytes: global size in bytes (numel * element size).
      sharding: OpSharding string as torch_xla reports it, ``'{replicated}'`` when unsharded.
      kind: ``'input'`` for a tensor the caller passed as an input, ``'captured'`` for device
        data the lowering hoisted (weights used by the code, scalar constants, RNG seed).
      input_index: position in the caller's inputs for ``kind == 'input'``, else None.
    """

    id: int
    tensor: torch.Tensor
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    sharding: str
    kind: str
    input_index: int | None = None


class _RecomputeVJP(torch.autograd.Function):
    """Forward: run the lowered computation. Backward: re-run ``fn`` eagerly and differentiate it.

    Gradients are those of the traced function (like ``torch.utils.checkpoint``): the
    backward recomputes the forward in torch_xla, with the RNG state the forward's random
    ops used, and calls ``torch.autograd.grad``. ``tensors`` are the call's inputs followed
    by the captured tensors that require grad (so autograd delivers their gradients).
    """

    @staticmethod
    def forward(ctx, lowered, num_inputs, *tensors):
        ctx.lowered, ctx.num_inputs = lowered, num_inputs
        ctx.save_for_backward(*tensors)
        return tuple(lowered.run_graph(tensors[:num_inputs]))

    @staticmethod
    def backward(ctx, *grad_outputs):
        saved = ctx.saved_tensors
        n = ctx.num_inputs
        needs = ctx.needs_input_grad[2:]
        inputs = [x.detach().requires_grad_(need) for x, need in zip(saved[:n], needs[:n])]
        captured = list(saved[n:])  # the user's own leaves: fn reads them, so differentiate w.r.t. them
        with torch.enable_grad(), _rng_state(ctx.lowered.rng_state):
            outs = ctx.lowered.call_fn(inputs)
        targets = [x for x in inputs if x.requires_grad] + [c for c, need in zip(captured, needs[n:]) if need]
        pairs = [(o, g) for o, g in zip(outs, grad_outputs)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True)
                     if pairs and targets else [None] * len(targets))
        return (None, None) + tuple(next(grads) if need else None for need in needs)


@contextlib.contextmanager
def _rng_state(state):
    """Run the block with torch_xla's running RNG state set to ``state``, then restore it.

    Like ``torch.utils.checkpoint``'s RNG preservation: the recomputation draws the same
    random numbers (dropout masks) as the traced forward. ``None``: leave the RNG alone.
    """
    if state is None:
        yield
        return
    device = torch_xla.device()
    before = xm.get_rng_state(device)
    xm.set_rng_state(state, device)
    try:
        yield
    finally:
        xm.set_rng_state(before, device)


class _SourceRecorder(TorchFunctionMode):
    """Records every tensor argument of the torch functions ``fn`` calls while it is traced.

    Among them are the user's own captured tensors (module parameters, buffers, tensors of
    a closure), which the lowering maps back to its ``captured`` parameters by device data.
    """

    def __init__(self):
        super().__init__()
        self.seen: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in _ctx.tree_flatten((args, kwargs))[0]:
            # Plain XLA tensors and parameters only: not the fake/functional tensors of a nested trace.
            if (type(a) is torch.Tensor or isinstance(a, torch.nn.Parameter)) and a.device.type == "xla":
                self.seen.setdefault(id(a), a)
        return func(*args, **kwargs)


class LoweredComputation:
    """A lowered piece of a torch_xla program: HLO plus its device-backed parameter table.

    Build one with :func:`lower` (from output tensors) or :func:`lower_fn` (from a function
    and example inputs). Attributes:

      name: the computation's name.
      hlo_proto: ``bytes``, the serialized ``HloModuleProto`` (what the PJRT executor takes).
      hlo_text: the HLO in assembly syntax.
      parameters: list of :class:`HloParameter`, ordered by parameter id.
      output_shapes / output_dtypes: of the outputs, in order.
    """

    def __init__(self, name, hlo_proto, parameters, inputs, outputs, fn=None, *, sources=None, user_inputs=None,
                 rng_state=None, grad_leaves=()):
        self.name = name
        self.hlo_proto = hlo_proto
        self.parameters = parameters
        self.output_shapes = [tuple(o.shape) for o in outputs]
        self.output_dtypes = [o.dtype for o in outputs]
        self._input_meta = [(tuple(x.shape), x.dtype) for x in inputs]
        self._fn = fn
        self._rng_state = rng_state
        self._computation = _ctx.computation_from_hlo_proto(name, hlo_proto)
        self.hlo_text = _ctx.computation_hlo_text(self._computation)
        self._has_annotations = any(f'custom_call_target="{t}"' in self.hlo_text
                                    for t in ANNOTATION_TARGETS)
        self._handles = {data_handle(p.tensor): p.id for p in parameters}
        # The caller's tensors (kept alive, so their ids stay theirs) -> input index.
        self._user_inputs = list(user_inputs if user_inputs is not None else inputs)
        self._input_ids = {id(x): i for i, x in enumerate(self._user_inputs)}
        # Captured parameter id -> the user's tensor that fed it (lower_fn only): a call reads its current data.
        self._sources = dict(sources or {})
        self._source_ids = {id(t): pid for pid, t in self._sources.items()}
        # Leaf tensors fn reads (directly or through other tensors): the candidates for gradients.
        leaves = list(grad_leaves) + [t for t in self._sources.values() if t.is_leaf]
        self._leaves = list({id(t): t for t in leaves}.values())

    # -- table queries -------------------------------------------------------------------
    def parameter_id(self, tensor: torch.Tensor) -> int:
        """The HLO parameter id fed by ``tensor`` (an input or a captured tensor).

        Raises:
          TypeError: ``tensor`` is not an XLA tensor.
          ValueError: ``tensor`` does not feed any parameter of this lowering, or it is a view
            or a pending computation (not device data of its own).
        """
        check_xla_tensor(tensor, "tensor")
        if id(tensor) in self._input_ids:
            return self.input_parameters[self._input_ids[id(tensor)]].id
        if id(tensor) in self._source_ids:
            return self._source_ids[id(tensor)]
        if needs_materialization(tensor):
            raise ValueError(f"tensor: shape {tuple(tensor.shape)} is a view or a pending computation, not device "
                             f"data, so it feeds no HLO parameter of '{self.name}'; pass the tensor it was made "
                             f"from")
        pid = None if buffer_deleted(tensor) else self._handles.get(data_handle(tensor))
        if pid is not None:
            return pid
        raise ValueError(f"tensor: shape {tuple(tensor.shape)} {tensor.dtype} is not part of the lowering "
                         f"'{self.name}' (it feeds none of its {len(self.parameters)} HLO parameters)")

    @property
    def input_parameters(self) -> list:
        """The parameters fed by the caller's inputs, in input order."""
        return sorted((p for p in self.parameters if p.kind == "input"), key=lambda p: p.input_index)

    @property
    def total_bytes(self) -> int:
        """Sum of all parameters' global sizes, in bytes."""
        return sum(p.nbytes for p in self.parameters)

    def summary(self) -> str:
        """A printable table: id, kind, shape, dtype, bytes, sharding; then count and total bytes."""
        rows = [f"{'id':>3} {'kind':8} {'shape':18} {'dtype':14} {'bytes':>10}  sharding"]
        for p in self.parameters:
            rows.append(f"{p.id:>3} {p.kind:8} {str(list(p.shape)):18} {str(p.dtype):14} {p.nbytes:>10}  {p.sharding}")
        shardings = sorted({p.sharding for p in self.parameters})
        rows.append(f"{len(self.parameters)} HLO parameters, {self.total_bytes} bytes, "
                    f"{len(shardings)} distinct shardings: {', '.join(shardings)}")
        return "\n".join(rows)

    # -- execution -----------------------------------------------------------------------
    def _check_inputs(self, inputs) -> None:
        if len(inputs) != len(self._input_meta):
            raise ValueError(f"inputs: expected {len(self._input_meta)} tensors, got {len(inputs)}")
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self._input_meta)):
            check_xla_tensor(x, f"inputs[{i}]")
            if x.dtype != dtype:
                raise TypeError(f"inputs[{i}]: expected dtype {dtype}, got {x.dtype}")
            if tuple(x.shape) != shape:
                raise ValueError(f"inputs[{i}]: expected shape {list(shape)}, got {list(x.shape)}")

    def _captured_args(self) -> dict:
        """Captured parameter id -> the tensor that feeds it now, checked before anything runs.

        A captured tensor of :func:`lower_fn` is read from the user's tensor as it is now (an
        in-place update after lowering is seen by the forward and the recomputing backward
        alike); other captured entries are the table's device data, which must still exist.
        """
        args = {}
        for p in self.parameters:
            if p.kind != "captured":
                continue
            src = self._sources.get(p.id)
            if src is not None:
                if tuple(src.shape) != p.shape or src.dtype != p.dtype or src.device.type != "xla":
                    raise ValueError(f"captured parameter {p.id}: its tensor is now {list(src.shape)} {src.dtype} on "
                                     f"{src.device}, lowered as {list(p.shape)} {p.dtype}; lower '{self.name}' again")
                args[p.id] = src
            elif buffer_deleted(p.tensor):
                raise ValueError(f"captured parameter {p.id} ({list(p.shape)} {p.dtype}): its device buffer was "
                                 f"deleted after lowering (the tensor was updated in place and its buffer donated); "
                                 f"lower '{self.name}' again, or lower with lower_fn, which reads captured tensors "
                                 f"at call time")
            else:
                args[p.id] = p.tensor
        return args

    def _check_runnable(self) -> None:
        if self._has_annotations and not runtime_supports_annotations():
            raise ValueError(f"'{self.name}' contains {' / '.join(ANNOTATION_TARGETS)} custom calls (xla_swap "
                             f"place_to_host / place_to_device, kept by emit_annotations(True)), which the "
                             f"torch_xla runtime of this process cannot compile; run its hlo_proto with "
                             f"xla_swap.executors.PjrtExecutor, or lower it without emit_annotations(True)")

    @property
    def rng_state(self):
        """torch_xla's running RNG state (an ``int`` seed) when the function was traced, or ``None`` (read-only)."""
        return self._rng_state

    def run_graph(self, inputs) -> list:
        """Queue the lowered HLO on ``inputs`` (XLA tensors, checked by the caller); returns its lazy outputs."""
        captured = self._captured_args()
        args = [captured.get(p.id, p.tensor) for p in self.parameters]
        for p in self.input_parameters:
            args[p.id] = inputs[p.input_index]
        return _ctx.user_computation(f"xla_swap::{self.name}", args, self._computation)

    def call_fn(self, inputs) -> list:
        """Run the traced function (:func:`lower_fn`'s ``fn``) eagerly on ``inputs``; returns its outputs as a list."""
        outs = self._fn(*inputs)
        return list(outs) if isinstance(outs, (list, tuple)) else [outs]

    def __call__(self, *inputs: torch.Tensor) -> list:
        """Execute the lowered computation lazily in the torch_xla runtime on new inputs.

        Captured parameters: with :func:`lower_fn`, each is read from the user's tensor that
        fed it (its current device data, so an in-place update after lowering is used by the
        forward and the recomputing backward alike); with :func:`lower`, from the table.
        Gradients (``lower_fn`` only, when grad mode is on and an input or a captured tensor
        requires grad): the backward recomputes ``fn`` under the RNG state of the trace (the
        forward's dropout masks), and captured leaf tensors that require grad (e.g. an
        ``nn.Module``'s parameters) get their ``.grad`` like in eager mode.

        Args:
          *inputs: XLA tensors with the shapes and dtypes of the example inputs.

        Returns:
          list of XLA tensors, one per output (lazy, like any torch_xla result).

        Raises:
          ValueError: wrong number of inputs or a wrong shape (names ``inputs[i]``); an input
            requires grad but the computation was lowered from tensors (forward-only); a
            captured tensor changed shape/dtype or its buffer was deleted since lowering; the
            HLO holds host-offload annotations the torch_xla runtime cannot compile (the
            message names the custom call). All are raised before anything runs.
          TypeError: an input is not an XLA tensor or has the wrong dtype.
        """
        self._check_inputs(inputs)
        self._check_runnable()
        self._captured_args()  # fail before anything is queued
        grad_on = torch.is_grad_enabled()
        trainable = [t for t in self._leaves if t.requires_grad] if grad_on else []
        needs_grad = grad_on and (any(x.requires_grad for x in inputs) or bool(trainable))
        if not needs_grad:
            return list(self.run_graph(inputs))
        if self._fn is None:
            raise ValueError("inputs: an input requires grad, but this computation was lowered from tensors "
                             "(forward-only); lower it with lower_fn(fn, *inputs) to get gradients")
        return list(_RecomputeVJP.apply(self, len(inputs), *inputs, *trainable))

    execute = __call__


def _materialize(tensors) -> None:
    """Make ``tensors`` device data (execute their pending graphs, views included), without syncing anything else."""
    pending = [t for t in tensors if needs_materialization(t)]
    if pending:
        _ctx.sync_tensors(pending, wait=True)


def _check_lower_args(outputs, inputs, name):
    outputs = check_tensor_list(outputs, "outputs", allow_empty=False)
    inputs = check_tensor_list(inputs, "inputs", allow_empty=True)
    if name is not None:
        check_name(name, "name", identifier=True)
    return outputs, inputs


def _build(outputs, inputs, name, *, fn=None, sources=(), user_inputs=None, rng_state=None,
           grad_leaves=()) -> LoweredComputation:
    if name is None:
        name = f"xla_swap_lowered_{next(_names)}"
    graph = _ctx.lower_graph(name, outputs, inputs)
    input_ids = list(graph.input_parameter_ids)
    for i, pid in enumerate(input_ids):
        if pid < 0:
            raise ValueError(f"inputs[{i}]: shape {list(inputs[i].shape)} is not read by the graph of outputs, "
                             f"so it feeds no HLO parameter of '{name}'")
    by_id = {pid: i for i, pid in enumerate(input_ids)}
    params = []
    for pid, t in sorted(graph.device_parameters.items()):
        params.append(HloParameter(
            id=pid, tensor=t, shape=tuple(t.shape), dtype=t.dtype, nbytes=t.numel() * t.element_size(),
            sharding=sharding_spec(t), kind="input" if pid in by_id else "captured", input_index=by_id.get(pid)))
    # The user's tensors behind captured parameters, matched by device buffer.
    captured = {data_handle(p.tensor): p.id for p in params if p.kind == "captured"}
    by_pid = {}
    for t in sources:
        try:
            if needs_materialization(t) or buffer_deleted(t):
                continue
            pid = captured.get(data_handle(t))
        except RuntimeError:  # not a tensor of the torch_xla runtime (e.g. left over from a nested trace)
            continue
        if pid is not None:
            by_pid.setdefault(pid, t)
    lowered = LoweredComputation(name, graph.hlo_proto, params, inputs, outputs, fn=fn, sources=by_pid,
                                 user_inputs=user_inputs, rng_state=rng_state, grad_leaves=grad_leaves)
    log.debug("lowered %s: %d parameters, %d bytes", name, len(params), lowered.total_bytes)
    return lowered


def lower(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor] = (), *, name: str | None = None,
          _fn: Callable | None = None) -> LoweredComputation:
    """Lower the pending torch_xla graph that produces ``outputs`` into an HLO module.

    Captured parameters are the table's device data (a snapshot): calling the result after
    a captured tensor was updated in place and its buffer donated raises a ``ValueError``;
    :func:`lower_fn` reads captured tensors at call time instead.

    Args:
      outputs: non-empty list or tuple of XLA tensors (lazy results) to lower.
      inputs: list or tuple of XLA tensors that the caller will replace at execution time.
        Each must be device data (not a view or a pending computation: ``torch_xla.sync()``
        it before computing ``outputs``, or use :func:`lower_fn`), must feed a parameter of
        the lowering, and must not be the same device data as another input. Every other
        device tensor the graph reads is ``captured``.
      name: the HLO module name (letters, digits, ``_``); a unique one is made if None.

    Returns:
      :class:`LoweredComputation`.

    Raises:
      ValueError: ``outputs`` is empty; an input is a view or pending computation, is the
        same device data as an earlier input, or is not read by the graph of ``outputs``;
        ``name`` is not an identifier.
      TypeError: ``outputs`` / ``inputs`` is not a list or tuple (e.g. one tensor, None);
        an output or input is not a tensor on an XLA device; ``name`` is not a str.
    """
    if _fn is not None:
        check_callable(_fn, "_fn")
    outputs, inputs = _check_lower_args(outputs, inputs, name)
    seen = {}
    for i, x in enumerate(inputs):
        if needs_materialization(x):
            raise ValueError(f"inputs[{i}]: shape {list(x.shape)} is a view or a pending computation, not device "
                             f"data, so it cannot become an HLO parameter; torch_xla.sync() it before computing "
                             f"outputs, or use lower_fn (which materialises its inputs first)")
        h = data_handle(x)
        if h in seen:
            raise ValueError(f"inputs[{i}]: the same device data as inputs[{seen[h]}]; the graph reads it once, so "
                             f"both would feed one HLO parameter. Pass distinct tensors, or use lower_fn, which "
                             f"gives each input its own parameter")
        seen[h] = i
    return _build(outputs, inputs, name, fn=_fn)


def lower_fn(fn: Callable, *example_inputs: torch.Tensor, name: str | None = None) -> LoweredComputation:
    """Trace ``fn(*example_inputs)`` lazily and lower it; inputs become ``input`` parameters.

    The result can be called on new inputs of the same shapes and dtypes; when an input (or
    a captured tensor) requires grad, the backward recomputes ``fn`` in torch_xla and
    differentiates it, with the forward's RNG state (like ``torch.utils.checkpoint``).
    Every example input gets its own HLO parameter, even when the same tensor is passed
    twice. Inputs that are views or pending computations are materialised first.

    Args:
      fn: a function of XLA tensors returning a tensor or a tuple/list of tensors.
      *example_inputs: XLA tensors; only their values' shapes/dtypes matter afterwards.
      name: as in :func:`lower`.

    Raises:
      TypeError: ``fn`` is not callable, an input is not an XLA tensor, ``name`` is not a
        str, or ``fn`` returns something other than XLA tensors (names ``outputs[i]``).
      ValueError: as in :func:`lower`, e.g. ``fn`` ignores one of its inputs; ``fn`` returns an
        empty tuple or list (no output to lower), raised before anything is lowered.
    """
    check_callable(fn, "fn")
    for i, t in enumerate(example_inputs):
        check_xla_tensor(t, f"example_inputs[{i}]")
    if name is not None:
        check_name(name, "name", identifier=True)
    _materialize(example_inputs)
    detached, seen = [], set()
    for x in example_inputs:
        d = x.detach()
        h = data_handle(d)
        if h in seen:  # the same buffer twice: give this input a buffer (and so a parameter) of its own
            d = _copy(d)
            h = data_handle(d)
        seen.add(h)
        detached.append(d)
    rng_state = xm.get_rng_state(torch_xla.device())
    recorder = _SourceRecorder()
    # Grad mode on, so that the captured leaves that require grad are visible in the trace's graph.
    with torch.enable_grad(), recorder, lowering_scope():
        outs = fn(*detached)
    returned, outs = outs, list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if not outs:   # torch_xla would lower an empty graph: a crash (SIGSEGV) or "No XlaOp with handle"
        raise ValueError(f"fn: {describe_fn(fn)} returned {returned!r}, no tensor; lower_fn needs a function that "
                         f"returns an XLA tensor or a non-empty tuple/list of them")
    for i, o in enumerate(outs):
        check_xla_tensor(o, f"outputs[{i}] (returned by fn)")
    leaves = _grad_leaves(outs)
    sources = list(leaves) + [t for t in recorder.seen.values() if all(t is not d for d in detached)]
    outs = [o.detach() for o in outs]
    return _build(outs, detached, name, fn=fn, sources=sources, user_inputs=list(example_inputs),
                  rng_state=rng_state, grad_leaves=leaves)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of device-data ``t`` in a device buffer of its own (``clone`` would share the buffer)."""
    c = torch.where(torch.ones((), dtype=torch.bool, device=t.device), t, t)
    _materialize([c])
    return c


def _grad_leaves(outs) -> list:
    """The leaf tensors requiring grad that ``outs``' autograd graph reaches (captured weights)."""
    found, seen = [], set()
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            found.append(var)
        stack.extend(n for n, _ in node.next_functions)
    return found
