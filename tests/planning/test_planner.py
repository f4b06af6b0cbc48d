"""Tests of the offload planner (xla_swap.planning.planner): pure Python, no torch / jax needed."""
import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from xla_swap.planning.planner import (
    GB, GiB, H200_PINNED, TARGETS, InfeasibleBudgetError, LayerCost, Link, Plan, adam_state_bytes, evaluate,
    min_feasible_bytes, plan,
)
from xla_swap.planning.policy import OffloadPolicy

MiB = 1 << 20

# --- the docs/explanation/measured-facts.md stack: 8 bf16 FFN layers, D=8192, F=32768 (1 GiB of weights each), 8192 tokens,
# 100 ms forward for the stack on an H200, Adam state in fp32.
D, F, T, L = 8192, 32768, 8192, 8
N_BIG = 2 * D * F
BIG = LayerCost(
    param_bytes=2 * N_BIG,                      # 1 GiB bf16
    optimizer_bytes=adam_state_bytes(N_BIG),     # 4 GiB: two fp32 moments
    activations={"ffn_hidden": T * F * 2},       # 512 MiB, tagged with offload_name
    intermediate_bytes=T * F * 2,                # 512 MiB untagged (gelu output)
    carry_bytes=T * D * 2,                       # 128 MiB layer input
    forward_s=0.100 / L,
)

# --- a small BERT-like stack (all-MiniLM-L6-v2 shapes: hidden 384, FFN 1536, 12 heads, 6 layers),
# fp32, batch 32 x 128 tokens, 20 TFLOP/s, forward time from FLOPs (2 * params * tokens).
H, I, S, B, HEADS = 384, 1536, 128, 32, 12
N_SMALL = 4 * H * H + 2 * H * I + 9 * H + I
SMALL = LayerCost(
    param_bytes=4 * N_SMALL,
    optimizer_bytes=adam_state_bytes(N_SMALL),
    activations={"attn_probs": HEADS * S * S * B * 4, "ffn_hidden": S * B * I * 4},
    intermediate_bytes=6 * S * B * H * 4,
    carry_bytes=S * B * H * 4,
    flops=2 * N_SMALL * S * B,
    flops_per_s=20e12,
)


def sweep(layer, num_layers, training=True, link=H200_PINNED):
    """Every distinct plan as the budget shrinks: each plan holds for budgets in
    [plan.device_bytes, previous threshold), so the next threshold is device_bytes - 1."""
    budget = plan(layer, num_layers, 1 << 62, link, training=training).device_bytes
    out = []
    while True:
        try:
            p = plan(layer, num_layers, budget, link, training=training)
        except InfeasibleBudgetError as e:
            assert e.min_budget_bytes == out[-1].device_bytes == min_feasible_bytes(layer, num_layers, training=training)
            return out
        out.append(p)
        budget = p.device_bytes - 1


def short(p: OffloadPolicy):
    return (p.params, p.grads, p.optimizer_state, tuple(p.activations.values()), p.remat, p.prefetch_depth)


def classes_off_device(p: OffloadPolicy):
    off = set()
    if p.activations and any(w != "device" for w in p.activations.values()) or p.remat:
        off.add("activations")
    for name in ("params", "grads", "optimizer_state"):
        if getattr(p, name) == "host":
            off.add(name)
    return off


def first_leave_order(plans):
    order = []
    for p in plans:
        for c in sorted(classes_off_device(p.policy) - set(order)):
            order.append(c)
    return order


# ----------------------------------------------------------------------------- everything fits

@pytest.mark.parametrize("layer,n", [(BIG, L), (SMALL, 6)])
@pytest.mark.parametrize("training", [True, False])
def test_budget_that_fits_everything_gives_all_device(layer, n, training):
    p = plan(layer, n, 1 << 50, training=training)
    assert p.policy.is_all_device and not p.policy.remat and p.policy.prefetch_depth == 1
    assert p.host_bytes == 0
    act = sum(layer.activations.values())
    if training:   # memory model of docs/reference/planner.md, by hand
        expect = n * (layer.param_bytes + layer.grad_bytes + layer.optimizer_bytes + act
                      + layer.intermediate_bytes + layer.carry_bytes) + layer.working_bytes + layer.carry_bytes
        assert p.policy.activations == {k: "device" for k in layer.activations}
        assert p.step_s == pytest.approx(n * 3 * layer.forward_time_s)          # 6ND: fwd + 2x bwd
    else:
        expect = n * layer.param_bytes + layer.working_bytes + layer.carry_bytes
        assert p.policy.activations == {}
        assert p.step_s == pytest.approx(n * layer.forward_time_s)
    assert p.device_bytes == expect
    assert plan(layer, n, expect, training=training).policy.is_all_device
    assert not plan(layer, n, expect - 1, training=training).policy.is_all_device


# ----------------------------------------------------------------------------- order as budgets shrink

