"""The torch <-> jax bridge of the torch entry point: tensors and functions.

* **Tensors.** :func:`to_numpy` / :func:`to_torch` copy through the host (``bfloat16`` as
  ``ml_dtypes.bfloat16``); :func:`inputs_to_jax` / :func:`output_to_torch` hand CUDA tensors to
  jax and back through DLPack (no copy through the host), split over or assembled from several
  local GPUs by peer-to-peer copies, laid out where the runtime places them (:func:`tensor_pieces`
  says which piece goes to which device).
* **Functions.** :func:`module_fn` turns an ``nn.Module``'s ``forward`` into a JAX function of its
  weights with torchax (``torch.func.functional_call`` under torchax's environment);
  :func:`torch_fn` does the same for a torch function of tensors (a loss).
* **Precision.** :func:`torch_matmul_precision`: torch's fp32 matmul setting as jax's name.

The module imports torch, jax and numpy; the torchax environment comes from the caller
(:func:`xla_swap.torch_attention.torchax_env`).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from xla_swap.index_checks import check_index_range

__all__ = ["torch_matmul_precision", "to_numpy", "to_torch", "inputs_to_jax", "tensor_pieces", "tensor_to_sharding",
           "output_to_torch", "module_fn", "torch_fn", "torch_dtype"]


#: torch's fp32 matmul setting -> ``jax.default_matmul_precision``: ``"ieee"`` (torch's default,
#: ``allow_tf32 = False``) runs fp32 contractions in full fp32, ``"tf32"`` at TensorFloat-32.
_JAX_PRECISION = {"ieee": "highest", "tf32": "tensorfloat32"}


def torch_matmul_precision() -> str:
    """jax's name for the fp32 matmul precision torch uses now on CUDA: ``"highest"`` or ``"tensorfloat32"``.

    Reads ``torch.backends.cuda.matmul.fp32_precision`` (torch >= 2.9; ``"none"`` defers to
    ``torch.backends.fp32_precision``, whose ``"none"`` is IEEE fp32), else
    ``torch.backends.cuda.matmul.allow_tf32``. ``torch.set_float32_matmul_precision("high")`` and
    ``"medium"`` both mean TF32 there (torch's cuBLAS path); ``"highest"`` means fp32. Contractions
    of bf16 / fp16 operands are unaffected in both libraries. XLA's CPU backend computes fp32
    contractions in fp32 either way.
    """
    m = torch.backends.cuda.matmul
    p = getattr(m, "fp32_precision", None)
    if p is None:
        return "tensorfloat32" if m.allow_tf32 else "highest"
    if p == "none":
        p = getattr(torch.backends, "fp32_precision", "none")
    return _JAX_PRECISION.get(p, "highest")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU numpy copy of a torch tensor; bfloat16 becomes ``ml_dtypes.bfloat16`` (jax's)."""
    t = t.detach().to("cpu")
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(jnp.bfloat16)
    return t.contiguous().numpy()


def to_torch(a) -> torch.Tensor:
    """A CPU torch tensor from a jax or numpy array (a copy).

    A jax array that spans devices of other processes (multi-process runs) is gathered first:
    a replicated one from this process's first shard, a sharded one with
    ``jax.experimental.multihost_utils.process_allgather`` (a collective: every process must
    call this, in the same order).
    """
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        if a.is_fully_replicated:
            a = a.addressable_shards[0].data
        else:
            from jax.experimental import multihost_utils
            a = multihost_utils.process_allgather(a, tiled=True)
    a = np.asarray(a)
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _cuda_of(d: jax.Device) -> torch.device:
    """The torch CUDA device of a jax GPU device (same process, same ``CUDA_VISIBLE_DEVICES``)."""
    return torch.device("cuda", d.local_hardware_id)


def tensor_pieces(shape: tuple, sharding) -> list[tuple[jax.Device, tuple]]:
    """Where a tensor of ``shape`` goes under ``sharding``: ``[(device, index), ...]``, one per addressable
    device, ``index`` (a tuple of slices) the piece of the tensor that device holds (the whole tensor on
    each device of a replicated sharding, a block of rows on each of a split one)."""
    return list(sharding.addressable_devices_indices_map(tuple(shape)).items())


def tensor_to_sharding(t: torch.Tensor, sharding, put: Callable) -> jax.Array:
    """``t`` as a jax array laid out as ``sharding``: each device's piece (:func:`tensor_pieces`) handed to
    ``put(piece, device) -> single-device jax.Array`` and the pieces assembled, never gathered onto one
    device first (:func:`_cuda_to_jax` puts CUDA pieces by peer-to-peer copies and DLPack)."""
    pieces = [put(t[index], d) for d, index in tensor_pieces(tuple(t.shape), sharding)]
    if len(sharding.device_set) == 1:
        return pieces[0]
    return jax.make_array_from_single_device_arrays(tuple(t.shape), sharding, pieces)


def _cuda_put(piece: torch.Tensor, d: jax.Device) -> jax.Array:
    """A CUDA tensor's ``piece`` on jax GPU device ``d``: copied there by torch (peer to peer: NVLink or PCIe,
    no host) when it lives on another GPU, then shared through DLPack (no copy). DLPack export runs under
    ``torch.cuda.device(piece.device)``: torch refuses to export a tensor of another device than the
    current one, and jax's client set-up may change it."""
    dev = _cuda_of(d)
    piece = piece.to(dev, non_blocking=True).contiguous()
    with torch.cuda.device(dev):
        return jax.dlpack.from_dlpack(piece)


def _cuda_to_jax(t: torch.Tensor, sharding=None) -> jax.Array:
    """A CUDA tensor as a jax array laid out as ``sharding`` (``None``: on its own GPU), with no copy through the host.

    A piece already on its device is shared through DLPack; the others are copied by torch peer to peer
    (:func:`tensor_to_sharding`, :func:`_cuda_put`): jax's own resharding of a one-GPU array went through
    a much slower path (docs/explanation/history.md, "CUDA inputs on several GPUs").
    """
    if sharding is None:
        with torch.cuda.device(t.device):
            return jax.dlpack.from_dlpack(t)
    return tensor_to_sharding(t, sharding, _cuda_put)


def _as_int32(t: torch.Tensor, lo_hi: tuple | None) -> torch.Tensor:
    """An int64 tensor as int32 unless jax runs with x64 (token ids); other tensors as they are.

    ``lo_hi``: the tensor's ``(min, max)`` when already read (by the index check), else read here.
    Raises: ValueError: it holds values outside int32 with ``jax_enable_x64`` off.
    """
    if t.dtype == torch.int64 and not jax.config.jax_enable_x64:
        if lo_hi is None and t.numel():
            lo_hi = torch.stack(torch.aminmax(t.detach())).tolist()
        if lo_hi is not None and (lo_hi[1] > np.iinfo(np.int32).max or lo_hi[0] < np.iinfo(np.int32).min):
            raise ValueError("an int64 input holds values outside int32; enable jax x64 to pass it")
        t = t.to(torch.int32)
    return t


def output_to_torch(a, device: torch.device | None) -> torch.Tensor:
    """A runtime output as a torch tensor: on the CUDA ``device`` when given and the array lives on
    GPUs (through DLPack; an array split over several local GPUs is assembled on ``device`` by
    peer-to-peer copies, never through the host), else a CPU copy.

    A copy between GPUs reads a buffer jax owns, which jax may reuse once the array is dropped
    (it does not see torch's streams), so the devices involved are synchronised before returning
    (only where such a copy ran: an output on ``device`` itself is shared, not copied).
    """
    if device is not None and isinstance(a, jax.Array) and a.sharding.memory_kind in (None, "device") \
            and a.is_fully_addressable and all(d.platform == "gpu" for d in a.devices()):
        if len(a.devices()) == 1 or a.is_fully_replicated:
            sh = next((s for s in a.addressable_shards if _cuda_of(s.device) == device), a.addressable_shards[0])
            src = _cuda_of(sh.device)
            with torch.cuda.device(src):
                t = torch.from_dlpack(sh.data)
            if src == device:
                return t
            out = t.to(device)
            torch.cuda.synchronize(src)
            torch.cuda.synchronize(device)
            return out
        out, done, used = None, set(), {device}
        for sh in a.addressable_shards:
            key = tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in sh.index)
            if key in done:
                continue
            done.add(key)
            src = _cuda_of(sh.device)
            used.add(src)
            with torch.cuda.device(src):
                piece = torch.from_dlpack(sh.data)
            if out is None:
                out = torch.empty(a.shape, dtype=piece.dtype, device=device)
            out[sh.index].copy_(piece)
        for d in used:
            torch.cuda.synchronize(d)
        return out
    return to_torch(a)


