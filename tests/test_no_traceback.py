"""No traceback reaches a user (issue 26): an unreadable checkpoint, an output path that cannot be
written, an engine interpreter that exits at once, an adapter that answers with the wrong type, an
unreachable server and a prompt file that does not exist each give one line naming the file,
option, interpreter or URL at fault, and why.

Cheap: checkpoints are the tiny random pair of make_tiny_pair; the plugin runs capture one
two-prompt case; the CLI commands stop at their checks, before any model is loaded."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest
import torch

from difftest.cli import main
from difftest.base.errors import ConfigError
from helpers import TINY_CASE, one_line, run_pytest


def damaged_copy(src: Path, out: Path, damage: str) -> Path:
    """A copy of checkpoint `src` whose model.safetensors is cut in half, empty, or not one at all."""
    shutil.copytree(src, out)
    f = out / "model.safetensors"
    blob = f.read_bytes()
    f.write_bytes({"truncated": blob[: len(blob) // 2], "empty": b"", "garbage": os.urandom(4096)}[damage])
    return out


def write_project(root: Path, target: Path, draft: Path) -> Path:
    (root / "cases").mkdir(parents=True)
    (root / "cases" / "c.yaml").write_text(TINY_CASE.format(target=target, draft=draft))
    return root


# -- 1. an unreadable checkpoint: the lint item fails as the capture item does --------------------
@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_an_unreadable_draft_safetensors_gives_the_lint_the_loaders_one_line(models, tmp_path, damage):
    from difftest.checks.lint import lint_draft
    from difftest_engines.ref.eagle3 import load_state_dict

    target, draft = models
    bad = damaged_copy(draft, tmp_path / "draft", damage)
    with pytest.raises(ConfigError) as linted:
        lint_draft(bad, target)
    with pytest.raises(ConfigError) as loaded:
        load_state_dict(bad)
    assert one_line(linted) == one_line(loaded)
    assert one_line(linted).startswith(f"{bad / 'model.safetensors'}: ")


@pytest.mark.parametrize("which", ["draft", "target"])
def test_a_config_json_that_is_not_an_object_gives_the_lint_the_loaders_one_line(models, tmp_path, which):
    from difftest.checks.lint import lint_draft
    from difftest_engines.ref.draft_loading import load_draft
    from difftest_engines.ref.target import target_config

    target, draft = models
    dirs = {"target": target, "draft": draft}
    dirs[which] = Path(shutil.copytree(dirs[which], tmp_path / which))
    (dirs[which] / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError) as linted:
        lint_draft(dirs["draft"], dirs["target"])
    with pytest.raises(ConfigError) as loaded:
        load_draft(dirs["draft"]) if which == "draft" else target_config(dirs["target"])
    assert one_line(linted) == one_line(loaded) == f"{dirs[which] / 'config.json'}: expected a JSON object, got list"


def test_the_lint_and_capture_items_fail_an_unreadable_draft_with_the_same_line(models, tmp_path):
    target, draft = models
    bad = damaged_copy(draft, tmp_path / "draft", "truncated")
    run = run_pytest(write_project(tmp_path / "p", target, bad), "cases/", "--engines=ref")
    assert run.returncode == 6, run.output  # a damaged checkpoint is a configuration error, not a regression
    assert "Traceback" not in run.output and "internal error" not in run.output, run.output
    capture, lint = (run.outcome("c", "ref", check).message for check in ("capture", "lint"))
    assert capture == lint and lint.startswith(f"{bad / 'model.safetensors'}: ")


# -- 2. the reference's target loader names the file at fault -------------------------------------
def test_a_truncated_target_safetensors_is_one_line_naming_the_file(models, tmp_path):
    from difftest_engines.ref.target import load_target

    bad = damaged_copy(models[0], tmp_path / "target", "truncated")
    with pytest.raises(ConfigError) as e:
        load_target(bad)
    assert one_line(e).startswith(f"{bad / 'model.safetensors'}: ")


def test_a_loader_failure_on_an_unreadable_file_is_translated_to_the_lints_line_for_that_file(models, tmp_path):
    from safetensors.torch import load_file

    from difftest.checks.lint import tensor_meta
    from difftest.rules.weight_files import explain_load_failure

    bad = damaged_copy(models[0], tmp_path / "target", "truncated")
    with pytest.raises(Exception) as raw:  # what transformers lets through: safetensors' own words, no path
        load_file(str(bad / "model.safetensors"))
    with pytest.raises(ConfigError) as linted:
        tensor_meta(bad)
    message = str(explain_load_failure(bad, raw.value, "transformers cannot load this target"))
    assert message == one_line(linted) and message.startswith(f"{bad / 'model.safetensors'}: ")


class _RunsCode:
    """Unpickling this calls os.mkdir(path): what a malicious checkpoint would do, made visible."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def test_a_target_pickle_holding_code_is_refused_naming_the_file_and_never_run(models, tmp_path):
    from safetensors.torch import load_file

    from difftest_engines.ref.target import load_target

    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(models[0] / "config.json", target / "config.json")
    ran = tmp_path / "the-pickle-ran"
    torch.save(
        {**load_file(str(models[0] / "model.safetensors")), "extra": _RunsCode(ran)}, target / "pytorch_model.bin"
    )
    with pytest.raises(ConfigError) as e:
        load_target(target)
    message = one_line(e)
    assert message.startswith(f"{target / 'pytorch_model.bin'}: refused: not a plain-tensor checkpoint")
    assert "weights_only=False" not in message and not ran.exists()


