"""Golden baselines (difftest.run.baseline): `--save-baseline NAME` writes one, immutable and atomic;
`--baseline NAME` makes it the reference. Black-box through `pytest cases/` with the ref engine."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftest.records.baseline_manifest import BaselineManifest, ScatteredLogits, StoredSpec
from difftest.run.baseline import SCHEMA, BaselineSource, BaselineWriter
from difftest.base.errors import ConfigError
from helpers import ROOT, TINY_CASE, run_pytest


@pytest.fixture(scope="module")
def shared_capture_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # shared: later runs reuse the captures


def baseline_project(root: Path, models, **fmt) -> Path:
    (root / "cases").mkdir(parents=True, exist_ok=True)
    target, draft = models
    (root / "cases" / "tiny.yaml").write_text(TINY_CASE.format(target=target, draft=draft, **fmt))
    return root


def run_cases_with_cache(root: Path, shared_capture_cache: Path, *args: str):
    return run_pytest(root, "cases/", *args, env={"DIFFTEST_CACHE": str(shared_capture_cache)})


@pytest.fixture(scope="module")
def saved(models, shared_capture_cache, tmp_path_factory):
    root = baseline_project(tmp_path_factory.mktemp("saved"), models)
    result = run_cases_with_cache(root, shared_capture_cache, "--engines=ref", "--save-baseline", "v1")
    assert result.returncode == 0, result.output
    return result


def manifest(root: Path, name: str = "v1") -> BaselineManifest:
    return BaselineManifest.load(root / "baselines" / name / "manifest.json")


def manifest_json(root: Path, name: str = "v1") -> dict:
    """The file as written, for what a record's reading would recompute or drop."""
    return json.loads((root / "baselines" / name / "manifest.json").read_text())


def test_saved_baseline_manifest_records_versions_device_dtype_and_git_sha(saved):
    assert manifest_json(saved.root)["schema"] == SCHEMA
    m = manifest(saved.root)
    assert m.name == "v1"
    assert set(m.harness) == {"difftest", "python", "platform", "torch", "transformers"}
    # the harness's commit from a checkout, said plainly from a source tree without .git (an unpacked sdist)
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert m.git_sha.split()[0] == head.stdout.strip()
    else:
        assert m.git_sha == "not a git checkout"
    entry = m.cases["tiny"]
    assert len(entry.fingerprint) == 16
    assert entry.prompts == [[1, 5, 9, 33, 77, 101, 7], [4, 8, 15, 16, 23, 42]]
    ref = entry.engines["ref"]
    assert ref.info is not None
    assert (ref.device, ref.dtype, ref.info.name) == ("cpu", "float32", "ref")
    assert ref.info.version.startswith("difftest-")
    assert ref.engine == StoredSpec("ref")


def test_saved_baseline_stores_every_prompt_capture_and_the_accept_stats(saved):
    ref = manifest(saved.root).cases["tiny"].engines["ref"]
    tensors = load_file(str(saved.root / "baselines" / "v1" / ref.file))
    assert len(ref.captures) == 2
    for i, stored in enumerate(ref.captures):
        expected = [f"p{i}/{n}" + ("#columns" if n in stored.derived else "") for n in stored.tensors]
        assert sorted(k for k in tensors if k.startswith(f"p{i}/")) == sorted(expected)
        assert "draft.fc_in" in stored.tensors and "target.h.0" in stored.tensors
        assert stored.derived["draft.logits_target"] == ScatteredLogits(scatter="draft.logits", vocab=512)
    assert ref.accept.num_verify > 0
    written = manifest_json(saved.root)["cases"]["tiny"]["engines"]["ref"]["accept"]
    assert written["accept_length"] == ref.accept.num_accepted / ref.accept.num_verify + 1  # for readers of the file
    assert ref.bytes == (saved.root / "baselines" / "v1" / ref.file).stat().st_size


def test_saved_baseline_stores_each_captures_typed_meta_with_its_schema_version(saved):
    for stored in manifest_json(saved.root)["cases"]["tiny"]["engines"]["ref"]["captures"]:
        assert (stored["meta"]["schema_version"], stored["meta"]["engine"], stored["meta"]["dtype"]) == (
            2,
            "ref",
            "float32",
        )


def test_baseline_saved_before_typed_records_still_compares(saved, models, shared_capture_cache, tmp_path):
    root = baseline_project(tmp_path, models)
    shutil.copytree(saved.root / "baselines", root / "baselines")
    path = root / "baselines" / "v1" / "manifest.json"
    m = json.loads(path.read_text())
    for stored in m["cases"]["tiny"]["engines"]["ref"]["captures"]:  # as written before: untyped, adapter keys flat
        stored["meta"].pop("schema_version")
        stored["meta"]["hot_token_id_source"] = "an adapter's own key"
    path.write_text(json.dumps(m))
    result = run_cases_with_cache(root, shared_capture_cache, "--engines=ref", "--baseline", "v1")
    assert result.returncode == 0, result.output
    assert result.outcome("tiny", "ref", "fc_inputs").outcome == "passed"


