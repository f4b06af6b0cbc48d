#!/usr/bin/env python
"""A named activation offloaded under SPMD, run through the PJRT executor.

Two steps, two processes (the GPU machine has no torch_xla):

* ``export DIR --devices N`` (torch_xla, CPU): lowers one training step of a residual scan,
  ``a = offload_name(tanh(h @ W_a[i]), "act"); h = h + a @ W_b[i]``, loss ``(h**2).sum() + a.sum()``,
  weights ``[L, D, D]`` sharded ``(None, "x", "y")`` over an ``(N/2, 2)`` mesh (``(1, 1)`` on one
  device), ``h`` ``[B, D]`` replicated, with the activation offloaded
  (``OffloadPolicy(activations={"act": "host"})``: the named activation's annotations are
  ``MoveToHost`` / ``MoveToDevice`` with no sharding) and with nothing offloaded; writes both
  ``HloModuleProto`` files and their parameter values (``<name>.hlo.pb``, ``<name>.npz``) to DIR.
* ``check DIR [--out FILE]`` (jax only, any backend): compiles both modules with
  :class:`xla_swap.executors.PjrtExecutor` on the first N devices, runs them on their saved
  parameters and writes JSON: the largest absolute difference of each output, the collectives
  in each compiled (partitioned) module, the annotation custom calls left after compiling, and
  the host memory-space (``S(5)``) and ``copy-start`` counts of the compiled text (the host
  offloader's work on an accelerator; XLA:CPU strips the annotations). Exit status 1 when the
  outputs differ by more than ``--tol`` or the offloaded module has more collectives of
  some kind than the other.

Run (here, then on the GPU machine)::

    PJRT_DEVICE=CPU python -m benchmarks.activation_offload_spmd export benchmarks/artifacts/act_offload_n2 --devices 2
    PYTHONPATH=. python3 benchmarks/activation_offload_spmd.py check benchmarks/artifacts/act_offload_n2 \\
        --out benchmarks/results/activation_offload_spmd.json

``tests/benchmarks_on_cpu/test_activation_offload_spmd_cpu.py`` runs both steps on the virtual CPU devices.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

NAMES = ("offloaded", "on_device")
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def export(out_dir: Path, devices: int, layers: int, batch: int, width: int) -> dict:
    """Lower both steps with torch_xla on ``devices`` virtual CPU devices; write them to ``out_dir``."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ["CPU_NUM_DEVICES"] = str(devices)
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    from xla_swap.lowering import emit_annotations, lower_fn, offload_name, scan
    from xla_swap.planning import OffloadPolicy

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    if n != devices:
        raise RuntimeError(f"--devices {devices}: torch_xla sees {n} devices (set CPU_NUM_DEVICES before import)")
    y = 2 if n % 2 == 0 else 1
    mesh = xs.Mesh(np.arange(n), (n // y, y), ("x", "y"))
    dev = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    W = {}
    for k in "ab":
        W[k] = (torch.randn(layers, width, width, generator=g) * (0.5 / width ** 0.5)).to(dev)
        xs.mark_sharding(W[k], mesh, (None, "x", "y"))
    h0 = torch.randn(batch, width, generator=g)

    def body(h, w):
        a = offload_name(torch.tanh(h @ w["a"]), "act")
        return h + a @ w["b"], a.sum(0)

    def step(h, a, b, policy):
        h, a, b = h.requires_grad_(True), a.requires_grad_(True), b.requires_grad_(True)
        with torch.enable_grad():
            out, ys = scan(body, h, {"a": a, "b": b}, policy=policy)
            return (out, *torch.autograd.grad((out ** 2).sum() + ys.sum(), [h, a, b]))

    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"devices": n, "mesh": [n // y, y], "layers": layers, "batch": batch, "width": width, "modules": {}}
    for name, policy in zip(NAMES, (OffloadPolicy(activations={"act": "host"}), OffloadPolicy())):
        with emit_annotations(True):
            low = lower_fn(lambda h, a, b: step(h, a, b, policy), h0.to(dev), W["a"], W["b"])
        (out_dir / f"{name}.hlo.pb").write_bytes(low.hlo_proto)
        np.savez(out_dir / f"{name}.npz", *[p.tensor.detach().cpu().numpy() for p in low.parameters])
        meta["modules"][name] = {
            "parameters": len(low.parameters),
            "annotations": {t: low.hlo_text.count(f'custom_call_target="{t}"')
                            for t in ("annotate_device_placement", "MoveToHost", "MoveToDevice")}}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def count_collectives(hlo: str) -> dict:
    """Collective instructions (sync or async start) in an HLO module's text, by opcode."""
    return {op: len(re.findall(rf"= [^\n]*\b{op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def check(in_dir: Path, tol: float) -> dict:
    """Compile and run both exported modules with the PJRT executor; compare; count collectives."""
    import jax
    import numpy as np

    from xla_swap.executors import PjrtExecutor

    meta = json.loads((in_dir / "meta.json").read_text())
    result = {"export": meta, "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
              "jax": jax.__version__, "modules": {}}
    outs = {}
    for name in NAMES:
        exe = PjrtExecutor((in_dir / f"{name}.hlo.pb").read_bytes(), devices=jax.devices()[:meta["devices"]])
        with np.load(in_dir / f"{name}.npz") as z:
            values = [z[f"arr_{i}"] for i in range(len(z.files))]
        outs[name] = [np.asarray(o) for o in exe(*exe.put_all(values))]
        text = exe.compiled_hlo_text()
        result["modules"][name] = {
            "collectives": count_collectives(text),
            "annotations_left": {t: text.count(f'custom_call_target="{t}"')
                                 for t in ("annotate_device_placement", "MoveToHost", "MoveToDevice")},
            "host_memory_space_S5": text.count("S(5)"),
            "copy_start": len(re.findall(r"= [^\n]*\bcopy-start\(", text))}
    diffs = [float(np.max(np.abs(a - b))) if a.size else 0.0 for a, b in zip(outs["offloaded"], outs["on_device"])]
    result["max_abs_diff"] = diffs
    result["tol"] = tol
    m = result["modules"]
    result["ok"] = bool(max(diffs) <= tol and all(
        m["offloaded"]["collectives"][op] <= m["on_device"]["collectives"][op] for op in COLLECTIVES))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="lower both steps with torch_xla (CPU)")
    e.add_argument("dir", type=Path)
    e.add_argument("--devices", type=int, default=2)
    e.add_argument("--layers", type=int, default=4)
    e.add_argument("--batch", type=int, default=64)
    e.add_argument("--width", type=int, default=128)
    c = sub.add_parser("check", help="compile and run both with the PJRT executor (jax only)")
    c.add_argument("dir", type=Path)
    c.add_argument("--out", type=Path)
    c.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args(argv)
    if args.cmd == "export":
        for k in ("devices", "layers", "batch", "width"):
            if getattr(args, k) < 1:
                p.error(f"--{k} must be >= 1")
        print(json.dumps(export(args.dir, args.devices, args.layers, args.batch, args.width)))
        return 0
    result = check(args.dir, args.tol)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
