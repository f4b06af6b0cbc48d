"""Hugging Face causal LMs as ``(first, layers, last)`` stages for ``SwappedStack``, built from the model's own code.

The base model (the module holding the decoder layers) is found by ``transformers``' own accessors:
``base_model_prefix``, ``get_decoder()``, the child holding ``get_input_embeddings()``. Its ends run
the model's own forward methods, with the decoder layers replaced (:mod:`xla_swap.hf.capture`):

* ``first`` runs the base model's ``forward`` with every decoder layer replaced by a *capture*
  that records the arguments the model passes it and returns the hidden state unchanged, in
  the form the model reads (bare, or first of a tuple the model indexes with ``[0]``); the last
  capture stops the forward. So the embedding (with its own scaling), position ids, rotary or
  other position embeddings and every layer's own mask (full or sliding window, from
  ``transformers.masking_utils`` as the model calls it) are the model's. The carry holds each
  distinct keyword value once; layers that the model gives different values (e.g. Gemma-2's
  sliding and full masks) form *groups*, and each layer stage picks its group's values
  (``first.layer_keys`` and ``first.select_layer_kwargs``, read by ``SwappedStack``).
* ``last`` applies the base model's final norm (found by name, else as the child the base's
  forward applies after its layers), then runs the causal LM's own ``forward`` with the base
  model replaced by a stub that returns the normed hidden state: the head and every logit
  transform of that forward (Cohere's ``logit_scale``, Gemma-2's softcapping, ...) are the model's.

Mixture-of-experts layers run their own routing; their experts (``transformers``'
``@use_experts_implementation`` modules) run, while traced, the form the caller names:
:func:`xla_swap.hf.moe.dense_experts_forward` (``experts="dense"``) or ``sorted_experts_forward``.

A ``peft`` LoRA model is cut through the model it wraps, adapters included (:mod:`xla_swap.hf.peft_models`).

At construction a probe (a few tokens, eager torch on the CPU, the layers replaced by the
identity) checks that ``last(first(ids))`` equals the model's own logits with the same
identity layers, and that the model's forward passes the hidden state unchanged from layer
to layer. A model these stages cannot express is refused with an error naming the module and
the feature (:mod:`xla_swap.hf.refusals`), also where its own code fails or does not trace.

The module imports torch; ``transformers`` only where a model is given.
"""
from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from xla_swap.hf.capture import (OUTPUT_FORMS, BaseOutput, IdentityLayer, LayerCapture, StopForward, Swapped,
                                 final_norm, hidden_state_output, is_const, is_tensor_tree, leaves,
                                 one_sequence_per_row)
from xla_swap.hf.refusals import (KeepTensorAttributes, describe_failure, failure_module, is_tracer_error,
                                  refuse_extra_outputs, refuse_old_transformers, refuse_output_from_earlier_layers,
                                  refuse_state_between_layers, refuse_unsupported)
from xla_swap.hf.locate import locate
from xla_swap.hf.moe import FORMS, experts_while_traced
from xla_swap.hf.peft_models import peft_causal_lm

__all__ = ["causal_lm_stages", "decoder_layers", "CausalLMFirst", "CausalLMLast"]

#: small probe: batch 2, the first row left-padded (so no mask is skipped as "all ones").
_PROBE_T = 8


