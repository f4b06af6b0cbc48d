#!/usr/bin/env python
"""Summarise a jax profiler trace (``jax.profiler.trace(dir, create_perfetto_trace=True)``): per GPU stream
its busy time and heaviest ops, and for host -> device copies how busy the link was over the window and
where it idled (with what each stream ran in the longest idle gaps); per GPU, how its window splits into
compute, collectives (and the part of them no compute hides), host copies and idle time (and the part of it
a host copy runs in), with the longest idle gaps and the kernels around them, and the collectives by HLO
op with the time no compute hides of each (:func:`overlap`); per GPU, its compute kernels by kind (GEMM,
attention, transpose, other) with the heaviest transposes (:func:`compute_kinds`).

    python benchmarks/trace_summary.py DIR_OR_perfetto_trace.json.gz [--gaps 12] [--json out.json]

The trace is Chrome's trace-event JSON (``traceEvents``: ``ph`` ``"X"`` events with ``ts``/``dur`` in
microseconds, ``"M"`` events naming processes and threads). A copy is an event whose name says
``memcpy``/``copy`` with ``HtoD``/``H2D``/``HostToDevice`` (``DtoH`` likewise); its bytes are read from
``args`` where the trace has them (``memcpy_details``' ``size:``).
"""
from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import re
import sys

H2D = re.compile(r"(htod|h2d|hosttodevice)", re.I)
D2H = re.compile(r"(dtoh|d2h|devicetohost)", re.I)
COPY = re.compile(r"(memcpy|copy)", re.I)


def load(path: str) -> dict:
    """The trace's JSON from ``path`` (a ``perfetto_trace.json.gz``, or a folder holding one below it)."""
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True))
        if not found:
            raise FileNotFoundError(f"no perfetto_trace.json.gz under {path}")
        path = found[-1]
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def union(intervals: list) -> list:
    """Sorted, merged ``[(start, end)]``."""
    out: list = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _measure(intervals: list) -> float:
    """The summed length of ``intervals`` (sorted, merged)."""
    return sum(b - a for a, b in intervals)


def _bytes(ev: dict) -> int | None:
    args = ev.get("args") or {}
    found = re.search(r"size:(\d+)", str(args.get("memcpy_details", "")))   # XLA:GPU's CUPTI copies
    if found:
        return int(found.group(1))
    for k, v in args.items():
        if "byte" in k.lower() or k.lower() in ("size", "num_bytes"):
            try:
                return int(float(str(v).split()[0]))
            except ValueError:
                pass
    return None


def _names(events: list) -> tuple[dict, dict]:
    """``({pid: process name}, {(pid, tid): thread name})`` from the trace's ``"M"`` events."""
    pname, tname = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e["tid"])] = e.get("args", {}).get("name", "")
    return pname, tname


