"""The workload: the L-layer bf16 FFN stack, its weights and inputs, and the reference programs.

``layer(h) = h + gelu(h @ a) @ b`` with ``a: (D, F)``, ``b: (F, D)`` in bfloat16. Weights are
drawn deterministically from the seed in 64 MiB chunks of one key, on the device; a run
generates them once into a ``.npy`` cache (``write_weight_cache``) that every process maps
(``np.load(mmap_mode="r")``); the values do not depend on the cache. Also the chunked form of
the stack (first and last layer split over F into stages) and the merge of its gradients.
Imports jax and numpy when a :class:`Workload` is made (no torch).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ._util import GiB, MiB, log

__all__ = ["Workload", "chunked_stages", "merge_chunk_grads"]


class Workload:
    """The stack in one process: device, shardings, weights (numpy, pinned_host, device), inputs, programs.

    Attributes:
      spec: the ``RunSpec``.
      dev: the first jax device; ``DEV`` / ``HOST``: its ``device`` / ``pinned_host`` shardings.
      L, D, F: layers, model width, FFN width. ``weight_bytes``: bytes of all weights.
      layer: ``layer(p, h) = h + gelu(h @ a) @ b`` with ``p = (a, b)``; ``fwd_j`` its jit;
      ``bwd_j``: jitted ``(p, h, g) -> (dh, (da, db))``.
    """

    def __init__(self, spec):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import SingleDeviceSharding

        self.jax, self.jnp, self.np = jax, jnp, np
        self.spec = spec
        self.dev = jax.devices()[0]
        self.DEV = SingleDeviceSharding(self.dev, memory_kind="device")
        self.HOST = SingleDeviceSharding(self.dev, memory_kind="pinned_host")
        self.L, self.D, self.F = spec.layers, spec.d, spec.f
        self.weight_bytes = spec.weight_bytes
        self._A = self._B = None
        self._host_w = None

        def layer(p, h):
            a, b = p
            return h + jax.nn.gelu(h @ a) @ b

        def bwd(p, h, g):
            _, vjp = jax.vjp(layer, p, h)
            gp, gh = vjp(g)
            return gh, gp

        self.layer = layer
        self.fwd_j = jax.jit(layer)
        self.bwd_j = jax.jit(bwd)

    # ---- data
    def mem(self) -> dict:
        """The device's ``memory_stats()`` (bytes: ``peak_bytes_in_use``, ``bytes_in_use``, ...), ``{}`` if none."""
        try:
            s = self.dev.memory_stats()
        except Exception:  # noqa: BLE001
            s = None
        return s or {}

    @staticmethod
    def _chunk_rows(rows, cols):
        chunk = max(1, min(rows, (64 * MiB) // (cols * 2)))
        while rows % chunk:
            chunk -= 1
        return chunk

    def _key(self, i, j):
        jax = self.jax
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.spec.seed), i), j)

    def _scales(self):
        np = self.np
        return 1.0 / np.sqrt(self.D), 0.5 / np.sqrt(self.F)

    def _gen(self, arr, i, j, scale):
        """Fill numpy ``arr`` (rows, cols) bf16 with N(0, scale^2) in <= 64 MiB chunks on the device."""
        jax, np = self.jax, self.np
        rows, cols = arr.shape
        chunk = self._chunk_rows(rows, cols)
        gen = self._gen_fn(chunk, cols)
        key = self._key(i, j)
        for c in range(rows // chunk):
            arr[c * chunk:(c + 1) * chunk] = np.asarray(gen(jax.random.fold_in(key, c), scale))

    def _gen_matrix_fn(self, rows, cols):
        """One jitted call for a whole (rows, cols) matrix: the same values as the chunks of :meth:`_gen`."""
        jax, jnp = self.jax, self.jnp
        chunk = self._chunk_rows(rows, cols)
        n = rows // chunk

        def one(key, c, s):
            return (jax.random.normal(jax.random.fold_in(key, c), (chunk, cols), jnp.float32) * s).astype(jnp.bfloat16)

        return jax.jit(lambda k, s: jax.vmap(one, in_axes=(None, 0, None))(k, jnp.arange(n), s).reshape(rows, cols))

    def _cache_paths(self, cache_dir):
        """The two ``.npy`` files (A, B) of this seed and size in ``cache_dir``."""
        tag = f"seed{self.spec.seed}_L{self.L}_D{self.D}_F{self.F}"
        return Path(cache_dir) / f"A_{tag}.npy", Path(cache_dir) / f"B_{tag}.npy"

    def write_weight_cache(self, cache_dir) -> dict:
        """Generate the weights (one jitted call per layer matrix) into ``.npy`` files (uint16 bits of bf16)."""
        np = self.np
        t = time.perf_counter()
        sa, sb = self._scales()
        out = {}
        for j, (path, shape, scale) in enumerate(zip(self._cache_paths(cache_dir),
                                                      ((self.L, self.D, self.F), (self.L, self.F, self.D)),
                                                      (sa, sb))):
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint16, shape=shape)
            gen = self._gen_matrix_fn(shape[1], shape[2])
            for i in range(self.L):
                mm[i] = np.asarray(gen(self._key(i, j), scale)).view(np.uint16)
            mm.flush()
            del mm
            os.replace(tmp, path)
            out[path.name] = str(path)
        dt = time.perf_counter() - t
        log(f"wrote {self.weight_bytes / GiB:.2f} GiB of weights to {cache_dir} in {dt:.1f} s")
        return {"gen_s": dt, "files": out}

    def _gen_fn(self, rows, cols):
        jax, jnp = self.jax, self.jnp
        cache = self.__dict__.setdefault("_gen_cache", {})
        if (rows, cols) not in cache:
            cache[(rows, cols)] = jax.jit(
                lambda k, s: (jax.random.normal(k, (rows, cols), jnp.float32) * s).astype(jnp.bfloat16))
        return cache[(rows, cols)]

    def weights_np(self):
        """Per-layer numpy bf16 weights: A (L, D, F), B (L, F, D). Deterministic in --seed.

        Mapped read-only from the run's cache (``--weights-cache``) when it is there, else
        generated in this process in 64 MiB chunks.
        """
        if self._A is None:
            np, jnp = self.np, self.jnp
            t = time.perf_counter()
            cache = self.spec.weights_cache
            paths = self._cache_paths(cache) if cache else None
            if paths and all(p.exists() for p in paths):
                A, B = (np.load(p, mmap_mode="r").view(jnp.bfloat16) for p in paths)
                log(f"mapped {self.weight_bytes / GiB:.2f} GiB of weights from {cache} "
                    f"in {time.perf_counter() - t:.1f} s")
            else:
                sa, sb = self._scales()
                A = np.empty((self.L, self.D, self.F), jnp.bfloat16)
                B = np.empty((self.L, self.F, self.D), jnp.bfloat16)
                for i in range(self.L):
                    self._gen(A[i], i, 0, sa)
                    self._gen(B[i], i, 1, sb)
                log(f"generated {self.weight_bytes / GiB:.2f} GiB of weights in {time.perf_counter() - t:.1f} s")
            self._A, self._B = A, B
        return self._A, self._B

    def stacked_host_weights(self):
        """Stacked ``pinned_host`` arrays A (L, D, F), B (L, F, D) (the in-graph variants' form)."""
        A, B = self.weights_np()
        SA = self.jax.device_put(A, self.HOST)
        SB = self.jax.device_put(B, self.HOST)
        return self.jax.block_until_ready((SA, SB))

    def host_weights(self):
        """Per-layer separate pinned_host buffers [(a, b)] * L."""
        if self._host_w is None:
            A, B = self.weights_np()
            self._host_w = [(self.jax.device_put(A[i], self.HOST), self.jax.device_put(B[i], self.HOST))
                            for i in range(self.L)]
            self.jax.block_until_ready(self._host_w)
        return self._host_w

    def device_weights(self):
        """Per-layer device-resident weights [(a, b)] * L (cached: loaded once per process)."""
        if getattr(self, "_dev_w", None) is None:
            A, B = self.weights_np()
            w = [(self.jax.device_put(A[i], self.DEV), self.jax.device_put(B[i], self.DEV)) for i in range(self.L)]
            self._dev_w = self.jax.block_until_ready(w)
        return self._dev_w

    def inputs(self, tokens):
        """``(x, ct)``: the input and the output cotangent, ``(tokens, D)`` bfloat16 on the device."""
        jax, jnp = self.jax, self.jnp
        key = jax.random.PRNGKey(self.spec.seed + 10_000)
        x = jax.device_put(jax.random.normal(jax.random.fold_in(key, 0), (tokens, self.D), jnp.bfloat16), self.DEV)
        ct = jax.device_put(jax.random.normal(jax.random.fold_in(key, 1), (tokens, self.D), jnp.bfloat16), self.DEV)
        return jax.block_until_ready((x, ct))

    # ---- programs
    def ondev_forward(self, W, x):
        """The reference forward: ``fwd_j`` per layer over ``W`` = per-layer ``(a, b)``."""
        h = x
        for p in W:
            h = self.fwd_j(p, h)
        return h

    def ondev_train(self, W, x, ct):
        """The reference training step: ``(out, dx, [(da, db)] * L)``; per-layer forward and vjp executables."""
        hs = [x]
        h = x
        for p in W:
            h = self.fwd_j(p, h)
            hs.append(h)
        out = hs.pop()
        g = ct
        grads = [None] * len(W)
        for i in reversed(range(len(W))):
            g, grads[i] = self.bwd_j(W[i], hs[i], g)
            hs[i] = None
        return out, g, grads


