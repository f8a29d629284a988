"""Every command other than `run` ends with a documented exit code (docs/running.md, "Exit codes";
difftest.base.exit_codes): a bad option or option value is USAGE (4), as for `run`; a command that
could not answer (its input unusable, its engine failed) is TROUBLE (2). Either way one line on
stderr says why, never a traceback."""

from __future__ import annotations

import pytest

from difftest.base import exit_codes
from difftest.cli import main


def _ends(argv: list[str], capsys) -> tuple[int, str]:
    """The exit code and stderr of `difftest ARGV` (argparse's refusals raise SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_the_exit_code_table_documents_two_as_a_command_that_could_not_answer():
    assert exit_codes.TROUBLE == 2
    assert "2 not from run: another command" in exit_codes.help_text()
    codes = [e.code for e in exit_codes.TABLE]
    assert len(codes) == len(set(codes))


@pytest.mark.parametrize(
    "argv",
    [
        ["report", "r.json", "--bogus"],
        ["bundle", "r.json", "--bogus"],
        ["fix", "c.yaml", "--bogus"],
        ["rules", "discover", "vllm", "--bogus"],
        ["versions", "reports", "--bogus"],
        ["env", "create", "sglang", "--bogus"],
        ["probe", "--server", "http://127.0.0.1:1", "--case", "c.yaml", "--bogus"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_an_unknown_option_is_a_usage_error_in_one_line(argv, capsys):
    code, err = _ends(argv, capsys)
    assert code == exit_codes.USAGE
    assert "--bogus" in _one_line(err)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["rules", "discover", "vlm"], "unknown engine; did you mean 'vllm'?"),
        (["rules", "discover", "vllm", "--engine-python", "vllm"], "--engine-python: 'vllm' is not NAME=PATH"),
        (["env", "create", "tensorrt", "--dry-run"], "unknown engine 'tensorrt'"),
        (["probe", "--server", "http://127.0.0.1:1", "--case", "c.yaml", "--timeout", "0"], "must be > 0 seconds"),
    ],
    ids=["rules-engine", "rules-engine-python", "env-create-engine", "probe-timeout"],
)
def test_a_bad_option_value_is_a_usage_error_in_one_line(argv, says, capsys, tmp_path):
    code, err = _ends([*argv, *(["--out", str(tmp_path)] if argv[0] == "rules" else [])], capsys)
    assert code == exit_codes.USAGE
    assert says in _one_line(err)


@pytest.mark.parametrize("command", ["report", "bundle"])
def test_a_missing_report_is_a_command_that_could_not_answer(command, capsys, tmp_path):
    code, err = _ends([command, str(tmp_path / "missing.json")], capsys)
    assert code == exit_codes.TROUBLE
    assert _one_line(err).startswith(f"difftest {command}: ") and "missing.json" in err


def test_versions_over_no_report_could_not_answer(capsys, tmp_path):
    code, err = _ends(["versions", str(tmp_path)], capsys)
    assert code == exit_codes.TROUBLE
    _one_line(err)


def test_fix_of_a_missing_case_could_not_answer(capsys, tmp_path):
    code, err = _ends(["fix", str(tmp_path / "nope.yaml"), "--engines", "vllm", "--out", str(tmp_path)], capsys)
    assert code == exit_codes.TROUBLE
    assert "nope.yaml" in _one_line(err)


def test_probe_of_a_missing_case_could_not_answer(capsys, tmp_path):
    argv = ["probe", "--server", "http://127.0.0.1:1", "--case", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)]
    code, err = _ends(argv, capsys)
    assert code == exit_codes.TROUBLE
    assert _one_line(err).startswith("difftest probe: ") and "nope.yaml" in err
