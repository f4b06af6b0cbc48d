"""The torch <-> jax bridge of the torch entry point: tensors and functions.

* **Tensors.** :func:`to_numpy` / :func:`to_torch` copy through the host (``bfloat16`` as
  ``ml_dtypes.bfloat16``); :func:`inputs_to_jax` / :func:`output_to_torch` hand CUDA tensors to
  jax and back through DLPack (no copy through the host), split over or assembled from several
  local GPUs by peer-to-peer copies, laid out where the runtime places them (:func:`tensor_pieces`
  says which piece goes to which device). With per-rank batches (:mod:`xla_swap.distributed`)
  :func:`local_to_global` makes this process's batch its rows of the global array and
  :func:`rank_rows_to_torch` gives an output's rows of this process back.
* **Functions.** :func:`module_fn` turns an ``nn.Module``'s ``forward`` into a JAX function of its
  weights with torchax (``torch.func.functional_call`` under torchax's environment);
  :func:`torch_fn` does the same for a torch function of tensors (a loss).
* **Precision.** :func:`torch_matmul_precision`: torch's fp32 matmul setting as jax's name.

The module imports torch, jax and numpy; the torchax environment comes from the caller
(:func:`xla_swap.stack.torch_attention.torchax_env`).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from xla_swap.stack.checks import check_index_range

__all__ = ["torch_matmul_precision", "to_numpy", "to_torch", "inputs_to_jax", "tensor_pieces", "tensor_to_sharding",
           "output_to_torch", "local_to_global", "rank_rows_to_torch", "module_fn", "torch_fn", "torch_dtype"]


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


def _on_gpus(a) -> bool:
    """Whether jax array ``a`` lives in GPU device memory (its addressable devices are GPUs)."""
    return isinstance(a, jax.Array) and a.sharding.memory_kind in (None, "device") and \
        all(s.device.platform == "gpu" for s in a.addressable_shards)


def _assemble(shape: tuple, parts: list, device: torch.device | None) -> torch.Tensor:
    """A torch tensor of ``shape`` from ``parts`` ``[(dst index, single-device jax array, src index), ...]``
    (``out[dst] = data[src]``): on the CUDA ``device`` by peer-to-peer copies (DLPack, never through the
    host; the GPUs involved synchronised before returning: jax may reuse a buffer once the array is
    dropped), else on the CPU."""
    if device is None:
        out = None
        for dst, data, src in parts:
            piece = np.asarray(data)[src]
            if out is None:
                out = np.empty(shape, piece.dtype)
            out[dst] = piece
        return to_torch(out)
    out, used = None, {device}
    for dst, data, src in parts:
        s = _cuda_of(next(iter(data.devices())))
        used.add(s)
        with torch.cuda.device(s):
            piece = torch.from_dlpack(data)[src]
        if out is None:
            out = torch.empty(shape, dtype=piece.dtype, device=device)
        out[dst].copy_(piece)
    for d in used:
        torch.cuda.synchronize(d)
    return out


def _box(index: tuple, shape: tuple) -> tuple:
    """A device's ``index`` (tuple of slices) into an array of ``shape`` as ``((start, stop), ...)`` per dimension."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def output_to_torch(a, device: torch.device | None) -> torch.Tensor:
    """A runtime output as a torch tensor: on the CUDA ``device`` when given and the array lives on
    GPUs (through DLPack; an array split over several local GPUs is assembled on ``device`` by
    peer-to-peer copies, never through the host), else a CPU copy.

    A copy between GPUs reads a buffer jax owns, which jax may reuse once the array is dropped
    (it does not see torch's streams), so the devices involved are synchronised before returning
    (only where such a copy ran: an output on ``device`` itself is shared, not copied).
    """
    if device is not None and _on_gpus(a) and a.is_fully_addressable:
        if len(a.devices()) == 1 or a.is_fully_replicated:
            sh = next((s for s in a.addressable_shards if _cuda_of(s.device) == device), a.addressable_shards[0])
            if _cuda_of(sh.device) == device:
                with torch.cuda.device(device):
                    return torch.from_dlpack(sh.data)
            return _assemble(a.shape, [((), sh.data, ())], device)
        parts, done = [], set()
        for sh in a.addressable_shards:
            key = _box(sh.index, a.shape)
            if key not in done:
                done.add(key)
                parts.append((sh.index, sh.data, ()))
        return _assemble(a.shape, parts, device)
    return to_torch(a)


def _process_boxes(sharding, shape: tuple) -> dict:
    """``{process index: {box, ...}}``: the boxes (:func:`_box`) every process's devices hold of an array of
    ``shape`` under ``sharding`` (read from every device's index: the same answer on every process)."""
    boxes: dict = {}
    for d, index in sharding.devices_indices_map(tuple(shape)).items():
        boxes.setdefault(d.process_index, set()).add(_box(index, shape))
    return boxes


