"""Analysis and tables of ``llama_multi_gpu.py``: pure functions of its raw JSON (no torch, no jax).

:func:`analyze` turns the pieces' rows into medians, floors, ratios, speed-ups and target checks (the
formulas are in ``llama_multi_gpu``'s docstring and :func:`row_metrics`), and names the rows with a
stalled step (``stalls``: a sample over :data:`STALL_SPREAD` x the fastest, and whether the median is
one) and the host-bound rows below :data:`BELOW_FLOOR` of their floor (``below_floor``: they moved their bytes
faster than the links were measured to); :func:`render` writes the markdown tables.
"""
from __future__ import annotations

import statistics

import trace_summary

#: step / floor at most (link-bound rows), speed-up at least ``scaling_per_gpu x n`` (compute-bound rows).
TARGETS = {"link_ratio": 1.10, "scaling_per_gpu": 0.925}
#: model FLOPs actually computed per model FLOP with remat (the forward recomputed in the backward).
REMAT_FACTOR = 4.0 / 3.0
#: A row whose slowest sample is over this many times its fastest had a step that stalled (the analysis says so).
STALL_SPREAD = 1.5
#: A host-bound row below this fraction of its floor moved its bytes faster than the links were measured to: the
#: analysis names it (its floor, from that measurement, is too high).
BELOW_FLOOR = 0.95


def row_metrics(row: dict, links: dict) -> dict:
    """One row's floors and ratios from its bytes and the links of its piece (bytes/s, FLOP/s).

    ``host_s = max((w_in+m+act)/h2d, (w+m+act)/d2h, (w_in+w+2m+2act)/both)`` with the aggregate bandwidths
    of ``links["host_link"]["n"]`` on n GPUs (``["1"]`` on one): each GPU moves 1/n of the bytes at 1/n of
    the aggregate; ``nvlink_s = 3 (n-1)/n W / nvlink`` (weights all-gathered in the forward and the backward,
    gradients reduce-scattered; None where NVLink was not measured); ``compute_s`` = FLOPs x 4/3 / (n x the
    GEMM rate), a lower bound. ``floor_s`` the largest (the host links, NVLink and the SMs work at once),
    ``bound`` which, ``ratio = step / floor``; ``host_plus_nvlink_s`` the two link terms added (a diagnostic).
    """
    n, step = row["n"], row.get("step_s")
    out = {k: row.get(k) for k in ("form", "n", "tokens", "b", "s", "tokens_per_gpu", "first_loss", "last_loss",
                                   "first_step_s", "build_s", "error", "profile")}
    out["step_s"], out["flops"] = step, row["flops"]
    samples = [x for x in row.get("samples") or [] if x]
    if len(samples) > 1:   # a sample far above the fastest: a step that waited on something once (a stall)
        out["samples_s"], out["spread"] = samples, max(samples) / min(samples)
    if step is None or "bytes" not in row:
        return out
    out["tflops_per_gpu"] = row["flops"] / step / n / 1e12
    hl = links.get("host_link", {}).get("n" if n > 1 else "1") or {}
    B = row["bytes"]
    moved = B["w_in"] + B["w"] + 2 * B["m"] + 2 * B["act"]   # both directions together
    terms = {}
    if hl:
        terms["host"] = max((B["w_in"] + B["m"] + B["act"]) / hl["h2d"], (B["w"] + B["m"] + B["act"]) / hl["d2h"],
                            moved / hl["both"])
    nv = (links.get("nvlink") or {}).get("per_gpu")
    if n > 1 and nv:
        terms["nvlink"] = 3 * (n - 1) / n * B["weight"] / nv
    if links.get("gemm_flops"):
        terms["compute"] = row["flops"] * REMAT_FACTOR / (n * links["gemm_flops"])
    out.update({f"{k}_s": v for k, v in terms.items()})
    out["host_bytes"], out["host_both_rate"] = moved, hl.get("both")
    if "host" in terms and "nvlink" in terms:   # were the two links not to overlap (not the floor: a diagnostic)
        out["host_plus_nvlink_s"] = terms["host"] + terms["nvlink"]
    out["nvlink_bytes_per_gpu"] = 3 * (n - 1) / n * B["weight"]
    if terms:
        out["bound"] = max(terms, key=terms.get)
        out["floor_s"] = terms[out["bound"]]
        out["ratio"] = step / out["floor_s"]
    return out


