"""speculators' own writer, end to end: training data written by `speculators generate-offline-data`
(0.9.0) against a real vLLM 0.32.0 server on CPU serving fixture:tiny-llama, a draft trained on it
by `speculators train`, and `difftest train-acc` on both.

What runs, all of it the upstream code except the CPU stand-in for vLLM's CUDA-only copy path:
* the prompts: random prompts and the target's own greedy continuation (loss on the continuation),
  saved as the arrow dataset `speculators prepare-data` writes (tests/trainer_oracle/speculators_prepare.py);
* the server: `difftest_engines.vllm.serve` (vLLM's api_server) with speculators' extraction settings, the
  `extract_hidden_states` speculative method asking for layer ids LAYER_IDS and vLLM's
  ExampleHiddenStatesConnector through difftest_engines/vllm/cpu_hidden_states.py (its streams, events and
  pinned memory made host no-ops for that module only; nothing installed is edited). It is started
  once for this module and stopped, process group and all, as soon as the writer is done, test
  failure or not;
* the writer: `python -m speculators generate-offline-data --validate-outputs --fail-on-error`,
  the hidden states to a folder apart from the dataset (`--output`), as users run it;
* the trainer: `speculators train` on CPU over that folder (tests/trainer_oracle/speculators_train.py),
  a few dozen samples, no --target-layer-ids: its config records the default [2, 4, 5] for 8 layers;
* the oracle: speculators' own `compute_metrics` on the trainer's checkpoint
  (tests/trainer_oracle/speculators_checkpoint.py).

LAYER_IDS is the seed's launch ([0, 2, 4] plus the last layer): `train-acc` must read the tensors
vLLM actually wrote, identify them against the target (not trust the ids), reproduce the trainer's
counts, and show the draft collapsing under vLLM's reading of its config ([h2, h4, h5]).

Without the vLLM or speculators environment the tests skip naming the setup command; with
DIFFTEST_REQUIRE_ENGINES=1 (CI) they fail. Nothing is cached: the point is to run the writer.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from helpers import fixture_path, train_acc
from test_trainers_oracle import HERE, trainer_python
from tests import live_servers

TARGET = "fixture:tiny-llama"
LAYER_IDS = [0, 2, 4, 8]  # vLLM's extract_hidden_states ids: the seed's launch ids [0, 2, 4] + the last layer
RECIPE = {
    "prompts": 48,
    "prompt_len": 12,
    "continue": 16,
    "seed": 11,
    # 36 training samples, two per packed batch of 64 tokens: 18 optimizer steps an epoch
    "epochs": 8,
    "total_seq_len": 64,
    "train_ratio": 0.75,
}
STEPS = 3  # speculators' default --ttt-steps


@torch.no_grad()
def write_prompts(target_dir: Path, path: Path) -> None:
    """samples.jsonl: random prompts + the target's greedy continuation, loss on the continuation."""
    from difftest_engines.ref.target import load_target
    from difftest_engines.trainingdata.dump import random_prompts

    target = load_target(target_dir)
    ids = torch.tensor(
        random_prompts(target.config.vocab_size, RECIPE["prompts"], RECIPE["prompt_len"], RECIPE["seed"])
    )
    for _ in range(RECIPE["continue"]):
        ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    mask = [0] * RECIPE["prompt_len"] + [1] * RECIPE["continue"]
    path.write_text(
        "".join(json.dumps({"index": i, "input_ids": r, "loss_mask": mask}) + "\n" for i, r in enumerate(ids.tolist()))
    )


def _run(cmd: list, log: Path, timeout: float, **env_extra: str) -> subprocess.CompletedProcess:
    """CMD in a trainer environment (none of difftest's path); COLUMNS: the trainer logs through rich,
    which wraps at the terminal width."""
    env = dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1", COLUMNS="400", **env_extra)
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout)
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{cmd[1:3]} failed (log {log}):\n" + (proc.stdout + proc.stderr)[-4000:]
    return proc


