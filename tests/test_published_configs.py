"""What difftest says of the EAGLE-3 drafts as trainers publish them (issue 42 item 2).

The published config.json files are kept verbatim in difftest_fixtures/published_configs/ (provenance
in sources.json); difftest_fixtures/published.py builds tiny drafts of the same shape. Engine-free:
the lint, the reference loader and the wiring presets (`ref[wiring=...]`'s readings). The engines run
the shipped cases cases/published_*.yaml.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from difftest.checks.lint import lint_draft
from difftest.rules.wiring import hidden_indices, resolve
from difftest_engines.ref.draft_loading import load_draft
from difftest_fixtures import published

PUBLISHED = published.PUBLISHED_DIR
SHAPES = [name for name in published.SOURCES]


@pytest.fixture(scope="module")
def built() -> dict[str, Path]:
    return published.ensure_fixtures(log=lambda *_: None)


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _target_dir(name: str) -> Path:
    """The tiny target a published shape pairs with (built by published.ensure_fixtures)."""
    from difftest_fixtures import cache

    return cache.fixtures_dir() / published.SOURCES[name].target


def _lint(built: dict[str, Path], name: str):
    return lint_draft(built[name], _target_dir(name), published.SOURCES[name].trained_on)


# -- the published files ---------------------------------------------------------------------------


def test_every_published_config_names_its_source_repository_path_and_commit():
    sources = json.loads((PUBLISHED / "sources.json").read_text())
    files = sorted(p.name for p in PUBLISHED.glob("*.json") if p.name != "sources.json")
    assert sorted(sources) == files
    for entry in sources.values():
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", entry["repo"]) and entry["path"].endswith(".json")
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"])


def test_every_published_shape_is_made_from_a_published_file():
    assert sorted(s.file for s in published.SOURCES.values()) == sorted(
        p.name for p in PUBLISHED.glob("*.json") if p.name != "sources.json"
    )


def test_specforge_deepseek_and_kimi_publish_their_ids_only_in_eagle_config():
    for file, ids in (
        ("specforge-deepseek-v3-671b-eagle3.json", [1, 29, 57]),
        ("specforge-kimi-k25-eagle3.json", [2, 30, 58]),
    ):
        cfg = json.loads((PUBLISHED / file).read_text())
        assert "eagle_aux_hidden_state_layer_ids" not in cfg
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids


# -- the tiny shapes keep the structure ------------------------------------------------------------


@pytest.mark.parametrize("name", SHAPES)
def test_a_published_shape_keeps_every_published_key(built, name):
    cfg = _config(built[name])
    assert set(published.SOURCES[name].published()) <= set(cfg)


@pytest.mark.parametrize("name", SHAPES)
def test_a_published_shape_keeps_where_its_layer_ids_live(built, name):
    pub, cfg = published.SOURCES[name].published(), _config(built[name])
    assert ("eagle_aux_hidden_state_layer_ids" in cfg) == ("eagle_aux_hidden_state_layer_ids" in pub)
    assert ("eagle_config" in cfg) == ("eagle_config" in pub)


@pytest.mark.parametrize("name", SHAPES)
def test_a_published_shape_has_a_vocabulary_map_exactly_when_it_publishes_a_draft_vocabulary(built, name):
    from safetensors import safe_open

    with safe_open(str(built[name] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    has_draft_vocab = "draft_vocab_size" in published.SOURCES[name].published()
    assert ("d2t" in keys) == has_draft_vocab and ("t2d" in keys) == has_draft_vocab


@pytest.mark.parametrize("name", SHAPES)
def test_a_published_shape_keeps_its_rope_settings_verbatim(built, name):
    pub, cfg = published.SOURCES[name].published(), _config(built[name])
    for key in ("rope_theta", "rope_scaling"):
        assert cfg.get(key, "absent") == pub.get(key, "absent")


@pytest.mark.parametrize("name", SHAPES)
def test_a_published_shape_keeps_multi_head_kv_when_published_with_as_many_kv_heads_as_heads(built, name):
    pub, cfg = published.SOURCES[name].published(), _config(built[name])
    mha = pub["num_key_value_heads"] == pub["num_attention_heads"]
    assert (cfg["num_key_value_heads"] == cfg["num_attention_heads"]) == mha


@pytest.mark.parametrize("name", SHAPES)
def test_a_published_shape_keeps_max_position_embeddings_as_the_same_fraction_of_its_targets(built, name):
    source = published.SOURCES[name]
    target = _config(_target_dir(name))
    expected = source.published()["max_position_embeddings"] * target["max_position_embeddings"]
    assert _config(built[name])["max_position_embeddings"] == expected // source.target_max_positions


def test_the_deepseek_family_ids_are_the_published_formulas_at_the_tiny_targets_depth(built):
    L = _config(built[published.TARGET_8L])["num_hidden_layers"]
    kimi = _config(built[published.SPECFORGE_KIMI])["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    deepseek = _config(built[published.SPECFORGE_DEEPSEEK])["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert kimi == [2, L // 2, L - 3]  # vLLM's defaults, as [2, 30, 58] is at L = 61
    assert deepseek == [1, L // 2 - 1, L - 4]  # SpecForge's defaults, as [1, 29, 57] is at L = 61


# -- loading ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHAPES)
def test_a_published_shape_loads_in_the_reference_without_refusal(built, name):
    loaded = load_draft(built[name])
    assert loaded.model is not None


def test_a_full_vocabulary_draft_without_d2t_maps_draft_ids_to_the_same_target_ids(built):
    cfg = _config(built[published.TORCHSPEC_KIMI])
    model = load_draft(built[published.TORCHSPEC_KIMI]).model
    assert "draft_vocab_size" not in cfg
    assert model.lm_head.weight.shape[0] == cfg["vocab_size"]


@pytest.mark.parametrize("name", SHAPES)
def test_a_published_shape_still_predicts_the_target_under_its_published_settings(built, name):
    # measured at build time (published._measured: the draft under its own rope, eps, heads, vocabulary)
    quality = json.loads((built[name] / "quality.json").read_text())
    assert quality["step0_agreement"] > 0.5 and quality["accept_length"] > 2.0


# -- what the lint says ----------------------------------------------------------------------------


def test_lint_lists_model_runner_v1_reading_specforge_deepseek_ids_one_layer_below_training(built):
    # vLLM 0.32.0 runs Model Runner V2 unless a spec names runner=v1: V1's reading is listed, not an error
    findings = [f for f in _lint(built, published.SPECFORGE_DEEPSEEK) if f.code == "layer-ids-training"]
    assert [f.severity for f in findings] == ["warning"]
    assert "Model Runner V1" in findings[0].message and "[h1, h3, h4]" in findings[0].message
    assert "a code path this run does not take" in findings[0].message


def test_lint_names_model_runner_v1_reading_as_an_error_when_the_run_takes_runner_v1(built):
    name = published.SPECFORGE_DEEPSEEK
    findings = lint_draft(
        built[name], _target_dir(name), published.SOURCES[name].trained_on, specs=[("vllm", {"runner": "v1"})]
    )
    [error] = [f for f in findings if f.code == "layer-ids-training" and f.severity == "error"]
    assert "Model Runner V1" in error.message and "[h1, h3, h4]" in error.message and "[h2, h4, h5]" in error.message


def test_lint_names_specforge_reading_the_kimi_ids_one_layer_above_what_engines_feed(built):
    [finding] = [f for f in _lint(built, published.SPECFORGE_KIMI) if f.code == "layer-ids-training"]
    assert "SpecForge" in finding.message and "[h3, h5, h6]" in finding.message


@pytest.mark.parametrize("name", [published.SPECFORGE_DEEPSEEK, published.SPECFORGE_KIMI])
def test_lint_names_model_runner_v2_ignoring_ids_only_in_eagle_config(built, name):
    # vLLM 0.32.0's default runner (layer_rules.spec_variant) never reads eagle_config's ids: its defaults
    # [h2, h4, h5] happen to be what these drafts were trained on, which the lint says with the fix
    messages = " ".join(f.message for f in _lint(built, name))
    assert "Model Runner V2" in messages and "ignores eagle_config.eagle_aux_hidden_state_layer_ids" in messages
    assert "only because its defaults are those layers" in messages


def test_lint_fixes_model_runner_v2_by_writing_the_ids_at_the_top_level(built):
    [warning] = [f for f in _lint(built, published.SPECFORGE_DEEPSEEK) if f.code == "layer-ids-training"]
    assert "fix: {'eagle_aux_hidden_state_layer_ids': [2, 4, 5]}" in warning.message


def test_lint_says_a_config_without_ids_falls_back_to_the_defaults_the_draft_was_trained_on(built):
    [finding] = [f for f in _lint(built, published.TORCHSPEC_KIMI) if f.code == "layer-ids-missing"]
    assert finding.severity == "warning" and "[h2, h4, h5] (L=8)" in finding.message


def test_lint_has_no_vocabulary_map_finding_for_a_full_vocabulary_draft_without_d2t(built):
    assert [f for f in _lint(built, published.TORCHSPEC_KIMI) if f.code in ("vocab-map", "d2t-convention")] == []


def test_lint_names_sglang_refusing_a_draft_max_position_embeddings_below_its_targets(built):
    # the EAGLE-3 Llama-3.1 training config's 2048 of 131072, at test size 32 of tiny-llama's 2048
    [f] = [f for f in _lint(built, published.EAGLE_LLAMA31) if f.code == "draft-positions"]
    assert f.severity == "error" and f.engines == ("sglang",)
    assert "max_position_embeddings is 32, below the target's 2048" in f.message
    assert "ModelConfig._derive_context_length" in f.message  # SGLang 0.5.23 does not start
    assert "_maybe_override_draft_max_position_embeddings" in f.message  # vLLM 0.32.0 raises it and runs
    assert "Fix: write max_position_embeddings = 2048" in f.message


def test_lint_only_warns_of_a_short_draft_when_sglang_is_held_to_the_drafts_length(built):
    name = published.EAGLE_LLAMA31
    engines = {"sglang": {"server_args": {"context_length": 32}}}
    findings = lint_draft(built[name], _target_dir(name), published.SOURCES[name].trained_on, engines)
    [f] = [f for f in findings if f.code == "draft-positions"]
    assert f.severity == "warning" and f.engines == () and "vLLM 0.32.0 raises" in f.message


def test_lint_warns_of_a_case_running_positions_beyond_the_drafts_max_position_embeddings(built):
    name = published.SPECFORGE_DEEPSEEK  # 1024 positions, as its target
    findings = lint_draft(built[name], _target_dir(name), published.SOURCES[name].trained_on, positions=1100)
    [f] = [f for f in findings if f.code == "draft-positions"]
    assert f.severity == "warning" and "the case runs positions up to 1100" in f.message


def test_lint_has_no_position_finding_for_a_draft_as_long_as_its_target(built):
    assert [f for f in _lint(built, published.SPECFORGE_DEEPSEEK) if f.code == "draft-positions"] == []


# -- what each engine's reading feeds (the presets ref[wiring=...] runs) -----------------------------


@pytest.mark.parametrize(
    ("name", "preset", "fed"),
    [
        # SGLang's DeepSeek model: first id 1 -> h[k+1]; SpecForge trains the same way
        (published.SPECFORGE_DEEPSEEK, "sglang-deepseek", [2, 4, 5]),
        (published.SPECFORGE_DEEPSEEK, "specforge", [2, 4, 5]),
        # vLLM (Model Runner V1's reading: eagle_config when the top level has none): h[k]
        (published.SPECFORGE_DEEPSEEK, "vllm", [1, 3, 4]),
        (published.SPECFORGE_KIMI, "vllm", [2, 4, 5]),
        (published.SPECFORGE_KIMI, "sglang-deepseek", [2, 4, 5]),
        (published.SPECFORGE_KIMI, "specforge", [3, 5, 6]),
        # no ids: the defaults (2, L//2, L-3)
        (published.TORCHSPEC_KIMI, "vllm", [2, 4, 5]),
        (published.TORCHSPEC_KIMI, "sglang-deepseek", [2, 4, 5]),
    ],
)
def test_what_each_reading_feeds_a_published_shape(built, name, preset, fed):
    cfg = _config(built[name])
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    L = _config(_target_dir(name))["num_hidden_layers"]
    assert hidden_indices(resolve(preset, L, ids, "test").inputs) == fed


def test_lint_names_sglang_failing_on_a_config_without_draft_vocab_size(built):
    [f] = [f for f in _lint(built, published.TORCHSPEC_KIMI) if f.code == "draft-config-key"]
    assert f.severity == "error" and f.engines == ("sglang",)
    assert "draft_vocab_size" in f.message and "SGLang 0.5.23" in f.message
    assert "Fix: write draft_vocab_size = the draft's vocabulary" in f.message


def test_lint_has_no_draft_vocab_size_finding_for_a_draft_that_writes_it(built):
    assert [f for f in _lint(built, published.SPECFORGE_DEEPSEEK) if f.code == "draft-config-key"] == []


def test_lint_warns_not_errs_of_specforge_deepseek_training_with_the_rope_its_config_names(built):
    # SpecForge builds the draft's rope from the draft config it is given (theta 10000 when absent, and its
    # example scripts pass this config), as the engines do: what was trained is what is served
    findings = _lint(built, published.SPECFORGE_DEEPSEEK)
    [f] = [f for f in findings if f.code == "rope-dropped"]
    assert f.severity == "warning" and "get_rope_config" in f.message
    assert [f for f in findings if f.severity == "error"] == []
