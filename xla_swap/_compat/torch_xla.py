"""The private torch_xla (and torch) APIs the torch_xla front end calls, each wrapped once.

Imported by :mod:`xla_swap.lowering` only (it imports torch and torch_xla; the executors, the
planner and ``xla_swap.stack`` never import it).

What is wrapped:

* ``torch_xla._XLAC`` (the C++ bindings): :func:`needs_materialization`,
  :func:`tensor_handles`, :func:`sharding_spec`, :func:`user_computation`,
  :func:`sync_tensors`, :func:`lower_graph` (``LoweringContext``).
* ``torch_xla.core.xla_builder``: :func:`computation_from_hlo_proto`,
  :func:`computation_hlo_text`.
* The private helpers of ``torch_xla.experimental.scan_layers``:
  :func:`layer_weights_and_buffers`, :func:`ensure_same_structure`, :func:`one_layer_fn`.
* torch internals the scan helpers build on: ``torch._functorch.partitioners``
  (:func:`default_partition_fn`, :func:`extract_fwd_bwd_modules`) and ``torch.utils._pytree``
  (:func:`tree_flatten`, :func:`tree_unflatten`, :func:`tree_map`).

Verified versions (:data:`VERIFIED`): torch_xla 2.9.0 with torch 2.9.0 (CPU, Python 3.11,
``make test``). A wrapper whose API is missing raises
:class:`~xla_swap._compat.MissingUpstreamAPI` naming it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch_xla

from xla_swap._compat import MissingUpstreamAPI, _resolve

#: The torch_xla / torch versions these wrappers were verified on.
VERIFIED = "torch_xla 2.9.0 with torch 2.9.0"

__all__ = ["VERIFIED", "MissingUpstreamAPI", "LoweredGraph", "needs_materialization", "tensor_handles",
           "sharding_spec", "user_computation", "sync_tensors", "lower_graph", "computation_from_hlo_proto",
           "computation_hlo_text", "layer_weights_and_buffers", "ensure_same_structure", "one_layer_fn",
           "default_partition_fn", "extract_fwd_bwd_modules", "tree_flatten", "tree_unflatten", "tree_map"]


def _installed() -> str:
    return f"torch_xla {getattr(torch_xla, '__version__', '?')} / torch {torch.__version__}"


def _lookup(module: str, path: str = ""):
    """``module.path``; :class:`MissingUpstreamAPI` naming it (and the installed version) when absent."""
    return _resolve(module, path, _installed, VERIFIED)


def _xlac(name: str):
    """``torch_xla._XLAC.<name>``; :class:`MissingUpstreamAPI` naming it when absent."""
    return _lookup("torch_xla", f"_XLAC.{name}")


# ---------------------------------------------------------------------------------------
# torch_xla._XLAC
# ---------------------------------------------------------------------------------------
def needs_materialization(tensors: Sequence[torch.Tensor]) -> list:
    """For each XLA tensor, True when it is not device data itself (a pending computation or a view).

    Wraps ``torch_xla._XLAC._check_tensor_need_materialization``. Verified: :data:`VERIFIED`.
    """
    return [bool(b) for b in _xlac("_check_tensor_need_materialization")(list(tensors))]


def tensor_handles(tensors: Sequence[torch.Tensor]) -> list:
    """The runtime handles (ints) of the device data behind device-data XLA tensors.

    Equal handles mean the same device buffer. Raises the ``RuntimeError`` torch_xla raises
    for a tensor whose buffer was deleted (its message says ``IsDeleted`` / ``is deleted``).
    Wraps ``torch_xla._XLAC._get_tensors_handle``. Verified: :data:`VERIFIED`.
    """
    return list(_xlac("_get_tensors_handle")(list(tensors)))


def sharding_spec(t: torch.Tensor) -> str:
    """The OpSharding string of an XLA tensor (``'{devices=[4,1]0,1,2,3}'``); ``''`` when it has none.

    Wraps ``torch_xla._XLAC._get_xla_sharding_spec``. Verified: :data:`VERIFIED`.
    """
    return _xlac("_get_xla_sharding_spec")(t) or ""


def user_computation(name: str, args: Sequence[torch.Tensor], computation) -> list:
    """Apply a built XLA computation to XLA tensors lazily (one IR node); returns its outputs.

    ``computation`` comes from :func:`computation_from_hlo_proto`; the node's hash is the
    computation's. Wraps ``torch_xla._XLAC._xla_user_computation``. Verified: :data:`VERIFIED`.
    """
    return list(_xlac("_xla_user_computation")(name, list(args), computation))


def sync_tensors(tensors: Sequence[torch.Tensor], *, wait: bool = True) -> None:
    """Execute the pending graphs of ``tensors`` only (nothing else is synced), making them device data.

    Wraps ``torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=wait)``. Verified: :data:`VERIFIED`.
    """
    _xlac("_xla_sync_multi")(list(tensors), devices=[], wait=wait)


@dataclasses.dataclass(frozen=True)
class LoweredGraph:
    """The result of :func:`lower_graph`.

    Attributes:
      hlo_proto: the serialized ``HloModuleProto`` (bytes).
      input_parameter_ids: for each input tensor, the HLO parameter id it feeds (-1: none).
      device_parameters: ``{parameter id: device-data XLA tensor}`` for every parameter: the
        device data itself, never a host copy.
    """
    hlo_proto: bytes
    input_parameter_ids: tuple
    device_parameters: dict


def lower_graph(name: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor] = ()) -> LoweredGraph:
    """Lower the pending graph of ``outputs`` into an HLO module named ``name``, with its device-data parameters.

    Wraps ``torch_xla._XLAC.lowering.LoweringContext`` and its ``build``,
    ``tensor_parameter_id``, ``device_parameter_id_tensor_mapping`` (pytorch/xla #8460; the
    older ``parameter_id_tensor_mapping`` copies every parameter to the host and is not used)
    and ``hlo``. Verified: :data:`VERIFIED`.
    """
    ctx = _xlac("lowering.LoweringContext")(name)
    for method in ("build", "tensor_parameter_id", "device_parameter_id_tensor_mapping", "hlo"):
        if not hasattr(ctx, method):
            raise MissingUpstreamAPI(f"torch_xla._XLAC.lowering.LoweringContext.{method}", _installed(), VERIFIED)
    ctx.build(list(outputs))
    ids = tuple(int(ctx.tensor_parameter_id(x)) for x in inputs)
    params = dict(ctx.device_parameter_id_tensor_mapping())
    return LoweredGraph(ctx.hlo(), ids, params)


# ---------------------------------------------------------------------------------------
# torch_xla.core.xla_builder
# ---------------------------------------------------------------------------------------
def computation_from_hlo_proto(name: str, proto: bytes):
    """An XLA computation (for :func:`user_computation`) built from a serialized ``HloModuleProto``.

    Wraps ``torch_xla.core.xla_builder.computation_from_module_proto``. Verified: :data:`VERIFIED`.
    """
    return _lookup("torch_xla.core.xla_builder", "computation_from_module_proto")(name, proto)


def computation_hlo_text(computation) -> str:
    """The HLO assembly text of an XLA computation from :func:`computation_from_hlo_proto`.

    Wraps ``torch_xla.core.xla_builder.get_computation_hlo``. Verified: :data:`VERIFIED`.
    """
    return _lookup("torch_xla.core.xla_builder", "get_computation_hlo")(computation)


# ---------------------------------------------------------------------------------------
# torch_xla.experimental.scan_layers (private helpers)
# ---------------------------------------------------------------------------------------
_SCAN_LAYERS = "torch_xla.experimental.scan_layers"


def layer_weights_and_buffers(layer: torch.nn.Module) -> tuple:
    """``(parameters, buffers)`` of an ``nn.Module``, two dicts by name, as torch_xla's ``scan_layers`` stacks them.

    Wraps ``torch_xla.experimental.scan_layers._extract_weights_and_buffers``. Verified: :data:`VERIFIED`.
    """
    return _lookup(_SCAN_LAYERS, "_extract_weights_and_buffers")(layer)


def ensure_same_structure(dicts: Sequence[dict]) -> None:
    """Raise ``ValueError`` unless the dicts of tensors have the same names and shapes (the layers' weights).

    Wraps ``torch_xla.experimental.scan_layers._ensure_same_structure``. Verified: :data:`VERIFIED`.
    """
    _lookup(_SCAN_LAYERS, "_ensure_same_structure")(list(dicts))


def one_layer_fn(layer: torch.nn.Module) -> Callable:
    """``fn(h, (params, buffers)) -> (h, None)``: one layer as a scan body over stacked weights.

    Built as torch_xla's ``scan_layers`` builds it, without a partitioner and without its
    purity cache. Wraps ``torch_xla.experimental.scan_layers._create_or_get_cached_one_layer_fn(layer,
    None, False)``. Verified: :data:`VERIFIED`.
    """
    return _lookup(_SCAN_LAYERS, "_create_or_get_cached_one_layer_fn")(layer, None, False)


# ---------------------------------------------------------------------------------------
# torch internals used by the scan helpers
# ---------------------------------------------------------------------------------------
def default_partition_fn() -> Callable:
    """AOTAutograd's default partitioner, the ``partition_fn`` default of torch_xla's ``scan``.

    Wraps ``torch._functorch.partitioners.default_partition`` (returns that function, so
    identity comparisons with torch_xla's default hold). Verified: :data:`VERIFIED`.
    """
    return _lookup("torch._functorch.partitioners", "default_partition")


def extract_fwd_bwd_modules(joint_module, saved_values: list, *, num_fwd_outputs: int) -> tuple:
    """Split an AOTAutograd joint graph into ``(forward, backward)`` modules that pass ``saved_values``.

    No symbolic-int nodes are saved. Wraps ``torch._functorch.partitioners._extract_fwd_bwd_modules``.
    Verified: :data:`VERIFIED`.
    """
    extract = _lookup("torch._functorch.partitioners", "_extract_fwd_bwd_modules")
    return extract(joint_module, saved_values, saved_sym_nodes=[], num_fwd_outputs=num_fwd_outputs)


def tree_flatten(tree) -> tuple:
    """``(leaves, spec)`` of a torch pytree (the tree format torch_xla's scan uses).

    Wraps ``torch.utils._pytree.tree_flatten`` (torch has no public pytree module in 2.9).
    Verified: :data:`VERIFIED`.
    """
    return _lookup("torch.utils._pytree", "tree_flatten")(tree)


def tree_unflatten(leaves: Sequence[Any], spec) -> Any:
    """The pytree of ``spec`` (from :func:`tree_flatten`) with ``leaves``.

    Wraps ``torch.utils._pytree.tree_unflatten``. Verified: :data:`VERIFIED`.
    """
    return _lookup("torch.utils._pytree", "tree_unflatten")(list(leaves), spec)


def tree_map(fn: Callable, tree, *rest) -> Any:
    """``fn`` applied leaf by leaf over one or more pytrees of the same structure.

    Wraps ``torch.utils._pytree.tree_map``. Verified: :data:`VERIFIED`.
    """
    return _lookup("torch.utils._pytree", "tree_map")(fn, tree, *rest)
