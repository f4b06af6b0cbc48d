"""CPU smoke test of ``benchmarks/leak_cycles.py``: every case runs a few cycles and the JSON has the
documented structure. The figures are not checked (a few cycles say nothing about a slope): that
nothing dropped is alive after ``gc.collect()`` is, as it holds after any number of cycles. The reader of
CPython's interned-string table (``benchmarks/leak_interned.py``) is checked against ``sys.intern`` and
its keys-object size against ``sys.getsizeof``."""
import json
import sys

import pytest

import leak_cycles  # benchmarks/ is on pytest's pythonpath
import leak_interned


def test_few_cycles_every_case_structure(tmp_path, capsys):
    out = tmp_path / "sub" / "leak_cycles.json"
    rc = leak_cycles.main(["--cycles", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == (0 if data["pass"] else 1)
    assert data["target_kib_per_cycle"] == leak_cycles.TARGET_KIB and data["compile_cache"] is False
    assert data["command"].startswith("leak_cycles.py --cycles 2") and data["platform"] == "cpu"
    assert data["versions"]["jax"] and data["versions"]["torch"]
    assert [r["case"] for r in data["results"]] == list(leak_cycles.CASES)
    for r in data["results"]:
        assert r["cycles"] == 2 and len(r["rss_bytes"]) == 2 and all(b > 0 for b in r["rss_bytes"])
        assert isinstance(r["rss_slope_kib_per_cycle"], float) and isinstance(r["raw_rss_slope_kib_per_cycle"], float)
        assert len(r["trimmed_rss_bytes"]) == 2 and r["seconds"] > 0        # glibc on the CPU machine
        assert len(r["python_blocks"]) == 2 and len(r["jax_cache_entries"]) == 2 and r["jax_cache_entries"][0] > 0
        assert r["device_bytes_in_use"] is None and r["device_slope_kib_per_cycle"] is None   # CPU: no statistics
        assert r["alive_after_gc"] == 0 and 0 <= r["freed_by_refcount"] <= 2
        assert r["live_arrays_end"] == r["live_arrays_start"]
        assert len(r["malloc_in_use_bytes"]) == 2 and all(m > 0 for m in r["malloc_in_use_bytes"])   # glibc
        assert isinstance(r["malloc_in_use_slope_kib_per_cycle"], float)
        assert r["interned_live"] is None or (len(r["interned_live"]) == 2 and len(r["interned_log2_slots"]) == 2)
        settle = r["interned_settle"]        # on by default: the table rebuilt after the first cycle
        assert settle["strings"] > 0 and settle["trimmed_rss_before"] > 0 and settle["trimmed_rss_after"] > 0
        if r["interned_live"] is not None:   # the table read: the second sample is the settled table
            assert r["interned_log2_slots"][1] == settle["after"]["log2_slots"]
    assert data["settle_interned"] is True and data["malloc_thresholds"] == leak_cycles.MALLOC_THRESHOLDS
    table = capsys.readouterr().out
    assert table.count("\n| runtime_") == 2 and "\n| stack | 2 |" in table and ("PASS" in table or "FAIL" in table)


def test_slope_is_least_squares_over_the_second_half():
    assert abs(leak_cycles.slope_per_cycle([100, 0, 0, 10, 20, 30]) - 10.0) < 1e-9   # [10, 20, 30]
    assert abs(leak_cycles.slope_per_cycle([5, 5, 5, 5])) < 1e-9
    r = {"rss_slope_kib_per_cycle": 0.5, "alive_after_gc": 0, "device_slope_kib_per_cycle": None}
    assert leak_cycles.passed(r) and not leak_cycles.passed({**r, "alive_after_gc": 1})
    assert not leak_cycles.passed({**r, "device_slope_kib_per_cycle": 2.0})


def test_interned_table_reader_counts_sys_intern_and_keys_size_matches_cpython():
    try:
        read = leak_interned.interned_table_reader()
    except RuntimeError as e:             # not CPython 3.11 with libpython's symbols: the error names why
        pytest.skip(str(e))
    for log2 in (16, 17):                 # the formula against CPython's own size of a str-keyed dict
        d = {f"k{i}": i for i in range(1 << (log2 - 1))}   # half of 2^log2 slots: built at 2^log2
        assert sys.getsizeof(d) - sys.getsizeof({}) == leak_interned.keys_object_nbytes(log2)
    with pytest.raises(ValueError, match="log2"):
        leak_interned.keys_object_nbytes(8)
    before = read()
    fresh = [sys.intern("leak-interned-test-%d" % i) for i in range(3000)]
    mid = read()
    assert mid["live"] == before["live"] + 3000
    assert mid["log2_slots"] != before["log2_slots"] or mid["free"] == before["free"] - 3000
    del fresh
    assert read()["live"] == before["live"]
    rows = leak_interned.run([("runtime_forward", 2)], read)
    assert [r["cycle"] for r in rows] == [0, 1] and all(r["live"] > 0 and r["trimmed_rss_kib"] > 0 for r in rows)


def test_settle_interned_table_rebuilds_at_three_times_the_live_strings():
    try:
        read = leak_interned.interned_table_reader()
    except RuntimeError as e:
        pytest.skip(str(e))
    first = leak_interned.settle_interned_table(read)
    live, log2 = first["after"]["live"], first["after"]["log2_slots"]
    assert first["before"]["live"] == live                         # no string stays interned
    assert (1 << log2) >= 3 * live > (1 << (log2 - 1))              # CPython's size for 3x the live strings
    assert first["strings"] == first["before"]["free"] + 1          # rebuilt at the first insertion past the free ones
    again = leak_interned.settle_interned_table(read)               # settled: the next rebuild keeps the size
    assert again["after"]["log2_slots"] == log2 and again["after"]["live"] == live
    assert again["strings"] == first["after"]["free"] + 1
    blind = leak_interned.settle_interned_table(None)
    assert blind == {"strings": leak_interned.BLIND_SETTLE_STRINGS, "before": None, "after": None}
    assert read()["live"] == live and read()["log2_slots"] == log2


def test_no_settle_interned_option(tmp_path):
    out = tmp_path / "r.json"
    leak_cycles.main(["--cycles", "2", "--cases", "runtime_forward", "--no-settle-interned", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["settle_interned"] is False and data["results"][0]["interned_settle"] is None


def test_fix_malloc_thresholds_rejects_nonpositive():
    with pytest.raises(ValueError, match="nbytes"):
        leak_cycles.fix_malloc_thresholds(0)
