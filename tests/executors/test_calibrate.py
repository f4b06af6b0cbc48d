"""``xla_swap.executors.streaming.calibrate``: calibration on the device, the chosen schedule applied.

On the virtual CPU devices: the calibration's figures are positive and finite and its bytes are
the runtime's; the chosen residency is what the new runtime runs (resident stages never
transferred: counted in a ``TraceRecorder``'s events); a training step with the chosen schedule
(residency, offload, moments on the device) equals the monolithic device-resident jax reference
in values and gradients, and with AdamW equals the same steps with every stage resident.
"""
import dataclasses
import functools
import math

import jax
import numpy as np
import pytest

from streaming_cases import check_close, count_runtime_builds, forbid_clock, layer, loss_fn, mono_loss, stacked
from xla_swap.executors import RuntimeConfig, StreamingRuntime, TraceRecorder
from xla_swap.executors.streaming.calibrate import (Calibration, autotune, calibrate, calibration_from_figures, measure_link,
                                                    peak_bytes_in_use, reconfigure, runtime_signature)
from xla_swap.planning import AdamW, InfeasibleBudgetError, Link
from xla_swap.planning.chooser import ChoiceCache, choose_schedule, evaluate_choice


def test_calibration_figures_positive_finite(params, x):
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=AdamW(lr=1e-3))
    cal = calibrate(rt, x, reps=2)
    assert isinstance(cal, Calibration) and cal.groups == (tuple(range(8)),)   # one shared executable
    for v in (cal.link.h2d_gbps, cal.link.d2h_gbps, cal.link.both_gbps, *cal.forward_s, *cal.backward_s,
              cal.wall_s, *[s for v in cal.link_samples.values() for s in v]):
        assert math.isfinite(v) and v > 0
    for i, c in enumerate(cal.costs):
        assert c.param_bytes == rt.stage_nbytes[i] == 2 * 16 * 32 * 4
        assert c.optimizer_bytes == 2 * c.param_bytes                      # fp32 moments
        assert c.carry_bytes == x.nbytes and c.intermediate_bytes > 0
        assert c.forward_time_s == cal.forward_s[i] and c.backward_factor >= 0
    assert cal.remat and cal.key == runtime_signature(rt, x)
    link, samples = measure_link(rt, reps=1)
    assert len(samples["both"]) == 1 and link.h2d_gbps > 0
    assert peak_bytes_in_use() is None or peak_bytes_in_use() > 0          # None on XLA:CPU
    assert rt.step == 0 and all(s is not None for s in rt.optimizer_state)  # nothing of the runtime changed


def _h2d_per_stage(rec: TraceRecorder, n: int) -> list:
    counts = [0] * n
    for e in rec.events:
        if e.kind == "h2d":
            counts[e.stage] += 1
    return counts


#: Figures injected into the chooser tests: a link slow enough that streaming a stage's weights
#: (4096 bytes) takes longer than its compute, so every resident stage shortens the predicted step.
SLOW_LINK = Link(h2d_gbps=1e-3, d2h_gbps=1e-3, both_gbps=1.5e-3)
FWD_S, BWD_S = 1e-3, 2.5e-3


