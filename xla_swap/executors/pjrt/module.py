"""The module that :class:`xla_swap.executors.PjrtExecutor` compiles: loading, its ``@main``, its rewrites.

* Loading (:func:`load_module`): HLO protos, ``XlaComputation``, StableHLO text or bytecode and
  :class:`jax.stages.Lowered` all become a :class:`ModuleSource`: StableHLO bytecode with GSPMD
  shardings (``mhlo.sharding``) and the memory kinds the input declared (lost in HLO, read from
  a jax lowering's StableHLO).
* The entry function (:func:`read_entry`): shapes, dtypes and attribute dicts of its
  parameters and results.
* Rewrites done before compiling: host callbacks refused (:func:`refuse_host_callbacks`), input
  donation stripped (:func:`strip_donation`), ``mhlo.memory_kind`` / ``mhlo.sharding`` written on
  ``@main`` (:func:`set_entry_attributes`).

Imports jax and numpy only (the private jax / jaxlib APIs through :mod:`xla_swap._compat.jax`).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import numpy as np
from jax.extend.mlir import ir

from xla_swap._compat import jax as _cj   # every private jax / jaxlib API used here

_MLIR_BYTECODE_MAGIC = b"ML\xefR"


@dataclasses.dataclass
class ModuleSource:
    """A module normalised to StableHLO bytecode with GSPMD shardings (``mhlo.sharding``).

    Attributes:
      mlir: the StableHLO module as MLIR bytecode.
      arg_memory_kinds / result_memory_kinds: per parameter / result, the memory kind the input
        declared (a JAX lowering, StableHLO input); None where unknown (may be shorter than the
        signature).
      num_partitions: ``mhlo.num_partitions`` where the input declared it, else None.
    """
    mlir: bytes
    arg_memory_kinds: list
    result_memory_kinds: list
    num_partitions: int | None


def entry_func(module: ir.Module):
    """The entry ``func.func`` of ``module``: ``@main``, else its one public function.

    Raises: ValueError: neither exists.
    """
    funcs = [op for op in module.body.operations if op.operation.name == "func.func"]
    for op in funcs:
        if ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    public = [op for op in funcs if "sym_visibility" not in op.attributes
              or ir.StringAttr(op.attributes["sym_visibility"]).value == "public"]
    if len(public) == 1:
        return public[0]
    raise ValueError("module: no entry function '@main' (and not exactly one public function) in the module")


def dict_entries(attr) -> dict:
    """An MLIR dictionary attribute as a Python dict ``{name: Attribute}``."""
    dictionary = ir.DictAttr(attr)
    return {dictionary[j].name: dictionary[j].attr for j in range(len(dictionary))}


def attr_dicts(func, key: str, count: int) -> list:
    """``func``'s ``arg_attrs`` / ``res_attrs`` (``key``) as ``count`` dicts (empty ones when absent)."""
    if key in func.attributes:
        return [dict_entries(a) for a in ir.ArrayAttr(func.attributes[key])]
    return [{} for _ in range(count)]


def str_attr(entries: dict, key: str):
    """The string value of ``entries[key]``, or None when absent."""
    attr = entries.get(key)
    return None if attr is None else ir.StringAttr(attr).value


def _memory_kinds_of(mlir_module: ir.Module) -> tuple[list, list, int | None]:
    """(argument memory kinds, result memory kinds, mhlo.num_partitions) of a StableHLO module."""
    main = entry_func(mlir_module)
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    args = [str_attr(e, "mhlo.memory_kind") for e in attr_dicts(main, "arg_attrs", len(ftype.inputs))]
    results = [str_attr(e, "mhlo.memory_kind") for e in attr_dicts(main, "res_attrs", len(ftype.results))]
    num_partitions = None
    if "mhlo.num_partitions" in mlir_module.operation.attributes:
        num_partitions = ir.IntegerAttr(mlir_module.operation.attributes["mhlo.num_partitions"]).value
    return args, results, num_partitions


def _from_hlo_proto(proto: bytes, arg_kinds=None, result_kinds=None, num_partitions=None) -> ModuleSource:
    try:
        mlir = _cj.hlo_to_stablehlo(proto)
    except _cj.MissingUpstreamAPI:
        raise
    except Exception as e:  # the jaxlib error type differs between versions
        raise ValueError(f"module: could not read the bytes as a serialized HloModuleProto: {e}") from e
    return ModuleSource(mlir, list(arg_kinds or []), list(result_kinds or []), num_partitions)


def _from_mlir(text_or_bytecode) -> ModuleSource:
    with _cj.make_ir_context():
        try:
            mod = ir.Module.parse(text_or_bytecode)
        except Exception as e:
            raise ValueError(f"module: could not parse the StableHLO/MLIR module: {e}") from e
        args, results, num_partitions = _memory_kinds_of(mod)
        data = _cj.module_to_bytecode(mod)
    # Through HLO, as jax's own compiler_ir('hlo') does: Shardy annotations become mhlo.sharding.
    return _from_hlo_proto(_cj.stablehlo_to_hlo_proto(data), args, results, num_partitions)


