"""``generate(expert_fetch="routed")``: each step copies only the experts its tokens were routed to, and the
tokens stay ``model.generate``'s.

For small Mixtral, Qwen3-MoE, GPT-OSS and DeepSeek-V3 models (8 experts, top-2; DeepSeek-V3 with a dense
first layer, a shared expert and group-limited routing) on a left-padded batch of 3, greedy:

* the tokens equal ``model.generate``'s, in every expert layout (``"stacked"``, ``"split"``: one packed buffer
  per expert, ``"auto"``; Mixtral's split run with the KV cache in ``pinned_host``);
* the host -> device copies of each layer's experts (``last_generation["experts"]["copies"]``): in the split
  layout one copy per routed expert, of one expert's bytes each; in the stacked one a slice per weight;
* the experts copied at each step, per layer (``stack.last_generation["experts"]["fetched"]``, what the
  streamer's expert store copied), equal the set of experts the torch model routed that step's tokens to
  (forward pre-hooks on its experts modules, which the model's router feeds): the decode steps against
  ``model.generate``'s own forwards, the prefill against a torch forward on the stack's padded prompt;

and the choice: ``"auto"`` routes the decode steps of a small batch and streams every expert for the
prefill and for a large batch; ``expert_layout="auto"`` follows the bytes per expert (sizes injected); the
split layout holds each expert once (the stacked arrays deleted while a generator holds them, streamed whole
from the packed buffers by ``expert_fetch="all"``) and ``release_generation`` puts the stack's weights back
bit-exact; bad arguments are refused before anything runs.
"""
import jax
import pytest
import torch

transformers = pytest.importorskip("transformers")

import xla_swap  # noqa: E402
from xla_swap.hf.causal_lm import decoder_layers  # noqa: E402
from xla_swap.hf.moe import experts_modules  # noqa: E402

V, NEW = 128, 6
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
           v_head_dim=8, head_dim=4)
FAMILIES = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {**MOE, "num_experts": 8, "norm_topk_prob": True},
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 4},
    "deepseek_v3": {**MOE, **MLA, "n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "n_group": 2, "topk_group": 1, "num_hidden_layers": 3},
}