def _own_block(p: int, n: int) -> tuple[int, int]:
    """Process ``p``'s rows ``[lo, hi)`` of a leading dimension ``n`` split over the processes in order."""
    m = n // jax.process_count()
    return p * m, (p + 1) * m


def _clipped(box: tuple, lo: int, hi: int) -> tuple | None:
    """``box`` with its leading dimension clipped to ``[lo, hi)`` (``None`` when nothing is left)."""
    a, b = max(box[0][0], lo), min(box[0][1], hi)
    return ((a, b),) + tuple(box[1:]) if a < b else None


def _holds_own_rows(sharding, shape: tuple) -> bool:
    """Whether every process's devices hold all of its own block of rows (:func:`_own_block`)."""
    boxes = _process_boxes(sharding, shape)
    block = (shape[0] // jax.process_count()) * int(np.prod(shape[1:], dtype=np.int64))
    for p in range(jax.process_count()):
        clipped = {c for b in boxes.get(p, ()) if (c := _clipped(b, *_own_block(p, shape[0]))) is not None}
        if sum(int(np.prod([hi - lo for lo, hi in c], dtype=np.int64)) for c in clipped) != block:
            return False
    return True


def local_to_global(t: torch.Tensor, sharding) -> jax.Array:
    """This process's batch ``t`` (CPU or CUDA, leading dimension ``b``) as its rows of the global array
    ``[processes x b, ...]`` (the processes' batches concatenated in process order) laid out as ``sharding``.

    Where every device holds rows of its own process's block only (a batch split over the devices in
    process order), each device gets its piece of ``t`` (CUDA pieces by peer-to-peer copies and DLPack);
    otherwise (a replicated layout, a batch that does not split over the local devices) every process's
    batch is gathered through the host first (``process_allgather``: a collective, taken on every process
    alike since the choice reads every device's index).
    """
    r, b = jax.process_index(), t.shape[0]
    shape = (jax.process_count() * b,) + tuple(t.shape[1:])
    if all(lo <= box[0][0] and box[0][1] <= hi for p, boxes in _process_boxes(sharding, shape).items()
           for lo, hi in [_own_block(p, shape[0])] for box in boxes):
        put = _cuda_put if t.device.type == "cuda" else _cpu_put
        pieces = []
        for d, index in tensor_pieces(shape, sharding):
            lo, hi = _box(index, shape)[0]
            pieces.append(put(t[(slice(lo - r * b, hi - r * b),) + tuple(index[1:])], d))
        if len(sharding.device_set) == 1:
            return pieces[0]
        return jax.make_array_from_single_device_arrays(shape, sharding, pieces)
    from jax.experimental import multihost_utils
    whole = to_torch(multihost_utils.process_allgather(to_numpy(t), tiled=True))
    return tensor_to_sharding(whole, sharding, _cpu_put)


def rank_rows_to_torch(a, device: torch.device | None) -> torch.Tensor:
    """This process's rows of a global runtime output ``a`` (per-rank batches: process ``p`` gets rows
    ``[p x m, (p + 1) x m)`` of its leading dimension ``processes x m``), as :func:`output_to_torch` gives
    a tensor (on the CUDA ``device`` when given and ``a`` lives on GPUs, else the CPU). Taken from this
    process's own devices where they hold those rows; otherwise gathered (a collective, taken on every
    process alike). An output whose leading dimension does not split over the processes (a scalar) is
    given whole."""
    w = jax.process_count()
    if not isinstance(a, jax.Array) or w == 1 or a.ndim == 0 or a.shape[0] % w:
        return output_to_torch(a, device)
    lo, hi = _own_block(jax.process_index(), a.shape[0])
    device = device if _on_gpus(a) else None
    if not _holds_own_rows(a.sharding, a.shape):
        whole = to_torch(a)[lo:hi]
        return whole if device is None else whole.to(device)
    parts, done = [], set()
    for sh in a.addressable_shards:
        box = _box(sh.index, a.shape)
        c = _clipped(box, lo, hi)
        if c is None or c in done:
            continue
        done.add(c)
        dst = (slice(c[0][0] - lo, c[0][1] - lo),) + tuple(slice(x, y) for x, y in c[1:])
        src = (slice(c[0][0] - box[0][0], c[0][1] - box[0][0]),) + tuple(slice(x - bx, y - bx) for (x, y), (bx, _) in
                                                                        zip(c[1:], box[1:]))
        parts.append((dst, sh.data, src))
    return _assemble((hi - lo,) + tuple(a.shape[1:]), parts, device)


def _jax_dtype(dtype: torch.dtype) -> np.dtype:
    """jax's (numpy's) dtype of a torch dtype (``bfloat16`` as ``ml_dtypes.bfloat16``)."""
    return to_numpy(torch.empty(0, dtype=dtype)).dtype


def _checked_inputs(x, what: str, bounds: dict | None) -> tuple[bool, tuple]:
    """``(single, tensors)`` of :func:`inputs_to_jax`'s ``x``: checked, detached, int64 as int32 without x64."""
    single = isinstance(x, torch.Tensor)
    if not (single or (isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x))):
        raise TypeError(f"{what} must be a torch.Tensor or a non-empty tuple of torch.Tensors, got {type(x).__name__}")
    xs = (x,) if single else tuple(x)
    # every index check before any tensor is converted; its min/max read also serves the int32 check
    ranges = {i: check_index_range(xs[i], *b) for i, b in sorted((bounds or {}).items()) if i < len(xs)}
    return single, tuple(_as_int32(t, ranges.get(i)).detach() for i, t in enumerate(xs))


