"""The multi-GPU benchmark (benchmarks/multi_gpu.py) on the virtual CPU devices: every row runs at a
tiny shape on 2 or 4 devices (1 when only one is there), its analysis has every row, floor and
ratio, ``--render`` prints the same table again; ``analyze`` on a hand-made raw dict gives the
floors of its formulas and the target flags; FSDP2 runs on 2 gloo ranks through ``anchors.py``."""
import copy
import json
import statistics

import jax
import pytest

import anchors  # benchmarks/ is on pytest's pythonpath
import multi_gpu


def _fsdp2_available():
    try:
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: F401
    except ImportError:
        return False
    return dist.is_available()


def _gpus():
    c = jax.device_count()
    return 4 if c >= 4 else 2 if c >= 2 else 1


def test_smoke_run_writes_every_row_and_rerenders(tmp_path, capsys):
    n = _gpus()
    argv = ["--gpus", str(n), "--shape", "64,128,2", "--tokens", "16", "32", "--reps", "1",
            "--out-dir", str(tmp_path)]
    if _fsdp2_available():
        argv += ["--anchors", "fsdp2", "--anchor-reps", "1", "--anchor-timeout-s", "120"]
    assert multi_gpu.main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "multi_gpu.json").read_text())
    raw, a = data["raw"], data["analysis"]
    assert a == json.loads(json.dumps(multi_gpu.analyze(raw)))       # the saved analysis is the raw's
    assert raw["n"] == n and raw["weight_bytes"] == 2 * 2 * 64 * 128 * 2   # L * 2 matrices * D*F * bf16
    for T in ("16", "32"):
        for s in ("fsdp", "tp"):
            assert set(a["median_s"][s][T]) == set(multi_gpu._ROWS)
            r, f = a["ratio"][s][T], a["floor_s"][s][T]
            for key in ("fwd", "train", "scaling_fwd", "scaling_train"):
                assert r[key] > 0
            assert f["fwd"] >= a["median_s"][s][T]["ondev_fwd"]
            assert f["train"] >= a["median_s"][s][T]["ondev_train"]
        assert set(a["median_s"]["1gpu"][T]) == set(multi_gpu._ROWS_1GPU)
        assert a["ratio"]["1gpu"][T]["mesh"] > 0
    # 2 targets per sharding and T, 2 scaling ones, and the mesh one per T
    assert len(a["checks"]) == 2 * 2 * 4 + 2
    if n > 1:
        assert raw["layout"]["fsdp"]["data_parallel"] is True
        assert raw["layout"]["tp"]["data_parallel"] is False
        # tp_spec speaks torch's [out, in]; the host holds nn.Linear weights [in, out] (transpose_linear)
        assert raw["layout"]["tp"]["specs"] == {"a.weight": [None, "d"], "b.weight": ["d", None]}
        assert raw["layout"]["tp"]["held_transposed"] == ["a.weight", "b.weight"]
        assert raw["layout"]["fsdp"]["memory_kind"] == "pinned_host"
    for s in ("fsdp", "tp"):  # same weights, same input: the n-device outputs are the 1-device one's
        assert raw["max_abs_diff_vs_1gpu"][s] < 1e-2
    assert raw["mesh_vs_plain_max_abs_diff"] == 0.0
    if _fsdp2_available():
        x = a["anchors"]["fsdp2"]
        assert "error" not in x, x
        assert x["world_size"] == n and x["tokens"] == 16 and x["xla_swap_row"] == "fsdp train"
        assert x["fb_over_xla_swap_train"] == x["forward_backward_s"] / a["median_s"]["fsdp"]["16"]["train"]
    table = multi_gpu.render(a)
    assert table + "\n" in printed
    assert "total wall time" in printed
    for line in printed.splitlines():  # a JSON line per row as it went
        if line.startswith('{"group"'):
            assert json.loads(line)["median_s"] > 0
    assert multi_gpu.main(["--render", str(tmp_path / "multi_gpu.json")]) == 0
    assert capsys.readouterr().out == table + "\n"


def test_nothing_written_without_out_dir(tmp_path, monkeypatch, capsys):
    raw = _raw()
    monkeypatch.setattr(multi_gpu, "measure", lambda *a, **k: copy.deepcopy(raw))
    monkeypatch.chdir(tmp_path)
    assert multi_gpu.main(["--gpus", "2", "--shape", "8192,32768,8"]) == 0
    assert list(tmp_path.iterdir()) == []
    assert multi_gpu.render(multi_gpu.analyze(dict(raw, anchors={}))) in capsys.readouterr().out  # none asked


