"""Fuzzing the public entry points of the executors and the torch entry point (reliability issue).

Each entry point gets one generated bad (or odd) argument in one position; only ``ValueError``,
``TypeError`` or a documented error class may come out, the user's arrays and modules are
unchanged, and the process stays usable (a runtime built afterwards still computes right).

Needs torch (``SwappedStack`` is fuzzed here too): skipped in the jax-only venv of
``make test-jax-only``.
"""
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from xla_swap.executors import InGraphRuntime, PjrtExecutor, StreamingRuntime  # noqa: E402
from xla_swap.planning import AdamW  # noqa: E402
from xla_swap.stack import SwappedStack  # noqa: E402

D = 8

_JUNK = st.one_of(st.none(), st.integers(-3, 3), st.booleans(), st.floats(allow_nan=True), st.text(max_size=4),
                  st.lists(st.integers(), max_size=2), st.just(10 ** 400), st.just(np.int64(2)),
                  st.just(float("inf")), st.just(print), st.just(np.zeros((2, 3), np.float32)),
                  st.just([{"a": np.ones((D, D), np.int8)}]), st.just(jax.devices()[0]),
                  st.just({"params": "host"}), st.just(torch.nn.Linear(2, 2)), st.just(torch.zeros(2, 2)))
_ALLOWED = (ValueError, TypeError)


def layer(p, h):
    return h + jnp.tanh(h @ p["a"])


def _params():
    return [{"a": np.full((D, D), 0.1, np.float32)} for _ in range(3)]


def _entry_points(params, x, mods):
    rt = StreamingRuntime(layer, params)
    opt_rt = StreamingRuntime(layer, params, optimizer=AdamW())
    stack = SwappedStack(mods)
    return {
        "StreamingRuntime.stage_fn": lambda a: StreamingRuntime(a, params),
        "StreamingRuntime.stage_params": lambda a: StreamingRuntime(layer, a),
        "StreamingRuntime.prefetch_depth": lambda a: StreamingRuntime(layer, params, prefetch_depth=a),
        "StreamingRuntime.device": lambda a: StreamingRuntime(layer, params, device=a),
        "StreamingRuntime.sharding": lambda a: StreamingRuntime(layer, params, sharding=a),
        "StreamingRuntime.remat": lambda a: StreamingRuntime(layer, params, remat=a),
        "StreamingRuntime.resident": lambda a: StreamingRuntime(layer, params, resident=a),
        "StreamingRuntime.optimizer": lambda a: StreamingRuntime(layer, params, optimizer=a),
        "StreamingRuntime.trainable": lambda a: StreamingRuntime(layer, params, trainable=a),
        "StreamingRuntime.max_signatures": lambda a: StreamingRuntime(layer, params, max_signatures=a),
        "StreamingRuntime.from_policy": lambda a: StreamingRuntime.from_policy(layer, params, a),
        "forward.h": lambda a: rt.forward(a),
        "train_step.loss_fn": lambda a: rt.train_step(x, a),
        "train_step.cotangent": lambda a: rt.train_step(x, cotangent=a),
        "train_step.loss_args": lambda a: rt.train_step(x, lambda o, *r: jnp.sum(o), loss_args=a),
        "train_step.lr": lambda a: opt_rt.train_step(x, lambda o: jnp.sum(o), lr=a),
        "InGraphRuntime.stage_params": lambda a: InGraphRuntime(layer, a),
        "InGraphRuntime.forward": lambda a: InGraphRuntime(layer, params).forward(a),
        "PjrtExecutor.module": lambda a: PjrtExecutor(a),
        "AdamW.lr": lambda a: AdamW(lr=a),
        "AdamW.betas": lambda a: AdamW(betas=a),
        "AdamW.from_torch": lambda a: AdamW.from_torch(a),
        "SwappedStack.layers": lambda a: SwappedStack(a),
        "SwappedStack.first": lambda a: SwappedStack(mods, first=a),
        "SwappedStack.policy": lambda a: SwappedStack(mods, policy=a),
        "SwappedStack.budget_bytes": lambda a: SwappedStack(mods, budget_bytes=a),
        "SwappedStack.optimizer": lambda a: SwappedStack(mods, optimizer=a),
        "SwappedStack.devices": lambda a: SwappedStack(mods, devices=a),
        "SwappedStack.shard": lambda a: SwappedStack(mods, shard=a),
        "SwappedStack.forward": lambda a: stack(a),
        "SwappedStack.train_step.inputs": lambda a: stack.train_step(a, loss_fn=lambda o: o.sum()),
        "SwappedStack.train_step.loss_fn": lambda a: stack.train_step(torch.ones(2, D), loss_fn=a),
    }


_NAMES = sorted(_entry_points(_params(), np.ones((2, D), np.float32), [torch.nn.Linear(D, D)]))


@given(entry=st.sampled_from(_NAMES), arg=_JUNK)
@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_fuzz_executor_entry_points_raise_only_documented_errors(entry, arg):
    params = _params()
    x = np.linspace(-1, 1, 2 * D, dtype=np.float32).reshape(2, D)
    torch.manual_seed(0)
    mods = [torch.nn.Linear(D, D) for _ in range(2)]
    before = [m.weight.detach().clone() for m in mods]
    try:
        _entry_points(params, x, mods)[entry](arg)
    except _ALLOWED:
        pass
    # the user's arrays and modules are unchanged, and the process still computes right
    np.testing.assert_array_equal(params[0]["a"], np.full((D, D), 0.1, np.float32))
    for m, w in zip(mods, before):
        torch.testing.assert_close(m.weight.detach(), w, rtol=0, atol=0)
    ref = x
    for p in params:
        ref = ref + np.tanh(ref @ p["a"])
    np.testing.assert_allclose(np.asarray(StreamingRuntime(layer, params).forward(x)), ref, rtol=1e-5, atol=1e-6)
