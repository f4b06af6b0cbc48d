"""Where a mixture-of-experts layer's experts live in ``pinned_host`` and how the chosen ones reach the device.

A layer's expert weights come stacked, each ``[E, ...]`` (one row per expert). :class:`ExpertStore` holds them
in one of two layouts:

* ``"stacked"``: as they are. The chosen rows are sliced inside one jitted program per weight shapes and
  count (dynamic slices of the host arrays moved to the device; on XLA:GPU a fusion reads the host slices
  on the compute stream). No extra host memory.
* ``"split"``: each expert's weights packed into one contiguous ``pinned_host`` buffer (:class:`Packing`:
  the weights one after another, flattened, of their common dtype, or as bytes when the dtypes differ),
  built from the stacked arrays on first use; the stacked arrays are then **deleted** (their host memory
  freed: the experts are held once). A fetch of ``m`` experts is one ``jax.device_put`` of ``m`` buffers:
  ``m`` host -> device copies on the copy engines, as whole stages move. The receiving program unpacks
  them on the device (:meth:`Packing.unpack`: static slices and reshapes). :meth:`ExpertStore.restore`
  rebuilds the stacked arrays (bit-exact) and puts them back into the stage's weights; until then any
  other reader of those arrays fails loudly (``RuntimeError: Array has been deleted``); the torch stack's
  entry points call it first (``xla_swap.hf.generators.Generators.give_back``).

The module imports only numpy and jax (no torch).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..pytrees import DEVICE_KIND

__all__ = ["STORE_LAYOUTS", "PACKED", "Packing", "ExpertStore"]

#: the layouts an :class:`ExpertStore` holds the experts in.
STORE_LAYOUTS = ("stacked", "split")
#: the key of the packed per-expert buffers (a list, one per expert) in a stage's weights dict.
PACKED = "xla_swap.packed_experts"


@dataclasses.dataclass(frozen=True)
class Packing:
    """How one expert's weights lie in its packed buffer.

    Attributes:
      names: the weights' keys, sorted; shapes, dtypes: one expert's shape and dtype of each.
      dtype: the buffer's dtype: the weights' common dtype, or ``uint8`` (bytes) when they differ.
      offsets, sizes: where each weight lies in the buffer, in elements of ``dtype``.
    """
    names: tuple
    shapes: tuple
    dtypes: tuple
    dtype: np.dtype
    offsets: tuple
    sizes: tuple

    @classmethod
    def of(cls, stacked: dict) -> "Packing":
        """The packing of ``stacked`` (``{name: array or ShapeDtypeStruct [E, ...]}``). Raises ValueError: empty."""
        if not stacked:
            raise ValueError("stacked must hold at least one expert weight, got none")
        names = tuple(sorted(stacked))
        shapes = tuple(tuple(stacked[n].shape[1:]) for n in names)
        dtypes = tuple(np.dtype(stacked[n].dtype) for n in names)
        dtype = dtypes[0] if len(set(dtypes)) == 1 else np.dtype(np.uint8)
        sizes = tuple(int(np.prod(s, dtype=np.int64)) * (d.itemsize // dtype.itemsize) for s, d in zip(shapes, dtypes))
        offsets = tuple(int(o) for o in np.cumsum((0,) + sizes[:-1]))
        return cls(names, shapes, dtypes, dtype, offsets, sizes)

    @property
    def length(self) -> int:
        """Elements of one packed buffer."""
        return int(sum(self.sizes))

    @property
    def nbytes(self) -> int:
        """Bytes of one packed buffer (one expert's weights)."""
        return self.length * self.dtype.itemsize

    def pack(self, rows: dict) -> np.ndarray:
        """One expert's buffer ``[length]`` from ``rows`` (``{name: numpy array}`` of that expert's weights)."""
        out = np.empty(self.length, self.dtype)
        for n, off, size in zip(self.names, self.offsets, self.sizes):
            out[off:off + size] = np.ascontiguousarray(rows[n]).reshape(-1).view(self.dtype)
        return out

    def unpack(self, buf) -> dict:
        """``{name: array}`` of one expert from its buffer ``buf`` (``[length]``, numpy or jax; traceable)."""
        xp = np if isinstance(buf, np.ndarray) else jnp
        out = {}
        for n, shape, dt, off, size in zip(self.names, self.shapes, self.dtypes, self.offsets, self.sizes):
            part = buf[off:off + size]
            if dt == self.dtype:
                out[n] = part.reshape(shape)
            elif xp is np:
                out[n] = part.view(dt).reshape(shape)
            else:
                grain = (dt.itemsize,) if dt.itemsize > 1 else ()
                out[n] = jax.lax.bitcast_convert_type(part.reshape(shape + grain), dt)
        return out


@dataclasses.dataclass(eq=False)
class _Packed:
    """A stage's experts in the ``"split"`` layout."""
    source: dict          # the stage's weights dict they were packed from (its stacked arrays deleted)
    packing: Packing
    buffers: list         # E pinned_host arrays [length]
    shardings: dict       # name -> the stacked array's sharding (pinned_host)
    freed: int            # bytes of the stacked arrays deleted


class ExpertStore:
    """Holds mixture-of-experts weights in ``pinned_host`` in one layout and copies the chosen experts to the device.

    Args:
      layout: ``"stacked"`` or ``"split"`` (module docstring).
      device_sharding: where the fetched experts go (memory kind ``device``).

    :attr:`copies` lists per fetch ``(stage, host -> device copies, bytes)``.

    Raises: ValueError: an unknown ``layout``.
    """

    def __init__(self, layout: str, device_sharding):
        if layout not in STORE_LAYOUTS:
            raise ValueError(f"expert layout must be one of {STORE_LAYOUTS}, got {layout!r}")
        self.layout = layout
        self._dev = device_sharding.with_memory_kind(DEVICE_KIND)
        self._slicers: dict = {}
        self._packed: dict[int, _Packed] = {}
        #: per fetch: ``(stage, arrays copied host -> device, bytes)``.
        self.copies: list[tuple[int, int, int]] = []

    def packed(self, stage: int, params: dict, names) -> list:
        """Stage ``stage``'s experts as ``E`` packed ``pinned_host`` buffers (``"split"``), packed from
        ``params`` (its weights dict, ``params[n]`` stacked ``[E, ...]``) on first use or when ``params`` is
        another dict than last time; the stacked arrays of ``params`` are then deleted."""
        got = self._packed.get(stage)
        if got is not None and got.source is params:
            return got.buffers
        names = sorted(names)
        packing = Packing.of({n: params[n] for n in names})
        host = params[names[0]].sharding
        whole = {n: np.asarray(params[n]) for n in names}   # host copies, freed below
        e = whole[names[0]].shape[0]
        bufs = [jax.device_put(packing.pack({n: whole[n][j] for n in names}), host) for j in range(e)]
        jax.block_until_ready(bufs)
        del whole
        shardings = {n: params[n].sharding for n in names}
        freed = sum(params[n].nbytes for n in names)
        for n in names:
            params[n].delete()
        self._packed[stage] = _Packed(params, packing, bufs, shardings, freed)
        return bufs

    def fetch(self, stage: int, params: dict, names, ids: np.ndarray) -> dict:
        """The chosen experts on the device, asynchronous: ``{name: [m arrays]}`` (``"stacked"``: expert
        ``ids[j]``'s slice of each ``params[name]``) or ``{PACKED: [m buffers]}`` (``"split"``: expert ``ids[j]``'s
        packed buffer; :meth:`Packing.unpack` reads it). ``ids``: int32 ``[m]``, ascending. Raises
        RuntimeError (``"stacked"``) when the slicing program does not compile on the platform."""
        m = len(ids)
        if self.layout == "split":
            bufs = self.packed(stage, params, names)
            got = jax.device_put([bufs[int(e)] for e in ids], self._dev)
            self.copies.append((stage, m, int(sum(b.nbytes for b in got))))
            return {PACKED: list(got)}
        w = {n: params[n] for n in sorted(names)}
        ids_dev = jax.device_put(ids, self._dev)
        key = (m, tuple((n, v.shape, v.dtype, v.sharding) for n, v in w.items()))   # per layer and token: cheap
        slicer = self._slicers.get(key)
        if slicer is None:   # one program per count: dynamic slices of the host arrays, each moved to the device
            dev = self._dev

            def take(w, ids):
                return {n: [jax.device_put(jax.lax.dynamic_index_in_dim(v, ids[j], keepdims=False), dev)
                            for j in range(m)] for n, v in w.items()}
            try:
                slicer = jax.jit(take, out_shardings=dev).lower(w, ids_dev).compile()
            except Exception as e:  # noqa: BLE001 - re-raised naming the other layout
                raise RuntimeError(f"slicing experts out of the stacked pinned_host weights does not compile here "
                                   f"({type(e).__name__}: {e}); expert_layout='split' copies whole per-expert "
                                   "buffers instead") from e
            self._slicers[key] = slicer
        self.copies.append((stage, m * len(w), int(sum(v.nbytes for v in w.values()) // w[next(iter(w))].shape[0] * m)))
        return slicer(w, ids_dev)

    def restore(self, host_params: list) -> None:
        """Put the stacked arrays back (rebuilt from the packed buffers, bit-exact, in their ``pinned_host``
        shardings) into ``host_params[stage]`` (a new dict) of each stage packed from the dict it holds now,
        and drop the packed buffers."""
        for stage, pk in sorted(self._packed.items()):
            if host_params[stage] is pk.source:
                rows = [pk.packing.unpack(np.asarray(b)) for b in pk.buffers]
                back = {n: jax.device_put(np.stack([r[n] for r in rows]), pk.shardings[n]) for n in pk.packing.names}
                del rows
                host_params[stage] = {**pk.source, **back}
        self._packed = {}

    def host_nbytes(self) -> int:
        """Bytes of ``pinned_host`` held beyond the stages' stacked weights: the packed buffers less the stacked
        arrays they replaced (0: each expert is held once)."""
        return int(sum(sum(b.nbytes for b in pk.buffers) - pk.freed for pk in self._packed.values()))
