"""The memory plan (difftest.run.memory_plan, in difftest.run.pool.EnginePool): each engine's resident
need is estimated from the case's checkpoints and what the engine declares; engines that all fit
stay alive for the run, engines that do not run one (or as many as fit) at a time with the same
verdicts, and an engine that cannot fit even alone is refused before it starts (exit 7). SGLang's
static memory share is computed from the weights instead of a fixed 0.3."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
from safetensors.torch import save_file
import torch

from difftest.base import exit_codes
from difftest.base.errors import ConfigError, EngineError
from difftest.case.case import Case
from difftest.records.engine_info import EngineInfo
from difftest.run import memory_plan as mp
from difftest.run.engine import EngineSpec
from difftest.run.case_run import calibration_case
from difftest.run.pool import EnginePool, Options
from difftest_engines.ref.engine import RefEngine
from difftest_engines.sglang import engine as sglang_engine
from difftest_engines.sglang.engine import SglangEngine
from difftest_engines.vllm.engine import VllmEngine
from helpers import TINY_CASE, one_line, run_pytest

REF, FAKE = EngineSpec("ref"), EngineSpec("fake", params=(("mode", "same"),))
GiB = 1 << 30


# -- the budget ---------------------------------------------------------------------------
def test_a_budget_is_a_size_with_a_unit_for_the_host_or_for_the_host_and_the_gpu():
    assert mp.parse_budget("20GB") == mp.Budget(20 * 10**9, None, mp.BUDGET_ENV)
    assert mp.parse_budget("host=1.5GiB,gpu=70GB") == mp.Budget(int(1.5 * GiB), 70 * 10**9, mp.BUDGET_ENV)


@pytest.mark.parametrize(
    "text, says",
    [
        ("22 gigs", "'22 gigs' is not a size with a unit"),
        ("22", "'22' is not a size with a unit"),
        ("cpu=2GB", "did you mean 'gpu'"),
        ("host=2GB,host=3GB", "host given twice"),
    ],
)
def test_a_malformed_budget_is_refused_in_one_line_naming_the_variable(monkeypatch, text, says):
    monkeypatch.setenv(mp.BUDGET_ENV, text)
    with pytest.raises(ConfigError) as e:
        mp.declared_budget()
    assert one_line(e).startswith(f"{mp.BUDGET_ENV}: ") and says in str(e.value)


# -- the estimates ------------------------------------------------------------------------
def test_weight_bytes_count_every_stored_tensor_at_the_dtype_the_engine_loads_it_in(tmp_path):
    save_file(
        {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16), "d2t": torch.zeros(7, dtype=torch.int64)},
        tmp_path / "model.safetensors",
    )
    assert mp.weight_bytes(tmp_path, "bfloat16") == (12 + 5) * 2 + 7 * 8
    assert mp.weight_bytes(tmp_path, "float64") == (12 + 5) * 8 + 7 * 8


def test_each_engine_declares_its_own_factors_in_its_adapter():
    ref = mp.MemoryFactors.declared("ref", RefEngine.MEMORY)
    assert ref.keeps_every_case and not ref.on_gpu
    assert mp.MemoryFactors.declared("vllm", VllmEngine.MEMORY).kv_setting == "kv_cache_space_gib"
    assert mp.MemoryFactors.declared("sglang", SglangEngine.MEMORY).kv_gb > 0
    assert mp.MemoryFactors.declared("other", None) == mp.DEFAULT_FACTORS


def test_an_unknown_or_ill_typed_factor_is_refused_in_one_line_with_the_closest_name():
    with pytest.raises(ConfigError) as e:
        mp.MemoryFactors.declared("x", {"overhed_gb": 1.0})
    assert "unknown factor 'overhed_gb'" in one_line(e) and "overhead_gb" in str(e.value)
    with pytest.raises(ConfigError, match="keeps_every_case must be a bool"):
        mp.MemoryFactors.declared("x", {"keeps_every_case": 1})


def test_the_calibrating_engine_counts_its_float64_run_beside_the_cases_dtype(tmp_path):
    save_file({"w": torch.zeros(1000)}, tmp_path / "model.safetensors")
    loads = mp.loads_for(str(tmp_path), "", "bfloat16", calibrates=True)
    assert [ld.dtype for ld in loads] == ["bfloat16", "float64"]
    assert [ld.bytes() for ld in loads] == [2000, 8000]
    assert mp.loads_for(str(tmp_path), "", "bfloat16", calibrates=False) == loads[:1]


def _streamed_pair(root: Path) -> tuple[str, str]:
    """A target of two decoder layers (100 and 60 elements), a head of 80 and a norm of 4, and a draft
    of 50 elements, all stored in bfloat16."""
    bf16 = torch.bfloat16
    (root / "t").mkdir()
    (root / "d").mkdir()
    target = {
        "model.layers.0.mlp.w": torch.zeros(60, dtype=bf16),
        "model.layers.0.attn.w": torch.zeros(40, dtype=bf16),
        "model.layers.1.mlp.w": torch.zeros(60, dtype=bf16),
        "lm_head.weight": torch.zeros(80, dtype=bf16),
        "model.norm.weight": torch.zeros(4, dtype=bf16),
    }
    save_file(target, root / "t" / "model.safetensors")
    save_file({"w": torch.zeros(50, dtype=bf16)}, root / "d" / "model.safetensors")
    return str(root / "t"), str(root / "d")


def _pair_case(tmp_path: Path, monkeypatch) -> Case:
    """A bf16 case over _streamed_pair's checkpoints (its own capture cache)."""
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / "cache"))
    target, draft = _streamed_pair(tmp_path)
    return Case(name="pair", path=str(tmp_path / "pair.yaml"), target=target, draft=draft, dtype="bfloat16")


