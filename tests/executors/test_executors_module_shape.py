"""The shape rules of ``xla_swap/executors/`` (the streaming runtime split into one idea per module),
checked on the source with ``ast``, as ``tests/planning/test_module_shape.py`` checks the planner:

* no module over :data:`MAX_MODULE_LINES` lines, no function or method over :data:`MAX_FUNCTION_LINES`
  (its decorators, signature and docstring included), no module docstring over
  :data:`MAX_MODULE_DOCSTRING_LINES` lines;
* no module of ``xla_swap/executors/`` reads a private (``_``-prefixed) attribute of anything but
  ``self`` / ``cls`` (``calibrate.py`` uses ``StreamingRuntime``'s public measurement API).
"""
from __future__ import annotations

import ast
import pathlib

from shape_rules import MAX_FUNCTION_LINES, MAX_MODULE_DOCSTRING_LINES, MAX_MODULE_LINES
from shape_rules import shape_violations as _shape_violations

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXECUTORS = ROOT / "xla_swap" / "executors"

#: The runtime's modules after the split of ``streaming.py`` (each must exist and hold the rules).
RUNTIME_MODULES = ("streaming.py", "placement.py", "compilation.py", "stage_programs.py", "loop.py",
                   "update_pass.py", "instrumentation.py", "calibrate.py")


def _private_reads(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``"file:line expr"`` for every ``x._name`` in ``path`` whose ``x`` is not ``self`` or ``cls``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_runtime_modules_exist():
    missing = [m for m in RUNTIME_MODULES if not (EXECUTORS / m).is_file()]
    assert not missing, missing


def test_executor_modules_are_small():
    files = sorted(EXECUTORS.glob("*.py"))
    assert len(files) >= len(RUNTIME_MODULES), files
    bad = [v for p in files for v in _shape_violations(p)]
    assert not bad, "xla_swap/executors: one idea per module, short functions:\n" + "\n".join(bad)


def test_no_private_attribute_of_another_object_is_read():
    bad = [v for p in sorted(EXECUTORS.glob("*.py")) for v in _private_reads(p)]
    assert not bad, "read public names (StreamingRuntime's measurement API):\n" + "\n".join(bad)


def test_checkers_flag_what_they_look_for(tmp_path):
    """The checkers above see a long module, a long docstring, a long function and a private read."""
    probe = tmp_path / "probe.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    doc = "\n".join(["doc"] * (MAX_MODULE_DOCSTRING_LINES + 1))
    padding = "\n" * MAX_MODULE_LINES
    probe.write_text(f'"""{doc}"""\nvalue = runtime._hidden + self._own + runtime.public\n'
                     f"@staticmethod\ndef short():\n    pass\ndef long():\n{body}\n{padding}")
    found = _shape_violations(probe, root=tmp_path)
    assert len(found) == 3, found
    assert any("long is" in v for v in found) and not any("short" in v for v in found)
    assert _shape_violations(probe, root=tmp_path, max_lines=10 ** 6) == found[1:]
    assert _private_reads(probe, root=tmp_path) == [f"probe.py:{MAX_MODULE_DOCSTRING_LINES + 2} runtime._hidden"]
