"""The torch entry point: train and serve a stack of ``nn.Module`` layers larger than device
memory, with weights, gradients and AdamW state in host memory.

    stack = SwappedStack(model.model.layers, first=embed, last=head,
                         optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4))
    loss = stack.train_step(input_ids, labels, loss_fn=torch.nn.functional.cross_entropy)
    logits = stack(input_ids)          # serving: torch tensors in and out
    stack.sync_modules()               # the trained weights back into the nn.Modules
    stack.save_checkpoint("ckpt/")     # weights, AdamW moments, step (torch.distributed.checkpoint)

Design (``docs/design.md``):

* **Bridge.** Each stage (``first``, every layer, ``last``) is turned into a JAX function by
  torchax (it ships with torch_xla and runs without it): the module's ``forward`` runs under
  torchax's environment inside ``torch.func.functional_call`` with the weights passed in,
  so unmodified modules (Hugging Face layers included) trace into one XLA executable per
  distinct stage. Layers with identical parameter names, shapes and dtypes share layer 0's
  function, so an L-layer stack compiles one forward and one backward executable. The
  weights are copied from the modules to host memory directly (never through the device).
* **Runtime.** The stages run in :class:`xla_swap.executors.StreamingRuntime`: each stage's
  weights live in their own ``pinned_host`` buffers and are streamed to the device
  ``prefetch_depth`` stages ahead, in the forward and again in the backward.
* **Optimizer.** With an optimizer (an :class:`xla_swap.planning.AdamW`, or a
  ``torch.optim.AdamW`` whose param groups are read at every step: schedulers and per-group
  weight decay work), each stage is updated on the device
  right after its backward: its moments come from ``pinned_host`` with its weights, and the
  new weights and moments go back. Gradients never leave the device; AdamW state never
  lives on it beyond the prefetch window. The update is ``torch.optim.AdamW``'s.
  Without an optimizer, ``train_step`` writes the gradients into the modules' ``.grad``.
* **Carry.** ``first(*inputs)`` returns the hidden state ``h``, or ``(h, layer_kwargs)``
  where ``layer_kwargs`` is a dict of tensors every layer gets as keyword arguments
  (attention mask, rotary ``position_embeddings``); each layer is called
  ``layer(h, **layer_kwargs)`` (a tuple result's first element is the new ``h``); ``last(h)``
  gives the output. Integer tensors (token ids) are constants: they get no gradient.
  Layers that get different keyword values (a sliding-window and a full mask) are told apart
  by ``first.layer_keys`` (one hashable key per layer) and ``first.select_layer_kwargs(key,
  layer_kwargs) -> kwargs``: layer ``i`` is then called with
  ``select_layer_kwargs(layer_keys[i], layer_kwargs)``, and only layers of one key share a
  compiled function (``xla_swap.hf.CausalLMFirst`` does this).

* **Release.** A stack holds its stage functions, its ``StreamingRuntime`` (executables,
  weights, optimizer state) and at most 8 converted loss functions; dropping it frees them (by
  reference counting). The modules are the caller's. What outlives it is listed in
  :mod:`xla_swap.executors.streaming` (jax's own bounded caches; ``benchmarks/leak_cycles.py``).

The module imports torch, torchax, jax and numpy; not torch_xla.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xla_swap.executors._stages import _check_input_dtypes
from xla_swap.executors.streaming import StreamingRuntime, remat_from_policy
from xla_swap.hf import causal_lm_stages  # noqa: F401  (re-exported: the entry point's splitter)
from xla_swap.planning.optimizer import AdamW
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.torch_attention import torchax_env

__all__ = ["SwappedStack", "causal_lm_stages", "DEFAULT_POLICY"]

log = logging.getLogger(__name__)

#: The policy used when none is given: weights, gradients and optimizer state in host
#: memory, each stage recomputed in the backward, two stages prefetched.
DEFAULT_POLICY = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=True, prefetch_depth=2)

_SHARD_RULES = ("fsdp", "replicate")


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


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU numpy copy of a torch tensor; bfloat16 becomes ``ml_dtypes.bfloat16`` (jax's)."""
    t = t.detach().to("cpu")
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(jnp.bfloat16)
    return t.contiguous().numpy()


def _to_torch(a) -> torch.Tensor:
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


def _cuda_to_jax(t: torch.Tensor, sharding=None) -> jax.Array:
    """A CUDA tensor as a jax array, with no copy through the host.

    Without ``sharding`` (or with one of a single device) the tensor itself is shared through
    DLPack. With a sharding over several local GPUs each device's piece is copied by torch
    (peer to peer: NVLink or PCIe, no host) to that GPU, shared through DLPack, and the pieces
    assembled with ``jax.make_array_from_single_device_arrays``: jax's own resharding of a
    one-GPU array went through a much slower path (on 2 H200s the input of the data-parallel
    forward took 113 ms for 128 MiB; ``benchmarks/README.md``, "The torch entry point on N GPUs").
    DLPack export runs under ``torch.cuda.device(piece.device)``: torch refuses to export a
    tensor of another device than the current one, and jax's client set-up may change it.
    """
    if sharding is None or len(sharding.device_set) == 1:
        with torch.cuda.device(t.device):
            return jax.dlpack.from_dlpack(t)
    pieces = []
    for d, index in sharding.addressable_devices_indices_map(tuple(t.shape)).items():
        dev = _cuda_of(d)
        piece = t[index].to(dev, non_blocking=True).contiguous()
        with torch.cuda.device(dev):
            pieces.append(jax.dlpack.from_dlpack(piece))
    return jax.make_array_from_single_device_arrays(tuple(t.shape), sharding, pieces)


def _input_to_jax(t: torch.Tensor, sharding_of: Callable | None = None):
    """An input tensor for the runtime; 64-bit integers become int32 unless jax runs with x64 (token ids).

    A CUDA tensor becomes a jax array on the GPUs (``_cuda_to_jax``, laid out as
    ``sharding_of(shape, dtype)`` says: the runtime's placement of its input); anything else
    becomes a numpy array (the runtime copies it to the devices).
    """
    if t.dtype == torch.int64 and not jax.config.jax_enable_x64:
        if t.numel() and (int(t.max()) > np.iinfo(np.int32).max or int(t.min()) < np.iinfo(np.int32).min):
            raise ValueError("an int64 input holds values outside int32; enable jax x64 to pass it")
        t = t.to(torch.int32)
    if t.device.type == "cuda":
        t = t.detach().contiguous()
        return _cuda_to_jax(t, sharding_of(tuple(t.shape), t.dtype) if sharding_of is not None else None)
    return _to_numpy(t)


def _out_to_torch(a, device: torch.device | None) -> torch.Tensor:
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
    return _to_torch(a)


def _inputs_to_jax(x, what: str, sharding_of: Callable | None = None):
    """A torch tensor, or a tuple/list of them, as jax / numpy arrays (same structure; a tensor stays one leaf)."""
    if isinstance(x, torch.Tensor):
        return _input_to_jax(x, sharding_of)
    if isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(_input_to_jax(t, sharding_of) for t in x)
    raise TypeError(f"{what} must be a torch.Tensor or a non-empty tuple of torch.Tensors, got {type(x).__name__}")


def _linear_weights(mod: torch.nn.Module) -> frozenset[str]:
    """Names (as in ``mod.named_parameters()``) of the 2-D ``weight`` of every ``nn.Linear`` in ``mod``."""
    names = set()
    for prefix, sub in mod.named_modules():
        w = getattr(sub, "weight", None) if isinstance(sub, torch.nn.Linear) else None
        if isinstance(w, torch.nn.Parameter) and w.dim() == 2:
            names.add(f"{prefix}.weight" if prefix else "weight")
    own = {n for n, _ in mod.named_parameters()}
    return frozenset(names & own)


def _embedding_padding_rows(mod: torch.nn.Module) -> dict[str, int]:
    """``{weight name: padding_idx}`` of every ``nn.Embedding`` in ``mod`` with a ``padding_idx``.

    Raises: ValueError naming the module for ``max_norm`` (the forward rewrites the weight),
    ``scale_grad_by_freq`` or ``sparse`` (gradients torchax does not compute like torch).
    """
    rows = {}
    for prefix, sub in mod.named_modules():
        if not isinstance(sub, torch.nn.Embedding):
            continue
        for attr in ("max_norm", "scale_grad_by_freq", "sparse"):
            if getattr(sub, attr, None):
                raise ValueError(f"{prefix or type(mod).__name__} ({type(sub).__name__}) uses {attr}: not supported")
        if sub.padding_idx is not None:
            rows[f"{prefix}.weight" if prefix else "weight"] = int(sub.padding_idx) % sub.num_embeddings
    return rows


def _module_fn(mod: torch.nn.Module, env, transposed: frozenset = frozenset(), padding_rows: dict | None = None):
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


def _torch_fn(fn: Callable, env):
    """A torch function of tensors as a JAX function of arrays (torchax)."""
    def f(*args):
        args = env.j2t_iso(args)
        with env:
            res = fn(*args)
            return env.t2j_iso(res)
    return f


def _torch_dtype(dt) -> torch.dtype:
    """torch's dtype of a numpy / jax dtype (``bfloat16`` included)."""
    dt = np.dtype(dt)
    if dt == jnp.bfloat16:
        return torch.bfloat16
    return torch.from_numpy(np.zeros(0, dt)).dtype


def _chunks(a: jax.Array, transposed: bool) -> list[tuple[tuple, tuple, Callable]]:
    """The distinct shards of ``a`` held by this process, in torch's layout: ``[(offsets, sizes,
    load)]`` where ``load()`` copies the shard into a CPU torch tensor (replicated shards once)."""
    out, seen = [], set()
    for sh in a.addressable_shards:
        start = tuple(s.start or 0 for s in sh.index)
        if start in seen:
            continue
        seen.add(start)
        sizes = tuple(sh.data.shape)

        def load(data=sh.data):
            t = _to_torch(data)
            return t.t().contiguous() if transposed else t
        out.append((start[::-1], sizes[::-1], load) if transposed else (start, sizes, load))
    return out


#: the torch optimizer's state key of each moment kind of ``SwappedStack._ckpt_layout``.
_MOMENT_KEYS = {"m": "exp_avg", "v": "exp_avg_sq", "step": "step"}


