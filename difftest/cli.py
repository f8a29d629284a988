"""`difftest` command line.

difftest --version                           difftest's version and the engines' pinned releases
difftest fixtures [NAME ...] [--force] [--jobs N] | --list   build (or list) the built-in tiny models
difftest run [CASES...] --engines=ref,... [--out DIR] [-q | --json] [--allow-missing-engines]
             run cases through the pytest plugin, write reports; exit codes: difftest.base.exit_codes
             [--save-baseline NAME [--force] | --baseline NAME]   golden baselines (difftest.run.baseline)
difftest env create ENGINE[==VERSION] [--label L]   an engine environment for --engines=ENGINE@L
difftest env list [--json]                   every built environment: engine, release, path, size, complete
difftest cache [--json] | cache prune [--captures] [--older-than DAYS] [--dry-run]   the cache by kind
difftest train-acc --data DIR --draft D --target T [--wiring vllm ...]   training accuracy, wirings side by side
difftest dump --target T --out DIR --format speculators --layers h0+h2+h4+h7   write training data
             (these two come from the training-data engine, through the `difftest.commands`
             entry points: difftest.base.extensions)
difftest infer-wiring --target T --draft D [--prompts ...] [--json]   what the draft was trained on
difftest report reports/CASE.json [--out DIR]   re-render the Markdown and HTML report from the JSON
difftest bundle reports/CASE.json [--out OUT]   one .tar.gz with JSON, HTML, Markdown, case YAML, engine logs
difftest probe --server URL --case CASE [--kind sglang|vllm]   a running server's acceptance vs the reference
difftest versions REPORT_DIR...              EAGLE-3 behaviour by engine release, from runs over several releases
"""

from __future__ import annotations

import sys

# Ctrl-C while these imports run (torch's take seconds) comes before main() can catch it: the same one
# line and exit code as main's, not a traceback through the import machinery
try:
    import argparse
    import glob
    import json
    import multiprocessing
    import os
    import re
    from dataclasses import asdict
    from pathlib import Path
    from concurrent.futures import ProcessPoolExecutor
    from importlib import metadata

    from difftest.base import exit_codes
    from difftest import cache_command, fix_command, init_command, rules_command
    from difftest.base.cli_args import Parser, deprecated_alias, unknown_options, whole_number
    from difftest.base.errors import DifftestError
    from difftest.base.paths import cache_root
    from difftest.base.extensions import commands
    from difftest.report import bundle, version_table
    from difftest.run import envs
    from difftest.run.case_run import FIXTURE_GROUP
except KeyboardInterrupt:
    print("difftest: interrupted", file=sys.stderr)
    sys.exit(130)  # exit_codes.INTERRUPTED, which may not be imported yet


def _fixtures(args: argparse.Namespace) -> int:
    providers = list(metadata.entry_points(group=FIXTURE_GROUP))
    if not providers:
        print(
            "difftest: no fixture provider installed (is the project installed with `pip install -e .`?)",
            file=sys.stderr,
        )
        return exit_codes.USAGE
    if args.list:
        return _list_fixtures(providers, args.names)
    if not args.names:
        lanes = _lanes(providers)
        if min(args.jobs, len(lanes)) <= 1:
            for lane in lanes:
                _build_lane(lane, args.force)
            return 0
        # Fixture by fixture on `jobs` processes, one thread each (builds pin one: reproducible). Lanes
        # alone left a core idle for most of the build: the tiny-llama lane is three times the DeepSeek
        # one. Each fixture builds once across processes and waits for what it builds on (the fixture
        # cache's per-name locks), and the queue takes the lanes in turn, so each process starts on
        # its own lane's first fixture and the long lane's tail is shared.
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for future in [pool.submit(_build_one, provider, name, args.force) for provider, name in _queue(lanes)]:
                future.result()
        return 0
    if args.force:
        print("difftest fixtures: --force rebuilds every fixture; give no names with it", file=sys.stderr)
        return exit_codes.USAGE
    loaded = [ep.load() for ep in providers]
    for name in args.names:
        path = next((p for p in (m.resolve_fixture(name) for m in loaded) if p is not None), None)
        if path is None:
            print(f"difftest fixtures: no provider knows fixture {name!r}", file=sys.stderr)
            return exit_codes.USAGE
        print(f"[fixtures] {name}: {path}")
    return 0


