"""``SwappedStack.generate``: the tokens of Hugging Face's ``model.generate`` for small Llama, Mistral
(sliding window shorter than the sequence), Qwen2, Gemma-2, Gemma-3, Mixtral, GPT-NeoX, Phi-3 with longrope and Falcon
models, batch 4, left padding, 32 new tokens; sampling reproducible; the KV cache on the host and on the device equal; decode compiled once;
bad arguments refused before anything runs. Phi-3 longrope is refused by name at the bottom of the transformers
range (``transformers_ends.py``)."""
import pytest
import torch
import transformers
from torch.distributed.fsdp import MixedPrecisionPolicy

import xla_swap
from transformers_ends import LONGROPE_REFUSAL, LONGROPE_TRACED_FROM, older_than

V = 128
NEW = 32


def _model(family):
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=8, tie_word_embeddings=False)
        cls = transformers.MistralForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    elif family == "gemma2":
        cfg = transformers.Gemma2Config(**common, head_dim=16, sliding_window=8, tie_word_embeddings=True)
        cls = transformers.Gemma2ForCausalLM
    elif family == "gemma3":   # sliding and full layers, a rotary embedding per layer type
        cfg = transformers.Gemma3TextConfig(**common, head_dim=16, sliding_window=8)
        cls = transformers.Gemma3ForCausalLM
    elif family.startswith("phi3-longrope"):   # short rotary factors up to `orig` positions, long ones past them
        orig = int(family.split("-")[-1]) if family.count("-") == 2 else 8   # 8: the prompts of 11 start long
        factors = dict(short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.1 * i for i in range(8)])
        cfg = transformers.Phi3Config(**common, pad_token_id=0, original_max_position_embeddings=orig,
                                      rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                           original_max_position_embeddings=orig, **factors))
        cls = transformers.Phi3ForCausalLM
    elif family == "falcon":   # its layers return a tuple the model indexes with [0]
        cfg = transformers.FalconConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=256)
        cls = transformers.FalconForCausalLM
    elif family == "gpt_neox":   # its layers take the cache as layer_past=
        cfg = transformers.GPTNeoXConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=256)
        cls = transformers.GPTNeoXForCausalLM
    else:                      # mixture of experts (dense dispatch in the stages)
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                         tie_word_embeddings=False)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    return cls(cfg).float().eval()


def _prompts():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (4, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    return ids, mask


def _stack(model):
    first, layers, last = xla_swap.causal_lm_stages(model)
    return xla_swap.SwappedStack(layers, first=first, last=last)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2", "gemma3", "mixtral", "gpt_neox",
                                    "phi3-longrope", "falcon"])
