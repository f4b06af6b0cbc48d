"""How many experts a step's tokens need, and whether fetching only those pays (routed experts).

A mixture-of-experts layer routes each token to ``k`` of its ``E`` experts. Under uniform, independent
routing, ``T`` tokens reach on average ``E (1 - (1 - k / E) ** T)`` distinct experts
(:func:`expected_distinct_experts`): a decode step of batch ``B`` has ``T = B``, a prefill ``B`` times the
bucketed prompt. Fetching only those moves that fraction of the layer's expert bytes, but it puts one
device -> host read of the routing and the expert copies on each layer's critical path (they cannot
start before the router ran). :func:`routed_pays` takes routed fetching while the expected distinct
experts stay at most :data:`ROUTED_MAX_FRACTION` of ``E``; :func:`routed_token_limit` is the largest
token count that passes (Mixtral's 8 experts top-2: 5 tokens; Qwen3-30B-A3B's 128 top-8: 24; DeepSeek-V3's
256 top-8: 50). Real routing is not uniform (tokens of one prompt share experts), so ``generate`` also
reads the distinct experts each routed step fetched and stops routing when they pass that fraction.

:func:`choose_expert_layout` picks how the fetched experts are held in ``pinned_host``: ``"split"`` (one
packed buffer per expert, one copy-engine transfer each, with a fixed cost per copy) from
:data:`SPLIT_MIN_EXPERT_BYTES` per expert, else ``"stacked"`` (slices read by a program on the device).

Imports nothing beyond the standard library.
"""
from __future__ import annotations

import math

__all__ = ["ROUTED_MAX_FRACTION", "expected_distinct_experts", "routed_pays", "routed_token_limit", "expert_bucket",
           "SPLIT_MIN_EXPERT_BYTES", "choose_expert_layout"]

#: routed fetching is chosen while the expected distinct experts are at most this fraction of ``E``: the
#: saved bytes (at least a fifth of the experts') must outweigh a host round trip per layer.
ROUTED_MAX_FRACTION = 0.8

#: bytes of one expert's weights (one layer) from which ``"split"`` beats ``"stacked"`` in a decode step. From
#: one H200 (``benchmarks/results/moe_generate_gpu``, routed decode at batch 1, step over the routed-bytes
#: floor): Qwen3-30B-A3B's 9.4 MB experts 1.19 stacked against 1.48 split, Mixtral-8x7B's 352 MB experts
#: 1.04 split against 1.15 stacked. The threshold sits near the two sizes' geometric mean (57.5 MB),
#: rounded to 64 MiB; no size between them was measured.
SPLIT_MIN_EXPERT_BYTES = 64 << 20


def _check(num_experts: int, k: int) -> None:
    for name, v in (("num_experts", num_experts), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if k > num_experts:
        raise ValueError(f"k ({k}) must be at most num_experts ({num_experts})")


def expected_distinct_experts(num_experts: int, k: int, tokens: int) -> float:
    """``E (1 - (1 - k / E) ** tokens)``: the mean number of distinct experts ``tokens`` tokens reach, each
    routed to ``k`` of ``E`` experts uniformly and independently.

    Raises: ValueError: ``num_experts`` or ``k`` not an int >= 1, ``k > num_experts``, ``tokens`` not an int >= 0.
    """
    _check(num_experts, k)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be an int >= 0, got {tokens!r}")
    return num_experts * (1.0 - (1.0 - k / num_experts) ** tokens)


def routed_pays(num_experts: int, k: int, tokens: int, max_fraction: float = ROUTED_MAX_FRACTION) -> bool:
    """Whether ``tokens`` tokens are expected to reach at most ``max_fraction`` of the ``E`` experts
    (:func:`expected_distinct_experts`). Raises ValueError as it does, or for ``max_fraction`` outside (0, 1]."""
    if not 0 < max_fraction <= 1:
        raise ValueError(f"max_fraction must be in (0, 1], got {max_fraction!r}")
    return expected_distinct_experts(num_experts, k, tokens) <= max_fraction * num_experts


def routed_token_limit(num_experts: int, k: int, max_fraction: float = ROUTED_MAX_FRACTION) -> int:
    """The largest token count for which :func:`routed_pays` holds (0 when even one token reaches more:
    ``k / E > max_fraction``; ``2 ** 31 - 1`` for ``max_fraction = 1``). Raises ValueError as
    :func:`routed_pays` does."""
    if not routed_pays(num_experts, k, 1, max_fraction):
        return 0
    if max_fraction == 1:
        return 2 ** 31 - 1   # every count passes (k < E here, else one token would not have)
    t = int(math.floor(math.log(1.0 - max_fraction) / math.log(1.0 - k / num_experts)))
    while routed_pays(num_experts, k, t + 1, max_fraction):
        t += 1
    while t > 0 and not routed_pays(num_experts, k, t, max_fraction):
        t -= 1
    return t


def expert_bucket(distinct: int, k: int, num_experts: int) -> int:
    """The slot count a step that fetched ``distinct`` experts computes with: the smallest ``k * 2 ** j`` at
    least ``distinct``, at most ``num_experts`` (one executable per bucket, not per count; the spare slots
    repeat a fetched expert and get no token). Raises ValueError as :func:`expected_distinct_experts`, or
    for ``distinct`` outside ``[1, num_experts]``."""
    _check(num_experts, k)
    if isinstance(distinct, bool) or not isinstance(distinct, int) or not 1 <= distinct <= num_experts:
        raise ValueError(f"distinct must be an int in [1, {num_experts}], got {distinct!r}")
    slots = k
    while slots < distinct:
        slots *= 2
    return min(slots, num_experts)


def choose_expert_layout(expert_nbytes: int, min_split: int = SPLIT_MIN_EXPERT_BYTES) -> str:
    """``"split"`` when one expert's weights (``expert_nbytes`` bytes, the largest layer's) reach ``min_split``
    bytes, else ``"stacked"``.

    Raises: ValueError: ``expert_nbytes`` or ``min_split`` not an int >= 0.
    """
    for name, v in (("expert_nbytes", expert_nbytes), ("min_split", min_split)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    return "split" if expert_nbytes >= min_split else "stacked"
