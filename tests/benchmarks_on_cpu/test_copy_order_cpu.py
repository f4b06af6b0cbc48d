"""``benchmarks/copy_order.py`` and ``torch_stack.measure_bandwidth`` on virtual CPU devices: every dispatch
order moves the right values to the right memory kind, and the "both directions" rate alternates the
directions one array per call."""
import json

import jax
import numpy as np
import pytest

import copy_order  # benchmarks/ is on pytest's pythonpath
import torch_stack


@pytest.fixture(scope="module")
def arrays():
    devs = jax.devices()
    dev, dsh = copy_order._arrays(devs, 4, 1 / 16, 100)
    hsh = dsh.with_memory_kind("pinned_host")
    host = jax.device_put(copy_order._arrays(devs, 4, 1 / 16, 0)[0], [hsh] * 4)
    return host, dev, dsh, hsh


def _check_moved(moved, host, dev, expect_in: int, expect_out: int):
    """Every moved array holds the value of the array it copies, in the memory kind it was sent to."""
    into = [a for a in moved if a.sharding.memory_kind == "device"]
    out = [a for a in moved if a.sharding.memory_kind == "pinned_host"]
    assert (len(into), len(out)) == (expect_in, expect_out)
    host_values = {float(np.asarray(h)[0]) for h in host}
    dev_values = {float(np.asarray(d)[0]) for d in dev}
    assert {float(np.asarray(a)[0]) for a in into} <= host_values
    assert {float(np.asarray(a)[0]) for a in out} <= dev_values
    for a in moved:
        assert np.all(np.asarray(a) == np.asarray(a)[0])   # whole arrays, not pieces


def test_every_transfer_order_moves_each_array_once_each_way(arrays):
    host, dev, dsh, hsh = arrays
    variants = copy_order.transfer_variants(host, dev, dsh, hsh)
    assert {"lists", "alternating_singles", "singles_in_then_out", "blocks_of_2"} <= set(variants)
    W = sum(a.nbytes for a in host)
    for name, (call, nbytes) in variants.items():
        moved = call()
        n_in = 0 if name == "d2h" else len(host)
        n_out = 0 if name == "h2d" else len(dev)
        _check_moved(moved, host, dev, n_in, n_out)
        assert nbytes == W * (n_in + n_out) // len(host), name


def test_the_runtime_like_passes_send_each_stage_out_after_its_computation(arrays):
    host, dev, dsh, hsh = arrays
    variants, t_stage = copy_order.stage_variants(host[:2], dev[:2], dsh, hsh, stages=3, matmuls=1, m=32)
    assert set(variants) == {"stages_out_first", "stages_in_first", "stages_alternating_singles"}
    assert t_stage > 0
    for name, (call, nbytes) in variants.items():
        moved = call()
        into = [a for a in moved if a.sharding.memory_kind == "device"]
        out = [a for a in moved if a.sharding.memory_kind == "pinned_host"]
        assert len(into) == len(out) == 3 * 2, name
        # each stage's outputs (dev + a scalar of its computation, which bf16 rounds away here) go out
        assert sorted(float(np.asarray(o)[0]) for o in out) == sorted([float(np.asarray(d)[0]) for d in dev[:2]] * 3)
        assert nbytes == 3 * 2 * sum(a.nbytes for a in host[:2])


def test_the_script_writes_a_row_per_variant(tmp_path):
    out = tmp_path / "copy_order.json"
    assert copy_order.main(["--cpu-smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    names = [r["variant"] for r in res["rows"]]
    assert len(names) == len(set(names)) and "alternating_singles" in names and "stages_out_first" in names
    assert res["devices"] == len(jax.devices())
    assert all(r["GBps"] > 0 and r["bytes"] > 0 for r in res["rows"])


def test_measure_bandwidth_alternates_the_two_directions_one_array_per_call(arrays, monkeypatch):
    host, _, _, _ = arrays
    calls = []
    real_put = jax.device_put

    def recording_put(x, s=None, **kw):
        kinds = [t.memory_kind for t in (s if isinstance(s, list) else [s])]
        calls.append((len(x) if isinstance(x, list) else 1, kinds))
        return real_put(x, s, **kw)

    monkeypatch.setattr(jax, "device_put", recording_put)
    bw = torch_stack.measure_bandwidth(host, reps=1)
    assert bw["bytes"] == sum(a.nbytes for a in host)
    assert all(bw[k] > 0 for k in ("h2d", "d2h", "both"))
    singles = [kinds[0] for n, kinds in calls if n == 1]
    # the "both" round: array k in, its device copy out, then k + 1 ...
    assert singles == ["device", "pinned_host"] * len(host)