def make(family, **overrides):
    kind = type(transformers.AutoConfig.for_model(family))
    base = {k: v for k, v in BASE.items() if not isinstance(getattr(kind, k, None), property)}
    cfg = transformers.AutoConfig.for_model(family, **{**base, **FAMILIES[family], **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def prompts(batch=3, length=7):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


def one_device_stack(model):
    first, layers, last = xla_swap.causal_lm_stages(model)
    return xla_swap.SwappedStack(layers, first=first, last=last,
                                 parallel=xla_swap.ParallelConfig(devices=jax.devices()[:1]))


class RoutedSets:
    """Per forward of the torch model, ``{layer index: set of expert ids}`` its experts modules were given."""

    def __init__(self, model):
        self.calls: list[dict] = []
        self._handles = []
        layers = decoder_layers(model)
        for i, layer in enumerate(layers):
            for _, mod in experts_modules(layer):
                self._handles.append(mod.register_forward_pre_hook(self._hook(i)))
        self.moe_layers = sorted({i for i, layer in enumerate(layers) if experts_modules(layer)})

    def _hook(self, i):
        def hook(mod, args):
            if i == self.moe_layers[0]:
                self.calls.append({})
            self.calls[-1][i] = set(args[1].reshape(-1).tolist())
        return hook

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()


def padded_prefill(ids, mask, p_len):
    """The prefill inputs ``generate`` builds: left-padded to ``p_len`` with id 0, positions ``cumsum - 1``
    (0 at pads)."""
    b, t = ids.shape
    ids_p = torch.zeros((b, p_len), dtype=torch.int64)
    ids_p[:, p_len - t:] = ids
    mask_p = torch.zeros((b, p_len), dtype=torch.int64)
    mask_p[:, p_len - t:] = mask
    pos = (mask_p.cumsum(1) - 1).clamp_min(0) * mask_p
    return ids_p, mask_p, pos


@pytest.mark.parametrize("family,layout,kv", [("mixtral", "stacked", "device"), ("qwen3_moe", "stacked", "device"),
                                              ("gpt_oss", "stacked", "device"), ("deepseek_v3", "stacked", "device"),
                                              ("mixtral", "split", "host"), ("qwen3_moe", "split", "device"),
                                              ("gpt_oss", "split", "device"), ("deepseek_v3", "split", "device"),
                                              ("qwen3_moe", "auto", "device")])
def test_routed_tokens_and_fetched_experts_equal_torch(family, layout, kv):
    model = make(family)
    ids, mask = prompts()
    with RoutedSets(model) as hooks:   # (removed before the stack traces the layers)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    decode_sets = hooks.calls[1:]
    stack = one_device_stack(model)
    got = stack.generate(ids, mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, expert_fetch="routed",
                         expert_layout=layout, kv_cache=kv)
    assert torch.equal(got, ref), (got[:, 7:], ref[:, 7:])
    info = stack.last_generation["experts"]
    assert info["routed_steps"] == [True] * NEW
    fetched = [{layer: set(e) for layer, e in step} for step in info["fetched"]]
    assert all(list(dict(step)) == hooks.moe_layers for step in info["fetched"])   # each MoE layer once, in order
    assert fetched[1:] == decode_sets and len(decode_sets) == NEW - 1
    ids_p, mask_p, pos_p = padded_prefill(ids, mask, stack.last_generation["prompt_len"])
    with torch.no_grad(), RoutedSets(model) as prefill:
        model(ids_p, attention_mask=mask_p, position_ids=pos_p)
    assert fetched[0] == prefill.calls[0]
    assert any(len(s) < 8 for step in fetched[1:] for s in step.values())   # fewer than every expert was copied
    resolved = "stacked" if layout == "auto" else layout   # tiny experts: auto keeps them stacked
    assert info["layout"] == resolved
    per_expert = {i: sum(v.nbytes for n, v in stack.runtime.host_params[1 + i].items() if ".experts." in n) // 8
                  for i in hooks.moe_layers}
    n_weights = {i: sum(".experts." in n for n in stack.runtime.host_params[1 + i]) for i in hooks.moe_layers}
    for step_copies, step in zip(info["copies"], fetched):
        assert [c[0] for c in step_copies] == hooks.moe_layers
        for layer, n, nbytes in step_copies:
            assert n == len(step[layer]) * (1 if resolved == "split" else n_weights[layer])
            assert nbytes == len(step[layer]) * per_expert[layer]


def test_auto_routes_small_decode_batches_only():
    """Mixtral's 8 experts, top-2: a decode step of 1 token is routed (2 of 8 expected), the prefill of 16
    (7.9 of 8) and decode steps of 6 rows (6.6 of 8 > 0.8 x 8) stream every expert; tokens equal torch's."""
    model = make("mixtral")
    stack = one_device_stack(model)
    for batch, routed in ((1, True), (6, False)):
        ids, mask = prompts(batch)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        got = stack.generate(ids, mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
        assert torch.equal(got, ref)
        info = stack.last_generation["experts"]
        assert "prefill of 16 tokens" in info["explanation"] or not routed
        if routed:
            assert info["routed_steps"] == [False] + [True] * (NEW - 1)
            assert all(len(e) == 2 for step in info["fetched"][1:] for _, e in step)   # one token: its top-2
        else:
            assert info["routed_steps"] == [False] * NEW and "decode of 6 tokens" in info["explanation"]


def test_split_layout_holds_each_expert_once_and_gives_the_weights_back(monkeypatch):
    """``expert_layout="auto"`` with the size threshold injected at the model's expert size: split. While the
    generator holds the packed buffers the stacked arrays are deleted (a reader fails loudly), every-expert
    steps stream the packed buffers, and the tokens stay torch's; the stack's own readers (``state_dicts``) and
    ``release_generation`` rebuild them bit-exact."""
    from xla_swap.hf import moe_decode
    from xla_swap.hf.generate import release_generation
    from xla_swap.planning.routing import choose_expert_layout
    model = make("qwen3_moe")
    stack = one_device_stack(model)
    before = [{n: t.clone() for n, t in d.items()} for d in stack.state_dicts()]
    monkeypatch.setattr(moe_decode, "choose_expert_layout", lambda n: choose_expert_layout(n, min_split=n))
    ids, mask = prompts()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    for fetch in ("all", "routed", "all"):
        got = stack.generate(ids, mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, expert_fetch=fetch)
        assert torch.equal(got, ref), fetch
        info = stack.last_generation["experts"]
        assert info["layout"] == "split" and "B per expert -> 'split'" in info["layout_explanation"]
        assert info["routed_steps"] == [fetch == "routed"] * NEW
    experts = [v for p in stack.runtime.host_params for n, v in p.items() if ".experts." in n]
    assert experts and all(v.is_deleted() for v in experts)
    assert stack.generators.current.routed_experts.expert_host_nbytes() == 0
    after = stack.state_dicts()   # the stack's own readers put the stacked arrays back first
    assert all(torch.equal(after[i][n], t) for i, d in enumerate(before) for n, t in d.items())
    assert not any(v.is_deleted() for p in stack.runtime.host_params for n, v in p.items() if ".experts." in n)
    got = stack.generate(ids, mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, expert_fetch="routed")
    assert torch.equal(got, ref) and stack.generators.current.routed_experts.expert_host_nbytes() == 0   # packed again
    release_generation(stack)
    after = stack.state_dicts()
    assert all(torch.equal(after[i][n], t) for i, d in enumerate(before) for n, t in d.items())
    got = stack.generate(ids, mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, expert_fetch="routed",
                         expert_layout="stacked")
    assert torch.equal(got, ref) and stack.last_generation["experts"]["layout"] == "stacked"


def test_training_after_split_generation_equals_training_without_it(monkeypatch):
    """A ``train_step`` after a ``"split"``-layout ``generate`` (experts packed, stacked arrays deleted) puts the
    weights back first: its loss and the updated weights equal a stack's that never generated, and a
    ``generate`` after it serves the updated experts (tokens of the reference stack's)."""
    from xla_swap.hf import moe_decode
    from xla_swap.planning.routing import choose_expert_layout
    monkeypatch.setattr(moe_decode, "choose_expert_layout", lambda n: choose_expert_layout(n, min_split=n))
    stacks = []
    for _ in range(2):
        model = make("qwen3_moe")
        first, layers, last = xla_swap.causal_lm_stages(model)
        stacks.append(xla_swap.SwappedStack(
            layers, first=first, last=last, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
            loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)),
            parallel=xla_swap.ParallelConfig(devices=jax.devices()[:1])))
    ids, mask = prompts()
    gen = dict(max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, expert_fetch="routed")
    stacks[0].generate(ids, mask, **gen)
    assert stacks[0].last_generation["experts"]["layout"] == "split"
    losses = [float(s.train_step(ids[:, :-1], ids[:, 1:])) for s in stacks]
    assert losses[0] == losses[1]
    after = [s.state_dicts() for s in stacks]
    assert all(torch.equal(after[0][i][n], t) for i, d in enumerate(after[1]) for n, t in d.items())
    got = [s.generate(ids, mask, **gen) for s in stacks]
    assert torch.equal(got[0], got[1])


def test_auto_stops_routing_when_a_step_fetches_most_experts():
    """The measured check: a decode step whose layers fetched more than the fraction ends routing for the call."""
    from types import SimpleNamespace

    from xla_swap.hf.moe_decode import FetchPlan, RoutingInfo
    info = RoutingInfo({0: ("mlp.experts", 8, 2), 1: ("mlp.experts", 8, 2)}, None, {})
    plan = FetchPlan(info, "auto", 2, 16)
    streamer = SimpleNamespace(routed=None, expert_fetches=[])
    assert (plan.prefill, plan.decode) == (False, True)
    plan.before_step(streamer, 0)
    assert streamer.routed is False
    plan.before_step(streamer, 1)
    streamer.expert_fetches = [(1, tuple(range(7))), (2, tuple(range(8)))]   # 7.5 of 8 > 0.8 x 8
    plan.before_step(streamer, 2)
    assert streamer.routed is False and plan.routed_steps == [False, True, False]
    assert "step 1 fetched more than 0.8 of the experts" in plan.explanation


def test_routed_refused_before_running():
    model = make("mixtral")
    ids, mask = prompts()
    stack = one_device_stack(model)
    for kw, msg in ((dict(expert_fetch="some"), "expert_fetch must be one of"),
                    (dict(expert_layout="rows"), "expert_layout must be one of")):
        with pytest.raises(ValueError, match=msg):
            stack.generate(ids, mask, max_new_tokens=2, **kw)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in BASE.items()})).eval()
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        one_device_stack(llama).generate(ids, mask, max_new_tokens=2, expert_fetch="routed")
    if len(jax.devices()) > 1:
        first, layers, last = xla_swap.causal_lm_stages(model)
        wide = xla_swap.SwappedStack(layers, first=first, last=last)
        with pytest.raises(ValueError, match=f"runs on {len(jax.devices())} devices"):
            wide.generate(ids, mask, max_new_tokens=2, expert_fetch="routed")
    assert not hasattr(stack, "last_generation")


