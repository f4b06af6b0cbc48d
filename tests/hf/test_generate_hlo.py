"""The KV cache in ``pinned_host`` and on the device run the same computation: the decode (and prefill)
executables of a bf16 Llama stack compute the same multiset of operations (``hlo_arithmetic`` of
benchmarks/generate_gpu.py: opcodes, result types and dims, without names, layouts, memory spaces or
copies) for ``kv_cache="host"`` as for ``kv_cache="device"``; on the CPU their optimized HLO is also equal
apart from names, and the caches hold the same bits after the run. A GPU run that gives other tokens for the two placements therefore differs in how
XLA compiled the same computation (its kernels), not in what the host path computes."""
import jax
import jax.numpy as jnp
import torch
import transformers

import generate_gpu  # benchmarks/ is on pytest's pythonpath
import xla_swap

V, B, PROMPT, CACHE = 128, 4, 11, 32


def _bf16_llama():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _signature(t: int):
    i32 = jnp.int32
    return (jax.ShapeDtypeStruct((B, t), i32), jax.ShapeDtypeStruct((B, CACHE), i32),
            jax.ShapeDtypeStruct((B, t), i32), jax.ShapeDtypeStruct((), i32))


def test_host_and_device_kv_cache_compute_the_same_ops():
    model = _bf16_llama()
    first, layers, last = xla_swap.causal_lm_stages(model)
    stack = xla_swap.SwappedStack(layers, first=first, last=last)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (B, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    kw = dict(max_new_tokens=3, eos_token_id=None, max_cache_len=CACHE)
    streamers, tokens = {}, {}
    for placement in ("device", "host"):
        tokens[placement] = stack.generate(ids, mask, kv_cache=placement, **kw)
        assert stack.last_generation["placement"] == placement
        gen = stack.generators.current
        assert gen.streamer.state_on_host[1] is (placement == "host")
        streamers[placement] = gen.streamer
    assert torch.equal(tokens["host"], tokens["device"])
    # the values the cache carries back from pinned_host: every layer's keys and values bit for bit
    for i in range(1, 1 + len(layers)):
        dev, host = streamers["device"].states[i], streamers["host"].states[i]
        assert {a.sharding.memory_kind for a in jax.tree_util.tree_leaves(host)} == {"pinned_host"}
        for a, b in zip(jax.tree_util.tree_leaves(dev), jax.tree_util.tree_leaves(host)):
            assert a.dtype == b.dtype == jnp.bfloat16
            assert (jax.device_get(a).view("uint16") == jax.device_get(b).view("uint16")).all(), i
    compiled = {p: s.num_executables for p, s in streamers.items()}
    p_len = stack.last_generation["prompt_len"]
    for t in (1, p_len):   # the decode step and the prefill
        exes = {p: s.executables(_signature(t)) for p, s in streamers.items()}
        assert len(exes["device"]) == len(exes["host"]) == 2 + len(layers)
        for i, (d, h) in enumerate(zip(exes["device"], exes["host"])):
            assert d is not h   # each placement compiled its own executables
            ops_d, ops_h = generate_gpu.hlo_arithmetic(d.as_text()), generate_gpu.hlo_arithmetic(h.as_text())
            assert ops_d == ops_h, (t, i, (ops_d - ops_h), (ops_h - ops_d))
            assert generate_gpu.hlo_without_names(d.as_text()) == generate_gpu.hlo_without_names(h.as_text())
        # the multiset sees the computation: the layer's bf16 parameters are converted and multiplied
        layer_ops = generate_gpu.hlo_arithmetic(exes["device"][1].as_text())
        assert any(op.startswith("dot ") for op in layer_ops), layer_ops
        assert any(op.startswith("convert ") and "bf16[" in op for op in layer_ops), layer_ops
    # the accessor compiled nothing new (both signatures ran) and ran nothing
    assert {p: s.num_executables for p, s in streamers.items()} == compiled
    # the comparison can fail: the prefill's layer computes other shapes than the decode step's
    dec, pre = (generate_gpu.hlo_arithmetic(streamers["host"].executables(_signature(t))[1].as_text())
                for t in (1, p_len))
    assert dec != pre


def test_hlo_arithmetic_ignores_names_layouts_and_memory_spaces():
    a = """HloModule jit_f, entry_computation_layout={(f32[4,8]{1,0})->f32[4,4]{1,0}}

ENTRY %main.3 (x.1: f32[4,8], w.2: f32[8,4]) -> f32[4,4] {
  %x.1 = f32[4,8]{1,0} parameter(0)
  %w.2 = f32[8,4]{1,0:S(5)} parameter(1)
  %copy.7 = f32[8,4]{1,0} copy(%w.2)
  %mv = f32[8,4]{1,0} custom-call(%copy.7), custom_call_target="MoveToDevice"
  ROOT %dot.3 = f32[4,4]{1,0} dot(%x.1, %mv), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="a"}
}
"""
    b = a.replace("%dot.3", "%d").replace("{1,0:S(5)}", "{0,1}").replace('op_name="a"', 'op_name="b"')
    b = b.replace("  %copy.7 = f32[8,4]{1,0} copy(%w.2)\n", "")
    assert generate_gpu.hlo_arithmetic(a) == generate_gpu.hlo_arithmetic(b) == {
        "dot f32[4,4] lhs_contracting_dims={1} rhs_contracting_dims={0}": 1}
    c = a.replace("rhs_contracting_dims={0}", "rhs_contracting_dims={1}")
    assert generate_gpu.hlo_arithmetic(a) != generate_gpu.hlo_arithmetic(c)
    assert generate_gpu.hlo_arithmetic(a) != generate_gpu.hlo_arithmetic(a.replace("f32[4,4]{1,0} dot", "bf16[4,4]{1,0} dot"))


def test_compare_hlo_names_what_differs():
    a = """HloModule m
ENTRY %e (x: f32[4,8], w: f32[8,4]) -> f32[4,4] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,4]{1,0} parameter(1)
  ROOT %d = f32[4,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, backend_config={"alg":1}
}
"""
    same = generate_gpu.compare_hlo([a], [a.replace("%d", "%dot.9")])
    assert same["arithmetic_equal"] and same["text_equal"] and same["arithmetic_differences"] == []
    kernel = generate_gpu.compare_hlo([a], [a.replace('"alg":1', '"alg":7')])   # another GEMM algorithm
    assert kernel["arithmetic_equal"] and not kernel["text_equal"] and kernel["differing_lines"] == 1
    ops = generate_gpu.compare_hlo([a], [a.replace("f32[4,4]{1,0} dot", "bf16[4,4]{1,0} dot")])
    assert not ops["arithmetic_equal"] and ops["arithmetic_differences"] == [
        "- 1 x dot f32[4,4] lhs_contracting_dims={1} rhs_contracting_dims={0}",
        "+ 1 x dot bf16[4,4] lhs_contracting_dims={1} rhs_contracting_dims={0}"]
