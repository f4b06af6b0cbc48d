"""The stage split of the torch entry point: what a stage is made of, shared by ``SwappedStack`` and the
Hugging Face adapters (``xla_swap.hf``, ``xla_swap.hf.generate``).

* **Tensors.** :func:`stage_tensors`: a stage's buffers and parameters, from the module or a
  ``weights`` source (checked).
* **Layout.** :func:`linear_weights`: the ``nn.Linear`` weights held transposed (``[in, out]``);
  :func:`embedding_padding_rows`: the rows that get no gradient.
* **Sharing.** :func:`layer_groups`: layers that compute the same thing (:func:`program_key`) share
  one compiled function;
  :func:`tied_parameters`: the weights ``first`` and ``last`` share (tied embeddings).
* **Carry.** :func:`split_carry` reads ``first``'s ``(h, layer_kwargs)``;
  :func:`layer_selection` gives each layer its keyword arguments; :data:`TIED` prefixes the
  carry keys of tied weights.
* **Functions.** :func:`stage_functions`: the JAX function of every stage, ``f(w, carry)``.
* **Host weights.** :func:`host_stages`: every stage's tensors in ``pinned_host``, one stage at a time.
* **The stack's view.** :class:`StageLayout`: the stages' modules, names and layouts, as the stack's parts read them.

The module imports torch and jax; torchax only through the environment it is given.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from xla_swap.distributed import check_ranks_hold_the_same, value_crc
from xla_swap.executors.pytrees import check_input_dtypes
from xla_swap.executors.transfers import put
from xla_swap.hf.refusals import describe_failure
from xla_swap.stack.mixed_precision import is_float
from xla_swap.stack.torch_bridge import inputs_to_jax, module_fn, to_numpy

__all__ = ["linear_weights", "embedding_padding_rows", "stage_signature", "layer_selection", "TIED", "split_carry",
           "stage_tensors", "tied_parameters", "stage_avals", "program_key", "attribute_key",
           "attribute_keys", "layer_groups", "example_carry", "stage_functions", "host_stages",
           "StageLayout"]


def linear_weights(mod: torch.nn.Module) -> frozenset[str]:
    """Names (as in ``mod.named_parameters()``) of the 2-D ``weight`` of every ``nn.Linear`` in ``mod``."""
    names = set()
    for prefix, sub in mod.named_modules():
        w = getattr(sub, "weight", None) if isinstance(sub, torch.nn.Linear) else None
        if isinstance(w, torch.nn.Parameter) and w.dim() == 2:
            names.add(f"{prefix}.weight" if prefix else "weight")
    own = {n for n, _ in mod.named_parameters()}
    return frozenset(names & own)


def embedding_padding_rows(mod: torch.nn.Module) -> dict[str, int]:
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


def stage_signature(mod: torch.nn.Module) -> tuple:
    """``(type, ((name, shape, dtype), ...))`` of ``mod``'s state: layers of another signature never share a function."""
    return (type(mod), tuple((n, tuple(t.shape), t.dtype) for n, t in mod.state_dict(keep_vars=True).items()))


def layer_selection(first, n_layers: int):
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
TIED = "xla_swap.tied:"


def split_carry(out, stage: str):
    """``(h, dict of layer keyword tensors)`` from what ``stage`` returned: a tensor (``{}``) or ``(h, dict)``.

    Raises: TypeError naming ``stage``: another tuple or list.
    """
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict):
        return out[0], dict(out[1])
    if isinstance(out, (tuple, list)):
        raise TypeError(f"{stage} must return a tensor or (tensor, dict of layer keyword tensors), "
                        f"got a {type(out).__name__} of length {len(out)}")
    return out, {}


def stage_tensors(stage: str, mod: torch.nn.Module, pnames: list, weights) -> dict:
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


def tied_parameters(names: list[str], modules: list[torch.nn.Module]) -> tuple[dict[int, str], dict[str, str]]:
    """``(owner, tied)`` of the stages ``modules`` named ``names`` (``"first"``, ``"layers[i]"``, ``"last"``):
    ``owner`` maps ``id(parameter)`` to the name of the stage holding it, ``tied`` maps a parameter
    name in ``last`` to its name in ``first`` for the weights those two share (tied embeddings).

    Raises: ValueError naming the parameter: one shared by two stages other than ``first`` and ``last``.
    """
    owner: dict[int, str] = {}
    name_in_first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, m in zip(names, modules):
        for pn, p in m.named_parameters():
            if id(p) in owner and owner[id(p)] != name:
                if owner[id(p)] == "first" and name == "last":
                    tied[pn] = name_in_first[id(p)]
                    continue
                raise ValueError(f"parameter {name}.{pn} is also in {owner[id(p)]}: weights shared between "
                                 "stages are supported between first and last only (tied embeddings)")
            owner[id(p)] = name
            if name == "first":
                name_in_first[id(p)] = pn
    return owner, tied


