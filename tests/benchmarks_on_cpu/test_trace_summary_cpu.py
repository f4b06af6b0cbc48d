"""``benchmarks/trace_summary.py``: on a trace in the form jax's profiler writes for a GPU (a device process
with one thread per stream, copies named ``MemcpyH2D`` with their bytes in ``memcpy_details``), the link's busy
time is the union of the copies, the idle gaps are what lies between, each gap names the kernels that ran in
it, and the bytes per copy are read; and on a real trace of the CPU smoke run (no GPU streams) it summarises
the host threads and finds no copies."""
import gzip
import json
import pathlib

import pytest

import moe_generate_gpu  # benchmarks/ is on pytest's pythonpath
import trace_summary


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _x(pid, tid, ts, dur, name, size=None):
    e = {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}
    if size is not None:
        e["args"] = {"memcpy_details": f"kind_src:unknown kind_dst:unknown size:{size} dest:0 async:1"}
    return e


def test_link_busy_time_gaps_and_bytes(tmp_path):
    events = [_meta(1, "/device:GPU:0"), _meta(1, "Stream #20(MemcpyH2D)", 20), _meta(1, "Stream #21(MemcpyH2D)", 21),
              _meta(1, "Stream #14(Compute)", 14), _meta(7, "/host:CPU"), _meta(7, "python3", 70),
              _x(1, 20, 0, 100, "MemcpyH2D", 1000), _x(1, 21, 50, 100, "MemcpyH2D", 3000),   # overlap: 0-150
              _x(1, 20, 400, 50, "MemcpyH2D", 500),                                           # gap 150-400
              _x(1, 14, 200, 30, "router_fusion"), _x(1, 14, 500, 30, "late_kernel"),
              _x(7, 70, 0, 450, "PjitFunction(before)")]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = trace_summary.summarise(trace_summary.load(str(tmp_path)))
    h = s["h2d"]
    assert s["h2d_events"] == 3 and s["d2h_events"] == 0
    assert (h["window_us"], h["busy_us"], h["idle_us"], h["bytes"]) == (450, 200, 250, 4500)
    assert h["largest_gaps"][0]["gap_us"] == 250 and h["largest_gaps"][0]["at_us"] == 150
    assert [name for name, _ in h["largest_gaps"][0]["during"]] == ["Stream #14(Compute): router_fusion"]
    threads = {t["thread"]: t for t in s["threads"]}
    assert threads["python3"]["busy_us"] == 450 and threads["Stream #20(MemcpyH2D)"]["events"] == 2
    assert "busy 0.20 ms" in trace_summary.render(s)


def test_cpu_smoke_profile(tmp_path):
    out, prof = tmp_path / "moe.json", tmp_path / "prof"
    assert moe_generate_gpu.main(["--cpu-smoke", "--shapes", "qwen3", "--profile-dir", str(prof),
                                  "--profile-tokens", "3", "--out", str(out)]) == 0
    profiles = json.loads(out.read_text())["shapes"]["qwen3"]["profiles"]
    assert set(profiles) == {"stacked", "split"}
    for p in profiles.values():
        assert p["decode_step_s"] > 0 and p["summary"]["h2d_events"] == 0   # no GPU: no copies on streams
        assert any(t["thread"].startswith("python") for t in p["summary"]["threads"])


def test_overlap_splits_each_gpus_window():
    """Two GPUs. GPU 0: compute 0-100 and 150-250, an NCCL all-gather 80-170 (50 us of it under no
    compute), an H2D copy 250-300 with nothing else running; GPU 1: compute only. XLA's host-side
    threads and a non-stream thread on the device are not counted."""
    events = [_meta(1, "/device:GPU:0"), _meta(1, "Stream #14(Compute)", 14), _meta(1, "Stream #30(Nccl)", 30),
              _meta(1, "Stream #20(MemcpyH2D)", 20), _meta(1, "XLA Ops", 99),
              _meta(2, "/device:GPU:1"), _meta(2, "Stream #14(Compute)", 14), _meta(7, "/host:CPU"),
              _meta(7, "python3", 70),
              _x(1, 14, 0, 100, "loop_gemm_fusion"), _x(1, 14, 150, 100, "cutlass_gemm"),
              _x(1, 30, 80, 90, "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"),
              _x(1, 20, 250, 50, "MemcpyH2D", 4096), _x(1, 99, 0, 300, "all-gather-start.1"),
              _x(2, 14, 10, 40, "loop_gemm_fusion"), _x(7, 70, 0, 500, "PjitFunction(step)")]
    rows = trace_summary.overlap({"traceEvents": events})
    assert [r["device"] for r in rows] == ["/device:GPU:0", "/device:GPU:1"]
    g0, g1 = rows
    assert (g0["window_us"], g0["compute_us"], g0["collective_us"]) == (300, 200, 90)
    assert g0["collective_exposed_us"] == 50 - 0 and g0["idle_us"] == 300 - 250
    assert (g0["h2d_us"], g0["d2h_us"]) == (50, 0)
    assert g0["top_collective"][0][0].startswith("ncclDevKernel_AllGather")
    assert (g1["window_us"], g1["compute_us"], g1["collective_us"], g1["idle_us"]) == (40, 40, 0, 0)
    assert g0["exposed_collectives"] == [{"module": "", "op": g0["top_collective"][0][0], "count": 1, "dur_us": 90,
                                          "exposed_us": 50}]   # 80-100 and 150-170 run beside compute
    assert g0["idle_copying_us"] == 50 and g0["idle_gaps"] == [
        {"gap_us": 50, "at_us": 250, "before": "cutlass_gemm", "after": None, "h2d_us": 50, "d2h_us": 0}]
    table = trace_summary.render_overlap(rows)
    assert "| /device:GPU:0 | 0.30 | 0.20 | 0.09 | 0.05 | 0.05 | 0.05 | 0.05 | 0.00 |" in table
    assert "- /device:GPU:0 idle 0.05 ms at 0.25 ms (h2d 0.05, d2h 0.00): after `cutlass_gemm`, before `None`" in table
    assert "- /device:GPU:0 collective `` `ncclDevKernel_AllGather" in table and "1 x, 0.09 ms, 0.05 ms under no" in table


