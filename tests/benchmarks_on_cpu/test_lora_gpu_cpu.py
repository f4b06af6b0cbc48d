"""The LoRA benchmark (benchmarks/lora_gpu.py) end to end on the CPU at its tiny shape: every row runs,
the stack's first losses equal torch's on the PEFT model, the LoRA rows move the adapters and their
moments alone out, and the floors follow from the row's bytes and the link measured in the run."""
import json

import pytest

pytest.importorskip("peft")

import lora_gpu  # noqa: E402  (benchmarks/ is on pytest's pythonpath)


def test_tiny_run(tmp_path):
    out = tmp_path / "lora.json"
    assert lora_gpu.main(["--tiny", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["row"]: r for r in data["rows"]}
    assert set(rows) == set(lora_gpu.ROWS)
    for name, r in rows.items():
        assert "error" not in r, r
        assert r["first_loss"] == pytest.approx(rows["torch_peft"]["first_loss"], rel=1e-3), name
        assert r["step_s"] > 0 and r["tflops"] > 0 and isinstance(r["remat"], bool)
    h2d = data["link_gbps"][0] * 1e9
    for name in ("stack_lora", "stack_full"):     # the default policy: everything streamed, remat
        r = rows[name]
        assert r["remat"] and r["resident_stages"] == 0 and r["w_bytes"] > 0
        assert r["floor_s"] == pytest.approx((2 * r["w_bytes"] + r["trainable_bytes"] + 2 * r["m_bytes"]) / h2d)
        assert 0 < r["schedule_floor_s"] and r["ratio_to_floor"] == pytest.approx(r["step_s"] / r["floor_s"])
    saved = rows["stack_lora_saved"]                          # streamed, no recompute
    assert not saved["remat"] and saved["resident_stages"] == 0 and saved["w_bytes"] == rows["stack_lora"]["w_bytes"]
    lo, full = rows["stack_lora"], rows["stack_full"]
    assert lo["trainable_bytes"] < 0.01 * lo["w_bytes"] and lo["m_bytes"] < 0.01 * full["m_bytes"]
    assert full["trainable_bytes"] > 0.99 * full["w_bytes"]
    assert lo["model_flops"] < full["model_flops"]           # no weight gradient of the frozen base
    for name in ("stack_lora_chosen", "stack_full_chosen"):  # the chooser's pick, named
        assert rows[name]["chosen"] and set(rows[name]["predicted_by_remat"]) <= {"True", "False"}
    assert lo["torch_row"].startswith("torch_peft") and lo["vs_torch"] > 0
