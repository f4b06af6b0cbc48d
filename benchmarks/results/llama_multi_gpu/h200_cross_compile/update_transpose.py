"""What the transposed gradients cost the fused AdamW update on one GPU, at one device's shapes of the 8B-like
model on 2 GPUs (the eighth run of ../README.md).

    PYTHONPATH=. python3 benchmarks/results/llama_multi_gpu/h200_cross_compile/update_transpose.py

``xla_swap.executors.optim.apply_update`` (the update the backward programs fuse) over bf16 weights, gradients and
moments of one layer's ``gate_proj`` and ``up_proj`` shards and of the ``lm_head`` shard, as each of the two
rules leaves them on a device: the largest-dimension split (held ``[4096, 7168]`` and ``[4096, 16000]``, the
gradient reduce-scattered as its transpose, ``[7168, 4096]`` and ``[16000, 4096]``), and the split on the held
layout's first dimension (``[2048, 14336]`` and ``[2048, 32000]``, the gradient alike). Weights and moments
donated, as in the runtime. Prints per variant the median of 50 runs (ms) and the compiled program's fusions.
"""
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from xla_swap.executors.optim import apply_update, hyper_rows
from xla_swap.planning.optimizer import AdamW


def variant(shapes: list, transposed: bool, reps: int = 50) -> dict:
    """The median time (ms) of one update of weights of ``shapes`` whose gradients arrive transposed or not."""
    key = jax.random.key(0)
    p = [jax.random.normal(key, s, jnp.bfloat16) for s in shapes]
    g = [jax.random.normal(key, s[::-1] if transposed else s, jnp.bfloat16) for s in shapes]
    st = [(jnp.zeros(s, jnp.bfloat16), jnp.zeros(s, jnp.bfloat16)) for s in shapes]
    opt = AdamW(lr=1e-5)
    hyper = jnp.asarray(hyper_rows([opt], 1))

    def upd(p, g, st, hyper):
        g = [x.T for x in g] if transposed else g
        return apply_update(p, g, st, hyper, [0] * len(p))
    f = jax.jit(upd, donate_argnums=(0, 2))
    text = f.lower(p, g, st, hyper).compile().as_text()
    fusions = sorted(set(re.findall(r"^\s+%?((?:input|loop|wrapped)_[\w]*fusion|wrapped_\w+)[.\d]* = ", text, re.M)))
    p, st = f(p, g, st, hyper)
    jax.block_until_ready((p, st))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        p, st = f(p, g, st, hyper)
        jax.block_until_ready((p, st))
        times.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "fusions": fusions}


def main():
    out = {"device": str(jax.devices()[0].device_kind)}
    cases = {"layer gate_proj + up_proj": [(4096, 7168)] * 2, "lm_head": [(4096, 16000)]}
    for name, shapes in cases.items():
        out[name] = {"largest (gradient transposed)": variant(shapes, True),
                     "first dim": variant([(s[0] // 2, s[1] * 2) for s in shapes], False)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
