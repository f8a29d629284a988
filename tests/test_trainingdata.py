"""Training-data engine: both dump formats, layer identification, bad input, train-acc, the seed end to end.

Runs on the random tiny pair (tests/helpers.make_tiny_pair: 6 layers, H=64); the end-to-end
test trains a small draft on a miswired dump the way the seed's trainer did.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from difftest import cli
from difftest_engines.trainingdata.layer_identity import identify_against_target, identify_by_statistics
from difftest_engines.trainingdata.train_accuracy import RULES, VerifierHead, rms_norm
from difftest_engines.ref.target import load_target, run_target
from difftest_engines.trainingdata.dump import dump_from_target, random_prompts
from difftest_engines.trainingdata.formats import read_dump
from helpers import run_pytest

L = 6
TINY_PAIR_LAYERS = L  # the conftest `models` pair

PROMPTS = random_prompts(512, 6, 10, seed=0)


@pytest.fixture(scope="module")
def target(models):
    return load_target(models[0])


def _reference(target, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    res = run_target(target, ids[None])
    ref = {f"target.h.{k}": h[0] for k, h in enumerate(res.hidden)}
    ref["target.final_norm"] = res.final_norm[0]
    return ref


def _dump(models, tmp_path, fmt, layers, prompts=PROMPTS, name="dump"):
    return dump_from_target(models[0], tmp_path / name, fmt, layers, prompts, continue_tokens=6)


# -- formats -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, layers",
    [("speculators", "h0+h2+h4+h5"), ("speculators-legacy", "h2+h4+h5+h6"), ("specforge", "h2+h4+h5+final_norm")],
    ids=["speculators", "legacy", "specforge"],
)
def test_dump_round_trips_in_every_format(models, target, tmp_path, fmt, layers):
    path = _dump(models, tmp_path, fmt, layers)
    dump = read_dump(path)  # format detected from the layout
    assert dump.format == fmt and len(dump.samples) == len(PROMPTS) and not dump.skipped
    s = dump.samples[0]
    assert s.fc_count == 3 and len(s) == len(PROMPTS[0]) + 6
    assert s.input_ids[: len(PROMPTS[0])].tolist() == PROMPTS[0]
    assert s.loss_mask.tolist() == [False] * len(PROMPTS[0]) + [True] * 6
    ref = _reference(target, s.input_ids)
    names = [f"target.{x}" if x == "final_norm" else f"target.h.{x[1:]}" for x in layers.split("+")]
    assert torch.equal(s.fc_in, torch.cat([ref[n] for n in names[:3]], dim=-1))
    assert torch.equal(s.verifier, ref[names[3]])
    assert dump.find(PROMPTS[1]) == (dump.samples[1], len(PROMPTS[1]))
    assert dump.find([1, 2, 3]) is None


# -- layer identity --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layers, expected",
    [
        (
            "h0+h2+h4+h5",
            "dumped tensors = [h0, h2, h4, h5]; trainer fed fc [h0, h2, h4]; verifier = h5 (not the final layer; the target has 6 layers)",
        ),
        (
            "h4+h0+h2+h6",
            "dumped tensors = [h4, h0, h2, h6]; trainer fed fc [h4, h0, h2]; verifier = h6 (the final layer)",
        ),
        (
            "h3+h5+h6+final_norm",
            "dumped tensors = [h3, h5, h6, final_norm]; trainer fed fc [h3, h5, h6]; verifier = final_norm (the final layer, after the norm)",
        ),
    ],
    ids=["embedding-included", "permuted", "off-by-one"],
)
def test_identification_against_the_target(models, target, tmp_path, layers, expected):
    s = read_dump(_dump(models, tmp_path, "speculators", layers, PROMPTS[:2])).samples[0]
    ident = identify_against_target(s.tensors, _reference(target, s.input_ids), s.fc_count, L)
    assert ident.summary() == expected
    assert all(t.rel_err < 1e-6 for t in ident.tensors)
    if "permuted" in expected or layers.startswith("h4"):
        assert "fc tensors are not in depth order (permuted)" in ident.notes


def _stats(models, target, tmp_path, layers):
    dump = read_dump(_dump(models, tmp_path, "speculators", layers))
    samples = dump.samples
    return identify_by_statistics(
        [s.tensors for s in samples],
        [s.input_ids for s in samples],
        [s.loss_mask for s in samples],
        samples[0].fc_count,
        target.get_input_embeddings().weight.detach(),
        target.lm_head.weight.detach(),
        target.model.norm.weight.detach(),
        target.config.rms_norm_eps,
    )


def test_statistics_find_the_embedding_and_a_verifier_that_is_not_final(models, target, tmp_path):
    ident = _stats(models, target, tmp_path, "h0+h2+h4+h5")
    assert ident.tensors[0].name == "target.h.0"
    assert [t.name for t in ident.tensors[1:]] == [None, None, None]
    assert ident.verifier_is_final() is False
    assert ident.summary().startswith(
        "dumped tensors = [h0, ?, ?, ?]; trainer fed fc [h0, ?, ?]; verifier = ? (not the final layer)"
    )
    assert any("not the final layer" in n for n in ident.notes)


def test_statistics_flag_a_permuted_dump_and_accept_a_final_verifier(models, target, tmp_path):
    ident = _stats(models, target, tmp_path, "h4+h1+h2+h6")
    assert ident.tensors[0].name is None  # no tensor equals the embedding
    assert any("not in depth order" in n for n in ident.notes)
    assert ident.verifier_is_final() is True and ident.verifier.top1_next == 1.0


@pytest.mark.parametrize("normed", [True, False], ids=["specforge-normed-verifier", "normed-again"])
def test_statistics_take_a_specforge_verifier_as_already_normed(normed):
    # SpecForge stores the verifier after the final norm: lm_head applies directly (norming it again with an
    # uneven weight moves its top-1), and its small norm is no depth cue for the fc tensors before it
    H = 8
    g = torch.Generator().manual_seed(0)
    w = torch.linspace(0.2, 3.0, H)
    dumped, ids, masks = [], [], []
    for _ in range(4):
        verifier = rms_norm(torch.randn(20, H, generator=g), w, 1e-6)  # [n, H], post-norm
        fc = [torch.randn(20, H, generator=g) * scale for scale in (10.0, 20.0, 30.0)]
        dumped.append(fc + [verifier])
        ids.append(torch.cat([torch.zeros(1, dtype=torch.long), verifier.argmax(-1)[:-1]]))  # token i+1 = top-1 at i
        masks.append(torch.ones(20, dtype=torch.bool))
    ident = identify_by_statistics(dumped, ids, masks, 3, None, torch.eye(H), w, 1e-6, verifier_normed=normed)
    depth_note = any("not in depth order" in n for n in ident.notes)
    if normed:
        assert ident.verifier.top1_next == 1.0 and not depth_note, ident.notes
    else:  # what treating it like a pre-norm layer would say
        assert ident.verifier.top1_next < 0.95 and depth_note


# -- bad input --------------------------------------------------------------------------------


def test_bad_samples_are_skipped_with_one_line_each(models, tmp_path):
    path = _dump(models, tmp_path, "speculators", "h0+h2+h4+h5")
    from safetensors.torch import load_file, save_file

    hs = path / "hidden_states"
    (hs / "hs_0.safetensors").write_bytes((hs / "hs_0.safetensors").read_bytes()[:200])  # truncated file
    d = load_file(str(hs / "hs_2.safetensors"))
    d["hidden_states"][3, 1, 5] = float("nan")
    save_file(d, str(hs / "hs_2.safetensors"))
    d = load_file(str(hs / "hs_3.safetensors"))
    save_file(
        {"hidden_states": d["hidden_states"][:, :3].contiguous(), "token_ids": d["token_ids"]},
        str(hs / "hs_3.safetensors"),
    )
    rows = [json.loads(x) for x in (path / "samples.jsonl").read_text().splitlines()]
    rows[4]["input_ids"][2] += 1  # token ids != input ids
    rows[5]["loss_mask"] = rows[5]["loss_mask"][:-1]  # lengths differ
    (path / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dump = read_dump(path)
    assert [s.index for s in dump.samples] == [1]
    lines = dump.skipped
    assert len(lines) == 5 and all(line.endswith("(sample skipped)") for line in lines)
    assert lines[0].startswith(f"{hs / 'hs_0.safetensors'}: cannot be read")
    assert lines[1].startswith(f"{hs / 'hs_2.safetensors'}: hidden_states: 1 NaN/Inf values")
    assert lines[2].startswith(f"{hs / 'hs_3.safetensors'}: hidden_states: 3 layers (2 for fc), but ")
    assert lines[3].startswith(
        f"{hs / 'hs_4.safetensors'}: token_ids: 16 tokens do not equal the dataset's input_ids (16 tokens); first difference at position 2"
    )
    assert lines[4].startswith(f"{hs / 'hs_5.safetensors'}: loss_mask: shape [15], expected [16]")


def test_legacy_and_specforge_bad_fields_are_named(models, tmp_path):
    legacy = _dump(models, tmp_path, "speculators-legacy", "h2+h4+h5+h6", PROMPTS[:2], "legacy")
    data = torch.load(legacy / "data_1.pt", weights_only=True)
    data["hidden_states"][2] = data["hidden_states"][2][:-3]  # truncated layer
    torch.save(data, legacy / "data_1.pt")
    dump = read_dump(legacy)
    assert len(dump.samples) == 1
    assert dump.skipped == [
        f"{legacy / 'data_1.pt'}: hidden_states[2]: 13 positions, but input_ids has 16 (truncated or mismatched dump) (sample skipped)"
    ]
    sf = _dump(models, tmp_path, "specforge", "h2+h4+h5+final_norm", PROMPTS[:2], "sf")
    data = torch.load(sf / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    data["aux_hidden_state"] = data["aux_hidden_state"].long()
    torch.save(data, sf / "rows_0-2000" / "data_0.ckpt")
    assert read_dump(sf).skipped == [
        f"{sf / 'rows_0-2000' / 'data_0.ckpt'}: aux_hidden_state: dtype torch.int64, expected a floating-point hidden state (sample skipped)"
    ]


# -- the seed, end to end ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed(models, target, tmp_path_factory):
    """A miswired dump [h0, h2, h4, h5] (verifier h5, not the final h6) and a draft trained on it as the
    seed's trainer did (fc cat(h0, h2, h4), targets from h5), saved with config ids [2, 4, 5]."""
    from difftest_engines.ref.draft_loading import load_draft
    from difftest_engines.ref.train import TrainData, save_eagle_format, train_draft

    root = tmp_path_factory.mktemp("seed")
    prompts = random_prompts(512, 48, 10, seed=3)
    dump = read_dump(dump_from_target(models[0], root / "data", "speculators", "h0+h2+h4+h5", prompts, 6))
    head = VerifierHead(target.lm_head.weight.detach(), target.model.norm.weight.detach(), target.config.rms_norm_eps)
    normed = torch.stack([rms_norm(s.verifier, head.norm_weight, head.eps) for s in dump.samples])
    data = TrainData(
        torch.stack([s.input_ids for s in dump.samples]),
        torch.stack([s.fc_in for s in dump.samples]),
        torch.stack([head.logits(s.verifier, RULES["speculators"]).argmax(-1) for s in dump.samples]),
        normed,
    )
    torch.manual_seed(0)
    cfg = load_draft(models[1]).config
    draft = train_draft(
        target,
        cfg,
        ["target.h.0", "target.h.2", "target.h.4"],
        data,
        steps=150,
        seed=0,
        batch_size=16,
        temperature=None,
    )
    save_eagle_format(draft, root / "draft", [2, 4, 5])
    return root


