"""`difftest fix CASE [CASE ...] --engines NAME`: the edit that makes an engine feed what training fed,
written and then VERIFIED on the real engine (vLLM 0.32.0, SGLang 0.5.23), on the four shapes the
field meets: SGLang's off-by-one, SGLang's sort + shift on a draft trained out of layer order, a draft
with no ids at all (the default-layer fallback), and the seed's shape on a DeepSeek-V3 target (trained
on [h0, h2, h4]: SGLang's DeepSeek rule can feed it, vLLM's DeepSeek model cannot capture h0). SGLang's
three are fixed by one command and verified by one run of the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, edited_copy
from test_engine_vllm import vllm_python

from difftest.rules.layer_rules import KEY
from difftest.run.case_run import resolve_fixture


def fix_all(cases: list[Path], engine: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "difftest.cli",
            "fix",
            *map(str, cases),
            "--engines",
            engine,
            "--out",
            str(out),
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def fix(case: Path, engine: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return fix_all([case], engine, out, *extra)


def result(out: Path, case: str, engine: str) -> dict:
    return json.loads((out / "fix" / f"{case}.{engine}.fix.json").read_text())


@pytest.fixture(scope="module")
def deepseek_seed_case(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 pair declared trained on [h0, h2, h4], the seed's shape (the embedding
    first). The draft's weights were trained on [h2, h4, h5]: what is verified is the feed and that
    the engine's draft computes what the reference's does on it, not the acceptance of a good draft."""
    root = tmp_path_factory.mktemp("deepseek-seed")
    case = yaml.safe_load((ROOT / "cases" / "tiny_deepseek_v3.yaml").read_text())
    case.update(
        name="deepseek_seed",
        wiring=["h0", "h2", "h4"],
        target=resolve_fixture("fixture:tiny-deepseek-v3"),
        draft=resolve_fixture("fixture:tiny-deepseek-v3-eagle3"),
    )
    case.pop("engines", None)
    case.pop("expect", None)
    (root / "deepseek_seed.yaml").write_text(yaml.safe_dump(case, sort_keys=False))
    return root / "deepseek_seed.yaml"


@pytest.fixture(scope="module")
def sglang_fixes(tmp_path_factory, deepseek_seed_case, sglang_python) -> tuple[subprocess.CompletedProcess, Path]:
    """One `difftest fix` over SGLang's three shapes: each case's edit is computed, and all three are
    verified in one run of the engine (one SGLang session serves them, as it would a user's repo)."""
    out = tmp_path_factory.mktemp("sglang-fixes")
    cases = [
        ROOT / "cases" / "tiny_llama_sglang_default_ids.yaml",
        ROOT / "cases" / "catalogue_ids_unsorted.yaml",
        deepseek_seed_case,
    ]
    return fix_all(cases, "sglang", out, f"--engine-python=sglang={sglang_python}"), out


def test_several_cases_are_fixed_in_one_run_and_verified_by_one_engine_run(sglang_fixes):
    run, out = sglang_fixes
    assert run.returncode == 0, run.stdout + run.stderr
    verifying = [
        line for line in run.stderr.splitlines() if line.startswith("[difftest fix] verifying on the real engine")
    ]
    assert len(verifying) == 1, run.stderr
    for patched in (
        "tiny_llama_sglang_default_ids.sglang.yaml",
        "catalogue_ids_unsorted.sglang.yaml",
        "deepseek_seed.sglang.yaml",
    ):
        assert patched in verifying[0]
    assert run.stdout.count("VERIFIED on the real engine: ") == 3, run.stdout


def test_sglang_off_by_one_is_fixed_and_verified(sglang_fixes):
    run, out = sglang_fixes
    r = result(out, "tiny_llama_sglang_default_ids", "sglang")
    assert r["patch"] == {"eagle_config": {KEY: [1, 3, 4]}}
    assert r["verified"] is True, r["verification"]
    assert {c["check"]: c["outcome"] for c in r["verification"]}["accept_length"] == "passed"
    patch = json.loads((out / "fix" / "tiny_llama_sglang_default_ids.sglang.patch.json").read_text())
    assert patch == r["patch"]


