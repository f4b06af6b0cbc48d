"""The README's policy example and the Llama training example run as written."""
import json
import os
import subprocess
import sys
from pathlib import Path

import train_llama   # examples/train_llama.py (examples/ is on pytest's pythonpath)

ROOT = Path(__file__).resolve().parents[2]


def _xla_flags(devices: int) -> str:
    """This process's ``XLA_FLAGS`` (conftest's) with ``devices`` virtual CPU devices instead of its own count."""
    return " ".join([f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
                    + [f"--xla_force_host_platform_device_count={devices}"])


def test_policy_example_runs():
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "policy_example.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "5 to-device and 3 to-host annotations" in r.stdout


def test_train_llama_example_runs(tmp_path):
    """The Llama training example (SwappedStack, AdamW state in pinned_host) runs and passes its checks."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_xla_flags(4), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_llama.py"), "--steps", "4", "--layers", "2",
                        "--dim", "32", "--seq", "16", "--batch", "2", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "[FAIL]" not in r.stdout and (tmp_path / "train_llama_loss.png").exists()


def _train(tmp_path, capsys, *argv: str):
    """``examples/train_llama.py`` at 2 layers of 32, sequences of 16, batches of 2, its files into ``tmp_path``,
    called in this process (``main(argv)``: the test session's virtual devices, 4 in ``make test``; the
    subprocess of ``test_train_llama_example_runs`` runs it as a script): its exit status and stdout."""
    rc = train_llama.main(["--layers", "2", "--dim", "32", "--seq", "16", "--batch", "2", "--out", str(tmp_path),
                           *argv])
    return rc, capsys.readouterr().out


def test_train_llama_example_saves_and_resumes(tmp_path, capsys):
    """``--save`` after 3 steps, then ``--resume`` to 5: the second run starts at step 3 and passes
    the example's checks (the losses of both runs, one per step)."""
    rc, out = _train(tmp_path, capsys, "--steps", "3", "--save", str(tmp_path / "ckpt"))
    assert rc == 0 and (tmp_path / "ckpt" / ".metadata").exists(), out[-3000:]
    rc, out = _train(tmp_path, capsys, "--steps", "5", "--resume", str(tmp_path / "ckpt"))
    assert rc == 0, out[-3000:]
    assert "resumed from" in out and "at step 3" in out and "[FAIL]" not in out
    assert len(json.loads((tmp_path / "train_llama_loss.json").read_text())["losses"]) == 5


def test_train_llama_example_with_every_training_option(tmp_path, capsys):
    """Clipping, 2 micro-batches per AdamW step, a warm-up + cosine schedule, param groups and bf16
    compute over fp32 masters, saved after 3 steps and resumed to 5 (the schedule in the checkpoint's
    ``extra``): the example's checks pass, one loss per optimizer step."""
    options = ["--lr", "3e-2", "--clip", "1.0", "--accumulate", "2", "--warmup", "1", "--bf16"]
    rc, out = _train(tmp_path, capsys, *options, "--steps", "3", "--save", str(tmp_path / "ckpt"))
    assert rc == 0 and "[FAIL]" not in out, out[-3000:]
    rc, out = _train(tmp_path, capsys, *options, "--steps", "5", "--resume", str(tmp_path / "ckpt"))
    assert rc == 0, out[-3000:]
    assert "at step 3" in out and "[FAIL]" not in out
    saved = json.loads((tmp_path / "train_llama_loss.json").read_text())
    assert len(saved["losses"]) == 5 and saved["args"]["accumulate"] == 2 and saved["args"]["bf16"]


def test_train_llama_example_with_a_budget(tmp_path, capsys):
    """``--budget-mib``: SwappedStack(budget_bytes=) chooses at the first step (on 4 CPU devices,
    FSDP); the example's checks (loss down, each stage's weights and moments where the schedule
    puts them, the predicted peak within the budget, torch agrees) pass."""
    rc, out = _train(tmp_path, capsys, "--steps", "4", "--budget-mib", "40")
    assert rc == 0, out[-3000:]
    assert "[FAIL]" not in out and "schedule: k=" in out
    saved = json.loads((tmp_path / "train_llama_loss.json").read_text())
    assert saved["schedule"].startswith("k=") and saved["args"]["budget_mib"] == 40
