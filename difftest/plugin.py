"""pytest plugin: `pytest cases/ --engines=ref,"ref[wiring=sglang]"`.

Collects `cases/*.yaml`; each case x engine becomes named items
(`cases/tiny.yaml::ref[wiring=sglang]::fc_inputs`). The first engine is the reference
unless --reference says otherwise. A failing item prints the harness's one-paragraph
verdict, not a traceback; an engine that is not installed or cannot start fails with the
reason and its setup command (skips, with --allow-missing-engines). The session's exit status
says which kind of failure it met (difftest.base.exit_codes; docs/running.md).

Upgrade checks: `--save-baseline NAME` adds a `save_baseline` item per case x engine and writes
baselines/NAME at session end (difftest.run.baseline); `--baseline NAME` makes that stored run the
reference (`baseline:NAME`). Every session ends with the per-case verdict table (difftest.report.upgrade).
"""

from __future__ import annotations

import contextlib

import os
import sys
import threading
import argparse
from collections import Counter
from pathlib import Path
from typing import TextIO

import pytest

from difftest.run import baseline as baseline_mod
from difftest.run import memory_plan
from difftest.checks import checks as checks_mod
from difftest.report import upgrade as upgrade_mod
from difftest.report import writer as report_mod
from difftest.report import report_files
from difftest.case.case import Case, load_case
from difftest.base.registry import engine_schema, engine_target
from difftest.run.engine import EngineSpec, check_case_settings, check_settings
from difftest.run.engine import parse_engine_list, parse_spec
from difftest.base.registry import calibration_engine, registered_engines
from difftest.run.envs import interpreter, project_pythons
from difftest.base.outputs import check_output_dir
from difftest.base.errors import (
    CaseNotConfigured,
    ConfigError,
    DifftestError,
    EngineError,
    EngineUnavailable,
    NotAvailable,
)
from difftest.base.settings import unknown_key
from difftest.base import exit_codes
from difftest.run.progress import FORMATS, Progress
from difftest.case.expected_failure import judge as judge_expected
from difftest.records import CheckData, CheckResult, ExpectedFailureRecord
from difftest.run.case_run import engine_case_of
from difftest.run.session import Options, Session

SESSION = pytest.StashKey[Session]()
RESULTS = pytest.StashKey[dict]()
CASES = pytest.StashKey[dict]()
NAMES = pytest.StashKey[dict]()  # case name -> the file that claimed it (names key reports and baselines)
WRITER = pytest.StashKey["baseline_mod.BaselineWriter | None"]()
PROGRESS = pytest.StashKey["Progress | None"]()
KINDS = pytest.StashKey["FailureKinds"]()


def _terminal() -> TextIO | None:
    """The real stderr, taken when the plugin is loaded (before pytest captures fd 2): progress lines
    and heartbeats, which come from a thread too, go there without toggling pytest's capture."""
    try:
        return os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    except OSError:
        return None


_TERMINAL = _terminal()


class CheckFailed(Exception):
    """A check's verdict or a user-fixable error: shown as its message alone."""


FAILURE = "difftest.failure"  # the user property a failed item files its kind under (exit_codes.FAILURE_KINDS)


def _fail(item: pytest.Item, kind: str, message: str) -> CheckFailed:
    """The item fails as `kind`; its report carries the kind (to the xdist controller too), so the
    session's exit status says what kind of failure the run met (pytest_sessionfinish)."""
    item.user_properties.append((FAILURE, kind))
    return CheckFailed(message)


