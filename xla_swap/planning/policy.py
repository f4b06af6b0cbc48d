"""The placement policy shared by the scan helpers, the planner and the executors.

Framework-neutral: imports neither torch nor jax.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Mapping, Sequence

#: The device memory kind, as JAX / PJRT name it.
DEVICE = "device"
#: The pinned host memory kind, as JAX / PJRT name it (``"host"`` in a policy means this).
PINNED_HOST = "pinned_host"
#: Memory kinds, as JAX / PJRT name them. ``host`` in a policy means ``pinned_host``.
MEMORY_KINDS = (DEVICE, PINNED_HOST)
PLACEMENTS = ("device", "host")
ACTIVATION_PLACEMENTS = ("device", "host", "remat")


class FrozenMapping(dict):
    """A read-only ``dict`` (sorted by key): the mappings held by frozen policies and costs.

    Every mutating method raises ``TypeError``, so a policy's hash and meaning cannot change
    after construction. Still a ``dict`` for ``json`` / ``dataclasses.asdict``; pickles and
    copies as a new frozen mapping.
    """

    __slots__ = ()

    def _readonly(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is read-only; build a new object with dataclasses.replace(...)")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _readonly

    def __hash__(self):
        return hash(tuple(self.items()))

    def __reduce__(self):
        return (type(self), (dict(self),))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return repr(dict(self))


def as_int(name: str, value, minimum: int) -> int:
    """``value`` as an ``int`` >= ``minimum``: any integral number (``numpy.int64`` too), not a bool.

    Raises:
      TypeError: not an integral number, or a bool.
      ValueError: smaller than ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_bool(name: str, value) -> None:
    """Accept a ``bool`` (or a numpy ``bool_``); raises TypeError naming ``name`` otherwise."""
    if not isinstance(value, bool) and not (type(value).__name__ == "bool_" and type(value).__module__ == "numpy"):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_flags(name: str, value, n: int) -> tuple[bool, ...]:
    """``value`` as a tuple of ``n`` bools (one per stage; numpy ``bool_`` accepted); ``None`` means all ``False``.

    Raises: ValueError: not a sequence of ``n`` bools (the message names ``name``).
    """
    if value is None:
        return (False,) * n
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != n \
            or not all(isinstance(v, bool) or (type(v).__name__ == "bool_" and type(v).__module__ == "numpy")
                       for v in value):
        raise ValueError(f"{name} must be a sequence of {n} bools (one per stage), got {value!r}")
    return tuple(bool(v) for v in value)


def _check_choice(name: str, value, allowed) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name}={value!r} is not a placement; expected one of {', '.join(map(repr, allowed))}")


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """Where each class of tensor of a layered (scanned) model lives.

    Args:
      params: ``"device"`` keeps the stacked per-layer weights in device memory;
        ``"host"`` keeps them in host memory (``pinned_host``) and each scan
        iteration brings only its own layer slice to the device, in the forward
        and again in the backward pass.
      grads: where the gradients of swapped parameters go: ``"device"`` or
        ``"host"`` (each layer's gradient slice is sent to host memory as soon as
        the backward of that layer produced it). Only meaningful with
        ``params="host"``.
      activations: ``{name: placement}`` for activations tagged with
        ``offload_name(t, name)``: ``"host"`` saves the tensor for the backward
        pass in host memory (offload), ``"device"`` saves it on the device,
        ``"remat"`` recomputes it in the backward pass.
      remat: whether untagged intermediates of each layer are recomputed in the
        backward pass (``True``) or saved on the device (``False``).
      prefetch_depth: how many layers ahead the streaming runtime transfers
        weights (an integral number k >= 1, ``numpy.int64`` included; stored as an
        ``int``). The in-graph scan helpers ignore it.
      optimizer_state: ``"device"`` or ``"host"``: where the training loop keeps
        optimizer state (Adam moments). Used by the planner and the examples.

    ``activations`` is stored as a read-only :class:`FrozenMapping` sorted by name, so the
    policy's hash and meaning cannot change after construction.

    Raises:
      ValueError: an argument is not one of the values listed above, naming it.
      TypeError: ``activations`` is not a mapping, ``remat`` is not a bool, or
        ``prefetch_depth`` is not an integral number.
    """

    params: str = "device"
    grads: str = "device"
    activations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    remat: bool = False
    prefetch_depth: int = 1
    optimizer_state: str = "device"

    def __post_init__(self):
        _check_choice("params", self.params, PLACEMENTS)
        _check_choice("grads", self.grads, PLACEMENTS)
        _check_choice("optimizer_state", self.optimizer_state, PLACEMENTS)
        if not isinstance(self.activations, Mapping):
            raise TypeError(f"activations must be a mapping name -> placement, got {type(self.activations).__name__}")
        check_bool("remat", self.remat)
        for name, where in self.activations.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"activations: names must be non-empty strings, got {name!r}")
            _check_choice(f"activations[{name!r}]", where, ACTIVATION_PLACEMENTS)
        depth = as_int("prefetch_depth", self.prefetch_depth, 1)
        # Freeze the mapping so the policy is hashable and cannot change under a compiled program.
        object.__setattr__(self, "activations", FrozenMapping(sorted(self.activations.items())))
        object.__setattr__(self, "remat", bool(self.remat))
        object.__setattr__(self, "prefetch_depth", depth)

    def __hash__(self):
        return hash((self.params, self.grads, tuple(self.activations.items()), self.remat,
                     self.prefetch_depth, self.optimizer_state))

    @property
    def offloaded_activations(self) -> tuple[str, ...]:
        """Names of activations saved in host memory, sorted."""
        return tuple(n for n, w in self.activations.items() if w == "host")

    @property
    def swaps_params(self) -> bool:
        """True when the stacked layer weights live in host memory."""
        return self.params == "host"

    @property
    def is_all_device(self) -> bool:
        """True when nothing is placed on the host (the helpers then behave exactly like torch_xla's)."""
        return (self.params == "device" and self.grads == "device" and self.optimizer_state == "device"
                and "host" not in self.activations.values())


ALL_DEVICE = OffloadPolicy()
