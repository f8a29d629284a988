"""`difftest report` and `difftest bundle`: re-render and pack a written report, offline."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

from difftest.report import writer as report_mod
from difftest.report import report_files
from difftest.base.outputs import atomic_path, check_output_dir, check_output_file
from difftest.records import Report
from difftest.base.paths import log_file_name
from difftest.report.html_report import render as render_html


def load(path: str | Path, command: str | None = None) -> Report:
    """The report, validated (difftest.records.Report): one line naming the file and field otherwise.
    A report of an older schema version is read with one line on stderr saying what it lacks
    (`difftest COMMAND: PATH: ...`), never silently."""
    report, note = Report.load_noting(path)
    if note is not None and command is not None:
        print(f"difftest {command}: {path}: {note}", file=sys.stderr)
    return report


def rerender(args) -> int:
    path = Path(args.json)
    out_dir = check_output_dir(
        args.out_dir or path.parent, "--out" if args.out_dir else "--out (default: beside the JSON)"
    )
    data = load(path, "report")
    md, html = report_files.render(data, out_dir)
    print(md)
    print(html)
    return 0


def bundle(args) -> int:
    path = Path(args.json)
    if args.output:
        check_output_file(args.output, "--out")
    data = load(path, "bundle")
    stem = data.case.replace("/", "_")
    # the default path needs the case name from the JSON, so it is checked once that is read
    out = (
        Path(args.output)
        if args.output
        else check_output_file(path.parent / f"{stem}.difftest.tar.gz", "--out (default: beside the JSON)")
    )

    members: dict[str, bytes] = {
        f"{stem}/{stem}.json": path.read_bytes(),
        f"{stem}/{stem}.md": report_mod.markdown(data).encode(),
        f"{stem}/{stem}.html": render_html(data).encode(),
        f"{stem}/case/{Path(data.case_file or stem + '.yaml').name}": data.case_yaml.encode(),
    }
    logs = path.parent / "logs"
    for engine in data.engines:
        log = logs / log_file_name(engine)
        if log.is_file():
            members[f"{stem}/logs/{log.name}"] = log.read_bytes()
    with atomic_path(out) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for name, blob in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(blob))
    print(out)
    return 0