class FailureKinds:
    """The kinds of the session's failed items, from their reports (wherever the items ran), and
    whether the session ended by a real Ctrl-C."""

    def __init__(self) -> None:
        self.kinds: set[str] = set()
        self.ctrl_c = False

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.kinds.update(str(value) for name, value in report.user_properties if name == FAILURE)

    def pytest_keyboard_interrupt(self, excinfo) -> None:
        # pytest reports collection errors and pytest.exit() as interruptions too; only Ctrl-C is 130
        self.ctrl_c = excinfo.type is KeyboardInterrupt


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("difftest", "EAGLE-3 differential testing")
    g.addoption(
        "--engines",
        default=None,
        help='engines to compare, e.g. ref,"ref[wiring=sglang]",vllm (default: the engine that calibrates, ref)',
    )
    g.addoption("--reference", default=None, help="the engine others are compared to (default: the first of --engines)")
    g.addoption(
        "--engine-python",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="interpreter for an engine's worker (NAME is name or name@label); repeatable",
    )
    g.addoption("--out", default=None, help="where per-case JSON/Markdown/HTML reports go (default: <rootdir>/reports)")
    # the old spelling, kept one release: it works and warns, naming --out (one name per concept)
    g.addoption("--report-dir", dest="report_dir", default=None, help=argparse.SUPPRESS)
    g.addoption(
        "--progress",
        default=None,
        choices=FORMATS,
        help="progress lines on stderr while engines start and run: lines (default; off under -q), json "
        "(one object per line), off",
    )
    g.addoption(
        "--engine-timeout",
        type=float,
        default=900.0,
        help="seconds one engine request may take (default 900; starting an engine at least 120)",
    )
    g.addoption(
        "--allow-missing-engines",
        action="store_true",
        help="skip, instead of fail, the items of an engine that is not installed or cannot start",
    )
    # failing is the default now; the old flag is accepted one release and warns
    g.addoption("--require-engines", action="store_true", help=argparse.SUPPRESS)
    g.addoption("--no-capture-cache", action="store_true", help="recapture instead of reusing cached captures")
    g.addoption(
        "--save-baseline",
        default=None,
        metavar="NAME",
        help="store every engine's captures and accept-length stats as baseline NAME (immutable)",
    )
    g.addoption(
        "--baseline",
        default=None,
        metavar="NAME[:ENGINE]",
        help="compare the engines against stored baseline NAME (it becomes the reference, baseline:NAME)",
    )
    g.addoption("--baseline-dir", default=None, help="where baselines live (default: <rootdir>/baselines)")
    g.addoption(
        "--force-baseline",
        "--force",
        dest="force_baseline",
        action="store_true",
        help="let --save-baseline replace an existing baseline",
    )


