"""What a case declares it tolerates: TolerancePair (`tolerances.<pattern>`, `expect.accept_length`)
and Expectations (`expect:`), records from the moment the case file is read
(difftest.case.case_schema builds them; difftest.compare.tolerances and the checks read them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, overload


@dataclass(frozen=True)
class TolerancePair:
    """{atol, rtol}, each finite and >= 0; one left out (None) keeps what applies without it (the
    dtype's default for a tensor pattern, 0 for the accept length)."""

    atol: float | None = None
    rtol: float | None = None

    @classmethod
    def from_dict(cls, d: dict) -> TolerancePair:
        return cls(d.get("atol"), d.get("rtol"))


@dataclass(frozen=True)
class Expectations:
    """A case's `expect:`: the core checks' thresholds, and those of the checks engines contribute."""

    top1_agreement: float | None = None  # the fraction of clear positions that must agree; None: the check's
    accept_length: TolerancePair | None = None  # widens the accept-length gate; None: the noise alone
    # `expect.<check>` of a check an engine contributes (difftest.base.check_registry.CheckSpec.expect):
    # the keys it declares, as given
    contributed: dict[str, dict[str, float]] = field(default_factory=dict)

    def given(self) -> tuple[str, ...]:
        """The names of the expectations the case sets."""
        core = tuple(n for n in ("top1_agreement", "accept_length") if getattr(self, n) is not None)
        return core + tuple(self.contributed)

    @overload
    def get(self, name: Literal["top1_agreement"], default: float) -> float: ...
    @overload
    def get(self, name: Literal["accept_length"], default: None = None) -> TolerancePair | None: ...
    @overload
    def get(self, name: str, default: Any = None) -> Any: ...
    def get(self, name: str, default: Any = None) -> Any:
        """By check name, for a check that knows only its name (one an engine contributes); `default`
        where the case sets none."""
        value = getattr(self, name) if name in ("top1_agreement", "accept_length") else self.contributed.get(name)
        return default if value is None else value

    @classmethod
    def from_dict(cls, d: dict) -> Expectations:
        accept = d.get("accept_length")
        return cls(
            d.get("top1_agreement"),
            None if accept is None else TolerancePair.from_dict(accept),
            {k: dict(v) for k, v in (d.get("contributed") or {}).items()},
        )
