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
:class:`xla_swap.executors.MemoryReport`, defined in ``report.py``). The executor's parts, one
idea per module of ``xla_swap/executors/pjrt/`` beside this one, are listed in docs/explanation/design.md.
"""
from __future__ import annotations

import logging
from typing import Mapping, Sequence

import jax
from jax.extend.mlir import ir
from jax.sharding import SingleDeviceSharding

from xla_swap._compat import jax as _cj   # every private jax / jaxlib API used here
from xla_swap.planning.policy import DEVICE, MEMORY_KINDS, PINNED_HOST  # noqa: F401 (re-exported)

from .buffers import ParameterBuffers
from .host_memory import (AUTO, DEFAULT_GPU_HOST_MEMORY_LIMIT_GB, HOST_MEMORY_LIMIT_ENV,  # noqa: F401
                          HostMemoryError, check_host_limit_arg, default_host_limit, is_host_oom)
from .module import (EntryFunction, load_module, read_entry, refuse_host_callbacks, set_entry_attributes,
                     str_attr, strip_donation)
from .placement import (ParameterInfo, ParameterPlacement, check_devices_arg, check_mapping,  # noqa: F401
                        check_supported_kinds, requested_placements)
from .policy import PolicyPlacements, placements_for_policy  # noqa: F401 (re-exported)
from .sharding import is_tiled, parameter_shardings, resolve_devices
from ..report import HOST_MEMORY_SPACE, MemoryReport, compiled_report, entry_layout  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


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
                 result_memory_kinds: Mapping | None = None, host_memory_limit_bytes: int | None | str = AUTO):
        # -- arguments: every check before the module is read ----------------------------
        check_host_limit_arg(host_memory_limit_bytes)
        placements = check_mapping(placements, "placements")
        result_memory_kinds = check_mapping(result_memory_kinds, "result_memory_kinds")
        devices = check_devices_arg(devices)
        source = load_module(module)
        with _cj.make_ir_context() as ctx, ir.Location.unknown(ctx):
            mod = ir.Module.parse(source.mlir)
            entry = read_entry(mod)
            refuse_host_callbacks(mod)
            kinds, shard_specs = requested_placements(source, entry, placements, result_memory_kinds)
            hlo_shardings = parameter_shardings(entry, shard_specs)
            devices = resolve_devices(source, entry, devices, shard_specs, hlo_shardings)
            res_kinds = check_supported_kinds(source, entry, devices, kinds, result_memory_kinds)
            if len(devices) > 1:
                hlo_shardings = [h if h is not None else _cj.replicated_hlo_sharding() for h in hlo_shardings]
            #: indices of the parameters the module itself donated (its input/output aliases),
            #: compiled WITHOUT donation: the caller's arrays are never deleted by a call.
            self.donated_parameters = strip_donation(mod, entry.arg_attrs)
            set_entry_attributes(entry, kinds, shard_specs, hlo_shardings, result_memory_kinds, res_kinds)
            res_has_sharding = [str_attr(a, "mhlo.sharding") is not None for a in entry.res_attrs]
            self._bytecode = _cj.module_to_bytecode(mod)
        self._compile(devices, kinds, res_has_sharding)
        self._describe_signature(entry, kinds, shard_specs, hlo_shardings)
        #: the placement of the arguments (:class:`ParameterBuffers`): checks, the host limit, the copies.
        self.buffers = ParameterBuffers(self.parameters, self.platform, None)
        self.host_memory_limit_bytes = host_memory_limit_bytes   # "auto" resolved for the platform
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

    def _describe_signature(self, entry: EntryFunction, kinds: list, shard_specs: list, hlo_shardings: list) -> None:
        """Set ``parameters`` (:class:`ParameterInfo`), ``output_shapes`` / ``output_dtypes`` /
        ``output_shardings`` and the compiled entry layout from the compiled executable.

        Raises: RuntimeError: the compiled module has another number of entry parameters.
        """
        devices, n = self.devices, len(self.devices)
        params = []
        for i, ((shape, dtype), hlo_sharding) in enumerate(zip(entry.metas, hlo_shardings)):
            spec = shard_specs[i]
            if isinstance(spec, jax.sharding.Sharding) and not spec.is_fully_replicated:
                sharding = spec.with_memory_kind(kinds[i])
            elif n == 1 and (hlo_sharding is None or not is_tiled(hlo_sharding)):
                sharding = SingleDeviceSharding(devices[0], memory_kind=kinds[i])
            else:
                sharding = _cj.gspmd_sharding(devices, hlo_sharding, memory_kind=kinds[i])
            text = str(hlo_sharding) if hlo_sharding is not None else "{replicated}"
            params.append(ParameterInfo(i, shape, dtype, kinds[i], text, sharding))
        self.parameters = tuple(params)
        n_out = len(entry.out_metas)
        self.output_shapes = tuple(s for s, _ in entry.out_metas)
        self.output_dtypes = tuple(d for _, d in entry.out_metas)
        out_kinds = _cj.output_memory_kinds(self._exe) if n_out else []
        out_hlo_shardings = _cj.output_hlo_shardings(self._exe) if n_out else []
        shardings = []
        for i in range(n_out):
            kind = out_kinds[i] if i < len(out_kinds) else DEVICE
            out_hlo = out_hlo_shardings[i] if out_hlo_shardings and i < len(out_hlo_shardings) else None
            if n == 1 or out_hlo is None:
                sharding = (SingleDeviceSharding(devices[0], memory_kind=kind) if n == 1 else
                            _cj.gspmd_sharding(devices, _cj.replicated_hlo_sharding(), memory_kind=kind))
            else:
                sharding = _cj.gspmd_sharding(devices, out_hlo, memory_kind=kind)
            shardings.append(sharding)
        self.output_shardings = tuple(shardings)
        self._param_layout, self._result_layout = entry_layout(self._compiled_text)
        if len(self._param_layout) != len(entry.metas):
            raise RuntimeError(f"compiled module has {len(self._param_layout)} entry parameters, "
                               f"expected {len(entry.metas)}")

    @classmethod
    def from_policy(cls, module, policy, *, weights=(), grad_results=None, parameters=None,
                    devices: Sequence | None = None, host_memory_limit_bytes: int | None | str = AUTO
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
        placed = placements_for_policy(policy, table, weights=weights, grad_results=grad_results)
        return cls(module, placed.placements, devices, result_memory_kinds=placed.result_memory_kinds,
                   host_memory_limit_bytes=host_memory_limit_bytes)

    # -- introspection ---------------------------------------------------------------------
    @property
    def num_outputs(self) -> int:
        """Number of results."""
        return len(self.output_shapes)

    # -- the arguments' placement (``buffers``) -------------------------------------------
    @property
    def num_parameters(self) -> int:
        """Number of entry parameters."""
        return len(self.parameters)

    @property
    def host_memory_limit_bytes(self) -> int | None:
        """The cap on live ``pinned_host`` bytes over all devices that placements check (None: no limit)."""
        return self.buffers.host_memory_limit_bytes

    @host_memory_limit_bytes.setter
    def host_memory_limit_bytes(self, value) -> None:
        """Set the cap (as the constructor's argument: None, ``"auto"`` or an int >= 0; ValueError otherwise)."""
        check_host_limit_arg(value)
        self.buffers.host_memory_limit_bytes = default_host_limit(self.platform) if value == AUTO else value

    @property
    def transfer_count(self) -> int:
        """Number of arrays this executor has placed (copied) so far."""
        return self.buffers.transfer_count

    def put(self, index: int, array) -> jax.Array:
        """Place one parameter's value in its memory kind and sharding: :meth:`ParameterBuffers.put`."""
        return self.buffers.put(index, array)

    def put_all(self, arrays: Sequence) -> list:
        """:meth:`put` every parameter, all checked first: :meth:`ParameterBuffers.put_all`."""
        return self.buffers.put_all(arrays)

    def is_placed(self, index: int, x) -> bool:
        """Whether ``x`` is used by a call without a copy: :meth:`ParameterBuffers.is_placed`."""
        return self.buffers.is_placed(index, x)

    def host_bytes_in_use(self) -> int:
        """Bytes of live ``pinned_host`` jax arrays of this platform, over all devices."""
        return self.buffers.host_bytes_in_use()

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
        host_results = 0
        if self.buffers.host_memory_limit_bytes is not None:
            if self._report is None:
                self._report = self.memory_report()
            host_results = (self._report.host_output_bytes + self._report.host_temp_bytes) * len(self.devices)
        values = self.buffers.place_all(list(args), "call", extra_host_bytes=host_results)
        try:
            with self.buffers.x64():
                shards = _cj.execute_sharded(self._exe, values)
        except Exception as e:
            if is_host_oom(e):
                raise HostMemoryError(
                    f"call: the runtime ran out of pinned host memory while executing ({HOST_MEMORY_LIMIT_ENV} caps "
                    f"the PJRT GPU pinned pool, default {DEFAULT_GPU_HOST_MEMORY_LIMIT_GB} GiB): "
                    f"{str(e).splitlines()[0]}", 0) from e
            raise
        with self.buffers.x64():
            return [jax.make_array_from_single_device_arrays(shape, sharding, list(arrs))
                    for shape, sharding, arrs in zip(self.output_shapes, self.output_shardings, shards)]

    execute = __call__

    def __repr__(self) -> str:
        kinds = ", ".join(f"{p.index}:{p.memory_kind}" for p in self.parameters)
        return (f"PjrtExecutor({self.num_parameters} params [{kinds}], {self.num_outputs} outputs, "
                f"{len(self.devices)} {self.platform} device(s))")


def compile_lowered(lowered: "jax.stages.Lowered", placements: Mapping | None = None,
                    devices: Sequence | None = None, *, result_memory_kinds: Mapping | None = None,
                    host_memory_limit_bytes: int | None | str = AUTO) -> PjrtExecutor:
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
