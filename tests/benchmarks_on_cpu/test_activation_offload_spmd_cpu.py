"""benchmarks/activation_offload_spmd.py on the virtual CPU devices: ``export`` (torch_xla, in a
subprocess) writes both modules, the offloaded one with the named activation's MoveToHost /
MoveToDevice; ``check`` runs both through the PJRT executor and finds equal outputs and no collective
the on-device module lacks (XLA:CPU strips the annotations, so this is the smoke run of the GPU check)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import activation_offload_spmd as bench   # benchmarks/ is on pytest's pythonpath

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.spmd
def test_export_then_check_on_cpu(tmp_path, num_devices):
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    env.update(PJRT_DEVICE="CPU", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "benchmarks.activation_offload_spmd", "export", str(tmp_path),
                        "--devices", str(num_devices), "--layers", "2", "--batch", "8", "--width", "16"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["devices"] == num_devices
    assert meta["modules"]["offloaded"]["annotations"] == {"annotate_device_placement": 0, "MoveToHost": 1,
                                                           "MoveToDevice": 1}
    assert set(meta["modules"]["on_device"]["annotations"].values()) == {0}
    result = bench.check(tmp_path, tol=1e-5)
    assert result["ok"], result
    assert len(result["max_abs_diff"]) == 4          # out, grad h, grad W_a, grad W_b
    with pytest.raises(SystemExit):                  # argparse refuses a device count below 1
        bench.main(["export", str(tmp_path / "x"), "--devices", "0"])
