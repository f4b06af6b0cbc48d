"""The PJRT executor path of ``minilm_embed.py``.

:func:`run_lowered_with_pjrt` runs the HLO that torch_xla lowered (SPMD, 4 devices) through
:class:`xla_swap.executors.PjrtExecutor`, with the stacked layer weights in ``pinned_host``
memory when the policy swaps parameters. (The streaming path runs the torch model itself
through ``xla_swap.stack.swapped_stack.SwappedStack``: ``minilm_embed.run_streaming``.)

This module imports neither torch_xla nor torch at import time.
"""
from __future__ import annotations

import numpy as np


# ---------------------------------------------------------------------------------------
# PJRT executor on torch_xla's HLO
# ---------------------------------------------------------------------------------------
def run_lowered_with_pjrt(lowered, policy, *, weights):
    """Compile and run a torch_xla lowering with PJRT (jaxlib), placed by the policy it was lowered with.

    The executor is ``PjrtExecutor.from_policy(lowered, policy, weights=ids, grad_results=())``:
    every entry parameter keeps the HLO sharding string torch_xla reported for it
    (``HloParameter.sharding``), the stacked layer weights get memory kind ``pinned_host``
    when ``policy.params == "host"``, all others ``device``; the module is a forward, so it
    returns no gradients. Parameter values are read from their torch_xla tensors
    (``.cpu().numpy()``: a device-to-host copy, so call this outside a ``host_transfer_guard``).

    Args:
      lowered: ``xla_swap.lowering.computation.LoweredComputation`` whose first output is the
        ``[B, 384]`` float32 sentence embedding (lowered with ``emit_annotations(True)``
        when the weights are to live in host memory).
      policy: the ``xla_swap.planning.OffloadPolicy`` the scan was lowered with.
      weights: the stacked layer weights: XLA tensors that feed the lowering (their ids come
        from ``lowered.parameter_id``) or int parameter ids.

    Returns:
      ``(embeddings, report)``: ``np.ndarray`` of the first output (``[B, 384]`` float32
      for MiniLM) and the executor's :class:`xla_swap.executors.MemoryReport` (its
      ``parameter_memory_spaces[i]`` is ``"pinned_host"`` for the host parameters).

    Raises:
      ValueError: a weight id the lowering does not have, or a tensor that feeds none of its
        parameters; the executor's errors (sharding strings, device count, e.g. fewer jax
        devices than the lowering's SPMD mesh).
      TypeError: a parameter tensor's dtype differs from the compiled parameter's.
      jax.errors.JaxRuntimeError: XLA failed to compile or run the module.
    """

    from xla_swap.executors.pjrt import PjrtExecutor

    ids = [w if isinstance(w, (int, np.integer)) else lowered.parameter_id(w) for w in weights]
    # torch_xla's HLO has s64 parameters (token ids, scalar constants): the executor places and
    # runs them with jax's x64 mode on.
    executor = PjrtExecutor.from_policy(lowered, policy, weights=ids, grad_results=())
    values = {p.id: p.tensor.detach().cpu().numpy() for p in lowered.parameters}
    placed = executor.put_all([values[i] for i in range(executor.num_parameters)])
    outputs = executor(*placed)
    embeddings = np.array(outputs[0])  # a writable host copy
    report = executor.memory_report()
    return embeddings, report
