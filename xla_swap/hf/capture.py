"""The stand-ins :mod:`xla_swap.hf` puts in place of a causal LM's decoder layers while the model's own
forward runs (recording what each layer is given), the stub standing in for the base model in the
last stage (:class:`BaseOutput`), and the small helpers they share with :mod:`xla_swap.hf.kv_cache`.
Imports torch; ``transformers`` where a model's forward runs.
"""
from __future__ import annotations

import inspect

import torch

__all__ = ["StopForward", "layer_output", "OUTPUT_FORMS", "Unused", "holds", "StandIn", "LayerCapture",
           "IdentityLayer", "is_tensor_tree", "leaves", "is_const", "Swapped", "one_sequence_per_row", "final_norm",
           "hidden_state_output", "BaseOutput"]


class StopForward(Exception):
    """Raised by the last capture: the first stage needs nothing after the layers' inputs."""


def layer_output(h, form: int, fill=None):
    """A decoder layer's output in the form its model reads: ``h`` itself (``form`` 0) or a tuple of
    ``form`` entries, ``h`` first and ``fill`` after (a layer returning ``(hidden, attention weights, ...)``
    that the model indexes with ``[0]`` or unpacks)."""
    return h if form == 0 else (h,) + (fill,) * (form - 1)


#: the output forms tried for the layers' stand-ins (``layer_output``), in order.
OUTPUT_FORMS = (0, 1, 2, 3)


class Unused:
    """The ``fill`` of a check: an output entry after the hidden state that no later computation may read."""

    def __repr__(self):
        return "<a decoder layer's output after the hidden state>"


def holds(v, marker) -> bool:
    """Whether ``v`` is ``marker`` or a (nested) tuple / list / dict holding it."""
    if v is marker:
        return True
    if isinstance(v, (tuple, list)):
        return any(holds(x, marker) for x in v)
    if isinstance(v, dict):
        return any(holds(x, marker) for x in v.values())
    return False


class StandIn(torch.nn.Module):
    """A module standing in for ``real`` (a decoder layer or the base model; not registered as a submodule):
    an attribute it lacks is read from ``real`` when it is a constant (``layer.attention_type``); any other
    one raises ``AttributeError`` naming ``real``'s class and the attribute (the stand-in has no submodules)."""

    def __init__(self, real: torch.nn.Module | None):
        super().__init__()
        object.__setattr__(self, "real", real)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            real = self.__dict__.get("real")
            if real is None or name.startswith("__"):
                raise
        v = getattr(real, name)
        if is_const(v):
            return v
        raise AttributeError(f"the model's forward reads .{name} (a {type(v).__name__}) of {type(real).__name__} "
                             "around its call; the stages replace that module there and pass on its constant "
                             "attributes only")


class LayerCapture(StandIn):
    """Stands in for decoder layer ``index`` (``real``, see :class:`StandIn`) while the model's own forward
    runs: appends ``(hidden_state, {argument name: value})`` to ``record`` (the layer's arguments bound to
    its ``signature``, ``**kwargs`` flattened) and returns the hidden state unchanged in the output form
    ``form`` (:func:`layer_output`, entries after it ``fill``), or raises :class:`StopForward` when ``stop``.
    With ``taint`` the hidden state returned is a new leaf tensor of the same values requiring grad (what
    the model computes from it then requires grad: a check of what depends on the layers' outputs).
    ``returned`` is the hidden state it last returned. Raises ``TypeError`` when the call does not bind."""

    def __init__(self, index: int, signature: inspect.Signature, record: list, stop: bool, form: int = 0,
                 real: torch.nn.Module | None = None, fill=None, taint: bool = False):
        super().__init__(real)
        self.index, self.signature, self.stop, self.form, self.taint = index, signature, stop, form, taint
        object.__setattr__(self, "record", record)
        object.__setattr__(self, "fill", fill)
        object.__setattr__(self, "returned", None)

    def forward(self, *args, **kwargs):
        """Record ``(hidden_state, arguments)`` and return the hidden state (raise ``StopForward`` when ``stop``)."""
        bound = self.signature.bind(*args, **kwargs).arguments
        extra = bound.pop(next(n for n, p in self.signature.parameters.items()
                               if p.kind == p.VAR_KEYWORD), {}) if any(
            p.kind == p.VAR_KEYWORD for p in self.signature.parameters.values()) else {}
        bound.update(extra)
        h = bound.pop(next(iter(self.signature.parameters)))
        self.record.append((h, bound))
        if self.stop:
            raise StopForward
        out = h.detach().requires_grad_() if self.taint and isinstance(h, torch.Tensor) else h
        object.__setattr__(self, "returned", out)
        return layer_output(out, self.form, self.fill)


def is_tensor_tree(v) -> bool:
    """Whether ``v`` is a tensor or a non-empty (nested) tuple / list of tensors only."""
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, (tuple, list)) and v:
        return all(is_tensor_tree(x) for x in v)
    return False


def leaves(v) -> list:
    """The tensors of a tensor tree (``is_tensor_tree``), in order."""
    return [v] if isinstance(v, torch.Tensor) else [t for x in v for t in leaves(x)]


