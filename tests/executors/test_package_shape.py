"""Every module of ``xla_swap/`` holds the shape rules of ``shape_rules`` (no module over 600 lines, no
function over 80, no module docstring over 40, no private name of another module imported)."""
from __future__ import annotations

from shape_rules import (MAX_FUNCTION_LINES, MAX_MODULE_DOCSTRING_LINES, MAX_MODULE_LINES, PACKAGE,
                         private_imports, shape_violations)


def _modules():
    files = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    assert len(files) > 40, files
    return files


def test_every_module_is_small():
    bad = [v for p in _modules() for v in shape_violations(p)]
    assert not bad, "xla_swap: one idea per module, short functions:\n" + "\n".join(bad)


def test_no_private_name_of_another_module_is_imported():
    bad = [v for p in _modules() for v in private_imports(p)]
    assert not bad, "import public names:\n" + "\n".join(bad)


def test_the_rules_flag_what_they_look_for(tmp_path):
    probe = tmp_path / "probe.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    doc = "\n".join(["doc"] * (MAX_MODULE_DOCSTRING_LINES + 1))
    probe.write_text(f'"""{doc}"""\nfrom xla_swap.hf import _hidden\nfrom ._stages import ok\n'
                     f'def long():\n{body}\n' + "\n" * MAX_MODULE_LINES)
    found = shape_violations(probe, root=tmp_path)
    assert [f.split(" ")[0] for f in found] == ["probe.py:", "probe.py:", f"probe.py:{MAX_MODULE_DOCSTRING_LINES + 4}"]
    assert private_imports(probe, root=tmp_path) == [f"probe.py:{MAX_MODULE_DOCSTRING_LINES + 2} xla_swap.hf._hidden"]
