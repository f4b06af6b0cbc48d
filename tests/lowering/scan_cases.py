"""Shared cases of the scan tests: a two-weight residual body with a tagged activation, the
offload policies it is run with, its plain Python loop reference on CPU torch, sharded weights,
and one lowered training step (``emit_annotations(True)`` + ``lower_fn``).

Used by ``test_scan_offload.py`` and by ``tests/integration/test_scan_pjrt.py`` (the same
lowered modules run through the PJRT executor).
"""
import torch

from xla_util import mesh_2d, to_xla
from xla_swap.lowering import emit_annotations, lower_fn, offload_name, scan
from xla_swap.planning import OffloadPolicy

POLICIES = [
    OffloadPolicy(),
    OffloadPolicy(params="host"),
    OffloadPolicy(params="host", grads="host"),
    OffloadPolicy(params="host", grads="host", activations={"act": "host"}),
    OffloadPolicy(params="host", activations={"act": "remat"}, remat=True),
    OffloadPolicy(params="host", grads="host", activations={"act": "device"}, remat=True),
    OffloadPolicy(activations={"act": "host"}),
    OffloadPolicy(remat=True),
    OffloadPolicy(params="host", grads="host", activations={"act": "host"}, remat=True),
]


def body(h, w):
    a = torch.tanh(h @ w["a"])
    a = offload_name(a, "act")
    return h + a @ w["b"], a.sum(0)


def loop_reference(h, W, reverse=False):
    """The plain Python for-loop on CPU torch."""
    ys = []
    order = range(W["a"].shape[0])
    for i in (reversed(order) if reverse else order):
        h, y = body(h, {k: v[i] for k, v in W.items()})
        ys.append(y)
    if reverse:
        ys = ys[::-1]
    return h, torch.stack(ys)


def make_weights(L, D, seed, two_d):
    g = torch.Generator().manual_seed(seed)
    cpu = {"a": torch.randn(L, D, D, generator=g) * 0.2, "b": torch.randn(L, D, D, generator=g) * 0.2}
    mesh = mesh_2d()
    spec = (None, "x", "y") if two_d else (None, "x", None)
    return cpu, {k: to_xla(v, mesh, spec) for k, v in cpu.items()}


def lower_train_step(policy, W):
    def step(h, a, b):
        h, a, b = h.requires_grad_(True), a.requires_grad_(True), b.requires_grad_(True)
        with torch.enable_grad():
            out, ys = scan(body, h, {"a": a, "b": b}, policy=policy)
            return (out, *torch.autograd.grad((out ** 2).sum() + ys.sum(), [h, a, b]))

    with emit_annotations(True):
        return lower_fn(step, to_xla(torch.randn(8, 16)), W["a"], W["b"])
