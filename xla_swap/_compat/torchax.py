"""torchax, imported without changing torch for the rest of the process.

``import torchax`` (0.0.6 inside torch_xla 2.9, 0.0.13 on PyPI) runs two process-wide
registrations at import time:

* ``torch.utils.rename_privateuse1_backend("jax")``: torch then reports a PrivateUse1
  accelerator (``c10::is_privateuse1_backend_registered``, which ``at::getAccelerator``
  prefers over CUDA). torch's autograd engine and FSDP2 ask that accelerator for its device
  guard and hooks, which torchax never registers: after it, a plain CUDA ``backward()`` raises
  ``PyTorch is not linked with support for jax devices`` and FSDP2's ``fully_shard`` raises
  ``Please register PrivateUse1HooksInterface``. The rename cannot be undone (torch allows it
  once per process).
* ``torch._register_device_module("jax", ...)``: a ``torch.jax`` attribute, the device module
  ``torch.autocast`` looks up by the backend's name.

xla_swap needs neither: its stage functions run under ``torchax.default_env()``, and torchax's
environment treats ``privateuseone`` as its own device name beside ``jax``. :func:`import_torchax`
imports torchax with the rename skipped and a device module registered under the
unrenamed name (``torch.privateuseone``: enough for ``torch.autocast``, which Hugging Face's rotary
embeddings enter on torchax tensors; it reports itself unavailable, so it changes no accelerator
and no device discovery), and its tensors and views then report their device as
``privateuseone:0`` (the same device before the rename) instead of ``jax:0``; a dtype change torch's
C++ code asks of them on ``meta`` stays on their device, as it does for ``jax:0``. Verified on torchax
0.0.6 (torch 2.9) and 0.0.13 (torch 2.11).

If torchax was imported before (by torch_xla, or by the user), the registrations have already
happened and :func:`torch_accelerator_taken` says so.
"""
from __future__ import annotations

import contextlib
import sys
import threading

_LOCK = threading.Lock()


@contextlib.contextmanager
def _without_device_registration():
    """Inside the block (torchax's import): ``torch.utils.rename_privateuse1_backend`` is a no-op and
    ``torch._register_device_module`` registers under ``privateuseone``."""
    import torch
    import torch.utils

    saved_rename = torch.utils.rename_privateuse1_backend
    saved_register = torch._register_device_module
    torch.utils.rename_privateuse1_backend = lambda name: None
    # torch.autocast(device_type=t.device.type), which Hugging Face's rotary embeddings run on
    # torchax tensors, looks up the device module by the backend's name: register one under the
    # unrenamed name that autocast accepts and that says it is not available, so torch's own
    # device discovery (torch.distributed.checkpoint's writer, say) never picks it.
    torch._register_device_module = lambda name, module: (
        None if hasattr(torch, "privateuseone") else saved_register("privateuseone", _autocast_only_module()))
    try:
        yield
    finally:
        torch.utils.rename_privateuse1_backend = saved_rename
        torch._register_device_module = saved_register


def _autocast_only_module():
    """A device module for ``torch.privateuseone``: what ``torch.autocast`` needs, and not available."""
    import types

    import torch
    mod = types.ModuleType("xla_swap_torchax_device")
    mod.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
    mod.is_available = lambda: False
    mod.device_count = lambda: 0
    mod._is_in_bad_fork = lambda: False
    return mod


def import_torchax():
    """``torchax``, imported without registering the ``jax`` PrivateUse1 backend with torch.

    Returns: the ``torchax`` module.

    Raises:
      ImportError: torchax is not installed (it ships with torch_xla; ``pip install torchax``).
    """
    mod = sys.modules.get("torchax")
    if mod is not None:
        return mod
    with _LOCK:
        mod = sys.modules.get("torchax")
        if mod is not None:
            return mod
        try:
            import importlib.util
            found = importlib.util.find_spec("torchax") is not None
        except ValueError:  # pragma: no cover - a broken half-imported module
            found = False
        if not found:
            raise ImportError("xla_swap.stack needs torchax (it ships with torch_xla; or `pip install torchax`)")
        with _without_device_registration():
            import torchax
            import torchax.tensor
        _report_privateuse1_device(torchax.tensor.Tensor)
        _report_view_device()
        return torchax


def _report_view_device() -> None:
    """torchax's views (``torchax.view.View``: what an in-place op on a slice gives, and its reads) report
    ``torch.device("jax:0")`` as its tensors do: the same unrenamed name, ``privateuseone:0``, as
    :func:`_report_privateuse1_device` gives the tensors (a model reading ``x.device`` of a view, xLSTM's
    ``query.device``, then gets a device torch can parse)."""
    import torch
    try:
        from torchax.view import View
    except ImportError:   # a torchax without views
        return
    if torch._C._get_privateuse1_backend_name() == "privateuseone":
        View.device = property(lambda self: torch.device("privateuseone", 0))


def _report_privateuse1_device(tensor_cls) -> None:
    """torchax tensors report ``torch.device("jax:0")``, a name that exists only after the rename;
    without it they report the same device by its unrenamed name, ``privateuseone:0`` (which
    torchax's dispatch already returns for ``prim.device`` and its environment accepts).

    A torchax tensor is a wrapper on the ``meta`` device for torch's C++ code, so a composite op
    that changes a dtype (``softmax(x, dtype=torch.float32)`` on a bf16 ``x``, as MoE routers
    do) asks for a copy to ``meta``; ``Environment._is_same_device`` takes that for the tensor's own
    device only when the tensor reports ``jax``, and would otherwise copy a traced array to the
    host (``TracerArrayConversionError``). It is told the same of ``privateuseone``."""
    import torch
    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        return
    tensor_cls.device = property(lambda self: torch.device("privateuseone", 0))
    from torchax.tensor import Environment
    same = Environment._is_same_device

    def _is_same_device(self, the_tensor, new_device):
        if new_device == "meta" and isinstance(the_tensor, tensor_cls):
            return True
        return same(self, the_tensor, new_device)

    Environment._is_same_device = _is_same_device


def torch_accelerator_taken() -> str | None:
    """The PrivateUse1 backend name if one is registered with torch in this process, else ``None``.

    A registered PrivateUse1 backend is the accelerator torch's autograd engine and FSDP2 use;
    ``"jax"`` means torchax was imported before :func:`import_torchax` could isolate it.
    """
    import torch
    name = torch._C._get_privateuse1_backend_name()
    return None if name == "privateuseone" else name


def override_op(env, op, impl) -> None:
    """Make torchax's environment ``env`` run the torch function ``impl`` (torch tensors in and out,
    no ``env`` argument) for the torch op or function ``op``.

    Wraps ``torchax.tensor.Environment.override_op_definition``; in torchax 0.0.6 that method
    builds an ``ops_registry.Operator`` without its ``is_view_op`` field and raises
    ``TypeError``, so the operator is then put into the environment's private ``_ops`` table
    itself, as that method does. Verified on torchax 0.0.6 (torch 2.9).

    Raises: MissingUpstreamAPI: neither way exists in the installed torchax.
    """
    try:
        env.override_op_definition(op, impl)
        return
    except TypeError:
        pass
    from xla_swap._compat import MissingUpstreamAPI
    try:
        from torchax.ops import ops_registry
        table = env._ops
    except (ImportError, AttributeError) as e:  # pragma: no cover - another torchax
        raise MissingUpstreamAPI("torchax Environment._ops / torchax.ops.ops_registry.Operator") from e
    table[op] = ops_registry.Operator(op, impl, is_jax_function=False, is_user_defined=True, needs_env=False,
                                      is_view_op=False)
