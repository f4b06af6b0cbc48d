"""``save_checkpoint`` / ``load_checkpoint`` across numbers of processes (``jax.distributed`` on CPU).

``tests/stack/mp_ckpt_worker.py`` trains a ``SwappedStack`` of torch layers (FSDP-sharded,
``torch.optim.AdamW``) 2 steps and saves, in 2 processes x 2 devices (one DCP save over
``torch.distributed``, gloo) and in 1 process x 4 devices; each checkpoint is loaded by the other
form into a stack over other weights. The loaded weights, moments and step equal the saver's
(gathered) exactly, and the 3rd step equals the saver's 3rd step (relative norm <= 1e-6: gloo's
all-reduce sums in another order). Without ``torch.distributed``, a 2-process save is refused
before anything is written.
"""
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp

from test_multiprocess import _close, _free_port, run_workers

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "mp_ckpt_worker.py"


def _run(nproc: int, ndev: int, out: Path, save="-", load="-") -> dict:
    ports = [str(_free_port()), str(_free_port())]
    return run_workers(WORKER, [[str(i), str(nproc), *ports, str(ndev), str(out), str(save), str(load)]
                                for i in range(nproc)], out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two processes save; one process saves and loads theirs; two processes load the one's."""
    tmp = tmp_path_factory.mktemp("mpckpt")
    multi = _run(2, 2, tmp / "a.json", save=tmp / "ckpt2")
    single = _run(1, 4, tmp / "b.json", save=tmp / "ckpt1", load=tmp / "ckpt2")
    multi_load = _run(2, 2, tmp / "c.json", load=tmp / "ckpt1")
    return tmp, multi, single, multi_load


def _equal(a: dict, b: dict):
    """Exactly equal (a loaded copy) per key."""
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k


def _loaded_equals_saved(saver: dict, loader: dict):
    assert saver["saved"]["step"] == loader["loaded"]["step"] == 2 and saver["step3"]["step"] == 3
    assert loader["extra"] == {"scheduler": {"last_epoch": 2}}
    fresh, saved = (np.asarray(r["0.up.weight"]) for r in (loader["fresh"], saver["saved"]))
    assert np.abs(fresh - saved).max() > 0.1   # the loading stack started from other weights
    _equal(loader["loaded"], saver["saved"])
    _close(loader["loaded_step3"], saver["step3"])


def test_two_process_checkpoint_loads_in_one_process(runs):
    """2 processes x 2 devices save (each process its own files, one metadata); 1 process x 4 devices
    loads: weights, moments and step equal; the 3rd step equals the 2-process run's."""
    tmp, multi, single, _ = runs
    files = sorted(p.name for p in (tmp / "ckpt2").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
    assert all((tmp / "ckpt2" / f).stat().st_size > 0 for f in files)
    md = dcp.FileSystemReader(tmp / "ckpt2").read_metadata().state_dict_metadata
    assert len(md["model.layers.0.up.weight"].chunks) == 4            # one chunk per FSDP shard
    assert len(md["model.layers.0.up.bias"].chunks) == 1              # replicated: written once
    assert len(md["optim.state.layers.0.up.weight.step"].chunks) == 1
    _loaded_equals_saved(multi, single)


def test_one_process_checkpoint_loads_in_two_processes(runs):
    """1 process x 4 devices saves; 2 processes x 2 devices load it (without torch.distributed):
    equal state, and the 3rd step equals the 1-process run's."""
    _, _, single, multi_load = runs
    _loaded_equals_saved(single, multi_load)


def test_two_processes_without_torch_distributed_are_refused(runs):
    """A 2-process save before torch.distributed is initialized raises, naming what to call, and
    creates nothing."""
    _, multi, _, _ = runs
    assert "no_dist_error" in multi, "save_checkpoint did not raise"
    msg = multi["no_dist_error"]
    assert "torch.distributed is not initialized" in msg and "xla_swap.distributed.initialize()" in msg
    assert "init_process_group('gloo')" in msg
    assert multi["no_dist_wrote"] is False