def _list_fixtures(providers: list, only: list[str]) -> int:
    """`difftest fixtures --list`: each fixture a provider declares (`NAMES`), built or not, and where."""
    rows = []
    for ep in providers:
        module = ep.load()
        for name in getattr(module, "NAMES", None) or getattr(module, "names", None) or []:
            if only and name not in only:
                continue
            path = _built_fixture(name)
            rows.append((name, path is not None, path))
    unknown = sorted(set(only) - {r[0] for r in rows})
    if unknown:
        print(f"difftest fixtures: no provider knows fixture {unknown[0]!r}", file=sys.stderr)
        return exit_codes.USAGE
    for name, built, path in rows:
        print(f"{name:<32} {'built' if built else 'not built':<10} {path or '?'}")
    return 0


def _built_fixture(name: str) -> Path | None:
    """Where fixture `name` is built, without building it: providers publish under
    fixtures/GROUP/NAME, or fixtures/GROUP/NAME-<12 hex digits of its recipe> (the newest wins)."""
    found = [
        p
        for p in (cache_root() / "fixtures").glob(f"*/{glob.escape(name)}*")
        if p.is_dir() and re.fullmatch(re.escape(name) + r"(-[0-9a-f]{12})?", p.name)
    ]
    exact = [p for p in found if p.name == name]  # an unkeyed fixture; a keyed one of the same name is another
    return exact[0] if exact else max(found, key=lambda p: p.stat().st_mtime) if found else None


def _lanes(providers: list) -> list[list[str]]:
    """Providers grouped by the `LANE` they declare (default: their own): a lane builds on its own
    fixtures only, so lanes can build side by side while a lane's providers build in order."""
    lanes: dict[str, list[str]] = {}
    for ep in providers:
        lanes.setdefault(getattr(ep.load(), "LANE", ep.name), []).append(ep.name)
    return list(lanes.values())


def _build_lane(names: list[str], force: bool) -> None:
    providers = {ep.name: ep for ep in metadata.entry_points(group=FIXTURE_GROUP)}
    for name in names:
        providers[name].load().build_all(force=force)


def _queue(lanes: list[list[str]]) -> list[tuple[str, str | None]]:
    """(provider, fixture) in build order, the lanes taken in turn; a provider without a command line
    for one fixture (`NAMES` and `main`) is one item, built whole (fixture None)."""
    providers = {ep.name: ep for ep in metadata.entry_points(group=FIXTURE_GROUP)}
    per_lane: list[list[tuple[str, str | None]]] = []
    for lane in lanes:
        items: list[tuple[str, str | None]] = []
        for provider in lane:
            module = providers[provider].load()
            names = getattr(module, "NAMES", None) if hasattr(module, "main") else None
            items += [(provider, n) for n in names] if names else [(provider, None)]
        per_lane.append(items)
    longest = max(map(len, per_lane), default=0)
    return [lane[i] for i in range(longest) for lane in per_lane if i < len(lane)]


def _build_one(provider: str, name: str | None, force: bool) -> None:
    module = next(ep for ep in metadata.entry_points(group=FIXTURE_GROUP) if ep.name == provider).load()
    if name is None:
        module.build_all(force=force)
    else:
        module.main([name, *(["--force"] if force else [])])


# run's options that take a value, each refused when given empty
VALUE_OPTIONS = ("--engines", "--reference", "--out", "--save-baseline", "--baseline", "--baseline-dir")


def _run(args: argparse.Namespace, extra: list[str], known: list[str]) -> int:
    import pytest  # pytest costs every other subcommand its import; only `run` drives it

    # what `run` does not know goes to pytest (-k, -x, ...); a misspelling of one of run's own options
    # (`--engine`, `--out-dir`, a prefix) is refused here, naming it, not handed on to fail obscurely
    wrong = unknown_options(extra, known)
    if wrong is not None:
        print(f"difftest run: {wrong}", file=sys.stderr)
        return exit_codes.USAGE
    if args.quiet and args.json:
        print("difftest run: -q and --json: choose one (--json prints progress as JSON lines)", file=sys.stderr)
        return exit_codes.USAGE
    # an empty value is what an unset variable gives (--engines=$ENGINES): refused, never the default
    for option in VALUE_OPTIONS:
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        if value is not None and not value.strip():
            print(
                f"difftest run: {option}: empty value (an unset variable?); give a value or leave the option out",
                file=sys.stderr,
            )
            return exit_codes.USAGE
    # pytest's own lines stay terse (-q); the progress lines say what the run waits on (stderr)
    progress = "json" if args.json else "off" if args.quiet else "lines"
    argv = ["-p", "difftest.plugin", "-p", "no:cacheprovider", "-q", "-rfEs", f"--progress={progress}", *args.cases]
    if not any(a.startswith("--benchmark") for a in extra):
        # pytest-benchmark, where installed, creates an empty .benchmarks/ in the working directory of
        # every run; cases are no benchmarks, so it is loaded only when a --benchmark-* option asks for it
        argv += ["-p", "no:benchmark"]
    if args.engines is not None:  # else the plugin's default: the engine that calibrates (registry.calibration_engine)
        argv.append(f"--engines={args.engines}")
    if args.reference is not None:
        argv.append(f"--reference={args.reference}")
    if args.out is not None:
        argv.append(f"--out={args.out}")
    if args.allow_missing_engines:
        argv.append("--allow-missing-engines")
    for item in args.engine_python:
        argv.append(f"--engine-python={item}")
    for option in ("save_baseline", "baseline", "baseline_dir"):
        if getattr(args, option) is not None:
            argv.append(f"--{option.replace('_', '-')}={getattr(args, option)}")
    if args.force:
        argv.append("--force-baseline")
    try:
        return int(pytest.main(argv + extra))
    except KeyboardInterrupt:  # before pytest's session took over Ctrl-C (its start-up)
        return exit_codes.INTERRUPTED