def _torchrun_rows(tr: dict) -> tuple[list, str | None]:
    """The torchrun ranks' rows merged: per token count the largest of the ranks' median steps (the step
    of the slowest rank), rank 0's losses and bytes; ``form`` as the ranks ran it."""
    ranks = [r for r in (tr or {}).get("ranks", []) if r]
    if not ranks:
        return [], None
    merged = []
    for i, row in enumerate(ranks[0].get("rows", [])):
        steps = [r["rows"][i].get("step_s") for r in ranks if len(r.get("rows", [])) > i]
        row = dict(row, per_rank_step_s=steps)
        row["step_s"] = max(steps) if steps and None not in steps else None
        merged.append(row)
    return merged, ranks[0].get("form")


def _find(rows: list, form: str, n: int, tokens: int) -> dict | None:
    for r in rows:
        if r.get("form") == form and r["n"] == n and r["tokens"] == tokens and r.get("step_s"):
            return r
    return None


def scaling(rows: list, n: int, per_gpu: list, forms: list) -> list:
    """Strong (T global on 1 and n GPUs) and weak (T per GPU: T on 1, nT on n) speed-ups per form, with the
    n-GPU row's bound and the target that applies: speed-up where compute-bound, step / floor otherwise.
    ``over_one_gpu``: the n-GPU step over one GPU's at the same tokens per GPU (where that row ran), what
    spreading the step costs beside the smaller per-GPU batch of strong scaling (None without that row)."""
    out = []
    for form in forms:
        for kind in ("strong", "weak"):
            for p in per_gpu:
                one = _find(rows, "single", 1, p)
                many = _find(rows, form, n, p if kind == "strong" else n * p)
                if one is None or many is None:
                    continue
                speedup = (one["step_s"] / many["step_s"]) * (1 if kind == "strong" else n)
                s = {"form": form, "kind": kind, "tokens_per_gpu": many["tokens_per_gpu"], "tokens": many["tokens"],
                     "step_1_s": one["step_s"], "step_n_s": many["step_s"], "speedup": speedup,
                     "tflops_1": one.get("tflops_per_gpu"), "tflops_n": many.get("tflops_per_gpu"),
                     "first_loss_1": one.get("first_loss"), "first_loss_n": many.get("first_loss"),
                     "bound": many.get("bound"), "ratio": many.get("ratio"), "floor_s": many.get("floor_s")}
                same = _find(rows, "single", 1, many["tokens_per_gpu"])   # one GPU at this row's tokens per GPU
                s["over_one_gpu"] = many["step_s"] / same["step_s"] if same else None
                if many.get("bound") == "compute":
                    s.update(target=f">= {TARGETS['scaling_per_gpu'] * n:.2f}x speed-up",
                             met=speedup >= TARGETS["scaling_per_gpu"] * n)
                elif many.get("bound"):
                    s.update(target=f"<= {TARGETS['link_ratio']:.2f}x floor", met=many["ratio"] <= TARGETS["link_ratio"])
                out.append(s)
    return out


