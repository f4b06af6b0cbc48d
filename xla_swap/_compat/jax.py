"""The private jax / jaxlib APIs xla_swap calls, each wrapped once.

Imports jax and numpy only: no torch, no torch_xla (the executors import this module, and the
GPU machine has neither; ``tests/integration/test_layering.py`` checks it with torch and
torch_xla blocked).

What is wrapped, by the part of xla_swap that needs it:

* MLIR modules (:mod:`xla_swap.executors.pjrt`, :mod:`xla_swap.lowering.offload`):
  :func:`make_ir_context`, :func:`module_to_bytecode`, :func:`ir_element_type_factories`,
  :func:`hlo_to_stablehlo`, :func:`stablehlo_to_hlo_proto`.
* HLO shardings and jax shardings (pjrt): :func:`parse_hlo_sharding`,
  :func:`replicated_hlo_sharding`, :func:`hlo_sharding_layout`, :func:`sharding_to_hlo`,
  :func:`sharding_devices`, :func:`gspmd_sharding`.
* Lowerings, x64 mode (pjrt): :func:`lowered_const_args`, :func:`enable_x64`.
* The PJRT client and its loaded executables (pjrt): :func:`compile_spmd`,
  :func:`compiled_memory_stats`, :func:`compiled_hlo_text`, :func:`output_memory_kinds`,
  :func:`output_hlo_shardings`, :func:`execute_sharded`.
* jax's in-memory caches (tests that a dropped runtime releases them): :func:`tracing_cache_entries`.
* Whether jax's backends (the PJRT clients) have started (:mod:`xla_swap.executors.host_pool`):
  :func:`backends_initialized`.
* cuDNN's fused attention with a bias that gets no gradient (:mod:`xla_swap.stack.torch_attention`):
  :func:`cudnn_attention_fixed_bias`.

Verified versions (:data:`VERIFIED`): jax/jaxlib 0.10.2 on CPU (Python 3.11, ``make test``)
and 0.11.2 on CPU (Python 3.12, ``make test-jax-only``) and on NVIDIA H200s with the CUDA 13
plugin, 1 and 2 GPUs (``tests/executors/test_compat_jax.py``, 2026-11-24). A wrapper whose
API is missing raises :class:`~xla_swap._compat.MissingUpstreamAPI` naming it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from xla_swap._compat import MissingUpstreamAPI, _resolve

#: The jax / jaxlib versions these wrappers were verified on.
VERIFIED = "jax/jaxlib 0.10.2 (CPU) and 0.11.2 (CPU; CUDA 13 on H200)"

__all__ = ["VERIFIED", "MissingUpstreamAPI", "HloShardingLayout", "make_ir_context", "module_to_bytecode",
           "ir_element_type_factories", "hlo_to_stablehlo", "stablehlo_to_hlo_proto", "parse_hlo_sharding",
           "replicated_hlo_sharding", "hlo_sharding_layout", "sharding_to_hlo", "sharding_devices", "gspmd_sharding",
           "lowered_const_args", "enable_x64", "compile_spmd", "compiled_memory_stats", "compiled_hlo_text",
           "output_memory_kinds", "output_hlo_shardings", "execute_sharded", "tracing_cache_entries",
           "backends_initialized", "cudnn_attention_fixed_bias"]

_LIB = "jax._src.lib"          # holds jaxlib's xla_client (an attribute, not a module)
_XLA_CLIENT = f"{_LIB}.xla_client"


def _installed() -> str:
    try:
        import jaxlib
        lib = getattr(jaxlib, "__version__", "?")
    except ImportError:  # pragma: no cover - jax cannot run without jaxlib
        lib = "missing"
    return f"jax {jax.__version__} / jaxlib {lib}"


def _lookup(module: str, path: str = ""):
    """``module.path``; :class:`MissingUpstreamAPI` naming it (and the installed version) when absent."""
    return _resolve(module, path, _installed, VERIFIED)


def _member(obj, name: str, api: str):
    """``getattr(obj, name)``; :class:`MissingUpstreamAPI` naming ``api`` when absent."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise MissingUpstreamAPI(api, _installed(), VERIFIED) from None


# ---------------------------------------------------------------------------------------
# MLIR modules
# ---------------------------------------------------------------------------------------
def make_ir_context():
    """A new MLIR context with jax's dialects loaded (use it as ``with make_ir_context() as ctx:``).

    Wraps ``jax.interpreters.mlir.make_ir_context`` (``jax._src.interpreters.mlir``). The
    MLIR Python bindings themselves are public: ``jax.extend.mlir.ir``. Verified: :data:`VERIFIED`.
    """
    return _lookup("jax.interpreters.mlir", "make_ir_context")()


