"""Every causal-LM family of the installed ``transformers`` through ``causal_lm_stages``: exact or refused.

Each family builds from a small random-init config (2 layers, hidden 32, vocab 96, fp32, CPU)
and either

* matches torch eager on the same weights and data: logits at the non-pad positions of a
  padded batch (with its ``attention_mask``) within rel 1e-5, and three AdamW steps of
  ``stack.train_step((ids, attention_mask), labels)`` (labels -100 at the pads, ignored by
  ``cross_entropy``) within rel 1e-5 (loss) and 1e-4 (weights); or
* is refused at construction (``causal_lm_stages`` or ``SwappedStack``) with an error naming
  the module and the feature.

Configs exercise what used to go silently wrong: sliding windows shorter than the sequence,
alternating local/global layers (Gemma-2/3, Qwen2's ``max_window_layers``), logit scaling and
softcapping (Cohere, Granite, Gemma-2), tied embeddings (Gemma, GPT-2, and Llama tied), left and
right padding. And what was refused for a wrong reason or crashed inside the model's code: layers
returning a tuple the model indexes (Falcon), the base model found by ``get_decoder()`` (OPT) or by
its input embedding (Llama-4, then refused by name for its complex rotary embeddings), a final norm
found by what the base model does (LFM2's ``embedding_norm``), longrope's per-call factors (Phi-3),
a tensor of the base model itself (RecurrentGemma's normalizer), partial interleaved rotary
(CodeGen, GPT-J); refusals name the module and the feature (dynamic RoPE, JetMoE's data-dependent
gating, Zaya's router state and Inkling-2's block states handed from layer to layer or combined with the
last layer's output after the layers, Zamba-2's transformer block shared by its hybrid layers, which get
their keyword arguments in another order than the others).

Weights: an entry whose torch gradient is zero by the maths (a key bias, which shifts every score
of a query by the same amount) holds only AdamW's amplified rounding noise in both runs, so it is
compared within the whole model's rel 1e-4 instead of its parameter's.

At the bottom of the declared transformers range (``make test-transformers-low``) a family the stages need a
newer transformers for is expected refused with its message, and a model type not there yet is skipped
(``transformers_ends.py``); from the version that has it on, the checks above run unchanged.

One device (the family sweep checks the model's code, not the sharding: ``test_stack.py`` runs
the stack on 1, 4 and 8 devices), except Llama, Gemma-2 and Mixtral, also trained on every device
of the run with FSDP. Mixture-of-experts configs use 4 experts and top-2 (Mixtral, Qwen2-MoE with
its shared expert, Qwen3-MoE, OLMoE, DeepSeek-V3 with a shared expert and group-limited routing,
GPT-OSS with biased, clamped experts).
"""
import copy

import jax
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers_ends import LONGROPE_REFUSAL, LONGROPE_TRACED_FROM, needs_newer, older_than, \
    skip_if_absent  # noqa: E402
from xla_swap.hf.refusals import describe_failure  # noqa: E402
from xla_swap.stack import SwappedStack, causal_lm_stages  # noqa: E402
from xla_swap.stack.config import ParallelConfig

V, T = 96, 12
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)

#: mixture of experts: 4 experts, top-2 (every token routed to fewer experts than there are).
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
#: DeepSeek's multi-head latent attention.
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
           head_dim=4)