def anchor_rows(anchors: dict, shape: str, rows: list, n: int) -> list:
    """Each anchor of ``shape`` at each of its token counts against ours (one process, n GPUs; and the
    torchrun form where it ran that count): ``anchor_over_ours`` > 1 means ours is faster."""
    out = []
    for key, a in anchors.items():
        name, _, sh = key.partition(":")
        if sh != shape:
            continue
        if not a or "error" in a:
            out.append({"anchor": name, "error": str((a or {}).get("error", "no result"))[:300]})
            continue
        for T, r in (a.get("by_tokens") or {str(a["T"]): a}).items():
            x = {"anchor": name, "tokens": int(T), "world_size": r.get("world_size"), "step_s": r["step_s"],
                 "forward_backward_s": r["forward_backward_s"], "optimizer_s": r.get("optimizer_s"),
                 "optimizer": a.get("optimizer"), "peak_device_bytes": r.get("peak_device_bytes"),
                 "exit_after_result": (a.get("after_result") or {}).get("return_codes")}
            for form in ("single", "torchrun", "torchrun_global_batch"):
                ours = _find(rows, form, n, int(T))
                if ours:
                    x[f"ours_{form}_s"] = ours["step_s"]
                    x[f"anchor_over_{form}"] = r["step_s"] / ours["step_s"]
            out.append(x)
    return out


def analyze(raw: dict) -> dict:
    """Every shape's rows with their floors, the scaling and anchor tables, the largest-model row, the checks."""
    n, per_gpu = raw["n"], raw["tokens_per_gpu"]
    shapes = {}
    for shape, piece in raw.get("ours", {}).items():
        tokens = per_gpu.get(shape, []) if isinstance(per_gpu, dict) else per_gpu
        links = {k: piece.get(k) for k in ("host_link", "nvlink", "gemm_flops")}
        tr_rows, tr_form = _torchrun_rows(raw.get("torchrun", {}).get(shape))
        rows = [row_metrics(r, links) for r in piece.get("rows", []) + tr_rows]
        forms = ["single"] + ([tr_form] if tr_form else [])
        shapes[shape] = {"shape": piece.get("shape"), "device_kind": piece.get("device_kind"), "links": links,
                         "params": (piece.get("rows") or [{}])[0].get("params"), "rows": rows,
                         "weight_bytes": next((r["bytes"]["weight"] for r in piece.get("rows", []) if "bytes" in r),
                                              None),
                         "scaling": scaling(rows, n, tokens, forms),
                         "anchors": anchor_rows(raw.get("anchors", {}), shape, rows, n)}
    largest = None
    lg = raw.get("largest")
    if lg:
        links = {k: lg.get(k) for k in ("host_link", "nvlink", "gemm_flops")}
        largest = {k: lg.get(k) for k in ("shape", "params", "weight_bytes", "state_bytes", "skipped", "host_pool_gib",
                                          "device_kind")}
        largest["rows"] = [row_metrics(r, links) for r in lg.get("rows", [])]
        peak = (lg.get("host_after") or {}).get("VmHWM")
        largest["peak_rss_bytes"] = peak
        largest["peak_rss_over_state"] = peak / lg["state_bytes"] if peak and lg.get("state_bytes") else None
        x = raw.get("largest_anchor")
        if x:
            largest["anchor"] = {k: x.get(k) for k in ("anchor", "shape", "T", "step_s", "forward_backward_s",
                                                       "optimizer_s", "host_peak_rss_bytes", "param_pinned", "error")}
    checks = [dict(c, shape=s) for s, d in shapes.items() for c in d["scaling"] if "met" in c]
    checks += [{"shape": s, "what": f"{a['anchor']} / ours at {a['tokens']}", "value": a["anchor_over_single"],
                "target": "> 1 (ours faster)", "met": a["anchor_over_single"] > 1}
               for s, d in shapes.items() for a in d["anchors"] if "anchor_over_single" in a]
    every = [(s, r) for s, d in list(shapes.items()) + [("largest", largest or {"rows": []})] for r in d["rows"]]
    stalls = [dict(shape=s, form=r["form"], n=r["n"], tokens=r["tokens"], samples_s=r["samples_s"],
                   median_stalled=r["step_s"] is not None and r["step_s"] > STALL_SPREAD * min(r["samples_s"]))
              for s, r in every if r.get("spread", 1) > STALL_SPREAD]
    below = [dict(shape=s, form=r["form"], n=r["n"], tokens=r["tokens"], ratio=r["ratio"], host_bytes=r["host_bytes"],
                  rate=r["host_bytes"] / r["step_s"], measured_both=r["host_both_rate"])
             for s, r in every if r.get("bound") == "host" and r["ratio"] < BELOW_FLOOR and r.get("host_both_rate")]
    return {"n": n, "tokens_per_gpu": per_gpu, "pieces": raw.get("pieces", {}), "shapes": shapes,
            "largest": largest, "checks": checks, "stalls": stalls, "below_floor": below, "wall_s": raw.get("wall_s"),
            "targets": TARGETS,
            "cpu_adam_build": raw.get("cpu_adam_build")}


