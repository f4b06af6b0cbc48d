"""The main job's PJRT and streaming executors run end to end and pass their checks.

``make demo`` already runs the default mode (torch_xla runtime); these run
``examples/minilm_embed.py --executor pjrt --params host`` and ``--executor streaming`` as
subprocesses (4 virtual CPU devices), each in well under a minute on 2 cores.
"""
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "minilm_embed.py"
COSINE = "[PASS] min cosine vs sentence-transformers >= 0.9999"


def _run(*args: str) -> str:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4",
               XLA_FLAGS=" ".join([f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
                                  + ["--xla_force_host_platform_device_count=4"]), JAX_PLATFORMS="cpu",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd=str(ROOT),
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(args)} exited {r.returncode}:\n{out[-4000:]}"
    assert "[FAIL]" not in out, out[-4000:]
    assert COSINE in r.stdout, r.stdout[-4000:]
    return r.stdout


def test_pjrt_executor_with_host_weights():
    out = _run("--executor", "pjrt", "--params", "host")
    for line in ("[PASS] stacked layer weights are in pinned_host memory",
                 "[PASS] 0 host transfers while lowering and running",
                 "[PASS] layer weights sharded over the mesh"):
        assert line in out, out[-4000:]
    assert "pjrt memory report" in out and "pinned_host" in out  # MemoryReport.__str__ (executor="pjrt")


def test_streaming_executor():
    out = _run("--executor", "streaming")
    for line in ("[PASS] streaming: layer weights resident in pinned_host",
                 "[PASS] streaming: one executable shared by the 6 layers (plus the embeddings')",
                 "[PASS] streaming: layer weights sharded over the devices"):
        assert line in out, out[-4000:]
