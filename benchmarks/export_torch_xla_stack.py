#!/usr/bin/env python
"""Export the gpu_stack FFN stack lowered by torch_xla (on CPU) for the PJRT executor on the GPU.

The stack of ``benchmarks/gpu_stack/``: ``layer(h) = h + gelu(h @ a, tanh) @ b`` over
stacked weights ``w1 [L, D, F]``, ``w2 [L, F, D]``, written in torch and scanned with
``xla_swap.lowering.scan(layer, x, {"a": w1, "b": w2}, policy=OffloadPolicy(params="host"))``,
then lowered with ``emit_annotations(True)`` + ``lower_fn``: every iteration's weight slice
goes through ``annotate_device_placement`` (``_xla_buffer_placement="device"``), so the
module can run with the stacked weights in ``pinned_host`` memory. The GPU machine has no
torch_xla: it only loads the ``HloModuleProto`` and its JSON sidecar (the parameter table:
which entry parameter is w1, w2, x) and runs them with ``xla_swap.executors.PjrtExecutor``
(the ``torch_xla-lowered`` variant of ``python -m benchmarks.gpu_stack``).

Files, per token count T (``--out-dir``, default ``benchmarks/artifacts``)::

    torch_xla_stack_D{D}_F{F}_L{L}_{dtype}_T{T}.hlo.pb   serialized HloModuleProto (no weights inside)
    torch_xla_stack_D{D}_F{F}_L{L}_{dtype}_T{T}.json     sidecar: parameter table, roles, command

Weights are zeros for the export (they must be materialised device data so that they become
HLO parameters, not constants or graph producers): 2 * L * D * F elements of ``--dtype`` in
RAM while lowering (8 GiB for the full bf16 stack), freed afterwards.

Commands::

    # the committed artifacts (D=8192, F=32768, L=8, bf16, T=8192 and 32768; ~1 min, ~9 GiB RAM)
    PYTHONPATH=. PJRT_DEVICE=CPU .venv/bin/python benchmarks/export_torch_xla_stack.py
    # correctness check on CPU: tiny fp32 stack (D=256 F=512 L=4 T=64 unless given), random
    # weights, exported proto through PjrtExecutor with w1/w2 in pinned_host vs on-device jax
    PYTHONPATH=. PJRT_DEVICE=CPU .venv/bin/python benchmarks/export_torch_xla_stack.py --check
    # small artifacts for the CPU smoke test of benchmarks.gpu_stack (keep them out of the repo)
    PYTHONPATH=. PJRT_DEVICE=CPU .venv/bin/python benchmarks/export_torch_xla_stack.py \\
        --d 256 --f 512 --layers 4 --tokens 64 128 --out-dir /tmp/xla_swap_artifacts

This module imports torch / torch_xla only inside the functions that need them, so
``benchmarks.gpu_stack`` can import :func:`artifact_stem` and :func:`load_artifact` on a machine
with jax alone.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "artifacts"
DTYPES = ("bf16", "f32")
#: Artifacts above this size are refused: the weights must stay out of the module.
MAX_PROTO_BYTES = 1 << 20
LAYER_TEXT = "h + gelu(h @ a, approximate='tanh') @ b"
FULL = dict(d=8192, f=32768, layers=8, tokens=[8192, 32768], dtype="bf16")
CHECK = dict(d=256, f=512, layers=4, tokens=[64], dtype="f32")


def log(msg: str) -> None:
    print(f"[export {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- torch-free helpers
def artifact_stem(d: int, f: int, layers: int, dtype: str, tokens: int) -> str:
    """File name stem shared by the proto and its sidecar (all sizes in it)."""
    return f"torch_xla_stack_D{d}_F{f}_L{layers}_{dtype}_T{tokens}"


def load_artifact(out_dir, d: int, f: int, layers: int, dtype: str, tokens: int):
    """``(hlo_proto_bytes, sidecar dict)`` of one exported stack, or ``(None, reason)`` when missing/mismatched.

    Needs neither torch nor jax. The sidecar is checked against the requested sizes and the
    proto against the sidecar's sha256.
    """
    stem = artifact_stem(d, f, layers, dtype, tokens)
    pb, js = Path(out_dir) / f"{stem}.hlo.pb", Path(out_dir) / f"{stem}.json"
    if not pb.exists() or not js.exists():
        return None, (f"no torch_xla artifact {pb} (+ .json); export it on a machine with torch_xla: "
                      f"PYTHONPATH=. PJRT_DEVICE=CPU python benchmarks/export_torch_xla_stack.py --d {d} --f {f} "
                      f"--layers {layers} --tokens {tokens} --dtype {dtype} --out-dir {out_dir}")
    meta = json.loads(js.read_text())
    proto = pb.read_bytes()
    want = {"d": d, "f": f, "layers": layers, "dtype": dtype, "tokens": tokens}
    got = {k: meta.get(k) for k in want}
    if got != want:
        return None, f"sidecar {js} describes {got}, expected {want}"
    if hashlib.sha256(proto).hexdigest() != meta.get("sha256"):
        return None, f"{pb}: sha256 differs from its sidecar {js}"
    return proto, meta


# --------------------------------------------------------------------------- torch_xla side
def _torch_dtype(name: str):
    import torch
    return {"bf16": torch.bfloat16, "f32": torch.float32}[name]


def layer_fn(h, w):
    """One layer of the stack, the scan body: ``(carry, x) -> (carry, None)``."""
    import torch
    return h + torch.nn.functional.gelu(h @ w["a"], approximate="tanh") @ w["b"], None


def stack_policy():
    """The policy the stack is lowered with and run by: ``OffloadPolicy(params="host")``.

    The same object drives the lowering (:func:`lower_stack`) and the executor's placements
    (``PjrtExecutor.from_policy(proto, stack_policy(), weights=[roles["w1"], roles["w2"]])``).
    """
    from xla_swap.planning import OffloadPolicy
    return OffloadPolicy(params="host")


def lower_stack(w1, w2, x):
    """Lower ``scan(layer, x, {"a": w1, "b": w2}, policy=OffloadPolicy(params="host"))`` with annotations.

    Args:
      w1, w2: materialised XLA tensors ``[L, D, F]`` / ``[L, F, D]`` (captured parameters).
      x: materialised XLA tensor ``[T, D]`` (the input parameter).

    Returns:
      ``(lowered, roles)``: the :class:`xla_swap.lowering.LoweredComputation` and
      ``{"w1": id, "w2": id, "x": id}`` (HLO entry parameter ids).
    """
    from xla_swap.lowering import emit_annotations, lower_fn, scan

    policy = stack_policy()

    def forward(h):
        out, _ = scan(layer_fn, h, {"a": w1, "b": w2}, policy=policy)
        return out

    with emit_annotations(True):
        lowered = lower_fn(forward, x, name="torch_xla_ffn_stack")
    roles = {"w1": lowered.parameter_id(w1), "w2": lowered.parameter_id(w2), "x": lowered.parameter_id(x)}
    if sorted(roles.values()) != list(range(len(lowered.parameters))):
        raise RuntimeError(f"unexpected parameter table: roles {roles}\n{lowered.summary()}")
    return lowered, roles


def sidecar(lowered, roles, *, d, f, layers, tokens, dtype, command) -> dict:
    import torch
    import torch_xla

    by_id = {v: k for k, v in roles.items()}
    text = lowered.hlo_text
    return {
        "name": lowered.name, "d": d, "f": f, "layers": layers, "tokens": tokens, "dtype": dtype,
        "layer": LAYER_TEXT,
        "forward": "xla_swap.lowering.scan(layer, x, {'a': w1, 'b': w2}, policy=OffloadPolicy(params='host')), "
                   "lowered with emit_annotations(True) + lower_fn",
        "roles": roles,
        "params": [{"id": p.id, "role": by_id[p.id], "kind": p.kind, "shape": list(p.shape),
                    "dtype": str(p.dtype).replace("torch.", ""), "nbytes": p.nbytes, "sharding": p.sharding}
                   for p in lowered.parameters],
        "outputs": [{"shape": list(s), "dtype": str(dt).replace("torch.", "")}
                    for s, dt in zip(lowered.output_shapes, lowered.output_dtypes)],
        "annotate_device_placement": {
            "device": text.count('_xla_buffer_placement="device"'),
            "pinned_host": text.count('_xla_buffer_placement="pinned_host"')},
        "hlo_proto_bytes": len(lowered.hlo_proto),
        "sha256": hashlib.sha256(lowered.hlo_proto).hexdigest(),
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "torch_version": torch.__version__, "torch_xla_version": torch_xla.__version__,
    }


def _materialize(*tensors):
    import torch_xla
    torch_xla.sync()
    for t in tensors:
        if not torch_xla._XLAC._get_tensors_xla_device_data_node([t])[1]:
            raise RuntimeError(f"tensor {tuple(t.shape)} is not device data after torch_xla.sync()")


def export(args, command: str) -> list:
    """Export one proto + sidecar per token count; returns the written proto paths."""
    import gc

    import torch
    import torch_xla

    dev = torch_xla.device()
    dt = _torch_dtype(args.dtype)
    L, D, F = args.layers, args.d, args.f
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    w1 = torch.zeros(L, D, F, dtype=dt, device=dev)
    w2 = torch.zeros(L, F, D, dtype=dt, device=dev)
    _materialize(w1, w2)
    log(f"weights w1 {list(w1.shape)} w2 {list(w2.shape)} {args.dtype}: "
        f"{2 * w1.numel() * w1.element_size() / 2**30:.2f} GiB of zeros on {dev} in {time.perf_counter() - t0:.1f} s")
    written = []
    try:
        for T in args.tokens:
            t = time.perf_counter()
            x = torch.zeros(T, D, dtype=dt, device=dev)
            _materialize(x)
            lowered, roles = lower_stack(w1, w2, x)
            meta = sidecar(lowered, roles, d=D, f=F, layers=L, tokens=T, dtype=args.dtype, command=command)
            n = len(lowered.hlo_proto)
            if n >= MAX_PROTO_BYTES:
                raise RuntimeError(f"T={T}: the HloModuleProto is {n} bytes (>= {MAX_PROTO_BYTES}): weights or "
                                   "constants were baked into it")
            if meta["annotate_device_placement"]["device"] < 2:
                raise RuntimeError(f"T={T}: expected annotate_device_placement on both weight slices, HLO has "
                                   f"{meta['annotate_device_placement']}")
            stem = artifact_stem(D, F, L, args.dtype, T)
            (out_dir / f"{stem}.hlo.pb").write_bytes(lowered.hlo_proto)
            (out_dir / f"{stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
            if args.hlo_text:
                (out_dir / f"{stem}.hlo.txt").write_text(lowered.hlo_text)
            written.append(out_dir / f"{stem}.hlo.pb")
            log(f"T={T}: {out_dir / stem}.hlo.pb ({n} bytes), roles {roles}, "
                f"{meta['annotate_device_placement']} annotations, {time.perf_counter() - t:.1f} s")
            del lowered, x
    finally:
        del w1, w2
        gc.collect()
        torch_xla.sync()
    return written


# --------------------------------------------------------------------------- --check
def check(args, command: str) -> dict:
    """Export at the given (small) sizes with random weights, run through PjrtExecutor vs on-device jax.

    Writes the artifacts to ``--out-dir`` (a temporary directory unless given), reloads them
    with :func:`load_artifact` exactly as ``benchmarks.gpu_stack`` does, places w1/w2 in
    ``pinned_host`` and x on the device, and compares with the stack run by jax with every
    weight on the device. Raises ``AssertionError`` on a mismatch.
    """
    import numpy as np
    import torch
    import torch_xla
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from xla_swap.executors.pjrt import PjrtExecutor

    dev = torch_xla.device()
    dt = _torch_dtype(args.dtype)
    L, D, F = args.layers, args.d, args.f
    g = torch.Generator().manual_seed(0)
    w1_cpu = (torch.randn(L, D, F, generator=g) / D ** 0.5).to(dt)
    w2_cpu = (torch.randn(L, F, D, generator=g) * 0.5 / F ** 0.5).to(dt)
    w1, w2 = w1_cpu.to(dev), w2_cpu.to(dev)
    _materialize(w1, w2)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jdev = jax.devices()[0]
    DEV = SingleDeviceSharding(jdev, memory_kind="device")

    def to_np(t):
        return t.float().numpy().astype(jnp.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()

    ref_w = [(jax.device_put(to_np(w1_cpu[i]), DEV), jax.device_put(to_np(w2_cpu[i]), DEV)) for i in range(L)]

    @jax.jit
    def ref_layer(p, h):
        a, b = p
        return h + jax.nn.gelu(h @ a, approximate=True) @ b

    tol = 1e-5 if args.dtype == "f32" else 2e-2
    results = {}
    for T in args.tokens:
        x_cpu = torch.randn(T, D, generator=g).to(dt)
        x = x_cpu.to(dev)
        _materialize(x)
        lowered, roles = lower_stack(w1, w2, x)
        meta = sidecar(lowered, roles, d=D, f=F, layers=L, tokens=T, dtype=args.dtype, command=command)
        stem = artifact_stem(D, F, L, args.dtype, T)
        (out_dir / f"{stem}.hlo.pb").write_bytes(lowered.hlo_proto)
        (out_dir / f"{stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
        proto, meta = load_artifact(out_dir, D, F, L, args.dtype, T)
        assert proto is not None, meta
        r = meta["roles"]
        # the policy's placements: the stacked weights in pinned_host, everything else on the device
        exe = PjrtExecutor.from_policy(proto, stack_policy(), weights=[r["w1"], r["w2"]],
                                       parameters=len(r))
        values = [None] * exe.num_parameters
        values[r["w1"]], values[r["w2"]], values[r["x"]] = to_np(w1_cpu), to_np(w2_cpu), to_np(x_cpu)
        placed = exe.put_all(values)
        out = np.asarray(exe(*placed)[0]).astype(np.float32)
        h = jax.device_put(to_np(x_cpu), DEV)
        for p in ref_w:
            h = ref_layer(p, h)
        ref = np.asarray(h).astype(np.float32)
        rel = float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
        rep = exe.memory_report()
        kinds = [placed[i].sharding.memory_kind for i in range(exe.num_parameters)]
        compiled = exe.compiled_hlo_text()
        results[T] = {"rel_err": rel, "tol": tol, "roles": r, "arg_memory_kinds": kinds,
                      "compiled_param_spaces": list(rep.parameter_memory_spaces),
                      "device_temp_bytes": rep.device_temp_bytes, "proto_bytes": len(proto),
                      "compiled_annotations_left": compiled.count("annotate_device_placement")}
        log(f"check T={T}: rel err {rel:.2e} (tol {tol:g}); memory kinds {kinds}; compiled parameter spaces "
            f"{list(rep.parameter_memory_spaces)}; device temp {rep.device_temp_bytes} bytes")
        assert rel <= tol, f"T={T}: rel err {rel} > {tol}"
        for w in ("w1", "w2"):
            assert rep.parameter_memory_spaces[r[w]] == "pinned_host", (w, rep.parameter_memory_spaces)
            assert kinds[r[w]] == "pinned_host", (w, kinds)
        assert rep.parameter_memory_spaces[r["x"]] == "device"
        # torch_xla's scan also stacks its saved activations (ys [L, T, F], for a backward that
        # this forward never runs): the compiler must drop that dead loop output.
        assert f"[{L},{T},{F}]" not in compiled, f"T={T}: the compiled module keeps a [{L},{T},{F}] buffer"
        moved = float(np.max(np.abs(out - to_np(x_cpu).astype(np.float32))) / max(float(np.max(np.abs(ref))), 1e-30))
        assert moved > 1e-2, f"T={T}: the stack barely changed its input ({moved:.1e}): a vacuous check"
        del lowered, x
    del w1, w2
    torch_xla.sync()
    log("check passed")
    return results


# --------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d", type=int, default=None, help=f"model width (default {FULL['d']}; --check: {CHECK['d']})")
    p.add_argument("--f", type=int, default=None, help=f"FFN width (default {FULL['f']}; --check: {CHECK['f']})")
    p.add_argument("--layers", type=int, default=None,
                   help=f"layers L (default {FULL['layers']}; --check: {CHECK['layers']})")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help=f"token counts (default {FULL['tokens']}; --check: {CHECK['tokens']})")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help=f"weights/activations dtype (default {FULL['dtype']}; --check: {CHECK['dtype']})")
    p.add_argument("--out-dir", default=None,
                   help=f"where to write (default {DEFAULT_OUT.relative_to(REPO)}; --check: a temporary directory)")
    p.add_argument("--hlo-text", action="store_true", help="also write the HLO text next to each proto")
    p.add_argument("--check", action="store_true",
                   help="check on CPU: random weights, exported proto via PjrtExecutor (w1/w2 pinned_host) "
                        "vs on-device jax")
    args = p.parse_args(argv)
    defaults = CHECK if args.check else FULL
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k in ("d", "f", "layers"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be >= 1")
    if any(t < 1 for t in args.tokens):
        p.error("--tokens must be >= 1")
    return args


def main(argv=None) -> None:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    args = parse_args(argv)
    command = " ".join(["PYTHONPATH=. PJRT_DEVICE=CPU", "python"] + [shlex.quote(a) for a in
                                                                     [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]])
    if args.check:
        if args.out_dir is None:
            import tempfile
            with tempfile.TemporaryDirectory(prefix="torch_xla_stack_check_") as tmp:
                args.out_dir = tmp
                check(args, command)
        else:
            check(args, command)
        return
    if args.out_dir is None:
        args.out_dir = str(DEFAULT_OUT)
    export(args, command)


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    main()
