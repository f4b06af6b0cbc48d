"""Reliability of the front end and the planner: no crash, no silent wrong result,
a clear error naming the argument for every bad input, before any state changes."""
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch_xla
from hypothesis import HealthCheck, given, settings, strategies as st
from torch_xla.experimental.scan import scan as txla_scan

from xla_util import DEV, mesh_2d, to_xla
from xla_swap.lowering import (ScanArgumentError, emit_annotations, host_transfer_guard, lower, lower_fn, offload_name,
                               place_to_device, place_to_host, scan, scan_layers)
from xla_swap.planning import InfeasibleBudgetError, LayerCost, Link, OffloadPolicy, evaluate, plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_child(code: str, spmd: bool) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python process with torch_xla on CPU (SPMD or not)."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    head = "import torch, torch_xla\nimport torch_xla.runtime as xr\n" + ("xr.use_spmd()\n" if spmd else "")
    return subprocess.run([sys.executable, "-c", head + textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=240)


def cpu_copy(t):
    return t.detach().cpu()


# ------------------------------------------------------------------- item 2
@pytest.mark.spmd
def test_item2_remat_policy_with_a_tensor_created_in_the_body():
    """torch_xla's test_scan_create_tensors case: a get_attr constant in the scanned function."""
    def fn(c, x):
        a = torch.tensor([1.0, 2.0, 3.0], device=c.device)
        c = c * a + x.sin()
        return c, c.sum()

    def run(scan_fn, **kw):
        c = to_xla(torch.ones(3)).requires_grad_(True)
        x = to_xla(torch.randn(4, 3, generator=torch.Generator().manual_seed(0))).requires_grad_(True)
        out, ys = scan_fn(fn, c, x, **kw)
        return [cpu_copy(t) for t in (out, ys, *torch.autograd.grad(out.sum() + ys.sum(), [c, x]))]

    want = run(txla_scan)
    for policy in (OffloadPolicy(remat=True), OffloadPolicy(params="host", remat=True)):
        for a, b in zip(run(scan, policy=policy), want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------- item 3
@pytest.mark.spmd
def test_item3_recomputing_backward_reuses_the_forward_dropout_mask():
    w = to_xla(torch.randn(32, 32, generator=torch.Generator().manual_seed(1)))
    torch_xla.sync()
    low = lower_fn(lambda x: torch.nn.functional.dropout(x @ w, 0.5, training=True), to_xla(torch.randn(16, 32)))
    x = to_xla(torch.randn(16, 32, generator=torch.Generator().manual_seed(2))).requires_grad_(True)
    out = low(x)[0]
    g, = torch.autograd.grad(out, x, torch.ones_like(out))
    mask = (out != 0).float().cpu()
    assert 0.2 < mask.mean() < 0.8                  # dropout did drop
    want = (mask * 2) @ w.cpu().t()                 # d/dx of dropout(x @ w) with the forward's mask
    torch.testing.assert_close(g.cpu(), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- item 4
@pytest.mark.spmd
def test_item4_captured_parameters_get_gradients():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3).to(DEV)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict({k: v.cpu() for k, v in lin.state_dict().items()})
    torch_xla.sync()
    low = lower_fn(lin, to_xla(torch.randn(2, 4)))
    x0 = torch.randn(2, 4)
    x = to_xla(x0).requires_grad_(True)
    (low(x)[0] ** 2).sum().backward()
    (ref(x0.requires_grad_(True)) ** 2).sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None
    torch.testing.assert_close(lin.weight.grad.cpu(), ref.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.bias.grad.cpu(), ref.bias.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.cpu(), x0.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- item 5
@pytest.mark.spmd
def test_item5_in_place_update_after_lowering_forward_and_backward_agree():
    w = to_xla(torch.randn(4, 4, generator=torch.Generator().manual_seed(3)))
    torch_xla.sync()
    low = lower_fn(lambda x: (x @ w).sin(), to_xla(torch.randn(2, 4)))
    w.mul_(3)                                       # e.g. an optimizer step
    torch_xla.sync()
    x = to_xla(torch.randn(2, 4)).requires_grad_(True)
    out = low(x)[0]
    g, = torch.autograd.grad(out.sum(), x)
    eager = (x @ w).sin()
    g_eager, = torch.autograd.grad(eager.sum(), x)
    torch.testing.assert_close(out.cpu(), eager.cpu(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g.cpu(), g_eager.cpu(), rtol=1e-6, atol=1e-6)


def test_item5_no_is_deleted_crash_without_spmd():
    """Without SPMD, torch_xla donates the updated buffer: the old code died in a C++ check."""
    r = run_child("""
        from xla_swap.lowering import lower, lower_fn
        dev = torch_xla.device()
        w = torch.randn(4, 4).to(dev); x = torch.randn(2, 4).to(dev); torch_xla.sync()
        low = lower_fn(lambda x: x @ w, x)
        snap = lower([x @ w], [x])
        w.mul_(3); torch_xla.sync()
        x2 = torch.randn(2, 4).to(dev)
        assert torch.allclose(low(x2)[0].cpu(), (x2 @ w).cpu())
        try:
            snap(x2)
        except ValueError as e:
            assert "deleted" in str(e), e
        print("OK")
    """, spmd=False)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


# ------------------------------------------------------------------- item 6
@pytest.mark.spmd
def test_item6_same_tensor_twice_is_two_parameters():
    x = to_xla(torch.ones(4))
    a, b = to_xla(torch.randn(4)), to_xla(torch.randn(4))
    torch_xla.sync()
    low = lower_fn(lambda p, q: p * 2 + q * 3, x, x)
    assert len(low.input_parameters) == 2
    assert low.input_parameters[0].id != low.input_parameters[1].id
    torch.testing.assert_close(low(a, b)[0].cpu(), (a * 2 + b * 3).cpu())
    with pytest.raises(ValueError, match=r"inputs\[1\]: the same device data as inputs\[0\]"):
        lower([x * 2], [x, x])


# ------------------------------------------------------------------- item 8
def _all_gathers(hlo: str) -> int:
    return len(re.findall(r"= [^\n]*\ball-gather(?:-start)?\(", hlo))


@pytest.mark.spmd
def test_item8_activation_offload_adds_no_all_gather_under_spmd():
    from xla_swap.executors import PjrtExecutor

    mesh = mesh_2d()
    g = torch.Generator().manual_seed(4)
    W = {k: to_xla(torch.randn(3, 16, 16, generator=g) * 0.2, mesh, (None, None, "y")) for k in "ab"}

    def body(h, w):
        a = offload_name(torch.tanh(h @ w["a"]), "act")
        return h + a @ w["b"], None

    def compiled(policy):
        def step(h, a, b):
            h, a, b = h.requires_grad_(True), a.requires_grad_(True), b.requires_grad_(True)
            with torch.enable_grad():
                out, _ = scan(body, h, {"a": a, "b": b}, policy=policy)
                return (out, *torch.autograd.grad((out ** 2).sum(), [h, a, b]))

        h = to_xla(torch.randn(8, 16, generator=g), mesh, ("x", None))   # batch-sharded activation
        torch_xla.sync()
        with emit_annotations(True):
            low = lower_fn(step, h, W["a"], W["b"])
        return low, PjrtExecutor(low.hlo_proto).compiled_hlo_text()

    _, all_device = compiled(OffloadPolicy())
    low, offloaded = compiled(OffloadPolicy(activations={"act": "host"}))
    calls = re.findall(r"custom-call\([^\n]*(?:annotate_device_placement|MoveToHost|MoveToDevice)[^\n]*", low.hlo_text)
    assert len(calls) == 2 and not any("{replicated}" in c for c in calls)
    print(f"all-gathers: all-device {_all_gathers(all_device)}, act offloaded {_all_gathers(offloaded)}")
    assert _all_gathers(offloaded) == _all_gathers(all_device)


# ------------------------------------------------------------------- item 10
def test_item10_annotated_lowering_refused_by_the_torch_xla_runtime():
    r = run_child("""
        from xla_swap.lowering import emit_annotations, lower_fn, place_to_host, place_to_device
        dev = torch_xla.device()
        x = torch.randn(4, 4).to(dev); torch_xla.sync()
        with emit_annotations(True):
            low = lower_fn(lambda t: place_to_device(place_to_host(t * 2)), x)
        try:
            low(x)
        except ValueError as e:
            assert "annotate_device_placement" in str(e), e
            print("REFUSED")
        y = (x + 1).cpu()            # the process is still usable
        torch_xla.sync()
        assert torch.allclose(y, x.cpu() + 1)
        print("OK")
    """, spmd=True)
    assert r.returncode == 0 and "REFUSED" in r.stdout and "OK" in r.stdout, r.stderr[-3000:]


# ------------------------------------------------------------------- item 12
def test_item12_silently_accepted_inputs_are_refused():
    x = to_xla(torch.randn(4, 4))
    torch_xla.sync()
    with pytest.raises(TypeError, match="counters: expected a list or tuple"):
        with host_transfer_guard("TransferFromDeviceTime"):
            pass
    with pytest.raises(ValueError, match=r"counters\[0\]: 'TransferFromDevice' is not a torch_xla metric"):
        with host_transfer_guard(["TransferFromDevice"]):
            pass
    with pytest.raises(TypeError, match="outputs: expected a list or tuple of XLA tensors, got a single tensor"):
        lower(x * 2)
    with pytest.raises(ValueError, match="sharding: 'garbage' is not an OpSharding string"):
        place_to_host(x, "garbage")
    with pytest.raises(ValueError, match="sharding: .* tiles 1 dimensions, the tensor has 2"):
        place_to_device(x, "{devices=[4]0,1,2,3}")
    policy = OffloadPolicy(activations={"act": "host"})
    h = hash(policy)
    with pytest.raises(TypeError, match="read-only"):
        policy.activations["act"] = "device"
    assert hash(policy) == h and policy.activations == {"act": "host"}
    with pytest.raises(ValueError, match=r"policy.activations names \['nope'\].*known names: \['act'\]"):
        evaluate(OffloadPolicy(activations={"nope": "host"}), LayerCost(1 << 20, activations={"act": 1 << 10},
                                                                         forward_s=1e-3), 2)
    W = to_xla(torch.randn(2, 4, 4))

    def body(c, w):
        return c @ w, None

    with pytest.raises(ValueError, match="partition_fn: .*cannot be used"):
        scan(body, x, W, partition_fn=lambda *a, **k: None, policy=OffloadPolicy(params="host"))
    with pytest.warns(UserWarning, match="is_fn_pure=True is ignored"):
        scan(body, x, W, is_fn_pure=True, policy=OffloadPolicy(params="host"))
    with pytest.raises(TypeError, match="remat must be a bool"):
        OffloadPolicy(remat=print)
    # the process is still usable, x unchanged
    out, _ = scan(body, x, W, policy=OffloadPolicy(params="host"))
    torch.testing.assert_close(out.cpu(), x.cpu() @ W[0].cpu() @ W[1].cpu(), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- item 13
def test_item13_unclear_errors_name_the_argument():
    x = to_xla(torch.randn(4, 4))
    torch_xla.sync()
    with pytest.raises(TypeError, match="name: expected a str, got int"):
        lower([x * 2], name=123)
    with pytest.raises(TypeError, match="outputs: expected a list or tuple of XLA tensors, got NoneType"):
        lower(None)
    low = lower_fn(lambda t: t @ x, to_xla(torch.randn(2, 4)))
    with pytest.raises(ValueError, match="tensor: .* is a view or a pending computation"):
        low.parameter_id(x.view(16))
    W = to_xla(torch.randn(2, 4, 4))
    with pytest.raises(ValueError, match="xs: leaf 1 is 0-d"):
        scan(lambda c, w: (c, None), x, (W, to_xla(torch.tensor(1.0))))
    with pytest.raises(TypeError, match="fn: expected a callable, got int"):
        scan(1000, x, W, policy=OffloadPolicy(params="host"))
    with pytest.raises(TypeError, match=r"layers\[1\]: expected a torch.nn.Module, got str"):
        scan_layers([torch.nn.Linear(4, 4).to(DEV), "x"], x)
    with pytest.raises(ValueError, match=r"LayerCost.param_bytes must be <= 2\*\*63 - 1"):
        LayerCost(param_bytes=10 ** 400, forward_s=1.0)
    with pytest.raises(ValueError, match=r"h2d_gbps \+ Link.d2h_gbps") as e:
        Link(1e308, 1e308)
    assert "both_gbps must" not in str(e.value)
    assert OffloadPolicy(prefetch_depth=np.int64(2)).prefetch_depth == 2
    assert type(OffloadPolicy(prefetch_depth=np.int64(2)).prefetch_depth) is int
    # lower_fn with an input whose graph is still pending: materialised, not "not read by the graph"
    pending = x + 1
    low = lower_fn(lambda t: t * 2, pending)
    torch.testing.assert_close(low(x)[0].cpu(), x.cpu() * 2)


# ------------------------------------------------------------------- fuzz
_JUNK = st.one_of(st.none(), st.integers(-3, 3), st.booleans(), st.floats(allow_nan=True), st.text(max_size=4),
                  st.just("{replicated}"), st.just("{devices=[2,2]0,1,2,3}"), st.lists(st.integers(), max_size=2),
                  st.dictionaries(st.text(max_size=3), st.sampled_from(["host", "device", "remat", "x", 1]),
                                  max_size=2),
                  st.just(10 ** 400), st.just(np.int64(2)), st.just(float("inf")), st.just(print))

_ALLOWED = (ValueError, TypeError, InfeasibleBudgetError)


def _entry_points(x, W):
    """Each public entry point as ``f(arg)``, the fuzzed argument in one position."""
    def guard(a):
        with host_transfer_guard(a):
            pass

    def guard_flag(a):
        with host_transfer_guard(raise_on_transfer=a):
            pass

    def emit(a):
        with emit_annotations(a):
            pass

    layer = LayerCost(1 << 20, activations={"act": 1 << 10}, forward_s=1e-3)
    return {
        "lower.outputs": lambda a: lower(a),
        "lower.inputs": lambda a: lower([x * 2], a),
        "lower.name": lambda a: lower([x * 2], name=a),
        "lower_fn.fn": lambda a: lower_fn(a, x),
        "lower_fn.input": lambda a: lower_fn(lambda t: t * 2, a),
        "lower_fn.name": lambda a: lower_fn(lambda t: t * 2, x, name=a),
        "scan.fn": lambda a: scan(a, x, W),
        "scan.init": lambda a: scan(lambda c, w: (c, None), a, W),
        "scan.xs": lambda a: scan(lambda c, w: (c, None), x, a),
        "scan.policy": lambda a: scan(lambda c, w: (c, None), x, W, policy=a),
        "scan.is_fn_pure": lambda a: scan(lambda c, w: (c, None), x, W, is_fn_pure=a),
        "scan_layers.layers": lambda a: scan_layers(a, x),
        "place_to_host.x": lambda a: place_to_host(a),
        "place_to_host.sharding": lambda a: place_to_host(x, a),
        "place_to_device.grad_to_host": lambda a: place_to_device(x, "", a),
        "offload_name.name": lambda a: offload_name(x, a),
        "host_transfer_guard.counters": guard,
        "host_transfer_guard.raise_on_transfer": guard_flag,
        "emit_annotations.enabled": emit,
        "OffloadPolicy.params": lambda a: OffloadPolicy(params=a),
        "OffloadPolicy.activations": lambda a: OffloadPolicy(activations=a),
        "OffloadPolicy.remat": lambda a: OffloadPolicy(remat=a),
        "OffloadPolicy.prefetch_depth": lambda a: OffloadPolicy(prefetch_depth=a),
        "LayerCost.param_bytes": lambda a: LayerCost(param_bytes=a, forward_s=1e-3),
        "LayerCost.activations": lambda a: LayerCost(1, activations=a, forward_s=1e-3),
        "LayerCost.forward_s": lambda a: LayerCost(1, forward_s=a),
        "Link.h2d_gbps": lambda a: Link(a, 10.0),
        "Link.both_gbps": lambda a: Link(10.0, 10.0, a),
        "plan.num_layers": lambda a: plan(layer, a, budget_bytes=1 << 40),
        "plan.budget_bytes": lambda a: plan(layer, 2, budget_bytes=a),
        "plan.link": lambda a: plan(layer, 2, budget_bytes=1 << 40, link=a),
        "evaluate.policy": lambda a: evaluate(a, layer, 2),
        "evaluate.training": lambda a: evaluate(OffloadPolicy(), layer, 2, training=a),
    }


_NAMES = sorted(_entry_points(None, None))


@given(entry=st.sampled_from(_NAMES), arg=_JUNK)
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_fuzz_public_entry_points_raise_only_documented_errors(entry, arg):
    x0 = torch.randn(4, 4, generator=torch.Generator().manual_seed(5))
    x = to_xla(x0)
    W = to_xla(torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(6)))
    torch_xla.sync()
    try:
        _entry_points(x, W)[entry](arg)
    except _ALLOWED:
        pass
    # the user's tensors are unchanged and the process is usable
    torch.testing.assert_close(x.cpu(), x0)
    torch.testing.assert_close((x @ x).cpu(), x0 @ x0, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- sharding strings, device ids
@pytest.mark.spmd
def test_sharding_strings_with_bad_device_ids_are_named():
    import torch_xla.runtime as xr
    n = xr.global_runtime_device_count()
    x0 = torch.randn(4, 4, generator=torch.Generator().manual_seed(7))
    x = to_xla(x0)
    torch_xla.sync()
    ids = ",".join(map(str, range(n)))
    cases = [(f"{{devices=[{n},1]{ids[:-1]}{n + 3}}}", f"names device {n + 3}, but the runtime has {n} device"),
             (f"{{devices=[{n + 1},1]{ids},{n}}}", f"names device {n}, but the runtime has {n} device"),
             (f"{{devices=[{n + 1},1]<=[{n + 1}]}}", f"names device {n}, but the runtime has {n} device"),
             (f"{{maximal device={n}}}", f"names device {n}"),
             ("{devices=[0,1]<=[0]}", "tile dimension of 0")]
    if n > 1:
        cases.append((f"{{devices=[{n},1]0,{ids[:-2]}}}", "lists device 0 twice"))
    for spec, msg in cases:
        for fn in (place_to_host, place_to_device):
            with pytest.raises(ValueError, match="sharding: .*" + re.escape(msg)):
                fn(x, spec)
        with emit_annotations(True):
            with pytest.raises(ValueError, match="sharding: .*" + re.escape(msg)):
                lower_fn(lambda t: place_to_device(place_to_host(t * 2, spec), spec), x)
    # a permutation of the devices is accepted; x is unchanged and the process usable
    perm = ",".join(map(str, reversed(range(n))))
    torch.testing.assert_close(place_to_host(x, f"{{devices=[{n},1]{perm}}}").cpu(), x0)
    torch.testing.assert_close((x @ x).cpu(), x0 @ x0, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- errors instead of a crash or a poisoned process
@pytest.mark.parametrize("spmd", [False, True])
def test_lower_fn_of_a_function_without_output_is_refused_and_the_process_stays_usable(spmd):
    """torch_xla lowers an empty output list with SIGSEGV (no SPMD) or 'No XlaOp with handle' (SPMD): run in a
    subprocess, so that a regression cannot kill pytest."""
    r = run_child("""
        from xla_swap.lowering import lower_fn
        dev = torch_xla.device()
        x0 = torch.randn(4, 4)
        x = x0.to(dev); torch_xla.sync()
        for returned in ((), []):
            try:
                lower_fn(lambda t: returned, x)
            except ValueError as e:
                assert f"fn: '<lambda>' returned {returned!r}, no tensor" in str(e), e
                print("REFUSED")
        y = x @ x + 1                                     # a valid computation, same process
        torch_xla.sync()
        assert torch.allclose(y.cpu(), x0 @ x0 + 1, atol=1e-5)
        low = lower_fn(lambda t: (t * 2, t.sum()), x)     # lowering still works
        a, b = low(x)
        assert torch.allclose(a.cpu(), x0 * 2) and torch.allclose(b.cpu(), x0.sum(), atol=1e-5)
        print("OK")
    """, spmd=spmd)
    assert r.returncode == 0 and r.stdout.count("REFUSED") == 2 and "OK" in r.stdout, (r.returncode, r.stderr[-3000:])


@pytest.mark.parametrize("spmd", [False, True])
def test_annotation_outside_a_lowering_is_refused_before_it_poisons_the_process(spmd):
    """On the torch_xla CPU runtime (which cannot run the annotations), place_to_host / place_to_device /
    a host-param scan under emit_annotations(True) outside a lowering raise a ValueError before anything
    enters the lazy graph: every later sync works; inside lower_fn the same ops are lowered as before."""
    r = run_child("""
        from xla_swap.lowering import (emit_annotations, lower, lower_fn, lowering_scope, place_to_device,
                                       place_to_host, runtime_supports_annotations, scan)
        from xla_swap.planning import OffloadPolicy
        assert not runtime_supports_annotations()
        dev = torch_xla.device()
        x0, w0 = torch.randn(4, 4), torch.randn(2, 4, 4)
        x, W = x0.to(dev), w0.to(dev); torch_xla.sync()
        body = lambda c, w: (c @ w, None)
        with emit_annotations(True):
            for op, call in (("place_to_host", lambda: place_to_host(x)),
                             ("place_to_device", lambda: place_to_device(x * 2)),
                             ("place_to_device", lambda: scan(body, x, W, policy=OffloadPolicy(params="host")))):
                try:
                    call()
                except ValueError as e:
                    assert f"x: {op} under emit_annotations(True), outside a lowering" in str(e), e
                    assert "annotate_device_placement" in str(e) and "lower_fn" in str(e), e
                    print("REFUSED")
            torch_xla.sync()                              # nothing pending fails
            y = x @ x + 1
            assert torch.allclose(y.cpu(), x0 @ x0 + 1, atol=1e-5)
            low = lower_fn(lambda t: place_to_device(place_to_host(t * 2)), x)   # lowering: emitted
            with lowering_scope():
                snap = lower([place_to_host(x * 3)], [x])
        for l in (low, snap):
            assert 'custom_call_target="annotate_device_placement"' in l.hlo_text or "MoveTo" in l.hlo_text
        out, _ = scan(body, x, W, policy=OffloadPolicy(params="host"))           # dropped: the identity
        torch_xla.sync()
        assert torch.allclose(out.cpu(), x0 @ w0[0] @ w0[1], atol=1e-4)
        print("OK")
    """, spmd=spmd)
    assert r.returncode == 0 and r.stdout.count("REFUSED") == 3 and "OK" in r.stdout, (r.returncode,
                                                                                         r.stderr[-3000:])


_BAD_BODIES = [
    (lambda c, w: (torch.cat([c, c]), None), ValueError, r"returned carry leaf 0 of shape \[8, 4\], expected \[4, 4\]"),
    (lambda c, w: ((c @ w).double(), None), TypeError, "returned carry leaf 0 of dtype torch.float64, expected "
                                                       "torch.float32"),
    (lambda c, w: c @ w, ScanArgumentError, r"returned a tensor of shape \[4, 4\] torch.float32; expected a "
                                            r"\(carry, y\) pair"),
    (lambda c, w: torch.stack([c @ w, c]), ScanArgumentError, r"returned a tensor of shape \[2, 4, 4\]"),
    (lambda c, w: (c, c, c), ScanArgumentError, "returned a tuple of 3"),
    (lambda c, w: ((c, c), None), ValueError, "returned a carry that is a tuple of 2 .*expected the structure of init"),
    (lambda c, w: (c @ w, 3), TypeError, "returned y with leaf 0 a value of type int"),
]


@pytest.mark.spmd
@pytest.mark.parametrize("policy", [OffloadPolicy(params="host"), OffloadPolicy(remat=True)], ids=["host", "remat"])
def test_scan_body_breaking_the_contract_is_named(policy):
    """A body that changes the carry's shape or dtype, or does not return (carry, y): an error naming the body,
    what it returned and what was expected (torch_xla: AssertionError, 'too many values to unpack', or an XLA
    shape error); afterwards the same scan with a valid body equals the Python loop."""
    x0, w0 = torch.randn(4, 4), torch.randn(2, 4, 4) * 0.5
    x, W = to_xla(x0), to_xla(w0)
    torch_xla.sync()
    for fn, error, message in _BAD_BODIES:
        with pytest.raises(error, match="fn: '<lambda>' " + message):
            scan(fn, x, W, policy=policy)
    with pytest.raises(ValueError, match=r"layers: Linear returned carry leaf 0 of shape \[4, 8\], expected \[4, 4\]"):
        scan_layers([torch.nn.Linear(4, 8).to(DEV)], x, policy=policy)
    torch_xla.sync()
    out, ys = scan(lambda c, w: (c @ w, c.sum()), x, W, policy=policy)
    torch.testing.assert_close(out.cpu(), x0 @ w0[0] @ w0[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ys.cpu(), torch.stack([x0.sum(), (x0 @ w0[0]).sum()]), rtol=1e-5, atol=1e-5)
