"""SpecForge's own writer, end to end: training data written by SpecForge 0.2.0's hidden-state
preparation (its SGLang 0.5.14 capture, on CPU) from fixture:tiny-llama-chat on a small conversation
file, then `difftest train-acc` on those files.

What runs, all of it the upstream code except the CPU stand-ins applied at run time
(tests/trainer_oracle/specforge_cpu.py; nothing installed and nothing upstream edited):
* the data: conversations of the target's vocabulary words in SpecForge's jsonl layout
  ({"id", "conversations": [{"role", "content"}]}); the chat template is the fixture tokenizer's, and
  the matching SpecForge ChatTemplate is registered through its TEMPLATE_REGISTRY, as its docs tell
  users of a custom template to;
* the writer: SpecForge's installed package (tests/trainer_oracle/specforge_capture.py composes what
  its scripts/prepare_hidden_states.py does from the classes the package ships: the capture plan,
  OfflineSGLangCapture, build_eagle3_dataset, generate_vocab_mapping_file,
  OfflineCaptureLayout.materialize), with no capture ids: SpecForge resolves its default for an
  8-layer target, [1, 3, 4] ("output of layer k", i.e. h2, h4, h5), and the files are
  rows_0-2000/data_i.ckpt with input_ids, loss_mask, aux_hidden_state [1, L, 3H] and hidden_state
  [1, L, H] (after the final norm), plus vocab_mapping/vocab_mapping.pt;
* the script itself: with DIFFTEST_SPECFORGE_SCRIPT naming a SpecForge checkout's
  scripts/prepare_hidden_states.py (it is in neither the wheel nor the sdist), one more test runs it
  unmodified on the same inputs (tests/trainer_oracle/specforge_prepare_hs.py) and requires the
  same files: the feature files byte for byte, the mapping tensor for tensor; it skips otherwise;
* the check: `train-acc` identifies the tensors SGLang actually wrote against the target (not the
  ids), scores fixture:tiny-llama-eagle3 (trained on fc = [h2, h4, h5]) under the trainer's wiring,
  reproduces SpecForge's own training forward on the files, and shows what serving engines do with
  the ids a SpecForge draft config records ([1, 3, 4]): vLLM reads them as [h1, h3, h4] and the draft
  collapses; SGLang 0.5.23 adds 1 when the first id is 1 and feeds what the trainer fed;
* the draft: fixture:tiny-llama-eagle3, and with DIFFTEST_FULL_MATRIX=1 also one SpecForge trains on
  these files (`specforge train`, `specforge export --to hf`; about 2 min more), the same checks on each.

Environment: `scripts/setup-engine specforge-writer` (SpecForge 0.2.0 + SGLang 0.5.14 on CPU torch,
2.7 GB; .ci/run builds it beside the other environments, 176 s of installs measured here from an empty pip cache). Without it the
tests skip naming that command; with DIFFTEST_REQUIRE_ENGINES=1 (CI) they fail.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers import train_acc
from test_trainers_oracle import HERE, trainer_python

TARGET, DRAFT = "fixture:tiny-llama-chat", "fixture:tiny-llama-eagle3"
SCRIPT_VAR = "DIFFTEST_SPECFORGE_SCRIPT"
N_CONVERSATIONS, SEED = 24, 5
DEFAULT_IDS = [1, 3, 4]  # SpecForge's default capture ids for 8 layers: [1, L//2 - 1, L - 4]
STEPS, MAX_LEN = 7, 2048  # SpecForge's defaults: ttt_length, max_length
TRAIN_EPOCHS = 30


def _writer() -> str:
    """The writer environment's interpreter; skips naming its setup command (fails under
    DIFFTEST_REQUIRE_ENGINES=1, CI, which builds it: .ci/run)."""
    return trainer_python("specforge-writer")


def _script() -> str:
    """SpecForge's scripts/prepare_hidden_states.py from a checkout (not in its wheel or sdist), or skip."""
    script = os.environ.get(SCRIPT_VAR, "")
    if not script or not Path(script).is_file():
        pytest.skip(
            f"{SCRIPT_VAR} does not name SpecForge's scripts/prepare_hidden_states.py (not in its wheel "
            "or sdist): set it to a SpecForge checkout's copy to compare the script's files"
        )
    return script