def _from_lowered(lowered) -> ModuleSource:
    const_args = _cj.lowered_const_args(lowered)
    if const_args:
        raise ValueError(f"module: this jax lowering hoisted {len(const_args)} constant(s) into extra "
                         "arguments (jax_use_simplified_jaxpr_constants); lower with that flag off")
    stablehlo = lowered.compiler_ir("stablehlo")
    args, results, num_partitions = _memory_kinds_of(stablehlo)
    proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
    return _from_hlo_proto(proto, args, results, num_partitions)


def load_module(module) -> ModuleSource:
    """Read any module :class:`xla_swap.executors.PjrtExecutor` takes as a :class:`ModuleSource`.

    Args:
      module: serialized ``HloModuleProto`` bytes, a :class:`jax.stages.Lowered`, an
        ``XlaComputation`` / ``HloModule``, or a StableHLO module as MLIR text (str / bytes) or bytecode.

    Raises:
      TypeError: ``module`` is none of these.
      ValueError: the bytes or text cannot be read; a jax lowering hoisted constants into arguments.
    """
    if isinstance(module, jax.stages.Lowered):
        return _from_lowered(module)
    if hasattr(module, "as_serialized_hlo_module_proto"):      # XlaComputation / HloModule
        return _from_hlo_proto(module.as_serialized_hlo_module_proto())
    if isinstance(module, str):
        return _from_mlir(module)
    if isinstance(module, (bytes, bytearray, memoryview)):
        data = bytes(module)
        if data.startswith(_MLIR_BYTECODE_MAGIC) or data.lstrip().startswith((b"module", b"func.func", b"#loc")):
            return _from_mlir(data)
        return _from_hlo_proto(data)
    raise TypeError("module: expected HloModuleProto bytes, a jax.stages.Lowered or a StableHLO module "
                    f"(str or bytes), got {type(module).__name__}")


_IR_DTYPES: dict = {}


def ir_to_dtype(element_type) -> np.dtype:
    """numpy dtype of an MLIR element type.

    Several numpy dtypes lower to the same MLIR type: ``i1`` is jax's ``float0`` (the
    tangent type of integers, no bytes), ``bool`` and ``int1``. An HLO/StableHLO ``i1``
    (HLO ``pred``) value is a bool, so ``bool`` is taken and ``float0`` (a void dtype) never.

    Raises: ValueError: an element type without a numpy dtype.
    """
    if not _IR_DTYPES:
        _IR_DTYPES["i1"] = np.dtype(np.bool_)
        for dt, factory in _cj.ir_element_type_factories().items():
            try:
                dtype = np.dtype(dt)
                if dtype == jax.dtypes.float0:  # (bfloat16 and the fp8 types are void-kind too: keep them)
                    continue
                _IR_DTYPES.setdefault(str(factory()), dtype)
            except Exception:  # a factory this MLIR build lacks
                pass
    key = str(element_type)
    if key not in _IR_DTYPES:
        raise ValueError(f"module: unsupported element type {key}")
    return _IR_DTYPES[key]


def tensor_meta(tensor_type, what: str) -> tuple:
    """``(shape tuple, numpy dtype)`` of an MLIR tensor type.

    Raises: ValueError naming ``what``: not a ranked tensor, a dynamic shape, an unknown element type.
    """
    try:
        ranked = ir.RankedTensorType(tensor_type)
    except (ValueError, TypeError):
        raise ValueError(f"module: {what} has type {tensor_type}; only ranked tensors are supported") from None
    if not ranked.has_static_shape:
        raise ValueError(f"module: {what} has the dynamic type {tensor_type}; only static shapes are supported")
    return tuple(int(d) for d in ranked.shape), ir_to_dtype(ranked.element_type)


@dataclasses.dataclass
class EntryFunction:
    """The ``@main`` function of a parsed module: its signature and its argument / result attributes.

    Attributes:
      main: the ``func.func`` operation.
      metas / out_metas: per parameter / result, ``(shape tuple, numpy dtype)``.
      arg_attrs / res_attrs: per parameter / result, a dict of its MLIR attributes (name -> Attribute).
    """
    main: Any
    metas: list
    out_metas: list
    arg_attrs: list
    res_attrs: list


def read_entry(mod: ir.Module) -> EntryFunction:
    """The entry function of ``mod`` with its parameter and result shapes, dtypes and attributes.

    Raises: ValueError: the module has no entry function, or a parameter / result is not a
      ranked tensor of a known element type (named ``parameter i`` / ``result i``).
    """
    main = entry_func(mod)
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    n_in, n_out = len(ftype.inputs), len(ftype.results)
    return EntryFunction(main=main,
                         metas=[tensor_meta(t, f"parameter {i}") for i, t in enumerate(ftype.inputs)],
                         out_metas=[tensor_meta(t, f"result {i}") for i, t in enumerate(ftype.results)],
                         arg_attrs=attr_dicts(main, "arg_attrs", n_in),
                         res_attrs=attr_dicts(main, "res_attrs", n_out))


