#!/usr/bin/env python
"""Planner's predicted device bytes vs the PJRT executor's compiled memory report, on CPU.

What is lowered
---------------
One training step of the layer stack of ``examples/train_decoder.py`` (``layer_fn(cfg,
offload_name)``, the pre-LN decoder block): ``xla_swap.frontend.scan`` over the stacked weights
``init_params(cfg)["layers"]`` with a policy, loss ``(h_out ** 2).mean()``, outputs the loss and
the gradients of the six stacked weights. It is traced under ``emit_annotations(True)`` and
lowered with ``lower_fn`` (inputs: the carry ``h0 [B, S, D]`` and the stacked weights). No
embedding, unembedding or optimizer step: the planner's ``LayerCost`` (``layer_cost(cfg)``)
describes the layers only.

How it is compiled
------------------
``PjrtExecutor`` with the stacked weights in ``pinned_host`` when ``policy.params == "host"``.
The executor has no per-result placement argument, but it honours the result memory kinds of a
StableHLO module it is given (as for a JAX lowering): for ``policy.grads == "host"`` the
torch_xla ``HloModuleProto`` is converted to StableHLO (jaxlib's ``hlo_to_stablehlo``) and
``mhlo.memory_kind = "pinned_host"`` is set on the gradient results of ``@main``. The compiled
entry layout then carries ``S(5)`` on those results, and ``memory_report()`` counts them as
host output bytes.

What is compared, and why on one device
---------------------------------------
* predicted: ``evaluate(policy, replace(layer_cost(cfg), optimizer_bytes=0), cfg.layers)
  .device_bytes`` - the planner's forward/backward peak for the SAME policy. The optimizer state
  is zeroed because the lowered module has no optimizer step (for the planned policy it is on
  the host anyway, for the all-device policy it would add 12.6 MB that the module never holds);
  the unmodified ``evaluate(policy, layer_cost(cfg), cfg.layers)`` is recorded too.
* measured: ``MemoryReport.device_total_bytes`` = device arguments + device outputs - aliased +
  temporaries, bytes per device.

The planner predicts GLOBAL bytes of an unsharded program; under SPMD the report is PER DEVICE
of the partitioned program. Neither per-device bytes nor per-device x N equal global bytes when
some tensors are sharded and others replicated (the example shards the weights' last dimension,
its activations are partly replicated), so the comparison lowers the stack with unsharded
(replicated) weights; the executor then compiles it for one device (no tiled sharding, no
``num_partitions``), whose per-device report is the global figure. This holds whatever
``XLA_SWAP_NUM_DEVICES`` / ``CPU_NUM_DEVICES`` is. The SPMD rows (``--spmd``, weights sharded
like the example over all devices) are recorded for information only.

Decomposition (to explain the difference): every policy is also compiled with ``L // 2``
layers; ``(m(L) - m(L/2)) / (L - L/2)`` is the per-layer device bytes and ``m(L) - L x
per-layer`` the layer-count-independent part, for measured and predicted bytes alike.
Host bytes (weights in pinned_host arguments, gradients in pinned_host outputs) are compared
with the planner's ``host_components``.

What the CPU compiler does with the annotations (jaxlib 0.10.2, measured)
-------------------------------------------------------------------------
* ``strip-memory-placement-annotations`` (pipeline ``pre-spmd-partitioner``) deletes every
  ``annotate_device_placement`` custom call before anything else (18 in the lowered planned
  module, 0 after the pass; reproduce with ``XLA_FLAGS="--xla_dump_to=DIR
  --xla_dump_hlo_pass_re=.*"``). There is no host-offloader, no memory-space assignment and no
  async copy (no ``copy-start``/``copy-done``) on CPU.
* The entry layout keeps ``S(5)`` on the pinned_host parameters and results, but host and
  device memory are one address space: the per-layer ``dynamic-slice`` of a stacked weight is
  fused into its consumer (or copied as one matrix slice) straight from the ``S(5)`` buffer, and
  the gradient ``dynamic-update-slice`` writes into the ``S(5)`` result in place. So the
  planner's streaming buffers - a window of ``prefetch_depth + 1`` layers of weights and one
  layer's gradient in flight - exist on CPU only as incidental one-matrix slices: there the
  measurement is LOWER than an accelerator's would be.
* Named activations offloaded inside the while loop are not a factor for the planned policy
  (``ffn_act`` is rematerialised). Note, front end: with ``remat=True`` and ``ffn_act`` placed
  ``"host"``, ``policy_partition`` inserts the host copy but its ``place_to_device`` has no user
  (the backward reads ``ffn_act`` through the view ``f.view(B*S, 4D)`` that the forward's matmul
  also uses, which is not redirected), so ``ffn_act`` is recomputed and nothing is offloaded: no
  pinned_host annotation of its shape in the lowered HLO, the same temp bytes as ``"remat"``.
  The benchmark does not use such a policy.
* ``peak_memory_in_bytes`` of the CPU client is arguments + outputs only (temporaries are not
  in it); it is recorded, not used.

Run (about a minute on 2 cores)::

    .venv/bin/python benchmarks/planner_vs_pjrt.py --spmd 4

writes ``benchmarks/results/planner_vs_pjrt.{json,md}``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _setup_env(num_devices: int) -> None:
    """Virtual CPU devices for torch_xla and jax; must run before either is imported."""
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["CPU_NUM_DEVICES"] = str(num_devices)
    flag = f"--xla_force_host_platform_device_count={num_devices}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _train_decoder():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_decoder
    return train_decoder


# --------------------------------------------------------------------------------------- policies

def policies(cfg) -> dict:
    """``{name: OffloadPolicy}``: the planner's policy for the example's budget, the all-device
    policy, and the planned placement without recomputation (isolates the recompute buffer)."""
    from xla_swap.planning import OffloadPolicy
    td = _train_decoder()
    planned = td.planned_policy(cfg)[0].policy
    no_remat = dataclasses.replace(planned, remat=False,
                                   activations={n: "device" for n in planned.activations})
    return {"planned": planned, "all-device": OffloadPolicy(), "planned, no remat": no_remat}


def predict(cfg, policy):
    """The planner's forward/backward prediction for ``policy``: ``(plan, plan_with_optimizer)``.

    ``plan`` evaluates ``layer_cost(cfg)`` with ``optimizer_bytes=0`` (the lowered step has no
    optimizer); ``plan_with_optimizer`` is the unmodified ``evaluate(policy, layer_cost(cfg), L)``.
    """
    from xla_swap.planning import evaluate
    td = _train_decoder()
    cost = td.layer_cost(cfg)
    fb = evaluate(policy, dataclasses.replace(cost, optimizer_bytes=0), cfg.layers)
    assert fb.peak_phase == "forward/backward", fb.peak_phase
    return fb, evaluate(policy, cost, cfg.layers)


# --------------------------------------------------------------------------------------- lowering

def stacked_weights(cfg, shard: bool = False) -> dict:
    """The example's stacked layer weights on the XLA device, ``{name: [L, ...]}``.

    ``shard=True`` shards them like ``train_decoder.train``: 3-D weights whose last dimension
    divides by the device count over mesh axis ``model`` on that dimension.
    """
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    td = _train_decoder()
    dev = torch_xla.device()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("model",)) if shard else None
    out = {}
    for k, v in td.init_params(cfg)["layers"].items():
        t = v.to(dev)
        if shard and t.dim() == 3 and t.shape[-1] % n == 0:
            xs.mark_sharding(t, mesh, (None, None, "model"))
        out[k] = t
    return out


def lower_train_step(cfg, policy, weights: dict):
    """Lower loss + gradients of the stacked weights for one step of the layer scan.

    Returns ``(lowered, weight_param_ids)``: the ``LoweredComputation`` (outputs: loss, then
    the gradients in ``sorted(weights)`` order) and the HLO parameter ids of the weights.
    """
    import torch
    import torch_xla
    from xla_swap.frontend import emit_annotations, lower_fn, offload_name, scan
    td = _train_decoder()
    names = sorted(weights)
    block = td.layer_fn(cfg, offload_name)

    def step(h, *ws):
        h = h.requires_grad_(True)
        ws = [w.requires_grad_(True) for w in ws]
        with torch.enable_grad():
            out, _ = scan(block, h, dict(zip(names, ws)), policy=policy)
            loss = (out ** 2).mean()
            grads = torch.autograd.grad(loss, ws)
        return (loss.detach(), *grads)

    g = torch.Generator().manual_seed(cfg.seed + 1)
    h0 = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g).to(torch_xla.device())
    with emit_annotations(True):
        lowered = lower_fn(step, h0, *[weights[k] for k in names])
    return lowered, [lowered.parameter_id(weights[k]) for k in names]


def with_result_memory_kinds(hlo_proto: bytes, kinds: dict) -> str:
    """StableHLO text of ``hlo_proto`` with ``mhlo.memory_kind`` set on results ``{index: kind}``
    (other result attributes, e.g. ``mhlo.sharding``, kept). ``PjrtExecutor`` compiles a
    StableHLO module's result memory kinds into the entry layout (``S(5)`` for pinned_host)."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir
    text = xc._xla.mlir.hlo_to_stablehlo(hlo_proto)
    with jmlir.make_ir_context():
        mod = ir.Module.parse(text)
        main = next(op for op in mod.body.operations if op.operation.name == "func.func"
                    and ir.StringAttr(op.attributes["sym_name"]).value == "main")
        n = len(ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).results)
        old = list(ir.ArrayAttr(main.attributes["res_attrs"])) if "res_attrs" in main.attributes else []
        attrs = []
        for i in range(n):
            entries = {}
            if i < len(old):
                d = ir.DictAttr(old[i])
                entries = {d[j].name: d[j].attr for j in range(len(d))}
            if i in kinds:
                entries["mhlo.memory_kind"] = ir.StringAttr.get(kinds[i])
            attrs.append(ir.DictAttr.get(entries))
        main.attributes["res_attrs"] = ir.ArrayAttr.get(attrs)
        return str(mod)


