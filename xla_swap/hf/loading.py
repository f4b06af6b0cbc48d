"""Build a ``SwappedStack`` from a model on the meta device and a Hugging Face safetensors checkpoint,
without the model ever existing in torch's host memory.

    with torch.device("meta"):
        model = LlamaForCausalLM(config)            # structure only: no storage
    stack = xla_swap.load_stack(model, "ckpt/", dtype=torch.bfloat16,
                                optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5))

:class:`SafetensorsWeights` reads a checkpoint as ``save_pretrained`` writes it (``model.safetensors``,
or shards listed in ``model.safetensors.index.json``) one stage at a time with
``safetensors.safe_open``; ``SwappedStack(weights=...)`` copies each stage into its ``pinned_host``
buffers and drops it before reading the next. The checkpoint's keys are the model's
``state_dict()`` names; each stage tensor is found by identity in the model, so tied weights
(one tensor under several names, ``lm_head.weight`` and ``model.embed_tokens.weight``) are read
once under whichever name the checkpoint holds.

The module imports torch and safetensors; ``SwappedStack`` (torchax, jax) where a stack is built.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch

__all__ = ["SafetensorsWeights", "load_stack"]

#: file names ``save_pretrained`` writes (``transformers.utils.SAFE_WEIGHTS_NAME`` / ``SAFE_WEIGHTS_INDEX_NAME``).
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

#: safetensors' dtype names -> torch dtypes.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _checkpoint_files(path) -> dict[str, str]:
    """``{key: file}`` of a safetensors checkpoint: a ``.safetensors`` file, or a folder with
    ``model.safetensors`` or ``model.safetensors.index.json`` (its ``weight_map``)."""
    from safetensors import safe_open
    p = os.fspath(path)
    if os.path.isdir(p):
        index = os.path.join(p, SAFE_WEIGHTS_INDEX_NAME)
        single = os.path.join(p, SAFE_WEIGHTS_NAME)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"checkpoint={p!r}: {SAFE_WEIGHTS_INDEX_NAME} has no weight_map")
            files = {k: os.path.join(p, v) for k, v in weight_map.items()}
            for f in sorted(set(files.values())):
                if not os.path.isfile(f):
                    raise FileNotFoundError(f"checkpoint={p!r}: shard {os.path.basename(f)} of the index is missing")
            return files
        if os.path.isfile(single):
            p = single
        else:
            raise FileNotFoundError(f"checkpoint={p!r} holds neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}")
    elif not os.path.isfile(p):
        raise FileNotFoundError(f"checkpoint={p!r} is neither a folder nor a file")
    with safe_open(p, framework="pt") as f:
        return {k: p for k in f.keys()}


class SafetensorsWeights:
    """A Hugging Face safetensors checkpoint as the ``weights`` source of a ``SwappedStack`` whose
    modules belong to ``model`` (which may be on the meta device).

    Only the checkpoint's headers are read at construction (names, shapes, dtypes); calling the
    object reads the tensors of one stage (``safetensors.safe_open``, each file opened for that
    stage only, so no more than one stage of the checkpoint is mapped at a time).

    Args:
      model: the ``torch.nn.Module`` whose ``state_dict()`` names the checkpoint uses (e.g. a
        ``transformers`` causal LM, on the meta device or not); the stack's modules must be its
        submodules (``xla_swap.causal_lm_stages(model)``).
      path: a ``.safetensors`` file, or a folder holding ``model.safetensors`` or
        ``model.safetensors.index.json`` and its shards (``save_pretrained``'s layout).
      dtype: ``None`` (default): each tensor in the checkpoint's dtype; or a floating
        ``torch.dtype`` for every floating tensor, as ``model.to(dtype)`` casts them (buffers not in
        the checkpoint included: the stages then compute in one dtype); integer ones keep theirs.

    Attributes:
      keys: ``{id(tensor): checkpoint key}`` of the model's parameters and buffers read from it.

    Raises (at construction, nothing read or changed):
      TypeError: ``model`` not an ``nn.Module``; ``path`` not a ``str`` / ``os.PathLike``; ``dtype``
        not a floating ``torch.dtype`` or ``None``.
      FileNotFoundError: no checkpoint at ``path`` (or a shard of its index is missing).
      ValueError: the checkpoint does not match the model: parameters or persistent buffers
        missing from it, keys of it that are no tensor of the model (unexpected), or a shape that
        differs (the message names them); a dtype safetensors' torch reader does not know.
    """

    def __init__(self, model: torch.nn.Module, path, *, dtype: torch.dtype | None = None):
        from safetensors import safe_open
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"checkpoint must be a str or os.PathLike (file or folder), got {type(path).__name__}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
        files = _checkpoint_files(path)
        meta: dict[str, tuple[tuple, torch.dtype]] = {}
        for f in sorted(set(files.values())):
            with safe_open(f, framework="pt") as h:
                for k in h.keys():
                    if files.get(k) != f:
                        continue
                    sl = h.get_slice(k)
                    dt = _DTYPES.get(sl.get_dtype())
                    if dt is None:
                        raise ValueError(f"checkpoint: {k} has dtype {sl.get_dtype()}, which torch cannot read")
                    meta[k] = (tuple(sl.get_shape()), dt)
        absent = sorted(set(files) - set(meta))
        if absent:
            raise ValueError(f"checkpoint: {len(absent)} keys of the index are not in their shard files: {absent[:4]}")
        names: dict[int, list[str]] = {}
        tensors: dict[int, torch.Tensor] = {}
        for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
            names.setdefault(id(t), []).append(n)
            tensors[id(t)] = t
        persistent = set(model.state_dict(keep_vars=True))
        keys, missing = {}, []
        for i, ns in names.items():
            k = next((n for n in ns if n in meta), None)
            if k is not None:
                keys[i] = k
            elif isinstance(tensors[i], torch.nn.Parameter) or any(n in persistent for n in ns):
                missing.append(ns[0])
        used = {n for i in keys for n in names[i]}
        unexpected = sorted(set(meta) - used)
        if missing or unexpected:
            raise ValueError(f"checkpoint {os.fspath(path)!r} does not match {type(model).__name__}: "
                             f"{len(missing)} tensors missing {sorted(missing)[:4]}, "
                             f"{len(unexpected)} unexpected keys {unexpected[:4]}")
        for i, k in keys.items():
            if meta[k][0] != tuple(tensors[i].shape):
                raise ValueError(f"checkpoint: {k} has shape {list(meta[k][0])}, the model's "
                                 f"{names[i][0]} has {list(tensors[i].shape)}")
        self.path = os.fspath(path)
        self.dtype = dtype
        self.keys: dict[int, str] = keys
        self._files = files
        self._meta = meta

    def dtype_of(self, t: torch.Tensor) -> torch.dtype:
        """The dtype ``t`` (a parameter or buffer of the model) is read in: the checkpoint's, or
        ``dtype`` for a floating one (the model's own dtype for a tensor not in the checkpoint)."""
        k = self.keys.get(id(t))
        dt = t.dtype if k is None else self._meta[k][1]
        return self.dtype if self.dtype is not None and dt.is_floating_point else dt

    def read(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name: CPU tensor}`` for ``{name: tensor of the model}``: read from the checkpoint
        (cast to ``dtype``), or the tensor itself for one not in it (a non-persistent buffer).

        Raises: ValueError naming it: a tensor not in the checkpoint that is on the meta device.
        """
        from safetensors import safe_open
        out: dict[str, Any] = {}
        by_file: dict[str, list[tuple[str, str, torch.Tensor]]] = {}
        for n, t in tensors.items():
            k = self.keys.get(id(t))
            if k is None:
                if t.is_meta:
                    raise ValueError(f"{n} is on the meta device and not in the checkpoint (a non-persistent buffer): "
                                     "compute it first (load_stack does it with the model's own initialize_weights)")
                out[n] = t.to(self.dtype_of(t))
            else:
                by_file.setdefault(self._files[k], []).append((n, k, t))
        for f, items in by_file.items():
            with safe_open(f, framework="pt", device="cpu") as h:
                for n, k, t in items:
                    x = h.get_tensor(k)
                    out[n] = x.to(self.dtype_of(t))
        return {n: out[n] for n in tensors}

    def __call__(self, module: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
        """The ``SwappedStack(weights=...)`` protocol: ``{name: CPU tensor}`` for the parameters and
        buffers ``names`` of ``module`` (a submodule of the model)."""
        own = {**dict(module.named_buffers()), **dict(module.named_parameters())}
        return self.read({n: own[n] for n in names})


def load_stack(model: torch.nn.Module, checkpoint, *, dtype: torch.dtype | None = None,
               layers_attr: str | None = None, norm_attr: str | None = None, experts: str = "dense",
               **stack_kwargs):
    """A ``SwappedStack`` of a Hugging Face causal LM whose weights come from a safetensors checkpoint.

    The model may be on the meta device (``with torch.device("meta"): model = Cls(config)``,
    or ``accelerate.init_empty_weights()``): then the whole model never exists in torch's
    memory. The steps:

    1. the checkpoint's headers are checked against the model (:class:`SafetensorsWeights`:
       missing / unexpected keys and shapes are refused before anything is read or changed);
    2. non-persistent buffers on the meta device (rotary ``inv_freq``) are computed in place, on
       the CPU, by the model's own ``initialize_weights()`` (transformers' init, which computes
       them as the model's constructor does); a model without it is refused;
    3. the parameters outside the decoder layers (embedding, final norm, head: what
       ``causal_lm_stages``' probe runs) are read into the model for the probe only
       (``torch.utils.swap_tensors``: the parameter objects stay the same, so an optimizer
       built over ``model.parameters()`` still matches) and put back on the meta device after;
    4. ``SwappedStack(layers, first=first, last=last, weights=SafetensorsWeights(...))`` reads
       the checkpoint one stage at a time into ``pinned_host``.

    With ``dtype`` and a model on the meta device, the model is cast first (``model.to(dtype)``:
    no memory, the same parameter objects), since a forward reads its modules' dtype.

    Host memory (beyond the stack's own weights and optimizer state): the ends' weights during
    the probe (released before the stack is built), then one stage's tensors at a time.

    Args:
      model: a ``transformers`` causal LM (see ``causal_lm_stages``), on the meta device or not
        (a model with real weights is not changed; the stack holds the checkpoint's values).
      checkpoint: a ``.safetensors`` file, or a folder as ``save_pretrained`` writes it (one
        ``model.safetensors``, or shards and ``model.safetensors.index.json``).
      dtype: ``None`` (the checkpoint's dtypes) or a floating ``torch.dtype`` every floating
        tensor is held in (e.g. ``torch.bfloat16``), buffers included, as ``model.to(dtype)`` casts.
      layers_attr, norm_attr, experts: as for ``causal_lm_stages`` (``experts``: ``"dense"`` or
        ``"sorted"``, the form a mixture-of-experts model's experts run in).
      **stack_kwargs: ``SwappedStack``'s keyword arguments (``optimizer``, ``policy``,
        ``budget_bytes``, ...), except ``first``, ``last`` and ``weights``.

    Returns: the ``SwappedStack``. Its modules are the model's (on the meta device when the model
      was): ``sync_modules`` then refuses; ``state_dicts()`` / ``save_checkpoint()`` read the weights.

    Raises: TypeError: ``model`` not an ``nn.Module`` or not a causal LM; ``checkpoint`` / ``dtype``
      of the wrong type; ``first`` / ``last`` / ``weights`` in ``stack_kwargs``.
      FileNotFoundError: no checkpoint there. ValueError: ``experts`` not ``"dense"`` / ``"sorted"``
      (before anything is read); the checkpoint does not match the
      model (names the keys and shapes); a meta non-persistent buffer the model cannot compute
      (no ``initialize_weights``, or some parameters real); ``causal_lm_stages``' and
      ``SwappedStack``'s errors.
    """
    from xla_swap.hf.causal_lm import decoder_layers
    from xla_swap.stack.swapped_stack import SwappedStack
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    bad = sorted(set(stack_kwargs) & {"first", "last", "weights", "layers"})
    if bad:
        raise TypeError(f"load_stack builds {bad} itself from the model and checkpoint; do not pass them")
    from xla_swap.hf.moe import FORMS
    if experts not in FORMS:
        raise ValueError(f"experts must be one of {sorted(FORMS)}, got {experts!r}")
    src = SafetensorsWeights(model, checkpoint, dtype=dtype)
    layers = decoder_layers(model, layers_attr)
    if dtype is not None and all(p.is_meta for p in model.parameters()):
        model.to(dtype)   # the modules' own dtype is what their forward reads (no memory on meta; same objects)
    _compute_meta_buffers(model, src)
    first, layer_list, last = _stages_with_real_ends(model, layers, src, layers_attr, norm_attr, experts)
    return SwappedStack(layer_list, first=first, last=last, weights=src, **stack_kwargs)


def _compute_meta_buffers(model: torch.nn.Module, src: "SafetensorsWeights") -> None:
    """Non-persistent buffers on the meta device (rotary ``inv_freq``) computed in place on the CPU by
    the model's own ``initialize_weights()``; a model that cannot is refused (``ValueError``)."""
    meta_buffers = [(n, b) for n, b in model.named_buffers() if b.is_meta and id(b) not in src.keys]
    if not meta_buffers:
        return
    init = getattr(model, "initialize_weights", None)
    real = next((n for n, p in model.named_parameters() if not p.is_meta), None)
    if not callable(init) or real is not None:
        why = "the model has no initialize_weights()" if not callable(init) else \
            f"the model's init would overwrite its real parameter {real}"
        raise ValueError(f"buffer {meta_buffers[0][0]} is on the meta device and not in the checkpoint, and {why}; "
                         "build the model with accelerate.init_empty_weights() (buffers stay real)")
    for n, b in meta_buffers:   # only non-persistent buffers can be absent from a matching checkpoint
        owner, _, bn = n.rpartition(".")
        model.get_submodule(owner).register_buffer(bn, torch.empty_like(b, device="cpu"), persistent=False)
    init()


def _stages_with_real_ends(model: torch.nn.Module, layers, src: "SafetensorsWeights", layers_attr, norm_attr,
                           experts: str) -> tuple:
    """``causal_lm_stages(model, ...)`` with the parameters outside the decoder layers read from ``src``
    for its probe (``torch.utils.swap_tensors``: the same parameter objects) and put back after."""
    from xla_swap.hf.causal_lm import causal_lm_stages
    in_layers = {id(t) for m in layers for t in list(m.parameters()) + list(m.buffers())}
    ends = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_meta and id(t) not in in_layers}
    swapped = []
    try:
        for n, t in src.read(ends).items():
            real = torch.nn.Parameter(t, requires_grad=ends[n].requires_grad) \
                if isinstance(ends[n], torch.nn.Parameter) else t
            torch.utils.swap_tensors(ends[n], real)
            swapped.append((ends[n], real))
        return causal_lm_stages(model, layers_attr, norm_attr, experts=experts)
    finally:
        for t, real in reversed(swapped):
            torch.utils.swap_tensors(t, real)
        del swapped