def inputs_to_jax(x, what: str, placement: Callable | None = None, bounds: dict | None = None):
    """A torch tensor, or a tuple/list of them, as jax / numpy arrays (same structure; a tensor stays one leaf).

    ``placement``: ``(avals) -> shardings``, given the tuple of every tensor's ``jax.ShapeDtypeStruct`` (as
    converted: int64 as int32 without x64) and returning one sharding per tensor: where the runtime places
    it. CUDA tensors (on any local GPU) are laid out so (:func:`tensor_to_sharding`; without ``placement``
    they stay on their own GPU); CPU tensors become numpy arrays (the runtime copies them to the devices).
    ``bounds``: ``{position: (name, size[, ignore_index[, what]])}``: the tensor at that position (0 for a
    lone tensor) is checked by :func:`xla_swap.index_checks.check_index_range` (module docstring there: cost).

    Raises: TypeError: ``x`` is not a tensor or a non-empty tuple of them (the message names ``what``);
      IndexError: a checked tensor holds an index out of its range; ValueError: an int64 tensor holds
      values outside int32 with ``jax_enable_x64`` off.
    """
    single = isinstance(x, torch.Tensor)
    if not (single or (isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x))):
        raise TypeError(f"{what} must be a torch.Tensor or a non-empty tuple of torch.Tensors, got {type(x).__name__}")
    xs = (x,) if single else tuple(x)
    # every index check before any tensor is converted; its min/max read also serves the int32 check
    ranges = {i: check_index_range(xs[i], *b) for i, b in sorted((bounds or {}).items()) if i < len(xs)}
    xs = tuple(_as_int32(t, ranges.get(i)).detach() for i, t in enumerate(xs))
    shardings = (None,) * len(xs)
    if placement is not None and any(t.device.type == "cuda" for t in xs):
        shardings = tuple(placement(tuple(jax.ShapeDtypeStruct(tuple(t.shape), to_numpy(torch.empty(0, dtype=t.dtype)).dtype)
                                          for t in xs)))
    out = tuple(_cuda_to_jax(t.contiguous(), sh) if t.device.type == "cuda" else to_numpy(t)
                for t, sh in zip(xs, shardings))
    return out[0] if single else out


