"""Lower part of a torch_xla program and map every HLO parameter to its device-backed tensor.

``torch_xla._XLAC.lowering.LoweringContext`` has two ways to ask which tensor feeds an HLO
parameter. ``parameter_id_tensor_mapping()`` copies every parameter to the host (and runs
``ReplicateShardedData`` for every sharded one first); ``device_parameter_id_tensor_mapping()``
(pytorch/xla #8460) returns the device data itself. This module only uses the latter, and
:func:`host_transfer_guard` lets tests and scripts prove it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from typing import Callable, Iterator, Sequence

import torch
import torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla.debug.metrics as met

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


@contextlib.contextmanager
def host_transfer_guard(counters: Sequence[str] = HOST_TRANSFER_COUNTERS, *, raise_on_transfer: bool = True
                        ) -> Iterator[dict]:
    """Fail if torch_xla moves data from the device to the host inside the ``with`` block.

    Reads torch_xla's metrics (``torch_xla.debug.metrics``) on entry and exit; it does not
    clear them, so other metric readers in the process are unaffected.

    Args:
      counters: torch_xla counter or metric names to watch. Default:
        ``TransferFromDeviceTime`` (any device-to-host copy) and ``ReplicateShardedData``
        (an SPMD-sharded tensor gathered to one device, the step before a host copy).
      raise_on_transfer: if False, only record; the caller inspects the yielded dict.

    Yields:
      A dict ``{counter_name: increments seen inside the block}``, filled on exit.

    Raises:
      HostTransferError: on exit, when any watched counter increased; the message names
        each offending counter and by how much.
    """
    counters = tuple(counters)
    if not counters or not all(isinstance(c, str) and c for c in counters):
        raise ValueError(f"counters: expected a non-empty sequence of metric names, got {counters!r}")
    before = {c: _metric_count(c) for c in counters}
    seen: dict = {}
    yield seen
    for c in counters:
        seen[c] = _metric_count(c) - before[c]
    offending = {c: n for c, n in seen.items() if n}
    if offending and raise_on_transfer:
        what = ", ".join(f"{c} +{n}" for c, n in offending.items())
        raise HostTransferError(f"device-to-host transfer inside host_transfer_guard: {what}")


def _check_xla_tensor(t, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor on an XLA device, got {type(t).__name__}")
    if t.device.type != "xla":
        raise TypeError(f"{where}: expected a tensor on an XLA device, got a tensor on {t.device} "
                        f"(move it with .to(torch_xla.device()))")


def sharding_spec(t: torch.Tensor) -> str:
    """The OpSharding string torch_xla reports for ``t`` (e.g. ``'{devices=[4,1]0,1,2,3}'``).

    Returns ``'{replicated}'`` for a tensor without a sharding annotation.
    """
    return torch_xla._XLAC._get_xla_sharding_spec(t) or "{replicated}"


def data_handle(t: torch.Tensor) -> int:
    """The runtime handle of the device data behind ``t``: equal handles mean the same device buffer."""
    return torch_xla._XLAC._get_tensors_handle([t])[0]


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
    backward recomputes the forward in torch_xla and calls ``torch.autograd.grad``.
    """

    @staticmethod
    def forward(ctx, lowered, *inputs):
        ctx.lowered = lowered
        ctx.save_for_backward(*inputs)
        return tuple(lowered._run(inputs))

    @staticmethod
    def backward(ctx, *grad_outputs):
        needs = ctx.needs_input_grad[1:]
        inputs = [x.detach().requires_grad_(n) for x, n in zip(ctx.saved_tensors, needs)]
        with torch.enable_grad():
            outs = ctx.lowered._call_fn(inputs)
        diff = [x for x in inputs if x.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], diff, [g for _, g in pairs], allow_unused=True)
        it = iter(grads)
        return (None,) + tuple(next(it) if x.requires_grad else None for x in inputs)


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

    def __init__(self, name, hlo_proto, parameters, inputs, outputs, fn=None):
        self.name = name
        self.hlo_proto = hlo_proto
        self.parameters = parameters
        self.output_shapes = [tuple(o.shape) for o in outputs]
        self.output_dtypes = [o.dtype for o in outputs]
        self._input_meta = [(tuple(x.shape), x.dtype) for x in inputs]
        self._fn = fn
        self._computation = xb.computation_from_module_proto(name, hlo_proto)
        self.hlo_text = xb.get_computation_hlo(self._computation)
        self._handles = {data_handle(p.tensor): p.id for p in parameters}
        self._input_ids = {id(x): i for i, x in enumerate(inputs)}

    # -- table queries -------------------------------------------------------------------
    def parameter_id(self, tensor: torch.Tensor) -> int:
        """The HLO parameter id fed by ``tensor`` (an input or a captured tensor).

        Raises:
          TypeError: ``tensor`` is not an XLA tensor.
          ValueError: ``tensor`` does not feed any parameter of this lowering.
        """
        _check_xla_tensor(tensor, "tensor")
        if id(tensor) in self._input_ids:
            return self.input_parameters[self._input_ids[id(tensor)]].id
        if torch_xla._XLAC._get_tensors_xla_device_data_node([tensor])[1]:
            pid = self._handles.get(data_handle(tensor))
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
            _check_xla_tensor(x, f"inputs[{i}]")
            if x.dtype != dtype:
                raise TypeError(f"inputs[{i}]: expected dtype {dtype}, got {x.dtype}")
            if tuple(x.shape) != shape:
                raise ValueError(f"inputs[{i}]: expected shape {list(shape)}, got {list(x.shape)}")

    def _run(self, inputs) -> list:
        args = [p.tensor for p in self.parameters]
        for p in self.input_parameters:
            args[p.id] = inputs[p.input_index]
        return torch_xla._XLAC._xla_user_computation(f"xla_swap::{self.name}", args, self._computation)

    def _call_fn(self, inputs):
        outs = self._fn(*inputs)
        return list(outs) if isinstance(outs, (list, tuple)) else [outs]

    def __call__(self, *inputs: torch.Tensor) -> list:
        """Execute the lowered computation lazily in the torch_xla runtime on new inputs.

        Captured parameters are fed from the table (their current device data).

        Args:
          *inputs: XLA tensors with the shapes and dtypes of the example inputs.

        Returns:
          list of XLA tensors, one per output (lazy, like any torch_xla result).

        Raises:
          ValueError: wrong number of inputs or a wrong shape (names ``inputs[i]``); an input
            requires grad but the computation was lowered from tensors (forward-only).
          TypeError: an input is not an XLA tensor or has the wrong dtype.
        """
        self._check_inputs(inputs)
        needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
        if not needs_grad:
            return list(self._run(inputs))
        if self._fn is None:
            raise ValueError("inputs: an input requires grad, but this computation was lowered from tensors "
                             "(forward-only); lower it with lower_fn(fn, *inputs) to get gradients")
        return list(_RecomputeVJP.apply(self, *inputs))

    execute = __call__


