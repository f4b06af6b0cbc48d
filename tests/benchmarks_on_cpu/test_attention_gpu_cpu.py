"""The fused-attention benchmark (benchmarks/attention_gpu.py): its CPU run end to end (every row
kind, the stack's first loss equal to torch's, the attention cases equal to torch's SDPA), and the
two functions its verdicts come from, with figures given rather than measured."""
import json
import types

import pytest

import attention_gpu  # benchmarks/ is on pytest's pythonpath
from xla_swap.planning.costs import Link


def _row(name, **kw):
    return dict({"b": 2, "s": 8, "row": name}, **kw)


def test_compare_judges_each_row_against_its_bound():
    steps = [_row("torch_device", step_s=1.0, fwdbwd_s=0.8),
             _row("torch_device_ckpt", step_s=1.2, fwdbwd_s=1.0),
             _row("stack_cudnn", step_s=1.5, floor_s=1.4, ratio_to_floor=1.5 / 1.4),
             _row("stack_cudnn_fwdbwd", step_s=0.9, floor_s=0.5, ratio_to_floor=1.8),
             _row("stack_cudnn_saved", error="RESOURCE_EXHAUSTED"),
             dict(_row("stack_cudnn", step_s=2.0, floor_s=1.0, ratio_to_floor=2.0), s=16)]  # no torch row
    attention_gpu.compare(steps)
    adamw, fwdbwd, failed, alone = steps[2:]
    # the AdamW step: its floor (1.4 s) is above torch's checkpointed step (1.2 s): link-bound
    assert adamw["bound"] == "link" and adamw["target_ratio"] == pytest.approx(1.5 / 1.4)
    assert adamw["vs_torch"] == pytest.approx(1.5) and adamw["vs_torch_ckpt"] == pytest.approx(1.25)
    assert adamw["torch_row"] == "torch_device"
    # fwd+bwd against torch's fwd+bwd: floor 0.5 s below 1.0 s, compute-bound, judged against ckpt
    assert fwdbwd["bound"] == "compute" and fwdbwd["target_ratio"] == pytest.approx(0.9)
    assert fwdbwd["vs_torch"] == pytest.approx(0.9 / 0.8)
    assert "bound" not in failed and "bound" not in alone


def test_link_floor_counts_the_schedule_bytes():
    steps = [types.SimpleNamespace(fetch=(0, 1), fetch_next=()), types.SimpleNamespace(fetch=(2,), fetch_next=(0,))]
    rt = types.SimpleNamespace(stage_nbytes=[10e9, 20e9, 30e9], num_stages=3, resident=(False, False, True),
                               optimizer=object(), optimizer_state_on_host=True,
                               optimizer_state_nbytes=[1e9, 2e9, 3e9], offloaded_activation_nbytes=4e9,
                               last_schedule=types.SimpleNamespace(timeline=steps))
    f = attention_gpu.link_floor(types.SimpleNamespace(runtime=rt), Link(h2d_gbps=50, d2h_gbps=40, both_gbps=80))
    w_in, W, M, A = 70e9, 30e9, 6e9, 4e9          # fetched 0, 1, 2, 0; streamed 0, 1; all moments
    assert (f["w_in_bytes"], f["w_bytes"], f["m_bytes"], f["act_bytes"]) == (w_in, W, M, A)
    assert f["floor_s"] == pytest.approx(max((w_in + M + A) / 50e9, (W + M + A) / 40e9, (w_in + W + 2 * M + 2 * A) / 80e9))
    rt.optimizer = None
    assert attention_gpu.link_floor(types.SimpleNamespace(runtime=rt), Link(50, 40, 80))["m_bytes"] == 0


def test_cpu_run(tmp_path):
    out = tmp_path / "attn.json"
    assert attention_gpu.main(["--d", "64", "--f", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                               "--attn-shapes", "1,4,2,128", "--step-shapes", "1,64", "--saved-rows",
                               "--saved-max-tokens", "64", "--budget-gib", "4", "--ckpt-tokens", "1000", "--link-gib", "0.25",
                               "--reps", "1", "--window", "2", "--steps", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [a["case"] for a in data["attention"]] == ["causal", "causal_hf", "mask", "mask_float"]
    for a in data["attention"]:
        # no GPU: cuDNN refuses at trace time, torch's math runs (bf16 against torch's bf16 SDPA)
        assert a["cudnn_rel_err"] < 2e-2 and a["xla_rel_err"] < 2e-2, a
        assert a["cudnn_grad_rel_err"] < 5e-2 and a["xla_grad_rel_err"] < 5e-2, a
        assert a["torch_fwd_s"] > 0 and a["cudnn_fwdbwd_s"] > 0 and a["cudnn_fwd_hlo"]["custom_calls"] == []
    rows = {r["row"]: r for r in data["steps"]}
    assert set(rows) == {"torch_device", "torch_device_ckpt", "stack_cudnn", "stack_cudnn_fwdbwd", "stack_xla",
                         "stack_cudnn_saved", "stack_cudnn_chosen"}
    torch_loss = rows["torch_device"]["first_loss"]
    for name, r in rows.items():
        assert "error" not in r, r
        assert r["first_loss"] == pytest.approx(torch_loss, rel=1e-3), name
        if name.startswith("stack"):
            assert r["floor_s"] >= 0 and r["bound"] in ("link", "compute") and r["vs_torch_ckpt"] > 0
    assert rows["stack_cudnn_saved"]["act_bytes"] > 0 and rows["stack_cudnn"]["act_bytes"] == 0
    assert rows["stack_cudnn_fwdbwd"]["m_bytes"] == 0 < rows["stack_cudnn"]["m_bytes"]
    assert rows["stack_cudnn_chosen"]["chosen"] and isinstance(rows["stack_cudnn_chosen"]["chosen_remat"], bool)
