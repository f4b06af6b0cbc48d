"""The Hugging Face Llama the multi-GPU benchmarks train, built from a config by ``transformers``' own code.

Shapes (:data:`SHAPES`, bf16, vocabulary 32000, untied head, SDPA attention):

* ``8b``: an 8B-like layer (D=4096, F=14336, 32 / 8 heads), 4 layers by default;
* ``34b``: a 34B-like layer (D=8192, F=22016, 64 / 8 heads: CodeLlama-34B's), 4 layers by default; with
  48 layers it is the 34B-shaped model of the largest-model row (about 67.5 GB of bf16 weights);
* ``70b``: Llama-2-70B's shape (D=8192, F=28672, 64 / 8 heads, 80 layers: about 138 GB of bf16 weights);
* ``tiny``: D=64, F=128, 4 / 2 heads, vocabulary 256, 2 layers (the CPU smoke runs).

Two ways to build one:

* :func:`meta_model`: the decoder layers only on the meta device (never allocated in torch), the ends
  (embedding, final norm, head, rotary) real on the CPU with random values; ``SwappedStack(weights=
  RandomWeights(device))`` then draws each layer's values on ``device`` one stage at a time straight into
  ``pinned_host`` (``generate_gpu.RandomWeights``);
* :func:`device_model`: the whole model on a device, initialised by ``transformers``' own init (the anchors).

Model FLOPs of a training step of ``b`` sequences of ``s`` tokens (:func:`model_flops`, recomputation not
counted): ``6 N b s`` (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", eq. 2.1 and its
training factor 3: forward 2 N per token, backward 4 N) with ``N`` the parameters other than the input
embedding (its lookup is no matmul; the head is counted), plus causal attention's score and value products,
``6 L b s^2 D``: half of the ``12 L s D`` per token of Chowdhery et al. 2022 (PaLM, appendix B), which
counts the full ``s x s`` score matrix.

Imports torch and transformers only (no jax).
"""
from __future__ import annotations

import math

SHAPES = {
    "8b": dict(d=4096, f=14336, heads=32, kv=8, layers=4, vocab=32000),
    "34b": dict(d=8192, f=22016, heads=64, kv=8, layers=4, vocab=32000),
    "70b": dict(d=8192, f=28672, heads=64, kv=8, layers=80, vocab=32000),
    "tiny": dict(d=64, f=128, heads=4, kv=2, layers=2, vocab=256),
}

__all__ = ["SHAPES", "shape_of", "config", "param_counts", "model_flops", "batch_shape", "batch", "ce",
           "meta_model", "device_model", "human_params", "state_bytes", "largest_layers", "LlamaWorkload"]


def shape_of(name: str, layers: int | None = None) -> dict:
    """A copy of ``SHAPES[name]`` with ``layers`` when given. Raises ValueError naming an unknown shape."""
    if name not in SHAPES:
        raise ValueError(f"shape {name!r}: one of {sorted(SHAPES)}")
    out = dict(SHAPES[name])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        out["layers"] = layers
    return out


