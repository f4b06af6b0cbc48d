"""The shape rules of the PJRT executor's modules (``xla_swap/executors/pjrt*.py``), checked on the source with ``ast``:

* no module over 600 lines, no function or method over 80 (decorators, signature and docstring
  included), no module docstring over 40 lines (the rules of tests/executors/shape_rules.py);
* no module of ``xla_swap`` imports a private (``_``-prefixed) name from one of them;
* ``xla_swap.executors.pjrt`` still offers every public name it offered before it was split.
"""
from __future__ import annotations

import ast
import pathlib

from shape_rules import shape_violations

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXECUTORS = ROOT / "xla_swap" / "executors"

#: The modules of the PJRT executor, one idea each (docs/design.md, "PJRT through jaxlib").
PJRT_MODULES = ("pjrt.py", "pjrt_buffers.py", "pjrt_host_memory.py", "pjrt_module.py", "pjrt_placement.py",
                "pjrt_policy.py", "pjrt_sharding.py")
#: What ``from xla_swap.executors.pjrt import ...`` offers to callers (tests, benchmarks, examples, host_pool).
PJRT_PUBLIC_NAMES = ("PjrtExecutor", "ParameterPlacement", "ParameterInfo", "MemoryReport", "HostMemoryError",
                     "PolicyPlacements", "placements_for_policy", "compile_lowered", "MEMORY_KINDS", "DEVICE",
                     "PINNED_HOST", "HOST_MEMORY_LIMIT_ENV", "HOST_MEMORY_SPACE", "DEFAULT_GPU_HOST_MEMORY_LIMIT_GB")


def _private_pjrt_imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``"file:line name"`` for every import of a ``_``-prefixed name from a PJRT module in ``path``."""
    stems = {m[:-3] for m in PJRT_MODULES}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        last = node.module.rsplit(".", 1)[-1]
        if last in stems and (node.level or node.module.startswith("xla_swap.executors.")):
            found += [f"{path.relative_to(root)}:{node.lineno} {node.module}.{a.name}"
                      for a in node.names if a.name.startswith("_")]
    return found


def test_pjrt_modules_are_small():
    files = [EXECUTORS / name for name in PJRT_MODULES]
    missing = [str(p) for p in files if not p.exists()]
    assert not missing, missing
    bad = [v for p in files for v in shape_violations(p)]
    assert not bad, "xla_swap/executors/pjrt*.py: one idea per module, short functions:\n" + "\n".join(bad)


def test_every_pjrt_module_is_listed():
    """A new ``pjrt_*.py`` module is held to the rules above too."""
    on_disk = sorted(p.name for p in EXECUTORS.glob("pjrt*.py"))
    assert on_disk == sorted(PJRT_MODULES), on_disk


def test_no_private_pjrt_name_is_imported():
    files = sorted((ROOT / "xla_swap").rglob("*.py"))
    bad = [v for p in files for v in _private_pjrt_imports(p)]
    assert not bad, "import public names from the PJRT modules:\n" + "\n".join(bad)


def test_pjrt_keeps_its_public_names():
    from xla_swap import executors
    from xla_swap.executors import pjrt
    missing = [n for n in PJRT_PUBLIC_NAMES if not hasattr(pjrt, n)]
    assert not missing, missing
    assert all(getattr(executors, n) is getattr(pjrt, n) for n in executors.__all__ if hasattr(pjrt, n))


def test_private_import_checker_flags_what_it_looks_for(tmp_path):
    """The checker sees a private name imported from a PJRT module, relatively or absolutely, and nothing else."""
    probe = tmp_path / "probe.py"
    probe.write_text("from .pjrt_module import _hidden, load_module\n"
                     "from xla_swap.executors.pjrt import _x\nfrom .report import _y\nfrom pjrt_module import _z\n")
    assert _private_pjrt_imports(probe, root=tmp_path) == ["probe.py:1 pjrt_module._hidden",
                                                           "probe.py:2 xla_swap.executors.pjrt._x"]