def _ms(s) -> str:
    return "-" if s is None else f"{1e3 * s:.1f}"


def _x(v, fmt=".2f") -> str:
    return "-" if v is None else f"{v:{fmt}}"


def _rx(v, fmt=".2f") -> str:
    """A ratio with its ``x``, or ``-``."""
    return "-" if v is None else f"{v:{fmt}}x"


def _tf(v) -> str:
    """TFLOP/s: whole numbers on a GPU, three significant digits below 10 (the CPU smoke runs)."""
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.3g}"


def _gb(b) -> str:
    return "-" if b is None else f"{b / 1e9:.2f} GB"


def _links_line(links: dict) -> str:
    hl = links.get("host_link") or {}
    parts = []
    for key, label in (("n", "n GPUs"), ("1", "1 GPU")):
        if hl.get(key):
            h = hl[key]
            parts.append(f"host link {label} (aggregate) H2D {h['h2d'] / 1e9:.1f} / D2H {h['d2h'] / 1e9:.1f} / "
                         f"both {h['both'] / 1e9:.1f} GB/s")
    nv = links.get("nvlink")
    parts.append(f"NVLink {nv['per_gpu'] / 1e9:.1f} GB/s received per GPU (peer access {nv['peer_access']})"
                 if nv else "NVLink not measured")
    if links.get("gemm_flops"):
        parts.append(f"dense bf16 GEMM {links['gemm_flops'] / 1e12:.0f} TFLOP/s per GPU")
    return "; ".join(parts)


