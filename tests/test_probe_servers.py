"""`difftest probe` and `server[url=...]` against REAL SGLang 0.5.23 and vLLM 0.32.0 HTTP servers
on CPU (tests/live_servers.py), each started once and stopped when this module ends:

  sglang_server   the tiny Llama draft under SGLang's id convention, topk 1 with num_draft_tokens 16
                  asked for (SGLang runs num_steps + 1): prediction met, the override reported
  sglang_miswired the same draft unmodified: SGLang's +1 feeds [h3, h5, h6] (the draft was trained
                  on [h2, h4, h5]): the accept length collapses, seen from outside
  vllm_server     the tiny Llama draft as vLLM reads it: prediction met; acceptance from /metrics deltas

The probed cases are tiny_llama.yaml with 3 of its 12 speculative prompts x 24 tokens, or 2 x 16
(each prompt is a real request to a CPU server). Bad input (unreachable URL, timeout, no speculative decoding, another
model) must give one line naming the cause, never a hang.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from difftest.rules.overlay import overlay_checkpoint
from difftest_engines.server.command import PROBE_CHECK, SERVER_ENGINE, ensure_server_engine
from difftest_engines.server.client import counters, parse_launch_command, parse_prometheus
from difftest.base.paths import cache_root
from difftest.run.case_run import resolve_fixture
from tests import live_servers
from tests.helpers import run_pytest

ROOT = Path(__file__).resolve().parent.parent
SGLANG_IDS = {
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]},
    "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
}
CPU_SGLANG = [
    "--device",
    "cpu",
    "--attention-backend",
    "intel_amx",
    "--disable-cuda-graph",
    "--skip-tokenizer-init",
    "--mem-fraction-static",
    "0.3",
    "--max-total-tokens",
    "4096",
    "--dtype",
    "float32",
    "--random-seed",
    "0",
    "--disable-overlap-schedule",
    "--speculative-algorithm",
    "EAGLE3",
    "--speculative-num-steps",
    "4",
    "--sleep-on-idle",
]  # (the scheduler busy-polls between requests otherwise: difftest_engines/sglang/engine.py)


def _probe(*args: str, timeout: float = 900):
    """`difftest probe ...` in a fresh process, as a user runs it."""
    ensure_server_engine()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "difftest.cli", "probe", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    run.seconds = time.monotonic() - t
    return run


def _case(directory: Path, prompts: int, max_new_tokens: int) -> Path:
    """tiny_llama.yaml with fewer speculative prompts (each is a real request to a CPU server), in a
    folder named cases (the plugin collects only those)."""
    case = yaml.safe_load((ROOT / "cases" / "tiny_llama.yaml").read_text())
    case["speculative"]["prompts"] = case["speculative"]["prompts"][:prompts]
    case["speculative"]["max_new_tokens"] = max_new_tokens
    case["engines"]["sglang"]["speculative_num_draft_tokens"] = 16  # what the deployment asked for
    path = directory / "cases" / "tiny_llama_probe.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(case, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def probe_case(tmp_path_factory) -> Path:
    return _case(tmp_path_factory.mktemp("probe"), 3, 24)


@pytest.fixture(scope="session")
def small_case(tmp_path_factory) -> Path:
    """2 prompts x 16 tokens: a collapsed draft verifies after nearly every token, ~30 verifies tell 1.1 from 3.9."""
    return _case(tmp_path_factory.mktemp("probe-small"), 2, 16)


def _checkpoints(sglang_ids: bool) -> tuple[str, str]:
    target, draft = resolve_fixture("tiny-llama"), resolve_fixture("tiny-llama-eagle3")
    if sglang_ids:
        draft = str(overlay_checkpoint(draft, SGLANG_IDS, cache_root() / "sglang"))
    return target, draft


def _serve(request, name: str, kind: str, args: list[str], env: dict | None = None):
    log = Path(request.config.rootpath) / "reports" / "logs" / f"live-{name}.log"
    server = live_servers.start(kind, args, log, env)
    yield server
    left = server.stop()
    assert not left, f"{name}: processes left after stopping the server's process group: {left}"


@pytest.fixture(scope="module")  # stopped after this module: never alive beside later tests
def sglang_server(request):
    target, draft = _checkpoints(sglang_ids=True)
    yield from _serve(
        request,
        "sglang",
        "sglang",
        [
            "--model-path",
            target,
            "--speculative-draft-model-path",
            draft,
            *CPU_SGLANG,
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "16",
        ],
    )


@pytest.fixture(scope="module")  # stopped after this module: never alive beside later tests
def sglang_miswired(request):
    target, draft = _checkpoints(sglang_ids=False)
    yield from _serve(
        request,
        "sglang-miswired",
        "sglang",
        ["--model-path", target, "--speculative-draft-model-path", draft, *CPU_SGLANG, "--speculative-eagle-topk", "1"],
    )


@pytest.fixture(scope="module")  # stopped after this module: never alive beside later tests
def vllm_server(request):
    target, draft = _checkpoints(sglang_ids=False)
    spec = json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": 4})
    yield from _serve(
        request,
        "vllm",
        "vllm",
        [
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
        ],
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )


def _report(report_dir: Path) -> dict:
    return {
        (c["engine"].split("[")[0], c["check"]): c
        for c in json.loads((report_dir / "tiny_llama_probe.json").read_text())["checks"]
    }


# -- real servers ---------------------------------------------------------------------------


def test_sglang_probe_meets_the_prediction_and_reports_the_topk1_override(sglang_server, probe_case, tmp_path):
    run = _probe("--server", sglang_server.url, "--case", str(probe_case), "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASS: the deployment accepts what the reference predicts" in run.stdout
    assert "flag: topk 1 forces num_draft_tokens = 5 (num_steps + 1); 16 configured" in run.stdout
    assert "numbers: exact" in run.stdout
    checks = _report(tmp_path)
    al = checks[("server", "accept_length")]
    assert al["outcome"] == "passed"
    assert al["data"]["server_settings"]["num_draft_tokens"] == 5
    assert al["data"]["server_settings"]["launch"]["speculative_num_draft_tokens"] == "16"
    # SGLang's per-request counters and the replay agree request by request on these tokens
    for r in al["data"]["per_request"]:
        assert r["server"]["num_verify"] == r["predicted"]["num_verify"]
        assert r["server"]["accepted_per_pos"] == r["predicted"]["accepted_per_pos"]
    for name in ("fc_inputs", "draft_logits", "top1_agreement"):
        assert checks[("server", name)]["outcome"] == "not available"
    assert (tmp_path / "tiny_llama_probe.html").exists()


def test_sglang_miswired_draft_collapse_is_detected_from_outside(sglang_miswired, small_case, tmp_path):
    run = _probe("--server", sglang_miswired.url, "--case", str(small_case), "--out", str(tmp_path))
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.startswith("accept length collapsed: ")
    assert "FAIL: the deployment accepts less than the reference predicts" in run.stdout
    al = _report(tmp_path)[("server", "accept_length")]["data"]
    assert al["engine"]["accept_length"] < al["reference"]["accept_length"] - al["allowed"]


def test_vllm_probe_meets_the_prediction_from_metrics_deltas(vllm_server, probe_case, tmp_path):
    run = _probe("--server", vllm_server.url, "--case", str(probe_case), "--kind", "vllm", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "numbers: deltas: vLLM /metrics counters" in run.stdout
    al = _report(tmp_path)[("server", "accept_length")]
    settings = al["data"]["server_settings"]
    assert settings["num_steps"] == 4 and settings["draft_model"] == resolve_fixture("tiny-llama-eagle3")
    for r in al["data"]["per_request"]:
        assert r["numbers"] == "delta" and not r["server"]["contaminated"]
        assert r["server"]["accepted_per_pos"] == r["predicted"]["accepted_per_pos"]


def test_server_spec_stands_beside_other_engines_in_a_pytest_run(sglang_server, small_case, tmp_path):
    engines = f"fake=fake_engine:FakeEngine;server={SERVER_ENGINE}"  # registered whatever the installed metadata says
    run = run_pytest(
        small_case.parent.parent,
        f"cases/{small_case.name}",
        f"--engines=ref,server[url={sglang_server.url},kind=sglang]",
        f"--out={tmp_path}",
        "-k",
        "accept_length or fc_inputs",
        env={"DIFFTEST_ENGINES": engines, "DIFFTEST_CHECKS": f"server_accept_length={PROBE_CHECK}"},
        timeout=900,
    )
    checks = _report(tmp_path)
    assert checks[("server", "accept_length")]["outcome"] == "passed", run.output[-3000:]
    assert checks[("server", "fc_inputs")]["outcome"] == "not available"
    assert "not available for server" in run.output


def test_a_server_serving_another_model_is_refused_in_one_line(sglang_server, small_case, tmp_path):
    run = _probe(
        "--server",
        sglang_server.url,
        "--case",
        str(small_case),
        "--model",
        "/models/other-model",
        "--out",
        str(tmp_path),
    )
    assert run.returncode == 2
    err = run.stderr.strip().splitlines()[-1]
    assert err.startswith("difftest probe: ") and "serves model" in err and "other-model" in err
    assert "Traceback" not in run.stderr


# -- bad input without a server --------------------------------------------------------------


def test_an_unreachable_server_is_named_in_one_line(probe_case, tmp_path):
    url = f"http://127.0.0.1:{live_servers.free_port()}"
    run = _probe("--server", url, "--case", str(probe_case), "--out", str(tmp_path), timeout=120)
    assert run.returncode == 2
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("difftest probe: ") and f"{url}: cannot reach the server" in line
    assert "Traceback" not in run.stderr


class _Stub(http.server.BaseHTTPRequestHandler):
    """An HTTP endpoint that is not a speculative server: SGLang's info routes with no speculative
    algorithm, or (path /slow) an answer that never comes in time."""

    delay = 0.0

    def do_GET(self):
        time.sleep(self.delay)
        if self.path in ("/get_model_info", "/server_info"):
            body = json.dumps({"model_path": "x", "speculative_algorithm": None}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except BrokenPipeError:  # the probe gave up first (the timeout test)
                pass
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


def _stub(delay: float):
    handler = type("Handler", (_Stub,), {"delay": delay})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_server_without_speculative_decoding_is_named_in_one_line(probe_case, tmp_path):
    stub = _stub(0.0)
    try:
        run = _probe(
            "--server",
            f"http://127.0.0.1:{stub.server_address[1]}",
            "--case",
            str(probe_case),
            "--out",
            str(tmp_path),
            timeout=120,
        )
    finally:
        stub.shutdown()
    assert run.returncode == 2
    assert "runs no speculative decoding" in run.stderr.strip().splitlines()[-1]


def test_a_server_that_does_not_answer_in_time_is_a_timeout_not_a_hang(probe_case, tmp_path):
    stub = _stub(5.0)
    try:
        run = _probe(
            "--server",
            f"http://127.0.0.1:{stub.server_address[1]}",
            "--case",
            str(probe_case),
            "--kind",
            "sglang",
            "--timeout",
            "1",
            "--out",
            str(tmp_path),
            timeout=120,
        )
    finally:
        stub.shutdown()
    assert run.returncode == 2
    assert "no answer within 1s (timeout)" in run.stderr.strip().splitlines()[-1]


# -- the pieces ------------------------------------------------------------------------------

VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 8.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 23.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_prometheus_counters_are_summed_over_engines_per_position():
    c = counters(parse_prometheus(VLLM_METRICS))
    assert c["vllm:spec_decode_num_drafts"] == 8.0  # the _created sample is not a count
    assert c["vllm:spec_decode_num_accepted_tokens_per_pos[0]"] == 7.0
    assert c["vllm:spec_decode_num_accepted_tokens_per_pos[1]"] == 7.0
    assert c["vllm:num_requests_running"] == 0.0


def test_launch_command_gives_what_was_asked_for():
    asked = parse_launch_command(
        "python -m sglang.launch_server --speculative-num-draft-tokens 16 --disable-cuda-graph --tp=8"
    )
    assert asked == {"speculative_num_draft_tokens": "16", "disable_cuda_graph": "true", "tp": "8"}


def test_vllm_deltas_touched_by_a_concurrent_request_are_flagged(vllm_server):
    from difftest_engines.server.client import ServerClient

    def running() -> float:
        return ServerClient(vllm_server.url, "vllm")._vllm_snapshot().get("vllm:num_requests_running", 0.0)

    prompt = [574, 554, 303, 298, 472, 148, 901, 664]
    other = threading.Thread(target=lambda: ServerClient(vllm_server.url, "vllm").generate(prompt, 500, 4))
    other.start()
    # mine starts while the other client's request runs: seen running by the server, not slept for (a
    # fixed wait let it finish first on a quiet machine, or not yet start on a loaded one)
    deadline = time.monotonic() + 120
    while not running():
        assert other.is_alive() and time.monotonic() < deadline, "the other request never ran"
        time.sleep(0.02)
    mine = ServerClient(vllm_server.url, "vllm").generate(prompt, 8, 4)
    other.join()
    assert not mine.exact
    assert mine.contaminated  # running before it, or counters moved by more than this request


# -- tensor parallelism (the live TP = 2 servers: tests/test_probe_servers_tp.py, DIFFTEST_FULL_MATRIX=1)


def test_a_servers_tp_size_is_read_from_its_arguments_as_argparse_keeps_it():
    from difftest_engines.launch_args import int_option
    from difftest_engines.sglang.serve import TP_OPTIONS as SGLANG_TP
    from difftest_engines.vllm.serve import TP_OPTIONS as VLLM_TP

    assert int_option(["--model-path", "m", "--tp-size", "2"], SGLANG_TP, 1) == 2
    assert int_option(["--tensor-parallel-size=4"], SGLANG_TP, 1) == 4
    assert int_option(["-tp", "2", "--tensor-parallel-size", "8"], VLLM_TP, 1) == 8  # the last one wins
    assert int_option(["--model", "m"], VLLM_TP, 1) == 1
    assert int_option(["--tp-size", "two"], SGLANG_TP, 1) == 1  # left to the server to refuse


def test_sglang_cpu_ranks_get_their_own_cores_where_there_are_enough(monkeypatch):
    from difftest_engines.sglang import cpu_ranks

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cpu_ranks.core_groups(2) == "0|1"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert cpu_ranks.core_groups(2) == "0-3|4-7"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert cpu_ranks.core_groups(2) == "0|0"  # one core: shared


def _unset_for_this_test(monkeypatch, name: str) -> None:
    """Unset `name` and restore its value afterwards, including the value set by the code under test:
    monkeypatch.delenv on an absent variable records nothing, so a binding the code sets would
    outlive the test and reach every later engine in the worker (a TP-1 SGLang then refuses it)."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


