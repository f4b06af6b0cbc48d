"""``xla_swap.use_compilation_cache``: executables written to the directory and read back after
jax's in-memory caches are dropped (as a new process would), counted by jax's monitoring events;
bad arguments refused before anything changes. jax only (runs in ``make test-jax-only`` too)."""
import collections

import jax
import jax.numpy as jnp
import pytest

from xla_swap.executors.compile_cache import use_compilation_cache


@pytest.fixture
def events():
    seen = collections.Counter()

    def listener(name, **kw):
        seen[name] += 1
    jax.monitoring.register_event_listener(listener)
    yield seen
    jax.monitoring.clear_event_listeners()   # the suite registers no other listener


def test_executables_written_then_read_instead_of_compiled(tmp_path, events):
    prev = use_compilation_cache(tmp_path / "cache", min_compile_time_s=0)
    try:
        def step(x):
            return jnp.tanh(x @ x.T) * 3.0 + jnp.cos(x).sum()
        jax.jit(step)(jnp.ones((32, 32))).block_until_ready()
        assert any((tmp_path / "cache").iterdir())                      # written
        assert events["/jax/compilation_cache/cache_hits"] == 0
        jax.clear_caches()                                               # as a new process: nothing in memory
        jax.jit(step)(jnp.ones((32, 32))).block_until_ready()
        assert events["/jax/compilation_cache/cache_hits"] >= 1          # read from the directory
    finally:
        use_compilation_cache(prev)
    assert jax.config.jax_compilation_cache_dir == prev


@pytest.mark.parametrize("kwargs, err", [({"path": 3}, TypeError), ({"path": "x", "min_compile_time_s": -1}, ValueError),
                                         ({"path": "x", "min_compile_time_s": float("nan")}, ValueError),
                                         ({"path": "x", "min_compile_time_s": True}, TypeError)])
def test_bad_arguments_change_nothing(tmp_path, kwargs, err):
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    with pytest.raises(err):
        use_compilation_cache(**kwargs)
    assert (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs) == before
    assert not (tmp_path / "x").exists()
