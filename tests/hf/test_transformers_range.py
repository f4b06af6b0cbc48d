"""The installed ``transformers`` is inside ``pyproject.toml``'s declared range, and is the version the run
was meant to test: ``make test-transformers-low`` sets ``XLA_SWAP_TRANSFORMERS`` to the bottom of the range
(``.venv-tf-low``, put first on ``PYTHONPATH``) and runs this module with the family and generation tests,
so a run that silently imported ``.venv``'s newest release instead fails here."""
import os
import pathlib
import tomllib

import pytest

transformers = pytest.importorskip("transformers")
from packaging.requirements import Requirement  # noqa: E402
from packaging.version import Version  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def declared():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "transformers"]
    return req.specifier


def test_installed_transformers_in_declared_range():
    assert Version(transformers.__version__) in declared(), (transformers.__version__, str(declared()))


def test_transformers_is_the_one_asked_for():
    """Under ``XLA_SWAP_TRANSFORMERS`` (the low-end target): that version is the one imported, and it is the
    range's lower bound (``>=``)."""
    want = os.environ.get("XLA_SWAP_TRANSFORMERS")
    if not want:
        pytest.skip("XLA_SWAP_TRANSFORMERS is not set (make test-transformers-low sets it)")
    assert transformers.__version__ == want
    (low,) = [s.version for s in declared() if s.operator == ">="]
    assert Version(low) == Version(want)