def _run(cmd: list, log: Path) -> None:
    env = dict(
        os.environ, PYTHONPATH="", OMP_NUM_THREADS="1", HF_HOME=str(log.parent / "hf"), TOKENIZERS_PARALLELISM="false"
    )
    # The writer's SGLang runs one rank: a per-rank core binding from the caller's environment (a
    # tensor-parallel run's) fails its model runner's assertion that the binding lists tp_size groups.
    env.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    t0 = time.monotonic()
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    log.write_text(out)
    assert proc.returncode == 0, f"{Path(cmd[1]).name} failed (log {log}):\n{out[-4000:]}"
    print(f"{Path(cmd[1]).name} (SpecForge 0.2.0, SGLang 0.5.14, CPU): {time.monotonic() - t0:.1f}s")


def _resolve(ref: str) -> Path:
    from difftest.run.case_run import resolve_fixture

    return Path(resolve_fixture(ref))


def write_conversations(target: Path, path: Path) -> list[dict]:
    """User and assistant turns of random vocabulary words (no template marker among them)."""
    from difftest_fixtures.chat import MARKERS

    vocab = json.loads((target / "tokenizer.json").read_text())["model"]["vocab"]
    words = sorted(w for w in vocab if not w.startswith("<") and w not in MARKERS.values())
    r = random.Random(SEED)
    rows = []
    for i in range(N_CONVERSATIONS):
        turns = [
            {"role": "user", "content": " ".join(r.choices(words, k=r.randint(6, 12)))},
            {"role": "assistant", "content": " ".join(r.choices(words, k=r.randint(16, 28)))},
        ]
        rows.append({"id": str(i), "conversations": turns})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def specforge_template() -> dict:
    """fixtures_chat.TEMPLATE's turns in SpecForge's ChatTemplate fields (turn = START ROLE text END)."""
    from difftest_fixtures.chat import MARKERS

    m = MARKERS
    return {
        "tiny-chat": {
            "user_header": f"{m['start']} {m['user']} ",
            "assistant_header": f"{m['start']} {m['assistant']} ",
            "end_of_turn_token": f"{m['end']} ",
        }
    }