@contextlib.contextmanager
def _single_process_dcp():
    """Silence DCP's warnings that it runs in one process (``no_dist=True``: the stack's own choice) and
    that its writer calls the deprecated ``tensor.storage()``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # DCP's own writer calls it
        yield


def _streaming_save_planner(tensors: dict, objects: dict):
    """A ``torch.distributed.checkpoint`` save planner whose tensors are copied from the host
    buffers only when the writer asks for each one (``resolve_data``), one shard at a time.

    Args:
      tensors: ``{fqn: (global torch shape, torch dtype, [(offsets, sizes, load), ...])}``.
      objects: ``{fqn: picklable object}`` (saved as bytes).
    """
    import torch.distributed.checkpoint as dcp

    class StreamingSavePlanner(dcp.DefaultSavePlanner):
        def __init__(self, tensors: dict, objects: dict):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._tensors, self._objects = tensors, objects
            self._load = {}

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
            self.state_dict, self.is_coordinator = self._objects, is_coordinator

        def create_local_plan(self) -> dcp.SavePlan:
            from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
            from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
            items = []
            for fqn, (shape, dtype, chunks) in self._tensors.items():
                for offsets, sizes, load in chunks:
                    idx = MetadataIndex(fqn, torch.Size(offsets))
                    self._load[(fqn, tuple(offsets))] = load
                    items.append(WriteItem(
                        index=idx, type=WriteItemType.SHARD if len(chunks) > 1 else WriteItemType.TENSOR,
                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                               sizes=torch.Size(sizes)),
                                                    properties=TensorProperties(dtype=dtype), size=torch.Size(shape))))
            items += [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in self._objects]
            self.plan = dcp.SavePlan(items)
            return self.plan

        def resolve_data(self, write_item):
            from torch.distributed.checkpoint.planner import WriteItemType
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return self._load[(write_item.index.fqn, tuple(write_item.index.offset))]()

    return StreamingSavePlanner(tensors, objects)

def _signature(mod: torch.nn.Module) -> tuple:
    return (type(mod), tuple((n, tuple(t.shape), t.dtype) for n, t in mod.state_dict(keep_vars=True).items()))


def _layer_selection(first, n_layers: int):
    """``(keys, select)``: per layer, the key of its keyword arguments, and ``first.select_layer_kwargs`` (or
    ``None``: every layer gets the whole carry dict). TypeError unless ``first.layer_keys`` has one
    hashable key per layer."""
    select = getattr(first, "select_layer_kwargs", None)
    if select is None:
        return [None] * n_layers, None
    keys = list(getattr(first, "layer_keys", ()))
    if len(keys) != n_layers or not callable(select):
        raise TypeError(f"first.select_layer_kwargs needs first.layer_keys with one key per layer ({n_layers}), "
                        f"got {len(keys)}")
    return keys, select


#: prefix of the carry keys that hold a weight shared by ``first`` and ``last`` (``SwappedStack.tied``).
_TIED = "xla_swap.tied:"


def _split_carry(out, stage: str):
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict):
        return out[0], dict(out[1])
    if isinstance(out, (tuple, list)):
        raise TypeError(f"{stage} must return a tensor or (tensor, dict of layer keyword tensors), "
                        f"got a {type(out).__name__} of length {len(out)}")
    return out, {}


def _check_calibration_arg(calibration) -> None:
    """``calibration`` must be ``None``, a ``Calibration`` or a callable; raises TypeError naming it."""
    from xla_swap.executors.calibrate import Calibration
    if calibration is not None and not isinstance(calibration, Calibration) and not callable(calibration):
        raise TypeError(f"calibration must be a Calibration, a callable (runtime, h) -> Calibration or None, "
                        f"got {type(calibration).__name__}")


def _meta_tensor(modules, names) -> str | None:
    """The name (``stage.tensor``) of the first parameter or buffer of ``modules`` on the meta device, or ``None``."""
    for stage, m in zip(names, modules):
        for n, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.is_meta:
                return f"{stage}.{n}"
    return None


def _stage_tensors(stage: str, mod: torch.nn.Module, pnames: list, weights) -> dict:
    """The buffers and the parameters ``pnames`` of one stage as torch tensors (buffers first): the
    module's own, or what ``weights(mod, names)`` gives (checked: every name once, the module's shapes).

    Raises: ValueError naming the stage and tensor: a name missing from or unexpected in what
      ``weights`` gave, or a tensor of another shape. TypeError: a value that is not a tensor.
    """
    own = {**dict(mod.named_buffers()), **dict(mod.named_parameters())}
    want = [n for n, _ in mod.named_buffers()] + list(pnames)
    if weights is None:
        return {n: own[n] for n in want}
    got = weights(mod, list(want))
    if not isinstance(got, dict):
        raise TypeError(f"weights({stage}, names) must return a dict {{name: torch.Tensor}}, got {type(got).__name__}")
    missing, extra = [n for n in want if n not in got], sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(f"weights gave {stage} {len(missing)} tensors too few {missing[:4]} and "
                         f"{len(extra)} unexpected {extra[:4]}")
    for n in want:
        t = got[n]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights: {stage}.{n} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(own[n].shape) or t.is_meta:
            raise ValueError(f"weights: {stage}.{n} has shape {list(t.shape)}{' on meta' if t.is_meta else ''}, the "
                             f"module's has {list(own[n].shape)}")
    return {n: got[n] for n in want}


def _mixed_precision(param_dtype, mp_policy, n_devices: int) -> tuple[torch.dtype | None, bool]:
    """``(compute dtype or None, cast floating inputs)`` of ``SwappedStack``'s ``param_dtype`` /
    ``mp_policy`` arguments, checked (no state changes).

    Raises: TypeError / ValueError naming the argument or the ``mp_policy`` field not honoured.
    """
    if mp_policy is None:
        dtype, cast_inputs = param_dtype, True
        what = "param_dtype"
    else:
        if param_dtype is not None:
            raise ValueError("give either param_dtype or mp_policy, not both")
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy
        except ImportError:  # torch built without distributed
            MixedPrecisionPolicy = None
        if MixedPrecisionPolicy is None or not isinstance(mp_policy, MixedPrecisionPolicy):
            raise TypeError("mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
                            f"got {type(mp_policy).__name__}")
        dtype, cast_inputs = mp_policy.param_dtype, bool(mp_policy.cast_forward_inputs)
        what = "mp_policy.param_dtype"
        if mp_policy.output_dtype is not None:
            raise ValueError(f"mp_policy.output_dtype={mp_policy.output_dtype} is not implemented: the stack "
                             "returns the last stage's output as it computes it (leave output_dtype=None)")
        red = mp_policy.reduce_dtype
        if red is not None and red != dtype and not (red == torch.float32 and n_devices == 1):
            raise ValueError(f"mp_policy.reduce_dtype={red} is not implemented: gradients are reduced in "
                             f"param_dtype ({dtype}); reduce_dtype=torch.float32 is honoured on one device only "
                             "(no reduction: the bf16 gradient's cast to the fp32 master is exact)")
    if dtype is None:
        return None, cast_inputs
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what} must be a torch.dtype or None, got {type(dtype).__name__}")
    if dtype != torch.bfloat16:
        raise ValueError(f"{what} must be torch.bfloat16 or None, got {dtype}: float16 compute needs loss "
                         "scaling, which the stack does not implement")
    return dtype, cast_inputs


def _is_float(dt) -> bool:
    return jnp.issubdtype(dt, jnp.floating)


def _cast_floats(tree, dtype):
    """``tree`` with its floating leaves cast to ``dtype`` (others unchanged)."""
    return jax.tree_util.tree_map(lambda v: v.astype(dtype) if _is_float(v.dtype) else v, tree)


def _compute_in(fn: Callable, pnames: frozenset, dtype, cast_inputs: bool) -> Callable:
    """``fn(w, h)`` computing with its floating parameters (the names in ``pnames``; buffers stay
    as held) cast to ``dtype`` inside the stage, and with ``cast_inputs`` the floating leaves of
    ``h`` too: the gradient w.r.t. the held (master) parameter is the cast's transpose of the
    gradient w.r.t. the cast copy, in the master's dtype."""
    def stage(w, h):
        w = {n: (_round_to(v, dtype) if n in pnames and _is_float(v.dtype) else v) for n, v in w.items()}
        return fn(w, _cast_floats(h, dtype) if cast_inputs else h)
    return stage


def _round_to(v, dtype):
    """``v.astype(dtype)``, rounded by ``reduce_precision`` first: XLA's CPU backend computes bf16 dots in
    f32 and, allowed excess precision, drops an f32 -> bf16 -> f32 convert pair, which would hand the dot
    the unrounded master; ``reduce_precision`` is kept. Its transpose rounds the cotangent, which the
    convert's transpose already gives in ``dtype``: the gradient is unchanged."""
    fi = jnp.finfo(dtype)
    return jax.lax.reduce_precision(v, exponent_bits=fi.nexp, mantissa_bits=fi.nmant).astype(dtype)


