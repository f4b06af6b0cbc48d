"""The shape rules of tests/executors/shape_rules.py (no module over 600 lines, no function over
80, no module docstring over 40) on the torch front end's modules: the entry point ``SwappedStack``
split into one idea per module (docs/design.md lists them) and the generation modules."""
from __future__ import annotations

import pathlib

from shape_rules import shape_violations

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: the modules of ``xla_swap/`` that hold the rule.
FRONT_END = ("stack.py", "torch_bridge.py", "stages.py", "sharding.py", "mixed_precision.py", "checkpoint.py",
             "training.py", "budget.py", "generate.py", "kv_cache.py", "sampling.py", "hf.py", "torch_attention.py")


def test_front_end_modules_are_small():
    files = [ROOT / "xla_swap" / name for name in FRONT_END]
    assert all(p.is_file() for p in files), [str(p) for p in files if not p.is_file()]
    bad = [v for p in files for v in shape_violations(p)]
    assert not bad, "the torch front end: one idea per module, short functions:\n" + "\n".join(bad)


def test_stack_keeps_its_public_names():
    """What ``xla_swap`` and ``xla_swap.stack`` exported before the split is still there."""
    import xla_swap
    from xla_swap import stack
    for name in ("SwappedStack", "causal_lm_stages", "DEFAULT_POLICY", "torch_matmul_precision"):
        assert hasattr(stack, name), name
    assert xla_swap.SwappedStack is stack.SwappedStack
    assert xla_swap.causal_lm_stages is stack.causal_lm_stages
    from xla_swap.loading import load_stack
    assert xla_swap.load_stack is load_stack