def test_design_stack_shrinking_budget_sequence():
    plans = sweep(BIG, L)
    got = [(short(p.policy), p.device_bytes) for p in plans]
    # Thresholds from the memory model of docs/reference/planner.md, by hand. Per layer: P = G = 1 GiB
    # (weights, gradients), O = 4 GiB (Adam), A = 0.5 GiB (ffn_hidden), U = 0.5 GiB (untagged), C = 0.125
    # GiB (saved layer input); working set W = A + U (default) = 1 GiB; live carry C; prefetch depth 1, so
    # a host-placed class keeps a window of 2 layers (1 layer for in-flight gradients).
    P, G, O, C = BIG.param_bytes, BIG.grad_bytes, BIG.optimizer_bytes, BIG.carry_bytes
    A, U, W = BIG.activations["ffn_hidden"], BIG.intermediate_bytes, BIG.working_bytes
    all_device = L * (P + G + O + A + U + C) + W + C                        # 58.125 GiB
    ffn_host = all_device - (L - 2) * A                                     # 55.125: a 2-layer window of A
    ffn_remat = all_device - L * A + A                                      # 54.625: recompute term A
    remat = all_device - L * (A + U) + (A + U)                              # 51.125: recompute term A + U
    def params_host(k):     # a (k+1)-layer window of P instead of L layers
        return -(L - k - 1) * P

    grads_host = -(L - 1) * G                                               # -7: one layer's G in flight
    # With params on host a deeper prefetch saves weight traffic (the first and the last k layers skip an
    # inbound copy: kept on the device across the step boundary and the turn), so each placement appears
    # with every depth whose window fits, deepest first.
    assert got == [
        (("device", "device", "device", ("device",), False, 1), all_device),
        (("device", "device", "device", ("host",), False, 1), ffn_host),
        (("device", "device", "device", ("remat",), False, 1), ffn_remat),
        (("device", "device", "device", ("remat",), True, 1), remat),
        # at the bytes of ffn_hidden recomputed with k=3, the model times ffn_hidden to host with k=2 faster
        # (the turn keeps k+1 layers at any depth, so a deeper prefetch saves one copy less than it did)
        (("host", "device", "device", ("host",), False, 2), ffn_remat + params_host(3)),
        *[(("host", "device", "device", ("remat",), False, k), ffn_remat + params_host(k)) for k in (2, 1)],
        *[(("host", "device", "device", ("remat",), True, k), remat + params_host(k)) for k in (4, 3, 2, 1)],
        *[(("host", "host", "device", ("remat",), False, k), ffn_remat + params_host(k) + grads_host)
          for k in (4, 3, 2, 1)],
        *[(("host", "host", "device", ("remat",), True, k), remat + params_host(k) + grads_host) for k in (3, 2, 1)],
        # optimizer state to host frees L x O = 32 GiB, so the activations come back to the device; the
        # streamed update keeps the last k layers resident across the turn and the first k across the step
        # boundary (StreamingRuntime), so a deeper prefetch saves weight traffic while its (k+1)-layer
        # optimizer window P + G + O fits
        *[(("host", "host", "host", ("device",), False, k), (k + 1) * (P + G + O)) for k in (4, 3, 2)],
        (("host", "host", "host", ("device",), False, 1), 2 * P + G + L * (A + U + C) + W + C),   # 13.125
        # the minimum: the optimizer step streams a 2-layer window of P + G + O (12 GiB)
        (("host", "host", "host", ("remat",), False, 1), 2 * (P + G + O)),
    ]
    assert [b / GiB for _, b in got] == [58.125, 55.125, 54.625, 51.125, 50.625, 49.625, 48.625, 48.125, 47.125,
                                         46.125, 45.125, 44.625, 43.625, 42.625, 41.625, 40.125, 39.125, 38.125,
                                         30.0, 24.0, 18.0, 13.125, 12.0]
    assert all(p.optimizer_mode == ("streamed" if p.policy.optimizer_state == "host" else "device") for p in plans)
    # The order docs/reference/planner.md claims ("Search").
    assert first_leave_order(plans) == ["activations", "params", "grads", "optimizer_state"]
    # Step times by hand for the first moves: offloading ffn_hidden (512 MiB / 54 GB/s = 9.9 ms < 12.5 ms
    # compute) exposes one copy per pass; its recompute costs its byte share (1/2) of a forward per layer.
    x = 512 * MiB / (54 * GB)
    assert plans[0].step_s == pytest.approx(0.300)
    assert plans[1].step_s == pytest.approx(0.300 + 2 * x)
    assert plans[2].step_s == pytest.approx(0.300 + L * 0.5 * BIG.forward_s)
    assert plans[3].step_s == pytest.approx(0.400)                              # remat: one more forward
    assert [p.step_s for p in plans] == sorted(p.step_s for p in plans)         # never faster with less memory


def test_small_stack_shrinking_budget_sequence():
    plans = sweep(SMALL, 6)
    # Compute-bound: a layer's weights and Adam state cross the link in the backward (streamed optimizer mode)
    # faster than the layer computes, so all three leave the device first (docs/reference/planner.md, order claimed).
    assert [short(p.policy) for p in plans] == [
        ("device", "device", "device", ("device", "device"), False, 1),
        ("host", "host", "host", ("device", "device"), False, 1),
        ("host", "host", "host", ("device", "host"), False, 2),
        ("host", "host", "host", ("device", "host"), False, 1),
        ("host", "host", "host", ("device", "remat"), False, 1),
        ("host", "host", "host", ("host", "remat"), False, 2),
        ("host", "host", "host", ("host", "remat"), False, 1),
        ("host", "host", "host", ("remat", "remat"), False, 1),
        ("device", "device", "device", ("remat", "remat"), True, 1),
        ("host", "host", "host", ("device", "remat"), True, 1),
        ("host", "host", "host", ("remat", "remat"), True, 1),
    ]
    assert first_leave_order(plans) == ["grads", "optimizer_state", "params", "activations"]
    assert {p.optimizer_mode for p in plans[1:]} == {"streamed", "device"}
    assert [p.step_s for p in plans] == sorted(p.step_s for p in plans)


@pytest.mark.parametrize("layer,n", [(BIG, L), (SMALL, 6)])
def test_inference_moves_only_parameters(layer, n):
    plans = sweep(layer, n, training=False)
    assert [short(p.policy) for p in plans] == [("device", "device", "device", (), False, 1),
                                                ("host", "device", "device", (), False, 1)]
    assert plans[-1].device_bytes == 2 * layer.param_bytes + layer.working_bytes + layer.carry_bytes