def summarise(trace: dict, gaps: int = 12) -> dict:
    """Streams, copies and the link's idle gaps of ``trace`` (times in microseconds)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname, tname = _names(events)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    threads = collections.defaultdict(list)
    for e in spans:
        threads[(e["pid"], e["tid"])].append(e)
    out: dict = {"threads": []}
    for key, evs in sorted(threads.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        busy = _measure(union([(e["ts"], e["ts"] + e["dur"]) for e in evs]))
        names = collections.Counter()
        for e in evs:
            names[e["name"][:80]] += e["dur"]
        out["threads"].append({"process": pname.get(key[0], str(key[0])), "thread": tname.get(key, str(key[1])),
                               "events": len(evs), "busy_us": busy, "top": names.most_common(6)})
    gpu = {k for k, n in pname.items() if "gpu" in n.lower() or "device" in n.lower()}
    dev = [e for e in spans if e["pid"] in gpu]
    h2d = [e for e in dev if COPY.search(e["name"]) and H2D.search(e["name"] + json.dumps(e.get("args", {})))]
    d2h = [e for e in dev if COPY.search(e["name"]) and D2H.search(e["name"] + json.dumps(e.get("args", {})))]
    out["h2d_events"], out["d2h_events"] = len(h2d), len(d2h)
    if h2d:
        busy = union([(e["ts"], e["ts"] + e["dur"]) for e in h2d])
        t0, t1 = busy[0][0], busy[-1][1]
        nbytes = [b for b in (_bytes(e) for e in h2d) if b]
        out["h2d"] = {"window_us": t1 - t0, "busy_us": _measure(busy),
                      "bytes": sum(nbytes) if nbytes else None,
                      "sizes": collections.Counter(nbytes).most_common(8)}
        out["h2d"]["busy_fraction"] = out["h2d"]["busy_us"] / max(out["h2d"]["window_us"], 1e-9)
        holes = sorted(((b - a, a, b) for a, b in _complement(busy, t0, t1)), reverse=True)
        sizes = [g for g, _, _ in holes]
        out["h2d"]["idle_us"] = sum(sizes)
        out["h2d"]["idle_histogram_us"] = {f"<{lim}": sum(1 for g in sizes if g < lim) for lim in (10, 50, 100, 300, 1000)}
        out["h2d"]["idle_over_50us_total"] = sum(g for g in sizes if g >= 50)
        top = []
        for g, a, b in holes[:gaps]:
            during = collections.Counter()
            for e in dev:
                if e["ts"] < b and e["ts"] + e["dur"] > a and e not in h2d:
                    during[f"{tname.get((e['pid'], e['tid']), e['tid'])}: {e['name'][:60]}"] += 1
            top.append({"gap_us": g, "at_us": a - t0, "during": during.most_common(5)})
        out["h2d"]["largest_gaps"] = top
    return out


COLLECTIVE = re.compile(r"(nccl|all-gather|all_gather|allgather|reduce-scatter|reduce_scatter|reducescatter|"
                        r"all-reduce|all_reduce|allreduce|collective-permute|all-to-all)", re.I)


def _intersect(a: list, b: list) -> list:
    """The intersection of two sorted, merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _kernel_kind(e: dict) -> str:
    """``"collective"``, ``"h2d"``, ``"d2h"`` or ``"compute"`` (the rest, device-to-device copies included)."""
    if COLLECTIVE.search(e["name"]):
        return "collective"
    if COPY.search(e["name"]):
        text = e["name"] + json.dumps(e.get("args", {}))
        if H2D.search(text):
            return "h2d"
        if D2H.search(text):
            return "d2h"
    return "compute"