def _render_shape(name: str, d: dict, n: int) -> list:
    sh = d.get("shape") or {}
    p = (d.get("params") or {}).get("total")
    lines = [f"## {name}: D={sh.get('d')}, F={sh.get('f')}, {sh.get('heads')}/{sh.get('kv')} heads, "
             f"{sh.get('layers')} layers, vocab {sh.get('vocab')}, {p / 1e9 if p else 0:.2f} B parameters, "
             f"W = {_gb(d.get('weight_bytes'))} ({d.get('device_kind')})", "", _links_line(d["links"]), "",
             "| form | scaling | tokens / GPU | global tokens | 1 GPU ms | n GPUs ms | speed-up | TFLOP/s per GPU "
             "(1 / n) | n-GPU floor ms (bound) | step / floor | step / 1 GPU's at the same tokens per GPU | "
             "first loss 1 / n | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in d["scaling"]:
        tgt = f"{s['target']}: {'met' if s['met'] else '**missed**'}" if "met" in s else "-"
        loss = f"{_x(s['first_loss_1'], '.4f')} / {_x(s['first_loss_n'], '.4f')}" if s["kind"] == "strong" else "-"
        lines.append(f"| {s['form']} | {s['kind']} | {s['tokens_per_gpu']} | {s['tokens']} | {_ms(s['step_1_s'])} | "
                     f"{_ms(s['step_n_s'])} | {s['speedup']:.2f}x | {_tf(s['tflops_1'])} / {_tf(s['tflops_n'])} | "
                     f"{_ms(s['floor_s'])} ({s['bound']}) | {_rx(s['ratio'], '.3f')} | "
                     f"{_rx(s.get('over_one_gpu'), '.3f')} | {loss} | {tgt} |")
    lines += ["", "First losses: the same batch on the same weights only at the first token count; each later count "
              "trains the model the earlier counts left, and n GPUs may have run more counts than 1.",
              "", "| form | GPUs | tokens | b x s | step ms | first step s | first loss | TFLOP/s per GPU | host ms | "
              "NVLink ms | compute (lower bound) ms | floor ms (bound) | step / floor |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        if r.get("error") or r.get("step_s") is None:
            lines.append(f"| {r['form']} | {r['n']} | {r['tokens']} | {r.get('b')} x {r.get('s')} | "
                         f"error: {str(r.get('error'))[:120]} ||||||||")
            continue
        lines.append(f"| {r['form']} | {r['n']} | {r['tokens']} | {r['b']} x {r['s']} | {_ms(r['step_s'])} | "
                     f"{_x(r.get('first_step_s'), '.1f')} | {_x(r.get('first_loss'), '.4f')} | "
                     f"{_tf(r.get('tflops_per_gpu'))} | {_ms(r.get('host_s'))} | "
                     f"{_ms(r.get('nvlink_s'))} | {_ms(r.get('compute_s'))} | {_ms(r.get('floor_s'))} ({r.get('bound')}) | "
                     f"{_rx(r.get('ratio'), '.3f')} |")
    for r in d["rows"]:
        if r.get("profile"):   # a traced step: how each GPU's window splits (trace_summary.overlap)
            lines += ["", f"Traced step, {r['form']}, {r['n']} GPU(s), {r['tokens']} tokens: "
                      f"{_ms(r['profile']['step_s'])} ms (`{r['profile']['dir']}`)", "",
                      trace_summary.render_overlap(r["profile"]["overlap"])]
            for kind, cs in (r["profile"].get("collectives") or {}).items():
                what = cs.get("error") if isinstance(cs, dict) else "; ".join(
                    f"{c['op']} {c['result']} x{c['count']} ({c['bytes'] / 1e6:.3g} MB)" for c in cs[:6]) or "none"
                lines.append(f"- first decoder layer's {kind} program: {what}")
    if d["anchors"]:
        lines += ["", f"| anchor ({n} ranks) | tokens | step ms | fwd+bwd ms | optimizer ms | ours, one process ms "
                  "| anchor / ours | ours, torchrun ms | anchor / torchrun |", "|---|---|---|---|---|---|---|---|---|"]
        for a in d["anchors"]:
            if "error" in a:
                lines.append(f"| {a['anchor']} | error: {a['error'][:200]} ||||||||")
                continue
            tr = "torchrun" if "ours_torchrun_s" in a else "torchrun_global_batch"
            lines.append(f"| {a['anchor']} ({a.get('optimizer')}) | {a['tokens']} | {_ms(a['step_s'])} | "
                         f"{_ms(a['forward_backward_s'])} | {_ms(a.get('optimizer_s'))} | {_ms(a.get('ours_single_s'))} | "
                         f"{_rx(a.get('anchor_over_single'))} | {_ms(a.get(f'ours_{tr}_s'))} | "
                         f"{_rx(a.get(f'anchor_over_{tr}'))} |")
        for a in d["anchors"]:
            if a.get("exit_after_result"):
                lines.append(f"- {a['anchor']} at {a['tokens']} tokens: every rank gave its result, then the ranks "
                             f"exited with codes {a['exit_after_result']} (stderr in the raw JSON's `after_result`)")
    return lines


def _render_largest(lg: dict) -> list:
    sh = lg.get("shape") or {}
    lines = ["", f"## Largest model: D={sh.get('d')}, F={sh.get('f')}, {sh.get('layers')} layers, "
             f"{(lg.get('params') or {}).get('total', 0) / 1e9:.1f} B parameters, W = {_gb(lg.get('weight_bytes'))}, "
             f"weights + moments {_gb(lg.get('state_bytes'))}"]
    if lg.get("skipped"):
        return lines + ["", f"skipped: {lg['skipped']}"]
    lines += ["", f"pinned pool {lg.get('host_pool_gib')} GiB; peak host RSS {_gb(lg.get('peak_rss_bytes'))} = "
              f"{_x(lg.get('peak_rss_over_state'), '.3f')} x the state", "",
              "| GPUs | tokens | step ms | first step s | TFLOP/s per GPU | floor ms (bound) | step / floor |",
              "|---|---|---|---|---|---|---|"]
    for r in lg["rows"]:
        lines.append(f"| {r['n']} | {r['tokens']} | {_ms(r.get('step_s'))} | {_x(r.get('first_step_s'), '.1f')} | "
                     f"{_tf(r.get('tflops_per_gpu'))} | {_ms(r.get('floor_s'))} ({r.get('bound')}) | "
                     f"{_rx(r.get('ratio'), '.3f')} |" if not r.get("error") else f"| {r['n']} | {r['tokens']} | "
                     f"error: {r['error'][:200]} |||||")
    x = lg.get("anchor")
    if x:
        lines += ["", f"FSDP2 CPUOffloadPolicy (built on the meta device), {(x.get('shape') or {}).get('layers')} layers "
                  f"of the same shape, {x.get('T')} tokens: " + (f"error {str(x['error'])[:200]}" if x.get("error") else
                  f"step {_ms(x['step_s'])} ms (forward+backward {_ms(x['forward_backward_s'])}, optimizer "
                  f"{_ms(x.get('optimizer_s'))}), peak host RSS per rank {_gb(x.get('host_peak_rss_bytes'))}, "
                  f"parameters pinned: {x.get('param_pinned')}")]
    return lines


def render(a: dict) -> str:
    """The markdown of one :func:`analyze` result: per shape the scaling, the rows with their floors and the
    anchors; the largest model; the pieces (time, skipped); the checks."""
    lines = [f"# {a['n']} GPUs: HF Llama through SwappedStack, AdamW in pinned_host", ""]
    for name, d in a["shapes"].items():
        lines += _render_shape(name, d, a["n"]) + [""]
    if a.get("largest"):
        lines += _render_largest(a["largest"])
    lines += ["", "Pieces: " + "; ".join(
        f"{k} {v['skipped']}" if "skipped" in v else
        f"{k} {v['wall_s']:.0f} s{' (timed out)' if v.get('timed_out') else ''}{' rc ' + str(v['rc']) if v.get('rc') else ''}"
        f"{', no row' if v.get('rows') == 0 else ''}" for k, v in a["pieces"].items())]
    lines += ["", "Checks:"]
    for c in a["checks"]:
        what = c.get("what") or f"{c['form']} {c['kind']} scaling at {c['tokens']} tokens ({c['bound']}-bound)"
        value = c.get("value", c.get("speedup") if c.get("bound") == "compute" else c.get("ratio"))
        lines.append(f"- {c['shape']}: {what}: {_x(value, '.3f')}, target {c['target']}: "
                     f"{'met' if c['met'] else '**missed**'}")
    for t in a.get("stalls", []):
        lines.append(f"- {t['shape']}: {t['form']} {t['n']} GPU(s) at {t['tokens']} tokens: samples "
                     f"{', '.join(f'{x:.3f}' for x in t['samples_s'])} s, a step over {STALL_SPREAD}x the fastest "
                     f"({'**the median is a stalled step**' if t['median_stalled'] else 'the median is not'})")
    for b in a.get("below_floor", []):
        lines.append(f"- {b['shape']}: {b['form']} {b['n']} GPU(s) at {b['tokens']} tokens: {b['ratio']:.3f} of its host "
                     f"floor: the step moved {b['host_bytes'] / 1e9:.1f} GB over the host links at "
                     f"{b['rate'] / 1e9:.1f} GB/s, above the {b['measured_both'] / 1e9:.1f} GB/s measured for both "
                     "directions at once: this row's floor is too high")
    return "\n".join(lines)


def median(xs) -> float | None:
    """The median of ``xs`` (None when empty)."""
    return statistics.median(xs) if xs else None