def test_prefetch_depth_is_used_for_uneven_layers():
    # Four compute-heavy layers, then four transfer-heavy ones: a deeper prefetch loads the heavy
    # weights during the long computations, and the planner takes the deepest one that fits.
    light = LayerCost(param_bytes=54 * GB // 1000, forward_s=0.019)   # 1 ms copy, 19 ms compute
    heavy = LayerCost(param_bytes=54 * GB // 100, forward_s=0.001)    # 10 ms copy, 1 ms compute
    layers = [light] * 4 + [heavy] * 4
    steps = [evaluate(OffloadPolicy(params="host", prefetch_depth=k), layers, training=False).step_s
             for k in (1, 2, 3, 4)]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]
    assert plan(layers, budget_bytes=int(2.25e9), training=False).policy.prefetch_depth == 4
    assert plan(layers, budget_bytes=int(2.0e9), training=False).policy.prefetch_depth == 2
    assert plan(layers, budget_bytes=int(1.2e9), training=False).policy.prefetch_depth == 1


# ----------------------------------------------------------------------------- property

_bytes = st.integers(min_value=0, max_value=1 << 33)
_layer = st.builds(
    LayerCost,
    param_bytes=_bytes,
    grad_bytes=st.one_of(st.none(), _bytes),
    optimizer_bytes=st.integers(min_value=0, max_value=1 << 34),
    activations=st.dictionaries(st.sampled_from(["a", "b", "c"]), _bytes, max_size=2),
    intermediate_bytes=_bytes,
    carry_bytes=st.integers(min_value=0, max_value=1 << 30),
    forward_s=st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
)
_link = st.builds(Link, h2d_gbps=st.floats(1.0, 200.0), d2h_gbps=st.floats(1.0, 200.0),
                  both_gbps=st.one_of(st.none(), st.floats(1.0, 400.0)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.one_of(st.tuples(_layer, st.integers(1, 12)), st.lists(_layer, min_size=1, max_size=5)),
       budget=st.integers(min_value=1, max_value=1 << 40), link=_link, training=st.booleans(),
       target=st.sampled_from(TARGETS), steady_state=st.booleans())
def test_plan_fits_budget_or_reports_exact_minimum(layers, budget, link, training, target, steady_state):
    args = layers if isinstance(layers, tuple) else (layers, None)
    kw = dict(training=training, target=target, steady_state=steady_state)
    try:
        p = plan(*args, budget, link, **kw)
    except InfeasibleBudgetError as e:
        assert e.min_budget_bytes > budget and e.budget_bytes == budget
        assert str(e.min_budget_bytes) in str(e)
        p_min = plan(*args, e.min_budget_bytes, link, **kw)     # the minimum is feasible
        assert p_min.device_bytes == e.min_budget_bytes
        return
    assert p.device_bytes <= budget
    assert p.device_bytes == evaluate(p.policy, *args, link, **kw).device_bytes
    assert p.step_s >= p.floor_s * (1 - 1e-9)
    assert p.steady_state == steady_state
    assert p.step_s == pytest.approx(evaluate(p.policy, *args, link, optimizer_mode=p.optimizer_mode, **kw).step_s,
                                     rel=1e-12)
    # the exact minimum peak, or 1 (the smallest budget) for layers of zero bytes
    assert p.min_budget_bytes == min_feasible_bytes(*args, training=training, target=target) <= max(1, p.device_bytes)
    pol = p.policy   # structural rules 1-2 of docs/reference/planner.md ("Search")
    assert pol.optimizer_state == "device" or pol.grads == "host"
    assert pol.grads == "device" or pol.params == "host"
    if p.min_budget_bytes < budget:   # less memory is never faster
        tighter = plan(*args, max(1, (p.min_budget_bytes + budget) // 2), link, **kw)   # a budget is >= 1
        assert tighter.step_s >= p.step_s * (1 - 1e-9)


# ----------------------------------------------------------------------------- infeasible budget

def test_infeasible_budget_states_minimum():
    minimum = min_feasible_bytes(BIG, L)
    assert minimum == 12 * GiB     # optimizer step streaming 2 layers x (1 + 1 + 4) GiB
    with pytest.raises(InfeasibleBudgetError, match=rf"minimum feasible budget is {minimum} bytes \(12\.000 GiB\)") as e:
        plan(BIG, L, 10 * GiB)
    assert isinstance(e.value, ValueError)
    assert e.value.min_budget_bytes == minimum and e.value.budget_bytes == 10 * GiB
    assert evaluate(e.value.min_policy, BIG, L).device_bytes == minimum
    assert plan(BIG, L, minimum).device_bytes == minimum
    with pytest.raises(InfeasibleBudgetError, match=str(minimum)):
        plan(BIG, L, minimum - 1)


# ----------------------------------------------------------------------------- recompute term, XLA:CPU target

BIG_FB = dataclasses.replace(BIG, optimizer_bytes=0)     # no optimizer state: forward/backward is the peak


def test_recompute_term_is_what_the_layer_recomputes():
    A, U, C = BIG.activations["ffn_hidden"], BIG.intermediate_bytes, BIG.carry_bytes
    cases = {   # (activation placement, remat) -> recompute bytes of the layer in its backward
        ("device", False): 0, ("host", False): 0, ("remat", False): A,
        ("device", True): U, ("host", True): U, ("remat", True): A + U,
    }
    for (where, remat), expect in cases.items():
        p = evaluate(OffloadPolicy(activations={"ffn_hidden": where}, remat=remat), BIG, L)
        assert p.device_components["recompute"] == expect, (where, remat)
    # Inference has no backward, so no recompute term.
    assert "recompute" not in evaluate(OffloadPolicy(params="host"), BIG, L, training=False).device_components
    # The all-host, all-remat policy without optimizer state (so the forward/backward phase is the peak):
    # 2-layer weight window + 1 gradient + saved inputs + recompute + working set + carry.
    p = evaluate(OffloadPolicy(params="host", grads="host", activations={"ffn_hidden": "remat"}, remat=True),
                 BIG_FB, L)
    assert p.peak_phase == "forward/backward"
    assert p.device_components["recompute"] + p.device_components["working set"] == 2 * (A + U)
    assert p.device_bytes == 2 * BIG.param_bytes + BIG.grad_bytes + L * C + (A + U) + BIG.working_bytes + C


def test_xla_cpu_target_drops_streaming_windows_and_adds_operand_copies():
    P, G, A, U, C = BIG.param_bytes, BIG.grad_bytes, BIG.activations["ffn_hidden"], BIG.intermediate_bytes, \
        BIG.carry_bytes
    W, O = BIG.working_bytes, BIG.optimizer_bytes
    host = OffloadPolicy(params="host", grads="host", optimizer_state="host", activations={"ffn_hidden": "remat"},
                         remat=True, prefetch_depth=3)
    acc, cpu = evaluate(host, BIG_FB, L), evaluate(host, BIG_FB, L, target="xla_cpu")
    assert acc.device_components["params"] == 4 * P and acc.device_components["grads"] == G
    assert cpu.device_components["params"] == cpu.device_components["grads"] == 0     # no prefetch, no window
    assert cpu.device_components["operand copies"] == max(P, G) + C                  # layer slices + saved input
    assert cpu.device_bytes == max(P, G) + C + L * C + (A + U) + W + C
    assert acc.device_bytes == 4 * P + G + L * C + (A + U) + W + C
    assert evaluate(host, BIG, L, target="xla_cpu").host_components == evaluate(host, BIG, L).host_components
    # The optimizer step streams one layer (not prefetch_depth + 1) of P + G + O.
    opt = evaluate(host, BIG, L, target="xla_cpu")
    assert opt.peak_phase == "optimizer" and opt.device_bytes == P + G + O
    # Without remat the layer's saved slices are copied as well; an activation placed "host" stays on the device.
    saved = OffloadPolicy(params="host", grads="host", optimizer_state="host", activations={"ffn_hidden": "host"})
    cpu = evaluate(saved, BIG_FB, L, target="xla_cpu")
    assert cpu.device_components["activation ffn_hidden"] == L * A and cpu.host_components["activation ffn_hidden"] == 0
    assert cpu.device_components["operand copies"] == P + C + U + A
    assert cpu.device_components["recompute"] == 0
    # Inference: the layer's weight slices only.
    inf = evaluate(OffloadPolicy(params="host"), BIG, L, training=False, target="xla_cpu")
    assert inf.device_bytes == P + W + C
    # plan / min_feasible_bytes use the same model, and the plan records it.
    p = plan(BIG, L, 1 << 50, target="xla_cpu")
    assert p.target == "xla_cpu" and "xla_cpu" in p.explain()
    assert min_feasible_bytes(BIG, L, target="xla_cpu") == P + G + O


# ----------------------------------------------------------------------------- time model vs formula

@pytest.mark.parametrize("tokens,stack_s", [(8192, 0.100), (32768, 0.416)])
def test_forward_only_params_on_host_matches_floor(tokens, stack_s):
    layer = LayerCost(param_bytes=2 * N_BIG, carry_bytes=tokens * D * 2, intermediate_bytes=tokens * F * 2,
                      forward_s=stack_s / L)
    link = Link(h2d_gbps=54.0, d2h_gbps=54.0, both_gbps=93.0)
    budget = 6 * GiB  # below 8 GiB of weights: params must be swapped
    p = plan(layer, L, budget, link, training=False)
    assert p.policy.params == "host"
    x = layer.param_bytes / (link.h2d_gbps * GB)      # one layer's weights over H2D
    c = layer.forward_s
    # Every call still moves all L layers' weights in: the steady state's first k come at the previous call's tail.
    floor = max(L * c, L * layer.param_bytes / (link.h2d_gbps * GB))     # max(compute, 8 GiB / 54 GB/s)
    assert p.steady_state and p.floor_s == pytest.approx(floor, rel=1e-12)
    # A call of a loop (cyclic schedule): the first k layers are on the device when it starts and their
    # copies for the next call run at its tail, so neither the fill nor the drain is exposed: the floor.
    assert p.step_s == pytest.approx(max(L * c, L * x), rel=1e-12)
    # A single cold call: the first prefetch (compute-bound) or the last compute (link-bound) is exposed,
    # within one stage of the floor: 7.9 % at 8192 tokens (171.6 vs 159.1 ms), 4.8 % at 32768.
    cold = plan(layer, L, budget, link, training=False, steady_state=False)
    assert cold.policy == p.policy and not cold.steady_state
    assert cold.floor_s == pytest.approx(floor, rel=1e-12)
    assert cold.step_s == pytest.approx(max(x + L * c, L * x + c), rel=1e-12)
    assert floor < cold.step_s <= floor * (1 + 1.0 / L)
    for q in (p, cold):   # per layer: its weights' copy (at the tail for the next call, or at the start)
        assert all(t == pytest.approx(x) for t in q.layer_transfer_s)
        assert all(t == pytest.approx(c) for t in q.layer_compute_s)


def test_both_directions_share_aggregate_bandwidth():
    pol = OffloadPolicy(params="host", grads="host")   # unmentioned ffn_hidden: saved on the device
    p = evaluate(pol, BIG, L)
    bwd = dict(p.phase_layers["backward"])
    c, x = bwd[3]      # a middle layer: 1 GiB weights in, 1 GiB gradient out at once
    assert x == pytest.approx(2 * GiB / (93 * GB))
    assert c == pytest.approx(2 * BIG.forward_s)
    assert p.device_bytes == evaluate(OffloadPolicy(params="host", grads="host",
                                                    activations={"ffn_hidden": "device"}), BIG, L).device_bytes


def test_flops_estimate_and_remat_accounting():
    layer = LayerCost(param_bytes=1000, flops=6e12, flops_per_s=1e15)
    assert layer.forward_time_s == pytest.approx(6e-3) and layer.backward_time_s == pytest.approx(12e-3)
    plain = evaluate(OffloadPolicy(), layer, 4)
    remat = evaluate(OffloadPolicy(remat=True), layer, 4)
    assert plain.step_s == pytest.approx(4 * 3 * 6e-3)          # 6ND
    assert remat.step_s == pytest.approx(4 * 4 * 6e-3)          # 8ND: one more forward


def test_explain_table():
    p = plan(BIG, L, 40 * GiB)     # forward/backward peak (working set shown); the state stays on the device
    text = p.explain()
    assert isinstance(p, Plan)
    for word in ("params", "grads", "optimizer_state", "activation ffn_hidden", "working set", "predicted step",
                 "floor", "transfer s", "compute s"):
        assert word in text
    assert f"{p.step_s:.4f}" in text and f"{p.floor_s:.4f}" in text
    assert "steady state" in text and "single cold call" in plan(BIG, L, 40 * GiB, steady_state=False).explain()
    assert len([ln for ln in text.splitlines() if re.match(r"\s+\d+\s", ln)]) == L


def test_imports_without_torch_or_jax():
    code = ("import sys; import xla_swap.planning.planner; "
            "bad = [m for m in ('torch', 'torch_xla', 'jax') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).resolve().parents[2])


# ----------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("kwargs,field", [
    (dict(param_bytes=-1, forward_s=0.1), "param_bytes"),
    (dict(param_bytes=1, grad_bytes=-5, forward_s=0.1), "grad_bytes"),
    (dict(param_bytes=1, optimizer_bytes=-5, forward_s=0.1), "optimizer_bytes"),
    (dict(param_bytes=1, activations={"x": -1}, forward_s=0.1), "activations['x']"),
    (dict(param_bytes=1, carry_bytes=1.5, forward_s=0.1), "carry_bytes"),
    (dict(param_bytes=1, forward_s=-0.1), "forward_s"),
    (dict(param_bytes=1), "forward_s"),
    (dict(param_bytes=1, forward_s=0.1, flops=1.0, flops_per_s=1.0), "forward_s"),
    (dict(param_bytes=1, flops=1.0, flops_per_s=0.0), "flops_per_s"),
    (dict(param_bytes=1, forward_s=0.1, recompute_s={"y": 0.1}), "recompute_s['y']"),
    (dict(param_bytes=True, forward_s=0.1), "param_bytes"),
])
def test_bad_layer_cost_names_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=re.escape(field)):
        LayerCost(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(h2d_gbps=0, d2h_gbps=54), "h2d_gbps"),
    (dict(h2d_gbps=54, d2h_gbps=-1), "d2h_gbps"),
    (dict(h2d_gbps=54, d2h_gbps=54, both_gbps=0.0), "both_gbps"),
    (dict(h2d_gbps=float("nan"), d2h_gbps=54), "h2d_gbps"),
])
def test_bad_link_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Link(**kwargs)


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match="'param_byte'"):
        LayerCost.from_dict({"param_byte": 1, "forward_s": 0.1})
    with pytest.raises(ValueError, match="'h2d'"):
        Link.from_dict({"h2d": 54, "d2h_gbps": 54})
    with pytest.raises(TypeError, match="param_byte"):
        LayerCost(param_byte=1, forward_s=0.1)
    assert LayerCost.from_dict({"param_bytes": 1, "forward_s": 0.1}).grad_bytes == 1


