#!/usr/bin/env python
"""Anchor measurements: the FFN stack, or a Hugging Face Llama, trained with the usual torch CPU-offload tools.

The default model is the stack of ``benchmarks/gpu_stack/`` written as a torch module (:class:`FFNWorkload`):
``L`` layers, each ``h + b(gelu(a(h), approximate="tanh"))`` with ``a = nn.Linear(D, F, bias=False)`` and
``b = nn.Linear(F, D, bias=False)``, weights N(0, 0.02^2) in the given dtype (bfloat16 by default), input
``(T, D)`` in the same dtype, loss ``mean(out.float() ** 2)``. ``--llama NAME`` (``--layers``, ``--seq``)
trains a ``transformers`` ``LlamaForCausalLM`` of ``llama_model.SHAPES[NAME]`` instead
(``llama_model.LlamaWorkload``: ``T`` tokens as ``T / seq`` sequences of ``seq``, cross-entropy on the
next tokens; ``--checkpointing``: transformers' non-reentrant gradient checkpointing).

Two anchors, each on ``--world-size N`` ranks (one process per GPU, ``cuda:LOCAL_RANK``; data parallel:
the global ``T`` tokens split ``T/N`` per rank, each rank its own input):

* :func:`fsdp2_anchor`: ``torch.distributed.fsdp.fully_shard`` on every block (FFN layer, decoder layer)
  and on the root with ``CPUOffloadPolicy(pin_memory=True)``: parameters and gradients live in pinned
  host memory, each block is copied to the device for its forward and again for its backward, and
  ``torch.optim.AdamW(foreach=True)`` steps on the host (on the bf16 parameters themselves: no fp32
  master copy, optimizer states in bf16). gloo ranks on CPU. ``--meta-init``: the model is built on the
  meta device, sharded, then materialised on the host (``to_empty(device="cpu")``, values drawn per
  shard): for models larger than one GPU.
* :func:`deepspeed_anchor`: DeepSpeed ZeRO stage 3 with ``offload_param`` and ``offload_optimizer`` on the
  CPU (pinned), bf16 enabled (so fp32 master weights and fp32 Adam states on the host), optimizer
  ``DeepSpeedCPUAdam`` (JIT-built with ninja at first use) or, when that cannot be built,
  ``torch.optim.AdamW`` on the host (``torch_adam``); the dict says which ran.

Each returns the medians over ``reps`` steps, after one warm-up step, in seconds: ``forward_s`` (a forward
under ``torch.no_grad()``), ``forward_backward_s``, ``optimizer_s`` (the optimizer step, with zeroing the
gradients) and ``step_s`` (forward + backward + optimizer, one host timer over the three);
``peak_device_bytes`` is ``torch.cuda.max_memory_allocated()`` over the timed steps (None on CPU). Every
timed region starts and ends with ``torch.cuda.synchronize()`` (on CUDA) around ``time.perf_counter()``.
With several ``--tokens`` the model is built once and each T measured in turn: the top-level keys are the
first T's, ``by_tokens`` holds every T's. The dict also holds the samples, ``setup_s`` and
``host_peak_rss_bytes``. With several ranks the ranks meet at a barrier (untimed) before each timed forward
and step; the times are the maxima over the ranks of each rank's median (``per_rank``), and only rank 0
prints. DeepSpeed may log to stdout: the JSON line of the CLI is the last line.

Both set ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1`` before
initialising ``torch.distributed`` (nccl on CUDA, gloo on CPU), and destroy the group they created.

    python benchmarks/anchors.py --anchor fsdp2 --shape 8192,32768,8 --tokens 8192 --reps 3
    python benchmarks/anchors.py --anchor fsdp2 --llama 8b --layers 4 --tokens 8192 32768 --world-size 2
    python benchmarks/anchors.py --anchor deepspeed --llama 8b --layers 4 --tokens 8192 --world-size 2

``--world-size N`` (N > 1) starts N copies of this command, one per rank, with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set (as ``torchrun`` does; a command started by
``torchrun`` with the same ``--world-size`` runs as that rank), waits for them (``--timeout-s``), stops the
others when one fails, and prints rank 0's line. Imports torch (DeepSpeed, transformers where used).
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
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
    "FFNWorkload",
    "fsdp2_anchor",
    "fsdp2_cpu_offload_step",
    "deepspeed_anchor",
    "deepspeed_zero_offload_step",
    "deepspeed_config",
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


class FFNWorkload:
    """The FFN stack as the anchors train it: what :func:`fsdp2_anchor` and :func:`deepspeed_anchor` need of a
    model (``llama_model.LlamaWorkload`` is the other one).

    ``build`` makes the model (:func:`make_ffn_stack`; ``meta=True``: on the meta device), ``blocks`` the
    modules sharded one by one, ``batch(tokens, device, seed)`` one rank's input (``(x,)``: ``(tokens, D)``
    normal values in ``dtype``), ``forward`` / ``loss`` the model on it (``mean(out.float()**2)``),
    ``materialize`` fills a model built on the meta device once its storage exists (FSDP2's ``to_empty``),
    ``bucket_elements`` one block's parameters (DeepSpeed's prefetch bucket), ``describe`` the JSON fields.
    """

    def __init__(self, D: int, F: int, L: int, dtype: torch.dtype = torch.bfloat16):
        self.D, self.F, self.L, self.dtype = D, F, L, dtype
        self.bucket_elements = 2 * D * F

    def describe(self) -> dict:
        return {"model": "ffn", "D": self.D, "F": self.F, "L": self.L}

    def build(self, device: torch.device, seed: int = 0, meta: bool = False) -> nn.Module:
        if meta:
            return nn.Sequential(*[FFNLayer(self.D, self.F, self.dtype, "meta") for _ in range(self.L)])
        return make_ffn_stack(self.D, self.F, self.L, self.dtype, device, seed)

    def blocks(self, model: nn.Module) -> list:
        return list(model)

    def materialize(self, model: nn.Module, device: torch.device, seed: int = 0) -> None:
        from llama_model import fill_normal   # this folder is on the path (as for LlamaWorkload)
        fill_normal(model, device, seed)

    def batch(self, tokens: int, device: torch.device, seed: int) -> tuple:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return (torch.randn(tokens, self.D, dtype=self.dtype, device=device, generator=gen),)

    def forward(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        return model(batch[0])

    def loss(self, model: nn.Module, batch: tuple) -> torch.Tensor:
        return _loss(model(batch[0]))


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


def _destroy_process_group(created: bool) -> bool:
    """Every rank meets at a barrier, then the group is destroyed (a rank that tears gloo down while another
    still sends can abort the process). True when the ranks met: every rank ended its measurement."""
    import torch.distributed as dist

    met = False
    if created and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
            met = True
        dist.destroy_process_group()
    return met


def _end(res: dict | None, created: bool) -> None:
    """The anchors' teardown: ``res["ranks_met_at_end"] = True`` when the ranks met at the last barrier."""
    if _destroy_process_group(created) and res is not None:
        res["ranks_met_at_end"] = True


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