def server_args(target: Path, stage: Path) -> list[str]:
    """vLLM's flags for hidden-state extraction, as speculators' data-generation docs launch it, with
    the CPU stand-in connector. bfloat16, as targets are served for it: the files hold bf16 states of
    a bf16 forward, which train-acc identifies against the float32 target."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYER_IDS}},
    }
    kv = {
        "kv_connector": "CpuHiddenStatesConnector",
        "kv_connector_module_path": "difftest_engines.vllm.cpu_hidden_states",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(stage)},
    }
    return [
        "--model",
        str(target),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--enforce-eager",
        "--seed",
        "0",
        "--speculative-config",
        json.dumps(spec),
        "--kv-transfer-config",
        json.dumps(kv),
    ]


@pytest.fixture(scope="module")
def generated(request, tmp_path_factory) -> dict:
    """The writer's output: ROOT/dataset (arrow), ROOT/hidden_states (hs_{i}.safetensors), ROOT/samples.jsonl."""
    python = trainer_python("speculators")
    live_servers.engine_python("vllm")  # skip / fail naming the setup before any work
    target = fixture_path(TARGET)
    root = tmp_path_factory.mktemp("speculators-writer")
    logs = Path(request.config.rootpath) / "reports" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    write_prompts(target, root / "samples.jsonl")
    with ThreadPoolExecutor(1) as pool:  # the arrow dataset is saved while the server starts
        prepared = pool.submit(
            _run,
            [python, HERE / "speculators_prepare.py", root / "samples.jsonl", root / "dataset"],
            root / "prepare.log",
            300,
        )
        server = live_servers.start(
            "vllm",
            server_args(target, root / "stage"),
            logs / "live-vllm-hidden-states.log",
            env={"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        )
        try:
            started = server.started_s
            prepared.result()
            t1 = time.monotonic()
            proc = _run(
                [
                    python,
                    "-m",
                    "speculators",
                    "generate-offline-data",
                    "--preprocessed-data",
                    root / "dataset",
                    "--endpoint",
                    f"{server.url}/v1",
                    "--output",
                    root / "hidden_states",
                    "--concurrency",
                    "8",
                    "--validate-outputs",
                    "--fail-on-error",
                ],
                root / "generate.log",
                600,
            )
            wrote_s = time.monotonic() - t1
        finally:
            left = server.stop()
    assert not left, f"processes left after stopping the vLLM server's process group: {left}"
    print(
        f"vLLM server healthy after {started:.0f}s; generate-offline-data {wrote_s:.1f}s; "
        f"whole writer fixture {time.monotonic() - t0:.0f}s"
    )
    return {
        "target": target,
        "root": root,
        "dataset": root / "dataset",
        "hidden_states": root / "hidden_states",
        "log": proc.stdout + proc.stderr,
        "server_log": server.log,
    }


@pytest.fixture(scope="module")
def trained(generated) -> dict:
    """`speculators train` on the writer's output (speculators_train.py re-saves the same rows as its
    dataset, checks every file with generate-offline-data's own check, and keeps the master weights)."""
    python = trainer_python("speculators")
    root, out = generated["root"], generated["root"] / "train"
    _run(
        [
            python,
            HERE / "speculators_train.py",
            generated["target"],
            root,
            out,
            RECIPE["epochs"],
            RECIPE["total_seq_len"],
            RECIPE["train_ratio"],
        ],
        root / "train.log",
        900,
        TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"),
    )
    result = json.loads((out / "result.json").read_text())
    return {
        **generated,
        "out": out,
        "draft": out / "ckpt" / str(RECIPE["epochs"] - 1),
        "master": out / "master",
        "train_dataset": out / "dataset",
        "result": result,
    }


@pytest.fixture(scope="module")
def scored(trained, tmp_path_factory) -> dict:
    """`train-acc` on the writer's folders as a user points it at them (the dataset, the hidden states
    apart), the trainer's validation split, the trainer's wiring and vLLM's reading of the draft."""
    d = tmp_path_factory.mktemp("scored")
    common = [
        "--data",
        str(trained["dataset"]),
        "--hidden-states",
        str(trained["hidden_states"]),
        "--target",
        str(trained["target"]),
    ]
    rows, text = train_acc(
        *common, "--draft", str(trained["draft"]), "--split", "val", "--wiring", "vllm", json_out=d / "val.json"
    )
    master, master_text = train_acc(
        *common,
        "--draft",
        str(trained["master"]),
        "--split",
        "val",
        "--train-data-ratio",
        str(RECIPE["train_ratio"]),
        json_out=d / "master.json",
    )
    print(text)
    return {"rows": rows, "text": text, "master": master[0], "master_text": master_text}


# -- the writer -------------------------------------------------------------------------------------


def test_generate_offline_data_through_the_vllm_server_wrote_every_sample_with_the_prompts_tokens(generated):
    assert f"Saved {RECIPE['prompts']} new data points" in " ".join(generated["log"].split()), generated["log"][-3000:]
    files = sorted(generated["hidden_states"].glob("hs_*.safetensors"))
    assert len(files) == RECIPE["prompts"], generated["log"][-3000:]
    assert not list(generated["hidden_states"].glob("*.lock")), "the writer left lock files"
    from safetensors.torch import load_file

    rows = [json.loads(x) for x in (generated["root"] / "samples.jsonl").read_text().splitlines()]
    for i in (0, RECIPE["prompts"] - 1):
        hs = load_file(str(generated["hidden_states"] / f"hs_{i}.safetensors"))
        assert hs["token_ids"].tolist() == rows[i]["input_ids"]
        # one slot per requested id, in request order, in the server's dtype
        assert tuple(hs["hidden_states"].shape) == (len(rows[i]["input_ids"]), len(LAYER_IDS), 128), hs[
            "hidden_states"
        ].shape
        assert hs["hidden_states"].dtype == torch.bfloat16


def test_train_acc_identifies_the_layers_vllm_wrote_and_its_verifier(scored):
    text = scored["text"]
    # by a target run, not by the requested ids
    assert "dumped tensors = [h0, h2, h4, h8]; trainer fed fc [h0, h2, h4]; verifier = h8 (the final layer)" in text, (
        text
    )
    assert scored["rows"][0]["fc"] == ["h0", "h2", "h4"], text
    assert "hidden states from" in text and "0 skipped" in text, text


# -- the trainer on that data ----------------------------------------------------------------------


def test_train_acc_on_the_writers_data_reproduces_the_trainers_logged_validation_counts(trained, scored):
    """The trainer validated with its float32 master weights: on those, train-acc's counts give its
    logged full_acc exactly; on the bf16 checkpoint, within the near ties it prints."""
    logged = trained["result"]["val"]
    assert logged is not None, "the trainer logged no validation metrics"
    master = scored["master"]
    print(
        f"trainer's logged val full_acc {[round(logged[f'full_acc_{k}_epoch'], 4) for k in range(STEPS)]}; "
        f"train-acc on the master weights {master['correct']} of {master['counted']}"
    )
    assert "no rounding between these counts and float32 master weights" in scored["master_text"]
    for k in range(STEPS):
        assert logged[f"full_acc_{k}_epoch"] == pytest.approx(master["correct"][k] / master["counted"][k], abs=1e-12), k
    # the draft learned something (under vLLM's wiring it scores ~0.02), so the comparison can fail
    assert logged["full_acc_0_epoch"] > 0.2
    row = scored["rows"][0]
    for k in range(STEPS):
        assert abs(row["full_acc"][k] - logged[f"full_acc_{k}_epoch"]) * row["counted"][k] <= row["near_ties"][k] + 1e-6


def test_train_acc_counts_equal_speculators_own_metrics_on_the_trainers_checkpoint(trained, scored, tmp_path):
    python = trainer_python("speculators")
    out = tmp_path / "theirs.json"
    _run(
        [
            python,
            HERE / "speculators_checkpoint.py",
            trained["draft"],
            trained["train_dataset"],
            trained["hidden_states"],
            out,
            RECIPE["train_ratio"],
            RECIPE["total_seq_len"],
            STEPS,
        ],
        tmp_path / "oracle.log",
        600,
    )
    theirs = json.loads(out.read_text())["val"]
    row = scored["rows"][0]
    ours = {
        "full_acc_sum": row["correct"],
        "full_acc_total": row["counted"],
        "cond_acc_sum": row["cond_correct"],
        "cond_acc_total": row["cond_counted"],
    }
    print(f"val: difftest {ours}; speculators {theirs}")
    assert ours == theirs


# -- serving wiring ------------------------------------------------------------------------------


def test_the_draft_collapses_under_vllms_reading_of_its_config(trained, scored):
    cfg = json.loads((trained["draft"] / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5], cfg  # the trainer's default, not the data's
    rows = scored["rows"]
    assert [r["fc"] for r in rows] == [["h0", "h2", "h4"], ["h2", "h4", "h5"]]
    assert rows[1]["full_acc"][0] < rows[0]["full_acc"][0] / 2, (rows[0]["full_acc"], rows[1]["full_acc"])


# -- the CPU stand-in itself -----------------------------------------------------------------------

STAND_IN_PROBE = """
import torch
from difftest_engines.vllm import cpu_hidden_states as c
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as m
if torch.cuda.is_available():
    assert c.CpuHiddenStatesConnector is m.ExampleHiddenStatesConnector
    raise SystemExit("CUDA build: the stock connector")
assert issubclass(c.CpuHiddenStatesConnector, m.ExampleHiddenStatesConnector)
e = m.torch.cuda.Event()
e.record(m.torch.cuda.Stream())
x = torch.arange(6.0)
with m.torch.cuda.stream(m.torch.cuda.Stream()):
    y = m.torch.empty_like(x, device="cpu", pin_memory=True)
    y.copy_(x, non_blocking=True)
print("event done", e.query(), "copied", y.tolist() == x.tolist(), "tensor", m.torch.Tensor is torch.Tensor,
      "global torch.cuda untouched", torch.cuda.Event is not m.torch.cuda.Event)
"""


def test_the_cpu_stand_in_completes_events_and_copies_for_the_connector_module_only():
    python = live_servers.engine_python("vllm")
    env = dict(os.environ, PYTHONPATH=str(live_servers.ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([python, "-c", STAND_IN_PROBE], capture_output=True, text=True, env=env, timeout=300)
    if "CUDA build: the stock connector" in proc.stderr:
        pytest.skip("a CUDA build of vLLM keeps the stock connector (checked)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "event done True copied True tensor True global torch.cuda untouched True" in proc.stdout, proc.stdout