def config(shape: dict, max_positions: int = 65536):
    """A ``transformers.LlamaConfig`` of ``shape`` (a :data:`SHAPES` entry): untied head, SDPA attention."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["d"], intermediate_size=shape["f"],
                       num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv"], max_position_embeddings=max_positions,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def param_counts(shape: dict) -> dict:
    """``{"total", "embedding", "non_embedding", "per_layer"}`` parameter counts of ``shape`` (from a meta
    model: nothing allocated)."""
    import torch
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        m = LlamaForCausalLM(config(shape))
    total = sum(p.numel() for p in m.parameters())
    emb = m.model.embed_tokens.weight.numel()
    layer = sum(p.numel() for p in m.model.layers[0].parameters())
    return {"total": total, "embedding": emb, "non_embedding": total - emb, "per_layer": layer}


def model_flops(shape: dict, b: int, s: int, counts: dict | None = None) -> float:
    """Model FLOPs of one training step on ``b x s`` tokens (module docstring): ``6 N b s + 6 L b s^2 D``."""
    counts = counts or param_counts(shape)
    return 6.0 * counts["non_embedding"] * b * s + 6.0 * shape["layers"] * b * s * s * shape["d"]


def batch_shape(tokens: int, n: int, seq: int = 4096) -> tuple[int, int]:
    """``(b, s)`` with ``b * s == tokens`` and ``b`` a multiple of ``n`` (the data-parallel devices):
    sequences of ``seq`` tokens where that splits, else ``n`` sequences of ``tokens / n``.

    Raises ValueError when ``tokens`` is not a multiple of ``n``."""
    if tokens < 1 or n < 1 or tokens % n:
        raise ValueError(f"tokens={tokens} do not split over n={n} devices")
    if tokens % seq == 0 and (tokens // seq) % n == 0:
        return tokens // seq, seq
    return n, tokens // n


def batch(b: int, s: int, vocab: int, seed: int = 1, device=None):
    """``(ids, labels)``: ``[b, s]`` int64 token ids drawn uniformly (CPU generator ``seed``) and the next
    tokens, on ``device`` (default CPU)."""
    import torch
    ids = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return (x, y) if device is None else (x.to(device), y.to(device))


def ce(logits, labels):
    """Mean cross-entropy of ``[b, s, V]`` logits (computed in float32) against ``[b, s]`` labels."""
    import torch
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def meta_model(shape: dict, dtype=None, fill_device="cpu", seed: int = 0):
    """A ``LlamaForCausalLM`` of ``shape`` whose decoder layers are on the meta device and whose ends
    (embedding, final norm, head, rotary buffers) are real CPU tensors: matrices ``N(0, 0.02)`` drawn on
    ``fill_device`` (generator ``seed``), the norm ones. ``dtype`` default bfloat16."""
    import torch
    from generate_gpu import _real_ends
    from transformers import LlamaForCausalLM
    dtype = dtype or torch.bfloat16
    cfg = config(shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.to(dtype)
    _real_ends(model, cfg)
    gen = torch.Generator(device=fill_device).manual_seed(seed)
    with torch.no_grad():
        for m in (model.model.embed_tokens, model.lm_head):
            m.weight.copy_((torch.randn(m.weight.shape, generator=gen, device=fill_device) * 0.02).to(dtype).cpu())
        model.model.norm.weight.fill_(1.0)
    return model


def device_model(shape: dict, device, dtype=None, seed: int = 0, meta: bool = False):
    """A ``LlamaForCausalLM`` of ``shape`` in ``dtype`` (default bfloat16) on ``device``, initialised by
    ``transformers`` (``torch.manual_seed(seed)``), or, with ``meta=True``, on the meta device (structure
    only: the caller materialises it, e.g. FSDP2's ``to_empty``)."""
    import torch
    from transformers import LlamaForCausalLM
    dtype = dtype or torch.bfloat16
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta" if meta else device):
            model = LlamaForCausalLM(config(shape))
    finally:
        torch.set_default_dtype(old)
    return model   # the rotary inverse frequencies float32 whatever the default dtype (transformers' own)


def human_params(n: int) -> str:
    """``n`` parameters as ``1.13 B`` / ``218 M``."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.0f} M" if n >= 1e6 else str(n)


def state_bytes(weight_bytes: int) -> int:
    """Bytes of bf16 weights and both AdamW moments (held in the weights' dtype): ``3 x weight_bytes``."""
    return 3 * weight_bytes


def largest_layers(shape: dict, host_bytes: int, fraction: float = 0.85) -> int:
    """The most layers of ``shape`` whose bf16 weights and AdamW moments (3 x the weights) fit in
    ``fraction`` of ``host_bytes`` (at least 1)."""
    counts = param_counts(dict(shape, layers=1))
    ends = counts["total"] - counts["per_layer"]
    per = 2 * counts["per_layer"]
    return max(1, math.floor((fraction * host_bytes / 3 - 2 * ends) / per))


class LlamaWorkload:
    """A Llama of ``shape`` as ``benchmarks/anchors.py`` trains it (the interface of ``anchors.FFNWorkload``).

    ``build``: :func:`device_model` (``meta=True``: structure only); ``blocks``: the decoder layers (each
    sharded on its own); ``batch(tokens, device, seed)``: ``(ids, labels)``, ``tokens / seq`` sequences of
    ``seq`` (one sequence of ``tokens`` when fewer); ``loss``: :func:`ce` of the logits; ``materialize``
    (after FSDP2's ``to_empty``): every parameter's local shard ``N(0, 0.02)`` (norms ones), drawn on
    ``device``, and the rotary frequencies recomputed there; ``checkpointing``: transformers'
    non-reentrant gradient checkpointing on the built model.
    """

    def __init__(self, shape: dict, seq: int = 4096, checkpointing: bool = False, dtype=None):
        import torch
        self.shape, self.seq, self.checkpointing = dict(shape), seq, checkpointing
        self.dtype = dtype or torch.bfloat16
        self.bucket_elements = param_counts(dict(shape, layers=1))["per_layer"]

    def describe(self) -> dict:
        return {"model": "llama", "shape": self.shape, "seq": self.seq, "checkpointing": self.checkpointing}

    def build(self, device, seed: int = 0, meta: bool = False):
        model = device_model(self.shape, device, self.dtype, seed, meta=meta)
        if self.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return model

    def blocks(self, model) -> list:
        return list(model.model.layers)

    def materialize(self, model, device, seed: int = 0) -> None:
        fill_normal(model, device, seed)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config).to(device)

    def batch(self, tokens: int, device, seed: int) -> tuple:
        s = min(self.seq, tokens)
        if tokens % s:
            raise ValueError(f"{tokens} tokens are not whole sequences of {s}")
        return batch(tokens // s, s, self.shape["vocab"], seed, device)

    def forward(self, model, data: tuple):
        return model(input_ids=data[0]).logits

    def loss(self, model, data: tuple):
        return ce(model(input_ids=data[0]).logits, data[1])


def fill_normal(model, device, seed: int, std: float = 0.02) -> None:
    """Values for a model materialised from the meta device: each parameter's local tensor (a DTensor's
    shard, wherever it lives) N(0, std^2) where it has two or more dimensions, drawn on ``device``
    (generator ``seed``: fast on a GPU) and copied in, ones otherwise."""
    import torch
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=gen, device=device).mul_(std).to(t.dtype))
            else:
                t.fill_(1.0)
