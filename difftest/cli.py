"""`difftest` command line.

    difftest fixtures [--force]                  build the built-in tiny models (cached)
    difftest run [CASES...] --engines=ref,...    run cases through the pytest plugin, write reports
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from difftest.session import FIXTURE_GROUP


def _fixtures(args: argparse.Namespace) -> int:
    providers = list(metadata.entry_points(group=FIXTURE_GROUP))
    if not providers:
        print("difftest: no fixture provider installed (is the project installed with `pip install -e .`?)", file=sys.stderr)
        return 2
    for ep in providers:
        ep.load().build_all(force=args.force)
    return 0


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    import pytest

    argv = ["-p", "difftest.plugin", "-p", "no:cacheprovider", "-q", "-rfEs", *args.cases, f"--engines={args.engines}"]
    if args.reference:
        argv.append(f"--reference={args.reference}")
    if args.report_dir:
        argv.append(f"--report-dir={args.report_dir}")
    for item in args.engine_python:
        argv.append(f"--engine-python={item}")
    return int(pytest.main(argv + extra))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="difftest", description="Differential testing of EAGLE-3 draft wiring across engines")
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fixtures", help="build the built-in tiny target and drafts into the cache")
    f.add_argument("--force", action="store_true", help="rebuild even if cached")
    r = sub.add_parser("run", help="run cases (extra arguments go to pytest)")
    r.add_argument("cases", nargs="*", default=["cases/"])
    r.add_argument("--engines", default="ref")
    r.add_argument("--reference", default=None)
    r.add_argument("--report-dir", default=None)
    r.add_argument("--engine-python", action="append", default=[], metavar="NAME=PATH")
    args, extra = ap.parse_known_args(argv)
    if args.command == "fixtures":
        if extra:
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        return _fixtures(args)
    return _run(args, extra)


if __name__ == "__main__":
    sys.exit(main())