#: family -> (config overrides, padding side). Sliding windows of 4 < T.
EXACT = {
    "llama": ({}, "left"),
    "llama-tied": ({"tie_word_embeddings": True}, "right"),
    "mistral": ({"sliding_window": 4}, "left"),
    "qwen2": ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, "left"),
    "qwen3": ({}, "right"),
    "phi3": ({}, "left"),
    "olmo2": ({}, "left"),
    "starcoder2": ({"sliding_window": 4}, "left"),
    "granite": ({"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                 "attention_multiplier": 0.3}, "left"),
    "cohere": ({"logit_scale": 0.25}, "left"),
    "gemma": ({"tie_word_embeddings": True}, "left"),
    "gemma2": ({"tie_word_embeddings": True, "sliding_window": 4, "final_logit_softcapping": 2.0}, "left"),
    "gemma3_text": ({"sliding_window": 4, "sliding_window_pattern": 2, "final_logit_softcapping": 2.0}, "left"),
    "gpt2": ({"tie_word_embeddings": True}, "left"),
    "gpt_neox": ({}, "left"),
    "phi": ({}, "right"),
    "olmo": ({}, "left"),
    "stablelm": ({}, "left"),
    "cohere2": ({"sliding_window": 4, "sliding_window_pattern": 2}, "left"),
    "helium": ({}, "left"),
    "nemotron": ({}, "left"),
    "persimmon": ({}, "left"),
    "vaultgemma": ({"sliding_window": 4}, "left"),
    "mixtral": ({"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4}, "left"),
    "qwen2_moe": ({**MOE, "num_experts": 4, "shared_expert_intermediate_size": 16}, "left"),
    "qwen3_moe": ({**MOE, "num_experts": 4, "norm_topk_prob": True}, "right"),
    "olmoe": ({**MOE, "num_experts": 4}, "left"),
    "deepseek_v3": ({**MOE, **MLA, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                     "n_group": 2, "topk_group": 1}, "left"),
    "gpt_oss": ({"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4}, "left"),
    # rotary on the first rotary_dim of each head, interleaved
    "codegen": ({"rotary_dim": 4}, "left"),
    "gptj": ({"rotary_dim": 4}, "right"),
    # layers returning a tuple the model indexes with [0]: the stand-ins return the same form
    "falcon": ({}, "left"),
    # the base model (model.decoder) found by transformers' get_decoder(), not base_model_prefix
    "opt": ({"word_embed_proj_dim": 32, "ffn_dim": 64}, "left"),
    # short convolutions beside attention; the final norm (embedding_norm) found by what the base's forward does
    "lfm2": ({"layer_types": ["conv", "full_attention"]}, "left"),
    # a tensor of the base model itself (its normalizer buffer, in no child module); recurrent blocks
    "recurrent_gemma": ({"attention_window_size": 4, "block_types": ["recurrent", "attention"]}, "left"),
    # longrope: long factors past original_max_position_embeddings (8 < T), short ones below, chosen per call
    "phi3-longrope": ({"max_position_embeddings": 64, "original_max_position_embeddings": 8,
                       "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [3.0, 4.0, 5.0, 6.0],
                                           "original_max_position_embeddings": 8}}, "left"),
}

#: family -> (config overrides, a piece of the error naming the module and the feature, or a tuple of pieces).
REFUSED = {
    "mixtral-aux": ({"num_local_experts": 4, "output_router_logits": True},
                    "model.layers.0.mlp (MixtralSparseMoeBlock) is a mixture-of-experts block and "
                    "config.output_router_logits=True"),
    "mixtral-jitter": ({"num_local_experts": 4, "router_jitter_noise": 0.1},
                       "MixtralSparseMoeBlock) multiplies its input by random router jitter noise"),
    "jetmoe": ({"num_local_experts": 4}, ("layers[0] (JetMoeDecoderLayer) does not trace with torchax on an example "
                                          "input: the model's code in JetMoeTopKGating.forward (transformers/",
                                          "(data-dependent control flow), which a traced stage cannot express")),
    "deepseek_v2": ({**MOE, **MLA, "n_routed_experts": 4},
                    "passes decoder layer 0 position_embeddings= a complex tensor"),
    "llama-dynamic": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
                      "LlamaForCausalLM: model.rotary_emb (LlamaRotaryEmbedding) rope_type 'dynamic' is not supported"),
    # layers returning (hidden, router state) and the model handing the router state to the next layer
    "zaya": ({}, "ZayaModel.forward passes decoder layer 0's output after the hidden state to decoder layer 1 as "
                 "prev_router_hidden_states= (a state carried from layer to layer besides the hidden state)"),
    # block states gathered from the layers' inputs at every block boundary and handed to later layers
    "inkling2_text": ({"num_hidden_layers": 3, "n_layers_per_attn_res_block": 1, "unpadded_vocab_size": V},
                      "Inkling2TextModel.forward passes decoder layer 2 block_states= computed from earlier decoder "
                      "layers' outputs (a state carried from layer to layer besides the hidden state)"),
    # block states (the embedding: one block of 6 > 3 layers) combined with the last layer's output after the layers
    "inkling2_text-final": ({"num_hidden_layers": 3, "unpadded_vocab_size": V},
                            "Inkling2TextModel.forward computes its output after the decoder layers from decoder layer "
                            "0's input (the embedding) besides the last layer's output"),
    # hybrid layers passed the keywords in another order (accepted), sharing one transformer block (refused)
    "zamba2-shared": ({"layers_block_type": ["linear_attention", "hybrid", "hybrid"], "hybrid_layer_ids": [1, 2],
                       "num_mem_blocks": 1, "n_mamba_heads": 8, "mamba_headdim": 8, "attention_hidden_size": 64,
                       "mamba_d_state": 16, "num_hidden_layers": 3, "tie_word_embeddings": True},
                      "parameter layers[2].shared_transformer.self_attn.q_proj.weight is also in layers[1]: weights "
                      "shared between stages are supported between first and last only"),
    # found through its input embedding (base_model_prefix names no attribute, get_decoder() is the model)
    "llama4_text": ({"num_local_experts": 4, "interleave_moe_layer_step": 2, "attention_chunk_size": 4},
                    "Llama4TextModel.forward passes decoder layer 0 position_embeddings= a complex tensor"),
}


def make(family, overrides):
    name = family.split("-")[0]
    skip_if_absent(name)
    kind = type(transformers.AutoConfig.for_model(name))
    base = {k: v for k, v in BASE.items() if not isinstance(getattr(kind, k, None), property)}  # Falcon's head_dim
    cfg = transformers.AutoConfig.for_model(name, **{**base, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def ce(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def data(side):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, T + 1), generator=g)
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
    mask = torch.ones_like(x)
    pads = slice(0, 4) if side == "left" else slice(T - 4, T)
    mask[0, pads], x[0, pads], y[0, pads] = 0, 0, -100
    return x, mask, y


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.05)


#: the mixture-of-experts families of EXACT (their experts in transformers' experts interface).
MOE_FAMILIES = ["deepseek_v3", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]


def refusal_below_top(family):
    """The pieces of the refusal an EXACT ``family`` gets under the installed transformers, or ``None`` where
    it is new enough for the family to be exact (``transformers_ends.py``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    old = needs_newer(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family.split("-")[0]])
    if old is not None:
        return (old,)
    if family == "phi3-longrope" and older_than(LONGROPE_TRACED_FROM):
        return LONGROPE_REFUSAL
    return None


@pytest.mark.parametrize("family", sorted(EXACT))
def test_family_matches_torch(family):
    """Exact against torch (``check_family``), or, below the transformers version the family needs, refused
    at construction with the message that says so."""
    refusal = refusal_below_top(family)
    if refusal is not None:
        check_refused(family, EXACT[family][0], refusal)
    else:
        check_family(family)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_sorted_experts_family_matches_torch(family, monkeypatch):
    """``causal_lm_stages(model, experts="sorted")``: the experts as sorted segments (``ragged_dot``)
    give torch eager's logits and three AdamW steps, as the dense form does (and ``ragged_dot`` is traced)."""
    calls = []
    ragged = jax.lax.ragged_dot_general
    monkeypatch.setattr(jax.lax, "ragged_dot_general", lambda *a, **k: (calls.append(1), ragged(*a, **k))[1])
    check_family(family, experts="sorted")
    assert calls


def tie_routers(model):
    """Zero every router's parameters (modules named ``*Router``): every expert's score ties, as at a
    zero-initialised router's first step."""
    routers = [m for m in model.modules() if "Router" in type(m).__name__]
    assert routers
    with torch.no_grad():
        for m in routers:
            for p in m.parameters(recurse=False):
                p.zero_()
    return model


def check_family(family, experts="dense", tied=False):
    overrides, side = EXACT[family]
    ref = tie_routers(make(family, overrides)) if tied else make(family, overrides)
    model = copy.deepcopy(ref)
    first, layers, last = causal_lm_stages(model, experts=experts)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce, optimizer=adamw(model.parameters()),
                         parallel=ParallelConfig(devices=jax.devices()[:1]))
    x, mask, y = data(side)
    keep = mask.bool()
    with torch.no_grad():
        want = ref(x, attention_mask=mask).logits
    got = stack(x, mask)
    assert rel(got[keep], want[keep]) <= 1e-5
    opt = adamw(ref.parameters())
    quiet = None
    for _ in range(3):
        loss = stack.train_step((x, mask), y)
        ref_loss = ce(ref(x, attention_mask=mask).logits, y)
        opt.zero_grad()
        ref_loss.backward()
        if quiet is None:   # entries whose gradient is zero by the maths (rounding noise only)
            top = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
            quiet = {n: (p.grad.abs() <= 1e-6 * top) if p.grad is not None else torch.ones_like(p, dtype=torch.bool)
                     for n, p in ref.named_parameters()}
        opt.step()
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    stack.sync_modules()
    pairs = [(n, p.detach(), q.detach()) for (n, p), q in zip(model.named_parameters(), ref.parameters())]
    assert len(pairs) == len(list(ref.parameters()))
    for n, p, q in pairs:
        if not quiet[n].all():
            assert rel(p[~quiet[n]], q[~quiet[n]]) <= 1e-4, n
    assert rel(torch.cat([p.flatten() for _, p, _ in pairs]), torch.cat([q.flatten() for _, _, q in pairs])) <= 1e-4
    if overrides.get("tie_word_embeddings"):   # one weight: held once, by the first stage
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert stack.tied and all(n not in stack.runtime.host_params[-1] for n in stack.tied)


@pytest.mark.parametrize("experts", ["dense", "sorted"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tied_routers_match_torch(family, experts):
    """Every router zeroed, so every expert's score ties at the first step: the experts the stages pick
    are torch's (its CPU ``topk`` breaks ties its own way, not lowest index first), so the logits, the
    losses and the weights after three AdamW steps equal torch eager's, in both experts forms."""
    check_family(family, experts, tied=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,dim,largest,ordered", [(4, 2, -1, True, True), (8, 2, 0, True, True),
                                                     (128, 8, -1, True, True), (128, 2, -1, True, True),
                                                     (64, 4, -1, False, True), (16, 4, -1, True, False)])
def test_topk_ties_like_torch(n, k, dim, largest, ordered, dtype):
    """``torch.topk`` in the stages' environment on the CPU, on scores with ties (all equal, and repeated
    values): torch's values and indices (both of its CPU paths: ``nth_element`` below ``64 k`` scores,
    ``partial_sort`` from there), and torch's gradient through the values."""
    from xla_swap.stack.torch_attention import torchax_env
    env = torchax_env("cpu")
    g = torch.Generator().manual_seed(n + k)
    shape = (n, 3) if dim == 0 else (5, n)
    cases = [torch.zeros(shape), torch.randint(0, 3, shape, generator=g).float(), torch.randn(shape, generator=g)]
    w = torch.randn(*shape[:dim % 2], k, *shape[dim % 2 + 1:], generator=g)
    for x in (c.to(dtype) for c in cases):
        want_v, want_i = torch.topk(x, k, dim, largest, ordered)
        xg = x.clone().requires_grad_()
        (torch.topk(xg, k, dim, largest, ordered).values.float() * w).sum().backward()

        def f(a):
            v, i = torch.topk(env.j2t_iso(a), k, dim, largest, ordered)
            return env.t2j_iso(((v.float() * env.j2t_iso(jax.numpy.asarray(w.numpy()))).sum(), i))

        with env:
            (_, got_i), got_grad = jax.jit(jax.value_and_grad(f, has_aux=True))(env.t2j_copy(x))
        got_i = torch.from_numpy(jax.numpy.asarray(got_i).__array__().copy())
        assert torch.equal(got_i.long(), want_i)
        assert torch.equal(torch.gather(x, dim, got_i.long()), want_v)
        assert torch.equal(env.j2t_copy(got_grad), xg.grad)


def test_bf16_router_softmax_traces():
    """A bf16 Qwen3-MoE, whose router computes ``softmax(logits, dtype=torch.float32)`` on bf16 logits
    (torch's C++ casts a torchax tensor on the ``meta`` device it wraps), traces: the softmax equals
    torch's, and the model's logits through the stages are torch eager's within bf16 rounding
    (XLA's bf16 arithmetic on the CPU is not torch's: ``test_stack_mixed_precision.py``)."""
    from xla_swap.stack.torch_attention import torchax_env
    env = torchax_env("cpu")
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    with env:
        got = jax.jit(lambda a: env.t2j_iso(torch.softmax(env.j2t_iso(a), -1, dtype=torch.float32)))(env.t2j_copy(x))
    torch.testing.assert_close(env.j2t_copy(got), torch.softmax(x, -1, dtype=torch.float32), rtol=1e-6, atol=1e-7)
    model = make("qwen3_moe", {**EXACT["qwen3_moe"][0], "num_experts": 16, "num_experts_per_tok": 4}).bfloat16()
    ref = copy.deepcopy(model)
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, parallel=ParallelConfig(devices=jax.devices()[:1]))
    ids, mask, _ = data("left")
    keep = mask.bool()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits.float()
    assert rel(stack(ids, mask).float()[keep], want[keep]) <= 2e-2


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_refused_at_construction(family):
    check_refused(family, *REFUSED[family])


def check_refused(family, overrides, message):
    """``causal_lm_stages`` or ``SwappedStack`` of ``family`` built with ``overrides`` raises ValueError or
    TypeError whose message holds ``message`` (a string, or each of a tuple of pieces)."""
    model = make(family, overrides)
    with pytest.raises((ValueError, TypeError)) as info:
        first, layers, last = causal_lm_stages(model)
        SwappedStack(layers, first=first, last=last, parallel=ParallelConfig(devices=jax.devices()[:1]))
    for piece in (message,) if isinstance(message, str) else message:
        assert piece in str(info.value)


@pytest.mark.parametrize("root", ["/v/lib/python3.11/site-packages", "/repo/.venv-tf-low"])
def test_failure_names_transformers_file_from_package(root):
    """A failure in transformers' code is named with its file from the package on, whether transformers is
    installed in ``site-packages`` or in a ``pip install --target`` folder (``.venv-tf-low``)."""
    code = compile("def forward():\n    raise RuntimeError('boom')\nforward()",
                   f"{root}/transformers/models/toy/modeling_toy.py", "exec")
    with pytest.raises(RuntimeError) as info:
        exec(code, {})
    assert describe_failure(info.value) == "RuntimeError: boom, raised in forward (transformers/models/toy/modeling_toy.py:2)"


def test_layers_get_their_own_mask():
    """Gemma-2's alternating layers: two groups, each with its own mask (sliding or full) in the carry."""
    model = make("gemma2", {"sliding_window": 4})
    first, layers, last = causal_lm_stages(model)
    assert first.layer_keys == [0, 1]
    x, mask, _ = data("left")
    h, kw = first(x, mask)
    a, b = (first.select_layer_kwargs(k, kw)["attention_mask"] for k in (0, 1))
    assert a.shape == b.shape and not torch.equal(a, b)


def test_sdpa_fully_masked_rows_equal_torch():
    """The stages' environment runs ``xla_swap.stack.torch_attention``'s SDPA: a query row with every key masked
    (a pad query of a left-padded batch) gives torch's zeros, not NaN, and finite gradients."""
    from xla_swap.stack.torch_attention import sdpa_reference, torchax_env
    env = torchax_env("cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    keep = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    keep[..., 0, :] = False
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(sdpa_reference(q, k, v, attn_mask=keep), want, rtol=1e-6, atol=1e-6)
    f = jax.jit(lambda a, b, c, m: env.t2j_iso(torch.nn.functional.scaled_dot_product_attention(
        *env.j2t_iso((a, b, c)), attn_mask=env.j2t_iso(m))))
    with env:
        got = f(*(x.numpy() for x in (q, k, v, keep)))
    torch.testing.assert_close(torch.from_numpy(jax.numpy.asarray(got).__array__()), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,experts,tied", [("llama", "dense", False), ("gemma2", "dense", False),
                                                 ("mixtral", "dense", False), ("mixtral", "sorted", False),
                                                 ("olmoe", "dense", True)])
def test_family_fsdp_matches_torch(family, experts, tied):
    """Every device of the run (4 in ``make test``), ``shard="fsdp"`` (the default: weights sharded,
    the batch split over the devices): a left-padded batch of 8, two AdamW steps equal torch (also with
    every router's scores tied: torch's CPU ``topk`` choice, computed on the host, on a sharded batch)."""
    overrides, side = EXACT[family]
    ref = tie_routers(make(family, overrides)) if tied else make(family, overrides)
    model = copy.deepcopy(ref)
    first, layers, last = causal_lm_stages(model, experts=experts)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce, optimizer=adamw(model.parameters()))
    assert stack.runtime.batch_axis == ("d" if len(jax.devices()) > 1 else None)
    x, mask, y = (torch.cat([t] * 4) for t in data(side))
    opt = adamw(ref.parameters())
    for _ in range(2):
        loss = stack.train_step((x, mask), y)
        ref_loss = ce(ref(x, attention_mask=mask).logits, y)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    stack.sync_modules()
    got, want = (torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (model, ref))
    assert rel(got, want) <= 1e-4
    with torch.no_grad():
        assert rel(stack(x, mask)[mask.bool()], ref(x, attention_mask=mask).logits[mask.bool()]) <= 1e-5


@pytest.mark.parametrize("form", ["dense", "sorted"])
def test_experts_forms_equal_eager(form):
    """``xla_swap.hf.moe.dense_experts_forward`` / ``sorted_experts_forward`` on a Mixtral experts module: the
    eager implementation's output and gradients (weights, input, routing weights), in eager torch (the
    sorted form's segment loop; the stages' ``ragged_dot`` is checked by the family tests); the model keeps
    its own implementation after the stages are built and run."""
    from xla_swap.hf.moe import dense_experts_forward, experts_modules, sorted_experts_forward
    forward = {"dense": dense_experts_forward, "sorted": sorted_experts_forward}[form]
    model = make("mixtral", EXACT["mixtral"][0])
    impl = model.get_experts_implementation()
    (name, experts), = experts_modules(model.model.layers[0])
    g = torch.Generator().manual_seed(2)
    h = torch.randn(10, 32, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])
    weights = torch.rand(10, 2, generator=g, requires_grad=True)
    grads = []
    for fn in (lambda: type(experts).forward.__wrapped__(experts, h, index, weights),
               lambda: forward(experts, h, index, weights)):
        out = fn()
        out.pow(2).sum().backward()
        grads.append((out.detach(), *(t.grad.clone() for t in (h, weights, *experts.parameters()))))
        for t in (h, weights, *experts.parameters()):
            t.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    first, layers, last = causal_lm_stages(model, experts=form)
    SwappedStack(layers, first=first, last=last, parallel=ParallelConfig(devices=jax.devices()[:1]))(*data("left")[:2])
    assert model.get_experts_implementation() == impl


