"""``torchrun`` with per-rank batches on two GPUs, against one process on both (skipped without two NVIDIA
GPUs and ``JAX_PLATFORMS=cuda``).

``tests/stack/torchrun_worker.py`` with ``WORKER_CUDA=1``: each rank passes its own rows of the global
batch as CUDA tensors on its GPU (``cuda:LOCAL_RANK``); the reference is the same worker as one process
over both GPUs on the whole batch (CUDA tensors on ``cuda:0``). Asserted, as on CPU
(``test_torchrun._check``): every rank's losses of 3 AdamW steps equal the reference's, its weights after
``sync_modules`` and its AdamW moments are the reference's (relative norm <= 1e-5 per tensor), the ranks'
forward rows concatenated are the reference's (<= 1e-6), greedy ``generate`` gives the reference's
tokens (also with a shorter prompt on the last rank), and each process pins only its own GPU's shards.

On a two-GPU machine, from the repository root (the wheels of ``benchmarks/WHEELS.md`` in ``/tmp/site``)::

    export PYTHONPATH=/tmp/site:. JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
    python3 -m pytest -q -p no:cacheprovider tests/stack/test_torchrun_gpu.py
"""
import os
import shutil
import sys

import pytest

from test_torchrun import _check, _free_port, _wait


def _two_gpus() -> bool:
    if os.environ.get("JAX_PLATFORMS") != "cuda" or shutil.which("nvidia-smi") is None:
        return False
    import torch
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


pytestmark = pytest.mark.skipif(not _two_gpus(), reason="two NVIDIA GPUs with JAX_PLATFORMS=cuda")


def _gpu_env() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES")}
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(path + [root]), JAX_PLATFORMS="cuda", WORKER_CUDA="1",
               XLA_PYTHON_CLIENT_PREALLOCATE="false", NCCL_NVLS_ENABLE="0",
               XLA_SWAP_COORDINATOR_PORT=str(_free_port()))
    return env


def test_torchrun_two_gpus_equal_one_process_on_both(tmp_path):
    env = _gpu_env()
    (ref,) = _wait([[sys.executable]], env, tmp_path / "single")
    assert ref["losses"][-1] < ref["losses"][0]   # it trains
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    ranks = _wait([cmd], env, tmp_path / "ranks")
    assert len(ranks) == 2
    _check(ranks, ref)