def inputs_to_jax(x, what: str, placement: Callable | None = None, bounds: dict | None = None,
                  per_rank: bool = False):
    """A torch tensor, or a tuple/list of them, as jax / numpy arrays (same structure; a tensor stays one leaf).

    ``placement``: ``(avals) -> shardings``, given the tuple of every tensor's ``jax.ShapeDtypeStruct`` (as
    converted: int64 as int32 without x64) and returning one sharding per tensor: where the runtime places
    it. CUDA tensors (on any local GPU) are laid out so (:func:`tensor_to_sharding`; without ``placement``
    they stay on their own GPU); CPU tensors become numpy arrays (the runtime copies them to the devices).
    ``bounds``: ``{position: (name, size[, ignore_index[, what]])}``: the tensor at that position (0 for a
    lone tensor) is checked by :func:`xla_swap.stack.checks.check_index_range` (module docstring there: cost).
    ``per_rank`` (per-rank batches, :mod:`xla_swap.distributed`; needs ``placement``): ``x`` is this
    process's batch; each tensor becomes its rows of the global array (:func:`local_to_global`), placed
    as ``placement`` places the global avals. A collective: every process calls it (every process's
    checks end in one exchange, so that a refusal anywhere raises everywhere instead of leaving the
    others waiting).

    Raises: TypeError: ``x`` is not a tensor or a non-empty tuple of them (the message names ``what``);
      IndexError: a checked tensor holds an index out of its range; ValueError: an int64 tensor holds
      values outside int32 with ``jax_enable_x64`` off; with ``per_rank``, a 0-d tensor, another process
      refused its own or passes other shapes or dtypes (:func:`xla_swap.distributed.check_ranks_agree`).
    """
    if per_rank:
        return _per_rank_inputs(x, what, placement, bounds)
    single, xs = _checked_inputs(x, what, bounds)
    shardings = (None,) * len(xs)
    if placement is not None and any(t.device.type == "cuda" for t in xs):
        shardings = tuple(placement(tuple(jax.ShapeDtypeStruct(tuple(t.shape), _jax_dtype(t.dtype)) for t in xs)))
    out = tuple(_cuda_to_jax(t.contiguous(), sh) if t.device.type == "cuda" else to_numpy(t)
                for t, sh in zip(xs, shardings))
    return out[0] if single else out


def _per_rank_inputs(x, what: str, placement: Callable, bounds: dict | None):
    """:func:`inputs_to_jax` with ``per_rank``: the local checks, one exchange, then the global arrays."""
    from xla_swap.distributed import check_ranks_agree
    try:
        single, xs = _checked_inputs(x, what, bounds)
        flat = [i for i, t in enumerate(xs) if t.dim() == 0]
        if flat:
            raise ValueError(f"{what if single else f'{what}[{flat[0]}]'} is 0-d: with per-rank batches every "
                             "tensor's leading dimension is this rank's batch")
    except (TypeError, ValueError, IndexError):
        check_ranks_agree(what, None)
        raise
    check_ranks_agree(what, tuple((tuple(t.shape), str(t.dtype)) for t in xs))
    n = jax.process_count()
    avals = tuple(jax.ShapeDtypeStruct((n * t.shape[0],) + tuple(t.shape[1:]), _jax_dtype(t.dtype)) for t in xs)
    out = tuple(local_to_global(t.contiguous(), sh) for t, sh in zip(xs, placement(avals)))
    return out[0] if single else out


def _cpu_put(piece: torch.Tensor, d: jax.Device) -> jax.Array:
    """A CPU tensor's ``piece`` on jax device ``d`` (a host copy)."""
    return jax.device_put(to_numpy(piece), d)


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