def module_to_bytecode(module) -> bytes:
    """Serialize an MLIR ``ir.Module`` to MLIR bytecode.

    Wraps ``jax.interpreters.mlir.module_to_bytecode``. Verified: :data:`VERIFIED`.
    """
    return _lookup("jax.interpreters.mlir", "module_to_bytecode")(module)


def ir_element_type_factories() -> dict:
    """jax's table ``{numpy dtype (type or dtype): callable returning the MLIR element type}``.

    Needs an active MLIR context to call the factories. Wraps the private table
    ``jax._src.interpreters.mlir._dtype_to_ir_type`` (a copy is returned). Verified: :data:`VERIFIED`.
    """
    return dict(_lookup("jax._src.interpreters.mlir", "_dtype_to_ir_type"))


def hlo_to_stablehlo(proto: bytes) -> bytes:
    """Convert a serialized ``HloModuleProto`` to a StableHLO module (MLIR bytecode).

    Wraps ``jax._src.lib.xla_client._xla.mlir.hlo_to_stablehlo`` (jaxlib). Raises whatever
    jaxlib raises for bytes that are not an ``HloModuleProto`` (its error type differs
    between versions). Verified: :data:`VERIFIED`.
    """
    return _lookup(_LIB, "xla_client._xla.mlir.hlo_to_stablehlo")(proto)


def stablehlo_to_hlo_proto(module) -> bytes:
    """Convert a StableHLO module (MLIR text ``str`` or bytecode ``bytes``) to a serialized ``HloModuleProto``.

    No tuple arguments, no tuple result. Shardy annotations become ``mhlo.sharding`` (as in
    jax's own ``compiler_ir('hlo')``). Wraps
    ``jax._src.lib.xla_client._xla.mlir.mlir_module_to_xla_computation`` (jaxlib) and the
    result's ``as_serialized_hlo_module_proto``. Verified: :data:`VERIFIED`.
    """
    convert = _lookup(_LIB, "xla_client._xla.mlir.mlir_module_to_xla_computation")
    comp = convert(module, use_tuple_args=False, return_tuple=False)
    return _member(comp, "as_serialized_hlo_module_proto", "XlaComputation.as_serialized_hlo_module_proto")()


# ---------------------------------------------------------------------------------------
# shardings
# ---------------------------------------------------------------------------------------
def parse_hlo_sharding(text: str):
    """Parse an HLO sharding string (``"{devices=[4,1]0,1,2,3}"``, ``"{replicated}"``) into a jaxlib ``HloSharding``.

    Wraps ``jax._src.lib.xla_client.HloSharding.from_string`` (jaxlib); raises what it
    raises for an invalid string. ``str()`` of the result prints it back. Verified: :data:`VERIFIED`.
    """
    return _lookup(_LIB, "xla_client.HloSharding.from_string")(text)


def replicated_hlo_sharding():
    """The replicated jaxlib ``HloSharding``.

    Wraps ``jax._src.lib.xla_client.HloSharding.replicate`` (jaxlib). Verified: :data:`VERIFIED`.
    """
    return _lookup(_LIB, "xla_client.HloSharding.replicate")()


@dataclasses.dataclass(frozen=True)
class HloShardingLayout:
    """What xla_swap reads off a jaxlib ``HloSharding`` (see :func:`hlo_sharding_layout`).

    Attributes:
      kind: ``"replicated"``, ``"manual"``, ``"unknown"``, ``"tiled"``, ``"maximal"`` or
        ``"other"`` (checked in that order).
      num_devices: devices a tiled sharding spans (0 for the other kinds).
      tile_dims: the tile assignment's dimensions (tiled only; ``()`` otherwise), including
        the trailing replication / subgroup dimensions.
      device_ids: the device ids of the tile assignment (for a maximal sharding, the device it
        names).
      replicate_on_last_tile_dim: the last tile dimension replicates (tiled only).
      num_subgroup_dims: the number of trailing subgroup dimensions (``last_tile_dims``).
    """
    kind: str
    num_devices: int = 0
    tile_dims: tuple = ()
    device_ids: tuple = ()
    replicate_on_last_tile_dim: bool = False
    num_subgroup_dims: int = 0

    @property
    def tiled_rank(self) -> int:
        """Number of array dimensions a tiled sharding splits (its tile dimensions less the trailing ones)."""
        return len(self.tile_dims) - int(self.replicate_on_last_tile_dim) - self.num_subgroup_dims