class CausalLMFirst(torch.nn.Module):
    """The first stage: the base model's forward up to its first decoder layer (the model's own code).

    ``forward(input_ids, attention_mask=None, position_ids=None)`` with ``input_ids`` int
    ``[batch, seq]``, ``attention_mask`` int/bool ``[batch, seq]`` (1 = token, 0 = padding,
    left or right) and ``position_ids`` int ``[batch or 1, seq]`` (default: the model's own)
    returns ``(h, kwargs)``: ``h`` the embedded input ``[batch, seq, hidden]`` (the model's
    dtype) and ``kwargs`` a dict of the distinct keyword values the model passes its layers
    (masks, position embeddings, position ids), a key ``name@g`` holding the value of group
    ``g``'s layers only. Its parameters are the base model's outside the layers and the final norm (the base's
    own, not in a child module, as ``own_<name>``).
    """

    def __init__(self, model, base, layer_attr: str, norm_attr: str | None):
        super().__init__()
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_model", model)
        self._layer_attr = layer_attr
        for name, child in base.named_children():
            if name not in (layer_attr, norm_attr):
                self.add_module(name, child)
        # the base's own tensors (e.g. RecurrentGemma's normalizer): held here as own_<name>, swapped into the
        # base while its forward runs (so a traced stage gets them as inputs)
        self._own = [n for n, _ in base.named_parameters(recurse=False)] + [n for n, _ in base.named_buffers(recurse=False)]
        for n, p in base.named_parameters(recurse=False):
            self.register_parameter("own_" + n, p)
        for n, b in base.named_buffers(recurse=False):
            self.register_buffer("own_" + n, b)
        real = getattr(base, layer_attr)
        object.__setattr__(self, "_layers", list(real))   # not submodules: read for their constant attributes
        self._signatures = [inspect.signature(m.forward) for m in real]
        self._accepts = set(inspect.signature(base.forward).parameters)
        head = model.get_output_embeddings()
        self._vocab = int(head.weight.shape[0]) if isinstance(getattr(head, "weight", None), torch.Tensor) else 2
        emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
        self._rows = int(emb.num_embeddings) if isinstance(emb, torch.nn.Embedding) else self._vocab
        rows = getattr(emb, "num_embeddings", None)
        self._probe_vocab = min(self._vocab, int(rows)) if isinstance(rows, int) and rows > 0 else self._vocab
        #: per layer, its group (an int): layers of one group get the same keyword values.
        self.layer_keys: list[int] = []
        #: per group, the constant (non-tensor) keyword arguments the model passes those layers.
        self.constants: dict[int, dict[str, Any]] = {}
        #: ``{id(parameter): name}`` in the model the stages were cut from when that is not ``causal_lm``
        #: (a PEFT model: ``xla_swap.hf.peft_models``), else ``None``: ``SwappedStack``'s checkpoint names.
        self.parameter_names: dict[int, str] | None = None
        #: the form of a decoder layer's output the model reads (:func:`layer_output`; set by the probe).
        self.output_form: int = 0

    @property
    def base_module(self) -> torch.nn.Module:
        """The model's base module (the one holding the decoder layers), read-only."""
        return self._base

    @property
    def causal_lm(self) -> torch.nn.Module:
        """The whole causal LM this stage was cut from, read-only."""
        return self._model

    @property
    def probe_vocab(self) -> int:
        """The ids the probe and ``example_inputs`` draw from: ``[0, probe_vocab)``, within the input and the
        output embedding (where the model's head has more rows than its input embedding)."""
        return self._probe_vocab

    @property
    def layer_attr(self) -> str:
        """The name of the base module's attribute holding the decoder layers (a ``ModuleList``)."""
        return self._layer_attr

    @property
    def layer_signatures(self) -> list:
        """Per decoder layer, the ``inspect.Signature`` of its ``forward``."""
        return list(self._signatures)

    @property
    def base_keywords(self) -> frozenset:
        """The parameter names of the base module's ``forward`` (``str``)."""
        return frozenset(self._accepts)

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding (the vocabulary size; 2 where the head has no weight tensor)."""
        return self._vocab

    @property
    def num_embeddings(self) -> int:
        """Rows of the input embedding (``model.get_input_embeddings()``): token ids lie in ``[0, num_embeddings)``
        (``vocab_size`` where the input embedding is not an ``nn.Embedding``)."""
        return self._rows

    def index_input_bounds(self) -> dict[int, tuple[str, int]]:
        """``{0: ("input_ids", num_embeddings)}``: the input holding token ids and their range, which
        ``SwappedStack`` checks before running (:func:`xla_swap.stack.checks.token_id_bounds`)."""
        return {0: ("input_ids", self._rows)}

    def captures(self, record: list, stop: bool, fill=None, taint: bool = False) -> torch.nn.ModuleList:
        """One :class:`LayerCapture` per decoder layer, appending to ``record``, in this model's output form
        (entries after the hidden state ``fill``; ``taint``: see :class:`LayerCapture`); with ``stop`` the
        last one ends the forward."""
        n = len(self._signatures)
        return torch.nn.ModuleList([LayerCapture(i, s, record, stop and i == n - 1, self.output_form, layer, fill,
                                                 taint) for i, (s, layer) in enumerate(zip(self._signatures,
                                                                                          self._layers))])

    def identity_layers(self) -> torch.nn.ModuleList:
        """One :class:`IdentityLayer` per decoder layer, in this model's output form."""
        return torch.nn.ModuleList([IdentityLayer(s, self.output_form, layer)
                                    for s, layer in zip(self._signatures, self._layers)])

    def run_layers(self, input_ids, attention_mask, position_ids, stop: bool, fill=None, taint: bool = False):
        """Run the base module's forward with each decoder layer replaced by a recorder.

        Args: ``input_ids`` int ``[batch, seq]``, ``attention_mask`` ``[batch, seq]`` or ``None``,
        ``position_ids`` int ``[batch or 1, seq]`` or ``None``; ``stop``: end the forward after the
        last layer; ``fill``: the stand-ins' output entries after the hidden state; ``taint``: the stand-ins
        return a new leaf requiring grad (:class:`LayerCapture`). Returns ``(record, out)``:
        per layer ``(hidden, kwargs)`` and the base's output (``None`` when stopped). Raises ``TypeError`` for ``position_ids`` the base does not take,
        ``ValueError`` when the base skips a layer or changes the hidden state between layers.
        """
        record: list = []
        n = len(self._signatures)
        caps = self.captures(record, stop, fill, taint)
        kw = {"input_ids": input_ids, "attention_mask": attention_mask}
        if position_ids is not None:
            if "position_ids" not in self._accepts:
                raise TypeError(f"{type(self._base).__name__}.forward takes no position_ids")
            kw["position_ids"] = position_ids
        if "use_cache" in self._accepts:
            kw["use_cache"] = False
        out = None
        with Swapped((self._base, self._layer_attr, caps)), self.kept_attributes():
            try:
                out = self.call_base(kw)
            except StopForward:
                pass
        if len(record) < n and not stop:
            skipped = [i for i, c in enumerate(caps) if c.returned is None]
            raise ValueError(f"{type(self._base).__name__}.forward calls {len(record)} of its {n} decoder layers: it "
                             f"skips {', '.join(f'{i} ({type(self._layers[i]).__name__})' for i in skipped)} on this "
                             "input (e.g. cross-attention layers without their encoder states); the stages run "
                             "every layer: not supported")
        if len(record) < n:
            raise ValueError(f"{type(self._base).__name__}.forward called {len(record)} of its {n} decoder layers")
        if len(record) > n:
            raise ValueError(f"{type(self._base).__name__}.forward makes {len(record)} calls to its {n} decoder "
                             "layers (a layer run more than once, as in looped or recurrent-depth models): the "
                             "stages run each layer once: not supported")
        for i in range(1, n):
            if record[i][0] is not caps[i - 1].returned:
                raise ValueError(f"{type(self._base).__name__}.forward changes the hidden state between decoder layers "
                                 f"{i - 1} and {i} (outside the layers): not expressible as a stack of layer stages")
        return record, out

    def call_base(self, kwargs: dict, holder: torch.nn.Module | None = None):
        """``base_module(**kwargs)`` with the base's own tensors as ``holder`` (default: this module) holds them
        (attributes ``own_<name>``, see the class docstring)."""
        own = {n: getattr(holder if holder is not None else self, "own_" + n) for n in self._own}
        return torch.func.functional_call(self._base, own, (), kwargs, strict=False) if own else self._base(**kwargs)

    def kept_attributes(self) -> KeepTensorAttributes:
        """A context manager restoring the tensor attributes that a forward of the base module sets on it and
        its modules outside the decoder layers (a cache built in the forward keeps no traced value)."""
        return KeepTensorAttributes([self._base] + [m for m in self.modules() if m is not self])

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        """The first layer's input and every layer's keyword arguments, as the model computes them (class
        docstring). Raises ValueError naming the module and the feature when the model's code does not trace."""
        try:
            return self._forward(input_ids, attention_mask, position_ids)
        except Exception as e:   # noqa: BLE001 - jax's tracer errors are re-raised with the model's module named
            if not is_tracer_error(e):
                raise
            raise ValueError(f"{type(self._base).__name__}.forward does not trace: {describe_failure(e)}") from e

    def _forward(self, input_ids, attention_mask, position_ids):
        if attention_mask is None and position_ids is None:
            # No mask and the model's own positions: one sequence per row, which transformers finds by
            # reading the position ids (find_packed_sequence_indices) in eager torch but cannot while
            # traced. Told so, it builds what it builds in eager torch: no mask where SDPA's is_causal
            # does the same (full-attention layers), the window mask where one is needed.
            with one_sequence_per_row():
                record, _ = self.run_layers(input_ids, None, None, stop=True)
        else:
            record, _ = self.run_layers(input_ids, attention_mask, position_ids, stop=True)
        h = record[0][0]
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(self.layer_keys):
            groups.setdefault(g, []).append(i)
        carry: dict[str, Any] = {}
        names = list(record[0][1])
        for i, (_, kw) in enumerate(record):
            if set(kw) != set(names):
                raise ValueError(f"{type(self._base).__name__}.forward passes decoder layer {i} the keyword arguments "
                                 f"{sorted(kw)}, layer 0 {sorted(names)}: the stages give every layer the same "
                                 "keyword arguments; not supported")
        for name in names:
            values = [kw[name] for _, kw in record]
            if all(is_const(v) for v in values) and not all(v is None for v in values):
                for g, idx in groups.items():
                    for i in idx:
                        if values[i] != self.constants[g].get(name, values[i]) or name not in self.constants[g]:
                            raise ValueError(f"decoder layer {i} gets {name}={values[i]!r} here, "
                                             f"{self.constants[g].get(name)!r} when the stages were built")
                continue
            for i, v in enumerate(values):
                if not (v is None or is_tensor_tree(v)):
                    raise ValueError(f"{type(self._base).__name__}.forward passes decoder layer {i} {name}= a "
                                     f"{type(v).__name__}: only tensors, tuples of tensors and constants are supported")
                if v is not None and any(t.is_complex() for t in leaves(v)):
                    raise ValueError(f"{type(self._base).__name__}.forward passes decoder layer {i} {name}= a complex "
                                     "tensor (e.g. rotary embeddings as complex numbers): not supported in the stages")
            if all(v is values[0] for v in values):
                carry[name] = values[0]
                continue
            for g, idx in groups.items():
                v = values[idx[0]]
                if not all(values[i] is v for i in idx):
                    raise ValueError(f"{type(self._base).__name__}.forward passes different {name} to decoder layers "
                                     f"{idx} of one group (found at construction): stages cannot express it")
                carry[f"{name}@{g}"] = v
        return h, carry

    def example_inputs(self) -> tuple:
        """A small input, ``(input_ids [2, 8], attention_mask [2, 8])`` with the first row left-padded:
        ``SwappedStack`` traces every stage on it at construction (a model that does not trace is refused there)."""
        return _probe_inputs(self._probe_vocab)

    def select_layer_kwargs(self, key: int, kwargs: dict) -> dict:
        """The keyword arguments of a layer of group ``key`` from the carry dict ``kwargs`` (see the class)."""
        out = dict(self.constants.get(key, {}))
        for name, v in kwargs.items():
            base, _, g = name.partition("@")
            if not g:
                out[base] = v
            elif g == str(key):
                out[base] = v
        return out


