"""An ``OffloadPolicy`` as the placements of :class:`xla_swap.executors.PjrtExecutor` for one lowered module.

:func:`placements_for_policy` reads the policy's ``params`` and ``grads`` and the module's
parameter table (framework-neutral: records with ``.id`` and ``.sharding``, such as torch_xla's
``LoweredComputation.parameters``) and returns a :class:`PolicyPlacements`, the executor's
``placements`` and ``result_memory_kinds`` arguments. Imports jax and numpy only.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import numpy as np

from xla_swap.planning.policy import DEVICE, PINNED_HOST

from .placement import ParameterPlacement


@dataclasses.dataclass(frozen=True)
class PolicyPlacements:
    """The :class:`PjrtExecutor` arguments an ``OffloadPolicy`` gives for one lowered module.

    Pass them on as ``PjrtExecutor(module, p.placements, result_memory_kinds=p.result_memory_kinds)``
    (what :meth:`PjrtExecutor.from_policy` does).

    Attributes:
      placements: ``{parameter index: ParameterPlacement}``: with a parameter table, one
        entry per parameter (memory kind from the policy, sharding from the table); without
        one, an entry for each weight only (sharding kept from the module).
      result_memory_kinds: ``{result index: memory kind}`` for the gradient results.
      weights: the parameter indices the policy's ``params`` placed, sorted.
      grad_results: the result indices the policy's ``grads`` placed, sorted.
    """
    placements: Mapping
    result_memory_kinds: Mapping
    weights: tuple = ()
    grad_results: tuple = ()


def _check_ids(ids, name: str, limit: int | None, what: str, known: set | None = None) -> tuple:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name}: expected an iterable of int {what} indices, got {type(ids).__name__} {ids!r:.80}")
    out = []
    for k in ids:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool):
            raise TypeError(f"{name}: expected int {what} indices, got {type(k).__name__} {k!r:.80}")
        k = int(k)
        if k < 0 or (limit is not None and k >= limit) or (known is not None and k not in known):
            count = len(known) if known is not None else limit
            raise ValueError(f"{name}: {what} index {k} does not exist; the module has {count} {what}(s)")
        out.append(k)
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: duplicate {what} indices in {sorted(out)}")
    return tuple(sorted(out))


def _parameter_table(parameters) -> dict | None:
    """``{index: HLO sharding string or None}`` from a framework-neutral parameter table."""
    if parameters is None:
        return None
    if isinstance(parameters, (int, np.integer)) and not isinstance(parameters, bool):
        if parameters < 0:
            raise ValueError(f"parameters: a parameter count must be >= 0, got {parameters}")
        return {i: None for i in range(int(parameters))}
    if isinstance(parameters, Mapping):
        items = list(parameters.items())
    elif isinstance(parameters, (str, bytes)) or not hasattr(parameters, "__iter__"):
        raise TypeError(f"parameters: expected a parameter table (records with .id and .sharding, e.g. "
                        f"LoweredComputation.parameters), a mapping {{index: sharding}}, a parameter count or None, "
                        f"got {type(parameters).__name__}")
    else:
        items = []
        for j, rec in enumerate(parameters):
            if not hasattr(rec, "id"):
                raise TypeError(f"parameters[{j}]: expected a record with .id and .sharding (an HloParameter), "
                                f"got {type(rec).__name__}")
            items.append((rec.id, getattr(rec, "sharding", None)))
    table = {}
    for k, sharding in items:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0:
            raise TypeError(f"parameters: parameter ids must be ints >= 0, got {k!r}")
        if sharding is not None and not isinstance(sharding, (str, jax.sharding.Sharding)):
            raise TypeError(f"parameters[{k}]: sharding must be an HLO sharding string, a jax Sharding or None, "
                            f"got {type(sharding).__name__}")
        if int(k) in table:
            raise ValueError(f"parameters: parameter id {k} appears twice")
        table[int(k)] = sharding
    return table


def placements_for_policy(policy, parameters=None, *, weights=(), grad_results=None,
                          num_results: int | None = None) -> PolicyPlacements:
    """Turn an ``OffloadPolicy`` into :class:`PjrtExecutor` placements for one lowered module.

    What the executor applies of the policy: ``params`` (``"host"``: the ``weights``
    parameters in ``pinned_host``, ``"device"``: on the device; every other parameter on the
    device) and ``grads`` (``"host"``: the ``grad_results`` results written to
    ``pinned_host``). ``activations`` and ``remat`` are already part of a module lowered
    through ``xla_swap.lowering.scan`` with the same policy; ``prefetch_depth`` and
    ``optimizer_state`` are not used by this executor (they belong to the streaming runtime
    and the training loop).

    Args:
      policy: an ``xla_swap.planning.OffloadPolicy``.
      parameters: the module's parameter table, framework-neutral: a sequence of records with
        ``.id`` (int entry parameter index) and ``.sharding`` (an HLO sharding string such as
        ``"{devices=[1,4,1]0,1,2,3}"``, a jax Sharding, or None), e.g. torch_xla's
        ``LoweredComputation.parameters``; or a mapping ``{index: sharding or None}``; or the
        parameter count (int; shardings kept from the module); or None (unknown: placements
        only for ``weights``, indices checked by the executor).
      weights: entry parameter indices of the per-layer (stacked) weights that
        ``policy.params`` places, e.g. ``[lowered.parameter_id(w) for w in stacked]``.
        Required (non-empty) when ``policy.params == "host"``.
      grad_results: result indices holding those weights' gradients, placed by
        ``policy.grads``. Required when ``policy.grads == "host"`` (pass ``()`` for a
        forward-only module: nothing is then placed on the host for the gradients).
      num_results: the module's result count, to check ``grad_results`` (optional; the
        executor checks them too).

    Returns:
      :class:`PolicyPlacements`.

    Raises:
      TypeError: ``policy`` is not an ``OffloadPolicy``; ``parameters``, ``weights`` or
        ``grad_results`` have the wrong type (non-int indices, a string).
      ValueError: a weight or gradient index that does not exist (names it and the count);
        duplicate indices; ``policy.params == "host"`` with no weights;
        ``policy.grads == "host"`` with ``grad_results`` not given.
    """
    from xla_swap.planning.policy import OffloadPolicy
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"policy: expected an xla_swap.planning.OffloadPolicy, got {type(policy).__name__}")
    table = _parameter_table(parameters)
    known = set(table) if table is not None else None
    weight_ids = _check_ids(weights, "weights", None, "parameter", known)
    if num_results is not None and (not isinstance(num_results, (int, np.integer)) or isinstance(num_results, bool)
                                    or num_results < 0):
        raise ValueError(f"num_results: expected an int >= 0 or None, got {num_results!r}")
    grad_ids = _check_ids(grad_results, "grad_results", num_results, "result")
    if policy.params == "host" and not weight_ids:
        raise ValueError("weights: policy.params='host' needs the indices of the weight parameters to place in "
                         "pinned_host (e.g. [lowered.parameter_id(w) for w in stacked_weights]); none given")
    if policy.grads == "host" and grad_results is None:
        raise ValueError("grad_results: policy.grads='host' needs the result indices of the weights' gradients "
                         "(pass () for a module that returns no gradients)")
    weight_kind = PINNED_HOST if policy.params == "host" else DEVICE
    if table is None:
        placements = {i: ParameterPlacement(weight_kind) for i in weight_ids}
    else:
        placements = {i: ParameterPlacement(weight_kind if i in weight_ids else DEVICE, sharding)
                      for i, sharding in sorted(table.items())}
    results = {i: (PINNED_HOST if policy.grads == "host" else DEVICE) for i in grad_ids}
    return PolicyPlacements(placements, results, weight_ids, grad_ids)
