"""RoutingLayer: how an engine routed one prompt's tokens at one MoE layer against the reference
(`comparisons.<engine>[i].routing` of the report JSON; difftest.compare.noise.routing_rows builds it).

Rows whose expert set differs from the reference's are judged apart from the wiring verdict where
the reference's own routing margin says the decision was a near-tie (`apart`); a row that went to
other experts where the margin is clear (`clear`) is a divergence of the tensor the layer writes.
An engine whose capture holds no expert ids (`observed` False) is judged on the reference's margin
alone: every near-tie row is judged apart, and `differs`/`agreement` are None.
"""

from __future__ import annotations

from dataclasses import dataclass

from difftest.records.fields import encode_fields


@dataclass
class RoutingLayer:
    layer: int  # the MoE decoder layer k (its output is target.h.{k+1})
    rows: int  # tokens routed
    observed: bool  # the engine's capture holds the experts it chose (aux.router.{k}.experts)
    near_tie: int  # rows whose reference routing margin lies within the router's measured noise
    apart: int  # rows judged apart from here on: other experts at a near-tie (not observed: every near-tie)
    clear: int  # rows sent to other experts where the reference's margin is clear: a divergence
    differs: int | None = None  # rows whose expert set differs from the reference's; None: not observed
    agreement: float | None = None  # mean over rows of |engine's top-k set & reference's| / k; None: not observed
    min_agreement: float | None = None  # the lowest row's

    def to_dict(self) -> dict:
        return encode_fields(self, omit_none=("differs", "agreement", "min_agreement"))

    def line(self) -> str:
        """One line for the Markdown and the check messages."""
        if not self.observed:
            return (
                f"layer {self.layer}: expert ids not captured by the engine; {self.near_tie}/{self.rows} rows at a "
                f"reference near-tie judged apart"
            )
        text = (
            f"layer {self.layer}: expert-set agreement {self.agreement:.3f} (lowest row {self.min_agreement:.3f}); "
            f"{self.differs}/{self.rows} rows routed to other experts: {self.apart} at a reference near-tie "
            f"(judged apart)"
        )
        return text + (f", {self.clear} where the reference's margin is clear (a divergence)" if self.clear else "")
