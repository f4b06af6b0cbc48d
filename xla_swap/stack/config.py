"""The settings of ``SwappedStack`` beyond its stages, optimizer, loss and schedule, in small frozen groups
that read as they are written (as FSDP2's ``MixedPrecisionPolicy`` / ``OffloadPolicy`` and torchtitan's
config sections do):

    SwappedStack(layers, first=first, last=last, optimizer=opt, loss_fn=ce,
                 parallel=ParallelConfig(devices=jax.devices()[:2], shard="fsdp"),
                 training=TrainingConfig(max_grad_norm=1.0, skip_nonfinite=True),
                 autotune=AutotuneConfig(enabled=False), compilation=CompileConfig(transpose_linear=False))

Each group checks its own fields when it is built (an error naming the field, the value and what was
expected), so a bad setting fails where it is written, before any stack exists; the constructor checks
only what joins two settings (``max_grad_norm`` needs an optimizer). The settings with a form elsewhere keep
it: the schedule is an :class:`xla_swap.planning.OffloadPolicy` (prefetch depth, remat, where gradients and
optimizer state live), mixed precision a ``torch.distributed.fsdp.MixedPrecisionPolicy``.

The module imports jax (to check devices), not torch.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax

from xla_swap.planning.policy import as_int, check_bool
from xla_swap.stack.sharding import check_shard

__all__ = ["ParallelConfig", "TrainingConfig", "AutotuneConfig", "CompileConfig", "check_calibration_arg"]


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Where the stack runs and how its weights and activations are split over the devices.

    Args:
      devices: the ``jax`` devices to run on (default ``None``: ``jax.devices()``, every local device; with
        per-rank batches every process's). Stored as a tuple.
      shard: with several devices: ``"fsdp"`` (default; each weight with >= 2 dimensions is split over all
        devices on the first dimension of the layout it is held in that divides evenly, others replicated;
        each device keeps its shard in its own host memory), ``"replicate"``, or a callable
        ``(name, shape) -> tuple`` giving a ``PartitionSpec`` over the mesh axis ``"d"`` (torch's shape and
        spec, :mod:`xla_swap.stack.sharding`).
      data_parallel: with several devices, split the activations' leading (batch or token) dimension over
        them (each device computes its part of the batch; XLA all-gathers each layer's weight shards on the
        device): FSDP / ZeRO-3 as torch users know it. Inputs whose leading dimension does not split evenly
        stay replicated. Default ``None``: on for ``shard="fsdp"``, off otherwise (tensor parallelism with a
        ``shard`` callable wants replicated activations).

    Raises: TypeError: ``devices`` not a non-empty sequence of ``jax.Device``; ``data_parallel`` not a bool
      or ``None``. ValueError: ``shard`` not one of ``"fsdp"`` / ``"replicate"`` nor a callable.
    """

    devices: Sequence[jax.Device] | None = None
    shard: str | Callable = "fsdp"
    data_parallel: bool | None = None

    def __post_init__(self):
        d = self.devices
        if d is not None:
            if isinstance(d, jax.Device) or not isinstance(d, Sequence) or not d or \
                    not all(isinstance(x, jax.Device) for x in d):
                raise TypeError(f"devices must be a non-empty sequence of jax.Device, got {d!r}")
            object.__setattr__(self, "devices", tuple(d))
        check_shard(self.shard)
        if self.data_parallel is not None and not isinstance(self.data_parallel, bool):
            raise TypeError(f"data_parallel must be a bool or None, got {type(self.data_parallel).__name__}")

    def splits_batch(self) -> bool:
        """Whether activations are split over the devices when there are several (``data_parallel``'s default
        resolved)."""
        return self.shard == "fsdp" if self.data_parallel is None else self.data_parallel


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """How ``train_step`` updates and where its gradients and kept activations go.

    Args:
      max_grad_norm: with an optimizer: clip the gradients at every update to this global 2-norm (over
        every trainable parameter of every stage, ``torch.nn.utils.clip_grad_norm_``'s semantics: scale by
        ``min(1, max_grad_norm / (norm + 1e-6))``). Default ``None``. Stored as a float.
      skip_nonfinite: with an optimizer: skip an update whose gradient norm is inf or nan (weights, moments
        and step unchanged, the gradients dropped), as torch's ``GradScaler`` skips ``optimizer.step()``.
        Default ``False``. With either, the update is no longer fused into the backward: an update pass
        follows it (:class:`xla_swap.stack.training.Trainer` says what that moves).
      accumulate_grads: without an optimizer, add each step's gradients to the modules' ``.grad``
        (default; a host copy of every gradient per step). ``False`` leaves them in ``pinned_host`` as
        ``stack.last_grads`` (one pytree of jax arrays per stage) instead.
      offload_activations: each layer's kept input goes to ``pinned_host`` during the forward and comes back
        ``prefetch_depth`` layers ahead in the backward (activation offload). Default ``False``.

    Raises: ValueError: ``max_grad_norm`` not a finite number > 0 or ``None``. TypeError: a flag not a bool.
    """

    max_grad_norm: float | None = None
    skip_nonfinite: bool = False
    accumulate_grads: bool = True
    offload_activations: bool = False

    def __post_init__(self):
        m = self.max_grad_norm
        if m is not None:
            if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
                raise ValueError(f"max_grad_norm must be a finite number > 0 or None, got {m!r}")
            object.__setattr__(self, "max_grad_norm", float(m))
        for name in ("skip_nonfinite", "accumulate_grads", "offload_activations"):
            check_bool(name, getattr(self, name))

    @property
    def needs_norm(self) -> bool:
        """Whether an update needs the global gradient norm first (``max_grad_norm`` or ``skip_nonfinite``)."""
        return self.max_grad_norm is not None or self.skip_nonfinite


