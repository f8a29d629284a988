"""`difftest fixtures [NAME ...]`: build every provider's fixtures, or only those named."""

from __future__ import annotations

from difftest import cli
from engines.ref import fixtures as fx


def test_named_fixtures_are_built_and_their_paths_printed(capsys):
    assert cli.main(["fixtures", "tiny-llama"]) == 0
    assert capsys.readouterr().out == f"[fixtures] tiny-llama: {fx.fixture_path('tiny-llama')}\n"


def test_an_unknown_fixture_name_is_one_line_and_exit_2(capsys):
    assert cli.main(["fixtures", "tiny-nope"]) == 2
    assert capsys.readouterr().err == "difftest fixtures: no provider knows fixture 'tiny-nope'\n"


def test_force_with_names_is_refused(capsys):
    assert cli.main(["fixtures", "--force", "tiny-llama"]) == 2
    assert capsys.readouterr().err == "difftest fixtures: --force rebuilds every fixture; give no names with it\n"
