"""Training with the planner's policy equals the un-offloaded run step for step (20 steps, rtol 1e-5)."""
import pytest

import xla_util  # noqa: F401  (SPMD on the virtual devices)
import train_decoder   # examples/train_decoder.py (examples/ is on pytest's pythonpath)
from xla_swap.planning import OffloadPolicy

SMALL = train_decoder.Config(layers=3, dim=32, heads=2, seq=16, batch=2, lr=1e-2)


def test_planned_policy_loss_curve_equals_unoffloaded():
    planned, total, budget = train_decoder.planned_policy(SMALL, budget_fraction=0.5)
    assert budget < total                                   # smaller than parameters + optimizer state
    assert planned.device_bytes <= budget
    policy = planned.policy
    assert policy.swaps_params and not policy.is_all_device
    offloaded = train_decoder.train(SMALL, policy, steps=20)
    reference = train_decoder.train(SMALL, OffloadPolicy(), steps=20)
    assert len(offloaded) == len(reference) == 20
    assert reference[-1] < reference[0]                     # it does learn
    for step, (a, b) in enumerate(zip(offloaded, reference)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: {a} vs {b}"
