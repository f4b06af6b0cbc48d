#!/usr/bin/env python
"""How the order in which the host dispatches ``pinned_host`` <-> device copies sets the rate of the two
directions at once: one command, on the first ``--gpus`` devices (every one by default).

``torch_stack.measure_bandwidth`` gives the floors of the training benchmarks their "both directions"
rate. It used to dispatch every array to the device as one ``jax.device_put`` list, then every device copy
back as another; the runtime's own steps then moved bytes faster than that rate. This script times the
same bytes dispatched in several orders:

* ``h2d`` / ``d2h``: one direction, one list call (the single-direction rates);
* ``lists``: the arrays in as one list call, then their device copies out as another (the old method);
* ``lists_d2h_first``: the same, out first;
* ``one_list_alternating``: one list call whose arrays alternate in, out;
* ``singles_in_then_out``: one call per array, every array in, then every copy out;
* ``alternating_singles``: one call per array, array k in, then copy k out, then k+1 ... (the new method);
* ``blocks_of_{2,4,8}``: calls of 2, 4 or 8 arrays, alternating direction;
* ``stages_*``: a runtime-like pass: per stage a jitted computation (``--stage-matmuls`` products of
  ``[--stage-m]^2`` bf16), its ``--arrays-per-stage`` results sent out (they wait for it) and as many
  arrays brought in, dispatched as two lists, out first (the runtime's order) or in first, or as
  alternating single calls.

Every variant moves ``--arrays`` arrays of ``--mib`` MiB per device each way (``stages_*``:
``--stages`` x ``--arrays-per-stage``), best of ``--reps`` after a warm-up; GB/s counts the bytes both
ways together over the wall time. Results: JSON lines on stdout and ``--out``. ``--cpu-smoke``: tiny
arrays on the CPU devices (what the test runs).

    python3 benchmarks/copy_order.py --out $OUT/copy_order.json
    PYTHONPATH=. python3 benchmarks/copy_order.py --cpu-smoke --out /tmp/copy_order.json
"""
from __future__ import annotations

import argparse
import json
import time


