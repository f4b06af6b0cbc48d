"""The weights of the stages after the last routed one (a causal LM's final norm and head), copied in
pieces behind the routed layers' experts.

A routed layer's expert copies can start only once its routing is read on the host, so between one
layer's copies and the next the link idles while the host reads the routing and launches the layer's
executables. The tail's weights are needed only after the last routed layer: copied whole at its turn
they queue behind nothing and fill none of those idle times. :class:`TailPieces` holds each large tail
weight as ``pieces`` row blocks in ``pinned_host`` (split along axis 0, built on first use, held beside
the whole array: the tail's bytes once more in host memory; a weight whose blocks cannot be placed,
e.g. in a full pinned pool, is copied whole), dispatches one block's copy per routed layer right behind
its experts (:meth:`dispatch_next`), and at the tail stage's turn copies what is left and concatenates
the blocks on the device (:meth:`assemble`: one device-to-device copy of the weight). The stage gets the
same array, bit for bit, in the same device sharding.

The module imports only numpy and jax (no torch).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..transfers import put

__all__ = ["TailPieces", "TAIL_PIECE_MIN_BYTES"]

#: a tail weight smaller than this (bytes) is copied whole at its stage's turn.
TAIL_PIECE_MIN_BYTES = 16 << 20


class TailPieces:
    """Copies the large weights of chosen stages in row blocks spread over the calls of :meth:`dispatch_next`.

    Args: ``min_bytes``: the smallest weight (bytes) split into blocks (``None``: :data:`TAIL_PIECE_MIN_BYTES`
    as it is when this object is made).

    :attr:`copied` lists per stage assembled in the last run ``(stage, blocks copied ahead, blocks copied at
    its turn)``. Raises ValueError: ``min_bytes`` is not an int >= 0.
    """

    def __init__(self, min_bytes: int | None = None):
        min_bytes = TAIL_PIECE_MIN_BYTES if min_bytes is None else min_bytes
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        self.min_bytes = min_bytes
        self._host: dict = {}      # (stage, leaf) -> (whole host array, [host blocks])
        self._queue: list = []     # (stage, leaf, block) not yet copied this run, in dispatch order
        self._dev: dict = {}       # (stage, leaf) -> {block: device copy}
        self._per_call = 0
        self._concat: dict = {}
        #: per stage assembled in the last run: ``(stage, blocks copied ahead, blocks copied at its turn)``.
        self.copied: list[tuple[int, int, int]] = []

    def start(self, host_params: list, stages, pieces: int, calls: int) -> None:
        """A run begins: the large weights of ``stages`` (indices into ``host_params``, one device) split into
        ``pieces`` row blocks each (cached until :meth:`clear`, or until the weight is another array), their
        copies queued to go out over ``calls`` calls of :meth:`dispatch_next`. A run of no stages (a step that
        streams whole) keeps the cache."""
        self._queue, self._dev, self.copied = [], {}, []
        for j in stages:
            for k, a in enumerate(jax.tree_util.tree_leaves(host_params[j])):
                if a.ndim == 0 or a.nbytes < self.min_bytes or a.shape[0] < 2:
                    continue
                held = self._host.get((j, k))
                if held is None or held[0] is not a:
                    try:
                        held = (a, jax.block_until_ready(jax.device_put(
                            np.array_split(np.asarray(a), min(pieces, a.shape[0])), a.sharding)))
                    except Exception:  # noqa: BLE001 - e.g. the pinned pool is full: this weight goes whole
                        continue
                self._host[(j, k)] = held
                self._dev[(j, k)] = {}
                self._queue += [(j, k, b) for b in range(len(held[1]))]
        self._per_call = -(-len(self._queue) // max(calls, 1))

    def dispatch_next(self, device_sharding) -> None:
        """Start copying the next queued blocks (an even share of the run's) to ``device_sharding``'s device."""
        for j, k, b in self._queue[:self._per_call]:
            self._dev[(j, k)][b] = jax.device_put(self._host[(j, k)][1][b], device_sharding)
        del self._queue[:self._per_call]

    def holds(self, stage: int) -> bool:
        """Whether this run copies a weight of ``stage`` in blocks."""
        return any(j == stage for j, _ in self._dev)

    def assemble(self, stage: int, params, shardings):
        """``params`` (stage ``stage``'s host weights) on the device in ``shardings``: the blocked weights from
        their blocks (those not copied yet copied now), the others copied whole."""
        leaves, tree = jax.tree_util.tree_flatten(params)
        sh = jax.tree_util.tree_leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
        out, ahead, late = [], 0, 0
        for k, (a, s) in enumerate(zip(leaves, sh)):
            got = self._dev.pop((stage, k), None)
            if got is None:
                out.append(put(a, s))
                continue
            blocks = self._host[(stage, k)][1]
            ahead += len(got)
            for b in range(len(blocks)):
                if b not in got:
                    got[b] = jax.device_put(blocks[b], s)
                    late += 1
            self._queue = [q for q in self._queue if q[:2] != (stage, k)]
            out.append(self._concat_fn(len(blocks), s)(*[got[b] for b in range(len(blocks))]))
        self.copied.append((stage, ahead, late))
        return jax.tree_util.tree_unflatten(tree, out)

    def _concat_fn(self, n: int, sharding):
        key = (n, sharding)
        fn = self._concat.get(key)
        if fn is None:
            fn = self._concat[key] = jax.jit(lambda *blocks: jnp.concatenate(blocks, axis=0), out_shardings=sharding)
        return fn

    def host_nbytes(self) -> int:
        """Bytes of ``pinned_host`` the blocks hold (beside the whole arrays)."""
        return int(sum(sum(b.nbytes for b in held[1]) for held in self._host.values()))

    def clear(self) -> None:
        """Drop the blocks (host and device); a later :meth:`start` splits again."""
        self._host, self._queue, self._dev = {}, [], {}
