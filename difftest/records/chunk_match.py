"""How one fc chunk of an engine matches the reference's tensors (difftest.compare.diagnose finds them).

Its own module, free of torch and captures, so that the report's records (difftest.records) can
read the matches back without importing what computes them."""

from __future__ import annotations

from dataclasses import asdict, dataclass

MATCH_REL_DIFF = 1e-3  # a chunk "is" a reference tensor below this median per-token rel_diff (bf16 noise ~1e-5)
# Deep bfloat16 targets are noisier than that: on a Llama-3.1-8B-shaped random target the reference's own
# row error against float64 (its floor, difftest.compare.noise) is 0.05 at h.29, and a correct engine's
# chunk sits at a median rel_diff of 1.2e-3 from the layer it was fed, over MATCH_REL_DIFF, while the
# adjacent layer is 0.20 away (row error; rel_diff ~0.02). So each candidate's bound is
# max(MATCH_REL_DIFF, the rel_diff of a row error MATCH_FLOOR_FACTOR x its measured floor): two roundings
# of the same tensor (the reference's and the engine's) differ by at most twice the floor (triangle
# inequality), and the chunk's statistic is the median row while the floor is the 0.9 quantile. Not the
# verdict's SAFETY (10x): that reaches past the separation of adjacent deep layers (3.8x the floor at h.29).
MATCH_FLOOR_FACTOR = 2.0


def match_bound(floor: float) -> float:
    """The median rel_diff under which a chunk matches a candidate whose measured floor (row error against
    float64) is `floor`. rel_diff = |x - y|^2 / (|x|^2 + |y|^2) is e^2 / (2 + e^2) for a row error e
    orthogonal to the row (rounding)."""
    e2 = (MATCH_FLOOR_FACTOR * floor) ** 2
    return max(MATCH_REL_DIFF, e2 / (2 + e2))


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
    bound: float = MATCH_REL_DIFF  # the rel_diff under which the chunk matches `best` (match_bound of its floor)
    # the runner-up when it too lies within noise of the chunk (its rel_diff under the larger of the two
    # bounds): the measured noise cannot tell the two apart, so the chunk is named as neither
    also: str | None = None
    also_rel_diff: float | None = None

    @property
    def matched(self) -> bool:
        return self.rel_diff < self.bound and self.also is None

    @property
    def ambiguous(self) -> bool:
        return self.also is not None

    @property
    def correct(self) -> bool:
        return self.best == self.expected and self.matched

    def to_dict(self) -> dict:
        out = {**asdict(self), "matched": self.matched, "correct": self.correct}
        # absent reads as the fixed bound and no runner-up, as in reports written before them
        if out["bound"] == MATCH_REL_DIFF:
            del out["bound"]
        for k in ("also", "also_rel_diff"):
            if out[k] is None:
                del out[k]
        return out


@dataclass
class Similarity:
    """Every fc chunk against every candidate reference tensor: the heat map of the fc diagnosis."""

    chunks: list[str]  # "chunk 0", ...
    candidates: list[str]  # canonical names of the reference tensors
    cosine: list[list[float | None]]  # [chunk][candidate] mean per-token cosine (None: shapes differ)