def _gpu_streams(trace: dict):
    """``(device name, its kernels)`` per GPU process, in name order: the complete events (``ph`` ``"X"``)
    of its ``Stream ...`` threads; GPUs with none are left out."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname, tname = _names(events)
    for pid, name in sorted(pname.items(), key=lambda kv: kv[1]):
        if "gpu" not in name.lower():
            continue
        evs = [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("pid") == pid
               and tname.get((pid, e.get("tid")), "").startswith("Stream")]
        if evs:
            yield name, evs


def overlap(trace: dict, top: int = 6) -> list[dict]:
    """Per GPU (a device process's ``Stream ...`` threads), how its window splits (microseconds).

    Each kernel is a collective (its name matches NCCL's or XLA's collective names), a host copy
    (``memcpy``/``copy`` with ``HtoD``/``DtoH``) or compute (the rest, device-to-device copies included).
    ``window_us``: first start to last end of the GPU's events; ``compute_us`` and ``collective_us``:
    the unions' lengths; ``collective_exposed_us``: collective time with no compute kernel running;
    ``idle_us``: time with neither running (the GPU waits on host copies or the host), of it
    ``idle_copying_us`` with a host copy running (waiting on the link; the rest waits on the host);
    ``h2d_us``/``d2h_us``: the host copies' unions; ``top_compute``/``top_collective``: the heaviest
    names with their summed durations; ``exposed_collectives``: the collectives by HLO op, the most exposed
    first (:func:`_exposed_by_op`); ``idle_gaps``: the ``top`` longest idle gaps (:func:`_idle_gaps`)."""
    out = []
    for name, evs in _gpu_streams(trace):
        kinds: dict = collections.defaultdict(list)
        names: dict = collections.defaultdict(collections.Counter)
        kernels, colls = [], []   # (start, end, name) of the compute and collective kernels; the collective events
        for e in evs:
            kind = _kernel_kind(e)
            kinds[kind].append((e["ts"], e["ts"] + e["dur"]))
            names[kind][e["name"][:80]] += e["dur"]
            if kind in ("compute", "collective"):
                kernels.append((e["ts"], e["ts"] + e["dur"], e["name"][:80]))
            if kind == "collective":
                colls.append(e)
        u = {k: union(v) for k, v in kinds.items()}
        comp, coll = u.get("compute", []), u.get("collective", [])
        t0 = min(a for v in u.values() for a, _ in v[:1])
        t1 = max(v[-1][1] for v in u.values() if v)
        idle = _complement(union(comp + coll), t0, t1)
        copies = union(u.get("h2d", []) + u.get("d2h", []))
        out.append({"device": name, "window_us": t1 - t0, "compute_us": _measure(comp),
                    "collective_us": _measure(coll),
                    "collective_exposed_us": _measure(coll) - _measure(_intersect(coll, comp)),
                    "idle_us": _measure(idle), "idle_copying_us": _measure(_intersect(idle, copies)),
                    "h2d_us": _measure(u.get("h2d", [])), "d2h_us": _measure(u.get("d2h", [])),
                    "top_compute": names["compute"].most_common(top),
                    "top_collective": names["collective"].most_common(top),
                    "exposed_collectives": _exposed_by_op(colls, comp, top),
                    "idle_gaps": _idle_gaps(idle, kernels, u, t0, top)})
    return out


def _exposed_by_op(colls: list, comp: list, top: int) -> list[dict]:
    """The collectives of ``colls`` (trace events) grouped by the HLO op that ran them (``args``' ``hlo_module``
    and ``hlo_op``, as XLA:GPU's traces name them; the kernel's name where absent), the ``top`` with the most
    time under no compute kernel (``comp``: the compute union) first: ``{"module", "op", "count", "dur_us",
    "exposed_us"}``. The same op in every layer's program adds up over the layers."""
    by: dict = {}
    ends = [b for _, b in comp]
    for e in colls:
        args = e.get("args") or {}
        key = (args.get("hlo_module", ""), args.get("hlo_op") or e["name"][:80])
        g = by.setdefault(key, {"module": key[0], "op": key[1], "count": 0, "dur_us": 0.0, "exposed_us": 0.0})
        a, b = e["ts"], e["ts"] + e["dur"]
        near = comp[bisect.bisect_right(ends, a):bisect.bisect_left(ends, b) + 1]   # the intervals that can meet it
        g["count"] += 1
        g["dur_us"] += e["dur"]
        g["exposed_us"] += max(0.0, e["dur"] - _measure(_intersect([(a, b)], near)))   # no negative rounding
    return sorted(by.values(), key=lambda g: -g["exposed_us"])[:top]


def _complement(busy: list, t0: float, t1: float) -> list:
    """The parts of ``[t0, t1]`` outside ``busy`` (sorted, merged intervals)."""
    out, at = [], t0
    for a, b in busy:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    return out + ([(at, t1)] if at < t1 else [])


def _idle_gaps(idle: list, kernels: list, u: dict, t0: float, top: int) -> list[dict]:
    """The ``top`` longest of ``idle`` (intervals with no kernel running), each ``{"gap_us", "at_us"`` (from
    the window's start), ``"before"``/``"after"`` (the kernel that ended at its start / began at its end, or
    None), ``"h2d_us"``/``"d2h_us"`` (host copies running in it)``}``."""
    gaps = []
    for a, b in sorted(idle, key=lambda g: g[0] - g[1])[:top]:
        before = max((k for k in kernels if k[1] <= a), default=None, key=lambda k: k[1])
        after = min((k for k in kernels if k[0] >= b), default=None, key=lambda k: k[0])
        gaps.append({"gap_us": b - a, "at_us": a - t0, "before": before and before[2], "after": after and after[2],
                     "h2d_us": _measure(_intersect([(a, b)], u.get("h2d", []))),
                     "d2h_us": _measure(_intersect([(a, b)], u.get("d2h", [])))})
    return gaps


#: the kinds of compute kernel :func:`compute_kinds` sums, matched on the kernel's name in this order.
KERNEL_KINDS = (("attention", re.compile(r"(sdpa|flash|fmha|cudnn)", re.I)),
                ("gemm", re.compile(r"(nvjet|gemm|cutlass|cublas)", re.I)),
                ("transpose", re.compile(r"transpose", re.I)))


def compute_kinds(trace: dict, top: int = 8) -> list[dict]:
    """Per GPU, its compute kernels' summed durations by kind (microseconds): ``gemm_us``, ``attention_us``,
    ``transpose_us`` (:data:`KERNEL_KINDS`), ``other_us`` (the rest of what :func:`overlap` counts as
    compute: device-to-device copies included), ``total_us`` (their sum: durations added, not a union) and
    ``transposes``: the ``top`` heaviest transposes as ``{"module", "name", "us", "count"}`` (the kernel's
    HLO module from its ``args``)."""
    out = []
    for name, evs in _gpu_streams(trace):
        sums: dict = collections.Counter()
        tr: dict = collections.defaultdict(lambda: [0.0, 0])
        for e in evs:
            if _kernel_kind(e) != "compute":
                continue
            kind = next((k for k, rx in KERNEL_KINDS if rx.search(e["name"])), "other")
            sums[kind] += e["dur"]
            if kind == "transpose":
                key = (e.get("args", {}).get("hlo_module", "?"), re.sub(r"_\d+$", "", e["name"]))
                tr[key][0] += e["dur"]
                tr[key][1] += 1
        if not sums:
            continue
        row = {"device": name, **{f"{k}_us": sums[k] for k in ("gemm", "attention", "transpose", "other")},
               "total_us": sum(sums.values())}
        row["transposes"] = [{"module": m, "name": n, "us": us, "count": c}
                             for (m, n), (us, c) in sorted(tr.items(), key=lambda kv: -kv[1][0])[:top]]
        out.append(row)
    return out


def render_overlap(rows: list[dict]) -> str:
    """:func:`overlap`'s rows as a table (milliseconds), then per device its collectives with 0.1 % of the window
    or more under no compute, then the first device's longest idle gaps."""
    lines = ["| device | window ms | compute ms | collective ms | exposed ms | idle ms | idle, copying ms | h2d ms "
             "| d2h ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['device']} | " + " | ".join(f"{r.get(k, float('nan')) / 1e3:.2f}" for k in (
            "window_us", "compute_us", "collective_us", "collective_exposed_us", "idle_us", "idle_copying_us",
            "h2d_us", "d2h_us")) + " |")
    for r in rows:
        for c in r.get("exposed_collectives") or []:
            if c["exposed_us"] >= 1e-3 * r["window_us"]:   # 0.1 % of the window or more
                lines.append(f"- {r['device']} collective `{c['module']}` `{c['op']}`: {c['count']} x, "
                             f"{c['dur_us'] / 1e3:.2f} ms, {c['exposed_us'] / 1e3:.2f} ms under no compute")
    for g in (rows[0].get("idle_gaps") or [] if rows else []):
        lines.append(f"- {rows[0]['device']} idle {g['gap_us'] / 1e3:.2f} ms at {g['at_us'] / 1e3:.2f} ms "
                     f"(h2d {g['h2d_us'] / 1e3:.2f}, d2h {g['d2h_us'] / 1e3:.2f}): after `{g['before']}`, "
                     f"before `{g['after']}`")
    return "\n".join(lines)


def render(s: dict) -> str:
    lines = ["| process | thread | events | busy ms | heaviest (ms) |", "|---|---|---|---|---|"]
    for t in s["threads"][:16]:
        top = "; ".join(f"{n} {d / 1e3:.2f}" for n, d in t["top"][:3])
        lines.append(f"| {t['process'][:30]} | {t['thread'][:40]} | {t['events']} | {t['busy_us'] / 1e3:.2f} | {top} |")
    h = s.get("h2d")
    lines.append(f"h2d copies {s['h2d_events']}, d2h copies {s['d2h_events']}")
    if h:
        gb = f", {h['bytes'] / 1e9:.3f} GB, {h['bytes'] / h['busy_us'] / 1e3:.1f} GB/s while busy" if h["bytes"] else ""
        lines.append(f"h2d window {h['window_us'] / 1e3:.2f} ms, busy {h['busy_us'] / 1e3:.2f} ms "
                     f"({h['busy_fraction']:.3f}){gb}; idle {h['idle_us'] / 1e3:.2f} ms, in gaps >= 50 us "
                     f"{h['idle_over_50us_total'] / 1e3:.2f} ms; gaps {h['idle_histogram_us']}; sizes {h['sizes']}")
        for g in h["largest_gaps"]:
            lines.append(f"  gap {g['gap_us']:.0f} us at {g['at_us'] / 1e3:.2f} ms: {g['during']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--gaps", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    trace = load(args.trace)
    s = summarise(trace, args.gaps)
    s["overlap"] = overlap(trace)
    s["compute_kinds"] = compute_kinds(trace)
    print(render(s))
    print(render_overlap(s["overlap"]))
    for r in s["compute_kinds"]:
        print(f"- {r['device']} compute by kind (ms): " + ", ".join(
            f"{k} {r[k + '_us'] / 1e3:.1f}" for k in ("gemm", "attention", "transpose", "other", "total")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
