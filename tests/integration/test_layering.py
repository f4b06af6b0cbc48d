"""The import layering of README / CONTRIBUTING: front end -> planning -> executors.

* ``import xla_swap.executors`` loads jax only: no torch, no torch_xla (the GPU machine has
  no torch_xla);
* ``import xla_swap.planning`` loads neither torch, torch_xla nor jax;
* no module of ``xla_swap.lowering`` imports ``xla_swap.executors`` (checked on the source
  with ``ast``, so imports inside functions count too);
* ``xla_swap._compat.jax`` (and the executors through it) imports with torch, torch_xla and
  torchax blocked (an import hook that makes them fail), as on the GPU machine;
* private upstream APIs (``torch_xla._XLAC``, ``jax._src``, ``torch._functorch``, private
  members of jax objects, ...) are used only in ``xla_swap/_compat/`` (checked on the source).

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
FRONTEND = ROOT / "xla_swap" / "lowering"
COMPAT = ROOT / "xla_swap" / "_compat"


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
    ("xla_swap.planning.chooser", {"torch", "torch_xla", "torchax", "jax", "jaxlib"}),
    ("xla_swap.executors.streaming.calibrate", {"torch", "torch_xla", "torchax"}),
    ("xla_swap", {"torch", "torch_xla", "torchax", "jax", "jaxlib"}),   # SwappedStack loads lazily
    ("xla_swap._compat", {"torch", "torch_xla", "torchax", "jax", "jaxlib"}),
    ("xla_swap._compat.jax", {"torch", "torch_xla", "torchax"}),
    ("xla_swap.stack.config", {"torch", "torch_xla", "torchax"}),   # the stack's setting groups: written anywhere
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


def test_lowering_source_does_not_import_executors():
    files = sorted(FRONTEND.rglob("*.py"))
    assert files, f"no sources under {FRONTEND}"
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in files for mod, line in _imported_modules(p)
           if mod == "xla_swap.executors" or mod.startswith("xla_swap.executors.")]
    assert not bad, "the front end must not import the executors:\n" + "\n".join(bad)


def test_import_parser_sees_relative_and_absolute_forms(tmp_path):
    """The checker above resolves the forms a front-end module could use."""
    probe = tmp_path / "xla_swap" / "lowering" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from ..executors import StreamingRuntime\n"
                     "import xla_swap.executors.trace\n"
                     "from xla_swap import executors\n"
                     "def f():\n"
                     "    import importlib\n"
                     "    return importlib.import_module('xla_swap.executors')\n")
    mods = [m for m, _ in _imported_modules(probe, root=tmp_path)]
    # "from ..executors import ...", "from xla_swap import executors", import_module(...)
    assert mods.count("xla_swap.executors") == 3
    assert "xla_swap.executors.StreamingRuntime" in mods
    assert "xla_swap.executors.trace" in mods


def test_torch_entry_point_runs_without_torch_xla():
    """``xla_swap.stack`` (SwappedStack) is for machines without torch_xla: it imports neither torch_xla
    nor the torch_xla front end."""
    loaded = _top_level_modules_after("import xla_swap.stack.swapped_stack")
    assert "torch_xla" not in loaded
    imported = {m for m, _ in _imported_modules(ROOT / "xla_swap" / "stack" / "swapped_stack.py")}
    assert not any(m.startswith(("xla_swap.lowering", "torch_xla")) for m in imported), sorted(imported)


def test_the_stack_parts_do_not_import_the_stack():
    """``SwappedStack`` holds its parts and calls them; none of them imports ``xla_swap.stack.swapped_stack`` back
    (no circle)."""
    parts = ["hf/generate.py", "hf/generators.py", "stack/training.py", "stack/budget.py", "stack/checkpoint.py",
             "stack/config.py", "stack/checks.py", "stack/stages.py"]
    bad = [f"{p}:{line} imports {mod}" for p in parts for mod, line in _imported_modules(ROOT / "xla_swap" / p)
           if mod.split(".")[:2] == ["xla_swap", "stack"]
           and mod.split(".")[2:3] in (["swapped_stack"], ["SwappedStack"])]
    assert not bad, "\n".join(bad)


_BLOCK_TORCH = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torch_xla", "torchax"):
            raise ImportError(f"blocked by the layering test: {name}")
        return None
sys.meta_path.insert(0, _Block())
"""


