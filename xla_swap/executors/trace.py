"""Tracing of ``StreamingRuntime`` calls: a recorder object the caller passes in.

A :class:`TraceRecorder` is given to the runtime (``StreamingRuntime(..., trace=rec)``: every
call is recorded) or to one call (``rt.forward(h, trace=rec)``, ``rt.train_step(...,
trace=rec)``). The runtime stamps one :class:`StageEvent` per weight transfer and per stage
computation; a watcher thread owned by the recorder waits on each result and stamps when it
was ready. The runtime holds no trace state of its own.

Imports only jax (no torch, no numpy).
"""
from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time

import jax

__all__ = ["StageEvent", "TraceRecorder"]

#: The ``kind`` values of a :class:`StageEvent`.
EVENT_KINDS = ("h2d", "compute", "d2h")
#: The ``pass_name`` values of a :class:`StageEvent`.
PASS_NAMES = ("forward", "backward", "next")


@dataclasses.dataclass
class StageEvent:
    """One transfer or computation of one stage of a recorded call.

    Times are host ``time.perf_counter()`` seconds relative to the start of the call
    (:attr:`TraceRecorder.t0` holds the absolute start).

    Attributes:
      pass_name: ``"forward"``, ``"backward"``, or ``"next"`` (a transfer for the next call,
        ``prefetch_next_call``).
      stage: the stage index, 0-based.
      kind: ``"h2d"`` (weights pinned_host -> device), ``"compute"`` (the stage's
        executable) or ``"d2h"`` (parameter gradients, or updated weights and optimizer
        state, device -> pinned_host).
      issued_s: just before the host dispatched the operation.
      dispatched_s: when the (asynchronous) dispatch call returned.
      done_s: when ``block_until_ready`` on its result returned in the recorder's watcher
        thread (an upper bound of the completion time; ``None`` until known).
      error: the repr of an exception raised while waiting, else ``None``.
    """

    pass_name: str
    stage: int
    kind: str
    issued_s: float
    dispatched_s: float = float("nan")
    done_s: float | None = None
    error: str | None = None


class TraceRecorder:
    """Records the :class:`StageEvent` s of ``StreamingRuntime`` calls, one call at a time.

    Each recorded call starts a new recording: :attr:`events` and :attr:`t0` describe the
    last call recorded. While a call is recorded, a watcher thread waits on every result in
    dispatch order (``jax.block_until_ready`` releases the GIL, so the dispatching thread is
    not delayed) and holds references to those arrays until they are ready; the runtime
    turns buffer donation off for a recorded call (a donated buffer cannot be waited on).

    The runtime drives the recorder through :meth:`start`, :meth:`now`, :meth:`add` and
    :meth:`stop`; users read :attr:`events`, :attr:`t0` or :meth:`to_dicts`.

    Attributes:
      events: ``list[StageEvent]`` of the last recorded call, in dispatch order (empty before
        any). Their ``done_s`` are final once the call returned (:meth:`stop` waited).
      t0: the absolute ``time.perf_counter()`` (seconds) at the start of the last recorded
        call; ``nan`` before any.
    """

    def __init__(self) -> None:
        self.events: list[StageEvent] = []
        self.t0: float = float("nan")
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    @property
    def recording(self) -> bool:
        """``True`` between :meth:`start` and :meth:`stop`."""
        return self._thread is not None

    def start(self) -> None:
        """Begin recording one call: clear :attr:`events`, set :attr:`t0`, start the watcher thread.

        Raises:
          RuntimeError: the recorder is already recording a call (one recorder records one
            call at a time; nothing is changed).
        """
        if self.recording:
            raise RuntimeError("TraceRecorder is already recording a call; use one recorder per concurrent call")
        self.events = []
        self.t0 = time.perf_counter()
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._watch, args=(self._queue,), name="xla_swap-trace",
                                        daemon=True)
        self._thread.start()

    def now(self) -> float:
        """Seconds since :attr:`t0` (``nan`` before the first :meth:`start`)."""
        return time.perf_counter() - self.t0

    def add(self, event: StageEvent, arrays) -> None:
        """Stamp ``event.dispatched_s`` now, append it, and have the watcher stamp ``done_s`` once
        ``arrays`` (a pytree of jax arrays: the operation's result) are ready.

        Raises:
          TypeError: ``event`` is not a :class:`StageEvent`.
          RuntimeError: not recording (no :meth:`start`).
        """
        if not isinstance(event, StageEvent):
            raise TypeError(f"event must be a StageEvent, got {type(event).__name__}")
        if not self.recording:
            raise RuntimeError("TraceRecorder.add outside a recorded call (call start() first)")
        event.dispatched_s = self.now()
        self.events.append(event)
        self._queue.put((event, arrays))

    def stop(self) -> list[StageEvent]:
        """End the recording: wait until the watcher stamped every event; return :attr:`events`.

        A no-op returning :attr:`events` when not recording.
        """
        if self.recording:
            self._queue.put(None)
            self._thread.join()
            self._queue = self._thread = None
        return self.events

    def to_dicts(self) -> list[dict]:
        """The events as JSON-ready dicts (the :class:`StageEvent` fields; seconds relative to :attr:`t0`)."""
        return [dataclasses.asdict(e) for e in self.events]

    def _watch(self, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            event, arrays = item
            try:
                jax.block_until_ready(arrays)
            except Exception as e:  # noqa: BLE001 - recorded, the main thread reports its own errors
                event.error = repr(e)
            event.done_s = time.perf_counter() - self.t0
            del item, event, arrays

    def __repr__(self) -> str:
        t0 = "nan" if math.isnan(self.t0) else f"{self.t0:.6f}"
        return f"TraceRecorder(events={len(self.events)}, t0={t0}, recording={self.recording})"
