"""Wiring: which target tensors an engine feeds its draft's fc, in which order, and how that was decided.

One record for the whole trip: the wiring presets build it (difftest.rules.wiring.resolve), an
engine records the one it fed in its capture meta (difftest.records.meta.CaptureMeta.wiring), and
comparison, diagnosis and reports read it back. It sits in the base floor because the rule data
that builds it may import no record (an import-linter contract: rule data is data) while the
records that store it sit above the base.

Its JSON is its fields in order, `inputs` as a list (difftest.records.fields.encode): the form
captures and baselines were written with before, so they still load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from difftest.base.names import hidden_index, short_name


@dataclass(frozen=True)
class Wiring:
    inputs: list[str] = field(default_factory=list)  # canonical names in fc order, e.g. ["target.h.2", "target.h.4"]
    source: str = ""  # one line: the preset, config ids or engine setting it came from
    verifier: str | None = (
        None  # the tensor the verifier reads (speculators presets, training data), where there is one
    )

    def layer_indices(self) -> list[int | None]:
        """k of each `target.h.{k}` input; None for target.final_norm."""
        return [hidden_index(n) for n in self.inputs]

    def short(self) -> str:
        return "[" + ", ".join(short_name(n) for n in self.inputs) + "]"