def compile_step(lowered, weight_ids, policy):
    """``PjrtExecutor`` for the lowered step: weights in pinned_host when ``policy.params ==
    "host"``, gradient results (1..) in pinned_host when ``policy.grads == "host"``."""
    from xla_swap.executors import ParameterPlacement, PjrtExecutor
    host = set(weight_ids) if policy.params == "host" else set()
    placements = {p.id: ParameterPlacement("pinned_host" if p.id in host else "device", p.sharding)
                  for p in lowered.parameters}
    module = lowered.hlo_proto
    if policy.grads == "host":
        module = with_result_memory_kinds(module, {i: "pinned_host" for i in range(1, 1 + len(weight_ids))})
    return PjrtExecutor(module, placements=placements)


def compiler_facts(exe) -> dict:
    """What the compiled module shows about host offloading."""
    text = exe.compiled_hlo_text()
    rep = exe.memory_report()
    return {
        "annotate_device_placement_after_compile": text.count("annotate_device_placement"),
        "async_copies": len(re.findall(r"copy-start|copy-done", text)),
        "pinned_host_parameters": rep.parameter_memory_spaces.count("pinned_host"),
        "pinned_host_results": rep.output_memory_spaces.count("pinned_host"),
        "peak_memory_in_bytes_cpu_client": rep.raw_stats.get("peak_memory_in_bytes"),
    }


