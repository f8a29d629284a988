"""Verdicts that hold on models the harness was not tuned on (issues 12 and 24).

Independent random-weight targets (tests/independent_models.py: Llama, Qwen3 with q/k-norm, a
DeepSeek-V3-style MLA + MoE target; seeds and shapes unlike the built-in fixtures) with
EAGLE-3 drafts fitted to the targets' continuations of the cases' prompts, at default tolerances, on real vLLM and SGLang:

* correctly wired: zero failed checks, accept length included.
* each miswired export (`independent_models.EXPORT_MISWIRES`: ids off by one, a draft trained in
  another fc order, a draft trained on the embedding, a flipped `norm_before_residual` or
  `norm_output`, no `d2t`) served by the engines while the reference runs the draft as trained:
  an engine fails where and why its rule data (difftest.rules.layer_rules, difftest.rules.draft_rules, the
  lint) says, and an engine the rules say is immune passes every check. Its accept length collapses
  where the reference, serving the export as that engine does, loses more than the gate allows
  (tests/gate_power.py: the ids and vocab exports, and the norm flags on Qwen3 float32 only).

Every case runs in ONE pytest session (`--engines=ref,vllm,sglang`), so each engine starts once per
case and the session is paid once. CI runs every cell: 3 targets x {float32, bfloat16}, correct and
miswired (stop 55; the engines' garbage-collection passes made each case's engine start cheaper, which
paid for it). `DIFFTEST_FULL_MATRIX=1` adds each miswiring as a `ref[...]` spec on the reference
(docs/verdict.md has the measured matrix; scripts/independent_matrix.py prints it as a table).
Nothing is excused: the one gap stop 55 declared (and xfailed) holds since stop 56 (the row shift,
difftest.compare.noise).
"""

from __future__ import annotations

import os

import gate_power
import independent_models as im
import pytest
import torch
from helpers import run_pytest
from test_engine_vllm import vllm_python

ENGINE_CHECKS = ("fc_inputs", "draft_logits", "top1_agreement", "accept_length")
COLLAPSES = ("accept length collapsed", "acceptance collapsed at position")
FULL = os.environ.get("DIFFTEST_FULL_MATRIX") == "1"
CELLS = [(t, d) for t in im.TARGETS for d in im.DTYPES]
# miswiring as a `ref` spec -> (tensor where the error must be introduced (prefix), words the diagnosis must contain)
EXPECTED = {
    "off_by_one": ("draft.fc_in.", "off-by-one +1"),
    "permutation": ("draft.fc_in.", "permuted order"),
    "embedding_dropped": ("draft.fc_in.0", "embedding dropped"),
    "norm_before_residual": ("draft.layer0.mlp_out", "norm_before_residual"),
    "norm_output": ("draft.step1.", "norm_output"),
    "d2t_identity": ("draft.logits_target", "(d2t)"),
}


def _tag(target: str, dtype: str) -> str:
    return im.case_name(im.TARGETS[target], dtype)


@pytest.fixture(scope="module")
def engines_run(tmp_path_factory, sglang_python):
    """One session on ref, vLLM and SGLang over every case this module judges on the engines: the
    correct cells and the miswired exports. Returns (run, miswired case name -> MiswiredCase)."""
    root = tmp_path_factory.mktemp("indep")
    im.write_cases(root / "cases", log=lambda _: None)  # every target x dtype
    exports = im.write_export_miswired_cases(root / "cases", root / "exports", log=lambda _: None)
    miswired = {c.name: c for c in exports}
    im.write_expectations(root / "expectations.json", list(miswired.values()))
    run = run_pytest(
        root,
        "cases/",
        "--engines=ref,vllm,sglang",
        f"--engine-python=vllm={vllm_python()}",
        f"--engine-python=sglang={sglang_python}",
        "--require-engines",
        "--engine-timeout=900",
        timeout=7200,
    )
    return run, miswired


@pytest.fixture(scope="module")
def correct_run(engines_run):
    return engines_run[0]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("target,dtype", CELLS)
def test_correct_wiring_passes_every_check_at_default_tolerances(correct_run, target, dtype, engine):
    case = _tag(target, dtype)
    failed = [
        f"{check}: {r.message}"
        for check in ENGINE_CHECKS
        if (r := correct_run.outcome(case, engine, check)).outcome != "passed"
    ]
    assert not failed, "\n".join(failed) + "\n" + correct_run.output[-2000:]


@pytest.mark.parametrize("target,dtype", CELLS)
def test_noise_floor_is_measured_for_every_correct_case(correct_run, target, dtype):
    floor = correct_run.report(_tag(target, dtype)).noise_floor
    assert floor.measured, floor.source
    assert floor.tensors["draft.logits"].rows > 0