def test_chosen_residency_is_applied_and_never_transferred(params, x, monkeypatch):
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2))
    cal = calibration_from_figures(rt, x, link=SLOW_LINK, forward_s=FWD_S, backward_s=BWD_S)
    forbid_clock(monkeypatch)                                               # the choice reads no clock
    costs = list(cal.costs)
    stream = evaluate_choice(costs, cal.link, prefetch_depth=1)
    full = evaluate_choice(costs, cal.link, prefetch_depth=1, resident=[True] * 8)
    cache = ChoiceCache()
    # halfway between "only the window" and "everything": some stages resident, some streamed
    budget = (stream.device_bytes + full.device_bytes) // 2
    rt2, choice = autotune(rt, x, budget, cache=cache, calibration=cal)
    want = choose_schedule(cal.costs_for(True), SLOW_LINK, budget, allow_no_remat=True)   # autotune's default
    assert choice.runtime_kwargs() == want.runtime_kwargs() and choice.step_s == want.step_s
    assert 0 < choice.num_resident < 8 and choice.device_bytes <= budget    # transfer-bound: residency pays
    assert rt2 is not rt and rt2.resident == choice.resident and rt2.prefetch_depth == choice.prefetch_depth
    assert autotune(rt2, x, budget, cache=cache)[1] is choice               # cached: no calibration at all
    assert autotune(rt2, x, budget, cache=cache)[0] is rt2                  # already runs it
    monkeypatch.undo()                                                      # the steps below trace (clock allowed)
    rec = TraceRecorder()
    for _ in range(2):                                                      # a cold step, then the steady state
        out = rt2.train_step(x, loss_fn, trace=rec)
        counts = _h2d_per_stage(rec, 8)
        assert all(c == 0 for c, r in zip(counts, choice.resident) if r), counts
        assert any(c > 0 for c, r in zip(counts, choice.resident) if not r), counts
    ref_loss, ref_g = jax.value_and_grad(mono_loss)(stacked(params), x)
    check_close(out[0], ref_loss, rtol=1e-5)
    for i, g in enumerate(out[2]):
        for name in ("a", "b"):
            check_close(g[name], ref_g[name][i], rtol=1e-5, atol=1e-6)
    # everything fits: all resident, nothing transferred at all
    rt3, c3 = autotune(rt, x, full.device_bytes, cache=cache, calibration=cal)
    assert c3.resident == (True,) * 8
    rt3.train_step(x, loss_fn, trace=rec)
    assert _h2d_per_stage(rec, 8) == [0] * 8


def test_choices_follow_the_injected_figures_and_read_no_clock(params, x, monkeypatch):
    """With the clock and every measuring entry point made to raise, autotune still chooses, from the
    injected figures alone: a slow link keeps stages resident, a link far faster than the compute
    streams with nothing resident (the same budget); each choice is choose_schedule's for its figures,
    a given calibration is never answered from the cache, and a callable calibration is called."""
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=AdamW(lr=1e-3))
    slow = calibration_from_figures(rt, x, link=SLOW_LINK, forward_s=FWD_S, backward_s=BWD_S)
    fast_link = Link(h2d_gbps=1e6, d2h_gbps=1e6, both_gbps=2e6)
    fast = calibration_from_figures(rt, x, link=fast_link, forward_s=[FWD_S] * 8, backward_s=BWD_S)
    forbid_clock(monkeypatch)
    with pytest.raises(AssertionError, match="read the clock"):             # the guard is live
        calibrate(rt, x)
    stream = evaluate_choice(list(slow.costs), SLOW_LINK, prefetch_depth=2)
    full = evaluate_choice(list(slow.costs), SLOW_LINK, prefetch_depth=2, resident=[True] * 8)
    budget = (stream.device_bytes + full.device_bytes) // 2
    cache = ChoiceCache()
    _, c_slow = autotune(rt, x, budget, cache=cache, calibration=slow)
    _, c_fast = autotune(rt, x, budget, cache=cache, calibration=fast)      # same key: not read from the cache
    for got, cal in ((c_slow, slow), (c_fast, fast)):
        want = choose_schedule(cal.costs_for(True), cal.link, budget, allow_no_remat=True)   # autotune's default
        assert got.runtime_kwargs() == want.runtime_kwargs() and got.step_s == want.step_s
    assert c_slow.num_resident > 0                     # every resident stage saves a slow copy
    assert c_fast.step_s == pytest.approx(c_fast.floor_s)    # compute-bound: streaming costs nothing
    calls = []

    def figures(runtime, h):
        calls.append(runtime)
        return slow
    _, c_call = autotune(rt, x, budget, cache=cache, calibration=figures)
    assert calls == [rt] and c_call.runtime_kwargs() == c_slow.runtime_kwargs()
    with pytest.raises(TypeError, match="calibration returned a str"):
        autotune(rt, x, budget, cache=cache, calibration=lambda runtime, h: "figures")
    with pytest.raises(TypeError, match="calibration must be"):
        autotune(rt, x, budget, cache=cache, calibration=3)


