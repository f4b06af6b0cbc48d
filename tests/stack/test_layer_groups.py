"""Layers share a stage function only when they compute the same thing (``xla_swap.stack.stages.layer_groups``).

A per-layer Python setting read in ``forward`` changes what a layer computes without changing its
type or weight shapes: SmolLM3's ``no_rope_layers`` (every fourth layer without rotary
embeddings), an attention scale, a router's top-k, ``config.layer_types``. Each case is compared
with torch eager on the same model: logits, the loss, the gradients (through ``.grad``, no
optimizer) and the weights after one AdamW step. Homogeneous layers keep one function and
compile as many executables as a stack of fewer layers.
"""
import copy

import jax
import pytest
import torch

transformers = pytest.importorskip("transformers")

from xla_swap.stack import SwappedStack, causal_lm_stages  # noqa: E402
from xla_swap.stack.config import ParallelConfig

V, T = 128, 10
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _scale_layer_1(model):
    model.model.layers[1].self_attn.scaling = 0.05


def _top1_in_layer_2(model):
    model.model.layers[2].mlp.gate.top_k = 1
    model.model.layers[2].mlp.top_k = 1


#: case -> (family, config overrides, edit of the built model or None, the layers that differ).
CASES = {
    "smollm3-no-rope": ("smollm3", {"no_rope_layers": [1, 1, 1, 0]}, None, {3}),
    "llama-attention-scale": ("llama", {}, _scale_layer_1, {1}),
    "mixtral-top-k": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, _top1_in_layer_2, {2}),
    "gpt_oss-layer-types": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
                                        "layer_types": ["sliding_attention", "full_attention"] * 2}, None, {1, 3}),
}


def make(family, overrides, edit=None):
    cfg = transformers.AutoConfig.for_model(family, **{**BASE, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    if edit is not None:
        edit(model)
    return model


def ce(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, T + 1), generator=g)
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
    mask = torch.ones_like(x)
    mask[0, :3], x[0, :3], y[0, :3] = 0, 0, -100
    return x, mask, y


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_layer_settings_equal_torch(case):
    family, overrides, edit, odd = CASES[case]
    ref = make(family, overrides, edit)
    x, mask, y = data()
    keep = mask.bool()

    # forward and gradients (no optimizer: train_step fills .grad)
    model = copy.deepcopy(ref)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce, parallel=ParallelConfig(devices=jax.devices()[:1]))
    groups = stack.layer_groups
    assert all(groups[i] != groups[j] for i in odd for j in range(len(layers)) if j not in odd), groups
    with torch.no_grad():
        want = ref(x, attention_mask=mask).logits
    assert rel(stack(x, mask)[keep], want[keep]) <= 1e-5
    loss = stack.train_step((x, mask), y)
    ref_loss = ce(ref(x, attention_mask=mask).logits, y)
    ref_loss.backward()
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    # a weight whose gradient is zero by the maths (a top-1 router's, normalised to 1) holds rounding noise
    top = max(float(q.grad.norm()) for q in ref.parameters() if q.grad is not None)
    loud = {n for n, q in ref.named_parameters() if q.grad is not None and float(q.grad.norm()) > 1e-6 * top}
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if n in loud:
            assert p.grad is not None and rel(p.grad, q.grad) <= 1e-4, n

    # one AdamW update
    model = copy.deepcopy(ref)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce, parallel=ParallelConfig(devices=jax.devices()[:1]),
                         optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    stack.train_step((x, mask), y)
    torch.optim.AdamW(ref.parameters(), lr=1e-2).step()   # ref's .grad from above
    stack.sync_modules()
    # AdamW's first step is lr * sign(grad) where |grad| >> eps: compare it where the sign is not noise
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if n in loud:
            sure = q.grad.abs() > 1e-4 * float(q.grad.abs().max())
            assert rel((p.detach() - before[n])[sure], (q.detach() - before[n])[sure]) <= 1e-3, n
    got, want = (torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (model, ref))
    assert rel(got, want) <= 1e-4


def test_homogeneous_layers_share_one_function_and_compile_once():
    """Four identical Llama layers: one group, one stage function, and after a forward and a training
    step as many executables as a two-layer stack of the same layers compiles."""
    counts = []
    x, mask, y = data()
    for n in (2, 4):
        model = make("llama", {"num_hidden_layers": n})
        first, layers, last = causal_lm_stages(model)
        stack = SwappedStack(layers, first=first, last=last, loss_fn=ce,
                             parallel=ParallelConfig(devices=jax.devices()[:1]),
                             optimizer=torch.optim.AdamW(model.parameters()))
        assert stack.layer_groups == (0,) * n
        assert len(set(stack.runtime.stage_fn_ids[1:-1])) == 1
        stack(x, mask)
        stack.train_step((x, mask), y)
        counts.append(stack.runtime.num_executables)
    assert counts[0] == counts[1]


class Scaled(torch.nn.Module):
    """A layer whose output scale is a plain attribute read in ``forward``."""

    def __init__(self, scale):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.scale = scale

    def forward(self, h):
        return torch.tanh(self.lin(h)) * self.scale


def test_layers_without_example_inputs_are_told_apart_by_their_settings():
    """No ``first`` to trace an example on: layers are grouped by their plain attributes, so a layer
    with another ``scale`` gets its own function; the stack equals the torch loop, values and grads."""
    torch.manual_seed(0)
    layers = [Scaled(1.0), Scaled(1.0), Scaled(0.5), Scaled(1.0)]
    stack = SwappedStack(layers, loss_fn=lambda out, t: ((out - t) ** 2).mean(),
                         parallel=ParallelConfig(devices=jax.devices()[:1]))
    assert stack.layer_groups == (0, 0, 1, 0)
    x, t = torch.randn(3, 16), torch.randn(3, 16)
    h = x
    for m in layers:
        h = m(h)
    torch.testing.assert_close(stack(x), h.detach(), rtol=1e-5, atol=1e-6)
    ref = copy.deepcopy(layers)
    hr = x
    for m in ref:
        hr = m(hr)
    ((hr - t) ** 2).mean().backward()
    stack.train_step(x, t)
    for m, r in zip(layers, ref):
        torch.testing.assert_close(m.lin.weight.grad, r.lin.weight.grad, rtol=1e-4, atol=1e-6)


def test_a_layer_index_is_read_as_the_model_reads_it():
    """Without an example input: ``layer_idx`` (it counts the layers) is no setting, so identical Hugging
    Face layers share a group, while the per-layer config entries read through it (SmolLM3's
    ``config.no_rope_layers[layer_idx]``) still tell layers apart."""
    from xla_swap.stack.stages import attribute_keys

    def groups(layers):
        keys = attribute_keys(list(layers))
        return [keys.index(k) for k in keys]
    bert = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                                          intermediate_size=64))
    assert groups(bert.encoder.layer) == [0, 0, 0, 0]
    assert groups(make("smollm3", {"no_rope_layers": [1, 1, 1, 0]}).model.layers) == [0, 0, 0, 3]
    assert groups(make("smollm3", {"no_rope_layers": [1, 1, 1, 1]}).model.layers) == [0, 0, 0, 0]
    assert groups(make("llama", {}, _scale_layer_1).model.layers) == [0, 1, 0, 0]