def test_train_acc_is_high_under_the_training_wiring_and_low_under_the_engines(models, seed, tmp_path, capsys):
    out_json = tmp_path / "acc.json"
    rc = cli.main(
        [
            "train-acc",
            "--data",
            str(seed / "data"),
            "--draft",
            str(seed / "draft"),
            "--target",
            str(models[0]),
            "--wiring",
            "vllm",
            "--out",
            str(out_json),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "dumped tensors = [h0, h2, h4, h5]; trainer fed fc [h0, h2, h4]; verifier = h5 (not the final layer" in text
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["fc"] for r in rows] == [["h0", "h2", "h4"], ["h2", "h4", "h5"]]
    trained, served = rows[0]["full_acc"][0], rows[1]["full_acc"][0]
    print(f"training accuracy: trainer {trained:.3f}, vllm wiring {served:.3f}")
    assert trained > 0.4 and served < trained - 0.15, (trained, served)


def test_train_acc_states_each_figures_definition_and_the_accept_length_it_predicts(models, seed, tmp_path, capsys):
    out_json = tmp_path / "acc.json"
    rc = cli.main(
        [
            "train-acc",
            "--data",
            str(seed / "data"),
            "--draft",
            str(seed / "draft"),
            "--target",
            str(models[0]),
            "--out",
            str(out_json),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "speculators.full_acc: full_acc_k: origins where draft steps 0..k were all right" in text
    assert "difftest.accept_length: accepted draft tokens + 1 per verify step" in text
    row = json.loads(out_json.read_text())["rows"][0]
    # full_acc_k is P(K > k): the accept length it predicts is 1 + their sum
    assert row["predicted_accept_length"] == pytest.approx(1 + sum(row["full_acc"]))


def test_seed_case_train_engine_passes_and_the_serving_wiring_fails(models, seed, tmp_path):
    (tmp_path / "cases").mkdir()
    prompts = random_prompts(512, 48, 10, seed=3)[:3]
    case = {
        "target": str(models[0]),
        "draft": str(seed / "draft"),
        "wiring": ["h0", "h2", "h4"],
        "prompts": [{"ids": p} for p in prompts],
        "speculative": {"num_steps": 3, "max_new_tokens": 12},
        "engines": {"train": {"data": str(seed / "data")}},
    }
    (tmp_path / "cases" / "seed_train.yaml").write_text(json.dumps(case))
    run = run_pytest(tmp_path, "cases/", "--engines=ref,train,ref[wiring=vllm]")
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length", "train_accuracy"):
        assert run.outcome("seed_train", "train", check).outcome == "passed", (check, run.output[-3000:])
    fc = run.outcome("seed_train", "ref[wiring=vllm]", "fc_inputs")
    assert fc.outcome == "failed" and "pattern: embedding dropped" in fc.message
    acc = run.outcome("seed_train", "ref[wiring=vllm]", "train_accuracy")
    assert acc.outcome == "failed"
    assert acc.message.startswith("training accuracy collapses under this engine's wiring")
    assert "with ref[wiring=vllm]'s fc [h2, h4, h5] (the engine's capture)" in acc.message
    assert "verifier = h5 (not the final layer" in acc.message
    assert run.returncode == 1
    shutil.rmtree(tmp_path / "cases")


# -- the trainers' layouts ----------------------------------------------------------------------------


def _synthetic(n: int = 3) -> list:
    g = torch.Generator().manual_seed(0)
    return [([1, 2, 3, 4, 5], [0, 1, 1, 1, 1], [torch.randn(5, 8, generator=g) for _ in range(4)]) for _ in range(n)]


def test_specforge_compressed_rows_are_read_and_a_damaged_one_is_skipped_naming_it(tmp_path):
    from difftest_engines.trainingdata.formats import write_dump

    out = write_dump(tmp_path / "sf", "specforge", _synthetic(), fc_count=3, compress=True)
    bad = out / "rows_0-2000" / "data_1.ckpt.gz"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated gzip stream
    (out / "vocab_mapping").mkdir()
    torch.save(
        {"d2t": torch.zeros(2)}, out / "vocab_mapping" / "vocab_mapping.pt"
    )  # SpecForge writes it beside the rows
    dump = read_dump(out)
    assert dump.format == "specforge" and [s.source for s in dump.samples] == [
        str(out / "rows_0-2000" / "data_0.ckpt.gz"),
        str(out / "rows_0-2000" / "data_2.ckpt.gz"),
    ]
    assert len(dump.skipped) == 1 and dump.skipped[0].startswith(f"{bad}: cannot be read (")


def test_auxiliary_files_alone_are_no_training_data(tmp_path):
    from difftest.base.errors import ConfigError

    (tmp_path / "vocab_mapping").mkdir()
    torch.save({"d2t": torch.zeros(2)}, tmp_path / "vocab_mapping" / "vocab_mapping.pt")
    torch.save({"counts": torch.zeros(2)}, tmp_path / "token_freq.pt")
    with pytest.raises(ConfigError, match="no training data found"):
        read_dump(tmp_path)


# -- the speculators dataset part as `prepare-data` writes it ------------------------------------------


def _save_to_disk_layout(path, rows: list[dict], shards: int = 1) -> None:
    """The folder `datasets` save_to_disk writes (state.json listing data-XXXXX-of-YYYYY.arrow, each an
    Arrow IPC stream), written with pyarrow alone so the core environment can build it."""
    import pyarrow as pa

    path.mkdir(parents=True, exist_ok=True)
    per = -(-len(rows) // shards)
    names = [f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)]
    for k, name in enumerate(names):
        part = rows[k * per : (k + 1) * per]
        table = pa.table(
            {
                "input_ids": pa.array([r["input_ids"] for r in part], pa.list_(pa.int64())),
                "loss_mask": pa.array([r["loss_mask"] for r in part], pa.list_(pa.int64())),
                "seq_len": pa.array([len(r["input_ids"]) for r in part], pa.int64()),
            }
        )
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=2)  # several record batches per shard
    (path / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names], "_format_type": "torch"})
    )
    (path / "dataset_info.json").write_text("{}")


