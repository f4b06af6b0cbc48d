#!/usr/bin/env python
"""Anchor measurements: the FFN stack trained with the usual torch CPU-offload tools.

The stack is the one of ``benchmarks/gpu_stack/`` written as a torch module: ``L`` layers,
each ``h + b(gelu(a(h), approximate="tanh"))`` with ``a = nn.Linear(D, F, bias=False)`` and
``b = nn.Linear(F, D, bias=False)``, weights drawn from N(0, 0.02^2) in the given dtype
(bfloat16 by default). The input is ``(T, D)`` in the same dtype, the loss
``mean(out.float() ** 2)``.

Two anchors:

* :func:`fsdp2_cpu_offload_step`: ``torch.distributed.fsdp.fully_shard`` on every layer and on
  the root with ``CPUOffloadPolicy(pin_memory=True)``: parameters and gradients live in pinned
  host memory, each layer is copied to the device for its forward and again for its backward,
  and ``torch.optim.AdamW(foreach=True)`` steps on the host (on the bf16 parameters
  themselves: no fp32 master copy, optimizer states in bf16). World size 1 by default; with
  ``--world-size N`` the CLI starts N processes (one per GPU, ``cuda:LOCAL_RANK``; gloo
  processes on CPU), each weight is sharded over the N ranks and the global ``T`` tokens are
  split ``T/N`` per rank (data parallel, as torch FSDP trains).
* :func:`deepspeed_zero_offload_step` (one process, world size 1): DeepSpeed ZeRO stage 3 with ``offload_param`` and
  ``offload_optimizer`` on the CPU (pinned), bf16 enabled (so fp32 master weights and fp32
  Adam states on the host), optimizer ``DeepSpeedCPUAdam`` (JIT-built with ninja at first
  use) or, when that cannot be built, ``torch.optim.AdamW`` on the host (``torch_adam``);
  the dict says which ran.

Each returns the medians over ``reps`` steps, after one warm-up step, in seconds:
``forward_s`` (a forward under ``torch.no_grad()``), ``forward_backward_s``, ``optimizer_s``
(the optimizer step, with zeroing the gradients) and ``step_s`` (forward + backward +
optimizer, one host timer over the three); ``peak_device_bytes`` is
``torch.cuda.max_memory_allocated()`` over the timed steps (None on CPU). Every timed region
starts and ends with ``torch.cuda.synchronize()`` (on CUDA) around ``time.perf_counter()``.
The dict also holds the samples of every rep, ``setup_s`` (building and sharding the model)
and ``host_peak_rss_bytes`` (the process' peak resident set, bytes; the weights are drawn on
the device and then moved to the host by the offloading tool). DeepSpeed may log to stdout:
the JSON line of the CLI is the last line.

With several ranks every rank times its own steps (the ranks meet at a barrier, untimed, before
each timed forward and each timed step); the reported ``forward_s`` /
``forward_backward_s`` / ``optimizer_s`` / ``step_s`` are the maxima over the ranks of each
rank's median (``per_rank`` holds every rank's medians), ``peak_device_bytes`` the maximum
over ranks, and only rank 0 prints the JSON line (with ``world_size`` and ``T_per_rank``).

Both set ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` (``os.environ.setdefault``) before initialising
``torch.distributed`` (nccl on CUDA, gloo on CPU; ``MASTER_ADDR``/``MASTER_PORT`` set when
absent), and destroy the process group they created at the end.

Run one anchor per command, one JSON line on stdout::

    python benchmarks/anchors.py --anchor fsdp2 --shape 8192,32768,8 --tokens 8192 --reps 3
    python benchmarks/anchors.py --anchor fsdp2 --shape 8192,32768,8 --tokens 8192 --world-size 2
    python benchmarks/anchors.py --anchor deepspeed --shape 4096,14336,16 --tokens 8192

``--world-size N`` (N > 1) starts N copies of this command, one per rank, with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (as ``torchrun`` does;
a command started by ``torchrun`` with the same ``--world-size`` runs as that rank directly),
waits for them (``--timeout-s``), stops the others when one fails, and prints rank 0's line.

This module imports torch only (DeepSpeed inside :func:`deepspeed_zero_offload_step`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FFNLayer",
    "make_ffn_stack",
    "fsdp2_cpu_offload_step",
    "deepspeed_zero_offload_step",
    "parse_args",
    "launch_ranks",
    "main",
]

_NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class FFNLayer(nn.Module):
    """One layer of the stack: ``h + b(gelu(a(h), approximate="tanh"))``, no biases."""

    def __init__(self, D: int, F_: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.a = nn.Linear(D, F_, bias=False, dtype=dtype, device=device)
        self.b = nn.Linear(F_, D, bias=False, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(F.gelu(self.a(h), approximate="tanh"))


def make_ffn_stack(
    D: int,
    F: int,
    L: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> nn.Sequential:
    """``nn.Sequential`` of ``L`` :class:`FFNLayer` (``D -> F -> D``), weights N(0, 0.02^2).

    The weights are drawn on ``device`` in ``dtype`` from a generator seeded with ``seed``
    (the same seed and device give the same weights). 2*D*F*L parameters.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    layers = []
    with torch.no_grad():
        for _ in range(L):
            layer = FFNLayer(D, F, dtype, device)
            for p in layer.parameters():
                p.normal_(0.0, 0.02, generator=gen)
            layers.append(layer)
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------
# helpers