def hlo_sharding_layout(hs) -> HloShardingLayout:
    """Read kind, tiling and devices off a jaxlib ``HloSharding`` (from :func:`parse_hlo_sharding`).

    Wraps the jaxlib ``HloSharding`` methods ``is_replicated``, ``is_manual``,
    ``is_unknown``, ``is_tiled``, ``is_maximal``, ``num_devices``,
    ``tile_assignment_dimensions``, ``tile_assignment_devices``,
    ``replicate_on_last_tile_dim`` and ``subgroup_types``. Verified: :data:`VERIFIED`.
    """
    def call(name):
        return _member(hs, name, f"{_XLA_CLIENT}.HloSharding.{name}")()

    for kind in ("replicated", "manual", "unknown"):
        if call(f"is_{kind}"):
            return HloShardingLayout(kind)
    if call("is_tiled"):
        return HloShardingLayout(
            "tiled", num_devices=int(call("num_devices")),
            tile_dims=tuple(int(d) for d in call("tile_assignment_dimensions")),
            device_ids=tuple(int(d) for d in call("tile_assignment_devices")),
            replicate_on_last_tile_dim=bool(call("replicate_on_last_tile_dim")),
            num_subgroup_dims=len(call("subgroup_types")))
    if call("is_maximal"):
        return HloShardingLayout("maximal", device_ids=tuple(int(d) for d in call("tile_assignment_devices")))
    return HloShardingLayout("other")


def sharding_to_hlo(sharding, ndim: int):
    """The jaxlib ``HloSharding`` of a :class:`jax.sharding.Sharding` for an array of rank ``ndim``.

    Wraps the private method ``jax.sharding.Sharding._to_xla_hlo_sharding``. Verified: :data:`VERIFIED`.
    """
    return _member(sharding, "_to_xla_hlo_sharding", "jax.sharding.Sharding._to_xla_hlo_sharding")(ndim)


def sharding_devices(sharding) -> tuple:
    """The devices of a :class:`jax.sharding.Sharding` in its device-assignment order (a tuple).

    (``Sharding.device_set`` is public but unordered.) Wraps the private property
    ``jax.sharding.Sharding._device_assignment``. Verified: :data:`VERIFIED`.
    """
    return tuple(_member(sharding, "_device_assignment", "jax.sharding.Sharding._device_assignment"))


def gspmd_sharding(devices: Sequence, hlo_sharding, memory_kind: str | None = None):
    """A :class:`jax.sharding.Sharding` over ``devices`` (in order) given by a jaxlib ``HloSharding`` or ``OpSharding``.

    Wraps ``jax._src.sharding_impls.GSPMDSharding(devices, op_sharding, memory_kind=...)``
    (not exported by ``jax.sharding``). Verified: :data:`VERIFIED`.
    """
    cls = _lookup("jax._src.sharding_impls", "GSPMDSharding")
    return cls(tuple(devices), hlo_sharding, memory_kind=memory_kind)


# ---------------------------------------------------------------------------------------
# lowerings, x64
# ---------------------------------------------------------------------------------------
def lowered_const_args(lowered) -> tuple:
    """The constants a :class:`jax.stages.Lowered` hoisted into extra leading arguments (``()`` for none).

    jax hoists constants only with ``jax_use_simplified_jaxpr_constants`` on a lowering path
    that asks for it; a version without that feature has no such constants, so a missing
    attribute reads as ``()`` here. Wraps the private ``jax.stages.Lowered._lowering.const_args``.
    Verified: :data:`VERIFIED`.
    """
    return tuple(getattr(getattr(lowered, "_lowering", None), "const_args", None) or ())


def enable_x64():
    """A context manager in which jax keeps 64-bit types (``with enable_x64(): ...``).

    Wraps ``jax.enable_x64(True)`` (jax >= 0.10; older releases only had
    ``jax.experimental.enable_x64``, which the tested versions no longer have). Verified:
    :data:`VERIFIED`.
    """
    fn = getattr(jax, "enable_x64", None)
    if fn is None:
        fn = _lookup("jax.experimental", "enable_x64")
        return fn()
    return fn(True)


