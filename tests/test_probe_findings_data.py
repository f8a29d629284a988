"""Broken checkpoints, configs and training dumps the input probe found accepted (issue 45, item 8).

Each is refused in one line naming the file, the key or tensor and what was expected, or named by
the lint, instead of running silently: engine-free (the `ref` loaders, the lint, the training data;
one case run on the `ref` and `train` engines, which are the project's own CPU code).
Runs on the random tiny pair (tests/helpers.make_tiny_pair: 6 layers, H=64, draft ids [1, 2, 3]).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from difftest import cli
from difftest.base import exit_codes
from difftest.base.errors import ConfigError
from difftest.checks.lint import lint_draft
from difftest_engines.ref.draft_loading import load_draft
from difftest_engines.ref.target import load_target
from difftest_engines.trainingdata.dump import dump_from_target, random_prompts
from difftest_engines.trainingdata.formats import read_dump
from helpers import edited_copy, edited_draft, run_pytest

TINY_PAIR_LAYERS = 6
TRAINED = ["target.h.1", "target.h.2", "target.h.3"]  # the tiny draft's ids [1, 2, 3], read as vLLM does
PROMPTS = random_prompts(512, 4, 10, seed=0)


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# -- 1. a draft tensor the reference never applies ------------------------------------------------


def with_q_norm(t: dict) -> None:
    t["midlayer.self_attn.q_norm.weight"] = torch.full((16,), 2.0)


def test_lint_names_a_draft_tensor_the_reference_draft_does_not_use(models, tmp_path):
    draft = edited_draft(models, tmp_path, tensors=with_q_norm)
    [f] = [f for f in lint_draft(draft, models[0], TRAINED) if f.code == "draft-tensor-unused"]
    assert f.severity == "error"
    assert f.message.startswith(
        "draft tensor midlayer.self_attn.q_norm.weight is not used by the reference draft "
        "(engines that apply it compute another draft)"
    )


def test_ref_refuses_a_draft_tensor_it_does_not_use_instead_of_ignoring_it(models, tmp_path):
    draft = edited_draft(models, tmp_path, tensors=with_q_norm)
    with pytest.raises(ConfigError) as e:
        load_draft(draft)
    assert one_line(e) == (
        f"{draft}: draft tensor midlayer.self_attn.q_norm.weight is not used by the reference draft "
        "(engines that apply it compute another draft)"
    )


# -- 2. a number given as a string in the draft config ---------------------------------------------


def test_ref_refuses_a_draft_config_number_given_as_a_string(models, tmp_path):
    draft = edited_draft(models, tmp_path, config=lambda c: c.update(num_attention_heads="4"))
    with pytest.raises(ConfigError) as e:
        load_draft(draft)
    assert one_line(e) == f"{draft / 'config.json'}: num_attention_heads: expected an integer, got '4' (a string)"


def test_lint_refuses_a_draft_config_number_given_as_a_string(models, tmp_path):
    draft = edited_draft(models, tmp_path, config=lambda c: c.update(num_attention_heads="4"))
    with pytest.raises(ConfigError) as e:
        lint_draft(draft, models[0], TRAINED)
    assert one_line(e) == f"{draft / 'config.json'}: num_attention_heads: expected an integer, got '4' (a string)"


# -- 3. a tied target that stores its own, different head ------------------------------------------


def tied(cfg: dict) -> None:
    cfg["tie_word_embeddings"] = True


def test_lint_names_a_tied_target_whose_stored_head_differs_from_its_embedding(models, tmp_path):
    target = edited_copy(models[0], tmp_path / "target", config=tied)
    [f] = [f for f in lint_draft(models[1], target, TRAINED) if f.code == "target-tied-head"]
    assert f.severity == "error"
    assert "tie_word_embeddings is true, but lm_head.weight differs from model.embed_tokens.weight" in f.message


def test_ref_refuses_a_tied_target_whose_stored_head_differs_from_its_embedding(models, tmp_path):
    target = edited_copy(models[0], tmp_path / "target", config=tied)
    with pytest.raises(ConfigError) as e:
        load_target(target)
    assert "tie_word_embeddings is true, but lm_head.weight differs from model.embed_tokens.weight" in one_line(e)


def test_a_tied_target_whose_stored_head_equals_its_embedding_raises_nothing(models, tmp_path):
    def same_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    target = edited_copy(models[0], tmp_path / "target", config=tied, tensors=same_head)
    assert [f for f in lint_draft(models[1], target, TRAINED) if f.code == "target-tied-head"] == []


# -- 5. layer ids that are not integers ------------------------------------------------------------


def string_ids(cfg: dict) -> None:
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ["1", "2", "3"]


def test_lint_refuses_string_layer_ids_naming_the_key_and_value(models, tmp_path):
    draft = edited_draft(models, tmp_path, config=string_ids)
    with pytest.raises(ConfigError) as e:
        lint_draft(draft, models[0], TRAINED)
    assert one_line(e) == (
        f"{draft / 'config.json'}: eagle_aux_hidden_state_layer_ids: expected a list of integer "
        "layer ids, got ['1', '2', '3']"
    )


# -- 6. a target decoder tensor of the wrong shape ---------------------------------------------------


def test_ref_names_a_wrong_shaped_target_tensor_and_the_shape_expected(models, tmp_path):
    def short_q(t):
        t["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(32, 64)

    target = edited_copy(models[0], tmp_path / "target", tensors=short_q)
    with pytest.raises(ConfigError) as e:
        load_target(target)
    text = one_line(e)
    assert "model.layers.1.self_attn.q_proj.weight has shape [32, 64], expected [64, 64]" in text
    assert "above report" not in text


def test_lint_names_a_wrong_shaped_target_tensor_and_the_shape_expected(models, tmp_path):
    def short_q(t):
        t["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(32, 64)

    target = edited_copy(models[0], tmp_path / "target", tensors=short_q)
    [f] = [f for f in lint_draft(models[1], target, TRAINED) if f.code == "target-shape"]
    assert f.severity == "error"
    assert "model.layers.1.self_attn.q_proj.weight has shape [32, 64], expected [64, 64]" in f.message


# -- 4, 7. training dumps ------------------------------------------------------------------------------


def dump(models, tmp_path, fmt: str = "speculators", layers: str = "h1+h2+h3+h6", name: str = "data"):
    return dump_from_target(models[0], tmp_path / name, fmt, layers, PROMPTS, continue_tokens=4)


def train_acc(models, data, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(["train-acc", "--data", str(data), "--draft", str(models[1]), "--target", str(models[0])])
    out = capsys.readouterr()
    return rc, out.err


def test_a_dataset_row_without_loss_mask_is_skipped_naming_the_file_and_row(models, tmp_path):
    data = dump(models, tmp_path)
    rows = [json.loads(x) for x in (data / "samples.jsonl").read_text().splitlines()]
    del rows[1]["loss_mask"]
    (data / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    d = read_dump(data)
    assert [s.index for s in d.samples] == [0, 2, 3]
    assert d.skipped == [
        f"{data / 'samples.jsonl'}: line 2: loss_mask missing (every position would count as trained) (sample skipped)"
    ]


def test_an_arrow_dataset_row_with_a_null_loss_mask_is_skipped_naming_the_file_and_row(models, tmp_path):
    import pyarrow as pa

    data = dump(models, tmp_path)
    rows = [json.loads(x) for x in (data / "samples.jsonl").read_text().splitlines()]
    (data / "samples.jsonl").unlink()
    masks = [r["loss_mask"] for r in rows]
    masks[1] = None  # the column is there, this row's mask is not
    table = pa.table(
        {
            "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(pa.int64())),
            "loss_mask": pa.array(masks, pa.list_(pa.int64())),
        }
    )
    arrow = data / "data-00000-of-00001.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (data / "state.json").write_text(json.dumps({"_data_files": [{"filename": arrow.name}]}))
    (data / "dataset_info.json").write_text("{}")
    d = read_dump(data)
    assert [s.index for s in d.samples] == [0, 2, 3]
    assert d.skipped == [f"{arrow}: row 1: loss_mask missing (every position would count as trained) (sample skipped)"]


def test_train_acc_refuses_a_dump_with_fewer_fc_layers_than_the_draft_expects(models, tmp_path, capsys):
    data = dump(models, tmp_path, layers="h1+h2+h6")  # two fc tensors; the draft's fc takes three
    rc, err = train_acc(models, data, capsys)
    assert rc == 2
    [line] = err.strip().splitlines()[-1:]
    assert err.count("difftest train-acc") == 1, err
    assert line.startswith(f"difftest train-acc: {data / 'hidden_states' / 'hs_0.safetensors'}: ")
    assert "2 fc tensors of width 64 (128 wide), but the draft's fc takes 3 x 64 = 192" in line


def test_train_acc_refuses_token_ids_outside_the_vocabulary(models, tmp_path, capsys):
    data = dump(models, tmp_path, fmt="speculators-legacy")
    f = data / "data_2.pt"
    sample = torch.load(f, weights_only=True)
    sample["input_ids"][3] = 900
    torch.save(sample, f)
    rc, err = train_acc(models, data, capsys)
    assert rc == 2
    [line] = err.strip().splitlines()[-1:]
    assert err.count("difftest train-acc") == 1, err
    assert line == (
        f"difftest train-acc: {f}: input_ids: token id 900 at position 3 is outside the target vocabulary "
        "of 512 (the draft config's vocab_size)"
    )


def zero_loss_masks(data: Path) -> Path:
    """The legacy dump `data` with every sample's loss_mask set to zeros."""
    for f in sorted(data.glob("*.pt")):
        sample = torch.load(f, weights_only=True)
        sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
        torch.save(sample, f)
    return data


