"""What the tests that build Hugging Face models expect at each end of ``pyproject.toml``'s transformers range.

``make test`` runs them on the newest release (``.venv``), ``make test-transformers-low`` on the bottom
(``.venv-tf-low``). Where the bottom lacks what the stages need, the test expects the refusal, with its
message, below the first tested version that has it; from that version on it runs the full check, unchanged:

* a family :data:`xla_swap.hf.refusals.NEEDS_TRANSFORMERS` lists (CodeGen) is refused by name below its version
  (:func:`needs_newer`);
* Phi-3's longrope below :data:`LONGROPE_TRACED_FROM` picks its short or long factors with a Python branch on
  the largest position id (``if seq_len > original_max_position_embeddings``), which a traced stage cannot
  express: refused at construction naming that code (:data:`LONGROPE_REFUSAL`); from it on, a ``torch.where``;
* a model type the installed transformers does not have yet (:data:`ADDED_IN`) is skipped, naming why.
"""
import pytest
import transformers
from packaging.version import Version

from xla_swap.hf.refusals import NEEDS_TRANSFORMERS

#: the first tested transformers version whose longrope rotary embedding traces (``torch.where``).
LONGROPE_TRACED_FROM = "5.24"
#: pieces of the refusal of a longrope model below :data:`LONGROPE_TRACED_FROM` (at ``SwappedStack``).
LONGROPE_REFUSAL = ("Phi3Model.forward does not trace: the model's code in Phi3RotaryEmbedding."
                    "longrope_frequency_update (transformers/modeling_rope_utils.py:",
                    "uses a Python branch, size or index computed from a tensor's value (data-dependent control flow)")
#: model types newer than the bottom of the range: model type -> the first tested version that has it.
ADDED_IN = {"inkling2_text": "5.24"}


def older_than(version: str) -> bool:
    """Whether the installed transformers is older than ``version`` (a string such as ``"5.24"``)."""
    return Version(transformers.__version__) < Version(version)


def needs_newer(cls_name: str):
    """The refusal :func:`xla_swap.hf.refusals.refuse_old_transformers` gives causal LM class ``cls_name`` under
    the installed transformers (the whole message), or ``None`` where that version is new enough."""
    need = NEEDS_TRANSFORMERS.get(cls_name)
    version = ".".join(map(str, need[0])) if need else None
    if version is None or not older_than(version):
        return None
    return (f"{cls_name} needs transformers >= {version} in the stages ({need[1]}); "
            f"installed {transformers.__version__}")


def skip_if_absent(model_type: str) -> None:
    """Skip the test where the installed transformers is older than the one that added ``model_type``
    (:data:`ADDED_IN`); from that version on, a missing model type fails where the test builds it."""
    if model_type in ADDED_IN and older_than(ADDED_IN[model_type]):
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r} "
                    f"(first tested in {ADDED_IN[model_type]})")