# -- 3. output paths: checked before any work, written atomically ----------------------------------
REPORT = {
    "schema": "difftest.report",
    "schema_version": 4,  # the current one: an older one is read with a note on stderr (test_html_report)
    "case": "c",
    "case_file": "c.yaml",
    "created": "now",
    "reference": "ref",
    "accept_length_definition": "d",
    "engines": {},
    "checks": [],
}


@pytest.fixture
def report_json(tmp_path) -> Path:
    path = tmp_path / "reports" / "c.json"
    path.parent.mkdir()
    path.write_text(json.dumps(REPORT))
    return path


def test_report_out_dir_onto_an_existing_file_is_refused_in_one_line(report_json, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert main(["report", str(report_json), "--out", str(tmp_path / "afile")]) == 2
    assert capsys.readouterr().err == f"difftest report: --out: {tmp_path / 'afile'} is not a directory\n"


def test_bundle_onto_an_existing_directory_is_refused_and_leaves_nothing_behind(report_json, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert main(["bundle", str(report_json), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"difftest bundle: --out: {tmp_path / 'out'} is a directory; give a file path\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["c.json", "out", "reports"]


def test_bundle_to_a_path_under_a_file_is_refused_in_one_line(report_json, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "c.tar.gz"
    assert main(["bundle", str(report_json), "--out", str(out)]) == 2
    assert (
        capsys.readouterr().err
        == f"difftest bundle: --out: {tmp_path / 'afile'} is not a directory (needed for {out})\n"
    )


def test_a_bundle_write_that_fails_midway_leaves_no_temporary_archive(report_json, tmp_path, capsys, monkeypatch):
    import errno
    import tarfile

    def full_disk(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tarfile.TarFile, "addfile", full_disk)
    assert main(["bundle", str(report_json), "--out", str(tmp_path / "c.tar.gz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["c.json", "reports"]


def test_train_acc_json_under_a_file_is_refused_before_anything_is_computed(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "acc.json"
    # --data does not exist: a check after the computation would fail on that instead
    assert (
        main(["train-acc", "--data", str(tmp_path / "nodata"), "--draft", "d", "--target", "t", "--out", str(out)]) == 2
    )
    assert (
        capsys.readouterr().err
        == f"difftest train-acc: --out: {tmp_path / 'afile'} is not a directory (needed for {out})\n"
    )


def test_dump_out_onto_a_file_is_refused_before_the_target_runs(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert (
        main(
            [
                "dump",
                "--target",
                str(tmp_path / "t"),
                "--out",
                str(tmp_path / "afile"),
                "--format",
                "speculators",
                "--layers",
                "h0+h2",
                "--random",
                "1",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err == f"difftest dump: --out: {tmp_path / 'afile'} is not a directory\n"


def test_probe_report_dir_onto_a_file_is_refused_before_the_server_is_asked(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    # neither the case nor the server exists: the report directory is checked first
    assert (
        main(
            [
                "probe",
                "--server",
                "http://127.0.0.1:1",
                "--case",
                str(tmp_path / "none.yaml"),
                "--out",
                str(tmp_path / "afile"),
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.splitlines()[-1] == f"difftest probe: --out: {tmp_path / 'afile'} is not a directory"


def test_an_output_file_check_creates_nothing(tmp_path):
    from difftest.base.outputs import check_output_file

    assert check_output_file(tmp_path / "new" / "deeper" / "x.json", "--json") == tmp_path / "new" / "deeper" / "x.json"
    assert list(tmp_path.iterdir()) == []


# -- 4. engine workers: the interpreter and the adapter named -------------------------------------
def test_an_engine_interpreter_that_exits_at_once_is_named_with_its_exit_code(models, tmp_path):
    root = write_project(tmp_path, *models)
    run = run_pytest(root, "cases/", "--engines=ref", "--engine-python=ref=/bin/false", "-k", "capture")
    message = run.outcome("c", "ref", "capture").message
    assert message.startswith("ref: the engine interpreter /bin/false exited (code 1) before answering; log: "), message
    assert "earlier failure" not in message and "Traceback" not in run.output


def test_an_adapter_whose_capture_returns_the_wrong_type_is_one_line_naming_it(models, tmp_path):
    root = write_project(tmp_path, *models)
    run = run_pytest(root, "cases/", "--engines=ref,fake[mode=wrong_type]", "-k", "wrong_type and fc_inputs")
    message = run.outcome("c", "fake[mode=wrong_type]", "fc_inputs").message
    assert "adapter fake_engine.FakeEngine.capture() returned dict instead of a Capture" in message, message
    assert "\n" not in message and "AttributeError" not in run.output


# -- 5. a server that cannot be reached, a prompt file that does not exist --------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answering(status: int):
    """An HTTP server on localhost answering every GET with `status` and an empty body."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_refused_connection_says_the_server_cannot_be_reached(monkeypatch):
    from difftest_engines.server.client import ServerClient, ServerError

    monkeypatch.delenv("http_proxy", raising=False)
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ServerError) as e:
        ServerClient(url, timeout=10)
    assert one_line(e) == f"{url}: cannot reach the server (connection refused: nothing listens at that host and port)"


def test_a_host_name_that_does_not_resolve_says_so(monkeypatch):
    from difftest_engines.server.client import ServerClient, ServerError

    monkeypatch.delenv("http_proxy", raising=False)
    with pytest.raises(ServerError) as e:  # .invalid never resolves (RFC 6761)
        ServerClient("http://no-such-host.invalid:30000", timeout=10)
    assert (
        one_line(e)
        == "http://no-such-host.invalid:30000: cannot reach the server (host name 'no-such-host.invalid' not resolved)"
    )


def test_a_gateway_error_for_the_host_says_it_cannot_be_reached(monkeypatch):
    from difftest_engines.server.client import ServerClient, ServerError

    monkeypatch.delenv("http_proxy", raising=False)
    server = _answering(502)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ServerError) as e:
            ServerClient(url, timeout=10)
    finally:
        server.shutdown()
    assert one_line(e).startswith(f"{url}: cannot reach the server (a proxy or gateway answered HTTP 502")


def test_an_http_answer_that_is_neither_kind_names_what_answered(monkeypatch):
    from difftest_engines.server.client import ServerClient, ServerError

    monkeypatch.delenv("http_proxy", raising=False)
    server = _answering(404)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ServerError) as e:
            ServerClient(url, timeout=10)
    finally:
        server.shutdown()
    message = one_line(e)
    assert message.startswith(
        f"{url}: no SGLang or vLLM server reachable there: /get_model_info answered HTTP 404, /metrics HTTP 404"
    )


@pytest.mark.parametrize("value", ["prompts.txt", "data/prompts.jsonl", "cases/missing.yaml", "prompts.json"])
def test_infer_wiring_prompts_naming_a_missing_file_is_refused_naming_it(models, tmp_path, monkeypatch, capsys, value):
    monkeypatch.chdir(tmp_path)
    target, draft = models
    assert main(["infer-wiring", "--target", str(target), "--draft", str(draft), "--prompts", value]) == 2
    assert capsys.readouterr().err.startswith(
        f"difftest infer-wiring: --prompts: {value}: no such file (a path, not prompt text"
    )


def test_infer_wiring_prompts_naming_a_file_that_is_not_a_case_is_refused(models, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("hello\n")
    target, draft = models
    assert main(["infer-wiring", "--target", str(target), "--draft", str(draft), "--prompts", "prompts.txt"]) == 2
    assert capsys.readouterr().err.startswith("difftest infer-wiring: --prompts: prompts.txt: not a case YAML file")


def test_infer_wiring_prompt_text_with_a_slash_and_spaces_is_still_text(models, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    target, draft = models
    # the tiny target has no tokenizer: the text reaching the tokenizer is what this shows
    assert main(["infer-wiring", "--target", str(target), "--draft", str(draft), "--prompts", "what is 1/2?"]) == 2
    assert "text needs the target's tokenizer" in capsys.readouterr().err
