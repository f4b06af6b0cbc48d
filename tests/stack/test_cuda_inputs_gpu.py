"""CUDA tensors on any local GPU through ``SwappedStack`` on two GPUs (skipped without two NVIDIA GPUs and
``JAX_PLATFORMS=cuda``): a small bf16 Hugging Face Llama (SDPA: cuDNN's attention), its inputs and labels
on ``cuda:0`` and ``cuda:1`` in every pairing (and CPU inputs with CUDA labels), on both GPUs
(``data_parallel``) and on the first alone, at a batch that splits over the two and one that does not
(run replicated):

* ``train_step``: the loss and every parameter's gradient equal torch's on the device (bf16 rounding);
* ``forward``: the logits equal torch's, on the first CUDA input's device;
* ``generate`` with ``input_ids`` on ``cuda:1``: the tokens of the one-GPU stack on two GPUs (bf16,
  cuDNN), and Hugging Face's ``model.generate`` on the device for a float32 model; ``choose_batch`` on two.

On a two-GPU machine, from the repository root with the wheels of ``benchmarks/WHEELS.md`` in ``.whl/``
(with pytest, or as a script where pytest is not installed)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit
    export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
    if python3 -c "import pytest" 2>/dev/null; then python3 -m pytest -q -p no:cacheprovider \
        tests/stack/test_cuda_inputs_gpu.py; else python3 tests/stack/test_cuda_inputs_gpu.py; fi
"""
import copy
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # torch shares the GPUs in this process

import jax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2 and jax.default_backend() == "gpu" \
        and len(jax.devices()) >= 2


pytestmark = pytest.mark.skipif(not _two_gpus(), reason="two NVIDIA GPUs with JAX_PLATFORMS=cuda")

V, T = 256, 128
PAIRS = [("cuda:0", "cuda:0"), ("cuda:1", "cuda:0"), ("cuda:0", "cuda:1"), ("cuda:1", "cuda:1"), ("cpu", "cuda:1")]


def _model(dtype=torch.bfloat16, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def ce(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _stack(model, n_gpus):
    from xla_swap.stack import SwappedStack, causal_lm_stages
    from xla_swap.stack.config import ParallelConfig
    first, layers, last = causal_lm_stages(model)
    return SwappedStack(layers, first=first, last=last, loss_fn=ce,
                        parallel=ParallelConfig(devices=jax.devices()[:n_gpus]))


def _rel(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("n_gpus", [2, 1])
@pytest.mark.parametrize("batch", [4, 3])
def test_cuda_inputs_and_labels_train_and_forward_as_torch(n_gpus, batch):
    model = _model()
    ref = copy.deepcopy(model).to("cuda:0")
    stack = _stack(model, n_gpus)
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, V, (batch, T + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    ref.zero_grad(set_to_none=True)
    ref_loss = ce(ref(x.to("cuda:0")).logits, y.to("cuda:0"))
    ref_loss.backward()
    with torch.no_grad():
        ref_logits = ref(x.to("cuda:0")).logits
    for xd, yd in PAIRS:
        model.zero_grad(set_to_none=True)
        loss = stack.train_step(x.to(xd), y.to(yd))
        assert abs(float(loss) - float(ref_loss)) <= 1e-2 * abs(float(ref_loss)), (xd, yd)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) < 3e-2, (xd, yd, name)
        with torch.no_grad():
            out = stack(x.to(xd))
        assert out.device == torch.device(xd if xd != "cpu" else "cpu")
        assert _rel(out, ref_logits) < 2e-2, (xd, yd)


def test_generate_from_cuda_1_on_two_gpus():
    from xla_swap.hf.generate import choose_batch
    ids = torch.randint(3, V, (3, 11), generator=torch.Generator().manual_seed(4))
    model = _model()
    one = _stack(copy.deepcopy(model), 1).generate(ids.to("cuda:0"), max_new_tokens=8, eos_token_id=None,
                                                   pad_token_id=0)
    two = _stack(model, 2)
    got = two.generate(ids.to("cuda:1"), max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got, one) and torch.equal(got[:, :11], ids)
    batch, why = choose_batch(two, 11, 8)
    assert batch >= 1 and "batch" in why
    f32 = _model(torch.float32, seed=1)
    want = copy.deepcopy(f32).to("cuda:0").generate(ids.to("cuda:0"), max_new_tokens=8, do_sample=False,
                                                     eos_token_id=None, pad_token_id=0)
    assert torch.equal(_stack(f32, 2).generate(ids.to("cuda:1"), max_new_tokens=8, eos_token_id=None,
                                               pad_token_id=0), want.cpu())


if __name__ == "__main__":   # where pytest is not installed
    if not _two_gpus():
        raise SystemExit("skipped: needs two NVIDIA GPUs with JAX_PLATFORMS=cuda")
    for n in (2, 1):
        for b in (4, 3):
            test_cuda_inputs_and_labels_train_and_forward_as_torch(n, b)
            print(f"ok train_step / forward, {n} GPU(s), batch {b}", flush=True)
    test_generate_from_cuda_1_on_two_gpus()
    print("ok generate / choose_batch", flush=True)