def check_calibration_arg(calibration) -> None:
    """``calibration`` must be ``None``, a ``Calibration`` or a callable; raises TypeError naming it."""
    from xla_swap.executors.streaming.calibrate import Calibration
    if calibration is not None and not isinstance(calibration, Calibration) and not callable(calibration):
        raise TypeError(f"calibration must be a Calibration, a callable (runtime, h) -> Calibration or None, "
                        f"got {type(calibration).__name__}")


@dataclasses.dataclass(frozen=True)
class AutotuneConfig:
    """How a stack built with ``budget_bytes`` chooses its schedule.

    Args:
      enabled: choose the schedule from a measurement at the first ``forward`` / ``train_step`` (default
        ``True``): ``budget_bytes`` then bounds everything the stack holds on the device. ``False``: the
        budget bounds weights and optimizer state only, the residency fixed at construction. Without
        ``budget_bytes`` it does nothing (call ``stack.autotune`` to choose for a budget).
      calibration: what the choice is made from instead of measuring: a callable ``(runtime, h) ->
        xla_swap.executors.streaming.calibrate.Calibration`` called with the stack's runtime and the call's input as
        the runtime sees it, e.g. ``functools.partial(xla_swap.executors.streaming.calibrate.calibration_from_figures,
        link=..., forward_s=..., backward_s=...)`` (figures measured elsewhere, or a test's: no clock read),
        or a ``Calibration`` of this stack's stages and input signature. Default ``None``: measure.

    Raises: TypeError: ``enabled`` not a bool; ``calibration`` not ``None``, a ``Calibration`` or a callable.
    """

    enabled: bool = True
    calibration: Any = None

    def __post_init__(self):
        check_bool("enabled", self.enabled)
        check_calibration_arg(self.calibration)


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """How the stages are traced and compiled.

    Args:
      transpose_linear: hold every ``nn.Linear`` weight in host (and device) memory as ``[in, out]``, the
        transpose of torch's ``[out, in]`` (default ``True``). The stage hands the module the transpose,
        which XLA folds into the matmul: it then contracts like ``h @ w`` ("NN") instead of ``F.linear``'s
        "NT", which costs more compute per stage (``docs/explanation/design.md``). Everything the user sees
        stays in torch's layout (``shard`` callables, ``state_dicts()``, ``sync_modules()``, ``.grad``);
        only ``runtime.host_params`` and ``last_grads`` hold the names in ``stack.transposed`` as ``[in, out]``.
      fused_attention: on a GPU, run ``torch.nn.functional.scaled_dot_product_attention`` (what Hugging
        Face's ``sdpa`` attention calls) as cuDNN's fused attention (``xla_swap.stack.torch_attention``; default
        ``True``). ``False``: XLA's unfused form, which materialises the ``[B, N, T, S]`` scores. Other
        platforms always run XLA's form.
      max_signatures: input shapes whose executables stay cached (serving several batch sizes and
        sequence lengths; an int >= 1, default 8).

    Raises: TypeError: a flag not a bool, ``max_signatures`` not an int. ValueError: ``max_signatures < 1``.
    """

    transpose_linear: bool = True
    fused_attention: bool = True
    max_signatures: int = 8

    def __post_init__(self):
        check_bool("transpose_linear", self.transpose_linear)
        check_bool("fused_attention", self.fused_attention)
        object.__setattr__(self, "max_signatures", as_int("max_signatures", self.max_signatures, 1))
