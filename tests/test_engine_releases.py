"""Rules keyed by engine release (difftest.rules.engine_releases): an older release's rules are the pinned
ones with each change it predates undone, every difference is cited, and a release outside the
supported range is refused in one line naming the range."""

from __future__ import annotations

import pytest

from difftest.rules import draft_rules
from difftest.rules import engine_releases as er
from difftest.rules import layer_rules as lr
from difftest.base.errors import ConfigError

SGLANG_IDS = {"eagle_config": {lr.KEY: [2, 4, 5]}}


def test_the_pinned_release_reads_exactly_the_pinned_rules():
    assert er.layer_rule("sglang", lr.DEEPSEEK, "0.5.23+cpu-shim.a3") is lr.SGLANG_DEEPSEEK
    assert er.layer_rule("vllm", lr.LLAMA, None) is lr.VLLM_LLAMA
    assert er.engine_draft_rules("sglang", "0.5.23") is draft_rules.SGLANG


def test_sglang_before_25454_shifts_deepseek_ids_whose_first_id_is_2():
    old = er.layer_rule("sglang", lr.DEEPSEEK, "0.5.12").predict(SGLANG_IDS, 7, 3)
    new = er.layer_rule("sglang", lr.DEEPSEEK, "0.5.13").predict(SGLANG_IDS, 7, 3)
    assert (old.fed, new.fed) == ([3, 5, 6], [2, 4, 5])
    assert old.rule.label == "SGLang 0.5.12"


def test_sglang_llama_rule_is_the_same_in_every_supported_release():
    for v in ("0.5.5", "0.5.12", "0.5.16", "0.5.23"):
        assert er.layer_rule("sglang", lr.LLAMA, v).predict(SGLANG_IDS, 8, 3).fed == [3, 5, 6]


def test_an_upgrade_names_the_change_that_moved_the_feed_and_cites_it():
    diff = er.layer_difference("sglang", lr.DEEPSEEK, "0.5.12", "0.5.23", SGLANG_IDS, 7, 3)
    assert diff.line() == (
        "upgrade: SGLang 0.5.12 feeds [h3, h5, h6]; SGLang 0.5.23 feeds [h2, h4, h5]: the +1 on DeepSeek "
        "aux layer ids now applies only when the first id is 1 (sgl-project/sglang#25454, first in sglang 0.5.13)"
    )


def test_a_change_that_does_not_touch_this_config_is_not_cited():
    # ids [2, 4, 5] never ask for h0: the 0.5.14 h0-capture change is crossed but irrelevant
    diff = er.layer_difference("sglang", lr.DEEPSEEK, "0.5.12", "0.5.23", SGLANG_IDS, 7, 3)
    assert [c.first for c in diff.changes] == ["0.5.13"]


def test_releases_that_read_a_config_alike_show_no_difference():
    assert er.layer_difference("sglang", lr.DEEPSEEK, "0.5.16", "0.5.23", SGLANG_IDS, 7, 3) is None
    assert er.layer_difference("sglang", lr.LLAMA, "0.5.5", "0.5.23", SGLANG_IDS, 8, 3) is None


def test_sglang_before_32334_ignores_norm_before_fc():
    lines = er.flag_differences("sglang", "0.5.16", "0.5.23", {"norm_before_fc": True})
    assert lines == [
        "upgrade: norm_before_fc: SGLang 0.5.16 ignores it (never read); SGLang 0.5.23 takes True (top level); "
        "first moved tensor draft.fc_out: norm_before_fc is honoured (eagle_config, then the top level); "
        "before, it was ignored (sgl-project/sglang#32334, first in sglang 0.5.17)"
    ]
    assert er.flag_differences("sglang", "0.5.17", "0.5.23", {"norm_before_fc": True}) == []


def test_vllm_speculators_flags_arrive_release_by_release():
    cfg = {"speculators_model_type": "eagle3", "norm_before_fc": True, "fc_norm": True, "norm_output": True}
    located = draft_rules.flag_locations(cfg)

    def reads(version: str, flag: str):
        return draft_rules.engine_reading(er.engine_draft_rules("vllm", version), flag, located[flag])[0]

    assert [reads(v, "norm_before_fc") for v in ("0.18.0", "0.19.0", "0.32.0")] == [None, True, True]
    assert [reads(v, "fc_norm") for v in ("0.21.0", "0.24.0", "0.25.0")] == [None, None, True]
    assert [reads(v, "norm_output") for v in ("0.21.0", "0.24.0", "0.25.0")] == [None, None, True]


def test_vllm_before_0_22_reads_ids_only_at_the_top_level():
    old = er.layer_rule("vllm", lr.LLAMA, "0.21.0").predict({"eagle_config": {lr.KEY: [0, 2, 4]}}, 8, 3)
    assert old.ids is None and old.fed == [2, 4, 5]  # the default layers, silently


def test_a_downgrade_lists_the_same_changes_newest_first():
    up = er.changes_between("vllm", "0.21.0", "0.32.0")
    assert er.changes_between("vllm", "0.32.0", "0.21.0") == up[::-1]
    assert [c.first for c in up] == ["0.22.0", "0.22.0", "0.25.0"]


