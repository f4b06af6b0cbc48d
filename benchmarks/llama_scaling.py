"""The measuring pieces of ``llama_multi_gpu.py``, each run in its own process: an HF Llama (``llama_model``)
trained through ``SwappedStack`` with ``torch.optim.AdamW``, weights, gradients and moments in ``pinned_host``
(the default policy: remat, 2 stages prefetched, AdamW fused into the backward), on 1 and n GPUs.

* :func:`piece_ours` (one process, ``devices=jax.devices()[:n]``): the links first (NVLink by torch peer
  copies, :func:`nvlink_bandwidth`; the host link with every GPU pulling its own shards of ``pinned_host``
  arrays at once, :func:`host_link`; the dense bf16 GEMM rate of one GPU, :func:`gemm_rate`), then the
  1-GPU rows at each token count per GPU and the n-GPU rows at each global count (strong: the same
  counts; weak: n times them).
* :func:`piece_torchrun` (one rank of ``torchrun --nproc-per-node n``, one GPU each): the same stack over
  every rank's device after ``xla_swap.distributed.initialize()``, each rank passing its own local
  batch (DDP semantics: the global batch is the ranks' batches concatenated). Where that module is not
  there, jax's own ``jax.distributed.initialize`` from torchrun's environment, every rank passing the
  global batch (the README's earlier form); the row says which (``form``).
* :func:`piece_largest`: one row of the largest model (``--largest-layers`` of a shape), built on the
  meta device and loaded per stage (random values drawn on the GPU), the pinned pool sized from its state.

Every row: the first step (compilation) timed apart, ``--warmup`` more steps, then ``--reps`` timed steps,
each synced on the updated weights and moments in ``pinned_host``; the first loss; the bytes the step's
schedule moves (``attention_gpu.link_floor``'s counts: weights in, weights out, moments in and out);
the model FLOPs (``llama_model.model_flops``). The floors are computed from these by ``llama_multi_gpu``.
Each piece writes its JSON (``--piece-out``) after every row, so a piece stopped by its deadline keeps
the rows it finished.
"""
from __future__ import annotations

import gc
import json
import os
import re
import statistics
import sys
import time

import llama_model as lm


def host_memory() -> dict:
    """This process's peak and current resident set and the machine's available memory (bytes, Linux)."""
    out = {}
    for path, keys in (("/proc/self/status", ("VmHWM", "VmRSS")), ("/proc/meminfo", ("MemAvailable", "MemTotal"))):
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(":")
                    if name in keys:
                        out[name] = int(value.split()[0]) * 1024
        except OSError:
            pass
    return out


def nvlink_bandwidth(n: int, gib: float = 1.0, reps: int = 3) -> dict | None:
    """GPU-to-GPU bandwidth by torch peer copies, every GPU sending ``gib`` GiB to the next (a ring) at once:
    ``{"per_gpu": bytes/s each GPU receives (best of reps), "peer_access": [...]}``; None below 2 GPUs
    or without CUDA. Run before jax takes the GPUs' memory; frees what it allocated."""
    import torch
    if n < 2 or not torch.cuda.is_available() or torch.cuda.device_count() < n:
        return None
    nbytes = int(gib * 2 ** 30)
    src = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
    dst = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{(i + 1) % n}") for i in range(n)]
    streams = [torch.cuda.Stream(device=i) for i in range(n)]

    def ring():
        for i in range(n):
            with torch.cuda.device(i), torch.cuda.stream(streams[i]):
                dst[i].copy_(src[i], non_blocking=True)
        for i in range(n):
            torch.cuda.synchronize(i)

    ring()
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        ring()
        best = max(best, nbytes / (time.perf_counter() - t))
    peer = [torch.cuda.can_device_access_peer(i, (i + 1) % n) for i in range(n)]
    del src, dst
    torch.cuda.empty_cache()
    return {"per_gpu": best, "bytes": nbytes, "peer_access": peer}


