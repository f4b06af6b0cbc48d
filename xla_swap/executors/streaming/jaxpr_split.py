"""Split a traced function at its one call of a marker primitive: what can run before the call's result
is known, and what needs it.

``split_at(closed_jaxpr, primitive, drop)`` partitions the equations of a ``jax.make_jaxpr`` trace:
*late* equations are those that depend (transitively) on the marker's result, every other equation is
*early*, wherever it stood in program order (a shared expert computed after the routed experts in the
model's code is early: it does not read their result). ``before`` computes, from the inputs the caller
keeps, the marker's inputs, the *boundary* (the early values the late equations read) and the outputs
that are early; ``after`` computes the late outputs from the marker's result and the boundary. Between
the two the caller runs what the marker stands for (e.g. the routed experts, on weights fetched once the
routing is read on the host).

Both halves are ``jax.extend.core.ClosedJaxpr`` of the trace's own equations (no re-tracing, no other
ops): run through ``jax.extend.core.jaxpr_as_fun`` they compute what the whole trace computes, given the
marker's result. The module imports jax only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.extend.core as jcore

__all__ = ["JaxprSplit", "split_at", "count_primitive"]


@dataclasses.dataclass(frozen=True)
class JaxprSplit:
    """The two halves of a trace around its marker call (see the module docstring).

    Attributes:
      before: ``(*kept inputs) -> (*marker inputs, *boundary, *early outputs)``.
      after: ``(*marker results, *boundary) -> (*late outputs)``.
      kept: positions (in the trace's flat inputs) of the inputs ``before`` takes, ascending.
      n_marker_in: how many marker inputs ``before`` returns first.
      n_boundary: how many boundary values follow them (``after`` takes them after the marker results).
      outputs: per flat output of the trace, ``("early", j)`` (``before``'s ``j``-th early output),
        ``("late", j)`` (``after``'s ``j``-th output) or ``("literal", value)``.
      params: the marker equation's parameters.
    """
    before: Any
    after: Any
    kept: tuple[int, ...]
    n_marker_in: int
    n_boundary: int
    outputs: tuple[tuple[str, Any], ...]
    params: dict

    def assemble(self, early: Sequence, late: Sequence) -> list:
        """The trace's flat outputs from ``before``'s early outputs and ``after``'s outputs."""
        src = {"early": early, "late": late}
        return [v if kind == "literal" else src[kind][v] for kind, v in self.outputs]


def count_primitive(jaxpr, primitive) -> int:
    """Equations of ``primitive`` in ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive is primitive
        for sub in jcore.jaxprs_in_params(eqn.params):
            n += count_primitive(sub, primitive)
    return n


def _is_var(v) -> bool:
    return not isinstance(v, jcore.Literal)


def _late_equations(eqns: list, marker_at: int) -> tuple[list, list, set]:
    """``(early, late, late_vars)``: the equations (marker excluded) split by whether they read, transitively,
    the marker's results, and the variables those results and the late equations define."""
    late_vars = set(eqns[marker_at].outvars)
    early, late = [], []
    for k, eqn in enumerate(eqns):
        if k == marker_at:
            continue
        if k > marker_at and any(_is_var(v) and v in late_vars for v in eqn.invars):
            late.append(eqn)
            late_vars.update(eqn.outvars)
        else:
            early.append(eqn)
    return early, late, late_vars


def _live(eqns: list, outs: Sequence) -> list:
    """The equations of ``eqns`` (in order) that ``outs`` need (dead-code elimination)."""
    need = {v for v in outs if _is_var(v)}
    kept = []
    for eqn in reversed(eqns):
        if any(v in need for v in eqn.outvars):
            kept.append(eqn)
            need.update(v for v in eqn.invars if _is_var(v))
    return kept[::-1]


def _free_vars(eqns: list, outs: Sequence, bound: set) -> list:
    """Variables ``eqns`` and ``outs`` read that none of ``eqns`` defines and ``bound`` lacks, in first-use order."""
    defined, free = set(bound), {}
    for eqn in eqns:
        for v in eqn.invars:
            if _is_var(v) and v not in defined:
                free.setdefault(v, None)
        defined.update(eqn.outvars)
    for v in outs:
        if _is_var(v) and v not in defined:
            free.setdefault(v, None)
    return list(free)


def split_at(closed, primitive, drop: Sequence[int] = ()) -> JaxprSplit:
    """Split ``closed`` (a ``ClosedJaxpr`` from ``jax.make_jaxpr``) around its one top-level equation of
    ``primitive`` (see the module docstring).

    Args:
      closed: the trace.
      primitive: the marker (a ``jax.extend.core.Primitive``).
      drop: positions of flat inputs that must not be needed before the marker's result (e.g. the
        weights the marker stands for): ``before`` does not take them.

    Returns: a :class:`JaxprSplit`.

    Raises:
      ValueError: the trace has no equation of ``primitive`` or more than one, has it inside a nested
        call, has equations with side effects, or needs an input of ``drop`` besides the marker call.
    """
    jaxpr = closed.jaxpr
    eqns = list(jaxpr.eqns)
    at = [k for k, e in enumerate(eqns) if e.primitive is primitive]
    total = count_primitive(jaxpr, primitive)
    if len(at) != 1 or total != 1:
        raise ValueError(f"the trace calls {primitive.name} {total} times ({len(at)} at its top level): "
                         "exactly one top-level call is needed to split it")
    if jaxpr.effects or any(e.effects for e in eqns):
        raise ValueError("the trace has equations with side effects: they cannot be moved around the split")
    marker = eqns[at[0]]
    early, late, late_vars = _late_equations(eqns, at[0])
    consts = dict(zip(jaxpr.constvars, closed.consts))
    late_outs = [v for v in jaxpr.outvars if _is_var(v) and v in late_vars]
    boundary = [v for v in _free_vars(late, late_outs, set(marker.outvars)) if v not in consts]
    early_outs = [v for v in jaxpr.outvars if _is_var(v) and v not in late_vars]
    before_outs = [*marker.invars, *boundary, *early_outs]
    early = _live(early, before_outs)
    needed = set(_free_vars(early, before_outs, set()))
    dropped = [k for k in drop if jaxpr.invars[k] in needed]
    if dropped:
        raise ValueError(f"inputs {dropped} of the trace are read outside its {primitive.name} call")
    kept = tuple(k for k, v in enumerate(jaxpr.invars) if k not in set(drop))
    before = _closed([v for v in jaxpr.constvars if v in needed], consts, [jaxpr.invars[k] for k in kept],
                     before_outs, early)
    late_consts = set(_free_vars(late, late_outs, set(marker.outvars) | set(boundary)))
    after = _closed([v for v in jaxpr.constvars if v in late_consts], consts, [*marker.outvars, *boundary],
                    late_outs, late)
    outputs = tuple(("literal", v.val) if not _is_var(v) else
                    ("late", late_outs.index(v)) if v in late_outs else ("early", early_outs.index(v))
                    for v in jaxpr.outvars)
    return JaxprSplit(before, after, kept, len(marker.invars), len(boundary), outputs, dict(marker.params))


def _closed(constvars: list, consts: dict, invars: list, outvars: list, eqns: list):
    """A ``ClosedJaxpr`` of ``eqns`` with these variables (the constants' values from ``consts``)."""
    info = jcore.DebugInfo("split_at", "xla_swap.executors.streaming.jaxpr_split",
                           tuple(f"in{k}" for k in range(len(invars))),
                           tuple(f"out{k}" for k in range(len(outvars))))
    jaxpr = jcore.Jaxpr(constvars, invars, outvars, eqns, frozenset(), info)
    return jcore.ClosedJaxpr(jaxpr, [consts[v] for v in constvars])
