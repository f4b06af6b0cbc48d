"""``StreamingRuntime(stage_fn, stage_params, config, *, placement, ...)``: the settings come in one frozen
``RuntimeConfig`` (its ``num_stages`` filled in from ``stage_params``) and one frozen ``Placement``, each
checked once when it is made; a wrong type or a conflicting number of stages is refused naming the argument,
before the runtime holds anything."""
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from streaming_cases import layer, loss_fn, make_input, make_params, mono_forward, stacked
from xla_swap.executors import Placement, RuntimeConfig, StreamingRuntime
from xla_swap.executors.streaming.config import config_from_policy
from xla_swap.planning import OffloadPolicy


def test_runtime_config_with_no_argument_is_the_default_of_every_setting():
    c = RuntimeConfig()
    assert (c.num_stages, c.prefetch_depth, c.resident, c.remat, c.offload_activations, c.grads_to_host,
            c.optimizer_state_on_host, c.donate, c.throttle, c.track_residency, c.prefetch_next_call,
            c.max_signatures, c.max_grad_norm, c.skip_nonfinite) == \
        (None, 1, None, True, False, True, True, True, True, True, True, 8, None, False)
    rt = StreamingRuntime(layer, make_params(n=3))
    assert rt.config == c.replace(num_stages=3, resident=(False, False, False))
    with pytest.raises(TypeError):
        RuntimeConfig(3)      # by keyword only: a positional 3 is not a silent prefetch depth or stage count


def test_the_runtime_fills_in_num_stages_and_checks_resident_against_it():
    x = make_input()
    params = make_params(n=4)
    config = RuntimeConfig(prefetch_depth=2, resident=[False, True, False, True])
    rt = StreamingRuntime(layer, params, config)
    assert rt.config.num_stages == 4 and rt.resident == (False, True, False, True) and config.num_stages is None
    np.testing.assert_allclose(np.asarray(rt.forward(x)), np.asarray(mono_forward(stacked(params), x)), rtol=1e-5)
    assert StreamingRuntime(layer, params, config.replace(num_stages=4)).config == rt.config
    with pytest.raises(ValueError, match="resident must be a sequence of 3 bools"):
        StreamingRuntime(layer, make_params(n=3), config)


def test_a_config_for_another_number_of_stages_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"config.num_stages=3 but stage_params has 4 stages"):
        StreamingRuntime(layer, make_params(n=4), RuntimeConfig(num_stages=3))
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        RuntimeConfig(num_stages=0)
    with pytest.raises(TypeError, match="num_stages must be an int"):
        RuntimeConfig(num_stages=2.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"config": "x"}, "config must be an xla_swap.executors.RuntimeConfig or None, got str"),
    ({"config": {"prefetch_depth": 2}}, "config must be .*got dict"),
    ({"placement": jax.devices()[0]}, "placement must be an xla_swap.executors.Placement or None"),
    ({"placement": RuntimeConfig()}, "placement must be .*got RuntimeConfig"),
    ({"config": Placement()}, "config must be .*got Placement"),
])
def test_a_wrong_type_of_config_or_placement_is_a_type_error_naming_it(kwargs, match):
    with pytest.raises(TypeError, match=match):
        StreamingRuntime(layer, make_params(n=2), **kwargs)


def test_placement_is_checked_once_when_made_as_the_runtime_checked_its_keywords():
    dev = jax.devices()[0]
    with pytest.raises(ValueError, match="give either device or sharding, not both"):
        Placement(device=dev, sharding=SingleDeviceSharding(dev))
    for kwargs, name in [({"device": "cpu:0"}, "device"), ({"sharding": 3}, "sharding"),
                         ({"activation_sharding": "x"}, "activation_sharding"), ({"batch_axis": 0}, "batch_axis")]:
        with pytest.raises(TypeError, match=f"{name} must be"):
            Placement(**kwargs)
    p = Placement(device=dev)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.device = None
    with pytest.raises(ValueError, match="activation_sharding is required"):   # what needs the stages: at build
        StreamingRuntime(layer, make_params(n=2), placement=Placement(sharding=lambda i, path, leaf:
                                                                      SingleDeviceSharding(dev)))


def test_a_placed_runtime_equals_the_default_one():
    """``Placement(device=jax.devices()[0])`` is the default placement: the same loss and gradients."""
    params, x = make_params(n=3), make_input()
    a = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2), placement=Placement(device=jax.devices()[0]))
    b = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2))
    la, ga, pa = a.train_step(x, loss_fn)
    lb, gb, pb = b.train_step(x, loss_fn)
    for u, v in zip(jax.tree_util.tree_leaves((la, ga, pa)), jax.tree_util.tree_leaves((lb, gb, pb))):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_from_policy_sets_the_policy_fields_and_keeps_the_configs_others():
    params = make_params(n=3)
    policy = OffloadPolicy(params="device", prefetch_depth=2, grads="device", remat=False)
    others = RuntimeConfig(track_residency=False, max_signatures=2)
    rt = StreamingRuntime.from_policy(layer, params, policy, others)
    assert (rt.resident, rt.prefetch_depth, rt.grads_to_host, rt.remat, rt.track_residency, rt.max_signatures) == \
        ((True, True, True), 2, False, False, False, 2)
    assert config_from_policy(policy, 3, others).for_stages(3) == rt.config
    with pytest.raises(ValueError, match="prefetch_depth, remat: decided by the policy"):
        StreamingRuntime.from_policy(layer, params, policy, RuntimeConfig(prefetch_depth=3, remat=False))
    with pytest.raises(TypeError, match="config must be"):
        StreamingRuntime.from_policy(layer, params, policy, {"track_residency": False})


def test_reconfigured_takes_a_config_for_the_same_stages():
    params, x = make_params(n=3), make_input()
    rt = StreamingRuntime(layer, params, RuntimeConfig(track_residency=False))
    again = rt.reconfigured(RuntimeConfig(prefetch_depth=2), remat=False)
    assert (again.num_stages, again.prefetch_depth, again.remat, again.track_residency) == (3, 2, False, True)
    np.testing.assert_array_equal(np.asarray(again.forward(x)), np.asarray(rt.forward(x)))
    with pytest.raises(ValueError, match="config.num_stages=4 but stage_params has 3 stages"):
        rt.reconfigured(RuntimeConfig(num_stages=4))
    with pytest.raises(TypeError, match="config must be"):
        rt.reconfigured({"prefetch_depth": 2})


def test_the_executors_offer_the_two_configs():
    """``RuntimeConfig`` and ``Placement`` are public names of ``xla_swap.executors`` and of its ``streaming``
    package, the defining modules' objects; ``xla_swap`` itself stays without them."""
    import importlib

    import xla_swap
    from xla_swap import executors
    from xla_swap.executors.streaming import config, placement
    streaming = importlib.import_module("xla_swap.executors.streaming")
    for mod in (executors, streaming):
        assert {"RuntimeConfig", "Placement"} <= set(mod.__all__)
        assert mod.RuntimeConfig is config.RuntimeConfig and mod.Placement is placement.Placement
    assert "RuntimeConfig" not in dir(xla_swap) and "Placement" not in dir(xla_swap)
