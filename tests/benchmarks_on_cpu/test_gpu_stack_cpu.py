"""The GPU benchmark package ``benchmarks.gpu_stack``, checked on CPU (timings mean nothing here).

* Measurement: one variant of every kind runs in this process on a tiny stack; the
  xla_swap rows (in-graph, chunked streaming, training with kept residuals - chunked:
  per-stage gradients merged back to per-layer ones) agree with the on-device per-layer
  loop, gradients go to pinned_host, the streaming rows carry a trace.
* The runner: a driver run with one subprocess per variant, each given a ``ChildSpec`` file.
* The registry and the spec: every name resolves, every kind has a builder, specs round-trip.
* Analysis: floors, ratios, predicted peaks and target verdicts on a hand-made result.
* The report: ``--render`` of the committed run-8 JSON reproduces its table byte for byte.
"""
import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.gpu_stack import analysis, cli, measure, report, runner, variants
from benchmarks.gpu_stack.spec import ChildSpec, RunSpec, parse_chunks

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
TINY = RunSpec(d=64, f=128, layers=3, tokens=(32,), reps=2, chunks=((32, 4, 4),), trace=True)


# ---------------------------------------------------------------------------- measurement
@pytest.fixture(scope="module")
def rows():
    out = []
    for name in ("xla_swap-in-graph", "xla_swap-k2-chunked", "train-xla_swap-k2-saved-chunked", "train-xla_swap-k2",
                 "xla-in-graph", "xla-in-graph-unrolled", "on-device", "train-on-device", "train-on-device-jit-all",
                 "torch_xla-lowered", "accelerate"):
        out += measure.run_variant(TINY, name, [32])
    return {r["variant"]: r for r in out}


def test_forward_rows_agree_with_the_on_device_loop(rows):
    for v in ("xla_swap-in-graph", "xla_swap-k2-chunked", "xla-in-graph", "xla-in-graph-unrolled", "on-device-jit"):
        r = rows[v]
        assert "error" not in r, r.get("error")
        assert r["rel_err"] < 2e-2          # bf16, chunked sums reordered
        assert len(r["times_s"]) == 2 and r["median_ms"] > 0
    assert rows["on-device-loop"]["rel_err"] == 0.0  # it is the reference
    assert rows["xla_swap-k2-chunked"]["stages"] == 1 + 2 * 4   # 3 layers, first and last in 4 chunks
    assert rows["xla_swap-k2-chunked"]["prefetch_depth"] == 2 and rows["xla_swap-k2-chunked"]["throttle"] is True
    # the flag search compiled the in-graph programs again under every flag set (or recorded why not)
    for name in variants.FLAG_SETS:
        assert f"xla_swap-in-graph@{name}" in rows and f"xla-in-graph@{name}" in rows
    assert not any("@" in v for v in rows if v.startswith(("xla_swap-k", "on-device", "train")))


def test_training_rows_agree_and_send_gradients_to_host(rows):
    for v in ("train-xla_swap-k2-saved-chunked", "train-xla_swap-k2"):
        r = rows[v]
        assert "error" not in r, r.get("error")
        assert r["grads_memory_kind"] == "pinned_host"
        assert max(r["rel_err_out"], r["rel_err_dx"], r["rel_err_grads"]) < 2e-2
    for v in ("train-on-device", "train-on-device-jit", "train-on-device-saved-jit"):
        assert "error" not in rows[v] and rows[v]["grads_memory_kind"] == "device"
        assert rows[v]["rel_err"] < 2e-2
    saved = rows["train-xla_swap-k2-saved-chunked"]
    assert sum(saved["residual_nbytes"]) > 0 and sum(rows["train-xla_swap-k2"]["residual_nbytes"]) == 0
    assert rows["train-on-device-saved-jit"]["group_member"] == 1  # ran in the group's process


def test_streaming_rows_carry_the_recorded_trace(rows):
    r = rows["train-xla_swap-k2"]
    kinds = {(e["pass_name"], e["kind"]) for e in r["trace"]}
    assert {("forward", "compute"), ("backward", "compute"), ("backward", "d2h")} <= kinds
    assert sorted(e["stage"] for e in r["trace"] if e["kind"] == "compute" and e["pass_name"] == "forward") == [0, 1, 2]
    assert all(e["error"] is None and e["done_s"] >= e["dispatched_s"] >= e["issued_s"] >= 0 for e in r["trace"])
    assert "trace" not in rows["xla_swap-in-graph"]


def test_missing_artifact_and_torch_are_skips_not_errors(rows):
    assert "no torch_xla artifact" in rows["torch_xla-lowered"]["skipped"]
    assert "error" not in rows["torch_xla-lowered"]
    assert rows["accelerate"].get("skipped") or rows["accelerate"].get("median_ms")