def _as_prepare_data(dump_dir, out, shards: int = 2):
    """A difftest dump's dataset part rewritten as prepare-data's arrow folder (samples.jsonl removed)."""
    rows = [json.loads(x) for x in (dump_dir / "samples.jsonl").read_text().splitlines()]
    for r in rows:  # a mask the jsonl did not have, so reading it from the arrow columns shows
        r["loss_mask"] = [int(i % 3 != 0) for i in range(len(r["input_ids"]))]
    _save_to_disk_layout(out, rows, shards)
    return rows


def test_speculators_arrow_dataset_part_is_read_by_the_default_install(models, tmp_path):
    data = _dump(models, tmp_path, "speculators", "h0+h2+h4+h5")
    rows = _as_prepare_data(data, data, shards=2)
    (data / "samples.jsonl").unlink()
    dump = read_dump(data)
    assert dump.format == "speculators" and not dump.skipped and not dump.notes
    assert len(dump.samples) == len(rows)
    for s, r in zip(dump.samples, rows):  # row i across both shards and their batches is hs_{i}
        assert s.input_ids.tolist() == r["input_ids"]
        assert s.loss_mask.tolist() == [bool(m) for m in r["loss_mask"]]


def test_a_dataset_row_whose_tokens_differ_from_its_hidden_states_skips_that_sample(models, tmp_path):
    data = _dump(models, tmp_path, "speculators", "h0+h2+h4+h5")
    rows = [json.loads(x) for x in (data / "samples.jsonl").read_text().splitlines()]
    rows[1], rows[2] = rows[2], rows[1]  # the dataset's order no longer matches hs_1 / hs_2
    (data / "samples.jsonl").unlink()
    _save_to_disk_layout(data, rows)
    dump = read_dump(data)
    assert [s.index for s in dump.samples] == [0, 3, 4, 5]
    assert [line.split(": ")[1] for line in dump.skipped] == ["token_ids", "token_ids"]