def test_saved_baseline_reports_its_size(saved):
    size = sum(f.stat().st_size for f in (saved.root / "baselines" / "v1").rglob("*") if f.is_file())
    assert (
        f"baseline 'v1' written: {saved.root / 'baselines' / 'v1'} (1 case x engine entries, {size / 1024:.0f} KiB)"
        in saved.output
    )


def test_saving_leaves_no_staging_directory(saved):
    assert [p.name for p in (saved.root / "baselines").iterdir()] == ["v1"]


def test_existing_baseline_is_refused_without_force(saved, shared_capture_cache):
    before = (saved.root / "baselines" / "v1" / "manifest.json").read_bytes()
    result = run_cases_with_cache(saved.root, shared_capture_cache, "--engines=ref", "--save-baseline", "v1")
    assert result.returncode == 4  # pytest's usage error: nothing ran
    assert (
        f"ERROR: {saved.root / 'baselines' / 'v1'}: baseline 'v1' already exists and baselines are immutable; "
        "choose another name or pass --force to replace it"
    ) in result.output
    assert (saved.root / "baselines" / "v1" / "manifest.json").read_bytes() == before


def test_force_replaces_an_existing_baseline(models, shared_capture_cache, tmp_path):
    root = baseline_project(tmp_path, models)
    assert run_cases_with_cache(root, shared_capture_cache, "--engines=ref", "--save-baseline", "v1").returncode == 0
    (root / "baselines" / "v1" / "marker").write_text("from the first baseline")
    result = run_cases_with_cache(
        root, shared_capture_cache, "--engines=ref,ref@two", "--save-baseline", "v1", "--force"
    )
    assert result.returncode == 0, result.output
    assert sorted(manifest(root).cases["tiny"].engines) == ["ref", "ref@two"]
    assert not (root / "baselines" / "v1" / "marker").exists()
    assert [p.name for p in (root / "baselines").iterdir()] == ["v1"]


def test_baseline_is_not_written_when_an_engine_cannot_be_stored(models, shared_capture_cache, tmp_path):
    root = baseline_project(tmp_path, models)
    result = run_cases_with_cache(
        root, shared_capture_cache, "--engines=ref,fake[mode=unavailable]", "--save-baseline", "v2"
    )
    assert result.returncode == 7  # base/exit_codes.py::ENGINE: an engine could not start
    assert "baseline 'v2' NOT written: tiny fake[mode=unavailable]: fake: not installed" in result.output, (
        result.output[-3000:]
    )
    assert list((root / "baselines").iterdir()) == []


def test_baseline_is_the_reference_in_item_ids_and_reports(saved, shared_capture_cache):
    result = run_cases_with_cache(saved.root, shared_capture_cache, "--engines=ref", "--baseline", "v1", "-v")
    assert result.returncode == 0, result.output
    assert "cases/tiny.yaml::baseline:v1::capture PASSED" in result.output
    assert "cases/tiny.yaml::ref::fc_inputs PASSED" in result.output
    report = result.report("tiny")
    assert report.reference == "baseline:v1"
    assert report.engines["baseline:v1"].info.baseline.engines == {
        "ref": manifest(saved.root).cases["tiny"].engines["ref"].info.version
    }


def test_unchanged_engine_against_its_baseline_is_same(saved, shared_capture_cache):
    result = run_cases_with_cache(saved.root, shared_capture_cache, "--engines=ref", "--baseline", "v1")
    row = next(ln for ln in result.output.splitlines() if ln.startswith("tiny ") and " ref " in ln).split()
    assert row[:3] == ["tiny", "ref", "baseline:v1"]
    assert row[3] == row[4]  # reference and engine accept length
    assert row[5:8] == ["-", "same", str(saved.root / "reports" / "tiny.html")]


def test_miswired_engine_against_the_baseline_regresses_at_fc_chunk_0(saved, shared_capture_cache):
    result = run_cases_with_cache(saved.root, shared_capture_cache, "--engines=ref[wiring=sglang]", "--baseline", "v1")
    assert result.outcome("tiny", "ref[wiring=sglang]", "fc_inputs").data.tensor == "draft.fc_in.0"
    line = next(ln for ln in result.output.splitlines() if ln.startswith("tiny ") and "ref[wiring=sglang]" in ln)
    assert "draft.fc_in.0 (prompt 0)  regressed" in line


