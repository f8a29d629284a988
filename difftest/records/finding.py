"""One lint finding: what an engine would silently do differently with a draft checkpoint."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Finding:
    code: str
    severity: str  # "error" | "warning"
    message: str
    engines: tuple[str, ...] = ()  # the engines (difftest.rules.draft_rules) that compute the draft differently
    tensor: str | None = None  # the first draft tensor the fault changes, where one can be named
    # checkpoint tensor-name prefixes the fault concerns: an engine error naming one of them
    # (a loader refusing a weight) is explained by this finding
    weights: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.severity} [{self.code}]: {self.message}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["engines"] = list(self.engines)
        d["weights"] = list(self.weights)
        return d
