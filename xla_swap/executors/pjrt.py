"""Run a lowered XLA module through PJRT (jaxlib) with entry parameters in ``pinned_host`` memory.

No torch, no torch_xla: only numpy and jax/jaxlib (the private jax/jaxlib APIs through
:mod:`xla_swap._compat.jax`). One path serves both front ends:

* torch_xla: ``LoweringContext.hlo()`` gives ``HloModuleProto`` bytes whose entry parameters
  carry GSPMD shardings such as ``{devices=[4,1]0,1,2,3}``;
* JAX: ``jax.jit(f, ...).lower(...)`` gives a :class:`jax.stages.Lowered`
  (see :func:`compile_lowered`); its HLO is taken with ``compiler_ir('hlo')`` and the
  memory kinds JAX chose (lost in HLO) are read from its StableHLO.

How memory kinds reach PJRT (measured with jaxlib 0.10.2): JAX marks the arguments of the
StableHLO ``@main`` with ``mhlo.memory_kind = "pinned_host"`` (and ``mhlo.sharding`` /
``sdy.sharding``); the PJRT compiler turns that into memory space 5 (``S(5)``) in the entry
computation layout, e.g. ``entry_computation_layout={(f32[4,2,8]{2,1,0:S(5)}, ...)}``. HLO
has no per-parameter memory kind, so this module converts the HLO to StableHLO
(``hlo_to_stablehlo``), sets ``mhlo.memory_kind`` and ``mhlo.sharding`` on the ``@main``
arguments with the MLIR Python bindings that jax ships, and compiles that with GSPMD
partitioning (``use_shardy_partitioner=False``: Shardy ignores the ``mhlo.sharding``
attributes of a module that has no ``sdy`` annotations, such as torch_xla's, and the
parameters then come out replicated).

Result memory kinds: a JAX lowering declares them (``out_shardings`` with a memory kind); for
any module, torch_xla's included, ``PjrtExecutor(..., result_memory_kinds={i: "pinned_host"})``
sets ``mhlo.memory_kind`` on result ``i`` of ``@main`` the same way, e.g. for the gradients
of host-resident weights. :meth:`PjrtExecutor.from_policy` derives both the parameter
placements and the result memory kinds from an ``OffloadPolicy``.

What is refused or changed before compiling: host callbacks (the compiled program would
crash calling them) and input donation (stripped, so a call never deletes the caller's
arrays).

Memory statistics are per device: under SPMD ``get_compiled_memory_stats()`` describes the
partitioned module that each device runs (``argument_size_in_bytes`` of a parameter
``f32[4,8,8]`` sharded 4 ways counts ``4*2*8*4`` bytes, not ``4*8*8*4``). The CPU client does
not split its statistics by memory space (all ``host_*`` fields are 0 and S(5) parameters
are counted in ``argument_size_in_bytes``); :meth:`PjrtExecutor.memory_report` then takes the
split of arguments and outputs from the compiled entry layout (see
:class:`xla_swap.executors.MemoryReport`, defined in ``report.py``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
from typing import Any, Mapping, Sequence

import numpy as np
import jax
from jax.extend.mlir import ir
from jax.sharding import SingleDeviceSharding

from xla_swap._compat import jax as _cj   # every private jax / jaxlib API used here
from xla_swap.planning.policy import DEVICE, MEMORY_KINDS, PINNED_HOST

from .report import HOST_MEMORY_SPACE, MemoryReport, compiled_report, entry_layout  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

# Memory kinds an entry parameter or result may be placed in: ``MEMORY_KINDS`` (``DEVICE``,
# ``PINNED_HOST``) of ``xla_swap.planning.policy``, re-exported here.
#: The environment variable that caps PJRT GPU's pinned host memory pool (in GiB, default 64).
HOST_MEMORY_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
#: The PJRT GPU default of :data:`HOST_MEMORY_LIMIT_ENV`, in GiB.
DEFAULT_GPU_HOST_MEMORY_LIMIT_GB = 64

_GPU_PLATFORMS = ("cuda", "rocm", "gpu")
_MLIR_BYTECODE_MAGIC = b"ML\xefR"
_AUTO = "auto"


class HostMemoryError(MemoryError):
    """Placing arrays in ``pinned_host`` memory would exceed (or did exceed) the pinned pool.

    Attributes:
      requested_bytes: bytes the failed operation needed in pinned host memory (all devices).
      in_use_bytes: bytes of live ``pinned_host`` arrays of this platform before it (or None
        when the error came from the runtime).
      limit_bytes: the limit checked against (None when the error came from the runtime).
    """

    def __init__(self, message: str, requested_bytes: int, in_use_bytes: int | None = None,
                 limit_bytes: int | None = None):
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.in_use_bytes = in_use_bytes
        self.limit_bytes = limit_bytes


@dataclasses.dataclass(frozen=True)
class ParameterPlacement:
    """Where one entry parameter lives.

    Attributes:
      memory_kind: ``"device"`` or ``"pinned_host"``.
      sharding: ``None`` (keep the sharding the module's parameter carries, replicated if
        none), an HLO sharding string as torch_xla reports it (``"{devices=[4,1]0,1,2,3}"``,
        ``"{replicated}"``), or a :class:`jax.sharding.Sharding` over exactly the executor's
        devices, in order (its memory kind is replaced by ``memory_kind``).

    Raises:
      TypeError: ``memory_kind`` is not a str; ``sharding`` is none of the above.
      ValueError: ``memory_kind`` is not one of ``MEMORY_KINDS``.
    """
    memory_kind: str = DEVICE
    sharding: Any = None

    def __post_init__(self):
        if not isinstance(self.memory_kind, str):
            raise TypeError(f"memory_kind: expected one of {MEMORY_KINDS}, got {type(self.memory_kind).__name__}")
        if self.memory_kind not in MEMORY_KINDS:
            raise ValueError(f"memory_kind: unknown memory kind {self.memory_kind!r}; expected one of {MEMORY_KINDS}")
        if self.sharding is not None and not isinstance(self.sharding, (str, jax.sharding.Sharding)):
            raise TypeError(f"sharding: expected None, an HLO sharding string or a jax Sharding, "
                            f"got {type(self.sharding).__name__}")


@dataclasses.dataclass(frozen=True)
class ParameterInfo:
    """One entry parameter of a compiled :class:`PjrtExecutor`.

    Attributes:
      index: position in the entry computation (0-based).
      shape: global (unpartitioned) shape.
      dtype: numpy dtype.
      memory_kind: ``"device"`` or ``"pinned_host"`` (as requested at compile time).
      hlo_sharding: the HLO sharding string it was compiled with.
      sharding: the :class:`jax.sharding.Sharding` (with memory kind) that :meth:`PjrtExecutor.put`
        places arrays with.
    """
    index: int
    shape: tuple
    dtype: np.dtype
    memory_kind: str
    hlo_sharding: str
    sharding: Any

    @property
    def nbytes(self) -> int:
        """Global size in bytes (all shards together, counting a replicated array once)."""
        return int(math.prod(self.shape)) * self.dtype.itemsize

    @property
    def shard_nbytes(self) -> int:
        """Bytes of one device's shard."""
        return int(math.prod(self.sharding.shard_shape(self.shape))) * self.dtype.itemsize


# ---------------------------------------------------------------------------------------
# module loading
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Source:
    """A module normalised to StableHLO bytecode with GSPMD shardings (``mhlo.sharding``)."""
    mlir: bytes
    arg_memory_kinds: list          # from a JAX lowering / StableHLO input; None where unknown
    result_memory_kinds: list
    num_partitions: int | None      # mhlo.num_partitions where the input declared it


