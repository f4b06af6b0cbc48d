"""``SwappedStack.train_step``'s cache of converted losses, keyed by ``xla_swap.stack.training.loss_key``:
a loss lambda recreated each step compiles once, and losses that compute different things never
share a compiled loss. Backend compiles are counted with jax's monitoring events; losses, gradients
and updates are compared with torch."""
import collections
import copy

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llama_cases import V, batches, ce, make_model, rel
from xla_swap.executors.compile_cache import use_compilation_cache
from xla_swap.stack import SwappedStack, causal_lm_stages
from xla_swap.stack.config import TrainingConfig
from xla_swap.stack.training import loss_key

COMPILE = "/jax/core/compile/backend_compile_duration"
SCALE = 1.0   # a global a loss reads (rebound by a test)


@pytest.fixture
def compiles():
    """Backend compiles by event name; jax's persistent cache off meanwhile (a hit compiles nothing)."""
    seen = collections.Counter()

    def listener(name, duration, **kw):
        seen[name] += 1
    min_s = jax.config.jax_persistent_cache_min_compile_time_secs   # the suite's, restored as it was
    prev = use_compilation_cache(None, min_compile_time_s=min_s)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        use_compilation_cache(prev, min_compile_time_s=min_s)
        assert (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs) == \
            (prev, min_s)


def scaled(scale):
    """A new loss function object at each call, closing over ``scale``."""
    return lambda logits, labels: scale * F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def train(loss_for_step, compiles, steps=4):
    """AdamW steps through the stack with ``loss_for_step(i)``, each equal to torch's; backend compiles per step."""
    ref = make_model(layers=2, seed=5)
    model = copy.deepcopy(ref)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    per_step = []
    for i, (x, y) in enumerate(batches(steps, seed=6)):
        before = compiles[COMPILE]
        loss = stack.train_step(x, y, loss_fn=loss_for_step(i))
        per_step.append(compiles[COMPILE] - before)
        ref_loss = ce(ref(x).logits, y)
        opt_ref.zero_grad()
        ref_loss.backward()
        opt_ref.step()
        assert abs(float(loss) - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), i
    stack.sync_modules()
    assert max(rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())) <= 1e-4
    return per_step


def test_a_loss_lambda_recreated_each_step_compiles_once(compiles):
    fixed = scaled(1.0)
    once = train(lambda i: fixed, compiles)
    assert once[0] > 0 and once[1:] == [0] * 3
    assert train(lambda i: scaled(1.0), compiles) == once                # a new closure object every step
    assert train(lambda i: lambda o, t: F.cross_entropy(o.reshape(-1, V), t.reshape(-1)), compiles) == once
    assert train(lambda i: lambda o, t: SCALE * ce(o, t), compiles) == once   # reads a global and a helper


def test_losses_computing_different_things_do_not_share_a_compiled_loss(compiles):
    global SCALE
    model = make_model(layers=2, seed=7)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last,
                         training=TrainingConfig(accumulate_grads=False))   # no optimizer: weights fixed
    (x, y), = batches(1, seed=8)
    with torch.no_grad():
        want = float(ce(model(x).logits, y))

    def step(loss_fn):
        before = compiles[COMPILE]
        loss = float(stack.train_step(x, y, loss_fn=loss_fn))
        grad = np.asarray(stack.last_grads[1]["mlp.up_proj.weight"])
        return loss, grad, compiles[COMPILE] - before

    one, g1, _ = step(scaled(1.0))
    assert one == pytest.approx(want, rel=1e-5)
    for scale in (2.0, -0.5):                 # another closure value: its own compiled loss
        loss, g, n = step(scaled(scale))
        assert n > 0 and loss == pytest.approx(scale * one, rel=1e-6)
        np.testing.assert_allclose(g, scale * g1, rtol=1e-5, atol=1e-7)
        assert step(scaled(1.0))[::2] == (pytest.approx(one, rel=1e-6), 0)   # a new lambda like the first: cached
    SCALE = 3.0                               # a global the loss reads, rebound
    try:
        loss, _, n = step(lambda o, t: SCALE * ce(o, t))
        assert n > 0 and loss == pytest.approx(3.0 * one, rel=1e-6)
    finally:
        SCALE = 1.0
    box = [1.0]                               # a mutable value: never keyed by code, so never stale
    reads_box = lambda: lambda o, t: box[0] * ce(o, t)   # noqa: E731
    assert step(reads_box())[0] == pytest.approx(one, rel=1e-6)
    box[0] = 4.0
    loss, _, n = step(reads_box())
    assert n > 0 and loss == pytest.approx(4.0 * one, rel=1e-6)


def test_loss_key_is_the_code_and_the_values_it_reads():
    assert loss_key(scaled(1.0)) == loss_key(scaled(1.0)) and hash(loss_key(scaled(1.0))) == hash(loss_key(scaled(1.0)))
    assert loss_key(scaled(1.0)) != loss_key(scaled(2.0))
    assert loss_key(scaled(0.0)) != loss_key(scaled(-0.0))            # different results (1 / x)
    assert loss_key(scaled(1)) != loss_key(scaled(1.0)) != loss_key(scaled(True))
    w = torch.ones(3)
    on_tensor = lambda: lambda o, t: (o * w).sum()                   # noqa: E731  (w may change in place)
    assert loss_key(on_tensor()) != loss_key(on_tensor())
    f = on_tensor()
    assert loss_key(f) == loss_key(f)                                 # the same object: the same loss

    class Unhashable:
        __hash__ = None

        def __call__(self, o, t):
            return ce(o, t)
    u = Unhashable()
    assert loss_key(u) == loss_key(u) and loss_key(u) != loss_key(Unhashable())
    m = torch.nn.CrossEntropyLoss()
    assert loss_key(m.forward) == loss_key(m.forward)                 # a bound method: its object and function
