"""Placing the arguments of :class:`xla_swap.executors.PjrtExecutor` in their memory kinds and shardings.

:class:`ParameterBuffers`, which the executor holds: :meth:`~ParameterBuffers.put` /
:meth:`~ParameterBuffers.put_all` check a value against its :class:`ParameterInfo` (shape, dtype,
liveness), check the pinned host limit (:mod:`xla_swap.executors.pjrt.host_memory`) and copy it
with ``jax.device_put``; an array already placed is passed on as it is.

Imports jax and numpy only (the private jax / jaxlib APIs through :mod:`xla_swap._compat.jax`).
"""
from __future__ import annotations

import contextlib
from typing import Mapping, Sequence

import jax
import numpy as np

from xla_swap._compat import jax as _cj   # every private jax / jaxlib API used here
from xla_swap.planning.policy import DEVICE, PINNED_HOST

from .host_memory import (DEFAULT_GPU_HOST_MEMORY_LIMIT_GB, HOST_MEMORY_LIMIT_ENV, HostMemoryError,
                          is_resource_exhausted, pinned_host_bytes_in_use)
from .placement import ParameterInfo


class ParameterBuffers:
    """The placement of a :class:`xla_swap.executors.PjrtExecutor`'s entry parameters; the executor holds one.

    Args:
      parameters: tuple of :class:`ParameterInfo`, one per entry parameter.
      platform: the jax platform of the devices (``"cpu"``, ``"cuda"``, ...).
      host_memory_limit_bytes: cap, in bytes over all devices, on live ``pinned_host`` arrays of
        ``platform`` (None: no limit).

    Attributes: the arguments, and ``transfer_count``: number of arrays placed (copied) so far.
    """

    def __init__(self, parameters: tuple, platform: str, host_memory_limit_bytes: int | None):
        self.parameters = tuple(parameters)
        self.platform = platform
        self.host_memory_limit_bytes = host_memory_limit_bytes
        self.transfer_count = 0

    @property
    def num_parameters(self) -> int:
        """Number of entry parameters."""
        return len(self.parameters)

    def _check_index(self, index) -> int:
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool) or not 0 <= index < self.num_parameters:
            raise ValueError(f"index: parameter {index!r} does not exist; the module has {self.num_parameters} "
                             f"entry parameter(s)")
        return int(index)

    def _check_value(self, index: int, x, where: str):
        """Liveness, shape and dtype check; returns ``x`` (jax.Array) or ``np.asarray(x)``."""
        param = self.parameters[index]
        if isinstance(x, jax.Array):
            if x.is_deleted():
                raise ValueError(f"{where}: parameter {index} got a deleted jax.Array (shape {list(x.shape)}, "
                                 f"{np.dtype(x.dtype)}): it was donated to another computation or .delete()d; "
                                 f"pass a live array")
        else:
            try:
                arr = np.asarray(x)
            except (TypeError, ValueError):   # a ragged nested list
                arr = None
            if arr is None or arr.dtype.kind in "OUS":   # None, a str: no array of numbers
                raise TypeError(f"{where}: parameter {index} expects a numpy array or jax.Array of {param.dtype} "
                                f"{list(param.shape)}, got {type(x).__name__} {x!r:.60}")
            x = arr
        if tuple(x.shape) != param.shape:
            raise ValueError(f"{where}: parameter {index} expects shape {list(param.shape)}, got {list(x.shape)}")
        if np.dtype(x.dtype) != param.dtype:
            raise TypeError(f"{where}: parameter {index} expects dtype {param.dtype}, got {np.dtype(x.dtype)}")
        return x

    def is_placed(self, index: int, x) -> bool:
        """Whether ``x`` is a live jax.Array already in parameter ``index``'s memory kind and sharding.

        Such arrays are passed to the executable as they are (no copy).

        Raises: ValueError: ``index`` does not exist.
        """
        param = self.parameters[self._check_index(index)]
        if not isinstance(x, jax.Array) or x.is_deleted():
            return False
        if tuple(x.shape) != param.shape or np.dtype(x.dtype) != param.dtype:
            return False
        kind = x.sharding.memory_kind or DEVICE
        if kind != param.memory_kind:
            return False
        try:
            return x.sharding.with_memory_kind(kind).is_equivalent_to(param.sharding, len(param.shape))
        except Exception:  # sharding types that cannot be compared
            return False

    @staticmethod
    def _host_bytes(param: ParameterInfo) -> int:
        """Pinned host bytes an array of ``param`` occupies over all devices (0 for device params)."""
        if param.memory_kind != PINNED_HOST:
            return 0
        return param.shard_nbytes * len(param.sharding.addressable_devices)

    def host_bytes_in_use(self) -> int:
        """Bytes of live ``pinned_host`` jax arrays of this platform, over all devices."""
        return pinned_host_bytes_in_use(self.platform)

    def _check_host_limit(self, requested: int, what: str) -> None:
        if self.host_memory_limit_bytes is None or requested == 0:
            return
        in_use = self.host_bytes_in_use()
        if in_use + requested > self.host_memory_limit_bytes:
            raise HostMemoryError(
                f"{what}: placing {requested} bytes in pinned_host memory would exceed the pinned host limit of "
                f"{self.host_memory_limit_bytes} bytes ({in_use} bytes already in use). PJRT GPU caps its pinned "
                f"host pool with {HOST_MEMORY_LIMIT_ENV} (GiB, default {DEFAULT_GPU_HOST_MEMORY_LIMIT_GB}); raise "
                f"it, or keep fewer parameters in pinned_host.",
                requested, in_use, self.host_memory_limit_bytes)

    def x64(self):
        """x64 mode while placing/executing when a parameter is 64-bit (jax would narrow it otherwise)."""
        if any(np.dtype(p.dtype).itemsize == 8 and np.dtype(p.dtype).kind in "iuf" for p in self.parameters):
            return _cj.enable_x64()
        return contextlib.nullcontext()

    def _device_put(self, index: int, x) -> jax.Array:
        param = self.parameters[index]
        try:
            with self.x64():
                out = jax.device_put(x, param.sharding)
        except Exception as e:
            if param.memory_kind == PINNED_HOST and is_resource_exhausted(e):
                raise HostMemoryError(
                    f"parameter {index}: the runtime could not allocate {self._host_bytes(param)} bytes of "
                    f"pinned_host memory ({HOST_MEMORY_LIMIT_ENV} caps the PJRT GPU pinned pool, default "
                    f"{DEFAULT_GPU_HOST_MEMORY_LIMIT_GB} GiB): {str(e).splitlines()[0]}",
                    self._host_bytes(param)) from e
            raise
        self.transfer_count += 1
        return out

    def put(self, index: int, array) -> jax.Array:
        """Place one parameter's value in its memory kind and sharding.

        Keep the returned array and pass it to the executor again: it is used without a copy,
        so a ``pinned_host`` parameter stays resident in host memory between calls.

        Args:
          index: entry parameter index.
          array: numpy array or jax.Array of the parameter's global shape and exact dtype.

        Returns:
          a jax.Array with ``sharding`` equivalent to ``parameters[index].sharding`` (its
          ``memory_kind`` is the parameter's); ``array`` itself when it is already placed.

        Raises:
          ValueError: ``index`` does not exist (names it and the parameter count); wrong shape;
            ``array`` is a deleted jax.Array.
          TypeError: wrong dtype (names the parameter, expected and got); ``array`` is no
            array of numbers (``None``, a str).
          HostMemoryError: a ``pinned_host`` placement would exceed ``host_memory_limit_bytes``,
            or the runtime ran out of pinned host memory.
        """
        index = self._check_index(index)
        x = self._check_value(index, array, "put")
        if self.is_placed(index, x):
            return x
        self._check_host_limit(self._host_bytes(self.parameters[index]), f"put(parameter {index})")
        return self._device_put(index, x)

    def put_all(self, arrays: Sequence) -> list:
        """:meth:`put` every parameter; ``arrays[i]`` feeds parameter ``i``.

        All values are checked (count, shapes, dtypes, host limit) before anything is placed.

        Returns:
          list of jax.Arrays, one per parameter.

        Raises:
          ValueError: ``len(arrays) != num_parameters``; a wrong shape; a deleted jax.Array.
          TypeError: ``arrays`` is not a list or tuple (``None``, one array, a mapping); a
            wrong dtype; an element that is no array of numbers (``None``, a str).
          HostMemoryError: as in :meth:`put`, for the total of the host placements.
        """
        if isinstance(arrays, (str, bytes, Mapping)) or not isinstance(arrays, Sequence):
            raise TypeError(f"arrays: expected a list or tuple with one array per parameter "
                            f"({self.num_parameters}), got {type(arrays).__name__}")
        arrays = list(arrays)
        if len(arrays) != self.num_parameters:
            raise ValueError(f"put_all: expected {self.num_parameters} arrays (one per parameter), got {len(arrays)}")
        return self.place_all(arrays, "put_all")

    def place_all(self, arrays: list, where: str, extra_host_bytes: int = 0) -> list:
        """Check every value, then the host limit for the placements plus ``extra_host_bytes``, then place.

        ``extra_host_bytes``: pinned host bytes the caller will need besides the placements (a
        call's host outputs and temporaries), checked with them.
        """
        values = [self._check_value(i, x, f"{where}: argument {i}") for i, x in enumerate(arrays)]
        todo = [i for i, x in enumerate(values) if not self.is_placed(i, x)]
        host = sum(self._host_bytes(self.parameters[i]) for i in todo)
        self._check_host_limit(host + extra_host_bytes, where)
        for i in todo:
            values[i] = self._device_put(i, values[i])
        return values
