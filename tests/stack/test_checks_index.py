"""Out-of-range indices raise ``IndexError`` as torch raises it, before any state changes.

A small Hugging Face Llama (vocab 512) through ``causal_lm_stages`` and ``SwappedStack`` with
``torch.optim.AdamW``: a token id of 600 or -1 in ``forward``, ``train_step`` (updating and
accumulating) and ``generate``, and labels of 700 or -5 in ``train_step``, each raise ``IndexError``
naming the tensor, the value and the range, as torch's eager model and ``cross_entropy`` raise
``IndexError`` on the same inputs. Afterwards the weights, AdamW moments and step, the pending
micro-batches and the torch optimizer's step count are unchanged, and the next steps (labels -100
at some positions, which stay accepted) equal torch's. Without the checks an id past the vocabulary
gave NaN logits and turned every weight NaN, and a label past it trained toward a clamped class.
"""
import copy
import functools

import jax
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from xla_swap.stack.checks import check_index_range, class_target_bounds, loss_ignore_index, token_id_bounds
from xla_swap.stack import SwappedStack, causal_lm_stages
from xla_swap.stack.config import ParallelConfig

V = 512
TOL = 1e-5
ADAM = dict(lr=1e-3, weight_decay=0.05, eps=1e-6)   # eps as test_stack_optim.py: no sign-flip noise


def _model():
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float().eval()


def ce(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _batch(seed, b=2, t=8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, t + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:].clone()
    y[0, :3] = -100   # ignored, as cross_entropy ignores them
    return x, y


def _with(t, value):
    t = t.clone()
    t[1, 4] = value
    return t


def _torch_fqn(fqn):
    """The model's parameter name of a stack fqn (``first.embed_tokens.weight`` -> ``model.embed_tokens.weight``)."""
    for a, b in (("first.", "model."), ("layers.", "model.layers."), ("last.norm.", "model.norm."), ("last.", "")):
        if fqn.startswith(a):
            return b + fqn[len(a):]
    raise AssertionError(fqn)


def _state(stack, opt, steps):
    sd = stack.state_dict()
    return sd, stack.runtime.step, stack.runtime.micro_batches, steps[0], copy.deepcopy(opt.param_groups[0]["lr"])


def _assert_same_state(before, after):
    (sd0, *rest0), (sd1, *rest1) = before, after
    assert rest0 == rest1
    for k, t in sd0["model"].items():
        assert torch.equal(t, sd1["model"][k]), k
    for k, st in sd0["optim"]["state"].items():
        for m, t in st.items():
            assert torch.equal(t, sd1["optim"]["state"][k][m]), (k, m)


def _assert_torch_raises(model, ids=None, labels=None, x=None):
    with pytest.raises(IndexError):
        with torch.no_grad():
            out = model(ids if ids is not None else x).logits
            ce(out, labels if labels is not None else torch.zeros(out.shape[:-1], dtype=torch.long))


def test_forward_and_generate_refuse_ids_outside_the_vocabulary():
    """ids 600 and -1: IndexError naming input_ids, the value and [0, 512) from forward and generate (torch's
    model and its generate raise IndexError too); nothing changed; the next forward equals torch's."""
    model = _model()
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce, parallel=ParallelConfig(devices=jax.devices()[:1]),
                         optimizer=torch.optim.AdamW(model.parameters(), **ADAM))
    x, _ = _batch(0)
    weights = stack.state_dicts()
    for bad in (600, -1):
        ids = _with(x, bad)
        _assert_torch_raises(model, ids=ids)
        with pytest.raises(IndexError):
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        for call in (lambda: stack(ids), lambda: stack(ids, torch.ones_like(ids)),
                     lambda: stack.generate(ids, max_new_tokens=2, pad_token_id=0)):
            with pytest.raises(IndexError, match=rf"input_ids holds {bad}, outside \[0, {V}\)"):
                call()
    assert not hasattr(stack, "last_generation")
    for w0, w1 in zip(weights, stack.state_dicts()):
        assert all(torch.equal(w0[n], w1[n]) for n in w0)
    with torch.no_grad():
        ref = model(x).logits
    got = stack(x)
    assert torch.isfinite(got).all() and float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    out = stack.generate(x, max_new_tokens=3, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, model.generate(x, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0))


