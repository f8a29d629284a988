"""How one fc chunk of an engine matches the reference's tensors (difftest.compare.diagnose finds them).

Its own module, free of torch and captures, so that the report's records (difftest.records) can
read the matches back without importing what computes them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

MATCH_REL_DIFF = 1e-3  # a chunk "is" a reference tensor below this median per-token rel_diff (bf16 noise ~1e-5)


@dataclass
class ChunkMatch:
    chunk: int
    expected: str | None  # reference wiring at this slot
    best: str  # reference tensor the engine's chunk matches best (maybe "rmsnorm(target.h.k)")
    cosine: float  # mean per-token cosine against `best`
    min_cosine: float  # worst token
    rel_diff: float  # median per-token rel_diff against `best` (difftest.compare.diagnose._score: why not the mean)
    max_abs: float
    norm: float  # mean per-token RMS of the engine's chunk
    norm_spread: float  # its standard deviation over tokens
    expected_norm: float | None = None  # mean per-token RMS of the expected reference tensor

    @property
    def matched(self) -> bool:
        return self.rel_diff < MATCH_REL_DIFF

    @property
    def correct(self) -> bool:
        return self.best == self.expected and self.matched

    def to_dict(self) -> dict:
        return {**asdict(self), "matched": self.matched, "correct": self.correct}


@dataclass
class Similarity:
    """Every fc chunk against every candidate reference tensor: the heat map of the fc diagnosis."""

    chunks: list[str]  # "chunk 0", ...
    candidates: list[str]  # canonical names of the reference tensors
    cosine: list[list[float | None]]  # [chunk][candidate] mean per-token cosine (None: shapes differ)
