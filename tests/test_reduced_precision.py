"""An engine whose float32 matmuls run below float32 (TF32 tensor cores, a bf16 GEMM) is reported as
reduced precision, with the tensor and the size of the move, not as a divergence at the target's first
layer; a case can declare it (`precision:`) and is then judged against that precision's floor; a real
miswiring on such an engine still fails with its own cause.

The engine is the reference computing its matmuls as TF32 / bf16 do (`ref[matmul=tf32]`,
difftest_engines/ref/matmul_precision.py). On an H200 with float32 matmuls on TF32 the same tiny Llama
failed "error introduced at target.h.1 ... 128x the threshold", cos 1.0000 (docs/verdict.md)."""

from __future__ import annotations

import html
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import fixture_path, one_line

from difftest.base.errors import ConfigError
from difftest.case.case import load_case
from difftest.checks.checks import run_check
from difftest.records import CheckResult
from difftest.report import writer
from difftest.report.html_report import render as render_html
from difftest.run.case_run import CaseRun
from difftest.run.engine import parse_spec
from difftest.run.pool import EnginePool, Options
from difftest_engines.ref.matmul_precision import matmul_precision, round_mantissa


# -- the emulation rounds as the formats do ---------------------------------------------------------
def _rounded_by_hand(x: float, bits: int) -> float:
    """x to `bits` explicit mantissa bits, round half to even, from frexp (no bit tricks)."""
    if x == 0 or not math.isfinite(x):
        return x
    m, e = math.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1: bits + 1 significant bits kept
    scaled = m * 2.0 ** (bits + 1)
    return round(scaled) * 2.0 ** (e - bits - 1)  # Python's round() ties to even


