"""`difftest versions REPORT_DIR...`: EAGLE-3 behaviour by engine release, read from real runs.

A run of the shipped cases over several releases of an engine (`pytest cases/
--engines=ref,sglang@0.5.9,sglang,...`, which scripts/version-matrix makes for every installed
release) leaves one report per case. This turns them into one table: per case and release, what
the release really did with that draft, measured against the reference: the hidden states it fed
fc (by value, not by its config), where its draft first computed something else (a norm flag it
ignored shows at that flag's first tensor), its accept length, or the error it refused the draft
with. Beside each measured cell, the release's rules (difftest.rules.engine_releases) say what was
predicted; a cell that disagrees is marked.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from difftest.rules import engine_releases
from difftest.base import exit_codes
from difftest.base.errors import ConfigError, DifftestError
from difftest.base.jsonfile import read_json
from difftest.records.check_data import AcceptLengthData, ServerAcceptData
from difftest.records.report import Report


@dataclass(frozen=True)
class Cell:
    """One release on one case."""

    case: str
    engine: str  # "sglang"
    release: str  # "0.5.23"
    spec: str  # the engine spec id of the run ("sglang@0.5.9")
    fed: list[str | None] | None  # reference tensors the fc chunks were, by value
    draft: str  # "as ref", "differs from draft.fc_out", or why it was not compared
    accept: float | None
    reference_accept: float | None
    refused: str | None  # the engine's error, first line

    def text(self) -> str:
        if self.refused:
            return f"refused: {self.refused}"
        fed = "[" + ", ".join(_short(n) for n in self.fed) + "]" if self.fed else "?"
        al = f"; AL {self.accept:.2f}" if self.accept is not None else ""
        return f"fed {fed}; draft {self.draft}{al}"


def _short(name: str | None) -> str:
    if name is None:
        return "?"
    return name.replace("target.h.", "h").replace("rmsnorm(", "norm(")


def _first_line(text: str) -> str:
    """The engine's own error: the last line, without the adapter's preamble (which checkpoints it
    started) or the log path, where the exception's words are."""
    line = (text or "").strip().splitlines()[-1] if text else ""
    line = line.split(" (log: ")[0]
    if "): " in line:
        line = line.rsplit("): ", 1)[1]
    return line[:160]


def cells(report: Report) -> list[Cell]:
    out = []
    for spec, entry in report.engines.items():
        info = entry.info
        if spec == report.reference or info is None or info.name not in engine_releases.SUPPORTED:
            continue
        engine, release = info.name, engine_releases.release(info.version)
        fc, logits, accept = (report.result(spec, c) for c in ("fc_inputs", "draft_logits", "accept_length"))
        refused = None
        if entry.error:
            refused = _first_line(entry.error)
        elif fc is not None and fc.outcome != "passed" and fc.data is None:
            refused = _first_line(fc.message)  # an error (also one a declared expectation judged): nothing was compared
        fed = getattr(fc.data, "fed", None) if fc is not None else None
        if logits is None or logits.outcome in ("error", "skipped"):
            draft = "not compared"
        elif logits.outcome == "passed":
            draft = "as ref"
        else:
            draft = f"differs from {getattr(logits.data, 'introduced', None) or '?'}"
        ref_al = eng_al = None
        if accept is not None and isinstance(accept.data, (AcceptLengthData, ServerAcceptData)):
            ref_al, eng_al = accept.data.reference.accept_length, accept.data.engine.accept_length
        out.append(Cell(report.case, engine, release, spec, fed, draft, eng_al, ref_al, refused))
    return out


def read_reports(directories: list[Path]) -> list[Report]:
    reports = []
    for d in directories:
        if not d.is_dir():
            raise ConfigError(f"{d} is not a directory of reports")
        for f in sorted(d.glob("*.json")):
            data = read_json(f, "difftest report")
            if isinstance(data, dict) and data.get("schema") == "difftest.report":
                reports.append(Report.from_dict(data, str(f)))
    if not reports:
        raise ConfigError(f"no difftest reports in {', '.join(map(str, directories))}")
    return reports


def markdown(all_cells: list[Cell]) -> list[str]:
    """Rows: cases; columns: engine releases, oldest first per engine."""
    columns = sorted({(c.engine, c.release) for c in all_cells}, key=lambda k: (k[0], Version(k[1])))
    cases = sorted({c.case for c in all_cells})
    by = {(c.case, c.engine, c.release): c for c in all_cells}
    head = ["case"] + [f"{engine_releases.ENGINE_LABELS.get(e, e)} {r}" for e, r in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        row = [case] + [by[(case, e, r)].text() if (case, e, r) in by else "-" for e, r in columns]
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in row) + " |")
    return lines


def add_parser(sub) -> None:
    p = sub.add_parser(
        "versions", help="EAGLE-3 behaviour by engine release, from the reports of a run over several releases"
    )
    p.add_argument(
        "reports", nargs="+", help="report directories of runs with several releases (scripts/version-matrix)"
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        found = [c for r in read_reports([Path(d) for d in args.reports]) for c in cells(r)]
    except DifftestError as e:  # one line, named as every command's refusals are
        print(f"difftest versions: {e}", file=sys.stderr)
        return exit_codes.TROUBLE
    if not found:
        print(
            "difftest versions: the reports compare no engine release (run them with --engines=ref,sglang@OLD,sglang,...)",
            file=sys.stderr,
        )
        return exit_codes.TROUBLE
    print("\n".join(markdown(found)))
    return 0
