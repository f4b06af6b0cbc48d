"""CPU checks of ``benchmarks/anchors.py`` (the FSDP2 / DeepSpeed anchors of the GPU benchmark).

FSDP2 with ``CPUOffloadPolicy`` runs on CPU (gloo, world size 1, ``pin_memory=False``), so
the anchor itself runs here on a tiny stack; DeepSpeed is not installed here, and its anchor
must then answer with an error dict rather than raise.
"""
import importlib.util
import json
import os
import pathlib
import sys

import pytest
import torch

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "anchors.py"
_spec = importlib.util.spec_from_file_location("xla_swap_bench_anchors", _PATH)
anchors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(anchors)

_TIMES = ("forward_s", "forward_backward_s", "optimizer_s", "step_s")


@pytest.fixture
def restore_env():
    """The anchors set MASTER_ADDR/PORT and the no-multicast variables: undo that."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_make_ffn_stack_shapes_and_determinism():
    m = anchors.make_ffn_stack(16, 32, 3, torch.float32, "cpu", seed=5)
    assert len(m) == 3
    assert m[0].a.weight.shape == (32, 16) and m[0].b.weight.shape == (16, 32)
    assert m[0].a.bias is None and m[0].b.bias is None
    assert all(p.dtype == torch.float32 for p in m.parameters())
    again = anchors.make_ffn_stack(16, 32, 3, torch.float32, "cpu", seed=5)
    other = anchors.make_ffn_stack(16, 32, 3, torch.float32, "cpu", seed=6)
    for p, q in zip(m.parameters(), again.parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(m[0].a.weight, other[0].a.weight)
    w = torch.cat([p.flatten() for p in m.parameters()])
    assert 0.015 < w.std().item() < 0.025
    x = torch.randn(4, 16)
    h = x + m[0].b(torch.nn.functional.gelu(m[0].a(x), approximate="tanh"))
    torch.testing.assert_close(m[0](x), h)
    assert m(x).shape == (4, 16)


def test_parse_args():
    a = anchors.parse_args(["--anchor", "deepspeed", "--shape", "4096,14336,16",
                            "--tokens", "2048", "--reps", "5"])
    assert (a.anchor, a.shape, a.tokens, a.reps) == ("deepspeed", (4096, 14336, 16), [2048], 5)
    assert a.stage == 3 and a.ds_optimizer == "auto" and not a.no_optimizer
    d = anchors.parse_args(["--anchor", "fsdp2"])
    assert d.shape == (8192, 32768, 8) and d.tokens == [8192] and d.llama is None
    assert anchors.parse_args(["--anchor", "fsdp2", "--tokens", "16", "32"]).tokens == [16, 32]
    with pytest.raises(SystemExit):
        anchors.parse_args(["--anchor", "fsdp2", "--shape", "1,2"])
    with pytest.raises(SystemExit):
        anchors.parse_args(["--anchor", "ddp"])


def test_fsdp2_cpu_offload_cli_one_json_line(capsys, restore_env):
    res = anchors.main(["--anchor", "fsdp2", "--shape", "64,128,2", "--tokens", "16",
                        "--reps", "1", "--device", "cpu"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    out = json.loads(lines[-1])
    assert "error" not in out, out.get("traceback")
    assert out == json.loads(json.dumps(res))
    for k in _TIMES:
        assert out[k] > 0 and len(out["samples"][k]) == 1
    assert out["step_s"] >= out["forward_backward_s"]
    assert out["peak_device_bytes"] is None  # CPU: no device memory to report
    assert out["param_device"] == "cpu" and out["pin_memory"] is False
    assert (out["D"], out["F"], out["L"], out["T"]) == (64, 128, 2, 16)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
    assert not torch.distributed.is_initialized()  # it destroyed the group it made


def test_fsdp2_without_optimizer(restore_env):
    res = anchors.fsdp2_cpu_offload_step(32, 64, 1, 8, 2, optimizer=False, device="cpu")
    assert res["optimizer"] is None and res["optimizer_s"] is None
    assert res["forward_s"] > 0 and len(res["samples"]["forward_backward_s"]) == 2
    assert not torch.distributed.is_initialized()


def test_deepspeed_missing_gives_error_dict(monkeypatch, capsys, restore_env):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    res = anchors.deepspeed_zero_offload_step(64, 128, 2, 16, 1)
    assert isinstance(res, dict) and "deepspeed not importable" in res["error"]
    out = anchors.main(["--anchor", "deepspeed", "--shape", "64,128,2", "--tokens", "16"])
    assert "error" in out
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["anchor"] == "deepspeed"


def test_deepspeed_config_offloads_both():
    c = anchors.deepspeed_config(64, 128)
    z = c["zero_optimization"]
    assert z["stage"] == 3 and c["bf16"]["enabled"]
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "torch_adam" not in c["optimizer"]["params"]
    c2 = anchors.deepspeed_config(64, 128, stage=2, torch_adam=True)
    assert "offload_param" not in c2["zero_optimization"]
    assert c2["optimizer"]["params"]["torch_adam"] is True


def test_world_size_option_and_refusals(capsys, restore_env):
    assert anchors.parse_args(["--anchor", "fsdp2"]).world_size == 1
    assert anchors.parse_args(["--anchor", "fsdp2", "--world-size", "4"]).world_size == 4
    with pytest.raises(SystemExit):
        anchors.parse_args(["--anchor", "fsdp2", "--world-size", "0"])
    res = anchors.main(["--anchor", "fsdp2", "--shape", "64,128,2", "--tokens", "15", "--world-size", "2"])
    assert "does not split evenly" in res["error"]  # refused before any rank starts
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["world_size"] == 2


def test_rank_launcher_timeout_stops_the_ranks(restore_env):
    res = anchors.main(["--anchor", "fsdp2", "--shape", "64,128,2", "--tokens", "16", "--world-size", "2",
                        "--timeout-s", "0.2"])
    assert res["error"].startswith("timed out after 0.2 s")


def test_llama_fsdp2_two_ranks_two_token_counts(capsys, restore_env):
    """An HF Llama (llama_model's tiny shape) under FSDP2 on 2 gloo ranks, both token counts on one model:
    each T has its own medians and every rank's, each rank ran T/2 tokens as whole sequences."""
    res = anchors.main(["--anchor", "fsdp2", "--llama", "tiny", "--seq", "16", "--tokens", "64", "32",
                        "--reps", "1", "--world-size", "2", "--timeout-s", "120"])
    assert "error" not in res, res
    assert res["ranks_met_at_end"] is True                                   # the last barrier passed
    assert res["model"] == "llama" and res["shape"]["d"] == 64 and res["seq"] == 16
    assert set(res["by_tokens"]) == {"64", "32"} and res["T"] == 64          # the first T at the top
    for T, r in res["by_tokens"].items():
        assert r["T"] == int(T) and r["T_per_rank"] == int(T) // 2 and r["world_size"] == 2
        assert [x["rank"] for x in r["per_rank"]] == [0, 1]
        for key in _TIMES:
            assert r[key] == max(x[key] for x in r["per_rank"]) > 0
    assert res["param_device"] == "cpu" and res["optimizer"].startswith("torch.optim.AdamW")


def test_llama_fsdp2_meta_init(restore_env):
    """--meta-init: built on the meta device, sharded, materialised on the host with finite values; a step runs."""
    import llama_model
    w = llama_model.LlamaWorkload(llama_model.shape_of("tiny"), seq=8)
    res = anchors.fsdp2_anchor(w, 16, 1, device="cpu", meta_init=True)
    assert "error" not in res and res["meta_init"] is True and res["step_s"] > 0
    assert res["samples"]["step_s"][0] > 0 and res["param_device"] == "cpu"



def test_an_anchors_fields_never_collide_with_the_names_per_tokens_takes():
    """DeepSpeed's info holds ``model`` (the workload's name), ``rank``, ``world_size`` and ``seed``:
    passed on by ``**extra`` they collided with ``_per_tokens``' own arguments (a TypeError on the GPU,
    twice). The filter drops every name ``_per_tokens`` takes, and keeps the rest."""
    import inspect
    info = {"anchor": "deepspeed", "model": "llama", "rank": 0, "world_size": 2, "seed": 0, "stage": 3,
            "tokens": [8], "reps": 1, "device": "cuda:0", "setup_s": 1.0}
    kept = anchors._passthrough(info)
    params = set(inspect.signature(anchors._per_tokens).parameters) - {"extra"}
    assert not set(kept) & params
    assert kept == {"anchor": "deepspeed", "stage": 3, "setup_s": 1.0}


def _line(**kw):
    return json.dumps({"anchor": "fsdp2", "world_size": 2, **kw}) + "\n"


def test_rank_verdict_a_rank_dying_after_its_result_is_reported_not_an_error():
    """Every rank printed its result (after its last barrier): a rank's SIGABRT afterwards (CI saw -6 in
    the interpreter's exit) is reported under ``after_result`` with its stderr, and the step time stands."""
    texts = [(_line(step_s=1.0, rank=0), ""), (_line(step_s=1.1, rank=1), "Fatal Python error: Aborted\n")]
    res = anchors.rank_verdict(texts, [0, -6], None)
    assert "error" not in res and res["step_s"] == 1.0
    assert res["after_result"] == {"return_codes": [0, -6], "reason": None,
                                   "stderr_tail": {1: "Fatal Python error: Aborted\n"}}


def test_rank_verdict_a_rank_without_its_result_is_an_error_with_its_stderr():
    texts = [(_line(step_s=1.0, rank=0), ""), ("", "Fatal Python error: Aborted\n")]
    res = anchors.rank_verdict(texts, [0, -6], None)
    assert res["error"] == "a rank failed (return codes [0, -6])"
    assert res["stderr_tail"] == {1: "Fatal Python error: Aborted\n"}
    res = anchors.rank_verdict([("", "boom"), (_line(step_s=1.0), "")], [-9, -9], "timed out after 5 s")
    assert res["error"] == "timed out after 5 s (return codes [-9, -9])" and res["stderr_tail"][0] == "boom"
    res = anchors.rank_verdict([(_line(step_s=1.0), ""), (_line(error="ValueError: x"), "tb")], [0, 1], None)
    assert res["error"].startswith("a rank failed") and 1 in res["stderr_tail"]
    res = anchors.rank_verdict([(_line(error="ValueError: y"), ""), (_line(step_s=1.0), "")], [1, 0], None)
    assert res["error"] == "ValueError: y"                          # rank 0's own error stands
    assert anchors.rank_verdict([(_line(step_s=1.0), ""), (_line(step_s=1.0), "")], [0, 0], None) == \
        json.loads(_line(step_s=1.0))                                # a clean run is rank 0's line as printed


def test_rank_verdict_rank_0_past_the_last_barrier_makes_the_measurement_whole():
    """Rank 0 passed the last barrier (``ranks_met_at_end``): rank 1 ended its timed steps, so its death
    in the teardown, before its own line, is after the result."""
    texts = [(_line(step_s=1.0, ranks_met_at_end=True), ""), ("", "Fatal Python error: Aborted\n")]
    res = anchors.rank_verdict(texts, [0, -6], None)
    assert "error" not in res and res["after_result"]["return_codes"] == [0, -6]