# the options that take a value, by dest: each refused when given empty
VALUE_OPTIONS = ("engines", "reference", "out", "report_dir", "save_baseline", "baseline", "baseline_dir")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "difftest(check, engine): an item generated from a difftest case")
    config.stash[KINDS] = FailureKinds()
    config.pluginmanager.register(config.stash[KINDS], "difftest-failure-kinds")
    try:
        for option in VALUE_OPTIONS:  # what an unset variable gives (--engines=$ENGINES): never the default
            value = config.getoption(option)
            if value is not None and not value.strip():
                raise ConfigError(
                    f"--{option.replace('_', '-')}: empty value (an unset variable?); give a value or leave the option out"
                )
        engines = parse_engine_list(config.getoption("engines") or calibration_engine())
        reference = parse_spec(config.getoption("reference")) if config.getoption("reference") else engines[0]
        if reference.id not in [e.id for e in engines]:
            engines.insert(0, reference)
        for spec in engines:
            engine_target(spec.name)
            if spec.params:  # the spec alone, before any case (a case's section is checked when it is collected)
                schema = engine_schema(spec.name)
                if schema is not None:
                    check_settings(schema, spec)
        # the project file (difftest.toml) first, so --engine-python overrides it
        pythons = project_pythons(Path(config.rootpath))
        for item in config.getoption("engine_python"):
            pythons.update(_engine_python(item))
        timeout = config.getoption("engine_timeout")
        if not (0 < timeout < float("inf")):
            raise ConfigError(f"--engine-timeout: expected a positive number of seconds, got {timeout:g}")
        memory_plan.declared_budget()  # a malformed DIFFTEST_MEMORY_BUDGET: refused before any engine starts
        out = config.getoption("out")
        if config.getoption("report_dir"):
            _deprecated("--report-dir", "--out")
            if out:
                raise ConfigError("--report-dir is the old name of --out; give --out only")
            out = config.getoption("report_dir")
        if config.getoption("require_engines"):
            _deprecated(
                "--require-engines", "nothing: a missing engine fails by default (--allow-missing-engines skips)"
            )
        report_dir = Path(out or Path(config.rootpath) / "reports")
        _check_writable_dir(report_dir, "--out")
        baseline_dir = Path(config.getoption("baseline_dir") or Path(config.rootpath) / baseline_mod.DEFAULT_DIR)
        if config.getoption("baseline_dir") or config.getoption("baseline") or config.getoption("save_baseline"):
            # up front, not when the run is over: the folder is written at the session's end, or read first
            where = (
                "--baseline-dir"
                if config.getoption("baseline_dir")
                else "--baseline-dir (default: <rootdir>/baselines)"
            )
            if config.getoption("save_baseline"):
                check_output_dir(baseline_dir, where)
            elif baseline_dir.exists() and not baseline_dir.is_dir():
                raise ConfigError(f"{where}: {baseline_dir} is not a directory")
        stored = None
        if config.getoption("baseline"):
            if config.getoption("reference"):
                raise ConfigError("--baseline: the baseline is the reference; drop --reference")
            stored = baseline_mod.BaselineSource(
                baseline_dir, *baseline_mod.parse_reference(config.getoption("baseline"))
            )
            reference = stored.spec
            engines.insert(0, reference)
        writer = None
        if config.getoption("save_baseline"):
            writer = baseline_mod.BaselineWriter(
                baseline_dir, config.getoption("save_baseline"), config.getoption("force_baseline")
            )
    except ConfigError as e:
        raise pytest.UsageError(str(e)) from None
    progress = _progress_writer(config)
    config.stash[PROGRESS] = progress
    options = Options(
        engines=engines,
        reference=reference,
        engine_python=pythons,
        timeout=timeout,
        use_cache=not config.getoption("no_capture_cache"),
        log_dir=report_dir / "logs",
        progress=progress,
    )
    config.stash[SESSION] = Session(options)
    if stored is not None:
        config.stash[SESSION].add_stored(stored)
    config.stash[WRITER] = writer
    config.stash[RESULTS] = {}
    config.stash[CASES] = {}
    config.stash[NAMES] = {}
    config._difftest_report_dir = report_dir  # type: ignore[attr-defined]


def _engine_python(item: str) -> dict[str, str]:
    """--engine-python NAME=PATH: a registered engine (name or name@label) and an executable interpreter."""
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--engine-python: {item!r} is not NAME=PATH")
    try:
        spec = parse_spec(name)
    except ConfigError:
        spec = None
    if spec is None or spec.params or spec.key != name.strip():
        raise ConfigError(f"--engine-python {item}: {name!r} is not an engine name (NAME or NAME@LABEL)")
    known = registered_engines()
    if spec.name not in known:
        raise unknown_key(f"--engine-python {item}: {spec.name}", spec.name, known, "engine")
    return {spec.key: interpreter(path, f"--engine-python {item}")}


# refused at start-up, not at session end: a directory that cannot be created or written
_check_writable_dir = check_output_dir


def _deprecated(old: str, new: str) -> None:
    print(f"difftest: {old} is deprecated and goes in the next release; use {new}", file=sys.stderr, flush=True)


