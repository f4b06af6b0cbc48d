"""A dropped ``SwappedStack`` releases everything it made: the stack, its runtime,
its stage closures (they capture the modules), its converted loss, the executables and the host
buffers of weights and AdamW state are dead once the stack is dropped, by reference counting alone,
on 1 device and with the weights FSDP-sharded over several (the stack's sharding rule is a closure
over the stack). No timing, no RSS: weak references."""
import weakref

import jax
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from xla_swap.stack import SwappedStack, causal_lm_stages

pytestmark = pytest.mark.spmd

V = 64


def ce(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _model():
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float().eval()


def _cycle(model, ids) -> list:
    """Build a stack over ``model``, serve and train one step, drop it; weak references to what it made."""
    first, layers, last = causal_lm_stages(model)
    stack = SwappedStack(layers, first=first, last=last, loss_fn=ce,
                         optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    logits = stack(ids[:, :-1])
    loss = stack.train_step(ids[:, :-1], ids[:, 1:])
    assert logits.shape == (2, 8, V) and torch.isfinite(loss)
    rt = stack.runtime
    made = ([stack, rt] + list(rt._fns) + list(rt._traced_fns) + list(stack.trainer.loss_functions.values())
            + list(rt._loss_jits.values()) + [e for s in rt._sigs.values() for e in s.compiled.values()]
            + jax.tree_util.tree_leaves(rt.host_params) + jax.tree_util.tree_leaves(rt.optimizer_state))
    assert rt.num_executables > 0 and stack.trainer.loss_functions and rt.step == 1
    return [weakref.ref(o) for o in made]


def test_dropped_stack_frees_runtime_closures_executables_and_buffers(num_devices):
    model = _model()
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):                   # a second stack over the same modules releases the same way
        refs = _cycle(model, ids)
        alive = [type(r()).__name__ for r in refs if r() is not None]
        assert alive == [], f"alive after the stack was dropped (before any gc.collect()): {alive}"
        assert len(refs) > 20
    assert all(p.grad is None for p in model.parameters())   # the caller's modules are untouched
