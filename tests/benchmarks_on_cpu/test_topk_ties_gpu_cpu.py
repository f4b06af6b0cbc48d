"""``benchmarks/topk_ties_gpu.py`` on the CPU: its comparison of ``torch.topk`` with the stages' runs
(torch's CPU kernel on both sides here, so every row picks the same experts in the same order)."""
import pytest

pytest.importorskip("transformers")

import topk_ties_gpu  # noqa: E402  (benchmarks/ is on pytest's pythonpath)


def test_topk_rows_agree_on_cpu():
    rows = topk_ties_gpu.compare_topk("cpu", 4, [(4, 2), (128, 8), (128, 2)])
    assert len(rows) == 6 and all(r["same_set"] and r["same_order"] for r in rows)