def stage_avals(mod: torch.nn.Module, transposed: frozenset = frozenset()) -> dict:
    """``{name: jax.ShapeDtypeStruct}`` of ``mod``'s buffers and parameters as a stage function takes
    them (buffers first; the names in ``transposed`` as ``[in, out]``). Meta tensors are fine."""
    def aval(n, t):
        dt = jnp.bfloat16 if t.dtype == torch.bfloat16 else torch.empty(0, dtype=t.dtype).numpy().dtype
        return jax.ShapeDtypeStruct(tuple(t.shape[::-1]) if n in transposed else tuple(t.shape), dt)
    return {n: aval(n, t) for n, t in list(mod.named_buffers()) + list(mod.named_parameters())}


def program_key(fn: Callable, *avals) -> tuple:
    """What ``fn`` computes on ``avals`` (pytrees of ``ShapeDtypeStruct``), hashable: the text of its
    jaxpr (every operation with its parameters and literals: a scale, a top-k, a branch taken in
    Python) and the shape, dtype and bytes of each constant it closes over. Equal keys: one program."""
    closed = jax.make_jaxpr(fn)(*avals)
    consts = []
    for c in closed.consts:
        a = np.asarray(c)
        consts.append((a.shape, str(a.dtype), hashlib.sha256(a.tobytes()).hexdigest()))
    return str(closed.jaxpr), tuple(consts)


_PLAIN = (bool, int, float, str, type(None))


def attribute_key(mod: torch.nn.Module, skip: frozenset = frozenset()) -> tuple:
    """The plain Python settings of ``mod`` and its submodules, hashable: every public attribute
    whose value is a bool, int, float, str or ``None`` (or a tuple / list of them), as
    ``(submodule name, attribute, value)``, less the ``(submodule name, attribute)`` pairs in ``skip``.
    Layers whose keys differ may compute different things."""
    out = []
    for prefix, sub in mod.named_modules():
        for k, v in sorted(vars(sub).items()):
            if k.startswith("_") or k == "training" or (prefix, k) in skip:
                continue
            if isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v):
                v = tuple(v)
            elif not isinstance(v, _PLAIN):
                continue
            out.append((prefix, k, v))
    return tuple(out)


def attribute_keys(layers: list) -> list[tuple]:
    """Per layer, its :func:`attribute_key` with the layer's index read as the model reads it.

    An int attribute that counts the layers (``layer_idx`` 0, 1, ..., ``layer_number`` 1, 2, ...)
    is the layer's index, not a setting: it is left out, and in its place go the entries at that
    index of every list in the ``config`` of the layer's submodules holding one entry per layer or
    more (``config.layer_types[i]``, ``config.no_rope_layers[i]``: what a model reads by index)."""
    keys = [attribute_key(m) for m in layers]
    if len(layers) < 2:
        return keys
    values: dict = {}
    for key in keys:
        for prefix, k, v in key:
            values.setdefault((prefix, k), []).append(v)
    counts = frozenset(pk for pk, vs in values.items() if len(vs) == len(layers) and
                       all(type(v) is int for v in vs) and all(b - a == 1 for a, b in zip(vs, vs[1:])))
    if not counts:
        return keys
    out, (prefix, k) = [], min(counts)
    for m in layers:
        idx = getattr(m.get_submodule(prefix), k) - values[(prefix, k)][0]
        configs = {id(c): c for _, sub in m.named_modules() if (c := getattr(sub, "config", None)) is not None}
        read = tuple((name, v[idx]) for c in configs.values() for name, v in sorted(vars(c).items())
                     if isinstance(v, (list, tuple)) and len(v) >= len(layers) and not name.startswith("_"))
        out.append((attribute_key(m, counts), repr(read)))
    return out


def _layer_stage(m: torch.nn.Module, env, transposed: frozenset, key, select, tied: dict):
    """Layer ``m``'s stage function ``f(w, (h, layer_kwargs)) -> (h', layer_kwargs)``."""
    layer_fn = module_fn(m, env, transposed, embedding_padding_rows(m))

    def layer_stage(w, carry):
        h, kw = carry
        own = {n: v for n, v in kw.items() if not n.startswith(TIED)} if tied else kw
        out = layer_fn(w, (h,), own if select is None else select(key, own))
        if isinstance(out, (tuple, list)):
            out = out[0]
        return out, kw
    return layer_stage


