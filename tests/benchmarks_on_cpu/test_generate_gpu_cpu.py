"""The generation benchmark (benchmarks/generate_gpu.py) in its CPU smoke mode: both build paths (a real
model, and a meta-device model with random weights per stage), every row timed, the floor ratios present,
the stack's greedy tokens equal to transformers' generate, the host KV cache giving the device cache's tokens and compiling the same HLO."""
import json
import math

import generate_gpu  # benchmarks/ is on pytest's pythonpath


def test_cpu_smoke(tmp_path):
    out = tmp_path / "gen.json"
    assert generate_gpu.main(["--cpu-smoke", "--kv-host-70b", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["bandwidth"]["h2d_GBps"] > 0 and data["host_pool_GiB"] >= 1
    s8, s70 = data["shapes"]["8b"], data["shapes"]["70b"]
    assert s8["hf_tokens_equal"] is True
    assert s8["accelerate"]["skipped"]          # no CUDA here
    for s in (s8, s70):
        assert set(s["rows"]) >= {"stack_b1", "stack_b2", "stack_b2_kvhost"}
        for name, r in s["rows"].items():
            assert r["decode_step_s"] > 0 and r["ttft_s"] > 0
            if name.startswith("stack"):
                assert r["ratio_to_floor"] > 0 and r["floor_s"] >= s["link_floor_s"]
            if "decode_steps_s" in r:   # the mean is the steps' total over their count, whatever the reads' lag
                assert math.isclose(r["decode_mean_s"], sum(r["decode_steps_s"]) / len(r["decode_steps_s"]))
        assert s["rows"]["stack_b2_kvhost"]["placement"] == "host"
        assert s["rows"]["stack_b2_kvhost"]["tokens_equal_device_cache"] is True
        assert s["rows"]["stack_b2_kvhost"]["first_divergence_from_device_cache"] == [-1, -1]
        assert s["rows"]["stack_b2_recompiled"]["tokens_equal_first_run"] is True
        for row, key in (("stack_b2_kvhost", "hlo_vs_device_cache"), ("stack_b2_recompiled", "hlo_vs_first_run")):
            h = s["rows"][row][key]   # the CPU compiles both placements alike: same ops, same text
            assert h["arithmetic_equal"] is True and h["text_equal"] is True, h
    assert s8["rows"]["stack_b1"]["compute_floor_from"] == "resident stack"
    assert s70["rows"]["stack_b1"]["compute_floor_from"] == "W / hbm"
    assert "| 70b" in generate_gpu.render(data)


def test_one_process_per_shape(tmp_path):
    out = tmp_path / "gen.json"
    generate_gpu._per_shape(["--cpu-smoke", "--no-kv-host", "--batches-70b", "1"], ["70b"], str(out))
    data = json.loads(out.read_text())
    rows = data["shapes"]["70b"]["rows"]
    assert set(rows) == {"stack_b1"} and rows["stack_b1"]["decode_step_s"] > 0
    assert data["shapes"]["70b"]["bandwidth"]["h2d_GBps"] > 0


def test_deterministic_xla_flags():
    flags = generate_gpu.deterministic_xla_flags("--xla_gpu_autotune_level=4 --xla_dump_to=/tmp/d")
    assert flags.split() == ["--xla_dump_to=/tmp/d", "--xla_gpu_autotune_level=0"]
    assert generate_gpu.deterministic_xla_flags("") == "--xla_gpu_autotune_level=0"


def test_two_devices_and_own_shapes(tmp_path, num_devices):
    """A shape with its own layer count over 2 devices: floors from both devices' links, resident rows."""
    out = tmp_path / "gen.json"
    assert generate_gpu.main(["--cpu-smoke", "--shapes", "d8192", "--no-kv-host", "--gpus", "2", "--batches", "2",
                              "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["bandwidth"]["gpus"] == 2
    s = data["shapes"]["d8192"]
    assert s["shape"]["layers"] == 2 and s["stream_only_s"] > 0
    assert s["rows"]["stack_b2"]["compute_floor_from"] == "resident stack"
    assert s["rows"]["stack_b2"]["decode_step_s"] > 0


def test_prefill_smoke(tmp_path):
    import prefill_gpu
    out = tmp_path / "prefill.json"
    assert prefill_gpu.main(["--cpu-smoke", "--check-path", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["prompt"] for r in rows] == [16, 32]
    assert all(r["torch_s"] > 0 and r["stack_s"] > 0 and r["stack_over_torch"] > 0 for r in rows)
    # fp32 on the CPU runs the reference attention: the causal prefill path (bf16 on the GPU) is never traced
    assert all(r["causal_prefill_traced"] == r["causal_prefill_runs"] == r["causal_prefill_runs_padded"] == 0
               for r in rows)
