"""A report's files: the JSON record, and the Markdown and HTML rendered beside it from the record
alone. Above both renderers (difftest.report.writer's Markdown, difftest.report.html_report), which read the
record and never write."""

from __future__ import annotations

import json
from pathlib import Path

from difftest.report import html_report
from difftest.base.outputs import atomic_write
from difftest.records import Report
from difftest.report.writer import json_path, markdown


def write(report: Report, directory: Path) -> Path:
    """The report's JSON, then its Markdown and HTML; each file written whole or not at all."""
    path = json_path(report, directory)
    atomic_write(path, json.dumps(report.to_dict(), indent=1, default=str))
    render(report, directory)
    return path


def render(report: Report, directory: Path) -> tuple[Path, Path]:
    """Markdown and HTML beside the JSON, from the report alone."""
    stem = report.case.replace("/", "_")
    atomic_write(directory / f"{stem}.md", markdown(report))
    atomic_write(directory / f"{stem}.html", html_report.render(report))
    return directory / f"{stem}.md", directory / f"{stem}.html"