def _raw():
    """A hand-made raw dict: 2 GPUs, L=8, k=2, W = 8 GiB, two token counts."""
    GB = 1e9
    return {
        "n": 2, "shape": [8192, 32768, 8], "tokens": [8192, 32768], "dtype": "bfloat16", "k": 2, "kept_at_turns": 4,
        "weight_bytes": 8 * 2**30, "reps": 3, "window": 1, "device_kind": "test",
        "bw": {"n": {"h2d": 110 * GB, "d2h": 100 * GB, "both": 150 * GB},
               "1": {"h2d": 55 * GB, "d2h": 54 * GB, "both": 75 * GB}},
        "bw_sharding": "fsdp",
        "rows": {
            "1gpu": {"8192": {"fwd_1gpu": [0.17, 0.16, 0.18], "train_1gpu": [0.40, 0.41, 0.39],
                              "ondev_fwd_1gpu": [0.10], "ondev_train_1gpu": [0.33],
                              "fwd_1dev_plain": [0.160, 0.161], "fwd_1dev_mesh": [0.162, 0.163]},
                     "32768": {"fwd_1gpu": [0.44], "train_1gpu": [1.40],
                               "fwd_1dev_plain": [0.43], "fwd_1dev_mesh": [0.45]}},
            "fsdp": {"8192": {"ondev_fwd": [0.05], "ondev_train": [0.17], "fwd": [0.082, 0.080, 0.09],
                              "train": [0.21]},
                     "32768": {"ondev_fwd": [0.21], "ondev_train": [0.66], "fwd": [0.25], "train": [0.80]}},
        },
        "anchors": {"fsdp2": {"anchor": "fsdp2", "world_size": 2, "T": 8192, "forward_s": 0.2,
                              "forward_backward_s": 0.5, "step_s": 2.0, "optimizer": "AdamW"}},
    }


def test_analyze_floors_ratios_and_targets():
    raw = _raw()
    a = multi_gpu.analyze(raw)
    n, L, k, W = 2, 8, 2, 8 * 2**30
    h2d, d2h, both = (raw["bw"]["n"][x] / n for x in ("h2d", "d2h", "both"))    # per GPU
    wn = W / n
    w_in = (2 * L - 2 * k) / L * wn
    for T in ("8192", "32768"):
        m = {r: statistics.median(v) for r, v in raw["rows"]["fsdp"][T].items()}
        f = a["floor_s"]["fsdp"][T]
        assert f["fwd"] == pytest.approx(max(m["ondev_fwd"], wn / h2d))
        assert f["train"] == pytest.approx(max(m["ondev_train"], w_in / h2d, wn / d2h, (w_in + wn) / both))
        assert a["ratio"]["fsdp"][T]["fwd"] == pytest.approx(m["fwd"] / f["fwd"])
        assert a["ratio"]["fsdp"][T]["train"] == pytest.approx(m["train"] / f["train"])
        one = {r: statistics.median(v) for r, v in raw["rows"]["1gpu"][T].items()}
        assert a["ratio"]["fsdp"][T]["scaling_fwd"] == pytest.approx(one["fwd_1gpu"] / m["fwd"])
        assert a["ratio"]["fsdp"][T]["scaling_train"] == pytest.approx(one["train_1gpu"] / m["train"])
        assert a["ratio"]["1gpu"][T]["mesh"] == pytest.approx(one["fwd_1dev_mesh"] / one["fwd_1dev_plain"])
    # 8192 tokens: the forward is transfer-bound (4 GiB per GPU at 55 GB/s: 78 ms > 50 ms on device);
    # 32768 tokens: compute-bound both ways
    assert a["floor_s"]["fsdp"]["8192"]["fwd_bound"] == "h2d"
    assert a["floor_s"]["fsdp"]["32768"]["fwd_bound"] == "compute"
    assert a["floor_s"]["fsdp"]["32768"]["train_bound"] == "compute"
    # the 1-GPU floors: n=1, its bandwidths, its on-device rows where measured (8192), else transfer terms only
    b1 = raw["bw"]["1"]
    w_in1 = (2 * L - 2 * k) / L * W
    assert a["floor_s"]["1gpu"]["8192"]["fwd"] == pytest.approx(max(0.10, W / b1["h2d"]))
    assert a["floor_s"]["1gpu"]["8192"]["train"] == pytest.approx(
        max(0.33, w_in1 / b1["h2d"], W / b1["d2h"], (w_in1 + W) / b1["both"]))
    assert a["floor_s"]["1gpu"]["32768"]["train"] == pytest.approx(
        max(w_in1 / b1["h2d"], W / b1["d2h"], (w_in1 + W) / b1["both"]))
    assert a["bw"]["per_gpu"]["h2d"] == h2d and a["bw"]["aggregate"]["h2d"] == raw["bw"]["n"]["h2d"]
    # targets: data, and the flags follow them (scaling target 1.85 at n=2)
    assert a["targets"] == {"fwd": 1.05, "train": 1.10, "scaling": 1.85, "mesh": 1.02}
    flags = {(c["what"], c["tokens"]): c for c in a["checks"]}
    for (what, T), c in flags.items():
        assert c["met"] == (c["value"] <= c["target"] if c["op"] == "<=" else c["value"] >= c["target"])
    assert flags[("fsdp forward scaling (1 GPU / 2)", 8192)]["met"]            # 0.17 / 0.082 = 2.07
    assert not flags[("fsdp forward scaling (1 GPU / 2)", 32768)]["met"]       # 0.44 / 0.25 = 1.76
    assert flags[("1-device mesh / plain forward", 8192)]["met"]               # 0.1625 / 0.1605
    assert not flags[("1-device mesh / plain forward", 32768)]["met"]          # 0.45 / 0.43 = 1.047
    # the anchor: FSDP2's forward+backward and whole step over xla_swap's fsdp train row at its T
    x = a["anchors"]["fsdp2"]
    assert x["xla_swap_row"] == "fsdp train" and x["tokens"] == 8192
    assert x["fb_over_xla_swap_train"] == pytest.approx(0.5 / 0.21)
    assert x["step_over_xla_swap_train"] == pytest.approx(2.0 / 0.21)
    assert x["fwd_over_xla_swap_fwd"] == pytest.approx(0.2 / 0.082)
    text = multi_gpu.render(a)
    assert "**missed**" in text and "fsdp2 on 2 GPUs" in text
    json.dumps(a)  # JSON out


