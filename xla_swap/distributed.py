"""Several processes as ``torchrun`` starts them, one per GPU, each with its own batch.

    # torchrun --nproc-per-node N train.py   (several hosts: --nnodes M --node-rank k --master-addr HOST)
    import xla_swap.distributed
    xla_swap.distributed.initialize()            # first: before anything uses jax's devices
    stack = xla_swap.SwappedStack(layers, ...)   # one mesh over every process's devices
    loss = stack.train_step(my_ids, my_labels)   # this rank's own batch, as under DDP / FSDP2

:func:`initialize` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and starts jax's multi-controller engine
(``jax.distributed.initialize``, its coordinator on ``MASTER_ADDR`` at another port than torch's
store) with one GPU per process, and a gloo ``torch.distributed`` process group unless one exists.
From then on the process runs in **per-rank batch** mode (:func:`per_rank_batches`):

* ``forward``, ``train_step``, ``generate`` take this rank's local batch; the global batch is the
  ranks' batches concatenated in rank order (every rank passes the same shapes and dtypes), targets
  likewise. The loss and gradients are the global batch's (the loss returned is equal on every rank);
  ``forward``'s output and ``generate``'s tokens are this rank's rows; ``choose_batch`` gives a
  per-rank batch.
* Every rank calls every method of the stack in the same order (they run collectives);
  ``sync_modules`` / ``state_dicts`` give every rank the whole weights.

Without :func:`initialize` (one process, or processes started by ``jax.distributed.initialize``
directly) every process passes the same global inputs, as before. Guide: ``docs/how-to/torchrun.md``.

The module imports jax and numpy; torch only where it uses its process group (:func:`initialize`, the
host-side exchanges of :func:`gather_ints`).
"""
from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import jax
import numpy as np

__all__ = ["initialize", "per_rank_batches", "rank", "world_size", "local_rank", "gather_ints", "gather_prompts",
           "check_ranks_agree", "value_crc", "check_ranks_hold_the_same", "CRC_CHUNK", "COORDINATOR_PORT_ENV"]

#: the environment variable that sets jax's coordinator port (default ``MASTER_PORT + 1``).
COORDINATOR_PORT_ENV = "XLA_SWAP_COORDINATOR_PORT"
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_state: dict | None = None   # the settings initialize() started with


def _int_of(name: str, text, lo: int, hi: int | None = None) -> int:
    """``text`` (an environment value or an argument named ``name``) as an int in ``[lo, hi)``; ValueError naming it."""
    try:
        v = int(text) if isinstance(text, str) or (isinstance(text, int) and not isinstance(text, bool)) else None
    except ValueError:
        v = None
    if v is None or v < lo or (hi is not None and v >= hi):
        rng = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an int in {rng}, got {text!r}")
    return v


def _settings(env, coordinator_port, local_device_ids) -> dict:
    """The settings of :func:`initialize` from ``env`` (torchrun's variables) and its arguments, checked."""
    missing = [n for n in _TORCHRUN_ENV if not env.get(n)]
    if missing:
        raise ValueError(f"xla_swap.distributed.initialize() reads torchrun's environment: {', '.join(missing)} "
                         "not set (start the script with torchrun --nproc-per-node N ...)")
    world = _int_of("WORLD_SIZE", env["WORLD_SIZE"], 1)
    local_world = _int_of("LOCAL_WORLD_SIZE", env["LOCAL_WORLD_SIZE"], 1, world + 1)
    s = dict(rank=_int_of("RANK", env["RANK"], 0, world), world_size=world, local_world_size=local_world,
             local_rank=_int_of("LOCAL_RANK", env["LOCAL_RANK"], 0, local_world))
    master_port = _int_of("MASTER_PORT", env["MASTER_PORT"], 1, 65536)
    if coordinator_port is not None:
        port = _int_of("coordinator_port", coordinator_port, 1, 65536)
    elif env.get(COORDINATOR_PORT_ENV):
        port = _int_of(COORDINATOR_PORT_ENV, env[COORDINATOR_PORT_ENV], 1, 65536)
    else:
        port = master_port + 1 if master_port < 65535 else master_port - 1
    if port == master_port:
        raise ValueError(f"jax's coordinator port {port} is MASTER_PORT (torch's store may use it): give "
                         f"coordinator_port= or {COORDINATOR_PORT_ENV} another port")
    if local_device_ids is None:
        local_device_ids = [s["local_rank"]]
    elif isinstance(local_device_ids, int) and not isinstance(local_device_ids, bool):
        local_device_ids = [local_device_ids]
    if not isinstance(local_device_ids, Sequence) or not local_device_ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in local_device_ids):
        raise ValueError(f"local_device_ids must be a non-empty sequence of ints >= 0, got {local_device_ids!r}")
    s.update(coordinator=f"{env['MASTER_ADDR']}:{port}", local_device_ids=[int(i) for i in local_device_ids])
    return s


