"""Index inputs checked as torch checks them: token ids into an embedding, class indices into a loss.

On the device an out-of-range index does not fail: XLA's gather clamps it or fills NaN, so an id
past the vocabulary gives NaN logits (and a NaN update of every weight) and a label past the
classes trains toward a clamped one. Torch's CPU kernels raise ``IndexError`` instead
(``nn.Embedding``: "index out of range in self"; ``cross_entropy`` / ``nll_loss``: "Target 700 is
out of bounds"). ``SwappedStack`` and ``generate`` call these checks on the torch tensors before
anything is dispatched, so a bad value raises ``IndexError`` with the state untouched:

* **Token ids** (:func:`token_id_bounds`): the inputs of ``first`` that index an embedding, when
  ``first`` says which (``index_input_bounds()``, as :class:`xla_swap.hf.causal_lm.CausalLMFirst` does for
  ``input_ids``) or is an ``nn.Embedding`` itself; other ``first`` modules are not checked.
* **Class indices** (:func:`class_target_bounds`): integer targets shaped like an output of 2 or
  more dimensions without its last one (or that shape flattened) are the class indices of a
  ``cross_entropy``-style loss: each must lie in ``[0, C)``, ``C`` the output's last dimension, or
  equal the loss's ignore index (:func:`loss_ignore_index`: ``-100``, ``cross_entropy``'s default,
  unless the loss names another; ``loss_fn.ignore_index = None`` turns the check off). Float
  targets and integer targets of other shapes are not checked.

Cost (:func:`check_index_range`): one ``torch.aminmax`` over the tensor and one read of its two
values, which also serves the int32 check of an int64 tensor (``xla_swap.stack.torch_bridge``: int64
ids cost one read in all). For a CPU tensor that is a host pass before dispatch; for a CUDA
tensor the reduction runs on the tensor's device in torch's current stream and the read waits for
that stream only (the work that produced the tensor), never for the work the stack queued on jax's.

The module imports torch only.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

__all__ = ["check_index_range", "token_id_bounds", "class_target_bounds", "loss_ignore_index", "IGNORE_INDEX"]

#: the ignore index of ``torch.nn.functional.cross_entropy`` / ``nll_loss`` by default.
IGNORE_INDEX = -100


def check_index_range(t: torch.Tensor, name: str, size: int, ignore_index: int | None = None,
                      what: str = "") -> tuple[int, int] | None:
    """Check that the integer tensor ``t`` holds indices into ``size`` entries, as torch's kernels do.

    Every value must lie in ``[0, size)`` or equal ``ignore_index`` (``None``: none is ignored).

    Args:
      t: an integer torch tensor of any shape, on the CPU or a CUDA device (module docstring: cost).
      name: how the message names ``t`` (``"input_ids"``, ``"targets[0]"``).
      size: the number of entries indexed (int >= 0).
      ignore_index: a value let through although outside the range, or ``None``.
      what: what the range is, for the message (``"the rows of the input embedding"``).

    Returns: ``(min, max)`` of the values, those equal to ``ignore_index`` counted as 0; ``None``
      for an empty tensor or one of a floating, complex or bool dtype (not indices: not checked here).

    Raises: IndexError naming ``name``, the offending value (the smallest if any is negative, else
      the largest), the range and the ignore index.
    """
    if t.numel() == 0 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        return None
    v = t.detach()
    if ignore_index is not None:
        v = torch.where(v == ignore_index, torch.zeros((), dtype=v.dtype, device=v.device), v)
    lo, hi = torch.stack(torch.aminmax(v)).tolist()   # one read
    if lo < 0 or hi >= size:
        bad = lo if lo < 0 else hi
        ignored = "" if ignore_index is None else f" and is not the ignore index {ignore_index}"
        raise IndexError(f"{name} holds {bad}, outside [0, {size}){' (' + what + ')' if what else ''}{ignored}")
    return lo, hi


def token_id_bounds(first: torch.nn.Module | None) -> dict[int, tuple]:
    """``{input position: (name, embedding rows, None, what)}`` (the arguments of :func:`check_index_range`
    after the tensor): the inputs of ``first`` that are token ids.

    From ``first.index_input_bounds()`` (``{position: (name, rows)}``) when ``first`` defines it
    (:class:`xla_swap.hf.causal_lm.CausalLMFirst`: ``input_ids`` and its input embedding's rows); for an
    ``nn.Embedding`` itself, its first input and ``num_embeddings``; else ``{}``: nothing is checked
    (which input of a module of one's own feeds which embedding is not known without running it).
    """
    if first is None:
        return {}
    bounds = getattr(first, "index_input_bounds", None)
    if callable(bounds):
        found = dict(bounds())
    elif isinstance(first, torch.nn.Embedding):
        found = {0: ("inputs[0]", int(first.num_embeddings))}
    else:
        return {}
    what = "the rows of the input embedding"
    return {i: (name, int(rows), None, what) for i, (name, rows) in found.items()}


def loss_ignore_index(loss_fn: Callable) -> int | None:
    """The ignore index of ``loss_fn``'s class targets: its ``ignore_index`` attribute (a
    ``torch.nn.CrossEntropyLoss`` / ``NLLLoss`` module, or one set on a function), a
    ``functools.partial``'s ``ignore_index`` keyword, else ``IGNORE_INDEX`` (``-100``, the default
    of ``cross_entropy``). An attribute set to ``None`` means the loss's integer targets are not
    class indices: nothing is checked (``None`` is returned and :func:`class_target_bounds` gives ``{}``)."""
    if isinstance(loss_fn, functools.partial) and "ignore_index" in (loss_fn.keywords or {}):
        return loss_fn.keywords["ignore_index"]
    if hasattr(loss_fn, "ignore_index"):
        return loss_fn.ignore_index
    return IGNORE_INDEX


def class_target_bounds(targets, out_shape: tuple | None, loss_fn: Callable) -> dict:
    """``{target position: (name, C, ignore index, what)}`` for the targets that are class indices.

    ``targets``: a torch tensor (named ``targets``) or a tuple / list of them (``targets[i]``). A
    target is one when it is an integer torch tensor shaped like the output without its last
    dimension, or that shape flattened (``out_shape[:-1]``, or ``(prod(out_shape[:-1]),)``), as
    ``cross_entropy(logits.flatten(0, -2), labels.flatten())`` takes it; ``C = out_shape[-1]``. None
    are when ``out_shape`` is ``None`` or has fewer than 2 dimensions (no batch of class scores: a
    0-d integer target beside a 1-d output is more often a count than a class), or
    ``loss_ignore_index(loss_fn)`` is ``None``.
    """
    ignore = loss_ignore_index(loss_fn)
    if out_shape is None or len(out_shape) < 2 or ignore is None or isinstance(ignore, bool) or \
            not isinstance(ignore, int):
        return {}
    single = isinstance(targets, torch.Tensor)
    targets = (targets,) if single else tuple(targets)
    lead = tuple(out_shape[:-1])
    shapes = {lead, (math.prod(lead),)}
    what = f"the {out_shape[-1]} classes of the output's last dimension"
    return {i: ("targets" if single else f"targets[{i}]", int(out_shape[-1]), ignore, what)
            for i, t in enumerate(targets) if isinstance(t, torch.Tensor) and not t.is_floating_point()
            and not t.is_complex() and t.dtype != torch.bool and tuple(t.shape) in shapes}