def _reference_pool(budget_bytes: int, lines: list | None = None) -> "StubPool":
    """A pool of the reference alone under a host budget of `budget_bytes`."""
    budget = mp.Budget(budget_bytes, None, mp.BUDGET_ENV)
    progress = lines.append if lines is not None else (lambda _: None)
    return StubPool(Options(engines=[REF], reference=REF, progress=progress, memory_budget=budget))


def test_a_streamed_calibration_holds_the_targets_largest_layer_and_the_drafts_whole_copy_in_float64(tmp_path):
    target, draft = _streamed_pair(tmp_path)
    streamed = mp.MemoryFactors(calibration_streamed=True)
    assert mp.largest_part_bytes(target, "float64") == 100 * 8  # layer 0 (two tensors), not the head alone
    own, calibration = mp.loads_for(target, draft, "bfloat16", calibrates=True)
    assert mp.load_bytes(streamed, calibration) == 100 * 8 + 50 * 8
    # beside the case's own bf16 load, the float64 run reads that load: counted once, as the load
    assert mp.worker_bytes(streamed, [own, calibration]) == (244 + 50) * 2 + 100 * 8 + 50 * 8
    # a worker asked for the float64 case alone reads the checkpoint's files, memory-mapped: no load of the
    # target (the page cache is the kernel's, not the worker's)
    (alone,) = mp.loads_for(target, draft, "float64", calibrates=False, weights_dtype="bfloat16")
    assert alone == calibration
    assert mp.worker_bytes(streamed, [alone]) == 100 * 8 + 50 * 8
    # an engine that loads whole float64 copies keeps its declared share of them
    assert mp.load_bytes(mp.MemoryFactors(calibration_copies=0.5), calibration) == (244 + 50) * 8 // 2


def test_a_streamed_calibration_counts_no_float64_table_for_the_drafts_embedding(tmp_path):
    target, _ = _streamed_pair(tmp_path)
    bf16 = torch.bfloat16
    draft = tmp_path / "d-embed"
    draft.mkdir()
    save_file(
        {"embed_tokens.weight": torch.zeros(6, 5, dtype=bf16), "fc.weight": torch.zeros(20, dtype=bf16)},
        draft / "model.safetensors",
    )
    _, calibration = mp.loads_for(target, str(draft), "bfloat16", calibrates=True)
    # its rows are looked up from the case's own draft: only fc in float64 beside the target's layer 0
    assert mp.load_bytes(mp.MemoryFactors(calibration_streamed=True), calibration) == 100 * 8 + 20 * 8
    wide = tmp_path / "d-f64"
    wide.mkdir()
    save_file({"embed_tokens.weight": torch.zeros(6, 5, dtype=torch.float64)}, wide / "model.safetensors")
    assert mp.looked_up_bytes(wide, "float64") == 0  # a float32 source would round it: the whole table stays


def test_a_streamed_calibration_counts_a_head_wider_than_a_layer_at_one_layers_size(tmp_path):
    bf16 = torch.bfloat16
    save_file(
        {"model.layers.0.mlp.w": torch.zeros(100, dtype=bf16), "lm_head.weight": torch.zeros(900, dtype=bf16)},
        tmp_path / "model.safetensors",
    )
    # the head is upcast in chunks of vocabulary rows no larger than the largest layer (streamed.py)
    assert mp.largest_part_bytes(tmp_path, "float64") == 100 * 8


