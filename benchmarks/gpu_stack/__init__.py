"""GPU benchmark: the L-layer bf16 FFN stack of docs/explanation/measured-facts.md, host-offloaded in several ways.

Run from the repository root (jax only; no torch, no torch_xla)::

  python -m benchmarks.gpu_stack --chunks 8192=1,2 32768=4,1 --budget-s 530 --child-timeout-s 130
  python -m benchmarks.gpu_stack --render benchmarks/results/gpu_stack.json    # re-render a table (CPU)

Stack: ``layer(h) = h + gelu(h @ a) @ b`` with ``a: (D, F)``, ``b: (F, D)`` in bfloat16;
D=8192, F=32768 gives 1 GiB of weights per layer, 8 GiB for 8 layers. Inputs ``(T, D)``
bfloat16 for T in ``--tokens`` (default 8192 32768). The reference figures (bandwidths,
on-device and streaming times, floors) are in docs/explanation/measured-facts.md; the runs in
docs/reference/benchmark-runs.md.

Design, one idea per module:

* ``variants``: the registry: every row as a frozen :class:`~.variants.Variant` (kind,
  training, kept residuals, prefetch depth, throttle, chunked ends, flag search), groups,
  presets, the run order and the XLA flag sets. Nothing decodes a variant's name.
* ``spec``: :class:`~.spec.RunSpec` (sizes and settings) and :class:`~.spec.ChildSpec`
  (one process's variant, token counts and result file), JSON-serialisable.
* ``workload``: the stack, its deterministic weights (and their ``.npy`` cache), inputs, the
  on-device reference programs, the chunked form of the stack.
* ``measure``: one builder per variant kind (``BUILDERS``) and :func:`~.measure.run_one`,
  which times any built program the same way, reads device memory, traces streaming calls
  with a ``xla_swap.executors.TraceRecorder``, runs the flag search and the correctness check.
* ``runner``: the plan, one subprocess per variant given a spec file, saving after each.
* ``analysis``: pure functions from the result JSON to JSON: predicted peaks, floors and
  ratios, the targets (:class:`~.analysis.Targets`, data) and their verdicts.
* ``report``: the markdown rendering of an analysed result.
* ``cli``: the command line.

Variants (same weights and inputs, generated deterministically from ``--seed``):

* ``bandwidth``: pinned_host->device, device->pinned_host and both at once (GB/s = 1e9 B/s,
  median and best of ``--reps``), ``jax.device_put`` between memory kinds.
* ``on-device-loop`` / ``on-device-jit``: weights in device memory; a per-layer jitted
  function called in a Python loop / the whole stack in one jit. The faster median is the
  forward compute time.
* ``xla-in-graph``: stacked ``pinned_host`` params ``(L, D, F)``, ``lax.scan`` with a
  ``device_put`` of the layer's slice in the body.
* ``xla-in-graph-unrolled``: per-layer separate ``pinned_host`` buffers, Python-unrolled loop
  in one jit, ``device_put`` of each layer inside the jit.
* ``xla_swap-in-graph``: ``xla_swap.executors.InGraphRuntime`` over the per-layer host buffers
  (first and last layer in ``--chunks`` column chunks).
* ``torch_xla-lowered``: the same stack written in torch, scanned by
  ``xla_swap.lowering.scan(..., policy=OffloadPolicy(params="host"))`` and lowered by torch_xla
  on CPU (``benchmarks/export_torch_xla_stack.py`` wrote the ``HloModuleProto`` + JSON sidecar
  to ``--artifacts-dir``), run by ``xla_swap.executors.PjrtExecutor`` with the stacked weights
  in ``pinned_host`` and x on the device; ``put_all`` once, untimed. Skipped, with a note,
  when the artifact for (D, F, L, bf16, T) is missing. The markdown adds its ratio to
  ``xla-in-graph`` (the JAX-lowered module of the same stacked form).
* ``xla_swap-k1`` / ``-k2`` / ``-k3``: ``xla_swap.executors.StreamingRuntime`` with prefetch
  depth k (``throttle=True``: the host waits, without any data transfer, for stage i-1 before
  issuing stage i+k's transfer, so device memory stays bounded); ``-nothrottle`` rows let the
  host run ahead; ``-chunked`` rows split the first and last layer into column-chunk stages.
* ``train-on-device`` / ``train-on-device-jit`` / ``train-on-device-saved-jit``: forward +
  backward with weights and gradients in device memory (the compute references).
* ``train-xla_swap-k1`` / ``-k2`` (``-saved``: residuals kept, ``-chunked``, ``-nothrottle``):
  ``StreamingRuntime.train_step``, gradients to pinned_host.
* ``accelerate`` (``--accelerate``): HF accelerate ``cpu_offload`` on torch CUDA, forward at
  the smallest token count. torch is imported only there.

``--variants`` takes variant names, groups and presets: ``forward``, ``train``, ``in-graph``
(the torch_xla-vs-JAX comparison alone), ``extras``, ``all`` (everything but the extras,
the default; ``accelerate`` is skipped, with a note, where torch CUDA is missing).

Weights: generated once per run by a separate ``weights`` process (jax.random on the device,
one layer matrix per jitted call) into two ``.npy`` files in ``/dev/shm`` (else the run's
temporary directory; ``--no-weight-cache`` turns it off); every variant process maps them.

Floors: forward = max(compute, W / H2D); training = max(train compute, 2W / H2D, W / D2H,
3W / both-ways aggregate bandwidth), W = weight bytes. Correctness: max |x - ref| / max |ref|
against the on-device per-layer loop (bf16; ~1e-2 is the tolerance).

Peak device memory: jax cannot reset ``peak_bytes_in_use``, so by default (``--isolate
process``) every variant runs in its own subprocess (all its token counts, ascending) and gets
its own peak. ``--isolate none`` runs everything in one process: peaks are then cumulative.

Results: ``gpu_stack.json`` and ``gpu_stack.md`` in ``--out-dir``, else ``$OUT``, else ``out/``
(untracked; ``--out-dir benchmarks/results`` updates the committed results), saved after
every variant; ``--render`` writes there too. The markdown table is printed last.

Smoke test on CPU (ratios meaningless there: pinned_host and device are both host RAM)::

  JAX_PLATFORMS=cpu python -m benchmarks.gpu_stack --d 256 --f 512 --layers 4 --tokens 64 128 --reps 3
  # with the torch_xla variant: export small artifacts first (needs torch_xla), then
  PJRT_DEVICE=CPU python benchmarks/export_torch_xla_stack.py --d 256 --f 512 \\
      --layers 4 --tokens 64 128 --out-dir /tmp/xla_swap_artifacts
  JAX_PLATFORMS=cpu python -m benchmarks.gpu_stack --d 256 --f 512 --layers 4 \\
      --tokens 64 128 --reps 3 --variants in-graph --artifacts-dir /tmp/xla_swap_artifacts
"""