def test_calibration_from_figures_has_the_runtimes_bytes(params, x):
    """The injected calibration carries the given times and the bytes calibrate() reads; bad figures
    are refused naming the argument, before anything is compiled."""
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=AdamW(lr=1e-3))
    measured = calibrate(rt, x, reps=1)
    fwd = [1e-3 * (i + 1) for i in range(8)]
    cal = calibration_from_figures(rt, x, link=SLOW_LINK, forward_s=fwd, backward_s=[3 * f for f in fwd])
    assert cal.key == measured.key and cal.groups == measured.groups and cal.remat and cal.wall_s == 0.0
    assert cal.forward_s == tuple(fwd) and cal.backward_s == tuple(3 * f for f in fwd) and cal.link == SLOW_LINK
    assert cal.forward_temp_bytes == measured.forward_temp_bytes
    for c, m, f in zip(cal.costs, measured.costs, fwd):
        assert dataclasses.replace(c, forward_s=1.0, backward_factor=0.0) == \
            dataclasses.replace(m, forward_s=1.0, backward_factor=0.0)     # every byte field equal
        assert c.forward_s == f and c.backward_factor == pytest.approx(2.0)  # (3f - f recomputed) / f
    for kwargs, err, match in [
            (dict(link=(1, 1, 1)), TypeError, "link"),
            (dict(forward_s=0.0), ValueError, r"forward_s\[0\]"),
            (dict(forward_s=float("nan")), ValueError, r"forward_s\[0\]"),
            (dict(forward_s="1"), TypeError, "forward_s"),
            (dict(backward_s=[1.0] * 3), ValueError, "backward_s has 3 entries"),
            (dict(backward_s=[1.0] * 7 + [True]), TypeError, r"backward_s\[7\]"),
            (dict(forward_s=1.0, backward_s=0.5), ValueError, "below forward_s")]:
        args = {**dict(link=SLOW_LINK, forward_s=FWD_S, backward_s=BWD_S), **kwargs}
        with pytest.raises(err, match=match):
            calibration_from_figures(rt, x, **args)
    with pytest.raises(TypeError, match="runtime"):
        calibration_from_figures("rt", x, link=SLOW_LINK, forward_s=FWD_S, backward_s=BWD_S)


def _check_grads_against_jax(rt, params, x):
    """``rt`` (no optimizer): a ``train_step``'s loss and per-stage gradients equal ``jax.value_and_grad``
    of the monolithic model."""
    loss, _, grads = rt.train_step(x, loss_fn)
    ref_loss, ref_g = jax.value_and_grad(mono_loss)(stacked(params), x)
    check_close(loss, ref_loss, rtol=1e-5)
    for i, g in enumerate(grads):
        for name in ("a", "b"):
            check_close(g[name], ref_g[name][i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("resident, offload, moments_on_host", [
    ([False] * 8, True, True), ([False, True] * 4, True, False), ([False] * 5 + [True] * 3, False, True)])
def test_schedule_equals_reference(params, x, resident, offload, moments_on_host):
    """AdamW steps with a schedule (residency, activation offload, moments on the device) equal the
    same steps with every stage resident, and without an optimizer the gradients equal jax.grad."""
    opt = AdamW(lr=1e-2, weight_decay=0.1)
    base = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=opt)
    cal = calibration_from_figures(base, x, link=SLOW_LINK, forward_s=FWD_S, backward_s=BWD_S)
    choice = evaluate_choice(list(cal.costs), cal.link, prefetch_depth=2, resident=resident,
                             offload_activations=offload, optimizer_state_on_host=moments_on_host)
    rt = reconfigure(base, choice)
    assert rt.offload_activations == offload and rt.resident == tuple(resident)
    ref = StreamingRuntime(layer, params,
                           RuntimeConfig(prefetch_depth=2, resident=[True] * 8, optimizer_state_on_host=False),
                           optimizer=opt)
    for _ in range(3):
        got, want = rt.train_step(x, loss_fn)[0], ref.train_step(x, loss_fn)[0]
        check_close(got, want, rtol=1e-5)
    if offload:
        assert rt.offloaded_activation_nbytes > 0
    for p, q in zip(rt.host_params, ref.host_params):
        for name in ("a", "b"):
            check_close(p[name], q[name], rtol=1e-5, atol=1e-6)
    assert rt.step == ref.step == 3
    # without an optimizer: gradients against the monolithic jax reference
    plain = reconfigure(StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2)), choice)
    _check_grads_against_jax(plain, params, x)


