#!/usr/bin/env python
"""Timeline PNG of one traced streaming call from a ``benchmarks.gpu_stack`` result JSON.

The ``xla_swap-*`` rows of ``python -m benchmarks.gpu_stack`` carry a ``trace``: for every stage
(layer) and pass, one event per H2D weight transfer, per computation and (training) per D2H
gradient transfer, with host timestamps relative to the start of the call: ``issued_s``
(before the dispatch), ``dispatched_s`` (the asynchronous dispatch returned) and ``done_s``
(``block_until_ready`` returned in the watcher thread of ``xla_swap.executors.TraceRecorder``,
which waits on the results one at a time in dispatch order). No device-side start times exist,
so each bar is drawn as

    start = max(dispatched_s, done of the previous event on the same lane,
                done of what it consumes: a computation its stage's H2D of the same pass,
                a D2H its stage's computation)
    end   = done_s  (host-observed: an upper bound of the real completion)

One lane per kind (H2D, compute, and D2H when there is any), a bar per layer with its index
on it (forward and backward in two colours), x axis in ms. A bar is hatched when its done
stamp came less than 0.5 ms after the previous stamp: the event had completed while the
watcher still waited on an earlier-dispatched one, so its end is only an upper bound. Also printed: per-lane busy time,
the idle gaps of the compute lane, and the transfer time of one layer at the measured H2D
bandwidth.

Usage::

    .venv/bin/python benchmarks/plot_timeline.py                       # results/gpu_stack.json, xla_swap-k2, T=8192
    .venv/bin/python benchmarks/plot_timeline.py benchmarks/results/gpu_stack.json --tokens 32768
    .venv/bin/python benchmarks/plot_timeline.py benchmarks/results/gpu_stack.json \\
        --variant train-xla_swap-k2-saved --tokens 8192

Output: ``out/timeline_<variant>_T<tokens>.png`` (untracked; ``--out`` to change).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_JSON = REPO / "benchmarks" / "results" / "gpu_stack.json"
LANES = [("h2d", "H2D\n(weights → device)"), ("compute", "compute"), ("d2h", "D2H\n(grads → host)")]
COLORS = {"forward": "#4C78A8", "backward": "#F58518"}
#: A done stamp less than this after the previous one means the watcher did not wait on the event.
WAITED_S = 0.5e-3


def find_row(data: dict, variant: str, tokens: int) -> dict:
    rows = [r for r in data.get("results", []) if r.get("variant") == variant and r.get("tokens") == tokens]
    if not rows:
        have = sorted({(r.get("variant"), r.get("tokens")) for r in data.get("results", []) if r.get("trace")},
                      key=str)
        raise SystemExit(f"no row {variant!r} T={tokens}; rows with a trace: {have or 'none'}")
    row = rows[0]
    if not row.get("trace"):
        raise SystemExit(f"row {variant!r} T={tokens} has no trace (skipped, failed or run with --no-trace): "
                         f"{row.get('skipped') or row.get('error') or ''}".strip())
    return row


def _num(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def layout(trace: list) -> list:
    """Bars: dicts with lane, pass, stage, start_s, end_s, dispatched_s (see the module docstring)."""
    events = [dict(e) for e in trace if _num(e.get("done_s")) is not None]
    for e in events:
        e["t_disp"] = _num(e.get("dispatched_s"))
        if e["t_disp"] is None:
            e["t_disp"] = _num(e.get("issued_s")) or 0.0
    done = {(e["pass_name"], e["stage"], e["kind"]): e["done_s"] for e in events}
    # The watcher waits in dispatch order: an event stamped within WAITED_S of the previous
    # stamp was already complete when the watcher reached it (its end is only an upper bound).
    prev_done = None
    for e in sorted(events, key=lambda e: e["t_disp"]):
        e["waited"] = prev_done is None or e["done_s"] - prev_done > WAITED_S
        prev_done = e["done_s"]
    bars = []
    for kind, _ in LANES:
        prev = 0.0
        for e in sorted((e for e in events if e["kind"] == kind), key=lambda e: e["t_disp"]):
            dep = None
            if kind == "compute":
                dep = done.get((e["pass_name"], e["stage"], "h2d"))
            elif kind == "d2h":
                dep = done.get((e["pass_name"], e["stage"], "compute"))
            start = max(e["t_disp"], prev, dep or 0.0)
            start = min(start, e["done_s"])
            bars.append({"lane": kind, "pass": e["pass_name"], "stage": e["stage"], "start_s": start,
                         "end_s": e["done_s"], "dispatched_s": e["t_disp"], "error": e.get("error"),
                         "end_observed": e["waited"]})
            prev = e["done_s"]
    return bars


def lane_stats(bars: list) -> dict:
    """Per lane: busy ms, span ms, busy fraction, and the idle gaps (ms) between consecutive bars."""
    out = {}
    for kind, _ in LANES:
        bs = sorted((b for b in bars if b["lane"] == kind), key=lambda b: b["start_s"])
        if not bs:
            continue
        busy = sum(b["end_s"] - b["start_s"] for b in bs)
        span = bs[-1]["end_s"] - bs[0]["start_s"]
        gaps = [(round(1e3 * b0["end_s"], 2), round(1e3 * (b1["start_s"] - b0["end_s"]), 2))
                for b0, b1 in zip(bs, bs[1:]) if b1["start_s"] - b0["end_s"] > 1e-4]
        out[kind] = {"bars": len(bs), "busy_ms": 1e3 * busy, "first_start_ms": 1e3 * bs[0]["start_s"],
                     "last_end_ms": 1e3 * bs[-1]["end_s"], "busy_frac_of_own_span": busy / span if span else 1.0,
                     "gaps_ms (at, length)": gaps,
                     "bar_ms": [round(1e3 * (b["end_s"] - b["start_s"]), 1) for b in bs],
                     "end_observed": [b["end_observed"] for b in bs]}
    return out


def plot(data: dict, row: dict, out: Path) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    bars = layout(row["trace"])
    stats = lane_stats(bars)
    lanes = [(k, label) for k, label in LANES if k in stats]
    end_ms = max(1e3 * b["end_s"] for b in bars)
    meta = data.get("meta", {})
    bw = (data.get("bandwidth") or {}).get("h2d_GBps")
    layer_bytes = meta.get("weight_bytes", 0) / max(meta.get("layers", 1), 1)
    layer_ms = layer_bytes / (bw * 1e9) * 1e3 if bw else None

    fig, ax = plt.subplots(figsize=(13, 1.0 + 1.1 * len(lanes)))
    height = 0.62
    for y, (kind, _) in enumerate(lanes):
        for b in (b for b in bars if b["lane"] == kind):
            x0, w = 1e3 * b["start_s"], 1e3 * (b["end_s"] - b["start_s"])
            ax.barh(y, w, left=x0, height=height, color=COLORS.get(b["pass"], "gray"),
                    edgecolor="black", linewidth=0.6, alpha=(0.9 if b["end_observed"] else 0.45) * (0.4 if b["error"] else 1),
                    hatch=None if b["end_observed"] else "///")
            ax.text(x0 + w / 2, y, str(b["stage"]), ha="center", va="center", fontsize=8 if w > 4 else 6,
                    color="white", fontweight="bold")
            ax.plot([1e3 * b["dispatched_s"]] * 2, [y - height / 2 - 0.12, y - height / 2 - 0.02],
                    color="dimgray", linewidth=0.8)
        s = stats[kind]
        bound = "" if all(s["end_observed"]) else "≤ "
        ax.text(end_ms * 1.01, y, f"busy {bound}{s['busy_ms']:.0f} ms\n"
                f"({bound}{100 * s['busy_ms'] / end_ms:.0f}% of call)", va="center", fontsize=8)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([label for _, label in lanes], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, end_ms * 1.12)
    ax.set_xlabel("ms since the start of the traced call (host clock)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    passes = sorted({b["pass"] for b in bars}, key=lambda p: p != "forward")
    handles = [Patch(color=COLORS.get(p, "gray"), label=p) for p in passes]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                         label="end only an upper bound (done while the watcher waited on an earlier event)"))
    handles.append(plt.Line2D([], [], color="dimgray", label="dispatched (tick)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.28 - 0.1 / len(lanes)), fontsize=8,
              ncol=len(handles), frameon=False)

    med, floor = row.get("median_ms"), row.get("floor_ms")
    title = (f"{row['variant']}, T={row['tokens']}, {meta.get('layers', '?')} layers, "
             f"{layer_bytes / 2**30:.2f} GiB/layer on {row.get('device', meta.get('device', '?'))}: traced call "
             f"{end_ms:.0f} ms (timed median {med:.0f} ms" if med else f"{row['variant']}, T={row['tokens']}: "
             f"traced call {end_ms:.0f} ms (")
    title += f", floor {floor:.0f} ms)" if floor else ")"
    if layer_ms:
        title += f"\none layer's weights at the measured H2D {bw:.1f} GB/s: {layer_ms:.1f} ms"
    fl = (data.get("floors") or {}).get(str(row["tokens"])) or {}
    key = "train_compute_ms" if row["variant"].startswith("train-") else "compute_ms"
    per_layer_compute = fl.get(key) / meta["layers"] if fl.get(key) and meta.get("layers") else None
    if per_layer_compute:
        title += (f"; on-device {'forward+backward' if key == 'train_compute_ms' else 'compute'}: "
                  f"{per_layer_compute:.1f} ms/layer")
    subtitle = ("bars: start = max(dispatch, previous done on the lane, done of the stage's own input: H2D for "
                "compute, compute for D2H); end = done as observed on the host.\nOnly host-observed done times "
                "exist (one watcher thread waits in dispatch order), so ends are upper bounds and starts are "
                "inferred, not measured.")
    fig.suptitle(title, fontsize=10, y=1.0 + 0.04 * (3 - len(lanes)))
    ax.set_title(subtitle, fontsize=7.5, color="dimgray")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return {"out": str(out), "traced_call_ms": end_ms, "median_ms": med, "floor_ms": floor,
            "one_layer_h2d_ms": layer_ms, "on_device_ms_per_layer": per_layer_compute, "lanes": stats}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="?", default=str(DEFAULT_JSON), help="gpu_stack result JSON")
    p.add_argument("--variant", default="xla_swap-k2", help="row variant (default xla_swap-k2)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", default=None, help="PNG path (default out/timeline_<variant>_T<tokens>.png, untracked)")
    args = p.parse_args(argv)
    data = json.loads(Path(args.json).read_text())
    variant = args.variant
    row = find_row(data, variant, args.tokens)
    out = Path(args.out) if args.out else REPO / "out" / f"timeline_{variant}_T{args.tokens}.png"
    summary = plot(data, row, out)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
