"""``torchrun`` with per-rank batches (``xla_swap.distributed.initialize``) on CPU, against one process.

The real ``torchrun`` starts ``tests/stack/torchrun_worker.py`` (so the environment is torchrun's
own): 2 processes x 2 CPU devices, and 2 "nodes" (two ``torchrun --nnodes 2 --node-rank k`` on this
machine) of 2 processes x 1 device. Each rank passes its own rows of one global batch; the same worker
run as 1 process x 4 devices on the whole batch is the reference. Asserted: every rank's losses of 3
AdamW steps equal the reference's, its weights after ``sync_modules`` and its AdamW moments are the
reference's (relative norm of the difference <= 1e-5 per tensor: gloo's cross-process sums run in
another order, and the q/k projections, whose gradients at initialisation are tiny, show about 2e-6),
the ranks' forward rows concatenated in rank order are the reference's (<= 1e-6; also a batch of one
row per rank, which runs replicated through the gathered path), and greedy ``generate`` gives the
reference's tokens exactly, with equal prompt lengths and with a shorter prompt on the last rank
(the reference left-pads it). Ranks passing other shapes, one rank refusing its input, or ranks building
from other weights raise on every rank, and building gathers no whole array from every process (the
worker checks). Plus ``initialize()``'s refusals, which start nothing, and the CRC the ranks compare.
"""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "torchrun_worker.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
ROWS = ("forward", "forward_replicated", "generate", "generate_short_2", "generate_short_4")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "RANK", "WORLD_SIZE")}
    # NPROC: XLA:CPU's thread pool (one thread per core by default); with 2 devices per process on a 2-core
    # machine a collective could wait for a thread another device's later program holds (seen: 2 hangs in 9)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]   # conftest's others
    env.update(PYTHONPATH=str(ROOT), XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]),
               JAX_PLATFORMS="cpu", XLA_SWAP_COORDINATOR_PORT=str(_free_port()), NPROC="8")
    return env


def _wait(cmds: list, env: dict, out: Path) -> list:
    """Run ``cmds`` at once (each in its own process group, killed whole on a timeout), wait for all;
    return every rank's JSON, in rank order."""
    out.mkdir()
    logs = [out.parent / f"log{i}.txt" for i in range(len(cmds))]
    procs = []
    for c, log in zip(cmds, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(c + [str(WORKER), str(out)], env=env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=400)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log.read_text()[-4000:]
    files = sorted(out.glob("rank*.json"), key=lambda f: int(f.stem[4:]))
    return [json.loads(f.read_text()) for f in files]


def _close(a, b, tol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err <= tol, (what, err)


def _check(ranks: list, ref: dict) -> None:
    for r, res in enumerate(ranks):
        assert res["losses"] == ref["losses"], (r, res["losses"], ref["losses"])
        assert res["refusals"] == "checked"
        for kind in ("weights", "moments"):
            assert res[kind].keys() == ref[kind].keys()
            for name in ref[kind]:
                _close(res[kind][name], ref[kind][name], 1e-5, (r, kind, name))
    for key in ROWS:
        if key in ranks[0]:
            rows = [row for res in ranks for row in res[key]]
            if key.startswith("generate"):
                assert rows == ref[key], (key, rows, ref[key])
            else:
                _close(rows, ref[key], 1e-6, key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The worker as 1 process x 4 devices on the whole batch."""
    (ref,) = _wait([[sys.executable]], _env(4), tmp_path_factory.mktemp("single") / "out")
    assert ref["losses"][-1] < ref["losses"][0]   # it trains
    return ref


def test_torchrun_two_processes_equal_one(reference, tmp_path):
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    ranks = _wait([cmd], _env(2), tmp_path / "out")
    assert len(ranks) == 2 and "forward_replicated" in ranks[0]
    _check(ranks, reference)


def test_torchrun_two_nodes_equal_one(reference, tmp_path):
    port = str(_free_port())
    cmds = [[str(TORCHRUN), "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", port] for k in (0, 1)]
    ranks = _wait(cmds, _env(1), tmp_path / "out")
    assert len(ranks) == 4
    _check(ranks, reference)


TORCHRUN_ENV = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT="29500")


@pytest.mark.parametrize("change, kwargs, match", [
    ({"RANK": None}, {}, "RANK not set"),
    ({"MASTER_ADDR": None, "MASTER_PORT": None}, {}, "MASTER_ADDR, MASTER_PORT not set"),
    ({"RANK": "2"}, {}, r"RANK must be an int in \[0, 2\), got '2'"),
    ({"WORLD_SIZE": "two"}, {}, "WORLD_SIZE must be an int"),
    ({"LOCAL_RANK": "2"}, {}, r"LOCAL_RANK must be an int in \[0, 2\)"),
    ({"LOCAL_WORLD_SIZE": "3"}, {}, r"LOCAL_WORLD_SIZE must be an int in \[1, 3\)"),
    ({"MASTER_PORT": "70000"}, {}, "MASTER_PORT must be an int"),
    ({}, {"coordinator_port": 29500}, "is MASTER_PORT"),
    ({"XLA_SWAP_COORDINATOR_PORT": "x"}, {}, "XLA_SWAP_COORDINATOR_PORT must be an int"),
    ({}, {"coordinator_port": True}, "coordinator_port must be an int"),
    ({}, {"local_device_ids": [-1]}, "local_device_ids must be"),
])
def test_initialize_refuses_bad_environment_before_starting(monkeypatch, change, kwargs, match):
    import jax
    import xla_swap.distributed as xd
    for k, v in {**TORCHRUN_ENV, "XLA_SWAP_COORDINATOR_PORT": None, **change}.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        xd.initialize(**kwargs)
    assert not xd.per_rank_batches() and not jax.distributed.is_initialized()


def test_initialize_refuses_a_non_bool_process_group(monkeypatch):
    import xla_swap.distributed as xd
    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(TypeError, match="process_group must be a bool"):
        xd.initialize(process_group="gloo")
    assert not xd.per_rank_batches()


def test_value_crc_tells_values_shapes_and_dtypes_apart(monkeypatch):
    import ml_dtypes

    from xla_swap.distributed import CRC_CHUNK, check_ranks_hold_the_same, value_crc
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert value_crc(a) == value_crc(a.copy()) == value_crc(np.asfortranarray(a))   # C-order bytes
    b = a.copy()
    b[2, 3] += 1
    assert len({value_crc(a), value_crc(b), value_crc(a.reshape(4, 3)), value_crc(a.astype(np.float64)),
                value_crc(a.astype(ml_dtypes.bfloat16))}) == 5
    big = np.zeros(CRC_CHUNK * 2 + 3, np.uint8)   # three chunks, CRC'd on threads
    other = big.copy()
    other[-1] = 1
    assert value_crc(big) == value_crc(big.copy()) != value_crc(other)
    assert value_crc(big) != value_crc(big[:-1])
    check_ranks_hold_the_same("weights", ["x"], [value_crc(a)])   # one process: nothing to compare
    import jax
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="1 names and 2 CRCs"):   # refused before any exchange
        check_ranks_hold_the_same("weights", ["x"], [1, 2])