def test_remat_or_residual_offload_chosen_per_link_and_run(params, x, monkeypatch):
    """Under a budget that holds the residuals offloaded but not in device memory: with a link far
    faster than the compute the chooser drops remat and offloads each stage's input and vjp residuals
    (the runtime built from the choice runs remat=False, offload_activations=True, and sends exactly
    those bytes to pinned_host); with a slow link it keeps remat. The no-remat AdamW steps equal the
    remat=True steps in values and weights, and without an optimizer its gradients equal jax.grad."""
    opt = AdamW(lr=1e-2, weight_decay=0.1)
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=opt)
    rich = calibration_from_figures(rt, x, link=Link(h2d_gbps=1e3, d2h_gbps=1e3, both_gbps=2e3),
                                    forward_s=FWD_S, backward_s=3 * FWD_S)
    poor = calibration_from_figures(rt, x, link=SLOW_LINK, forward_s=FWD_S, backward_s=3 * FWD_S)
    costs = list(rich.costs)
    budget = evaluate_choice(costs, rich.link, prefetch_depth=2, offload_activations=True, remat=False).device_bytes
    assert min(evaluate_choice(costs, rich.link, prefetch_depth=k, remat=False).device_bytes
               for k in (2, 3, 4)) > budget                                 # residuals on the device do not fit
    forbid_clock(monkeypatch)
    rt_poor, c_poor = autotune(rt, x, budget, cache=ChoiceCache(), calibration=poor)
    assert c_poor.remat and rt_poor.remat is True                           # link-poor: recompute
    rt_rich, c_rich = autotune(rt, x, budget, cache=ChoiceCache(), calibration=rich)
    assert not c_rich.remat and c_rich.offload_activations and c_rich.device_bytes <= budget
    assert rt_rich.remat is False and rt_rich.offload_activations           # the runtime runs the choice
    assert autotune(rt, x, budget, cache=ChoiceCache(), calibration=rich, allow_no_remat=False)[1].remat
    # a checkpoint policy's figures are that policy's: it is kept, never replaced by a bool
    policy = jax.checkpoint_policies.dots_saveable
    monkeypatch.undo()
    rt_pol = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2, remat=policy), optimizer=opt)
    pol = calibration_from_figures(rt_pol, x, link=rich.link, forward_s=FWD_S, backward_s=3 * FWD_S)
    forbid_clock(monkeypatch)
    rt_pol2, c_pol = autotune(rt_pol, x, 2 * budget, cache=ChoiceCache(), calibration=pol)
    assert not c_pol.remat and rt_pol2.remat is policy and reconfigure(rt_pol, c_pol).remat is policy
    assert reconfigure(rt_pol, c_poor).remat is True                        # a choice to recompute: True
    monkeypatch.undo()                                                      # the steps below trace
    ref = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=opt)  # remat=True, nothing offloaded
    k = c_rich.prefetch_depth
    offloaded = sum(c.carry_bytes + c.intermediate_bytes for c in costs[:8 - k - 1])   # the last k+1 stay
    for _ in range(3):
        got, want = rt_rich.train_step(x, loss_fn)[0], ref.train_step(x, loss_fn)[0]
        check_close(got, want, rtol=1e-5)
        assert rt_rich.offloaded_activation_nbytes == offloaded > (8 - k - 1) * x.nbytes     # residuals included
        assert sum(rt_rich.residual_nbytes) > 0 and sum(ref.residual_nbytes) == 0
    for p, q in zip(rt_rich.host_params, ref.host_params):
        for name in ("a", "b"):
            check_close(p[name], q[name], rtol=1e-5, atol=1e-6)
    plain = reconfigure(StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2)), c_rich)
    assert plain.remat is False
    _check_grads_against_jax(plain, params, x)


