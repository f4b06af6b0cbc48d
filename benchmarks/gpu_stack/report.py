"""The report: a result (JSON dicts, analysed) rendered as markdown tables and lines.

Only formatting lives here; every figure comes from the result rows or from
``analysis`` (floors, target verdicts, the torch_xla comparison). Standard library only.
"""
from __future__ import annotations

from ._util import GiB, gib
from .analysis import evaluate_targets, torch_xla_vs_jax

__all__ = ["markdown", "targets_lines", "torch_xla_vs_jax_lines"]


def markdown(data: dict) -> str:
    """The markdown report of a result (after ``analysis.compute_floors``): header, bandwidth,
    targets, the table of rows, the torch_xla comparison, floors and notes. No trailing newline."""
    m = data["meta"]
    bw = data.get("bandwidth") or {}
    lines = [f"## gpu_stack: {m['layers']}-layer bf16 FFN stack, D={m['d']}, F={m['f']}, "
             f"{m['weight_bytes'] / GiB:.2f} GiB of weights",
             "",
             f"device: {m.get('device')} ({m.get('platform')}), jax {m.get('jax_version')}, {m['date']}, "
             f"isolate={m['isolate']}, reps={m['reps']}, total {m.get('total_wall_s', float('nan')):.0f} s",
             "",
             f"command: `{m['command']}`",
             ""]
    if bw.get("h2d_GBps"):
        lines += [f"pinned bandwidth ({bw['bytes'] / GiB:.2f} GiB in {bw.get('buffers', 1)} buffers, median / best "
                  f"of {len(bw.get('h2d_times_s', []))}; floors use the best): H2D {bw['h2d_GBps']:.1f} / "
                  f"{bw.get('h2d_best_GBps', float('nan')):.1f} GB/s, D2H {bw['d2h_GBps']:.1f} / "
                  f"{bw.get('d2h_best_GBps', float('nan')):.1f} GB/s, both at once {bw['both_GBps']:.1f} / "
                  f"{bw.get('both_best_GBps', float('nan')):.1f} GB/s (aggregate)", ""]
    lines += targets_lines(evaluate_targets(data))
    lines += ["| variant | tokens | median ms | min ms | floor ms | x floor | peak dev GiB | predicted GiB "
              "| peak / pred | temp GiB | max rel err | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    for r in data["results"]:
        if r["variant"] == "bandwidth":
            continue
        note = r.get("error", "") or r.get("skipped", "")
        note = note.strip().splitlines()[-1][:80] if note else ""
        if "copy_start_count" in r:
            note = (note + f" copy-start={r['copy_start_count']}").strip()
        if r.get("grads_memory_kind"):
            note = (note + f" grads:{r['grads_memory_kind']}").strip()
        if r.get("predicted_note") and r.get("predicted_peak_bytes") is None:
            note = (note + " " + r["predicted_note"]).strip()
        if r.get("peak_is_cumulative"):
            note = (note + " peak cumulative").strip()
        lines.append("| " + " | ".join([
            r["variant"], str(r.get("tokens", "")), f(r.get("median_ms")), f(r.get("min_ms")),
            f(r.get("floor_ms")), f(r.get("ratio"), "{:.3f}"), gib(r.get("peak_bytes")),
            gib(r.get("predicted_peak_bytes")), f(r.get("peak_over_predicted"), "{:.2f}"),
            gib(r.get("temp_bytes")), f(r.get("rel_err"), "{:.1e}"), note]) + " |")
    lines += torch_xla_vs_jax_lines(torch_xla_vs_jax(data))
    fl = data.get("floors", {})
    lines += ["", "Floors: forward = max(compute = min(on-device-loop, on-device-jit), W / H2D); training = "
              "max(compute, 2W / H2D, W / D2H, 3W / both-ways), W = weight bytes; training compute = the on-device "
              "time of the same algorithm: min(train-on-device, train-on-device-jit) for per-layer recompute rows, "
              "train-on-device-saved-jit for -saved rows (residuals kept: dots_with_no_batch_dims_saveable)."]
    for t, fv in fl.items():
        lines.append(f"- T={t}: forward floor {_fmt(fv.get('forward_ms'))} ms (compute {_fmt(fv.get('compute_ms'))}, "
                     f"W/H2D {_fmt(fv.get('h2d_ms'))}); training floor {_fmt(fv.get('train_ms'))} ms (compute "
                     f"{_fmt(fv.get('train_compute_ms'))}), -saved {_fmt(fv.get('train_saved_ms'))} ms (compute "
                     f"{_fmt(fv.get('train_saved_compute_ms'))}); transfer {_fmt(fv.get('train_transfer_ms'))} ms; "
                     f"phase bounds {_fmt(fv.get('train_phase_ms'))} / -saved {_fmt(fv.get('train_saved_phase_ms'))} ms")
    lines += ["", "Phase bound (training): max(C_fwd, W/H2D) + max(C_train - C_fwd, W/D2H): the backward starts after "
              "the forward's last layer, whose weights arrive only after all W crossed H2D, then computes and sends W "
              "of gradients out. The issue's floor treats the step as one pool of transfers and compute; where the "
              "forward is transfer-bound and the backward compute-bound, no schedule that streams every layer in "
              "the forward reaches it."]
    lines += ["", "Peak: one process per variant, token counts ascending; the first token count's peak is its own, "
              "later ones are the process's high-water mark (jax cannot reset it; activations grow with T). "
              "Predicted = bytes in use before the call + the working set: xla_swap streaming (throttled) = the "
              "largest live set over the runtime's schedule: at each stage, the weights of the k+1 stages it holds "
              "(the one computing + k prefetched; in the backward its gradients reuse its weights' buffers), the "
              "stage inputs and saved residuals kept so far (training), the stage's input and output (cotangents) "
              "and its executable's temporaries (compiled memory_analysis); in-graph = compiled temp + output; "
              "on-device loops = activations (+ gradients) + one layer's temporaries; rows after the first of a "
              "process group are not compared.",
              "xla_swap rows throttle (host waits on stage i-1, no data transfer) unless -nothrottle; -chunked: first "
              "and last layer split into column-chunk stages; rel err = max|x-ref|/max|ref| vs on-device loop."]
    if m.get("platform") == "cpu":
        lines.append("CPU run: pinned_host and device are both host RAM; ratios and bandwidths mean nothing.")
    return "\n".join(lines)



def targets_lines(verdicts: list) -> list:
    """Lines of the targets block from ``analysis.evaluate_targets`` verdicts (one line each)."""
    out = ["Targets (best xla_swap path per token count, medians):", ""]
    labels = {"forward": "forward", "train": "training step"}
    for v in verdicts:
        t, bound = v.get("tokens"), v["bound"]
        if v["target"] in labels:
            label = labels[v["target"]]
            if v["variant"] is None:
                out.append(f"- {label} T={t}: no result")
                continue
            phase = (f"; {v['ratio_phase']:.3f}x the phase bound {v['phase_bound_ms']:.1f} ms"
                     if v.get("ratio_phase") else "")
            out.append(f"- {label} T={t}: {v['ratio']:.3f}x floor ({v['variant']}, {v['median_ms']:.1f} ms{phase}) - "
                       f"target <= {bound:.2f}x {'MET' if v['met'] else 'MISSED'}")
        elif v["target"] == "forward_flag_search":
            out.append(f"- forward T={t}, xla_swap in-graph under the best XLA flag set of this run: "
                       f"{v['ratio']:.3f}x ({v['variant']}, {v['median_ms']:.1f} ms; the best of {v['candidates']} "
                       f"medians, so biased low) - {'within' if v['met'] else 'above'} {bound:.2f}x")
        elif v["target"] == "accelerate_speedup":
            out.append(f"- vs HF accelerate cpu_offload T={t}: {v['accelerate_ms']:.1f} ms / {v['xla_swap_ms']:.1f} ms "
                       f"= {v['speedup']:.1f}x faster - target >= {bound:.0f}x {'MET' if v['met'] else 'MISSED'}")
        elif v["target"] == "peak":
            out.append(f"- peak device memory vs prediction, xla_swap rows: worst {v['peak_over_predicted']:.2f} "
                       f"({v['variant']} T={t}) - target within {bound:.0%} {'MET' if v['met'] else 'MISSED'}")
        else:
            raise ValueError(f"unknown target verdict {v['target']!r}")
    return out + [""]


def _fmt(x):
    return "-" if x is None else f"{x:.1f}"


def torch_xla_vs_jax_lines(comparisons: list) -> list:
    """The line after the table from ``analysis.torch_xla_vs_jax``: torch_xla-lowered / xla-in-graph
    medians per token count (empty when neither row ran)."""
    parts = []
    for c in comparisons:
        if "na" in c:
            parts.append(f"T={c['tokens']}: n/a ({c['na']})")
            continue
        parts.append(f"T={c['tokens']}: {c['ratio']:.3f} ({c['torch_xla_ms']:.1f} / {c['jax_ms']:.1f} ms; min/min "
                     f"{c['min_ratio']:.3f}) {'within' if c['within'] else 'NOT within'} {c['bound']:.0%}")
    if not parts:
        return []
    return ["", "torch_xla-lowered / xla-in-graph (JAX-lowered, same stacked pinned_host form), median: "
            + "; ".join(parts) + "."]