class CausalLMLast(torch.nn.Module):
    """The last stage: the base model's final norm, then the causal LM's own forward after its base model.

    ``forward(h)`` with ``h`` ``[batch, seq, hidden]`` returns the logits ``[batch, seq, vocab]``
    as the model's ``forward`` computes them from its base model's output (head, logit
    scaling, softcapping). Its parameters are the final norm's and the output embedding's.
    """

    def __init__(self, model, base, norm_attr: str | None, base_path: str | None = None):
        super().__init__()
        object.__setattr__(self, "_model", model)
        path = base_path or model.base_model_prefix
        owner, _, self._prefix = path.rpartition(".")
        object.__setattr__(self, "_owner", model.get_submodule(owner) if owner else model)
        self._norm_attr = norm_attr
        if norm_attr is not None:
            self.add_module("norm", getattr(base, norm_attr))
        self.add_module("lm_head", model.get_output_embeddings())
        self._stub = BaseOutput(base)

    @property
    def extra_fields_read(self) -> list[str]:
        """The fields of the base model's output other than ``last_hidden_state`` (outside its output class)
        that the causal LM's forward has read in this stage (they are ``None`` here)."""
        return list(self._stub.read)

    @property
    def norm_attr(self) -> str | None:
        """The name of the base model's final norm this stage applies (``None``: none)."""
        return self._norm_attr

    def forward(self, h):
        """Logits of hidden states ``h`` ``[batch, seq, hidden]`` by the model's own final norm and head.
        Raises ValueError naming the module and the feature when the model's code does not trace."""
        if self._norm_attr is not None:
            h = self.norm(h)
        self._stub.output = hidden_state_output(h, self._stub.read)
        try:
            with Swapped((self._owner, self._prefix, self._stub)):
                out = self._model(use_cache=False) if _accepts(self._model, "use_cache") else self._model()
        except Exception as e:   # noqa: BLE001 - jax's tracer errors are re-raised with the model's module named
            if not is_tracer_error(e):
                raise
            raise ValueError(f"{type(self._model).__name__}.forward after its base model does not trace: "
                             f"{describe_failure(e)}") from e
        finally:
            self._stub.output = None
        return out.logits if hasattr(out, "logits") else out[0]