def _env_parsers(sub) -> None:
    """`env create`: build an engine environment at a chosen version (difftest.run.envs)."""

    def handler(args: argparse.Namespace) -> int:
        return envs.main(args)

    e = sub.add_parser("env", help="engine environments for versioned specs (NAME@LABEL)")
    esub = e.add_subparsers(dest="env_command", required=True)
    c = esub.add_parser("create", help="build ENGINE[==VERSION] once in the user cache and link envs/ENGINE@LABEL")
    c.add_argument("requirement", help="sglang, sglang==0.5.23, vllm==0.32.0 (default version: the pinned one)")
    c.add_argument("--label", default=None, help="the spec label it answers to (default: the version)")
    c.add_argument("--dry-run", action="store_true", help="print the plan (directory, version, link) and build nothing")
    c.set_defaults(handler=handler)
    ls = esub.add_parser("list", help="every built environment: engine, release, path, size, complete or not")
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    ls.set_defaults(handler=_env_list)


def _env_list(args: argparse.Namespace) -> int:
    found = envs.list_envs()
    if args.json:
        print(json.dumps([asdict(e) for e in found]))
        return 0
    if not found:
        print(f"difftest env list: no environment under {envs.cache_root() / 'envs'}")
        return 0
    for e in found:
        state = "complete" if e.complete else "INCOMPLETE"
        where = f"-> {e.link_to}" if e.link_to else f"{cache_command.human(e.size or 0)}"
        print(f"{e.name:<36} {e.engine:<18} {e.release or '?':<12} {state:<10} {e.path} {where}")
    return 0


def _extension_parsers(sub) -> list[str]:
    """Commands engine packages contribute (difftest.base.extensions: the `difftest.commands` entry
    points), e.g. the training-data engine's `train-acc` and `dump`; their names."""
    for name, command in commands().items():
        p = sub.add_parser(name, help=command.help)
        command.add_arguments(p)
        p.set_defaults(handler=command.run)
    return list(commands())


def _report_parsers(sub) -> None:
    """`report` and `bundle`: work on a written JSON report only (no engines, no models)."""

    def handler(name: str):
        def run(args: argparse.Namespace) -> int:
            try:
                return getattr(bundle, name)(args)
            except DifftestError as e:
                print(f"difftest {args.command}: {e}", file=sys.stderr)
                return exit_codes.TROUBLE
            except OSError as e:  # a write the checks up front could not foresee (a full disk): nothing is left
                print(f"difftest {args.command}: {e.filename or args.json}: {e.strerror or e}", file=sys.stderr)
                return exit_codes.TROUBLE
            except RecursionError:  # JSON nested deeper than Python's parser recurses (no report is)
                print(
                    f"difftest {args.command}: {args.json}: not a difftest report (JSON nested too deeply to read)",
                    file=sys.stderr,
                )
                return exit_codes.TROUBLE
            except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
                # valid JSON whose nested fields are missing or of the wrong kind (hand-edited, truncated
                # by another tool): one line naming the file, not a traceback
                what = f"field {e.args[0]!r} missing" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
                print(f"difftest {args.command}: {args.json}: not a complete difftest report ({what})", file=sys.stderr)
                return exit_codes.TROUBLE

        return run

    p = sub.add_parser("report", help="re-render a case's Markdown and HTML report from its JSON")
    p.add_argument("json", help="reports/CASE.json")
    p.add_argument("--out", dest="out_dir", default=None, help="where to write (default: beside the JSON)")
    deprecated_alias(p, ["--out-dir"], "--out", "out_dir")
    p.set_defaults(handler=handler("rerender"))
    b = sub.add_parser("bundle", help="pack a case's JSON, HTML, Markdown, case YAML and engine logs into one archive")
    b.add_argument("json", help="reports/CASE.json")
    b.add_argument(
        "--out", dest="output", default=None, help="archive path (default: beside the JSON, CASE.difftest.tar.gz)"
    )
    deprecated_alias(b, ["-o", "--output"], "--out", "output")
    b.set_defaults(handler=handler("bundle"))