#: Custom-call targets that call back into Python on the host (jax.debug.print, jax.pure_callback,
#: jax.experimental.io_callback): ``xla_python_cpu_callback``, ``xla_ffi_python_gpu_callback``,
#: ``xla_ffi_partitioned_python_cpu_callback``, ...
_HOST_CALLBACK_RE = re.compile(r'(?:custom_call\s*@|call_target_name\s*=\s*")([\w.]*python[\w.]*callback[\w.]*)')


def refuse_host_callbacks(mod: ir.Module) -> None:
    """ValueError when the module calls back into Python on the host.

    Such a custom call refers to a Python function registered with the compile call that
    jax itself makes (an index into its host-callback list); a module compiled without that
    list crashes the process when the call runs (a segmentation fault, measured with jaxlib
    0.10.2), so it is refused here, before it reaches the compiler.
    """
    text = mod.operation.get_asm(large_elements_limit=16)
    targets = sorted(set(_HOST_CALLBACK_RE.findall(text)))
    if targets:
        raise ValueError(
            f"module: the program calls back into Python on the host (custom call {', '.join(targets)}: "
            "jax.debug.print, jax.pure_callback or jax.experimental.io_callback). PjrtExecutor cannot compile "
            "host callbacks (the compiled program would crash calling them); remove them from the function "
            "before lowering, or run it with jax.jit")


#: Module attributes and argument attributes by which a module donates its inputs.
_DONATION_MODULE_ATTRS = ("mhlo.input_output_alias", "mhlo.buffer_donor")
_DONATION_ARG_ATTRS = ("tf.aliasing_output", "jax.buffer_donor")


def strip_donation(mod: ir.Module, arg_attrs: list) -> tuple:
    """Remove every input donation (input/output aliases, buffer donors) from ``mod`` in place.

    ``arg_attrs`` (``@main``'s argument attribute dicts) lose their donation entries too.
    Returns the sorted indices of the parameters the module donated.
    """
    donated = set()
    attrs = mod.operation.attributes
    for name in _DONATION_MODULE_ATTRS:
        if name in attrs:
            donated |= {int(m) for m in re.findall(r"parameter_number\s*=\s*(\d+)", str(attrs[name]))}
            del attrs[name]
    for i, entries in enumerate(arg_attrs):
        for name in _DONATION_ARG_ATTRS:
            if entries.pop(name, None) is not None:
                donated.add(i)
    return tuple(sorted(donated))


def set_entry_attributes(entry: EntryFunction, kinds: list, shard_specs: list, hlo_shardings: list,
                         result_memory_kinds: dict, res_kinds: list) -> None:
    """Write ``mhlo.memory_kind`` and ``mhlo.sharding`` on ``@main``'s arguments, and the requested
    ``mhlo.memory_kind`` on its results (in place; a replaced sharding's stale Shardy copy is dropped).

    Args:
      entry: the entry function, from :func:`read_entry`.
      kinds: per parameter, its memory kind.
      shard_specs: per parameter, the requested sharding spec (None: the module's own).
      hlo_shardings: per parameter, its jaxlib ``HloSharding`` (None: none written).
      result_memory_kinds: ``{result index: memory kind}`` as requested.
      res_kinds: per result, its memory kind (requested, else declared by the module, else None).
    """
    new_arg_attrs = []
    for i, entries in enumerate(entry.arg_attrs):
        entries = dict(entries)
        entries["mhlo.memory_kind"] = ir.StringAttr.get(kinds[i])
        if hlo_shardings[i] is not None:
            entries["mhlo.sharding"] = ir.StringAttr.get(str(hlo_shardings[i]))
            if shard_specs[i] is not None and "mhlo.frontend_attributes" in entries:
                frontend = dict_entries(entries["mhlo.frontend_attributes"])
                frontend.pop("xla.sdy.sharding", None)  # stale Shardy copy of the replaced sharding
                entries["mhlo.frontend_attributes"] = ir.DictAttr.get(frontend)
        new_arg_attrs.append(ir.DictAttr.get(entries))
    entry.main.attributes["arg_attrs"] = ir.ArrayAttr.get(new_arg_attrs)
    new_res_attrs = []
    for i, entries in enumerate(entry.res_attrs):
        entries = dict(entries)
        if i in result_memory_kinds or (res_kinds[i] and "mhlo.memory_kind" not in entries):
            entries["mhlo.memory_kind"] = ir.StringAttr.get(res_kinds[i])
        new_res_attrs.append(ir.DictAttr.get(entries))
    entry.main.attributes["res_attrs"] = ir.ArrayAttr.get(new_res_attrs)
