"""Fresh optimizer moments are made where they live: zeros in device memory are made on the device, zeros in
``pinned_host`` as the output of a program (neither copies a host array); the runtime's state is that."""
import jax
import numpy as np
import pytest

from streaming_cases import layer, make_params
from xla_swap.executors import RuntimeConfig, StreamingRuntime
from xla_swap.executors.streaming.placement import zeros_where_they_live
from xla_swap.planning import AdamW


def _shardings(kind):
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


@pytest.mark.parametrize("kind", ["device", "pinned_host"])
def test_zeros_move_nothing_from_the_host(kind):
    zeros = [(np.zeros((4, 8), np.float32), np.zeros((4, 8), np.float32)), (np.zeros((3,), np.int8),) * 2]
    sh = _shardings(kind)
    with jax.transfer_guard_host_to_device("disallow_explicit"):   # a host copy would raise here
        out = zeros_where_they_live(zeros, [(sh, sh), (sh, sh)])
    for got, want in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(zeros)):
        assert got.sharding.memory_kind == kind and got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), want)
    with jax.transfer_guard_host_to_device("disallow_explicit"), pytest.raises(Exception, match="[Dd]isallowed"):
        jax.device_put(zeros[0][0], sh)                   # the guard catches a copy from the host


@pytest.mark.parametrize("on_host", [False, True])
def test_runtime_moments_start_at_zero_where_they_live(on_host):
    params = make_params(3)
    rt = StreamingRuntime(layer, params, RuntimeConfig(optimizer_state_on_host=on_host, resident=[False, True, False]),
                          optimizer=AdamW(lr=1e-2))
    for i, state in enumerate(rt.optimizer_state):
        kind = "pinned_host" if on_host and i != 1 else "device"
        for leaf in jax.tree_util.tree_leaves(state):
            assert leaf.sharding.memory_kind == kind
            assert not np.any(np.asarray(jax.device_put(leaf, _shardings("device"))))