def test_bad_plan_arguments():
    with pytest.raises(ValueError, match="budget_bytes"):
        plan(BIG, L, -1)
    with pytest.raises(ValueError, match="num_layers"):
        plan(BIG, 0, GiB)
    with pytest.raises(ValueError, match="num_layers"):
        plan([BIG, BIG], 3, GiB)
    with pytest.raises(ValueError, match="max_prefetch_depth"):
        plan(BIG, L, GiB, max_prefetch_depth=0)
    with pytest.raises(TypeError, match="link"):
        plan(BIG, L, GiB, link=54.0)
    with pytest.raises(TypeError, match="training"):
        plan(BIG, L, GiB, training="yes")
    for call in (lambda: plan(BIG, L, GiB, target="gpu"), lambda: evaluate(OffloadPolicy(), BIG, L, target="cpu"),
                 lambda: min_feasible_bytes(BIG, L, target=None)):
        with pytest.raises(ValueError, match="target"):
            call()
    assert plan(BIG, L, 30 * GiB).target == "accelerator"     # still usable; the default target


# ----------------------------------------------------------------------------- optimizer state in host memory

# The default shape of benchmarks/results/torch_stack/README.md (H100): 8 bf16 FFN layers, D=8192, F=32768, bf16
# AdamW moments (as torch keeps them for bf16 parameters), prefetch depth k=2, pinned link 53.9 / 54.6 / 75.1 GB/s,
# host memory 21.2 GB/s (docs/explanation/measured-facts.md, section 7).  That run timed each call on its own,
# without the cyclic schedule: a single (cold) call of the time model.
TS_N = 2 * D * F                                  # parameters per layer
TS_LINK = Link(h2d_gbps=53.886, d2h_gbps=54.643, both_gbps=75.106, host_memory_gbps=21.2)
TS_ONDEV_ADAMW_S = 0.359      # whole step, moments in device memory (median; the README's "ondev_adamw" samples)
TS_STREAMED_S = 0.831         # whole step, moments streamed through pinned_host (median)
# The same shape in a loop with the cyclic schedule (benchmarks/results/torch_stack_cyclic, medians of
# torch_stack.json): the steady state of the time model.
TSC_LINK = Link(h2d_gbps=54.548, d2h_gbps=54.572, both_gbps=79.289, host_memory_gbps=21.2)
TSC_ONDEV_ADAMW_S = 0.365     # "ondev_adamw"
TSC_STREAMED_S = 0.753        # "torch_adamw"
TS_HOST_POLICY = OffloadPolicy(params="host", grads="host", optimizer_state="host", prefetch_depth=2)


