"""The budget sweep benchmark (benchmarks/budget_sweep.py) on CPU: every row runs at a tiny shape and
the saved JSON re-renders (table; the PNG only into --out-dir); the analysis is checked on a hand-made raw dict."""
import json

import budget_sweep  # benchmarks/ is on pytest's pythonpath
import pytest


def test_tiny_run_and_render(tmp_path):
    assert budget_sweep.main(["--shapes", "32,64,4,8", "64,64,3,16", "--reps", "1", "--window", "1",
                              "--in-process", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "budget_sweep.json").read_text())
    sweep, other = data["raw"]
    assert set(sweep["auto"]) == {f"auto_{b}" for b in budget_sweep.BUDGETS} | {"fwd_auto_50"}
    assert set(other["auto"]) == {"auto_50", "fwd_auto_50"}
    for r in sweep["rows"].values():
        assert "error" not in r and len(r["step_s"]) == 1 and r["pred_step_s"] > 0
    assert sweep["rows"]["actoff_k2"]["offloaded_bytes"] > 0
    assert sweep["rows"]["ondev"]["resident"] == [True] * 4
    b = sweep["budgets"]
    assert b["window"] <= b["25"] <= b["50"] <= b["100"]
    # everything fits: the pick is predicted no slower than every stage resident (on CPU the
    # measured link can make streaming as fast, so the pick need not be all-resident)
    assert sweep["auto"]["auto_100"]["pred_step_s"] <= sweep["rows"]["ondev"]["pred_step_s"] * (1 + 1e-9)
    a = budget_sweep.analyze(sweep)
    assert a["budgets"]["auto_100"]["best_hand"] is not None and "actoff" in a
    # forward rows (their own budgets and auto row), half resident against the phase bound
    fwd = {"fwd_k2", "fwd_k4", "fwd_half_k2", "fwd_ondev"}
    assert fwd <= set(sweep["rows"]) and not any(sweep["rows"][n]["training"] for n in fwd)
    assert sweep["auto"]["fwd_auto_50"]["training"] is False and sweep["rows"]["half_k2"]["resident"] == [False] * 2 + [True] * 2
    assert a["budgets"]["fwd_auto_50"]["best_hand"] in fwd and sweep["phase_bound_s"] > 0 and "half" in a
    # peaks: actoff_k2 runs right before stream_k2; the floor is never under the on-device step
    order = [n for n in sweep["rows"] if "same_as" not in sweep["rows"][n]]
    assert order.index("actoff_k2") + 1 == order.index("stream_k2") and order.index("ondev_actoff") + 1 == order.index("ondev")
    for name, src in sweep["aliases"].items():               # a hand row equal to an earlier one is not run again
        assert sweep["rows"][name]["step_s"] == sweep["rows"][src]["step_s"] and name not in order
    assert "actoff_ondev" in a
    assert a["budgets"]["auto_50"]["floor_s"] >= a["rows"]["ondev"]["step_s"]
    assert "actoff" in budget_sweep.analyze(other)          # every shape measures activation offload
    # the user's one call on the sweep shape: built with budget_bytes, chose at its first train_step
    d = sweep["default_50"]
    assert d["first_call_s"] > 0 and len(d["step_s"]) == 1 and "default_50" in a and "default_50" not in other
    assert a["default_50"]["same_as_auto_50"] == budget_sweep._same(d["config"], sweep["auto"]["auto_50"])
    assert (tmp_path / "budget_sweep.png").stat().st_size > 1000
    md = (tmp_path / "budget_sweep.md").read_text()
    (tmp_path / "budget_sweep.png").unlink()
    assert budget_sweep.main(["--render", str(tmp_path / "budget_sweep.json")]) == 0
    assert not (tmp_path / "budget_sweep.png").exists()          # --render writes nothing unless asked
    assert budget_sweep.main(["--render", str(tmp_path / "budget_sweep.json"), "--out-dir", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "budget_sweep.png").exists()
    assert "auto_window" in md and "### shape D,F,L,T = 64,64,3,16" in md


def test_floor_for_is_the_compute_when_everything_fits_and_the_bytes_when_little_does():
    from xla_swap.planning import LayerCost, Link
    link = Link(h2d_gbps=50.0, d2h_gbps=50.0, both_gbps=80.0)
    costs = [LayerCost(param_bytes=10 ** 9, grad_bytes=10 ** 9, optimizer_bytes=2 * 10 ** 9, carry_bytes=10 ** 6,
                       forward_s=0.01)] * 12
    b = budget_sweep.budgets_for(costs, link)
    assert budget_sweep.floor_for(costs, link, b["100"], 0.123, True) == pytest.approx(0.123)
    low = budget_sweep.floor_for(costs, link, b["window"], 0.0, True)
    half = budget_sweep.floor_for(costs, link, b["50"], 0.0, True)
    assert low > half > 0                        # more budget, fewer bytes must move
    assert budget_sweep.floor_for(costs, link, b["window"], 100.0, True) == 100.0


def _row(step, pred_step, peak, pred_peak, **kw):
    return {"step_s": [step], "pred_step_s": pred_step, "peak_bytes": peak, "pred_peak_bytes": pred_peak,
            "pred_transfer_floor_s": kw.pop("xfer", 0.0), **kw}


def test_analysis_of_a_hand_made_raw():
    G = 2 ** 30
    raw = {"shape": [8, 16, 4, 2], "forward_s": [0.1] * 4, "backward_s": [0.2] * 4,
           "rows": {"stream_k2": _row(0.80, 0.78, 12 * G, 12 * G, xfer=0.7),
                    "actoff_k2": _row(0.808, 0.79, 11.2 * G, 12 * G, offloaded_bytes=0.75 * G, xfer=0.71),
                    "lastfirst_50": _row(0.70, 0.69, 15 * G, 14 * G, xfer=0.6),
                    "ondev": _row(0.36, 0.35, 27 * G, 27.5 * G),
                    "auto_50": _row(0.66, 0.65, 15.5 * G, 15 * G, xfer=0.55)},
           "auto": {"auto_50": {"budget_bytes": 16 * G, "same_as": None, "pred_step_s": 0.65,
                                "pred_peak_bytes": 15 * G, "describe": "k=1"},
                    "auto_100": {"budget_bytes": 28 * G, "same_as": "ondev", "pred_step_s": 0.35,
                                 "pred_peak_bytes": 27.5 * G, "describe": "all"}}}
    a = budget_sweep.analyze(raw)
    b50 = a["budgets"]["auto_50"]
    assert b50["best_hand"] == "lastfirst_50" and b50["over_best_hand"] == pytest.approx(0.66 / 0.70)
    assert b50["floor_s"] == pytest.approx(0.55) and b50["over_floor"] == pytest.approx(0.66 / 0.55)
    assert a["budgets"]["auto_100"]["row"] == "ondev" and a["auto_100_over_ondev"] == pytest.approx(1.0)
    assert a["budgets"]["auto_100"]["floor_s"] == pytest.approx(0.36)      # the on-device step
    assert a["actoff"]["overhead"] == pytest.approx(0.01)
    assert a["actoff"]["cut_per_offloaded_byte"] == pytest.approx(0.8 / 0.75)
    assert a["rows"]["stream_k2"]["step_over_pred"] == pytest.approx(0.80 / 0.78)
    assert a["rows"]["ondev"]["peak_over_pred"] == pytest.approx(27 / 27.5)
    text = budget_sweep.render([a])
    assert "| auto_50 | train | 16.00 | k=1 | 0.6600 (0.6500) | 1.200 | lastfirst_50 (0.7000) | 0.943 |" in text
    assert "overhead 1.00 %" in text


@pytest.mark.parametrize("run", [".", "shapes34", "fifth_run", "fourth_run", "fourth_run/shapes34", "third_run", "second_run",
                                 "second_run/shape3", "first_run"])
def test_committed_gpu_table_rerenders(run):
    """The committed H100 sweeps (benchmarks/results/budget_sweep/) re-render to their committed tables."""
    import subprocess
    import sys
    from pathlib import Path
    res = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "budget_sweep" / run
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "benchmarks" / "budget_sweep.py"),
                          "--render", str(res / "budget_sweep.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == (res / "budget_sweep.md").read_text()
