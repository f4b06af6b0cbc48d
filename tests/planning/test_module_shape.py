"""The shape rules of ``xla_swap/planning/`` (docs/planner.md lists its modules), checked on the source with ``ast``:

* no module over :data:`MAX_MODULE_LINES` lines, no function or method over :data:`MAX_FUNCTION_LINES`
  (its decorators, signature and docstring included);
* no module docstring over :data:`MAX_MODULE_DOCSTRING_LINES` lines: the model's description and
  the run history live in ``docs/`` (docs/planner.md, docs/benchmark-history.md);
* no module of ``xla_swap`` imports a private (``_``-prefixed) name from ``xla_swap.planning``.
"""
from __future__ import annotations

import ast
import pathlib

from shape_rules import MAX_FUNCTION_LINES, MAX_MODULE_DOCSTRING_LINES, MAX_MODULE_LINES
from shape_rules import shape_violations as _shape_violations

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLANNING = ROOT / "xla_swap" / "planning"


def _private_planning_imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``"file:line name"`` for every ``from xla_swap.planning[.x] import _name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and (node.module == "xla_swap.planning" or node.module.startswith("xla_swap.planning.")):
            found += [f"{path.relative_to(root)}:{node.lineno} {node.module}.{a.name}"
                      for a in node.names if a.name.startswith("_")]
    return found


def test_planning_modules_are_small():
    files = sorted(PLANNING.glob("*.py"))
    assert len(files) >= 8, files
    bad = [v for p in files for v in _shape_violations(p)]
    assert not bad, "xla_swap/planning: one idea per module, short functions:\n" + "\n".join(bad)


def test_no_private_planning_name_is_imported():
    files = sorted((ROOT / "xla_swap").rglob("*.py"))
    bad = [v for p in files for v in _private_planning_imports(p)]
    assert not bad, "import public names from xla_swap.planning:\n" + "\n".join(bad)


def test_checkers_flag_what_they_look_for(tmp_path):
    """The checkers above see a long module, a long docstring, a long function and a private import."""
    probe = tmp_path / "probe.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    doc = "\n".join(["doc"] * (MAX_MODULE_DOCSTRING_LINES + 1))
    padding = "\n" * MAX_MODULE_LINES
    probe.write_text(f'"""{doc}"""\nfrom xla_swap.planning.units import _hidden, as_bytes\n'
                     f"@staticmethod\ndef short():\n    pass\ndef long():\n{body}\n{padding}")
    found = _shape_violations(probe, root=tmp_path)
    assert len(found) == 3, found
    assert any("long is" in v for v in found) and not any("short" in v for v in found)
    assert _private_planning_imports(probe, root=tmp_path) == [
        f"probe.py:{MAX_MODULE_DOCSTRING_LINES + 2} xla_swap.planning.units._hidden"]
