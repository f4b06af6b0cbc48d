"""What the multi-process CPU workers (``mp_worker.py``, ``mp_ckpt_worker.py``) share: jax started on ``ndev``
virtual CPU devices per process (``jax.distributed`` with gloo collectives when there are several
processes), the torch block they stack, and the gather of a possibly cross-process array."""
import os

D, F = 8, 16


def start_jax(pid: int, nproc: int, port: str, ndev: int):
    """Start jax in this process: ``ndev`` CPU devices (``XLA_FLAGS``' other flags kept), and with ``nproc > 1``
    process ``pid`` of a ``jax.distributed`` run whose coordinator listens on ``127.0.0.1:port``. Call it
    before anything imports jax. Returns the ``jax`` module."""
    os.environ["XLA_FLAGS"] = " ".join([f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
                                       + [f"--xla_force_host_platform_device_count={ndev}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    if nproc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    assert len(jax.devices()) == nproc * ndev
    return jax


def gather(a):
    """``a`` whole as numpy: gathered from every process when it spans several (a collective)."""
    import numpy as np
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(a, tiled=True)) if not a.is_fully_addressable \
        else np.asarray(a)


def block_class():
    """The torch layer the workers stack: ``h + down(gelu(up(h)))``, ``D`` -> ``F`` -> ``D``."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(D, F), torch.nn.Linear(F, D)

        def forward(self, h):
            return h + self.down(torch.nn.functional.gelu(self.up(h)))
    return Block
