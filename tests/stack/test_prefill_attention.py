"""The causal prefill path of the GPU environment's SDPA (``xla_swap.stack.torch_attention.prefill_attention``), driven
on the CPU with cuDNN's calls stood in for by XLA's attention (no GPU here).

What reaches the kernel is recorded: at trace time (both branches of the device-side check are traced) and at
run time (a host callback in the stand-in: the branch that ran). A prefill mask built by ``transformers``'
``sdpa_mask`` over a fixed-size cache, causal with left padding, runs the causal kernel over the prompt's keys
``[0, T)`` with no mask; a sliding window that reaches inside the prompt, a cache offset > 0, a custom 4D mask, a
hole or right padding run the masked call over every key. Values equal torch's math (``sdpa_reference``) either
way. Then ``generate`` in the GPU environment (stand-ins, fp32 admitted to the fused path) gives the tokens of
``model.generate`` (Llama, Qwen2, Mistral, GPT-NeoX, Mixtral, Falcon) for a left-padded batch and an unpadded
one, with the causal path run where the mask allows it.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import masking_utils

import xla_swap
from xla_swap.stack import torch_attention

F = torch.nn.functional
B, T, S, NQ, NKV, H = 2, 8, 12, 4, 2, 16


@pytest.fixture
def kernel(monkeypatch):
    """cuDNN's calls replaced by XLA's attention, fp32 admitted: ``calls`` (trace time) and ``runs`` (run time)
    list ``(is_causal, key length, mask shape or None)`` of each call."""
    calls, runs = [], []

    def fused(q, k, v, mask, scale, causal, bias=None):
        m = mask if bias is None else bias
        tag = (bool(causal), int(k.shape[1]), None if m is None else tuple(m.shape))
        calls.append(tag)
        jax.debug.callback(lambda: runs.append(tag))
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale, is_causal=causal,
                                            implementation="xla")

    def biased(q, k, v, bias, scale, causal):
        return fused(q, k, v, None, scale, causal, bias)
    monkeypatch.setattr(torch_attention, "_fused", fused)
    monkeypatch.setattr(torch_attention, "_biased", biased)
    monkeypatch.setattr(torch_attention, "_FUSED_DTYPES", (jnp.bfloat16, jnp.float16, jnp.float32))
    return calls, runs


def _mask(fn=masking_utils.causal_mask_function, pad=(3, 0), q_offset=0, t=T, s=S, kv2d=None):
    """``transformers``' SDPA mask ``[B, 1, t, s]`` (bool) for a prefill of ``t`` tokens at cache slot ``q_offset``
    into a cache of ``s`` slots: rows left-padded by ``pad``, slots past the prompt empty (as ``generate`` sets them)."""
    if kv2d is None:
        kv2d = torch.zeros(len(pad), s, dtype=torch.bool)
        for b, p in enumerate(pad):
            kv2d[b, p:q_offset + t] = True
    return masking_utils.sdpa_mask(batch_size=kv2d.shape[0], q_length=t, kv_length=s, q_offset=q_offset,
                                   mask_function=fn, attention_mask=kv2d, allow_is_causal_skip=False)


def _attend(mask, dtype=torch.float32, t=T, s=S, prefill=True):
    """SDPA in the GPU environment (jitted, the mask an argument: checked on the device) and torch's math."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, NQ, t, H, generator=g).to(dtype)
    k, v = (torch.randn(B, NKV, s, H, generator=g).to(dtype) for _ in range(2))
    env = torch_attention.torchax_env("gpu")

    def f(q, k, v, m):
        with env:
            args = env.j2t_iso((q, k, v, m))
            return env.t2j_iso(F.scaled_dot_product_attention(*args[:3], attn_mask=args[3], enable_gqa=True))
    arrays = [jnp.asarray(x.float().numpy()).astype(jnp.dtype(str(dtype).split(".")[-1])) for x in (q, k, v)]
    m = jnp.asarray(mask.numpy()) if mask.dtype == torch.bool else jnp.asarray(mask.float().numpy()).astype(arrays[0].dtype)
    if prefill:
        with torch_attention.prefill_attention():
            out = jax.jit(f)(*arrays, m)
    else:
        out = jax.jit(f)(*arrays, m)
    ref = torch_attention.sdpa_reference(q.float(), k.float(), v.float(), mask if mask.dtype == torch.bool
                                         else mask.float(), enable_gqa=True)
    return np.asarray(jnp.asarray(out, jnp.float32)), ref.numpy()