@pytest.mark.parametrize("engine", im.SERVING_ENGINES)
@pytest.mark.parametrize("miswire", [m.name for m in im.EXPORT_MISWIRES])
@pytest.mark.parametrize("target,dtype", CELLS)
def test_each_miswired_export_fails_on_the_engines_where_their_rules_say(engines_run, target, dtype, miswire, engine):
    run, cases = engines_run
    case = cases[im.case_name(im.TARGETS[target], dtype, f"_x_{miswire}")]
    expect = case.expect[engine]
    results = {c: run.outcome(case.name, engine, c) for c in ENGINE_CHECKS}
    told = "\n".join(f"{c}: {r.outcome}: {r.message}" for c, r in results.items())
    if not expect.fails:  # the engine's rules say it serves the export as trained
        failed = [c for c, r in results.items() if r.outcome != "passed"]
        assert not failed, f"{case.name} on {engine}: the rules say immune ({expect.because}), yet:\n{told}"
        return
    compared = [results["fc_inputs"], results["draft_logits"]]
    first = next((r for r in compared if r.outcome == "failed"), None)
    assert first is not None, f"{case.name} on {engine} ({expect.because}) passed fc_inputs and draft_logits:\n{told}"
    assert im.introduced_in(first.data.introduced, expect.where, dtype), f"{expect.because}\n{first.message}"
    assert expect.why in first.message, f"{expect.because}\n{first.message}"


@pytest.fixture(scope="module")
def reference():
    return gate_power.Reference()


@pytest.mark.parametrize("engine", im.SERVING_ENGINES)
@pytest.mark.parametrize("miswire", [m.name for m in im.EXPORT_MISWIRES])
@pytest.mark.parametrize("target,dtype", CELLS)
def test_a_miswired_export_collapses_the_accept_length_where_the_reference_serving_it_so_does(
    engines_run, reference, target, dtype, miswire, engine
):
    # measured, not listed: the reference serves the export as this engine does and the accept gate judges
    # it against the correct draft (tests/gate_power.py). The ids and vocab exports collapse (but DeepSeek-V3
    # bf16 off_by_one as vLLM serves it); the norm flags cost these drafts 3-21%, a collapse on Qwen3 float32 only
    run, cases = engines_run
    case = cases[im.case_name(im.TARGETS[target], dtype, f"_x_{miswire}")]
    if not case.expect[engine].fails:
        pytest.skip(f"{engine} serves the export as trained ({case.expect[engine].because})")
    power = gate_power.reference_collapses(case, engine, reference)
    if not power.collapses:
        pytest.skip(f"no collapse to demand: {power.why}")
    collapse = run.outcome(case.name, engine, "accept_length")
    # the gate's collapse, on the accept length or at a draft position (difftest.compare.accept_judge.message):
    # measured on bf16 DeepSeek-V3 served by SGLang, an ids export accepting 1.23 against 1.94 stays within the
    # accept length's allowance over the engine's own 75 verify steps and collapses at position 2
    assert collapse.outcome == "failed" and collapse.message.startswith(COLLAPSES), f"{power.why}\n{collapse.message}"


@pytest.fixture(scope="module")
def miswired_runs(tmp_path_factory):
    """target -> its runs, made on first use. One session per target: every miswiring as a `ref`
    spec against the reference, in the target's dtypes (accept length left out: it needs the
    draft chain simulated per spec, and says nothing about where the error is introduced).
    Memoised by hand: an indirectly parametrised module fixture is set up again for every
    parameter combination it meets, once per miswiring instead of once per target."""
    made: dict[str, tuple] = {}

    def runs_for(target: str) -> dict:
        if target not in made:
            made[target] = _miswired(tmp_path_factory, target)
        return made[target]

    return runs_for


def _miswired(tmp_path_factory, target: str) -> dict:
    spec = im.TARGETS[target]
    dtypes = list(im.DTYPES)
    root = tmp_path_factory.mktemp(f"miswired-{target}")
    im.write_cases(root / "cases", names=[target], dtypes=dtypes, log=lambda _: None)
    engines = ["ref"] + [m.engine_spec(spec) for m in im.MISWIRES if not m.case_suffix]
    run = run_pytest(root, "cases/", f"--engines={','.join(engines)}", "-k", "not accept_length", timeout=3600)
    h0 = root / "h0"
    im.write_miswired_cases(h0 / "cases", names=[target], dtypes=dtypes, log=lambda _: None)
    dropped = next(m for m in im.MISWIRES if m.case_suffix)
    h0_run = run_pytest(
        h0, "cases/", f"--engines=ref,{dropped.engine_spec(spec)}", "-k", "not accept_length", timeout=3600
    )
    return {m.name: (h0_run if m.case_suffix else run, m) for m in im.MISWIRES}


