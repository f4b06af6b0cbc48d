"""In-graph host offload: the whole stack as one XLA program over per-stage ``pinned_host`` buffers.

The program is the Python-unrolled stack ``h = stage_fn_i(device_put(params_i, device), h)``
traced into one ``jax.jit``; every stage's weights are *separate* ``pinned_host`` entry
parameters. XLA:GPU turns each ``device_put`` of a whole host buffer into an asynchronous
``copy-start``/``copy-done`` pair on a second stream and overlaps it with the previous
stage's compute; it does not do that for dynamic slices of one stacked host buffer (the
``lax.scan`` form), which it reads on the compute stream (docs/explanation/measured-facts.md,
section 5: the per-stage buffers run at the floor, the stacked form about 1.5x it). How far
ahead XLA prefetches is XLA's choice (its scheduler); ``copy_start_count`` and
``memory_report`` of the compiled program tell what it did.

Compared with :class:`xla_swap.executors.streaming.runtime.StreamingRuntime`: one executable and
no host-side dispatch per stage, but no control over device memory: in a forward XLA keeps
about two stages of weights, in a training step it prefetches without bound (section 6), so
only the forward is offered here.

The module imports only numpy and jax (no torch, no torch_xla).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.sharding import SingleDeviceSharding

from .report import MemoryReport, compiled_report, entry_layout, stats_dict
from .pytrees import (DEVICE_KIND, HOST_KIND, aval_key, check_carry_dtypes, check_input_dtypes, check_memory_kinds,
                      describe, stage_fns, tree_aval, tree_nbytes)

__all__ = ["InGraphRuntime"]


class InGraphRuntime:
    """Run a stack of stages as one jitted program that moves each stage's weights in itself.

    Args:
      stage_fn: ``stage_fn(params_i, h) -> h`` (as for ``StreamingRuntime``): one callable
        for every stage or a sequence with one per stage; ``h`` an array or a pytree of
        arrays.
      stage_params: non-empty sequence of per-stage pytrees of arrays. Each leaf is put
        into its own ``pinned_host`` buffer on ``device`` (a jax array already there, e.g.
        ``StreamingRuntime.host_params``, is used without a copy).
      device: the ``jax.Device`` (default ``jax.devices()[0]``); it must have the
        ``pinned_host`` and ``device`` memory kinds.
      compiler_options: XLA ``DebugOptions`` for this program only, e.g.
        ``{"xla_gpu_enable_latency_hiding_scheduler": True}`` (passed to
        ``jax.stages.Lowered.compile(compiler_options=...)``; the same names as the
        ``XLA_FLAGS`` flags without ``--``). An unknown name fails in ``compile``.

    Device memory: decided by XLA's scheduler (``memory_report()``); the weights
    themselves live in ``pinned_host`` (``weight_nbytes`` bytes of host memory).

    Raises:
      TypeError: ``stage_fn`` (or an element) is not callable; a parameter leaf is not an
        array, or has a dtype jax would narrow (``float64``/``complex128``, or a 64-bit integer
        array with values beyond 32 bits, with ``jax_enable_x64`` off); ``device`` is not a
        ``jax.Device``; ``compiler_options`` is not a dict.
      ValueError: ``stage_params`` is empty or not a sequence; the number of stage
        functions differs from the number of stages; a parameter leaf is a deleted jax
        array; the device lacks a memory kind.
    """

    def __init__(self, stage_fn: Callable | Sequence[Callable], stage_params: Sequence[Any], *,
                 device: jax.Device | None = None, compiler_options: dict | None = None):
        if isinstance(stage_params, (str, bytes, dict)) or not isinstance(stage_params, Sequence) \
                or len(stage_params) == 0:
            raise ValueError("stage_params must be a non-empty sequence (list/tuple) of per-stage pytrees")
        n = len(stage_params)
        fns, shared = stage_fns(stage_fn, n)
        for i, p in enumerate(stage_params):
            tree_aval(p, f"stage_params[{i}]")
            check_input_dtypes(p, f"stage_params[{i}]")
        if device is not None and not isinstance(device, jax.Device):
            raise TypeError(f"device must be a jax.Device, got {type(device).__name__}")
        if compiler_options is not None and not isinstance(compiler_options, dict):
            raise TypeError(f"compiler_options must be a dict of XLA debug options, got {type(compiler_options).__name__}")
        dev = device if device is not None else jax.devices()[0]
        check_memory_kinds(dev, "in-graph offload")
        self.num_stages = n
        self.compiler_options = dict(compiler_options or {})
        self._fns = fns
        self._shared_fn = shared
        self._host = SingleDeviceSharding(dev, memory_kind=HOST_KIND)
        self._dev = SingleDeviceSharding(dev, memory_kind=DEVICE_KIND)
        #: per-stage pytrees of ``pinned_host`` arrays (the program's weight parameters).
        self.host_params: list = [jax.device_put(p, self._host) for p in stage_params]
        #: bytes of all stages' weights (logical sizes).
        self.weight_nbytes: int = sum(tree_nbytes(p) for p in self.host_params)
        self._compiled = None
        self._in_key = None
        self._in_aval = None

    def _program(self, params, h):
        for i, (f, p) in enumerate(zip(self._fns, params)):
            if i:
                check_carry_dtypes(self._fns, params, i - 1, h_in, h, "h")
            h_in = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), h)
            try:
                h = f(jax.device_put(p, self._dev), h)
            except (TypeError, ValueError) as e:   # shape/dtype errors while tracing: name the stage
                fn = "stage_fn" if self._shared_fn else f"stage_fn[{i}]"
                raise (TypeError if isinstance(e, TypeError) else ValueError)(
                    f"stage {i}: {fn}(stage_params[{i}], h) failed while tracing, with h of {describe(h_in)} and "
                    f"stage_params[{i}] of {describe(p)}: {e}") from e
        return h

    def _check_live(self) -> None:
        for i, p in enumerate(self.host_params):
            for path, leaf in jax.tree_util.tree_flatten_with_path(p)[0]:
                if leaf.is_deleted():
                    raise ValueError(f"host_params[{i}]{jax.tree_util.keystr(path)}: the pinned_host weight array "
                                     f"has been deleted (donated or freed); make a new InGraphRuntime")

    def compile(self, h):
        """Compile for the shapes of ``h`` (done by the first ``forward``); returns ``jax.stages.Compiled``.

        Raises:
          TypeError: a leaf of ``h`` is not an array; a stage function raised a TypeError
            while tracing (e.g. a shape mismatch in a matmul): the message names the stage
            (``stage i: stage_fn[i](stage_params[i], h)``) with the shapes of its ``h`` and
            its parameters; a leaf of ``h`` has a dtype jax would narrow (``float64``/``complex128``,
            or a 64-bit integer array with values beyond 32 bits, with ``jax_enable_x64`` off); a
            stage whose ``stage_fn`` and parameter signature the next stage shares returns the carry
            in other dtypes than it got (e.g. an ``int32`` ``h`` promoted by ``float32`` weights).
          ValueError: ``h`` differs in structure, shapes or dtypes from the first call's; a
            leaf of ``h`` is a deleted jax array; a stage function raised a ValueError while
            tracing (named as above). Nothing is compiled or cached then.
        """
        aval = tree_aval(h, "h")
        check_input_dtypes(h, "h")
        if self._compiled is not None:
            if aval_key(aval) != self._in_key:
                raise ValueError(f"h has {describe(aval)}, but this runtime was compiled for "
                                 f"{describe(self._in_aval)}; make a new InGraphRuntime for another shape")
            return self._compiled
        spec = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._dev), aval)
        lowered = jax.jit(self._program, out_shardings=self._dev).lower(self.host_params, spec)
        self._compiled = lowered.compile(compiler_options=self.compiler_options or None)
        self._in_key, self._in_aval = aval_key(aval), aval
        return self._compiled

    def forward(self, h):
        """Run the stack on ``h`` (array or pytree; numpy or jax); returns the output on the device.

        Asynchronous (``jax.block_until_ready`` waits).

        Raises:
          as ``compile``; ValueError: a weight array of ``host_params`` was deleted.
        """
        exe = self.compile(h)
        self._check_live()
        return exe(self.host_params, jax.device_put(h, self._dev))

    __call__ = forward

    def copy_start_count(self) -> int:
        """Number of asynchronous copies (``copy-start``) in the compiled program (0 before ``compile``).

        On GPU one per weight leaf means XLA overlaps every transfer; on CPU the placement
        annotations are stripped and the count is 0.
        """
        return 0 if self._compiled is None else self._compiled.as_text().count("copy-start")

    def memory_report(self) -> MemoryReport:
        """The compiled program's memory use, split between device and pinned host memory.

        Returns: :class:`xla_swap.executors.MemoryReport` with ``executor="ingraph"``, one device,
          compiled figures only (XLA's statistics of the program, the split of arguments and
          outputs from its entry layout where the client does not report one: the CPU client).

        Raises: RuntimeError: nothing compiled yet (call ``compile`` or ``forward`` first).
        """
        if self._compiled is None:
            raise RuntimeError("memory_report: nothing is compiled yet; call compile(h) or forward(h) first")
        params, results = entry_layout(self._compiled.as_text())
        return compiled_report("ingraph", 1, stats_dict(self._compiled.memory_analysis()), params, results)
