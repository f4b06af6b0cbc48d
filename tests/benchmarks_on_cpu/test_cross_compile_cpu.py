"""``benchmarks/cross_compile.py`` on virtual CPU devices: a stack's programs lowered again for other devices at
the target's token counts, and the compiled HLO's transposes and collectives read off the text."""
import json

import jax
import pytest

import cross_compile  # benchmarks/ is on pytest's pythonpath

# the shapes XLA's GPU compiler wrote for the 8B-like layer's backward under the largest-dimension split
# (benchmarks/results/llama_multi_gpu/README.md, eighth run), cut to the lines the summary reads
GPU_HLO = """HloModule jit_fn, is_scheduled=true

%fused_convert_transpose (param_0.935: bf16[4096,7168], param_1.2: f32[1,8]) -> (bf16[4096,7168], bf16[7168,4096]) {
  %param_0.935 = bf16[4096,7168]{1,0} parameter(0)
  %transpose.109.5 = f32[7168,4096]{1,0} transpose(%convert.2.3), dimensions={1,0}
  ROOT %tuple = (bf16[4096,7168]{1,0}, bf16[7168,4096]{1,0}) tuple(%a, %b)
}

ENTRY %main.1 (param: bf16[4,4096,4096], param.10: bf16[4096,7168]) -> bf16[4096,7168] {
  %param = bf16[4,4096,4096]{2,1,0} parameter(0), metadata={scheduling_name="param"}
  %copy.10 = bf16[4,4096,4096]{2,1,0} copy(%param), metadata={scheduling_name="copy.10"}
  %all-gather-start = (bf16[2048,14336]{1,0}, bf16[4096,14336]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[1,2]<=[2], dimensions={0}, use_global_device_ids=true
  %reduce-scatter.1 = bf16[7168,4096]{1,0} reduce-scatter(%g), channel_id=2, replica_groups=[1,2]<=[2], dimensions={0}, to_apply=%add
  %input_convert_transpose_fusion = (bf16[4096,7168]{1,0}, /*index=1*/bf16[7168,4096]{1,0}) fusion(%param.10, %x), kind=kInput, calls=%fused_convert_transpose
  %fmha = (bf16[4,32,4096,128]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax"
  ROOT %gte = bf16[4096,7168]{1,0} get-tuple-element(%input_convert_transpose_fusion), index=0
}
"""


def test_hlo_summary_reads_tuple_fusions_async_collectives_and_skips_fused_insides():
    got = cross_compile.hlo_summary(GPU_HLO)
    assert got["transposes"] == [
        ["copy.10", "bf16[4,4096,4096]{2,1,0}", 4 * 4096 * 4096 * 2],
        ["input_convert_transpose_fusion", "bf16[4096,7168]{1,0}", 2 * 4096 * 7168 * 2]]   # not transpose.109.5
    assert got["transpose_bytes"] == 4 * 4096 * 4096 * 2 + 2 * 4096 * 7168 * 2
    assert got["collectives"] == [["all-gather-start", "bf16[4096,14336]{1,0}", "0"],   # the result
                                  ["reduce-scatter", "bf16[7168,4096]{1,0}", "0"]]
    assert got["cudnn_attention"] == 1


@pytest.mark.parametrize("shape,want", [
    ((2, 48, 64), (8, 4096, 64)),    # hidden states: batch and sequence
    ((1, 48, 16), (1, 4096, 16)),    # rotary tables: a broadcast batch of 1 stays
    ((96, 256), (32768, 256)),       # flattened tokens
    ((2, 64), (2, 64)),              # a weight is left as it is
])
def test_scaled_shape(shape, want):
    assert cross_compile.scaled_shape(shape, {"b": (2, 8), "s": (48, 4096)}) == want


def test_a_tiny_llama_step_compiles_for_other_devices_at_the_target_tokens(tmp_path):
    """Every program of the step (first, layer, last, and each one's backward with AdamW fused) compiles for
    CPU devices 2 and 3 at 4 x 96 tokens (the step itself runs 4 x 48 on devices 0 and 1); the layers gather
    their weights there, split on their held layout's first dimension; the hooks are undone after."""
    from xla_swap.executors.streaming import compilation
    from xla_swap.stack import torch_attention
    before = compilation.gathered, torch_attention.sdpa_reference, jax.jit
    out = tmp_path / "xc.json"
    assert cross_compile.main(["--target", "cpu", "--devices", "2", "--shape", "tiny", "--batch", "4",
                               "--seq", "96", "--out", str(out), "--gather"]) == 0
    r = json.loads(out.read_text())
    assert r["target_devices"] == [str(d) for d in jax.devices("cpu")[2:4]]
    progs = r["programs"]
    assert len(progs) == 6 and not [p for p in progs if "error" in p], progs
    assert [p["fn"].split(".")[0] for p in progs[:3]] == ["stage_functions", "_layer_stage", "stage_functions"]
    assert "bfloat16[4, 96, 64]" in progs[1]["inputs"] and "int32[4, 96]" in progs[0]["inputs"]
    gathers = [c for c in progs[1]["collectives"] if c[0].startswith("all-gather")]
    assert gathers and all(c[2] == "0" for c in gathers), progs[1]["collectives"]
    assert (compilation.gathered, torch_attention.sdpa_reference, jax.jit) == before
