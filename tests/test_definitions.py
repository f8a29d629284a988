"""Every figure a report shows states its definition (difftest.base.definitions), and the engines' and
trainers' own figures convert to the harness's through one table."""

from __future__ import annotations

import pytest

from difftest.base import definitions

from difftest.report import writer as report
from difftest.records.acceptance import NORMALISATION, AcceptStats, normalise
from difftest.records import CheckResult
from difftest.records.check_data import AcceptLengthData
from difftest.records.report import Report
from difftest_engines.trainingdata.train_check import TrainAccuracyData


# one figure per normalisable definition, written out by hand: (name, what normalise is given, the
# harness's accept length it must give: accepted draft tokens + 1 per verify step)
HAND_CONVERTED = [
    ("difftest", dict(value=2.5), 2.5),
    ("vllm.mean_acceptance_length", dict(value=2.5), 2.5),
    ("vllm.num_accepted_tokens_per_draft", dict(value=1.5), 2.5),
    ("sglang.spec_accept_length", dict(completion_tokens=130, requests=10, verify_ct=40), 3.0),
    ("sglang.spec_num_correct_drafts", dict(value=60, verify_ct=40), 2.5),
    ("acceptance_rate", dict(value=0.5, num_draft_tokens=4), 2.5),
    ("speculators.full_acc", dict(steps=[0.8, 0.6, 0.4]), 2.8),  # P(K > k) summed, + 1
    ("speculators.cond_acc", dict(steps=[0.8, 0.75, 2 / 3]), 2.8),  # 0.8, 0.8*0.75, 0.8*0.75*2/3
    ("specforge.acc", dict(steps=[0.8, 0.75, 2 / 3]), 2.8),
]


def test_every_normalisable_figure_is_defined_and_converts_as_worked_by_hand():
    assert [name for name, _, _ in NORMALISATION] == [name for name, _, _ in HAND_CONVERTED]
    for name, given, expected in HAND_CONVERTED:
        if name != "difftest":
            assert definitions.definition(name).counts  # declared in difftest.base.definitions
        assert normalise(name, **given) == pytest.approx(expected), name


def test_an_unknown_figure_is_refused_naming_the_known_ones():
    with pytest.raises(KeyError, match="no definition for 'sglang.accept_len'.*sglang.spec_accept_length"):
        definitions.definition("sglang.accept_len")


def test_trainers_are_told_apart_by_their_rules_name():
    assert definitions.trainer_figures("speculators>=0.7") == ("speculators.full_acc", "speculators.cond_acc")
    assert definitions.trainer_figures("speculators@0.6") == ("speculators.full_acc", "speculators.cond_acc")
    assert definitions.trainer_figures("specforge@0.2") == ("specforge.acc",)


def test_conditional_accuracies_multiply_into_per_position_acceptance():
    assert definitions.per_position_from_conditional([0.5, 0.5, 0.5]) == [0.5, 0.25, 0.125]
    assert definitions.accept_length_from_per_position([0.5, 0.25, 0.125]) == pytest.approx(1.875)


def _accept_result(native: list[str]) -> CheckResult:
    data = AcceptLengthData(
        reference=AcceptStats(10, 12, 3, [6, 4, 2], 1),
        engine=AcceptStats(10, 12, 3, [6, 4, 2], 1, native=native),
        allowed=0.5,
        spread=0.1,
    )
    return CheckResult("sglang", "accept_length", "passed", "", data)


def test_report_defines_the_accept_length_the_per_position_rates_and_the_engines_own_figures():
    used = [d.name for d in report.definitions_used([_accept_result(["sglang.spec_num_correct_drafts"])], True)]
    assert used == [
        "difftest.row_error",
        "difftest.excess",
        "difftest.accept_length",
        "difftest.acceptance_rate_per_pos",
        "sglang.spec_num_correct_drafts",
    ]


def test_report_defines_the_trainers_figures_under_its_rules():
    data = TrainAccuracyData(
        trainer={"rules": "specforge@0.2"}, engine={}, engine_wiring=[], identification={}, skipped=0
    )
    used = [d.name for d in report.definitions_used([CheckResult("ref", "train_accuracy", "passed", "", data)], False)]
    assert used == ["difftest.train_accuracy", "specforge.acc"]


def test_markdown_report_has_a_definitions_table_row_per_figure():
    rep = Report(
        "c",
        "c.yaml",
        "",
        "ref",
        "",
        {},
        [],
        definitions=report.definitions_used([_accept_result(["vllm.mean_acceptance_length"])], False),
    )
    lines = report.markdown_definitions(rep)
    assert Report.from_dict(rep.to_dict(), "r.json").definitions == rep.definitions  # round trip
    assert lines[0] == "## Definitions"
    assert any(
        line.startswith("| `vllm.mean_acceptance_length` | 1 + accepted draft tokens / drafts") for line in lines
    )
    assert len([line for line in lines if line.startswith("| `")]) == 3
