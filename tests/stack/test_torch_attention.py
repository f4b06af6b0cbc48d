"""torch SDPA in the GPU torchax environment (``xla_swap.stack.torch_attention``) against torch eager.

On a machine without a GPU the environment's cuDNN path refuses at trace time (``cuDNN is not
detected``) and every call takes the reference (torch's math, run by XLA): these tests check the
torch semantics the environment maps (layout, causal, boolean and additive masks, grouped-query
K/V, scale, fully masked rows), values and gradients; ``benchmarks/attention_gpu.py`` checks the
cuDNN path itself against torch on the GPU.
"""
import collections
import types
import warnings

import jax
import numpy as np
import pytest
import torch

from xla_swap.stack import torch_attention

F = torch.nn.functional


def _jax_fn(env, fn):
    def f(*arrays):
        args = env.j2t_iso(arrays)
        with env:
            return env.t2j_iso(fn(*args))
    return f


def _causal_additive(t, s, pad=0, device=None):
    """Causal and left-padded (the first ``pad`` keys masked); a padded query row keeps its own key,
    as transformers' SDPA masks leave no row fully masked."""
    m = torch.full((t, s), torch.finfo(torch.float32).min, device=device).triu(1)
    m[pad:, :pad] = torch.finfo(torch.float32).min
    return m[None, None]


CASES = {
    "causal": (4, 4, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    "additive_mask": (4, 4, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_additive(8, 8, 2, q.device))),
    "bool_mask": (4, 4, lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool, device=q.device).tril()[None, None])),
    "fully_masked_rows": (4, 4, lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=(torch.arange(8, device=q.device)[None, :] >= 3)
        & torch.ones(8, 8, dtype=torch.bool, device=q.device).tril())),
    "gqa_scale": (4, 2, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3,
                                                                        enable_gqa=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_env_sdpa_equals_torch_values_and_grads(case):
    nq, nkv, fn = CASES[case]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 8, 16, generator=g) for n in (nq, nkv, nkv))
    cot = torch.randn(2, nq, 8, 16, generator=g)
    qt, kt, vt = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = fn(qt, kt, vt)
    ref.backward(cot)

    env = torch_attention.torchax_env("gpu")
    before = torch_attention.kernel_counts().get("reference", 0)
    f = _jax_fn(env, fn)
    args = [jax.numpy.asarray(t.numpy()) for t in (q, k, v)]
    out, vjp = jax.vjp(f, *args)
    grads = vjp(jax.numpy.asarray(cot.numpy()))
    assert torch_attention.kernel_counts()["reference"] > before    # no GPU: the reference ran
    np.testing.assert_allclose(np.asarray(out), ref.detach().numpy(), rtol=1e-5, atol=1e-5)
    for gj, gt in zip(grads, (qt.grad, kt.grad, vt.grad)):
        np.testing.assert_allclose(np.asarray(gj), gt.numpy(), rtol=1e-4, atol=1e-5)


def test_gpu_env_refuses_attention_dropout():
    env = torch_attention.torchax_env("gpu")
    f = _jax_fn(env, lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1))
    with pytest.raises(ValueError, match="dropout_p"):
        jax.eval_shape(f, jax.ShapeDtypeStruct((1, 2, 4, 8), np.float32))


def test_one_environment_per_platform_and_torchax_default_untouched():
    from xla_swap._compat.torchax import import_torchax
    default = import_torchax().default_env()
    envs = {p: torch_attention.torchax_env(p) for p in ("cpu", "gpu")}
    assert envs["cpu"] is torch_attention.torchax_env("cpu") and envs["cpu"] is not envs["gpu"]
    assert default not in envs.values()


def test_bf16_llama_keeps_torch_dtypes():
    """SDPA keeps torch's dtype (torchax's softmax upcasts bf16 to fp32): a bf16 Llama builds and its
    logits are bf16, equal to torch eager's within bf16 rounding."""
    from llama_cases import V, make_model
    from xla_swap.stack import SwappedStack, causal_lm_stages
    model = make_model(layers=2).bfloat16()
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    out = stack(ids)
    with torch.no_grad():
        ref = model(ids).logits
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def _xla_attention(calls):
    """Stand-ins for the two cuDNN calls (no GPU here): XLA's attention, counting which one traced."""
    def with_bias_grad(q, k, v, bias, scale, causal):
        calls["bias_grad"] += 1
        return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale, is_causal=causal, implementation="xla")

    def fixed(q, k, v, *, bias, scale, is_causal):
        calls["fixed"] += 1
        return jax.nn.dot_product_attention(q, k, v, bias=jax.lax.stop_gradient(bias), scale=scale,
                                            is_causal=is_causal, implementation="xla")
    from xla_swap._compat import MissingUpstreamAPI
    return with_bias_grad, types.SimpleNamespace(cudnn_attention_fixed_bias=fixed, MissingUpstreamAPI=MissingUpstreamAPI)


