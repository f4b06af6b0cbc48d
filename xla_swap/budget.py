"""The device-memory budget of the torch entry point (``SwappedStack(budget_bytes=...)``).

Two rules: with ``autotune=False`` the budget bounds weights and optimizer state, and
:func:`resident_for_budget` keeps stages resident from the last backwards beside the streaming
window; with ``autotune=True`` the first call measures and chooses a whole schedule
(:class:`AutotuneMixin`, ``xla_swap.executors.calibrate.autotune``).

The module imports torch (for the inputs' shapes in messages).
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["check_calibration_arg", "resident_for_budget", "AutotuneMixin"]


def check_calibration_arg(calibration) -> None:
    """``calibration`` must be ``None``, a ``Calibration`` or a callable; raises TypeError naming it."""
    from xla_swap.executors.calibrate import Calibration
    if calibration is not None and not isinstance(calibration, Calibration) and not callable(calibration):
        raise TypeError(f"calibration must be a Calibration, a callable (runtime, h) -> Calibration or None, "
                        f"got {type(calibration).__name__}")


def resident_for_budget(stage_params: list[dict], trainable: list, optimizer, budget: int, k: int) -> list[bool]:
    """Per stage, whether it is kept in device memory for ``budget`` bytes of weights and optimizer state
    (``SwappedStack(budget_bytes=..., autotune=False)``): from the last stage backwards while they fit
    beside the streaming window of the ``k + 1`` largest stages.

    Args:
      stage_params: per stage, ``{name: array}`` of its host weights (``nbytes``, ``itemsize``).
      trainable: per stage, the names the optimizer updates (their state counts).
      optimizer: an ``AdamW`` (``state_bytes``) or ``None``.
      budget: bytes, an int > 0 (``check_budget_bytes``'s result); k: the prefetch depth.

    Raises: ValueError naming ``budget_bytes``: the window alone exceeds ``budget``.
    """
    def nbytes(i):
        w = sum(a.nbytes for a in stage_params[i].values())
        if optimizer is not None:
            w += sum(optimizer.state_bytes(stage_params[i][n].nbytes, stage_params[i][n].itemsize)
                     for n in trainable[i])
        return w
    sizes = [nbytes(i) for i in range(len(stage_params))]
    window = sum(sorted(sizes, reverse=True)[:k + 1])
    if window > budget:
        raise ValueError(f"budget_bytes={budget} is below the streaming window: {k + 1} stages of weights "
                         f"and optimizer state need {window} bytes")
    if sum(sizes) <= budget:
        return [True] * len(sizes)
    resident, used = [False] * len(sizes), window
    for i in reversed(range(len(sizes))):
        if used + sizes[i] > budget:
            break
        resident[i], used = True, used + sizes[i]
    return resident


class AutotuneMixin:
    """The schedule choice of :class:`xla_swap.stack.SwappedStack` for a budget (it inherits it).

    It reads and replaces the stack's ``runtime`` and sets ``schedule``.
    """

    def autotune(self, inputs, *, budget_bytes: int, training: bool = True, reps: int = 3, calibration=None,
                 **choose_kwargs):
        """Choose prefetch depth, resident stages, activation offload, where the optimizer state
        lives and, for training, ``remat`` (recompute, or keep the residuals) from a short
        measurement on the device, and run the stack with that choice from now on.

        A stack built with ``budget_bytes`` (and ``autotune=True``, the default) calls it at its
        first ``forward`` / ``train_step`` with that call's inputs; call it again for another
        input shape or budget. The choice is also kept as ``self.schedule``.

        ``xla_swap.executors.calibrate.autotune`` measures the link and each distinct stage's
        forward and backward (a few calls), ``xla_swap.planning.chooser.choose_schedule`` picks
        the fastest predicted configuration whose predicted peak fits, cached per stage
        signatures, input shapes, budget and mode; ``self.runtime`` is replaced by one running it
        (weights, optimizer state and step carried over). The runtime stays ``StreamingRuntime``
        (``InGraphRuntime`` has no training step).

        Args:
          inputs: a torch tensor or a tuple of them, as for ``train_step`` / ``forward`` (their
            shapes fix the stages' shapes; the values are not used).
          budget_bytes: device memory in bytes (int > 0) for *everything* the stack holds on the
            device (weights, optimizer state, activations, temporaries), unlike the constructor's
            ``budget_bytes`` (weights and optimizer state).
          training: choose for ``train_step`` (default) or ``forward``.
          reps: timed calls per measured figure.
          calibration: a ``Calibration`` or a callable ``(runtime, h) -> Calibration`` to choose
            from instead of measuring (see the constructor's ``calibration``; default: the
            constructor's, else measure). With one, nothing is measured and the cached choices
            are not read.
          **choose_kwargs: ``max_prefetch_depth``, ``allow_offload``, ``allow_device_optimizer_state``,
            ``allow_no_remat`` (default ``True``; ``False`` keeps ``remat=True``).

        Returns: the ``xla_swap.planning.chooser.ScheduleChoice`` (``.explain()``; ``.observe(step_s,
        peak_bytes)`` records measured figures beside the prediction).

        Raises: ``xla_swap.planning.InfeasibleBudgetError`` (a ``ValueError``) when nothing fits,
          ``ValueError`` / ``TypeError`` for bad arguments (a bad ``budget_bytes`` as
          ``xla_swap.planning.units.check_budget_bytes`` words it), ``ValueError`` with per-rank batches
          (:mod:`xla_swap.distributed`); the stack is unchanged then.
        """
        from xla_swap.distributed import per_rank_batches
        from xla_swap.executors.calibrate import autotune
        check_calibration_arg(calibration)
        if per_rank_batches():
            raise ValueError("autotune with per-rank batches (xla_swap.distributed): each process would measure and "
                             "choose its own schedule; build the stack with a policy")
        x = self._carry_in(inputs if isinstance(inputs, (tuple, list)) else (inputs,))
        cal = self.calibration if calibration is None else calibration
        with self.torch_precision():
            # the stack drops its old runtime: the new one takes its weights and moments, no copy
            self.runtime, choice = autotune(self.runtime, x, budget_bytes, training=training, reps=reps,
                                            calibration=cal, own_params=True, **choose_kwargs)
        self.schedule = choice
        if isinstance(self.runtime.remat, bool):   # the policy in force follows the choice
            self.policy = dataclasses.replace(self.policy, remat=self.runtime.remat,
                                              prefetch_depth=self.runtime.prefetch_depth)
        return choice

    def _maybe_autotune(self, inputs: tuple, training: bool) -> None:
        """At the first call of a stack built with ``budget_bytes`` and ``autotune=True``: :meth:`autotune`,
        for training whenever the stack has an optimizer (its device memory then holds the resident
        stages' optimizer state, which a forward's choice does not count), else for that call's mode."""
        if self._autotune_budget is None or self.schedule is not None:
            return
        from xla_swap.planning import InfeasibleBudgetError
        try:
            self.autotune(inputs, budget_bytes=self._autotune_budget, training=training or self.optimizer is not None)
        except InfeasibleBudgetError as e:
            raise ValueError(
                f"budget_bytes={self._autotune_budget} holds no schedule for inputs of these shapes "
                f"({', '.join(str(tuple(t.shape)) for t in inputs if isinstance(t, torch.Tensor))}): the smallest "
                f"predicted needs {e.min_budget_bytes} bytes of device memory (weights, optimizer state, activations "
                f"and temporaries). Give a larger budget_bytes or smaller inputs, call stack.autotune(inputs, "
                f"budget_bytes=...) with a larger one, or build with autotune=False (the budget then bounds weights "
                f"and optimizer state only)") from e
