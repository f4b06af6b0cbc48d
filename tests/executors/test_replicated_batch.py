"""A data-parallel ``StreamingRuntime`` (``batch_axis``) given an input whose leading dimension does not
split over the devices: that signature runs replicated, exact (values, input cotangent, gradients and
AdamW updates equal the one-device runtime's), with each stage's weights gathered so that the
partitioner never splits the computation along a weight (no all-reduce or reduce-scatter in any stage
executable, only weight all-gathers), without keeping the gathered weights as saved residuals, and with
the loss arguments laid out like the output; a splitting input in the same runtime stays split.
numpy + jax only."""
import re
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from streaming_cases import D, F, L, check_close, layer, make_input
from xla_swap.executors import Placement, RuntimeConfig, StreamingRuntime

pytestmark = pytest.mark.spmd


def _runtimes(num_devices, params, optimizer=None, **kw):
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("x",))
    ref = StreamingRuntime(layer, params, RuntimeConfig(**kw), placement=Placement(device=jax.devices()[0]),
                           optimizer=optimizer)
    rt = StreamingRuntime(layer, params, RuntimeConfig(**kw), optimizer=optimizer, placement=Placement(
        sharding=NamedSharding(mesh, P("x", None)), activation_sharding=NamedSharding(mesh, P()), batch_axis="x"))
    return ref, rt


def _collectives(exe) -> set:
    return set(re.findall(r"= \S+ (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\(",
                          exe.as_text()))


def _loss(out, target):
    return jax.numpy.sum(jax.numpy.sin(out) * target)


@pytest.mark.parametrize("remat,opt", [(True, False), (False, False), (False, True)])
def test_unsplit_batch_runs_replicated_and_exact(num_devices, params, remat, opt):
    from xla_swap.planning import AdamW
    if num_devices == 1:
        pytest.skip("needs several devices")
    kw = dict(prefetch_depth=2, remat=remat)
    if opt:
        kw["optimizer"] = AdamW(lr=1e-2)
    ref, rt = _runtimes(num_devices, params, **kw)
    x = make_input(t=num_devices + 1)          # splits over no device count > 1
    target = np.cos(x)
    assert rt.runs_replicated(jax.ShapeDtypeStruct(x.shape, x.dtype))
    with pytest.warns(UserWarning, match=f"leading dimension \\({num_devices + 1},\\).*runs replicated"):
        y = rt.forward(x)
    assert y.sharding.is_fully_replicated and len(y.sharding.device_set) == num_devices
    check_close(y, ref.forward(x), rtol=1e-5, atol=1e-5)
    for _ in range(2 if opt else 1):
        loss, gx, grads = rt.train_step(x, _loss, loss_args=(target,))
        rloss, rgx, rgrads = ref.train_step(x, _loss, loss_args=(target,))
        check_close(loss, rloss, rtol=1e-5)
        assert gx.sharding.is_fully_replicated
        check_close(gx, rgx, rtol=1e-5, atol=1e-5)
    if opt:
        for i in (0, L - 1):
            check_close(rt.host_params[i]["b"], ref.host_params[i]["b"], rtol=1e-5, atol=1e-6)
            assert rt.host_params[i]["b"].sharding.spec == P("x", None)   # stored sharded as before
    else:
        assert grads[3]["a"].sharding.spec == P("x", None)
        check_close(grads[3]["a"], rgrads[3]["a"], rtol=1e-5, atol=1e-5)
    sig = rt.signature(x)
    assert sig.replicated
    kinds = ["forward-save" if remat is False else "forward", "backward-saved" if remat is False else "backward"]
    for kind in kinds:
        for i in range(L):
            assert _collectives(rt.stage_executable(sig, kind, i)) == {"all-gather"}, (kind, i)
    if remat is False:   # about the residuals one device keeps, not the gathered weights as well
        assert all(abs(r - q) < D * F * 4 for r, q in zip(rt.residual_nbytes, ref.residual_nbytes)), \
            (rt.residual_nbytes, ref.residual_nbytes)
    # the loss arguments go where the output is: replicated here
    t_aval = jax.ShapeDtypeStruct(target.shape, target.dtype)
    assert rt.loss_args_sharding_of(sig.in_aval, (t_aval,))[0].is_equivalent_to(y.sharding, 2)


def test_split_and_unsplit_signatures_side_by_side(num_devices, params):
    if num_devices == 1:
        pytest.skip("needs several devices")
    ref, rt = _runtimes(num_devices, params, prefetch_depth=1)
    split, odd = make_input(t=2 * num_devices), make_input(t=2 * num_devices + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a splitting batch gives no warning
        y = rt.forward(split)
    assert y.sharding.spec == P("x")
    with pytest.warns(UserWarning, match="runs replicated"):
        y_odd = rt.forward(odd)
    assert y_odd.sharding.is_fully_replicated
    check_close(y, ref.forward(split), rtol=1e-5, atol=1e-5)
    check_close(y_odd, ref.forward(odd), rtol=1e-5, atol=1e-5)
    s_split, s_odd = rt.signature(split), rt.signature(odd)
    assert not s_split.replicated and s_odd.replicated
    a_split = jax.ShapeDtypeStruct(split.shape, split.dtype)
    assert rt.input_sharding_of(a_split).spec == P("x")
    assert rt.loss_args_sharding_of(a_split, (a_split,))[0].spec == P("x")
    # a target whose own leading dimension splits is still replicated beside a replicated output
    assert rt.loss_args_sharding_of(s_odd.in_aval, (jax.ShapeDtypeStruct((num_devices, D), np.float32),))[0] \
        .is_fully_replicated
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # once per signature
        rt.forward(odd)


def test_one_device_and_no_batch_axis_never_replicate(params):
    rt = StreamingRuntime(layer, params[:2], placement=Placement(device=jax.devices()[-1]))
    a = jax.ShapeDtypeStruct((3, D), np.float32)
    assert not rt.runs_replicated(a)
    assert rt.input_sharding_of(a) == rt.loss_args_sharding_of(a, (a,))[0] == rt.activation_sharding
    assert rt.activation_sharding.device_set == {jax.devices()[-1]}
