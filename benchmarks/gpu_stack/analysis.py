"""Analysis of a result: pure functions from the result JSON (dicts) to JSON (standard library and
``xla_swap.planning``'s pure-Python schedule only).

* :func:`predict_peak`: a row's predicted peak device bytes (the memory model of each kind).
* :func:`compute_floors`: per token count, the forward and training floors (milliseconds)
  from the bandwidth and the on-device compute rows; every timed row's ratio to its floor.
* :func:`evaluate_targets`: the targets (:class:`Targets`, data) met or missed, one verdict
  dict each; :func:`torch_xla_vs_jax`: the torch_xla-lowered / xla-in-graph comparison.

A result is ``{"meta": {...}, "bandwidth": {...} | None, "results": [row, ...], "floors": {...}}``
with times in milliseconds (``*_ms``) or seconds (``*_s``), bytes (``*_bytes``) and bandwidths
in GB/s (1e9 bytes per second).
"""
from __future__ import annotations

import dataclasses

from xla_swap.planning.prefetch import PrefetchSchedule

from ._util import GiB
from .variants import FLAG_SETS, base_name, compute_reference_names, lookup

__all__ = ["Targets", "DEFAULT_TARGETS", "predict_peak", "compute_floors", "evaluate_targets", "torch_xla_vs_jax",
           "targets_of"]