def ts_layer(total_compute_s=TS_ONDEV_ADAMW_S):
    """One layer whose forward + backward (2x forward) adds up, over L layers, to ``total_compute_s``."""
    return LayerCost(param_bytes=2 * TS_N, optimizer_bytes=adam_state_bytes(TS_N, 2), forward_s=total_compute_s / (3 * L))


def test_host_update_bytes_default_is_adamw_traffic():
    layer = ts_layer()
    # read param + grad + m + v, write param + m + v: 14 bytes per bf16 parameter
    assert layer.host_update_bytes == 2 * layer.param_bytes + layer.grad_bytes + 2 * layer.optimizer_bytes == 14 * TS_N
    assert dataclasses.replace(layer, host_update_bytes=123).host_update_bytes == 123
    assert Link(54, 54).host_memory_gbps == 21.2                     # the docs/explanation/measured-facts.md default
    assert TS_LINK.host_update_s(21.2 * GB) == pytest.approx(1.0)


def test_streamed_mode_wins_and_matches_measured_step_at_default_shape():
    layer = ts_layer(TSC_ONDEV_ADAMW_S)
    p = evaluate(TS_HOST_POLICY, layer, L, TSC_LINK)
    assert p.optimizer_mode == "streamed" and p.steady_state
    assert set(p.optimizer_mode_s) == {"streamed", "host"}
    assert p.optimizer_mode_s["streamed"] < p.optimizer_mode_s["host"]
    assert p.step_s == p.optimizer_mode_s["streamed"]
    # PCIe floor of the streamed step in a loop: in = (2L - 2k - 2) weights (the last k+1 kept at the turn, the
    # first k+1 from the previous step's backward) + L x moments, out = L x (weights + moments), both
    # directions at once at the both-ways figure; compute 0.365 s is below it.
    k, W, M = TS_HOST_POLICY.prefetch_depth, layer.param_bytes, layer.optimizer_bytes
    tin, tout = (2 * L - 2 * k - 2) * W + L * M, L * (W + M)
    floor = max(TSC_ONDEV_ADAMW_S, (tin + tout) / (TSC_LINK.both_gbps * GB))
    assert p.floor_s == pytest.approx(floor, rel=1e-9)
    assert p.step_s >= p.floor_s
    assert p.step_s == pytest.approx(TSC_STREAMED_S, rel=0.1)      # measured 0.753 s
    # A single call (the run that timed each call on its own): the first k layers stream in too, 2L - k - 1 weights.
    cold_layer = ts_layer()
    cold = evaluate(TS_HOST_POLICY, cold_layer, L, TS_LINK, steady_state=False)
    assert cold.optimizer_mode == "streamed" and not cold.steady_state
    tin = (2 * L - k - 1) * W + L * M
    assert cold.floor_s == pytest.approx(max(TS_ONDEV_ADAMW_S, (tin + tout) / (TS_LINK.both_gbps * GB)), rel=1e-9)
    assert cold.step_s >= cold.floor_s
    assert cold.step_s == pytest.approx(TS_STREAMED_S, rel=0.1)    # measured 0.831 s
    # The host mode is bounded by host memory: L layers x 14 bytes/parameter / 21.2 GB/s.
    host_s = L * layer.host_update_bytes / (TSC_LINK.host_memory_gbps * GB)
    assert p.optimizer_mode_s["host"] >= host_s
    text = p.explain()
    assert "optimizer mode: streamed" in text
    assert f"streamed {p.optimizer_mode_s['streamed']:.4f} s" in text and f"host {p.optimizer_mode_s['host']:.4f} s" in text


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("moments", [0, 2])      # optimizer state per layer, in units of the layer's weights
@pytest.mark.parametrize("mode", ["streamed", "device"])
def test_steady_state_step_saves_k_layer_transfers_of_a_transfer_bound_forward(k, moments, mode):
    link = H200_PINNED
    W = GiB
    x = W / (link.h2d_gbps * GB)                  # one layer's weights over H2D
    c = 0.7 * x                                   # the forward waits for the link; the backward (2c) does not
    layer = LayerCost(param_bytes=W, optimizer_bytes=moments * W, forward_s=c)
    pol = OffloadPolicy(params="host", grads="host", optimizer_state="host" if mode == "streamed" else "device",
                        prefetch_depth=k)
    steady = evaluate(pol, layer, L, link, optimizer_mode=mode)
    cold = evaluate(pol, layer, L, link, optimizer_mode=mode, steady_state=False)
    assert steady.steady_state and not cold.steady_state and steady.device_bytes == cold.device_bytes
    # In a loop the step starts with layers 0..k on the device: the previous step's last pass kept 0..k-1 and
    # streamed layer k into its window's free slot.  The forward streams the other L - k - 1 back to back,
    # the first once layer 0 freed its slot of the (k+1)-layer window (or, with k = 3, computes the 4 layers
    # it holds longer than the link needs); a single call streams all L.
    assert steady.phase_s["forward"] == pytest.approx(max(c + (L - k - 1) * x + c, L * c), rel=1e-9)
    assert cold.phase_s["forward"] == pytest.approx(L * x + c, rel=1e-9)
    # So the step is shorter by about k layers' transfer time: what the forward saves (at most (k + 1) x - c),
    # less what layer k's copy at the end of the last pass costs there (nothing behind the backward's compute
    # without moments; part of a copy where the link is busy: the moments, the device mode's optimizer phase).
    saved = cold.step_s - steady.step_s
    assert k * x * (1 - 1e-9) <= saved <= ((k + 1) * x - c) * (1 + 1e-9)
    if mode == "streamed" and moments == 0:
        assert saved == pytest.approx(cold.phase_s["forward"] - steady.phase_s["forward"], rel=1e-9)
    # Floors with the same byte counts: 2L - 2k - 2 layers of weights in per step (forward L - k - 1, backward
    # L - k - 1; layers 0..k stay for the next step; 2L - k - 1 in a single call), plus what the optimizer moves: the
    # moments in and out with the new weights ("streamed"), or every layer's weights and gradients in and
    # its weights out in the optimizer phase ("device", gradients out in the backward).
    comp = L * layer.forward_s * (1 + layer.backward_factor)
    if mode == "streamed":
        extra_in, tout = L * layer.optimizer_bytes, L * (W + layer.optimizer_bytes)
    else:
        extra_in, tout = L * (W + layer.grad_bytes), L * (layer.grad_bytes + W)
    for q, w_in in ((steady, 2 * L - 2 * k - 2), (cold, 2 * L - k - 1)):
        assert q.floor_s == pytest.approx(max(comp, link.transfer_s(w_in * W + extra_in, tout)), rel=1e-9)
        assert q.step_s >= q.floor_s
    assert steady.floor_s <= cold.floor_s