# ---------------------------------------------------------------------------- runner
def test_driver_runs_each_variant_in_a_child_given_a_spec(tmp_path, capsys):
    out = tmp_path / "out"
    cli.main(["--d", "64", "--f", "128", "--layers", "2", "--tokens", "16", "--reps", "1", "--no-flag-search",
              "--variants", "bandwidth", "on-device-loop", "xla_swap-k1", "--out-dir", str(out)])
    data = json.loads((out / "gpu_stack.json").read_text())
    assert data["meta"]["command"].endswith("-m benchmarks.gpu_stack --d 64 --f 128 --layers 2 --tokens 16 --reps 1 "
                                            "--no-flag-search --variants bandwidth on-device-loop xla_swap-k1 "
                                            f"--out-dir {out}")
    assert RunSpec.from_dict(data["meta"]["spec"]).layers == 2
    assert data["meta"]["targets"] == analysis.DEFAULT_TARGETS.to_dict()
    assert data["meta"]["weight_cache"].get("gen_s") is not None  # the weights process ran
    assert data["bandwidth"]["h2d_GBps"] > 0
    got = {r["variant"]: r for r in data["results"]}
    assert set(got) == {"on-device-loop", "xla_swap-k1"}
    for r in got.values():
        assert "error" not in r, r.get("error")
        assert r["process_wall_s"] > 0 and r["rel_err"] < 2e-2 and r["ratio"] is not None
    md = (out / "gpu_stack.md").read_text()
    assert md == report.markdown(data) + "\n" and md in capsys.readouterr().out + "\n"


def test_plan_orders_by_priority_and_keeps_group_members():
    plan = runner.plan(["xla_swap-k1", "train-on-device-jit", "on-device", "bandwidth"], [64, 16], accelerate=True)
    assert plan == [("bandwidth", None), ("on-device", [16, 64]), ("accelerate", [16]), ("xla_swap-k1", [16, 64]),
                    ("train-on-device-jit", [16, 64])]


