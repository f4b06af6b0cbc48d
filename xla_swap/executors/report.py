"""One memory-report type for every executor: :class:`MemoryReport`.

``PjrtExecutor.memory_report()``, ``InGraphRuntime.memory_report()`` and
``StreamingRuntime.memory_report()`` all return it. Units: bytes (ints), **per device** (under
SPMD every device runs the partitioned program: a parameter sharded N ways counts 1/N of its
global size, a replicated one in full). Imports nothing heavy (no jax, no numpy).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping

from xla_swap.planning.policy import DEVICE, PINNED_HOST, FrozenMapping

__all__ = ["MemoryReport", "EXECUTORS", "SPLIT_SOURCES", "HOST_MEMORY_SPACE"]

#: The executors a report describes (``MemoryReport.executor``).
EXECUTORS = ("pjrt", "ingraph", "streaming")
#: Where a report's device / host split of arguments and outputs comes from (``MemoryReport.split_source``).
SPLIT_SOURCES = ("compiled_memory_stats", "entry_layout", "none")
#: Layout memory space of host memory in compiled HLO (``Layout::kHostMemorySpace``).
HOST_MEMORY_SPACE = 5

_COMPILED = ("device_argument_bytes", "host_argument_bytes", "device_output_bytes", "host_output_bytes",
             "device_temp_bytes", "host_temp_bytes", "device_alias_bytes", "host_alias_bytes",
             "generated_code_bytes")
_SHAPE_RE = re.compile(r"^\s*([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Memory use of one executor, in bytes per device.

    Three kinds of figures, named by what they are:

    * **compiled** (``*_argument_bytes``, ``*_output_bytes``, ``*_temp_bytes``, ``*_alias_bytes``,
      ``generated_code_bytes``, the ``parameter_*`` / ``output_*`` tuples): XLA's memory
      statistics of the compiled program, i.e. what the compiler assigned, not what a run
      allocated. ``PjrtExecutor`` and ``InGraphRuntime``: their one program. ``StreamingRuntime``:
      per field, the largest over its cached stage executables (one stage's call; 0 before the
      first call compiled any), so ``device_total_bytes`` is one stage call's, not the stack's.
    * **predicted** (``predicted_*``, streaming only): from the runtime's prefetch schedule
      (``StreamingRuntime.schedule()``, ``xla_swap.planning.PrefetchSchedule``).
    * **measured** (``measured_live_stages``, streaming only): counted at run time from the live
      device arrays (``track_residency``).

    Where the client does not split arguments and outputs by memory space (the CPU client reports
    every ``host_*`` statistic as 0 and counts ``S(5)`` parameters in the argument bytes), the split
    is taken from the compiled entry computation layout: ``device_argument_bytes =
    argument_size_in_bytes - (bytes of the S(5) parameters)``; ``split_source`` then reads
    ``"entry_layout"``, else ``"compiled_memory_stats"`` (``"none"``: nothing compiled yet).

    Attributes:
      executor: ``"pjrt"``, ``"ingraph"`` or ``"streaming"`` (:data:`EXECUTORS`).
      num_devices: devices the program runs on (SPMD partitions).
      device_argument_bytes / host_argument_bytes: entry parameters (compiled).
      device_output_bytes / host_output_bytes: results (compiled).
      device_temp_bytes / host_temp_bytes: temporaries (compiled).
      device_alias_bytes / host_alias_bytes: parameter bytes reused for outputs (compiled).
      generated_code_bytes: size of the generated code (compiled).
      parameter_memory_spaces: per entry parameter, ``"device"``, ``"pinned_host"`` (layout ``S(5)``)
        or ``"S(n)"``, read from the compiled HLO (``()`` for the streaming runtime).
      parameter_bytes: per entry parameter, its per-device bytes from the compiled layout.
      output_memory_spaces / output_bytes: the same for the results.
      split_source: one of :data:`SPLIT_SOURCES` (see above).
      raw_stats: the client's statistics, ``{name: int}`` (read-only; empty when none).
      predicted_live_stages: streaming: the most streamed stages whose weights are in device memory
        at once (``schedule(training).max_live_stages``); else ``None``.
      predicted_live_weight_bytes: streaming: their weight bytes per device
        (``schedule(training).peak_live_bytes`` of the stages' per-device bytes); else ``None``.
      resident_weight_bytes: streaming: weights (and optimizer state) of ``resident`` stages, held in
        device memory for good, per device (array sizes); else ``None``.
      host_weight_bytes: streaming: weights (and optimizer state) in ``pinned_host``, per device
        (array sizes); else ``None``.
      measured_live_stages: streaming with ``track_residency``: ``max_resident_stages`` (the most
        stages seen live since the last ``reset_stats()``); else ``None``.

    Raises (construction): ValueError: ``executor`` or ``split_source`` not one of the values
      listed, ``num_devices < 1``, a byte count negative or not an int.
    """
    executor: str
    num_devices: int
    device_argument_bytes: int = 0
    host_argument_bytes: int = 0
    device_output_bytes: int = 0
    host_output_bytes: int = 0
    device_temp_bytes: int = 0
    host_temp_bytes: int = 0
    device_alias_bytes: int = 0
    host_alias_bytes: int = 0
    generated_code_bytes: int = 0
    parameter_memory_spaces: tuple = ()
    parameter_bytes: tuple = ()
    output_memory_spaces: tuple = ()
    output_bytes: tuple = ()
    split_source: str = "compiled_memory_stats"
    raw_stats: Mapping = dataclasses.field(default_factory=FrozenMapping)
    predicted_live_stages: int | None = None
    predicted_live_weight_bytes: int | None = None
    resident_weight_bytes: int | None = None
    host_weight_bytes: int | None = None
    measured_live_stages: int | None = None

    def __post_init__(self):
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor={self.executor!r}; expected one of {', '.join(map(repr, EXECUTORS))}")
        if self.split_source not in SPLIT_SOURCES:
            raise ValueError(f"split_source={self.split_source!r}; expected one of "
                             f"{', '.join(map(repr, SPLIT_SOURCES))}")
        if isinstance(self.num_devices, bool) or not isinstance(self.num_devices, int) or self.num_devices < 1:
            raise ValueError(f"num_devices must be an int >= 1, got {self.num_devices!r}")
        optional = ("predicted_live_stages", "predicted_live_weight_bytes", "resident_weight_bytes",
                    "host_weight_bytes", "measured_live_stages")
        for name in _COMPILED + optional:
            v = getattr(self, name)
            if v is None and name in optional:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0 (bytes or stages), got {v!r}")
        object.__setattr__(self, "raw_stats", FrozenMapping(sorted(dict(self.raw_stats).items())))

    @property
    def device_total_bytes(self) -> int:
        """Lower bound of device memory per device for one call of the (largest) compiled program:
        arguments + outputs - aliased + temporaries."""
        return (self.device_argument_bytes + self.device_output_bytes - self.device_alias_bytes
                + self.device_temp_bytes)

    @property
    def host_total_bytes(self) -> int:
        """The same bound for pinned host memory, per device."""
        return self.host_argument_bytes + self.host_output_bytes - self.host_alias_bytes + self.host_temp_bytes

    def __str__(self) -> str:
        rows = [f"{self.executor} memory report: bytes per device, {self.num_devices} device(s), "
                f"split from {self.split_source}",
                f"{'':12} {'device':>14} {'pinned_host':>14}"]
        for name, label in (("argument", "arguments"), ("output", "outputs"), ("temp", "temporaries"),
                            ("alias", "aliased")):
            rows.append(f"{label:12} {getattr(self, f'device_{name}_bytes'):>14} "
                        f"{getattr(self, f'host_{name}_bytes'):>14}")
        rows.append(f"{'total':12} {self.device_total_bytes:>14} {self.host_total_bytes:>14}")
        if self.parameter_memory_spaces:
            rows.append(f"{'param':>5}  {'memory space':12} {'bytes/device':>14}")
            for i, (space, n) in enumerate(zip(self.parameter_memory_spaces, self.parameter_bytes)):
                rows.append(f"{i:>5}  {space:12} {n:>14}")
        for name in ("predicted_live_stages", "predicted_live_weight_bytes", "resident_weight_bytes",
                     "host_weight_bytes", "measured_live_stages"):
            if getattr(self, name) is not None:
                rows.append(f"{name:28} {getattr(self, name):>14}")
        return "\n".join(rows)


