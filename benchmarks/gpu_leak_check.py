"""No-leak check of the streaming runtime on a GPU: 100 consecutive calls, device memory unchanged.

Records the device's ``bytes_in_use`` (``jax.Device.memory_stats()``) after a warm-up call and
after each of 100 further forward calls and 10 training steps, and the number of live device
arrays. Saves JSON to ``$OUT/gpu_leak_check.json`` (else benchmarks/results/).

    PYTHONPATH=. python3 benchmarks/gpu_leak_check.py --d 4096 --f 16384 --layers 8 --tokens 4096
"""
import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from xla_swap.executors import RuntimeConfig, StreamingRuntime


def layer(w, h):
    return h + jax.nn.gelu(h @ w["a"]) @ w["b"]


def device_arrays() -> int:
    return sum(1 for a in jax.live_arrays() if getattr(a.sharding, "memory_kind", "device") == "device")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--f", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    key = jax.random.PRNGKey(0)
    params = [{"a": np.asarray(jax.random.normal(jax.random.fold_in(key, 2 * i), (args.d, args.f), jnp.bfloat16) * 0.02),
               "b": np.asarray(jax.random.normal(jax.random.fold_in(key, 2 * i + 1), (args.f, args.d), jnp.bfloat16) * 0.02)}
              for i in range(args.layers)]
    rt = StreamingRuntime(layer, params, RuntimeConfig(prefetch_depth=2))
    x = jax.random.normal(key, (args.tokens, args.d), jnp.bfloat16)

    def in_use():
        stats = dev.memory_stats() or {}
        return int(stats.get("bytes_in_use", -1))

    jax.block_until_ready(rt.forward(x))
    base, base_arrays = in_use(), device_arrays()
    fwd = []
    for _ in range(args.calls):
        jax.block_until_ready(rt.forward(x))
        fwd.append(in_use())
    loss = lambda h: jnp.sum(h.astype(jnp.float32))  # noqa: E731
    jax.block_until_ready(rt.train_step(x, loss))
    train_base = in_use()
    train = []
    for _ in range(10):
        jax.block_until_ready(rt.train_step(x, loss))
        train.append(in_use())
    out = {"device": dev.device_kind, "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "command": " ".join(sys.argv), "args": vars(args), "bytes_in_use_after_warmup": base,
           "forward_bytes_in_use": fwd, "live_device_arrays_before": base_arrays, "live_device_arrays_after": device_arrays(),
           "train_bytes_in_use_after_warmup": train_base, "train_bytes_in_use": train,
           "max_resident_stages": rt.max_resident_stages}
    out["forward_unchanged"] = all(b == base for b in fwd)
    out["train_unchanged"] = all(b == train_base for b in train)
    path = os.path.join(os.environ.get("OUT", "benchmarks/results"), "gpu_leak_check.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"forward: bytes_in_use after warm-up {base}, after {args.calls} calls min {min(fwd)} max {max(fwd)} "
          f"-> unchanged={out['forward_unchanged']}; live device arrays {base_arrays} -> {out['live_device_arrays_after']}")
    print(f"train: bytes_in_use after warm-up {train_base}, after 10 steps min {min(train)} max {max(train)} "
          f"-> unchanged={out['train_unchanged']}; max resident stages {rt.max_resident_stages}")
    return 0 if out["forward_unchanged"] and out["train_unchanged"] else 1


if __name__ == "__main__":
    sys.exit(main())
