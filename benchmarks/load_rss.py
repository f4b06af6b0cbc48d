"""Host memory of building a ``SwappedStack`` from a Hugging Face checkpoint, in a fresh process (CPU).

Two paths, each from the same ``save_pretrained`` checkpoint:

* ``meta``: ``with torch.device("meta"): model = Cls(config)``, then ``xla_swap.load_stack(model,
  checkpoint)``: the checkpoint is read one stage at a time into the stack's ``pinned_host`` buffers.
* ``full``: ``Cls.from_pretrained(checkpoint)`` (the whole model in torch), ``causal_lm_stages`` and
  ``SwappedStack``: the existing path, the user's model alive beside the stack. ``--release`` then
  frees the modules' storage (``model.to("meta")``) and reports what is left.

The peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` after the imports and
the jax client's start) minus the resident set at the reset is the growth; it is reported in bytes
and as a multiple of the weight bytes (parameters, each once, in the dtype held). Nothing is timed.
On the CPU the "device" is host memory too, so ``--train`` (one ``train_step``) adds the streamed
device copies, gradients and XLA's temporaries to the figure: the GPU's host RSS is lower.

    python -m benchmarks.load_rss CKPT --path meta --dtype bfloat16 --optimizer --out result.json
"""
from __future__ import annotations

import argparse
import gc
import json


def _status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _reset_peak() -> int:
    """Reset ``VmHWM`` to the current resident set (Linux ``clear_refs`` 5); returns that resident set."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status()["VmRSS"]


def measure(checkpoint: str, path: str, dtype: str = "float32", optimizer: bool = False, release: bool = False,
            train: bool = False, ids_file: str | None = None) -> dict:
    """Build the stack by ``path`` (``"meta"`` or ``"full"``) and return the figures (bytes, ratios).

    With ``ids_file`` (a ``torch.save`` of ``{"ids": LongTensor}``) the stack's logits on those ids
    are returned too (``"logits"``, a CPU tensor), for the caller to compare.
    """
    import jax
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import xla_swap
    from xla_swap._compat.torchax import import_torchax
    from xla_swap.stack import SwappedStack, causal_lm_stages
    jax.devices()
    import_torchax()
    tdtype = getattr(torch, dtype)
    cfg = AutoConfig.from_pretrained(checkpoint)
    base = _reset_peak()
    if path == "meta":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        model.eval()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5) if optimizer else None
        stack = xla_swap.load_stack(model, checkpoint, dtype=tdtype, optimizer=opt)
    elif path == "full":
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=tdtype).eval()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5) if optimizer else None
        first, layers, last = causal_lm_stages(model)
        stack = SwappedStack(layers, first=first, last=last, optimizer=opt)
    else:
        raise ValueError(f"path must be 'meta' or 'full', got {path!r}")
    jax.block_until_ready((stack.runtime.host_params, stack.runtime.optimizer_state))  # the copies are async
    gc.collect()
    after_build = _status()
    weight_bytes = sum(p.numel() * tdtype.itemsize for p in model.parameters())
    res = {"path": path, "dtype": dtype, "optimizer": optimizer, "weight_bytes": weight_bytes,
           "build_peak_bytes": after_build["VmHWM"] - base, "after_build_bytes": after_build["VmRSS"] - base}
    if release and path == "full":
        model.to("meta")
        gc.collect()
        res["after_release_bytes"] = _status()["VmRSS"] - base
    if ids_file is not None:
        ids = torch.load(ids_file)["ids"]
        res["logits"] = stack(ids)
    if train:
        ids = torch.randint(0, cfg.vocab_size, (1, 32))
        ce = lambda lg, y: torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), y.reshape(-1))
        stack.train_step(ids[:, :-1], ids[:, 1:], loss_fn=ce)
        stack.train_step(ids[:, :-1], ids[:, 1:], loss_fn=ce)
        gc.collect()
        st = _status()
        res["train_peak_bytes"], res["after_train_bytes"] = st["VmHWM"] - base, st["VmRSS"] - base
    for k in [k for k in res if k.endswith("_bytes") and k != "weight_bytes"]:
        res[k.replace("_bytes", "_x")] = round(res[k] / weight_bytes, 3)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--path", choices=("meta", "full"), required=True)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--optimizer", action="store_true", help="torch.optim.AdamW (moments in the weights' dtype)")
    ap.add_argument("--release", action="store_true", help="full path: model.to('meta') after the build")
    ap.add_argument("--train", action="store_true", help="two train_steps after the build (needs --optimizer)")
    ap.add_argument("--ids", default=None, help="torch.save file {'ids': LongTensor}: save the stack's logits")
    ap.add_argument("--out", default=None, help="write the figures as JSON (and logits to OUT.pt with --ids)")
    a = ap.parse_args(argv)
    res = measure(a.checkpoint, a.path, a.dtype, a.optimizer, a.release, a.train, a.ids)
    logits = res.pop("logits", None)
    print(json.dumps(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        if logits is not None:
            import torch
            torch.save({"logits": logits}, a.out + ".pt")


if __name__ == "__main__":
    main()