def test_prepare_data_folder_without_hidden_states_says_where_they_are_expected(models, tmp_path):
    from difftest.base.errors import ConfigError

    data = _dump(models, tmp_path, "speculators", "h0+h2+h4+h5")
    _as_prepare_data(data, tmp_path / "prepared", shards=2)
    with pytest.raises(ConfigError) as e:
        read_dump(tmp_path / "prepared")
    msg = str(e.value)
    assert "\n" not in msg and "no training data found" not in msg
    assert (
        f"holds a speculators arrow dataset ({len(PROMPTS)} samples in data-00000-of-00002.arrow .. data-00001-of-00002.arrow)"
        in msg
    )
    assert f"expected {tmp_path / 'prepared' / 'hidden_states'}/hs_*.safetensors" in msg
    assert "hidden_states=DIR (train-acc: --hidden-states DIR)" in msg


def test_a_dataset_dictionary_folder_is_refused_naming_the_split_to_give(tmp_path):
    from difftest.base.errors import ConfigError

    _save_to_disk_layout(tmp_path / "dd" / "train", [{"input_ids": [1, 2], "loss_mask": [1, 1]}])
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(
        ConfigError, match=r"is a dataset dictionary \(splits: train\); give one split's folder, e.g. .*/dd/train$"
    ):
        read_dump(tmp_path / "dd", hidden_states=tmp_path)


