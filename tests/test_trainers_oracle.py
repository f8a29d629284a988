"""The training side against the trainers' own code: speculators 0.9.0 and SpecForge 0.2.0 run as the oracle.

Each trainer runs in its own environment (`scripts/setup-engine speculators`, `scripts/setup-engine
specforge`), through the scripts in tests/trainer_oracle/. Without an environment these tests are
skipped naming that command; with DIFFTEST_REQUIRE_ENGINES=1 (CI) they fail instead.

* metrics: on the same draft logits and data, difftest's per-step counts (full_acc, cond_acc; SpecForge's
  acc_k) equal the trainers' `compute_metrics` / `_compute_metric_counts` exactly, so the ratios agree
  to 1e-6. The draft logits are the verifier's targets plus noise (accuracies between about 0.2 and 0.9,
  so AND-ing steps and masks matter), loss masks have gaps, and some targets fall outside the draft vocab.
* the sliding window: a speculators draft whose config records a window shorter than the samples is
  scored as speculators' forward scores it (its masks keep keys q - W < k <= q at step 0).
* the training forward: a draft built by speculators itself (`Eagle3DraftModel.from_training_args`, the
  `speculators train` defaults) scored by its own training forward (ArrowDataset -> CollateFn(shift_batch)
  -> forward metrics) gives the counts `difftest train-acc` gives on the same draft and dump, with the
  rules chosen from the draft config's speculators_version (teacher-forced tokens, positions from 1,
  norm_output).
* SpecForge's training forward: fixture:tiny-llama-eagle3 on fixture:tiny-llama's states in SpecForge's rows
  layout, scored by SpecForge's own `Eagle3TrainStrategy.forward_loss` in bf16 (the only dtype its offline
  forward runs in), gives the counts `train-acc --dtype bfloat16` gives exactly, with the config's norm_output
  false and absent; the reference draft's arithmetic with float32 targets gives other counts on the same data.
* precision: the same speculators-built draft rounded to bf16 (as the trainer's checkpointer saves it) moves
  the counts by no more than the near ties `train-acc` reports for it.
* readers: a speculators folder (arrow dataset + hidden states in a separate --hidden-states-path) read
  by speculators' ArrowDataset, and a SpecForge rows_a-b folder (.ckpt and .ckpt.gz, with its
  vocab_mapping/vocab_mapping.pt) read by SpecForge's offline reader, give difftest's reader the same
  tensors; difftest reads the arrow folder `datasets` wrote without `datasets` (the default install).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from difftest.base.errors import ConfigError
from difftest.base.paths import cache_root
from difftest_engines.trainingdata.train_accuracy import RULES, VerifierHead, score_steps
from difftest_engines.trainingdata.formats import read_dump, write_dump

HERE = Path(__file__).parent / "trainer_oracle"
REQUIRED = os.environ.get("DIFFTEST_REQUIRE_ENGINES") == "1"
V, VD, H, STEPS = 64, 24, 16, 4  # full vocab, draft vocab, hidden, TTT steps


def trainer_python(name: str, setup: str | None = None) -> str:
    """The trainer environment's interpreter; `setup`: the command that builds it (default scripts/setup-engine NAME)."""
    candidate = cache_root() / "envs" / name / "bin" / "python"
    if not candidate.exists():
        why = f"{name}'s environment is not set up ({candidate} not found); set it up with: {setup or f'scripts/setup-engine {name}'}"
        if REQUIRED:
            pytest.fail(f"DIFFTEST_REQUIRE_ENGINES=1: {why}")
        pytest.skip(why)
    return str(candidate)


