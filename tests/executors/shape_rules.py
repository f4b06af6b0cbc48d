"""The shape rules of ``xla_swap/`` (one idea per module), checked
on the source by ``test_package_shape``:

* no module over :data:`MAX_MODULE_LINES` lines, no function or method over :data:`MAX_FUNCTION_LINES`
  (its decorators, signature and docstring included), no module docstring over
  :data:`MAX_MODULE_DOCSTRING_LINES` lines (descriptions and run history live in ``docs/``);
* no module imports a private (``_``-prefixed) name of another ``xla_swap`` module, nor reads a private
  attribute of an object other than ``self`` / ``cls`` (``private_attribute_reads``);
* no run of six code lines stands to the letter in two places (``repeated_blocks``);
* no class has more than one base other than exceptions, warnings, protocols and ``Generic``
  (``multiple_bases``: a class holds its parts and calls them; it is not assembled from mixins).
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