def test_the_reference_declares_its_float64_run_streamed():
    assert mp.MemoryFactors.declared("ref", RefEngine.MEMORY).calibration_streamed


# -- the pool under a plan (stand-in workers: what starts and closes, not what they compute) -------
class StubClient:
    def __init__(self, spec, log: list):
        self.spec, self.log = spec, log
        self.target, self.python = "stub:Stub", sys.executable
        self.proc, self.info, self.ended_with = None, None, None

    def environment(self) -> dict:
        return {}

    def start(self):
        self.log.append(("start", self.spec.id))
        self.info = EngineInfo(name=self.spec.name, version="1", versions={}, kernels="none")
        return self.info

    @property
    def started_info(self) -> EngineInfo:
        return self.info

    def close(self):
        self.log.append(("close", self.spec.id))

    kill = close


class StubPool(EnginePool):
    def __init__(self, options: Options):
        super().__init__(options)
        self.log: list = []

    def _new_client(self, spec):
        return StubClient(spec, self.log)


@pytest.fixture
def case(tmp_path, monkeypatch) -> Case:
    return two_checkpoint_case(tmp_path, monkeypatch)


def two_checkpoint_case(tmp_path, monkeypatch) -> Case:
    """A case of two 4000-byte checkpoints, the fake engine beside the reference."""
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(mp.BUDGET_ENV, raising=False)
    # tests/fake_engine.py, a reference underneath: the reference's factors
    monkeypatch.setenv("DIFFTEST_ENGINES", "fake=fake_engine:FakeEngine")
    for part in ("target", "draft"):
        (tmp_path / part).mkdir()
        save_file({"w": torch.zeros(1000)}, tmp_path / part / "model.safetensors")
    return Case(
        name="tiny", path=str(tmp_path / "tiny.yaml"), target=str(tmp_path / "target"), draft=str(tmp_path / "draft")
    )


def stub_pool(budget: str, lines: list) -> StubPool:
    options = Options(engines=[REF, FAKE], reference=REF, progress=lines.append, memory_budget=mp.parse_budget(budget))
    return StubPool(options)


def serve_case(pool: EnginePool, case: Case) -> None:
    """What a case's run asks of the pool for results not cached: the reference's, then the other engine's."""
    pool.begin_case(case.path)
    pool.client(REF, case)
    pool.client(FAKE, case)


def test_engines_that_all_fit_stay_alive_and_start_once(case):
    lines: list = []
    pool = stub_pool("10GB", lines)
    serve_case(pool, case)
    serve_case(pool, dataclasses.replace(case, path=case.path + ".2"))
    assert pool.log == [("start", "ref"), ("start", FAKE.id)]
    assert any(
        ln.startswith(
            "memory plan: ref 0.8 GB, fake[mode=same] 0.8 GB of 10.0 GB in DIFFTEST_MEMORY_BUDGET: all at once"
        )
        for ln in lines
    )


def test_engines_that_do_not_fit_together_run_one_at_a_time(case):
    lines: list = []
    pool = stub_pool("1.2GB", lines)
    serve_case(pool, case)
    assert pool.log == [("start", "ref"), ("close", "ref"), ("start", FAKE.id)]
    assert any(ln.endswith("one at a time") for ln in lines)
    assert any(ln.startswith("ref: its worker closes to free memory") for ln in lines)


def test_a_start_asked_for_without_a_case_makes_room_as_the_current_case_needs(case):
    pool = stub_pool("1.2GB", [])
    serve_case(pool, case)
    pool.client(REF)  # e.g. a cache key asking for the engine's version
    assert pool.log[-2:] == [("close", FAKE.id), ("start", "ref")]


def test_a_closed_worker_still_answers_what_it_said_of_itself_without_starting_again(case):
    pool = stub_pool("1.2GB", [])
    serve_case(pool, case)
    assert pool.info(REF).name == "ref" and pool.engine_info(REF) is not None
    assert ("start", "ref") in pool.log and pool.log.count(("start", "ref")) == 1


def test_an_engine_that_cannot_fit_even_alone_is_refused_before_it_starts_naming_what_it_needs(case):
    pool = stub_pool("500MB", [])
    pool.begin_case(case.path)
    with pytest.raises(EngineError) as e:
        pool.client(REF, case)
    message = one_line(e)
    assert message.startswith("ref: not started: the memory plan estimates it needs 0.8 GB for tiny (")
    assert "and 0.5 GB is in DIFFTEST_MEMORY_BUDGET" in message
    assert pool.log == [] and pool.start_error(REF) == message  # an engine error: exit 7