def host_link(devs, gib_per_device: float = 4.0, arrays: int = 16, reps: int = 3) -> dict:
    """Aggregate ``pinned_host`` <-> device bandwidths (bytes/s) with every device of ``devs`` moving its own
    shards at once (``torch_stack.measure_bandwidth``: h2d, d2h, both; best of ``reps`` after a warm-up
    round): ``arrays`` bf16 arrays of ``gib_per_device / arrays`` GiB per device, split over a mesh of
    ``devs``. On one H200, 16 arrays of 256 MiB read 100.5 GB/s both ways, 4 of them 97.8
    (``benchmarks/results/copy_order/README.md``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from torch_stack import measure_bandwidth
    mesh = Mesh(np.array(devs), ("d",))
    dev_sh = NamedSharding(mesh, PartitionSpec("d"))
    host_sh = dev_sh.with_memory_kind("pinned_host")
    elems = int(gib_per_device * 2 ** 30 / arrays / 2) * len(devs)   # bf16 elements of one array
    host = [jax.device_put(jax.jit(lambda i=i: jnp.full((elems,), i, jnp.bfloat16), out_shardings=dev_sh)(),
                           host_sh) for i in range(arrays)]
    jax.block_until_ready(host)
    bw = measure_bandwidth(host, reps + 1)
    del host
    return {"n": len(devs), **bw}


def gemm_rate(dev, m: int = 8192, chain: int = 16, reps: int = 5) -> float:
    """Dense bf16 matmul rate of one device (FLOP/s, best of ``reps``): ``chain`` products of ``[m, m]``."""
    import jax
    import jax.numpy as jnp
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    a = jax.device_put(jax.random.normal(k1, (m, m), jnp.bfloat16), dev)
    b = jax.device_put(jax.random.normal(k2, (m, m), jnp.bfloat16) / m ** 0.5, dev)

    @jax.jit
    def f(x, w):
        for _ in range(chain):
            x = x @ w
        return x

    jax.block_until_ready(f(a, b))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(a, b))
        best = min(best, time.perf_counter() - t)
    return chain * 2.0 * m ** 3 / best


def largest_dim_rule(name: str, shape: tuple) -> tuple:
    """``ParallelConfig(shard=...)`` for ``--shard largest``: the package's ``"fsdp"`` rule before the eighth run
    (``results/llama_multi_gpu/README.md``), every 2-D weight split on its largest dimension (a square one on
    torch's dim 1), 1-D weights replicated, for the A/B against the split on the held layout's first dimension.
    Given in torch's layout: the stack holds an ``nn.Linear`` weight as ``[in, out]`` and reverses the spec, so
    ``gate_proj``, ``up_proj`` and ``lm_head`` split on the minor dimension of the layout they are held in."""
    if len(shape) != 2:
        return ()
    return ("d", None) if shape[0] > shape[1] else (None, "d")


def build_stack(shape: dict, devices, fill_device, seed: int = 0, prefetch_depth: int | None = None,
                shard: str = "fsdp"):
    """``(stack, seconds)``: ``SwappedStack`` over ``causal_lm_stages`` of a meta-device Llama of ``shape``
    (``llama_model.meta_model``), ``torch.optim.AdamW(lr=1e-5)`` over its parameters, loss ``llama_model.ce``,
    on ``devices``, the layers' values drawn per stage on ``fill_device`` (``generate_gpu.RandomWeights``);
    ``xla_swap.stack.swapped_stack.DEFAULT_POLICY``, with ``prefetch_depth`` where given; the weights split
    by ``shard``: ``"fsdp"`` (the package's rule) or ``"largest"`` (:func:`largest_dim_rule`, with the batch
    split over the devices as ``"fsdp"`` splits it)."""
    import dataclasses

    import torch
    import xla_swap
    from generate_gpu import RandomWeights
    from xla_swap.stack.swapped_stack import DEFAULT_POLICY
    t0 = time.perf_counter()
    model = lm.meta_model(shape, fill_device=fill_device, seed=seed)
    first, layers, last = xla_swap.causal_lm_stages(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    policy = DEFAULT_POLICY
    if prefetch_depth is not None:
        policy = dataclasses.replace(policy, prefetch_depth=prefetch_depth)
    stack = xla_swap.SwappedStack(layers, first=first, last=last, optimizer=opt, loss_fn=lm.ce,
                                  parallel=xla_swap.ParallelConfig(   # a callable rule's default: no data parallelism
                                      devices=devices, shard=largest_dim_rule if shard == "largest" else shard,
                                      data_parallel=True if shard == "largest" else None),
                                  weights=RandomWeights(fill_device, seed=seed), policy=policy)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()   # the stage values drawn on the GPU
    return stack, time.perf_counter() - t0


def schedule_bytes(stack) -> dict:
    """The bytes the stack's last step moved over the host links (logical, all devices together):
    ``w_in`` weights in, ``w`` weights out (the updated ones), ``m`` moments (each way), ``act`` offloaded
    activations (each way); ``weight`` all the stages' weights."""
    from attention_gpu import link_floor
    from xla_swap.planning.costs import Link
    f = link_floor(stack, Link(h2d_gbps=1.0, d2h_gbps=1.0, both_gbps=1.0))
    return {"w_in": f["w_in_bytes"], "w": f["w_bytes"], "m": f["m_bytes"], "act": f["act_bytes"],
            "weight": stack.runtime.weight_nbytes}


def time_steps(stack, x, y, reps: int, warmup: int) -> dict:
    """The first step (compilation) timed, ``warmup`` more, then ``reps`` timed steps, each synced on the
    runtime's ``pinned_host`` weights and moments: ``{"first_step_s", "first_loss", "samples", "step_s",
    "last_loss"}`` (seconds; losses as floats)."""
    import jax
    rt = stack.runtime

    def step():
        loss = stack.train_step(x, y)
        jax.block_until_ready((rt.host_params, rt.optimizer_state))
        return float(loss)

    t = time.perf_counter()
    first = step()
    first_s = time.perf_counter() - t
    for _ in range(warmup):
        step()
    samples, last = [], first
    for _ in range(reps):
        t = time.perf_counter()
        last = step()
        samples.append(time.perf_counter() - t)
    return {"first_step_s": first_s, "first_loss": first, "samples": samples,
            "step_s": statistics.median(samples) if samples else None, "last_loss": last}


_COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "bf16": 2}