def test_sglang_sort_and_shift_is_fixed_by_reordering_fc_and_verified(sglang_fixes):
    """Trained on [h5, h2, h4]: SGLang sorts and adds 1 ([h3, h5, h6]); no ids alone can feed the
    listed order, but fc.weight's input blocks moved into layer order can, with ids [1, 3, 4]."""
    run, out = sglang_fixes
    r = result(out, "catalogue_ids_unsorted", "sglang")
    assert r["fc_order"] == [1, 2, 0] and r["patch"] == {"eagle_config": {KEY: [1, 3, 4]}}
    assert "checkpoint edit: fc.weight's input blocks reordered into layer order" in run.stdout
    assert r["verified"] is True, r["verification"]


def test_seed_shape_on_deepseek_names_sglangs_ids_and_is_verified(sglang_fixes):
    run, out = sglang_fixes
    r = result(out, "deepseek_seed", "sglang")
    # DeepSeek rule: +1 only when the first id is 1, so [0, 2, 4] is read as is
    assert r["patch"] == {"eagle_config": {KEY: [0, 2, 4]}}
    assert r["verified"] is True, r["verification"]
    fc = next(c for c in r["verification"] if c["check"] == "fc_inputs")
    assert fc["outcome"] == "passed"


def test_sglang_off_by_one_is_fixed_and_verified_when_the_case_runs_sglang_at_tp2(tmp_path, sglang_python):
    """The case's `engines.sglang.tp_size: 2` travels into the patched case: the verifying run starts
    SGLang with two ranks (two scheduler processes over gloo) and every check passes there. One
    more SGLang start at TP = 2 (2-4 min on two cores): DIFFTEST_FULL_MATRIX=1. vLLM's fix at TP = 2:
    tests/test_engine_vllm_tp.py::test_difftest_fix_for_the_seed_case_is_verified_on_vllm_at_tp2."""
    if os.environ.get("DIFFTEST_FULL_MATRIX") != "1":
        pytest.skip("`difftest fix` verified on SGLang at TP = 2 (one more TP = 2 start): DIFFTEST_FULL_MATRIX=1")
    case = yaml.safe_load((ROOT / "cases" / "tiny_llama_sglang_default_ids.yaml").read_text())
    case["engines"] = {"sglang": {"tp_size": 2}}
    (tmp_path / "tp2_default_ids.yaml").write_text(yaml.safe_dump(case, sort_keys=False))
    run = fix(
        tmp_path / "tp2_default_ids.yaml",
        "sglang",
        tmp_path,
        f"--engine-python=sglang={sglang_python}",
        "--no-capture-cache",
    )  # SGLang itself runs: a capture cached by an earlier run would be reused
    assert run.returncode == 0, run.stdout + run.stderr
    r = result(tmp_path, "tp2_default_ids", "sglang")
    assert r["patch"] == {"eagle_config": {KEY: [1, 3, 4]}}
    patched = yaml.safe_load((tmp_path / "fix" / "tp2_default_ids.sglang.yaml").read_text())
    assert patched["engines"]["sglang"]["tp_size"] == 2
    assert r["verified"] is True, r["verification"]
    assert {c["check"] for c in r["verification"]} >= {"fc_inputs", "draft_logits", "top1_agreement", "accept_length"}
    log = (Path(r["verification_report"]).parent / "logs" / "sglang.log").read_text()
    assert "[sglang adapter] tp_size 2: " in log, "the verifying run did not join two ranks' records"