def test_a_refusal_holds_for_its_case_only(case):
    pool = stub_pool("500MB", [])
    pool.begin_case(case.path)
    with pytest.raises(EngineError):
        pool.client(REF, case)
    pool.begin_case(case.path + ".next")
    assert pool.start_error(REF) is None


def test_a_calibration_too_large_for_the_budget_is_refused_and_the_reference_keeps_serving_its_case(
    tmp_path, monkeypatch
):
    own = _pair_case(tmp_path, monkeypatch)
    # the reference's own load: 0.8 GB of overhead and 588 bytes; its float64 run adds 1200 bytes more
    pool = _reference_pool(800_001_000)
    pool.begin_case(own.path)
    pool.client(REF, own)
    with pytest.raises(EngineError, match="ref: not started: the memory plan estimates it needs 0.8 GB for pair"):
        pool.client(REF, calibration_case(own))
    pool.client(REF, own)  # the case's own items: the same worker, neither closed nor refused
    assert pool.log == [("start", "ref")] and pool.start_error(REF) is None


def test_a_calibration_that_fits_only_without_the_cases_own_load_runs_in_a_fresh_worker(tmp_path, monkeypatch):
    # the Llama-3.1-8B shape in bf16 on 24 GB: the case's load (16 GB) and the float64 run do not fit
    # together, the float64 run alone does (it reads the checkpoint's files, not a bf16 load)
    own = _pair_case(tmp_path, monkeypatch)
    # overhead 0.8 GB; the case's load 588 bytes, the float64 run 1200: together 1788, the run alone 1200
    lines: list = []
    pool = _reference_pool(800_001_500, lines)
    pool.begin_case(own.path)
    pool.client(REF, own)
    pool.client(REF, calibration_case(own))
    assert pool.log == [("start", "ref"), ("close", "ref"), ("start", "ref")]
    assert any(ln.startswith("ref: its worker closes to free memory: it holds earlier cases' models") for ln in lines)


def test_a_refused_calibration_says_it_counted_the_streamed_run_not_float64_copies(tmp_path, monkeypatch):
    own = _pair_case(tmp_path, monkeypatch)
    pool = _reference_pool(800_001_000)
    pool.begin_case(own.path)
    with pytest.raises(EngineError) as e:
        pool.client(REF, calibration_case(own))
    assert f"(the float64 run streamed from the files of {own.target} and its draft: the target's largest layer" in (
        one_line(e)
    )


def test_a_calibration_refused_while_the_reference_is_closed_does_not_refuse_the_cases_own_start(tmp_path, monkeypatch):
    # the Llama-3.1-8B shape one engine at a time: the reference's worker was closed for another engine,
    # its case-dtype results came from the cache, the float64 calibration was refused; the reference's
    # replay of the engine's tokens then errored the accept-length check with the calibration's refusal
    own = _pair_case(tmp_path, monkeypatch)
    pool = _reference_pool(800_001_000)
    pool.begin_case(own.path)
    with pytest.raises(EngineError, match="ref: not started: the memory plan estimates it needs 0.8 GB for pair"):
        pool.client(REF, calibration_case(own))
    pool.client(REF, own)
    assert pool.log == [("start", "ref")] and pool.start_error(REF) is None


def test_the_float64_calibrations_plan_counts_only_the_engine_that_calibrates(case):
    lines: list = []
    pool = stub_pool("10GB", lines)
    serve_case(pool, case)
    pool.client(REF, calibration_case(case))
    plans = [ln for ln in lines if ln.startswith("memory plan:")]
    assert len(plans) == 2 and FAKE.id in plans[0]
    assert plans[1].startswith("memory plan: ref ") and FAKE.id not in plans[1]


def test_a_malformed_budget_in_the_environment_fails_the_first_start_as_a_configuration_error(case, monkeypatch):
    monkeypatch.setenv(mp.BUDGET_ENV, "lots")
    pool = StubPool(Options(engines=[REF], reference=REF))
    with pytest.raises(ConfigError, match="DIFFTEST_MEMORY_BUDGET: 'lots' is not a size"):
        pool.client(REF, case)
    assert pool.log == []


