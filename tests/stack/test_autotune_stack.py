"""``SwappedStack.autotune``: the schedule chosen from a calibration, through the torch entry point.

A stack of torch FFN layers with AdamW: after ``autotune`` under a budget between "only the
streaming window" and "everything", the stack runs the chosen residency (resident stages' weights
in device memory), and training equals plain torch ``AdamW`` on CPU (values and weights). A small
``transformers`` Llama under a budget that holds its residuals only offloaded: the choice drops
remat on a fast link (residuals to ``pinned_host``) and keeps it on a slow one, training as torch.

Every choice here is made from injected figures (``calibration_from_figures``: the runtime's bytes,
given times and link) with the clock made to raise, and is checked against ``choose_schedule`` for
those figures: the verdicts do not depend on the speed of the machine running the tests.
"""
import copy
import dataclasses
import functools

import time

import jax
import pytest
import torch

from ffn_cases import D, FFN, FIGURES, L, T, loss
from streaming_cases import forbid_clock
from xla_swap.executors.streaming.calibrate import calibration_from_figures
from xla_swap.planning import AdamW, InfeasibleBudgetError, Link
from xla_swap.planning.chooser import ChoiceCache, choose_schedule, evaluate_choice
from xla_swap.stack.swapped_stack import DEFAULT_POLICY
from xla_swap.stack import SwappedStack
from xla_swap.stack.config import AutotuneConfig, ParallelConfig

_perf_counter = time.perf_counter


def _torch_step(ref, opt_ref, x) -> float:
    """One plain torch AdamW step of the reference layers; its loss."""
    h = x
    for m in ref:
        h = m(h)
    want = loss(h)
    opt_ref.zero_grad()
    want.backward()
    opt_ref.step()
    return float(want.detach())


def _assert_weights_close(stack, layers, ref) -> None:
    stack.sync_modules()
    worst = max(float((p - q).norm() / q.norm()) for p, q in zip(layers.parameters(), ref.parameters()))
    assert worst <= 1e-4, worst


def _same_choice(got, cal, budget, training=True):
    """``got`` is what ``choose_schedule`` picks for ``cal``'s figures and ``budget``."""
    want = choose_schedule(cal.costs_for(training), cal.link, budget, training=training,
                           allow_no_remat=True)     # autotune's default
    assert got.runtime_kwargs() == want.runtime_kwargs() and got.step_s == want.step_s and got.training == training


