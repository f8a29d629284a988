"""TensorDiff: one tensor's comparison with the reference, a row of a report's comparisons
(`comparisons[engine][prompt].tensors`), and TensorStatus, the one vocabulary of its verdicts.

difftest.compare.compare computes it; the report, the HTML, the session summary and the upgrade check read
it back as this record. Its JSON is the dataclass's fields, unchanged since report schema version 2;
a row that lacks the noise numbers (one written before the noise criterion, or a hand-made one) is
read with the defaults, `criterion` "" (not recorded) and `differs` derived from its |diff|.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from difftest.records.fields import decode


class TensorStatus(enum.StrEnum):
    """A tensor's verdict. A str: it is written to JSON and compared as its value."""

    OK = "ok"  # compared, within noise (or within the case's tolerance)
    MISMATCH = "mismatch"  # compared, above noise (or outside the case's tolerance)
    MISSING = "missing"  # the engine did not capture it
    ALLOWED_MISSING = "allowed-missing"  # not captured, and the case's allow_missing says so
    SHAPE = "shape"  # captured with another shape: not comparable
    TIE = "tie"  # a later draft step after a tie: computed on another token, not compared

    @property
    def passes(self) -> bool:
        """The verdict does not fail the tensor."""
        return self in (TensorStatus.OK, TensorStatus.ALLOWED_MISSING, TensorStatus.TIE)

    @property
    def above_noise(self) -> bool:
        """The tensor fails: above noise, not captured or not comparable."""
        return self in (TensorStatus.MISMATCH, TensorStatus.MISSING, TensorStatus.SHAPE)

    @property
    def compared(self) -> bool:
        """Values were compared: the row carries numbers, not only a `detail`."""
        return self in (TensorStatus.OK, TensorStatus.MISMATCH)


NOISE = "noise"  # TensorDiff.criterion of a tensor judged against the noise floor
NOT_RECORDED = ""  # ... of a row written before the noise criterion
MEASURED_FLOOR = "measured floor"  # TensorDiff.floor_basis of a tensor whose own floor was measured


@dataclass
class TensorDiff:
    name: str
    status: TensorStatus
    shape: list[int] = field(default_factory=list)
    numel: int = 0
    mismatched: int = 0
    max_abs: float = 0.0
    max_abs_index: list[int] = field(default_factory=list)
    ref_value: float = 0.0
    other_value: float = 0.0
    max_rel: float = 0.0
    mean_abs: float = 0.0
    cosine: float = 1.0
    rel_diff: float = 0.0  # SGLang's dump comparator: 1 - 2 sum(xy) / sum(x^2 + y^2)
    nonfinite_mismatch: int = 0  # NaN anywhere, or an infinity the other side lacks
    tolerance: str = ""
    detail: str = ""
    # NaN/Inf counts per side (equal infinities, e.g. -inf outside the draft vocab, are not errors)
    nan_ref: int = 0
    nan_other: int = 0
    inf_ref: int = 0
    inf_other: int = 0
    # per-token (per-row: every leading dim flattened) error profile
    rows: int = 0
    rows_mismatched: int = 0
    worst_row: int = -1
    row_max_abs: list[float] = field(default_factory=list)
    row_mismatched: list[int] = field(default_factory=list)
    row_cosine: list[float] = field(default_factory=list)
    # logits tensors only (difftest.compare.compare.is_logits): distribution metrics over rows, softmax over the last dim
    topk: int = 0  # 0: not computed
    top1_agree: int = 0  # rows where the reference's top-1 is also the engine's (no engine logit above it)
    topk_member: int = 0  # rows whose reference top-1 is within the engine's top-k
    kl_mean: float = 0.0  # KL(softmax(ref) || softmax(engine)), nats, mean over rows
    kl_max: float = 0.0
    tv_mean: float = 0.0  # total variation distance, mean over rows
    tv_max: float = 0.0
    # the verdict (difftest.compare.noise): per-row relative error ||engine - ref|| / ||ref|| against the
    # threshold derived from the measured noise floor
    criterion: str = NOISE  # NOISE | "elementwise (case tolerance PATTERN)" | NOT_RECORDED
    err: float = 0.0  # largest per-row relative error
    err_q: float = 0.0  # its FLOOR_QUANTILE quantile over rows
    noise_floor: float = 0.0  # the reference's own per-row error against float64 (quantile)
    # what noise_floor is: measured on this tensor, or where it fell back (difftest.compare.compare.floor_basis)
    floor_basis: str = MEASURED_FLOOR
    threshold: float = 0.0
    rows_above: int = 0  # rows whose error exceeds the threshold
    excess: float = 0.0  # err / threshold (noise units; > 1: above noise)
    introduced: bool = False  # above noise and not explained by its inputs (difftest.compare.noise)
    row_err: list[float] = field(default_factory=list)  # per-row relative error profile
    differs: bool = False  # any element not bit-identical

    def __post_init__(self) -> None:
        self.status = TensorStatus(self.status)  # a plain string names a member; anything else is refused

    @property
    def ok(self) -> bool:
        return self.status.passes

    @property
    def by_noise(self) -> bool:
        """Judged against the noise floor (not elementwise by a case tolerance, not an older row)."""
        return self.criterion == NOISE

    @property
    def has_noise_numbers(self) -> bool:
        return self.criterion != NOT_RECORDED

    def summary(self) -> str:
        """One line on the elementwise statistics (information, or the verdict under a case tolerance)."""
        if not self.status.compared:
            return f"{self.name}: {self.detail}"
        pct = 100.0 * self.mismatched / max(self.numel, 1)
        idx = ", ".join(map(str, self.max_abs_index))
        head = (
            f"{self.name}: {self.mismatched}/{self.numel} elements ({pct:.1f}%) outside {self.tolerance}"
            if self.mismatched
            else f"{self.name}: all {self.numel} elements within {self.tolerance}"
        )
        text = (
            f"{head}; greatest |diff| {self.max_abs:.4g} at [{idx}] (reference {self.ref_value:.4g}, "
            f"engine {self.other_value:.4g}); cos {self.cosine:.4f}, rel_diff {self.rel_diff:.2e}"
            + (f"; {self.nonfinite_mismatch} NaN/Inf mismatches" if self.nonfinite_mismatch else "")
        )
        if self.mismatched and self.rows > 1:
            text += f"; rows off {self.rows_mismatched}/{self.rows} (worst row {self.worst_row})"
        if self.topk and self.mismatched:
            text += (
                f"; top-1 agree {self.top1_agree}/{self.rows}, reference top-1 in engine top-{self.topk} "
                f"{self.topk_member}/{self.rows}, KL mean {self.kl_mean:.3g} max {self.kl_max:.3g}, "
                f"TV mean {self.tv_mean:.3g} max {self.tv_max:.3g}"
            )
        return text

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["status"] = self.status.value
        if out["floor_basis"] == MEASURED_FLOOR:  # absent reads as measured, as in reports written before it
            del out["floor_basis"]
        for key in ("shape", "max_abs_index", "row_max_abs", "row_mismatched", "row_cosine", "row_err"):
            out[key] = list(out[key])
        return out

    @classmethod
    def from_json(cls, data: object, where: str, at: str) -> "TensorDiff":
        if isinstance(data, dict) and "criterion" not in data:
            data = {"criterion": NOT_RECORDED, **data}
        if isinstance(data, dict) and "differs" not in data:
            moved = data.get("max_abs", 0) != 0 or bool(data.get("nonfinite_mismatch"))
            data = {**data, "differs": moved}
        return decode(cls, data, where, at)
