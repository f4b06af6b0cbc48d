"""The settings of a ``StreamingRuntime`` are one frozen ``RuntimeConfig``, checked once at construction:
the runtime's attributes read it, nothing rewrites it, and a setting given at construction
(``max_grad_norm``) acts on every step as the per-call keyword does on one. Backward modes and
executable cache keys are typed (``BackwardMode``, ``ExeKey``, ``StageKey``)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streaming_cases import layer, loss_fn, make_input, make_params
from xla_swap.executors import StreamingRuntime
from xla_swap.executors.streaming.compilation import ExeKey, StageKey
from xla_swap.executors.streaming.config import BackwardMode, RuntimeConfig
from xla_swap.executors.streaming.stateful_streamer import StatefulStreamer
from xla_swap.planning import AdamW


def test_the_runtime_reads_its_settings_from_one_frozen_config():
    params = make_params(n=3)
    rt = StreamingRuntime(layer, params,
                          RuntimeConfig(prefetch_depth=2, remat=False, resident=[False, True, False],
                                        offload_activations=True, max_signatures=3))
    c = rt.config
    assert isinstance(c, RuntimeConfig)
    assert (c.num_stages, c.prefetch_depth, c.resident, c.remat, c.offload_activations, c.max_signatures) == \
        (3, 2, (False, True, False), False, True, 3)
    for name in ("num_stages", "prefetch_depth", "resident", "remat", "offload_activations", "max_signatures",
                 "donate", "throttle", "track_residency", "grads_to_host", "optimizer_state_on_host",
                 "prefetch_next_call", "max_grad_norm", "skip_nonfinite"):
        assert getattr(rt, name) == getattr(c, name), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.prefetch_depth = 1
    with pytest.raises(AttributeError, match="prefetch_depth"):
        rt.prefetch_depth = 1
    assert rt.schedule(True).prefetch_depth == 2 and rt.config is c


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"prefetch_depth": 0}, ValueError, "prefetch_depth must be >= 1"),
    ({"prefetch_depth": 1.5}, TypeError, "prefetch_depth must be an int"),
    ({"prefetch_depth": True}, TypeError, "prefetch_depth must be an int"),
    ({"resident": [True]}, ValueError, "resident must be a sequence of 3 bools"),
    ({"max_signatures": 0}, ValueError, "max_signatures must be an int >= 1"),
    ({"max_grad_norm": float("nan")}, ValueError, "max_grad_norm must be a finite number > 0"),
    ({"donate": 1}, TypeError, "donate must be a bool"),
    ({"skip_nonfinite": 1}, TypeError, "skip_nonfinite must be a bool"),
    ({"remat": "yes"}, TypeError, "remat must be a bool"),
])
def test_the_config_checks_every_setting_once(kwargs, exc, match):
    """The config refuses a bad setting with the message the runtime gives: the runtime's check is this one."""
    with pytest.raises(exc, match=match):
        RuntimeConfig(num_stages=3, **kwargs)
    with pytest.raises(exc, match=match):
        StreamingRuntime(layer, make_params(n=3), RuntimeConfig(**kwargs), optimizer=AdamW(lr=1e-2))


@pytest.mark.parametrize("depth, exc", [(0, ValueError), (1.5, TypeError)])
def test_the_decode_streamer_checks_prefetch_depth_as_the_runtime_does(depth, exc):
    rt = StreamingRuntime(layer, make_params(n=2))
    with pytest.raises(exc) as streamer_err:
        StatefulStreamer([layer] * 2, rt.host_params, rt.device_shardings, state_avals=[None, None],
                         activation_sharding=rt.activation_sharding, prefetch_depth=depth)
    with pytest.raises(exc) as config_err:
        RuntimeConfig(num_stages=2, prefetch_depth=depth)
    assert str(streamer_err.value) == str(config_err.value)


