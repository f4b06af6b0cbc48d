"""``SwappedStack`` training features against plain torch on the same weights and data.

Small ``transformers`` Llama decoders in float32 on the CPU: the torch optimizer's param groups
and a ``torch.optim.lr_scheduler`` read at every step, gradient accumulation over micro-batches,
global-norm gradient clipping and the skipped step on a non-finite gradient. Each compares the
weights after a few steps with torch eager training (``torch.optim.AdamW``,
``torch.nn.utils.clip_grad_norm_``) to a relative 1e-5 per parameter.
"""
import copy
import math

import jax
import pytest
import torch

from llama_cases import batches, ce, hf_groups, make_model, warmup_cosine
from xla_swap.stack import SwappedStack, causal_lm_stages
from xla_swap.stack.config import ParallelConfig, TrainingConfig

TOL = 1e-5

# The first AdamW steps move each element by lr * g / (|g| + eps), about lr * sign(g): an element whose
# gradient cancels to ~0 across positions or micro-batches flips with fp32 rounding (torch fp32 and
# torch fp64 differ by up to 8.6e-5 at eps=1e-8, lr=1e-3 with 2 micro-batches). eps=1e-6 makes such
# elements' steps linear in g, so the comparison measures the implementation, not that noise.
ADAM = dict(lr=1e-3, weight_decay=0.05, eps=1e-6)


def worst_rel(model, ref):
    out = 0.0
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        out = max(out, float((p.detach() - q.detach()).norm() / q.detach().norm().clamp_min(1e-30)))
    return out


def stack_of(model, opt, **kw):
    """A stack over the whole model on one device (weights, moments in pinned_host, 2 layers prefetched)."""
    first, layers, last = causal_lm_stages(model)
    return SwappedStack(layers, first=first, last=last, loss_fn=ce, optimizer=opt,
                        parallel=ParallelConfig(devices=jax.devices()[:1]), **kw)


def test_scheduler_and_param_groups_equal_torch(recwarn):
    """Warm-up (lr 0 at the first step) + cosine over 6 steps, decay / no-decay groups with other
    betas: the weights equal torch's; the lr changes never recompile; the scheduler does not warn."""
    ref = make_model()
    model = copy.deepcopy(ref)
    groups_ref = hf_groups(ref, 0.1)
    groups = hf_groups(model, 0.1)
    groups_ref[1]["betas"] = groups[1]["betas"] = (0.8, 0.99)
    opt_ref = torch.optim.AdamW(groups_ref, lr=3e-3)
    sched_ref = warmup_cosine(opt_ref)
    opt = torch.optim.AdamW(groups, lr=3e-3)
    sched = warmup_cosine(opt)
    stack = stack_of(model, opt)
    execs = None
    for x, y in batches(6):
        loss = stack.train_step(x, y)
        sched.step()
        ref_loss = ce(ref(x).logits, y)
        opt_ref.zero_grad()
        ref_loss.backward()
        opt_ref.step()
        sched_ref.step()
        assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
        if execs is None:
            execs = stack.runtime.num_executables
        assert stack.runtime.num_executables == execs  # lr and betas are traced inputs
    assert stack.runtime.step == 6 and opt.param_groups[0]["lr"] == opt_ref.param_groups[0]["lr"]
    stack.sync_modules()
    assert worst_rel(model, ref) <= TOL
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]
    assert not opt.state  # the torch optimizer's own state is not used


def test_lr_override_and_frozen_parameter():
    """``train_step(lr=...)`` overrides every group's lr for that step only; a parameter with
    ``requires_grad=False`` stays as it is (torch gives it no .grad)."""
    ref = make_model(layers=2)
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.05)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.05)
    stack = stack_of(model, opt)
    for i, (x, y) in enumerate(batches(3)):
        lr = 5e-3 if i == 1 else None
        stack.train_step(x, y, lr=lr)
        opt_ref.zero_grad()
        ce(ref(x).logits, y).backward()
        if lr is not None:
            opt_ref.param_groups[0]["lr"] = lr
        opt_ref.step()
        opt_ref.param_groups[0]["lr"] = 1e-3
    assert opt.param_groups[0]["lr"] == 1e-3
    stack.sync_modules()
    assert worst_rel(model, ref) <= TOL
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, ref.model.layers[0].mlp.up_proj.weight)