def test_float_mask_gradient_only_where_the_mask_is_differentiated(monkeypatch):
    """A float mask is cuDNN's bias: where it is a constant of the differentiated function the
    backward without the bias gradient traces; where it is differentiated, the one with it;
    values and gradients equal XLA's attention either way."""
    calls = collections.Counter()
    with_bias_grad, compat = _xla_attention(calls)
    monkeypatch.setattr(torch_attention, "_cudnn", with_bias_grad)
    monkeypatch.setattr(torch_attention, "_compat_jax", compat)
    r = np.random.default_rng(0)
    q, k, v = (jax.numpy.asarray(r.standard_normal((2, 8, n, 16)), np.float32) for n in (4, 2, 2))
    bias = jax.numpy.asarray(r.standard_normal((1, 1, 8, 8)), np.float32)

    def ref(q, k, v, b):
        return jax.nn.dot_product_attention(q, k, v, bias=b, scale=0.25, implementation="xla").sum()

    def ours(q, k, v, b):
        return torch_attention._biased(q, k, v, b, 0.25, False).sum()
    g = jax.grad(ours, argnums=(0, 1, 2))(q, k, v, bias)
    assert calls == {"fixed": 1}
    for a, b in zip(g, jax.grad(ref, argnums=(0, 1, 2))(q, k, v, bias)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    g4 = jax.grad(ours, argnums=(0, 1, 2, 3))(q, k, v, bias)
    assert calls == {"fixed": 1, "bias_grad": 1}
    ref4 = jax.grad(ref, argnums=(0, 1, 2, 3))(q, k, v, bias)
    assert float(jax.numpy.abs(ref4[3]).max()) > 1e-3           # the bias gradient is not zero
    for a, b in zip(g4, ref4):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_gpu_env_float_mask_through_the_fused_path(monkeypatch):
    """torch SDPA with an additive mask in the GPU environment, the cuDNN calls stood in for by
    XLA's: values and q/k/v gradients equal torch eager's (bf16), the mask not differentiated."""
    calls = collections.Counter()
    with_bias_grad, compat = _xla_attention(calls)
    monkeypatch.setattr(torch_attention, "_cudnn", with_bias_grad)
    monkeypatch.setattr(torch_attention, "_compat_jax", compat)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 8, 16, generator=g).bfloat16() for n in (4, 2, 2))
    mask = _causal_additive(8, 8, 2).bfloat16()
    cot = torch.randn(2, 4, 8, 16, generator=g).bfloat16()

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    qt, kt, vt = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = fn(qt, kt, vt)
    ref.backward(cot)
    before = dict(torch_attention.kernel_counts())
    out, vjp = jax.vjp(_jax_fn(torch_attention.torchax_env("gpu"), fn),
                       *(jax.numpy.asarray(t.float().numpy()).astype(jax.numpy.bfloat16) for t in (q, k, v)))
    grads = vjp(jax.numpy.asarray(cot.float().numpy()).astype(jax.numpy.bfloat16))
    assert torch_attention.kernel_counts().get("cudnn", 0) == before.get("cudnn", 0) + 1
    assert calls == {"fixed": 1}
    np.testing.assert_allclose(np.asarray(out, np.float32), ref.detach().float().numpy(), rtol=2e-2, atol=2e-2)
    for gj, gt in zip(grads, (qt.grad, kt.grad, vt.grad)):
        np.testing.assert_allclose(np.asarray(gj, np.float32), gt.float().numpy(), rtol=5e-2, atol=5e-2)