def module_fn(mod: torch.nn.Module, env, transposed: frozenset = frozenset(), padding_rows: dict | None = None):
    """``f(states, args, kwargs) -> outputs``: ``mod.forward`` as a JAX function of its weights (torchax).

    The weights named in ``transposed`` arrive in the host layout ``[in, out]`` and are handed
    to the module as their transpose (``[out, in]``, ``nn.Linear``'s); XLA folds the
    transpose into the matmul (its ``TransposeFolding`` pass), which then contracts like
    ``h @ w``. ``padding_rows`` (``{name: row}``, an ``nn.Embedding``'s ``padding_idx``): that row
    of the weight gets no gradient from this module, as torch's embedding backward gives
    (torchax's does not exclude it); values are unchanged.
    """
    def f(states, args, kwargs=None):
        if padding_rows:
            states = dict(states)
            for n, row in padding_rows.items():
                v = states[n]
                is_pad = (jnp.arange(v.shape[0]) == row)[:, None]
                states[n] = jnp.where(is_pad, jax.lax.stop_gradient(v), v)
        if transposed:
            states = {n: (jnp.swapaxes(v, 0, 1) if n in transposed else v) for n, v in states.items()}
        states, args, kwargs = env.j2t_iso((states, args, kwargs or {}))
        with env, _no_scalar_unwrap(env):
            res = torch.func.functional_call(mod, states, args, kwargs, tie_weights=False)
            return env.t2j_iso(res)
    return f


@contextlib.contextmanager
def _no_scalar_unwrap(env):
    """Turn off torchax's ``allow_mixed_math_with_scalar_tensor`` for the block: with it, torchax 0.0.6 takes
    ``.item()`` of any one-element *view* of its own tensors used as an index (``mask[batch_idx, kv_idx]``
    in ``transformers.masking_utils`` at batch 1), which fails while tracing."""
    cfg = env.config
    old = cfg.allow_mixed_math_with_scalar_tensor
    cfg.allow_mixed_math_with_scalar_tensor = False
    try:
        yield
    finally:
        cfg.allow_mixed_math_with_scalar_tensor = old


def torch_fn(fn: Callable, env):
    """A torch function of tensors as a JAX function of arrays (torchax)."""
    def f(*args):
        args = env.j2t_iso(args)
        with env:
            res = fn(*args)
            return env.t2j_iso(res)
    return f


def torch_dtype(dt) -> torch.dtype:
    """torch's dtype of a numpy / jax dtype (``bfloat16`` included)."""
    dt = np.dtype(dt)
    if dt == jnp.bfloat16:
        return torch.bfloat16
    return torch.from_numpy(np.zeros(0, dt)).dtype