def _tokens_list(tokens, world_size: int) -> list[int]:
    """``tokens`` (an int or a sequence of them) as a list, each a positive multiple of ``world_size``.
    Raises ValueError naming the first that is not."""
    ts = [int(tokens)] if isinstance(tokens, int) else [int(t) for t in tokens]
    if not ts:
        raise ValueError("tokens: at least one token count")
    for t in ts:
        if t < 1 or t % world_size:
            raise ValueError(f"T={t} tokens do not split evenly over {world_size} ranks")
    return ts


def _rank_device(device, rank: int, world_size: int) -> torch.device:
    """The device of this rank: ``device`` if given, else ``cuda:LOCAL_RANK`` (``cuda:0`` with one rank)
    when CUDA is there, else the CPU."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}")
    if device is not None:
        device = torch.device(device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) if world_size > 1 else 0)
    else:
        device = torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _per_tokens(workload, tokens: list[int], reps: int, device: torch.device, model, opt_step, *,
                rank: int, world_size: int, seed: int, barrier=None, clear=None, backward=None, **extra: Any) -> dict:
    """Each token count in turn on the built ``model`` (FSDP2's module or DeepSpeed's engine): this rank's
    ``T / world_size`` tokens (input seeded ``seed + 1 + rank``), :func:`_measure`, :func:`_result`, the
    maxima over the ranks. ``backward(loss)``: default ``loss.backward()`` (DeepSpeed: ``engine.backward``,
    which scales and reduces). Returns the first T's dict with ``by_tokens`` (every T's) when several."""
    by: dict[str, dict] = {}
    for T in tokens:
        t_local = T // world_size
        batch = workload.batch(t_local, device, seed + 1 + rank)

        def forward():
            with torch.no_grad():
                return workload.forward(model, batch)

        def forward_backward():
            loss = workload.loss(model, batch)
            if backward is not None:
                backward(loss)
            else:
                loss.backward()
            if clear is not None:
                clear()

        samples = _measure(device, reps, forward, forward_backward, opt_step, barrier)
        fields = {**workload.describe(), **extra, "T": T, "T_per_rank": t_local, "world_size": world_size,
                  "reps": reps, "cpu_threads": torch.get_num_threads()}
        res = _result(samples, device, **fields)
        if world_size > 1:
            _max_over_ranks(res)
        by[str(T)] = res
        del batch
    out = dict(by[str(tokens[0])])
    if len(tokens) > 1:
        out["by_tokens"] = by
    return out


#: the names :func:`_per_tokens` takes: an anchor's ``info`` passes its other fields through ``**extra``.
_PER_TOKENS_ARGS = frozenset(inspect.signature(_per_tokens).parameters) - {"extra"}


def _passthrough(info: dict) -> dict:
    """The fields of an anchor's ``info`` that :func:`_per_tokens` may take as ``**extra``: every one but
    the names it takes itself (``model``, ``rank``, ``world_size``, ``seed``, ...), which the caller passes."""
    return {k: v for k, v in info.items() if k not in _PER_TOKENS_ARGS}


def fsdp2_anchor(workload, tokens, reps: int = 3, *, optimizer: bool = True, device=None, seed: int = 0,
                 lr: float = 1e-4, rank: int = 0, world_size: int = 1, meta_init: bool = False) -> dict:
    """FSDP2 (``fully_shard``) with ``CPUOffloadPolicy`` on ``world_size`` ranks: medians of ``reps``.

    Every block of ``workload`` (:class:`FFNWorkload`, ``llama_model.LlamaWorkload``) and the root are
    wrapped with ``fully_shard(..., mesh=<world_size-device mesh>, offload_policy=CPUOffloadPolicy(
    pin_memory=...))`` (``pin_memory=True`` on CUDA; False on CPU, where there is nothing to pin for). The
    model is built on ``device`` (default: ``cuda:LOCAL_RANK`` if CUDA is available, else CPU; every rank
    draws the same weights from ``seed``) and moved to the host by ``fully_shard``, each rank keeping its
    shard; with ``meta_init`` it is built on the meta device, sharded, then materialised on the host
    (``to_empty(device="cpu")``) and filled by ``workload.materialize``. ``torch.optim.AdamW(lr,
    foreach=True)`` steps on the host shards. ``tokens``: a global token count or several (each a multiple
    of ``world_size``; each rank runs ``T / world_size`` tokens of its own input).

    Called once in every rank (the CLI's ``--world-size`` starts the ranks). Returns a dict: ``forward_s``,
    ``forward_backward_s``, ``optimizer_s`` (None when ``optimizer`` is False), ``step_s`` (seconds: this
    rank's median with one rank; with several, the maximum over the ranks of each rank's median,
    ``per_rank`` listing every rank's medians), ``peak_device_bytes`` (bytes, max over ranks, or None on
    CPU), ``samples``, ``setup_s``, ``host_peak_rss_bytes`` (this rank), ``world_size``, ``T_per_rank``,
    ``param_pinned``, the configuration and versions; ``by_tokens`` with several token counts. Initialises
    (and destroys) the process group (nccl on CUDA, gloo on CPU) unless one exists. Raises ValueError: a
    token count that does not split over the ranks, a rank outside the world.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    tokens = _tokens_list(tokens, world_size)
    device = _rank_device(device, rank, world_size)
    created = _init_process_group(device, rank, world_size)
    res = None
    try:
        t_setup = time.perf_counter()
        mesh = init_device_mesh(device.type, (world_size,))
        pin = device.type == "cuda"
        policy = CPUOffloadPolicy(pin_memory=pin)
        model = workload.build(device, seed, meta=meta_init)
        for block in workload.blocks(model):
            fully_shard(block, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        if meta_init:
            model.to_empty(device="cpu")
            workload.materialize(model, device, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True) if optimizer else None
        _release_cached(device)
        setup_s = time.perf_counter() - t_setup
        local = next(model.parameters()).to_local()

        def optimizer_step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        barrier = None
        if world_size > 1:
            import torch.distributed as dist
            barrier = dist.barrier
        res = _per_tokens(
            workload, tokens, reps, device, model, optimizer_step if opt else None, rank=rank,
            world_size=world_size, seed=seed, barrier=barrier,
            clear=None if opt else (lambda: model.zero_grad(set_to_none=True)), anchor="fsdp2",
            dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
            optimizer="torch.optim.AdamW(foreach=True)" if opt else None, pin_memory=pin,
            param_device=local.device.type, param_pinned=bool(local.is_pinned()) if pin else False,
            meta_init=meta_init, setup_s=setup_s)
        return res
    finally:
        _end(res, created)


def fsdp2_cpu_offload_step(D: int, F: int, L: int, T: int, reps: int = 3, *, optimizer: bool = True,
                           dtype: torch.dtype = torch.bfloat16, device=None, seed: int = 0, lr: float = 1e-4,
                           rank: int = 0, world_size: int = 1) -> dict:
    """:func:`fsdp2_anchor` on the FFN stack ``D, F, L`` in ``dtype`` at ``T`` global tokens (the keys of
    that function's dict, plus ``D``, ``F``, ``L``)."""
    return fsdp2_anchor(FFNWorkload(D, F, L, dtype), T, reps, optimizer=optimizer, device=device, seed=seed,
                        lr=lr, rank=rank, world_size=world_size)


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
                     lr: float = 1e-4, pin_memory: bool = True, bucket_elements: int | None = None) -> dict:
    """The DeepSpeed config of :func:`deepspeed_anchor` (a plain dict).

    ZeRO ``stage`` 3 offloads parameters and optimizer to the CPU (ZeRO-Infinity without
    NVMe); stage 2 offloads the optimizer only (ZeRO-Offload). The prefetch bucket holds one
    block (``bucket_elements``, default 2*D*F: one FFN layer), the persistence threshold is 0
    (every parameter offloaded).
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
        zero["stage3_prefetch_bucket_size"] = bucket_elements or 2 * D * F
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


def deepspeed_anchor(workload, tokens, reps: int = 3, *, stage: int = 3, optimizer: str = "auto", device=None,
                     seed: int = 0, lr: float = 1e-4, rank: int = 0, world_size: int = 1) -> dict:
    """DeepSpeed ZeRO ``stage`` (3: params + optimizer offloaded to the CPU; 2: optimizer only), bf16, on
    ``world_size`` ranks (this one ``rank``, ``cuda:LOCAL_RANK``): medians of ``reps`` steps after one
    warm-up step, per global token count of ``tokens`` (each rank ``T / world_size`` of its own input).

    ``optimizer``: ``"auto"`` builds DeepSpeedCPUAdam (ninja JIT; may take a minute) and falls back to
    ``torch.optim.AdamW`` on the host (``torch_adam: true``) if the build fails; ``"cpu_adam"`` or
    ``"torch_adam"`` force one. The dict's ``optimizer`` names the one that ran, ``cpu_adam_error`` says
    why CPU Adam was not used.

    Returns the keys of :func:`fsdp2_anchor` (seconds, bytes) plus ``config`` (the DeepSpeed config) and
    ``deepspeed`` (its version); or ``{"error": "...", ...}`` (never an exception) when DeepSpeed is not
    importable, CUDA is missing, or the run fails.
    """
    for k, v in _NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    info: dict[str, Any] = {"anchor": "deepspeed", "stage": stage, "world_size": world_size, **workload.describe()}
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001 - ImportError or a broken install
        return dict(info, error=f"deepspeed not importable: {type(e).__name__}: {e}")
    info["deepspeed"] = deepspeed.__version__
    created, res = False, None
    try:
        tokens = _tokens_list(tokens, world_size)
        device = _rank_device(device, rank, world_size)
        if device.type != "cuda":
            return dict(info, error="the deepspeed anchor needs a CUDA device")
        for k, v in (("RANK", str(rank)), ("LOCAL_RANK", str(device.index)), ("WORLD_SIZE", str(world_size))):
            os.environ.setdefault(k, v)  # deepspeed.comm reads them
        created = _init_process_group(device, rank, world_size)
        deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
        use_torch_adam = optimizer == "torch_adam"
        if optimizer == "auto":
            ok, msg = _cpu_adam_buildable()
            use_torch_adam = not ok
            if msg:
                info["cpu_adam_error"] = msg
        config = deepspeed_config(0, 0, stage=stage, torch_adam=use_torch_adam, lr=lr,
                                  bucket_elements=workload.bucket_elements)
        info["config"] = json.loads(json.dumps(config))  # a copy: deepspeed may edit its own
        t_setup = time.perf_counter()
        model = workload.build(device, seed)
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        info["optimizer"] = type(getattr(opt, "optimizer", opt)).__name__
        info["zero_optimizer"] = type(opt).__name__
        _release_cached(device)
        info["setup_s"] = time.perf_counter() - t_setup
        barrier = None
        if world_size > 1:
            import torch.distributed as dist
            barrier = dist.barrier
        # engine.step() also zeroes the gradients
        extra = _passthrough(info)
        res = _per_tokens(workload, tokens, reps, device, engine, engine.step, rank=rank, world_size=world_size,
                          seed=seed, barrier=barrier, backward=engine.backward, **extra)
        return res
    except Exception as e:  # noqa: BLE001 - report, never raise
        info["error"] = f"{type(e).__name__}: {e}"[-4000:]
        info["traceback"] = traceback.format_exc()[-8000:]
        return info
    finally:
        with contextlib.suppress(Exception):
            _end(res, created)


def deepspeed_zero_offload_step(D: int, F: int, L: int, T: int, reps: int = 3, *, stage: int = 3,
                                optimizer: str = "auto", device=None, seed: int = 0, lr: float = 1e-4) -> dict:
    """:func:`deepspeed_anchor` on the FFN stack ``D, F, L`` (bf16) at ``T`` tokens, world size 1."""
    return deepspeed_anchor(FFNWorkload(D, F, L), T, reps, stage=stage, optimizer=optimizer, device=device,
                            seed=seed, lr=lr)


# ---------------------------------------------------------------------------------------
# CLI


def _shape(s: str) -> tuple[int, int, int]:
    parts = [int(p) for p in s.split(",")]
    if len(parts) != 3 or min(parts) <= 0:
        raise argparse.ArgumentTypeError(f"--shape wants D,F,L (positive ints), got {s!r}")
    return parts[0], parts[1], parts[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The CLI: ``--anchor fsdp2|deepspeed --shape D,F,L | --llama NAME --tokens T [T ...] --reps N`` (+ options)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", choices=["fsdp2", "deepspeed"], required=True)
    p.add_argument("--shape", type=_shape, default=(8192, 32768, 8), help="D,F,L of the FFN stack")
    p.add_argument("--llama", default=None, help="a llama_model.SHAPES name (8b, 34b, tiny): an HF Llama "
                   "instead of the FFN stack")
    p.add_argument("--layers", type=int, default=None, help="with --llama: decoder layers (default: the shape's)")
    p.add_argument("--seq", type=int, default=4096, help="with --llama: tokens per sequence")
    p.add_argument("--checkpointing", action="store_true", help="with --llama: transformers' gradient "
                   "checkpointing (non-reentrant)")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192],
                   help="T (global: split over the ranks); several: measured in turn on one model")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None,
                   help="default: cuda:LOCAL_RANK (cuda:0 with one rank) if available, else cpu")
    p.add_argument("--no-optimizer", action="store_true",
                   help="fsdp2 only: forward and backward, no optimizer step")
    p.add_argument("--meta-init", action="store_true", help="fsdp2 only: build on the meta device, shard, "
                   "materialise on the host (models larger than one GPU)")
    p.add_argument("--world-size", type=int, default=1,
                   help="ranks (processes, one GPU each), started by this command")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="with --world-size > 1: stop the ranks after this many seconds")
    p.add_argument("--stage", type=int, choices=[2, 3], default=3, help="deepspeed only")
    p.add_argument("--ds-optimizer", choices=["auto", "cpu_adam", "torch_adam"],
                   default="auto", help="deepspeed only")
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error(f"--world-size must be >= 1, got {args.world_size}")
    return args


def workload_of(args: argparse.Namespace):
    """The model the CLI's arguments name: :class:`FFNWorkload` of ``--shape``, or with ``--llama`` a
    ``llama_model.LlamaWorkload`` (``--layers``, ``--seq``, ``--checkpointing``)."""
    if args.llama is None:
        return FFNWorkload(*args.shape)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from llama_model import LlamaWorkload, shape_of

    return LlamaWorkload(shape_of(args.llama, args.layers), seq=args.seq, checkpointing=args.checkpointing)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_rank_process(world_size: int) -> bool:
    """True in a process started as one rank (``RANK`` set, ``WORLD_SIZE`` equal to ``world_size``)."""
    return world_size > 1 and "RANK" in os.environ and os.environ.get("WORLD_SIZE") == str(world_size)


def launch_ranks(argv: list[str], world_size: int, timeout_s: float | None = None, anchor: str = "fsdp2") -> dict:
    """Run this script as ``world_size`` rank processes with ``argv`` and return rank 0's JSON dict.

    Each rank gets ``RANK``, ``LOCAL_RANK`` (= rank), ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
    ``MASTER_PORT`` (one free port), the no-multicast variables and, unless set, ``OMP_NUM_THREADS``
    = its share of the cores (without it every rank's host optimizer takes all the cores at once). Their stdout and stderr go
    to temporary files; rank 0's stdout is echoed to this process' stdout minus its JSON line
    (the caller prints it), every rank's stderr tail to stderr. When a rank exits with an error
    the others get 10 s, then are killed; after ``timeout_s`` seconds (None: no limit) all are.
    ``PYTHONFAULTHANDLER=1`` makes a rank that dies of a signal print its Python stack. The result is
    :func:`rank_verdict`'s.
    """
    import subprocess
    import tempfile

    port = str(_free_port())
    threads = max(1, (os.cpu_count() or 1) // world_size)   # each rank its share of the cores (host AdamW)
    procs, files = [], []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="anchors_ranks_") as tmp:
        for r in range(world_size):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONFAULTHANDLER="1", **_NO_MULTICAST_ENV)
            env.setdefault("OMP_NUM_THREADS", str(threads))
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
    for ln in texts[0][0].splitlines():
        if not ln.startswith("{"):
            print(ln)
    return rank_verdict(texts, [p.returncode for p in procs], reason, anchor=anchor, world_size=world_size)


def _last_json(text: str) -> dict | None:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def rank_verdict(texts: list[tuple[str, str]], codes: list[int | None], reason: str | None, *,
                 anchor: str = "fsdp2", world_size: int | None = None) -> dict:
    """Rank 0's result from every rank's ``(stdout, stderr)`` and return code (``reason``: why the
    launcher stopped them, or None).

    Every rank prints its own JSON line after its last barrier and the process group's teardown. The
    measurement is whole when every rank printed one without ``error``, or when rank 0's has
    ``ranks_met_at_end`` (every rank reached the last barrier, after its timed steps). Then return codes
    other than 0 and a ``reason`` came after it (a rank dying in the teardown or the interpreter's exit,
    say) and are reported under ``after_result`` (codes, reason, the failing ranks' stderr tails), not as
    an error. Otherwise the result gets ``error``, with the return codes and the failing ranks' stderr
    tails.
    """
    world_size = len(texts) if world_size is None else world_size
    results = [_last_json(out) for out, _ in texts]
    failing = {r: texts[r][1][-1500:] for r, c in enumerate(codes) if c not in (0, None) or results[r] is None}
    res = results[0] if results[0] is not None else {"anchor": anchor, "world_size": world_size}
    if "error" in res:
        return res
    whole = res.get("ranks_met_at_end") is True or all(x is not None and "error" not in x for x in results)
    if whole and (reason or any(codes)):
        res["after_result"] = {"return_codes": codes, "reason": reason, "stderr_tail": failing}
    elif not whole:
        first = reason or ("rank 0 printed no result" if results[0] is None else "a rank failed")
        res["error"] = f"{first} (return codes {codes})"
        res["stderr_tail"] = failing
    return res


def _run_rank(args: argparse.Namespace, rank: int) -> dict:
    """This process's anchor as ``rank`` of ``--world-size``: its dict, or one with ``error`` and
    ``traceback`` (printed to stderr with several ranks) when it raised."""
    ws = args.world_size
    try:
        workload = workload_of(args)
        if args.anchor == "fsdp2":
            return fsdp2_anchor(workload, args.tokens, args.reps, optimizer=not args.no_optimizer,
                                device=args.device, seed=args.seed, rank=rank, world_size=ws,
                                meta_init=args.meta_init)
        return deepspeed_anchor(workload, args.tokens, args.reps, stage=args.stage, optimizer=args.ds_optimizer,
                                device=args.device, seed=args.seed, rank=rank, world_size=ws)
    except Exception as e:  # noqa: BLE001 - one JSON line either way
        res = {"anchor": args.anchor, "world_size": ws, "rank": rank, "error": f"{type(e).__name__}: {e}"[-4000:],
               "traceback": traceback.format_exc()[-8000:]}
        if ws > 1:
            sys.stderr.write(res["traceback"])
        return res


def main(argv: list[str] | None = None) -> dict:
    """Run one anchor and print its dict as one JSON line on stdout; return the dict.

    With ``--world-size N > 1`` this starts the N ranks (:func:`launch_ranks`) unless it is one of
    them; every rank prints its own line (the launcher returns rank 0's). A token count that does not
    split over the ranks is refused before any rank starts.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    ws = args.world_size
    rank = 0
    bad = [t for t in args.tokens if t < 1 or t % ws]
    if bad:
        res = {"anchor": args.anchor, "world_size": ws,
               "error": f"--tokens {bad[0]} does not split evenly over {ws} ranks"}
    elif ws > 1 and not _is_rank_process(ws):
        res = launch_ranks(argv, ws, args.timeout_s, anchor=args.anchor)
    else:
        rank = int(os.environ["RANK"]) if ws > 1 else 0
        res = _run_rank(args, rank)
    sys.stdout.flush()
    print(json.dumps(res, default=str), flush=True)  # a rank's own stdout: launch_ranks reads them all
    return res


if __name__ == "__main__":
    sys.exit(1 if "error" in main() else 0)