# ---------------------------------------------------------------------------- registry and spec
def test_registry_names_resolve_and_every_kind_has_a_builder():
    for name in variants.ALL_NAMES:
        members = variants.GROUPS.get(name, (name,))
        assert all(variants.lookup(m) is not None for m in members), name
    members = {m for g in variants.GROUPS.values() for m in g}
    for preset in variants.PRESETS.values():
        assert set(preset) <= set(variants.ALL_NAMES) | members
    timed = {v.kind for v in variants.VARIANTS.values()} - {"bandwidth", "weights", "accelerate"}
    assert timed == set(measure.BUILDERS)
    assert variants.lookup("xla_swap-in-graph@lhs") is variants.VARIANTS["xla_swap-in-graph"]
    assert variants.lookup("no-such-row") is None
    v = variants.VARIANTS["train-xla_swap-k2-saved-chunked"]
    assert (v.kind, v.train, v.saved, v.prefetch_depth, v.chunked, v.throttle) == ("streaming", True, True, 2, True, True)
    assert variants.VARIANTS["xla_swap-k2-nothrottle"].throttle is False
    assert variants.compute_reference_names(train=False) == ("on-device-loop", "on-device-jit")
    assert variants.compute_reference_names(train=True, saved=True) == ("train-on-device-saved-jit",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.prefetch_depth = 3


def test_registry_refuses_bad_variants_and_names():
    with pytest.raises(ValueError, match="kind must be one of"):
        variants.Variant("x", "scan")
    with pytest.raises(ValueError, match="prefetch_depth is for kind 'streaming' only"):
        variants.Variant("x", "xla-in-graph", prefetch_depth=2)
    with pytest.raises(ValueError, match="prefetch_depth must be >= 1"):
        variants.Variant("x", "streaming", prefetch_depth=0)
    with pytest.raises(ValueError, match="saved .* needs train"):
        variants.Variant("x", "on-device-jit", saved=True)
    assert variants.expand(["in-graph", "xla-in-graph", "on-device-jit"]) == [
        "bandwidth", "on-device-loop", "xla-in-graph", "torch_xla-lowered", "on-device-jit"]
    with pytest.raises(ValueError, match="unknown 'xla_swap-k9'"):
        variants.expand(["xla_swap-k9"])


def test_cli_errors_name_the_option(capsys):
    for argv, msg in ((["--variants", "nope"], "--variants: unknown 'nope'"),
                      (["--chunks", "3", "--f", "128"], "--chunks: chunk counts must be >= 1 and divide --f"),
                      (["--chunks", "64=1,2", "--tokens", "64", "128"], "--chunks: no chunk counts for token counts"),
                      (["--layers", "0"], "--layers must be >= 1")):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_spec_round_trips_and_validates():
    child = ChildSpec(TINY.replace(weights_cache="/dev/shm/x"), "on-device", (32,), "/tmp/r.json")
    assert ChildSpec.from_json(child.to_json()) == child
    assert TINY.chunk_plan(32) == (4, 4) and TINY.weight_bytes == 3 * 2 * 64 * 128 * 2
    with pytest.raises(KeyError, match="no chunk counts for 64 tokens"):
        TINY.chunk_plan(64)
    with pytest.raises(ValueError, match="reps must be >= 1"):
        TINY.replace(reps=0)
    with pytest.raises(ValueError, match="chunks: .* dividing f \\(128\\)"):
        TINY.replace(chunks=((32, 3, 1),))
    with pytest.raises(ValueError, match="no chunk counts for token counts \\[64\\]"):
        TINY.replace(tokens=(32, 64))
    with pytest.raises(TypeError):
        RunSpec.from_dict({"layer": 3})


def test_chunk_spec():
    assert parse_chunks(["4"], [64, 128]) == {64: (4, 4), 128: (4, 4)}
    assert parse_chunks(["64=1,2", "128=4,1"], [64, 128]) == {64: (1, 2), 128: (4, 1)}
    with pytest.raises(ValueError, match="no chunk counts for token counts \\[128\\]"):
        parse_chunks(["64=1,2"], [64, 128])
    with pytest.raises(ValueError, match="expected N or TOKENS=FIRST,LAST, got '64=2'"):
        parse_chunks(["64=2"], [64])


# ---------------------------------------------------------------------------- analysis
GB = 1e9


def _result():
    """A hand-made result: W = 10 GB, H2D 100 GB/s (100 ms), D2H 50 GB/s (200 ms), both 120 GB/s (250 ms)."""
    W = int(10 * GB)
    rows = [
        {"variant": "on-device-loop", "tokens": 8, "median_ms": 90.0, "min_ms": 88.0},
        {"variant": "on-device-jit", "tokens": 8, "median_ms": 80.0, "min_ms": 79.0},
        {"variant": "train-on-device", "tokens": 8, "median_ms": 300.0, "min_ms": 290.0},
        {"variant": "train-on-device-saved-jit", "tokens": 8, "median_ms": 220.0, "min_ms": 210.0},
        {"variant": "xla_swap-k2", "tokens": 8, "median_ms": 102.0, "min_ms": 101.0,
         "peak_bytes": 1050, "predicted_peak_bytes": 1000},
        {"variant": "xla_swap-in-graph", "tokens": 8, "median_ms": 110.0, "min_ms": 105.0},
        {"variant": "xla_swap-in-graph@lhs", "tokens": 8, "median_ms": 101.0, "min_ms": 100.0},
        {"variant": "train-xla_swap-k2", "tokens": 8, "median_ms": 330.0, "min_ms": 320.0,
         "peak_bytes": 800, "predicted_peak_bytes": 1000},
        {"variant": "train-xla_swap-k2-saved", "tokens": 8, "median_ms": 255.0, "min_ms": 250.0},
        {"variant": "accelerate", "tokens": 8, "median_ms": 510.0, "min_ms": 500.0},
        {"variant": "xla-in-graph", "tokens": 8, "median_ms": 100.0, "min_ms": 100.0},
        {"variant": "torch_xla-lowered", "tokens": 8, "median_ms": 101.0, "min_ms": 100.0},
        {"variant": "xla_swap-k1", "tokens": 8, "error": "boom"},
    ]
    return {"meta": {"tokens": [8], "weight_bytes": W},
            "bandwidth": {"h2d_GBps": 90.0, "h2d_best_GBps": 100.0, "d2h_GBps": 50.0, "both_GBps": 120.0},
            "results": rows}


def test_floors_and_ratios():
    data = _result()
    analysis.compute_floors(data)
    f = data["floors"]["8"]
    assert f["compute_ms"] == 80.0 and f["h2d_ms"] == pytest.approx(100.0)   # the best H2D figure
    assert f["forward_ms"] == pytest.approx(100.0)
    assert f["train_transfer_ms"] == pytest.approx(250.0)                   # 3W / both-ways
    assert f["train_ms"] == 300.0 and f["train_saved_ms"] == 250.0
    assert f["train_phase_ms"] == pytest.approx(100.0 + 220.0)              # max(80, 100) + max(300 - 80, 200)
    by = {r["variant"]: r for r in data["results"]}
    assert by["xla_swap-k2"]["ratio"] == pytest.approx(1.02)
    assert by["train-xla_swap-k2"]["ratio"] == pytest.approx(1.1)
    assert by["train-xla_swap-k2-saved"]["floor_ms"] == 250.0                # the -saved family's floor
    assert by["train-xla_swap-k2"]["ratio_phase"] == pytest.approx(330.0 / 320.0)
    assert by["xla_swap-k2"]["peak_over_predicted"] == pytest.approx(1.05)
    assert "ratio" not in by["xla_swap-k1"]
    before = json.dumps(data, sort_keys=True)
    analysis.compute_floors(data)
    assert json.dumps(data, sort_keys=True) == before                        # idempotent


def test_target_verdicts_and_their_lines():
    data = _result()
    analysis.compute_floors(data)
    got = {v["target"]: v for v in analysis.evaluate_targets(data)}
    assert got["forward"]["variant"] == "xla_swap-k2" and got["forward"]["met"] is True
    assert got["train"]["variant"] == "train-xla_swap-k2-saved" and got["train"]["met"] is True  # 1.02 <= 1.10
    assert got["forward_flag_search"]["variant"] == "xla_swap-in-graph@lhs" and got["forward_flag_search"]["met"]
    assert got["accelerate_speedup"]["speedup"] == pytest.approx(5.0) and got["accelerate_speedup"]["met"]
    assert got["peak"]["variant"] == "train-xla_swap-k2" and got["peak"]["met"] is False       # 0.80: 20 % off
    strict = analysis.Targets(forward=1.01, train=1.01)
    got = {v["target"]: v for v in analysis.evaluate_targets(data, strict)}
    assert got["forward"]["met"] is False and got["train"]["met"] is False
    lines = report.targets_lines(analysis.evaluate_targets(data))
    assert "- forward T=8: 1.020x floor (xla_swap-k2, 102.0 ms) - target <= 1.03x MET" in lines
    assert ("- peak device memory vs prediction, xla_swap rows: worst 0.80 (train-xla_swap-k2 T=8) - "
            "target within 10% MISSED") in lines
    # the targets a result stores are the ones it is judged against
    data["meta"]["targets"] = strict.to_dict()
    assert analysis.targets_of(data) == strict
    (cmp,) = analysis.torch_xla_vs_jax(data)
    assert cmp["ratio"] == pytest.approx(1.01) and cmp["within"] is True    # within the default 2 %
    (cmp,) = analysis.torch_xla_vs_jax(data, analysis.Targets(torch_xla=0.005))
    assert cmp["within"] is False


def test_predicted_peak_of_a_streaming_row_is_its_largest_live_set():
    # 3 stages of 100 B, k=1, activations 10 B, forward temporaries 5 B, 1000 B in use before
    row = {"variant": "xla_swap-k1", "bytes_in_use_before": 1000, "activation_bytes": 10, "weight_bytes": 300,
           "prefetch_depth": 1, "throttle": True, "stage_nbytes": [100, 100, 100], "stage_input_nbytes": [10, 10, 10],
           "stage_temp_bytes": {"forward": [5, 5, 5], "backward": [0, 0, 0]}, "residual_nbytes": [0, 0, 0]}
    got = analysis.predict_peak(row, layers=3)
    assert got["predicted_peak_bytes"] == 1000 + 200 + 10 + 10 + 5          # weights of 2 stages, in, out, temp
    assert got["predicted_note"].startswith("live set at forward 0")
    train = dict(row, variant="train-xla_swap-k1", residual_nbytes=[7, 7, 7])
    # backward of stage 2: weights of 1..2, inputs and residuals of 0..2, cotangent in and out
    assert analysis.predict_peak(train, layers=3)["predicted_peak_bytes"] == 1000 + 200 + 30 + 21 + 10 + 10
    # the weights term is the runtime's PrefetchSchedule: with stages 0 and 1 resident (counted in the
    # bytes in use before) only stage 2's weights are live
    part = dict(train, resident=[True, True, False])
    assert analysis.predict_peak(part, layers=3)["predicted_peak_bytes"] == 1000 + 100 + 30 + 21 + 10 + 10
    assert analysis.predict_peak(dict(row, throttle=False), 3)["predicted_peak_bytes"] is None
    assert analysis.predict_peak(dict(row, bytes_in_use_before=None), 3) == {}
    loop = {"variant": "train-on-device", "bytes_in_use_before": 0, "activation_bytes": 10, "weight_bytes": 300,
            "layer_temp_bytes": 4}
    assert analysis.predict_peak(loop, layers=3)["predicted_peak_bytes"] == 4 * 10 + 300 + 20 + 4


# ---------------------------------------------------------------------------- report
def test_render_reproduces_the_committed_run_8_table(tmp_path, capsys):
    src = RESULTS / "gpu_stack.json"
    committed = (RESULTS / "gpu_stack.md").read_text()
    before = src.read_bytes()
    cli.main(["--render", str(src), "--out-dir", str(tmp_path)])
    assert (tmp_path / "gpu_stack.md").read_text() == committed
    assert capsys.readouterr().out == committed
    assert src.read_bytes() == before                                       # the input is only read
    assert "| xla_swap-k2-chunked | 32768 |" in committed