def test_unsupported_torch_optimizers_are_refused():
    model = make_model(layers=1)
    first, layers, last = causal_lm_stages(model)
    kw = dict(first=first, last=last, loss_fn=ce)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.AdamW.*SGD"):
        SwappedStack(layers, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    g = hf_groups(model, 0.1)
    g[1]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"param_groups\[1\]: amsgrad=True"):
        SwappedStack(layers, optimizer=torch.optim.AdamW(g), **kw)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: maximize=True"):
        SwappedStack(layers, optimizer=torch.optim.AdamW(model.parameters(), maximize=True), **kw)
    with pytest.raises(ValueError, match="L2"):
        SwappedStack(layers, optimizer=torch.optim.Adam(model.parameters(), weight_decay=0.1), **kw)
    g = hf_groups(model, 0.1)
    with pytest.raises(ValueError, match="requires grad but is in no param_group"):
        SwappedStack(layers, optimizer=torch.optim.AdamW(g[:1]), **kw)
    with pytest.raises(ValueError, match="in no stage of the stack"):
        SwappedStack(layers, optimizer=torch.optim.AdamW(model.parameters()))  # no first / last
    # a group changed after construction: refused at the step, the stack still usable
    opt = torch.optim.AdamW(hf_groups(model, 0.1), lr=1e-3)
    stack = SwappedStack(layers, optimizer=opt, **kw)
    x, y = batches(1)[0]
    moved = opt.param_groups[1]["params"].pop()
    with pytest.raises(ValueError, match="other parameters than when the SwappedStack was built"):
        stack.train_step(x, y)
    opt.param_groups[1]["params"].append(moved)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"param_groups\[0\]: AdamW lr must be >= 0"):
        stack.train_step(x, y)
    opt.param_groups[0]["lr"] = 1e-3
    assert stack.runtime.step == 0
    stack.train_step(x, y)
    assert stack.runtime.step == 1


def torch_update(model, opt, max_norm=None, skip_nonfinite=False):
    """torch's update after the backward(s): clip_grad_norm_, skip on a non-finite norm, step, zero_grad."""
    norm = None
    if max_norm is not None or skip_nonfinite:
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm is not None else math.inf))
    skipped = skip_nonfinite and not math.isfinite(norm)
    if not skipped:
        opt.step()
    opt.zero_grad()
    return norm, skipped


def test_accumulation_over_4_micro_batches_equals_torch():
    """4 micro-batches per update (loss / 4, torch's loop), 2 updates with a scheduler: the weights
    equal torch's; no update and no step between micro-batches."""
    n = 4
    ref = make_model()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(hf_groups(ref, 0.1), lr=3e-3, eps=1e-6)  # eps: see ADAM
    sched_ref = warmup_cosine(opt_ref, warmup=1, total=4)
    opt = torch.optim.AdamW(hf_groups(model, 0.1), lr=3e-3, eps=1e-6)
    sched = warmup_cosine(opt, warmup=1, total=4)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, optimizer=opt,
                         parallel=ParallelConfig(devices=jax.devices()[:1]),
                         loss_fn=lambda logits, y: ce(logits, y) / n)
    data = batches(3 * n, seed=3)
    for i, (x, y) in enumerate(data):
        acc = (i + 1) % n != 0
        before = stack.runtime.host_params[2]
        loss = stack.train_step(x, y, accumulate=acc)
        ref_loss = ce(ref(x).logits, y) / n
        ref_loss.backward()
        assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
        if acc:
            assert stack.runtime.micro_batches == i % n + 1 and stack.runtime.host_params[2] is before
        else:
            torch_update(ref, opt_ref)
            sched_ref.step()
            sched.step()
            assert stack.runtime.micro_batches == 0 and stack.runtime.grad_acc is None
    assert stack.runtime.step == 3
    stack.sync_modules()
    assert worst_rel(model, ref) <= TOL