class SwappedStack:
    """A stack of torch layers whose weights, gradients and optimizer state live in host memory.

    Args:
      layers: a non-empty sequence of ``torch.nn.Module`` (e.g. ``model.model.layers`` of a
        Hugging Face decoder, unmodified). Called ``layer(h, **layer_kwargs)``.
      first: optional module run before the layers on the user's inputs, e.g. the embedding:
        ``first(*inputs) -> h`` or ``(h, layer_kwargs)`` (see the module docstring). Without
        it, the first input is ``h``.
      last: optional module run after the layers, e.g. final norm and LM head: ``last(h) -> out``.
      policy: an :class:`xla_swap.planning.OffloadPolicy` (default ``DEFAULT_POLICY``):
        ``params`` host/device, ``grads``, ``optimizer_state``, ``remat``, ``prefetch_depth``.
        Not together with ``budget_bytes``.
      budget_bytes: instead of ``policy``: device memory (bytes) for the stack. With
        ``autotune=True`` (the default) it bounds everything the stack holds on the device
        (weights, optimizer state, activations, temporaries): the first ``forward`` or
        ``train_step`` measures the link and each layer on the device (a few calls: seconds)
        and switches to the schedule predicted fastest for the budget and that call's input
        shape (:meth:`autotune`; ``schedule`` then holds the choice), for a training step when
        there is an ``optimizer``, else for that call's mode. Until then every stage streams.
        With several devices the bytes are counted unsharded (the planner's logical bytes). With ``autotune=False`` it bounds weights and optimizer state only: stages
        are kept resident from the last one backwards while they fit beside the streaming
        window of ``prefetch_depth + 1`` stages (the last stages are the first the backward
        needs), at construction, and the rest are streamed.
      autotune: with ``budget_bytes``, choose the schedule from a measurement at the first
        call (default ``True``; see ``budget_bytes``). Without ``budget_bytes`` it does
        nothing (call :meth:`autotune` to choose for a budget).
      calibration: what :meth:`autotune` (the first call's choice included) chooses from instead of
        measuring: a callable ``(runtime, h) -> xla_swap.executors.calibrate.Calibration`` called
        with the stack's runtime and the call's input as the runtime sees it, e.g.
        ``functools.partial(xla_swap.executors.calibrate.calibration_from_figures, link=...,
        forward_s=..., backward_s=...)`` (figures measured elsewhere, or a test's: no clock read),
        or a ``Calibration`` of this stack's stages and input signature. Default ``None``: measure.
      fused_attention: on a GPU, run ``torch.nn.functional.scaled_dot_product_attention`` (what
        Hugging Face's ``sdpa`` attention calls) as cuDNN's fused attention
        (``xla_swap.torch_attention``; default ``True``). ``False``: XLA's unfused form, which
        materialises the ``[B, N, T, S]`` scores. Other platforms always run XLA's form.
      optimizer: ``None`` (``train_step`` fills ``.grad``), an ``xla_swap.planning.AdamW``, or
        a ``torch.optim.AdamW`` (or ``Adam``) over the stages' parameters: the lr, weight decay,
        betas and eps of each of its ``param_groups`` are read at every ``train_step`` and applied
        to that group's parameters as traced inputs of the per-layer update, so a
        ``torch.optim.lr_scheduler`` stepping it works unchanged (and never recompiles) and groups
        with other weight decay (none on norms and biases, as the Hugging Face Trainer builds
        them) are honoured. Its own state is not used: the moments live in
        ``runtime.optimizer_state`` and the step count in ``runtime.step``, so
        ``optimizer.state_dict()`` holds the groups but no moments: checkpoint with
        :meth:`save_checkpoint` / :meth:`state_dict`, which hold both. After each update its
        ``step()`` is called while none of its parameters has a ``.grad`` (a no-op on them that
        runs its step hooks and keeps a scheduler from warning that it stepped first).
        Parameters with ``requires_grad=False`` are not updated, as in torch.
      loss_fn: default ``loss_fn(output, *targets) -> scalar`` torch function for
        ``train_step`` (e.g. ``torch.nn.functional.cross_entropy``).
      devices: the ``jax`` devices to run on (default: ``jax.devices()``, all local devices).
      shard: with several devices: ``"fsdp"`` (default; each weight with >= 2 dimensions is
        split over all devices on its largest evenly divisible dimension, others replicated;
        each device keeps its shard in its own host memory), ``"replicate"``, or a callable
        ``(name, shape) -> tuple`` giving a ``PartitionSpec`` over the mesh axis ``"d"``.
      data_parallel: with several devices, split the activations' leading (batch or token)
        dimension over them (each device computes its part of the batch; XLA all-gathers
        each layer's weight shards on the device): FSDP / ZeRO-3 as torch users know it.
        Inputs whose leading dimension does not split evenly stay replicated. Default
        ``None``: on for ``shard="fsdp"``, off otherwise (tensor parallelism with a
        ``shard`` callable wants replicated activations).
      transpose_linear: hold every ``nn.Linear`` weight in host (and device) memory as
        ``[in, out]``, the transpose of torch's ``[out, in]`` (default ``True``). The stage hands
        the module the transpose, which XLA folds into the matmul: it then contracts like
        ``h @ w`` ("NN") instead of ``F.linear``'s "NT", which measured up to 9 % more compute
        per stage on an H100 (``benchmarks/results/torch_stack_cyclic/README.md``). Everything
        the user sees stays in torch's layout: ``shard`` callables get torch's shape and return
        torch's spec, ``state_dicts()``, ``sync_modules()`` and ``.grad`` are ``[out, in]``;
        only ``runtime.host_params`` and ``last_grads`` hold the names in ``transposed`` as
        ``[in, out]``.
      prefetch_depth: overrides ``policy.prefetch_depth`` when given.
      max_signatures: input shapes whose executables stay cached (serving several batch
        sizes and sequence lengths).
      offload_activations: in training, each layer's kept input goes to ``pinned_host`` during the
        forward and comes back ``prefetch_depth`` layers ahead in the backward (activation offload).
      accumulate_grads: without an optimizer, add each step's gradients to the modules'
        ``.grad`` (default; a host copy of every gradient per step). ``False`` leaves them in
        ``pinned_host`` as ``last_grads`` (one pytree of jax arrays per stage) instead.

      max_grad_norm: with an optimizer: clip the gradients at every update to this global 2-norm
        (over every trainable parameter of every stage, ``torch.nn.utils.clip_grad_norm_``'s
        semantics: scale by ``min(1, max_grad_norm / (norm + 1e-6))``). Default ``None``.
      skip_nonfinite: with an optimizer: skip an update whose gradient norm is inf or nan
        (weights, moments and step unchanged, the gradients dropped), as torch's ``GradScaler``
        skips ``optimizer.step()``. Default ``False``.
        With either, the update needs every stage's gradients first, so it is no longer fused
        into the backward: the backward sends each layer's gradients to ``pinned_host`` and an
        update pass streams weights, gradients and moments in and the new weights and moments
        out. Per update that moves, beyond the fused step, the gradients out and in (2 x the
        trainable weight bytes) and the weights in once more (less the ``prefetch_depth + 1``
        layers the backward leaves on the device), and waits once for the norm.
      weights: where the stages' values come from: ``None`` (default) the modules' own parameters
        and buffers, or a callable ``weights(module, names) -> {name: torch.Tensor}`` called once
        per stage, in order, with the stage's module and the names of its buffers and parameters
        (as ``named_buffers()`` / ``named_parameters()`` give them), returning CPU tensors of the
        modules' shapes in torch's layout, in the dtype the stage is to hold (the modules' own
        dtype is not used). The modules may then be on the meta device (``torch.device("meta")``):
        only their structure is used. :class:`xla_swap.loading.SafetensorsWeights` reads a
        Hugging Face safetensors checkpoint this way; :func:`xla_swap.load_stack` builds a stack
        from a causal LM and its checkpoint.
      param_dtype: ``torch.bfloat16`` for mixed precision as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``
        gives it on one device (default ``None``: compute in the dtypes held). The parameters stay in
        ``pinned_host`` in the model's float32 (the master weights; AdamW moments float32 too, unless
        the optimizer's ``state_dtype`` says otherwise); each stage casts its floating parameters (not
        its buffers) and its floating inputs to bf16 on the device, inside its executable, so forward
        and backward compute in bf16, the gradient w.r.t. the master is the bf16 gradient cast to
        float32 by the cast's transpose, and AdamW updates the float32 master. Outputs, the carry
        and ``.grad`` (without an optimizer: float32) are as computed. Cost: the weights cross the link
        as float32, twice the bytes of bf16 weights (``runtime.stage_nbytes`` counts them so, and the
        planner and :meth:`autotune` with it); the bf16 copy is a temporary of the stage's executable.
        ``float16`` is refused (it needs loss scaling, which the stack does not implement).
      mp_policy: instead of ``param_dtype``: a ``torch.distributed.fsdp.MixedPrecisionPolicy``. Its
        ``param_dtype`` and ``cast_forward_inputs`` are honoured; ``output_dtype`` must be ``None``;
        ``reduce_dtype`` ``None`` or ``param_dtype``, or ``torch.float32`` on one device (no reduction
        there: the cast of the bf16 gradient to the float32 master is exact).

    Host memory at construction: each stage is read (from the modules, or ``weights``), copied into
    its ``pinned_host`` buffers (with an optimizer, zero moments beside them) and released before
    the next, so beyond the stack's own buffers construction holds one stage's transient copies.
    The stack never aliases the modules' storage and needs it only for :meth:`sync_modules` and,
    without an optimizer, for the ``.grad`` it writes (``accumulate_grads``): with an optimizer
    the caller may release it once the stack is built, keeping the modules' structure, e.g.
    ``model.to("meta")`` (the parameter objects stay the same, so a torch optimizer's groups
    still match; ``sync_modules`` then refuses).

    Raises:
      TypeError: a layer / ``first`` / ``last`` is not an ``nn.Module``; ``policy``,
        ``optimizer``, ``loss_fn``, ``devices``, ``shard`` or ``calibration`` has the wrong type; a
        parameter or buffer is ``float64`` with ``jax_enable_x64`` off (it would run as ``float32``;
        the message names the stage and the tensor).
      ValueError: ``layers`` is empty; both ``policy`` and ``budget_bytes``; a bad budget (below
        the streaming window of weights and optimizer state);
        a parameter shared by two stages other than ``first`` and ``last`` (tied embeddings: held once
        by ``first``, carried to ``last``; ``tied``); a stage that fails to trace on
        ``first.example_inputs()`` (when ``first`` has it: the message names the stage's module); a torch
        optimizer with options AdamW here does not implement (``amsgrad``, ``maximize``,
        ``Adam``'s L2 ``weight_decay``; the message names the group), a stage parameter with
        ``requires_grad`` in none of its groups, or a group's parameter in no stage (the
        message names it); ``shard`` is unknown; ``max_grad_norm`` not a finite number > 0;
        ``max_grad_norm`` or ``skip_nonfinite`` without an optimizer. TypeError: a torch optimizer other than
        ``AdamW`` / ``Adam`` (e.g. SGD).
      ValueError: a parameter or buffer on the meta device without ``weights``; what ``weights`` gives lacks a name, has an
        unexpected one or a tensor of another shape (the message names the stage and tensor).
        TypeError: ``weights`` not callable, or it returns something other than a dict of tensors.
      ValueError: ``param_dtype`` other than ``torch.bfloat16`` (TypeError: not a ``torch.dtype``), both
        ``param_dtype`` and ``mp_policy``, an ``mp_policy`` field not honoured (named), a floating
        parameter (or what ``weights`` gives for one) that is not float32 with ``param_dtype``.
        TypeError: ``mp_policy`` not a ``MixedPrecisionPolicy``.
      ImportError: torchax is not installed.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], *, first: torch.nn.Module | None = None,
                 last: torch.nn.Module | None = None, policy: OffloadPolicy | None = None,
                 budget_bytes: int | None = None, optimizer=None, loss_fn: Callable | None = None,
                 devices: Sequence[jax.Device] | None = None, shard: str | Callable = "fsdp",
                 prefetch_depth: int | None = None, max_signatures: int = 8, accumulate_grads: bool = True,
                 offload_activations: bool = False, data_parallel: bool | None = None,
                 transpose_linear: bool = True, autotune: bool = True, calibration=None,
                 fused_attention: bool = True, max_grad_norm: float | None = None,
                 skip_nonfinite: bool = False, weights: Callable | None = None,
                 param_dtype: torch.dtype | None = None, mp_policy=None):
        # ---- validation (no state changes) ----
        if isinstance(layers, torch.nn.Module) and not isinstance(layers, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise TypeError("layers must be a sequence of nn.Modules (e.g. model.model.layers), got one module")
        layers = list(layers) if isinstance(layers, (Sequence, torch.nn.ModuleList, torch.nn.Sequential)) else None
        if not layers:
            raise ValueError("layers must be a non-empty sequence of torch.nn.Module")
        for i, m in enumerate(layers):
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"layers[{i}] must be a torch.nn.Module, got {type(m).__name__}")
        for name, m in (("first", first), ("last", last)):
            if m is not None and not isinstance(m, torch.nn.Module):
                raise TypeError(f"{name} must be a torch.nn.Module or None, got {type(m).__name__}")
        if policy is not None and budget_bytes is not None:
            raise ValueError("give either policy or budget_bytes, not both")
        if policy is not None and not isinstance(policy, OffloadPolicy):
            raise TypeError(f"policy must be an xla_swap.planning.OffloadPolicy, got {type(policy).__name__}")
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                                         or budget_bytes <= 0):
            raise ValueError(f"budget_bytes must be a positive int (bytes), got {budget_bytes!r}")
        if data_parallel is not None and not isinstance(data_parallel, bool):
            raise TypeError(f"data_parallel must be a bool or None, got {type(data_parallel).__name__}")
        if not isinstance(accumulate_grads, bool):
            raise TypeError(f"accumulate_grads must be a bool, got {type(accumulate_grads).__name__}")
        if not isinstance(transpose_linear, bool):
            raise TypeError(f"transpose_linear must be a bool, got {type(transpose_linear).__name__}")
        if not isinstance(autotune, bool):
            raise TypeError(f"autotune must be a bool, got {type(autotune).__name__}")
        if not isinstance(fused_attention, bool):
            raise TypeError(f"fused_attention must be a bool, got {fused_attention!r}")
        _check_calibration_arg(calibration)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be a bool, got {type(skip_nonfinite).__name__}")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))
                                          or not np.isfinite(max_grad_norm) or max_grad_norm <= 0):
            raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {max_grad_norm!r}")
        if optimizer is None and (max_grad_norm is not None or skip_nonfinite):
            raise ValueError("max_grad_norm and skip_nonfinite need an optimizer; without one train_step fills .grad "
                             "(clip it with torch.nn.utils.clip_grad_norm_)")
        torch_optimizer = None
        if isinstance(optimizer, torch.optim.Optimizer):
            torch_optimizer, optimizer = optimizer, AdamW.groups_from_torch(optimizer)
        elif optimizer is not None and not isinstance(optimizer, AdamW):
            raise TypeError("optimizer must be None, an xla_swap.planning.AdamW or a torch.optim.AdamW, "
                            f"got {type(optimizer).__name__}")
        if not (callable(shard) or shard in _SHARD_RULES):
            raise ValueError(f"shard must be one of {_SHARD_RULES} or a callable (name, shape) -> spec, got {shard!r}")
        devices = list(jax.devices()) if devices is None else devices
        if isinstance(devices, jax.Device) or not isinstance(devices, Sequence) or not devices or \
                not all(isinstance(d, jax.Device) for d in devices):
            raise TypeError(f"devices must be a non-empty sequence of jax.Device, got {devices!r}")
        compute_dtype, cast_inputs = _mixed_precision(param_dtype, mp_policy, len(devices))
        policy = policy or DEFAULT_POLICY
        if prefetch_depth is not None:
            policy = OffloadPolicy(params=policy.params, grads=policy.grads, activations=policy.activations,
                                   remat=policy.remat, prefetch_depth=prefetch_depth,
                                   optimizer_state=policy.optimizer_state)
        modules = ([first] if first is not None else []) + layers + ([last] if last is not None else [])
        owner: dict[int, str] = {}
        names = (["first"] if first is not None else []) + [f"layers[{i}]" for i in range(len(layers))] + \
            (["last"] if last is not None else [])
        first_names: dict[int, str] = {}
        #: ``{name in last: name in first}``: parameters ``first`` and ``last`` share (tied embeddings).
        tied: dict[str, str] = {}
        for name, m in zip(names, modules):
            for pn, p in m.named_parameters():
                if id(p) in owner and owner[id(p)] != name:
                    if owner[id(p)] == "first" and name == "last" and m is last:
                        tied[pn] = first_names[id(p)]
                        continue
                    raise ValueError(f"parameter {name}.{pn} is also in {owner[id(p)]}: weights shared between "
                                     "stages are supported between first and last only (tied embeddings)")
                owner[id(p)] = name
                if name == "first":
                    first_names[id(p)] = pn
        if weights is not None and not callable(weights):
            raise TypeError(f"weights must be None or a callable (module, names) -> {{name: torch.Tensor}}, "
                            f"got {type(weights).__name__}")
        on_meta = _meta_tensor(modules, names)
        if on_meta is not None and weights is None:
            raise ValueError(f"{on_meta} is on the meta device (no values): give weights= (a source of the stages' "
                             "tensors) or build the stack with xla_swap.load_stack(model, checkpoint)")
        if compute_dtype is not None and weights is None:
            for name, m in zip(names, modules):
                for pn, p in m.named_parameters():
                    if p.is_floating_point() and p.dtype != torch.float32:
                        raise ValueError(f"param_dtype keeps float32 master weights: {name}.{pn} is {p.dtype}; "
                                         "build the model in float32 (model.float())")
        group_of: dict[int, int] = {}  # id(parameter) -> index of its torch param_group
        if torch_optimizer is not None:
            group_of = self._torch_groups(torch_optimizer, names, modules, owner)
        # torchax imported without its registration with torch; on a GPU, SDPA on cuDNN's fused attention
        env = torchax_env(devices[0].platform if fused_attention else "xla")

        # ---- stage functions: one per distinct layer signature ----
        self.modules: list[torch.nn.Module] = modules
        self.stage_names: list[str] = names
        self.has_first, self.has_last = first is not None, last is not None
        self._env = env
        #: per stage, the names of the ``nn.Linear`` weights held as ``[in, out]`` on the host
        #: and the device (``transpose_linear``).
        self.transposed: list[frozenset[str]] = [_linear_weights(m) if transpose_linear else frozenset()
                                                 for m in modules]
        if tied:
            self.transposed[-1] = self.transposed[-1] - set(tied)
        #: ``{name in last: name in first}``: the weights ``first`` and ``last`` share (tied embeddings):
        #: held once, in the first stage (one gradient, the sum of both uses; one optimizer state), and
        #: carried to the last stage on the device as part of the carry.
        self.tied: dict[str, str] = dict(tied)
        tr = iter(self.transposed)
        fns = []
        if first is not None:
            ffn = _module_fn(first, env, next(tr), _embedding_padding_rows(first))

            tr_first = self.transposed[0]

            def first_stage(w, inputs, ffn=ffn):
                h, kw = _split_carry(ffn(w, tuple(inputs)), "first")
                for nl, nf in tied.items():  # in torch's layout
                    kw[_TIED + nl] = jnp.swapaxes(w[nf], 0, 1) if nf in tr_first else w[nf]
                return h, kw
            fns.append(first_stage)
        shared: dict = {}
        keys, select = _layer_selection(first, len(layers))
        for i, m in enumerate(layers):
            sig, tr_i = (_signature(m), keys[i]), next(tr)
            if sig not in shared:
                lfn = _module_fn(m, env, tr_i, _embedding_padding_rows(m))

                def layer_stage(w, carry, lfn=lfn, key=keys[i]):
                    h, kw = carry
                    own = {n: v for n, v in kw.items() if not n.startswith(_TIED)} if tied else kw
                    out = lfn(w, (h,), own if select is None else select(key, own))
                    if isinstance(out, (tuple, list)):
                        out = out[0]
                    return out, kw
                shared[sig] = layer_stage
            fns.append(shared[sig])
        if last is not None:
            lastfn = _module_fn(last, env, next(tr), _embedding_padding_rows(last))

            def last_stage(w, carry, lastfn=lastfn):
                if tied:
                    w = {**w, **{nl: carry[1][_TIED + nl] for nl in tied}}
                return lastfn(w, (carry[0],))
            fns.append(last_stage)

        # ---- weights: torch (or `weights`) -> pinned_host, one stage at a time (never through the device) ----
        n_dev = len(devices)
        mesh = Mesh(np.array(devices), ("d",)) if n_dev > 1 else None
        self.mesh = mesh

        def spec_for(name, shape, transposed=False):
            if callable(shard):
                if not transposed:
                    return tuple(shard(name, tuple(shape)) or ())
                spec = tuple(shard(name, tuple(shape)[::-1]) or ())  # torch's shape and spec
                return tuple((spec + (None,) * (2 - len(spec)))[::-1])
            if shard == "replicate" or len(shape) < 2:
                return ()
            dims = sorted(range(len(shape)), key=lambda d: -shape[d])
            for d in dims:
                if shape[d] % n_dev == 0:
                    return tuple("d" if j == d else None for j in range(len(shape)))
            return ()

        def host_sharding(i, name, shape):
            if mesh is None:
                return jax.sharding.SingleDeviceSharding(devices[0], memory_kind="pinned_host")
            return NamedSharding(mesh, PartitionSpec(*spec_for(name, shape, name in self.transposed[i])),
                                 memory_kind="pinned_host")

        stage_params, trainable, updated, groups = [], [], [], []
        for i, (name, m, tr_m) in enumerate(zip(names, modules, self.transposed)):
            pnames = [n for n, _ in m.named_parameters() if not (m is last and n in tied)]
            tensors = _stage_tensors(name, m, pnames, weights)
            arrays = {n: _to_numpy(t.t() if n in tr_m else t) for n, t in tensors.items()}
            del tensors
            _check_input_dtypes(arrays, name)  # float64 weights would run as float32 without x64
            if compute_dtype is not None:
                for n in pnames:
                    if _is_float(arrays[n].dtype) and arrays[n].dtype != np.float32:
                        raise ValueError(f"param_dtype keeps float32 master weights: weights gives {name}.{n} as "
                                         f"{arrays[n].dtype}; give float32 tensors")
            # each stage is placed in pinned_host as soon as it is read (copies: the stack never
            # aliases the modules' storage) and handed to the runtime as its own (own_params)
            placed = {}
            for n in list(arrays):
                a = arrays.pop(n)
                placed[n] = jax.device_put(a, host_sharding(i, n, a.shape), may_alias=False)
                del a
            trainable.append(pnames)  # ordered: every process must gather in the same order
            # the optimizer updates what torch's would: parameters with requires_grad (frozen ones get no .grad)
            updated.append({n for n, p in m.named_parameters() if p.requires_grad})
            groups.append({n: group_of.get(id(p), 0) for n, p in m.named_parameters()})
            stage_params.append({**{n: placed[n] for n in placed if n not in pnames},
                                 **{n: placed[n] for n in pnames}})
        self._trainable = trainable
        #: the dtype the stages compute in (``param_dtype``): each stage casts its floating parameters
        #: (and with ``cast_forward_inputs`` its floating inputs) to it; ``None``: as held.
        self.param_dtype: torch.dtype | None = compute_dtype
        if compute_dtype is not None:   # one wrapper per distinct stage function (shared layers stay shared)
            wrapped: dict[int, Callable] = {}
            for i, f in enumerate(fns):
                if id(f) not in wrapped:
                    wrapped[id(f)] = _compute_in(f, frozenset(trainable[i]), jnp.bfloat16, cast_inputs)
                fns[i] = wrapped[id(f)]
        self._cast_inputs = cast_inputs

        sharding = None
        if mesh is not None:
            def sharding(i, path, leaf):
                name = path[0].key
                return NamedSharding(mesh, PartitionSpec(*spec_for(name, leaf.shape, name in self.transposed[i])))

        resident = None
        k = policy.prefetch_depth
        if budget_bytes is not None:   # raises below the streaming window, before anything is built
            resident = self._resident_for_budget(stage_params, updated,
                                                 optimizer[0] if isinstance(optimizer, list) else optimizer,
                                                 budget_bytes, k)
            if autotune:   # stream everything until the first call chooses (the least device memory)
                resident = [False] * len(stage_params)
        if data_parallel is None:
            data_parallel = shard == "fsdp"
        #: whether activations are split over the devices on their leading dimension.
        self.data_parallel: bool = bool(data_parallel and mesh is not None)
        kwargs = dict(sharding=sharding, activation_sharding=NamedSharding(mesh, PartitionSpec()),
                      batch_axis="d" if self.data_parallel else None) \
            if sharding is not None else dict(device=devices[0])
        common = dict(optimizer=optimizer, trainable=lambda i, path: path[0].key in updated[i], own_params=True,
                      group_of=lambda i, path: groups[i][path[0].key],
                      track_residency=False, max_signatures=max_signatures,
                      offload_activations=offload_activations, **kwargs)
        if resident is None:
            rt = StreamingRuntime.from_policy(fns, stage_params, policy, **common)
        else:  # the policy's fields, with the residency the budget chose
            rt = StreamingRuntime(fns, stage_params, prefetch_depth=k, resident=resident,
                                  grads_to_host=policy.grads == "host",
                                  optimizer_state_on_host=policy.optimizer_state == "host",
                                  remat=remat_from_policy(policy), **common)
        #: the :class:`~xla_swap.executors.StreamingRuntime` that runs the stages.
        self.runtime: StreamingRuntime = rt
        #: the policy in force (``budget_bytes`` given: ``params`` reads "host", see ``runtime.resident``
        #: and, once chosen, ``runtime.remat``).
        self.policy: OffloadPolicy = policy
        #: the optimizer's configuration (group 0's with a torch optimizer), or ``None``.
        self.optimizer: AdamW | None = rt.optimizer
        #: the torch optimizer given, whose ``param_groups`` are read at every ``train_step``, or ``None``.
        self.torch_optimizer = torch_optimizer
        self._group_ids = [tuple(id(p) for p in g["params"]) for g in torch_optimizer.param_groups] \
            if torch_optimizer is not None else None
        self.loss_fn = loss_fn
        self.accumulate_grads = accumulate_grads
        #: the global gradient-norm clip applied at each update (``None``: none).
        self.max_grad_norm: float | None = None if max_grad_norm is None else float(max_grad_norm)
        #: whether an update whose gradient norm is not finite is skipped.
        self.skip_nonfinite: bool = skip_nonfinite
        #: without an optimizer and with ``accumulate_grads=False``: the last step's gradients
        #: (per stage, ``{name: jax.Array}`` in ``pinned_host``; the names in ``transposed`` as ``[in, out]``).
        self.last_grads: list | None = None
        self._jax_losses: dict = {}
        #: the schedule chosen by :meth:`autotune` (a ``ScheduleChoice``: ``.explain()``), or ``None``.
        self.schedule = None
        self._autotune_budget: int | None = budget_bytes if autotune else None
        #: what :meth:`autotune` chooses from when given no ``calibration`` (``None``: it measures).
        self.calibration = calibration
        #: jax's fp32 matmul precision the executables were traced with: torch's setting
        #: (:func:`torch_matmul_precision`), read again at every call.
        self.matmul_precision: str = torch_matmul_precision()
        example = getattr(first, "example_inputs", None)
        if callable(example):  # refuse at construction what does not trace (e.g. an op torchax lacks)
            self._check_trace(example())

    def _check_trace(self, inputs: tuple) -> None:
        """Trace the forward of every stage (shapes only, nothing compiled or run) on ``inputs``.

        Raises: ValueError naming the stage and its module when a stage fails to trace.
        """
        try:
            with self._torch_precision():
                self.runtime.output_aval(self._carry_in(tuple(inputs)))
        except (ValueError, TypeError) as e:
            msg = str(e)
            i = int(msg.split(":")[0].split()[1]) if msg.startswith("stage ") else None
            where = f"{self.stage_names[i]} ({type(self.modules[i]).__name__})" if i is not None else "a stage"
            raise ValueError(f"{where} does not trace with torchax on an example input: {msg}") from e

    @contextlib.contextmanager
    def _torch_precision(self):
        """Trace and run under torch's fp32 matmul setting; a changed setting compiles again."""
        p = torch_matmul_precision()
        if p != self.matmul_precision:
            self.runtime.clear_executables()
            self.matmul_precision = p
        with jax.default_matmul_precision(p):
            yield

    @staticmethod
    def _torch_groups(opt, names, modules, owner) -> dict[int, int]:
        """``{id(parameter): param_group index}`` of a torch optimizer over the stack's parameters.

        Raises: ValueError naming the parameter: a stage parameter with ``requires_grad`` in no
        group (torch would not train it, the stack would), or a group's parameter in no stage
        (the stack would never update it).
        """
        group_of = {}
        for gi, g in enumerate(opt.param_groups):
            for p in g["params"]:
                if id(p) not in owner:
                    raise ValueError(f"optimizer.param_groups[{gi}] holds a parameter of shape {tuple(p.shape)} that "
                                     "is in no stage of the stack (it would never be updated); give the optimizer "
                                     "the stages' parameters only")
                group_of[id(p)] = gi
        for name, m in zip(names, modules):
            for pn, p in m.named_parameters():
                if p.requires_grad and id(p) not in group_of:
                    raise ValueError(f"parameter {name}.{pn} requires grad but is in no param_group of the optimizer "
                                     "(torch would not update it); add it to a group or set requires_grad=False")
        return group_of

    def _read_torch_groups(self) -> list[AdamW]:
        """The torch optimizer's groups now (a scheduler may have changed them): one ``AdamW`` each.

        Raises: ValueError: the groups' parameters changed since construction; the errors of
        ``AdamW.groups_from_torch`` (e.g. ``amsgrad`` switched on).
        """
        opt = self.torch_optimizer
        if [tuple(id(p) for p in g["params"]) for g in opt.param_groups] != self._group_ids:
            raise ValueError("optimizer.param_groups hold other parameters than when the SwappedStack was built "
                             "(add_param_group, or parameters moved between groups); build a new SwappedStack")
        return AdamW.groups_from_torch(opt, self.optimizer.state_dtype)

    @staticmethod
    def _resident_for_budget(stage_params, trainable, optimizer, budget, k) -> list[bool]:
        """Stages kept in device memory for ``budget`` bytes: from the last backwards while they fit."""
        def nbytes(i):
            w = sum(a.nbytes for a in stage_params[i].values())
            if optimizer is not None:
                w += sum(optimizer.state_bytes(stage_params[i][n].nbytes, stage_params[i][n].itemsize)
                         for n in trainable[i])
            return w
        sizes = [nbytes(i) for i in range(len(stage_params))]
        window = sum(sorted(sizes, reverse=True)[:k + 1])
        if window > budget:
            raise ValueError(f"budget_bytes={budget} is below the streaming window: {k + 1} stages of weights "
                             f"and optimizer state need {window} bytes")
        if sum(sizes) <= budget:
            return [True] * len(sizes)
        resident, used = [False] * len(sizes), window
        for i in reversed(range(len(sizes))):
            if used + sizes[i] > budget:
                break
            resident[i], used = True, used + sizes[i]
        return resident

    # ------------------------------------------------------------------ serving
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Run the stack on ``inputs``; returns a torch tensor.

        Inputs on the CPU give a CPU output (copied from the device); CUDA inputs (on the
        GPU the runtime uses) are shared with jax through DLPack and give a CUDA output,
        also shared (no copy through the host: the way to serve at the floor).

        Each new input shape compiles once (bounded cache, ``max_signatures``).

        Raises:
          TypeError: an input is not a torch.Tensor; an input's dtype jax would narrow
            (``float64`` with ``jax_enable_x64`` off), or one the layers would compute in another
            dtype (an ``int32`` or ``float16`` hidden state into ``float32`` layers shared by
            several stages): the message names ``inputs[i]``, the dtype got and the one expected.
          ValueError: a stage fails to trace (the message names it).
        """
        with self._torch_precision():
            self._maybe_autotune(tuple(inputs), training=False)
            x = self._carry_in(inputs)
            out_dev = next((t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"),
                           None)
            return self._out(self.runtime.forward(x), out_dev)

    __call__ = forward

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Generate tokens with a KV cache, as ``model.generate`` (a stack of ``causal_lm_stages(model)``).

        ``input_ids`` int ``[batch, prompt]``, ``attention_mask`` ``None`` or left-padded 0/1 of its
        shape; keywords ``max_new_tokens`` (required), ``do_sample``, ``temperature``, ``top_k``,
        ``top_p``, ``eos_token_id``, ``pad_token_id``, ``seed``, ``kv_cache`` (``"auto"`` /
        ``"device"`` / ``"host"``), ``device_budget_bytes``, ``max_cache_len``, ``prompt_bucket``.
        Returns int64 ``[batch, prompt + n]`` on the CPU. Arguments, placement and errors:
        :func:`xla_swap.generate.generate`.
        """
        from xla_swap.generate import generate
        return generate(self, input_ids, attention_mask, **kwargs)

    # ------------------------------------------------------------------ training
    def train_step(self, inputs, targets=(), *, loss_fn: Callable | None = None, lr: float | None = None,
                   accumulate: bool = False) -> torch.Tensor:
        """One training step: forward, ``loss_fn(output, *targets)``, backward, optimizer step.

        With ``accumulate=True`` (and an optimizer) it is one micro-batch: its gradients are added
        to the accumulated ones and nothing is updated; the next call with ``accumulate=False``
        adds its own and updates with the sum, as torch's ``loss.backward()`` per micro-batch and
        one ``optimizer.step()`` do (``.grad`` sums: divide the loss by the number of
        micro-batches, as torch's loop does, for their mean). An update clips and skips as the
        constructor's ``max_grad_norm`` / ``skip_nonfinite`` say (``last_grad_norm``,
        ``last_step_skipped``).

        Args:
          inputs: a torch tensor or a tuple of them (the arguments of ``first``).
          targets: a torch tensor or a tuple of them, passed to the loss after the output.
          loss_fn: a torch function ``(output, *targets) -> scalar`` (default: the constructor's).
          lr: this step's learning rate for every parameter group, overriding the optimizer's for
            this step only (a torch optimizer's ``param_groups`` are not changed). Default: each
            group's own ``lr`` (with a torch optimizer, read now: a ``torch.optim.lr_scheduler``
            stepping it is followed). Unused by an ``accumulate=True`` call (no update).
          accumulate: see above (a bool; needs an optimizer).

        Returns: the loss, a 0-d float32 CPU torch tensor. With an optimizer the weights are
        updated (in host memory: ``sync_modules()`` copies them into the modules); without
        one the gradients are added to the modules' ``.grad`` (CPU tensors).

        Raises (before any state changes):
          TypeError: ``inputs``/``targets`` not tensors; no ``loss_fn``; an input's dtype
            refused as in :meth:`forward`; a ``float64`` target with ``jax_enable_x64`` off;
            ``accumulate`` not a bool.
          ValueError: the loss is not a floating scalar; a stage fails to trace; ``lr < 0``; the
            torch optimizer's groups hold other parameters than at construction, or an option
            the update does not implement (``AdamW.groups_from_torch``); ``accumulate=True``
            without an optimizer (``.grad`` accumulates already); without an optimizer and with
            ``accumulate_grads``, a parameter on the meta device (no ``.grad`` to add to).
        """
        if loss_fn is None:
            loss_fn = self.loss_fn
        if loss_fn is None or not callable(loss_fn) or isinstance(loss_fn, torch.Tensor):
            raise TypeError("train_step needs a loss_fn (here or in the constructor): (output, *targets) -> scalar")
        if not isinstance(accumulate, bool):
            raise TypeError(f"accumulate must be a bool, got {type(accumulate).__name__}")
        if self.optimizer is None and self.accumulate_grads:
            on_meta = _meta_tensor(self.modules, self.stage_names)
            if on_meta is not None:
                raise ValueError(f"{on_meta} is on the meta device: without an optimizer train_step adds the gradients "
                                 "to the modules' .grad; build the stack with an optimizer or accumulate_grads=False "
                                 "(last_grads)")
        if accumulate and self.optimizer is None:
            raise ValueError("accumulate=True needs an optimizer; without one train_step adds the gradients to "
                             ".grad already (accumulate_grads)")
        with self._torch_precision():
            return self._train_step(inputs, targets, loss_fn, lr, accumulate)

    def _train_step(self, inputs, targets, loss_fn, lr, accumulate) -> torch.Tensor:
        t = () if targets is None or (isinstance(targets, tuple) and not targets) else \
            _inputs_to_jax(targets if isinstance(targets, (tuple, list)) else (targets,), "targets")
        _check_input_dtypes(t, "targets")
        if self.torch_optimizer is not None:
            self.runtime.param_groups = self._read_torch_groups()
        self._maybe_autotune(tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), training=True)
        x = self._carry_in(inputs if isinstance(inputs, (tuple, list)) else (inputs,))
        jloss = self._jax_losses.get(loss_fn)
        if jloss is None:
            tfn = _torch_fn(loss_fn, self._env)

            def jloss(out, *targets, tfn=tfn):
                if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
                    out = out[0]  # no `last` stage: the output is the layers' (h, layer_kwargs) carry
                return tfn(out, *targets)
            if len(self._jax_losses) >= 8:
                self._jax_losses.pop(next(iter(self._jax_losses)))
            self._jax_losses[loss_fn] = jloss
        step = self.runtime.step
        clip = dict(accumulate=accumulate, max_grad_norm=self.max_grad_norm, skip_nonfinite=self.skip_nonfinite) \
            if self.optimizer is not None else {}
        loss, _, grads = self.runtime.train_step(x, jloss, loss_args=tuple(t), lr=lr, **clip)
        if self.torch_optimizer is not None and self.runtime.step > step:
            self._torch_step()
        if grads is not None:
            if self.accumulate_grads:
                self._accumulate_grads(grads)
            else:
                self.last_grads = grads
        return _to_torch(loss).float()

    @property
    def last_grad_norm(self) -> float | None:
        """The global 2-norm of the gradients of the last update (over every trainable parameter of
        every stage, before clipping: ``clip_grad_norm_``'s return value; a float, possibly inf or
        nan), or ``None`` when neither ``max_grad_norm`` nor ``skip_nonfinite`` is set."""
        return self.runtime.last_grad_norm

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last update was skipped for a non-finite gradient (``skip_nonfinite``)."""
        return self.runtime.last_step_skipped

    def _torch_step(self) -> None:
        """Call the torch optimizer's ``step()`` after an update, when none of its parameters has a
        ``.grad``: a no-op on its parameters and state that runs its step hooks and tells a
        ``torch.optim.lr_scheduler`` the optimizer stepped (else it warns that the scheduler
        stepped first)."""
        opt = self.torch_optimizer
        if all(p.grad is None for g in opt.param_groups for p in g["params"]):
            opt.step()

    def _accumulate_grads(self, grads) -> None:
        for i, (m, g, names) in enumerate(zip(self.modules, grads, self._trainable)):
            params = dict(m.named_parameters())
            for n in names:
                if g.get(n) is None:
                    continue
                gt = self._torch_layout(i, n, _to_torch(g[n])).to(params[n].dtype)
                if params[n].grad is None:
                    params[n].grad = gt
                else:
                    params[n].grad.add_(gt)

    def autotune(self, inputs, *, budget_bytes: int, training: bool = True, reps: int = 3, calibration=None,
                 **choose_kwargs):
        """Choose prefetch depth, resident stages, activation offload, where the optimizer state
        lives and, for training, ``remat`` (recompute, or keep the residuals) from a short
        measurement on the device, and run the stack with that choice from now on.

        A stack built with ``budget_bytes`` (and ``autotune=True``, the default) calls it at its
        first ``forward`` / ``train_step`` with that call's inputs; call it again for another
        input shape or budget. The choice is also kept as ``self.schedule``.

        ``xla_swap.executors.calibrate.autotune`` measures the link and each distinct stage's
        forward and backward (a few calls), ``xla_swap.planning.chooser.choose_schedule`` picks
        the fastest predicted configuration whose predicted peak fits, cached per stage
        signatures, input shapes, budget and mode; ``self.runtime`` is replaced by one running it
        (weights, optimizer state and step carried over). The runtime stays ``StreamingRuntime``
        (``InGraphRuntime`` has no training step).

        Args:
          inputs: a torch tensor or a tuple of them, as for ``train_step`` / ``forward`` (their
            shapes fix the stages' shapes; the values are not used).
          budget_bytes: device memory in bytes (int > 0) for *everything* the stack holds on the
            device (weights, optimizer state, activations, temporaries), unlike the constructor's
            ``budget_bytes`` (weights and optimizer state).
          training: choose for ``train_step`` (default) or ``forward``.
          reps: timed calls per measured figure.
          calibration: a ``Calibration`` or a callable ``(runtime, h) -> Calibration`` to choose
            from instead of measuring (see the constructor's ``calibration``; default: the
            constructor's, else measure). With one, nothing is measured and the cached choices
            are not read.
          **choose_kwargs: ``max_prefetch_depth``, ``allow_offload``, ``allow_device_optimizer_state``,
            ``allow_no_remat`` (default ``True``; ``False`` keeps ``remat=True``).

        Returns: the ``xla_swap.planning.chooser.ScheduleChoice`` (``.explain()``; ``.observe(step_s,
        peak_bytes)`` records measured figures beside the prediction).

        Raises: ``xla_swap.planning.InfeasibleBudgetError`` (a ``ValueError``) when nothing fits,
          ``ValueError`` / ``TypeError`` for bad arguments; the stack is unchanged then.
        """
        from xla_swap.executors.calibrate import autotune
        _check_calibration_arg(calibration)
        x = self._carry_in(inputs if isinstance(inputs, (tuple, list)) else (inputs,))
        cal = self.calibration if calibration is None else calibration
        with self._torch_precision():
            self.runtime, choice = autotune(self.runtime, x, budget_bytes, training=training, reps=reps,
                                            calibration=cal, **choose_kwargs)
        self.schedule = choice
        return choice

    def _maybe_autotune(self, inputs: tuple, training: bool) -> None:
        """At the first call of a stack built with ``budget_bytes`` and ``autotune=True``: :meth:`autotune`,
        for training whenever the stack has an optimizer (its device memory then holds the resident
        stages' optimizer state, which a forward's choice does not count), else for that call's mode."""
        if self._autotune_budget is None or self.schedule is not None:
            return
        from xla_swap.planning import InfeasibleBudgetError
        try:
            self.autotune(inputs, budget_bytes=self._autotune_budget, training=training or self.optimizer is not None)
        except InfeasibleBudgetError as e:
            raise ValueError(
                f"budget_bytes={self._autotune_budget} holds no schedule for inputs of these shapes "
                f"({', '.join(str(tuple(t.shape)) for t in inputs if isinstance(t, torch.Tensor))}): the smallest "
                f"predicted needs {e.min_budget_bytes} bytes of device memory (weights, optimizer state, activations "
                f"and temporaries). Give a larger budget_bytes or smaller inputs, call stack.autotune(inputs, "
                f"budget_bytes=...) with a larger one, or build with autotune=False (the budget then bounds weights "
                f"and optimizer state only)") from e

    # ------------------------------------------------------------------ weights
    def state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """The current weights of every stage as CPU torch tensors: ``[{name: tensor}, ...]`` (copies).

        With several processes every process must call it (the sharded weights are gathered).
        """
        return [{n: self._torch_layout(i, n, _to_torch(p[n])) for n in names}
                for i, (p, names) in enumerate(zip(self.runtime.host_params, self._trainable))]

    def _torch_layout(self, stage: int, name: str, t: torch.Tensor) -> torch.Tensor:
        """A host-layout tensor of ``name`` in stage ``stage`` in torch's layout (``transposed`` ones back to ``[out, in]``)."""
        return t.t().contiguous() if name in self.transposed[stage] else t

    def sync_modules(self) -> None:
        """Copy the current (trained) weights into the ``nn.Module`` parameters, in place.

        Raises: ValueError naming the parameter, before anything is copied: a parameter is on the
          meta device (a stack built by :func:`xla_swap.load_stack`, or whose modules were released
          with ``model.to("meta")``): use :meth:`state_dicts` or :meth:`save_checkpoint` instead.
        """
        for name, m in zip(self.stage_names, self.modules):
            for n, p in m.named_parameters():
                if p.is_meta:
                    raise ValueError(f"sync_modules: {name}.{n} is on the meta device (the module holds no storage); "
                                     "read the weights with state_dicts() or save_checkpoint()")
        with torch.no_grad():
            for m, sd in zip(self.modules, self.state_dicts()):
                params = dict(m.named_parameters())
                for n, t in sd.items():
                    params[n].copy_(t)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The whole training state as CPU torch tensors (copies), in torch's layout and names.

        ``{"model": {fqn: weight}, "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}},
        "param_groups": [...]}}``, the form of ``torch.distributed.checkpoint.state_dict
        .get_state_dict``: ``fqn`` is the stage's name with the parameter's (``first.embed_tokens.weight``,
        ``layers.0.self_attn.q_proj.weight``, ``last.lm_head.weight``); weights and moments are
        ``[out, in]`` for ``nn.Linear`` weights as torch holds them, in the dtypes the stack holds
        (moments: the optimizer's state dtype); ``step`` is a 0-d float32 tensor (the optimizer's
        step count, as ``torch.optim.AdamW`` keeps it); each param group holds its options and its
        parameters' fqns. Parameters with ``requires_grad=False`` have weights and no state;
        without an optimizer only ``"model"`` is there. This is one copy of the whole state in host
        memory: :meth:`save_checkpoint` writes it without one.

        Raises: ValueError: accumulated micro-batches are pending (``train_step(accumulate=True)``
          since the last update: their gradients are not part of the state; update first); the
          stack spans several processes.
        """
        self._check_checkpointable("state_dict")
        sd: dict = {"model": {}}
        if self.optimizer is not None:
            sd["optim"] = {"state": {}, "param_groups": self._param_groups_state()}
        for i, lay in enumerate(self._ckpt_layout()):
            for key, (fqn, name, kind, j, _, _) in lay.items():
                t = self._ckpt_tensor(i, name, kind, j)
                if kind == "w":
                    sd["model"][fqn] = t
                else:
                    sd["optim"]["state"].setdefault(fqn, {})[_MOMENT_KEYS[kind]] = t
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the training state from a :meth:`state_dict` (of this stack or another built the
        same way): weights and moments are copied into the stack's host buffers, stage by stage,
        with their shardings and memory kinds; the step count and the param groups' options (into
        the torch optimizer's ``param_groups``, as ``optimizer.load_state_dict`` does) follow.

        Raises (before anything changes): TypeError: ``state_dict`` is not a dict of that form.
          ValueError: keys missing or unexpected (another model or config; the message names
          them), a tensor of another shape or dtype (named), steps that differ between
          parameters, param groups of other parameters or options AdamW refuses; accumulated
          micro-batches are pending; the stack spans several processes.
        """
        self._check_checkpointable("load_state_dict")
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("model"), dict) or \
                ("optim" in state_dict and not isinstance(state_dict["optim"], dict)):
            raise TypeError("state_dict must be a dict {'model': {fqn: tensor}, 'optim': {...}} as "
                            f"SwappedStack.state_dict() returns, got {type(state_dict).__name__}")
        flat = {f"model.{k}": v for k, v in state_dict["model"].items()}
        optim = state_dict.get("optim", {})
        for fqn, st in (optim.get("state") or {}).items():
            if not isinstance(st, dict):
                raise TypeError(f"state_dict['optim']['state'][{fqn!r}] must be a dict, got {type(st).__name__}")
            flat.update({f"optim.state.{fqn}.{k}": v for k, v in st.items()})
        for k, v in flat.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"state_dict: {k} must be a torch.Tensor, got {type(v).__name__}")
        meta = {k: (tuple(v.shape), v.dtype) for k, v in flat.items()}
        self._restore(meta, lambda keys: {k: flat[k] for k in keys}, optim.get("param_groups"), "state_dict")

    def save_checkpoint(self, path, *, extra: dict | None = None) -> None:
        """Write :meth:`state_dict` as a ``torch.distributed.checkpoint`` (DCP) checkpoint into the
        folder ``path`` (created; files of an earlier checkpoint there are overwritten).

        The keys are ``state_dict()``'s flattened as DCP flattens a nested dict (``model.<fqn>``,
        ``optim.state.<fqn>.exp_avg``, ``optim.param_groups``, ``extra.<key>``), so
        ``torch.distributed.checkpoint.load`` reads it into torch tensors of those shapes. A weight
        sharded over several devices (``shard="fsdp"``) is written as one chunk per distinct shard,
        each copied from its own host buffer when the writer reaches it and released once written:
        the extra host memory is a few copies of the largest single shard (the shard read out of
        its buffer, its ``[out, in]`` transpose, the writer's serialization; at most four), never
        the model or one stage. Not measured: derived from the writer's one-item-at-a-time loop.

        Args:
          path: a folder (``str`` or ``os.PathLike``).
          extra: ``None`` or a dict ``{str: picklable}`` saved beside the state, e.g.
            ``{"scheduler": sched.state_dict()}`` (:meth:`load_checkpoint` returns it).

        Raises: TypeError: ``path`` or ``extra`` of the wrong type. ValueError: as
          :meth:`state_dict` (pending micro-batches; several processes).
        """
        import os

        import torch.distributed.checkpoint as dcp
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike folder, got {type(path).__name__}")
        if extra is not None and (not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra)):
            raise TypeError(f"extra must be None or a dict with str keys, got {type(extra).__name__}")
        self._check_checkpointable("save_checkpoint")
        tensors = {}
        for i, lay in enumerate(self._ckpt_layout()):
            for key, (fqn, name, kind, j, shape, dtype) in lay.items():
                if kind == "step":
                    tensors[key] = (shape, dtype, [((), (), lambda: torch.tensor(float(self.runtime.step)))])
                else:
                    tensors[key] = (shape, dtype, _chunks(self._ckpt_source(i, name, kind, j),
                                                          name in self.transposed[i]))
        objects = {f"extra.{k}": v for k, v in (extra or {}).items()}
        if self.optimizer is not None:
            objects["optim.param_groups"] = self._param_groups_state()
        os.makedirs(path, exist_ok=True)
        # per_thread_copy_ahead=0: the writer resolves (copies) one shard, writes it, then the next
        writer = dcp.FileSystemWriter(path, per_thread_copy_ahead=0)
        with _single_process_dcp():
            dcp.save({}, storage_writer=writer, planner=_streaming_save_planner(tensors, objects), no_dist=True)

    def load_checkpoint(self, path) -> dict:
        """Restore the training state from a :meth:`save_checkpoint` folder, as :meth:`load_state_dict`
        does, reading one stage at a time (extra host memory: about three times one stage's
        weights and moments).

        The checkpoint's keys, shapes and dtypes (its metadata), its step counts and param groups
        are checked before anything changes. Should reading a stage's data fail after that (a
        truncated file), the error says which stages were restored already.

        Returns: the ``extra`` dict given to :meth:`save_checkpoint` (``{}`` without one).

        Raises: TypeError: ``path`` not a str / ``os.PathLike``. FileNotFoundError: no DCP
          checkpoint in ``path``. ValueError: as :meth:`load_state_dict` (the message names the key).
        """
        import os

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike folder, got {type(path).__name__}")
        self._check_checkpointable("load_checkpoint")
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise FileNotFoundError(f"path={os.fspath(path)!r} holds no torch.distributed.checkpoint checkpoint "
                                    "(no .metadata file)")
        md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        meta = {k: (tuple(v.size), v.properties.dtype) for k, v in md.items()
                if isinstance(v, TensorStorageMetadata) and not k.startswith("extra.")}
        meta.update({k: None for k, v in md.items() if not isinstance(v, TensorStorageMetadata)
                     and not k.startswith("extra.") and k != "optim.param_groups"})
        objects = {k: None for k in md if k.startswith("extra.") or k == "optim.param_groups"}
        if objects:
            with _single_process_dcp():
                dcp.load(objects, storage_reader=dcp.FileSystemReader(path), no_dist=True)

        def read(keys):
            sd = {k: torch.empty(meta[k][0], dtype=meta[k][1]) for k in keys}
            with _single_process_dcp():
                dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
            return sd
        self._restore(meta, read, objects.get("optim.param_groups"), f"checkpoint {os.fspath(path)!r}")
        return {k[len("extra."):]: v for k, v in objects.items() if k.startswith("extra.")}

    def _check_checkpointable(self, what: str) -> None:
        if self.runtime.grad_acc is not None:
            raise ValueError(f"{what}: {self.runtime.micro_batches} accumulated micro-batches are pending (train_step("
                             "accumulate=True) since the last update); their gradients are not part of the state: "
                             "finish the accumulation with train_step(accumulate=False) first")
        if jax.process_count() > 1:
            raise ValueError(f"{what} is not implemented for a stack spanning {jax.process_count()} processes")

    def _fqn(self, stage: int, name: str) -> str:
        """torch-style name of parameter ``name`` of ``stage``: ``layers.3.mlp.up_proj.weight``."""
        return f"{self.stage_names[stage].replace('[', '.').replace(']', '')}.{name}"

    def _ckpt_layout(self) -> list[dict]:
        """Per stage ``{flat key: (fqn, name, kind, j, torch shape, torch dtype)}``; ``kind`` is ``"w"``
        (weight), ``"m"`` / ``"v"`` (moments of trainable leaf ``j``) or ``"step"``."""
        rt, out = self.runtime, []
        for i, names in enumerate(self._trainable):
            p, lay = rt.host_params[i], {}

            def tshape(a, n, i=i):
                return tuple(a.shape)[::-1] if n in self.transposed[i] else tuple(a.shape)
            for n in names:
                fqn = self._fqn(i, n)
                lay[f"model.{fqn}"] = (fqn, n, "w", None, tshape(p[n], n), _torch_dtype(p[n].dtype))
            if self.optimizer is not None:
                key_of = {jax.tree_util.keystr((jax.tree_util.DictKey(n),)): n for n in names}
                for j, path in enumerate(rt.trainable_paths(i)):
                    n = key_of[path]
                    fqn, m = self._fqn(i, n), rt.optimizer_state[i][j][0]
                    for kind in ("m", "v"):
                        lay[f"optim.state.{fqn}.{_MOMENT_KEYS[kind]}"] = (fqn, n, kind, j, tshape(m, n),
                                                                         _torch_dtype(m.dtype))
                    lay[f"optim.state.{fqn}.step"] = (fqn, n, "step", j, (), torch.float32)
            out.append(lay)
        return out

    def _ckpt_source(self, stage: int, name: str, kind: str, j):
        rt = self.runtime
        return rt.host_params[stage][name] if kind == "w" else rt.optimizer_state[stage][j][0 if kind == "m" else 1]

    def _ckpt_tensor(self, stage: int, name: str, kind: str, j) -> torch.Tensor:
        if kind == "step":
            return torch.tensor(float(self.runtime.step))
        return self._torch_layout(stage, name, _to_torch(self._ckpt_source(stage, name, kind, j)))

    def _param_groups_state(self) -> list[dict]:
        """The param groups' options and their parameters' fqns (``"params"``), as torch's
        ``get_optimizer_state_dict`` gives them: the torch optimizer's groups, else the runtime's."""
        import copy
        fqn_of = {id(p): self._fqn(i, n) for i, m in enumerate(self.modules) for n, p in m.named_parameters()}
        if self.torch_optimizer is not None:
            return [{**copy.deepcopy({k: v for k, v in g.items() if k != "params"}),
                     "params": [fqn_of[id(p)] for p in g["params"]]} for g in self.torch_optimizer.param_groups]
        rt = self.runtime
        members: list[list[str]] = [[] for _ in rt.param_groups]
        for i, names in enumerate(self._trainable):
            key_of = {jax.tree_util.keystr((jax.tree_util.DictKey(n),)): n for n in names}
            for path, g in zip(rt.trainable_paths(i), rt.group_idx[i]):
                members[g].append(self._fqn(i, key_of[path]))
        return [{"lr": g.lr, "betas": g.betas, "eps": g.eps, "weight_decay": g.weight_decay, "params": ps}
                for g, ps in zip(rt.param_groups, members)]

    def _restore(self, meta: dict, read: Callable, groups, where: str) -> None:
        """Check ``meta`` (``{flat key: (shape, torch dtype)}``) and ``groups`` against the stack, then
        load each stage from ``read(keys) -> {key: tensor}`` and set the step and the groups.

        Raises ValueError naming the key before anything changes (see :meth:`load_state_dict`).
        """
        layout = self._ckpt_layout()
        want = {k: v for lay in layout for k, v in lay.items()}
        missing, unexpected = sorted(set(want) - set(meta)), sorted(set(meta) - set(want))
        if missing or unexpected:
            raise ValueError(f"{where} does not match the stack (another model, config or optimizer?): "
                             f"{len(missing)} keys missing {missing[:4]}, {len(unexpected)} unexpected {unexpected[:4]}")
        for k, (_, _, _, _, shape, dtype) in want.items():
            if meta[k] != (tuple(shape), dtype):
                got = "an object" if meta[k] is None else f"shape {list(meta[k][0])} dtype {meta[k][1]}"
                raise ValueError(f"{where}: {k} has {got}, the stack holds shape {list(shape)} dtype {dtype}")
        step, new_groups = None, None
        if self.optimizer is not None:
            if groups is None:
                raise ValueError(f"{where} has no optim.param_groups")
            steps = read([k for k, v in want.items() if v[2] == "step"])
            vals = {float(t) for t in steps.values()}
            if len(vals) > 1 or (vals and (not float(next(iter(vals))).is_integer() or next(iter(vals)) < 0)):
                raise ValueError(f"{where}: the parameters' steps differ or are not counts: {sorted(vals)[:4]}")
            step = int(next(iter(vals))) if vals else self.runtime.step
            new_groups = self._checked_groups_state(groups, where)
        for i, lay in enumerate(layout):
            keys = [k for k, v in lay.items() if v[2] != "step"]
            try:
                got = read(keys)
            except Exception as e:
                if i == 0:
                    raise
                raise RuntimeError(f"{where}: reading stage {self.stage_names[i]} failed after stages "
                                   f"{self.stage_names[0]}..{self.stage_names[i - 1]} were restored; load again") from e
            params, state = dict(self.runtime.host_params[i]), {}
            for k in keys:
                _, n, kind, j, _, _ = lay[k]
                t = got[k].detach().to("cpu")
                a = _to_numpy(t.t() if n in self.transposed[i] else t)
                if kind == "w":
                    params[n] = a
                else:
                    state.setdefault(j, [None, None])[0 if kind == "m" else 1] = a
            self.runtime.load_stage(i, params, [tuple(state[j]) for j in sorted(state)]
                                    if self.optimizer is not None else None)
        if self.optimizer is not None:
            self.runtime.step = step
            if self.torch_optimizer is not None:
                for g, saved in zip(self.torch_optimizer.param_groups, groups):
                    g.update({k: v for k, v in saved.items() if k != "params"})
            self.runtime.param_groups = new_groups

    def _checked_groups_state(self, groups, where: str) -> list[AdamW]:
        """The runtime's groups for saved ``groups`` (``_param_groups_state`` form); ValueError if they
        hold other parameters than the stack's groups or options AdamW refuses."""
        mine = self._param_groups_state()
        if not isinstance(groups, list) or len(groups) != len(mine) or not all(isinstance(g, dict) for g in groups):
            raise ValueError(f"{where}: optim.param_groups must be {len(mine)} dicts (the stack's groups), "
                             f"got {type(groups).__name__} of {len(groups) if isinstance(groups, list) else '?'}")
        out = []
        for gi, (g, m) in enumerate(zip(groups, mine)):
            if sorted(g.get("params", [])) != sorted(m["params"]):
                raise ValueError(f"{where}: optim.param_groups[{gi}] holds other parameters than the stack's group "
                                 f"{gi} ({len(g.get('params', []))} vs {len(m['params'])})")
            try:
                out.append(AdamW(lr=float(g["lr"]), betas=tuple(float(b) for b in g["betas"]), eps=float(g["eps"]),
                                 weight_decay=float(g["weight_decay"]), state_dtype=self.optimizer.state_dtype))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{where}: optim.param_groups[{gi}]: {e!r}") from None
        return out

    # ------------------------------------------------------------------ internals
    def _carry_in(self, inputs):
        if not inputs:
            raise TypeError("forward/train_step need at least one input tensor")
        if not self.has_first and len(inputs) != 1:
            raise TypeError(f"without a `first` stage the layers take one input (h), got {len(inputs)}")
        x = _inputs_to_jax(tuple(inputs), "inputs", self._input_sharding)
        if self.param_dtype is not None and self._cast_inputs and not self.has_first:
            x = _cast_floats(x, jnp.bfloat16)   # h as the layers compute it (the carry check wants it so)
        x = x if self.has_first else (x[0], {})
        self.runtime.signature(x, "inputs")   # dtype checks (and the trace, cached) before anything runs
        return x

    def _input_sharding(self, shape: tuple, dtype) -> jax.sharding.Sharding | None:
        """Where the runtime places an input leaf of ``shape`` (``None``: on one device)."""
        if self.mesh is None:
            return None
        return self.runtime.activation_sharding_of(jax.ShapeDtypeStruct(shape, jnp.dtype(str(dtype).removeprefix("torch."))))

    def _out(self, y, device: torch.device | None):
        if isinstance(y, tuple) and len(y) == 2 and isinstance(y[1], dict):
            y = y[0]
        return jax.tree_util.tree_map(lambda a: _out_to_torch(a, device), y)