def draft_config(draft: Path, path: Path) -> None:
    """The draft's config without capture ids, as SpecForge's --draft-model-config (draft_vocab_size):
    SpecForge then resolves its own default ids for the target."""
    cfg = json.loads((draft / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    cfg.pop("eagle_config", None)
    path.write_text(json.dumps(cfg, indent=1))


def served_target(target: Path, view: Path) -> Path:
    """The target as SpecForge's pipeline is given one: in bfloat16, as targets are served (the writer
    runs SGLang in the config's dtype, and the trainer's frozen TargetHead is bf16, so float32 files
    would not even reach its lm_head), with a *.index.json, the only layout TargetHead.load_weights
    reads (modeling/target/target_head.py). The weight files are linked, not copied."""
    from safetensors import safe_open

    view.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.name != "config.json":
            (view / f.name).symlink_to(f)
    config = json.loads((target / "config.json").read_text())
    (view / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=1))
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    (view / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return view


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """What both writers are given: the conversations, the served target, the template, the draft config."""
    target, draft = _resolve(TARGET), _resolve(DRAFT)
    root = tmp_path_factory.mktemp("specforge-writer")
    rows = write_conversations(target, root / "conversations.jsonl")
    served = served_target(target, root / "target")
    (root / "templates.json").write_text(json.dumps(specforge_template()))
    draft_config(draft, root / "draft.json")
    return {"root": root, "target": target, "served": served, "draft": draft, "rows": rows}


@pytest.fixture(scope="module")
def writer_python() -> str:
    return _writer()


@pytest.fixture(scope="module")
def written(writer_python, inputs) -> dict:
    """SpecForge's installed package writes the files (tests/trainer_oracle/specforge_capture.py)."""
    root, out = inputs["root"], inputs["root"] / "hidden_states"
    cmd = [
        writer_python,
        HERE / "specforge_capture.py",
        "--target",
        inputs["served"],
        "--draft-config",
        root / "draft.json",
        "--data",
        root / "conversations.jsonl",
        "--chat-template",
        "tiny-chat",
        "--templates",
        root / "templates.json",
        "--output",
        out,
        "--cache-dir",
        root / "cache",
        "--max-length",
        "256",
        "--batch-size",
        "8",
        "--mem-fraction-static",
        "0.05",
    ]
    _run(cmd, root / "capture.log")
    return {**inputs, "out": out}


@pytest.fixture(scope="module")
def script_written(writer_python, inputs) -> Path:
    """SpecForge's scripts/prepare_hidden_states.py writes the same data (tests/trainer_oracle/specforge_prepare_hs.py)."""
    script, root = _script(), inputs["root"] / "script"
    out = root / "hidden_states"
    cmd = [
        writer_python,
        HERE / "specforge_prepare_hs.py",
        script,
        root / "run",
        inputs["root"] / "templates.json",
        "--",
        "--target-model-path",
        inputs["served"],
        "--draft-model-config",
        inputs["root"] / "draft.json",
        "--data-path",
        inputs["root"] / "conversations.jsonl",
        "--chat-template",
        "tiny-chat",
        "--max-length",
        "256",
        "--batch-size",
        "8",
        "--output-path",
        out,
        "--cache-dir",
        root / "run" / "cache",
        "--build-dataset-num-proc",
        "1",
        "--num-workers",
        "0",
        "--num-io-threads",
        "1",
        "--sglang-attention-backend",
        "torch_native",
        "--sglang-mem-fraction-static",
        "0.05",
    ]
    root.mkdir()
    _run(cmd, root / "prepare.log")
    return out


def train_config(written: dict, root: Path) -> Path:
    """SpecForge's own run config (config/Config) for `specforge train` on the writer's files, on a CPU:
    DDP over one gloo rank (fsdp_sharding NO_SHARD), batch 1, sdpa, bf16 as the files; 30 epochs of the
    24 files (720 steps) is what a from-scratch draft needs here to score (step 0: 0.39)."""
    # SpecForge's default draft (no norm_output key: SpecForge applies its final norm to the logits).
    # The fixture's `norm_output: false` leaves that norm without a gradient, which DDP refuses.
    cfg = json.loads((root.parent / "draft.json").read_text())
    cfg.pop("norm_output", None)
    (root / "draft.json").write_text(json.dumps(cfg, indent=1))
    run = {
        "model": {
            "target_model_path": str(written["served"]),
            "draft_model_config": str(root / "draft.json"),
            "embedding_key": "model.embed_tokens.weight",
            "torch_dtype": "bfloat16",
            "vocab_mapping_path": str(written["out"] / "vocab_mapping" / "vocab_mapping.pt"),
        },
        "data": {"hidden_states_path": str(written["out"]), "max_length": 256, "cache_dir": str(root / "cache")},
        "training": {
            "strategy": "eagle3",
            "fsdp_sharding": "NO_SHARD",
            "num_epochs": TRAIN_EPOCHS,
            "batch_size": 1,
            "learning_rate": 0.003,
            "ttt_length": STEPS,
            "attention_backend": "sdpa",
            "save_interval": 100000,
            "log_interval": 120,
            "seed": 0,
        },
        "run_id": "tiny-chat",
        "output_dir": str(root / "run"),
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }
    (root / "run.json").write_text(json.dumps(run, indent=1))
    return root / "run.json"


@pytest.fixture(scope="module", params=["fixture", "specforge-train"])
def draft(request, written) -> Path:
    """The draft scored on the writer's files: fixture:tiny-llama-eagle3 (trained on fc = [h2, h4, h5]),
    or, with DIFFTEST_FULL_MATRIX=1, one SpecForge trains on these very files (`specforge train`, then
    `specforge export --to hf`: tests/trainer_oracle/specforge_train.py; ~2 min on a loaded core)."""
    if request.param == "fixture":
        return written["draft"]
    if os.environ.get("DIFFTEST_FULL_MATRIX") != "1":
        pytest.skip("a draft trained by `specforge train` on the writer's files (~2 min): DIFFTEST_FULL_MATRIX=1")
    root = written["root"] / "train"
    root.mkdir()
    config = train_config(written, root)
    env = dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1", HF_HOME=str(root / "hf"))
    cmd = [trainer_python("specforge"), HERE / "specforge_train.py", config, root / "draft.json", root / "export"]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=900)
    log = proc.stdout + proc.stderr
    (root / "train.log").write_text(log)
    assert proc.returncode == 0, f"specforge train failed (log {root / 'train.log'}):\n{log[-4000:]}"
    return root / "export"


@pytest.fixture(scope="module")
def scored(written, draft, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("scored")
    ids = ",".join(map(str, DEFAULT_IDS))
    rows, text = train_acc(
        "--data",
        str(written["out"]),
        "--target",
        TARGET,
        "--draft",
        str(draft),
        "--format",
        "specforge",
        "--layer-ids",
        ids,
        "--wiring",
        "vllm",
        "--wiring",
        "sglang",
        json_out=d / "rows.json",
    )
    # in bfloat16, as SpecForge's trainer runs its draft (model.torch_dtype) on these bf16 files
    bf16, bf16_text = train_acc(
        "--data",
        str(written["out"]),
        "--target",
        TARGET,
        "--draft",
        str(draft),
        "--format",
        "specforge",
        "--dtype",
        "bfloat16",
        json_out=d / "bf16.json",
    )
    print(text)
    return {"rows": rows, "text": text, "bf16": bf16[0], "bf16_text": bf16_text}


@pytest.fixture(scope="module")
def constant_guess(written) -> float:
    """The best step-0 accuracy a draft that always guesses one token can have on these files: the most
    frequent target's share among the loss positions (targets: argmax of the target's lm_head on the
    written hidden_state, the verifier)."""
    from collections import Counter

    from safetensors.torch import load_file

    weights = load_file(str(written["target"] / "model.safetensors"))
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()
    counts: Counter = Counter()
    for path in (written["out"] / "rows_0-2000").glob("data_*.ckpt"):
        rec = torch.load(path, weights_only=True)
        targets = (rec["hidden_state"][0].float() @ lm_head.T).argmax(-1)
        counts.update(targets[rec["loss_mask"].flatten().bool()].tolist())
    return counts.most_common(1)[0][1] / sum(counts.values())


@pytest.fixture(scope="module")
def specforge_forward(written, draft, tmp_path_factory) -> dict:
    """SpecForge's own training forward on the writer's files (tests/trainer_oracle/specforge_forward.py)."""
    python = trainer_python("specforge")
    out = tmp_path_factory.mktemp("specforge-forward") / "counts.json"
    env = dict(os.environ, PYTHONPATH="", OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1")
    cmd = [
        python,
        HERE / "specforge_forward.py",
        draft,
        written["served"],
        written["out"],
        out,
        STEPS,
        MAX_LEN,
        "bfloat16",
    ]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


# -- the writer -------------------------------------------------------------------------------------


def test_specforge_wrote_one_feature_file_per_conversation_in_its_layout(written):
    files = sorted((written["out"] / "rows_0-2000").glob("data_*.ckpt"))
    assert len(files) == N_CONVERSATIONS, sorted(p.name for p in written["out"].rglob("*"))
    assert (written["out"] / "vocab_mapping" / "vocab_mapping.pt").is_file()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(written["target"]), local_files_only=True)
    rendered = {
        tuple(tok.apply_chat_template(r["conversations"], tokenize=True, return_dict=False)): r for r in written["rows"]
    }
    seen = set()
    for path in files:
        rec = torch.load(path, weights_only=True)
        n = rec["input_ids"].shape[-1]
        assert set(rec) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}, set(rec)
        assert tuple(rec["aux_hidden_state"].shape) == (1, n, 3 * 128), rec["aux_hidden_state"].shape
        assert tuple(rec["hidden_state"].shape) == (1, n, 128), rec["hidden_state"].shape
        assert rec["aux_hidden_state"].dtype == rec["hidden_state"].dtype == torch.bfloat16  # the served dtype
        # a conversation's chat-template rendering, then the batch's padding (pad id 0, no loss)
        ids, mask = rec["input_ids"].flatten().tolist(), rec["loss_mask"].flatten().tolist()
        real = len(ids) - next(i for i, t in enumerate(reversed(ids)) if t != tok.pad_token_id)
        row = rendered.get(tuple(ids[:real]))
        assert row is not None, (path.name, tok.convert_ids_to_tokens(ids[:real]))
        assert set(ids[real:]) <= {tok.pad_token_id} and not any(mask[real:]), path.name
        seen.add(row["id"])
        # loss on the assistant turn: its words and the end-of-turn marker
        assert sum(mask) == len(row["conversations"][1]["content"].split()) + 1, (path.name, mask)
    assert len(seen) == N_CONVERSATIONS


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def test_the_installed_packages_files_are_the_scripts_files_tensor_for_tensor(written, script_written):
    """Only with DIFFTEST_SPECFORGE_SCRIPT: the script, run on the same inputs, writes the same files,
    the same tensors (values, dtypes, shapes) in each, and the same vocabulary mapping; the feature
    files are the same bytes (the mapping's archive names the script's temporary file, so only its
    tensors are compared)."""
    ours, theirs = written["out"], script_written
    assert _files(ours) == _files(theirs), (_files(ours), _files(theirs))
    for name in _files(ours):
        a, b = torch.load(ours / name, weights_only=True), torch.load(theirs / name, weights_only=True)
        assert list(a) == list(b), (name, list(a), list(b))  # the same keys, in the layout's order
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (name, key)
        if name.startswith("rows_"):
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


# -- the end-to-end check on that data ----------------------------------------------------------


def test_train_acc_identifies_the_layers_sglang_captured_for_specforge(scored):
    text = scored["text"]
    # by a target run, not by the ids: SpecForge's [1, 3, 4] are "output of layer k" = h2, h4, h5
    assert (
        "dumped tensors = [h2, h4, h5, final_norm]; trainer fed fc [h2, h4, h5]; "
        "verifier = final_norm (the final layer, after the norm)"
    ) in text, text
    assert scored["rows"][0]["fc"] == ["h2", "h4", "h5"], scored["rows"][0]
    assert f"(specforge, {N_CONVERSATIONS} samples, 0 skipped)" in text, text


def test_train_acc_reproduces_specforges_own_training_forward_on_the_writers_files(
    scored, specforge_forward, constant_guess
):
    """Same positions counted and the same correct counts at every step: `train-acc --dtype bfloat16` runs the
    draft in SpecForge's own bf16 arithmetic, takes its bf16 TargetHead's argmax and reads norm_output as it
    does (difftest_engines/trainingdata/trainer_forward.py); scored in float32 it says so."""
    ours, theirs = scored["bf16"], specforge_forward
    print(f"SpecForge forward correct {theirs['correct']} of {theirs['denom']}; train-acc {ours['correct']}")
    assert theirs["files"] == N_CONVERSATIONS
    assert ours["counted"] == theirs["denom"]
    assert ours["correct"] == theirs["correct"], (ours["correct"], theirs["correct"])
    assert "--dtype bfloat16 gives them exactly" in scored["text"] and "trainer dtype" not in scored["bf16_text"]
    # the draft scores (far above any constant guess), so the comparison can fail
    assert theirs["correct"][0] / theirs["denom"][0] > 10 * constant_guess, (theirs, constant_guess)


def test_the_draft_trained_on_that_wiring_scores_under_the_trainers_wiring(scored, constant_guess):
    """At least ten times what always guessing the most frequent target scores (about 0.011 here;
    the fixture draft scores 0.725, the one SpecForge trains 0.39)."""
    trainer = scored["rows"][0]
    assert trainer["counted"][0] > 0 and trainer["full_acc"][0] > 10 * constant_guess, (trainer, constant_guess)


def test_vllm_reads_a_specforge_draft_configs_ids_one_layer_early_and_the_draft_collapses(scored):
    rows = {tuple(r["fc"]): r for r in scored["rows"]}
    assert ("h1", "h3", "h4") in rows, [r["fc"] for r in scored["rows"]]  # vLLM: k = id
    trainer, vllm = scored["rows"][0], rows[("h1", "h3", "h4")]
    assert vllm["full_acc"][0] < trainer["full_acc"][0] / 2, (trainer["full_acc"], vllm["full_acc"])


def test_sglang_feeds_a_specforge_draft_what_the_trainer_fed(scored):
    fcs = [r["fc"] for r in scored["rows"]]
    assert fcs.count(["h2", "h4", "h5"]) == 2, fcs  # the trainer's row and SGLang's (+1 when the first id is 1)


def test_the_package_writer_refuses_an_existing_output_folder_in_one_line(writer_python, tmp_path):
    """Nothing is written over an earlier run's files (the script would skip existing files silently)."""
    out = tmp_path / "hidden_states"
    (out / "rows_0-2000").mkdir(parents=True)
    cmd = [
        writer_python,
        HERE / "specforge_capture.py",
        "--target",
        "T",
        "--draft-config",
        "D",
        "--data",
        "J",
        "--chat-template",
        "tiny-chat",
        "--output",
        out,
        "--cache-dir",
        tmp_path / "cache",
    ]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "", (proc.returncode, proc.stdout)
    assert proc.stderr == f"specforge_capture: --output {out} exists; give a new directory\n", proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["rows_0-2000"] and not (tmp_path / "cache").exists()