def _accepts(mod, name: str) -> bool:
    return name in inspect.signature(mod.forward).parameters


def causal_lm_stages(model: torch.nn.Module, layers_attr: str | None = None, norm_attr: str | None = None,
                     experts: str = "dense"):
    """Split a Hugging Face causal LM into ``(first, layers, last)`` for ``SwappedStack``, from the model's own code.

    ``first`` (:class:`CausalLMFirst`) runs the base model's forward up to the first decoder
    layer: embedding (with its own scaling), position ids, position embeddings and the mask
    each layer gets (full or sliding window, left or right padding, by the model's config
    and ``transformers.masking_utils`` as its forward calls them); it takes
    ``(input_ids, attention_mask=None, position_ids=None)``. ``layers`` are the model's decoder
    layers, unmodified, each called with the keyword arguments the model passes it.
    ``last`` (:class:`CausalLMLast`) is the final norm and the causal LM's own head and logit
    transforms. The modules share the model's parameters (no copy).

    Args:
      model: a ``transformers`` causal LM (``...ForCausalLM``, ``GPT2LMHeadModel``): a base
        model (at ``model.base_model_prefix``, or ``model.get_decoder()``, or the child holding
        ``model.get_input_embeddings()``) whose decoder layers are a ``ModuleList`` of
        ``config.num_hidden_layers`` modules (``layers``, ``h``, ``blocks``; or ``layers_attr``);
        or a ``peft`` ``PeftModel`` of one with LoRA (or DoRA) adapters: the stages run its
        modules, adapters included, and ``first.parameter_names`` holds its parameter names
        (:mod:`xla_swap.hf.peft_models`).
      layers_attr: the name of that ``ModuleList`` in the base model, when not a common one.
      norm_attr: the name of the base model's final norm, or ``""`` for none. Default: found by
        name (``norm``, ``ln_f``, ``final_layernorm``, ...) and checked against what the base's
        forward does after its layers on the probe input; where that name does not match, the
        child of the base model that does (Lfm2's ``embedding_norm``).
      experts: how a mixture-of-experts layer's experts run in the stages (ignored for a model
        without experts): ``"dense"`` (default; every expert on every token: ``E / k`` times the
        routed expert FLOPs and ``[E, N, 2 I]`` + ``[E, N, D]`` activations per layer, plain
        einsums) or ``"sorted"`` (the ``N k`` routed (token, expert) pairs sorted by expert, one
        ``jax.lax.ragged_dot_general`` per projection: the routed FLOPs only, ``[N k, 2 I]`` +
        ``[N k, D]`` activations, plus a gather and an un-sort of ``N k D`` elements). Both equal
        ``transformers``' eager experts; see :mod:`xla_swap.hf.moe`.

    Returns: ``(first, layers, last)``: two ``nn.Module`` and a list of ``nn.Module``.

    Raises:
      TypeError: ``model`` is not a Hugging Face causal LM with a base model and an output
        embedding; no decoder layer list is found.
      ValueError: ``experts`` is not ``"dense"`` or ``"sorted"`` (raised first, nothing changed); a PEFT
        model with what :func:`xla_swap.hf.peft_models.peft_causal_lm` refuses (named).
      ValueError: the model uses something the stages cannot express (the message names the
        module and the feature): a transformation of the hidden state between layers, keyword
        arguments of other kinds than tensors and constants, parameters of the causal LM
        outside its head, a difference between the stages and the model's own forward on a
        probe input, a mixture-of-experts block outside ``transformers``' experts interface or
        with the auxiliary loss or router jitter noise asked for, complex keyword tensors; a
        parameter or buffer of the ends (outside the decoder layers) is on the meta device (the
        probe needs values: build such a model's stack with :func:`xla_swap.load_stack`, which
        loads the ends for the probe); rotary embeddings with ``rope_type`` ``"dynamic"`` (their
        frequencies depend on earlier calls); the model's own forward failing with its layers
        replaced by stand-ins, or its ends failing on the probe input (the message names where in
        the model's code, and says to pass ``norm_attr=`` where the final norm may be another).

    Mixture-of-experts layers keep their routing; their experts run in the form ``experts``
    while the stages are traced (forward hooks on those layers,
    :func:`xla_swap.hf.moe.experts_while_traced`; eager calls of the model are unchanged).
    """
    if experts not in FORMS:
        raise ValueError(f"experts must be one of {sorted(FORMS)}, got {experts!r}")
    model, names = peft_causal_lm(model)
    name = type(model).__name__
    refuse_old_transformers(name)
    base, prefix, layers_attr, found_norm = locate(model, layers_attr, norm_attr)
    layers = list(getattr(base, layers_attr))
    refuse_unsupported(model, name, prefix, layers_attr, layers)
    _refuse_parameters_outside(model, base)
    first, last = _ends(model, base, prefix, layers_attr, found_norm)
    record, out = _capture(model, first)
    if norm_attr is None:   # found by name: checked (or found) against what the base's forward does
        norm = final_norm(base, layers_attr, found_norm, record[-1][0], out, _called_before_layers(first))
        if norm != found_norm:
            form = first.output_form
            first, last = _ends(model, base, prefix, layers_attr, norm)
            first.output_form = form
    first.parameter_names = names
    _probe(model, base, layers_attr, first, last, record)
    experts_while_traced(model, layers, experts)   # the checks passed: hooks for the stages' tracing
    return first, layers, last