def layer_groups(layers: list, fns: list, transposed: list, keys: list, carry=None) -> list[int]:
    """Per layer, the index of its group: layers of one group compute the same thing and share one
    stage function (one executable per kind and input signature).

    Layers are told apart by type, state names, shapes and dtypes (:func:`stage_signature`) and
    keyword key (``keys``), then by what they compute: with ``carry`` (the avals of a layer input,
    ``(h, layer_kwargs)``), by the :func:`program_key` of each layer's function ``fns[i]`` traced on
    it, so that a per-layer Python setting read in ``forward`` (rotary on or off, a scale, a top-k,
    ``config.layer_types[self.layer_idx]``) gives its layer its own function; without ``carry``, by
    :func:`attribute_keys` (every layer holding another plain setting gets its own).

    Raises: ValueError naming the layer and its module when a layer does not trace on ``carry``, and where
      in the model's code and why (``xla_swap.hf.refusals.describe_failure``).
    """
    found: dict = {}
    groups = []
    plain = attribute_keys(layers) if carry is None else None
    for i, (m, f) in enumerate(zip(layers, fns)):
        try:
            what = program_key(f, stage_avals(m, transposed[i]), carry) if carry is not None else plain[i]
        except Exception as e:  # noqa: BLE001  (any trace failure is refused with the layer named)
            raise ValueError(f"layers[{i}] ({type(m).__name__}) does not trace with torchax on an example input: "
                             f"{describe_failure(e)}\n(details: {type(e).__name__}: {e})") from e
        groups.append(found.setdefault((stage_signature(m), keys[i], what), len(found)))
    return groups


def example_carry(first, first_fn: Callable, transposed: frozenset):
    """The avals of the layers' input, ``first_fn`` traced (shapes only) on ``first.example_inputs()``;
    ``None`` when ``first`` is ``None`` or has no ``example_inputs``."""
    example = getattr(first, "example_inputs", None)
    if not callable(example):
        return None
    return jax.eval_shape(first_fn, stage_avals(first, transposed), inputs_to_jax(tuple(example()), "example_inputs"))


def stage_functions(first, layers: list, last, env, transposed: list[frozenset], tied: dict[str, str]) -> tuple:
    """The JAX function of every stage (``first`` when given, each layer, ``last`` when given), in
    order, and the layers' groups (:func:`layer_groups`).

    ``first(w, inputs) -> (h, layer_kwargs)`` (the carry; with ``tied``, the shared weights in
    torch's layout under :data:`TIED` keys), ``layer(w, (h, layer_kwargs)) -> (h, layer_kwargs)``,
    ``last(w, (h, layer_kwargs)) -> out``. Layers of one group share one function object (one
    compiled executable per kind and input signature). ``transposed`` has one entry per stage
    (:func:`xla_swap.stack.torch_bridge.module_fn`).

    Returns: ``(fns, groups)``: a list with one function per stage, and per layer its group index.

    Raises: TypeError from :func:`layer_selection`; ValueError from :func:`layer_groups`.
    """
    fns, carry = [], None
    layer_transposed = transposed[1:] if first is not None else transposed
    if first is not None:
        first_fn = module_fn(first, env, transposed[0], embedding_padding_rows(first))
        first_transposed = transposed[0]

        def first_stage(w, inputs):
            h, kw = split_carry(first_fn(w, tuple(inputs)), "first")
            for name_last, name_first in tied.items():  # in torch's layout
                kw[TIED + name_last] = jnp.swapaxes(w[name_first], 0, 1) if name_first in first_transposed \
                    else w[name_first]
            return h, kw
        fns.append(first_stage)
        carry = example_carry(first, first_stage, first_transposed)
    keys, select = layer_selection(first, len(layers))
    own = [_layer_stage(m, env, layer_transposed[i], keys[i], select, tied) for i, m in enumerate(layers)]
    groups = layer_groups(layers, own, layer_transposed, keys, carry)
    fns += [own[groups.index(g)] for g in groups]
    if last is not None:
        last_fn = module_fn(last, env, transposed[-1], embedding_padding_rows(last))

        def last_stage(w, carry):
            if tied:
                w = {**w, **{n: carry[1][TIED + n] for n in tied}}
            return last_fn(w, (carry[0],))
        fns.append(last_stage)
    return fns, groups


