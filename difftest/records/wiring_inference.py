"""WiringInference: what `wiring: infer` concluded from the draft's own behaviour (difftest.rules.infer_wiring
searches; difftest.run.infer_case runs it for a case), kept in the report (`wiring_inference`) and in the
capture item's data. Its JSON is the dataclasses' fields, as dataclasses.asdict wrote them before.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from difftest.base.names import short_name

Z_DECIDE = 3.0  # standard errors a contrast must reach to count (difftest.rules.infer_wiring's docstring)


def _num(x: float | None) -> str:
    return "not in the evidence" if x is None else f"{x:.2f}"


def short(w: Sequence[str]) -> str:
    return "[" + ", ".join(short_name(n) for n in w) + "]"


@dataclass
class SlotContrast:
    slot: int
    chosen: str
    alternative: str  # the best other tensor for this slot, others fixed
    alternative_agreement: float
    drop: float  # agreement(best) - agreement(alternative)
    z: float  # McNemar z of the agreement drop
    z_logp: float  # paired z of the drop in the log-probability of the target's token

    @property
    def decided_by(self) -> str | None:
        if self.z >= Z_DECIDE:
            return "agreement"
        return "log-probability" if self.z_logp >= Z_DECIDE else None


@dataclass
class Reading:
    engine: str
    wiring: list[str] | None  # None: that engine cannot serve these ids
    agreement: float | None


@dataclass
class WiringInference:
    decided: bool
    wiring: list[str]  # the best wiring found (trusted only when decided)
    agreement: float
    runner_up: list[str] | None
    runner_up_agreement: float | None
    margin: float | None
    margin_z: float | None
    readings: list[Reading]
    slots: list[SlotContrast]
    shuffled_agreement: float
    shuffled_z: float
    positions: int
    forwards: int
    grid_size: int  # what the full grid would have cost
    source: str
    label_source: str
    reasons: list[str] = field(default_factory=list)  # why it cannot tell (empty when decided)

    def short(self) -> str:
        return short(self.wiring)

    def headline(self) -> str:
        readings = "; ".join(
            f"the config reads as {short(r.wiring)} in {r.engine} ({_num(r.agreement)})"
            if r.wiring
            else f"{r.engine} cannot serve the config's ids"
            for r in self.readings
        )
        if self.decided:
            head = f"trained on {self.short()} (agreement {self.agreement:.2f})"
            if self.runner_up is not None:
                head += f"; runner-up {short(self.runner_up)} ({self.runner_up_agreement:.2f}, margin {self.margin:.2f}, z {self.margin_z:.1f})"
        else:
            head = f"cannot tell what the draft was trained on: {self.reasons[0]}"
            head += f" (best found {self.short()}, agreement {self.agreement:.2f})"
        return head + (f"; {readings}" if readings else "")

    def lines(self) -> list[str]:
        out = [self.headline()]
        for s in self.slots:
            how = f"; pinned by {s.decided_by}" if s.decided_by else "; not pinned"
            out.append(
                f"slot {s.slot}: {short_name(s.chosen)}; moved alone to {short_name(s.alternative)} agreement "
                f"drops {s.drop:+.3f} to {s.alternative_agreement:.3f} (z {s.z:.1f}; log-probability z "
                f"{s.z_logp:.1f}){how}"
            )
        out.append(
            f"features from unrelated positions: agreement {self.shuffled_agreement:.3f} (z {self.shuffled_z:.1f})"
        )
        out += [f"cannot tell: {r}" for r in self.reasons[1:]]
        out.append(
            f"evidence: {self.source}; labels: {self.label_source}; {self.positions} positions; "
            f"{self.forwards} draft forwards (full grid: {self.grid_size}); decided at z >= {Z_DECIDE:g}"
        )
        return out

    def to_dict(self) -> dict:
        return asdict(self)
