"""Instrumentation of a streaming runtime: the stages with live device buffers (:class:`ResidencyTracker`),
and its read-only views (:class:`RuntimeInspector`): the memory report, the compiled executables'
memory and HLO, and a stage's planner ``LayerCost``.

Imports only jax (no torch).
"""
from __future__ import annotations

import time
import weakref

import jax
import numpy as np

from ..report import MemoryReport, compiled_report, stats_dict
from .stage_programs import forward_save_fn
from ..pytrees import DEVICE_KIND, probe, tree_nbytes

__all__ = ["ResidencyTracker", "RuntimeInspector", "device_nbytes", "memory_analysis"]


def device_nbytes(tree) -> int:
    """Bytes one device holds of a pytree of jax arrays (a shard of each leaf; a replicated leaf in full)."""
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize
               for a in jax.tree_util.tree_leaves(tree))


def memory_analysis(exe):
    """``exe.memory_analysis()``, or ``None`` where the backend does not implement it."""
    try:
        return exe.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None



class ResidencyTracker:
    """Which stages have runtime-created device buffers alive: counted after each stage of a call
    (with ``track_residency``) into ``residency_trace`` and ``max_resident_stages``.

    Args: ``enabled``: the runtime's ``track_residency``; ``resident``: per stage, whether it is
      resident (its buffers are not counted).
    """

    def __init__(self, enabled: bool, resident: tuple):
        self.enabled, self.resident = enabled, resident
        self._tracked: dict[int, tuple[weakref.ref, int]] = {}
        #: highest number of stages with live device buffers seen at any step since the
        #: last ``reset_stats()`` (only with ``track_residency``).
        self.max_resident_stages: int = 0
        #: ``[(pass_name, stage, resident_stages), ...]`` of the last call.
        self.residency_trace: list[tuple[str, int, int]] = []

    def start_call(self) -> None:
        """A call starts: ``residency_trace`` empty (``max_resident_stages`` runs on)."""
        self.residency_trace = []

    def reset_stats(self) -> None:
        """Reset ``max_resident_stages`` and ``residency_trace``."""
        self.max_resident_stages = 0
        self.residency_trace = []

    def resident_stages(self) -> int:
        """Number of distinct stages that have runtime-created device buffers alive right now.

        Counts ``jax.live_arrays()`` of memory kind ``device`` that this runtime created
        (streamed weights, device-side parameter gradients), grouped by stage. Deleted
        (donated) arrays are not live. Stages in ``resident`` are not counted.

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
        for key in [k for k, (r, _) in tracked.items() if r() is None]:
            del tracked[key]
        return len(stages)

    def track(self, tree, stage: int) -> None:
        """Count ``tree``'s device buffers as ``stage``'s in :meth:`resident_stages` (not for a resident stage)."""
        if not self.enabled or self.resident[stage]:
            return
        for leaf in jax.tree_util.tree_leaves(tree):
            self._tracked[id(leaf)] = (weakref.ref(leaf), stage)

    def record(self, pass_name: str, stage: int) -> None:
        """After ``stage`` of ``pass_name``: append the live-stage count to ``residency_trace``."""
        if not self.enabled:
            return
        r = self.resident_stages()
        self.residency_trace.append((pass_name, stage, r))
        if r > self.max_resident_stages:
            self.max_resident_stages = r


class RuntimeInspector:
    """The read-only views of a streaming runtime: memory reports, the compiled executables' memory and
    HLO, and a stage's planner ``LayerCost``.

    Args: the runtime's ``config``, ``store``, ``compiler``, ``layout``, ``residency`` and ``calls``
      (for its ``schedule``).
    """

    def __init__(self, config, store, compiler, layout, residency, calls):
        self.config, self.store, self.compiler = config, store, compiler
        self.layout, self.residency, self.calls = layout, residency, calls

    def memory_report(self, training: bool = False) -> MemoryReport:
        """Device and host memory of this runtime, per device: compiled, predicted by the schedule, measured.

        Args:
          training: predict for ``train_step`` (``True``) or ``forward`` (``False``).

        Returns: :class:`xla_swap.executors.MemoryReport` with ``executor="streaming"``: the compiled
          figures are, per field, the largest over the stage executables cached now (one stage's
          call; ``split_source="none"`` and zeros before any is compiled);
          ``predicted_live_stages`` / ``predicted_live_weight_bytes`` from ``schedule(training)``
          over the stages' per-device weight bytes; ``resident_weight_bytes`` and
          ``host_weight_bytes`` (weights plus optimizer state, per device, from the arrays);
          ``measured_live_stages`` = ``max_resident_stages`` with ``track_residency``, else ``None``.

        Raises: TypeError: ``training`` is not a bool.
        """
        sched = self.calls.schedule(training)
        c, store = self.config, self.store
        n = c.num_stages
        weights = [device_nbytes(p) for p in store.host_params]
        state = [device_nbytes(s) for s in store.optimizer_state] or [0] * n
        resident = sum(weights[i] + state[i] for i in range(n) if c.resident[i])
        host = sum(weights[i] + (state[i] if c.optimizer_state_on_host else 0)
                   for i in range(n) if not c.resident[i])
        extra = dict(predicted_live_stages=sched.max_live_stages,
                     predicted_live_weight_bytes=sched.peak_live_bytes(weights),
                     resident_weight_bytes=resident, host_weight_bytes=host,
                     measured_live_stages=self.residency.max_resident_stages if c.track_residency else None)
        stats = [stats_dict(memory_analysis(exe)) for sig in self.compiler.sigs.values()
                 for exe in sig.compiled.values()]
        num_devices = len(self.layout.activation_sharding.device_set)
        if not stats:
            return MemoryReport("streaming", num_devices, split_source="none", **extra)
        largest = {key: max(s.get(key, 0) for s in stats) for key in set().union(*stats)}
        return compiled_report("streaming", num_devices, largest, [], [], **extra)

    def executable_memory(self) -> list[dict]:
        """Compiled memory analysis of every executable cached now.

        Returns:
          list of dicts ``{"kind": "forward"|"backward"|..., "stages": [int], "argument_bytes",
          "output_bytes", "alias_bytes", "temp_bytes"}`` (bytes, device memory, per call of
          the executable; ``None`` where the backend reports nothing).
        """
        out = []
        for sig in self.compiler.sigs.values():
            for (_, key), exe in sig.compiled.items():
                stages = [i for (k, i), e in sig.stage_exe.items() if e is exe and k == key]
                m = memory_analysis(exe)
                get = (lambda a: getattr(m, a, None)) if m is not None else (lambda a: None)
                out.append({"kind": key.label, "stages": stages,
                            "argument_bytes": get("argument_size_in_bytes"),
                            "output_bytes": get("output_size_in_bytes"),
                            "alias_bytes": get("alias_size_in_bytes"),
                            "temp_bytes": get("temp_size_in_bytes")})
        return out

    def executable_hlo(self) -> list[tuple[str, str]]:
        """``(kind, HLO text)`` of every executable cached now (``kind`` as in :meth:`executable_memory`).

        The optimized HLO module (``Compiled.as_text()``), for checks of what was compiled:
        the precision of the contractions, the memory kinds, the collectives.
        """
        return [(key.label, exe.as_text()) for sig in self.compiler.sigs.values()
                for (_, key), exe in sig.compiled.items()]

    def stage_input_nbytes(self) -> list[int]:
        """Bytes of each stage's input activation (the carry), for the last call's input signature.

        ``train_step`` keeps every stage's input on the device until that stage's backward,
        so their sum is the kept-activation part of its device memory.

        Returns: list of ``num_stages`` ints (bytes). Raises: ``RuntimeError`` before the
        first ``forward``/``train_step``/``output_aval`` (the shapes are not known yet).
        """
        last = self.compiler.last_sig
        if last is None:
            raise RuntimeError("stage_input_nbytes: call forward, train_step or output_aval first")
        return [tree_nbytes(a) for a in last.chain[:-1]]

    def layer_cost(self, h, stage: int, *, measure_reps: int = 0, flops_per_s: float | None = None):
        """A planner ``LayerCost`` for one stage, derived from its compiled executables (and, optionally, timed).

        Args:
          h: an input of the stack (its signature fixes the shapes).
          stage: the stage index.
          measure_reps: > 0 times the stage's forward that many times on the device (weights
            copied there first; median, seconds) as ``forward_s``.
          flops_per_s: instead of ``measure_reps``: the achieved FLOP/s to divide the compiled
            forward's FLOPs (XLA's cost analysis) by. Exactly one of the two.

        Returns: ``xla_swap.planning.LayerCost`` with ``param_bytes`` (the stage's weights),
          ``grad_bytes`` (its trainable leaves: their gradients, and what an update writes back),
          ``optimizer_bytes`` (this runtime's optimizer state of the stage, 0 without one),
          ``carry_bytes`` (the stage input),
          ``intermediate_bytes`` (the residuals ``jax.vjp`` keeps beyond weights and input,
          with ``remat`` other than ``True``: what ``remat=False`` would save),
          ``working_bytes`` (the compiled backward's temporaries), and ``forward_s`` or ``flops``.

        Raises: ValueError: ``stage`` out of range; neither or both of ``measure_reps`` and
          ``flops_per_s``; the backend reports no FLOPs; the checks of ``forward``.
        """
        from xla_swap.planning import LayerCost
        self.store.check_stage(stage)
        if isinstance(measure_reps, bool) or not isinstance(measure_reps, int) or measure_reps < 0:
            raise ValueError(f"measure_reps must be an int >= 0, got {measure_reps!r}")
        if (measure_reps > 0) == (flops_per_s is not None):
            raise ValueError("layer_cost needs exactly one of measure_reps > 0 (time the stage) and flops_per_s")
        sig = self.compiler.signature(h)
        hin = sig.chain[stage]
        fwd = self.compiler.exe(sig, self.compiler.exe_key("forward"), stage)
        kw = self.stage_cost_bytes(sig, stage)
        if measure_reps:
            p = self.store.weights_in(stage)
            x = jax.device_put(jax.tree_util.tree_map(probe, hin), self.layout.act(hin, sig.replicated))
            jax.block_until_ready(fwd(p, x))
            ts = []
            for _ in range(measure_reps):
                t = time.perf_counter()
                jax.block_until_ready(fwd(p, x))
                ts.append(time.perf_counter() - t)
            kw["forward_s"] = float(np.median(ts))
        else:
            cost = fwd.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            flops = float((cost or {}).get("flops", 0.0))
            if not flops > 0:
                raise ValueError("the backend's cost analysis reports no FLOPs for this stage; pass measure_reps")
            kw.update(flops=flops, flops_per_s=flops_per_s)
        return LayerCost(**kw)

    def stage_cost_bytes(self, sig, stage: int) -> dict:
        """The byte fields of :meth:`layer_cost` for ``stage`` under input signature ``sig`` (from
        :meth:`signature`), from the compiled executables alone (nothing runs, no clock is read).

        Returns: ``{"param_bytes", "grad_bytes", "optimizer_bytes", "carry_bytes",
          "intermediate_bytes", "working_bytes"}`` (bytes; ``working_bytes`` ``None`` with an
          optimizer or where the backend reports no temporaries), as :meth:`layer_cost` documents.

        Raises: ValueError: ``stage`` not an int in ``[0, num_stages)``.
        """
        self.store.check_stage(stage)
        lay = self.store.layouts[stage]
        f, pav, hin = self.compiler.traced_fns[stage], lay.param_aval, sig.chain[stage]
        mask = list(lay.train_mask)
        saved = jax.eval_shape(forward_save_fn(f, False, {}, mask), pav, hin)[1]
        bwd = self.compiler.exe(sig, self.compiler.exe_key("backward"), stage) if not self.compiler.num_groups else None
        try:
            working = int(bwd.memory_analysis().temp_size_in_bytes) if bwd is not None else None
        except Exception:  # noqa: BLE001 - not every backend reports it
            working = None
        trained = [a for a, m in zip(jax.tree_util.tree_leaves(pav), mask) if m]
        return dict(param_bytes=self.store.stage_nbytes[stage], grad_bytes=tree_nbytes(trained),
                    optimizer_bytes=self.store.optimizer_state_nbytes[stage], carry_bytes=tree_nbytes(hin),
                    intermediate_bytes=tree_nbytes(saved), working_bytes=working)
