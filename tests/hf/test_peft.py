"""PEFT models as they come: ``causal_lm_stages(peft_model)`` and the ``SwappedStack`` built from it,
against torch eager on the same PEFT model.

A small ``transformers`` Llama (hidden 64, FFN 176, 2 layers, 4/2 heads, vocab 512), float32 on the
CPU, wrapped by ``peft.get_peft_model`` with LoRA (r=4) on every projection, trained by
``torch.optim.AdamW(peft_model.parameters())``:

* forward logits, the loss of 3 steps and the adapters after them equal torch's; the frozen base
  weights are unchanged; DoRA and several active adapters likewise;
* no gradient of a frozen weight is computed (no dot of the layers' backward executables has a
  frozen weight's shape, while a fully trained stack's has) and none moves (the frozen weights'
  host arrays are the same objects after the steps, fused or clipped updates alike; no optimizer
  state for them; without an optimizer their ``.grad`` stays ``None`` as in torch);
* ``save_checkpoint`` holds the adapters and their moments under the PEFT model's own names, and
  ``load_checkpoint`` into a fresh stack resumes as the uninterrupted run;
* ``sync_modules`` writes into the PEFT model: ``save_pretrained`` then saves torch's adapters;
* ``generate`` gives the PEFT model's greedy tokens;
* what cannot equal torch is refused by name.
"""
import copy
import re

import jax
import pytest
import torch

peft = pytest.importorskip("peft")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from llama_cases import rel  # noqa: E402  (relative error in the 2-norm, as the other stack tests)
from xla_swap.stack import SwappedStack, causal_lm_stages  # noqa: E402
from xla_swap.stack.config import ParallelConfig, TrainingConfig
from xla_swap.stack.torch_bridge import inputs_to_jax  # noqa: E402

V, D, F = 512, 64, 176
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-2


def llama(seed=0):
    cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float().eval()


def lora(seed=0, **kw):
    """The PEFT model (adapters initialised at random: ``lora_B`` non-zero, so the adapters act from step 0)."""
    return peft.get_peft_model(llama(seed), peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJ,
                                                            init_lora_weights=False, **kw))


