"""`difftest probe` against REAL SGLang 0.5.23 and vLLM 0.32.0 servers started with tensor
parallelism 2 on CPU (two ranks over gloo: `--tp-size 2`, `--tensor-parallel-size 2`), judged
against the same server at TP = 1: the same tokens, the same acceptance, the same prediction and
the same verdict. engines/{sglang,vllm}/serve.py give each rank its cores on a one-NUMA-node
machine (SGLANG_CPU_OMP_THREADS_BIND split, VLLM_CPU_OMP_THREADS_BIND=nobind).

Four server starts (each engine at TP = 1 then TP = 2, one at a time, each stopped before the
next), about 1-2.5 min each on two cores: DIFFTEST_FULL_MATRIX=1 only. The default suite keeps
the cheap parts (the TP arguments read, the cores split, the TP flag) in tests/test_probe_servers.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import live_servers
from tests.test_probe_servers import CPU_SGLANG, _case, _checkpoints, _probe

FULL = os.environ.get("DIFFTEST_FULL_MATRIX") == "1"
pytestmark = pytest.mark.skipif(
    not FULL, reason="four live-server starts at TP = 1 and 2 (minutes): DIFFTEST_FULL_MATRIX=1"
)


@dataclass
class Probed:
    tp: int
    returncode: int
    stdout: str
    started_s: float  # launch to healthy
    probe_s: float  # the whole `difftest probe` run, reference included
    accept: dict  # the report's accept_length item


def _serve_and_probe(
    request,
    out: Path,
    kind: str,
    tp: int,
    args: list[str],
    case: Path,
    env: dict | None = None,
    probe_args: tuple[str, ...] = (),
) -> Probed:
    log = Path(request.config.rootpath) / "reports" / "logs" / f"live-{kind}-tp{tp}.log"
    server = live_servers.start(kind, args, log, env)
    try:
        run = _probe("--server", server.url, "--case", str(case), "--out", str(out), *probe_args)
    finally:
        left = server.stop()
    assert not left, f"{kind} TP = {tp}: processes left after stopping the server's process group: {left}"
    report = json.loads((out / "tiny_llama_probe.json").read_text())
    accept = next(c for c in report["checks"] if c["engine"].startswith("server") and c["check"] == "accept_length")
    print(
        f"[probe tp] {kind} TP = {tp}: healthy after {server.started_s:.1f}s, probe {run.seconds:.1f}s, "
        f"server AL {accept['data']['engine']['accept_length']:.3f}, predicted "
        f"{accept['data']['reference']['accept_length']:.3f}, outcome {accept['outcome']}"
    )
    return Probed(tp, run.returncode, run.stdout + run.stderr, server.started_s, run.seconds, accept)


@pytest.fixture(scope="module")
def probe_case(tmp_path_factory) -> Path:
    return _case(tmp_path_factory.mktemp("probe-tp"), 3, 24)


@pytest.fixture(scope="module")
def sglang_tp(request, tmp_path_factory, probe_case) -> dict[int, Probed]:
    target, draft = _checkpoints(sglang_ids=True)
    args = [
        "--model-path",
        target,
        "--speculative-draft-model-path",
        draft,
        *CPU_SGLANG,
        "--speculative-eagle-topk",
        "1",
    ]
    return {
        tp: _serve_and_probe(
            request, tmp_path_factory.mktemp(f"sglang-tp{tp}"), "sglang", tp, [*args, "--tp-size", str(tp)], probe_case
        )
        for tp in (1, 2)
    }


@pytest.fixture(scope="module")
def vllm_tp(request, tmp_path_factory, probe_case) -> dict[int, Probed]:
    target, draft = _checkpoints(sglang_ids=False)
    spec = json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": 4})
    args = [
        "--model",
        target,
        "--speculative-config",
        spec,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--skip-tokenizer-init",
        "--seed",
        "0",
        "--no-enable-prefix-caching",
    ]
    return {
        tp: _serve_and_probe(
            request,
            tmp_path_factory.mktemp(f"vllm-tp{tp}"),
            "vllm",
            tp,
            [*args, "--tensor-parallel-size", str(tp)],
            probe_case,
            {"VLLM_SERVER_DEV_MODE": "1"},
            ("--kind", "vllm"),
        )
        for tp in (1, 2)
    }


def _same_at_tp2(runs: dict[int, Probed]) -> None:
    one, two = runs[1], runs[2]
    assert one.returncode == 0, one.stdout
    assert two.returncode == 0, two.stdout
    assert (one.accept["outcome"], two.accept["outcome"]) == ("passed", "passed")
    assert one.accept["data"]["server_settings"]["tp"] == 1
    assert two.accept["data"]["server_settings"]["tp"] == 2
    assert f"tp {two.tp}" in two.stdout  # the server line names the parallelism probed
    for i, (a, b) in enumerate(zip(one.accept["data"]["per_request"], two.accept["data"]["per_request"], strict=True)):
        assert b["server"]["output"] == a["server"]["output"], f"request {i}: TP = 2 generated other tokens"
        for key in ("num_verify", "num_accepted", "accepted_per_pos"):
            assert b["server"][key] == a["server"][key], f"request {i}: {key} at TP = 2 vs TP = 1"
            assert b["predicted"][key] == a["predicted"][key], f"request {i}: predicted {key} at TP = 2 vs TP = 1"
        assert b["server"]["accepted_per_pos"] == b["predicted"]["accepted_per_pos"]


def test_sglang_server_at_tp2_accepts_and_is_judged_as_at_tp1(sglang_tp):
    _same_at_tp2(sglang_tp)
    assert "numbers: exact" in sglang_tp[2].stdout


def test_vllm_server_at_tp2_accepts_and_is_judged_as_at_tp1(vllm_tp):
    _same_at_tp2(vllm_tp)
    assert vllm_tp[2].accept["data"]["server_settings"]["details"]["tensor_parallel_size"] == 2