@pytest.mark.parametrize("max_norm,micro", [(0.5, 1), (0.5, 2), (1e3, 1)])
def test_global_norm_clipping_equals_torch(max_norm, micro):
    """``max_grad_norm`` = ``clip_grad_norm_`` over every parameter of every stage, at a threshold
    that triggers (0.5: the norms are 2-5) and one that does not, alone and with accumulation."""
    ref = make_model()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), **ADAM)
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    stack = stack_of(model, opt, training=TrainingConfig(max_grad_norm=max_norm))
    data = batches(3 * micro, seed=5)
    norms = []
    for i, (x, y) in enumerate(data):
        update = (i + 1) % micro == 0
        stack.train_step(x, y, accumulate=not update)
        ce(ref(x).logits, y).backward()
        if update:
            norm, _ = torch_update(ref, opt_ref, max_norm)
            norms.append(norm)
            assert abs(stack.last_grad_norm - norm) <= 1e-5 * norm and not stack.last_step_skipped
    assert all(n > max_norm for n in norms) if max_norm < 1 else all(n < max_norm for n in norms)
    assert stack.runtime.step == 3
    stack.sync_modules()
    assert worst_rel(model, ref) <= TOL


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_nonfinite_gradient_skips_the_step(max_norm):
    """An inf loss scale at the second step makes every gradient non-finite: that update is skipped
    (weights, moments and step unchanged), as torch's GradScaler skips ``optimizer.step()``."""
    ref = make_model()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), **ADAM)
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    first, layers, last = causal_lm_stages(model)

    def scaled_ce(logits, y, scale):
        return ce(logits, y) * scale
    stack = SwappedStack(layers, first=first, last=last, optimizer=opt,
                         parallel=ParallelConfig(devices=jax.devices()[:1]),
                         loss_fn=scaled_ce, training=TrainingConfig(max_grad_norm=max_norm, skip_nonfinite=True))
    for i, (x, y) in enumerate(batches(4, seed=7)):
        scale = torch.tensor(math.inf if i == 1 else 1.0)
        state = stack.runtime.optimizer_state[1]
        stack.train_step(x, (y, scale))
        scaled_ce(ref(x).logits, y, scale).backward()
        norm, skipped = torch_update(ref, opt_ref, max_norm, skip_nonfinite=True)
        assert stack.last_step_skipped == skipped == (i == 1)
        assert (stack.runtime.optimizer_state[1] is state) == skipped
        assert math.isfinite(stack.last_grad_norm) != skipped
    assert stack.runtime.step == 3
    stack.sync_modules()
    assert worst_rel(model, ref) <= TOL


def test_bad_training_arguments_are_named():
    model = make_model(layers=1)
    first, layers, last = causal_lm_stages(model)
    kw = dict(first=first, last=last, loss_fn=ce, parallel=ParallelConfig(devices=jax.devices()[:1]))
    with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0"):
        SwappedStack(layers, optimizer=torch.optim.AdamW(model.parameters()),
                     training=TrainingConfig(max_grad_norm=0.0), **kw)
    with pytest.raises(ValueError, match="need an optimizer"):
        SwappedStack(layers, training=TrainingConfig(skip_nonfinite=True), **kw)
    x, y = batches(1)[0]
    plain = SwappedStack(layers, **kw)
    with pytest.raises(ValueError, match="accumulate=True needs an optimizer"):
        plain.train_step(x, y, accumulate=True)
    stack = SwappedStack(layers, optimizer=torch.optim.AdamW(model.parameters()), **kw)
    with pytest.raises(TypeError, match="accumulate must be a bool"):
        stack.train_step(x, y, accumulate="yes")
    stack.train_step(x, y, accumulate=True)  # still usable
    assert stack.runtime.micro_batches == 1 and stack.runtime.step == 0
