"""``xla_swap.planning.chooser``: the StreamingRuntime configuration chosen from costs and a budget.

The chooser's predicted peak never exceeds the budget; everything fits -> every stage resident;
only the streaming window fits -> nothing resident; more budget never predicts a slower step;
the rewrite onto the planner's model (resident stages move nothing, offload's bytes) is checked
against ``evaluate`` directly; bad input is refused naming the argument.
"""
import dataclasses

import pytest

from xla_swap.planning import InfeasibleBudgetError, LayerCost, Link, OffloadPolicy, evaluate
from xla_swap.planning.chooser import (CHOICES, STAGE_INPUT, STAGE_RESIDUALS, ChoiceCache, ScheduleChoice,
                                      choose_schedule, evaluate_choice)

GiB = 1 << 30
LINK = Link(54.5, 54.6, 79.3)
#: The default H100 stack's layer (bf16 D=8192 F=32768, 8192 tokens, bf16 AdamW moments), rounded.
LAYER = LayerCost(param_bytes=GiB, optimizer_bytes=2 * GiB, carry_bytes=128 << 20, intermediate_bytes=GiB,
                  working_bytes=512 << 20, forward_s=0.012, backward_factor=1.6)
COSTS = [LAYER] * 8


def test_all_resident_when_everything_fits_and_nothing_extra_when_only_the_window_fits():
    full = evaluate_choice(COSTS, LINK, prefetch_depth=2, resident=[True] * 8)
    c = choose_schedule(COSTS, LINK, full.device_bytes)
    assert c.resident == (True,) * 8 and c.device_bytes <= full.device_bytes
    assert c.plan.floor_s == pytest.approx(c.step_s)            # nothing moves: the compute
    assert c.budget_bytes == full.device_bytes and c.candidates > 8
    # the smallest streaming window: one byte short of it is infeasible, at it nothing is resident
    smallest = min(evaluate_choice(COSTS, LINK, prefetch_depth=k, offload_activations=o).device_bytes
                   for k in (1, 2, 3, 4) for o in (False, True))
    c = choose_schedule(COSTS, LINK, smallest)
    assert c.num_resident == 0 and c.device_bytes <= smallest
    with pytest.raises(InfeasibleBudgetError) as e:
        choose_schedule(COSTS, LINK, smallest - 1)
    assert e.value.min_budget_bytes == smallest


def test_budget_respected_and_more_budget_is_never_slower():
    prev = None
    for gib in (8, 9, 10, 12, 14, 16, 20, 24, 28, 40):
        c = choose_schedule(COSTS, LINK, gib * GiB)
        assert c.device_bytes <= gib * GiB
        if prev is not None:
            assert c.step_s <= prev.step_s * (1 + 1e-9)
            assert c.num_resident >= prev.num_resident or c.prefetch_depth != prev.prefetch_depth \
                or c.optimizer_state_on_host != prev.optimizer_state_on_host
        prev = c


def test_depth_one_only_when_nothing_deeper_fits():
    """k = 1 (which the runtime measured far slower than predicted) is picked only below every k >= 2 peak."""
    # the smallest peak with k >= 2: k = 2, nothing resident, moments on the host, activations offloaded or not
    k2_min = min(evaluate_choice(COSTS, LINK, prefetch_depth=2, offload_activations=o).device_bytes for o in (False, True))
    for gib in (8, 9, 10, 12, 14, 16, 20, 24, 28, 40):
        c = choose_schedule(COSTS, LINK, gib * GiB)
        assert (c.prefetch_depth == 1) == (gib * GiB < k2_min), (gib, c.prefetch_depth)


def test_resident_stages_move_nothing_in_the_model():
    """The rewrite: a resident stage's rows carry no bytes, and its weights + state are added to the peak."""
    res = [False] * 4 + [True] * 4
    s = evaluate_choice(COSTS, LINK, prefetch_depth=2, resident=res)
    for phase, rows in s.plan.phase_layers.items():
        for i, (_, x) in rows:
            if res[i]:
                assert x == 0.0, (phase, i)
    assert s.extra_device_bytes["resident stages (weights + optimizer state)"] == 4 * 3 * GiB
    stream = evaluate_choice(COSTS, LINK, prefetch_depth=2)
    assert s.step_s < stream.step_s
    # nothing resident is exactly the planner's streaming policy on the measured costs
    p = evaluate(OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=True, prefetch_depth=2),
                 COSTS, link=LINK, optimizer_mode="streamed")
    assert stream.step_s == p.step_s and stream.device_bytes == p.device_bytes


