"""The GPU benchmark's own checks, run small on CPU (timings mean nothing here).

``benchmarks/gpu_stack.py`` compares every variant's output (and, for training, the input
cotangent and every layer's weight gradients) with the on-device per-layer loop. This runs
the xla_swap rows - in-graph, chunked streaming, training with kept residuals (chunked:
per-stage gradients merged back to per-layer ones) - on a tiny stack in one process and
asserts those errors, the gradients' memory kind and the rows the table needs.
"""
import pytest

import gpu_stack   # benchmarks/gpu_stack.py (benchmarks/ is on pytest's pythonpath)


@pytest.fixture(scope="module")
def rows():
    args = gpu_stack.parse_args(["--d", "64", "--f", "128", "--layers", "3", "--tokens", "32", "--reps", "2",
                                 "--chunks", "4", "--no-trace"])
    args.weights_cache = None
    out = []
    for v in ("xla_swap-in-graph", "xla_swap-k2-chunked", "train-xla_swap-k2-saved-chunked", "train-xla_swap-k2"):
        out += gpu_stack.run_variant(args, v, [32])
    return {r["variant"]: r for r in out}


def test_forward_rows_agree_with_the_on_device_loop(rows):
    for v in ("xla_swap-in-graph", "xla_swap-k2-chunked"):
        r = rows[v]
        assert "error" not in r, r.get("error")
        assert r["rel_err"] < 2e-2          # bf16, chunked sums reordered
        assert len(r["times_s"]) == 2 and r["median_ms"] > 0
    assert rows["xla_swap-k2-chunked"]["stages"] == 1 + 2 * 4   # 3 layers, first and last in 4 chunks
    # the flag search compiled the in-graph program again under every flag set (or recorded why not)
    for name in gpu_stack.FLAG_SETS:
        assert f"xla_swap-in-graph@{name}" in rows


def test_training_rows_agree_and_send_gradients_to_host(rows):
    for v in ("train-xla_swap-k2-saved-chunked", "train-xla_swap-k2"):
        r = rows[v]
        assert "error" not in r, r.get("error")
        assert r["grads_memory_kind"] == "pinned_host"
        assert max(r["rel_err_out"], r["rel_err_dx"], r["rel_err_grads"]) < 2e-2
    saved = rows["train-xla_swap-k2-saved-chunked"]
    assert sum(saved["residual_nbytes"]) > 0 and sum(rows["train-xla_swap-k2"]["residual_nbytes"]) == 0


def test_chunk_spec():
    assert gpu_stack.parse_chunks(["4"], [64, 128]) == {64: (4, 4), 128: (4, 4)}
    assert gpu_stack.parse_chunks(["64=1,2", "128=4,1"], [64, 128]) == {64: (1, 2), 128: (4, 1)}
    with pytest.raises(ValueError, match="no chunk counts for token counts \\[128\\]"):
        gpu_stack.parse_chunks(["64=1,2"], [64, 128])
    with pytest.raises(ValueError, match="expected N or TOKENS=FIRST,LAST, got '64=2'"):
        gpu_stack.parse_chunks(["64=2"], [64])