def test_reconfigure_carries_optimizer_state(params, x):
    opt = AdamW(lr=1e-2)
    a = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=opt)
    b = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=opt)
    a.train_step(x, loss_fn)
    b.train_step(x, loss_fn)
    cal = calibration_from_figures(a, x, link=SLOW_LINK, forward_s=FWD_S, backward_s=BWD_S)
    choice = evaluate_choice(list(cal.costs), cal.link, prefetch_depth=1, resident=[True] + [False] * 7)
    before = [[tuple(np.asarray(t) for t in pair) for pair in st] for st in a.optimizer_state]
    a2 = reconfigure(a, choice)
    assert a2.step == 1
    a2.train_step(x, loss_fn)
    b.train_step(x, loss_fn)
    for p, q in zip(a2.host_params, b.host_params):
        check_close(p["a"], q["a"], rtol=1e-5, atol=1e-6)
    # the old runtime's moments were copied, not aliased or donated: still there, unchanged
    for st, ref in zip(a.optimizer_state, before):
        for pair, rpair in zip(st, ref):
            for t, r in zip(pair, rpair):
                np.testing.assert_array_equal(np.asarray(t), r)


def test_optimizer_state_argument(params, x):
    opt = AdamW(lr=1e-2)
    a = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=opt)
    a.train_step(x, loss_fn)
    b = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=opt,
                         optimizer_state=a.optimizer_state)
    for sa, sb in zip(a.optimizer_state, b.optimizer_state):
        for pa, pb in zip(sa, sb):
            assert pa[0] is not pb[0]
            np.testing.assert_array_equal(np.asarray(pa[0]), np.asarray(pb[0]))
            assert float(np.abs(np.asarray(pb[1])).max()) > 0          # not the zero state
    bad = [list(s) for s in a.optimizer_state]
    bad[3] = bad[3][:-1]
    with pytest.raises(ValueError, match=r"optimizer_state\[3\]"):
        StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=opt, optimizer_state=bad)
    with pytest.raises(ValueError, match="one list of \\(m, v\\) pairs per stage"):
        StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=opt,
                         optimizer_state=a.optimizer_state[:2])
    with pytest.raises(ValueError, match="without an optimizer"):
        StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer_state=a.optimizer_state)
    a.train_step(x, loss_fn)                                           # the failed calls changed nothing


def test_bad_arguments_leave_the_runtime_usable(params, x):
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2))
    with pytest.raises(TypeError, match="runtime"):
        calibrate("rt", x)
    with pytest.raises(ValueError, match="reps"):
        calibrate(rt, x, reps=0)
    with pytest.raises(ValueError, match="budget_bytes"):
        autotune(rt, x, -1)
    cal = calibration_from_figures(rt, x, link=SLOW_LINK, forward_s=FWD_S, backward_s=BWD_S)
    with pytest.raises(InfeasibleBudgetError):
        autotune(rt, x, 1024, cache=ChoiceCache(), calibration=cal)
    with pytest.raises(TypeError, match="choice"):
        reconfigure(rt, {"prefetch_depth": 1})
    with pytest.raises(ValueError, match="calibration"):
        autotune(rt, np.zeros((4, 16), np.float32), 1 << 30, calibration=cal)
    check_close(rt.forward(x), jax.jit(lambda s, h: jax.lax.scan(lambda c, p: (layer(p, c), None), h, s)[0])(
        stacked(params), x), rtol=1e-5)


