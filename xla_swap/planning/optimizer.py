"""Optimizer configurations: framework-neutral descriptions of an update rule and its state.

An optimizer here is data (hyperparameters), like :class:`~xla_swap.planning.OffloadPolicy`:
the planner reads its state size, the runtimes apply it
(``xla_swap.executors.optim`` holds the JAX update), and the torch entry point builds it from
a ``torch.optim.AdamW``. Imports neither torch nor jax.
"""
from __future__ import annotations

import dataclasses
import math
from numbers import Real

__all__ = ["AdamW", "HYPER_WIDTH", "STATE_DTYPE_ITEMSIZE"]

#: Columns of one parameter group's row of step scalars (``AdamW.hyper``).
HYPER_WIDTH = 8

#: The dtypes ``AdamW.state_dtype`` may name, with their bytes per element.
STATE_DTYPE_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW (Loshchilov & Hutter, 2019) with the update and defaults of ``torch.optim.AdamW``.

    Per step t (1-based), for each parameter p with gradient g, moments m and v::

        p <- p * (1 - lr * weight_decay)
        m <- beta1 * m + (1 - beta1) * g
        v <- beta2 * v + (1 - beta2) * g * g
        p <- p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    which is ``torch.optim.AdamW``'s single-tensor update (``amsgrad=False``,
    ``maximize=False``). The arithmetic runs in float32; the moments are stored in
    ``state_dtype``.

    Args:
      lr: learning rate (>= 0, finite; 0 is a warm-up schedule's first value: the moments and
        the step still advance, the weights do not move).
      betas: ``(beta1, beta2)``, each in [0, 1).
      eps: added to the denominator (> 0).
      weight_decay: decoupled weight decay (>= 0).
      state_dtype: dtype name of the moments, one of :data:`STATE_DTYPE_ITEMSIZE`'s; ``None``
        (default) keeps each parameter's own dtype, as torch does (bf16 parameters get bf16 moments).

    Raises:
      TypeError: a hyperparameter is not a real number, or ``state_dtype`` not a string/None.
      ValueError: a hyperparameter is out of its range, or ``state_dtype`` names another dtype
        (the message names it).
    """

    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    state_dtype: str | None = None

    def __post_init__(self):
        for name in ("lr", "eps", "weight_decay"):
            object.__setattr__(self, name, _finite(f"AdamW {name}", getattr(self, name)))
        if self.lr < 0:
            raise ValueError(f"AdamW lr must be >= 0, got {self.lr}")
        if self.eps <= 0:
            raise ValueError(f"AdamW eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"AdamW weight_decay must be >= 0, got {self.weight_decay}")
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise TypeError(f"AdamW betas must be a pair (beta1, beta2), got {self.betas!r}")
        betas = []
        for i, b in enumerate(self.betas):
            b = _finite(f"AdamW betas[{i}]", b)
            if not 0.0 <= b < 1.0:
                raise ValueError(f"AdamW betas[{i}] must be a real number in [0, 1), got {b!r}")
            betas.append(b)
        object.__setattr__(self, "betas", tuple(betas))
        if self.state_dtype is not None and not isinstance(self.state_dtype, str):
            raise TypeError(f"AdamW state_dtype must be a dtype name (str) or None, got {type(self.state_dtype).__name__}")
        if self.state_dtype is not None and self.state_dtype not in STATE_DTYPE_ITEMSIZE:
            raise ValueError(f"AdamW state_dtype must be None or one of {', '.join(map(repr, STATE_DTYPE_ITEMSIZE))}, "
                             f"got {self.state_dtype!r}")

    #: Number of state tensors per parameter (the two moments).
    num_moments = 2

    def state_dtype_for(self, param_dtype: str) -> str:
        """The dtype name of the moments of a parameter of dtype name ``param_dtype`` (e.g. ``"bfloat16"``):
        ``state_dtype``, or the parameter's own dtype when it is ``None`` (as torch does)."""
        return param_dtype if self.state_dtype is None else self.state_dtype

    def state_bytes(self, param_bytes: int, param_itemsize: int) -> int:
        """Bytes of optimizer state for ``param_bytes`` bytes of parameters of ``param_itemsize`` bytes each.

        Returns: int, bytes: ``2 * (param_bytes / param_itemsize) * state itemsize``.
        """
        n = param_bytes // param_itemsize
        item = param_itemsize if self.state_dtype is None else STATE_DTYPE_ITEMSIZE[self.state_dtype]
        return int(self.num_moments * n * item)

    def hyper(self, step: int, lr: float | None = None) -> tuple[float, ...]:
        """The step's scalars, computed in float64 as torch does.

        Returns: a tuple of ``HYPER_WIDTH`` floats ``(1 - lr*wd, lr/(1-b1^t), sqrt(1-b2^t), b1, 1-b1,
        b2, 1-b2, eps)``: every hyperparameter the update reads, so that the runtimes pass them as
        one traced row per parameter group (schedules of any of them never recompile).

        Args:
          step: the 1-based step number t (int >= 1).
          lr: the learning rate of this step (default ``self.lr``), e.g. from a schedule.

        Raises: ValueError: ``step < 1`` or ``lr < 0``; TypeError: ``lr`` is not a real number.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"step must be an int >= 1, got {step!r}")
        lr = self.lr if lr is None else _finite("lr", lr)
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        b1, b2 = self.betas
        return (1.0 - lr * self.weight_decay, lr / (1.0 - b1 ** step), math.sqrt(1.0 - b2 ** step),
                b1, 1.0 - b1, b2, 1.0 - b2, self.eps)

    @classmethod
    def from_torch(cls, optimizer) -> "AdamW":
        """The configuration of a ``torch.optim.AdamW`` (or ``Adam``) instance with one configuration.

        Raises: the errors of :meth:`groups_from_torch`, and ValueError when the param groups
        differ in a hyperparameter (use :meth:`groups_from_torch` for one configuration per group).
        """
        groups = cls.groups_from_torch(optimizer)
        for i, g in enumerate(groups[1:], 1):
            if g != groups[0]:
                raise ValueError(f"optimizer.param_groups[{i}] has other hyperparameters than group 0; "
                                 "AdamW.from_torch reads one configuration (groups_from_torch reads one per group)")
        return groups[0]

    @classmethod
    def groups_from_torch(cls, optimizer, state_dtype: str | None = None) -> list["AdamW"]:
        """One configuration per ``param_group`` of a ``torch.optim.AdamW`` (or ``Adam``), read now.

        Reads ``lr`` (a float or a 0-d tensor), ``betas``, ``eps`` and ``weight_decay`` of every
        group, so a ``torch.optim.lr_scheduler`` that changed them since is seen. Duck-typed (no
        torch import): the optimizer's class must be named ``AdamW`` or ``Adam``.

        Args:
          optimizer: the torch optimizer.
          state_dtype: the ``state_dtype`` of every returned configuration.

        Returns: a list of ``AdamW``, ``len(optimizer.param_groups)`` long, in group order.

        Raises:
          TypeError: ``optimizer`` is not a torch AdamW/Adam (the message names its class).
          ValueError: a group has an option this update does not implement (``amsgrad=True``,
            ``maximize=True``, ``Adam`` with ``weight_decay`` and without
            ``decoupled_weight_decay``: L2 regularisation, not AdamW), or a hyperparameter out
            of range; the message names the group and the option.
        """
        name = type(optimizer).__name__
        groups = getattr(optimizer, "param_groups", None)
        if name not in ("AdamW", "Adam") or not groups:
            raise TypeError(f"optimizer must be a torch.optim.AdamW (or an xla_swap AdamW), got {name}")
        out = []
        for i, g in enumerate(groups):
            for opt_name in ("amsgrad", "maximize"):
                if g.get(opt_name):
                    raise ValueError(f"optimizer.param_groups[{i}]: {opt_name}=True is not supported")
            wd = g.get("weight_decay") or 0.0
            if name == "Adam" and wd and not g.get("decoupled_weight_decay", False):
                raise ValueError(f"optimizer.param_groups[{i}]: torch.optim.Adam with weight_decay is L2 "
                                 "regularisation, not AdamW's decoupled decay; use torch.optim.AdamW")
            vals = {k: g.get(k) for k in ("lr", "betas", "eps")}
            vals = {k: (tuple(_item(b) for b in v) if k == "betas" and isinstance(v, (tuple, list)) else _item(v))
                    for k, v in vals.items()}
            try:
                out.append(cls(lr=vals["lr"], betas=vals["betas"], eps=vals["eps"], weight_decay=_item(wd),
                               state_dtype=state_dtype))
            except (TypeError, ValueError) as e:
                raise type(e)(f"optimizer.param_groups[{i}]: {e}") from None
        return out


def _item(v):
    """A 0-d tensor's (or numpy scalar's) Python number; anything else unchanged."""
    return v.item() if hasattr(v, "item") and getattr(v, "shape", None) in ((), []) else v


def _finite(name: str, v) -> float:
    """``v`` as a finite float; TypeError for a non-real (bools too), ValueError for inf/nan/overflow."""
    if isinstance(v, bool) or not isinstance(v, Real):
        raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got {v!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {v!r}")
    return f