def test_steady_state_keeps_nothing_when_the_cpu_updates_the_weights():
    # The "host" mode rewrites the weights on the CPU after the backward (layer 0 last): the next forward streams
    # every layer again, so its steady state is the single-call time.
    layer = ts_layer()
    on, off = (evaluate(TS_HOST_POLICY, layer, L, TS_LINK, optimizer_mode="host", steady_state=s) for s in (True, False))
    assert on.step_s == off.step_s and on.floor_s == off.floor_s and on.phase_s == off.phase_s


def test_steady_state_with_every_layer_in_the_window_moves_no_weights_in():
    # k >= L: StreamingRuntime keeps every layer on the device between calls (a live copy), in inference and
    # training (nothing is streamed for the next call either).
    layer = LayerCost(param_bytes=GiB, optimizer_bytes=2 * GiB, forward_s=0.01)
    n, k = 3, 4
    inf = evaluate(OffloadPolicy(params="host", prefetch_depth=k), layer, n, training=False)
    assert inf.step_s == pytest.approx(n * layer.forward_s) and inf.floor_s == pytest.approx(n * layer.forward_s)
    assert inf.layer_transfer_s == (0.0,) * n
    cold = evaluate(OffloadPolicy(params="host", prefetch_depth=k), layer, n, training=False, steady_state=False)
    assert cold.floor_s == pytest.approx(max(n * layer.forward_s, n * GiB / (H200_PINNED.h2d_gbps * GB)))
    pol = OffloadPolicy(params="host", grads="host", optimizer_state="host", prefetch_depth=k)
    train = evaluate(pol, layer, n, optimizer_mode="streamed")
    tin, tout = n * layer.optimizer_bytes, n * (GiB + layer.optimizer_bytes)     # moments in; weights, moments out
    assert train.floor_s == pytest.approx(max(n * 3 * layer.forward_s, H200_PINNED.transfer_s(tin, tout)))


