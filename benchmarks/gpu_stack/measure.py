"""Measurement in one process: build a variant's program, time it, read its memory, check it.

:data:`BUILDERS` maps each :class:`~.variants.Variant` ``kind`` to a function that builds a
:class:`Program` (the timed call and what it keeps alive); :func:`run_one` times any program
the same way: one untimed first call (compile + run), ``warmup`` more, ``reps`` timed calls
(seconds, host clock, only the final ``block_until_ready`` syncs), device memory stats before
and after, the streaming runtime's per-stage sizes and one traced call (a
``xla_swap.executors.TraceRecorder``), the predicted peak (``analysis.predict_peak``), the XLA
flag search, and the relative error against the on-device per-layer loop.
Imports jax, numpy and xla_swap.executors when run (no torch but for ``accelerate``).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

from .analysis import predict_peak
from ._util import GiB, MiB, gib, log
from .spec import ARTIFACT_DTYPE, RunSpec
from .variants import FLAG_SETS, GROUPS, Variant, lookup
from .workload import Workload, chunked_stages, merge_chunk_grads

__all__ = ["Program", "BUILDERS", "run_variant", "run_one", "run_bandwidth", "run_accelerate", "compiled_info",
           "flag_options", "time_calls", "rel_err"]


def flag_options(flags: str) -> dict:
    """``"--a=true --b=1"`` -> ``{"a": True, "b": "1"}`` (compiler_options for ``Lowered.compile``)."""
    out = {}
    for item in flags.split():
        key, _, val = item.lstrip("-").partition("=")
        out[key] = {"true": True, "false": False}.get(val.lower(), val)
    return out


def time_calls(fn: Callable[[], Any], reps: int, warmup: int):
    """Call ``fn`` ``warmup`` times untimed, then time ``reps`` calls; only the final
    ``block_until_ready`` of each call syncs. Returns ``(times in seconds, last output)``."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times, out = [], None
    for _ in range(reps):
        out = None  # free the previous result before the next call
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    return times, out


def rel_err(wl: Workload, a, b) -> float:
    """``max|a - b| / max|b|`` in float32 on the device (``a``, ``b``: arrays of one shape)."""
    jax, jnp = wl.jax, wl.jnp
    a = jax.device_put(a, wl.DEV).astype(jnp.float32)
    b = jax.device_put(b, wl.DEV).astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def compiled_info(compiled) -> dict:
    """Compiled ``memory_analysis`` bytes (temp, output, argument, host temp) and the count of
    ``copy-start`` ops in the compiled HLO text, as far as the backend reports them."""
    info = {}
    try:
        m = compiled.memory_analysis()
        info["temp_bytes"] = int(m.temp_size_in_bytes)
        info["output_bytes"] = int(m.output_size_in_bytes)
        info["argument_bytes"] = int(m.argument_size_in_bytes)
        info["host_temp_bytes"] = int(getattr(m, "host_temp_size_in_bytes", 0))
    except Exception as e:  # noqa: BLE001
        info["memory_analysis_error"] = repr(e)
    try:
        text = compiled.as_text()
        info["copy_start_count"] = text.count("copy-start")
    except Exception:  # noqa: BLE001
        pass
    return info