def is_const(v) -> bool:
    """Whether ``v`` is a Python constant a stage can close over (``None``, bool, int, float, str)."""
    return v is None or isinstance(v, (bool, int, float, str))


class Swapped:
    """Context manager: ``setattr(obj, name, value)`` for each ``(obj, name, value)`` triple for its
    duration, the old values restored on exit (in reverse order, also when the body raises)."""

    def __init__(self, *triples):
        self.triples, self.old = triples, []

    def __enter__(self):
        for obj, name, value in self.triples:
            self.old.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

    def __exit__(self, *exc):
        for obj, name, value in reversed(self.old):
            setattr(obj, name, value)
        self.old = []


class one_sequence_per_row:
    """Context manager: ``transformers.masking_utils.find_packed_sequence_indices`` returns ``None`` (no
    packed sequences), its eager result for position ids ``0..T-1`` in every row."""

    def __enter__(self):
        import transformers.masking_utils as mu
        self.saved = getattr(mu, "find_packed_sequence_indices", None)
        if self.saved is not None:
            mu.find_packed_sequence_indices = lambda position_ids: None
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            import transformers.masking_utils as mu
            mu.find_packed_sequence_indices = self.saved


class IdentityLayer(StandIn):
    """Stands in for decoder layer ``real`` (:class:`StandIn`): returns its hidden-state argument (bound to
    ``signature``) unchanged, in the output form ``form`` (:func:`layer_output`)."""

    def __init__(self, signature, form: int, real: torch.nn.Module | None = None):
        super().__init__(real)
        self.signature, self.form = signature, form

    def forward(self, *args, **kwargs):
        """The hidden-state argument, in the output form."""
        h = self.signature.bind(*args, **kwargs).arguments[next(iter(self.signature.parameters))]
        return layer_output(h, self.form)


def final_norm(base, layers_attr: str, norm_attr: str | None, h, out, before=frozenset()) -> str | None:
    """The name of ``base``'s child (not ``layers_attr``, none of ``before``: the children its forward calls
    before the layers) that its forward applies to the last layer's output ``h`` (``[batch, seq, hidden]``)
    to give its own output ``out`` (a model output or tuple): ``norm_attr`` when it does; else ``None`` when
    ``out`` equals ``h``; else the one other child that does (dropout and identity modules left out); else
    ``norm_attr`` (also when ``out`` holds no tensor, or several children do). Each child is tried in eager
    torch (one failing on ``h`` is passed over)."""
    y = getattr(out, "last_hidden_state", None) if out is not None else None
    if y is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        y = out[0]
    if not isinstance(y, torch.Tensor):
        return norm_attr
    skip = (torch.nn.Identity, torch.nn.Dropout, torch.nn.ModuleList, torch.nn.ModuleDict)

    def gives_y(name):
        try:
            got = getattr(base, name)(h)
        except Exception:   # noqa: BLE001 - a child that does not take one hidden state
            return False
        return isinstance(got, torch.Tensor) and got.shape == y.shape and torch.equal(got, y)

    with torch.no_grad():
        if norm_attr and norm_attr not in before and gives_y(norm_attr):
            return norm_attr
        if y is h or (y.shape == h.shape and torch.equal(h, y)):
            return None
        found = [n for n, child in base.named_children() if n not in (layers_attr, norm_attr) and n not in before
                 and not isinstance(child, skip) and gives_y(n)]
    return found[0] if len(found) == 1 else norm_attr


def hidden_state_output(h, read: list | None = None):
    """The base model's output as the causal LM's forward reads it: ``last_hidden_state`` ``h``; every other
    field it reads (``past_key_values``, an MoE model's ``router_logits``, ...) is ``None``, and the names of
    fields outside the output class it reads are appended to ``read``."""
    import dataclasses

    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    global _HiddenStateOutput
    if _HiddenStateOutput is None:
        @dataclasses.dataclass
        class _HiddenStateOutput(BaseModelOutputWithPastAndCrossAttentions):
            def __getattr__(self, name):
                if name.startswith("_"):
                    raise AttributeError(name)
                read_list = self.__dict__.get("read_fields")
                if read_list is not None:
                    read_list.append(name)
                return None
    out = _HiddenStateOutput(last_hidden_state=h)
    object.__setattr__(out, "read_fields", read)
    return out


_HiddenStateOutput = None


class BaseOutput(StandIn):
    """Stands in for the base model ``base`` inside the causal LM's forward: returns the given output; the
    base's constant attributes read through it (Falcon-H1's ``lm_head_multiplier``), as :class:`StandIn`."""

    def __init__(self, base):
        super().__init__(base)
        object.__setattr__(self, "config", getattr(base, "config", None))
        self.output = None
        #: the fields of the base model's output outside its class that the causal LM's forward read.
        self.read: list[str] = []

    def forward(self, *args, **kwargs):
        """``output`` (set by the caller); RuntimeError when unset."""
        if self.output is None:
            raise RuntimeError("the base-model stub was called outside CausalLMLast.forward")
        return self.output
