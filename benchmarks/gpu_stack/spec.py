"""What one measuring process needs to know, as JSON-serialisable frozen dataclasses.

:class:`RunSpec` holds the stack's sizes and the measurement settings; :class:`ChildSpec`
adds the variant, its token counts and where to write the result. The driver writes a
``ChildSpec`` to a file and starts ``python -m benchmarks.gpu_stack --child FILE``; the child
reads it back (no command line is rebuilt). Standard library only.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

__all__ = ["RunSpec", "ChildSpec", "parse_chunks", "DEFAULT_ARTIFACTS", "ARTIFACT_DTYPE"]

#: The torch_xla artifacts' default directory (``benchmarks/export_torch_xla_stack.py`` writes it).
DEFAULT_ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
#: The stack's dtype as the torch_xla artifacts name it.
ARTIFACT_DTYPE = "bf16"


def parse_chunks(spec, tokens) -> dict:
    """``["4"]`` or ``["8192=1,2", "32768=4,1"]`` -> ``{T: (first, last)}`` for every T in ``tokens``.

    Raises: ValueError naming the bad item, or a token count without a chunk count.
    """
    if len(spec) == 1 and "=" not in spec[0]:
        try:
            n = int(spec[0])
        except ValueError:
            raise ValueError(f"expected N or TOKENS=FIRST,LAST, got {spec[0]!r}") from None
        return {t: (n, n) for t in tokens}
    plan = {}
    for item in spec:
        t, _, fl = item.partition("=")
        try:
            first, last = (int(v) for v in fl.split(","))
            plan[int(t)] = (first, last)
        except ValueError:
            raise ValueError(f"expected N or TOKENS=FIRST,LAST, got {item!r}") from None
    missing = [t for t in tokens if t not in plan]
    if missing:
        raise ValueError(f"no chunk counts for token counts {missing}")
    return plan


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The stack and the measurement settings of one run (every process of it gets the same).

    Attributes:
      d, f, layers: model width D, FFN width F, number of layers L (the stack of
        ``workload.Workload``: ``L`` layers of ``a: (D, F)``, ``b: (F, D)`` bfloat16).
      tokens: the token counts T (inputs ``(T, D)`` bfloat16), as given.
      reps, warmup: timed and untimed calls per measurement.
      seed: the weights' and inputs' random seed.
      bw_mib: bandwidth buffer size in MiB; ``None``: buffers shaped like the weights.
      chunks: ``(T, first, last)`` per token count: column chunks of the first and last layer
        in the ``chunked`` variants (1: not split).
      flag_search: time the ``flag_search`` variants again under every XLA flag set.
      trace: one extra, untimed, traced call of the streaming variants (``"trace"`` in the row).
      artifacts_dir: the torch_xla-lowered protos and sidecars.
      weights_cache: the directory of the run's ``.npy`` weight cache, or ``None`` (generate).

    Raises:
      ValueError: a size, ``reps``, a token count or a chunk count < 1 (``warmup`` < 0); a
        chunk count that does not divide ``f``; a token count without chunk counts. The
        message names the field.
    """

    d: int = 8192
    f: int = 32768
    layers: int = 8
    tokens: tuple = (8192, 32768)
    reps: int = 5
    warmup: int = 1
    seed: int = 0
    bw_mib: int | None = None
    chunks: tuple = ((8192, 4, 4), (32768, 4, 4))
    flag_search: bool = True
    trace: bool = True
    artifacts_dir: str = str(DEFAULT_ARTIFACTS)
    weights_cache: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "chunks", tuple(tuple(int(v) for v in c) for c in self.chunks))
        for name in ("d", "f", "layers", "reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.tokens or any(t < 1 for t in self.tokens):
            raise ValueError(f"tokens must be counts >= 1, got {list(self.tokens)}")
        if self.bw_mib is not None and self.bw_mib < 1:
            raise ValueError(f"bw_mib must be >= 1 or None, got {self.bw_mib}")
        for c in self.chunks:
            if len(c) != 3 or c[1] < 1 or c[2] < 1 or self.f % c[1] or self.f % c[2]:
                raise ValueError(f"chunks: (tokens, first, last) with counts >= 1 dividing f ({self.f}), got {c}")
        missing = [t for t in self.tokens if t not in {c[0] for c in self.chunks}]
        if missing:
            raise ValueError(f"chunks: no chunk counts for token counts {missing}")

    @property
    def weight_bytes(self) -> int:
        """Bytes of all the stack's weights: ``layers * 2 * d * f * 2`` (bfloat16)."""
        return self.layers * 2 * self.d * self.f * 2

    def chunk_plan(self, tokens: int) -> tuple[int, int]:
        """``(first, last)`` chunk counts at ``tokens``. Raises KeyError for a token count not in the run."""
        for t, first, last in self.chunks:
            if t == tokens:
                return first, last
        raise KeyError(f"no chunk counts for {tokens} tokens")

    def replace(self, **changes) -> "RunSpec":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """JSON-ready dict of the fields (tuples as lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict) -> "RunSpec":
        """The inverse of :meth:`to_dict`. Raises TypeError for an unknown field, ValueError as the constructor."""
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    """One measuring process: ``variant`` (a variant or group name, or ``"weights"``) at ``tokens``
    (``None`` for bandwidth and weights) with ``run``'s settings; results go to ``result_file``."""

    run: RunSpec
    variant: str
    tokens: tuple | None
    result_file: str

    def to_json(self) -> str:
        """The spec as a JSON text."""
        return json.dumps({"run": self.run.to_dict(), "variant": self.variant,
                           "tokens": None if self.tokens is None else list(self.tokens),
                           "result_file": self.result_file})

    @classmethod
    def from_json(cls, text: str) -> "ChildSpec":
        """The inverse of :meth:`to_json`. Raises ValueError (bad JSON or field values), KeyError (a missing key)."""
        d = json.loads(text)
        tokens = d["tokens"]
        return cls(RunSpec.from_dict(d["run"]), d["variant"], None if tokens is None else tuple(tokens),
                   d["result_file"])
