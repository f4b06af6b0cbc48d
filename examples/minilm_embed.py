"""Main job: embed real sentences with all-MiniLM-L6-v2, its 6 encoder layers run as a scan.

torch_xla under SPMD on 4 virtual CPU devices, the stacked layer weights sharded over the
mesh axis ``model``. The encoder is lowered with xla_swap's LoweringContext wrapper inside
a host-transfer guard, run, and compared with sentence-transformers on plain CPU torch.

    python examples/minilm_embed.py                       # torch_xla runtime, weights on device
    python examples/minilm_embed.py --params host         # policy: weights in host memory, swapped per layer
    python examples/minilm_embed.py --executor pjrt       # run the lowered HLO through PJRT (jaxlib)
    python examples/minilm_embed.py --executor streaming  # the torch BertModel through SwappedStack

Exits non-zero if a check fails: host transfers inside the guard must be 0 and the minimum
cosine similarity with the reference must be >= 0.9999.
"""
import argparse
import logging
import os
import sys

DEVICES = 4
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", str(DEVICES))
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import minilm  # noqa: E402

MIN_COSINE = 0.9999


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", choices=["device", "host"], default="device",
                   help="placement policy for the stacked layer weights")
    p.add_argument("--executor", choices=["torch_xla", "pjrt", "streaming"], default="torch_xla")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    steps = tqdm(total=4, desc="minilm", unit="step", file=sys.stdout)

    steps.set_postfix_str("loading weights and tokenizer")
    emb, layers = minilm.load_weights()
    cfg = minilm.load_config()
    ids, mask = minilm.tokenize(minilm.SENTENCES)
    steps.update()

    if args.executor == "streaming":
        emb_out, checks = run_streaming(ids, mask, steps)
    else:
        emb_out, checks = run_torch_xla(emb, layers, cfg, ids, mask, args, steps)

    steps.set_postfix_str("sentence-transformers reference on CPU")
    ref = minilm.reference_embeddings(minilm.SENTENCES)
    steps.update()
    steps.close()

    cos = torch.nn.functional.cosine_similarity(torch.as_tensor(np.asarray(emb_out)), ref, dim=1)
    checks["min cosine vs sentence-transformers >= %.4f" % MIN_COSINE] = float(cos.min()) >= MIN_COSINE
    print(f"\n{len(minilm.SENTENCES)} sentences, tokens {tuple(ids.shape)}, embeddings {tuple(ref.shape)}")
    print(f"min cosine similarity vs sentence-transformers (CPU torch): {float(cos.min()):.7f}  "
          f"(mean {float(cos.mean()):.7f})")
    failed = [name for name, ok in checks.items() if not ok]
    for name, ok in checks.items():
        print(f"[{'PASS' if ok else 'FAIL'}] {name}")
    return 1 if failed else 0


def run_streaming(ids, mask, steps):
    """The unmodified torch model (``transformers.BertModel``) through ``xla_swap.stack.swapped_stack.SwappedStack``.

    The embeddings (with the attention mask) are the first stage, the 6 ``BertLayer``s the
    streamed layers (weights in ``pinned_host``, FSDP-sharded over the 4 devices, prefetched 2
    layers ahead); mean pooling and normalisation run in torch on the output.

    Returns: ``(embeddings [B, 384] float32 numpy, checks)``.
    """
    import jax

    from xla_swap.stack import SwappedStack

    model = minilm.load_bert()
    steps.set_postfix_str("streaming: BertModel layers to pinned_host")
    stack = SwappedStack(model.encoder.layer, first=minilm.EmbedWithMask(model.embeddings))   # 2 layers prefetched
    steps.update()
    steps.set_postfix_str(f"streaming: {stack.runtime.num_stages} stages on {len(jax.devices())} device(s)")
    with torch.no_grad():
        h = stack(ids, mask)
        out = minilm.mean_pool_normalize(h, mask).numpy()
    steps.update()
    rt = stack.runtime
    kinds = {a.sharding.memory_kind for p in rt.host_params for a in jax.tree_util.tree_leaves(p)}
    w = rt.host_params[1]["attention.self.query.weight"]
    print(f"\nstreaming (torch BertModel via SwappedStack): {rt.num_stages} stages, {rt.weight_nbytes} bytes of "
          f"weights in pinned_host, prefetch depth {rt.prefetch_depth}, {rt.num_executables} executable(s), "
          f"query weight sharding {w.sharding.spec}")
    checks = {
        "streaming: layer weights resident in pinned_host": kinds == {"pinned_host"},
        "streaming: one executable shared by the 6 layers (plus the embeddings')": rt.num_executables == 2,
        "streaming: layer weights sharded over the devices": len(w.addressable_shards) == len(jax.devices()),
    }
    return out, checks


