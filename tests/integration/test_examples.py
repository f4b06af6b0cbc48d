"""The README's policy example runs as written."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_policy_example_runs():
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "policy_example.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "5 to-device and 3 to-host annotations" in r.stdout


def test_train_llama_example_runs(tmp_path):
    """The Llama training example (SwappedStack, AdamW state in pinned_host) runs and passes its checks."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_llama.py"), "--steps", "4", "--layers", "2",
                        "--dim", "32", "--seq", "16", "--batch", "2", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "[FAIL]" not in r.stdout and (tmp_path / "train_llama_loss.png").exists()


def test_train_llama_example_saves_and_resumes(tmp_path):
    """``--save`` after 3 steps, then ``--resume`` to 5: the second run starts at step 3 and passes
    the example's checks (the losses of both runs, one per step)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    common = [sys.executable, str(ROOT / "examples" / "train_llama.py"), "--layers", "2", "--dim", "32",
              "--seq", "16", "--batch", "2", "--out", str(tmp_path)]
    r = subprocess.run(common + ["--steps", "3", "--save", str(tmp_path / "ckpt")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and (tmp_path / "ckpt" / ".metadata").exists(), (r.stdout + r.stderr)[-3000:]
    r = subprocess.run(common + ["--steps", "5", "--resume", str(tmp_path / "ckpt")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "resumed from" in r.stdout and "at step 3" in r.stdout and "[FAIL]" not in r.stdout
    assert len(json.loads((tmp_path / "train_llama_loss.json").read_text())["losses"]) == 5


def test_train_llama_example_with_every_training_option(tmp_path):
    """Clipping, 2 micro-batches per AdamW step, a warm-up + cosine schedule, param groups and bf16
    compute over fp32 masters, saved after 3 steps and resumed to 5 (the schedule in the checkpoint's
    ``extra``): the example's checks pass, one loss per optimizer step."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    common = [sys.executable, str(ROOT / "examples" / "train_llama.py"), "--layers", "2", "--dim", "32",
              "--seq", "16", "--batch", "2", "--lr", "3e-2", "--clip", "1.0", "--accumulate", "2", "--warmup", "1",
              "--bf16", "--out", str(tmp_path)]
    r = subprocess.run(common + ["--steps", "3", "--save", str(tmp_path / "ckpt")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "[FAIL]" not in r.stdout, (r.stdout + r.stderr)[-3000:]
    r = subprocess.run(common + ["--steps", "5", "--resume", str(tmp_path / "ckpt")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "at step 3" in r.stdout and "[FAIL]" not in r.stdout
    saved = json.loads((tmp_path / "train_llama_loss.json").read_text())
    assert len(saved["losses"]) == 5 and saved["args"]["accumulate"] == 2 and saved["args"]["bf16"]


def test_train_llama_example_with_a_budget(tmp_path):
    """``--budget-mib``: SwappedStack(budget_bytes=) chooses at the first step (on 4 CPU devices,
    FSDP); the example's checks (loss down, each stage's weights and moments where the schedule
    puts them, the predicted peak within the budget, torch agrees) pass."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_llama.py"), "--steps", "4", "--layers", "2",
                        "--dim", "32", "--seq", "16", "--batch", "2", "--budget-mib", "40", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "[FAIL]" not in r.stdout and "schedule: k=" in r.stdout
    saved = json.loads((tmp_path / "train_llama_loss.json").read_text())
    assert saved["schedule"].startswith("k=") and saved["args"]["budget_mib"] == 40