def _materialize(tensors) -> None:
    """Make ``tensors`` device data (execute their pending graphs), without syncing anything else."""
    pending = [t for t in tensors if not torch_xla._XLAC._get_tensors_xla_device_data_node([t])[1]]
    if pending:
        torch_xla._XLAC._xla_sync_multi(pending, devices=[], wait=True)


def lower(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor] = (), *, name: str | None = None,
          _fn: Callable | None = None) -> LoweredComputation:
    """Lower the pending torch_xla graph that produces ``outputs`` into an HLO module.

    Args:
      outputs: non-empty sequence of XLA tensors (lazy results) to lower.
      inputs: XLA tensors that the caller will replace at execution time. Each must be device
        data (it is materialised here if it still has a pending graph) and must feed a
        parameter of the lowering. Every other device tensor the graph reads is ``captured``.
      name: the HLO module name (letters, digits, ``_``); a unique one is made if None.

    Returns:
      :class:`LoweredComputation`.

    Raises:
      ValueError: ``outputs`` is empty; an input is not read by the graph of ``outputs``;
        ``name`` is not an identifier.
      TypeError: an output or input is not a tensor on an XLA device.
    """
    outputs, inputs = list(outputs), list(inputs)
    if not outputs:
        raise ValueError("outputs: expected at least one XLA tensor to lower, got an empty sequence")
    for i, t in enumerate(outputs):
        _check_xla_tensor(t, f"outputs[{i}]")
    for i, t in enumerate(inputs):
        _check_xla_tensor(t, f"inputs[{i}]")
    if name is None:
        name = f"xla_swap_lowered_{next(_names)}"
    if not name.isidentifier():
        raise ValueError(f"name: expected an identifier (letters, digits, '_'), got {name!r}")
    _materialize(inputs)
    ctx = torch_xla._XLAC.lowering.LoweringContext(name)
    ctx.build(outputs)
    input_ids = [ctx.tensor_parameter_id(x) for x in inputs]
    for i, pid in enumerate(input_ids):
        if pid < 0:
            raise ValueError(f"inputs[{i}]: shape {list(inputs[i].shape)} is not read by the graph of outputs, "
                             f"so it feeds no HLO parameter of '{name}'")
    by_id = {pid: i for i, pid in enumerate(input_ids)}
    params = []
    for pid, t in sorted(ctx.device_parameter_id_tensor_mapping().items()):
        params.append(HloParameter(
            id=pid, tensor=t, shape=tuple(t.shape), dtype=t.dtype, nbytes=t.numel() * t.element_size(),
            sharding=sharding_spec(t), kind="input" if pid in by_id else "captured", input_index=by_id.get(pid)))
    lowered = LoweredComputation(name, ctx.hlo(), params, inputs, outputs, fn=_fn)
    log.debug("lowered %s: %d parameters, %d bytes", name, len(params), lowered.total_bytes)
    return lowered


def lower_fn(fn: Callable, *example_inputs: torch.Tensor, name: str | None = None) -> LoweredComputation:
    """Trace ``fn(*example_inputs)`` lazily and lower it; inputs become ``input`` parameters.

    The result can be called on new inputs of the same shapes and dtypes; when an input
    requires grad, the backward recomputes ``fn`` in torch_xla and differentiates it.

    Args:
      fn: a function of XLA tensors returning a tensor or a tuple/list of tensors.
      *example_inputs: XLA tensors; only their values' shapes/dtypes matter afterwards.
      name: as in :func:`lower`.

    Raises:
      TypeError: ``fn`` is not callable, an input is not an XLA tensor, or ``fn`` returns
        something other than XLA tensors.
      ValueError: as in :func:`lower`, e.g. ``fn`` ignores one of its inputs.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    for i, t in enumerate(example_inputs):
        _check_xla_tensor(t, f"example_inputs[{i}]")
    _materialize(example_inputs)
    detached = [x.detach() for x in example_inputs]
    with torch.no_grad():
        outs = fn(*detached)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return lower(outs, detached, name=name, _fn=fn)
