"""Checkpoint integrity: a checkpoint that does not hold what its config describes is an error
naming the file, the tensor and the config field, in lint and before the reference loads it; the
reference never runs a randomly initialised tensor (difftest.rules.checkpoint_integrity)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from difftest.rules.checkpoint_integrity import read_header, stored_tensors, target_findings
from difftest.base.errors import ConfigError
from difftest.checks.lint import lint_draft
from helpers import edited_copy


TINY_PAIR_LAYERS, TINY_PAIR_SEED = 5, 11  # the conftest `models` pair: 5 layers, seed 11


def errors(findings, code: str) -> list[str]:

    return [f.message for f in findings if f.code == code and f.severity == "error"]


def load_target(path: Path):
    from difftest_engines.ref.target import load_target as load

    return load(path)


def test_an_intact_target_has_no_finding_and_loads(models):
    target, _ = models
    assert target_findings(target) == []
    assert load_target(target) is not None


@pytest.mark.parametrize("name", ["indep-qwen3", "indep-deepseek-v3"])
def test_intact_targets_of_other_families_have_no_finding(name):
    from independent_models import ensure_model

    assert target_findings(ensure_model(name, log=lambda *_: None).target) == []


def test_a_target_without_its_untied_head_is_refused_naming_the_tensor_and_the_tie_flag(models, tmp_path):
    target, draft = models
    broken = edited_copy(target, tmp_path / "t", tensors=lambda t: t.pop("lm_head.weight"))
    [message] = errors(target_findings(broken), "target-weights")
    assert "lm_head.weight" in message and "tie_word_embeddings false" in message
    assert "vllm 0.32.0 refuses at load" in message and "sglang 0.5.23" in message  # what each engine does
    assert any("lm_head.weight" in m for m in errors(lint_draft(draft, broken), "target-weights"))
    with pytest.raises(ConfigError, match=r"lm_head\.weight"):
        load_target(broken)


def test_a_tied_target_without_a_head_is_intact(models, tmp_path):
    target, _ = models
    tied = edited_copy(
        target,
        tmp_path / "t",
        config=lambda c: c.update(tie_word_embeddings=True),
        tensors=lambda t: t.pop("lm_head.weight"),
    )
    assert errors(target_findings(tied), "target-weights") == []


def test_a_target_without_its_embedding_is_refused(models, tmp_path):
    target, _ = models
    broken = edited_copy(target, tmp_path / "t", tensors=lambda t: t.pop("model.embed_tokens.weight"))
    [message] = errors(target_findings(broken), "target-weights")
    assert "model.embed_tokens.weight" in message
    with pytest.raises(ConfigError, match=r"embed_tokens"):
        load_target(broken)


def test_a_config_with_fewer_layers_than_the_weights_names_num_hidden_layers(models, tmp_path):
    target, _ = models
    short = edited_copy(target, tmp_path / "t", config=lambda c: c.update(num_hidden_layers=3))
    [message] = errors(target_findings(short), "target-weights")
    assert "num_hidden_layers is 3" in message and "layers up to 4" in message
    with pytest.raises(ConfigError, match="num_hidden_layers is 3"):
        load_target(short)


def test_a_config_with_more_layers_than_the_weights_names_the_missing_layer(models, tmp_path):
    target, _ = models
    deep = edited_copy(target, tmp_path / "t", config=lambda c: c.update(num_hidden_layers=6))
    [message] = errors(target_findings(deep), "target-weights")
    assert "model.layers.5.*" in message


def test_a_vocab_size_that_disagrees_with_the_weights_names_the_field(models, tmp_path):
    target, _ = models
    wrong = edited_copy(target, tmp_path / "t", config=lambda c: c.update(vocab_size=600))
    messages = errors(target_findings(wrong), "target-weights")
    assert any("model.embed_tokens.weight has shape [512, 64]" in m and "vocab_size 600" in m for m in messages)
    with pytest.raises(ConfigError, match="vocab_size 600"):
        load_target(wrong)


def test_one_missing_attention_tensor_in_a_deepseek_layer_is_named(tmp_path):
    from independent_models import ensure_model

    target = ensure_model("indep-deepseek-v3", log=lambda *_: None).target
    name = next(k for k in read_header(next(target.glob("*.safetensors"))) if k.startswith("model.layers.1.self_attn."))
    broken = edited_copy(target, tmp_path / "t", tensors=lambda t: t.pop(name))
    [message] = errors(target_findings(broken), "target-weights")
    assert name in message


def split_into_shards(src: Path, out: Path) -> Path:
    """`src` saved as two shards with a model.safetensors.index.json, as save_pretrained shards."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    f = next(out.glob("*.safetensors"))
    state = load_file(str(f))
    f.unlink()
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_a_sharded_checkpoint_with_its_index_is_intact(models, tmp_path):
    target, _ = models
    assert target_findings(split_into_shards(target, tmp_path / "t")) == []


def test_an_index_naming_a_shard_that_does_not_exist_is_an_error_for_a_draft_too(models, tmp_path):
    target, draft = models
    sharded = split_into_shards(draft, tmp_path / "d")
    (sharded / "model-00002-of-00002.safetensors").unlink()
    [message] = errors(stored_tensors(sharded)[1], "checkpoint-index")
    assert "model-00002-of-00002.safetensors" in message and "does not exist" in message
    assert any("does not exist" in m for m in errors(lint_draft(sharded, target), "checkpoint-index"))


def test_an_index_that_puts_a_tensor_in_the_wrong_shard_is_an_error(models, tmp_path):
    target, _ = models
    sharded = split_into_shards(target, tmp_path / "t")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = "model-00002-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    [message] = errors(stored_tensors(sharded)[1], "checkpoint-index")
    assert first in message


def test_a_truncated_safetensors_file_is_named_with_its_sizes(models, tmp_path):
    target, _ = models
    cut = edited_copy(target, tmp_path / "t")
    f = next(cut.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ConfigError, match=rf"{f.name}: truncated: its header describes \d+ bytes, the file holds \d+"):
        target_findings(cut)


@pytest.mark.parametrize("content", [b"", b"\x01\x02", b"garbage that is not a safetensors header at all"])
def test_a_file_that_is_not_safetensors_is_named(tmp_path, content):
    f = tmp_path / "model.safetensors"
    f.write_bytes(content)
    with pytest.raises(ConfigError, match=r"model\.safetensors: (truncated or )?not a safetensors file"):
        read_header(f)


def test_stored_dtype_other_than_the_configs_is_a_warning_not_an_error(models, tmp_path):
    target, _ = models
    cast = edited_copy(target, tmp_path / "t", config=lambda c: c.update(torch_dtype="bfloat16", dtype="bfloat16"))
    findings = target_findings(cast)
    assert [f.severity for f in findings if f.code == "checkpoint-dtype"] == ["warning"]
    assert errors(findings, "target-weights") == []


def test_the_reference_refuses_a_draft_whose_index_names_a_missing_shard(models, tmp_path):
    from difftest_engines.ref.eagle3 import load_state_dict

    _, draft = models
    sharded = split_into_shards(draft, tmp_path / "d")
    assert set(load_state_dict(sharded))  # intact: both shards read
    (sharded / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"model-00001-of-00002\.safetensors, which does not exist"):
        load_state_dict(sharded)