@dataclasses.dataclass(frozen=True)
class Targets:
    """What a run is judged against (the issue's targets), and on which rows.

    Attributes:
      forward: the best ``forward_rows`` median over the forward floor, at most.
      train: the best ``train_rows`` median over its training floor, at most.
      accelerate_speedup: HF accelerate's median over the best forward row's, at least.
      peak: ``|peak / predicted - 1|`` of every xla_swap row, at most.
      torch_xla: ``torch_xla-lowered / xla-in-graph - 1`` (medians), at most.
      forward_rows, train_rows: the rows the targets are judged on: xla_swap's execution paths.
    """

    forward: float = 1.03
    train: float = 1.10
    accelerate_speedup: float = 3.0
    peak: float = 0.10
    torch_xla: float = 0.02
    forward_rows: tuple = ("xla_swap-k2-chunked", "xla_swap-k3-chunked", "xla_swap-k2", "xla_swap-in-graph")
    train_rows: tuple = ("train-xla_swap-k2-saved-chunked", "train-xla_swap-k2-saved", "train-xla_swap-k2")

    def to_dict(self) -> dict:
        """JSON-ready dict (stored in a result's ``meta["targets"]``; row tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Targets":
        """The inverse of :meth:`to_dict`. Raises TypeError for an unknown key."""
        d = dict(d)
        for k in ("forward_rows", "train_rows"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)


DEFAULT_TARGETS = Targets()


def targets_of(data: dict) -> Targets:
    """The targets a result is judged against: its ``meta["targets"]``, else :data:`DEFAULT_TARGETS`
    (result files written before targets were stored)."""
    t = data["meta"].get("targets")
    return Targets.from_dict(t) if t else DEFAULT_TARGETS


def predict_peak(row: dict, layers: int) -> dict:
    """Predicted peak device bytes of a timed row (bytes in use before the call + the call's working set).

    * xla_swap streaming, throttled: the largest live set over the runtime's schedule: at each
      stage, the weights of the stages ``xla_swap.planning.PrefetchSchedule`` says are live there
      (the runtime's own schedule: at most k+1; the larger of a cold and a steady-state call; the
      gradients reuse the streamed weights' buffers by donation), the stage inputs and saved
      residuals kept so far (training), the stage's input and output (cotangents) and its
      executable's temporaries (``stage_temp_bytes``).
    * no throttle: not bounded by the runtime (``None``).
    * in-graph programs (xla-in-graph, xla_swap-in-graph, torch_xla-lowered, on-device-jit):
      XLA's own plan: compiled ``memory_analysis`` temporaries + output (+ device-resident
      weights for on-device-jit).
    * on-device loops: all weights (+ all gradients in training) + activations as above.

    Args:
      row: a result row with ``bytes_in_use_before``, ``activation_bytes``, ``weight_bytes``
        and, for streaming rows, the per-stage sizes (``stage_nbytes``, ``stage_input_nbytes``,
        ``stage_temp_bytes``, ``residual_nbytes``, ``prefetch_depth``, ``throttle``).
      layers: the number of layers L.

    Returns: ``{"predicted_peak_bytes": int | None, "predicted_note": str}``, or ``{}`` when
    nothing can be predicted (no memory stats, or a kind without a model).
    """
    before = row.get("bytes_in_use_before")
    if before is None:
        return {}
    v = lookup(row["variant"])
    if v is None:
        return {}
    h = row["activation_bytes"]
    W = row["weight_bytes"]
    train = v.train
    if row.get("group_member"):
        return {"predicted_peak_bytes": None, "predicted_note": "peak is the group's high-water mark"}
    if v.kind == "streaming":
        if not row.get("throttle", True):
            return {"predicted_peak_bytes": None, "predicted_note": "no throttle: not bounded"}
        k, sn = row["prefetch_depth"], row["stage_nbytes"]
        n = len(sn)
        ins, tf, tb = row["stage_input_nbytes"], row["stage_temp_bytes"]["forward"], row["stage_temp_bytes"]["backward"]
        outs = ins[1:] + [h]
        res_b = row["residual_nbytes"] if train else [0] * n
        resident = tuple(row.get("resident") or (False,) * n)
        weights: dict = {}  # (pass, stage) -> bytes of live stage weights, the larger of a cold and a steady call
        for steady in (False, True):
            for st in PrefetchSchedule(n, k, training=train, resident=resident, steady_state=steady).steps:
                key = (st.pass_name, st.stage)
                weights[key] = max(weights.get(key, 0), sum(sn[j] for j in st.live))
        steps = []  # (what, bytes) live while stage i runs, per the runtime's schedule
        for i in range(n):  # forward: live weights, kept inputs/residuals so far, in + out, temp
            kept = (sum(ins[:i + 1]) + sum(res_b[:i])) if train else ins[i]
            steps.append((f"forward {i}", weights[("forward", i)] + kept + outs[i] + res_b[i] + tf[i]))
        if train:
            for i in range(n - 1, -1, -1):  # backward: live weights (grads reuse i's), kept
                # inputs/residuals of stages <= i, cotangent in (outs[i]) and out (ins[i]), temp
                steps.append((f"backward {i}", weights[("backward", i)] + sum(ins[:i + 1]) + sum(res_b[:i + 1])
                              + outs[i] + ins[i] + tb[i]))
        what, work = max(steps, key=lambda t: t[1])
        return {"predicted_peak_bytes": before + work,
                "predicted_note": f"live set at {what}: {work / GiB:.2f} GiB (weights of the schedule's live "
                                  f"stages, at most k+1={k + 1}, activations, residuals, temporaries)"}
    if row.get("temp_bytes") is not None and v.kind != "on-device-loop":
        outb = row.get("output_bytes") or (h if not train else h + h + W)
        return {"predicted_peak_bytes": before + row["temp_bytes"] + outb,
                "predicted_note": "compiled temp + output"}
    if v.kind == "on-device-loop":
        # weights already in use before; activations: stage in/out; training: L+1 inputs + grads
        work = (2 * h) if not train else ((layers + 1) * h + W + 2 * h)
        work += row.get("layer_temp_bytes") or 0
        return {"predicted_peak_bytes": before + work, "predicted_note": "activations (+ gradients) + layer temp"}
    return {}


def compute_floors(data: dict) -> None:
    """Add ``data["floors"]`` and, to every timed row, ``floor_ms``, ``ratio`` (and
    ``phase_bound_ms`` / ``ratio_phase`` for training rows) and ``peak_over_predicted``.

    forward floor = max(compute, W / H2D), compute = the fastest forward compute reference
    (on-device-loop, on-device-jit); training floor = max(compute, 2W / H2D, W / D2H, 3W /
    both-ways): forward and backward each bring every layer in (2W), the gradients go out (W),
    and 3W cross the link while both directions run. Training compute: per-layer recompute
    rows use the faster of train-on-device and train-on-device-jit; ``saved`` rows (residuals
    kept, no recompute) use train-on-device-saved-jit: each family is held to the on-device
    time of the same algorithm. Bandwidths: the best of the run (``*_best_GBps``, else the
    median). In place; a pure function of ``data`` otherwise (calling it again gives the same).
    """
    bw = data.get("bandwidth") or {}
    h2d, d2h, both = (bw.get(k + "_best_GBps", bw.get(k + "_GBps")) for k in ("h2d", "d2h", "both"))
    W = data["meta"]["weight_bytes"]
    floors = {}
    by = {(r["variant"], r.get("tokens")): r for r in data["results"]}

    def fastest(t, names):
        got = [by[(v, t)]["median_ms"] for v in names if by.get((v, t), {}).get("median_ms") is not None]
        return min(got) if got else None

    for t in data["meta"]["tokens"]:
        f = {"compute_ms": fastest(t, compute_reference_names(train=False)),
             "h2d_ms": W / (h2d * 1e9) * 1e3 if h2d else None}
        f["forward_ms"] = max([v for v in (f["compute_ms"], f["h2d_ms"]) if v is not None], default=None)
        transfer = []
        if h2d:
            transfer.append(2 * W / (h2d * 1e9) * 1e3)
        if d2h:
            transfer.append(W / (d2h * 1e9) * 1e3)
        if both:
            transfer.append(3 * W / (both * 1e9) * 1e3)
        f["train_transfer_ms"] = max(transfer, default=None)
        f["train_compute_ms"] = fastest(t, compute_reference_names(train=True))
        f["train_saved_compute_ms"] = fastest(t, compute_reference_names(train=True, saved=True))
        for key, comp in (("train_ms", f["train_compute_ms"]), ("train_saved_ms", f["train_saved_compute_ms"])):
            f[key] = max(comp, f["train_transfer_ms"] or 0) if comp is not None else None
            # phase bound: the backward cannot start before the forward's last layer, whose
            # weights arrive after all W crossed H2D; then the backward computes and sends W
            # of gradients out: max(C_fwd, W/H2D) + max(C_train - C_fwd, W/D2H)
            cf = f["compute_ms"]
            if comp is not None and cf is not None and h2d and d2h:
                f[key.replace("_ms", "_phase_ms")] = (max(cf, W / (h2d * 1e9) * 1e3)
                                                      + max(comp - cf, W / (d2h * 1e9) * 1e3))
        floors[str(t)] = f
    data["floors"] = floors
    for r in data["results"]:
        if r.get("predicted_peak_bytes") and r.get("peak_bytes"):
            r["peak_over_predicted"] = r["peak_bytes"] / r["predicted_peak_bytes"]
        if "median_ms" not in r or r.get("tokens") is None:
            continue
        f = floors.get(str(r["tokens"]), {})
        v = lookup(r["variant"])
        if v is not None and v.train:
            key = "train_saved_ms" if v.saved else "train_ms"
            floor = f.get(key)
            phase = f.get(key.replace("_ms", "_phase_ms"))
            if phase:
                r["phase_bound_ms"] = phase
                r["ratio_phase"] = r["median_ms"] / phase
        else:
            floor = f.get("forward_ms")
        r["floor_ms"] = floor
        r["ratio"] = r["median_ms"] / floor if floor else None


def evaluate_targets(data: dict, targets: Targets | None = None) -> list[dict]:
    """The targets met or missed, from the best rows per token count (medians); run after
    :func:`compute_floors`. ``targets``: default :func:`targets_of` ``(data)``.

    Returns a list of verdict dicts, in report order, each with ``"target"`` and ``"bound"``:
      * ``"forward"`` / ``"train"``: per token count (``"tokens"``), the best row's ``"variant"``,
        ``"ratio"``, ``"median_ms"``, ``"ratio_phase"`` / ``"phase_bound_ms"`` (training, when
        known) and ``"met"``; ``"variant": None`` when no row has a ratio.
      * ``"forward_flag_search"``: per token count with flag-search rows of xla_swap-in-graph:
        the best of them (``"candidates"``: how many flag sets; the best of several noisy
        medians, so biased low) and ``"met"`` (within the forward bound).
      * ``"accelerate_speedup"``: ``"accelerate_ms"``, ``"xla_swap_ms"``, ``"speedup"``, ``"met"``.
      * ``"peak"``: the xla_swap row farthest from its prediction: ``"variant"``, ``"tokens"``,
        ``"peak_over_predicted"``, ``"met"``.
    """
    targets = targets or targets_of(data)
    by = {(r["variant"], r.get("tokens")): r for r in data["results"]}
    tokens = data["meta"]["tokens"]

    def best(names, t):
        rows = [by[(v, t)] for v in names if by.get((v, t), {}).get("ratio") is not None]
        return min(rows, key=lambda r: r["ratio"]) if rows else None

    out = []
    for target, names, bound in (("forward", targets.forward_rows, targets.forward),
                                 ("train", targets.train_rows, targets.train)):
        for t in tokens:
            r = best(names, t)
            v = {"target": target, "tokens": t, "bound": bound, "variant": None}
            if r is not None:
                v.update({"variant": r["variant"], "ratio": r["ratio"], "median_ms": r["median_ms"],
                          "met": r["ratio"] <= bound})
                if r.get("ratio_phase"):
                    v.update({"ratio_phase": r["ratio_phase"], "phase_bound_ms": r["phase_bound_ms"]})
            out.append(v)
    for t in tokens:
        r = best([f"xla_swap-in-graph@{f}" for f in FLAG_SETS], t)
        if r is not None:
            out.append({"target": "forward_flag_search", "tokens": t, "bound": targets.forward,
                        "variant": r["variant"], "ratio": r["ratio"], "median_ms": r["median_ms"],
                        "candidates": len(FLAG_SETS), "met": r["ratio"] <= targets.forward})
    acc = [r for r in data["results"] if r["variant"] == "accelerate" and r.get("median_ms")]
    if acc:
        t = acc[0]["tokens"]
        r = best(targets.forward_rows, t)
        if r is not None:
            sp = acc[0]["median_ms"] / r["median_ms"]
            out.append({"target": "accelerate_speedup", "tokens": t, "bound": targets.accelerate_speedup,
                        "accelerate_ms": acc[0]["median_ms"], "xla_swap_ms": r["median_ms"], "variant": r["variant"],
                        "speedup": sp, "met": sp >= targets.accelerate_speedup})
    judged = set(targets.forward_rows) | set(targets.train_rows)
    peaks = [r for r in data["results"] if r.get("peak_over_predicted") is not None
             and base_name(r["variant"]) in judged]
    if peaks:
        worst = max(peaks, key=lambda r: abs(r["peak_over_predicted"] - 1))
        out.append({"target": "peak", "bound": targets.peak, "variant": worst["variant"], "tokens": worst["tokens"],
                    "peak_over_predicted": worst["peak_over_predicted"],
                    "met": abs(worst["peak_over_predicted"] - 1) <= targets.peak})
    return out


def torch_xla_vs_jax(data: dict, targets: Targets | None = None) -> list[dict]:
    """torch_xla-lowered / xla-in-graph (JAX-lowered, same stacked pinned_host form) per token count
    where both rows exist: ``{"tokens", "ratio", "torch_xla_ms", "jax_ms", "min_ratio", "bound",
    "within"}``, or ``{"tokens", "na": why}`` when one has no timing (skipped, failed)."""
    targets = targets or targets_of(data)
    by = {(r["variant"], r.get("tokens")): r for r in data["results"]}
    out = []
    for t in data["meta"]["tokens"]:
        tx, jx = by.get(("torch_xla-lowered", t)), by.get(("xla-in-graph", t))
        if not tx or not jx:
            continue
        if tx.get("median_ms") is None or jx.get("median_ms") is None:
            why = (tx.get("skipped") or tx.get("error") or jx.get("skipped") or jx.get("error") or "no timing")
            out.append({"tokens": t, "na": why.strip().splitlines()[-1][:100]})
            continue
        ratio = tx["median_ms"] / jx["median_ms"]
        out.append({"tokens": t, "ratio": ratio, "torch_xla_ms": tx["median_ms"], "jax_ms": jx["median_ms"],
                    "min_ratio": tx["min_ms"] / jx["min_ms"], "bound": targets.torch_xla,
                    "within": ratio <= 1 + targets.torch_xla})
    return out
