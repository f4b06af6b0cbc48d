#!/usr/bin/env python
"""One expert projection of a Mixtral-shaped layer in jax alone: dense dispatch against sorted segments.

The kernels under ``xla_swap.hf.moe``'s two experts forms, without torch or the stack: the
``gate_up`` projection (weights ``[E, 2 I, D]``, torch's layout) of ``--tokens`` tokens routed to
``--top-k`` of ``E`` experts (uniform random routing), bf16, forward and forward + backward (the
gradients of the input and the weights), jitted:

* ``dense``: ``einsum("nd,eod->eno")``, every expert on every token (``dense_experts_forward``);
* ``ragged``: ``jax.lax.ragged_dot_general`` over the ``tokens x k`` expert-sorted rows
  (``sorted_experts_forward``), as the installed jax and XLA lower it;
* ``blocked<B>``: the same sorted rows, each expert's segment padded to a multiple of ``B`` rows and
  one ``[B, D] x [D, 2 I]`` matmul per block in a ``lax.map`` over a static ``tokens k / B + E``
  blocks (the routed FLOPs plus the padding): a candidate for a future form, checked against
  ``ragged`` here (max abs difference printed).

Minimum of ``--reps`` calls after a warm-up (milliseconds). ``--smoke``: tiny shapes (CPU).

    python3 benchmarks/moe_ragged_dot.py --out $OUT/moe_ragged_dot.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def kernels(E: int, S: int, D: int, O: int, idx, blocks=(512, 1024)) -> dict:
    """``{name: f(xs [S, D], w [E, O, D]) -> [S, O]}`` for sorted expert ids ``idx`` ``[S]`` (``dense``
    takes the unsorted tokens ``[S / k, D]`` and returns ``[E, S / k, O]``)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    gs = jnp.bincount(idx, length=E).astype(jnp.int32)
    dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                         rhs_group_dimensions=[0])
    out = {"dense": lambda x, w: jnp.einsum("nd,eod->eno", x, w),
           "ragged": lambda xs, w: lax.ragged_dot_general(xs, w, gs, dims)}

    def blocked(B):
        nb = -(-S // B) + E

        def f(xs, w):
            padded = (gs + B - 1) // B * B
            pstart, start = jnp.cumsum(padded) - padded, jnp.cumsum(gs) - gs
            dest = pstart[idx] + jnp.arange(S) - start[idx]
            xp = jnp.zeros((nb * B, D), xs.dtype).at[dest].set(xs).reshape(nb, B, D)
            expert = jnp.minimum(jnp.searchsorted(pstart + padded, jnp.arange(nb) * B, side="right"), E - 1)
            yp = lax.map(lambda a: a[0] @ w[a[1]].T, (xp, expert))
            return yp.reshape(nb * B, O)[dest]
        return f
    for B in blocks:
        out[f"blocked{B}"] = blocked(B)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=14336)
    ap.add_argument("--num-experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU test runs it)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe_ragged_dot.json"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.d, args.f, args.num_experts, args.tokens, args.reps = 32, 48, 4, 64, 1
    import jax
    import jax.numpy as jnp
    E, N, k, D = args.num_experts, args.tokens, args.top_k, args.d
    S, O = N * k, 2 * args.f
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (N, D), jnp.bfloat16)
    w = jax.random.normal(keys[1], (E, O, D), jnp.bfloat16) * 0.02
    idx = jnp.sort(jax.random.randint(keys[2], (S,), 0, E))
    xs = x[jnp.arange(S) // k]
    blocks = (8, 16) if args.smoke else (512, 1024)
    fns = kernels(E, S, D, O, idx, blocks)
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "args": vars(args),
           "routed_fwd_flops": 2 * S * D * O, "dense_fwd_flops": 2 * N * E * D * O, "rows": {}}
    ref = fns["ragged"](xs, w).astype(jnp.float32)
    for name, f in fns.items():
        a = (x, w) if name == "dense" else (xs, w)
        row = res["rows"][name] = {}
        try:
            if name.startswith("blocked"):
                row["max_abs_diff_to_ragged"] = float(jnp.abs(f(*a).astype(jnp.float32) - ref).max())
            fwd = jax.jit(f)
            both = jax.jit(jax.value_and_grad(lambda *a: (f(*a).astype(jnp.float32) ** 2).mean(), argnums=(0, 1)))
            jax.block_until_ready((fwd(*a), both(*a)))
            tf, tb = [], []
            for _ in range(args.reps):
                t = time.perf_counter()
                jax.block_until_ready(fwd(*a))
                tf.append(time.perf_counter() - t)
                t = time.perf_counter()
                jax.block_until_ready(both(*a))
                tb.append(time.perf_counter() - t)
            row.update(fwd_ms=1e3 * min(tf), fwd_bwd_ms=1e3 * min(tb))
        except Exception as e:   # a lowering the installed jax / XLA lacks: recorded
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        print(name, json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
