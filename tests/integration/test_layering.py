"""The import layering of README / CONTRIBUTING: front end -> planning -> executors.

* ``import xla_swap.executors`` loads jax only: no torch, no torch_xla (the GPU machine has
  no torch_xla);
* ``import xla_swap.planning`` loads neither torch, torch_xla nor jax;
* no module of ``xla_swap.frontend`` imports ``xla_swap.executors`` (checked on the source
  with ``ast``, so imports inside functions count too).

The import checks run in fresh interpreters: the test process itself has torch and jax loaded.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FRONTEND = ROOT / "xla_swap" / "frontend"


def _top_level_modules_after(import_stmt: str) -> set:
    """Top-level names in ``sys.modules`` of a fresh interpreter after ``import_stmt``."""
    code = (f"import sys, json\n{import_stmt}\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{import_stmt!r} failed:\n{proc.stderr[-4000:]}"
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("package, forbidden", [
    ("xla_swap.executors", {"torch", "torch_xla", "torchax"}),
    ("xla_swap.planning", {"torch", "torch_xla", "torchax", "jax", "jaxlib"}),
    ("xla_swap", {"torch", "torch_xla", "torchax", "jax", "jaxlib"}),   # SwappedStack loads lazily
])
def test_package_imports_without(package, forbidden):
    loaded = _top_level_modules_after(f"import {package}")
    assert "xla_swap" in loaded
    assert not (loaded & forbidden), f"import {package} loaded {sorted(loaded & forbidden)}"


def _imported_modules(path: pathlib.Path, root: pathlib.Path = ROOT) -> list:
    """``(module, line)`` for every import in ``path``: absolute names, relative imports resolved
    against ``path``'s package under ``root``; ``from a import b`` yields ``a`` and ``a.b``."""
    package = ".".join(path.relative_to(root).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, node.lineno))
            found += [(f"{module}.{a.name}", node.lineno) for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.append((node.args[0].value, node.lineno))
    return found


def test_frontend_source_does_not_import_executors():
    files = sorted(FRONTEND.rglob("*.py"))
    assert files, f"no sources under {FRONTEND}"
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in files for mod, line in _imported_modules(p)
           if mod == "xla_swap.executors" or mod.startswith("xla_swap.executors.")]
    assert not bad, "the front end must not import the executors:\n" + "\n".join(bad)


def test_import_parser_sees_relative_and_absolute_forms(tmp_path):
    """The checker above resolves the forms a front-end module could use."""
    probe = tmp_path / "xla_swap" / "frontend" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from ..executors import StreamingRuntime\n"
                     "import xla_swap.executors.streaming\n"
                     "from xla_swap import executors\n"
                     "def f():\n"
                     "    import importlib\n"
                     "    return importlib.import_module('xla_swap.executors')\n")
    mods = [m for m, _ in _imported_modules(probe, root=tmp_path)]
    # "from ..executors import ...", "from xla_swap import executors", import_module(...)
    assert mods.count("xla_swap.executors") == 3
    assert "xla_swap.executors.StreamingRuntime" in mods
    assert "xla_swap.executors.streaming" in mods


def test_torch_entry_point_runs_without_torch_xla():
    """``xla_swap.stack`` (SwappedStack) is for machines without torch_xla: it imports neither torch_xla
    nor the torch_xla front end."""
    loaded = _top_level_modules_after("import xla_swap.stack")
    assert "torch_xla" not in loaded
    imported = {m for m, _ in _imported_modules(ROOT / "xla_swap" / "stack.py")}
    assert not any(m.startswith(("xla_swap.frontend", "torch_xla")) for m in imported), sorted(imported)