def _default_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _set_dist_env() -> None:
    """The no-multicast variables and MASTER_ADDR/MASTER_PORT (a free port), where not set."""
    for k, v in _NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def _init_process_group(device: torch.device, rank: int = 0, world_size: int = 1) -> bool:
    """Initialise a process group of ``world_size`` ranks (this one ``rank``); True when this call
    created it. nccl on CUDA (``device`` made current), gloo on CPU; MASTER_ADDR/PORT from the
    environment (set by the launcher for several ranks; a free local port for one)."""
    import torch.distributed as dist

    _set_dist_env()
    if dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return True


def _destroy_process_group(created: bool) -> None:
    import torch.distributed as dist

    if created and dist.is_initialized():
        dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release_cached(device: torch.device) -> None:
    """After set-up: give back the device copies of the weights the offloading freed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _timed(device: torch.device, fn: Callable[[], Any]) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _host_peak_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _result(samples: dict[str, list[float]], device: torch.device, **extra: Any) -> dict:
    res: dict[str, Any] = {}
    for k, v in samples.items():
        res[k] = statistics.median(v) if v else None
    if device.type == "cuda":
        res["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(device))
        res["peak_device_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
        res["device_name"] = torch.cuda.get_device_name(device)
    else:
        res["peak_device_bytes"] = None
        res["device_name"] = "cpu"
    res["host_peak_rss_bytes"] = _host_peak_rss_bytes()
    res["samples"] = samples
    res["torch"] = torch.__version__
    res.update(extra)
    return res


def _measure(
    device: torch.device,
    reps: int,
    forward: Callable[[], Any],
    forward_backward: Callable[[], Any],
    optimizer_step: Callable[[], Any] | None,
    barrier: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """One untimed warm-up (forward, then a whole step), then ``reps`` timed reps.

    ``barrier`` (several ranks: ``torch.distributed.barrier``) runs, untimed, before the forward
    and before the step of each rep, so every rank starts each timed region together: a rank's
    time then does not absorb another rank's lag from the previous region.
    """
    barrier = barrier or (lambda: None)
    forward()
    forward_backward()
    if optimizer_step is not None:
        optimizer_step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    samples: dict[str, list[float]] = {
        "forward_s": [],
        "forward_backward_s": [],
        "optimizer_s": [],
        "step_s": [],
    }
    for _ in range(reps):
        _sync(device)
        barrier()
        samples["forward_s"].append(_timed(device, forward))
        _sync(device)
        barrier()
        _sync(device)
        t0 = time.perf_counter()
        forward_backward()
        _sync(device)
        t1 = time.perf_counter()
        if optimizer_step is not None:
            optimizer_step()
            _sync(device)
        t2 = time.perf_counter()
        samples["forward_backward_s"].append(t1 - t0)
        if optimizer_step is not None:
            samples["optimizer_s"].append(t2 - t1)
        samples["step_s"].append(t2 - t0)
    return samples


# ---------------------------------------------------------------------------------------
# FSDP2


def fsdp2_cpu_offload_step(
    D: int,
    F: int,
    L: int,
    T: int,
    reps: int = 3,
    *,
    optimizer: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    seed: int = 0,
    lr: float = 1e-4,
    rank: int = 0,
    world_size: int = 1,
) -> dict:
    """FSDP2 (``fully_shard``) with ``CPUOffloadPolicy`` on ``world_size`` ranks: medians of ``reps``.

    Every layer and the root are wrapped with
    ``fully_shard(..., mesh=<world_size-device mesh>, offload_policy=CPUOffloadPolicy(pin_memory=...))``
    (``pin_memory=True`` on CUDA; False on CPU, where there is nothing to pin for). The model
    is built on ``device`` (default: ``cuda:rank`` if CUDA is available, else CPU; every rank
    draws the same weights from ``seed``) and moved to the host by ``fully_shard``, each rank
    keeping its shard. ``torch.optim.AdamW(lr, foreach=True)`` steps on the host shards.
    Data parallel: ``T`` is the global token count, each rank runs ``T / world_size`` tokens
    (its own input, seeded ``seed + 1 + rank``); ``T`` must be a multiple of ``world_size``.

    Called once in every rank (the CLI's ``--world-size`` starts the ranks). Returns a dict:
    ``forward_s``, ``forward_backward_s``, ``optimizer_s`` (None when ``optimizer`` is False),
    ``step_s`` (seconds: this rank's median with one rank; with several, the maximum over the
    ranks of each rank's median, ``per_rank`` listing every rank's medians),
    ``peak_device_bytes`` (bytes, max over ranks, or None on CPU), ``samples`` (this rank's
    reps, seconds), ``setup_s``, ``host_peak_rss_bytes`` (this rank), ``world_size``,
    ``T_per_rank``, the configuration and versions. Initialises (and destroys) the process
    group (nccl on CUDA, gloo on CPU) unless one exists.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}")
    if T % world_size:
        raise ValueError(f"T={T} tokens do not split evenly over {world_size} ranks")
    if device is not None:
        device = torch.device(device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) if world_size > 1 else 0)
    else:
        device = torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    created = _init_process_group(device, rank, world_size)
    try:
        t_setup = time.perf_counter()
        mesh = init_device_mesh(device.type, (world_size,))
        pin = device.type == "cuda"
        policy = CPUOffloadPolicy(pin_memory=pin)
        model = make_ffn_stack(D, F, L, dtype, device, seed)
        for layer in model:
            fully_shard(layer, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True) if optimizer else None
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + 1 + rank)
        t_local = T // world_size
        x = torch.randn(t_local, D, dtype=dtype, device=device, generator=gen)
        _release_cached(device)
        setup_s = time.perf_counter() - t_setup
        param_device = next(model.parameters()).to_local().device.type

        def forward():
            with torch.no_grad():
                return model(x)

        def forward_backward():
            _loss(model(x)).backward()

        def optimizer_step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        if opt is None:
            def clear_grads():
                model.zero_grad(set_to_none=True)
            fb = lambda: (forward_backward(), clear_grads())  # noqa: E731
        else:
            fb = forward_backward
        barrier = None
        if world_size > 1:
            import torch.distributed as dist
            barrier = dist.barrier
        samples = _measure(device, reps, forward, fb, optimizer_step if opt else None, barrier)
        res = _result(
            samples,
            device,
            anchor="fsdp2",
            D=D, F=F, L=L, T=T, reps=reps,
            dtype=str(dtype).replace("torch.", ""),
            optimizer="torch.optim.AdamW(foreach=True)" if opt else None,
            pin_memory=pin,
            param_device=param_device,
            setup_s=setup_s,
            world_size=world_size,
            T_per_rank=t_local,
        )
        if world_size > 1:
            _max_over_ranks(res)
        return res
    finally:
        _destroy_process_group(created)


