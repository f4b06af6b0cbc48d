"""The HF Llama multi-GPU benchmark (benchmarks/llama_multi_gpu.py) on virtual CPU devices: the whole driver
at the tiny shape (one process on 1 and 2 devices, FSDP2 on 2 gloo ranks, 2 torchrun ranks), the largest-model
piece in this process, and the analysis on a hand-made raw dict (floors, speed-ups, targets, anchors)."""
import json
import math
import os

import jax
import numpy as np
import pytest

import llama_model as lm
import llama_multi_gpu
import llama_report
import llama_scaling


def _fsdp2_available():
    try:
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: F401
    except ImportError:
        return False
    return dist.is_available()


def _rows(a, form, n):
    return {r["tokens"]: r for r in a["shapes"]["tiny"]["rows"] if r["form"] == form and r["n"] == n}


def test_smoke_run_every_piece(tmp_path, capsys):
    anchors = "fsdp2" if _fsdp2_available() else ""
    assert llama_multi_gpu.main(["--cpu-smoke", "--tokens", "32", "--torchrun-tokens", "32", "--anchors", anchors,
                                 "--profile-dir", str(tmp_path / "prof"), "--profile-tokens", "64",
                                 "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "llama_multi_gpu.json").read_text())
    raw, a = data["raw"], data["analysis"]
    assert a == json.loads(json.dumps(llama_report.analyze(raw), default=str))   # the saved analysis is the raw's
    for name, p in raw["pieces"].items():
        assert p["rc"] == 0 and not p["timed_out"], (name, (tmp_path / "logs" / (name.replace(":", "_") + ".log"))
                                                     .read_text()[-3000:])
    one, two = _rows(a, "single", 1), _rows(a, "single", 2)
    assert set(one) == {32} and set(two) == {32, 64}        # 1 GPU at 32 per GPU; 2 GPUs: strong 32, weak 64
    shape = raw["ours"]["tiny"]["shape"]
    counts = lm.param_counts(shape)
    for r in raw["ours"]["tiny"]["rows"]:
        B = r["bytes"]
        assert B["m"] == 2 * 2 * counts["total"]              # both AdamW moments of every bf16 weight, in and out
        assert B["w"] == B["weight"] >= 2 * counts["total"]   # the updated weights out (buffers too)
        assert r["flops"] == lm.model_flops(shape, r["b"], r["s"])
    for r in list(one.values()) + list(two.values()):
        terms = [r[k] for k in ("host_s", "compute_s") if r.get(k) is not None]
        assert r["floor_s"] == max(terms) and r["ratio"] == pytest.approx(r["step_s"] / r["floor_s"])
        assert r["tflops_per_gpu"] == pytest.approx(r["flops"] / r["step_s"] / r["n"] / 1e12)
    # the same batch and weights on 1 and 2 devices: the same first loss (bf16 sums in another order)
    assert two[32]["first_loss"] == pytest.approx(one[32]["first_loss"], rel=2e-3)
    assert math.isclose(one[32]["first_loss"], math.log(shape["vocab"]), rel_tol=0.05)   # random weights
    # --profile-tokens 64: only the 2-device row at 64 tokens is traced (a perfetto trace; no GPU streams here)
    assert [(r["n"], r["tokens"]) for r in raw["ours"]["tiny"]["rows"] if "profile" in r] == [(2, 64)]
    prof = two[64]["profile"]
    assert prof["step_s"] > 0 and prof["overlap"] == [] and list((tmp_path / "prof").glob("**/perfetto_trace.json.gz"))
    for kind in ("forward", "backward"):   # the layer's weights are split over the 2 devices: gathered
        assert any(c["op"] == "all-gather" and c["bytes"] > 0 for c in prof["collectives"][kind]), prof["collectives"]
    tr = {r["tokens"]: r for r in a["shapes"]["tiny"]["rows"] if r["form"].startswith("torchrun")}
    assert set(tr) == {64}                                    # 32 tokens per rank, 2 ranks
    assert tr[64]["first_loss"] == pytest.approx(two[64]["first_loss"], rel=2e-3)
    sc = {(s["form"], s["kind"]) for s in a["shapes"]["tiny"]["scaling"]}
    assert ("single", "strong") in sc and ("single", "weak") in sc and any(f.startswith("torchrun") for f, _ in sc)
    for s in a["shapes"]["tiny"]["scaling"]:
        k = 1 if s["kind"] == "strong" else 2
        assert s["speedup"] == pytest.approx(k * s["step_1_s"] / s["step_n_s"]) and "met" in s
    if anchors:
        (x,) = a["shapes"]["tiny"]["anchors"]
        assert x["anchor"] == "fsdp2" and x["world_size"] == 2 and x["tokens"] == 32
        assert x["anchor_over_single"] == pytest.approx(x["step_s"] / two[32]["step_s"])
    table = llama_report.render(a)
    assert table + "\n" in printed and (tmp_path / "llama_multi_gpu.md").read_text() == table + "\n"
    assert llama_multi_gpu.main(["--render", str(tmp_path / "llama_multi_gpu.json")]) == 0
    assert capsys.readouterr().out == table + "\n"


def test_pieces_skipped_past_the_budget(tmp_path, capsys):
    assert llama_multi_gpu.main(["--cpu-smoke", "--budget-s", "1", "--largest", "--out-dir", str(tmp_path)]) == 0
    raw = json.loads((tmp_path / "llama_multi_gpu.json").read_text())["raw"]
    assert set(raw["pieces"]) == {"ours:tiny", "fsdp2:tiny", "deepspeed:tiny", "torchrun:tiny", "largest:tiny"}
    assert all("skipped" in p for p in raw["pieces"].values())
    assert '{"piece": "ours:tiny", "skipped": ' in capsys.readouterr().out


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 virtual devices")
def test_largest_piece(tmp_path, capsys):
    out = tmp_path / "largest.json"
    args = llama_multi_gpu.parse_args(["--piece", "largest", "--shape", "tiny", "--layers", "3", "--gpus", "2",
                                       "--tokens", "32", "--seq", "16", "--reps", "1", "--warmup", "0",
                                       "--piece-out", str(out), "--largest-host-reserve-gb", "1"])
    assert llama_scaling.run_piece(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    built = [x for x in lines if "built" in x]   # the build is said before the first row: a stopped piece's progress
    assert built and built[0]["n"] == 2 and built[0]["build_s"] >= 0
    assert all("elapsed_s" in x for x in lines if "host_pool_gib" in x or "wall_s" in x)
    d = json.loads(out.read_text())
    counts = lm.param_counts(lm.shape_of("tiny", 3))
    assert d["weight_bytes"] == 2 * counts["total"] and d["state_bytes"] == 3 * d["weight_bytes"]
    (row,) = d["rows"]
    assert row["n"] == 2 and row["form"] == "largest" and row["step_s"] > 0 and row["shape"]["layers"] == 3
    a = llama_report.analyze({"n": 2, "tokens_per_gpu": [16], "largest": d})["largest"]
    assert a["peak_rss_over_state"] == d["host_after"]["VmHWM"] / d["state_bytes"]
    assert a["rows"][0]["ratio"] == pytest.approx(row["step_s"] / a["rows"][0]["floor_s"])


def _raw():
    """Two GPUs, one shape: 1-GPU rows at 8192 and 32768, 2-GPU rows at 8192, 16384, 32768, 65536 (GB/s and
    TFLOP/s chosen so that 8192 on 2 GPUs is host-bound and 65536 compute-bound), an FSDP2 anchor."""
    GB = 1e9
    B = {"w_in": 1 * GB, "w": 2 * GB, "m": 4 * GB, "act": 0, "weight": 2 * GB}
    steps = {(1, 8192): 0.30, (1, 32768): 1.00, (2, 8192): 0.17, (2, 16384): 0.30, (2, 32768): 0.52,
             (2, 65536): 1.02}
    rows = [{"form": "single", "n": n, "tokens": T, "b": T // 4096, "s": 4096, "tokens_per_gpu": T // n,
             "flops": 6e9 * T, "bytes": B, "step_s": t, "first_loss": 10.4} for (n, T), t in steps.items()]
    links = {"host_link": {"n": {"h2d": 100 * GB, "d2h": 100 * GB, "both": 140 * GB},
                           "1": {"h2d": 50 * GB, "d2h": 50 * GB, "both": 70 * GB}},
             "nvlink": {"per_gpu": 200 * GB, "peer_access": [True, True]}, "gemm_flops": 700e12}
    return {"n": 2, "tokens_per_gpu": [8192, 32768], "pieces": {}, "ours": {"8b": dict(links, shape={}, rows=rows)},
            "anchors": {"fsdp2:8b": {"anchor": "fsdp2", "T": 8192, "step_s": 0.5, "forward_backward_s": 0.2,
                                     "optimizer_s": 0.3, "world_size": 2, "optimizer": "AdamW",
                                     "by_tokens": {"8192": {"step_s": 0.5, "forward_backward_s": 0.2, "world_size": 2},
                                                   "32768": {"step_s": 0.4, "forward_backward_s": 0.3,
                                                             "world_size": 2}}}}}


def test_analyze_floors_speedups_and_targets():
    raw = _raw()
    a = llama_report.analyze(raw)
    rows = {(r["n"], r["tokens"]): r for r in a["shapes"]["8b"]["rows"]}
    GB = 1e9
    r = rows[(2, 8192)]
    host = max((1 + 4) * GB / (100 * GB), (2 + 4) * GB / (100 * GB), (1 + 2 + 8) * GB / (140 * GB))
    assert r["host_s"] == pytest.approx(host)
    assert r["nvlink_s"] == pytest.approx(3 * 0.5 * 2 * GB / (200 * GB))
    assert r["compute_s"] == pytest.approx(6e9 * 8192 * 4 / 3 / (2 * 700e12))
    assert r["bound"] == "host" and r["floor_s"] == pytest.approx(host) and r["ratio"] == pytest.approx(0.17 / host)
    assert r["host_plus_nvlink_s"] == pytest.approx(host + r["nvlink_s"])    # a diagnostic, not the floor
    assert rows[(2, 65536)]["bound"] == "compute"
    one = rows[(1, 8192)]                          # one GPU: its own link, no NVLink term
    assert one["host_s"] == pytest.approx(max(5 / 50, 6 / 50, 11 / 70)) and "nvlink_s" not in one
    sc = {(s["kind"], s["tokens"]): s for s in a["shapes"]["8b"]["scaling"]}
    assert sc[("strong", 8192)]["speedup"] == pytest.approx(0.30 / 0.17)
    assert sc[("weak", 65536)]["speedup"] == pytest.approx(2 * 1.00 / 1.02)
    assert sc[("strong", 8192)]["met"] == (0.17 / host <= 1.10)              # host-bound: judged by its floor
    assert sc[("weak", 65536)]["met"] == (2 * 1.00 / 1.02 >= 1.85)           # compute-bound: by its speed-up
    assert sc[("weak", 65536)]["met"] is True
    # against one GPU at the same tokens per GPU: weak rows always have that row; strong ones here do not (4096, 16384)
    assert sc[("weak", 65536)]["over_one_gpu"] == pytest.approx(1.02 / 1.00)
    assert sc[("weak", 16384)]["over_one_gpu"] == pytest.approx(0.30 / 0.30)
    assert sc[("strong", 8192)]["over_one_gpu"] is None and sc[("strong", 32768)]["over_one_gpu"] is None
    x = {t["tokens"]: t for t in a["shapes"]["8b"]["anchors"]}
    assert x[8192]["anchor_over_single"] == pytest.approx(0.5 / 0.17)
    assert x[32768]["anchor_over_single"] == pytest.approx(0.4 / 0.52)
    checks = {c.get("what"): c["met"] for c in a["checks"] if "what" in c}
    assert checks == {"fsdp2 / ours at 8192": True, "fsdp2 / ours at 32768": False}
    text = llama_report.render(a)
    assert "**missed**" in text and "| fsdp2 (AdamW) | 8192 |" in text
    assert "| single | weak | 32768 | 65536 | 1000.0 | 1020.0 | 1.96x |" in text and "| 1.020x |" in text
    assert "exited with codes" not in text
    json.dumps(a)
    raw["anchors"]["fsdp2:8b"]["after_result"] = {"return_codes": [0, -6], "reason": None, "stderr_tail": {}}
    text = llama_report.render(llama_report.analyze(raw))   # a rank's exit after every result: said, not hidden
    assert "- fsdp2 at 8192 tokens: every rank gave its result, then the ranks exited with codes [0, -6]" in text


def test_analysis_names_rows_with_a_stalled_step():
    """A row with a sample over 1.5x its fastest is listed; whether its median is such a step is said (the
    4-GPU torchrun row of 2026-11-28: samples 1.221, 1.019, 0.148 s)."""
    raw = _raw()
    rows = raw["ours"]["8b"]["rows"]
    rows[0]["samples"], rows[0]["step_s"] = [1.221, 1.019, 0.148], 1.019
    rows[1]["samples"], rows[1]["step_s"] = [0.153, 0.100, 0.101], 0.101
    rows[2]["samples"] = [rows[2]["step_s"]] * 3
    a = llama_report.analyze(raw)
    stalls = {(t["n"], t["tokens"]): t for t in a["stalls"]}
    key0, key1 = (rows[0]["n"], rows[0]["tokens"]), (rows[1]["n"], rows[1]["tokens"])
    assert set(stalls) == {key0, key1}
    assert stalls[key0]["median_stalled"] is True and stalls[key1]["median_stalled"] is False
    text = llama_report.render(a)
    assert "samples 1.221, 1.019, 0.148 s, a step over 1.5x the fastest (**the median is a stalled step**)" in text
    assert "samples 0.153, 0.100, 0.101 s, a step over 1.5x the fastest (the median is not)" in text


def test_analysis_names_host_bound_rows_below_their_floor():
    """A host-bound row under 0.95 of its floor moved its bytes faster than the both-directions rate measured
    for its GPUs: the analysis names it with the rate it reached (the 4-GPU rows of 2026-11-28 at 32 layers:
    0.83-0.86 of a floor from 143.7 GB/s)."""
    raw = _raw()
    GB = 1e9
    for r in raw["ours"]["8b"]["rows"]:
        if (r["n"], r["tokens"]) == (2, 8192):
            r["step_s"] = 0.07                     # 11 GB over the host links: 157 GB/s, the floor 11/140 s
    a = llama_report.analyze(raw)
    (b,) = a["below_floor"]
    assert (b["n"], b["tokens"], b["form"]) == (2, 8192, "single")
    assert b["ratio"] == pytest.approx(0.07 / (11 / 140)) and b["rate"] == pytest.approx(11 * GB / 0.07)
    assert b["measured_both"] == 140 * GB
    assert ("- 8b: single 2 GPU(s) at 8192 tokens: 0.891 of its host floor: the step moved 11.0 GB over the host "
            "links at 157.1 GB/s, above the 140.0 GB/s measured for both directions at once") in llama_report.render(a)
    assert llama_report.analyze(_raw())["below_floor"] == []


def test_pieces_stopped_before_their_first_row_are_named():
    """A piece's JSON is written before its first row (the 4-GPU torchrun piece of 2026-11-28 stopped by the
    budget while its ranks built): the driver counts its rows, and the report says it gave none."""
    ranks = [{"piece": "torchrun", "rank": r, "rows": []} for r in range(2)]
    assert llama_multi_gpu.rows_of({"kind": "torchrun"}, {"ranks": ranks}) == 0
    ranks[0]["rows"] = [{"tokens": 8192}, {"tokens": 65536}]
    assert llama_multi_gpu.rows_of({"kind": "torchrun"}, {"ranks": ranks}) == 2
    assert llama_multi_gpu.rows_of({"kind": "ours"}, {"rows": [{}]}) == 1
    assert llama_multi_gpu.rows_of({"kind": "ours"}, None) == 0
    assert llama_multi_gpu.rows_of({"kind": "anchor"}, {"anchor": "fsdp2", "error": "x"}) == 0
    assert llama_multi_gpu.rows_of({"kind": "anchor"}, {"anchor": "fsdp2", "step_s": 0.5}) == 1
    raw = dict(_raw(), pieces={"ours:8b": {"rc": 0, "wall_s": 192.0, "timed_out": False, "rows": 6},
                               "torchrun:8b": {"rc": -9, "wall_s": 183.0, "timed_out": True, "rows": 0}})
    text = llama_report.render(llama_report.analyze(raw))
    assert "Pieces: ours:8b 192 s; torchrun:8b 183 s (timed out) rc -9, no row" in text


def test_batch_shape():
    assert lm.batch_shape(8192, 2) == (2, 4096) and lm.batch_shape(65536, 2) == (16, 4096)
    assert lm.batch_shape(8192, 4) == (4, 2048)              # fewer sequences than devices: shorter ones
    assert lm.batch_shape(32, 2, seq=16) == (2, 16)
    with pytest.raises(ValueError, match="do not split"):
        lm.batch_shape(7, 2)


def test_largest_row_is_skipped_where_its_pinned_pools_and_reserve_exceed_the_host():
    gb, gib = 10**9, 2**30
    state = 413_860_000_000   # a 70B model's bf16 weights and two bf16 moments
    # 4 pools of ceil(state / 4 x headroom) GiB each, plus the reserve, against MemAvailable.
    assert llama_scaling.pools_do_not_fit(state, 4, 1.1, 520 * gb, 48 * gb) is None   # 4 x 106 GiB + 48 GB
    why = llama_scaling.pools_do_not_fit(state, 4, 1.2, 520 * gb, 48 * gb)            # 4 x 116 GiB + 48 GB
    assert why is not None and "4 pinned pools of 116.0 GiB" in why and "520.0 GB available" in why
    assert llama_scaling.pools_do_not_fit(state, 4, 1.2, None, 48 * gb) is None
    pools = 4 * 116 * gib
    assert llama_scaling.pools_do_not_fit(state, 4, 1.2, pools + 48 * gb, 48 * gb) is None
    assert llama_scaling.pools_do_not_fit(state, 4, 1.2, pools + 48 * gb - 1, 48 * gb) is not None


def test_largest_piece_skips_with_the_figures_when_the_host_is_too_small(tmp_path, monkeypatch):
    out = tmp_path / "largest.json"
    args = llama_multi_gpu.parse_args(["--piece", "largest", "--shape", "tiny", "--layers", "3", "--gpus", "2",
                                       "--tokens", "32", "--piece-out", str(out), "--largest-host-reserve-gb", "1e6"])
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "7")
    assert llama_scaling.run_piece(args) == 0
    d = json.loads(out.read_text())
    assert "plus 1000000 GB for the process" in d["skipped"] and d["rows"] == []
    assert os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] == "7"   # the pool was left as it was


def test_torchrun_ranks_pin_their_share_of_the_state_when_jax_starts(monkeypatch):
    from xla_swap.executors.host_pool import HOST_MEMORY_LIMIT_ENV, HOST_MEMORY_PREALLOCATE_ENV
    for name in (HOST_MEMORY_LIMIT_ENV, HOST_MEMORY_PREALLOCATE_ENV):   # unset here, and as before once the test ends
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr("xla_swap._compat.jax.backends_initialized", lambda: False)
    shape = lm.shape_of("8b", 4)
    share = lm.state_bytes(2 * lm.param_counts(shape)["total"]) / 4   # 3 x 2.27 GB over 4 ranks
    got = llama_scaling.pin_pool_at_start(shape, 4, 2.0)
    assert got == {"host_pool_gib": math.ceil(share * 2 / 2**30), "host_pool_headroom": 2.0,
                   "host_pool_preallocated": True}
    assert got["host_pool_gib"] == 4
    assert os.environ[HOST_MEMORY_LIMIT_ENV] == "4" and os.environ[HOST_MEMORY_PREALLOCATE_ENV] == "true"
    # the driver passes the factor on to every rank, and refuses one the pool cannot take
    args = llama_multi_gpu.parse_args(["--gpus", "2", "--shapes", "8b", "--anchors", "", "--torchrun-pool-headroom",
                                       "1.5"])
    cmd = next(p["cmd"] for p in llama_multi_gpu.plan(args, 2, "/tmp") if p["kind"] == "torchrun")
    assert cmd[cmd.index("--torchrun-pool-headroom") + 1] == "1.5"
    with pytest.raises(SystemExit):
        llama_multi_gpu.parse_args(["--torchrun-pool-headroom", "0.5"])


def test_hlo_collectives_groups_ops_by_result_type_with_bytes():
    text = """
  %all-gather = f32[4096,4096]{0,1} all-gather(%a), channel_id=1, dimensions={1}
  %all-gather.1 = f32[4096,4096]{0,1} all-gather(%b), channel_id=2, dimensions={1}
  %ag-start = bf16[8,16]{1,0} all-gather-start(%c), channel_id=3
  %all-reduce.26 = (f32[4096,128]{1,0}, /*index=1*/bf16[4096]{0}) all-reduce(%d, %e), channel_id=4, to_apply=%add
  %reduce-scatter = bf16[7168,4096]{1,0} reduce-scatter(%f), dimensions={0}
  %dot = f32[4,4]{1,0} dot(%g, %h)
"""
    got = llama_scaling.hlo_collectives(text)
    assert got == [
        {"op": "all-gather", "result": "f32[4096,4096]", "count": 2, "bytes": 2 * 4096 * 4096 * 4},
        {"op": "reduce-scatter", "result": "bf16[7168,4096]", "count": 1, "bytes": 7168 * 4096 * 2},
        {"op": "all-reduce", "result": "(f32[4096,128], bf16[4096])", "count": 1, "bytes": 4096 * 128 * 4 + 4096 * 2},
        {"op": "all-gather", "result": "bf16[8,16]", "count": 1, "bytes": 8 * 16 * 2}]
    assert llama_scaling.hlo_collectives("%dot = f32[4,4]{1,0} dot(%g, %h)") == []


def test_the_largest_dimension_rule_splits_some_held_layouts_on_dim_1_and_trains_alike():
    """``--shard largest`` (the A/B of the collectives' layouts, the package's rule before): ``gate_proj``,
    ``up_proj`` and ``lm_head`` split on dim 1 of the layout they are held in where ``"fsdp"`` splits every 2-D
    weight on dim 0, the batch split over the devices under both, and the same losses and updated weights."""
    shape = lm.shape_of("tiny")
    devs = jax.devices()[:2]
    x, y = lm.batch(2, 16, shape["vocab"], seed=1)
    got = {}
    for rule in ("fsdp", "largest"):
        stack, _ = llama_scaling.build_stack(shape, devs, "cpu", shard=rule)
        assert stack.runtime.layout.batch_axis == "d", rule
        specs = {n: tuple(a.sharding.spec) for p in stack.runtime.host_params for n, a in p.items() if a.ndim == 2}
        got[rule] = ([float(stack.train_step(x, y)) for _ in range(2)], specs,
                     [np.asarray(a, np.float32) for p in stack.runtime.host_params
                      for a in jax.tree_util.tree_leaves(p)])
    assert all(s[0] == "d" for s in got["fsdp"][1].values()), got["fsdp"][1]
    minor = sorted(n for n, s in got["largest"][1].items() if s[0] != "d")
    assert minor == ["lm_head.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"], minor
    # bf16 weights: the two layouts sum the dots in other orders
    np.testing.assert_allclose(got["largest"][0], got["fsdp"][0], rtol=1e-3)
    for a, b in zip(got["largest"][2], got["fsdp"][2]):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-4)
