"""`difftest fixtures [NAME ...]`: build every provider's fixtures, or only those named."""

from __future__ import annotations

import pytest

from difftest import cli
from difftest_fixtures import tiny_llama as fx


def test_named_fixtures_are_built_and_their_paths_printed(capsys):
    assert cli.main(["fixtures", "tiny-llama"]) == 0
    assert capsys.readouterr().out == f"[fixtures] tiny-llama: {fx.fixture_path('tiny-llama')}\n"


def test_an_unknown_fixture_name_is_one_line_and_a_usage_error(capsys):
    assert cli.main(["fixtures", "tiny-nope"]) == 4
    assert capsys.readouterr().err == "difftest fixtures: no provider knows fixture 'tiny-nope'\n"


def test_force_with_names_is_refused(capsys):
    assert cli.main(["fixtures", "--force", "tiny-llama"]) == 4
    assert capsys.readouterr().err == "difftest fixtures: --force rebuilds every fixture; give no names with it\n"


def test_providers_that_build_on_each_other_share_a_lane():
    from importlib import metadata

    from difftest.run.case_run import FIXTURE_GROUP

    lanes = cli._lanes(list(metadata.entry_points(group=FIXTURE_GROUP)))
    assert sorted(sorted(lane) for lane in lanes) == [
        ["builtin", "catalogue", "chat", "train-data"],
        ["deepseek", "mla", "published"],  # the published shapes build on the DeepSeek-V3 target
        ["real-shapes"],  # builds on nothing (and `difftest fixtures` builds none of it)
    ]


def test_a_lane_builds_its_providers_in_installed_order():
    from importlib import metadata

    from difftest.run.case_run import FIXTURE_GROUP

    names = [ep.name for ep in metadata.entry_points(group=FIXTURE_GROUP)]
    for lane in cli._lanes(list(metadata.entry_points(group=FIXTURE_GROUP))):
        assert lane == sorted(lane, key=names.index)


@pytest.mark.parametrize(
    "jobs, why", [("0", "expected 1 or more, got 0"), ("two", "expected a whole number, got 'two'")]
)
def test_a_bad_jobs_count_is_refused_in_one_line(capsys, jobs, why):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fixtures", "--jobs", jobs])
    assert exit_.value.code == 4
    assert capsys.readouterr().err == f"difftest fixtures: argument --jobs: {why} (see difftest fixtures --help)\n"


def test_the_build_queue_takes_the_lanes_in_turn_and_lists_every_fixture_once():
    from importlib import metadata

    from difftest.run.case_run import FIXTURE_GROUP

    lanes = cli._lanes(list(metadata.entry_points(group=FIXTURE_GROUP)))
    queue = cli._queue(lanes)
    lane_of = {provider: i for i, lane in enumerate(lanes) for provider in lane}
    assert len(queue) == len(set(queue))
    assert [lane_of[p] for p, _ in queue[: len(lanes)]] == list(range(len(lanes)))  # each process its own lane first
    from difftest_fixtures import catalogue as fixtures_catalogue

    assert [n for p, n in queue if p == "catalogue"] == fixtures_catalogue.NAMES  # in the provider's build order
    assert ("train-data", None) in queue  # no per-fixture command line: built whole