def test_autotune_partial_residency_equals_torch_adamw(monkeypatch):
    import xla_swap.executors.streaming.calibrate as cal_mod
    monkeypatch.setattr(cal_mod, "CHOICES", ChoiceCache())
    torch.manual_seed(0)
    ref = torch.nn.ModuleList(FFN() for _ in range(L))
    layers = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    stack = SwappedStack(list(layers), optimizer=torch.optim.AdamW(layers.parameters(), lr=1e-2), loss_fn=loss,
                         parallel=ParallelConfig(devices=jax.devices()[:1]))
    x = torch.randn(T, D)
    c = FIGURES(stack.runtime, stack._carry_in((x,)))
    lo = evaluate_choice(list(c.costs), c.link, prefetch_depth=1).device_bytes
    hi = evaluate_choice(list(c.costs), c.link, prefetch_depth=1, resident=[True] * L).device_bytes
    forbid_clock(monkeypatch)
    with pytest.raises(InfeasibleBudgetError):
        stack.autotune(x, budget_bytes=lo // 2, calibration=c)
    before = stack.runtime
    assert stack.runtime is before                                         # unchanged by the refusal
    choice = stack.autotune(x, budget_bytes=(lo + hi) // 2, calibration=FIGURES)
    _same_choice(choice, c, (lo + hi) // 2)
    assert 0 < choice.num_resident < L and choice.device_bytes <= (lo + hi) // 2
    monkeypatch.setattr(time, "perf_counter", _perf_counter)               # the steps below may read it
    rt = stack.runtime
    assert rt is not before and rt.resident == choice.resident
    for i, r in enumerate(choice.resident):
        kind = jax.tree_util.tree_leaves(rt.host_params[i])[0].sharding.memory_kind
        assert kind == ("device" if r else "pinned_host")
    for _ in range(3):
        got = stack.train_step(x)
        want = _torch_step(ref, opt_ref, x)
        assert abs(float(got) - want) <= 1e-5 * abs(want)
    _assert_weights_close(stack, layers, ref)
    assert "measured step: not yet" in choice.explain()


def test_budget_bytes_chooses_the_schedule_at_the_first_call(monkeypatch):
    """``SwappedStack(budget_bytes=B)`` (``autotune=True``, the default): everything streams until
    the first ``train_step``, which chooses (here from injected figures, ``calibration=``: the clock
    raises) and switches to the chooser's schedule for ``B``; training then equals torch AdamW. A
    budget no schedule fits is refused at the first call, naming ``budget_bytes``, with the stack
    unchanged and usable; ``autotune=False`` keeps the construction-time rule."""
    import xla_swap.executors.streaming.calibrate as cal_mod
    monkeypatch.setattr(cal_mod, "CHOICES", ChoiceCache())
    torch.manual_seed(1)
    ref = torch.nn.ModuleList(FFN() for _ in range(L))
    layers = copy.deepcopy(ref)
    x = torch.randn(T, D)
    probe_layers = copy.deepcopy(ref)
    probe = SwappedStack(list(probe_layers), optimizer=torch.optim.AdamW(probe_layers.parameters(), lr=1e-2),
                         loss_fn=loss, parallel=ParallelConfig(devices=jax.devices()[:1]))
    c = FIGURES(probe.runtime, probe._carry_in((x,)))
    lo = evaluate_choice(list(c.costs), c.link, prefetch_depth=2).device_bytes
    hi = evaluate_choice(list(c.costs), c.link, prefetch_depth=2, resident=[True] * L).device_bytes
    budget = (lo + hi) // 2
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    stack = SwappedStack(list(layers), optimizer=torch.optim.AdamW(layers.parameters(), lr=1e-2), loss_fn=loss,
                         parallel=ParallelConfig(devices=jax.devices()[:1]), budget_bytes=budget,
                         autotune=AutotuneConfig(calibration=FIGURES))
    assert stack.schedule is None and stack.runtime.resident == (False,) * L      # streams until the first call
    for step in range(3):
        if step == 0:
            forbid_clock(monkeypatch)
        got = stack.train_step(x)
        if step == 0:
            monkeypatch.setattr(time, "perf_counter", _perf_counter)
            _same_choice(stack.schedule, c, budget)
            assert 0 < stack.schedule.num_resident < L
            assert stack.schedule.budget_bytes == budget and stack.runtime.resident == stack.schedule.resident
            assert stack.schedule.same_config(dict(prefetch_depth=stack.runtime.prefetch_depth,
                                                   resident=list(stack.runtime.resident),
                                                   offload_activations=stack.runtime.offload_activations,
                                                   optimizer_state_on_host=stack.runtime.optimizer_state_on_host))
            chosen = stack.runtime
        assert stack.runtime is chosen                                             # chosen once
        want = _torch_step(ref, opt_ref, x)
        assert abs(float(got) - want) <= 1e-5 * abs(want)
    _assert_weights_close(stack, layers, ref)
    # a budget above the constructor's check (2 stages of weights + moments at prefetch_depth=1)
    # but below the smallest predicted peak of the chooser's whole search space
    with pytest.raises(InfeasibleBudgetError) as e:
        choose_schedule(list(c.costs), c.link, 1)
    smallest = e.value.min_budget_bytes
    tight = SwappedStack(list(copy.deepcopy(ref)), optimizer=AdamW(lr=1e-2), loss_fn=loss,
                         policy=dataclasses.replace(DEFAULT_POLICY, prefetch_depth=1),
                         parallel=ParallelConfig(devices=jax.devices()[:1]), budget_bytes=smallest - 1,
                         autotune=AutotuneConfig(calibration=FIGURES))
    before = tight.runtime
    with pytest.raises(ValueError, match=r"budget_bytes=\d+ holds no schedule"):
        tight.train_step(x)
    assert tight.runtime is before and tight.schedule is None
    tight.autotune(x, budget_bytes=hi)                                             # the way out the message names
    _same_choice(tight.schedule, c, hi)
    assert float(tight.train_step(x)) > 0
    # with an optimizer the choice is for training even when the first call is a forward
    fwd_first = SwappedStack(list(copy.deepcopy(ref)), optimizer=AdamW(lr=1e-2), loss_fn=loss,
                             parallel=ParallelConfig(devices=jax.devices()[:1]), budget_bytes=budget,
                             autotune=AutotuneConfig(calibration=FIGURES))
    fwd_first(x)
    assert fwd_first.schedule.training is True
    _same_choice(fwd_first.schedule, c, budget)
    rule = SwappedStack(list(copy.deepcopy(ref)), optimizer=AdamW(lr=1e-2), loss_fn=loss,
                        parallel=ParallelConfig(devices=jax.devices()[:1]), budget_bytes=10 ** 12,
                        autotune=AutotuneConfig(enabled=False))
    rule.train_step(x)
    assert rule.schedule is None and rule.runtime.resident == (True,) * L
    with pytest.raises(TypeError, match="calibration must be"):
        SwappedStack(list(copy.deepcopy(ref)), parallel=ParallelConfig(devices=jax.devices()[:1]),
                     budget_bytes=budget, autotune=AutotuneConfig(calibration="fast"))


def test_budget_picks_residual_offload_on_a_rich_link_and_trains_as_torch(monkeypatch):
    """A small ``transformers`` Llama through ``SwappedStack(budget_bytes=B)`` with AdamW, ``B`` holding
    the vjp residuals offloaded but not in device memory: with a link far faster than the injected
    compute the first step drops remat and offloads every stage's input and residuals (the runtime
    runs remat=False, offload_activations=True), with a slow link it keeps remat; both train as torch
    eager AdamW (loss and weights) over 3 steps."""
    from llama_cases import batches, ce, make_model
    from xla_swap.hf import causal_lm_stages
    import xla_swap.executors.streaming.calibrate as cal_mod
    monkeypatch.setattr(cal_mod, "CHOICES", ChoiceCache())
    data = batches(3, b=2, t=12, seed=3)
    ref0 = make_model(layers=3, seed=4)
    figures = {name: functools.partial(calibration_from_figures, link=link, forward_s=1e-3, backward_s=3e-3)
               for name, link in (("rich", Link(h2d_gbps=1e3, d2h_gbps=1e3, both_gbps=2e3)),
                                  ("poor", Link(h2d_gbps=1e-3, d2h_gbps=1e-3, both_gbps=1.5e-3)))}

    def stack_of(model, **kw):
        first, layers, last = causal_lm_stages(model)
        return SwappedStack(layers, first=first, last=last, loss_fn=ce,
                            parallel=ParallelConfig(devices=jax.devices()[:1]),
                            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6), **kw)
    probe = stack_of(copy.deepcopy(ref0))
    cals = {name: f(probe.runtime, probe._carry_in((data[0][0],))) for name, f in figures.items()}
    c = cals["rich"]
    costs = list(c.costs)
    budget = evaluate_choice(costs, c.link, prefetch_depth=2, offload_activations=True, remat=False).device_bytes
    assert min(evaluate_choice(costs, c.link, prefetch_depth=k, remat=False).device_bytes for k in (2, 3, 4)) > budget
    for name, want_remat in (("rich", False), ("poor", True)):
        ref = copy.deepcopy(ref0).train()
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
        model = copy.deepcopy(ref0)
        stack = stack_of(model, budget_bytes=budget, autotune=AutotuneConfig(calibration=figures[name]))
        for step, (x, y) in enumerate(data):
            if step == 0:
                forbid_clock(monkeypatch)
            got = float(stack.train_step(x, y))
            if step == 0:
                monkeypatch.setattr(time, "perf_counter", _perf_counter)
                ch = stack.schedule
                assert ch.remat is want_remat and stack.runtime.remat is want_remat, (name, ch.describe())
                assert stack.policy.remat is want_remat and stack.policy.prefetch_depth == ch.prefetch_depth
                _same_choice(ch, cals[name], budget)        # the stack's first runtime is the probe's
                if not want_remat:
                    assert ch.offload_activations and stack.runtime.offload_activations
                    assert stack.runtime.offloaded_activation_nbytes > 0 and sum(stack.runtime.residual_nbytes) > 0
            want = ce(ref(x).logits, y)
            opt_ref.zero_grad()
            want.backward()
            opt_ref.step()
            assert abs(got - float(want.detach())) <= 1e-5 * abs(float(want.detach())), (name, step)
        stack.sync_modules()
        worst = max(float((p.detach() - q.detach()).norm() / q.detach().norm().clamp_min(1e-30))
                    for p, q in zip(model.parameters(), ref.parameters()))
        assert worst <= 1e-5, (name, worst)