def _entry_func(module: ir.Module):
    funcs = [op for op in module.body.operations if op.operation.name == "func.func"]
    for op in funcs:
        if ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    public = [op for op in funcs if "sym_visibility" not in op.attributes
              or ir.StringAttr(op.attributes["sym_visibility"]).value == "public"]
    if len(public) == 1:
        return public[0]
    raise ValueError("module: no entry function '@main' (and not exactly one public function) in the module")


def _dict_entries(attr) -> dict:
    d = ir.DictAttr(attr)
    return {d[j].name: d[j].attr for j in range(len(d))}


def _attr_dicts(func, key: str, n: int) -> list:
    if key in func.attributes:
        return [_dict_entries(a) for a in ir.ArrayAttr(func.attributes[key])]
    return [{} for _ in range(n)]


def _str_attr(entries: dict, key: str):
    a = entries.get(key)
    return None if a is None else ir.StringAttr(a).value


def _memory_kinds_of(mlir_module: ir.Module) -> tuple[list, list, int | None]:
    """(argument memory kinds, result memory kinds, mhlo.num_partitions) of a StableHLO module."""
    main = _entry_func(mlir_module)
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    args = [_str_attr(e, "mhlo.memory_kind") for e in _attr_dicts(main, "arg_attrs", len(ftype.inputs))]
    res = [_str_attr(e, "mhlo.memory_kind") for e in _attr_dicts(main, "res_attrs", len(ftype.results))]
    nparts = None
    if "mhlo.num_partitions" in mlir_module.operation.attributes:
        nparts = ir.IntegerAttr(mlir_module.operation.attributes["mhlo.num_partitions"]).value
    return args, res, nparts


def _from_hlo_proto(proto: bytes, arg_kinds=None, res_kinds=None, nparts=None) -> _Source:
    try:
        mlir = _cj.hlo_to_stablehlo(proto)
    except _cj.MissingUpstreamAPI:
        raise
    except Exception as e:  # the jaxlib error type differs between versions
        raise ValueError(f"module: could not read the bytes as a serialized HloModuleProto: {e}") from e
    return _Source(mlir, list(arg_kinds or []), list(res_kinds or []), nparts)


def _from_mlir(text_or_bytecode) -> _Source:
    with _cj.make_ir_context():
        try:
            mod = ir.Module.parse(text_or_bytecode)
        except Exception as e:
            raise ValueError(f"module: could not parse the StableHLO/MLIR module: {e}") from e
        args, res, nparts = _memory_kinds_of(mod)
        data = _cj.module_to_bytecode(mod)
    # Through HLO, as jax's own compiler_ir('hlo') does: Shardy annotations become mhlo.sharding.
    return _from_hlo_proto(_cj.stablehlo_to_hlo_proto(data), args, res, nparts)


def _from_lowered(lowered) -> _Source:
    const_args = _cj.lowered_const_args(lowered)
    if const_args:
        raise ValueError(f"module: this jax lowering hoisted {len(const_args)} constant(s) into extra "
                         "arguments (jax_use_simplified_jaxpr_constants); lower with that flag off")
    stablehlo = lowered.compiler_ir("stablehlo")
    args, res, nparts = _memory_kinds_of(stablehlo)
    proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
    return _from_hlo_proto(proto, args, res, nparts)


def _load(module) -> _Source:
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


def _ir_to_dtype(t) -> np.dtype:
    """numpy dtype of an MLIR element type.

    Several numpy dtypes lower to the same MLIR type: ``i1`` is jax's ``float0`` (the
    tangent type of integers, no bytes), ``bool`` and ``int1``. An HLO/StableHLO ``i1``
    (HLO ``pred``) value is a bool, so ``bool`` is taken and ``float0`` (a void dtype) never.
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
    key = str(t)
    if key not in _IR_DTYPES:
        raise ValueError(f"module: unsupported element type {key}")
    return _IR_DTYPES[key]


def _tensor_meta(t, what: str):
    try:
        rt = ir.RankedTensorType(t)
    except (ValueError, TypeError):
        raise ValueError(f"module: {what} has type {t}; only ranked tensors are supported") from None
    if not rt.has_static_shape:
        raise ValueError(f"module: {what} has the dynamic type {t}; only static shapes are supported")
    return tuple(int(d) for d in rt.shape), _ir_to_dtype(rt.element_type)


# ---------------------------------------------------------------------------------------
# shardings
# ---------------------------------------------------------------------------------------
def _parse_hlo_sharding(s: str, where: str):
    """A jaxlib ``HloSharding`` from an HLO sharding string; ValueError naming ``where`` when invalid.

    A tiled sharding over n devices must name each of the device ids ``0..n-1`` once (XLA's
    verifier refuses anything else at compile time).
    """
    try:
        hs = _cj.parse_hlo_sharding(s)
    except _cj.MissingUpstreamAPI:
        raise
    except Exception as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "error:" in ln), lines[0] if lines else type(e).__name__)
        raise ValueError(f"{where}: invalid HLO sharding string {s!r}: {detail}") from e
    layout = _cj.hlo_sharding_layout(hs)
    if layout.kind == "tiled":
        ids, n = layout.device_ids, layout.num_devices
        twice = sorted({d for d in ids if ids.count(d) > 1}) if len(set(ids)) != len(ids) else []
        if twice:
            raise ValueError(f"{where}: HLO sharding {s!r} lists device {twice[0]} twice; each device holds one tile")
        bad = [d for d in ids if not 0 <= d < n]
        if bad:
            raise ValueError(f"{where}: HLO sharding {s!r} names device {bad[0]}, but its {n} tiles run on "
                             f"devices 0..{n - 1}")
    return hs


def _devices_needed(hs) -> int:
    """Smallest device count the sharding (a jaxlib ``HloSharding``) can run on (0: any)."""
    layout = _cj.hlo_sharding_layout(hs)
    if layout.kind == "tiled":
        return layout.num_devices
    if layout.kind == "maximal" and layout.device_ids:
        return max(layout.device_ids) + 1
    return 0


def _is_tiled(hs) -> bool:
    return _cj.hlo_sharding_layout(hs).kind == "tiled"


def _check_rank(hs, shape: tuple, where: str) -> None:
    layout = _cj.hlo_sharding_layout(hs)
    if layout.kind != "tiled":
        return
    if layout.tiled_rank != len(shape):
        raise ValueError(f"{where}: sharding {hs} tiles {layout.tiled_rank} dimension(s), but the parameter has "
                         f"rank {len(shape)} (shape {list(shape)})")


# ---------------------------------------------------------------------------------------
# compiled HLO inspection
# ---------------------------------------------------------------------------------------
def _is_resource_exhausted(e: Exception) -> bool:
    msg = str(e)
    return "RESOURCE_EXHAUSTED" in msg or "Out of memory" in msg or "out of memory" in msg.lower()


def _is_host_oom(e: Exception) -> bool:
    msg = str(e).lower()
    return _is_resource_exhausted(e) and ("host" in msg or "pinned" in msg)


def _default_host_limit(platform: str) -> int | None:
    """PJRT GPU's pinned pool size in bytes (``$XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` GiB); None on CPU."""
    if platform not in _GPU_PLATFORMS:
        return None
    value = os.environ.get(HOST_MEMORY_LIMIT_ENV, str(DEFAULT_GPU_HOST_MEMORY_LIMIT_GB))
    try:
        gib = float(value)
    except ValueError:
        raise ValueError(f"{HOST_MEMORY_LIMIT_ENV}={value!r} is not a number of GiB") from None
    if not gib >= 0 or gib == float("inf"):
        raise ValueError(f"{HOST_MEMORY_LIMIT_ENV}={value!r} must be a finite number of GiB >= 0")
    return int(gib * (1 << 30))