def decoder_layers(model: torch.nn.Module, layers_attr: str | None = None) -> torch.nn.ModuleList:
    """The decoder layer list of a Hugging Face causal LM, as :func:`causal_lm_stages` finds it.

    Raises: TypeError as :func:`causal_lm_stages` (not a causal LM; no layer list found).
    """
    base, _, layers_attr, _ = locate(peft_causal_lm(model)[0], layers_attr, None)
    return getattr(base, layers_attr)


def _refuse_parameters_outside(model, base) -> None:
    """ValueError naming a parameter of ``model`` outside its base model and its output embedding."""
    head = model.get_output_embeddings()
    base_params = {id(p) for p in base.parameters()}
    for pn, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in base_params and all(p is not q for q in head.parameters()):
            raise ValueError(f"{type(model).__name__} has parameter {pn} outside its base model and output embedding "
                             "(a head that computes more than the output embedding): not supported")


def _ends(model, base, prefix: str, layers_attr: str, norm_attr: str | None) -> tuple:
    """``(first, last)`` of a located model; ValueError when one of their tensors is on the meta device."""
    first = CausalLMFirst(model, base, layers_attr, norm_attr)
    last = CausalLMLast(model, base, norm_attr, prefix)
    for stage, m in (("first", first), ("last", last)):
        for n, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.is_meta:
                raise ValueError(f"{type(model).__name__}: {stage}.{n} is on the meta device: the probe runs the "
                                 "model's ends on values; load the model with xla_swap.load_stack(model, checkpoint)")
    return first, last


