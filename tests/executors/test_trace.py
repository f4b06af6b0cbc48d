"""Tests of ``xla_swap.executors.TraceRecorder``: the recorder passed to ``StreamingRuntime``
(constructor or per call), its events and their times, donation off while tracing, and the
errors of bad input and misuse (numpy + jax only)."""
import json
import math

import jax
import numpy as np
import pytest

from streaming_cases import L, layer, loss_fn
from xla_swap.executors import RuntimeConfig, StageEvent, StreamingRuntime, TraceRecorder


def _kinds(rec):
    return sorted({(e.pass_name, e.kind) for e in rec.events})


def test_per_call_recorder_records_that_call_only(params, x):
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2, prefetch_next_call=False))
    assert rt.trace is None
    rec = TraceRecorder()
    assert rec.events == [] and math.isnan(rec.t0) and not rec.recording
    want = np.asarray(rt.forward(x))
    np.testing.assert_array_equal(np.asarray(rt.forward(x, trace=rec)), want)
    assert not rec.recording
    assert _kinds(rec) == [("forward", "compute"), ("forward", "h2d")]
    assert sorted(e.stage for e in rec.events if e.kind == "compute") == list(range(L))
    assert sorted(e.stage for e in rec.events if e.kind == "h2d") == list(range(L))
    first, t0 = list(rec.events), rec.t0
    # a call without the recorder leaves it alone
    jax.block_until_ready(rt.forward(x))
    assert rec.events == first and rec.t0 == t0
    # the next recorded call replaces the events: a training step this time
    jax.block_until_ready(rt.train_step(x, loss_fn, trace=rec)[:2])
    assert rec.t0 > t0
    assert _kinds(rec) == [("backward", "compute"), ("backward", "d2h"), ("backward", "h2d"),
                           ("forward", "compute"), ("forward", "h2d")]
    assert sum(e.kind == "compute" for e in rec.events) == 2 * L


def test_event_times_are_seconds_since_t0_in_dispatch_order(params, x):
    rec = TraceRecorder()
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=1), trace=rec)
    jax.block_until_ready(rt.train_step(x, loss_fn)[:2])
    ev = rec.events
    assert ev and all(isinstance(e, StageEvent) and e.error is None for e in ev)
    for e in ev:
        assert 0 <= e.issued_s <= e.dispatched_s <= e.done_s < 60
    dispatched = [e.dispatched_s for e in ev]
    assert dispatched == sorted(dispatched)  # appended as dispatched
    rows = json.loads(json.dumps(rec.to_dicts()))
    assert rows[0].keys() == {"pass_name", "stage", "kind", "issued_s", "dispatched_s", "done_s", "error"}
    assert [(r["pass_name"], r["stage"], r["kind"]) for r in rows] == [(e.pass_name, e.stage, e.kind) for e in ev]


def test_per_call_recorder_overrides_the_constructors(params, x):
    a, b = TraceRecorder(), TraceRecorder()
    rt = StreamingRuntime(layer, params, trace=a)
    jax.block_until_ready(rt.forward(x, trace=b))
    assert a.events == [] and len([e for e in b.events if e.kind == "compute"]) == L
    jax.block_until_ready(rt.forward(x))
    assert len([e for e in a.events if e.kind == "compute"]) == L


def test_traced_training_does_not_donate(params, x):
    plain = StreamingRuntime(layer, params)
    jax.block_until_ready(plain.train_step(x, loss_fn)[:2])
    assert "backward-donate" in {m["kind"] for m in plain.executable_memory()}
    traced = StreamingRuntime(layer, params, trace=TraceRecorder())
    out = traced.train_step(x, loss_fn)
    assert "backward-donate" not in {m["kind"] for m in traced.executable_memory()}
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(plain.train_step(x, loss_fn)[0]))


def test_bad_trace_arguments_raise_before_anything_runs(params, x):
    with pytest.raises(TypeError, match=r"trace must be an xla_swap.executors.TraceRecorder or None, got bool "
                                        r"\(pass trace=TraceRecorder\(\) to record a trace\)"):
        StreamingRuntime(layer, params, trace=True)
    rt = StreamingRuntime(layer, params)
    with pytest.raises(TypeError, match="trace must be .* got list"):
        rt.forward(x, trace=[])
    with pytest.raises(TypeError, match="trace must be .* got str"):
        rt.train_step(x, loss_fn, trace="yes")
    assert rt.num_signatures == 0  # nothing was traced or compiled
    rec = TraceRecorder()
    jax.block_until_ready(rt.forward(x, trace=rec))  # still usable
    assert rec.events


def test_recorder_misuse_raises():
    rec = TraceRecorder()
    with pytest.raises(RuntimeError, match="outside a recorded call"):
        rec.add(StageEvent("forward", 0, "compute", 0.0), None)
    assert rec.stop() == [] and not rec.recording  # stop without start: a no-op
    rec.start()
    try:
        with pytest.raises(RuntimeError, match="already recording"):
            rec.start()
        with pytest.raises(TypeError, match="event must be a StageEvent, got dict"):
            rec.add({"stage": 0}, None)
        rec.add(StageEvent("forward", 0, "compute", rec.now()), jax.numpy.ones(3))
    finally:
        events = rec.stop()
    assert len(events) == 1 and events[0].done_s is not None and events[0].error is None
    assert "events=1" in repr(rec)
