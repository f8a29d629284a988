"""vLLM's two model runners as rule data (no engine): which runner a release runs by default, how each reads
a draft's layer ids, the fix that makes both read the same, a failure declared for one runner only, and a
release without rules on record (run and measured, not refused). The rules are confirmed on the real engine
by tests/test_layer_rules_engines.py (both runners) and tests/test_engine_vllm_v2.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from difftest.base.errors import ConfigError
from difftest.case.expected_failure import ExpectedFailure, parse
from difftest.records.engine_info import EngineInfo
from difftest.rules import engine_releases as er
from difftest.rules import layer_rules as lr
from difftest_engines.vllm import releases

NESTED = {"eagle_config": {lr.KEY: [0, 2, 4]}}  # SpecForge's export: ids only in eagle_config
L = 8


def _rule(variant: str, version: str | None = None) -> lr.LayerIdRule:
    rule = er.layer_rule("vllm", lr.LLAMA, version, variant)
    assert rule is not None
    return rule


def test_model_runner_v2_ignores_nested_ids_and_feeds_its_defaults():
    reading = _rule("runner v2").predict(NESTED, L, 3)
    assert reading.fed == [2, 4, 5]  # (2, L//2, L-3)
    assert reading.outcome == "default"
    words = reading.explain()
    assert "Model Runner V2" in words
    assert "ignores eagle_config.eagle_aux_hidden_state_layer_ids [0, 2, 4]" in words
    assert "finds no ids (top level / eagle_config.layer_ids) and falls back to [2, L//2, L-3] = [2, 4, 5]" in words


def test_model_runner_v1_reads_the_nested_ids():
    assert _rule("runner v1").predict(NESTED, L, 3).fed == [0, 2, 4]


def test_model_runner_v2_reads_eagle_config_layer_ids():
    reading = _rule("runner v2").predict({"eagle_config": {"layer_ids": [1, 3, 6]}}, L, 3)
    assert (reading.fed, reading.place) == ([1, 3, 6], lr.EAGLE_CONFIG_LAYER_IDS)
    assert _rule("runner v1").predict({"eagle_config": {"layer_ids": [1, 3, 6]}}, L, 3).fed == [2, 4, 5]


@pytest.mark.parametrize("ids", [[0, 2, 4], [5, 1, 3], [3, 3, 7]])
def test_both_runners_read_top_level_ids_alike(ids):
    cfg = {lr.KEY: ids, "eagle_config": {lr.KEY: [1, 2, 3]}}
    v1, v2 = _rule("runner v1").predict(cfg, L, 3), _rule("runner v2").predict(cfg, L, 3)
    assert (v1.fed, v1.refusal) == (v2.fed, v2.refusal)


def test_the_v2_fix_writes_top_level_ids_that_v1_reads_the_same():
    edit = lr.config_edit(NESTED, lr.LLAMA, "vllm", [0, 2, 4], L, _rule("runner v2"))
    assert edit.patch == {lr.KEY: [0, 2, 4]}
    edited = er.layer_rules._merge(NESTED, edit.patch)
    assert _rule("runner v1").predict(edited, L, 3).fed == _rule("runner v2").predict(edited, L, 3).fed == [0, 2, 4]


def test_a_fix_for_v1_names_what_it_does_to_v2():
    cfg = {lr.KEY: [2, 4, 5]}
    edit = lr.config_edit(cfg, lr.LLAMA, "vllm", [1, 3, 6], L, _rule("runner v1"))
    assert edit.patch == {lr.KEY: [1, 3, 6]}
    # both runners read the top level first: the edit moves V2 too, to the trained layers
    (v2,) = [s for s in edit.side_effects if "Model Runner V2" in s]
    assert "feeds [h1, h3, h6]" in v2 and "needs" not in v2


def test_an_older_release_keeps_the_runner_in_its_label():
    assert _rule("runner v2", "0.27.0").label == "vLLM 0.27.0 Model Runner V2"
    assert _rule("", "0.27.0").label == "vLLM 0.27.0"


@pytest.mark.parametrize("version,runner", [("0.32.0", "v2"), ("0.34.0", "v2"), ("0.27.0", "v1"), ("0.24.0", "v1")])
def test_the_default_runner_is_the_one_a_gpu_deployment_of_the_release_takes(version, runner):
    assert releases.default_runner(version) == runner


def test_a_runner_a_release_does_not_have_is_named_in_one_line():
    v1 = releases.runner_problem("0.34.0", "v1")
    assert v1 is not None and "no Model Runner V1" in v1 and "\n" not in v1
    v2 = releases.runner_problem("0.27.0", "v2")
    assert v2 is not None and "runner=v1" in v2
    assert releases.runner_problem("0.32.0", "v1") is None and releases.runner_problem("0.32.0", "v2") is None
    assert releases.runner_problem("0.33.0", "v1") is None  # read in the 0.33.0 wheel: V1 is still there


@pytest.mark.parametrize(
    "engine,params,variant",
    [
        ("vllm", {}, "runner v2"),
        ("vllm", {"runner": "v1"}, "runner v1"),
        ("vllm@0.24.0", {"runner": "v1"}, "runner v1"),
        ("sglang", {}, ""),
        ("ref", {"wiring": "vllm"}, ""),
    ],
)
def test_a_spec_names_the_variant_it_runs(engine, params, variant):
    assert lr.spec_variant(engine, params) == variant


def test_an_expected_failure_for_one_runner_does_not_apply_to_the_other(tmp_path: Path):
    raw = [{"engine": "vllm", "variant": "runner v2", "check": "fc_inputs", "cause": "ignores"}]
    (entry,) = parse(raw, tmp_path / "c.yaml", ("fc_inputs",), engines={"vllm", "ref"})
    assert entry.matches("vllm", "vllm", "fc_inputs", variant="runner v2")
    assert not entry.matches("vllm", "vllm[runner=v1]", "fc_inputs", variant="runner v1")
    assert entry.to_dict()["variant"] == "runner v2"
    assert "variant" not in ExpectedFailure("vllm", "fc_inputs", "x").to_dict()


def test_a_misspelt_expected_failure_key_names_variant(tmp_path: Path):
    with pytest.raises(ConfigError, match="did you mean 'variant'"):
        parse(
            [{"engine": "vllm", "varient": "runner v2", "check": "fc_inputs", "cause": "x"}],
            tmp_path / "c.yaml",
            ("fc_inputs",),
            engines={"vllm"},
        )


def test_the_engine_label_names_the_runner_beside_the_release():
    assert EngineInfo("vllm", "0.32.0", variant="runner v2").label() == "vllm 0.32.0 (runner v2)"
    assert EngineInfo("sglang", "0.5.23").label() == "sglang 0.5.23"


def test_a_release_nobody_studied_has_no_rule_on_record_and_is_measured():
    assert not er.on_record("sglang", "0.5.24") and er.on_record("sglang", "0.5.23")
    assert er.layer_rule("sglang", lr.LLAMA, "0.5.24") is None
    assert er.engine_draft_rules("sglang", "0.5.24") is None
    line = er.unrecorded("sglang", "0.5.24")
    assert line.startswith("no rule on record for sglang 0.5.24") and "measured" in line


def test_a_newer_release_can_be_built_for_a_pre_upgrade_check():
    assert er.check_runs_here("sglang", "0.5.24") == "0.5.24"
    assert er.check_runs_here("vllm", "0.33.0") == "0.33.0"
    with pytest.raises(ConfigError, match="is not a release version"):
        er.check_runs_here("vllm", "latest")


def test_the_other_runner_of_the_pinned_release_is_its_sibling():
    assert [r.label for r in lr.variant_siblings(_rule("runner v2"))] == ["vLLM 0.32.0 Model Runner V1"]
    assert [r.label for r in lr.variant_siblings(_rule("runner v1"))] == ["vLLM 0.32.0 Model Runner V2"]
    assert lr.variant_siblings(_rule("runner v1", "0.27.0")) == []
    assert lr.variant_siblings(er.layer_rule("sglang", lr.LLAMA)) == []