# --------------------------------------------------------------------------------------- measuring

def measure(cfg, policy, shard: bool = False) -> dict:
    """Lower, compile and compare one (config, policy). Bytes; per device for ``shard=True``."""
    t0 = time.time()
    w = stacked_weights(cfg, shard)
    lowered, wids = lower_train_step(cfg, policy, w)
    exe = compile_step(lowered, wids, policy)
    rep = exe.memory_report()
    fb, full = predict(cfg, policy)
    out_grads = list(range(1, 1 + len(wids)))
    return {
        "layers": cfg.layers, "num_devices": rep.num_devices,
        "predicted_device_bytes": fb.device_bytes,
        "predicted_device_bytes_with_optimizer": full.device_bytes,
        "predicted_components": dict(fb.device_components),
        "predicted_host_params_bytes": fb.host_components["params"],
        "predicted_host_grads_bytes": fb.host_components["grads"],
        "measured_device_bytes": rep.device_total_bytes,
        "measured": {"device_argument": rep.device_argument_bytes, "device_output": rep.device_output_bytes,
                     "device_temp": rep.device_temp_bytes, "device_alias": rep.device_alias_bytes,
                     "host_argument": rep.host_argument_bytes, "host_output": rep.host_output_bytes},
        "ratio": fb.device_bytes / rep.device_total_bytes,
        "weight_memory_spaces": sorted({rep.parameter_memory_spaces[i] for i in wids}),
        "grad_memory_spaces": sorted({rep.output_memory_spaces[i] for i in out_grads}),
        "compiler": compiler_facts(exe),
        "seconds": round(time.time() - t0, 2),
        "_report": rep, "_weight_ids": wids,
    }


