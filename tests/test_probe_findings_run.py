"""The broken-input probe's findings on running (issue 45 item 8): each one is refused in one line
naming what is wrong, or now does the right thing.

1. an empty option value (`--engines=`, an unset CI variable) is a usage error, not the default;
2. two runs saving the same baseline at once: the second is refused, not silently replacing the first;
3. `--baseline-dir` naming a file is refused before the run;
4. `difftest report` on JSON nested too deeply names the file;
5. a server that answers 200 with a body that is not JSON, or bytes that are not HTTP, is named;
6. Ctrl-C while `difftest` imports, or while `train-acc` scores, is exit 130 and one line;
7. `difftest run` leaves no `.benchmarks/` folder (pytest-benchmark's) behind;
8. (a rerun at stop 53) an empty value to the other commands' options (`init --engines/--server`,
   `probe --server/--model`, `train-acc --wiring`) is a usage error too, and `difftest versions` names a
   report nested too deeply (it ended in a RecursionError traceback).

Engine-free: the runs refuse before any engine starts, and the baseline race runs on BaselineWriter."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from difftest import cli
from difftest.base import exit_codes
from difftest.base.errors import ConfigError
from difftest.run.baseline import BaselineWriter
from helpers import ROOT, TESTS, one_line, run_pytest


def _difftest(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`difftest ARGS` in a fresh process inside `cwd`."""
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), environ.get("PYTHONPATH", "")])
    environ.update(env or {})
    command = [sys.executable, "-m", "difftest.cli", *args]
    return subprocess.run(command, cwd=cwd, env=environ, capture_output=True, text=True, timeout=600)


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# -- 1. an empty option value ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "option", ["--engines", "--reference", "--out", "--save-baseline", "--baseline", "--baseline-dir"]
)
def test_an_empty_option_value_is_a_usage_error_from_difftest_run(option, tmp_path, capsys):
    assert cli.main(["run", str(tmp_path), f"{option}="]) == exit_codes.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"difftest run: {option}: empty value"), err


def test_an_empty_engines_value_is_a_usage_error_from_pytest(tmp_path):
    (tmp_path / "cases").mkdir()
    run = run_pytest(tmp_path, "cases/", "--engines=")
    assert run.returncode == exit_codes.USAGE, run.output
    assert "--engines: empty value" in run.output
    assert "Traceback" not in run.output


# -- 2. two runs saving the same baseline --------------------------------------------------------
def _staged(root: Path, name: str, mark: str) -> BaselineWriter:
    writer = BaselineWriter(root, name)
    (writer._staging() / "mark").write_text(mark)
    return writer


def test_a_baseline_another_run_commits_after_this_runs_check_is_refused_not_replaced(tmp_path, monkeypatch):
    first, second = _staged(tmp_path, "v1", "first"), _staged(tmp_path, "v1", "second")
    checked = second.refuse_existing

    def check_then_the_other_run_commits() -> None:  # the window between the check and the rename
        checked()
        first.commit()

    monkeypatch.setattr(second, "refuse_existing", check_then_the_other_run_commits)
    with pytest.raises(ConfigError) as e:
        second.commit()
    assert "'v1' already exists" in one_line(e)
    assert (tmp_path / "v1" / "mark").read_text() == "first"


