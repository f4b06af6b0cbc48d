"""The repository stands alone: no tracked text file cites a file outside it.

Scans every file ``git ls-files`` lists, except binary files and recorded benchmark output
(``benchmarks/results/``, ``benchmarks/artifacts/``: raw logs and JSON of past runs, kept as
they were written). Measured facts and design notes belong in ``docs/``.
"""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Written so that this file does not match its own patterns.
OUTSIDE_REFERENCES = [
    re.compile(r"\.\./shared"),                    # the sibling folder of the checkout
    re.compile(r"(?<![\w/])DESIGN\.md"),           # the design notes kept outside the repo
    re.compile(r"shared/probe[s]"),                # the measurement scripts kept outside the repo
    re.compile(r"/work/share[d]"),                 # the same folder by absolute path
]
SKIPPED_PREFIXES = ("benchmarks/results/", "benchmarks/artifacts/")


def _tracked_text_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in out.decode().split("\0"):
        if not name or name.startswith(SKIPPED_PREFIXES):
            continue
        path = ROOT / name
        if not path.is_file():          # deleted in the work tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            yield name, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def outside_references() -> list:
    """``"path:line: text"`` for every line of a tracked text file that cites a file outside the repo."""
    hits = []
    for name, text in _tracked_text_files():
        for lineno, line in enumerate(text.splitlines(), 1):
            if any(p.search(line) for p in OUTSIDE_REFERENCES):
                hits.append(f"{name}:{lineno}: {line.strip()}")
    return hits


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_no_reference_to_files_outside_the_repo():
    hits = outside_references()
    assert not hits, "tracked files cite files outside the repository (use docs/):\n" + "\n".join(hits)


def test_patterns_catch_the_known_forms():
    """The patterns match the forms used so far and leave in-repo paths alone."""
    design = "DESIGN" + ".md"          # split so that the scan above does not flag this file
    bad = ["see ../" + "shared/" + design, f"figures from ``{design}``", f"({design}, one H200)",
           "Script: shared/" + "probes/x.py", "/work/" + "shared/seeds"]
    good = ["docs/explanation/measured-facts.md", "docs/explanation/design.md", "benchmarks/README.md", "MY_DESIGN.md"]
    for s in bad:
        assert any(p.search(s) for p in OUTSIDE_REFERENCES), s
    for s in good:
        assert not any(p.search(s) for p in OUTSIDE_REFERENCES), s