# -- a real run under a budget (the reference and the fake engine on the tiny pair) --------------
def _project(root: Path, models) -> Path:
    (root / "cases").mkdir(parents=True)
    target, draft = models
    (root / "cases" / "tiny.yaml").write_text(TINY_CASE.format(target=target, draft=draft))
    return root


def _outcomes(run) -> dict:
    return {(r.engine, r.check): r.outcome for r in run.report("tiny").checks}


def test_one_at_a_time_gives_the_verdicts_all_at_once_gives(models, tmp_path):
    engines = "--engines=ref,fake[mode=diverge]"
    runs = {}
    for name, budget in (("all", "100GB"), ("one", "1.2GB")):
        root = _project(tmp_path / name, models)
        env = {"DIFFTEST_CACHE": str(tmp_path / name / "cache"), mp.BUDGET_ENV: budget}
        runs[name] = run_pytest(root, "cases/", engines, env=env)
    assert "all at once" in runs["all"].output and "closes to free memory" not in runs["all"].output
    assert "one at a time" in runs["one"].output and "closes to free memory" in runs["one"].output
    # each engine's results for the case are all taken while its worker runs: one start each
    assert runs["one"].output.count("[difftest] starting ref ") == 1
    assert runs["one"].output.count("[difftest] starting fake[mode=diverge] ") == 1
    assert runs["one"].returncode == runs["all"].returncode == exit_codes.REGRESSION  # the diverging engine
    assert _outcomes(runs["one"]) == _outcomes(runs["all"])


def test_a_calibration_that_fits_only_without_the_cases_load_starts_the_reference_three_times_not_at_every_request(
    models, tmp_path
):
    # the Llama-3.1-8B shape in bf16 on 24 GB, in small: the reference's bf16 load and its float64 run do
    # not fit one worker, each alone does. The float64 run goes first, the case's dtype after it: the
    # reference starts for its case (nothing loaded yet), fresh for the float64 run (reading the files),
    # fresh for the case's dtype, and no more (interleaved per prompt, the golden re-runs on the float64
    # captures switched workers at nearly every request)
    target, draft = map(str, models)
    factors = mp.MemoryFactors.declared("ref", RefEngine.MEMORY)
    own, calibration = mp.loads_for(target, draft, "bfloat16", calibrates=True)
    alone = [mp.worker_bytes(factors, [ld]) for ld in (own, calibration)]
    budget = int(factors.overhead_gb * mp.GB) + max(alone) + min(alone) // 2
    root = _project(tmp_path, models)
    (root / "cases" / "tiny.yaml").write_text(TINY_CASE.format(target=target, draft=draft) + "dtype: bfloat16\n")
    env = {"DIFFTEST_CACHE": str(tmp_path / "cache"), mp.BUDGET_ENV: f"{budget}B"}
    run = run_pytest(root, "cases/", "--engines=ref", env=env)
    assert "one at a time" in run.output and "a fresh one starts for tiny" in run.output, run.output[-3000:]
    assert run.output.count("[difftest] starting ref ") == 3, run.output[-3000:]
    assert "cannot run this case in float64" not in run.output


def _ref_run_under(budget: str, models, tmp_path: Path):
    """The tiny case on ref alone with DIFFTEST_MEMORY_BUDGET set to `budget`."""
    root = _project(tmp_path, models)
    return run_pytest(
        root, "cases/", "--engines=ref", env={"DIFFTEST_CACHE": str(tmp_path / "cache"), mp.BUDGET_ENV: budget}
    )


def test_an_engine_too_large_for_the_budget_ends_the_run_with_the_engine_exit_code(models, tmp_path):
    run = _ref_run_under("100MB", models, tmp_path)
    assert run.returncode == exit_codes.ENGINE, run.output[-2000:]
    assert "ref: not started: the memory plan estimates" in run.output and "Traceback" not in run.output


def test_a_malformed_budget_is_a_usage_error_before_any_engine_starts(models, tmp_path):
    run = _ref_run_under("lots", models, tmp_path)
    assert run.returncode == exit_codes.USAGE, run.output[-2000:]
    assert "DIFFTEST_MEMORY_BUDGET: 'lots' is not a size" in run.output and "[difftest] starting" not in run.output


