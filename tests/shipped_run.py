"""One real run of the user's command over every shipped case, shared by every test that judges a
shipped case on the real engines.

`pytest cases/ --engines=ref,vllm,sglang,...` is what a user runs and what the README promises is
green. Starting vLLM and SGLang once per test module made CI pay for the same engine start-ups
and the same captures again and again; now the suite runs that command once and the tests read its
reports (`SHIPPED.report(case)`, `SHIPPED.outcome(case, engine, check)`).

The run is stored under `${DIFFTEST_CACHE}/shipped-runs/<key>/` where the key covers everything
its verdicts depend on: every file under `cases/`, `difftest/`, `difftest_engines/` and `difftest_fixtures/` (so
the fixtures' builders and the adapters too), the engine list and each engine environment's
resolved directory (whose name hashes its pins). A test stream that needs it while another builds it waits on a file
lock; a second test run on the same tree reads it. The run itself captures with
`--no-capture-cache`: its verdicts are those of the engines now, not of an older capture.

`python tests/shipped_run.py` runs it (or finds it) and prints where its reports are.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
if str(TESTS.parent) not in sys.path:
    sys.path.insert(0, str(TESTS.parent))

from helpers import ROOT, Run, run_pytest  # noqa: E402

from difftest.base.content_digest import signature  # noqa: E402
from difftest.base.paths import cache_root  # noqa: E402

# The user's command. The expectations the shipped cases declare for other engines are exercised
# elsewhere: the reference presets (`ref[wiring=vllm]`, ...) and the training-data engine by
# tests/test_cases.py and tests/test_chat_template.py, older releases by tests/test_upgrade_real_releases.py.
REAL = ("vllm", "sglang")
ENGINES = ("ref", *REAL)
SOURCES = ("cases", "difftest", "difftest_engines", "difftest_fixtures")
TIMEOUT_S = 3600.0


def engine_python(name: str) -> Path:
    return cache_root() / "envs" / name / "bin" / "python"


def missing_engines() -> list[str]:
    return [n for n in REAL if not engine_python(n).exists()]


def _sources(part: str) -> list:
    """The part's files by content; Python's bytecode caches aside (importing the tree writes them)."""
    return [entry for entry in signature(ROOT / part) if "__pycache__" not in Path(entry[0]).parts]


def run_key() -> str:
    h = hashlib.sha256()
    for part in SOURCES:
        h.update(json.dumps([part, _sources(part)]).encode())
    h.update(json.dumps(ENGINES).encode())
    for name in REAL:
        h.update(str(engine_python(name).resolve()).encode())
    return h.hexdigest()[:16]


def _load(directory: Path) -> Run:
    meta = json.loads((directory / "run.json").read_text())
    return Run(meta["returncode"], (directory / "output.txt").read_text(), directory)


def _places() -> tuple[Path, Path]:
    """The stored run's directory for this tree and these environments, and the lock its maker holds."""
    base = cache_root() / "shipped-runs"
    base.mkdir(parents=True, exist_ok=True)
    key = run_key()
    return base / key, base / f".{key}.lock"


def shipped() -> Run:
    """The stored run for this tree and these environments, made now if there is none."""
    directory, lock_path = _places()
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (directory / "run.json").exists():
            # written in place (the reports' links name their final paths); run.json, renamed into place
            # last, marks a finished run: a directory without it is an interrupted one and starts over
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            pythons = [f"--engine-python={n}={engine_python(n)}" for n in REAL]
            run = run_pytest(
                ROOT,
                "cases/",
                f"--engines={','.join(ENGINES)}",
                *pythons,
                "--require-engines",
                "--no-capture-cache",
                "--engine-timeout=600",
                f"--out={directory / 'reports'}",
                "--durations=15",
                timeout=TIMEOUT_S,
            )
            (directory / "output.txt").write_text(run.output)
            marker = directory / "run.json.tmp"
            marker.write_text(json.dumps({"returncode": run.returncode, "engines": ENGINES}))
            os.rename(marker, directory / "run.json")
    return _load(directory)


def reference_captures() -> None:
    """Before a test runs shipped cases on `ref` beside another engine (`ref[wiring=vllm]`, `train`),
    or on a pinned engine the run has (the upgrade check's bump sessions): while the shipped run is
    being made (scripts/test starts it before the suite), wait for it. It writes every engine's
    captures and speculative runs of every shipped case into the capture cache
    (`--no-capture-cache` only stops it reading the cache), and remembers each engine's identity
    (difftest/run/engine_identity.py), so the test's own run reads them by content key instead of
    computing them again, without starting an engine whose every result is cached. Nothing is
    started here: without a run under way (no engines, or a test run alone) the test computes its
    captures itself."""
    if missing_engines():
        return
    directory, lock_path = _places()
    if (directory / "run.json").exists():
        return
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its maker holds the lock: wait until the run is stored
            fcntl.flock(lock, fcntl.LOCK_EX)


def shipped_or_skip() -> Run:
    """For a test: the run, or a skip naming the setup commands (a failure under DIFFTEST_REQUIRE_ENGINES=1, CI)."""
    import pytest

    missing = missing_engines()
    if missing:
        why = "the shipped-case run needs " + ", ".join(f"{n} (scripts/setup-engine {n})" for n in missing)
        if os.environ.get("DIFFTEST_REQUIRE_ENGINES") == "1":
            pytest.fail(f"DIFFTEST_REQUIRE_ENGINES=1: {why}")
        pytest.skip(why)
    return shipped()


if __name__ == "__main__":
    run = shipped()
    print(run.output[-2500:])
    print(f"shipped run: rc {run.returncode}, reports in {run.root / 'reports'}")
    sys.exit(0 if run.returncode == 0 else 1)