@pytest.mark.skipif(
    not FULL, reason="CI runs the miswirings as exports on the engines; as ref specs: DIFFTEST_FULL_MATRIX=1"
)
@pytest.mark.parametrize("miswire", sorted(EXPECTED))
@pytest.mark.parametrize("target,dtype", CELLS)
def test_each_miswiring_as_a_reference_spec_fails_naming_where_and_why(miswired_runs, target, dtype, miswire):
    run, m = miswired_runs(target)[miswire]
    spec = im.TARGETS[target]
    case, engine = m.case_name(spec, dtype), m.engine_spec(spec)
    where, why = EXPECTED[miswire]
    results = {c: run.outcome(case, engine, c) for c in ("fc_inputs", "draft_logits", "top1_agreement")}
    failing = [r for r in results.values() if r.outcome == "failed"]
    assert failing, f"{miswire} on {case} passed every check:\n" + "\n".join(r.message for r in results.values())
    first = next(r for r in (results["fc_inputs"], results["draft_logits"]) if r.outcome == "failed")
    assert im.introduced_in(first.data.introduced, where, dtype), first.message
    assert why in first.message, first.message


# -- the drafts each dtype's cases serve (independent_models.FITTED_DTYPES) -------------------------


def test_bf16_cases_serve_drafts_fitted_to_the_bf16_rounded_target(tmp_path):
    built = im.ensure_model("indep-llama", log=lambda _: None)
    cases = {c.dtype: c.path.read_text() for c in im.write_cases(tmp_path, names=["indep-llama"], log=lambda _: None)}
    fitted = built.fitted_for("bfloat16")
    assert f"draft: {fitted.draft}\n" in cases["bfloat16"]
    assert f"draft: {built.draft}\n" in cases["float32"]
    assert fitted.draft != built.draft


def test_dtype_fitted_drafts_ship_the_targets_float32_embedding():
    # the fit runs on the rounded target; a draft shipping that rounded embedding is one the lint refuses
    # ([embedding-substituted]: SGLang serves the target's), though both round to the same bf16 rows
    from safetensors.torch import load_file

    built = im.ensure_model("indep-llama", log=lambda _: None)
    target = load_file(str(built.target / "model.safetensors"))["model.embed_tokens.weight"]
    for d in (built.fitted_for("bfloat16").draft, built.fitted_for("bfloat16").draft_h0):
        assert torch.equal(load_file(str(d / "model.safetensors"))["embed_tokens.weight"], target)


def test_the_bf16_fitted_draft_accepts_more_on_the_bf16_target_than_the_float32_fit():
    # measured: 3.519 against 2.556 (float32 fit), the float32 cell's 3.593 (docs/verdict.md)
    from difftest_engines.ref.draft_loading import load_draft
    from difftest_engines.ref.speculate import simulate_greedy
    from difftest_engines.ref.target import load_target

    built = im.ensure_model("indep-llama", log=lambda _: None)
    target = load_target(str(built.target), torch.bfloat16)
    _, prompts = im.prompts(built.spec)
    wiring = [f"target.h.{k}" for k in built.spec.trained]

    def accept(draft_dir):
        draft = load_draft(
            str(draft_dir),
            target_embed=target.get_input_embeddings().weight.detach(),
            target_lm_head=target.get_output_embeddings().weight.detach(),
            dtype=torch.bfloat16,
        ).model
        return simulate_greedy(target, draft, wiring, prompts, 3, 16)[0].accept_length

    fitted, unfitted = accept(built.fitted_for("bfloat16").draft), accept(built.draft)
    assert fitted > unfitted + 0.5, (fitted, unfitted)


# -- where a flag acting from a later draft step may first show (independent_models.introduced_in) ---


def test_a_flag_acting_from_step_1_shows_in_step_1_or_in_the_state_carried_into_it():
    where = "draft.step1.fc_out"  # norm_output (difftest.rules.draft_rules.FLAG_TENSORS)
    for dtype in ("float32", "bfloat16"):
        assert im.introduced_in("draft.step1.layer0.attn_in", where, dtype)
        assert im.introduced_in("draft.hidden_prenorm", where, dtype)
        assert not im.introduced_in("draft.layer0.mlp_out", where, dtype)
        assert not im.introduced_in("draft.fc_in.0", where, dtype)
        assert not im.introduced_in("target.h.3", where, dtype)


def test_a_flag_acting_from_step_1_may_first_show_at_a_later_step_in_bf16_only():
    # bf16: the flip's direct effect on step 1 is under the noise threshold (1.8-10.2x the floor, SAFETY
    # 10); it is measurable where step 2 compounds it (docs/verdict.md, "Measured at stop 53")
    where = "draft.step1.fc_out"
    assert im.introduced_in("draft.step2.layer0.mlp_out", where, "bfloat16")
    assert not im.introduced_in("draft.step2.layer0.mlp_out", where, "float32")


def test_a_flag_on_the_residual_stream_is_introduced_at_the_mlp_output_in_every_dtype():
    where = "draft.layer0.mlp_out"  # norm_before_residual (difftest.rules.draft_rules.FLAG_TENSORS)
    for dtype in ("float32", "bfloat16"):
        assert im.introduced_in("draft.layer0.mlp_out", where, dtype)
        assert not im.introduced_in("draft.hidden_prenorm", where, dtype)
        assert not im.introduced_in("draft.layer0.attn_out", where, dtype)
        assert not im.introduced_in("draft.step2.hidden_prenorm", where, dtype)
