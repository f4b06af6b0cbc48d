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


def median_window_time(fn, reps: int, window: int, sync=lambda: None) -> float:
    """Median over ``reps`` windows of the wall time per call of ``window`` back-to-back calls of
    ``fn()`` followed by one ``sync()`` (seconds), after one warm-up window.

    For a kernel of a millisecond or less: the calls queue on the device while the host issues
    the next, so the figure is the device's time per call, as inside a compiled program, not
    the host's launch and synchronisation latency, which a per-call sync adds to every sample.
    """
    def one():
        t = time.perf_counter()
        for _ in range(window):
            fn()
        sync()
        return (time.perf_counter() - t) / window
    one()
    return statistics.median(one() for _ in range(reps))