@pytest.mark.parametrize("import_stmt", ["import xla_swap._compat.jax", "import xla_swap.executors",
                                         "import xla_swap.planning", "import xla_swap.executors.streaming.calibrate"])
def test_imports_with_torch_and_torch_xla_blocked(import_stmt):
    """As on a machine without them: importing torch, torch_xla or torchax raises ImportError."""
    code = (_BLOCK_TORCH + f"{import_stmt}\n"
            "try:\n    import torch\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('block failed')\n"
            "print('ok')")
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{import_stmt!r} with torch blocked failed:\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().splitlines()[-1] == "ok"


#: Upstream packages whose private (``_``-prefixed) modules and members only ``xla_swap/_compat`` may use.
_UPSTREAM = ("torch", "torch_xla", "torchax", "jax", "jaxlib", "flax")
#: Private members of upstream objects (not reachable by module path) that xla_swap has used.
_PRIVATE_MEMBERS = ("_XLAC", "_xla", "_lowering", "_to_xla_hlo_sharding", "_device_assignment",
                    "_dtype_to_ir_type", "_src")


def _private_upstream_uses(path: pathlib.Path, root: pathlib.Path = ROOT) -> list:
    """``"file:line what"`` for every private upstream API ``path`` uses.

    An import of an upstream module path or name with a ``_``-prefixed part (``from
    jax._src.lib import xla_client``, ``from torch.utils._pytree import tree_map``, ``from
    torch_xla.experimental.scan_layers import _ensure_same_structure``), an attribute chain
    from an upstream module with such a part (``torch_xla._XLAC.f``), or a known private
    member of an upstream object (``sharding._device_assignment``, ``lowered._lowering``).
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(root)
    found = []

    def private(parts):
        return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] in _UPSTREAM and private(parts):
                    found.append(f"{rel}:{node.lineno} import {a.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            parts = node.module.split(".")
            if parts[0] in _UPSTREAM and (private(parts) or private([a.name for a in node.names])):
                found.append(f"{rel}:{node.lineno} from {node.module} import "
                             + ", ".join(a.name for a in node.names))
        elif isinstance(node, ast.Attribute) and node.attr in _PRIVATE_MEMBERS:
            found.append(f"{rel}:{node.lineno} .{node.attr}")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            parts = node.args[0].value.split(".")
            if parts[0] in _UPSTREAM and private(parts):
                found.append(f"{rel}:{node.lineno} import_module({node.args[0].value!r})")
    return found


def test_private_upstream_apis_only_in_compat():
    files = [p for p in sorted((ROOT / "xla_swap").rglob("*.py")) if COMPAT not in p.parents]
    assert len(files) > 10, files
    bad = [use for p in files for use in _private_upstream_uses(p)]
    assert not bad, ("private torch_xla / torch / jax APIs belong in xla_swap/_compat (a named wrapper with the "
                     "versions it was verified on), not in:\n" + "\n".join(bad))


def test_private_api_checker_sees_the_forms_once_used(tmp_path):
    """The checker above flags each form the package used before ``xla_swap._compat`` existed."""
    probe = tmp_path / "xla_swap" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from jax._src.lib import xla_client as xc\n"
                     "from torch.utils._pytree import tree_map\n"
                     "from torch_xla.experimental.scan_layers import _ensure_same_structure\n"
                     "import torch_xla\n"
                     "h = torch_xla._XLAC._get_tensors_handle([])\n"
                     "c = xc._xla.mlir.hlo_to_stablehlo(b'')\n"
                     "d = sharding._device_assignment\n"
                     "k = lowered._lowering.const_args\n"
                     "import importlib\n"
                     "m = importlib.import_module('jax._src.sharding_impls')\n"
                     "from jax.sharding import NamedSharding\n")   # public: not flagged
    lines = sorted(int(u.split(":")[1].split()[0]) for u in _private_upstream_uses(probe, root=tmp_path))
    assert lines == [1, 2, 3, 5, 6, 7, 8, 10], lines