def test_missing_ids_fallback_is_fixed_on_vllm_and_verified(tmp_path):
    """The seed draft (trained on [h0, h2, h4]) exported with no ids: vLLM falls back to
    [h2, h4, h5]; the fix writes top-level ids [0, 2, 4]."""

    def drop_ids(cfg):
        cfg.pop(KEY, None)
        cfg.get("eagle_config", {}).pop(KEY, None)

    draft = edited_copy(
        Path(resolve_fixture("fixture:tiny-llama-eagle3-miswired")), tmp_path / "draft", config=drop_ids
    )
    case = yaml.safe_load((ROOT / "cases" / "seed_miswired_training.yaml").read_text())
    case.update(name="seed_no_ids", draft=str(draft), target=resolve_fixture("fixture:tiny-llama"))
    case.pop("engines", None)
    (tmp_path / "seed_no_ids.yaml").write_text(yaml.safe_dump(case, sort_keys=False))
    run = fix(tmp_path / "seed_no_ids.yaml", "vllm", tmp_path, f"--engine-python=vllm={vllm_python()}")
    assert run.returncode == 0, run.stdout + run.stderr
    # vLLM's default runner, Model Runner V2, reads the top level, then eagle_config.layer_ids
    assert (
        "finds no ids (top level / eagle_config.layer_ids) and falls back to [2, L//2, L-3] = [2, 4, 5]" in run.stdout
    )
    r = result(tmp_path, "seed_no_ids", "vllm")
    assert r["patch"] == {KEY: [0, 2, 4]} and r["verified"] is True, r["verification"]


def test_seed_shape_on_deepseek_is_refused_for_vllm_naming_who_can_serve_it(deepseek_seed_case, tmp_path):
    run = fix(deepseek_seed_case, "vllm", tmp_path, "--no-verify")
    assert run.returncode == 1, run.stdout + run.stderr
    assert (
        "no config fix: vLLM 0.32.0 Model Runner V2 (DeepSeek-V3 rule" in run.stdout
        and "cannot feed [h0]" in run.stdout
    )
    assert "SGLang 0.5.23 can serve it (ids [0, 2, 4] at eagle_config)" in run.stdout
    assert "to run on vLLM 0.32.0 Model Runner V2, retrain the draft on a wiring it can feed" in run.stdout


def test_an_engine_without_a_rule_model_is_one_line(tmp_path):
    run = fix(ROOT / "cases" / "tiny_llama.yaml", "ref", tmp_path, "--no-verify")
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("difftest fix: --engines ref: no layer-id rule models ref")


def test_a_missing_case_file_is_one_line(tmp_path):
    run = fix(tmp_path / "nope.yaml", "sglang", tmp_path, "--no-verify")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "nope.yaml" in run.stderr, run.stderr


def test_an_inferred_wiring_is_what_the_fix_is_computed_for_and_pinned_in_the_patched_case(tmp_path):
    """`wiring: infer` (the seed draft): the inferred [h0, h2, h4] is the training feed the fix targets."""
    run = fix(ROOT / "cases" / "seed_infer_wiring.yaml", "sglang", tmp_path, "--no-verify")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "training fed [h0, h2, h4]" in run.stdout
    patched = yaml.safe_load((tmp_path / "fix" / "seed_infer_wiring.sglang.yaml").read_text())
    assert patched["wiring"] == ["h0", "h2", "h4"]
    assert patched["engines"]["sglang"]["draft_config_overrides"]["eagle_config"] == {KEY: [-1, 1, 3]}


def test_a_bad_case_among_several_is_one_line_and_the_others_are_still_fixed(tmp_path):
    good = ROOT / "cases" / "tiny_llama_sglang_default_ids.yaml"
    run = fix_all([tmp_path / "nope.yaml", good], "sglang", tmp_path, "--no-verify")
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "nope.yaml" in run.stderr, run.stderr
    assert result(tmp_path, "tiny_llama_sglang_default_ids", "sglang")["patch"] == {"eagle_config": {KEY: [1, 3, 4]}}


def test_two_cases_of_one_name_are_refused_before_either_overwrites_the_others_files(tmp_path):
    case = ROOT / "cases" / "tiny_llama_sglang_default_ids.yaml"  # named after its file
    copy = tmp_path / "elsewhere" / case.name
    copy.parent.mkdir()
    copy.write_text(case.read_text())
    run = fix_all([case, copy], "sglang", tmp_path, "--no-verify")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip() == (
        f"difftest fix: {copy}: a case named 'tiny_llama_sglang_default_ids' "
        f"is already being fixed ({case}); one case of a name per run"
    )
    assert run.stdout.count("wrote ") == 2  # the first case's patch and patched case, once