def test_a_failure_declared_against_the_engine_a_baseline_was_saved_from_holds_against_the_baseline(
    saved, models, shared_capture_cache, tmp_path
):
    """An upgrade check declares its expected verdicts against the old release (`reference:
    sglang@0.5.16`): they hold whether it runs in the session or was stored, and declaring them after
    the baseline was saved leaves it valid (expectations are judged, not captured)."""
    root = baseline_project(tmp_path, models)
    case = root / "cases" / "tiny.yaml"
    case.write_text(
        case.read_text() + "expect_failure:\n"
        '  - {engine: "ref[wiring=sglang]", reference: ref, check: fc_inputs, cause: "draft.fc_in.0"}\n'
    )
    shutil.copytree(saved.root / "baselines", root / "baselines")
    result = run_cases_with_cache(root, shared_capture_cache, "--engines=ref[wiring=sglang]", "--baseline", "v1")
    fc = result.outcome("tiny", "ref[wiring=sglang]", "fc_inputs")
    assert fc.outcome == "xfailed", fc.message
    assert fc.expected_failure.reference == "ref"
    top1 = result.outcome("tiny", "ref[wiring=sglang]", "top1_agreement").message
    assert top1.startswith("draft top-1 agreement with ref (baseline v1): "), top1


def test_changed_case_is_refused_against_the_baseline(saved, models, shared_capture_cache, tmp_path):
    root = baseline_project(tmp_path, models)
    case = root / "cases" / "tiny.yaml"
    case.write_text(case.read_text().replace("max_new_tokens: 8", "max_new_tokens: 9"))
    shutil.copytree(saved.root / "baselines", root / "baselines")
    result = run_cases_with_cache(root, shared_capture_cache, "--engines=ref", "--baseline", "v1")
    message = result.outcome("tiny", "baseline:v1", "capture").message
    assert message.startswith(
        f"{root / 'baselines' / 'v1' / 'manifest.json'}: case 'tiny' changed since the baseline was saved"
    )
    assert message.endswith("case settings or checkpoint contents); save a new baseline") and "\n" not in message


def test_missing_baseline_is_a_usage_error_listing_the_saved_ones(saved, shared_capture_cache):
    result = run_cases_with_cache(saved.root, shared_capture_cache, "--engines=ref", "--baseline", "v9")
    assert result.returncode == 4
    assert f"ERROR: --baseline: no baseline 'v9' in {saved.root / 'baselines'} (found: v1)" in result.output


# -- units ---------------------------------------------------------------------------------------
def test_scattered_logits_target_is_stored_as_its_columns_and_rebuilt_exactly():
    from difftest.records.scattered import scatter as _scatter
    from difftest.run.baseline import _pack

    logits = torch.randn(3, 4)
    full = torch.full((3, 9), float("-inf"))  # draft ids 0..3 are target ids 0, 2, 5, 7
    full[:, [0, 2, 5, 7]] = logits
    stored, derived = _pack({"draft.logits": logits, "draft.logits_target": full})
    assert sorted(stored) == ["draft.logits", "draft.logits_target#columns"]
    assert stored["draft.logits_target#columns"].tolist() == [0, 2, 5, 7]
    assert derived == {"draft.logits_target": ScatteredLogits(scatter="draft.logits", vocab=9)}
    assert torch.equal(_scatter(logits, stored["draft.logits_target#columns"].long(), 9), full)


def test_logits_target_that_is_not_an_exact_scatter_is_stored_as_is():
    from difftest.records.scattered import scatter as _scatter
    from difftest.run.baseline import _pack

    logits = torch.randn(3, 4)
    full = _scatter(logits, torch.tensor([0, 2, 5, 7]), 9)
    full[1, 2] += 1e-6  # an engine that rescaled or recomputed them
    stored, derived = _pack({"draft.logits": logits, "draft.logits_target": full})
    assert derived == {} and stored["draft.logits_target"] is full


def test_writer_refuses_an_existing_name(tmp_path):
    (tmp_path / "v1").mkdir()
    with pytest.raises(ConfigError, match=r"baseline 'v1' already exists and baselines are immutable"):
        BaselineWriter(tmp_path, "v1")


def test_writer_refuses_a_name_that_is_not_a_directory_name(tmp_path):
    with pytest.raises(ConfigError, match=r"^--save-baseline: baseline name '\.\./x' must be letters, digits"):
        BaselineWriter(tmp_path, "../x")


def test_baseline_with_another_schema_is_refused(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "manifest.json").write_text('{"schema": "difftest.capture/1"}')
    with pytest.raises(
        ConfigError, match=r"manifest.json: schema 'difftest.capture/1', expected 'difftest.baseline/1'$"
    ):
        BaselineSource(tmp_path, "v1")


def test_git_sha_of_a_tree_without_git_says_it_is_not_a_checkout(tmp_path):
    from difftest.report.writer import _git_sha

    (tmp_path / "difftest").mkdir()
    assert _git_sha(tmp_path) == "not a git checkout"