def test_experts_form_refused_by_name():
    """An unknown ``experts=`` is refused before anything is built or hooked."""
    model = make("mixtral", EXACT["mixtral"][0])
    with pytest.raises(ValueError, match="experts must be one of \\['dense', 'sorted'\\], got 'grouped'"):
        causal_lm_stages(model, experts="grouped")
    assert all(getattr(layer, "_xla_swap_experts", None) is None for layer in model.model.layers)


def test_longrope_factors_chosen_per_call():
    """Phi-3 longrope picks its long or short factors from each call's largest position (a traced
    ``torch.where``): sequences of 6 (short factors, <= ``original_max_position_embeddings`` 8) and 12 (long)
    through one stack equal torch, and no traced value stays on the rotary module as its cache."""
    ref = make("phi3-longrope", EXACT["phi3-longrope"][0])
    first, layers, last = causal_lm_stages(copy.deepcopy(ref))
    stack = SwappedStack(layers, first=first, last=last, parallel=ParallelConfig(devices=jax.devices()[:1]))
    x, mask, _ = data("left")
    for t in (6, 12):
        with torch.no_grad():
            want = ref(x[:, -t:], attention_mask=mask[:, -t:]).logits
        keep = mask[:, -t:].bool()
        assert rel(stack(x[:, -t:], mask[:, -t:])[keep], want[keep]) <= 1e-5
    rotary = first.base_module.rotary_emb
    assert all(type(v) is torch.Tensor for v in vars(rotary).values() if isinstance(v, torch.Tensor))


def test_wrong_final_norm_says_norm_attr():
    """Lfm2's final norm is ``embedding_norm``: told there is none (``norm_attr=""``), the probe refuses with an
    error saying which norm it used and to pass ``norm_attr=``."""
    model = make("lfm2", EXACT["lfm2"][0])
    with pytest.raises(ValueError, match="Lfm2ForCausalLM: the stages' logits differ .* final norm used: None\\): "
                                         "pass norm_attr= naming the base model's final norm"):
        causal_lm_stages(model, norm_attr="")
    first, layers, last = causal_lm_stages(model)
    assert last.norm_attr == "embedding_norm"
