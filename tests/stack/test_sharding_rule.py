"""The ``"fsdp"`` rule of ``xla_swap.stack.sharding``: each weight of >= 2 dimensions split on the first dimension
of its held layout that divides evenly (contiguous collectives), callables asked in torch's layout."""
import pytest

from xla_swap.stack.sharding import partition_spec


@pytest.mark.parametrize("shape,n,want", [
    ((4096, 14336), 2, ("d", None)),        # gate_proj held [D, F]: D, not the larger F
    ((14336, 4096), 4, ("d", None)),        # down_proj held [F, D]
    ((3, 8), 2, (None, "d")),               # the major dimension does not divide: the next one
    ((8, 3, 5), 4, ("d", None, None)),      # an expert stack [E, D, F]: the experts
    ((3, 6, 5), 2, (None, "d", None)),
    ((3, 5), 2, ()),                        # nothing divides: replicated
    ((4096,), 2, ()),                       # 1-D weights (norms, biases) replicated
])
def test_fsdp_splits_the_first_dimension_that_divides(shape, n, want):
    assert partition_spec("fsdp", "w", shape, n) == want
    assert partition_spec("replicate", "w", shape, n) == ()


def test_a_callable_speaks_torch_layout_and_its_spec_turns_for_a_transposed_weight():
    seen = []

    def rule(name, shape):
        seen.append((name, shape))
        return ("d", None)   # torch's [out, in]: split the output features
    assert partition_spec(rule, "mlp.up_proj.weight", (64, 128), 2, transposed=True) == (None, "d")
    assert partition_spec(rule, "embed_tokens.weight", (256, 64), 2) == ("d", None)
    assert seen == [("mlp.up_proj.weight", (128, 64)), ("embed_tokens.weight", (256, 64))]
