"""The torch entry point: train and serve a stack of ``nn.Module`` layers larger than device
memory, with weights, gradients and AdamW state in host memory.

    stack = SwappedStack(model.model.layers, first=embed, last=head,
                         optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4))
    loss = stack.train_step(input_ids, labels, loss_fn=torch.nn.functional.cross_entropy)
    logits = stack(input_ids)          # serving: torch tensors in and out
    stack.sync_modules()               # the trained weights back into the nn.Modules

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
  ``torch.optim.AdamW`` whose hyperparameters are read), each stage is updated on the device
  right after its backward: its moments come from ``pinned_host`` with its weights, and the
  new weights and moments go back. Gradients never leave the device; AdamW state never
  lives on it beyond the prefetch window. The update is ``torch.optim.AdamW``'s.
  Without an optimizer, ``train_step`` writes the gradients into the modules' ``.grad``.
* **Carry.** ``first(*inputs)`` returns the hidden state ``h``, or ``(h, layer_kwargs)``
  where ``layer_kwargs`` is a dict of tensors every layer gets as keyword arguments
  (attention mask, rotary ``position_embeddings``); each layer is called
  ``layer(h, **layer_kwargs)`` (a tuple result's first element is the new ``h``); ``last(h)``
  gives the output. Integer tensors (token ids) are constants: they get no gradient.

* **Release.** A stack holds its stage functions, its ``StreamingRuntime`` (executables,
  weights, optimizer state) and at most 8 converted loss functions; dropping it frees them (by
  reference counting). The modules are the caller's. What outlives it is listed in
  :mod:`xla_swap.executors.streaming` (jax's own bounded caches; ``benchmarks/leak_cycles.py``).

The module imports torch, torchax, jax and numpy; not torch_xla.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xla_swap.executors.streaming import StreamingRuntime, _remat_from_policy
from xla_swap.planning.optimizer import AdamW
from xla_swap.planning.policy import OffloadPolicy

__all__ = ["SwappedStack", "causal_lm_stages", "DEFAULT_POLICY"]

log = logging.getLogger(__name__)

#: The policy used when none is given: weights, gradients and optimizer state in host
#: memory, each stage recomputed in the backward, two stages prefetched.
DEFAULT_POLICY = OffloadPolicy(params="host", grads="host", optimizer_state="host", remat=True, prefetch_depth=2)

_SHARD_RULES = ("fsdp", "replicate")


def _torchax():
    try:
        import torchax
    except ImportError as e:  # pragma: no cover - torchax ships with torch_xla; on other machines pip install it
        raise ImportError("xla_swap.stack needs torchax (it ships with torch_xla; or `pip install torchax`)") from e
    return torchax


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


def _module_fn(mod: torch.nn.Module, env, transposed: frozenset = frozenset()):
    """``f(states, args, kwargs) -> outputs``: ``mod.forward`` as a JAX function of its weights (torchax).

    The weights named in ``transposed`` arrive in the host layout ``[in, out]`` and are handed
    to the module as their transpose (``[out, in]``, ``nn.Linear``'s); XLA folds the
    transpose into the matmul (its ``TransposeFolding`` pass), which then contracts like
    ``h @ w``.
    """
    def f(states, args, kwargs=None):
        if transposed:
            states = {n: (jnp.swapaxes(v, 0, 1) if n in transposed else v) for n, v in states.items()}
        states, args, kwargs = env.j2t_iso((states, args, kwargs or {}))
        with env:
            res = torch.func.functional_call(mod, states, args, kwargs, tie_weights=False)
            return env.t2j_iso(res)
    return f


def _torch_fn(fn: Callable, env):
    """A torch function of tensors as a JAX function of arrays (torchax)."""
    def f(*args):
        args = env.j2t_iso(args)
        with env:
            res = fn(*args)
            return env.t2j_iso(res)
    return f


def _signature(mod: torch.nn.Module) -> tuple:
    return (type(mod), tuple((n, tuple(t.shape), t.dtype) for n, t in mod.state_dict(keep_vars=True).items()))


def _split_carry(out, stage: str):
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict):
        return out[0], dict(out[1])
    if isinstance(out, (tuple, list)):
        raise TypeError(f"{stage} must return a tensor or (tensor, dict of layer keyword tensors), "
                        f"got a {type(out).__name__} of length {len(out)}")
    return out, {}


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
      optimizer: ``None`` (``train_step`` fills ``.grad``), an ``xla_swap.planning.AdamW``, or
        a ``torch.optim.AdamW`` (its hyperparameters are read; its own state is not used).
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

    Raises:
      TypeError: a layer / ``first`` / ``last`` is not an ``nn.Module``; ``policy``,
        ``optimizer``, ``loss_fn``, ``devices`` or ``shard`` has the wrong type.
      ValueError: ``layers`` is empty; both ``policy`` and ``budget_bytes``; a bad budget (below
        the streaming window of weights and optimizer state);
        a parameter shared by two stages (tied weights are not supported); a torch
        optimizer with options AdamW here does not implement; ``shard`` is unknown.
      ImportError: torchax is not installed.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], *, first: torch.nn.Module | None = None,
                 last: torch.nn.Module | None = None, policy: OffloadPolicy | None = None,
                 budget_bytes: int | None = None, optimizer=None, loss_fn: Callable | None = None,
                 devices: Sequence[jax.Device] | None = None, shard: str | Callable = "fsdp",
                 prefetch_depth: int | None = None, max_signatures: int = 8, accumulate_grads: bool = True,
                 offload_activations: bool = False, data_parallel: bool | None = None,
                 transpose_linear: bool = True, autotune: bool = True):
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
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = AdamW.from_torch(optimizer)
        elif optimizer is not None and not isinstance(optimizer, AdamW):
            raise TypeError("optimizer must be None, an xla_swap.planning.AdamW or a torch.optim.AdamW, "
                            f"got {type(optimizer).__name__}")
        if not (callable(shard) or shard in _SHARD_RULES):
            raise ValueError(f"shard must be one of {_SHARD_RULES} or a callable (name, shape) -> spec, got {shard!r}")
        devices = list(jax.devices()) if devices is None else devices
        if isinstance(devices, jax.Device) or not isinstance(devices, Sequence) or not devices or \
                not all(isinstance(d, jax.Device) for d in devices):
            raise TypeError(f"devices must be a non-empty sequence of jax.Device, got {devices!r}")
        policy = policy or DEFAULT_POLICY
        if prefetch_depth is not None:
            policy = OffloadPolicy(params=policy.params, grads=policy.grads, activations=policy.activations,
                                   remat=policy.remat, prefetch_depth=prefetch_depth,
                                   optimizer_state=policy.optimizer_state)
        modules = ([first] if first is not None else []) + layers + ([last] if last is not None else [])
        owner: dict[int, str] = {}
        names = (["first"] if first is not None else []) + [f"layers[{i}]" for i in range(len(layers))] + \
            (["last"] if last is not None else [])
        for name, m in zip(names, modules):
            for pn, p in m.named_parameters():
                if id(p) in owner and owner[id(p)] != name:
                    raise ValueError(f"parameter {name}.{pn} is also in {owner[id(p)]}: weights shared between "
                                     "stages (tied embeddings) are not supported; untie them")
                owner[id(p)] = name
        tx = _torchax()
        env = tx.default_env()

        # ---- stage functions: one per distinct layer signature ----
        self.modules: list[torch.nn.Module] = modules
        self.stage_names: list[str] = names
        self.has_first, self.has_last = first is not None, last is not None
        self._env = env
        #: per stage, the names of the ``nn.Linear`` weights held as ``[in, out]`` on the host
        #: and the device (``transpose_linear``).
        self.transposed: list[frozenset[str]] = [_linear_weights(m) if transpose_linear else frozenset()
                                                 for m in modules]
        tr = iter(self.transposed)
        fns = []
        if first is not None:
            ffn = _module_fn(first, env, next(tr))

            def first_stage(w, inputs, ffn=ffn):
                return _split_carry(ffn(w, tuple(inputs)), "first")
            fns.append(first_stage)
        shared: dict = {}
        for i, m in enumerate(layers):
            sig, tr_i = _signature(m), next(tr)
            if sig not in shared:
                lfn = _module_fn(m, env, tr_i)

                def layer_stage(w, carry, lfn=lfn):
                    h, kw = carry
                    out = lfn(w, (h,), kw)
                    if isinstance(out, (tuple, list)):
                        out = out[0]
                    return out, kw
                shared[sig] = layer_stage
            fns.append(shared[sig])
        if last is not None:
            lastfn = _module_fn(last, env, next(tr))

            def last_stage(w, carry, lastfn=lastfn):
                return lastfn(w, (carry[0],))
            fns.append(last_stage)

        # ---- weights: torch -> host numpy (never through the device) ----
        stage_params, trainable = [], []
        for m, tr_m in zip(modules, self.transposed):
            params = {n: _to_numpy(p.t() if n in tr_m else p) for n, p in m.named_parameters()}
            buffers = {n: _to_numpy(b) for n, b in m.named_buffers()}
            trainable.append(list(params))  # ordered: every process must gather in the same order
            stage_params.append({**buffers, **params})
        self._trainable = trainable
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

        sharding = None
        if mesh is not None:
            def sharding(i, path, leaf):
                name = path[0].key
                return NamedSharding(mesh, PartitionSpec(*spec_for(name, leaf.shape, name in self.transposed[i])))

        resident = None
        k = policy.prefetch_depth
        if budget_bytes is not None:   # raises below the streaming window, before anything is built
            resident = self._resident_for_budget(stage_params, trainable, optimizer, budget_bytes, k)
            if autotune:   # stream everything until the first call chooses (the least device memory)
                resident = [False] * len(stage_params)
        if data_parallel is None:
            data_parallel = shard == "fsdp"
        #: whether activations are split over the devices on their leading dimension.
        self.data_parallel: bool = bool(data_parallel and mesh is not None)
        kwargs = dict(sharding=sharding, activation_sharding=NamedSharding(mesh, PartitionSpec()),
                      batch_axis="d" if self.data_parallel else None) \
            if sharding is not None else dict(device=devices[0])
        common = dict(optimizer=optimizer, trainable=lambda i, path: path[0].key in trainable[i],
                      track_residency=False, max_signatures=max_signatures,
                      offload_activations=offload_activations, **kwargs)
        if resident is None:
            rt = StreamingRuntime.from_policy(fns, stage_params, policy, **common)
        else:  # the policy's fields, with the residency the budget chose
            rt = StreamingRuntime(fns, stage_params, prefetch_depth=k, resident=resident,
                                  grads_to_host=policy.grads == "host",
                                  optimizer_state_on_host=policy.optimizer_state == "host",
                                  remat=_remat_from_policy(policy), **common)
        #: the :class:`~xla_swap.executors.StreamingRuntime` that runs the stages.
        self.runtime: StreamingRuntime = rt
        #: the policy in force (``budget_bytes`` given: ``params`` reads "host", see ``runtime.resident``).
        self.policy: OffloadPolicy = policy
        self.optimizer: AdamW | None = optimizer
        self.loss_fn = loss_fn
        self.accumulate_grads = accumulate_grads
        #: without an optimizer and with ``accumulate_grads=False``: the last step's gradients
        #: (per stage, ``{name: jax.Array}`` in ``pinned_host``; the names in ``transposed`` as ``[in, out]``).
        self.last_grads: list | None = None
        self._jax_losses: dict = {}
        #: the schedule chosen by :meth:`autotune` (a ``ScheduleChoice``: ``.explain()``), or ``None``.
        self.schedule = None
        self._autotune_budget: int | None = budget_bytes if autotune else None

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

        Raises: TypeError: an input is not a torch.Tensor; ValueError: a stage fails to trace
        (the message names it).
        """
        self._maybe_autotune(tuple(inputs), training=False)
        x = self._carry_in(inputs)
        out_dev = next((t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"), None)
        return self._out(self.runtime.forward(x), out_dev)

    __call__ = forward

    # ------------------------------------------------------------------ training
    def train_step(self, inputs, targets=(), *, loss_fn: Callable | None = None, lr: float | None = None
                   ) -> torch.Tensor:
        """One training step: forward, ``loss_fn(output, *targets)``, backward, optimizer step.

        Args:
          inputs: a torch tensor or a tuple of them (the arguments of ``first``).
          targets: a torch tensor or a tuple of them, passed to the loss after the output.
          loss_fn: a torch function ``(output, *targets) -> scalar`` (default: the constructor's).
          lr: this step's learning rate (a schedule), default the optimizer's.

        Returns: the loss, a 0-d float32 CPU torch tensor. With an optimizer the weights are
        updated (in host memory: ``sync_modules()`` copies them into the modules); without
        one the gradients are added to the modules' ``.grad`` (CPU tensors).

        Raises:
          TypeError: ``inputs``/``targets`` not tensors; no ``loss_fn``.
          ValueError: the loss is not a floating scalar; a stage fails to trace.
        """
        if loss_fn is None:
            loss_fn = self.loss_fn
        if loss_fn is None or not callable(loss_fn) or isinstance(loss_fn, torch.Tensor):
            raise TypeError("train_step needs a loss_fn (here or in the constructor): (output, *targets) -> scalar")
        self._maybe_autotune(tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), training=True)
        x = self._carry_in(inputs if isinstance(inputs, (tuple, list)) else (inputs,))
        t = () if targets is None or (isinstance(targets, tuple) and not targets) else \
            _inputs_to_jax(targets if isinstance(targets, (tuple, list)) else (targets,), "targets")
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
        loss, _, grads = self.runtime.train_step(x, jloss, loss_args=tuple(t), lr=lr)
        if grads is not None:
            if self.accumulate_grads:
                self._accumulate_grads(grads)
            else:
                self.last_grads = grads
        return _to_torch(loss).float()

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

    def autotune(self, inputs, *, budget_bytes: int, training: bool = True, reps: int = 3, **choose_kwargs):
        """Choose prefetch depth, resident stages, activation offload and where the optimizer state
        lives from a short measurement on the device, and run the stack with that choice from now on.

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
          **choose_kwargs: ``max_prefetch_depth``, ``allow_offload``, ``allow_device_optimizer_state``.

        Returns: the ``xla_swap.planning.chooser.ScheduleChoice`` (``.explain()``; ``.observe(step_s,
        peak_bytes)`` records measured figures beside the prediction).

        Raises: ``xla_swap.planning.InfeasibleBudgetError`` (a ``ValueError``) when nothing fits,
          ``ValueError`` / ``TypeError`` for bad arguments; the stack is unchanged then.
        """
        from xla_swap.executors.calibrate import autotune
        x = self._carry_in(inputs if isinstance(inputs, (tuple, list)) else (inputs,))
        self.runtime, choice = autotune(self.runtime, x, budget_bytes, training=training, reps=reps, **choose_kwargs)
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
        """Copy the current (trained) weights into the ``nn.Module`` parameters, in place."""
        with torch.no_grad():
            for m, sd in zip(self.modules, self.state_dicts()):
                params = dict(m.named_parameters())
                for n, t in sd.items():
                    params[n].copy_(t)

    # ------------------------------------------------------------------ internals
    def _carry_in(self, inputs):
        if not inputs:
            raise TypeError("forward/train_step need at least one input tensor")
        if not self.has_first and len(inputs) != 1:
            raise TypeError(f"without a `first` stage the layers take one input (h), got {len(inputs)}")
        x = _inputs_to_jax(tuple(inputs), "inputs", self._input_sharding)
        return x if self.has_first else (x[0], {})

    def _input_sharding(self, shape: tuple, dtype) -> jax.sharding.Sharding | None:
        """Where the runtime places an input leaf of ``shape`` (``None``: on one device)."""
        if self.mesh is None:
            return None
        return self.runtime._act(jax.ShapeDtypeStruct(shape, jnp.dtype(str(dtype).removeprefix("torch."))))

    def _out(self, y, device: torch.device | None):
        if isinstance(y, tuple) and len(y) == 2 and isinstance(y[1], dict):
            y = y[0]
        return jax.tree_util.tree_map(lambda a: _out_to_torch(a, device), y)


class _CausalLMFirst(torch.nn.Module):
    """Token embedding, rotary position embeddings and the causal mask of a Hugging Face decoder."""

    def __init__(self, embed_tokens, rotary_emb):
        super().__init__()
        self.embed_tokens, self.rotary_emb = embed_tokens, rotary_emb

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)[None, :]
        cos, sin = self.rotary_emb(h, pos)
        mask = torch.full((t, t), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device).triu(1)[None, None]
        return h, {"attention_mask": mask, "position_embeddings": (cos, sin)}


class _CausalLMLast(torch.nn.Module):
    """Final norm and LM head of a Hugging Face decoder."""

    def __init__(self, norm, lm_head):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, h):
        return self.lm_head(self.norm(h))