def run_oracle(name: str, script: str, *args: str) -> None:
    # SpecForge's metric functions are torch.compile'd; their eager code is the same function and
    # skips minutes of CPU compilation
    env = dict(os.environ, PYTHONPATH="", TORCH_COMPILE_DISABLE="1")
    proc = subprocess.run(
        [trainer_python(name), str(HERE / script), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# -- the shared draft and data ------------------------------------------------------------------


def make_cases(seed: int = 0, n_cases: int = 6) -> tuple[dict, list[dict]]:
    g = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(V, H, generator=g)
    norm_weight = 0.5 + torch.rand(H, generator=g)
    draft_cols = torch.sort(torch.randperm(V, generator=g)[:VD]).values  # draft id d -> target id draft_cols[d]
    d2t = draft_cols - torch.arange(VD)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_cols] = True
    head = VerifierHead(lm_head, norm_weight, 1e-6)
    cases = []
    for c in range(n_cases):
        N = int(torch.randint(10, 40, (1,), generator=g))
        verifier = torch.randn(N, H, generator=g) * (1 + c)  # scale varies: the norm matters
        input_ids = torch.randint(0, V, (N,), generator=g)
        loss_mask = (torch.rand(N, generator=g) < 0.75).long()
        loss_mask[: int(torch.randint(0, 4, (1,), generator=g))] = 0  # a prompt
        # the draft: each trainer's targets at j = i + k + 1, plus noise that grows with the step
        T = head.targets(verifier, d2t, RULES["speculators"])[0]
        logits = torch.randn(STEPS, N - 1, VD, generator=g) * 1.5
        for k in range(STEPS):
            j = (torch.arange(N - 1) + k + 1).clamp(max=N - 1)
            logits[k, torch.arange(N - 1), T[j]] += 4.0 - 0.5 * k
        cases.append({"input_ids": input_ids, "loss_mask": loss_mask, "verifier": verifier, "logits": logits})
    shared = {
        "lm_head": lm_head,
        "norm_weight": norm_weight,
        "eps": 1e-6,
        "d2t": d2t,
        "t2d": t2d,
        "draft_cols": draft_cols,
        "head": head,
    }
    return shared, cases


def difftest_counts(shared: dict, case: dict, rules) -> dict:
    targets, in_vocab = shared["head"].targets(case["verifier"], shared["d2t"], rules)
    preds = [case["logits"][k].argmax(-1) for k in range(STEPS)]
    return score_steps(preds, targets, case["loss_mask"].bool(), rules, in_vocab).to_dict()


# -- metrics ----------------------------------------------------------------------------------------


def test_speculators_metrics_equal_difftest_full_and_cond_accuracy(tmp_path):
    shared, cases = make_cases(seed=1)
    payload = [
        {
            **c,
            "eps": shared["eps"],
            "norm_weight": shared["norm_weight"],
            "lm_head_draft_rows": shared["lm_head"][shared["draft_cols"]],
        }
        for c in cases
    ]
    torch.save(payload, tmp_path / "in.pt")
    run_oracle("speculators", "speculators_metrics.py", str(tmp_path / "in.pt"), str(tmp_path / "out.json"))
    theirs = json.loads((tmp_path / "out.json").read_text())
    full_seen = set()
    for case, t in zip(cases, theirs):
        ours = difftest_counts(shared, case, RULES["speculators"])
        assert ours["correct"] == t["full_acc_sum"] and ours["counted"] == t["full_acc_total"], (ours, t)
        assert ours["cond_correct"] == t["cond_acc_sum"] and ours["cond_counted"] == t["cond_acc_total"], (ours, t)
        for a, c, n in zip(ours["full_acc"], t["full_acc_sum"], t["full_acc_total"]):
            if n:
                assert abs(a - c / n) < 1e-6
                full_seen.add(round(a, 2))
    assert len(full_seen) > 3 and max(full_seen) > 0.5 and min(full_seen) < 0.5  # the data exercises the rules


def test_specforge_metric_counts_equal_difftest_accuracy(tmp_path):
    shared, cases = make_cases(seed=2)
    payload = [
        {**c, "lm_head": shared["lm_head"], "d2t": shared["d2t"], "t2d": shared["t2d"], "max_len": 2048} for c in cases
    ]
    torch.save(payload, tmp_path / "in.pt")
    run_oracle("specforge", "specforge_metrics.py", str(tmp_path / "in.pt"), str(tmp_path / "out.json"))
    theirs = json.loads((tmp_path / "out.json").read_text())
    out_of_vocab = 0
    for case, t in zip(cases, theirs):
        ours = difftest_counts(shared, case, RULES["specforge"])
        denom = [d if d >= 1 else 0.0 for d in t["denom"]]  # clamp_min(1e-6) for an empty mask
        assert ours["correct"] == t["correct"] and ours["counted"] == denom, (ours, t)
        for a, c, n in zip(ours["full_acc"], t["correct"], denom):
            if n:
                assert abs(a - c / n) < 1e-6
        _, in_vocab = shared["head"].targets(case["verifier"], shared["d2t"], RULES["specforge"])
        out_of_vocab += int((~in_vocab[1:] & case["loss_mask"][:-1].bool()).sum())
    assert out_of_vocab > 0  # some counted targets lie outside the draft vocab: SpecForge counts them as misses


# -- readers ----------------------------------------------------------------------------------------


def _hidden_samples(seed: int, n: int = 3, layers: int = 4) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        N = int(torch.randint(6, 20, (1,), generator=g))
        out.append(
            {
                "input_ids": torch.randint(0, V, (N,), generator=g),
                "loss_mask": (torch.rand(N, generator=g) < 0.7).long(),
                "hidden_states": torch.randn(N, layers, H, generator=g).to(torch.bfloat16),
            }
        )
    return out


def test_speculators_folder_with_separate_hidden_states_reads_as_their_trainer_reads_it(tmp_path, monkeypatch):
    samples = _hidden_samples(3)
    torch.save(samples, tmp_path / "in.pt")
    data, hs = tmp_path / "data", tmp_path / "elsewhere" / "hs"
    run_oracle(
        "speculators", "speculators_reader.py", str(tmp_path / "in.pt"), str(data), str(hs), str(tmp_path / "out.pt")
    )
    theirs = torch.load(tmp_path / "out.pt", weights_only=True)
    monkeypatch.setitem(sys.modules, "datasets", None)  # the default install has no `datasets`: importing it fails
    dump = read_dump(data, hidden_states=hs)  # auto: hidden_states given means speculators
    assert dump.format == "speculators" and not dump.skipped and len(dump.samples) == len(theirs)
    for s, t in zip(dump.samples, theirs):
        assert torch.equal(s.input_ids, t["input_ids"].long())
        assert torch.equal(s.loss_mask, t["loss_mask"].bool())
        assert torch.equal(s.fc_in, t["hidden_states"])  # [seq, 3H]: every layer but the last, flattened in order
        assert torch.equal(s.verifier, t["verifier_last_hidden_states"])
    with pytest.raises(
        ConfigError,
        match=r"holds a speculators arrow dataset \(3 samples in data-00000-of-00001.arrow\) "
        r"but no hidden states: .*--hidden-states DIR",
    ):
        read_dump(data)  # the same folder without its hidden states: what was found and where they are expected


@pytest.mark.parametrize("compress", [False, True], ids=["ckpt", "ckpt.gz"])
def test_specforge_rows_folder_reads_as_their_offline_reader_reads_it(tmp_path, compress):
    samples = [
        (s["input_ids"].tolist(), s["loss_mask"].tolist(), [s["hidden_states"][:, j].float() for j in range(4)])
        for s in _hidden_samples(4, n=12)
    ]
    out = write_dump(tmp_path / "sf", "specforge", samples, fc_count=3, compress=compress)
    (out / "difftest_dump.json").unlink()
    (out / "vocab_mapping").mkdir()
    torch.save(
        {"d2t": torch.zeros(4, dtype=torch.long), "t2d": torch.ones(4, dtype=torch.bool)},
        out / "vocab_mapping" / "vocab_mapping.pt",
    )
    run_oracle("specforge", "specforge_reader.py", str(out), str(tmp_path / "out.pt"), "2048")
    theirs = torch.load(tmp_path / "out.pt", weights_only=True)
    dump = read_dump(out)
    assert dump.format == "specforge" and not dump.skipped
    assert [s.source for s in dump.samples] == [
        t["path"] for t in theirs
    ]  # same files, same order (data_10 before data_2)
    assert all(t["path"].endswith(".ckpt.gz" if compress else ".ckpt") and "/rows_0-2000/" in t["path"] for t in theirs)
    for s, t in zip(dump.samples, theirs):
        assert torch.equal(s.input_ids, t["input_ids"])
        assert torch.equal(s.loss_mask[:-1], t["loss_mask"][:-1].bool())  # SpecForge zeroes the last position itself
        assert torch.equal(s.fc_in, t["aux_hidden_state"]) and torch.equal(s.verifier, t["hidden_state"])


# -- speculators' own training forward on its own draft -----------------------------------------------


@pytest.fixture(scope="module")
def speculators_draft_run(tmp_path_factory):
    """A speculators-built draft (Eagle3DraftModel.from_training_args, `speculators train` defaults: norm_output,
    sliding window) for the tiny random target, scored by speculators' training forward on a difftest dump whose
    loss mask covers text that is not the target's greedy continuation (so teacher forcing is observable)."""
    from difftest_engines.trainingdata.dump import dump_from_target, random_prompts
    from helpers import make_tiny_pair

    python = trainer_python("speculators")
    root = tmp_path_factory.mktemp("spec_forward")
    target, _ = make_tiny_pair(root, num_layers=6)
    data = dump_from_target(
        target, root / "data", "speculators", "h1+h3+h4+h6", random_prompts(512, 8, 14, seed=5), continue_tokens=6
    )
    rows = [json.loads(x) for x in (data / "samples.jsonl").read_text().splitlines()]
    for r in rows:  # every position counts: the random prompt tokens are nobody's prediction
        r["loss_mask"] = [1] * len(r["loss_mask"])
    (data / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    draft = root / "draft"
    env = dict(os.environ, PYTHONPATH="")
    proc = subprocess.run(
        [
            python,
            str(HERE / "speculators_forward.py"),
            str(target),
            str(data),
            str(draft),
            str(root / "theirs.json"),
            "3",
            "16",
            "1,3,4",
            "12",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {
        "target": target,
        "data": data,
        "draft": draft,
        "theirs": json.loads((root / "theirs.json").read_text()),
        "root": root,
    }


def _train_acc(run: dict, *extra: str) -> dict:
    from difftest import cli

    out = run["root"] / f"ours{'-'.join(extra)}.json"
    rc = cli.main(
        [
            "train-acc",
            "--data",
            str(run["data"]),
            "--draft",
            str(run["draft"]),
            "--target",
            str(run["target"]),
            "--ttt-steps",
            "3",
            "--out",
            str(out),
            *extra,
        ]
    )
    assert rc == 0
    return json.loads(out.read_text())["rows"][0]


def test_train_acc_equals_speculators_training_forward_on_its_own_draft(speculators_draft_run, capsys):
    theirs = speculators_draft_run["theirs"]["full"]
    ours = _train_acc(speculators_draft_run)  # rules from the draft config's speculators_version (0.9.0)
    assert "scored with speculators@0.9.0 (the draft config's speculators_version)'s rules" in capsys.readouterr().out
    assert ours["correct"] == theirs["full_acc_sum"] and ours["counted"] == theirs["full_acc_total"], (ours, theirs)
    assert ours["cond_correct"] == theirs["cond_acc_sum"] and ours["cond_counted"] == theirs["cond_acc_total"], (
        ours,
        theirs,
    )
    assert ours["correct"][0] > 0 and ours["correct"][1] > 0  # enough right predictions that the rules matter


def test_train_acc_truncates_samples_where_speculators_collate_does(speculators_draft_run):
    theirs = speculators_draft_run["theirs"]["12"]  # CollateFn(max_len=12) after shift_batch: 13 tokens kept
    ours = _train_acc(speculators_draft_run, "--max-len", "12")
    assert ours["counted"] == theirs["full_acc_total"] and ours["correct"] == theirs["full_acc_sum"], (ours, theirs)
    assert ours["cond_counted"] == theirs["cond_acc_total"], (ours, theirs)
    assert ours["counted"][0] < speculators_draft_run["theirs"]["full"]["full_acc_total"][0]  # it did cut


# -- speculators' sliding window: samples longer than the draft's window --------------------------------


WINDOW = 4  # the samples are 20 tokens (19 origins after shift_batch): most origins see fewer keys than under causal


@pytest.fixture(scope="module")
def speculators_windowed_run(speculators_draft_run):
    """The same target, data and seed, the draft built with `--sliding-window 4` (speculators records it as
    transformer_layer_config.sliding_window + layer_types ["sliding_attention"]) and scored by speculators'
    own training forward, whose mask (models/eagle3/attention.py::create_combined_mask_mod) applies it."""
    python = trainer_python("speculators")
    run = speculators_draft_run
    root = run["root"]
    env = dict(os.environ, PYTHONPATH="")
    proc = subprocess.run(
        [
            python,
            str(HERE / "speculators_forward.py"),
            str(run["target"]),
            str(run["data"]),
            str(root / "draft_w"),
            str(root / "theirs_w.json"),
            "3",
            "16",
            "1,3,4",
            "",
            str(WINDOW),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**run, "draft": root / "draft_w", "theirs": json.loads((root / "theirs_w.json").read_text())}


def test_train_acc_applies_the_drafts_sliding_window_as_speculators_training_forward_does(
    speculators_windowed_run, capsys
):
    from safetensors.torch import load_file

    run = speculators_windowed_run
    layer = json.loads((run["draft"] / "config.json").read_text())["transformer_layer_config"]
    assert (layer["sliding_window"], layer["layer_types"]) == (
        WINDOW,
        ["sliding_attention"],
    )  # as speculators records it
    theirs, theirs_2048 = run["theirs"]["full"], json.loads((run["root"] / "theirs.json").read_text())["full"]
    ours = _train_acc(run)
    assert (
        f"attention: sliding window {WINDOW} (the draft config's layer_types[0] = sliding_attention"
        in capsys.readouterr().out
    )
    assert ours["correct"] == theirs["full_acc_sum"] and ours["counted"] == theirs["full_acc_total"], (ours, theirs)
    assert ours["cond_correct"] == theirs["cond_acc_sum"] and ours["cond_counted"] == theirs["cond_acc_total"], (
        ours,
        theirs,
    )
    # the window alone makes the difference: same weights as the 2048-window draft, different counts
    w, w2048 = (
        load_file(str(run["draft"] / "model.safetensors")),
        load_file(str(run["root"] / "draft" / "model.safetensors")),
    )
    assert w.keys() == w2048.keys() and all(torch.equal(w[k], w2048[k]) for k in w)
    assert theirs["full_acc_sum"] != theirs_2048["full_acc_sum"], (theirs, theirs_2048)


# -- speculators 0.6.0: the pre-0.7 rule, against the real release ------------------------------------


@pytest.fixture(scope="module")
def speculators06_draft_run(speculators_draft_run):
    """The same target and data, a draft built and scored by speculators 0.6.0's own training forward, whose
    TTT steps after the first feed the draft's own argmax through d2t (its default, use_off_policy_tokens=False)."""
    # speculators' recipe with speculators repinned to 0.6.0, installed --no-deps (difftest/run/envs.py)
    python = trainer_python("speculators@0.6.0", setup=".venv/bin/difftest env create speculators==0.6.0")
    run = speculators_draft_run
    root = run["root"]
    # 0.6.0's forward is torch.compile'd and its flex attention compiles on CPU: keep inductor's cache here
    env = dict(os.environ, PYTHONPATH="", TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
    proc = subprocess.run(
        [
            python,
            str(HERE / "speculators06_forward.py"),
            str(run["target"]),
            str(run["data"]),
            str(root / "draft06"),
            str(root / "theirs06.json"),
            "3",
            "16",
            "1,3,4",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**run, "draft": root / "draft06", "theirs": json.loads((root / "theirs06.json").read_text())}


def test_train_acc_equals_speculators_0_6_training_forward_feeding_the_drafts_own_argmax(
    speculators06_draft_run, capsys
):
    theirs = speculators06_draft_run["theirs"]
    ours = _train_acc(speculators06_draft_run)  # rules from the draft config's speculators_version (0.6.0)
    assert "scored with speculators@0.6.0 (the draft config's speculators_version)'s rules" in capsys.readouterr().out
    assert ours["correct"] == theirs["full_acc_sum"] and ours["counted"] == theirs["full_acc_total"], (ours, theirs)
    assert ours["cond_correct"] == theirs["cond_acc_sum"] and ours["cond_counted"] == theirs["cond_acc_total"], (
        ours,
        theirs,
    )
    teacher_forced = _train_acc(speculators06_draft_run, "--trainer", "speculators@0.9")
    assert teacher_forced["correct"][1:] != theirs["full_acc_sum"][1:], (
        teacher_forced,
        theirs,
    )  # the rule shows on this draft


# -- precision: the same draft rounded to bf16, as speculators' checkpointer saves it ----------------------------


def test_rounding_a_speculators_draft_to_bf16_moves_its_counts_by_no_more_than_the_near_ties_reported(
    speculators_draft_run, capsys
):
    """An independent draft (speculators-built, random weights x8, float32 as saved) and its bf16 rounding, the
    checkpointer's float_dtype: the fp32 draft's counts are what a trainer holding those master weights counts
    (test_train_acc_equals_speculators_training_forward_on_its_own_draft), and the bf16 copy's differ from them by
    at most the near ties train-acc reports for it."""
    from safetensors.torch import load_file, save_file

    run = speculators_draft_run
    bf16 = run["root"] / "draft_bf16"
    bf16.mkdir(exist_ok=True)
    (bf16 / "config.json").write_text((run["draft"] / "config.json").read_text())
    weights = load_file(str(run["draft"] / "model.safetensors"))
    save_file(
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()},
        str(bf16 / "model.safetensors"),
    )
    master = _train_acc(run)
    assert "no rounding between these counts and float32 master weights" in capsys.readouterr().out
    rounded = _train_acc({**run, "draft": bf16})
    assert "precision: weights stored in bfloat16" in capsys.readouterr().out
    diff = [abs(a - b) for a, b in zip(master["correct"], rounded["correct"])]
    print(
        f"fp32 correct {master['correct']}, bf16 {rounded['correct']}, |diff| {diff}, near ties {rounded['near_ties']}"
    )
    assert all(d <= n for d, n in zip(diff, rounded["near_ties"])), (diff, rounded["near_ties"])
    assert sum(rounded["near_ties"]) < sum(rounded["counted"])  # the bound says something


# -- SpecForge's own training forward, op for op: exact counts in its dtype ---------------------------------


@pytest.fixture(scope="module")
def specforge_forward_data(tmp_path_factory):
    """fixture:tiny-llama's hidden states in SpecForge's rows layout (bf16, [h2, h4, h5] + the final norm: what
    fixture:tiny-llama-eagle3 was trained on) over random prompts and the target's greedy continuation (loss on
    it), and the target as SpecForge's TargetHead reads it (bf16 config, *.index.json)."""
    from difftest.run.case_run import resolve_fixture
    from difftest_engines.trainingdata.dump import dump_from_target, random_prompts
    from test_specforge_writer_e2e import served_target

    trainer_python("specforge")  # skip (or fail under DIFFTEST_REQUIRE_ENGINES) before any work
    root = tmp_path_factory.mktemp("specforge_forward")
    target = Path(resolve_fixture("fixture:tiny-llama"))
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(vocab, 10, 12, seed=7)
    data = dump_from_target(target, root / "data", "specforge", "h2+h4+h5+final_norm", prompts, 20, torch.bfloat16)
    draft = Path(resolve_fixture("fixture:tiny-llama-eagle3"))
    absent = root / "draft-norm-output-absent"  # SpecForge's default: the final norm before lm_head
    absent.mkdir()
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg.pop("norm_output") is False  # the fixture writes it: SpecForge then leaves the norm out of the logits
    (absent / "config.json").write_text(json.dumps(cfg))
    (absent / "model.safetensors").symlink_to(draft / "model.safetensors")
    return {
        "root": root,
        "data": data,
        "target": target,
        "served": served_target(target, root / "target"),
        "drafts": {"norm_output false": draft, "norm_output absent": absent},
    }


SPECFORGE_STEPS = 7  # its default ttt_length


def _specforge_forward(run: dict, draft: Path, dtype: str) -> dict:
    out = run["root"] / f"theirs-{draft.name}-{dtype}.json"
    if out.exists():  # the module's data and draft: one SpecForge run each
        return json.loads(out.read_text())
    run_oracle(
        "specforge",
        "specforge_forward.py",
        str(draft),
        str(run["served"]),
        str(run["data"]),
        str(out),
        str(SPECFORGE_STEPS),
        "2048",
        dtype,
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("variant", ["norm_output false", "norm_output absent"])
def test_train_acc_equals_specforges_training_forward_exactly_in_bf16(specforge_forward_data, variant):
    """SpecForge 0.2.0's `Eagle3TrainStrategy.forward_loss` (tests/trainer_oracle/specforge_forward.py: its draft
    in bfloat16, its bf16 TargetHead) and `train-acc --dtype bfloat16` count the same correct positions at every
    TTT step: the draft runs in SpecForge's arithmetic (trainer_forward.py), the targets are its bf16 head's
    argmax, and norm_output is read as SpecForge reads it (false: no final norm before lm_head; absent: the norm).
    bfloat16 is the only dtype SpecForge's offline forward runs in (train_accuracy.SPECFORGE.forward_dtype)."""
    from helpers import train_acc

    run = specforge_forward_data
    draft, dtype = run["drafts"][variant], "bfloat16"
    theirs = _specforge_forward(run, draft, dtype)
    rows, _ = train_acc(
        "--data",
        str(run["data"]),
        "--target",
        str(run["target"]),
        "--draft",
        str(draft),
        "--format",
        "specforge",
        "--dtype",
        dtype,
        json_out=run["root"] / f"ours-{draft.name}-{dtype}.json",
    )
    ours = rows[0]
    print(f"{variant}: SpecForge {theirs['correct']} of {theirs['denom']}; train-acc {ours['correct']}")
    assert theirs["files"] == 10 and len(ours["correct"]) == SPECFORGE_STEPS
    assert ours["counted"] == theirs["denom"] and ours["correct"] == theirs["correct"], (ours, theirs)
    assert ours["correct"][0] > ours["counted"][0] / 2  # the draft scores: a flipped prediction would show


def test_the_reference_drafts_arithmetic_and_float32_targets_do_not_give_specforges_bf16_counts(specforge_forward_data):
    """The same bf16 draft and data scored the way train-acc scored SpecForge before (the reference draft's
    forward, float32 target logits, the norm always before lm_head): other counts than SpecForge's own, so the
    exact test above holds the conventions, not a coincidence."""
    from dataclasses import replace

    from difftest_engines.ref.draft_loading import load_draft
    from difftest_engines.trainingdata.train_accuracy import StepCounts, sample_accuracy
    from safetensors.torch import load_file

    run = specforge_forward_data
    draft = run["drafts"]["norm_output false"]
    theirs = _specforge_forward(run, draft, "bfloat16")
    weights = load_file(str(run["target"] / "model.safetensors"))
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    head = VerifierHead(lm_head, torch.ones(lm_head.shape[1]), 1e-6)
    loaded = load_draft(draft, weights["model.embed_tokens.weight"], lm_head, dtype=torch.bfloat16)
    before = replace(RULES["specforge"], draft_forward="reference", target_logits_dtype=None)
    total = StepCounts()
    for s in read_dump(run["data"], "specforge").samples:
        total = total.add(
            sample_accuracy(loaded.model, head, s.fc_in, s.verifier, s.input_ids, s.loss_mask, SPECFORGE_STEPS, before)
        )
    assert total.counted == theirs["denom"]
    assert total.correct != theirs["correct"], (total.correct, theirs["correct"])