def test_of_baselines_committed_at_once_under_one_name_exactly_one_is_written(tmp_path):
    writers = [_staged(tmp_path, "v1", f"run {i}") for i in range(4)]
    start = threading.Barrier(len(writers))
    outcomes: list[str] = []

    def commit(writer: BaselineWriter) -> None:
        start.wait()
        try:
            writer.commit()
            outcomes.append("written")
        except ConfigError:
            writer.discard()
            outcomes.append("refused")

    threads = [threading.Thread(target=commit, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["refused"] * 3 + ["written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]  # no staging folder left behind


# -- 3. --baseline-dir naming a file -----------------------------------------------------------
@pytest.mark.parametrize("use", ["--save-baseline=v1", "--baseline=v1"])
def test_a_baseline_dir_that_is_a_file_is_refused_before_the_run(use, tmp_path):
    (tmp_path / "cases").mkdir()
    afile = tmp_path / "afile"
    afile.write_text("")
    run = run_pytest(tmp_path, "cases/", use, f"--baseline-dir={afile}")
    assert run.returncode == exit_codes.USAGE, run.output
    assert f"--baseline-dir: {afile} is not a directory" in run.output
    assert "internal error" not in run.output and "Traceback" not in run.output


# -- 4. a report nested too deeply ---------------------------------------------------------------
@pytest.mark.parametrize("command", ["report", "bundle"])
def test_a_report_nested_too_deeply_is_named_in_one_line(command, tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text('{"case": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert cli.main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"difftest {command}: {path}: not a difftest report (JSON nested too deeply to read)\n"


# -- 5. a server that answers what is not JSON, or not HTTP ---------------------------------------
def _raw_server(answer: bytes) -> tuple[str, socket.socket]:
    """A socket on localhost answering every connection with `answer`, then closing it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", listener


NOT_JSON = b"<html>hello\x00</html>"
OK_NOT_JSON = b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(NOT_JSON), NOT_JSON)
NOT_HTTP = b"SSH-2.0-OpenSSH_9.6\r\n"


@pytest.mark.parametrize("kind,path", [("sglang", "/server_info"), ("vllm", "/v1/models"), (None, "/server_info")])
def test_a_server_answering_200_with_a_body_that_is_not_json_is_named(kind, path):
    from difftest_engines.server.client import ServerClient, ServerError

    url, listener = _raw_server(OK_NOT_JSON)
    try:
        with pytest.raises(ServerError) as e:
            ServerClient(url, kind, timeout=10).settings()
    finally:
        listener.close()
    assert one_line(e) == (
        f"{url}{path} answered 200 with a body that is not JSON (first bytes: {NOT_JSON.decode(errors='replace')!r})"
    )


def test_a_port_that_does_not_speak_http_is_named():
    from difftest_engines.server.client import ServerClient, ServerError

    url, listener = _raw_server(NOT_HTTP)
    try:
        with pytest.raises(ServerError) as e:
            ServerClient(url, "sglang", timeout=10).settings()
    finally:
        listener.close()
    assert one_line(e) == (
        f"{url}/server_info is not an HTTP server (it answered bytes that are not an HTTP status line: "
        "'SSH-2.0-OpenSSH_9.6\\r\\n')"
    )


def test_a_server_engine_on_a_port_that_does_not_speak_http_is_unavailable_in_one_line():
    from difftest.api import EngineError, parse_spec
    from difftest_engines.server.engine import ServerEngine

    url, listener = _raw_server(NOT_HTTP)
    try:
        with pytest.raises(EngineError) as e:
            ServerEngine(parse_spec(f"server[url={url},kind=vllm]")).info()
    finally:
        listener.close()
    assert one_line(e).startswith(f"{url}/v1/models is not an HTTP server")


def test_difftest_probe_names_the_endpoint_that_answered_what_is_not_json(tmp_path, monkeypatch):
    from difftest_engines.server.command import ensure_server_engine

    for variable in ("DIFFTEST_ENGINES", "DIFFTEST_CHECKS", "DIFFTEST_COMMANDS"):  # restored after the test
        monkeypatch.setenv(variable, os.environ.get(variable, ""))
    ensure_server_engine()  # its variables reach the probe's process
    url, listener = _raw_server(OK_NOT_JSON)
    try:
        run = _difftest(ROOT, "probe", "--server", url, "--case", "cases/tiny_llama.yaml", "--out", str(tmp_path))
    finally:
        listener.close()
    assert run.returncode == 2, run.stderr
    line = _last_line(run.stderr)
    assert (
        line.startswith("difftest probe: ") and f"{url}/server_info answered 200 with a body that is not JSON" in line
    )
    assert "Traceback" not in run.stderr


# -- 6. Ctrl-C while difftest imports, or while train-acc scores -------------------------------
# Runs the `difftest` console script with Python's own Ctrl-C handler (the suite may run with SIGINT
# ignored, which a child inherits) and an import hook that says when the named module starts
# importing and then waits there: the signal lands inside that import, every time.
_HOLD_AT_IMPORT = """
import os, runpy, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
held = sys.argv[1]

class Hold:
    def find_spec(self, name, path=None, target=None):
        if name == held:
            print("importing " + name, flush=True)
            time.sleep(600)
        return None

sys.meta_path.insert(0, Hold())
sys.argv = ["difftest", *sys.argv[2:]]
runpy.run_path(os.path.join(os.path.dirname(sys.executable), "difftest"), run_name="__main__")
"""


def _launch(launcher: str, args: list[str], cwd: Path) -> subprocess.Popen:
    """`python -c LAUNCHER ARGS...` with the project importable and its pipes read as text."""
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, "-c", launcher, *args],
        cwd=cwd,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("module", ["torch", "difftest_engines.trainingdata.train_accuracy"])
def test_ctrl_c_while_train_acc_imports_is_exit_130_in_one_line(module, tmp_path):
    args = ["--data", str(tmp_path), "--draft", "d", "--target", "t", "--out", str(tmp_path / "out")]
    proc = _launch(_HOLD_AT_IMPORT, [module, "train-acc", *args], tmp_path)
    try:
        assert proc.stdout.readline() == f"importing {module}\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == exit_codes.INTERRUPTED, err
    assert err == "difftest: interrupted\n"


# The same console script, held inside train-acc's scoring loop: the first sample is really scored,
# then the launcher says so and waits there, so the signal lands mid-scoring every time (a dump big
# enough to be still scoring when the signal comes would be a race).
_HOLD_IN_SCORING = """
import os, runpy, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import difftest_engines.trainingdata.engine as engine

scored = engine.sample_accuracy

def held(*args, **kwargs):
    counts = scored(*args, **kwargs)
    print("scoring", flush=True)
    time.sleep(600)
    return counts

engine.sample_accuracy = held
sys.argv = ["difftest", *sys.argv[1:]]
runpy.run_path(os.path.join(os.path.dirname(sys.executable), "difftest"), run_name="__main__")
"""


def test_ctrl_c_while_train_acc_scores_is_exit_130_in_one_line_and_writes_no_table(models, tmp_path):
    from difftest_engines.trainingdata.dump import dump_from_target, random_prompts

    data = dump_from_target(
        models[0], tmp_path / "data", "speculators", "h1+h2+h3+h6", random_prompts(512, 3, 8, seed=0)
    )
    out = tmp_path / "acc.json"
    args = ["--data", str(data), "--draft", str(models[1]), "--target", str(models[0]), "--out", str(out)]
    proc = _launch(_HOLD_IN_SCORING, ["train-acc", *args], tmp_path)
    try:
        printed = []
        while not printed or printed[-1] not in ("scoring\n", ""):  # "": it ended before scoring
            printed.append(proc.stdout.readline())
        assert printed[-1] == "scoring\n", "".join(printed) + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == exit_codes.INTERRUPTED, err
    # before it, stderr holds only transformers' weight-loading progress bars
    assert err.splitlines()[-1] == "difftest: interrupted" and err.count("interrupted") == 1, err
    assert "Traceback" not in err + rest, err
    assert "predicted AL" not in rest  # no table of what was scored so far
    assert not out.exists() and list(tmp_path.glob("acc.json*")) == []  # no --out file, whole or partial


# -- 7. no .benchmarks folder -----------------------------------------------------------------
def test_difftest_run_leaves_no_benchmarks_folder_in_the_working_directory(tmp_path):
    (tmp_path / "cases").mkdir()
    run = _difftest(tmp_path, "run", "cases/", "-q", f"--rootdir={tmp_path}")
    assert run.returncode == exit_codes.NO_CASES, run.stdout + run.stderr
    assert not (tmp_path / ".benchmarks").exists()


# -- 8. empty values to the other commands, and `difftest versions` on JSON nested too deeply -------
@pytest.mark.parametrize(
    "argv, option",
    [
        (["init", "--target", "t", "--draft", "d", "--engines", ""], "--engines"),
        (["init", "--target", "t", "--draft", "d", "--server", " "], "--server"),
        (["probe", "--server", "", "--case", "c.yaml"], "argument --server"),
        (["probe", "--server", "http://127.0.0.1:1", "--case", "c.yaml", "--model", ""], "argument --model"),
        (["train-acc", "--data", "x", "--draft", "d", "--target", "t", "--wiring", ""], "argument --wiring"),
    ],
    ids=["init-engines", "init-server", "probe-server", "probe-model", "train-acc-wiring"],
)
def test_an_empty_option_value_is_a_usage_error_from_every_command(argv, option, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("t", "d"):  # init reads the configs only
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    out = tmp_path / "case.yaml"
    try:
        code = cli.main([*argv, *(["--out", str(out)] if argv[0] == "init" else [])])
    except SystemExit as e:  # the parser's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == exit_codes.USAGE, err
    assert err.count("\n") == 1 and f"{option}: " in err and ("empty value" in err or "got ''" in err), err
    assert not out.exists()


def test_versions_over_a_report_nested_too_deeply_is_named_in_one_line(tmp_path, capsys):
    path = tmp_path / "deep.json"
    path.write_text('{"case": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert cli.main(["versions", str(tmp_path)]) == exit_codes.TROUBLE
    err = capsys.readouterr().err
    assert err == f"difftest versions: {path}: not a difftest report (JSON nested too deeply to read)\n"
