"""The shape rules of ``xla_swap/`` (one idea per module), checked
on the source by ``test_package_shape``:

* no module over :data:`MAX_MODULE_LINES` lines, no function or method over :data:`MAX_FUNCTION_LINES`
  (its decorators, signature and docstring included), no module docstring over
  :data:`MAX_MODULE_DOCSTRING_LINES` lines (descriptions and run history live in ``docs/``);
* no module imports a private (``_``-prefixed) name of another ``xla_swap`` module, nor reads a private
  attribute of an object other than ``self`` / ``cls`` (``private_attribute_reads``);
* no run of six code lines stands to the letter in two places (``repeated_blocks``);
* no class has more than one base other than exceptions, warnings, protocols and ``Generic``
  (``multiple_bases``: a class holds its parts and calls them; it is not assembled from mixins);
* no circle of top-level imports (``import_cycles``);
* no attribute read through ``self`` in one module that only other modules set (``attributes_set_elsewhere``);
* no ``for`` statement over a schedule's steps (``x.steps``, ``x.timeline``, ``x.pass_steps(...)``) outside
  the streaming runtime's one executor (``schedule_step_loops``).
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "xla_swap"

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_MODULE_DOCSTRING_LINES = 40


def shape_violations(path: pathlib.Path, root: pathlib.Path = ROOT, max_lines: int = MAX_MODULE_LINES) -> list[str]:
    """``"file: what"`` for every size rule of the module docstring that ``path`` breaks."""
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    rel = path.relative_to(root)
    found = []
    lines = len(text.splitlines())
    if lines > max_lines:
        found.append(f"{rel}: {lines} lines (at most {max_lines})")
    doc = ast.get_docstring(tree, clean=False)
    if doc is not None and len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
        found.append(f"{rel}: module docstring of {len(doc.splitlines())} lines "
                     f"(at most {MAX_MODULE_DOCSTRING_LINES}; the rest belongs in docs/)")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - start + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{rel}:{node.lineno} {node.name} is {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def private_imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``"file:line module.name"`` for every ``from xla_swap... import _name`` (absolute or relative) in
    ``path``; ``xla_swap._compat`` is exempt (it exists to hold the private upstream APIs)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if not (node.level or module == "xla_swap" or module.startswith("xla_swap.")):
            continue
        if module.startswith("xla_swap._compat") or (node.level and "_compat" in path.parts):
            continue
        found += [f"{path.relative_to(root)}:{node.lineno} {'.' * node.level}{module}.{a.name}"
                  for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def _is_exempt_base(node: ast.expr) -> bool:
    """``self`` / ``cls`` / ``super()`` and ``torch.ops...`` (aten op names such as ``_unsafe_view``)."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super":
        return True
    while isinstance(node, ast.Attribute):
        if node.attr == "ops" and isinstance(node.value, ast.Name) and node.value.id == "torch":
            return True
        node = node.value
    return False


def private_attribute_reads(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``"file:line expr._name"`` for every ``x._name`` in ``path`` with ``x`` not ``self`` / ``cls`` /
    ``super()``; ``xla_swap/_compat`` (the private upstream APIs) and ``torch.ops.*`` are exempt."""
    if "_compat" in path.relative_to(root).parts:
        return []
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not _is_exempt_base(node.value)):
            found.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return found


#: bases that do not make a class a mixin: exception and warning classes, protocols and ``Generic``.
_EXEMPT_BASES = ("Protocol", "Generic", "Exception", "BaseException", "Warning")


def _is_exception_or_protocol(base: ast.expr) -> bool:
    """A base named ``...Error`` / ``...Exception`` / ``...Warning`` / ``BaseException``, ``Protocol`` or
    ``Generic`` (also subscripted or qualified: ``typing.Protocol``, ``Generic[T]``)."""
    if isinstance(base, ast.Subscript):
        base = base.value
    name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else ""
    return name in _EXEMPT_BASES or name.endswith(("Error", "Exception", "Warning"))


def multiple_bases(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``"file:line Name(A, B)"`` for every class in ``path`` with more than one base other than exceptions
    and protocols (:func:`_is_exception_or_protocol`; ``metaclass=`` and other keywords are not bases)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ClassDef):
            counted = [b for b in node.bases if not _is_exception_or_protocol(b)]
            if len(counted) > 1:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}"
                             f"({', '.join(ast.unparse(b) for b in node.bases)})")
    return found


def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line number, text with white space folded)`` of each code line of ``path``; blank,
    comment-only, import and lone-punctuation lines, and every line of a docstring, are left out."""
    text = path.read_text()
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(text, filename=str(path))):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        folded = " ".join(line.split("#", 1)[0].split()) if "'" not in line and '"' not in line \
            else " ".join(line.split())
        if n in doc_lines or not any(c.isalnum() for c in folded) or folded.startswith(("import ", "from ")):
            continue
        out.append((n, folded))
    return out