def causal_lm_stages(model: torch.nn.Module):
    """Split a Hugging Face Llama-style causal LM into ``(first, layers, last)`` for ``SwappedStack``.

    ``first`` embeds the tokens and computes the rotary position embeddings and a causal
    additive mask (every layer gets ``attention_mask`` and ``position_embeddings``);
    ``layers`` is ``model.model.layers`` (unmodified); ``last`` is the final norm and the LM head.
    The modules share the model's parameters (no copy).

    Args:
      model: e.g. ``transformers.LlamaForCausalLM`` (needs ``model.model.embed_tokens``,
        ``.rotary_emb``, ``.layers``, ``.norm`` and ``model.lm_head``). Inputs are unpadded
        ``input_ids`` of shape ``[batch, seq]``.

    Raises: TypeError: the model lacks one of those attributes.
    """
    inner = getattr(model, "model", None)
    need = ("embed_tokens", "rotary_emb", "layers", "norm")
    if inner is None or not all(hasattr(inner, a) for a in need) or not hasattr(model, "lm_head"):
        raise TypeError("model must be a Llama-style causal LM with model.model.embed_tokens, .rotary_emb, .layers, "
                        f".norm and model.lm_head, got {type(model).__name__}")
    if model.lm_head.weight is inner.embed_tokens.weight:
        raise ValueError("the model ties lm_head to embed_tokens (tie_word_embeddings=True); untie them for "
                         "SwappedStack")
    return _CausalLMFirst(inner.embed_tokens, inner.rotary_emb), list(inner.layers), \
        _CausalLMLast(inner.norm, model.lm_head)
