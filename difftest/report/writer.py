"""Per-case reports: JSON (a difftest.records.Report, schema difftest.report version 4), a Markdown digest and a self-contained
HTML page (difftest.report.html_report), written atomically. The JSON is the source: `difftest
report PATH.json` re-renders the other two from it. Layout: reports/README.md.

The JSON holds the case's noise floor (difftest.compare.noise) and, per engine and prompt, where the
error is introduced, the first tensor above noise, the first that differs at all and the tie
that stopped the comparison of later draft steps; both renderings show each engine's error
against that floor (the compact table below, and an SVG plot in the HTML).
"""

from __future__ import annotations

import json
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from importlib import metadata

from difftest.base import definitions
from difftest.records.acceptance import DEFINITION
from difftest.base.errors import DifftestError
from difftest.base import check_registry
from difftest.records import (
    AcceptLengthData,
    CheckResult,
    ComparisonData,
    FixData,
    PromptComparison,
    Report,
    ServerAcceptData,
    Top1Data,
)
from difftest.records.case_record import CaseRecord
from difftest.records.report import FigureDefinition
from difftest.records.wiring_inference import WiringInference
from difftest.records.tensor_diff import TensorDiff, TensorStatus
from difftest.base.names import short_name
from difftest import __version__

INTERRUPTED = "the run stopped before every check of this case ran; the checks below are those that did"


def build(record: CaseRecord) -> Report:
    """The case's report from its record alone (difftest.records.case_record): no engine is asked."""
    return Report(
        case=record.case,
        case_file=record.case_file,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        reference=record.reference,
        accept_length_definition=DEFINITION,
        definitions=definitions_used(record.checks, bool(record.comparisons)),
        engines=dict(record.engines),
        checks=list(record.checks),
        noise_floor=record.noise_floor,
        wiring_inference=record.wiring_inference,
        comparisons=dict(record.comparisons),
        environment=environment(),
        reproduce=reproduce_command(record.case_file, record.engine_ids, record.reference),
        case_yaml=record.case_yaml,
        timings=record.timings,
        memory_plan=record.memory_plan,
    )


def definitions_used(results: list[CheckResult], compared: bool) -> list[FigureDefinition]:
    """Every figure this report shows, with what it counts and how the engines' and trainers' own
    figures were converted to it (difftest.base.definitions)."""
    names: list[str] = []
    if compared:
        names += [definitions.ROW_ERROR, definitions.EXCESS]
    for r in results:
        data = r.data
        if (check := check_registry.items().get(r.check)) is not None and check.figures is not None:
            names += check.figures(data)  # each check names its own figures (difftest.base.check_registry)
    known = {**definitions.BY_NAME, **check_registry.figure_definitions()}
    return [
        FigureDefinition(n, d.counts, d.converts)
        for n, d in ((n, known[n]) for n in dict.fromkeys(names) if n in known)
    ]


def markdown_definitions(report: Report) -> list[str]:
    if not report.definitions:
        return []
    lines = ["## Definitions", "", "| figure | counts | to the harness's definition |", "|---|---|---|"]
    lines += [f"| `{d.name}` | {_md(d.counts)} | {_md(d.converts)} |" for d in report.definitions]
    return lines + [""]


def reproduce_command(case_path: str, engines: list[str], reference: str) -> str:
    """The command that reruns this comparison. A stored baseline is not an engine one can name
    in --engines: it comes back as --baseline NAME[:ENGINE]."""
    if reference.startswith("baseline:"):
        live = [e for e in engines if e != reference]
        return shlex.join(
            [
                "difftest",
                "run",
                case_path,
                f"--engines={','.join(live)}",
                f"--baseline={reference.removeprefix('baseline:')}",
            ]
        )
    cmd = ["difftest", "run", case_path, f"--engines={','.join(engines)}"]
    if engines and engines[0] != reference:
        cmd.append(f"--reference={reference}")
    return shlex.join(cmd)