# ---------------------------------------------------------------------------------------
# argument checks and module rewrites done before anything reaches the compiler
# ---------------------------------------------------------------------------------------
def _check_host_limit_arg(value) -> None:
    if not (value is None or isinstance(value, str) and value == _AUTO or isinstance(value, (int, np.integer))
            and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"host_memory_limit_bytes: expected None, 'auto' or a non-negative int, got {value!r}")


def _check_mapping(value, name: str) -> dict:
    """``dict(value)`` for a mapping (``{}`` for None); TypeError naming ``name`` otherwise."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}: expected a mapping {{index: ...}} (a dict) or None, got {type(value).__name__} "
                        f"{value!r:.80}")
    return dict(value)


def _check_index_keys(mapping: dict, name: str, count: int, what: str, plural: str) -> None:
    for k in mapping:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 0 <= k < count:
            raise ValueError(f"{name}: {what} index {k!r} does not exist; the module has {count} {plural}"
                             + (f" (valid indices 0..{count - 1})" if count else ""))


def _check_devices_arg(devices):
    """None, or ``devices`` as a tuple; TypeError for a lone Device, a string or a non-iterable."""
    if devices is None:
        return None
    if isinstance(devices, jax.Device):
        raise TypeError(f"devices: expected a sequence of jax devices, got one Device ({devices}); pass [device]")
    if isinstance(devices, (str, bytes, Mapping)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"devices: expected a sequence of jax devices, got {type(devices).__name__} {devices!r:.80}")
    return tuple(devices)


#: Custom-call targets that call back into Python on the host (jax.debug.print, jax.pure_callback,
#: jax.experimental.io_callback): ``xla_python_cpu_callback``, ``xla_ffi_python_gpu_callback``,
#: ``xla_ffi_partitioned_python_cpu_callback``, ...
_HOST_CALLBACK_RE = re.compile(r'(?:custom_call\s*@|call_target_name\s*=\s*")([\w.]*python[\w.]*callback[\w.]*)')


def _refuse_host_callbacks(mod: ir.Module) -> None:
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


def _strip_donation(mod: ir.Module, arg_attrs: list) -> tuple:
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


def _check_even(hs, shape: tuple, where: str) -> None:
    """ValueError when a tiled sharding does not split every dimension evenly (jax arrays need that)."""
    layout = _cj.hlo_sharding_layout(hs)
    if layout.kind != "tiled":
        return
    tiles = list(layout.tile_dims)[:len(shape)]
    for d, (size, t) in enumerate(zip(shape, tiles)):
        if t > 1 and size % t:
            raise ValueError(f"{where}: sharding {hs} splits dimension {d} of size {size} into {t} shards, which "
                             f"does not divide it (shape {list(shape)}); jax arrays need even shards: choose a "
                             f"sharding whose shard counts divide the shape")


# ---------------------------------------------------------------------------------------
# an OffloadPolicy as placements
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PolicyPlacements:
    """The :class:`PjrtExecutor` arguments an ``OffloadPolicy`` gives for one lowered module.

    Pass them on as ``PjrtExecutor(module, p.placements, result_memory_kinds=p.result_memory_kinds)``
    (what :meth:`PjrtExecutor.from_policy` does).

    Attributes:
      placements: ``{parameter index: ParameterPlacement}``: with a parameter table, one
        entry per parameter (memory kind from the policy, sharding from the table); without
        one, an entry for each weight only (sharding kept from the module).
      result_memory_kinds: ``{result index: memory kind}`` for the gradient results.
      weights: the parameter indices the policy's ``params`` placed, sorted.
      grad_results: the result indices the policy's ``grads`` placed, sorted.
    """
    placements: Mapping
    result_memory_kinds: Mapping
    weights: tuple = ()
    grad_results: tuple = ()


def _check_ids(ids, name: str, limit: int | None, what: str, known: set | None = None) -> tuple:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name}: expected an iterable of int {what} indices, got {type(ids).__name__} {ids!r:.80}")
    out = []
    for k in ids:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
            raise TypeError(f"{name}: expected int {what} indices, got {type(k).__name__} {k!r:.80}")
        k = int(k)
        if k < 0 or (limit is not None and k >= limit) or (known is not None and k not in known):
            count = len(known) if known is not None else limit
            raise ValueError(f"{name}: {what} index {k} does not exist; the module has {count} {what}(s)")
        out.append(k)
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: duplicate {what} indices in {sorted(out)}")
    return tuple(sorted(out))


def _parameter_table(parameters) -> dict | None:
    """``{index: HLO sharding string or None}`` from a framework-neutral parameter table."""
    if parameters is None:
        return None
    if isinstance(parameters, (int, np.integer)) and not isinstance(parameters, bool):
        if parameters < 0:
            raise ValueError(f"parameters: a parameter count must be >= 0, got {parameters}")
        return {i: None for i in range(int(parameters))}
    if isinstance(parameters, Mapping):
        items = list(parameters.items())
    elif isinstance(parameters, (str, bytes)) or not hasattr(parameters, "__iter__"):
        raise TypeError(f"parameters: expected a parameter table (records with .id and .sharding, e.g. "
                        f"LoweredComputation.parameters), a mapping {{index: sharding}}, a parameter count or None, "
                        f"got {type(parameters).__name__}")
    else:
        items = []
        for j, rec in enumerate(parameters):
            if not hasattr(rec, "id"):
                raise TypeError(f"parameters[{j}]: expected a record with .id and .sharding (an HloParameter), "
                                f"got {type(rec).__name__}")
            items.append((rec.id, getattr(rec, "sharding", None)))
    table = {}
    for k, sharding in items:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0:
            raise TypeError(f"parameters: parameter ids must be ints >= 0, got {k!r}")
        if sharding is not None and not isinstance(sharding, (str, jax.sharding.Sharding)):
            raise TypeError(f"parameters[{k}]: sharding must be an HLO sharding string, a jax Sharding or None, "
                            f"got {type(sharding).__name__}")
        if int(k) in table:
            raise ValueError(f"parameters: parameter id {k} appears twice")
        table[int(k)] = sharding
    return table


def placements_for_policy(policy, parameters=None, *, weights=(), grad_results=None,
                          num_results: int | None = None) -> PolicyPlacements:
    """Turn an ``OffloadPolicy`` into :class:`PjrtExecutor` placements for one lowered module.

    What the executor applies of the policy: ``params`` (``"host"``: the ``weights``
    parameters in ``pinned_host``, ``"device"``: on the device; every other parameter on the
    device) and ``grads`` (``"host"``: the ``grad_results`` results written to
    ``pinned_host``). ``activations`` and ``remat`` are already part of a module lowered
    through ``xla_swap.frontend.scan`` with the same policy; ``prefetch_depth`` and
    ``optimizer_state`` are not used by this executor (they belong to the streaming runtime
    and the training loop).

    Args:
      policy: an ``xla_swap.planning.OffloadPolicy``.
      parameters: the module's parameter table, framework-neutral: a sequence of records with
        ``.id`` (int entry parameter index) and ``.sharding`` (an HLO sharding string such as
        ``"{devices=[1,4,1]0,1,2,3}"``, a jax Sharding, or None), e.g. torch_xla's
        ``LoweredComputation.parameters``; or a mapping ``{index: sharding or None}``; or the
        parameter count (int; shardings kept from the module); or None (unknown: placements
        only for ``weights``, indices checked by the executor).
      weights: entry parameter indices of the per-layer (stacked) weights that
        ``policy.params`` places, e.g. ``[lowered.parameter_id(w) for w in stacked]``.
        Required (non-empty) when ``policy.params == "host"``.
      grad_results: result indices holding those weights' gradients, placed by
        ``policy.grads``. Required when ``policy.grads == "host"`` (pass ``()`` for a
        forward-only module: nothing is then placed on the host for the gradients).
      num_results: the module's result count, to check ``grad_results`` (optional; the
        executor checks them too).

    Returns:
      :class:`PolicyPlacements`.

    Raises:
      TypeError: ``policy`` is not an ``OffloadPolicy``; ``parameters``, ``weights`` or
        ``grad_results`` have the wrong type (non-int indices, a string).
      ValueError: a weight or gradient index that does not exist (names it and the count);
        duplicate indices; ``policy.params == "host"`` with no weights;
        ``policy.grads == "host"`` with ``grad_results`` not given.
    """
    from xla_swap.planning.policy import OffloadPolicy
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"policy: expected an xla_swap.planning.OffloadPolicy, got {type(policy).__name__}")
    table = _parameter_table(parameters)
    known = set(table) if table is not None else None
    w = _check_ids(weights, "weights", None, "parameter", known)
    if num_results is not None and (not isinstance(num_results, (int, np.integer)) or isinstance(num_results, bool)
                                    or num_results < 0):
        raise ValueError(f"num_results: expected an int >= 0 or None, got {num_results!r}")
    g = _check_ids(grad_results, "grad_results", num_results, "result")
    if policy.params == "host" and not w:
        raise ValueError("weights: policy.params='host' needs the indices of the weight parameters to place in "
                         "pinned_host (e.g. [lowered.parameter_id(w) for w in stacked_weights]); none given")
    if policy.grads == "host" and grad_results is None:
        raise ValueError("grad_results: policy.grads='host' needs the result indices of the weights' gradients "
                         "(pass () for a module that returns no gradients)")
    weight_kind = PINNED_HOST if policy.params == "host" else DEVICE
    if table is None:
        placements = {i: ParameterPlacement(weight_kind) for i in w}
    else:
        placements = {i: ParameterPlacement(weight_kind if i in w else DEVICE, sharding)
                      for i, sharding in sorted(table.items())}
    results = {i: (PINNED_HOST if policy.grads == "host" else DEVICE) for i in g}
    return PolicyPlacements(placements, results, w, g)


# ---------------------------------------------------------------------------------------
# the executor
# ---------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------
# the steps of PjrtExecutor.__init__: read the entry signature, resolve placements and
# devices, rewrite @main's attributes (all inside one MLIR context)
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Entry:
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


def _read_entry(mod: ir.Module) -> _Entry:
    """The entry function of ``mod`` with its parameter and result shapes, dtypes and attributes.

    Raises: ValueError: the module has no entry function, or a parameter / result is not a
      ranked tensor of a known element type (named ``parameter i`` / ``result i``).
    """
    main = _entry_func(mod)
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    n_in, n_out = len(ftype.inputs), len(ftype.results)
    return _Entry(main=main,
                  metas=[_tensor_meta(t, f"parameter {i}") for i, t in enumerate(ftype.inputs)],
                  out_metas=[_tensor_meta(t, f"result {i}") for i, t in enumerate(ftype.results)],
                  arg_attrs=_attr_dicts(main, "arg_attrs", n_in), res_attrs=_attr_dicts(main, "res_attrs", n_out))


def _requested_placements(src: _Source, entry: _Entry, placements: dict, result_memory_kinds: dict):
    """Per parameter, the requested memory kind and sharding spec (HLO string, jax Sharding or ``None``).

    A parameter not in ``placements`` keeps the memory kind the module declares (a jax lowering's),
    else ``"device"``, and its own sharding (spec ``None``).

    Returns: ``(kinds, shard_specs)``, two lists with one entry per entry parameter.

    Raises:
      ValueError: an index of ``placements`` / ``result_memory_kinds`` that does not exist; an
        unknown memory kind (requested or declared by the module).
      TypeError: a placement value or its sharding of the wrong type.
    """
    n_in, n_out = len(entry.metas), len(entry.out_metas)
    _check_index_keys(placements, "placements", n_in, "parameter", "entry parameter(s)")
    _check_index_keys(result_memory_kinds, "result_memory_kinds", n_out, "result", "result(s)")
    for i, kind in result_memory_kinds.items():
        if not isinstance(kind, str) or kind not in MEMORY_KINDS:
            raise ValueError(f"result_memory_kinds[{i}]: unknown memory kind {kind!r}; expected one of "
                             f"{MEMORY_KINDS}")
    kinds, shard_specs = [], []
    for i in range(n_in):
        kind = (src.arg_memory_kinds[i] if i < len(src.arg_memory_kinds) else None) or DEVICE
        spec = None
        p = placements.get(i)
        if p is not None:
            if isinstance(p, str):
                kind = p
            elif isinstance(p, ParameterPlacement):
                kind, spec = p.memory_kind, p.sharding
            elif isinstance(p, jax.sharding.Sharding):
                kind, spec = p.memory_kind or DEVICE, p
            else:
                raise TypeError(f"placements[{i}]: expected 'device', 'pinned_host', a ParameterPlacement "
                                f"or a jax Sharding, got {type(p).__name__}")
        if kind not in MEMORY_KINDS:
            where = f"placements[{i}]" if p is not None else f"parameter {i} (memory kind set by the module)"
            raise ValueError(f"{where}: unknown memory kind {kind!r}; expected one of {MEMORY_KINDS}")
        if spec is not None and not isinstance(spec, (str, jax.sharding.Sharding)):
            raise TypeError(f"placements[{i}]: sharding must be an HLO sharding string or a jax Sharding, "
                            f"got {type(spec).__name__}")
        kinds.append(kind)
        shard_specs.append(spec)
    return kinds, shard_specs


def _parameter_shardings(entry: _Entry, shard_specs: list) -> list:
    """Per parameter, its HLO sharding: from the requested spec, else the module's ``mhlo.sharding``, else ``None``.

    Raises: ValueError: an invalid sharding string, or one whose rank differs from the parameter's.
    """
    out = []
    for i, spec in enumerate(shard_specs):
        where = f"placements[{i}]" if spec is not None else f"parameter {i}"
        if isinstance(spec, jax.sharding.Sharding):
            hs = _cj.sharding_to_hlo(spec, len(entry.metas[i][0]))
        else:
            text = spec if isinstance(spec, str) else _str_attr(entry.arg_attrs[i], "mhlo.sharding")
            hs = _parse_hlo_sharding(text, where) if text else None
        if hs is not None:
            _check_rank(hs, entry.metas[i][0], where)
        out.append(hs)
    return out


def _resolve_devices(src: _Source, entry: _Entry, devices, shard_specs: list, hlo_shardings: list) -> tuple:
    """The devices to compile for: ``devices`` checked against the shardings, or the first N of
    ``jax.devices()`` where N is the device count the module's shardings / ``mhlo.num_partitions`` name.

    Raises: ValueError: the device count or order the module cannot use, duplicates, several
      platforms, a sharding that splits a dimension unevenly (messages as :class:`PjrtExecutor`'s).
    """
    needed = max([_devices_needed(h) for h in hlo_shardings if h is not None] + [0])
    for a in entry.res_attrs:
        text = _str_attr(a, "mhlo.sharding")
        if text:
            needed = max(needed, _devices_needed(_parse_hlo_sharding(text, "module result")))
    if src.num_partitions and src.num_partitions > 1:
        needed = max(needed, src.num_partitions)
    for spec in shard_specs:
        if isinstance(spec, jax.sharding.Sharding) and not spec.is_fully_replicated:
            needed = max(needed, len(_cj.sharding_devices(spec)))
    if devices is None:
        available = jax.devices()
        n = max(needed, 1)
        if n > len(available):
            raise ValueError(f"devices: the module is partitioned over {n} devices, but only "
                             f"{len(available)} {available[0].platform} device(s) are available")
        devices = tuple(available[:n])
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise ValueError(f"devices: expected a non-empty sequence of jax devices, got {devices!r}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices: duplicate devices in {devices}")
    if len({d.platform for d in devices}) != 1:
        raise ValueError(f"devices: all devices must be of one platform, got {devices}")
    n = len(devices)
    if n > len(jax.devices(devices[0].platform)):
        raise ValueError(f"devices: {n} devices given, but only {len(jax.devices(devices[0].platform))} "
                         f"are available")
    if src.num_partitions and src.num_partitions > 1 and n != src.num_partitions:
        raise ValueError(f"devices: the module declares mhlo.num_partitions={src.num_partitions}, "
                         f"but {n} device(s) were given")
    for i, hs in enumerate(hlo_shardings):
        if hs is None:
            continue
        k = _devices_needed(hs)
        if _is_tiled(hs) and k != n:
            raise ValueError(f"devices: parameter {i} is sharded {hs} over {k} devices, but {n} device(s) "
                             f"were given; pass {k} devices")
        if not _is_tiled(hs) and k > n:
            raise ValueError(f"devices: parameter {i} is placed on {hs}, but only {n} device(s) were given")
        _check_even(hs, entry.metas[i][0], f"placements[{i}]" if shard_specs[i] is not None else f"parameter {i}")
    for i, spec in enumerate(shard_specs):
        if isinstance(spec, jax.sharding.Sharding) and not spec.is_fully_replicated \
                and _cj.sharding_devices(spec) != devices:
            raise ValueError(f"placements[{i}]: the sharding's devices {_cj.sharding_devices(spec)} "
                             f"differ from the executor's devices {devices} (order matters)")
    return devices


def _check_supported_kinds(src: _Source, entry: _Entry, devices: tuple, kinds: list,
                           result_memory_kinds: dict) -> list:
    """Check that ``devices`` have every parameter's and result's memory kind.

    Returns: per result, its memory kind (requested, else declared by the module, else ``None``).

    Raises: ValueError: a memory kind the devices lack (naming the parameter or result).
    """
    mem_kinds = {m.kind for m in devices[0].addressable_memories()}
    for i, kind in enumerate(kinds):
        if kind not in mem_kinds:
            raise ValueError(f"placements[{i}]: memory kind {kind!r} is not supported by "
                             f"{devices[0].platform} devices (they have {sorted(mem_kinds)})")
    res_kinds = [result_memory_kinds.get(i) or (src.result_memory_kinds[i]
                                                if i < len(src.result_memory_kinds) else None)
                 for i in range(len(entry.out_metas))]
    for i, kind in enumerate(res_kinds):
        if kind is not None and kind not in mem_kinds:
            where = f"result_memory_kinds[{i}]" if i in result_memory_kinds else f"result {i}"
            raise ValueError(f"{where}: memory kind {kind!r} is not supported by {devices[0].platform} "
                             f"devices (they have {sorted(mem_kinds)})")
    return res_kinds


def _set_entry_attributes(entry: _Entry, kinds: list, shard_specs: list, hlo_shardings: list,
                          result_memory_kinds: dict, res_kinds: list) -> None:
    """Write ``mhlo.memory_kind`` and ``mhlo.sharding`` on ``@main``'s arguments, and the requested
    ``mhlo.memory_kind`` on its results (in place; a replaced sharding's stale Shardy copy is dropped)."""
    new_arg_attrs = []
    for i, entries in enumerate(entry.arg_attrs):
        entries = dict(entries)
        entries["mhlo.memory_kind"] = ir.StringAttr.get(kinds[i])
        if hlo_shardings[i] is not None:
            entries["mhlo.sharding"] = ir.StringAttr.get(str(hlo_shardings[i]))
            if shard_specs[i] is not None and "mhlo.frontend_attributes" in entries:
                fa = _dict_entries(entries["mhlo.frontend_attributes"])
                fa.pop("xla.sdy.sharding", None)  # stale Shardy copy of the replaced sharding
                entries["mhlo.frontend_attributes"] = ir.DictAttr.get(fa)
        new_arg_attrs.append(ir.DictAttr.get(entries))
    entry.main.attributes["arg_attrs"] = ir.ArrayAttr.get(new_arg_attrs)
    new_res_attrs = []
    for i, entries in enumerate(entry.res_attrs):
        entries = dict(entries)
        if i in result_memory_kinds or (res_kinds[i] and "mhlo.memory_kind" not in entries):
            entries["mhlo.memory_kind"] = ir.StringAttr.get(res_kinds[i])
        new_res_attrs.append(ir.DictAttr.get(entries))
    entry.main.attributes["res_attrs"] = ir.ArrayAttr.get(new_res_attrs)


class PjrtExecutor:
    """A lowered XLA module compiled with PJRT (jaxlib) for CPU or NVIDIA GPU, SPMD over N devices.

    Args:
      module: serialized ``HloModuleProto`` ``bytes`` (torch_xla's ``LoweringContext.hlo()``,
        or ``jax.jit(f).lower(...).compiler_ir('hlo').as_serialized_hlo_module_proto()``), a
        :class:`jax.stages.Lowered`, an ``XlaComputation``, or a StableHLO module as MLIR text
        (``str``/``bytes``) or bytecode. Parameter indices below are the entry computation's
        parameters, in order (for a jax lowering: the flattened arguments that jax kept;
        jax drops unused ones).
      placements: ``{param_index: "device" | "pinned_host" | ParameterPlacement | Sharding}``.
        Parameters not named keep their defaults: memory kind ``"device"`` (for a JAX
        lowering: the memory kind JAX lowered it with), sharding as the module's parameter
        carries it (replicated if none). A tiled sharding must split every dimension evenly.
        :meth:`from_policy` / :func:`placements_for_policy` build this from an
        ``OffloadPolicy``.
      devices: a sequence of jax devices to run on, in SPMD partition order. Default: the
        first N of ``jax.devices()``, N being the device count the module's shardings (or its
        ``mhlo.num_partitions``) name -- all devices for a module lowered over all of them --
        and a single device when the module is not partitioned.
      result_memory_kinds: ``{result_index: "device" | "pinned_host"}``: the memory kind a
        result is written to (e.g. the gradients of host-resident weights to
        ``"pinned_host"``), for any module, torch_xla's ``HloModuleProto`` included. Results
        not named keep the memory kind the module declares (a JAX lowering's
        ``out_shardings``), else ``"device"``.
      host_memory_limit_bytes: cap, in bytes over all devices, on live ``pinned_host`` arrays
        of this platform that :meth:`put` and :meth:`__call__` check before placing host
        arrays. ``"auto"`` (default): on GPU ``$XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` (default
        64) GiB, the size of PJRT GPU's pinned pool; on CPU no limit. ``None``: no limit.

    Donation: a module that donates inputs (``jax.jit(..., donate_argnums=...)``, HLO
    ``input_output_alias``) is compiled WITHOUT donation, so a call never deletes the
    caller's arrays (the results of :meth:`put` among them); ``donated_parameters`` lists
    what the module asked to donate. The cost is the memory donation would have saved: the
    results get buffers of their own.

    Host callbacks (``jax.debug.print``, ``jax.pure_callback``, ``io_callback``) are refused
    with a ValueError before compiling: the Python functions they call are not part of the
    module, and the compiled program would crash the process when calling them.

    All arguments are checked before anything is compiled or placed.

    Raises:
      TypeError: ``module`` is none of the accepted types; ``placements`` or
        ``result_memory_kinds`` is not a mapping (a list, a string); ``devices`` is a single
        Device, a string or not iterable; a placement value has a wrong type.
      ValueError: ``module`` cannot be read; the module calls host callbacks; a placement
        (or result memory kind) names an index that does not exist (the message names the
        index and the count); an unknown memory kind (or one the devices lack); an invalid
        sharding string, one whose rank does not match, one that lists a device twice or
        names a device outside its tiles' ``0..n-1``, or one that splits a dimension
        unevenly; a jax Sharding over other devices; a device count the module cannot use
        (shardings over K devices but ``len(devices) != K``, or K larger than
        ``len(jax.devices())``); duplicate devices or devices of several platforms.
      jax.errors.JaxRuntimeError: XLA rejected the module while compiling.

    Attributes:
      devices: tuple of the jax devices, in partition order.
      platform: ``"cpu"``, ``"cuda"``, ...
      parameters: tuple of :class:`ParameterInfo`, one per entry parameter.
      output_shapes / output_dtypes: global shapes and numpy dtypes of the results.
      output_shardings: the jax Shardings (with memory kinds) of the results.
      donated_parameters: sorted indices of the parameters the module donated (compiled
        without donation, see above).
      transfer_count: number of arrays this executor has placed (copied) so far, by
        :meth:`put`/:meth:`put_all` or implicitly in :meth:`__call__`.
    """

    def __init__(self, module, placements: Mapping | None = None, devices: Sequence | None = None, *,
                 result_memory_kinds: Mapping | None = None, host_memory_limit_bytes: int | None | str = _AUTO):
        # -- arguments: every check before the module is read ----------------------------
        _check_host_limit_arg(host_memory_limit_bytes)
        placements = _check_mapping(placements, "placements")
        result_memory_kinds = _check_mapping(result_memory_kinds, "result_memory_kinds")
        devices = _check_devices_arg(devices)
        src = _load(module)
        self.transfer_count = 0
        with _cj.make_ir_context() as ctx, ir.Location.unknown(ctx):
            mod = ir.Module.parse(src.mlir)
            entry = _read_entry(mod)
            _refuse_host_callbacks(mod)
            kinds, shard_specs = _requested_placements(src, entry, placements, result_memory_kinds)
            hlo_shardings = _parameter_shardings(entry, shard_specs)
            devices = _resolve_devices(src, entry, devices, shard_specs, hlo_shardings)
            res_kinds = _check_supported_kinds(src, entry, devices, kinds, result_memory_kinds)
            if len(devices) > 1:
                hlo_shardings = [hs if hs is not None else _cj.replicated_hlo_sharding() for hs in hlo_shardings]
            #: indices of the parameters the module itself donated (its input/output aliases),
            #: compiled WITHOUT donation: the caller's arrays are never deleted by a call.
            self.donated_parameters = _strip_donation(mod, entry.arg_attrs)
            _set_entry_attributes(entry, kinds, shard_specs, hlo_shardings, result_memory_kinds, res_kinds)
            res_has_sharding = [_str_attr(a, "mhlo.sharding") is not None for a in entry.res_attrs]
            self._bytecode = _cj.module_to_bytecode(mod)
        self._compile(devices, kinds, res_has_sharding)
        self._describe_signature(entry, kinds, shard_specs, hlo_shardings)
        if host_memory_limit_bytes == _AUTO:
            host_memory_limit_bytes = _default_host_limit(self.platform)
        self.host_memory_limit_bytes = host_memory_limit_bytes
        self._report = None
        log.info("compiled PJRT executable: %d parameter(s) (%d in pinned_host), %d result(s), %d %s device(s)",
                 len(entry.metas), kinds.count(PINNED_HOST), len(entry.out_metas), len(devices), self.platform)

    def _compile(self, devices: tuple, kinds: list, res_has_sharding: list) -> None:
        """Compile the rewritten module (``self._bytecode``) for ``devices`` with GSPMD partitioning.

        Sets ``devices``, ``platform``, the loaded executable and its optimized HLO text.

        Raises: jax.errors.JaxRuntimeError: XLA rejected the module.
        """
        self.devices = devices
        self.platform = devices[0].platform
        log.debug("compiling %d-parameter module for %d %s device(s); memory kinds %s",
                  len(kinds), len(devices), self.platform, kinds)
        # GSPMD (use_shardy_partitioner=False), parameter shardings kept as set on @main.
        self._exe = _cj.compile_spmd(self._bytecode, devices, num_parameters=len(kinds),
                                     result_has_sharding=res_has_sharding)
        self._compiled_text = _cj.compiled_hlo_text(self._exe)

    def _describe_signature(self, entry: "_Entry", kinds: list, shard_specs: list, hlo_shardings: list) -> None:
        """Set ``parameters`` (:class:`ParameterInfo`), ``output_shapes`` / ``output_dtypes`` /
        ``output_shardings`` and the compiled entry layout from the compiled executable.

        Raises: RuntimeError: the compiled module has another number of entry parameters.
        """
        devices, n = self.devices, len(self.devices)
        params = []
        for i, ((shape, dtype), hs) in enumerate(zip(entry.metas, hlo_shardings)):
            spec = shard_specs[i]
            if isinstance(spec, jax.sharding.Sharding) and not spec.is_fully_replicated:
                sharding = spec.with_memory_kind(kinds[i])
            elif n == 1 and (hs is None or not _is_tiled(hs)):
                sharding = SingleDeviceSharding(devices[0], memory_kind=kinds[i])
            else:
                sharding = _cj.gspmd_sharding(devices, hs, memory_kind=kinds[i])
            params.append(ParameterInfo(i, shape, dtype, kinds[i], str(hs) if hs is not None else "{replicated}",
                                        sharding))
        self.parameters = tuple(params)
        n_out = len(entry.out_metas)
        self.output_shapes = tuple(s for s, _ in entry.out_metas)
        self.output_dtypes = tuple(d for _, d in entry.out_metas)
        out_kinds = _cj.output_memory_kinds(self._exe) if n_out else []
        out_ops = _cj.output_hlo_shardings(self._exe) if n_out else []
        shardings = []
        for i in range(n_out):
            kind = out_kinds[i] if i < len(out_kinds) else DEVICE
            op = out_ops[i] if out_ops and i < len(out_ops) else None
            if n == 1 or op is None:
                s = (SingleDeviceSharding(devices[0], memory_kind=kind) if n == 1 else
                     _cj.gspmd_sharding(devices, _cj.replicated_hlo_sharding(), memory_kind=kind))
            else:
                s = _cj.gspmd_sharding(devices, op, memory_kind=kind)
            shardings.append(s)
        self.output_shardings = tuple(shardings)
        self._param_layout, self._result_layout = entry_layout(self._compiled_text)
        if len(self._param_layout) != len(entry.metas):
            raise RuntimeError(f"compiled module has {len(self._param_layout)} entry parameters, "
                               f"expected {len(entry.metas)}")

    @classmethod
    def from_policy(cls, module, policy, *, weights=(), grad_results=None, parameters=None,
                    devices: Sequence | None = None, host_memory_limit_bytes: int | None | str = _AUTO
                    ) -> "PjrtExecutor":
        """Compile ``module`` with the placements an ``OffloadPolicy`` gives (see :func:`placements_for_policy`).

        Args:
          module: a lowering with a parameter table, duck-typed: an object with ``hlo_proto``
            (serialized ``HloModuleProto`` bytes) and ``parameters`` (records with ``.id``
            and ``.sharding``), such as torch_xla's ``LoweredComputation`` (no torch import
            here); or anything :class:`PjrtExecutor` takes (then pass ``parameters`` or keep
            the module's shardings).
          policy: an ``xla_swap.planning.OffloadPolicy``; ``params`` and ``grads`` are applied.
          weights: entry parameter indices of the stacked per-layer weights (required when
            ``policy.params == "host"``), e.g. ``[lowered.parameter_id(w) for w in stacked]``.
          grad_results: result indices of those weights' gradients (required when
            ``policy.grads == "host"``; ``()`` for a forward-only module).
          parameters: the parameter table when ``module`` carries none (see
            :func:`placements_for_policy`); given with a lowering, it replaces the
            lowering's own table.
          devices, host_memory_limit_bytes: as for :class:`PjrtExecutor`.

        Returns:
          :class:`PjrtExecutor`; every parameter placed with the table's sharding, the weights
          in ``policy.params``'s memory kind, the gradient results in ``policy.grads``'s.

        Raises:
          TypeError / ValueError: as :func:`placements_for_policy` and :class:`PjrtExecutor`
            (all raised before compiling).
        """
        if hasattr(module, "hlo_proto") and hasattr(module, "parameters"):
            table = module.parameters if parameters is None else parameters
            module = module.hlo_proto
        else:
            table = parameters
        p = placements_for_policy(policy, table, weights=weights, grad_results=grad_results)
        return cls(module, p.placements, devices, result_memory_kinds=p.result_memory_kinds,
                   host_memory_limit_bytes=host_memory_limit_bytes)

    # -- introspection ---------------------------------------------------------------------
    @property
    def num_parameters(self) -> int:
        """Number of entry parameters."""
        return len(self.parameters)

    @property
    def num_outputs(self) -> int:
        """Number of results."""
        return len(self.output_shapes)

    @property
    def parameter_memory_kinds(self) -> tuple:
        """The requested memory kind of every parameter (``"device"`` / ``"pinned_host"``)."""
        return tuple(p.memory_kind for p in self.parameters)

    def stablehlo_text(self) -> str:
        """The StableHLO module as compiled: ``@main`` with the ``mhlo.memory_kind``/``mhlo.sharding`` set here."""
        with _cj.make_ir_context():
            return str(ir.Module.parse(self._bytecode))

    def compiled_hlo_text(self) -> str:
        """The optimized, partitioned HLO module (as one device runs it), with its entry layout."""
        return self._compiled_text

    def memory_report(self) -> MemoryReport:
        """The compiled memory use, per device, split between device and pinned host memory.

        Returns:
          :class:`xla_swap.executors.MemoryReport` with ``executor="pjrt"`` (bytes per device;
          compiled figures only, see its docstring for the sources).
        """
        return compiled_report("pjrt", len(self.devices), _cj.compiled_memory_stats(self._exe),
                               self._param_layout, self._result_layout)

    # -- placement -------------------------------------------------------------------------
    def _check_index(self, index) -> int:
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool) or not 0 <= index < self.num_parameters:
            raise ValueError(f"index: parameter {index!r} does not exist; the module has {self.num_parameters} "
                             f"entry parameter(s)")
        return int(index)

    def _check_value(self, index: int, x, where: str):
        """Liveness, shape and dtype check; returns ``x`` (jax.Array) or ``np.asarray(x)``."""
        p = self.parameters[index]
        if isinstance(x, jax.Array):
            if x.is_deleted():
                raise ValueError(f"{where}: parameter {index} got a deleted jax.Array (shape {list(x.shape)}, "
                                 f"{np.dtype(x.dtype)}): it was donated to another computation or .delete()d; "
                                 f"pass a live array")
        else:
            try:
                arr = np.asarray(x)
            except (TypeError, ValueError):   # a ragged nested list
                arr = None
            if arr is None or arr.dtype.kind in "OUS":   # None, a str: no array of numbers
                raise TypeError(f"{where}: parameter {index} expects a numpy array or jax.Array of {p.dtype} "
                                f"{list(p.shape)}, got {type(x).__name__} {x!r:.60}")
            x = arr
        if tuple(x.shape) != p.shape:
            raise ValueError(f"{where}: parameter {index} expects shape {list(p.shape)}, got {list(x.shape)}")
        if np.dtype(x.dtype) != p.dtype:
            raise TypeError(f"{where}: parameter {index} expects dtype {p.dtype}, got {np.dtype(x.dtype)}")
        return x

    def is_placed(self, index: int, x) -> bool:
        """Whether ``x`` is a live jax.Array already in parameter ``index``'s memory kind and sharding.

        Such arrays are passed to the executable as they are (no copy).
        """
        p = self.parameters[self._check_index(index)]
        if not isinstance(x, jax.Array) or x.is_deleted():
            return False
        if tuple(x.shape) != p.shape or np.dtype(x.dtype) != p.dtype:
            return False
        kind = x.sharding.memory_kind or DEVICE
        if kind != p.memory_kind:
            return False
        try:
            return x.sharding.with_memory_kind(kind).is_equivalent_to(p.sharding, len(p.shape))
        except Exception:  # sharding types that cannot be compared
            return False

    @staticmethod
    def _host_bytes(p: ParameterInfo) -> int:
        """Pinned host bytes an array of ``p`` occupies over all devices (0 for device params)."""
        if p.memory_kind != PINNED_HOST:
            return 0
        return p.shard_nbytes * len(p.sharding.addressable_devices)

    def host_bytes_in_use(self) -> int:
        """Bytes of live ``pinned_host`` jax arrays of this platform, over all devices."""
        total = 0
        for a in jax.live_arrays(self.platform):
            s = a.sharding
            if s.memory_kind != PINNED_HOST:
                continue
            total += int(math.prod(s.shard_shape(a.shape))) * a.dtype.itemsize * len(s.addressable_devices)
        return total

    def _check_host_limit(self, requested: int, what: str) -> None:
        if self.host_memory_limit_bytes is None or requested == 0:
            return
        in_use = self.host_bytes_in_use()
        if in_use + requested > self.host_memory_limit_bytes:
            raise HostMemoryError(
                f"{what}: placing {requested} bytes in pinned_host memory would exceed the pinned host limit of "
                f"{self.host_memory_limit_bytes} bytes ({in_use} bytes already in use). PJRT GPU caps its pinned "
                f"host pool with {HOST_MEMORY_LIMIT_ENV} (GiB, default {DEFAULT_GPU_HOST_MEMORY_LIMIT_GB}); raise "
                f"it, or keep fewer parameters in pinned_host.",
                requested, in_use, self.host_memory_limit_bytes)

    def _x64(self):
        """x64 mode while placing/executing when a parameter is 64-bit (jax would narrow it otherwise)."""
        if any(np.dtype(p.dtype).itemsize == 8 and np.dtype(p.dtype).kind in "iuf" for p in self.parameters):
            return _cj.enable_x64()
        return contextlib.nullcontext()

    def _device_put(self, index: int, x) -> jax.Array:
        p = self.parameters[index]
        try:
            with self._x64():
                out = jax.device_put(x, p.sharding)
        except Exception as e:
            if p.memory_kind == PINNED_HOST and _is_resource_exhausted(e):
                raise HostMemoryError(
                    f"parameter {index}: the runtime could not allocate {self._host_bytes(p)} bytes of pinned_host "
                    f"memory ({HOST_MEMORY_LIMIT_ENV} caps the PJRT GPU pinned pool, default "
                    f"{DEFAULT_GPU_HOST_MEMORY_LIMIT_GB} GiB): {str(e).splitlines()[0]}",
                    self._host_bytes(p)) from e
            raise
        self.transfer_count += 1
        return out

    def put(self, index: int, array) -> jax.Array:
        """Place one parameter's value in its memory kind and sharding.

        Keep the returned array and pass it to :meth:`__call__` again: it is used without a
        copy, so a ``pinned_host`` parameter stays resident in host memory between calls.

        Args:
          index: entry parameter index.
          array: numpy array or jax.Array of the parameter's global shape and exact dtype.

        Returns:
          a jax.Array with ``sharding`` equivalent to ``parameters[index].sharding`` (its
          ``memory_kind`` is the parameter's); ``array`` itself when it is already placed.

        Raises:
          ValueError: ``index`` does not exist (names it and the parameter count); wrong shape;
            ``array`` is a deleted jax.Array.
          TypeError: wrong dtype (names the parameter, expected and got); ``array`` is no
            array of numbers (``None``, a str).
          HostMemoryError: a ``pinned_host`` placement would exceed ``host_memory_limit_bytes``,
            or the runtime ran out of pinned host memory.
        """
        index = self._check_index(index)
        x = self._check_value(index, array, "put")
        if self.is_placed(index, x):
            return x
        self._check_host_limit(self._host_bytes(self.parameters[index]), f"put(parameter {index})")
        return self._device_put(index, x)

    def put_all(self, arrays: Sequence) -> list:
        """:meth:`put` every parameter; ``arrays[i]`` feeds parameter ``i``.

        All values are checked (count, shapes, dtypes, host limit) before anything is placed.

        Returns:
          list of jax.Arrays, one per parameter.

        Raises:
          ValueError: ``len(arrays) != num_parameters``; a wrong shape; a deleted jax.Array.
          TypeError: ``arrays`` is not a list or tuple (``None``, one array, a mapping); a
            wrong dtype; an element that is no array of numbers (``None``, a str).
          HostMemoryError: as in :meth:`put`, for the total of the host placements.
        """
        if isinstance(arrays, (str, bytes, Mapping)) or not isinstance(arrays, Sequence):
            raise TypeError(f"arrays: expected a list or tuple with one array per parameter "
                            f"({self.num_parameters}), got {type(arrays).__name__}")
        arrays = list(arrays)
        if len(arrays) != self.num_parameters:
            raise ValueError(f"put_all: expected {self.num_parameters} arrays (one per parameter), got {len(arrays)}")
        return self._place_all(arrays, "put_all")

    def _place_all(self, arrays: list, where: str) -> list:
        values = [self._check_value(i, x, f"{where}: argument {i}") for i, x in enumerate(arrays)]
        todo = [i for i, x in enumerate(values) if not self.is_placed(i, x)]
        host = sum(self._host_bytes(self.parameters[i]) for i in todo)
        self._check_host_limit(host, where)
        for i in todo:
            values[i] = self._device_put(i, values[i])
        return values

    # -- execution -------------------------------------------------------------------------
    def __call__(self, *args) -> list:
        """Run the module.

        Args:
          *args: one value per entry parameter, numpy arrays or jax.Arrays of the parameter's
            global shape and exact dtype. Arrays already placed (see :meth:`is_placed`, e.g.
            the results of :meth:`put`) are used as they are; others are placed first. No
            argument is donated: every array stays valid after the call.

        Returns:
          list of jax.Arrays, one per result, with global shapes ``output_shapes``, dtypes
          ``output_dtypes`` and shardings ``output_shardings``.

        Raises:
          ValueError: wrong number of arguments; a wrong shape (names the parameter index,
            expected and got); a deleted jax.Array. Nothing is placed or run then.
          TypeError: a wrong dtype; an argument that is no array of numbers (``None``, a str).
          HostMemoryError: the host placements of the arguments plus the host outputs and host
            temporaries would exceed ``host_memory_limit_bytes``, or the runtime ran out of
            pinned host memory while placing or executing.
          jax.errors.JaxRuntimeError: other runtime failures.
        """
        if len(args) != self.num_parameters:
            raise ValueError(f"call: the module has {self.num_parameters} parameter(s), got {len(args)} argument(s)")
        if self.host_memory_limit_bytes is not None:
            if self._report is None:
                self._report = self.memory_report()
            extra = (self._report.host_output_bytes + self._report.host_temp_bytes) * len(self.devices)
            values = [self._check_value(i, x, f"call: argument {i}") for i, x in enumerate(args)]
            todo = [i for i, x in enumerate(values) if not self.is_placed(i, x)]
            self._check_host_limit(sum(self._host_bytes(self.parameters[i]) for i in todo) + extra, "call")
        values = self._place_all(list(args), "call")
        try:
            with self._x64():
                shards = _cj.execute_sharded(self._exe, values)
        except Exception as e:
            if _is_host_oom(e):
                raise HostMemoryError(
                    f"call: the runtime ran out of pinned host memory while executing ({HOST_MEMORY_LIMIT_ENV} caps "
                    f"the PJRT GPU pinned pool, default {DEFAULT_GPU_HOST_MEMORY_LIMIT_GB} GiB): "
                    f"{str(e).splitlines()[0]}", 0) from e
            raise
        with self._x64():
            return [jax.make_array_from_single_device_arrays(shape, sharding, list(arrs))
                    for shape, sharding, arrs in zip(self.output_shapes, self.output_shardings, shards)]

    execute = __call__

    def __repr__(self) -> str:
        kinds = ", ".join(f"{p.index}:{p.memory_kind}" for p in self.parameters)
        return (f"PjrtExecutor({self.num_parameters} params [{kinds}], {self.num_outputs} outputs, "
                f"{len(self.devices)} {self.platform} device(s))")


def compile_lowered(lowered: "jax.stages.Lowered", placements: Mapping | None = None,
                    devices: Sequence | None = None, *, result_memory_kinds: Mapping | None = None,
                    host_memory_limit_bytes: int | None | str = _AUTO) -> PjrtExecutor:
    """Compile a ``jax.jit(f, ...).lower(...)`` result on the same path as torch_xla HLO.

    The lowering's HLO (``compiler_ir('hlo')``) is compiled like an ``HloModuleProto`` from
    torch_xla; the memory kinds JAX lowered the arguments and results with (``in_shardings``
    / ``out_shardings`` with ``memory_kind``) are the defaults, ``placements`` override them.

    Args:
      lowered: a :class:`jax.stages.Lowered`. Its entry parameters are the flattened
        arguments jax kept (unused ones are dropped by jax).
      placements, devices, result_memory_kinds, host_memory_limit_bytes: as for
        :class:`PjrtExecutor` (``result_memory_kinds`` overrides the lowering's own).

    Returns:
      :class:`PjrtExecutor`.

    Raises:
      TypeError: ``lowered`` is not a ``jax.stages.Lowered``.
      ValueError: as for :class:`PjrtExecutor` (host callbacks are refused); the lowering
        hoisted constants into arguments.
    """
    if not isinstance(lowered, jax.stages.Lowered):
        raise TypeError(f"lowered: expected a jax.stages.Lowered (jax.jit(f).lower(...)), got {type(lowered).__name__}")
    return PjrtExecutor(lowered, placements, devices, result_memory_kinds=result_memory_kinds,
                        host_memory_limit_bytes=host_memory_limit_bytes)


__all__ = ["PjrtExecutor", "ParameterPlacement", "ParameterInfo", "MemoryReport", "HostMemoryError",
           "PolicyPlacements", "placements_for_policy", "compile_lowered", "MEMORY_KINDS", "DEVICE", "PINNED_HOST",
           "HOST_MEMORY_LIMIT_ENV", "HOST_MEMORY_SPACE"]