FAST = {
    "causal_left_padded": dict(),
    "causal_unpadded": dict(pad=(0, 0)),
    "cache_as_long_as_the_prompt": dict(s=T),
    "window_wider_than_the_prompt": dict(fn=masking_utils.sliding_window_causal_mask_function(T + 1)),
}
def _with_key_past_the_prompt():
    m = _mask()
    m[:, :, -1, T] = True                                   # the last query also sees cache slot T
    return m


def _custom_4d():
    g = torch.Generator().manual_seed(2)
    return (torch.rand(B, 1, T, S, generator=g) < 0.5) | torch.eye(T, S, dtype=torch.bool)


MASKED = {
    "sliding_window": lambda: _mask(fn=masking_utils.sliding_window_causal_mask_function(3)),
    "cache_offset": lambda: _mask(q_offset=2, pad=(1, 0)),
    "padding_hole": lambda: _mask(kv2d=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0]] * B, dtype=torch.bool)),
    "right_padding": lambda: _mask(kv2d=torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]] * B, dtype=torch.bool)),
    "key_past_the_prompt": _with_key_past_the_prompt,
    "custom_4d": _custom_4d,
    "bidirectional": lambda: _mask(fn=masking_utils.bidirectional_mask_function),
}


@pytest.mark.parametrize("case", sorted(FAST))
def test_causal_left_padded_prefill_runs_the_causal_kernel_over_the_prompt(kernel, case):
    calls, runs = kernel
    kw = FAST[case]
    s = kw.get("s", S)
    before = torch_attention.kernel_counts().get("causal_prefill", 0)
    out, ref = _attend(_mask(**kw), s=s)
    assert runs == [(True, T, None)]                          # causal, keys [0, T), no mask: the branch that ran
    assert sorted(calls, key=str) == sorted([(True, T, None), (False, s, (B, 1, T, s))], key=str)
    assert torch_attention.kernel_counts()["causal_prefill"] == before + 1
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)   # padding queries: zeros, as torch's math


@pytest.mark.parametrize("case", sorted(MASKED))
def test_other_masks_run_the_masked_call_over_every_key(kernel, case):
    calls, runs = kernel
    out, ref = _attend(MASKED[case]())
    assert runs == [(False, S, (B, 1, T, S))]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_bf16_causal_prefill_equals_torch(kernel):
    _, runs = kernel
    out, ref = _attend(_mask(), dtype=torch.bfloat16)
    assert runs == [(True, T, None)]
    np.testing.assert_allclose(out, ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("case", ["outside_prefill_attention", "float_mask", "one_query"])
def test_no_check_traced_where_the_path_does_not_apply(kernel, case):
    """Outside ``prefill_attention``, for a float mask and for one query (a decode step) the causal path is not
    even traced: one masked call."""
    calls, runs = kernel
    t = 1 if case == "one_query" else T
    mask = _mask(t=t, pad=(0, 0), q_offset=S - 1) if t == 1 else _mask()
    if case == "float_mask":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    out, ref = _attend(mask, t=t, prefill=case != "outside_prefill_attention")
    assert all(not c[0] and c[1] == S for c in calls) and len(runs) == 1
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture
def gpu_env(kernel, monkeypatch):
    """``SwappedStack`` traced in the GPU environment on the CPU (the kernel's stand-ins), runs counted."""
    import xla_swap.stack.swapped_stack
    monkeypatch.setattr(xla_swap.stack.swapped_stack, "torchax_env", lambda platform: torch_attention.torchax_env("gpu"))
    torch_attention.count_causal_prefill_runs(True)
    yield
    torch_attention.count_causal_prefill_runs(False)


@pytest.mark.parametrize("family,window,padded", [("llama", None, True), ("llama", None, False),
                                                  ("qwen2", None, True), ("mistral", 8, True),
                                                  ("mistral", 64, True), ("gpt_neox", None, True),
                                                  ("mixtral", None, True), ("falcon", None, True)])
def test_generate_in_the_gpu_environment_equals_hf(gpu_env, family, window, padded):
    """Greedy tokens equal ``model.generate``'s (fp32); every layer's prefill ran the causal path unless a
    sliding window (8) reaches inside the 16-token prefill; decode steps never take it."""
    from test_generate import _model, _prompts
    model = _model(family)
    if window is not None:
        model.config.sliding_window = window
    ids, mask = _prompts()
    if not padded:
        mask = torch.ones_like(mask)
    new = 6
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    first, layers, last = xla_swap.causal_lm_stages(model)
    stack = xla_swap.SwappedStack(layers, first=first, last=last)
    before = torch_attention.kernel_counts().get("causal_prefill_run", 0)
    got = stack.generate(ids, mask, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got, ref), (got[:, 11:], ref[:, 11:])
    ran = torch_attention.kernel_counts().get("causal_prefill_run", 0) - before
    assert ran == (0 if window == 8 else model.config.num_hidden_layers)