def test_offload_and_device_moments():
    on = evaluate_choice(COSTS, LINK, prefetch_depth=2, offload_activations=True)
    off = evaluate_choice(COSTS, LINK, prefetch_depth=2)
    assert on.plan.policy.activations == {STAGE_INPUT: "host"} and on.extra_device_bytes["carry"] == 128 << 20
    assert on.plan.host_components[f"activation {STAGE_INPUT}"] == 8 * (128 << 20)
    assert on.step_s >= off.step_s
    dev = evaluate_choice(COSTS, LINK, prefetch_depth=2, optimizer_state_on_host=False)
    assert dev.extra_device_bytes["optimizer state of streamed stages"] == 16 * GiB
    assert dev.step_s < off.step_s                                 # only the weights cross PCIe
    inf = evaluate_choice(COSTS, LINK, prefetch_depth=2, offload_activations=True, training=False)
    assert not inf.offload_activations and not inf.training       # offload is a training option


#: A link 100x faster than LINK: the LAYER stack's step is then bound by its compute.
RICH_LINK = Link(100 * 54.5, 100 * 54.6, 100 * 79.3)


def test_no_remat_maps_onto_the_planners_residual_terms():
    """remat=False is the planner's remat=False: offloaded, the residuals are a named activation placed
    "host" beside the stage input (out in the forward, in during the backward: the same Plan as the
    planner's for those costs written by hand); on the device, its "intermediates" term; the
    backward loses the recompute (compute-bound: one forward per stage)."""
    off = evaluate_choice(COSTS, LINK, prefetch_depth=2, offload_activations=True, remat=False)
    assert off.remat is False and off.plan.policy.remat is False
    assert off.plan.policy.activations == {STAGE_INPUT: "host", STAGE_RESIDUALS: "host"}
    assert off.plan.host_components[f"activation {STAGE_RESIDUALS}"] == 8 * GiB
    no_state = [dataclasses.replace(LAYER, optimizer_bytes=0)] * 8         # the backward sets the peak
    mem = evaluate_choice(no_state, LINK, prefetch_depth=2, offload_activations=True, remat=False).plan
    assert mem.peak_phase == "forward/backward" and mem.device_components["intermediates"] == 0
    assert mem.device_components[f"activation {STAGE_RESIDUALS}"] == 3 * GiB            # a window of k+1
    assert mem.device_components["recompute"] == 0
    by_hand = [LayerCost(param_bytes=GiB, optimizer_bytes=2 * GiB, intermediate_bytes=0, working_bytes=512 << 20,
                         activations={STAGE_INPUT: 128 << 20, STAGE_RESIDUALS: GiB}, forward_s=0.012,
                         backward_factor=1.6)] * 8
    p = evaluate(OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=False, prefetch_depth=2,
                               activations={STAGE_INPUT: "host", STAGE_RESIDUALS: "host"}),
                 by_hand, link=LINK, optimizer_mode="streamed")
    assert off.step_s == p.step_s and off.device_bytes == p.device_bytes + (128 << 20)   # + the live carry
    with_remat = evaluate_choice(COSTS, LINK, prefetch_depth=2, offload_activations=True)
    assert off.step_s > with_remat.step_s              # link-bound: 8 GiB more each way costs more than 8 forwards
    dev = evaluate_choice(no_state, LINK, prefetch_depth=2, remat=False)
    assert dev.plan.device_components["intermediates"] == 8 * GiB and not dev.plan.policy.activations
    # compute-bound (a fast link): no recompute saves one forward per stage, offloaded or not
    for offload in (False, True):
        fast = [evaluate_choice(COSTS, RICH_LINK, prefetch_depth=2, offload_activations=offload, remat=r)
                for r in (True, False)]
        assert fast[0].step_s - fast[1].step_s == pytest.approx(8 * 0.012, rel=1e-2)
    assert "remat=False" in off.describe() and off.runtime_kwargs()["remat"] is False
    inf = evaluate_choice(COSTS, LINK, prefetch_depth=2, training=False, remat=False)
    assert "remat" not in inf.runtime_kwargs() and "remat" not in inf.describe()   # a forward does not use it


