"""Where ``SwappedStack`` puts inputs and targets over the devices, on the virtual CPU devices.

* The targets reach the loss executable laid out like the output they meet: split on the batch over the
  data-parallel devices when ``data_parallel`` is on and the batch splits, replicated otherwise (also a
  flattened target whose own length would split); loss and AdamW weights equal torch's.
* A batch smaller than, or not a multiple of, the device count runs replicated: forward values, loss and
  every gradient equal torch's on the CPU, with and without saved residuals; a warning names it.
* The CUDA path's placement, run on the CPU: the sharding a CUDA target or input is laid out to
  (``loss_args_sharding_of`` / ``input_sharding_of``, what ``inputs_to_jax`` asks) equals the one the
  executables get, and ``tensor_to_sharding`` (the pieces a CUDA tensor is cut into, each put on its
  device) builds that array from a torch tensor, each device holding its own rows; a one-device stack on
  another device than the first gets its inputs and targets there.

``test_cuda_inputs_gpu.py`` runs CUDA tensors on two GPUs.
"""
import copy
import functools
import warnings

import jax
import pytest
import torch
from jax.sharding import PartitionSpec as P

from llama_cases import V, ce, make_model, rel
from xla_swap.planning import OffloadPolicy
from xla_swap.stack import SwappedStack, causal_lm_stages
from xla_swap.stack.config import ParallelConfig
from xla_swap.stack.torch_bridge import tensor_pieces, tensor_to_sharding, to_numpy

pytestmark = pytest.mark.spmd


def _batch(b, t=12, seed=0):
    ids = torch.randint(0, V, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _record_loss_calls(rt) -> list:
    """Record ``(output, targets)`` as the runtime hands them to its loss executable."""
    calls, lookup = [], rt._train_loss_exe

    def wrapped(*args, **kw):
        exe = lookup(*args, **kw)

        def call(out, *targets):
            calls.append((out, targets))
            return exe(out, *targets)
        return call
    rt._train_loss_exe = wrapped
    return calls


def _cpu_put(piece, device):
    return jax.device_put(to_numpy(piece), device)


def _splits(stack, b, n):
    return stack.data_parallel and b % n == 0


@pytest.mark.parametrize("data_parallel,b,flat", [(True, 8, False), (True, 8, True), (True, 3, True),
                                                  (False, 8, False), (False, 3, True)])
def test_targets_meet_the_output_sharding(num_devices, data_parallel, b, flat):
    ref = make_model(layers=2, seed=3)
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce,
                         parallel=ParallelConfig(data_parallel=data_parallel),
                         optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3))
    calls = _record_loss_calls(stack.runtime)
    for step in range(2):
        x, y = _batch(b, seed=step)
        target = y.reshape(-1) if flat else y
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = stack.train_step(x, target)
        ref_loss = ce(ref(x).logits, y)
        opt_ref.zero_grad()
        ref_loss.backward()
        opt_ref.step()
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    stack.sync_modules()   # (AdamW's m / sqrt(v) turns float32 rounding of near-zero gradients into lr-sized steps)
    assert max(rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())) <= 1e-3
    out, (t,) = calls[-1]
    assert t.shape == tuple(target.shape) and t.sharding.device_set == out.sharding.device_set
    assert t.sharding.is_equivalent_to(out.sharding, t.ndim)
    if num_devices > 1 and _splits(stack, b, num_devices):
        assert out.sharding.spec == t.sharding.spec == P("d")
    else:
        assert out.sharding.is_fully_replicated and t.sharding.is_fully_replicated
        assert len(out.sharding.device_set) == num_devices
    # the CUDA path's placement of this target (what inputs_to_jax asks), run with CPU pieces
    x_aval = stack.runtime.signature(stack._carry_in((x,))).in_aval
    sh = stack.runtime.loss_args_sharding_of(x_aval, (jax.ShapeDtypeStruct(t.shape, t.dtype),))[0]
    placed = tensor_to_sharding(target.to(torch.int32), sh, _cpu_put)
    assert placed.sharding.is_equivalent_to(t.sharding, t.ndim)
    assert (jax.numpy.asarray(placed) == t).all()
    pieces = tensor_pieces(tuple(target.shape), sh)
    assert len(pieces) == num_devices
    rows = {d: (idx[0].start or 0, target.shape[0] if idx[0].stop is None else idx[0].stop) for d, idx in pieces}
    per = target.shape[0] // num_devices if num_devices > 1 and _splits(stack, b, num_devices) else target.shape[0]
    assert sorted(hi - lo for lo, hi in rows.values()) == [per] * num_devices
    for s in placed.addressable_shards:            # each device holds its own rows, nothing gathered
        assert s.data.shape[0] == per


@pytest.mark.parametrize("b,remat", [(1, True), (3, False)])
def test_unsplit_batch_gives_torch_values_and_grads(num_devices, b, remat):
    ref = make_model(layers=2, seed=5)
    model = copy.deepcopy(ref)
    first, layers, last = causal_lm_stages(model)
    policy = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=remat, prefetch_depth=1)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce, policy=policy)
    x, y = _batch(b, seed=7)
    replicated = stack.data_parallel and b % num_devices != 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = stack.train_step(x, y)
        with torch.no_grad():
            got = stack(x)
    assert any("runs replicated" in str(w.message) for w in caught) == replicated
    assert stack.runtime.signature(stack._carry_in((x,))).replicated == replicated
    ref_loss = ce(ref(x).logits, y)
    ref_loss.backward()
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    with torch.no_grad():
        torch.testing.assert_close(got, ref(x).logits, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, q.grad) <= 1e-4, name


def test_one_device_stack_places_on_its_device():
    """A stack on one device other than the first: inputs and targets are laid out on that device
    (a CUDA tensor on another GPU is copied there), and the loss executable gets them there."""
    dev = jax.devices()[-1]
    model = make_model(layers=2, seed=9)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce, parallel=ParallelConfig(devices=[dev]))
    calls = _record_loss_calls(stack.runtime)
    x, y = _batch(2, seed=1)
    stack.train_step(x, y)
    out, (t,) = calls[-1]
    assert out.sharding.device_set == t.sharding.device_set == {dev}
    x_aval = stack.runtime.signature(stack._carry_in((x,))).in_aval
    where = functools.partial(stack.runtime.loss_args_sharding_of, x_aval)
    (sh,) = where((jax.ShapeDtypeStruct(tuple(y.shape), jax.numpy.int32),))
    assert sh.device_set == {dev} and stack.runtime.input_sharding_of(x_aval)[0].device_set == {dev}
    assert tensor_to_sharding(y.to(torch.int32), sh, _cpu_put).sharding.device_set == {dev}
