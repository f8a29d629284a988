"""The layer-id rule models (difftest.rules.layer_rules) as specifications: what each engine version feeds
for a config, why, and the edit that fixes it. Their agreement with the real engines is
tests/test_layer_rules_engines.py; these tests pin the semantics and the inverse."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from difftest.rules import layer_rules as lr
from difftest.rules.layer_rules import KEY

L = 8


def ec(ids):
    return {"eagle_config": {KEY: ids}}


def test_sglang_llama_sorts_then_shifts_the_issue_example():
    reading = lr.SGLANG_LLAMA.predict(ec([4, 2, 0]), L, 3)
    assert reading.fed == [1, 3, 5]
    assert reading.explain() == (
        "SGLang 0.5.23 (Llama rule: ids from eagle_config, layer order, k -> h[k+1]) "
        "turns [4, 2, 0] (eagle_config) into [h1, h3, h5]"
    )


def test_vllm_reads_the_top_level_before_eagle_config():
    cfg = {KEY: [1, 2, 3], **ec([4, 5, 6])}
    assert lr.VLLM_LLAMA.predict(cfg, L).fed == [1, 2, 3]
    assert lr.VLLM_LLAMA.predict(ec([4, 5, 6]), L).fed == [4, 5, 6]


def test_sglang_ignores_top_level_ids_and_falls_back_without_the_shift():
    reading = lr.SGLANG_LLAMA.predict({KEY: [1, 2, 3]}, L, 3)
    assert reading.ids is None and reading.fed == [2, 4, 5]


def test_default_fallback_on_a_shallow_target_is_narrower_than_fc_in_both_engines():
    """L = 4: [2, L//2, L-3] = [2, 2, 1], two layers once each; fc expects three chunks."""
    for rule in (lr.VLLM_LLAMA, lr.SGLANG_LLAMA):
        reading = rule.predict({}, 4, 3)
        assert reading.fed == [1, 2]
        assert "fc expects 3 chunks but the engine captures 2" in reading.refusal


def test_sglang_cannot_capture_the_last_layer_output():
    reading = lr.SGLANG_LLAMA.predict(ec([2, 4, 7]), L, 3)
    assert reading.fed == [3, 5] and reading.dropped == [8] and reading.refusal


def test_sglang_capturing_no_layer_fails_in_the_targets_forward_not_at_fc():
    """Measured on SGLang 0.5.23 (tests/test_layer_rules_engines.py, seed 148252363): ids [4, 5, 5]
    on a 5-layer Llama ask for h5, h6, beyond h0..h4; the worker died with "ValueError: too many
    values to unpack (expected 2)" in LlamaForCausalLM.forward, before the draft ran."""
    for rule in (lr.SGLANG_LLAMA, lr.SGLANG_QWEN3):
        reading = rule.predict(ec([4, 5, 5]), 5, 3)
        assert (reading.fed, reading.dropped, reading.outcome) == ([], [5, 6], "refused")
        assert "captures no layer: the target's forward unpacks (hidden, aux)" in reading.refusal
        assert reading.says == "too many values to unpack"
    # two layers for three chunks stays fc's shape error
    assert lr.SGLANG_LLAMA.predict(ec([0, 2, 5]), 5, 3).says == lr.SGLANG_LLAMA.shape_error


def test_vllm_v1_capturing_no_layer_fails_unpacking_the_targets_output_not_at_fc():
    """Measured on vLLM 0.32.0 Model Runner V1 (tests/test_layer_rules_engines.py, seed 1362464719):
    ids [-1, -1, -1] on a Qwen3 target capture nothing; the worker died with "ValueError: too many
    values to unpack (expected 2)" where the runner unpacks (hidden, aux), before the draft ran."""
    for family in (lr.LLAMA, lr.QWEN3, lr.DEEPSEEK):
        rule = lr.VARIANT_RULES[("vllm", family, "runner v1")]
        reading = rule.predict({KEY: [-1, -1, -1]}, 6, 3)
        assert (reading.fed, reading.outcome) == ([], "refused")
        assert "captures no layer: the target returns its hidden states alone" in reading.refusal
        assert reading.says == "too many values to unpack"
        # Model Runner V2 asserts the tuple instead
        assert (
            lr.VARIANT_RULES[("vllm", family, "runner v2")].predict({KEY: [-1, -1, -1]}, 6, 3).says == "AssertionError"
        )
    # two layers for three chunks stays fc's shape error
    assert lr.VLLM_LLAMA.predict({KEY: [-1, 2, 9]}, 6, 3).says == lr.VLLM_LLAMA.shape_error


def test_vllm_deepseek_refuses_id_0_and_sglang_deepseek_shifts_only_when_the_first_id_is_1():
    assert "id 0" in lr.VLLM_DEEPSEEK.predict({KEY: [0, 2, 4]}, 6, 3).refusal
    assert lr.SGLANG_DEEPSEEK.predict(ec([1, 3, 4]), 6, 3).fed == [2, 4, 5]
    assert lr.SGLANG_DEEPSEEK.predict(ec([0, 2, 4]), 6, 3).fed == [0, 2, 4]


def test_families_follow_the_target_config():
    assert lr.target_family({"model_type": "deepseek_v3"}) == lr.DEEPSEEK
    assert lr.target_family({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}) == lr.QWEN3
    assert lr.target_family({"model_type": "llama"}) == lr.LLAMA
    assert lr.rule_for("sglang@new", lr.QWEN3) is lr.SGLANG_QWEN3
    assert lr.rule_for("ref", lr.LLAMA) is None


def test_fix_for_sglang_feeds_the_embedding_through_id_minus_1():
    """SGLang's LlamaModel captures the input of layer i for i in layers_to_capture = id + 1: id -1
    is layer 0's input, the embedding (verified on SGLang 0.5.23: the seed draft's accept length
    matches the reference's with eagle_config ids [-1, 1, 3])."""
    edit = lr.config_edit({KEY: [2, 4, 7]}, lr.LLAMA, "sglang", [0, 2, 4], L)
    assert edit.patch == ec([-1, 1, 3])


def test_fix_for_the_seed_shape_on_deepseek_names_sglangs_ids_and_vllms_refusal():
    """A DeepSeek-V3 draft trained on [h0, h2, h4]: SGLang's DeepSeek rule feeds it from ids
    [0, 2, 4] (first id not 1: no shift); vLLM's DeepSeek model cannot capture h0 at all."""
    sglang = lr.config_edit({}, lr.DEEPSEEK, "sglang", [0, 2, 4], 6)
    assert sglang.patch == ec([0, 2, 4])
    vllm = lr.config_edit({}, lr.DEEPSEEK, "vllm", [0, 2, 4], 6)
    assert not vllm.possible and "cannot feed [h0]" in vllm.impossible
    assert any("SGLang 0.5.23 can serve it (ids [0, 2, 4] at eagle_config)" in a for a in vllm.alternatives)


def test_training_out_of_layer_order_is_fixed_by_reordering_fc_blocks_then_ids():
    """Both engines feed fc in layer order: a draft trained on [h4, h2, h0] needs its fc.weight input
    blocks reordered ([2, 1, 0]: new block j = trained block 2 - j), then the ids of [h0, h2, h4]."""
    edit = lr.config_edit(ec([4, 2, 0]), lr.LLAMA, "sglang", [4, 2, 0], L)
    assert edit.fc_order == [2, 1, 0] and edit.feeds == [0, 2, 4]
    assert edit.patch == ec([-1, 1, 3])


def test_a_layer_the_engine_cannot_capture_has_no_fix_and_names_who_can():
    edit = lr.config_edit(ec([1, 3, 7]), lr.LLAMA, "sglang", [2, 4, 8], L)
    assert not edit.possible and "cannot feed [h8]" in edit.impossible
    assert any(a.startswith("vLLM 0.32.0 can serve it (ids [2, 4, 8] at top level)") for a in edit.alternatives)


def test_a_fix_that_changes_another_engines_reading_says_so():
    """vLLM (Model Runner V1) reads eagle_config when the top level has none: writing SGLang's ids there moves it too;
    V2 never reads that key, so its reading stays."""
    edit = lr.config_edit(ec([2, 4, 5]), lr.LLAMA, "sglang", [2, 4, 5], L)
    assert edit.patch == ec([1, 3, 4])
    assert edit.side_effects and edit.side_effects[0].startswith(
        "vLLM 0.32.0 Model Runner V1 now reads [1, 3, 4] (eagle_config)"
    )


IDS = st.lists(st.integers(min_value=-1, max_value=L), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(ids=IDS, engine=st.sampled_from(["vllm", "sglang"]), family=st.sampled_from(lr.FAMILIES))
def test_solving_what_an_engine_feeds_gives_ids_it_reads_back_the_same_way(ids, engine, family):
    """The inverse is exact: for whatever a config makes an engine feed, solve() finds ids that make
    it feed the same layers (when the forward model feeds anything without failing)."""
    rule = lr.rule_for(engine, family)
    reading = rule.predict_ids(ids, L)
    if reading.refusal or reading.dropped or not reading.fed:
        return
    solved = rule.solve(reading.fed, L)
    assert solved.ids is not None, solved.impossible
    assert rule.predict_ids(solved.ids, L, fc_chunks=len(reading.fed)).fed == reading.fed


@pytest.mark.parametrize("engine,family", sorted(lr.ENGINE_RULES))
def test_every_rule_cites_its_engine_source(engine, family):
    rule = lr.ENGINE_RULES[(engine, family)]
    assert rule.sources and all(s.startswith(f"{engine}/") for s in rule.sources)


def test_sglang_deepseek_feeds_h1_only_when_the_1_is_not_listed_first():
    """Its +1 applies when the *first* id is 1: [h1, h2, h3] needs the ids unsorted, e.g. [2, 1, 3]."""
    ids = lr.SGLANG_DEEPSEEK.solve([1, 2, 3], 6).ids
    assert ids[0] != 1 and sorted(ids) == [1, 2, 3]
    assert lr.SGLANG_DEEPSEEK.predict_ids(ids, 6).fed == [1, 2, 3]


def test_the_report_has_a_fix_section_for_a_failing_fc_inputs_item():
    from difftest.report.html_report import render
    from difftest.report.writer import markdown

    from difftest.records import CheckResult, ComparisonData, FixData, Report

    fix = FixData(patch=ec([1, 3, 4]), ids=[1, 3, 4])
    data = ComparisonData(rule="SGLang 0.5.23 (Llama rule: ...)", fix=fix)
    report = Report(
        case="c",
        case_file="cases/c.yaml",
        created="now",
        reference="ref",
        accept_length_definition="d",
        engines={},
        checks=[CheckResult("sglang", "fc_inputs", "failed", "m", data)],
    )
    md = markdown(report)
    assert "## Fix" in md and "difftest fix cases/c.yaml --engines sglang" in md
    assert '{"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}' in md
    assert "<h2 id='fix'>Fix</h2>" in render(report)


def test_vllm_deepseek_drops_id_minus_1_without_the_id_0_crash():
    """-1 matches no layer index in DeepseekV2Model.forward: dropped (fewer chunks), not the h0 TypeError."""
    reading = lr.VLLM_DEEPSEEK.predict({KEY: [-1, 2, 4]}, 6, 3)
    assert reading.fed == [2, 4] and "fc expects 3 chunks" in reading.refusal


def test_a_retrain_suggestion_keeps_as_many_layers_as_fc_takes():
    """Measured at Kimi width (stop 54): a draft trained on [h1, h2, h3] of a 3-layer DeepSeek-V3 target,
    which SGLang's DeepSeek model captures only h0..h2 of, was told to retrain on [h1, h2] (two layers
    for a three-chunk fc); the suggestion is three distinct layers SGLang can feed."""
    edit = lr.config_edit({}, lr.DEEPSEEK, "sglang", [1, 2, 3], 3)
    [retrain] = [a for a in edit.alternatives if "retrain" in a]
    assert retrain.endswith("e.g. [h0, h1, h2]"), retrain
    # a feedable trained layer stays where it was; only the out-of-range one moves
    edit = lr.config_edit({}, lr.DEEPSEEK, "vllm", [0, 2, 4], 6)
    [retrain] = [a for a in edit.alternatives if "retrain" in a]
    assert retrain.endswith("e.g. [h1, h2, h4]"), retrain
