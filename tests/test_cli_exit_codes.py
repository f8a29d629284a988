"""Every command other than `run` ends with a documented exit code (docs/running.md, "Exit codes";
difftest.base.exit_codes): a bad option or option value is USAGE (4), as for `run`; a command that
could not answer (its input unusable, its engine failed) is TROUBLE (2). Either way one line on
stderr says why, never a traceback."""

from __future__ import annotations

import sys

import pytest

from difftest.base import exit_codes
from difftest.cli import main


# the engine packages' commands with their required options, none of them existing: a usage error is
# refused before any of them is read
TRAIN_ACC = ["train-acc", "--data", "no-data", "--draft", "no-draft", "--target", "no-target"]
DUMP = ["dump", "--target", "no-target", "--out", "no-out", "--format", "speculators", "--layers", "h0+h2"]


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
        ([*TRAIN_ACC, "--ttt-steps", "0"], "argument --ttt-steps: expected 1 or more, got 0"),
        ([*TRAIN_ACC, "--train-data-ratio", "1.5"], "argument --train-data-ratio: expected 0 < R < 1"),
        ([*DUMP, "--random", "-1"], "argument --random: expected 0 or more, got -1"),
        ([*DUMP, "--continue", "x"], "argument --continue: expected a whole number, got 'x'"),
        (["infer-wiring", "--target", "t", "--draft", "d", "--random", "0"], "argument --random: expected 1 or more"),
    ],
    ids=[
        "rules-engine",
        "rules-engine-python",
        "env-create-engine",
        "probe-timeout",
        "train-acc-ttt-steps",
        "train-acc-ratio",
        "dump-random",
        "dump-continue",
        "infer-wiring-random",
    ],
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


def test_train_acc_malformed_layer_ids_is_a_usage_error(capsys):
    code, err = _ends([*TRAIN_ACC, "--layer-ids", "2,x"], capsys)
    assert code == exit_codes.USAGE
    assert "argument --layer-ids: expected whole numbers separated by commas" in _one_line(err)


def test_train_acc_unknown_trainer_is_a_usage_error_before_the_data_is_read(capsys):
    code, err = _ends([*TRAIN_ACC, "--trainer", "speculatorz@0.9"], capsys)
    assert code == exit_codes.USAGE
    assert _one_line(err).startswith("difftest train-acc: --trainer: unknown trainer 'speculatorz'")


def test_dump_unknown_layers_preset_is_a_usage_error_before_the_target_loads(capsys, tmp_path):
    target = tmp_path / "target"  # a config and no weights: refused before any load could fail
    target.mkdir()
    (target / "config.json").write_text('{"num_hidden_layers": 4, "vocab_size": 32}')
    argv = ["dump", "--target", str(target), "--out", str(tmp_path / "out"), "--format", "speculators"]
    code, err = _ends([*argv, "--layers", "bogus", "--random", "1"], capsys)
    assert code == exit_codes.USAGE
    assert _one_line(err).startswith("difftest dump: --layers: unknown wiring preset 'bogus'")
    assert not (tmp_path / "out").exists()


def test_infer_wiring_malformed_prompt_ids_is_a_usage_error(capsys):
    code, err = _ends(["infer-wiring", "--target", "no-target", "--draft", "no-draft", "--prompts", "ids:1,x"], capsys)
    assert code == exit_codes.USAGE
    assert _one_line(err) == "difftest infer-wiring: --prompts: 'ids:1,x' is not ids:1,2,3"


def test_preview_of_another_engines_release_is_a_usage_error(capsys):
    code, err = _ends(["preview", "sglang==0.5.24", "c.yaml"], capsys)
    assert code == exit_codes.USAGE
    assert "'sglang==0.5.24': expected vllm==VERSION" in _one_line(err)


def test_preview_with_a_missing_engine_python_is_a_usage_error(capsys, tmp_path):
    code, err = _ends(["preview", "vllm==0.34.0", "c.yaml", "--engine-python", str(tmp_path / "python")], capsys)
    assert code == exit_codes.USAGE
    assert _one_line(err) == f"difftest preview: --engine-python: {tmp_path / 'python'}: no such file"


def test_preview_of_a_missing_case_could_not_answer_before_any_download(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / "cache"))
    argv = ["preview", "vllm==0.34.0", str(tmp_path / "nope.yaml"), "--engine-python", sys.executable]
    code, err = _ends(argv, capsys)
    assert code == exit_codes.TROUBLE
    assert _one_line(err) == f"difftest preview: {tmp_path / 'nope.yaml'}: no such case file"
    assert not (tmp_path / "cache").exists()  # the release's wheel was not fetched
