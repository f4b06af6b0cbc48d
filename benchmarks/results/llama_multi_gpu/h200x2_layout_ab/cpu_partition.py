"""How XLA's partitioner splits a Llama MLP's backward over 2 devices under the two weight splits (CPU compile only).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu python \
        benchmarks/results/llama_multi_gpu/h200x2_layout_ab/cpu_partition.py

The gradient of ``sum(((silu(x @ gate) * (x @ up)) @ down) ** 2)`` w.r.t. the weights, bf16, D=4096, F=14336,
8 x 4096 tokens split over the devices by batch, compiled (not run) with the weights split as the package's
``"fsdp"`` rule split them until the eighth run (``gate``/``up`` held ``[D, F]`` on F, ``down`` ``[F, D]`` on F;
``--shard largest`` since) and on their first dimension (``"major"``; the ``"fsdp"`` rule since), each also with the weights explicitly gathered
(``with_sharding_constraint`` to replicated). Prints, per variant, the compiled program's transposes and
collectives. On the CPU every variant all-gathers the three weights (it does not move the activations
instead); the CPU's transposes say nothing of the GPU's layouts (``benchmarks/cross_compile.py`` compiles for
the GPUs: ../README.md, eighth run).
"""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
D, F, B, S = 4096, 14336, 8, 4096
REP = NamedSharding(mesh, P())


def make_loss(gather: bool):
    def loss(w, x):
        if gather:
            w = jax.lax.with_sharding_constraint(w, {k: REP for k in w})
        h = jax.nn.silu(x @ w["gate"]) * (x @ w["up"])
        return jnp.sum((h @ w["down"]).astype(jnp.float32) ** 2)
    return loss


FSDP = {"gate": P(None, "d"), "up": P(None, "d"), "down": P("d", None)}
MAJOR = {"gate": P("d", None), "up": P("d", None), "down": P("d", None)}
w = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in (("gate", (D, F)), ("up", (D, F)), ("down", (F, D)))}
x = jax.ShapeDtypeStruct((B, S, D), jnp.bfloat16)
for name, specs, gather in (("fsdp", FSDP, False), ("fsdp_gathered", FSDP, True), ("major", MAJOR, False),
                            ("major_gathered", MAJOR, True)):
    wsh = {k: NamedSharding(mesh, v) for k, v in specs.items()}
    f = jax.jit(jax.grad(make_loss(gather)), in_shardings=(wsh, NamedSharding(mesh, P("d", None, None))),
                out_shardings=wsh)
    text = f.lower(w, x).compile().as_text()
    ops = {op: re.findall(r"= (\S+) " + re.escape(op) + r"\(", text)
           for op in ("transpose", "all-gather", "all-gather-start", "reduce-scatter", "all-reduce", "all-reduce-start",
                      "all-to-all", "collective-permute", "collective-permute-start")}
    print(json.dumps({"variant": name, **{k: v for k, v in ops.items() if v}}), flush=True)