def test_greedy_equals_hf(family):
    """The stack's greedy tokens equal HF generate's; Phi-3 longrope below the transformers version whose
    longrope traces is refused at construction with the message naming its code (``transformers_ends.py``)."""
    model = _model(family)
    ids, mask = _prompts()
    if family == "phi3-longrope" and older_than(LONGROPE_TRACED_FROM):
        with pytest.raises(ValueError) as info:
            _stack(model)
        assert all(piece in str(info.value) for piece in LONGROPE_REFUSAL), str(info.value)
        return
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    got = _stack(model).generate(ids, mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    assert got.shape == ref.shape == (4, 11 + NEW)
    assert torch.equal(got, ref), (got[:, 11:], ref[:, 11:])


def test_longrope_switch_mid_generation_refused():
    """Phi-3 longrope whose generation would grow past ``original_max_position_embeddings`` (16, from a prompt
    of 11): transformers' generate drops its cache there and runs the sequence again with the long factors, a
    cached generation cannot: refused by name before anything runs; within 17 positions it equals HF."""
    model = _model("phi3-longrope-16")
    ids, mask = _prompts()
    stack = _stack(model)
    with pytest.raises(ValueError, match="model.rotary_emb \\(Phi3RotaryEmbedding\\) rope_type 'longrope' switches to "
                                         "its long factors past original_max_position_embeddings=16"):
        stack.generate(ids, mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    assert torch.equal(stack.generate(ids, mask, max_new_tokens=6, eos_token_id=None, pad_token_id=0), ref)


def test_stop_tokens_equal_hf():
    """A stop token that the greedy run emits: the row stops, gets the pad, and the loop ends when every row did."""
    model = _model("llama")
    ids, mask = _prompts()
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    eos = [int(free[0, 11 + 3]), int(free[1, 11 + 5])]   # tokens rows 0 and 1 emit
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                         pad_token_id=1)
    got = _stack(model).generate(ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=1)
    assert torch.equal(got, ref), (got[:, 11:], ref[:, 11:])
    assert int((got[:2, 11:] == 1).sum()) > 0   # rows 0 and 1 stopped and were padded


def test_sampling_reproducible_and_host_cache_equal():
    model = _model("llama")
    ids, mask = _prompts()
    stack = _stack(model)
    kw = dict(max_new_tokens=NEW, eos_token_id=None, max_cache_len=64)
    greedy = stack.generate(ids, mask, **kw)
    a = stack.generate(ids, mask, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=3, **kw)
    b = stack.generate(ids, mask, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=3, **kw)
    c = stack.generate(ids, mask, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=4, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, greedy)
    assert torch.equal(stack.generate(ids, mask, do_sample=True, top_k=1, seed=5, **kw), greedy)
    assert stack.last_generation["placement"] == "device"
    # the KV cache in pinned_host, streamed with the weights: the same tokens
    host = stack.generate(ids, mask, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=3, kv_cache="host",
                          **kw)
    assert stack.last_generation["placement"] == "host"
    assert torch.equal(host, a)
    assert torch.equal(stack.generate(ids, mask, kv_cache="host", **kw), greedy)
    # auto with a budget below the cache: host; the explanation names the per-layer bytes
    stack.generate(ids, mask, device_budget_bytes=1024, **kw)
    info = stack.last_generation
    assert info["placement"] == "host"
    # 2 layers x 2 (K, V) x batch 4 x kv_heads 2 x head_dim 16 x cache 64 x 4 bytes
    assert info["kv_cache_bytes_per_layer"] == [2 * 4 * 2 * 16 * 64 * 4] * 2
    assert "1024" in info["explanation"]


def test_decode_compiled_once():
    model = _model("llama")
    ids, mask = _prompts()
    stack = _stack(model)
    stack.generate(ids, mask, max_new_tokens=2, eos_token_id=None, max_cache_len=64)
    gen = stack.generators.current
    after_two = gen.streamer.num_executables
    stack.generate(ids, mask, max_new_tokens=NEW, eos_token_id=None, max_cache_len=64)
    info = stack.last_generation
    assert info["new_tokens"] == NEW and len(info["step_done_s"]) == NEW
    assert info["first_token_s"] == info["step_done_s"][0] and sorted(info["step_done_s"]) == info["step_done_s"]
    assert gen.streamer.num_executables == after_two
    # first, one shared layer and last, for the prefill and for the decode signature
    assert after_two == 6


def test_choose_batch_grows_with_the_budget():
    from xla_swap.hf.generate import choose_batch
    stack = _stack(_model("llama"))
    small, why = choose_batch(stack, 11, NEW, device_budget_bytes=4 << 20)
    large, _ = choose_batch(stack, 11, NEW, device_budget_bytes=64 << 20)
    assert 1 <= small < large <= 1024 and "KV cache" in why
    assert choose_batch(stack, 11, NEW, device_budget_bytes=1 << 40, max_batch=48)[0] == 48
    with pytest.raises(ValueError, match="device_budget_bytes"):
        choose_batch(stack, 11, NEW)          # the CPU has no memory statistics


def test_choose_batch_over_devices_is_a_multiple_that_fits(num_devices):
    """Over n data-parallel devices each holds B / n sequences and 1/n of the prefetched weights: the batch is a
    multiple of n, and the chosen batch's prefill (compiled) fits the per-device budget with its KV cache (the
    estimate counts the cache also among the executables' outputs: conservative, within a factor 2)."""
    import jax
    from xla_swap.hf.generate import choose_batch, prefill_temps
    from xla_swap.hf.generators import Generator
    first, layers, last = xla_swap.causal_lm_stages(_model("llama"))
    stack = xla_swap.SwappedStack(layers, first=first, last=last,
                                  parallel=xla_swap.ParallelConfig(devices=jax.devices()))
    n = num_devices
    assert stack.runtime.batch_axis is not None
    budget = 16 << 20
    batch, why = choose_batch(stack, 11, NEW, device_budget_bytes=budget)
    assert batch % n == 0 and batch >= n and f"multiple of the {n}" in why
    gen = Generator(stack, batch, 48, "device", budget)
    window = -(-gen.window // n)
    used = max(prefill_temps(gen, batch, 16, 48)) + gen.kv_total // n + window
    assert used <= budget, (used, budget, why)
    more = Generator(stack, 2 * batch, 48, "device", budget)   # not far below what fits: twice the batch does not
    assert max(prefill_temps(more, 2 * batch, 16, 48)) + more.kv_total // n + window > budget


def test_bad_arguments_refused_before_running():
    model = _model("llama")
    ids, mask = _prompts()
    stack = _stack(model)
    bad = [
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=4, temperature=0.0), ValueError, "temperature"),
        (dict(max_new_tokens=4, top_k=0), ValueError, "top_k"),
        (dict(max_new_tokens=4, top_p=1.5), ValueError, "top_p"),
        (dict(max_new_tokens=4, kv_cache="disk"), ValueError, "kv_cache"),
        (dict(max_new_tokens=4, device_budget_bytes=-1), ValueError, "device_budget_bytes"),
        (dict(max_new_tokens=4, max_cache_len=8), ValueError, "max_cache_len"),
        (dict(max_new_tokens=4, eos_token_id=V + 5), ValueError, "eos_token_id"),
        (dict(max_new_tokens=4, do_sample="yes"), TypeError, "do_sample"),
    ]
    for kw, err, word in bad:
        with pytest.raises(err, match=word):
            stack.generate(ids, mask, **kw)
    right = torch.ones_like(ids)
    right[0, -2:] = 0
    with pytest.raises(ValueError, match="left-padded"):
        stack.generate(ids, right, max_new_tokens=4)
    with pytest.raises(ValueError, match="attention_mask"):
        stack.generate(ids, mask[:, :5], max_new_tokens=4)
    with pytest.raises(TypeError, match="input_ids"):
        stack.generate(ids.float(), mask, max_new_tokens=4)
    assert not hasattr(stack, "last_generation")   # nothing ran
    first, layers, last = xla_swap.causal_lm_stages(model)
    with pytest.raises(TypeError, match="causal_lm_stages"):
        xla_swap.SwappedStack(layers).generate(ids, max_new_tokens=4)
    # still usable
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    assert torch.equal(stack.generate(ids, mask, max_new_tokens=4, eos_token_id=None, pad_token_id=0), ref)