# ---------------------------------------------------------------------------------------
# the PJRT client and its loaded executables
# ---------------------------------------------------------------------------------------
def compile_spmd(bytecode: bytes, devices: Sequence, *, num_parameters: int, result_has_sharding: Sequence[bool]):
    """Compile a StableHLO module (bytecode) with GSPMD partitioning over ``devices``; returns the loaded executable.

    One replica, ``len(devices)`` partitions in ``devices`` order, GSPMD (not Shardy),
    parameter shardings kept as the module gives them, result shardings propagated where
    ``result_has_sharding[i]`` is False.

    Wraps ``jax.extend.backend.get_backend(platform).compile_and_load`` with
    ``jax._src.lib.xla_client.CompileOptions`` (its ``executable_build_options``:
    ``num_replicas``, ``num_partitions``, ``use_spmd_partitioning``, ``use_shardy_partitioner``,
    ``allow_spmd_sharding_propagation_to_parameters`` / ``_to_output``),
    ``xla_client.DeviceAssignment.create`` and ``xla_client.DeviceList``. Verified: :data:`VERIFIED`.
    """
    devices = tuple(devices)
    n = len(devices)
    backend = _lookup("jax.extend.backend", "get_backend")(devices[0].platform)
    opts = _lookup(_LIB, "xla_client.CompileOptions")()
    opts.num_replicas = 1
    opts.num_partitions = n
    bo = opts.executable_build_options
    bo.num_replicas = 1
    bo.num_partitions = n
    bo.use_spmd_partitioning = True
    bo.use_shardy_partitioner = False
    bo.allow_spmd_sharding_propagation_to_parameters = [False] * max(num_parameters, 1)
    bo.allow_spmd_sharding_propagation_to_output = [not h for h in result_has_sharding] or [False]
    opts.device_assignment = _lookup(_LIB, "xla_client.DeviceAssignment.create")(np.array([[d.id for d in devices]]))
    device_list = _lookup(_LIB, "xla_client.DeviceList")(devices)
    compile_and_load = _member(backend, "compile_and_load", "jax.extend.backend Client.compile_and_load")
    return compile_and_load(bytecode, device_list, opts)


def compiled_memory_stats(exe) -> dict:
    """The compiled memory statistics of a loaded executable: ``{"argument_size_in_bytes": int, ...}``.

    Every ``*_in_bytes`` integer field (``host_*`` among them; the CPU client reports those
    as 0). Wraps ``LoadedExecutable.get_compiled_memory_stats`` (jaxlib). Verified: :data:`VERIFIED`.
    """
    st = _member(exe, "get_compiled_memory_stats", "LoadedExecutable.get_compiled_memory_stats")()
    return {k: int(getattr(st, k)) for k in dir(st)
            if k.endswith("_in_bytes") and isinstance(getattr(st, k), int)}


def compiled_hlo_text(exe) -> str:
    """The optimized HLO module of a loaded executable as one device runs it, with its entry layout.

    Wraps ``LoadedExecutable.hlo_modules()[0].to_string()`` (jaxlib). Verified: :data:`VERIFIED`.
    """
    modules = _member(exe, "hlo_modules", "LoadedExecutable.hlo_modules")()
    return modules[0].to_string()


def output_memory_kinds(exe) -> list:
    """The memory kind (``"device"``, ``"pinned_host"``, ...) of every result of a loaded executable.

    Wraps ``LoadedExecutable.get_output_memory_kinds()[0]`` (jaxlib; one list per program,
    the entry program's first). Call it only for an executable with results. Verified: :data:`VERIFIED`.
    """
    return list(_member(exe, "get_output_memory_kinds", "LoadedExecutable.get_output_memory_kinds")()[0])


def output_hlo_shardings(exe) -> list:
    """The sharding of every result of a loaded executable, as jaxlib ``OpSharding`` protos.

    :func:`gspmd_sharding` takes them as they are. Wraps
    ``LoadedExecutable.get_output_shardings`` (jaxlib); ``[]`` where jaxlib returns ``None``.
    Verified: :data:`VERIFIED`.
    """
    return list(_member(exe, "get_output_shardings", "LoadedExecutable.get_output_shardings")() or [])