def initialize(*, coordinator_port: int | None = None, local_device_ids: Sequence[int] | None = None,
               process_group: bool = True, initialization_timeout: int = 300) -> None:
    """Start this process as one rank of a ``torchrun`` job, in per-rank batch mode (module docstring).

    Call it first, before anything uses jax's devices. A second call with the same settings does nothing.

    Args:
      coordinator_port: the port of jax's coordinator on ``MASTER_ADDR`` (rank 0 serves it). Default:
        ``$XLA_SWAP_COORDINATOR_PORT``, else ``MASTER_PORT + 1``; never ``MASTER_PORT`` (torch's store).
      local_device_ids: the local GPUs this process drives (jax's ``local_device_ids``); default
        ``[LOCAL_RANK]``, one GPU per process. Give ``[0]`` when each process already sees one GPU
        (``CUDA_VISIBLE_DEVICES`` set per process). On the CPU it does nothing (the device count is
        ``XLA_FLAGS=--xla_force_host_platform_device_count``); CPU collectives run on gloo.
      process_group: also initialize ``torch.distributed`` with the gloo backend when no process
        group exists (torch's distributed checkpoint needs one); ``False``: leave torch alone.
      initialization_timeout: seconds jax waits for every process to join.

    Raises (before anything starts):
      ValueError: a torchrun variable is missing or not an int in its range (``RANK`` < ``WORLD_SIZE``,
        ``LOCAL_RANK`` < ``LOCAL_WORLD_SIZE`` <= ``WORLD_SIZE``, ports in [1, 65536)), the message naming
        it; the coordinator port equals ``MASTER_PORT``; bad ``local_device_ids``; a second call with
        other settings; jax's engine already started with another rank or process count.
      TypeError: ``process_group`` not a bool.
      RuntimeError: jax's backends already started in this process (something used jax's devices first).
    """
    global _state
    if not isinstance(process_group, bool):
        raise TypeError(f"process_group must be a bool, got {type(process_group).__name__}")
    s = _settings(os.environ, coordinator_port, local_device_ids)
    if _state is not None:
        if {k: _state[k] for k in s} != s:
            raise ValueError(f"xla_swap.distributed.initialize() already ran with {_state}; now asked for {s}")
        return
    from xla_swap._compat.jax import backends_initialized
    if jax.distributed.is_initialized():   # started by the caller: it must be this job's engine
        if (jax.process_index(), jax.process_count()) != (s["rank"], s["world_size"]):
            raise ValueError(f"jax.distributed runs as process {jax.process_index()} of {jax.process_count()}, "
                             f"torchrun's environment says RANK={s['rank']} of WORLD_SIZE={s['world_size']}")
    elif backends_initialized():
        raise RuntimeError("xla_swap.distributed.initialize() must run before anything uses jax's devices "
                           "(jax.devices(), a jax array, a SwappedStack): call it first in the script")
    else:
        if jax.config.jax_cpu_collectives_implementation is None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=s["coordinator"], num_processes=s["world_size"],
                                   process_id=s["rank"], local_device_ids=s["local_device_ids"],
                                   initialization_timeout=initialization_timeout)
    if process_group:
        import torch.distributed as dist
        if dist.is_available() and not dist.is_initialized():
            dist.init_process_group("gloo", rank=s["rank"], world_size=s["world_size"])
    _state = s


def per_rank_batches() -> bool:
    """Whether this process runs in per-rank batch mode (:func:`initialize` ran): each rank passes its own batch."""
    return _state is not None


