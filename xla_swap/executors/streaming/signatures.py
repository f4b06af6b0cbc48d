"""The signatures of a runtime's inputs and the executables compiled for each: a :class:`SignatureCache`
(LRU, at most ``max_signatures``) of :class:`Signature` s, each holding its stages' input avals and its
executables, keyed by :class:`StageKey` (what stages must agree on to share one) and :class:`ExeKey`
(which executable of the stage). ``StreamingRuntime`` (through its ``StageCompiler``) and
``StatefulStreamer`` both keep their executables so.

Imports only jax (no torch).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from xla_swap.planning.cache import LRUCache

from .config import BackwardMode
from ..pytrees import aval_key, index_by_identity

__all__ = ["ExeKey", "Signature", "SignatureCache", "StageKey", "distinct_ids"]


def distinct_ids(fns) -> list[int]:
    """Per element of ``fns``, the index of its object among the distinct ones (by identity, in order)."""
    distinct: list = []
    ids = []
    for f in fns:
        j = index_by_identity(distinct, f)
        if j is None:
            distinct.append(f)
            j = len(distinct) - 1
        ids.append(j)
    return ids


@dataclasses.dataclass
class Signature:
    """Everything compiled for one input signature (tree structure, shapes and dtypes of ``h``)."""

    in_aval: Any
    chain: list  # avals (pytrees) of the input of stage i, i = 0..n (chain[n] is the output)
    stage_exe: dict = dataclasses.field(default_factory=dict)  # (ExeKey, stage) -> compiled
    compiled: dict = dataclasses.field(default_factory=dict)   # (StageKey, ExeKey) -> compiled
    saved_layout: dict = dataclasses.field(default_factory=dict)  # StageKey -> (vjp treedef, sources)
    residual_nbytes: list | None = None
    #: with ``batch_axis``: the batch does not split over the devices, so every activation is
    #: replicated and each stage gathers its weights (``ActivationLayout.runs_replicated``).
    replicated: bool = False
    warned: bool = False   # the warning of a replicated signature was given


@dataclasses.dataclass(frozen=True)
class ExeKey:
    """Which executable of a stage: its ``kind`` (one of :attr:`StageCompiler.STAGE_KINDS`), for a backward
    what it does with the gradients (``mode``) and whether it takes the accumulated gradients
    (``takes_acc``), and whether it donates its buffers."""

    kind: str
    mode: BackwardMode = BackwardMode.GRADS
    takes_acc: bool = False
    donate: bool = False

    @property
    def label(self) -> str:
        """The key as text (``executable_memory``'s ``kind``): e.g. ``"backward-accum+acc-donate"``."""
        return (self.kind + ("-accum" if self.mode is BackwardMode.ACCUM else "") + ("+acc" if self.takes_acc else "")
                + ("-donate" if self.donate else ""))


@dataclasses.dataclass(frozen=True)
class StageKey:
    """What stages must agree on to share an executable: the stage function (index among the distinct
    ones), the parameter key (``StageLayout.param_key``), the input and output avals and the state's."""

    fn_id: int
    params: tuple
    h_in: tuple
    h_out: tuple = ()
    state: tuple = ()   # a stateful stage's state avals (``StatefulStreamer``)


class SignatureCache:
    """The :class:`Signature` s of the last ``max_signatures`` input signatures (least recently used
    dropped, with its executables), and the executables of each.

    Args: ``max_signatures``: int >= 1 (checked by the caller).
    """

    def __init__(self, max_signatures: int):
        self.sigs = LRUCache(max_signatures)  # input key -> Signature
        #: the signature of the last lookup (``None`` before the first, or after :meth:`clear`).
        self.last_sig: Signature | None = None

    def signature(self, in_aval, trace_chain: Callable[[Any], list],
                  replicated: Callable[[Any], bool] | None = None) -> Signature:
        """The cached :class:`Signature` of ``in_aval`` (a pytree of ``jax.ShapeDtypeStruct``), or a new
        one whose ``chain`` is ``trace_chain(in_aval)`` (``replicated(in_aval)`` its flag); what
        ``trace_chain`` raises leaves the cache as it was."""
        key = aval_key(in_aval)
        sig = self.sigs.get(key)
        if sig is None:
            chain = trace_chain(in_aval)
            sig = Signature(in_aval, chain, replicated=bool(replicated and replicated(in_aval)))
            self.sigs.put(key, sig)
        self.last_sig = sig
        return sig

    def executable(self, sig: Signature, stage: int, key: ExeKey, base_of: Callable[[], StageKey],
                   compile_: Callable[[StageKey], Any]):
        """Stage ``stage``'s executable ``key`` of ``sig``: cached per stage, else shared by the stages of
        equal ``base_of()``, else ``compile_(base)``. A call that finds the stage's own entry builds no key
        (``base_of`` walks the stage's weights: it runs once per stage, ``key`` and signature)."""
        exe = sig.stage_exe.get((key, stage))
        if exe is not None:
            return exe
        base = base_of()
        exe = sig.compiled.get((base, key))
        if exe is None:
            exe = compile_(base)
            sig.compiled[(base, key)] = exe
        sig.stage_exe[(key, stage)] = exe
        return exe

    @property
    def num_executables(self) -> int:
        """Distinct executables cached now, over every signature."""
        return sum(len(s.compiled) for s in self.sigs.values())

    def clear(self) -> None:
        """Drop every signature and its executables."""
        self.sigs.clear()
        self.last_sig = None