def execute_sharded(exe, args: Sequence[Any]) -> list:
    """Run a loaded executable on placed ``jax.Array`` arguments; per result, its single-device arrays.

    Returns a list with one entry per result, each the list of that result's per-device
    shards (``jax.make_array_from_single_device_arrays`` builds the global arrays). Wraps
    ``LoadedExecutable.execute_sharded`` and ``ExecuteResults.disassemble_into_single_device_arrays``
    (jaxlib). Verified: :data:`VERIFIED`.
    """
    results = _member(exe, "execute_sharded", "LoadedExecutable.execute_sharded")(list(args))
    return _member(results, "disassemble_into_single_device_arrays",
                   "ExecuteResults.disassemble_into_single_device_arrays")()


# ---------------------------------------------------------------------------------------
# jax's in-memory caches (tests of the runtimes' release)
# ---------------------------------------------------------------------------------------
def tracing_cache_entries() -> int:
    """The number of entries held now by jax's registered in-memory caches (tracing, lowering,
    abstract evaluation: every ``functools.lru_cache`` / ``weakref_lru_cache`` jax registers).

    A weak-keyed entry is dropped when its key (e.g. a traced function) dies, so the count
    returns to its level once the objects that were traced are gone. Caches without
    ``cache_info()`` are not counted. Wraps the private registry ``jax._src.util._caches``.
    Verified: jax 0.10.2 (CPU).
    """
    total = 0
    for cache in list(_lookup("jax._src.util", "_caches").keys()):
        info = getattr(cache, "cache_info", None)
        if info is not None:
            total += int(getattr(info(), "currsize", 0) or 0)
    return total


# ---------------------------------------------------------------------------------------
# backend start-up (environment read by the PJRT clients when they are created)
# ---------------------------------------------------------------------------------------
def backends_initialized() -> bool:
    """Whether jax has created its backends (PJRT clients) in this process: from then on an
    environment variable read at client creation (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``) has no
    effect. Wraps ``jax._src.xla_bridge.backends_are_initialized``. Verified: jax 0.10.2 and 0.11.2 (CPU).
    """
    return bool(_lookup("jax._src.xla_bridge", "backends_are_initialized")())


# ---------------------------------------------------------------------------------------
# cuDNN fused attention
# ---------------------------------------------------------------------------------------
_CUDNN_ATTENTION = "jax._src.cudnn.fused_attention_stablehlo"


def cudnn_attention_fixed_bias(query, key, value, bias, *, scale: float, is_causal: bool):
    """cuDNN's fused attention with an additive ``bias`` whose gradient is not computed.

    ``jax.nn.dot_product_attention(bias=..., implementation="cudnn")`` has its backward compute
    the bias gradient for any float bias, a second output of the backward kernel. This calls the
    same kernels with that output off: the gradient of ``bias`` is zero, so use it only where
    the bias is not differentiated.

    Args:
      query: ``[B, T, N, H]``; key, value: ``[B, S, K, H]`` with ``N % K == 0``; bf16 or fp16.
      bias: broadcastable to ``[B, N, T, S]`` (up to 4 dimensions), the operands' dtype.
      scale: the factor of ``q k^T``. is_causal: add cuDNN's causal mask.

    Returns: ``[B, T, N, H]``, the operands' dtype.

    Raises: ValueError from jax's layout checks (a shape or dtype cuDNN's kernel does not take);
      RuntimeError without cuDNN (no GPU); :class:`MissingUpstreamAPI` when the private module or
      one of its members is absent.

    Wraps ``jax._src.cudnn.fused_attention_stablehlo._dot_product_attention`` with
    ``variadic_args=(has_bias=True, has_dbias=False)``, as its public ``dot_product_attention``
    does for a bias made from a boolean mask. Verified: jax 0.11.2 on an NVIDIA H100 (CUDA 13,
    cuDNN 9.19); the same signature in 0.10.2.
    """
    import jax.numpy as jnp
    m = _lookup(_CUDNN_ATTENTION)

    def get(name):
        return _member(m, name, f"{_CUDNN_ATTENTION}.{name}")
    core = get("_dot_product_attention")
    layout = get("_normalize_layout")("BTNH")
    mask_types = get("MaskType")
    cudnn_version = get("check_cudnn_version")()
    bias = get("combine_bias_and_mask")(bias, None, query.dtype)
    get("check_layout")(query, key, value, bias, None, None, None, None, None, None, layout)
    unused = jnp.zeros(0, dtype=query.dtype)
    mask_type = mask_types.CAUSAL if is_causal else mask_types.NO_MASK
    return core(query, key, value, bias, unused, unused, unused, unused, unused, unused, float(scale), 42, 0.0,
                (True, False), mask_type, layout.value, None, cudnn_version, False)