def ce(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batch(seed=1, b=2, t=12):
    ids = torch.randint(0, V, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def stack_of(pm, optimizer=True, **kw):
    """The stack of ``pm`` (on one device unless ``devices`` is given), with torch's AdamW over all of
    ``pm``'s parameters as a user writes it (frozen ones included: torch skips them)."""
    first, layers, last = causal_lm_stages(pm)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR) if optimizer else None
    kw.setdefault("parallel", ParallelConfig(devices=jax.devices()[:1]))
    return SwappedStack(layers, first=first, last=last, optimizer=opt, loss_fn=ce, **kw)


def torch_steps(ref, data):
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses = []
    for x, y in data:
        loss = ce(ref(x).logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def check_trained_as_torch(pm, ref, tol=3e-5):
    """Every trainable parameter of ``pm`` within ``tol`` of ``ref``'s; every frozen one equal."""
    want = dict(ref.named_parameters())
    trained = 0
    for n, p in pm.named_parameters():
        if p.requires_grad:
            assert rel(p.detach(), want[n].detach()) < tol, n
            trained += 1
        else:
            assert torch.equal(p, want[n]), n
    assert trained > 0


@pytest.mark.parametrize("kind", ["lora", "dora", "two_adapters"])
def test_adapters_train_as_torch(kind):
    pm = lora(use_dora=kind == "dora")
    if kind == "two_adapters":   # both summed by peft's forward, both trained
        pm.add_adapter("b", peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        pm.base_model.set_adapter(["default", "b"])
    ref = copy.deepcopy(pm)
    stack = stack_of(pm, parallel=ParallelConfig(devices=None))   # all devices: FSDP-sharded adapters and base weights
    x, y = batch()
    with torch.no_grad():
        assert rel(stack(x), ref(x).logits) < 1e-5
    want = torch_steps(ref, [(x, y)] * 3)
    got = [float(stack.train_step(x, y)) for _ in range(3)]
    assert got == pytest.approx(want, rel=1e-5)
    stack.sync_modules()
    check_trained_as_torch(pm, ref)     # frozen weights equal torch's, which leaves them as they were


def weight_shaped_dots(stack, x, kind):
    """``(dtype, shape)`` of every dot in the layers' compiled ``kind`` backward whose result has a
    frozen linear weight's shape (``[in, out]`` or ``[out, in]``): a weight gradient's matmul."""
    rt = stack.runtime
    sig = rt.signature(inputs_to_jax((x,), "inputs", None))
    shapes = {s for n in PROJ for m in stack.modules[1].modules() if hasattr(m, n)
              for w in [getattr(m, n).weight] for s in (tuple(w.shape), tuple(w.shape)[::-1])}
    found = set()
    for i in range(1, len(stack.modules) - 1):
        text = rt.stage_executable(sig, kind, i).as_text()
        for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\S* dot\(", text):
            if tuple(int(d) for d in dims.split(",") if d) in shapes:
                found.add((dtype, dims))
    return found


@pytest.mark.parametrize("remat", [True, False])
def test_no_frozen_gradient_is_computed_or_moved(remat):
    from xla_swap.planning import OffloadPolicy
    policy = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=remat, prefetch_depth=2)
    x, y = batch(t=11)   # 22 tokens: no activation has a weight's shape
    pm = lora()
    stack = stack_of(pm, policy=policy)
    full = stack_of(llama(), policy=policy)
    kind = "backward" if remat else "backward-saved"
    assert weight_shaped_dots(stack, x, kind) == set()
    assert weight_shaped_dots(full, x, kind)            # the check sees weight gradients where there are some
    rt = stack.runtime
    for i, m in enumerate(stack.modules):
        grad = {n for n, p in m.named_parameters() if p.requires_grad}
        assert set(rt.trainable_paths(i)) == {f"['{n}']" for n in grad}
        assert len(rt.optimizer_state[i]) == len(grad)  # moments for the adapters alone
    before = [dict(p) for p in rt.host_params]
    stack.train_step(x, y)
    stack.train_step(x, y)
    for i, m in enumerate(stack.modules):
        for n, p in m.named_parameters():   # a frozen weight's host array never moved; an adapter's was replaced
            assert (rt.host_params[i][n] is before[i][n]) == (not p.requires_grad), (i, n)


def test_clipped_steps_update_the_adapters_alone():
    """``max_grad_norm``: the gradients go to the host and a separate update pass applies AdamW; the
    norm is the adapters' (torch's ``clip_grad_norm_`` over the parameters with a gradient) and the
    frozen weights stay where they are."""
    pm = lora()
    ref = copy.deepcopy(pm)
    stack = stack_of(pm, training=TrainingConfig(max_grad_norm=0.5))
    rt = stack.runtime
    before = [dict(p) for p in rt.host_params]
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for s in range(2):
        x, y = batch(seed=s)
        stack.train_step(x, y)
        ce(ref(x).logits, y).backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 0.5)
        opt.step()
        opt.zero_grad()
        # step 0: the same gradients; step 1 follows an update that AdamW computes ill-conditioned where a
        # gradient is near its eps (1e-8: a few adapter elements), so its gradients agree less closely
        assert stack.last_grad_norm == pytest.approx(float(norm), rel=1e-6 if s == 0 else 1e-3) and float(norm) > 0.5
    for i, m in enumerate(stack.modules):
        for n, p in m.named_parameters():
            assert (rt.host_params[i][n] is before[i][n]) == (not p.requires_grad), (i, n)
    stack.sync_modules()
    check_trained_as_torch(pm, ref)


def test_without_optimizer_frozen_weights_get_no_grad():
    pm = lora()
    ref = copy.deepcopy(pm)
    x, y = batch()
    stack_of(pm, optimizer=False).train_step(x, y)
    ce(ref(x).logits, y).backward()
    want = dict(ref.named_parameters())
    for n, p in pm.named_parameters():
        assert (p.grad is None) == (want[n].grad is None), n
        if p.grad is not None:
            assert rel(p.grad, want[n].grad) < 1e-4, n


def test_checkpoint_holds_the_adapters_under_the_peft_names(tmp_path):
    import torch.distributed.checkpoint as dcp
    data = [batch(seed=s) for s in range(4)]
    pm = lora()
    ref = copy.deepcopy(pm)
    torch_steps(ref, data)
    stack = stack_of(pm)
    for x, y in data[:2]:
        stack.train_step(x, y)
    stack.save_checkpoint(tmp_path / "ckpt")
    md = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    names = dict(pm.named_parameters())
    adapters = {n for n, p in names.items() if p.requires_grad}
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in adapters
    assert {k[len("model."):] for k in md if k.startswith("model.")} == set(names)
    moments = {k[len("optim.state."):].rsplit(".", 1)[0] for k in md if k.startswith("optim.state.")}
    assert moments == adapters                      # no optimizer state for a frozen weight
    other = lora(seed=5)                            # other weights: the checkpoint replaces them
    resumed = stack_of(other)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for s in (stack, resumed):                      # the uninterrupted run, and the resumed one
        for x, y in data[2:]:
            s.train_step(x, y)
        s.sync_modules()
    check_trained_as_torch(other, pm, tol=1e-6)
    check_trained_as_torch(pm, ref)


def test_sync_modules_then_save_pretrained_saves_the_trained_adapters(tmp_path):
    from safetensors.torch import load_file
    pm = lora()
    ref = copy.deepcopy(pm)
    x, y = batch()
    torch_steps(ref, [(x, y)] * 3)
    stack = stack_of(pm)
    for _ in range(3):
        stack.train_step(x, y)
    stack.sync_modules()
    pm.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    want = peft.get_peft_model_state_dict(ref)
    assert set(saved) == set(want) and len(saved) == 2 * len(PROJ) * 2
    for k, t in saved.items():
        assert rel(t, want[k]) < 3e-5, k


def _inactive_trainable(pm):
    pm.add_adapter("b", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    for n, p in pm.named_parameters():
        if ".b." in n:
            p.requires_grad_(True)


@pytest.mark.parametrize("make, match", [
    (lambda: peft.get_peft_model(llama(), peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                                         feedforward_modules=["down_proj"])), "PEFT type IA3"),
    (lambda: peft.get_peft_model(llama(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)),
     "PROMPT_TUNING .prompt learning"),
    (lambda: lora(lora_dropout=0.1), "lora_dropout=0.1 in training mode"),   # get_peft_model: training mode
    (lambda: (pm := lora(), pm.merge_adapter())[0], "merged into its base weight"),
    (lambda: (pm := lora(), _inactive_trainable(pm))[0], r"lora_A\['b'\] requires grad but adapter 'b' is not active"),
    (lambda: lora(trainable_token_indices=[3, 7]), "TrainableTokensLayer"),
])
def test_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        causal_lm_stages(make())


def test_eval_mode_dropout_and_decoder_layers():
    pm = lora(lora_dropout=0.1).eval()           # eval mode: peft's dropout is the identity
    first, layers, last = causal_lm_stages(pm)
    assert layers == list(pm.get_base_model().model.layers)
    from xla_swap.hf.causal_lm import decoder_layers
    assert decoder_layers(pm) is pm.get_base_model().model.layers


def test_generate_equals_peft_generate():
    pm = lora().eval()
    x, _ = batch(t=6)
    with torch.no_grad():
        want = pm.generate(input_ids=x, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(stack_of(pm).generate(x, max_new_tokens=5), want)
