"""The pre-upgrade check on real releases, as a user runs it before a bump: a golden baseline saved
on the old release (`--save-baseline`), the pinned release compared against it (`--baseline`), on the
shipped case that exhibits a behaviour change.

  SGLang 0.5.16 -> 0.5.23   crosses sgl-project/sglang#32334 (first in 0.5.17): norm_before_fc is
                            honoured. `cases/release_sglang_norm_before_fc.yaml` (a draft trained
                            with it) must fail at draft.fc_out, naming the change and the release.
  vLLM 0.24.0 -> 0.32.0     crosses vllm-project/vllm#46488 (first in 0.25.0): norm_output is
                            propagated from a speculators config. `cases/release_vllm_speculators_norm_output.yaml`
                            must fail where draft step 1 begins, naming the change; the tiny case,
                            which meets no change, must pass. The same draft trained with fc_norm
                            (`cases/release_vllm_speculators_fc_norm.yaml`) is refused by 0.24.0 at
                            load: the failure names the flag, the weights and the fix.

Each old release's session runs it against the reference (`--engines=ref,sglang@0.5.16`: what a user
of 0.5.16 gets today) and saves the baseline, and the pinned
release's session compares against the stored run (`--engines=sglang --baseline NAME:sglang@0.5.16`,
`--engines=vllm --baseline NAME`). The cases declare each release pair's expected verdicts against
the old release (`reference: sglang@0.5.16`), which hold whether it runs in the session
(`--engines=sglang@0.5.16,sglang`, tests/test_upgrade_check.py runs that form on two labels of one
install) or was stored. The environments are built by `difftest env create sglang==0.5.16` /
`vllm==0.24.0` (.ci/run builds them; vLLM 0.24.0 on PyPI's CUDA build of torch 2.11.0,
difftest_engines/vllm/releases/setup-env-0.24.0.sh). Without them the tests skip naming that command, or
fail under DIFFTEST_REQUIRE_ENGINES=1 (CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import ROOT, Run, run_pytest
from shipped_run import reference_captures

from difftest.case.case import load_case
from difftest.records.baseline_manifest import BaselineManifest
from difftest.rules.engine_releases import release
from difftest.base.paths import cache_root

OLD_SGLANG, OLD_VLLM = "0.5.16", "0.24.0"
CASE = "release_sglang_norm_before_fc"
VLLM_CASE = "release_vllm_speculators_norm_output"
FC_NORM_CASE = "release_vllm_speculators_fc_norm"
SGLANG_BASELINE, VLLM_BASELINE = f"sglang-{OLD_SGLANG}", f"vllm-{OLD_VLLM}"


def _python(engine: str, release: str) -> str:
    python = cache_root() / "envs" / f"{engine}@{release}" / "bin" / "python"
    if not python.exists():
        why = f"{engine} {release}'s environment is not built ({python}); build it with: .venv/bin/difftest env create {engine}=={release}"
        if os.environ.get("DIFFTEST_REQUIRE_ENGINES") == "1":
            pytest.fail(f"DIFFTEST_REQUIRE_ENGINES=1: {why}")
        pytest.skip(why)
    return str(python)


def _pinned(engine: str) -> str:
    python = cache_root() / "envs" / engine / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{engine}'s environment is not set up; set it up with: scripts/setup-engine {engine}")
    return str(python)


def _session(out: Path, baselines: Path, engines: str, python: dict[str, str], *args: str) -> Run:
    """`pytest ARGS --engines=ENGINES` in the project, its reports under `out`, baselines in `baselines`.
    The capture cache is shared: its keys name each engine's release (CaseRun.inputs_key), so the old
    release's results are its own, and the pinned release and the reference reuse what the shipped
    run (tests/shipped_run.py) already captured of the same cases."""
    run = run_pytest(
        ROOT,
        *args,
        f"--engines={engines}",
        *(f"--engine-python={k}={v}" for k, v in python.items()),
        "--require-engines",
        "--engine-timeout=900",
        f"--baseline-dir={baselines}",
        f"--out={out / 'reports'}",
        timeout=3000,
    )
    run.root = out  # Run.report reads root/reports
    return run


@pytest.fixture(scope="module")
def baselines(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("baselines")


@pytest.fixture(scope="module")
def sglang_old(tmp_path_factory, baselines):
    """The old release against the reference (what a user of 0.5.16 gets today), saved as a golden
    baseline in the same session: the release starts once."""
    old = f"sglang@{OLD_SGLANG}"
    return _session(
        tmp_path_factory.mktemp("sglang-old"),
        baselines,
        f"ref,{old}",
        {old: _python("sglang", OLD_SGLANG)},
        f"cases/{CASE}.yaml",
        "--save-baseline",
        SGLANG_BASELINE,
    )


@pytest.fixture(scope="module")
def sglang_bump(tmp_path_factory, baselines, sglang_old):
    """The pinned release against the stored old one (the baseline holds ref and 0.5.16: pick one).
    Its captures and speculative runs are the shipped run's (the same case on the same release):
    waiting for that run spares computing them again. SGLang still starts for the layerwise
    golden-input captures, whose input is the old release's (measured stop 37: both bumps 232 s of
    a stream before, about 100 s after)."""
    assert sglang_old.returncode == 0, sglang_old.output[-4000:]
    reference_captures()
    return _session(
        tmp_path_factory.mktemp("sglang-bump"),
        baselines,
        "sglang",
        {"sglang": _pinned("sglang")},
        f"cases/{CASE}.yaml",
        "--baseline",
        f"{SGLANG_BASELINE}:sglang@{OLD_SGLANG}",
    )


@pytest.fixture(scope="module")
def vllm_old(tmp_path_factory, baselines):
    """The old release against the reference, saved as a golden baseline in the same session
    (`--engines=ref,vllm@0.24.0 --save-baseline`)."""
    old = f"vllm@{OLD_VLLM}"
    return _session(
        tmp_path_factory.mktemp("vllm-old"),
        baselines,
        f"ref,{old}",
        {old: _python("vllm", OLD_VLLM)},
        f"cases/{VLLM_CASE}.yaml",
        "cases/tiny_llama.yaml",
        "--save-baseline",
        VLLM_BASELINE,
    )


@pytest.fixture(scope="module")
def vllm_old_fc_norm(tmp_path_factory, baselines):
    """The fc_norm draft on the old release (`--engines=ref,vllm@0.24.0`): refused at load. No baseline:
    a release that cannot load a draft has no run of it to store."""
    old = f"vllm@{OLD_VLLM}"
    return _session(
        tmp_path_factory.mktemp("vllm-old-fcnorm"),
        baselines,
        f"ref,{old}",
        {old: _python("vllm", OLD_VLLM)},
        f"cases/{FC_NORM_CASE}.yaml",
    )


@pytest.fixture(scope="module")
def vllm_bump(tmp_path_factory, baselines, vllm_old):
    """The pinned release against the stored old one (the baseline holds ref and 0.24.0: pick one):
    `--engines=vllm --baseline vllm-0.24.0:vllm@0.24.0`. Its captures and speculative runs are the
    shipped run's, as for SGLang's bump."""
    assert vllm_old.returncode == 0, vllm_old.output[-4000:]
    reference_captures()
    return _session(
        tmp_path_factory.mktemp("vllm-bump"),
        baselines,
        "vllm",
        {"vllm": _pinned("vllm")},
        f"cases/{VLLM_CASE}.yaml",
        "cases/tiny_llama.yaml",
        "--baseline",
        f"{VLLM_BASELINE}:vllm@{OLD_VLLM}",
    )


def _manifest(baselines: Path, name: str) -> BaselineManifest:
    return BaselineManifest.load(baselines / name / "manifest.json")


def test_the_old_sglang_release_is_saved_as_a_baseline_naming_its_release(sglang_old, baselines):
    assert (
        f"baseline '{SGLANG_BASELINE}' written: {baselines / SGLANG_BASELINE} (2 case x engine entries"
        in sglang_old.output
    )
    engines = _manifest(baselines, SGLANG_BASELINE).cases[CASE].engines
    assert sorted(engines) == ["ref", f"sglang@{OLD_SGLANG}"]
    info = engines[f"sglang@{OLD_SGLANG}"].info
    assert info is not None and (info.name, release(info.version)) == ("sglang", OLD_SGLANG), info


def test_the_old_vllm_release_is_saved_as_a_baseline_naming_its_release(vllm_old, baselines):
    m = _manifest(baselines, VLLM_BASELINE).cases
    assert sorted(m) == [VLLM_CASE, "tiny_llama"]
    for case in m.values():
        assert sorted(case.engines) == ["ref", f"vllm@{OLD_VLLM}"]
        info = case.engines[f"vllm@{OLD_VLLM}"].info
        assert info is not None and (info.name, release(info.version)) == ("vllm", OLD_VLLM), info


def test_the_old_release_against_the_reference_names_the_flag_it_never_reads(sglang_old):
    assert sglang_old.returncode == 0, sglang_old.output[-4000:]
    logits = sglang_old.outcome(CASE, f"sglang@{OLD_SGLANG}", "draft_logits")
    assert logits.outcome == "xfailed" and logits.data.introduced == "draft.fc_out", logits.message
    assert (
        "never reads it (sglang/srt/models/llama_eagle3.py::LlamaModel.__init__ (before sgl-project/sglang#32334))"
        in logits.message
    )
    accept = sglang_old.outcome(CASE, f"sglang@{OLD_SGLANG}", "accept_length")
    assert accept.data.engine.accept_length < accept.data.reference.accept_length - 1.0


def test_the_old_release_is_told_it_cannot_read_the_flag_and_which_releases_can(sglang_old):
    """No config edit helps a release that reads the flag from no place: the cause names the releases
    that read it (the release rules) and the draft trained without it, never "write the flag where it reads it"."""
    message = sglang_old.outcome(CASE, f"sglang@{OLD_SGLANG}", "draft_logits").message
    fix = message.split("Fix: ", 1)[1].splitlines()[0]
    assert fix.startswith(f"sglang {OLD_SGLANG} cannot read norm_before_fc (True in the draft config) from any place")
    assert "serve the draft with a release that reads it: SGLang 0.5.17 - 0.5.23" in fix
    assert fix.endswith("or train the draft without norm_before_fc")


def test_the_old_vllm_release_against_the_reference_runs_the_draft_without_norm_output(vllm_old):
    assert vllm_old.returncode == 0, vllm_old.output[-4000:]
    logits = vllm_old.outcome(VLLM_CASE, f"vllm@{OLD_VLLM}", "draft_logits")
    assert logits.outcome == "xfailed" and logits.data.introduced.startswith("draft.step1."), logits.message
    accept = vllm_old.outcome(VLLM_CASE, f"vllm@{OLD_VLLM}", "accept_length")
    assert accept.data.engine.accept_length < accept.data.reference.accept_length - 0.5
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        r = vllm_old.outcome("tiny_llama", f"vllm@{OLD_VLLM}", check)
        assert r.outcome == "passed", f"tiny_llama {check}: {r.message}"


def test_the_old_vllm_release_refuses_an_fc_norm_draft_naming_the_flag_its_weights_and_the_fix(vllm_old_fc_norm):
    assert vllm_old_fc_norm.returncode == 0, vllm_old_fc_norm.output[-4000:]
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        r = vllm_old_fc_norm.outcome(FC_NORM_CASE, f"vllm@{OLD_VLLM}", check)
        assert r.outcome == "xfailed", r.message
    message = vllm_old_fc_norm.outcome(FC_NORM_CASE, f"vllm@{OLD_VLLM}", "fc_inputs").message
    assert (
        "known cause (lint [flag-ignored]): fc_norm: True in the draft config (speculators config), but vllm 0.24.0 "
        "reads it only from top level"
    ) in message
    assert "the checkpoint's fc_norm.* weights are refused at load" in message
    assert "Fix: convert the draft to the HF EAGLE-3 layout" in message
    assert "KeyError: 'fc_norm.0.weight'" in message  # the engine's own error, beneath the cause


@pytest.mark.parametrize(
    "run_name,case,reference,engine",
    [
        ("sglang_bump", CASE, f"sglang@{OLD_SGLANG}", "sglang"),
        ("sglang_old", CASE, "ref", f"sglang@{OLD_SGLANG}"),
        ("vllm_bump", VLLM_CASE, f"vllm@{OLD_VLLM}", "vllm"),
        ("vllm_old", VLLM_CASE, "ref", f"vllm@{OLD_VLLM}"),
        ("vllm_old_fc_norm", FC_NORM_CASE, "*", f"vllm@{OLD_VLLM}"),
    ],
)
def test_every_expectation_a_case_declares_for_the_old_release_is_exercised(run_name, case, reference, engine, request):
    run = request.getfixturevalue(run_name)
    declared = [
        e
        for e in load_case(ROOT / "cases" / f"{case}.yaml").expect_failure
        if e.reference == reference and e.engine == engine
    ]
    assert declared, "the case declares what the old release does"
    checks = run.report(case).checks
    for e in declared:
        hits = [r for r in checks if (r.expected_failure.cause if r.expected_failure else None) == e.cause]
        assert hits and all(r.outcome == "xfailed" for r in hits), (e, [r.outcome for r in hits])


# The bumps last: they wait for the shipped run (reference_captures), so the old releases' sessions
# run first, while it is still being made.
def test_the_sglang_bump_is_green_with_every_change_declared(sglang_bump):
    assert sglang_bump.returncode == 0, sglang_bump.output[-4000:]
    assert sglang_bump.report(CASE).reference == f"baseline:{SGLANG_BASELINE}:sglang@{OLD_SGLANG}"


def test_the_sglang_bump_reports_the_norm_change_at_draft_fc_out_citing_the_pull_request(sglang_bump):
    logits = sglang_bump.outcome(CASE, "sglang", "draft_logits")
    assert logits.outcome == "xfailed", logits.message
    assert logits.data.introduced == "draft.fc_out", logits.message
    assert (
        "upgrade: norm_before_fc: SGLang 0.5.16 ignores it (never read); SGLang 0.5.23 takes True (top level); "
        "first moved tensor draft.fc_out"
    ) in logits.message
    assert "(sgl-project/sglang#32334, first in sglang 0.5.17)" in logits.message


def test_the_sglang_bump_feeds_the_same_layers(sglang_bump):
    fc = sglang_bump.outcome(CASE, "sglang", "fc_inputs")
    assert fc.outcome == "passed", fc.message
    assert fc.data.fed == ["target.h.2", "target.h.4", "target.h.5"]


def test_the_vllm_bump_is_green_with_every_change_declared(vllm_bump):
    assert vllm_bump.returncode == 0, vllm_bump.output[-4000:]
    assert vllm_bump.report(VLLM_CASE).reference == f"baseline:{VLLM_BASELINE}:vllm@{OLD_VLLM}"


def test_the_vllm_bump_reports_norm_output_where_it_enters_citing_the_pull_request(vllm_bump):
    logits = vllm_bump.outcome(VLLM_CASE, "vllm", "draft_logits")
    assert logits.outcome == "xfailed", logits.message
    assert logits.data.introduced.startswith("draft.step1."), logits.message
    assert (
        "upgrade: norm_output: vLLM 0.24.0 ignores it (not set where it reads); vLLM 0.32.0 takes True "
        "(speculators config)"
    ) in logits.message
    assert "(vllm-project/vllm#46488, first in vllm 0.25.0)" in logits.message
    assert vllm_bump.outcome(VLLM_CASE, "vllm", "fc_inputs").outcome == "passed"


def test_the_vllm_bump_changes_nothing_a_draft_without_those_flags_meets(vllm_bump):
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        r = vllm_bump.outcome("tiny_llama", "vllm", check)
        assert r.outcome == "passed", f"tiny_llama {check}: {r.message}"