def test_chooser_drops_remat_only_where_the_link_has_room():
    """Under a budget that holds the residuals offloaded but not on the device, a link-rich
    (compute-bound) stack runs without recompute, offloading the residuals with the stage inputs,
    and a link-poor one keeps remat; allow_no_remat=False (the default) never drops it."""
    budget = evaluate_choice(COSTS, LINK, prefetch_depth=2, offload_activations=True, remat=False).device_bytes
    assert min(evaluate_choice(COSTS, LINK, prefetch_depth=k, remat=False).device_bytes for k in (2, 3, 4)) > budget
    rich = choose_schedule(COSTS, RICH_LINK, budget, allow_no_remat=True)
    assert not rich.remat and rich.offload_activations and rich.device_bytes <= budget
    assert rich.step_s < choose_schedule(COSTS, RICH_LINK, budget).step_s
    assert rich.best_step_s_by_remat[False] == rich.step_s < rich.best_step_s_by_remat[True]
    assert f"remat=False {rich.step_s:.4f} s" in rich.explain() and "remat=False" in rich.explain().splitlines()[0]
    poor = choose_schedule(COSTS, LINK, budget, allow_no_remat=True)
    assert poor.remat and poor.step_s <= evaluate_choice(COSTS, LINK, prefetch_depth=2, offload_activations=True,
                                                         remat=False).step_s
    assert choose_schedule(COSTS, RICH_LINK, budget).remat                      # the default: remat as given
    assert choose_schedule(COSTS, RICH_LINK, budget, allow_no_remat=True).candidates == \
        2 * choose_schedule(COSTS, RICH_LINK, budget).candidates
    # enough memory for every residual on the device: no recompute and nothing offloaded (compute-bound)
    roomy = choose_schedule(COSTS, RICH_LINK, 80 * GiB, allow_no_remat=True)
    assert not roomy.remat and not roomy.offload_activations
    # a forward has nothing to recompute: the option adds no candidate
    fwd = [choose_schedule(COSTS, RICH_LINK, budget, training=False, allow_no_remat=a) for a in (False, True)]
    assert fwd[0].candidates == fwd[1].candidates and fwd[0].same_config(fwd[1])
    # remat given False: the only setting tried
    assert not choose_schedule(COSTS, LINK, 80 * GiB, remat=False).remat
    # same_config: a mapping without remat means the runtime's default (True)
    kw = rich.runtime_kwargs()
    del kw["remat"]
    assert not rich.same_config(kw) and rich.same_config({**kw, "remat": False})
    with pytest.raises(TypeError, match="allow_no_remat"):
        choose_schedule(COSTS, LINK, budget, allow_no_remat="yes")


def test_observe_and_explain():
    c = evaluate_choice(COSTS, LINK, prefetch_depth=2)
    assert "not yet" in c.explain()
    c.observe(step_s=c.step_s * 1.1)
    c.observe(step_s=c.step_s * 1.3, peak_bytes=c.device_bytes)
    assert c.measured_step_s == pytest.approx(c.step_s * 1.2) and c.measured_peak_bytes == c.device_bytes
    text = c.explain()
    assert "1.200x predicted" in text and "1.000x predicted" in text and "OffloadPolicy" in text
    for bad, exc in (({"step_s": -1.0}, ValueError), ({"step_s": True}, TypeError), ({"peak_bytes": -5}, ValueError)):
        with pytest.raises(exc):
            c.observe(**bad)
    assert c.measured_step_s == pytest.approx(c.step_s * 1.2)     # unchanged by the refusals


def test_cache():
    cache = ChoiceCache(maxsize=2)
    c = evaluate_choice(COSTS, LINK, prefetch_depth=1)
    keys = [cache.key(("stages",), ("in", n), GiB, True) for n in range(3)]
    for k in keys:
        cache.put(k, c)
    assert len(cache) == 2 and cache.get(keys[0]) is None and cache.get(keys[2]) is c
    with pytest.raises(TypeError):
        cache.put(keys[0], "not a choice")
    with pytest.raises(TypeError):
        cache.key([1], (), 1, True)
    with pytest.raises(ValueError, match="maxsize"):
        ChoiceCache(0)
    assert isinstance(CHOICES, ChoiceCache) and isinstance(c, ScheduleChoice)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"budget_bytes": 0}, ValueError, "budget_bytes"),
    ({"budget_bytes": 1.5}, ValueError, "budget_bytes"),
    ({"budget_bytes": GiB, "max_prefetch_depth": 0}, ValueError, "max_prefetch_depth"),
    ({"budget_bytes": GiB, "training": 1}, TypeError, "training"),
])
def test_bad_arguments_are_named(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        choose_schedule(COSTS, LINK, **kwargs)
    with pytest.raises(TypeError, match="costs"):
        choose_schedule([], LINK, GiB)
    with pytest.raises(TypeError, match="link"):
        choose_schedule(COSTS, (54, 54), GiB)
    with pytest.raises(ValueError, match="resident"):
        evaluate_choice(COSTS, LINK, prefetch_depth=2, resident=[True])


def test_one_resident_stage_in_training_is_the_last():
    """With a budget for one resident stage beside the k=2 window, the training pick keeps the last
    stage (the last-stage-first order is the one searched: middle and first stages ran slower on
    an H100), even where the model rates stage 0 slightly faster."""
    one = evaluate_choice(COSTS, LINK, prefetch_depth=2, resident=[False] * 7 + [True]).device_bytes
    c = choose_schedule(COSTS, LINK, one, allow_offload=False, allow_device_optimizer_state=False)
    assert c.resident == (False,) * 7 + (True,)
    first = evaluate_choice(COSTS, LINK, prefetch_depth=2, resident=[True] + [False] * 7)
    assert first.step_s < c.step_s                    # the model's preference, not taken
    fwd = choose_schedule(COSTS, LINK, evaluate_choice(COSTS, LINK, prefetch_depth=2, training=False,
                                                       resident=[False] * 7 + [True]).device_bytes, training=False)
    assert fwd.num_resident == 1