def test_overlap_splits_idle_time_into_waiting_on_the_link_and_on_the_host():
    """One GPU: compute 0-100, 200-300 and 340-400, a D2H copy 120-150: of the idle 100-200 and 300-340,
    30 us wait with a host copy running; the longest gap comes first, with the kernels around it."""
    events = [_meta(1, "/device:GPU:0"), _meta(1, "Stream #14(Compute)", 14), _meta(1, "Stream #21(MemcpyD2H)", 21),
              _x(1, 14, 0, 100, "layer_fwd"), _x(1, 14, 200, 100, "layer_bwd"), _x(1, 14, 340, 60, "adamw"),
              _x(1, 21, 120, 30, "MemcpyD2H", 2048)]
    (g,) = trace_summary.overlap({"traceEvents": events}, top=1)
    assert (g["idle_us"], g["idle_copying_us"], g["d2h_us"]) == (140, 30, 30)
    assert g["idle_gaps"] == [{"gap_us": 100, "at_us": 100, "before": "layer_fwd", "after": "layer_bwd",
                               "h2d_us": 0, "d2h_us": 30}]


REAL_TRACE = pathlib.Path(__file__).parents[2] / "benchmarks/results/llama_multi_gpu/h200x2_collective_ab/trace_base.json.gz"


def test_overlap_of_a_real_two_gpu_training_step():
    """A step jax's profiler traced on 2 H200s (an 8-layer HF Llama through ``SwappedStack``, AdamW in
    ``pinned_host``; ``benchmarks/results/llama_multi_gpu/README.md``): each GPU's window is its compute, its
    collectives under no compute and its idle time; XLA:GPU names each NCCL kernel's program and HLO op, and the
    collectives grouped by op add up to every collective kernel, their exposed parts to at least the union's."""
    trace = trace_summary.load(str(REAL_TRACE))
    rows = trace_summary.overlap(trace, top=10_000)
    assert [r["device"] for r in rows] == ["/device:GPU:0", "/device:GPU:1"]
    for r in rows:
        parts = r["compute_us"] + r["collective_exposed_us"] + r["idle_us"]
        assert abs(parts - r["window_us"]) < 1e-6 * r["window_us"]
        ops = r["exposed_collectives"]
        assert all(c["module"].startswith("jit_") for c in ops)
        assert {c["op"].rpartition(".")[0].rstrip(".0123456789") for c in ops} >= {"all-gather", "reduce-scatter"}
        total = sum(d for _, d in r["top_collective"])
        assert abs(sum(c["dur_us"] for c in ops) - total) < 1e-6 * total
        assert all(0 <= c["exposed_us"] <= c["dur_us"] + 1e-9 for c in ops)
        assert sum(c["exposed_us"] for c in ops) >= r["collective_exposed_us"] - 1e-6
        assert [c["exposed_us"] for c in ops] == sorted((c["exposed_us"] for c in ops), reverse=True)
    assert "under no compute" in trace_summary.render_overlap(rows)


ONE_GPU_TRACE = pathlib.Path(__file__).parents[2] / \
    "benchmarks/results/llama_multi_gpu/h200_one_gpu_decomposition/trace_1gpu_l8_16384.json.gz"


def test_compute_kinds_split_every_compute_kernel_of_real_steps():
    """The same 8-layer step at 16384 tokens per GPU traced on one H200 and on 2: per GPU the kinds add up to
    the compute kernels' summed durations (every kernel on a stream, less collectives and host copies: the
    device-to-device copies are compute, as ``overlap`` counts them), and the
    transposes are named by program. Only the 2-GPU programs run transposes."""
    for path, gpus in ((ONE_GPU_TRACE, 1), (REAL_TRACE, 2)):
        trace = trace_summary.load(str(path))
        rows = trace_summary.compute_kinds(trace, top=10_000)
        assert len(rows) == gpus
        events = trace["traceEvents"]
        for r in rows:
            pid = next(e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                       and e["args"]["name"] == r["device"])
            tname = {e["tid"]: e["args"]["name"] for e in events
                     if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] == pid}
            def host_copy(e):
                text = e["name"] + json.dumps(e.get("args", {}))
                return bool(trace_summary.COPY.search(e["name"]) and (trace_summary.H2D.search(text)
                                                                     or trace_summary.D2H.search(text)))
            total = sum(e["dur"] for e in events if e.get("ph") == "X" and e.get("pid") == pid and "dur" in e
                        and tname.get(e.get("tid"), "").startswith("Stream")
                        and not trace_summary.COLLECTIVE.search(e["name"]) and not host_copy(e))
            assert r["total_us"] == pytest.approx(total)
            assert r["total_us"] == pytest.approx(sum(r[k + "_us"] for k in ("gemm", "attention", "transpose", "other")))
            assert r["gemm_us"] > r["attention_us"] > 0
            assert sum(t["us"] for t in r["transposes"]) == pytest.approx(r["transpose_us"])
            assert (r["transpose_us"] > 0) == (gpus == 2)