def hlo_collectives(text: str) -> list[dict]:
    """The collectives of a compiled HLO module's text, grouped: ``[{"op", "result", "count", "bytes"}]``,
    ``result`` the result type as written (a tuple for a combined collective), ``bytes`` the result's
    bytes summed over the group (what one device ends with; the bytes on the wire depend on the op and
    the device count), largest first."""
    groups: dict = {}
    for result, op in _COLLECTIVE.findall(re.sub(r"/\*.*?\*/", "", text)):   # tuples hold /*index=5*/
        result = re.sub(r"\{[^}]*\}", "", result).strip()    # layouts
        nbytes = 0
        for dtype, dims in _ARRAY.findall(result):
            size = _ITEMSIZE.get(dtype) or max(1, int(dtype[1:]) // 8)
            for d in filter(None, dims.split(",")):
                size *= int(d)
            nbytes += size
        g = groups.setdefault((op, result), {"op": op, "result": result, "count": 0, "bytes": 0})
        g["count"] += 1
        g["bytes"] += nbytes
    return sorted(groups.values(), key=lambda g: -g["bytes"])


def stage_collectives(stack, stage: int = 1) -> dict:
    """``{kind: hlo_collectives(...)}`` of stage ``stage``'s compiled ``forward`` and ``backward`` executables
    for the last call's input signature (compiled again here, donating nothing); a kind that failed to
    compile maps to ``{"error": ...}``."""
    rt = stack.runtime
    sig = rt.compiler.last_sig
    out = {}
    for kind in ("forward", "backward"):
        try:
            out[kind] = hlo_collectives(rt.stage_executable(sig, kind, stage).as_text())
        except Exception as e:  # noqa: BLE001 - a diagnostic: say why, keep the row
            out[kind] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def profile_step(stack, x, y, where: str) -> dict:
    """One more step traced by jax's profiler into ``where`` (a perfetto trace): ``{"dir", "step_s",
    "overlap", "collectives"}``: :func:`trace_summary.overlap`'s per-GPU split of the window (compute,
    collectives and the part of them no compute hides, host copies, idle; microseconds), and the
    collectives of the first decoder layer's programs (:func:`stage_collectives`: which ops, dtypes
    and sizes cross NVLink)."""
    import jax
    import trace_summary
    rt = stack.runtime
    with jax.profiler.trace(where, create_perfetto_trace=True):
        t = time.perf_counter()
        stack.train_step(x, y)
        jax.block_until_ready((rt.host_params, rt.optimizer_state))
        step_s = time.perf_counter() - t
    return {"dir": where, "step_s": step_s, "overlap": trace_summary.overlap(trace_summary.load(where)),
            "collectives": stage_collectives(stack)}


def stack_rows(shape: dict, devices, tokens: list[int], args, emit, form: str = "single",
               local: tuple | None = None) -> None:
    """Rows of one stack on ``devices`` at each global token count of ``tokens`` (``emit(row)`` each).

    ``local``: ``(rank, world)`` in the torchrun form: the stack spans every rank's device and this rank
    passes its own slice of the global batch (``form == "torchrun"``) or the whole of it
    (``"torchrun_global_batch"``, jax's own initialisation)."""
    n = len(devices)
    shard = getattr(args, "shard", "fsdp")
    stack, build_s = build_stack(shape, devices, args.fill_device, args.seed, args.prefetch_depth, shard)
    print(json.dumps({"built": form, "n": n, "build_s": round(build_s, 1)}), flush=True)   # a stopped piece's progress
    counts = lm.param_counts(shape)
    for T in tokens:
        b, s = lm.batch_shape(T, n, args.seq)
        x, y = lm.batch(b, s, shape["vocab"], seed=args.seed + 1)
        if local is not None and form == "torchrun":
            r, world = local
            per = b // world
            x, y = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
        row = {"form": form, "shape": shape, "n": n, "tokens": T, "b": b, "s": s, "tokens_per_gpu": T // n,
               "build_s": build_s, "prefetch_depth": stack.policy.prefetch_depth, "shard": shard,
               "flops": lm.model_flops(shape, b, s, counts), "params": counts}
        try:
            row.update(time_steps(stack, x, y, args.reps, args.warmup))
            row["bytes"] = schedule_bytes(stack)
            if getattr(args, "profile_dir", None) and (not args.profile_tokens or T in args.profile_tokens):
                row["profile"] = profile_step(stack, x, y, os.path.join(args.profile_dir, f"{form}_{n}gpu_{T}"))
        except Exception as e:  # noqa: BLE001 - an out-of-memory row is a result too
            row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        row["host_memory"] = host_memory()
        emit(row)
        build_s = 0.0
    del stack
    gc.collect()


class Writer:
    """The piece's JSON (``path``; nothing written without one), rewritten after every change, and one
    line per row and per :meth:`set` on stdout, with the seconds since the piece began (``elapsed_s``)."""

    def __init__(self, path: str | None, **head):
        self.path, self.data = path, dict(head, rows=[])
        self.t0 = time.perf_counter()
        self.save()

    def set(self, **kw) -> None:
        self.data.update(kw)
        print(json.dumps(dict(kw, elapsed_s=round(time.perf_counter() - self.t0, 1)), default=str)[:2000], flush=True)
        self.save()

    def row(self, row: dict) -> None:
        self.data["rows"].append(row)
        brief = {k: row.get(k) for k in ("form", "n", "tokens", "b", "s", "first_step_s", "step_s", "first_loss",
                                          "error")}
        print(json.dumps(dict(brief, elapsed_s=round(time.perf_counter() - self.t0, 1)), default=str), flush=True)
        self.save()

    def save(self) -> None:
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            os.replace(tmp, self.path)


def _compilation_cache(path: str | None) -> None:
    if path:
        import jax
        jax.config.update("jax_compilation_cache_dir", path)


def links(w: Writer, n: int | None):
    """NVLink (torch, before jax allocates), the host link on n GPUs and on one, the GEMM rate: into ``w``.
    ``n``: the devices (None: every one jax sees). Returns ``(jax devices, n)``."""
    import torch
    if torch.cuda.is_available():
        w.set(nvlink=nvlink_bandwidth(n or torch.cuda.device_count()))
    import jax
    devs = jax.devices()
    n = n or len(devs)
    w.set(device_kind=devs[0].device_kind, platform=devs[0].platform, jax=jax.__version__, n=n)
    gpu = devs[0].platform == "gpu"   # elsewhere (the CPU smoke runs) small enough to be quick
    gib = 4.0 if gpu else 1 / 64
    w.set(host_link={"n": host_link(devs[:n], gib), "1": host_link(devs[:1], gib)})
    w.set(gemm_flops=gemm_rate(devs[0], m=8192 if gpu else 256))
    return devs, n


def piece_ours(args) -> int:
    """The single-process piece (module docstring): links, then the 1-GPU and n-GPU rows of ``--shape``."""
    shape = lm.shape_of(args.shape, args.layers)
    w = Writer(args.piece_out, piece="ours", shape_name=args.shape, shape=shape)
    _compilation_cache(args.compilation_cache)
    devs, n = links(w, args.gpus)
    per_gpu = sorted(set(args.tokens))
    stack_rows(shape, devs[:1], per_gpu, args, w.row)
    if n > 1:
        stack_rows(shape, devs[:n], sorted(set(per_gpu) | {n * t for t in per_gpu}), args, w.row)
    w.set(wall_s=time.perf_counter() - w.t0)
    return 0


def _start_distributed(args) -> str:
    """Start jax's multi-controller engine in this torchrun rank: ``xla_swap.distributed.initialize()`` where
    it exists (form ``"torchrun"``: local batches), else ``jax.distributed.initialize`` from torchrun's
    ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` and ``--coordinator-port`` (default
    ``MASTER_PORT + 1``) (form
    ``"torchrun_global_batch"``). On the CPU, gloo collectives."""
    import jax
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        import xla_swap.distributed as xd
    except ImportError:
        xd = None
    if xd is not None:
        xd.initialize()
        return "torchrun"
    local = int(os.environ["LOCAL_RANK"])
    kw = {} if os.environ.get("JAX_PLATFORMS", "") == "cpu" else {"local_device_ids": [local]}
    port = args.coordinator_port or int(os.environ["MASTER_PORT"]) + 1   # torchrun's own store is on MASTER_PORT
    jax.distributed.initialize(coordinator_address=f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}",
                               num_processes=int(os.environ["WORLD_SIZE"]), process_id=int(os.environ["RANK"]),
                               **kw)
    return "torchrun_global_batch"


