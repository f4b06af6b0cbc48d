"""The device-memory budget of the torch entry point (``SwappedStack(budget_bytes=...)``).

Two rules: with ``AutotuneConfig(enabled=False)`` the budget bounds weights and optimizer state, and
:func:`resident_for_budget` keeps stages resident from the last backwards beside the streaming
window; with it enabled (the default) the first call measures and chooses a whole schedule
(:class:`Autotuner`, ``xla_swap.executors.streaming.calibrate.autotune``), which the stack holds and calls.

The module imports torch (for the inputs' shapes in messages).
"""
from __future__ import annotations

import torch

from xla_swap.executors.streaming.config import RuntimeConfig, config_from_policy
from xla_swap.executors.streaming.runtime import StreamingRuntime
from xla_swap.planning.policy import OffloadPolicy
from xla_swap.stack.config import check_calibration_arg

__all__ = ["resident_for_budget", "build_runtime", "Autotuner"]


def resident_for_budget(stage_params: list[dict], trainable: list, optimizer, budget: int, k: int) -> list[bool]:
    """Per stage, whether it is kept in device memory for ``budget`` bytes of weights and optimizer state
    (``SwappedStack(budget_bytes=..., autotune=AutotuneConfig(enabled=False))``): from the last stage backwards
    while they fit beside the streaming window of the ``k + 1`` largest stages.

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


def build_runtime(fns: list, stage_params: list, updated: list, policy: OffloadPolicy, budget_bytes: int | None,
                  autotune: bool, config: RuntimeConfig, common: dict) -> StreamingRuntime:
    """The ``StreamingRuntime`` of the stages under ``config`` with the fields ``policy`` decides
    (``config_from_policy``); with ``budget_bytes`` the residency
    :func:`xla_swap.stack.budget.resident_for_budget` gives (every stage streamed until the first call
    chooses, with ``autotune``). ``common``: the constructor's other keywords (``placement``, ``optimizer``,
    ...). Raises ValueError for a budget below the streaming window."""
    config = config_from_policy(policy, len(stage_params), config)
    if budget_bytes is not None:
        optimizer = common["optimizer"]
        resident = resident_for_budget(stage_params, updated, optimizer[0] if isinstance(optimizer, list)
                                       else optimizer, budget_bytes, policy.prefetch_depth)   # raises below the window
        if autotune:   # stream everything until the first call chooses (the least device memory)
            resident = [False] * len(stage_params)
        config = config.replace(resident=resident)
    return StreamingRuntime(fns, stage_params, config, **common)


class Autotuner:
    """The schedule choice of a ``SwappedStack`` for a device-memory budget: it measures (or reads
    ``calibration``), chooses and builds the runtime that runs the choice.

    Args:
      first_call_budget: the constructor's ``budget_bytes`` when it chooses at the first call
        (``AutotuneConfig.enabled``), else ``None``.
      calibration: what it chooses from when a call gives none (``None``: it measures); checked by the caller.

    Attributes: ``schedule``: the last choice (a ``ScheduleChoice``: ``.explain()``), or ``None``.
    """

    def __init__(self, first_call_budget: int | None, calibration):
        self.first_call_budget, self.calibration = first_call_budget, calibration
        self.schedule = None

    @property
    def due(self) -> bool:
        """Whether the first call is still to choose (a first-call budget and no choice yet)."""
        return self.first_call_budget is not None and self.schedule is None

    @staticmethod
    def check_call(calibration) -> None:
        """The checks of ``SwappedStack.autotune`` before anything runs: ``calibration``'s type (TypeError), and
        ValueError with per-rank batches (:mod:`xla_swap.distributed`: each process would choose its own)."""
        from xla_swap.distributed import per_rank_batches
        check_calibration_arg(calibration)
        if per_rank_batches():
            raise ValueError("autotune with per-rank batches (xla_swap.distributed): each process would measure and "
                             "choose its own schedule; build the stack with a policy")

    def choose(self, runtime, x, budget_bytes: int, *, training: bool, reps: int, calibration=None, **choose_kwargs):
        """The runtime running the schedule chosen for ``runtime``'s stages on input ``x`` (as the runtime takes
        it) within ``budget_bytes`` (weights, optimizer state and step carried over, no copy); the choice is
        kept as ``schedule`` (``SwappedStack.autotune`` calls it).

        ``xla_swap.executors.streaming.calibrate.autotune`` measures the link and each distinct stage's
        forward and backward (a few calls), ``xla_swap.planning.chooser.choose_schedule`` picks
        the fastest predicted configuration whose predicted peak fits, cached per stage
        signatures, input shapes, budget and mode. The runtime stays ``StreamingRuntime``
        (``InGraphRuntime`` has no training step).

        Args:
          runtime, x: the stack's runtime and an input as it takes it (the shapes matter, not the values).
          budget_bytes: device memory in bytes (int > 0) for *everything* the stack holds on the
            device (weights, optimizer state, activations, temporaries), unlike the constructor's
            ``budget_bytes`` (weights and optimizer state).
          training: choose for ``train_step`` or ``forward``.
          reps: timed calls per measured figure.
          calibration: a ``Calibration`` or a callable ``(runtime, h) -> Calibration`` to choose
            from instead of measuring (see the constructor's ``calibration``; default: the
            constructor's, else measure). With one, nothing is measured and the cached choices
            are not read.
          **choose_kwargs: ``max_prefetch_depth``, ``allow_offload``, ``allow_device_optimizer_state``,
            ``allow_no_remat`` (default ``True``; ``False`` keeps ``remat=True``).

        Raises: ``xla_swap.planning.InfeasibleBudgetError`` (a ``ValueError``) when nothing fits,
          ``ValueError`` / ``TypeError`` for bad arguments (a bad ``budget_bytes`` as
          ``xla_swap.planning.units.check_budget_bytes`` words it); with :meth:`check_call`'s errors
          first, nothing changes on an error.
        """
        from xla_swap.executors.streaming.calibrate import autotune
        cal = self.calibration if calibration is None else calibration
        new, choice = autotune(runtime, x, budget_bytes, training=training, reps=reps, calibration=cal,
                               own_params=True, **choose_kwargs)
        self.schedule = choice
        return new

    def infeasible(self, error, inputs: tuple) -> ValueError:
        """The first call's error when no schedule fits ``first_call_budget`` (``error``: the
        ``InfeasibleBudgetError``), naming the inputs' shapes and the ways out."""
        return ValueError(
            f"budget_bytes={self.first_call_budget} holds no schedule for inputs of these shapes "
            f"({', '.join(str(tuple(t.shape)) for t in inputs if isinstance(t, torch.Tensor))}): the smallest "
            f"predicted needs {error.min_budget_bytes} bytes of device memory (weights, optimizer state, activations "
            f"and temporaries). Give a larger budget_bytes or smaller inputs, call stack.autotune(inputs, "
            f"budget_bytes=...) with a larger one, or build with autotune=AutotuneConfig(enabled=False) (the budget "
            f"then bounds weights and optimizer state only)")