def rank() -> int:
    """This process's rank: ``RANK`` after :func:`initialize`, else ``jax.process_index()`` (which starts jax's
    backends: call :func:`initialize` first)."""
    return _state["rank"] if _state is not None else jax.process_index()


def world_size() -> int:
    """The number of processes: ``WORLD_SIZE`` after :func:`initialize`, else ``jax.process_count()``."""
    return _state["world_size"] if _state is not None else jax.process_count()


def local_rank() -> int:
    """This process's rank on its host: ``LOCAL_RANK`` after :func:`initialize`, else 0."""
    return _state["local_rank"] if _state is not None else 0


def gather_ints(values: Sequence[int]) -> np.ndarray:
    """Every process's ``values`` (ints within +-2**61, the same count on every process): int64
    ``[processes, len(values)]``, row ``p`` from process ``p``. A collective: every process calls it, in
    the same order. One process: ``values`` as one row. After :func:`initialize` it goes over the gloo
    process group (host only: it never waits for work queued on the GPUs); otherwise through jax
    (``multihost_utils.process_allgather``, a device collective that first drains the device's queue)."""
    v = [int(x) for x in values]
    if jax.process_count() == 1:
        return np.asarray([v], np.int64).reshape(1, len(v))
    group = _host_group()
    if group is not None:   # a host-side exchange: it does not wait for the devices' queued work
        import torch
        import torch.distributed as dist
        rows = [torch.zeros(len(v), dtype=torch.int64) for _ in range(jax.process_count())]
        dist.all_gather(rows, torch.tensor(v, dtype=torch.int64), group=group)
        return torch.stack(rows).numpy().reshape(len(rows), len(v))
    from jax.experimental import multihost_utils
    halves = np.asarray([[x >> 31 for x in v], [x & 0x7FFFFFFF for x in v]], np.int32)   # int32 without x64
    rows = np.asarray(multihost_utils.process_allgather(halves, tiled=False), np.int64)
    return (rows[:, 0] << 31) + rows[:, 1]


def _host_group():
    """The ``torch.distributed`` group to exchange small host values over: the default group where it
    exists, has a gloo backend (CPU tensors) and one rank per jax process in process order (as
    :func:`initialize` makes it); else ``None`` (the exchange goes through jax)."""
    if _state is None:
        return None
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != jax.process_count():
        return None
    if dist.get_rank() != jax.process_index() or "gloo" not in str(dist.get_backend()):
        return None
    return dist.group.WORLD


def check_ranks_agree(what: str, key) -> None:
    """Check that every process passes ``what`` of one structure: ``key`` (a hashable description, e.g.
    the shapes and dtypes, or ``None`` where this process refused its own ``what``) equal on every
    process. A collective (:func:`gather_ints`).

    Raises: ValueError on every process but those whose ``key`` is ``None`` (they raise their own
      error): another process refused its ``what`` (named), or the keys differ (this one's in the message).
    """
    h = zlib.crc32(repr(key).encode()) & 0x7FFFFFFF
    rows = gather_ints([key is not None, h])
    if key is None:
        return
    refused = [p for p in range(len(rows)) if not rows[p, 0]]
    if refused:
        raise ValueError(f"{what}: rank(s) {refused} refused their {what} (their own error says why)")
    other = [p for p in range(len(rows)) if rows[p, 1] != h]
    if other:
        raise ValueError(f"{what}: every rank must pass the same shapes and dtypes (per-rank batches of one "
                         f"size); rank {rank()} passes {key}, rank(s) {other} pass others")


#: bytes per chunk :func:`value_crc` hands to a thread.
CRC_CHUNK = 64 << 20


