#!/usr/bin/env python
"""An HF Llama trained through ``SwappedStack`` on 1 and n GPUs, as one process and under ``torchrun``, against
FSDP2 and DeepSpeed ZeRO-3 offload on the same GPUs, and the largest model the host holds: one command.

The model: ``transformers``' ``LlamaForCausalLM`` from a config (``llama_model.SHAPES``: ``8b``, D=4096,
F=14336, 32/8 heads; ``34b``, D=8192, F=22016, 64/8 heads; ``--layers`` each, vocabulary 32000, bf16),
through ``xla_swap.causal_lm_stages`` and ``SwappedStack(..., optimizer=torch.optim.AdamW(...))`` with the
default policy (weights, gradients, AdamW moments in ``pinned_host``). The pieces run one after another,
each in its own process(es), within ``--budget-s`` (a piece that no longer fits is skipped and says so):

1. ``ours`` per shape (``llama_scaling.piece_ours``): the links, then 1-GPU rows at each ``--tokens``
   (tokens per GPU; ``--shape-tokens`` per shape, 34b at 8192 by default) and n-GPU rows at the same
   global counts (strong scaling) and at n times them (weak);
2. the anchors per shape (``anchors.py --llama``, ``--world-size n``): FSDP2 with
   ``CPUOffloadPolicy(pin_memory=True)`` and DeepSpeed ZeRO-3 with parameters and optimizer offloaded
   (its CPU Adam is built in the background from the start), at the strong-scaling global counts;
3. ``torchrun --nproc-per-node n`` of this script (``llama_scaling.piece_torchrun``), each rank its own
   local batch of ``--torchrun-tokens`` (global = n x that);
4. with ``--largest``: the ``--largest-layers`` model of ``--largest-shape`` on every GPU.

Per row: the median step (``--reps`` after the compiling step and ``--warmup``), model TFLOP/s per GPU
(``llama_model.model_flops``: 6 N tokens + 6 L b s^2 D; Kaplan et al. 2020 and PaLM's appendix B, halved
for the causal mask), the speed-up over 1 GPU (strong: t1(T) / tn(T); weak: n t1(T) / tn(nT)), and the
n-GPU floor, the largest of (:func:`row_metrics`):

* host: each GPU moves its 1/n of the bytes the step's schedule moved (weights in ``w_in``, updated
  weights out ``w``, moments ``m`` in and out) over its own link, all GPUs at once:
  ``max((w_in+m)/h2d, (w+m)/d2h, (w_in+w+2m)/both)`` with the aggregate bandwidths measured in the same
  process with every GPU pulling its own ``pinned_host`` shards at once;
* NVLink: the weight all-gathers (forward and backward) and the gradient reduce-scatter,
  ``3 (n-1)/n W`` received per GPU, at the per-GPU rate of torch peer copies (a ring, all at once);
* compute (a lower bound): the model FLOPs x 4/3 (remat recomputes the forward) per GPU at the dense bf16
  GEMM rate of one GPU.

Targets (``TARGETS``): speed-up >= 0.925 n (1.85 on 2) where the n-GPU row is compute-bound, step / floor
<= 1.10 where it is link-bound; every anchor slower than ours. Writes ``llama_multi_gpu.json`` (``raw``,
``analysis``) and ``llama_multi_gpu.md`` to ``--out-dir`` after every piece, the pieces' logs under
``logs/``, and prints the tables. ``--render FILE`` re-renders a JSON; ``--cpu-smoke`` runs everything
tiny on virtual CPU devices (gloo anchors; DeepSpeed needs CUDA and reports so).

    PYTHONPATH=/tmp/site:. python3 benchmarks/llama_multi_gpu.py --gpus 2 --anchors fsdp2,deepspeed --out-dir $OUT
    python3 benchmarks/llama_multi_gpu.py --render $OUT/llama_multi_gpu.json
    PYTHONPATH=. python3 benchmarks/llama_multi_gpu.py --cpu-smoke --out-dir /tmp/lmg
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import llama_report  # noqa: E402

#: step / floor at most (link-bound rows), speed-up at least 0.925 n (compute-bound rows).
TARGETS = llama_report.TARGETS
ANCHORS = ("fsdp2", "deepspeed")
#: seconds an anchor needs at least (DeepSpeed's start and ZeRO-3 set-up are long): with less left it is skipped.
_ANCHOR_MIN_S = {"fsdp2": 40, "deepspeed": 75}
_SMOKE = dict(shapes=["tiny"], tokens=[32, 64], seq=16, reps=1, warmup=0, gpus=2, torchrun_shapes=["tiny"],
              torchrun_tokens=[16, 32], shape_tokens=[],
              anchor_shapes=["tiny"], largest_shape="tiny", largest_layers=3, largest_tokens=[32],
              largest_host_reserve_gb=1.0)


def parse_args(argv=None) -> argparse.Namespace:
    """The CLI (module docstring); ``--piece`` and the options after it are the pieces' own."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=None, help="n (default: every visible GPU; 2 with --cpu-smoke)")
    p.add_argument("--shapes", nargs="*", default=["8b", "34b"], help="llama_model.SHAPES names (none: only "
                   "--largest)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of every shape (default: the shape's, 4)")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="tokens per GPU")
    p.add_argument("--shape-tokens", nargs="*", default=["34b=8192"], help="SHAPE=T1,T2: tokens per GPU of one "
                   "shape instead of --tokens (default 34b=8192: the 9-minute budget)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--shard", choices=["fsdp", "largest"], default="fsdp", help="how our stacks split the weights "
                   "over the GPUs: the package's default rule (fsdp: the held layout's first dimension), or every 2-D "
                   "weight on its largest dimension (largest; llama_scaling.largest_dim_rule, the rule before), an "
                   "A/B of the collectives' layouts")
    p.add_argument("--prefetch-depth", type=int, default=None, help="our stacks' prefetch depth (default: "
                   "xla_swap.stack.swapped_stack.DEFAULT_POLICY's)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the compiling one")
    p.add_argument("--anchors", default="fsdp2,deepspeed", help="comma list of fsdp2, deepspeed ('' none)")
    p.add_argument("--anchor-shapes", nargs="*", default=None, help="default: --shapes")
    p.add_argument("--anchor-checkpointing", action="store_true", help="anchors with gradient checkpointing")
    p.add_argument("--no-torchrun", action="store_true", help="skip the torchrun form")
    p.add_argument("--torchrun-shapes", nargs="*", default=["8b"])
    p.add_argument("--torchrun-tokens", type=int, nargs="+", default=[4096, 32768],
                   help="tokens per rank (default 4096: strong scaling at 8192 on 2; 32768: weak)")
    p.add_argument("--torchrun-pool-headroom", type=float, default=2.0, help="each torchrun rank pins its PJRT "
                   "pinned pool when jax starts, this factor over its share of weights and moments (0: the pool "
                   "grows on demand, and its growth stalls the first timed steps by about 1 s: "
                   "results/four_gpu/run3/pool_stall.md)")
    p.add_argument("--largest", action="store_true", help="also the largest-model row (last)")
    p.add_argument("--largest-shape", default="34b")
    p.add_argument("--largest-layers", type=int, default=48)
    p.add_argument("--largest-tokens", type=int, nargs="+", default=[16384], help="global tokens")
    p.add_argument("--largest-headroom", type=float, default=1.25, help="the pinned pool per device over its "
                   "share of the state (1.1 ran out at the 70B shape's first step on 4 H200s)")
    p.add_argument("--largest-host-reserve-gb", type=float, default=48.0, help="host memory (GB) the largest "
                   "row leaves beside its pinned pools for the process and the system; less available: skipped")
    p.add_argument("--largest-anchor-layers", type=int, default=0, help="after the largest row: FSDP2 "
                   "CPUOffloadPolicy (built on the meta device) on this many layers of --largest-shape (0: none)")
    p.add_argument("--profile-dir", default=None, help="after each single-process row at --profile-tokens, one more "
                   "step traced (jax profiler) into this folder, its per-GPU split into the row (trace_summary.overlap)")
    p.add_argument("--profile-tokens", type=int, nargs="*", default=None, help="global token counts to trace "
                   "(default: every row's)")
    p.add_argument("--budget-s", type=float, default=500, help="wall time for every piece together")
    p.add_argument("--compilation-cache", default=None, help="jax's persistent compilation cache (a folder)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--render", default=None, help="re-render a llama_multi_gpu.json, run nothing")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on virtual CPU devices")
    p.add_argument("--torchrun", action="store_true", help="run as one rank of `torchrun --nproc-per-node n` "
                   "(the first of --shapes, --torchrun-tokens per rank; rows into --out-dir/torchrun_SHAPE_rankR.json)")
    # the pieces' own options (set by the driver)
    p.add_argument("--piece", choices=["ours", "torchrun", "largest"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--piece-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    p.add_argument("--fill-device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--coordinator-port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cpu_smoke and args.piece is None:   # the tiny defaults, where the command line left the default
        for k, v in _SMOKE.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    if not (args.torchrun_pool_headroom == 0 or args.torchrun_pool_headroom >= 1):
        p.error(f"--torchrun-pool-headroom: 0 (the pool grows on demand) or a factor >= 1, "
                f"got {args.torchrun_pool_headroom}")
    bad = [a for a in args.anchors.split(",") if a and a not in ANCHORS]
    if bad:
        p.error(f"--anchors: unknown {bad}; any of {ANCHORS}")
    try:
        args.tokens_of = {k: sorted({int(t) for t in v.split(",")}) for k, _, v in
                          (x.partition("=") for x in args.shape_tokens)}
    except ValueError:
        p.error(f"--shape-tokens: SHAPE=T1,T2 ..., got {args.shape_tokens}")
    return args


def tokens_of(args, shape: str) -> list[int]:
    """Tokens per GPU of ``shape``: its ``--shape-tokens`` entry, else ``--tokens``."""
    return args.tokens_of.get(shape) or sorted(set(args.tokens))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cuda_count() -> int:
    """Visible GPUs: nvidia-smi's list (the driver starts no CUDA context), else torch's count."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        count = sum(1 for ln in out.splitlines() if ln.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        count = 0
    if count and os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return count
    import torch
    return torch.cuda.device_count()


def _env(args, n: int) -> dict:
    """The pieces' environment: this folder and the repository on ``PYTHONPATH``; with ``--cpu-smoke`` jax
    on n virtual CPU devices; NVLink multicast off (the device rules)."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if args.cpu_smoke:   # n devices; the environment's other XLA flags kept
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env.update(JAX_PLATFORMS="cpu", PJRT_DEVICE="CPU", CUDA_VISIBLE_DEVICES="",
                   XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={n}"]))
    return env


def plan(args, n: int, work: str) -> list[dict]:
    """The pieces in order: ``{"name", "kind", "cmd", "min_s", ...}`` (``min_s``: below that much time left
    the piece is skipped)."""
    me, py = os.path.abspath(__file__), sys.executable
    common = ["--seq", str(args.seq), "--reps", str(args.reps), "--warmup", str(args.warmup),
              "--fill-device", "cpu" if args.cpu_smoke else "cuda:0"]
    if args.prefetch_depth is not None:
        common += ["--prefetch-depth", str(args.prefetch_depth)]
    if args.shard != "fsdp":
        common += ["--shard", args.shard]
    if args.compilation_cache:
        common += ["--compilation-cache", args.compilation_cache]
    layers = ["--layers", str(args.layers)] if args.layers else []
    anchors = [a for a in args.anchors.split(",") if a]
    pieces = []
    for shape in args.shapes:
        out = os.path.join(work, f"ours_{shape}.json")
        profile = ["--profile-dir", args.profile_dir] if args.profile_dir else []
        if profile and args.profile_tokens:
            profile += ["--profile-tokens", *map(str, args.profile_tokens)]
        pieces.append(dict(name=f"ours:{shape}", kind="ours", shape=shape, out=out, min_s=60, cmd=[
            py, me, "--piece", "ours", "--shape", shape, *layers, "--gpus", str(n), "--piece-out", out,
            "--tokens", *map(str, tokens_of(args, shape)), *common, *profile]))
        for a in anchors if shape in (args.anchor_shapes if args.anchor_shapes is not None else args.shapes) else []:
            pieces.append(dict(name=f"{a}:{shape}", kind="anchor", anchor=a, shape=shape, min_s=_ANCHOR_MIN_S[a], cmd=[
                py, os.path.join(HERE, "anchors.py"), "--anchor", a, "--llama", shape, *layers, "--seq",
                str(args.seq), "--tokens", *map(str, tokens_of(args, shape)), "--reps", str(args.reps),
                "--world-size", str(n)]
                + (["--checkpointing"] if args.anchor_checkpointing else [])))
        if not args.no_torchrun and shape in args.torchrun_shapes and n > 1:
            out = os.path.join(work, f"torchrun_{shape}_rank{{rank}}.json")
            one_device = {"XLA_FLAGS": _env(args, 1)["XLA_FLAGS"]} if args.cpu_smoke else {}
            pieces.append(dict(name=f"torchrun:{shape}", kind="torchrun", shape=shape, out=out, min_s=60,
                               env_extra=one_device, cmd=[
                py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), me, "--piece",
                "torchrun", "--shape", shape, *layers, "--piece-out", out, "--coordinator-port", str(_free_port()),
                "--torchrun-pool-headroom", str(args.torchrun_pool_headroom),
                "--tokens", *map(str, args.torchrun_tokens), *common]))
    if args.largest:
        out = os.path.join(work, "largest.json")
        pieces.append(dict(name=f"largest:{args.largest_shape}", kind="largest", shape=args.largest_shape, out=out,
                           min_s=90, cmd=[py, me, "--piece", "largest", "--shape", args.largest_shape, "--layers",
                                          str(args.largest_layers), "--gpus", str(n), "--piece-out", out,
                                          "--largest-headroom", str(args.largest_headroom),
                                          "--largest-host-reserve-gb", str(args.largest_host_reserve_gb),
                                          "--tokens", *map(str, args.largest_tokens), *common]))
        if args.largest_anchor_layers:
            pieces.append(dict(name=f"fsdp2-largest:{args.largest_shape}", kind="largest_anchor", min_s=90, cmd=[
                py, os.path.join(HERE, "anchors.py"), "--anchor", "fsdp2", "--llama", args.largest_shape, "--layers",
                str(args.largest_anchor_layers), "--meta-init", "--seq", str(args.seq), "--tokens",
                *map(str, args.largest_tokens), "--reps", str(args.reps), "--world-size", str(n)]))
    return pieces


def run_cmd(cmd: list, env: dict, timeout_s: float, log_path: str) -> dict:
    """Run ``cmd`` in its own process group, stdout and stderr into ``log_path``. After ``timeout_s`` the
    group gets SIGTERM (torchrun passes it on to its ranks, which run in sessions of their own), then
    SIGKILL 15 s later. ``{"rc", "wall_s", "timed_out"}``."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc, timed_out = p.wait(timeout=max(1.0, timeout_s)), False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)   # the group this call started
            try:
                rc = p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
            timed_out = True
    return {"rc": rc, "wall_s": time.perf_counter() - t0, "timed_out": timed_out}


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _last_json(log_path: str, key: str) -> dict | None:
    """The last line of ``log_path`` that is a JSON object holding ``key``."""
    found = None
    with open(log_path, errors="replace") as f:
        for ln in f:
            if ln.startswith("{"):
                try:
                    d = json.loads(ln)
                except ValueError:
                    continue
                if isinstance(d, dict) and key in d:
                    found = d
    return found


def collect(piece: dict, log_path: str, n: int):
    """What a finished (or stopped) piece left: its JSON, the torchrun ranks' JSONs, the anchor's line."""
    if piece["kind"] in ("anchor", "largest_anchor"):
        return _last_json(log_path, "anchor")
    if piece["kind"] == "torchrun":
        ranks = [_load(piece["out"].replace("{rank}", str(r))) for r in range(n)]
        return {"ranks": ranks} if any(ranks) else None
    return _load(piece["out"])


def rows_of(piece: dict, result) -> int:
    """How many rows a piece's :func:`collect` result holds: its rows (rank 0's under torchrun; one for an
    anchor's line without ``error``). 0 for a piece stopped before its first row, though its JSON exists."""
    if not result:
        return 0
    if piece["kind"] in ("anchor", "largest_anchor"):
        return int("error" not in result)
    if piece["kind"] == "torchrun":
        return len((result["ranks"][0] or {}).get("rows", []))
    return len(result.get("rows", []))


def start_cpu_adam_build(env: dict, log_path: str):
    """DeepSpeed's CPU Adam JIT build started in the background (a ninja build, minutes on a fresh machine),
    so that the DeepSpeed anchor finds it built; None where DeepSpeed is not installed."""
    if importlib.util.find_spec("deepspeed") is None:
        return None
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu_adam built')"
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                            env=dict(env, MAX_JOBS=env.get("MAX_JOBS", "8")), start_new_session=True)


def drive(args) -> dict:
    """Every piece of :func:`plan` in turn within ``--budget-s``: the raw dict (also written after each piece)."""
    t0 = time.perf_counter()
    n = args.gpus or (2 if args.cpu_smoke else _cuda_count())
    if n < 1:
        raise SystemExit("no GPU visible (nvidia-smi -L); --cpu-smoke runs on the CPU")
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="llama_multi_gpu_")
    work, logs = os.path.join(out_dir, "pieces"), os.path.join(out_dir, "logs")
    os.makedirs(work, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    env = _env(args, n)
    raw = {"argv": sys.argv, "n": n, "tokens_per_gpu": {s: tokens_of(args, s) for s in args.shapes}, "seq": args.seq,
           "reps": args.reps, "torchrun_tokens_per_rank": args.torchrun_tokens,
           "warmup": args.warmup, "cpu_smoke": args.cpu_smoke, "budget_s": args.budget_s, "pieces": {},
           "ours": {}, "torchrun": {}, "anchors": {}, "largest": None, "largest_anchor": None}
    build = None
    if "deepspeed" in args.anchors and not args.cpu_smoke:
        build = start_cpu_adam_build(env, os.path.join(logs, "cpu_adam_build.log"))
        raw["cpu_adam_build"] = "started" if build else "deepspeed not installed"
    for piece in plan(args, n, work):
        left = args.budget_s - (time.perf_counter() - t0)
        if left < piece["min_s"]:
            raw["pieces"][piece["name"]] = {"skipped": f"{left:.0f} s left of --budget-s, it needs >= {piece['min_s']}"}
            print(json.dumps({"piece": piece["name"], **raw["pieces"][piece["name"]]}), flush=True)
            continue
        if piece.get("anchor") == "deepspeed" and build is not None and build.poll() is None:
            try:   # the anchor builds it itself otherwise
                build.wait(timeout=max(1.0, left - piece["min_s"]))
            except subprocess.TimeoutExpired:
                pass
        log_path = os.path.join(logs, piece["name"].replace(":", "_") + ".log")
        status = run_cmd(piece["cmd"], dict(env, **piece.get("env_extra", {})), left - 20, log_path)
        result = collect(piece, log_path, n)
        raw["pieces"][piece["name"]] = dict(status, cmd=" ".join(piece["cmd"]), rows=rows_of(piece, result))
        store = {"ours": raw["ours"], "torchrun": raw["torchrun"], "anchor": raw["anchors"]}.get(piece["kind"])
        if piece["kind"] in ("largest", "largest_anchor"):
            raw[piece["kind"]] = result
        elif result is not None:
            store[piece["name"] if piece["kind"] == "anchor" else piece["shape"]] = result
        print(json.dumps({"piece": piece["name"], **status, "rows": raw["pieces"][piece["name"]]["rows"],
                          "elapsed_s": round(time.perf_counter() - t0, 1)}), flush=True)
        write(raw, args.out_dir)
    if build is not None and build.poll() is None:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()
    raw["wall_s"] = time.perf_counter() - t0
    return raw


def write(raw: dict, out_dir: str | None) -> str:
    """``llama_multi_gpu.json`` (raw and analysis) and ``llama_multi_gpu.md`` into ``out_dir`` (when given);
    the rendered text."""
    analysis = llama_report.analyze(raw)
    text = llama_report.render(analysis)
    if out_dir:
        with open(os.path.join(out_dir, "llama_multi_gpu.json"), "w") as f:
            json.dump({"raw": raw, "analysis": analysis}, f, indent=1, default=str)
        with open(os.path.join(out_dir, "llama_multi_gpu.md"), "w") as f:
            f.write(text + "\n")
    return text


def main(argv=None) -> int:
    """The CLI: a piece (``--piece``), the re-rendering (``--render``), or the whole run."""
    args = parse_args(argv)
    if args.torchrun and not args.piece:   # by hand under torchrun: the piece the driver would start
        args.piece, args.shape, args.tokens = "torchrun", args.shape or args.shapes[0], args.torchrun_tokens
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
            args.piece_out = os.path.join(args.out_dir, f"torchrun_{args.shape}_rank{{rank}}.json")
        args.fill_device = "cuda:0"   # made cuda:LOCAL_RANK by the piece where CUDA is there
    if args.piece:
        import llama_scaling
        return llama_scaling.run_piece(args)
    if args.render:
        with open(args.render) as f:
            print(llama_report.render(llama_report.analyze(json.load(f)["raw"])))
        return 0
    raw = drive(args)
    print(write(raw, args.out_dir))
    print(f"total wall time {raw['wall_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
