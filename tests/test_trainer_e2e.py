"""End to end with speculators' own trainer: a draft trained by `speculators train` (0.9.0, CPU), then
difftest on that draft and its data.

The data: the built-in tiny target (fixture:tiny-llama, 8 layers) on random prompts followed by its own
greedy continuation (loss on the continuation), saved in the layout speculators' generator writes
(hidden_states/hs_{i}.safetensors with token_ids and hidden_states [seq, 4, H]; the arrow dataset
prepare-data writes) and checked with the generator's own `check_hidden_states`. The hidden states
come from difftest's reference target (speculators' own writer, `generate-offline-data` through a
vLLM server, is tests/test_speculators_writer_e2e.py: a smaller run, as it pays a server start).
What the trainer does with the data is all speculators' code.

The seed's layout: the data holds [h0, h2, h4, h8] (generation launched with ids [0, 2, 4] plus the last
layer), training ran without --target-layer-ids, so the draft config records the trainer's default
[2, 4, 5] while fc learned cat(h0, h2, h4). vLLM reads [2, 4, 5] as cat(h2, h4, h5).

Exact counts: speculators' own metric code (tests/trainer_oracle/speculators_checkpoint.py) on the saved bf16
checkpoint and on the float32 master weights the training script keeps, over all rows and over the trainer's
validation split, equals `train-acc` (`--split val`) count for count; the trainer's logged validation numbers
are those of the master weights, packed, which `train-acc`'s precision and packing lines account for.

The trainer run (about 40 s on 2 cores) is cached under $DIFFTEST_CACHE/trainer-e2e, keyed by the
recipe, the trainer script and the target's bytes. Without speculators' environment the tests skip
naming `scripts/setup-engine speculators`; with DIFFTEST_REQUIRE_ENGINES=1 (CI) they fail.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from difftest import cli
from difftest.base.paths import cache_root
from helpers import fixture_path, run_pytest
from test_trainers_oracle import HERE, trainer_python

TARGET = "fixture:tiny-llama"
RECIPE = {
    "layers": "h0+h2+h4+h8",
    "prompts": 120,
    "prompt_len": 12,
    "continue": 16,
    "seed": 7,
    # 96 training samples, two per packed batch of 64 tokens: 48 optimizer steps an epoch, 288 in all
    "epochs": 6,
    "total_seq_len": 64,
    "train_ratio": 0.8,
}
STEPS = 3  # speculators' default --ttt-steps


@torch.no_grad()
def write_greedy_data(target_dir: Path, out: Path) -> Path:
    """Random prompts + the target's greedy continuation (loss mask 0 on the prompt, 1 on the continuation),
    the dumped tensors RECIPE["layers"] in file order, the verifier last. All prompts have one length, so
    the continuation runs batched (`difftest dump` does one prompt at a time: minutes for 120)."""
    from difftest_engines.ref.speculate import gather_fc_in
    from difftest_engines.ref.target import load_target, num_layers, run_target
    from difftest_engines.trainingdata.dump import parse_layers, random_prompts
    from difftest_engines.trainingdata.formats import write_dump

    target = load_target(target_dir)
    names = parse_layers(RECIPE["layers"], num_layers(target))
    ids = torch.tensor(
        random_prompts(target.config.vocab_size, RECIPE["prompts"], RECIPE["prompt_len"], RECIPE["seed"])
    )
    for _ in range(RECIPE["continue"]):
        ids = torch.cat([ids, run_target(target, ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    res = run_target(target, ids)
    tensors = [gather_fc_in(res, [n]) for n in names]  # each [B, seq, H]
    mask = [0] * RECIPE["prompt_len"] + [1] * RECIPE["continue"]
    samples = [(ids[b].tolist(), mask, [t[b] for t in tensors]) for b in range(ids.shape[0])]
    return write_dump(out, "speculators", samples, len(names) - 1, {"layers": RECIPE["layers"].split("+")})


def _key(target_dir: Path) -> str:
    h = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode())
    h.update((HERE / "speculators_train.py").read_bytes())
    h.update(inspect.getsource(write_greedy_data).encode())  # the data writer too
    h.update((Path(__file__).parent.parent / "difftest_engines" / "trainingdata" / "formats.py").read_bytes())
    for f in sorted(target_dir.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


VAL_LINE = re.compile(r"val/full_acc_(\d+)_epoch=([0-9.]+)")


@pytest.fixture(scope="module")
def trained() -> dict:
    """speculators' trainer run on the seed-layout data, built once and cached by content."""
    python = trainer_python("speculators")
    target = fixture_path(TARGET)
    root = cache_root() / "trainer-e2e" / f"speculators-0.9.0-{_key(target)}"
    if not (root / "out" / "result.json").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".build.", dir=root.parent))
        try:
            write_greedy_data(target, tmp / "data")
            # COLUMNS: the trainer logs through rich, which wraps at the terminal width (80 without one)
            # OMP_NUM_THREADS: on 2 shared cores a second spinning torch thread costs more than it gives a model this small
            env = dict(
                os.environ,
                PYTHONPATH="",
                COLUMNS="400",
                OMP_NUM_THREADS="1",
                TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
            )
            proc = subprocess.run(
                [
                    python,
                    str(HERE / "speculators_train.py"),
                    str(target),
                    str(tmp / "data"),
                    str(tmp / "out"),
                    str(RECIPE["epochs"]),
                    str(RECIPE["total_seq_len"]),
                    str(RECIPE["train_ratio"]),
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=900,
            )
            (tmp / "out").mkdir(exist_ok=True)
            (tmp / "out" / "train.log").write_text(proc.stdout + proc.stderr)
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
            if root.exists():
                shutil.rmtree(root)
            tmp.rename(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    # (result.json's checkpoint path is where the run was built, before the move into the cache)
    result = json.loads((root / "out" / "result.json").read_text())
    return {
        "target": target,
        "root": root,
        "data": root / "data",
        "val": root / "out" / "val",
        "draft": root / "out" / "ckpt" / str(RECIPE["epochs"] - 1),
        "result": result,
        "master": root / "out" / "master",
        "dataset": root / "out" / "dataset",
        "hidden_states": root / "data" / "hidden_states",
        "log": (root / "out" / "train.log").read_text(),
    }


def logged_val_accuracy(run: dict) -> list[float]:
    """The trainer's last validation record (trainer.py::val_epoch -> its metric logger), full_acc per TTT step."""
    val = run["result"]["val"]
    assert val is not None, "the trainer logged no validation metrics"
    return [val[f"full_acc_{k}_epoch"] for k in range(STEPS)]


@pytest.fixture(scope="module")
def scored(trained, tmp_path_factory) -> dict:
    """`difftest train-acc` on the trainer's draft and its validation split: the trainer's wiring (row 0, read
    from the data) and vLLM's reading of the draft config (row 1), in one run."""
    out = tmp_path_factory.mktemp("train_acc") / "train-acc.json"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        rc = cli.main(
            [
                "train-acc",
                "--data",
                str(trained["val"]),
                "--draft",
                str(trained["draft"]),
                "--target",
                str(trained["target"]),
                "--wiring",
                "vllm",
                "--out",
                str(out),
            ]
        )
    assert rc == 0, text.getvalue()
    return {"rows": json.loads(out.read_text())["rows"], "text": text.getvalue()}


# -- the trainer's own number ------------------------------------------------------------------------


def test_the_trainer_printed_the_validation_accuracy_it_logged(trained):
    # the console line a user reads (train/logger.py FormatDictFilter: 3 decimals), last epoch
    printed = {}
    for k, v in VAL_LINE.findall(trained["log"]):
        printed[int(k)] = float(v)
    logged = logged_val_accuracy(trained)
    assert sorted(printed) == list(range(STEPS)), trained["log"][-3000:]
    for k in range(STEPS):
        assert printed[k] == float(f"{logged[k]:.3f}"), (printed, logged)
    assert trained["result"]["train_steps"] >= 200  # "a few hundred steps"


# The trainer validates with its float32 master weights; the checkpoint it saves, the draft a user serves, is
# bfloat16 (train/checkpointer.py SingleGPUCheckpointer.save_checkpoint, float_dtype=torch.bfloat16). train-acc
# says so and computes how far that can move its counts: the counted positions with a prediction whose top-2
# logits lie within 4 bf16 units of roundoff (difftest_engines/trainingdata/precision.py). The tests below check the
# counts exactly, against the master weights the training script keeps, and speculators' own metric code.
def test_train_acc_reproduces_the_trainers_last_logged_validation_accuracy_within_the_bound_it_prints(trained, scored):
    assert "scored with speculators@0.9.0 (the draft config's speculators_version)'s rules" in scored["text"]
    row = scored["rows"][0]
    ours, theirs = row["full_acc"], logged_val_accuracy(trained)
    print(
        f"trainer's logged val full_acc {['%.4f' % a for a in theirs]}; difftest train-acc {['%.4f' % a for a in ours]} "
        f"(correct {row['correct']} of {row['counted']}; near ties {row['near_ties']})"
    )
    assert row["fc"] == ["h0", "h2", "h4"]  # identified against the target: the data's fc tensors
    assert len(ours) == STEPS
    assert "precision: weights stored in bfloat16" in scored["text"]
    for k in range(STEPS):
        assert abs(ours[k] - theirs[k]) * row["counted"][k] <= row["near_ties"][k] + 1e-6, (
            k,
            ours,
            theirs,
            row["near_ties"],
        )
    assert theirs[0] > 0.4  # the draft learned something, so the comparison can fail


# -- exact: speculators' own metric code on the trainer's checkpoint and its validation split ------------------


def _oracle(trained: dict, draft: Path, out: Path) -> dict:
    """tests/trainer_oracle/speculators_checkpoint.py: speculators loads DRAFT itself and runs its training forward's
    compute_metrics over all rows, the validation split one sample at a time, and the trainer's packed validation
    batches (its own dataloader)."""
    python = trainer_python("speculators")
    proc = subprocess.run(
        [
            python,
            str(HERE / "speculators_checkpoint.py"),
            str(draft),
            str(trained["dataset"]),
            str(trained["hidden_states"]),
            str(out),
            str(RECIPE["train_ratio"]),
            str(RECIPE["total_seq_len"]),
            str(STEPS),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def exact(trained, tmp_path_factory) -> dict:
    """speculators' counts on the bf16 checkpoint and on the float32 master weights, and train-acc's on the same
    data folder the trainer read (its arrow dataset, hidden states apart), all rows and --split val."""
    root = tmp_path_factory.mktemp("exact")
    out = {
        "theirs": _oracle(trained, trained["draft"], root / "theirs.json"),
        "theirs_master": _oracle(trained, trained["master"], root / "theirs_master.json"),
    }

    def ours(name: str, draft: Path, *extra: str) -> None:
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            rc = cli.main(
                [
                    "train-acc",
                    "--data",
                    str(trained["dataset"]),
                    "--hidden-states",
                    str(trained["hidden_states"]),
                    "--draft",
                    str(draft),
                    "--target",
                    str(trained["target"]),
                    "--out",
                    str(root / f"{name}.json"),
                    *extra,
                ]
            )
        assert rc == 0, text.getvalue()
        out[name] = {**json.loads((root / f"{name}.json").read_text())["rows"][0], "text": text.getvalue()}

    ours("all", trained["draft"])
    ours("val", trained["draft"], "--split", "val")  # the ratio from the run.yaml beside the checkpoint
    ours("all_master", trained["master"])
    ours("val_master", trained["master"], "--split", "val", "--train-data-ratio", str(RECIPE["train_ratio"]))
    return out


def _counts(ours: dict) -> dict:
    return {
        "full_acc_sum": ours["correct"],
        "full_acc_total": ours["counted"],
        "cond_acc_sum": ours["cond_correct"],
        "cond_acc_total": ours["cond_counted"],
    }


def test_train_acc_counts_equal_speculators_metrics_on_the_trainers_bf16_checkpoint_over_all_rows(exact):
    print(f"all rows: difftest {_counts(exact['all'])}; speculators {exact['theirs']['all']}")
    assert _counts(exact["all"]) == exact["theirs"]["all"]


def test_train_acc_split_val_scores_the_trainers_validation_split_as_speculators_does(exact, trained):
    assert exact["theirs"]["val_rows"] == [96, 120]  # ArrowDataset(split="val", train_ratio=0.8) on 120 rows
    assert (
        f"validation split: rows 96..119 of 120 (train_data_ratio 0.8 from {trained['draft'].parent / 'run.yaml'}"
        in exact["val"]["text"]
    )
    print(f"val: difftest {_counts(exact['val'])}; speculators {exact['theirs']['val']}")
    assert _counts(exact["val"]) == exact["theirs"]["val"]
    assert exact["val"]["counted"][0] == 24 * RECIPE["continue"]  # 24 samples, 16 loss positions each


def test_on_the_float32_master_weights_train_acc_gives_the_trainers_logged_validation_counts(exact, trained):
    logged = trained["result"]["val"]
    master, packed = exact["val_master"], exact["theirs_master"]["val_packed"]
    assert "no rounding between these counts and float32 master weights" in master["text"]
    assert _counts(master) == exact["theirs_master"]["val"]  # one sample at a time: every count
    assert _counts(exact["all_master"]) == exact["theirs_master"]["all"]
    # the trainer's packed batches (its own loader): full counts unchanged, cond denominators as train-acc says
    assert master["correct"] == packed["full_acc_sum"] and master["counted"] == packed["full_acc_total"]
    line = next(x for x in master["text"].splitlines() if x.startswith("packing:"))
    assert f"cond counted {packed['cond_acc_total']} packed" in line, (line, packed)
    for k in range(STEPS):  # and those are the numbers the trainer logged
        assert logged[f"full_acc_{k}_epoch"] == pytest.approx(master["correct"][k] / master["counted"][k], abs=1e-12)
        assert logged[f"cond_acc_{k}_epoch"] == pytest.approx(
            master["cond_correct"][k] / packed["cond_acc_total"][k], abs=1e-12
        )
    assert master["cond_counted"] != packed["cond_acc_total"]  # packing shows in cond: the line is needed


def test_the_bf16_checkpoints_counts_differ_from_the_master_weights_by_no_more_than_the_near_ties_reported(exact):
    for split in ("all", "val"):
        bf16, master = exact[split], exact[f"{split}_master"]
        diff = [abs(a - b) for a, b in zip(bf16["correct"], master["correct"])]
        print(
            f"{split}: bf16 correct {bf16['correct']}, master {master['correct']}, |diff| {diff}, bound {bf16['near_ties']}"
        )
        assert all(d <= n for d, n in zip(diff, bf16["near_ties"])), (diff, bf16["near_ties"])
    assert exact["all"]["correct"] != exact["all_master"]["correct"]  # rounding to bf16 does move counts here
    assert "precision: weights stored in bfloat16" in exact["val"]["text"]


# -- the seed's bug on that draft -------------------------------------------------------------------


def test_the_draft_config_records_the_trainers_default_ids_not_the_datas(trained):
    cfg = json.loads((trained["draft"] / "config.json").read_text())
    assert cfg["speculators_version"] == "0.9.0" and cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5], (
        cfg
    )  # [2, L//2, L-3] for L = 8; the data held h0, h2, h4


def test_train_acc_collapses_under_vllms_reading_of_the_draft_config(scored):
    rows = scored["rows"]
    assert [r["fc"] for r in rows] == [["h0", "h2", "h4"], ["h2", "h4", "h5"]]
    trained_acc, served = rows[0]["full_acc"][0], rows[1]["full_acc"][0]
    print(f"step-0 accuracy: trainer's wiring {trained_acc:.3f}, vLLM's {served:.3f}")
    assert served < trained_acc / 2, (trained_acc, served)


def test_serving_wiring_is_diagnosed_end_to_end_naming_tensor_cause_and_fix(trained, tmp_path):
    samples = [json.loads(x) for x in (trained["val"] / "samples.jsonl").read_text().splitlines()]
    case = {
        "target": str(trained["target"]),
        "draft": str(trained["draft"]),
        "dtype": "float32",
        "wiring": ["h0", "h2", "h4"],  # what the trainer fed fc (the train engine reads it from the data)
        "prompts": [{"ids": s["input_ids"][: RECIPE["prompt_len"]]} for s in samples[:2]],
        "speculative": {"num_steps": STEPS, "max_new_tokens": 8},
        "engines": {"train": {"data": str(trained["val"])}},
    }
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "speculators_trained.yaml").write_text(json.dumps(case))
    run = run_pytest(tmp_path, "cases/", "--engines=ref,train,ref[wiring=vllm]")
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length", "train_accuracy"):
        assert run.outcome("speculators_trained", "train", check).outcome == "passed", (check, run.output[-3000:])
    fc = run.outcome("speculators_trained", "ref[wiring=vllm]", "fc_inputs")
    assert fc.outcome == "failed", run.output[-3000:]
    assert "error introduced at draft.fc_in.0" in fc.message  # the tensor
    assert (
        "engine's fc chunk 0 matches reference target.h.2 (cos 1.0000); expected target.h.0 (the embedding)"
        in fc.message
    )
    assert "engine fed fc [h2, h4, h5]; reference fed [h0, h2, h4]" in fc.message  # the cause
    assert "embedding dropped and slots shifted by one" in fc.message, fc.message
    # the fix: the lint names the config edit that makes vLLM feed what the draft was trained on
    lint = {f.code: f for f in run.outcome("speculators_trained", "ref", "lint").data.findings if f.severity == "error"}
    assert list(lint) == ["layer-ids-training"], lint  # and nothing else: the bf16 embedding copy is the target's
    assert (
        "turns [2, 4, 5] (top level) into [h2, h4, h5]; the draft was trained on [h0, h2, h4]; "
        "fix: {'eagle_aux_hidden_state_layer_ids': [0, 2, 4]}" in lint["layer-ids-training"].message
    )
    acc = run.outcome("speculators_trained", "ref[wiring=vllm]", "train_accuracy")
    assert acc.outcome == "failed" and acc.message.startswith("training accuracy collapses under this engine's wiring")
    assert run.returncode == 1