def value_crc(a: np.ndarray) -> int:
    """A CRC-32 of a numpy array's shape, dtype and bytes (C order): what :func:`check_ranks_hold_the_same`
    compares. Arrays over :data:`CRC_CHUNK` bytes are cut into chunks of that size, CRC'd on up to 16
    threads (``zlib.crc32`` runs at about 2 GB/s on one core and releases the GIL), and the chunks' CRCs
    are CRC'd in turn: the same value on every process that holds the same array."""
    a = np.ascontiguousarray(a)
    flat = a.reshape(-1).view(np.uint8)
    head = zlib.crc32(repr((a.shape, str(a.dtype))).encode())
    if flat.size <= CRC_CHUNK:
        return zlib.crc32(flat, head)
    chunks = [flat[i:i + CRC_CHUNK] for i in range(0, flat.size, CRC_CHUNK)]
    with ThreadPoolExecutor(min(len(chunks), os.cpu_count() or 1, 16)) as pool:
        parts = np.asarray(list(pool.map(zlib.crc32, chunks)), np.uint32)
    return zlib.crc32(parts.view(np.uint8), head)


def check_ranks_hold_the_same(what: str, names: Sequence[str], crcs: Sequence[int]) -> None:
    """Check that every process holds the same values under ``names``, given this process's CRC of each
    (:func:`value_crc`, in ``names`` order): the names compared first (their count and a CRC of them),
    then the values' CRCs against process 0's (:func:`gather_ints`, twice). A collective: every process
    calls it. One process: nothing to compare.

    Raises: ValueError (before any exchange): ``names`` and ``crcs`` differ in length. ValueError on every
      process: the processes name other values (another model), or a value differs, naming the first name
      that differs, the ranks whose value differs from rank 0's and the count of such names.
    """
    if jax.process_count() == 1:
        return
    if len(names) != len(crcs):
        raise ValueError(f"{what}: {len(names)} names and {len(crcs)} CRCs")
    keys = gather_ints([len(names), zlib.crc32(repr(tuple(names)).encode())])
    other = np.flatnonzero((keys != keys[0]).any(axis=1)).tolist()
    if other:
        raise ValueError(f"{what}: rank(s) {other} hold other tensors than rank 0 (this rank: {len(names)}). "
                         f"Every rank must build the same model")
    rows = gather_ints(list(crcs))
    mismatch = rows != rows[0]                       # [processes, names]
    differ = np.flatnonzero(mismatch.any(axis=0))
    if differ.size:
        ranks = np.flatnonzero(mismatch.any(axis=1)).tolist()
        raise ValueError(f"{what}: rank(s) {ranks} hold other values than rank 0 for {names[differ[0]]} "
                         f"({len(differ)} of {len(names)} differ). Every rank must build the same model: "
                         f"the same checkpoint, or the same seed before building it")


def gather_prompts(check, input_ids, attention_mask, max_new_tokens: int, do_sample: bool, seed) -> tuple:
    """Per-rank batches: ``((this rank's ids, its rows), ids, mask, seed)``: every rank's prompts, checked by
    ``check(ids, mask)`` here first, as one batch in rank order, left-padded to the longest prompt, and rank
    0's seed (drawn there from torch's generator when ``None`` and sampling). A collective: every rank calls
    it. Raises what ``check`` raises here, and ValueError when another rank refused its arguments or passes
    another batch size or ``max_new_tokens``."""
    try:
        mask = check(input_ids, attention_mask)[0]
    except (TypeError, ValueError, IndexError):
        check_ranks_agree("generate's arguments", None)
        raise
    check_ranks_agree("input_ids", (input_ids.shape[0], max_new_tokens))   # the batch size and max_new_tokens
    import torch
    if do_sample and seed is None:
        seed = int(torch.randint(0, 2 ** 31 - 1, ()).item())
    from jax.experimental import multihost_utils
    b, t = input_ids.shape
    lengths = gather_ints([t, seed is not None, seed or 0])
    width = int(lengths[:, 0].max())
    ids, full = np.zeros((b, width), np.int32), np.zeros((b, width), np.int32)
    ids[:, width - t:], full[:, width - t:] = input_ids.detach().cpu().numpy(), mask.numpy()
    both = multihost_utils.process_allgather(np.stack([ids, full]), tiled=False)   # [ranks, 2, b, width]
    r = jax.process_index()
    own = (input_ids.detach().to("cpu", torch.int64), slice(r * b, (r + 1) * b))
    ids, mask = (torch.from_numpy(both[:, k].reshape(-1, width).astype(np.int64)) for k in (0, 1))
    return own, ids, mask, int(lengths[0, 2]) if lengths[0, 1] else None