_RANK_KEYS = ("forward_s", "forward_backward_s", "optimizer_s", "step_s")


def _max_over_ranks(res: dict) -> None:
    """Gather every rank's medians (a collective: every rank calls it) into ``res["per_rank"]``;
    the step times become the maxima over ranks of the ranks' medians (seconds), the peak the
    largest rank's (bytes)."""
    import torch.distributed as dist

    mine = {k: res[k] for k in _RANK_KEYS + ("peak_device_bytes",)}
    mine["rank"] = dist.get_rank()
    mine["device"] = res.get("device_name")
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    res["per_rank"] = every
    for k in _RANK_KEYS + ("peak_device_bytes",):
        vals = [r[k] for r in every if r[k] is not None]
        res[k] = max(vals) if vals else None


# ---------------------------------------------------------------------------------------
# DeepSpeed


def deepspeed_config(D: int, F: int, *, stage: int = 3, torch_adam: bool = False,
                     lr: float = 1e-4, pin_memory: bool = True) -> dict:
    """The DeepSpeed config of :func:`deepspeed_zero_offload_step` (a plain dict).

    ZeRO ``stage`` 3 offloads parameters and optimizer to the CPU (ZeRO-Infinity without
    NVMe); stage 2 offloads the optimizer only (ZeRO-Offload). The prefetch bucket holds one
    layer (2*D*F elements), the persistence threshold is 0 (every parameter offloaded).
    """
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": pin_memory},
        "contiguous_gradients": True,
        "overlap_comm": True,
    }
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_prefetch_bucket_size"] = 2 * D * F
    opt_params: dict[str, Any] = {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                  "weight_decay": 0.01}
    if torch_adam:
        opt_params["torch_adam"] = True
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": opt_params},
        "zero_allow_untested_optimizer": True,
    }