def run_bandwidth(wl: Workload) -> dict:
    """Time moving the stack's weight bytes W itself: H2D, D2H, and both at once.

    Buffers shaped like the weights (L x two per-layer matrices, separate ``pinned_host``
    / ``device`` buffers; ``bw_mib`` instead uses one buffer of that size), all copies of
    a direction issued back to back, timed until all are done. ``*_GBps`` = bytes moved /
    median time (GB = 1e9 B); ``*_best_GBps`` = bytes / fastest time. The floors use the best
    figures: a floor must not be slower than what the link was seen to do (the median of a
    1 GiB copy was measured at 45 GB/s on a host where the in-graph forward moved 8 GiB at
    51.6). Values: zeros generated on the device (a device -> host copy makes the host copies).
    """
    jax, jnp, spec = wl.jax, wl.jnp, wl.spec
    if spec.bw_mib:
        shapes = [(spec.bw_mib * MiB // 2,)]
    else:
        shapes = [s for _ in range(wl.L) for s in ((wl.D, wl.F), (wl.F, wl.D))]
    dev = [jax.device_put(jnp.zeros(s, jnp.bfloat16), wl.DEV) for s in shapes]
    host = jax.block_until_ready([jax.device_put(x, wl.HOST) for x in dev])
    dev2 = jax.block_until_ready([jax.device_put(jnp.zeros(s, jnp.bfloat16), wl.DEV) for s in shapes])
    nbytes = sum(int(x.size) * 2 for x in host)

    def h2d():
        return [jax.device_put(x, wl.DEV) for x in host]

    def d2h():
        return [jax.device_put(x, wl.HOST) for x in dev2]

    def both():
        return h2d(), d2h()

    out = {"bytes": nbytes, "buffers": len(shapes)}
    for name, fn, moved in (("h2d", h2d, nbytes), ("d2h", d2h, nbytes), ("both", both, 2 * nbytes)):
        jax.block_until_ready(fn())  # first use allocates; time_calls adds warmup more
        times, _ = time_calls(fn, spec.reps, spec.warmup)
        out[name + "_times_s"] = times
        out[name + "_GBps"] = moved / float(wl.np.median(times)) / 1e9
        out[name + "_best_GBps"] = moved / min(times) / 1e9
        log(f"bandwidth {name}: median {out[name + '_GBps']:.2f} GB/s, best {out[name + '_best_GBps']:.2f} GB/s "
            f"({len(times)} x {moved / GiB:.2f} GiB in {len(shapes)} buffers)")
    return out


@dataclasses.dataclass
class Program:
    """A built variant at one token count.

    Attributes:
      call: one timed call (returns the output pytree; asynchronous).
      keep: what must stay alive until the correctness check (weights, executables).
      info: row fields known from building (compiled sizes, stage counts, settings).
      runtime: the ``StreamingRuntime`` of streaming variants (per-stage sizes are read from it).
      traced_call: streaming variants: ``call`` with a ``TraceRecorder`` passed to the runtime.
      recompile: ``flag_search`` variants: ``compiler_options -> (compiled, call)``.
      ref_weights: the device weights the on-device rows already hold (the check reuses them).
    """

    call: Callable[[], Any]
    keep: list
    info: dict = dataclasses.field(default_factory=dict)
    runtime: Any = None
    traced_call: Callable | None = None
    recompile: Callable | None = None
    ref_weights: list | None = None


def _build_on_device_loop(wl: Workload, v: Variant, spec: RunSpec, tokens: int, x, ct, artifact) -> Program:
    W = wl.device_weights()
    call = (lambda: wl.ondev_train(W, x, ct)) if v.train else (lambda: wl.ondev_forward(W, x))
    one = (wl.bwd_j.lower(W[0], x, ct) if v.train else wl.fwd_j.lower(W[0], x)).compile()
    return Program(call, [W], {"layer_temp_bytes": compiled_info(one).get("temp_bytes")}, ref_weights=W)


def _build_on_device_jit(wl: Workload, v: Variant, spec: RunSpec, tokens: int, x, ct, artifact) -> Program:
    jax = wl.jax
    W = wl.device_weights()
    if v.train:
        policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable if v.saved
                  else jax.checkpoint_policies.nothing_saveable)
        f = jax.checkpoint(wl.layer, policy=policy)

        def step(W, x, ct):
            def stack(W, h):
                for p in W:
                    h = f(p, h)
                return h
            y, vjp = jax.vjp(stack, W, x)
            gW, gx = vjp(ct)
            return y, gx, gW
        compiled = jax.jit(step).lower(W, x, ct).compile()
        call = lambda: compiled(W, x, ct)  # noqa: E731
    else:
        compiled = jax.jit(wl.ondev_forward).lower(W, x).compile()
        call = lambda: compiled(W, x)  # noqa: E731
    return Program(call, [W, compiled], compiled_info(compiled), ref_weights=W)


def _build_xla_in_graph(wl: Workload, v: Variant, spec: RunSpec, tokens: int, x, ct, artifact) -> Program:
    jax = wl.jax
    SA, SB = wl.stacked_host_weights()
    DEV = wl.DEV

    def scanned(x, sa, sb):
        def body(h, ab):
            return wl.layer(jax.device_put(ab, DEV), h), None
        return jax.lax.scan(body, x, (sa, sb))[0]

    lowered = jax.jit(scanned).lower(x, SA, SB)
    compiled = lowered.compile()

    def recompile(opts):
        c = lowered.compile(compiler_options=opts)
        return c, (lambda: c(x, SA, SB))
    return Program(lambda: compiled(x, SA, SB), [SA, SB, compiled], compiled_info(compiled), recompile=recompile)


def _build_xla_in_graph_unrolled(wl: Workload, v: Variant, spec: RunSpec, tokens: int, x, ct, artifact) -> Program:
    jax = wl.jax
    HW = wl.host_weights()
    DEV = wl.DEV

    def unrolled(x, ws):
        h = x
        for p in ws:
            h = wl.layer(jax.device_put(p, DEV), h)
        return h

    compiled = jax.jit(unrolled).lower(x, HW).compile()
    return Program(lambda: compiled(x, HW), [compiled], compiled_info(compiled))


def _build_xla_swap_in_graph(wl: Workload, v: Variant, spec: RunSpec, tokens: int, x, ct, artifact) -> Program:
    from xla_swap.executors import InGraphRuntime

    chunks = spec.chunk_plan(tokens)
    fns, sp = chunked_stages(wl, wl.host_weights(), chunks)
    igr = InGraphRuntime(fns, sp, device=wl.dev)
    compiled = igr.compile(x)
    info = dict(compiled_info(compiled), stages=len(sp), chunks=list(chunks))

    def recompile(opts):
        r = InGraphRuntime(fns, igr.host_params, device=wl.dev, compiler_options=opts)
        return r.compile(x), (lambda: r.forward(x))
    return Program(lambda: igr.forward(x), [igr], info, recompile=recompile)


def _build_torch_xla_lowered(wl: Workload, v: Variant, spec: RunSpec, tokens: int, x, ct, artifact) -> Program:
    from benchmarks.export_torch_xla_stack import stack_policy
    from xla_swap.executors import PjrtExecutor

    proto, meta = artifact
    roles = meta["roles"]
    SA, SB = wl.stacked_host_weights()
    t = time.perf_counter()
    exe = PjrtExecutor.from_policy(proto, stack_policy(), weights=[roles["w1"], roles["w2"]], parameters=len(roles))
    info = {"compile_s": time.perf_counter() - t}
    values = [None] * exe.num_parameters
    values[roles["w1"]], values[roles["w2"]], values[roles["x"]] = SA, SB, x
    placed = exe.put_all(values)  # untimed; the stacked host arrays are already placed (no copy)
    rep = exe.memory_report()
    text = exe.compiled_hlo_text()
    info.update({"artifact": meta["_file"], "artifact_sha256": meta["sha256"], "roles": roles,
                 "put_all_copies": exe.transfer_count, "temp_bytes": rep.device_temp_bytes,
                 "output_bytes": rep.device_output_bytes,
                 "parameter_memory_spaces": list(rep.parameter_memory_spaces),
                 "copy_start_count": text.count("copy-start"),
                 "torch_xla_version": meta.get("torch_xla_version")})
    log(f"torch_xla-lowered T={tokens}: {meta['_file']}, parameter spaces {list(rep.parameter_memory_spaces)}, "
        f"put_all copies {exe.transfer_count}, device temp {gib(rep.device_temp_bytes)} GiB")
    return Program(lambda: exe(*placed)[0], [exe, placed, SA, SB], info)


def _build_streaming(wl: Workload, v: Variant, spec: RunSpec, tokens: int, x, ct, artifact) -> Program:
    from xla_swap.executors import Placement, RuntimeConfig, StreamingRuntime

    chunks = spec.chunk_plan(tokens) if v.chunked else (1, 1)
    fns, sp = chunked_stages(wl, wl.host_weights(), chunks) if v.chunked else (wl.layer, wl.host_weights())
    remat = wl.jax.checkpoint_policies.dots_with_no_batch_dims_saveable if v.saved else True
    rt = StreamingRuntime(fns, sp,
                          RuntimeConfig(prefetch_depth=v.prefetch_depth, throttle=v.throttle, track_residency=False,
                                        remat=remat), placement=Placement(device=wl.dev))
    if v.train:
        def call(trace=None):
            return rt.train_step(x, cotangent=ct, trace=trace)
    else:
        def call(trace=None):
            return rt.forward(x, trace=trace)
    info = {"prefetch_depth": v.prefetch_depth, "throttle": v.throttle, "stages": rt.num_stages,
            "remat": "dots_with_no_batch_dims_saveable" if v.saved else "per-stage recompute", "chunks": list(chunks)}
    return Program(call, [rt], info, runtime=rt, traced_call=call)


#: One builder per variant kind that :func:`run_one` times:
#: ``builder(workload, variant, spec, tokens, x, ct, artifact) -> Program``.
BUILDERS: dict[str, Callable[..., Program]] = {
    "on-device-loop": _build_on_device_loop,
    "on-device-jit": _build_on_device_jit,
    "xla-in-graph": _build_xla_in_graph,
    "xla-in-graph-unrolled": _build_xla_in_graph_unrolled,
    "xla_swap-in-graph": _build_xla_swap_in_graph,
    "torch_xla-lowered": _build_torch_xla_lowered,
    "streaming": _build_streaming,
}


def _load_artifact(wl: Workload, spec: RunSpec, tokens: int, res: dict):
    """The torch_xla artifact ``(proto, meta)`` for this stack and ``tokens``; ``None`` (and
    ``res["skipped"]`` set) when it is missing. Needs neither torch nor torch_xla."""
    from benchmarks.export_torch_xla_stack import artifact_stem, load_artifact

    proto, meta = load_artifact(spec.artifacts_dir, wl.D, wl.F, wl.L, ARTIFACT_DTYPE, tokens)
    if proto is None:
        res["skipped"] = meta
        log(f"skip torch_xla-lowered T={tokens}: {meta}")
        return None
    meta["_file"] = artifact_stem(wl.D, wl.F, wl.L, ARTIFACT_DTYPE, tokens) + ".hlo.pb"
    return proto, meta


def _streaming_sizes(rt, train: bool) -> dict:
    """Per-stage sizes of a streaming runtime after a call: the inputs of ``analysis.predict_peak``."""
    mems = rt.executable_memory()
    temps = [m["temp_bytes"] for m in mems if m["temp_bytes"] is not None]
    # per-stage temporaries of the executables this call used (forward / backward)
    stage_temp = {"forward": [0] * rt.num_stages, "backward": [0] * rt.num_stages}
    for m in mems:
        which = "backward" if m["kind"].startswith("backward") else "forward"
        for st in m["stages"]:
            stage_temp[which][st] = max(stage_temp[which][st], m["temp_bytes"] or 0)
    return {"temp_bytes": max(temps) if temps else None, "stage_nbytes": rt.stage_nbytes,
            "stage_input_nbytes": rt.stage_input_nbytes(), "stage_temp_bytes": stage_temp,
            "residual_nbytes": list(rt.residual_nbytes) if train else [0] * rt.num_stages}


def _flag_search(wl: Workload, prog: Program, name: str, res: dict) -> list:
    """Rows ``name@set``: the program compiled again and timed under each of :data:`FLAG_SETS`."""
    jax, np, spec = wl.jax, wl.np, wl.spec
    rows = []
    for fname, flags in FLAG_SETS.items():
        row = {k: v for k, v in res.items() if k in ("device", "platform", "jax_version", "weight_bytes",
                                                      "tokens", "activation_bytes")}
        row.update({"variant": f"{name}@{fname}", "xla_flags": flags, "peak_is_cumulative": True})
        try:
            c, fcall = prog.recompile(flag_options(flags))
            row.update(compiled_info(c))
            jax.block_until_ready(fcall())
            ftimes, _ = time_calls(fcall, spec.reps, spec.warmup)
            row.update({"times_s": ftimes, "median_ms": float(np.median(ftimes)) * 1e3,
                        "min_ms": min(ftimes) * 1e3})
            log(f"{row['variant']} T={row['tokens']}: median {row['median_ms']:.1f} ms, "
                f"copy-start={row.get('copy_start_count')}")
            del c, fcall
        except Exception as e:  # noqa: BLE001 - an option this XLA does not know
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{row['variant']} T={row['tokens']} FAILED: {row['error']}")
        rows.append(row)
    return rows


def _check(wl: Workload, v: Variant, spec: RunSpec, tokens: int, out, x, ct, ref_weights, res: dict) -> None:
    """Fill ``res["rel_err"]`` (and, for training, the output, input-cotangent and weight-gradient
    errors and the gradients' memory kind) against the on-device per-layer loop."""
    W = ref_weights if ref_weights is not None else wl.device_weights()
    if v.train:
        r_out, r_gx, r_grads = wl.ondev_train(W, x, ct)
        o_out, o_gx, o_grads = out
        if v.chunked:  # per-stage gradients: concatenate the chunks of the first and last layer back
            o_grads = merge_chunk_grads(wl, o_grads, spec.chunk_plan(tokens))
        res["rel_err_out"] = rel_err(wl, o_out, r_out)
        res["rel_err_dx"] = rel_err(wl, o_gx, r_gx)
        res["rel_err_grads"] = max(rel_err(wl, o, r) for og, rg in zip(o_grads, r_grads) for o, r in zip(og, rg))
        res["grads_memory_kind"] = o_grads[0][0].sharding.memory_kind
        res["rel_err"] = max(res["rel_err_out"], res["rel_err_dx"], res["rel_err_grads"])
    else:
        res["rel_err"] = rel_err(wl, out, wl.ondev_forward(W, x))
    log(f"{v.name} T={tokens}: max rel err vs on-device {res['rel_err']:.2e}")


def run_one(wl: Workload, v: Variant, tokens: int, res: dict, check: bool = True) -> list:
    """Time variant ``v`` at ``tokens`` in this process, filling the row ``res`` (see the package docstring).

    ``check``: also compare with the on-device loop (loads the weights onto the device, so it
    runs after the timing and only for the last token count of a process). Returns extra
    rows: the XLA flag-set timings of the ``flag_search`` variants (``name@set``).

    Raises: KeyError for a kind without a builder; whatever building or running raises.
    """
    spec, jax, np = wl.spec, wl.jax, wl.np
    build = BUILDERS[v.kind]
    artifact = None
    if v.kind == "torch_xla-lowered":  # before anything is generated: a missing artifact is a skip
        artifact = _load_artifact(wl, spec, tokens, res)
        if artifact is None:
            return []
    x, ct = wl.inputs(tokens)
    hbytes = int(x.size) * x.dtype.itemsize
    prog = build(wl, v, spec, tokens, x, ct, artifact)

    mem0 = wl.mem()
    t = time.perf_counter()
    jax.block_until_ready(prog.call())  # compile (first call) + first run, untimed
    prog.info["first_call_s"] = time.perf_counter() - t
    times, out = time_calls(prog.call, spec.reps, spec.warmup)
    mem1 = wl.mem()
    res.update(prog.info)
    res.update({"times_s": times, "median_ms": float(np.median(times)) * 1e3, "min_ms": min(times) * 1e3,
                "peak_bytes": mem1.get("peak_bytes_in_use"), "bytes_in_use_before": mem0.get("bytes_in_use"),
                "bytes_in_use_after": mem1.get("bytes_in_use"), "bytes_limit": mem1.get("bytes_limit"),
                "activation_bytes": hbytes})
    log(f"{v.name} T={tokens}: median {res['median_ms']:.1f} ms, min {res['min_ms']:.1f} ms, "
        f"peak {gib(res['peak_bytes'])} GiB")

    if prog.runtime is not None:
        res.update(_streaming_sizes(prog.runtime, v.train))
        if spec.trace:  # one extra, untimed call with event timestamps for a timeline plot
            from xla_swap.executors import TraceRecorder

            out = None
            recorder = TraceRecorder()
            out = jax.block_until_ready(prog.traced_call(trace=recorder))
            res["trace"] = recorder.to_dicts()
    res.update(predict_peak(res, wl.L))

    rows = []
    if v.flag_search and prog.recompile is not None and spec.flag_search and tokens == min(spec.tokens):
        rows = _flag_search(wl, prog, v.name, res)
    if not check:
        return rows
    # correctness against the on-device per-layer loop (after the peak was read)
    ref_weights = prog.ref_weights
    prog = None
    _check(wl, v, spec, tokens, out, x, ct, ref_weights, res)
    return rows


def run_variant(spec: RunSpec, name: str, tokens_list) -> list:
    """Run variant or group ``name`` for every token count (ascending) in this process; one row
    dict each (plus flag-search rows). ``"bandwidth"`` and ``"weights"`` take no token counts.

    Raises: ValueError for a name that is neither a variant nor a group.
    """
    members = GROUPS.get(name, (name,))
    variants = [lookup(m) for m in members]
    if None in variants or "@" in name:
        raise ValueError(f"unknown variant {name!r}")
    wl = Workload(spec)
    jax = wl.jax
    base = {"variant": name, "device": getattr(wl.dev, "device_kind", str(wl.dev)),
            "platform": wl.dev.platform, "jax_version": jax.__version__, "weight_bytes": wl.weight_bytes,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    kind = variants[0].kind
    if kind == "bandwidth":
        return [dict(base, tokens=None, **run_bandwidth(wl))]
    if kind == "weights":
        return [dict(base, tokens=None, **wl.write_weight_cache(spec.weights_cache))]
    if kind == "accelerate":
        return [run_accelerate(wl, t, dict(base, tokens=t)) for t in tokens_list]
    out = []
    tokens_list = sorted(tokens_list)
    for j, v in enumerate(variants):
        for i, tokens in enumerate(tokens_list):
            res = dict(base, variant=v.name, tokens=tokens, peak_is_cumulative=(i > 0 or j > 0), group_member=j)
            rows = []
            try:
                # the correctness check loads device weights: only after the last timed run
                rows = run_one(wl, v, tokens, res, check=(i == len(tokens_list) - 1))
            except Exception as e:  # noqa: BLE001 - record, go on with the next token count
                res["error"] = f"{type(e).__name__}: {e}"
                log(f"{v.name} T={tokens} FAILED: {res['error'][:300]}")
            out += [res] + rows
    return out


def run_accelerate(wl: Workload, tokens: int, res: dict) -> dict:
    """HF accelerate ``cpu_offload`` forward on torch CUDA (weights pageable, per-module hooks).

    Fills and returns ``res``: times, peak (``torch.cuda.max_memory_allocated``), relative error
    against the on-device loop; ``res["skipped"]`` when torch / accelerate / CUDA is missing.
    """
    try:
        import accelerate
        import torch
        from accelerate import cpu_offload
    except Exception as e:  # noqa: BLE001 - a jax-only machine
        res["skipped"] = f"torch/accelerate not importable: {e!r}"
        return res
    if not torch.cuda.is_available():
        res["skipped"] = "torch.cuda is not available"
        return res
    np, spec = wl.np, wl.spec
    x, _ = wl.inputs(tokens)
    W = wl.device_weights()
    ref = np.asarray(wl.ondev_forward(W, x).astype(wl.jnp.float32))
    x_np = np.asarray(x)
    del W, x
    A, B = wl.weights_np()

    def t_bf16(a):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)

    class FFN(torch.nn.Module):
        def __init__(self, a, b_):
            super().__init__()
            self.a = torch.nn.Parameter(a, requires_grad=False)
            self.b = torch.nn.Parameter(b_, requires_grad=False)

        def forward(self, h):
            return h + torch.nn.functional.gelu(h @ self.a, approximate="tanh") @ self.b

    model = torch.nn.Sequential(*[FFN(t_bf16(np.array(A[i])), t_bf16(np.array(B[i]))) for i in range(wl.L)])
    cuda = torch.device("cuda:0")
    cpu_offload(model, execution_device=cuda)
    xt = t_bf16(x_np).to(cuda)
    with torch.no_grad():
        for _ in range(spec.warmup + 1):
            model(xt)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        y = None
        for _ in range(spec.reps):
            y = None
            t = time.perf_counter()
            y = model(xt)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    y32 = y.float().cpu().numpy()
    res.update({"times_s": times, "median_ms": float(np.median(times)) * 1e3, "min_ms": min(times) * 1e3,
                "peak_bytes": int(torch.cuda.max_memory_allocated()),
                "peak_note": "torch.cuda.max_memory_allocated (torch allocator, not jax)",
                "torch_version": torch.__version__, "accelerate_version": accelerate.__version__,
                "rel_err": float(np.max(np.abs(y32 - ref)) / max(float(np.max(np.abs(ref))), 1e-30))})
    log(f"accelerate T={tokens}: median {res['median_ms']:.1f} ms, rel err {res['rel_err']:.2e}")
    return res
