"""The accept-length gate's record: per draft position, the reference's and the engine's rates
against the allowed difference, and the accept length itself. difftest.compare.accept_judge judges
(and explains the statistics); this is what a check's data and the report store."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class PositionJudgement:
    position: int
    reference: float
    engine: float
    se: float
    numerical: float
    allowed: float
    ok: bool

    @property
    def z(self) -> float:
        d = abs(self.engine - self.reference)
        return d / self.se if self.se else (0.0 if d == 0 else float("inf"))


@dataclass
class AcceptGate:
    reference_accept: float
    engine_accept: float
    allowed_accept: float
    spread: float  # standard error of the accept-length difference
    numerical_accept: float | None  # the reference's measured float64 move of the accept length
    tolerance: float | None  # the case's declared accept-length tolerance, if any
    z: float  # the per-position limit
    positions: list[PositionJudgement]
    noise: str  # where the numerical part came from

    @property
    def accept_ok(self) -> bool:
        return abs(self.engine_accept - self.reference_accept) <= self.allowed_accept

    @property
    def ok(self) -> bool:
        return self.accept_ok and all(p.ok for p in self.positions)

    @property
    def collapsed(self) -> bool:
        return self.engine_accept < self.reference_accept - self.allowed_accept

    def first_failing_position(self) -> PositionJudgement | None:
        return next((p for p in self.positions if not p.ok), None)

    def summary(self) -> str:
        bad = self.first_failing_position()
        if bad is None:
            return f"every position within noise (|diff| <= {self.z:.2f} x se + measured numerical move; {self.noise})"
        way = "fell" if bad.engine < bad.reference else "rose"
        return (
            f"position {bad.position} acceptance {way} to {bad.engine:.3f} from {bad.reference:.3f} "
            f"(|diff| {abs(bad.engine - bad.reference):.3f} > allowed {bad.allowed:.3f} = {self.z:.2f} x se "
            f"{bad.se:.3f} + numerical {bad.numerical:.3f}; z {bad.z:.1f}; {self.noise})"
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        for p, src in zip(d["positions"], self.positions):
            p["z"] = src.z
        return d