def _params_to_bf16(model):
    """A copy of ``model`` with its parameters in bf16 and its buffers (rotary ``inv_freq``) as built: what
    ``param_dtype=torch.bfloat16`` computes with (it casts parameters, as FSDP2's ``MixedPrecisionPolicy``;
    ``model.to(torch.bfloat16)`` would also round ``inv_freq``, another model)."""
    import copy
    bf = copy.deepcopy(model)
    for p in bf.parameters():
        p.data = p.data.to(torch.bfloat16)
    return bf


def _teacher_forced_logits(model, seq, mask):
    """float32 ``[B, new, V]``: ``model``'s logits predicting each generated token of ``seq`` (prompt then new)."""
    full = torch.cat([mask, torch.ones(seq.shape[0], seq.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
    with torch.no_grad():
        return model(seq, attention_mask=full).logits[:, mask.shape[1] - 1:-1].float()


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_bf16_param_dtype_generates_the_bf16_models_tokens(family):
    """Mixed precision (float32 masters, ``param_dtype=torch.bfloat16``) generates exactly the tokens of the stack of
    the model whose parameters are bf16 (the same computation), with the KV cache on the device and in
    ``pinned_host``. Against ``transformers``' generate of that bf16 model the tokens cannot be equal by construction:
    XLA and torch round bf16 arithmetic differently, and these random models' bf16 logits have exact ties (a top-2
    margin of 0). So each row either equals Hugging Face's tokens or first differs where the stack's token's
    Hugging Face logit is within ``2 delta`` of the top one, ``delta`` the largest bf16-vs-float32 difference of
    Hugging Face's own logits on the same sequences (the size of bf16 rounding here)."""
    model = _model(family)
    bf = _params_to_bf16(model)
    ids, mask = _prompts()
    kw = dict(max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    first, layers, last = xla_swap.causal_lm_stages(model)
    mixed = xla_swap.SwappedStack(layers, first=first, last=last,
                                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    got = mixed.generate(ids, mask, **kw)
    assert torch.equal(mixed.generate(ids, mask, kv_cache="host", **kw), got)
    assert torch.equal(_stack(bf).generate(ids, mask, **kw), got)
    ref = bf.generate(ids, attention_mask=mask, do_sample=False, **kw)
    hf_bf16 = _teacher_forced_logits(bf, ref, mask)
    delta = float((hf_bf16 - _teacher_forced_logits(model, ref, mask)).abs().max())
    assert 0 < delta < 1, delta
    p = ids.shape[1]
    rows_equal = 0
    for r in range(ids.shape[0]):
        diff = (got[r, p:] != ref[r, p:]).nonzero()
        if len(diff) == 0:
            rows_equal += 1
            continue
        s = int(diff[0])   # the same prefix up to s: Hugging Face's logits at s are those of the stack's sequence
        gap = float(hf_bf16[r, s].max() - hf_bf16[r, s, got[r, p + s]])
        assert gap <= 2 * delta, (family, r, s, gap, delta)
    assert rows_equal >= 1