def _version() -> str:
    """difftest's version, and each engine's pinned release (read from its requirements file: cheap)."""
    try:
        mine = metadata.version("difftest")
    except metadata.PackageNotFoundError:
        mine = "unknown (not installed)"
    pins = []
    for engine, dist in sorted(envs.ENGINE_DISTRIBUTIONS.items()):
        try:
            p = envs.plan(engine)
        except (DifftestError, OSError):  # an engine without its recipe here (a partial install)
            continue
        pins.append(f"{engine} {p.pinned}" if dist else engine)
    return f"difftest {mine}" + (f" (engines pinned: {', '.join(pins)})" if pins else "")


class _Version(argparse.Action):
    """--version, computed only when asked (it reads the engines' requirement files)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(_version())
        parser.exit()


RUN_EPILOG = (
    "Arguments run does not know go to pytest (-k EXPR, -x, ...). Progress lines go to stderr: "
    '-q none, --json one JSON object per line ({"event", "elapsed_s", "message", "waited_s"}; docs/running.md). '
    + exit_codes.help_text()
)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("difftest: interrupted", file=sys.stderr)
        return exit_codes.INTERRUPTED


def _main(argv: list[str] | None) -> int:
    ap = Parser(prog="difftest", description="Differential testing of EAGLE-3 draft wiring across engines")
    ap.add_argument("--version", action=_Version, help="difftest's version and the engines' pinned releases")
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fixtures", help="build the built-in tiny target and drafts into the cache")
    f.add_argument("names", nargs="*", metavar="NAME", help="only these fixtures (default: every provider's)")
    f.add_argument("--force", action="store_true", help="rebuild even if cached")
    f.add_argument(
        "--jobs",
        type=whole_number(1),
        default=max(1, min(2, os.cpu_count() or 1)),
        metavar="N",
        help="lanes of fixtures built side by side, one process and one thread each (default: up to 2 cores)",
    )
    f.add_argument("--list", action="store_true", help="list the fixtures (name, built or not, path); build nothing")
    r = sub.add_parser(
        "run",
        help="run cases (extra arguments go to pytest)",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("cases", nargs="*", default=["cases/"], help="case files or folders of them (default: cases/)")
    r.add_argument(
        "--engines", default=None, help='engines to compare, e.g. ref,sglang,"ref[wiring=sglang]" (default: ref)'
    )
    r.add_argument(
        "--reference", default=None, metavar="ENGINE", help="the engine the others are compared to (default: the first)"
    )
    r.add_argument("--out", default=None, metavar="DIR", help="where the reports go (default: reports/)")
    deprecated_alias(r, ["--report-dir"], "--out", "out")
    r.add_argument(
        "--engine-python",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="the interpreter an engine's worker runs in (NAME or NAME@LABEL); repeatable",
    )
    r.add_argument(
        "--allow-missing-engines",
        action="store_true",
        help="skip an engine that is not installed or cannot start (default: it fails the run, exit code 7)",
    )
    r.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    r.add_argument("--json", action="store_true", help="progress as JSON lines on stderr (docs/running.md)")
    r.add_argument("--save-baseline", default=None, metavar="NAME", help="store this run as baseline NAME")
    r.add_argument("--baseline", default=None, metavar="NAME[:ENGINE]", help="compare against baseline NAME")
    r.add_argument("--baseline-dir", default=None, help="where baselines live (default: ./baselines)")
    r.add_argument("--force", action="store_true", help="let --save-baseline replace an existing baseline")
    _env_parsers(sub)
    _report_parsers(sub)
    cache_command.add_parser(sub)
    fix_command.add_parser(sub)
    init_command.add_parser(sub)
    version_table.add_parser(sub)
    rules_command.add_parser(sub)
    try:
        _extension_parsers(sub)
    except DifftestError as e:
        print(f"difftest: {e}", file=sys.stderr)
        return exit_codes.CONFIG
    args, extra = ap.parse_known_args(argv)
    if args.command != "run" and extra:
        # the subcommand's own parser says it, so the closest name offered is one of its options
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "fixtures":
        return _fixtures(args)
    if args.command != "run":
        return args.handler(args)
    return _run(args, extra, r.option_names())


if __name__ == "__main__":
    sys.exit(main())
