"""pytest plugin: `pytest cases/ --engines=ref,"ref[wiring=sglang]"`.

Collects `cases/*.yaml`; each case x engine becomes named items
(`cases/tiny.yaml::ref[wiring=sglang]::fc_inputs`). The first engine is the reference
unless --reference says otherwise. A failing item prints the harness's one-paragraph
verdict, not a traceback; an engine that is not installed skips with the reason and
its setup command (or fails, with --require-engines, as CI runs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from difftest import checks as checks_mod
from difftest import report as report_mod
from difftest.case import Case, load_case
from difftest.engine import EngineSpec, engine_target, parse_engine_list, parse_spec
from difftest.errors import ConfigError, DifftestError, EngineUnavailable
from difftest.session import Options, Session

SESSION = pytest.StashKey[Session]()
RESULTS = pytest.StashKey[dict]()
CASES = pytest.StashKey[dict]()


class CheckFailed(Exception):
    """A check's verdict or a user-fixable error: shown as its message alone."""


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("difftest", "EAGLE-3 differential testing")
    g.addoption("--engines", default="ref", help='engines to compare, e.g. ref,"ref[wiring=sglang]",vllm (default: ref)')
    g.addoption("--reference", default=None, help="the engine others are compared to (default: the first of --engines)")
    g.addoption("--engine-python", action="append", default=[], metavar="NAME=PATH",
                help="interpreter for an engine's worker (NAME is name or name@label); repeatable")  # fmt: skip
    g.addoption("--report-dir", default=None, help="where per-case JSON/Markdown reports go (default: <rootdir>/reports)")
    g.addoption("--engine-timeout", type=float, default=900.0, help="seconds one engine request may take (default 900)")
    g.addoption("--require-engines", action="store_true", help="fail instead of skip when an engine is not installed (CI)")
    g.addoption("--no-capture-cache", action="store_true", help="recapture instead of reusing cached captures")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "difftest(check, engine): an item generated from a difftest case")
    try:
        engines = parse_engine_list(config.getoption("engines"))
        reference = parse_spec(config.getoption("reference")) if config.getoption("reference") else engines[0]
        if reference.id not in [e.id for e in engines]:
            engines.insert(0, reference)
        for spec in engines:
            engine_target(spec.name)
        pythons = {}
        for item in config.getoption("engine_python"):
            name, sep, path = item.partition("=")
            if not sep or not path:
                raise ConfigError(f"--engine-python: {item!r} is not NAME=PATH")
            pythons[name] = path
    except ConfigError as e:
        raise pytest.UsageError(str(e)) from None
    report_dir = Path(config.getoption("report_dir") or Path(config.rootpath) / "reports")
    options = Options(
        engines=engines,
        reference=reference,
        engine_python=pythons,
        timeout=config.getoption("engine_timeout"),
        use_cache=not config.getoption("no_capture_cache"),
        log_dir=report_dir / "logs",
        progress=_progress_writer(config),
    )
    config.stash[SESSION] = Session(options)
    config.stash[RESULTS] = {}
    config.stash[CASES] = {}
    config._difftest_report_dir = report_dir  # type: ignore[attr-defined]


def _progress_writer(config: pytest.Config):
    """`[difftest] ...` lines while engines load and run; none under -q."""
    if config.get_verbosity() < 0:
        return None

    def write(message: str) -> None:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        capture = config.pluginmanager.get_plugin("capturemanager")
        if reporter is None:
            return
        if capture is None:
            reporter.write_line(f"[difftest] {message}")
            return
        with capture.global_and_fixture_disabled():  # straight to the terminal, not into the item's captured output
            reporter.write_line(f"[difftest] {message}")

    return write


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(SESSION, None)
    if session is not None:
        session.close()


def pytest_collect_file(parent: pytest.Collector, file_path: Path):
    if file_path.suffix in (".yaml", ".yml") and file_path.parent.name == "cases":
        return CaseFile.from_parent(parent, path=file_path)
    return None


class CaseFile(pytest.File):
    def collect(self):
        session: Session = self.config.stash[SESSION]
        try:
            case = load_case(self.path)
        except ConfigError as e:
            yield ErrorItem.from_parent(self, name="load", error=str(e))
            return
        self.config.stash[CASES][case.path] = case
        for spec in session.options.engines:
            is_ref = spec.id == session.options.reference.id
            for check in checks_mod.checks_for(case, is_ref):
                yield CheckItem.from_parent(self, name=f"{spec.id}::{check}", case=case, spec=spec, check=check)


class ErrorItem(pytest.Item):
    def __init__(self, *, error: str, **kwargs):
        super().__init__(**kwargs)
        self.error = error

    def runtest(self) -> None:
        raise CheckFailed(self.error)

    def repr_failure(self, excinfo, style=None):
        return str(excinfo.value)

    def reportinfo(self):
        return self.path, None, f"{self.path.name}::load"


class CheckItem(pytest.Item):
    def __init__(self, *, case: Case, spec: EngineSpec, check: str, **kwargs):
        super().__init__(**kwargs)
        self.case, self.spec, self.check = case, spec, check
        self.add_marker(pytest.mark.difftest(check, spec.id))

    def runtest(self) -> None:
        session: Session = self.config.stash[SESSION]
        results = self.config.stash[RESULTS].setdefault(self.case.path, [])
        record = {"engine": self.spec.id, "check": self.check}
        try:
            verdict = checks_mod.CHECKS[self.check](session, self.case, self.spec)
        except EngineUnavailable as e:
            results.append({**record, "outcome": "skipped", "message": str(e)})
            if self.config.getoption("require_engines"):
                raise CheckFailed(f"engine required but unavailable: {e}") from None
            pytest.skip(str(e))
        except DifftestError as e:
            results.append({**record, "outcome": "error", "message": str(e)})
            raise CheckFailed(str(e)) from None
        results.append({**record, "outcome": "passed" if verdict.passed else "failed",
                        "message": verdict.message, "data": verdict.data})  # fmt: skip
        if not verdict.passed:
            raise CheckFailed(verdict.message)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CheckFailed):
            report_dir = self.config._difftest_report_dir  # type: ignore[attr-defined]
            return f"{excinfo.value}\nreport: {report_dir / (self.case.name + '.json')}"
        return "internal error in difftest (a harness bug, not an engine divergence):\n" + str(
            super().repr_failure(excinfo, style)
        )

    def reportinfo(self):
        return self.path, None, f"{self.case.name}::{self.spec.id}::{self.check}"


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    config = session.config
    if SESSION not in config.stash:
        return
    report_dir = config._difftest_report_dir  # type: ignore[attr-defined]
    written = []
    for path, results in config.stash[RESULTS].items():
        case = config.stash[CASES][path]
        written.append(report_mod.write(report_mod.build(case, config.stash[SESSION], results), report_dir))
    config._difftest_written = written  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    written = getattr(config, "_difftest_written", [])
    if written:
        terminalreporter.write_sep("-", "difftest reports")
        for p in written:
            terminalreporter.write_line(str(p))