def decompose(cfg, policy, full_row: dict) -> dict:
    """Per-layer and layer-count-independent device bytes, measured and predicted (L vs L // 2)."""
    half = dataclasses.replace(cfg, layers=cfg.layers // 2)
    h = measure(half, policy)
    dl = cfg.layers - half.layers
    out = {}
    for key in ("measured_device_bytes", "predicted_device_bytes"):
        per = (full_row[key] - h[key]) / dl
        out[key.split("_")[0]] = {"per_layer": per, "constant": full_row[key] - cfg.layers * per}
    return out


def public(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("_")}


# --------------------------------------------------------------------------------------- output

def markdown(results: dict, command: str) -> str:
    lines = ["## planner vs PJRT executor: device bytes of one training step of the layer stack (CPU)", "",
             f"command: `{command}`", "",
             f"jax {results['versions']['jax']}, torch_xla {results['versions']['torch_xla']}, "
             f"{results['date']}; predicted = `evaluate(policy, layer_cost(cfg) with optimizer_bytes=0, L)`"
             " (forward/backward peak, global bytes); measured = `memory_report().device_total_bytes` "
             "(arguments + outputs - alias + temp) of the unsharded module compiled for 1 device "
             "(= global bytes).", "",
             "| config | policy | predicted bytes | measured bytes | ratio | per layer pred / meas | "
             "constant pred / meas | host pred / meas |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        d = r["decomposition"]
        hp = r["predicted_host_params_bytes"] + r["predicted_host_grads_bytes"]
        hm = r["measured"]["host_argument"] + r["measured"]["host_output"]
        lines.append(f"| {r['config_name']} | {r['policy_name']} | {r['predicted_device_bytes']} | "
                     f"{r['measured_device_bytes']} | {r['ratio']:.3f} | "
                     f"{d['predicted']['per_layer']:.0f} / {d['measured']['per_layer']:.0f} | "
                     f"{d['predicted']['constant']:.0f} / {d['measured']['constant']:.0f} | {hp} / {hm} |")
    lines += ["", "Policies: " + "; ".join(f"`{k}` = `{v}`" for k, v in results["policies"].items()), ""]
    if results.get("spmd"):
        lines += ["SPMD, for information only (weights sharded like the example; bytes per device; "
                  "not comparable with global predictions):", "",
                  "| config | policy | devices | predicted (global) | measured per device | x devices | "
                  "ratio to per-device x devices |", "|---|---|---|---|---|---|---|"]
        for r in results["spmd"]:
            n = r["num_devices"]
            lines.append(f"| {r['config_name']} | {r['policy_name']} | {n} | {r['predicted_device_bytes']} | "
                         f"{r['measured_device_bytes']} | {n * r['measured_device_bytes']} | "
                         f"{r['predicted_device_bytes'] / (n * r['measured_device_bytes']):.3f} |")
        lines.append("")
    lines += ["### Findings", ""] + [f"- {f}" for f in results["findings"]]
    return "\n".join(lines) + "\n"


def findings(rows: list) -> list:
    by = {(r["config_name"], r["policy_name"]): r for r in rows}
    out = []
    ex = by[("example Config()", "planned")]
    nr = by[("example Config()", "planned, no remat")]
    ad = by[("example Config()", "all-device")]
    td = _train_decoder()
    cost = td.layer_cost(td.Config())
    out.append(
        f"Host bytes agree exactly: the stacked weights are pinned_host arguments and, with grads='host', the "
        f"gradients pinned_host results ({ex['measured']['host_argument']} + {ex['measured']['host_output']} bytes "
        f"= the planner's host params + grads).")
    out.append(
        f"Per-layer device bytes of the planned policy agree exactly: measured "
        f"{ex['decomposition']['measured']['per_layer']:.0f} = predicted "
        f"{ex['decomposition']['predicted']['per_layer']:.0f} bytes/layer (one saved layer input, the carry).")
    rec = (by[("example Config()", "planned")]["decomposition"]["measured"]["constant"]
           - nr["decomposition"]["measured"]["constant"])
    out.append(
        f"Planner modelling gap (recomputation): with remat the layer being back-propagated holds its recomputed "
        f"intermediates next to its gradient working set. Measured, the layer-count-independent part grows by "
        f"{rec:.0f} bytes from 'planned, no remat' to 'planned'; the planner predicts the same constant "
        f"({ex['decomposition']['predicted']['constant']:.0f}) for both (remat frees L, not L-1, layers' "
        f"intermediates in its model). Not changed in planner.py: any recompute term moves the hard-coded budget "
        f"thresholds of tests/test_planner.py (e.g. 54.125 -> 54.625 GiB for the design stack).")
    meas_inter = ad["decomposition"]["measured"]["per_layer"] - 2 * cost.param_bytes - cost.carry_bytes
    declared = sum(cost.activations.values()) + cost.intermediate_bytes
    out.append(
        f"Input gap (examples/train_decoder.py layer_cost): without remat the scan saves {meas_inter:.0f} bytes of "
        f"intermediates per layer (all-device per-layer slope minus weights, gradients and carry) against "
        f"{declared} declared (ffn_act + intermediate_bytes), x{meas_inter / declared:.2f}: the all-device ratio "
        f"({ad['ratio']:.3f}) is mostly this.")
    out.append(
        f"CPU compiler: annotate_device_placement calls left after compiling: "
        f"{ex['compiler']['annotate_device_placement_after_compile']}; async copies: {ex['compiler']['async_copies']}"
        f" (strip-memory-placement-annotations removes them; no host offloader). The S(5) weights are read and the "
        f"S(5) gradients written in place, so the planner's window of prefetch_depth+1 layers of weights plus one "
        f"layer's gradient ({ex['predicted_components']['params'] + ex['predicted_components']['grads']} bytes here) "
        f"has no counterpart beyond incidental one-matrix slices: on CPU this part of the prediction is an "
        f"overestimate that partly hides the two gaps above.")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spmd", type=int, default=4, help="also compile sharded over this many devices (0: skip)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    _setup_env(max(args.spmd, 1))
    import jax
    import torch_xla
    import torch_xla.runtime as xr
    xr.use_spmd()
    import logging
    logging.getLogger("xla_swap").setLevel(logging.ERROR)
    td = _train_decoder()
    configs = {"example Config()": td.Config(), "small (4x64, seq 32, batch 4)": td.Config(layers=4, dim=64, seq=32,
                                                                                          batch=4)}
    rows, pol_names = [], {}
    print(f"{'config':34} {'policy':18} {'predicted':>12} {'measured':>12} {'ratio':>7}")
    for cname, cfg in configs.items():
        for pname, pol in policies(cfg).items():
            r = measure(cfg, pol)
            r["decomposition"] = decompose(cfg, pol, r)
            r.update(config_name=cname, config=dataclasses.asdict(cfg), policy_name=pname, policy=str(pol))
            pol_names[f"{pname} ({cname})"] = str(pol)
            rows.append(public(r))
            print(f"{cname:34} {pname:18} {r['predicted_device_bytes']:>12} {r['measured_device_bytes']:>12} "
                  f"{r['ratio']:>7.3f}")
    spmd = []
    if args.spmd > 1:
        cfg = td.Config()
        for pname, pol in list(policies(cfg).items())[:2]:
            r = measure(cfg, pol, shard=True)
            r.update(config_name="example Config()", policy_name=pname, policy=str(pol))
            spmd.append(public(r))
            print(f"SPMD {r['num_devices']} devices {pname:18} predicted {r['predicted_device_bytes']} measured/device "
                  f"{r['measured_device_bytes']} (x{r['num_devices']} = {r['num_devices'] * r['measured_device_bytes']})")
    command = " ".join([".venv/bin/python", os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])])
    results = {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "versions": {"jax": jax.__version__, "torch_xla": torch_xla.__version__},
               "policies": pol_names, "rows": rows, "spmd": spmd, "findings": findings(rows)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_vs_pjrt.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "planner_vs_pjrt.md").write_text(markdown(results, command))
    print("\n".join(results["findings"]))
    print(f"saved {out / 'planner_vs_pjrt.json'} and {out / 'planner_vs_pjrt.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
