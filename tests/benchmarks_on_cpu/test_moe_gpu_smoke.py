"""``benchmarks/moe_gpu.py --smoke`` on the CPU: every row of the GPU run is made (torch, the stack with
each experts form, the largest stack with the form chosen) and the stacks' first losses equal torch's on
the same weights (float32). Timings mean nothing here and are not checked."""
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_moe_gpu_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "4")
    monkeypatch.syspath_prepend(str(BENCH))
    import moe_gpu
    out = tmp_path / "moe_gpu.json"
    assert moe_gpu.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    L, big = res["args"]["compare_layers"], res["args"]["layers"]
    assert res["forms"] == ["dense", "sorted"] and big > L
    want = rows["torch_device"]["first_loss"]
    for form in res["forms"]:
        row = rows[f"stack_{form}_{L}"]
        assert "error" not in row, row.get("error")
        assert abs(row["first_loss"] - want) <= 1e-5 * abs(want), (form, row["first_loss"], want)
        assert row["ratio_to_torch"] > 0 and row["ratio_to_link_floor_reference"] > 0
        assert row["weight_bytes"] == rows["torch_device"]["weight_bytes"]
    steps = {f: rows[f"stack_{f}_{L}"]["step_s"] for f in res["forms"]}
    assert res["big_form"] == min(steps, key=steps.get)
    row = rows[f"stack_{res['big_form']}_{big}"]
    assert "error" not in row and row["layers"] == big and row["weight_bytes"] > rows["torch_device"]["weight_bytes"]
    assert math.isfinite(row["first_loss"]) and row["first_loss"] > 0
    sys.modules.pop("moe_gpu", None)


def test_moe_ragged_dot_smoke(tmp_path, monkeypatch):
    """``benchmarks/moe_ragged_dot.py --smoke``: every kernel runs, and the blocked candidate equals
    ``ragged_dot_general`` on the same sorted rows."""
    monkeypatch.syspath_prepend(str(BENCH))
    import moe_ragged_dot
    out = tmp_path / "moe_ragged_dot.json"
    assert moe_ragged_dot.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"dense", "ragged", "blocked8", "blocked16"}
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("error"))
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
    assert rows["blocked8"]["max_abs_diff_to_ragged"] <= 1e-6
    assert rows["blocked16"]["max_abs_diff_to_ragged"] <= 1e-6