def chunked_stages(b: Workload, W, chunks):
    """Stage list with the first and last layer split into column chunks over F.

    Inside a chunked layer the carry is ``(x, acc)``: the first chunk opens it
    (``x -> (x, x + gelu(x @ a_0) @ b_0)``), middle chunks add ``gelu(x @ a_c) @ b_c`` to
    ``acc``, the last closes it and returns one array again; whole layers take and return
    one array. The same function as the plain stack up to bf16 summation order. Smaller
    first and last transfers shorten the pipeline's start (32768 tokens: compute waits for
    the first transfer) and end (8192 tokens: the last layer's compute follows the last
    transfer). ``chunks`` = ``(first, last)`` counts (1: not split). Returns
    ``(stage_fns, stage_params)``; ``W`` = per-layer ``(a, b)`` arrays.
    """
    jax = b.jax

    def ffn(p, x):
        a, bb = p
        return jax.nn.gelu(x @ a) @ bb

    def opening(p, x):
        return x, x + ffn(p, x)

    def part(p, carry):
        x, acc = carry
        return x, acc + ffn(p, x)

    def closing(p, carry):
        x, acc = carry
        return acc + ffn(p, x)

    fns, params = [], []
    for i, (a, bb) in enumerate(W):
        n = chunks[0] if i == 0 else chunks[1] if i == len(W) - 1 else 1
        if n > 1:
            fc = b.F // n
            for c in range(n):
                fns.append(opening if c == 0 else closing if c == n - 1 else part)
                params.append((a[:, c * fc:(c + 1) * fc], bb[c * fc:(c + 1) * fc]))
        else:
            fns.append(b.layer)
            params.append((a, bb))
    return fns, params


def merge_chunk_grads(b: Workload, grads, chunks):
    """Per-stage gradients of ``chunked_stages(chunks=(first, last))`` back to per-layer ``(da, db)``."""
    jnp = b.jnp
    out, i = [], 0
    for layer in range(b.L):
        n = chunks[0] if layer == 0 else chunks[1] if layer == b.L - 1 else 1
        if n > 1:
            parts = grads[i:i + n]
            i += n
            out.append((jnp.concatenate([jnp.asarray(p[0]) for p in parts], axis=1),
                        jnp.concatenate([jnp.asarray(p[1]) for p in parts], axis=0)))
        else:
            out.append(grads[i])
            i += 1
    return out