NOT_A_GIT_CHECKOUT = "not a git checkout"
_HARNESS_ROOT = Path(__file__).resolve().parents[2]  # a checkout, or site-packages from a wheel


def _git_sha(root: Path = _HARNESS_ROOT) -> str:
    """The checkout's commit; "not a git checkout" from an installed wheel or an unpacked source tree (a
    wheel installed inside some other repository must not report that repository's commit)."""
    if not (root / ".git").exists():
        return NOT_A_GIT_CHECKOUT
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    if sha.returncode:
        return NOT_A_GIT_CHECKOUT
    return sha.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def environment() -> dict:
    """The harness side: the engines' own versions are under `engines`."""
    import torch  # torch and the row kernel take seconds: reports are written and read torch-free

    from difftest.compare.rowstats import compile_status

    try:  # its installed version, not an import of it: importing transformers takes seconds
        tf = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        tf = "not installed"
    return {
        "difftest": __version__,
        "git_sha": _git_sha(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": tf,
        "harness_device": "cuda" if torch.cuda.is_available() else "cpu",
        "comparison_kernel": compile_status(),
    }


# -- the noise view, shared by the Markdown and the HTML (from the report dict alone) -------------
TOP_MOVERS = 5  # within-noise tensors shown when nothing is above noise
MAX_ROWS = 12  # rows of the compact table; the introduced tensors always among them


def num(x) -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return "-"
    return "inf" if x == float("inf") else f"{x:.3g}"


def noise_cells(t: TensorDiff) -> tuple[str, str, str, str]:
    """err, floor, threshold and excess as the tables show them; "-" for a row without them."""
    if not t.has_noise_numbers:
        return "-", "-", "-", "-"
    return num(t.err), num(t.noise_floor), num(t.threshold), num(t.excess)


def above_noise(t: TensorDiff) -> bool:
    return t.status.above_noise


def verdict_word(t: TensorDiff) -> str:
    """A tensor's verdict in words: above noise / within noise / identical / tie / missing / shape."""
    if t.status == TensorStatus.MISMATCH:  # a row from before the noise criterion was judged... above noise
        return "outside tolerance" if t.has_noise_numbers and not t.by_noise else "above noise"
    if t.status == TensorStatus.OK:
        return "within noise" if t.differs else "identical"
    return _VERDICT_WORDS.get(t.status, t.status.value)


_VERDICT_WORDS = {TensorStatus.TIE: "tie (not compared)", TensorStatus.ALLOWED_MISSING: "missing (allowed)"}


def focus(entries: list[PromptComparison]) -> PromptComparison | None:
    """The prompt an engine's noise view shows: the first with a divergence, else the one that moved
    most (largest finite excess), else the first."""
    if not entries:
        return None
    first = next((p for p in entries if p.first_divergence), None)
    if first is not None:
        return first

    def moved(p: PromptComparison) -> float:
        return max((t.excess for t in p.tensors if t.status == TensorStatus.OK), default=0.0)

    return max(entries, key=moved)


def interesting(entry: PromptComparison, top: int = TOP_MOVERS, cap: int = MAX_ROWS) -> tuple[list[TensorDiff], int]:
    """(rows of the compact table in data-flow order, how many tensors above noise were left out):
    the tensors above noise (the introduced ones first, then by excess) up to `cap`, or, when none is,
    the `top` movers by excess."""
    tensors = entry.tensors
    above = [t for t in tensors if above_noise(t)]
    if above:
        ranked = sorted(above, key=lambda t: (not t.introduced, -t.excess))
        keep = {id(t) for t in ranked[: max(cap, sum(1 for t in above if t.introduced))]}
        return [t for t in tensors if id(t) in keep], len(above) - len(keep)
    movers = sorted((t for t in tensors if t.status == TensorStatus.OK and t.excess > 0), key=lambda t: -t.excess)[:top]
    keep = {id(t) for t in movers}
    return [t for t in tensors if id(t) in keep], 0


def ties(report: Report, engine: str) -> dict:
    """Ties for one engine: top-1 positions within noise (the top1_agreement item) and the draft steps
    not compared because the engine drafted another token at a tie (per prompt)."""
    top1 = next((c.data for c in report.results(engine, "top1_agreement") if isinstance(c.data, Top1Data)), None)
    prompts = report.comparisons.get(engine) or []
    return {
        "top1_ties": top1.ties if top1 else None,
        "top1_ties_agree": top1.ties_agree if top1 else None,
        "skipped": [
            {"prompt": p.prompt, "tie": p.tie, "tensors": sum(1 for t in p.tensors if t.status == TensorStatus.TIE)}
            for p in prompts
            if p.tie
        ],
    }


def ties_lines(report: Report, engine: str) -> list[str]:
    t = ties(report, engine)
    out = []
    if t["top1_ties"] is not None:
        out.append(f"top-1 ties within noise: {t['top1_ties']} ({t['top1_ties_agree']} agree), not judged")
    for s in t["skipped"]:
        out.append(f"prompt {s['prompt']}: {s['tensors']} step tensors not compared: {s['tie']}")
    return out


def noise_floor_line(report: Report) -> str:
    nf = report.noise_floor
    if nf is None:
        return "noise floor: not in this report (no engine was compared)"
    measured = "measured" if nf.measured else "NOT measured"
    line = f"noise floor ({measured}, {nf.dtype}): {nf.source}"
    if nf.excluded:
        line += "; excluded: " + "; ".join(nf.excluded)
    return line


def declared_floor_lines(report: Report) -> list[str]:
    """Each engine the case declares a matmul precision for (`precision:`), the format and the floor it
    is judged against instead of the case's (difftest.run.case_run.CaseRun.noise_floor_for)."""
    nf = report.noise_floor
    if nf is None or not nf.declared:
        return []
    return [
        f"declared precision: `{d.engine}` in {d.precision} (the case's `precision:`), judged against that "
        f"format's floor ({'measured' if d.measured else 'NOT measured'}): {d.source}"
        for d in nf.declared
    ]


FEW_SHOWN = 6  # floors on too few rows listed in the Markdown; the rest in the JSON and the HTML


def floor_rows_lines(report: Report) -> list[str]:
    """How many rows the floor stands on: the fewest, and every tensor not measured on enough rows."""
    nf = report.noise_floor
    if nf is None or not nf.tensors:
        return []
    fewest = min(nf.tensors.values(), key=lambda f: f.rows)
    of = f" of {fewest.total_rows}" if fewest.total_rows is not None else ""
    out = [f"floor rows: fewest `{fewest.name}` on {fewest.rows}{of} rows"]
    few = [f for f in nf.tensors.values() if not f.measured]
    if few:
        out[0] += f"; {len(few)} tensors on too few rows (thresholds fall back):"
        out += [f"- `{f.name}`: {_md(f.source)}" for f in few[:FEW_SHOWN]]
        if len(few) > FEW_SHOWN:
            out.append(f"- and {len(few) - FEW_SHOWN} more (the JSON's `noise_floor.tensors`, the HTML's floor table)")
    return out


def routing_lines(report: Report, engine: str) -> list[str]:
    """Per prompt and MoE layer: the expert-set agreement with the reference and the rows judged apart."""
    prompts = [p for p in report.comparisons.get(engine) or [] if p.routing]
    if not prompts:
        return []
    lines = [
        "| prompt | MoE layer | rows | expert-set agreement | lowest row | other experts | judged apart (near-tie) "
        "| other experts at a clear margin |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in prompts:
        for r in p.routing:
            agree = f"{r.agreement:.3f}" if r.agreement is not None else "not captured"
            low = f"{r.min_agreement:.3f}" if r.min_agreement is not None else "-"
            differs = str(r.differs) if r.differs is not None else "-"
            clear = f"**{r.clear}**" if r.clear else "0"
            lines.append(
                f"| {p.prompt} | {r.layer} | {r.rows} | {agree} | {low} | {differs} | {r.apart} of {r.near_tie} | {clear} |"
            )
    return lines


def _md(text: str) -> str:
    return str(text).replace("\n", "<br>").replace("|", "\\|")


def markdown_noise(report: Report) -> list[str]:
    """Per engine: the compact error-vs-noise table of its focus prompt, and its ties."""
    comparisons = report.comparisons
    if not comparisons:
        return []
    lines = ["## Error against the noise floor", "", _md(noise_floor_line(report)), ""]
    declared = declared_floor_lines(report)
    if declared:
        lines += [f"- {_md(line)}" for line in declared] + [""]
    rows_lines = floor_rows_lines(report)
    if rows_lines:
        lines += rows_lines + [""]
    for engine, entries in comparisons.items():
        entry = focus(entries)
        if entry is None:
            continue
        head = f"### `{engine}`, prompt {entry.prompt}: "
        if entry.first_divergence:
            head += f"error introduced at `{entry.first_divergence}`"
            lines += [
                head,
                "",
                f"first above noise `{entry.first_above_noise}`; first that differs at all `{entry.first_differs}`",
                "",
            ]
        else:
            differs = entry.first_differs or next((t.name for t in entry.tensors if t.differs), None)
            lines += [head + ("every tensor within noise" if differs else "every compared tensor bit-identical"), ""]
        rows, left = interesting(entry)
        if rows:
            lines += [
                "| tensor | err | floor | threshold | excess | verdict | introduced |",
                "|---|---|---|---|---|---|---|",
            ]
            for t in rows:
                mark = "**<- introduced**" if t.introduced else ""
                err, floor, threshold, excess = noise_cells(t)
                lines.append(f"| `{t.name}` | {err} | {floor} | {threshold} | {excess}x | {verdict_word(t)} | {mark} |")
            if left:
                lines.append(f"\n{left} more tensors above noise not shown (see the HTML or JSON report).")
            lines.append("")
        tl = ties_lines(report, engine)
        if tl:
            lines += ["Ties:", ""] + [f"- {_md(x)}" for x in tl] + [""]
        rl = routing_lines(report, engine)
        if rl:
            lines += [f"Routing of `{engine}` against the reference, per MoE layer:", ""] + rl + [""]
    return lines


def markdown_inference(inf: WiringInference) -> list[str]:
    """`wiring: infer`: what the run's wiring was inferred as, and how firmly."""

    def w(names) -> str:
        return "[" + ", ".join(short_name(n) for n in names) + "]" if names else "-"

    lines = [
        "## Wiring inferred (`wiring: infer`)",
        "",
        f"trained on **{w(inf.wiring)}**, step-0 agreement {inf.agreement:.3f}; evidence: {inf.source}, "
        f"{inf.positions} positions, {inf.forwards} draft forwards (full grid {inf.grid_size})",
    ]
    if inf.runner_up:
        lines.append(
            f"runner-up {w(inf.runner_up)} ({inf.runner_up_agreement:.3f}): margin {inf.margin:.3f} "
            f"(z {inf.margin_z:.1f})"
        )
    lines += [
        "",
        "| slot | inferred | best alternative | agreement drop | z (agreement) | z (log-prob) |",
        "|---|---|---|---|---|---|",
    ]
    for s in inf.slots:
        lines.append(
            f"| {s.slot} | {short_name(s.chosen)} | {short_name(s.alternative)} | {s.drop:.3f} | "
            f"{s.z:.1f} | {s.z_logp:.1f} |"
        )
    lines += ["", "| engine | reads the config as | agreement |", "|---|---|---|"]
    for r in inf.readings:
        agreement = "-" if r.agreement is None else f"{r.agreement:.3f}"
        lines.append(f"| {r.engine} | {w(r.wiring) if r.wiring else 'cannot serve these ids'} | {agreement} |")
    return lines + [""]


@dataclass
class Fix:
    """A failing fc_inputs item's layer-id fix (difftest.checks.layer_reading) for one engine."""

    engine: str
    rule: str
    edit: FixData


def fixes(report: Report) -> list[Fix]:
    """The layer-id fixes the failing fc_inputs items computed, one per engine."""
    return [
        Fix(c.engine, c.data.rule or "", c.data.fix)
        for c in report.checks
        if c.check == "fc_inputs" and isinstance(c.data, ComparisonData) and c.data.fix is not None
    ]


def fix_lines(f: Fix, case_file: str) -> list[str]:
    if f.edit.impossible:
        return [f"no config fixes it: {f.edit.impossible}", *[f"instead: {a}" for a in f.edit.alternatives]]
    lines = [f"edit the draft's config.json: {json.dumps(f.edit.patch)}"]
    if f.edit.fc_order:
        lines.append(f"and reorder fc.weight's input blocks into layer order ({f.edit.fc_order})")
    lines += [f"note: {s}" for s in f.edit.side_effects]
    lines.append(f"write and verify it on the engine: difftest fix {case_file} --engines {f.engine}")
    return lines


def markdown_fixes(report: Report) -> list[str]:
    found = fixes(report)
    if not found:
        return []
    lines = ["## Fix", ""]
    for f in found:
        lines += [f"### `{f.engine}`", "", _md(f.rule), ""]
        lines += [f"- {_md(line)}" for line in fix_lines(f, report.case_file or "CASE")] + [""]
    return lines


CELL = 160  # characters of a table cell: a longer message moves into the details below the table


def portable(text: str, case_file: str) -> str:
    """`text` without this machine's absolute paths: relative to the case file's directory (its
    parent as `../`), else `~` for the home directory, so a report pasted into an issue shows no
    machine's layout and its commands run from the case's directory."""
    case = Path(case_file)
    if case.is_absolute():
        text = text.replace(str(case), case.name)
        here = case.parent
        text = text.replace(str(here) + "/", "")
        if here.parent != here.parent.parent:  # not the root: `../x` beats a machine path
            text = text.replace(str(here.parent) + "/", "../")
    home = str(Path.home())
    if home not in ("/", ""):
        text = re.sub(re.escape(home) + r"(?=/|\b)", "~", text)
    return text


def short(text: str, limit: int = CELL) -> str:
    """A table cell: the first line, cut at `limit` characters (the whole text goes to the details)."""
    lines = str(text).strip().splitlines() or [""]
    line = lines[0]
    if line.endswith(":") and len(lines) > 1:  # a preamble ("expected failure, cause ... named:"): with its first line
        line += " " + lines[1]
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def _wiring(names: list[str | None] | None) -> str:
    return "[" + ", ".join("?" if n is None else short_name(n) for n in names) + "]" if names else "?"


def fed_line(report: Report) -> str:
    """What the engines fed the draft's fc against what it was trained on (the fc_inputs items)."""
    wrong = []
    for c in report.checks:
        data = c.data
        if c.check != "fc_inputs" or not isinstance(data, ComparisonData) or not c.failed and c.outcome != "xfailed":
            continue
        trained = [m.expected for m in data.fc_chunks or []]
        if data.fed:
            wrong.append(f"`{c.engine}` fed fc {_wiring(data.fed)}, the draft was trained on {_wiring(trained)}")
        elif data.precision:  # reduced-precision drift (difftest.compare.diagnose.reduced_precision): no wiring fault
            wrong.append(f"`{c.engine}`: {_precision_said(data.precision)}")
        elif data.first_divergence:
            wrong.append(f"`{c.engine}` fc inputs diverge at `{data.first_divergence}`")
    if wrong:
        return "**Fed vs trained**: " + "; ".join(wrong) + "."
    compared = [c.engine for c in report.checks if c.check == "fc_inputs" and c.outcome == "passed"]
    if compared:
        return "**Fed vs trained**: " + ", ".join(f"`{e}`" for e in compared) + " fed fc what the draft was trained on."
    return "**Fed vs trained**: fc inputs not compared in this run."


def _precision_said(finding: str) -> str:
    """The reduced-precision finding without its figures: "ENGINE's target computes below float32
    (consistent with TF32 matmuls), not a wiring divergence; declare ..." (the figures are in the check's message)."""
    head, sep, rest = finding.partition(": rel err ")
    _, tail_sep, tail = rest.partition("); not a wiring")
    return f"{head}){tail_sep[1:]}{tail}" if sep and tail_sep else finding


def accept_line(report: Report) -> str:
    """Each engine's accept length against the reference's, with the change."""
    parts = []
    for c in report.checks:
        data = c.data
        if not isinstance(data, (AcceptLengthData, ServerAcceptData)):
            continue
        ref, eng = data.reference.accept_length, data.engine.accept_length
        change = f" ({100 * (eng - ref) / ref:+.1f}%)" if ref == ref and eng == eng and ref else ""
        parts.append(f"`{c.engine}` {eng:.2f} vs reference {ref:.2f}{change}")
    if not parts:
        return "**Accept length**: not measured in this run."
    return "**Accept length**: " + "; ".join(parts) + "."


def fix_line(report: Report) -> str:
    """The fix in one line: the config edit and the command that writes it, or that none is needed."""
    found = fixes(report)
    if found:
        items = []
        for f in found:
            if f.edit.impossible:
                items.append(f"`{f.engine}`: no config edit fixes it ({short(f.edit.impossible, 120)})")
            else:
                items.append(
                    f"`{f.engine}`: set {json.dumps(f.edit.patch)} in the draft's config.json "
                    f"(`difftest fix {report.case_file or 'CASE'} --engines {f.engine}`)"
                )
        return "**Fix**: " + "; ".join(items) + "."
    bad = [c for c in report.checks if c.failed]
    if bad:
        return f"**Fix**: none computed; {len(bad)} check(s) failed, see below."
    return "**Fix**: none needed" + (
        " (expected failures caught with their cause)."
        if any(c.outcome == "xfailed" for c in report.checks)
        else ": every check passed."
    )


def environment_table(report: Report) -> list[str]:
    """Every engine's release, code path, torch and transformers, then the machine and the harness."""
    lines = ["| engine | release | runner | kernels | torch | transformers | python |", "|---|---|---|---|---|---|---|"]
    for e, entry in report.engines.items():
        info = entry.info
        if info is None:
            lines.append(f"| `{e}` | did not start: {_md(short(entry.error or '', 100))} | | | | | |")
            continue
        v = info.versions
        lines.append(
            f"| `{e}` | {_md(info.label())} | {_md(info.code_path())} | {_md(info.kernels or '-')} | {v.get('torch', '-')} | "
            f"{v.get('transformers', '-')} | {v.get('python', '-')} |"
        )
    env = report.environment
    if env:
        lines.append(
            f"| harness | difftest {env.get('difftest', '?')} | {env.get('comparison_kernel', '-')} | "
            f"{env.get('harness_device', '-')} | {env.get('torch', '-')} | {env.get('transformers', '-')} | "
            f"{env.get('python', '-')} |"
        )
        lines += ["", f"machine: {env.get('platform', '?')}; difftest git {env.get('git_sha', '?')}"]
    return lines + ["", f"memory plan: {memory_plan_said(report)}", ""]


NO_MEMORY_PLAN = "not recorded (no engine worker was asked to start, or a report before schema 4)"


def memory_plan_said(report: Report) -> str:
    """Which memory plan the run followed, and why (difftest.records.memory_plan)."""
    return report.memory_plan.said() if report.memory_plan is not None else NO_MEMORY_PLAN


def _details(summary: str, body: list[str]) -> list[str]:
    """A folded section (GitHub renders Markdown inside it after a blank line)."""
    return ["<details>", f"<summary>{summary}</summary>", "", *body, "</details>", ""] if body else []


def markdown(report: Report) -> str:
    """Three lines a reader needs (what was fed vs trained, the accept-length change, the fix), the
    environment, the checks in short, then everything else folded."""
    lines = [f"# difftest: {report.case}", "", fed_line(report), "", accept_line(report), "", fix_line(report), ""]
    if report.interrupted:
        lines += [f"**Interrupted**: {INTERRUPTED}.", ""]
    lines += environment_table(report)
    lines += [
        f"reference `{report.reference}`; case file `{report.case_file}` (paths relative to its directory)",
        "",
        "| engine | check | outcome | message |",
        "|---|---|---|---|",
    ]
    long = []
    for r in report.checks:
        lines.append(f"| `{r.engine}` | {r.check} | {r.outcome} | {_md(short(r.message))} |")
        if short(r.message) != r.message.strip():
            long += [f"**`{r.engine}` {r.check}** ({r.outcome})", "", "```text", r.message.strip(), "```", ""]
    lines.append("")
    if report.reproduce:
        lines += ["Reproduce (from the case file's directory):", "", "```bash", report.reproduce, "```", ""]
    lines += _details("Check messages in full", long)
    if report.wiring_inference:
        lines += _details("Wiring inferred", markdown_inference(report.wiring_inference))
    lines += _details("Fix in full", markdown_fixes(report))
    lines += _details("Error against the noise floor, per prompt", markdown_noise(report))
    lines += _details("Timings", markdown_timings(report))
    lines += _details(
        "Definitions", [f"Accept length: {report.accept_length_definition}.", ""] + markdown_definitions(report)
    )
    return portable("\n".join(lines), report.case_file)


def markdown_timings(report: Report) -> list[str]:
    """Where the case's time went: the harness's share, then each phase (difftest.run.phase_clock)."""
    t = report.timings
    if t is None or not t.phases:
        return []
    total = t.harness_seconds + t.engine_seconds
    share = f" ({100 * t.harness_seconds / total:.0f}%)" if total > 0 else ""
    lines = [
        f"Time: harness {t.harness_seconds:.2f} s{share}, engines {t.engine_seconds:.2f} s ({t.scope}).",
        "",
        "| phase | owner | engine | dtype | seconds | count | MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p.phase} | {p.owner} | {p.engine or ''} | {p.dtype or ''} | {p.seconds:.3f} | {p.count} | "
        f"{p.bytes / 2**20:.1f} |"
        for p in t.phases
    ]
    return lines + [""]


def json_path(report: Report, directory: Path) -> Path:
    return directory / f"{report.case.replace('/', '_')}.json"


def is_complete(path: Path) -> bool:
    """A report on disk from a run that finished its case (not marked `interrupted`); one this
    difftest cannot read (missing, damaged, an older schema version) is not one to keep."""
    try:
        return not Report.load(path).interrupted
    except DifftestError:
        return False


def junit_properties(result: CheckResult, case_file: str) -> list[tuple[str, str]]:
    """One item's figures as JUnit properties (pytest's junitxml writes an item's user_properties):
    its outcome and cause in one line, where the error is introduced, the accept lengths; no
    machine path (portable)."""
    props = [("difftest.outcome", result.outcome), ("difftest.cause", portable(short(result.message, 300), case_file))]
    if result.expected_failure is not None:
        props.append(("difftest.expected_cause", result.expected_failure.cause))
    data = result.data
    if isinstance(data, ComparisonData) and (data.introduced or data.first_divergence):
        props.append(("difftest.first_divergence", str(data.introduced or data.first_divergence)))
    if isinstance(data, (AcceptLengthData, ServerAcceptData)):
        props += [
            ("difftest.accept_length", f"{data.engine.accept_length:.4f}"),
            ("difftest.reference_accept_length", f"{data.reference.accept_length:.4f}"),
        ]
    return props


def keyword(engine_id: str) -> str:
    """An engine spec id as one `pytest -k` word: `ref[wiring=sglang]` -> `ref_wiring_sglang`,
    `sglang@0.5.9` -> `sglang_0.5.9` (-k's grammar has no `=`, `@` or `,`)."""
    return re.sub(r"[^\w.+-]+", "_", engine_id).strip("_")
