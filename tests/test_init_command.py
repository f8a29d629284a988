"""`difftest init`: a starter case for a target and its draft that loads and runs
(difftest.init_command)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from difftest.base import exit_codes
from difftest.base.dtypes import DType
from difftest.case.case import load_case
from difftest.cli import main
from difftest.rules.wiring import DEFAULT_PRESET
from helpers import run_pytest


@pytest.fixture
def checkpoints(tmp_path) -> tuple[Path, Path]:
    """A bfloat16 target with a chat template and a draft declaring ids, as far as init and case
    validation read them (their JSON files)."""
    target, draft = tmp_path / "models" / "target", tmp_path / "models" / "draft"
    target.mkdir(parents=True), draft.mkdir(parents=True)
    (target / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "torch_dtype": "bfloat16"})
    )
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (draft / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]},
            }
        )
    )
    return target, draft


def init(tmp_path: Path, checkpoints, *extra: str) -> int:
    target, draft = checkpoints
    return main(["init", "--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "c.yaml"), *extra])


def test_written_case_loads_with_the_targets_dtype_and_a_chat_prompt_set(tmp_path, checkpoints):
    assert init(tmp_path, checkpoints) == 0
    case = load_case(tmp_path / "c.yaml")
    assert case.dtype == DType.BFLOAT16 and case.wiring == DEFAULT_PRESET
    assert len(case.prompts) == 16 and all(p.messages for p in case.prompts)


def test_target_without_a_chat_template_gets_the_sets_plain_text(tmp_path, checkpoints):
    (checkpoints[0] / "tokenizer_config.json").unlink()
    assert init(tmp_path, checkpoints) == 0
    assert all(p.text for p in load_case(tmp_path / "c.yaml").prompts)


def test_checkpoints_are_written_relative_to_the_case(tmp_path, checkpoints):
    init(tmp_path, checkpoints)
    text = (tmp_path / "c.yaml").read_text()
    assert 'target: "models/target"' in text and 'draft: "models/draft"' in text


def test_comments_name_the_drafts_declared_ids_and_the_run_command(tmp_path, checkpoints):
    init(tmp_path, checkpoints, "--engines", "ref")
    text = (tmp_path / "c.yaml").read_text().replace("\n#   ", " ")  # the notes unwrapped
    assert "declares layer ids [1, 3, 6] (eagle_config.eagle_aux_hidden_state_layer_ids)" in text
    assert "# Run: difftest run c.yaml --engines=ref\n" in text


def test_existing_case_is_kept_without_force(tmp_path, checkpoints, capsys):
    (tmp_path / "c.yaml").write_text("mine\n")
    assert init(tmp_path, checkpoints) == exit_codes.USAGE
    assert (tmp_path / "c.yaml").read_text() == "mine\n"
    assert "already exists (--force replaces it)" in capsys.readouterr().err


def test_force_replaces_an_existing_case(tmp_path, checkpoints):
    (tmp_path / "c.yaml").write_text("mine\n")
    assert init(tmp_path, checkpoints, "--force") == 0
    assert load_case(tmp_path / "c.yaml").wiring == DEFAULT_PRESET


def test_server_and_training_data_become_the_engines_that_read_them(tmp_path, checkpoints):
    data = tmp_path / "dump"
    data.mkdir()
    init(tmp_path, checkpoints, "--server", "http://127.0.0.1:30000", "--train-data", str(data))
    case = load_case(tmp_path / "c.yaml")
    assert case.engines["server"] == {"url": "http://127.0.0.1:30000"}
    assert case.engines["train"] == {"data": str(data.resolve())}


def test_missing_checkpoint_is_refused_in_one_line_and_nothing_is_written(tmp_path, checkpoints, capsys):
    assert (
        main(
            [
                "init",
                "--target",
                str(tmp_path / "nope"),
                "--draft",
                str(checkpoints[1]),
                "--out",
                str(tmp_path / "c.yaml"),
            ]
        )
        == exit_codes.CONFIG
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--target" in err and "no config.json" in err
    assert not list(tmp_path.glob("*.yaml")) and not list(tmp_path.glob(".*partial"))


def test_misspelt_engine_is_refused_with_the_closest_name(tmp_path, checkpoints, capsys):
    assert init(tmp_path, checkpoints, "--engines", "ref,sglnag") == exit_codes.USAGE
    assert "unknown engine 'sglnag'; did you mean 'sglang'?" in capsys.readouterr().err


def test_written_case_runs_on_the_reference_with_the_tiny_fixtures(tmp_path):
    out = tmp_path / "cases" / "starter.yaml"
    args = ["init", "--target", "fixture:tiny-llama", "--draft", "fixture:tiny-llama-eagle3", "--out", str(out)]
    assert main([*args, "--engines", "ref"]) == 0
    run = run_pytest(tmp_path, "cases/starter.yaml", "--engines=ref")
    assert run.returncode == 0, run.output[-2000:]