def _progress_writer(config: pytest.Config) -> Progress | None:
    """Progress lines (difftest.run.progress) on stderr: `--progress` says the format; by default
    lines, none under -q."""
    chosen = config.getoption("progress") or ("off" if config.get_verbosity() < 0 else "lines")
    if chosen == "off":
        return None
    terminal = _TERMINAL

    def write(line: str) -> None:
        # pytest may be mid-line on stdout (`-v` writes an item's id, then its outcome): end that line
        # first, from the main thread only (a heartbeat comes from its own), and flush it, so the
        # progress line stands alone and pytest writes the id again before the outcome
        # (with capture suspended, as pytest's live logging does: during an item's call fd 1 is captured,
        # and the newline would land in the item's "Captured stdout" section instead of the terminal)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        capman = config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and threading.current_thread() is threading.main_thread():
            with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
                reporter.ensure_newline()
                reporter._tw.flush()
        if terminal is not None:
            terminal.write(line + "\n")
            return
        print(line, file=sys.__stderr__, flush=True)

    return Progress(chosen, write)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Between items nothing is awaited: no heartbeat about a step that finished."""
    progress = item.config.stash.get(PROGRESS, None)
    if progress is not None:
        progress.idle()


def pytest_unconfigure(config: pytest.Config) -> None:
    progress = config.stash.get(PROGRESS, None)
    if progress is not None:
        progress.close()
    session = config.stash.get(SESSION, None)
    if session is not None:
        session.close()


def named_on_command_line(config: pytest.Config, file_path: Path) -> bool:
    """A file the user named as an argument (`pytest my/case.yaml`), wherever it lives."""
    where = Path(config.invocation_params.dir)
    for arg in config.args:
        try:
            if (where / arg.split("::")[0]).resolve() == file_path.resolve():
                return True
        except OSError:
            continue
    return False


def pytest_collect_file(parent: pytest.Collector, file_path: Path):
    """Case files: YAML in a folder named `cases` (`pytest cases/`), or any YAML named on the
    command line. Other YAML (a project's CI config, say) is never collected."""
    if file_path.suffix in (".yaml", ".yml") and (
        file_path.parent.name == "cases" or named_on_command_line(parent.config, file_path)
    ):
        return CaseFile.from_parent(parent, path=file_path)
    return None


class CaseFile(pytest.File):
    def collect(self):
        session: Session = self.config.stash[SESSION]
        with session.clock.phase("collect", str(self.path)):  # a case's path is its file's (load_case)
            try:
                case = load_case(self.path)
            except ConfigError as e:
                case, problem = None, ErrorItem.from_parent(self, name="load", error=str(e))
            except CaseNotConfigured as e:
                case, problem = None, NotConfiguredItem.from_parent(self, name="load", reason=str(e))
            else:
                problem = self._check(case, session)
        if case is None:
            yield problem
            return
        if problem is not None:
            yield ErrorItem.from_parent(self, name="load", error=problem)
            return
        try:  # the checks engines contribute are loaded here first: a broken registration is one line
            checks = {
                spec.id: checks_mod.checks_for(case, spec.id == session.options.reference.id, spec.name)
                for spec in session.options.engines
            }
        except ConfigError as e:
            yield ErrorItem.from_parent(self, name="load", error=str(e))
            return
        self.config.stash[CASES][case.path] = case
        for spec in session.options.engines:
            for check in checks[spec.id]:
                yield CheckItem.from_parent(self, name=f"{spec.id}::{check}", case=case, spec=spec, check=check)
            if self.config.stash[WRITER] is not None and not spec.name.startswith(baseline_mod.PREFIX):
                yield SaveBaselineItem.from_parent(self, name=f"{spec.id}::save_baseline", case=case, spec=spec)

    def _check(self, case: Case, session: Session) -> str | None:
        """What makes this case unusable with these engines, as one line (None: nothing)."""
        names = self.config.stash[NAMES]
        other = names.setdefault(case.name, case.path)
        if other != case.path:
            return (
                f"{case.path}: name: {case.name!r} is already the name of {other}; case names key report files "
                f"and baseline entries, so each must be unique"
            )
        try:
            check_case_settings(case, session.options.engines, engine_case_of)
        except ConfigError as e:
            return str(e)
        return None


class ErrorItem(pytest.Item):
    def __init__(self, *, error: str, **kwargs):
        super().__init__(**kwargs)
        self.error = error

    def runtest(self) -> None:
        writer = self.config.stash.get(WRITER, None)
        if writer is not None:  # a baseline must not be saved without a case the run was asked to store
            writer.problems.append(self.error)
        raise _fail(self, "config", self.error)

    def repr_failure(self, excinfo, style=None):
        return str(excinfo.value)

    def reportinfo(self):
        return self.path, None, f"{self.path.name}::load"


class NotConfiguredItem(pytest.Item):
    """A case for a model this machine does not have (an unset ${VAR}): skips, saying which."""

    def __init__(self, *, reason: str, **kwargs):
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self) -> None:
        pytest.skip(self.reason)

    def reportinfo(self):
        return self.path, None, f"{self.path.name}::load"