def test_train_acc_refuses_a_dump_whose_loss_masks_are_all_zero(models, tmp_path, capsys):
    data = zero_loss_masks(dump(models, tmp_path, fmt="speculators-legacy"))
    rc, err = train_acc(models, data, capsys)
    assert rc == 2
    [line] = err.strip().splitlines()[-1:]
    assert err.count("difftest train-acc") == 1, err
    assert line.startswith(
        f"difftest train-acc: {data}: every loss_mask of the {len(PROMPTS)} scored samples is all zero"
    )


def test_a_case_over_a_dump_whose_loss_masks_are_all_zero_is_a_configuration_error_naming_loss_mask(models, tmp_path):
    # in a case the nan accuracy failed train_accuracy blaming the verifier, the dump's target or the draft
    data = zero_loss_masks(dump(models, tmp_path, fmt="speculators-legacy"))
    (tmp_path / "cases").mkdir()
    case = {
        "target": str(models[0]),
        "draft": str(models[1]),
        "wiring": ["h1", "h2", "h3"],
        "prompts": [{"ids": p} for p in PROMPTS[:2]],
        "speculative": {"num_steps": 2, "max_new_tokens": 4},
        "engines": {"train": {"data": str(data)}},
    }
    (tmp_path / "cases" / "zero_masks.yaml").write_text(json.dumps(case))
    run = run_pytest(tmp_path, "cases/", "--engines=ref,train", "-k", "fc_inputs or train_accuracy")
    assert run.returncode == exit_codes.CONFIG, run.output[-3000:]
    for check in ("fc_inputs", "train_accuracy"):  # every item that reads the train engine's capture
        result = run.outcome("zero_masks", "train", check)
        assert result.outcome == "error", (check, result.message)
        assert "\n" not in result.message and result.message.startswith(
            f"{data}: every loss_mask of the {len(PROMPTS)} scored samples is all zero"
        ), result.message
    assert "Traceback" not in run.output and "likely causes" not in run.output and "predicted AL" not in run.output
    assert not re.search(r"\bnan\b", run.output), run.output[-3000:]


