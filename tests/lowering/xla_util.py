"""Shared set-up for the torch_xla tests: SPMD on the virtual CPU devices, and a mesh."""
import numpy as np
import torch
import torch_xla
import torch_xla.runtime as xr
import torch_xla.distributed.spmd as xs

xr.use_spmd()
N = xr.global_runtime_device_count()
DEV = torch_xla.device()


def mesh_2d() -> xs.Mesh:
    """A ('x', 'y') mesh over all devices: (1,1) for 1 device, (2,2) for 4, (4,2) for 8."""
    y = 2 if N % 2 == 0 and N > 1 else 1
    return xs.Mesh(np.arange(N), (N // y, y), ("x", "y"))


def to_xla(t: torch.Tensor, mesh=None, spec=None) -> torch.Tensor:
    """Copy a CPU tensor to the XLA device, optionally sharded with ``spec`` over ``mesh``."""
    x = t.to(DEV)
    if spec is not None:
        xs.mark_sharding(x, mesh, spec)
    return x