def test_choose_batch_counts_the_routed_bytes():
    """``choose_batch``: with room for a large batch, every expert streamed (the same batch as ``expert_fetch="all"``);
    with room for 2 sequences beside every expert, a routed batch (its window holds one layer's experts, not
    ``prefetch_depth + 1`` whole layers) of at most 5 rows (Mixtral's 8 experts, top-2), which gives more tokens
    per streamed byte; the explanation says which."""
    import re

    from xla_swap.hf.generate import choose_batch
    stack = one_device_stack(make("mixtral"))
    big, why_all = choose_batch(stack, 16, 8, device_budget_bytes=1 << 32, max_batch=64, expert_fetch="all")
    assert choose_batch(stack, 16, 8, device_budget_bytes=1 << 32, max_batch=64)[0] == big == 64
    window = int(re.search(r"streaming window (\d+) B", why_all).group(1))
    per_seq = sum(int(x) for x in re.search(r"KV cache (\d+) B \+ prefill temporaries (\d+) B", why_all).groups())
    budget = window + 2 * per_seq + per_seq // 2
    assert choose_batch(stack, 16, 8, device_budget_bytes=budget, expert_fetch="all")[0] == 2
    batch, why = choose_batch(stack, 16, 8, device_budget_bytes=budget)
    assert 2 < batch <= 5 and why.startswith(f"batch {batch}, routed experts")
    with pytest.raises(ValueError, match="expert_fetch must be 'auto' or 'all'"):
        choose_batch(stack, 16, 8, device_budget_bytes=budget, expert_fetch="routed")