@pytest.mark.parametrize(
    "engine,version,words",
    [
        ("sglang", "0.4.9", "outside the supported releases sglang 0.5.5 - 0.5.23"),
        ("sglang", "0.5.24", "outside the supported releases sglang 0.5.5 - 0.5.23"),
        ("vllm", "0.11.0", "outside the supported releases vllm 0.18.0 - 0.32.0"),
        ("vllm", "latest", "is not a release version"),
    ],
)
def test_a_release_outside_the_range_is_refused_naming_it(engine, version, words):
    with pytest.raises(ConfigError) as e:
        er.check_supported(engine, version)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_release_whose_rules_are_known_but_that_cannot_run_here_says_why():
    with pytest.raises(ConfigError) as e:
        er.check_runs_here("sglang", "0.5.12")
    assert "the releases that run on a CPU are 0.5.16 - 0.5.23" in str(e.value)
    assert er.check_runs_here("vllm", "0.27.0") == "0.27.0"
    assert (
        er.check_runs_here("vllm", "0.24.0") == "0.24.0"
    )  # on PyPI's CUDA torch 2.11.0 (difftest_engines/vllm/releases/0.24.0.txt)
    with pytest.raises(ConfigError, match="the releases that run on a CPU are 0.24.0 - 0.32.0"):
        er.check_runs_here("vllm", "0.23.0")


@pytest.mark.parametrize("change", er.CHANGES, ids=lambda c: f"{c.engine}-{c.first}-{c.reference.split('#')[-1]}")
def test_every_recorded_change_changes_something(change):
    """Undoing a change in the release that has it must alter a rule: a change that alters nothing is data rot."""
    before = er._version(change.engine, change.first)
    assert er.SUPPORTED[change.engine].contains(str(before))
    altered = False
    for fam, _ in change.layer_before:
        at = er.layer_rule(change.engine, fam, change.first)
        altered |= change.undo_layer(at, fam) != at
    rules = er.engine_draft_rules(change.engine, change.first)
    for flag, read_from in change.flags_before:
        altered |= rules.flag(flag).read_from != tuple(read_from)
    assert altered


def test_a_flag_both_releases_run_alike_is_not_a_difference():
    # 0.24.0 does not read a speculators config's fc_norm, 0.32.0 reads it as False: the draft runs the same
    cfg = {"speculators_model_type": "eagle3", "fc_norm": False, "norm_output": True}
    lines = er.flag_differences("vllm", "0.24.0", "0.32.0", cfg)
    assert [ln.split(":")[1].strip() for ln in lines] == ["norm_output"]
    assert lines[0].endswith("(vllm-project/vllm#46488, first in vllm 0.25.0)")


SPEC_FC_NORM = {"speculators_model_type": "eagle3", "fc_norm": True}


def test_a_weighted_flag_an_old_vllm_does_not_build_is_predicted_as_a_load_refusal_naming_its_weights():
    from difftest.rules.lint_checkpoint import flag_findings

    [f] = flag_findings(SPEC_FC_NORM, [er.engine_draft_rules("vllm", "0.24.0")])
    assert f.code == "flag-ignored" and f.engines == ("vllm",) and f.weights == ("fc_norm.",)
    assert f.message.startswith(
        "fc_norm: True in the draft config (speculators config), but vllm 0.24.0 reads it only from top level"
    )
    assert "the checkpoint's fc_norm.* weights are refused at load" in f.message
    assert "Fix: convert the draft to the HF EAGLE-3 layout" in f.message
    assert flag_findings(SPEC_FC_NORM, [er.engine_draft_rules("vllm", "0.25.0")]) == []


def test_a_weighted_flag_an_engine_drops_silently_is_predicted_as_a_divergence():
    from difftest.rules.lint_checkpoint import flag_findings

    [f] = flag_findings({"norm_before_fc": True}, [er.engine_draft_rules("sglang", "0.5.16")])
    assert "it runs the draft with norm_before_fc=False; the first tensor that differs is draft.fc_out" in f.message
    assert "refused at load" not in f.message  # SGLang's loader drops the input_norm weights without a word


def test_the_releases_that_read_a_flag_are_derived_from_the_changes_table():
    [run] = er.flag_readers("sglang", "norm_before_fc")
    assert (run.first, run.last, run.read_from) == ("0.5.17", "0.5.23", (draft_rules.EAGLE_CONFIG, draft_rules.TOP))
    assert run.words() == "SGLang 0.5.17 - 0.5.23 (from eagle_config, then top level)"


def test_a_flag_no_release_reads_has_no_readers():
    assert er.flag_readers("sglang", "norm_before_residual") == []


def test_a_flag_a_release_cannot_read_is_not_fixed_by_writing_it_elsewhere_and_names_the_releases_that_can():
    from difftest.rules.lint_checkpoint import flag_findings

    [f] = flag_findings({"norm_before_fc": True}, [er.engine_draft_rules("sglang", "0.5.16")])
    fix = f.message.split("Fix: ", 1)[1]
    assert fix.startswith("sglang 0.5.16 cannot read norm_before_fc (True in the draft config) from any place")
    assert "serve the draft with a release that reads it: SGLang 0.5.17 - 0.5.23" in fix
    assert fix.endswith("or train the draft without norm_before_fc")
    assert "write" not in fix


def test_a_flag_a_release_reads_elsewhere_is_fixed_by_writing_it_where_it_reads():
    from difftest.rules.lint_checkpoint import flag_findings, flag_misreadings

    cfg = {"eagle_config": {"fc_norm": True}}
    [m] = flag_misreadings(cfg, [er.engine_draft_rules("sglang", "0.5.23")])
    assert (m.place(), m.patch(), m.cannot()) == (draft_rules.TOP, {"fc_norm": True}, None)
    [f] = flag_findings(cfg, [er.engine_draft_rules("sglang", "0.5.23")])
    assert f.message.endswith(
        "Fix: write fc_norm: True where sglang 0.5.23 reads it (top level), or train the draft without it"
    )
