"""A dropped ``StreamingRuntime`` releases everything it made.

After ``del`` the runtime, its executables, the wrappers it traced, its jitted loss and its
host buffers are dead (weak references), by reference counting alone (no reference cycle
waits for the collector); and jax's in-memory caches hold as many entries after further
construct / call / drop cycles as before them, although the stage and loss functions are
module-level functions that outlive every runtime (jax keys its tracing caches on the traced
function object and on each ``jax.jit`` instance). No timing, no RSS: counts and weak references.
"""
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xla_swap._compat.jax import tracing_cache_entries
from xla_swap.executors import RuntimeConfig, StreamingRuntime
from xla_swap.executors.streaming.runtime import MAX_LOSS_FNS
from xla_swap.planning import AdamW


def layer(p, h):
    return h + jnp.tanh(h @ p["a"]) @ p["b"]


def mse(out, t):
    return jnp.mean((out - t) ** 2)


def _params(n=3):
    rng = np.random.default_rng(0)
    return [{"a": rng.standard_normal((8, 16), np.float32) * 0.1,
             "b": rng.standard_normal((16, 8), np.float32) * 0.1} for _ in range(n)]


X = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)


def _cycle(params, optimizer=None, **kw) -> list:
    """Build, call (forward and train_step) and drop a runtime; weak references to what it made."""
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=1, **kw), optimizer=optimizer)
    jax.block_until_ready(rt.forward(X))
    jax.block_until_ready(rt.train_step(X, mse, loss_args=(X,))[0])
    made = ([rt] + list(rt._traced_fns) + list(rt._loss_jits.values())
            + [e for s in rt._sigs.values() for e in s.compiled.values()]
            + jax.tree_util.tree_leaves(rt.host_params) + jax.tree_util.tree_leaves(rt.optimizer_state)
            + [a for _, dev in rt._carry.values() for a in jax.tree_util.tree_leaves(dev)])
    assert rt.num_executables > 0 and rt._carry and len(rt._loss_jits) == 1
    return [weakref.ref(o) for o in made]


@pytest.mark.parametrize("kw", [dict(), dict(optimizer=AdamW(lr=1e-3), remat=False),
                                dict(offload_activations=True, grads_to_host=False)],
                         ids=["grads", "adamw-saved", "offload"])
def test_dropped_runtime_frees_its_executables_functions_and_buffers(kw):
    params = _params()
    refs = _cycle(params, **kw)          # every name of the runtime went out of scope with the call
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert alive == [], f"alive after the runtime was dropped (before any gc.collect()): {alive}"
    assert len(refs) > 10


@pytest.mark.parametrize("kw", [dict(), dict(optimizer=AdamW(lr=1e-3), remat=False)], ids=["grads", "adamw-saved"])
def test_jax_caches_do_not_grow_over_construct_call_drop_cycles(kw):
    params = _params()
    _cycle(params, **kw)                 # jax's strong-keyed caches (shapes, shardings) fill once
    gc.collect()
    before = tracing_cache_entries()
    for _ in range(4):
        _cycle(params, **kw)
    gc.collect()
    assert tracing_cache_entries() == before


def test_a_runtime_traces_its_own_wrappers_of_the_stage_functions():
    params = _params()
    other = lambda p, h: layer(p, h)  # noqa: E731
    rt = StreamingRuntime([layer, other, layer], params, RuntimeConfig(prefetch_depth=1))
    assert rt._fns == [layer, other, layer]                 # the caller's functions, as given
    w = rt._traced_fns
    assert w[0] is w[2] and w[0] is not w[1] and w[0] is not layer and w[0].__wrapped__ is layer
    assert w[0].__qualname__ == layer.__qualname__
    y = rt.forward(X)
    ref = X
    for p in params:
        ref = layer(p, ref)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-6, atol=1e-6)
    assert rt.num_executables == 2                          # one per distinct function, as before
    assert StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=1))._traced_fns[0] is not w[0]  # per runtime


def test_loss_cache_stays_bounded_over_fresh_closures():
    rt = StreamingRuntime(layer, _params(2), RuntimeConfig(prefetch_depth=1))
    with pytest.warns(UserWarning, match="distinct loss_fn"):
        for s in range(MAX_LOSS_FNS + 3):
            rt.train_step(X, lambda o, s=s: jnp.mean(o ** 2) * (1 + s))
    assert len(rt._loss_jits) == MAX_LOSS_FNS and len(rt._loss_shapes) <= 4 * MAX_LOSS_FNS
