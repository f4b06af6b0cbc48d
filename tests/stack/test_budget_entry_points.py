"""A device-memory budget as one capability: checked once, the same way at every entry point, and
turned into the runtime that runs it exactly once.

Counted (``StreamingRuntime.__init__`` wrapped): ``SwappedStack(budget_bytes=B)`` builds one
runtime at construction (every stage streamed: the runtime the calibration reads), and the first
call builds one more, the runtime of the choice, which then serves every call; choosing again for
the same budget builds none; ``autotune=False`` builds one. A bad budget (0, -1, True, 1.5, 2.0,
"1GB", 2**63; ``None`` where a budget is required) raises the same exception type and message at ``SwappedStack``, ``SwappedStack.autotune``,
``plan``, ``choose_schedule`` and ``xla_swap.executors.streaming.calibrate.autotune`` as
``check_budget_bytes`` itself, before any runtime (or stage function) is built.

Every choice is made from injected figures (``calibration_from_figures``) with the clock made to raise.
"""
import time

import jax
import pytest
import torch

from ffn_cases import D, FFN, FIGURES, L, T, loss
from streaming_cases import count_runtime_builds, forbid_clock
from xla_swap.executors.streaming.calibrate import autotune
from xla_swap.planning import AdamW, LayerCost, plan
from xla_swap.planning.chooser import ChoiceCache, choose_schedule, evaluate_choice
from xla_swap.planning.units import check_budget_bytes
from xla_swap.stack import SwappedStack
from xla_swap.stack.config import AutotuneConfig, ParallelConfig

_perf_counter = time.perf_counter


def _layers(seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(FFN() for _ in range(L))


def _stack(layers, **kw):
    return SwappedStack(list(layers), optimizer=AdamW(lr=1e-2), loss_fn=loss,
                        parallel=ParallelConfig(devices=jax.devices()[:1]), **kw)


def _middle_budget(x) -> int:
    """A budget between "only the streaming window" and "everything resident" for the injected figures."""
    probe = _stack(_layers())
    c = FIGURES(probe.runtime, probe._carry_in((x,)))
    lo = evaluate_choice(list(c.costs), c.link, prefetch_depth=2).device_bytes
    hi = evaluate_choice(list(c.costs), c.link, prefetch_depth=2, resident=[True] * L).device_bytes
    return (lo + hi) // 2


def test_swapped_stack_builds_the_serving_runtime_once_per_choice(monkeypatch):
    import xla_swap.executors.streaming.calibrate as cal_mod
    monkeypatch.setattr(cal_mod, "CHOICES", ChoiceCache())
    x = torch.randn(T, D)
    budget = _middle_budget(x)
    built = count_runtime_builds(monkeypatch)
    stack = _stack(_layers(), budget_bytes=budget, autotune=AutotuneConfig(calibration=FIGURES))
    assert built == [stack.runtime] and stack.runtime.resident == (False,) * L    # streams until the first call
    forbid_clock(monkeypatch)
    stack.train_step(x)
    monkeypatch.setattr(time, "perf_counter", _perf_counter)
    chosen = stack.runtime
    assert len(built) == 2 and built[1] is chosen                                  # one build for the choice
    assert 0 < stack.schedule.num_resident < L and chosen.resident == stack.schedule.resident
    for _ in range(2):
        stack.train_step(x)
    stack(x)
    forbid_clock(monkeypatch)
    first = stack.schedule
    again = stack.autotune(x, budget_bytes=budget)                                 # chosen again, from the figures
    assert again.runtime_kwargs() == first.runtime_kwargs() and stack.runtime is chosen and len(built) == 2
    monkeypatch.setattr(time, "perf_counter", _perf_counter)
    built.clear()
    rule = _stack(_layers(), budget_bytes=10 ** 12,
                  autotune=AutotuneConfig(enabled=False))                # the construction-time rule
    rule.train_step(x)
    assert built == [rule.runtime] and rule.runtime.resident == (True,) * L


BAD = [0, -1, True, 1.5, 2.0, "1GB", None, 1 << 63]


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_bad_budget_is_refused_alike_everywhere_before_anything_is_built(bad, monkeypatch):
    import xla_swap.stack.swapped_stack as stack_mod
    x = torch.randn(T, D)
    stack = _stack(_layers())
    h = stack._carry_in((x,))
    cal = FIGURES(stack.runtime, h)
    runtime = stack.runtime
    with pytest.raises((TypeError, ValueError)) as want:
        check_budget_bytes(bad)
    assert "budget_bytes" in str(want.value)

    def nothing_built(*a, **k):
        raise AssertionError("built before the budget was checked")
    built = count_runtime_builds(monkeypatch)
    for name in ("stage_functions", "host_stages"):
        monkeypatch.setattr(stack_mod, name, nothing_built)
    forbid_clock(monkeypatch)
    entry_points = {
        "SwappedStack": lambda: _stack(_layers(), budget_bytes=bad),
        "SwappedStack.autotune": lambda: stack.autotune(x, budget_bytes=bad, calibration=cal),
        "calibrate.autotune": lambda: autotune(runtime, h, bad, cache=ChoiceCache(), calibration=cal),
        "choose_schedule": lambda: choose_schedule(list(cal.costs), cal.link, bad),
        "plan": lambda: plan(LayerCost(param_bytes=1 << 20, forward_s=1e-3), L, bad),
    }
    if bad is None:   # SwappedStack's budget is optional: None there means "by policy"
        del entry_points["SwappedStack"]
    for name, call in entry_points.items():
        with pytest.raises(type(want.value)) as got:
            call()
        assert type(got.value) is type(want.value) and str(got.value) == str(want.value), name
    assert built == [] and stack.runtime is runtime and stack.schedule is None


def test_the_chosen_runtime_takes_the_weights_and_moments_without_a_copy(monkeypatch):
    """The stack's autotune hands its runtime's host arrays to the runtime of the choice: a streamed
    stage's weights and moments are the same arrays (host memory holds them once), a stage made
    resident gets device copies of both; the old runtime's arrays are not deleted by the hand-over."""
    import xla_swap.executors.streaming.calibrate as cal_mod
    monkeypatch.setattr(cal_mod, "CHOICES", ChoiceCache())
    x = torch.randn(T, D)
    stack = _stack(_layers())
    old = stack.runtime
    stack.train_step(x)                     # moments exist and are not zeros
    forbid_clock(monkeypatch)
    choice = stack.autotune(x, budget_bytes=_middle_budget(x), calibration=FIGURES)
    new = stack.runtime
    assert new is not old and 0 < choice.num_resident < L
    for i in range(L):
        same = [a is b for a, b in zip(jax.tree_util.tree_leaves(new.host_params[i]),
                                       jax.tree_util.tree_leaves(old.host_params[i]))]
        state = [a is b for a, b in zip(jax.tree_util.tree_leaves(new.optimizer_state[i]),
                                        jax.tree_util.tree_leaves(old.optimizer_state[i]))]
        assert same and all(same) == (not new.resident[i]) and not any(same) == new.resident[i], (i, same)
        assert state and all(state) == (not new.resident[i]) and not any(state) == new.resident[i], (i, state)
    assert not any(a.is_deleted() for a in jax.tree_util.tree_leaves(old.host_params))