def test_one_runtime_built_per_choice(params, x, monkeypatch):
    """Choosing builds no runtime; ``autotune`` builds exactly one, the runtime that runs the choice
    (the calibration reads the runtime given, it builds none); a choice the runtime already runs,
    or a cached one, builds none; ``reconfigure`` builds one."""
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), optimizer=AdamW(lr=1e-3))
    cal = calibration_from_figures(rt, x, link=SLOW_LINK, forward_s=FWD_S, backward_s=BWD_S)
    stream = evaluate_choice(list(cal.costs), SLOW_LINK, prefetch_depth=2)
    full = evaluate_choice(list(cal.costs), SLOW_LINK, prefetch_depth=2, resident=[True] * 8)
    budget = (stream.device_bytes + full.device_bytes) // 2
    forbid_clock(monkeypatch)
    built = count_runtime_builds(monkeypatch)
    choice = choose_schedule(cal.costs_for(True), cal.link, budget, allow_no_remat=True)   # autotune's default
    assert built == [] and 0 < choice.num_resident < 8
    cache = ChoiceCache()
    figures = functools.partial(calibration_from_figures, link=SLOW_LINK, forward_s=FWD_S, backward_s=BWD_S)
    rt2, got = autotune(rt, x, budget, cache=cache, calibration=figures)
    assert built == [rt2] and rt2 is not rt and got.runtime_kwargs() == choice.runtime_kwargs()
    assert autotune(rt2, x, budget, cache=cache) == (rt2, got) and built == [rt2]             # cached, already run
    assert autotune(rt2, x, budget, cache=cache, calibration=cal)[0] is rt2 and built == [rt2]  # chosen again
    rt3 = reconfigure(rt, choice)
    assert built == [rt2, rt3] and rt3.resident == choice.resident


def test_costs_for_a_forward_take_the_forward_temporaries(params, x):
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2))
    cal = calibrate(rt, x, reps=1)
    assert len(cal.forward_temp_bytes) == 8 and all(isinstance(t, int) and t > 0 for t in cal.forward_temp_bytes)
    assert cal.costs_for(True) == list(cal.costs)
    fwd = cal.costs_for(False)
    for c, f, t in zip(cal.costs, fwd, cal.forward_temp_bytes):
        assert f.working_bytes == (c.working_bytes if t is None else t)
        assert (f.param_bytes, f.forward_s, f.carry_bytes) == (c.param_bytes, c.forward_s, c.carry_bytes)
    with pytest.raises(TypeError, match="training"):
        cal.costs_for("no")


def test_link_warm_up_stops_when_the_rate_stops_rising(monkeypatch):
    import xla_swap.executors.streaming.calibrate as cal_mod
    rates = iter([10.0, 20.0, 40.0, 41.0, 5.0])             # GB/s of successive copies: a ramp, then flat
    clock = {"t": 0.0}

    def move():
        clock["t"] += 1e9 / (next(rates) * 1e9)               # one GB at that rate
        return None
    monkeypatch.setattr(cal_mod.time, "perf_counter", lambda: clock["t"])
    assert cal_mod._warm_up(move, 10 ** 9) == 4                  # 41 is within 5 % of 40: warm
    flat = iter([50.0] * 30)
    rates = flat
    assert cal_mod._warm_up(lambda: clock.__setitem__("t", clock["t"] + 1 / next(rates)), 10 ** 9) == 2
    rising = (10.0 * 1.1 ** i for i in range(100))
    assert cal_mod._warm_up(lambda: clock.__setitem__("t", clock["t"] + 1 / next(rising)), 10 ** 9) == \
        cal_mod.LINK_WARMUP_MAX


def test_timing_inputs_are_not_zeros():
    """Stages are timed on N(0, 1) floating inputs (zeros can time faster on a GPU); integer leaves stay 0."""
    from xla_swap.executors.pytrees import probe
    f = probe(jax.ShapeDtypeStruct((64, 32), jax.numpy.bfloat16))
    assert f.dtype == jax.numpy.bfloat16 and f.shape == (64, 32) and 0.8 < float(np.std(f.astype(np.float32))) < 1.2
    i = probe(jax.ShapeDtypeStruct((4,), np.int32))
    assert i.dtype == np.int32 and not i.any()
    assert (probe(jax.ShapeDtypeStruct((8,), np.float32), 1) != probe(jax.ShapeDtypeStruct((8,), np.float32), 0)).any()