def _best(f, reps: int) -> float:
    """Seconds of the fastest of ``reps`` calls of ``f`` after one warm-up call."""
    f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def _arrays(devs, count: int, mib: float, base: int):
    """``count`` bf16 arrays of ``mib`` MiB per device, split over ``devs``: (device arrays, shardings)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    mesh = jax.sharding.Mesh(np.array(devs), ("d",))
    dsh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    elems = int(mib * 2 ** 20 / 2) * len(devs)
    fill = jax.jit(lambda v: jnp.full((elems,), v, jnp.bfloat16), out_shardings=dsh)
    return [fill(float(base + i)) for i in range(count)], dsh


def transfer_variants(host: list, dev: list, dsh, hsh) -> dict:
    """``{name: (call, bytes moved)}``: the pure transfer orders (module docstring) of ``host``
    (``pinned_host`` arrays) in and ``dev`` (device arrays) out. Each call waits for its copies and
    returns them (a list of jax arrays)."""
    import jax
    put, ready = jax.device_put, jax.block_until_ready
    n, W = len(host), sum(a.nbytes for a in host)

    def blocks(k):
        def run():
            moved = []
            for j in range(0, n, k):
                moved += put(host[j:j + k], [dsh] * len(host[j:j + k]))
                moved += put(dev[j:j + k], [hsh] * len(dev[j:j + k]))
            return ready(moved)
        return run

    return {
        "h2d": (lambda: ready(put(host, [dsh] * n)), W),
        "d2h": (lambda: ready(put(dev, [hsh] * n)), W),
        "lists": (lambda: ready(put(host, [dsh] * n) + put(dev, [hsh] * n)), 2 * W),
        "lists_d2h_first": (lambda: ready(put(dev, [hsh] * n) + put(host, [dsh] * n)), 2 * W),
        "one_list_alternating": (lambda: ready(put([a for p in zip(host, dev) for a in p],
                                                   [s for _ in range(n) for s in (dsh, hsh)])), 2 * W),
        "singles_in_then_out": (lambda: ready([put(a, dsh) for a in host] + [put(d, hsh) for d in dev]), 2 * W),
        "alternating_singles": (lambda: ready([c for a, d in zip(host, dev) for c in (put(a, dsh), put(d, hsh))]),
                                2 * W),
        **{f"blocks_of_{k}": (blocks(k), 2 * W) for k in (2, 4, 8) if k < n},
    }


def stage_variants(host: list, dev: list, dsh, hsh, stages: int, matmuls: int, m: int) -> tuple[dict, float]:
    """``({name: (call, bytes)}, seconds of one stage's computation)``: the runtime-like passes (module
    docstring); each stage's outputs are ``dev`` plus a scalar of its computation, so they wait for it.
    Each call waits for its copies and returns them (a list of jax arrays)."""
    import jax
    import jax.numpy as jnp
    put, ready = jax.device_put, jax.block_until_ready
    x = jax.device_put(jnp.ones((m, m), jnp.bfloat16), jax.sharding.NamedSharding(dsh.mesh, jax.sharding.PartitionSpec()))

    @jax.jit
    def stage(x, ws):
        for _ in range(matmuls):
            x = (x @ x) * 1e-4
        return x, [w + x[0, 0] for w in ws]

    ready(stage(x, dev))
    t_stage = _best(lambda: ready(stage(x, dev)[0]), 3)
    k, W = len(host), sum(a.nbytes for a in host)

    def run(order):
        def go():
            moved = []
            for _ in range(stages):
                outs = stage(x, dev)[1]
                if order == "out_first":
                    moved += put(outs, [hsh] * k) + put(host, [dsh] * k)
                elif order == "in_first":
                    moved += put(host, [dsh] * k) + put(outs, [hsh] * k)
                else:
                    moved += [c for o, a in zip(outs, host) for c in (put(o, hsh), put(a, dsh))]
            return ready(moved)
        return go

    return ({f"stages_{o}": (run(o), stages * 2 * W) for o in ("out_first", "in_first", "alternating_singles")},
            t_stage)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=0, help="devices to use (0: every one jax sees)")
    p.add_argument("--arrays", type=int, default=16)
    p.add_argument("--mib", type=float, default=256.0, help="MiB per device of each array")
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--arrays-per-stage", type=int, default=8)
    p.add_argument("--stage-matmuls", type=int, default=12)
    p.add_argument("--stage-m", type=int, default=8192)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny arrays on the CPU devices")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.arrays, args.mib, args.stages, args.arrays_per_stage = 8, 0.25, 2, 4
        args.stage_matmuls, args.stage_m, args.reps = 2, 64, 2
    import jax
    devs = jax.devices()[:args.gpus or None]
    dev, dsh = _arrays(devs, args.arrays, args.mib, 100)
    hsh = dsh.with_memory_kind("pinned_host")
    host = jax.block_until_ready(jax.device_put(_arrays(devs, args.arrays, args.mib, 0)[0], [hsh] * args.arrays))
    results = {"devices": len(devs), "device_kind": devs[0].device_kind, "jax": jax.__version__,
               "arrays": args.arrays, "mib_per_device": args.mib, "rows": []}

    def record(name, call, nbytes, **extra):
        s = _best(call, args.reps)
        row = {"variant": name, "GBps": nbytes / s / 1e9, "ms": s * 1e3, "bytes": nbytes, **extra}
        results["rows"].append(row)
        print(json.dumps(row), flush=True)

    for name, (call, nbytes) in transfer_variants(host, dev, dsh, hsh).items():
        record(name, call, nbytes)
    k = args.arrays_per_stage
    variants, t_stage = stage_variants(host[:k], dev[:k], dsh, hsh, args.stages, args.stage_matmuls, args.stage_m)
    for name, (call, nbytes) in variants.items():
        record(name, call, nbytes, stage_compute_ms=t_stage * 1e3, stages=args.stages)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
