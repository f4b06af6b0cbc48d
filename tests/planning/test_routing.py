"""``xla_swap.planning.routing``: the expected distinct experts of uniform routing (against a simulation), the
token limit at the fraction, and bad arguments refused."""
import random

import pytest

from xla_swap.planning.routing import (ROUTED_MAX_FRACTION, expected_distinct_experts, expert_bucket, routed_pays,
                                      routed_token_limit)


@pytest.mark.parametrize("e,k,tokens", [(8, 2, 1), (8, 2, 4), (128, 8, 16), (256, 8, 40)])
def test_expected_distinct_matches_a_simulation(e, k, tokens):
    rng = random.Random(0)
    runs = 4000
    mean = sum(len({x for _ in range(tokens) for x in rng.sample(range(e), k)}) for _ in range(runs)) / runs
    assert abs(mean - expected_distinct_experts(e, k, tokens)) < 0.02 * e


@pytest.mark.parametrize("e,k", [(8, 2), (128, 8), (256, 8), (4, 2), (8, 1), (16, 16)])
def test_token_limit_is_where_routed_stops_paying(e, k):
    t = routed_token_limit(e, k)
    assert t == 0 or routed_pays(e, k, t)
    assert not routed_pays(e, k, t + 1)
    assert (t > 0) == (k / e <= ROUTED_MAX_FRACTION)
    assert routed_token_limit(e, k, 1.0) == 2 ** 31 - 1


def test_bad_arguments_refused():
    for args, msg in (((0, 1, 1), "num_experts must be"), ((4, 5, 1), r"k \(5\) must be at most"),
                      ((4, 2, -1), "tokens must be"), ((4, True, 1), "k must be")):
        with pytest.raises(ValueError, match=msg):
            expected_distinct_experts(*args)
    with pytest.raises(ValueError, match="max_fraction must be in"):
        routed_pays(8, 2, 1, 0.0)


def test_expert_bucket():
    assert [expert_bucket(m, 2, 8) for m in range(1, 9)] == [2, 2, 4, 4, 8, 8, 8, 8]
    assert [expert_bucket(m, 8, 128) for m in (1, 8, 9, 33, 100, 128)] == [8, 8, 16, 64, 128, 128]
    assert expert_bucket(5, 3, 10) == 6 and expert_bucket(7, 3, 10) == 10
    with pytest.raises(ValueError, match=r"distinct must be an int in \[1, 8\]"):
        expert_bucket(9, 2, 8)
