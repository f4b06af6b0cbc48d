"""The README of ``benchmarks/hf_sweep.py``'s result: counts, the refusals grouped by reason, versions, the command
and the rows run again since (``--merge``), then every row."""
import re

#: what was found for the rows that are not exact (diagnosed by hand; the README prints it beside the row).
DIAGNOSIS: dict = {}

#: the refusals' reasons, grouped for the README: (what the model does, a pattern of its refusal's message).
REFUSAL_GROUPS = [
    ("decoder layers inside a child module of the base model (encoder-style layout)", r"encoder-style layout"),
    ("no list of decoder layer modules", r"no decoder layer list"),
    ("a layer argument the stages do not carry (complex rotary embeddings, a dict, a KV-sharing object)",
     r"a complex tensor|only tensors, tuples of tensors and constants"),
    ("a state carried from layer to layer besides the hidden state",
     r"state carried from layer to layer|computes with its decoder layers' outputs after the hidden state"),
    ("an output combined after the layers from states gathered over them", r"computes its output after the decoder"),
    ("data-dependent control flow in a layer's code", r"data-dependent control flow"),
    ("a layer run more than once, or skipped", r"calls to its \d+ decoder layers|skips \d"),
    ("weights shared between layers", r"weights shared between stages"),
    ("a config feature the stages leave out (dynamic RoPE, the auxiliary router loss)",
     r"rope_type 'dynamic'|output_router_logits"),
    ("a head computing more than the output embedding", r"outside its base model and output embedding"),
    ("the causal LM's forward after its base model fails on the last hidden state", r"fails after its base model"),
]


def _refusal_lines(results: list) -> list:
    """The README's table of the refused rows by reason (:data:`REFUSAL_GROUPS`, then any other)."""
    groups: dict = {}
    for r in results:
        if r["outcome"] == "refused":
            msg = r.get("message") or ""
            label = next((g for g, pat in REFUSAL_GROUPS if re.search(pat, msg)), "other")
            groups.setdefault(label, []).append(r["row"])
    if not groups:
        return []
    return ["| refused because of | rows |", "|---|---|"] + \
        [f"| {g} | {len(rows)}: {', '.join(f'`{x}`' for x in rows)} |" for g, rows in
         sorted(groups.items(), key=lambda kv: [g for g, _ in REFUSAL_GROUPS + [("other", "")]].index(kv[0]))] + [""]


def _reruns_lines(reruns: list) -> list:
    """The README's lines naming the rows run again into the result (``--merge --only``), by date."""
    if not reruns:
        return []
    return ["Rows run again since, on the code of that date, and merged into the result (the command above with",
            "`--merge --only ROW,...`):", ""] + [f"- {r['date']}: {', '.join(f'`{x}`' for x in r['rows'])}"
                                                  for r in reruns] + [""]


def write_readme(path: str, results: list, meta: dict, rel: float, loss_rel: float) -> None:
    """The committed summary at ``path``: counts, refusals by reason, versions, command, then every row (the exact
    ones in brief); ``rel`` / ``loss_rel``: the tolerances the rows were classed with."""
    counts = {k: sum(r["outcome"] == k for r in results) for k in ("exact", "refused", "wrong", "failing", "skipped")}
    lines = ["# Every transformers causal LM through `causal_lm_stages` (`benchmarks/hf_sweep.py`)", "",
             f"{meta['date']}, CPU, fp32. Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
             + ".", "", "Command (from the repository root, about " + f"{meta['minutes']:.0f} min on 2 shared cores):",
             "", "```bash", meta["command"], "```", ""] + _reruns_lines(meta.get("reruns", [])) + [
             "Per row: a small config (hidden 64, 4 layers or the family's layer pattern up to 8, 4 heads, vocab 512,",
             "intermediate 128, 4 experts top-2, sliding windows 4 < 12 tokens), a plain and a left-padded batch of 2:",
             "logits, `train_step` loss and the update of one `torch.optim.AdamW` step against torch eager",
             f"(exact: logits and update within rel {rel:g}, loss within {loss_rel:g}; entries whose torch gradient is",
             "below 1e-6 of the largest are left out of the update). Where a figure is off, torch in float64 arbitrates:",
             "the row is exact when the stack is within tolerance of float64 and torch fp32 is not (noted beside it).",
             "Refused: raised at construction by xla_swap's own code, naming the module and the feature. Variants",
             "(`family+variant`) add a config feature to a family. JSON: `hf_sweep.json`.", "",
             "| outcome | count |", "|---|---|"] + [f"| {k} | {v} |" for k, v in counts.items()] + \
        [f"| total | {len(results)} |", ""] + _refusal_lines(results)
    for kind in ("wrong", "failing", "refused", "skipped", "exact"):
        sel = [r for r in results if r["outcome"] == kind]
        if not sel:
            continue
        lines += [f"## {kind} ({len(sel)})", ""]
        for r in sel:
            if kind == "exact":
                m = r["max_rel"]
                note = f" ({r['note']})" if r.get("note") else ""
                lines.append(f"- `{r['row']}` ({r['class']}): logits {m['logits']:.1e}, update {m['update']:.1e}{note}")
            elif kind == "wrong":
                m = r["max_rel"]
                why = f" Cause: {DIAGNOSIS[r['row']]}." if r["row"] in DIAGNOSIS else ""
                lines.append(f"- `{r['row']}` ({r['class']}): logits {m['logits']:.1e}, loss {m['loss']:.1e}, update "
                             f"{m['update']:.1e} (worst parameter {m['worst_update'][0]}: {m['worst_update'][1]:.1e})."
                             + why)
            else:
                why = (r.get("message") or r.get("reason") or "").replace("\n", " ")
                lines.append(f"- `{r['row']}` ({r['class']}): {why[:600]}")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))