def test_analyze_anchor_error_and_scaling_target_per_gpu():
    raw = _raw()
    raw["anchors"]["fsdp2"] = {"anchor": "fsdp2", "error": "boom"}
    raw["n"] = 4
    a = multi_gpu.analyze(raw)
    assert a["anchors"]["fsdp2"] == {"error": "boom"}
    assert a["targets"]["scaling"] == pytest.approx(1.85 * 2)
    assert "fsdp2: not measured (boom)" in multi_gpu.render(a)


def test_analyze_anchor_with_a_rank_exit_after_the_result():
    raw = _raw()
    assert "after_result" not in multi_gpu.analyze(raw)["anchors"]["fsdp2"]
    raw["anchors"]["fsdp2"]["after_result"] = {"return_codes": [0, -6], "reason": None, "stderr_tail": {1: "x"}}
    a = multi_gpu.analyze(raw)
    assert a["anchors"]["fsdp2"]["after_result"]["return_codes"] == [0, -6]
    assert "then the ranks exited with codes [0, -6]" in multi_gpu.render(a)


def test_tp_spec():
    assert multi_gpu.tp_spec("a.weight", (256, 64)) == ("d", None)
    assert multi_gpu.tp_spec("b.weight", (64, 256)) == (None, "d")
    assert multi_gpu.tp_spec("norm.weight", (64,)) == ()


@pytest.mark.skipif(not _fsdp2_available(), reason="torch.distributed FSDP2 (fully_shard) unavailable")
def test_fsdp2_anchor_two_ranks(capsys):
    res = anchors.main(["--anchor", "fsdp2", "--shape", "64,128,2", "--tokens", "16", "--reps", "2",
                        "--world-size", "2", "--timeout-s", "60"])
    assert "error" not in res, res
    out = json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1])
    # the printed line is the result's JSON: a rank that died after its result (after_result) has its stderr
    # keyed by rank there, and JSON turns those keys into strings
    assert out == json.loads(json.dumps(res, default=str))
    assert res["world_size"] == 2 and res["T"] == 16 and res["T_per_rank"] == 8
    assert [r["rank"] for r in res["per_rank"]] == [0, 1]
    for key in ("forward_s", "forward_backward_s", "optimizer_s", "step_s"):
        assert res[key] == max(r[key] for r in res["per_rank"]) > 0
    assert res["param_device"] == "cpu"
