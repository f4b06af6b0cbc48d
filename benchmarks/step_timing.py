"""The timing the GPU benchmark scripts share: the median wall time of calls after a warm-up."""
from __future__ import annotations

import statistics
import time


def median_time(fn, reps: int, sync=lambda: None) -> float:
    """Median wall time (seconds) of ``reps`` calls of ``fn()``, after one warm-up call.

    ``sync()`` runs after every call, inside the timed interval (``torch.cuda.synchronize``, or a
    ``jax.block_until_ready`` wrapper; the default does nothing, for calls that return only when
    their work is done, such as ``SwappedStack.train_step``, whose loss is a CPU tensor).
    """
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)