def run_torch_xla(emb, layers, cfg, ids, mask, args, steps):
    """Lower and run the encoder with torch_xla under SPMD; returns (embeddings [B, 384], checks)."""
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    from xla_swap.lowering import emit_annotations, host_transfer_guard, lower_fn, scan
    from xla_swap.planning import OffloadPolicy

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("model",))
    dev = torch_xla.device()
    policy = OffloadPolicy(params=args.params)

    steps.set_postfix_str(f"sharding weights over {n} devices")
    emb_x = {k: v.to(dev) for k, v in emb.items()}
    layers_x = {}
    for k, v in layers.items():
        t = v.to(dev)
        if t.dim() == 3:          # [L, out, in]: shard the output features over the mesh axis
            xs.mark_sharding(t, mesh, (None, "model", None))
        layers_x[k] = t
    ids_x, mask_x = ids.to(dev), mask.to(dev)
    torch_xla.sync()
    steps.update()

    heads, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]

    def encode(input_ids, attention_mask):
        h = minilm.embed_tokens(emb_x, input_ids, eps)
        bias = minilm.mask_bias(attention_mask)
        # scan bodies must not capture tensors: the mask bias rides along in the carry.
        (h, _), _ = scan(lambda c, w: ((minilm.encoder_layer(c[0], w, c[1], heads, eps), c[1]), None),
                         (h, bias), layers_x, policy=policy)
        return minilm.mean_pool_normalize(h, attention_mask)

    steps.set_postfix_str(f"lowering + running ({args.executor}, params on {args.params})")
    checks = {}
    with host_transfer_guard(raise_on_transfer=False) as seen:
        with emit_annotations(args.executor == "pjrt"):
            lowered = lower_fn(encode, ids_x, mask_x, name="minilm_encoder")
        if args.executor == "torch_xla":
            out = lowered(ids_x, mask_x)[0]
            torch_xla.sync()
    steps.update()
    if args.executor == "pjrt":
        from minilm_pjrt import run_lowered_with_pjrt
        result, report = run_lowered_with_pjrt(lowered, policy, weights=list(layers_x.values()))
        print("\n" + str(report))
        if policy.swaps_params:
            checks["stacked layer weights are in pinned_host memory"] = report_has_host_weights(report, lowered, layers_x)
    else:
        result = out.cpu()

    print("\n" + lowered.summary())
    transfers = sum(seen.values())
    print(f"host transfers inside the guard: {transfers} ({seen})")
    checks["0 host transfers while lowering and running"] = transfers == 0
    checks["layer weights sharded over the mesh"] = all(
        p.sharding.startswith(f"{{devices=[1,{n},1]") for p in lowered.parameters
        if p.kind == "captured" and len(p.shape) == 3) or n == 1
    return result, checks


def report_has_host_weights(report, lowered, layers_x) -> bool:
    from xla_swap.lowering.computation import data_handle
    handles = {data_handle(t) for t in layers_x.values()}
    ids = [p.id for p in lowered.parameters if data_handle(p.tensor) in handles]
    return all(report.parameter_memory_spaces[i] == "pinned_host" for i in ids)


if __name__ == "__main__":
    sys.exit(main())