# -- SGLang's static share -----------------------------------------------------------------------
# The 1.0B model SGLang could not start under the fixed 0.3 (a Llama of hidden 2048, 8 layers, vocab
# 128256, intermediate 8192, 32 heads over 8 KV heads, untied head; bf16) and an EAGLE-3 draft for it
ONE_B = {"hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 8}
ONE_B_DRAFT = {**ONE_B, "num_hidden_layers": 1}


def _one_b_params() -> tuple[int, int]:
    h, inter, vocab, kv = 2048, 8192, 128256, 512
    layer = h * h * 2 + h * kv * 2 + 3 * h * inter + 2 * h
    target = 2 * vocab * h + 8 * layer + h
    draft = 3 * h * h + (2 * h * h + 2 * h * kv * 2 + h * h + 3 * h * inter + 3 * h) + 32000 * h + h
    return target, draft


def test_the_1b_models_needed_share_is_what_the_computed_share_gives_and_the_fixed_one_did_not():
    target, draft = _one_b_params()
    assert 0.99e9 < target < 1.02e9  # the 1.0B model
    weights = (target + draft) * 2  # bf16
    # SGLang asked for a share above 0.385 = what loading took / what it saw before loading
    visible = weights / 0.385
    kv = 4096 * (
        sglang_engine.kv_bytes_per_token(ONE_B, "bfloat16") + sglang_engine.kv_bytes_per_token(ONE_B_DRAFT, "bfloat16")
    )
    share = sglang_engine.static_share(weights, kv, visible, "cpu")
    assert share > 0.385 > sglang_engine.SHARE_FLOOR["cpu"]
    # and what is left after loading holds the KV cache: SGLang's rest = after - pre * (1 - share)
    assert (visible - weights) - visible * (1 - share) >= kv


def test_a_tiny_model_keeps_the_share_used_before():
    assert sglang_engine.static_share(10_000_000, 1_000_000, 20e9, "cpu") == 0.3


def test_a_model_that_leaves_sglang_no_room_is_refused_with_what_it_needs():
    with pytest.raises(ValueError, match=r"need 11\.5 GB of the 10\.0 GB SGLang sees free"):
        sglang_engine.static_share(10 * 10**9, 0, 10e9, "cpu")


def test_kv_bytes_per_token_count_keys_and_values_per_kv_head_or_mlas_latent():
    assert sglang_engine.kv_bytes_per_token(ONE_B, "bfloat16") == 8 * 2 * 8 * 64 * 2
    mla = {"num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "hidden_size": 7168}
    assert sglang_engine.kv_bytes_per_token(mla, "bfloat16") == 2 * 576 * 2


def test_an_explicit_share_wins_over_the_computed_one(tmp_path):
    case = Case(
        name="x", path=str(tmp_path / "x.yaml"), target="t", draft="d", engines={"sglang": {"mem_fraction_static": 0.7}}
    )
    plan = SglangEngine(EngineSpec("sglang"))._settings(case)
    assert plan.requested["mem_fraction_static"] == 0.7
    assert (
        SglangEngine(EngineSpec("sglang"))
        ._settings(Case(name="x", path="x.yaml", target="t", draft="d"))
        .requested["mem_fraction_static"]
        is None
    )


def test_sglang_weight_bytes_read_the_headers(tmp_path):
    save_file({"a": torch.zeros(3, 4), "i": torch.zeros(2, dtype=torch.int64)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert sglang_engine.weight_bytes(str(tmp_path), "bfloat16") == 12 * 2 + 2 * 8


def test_sglang_starts_a_tiny_model_with_the_computed_share(models, tmp_path, sglang_python):
    """A real SGLang start (its environment, else skipped) under the share the adapter computes."""
    root = _project(tmp_path, models)
    run = run_pytest(
        root,
        "cases/",
        "--engines=ref,sglang",
        "--no-capture-cache",
        f"--engine-python=sglang={sglang_python}",
        "--engine-timeout=900",
        "-k",
        "sglang",
    )  # the user's cache (SGLang's sockets live under it: a tmp_path cache makes their paths too long)
    logs = "".join(p.read_text(errors="replace") for p in (root / "reports" / "logs").glob("*sglang*"))
    assert re.search(r"\[sglang adapter\] mem_fraction_static 0\.\d+ \(weights 0\.\d\d GB", logs), run.output[-3000:]
    assert "failed to start" not in run.output and "not started" not in run.output
    assert run.report("tiny").results("sglang"), run.output[-3000:]


def test_another_engines_bad_setting_does_not_fail_the_references_start(case):
    vllm = EngineSpec("vllm")
    pool = StubPool(Options(engines=[REF, vllm], reference=REF, memory_budget=mp.parse_budget("10GB")))
    pool.client(REF, dataclasses.replace(case, engines={"vllm": {"kv_cache_space_gib": "lots"}}))
    assert pool.log == [("start", "ref")]
