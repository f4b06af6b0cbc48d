"""torch stays whole beside ``SwappedStack``, and torch's fp32 matmul setting is the stack's.

* torchax, which the stack uses to run torch modules as JAX functions, renames torch's
  PrivateUse1 backend to ``jax`` at import; torch then takes it as the process's accelerator,
  and CUDA autograd and FSDP2 fail (``PyTorch is not linked with support for jax devices``).
  The stack imports torchax without that registration: checked in a fresh interpreter (this
  process may have imported torchax through torch_xla already), where torch's accelerator,
  its PrivateUse1 name and plain torch autograd are the same before and after a stack is built,
  called and trained. A layer reading the device of a slice (a torchax view while traced, as xLSTM's
  mLSTM does) traces there and gives torch's values.
  The device module ``torch.autocast`` needs for torchax tensors is registered as unavailable, so
  torch's device discovery (``torch._utils._get_available_device_type``) is unchanged too.
* fp32 contractions follow ``torch.backends.cuda.matmul.fp32_precision`` / ``allow_tf32``:
  full fp32 (``operand_precision={highest,highest}`` in the compiled HLO) by default, as in
  torch, TF32 (``{high,high}``) when torch allows it; a change between calls compiles again.
  The values on a GPU are checked by ``benchmarks/torch_interop_gpu.py``.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from xla_swap.stack import SwappedStack
from xla_swap.stack.swapped_stack import torch_matmul_precision

ROOT = pathlib.Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, sys
import torch

def state():
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    from torch._utils import _get_available_device_type   # what torch.distributed.checkpoint's writer picks
    return [torch._C._get_privateuse1_backend_name(), str(acc), hasattr(torch, "jax"), _get_available_device_type()]

def torch_grad():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    lin(torch.ones(2, 8)).square().sum().backward()
    return lin.weight.grad.sum().item()

assert "torchax" not in sys.modules and "torch_xla" not in sys.modules
before, g_before = state(), torch_grad()
from xla_swap.stack import SwappedStack
torch.manual_seed(0)
layers = [torch.nn.Linear(8, 8) for _ in range(3)]
stack = SwappedStack(layers, optimizer=torch.optim.AdamW([p for l in layers for p in l.parameters()], lr=1e-2),
                     loss_fn=lambda o, y: (o - y).square().mean())
out = stack(torch.ones(2, 8))
loss = stack.train_step(torch.ones(2, 8), torch.zeros(2, 8))
after, g_after = state(), torch_grad()


class SliceDevice(torch.nn.Module):   # reads the device of a slice (a torchax view while traced), as xLSTM does
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        head = x[:, :4]
        return self.lin(x) + torch.ones(head.shape[0], 8, device=head.device)


torch.manual_seed(1)
sliced = [SliceDevice() for _ in range(2)]
x = torch.randn(2, 8)
want = sliced[1](sliced[0](x))
view_rel = float((SwappedStack(sliced)(x) - want).norm() / want.norm())
print(json.dumps({"torchax": "torchax" in sys.modules, "before": before, "after": after,
                  "grads": [g_before, g_after], "finite": bool(torch.isfinite(out).all() and torch.isfinite(loss)),
                  "view_rel": view_rel}))
"""


def test_stack_leaves_torch_accelerator_and_autograd_alone():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["torchax"] and r["finite"]          # the stack did run through torchax
    assert r["before"][0] == "privateuseone" and r["before"] == r["after"]
    assert r["grads"][0] == r["grads"][1]
    assert r["view_rel"] <= 1e-6   # a layer reading a slice's device (torchax view) traced, torch's values


def test_import_torchax_skips_the_registration_and_restores_torch():
    """The patch is scoped to torchax's import: torch's own functions are back afterwards."""
    import torch.utils
    from xla_swap._compat import torchax as compat
    rename, register = torch.utils.rename_privateuse1_backend, torch._register_device_module
    assert compat.import_torchax() is sys.modules["torchax"]
    assert torch.utils.rename_privateuse1_backend is rename and torch._register_device_module is register
    assert compat.torch_accelerator_taken() in (None, "jax")   # "jax": torch_xla imported torchax first


@pytest.fixture
def torch_fp32_precision():
    """Restores torch's fp32 matmul setting after the test."""
    m = torch.backends.cuda.matmul
    saved = m.fp32_precision
    yield m
    m.fp32_precision = saved


def _dot_precisions(stack) -> set:
    found = set()
    for _, text in stack.runtime.executable_hlo():
        for line in text.splitlines():
            if " dot(" in line and "f32[" in line.split("=")[1].split(" dot(")[0]:
                found.add(line.split("operand_precision={")[1].split("}")[0] if "operand_precision" in line
                          else "default")
    return found


def test_fp32_contractions_follow_torch_setting(torch_fp32_precision):
    torch_fp32_precision.fp32_precision = "ieee"
    assert torch_matmul_precision() == "highest"
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
              for _ in range(3)]
    x = torch.randn(4, 16)
    ref = x
    for layer in layers:
        ref = layer(ref)
    stack = SwappedStack(layers)
    assert stack.matmul_precision == "highest"
    out = stack(x)
    assert _dot_precisions(stack) == {"highest,highest"}
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)

    torch_fp32_precision.fp32_precision = "tf32"      # as allow_tf32 = True
    assert torch_matmul_precision() == "tensorfloat32"
    out_tf32 = stack(x)
    assert stack.matmul_precision == "tensorfloat32" and _dot_precisions(stack) == {"high,high"}
    torch.testing.assert_close(out_tf32, ref.detach(), rtol=1e-5, atol=1e-6)   # XLA:CPU computes fp32 anyway

    torch_fp32_precision.fp32_precision = "ieee"
    stack(x)
    assert _dot_precisions(stack) == {"highest,highest"}


def test_torch_matmul_precision_reads_every_torch_api(torch_fp32_precision):
    saved_generic = torch.backends.fp32_precision
    try:
        torch.set_float32_matmul_precision("high")
        assert torch_matmul_precision() == "tensorfloat32"
        torch.set_float32_matmul_precision("medium")     # TF32 on torch's cuBLAS path too
        assert torch_matmul_precision() == "tensorfloat32"
        torch.set_float32_matmul_precision("highest")
        assert torch_matmul_precision() == "highest"
        torch_fp32_precision.fp32_precision = "none"     # defers to the generic setting
        torch.backends.fp32_precision = "tf32"
        assert torch_matmul_precision() == "tensorfloat32"
    finally:
        torch.backends.fp32_precision = saved_generic


def test_gpu_interop_script_runs_on_cpu(tmp_path):
    """``benchmarks/torch_interop_gpu.py`` as a CPU smoke test: every check it makes passes there too."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), MASTER_PORT="29541")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    out = tmp_path / "interop.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "torch_interop_gpu.py"), "--d", "64",
                           "--layers", "2", "--tokens", "16", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["before"] == r["after"] and set(r["before"]) == {"autograd", "fsdp2"}
    assert all(r["checks"].values()) and r["precision"]["stack_fp32_vs_torch_fp32"] < 1e-5
