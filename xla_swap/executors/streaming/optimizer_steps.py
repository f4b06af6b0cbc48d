"""A streaming runtime's optimizer progress: the parameter groups, the step count, each step's
hyperparameter rows, and the figures of the last update (gradient norm, skipped or not) with the
clip coefficient of the separate update pass (``train_step`` with ``max_grad_norm`` or
``skip_nonfinite``), whose events the executor (``executor.execute_pass``) performs.

Imports only jax (no torch).
"""
from __future__ import annotations

import jax
import numpy as np

from xla_swap.planning.optimizer import AdamW

from .. import optim as _optim

__all__ = ["OptimizerSteps"]


class OptimizerSteps:
    """The optimizer's configuration and progress of one runtime.

    Args:
      groups: one ``AdamW`` per parameter group (``optim.check_optimizer``'s result), or ``None``.
      step: the optimizer steps applied so far (another runtime's, carried over).
    """

    def __init__(self, groups: list | None, step: int = 0):
        #: the configuration of parameter group 0 (its ``state_dtype`` is every group's), or ``None``.
        self.optimizer: AdamW | None = groups[0] if groups else None
        #: one ``AdamW`` per parameter group, read at every ``train_step`` (assign new ones between
        #: steps: a schedule); ``None`` without an optimizer.
        self.param_groups: list[AdamW] | None = groups
        #: the number of parameter groups the executables are built for (0 without an optimizer).
        self.num_groups: int = len(groups) if groups else 0
        #: number of optimizer steps applied so far.
        self.step: int = step
        #: the global gradient norm of the last update that computed one, else ``None``.
        self.last_grad_norm: float | None = None
        #: whether the last update was skipped for a non-finite gradient (``skip_nonfinite``).
        self.last_step_skipped: bool = False
        #: per stage, the last accumulating backward's sum of squares (device scalars), or ``None``.
        self.sumsq: list | None = None

    def checked_groups(self) -> list[AdamW]:
        """``param_groups``, checked against what the executables were built for (count, state dtype)."""
        groups = self.param_groups
        if not isinstance(groups, (list, tuple)) or len(groups) != self.num_groups or \
                not all(isinstance(g, AdamW) and g.state_dtype == self.optimizer.state_dtype for g in groups):
            raise ValueError(f"param_groups must stay a list of {self.num_groups} xla_swap.planning.AdamW with "
                             f"state_dtype={self.optimizer.state_dtype!r}, got {groups!r}")
        return list(groups)

    def hyper(self, lr, separate_update: bool):
        """The hyperparameter rows of the next step (``None`` without an optimizer).

        Raises: ValueError: a bad ``lr`` or ``param_groups``; ``lr`` or a ``separate_update`` option
          (``accumulate``, ``max_grad_norm``, ``skip_nonfinite``) without an optimizer.
        """
        if self.optimizer is not None:
            return _optim.hyper_rows(self.checked_groups(), self.step + 1, lr)  # ValueError for a bad lr
        if lr is not None:
            raise ValueError("lr is only used with an optimizer; this runtime has none")
        if separate_update:
            raise ValueError("accumulate, max_grad_norm and skip_nonfinite need an optimizer; without one the "
                             "gradients are returned (add or clip them yourself)")
        return None

    def fused_update_done(self) -> None:
        """After an update fused into the backward: one more step, no norm computed."""
        self.step += 1
        self.last_grad_norm, self.last_step_skipped = None, False

    def update_done(self) -> None:
        """After the separate update pass: one more step (its norm is ``last_grad_norm`` already)."""
        self.step += 1

    def accumulated(self, sumsq: list) -> None:
        """After an accumulating backward: its per-stage sums of squares, for the next update's norm."""
        self.sumsq = sumsq

    def clip_coefficient(self, max_grad_norm: float | None, skip_nonfinite: bool):
        """After the last micro-batch's backward: the global gradient norm (one host sync) into
        ``last_grad_norm``; returns the float32 coefficient the gradients are scaled by
        (``clip_grad_norm_``'s arithmetic), or ``None`` when the update is skipped (``last_step_skipped``)."""
        sumsq = jax.device_get(self.sumsq)
        self.sumsq = None
        norm = float(np.sqrt(np.sum(np.asarray(sumsq, np.float64))))
        self.last_grad_norm = norm
        self.last_step_skipped = bool(skip_nonfinite and not np.isfinite(norm))
        if self.last_step_skipped:
            return None
        coef = np.float32(1.0)
        if max_grad_norm is not None:  # clip_grad_norm_'s float32 arithmetic
            coef = np.minimum(np.float32(max_grad_norm) / (np.float32(norm) + np.float32(1e-6)), np.float32(1.0))
        return coef
