"""``ensure_host_memory_limit``: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB set from the bytes a plan needs
before the backend starts, an error naming it after (injected environment and start-up state)."""
import pytest

from xla_swap.executors.host_pool import HOST_MEMORY_LIMIT_ENV, HOST_MEMORY_PREALLOCATE_ENV, ensure_host_memory_limit

GIB = 1 << 30


def test_sets_the_pool_before_the_backend_starts():
    env = {}
    # 83 GB of bf16 weights (the 70B-shaped model) with 10 % headroom: 86 GiB
    assert ensure_host_memory_limit(83 * 10 ** 9, environ=env, initialized=lambda: False) == 86
    assert env[HOST_MEMORY_LIMIT_ENV] == "86"
    # enough already (the default 64 GiB, or a larger value set): unchanged
    env = {}
    assert ensure_host_memory_limit(10 * GIB, environ=env, initialized=lambda: True) == 64
    assert env == {}
    env = {HOST_MEMORY_LIMIT_ENV: "120"}
    assert ensure_host_memory_limit(100 * GIB, environ=env, initialized=lambda: True) == 120
    assert env[HOST_MEMORY_LIMIT_ENV] == "120"
    env = {HOST_MEMORY_LIMIT_ENV: "8"}
    assert ensure_host_memory_limit(9 * GIB, headroom=1.0, environ=env, initialized=lambda: False) == 9


def test_too_late_names_the_variable():
    env = {HOST_MEMORY_LIMIT_ENV: "64"}
    with pytest.raises(RuntimeError, match=rf"{HOST_MEMORY_LIMIT_ENV}=86 before jax starts"):
        ensure_host_memory_limit(83 * 10 ** 9, environ=env, initialized=lambda: True)
    assert env == {HOST_MEMORY_LIMIT_ENV: "64"}


def test_bad_input():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="nbytes"):
            ensure_host_memory_limit(bad, environ={}, initialized=lambda: False)
    with pytest.raises(ValueError, match="headroom"):
        ensure_host_memory_limit(1, headroom=0.5, environ={}, initialized=lambda: False)
    with pytest.raises(ValueError, match=HOST_MEMORY_LIMIT_ENV):
        ensure_host_memory_limit(1, environ={HOST_MEMORY_LIMIT_ENV: "lots"}, initialized=lambda: False)
    with pytest.raises(ValueError, match="preallocate"):
        ensure_host_memory_limit(1, preallocate="yes", environ={}, initialized=lambda: False)
    env = {HOST_MEMORY_PREALLOCATE_ENV: "sometimes"}
    with pytest.raises(ValueError, match=HOST_MEMORY_PREALLOCATE_ENV):
        ensure_host_memory_limit(1, preallocate=True, environ=env, initialized=lambda: False)
    assert env == {HOST_MEMORY_PREALLOCATE_ENV: "sometimes"}


def test_preallocate_pins_the_pool_needed_not_the_default():
    # one torchrun rank's share of an 8B-like 4-layer model's weights and moments: 1.70 GB x 2 -> 4 GiB
    env = {}
    assert ensure_host_memory_limit(1_701_894_528, headroom=2.0, preallocate=True, environ=env,
                                    initialized=lambda: False) == 4
    assert env == {HOST_MEMORY_LIMIT_ENV: "4", HOST_MEMORY_PREALLOCATE_ENV: "true"}
    # a limit the user set that holds the need stays (they chose what to pin); the pool is pinned at start
    env = {HOST_MEMORY_LIMIT_ENV: "16"}
    assert ensure_host_memory_limit(GIB, preallocate=True, environ=env, initialized=lambda: False) == 16
    assert env == {HOST_MEMORY_LIMIT_ENV: "16", HOST_MEMORY_PREALLOCATE_ENV: "true"}
    # without preallocate, the variable is never written
    env = {}
    ensure_host_memory_limit(GIB, environ=env, initialized=lambda: False)
    assert HOST_MEMORY_PREALLOCATE_ENV not in env


def test_preallocate_after_the_backend_started_names_the_variable():
    env = {HOST_MEMORY_LIMIT_ENV: "16"}
    with pytest.raises(RuntimeError, match=rf"{HOST_MEMORY_PREALLOCATE_ENV}=true before jax starts"):
        ensure_host_memory_limit(GIB, preallocate=True, environ=env, initialized=lambda: True)
    assert env == {HOST_MEMORY_LIMIT_ENV: "16"}
    # already pinned at start, with room: nothing to do
    for flag in ("true", "1", "TRUE"):
        env = {HOST_MEMORY_LIMIT_ENV: "16", HOST_MEMORY_PREALLOCATE_ENV: flag}
        assert ensure_host_memory_limit(GIB, preallocate=True, environ=env, initialized=lambda: True) == 16
    # pinned at start but too small: the limit is what to raise
    env = {HOST_MEMORY_LIMIT_ENV: "2", HOST_MEMORY_PREALLOCATE_ENV: "true"}
    with pytest.raises(RuntimeError, match=rf"{HOST_MEMORY_LIMIT_ENV}=4 before jax starts"):
        ensure_host_memory_limit(4 * GIB, headroom=1.0, preallocate=True, environ=env, initialized=lambda: True)

