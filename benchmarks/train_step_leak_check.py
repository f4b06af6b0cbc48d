"""Host-memory leak check of ``StreamingRuntime.train_step``.

Runs ``--steps`` training steps twice: once with a fresh loss closure every step (targets
captured by a new ``lambda``: the natural way to pass them, which used to cache and compile
every closure forever), once with the same ``loss_fn`` and the targets in ``loss_args``. The
process RSS (``/proc/self/statm``, bytes) is sampled every step; the slope after the warm-up
(least squares over the second half) must be under 1 KiB per step. Runs on the CPU in about a
minute; the figures go to ``--out-dir`` (nothing is written without it).

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/train_step_leak_check.py --steps 1000 --out-dir out/
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from xla_swap.executors import RuntimeConfig, StreamingRuntime

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def layer(p, h):
    return h + jnp.tanh(h @ p["a"]) @ p["b"]


def slope_bytes_per_step(samples: list) -> float:
    """Least-squares slope of the second half of ``samples`` (bytes per step)."""
    y = np.asarray(samples[len(samples) // 2:], np.float64)
    return float(np.polyfit(np.arange(len(y)), y, 1)[0])


def run(steps: int, fresh_closure: bool) -> dict:
    rng = np.random.default_rng(0)
    params = [{"a": rng.standard_normal((32, 64), np.float32) * 0.1,
               "b": rng.standard_normal((64, 32), np.float32) * 0.1} for _ in range(4)]
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2, track_residency=False))
    x = rng.standard_normal((16, 32), np.float32)
    targets = [rng.standard_normal((16, 32), np.float32) for _ in range(4)]

    def loss(out, t):
        return jnp.mean((out - t) ** 2)

    samples, t0 = [], time.perf_counter()
    for s in range(steps):
        t = targets[s % 4]
        if fresh_closure:
            out = rt.train_step(x, lambda o, t=t: loss(o, t))
        else:
            out = rt.train_step(x, loss, loss_args=(t,))
        jax.block_until_ready(out[0])
        samples.append(rss_bytes())
    return {"fresh_closure": fresh_closure, "steps": steps, "seconds": time.perf_counter() - t0,
            "rss_first": samples[0], "rss_last": samples[-1], "slope_bytes_per_step": slope_bytes_per_step(samples),
            "loss_jits_cached": len(rt._loss_jits)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    import warnings
    warnings.simplefilter("ignore")
    res = [run(args.steps, True), run(args.steps, False)]
    for r in res:
        print(json.dumps(r))
    ok = all(r["slope_bytes_per_step"] < 1024 for r in res)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "train_step_leak_check.json"), "w") as f:
            json.dump({"results": res, "argv": sys.argv, "jax": jax.__version__}, f, indent=1)
    print("PASS" if ok else "FAIL", "slope < 1 KiB/step")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
