"""What an engine's cached results are keyed on (CaseRun.inputs_key): what that engine reads of the
case, so that the exports of one draft, each run as trained on the reference, share the reference's
captures, float64 runs and speculative runs; and anything the engine does read still separates them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import TINY_CASE

from difftest.case.case import load_case
from difftest.run.engine import EngineSpec
from difftest.run.case_run import CaseRun
from difftest.run.session import Options, Session

REF, VLLM = EngineSpec("ref"), EngineSpec("vllm")


@pytest.fixture
def session(tmp_path) -> Session:
    return Session(Options(engines=[REF], reference=REF, log_dir=tmp_path / "logs"))


def case_file(path: Path, target: Path, draft: Path, engines: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TINY_CASE.format(target=target, draft=draft) + engines)
    return path


def export_of(draft: Path, where: Path) -> Path:
    """A served export: the draft with its config's norm_output flipped."""
    import json

    shutil.copytree(draft, where)
    cfg = json.loads((where / "config.json").read_text())
    cfg["norm_output"] = not cfg.get("norm_output", False)
    (where / "config.json").write_text(json.dumps(cfg))
    return where


def key(session: Session, path: Path, spec: EngineSpec) -> list:
    return CaseRun(session.pool, load_case(path)).inputs_key(spec)


def test_a_reference_running_the_draft_as_trained_shares_the_plain_cases_key(models, session, tmp_path):
    target, draft = models
    served = export_of(draft, tmp_path / "export")
    plain = case_file(tmp_path / "plain.yaml", target, draft)
    exported = case_file(tmp_path / "exported.yaml", target, served, f"engines:\n  ref: {{draft: {draft}}}\n")
    assert key(session, exported, REF) == key(session, plain, REF)


def test_another_engines_section_does_not_change_the_references_key(models, session, tmp_path):
    target, draft = models
    plain = case_file(tmp_path / "plain.yaml", target, draft)
    overridden = case_file(
        tmp_path / "sglang.yaml",
        target,
        draft,
        "engines:\n  sglang: {draft_config_overrides: {eagle_aux_hidden_state_layer_ids: [1, 2, 3]}}\n",
    )
    assert key(session, overridden, REF) == key(session, plain, REF)


def test_the_engine_serving_the_export_keeps_its_own_key(models, session, tmp_path):
    target, draft = models
    served = export_of(draft, tmp_path / "export")
    plain = case_file(tmp_path / "plain.yaml", target, draft)
    exported = case_file(tmp_path / "exported.yaml", target, served, f"engines:\n  ref: {{draft: {draft}}}\n")
    assert key(session, exported, VLLM) != key(session, plain, VLLM)


def test_the_engines_own_section_changes_its_key(models, session, tmp_path):
    target, draft = models
    plain = case_file(tmp_path / "plain.yaml", target, draft)
    flipped = case_file(tmp_path / "flipped.yaml", target, draft, "engines:\n  ref: {norm_output: true}\n")
    assert key(session, flipped, REF) != key(session, plain, REF)


def test_the_replacing_drafts_content_changes_the_key(models, session, tmp_path):
    target, draft = models
    as_trained = tmp_path / "as-trained"
    shutil.copytree(draft, as_trained)
    path = case_file(tmp_path / "exported.yaml", target, draft, f"engines:\n  ref: {{draft: {as_trained}}}\n")
    before = key(session, path, REF)
    cfg = as_trained / "config.json"
    cfg.write_text(cfg.read_text().replace("{", '{"comment": 1, ', 1))
    assert key(Session(Options(engines=[REF], reference=REF, log_dir=tmp_path / "logs2")), path, REF) != before


def test_a_spec_parameter_naming_the_draft_replaces_the_cases_too(models, session, tmp_path):
    target, draft = models
    served = export_of(draft, tmp_path / "export")
    plain = case_file(tmp_path / "plain.yaml", target, draft)
    exported = case_file(tmp_path / "exported.yaml", target, served)
    assert key(session, exported, EngineSpec("ref", params=(("draft", str(draft)),))) != key(session, exported, REF)
    assert key(session, exported, EngineSpec("ref", params=(("draft", str(draft)),))) == key(
        session, plain, EngineSpec("ref", params=(("draft", str(draft)),))
    )


def test_an_empty_replacing_setting_keeps_the_cases_draft_in_the_key(models, session, tmp_path):
    target, draft = models
    served = export_of(draft, tmp_path / "export")
    empty = 'engines:\n  ref: {draft: ""}\n'  # `draft: ${VAR:-}` with VAR unset: not given
    a = case_file(tmp_path / "a.yaml", target, draft, empty)
    b = case_file(tmp_path / "b.yaml", target, served, empty)
    assert key(session, a, REF) != key(session, b, REF)