def host_stages(names: list[str], modules: list[torch.nn.Module], transposed: list[frozenset], tied: dict,
                weights: Callable | None, host_sharding: Callable, compute_dtype, group_of: dict[int, int]) -> tuple:
    """Every stage's buffers and parameters copied into ``pinned_host``, one stage at a time (never
    through the device; copies: the modules' storage is not aliased).

    With several processes (``torchrun``) each process places only its own devices' slices of every
    array (``xla_swap.executors.transfers.put``), and the processes then compare a CRC-32 of every
    array they read (``xla_swap.distributed.check_ranks_hold_the_same``): one exchange of a few bytes
    per array, where ``jax.device_put`` would gather each whole array from every process to check it.

    Returns: ``(params, trainable, updated, groups)``, each a list with one entry per stage:
    ``{name: jax.Array}`` in ``pinned_host`` (buffers first), the parameter names (ordered), the
    names with ``requires_grad`` (a set), ``{name: torch param_group index}``.

    Args:
      names, modules: the stages (``"first"``, ``"layers[i]"``, ``"last"``) and their modules.
      transposed: per stage, the names held as ``[in, out]`` (``linear_weights``).
      tied: ``{name in last: name in first}``; ``last`` does not hold these.
      weights: ``None`` (the modules' own tensors) or ``weights(module, names) -> {name: tensor}``.
      host_sharding: ``(stage, name, shape) -> Sharding`` in ``pinned_host``.
      compute_dtype: the mixed-precision compute dtype, or ``None``; with one, floating parameters
        must be float32 (the master weights).
      group_of: ``{id(parameter): torch param_group index}`` (missing: group 0).

    Raises: the errors of :func:`stage_tensors`; TypeError for a ``float64`` tensor with x64 off
      (``check_input_dtypes``); ValueError naming the tensor: a floating parameter that is not
      float32 with ``compute_dtype``; ValueError on every process: the processes read other values
      (the first differing tensor named).
    """
    stage_params, trainable, updated, groups = [], [], [], []
    several, held = jax.process_count() > 1, []
    for i, (name, m, stage_transposed) in enumerate(zip(names, modules, transposed)):
        pnames = [n for n, _ in m.named_parameters() if not (name == "last" and n in tied)]
        tensors = stage_tensors(name, m, pnames, weights)
        arrays = {n: to_numpy(t.t() if n in stage_transposed else t) for n, t in tensors.items()}
        del tensors
        check_input_dtypes(arrays, name)  # float64 weights would run as float32 without x64
        if compute_dtype is not None:
            for n in pnames:
                if is_float(arrays[n].dtype) and arrays[n].dtype != np.float32:
                    raise ValueError(f"mp_policy.param_dtype keeps float32 master weights: weights gives "
                                     f"{name}.{n} as {arrays[n].dtype}; give float32 tensors")
        # each stage is placed in pinned_host as soon as it is read and handed to the runtime as its own;
        # with several processes each places its own devices' slices (``put``: no collective per array)
        placed = {}
        for n in list(arrays):
            a = arrays.pop(n)
            if several:
                held.append((f"{name}.{n}", value_crc(a)))
            placed[n] = put(a, host_sharding(i, n, a.shape), may_alias=False)
            del a
        trainable.append(pnames)  # ordered: every process must gather in the same order
        # the optimizer updates what torch's would: parameters with requires_grad (frozen ones get no .grad)
        updated.append({n for n, p in m.named_parameters() if p.requires_grad})
        groups.append({n: group_of.get(id(p), 0) for n, p in m.named_parameters()})
        stage_params.append({**{n: placed[n] for n in placed if n not in pnames},
                             **{n: placed[n] for n in pnames}})
    check_ranks_hold_the_same("the stages' weights", [h[0] for h in held], [h[1] for h in held])
    return stage_params, trainable, updated, groups


class StageLayout:
    """What the stack's parts (training, checkpoints, the weights' copies) need to know of its stages, fixed at
    construction: the modules in order, their names, the weights held transposed and the trainable names.

    Attributes:
      modules: the stages' ``nn.Module`` in order (``first``, the layers, ``last``).
      names: ``"first"``, ``"layers[i]"``, ``"last"``, one per stage.
      transposed: per stage, the names of the ``nn.Linear`` weights held ``[in, out]`` (``linear_weights``).
      trainable: per stage, the names of the parameters the optimizer updates (``requires_grad``).
      checkpoint_names: ``{(stage, name): fqn}`` from ``first.parameter_names`` (a PEFT model's), else ``{}``.
      has_first, has_last: whether ``first`` / ``last`` were given.
    """

    def __init__(self, modules: list, names: list[str], transposed: list, trainable: list, checkpoint_names: dict,
                 has_first: bool, has_last: bool):
        self.modules, self.names, self.transposed, self.trainable = modules, names, transposed, trainable
        self.checkpoint_names, self.has_first, self.has_last = checkpoint_names, has_first, has_last

    def torch_layout(self, stage: int, name: str, t: torch.Tensor) -> torch.Tensor:
        """A host-layout tensor of ``name`` in stage ``stage`` in torch's layout (``transposed`` ones back to
        ``[out, in]``)."""
        return t.t().contiguous() if name in self.transposed[stage] else t

    def fqn(self, stage: int, name: str) -> str:
        """torch-style name of parameter ``name`` of ``stage``: its name in the model the stages were cut
        from where ``checkpoint_names`` has it (a PEFT model's), else ``layers.3.mlp.up_proj.weight``."""
        own = self.checkpoint_names.get((stage, name))
        return own if own is not None else f"{self.names[stage].replace('[', '.').replace(']', '')}.{name}"
