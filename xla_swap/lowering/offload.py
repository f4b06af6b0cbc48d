"""Host-offload annotation ops for torch_xla tensors that compile under SPMD.

XLA marks memory moves with ``custom-call(x), custom_call_target="annotate_device_placement",
frontend_attributes={_xla_buffer_placement="pinned_host"|"device"}`` (the form JAX emits).
torch_xla 2.9's ``place_to_host`` / ``place_to_device`` emit it without a ``sharding``, so the
SPMD partitioner rejects it (``Side-effect HLO must have sharding``), and its IR node hashes
only the call target, so the two directions collide in torch_xla's graph hash (measured; see
docs/explanation/measured-facts.md). Here each annotation is a tiny StableHLO module (custom call + sharding +
placement) applied with torch_xla's ``_xla_user_computation`` (through
:mod:`xla_swap._compat.torch_xla`): the IR node's hash is the hash of that
module, so direction and sharding are part of it, and the custom call carries its sharding.

Under SPMD an operand whose sharding torch_xla does not know (an intermediate of a traced
function, e.g. a named activation inside ``scan``) is annotated with XLA's internal form
instead, ``custom-call(x), custom_call_target="MoveToHost"|"MoveToDevice"`` (what XLA's
``ConvertMemoryPlacementToInternalAnnotations`` turns ``annotate_device_placement`` into; no
side effect, no sharding). XLA's sharding propagation passes an operand's sharding through
these targets, so each gets the activation's own slice of the mesh and the partitioner adds no
collective. ``annotate_device_placement`` itself cannot take that route: without a sharding
torch_xla 2.9's partitioner refuses it (``Side-effect HLO must have sharding``), with
``{replicated}`` likewise, and with a tiled one its default handler refuses a side-effecting
call (``Side-effect ops cannot be replicated``); measured, docs/explanation/measured-facts.md section 9.

The ops are ``torch.library`` custom ops (``torch.ops.xla_swap.*``) with fake kernels and
autograd formulas, so AOTAutograd (which torch_xla's ``scan`` uses) traces them:

* ``place_to_host(x)``: backward brings the gradient back to the device.
* ``place_to_device(x)``: backward sends the gradient to the host when ``grad_to_host`` is set,
  otherwise leaves it on the device.
* ``offload_name(x, name)``: identity that tags an activation (torchprime style); the
  partitioner of :mod:`xla_swap.lowering.scan` saves tagged tensors according to the policy.

Backend capability: torch_xla's own CPU runtime cannot run the annotations (no host-offload
passes; ``Unknown custom-call API version``, and for the internal form ``No registered
implementation for untyped custom call to MoveToHost``, measured). Unless :func:`annotations_enabled`
says otherwise, the ops lower to identity and log one warning; inside
:func:`emit_annotations` (used when lowering for the PJRT executor) they are always emitted,
and on such a runtime only while a graph is built for lowering (:func:`lowering_scope`, which
``lower_fn`` enters): a pending annotated tensor the runtime ran would fail, and fail every
later ``torch_xla.sync()`` while it lives.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import re

import torch
import torch_xla.runtime as xr

from xla_swap._compat import torch_xla as _ctx   # every private torch_xla API used here
from xla_swap.lowering._checks import check_bool, check_name, check_sharding, check_xla_tensor

log = logging.getLogger(__name__)

#: The custom-call target of the placement annotations in the HLO.
ANNOTATION_TARGET = "annotate_device_placement"
#: XLA's internal host-offload targets, emitted for an operand of unknown sharding under SPMD.
MOVE_TO_HOST, MOVE_TO_DEVICE = "MoveToHost", "MoveToDevice"
#: Every custom-call target the annotation ops emit.
ANNOTATION_TARGETS = (ANNOTATION_TARGET, MOVE_TO_HOST, MOVE_TO_DEVICE)
# The sharding key of an annotation whose sharding XLA's propagation gives (internal target).
_PROPAGATED = "propagated"

_MLIR_DTYPES = {
    torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64",
    torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "ui8", torch.bool: "i1",
}
# Process-wide, not thread-local: autograd runs the backward of XLA tensors on its own threads.
_forced: list = [None]
_lowering: list = [0]   # depth of lowering_scope(), process-wide like _forced
_warned = []


@contextlib.contextmanager
def emit_annotations(enabled: bool = True):
    """Force the annotation ops to emit (``True``) or drop (``False``) their custom calls.

    Used around tracing/lowering whose HLO goes to the PJRT executor (which honours
    ``pinned_host``), whatever the torch_xla runtime could run. Re-entrant. Process-wide, not
    thread-local, because autograd runs the backward of XLA tensors on its own threads.
    Calling a :class:`~xla_swap.lowering.computation.LoweredComputation` that holds the emitted
    annotations on a runtime that cannot compile them raises a ``ValueError`` naming the
    custom call, before anything runs; so does an annotation op called here outside a lowering
    (:func:`lowering_scope`) on such a runtime, before its custom call enters the lazy graph.

    Args:
      enabled: ``True`` to emit, ``False`` to drop.

    Raises:
      TypeError: ``enabled`` is not a bool (on entry).
    """
    enabled = check_bool(enabled, "enabled")
    prev = _forced[0]
    _forced[0] = enabled
    try:
        yield
    finally:
        _forced[0] = prev


@contextlib.contextmanager
def lowering_scope():
    """Declare that the tensors built in the block are lowered (``lower`` / ``lower_fn``), not run.

    Inside :func:`emit_annotations` on a runtime that cannot compile the annotations
    (:func:`runtime_supports_annotations` False), :func:`place_to_host` / :func:`place_to_device`
    emit them only inside this block: their HLO is meant for
    :class:`~xla_swap.executors.PjrtExecutor`. :func:`~xla_swap.lowering.lower_fn` enters it
    around tracing ``fn``; enter it yourself to build annotated outputs for
    :func:`~xla_swap.lowering.lower`, and run none of them in torch_xla (``.cpu()``,
    ``torch_xla.sync()`` while they live): the runtime would fail on them. Re-entrant;
    process-wide, as :func:`emit_annotations`.
    """
    _lowering[0] += 1
    try:
        yield
    finally:
        _lowering[0] -= 1


def runtime_supports_annotations() -> bool:
    """Whether the torch_xla runtime of this process can compile ``annotate_device_placement``.

    True on TPU (its compiler has the host-offload passes) or when the environment variable
    ``XLA_SWAP_ANNOTATIONS=1`` says so; False on CPU (measured: torch_xla 2.9's CPU compiler
    fails) and on other devices, where it is unproven. ``XLA_SWAP_ANNOTATIONS=0`` forces False.
    """
    env = os.environ.get("XLA_SWAP_ANNOTATIONS")
    if env is not None:
        return env == "1"
    return xr.device_type() == "TPU"


def annotations_enabled() -> bool:
    """True when the ops emit custom calls now: inside :func:`emit_annotations` or on a capable runtime."""
    if _forced[0] is not None:
        return _forced[0]
    supported = runtime_supports_annotations()
    if not supported and not _warned:
        _warned.append(True)
        log.warning("xla_swap: the torch_xla %s runtime cannot compile host-offload annotations; they are "
                    "dropped (values and gradients are unchanged). Lower with xla_swap.lower_fn / "
                    "emit_annotations() and run with the PJRT executor for real host memory.",
                    xr.device_type())
    return supported


def slice_sharding(stacked: str) -> str:
    """Sharding string of one slice ``x[i]`` of a stacked tensor ``x`` with sharding ``stacked``.

    ``'{devices=[1,4,1]0,1,2,3}'`` -> ``'{devices=[4,1]0,1,2,3}'``; replicated stays replicated.

    Raises:
      ValueError: the stacked (layer) dimension itself is sharded: each device would hold only
        some layers, and a per-layer slice would need a gather; shard another dimension.
    """
    if stacked in ("", "{replicated}") or "devices=" not in stacked:
        return stacked or "{replicated}"
    m = re.match(r"\{devices=\[([0-9,]+)\](.*)\}$", stacked)
    if not m:
        raise ValueError(f"sharding: cannot parse OpSharding string {stacked!r}")
    dims = m.group(1).split(",")
    if dims[0] != "1":
        raise ValueError(f"sharding: the stacked layer dimension (dim 0) is sharded in {stacked!r}; "
                         "xla_swap swaps whole layers, so shard another dimension")
    return "{devices=[" + ",".join(dims[1:]) + "]" + m.group(2) + "}"


@functools.lru_cache(maxsize=None)
def _annotation_computation(shape: tuple, dtype: torch.dtype, placement: str, sharding: str):
    """The XLA computation ``x -> annotate_device_placement(x)`` for one shape/dtype/placement/sharding."""
    from xla_swap._compat import jax as _cj  # jaxlib parses StableHLO into an HloModuleProto

    if dtype not in _MLIR_DTYPES:
        raise TypeError(f"x: dtype {dtype} is not supported by the offload annotations "
                        f"(supported: {', '.join(map(str, _MLIR_DTYPES))})")
    ty = f"tensor<{'x'.join(map(str, shape)) + 'x' if shape else ''}{_MLIR_DTYPES[dtype]}>"
    if sharding == _PROPAGATED:
        target = MOVE_TO_HOST if placement == "pinned_host" else MOVE_TO_DEVICE
        attrs = f'mhlo.frontend_attributes = {{_xla_buffer_placement = "{placement}"}}'
    else:
        target = ANNOTATION_TARGET
        attrs = f'has_side_effect = true, mhlo.frontend_attributes = {{_xla_buffer_placement = "{placement}"}}'
        if sharding:
            attrs += f', mhlo.sharding = "{sharding}"'
    text = (f"module @xla_swap_to_{placement} {{\n"
            f"  func.func public @main(%arg0: {ty}) -> {ty} {{\n"
            f"    %0 = stablehlo.custom_call @{target}(%arg0) {{{attrs}}} : ({ty}) -> {ty}\n"
            f"    return %0 : {ty}\n  }}\n}}")
    return _ctx.computation_from_hlo_proto(f"xla_swap_to_{placement}", _cj.stablehlo_to_hlo_proto(text))


def _annotate(x: torch.Tensor, placement: str, sharding: str) -> torch.Tensor:
    if x.device.type != "xla":
        raise TypeError(f"x: expected a tensor on an XLA device, got a tensor on {x.device}")
    if not annotations_enabled():
        return x.clone()
    if not _lowering[0] and not runtime_supports_annotations():
        # Refused before the custom call enters the lazy graph: a pending annotated tensor breaks
        # every later sync of this process while it lives ("Check failed: tensor_data").
        op = "place_to_host" if placement == "pinned_host" else "place_to_device"
        raise ValueError(f"x: {op} under emit_annotations(True), outside a lowering: the torch_xla "
                         f"{xr.device_type()} runtime of this process cannot run its {' / '.join(ANNOTATION_TARGETS)} "
                         f"custom call (runtime_supports_annotations() is False), and a pending annotated tensor "
                         f"would leave every later torch_xla.sync() failing. Call it in a function traced by "
                         f"lower_fn (or in lowering_scope() before lower) and run the HLO with "
                         f"xla_swap.executors.PjrtExecutor, or drop emit_annotations(True) (the op is then the "
                         f"identity)")
    if xr.is_spmd():
        # The sharding given, else x's own. An intermediate of a traced function has none:
        # the internal target then takes the operand's from XLA's sharding propagation.
        sharding = sharding or _ctx.sharding_spec(x) or _PROPAGATED
    else:
        sharding = ""
    comp = _annotation_computation(tuple(x.shape), x.dtype, placement, sharding)
    return _ctx.user_computation(f"xla_swap::to_{placement}", [x], comp)[0]


def _check_annotated(x, sharding, where: str = "x") -> None:
    check_xla_tensor(x, where)
    if x.dtype not in _MLIR_DTYPES:
        raise TypeError(f"{where}: dtype {x.dtype} is not supported by the offload annotations "
                        f"(supported: {', '.join(map(str, _MLIR_DTYPES))})")
    check_sharding(sharding, "sharding", x.dim(), xr.global_runtime_device_count())


@torch.library.custom_op("xla_swap::place_to_host", mutates_args=())
def _place_to_host_op(x: torch.Tensor, sharding: str = "") -> torch.Tensor:
    return _annotate(x, "pinned_host", sharding)


@torch.library.custom_op("xla_swap::place_to_device", mutates_args=())
def _place_to_device_op(x: torch.Tensor, sharding: str = "", grad_to_host: bool = False) -> torch.Tensor:
    return _annotate(x, "device", sharding)


@torch.library.custom_op("xla_swap::offload_name", mutates_args=())
def _offload_name_op(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.clone()


def place_to_host(x: torch.Tensor, sharding: str = "") -> torch.Tensor:
    """Annotate ``x`` to live in host memory (``pinned_host``) from here on.

    Args:
      x: XLA tensor, any shape; dtypes f32/bf16/f16/f64/i8/i32/i64/u8/bool.
      sharding: OpSharding string for the annotation under SPMD (e.g.
        ``'{devices=[4,1]0,1,2,3}'``, one tile dimension per dimension of ``x``); default
        ``""``: ``x``'s own sharding; when torch_xla knows none (an intermediate of a traced
        function), the annotation is XLA's ``MoveToHost`` / ``MoveToDevice``, which XLA's
        sharding propagation gives ``x``'s sharding as compiled (module docstring).

    Returns:
      A tensor equal to ``x`` (same shape and dtype). Its gradient is moved back to the device.

    Raises:
      TypeError: ``x`` is not a tensor on an XLA device, or its dtype is not supported;
        ``sharding`` is not a str.
      ValueError: ``sharding`` is not an OpSharding string, its tiling does not fit ``x``, it
        lists a device twice or names a device id not below the runtime's device count; inside
        :func:`emit_annotations` on a runtime that cannot run the annotation, outside
        :func:`lowering_scope` / ``lower_fn`` (before anything enters the lazy graph).
    """
    _check_annotated(x, sharding)
    return torch.ops.xla_swap.place_to_host(x, sharding)


def place_to_device(x: torch.Tensor, sharding: str = "", grad_to_host: bool = False) -> torch.Tensor:
    """Annotate ``x`` (a host-resident value) to be brought to device memory.

    Args:
      x: XLA tensor, as in :func:`place_to_host`.
      sharding: as in :func:`place_to_host`.
      grad_to_host: when True the gradient of ``x`` is sent to host memory (for swapped
        parameters whose gradients live on the host); otherwise it stays on the device.

    Returns:
      A tensor equal to ``x``.

    Raises:
      TypeError: as in :func:`place_to_host`; ``grad_to_host`` is not a bool.
      ValueError: as in :func:`place_to_host`.
    """
    _check_annotated(x, sharding)
    grad_to_host = check_bool(grad_to_host, "grad_to_host")
    return torch.ops.xla_swap.place_to_device(x, sharding, grad_to_host)


def offload_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """Tag activation ``x`` with ``name`` (identity), torchprime-style.

    An :class:`~xla_swap.planning.OffloadPolicy` decides, per name, whether the scan helpers
    save the tagged tensor on the host, on the device, or recompute it in the backward pass.

    Args:
      x: a tensor (any device: on CPU it is a plain identity, e.g. in a reference loop).
      name: the activation's name, a non-empty str.

    Returns:
      A tensor equal to ``x``.

    Raises:
      TypeError: ``x`` is not a tensor; ``name`` is not a str.
      ValueError: ``name`` is empty.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    check_name(name, "name", identifier=False)
    return torch.ops.xla_swap.offload_name(x, name)


for _op in (_place_to_host_op, _place_to_device_op):
    _op.register_fake(lambda x, sharding="", *a: torch.empty_like(x))
_offload_name_op.register_fake(lambda x, name: torch.empty_like(x))


def _setup(ctx, inputs, output):
    ctx.args = inputs[1:]


_place_to_host_op.register_autograd(
    lambda ctx, g: (torch.ops.xla_swap.place_to_device(g, ctx.args[0], False), None), setup_context=_setup)
_place_to_device_op.register_autograd(
    lambda ctx, g: ((torch.ops.xla_swap.place_to_host(g, ctx.args[0]) if ctx.args[1] else g), None, None),
    setup_context=_setup)
_offload_name_op.register_autograd(lambda ctx, g: (g, None), setup_context=_setup)

PLACE_TO_HOST = torch.ops.xla_swap.place_to_host.default
PLACE_TO_DEVICE = torch.ops.xla_swap.place_to_device.default
OFFLOAD_NAME = torch.ops.xla_swap.offload_name.default