class CheckItem(pytest.Item):
    def __init__(self, *, case: Case, spec: EngineSpec, check: str, **kwargs):
        super().__init__(**kwargs)
        self.case, self.spec, self.check = case, spec, check
        self.add_marker(pytest.mark.difftest(check, spec.id))
        # `-k ref_wiring_sglang`: the spec id as one -k word (its grammar has no `=` or `@`)
        self.extra_keyword_matches.add(report_mod.keyword(spec.id))

    def runtest(self) -> None:
        session: Session = self.config.stash[SESSION]
        session.begin_case(self.case.path)
        results = self.config.stash[RESULTS].setdefault(self.case.path, [])
        try:
            with session.clock.phase("check", self.case.path, self.spec.id, self.case.dtype):
                verdict = checks_mod.run_check(self.check, session.run(self.case), self.spec)
        except NotAvailable as e:
            results.append(CheckResult(self.spec.id, self.check, "not available", str(e)))
            pytest.skip(str(e))
        except EngineUnavailable as e:
            if self.config.getoption("allow_missing_engines"):
                results.append(CheckResult(self.spec.id, self.check, "skipped", str(e)))
                pytest.skip(str(e))
            # the report says what the exit status says: this engine was required and did not run
            results.append(CheckResult(self.spec.id, self.check, "error", _unavailable(e)))
            raise _fail(self, "engine", _unavailable(e)) from None
        except DifftestError as e:
            message = str(e)
            if isinstance(e, EngineError):
                message = checks_mod.explain_engine_error(session.run(self.case), self.spec, message)
            self._expected_or_raise(results, "error", message, None, _kind(e, session, self.spec))
            return
        self._expected_or_raise(results, "passed" if verdict.passed else "failed", verdict.message, verdict.data)

    def _expected_or_raise(
        self, results: list, outcome: str, message: str, data: CheckData | None, kind: str = "regression"
    ) -> None:
        """Record the outcome; a declared expected failure (difftest.case.expected_failure) is judged strictly."""
        session = self.config.stash[SESSION]
        reference = session.run(self.case).reference_names()
        info = session.pool.engine_info(self.spec)
        variant = info.variant if info is not None else ""
        expected = next(
            (
                e
                for e in self.case.expect_failure
                if e.matches(self.spec.name, self.spec.id, self.check, reference, variant)
            ),
            None,
        )
        if expected is None:
            results.append(CheckResult(self.spec.id, self.check, outcome, message, data))
            self.user_properties += report_mod.junit_properties(results[-1], self.case.path)
            if outcome != "passed":
                raise _fail(self, kind, message)
            return
        judged = judge_expected(expected, outcome == "passed", message)
        results.append(
            CheckResult(
                self.spec.id,
                self.check,
                "xfailed" if judged.expected else "failed",
                judged.message,
                data,
                ExpectedFailureRecord(
                    expected.engine,
                    expected.check,
                    expected.cause,
                    None if expected.reference == "*" else expected.reference,
                ),
            )
        )
        self.user_properties += report_mod.junit_properties(results[-1], self.case.path)
        if not judged.expected:
            raise _fail(self, kind, judged.message)
        pytest.xfail(f"expected failure: {expected.cause}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CheckFailed):
            report_dir = self.config._difftest_report_dir
            return f"{excinfo.value}\nreport: {_shown(report_dir / (self.case.name + '.json'), self.config)}"
        return "internal error in difftest (a harness bug, not an engine divergence):\n" + str(
            super().repr_failure(excinfo, style)
        )

    def reportinfo(self):
        return self.path, None, f"{self.case.name}::{self.spec.id}::{self.check}"


def _shown(path: Path, config: pytest.Config) -> str:
    """A path as the failure text (and so the JUnit XML) shows it: relative to where pytest was
    started, else with `~` for the home directory; never this machine's layout."""
    try:
        return str(path.resolve().relative_to(Path(config.invocation_params.dir).resolve()))
    except ValueError:
        return report_mod.portable(str(path), "")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """JUnit names one scheme for every item: classname `cases.tiny.yaml.ENGINE_ID`, name the check
    (pytest's own split cuts at the first `[`, so `ref[wiring=sglang]` items got another scheme)."""
    if not isinstance(item, (CheckItem, SaveBaselineItem)):
        return
    from _pytest.junitxml import xml_key  # pytest's record_xml_attribute does the same; no public hook

    xml = item.config.stash.get(xml_key, None)
    if xml is None:
        return
    reporter = xml.node_reporter(getattr(item, "id", item.nodeid))  # the key junitxml files the item's reports under
    file_part = item.nodeid.split("::", 1)[0]
    classname = f"{file_part.replace('/', '.')}.{item.spec.id}"
    reporter.add_attribute("classname", f"{xml.prefix}.{classname}" if xml.prefix else classname)
    reporter.add_attribute("name", item.name.rsplit("::", 1)[-1])


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """pytest-xdist's `-n` is refused for case files: a case's checks share one engine run and one
    report, which workers in other processes would each redo and each write incomplete."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    where = Path(config.invocation_params.dir)
    for arg in config.args:
        target = where / arg.split("::")[0]
        cases = [target] if target.suffix in (".yaml", ".yml") else [target, target / "cases"]
        if any(c.suffix in (".yaml", ".yml") or (c.name == "cases" and any(c.glob("*.y*ml"))) for c in cases):
            raise pytest.UsageError(
                f"-n (pytest-xdist): {arg} holds difftest case files, whose checks share one engine run and "
                "one report per case; run them without -n"
            )


def _unavailable(e: EngineUnavailable) -> str:
    return f"engine unavailable: {e} (--allow-missing-engines skips it instead)"


def _kind(e: DifftestError, session: Session, spec: EngineSpec) -> str:
    """What a run's error was: the case's or its models' configuration, an engine that never started,
    or (an engine erring on the case) a regression."""
    if isinstance(e, ConfigError):
        return "config"
    if session.pool.start_error(spec) is not None:
        return "engine"
    return "regression"


class SaveBaselineItem(pytest.Item):
    """Stores one engine's captures and accept stats for --save-baseline (written at session end)."""

    def __init__(self, *, case: Case, spec: EngineSpec, **kwargs):
        super().__init__(**kwargs)
        self.case, self.spec = case, spec
        self.add_marker(pytest.mark.difftest("save_baseline", spec.id))

    def runtest(self) -> None:
        writer = self.config.stash[WRITER]
        if writer is None:  # these items exist only under --save-baseline, which makes the writer
            raise CheckFailed("--save-baseline: no baseline is being written")
        try:
            writer.add(self.config.stash[SESSION].run(self.case), self.spec)
        except EngineUnavailable as e:
            writer.problems.append(f"{self.case.name} {self.spec.id}: {e}")
            if self.config.getoption("allow_missing_engines"):
                pytest.skip(str(e))
            raise _fail(self, "engine", _unavailable(e)) from None
        except DifftestError as e:
            writer.problems.append(f"{self.case.name} {self.spec.id}: {e}")
            raise _fail(self, _kind(e, self.config.stash[SESSION], self.spec), str(e)) from None

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CheckFailed):
            return str(excinfo.value)
        return "internal error in difftest (a harness bug, not an engine divergence):\n" + str(
            super().repr_failure(excinfo, style)
        )

    def reportinfo(self):
        return self.path, None, f"{self.case.name}::{self.spec.id}::save_baseline"


