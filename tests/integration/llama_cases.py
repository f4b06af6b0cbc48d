"""Shared cases of the ``SwappedStack`` training tests: a small ``transformers`` Llama in float32,
its loss, token batches, the Hugging Face Trainer's param groups and a warm-up + cosine schedule.

Used by ``test_stack.py``, ``test_stack_optim.py`` and ``test_stack_checkpoint.py``.
"""
import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

#: vocabulary size of the small models.
V = 96


def make_model(layers=3, seed=0, ffn=64):
    """A random-init Llama decoder (hidden 32, 4/2 heads, untied), float32, eval mode."""
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float().eval()


def ce(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def batches(steps, b=2, t=12, seed=0):
    """``steps`` pairs ``(inputs [b, t], targets [b, t])`` of random token ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, V, (b, t + 1), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def hf_groups(model, wd):
    """The Hugging Face Trainer's grouping: weight decay on matrices, none on norms and biases."""
    params = list(model.named_parameters())
    return [{"params": [p for n, p in params if p.ndim >= 2], "weight_decay": wd},
            {"params": [p for n, p in params if p.ndim < 2], "weight_decay": 0.0}]


def warmup_cosine(opt, warmup=2, total=8):
    """``transformers.get_cosine_schedule_with_warmup``, written out (LambdaLR)."""
    def f(step):
        if step < warmup:
            return step / warmup
        prog = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * prog)))
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