def test_max_grad_norm_given_at_construction_clips_every_update():
    """A runtime built with ``max_grad_norm`` updates as one given it per step (same weights, moments and
    norm, to the bit), and the clip acts: the weights differ from an unclipped runtime's."""
    params, x = make_params(n=3), make_input()
    built = StreamingRuntime(layer, params, RuntimeConfig(max_grad_norm=0.05), optimizer=AdamW(lr=1e-2))
    per_step = StreamingRuntime(layer, params, optimizer=AdamW(lr=1e-2))
    unclipped = StreamingRuntime(layer, params, optimizer=AdamW(lr=1e-2))
    for _ in range(2):
        built.train_step(x, loss_fn)
        per_step.train_step(x, loss_fn, max_grad_norm=0.05)
        unclipped.train_step(x, loss_fn)
        assert built.last_grad_norm == per_step.last_grad_norm > 0.05
        assert built.last_schedule.update_pass and unclipped.last_grad_norm is None
    assert built.step == per_step.step == 2
    for a, b, c in zip(jax.tree_util.tree_leaves(built.host_params + built.optimizer_state),
                       jax.tree_util.tree_leaves(per_step.host_params + per_step.optimizer_state),
                       jax.tree_util.tree_leaves(unclipped.host_params + unclipped.optimizer_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(c))
               for a, c in zip(jax.tree_util.tree_leaves(built.host_params),
                               jax.tree_util.tree_leaves(unclipped.host_params)))


@pytest.mark.parametrize("setting", [{"max_grad_norm": 1.0}, {"skip_nonfinite": True}])
def test_the_norm_settings_at_construction_need_an_optimizer(setting):
    with pytest.raises(ValueError, match="max_grad_norm and skip_nonfinite need an optimizer"):
        StreamingRuntime(layer, make_params(n=2), RuntimeConfig(**setting))


def test_skip_nonfinite_given_at_construction_skips_every_nonfinite_update():
    """A runtime built with ``skip_nonfinite`` skips an update of nan gradients as a step given it does (weights,
    moments and step unchanged), runs the update pass on finite ones, and a step's ``False`` overrides it."""
    params, x = make_params(n=3), make_input()
    nan_loss = lambda out: jnp.sum(out) * jnp.nan   # noqa: E731 - every gradient nan
    built = StreamingRuntime(layer, params, RuntimeConfig(skip_nonfinite=True), optimizer=AdamW(lr=1e-2))
    assert built.config.needs_norm and built.skip_nonfinite
    before = [np.asarray(a) for a in jax.tree_util.tree_leaves(built.host_params + built.optimizer_state)]
    built.train_step(x, nan_loss)
    assert built.last_step_skipped and built.step == 0 and not np.isfinite(built.last_grad_norm)
    for a, b in zip(before, jax.tree_util.tree_leaves(built.host_params + built.optimizer_state)):
        np.testing.assert_array_equal(a, np.asarray(b))
    built.train_step(x, loss_fn)
    assert not built.last_step_skipped and built.step == 1 and built.last_schedule.update_pass
    built.train_step(x, loss_fn, skip_nonfinite=False)   # the step's own value: the fused update, no norm
    assert built.step == 2 and not built.last_schedule.update_pass


def test_modes_and_cache_keys_are_typed():
    """``ExeKey`` names an executable as ``executable_memory`` reports it; the cache holds ``(StageKey,
    ExeKey)`` pairs, one per distinct executable."""
    assert ExeKey("backward", BackwardMode.ACCUM, True, True).label == "backward-accum+acc-donate"
    assert ExeKey("backward", BackwardMode.UPDATE).label == "backward" == ExeKey("backward").label
    assert ExeKey("forward") == ExeKey("forward") and len({ExeKey("forward"), ExeKey("forward", donate=True)}) == 2
    rt = StreamingRuntime(layer, make_params(n=3), optimizer=AdamW(lr=1e-2))
    rt.train_step(make_input(), loss_fn, accumulate=True)
    sig = rt.signature(make_input())
    keys = list(sig.compiled)
    assert all(isinstance(s, StageKey) and isinstance(e, ExeKey) for s, e in keys)
    assert {e.label for _, e in keys} == {m["kind"] for m in rt.executable_memory()}
    assert {e.mode for _, e in keys if e.kind.startswith("backward")} == {BackwardMode.ACCUM}


def test_the_decode_streamer_keeps_its_executables_as_the_runtime_does():
    """``StatefulStreamer`` keeps its executables in a ``SignatureCache``, as the runtime's compiler does:
    stages of one function share an executable, and a signature dropped beyond ``max_signatures`` takes its
    executables with it (the cache stays bounded); a signature traced again compiles again, with the
    same results."""
    from xla_swap.executors.streaming.signatures import SignatureCache
    rt = StreamingRuntime(layer, make_params(n=3), RuntimeConfig(max_signatures=1))
    st = StatefulStreamer([layer] * 3, rt.host_params, rt.device_shardings, state_avals=[None] * 3,
                          activation_sharding=rt.activation_sharding, max_signatures=1)
    assert isinstance(rt.compiler.cache, SignatureCache)
    x1, x2 = make_input(t=4), make_input(t=6)
    want1 = rt.forward(x1)
    np.testing.assert_array_equal(np.asarray(st.run(x1)), np.asarray(want1))
    assert st.num_executables == rt.num_executables == 1
    first = st.executables(x1)[0]
    np.testing.assert_array_equal(np.asarray(st.run(x2)), np.asarray(rt.forward(x2)))
    assert st.num_executables == rt.num_executables == 1            # x1's signature and executable dropped
    assert st.executables(x1)[0] is not first
    np.testing.assert_array_equal(np.asarray(st.run(x1)), np.asarray(want1))


