"""CheckResult: one check item's outcome on one engine, as the report stores it."""

from __future__ import annotations

from dataclasses import dataclass, field

from difftest.records.check_data import CheckData, decode_data
from difftest.records.fields import CHOICES, READER, decode, encode_fields, fail, join

SCHEMA_VERSION = 2
# not available: a check that cannot apply to the engine (a running server has no tensors);
# xfailed: a declared expected failure, caught with its cause (difftest.case.expected_failure)
OUTCOMES = ("passed", "failed", "error", "skipped", "not available", "xfailed")


@dataclass
class ExpectedFailureRecord:
    """The case's `expect_failure` entry that judged this result."""

    engine: str
    check: str
    cause: str
    reference: str | None = None  # the reference it is declared against (None: any)


@dataclass
class CheckResult:
    engine: str  # the engine spec id
    check: str
    outcome: str = field(metadata={CHOICES: OUTCOMES})
    message: str
    data: CheckData | None = field(default=None, metadata={READER: decode_data})  # by its `kind`
    expected_failure: ExpectedFailureRecord | None = None

    @property
    def failed(self) -> bool:
        return self.outcome in ("failed", "error")

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **encode_fields(self, omit_none=("data", "expected_failure"))}

    @classmethod
    def from_json(cls, data: object, where: str, at: str) -> "CheckResult":
        if isinstance(data, dict) and data.get("schema_version") != SCHEMA_VERSION:
            got = data.get("schema_version")
            if got is None:
                raise fail(where, join(at, "schema_version"), "field missing")
            raise fail(
                where,
                join(at, "schema_version"),
                f"check result schema version {got!r}; this difftest reads {SCHEMA_VERSION}",
            )
        return decode(cls, data, where, at, skip=("schema_version",))
