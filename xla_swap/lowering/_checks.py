"""Argument checks shared by the front end's public entry points (private).

Every public function of :mod:`xla_swap.lowering` validates its arguments with these helpers
before it changes any state (torch_xla graphs, RNG, caches), so bad input raises a
``TypeError`` / ``ValueError`` that names the argument instead of an internal error or a
C++ check failure.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from xla_swap._compat import torch_xla as _ctx   # every private torch_xla API used here


def check_xla_tensor(t, where: str) -> torch.Tensor:
    """``t`` must be a ``torch.Tensor`` on an XLA device; raises ``TypeError`` naming ``where``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor on an XLA device, got {type(t).__name__}")
    if t.device.type != "xla":
        raise TypeError(f"{where}: expected a tensor on an XLA device, got a tensor on {t.device} "
                        f"(move it with .to(torch_xla.device()))")
    return t


def check_tensor_list(seq, where: str, *, allow_empty: bool) -> list:
    """``seq`` must be a list/tuple of XLA tensors (not one tensor, not a string, not None).

    Returns it as a list. Raises ``TypeError`` for a wrong container or element type,
    ``ValueError`` for an empty sequence when ``allow_empty`` is False.
    """
    if isinstance(seq, torch.Tensor):
        raise TypeError(f"{where}: expected a list or tuple of XLA tensors, got a single tensor "
                        f"(wrap it: [{where.split('[')[0]}])")
    if not isinstance(seq, (list, tuple)):
        raise TypeError(f"{where}: expected a list or tuple of XLA tensors, got {type(seq).__name__}")
    seq = list(seq)
    if not seq and not allow_empty:
        raise ValueError(f"{where}: expected at least one XLA tensor to lower, got an empty sequence")
    for i, t in enumerate(seq):
        check_xla_tensor(t, f"{where}[{i}]")
    return seq


def check_bool(value, where: str) -> bool:
    """``value`` must be a ``bool`` (numpy bools accepted); raises ``TypeError`` naming ``where``."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_" and type(value).__module__ == "numpy":
        return bool(value)
    raise TypeError(f"{where}: expected a bool, got {value!r}")


class ScanArgumentError(TypeError, ValueError):
    """A bad argument of :func:`~xla_swap.lowering.scan` / :func:`~xla_swap.lowering.scan_layers`
    for which torch_xla's own ``scan`` raises another exception type than this front end's checks
    would (``fn`` not callable: torch_xla raises ``ValueError``; a 0-d leaf of ``xs``: its
    ``len()`` raises ``TypeError``). Both a ``TypeError`` and a ``ValueError``, so code written
    against torch_xla's ``scan`` / ``scan_layers`` catches it whichever it expects."""


class ScanDeviceError(TypeError, RuntimeError):
    """A tensor of :func:`~xla_swap.lowering.scan` / :func:`~xla_swap.lowering.scan_layers`'s
    ``init`` / ``xs`` / ``input_data`` that is not on an XLA device. torch_xla's own ``scan`` and
    ``scan_layers`` raise ``RuntimeError`` there (from device propagation while tracing), this
    front end's checks ``TypeError`` before anything is traced: both, so code catching either works."""


def check_callable(fn, where: str, error: type = TypeError) -> Callable:
    """``fn`` must be callable; raises ``error`` (default ``TypeError``) naming ``where``."""
    if not callable(fn):
        raise error(f"{where}: expected a callable, got {type(fn).__name__}")
    return fn