def _awkward_values() -> torch.Tensor:
    """Random float32 of every scale, both signs, and values exactly halfway between two TF32 numbers."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-60, 60, (4000,), generator=g).float())
    ties = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11), 3 * (1 + 5 * 2.0**-11)])
    return torch.cat([x, ties, torch.tensor([0.0, -0.0, 1.0])]).float()


def test_tf32_emulation_rounds_every_value_to_ten_mantissa_bits_to_nearest_even():
    x = _awkward_values()
    got = round_mantissa(x, 10)
    want = torch.tensor([_rounded_by_hand(float(v), 10) for v in x], dtype=torch.float64)
    assert torch.equal(got.double(), want)
    assert float(round_mantissa(torch.tensor([1 + 2.0**-11]), 10)) == 1.0  # a tie goes to the even neighbour


def test_bf16_emulation_is_torchs_own_bfloat16_rounding():
    x = _awkward_values()
    assert torch.equal(round_mantissa(x, 7), x.to(torch.bfloat16).float())


def test_nan_and_infinities_pass_the_rounding_unchanged():
    x = torch.tensor([math.nan, math.inf, -math.inf])
    assert torch.equal(round_mantissa(x, 10).isnan(), x.isnan())
    assert round_mantissa(x, 10)[1:].tolist() == [math.inf, -math.inf]


def test_an_emulated_linear_is_the_float32_product_of_its_rounded_operands():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g), torch.randn(32, 64, generator=g)
    with matmul_precision("tf32"):
        got = F.linear(x, w)
    assert torch.equal(got, F.linear(round_mantissa(x, 10), round_mantissa(w, 10)))
    assert not torch.equal(got, F.linear(x, w))


def test_emulated_attention_rounds_the_operands_of_both_its_products():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 16, generator=g) for _ in range(3))
    with matmul_precision("tf32"):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    r = lambda t: round_mantissa(t, 10)  # noqa: E731
    scores = (r(q) @ r(k).transpose(-2, -1)) / 4.0
    scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -math.inf)
    assert torch.equal(got, r(scores.softmax(-1)) @ r(v))


def test_float64_operands_are_computed_as_they_are():
    x = torch.randn(3, 8, dtype=torch.float64)
    with matmul_precision("tf32"):
        assert torch.equal(x @ x.T, x.double() @ x.double().T)


# -- the case key ---------------------------------------------------------------------------------------
CASE_HEAD = "target: fixture:tiny-llama\ndraft: fixture:tiny-llama-eagle3\nprompts: [{ids: [1, 2, 3]}]\n"


def _case_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "case.yaml"
    path.write_text(CASE_HEAD + text)
    return path


def test_a_case_declares_the_matmul_format_an_engine_serves_it_in(tmp_path):
    case = load_case(_case_file(tmp_path, 'precision: {vllm: tf32, "ref[matmul=bf16]": bf16}\n'))
    assert case.precision == {"vllm": "tf32", "ref[matmul=bf16]": "bf16"}


def test_a_declared_precision_does_not_change_what_the_engines_capture(tmp_path):
    plain = load_case(_case_file(tmp_path, ""))
    declared = load_case(_case_file(tmp_path, "precision: {vllm: tf32}\n"))
    assert plain.fingerprint() == declared.fingerprint()


def test_an_unknown_precision_is_refused_in_one_line_naming_the_closest(tmp_path):
    path = _case_file(tmp_path, "precision: {vllm: tf23}\n")
    with pytest.raises(ConfigError) as e:
        load_case(path)
    assert one_line(e) == f"{path}: precision.vllm: expected one of tf32, bf16, got 'tf23'; did you mean 'tf32'?"


def test_an_unknown_engine_in_precision_is_refused_in_one_line_naming_the_closest(tmp_path):
    path = _case_file(tmp_path, "precision: {vlm: tf32}\n")
    with pytest.raises(ConfigError) as e:
        load_case(path)
    assert one_line(e).startswith(f"{path}: precision.vlm: unknown engine 'vlm'; did you mean 'vllm'? (known: ")


def test_a_precision_in_a_half_precision_case_is_refused(tmp_path):
    path = _case_file(tmp_path, "dtype: bfloat16\nprecision: {vllm: tf32}\n")
    with pytest.raises(ConfigError) as e:
        load_case(path)
    assert one_line(e) == (
        f"{path}: precision: declares matmul formats below float32, but the case computes in bfloat16: "
        "a precision applies to a float32 case"
    )


# -- engine-backed: the tiny Llama in float32 ------------------------------------------------------------
LLAMA_PROMPTS = (
    "prompts:\n  - ids: [331, 518, 978, 528, 666, 884, 979, 109, 909, 232, 920]\n"
    "  - ids: [640, 573, 434, 806, 590, 564, 866, 752, 799, 790, 506, 773, 795]\n"
    "speculative: {num_steps: 3, max_new_tokens: 8}\n"
)
TF32 = "ref[matmul=tf32]"


def _run(
    tmp: Path,
    name: str,
    target: str,
    draft: str,
    wiring: str,
    dtype: str,
    engines: list[str],
    extra: str = "",
    pool: EnginePool | None = None,
):
    """A case over (ref, *engines) in one pool (or `pool`, whose workers keep every case's models)."""
    path = tmp / f"{name}.yaml"
    path.write_text(f"target: {target}\ndraft: {draft}\ndtype: {dtype}\nwiring: {wiring}\n{LLAMA_PROMPTS}{extra}")
    specs = [parse_spec("ref"), *map(parse_spec, engines)]
    pool = pool or EnginePool(Options(engines=specs, reference=specs[0], log_dir=tmp / "logs"))
    return CaseRun(pool, load_case(path)), {s.id: s for s in specs}


def _checker(run: CaseRun, specs: dict):
    """check(name, engine) -> its verdict; check.report(*(name, engine)) -> the case's report of those items."""

    def check(name: str, engine: str):
        return run_check(name, run, specs[engine])

    def report(*items: tuple[str, str]):
        results = []
        for name, engine in items:
            v = check(name, engine)
            results.append(CheckResult(engine, name, "passed" if v.passed else "failed", v.message, v.data))
        return writer.build(run.record(results))

    check.report = report  # type: ignore[attr-defined]
    return check


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    run, specs = _run(
        tmp_path_factory.mktemp("llama"),
        "tf32",
        "fixture:tiny-llama",
        "fixture:tiny-llama-eagle3",
        "vllm",
        "float32",
        [TF32, "ref[matmul=bf16]"],
    )
    yield _checker(run, specs)
    run.pool.close()


@pytest.fixture(scope="module")
def declared(tmp_path_factory):
    run, specs = _run(
        tmp_path_factory.mktemp("declared"),
        "declared",
        "fixture:tiny-llama",
        "fixture:tiny-llama-eagle3",
        "vllm",
        "float32",
        [TF32, "ref[wiring=h3+h5+h6,matmul=tf32]"],
        'precision: {"ref[matmul=tf32]": tf32, "ref[wiring=h3+h5+h6,matmul=tf32]": tf32}\n',
    )
    yield _checker(run, specs)
    run.pool.close()


@pytest.mark.parametrize("check", ["fc_inputs", "draft_logits"])
def test_a_tf32_engine_on_a_float32_case_is_named_reduced_precision_not_a_first_layer_divergence(llama, check):
    v = llama(check, TF32)
    first = v.message.splitlines()[0]
    assert not v.passed  # nothing is accepted silently: the case did not declare it
    assert "error introduced at target.h.1" not in v.message
    assert first.startswith("ref[matmul=tf32]'s target computes below float32 (consistent with TF32 matmuls: rel err ")
    assert " at target.h.1, " in first and "x the float32 threshold" in first
    assert first.endswith(
        'not a wiring divergence; declare `precision: {"ref[matmul=tf32]": tf32}` in the case if this is how it serves'
    )
    assert v.data.precision == first and v.data.introduced == "target.h.1"


def test_a_bf16_gemm_engine_is_named_as_bf16(llama):
    first = llama("fc_inputs", "ref[matmul=bf16]").message.splitlines()[0]
    assert first.startswith("ref[matmul=bf16]'s target computes below float32 (consistent with bf16 matmuls: ")


def test_the_golden_rerun_of_a_tf32_draft_says_it_computes_the_reference_function(llama):
    last = llama("draft_logits", TF32).message.splitlines()[-1]
    assert last.startswith("golden inputs: on the reference's draft.fc_in, ref[matmul=tf32]'s draft moves only as TF32")
    assert last.endswith("its draft computes the reference's function, in reduced precision")


def test_the_reports_record_carries_the_finding(llama):
    data = llama("fc_inputs", TF32).data.to_dict()
    assert data["precision"].startswith("ref[matmul=tf32]'s target computes below float32")


def test_top1_and_accept_length_of_a_tf32_engine_pass_as_on_the_gpu(llama):
    assert llama("top1_agreement", TF32).passed


@pytest.mark.parametrize("check", ["fc_inputs", "draft_logits", "top1_agreement"])
def test_a_declared_precision_judges_the_engine_against_that_precisions_floor(declared, check):
    v = declared(check, TF32)
    assert v.passed, v.message
    if check != "top1_agreement":
        assert "noise floor measured: ref[matmul=tf32] in float32 vs float64 over 2 prompts" in v.message
        assert "declared precision tf32 for ref[matmul=tf32]" in v.message


def test_the_reports_floor_section_names_each_declared_precision_and_its_floor(declared):
    r = declared.report(("fc_inputs", TF32), ("fc_inputs", "ref[wiring=h3+h5+h6,matmul=tf32]"))
    shown = {d.engine: d for d in r.noise_floor.declared}
    assert set(shown) == {TF32, "ref[wiring=h3+h5+h6,matmul=tf32]"}
    assert shown[TF32].precision == "tf32" and shown[TF32].measured
    assert shown[TF32].source.startswith("measured: ref[matmul=tf32] in float32 vs float64 over 2 prompts")
    assert r.noise_floor.source.startswith("measured: ref in float32 vs float64")  # the case's own, beside them
    line = (
        "declared precision: `ref[matmul=tf32]` in tf32 (the case's `precision:`), judged against that format's "
        "floor (measured): measured: ref[matmul=tf32] in float32 vs float64 over 2 prompts"
    )
    assert any(ln.startswith(f"- {line}") for ln in writer.markdown(r).splitlines())
    assert html.escape(line) in render_html(r)


def test_the_fed_vs_trained_line_says_a_reduced_precision_engine_computes_below_float32(llama):
    line = writer.fed_line(llama.report(("fc_inputs", TF32)))
    assert "fc inputs diverge" not in line
    assert line == (
        "**Fed vs trained**: `ref[matmul=tf32]`: ref[matmul=tf32]'s target computes below float32 (consistent with "
        'TF32 matmuls); not a wiring divergence; declare `precision: {"ref[matmul=tf32]": tf32}` in the case if '
        "this is how it serves."
    )


def test_a_miswired_engine_with_a_declared_precision_still_fails_with_its_cause(declared):
    v = declared("fc_inputs", "ref[wiring=h3+h5+h6,matmul=tf32]")
    assert not v.passed
    assert "error introduced at draft.fc_in.0" in v.message.splitlines()[0]
    assert "engine fed fc [h3, h5, h6]; reference fed [h2, h4, h5]; pattern: off-by-one +1" in v.message


# -- real faults on an engine that also computes below float32: Llama, Qwen3, DeepSeek-V3 ------------------
def _qwen3_draft(out: Path) -> Path:
    """An untrained EAGLE-3 draft over the tiny Qwen3 target (no fixture trains one): ids [1, 2, 3], a
    draft vocabulary of 512 spread over the target's (a vocab map that is not the identity)."""
    from transformers import AutoModelForCausalLM

    from difftest_engines.ref.eagle3 import Eagle3Config
    from difftest_engines.ref.train import init_draft, save_eagle_format

    if (out / "config.json").exists():
        return out
    target = AutoModelForCausalLM.from_pretrained(fixture_path("tiny-qwen3"), dtype=torch.float32)
    c = target.config
    cfg = Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        draft_vocab_size=512,
        target_hidden_size=c.hidden_size,
        num_aux=3,
    )
    ids = torch.randperm(c.vocab_size, generator=torch.Generator().manual_seed(2))[:512].sort().values
    save_eagle_format(init_draft(target, cfg, ids - torch.arange(512), seed=5), out, [1, 2, 3])
    return out