def _called_before_layers(first: CausalLMFirst) -> set:
    """The names of the base model's children its forward calls before its last decoder layer (probe input)."""
    called: set = set()
    hooks = [child.register_forward_hook(lambda *_, n=n: called.add(n))
             for n, child in first.base_module.named_children() if n != first.layer_attr]
    try:
        with torch.no_grad():
            first.run_layers(*_probe_inputs(first.probe_vocab), None, stop=True)
    finally:
        for h in hooks:
            h.remove()
    return called


def _ours(exc: BaseException) -> bool:
    """Whether ``exc`` is a ValueError / TypeError raised by xla_swap's own code (a refusal already naming the
    module and the feature)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return isinstance(exc, (ValueError, TypeError)) and tb is not None and \
        os.path.dirname(tb.tb_frame.f_code.co_filename) == os.path.dirname(__file__)


def _capture(model, first: CausalLMFirst) -> tuple:
    """Run the base model's forward on the probe input with the layers replaced by captures, in the first
    output form of :data:`OUTPUT_FORMS` the model reads (set on ``first``); returns ``run_layers``'s
    ``(record, out)``. Raises ValueError naming the module and what failed when no form runs."""
    ids, mask = _probe_inputs(first.probe_vocab)
    errors, base = [], type(first.base_module).__name__
    for form in OUTPUT_FORMS:
        first.output_form = form
        try:
            with torch.no_grad():
                found = first.run_layers(ids, mask, None, stop=False)
        except Exception as e:   # noqa: BLE001 - the next form, else the first form's error, named
            errors.append(e)
            continue
        if form >= 2:
            refuse_extra_outputs(model, first, ids, mask)
        refuse_state_between_layers(model, first, ids, mask)
        return found
    first.output_form = 0
    if _ours(errors[0]):
        raise errors[0]
    raise ValueError(f"{type(model).__name__}: {base}.forward fails with its decoder layers replaced by the stages' "
                     f"stand-ins (each returning the hidden state, bare or as the first of a tuple): "
                     f"{describe_failure(errors[0])}; the stages cannot express this model") from errors[0]


def _probe(model, base, layers_attr: str, first: CausalLMFirst, last: CausalLMLast, record: list) -> None:
    """Group the layers by the keyword values the model gives them (``record``: ``run_layers``'s on the
    probe input), and check the ends against the model's forward."""
    name = type(model).__name__
    ids, mask = _probe_inputs(first.probe_vocab)
    with torch.no_grad():
        keys: dict[tuple, int] = {}
        layer_keys, constants = [], {}
        for i, (_, kw) in enumerate(record):
            consts = {n: v for n, v in kw.items() if is_const(v) and v is not None}
            # a layer's group: its constants and, per other keyword, the first layer given that very object
            key = tuple(sorted(consts.items())) + tuple(
                (n, next(j for j in range(len(record)) if record[j][1][n] is v)) for n, v in kw.items() if n not in consts)
            if key not in keys:
                keys[key] = len(keys)
                constants[keys[key]] = consts
            layer_keys.append(keys[key])
        first.layer_keys, first.constants = layer_keys, constants
        # the model's own logits with identity layers, against last(first(...)) with the same
        ident = first.identity_layers()
        try:
            with Swapped((base, layers_attr, ident)):
                ref = model(input_ids=ids, attention_mask=mask, **({"use_cache": False} if _accepts(model, "use_cache")
                                                                    else {}))
            ref = ref.logits if hasattr(ref, "logits") else ref[0]
            h, kw = first(ids, mask)
            got = last(h)
        except Exception as e:   # noqa: BLE001 - named below unless already a refusal of this module
            if _ours(e):
                raise
            if last.extra_fields_read or failure_module(e) == name:
                read = sorted(set(last.extra_fields_read))
                raise ValueError(f"{name}.forward fails after its base model in the last stage, which calls it "
                                 "with no inputs and the base model's output replaced by the last hidden state"
                                 f"{f' (other fields it read: {read})' if read else ''}: {describe_failure(e)}; "
                                 "not supported") from e
            raise ValueError(f"{name}: the stages' ends fail on a probe input (the base model's forward does "
                             f"something after its layers that the stages do not reproduce; final norm used: "
                             f"{last.norm_attr!r}): {describe_failure(e)}; pass norm_attr= naming the base model's "
                             f"final norm (or norm_attr='' for none) if it is another") from e
    if got.shape != ref.shape or not torch.equal(got[mask.bool()], ref[mask.bool()]):
        refuse_output_from_earlier_layers(model, first, ids, mask)
        raise ValueError(f"{name}: the stages' logits differ from the model's own forward on a probe input (the "
                         f"base model's forward does something after its layers that the stages do not reproduce; "
                         f"final norm used: {last.norm_attr!r}): pass norm_attr= naming the base model's final norm "
                         f"(or norm_attr='' for none) if it is another")


def _probe_inputs(vocab: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, max(int(vocab), 1), (2, _PROBE_T), generator=g)
    mask = torch.ones(2, _PROBE_T, dtype=torch.long)
    mask[0, :2] = 0
    return ids, mask
