"""What ``xla_swap`` and ``xla_swap.stack`` exported before ``stack.py`` was split into one idea per
module is still there (the shape rules of every module of ``xla_swap/`` are in
tests/executors/test_package_shape.py)."""
from __future__ import annotations


def test_stack_keeps_its_public_names():
    import xla_swap
    from xla_swap.stack import swapped_stack as stack
    for name in ("SwappedStack", "causal_lm_stages", "DEFAULT_POLICY", "torch_matmul_precision"):
        assert hasattr(stack, name), name
    assert xla_swap.SwappedStack is stack.SwappedStack
    assert xla_swap.causal_lm_stages is stack.causal_lm_stages
    from xla_swap.hf.loading import load_stack
    assert xla_swap.load_stack is load_stack