def repeated_blocks(paths, root: pathlib.Path = ROOT, min_lines: int = 6) -> list[str]:
    """``"a.py:10-15 ~ b.py:40-45"`` for every run of ``min_lines`` code lines (``_code_lines``: white
    space folded, comments, imports and docstrings left out) that stands to the letter in two places
    among ``paths``; the overlapping windows of one run are reported once."""
    seen: dict[tuple, tuple] = {}
    found, last = [], {}
    for path in paths:
        lines = _code_lines(path)
        rel = path.relative_to(root)
        for i in range(len(lines) - min_lines + 1):
            here = (rel, lines[i][0], lines[i + min_lines - 1][0])
            first = seen.setdefault(tuple(t for _, t in lines[i:i + min_lines]), here)
            if first is here or (first[0] == rel and first[2] >= here[1]):
                continue
            pair = (first[0], rel)
            if last.get(pair, -2) >= i - 1:     # the same run, one line further
                last[pair] = i
                continue
            last[pair] = i
            found.append(f"{first[0]}:{first[1]}-{first[2]} ~ {rel}:{here[1]}-{here[2]}")
    return found


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """The modules ``name``'s top-level statements import (not those inside functions or
    ``if TYPE_CHECKING:``): absolute names, relative ones resolved; ``from m import x`` gives ``m.x`` and ``m``."""
    out = set()
    base = name.split(".") if is_package else name.split(".")[:-1]

    def visit(stmts):
        for node in stmts:
            if isinstance(node, ast.If):
                test = node.test
                if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
                        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
                    continue
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                out.update(f"{mod}.{a.name}" for a in node.names)
                out.add((mod,))   # the module itself, unless every name is a submodule (import_cycles decides)
    visit(tree.body)
    return out


def import_cycles(paths, root: pathlib.Path = ROOT) -> list[str]:
    """``"a -> b -> a"`` for each circle of top-level imports among the modules ``paths`` (a package's
    ``__init__`` counts as the package; importing ``p.m`` also runs ``p``'s ``__init__``, which is not followed)."""
    graph = {}
    for p in paths:
        name = _module_name(p, root)
        graph[name] = _top_level_imports(ast.parse(p.read_text(), filename=str(p)), name, p.name == "__init__.py")
    def resolve(deps):
        names = {d for d in deps if isinstance(d, str)}
        froms = {d[0] for d in deps if isinstance(d, tuple)}
        # ``from pkg import mod`` imports pkg.mod (and runs pkg's __init__ first, which is not a circle of pkg's)
        froms = {f for f in froms if not any(n.startswith(f + ".") and n in graph for n in names)}
        return names | froms
    graph = {m: sorted(d for d in resolve(deps) if d in graph and d != m) for m, deps in graph.items()}
    found, state = [], {}

    def walk(m, stack):
        state[m] = "open"
        stack.append(m)
        for d in graph[m]:
            if state.get(d) == "open":
                found.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                walk(d, stack)
        stack.pop()
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            walk(m, [])
    return found


def _names_setattr(func: ast.expr) -> bool:
    """``setattr`` or ``object.__setattr__``."""
    return isinstance(func, ast.Name) and func.id == "setattr" or \
        isinstance(func, ast.Attribute) and func.attr == "__setattr__"


def _self_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """``(set here, read here)``: attribute names assigned through ``self`` / ``cls`` (or defined as a
    method, property or class attribute of a class of this module), and names read through them."""
    sets, reads = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    sets.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    sets.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            (sets if isinstance(node.ctx, (ast.Store, ast.Del)) else reads).add(node.attr)
        elif isinstance(node, ast.Call) and _names_setattr(node.func) and len(node.args) > 1 \
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "self" \
                and isinstance(node.args[1], ast.Constant):
            sets.add(node.args[1].value)
    return sets, reads


#: names a class reads through ``self`` from an upstream base (``torch.nn.Module.modules``), which some
#: ``xla_swap`` class also happens to set.
UPSTREAM_ATTRIBUTES = frozenset({"modules"})


def attributes_set_elsewhere(paths, root: pathlib.Path = ROOT) -> list[str]:
    """``"file self.name (set in other files)"`` for each name a module reads through ``self`` that it
    neither sets nor defines while other modules of ``paths`` set it through ``self``: a class that reads
    state another file's class sets (a mixin, or a subclass leaning on its base's internals)."""
    names = {p: _self_names(ast.parse(p.read_text(), filename=str(p))) for p in paths}
    setters: dict[str, set] = {}
    for p, (sets, _) in names.items():
        for n in sets:
            setters.setdefault(n, set()).add(p)
    found = []
    for p, (sets, reads) in sorted(names.items()):
        for n in sorted(reads - sets - UPSTREAM_ATTRIBUTES):
            if n in setters:
                others = ", ".join(sorted(str(o.relative_to(root)) for o in setters[n]))
                found.append(f"{p.relative_to(root)} self.{n} (set in {others})")
    return found


#: the one module that loops over a ``PrefetchSchedule``'s steps (every pass runs through it).
EXECUTOR_MODULE = PACKAGE / "executors" / "streaming" / "executor.py"

#: what a loop over a schedule's steps iterates: ``x.steps``, ``x.timeline`` or ``x.pass_steps(...)``.
_STEP_ATTRIBUTES = ("steps", "timeline")


def _iterates_schedule_steps(node: ast.expr) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pass_steps":
        return True
    return isinstance(node, ast.Attribute) and node.attr in _STEP_ATTRIBUTES


def schedule_step_loops(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``"file:line for target in iter"`` for every ``for`` statement of ``path`` over a schedule's steps
    (``x.steps``, ``x.timeline``, ``x.pass_steps(...)``; comprehensions that read the schedule as data are
    not loops that execute it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.For, ast.AsyncFor)) and _iterates_schedule_steps(node.iter):
            found.append(f"{path.relative_to(root)}:{node.lineno} for {ast.unparse(node.target)} in "
                         f"{ast.unparse(node.iter)}")
    return found
