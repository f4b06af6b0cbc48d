"""``SwappedStack.autotune``: the schedule chosen from a calibration, through the torch entry point.

A stack of torch FFN layers with AdamW: after ``autotune`` under a budget between "only the
streaming window" and "everything", the stack runs the chosen residency (resident stages' weights
in device memory), and training equals plain torch ``AdamW`` on CPU (values and weights).
"""
import copy

import jax
import pytest
import torch

from xla_swap.executors.calibrate import calibrate
from xla_swap.planning import InfeasibleBudgetError
from xla_swap.planning.chooser import ChoiceCache, evaluate_choice
from xla_swap.stack import SwappedStack

D, F, L, T = 16, 32, 6, 8


class FFN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(D, F, bias=False)
        self.b = torch.nn.Linear(F, D, bias=False)

    def forward(self, h):
        return h + self.b(torch.nn.functional.gelu(self.a(h), approximate="tanh"))


def loss(o):
    return (o ** 2).mean()


def test_autotune_partial_residency_equals_torch_adamw(monkeypatch):
    import xla_swap.executors.calibrate as cal_mod
    monkeypatch.setattr(cal_mod, "CHOICES", ChoiceCache())
    torch.manual_seed(0)
    ref = torch.nn.ModuleList(FFN() for _ in range(L))
    layers = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    stack = SwappedStack(list(layers), optimizer=torch.optim.AdamW(layers.parameters(), lr=1e-2), loss_fn=loss,
                         devices=jax.devices()[:1])
    x = torch.randn(T, D)
    c = calibrate(stack.runtime, stack._carry_in((x,)), reps=1)
    lo = evaluate_choice(list(c.costs), c.link, prefetch_depth=1).device_bytes
    hi = evaluate_choice(list(c.costs), c.link, prefetch_depth=1, resident=[True] * L).device_bytes
    with pytest.raises(InfeasibleBudgetError):
        stack.autotune(x, budget_bytes=lo // 2)
    before = stack.runtime
    assert stack.runtime is before                                         # unchanged by the refusal
    choice = stack.autotune(x, budget_bytes=(lo + hi) // 2, reps=1)
    assert 0 < choice.num_resident < L and choice.device_bytes <= (lo + hi) // 2
    rt = stack.runtime
    assert rt is not before and rt.resident == choice.resident
    for i, r in enumerate(choice.resident):
        kind = jax.tree_util.tree_leaves(rt.host_params[i])[0].sharding.memory_kind
        assert kind == ("device" if r else "pinned_host")
    for _ in range(3):
        got = stack.train_step(x)
        h = x
        for m in ref:
            h = m(h)
        want = loss(h)
        opt_ref.zero_grad()
        want.backward()
        opt_ref.step()
        assert abs(float(got) - float(want.detach())) <= 1e-5 * abs(float(want.detach()))
    stack.sync_modules()
    worst = max(float((p - q).norm() / q.norm()) for p, q in zip(layers.parameters(), ref.parameters()))
    assert worst <= 1e-4, worst
    assert "measured step: not yet" in choice.explain()