# -- 3 (the draft's side). a draft config that ties its head while storing one ----------------------


def test_lint_names_a_draft_that_ties_its_head_while_storing_its_own(models, tmp_path):
    draft = edited_draft(models, tmp_path, config=tied)
    [f] = [f for f in lint_draft(draft, models[0], TRAINED) if f.code == "draft-tied-head"]
    assert f.severity == "error"
    assert f.message.startswith(
        f"{draft / 'config.json'}: tie_word_embeddings is true, but the draft stores its own lm_head.weight"
    )


def test_ref_refuses_a_draft_that_ties_its_head_while_storing_its_own(models, tmp_path):
    draft = edited_draft(models, tmp_path, config=tied)
    with pytest.raises(ConfigError) as e:
        load_draft(draft)
    assert one_line(e).startswith(
        f"{draft / 'config.json'}: tie_word_embeddings is true, but the draft stores its own lm_head.weight"
    )


# -- 2 (flags). a flag given as a string: bool("false") is True -------------------------------------


def test_a_draft_flag_given_as_a_string_is_refused_by_ref_and_lint(models, tmp_path):
    draft = edited_draft(models, tmp_path, config=lambda c: c.update(norm_before_residual="false"))
    expected = f"{draft / 'config.json'}: norm_before_residual: expected true or false, got 'false' (a string)"
    with pytest.raises(ConfigError) as e:
        load_draft(draft)
    assert one_line(e) == expected
    with pytest.raises(ConfigError) as e:
        lint_draft(draft, models[0], TRAINED)
    assert one_line(e) == expected