def test_eager_attention_modules_names_the_eager_layers():
    """A Llama built with attn_implementation="eager" (its layers never call SDPA) is found layer by
    layer; the same model with "sdpa" is not."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from xla_swap.stack import causal_lm_stages
    for impl, expected in (("eager", ["layers[0].self_attn", "layers[1].self_attn"]), ("sdpa", [])):
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl)
        first, layers, last = causal_lm_stages(LlamaForCausalLM(cfg))
        names = ["first", "layers[0]", "layers[1]", "last"]
        assert torch_attention.eager_attention_modules([first, *layers, last], names) == expected
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch_attention.warn_eager_attention([first, *layers, last], names, "gpu")
            torch_attention.warn_eager_attention([first, *layers, last], names, "cpu")   # XLA's form anyway
        assert [str(w.message).split(":")[0] for w in caught] == ([", ".join(expected)] if expected else [])


@pytest.mark.skipif(not torch.cuda.is_available() or jax.default_backend() != "gpu",
                    reason="cuDNN's kernel: an NVIDIA GPU, JAX_PLATFORMS=cuda")
@pytest.mark.parametrize("mask_grad", [False, True])
def test_gpu_float_mask_on_cudnn_equals_torch(mask_grad):
    """On the GPU, SDPA with a float mask runs cuDNN's kernel; the q/k/v gradients, and the mask's
    where it is differentiated, equal torch's within bf16 rounding."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    m = (torch.randn(1, 1, 512, 512, device="cuda", generator=g) * 0.5).bfloat16()

    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    ts = [t.clone().requires_grad_(True) for t in (q, k, v, m)]
    fn(*ts).float().sum().backward()
    f = _jax_fn(torch_attention.torchax_env("gpu"), fn)
    argnums = (0, 1, 2, 3) if mask_grad else (0, 1, 2)
    before = torch_attention.kernel_counts().get("cudnn", 0)
    grads = jax.jit(jax.grad(lambda *a: f(*a).astype("float32").sum(), argnums=argnums))(
        *(jax.dlpack.from_dlpack(t) for t in (q, k, v, m)))
    assert torch_attention.kernel_counts()["cudnn"] == before + 1
    for gj, t in zip(grads, ts):
        gt = t.grad.float()
        assert float((torch.from_dlpack(gj).float() - gt).norm() / gt.norm()) < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available() or jax.default_backend() != "gpu",
                    reason="cuDNN's kernel: an NVIDIA GPU, JAX_PLATFORMS=cuda")
@pytest.mark.parametrize("mask_kind", ["padding_2d", "float_4d"])
def test_gpu_llama_padded_batch_equals_torch_on_the_device(mask_kind):
    """A bf16 Llama through SwappedStack on the GPU (cuDNN attention) with a left-padded batch, its
    mask given as transformers' 2D padding mask (a boolean SDPA mask) or as a 4D float mask: the
    loss over the real tokens and every gradient equal torch's on the device within bf16 rounding.
    Padded positions are out of the loss: there torch's CUDA SDPA returns unspecified values for
    a query with no key, the stack zeros (torch's CPU result)."""
    import copy
    from transformers import LlamaConfig, LlamaForCausalLM
    from xla_swap.stack import SwappedStack, causal_lm_stages
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).bfloat16()
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, 128, dtype=torch.long)
    pad[0, :16] = 0
    keep = torch.ones(128, 128, dtype=torch.bool).tril()[None, None] & pad[:, None, None, :].bool()
    keep = keep | ~keep.any(-1, keepdim=True)
    mask = pad if mask_kind == "padding_2d" else \
        torch.zeros(2, 1, 128, 128, dtype=torch.bfloat16).masked_fill(~keep, torch.finfo(torch.bfloat16).min)
    labels = ids.masked_fill(pad == 0, -100)

    def ce(lo, y):
        return F.cross_entropy(lo.flatten(0, 1).float(), y.flatten(), ignore_index=-100)
    ref = copy.deepcopy(model).cuda()
    ref_loss = ce(ref(ids.cuda(), attention_mask=mask.cuda()).logits, labels.cuda())
    ref_loss.backward()
    first, layers, last = causal_lm_stages(model)
    before = torch_attention.kernel_counts().get("cudnn", 0)
    loss = SwappedStack(layers, first=first, last=last, loss_fn=ce).train_step((ids, mask), (labels,))
    assert torch_attention.kernel_counts()["cudnn"] > before
    assert abs(float(loss) - float(ref_loss)) < 1e-2 * abs(float(ref_loss))
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        err = float((p.grad.float() - q.grad.float().cpu()).norm() / q.grad.float().norm())
        assert err < 3e-2, (name, err)