def piece_torchrun(args) -> int:
    """One torchrun rank (module docstring): rows at each per-rank token count, into ``--piece-out`` with
    ``{rank}`` replaced by this rank."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    import torch
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    args.fill_device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    shape = lm.shape_of(args.shape, args.layers)
    w = Writer(args.piece_out.replace("{rank}", str(rank)) if args.piece_out else None,
               piece="torchrun", shape_name=args.shape, shape=shape, rank=rank, world=world)
    if torch.cuda.is_available() and args.torchrun_pool_headroom:
        w.set(**pin_pool_at_start(shape, world, args.torchrun_pool_headroom))
    _compilation_cache(args.compilation_cache)
    form = _start_distributed(args)
    import jax
    w.set(form=form, devices=len(jax.devices()), local_devices=len(jax.local_devices()),
          device_kind=jax.devices()[0].device_kind)
    stack_rows(shape, jax.devices(), [world * t for t in sorted(set(args.tokens))], args, w.row, form=form,
               local=(rank, world))
    w.set(wall_s=time.perf_counter() - w.t0)
    jax.distributed.shutdown()
    return 0


def pin_pool_at_start(shape: dict, world: int, headroom: float) -> dict:
    """Size this rank's PJRT pinned pool to its share of ``shape``'s bf16 weights and AdamW moments times
    ``headroom`` and have PJRT pin it when jax starts (``host_pool.ensure_host_memory_limit(...,
    preallocate=True)``; called before jax's backend starts). Returns the fields the rank records:
    ``{"host_pool_gib", "host_pool_headroom", "host_pool_preallocated": True}``."""
    from xla_swap.executors.host_pool import ensure_host_memory_limit
    share = -(-lm.state_bytes(2 * lm.param_counts(shape)["total"]) // max(1, world))
    return dict(host_pool_gib=ensure_host_memory_limit(share, headroom=headroom, preallocate=True),
                host_pool_headroom=headroom, host_pool_preallocated=True)


def pools_do_not_fit(state: int, n: int, headroom: float, available: int | None, reserve: int) -> str | None:
    """Why the pinned pools of a ``state``-byte model over ``n`` devices would not fit the host, or None.

    Each device's pool pins ``ceil(state / n x headroom)`` GiB (``host_pool.ensure_host_memory_limit``);
    pinned pages cannot be swapped or reclaimed, so the ``n`` pools plus ``reserve`` bytes for the
    process and the system (page tables, the build's pageable copies, the driver) must fit ``available``
    (``MemAvailable``, bytes): a host whose pinned pages exhaust its memory can stop answering altogether,
    so the row is skipped with the figures instead. ``available`` None (not Linux): no check."""
    if not available:
        return None
    from xla_swap.executors.host_pool import pool_gib_needed
    pools = n * pool_gib_needed(-(-state // max(1, n)), headroom) * (1 << 30)
    if pools + reserve <= available:
        return None
    return (f"{n} pinned pools of {pools / n / 2**30:.1f} GiB ({state / 1e9:.1f} GB of weights and moments x "
            f"{headroom} / {n}) plus {reserve / 1e9:.0f} GB for the process need {(pools + reserve) / 1e9:.1f} GB, "
            f"{available / 1e9:.1f} GB available")


def piece_largest(args) -> int:
    """The largest-model row (module docstring) on every GPU at ``--largest-tokens``, skipped with the
    reason when the host cannot hold its weights and moments."""
    shape = lm.shape_of(args.shape, args.layers)
    counts = lm.param_counts(shape)
    weight = 2 * counts["total"]
    state = lm.state_bytes(weight)
    mem = host_memory()
    w = Writer(args.piece_out, piece="largest", shape_name=args.shape, shape=shape, params=counts,
               weight_bytes=weight, state_bytes=state, host_before=mem)
    import torch
    n_pool = args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 1)
    why = pools_do_not_fit(state, n_pool, args.largest_headroom, mem.get("MemAvailable"),
                           int(args.largest_host_reserve_gb * 1e9))
    if why:
        w.set(skipped=why)
        return 0
    from xla_swap.executors.host_pool import ensure_host_memory_limit
    per_device = -(-state // max(1, n_pool))   # the pool is per device: each device pins its 1/n of the state
    w.set(host_pool_gib=ensure_host_memory_limit(per_device, headroom=args.largest_headroom),
          host_pool_headroom=args.largest_headroom)
    _compilation_cache(args.compilation_cache)
    devs, n = links(w, args.gpus)
    stack_rows(shape, devs[:n], list(args.tokens), args, w.row, form="largest")
    w.set(host_after=host_memory(), wall_s=time.perf_counter() - w.t0)
    return 0


def run_piece(args) -> int:
    """Dispatch ``--piece`` (ours, torchrun, largest)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    return {"ours": piece_ours, "torchrun": piece_torchrun, "largest": piece_largest}[args.piece](args)
