"""Shared cases of the streaming and in-graph executor tests (numpy + jax only).

An ``L``-layer residual MLP stack (``layer``), its weights and input, the monolithic
device-resident reference (``mono_forward``: ``lax.scan`` over the stacked weights) and the
chunked variant of the stack with a pytree carry (``chunk_stages``).
"""
import gc

import jax
import jax.numpy as jnp
import numpy as np

L, D, F, T = 8, 16, 32, 8

#: (L, k, resident) cases of the schedule tests: streamed, k = L, k > L, partial residency, stage k resident.
SCHEDULE_SHAPES = [  # (L, k, resident)
    (4, 1, None),
    (5, 2, None),
    (3, 3, None),                               # k = L
    (2, 4, None),                               # k > L
    (5, 1, (False, True, False, False, True)),  # partial residency
    (4, 2, (False, False, True, False)),        # stage k resident
]


def layer(p, h):
    return h + jax.nn.gelu(h @ p["a"]) @ p["b"]


def make_params(n=L, d=D, f=F, seed=0):
    rng = np.random.default_rng(seed)
    return [{"a": (rng.standard_normal((d, f)) / np.sqrt(d)).astype(np.float32),
             "b": (rng.standard_normal((f, d)) / np.sqrt(f) * 0.5).astype(np.float32)} for _ in range(n)]


def make_input(t=T, d=D, seed=1):
    return np.random.default_rng(seed).standard_normal((t, d)).astype(np.float32)


def stacked(params):
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *params)


@jax.jit
def mono_forward(stack, h):
    """The whole stack as one program: lax.scan over device-resident stacked weights."""
    return jax.lax.scan(lambda c, p: (layer(p, c), None), h, stack)[0]


def mono_loss(stack, h):
    return jnp.sum(jnp.sin(mono_forward(stack, h)))


def loss_fn(out):
    return jnp.sum(jnp.sin(out))


def live_device_arrays():
    gc.collect()
    return sum(1 for a in jax.live_arrays() if a.sharding.memory_kind == "device")


def check_close(actual, desired, rtol=1e-6, atol=1e-6):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(desired), rtol=rtol, atol=atol)


def chunk_stages(params, chunks):
    """Each layer split into ``chunks`` stages over F; carry ``(x, acc)``: ``acc += gelu(x @ a_c) @ b_c``.

    The last chunk of a layer closes it: ``y = acc + ...``, the next carry is ``(y, y)``.
    The chunked stack computes the same function as ``layer`` (up to summation order).
    """
    def partial(p, carry):
        x, acc = carry
        return x, acc + jax.nn.gelu(x @ p["a"]) @ p["b"]

    def closing(p, carry):
        _, y = partial(p, carry)
        return y, y

    fns, stage_params = [], []
    for prm in params:
        fc = prm["a"].shape[1] // chunks
        for c in range(chunks):
            fns.append(closing if c == chunks - 1 else partial)
            stage_params.append({"a": prm["a"][:, c * fc:(c + 1) * fc], "b": prm["b"][c * fc:(c + 1) * fc]})
    return fns, stage_params


def forbid_clock(monkeypatch) -> None:
    """Make every read of the clock, and the calibration's measuring entry points, raise for the
    rest of the test: a choice made after this comes from injected figures alone."""
    import time

    import xla_swap.executors.streaming.calibrate as cal_mod
    from xla_swap.executors import StreamingRuntime

    def refuse(*a, **k):
        raise AssertionError("a chooser test read the clock / measured")

    monkeypatch.setattr(time, "perf_counter", refuse)
    for name in ("calibrate", "measure_link", "_median_time", "_warm_up"):
        monkeypatch.setattr(cal_mod, name, refuse)
    monkeypatch.setattr(StreamingRuntime, "layer_cost", refuse)


def count_runtime_builds(monkeypatch) -> list:
    """Wrap ``StreamingRuntime.__init__`` and ``_adopt`` (where a runtime takes its parts) for the rest of
    the test: every runtime construction from now on (direct, by ``from_policy``, ``reconfigure`` /
    ``reconfigured`` or a ``SwappedStack``) appends the runtime to the returned list once, as it starts
    (a constructor that raises counts too)."""
    from xla_swap.executors import StreamingRuntime

    built = []
    init, adopt = StreamingRuntime.__init__, StreamingRuntime._adopt

    def counting_init(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    def counting_adopt(self, parts):
        if not any(b is self for b in built):
            built.append(self)
        adopt(self, parts)

    monkeypatch.setattr(StreamingRuntime, "__init__", counting_init)
    monkeypatch.setattr(StreamingRuntime, "_adopt", counting_adopt)
    return built