def _finish_baseline(session: pytest.Session, writer: baseline_mod.BaselineWriter) -> str:
    """Commit the staged baseline when every entry was stored; otherwise leave nothing behind."""
    if writer.problems or not writer.entries:
        writer.discard()
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        why = writer.problems[0] if writer.problems else "nothing was stored (no case collected)"
        return f"baseline {writer.name!r} NOT written: {why}"
    try:
        path = writer.commit()
    except (ConfigError, OSError) as e:
        writer.discard()
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        return f"baseline {writer.name!r} NOT written: {e}"
    n = sum(len(c.engines) for c in writer.entries.values())
    return f"baseline {writer.name!r} written: {path} ({n} case x engine entries, {writer.size() / 1024:.0f} KiB)"


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    config = session.config
    if SESSION not in config.stash:
        return
    report_dir = config._difftest_report_dir  # type: ignore[attr-defined]
    selected = Counter(item.case.path for item in session.items if isinstance(item, CheckItem))
    written: list[Path | str] = []  # a report's path, or why it was not written
    kept: list[Path] = []
    rows: list = []
    for path, results in config.stash[RESULTS].items():
        case = config.stash[CASES][path]
        try:  # one case's report failing (disk full, ...) must not lose the others' or the summary
            report = report_mod.build(config.stash[SESSION].run(case).record(results))
            if len(results) < selected[path]:  # Ctrl-C, -x, a crash of the run: not every check ran
                report.interrupted = True
                previous = report_mod.json_path(report, report_dir)
                if report_mod.is_complete(previous):
                    kept.append(previous)  # an interrupted run never replaces a finished report
                    continue
            written.append(report_files.write(report, report_dir))
            rows += upgrade_mod.summarise(report, report_dir)
        except (DifftestError, OSError) as e:
            written.append(f"{case.name}: report NOT written: {e}")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        config.stash[SESSION].abort()  # a worker mid-request cannot answer a polite close
    config._difftest_written = written  # type: ignore[attr-defined]
    config._difftest_kept = kept  # type: ignore[attr-defined]
    config._difftest_summary = rows  # type: ignore[attr-defined]
    writer = config.stash.get(WRITER, None)
    if writer is not None:
        config._difftest_baseline = _finish_baseline(session, writer)  # type: ignore[attr-defined]
    _set_exit_status(session)  # last: a report or baseline not written fails the session first