# per fixture: target, draft (None: the Qwen3 draft above), trained wiring, a miswiring of it
FIXTURES = {
    "llama": (
        "fixture:tiny-llama",
        "fixture:tiny-llama-eagle3",
        "vllm",
        "h3+h5+h6",
        "[h3, h5, h6]; reference fed [h2, h4, h5]",
    ),
    "qwen3": ("fixture:tiny-qwen3", None, "vllm", "h2+h3+h4", "[h2, h3, h4]; reference fed [h1, h2, h3]"),
    "deepseek": (
        "fixture:tiny-deepseek-v3",
        "fixture:tiny-deepseek-v3-eagle3",
        "vllm",
        "h3+h5+h6",
        "[h3, h5, h6]; reference fed [h2, h4, h5]",
    ),
}
RUNS = [(f, d) for f in FIXTURES for d in ("float32", "bfloat16")]


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    """One engine pool per fixture, shared by its float32 and bfloat16 cases (a worker per spec, not per case)."""
    held: dict[str, EnginePool] = {}
    yield held, tmp_path_factory.mktemp("pool-logs")
    for pool in held.values():
        pool.close()


@pytest.fixture(scope="module", params=RUNS, ids=[f"{f}-{d}" for f, d in RUNS])
def faulty(request, tmp_path_factory, pools):
    """Each fault on an engine whose matmuls are TF32 (in a bfloat16 case they compute as bf16 anyway)."""
    name, dtype = request.param
    target, draft, wiring, miswired, fed = FIXTURES[name]
    tmp = tmp_path_factory.mktemp(f"{name}-{dtype}")
    if draft is None:
        draft = str(_qwen3_draft(tmp_path_factory.getbasetemp() / "qwen3-draft"))
    engines = {
        "wiring": f"ref[wiring={miswired},matmul=tf32]",
        "norm": "ref[norm_before_residual=true,matmul=tf32]",
        "d2t": "ref[d2t=identity,matmul=tf32]",
    }
    held, logs = pools
    if name not in held:
        specs = [parse_spec("ref"), *map(parse_spec, engines.values())]
        held[name] = EnginePool(Options(engines=specs, reference=specs[0], log_dir=logs / name))
    run, specs = _run(tmp, f"{name}_{dtype}", target, draft, wiring, dtype, list(engines.values()), pool=held[name])
    return lambda fault, check: run_check(check, run, specs[engines[fault]]), fed, engines


def _leads_with_the_fault(message: str, engine: str) -> None:
    assert message.splitlines()[0].startswith(f"{engine} diverges from ref on ")
    assert "computes below float32" not in message.splitlines()[0]


def test_another_layer_fed_to_fc_still_fails_as_a_miswiring(faulty):
    check, fed, engines = faulty
    v = check("wiring", "fc_inputs")
    assert not v.passed
    _leads_with_the_fault(v.message, engines["wiring"])
    assert "error introduced at draft.fc_in.0" in v.message.splitlines()[0]
    assert f"engine fed fc {fed}; pattern: off-by-one +1" in v.message


def test_a_flipped_norm_flag_still_fails_naming_the_flag(faulty):
    check, _, engines = faulty
    v = check("norm", "draft_logits")
    assert not v.passed
    _leads_with_the_fault(v.message, engines["norm"])
    assert "norm_before_residual handled differently" in v.message


def test_a_dropped_vocab_map_still_fails_naming_the_map(faulty):
    check, _, engines = faulty
    v = check("d2t", "draft_logits")
    assert not v.passed
    _leads_with_the_fault(v.message, engines["d2t"])
    assert "the draft-to-target vocab map (d2t) differs" in v.message
