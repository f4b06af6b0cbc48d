"""Several processes through ``jax.distributed`` (the multi-controller engine) on CPU.

2 processes x 2 virtual CPU devices run ``tests/stack/mp_worker.py`` over one 4-device mesh
(``StreamingRuntime`` with FSDP-style sharding, and ``SwappedStack`` training torch layers with
AdamW); each process pins only its own shards (asserted in the worker). The results must equal
the same worker run as 1 process x 4 devices (relative norm of the difference <= 1e-6), values
and gradients.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "mp_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(worker: Path, argvs: list, out: Path) -> dict:
    """Start ``worker`` once per argument list (one process each, CPU only), wait for all (300 s), assert that
    every one exited 0 (its log in the message) and return the JSON the workers wrote to ``out``."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}   # XLA_FLAGS: the worker sets the device count
    env["PYTHONPATH"] = str(ROOT)
    env["NPROC"] = "8"   # XLA:CPU's thread pool: with one thread per core a gloo collective can starve a device
    procs = [subprocess.Popen([sys.executable, str(worker), *argv], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv in argvs]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return json.loads(out.read_text())


def _run(nproc: int, ndev: int, out: Path) -> dict:
    port = str(_free_port())
    return run_workers(WORKER, [[str(i), str(nproc), port, str(ndev), str(out)] for i in range(nproc)], out)


def _close(a, b, path="result"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and a and isinstance(a[0], (dict, list)) and not isinstance(a[0], float):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    else:  # norm-wise: gloo's cross-process all-reduce sums in another order than one process does
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, path
        assert np.linalg.norm(a - b) <= 1e-6 * max(np.linalg.norm(b), 1e-30), (path, a, b)


def test_two_processes_equal_one(tmp_path):
    single = _run(1, 4, tmp_path / "single.json")
    multi = _run(2, 2, tmp_path / "multi.json")
    assert single["stack_losses"][-1] < single["stack_losses"][0]   # it trains
    put_single, put_multi = single.pop("put"), multi.pop("put")
    _close(multi, single)
    for got in (put_single, put_multi):   # values and shardings as jax.device_put gives them
        assert all(got["shardings"]) and all(got["equal"]), got
    # across processes, jax.device_put traces a program for a move between memory kinds (and checks a numpy
    # value on every process); transfers.put moves each process's shards on their own devices
    assert put_multi["device_put_traced"] > 0 and put_multi["traced"] == 0, put_multi