def test_host_mode_overlaps_the_backward():
    layer = ts_layer()
    link = TS_LINK
    on = evaluate(TS_HOST_POLICY, layer, L, link, optimizer_mode="host")
    off = evaluate(TS_HOST_POLICY, layer, L, link, optimizer_mode="host", host_overlap=False)
    assert on.optimizer_mode == off.optimizer_mode == "host"
    h = layer.host_update_bytes / (link.host_memory_gbps * GB)       # one layer's CPU update
    assert on.host_update_s == pytest.approx(L * h)
    # Host-bound here: ZeRO-Offload's overlap hides all but the forward and the first layer's backward + D2H
    # behind the L updates (max(backward, host update) + ...); without overlap the updates follow the backward.
    device_only = off.phase_s["forward"] + off.phase_s["backward"]
    assert off.step_s == pytest.approx(device_only + L * h)
    assert max(device_only, on.phase_s["forward"] + L * h) <= on.step_s < off.step_s
    assert dict(on.phase_layers["host update"]) == {i: (pytest.approx(h), 0.0) for i in range(L)}


def test_host_mode_wins_with_fast_host_memory_and_slow_pcie():
    layer = ts_layer()
    slow = Link(h2d_gbps=4.0, d2h_gbps=4.0, both_gbps=6.0, host_memory_gbps=2000.0)
    p = evaluate(TS_HOST_POLICY, layer, L, slow)
    assert p.optimizer_mode == "host"
    assert p.optimizer_mode_s["host"] < p.optimizer_mode_s["streamed"]
    # streamed moves L x moments more each way than host mode (which sends only the gradients out)
    assert p.optimizer_mode_s["streamed"] - p.optimizer_mode_s["host"] >= \
        L * layer.optimizer_bytes / (slow.both_gbps * GB) * 0.9
    # plan() picks the mode too, and can be restricted to one
    q = plan(layer, L, 1 << 50, slow, optimizer_mode="host")
    assert q.policy.optimizer_state == "host" and q.optimizer_mode == "host"
    r = plan(layer, L, 1 << 50, slow, optimizer_mode="device")
    assert r.policy.optimizer_state == "device" and r.optimizer_mode == "device"
    # with the default link, the streamed mode wins the same search
    s = plan(layer, L, 1 << 50, TS_LINK, optimizer_mode=None)
    assert s.optimizer_mode in ("device", "streamed")


def test_bad_optimizer_mode_arguments_are_named():
    layer = ts_layer()
    for kwargs in (dict(host_memory_gbps=0), dict(host_memory_gbps=-1.0), dict(host_memory_gbps=float("nan"))):
        with pytest.raises(ValueError, match="host_memory_gbps"):
            Link(h2d_gbps=54, d2h_gbps=54, **kwargs)
    with pytest.raises(ValueError, match="host_update_bytes"):
        LayerCost(param_bytes=1, forward_s=0.1, host_update_bytes=-1)
    with pytest.raises(ValueError, match="optimizer_mode"):
        evaluate(TS_HOST_POLICY, layer, L, optimizer_mode="cpu")
    with pytest.raises(ValueError, match="optimizer_mode"):
        plan(layer, L, 1 << 50, optimizer_mode="gpu")
    with pytest.raises(ValueError, match="optimizer_mode"):      # state on the host cannot run in "device" mode
        evaluate(TS_HOST_POLICY, layer, L, optimizer_mode="device")
    with pytest.raises(ValueError, match="optimizer_mode"):
        evaluate(OffloadPolicy(), layer, L, optimizer_mode="streamed")
    with pytest.raises(ValueError, match="host_overlap"):
        evaluate(TS_HOST_POLICY, layer, L, host_overlap="yes")
    with pytest.raises(ValueError, match="host_overlap"):
        plan(layer, L, 1 << 50, host_overlap=None)
    with pytest.raises(ValueError, match="steady_state"):
        evaluate(TS_HOST_POLICY, layer, L, steady_state="yes")
    with pytest.raises(ValueError, match="steady_state"):
        plan(layer, L, 1 << 50, steady_state=None)


# ----------------------------------------------------------------------------- several devices (num_devices)

@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("policy", [OffloadPolicy(), OffloadPolicy(params="host", prefetch_depth=2),
                                    OffloadPolicy(params="host", grads="host", optimizer_state="host")])