def test_an_sglang_server_at_tp2_on_cpu_binds_its_ranks_and_keeps_a_users_binding(monkeypatch):
    from difftest_engines.sglang import cpu_ranks, cpu_shim, serve

    _unset_for_this_test(monkeypatch, cpu_ranks.BIND_ENV)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert serve.bind_ranks(["--device", "cpu", "--tp-size", "1"], cpu_shim.CPU_SHIM) is None
    assert serve.bind_ranks(["--device", "cuda", "--tp-size", "2"], "sgl_kernel") is None  # a GPU server: untouched
    assert serve.bind_ranks(["--device", "cpu", "--tp-size", "2"], "sgl_kernel") == "0|1"
    monkeypatch.setenv(cpu_ranks.BIND_ENV, "0-0|1-1")
    assert serve.bind_ranks(["--device", "cpu", "--tp-size", "2"], cpu_shim.CPU_SHIM) == "0-0|1-1"


def test_a_vllm_server_at_tp2_leaves_its_ranks_unbound_unless_the_user_binds_them(monkeypatch):
    from difftest_engines.vllm import serve

    _unset_for_this_test(monkeypatch, serve.BIND_ENV)
    assert serve.bind_ranks(["--model", "m"]) is None
    assert serve.bind_ranks(["--model", "m", "--tensor-parallel-size", "2"]) == "nobind"
    monkeypatch.setenv(serve.BIND_ENV, "0|1")
    assert serve.bind_ranks(["-tp", "2"]) == "0|1"


def test_a_server_at_another_tp_than_the_case_declares_is_flagged(small_case):
    from difftest.case.case import load_case
    from difftest_engines.server.probe import flags

    case = load_case(small_case)
    case.engines["sglang"]["tp_size"] = 8
    settings = {"kind": "sglang", "num_steps": 4, "topk": 1, "num_draft_tokens": 5, "tp": 2, "algorithm": "EAGLE3"}
    assert (
        "the server runs tensor parallelism 2; the case's engines.sglang.tp_size says 8 (the prediction replays "
        "the server's tokens: it does not depend on it)"
    ) in flags(settings, case)
    case.engines["sglang"]["tp_size"] = 2
    assert not any("tensor parallelism" in f for f in flags(settings, case))