def describe_fn(fn) -> str:
    """``fn``'s name for messages: ``'body'``, ``'<lambda>'``, ``'Linear'`` (a module), or its type's name."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return repr(name) if isinstance(name, str) else repr(type(fn).__name__)


def check_name(name, where: str, *, identifier: bool) -> str:
    """``name`` must be a non-empty ``str`` (a Python identifier when ``identifier``)."""
    if not isinstance(name, str):
        raise TypeError(f"{where}: expected a str, got {type(name).__name__}")
    if not name or (identifier and not name.isidentifier()):
        what = "an identifier (letters, digits, '_')" if identifier else "a non-empty string"
        raise ValueError(f"{where}: expected {what}, got {name!r}")
    return name


def needs_materialization(t: torch.Tensor) -> bool:
    """True when ``t`` is not device data itself: a pending computation or a view."""
    return _ctx.needs_materialization([t])[0]


def buffer_deleted(t: torch.Tensor) -> bool:
    """True when the device buffer behind device-data tensor ``t`` was deleted (donated)."""
    try:
        _ctx.tensor_handles([t])
    except RuntimeError as e:
        if "IsDeleted" in str(e) or "is deleted" in str(e):
            return True
        raise
    return False


_INT_LIST = r"\d+(?:,\d+)*"
_SHARDING_RE = re.compile(
    r"\{(?:replicated|manual|maximal device=\d+|"
    rf"devices=\[(?P<tile>{_INT_LIST})\](?:(?P<ids>{_INT_LIST})|<=\[{_INT_LIST}\](?:T\({_INT_LIST}\))?)"
    r"(?P<rep> last_tile_dim_replicate)?(?: last_tile_dims=\{[a-z_, ]+\})?)\}")


def check_sharding(sharding, where: str, ndim: int | None = None, num_devices: int | None = None) -> str:
    """``sharding`` must be ``""`` or an HLO OpSharding string such as ``'{devices=[4,1]0,1,2,3}'``.

    With ``ndim``, a tiled sharding must have one tile dimension per tensor dimension (plus one
    for ``last_tile_dim_replicate``) and list as many devices as the tiles multiply to. A tiled
    sharding's device ids (listed, or ``0..n-1`` in the iota form) must be distinct; with
    ``num_devices``, every device id (a ``maximal`` one too) must be below it.

    Raises:
      TypeError: not a ``str``.
      ValueError: not a parseable OpSharding; a tile dimension of 0; inconsistent with ``ndim``; a device id listed
        twice, or one that is not below ``num_devices``.
    """
    if not isinstance(sharding, str):
        raise TypeError(f"{where}: expected an OpSharding string, got {type(sharding).__name__}")
    if sharding == "":
        return sharding
    m = _SHARDING_RE.fullmatch(sharding)
    if m is None:
        raise ValueError(f"{where}: {sharding!r} is not an OpSharding string (e.g. '{{replicated}}' or "
                         f"'{{devices=[4,1]0,1,2,3}}')")
    if m.group("tile") is not None:
        tile = [int(d) for d in m.group("tile").split(",")]
        extra = 1 if m.group("rep") else 0
        if 0 in tile:
            raise ValueError(f"{where}: {sharding!r} has a tile dimension of 0; each must be >= 1")
        if ndim is not None and len(tile) != ndim + extra:
            raise ValueError(f"{where}: {sharding!r} tiles {len(tile) - extra} dimensions, the tensor has {ndim}")
        if m.group("ids") is not None:
            n = 1
            for d in tile:
                n *= d
            if len(m.group("ids").split(",")) != n:
                raise ValueError(f"{where}: {sharding!r} lists {len(m.group('ids').split(','))} devices for "
                                 f"{n} tiles")
    ids = _device_ids(m)
    if isinstance(ids, list) and len(set(ids)) != len(ids):
        twice = next(d for i, d in enumerate(ids) if d in ids[:i])
        raise ValueError(f"{where}: {sharding!r} lists device {twice} twice; each device holds one tile")
    top = max(ids, default=-1) if isinstance(ids, list) else ids[-1] if len(ids) else -1
    if num_devices is not None and top >= num_devices:
        raise ValueError(f"{where}: {sharding!r} names device {top}, but the runtime has {num_devices} "
                         f"device(s) (ids 0..{num_devices - 1})")
    return sharding


def _device_ids(m: re.Match):
    """The device ids a matched sharding names: listed, ``0..n-1`` for the iota form, or the maximal one."""
    text = m.group(0)
    if text.startswith("{maximal device="):
        return [int(text[len("{maximal device="):-1])]
    if m.group("ids") is not None:
        return [int(d) for d in m.group("ids").split(",")]
    if m.group("tile") is not None:   # iota form: devices 0..n-1, each once
        n = 1
        for d in m.group("tile").split(","):
            n *= int(d)
        return range(n)
    return []