def test_one_device_is_the_one_device_model(policy, training):
    """num_devices=1 (explicit) gives exactly today's Plans, from evaluate, plan and min_feasible_bytes."""
    pol = policy if training else OffloadPolicy(params=policy.params, prefetch_depth=policy.prefetch_depth)
    assert evaluate(pol, BIG, L, training=training, num_devices=1) == evaluate(pol, BIG, L, training=training)
    for budget in (60 * GiB, 30 * GiB, 12 * GiB):
        assert plan(BIG, L, budget, training=training, num_devices=1) == plan(BIG, L, budget, training=training)
        assert plan(SMALL, 6, budget, training=training, num_devices=1) == plan(SMALL, 6, budget, training=training)
    assert min_feasible_bytes(BIG, L, training=training, num_devices=1) == min_feasible_bytes(BIG, L, training=training)
    assert evaluate(pol, BIG, L, training=training).num_devices == 1


@pytest.mark.parametrize("mode", ["streamed", "host", "device"])
def test_two_devices_halve_the_sharded_bytes_and_their_transfers(mode):
    """n=2: each device holds and moves half of every layer's weights, gradients and optimizer state;
    with no compute to hide behind, its per-layer transfer times and the floor halve too."""
    layer = dataclasses.replace(BIG, forward_s=0.0)      # transfer-bound: the floor is its transfer term
    host = OffloadPolicy(params="host", grads="host", optimizer_state="device" if mode == "device" else "host",
                         prefetch_depth=2)
    one = evaluate(host, layer, L, optimizer_mode=mode)
    two = evaluate(host, layer, L, optimizer_mode=mode, num_devices=2)
    assert two.num_devices == 2 and two.optimizer_mode == mode
    for k in ("params", "grads", "optimizer_state"):
        assert two.host_components[k] * 2 == one.host_components[k]
    assert one.host_components["params"] > 0 and one.host_components["grads"] > 0
    assert two.device_bytes < one.device_bytes
    dev_one, dev_two = evaluate(OffloadPolicy(), layer, L), evaluate(OffloadPolicy(), layer, L, num_devices=2)
    for k in ("params", "grads", "optimizer_state"):
        assert dev_two.device_components[k] * 2 == dev_one.device_components[k] > 0
    for k in ("activation ffn_hidden", "intermediates", "carry"):   # per device as the caller gives them
        assert dev_two.device_components[k] == dev_one.device_components[k]
    assert any(one.layer_transfer_s)
    assert two.layer_transfer_s == pytest.approx([x / 2 for x in one.layer_transfer_s], rel=1e-12)
    assert one.floor_s > 0 and two.floor_s == pytest.approx(one.floor_s / 2, rel=1e-12)
    if mode == "host":   # the CPU update's bytes are sharded too (each device's host memory updates its shard)
        assert two.host_update_s == pytest.approx(one.host_update_s / 2, rel=1e-12)
    # an odd byte count: each device holds the largest shard (rounded up)
    odd = dataclasses.replace(BIG, param_bytes=BIG.param_bytes + 1, grad_bytes=None)
    assert evaluate(OffloadPolicy(), odd, L, num_devices=2).device_components["params"] == L * (BIG.param_bytes // 2 + 1)


@pytest.mark.parametrize("training", [True, False])
def test_two_devices_fit_a_budget_one_cannot(training):
    budget = min_feasible_bytes(BIG, L, training=training, num_devices=2)
    assert budget < min_feasible_bytes(BIG, L, training=training)
    with pytest.raises(InfeasibleBudgetError):
        plan(BIG, L, budget, training=training)
    p = plan(BIG, L, budget, training=training, num_devices=2)
    assert p.device_bytes <= budget and p.num_devices == 2 and p.min_budget_bytes == budget
    assert "2 devices (bytes and times per device)" in p.explain()
    # all on the device: 2 devices fit a model whose weights + grads + state one device cannot hold
    full = evaluate(OffloadPolicy(), BIG, L, training=training)
    half = plan(BIG, L, full.device_bytes - 1, training=training, num_devices=2)
    assert half.policy.params == "device"
    assert plan(BIG, L, full.device_bytes - 1, training=training).policy != OffloadPolicy()


@pytest.mark.parametrize("bad", [0, -1, 1.0, 2.5, True, False, "2", None])
def test_bad_num_devices_is_refused_first(bad):
    calls = (lambda: evaluate(OffloadPolicy(), BIG, L, num_devices=bad),
             lambda: evaluate("not a policy", BIG, L, num_devices=bad),       # checked before anything
             lambda: plan(BIG, L, GiB, num_devices=bad),
             lambda: plan(BIG, 0, None, num_devices=bad),
             lambda: min_feasible_bytes(BIG, L, num_devices=bad))
    for call in calls:
        with pytest.raises(ValueError, match="num_devices"):
            call()


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("target", TARGETS)
def test_zero_byte_layers_plan_at_the_minimum_budget(training, target):
    """Layers of zero bytes (no weights, no activations): the minimum budget is 1 (a budget is a positive int),
    and plan accepts it, as for any stack; a budget of 0 is still refused by name."""
    for layers in (LayerCost(0, forward_s=1e-3), [LayerCost(0, activations={"act": 0}, forward_s=1e-3)] * 3):
        args = (layers, 2) if isinstance(layers, LayerCost) else (layers,)
        minimum = min_feasible_bytes(*args, training=training, target=target)
        assert minimum == 1
        p = plan(*args, budget_bytes=minimum, training=training, target=target)
        assert p.device_bytes == 0 and p.min_budget_bytes == minimum and p.budget_bytes == minimum
        assert p.device_bytes == evaluate(p.policy, *args, training=training, target=target).device_bytes
        with pytest.raises(ValueError, match="budget_bytes must be a positive int"):
            plan(*args, budget_bytes=0, training=training, target=target)
    # a stack of nonzero bytes keeps its exact minimum
    assert min_feasible_bytes(BIG, L, training=training, target=target) == \
        plan(BIG, L, min_feasible_bytes(BIG, L, training=training, target=target), training=training,
             target=target).device_bytes
