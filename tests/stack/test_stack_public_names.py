"""What ``xla_swap`` and ``xla_swap.stack`` exported before ``stack.py`` was split into one idea per
module is still there (the shape rules of every module of ``xla_swap/`` are in
tests/test_package_shape.py)."""
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


def test_the_packages_offer_their_entry_points():
    """The documented paths ``from xla_swap.stack import SwappedStack`` and ``from xla_swap.hf import
    causal_lm_stages`` give the defining modules' objects; the packages export nothing else, and a fresh
    ``import xla_swap`` still binds only ``__version__`` and the lazy ``__getattr__``."""
    import importlib
    import subprocess
    import sys

    import pytest

    from xla_swap.hf.causal_lm import causal_lm_stages
    from xla_swap.stack.swapped_stack import SwappedStack
    stack_pkg, hf_pkg = importlib.import_module("xla_swap.stack"), importlib.import_module("xla_swap.hf")
    assert stack_pkg.SwappedStack is SwappedStack and stack_pkg.causal_lm_stages is causal_lm_stages
    assert hf_pkg.causal_lm_stages is causal_lm_stages
    assert (stack_pkg.__all__, hf_pkg.__all__) == (["SwappedStack", "causal_lm_stages"], ["causal_lm_stages"])
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        stack_pkg.nothing
    code = "import xla_swap; print(sorted(n for n in dir(xla_swap) if not n.startswith('__')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
