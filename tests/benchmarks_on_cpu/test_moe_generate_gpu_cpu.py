"""``benchmarks/moe_generate_gpu.py --cpu-smoke``: both shapes (Mixtral- and Qwen3-MoE-shaped, tiny) build, every
row runs (every expert in both layouts, routed with each layout, auto, the batch sweep), routed and whole give
``transformers``' greedy tokens, the routed rows fetch top-k experts per layer at batch 1 (the split layout in
one copy each) and count fewer bytes than the whole step; the three ways of copying top-k experts alone move
the same bytes. Timings mean nothing on the CPU and are not checked."""
import json

import moe_generate_gpu  # benchmarks/ is on pytest's pythonpath


def test_cpu_smoke(tmp_path):
    out = tmp_path / "moe_gen.json"
    assert moe_generate_gpu.main(["--cpu-smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["bandwidth"]["h2d_GBps"] > 0
    for name, k in (("mixtral", 2), ("qwen3", 4)):
        s = data["shapes"][name]
        assert all(s["hf_tokens_equal"].values()), s["hf_tokens_equal"]
        rows = s["rows"]
        assert set(rows) >= {"all_b1", "all_stacked_b1", "routed_b1", "routed_split_b1", "auto_b1"}
        for key in ("routed_b1", "routed_split_b1", "auto_b1"):
            assert rows[key]["experts_per_layer_mean"] == k and rows[key]["step_bytes"] < rows["all_b1"]["step_bytes"]
        assert rows["routed_split_b1"]["layout"] == "split" and rows["routed_split_b1"]["copies_per_layer_mean"] == k
        assert rows["auto_b1"]["layout"] == "stacked"   # tiny experts
        for key in ("all_b1", "all_stacked_b1"):
            assert rows[key]["step_bytes"] == s["weight_bytes"] and rows[key]["routed_steps"] == [False] * 4
        assert all(r["decode_step_s"] > 0 and r["ratio_to_floor"] > 0 for r in rows.values())
        fetch = s["fetch"]
        assert set(fetch) == {"split_arrays", "packed", "stacked"}
        assert len({f["bytes"] for f in fetch.values()}) == 1 and fetch["packed"]["bytes"] > 0
        assert fetch["packed"]["copies"] == k and fetch["split_arrays"]["copies"] > k
        assert any(key.endswith("_sweep") for key in rows) and s["routed_token_limit"] >= 1
    assert "| qwen3 | routed_b1 |" in moe_generate_gpu.render(data)