def test_the_runtime_surface_is_its_parts_and_keeps_their_docstrings():
    """Every public method and property the runtime takes from a part reads that part's attribute and
    carries its docstring; a read-only one refuses assignment, ``step`` and ``param_groups`` write through."""
    from xla_swap.executors.streaming.forwarding import Forwarded
    rt = StreamingRuntime(layer, make_params(n=2), optimizer=AdamW(lr=1e-2))
    methods = ["schedule", "signature", "stage_executable", "clear_executables", "load_stage", "trainable_paths",
               "memory_report", "executable_memory", "executable_hlo", "layer_cost", "stage_cost_bytes",
               "stage_input_nbytes", "resident_stages", "reset_stats", "activation_sharding_of", "runs_replicated",
               "input_sharding_of", "loss_args_sharding_of", "num_executables", "num_signatures", "stage_fns",
               "stage_fn_ids"]
    for name in methods:
        fwd = vars(StreamingRuntime)[name]
        assert isinstance(fwd, Forwarded) and len(fwd.__doc__ or "") > 40, name
        assert getattr(rt, name) == getattr(getattr(rt, fwd.component), fwd.attr), name
    rt.step = 7
    groups = [AdamW(lr=3e-3)]
    rt.param_groups = groups
    assert rt.steps.step == 7 and rt.steps.param_groups is groups
    with pytest.raises(AttributeError, match="host_params"):
        rt.host_params = []


def test_reconfigured_is_the_same_stages_under_another_config():
    """``reconfigured(**settings)``: the config with those settings changed, the same weights, moments and
    step count placed where the new config keeps them, and training goes on as on the runtime it came from."""
    params, x = make_params(n=3), make_input()
    rt = StreamingRuntime(layer, params, RuntimeConfig(max_grad_norm=10.0), optimizer=AdamW(lr=1e-2))
    rt.train_step(x, loss_fn)
    new = rt.reconfigured(prefetch_depth=2, resident=[True, False, False], optimizer_state_on_host=False)
    assert new.config == rt.config.replace(prefetch_depth=2, resident=(True, False, False),
                                           optimizer_state_on_host=False)
    assert new.step == rt.step == 1 and new.max_grad_norm == 10.0 and new.stage_fns == rt.stage_fns
    assert new.host_params[0]["a"].sharding.memory_kind == "device"
    assert new.host_params[1]["a"].sharding.memory_kind == "pinned_host"
    assert {m.sharding.memory_kind for pair in new.optimizer_state[1] for m in pair} == {"device"}
    for a, b in zip(jax.tree_util.tree_leaves(rt.host_params + rt.optimizer_state),
                    jax.tree_util.tree_leaves(new.host_params + new.optimizer_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for r in (rt, new):
        r.train_step(x, loss_fn)
    assert new.step == rt.step == 2 and new.last_grad_norm == rt.last_grad_norm
    for a, b in zip(jax.tree_util.tree_leaves(rt.host_params + rt.optimizer_state),
                    jax.tree_util.tree_leaves(new.host_params + new.optimizer_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_reconfigured_refuses_before_building():
    rt = StreamingRuntime(layer, make_params(n=2), optimizer=AdamW(lr=1e-2))
    with pytest.raises(TypeError, match="num_stages"):
        rt.reconfigured(num_stages=3)
    with pytest.raises(TypeError, match="sideways"):
        rt.reconfigured(sideways=True)
    with pytest.raises(ValueError, match="prefetch_depth"):
        rt.reconfigured(prefetch_depth=0)
    with pytest.raises(TypeError, match="own_params"):
        rt.reconfigured(own_params=1)
    rt.train_step(make_input(), loss_fn, accumulate=True)
    with pytest.raises(ValueError, match="accumulated micro-batches"):
        rt.reconfigured(prefetch_depth=2)
