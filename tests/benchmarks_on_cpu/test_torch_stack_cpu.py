"""The torch entry point benchmark (benchmarks/torch_stack.py) on CPU: every row runs at a tiny shape,
its analysis gives floors and ratios, and the committed GPU table re-renders from its JSON."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch_stack  # benchmarks/ is on pytest's pythonpath

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "torch_stack"


def test_all_rows_run_and_analyze(tmp_path):
    assert torch_stack.main(["--shapes", "32,64,4,8", "--reps", "1", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "torch_stack.json").read_text())
    raw = data["raw"][0]
    assert raw["torch_vs_jax_max_abs_diff"] == 0.0          # the bridge computes the JAX layer exactly
    a = torch_stack.analyze(raw)
    for row in ("torch_fwd", "jax_fwd", "torch_train", "jax_train", "torch_adamw", "torch_adamw_devstate"):
        assert a["ratio"][row] > 0
    assert a["floor_s"]["fwd"] >= a["median_s"]["ondev_fwd"]
    assert raw["actoff_bytes"] > 0


@pytest.mark.parametrize("name, fsdp2_x, ds_x", [("torch_stack", "4.0x faster", "3.2x faster"),
                                                  ("torch_stack_cyclic", "4.1x faster", "3.2x faster"),
                                                  ("torch_stack_nn", "3.9x faster", "3.1x faster")])
def test_committed_gpu_table_rerenders(name, fsdp2_x, ds_x):
    results = RESULTS.parent / name
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "torch_stack.py"), "--render",
                          str(results / "torch_stack.json"), "--anchor-files", f"fsdp2={results / 'fsdp2.json'}",
                          f"deepspeed={results / 'deepspeed.json'}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    table = out.stdout
    readme = (results / "README.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith(("| 8192", "| 4096"))]
    assert rows and all(line in readme for line in rows), rows
    assert fsdp2_x in table and ds_x in table


def test_rand_weights_take_any_column_count():
    """The fast random weights have the asked shape when the columns are not a multiple of the
    1024-column block (D=5120 F=13824 of budget_sweep's fourth shape once got 13312 columns)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for shape in ((4, 13824), (3, 1000), (2, 2048)):
        w = torch_stack._rand(rng, shape, np.float32)
        assert w.shape == shape and w.flags.c_contiguous and 0.005 < float(w.std()) < 0.05