def _set_exit_status(session: pytest.Session) -> None:
    """The exit status a CI can trust (difftest.base.exit_codes): Ctrl-C is 130; a failed session says
    whether a case's configuration, an engine that never started or a regression failed it."""
    kinds = session.config.stash[KINDS]
    if session.exitstatus == pytest.ExitCode.INTERRUPTED and kinds.ctrl_c:
        session.exitstatus = exit_codes.INTERRUPTED
    elif session.exitstatus == pytest.ExitCode.TESTS_FAILED and kinds.kinds:
        session.exitstatus = exit_codes.worst(kinds.kinds)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    written = getattr(config, "_difftest_written", [])
    kept = getattr(config, "_difftest_kept", [])
    if written or kept:
        terminalreporter.write_sep("-", "difftest reports")
        for p in written:
            terminalreporter.write_line(str(p))
        for p in kept:
            terminalreporter.write_line(f"{p} (kept: the run was interrupted before this case finished)")
    rows = getattr(config, "_difftest_summary", [])
    if rows:
        terminalreporter.write_sep(
            "-", "difftest summary (accept length AL: accepted draft tokens + 1 per verify step)"
        )
        for line in upgrade_mod.render(rows):
            terminalreporter.write_line(line)
    baseline = getattr(config, "_difftest_baseline", None)
    if baseline:
        terminalreporter.write_sep("-", "difftest baseline")
        terminalreporter.write_line(baseline)