def memory_space(shape_str: str) -> str:
    """The memory space of a compiled HLO shape string: ``"device"``, ``"pinned_host"`` (``S(5)``) or ``"S(n)"``."""
    m = re.search(r"S\((\d+)\)", shape_str)
    space = int(m.group(1)) if m else 0
    return DEVICE if space == 0 else PINNED_HOST if space == HOST_MEMORY_SPACE else f"S({space})"


def shape_bytes(shape_str: str) -> int:
    """Bytes of a compiled HLO array shape string such as ``"f32[4,2,8]{2,1,0:S(5)}"`` (``pred``: 1 byte
    an element; other types: the bits in their name, ``bf16`` 2, ``c64`` 8, ``f8e4m3fn`` 1).

    Raises: RuntimeError: not an array shape.
    """
    m = _SHAPE_RE.match(shape_str)
    if not m:
        raise RuntimeError(f"cannot read the compiled shape {shape_str!r}")
    kind = m.group(1)
    bits = 8 if kind == "pred" else int(re.search(r"\d+", kind).group(0)) if re.search(r"\d+", kind) else 0
    if not bits:
        raise RuntimeError(f"cannot read the element type of the compiled shape {shape_str!r}")
    dims = [int(d) for d in m.group(2).split(",") if d]
    return int(math.prod(dims)) * max(1, bits // 8)


def _split_top_level(s: str) -> list:
    """``s`` split at the commas outside brackets, each part stripped."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def entry_layout(hlo_text: str) -> tuple[list, list]:
    """The compiled entry computation layout: ([param shape strings], [result shape strings])."""
    # XLA prints '/*index=5*/' before every fifth shape of long tuples: not part of the shapes.
    header = re.sub(r"/\*.*?\*/", "", hlo_text.split("\n", 1)[0])
    start = header.find("entry_computation_layout={")
    if start < 0:
        raise RuntimeError("compiled HLO has no entry_computation_layout")
    i = start + len("entry_computation_layout={")
    depth, j = 0, i
    while j < len(header):  # find the matching '}' of entry_computation_layout={...}
        if header[j] in "([{":
            depth += 1
        elif header[j] in ")]}":
            if depth == 0:
                break
            depth -= 1
        j += 1
    layout = header[i:j]
    depth, k = 0, 0
    for k, ch in enumerate(layout):  # split "(params)->result" at the top-level arrow
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "-" and depth == 0 and layout[k:k + 2] == "->":
            break
    params, result = layout[:k].strip(), layout[k + 2:].strip()
    params = _split_top_level(params[1:-1])
    results = _split_top_level(result[1:-1]) if result.startswith("(") else [result]
    return params, results


def compiled_report(executor: str, num_devices: int, raw: Mapping, param_layout: list, result_layout: list,
                    **extra) -> MemoryReport:
    """A :class:`MemoryReport` from a compiled program's statistics and its entry layout.

    Args:
      executor, num_devices: as the report's.
      raw: ``{"argument_size_in_bytes": int, ...}``, the client's compiled memory statistics.
      param_layout / result_layout: the compiled entry computation layout's shape strings.
      **extra: further report fields (the streaming ones).
    """
    p_spaces = tuple(memory_space(s) for s in param_layout)
    p_bytes = tuple(shape_bytes(s) for s in param_layout)
    o_spaces = tuple(memory_space(s) for s in result_layout)
    o_bytes = tuple(shape_bytes(s) for s in result_layout)
    host_p = sum(b for s, b in zip(p_spaces, p_bytes) if s == PINNED_HOST)
    host_o = sum(b for s, b in zip(o_spaces, o_bytes) if s == PINNED_HOST)
    arg, harg = raw.get("argument_size_in_bytes", 0), raw.get("host_argument_size_in_bytes", 0)
    out, hout = raw.get("output_size_in_bytes", 0), raw.get("host_output_size_in_bytes", 0)
    if (host_p or host_o) and not (harg or hout):
        source = "entry_layout"
        arg, harg = arg - host_p, host_p
        out, hout = out - host_o, host_o
    else:
        source = "compiled_memory_stats"
    return MemoryReport(
        executor=executor, num_devices=num_devices,
        device_argument_bytes=arg, host_argument_bytes=harg,
        device_output_bytes=out, host_output_bytes=hout,
        device_temp_bytes=raw.get("temp_size_in_bytes", 0), host_temp_bytes=raw.get("host_temp_size_in_bytes", 0),
        device_alias_bytes=raw.get("alias_size_in_bytes", 0),
        host_alias_bytes=raw.get("host_alias_size_in_bytes", 0),
        generated_code_bytes=raw.get("generated_code_size_in_bytes", 0),
        parameter_memory_spaces=p_spaces, parameter_bytes=p_bytes,
        output_memory_spaces=o_spaces, output_bytes=o_bytes,
        split_source=source, raw_stats=raw, **extra)


def stats_dict(analysis) -> dict:
    """``{name: int}`` of the ``*_in_bytes`` fields of a ``jax.stages.Compiled.memory_analysis()`` result
    (``{}`` for ``None``: a backend that reports nothing)."""
    if analysis is None:
        return {}
    return {k: int(getattr(analysis, k)) for k in dir(analysis)
            if k.endswith("_in_bytes") and isinstance(getattr(analysis, k), int)}
