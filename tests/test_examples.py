"""The README's policy example runs as written."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_policy_example_runs():
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "policy_example.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "5 to-device and 3 to-host annotations" in r.stdout