@pytest.mark.parametrize("family,layout", [("qwen3_moe", "split"), ("mixtral", "stacked")])
def test_tail_copied_in_blocks_behind_the_experts_equals_torch(monkeypatch, family, layout):
    """The head's weights (every tail weight, the threshold at 0) copied in row blocks, one share per routed
    layer, and concatenated on the device: the tokens still equal ``model.generate``'s, and each decode step
    assembled the head from blocks copied behind the experts."""
    from xla_swap.executors.streaming import tail_pieces
    monkeypatch.setattr(tail_pieces, "TAIL_PIECE_MIN_BYTES", 0)
    model = make(family, num_hidden_layers=5)   # the head's copy is due at layer 5 - prefetch depth
    ids, mask = prompts()
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    stack = one_device_stack(model)
    got = stack.generate(ids, mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, expert_fetch="routed",
                         expert_layout=layout)
    assert torch.equal(got, ref), (got[:, 7:], ref[:, 7:])
    info = stack.last_generation["experts"]
    head, depth = len(stack.runtime.host_params) - 1, stack.runtime.prefetch_depth
    due = sum(1 for layer in range(5) if 1 + layer < head - depth)   # routed layers read before the head's copy
    assert due >= 2
    blocked = sum(1 for a in jax.tree_util.tree_leaves(stack.runtime.host_params[head]) if a.ndim and a.shape[0] > 1)
    for routed, blocks in zip(info["routed_steps"], info["tail_blocks"]):
        assert routed and [b[0] for b in blocks] == [head]   # the head, assembled once per step
        ahead, late = blocks[0][1:]
        assert (ahead, late) == (due * blocked, 0)   # a block of each weight behind each of those layers' experts
    tail = stack.generators.current.routed_experts.tail
    held = tail.host_nbytes()
    assert held == sum(a.nbytes for a in jax.tree_util.tree_leaves(stack.runtime.host_params[head])
                       if a.ndim and a.shape[0] > 1)   # the blocks: the head's bytes once more
    whole = stack.generate(ids, mask, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0, expert_fetch="all",
                           expert_layout=layout)
    assert torch.equal(whole, ref) and stack.last_generation["experts"]["tail_blocks"] == [[]] * NEW
    assert stack.generators.current.routed_experts.tail is tail   # the same generator streamed it whole
    assert tail.host_nbytes() == held   # a run that streams whole keeps the blocks for the next routed one


def test_routed_steps_build_no_program_key_per_token(monkeypatch):
    """A routed layer's program is looked up by the stage's last signature and weights: the keys built in a
    generation (walks over the layer's weights) do not grow with the number of tokens, and the tokens equal
    ``model.generate``'s."""
    from xla_swap.executors.streaming import routed_experts
    model = make("qwen3_moe")
    ids, mask = prompts()
    stack = one_device_stack(model)
    keys = []
    real = routed_experts.aval_key
    monkeypatch.setattr(routed_experts, "aval_key", lambda t: keys.append(1) or real(t))
    built = {}
    for new in (2, 6, 2, 6):
        keys.clear()
        got = stack.generate(ids, mask, max_new_tokens=new, eos_token_id=None, pad_token_id=0,
                             expert_fetch="routed")
        built.setdefault(new, []).append(len(keys))
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        assert torch.equal(got, ref)
    assert built[2][1] == built[6][1] > 0, built   # warm: the same keys for 2 tokens and for 6