def _cpu_adam_buildable() -> tuple[bool, str]:
    """Try to JIT-build (or load) DeepSpeed's CPU Adam extension; (ok, message)."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
        return True, ""
    except Exception as e:  # noqa: BLE001 - any build failure means the fallback
        return False, f"{type(e).__name__}: {e}"[-2000:]


def deepspeed_zero_offload_step(
    D: int,
    F: int,
    L: int,
    T: int,
    reps: int = 3,
    *,
    stage: int = 3,
    optimizer: str = "auto",
    device: torch.device | str | None = None,
    seed: int = 0,
    lr: float = 1e-4,
) -> dict:
    """DeepSpeed ZeRO ``stage`` (3: params + optimizer offloaded to the CPU; 2: optimizer
    only), bf16, world size 1: medians of ``reps`` steps, after one warm-up step.

    ``optimizer``: ``"auto"`` builds DeepSpeedCPUAdam (ninja JIT; may take a minute) and falls
    back to ``torch.optim.AdamW`` on the host (``torch_adam: true``) if the build fails;
    ``"cpu_adam"`` or ``"torch_adam"`` force one. The dict's ``optimizer`` names the one that
    ran, ``cpu_adam_error`` says why CPU Adam was not used.

    Returns the keys of :func:`fsdp2_cpu_offload_step` (seconds, bytes) plus ``config`` (the
    DeepSpeed config) and ``deepspeed`` (its version); or ``{"error": "...", ...}`` (never an
    exception) when DeepSpeed is not importable, CUDA is missing, or the run fails.
    """
    for k, v in _NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001 - ImportError or a broken install
        return {"anchor": "deepspeed", "error": f"deepspeed not importable: "
                f"{type(e).__name__}: {e}"}
    device = torch.device(device) if device is not None else _default_device()
    if device.type != "cuda":
        return {"anchor": "deepspeed", "error": "the deepspeed anchor needs a CUDA device",
                "deepspeed": deepspeed.__version__}
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    created = False
    info: dict[str, Any] = {"anchor": "deepspeed", "deepspeed": deepspeed.__version__,
                            "D": D, "F": F, "L": L, "T": T, "reps": reps, "stage": stage}
    try:
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(k, v)  # deepspeed.comm reads them
        created = _init_process_group(device)
        deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
        use_torch_adam = optimizer == "torch_adam"
        if optimizer == "auto":
            ok, msg = _cpu_adam_buildable()
            use_torch_adam = not ok
            if msg:
                info["cpu_adam_error"] = msg
        config = deepspeed_config(D, F, stage=stage, torch_adam=use_torch_adam, lr=lr)
        info["config"] = json.loads(json.dumps(config))  # a copy: deepspeed may edit its own
        t_setup = time.perf_counter()
        model = make_ffn_stack(D, F, L, torch.bfloat16, device, seed)
        engine, opt, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config)
        info["optimizer"] = type(getattr(opt, "optimizer", opt)).__name__
        info["zero_optimizer"] = type(opt).__name__
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + 1)
        x = torch.randn(T, D, dtype=torch.bfloat16, device=device, generator=gen)
        _release_cached(device)
        info["setup_s"] = time.perf_counter() - t_setup

        def forward():
            with torch.no_grad():
                return engine(x)

        def forward_backward():
            engine.backward(_loss(engine(x)))

        def optimizer_step():
            engine.step()  # also zeroes the gradients

        samples = _measure(device, reps, forward, forward_backward, optimizer_step)
        return _result(samples, device, **info)
    except Exception as e:  # noqa: BLE001 - report, never raise
        info["error"] = f"{type(e).__name__}: {e}"[-4000:]
        info["traceback"] = traceback.format_exc()[-8000:]
        return info
    finally:
        with contextlib.suppress(Exception):
            _destroy_process_group(created)


# ---------------------------------------------------------------------------------------
# CLI


def _shape(s: str) -> tuple[int, int, int]:
    parts = [int(p) for p in s.split(",")]
    if len(parts) != 3 or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"--shape wants D,F,L (positive ints), got {s!r}")
    return parts[0], parts[1], parts[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The CLI: ``--anchor fsdp2|deepspeed --shape D,F,L --tokens T --reps N`` (+ options)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", choices=["fsdp2", "deepspeed"], required=True)
    p.add_argument("--shape", type=_shape, default=(8192, 32768, 8), help="D,F,L")
    p.add_argument("--tokens", type=int, default=8192, help="T (global: split over the ranks)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None,
                   help="default: cuda:LOCAL_RANK (cuda:0 with one rank) if available, else cpu")
    p.add_argument("--no-optimizer", action="store_true",
                   help="fsdp2 only: forward and backward, no optimizer step")
    p.add_argument("--world-size", type=int, default=1,
                   help="fsdp2 only: ranks (processes, one GPU each), started by this command")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="with --world-size > 1: stop the ranks after this many seconds")
    p.add_argument("--stage", type=int, choices=[2, 3], default=3, help="deepspeed only")
    p.add_argument("--ds-optimizer", choices=["auto", "cpu_adam", "torch_adam"],
                   default="auto", help="deepspeed only")
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error(f"--world-size must be >= 1, got {args.world_size}")
    return args


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_rank_process(world_size: int) -> bool:
    """True in a process started as one rank (``RANK`` set, ``WORLD_SIZE`` equal to ``world_size``)."""
    return world_size > 1 and "RANK" in os.environ and os.environ.get("WORLD_SIZE") == str(world_size)


def launch_ranks(argv: list[str], world_size: int, timeout_s: float | None = None) -> dict:
    """Run this script as ``world_size`` rank processes with ``argv`` and return rank 0's JSON dict.

    Each rank gets ``RANK``, ``LOCAL_RANK`` (= rank), ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
    ``MASTER_PORT`` (one free port) and the no-multicast variables. Their stdout and stderr go
    to temporary files; rank 0's stdout is echoed to this process' stdout minus its JSON line
    (the caller prints it), every rank's stderr tail to stderr. When a rank exits with an error
    the others get 10 s, then are killed; after ``timeout_s`` seconds (None: no limit) all are.
    Returns ``{"error": ...}`` when rank 0 printed no JSON line.
    """
    import subprocess
    import tempfile

    port = str(_free_port())
    procs, files = [], []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="anchors_ranks_") as tmp:
        for r in range(world_size):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **_NO_MULTICAST_ENV)
            out = open(os.path.join(tmp, f"rank{r}.out"), "w+")
            err = open(os.path.join(tmp, f"rank{r}.err"), "w+")
            files.append((out, err))
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv],
                                          stdout=out, stderr=err, env=env))
        reason = None
        failed_at = None
        while any(p.poll() is None for p in procs):
            now = time.perf_counter()
            if timeout_s is not None and now - t0 > timeout_s:
                reason = f"timed out after {timeout_s} s"
                break
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > 10:
                reason = "a rank failed; the others were stopped"
                break
            time.sleep(0.1)
        for p in procs:  # only the processes started here, one by one
            if p.poll() is None:
                p.kill()
                p.wait()
        texts = []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
            out.close()
            err.close()
    for r, (_, err) in enumerate(texts):
        if err.strip():
            sys.stderr.write(f"--- rank {r} stderr (tail) ---\n{err[-3000:]}\n")
    lines = texts[0][0].splitlines()
    json_lines = [ln for ln in lines if ln.startswith("{")]
    for ln in lines:
        if not ln.startswith("{"):
            print(ln)
    codes = [p.returncode for p in procs]
    if json_lines:
        res = json.loads(json_lines[-1])
    else:
        res = {"anchor": "fsdp2", "world_size": world_size,
               "error": f"{reason or 'rank 0 printed no result'} (return codes {codes}): {texts[0][1][-2000:]}"}
    if "error" not in res and (reason or any(codes)):
        res["error"] = f"{reason or 'a rank failed'} (return codes {codes})"
    return res


def main(argv: list[str] | None = None) -> dict:
    """Run one anchor and print its dict as one JSON line on stdout; return the dict.

    With ``--world-size N > 1`` (fsdp2 only) this starts the N ranks (:func:`launch_ranks`)
    unless it is one of them; a rank prints its line only as rank 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    D, F_, L = args.shape
    ws = args.world_size
    rank = 0
    if ws > 1 and args.anchor != "fsdp2":
        res = {"anchor": args.anchor, "error": "--world-size > 1 is implemented for fsdp2 only"}
    elif ws > 1 and args.tokens % ws:
        res = {"anchor": args.anchor, "world_size": ws,
               "error": f"--tokens {args.tokens} does not split evenly over {ws} ranks"}
    elif ws > 1 and not _is_rank_process(ws):
        res = launch_ranks(argv, ws, args.timeout_s)
    elif args.anchor == "fsdp2":
        rank = int(os.environ["RANK"]) if ws > 1 else 0
        try:
            res = fsdp2_cpu_offload_step(D, F_, L, args.tokens, args.reps,
                                         optimizer=not args.no_optimizer,
                                         device=args.device, seed=args.seed,
                                         rank=rank, world_size=ws)
        except Exception as e:  # noqa: BLE001 - one JSON line either way
            res = {"anchor": "fsdp2", "world_size": ws, "rank": rank,
                   "error": f"{type(e).__name__}: {e}"[-4000:],
                   "traceback": traceback.format_exc()[-8000:]}
            if ws > 1:
                sys.stderr.write(res["traceback"])
    else:
        res = deepspeed_zero_offload_step(D, F_, L, args.tokens, args.reps, stage=args.stage,
                                          optimizer=args.ds_optimizer, device=args.device,
                                          seed=args.seed)
    sys.stdout.flush()
    if rank == 0:
        print(json.dumps(res, default=str), flush=True)
    return res


if __name__ == "__main__":
    sys.exit(1 if "error" in main() else 0)
