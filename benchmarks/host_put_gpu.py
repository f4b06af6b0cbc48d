#!/usr/bin/env python
"""How fast a stage's values reach ``pinned_host``, by each path a build can take: one command, 1 and n GPUs.

A 70B-shaped build moved its state into ``pinned_host`` at about 0.9 GB/s on H200s
(``benchmarks/results/four_gpu/``), against a host link of 50+ GB/s per GPU. This script times each step of
the paths a leaf can take, so the build's path is chosen from figures:

* ``cuda_to_pageable``: ``torch.randn(..., device="cuda").cpu()``, a GPU tensor into fresh pageable memory
  (what ``RandomWeights`` does before the stack sees the values);
* ``numpy_to_pinned``: ``jax.device_put(numpy, NamedSharding(..., memory_kind="pinned_host"))``, the build's
  path today (``xla_swap.stack.stages.host_stages``);
* ``numpy_via_device``: the same numpy array put in device memory first, then moved to ``pinned_host``
  (two link crossings, each a DMA);
* ``cuda_via_dlpack``: a CUDA tensor laid out on the GPUs as the stack lays out CUDA inputs (pieces handed
  to jax by DLPack), then moved to ``pinned_host`` (no pageable copy);
* ``zeros_program``: a jitted ``zeros`` whose output lives in ``pinned_host`` (the fresh AdamW moments).

Each at two leaf shapes of a Llama-2-70B layer (``[8192, 28672]`` and ``[8192, 8192]``, bf16), split by rows
and by columns over 1 and n devices (``P('d', None)``, ``P(None, 'd')``): the median GB/s of ``--reps``
after one warm-up, in ``--out`` (JSON) and a table on stdout. ``--cpu-smoke``: tiny leaves on 4 virtual
CPU devices (the CUDA paths skipped), what the test runs.

    PYTHONPATH=/tmp/site:. python3 benchmarks/host_put_gpu.py --out $OUT/host_put.json
    PYTHONPATH=. python3 benchmarks/host_put_gpu.py --cpu-smoke --out /tmp/host_put.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` (which returns what to wait on) over ``reps`` runs after one warm-up."""
    import jax
    jax.block_until_ready(fn())
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def paths(shape: tuple, n: int, spec: str, reps: int, cuda: bool) -> dict:
    """GB/s of each path (module docstring) for one bf16 leaf of ``shape`` split by ``spec`` over ``n`` devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    devs = jax.devices()[:n]
    pspec = P("d", None) if spec == "rows" else P(None, "d")
    host = NamedSharding(Mesh(np.array(devs), ("d",)), pspec, memory_kind="pinned_host")
    dev = host.with_memory_kind("device")
    nbytes = int(np.prod(shape)) * 2
    a = np.asarray(np.random.default_rng(0).standard_normal(shape, np.float32), jnp.bfloat16)
    out = {"shape": list(shape), "n": n, "split": spec, "bytes": nbytes}
    out["numpy_to_pinned"] = _timed(lambda: jax.device_put(a, host, may_alias=False), reps)
    out["numpy_via_device"] = _timed(lambda: jax.device_put(jax.device_put(a, dev, may_alias=False), host), reps)
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.bfloat16), out_shardings=host)
    out["zeros_program"] = _timed(zeros, reps)
    if cuda:
        import torch
        g = torch.randn(shape, device="cuda:0", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        out["cuda_to_pageable"] = _timed(lambda: g.cpu(), reps)
        out["cuda_via_dlpack"] = _timed(lambda: _cuda_pieces_to_pinned(g, host), reps)
    return {k: (nbytes / v / 1e9 if isinstance(v, float) else v) for k, v in out.items()}


def _cuda_pieces_to_pinned(t, host):
    """``t`` (a CUDA tensor) as a ``pinned_host`` array of sharding ``host``: laid out on the GPUs as the stack
    lays out CUDA inputs (:func:`xla_swap.stack.torch_bridge.inputs_to_jax`: each piece copied peer to peer by torch
    and handed to jax by DLPack), then moved to ``pinned_host`` (one DMA per shard)."""
    import jax
    from xla_swap.stack.torch_bridge import inputs_to_jax
    on_devices = inputs_to_jax(t, "leaf", placement=lambda avals: (host.with_memory_kind("device"),))
    return jax.device_put(on_devices, host)


def main(argv=None) -> int:
    """The CLI (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "host_put.json"))
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from xla_swap.executors.host_pool import ensure_host_memory_limit
    ensure_host_memory_limit(8 << 30)
    cuda = jax.devices()[0].platform == "gpu"
    shapes = [(64, 224), (64, 64)] if args.cpu_smoke else [(8192, 28672), (8192, 8192)]
    counts = sorted({1, len(jax.devices())})
    rows = [paths(s, n, spec, args.reps, cuda) for s in shapes for n in counts for spec in ("rows", "cols")]
    data = {"device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "jax": jax.__version__, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    cols = ["numpy_to_pinned", "numpy_via_device", "cuda_to_pageable", "cuda_via_dlpack", "zeros_program"]
    print(f"{data['device']} x {data['devices']}, GB/s (median of {args.reps})")
    print("| leaf | devices | split | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[c]:.2f}" if c in r else "-" for c in cols]
        print(f"| {r['shape']} | {r['n']} | {r['split']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
