"""Host memory of building (and training) a ``SwappedStack`` from a Hugging Face checkpoint, in a fresh
process (CPU). Resident memory is measured, nothing is timed.

Two paths, each from the same ``save_pretrained`` checkpoint:

* ``meta``: ``with torch.device("meta"): model = Cls(config)``, then ``xla_swap.load_stack(model,
  checkpoint)``: the checkpoint is read one stage at a time into the stack's ``pinned_host`` buffers.
* ``full``: ``Cls.from_pretrained(checkpoint)`` (the whole model in torch), ``causal_lm_stages`` and
  ``SwappedStack``: the user's model alive beside the stack. ``--release`` then frees the modules'
  storage (``model.to("meta")``) and reports what is left.

``--mixed``: ``param_dtype=torch.bfloat16`` (float32 master weights and moments, bf16 compute) from
the checkpoint read in float32.

Before the measured build, the same path builds (and with ``--train`` trains) a one-layer model of
the same class, its widths and vocabulary scaled down (``--no-warmup`` skips it):
imports, torchax's registrations and jax's one-time allocations then fall outside the figure, which
is what the model's size adds. The peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs``) minus the resident set at the reset is the growth; reported in bytes and
as multiples of the bf16 weight bytes (parameters, each once, at 2 bytes), next to the stack's
state (``host_params`` and ``optimizer_state`` bytes). The baseline is taken after ``malloc_trim``,
so that the measured build does not reuse memory the warm-up freed. On the CPU the "device" is host
memory too, so ``--train`` adds the streamed device copies, gradients and XLA's temporaries to the
figure (and glibc keeps freed ones: see ``trimmed_host_after_train``): a GPU host's RSS is lower.
``tests/hf/test_load_stack.py`` runs it for two model sizes and bounds the difference per
weight byte; ``docs/explanation/mixed-precision-and-host-memory.md`` has the figures.

    python -m benchmarks.load_rss CKPT --path meta --dtype bfloat16 --optimizer --out result.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile


def _status() -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon`` and ``RssFile`` of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _reset_peak() -> int:
    """Reset ``VmHWM`` to the current resident set (Linux ``clear_refs`` 5), after the collector and
    ``malloc_trim``; returns that resident set."""
    gc.collect()
    _malloc_trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status()["VmRSS"]


def _device_bytes() -> int:
    """Bytes of the live device-memory arrays whose buffers no ``pinned_host`` array shares (on the CPU
    a copy between memory kinds may alias)."""
    import jax

    def ptrs(a):
        return {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
    live = jax.live_arrays()
    host = set().union(*[ptrs(a) for a in live if a.sharding.memory_kind == "pinned_host"])
    seen, total = set(), 0
    for a in live:
        if a.sharding.memory_kind == "pinned_host":
            continue
        for s in a.addressable_shards:
            p = s.data.unsafe_buffer_pointer()
            if p not in host and p not in seen:
                seen.add(p)
                total += s.data.nbytes
    return total


def _malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: the free memory of every heap handed back to the system (``False``
    where the C library has none)."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def _small_config(cfg):
    """``cfg`` with one layer and its widths scaled down (the warm-up model: same class and code paths)."""
    small = cfg.__class__.from_dict(cfg.to_dict())
    heads, kv = getattr(cfg, "num_attention_heads", 1), getattr(cfg, "num_key_value_heads", None)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    small.num_hidden_layers = 1
    small.hidden_size = heads * min(head_dim, 16)
    if getattr(small, "head_dim", None):
        small.head_dim = min(head_dim, 16)
    if hasattr(small, "intermediate_size"):
        small.intermediate_size = 2 * small.hidden_size
    small.vocab_size = min(cfg.vocab_size, 256)
    if kv is not None:
        small.num_key_value_heads = kv
    return small


def _build(path, checkpoint, tdtype, optimizer, mixed, autotune):
    """``(model, stack)`` built by ``path`` from ``checkpoint``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import xla_swap
    from xla_swap.stack import SwappedStack, causal_lm_stages
    from torch.distributed.fsdp import MixedPrecisionPolicy
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)) if mixed else {}
    kw["autotune"] = xla_swap.AutotuneConfig(enabled=autotune)
    if path == "meta":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
        model.eval()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5) if optimizer else None
        stack = xla_swap.load_stack(model, checkpoint, dtype=tdtype, optimizer=opt, **kw)
    elif path == "full":
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=tdtype).eval()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5) if optimizer else None
        first, layers, last = causal_lm_stages(model)
        stack = SwappedStack(layers, first=first, last=last, optimizer=opt, **kw)
    else:
        raise ValueError(f"path must be 'meta' or 'full', got {path!r}")
    return model, stack


def _train(stack, vocab):
    import torch
    ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    ce = lambda lg, y: torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), y.reshape(-1))
    for _ in range(2):
        stack.train_step(ids[:, :-1], ids[:, 1:], loss_fn=ce)