def test_train_step_refuses_bad_ids_and_labels_before_any_state_changes():
    """ids 600 / -1 and labels 700 / -5, updating and accumulating (torch raises IndexError on each): IndexError
    naming the tensor, value and range; weights, moments, step, pending micro-batches, the torch optimizer's
    step count unchanged, at a step boundary and with a micro-batch pending. The valid steps around them
    (labels -100 in places) equal torch's: one update, then two micro-batches and an update."""
    ref = _model()
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), **ADAM)
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    steps = [0]
    opt.register_step_post_hook(lambda *a: steps.__setitem__(0, steps[0] + 1))
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce, optimizer=opt,
                         parallel=ParallelConfig(devices=jax.devices()[:1]))
    (x0, y0), (x1, y1), (x2, y2) = _batch(0), _batch(1), _batch(2)
    bad = [(dict(inputs=_with(x0, 600), targets=y0), "input_ids", 600, V),
           (dict(inputs=_with(x0, -1), targets=y0), "input_ids", -1, V),
           (dict(inputs=x0, targets=_with(y0, 700)), "targets", 700, V),
           (dict(inputs=x0, targets=_with(y0, -5)), "targets", -5, V),
           (dict(inputs=(x0, torch.ones_like(x0)), targets=(_with(y0, 700),)), r"targets\[0\]", 700, V)]
    for kw, *_ in bad:
        ids = kw["inputs"][0] if isinstance(kw["inputs"], tuple) else kw["inputs"]
        labels = kw["targets"][0] if isinstance(kw["targets"], tuple) else kw["targets"]
        _assert_torch_raises(ref, ids=ids, labels=labels)

    def refused():
        for accumulate in (False, True):
            for kw, name, value, size in bad:
                with pytest.raises(IndexError, match=rf"{name} holds {value}, outside \[0, {size}\)"):
                    stack.train_step(**kw, accumulate=accumulate)

    def torch_step(x, y, update):
        ce(ref(x).logits, y).backward()
        if update:
            opt_ref.step()
            opt_ref.zero_grad()

    loss = stack.train_step(x0, y0)
    torch_step(x0, y0, True)
    before = _state(stack, opt, steps)
    refused()
    _assert_same_state(before, _state(stack, opt, steps))
    stack.train_step(x1, y1, accumulate=True)                  # a micro-batch pending: its gradients kept
    pending = (stack.runtime.step, stack.runtime.micro_batches, steps[0])
    refused()
    assert (stack.runtime.step, stack.runtime.micro_batches, steps[0]) == pending == (1, 1, 1)
    loss = stack.train_step(x2, y2)
    torch_step(x1, y1, False)
    torch_step(x2, y2, True)
    assert torch.isfinite(loss) and steps[0] == 2 and not opt.state
    sd = stack.state_dict()
    for fqn, w in sd["model"].items():
        p = ref.get_parameter(_torch_fqn(fqn))
        assert float((w - p.detach()).norm() / p.detach().norm()) <= TOL, fqn
        for key, m in sd["optim"]["state"][fqn].items():
            r = opt_ref.state[p][key]
            assert float((m - r).norm() / r.norm().clamp_min(1e-30)) <= TOL, (fqn, key)


def test_the_loss_ignore_index_is_read_from_the_loss():
    """``functools.partial(loss, ignore_index=-1)``: labels -1 pass (as in torch), -5 and -100 still raise."""
    model = _model()
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, parallel=ParallelConfig(devices=jax.devices()[:1]),
                         optimizer=torch.optim.AdamW(model.parameters(), **ADAM))

    def ce_ignore(logits, labels, ignore_index):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index)
    loss_fn = functools.partial(ce_ignore, ignore_index=-1)
    x, y = _batch(3)
    y = torch.where(y == -100, -1, y)
    with torch.no_grad():
        logits = model(x).logits
        ref = loss_fn(logits, y)
        for bad in (-5, -100):
            with pytest.raises(IndexError):
                loss_fn(logits, _with(y, bad))
    for bad in (-5, -100):
        with pytest.raises(IndexError, match=rf"targets holds {bad}, .* not the ignore index -1"):
            stack.train_step(x, _with(y, bad), loss_fn=loss_fn)
    assert stack.runtime.step == 0
    assert abs(float(stack.train_step(x, y, loss_fn=loss_fn)) - float(ref)) <= TOL * float(ref)


def test_which_tensors_are_checked():
    """The rules of ``xla_swap.stack.checks`` on torch tensors alone (no stack)."""
    t = torch.tensor([[0, 5], [-100, 7]])
    assert check_index_range(t, "labels", 8, -100) == (0, 7)
    with pytest.raises(IndexError, match=r"labels holds 7, outside \[0, 7\) and is not the ignore index -100"):
        check_index_range(t, "labels", 7, -100)
    with pytest.raises(IndexError, match=r"ids holds -100, outside \[0, 8\) \(rows\)$"):
        check_index_range(t, "ids", 8, what="rows")
    assert check_index_range(t.float() * 1e9, "h", 8) is None   # not indices
    assert check_index_range(t[:0], "ids", 8) is None
    out = (2, 3, 10)
    y, flat, h = torch.zeros(2, 3, dtype=torch.long), torch.zeros(6, dtype=torch.int32), torch.zeros(2, 3)
    assert class_target_bounds(y, out, F.cross_entropy) == {0: ("targets", 10, -100, "the 10 classes of the "
                                                                "output's last dimension")}
    assert set(class_target_bounds((h, flat, torch.zeros(2, 3, 10, dtype=torch.long)), out, F.cross_entropy)) == {1}
    assert class_target_bounds(y, None, F.cross_entropy) == {}
    assert class_target_bounds(torch.tensor(3), (10,), F.cross_entropy) == {}   # 1-d output: not class scores
    assert loss_ignore_index(torch.nn.CrossEntropyLoss(ignore_index=3)) == 3
    assert loss_ignore_index(functools.partial(F.nll_loss, ignore_index=-1)) == -1

    def own(o, y):
        return o.sum()
    own.ignore_index = None   # integer targets that are not class indices: not checked
    assert loss_ignore_index(own) is None and class_target_bounds(y, out, own) == {}
    assert token_id_bounds(torch.nn.Embedding(9, 2)) == {0: ("inputs[0]", 9, None, "the rows of the input embedding")}
    assert token_id_bounds(torch.nn.Linear(2, 2)) == {} and token_id_bounds(None) == {}
