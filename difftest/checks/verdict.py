"""A check's outcome: passed or not, the message a user reads, and data for the report.

Its own module so that checks contributed by engines (difftest.base.extensions) return one without
importing the core's checks, and the core's checks need none of theirs."""

from __future__ import annotations

from dataclasses import dataclass

from difftest.records.check_data import CheckData


@dataclass
class Verdict:
    passed: bool
    message: str
    data: CheckData | None = None  # the check's own record (difftest.records.check_data), stored in the report