def test_train_acc_reads_hidden_states_from_the_folder_given_as_hidden_states(models, tmp_path, capsys):
    data = _dump(models, tmp_path, "speculators", "h0+h2+h4+h5")
    args = ["train-acc", "--draft", str(models[1]), "--target", str(models[0]), "--ttt-steps", "2"]
    assert cli.main([*args, "--data", str(data), "--out", str(tmp_path / "here.json")]) == 0
    rows = _as_prepare_data(data, tmp_path / "prepared")
    (data / "hidden_states").rename(tmp_path / "elsewhere")  # as generate-offline-data --output puts them
    capsys.readouterr()
    rc = cli.main(
        [
            *args,
            "--data",
            str(tmp_path / "prepared"),
            "--hidden-states",
            str(tmp_path / "elsewhere"),
            "--out",
            str(tmp_path / "apart.json"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"(speculators, {len(PROMPTS)} samples, 0 skipped; hidden states from {tmp_path / 'elsewhere'})" in out
    here, apart = (json.loads((tmp_path / f).read_text())["rows"][0] for f in ("here.json", "apart.json"))
    # the positions counted at step 0 are those the arrow part's own loss mask selects (speculators: m_{i+1})
    assert apart["counted"][0] == sum(sum(r["loss_mask"][1:]) for r in rows) != here["counted"][0]


def test_train_acc_refuses_a_missing_hidden_states_folder_in_one_line(models, tmp_path, capsys):
    data = _dump(models, tmp_path, "speculators", "h0+h2+h4+h5")
    capsys.readouterr()  # the dump's own model loading
    rc = cli.main(
        [
            "train-acc",
            "--data",
            str(data),
            "--draft",
            str(models[1]),
            "--target",
            str(models[0]),
            "--hidden-states",
            str(tmp_path / "nope"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert err == f"difftest train-acc: --hidden-states: {tmp_path / 'nope'}: directory not found\n"


def test_an_empty_hidden_states_folder_names_the_option_to_give_another(models, tmp_path):
    from difftest.base.errors import ConfigError

    data = _dump(models, tmp_path, "speculators", "h0+h2+h4+h5")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ConfigError,
        match=r"empty: no hs_\*.safetensors files .*check the folder given as hidden_states=DIR \(train-acc: --hidden-states DIR\)$",
    ):
        read_dump(data, hidden_states=tmp_path / "empty")