def measure(checkpoint: str, path: str, dtype: str = "float32", optimizer: bool = False, release: bool = False,
            train: bool = False, ids_file: str | None = None, mixed: bool = False, warmup: bool = True,
            autotune: bool = True) -> dict:
    """Build the stack by ``path`` (``"meta"`` or ``"full"``) and return the figures (bytes, ratios).

    Figures: ``weight_bytes`` (bf16: 2 bytes a parameter), ``state_bytes`` (the stack's host weights
    and optimizer state), ``*_bytes`` growths of the resident set over the baseline and ``*_x`` the
    same over ``weight_bytes``. With ``train``: ``device_bytes``, the device-memory arrays alive after
    the steps (on the CPU inside the resident set, on a GPU not; buffers shared with ``pinned_host``
    arrays counted once); ``host_after_train``, ``after_train`` less them; and
    ``trimmed_host_after_train``, the same after glibc's ``malloc_trim(0)`` (the freed memory the
    allocator kept, handed back). ``autotune=False``: every stage streams
    (``SwappedStack(autotune=False)``, as for a model larger than the device), rather than the CPU's
    ample "device" holding stages. With ``ids_file`` (a ``torch.save`` of ``{"ids": LongTensor}``)
    the stack's logits on those ids are returned too (``"logits"``, a CPU tensor), computed after
    the figures are read.

    Raises: ValueError: ``path`` not ``"meta"`` / ``"full"``; ``mixed`` with a ``dtype`` other than float32.
    """
    import jax
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from xla_swap._compat.torchax import import_torchax
    if mixed and dtype != "float32":
        raise ValueError("mixed keeps float32 master weights: dtype must be 'float32'")
    jax.devices()
    import_torchax()
    tdtype = getattr(torch, dtype)
    cfg = AutoConfig.from_pretrained(checkpoint)
    if warmup:
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(_small_config(cfg)).float().save_pretrained(tmp)
            m, s = _build(path, tmp, tdtype, optimizer, mixed, autotune)
            if train:
                _train(s, min(cfg.vocab_size, 256))
            del m, s
    base = _reset_peak()
    model, stack = _build(path, checkpoint, tdtype, optimizer, mixed, autotune)
    jax.block_until_ready((stack.runtime.host_params, stack.runtime.optimizer_state))  # the copies are async
    gc.collect()
    after_build = _status()
    weight_bytes = sum(p.numel() * 2 for p in model.parameters())
    state_bytes = sum(v.nbytes for v in jax.tree_util.tree_leaves((stack.runtime.host_params, stack.runtime.optimizer_state))
                      if isinstance(v, jax.Array))
    res = {"path": path, "dtype": dtype, "mixed": mixed, "optimizer": optimizer, "warmup": warmup,
           "weight_bytes": weight_bytes, "state_bytes": state_bytes,
           "build_peak_bytes": after_build["VmHWM"] - base, "after_build_bytes": after_build["VmRSS"] - base}
    if release and path == "full":
        model.to("meta")
        gc.collect()
        res["after_release_bytes"] = _status()["VmRSS"] - base
    if train:
        _train(stack, cfg.vocab_size)
        gc.collect()
        st = _status()
        res["train_peak_bytes"], res["after_train_bytes"] = st["VmHWM"] - base, st["VmRSS"] - base
        res["device_bytes"] = _device_bytes()
        res["host_after_train_bytes"] = res["after_train_bytes"] - res["device_bytes"]
        if _malloc_trim():   # what the allocator keeps of freed memory, handed back
            res["trimmed_host_after_train_bytes"] = _status()["VmRSS"] - base - res["device_bytes"]
    for k in [k for k in res if k.endswith("_bytes") and k != "weight_bytes"]:
        res[k.replace("_bytes", "_x")] = round(res[k] / weight_bytes, 3)
    if ids_file is not None:   # after the figures: the forward's executables are not part of them
        res["logits"] = stack(torch.load(ids_file)["ids"])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--path", choices=("meta", "full"), required=True)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--mixed", action="store_true", help="param_dtype=torch.bfloat16 (float32 masters and moments)")
    ap.add_argument("--optimizer", action="store_true", help="torch.optim.AdamW (moments in the weights' dtype)")
    ap.add_argument("--release", action="store_true", help="full path: model.to('meta') after the build")
    ap.add_argument("--train", action="store_true", help="two train_steps after the build (needs --optimizer)")
    ap.add_argument("--no-autotune", action="store_true", help="SwappedStack(autotune=False): every stage streams")
    ap.add_argument("--no-warmup", action="store_true", help="measure from the first build (imports included)")
    ap.add_argument("--ids", default=None, help="torch.save file {'ids': LongTensor}: save the stack's logits")
    ap.add_argument("--out", default=None, help="write the figures as JSON (and logits to OUT.pt with --ids)")
    a = ap.parse_args(argv)
    res = measure(a.checkpoint, a.path, a.dtype, a.optimizer, a.release, a.train, a.ids, a.mixed, not a.no_warmup,
                  not a.no_autotune)
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
