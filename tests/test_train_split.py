"""`train-acc --split`: the trainer's train / validation split of speculators data, reproduced or refused.

speculators 0.9.0 (`train/data.py::ArrowDataset`): split_idx = int(N * train_data_ratio), validation = rows
[split_idx, N), no seed; `speculators train` records the ratio in run.yaml beside its checkpoints and omits it
when it is the default 0.9. Checked against speculators' own ArrowDataset in tests/test_trainer_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from difftest.base.errors import ConfigError
from difftest_engines.trainingdata.formats import read_dump, write_dump
from difftest_engines.trainingdata.split import SPECULATORS_DEFAULT_RATIO, choose_split, samples_in


def _dump(root: Path, n: int = 10, fmt: str = "speculators") -> Path:
    g = torch.Generator().manual_seed(0)
    samples = [([1 + i, 2, 3, 4], [0, 1, 1, 1], [torch.randn(4, 8, generator=g) for _ in range(3)]) for i in range(n)]
    return write_dump(root / "data", fmt, samples, fc_count=2)


def _draft(root: Path, run_yaml: str | None) -> Path:
    epoch = root / "ckpt" / "2"
    epoch.mkdir(parents=True)
    if run_yaml is not None:
        (root / "ckpt" / "run.yaml").write_text(run_yaml)
    return epoch


def test_val_split_is_the_rows_from_int_n_times_ratio_to_the_end(tmp_path):
    dump = read_dump(_dump(tmp_path, n=10))
    split = choose_split(dump, "val", 0.75, tmp_path / "nowhere")
    assert (split.start, split.stop) == (7, 10)  # int(10 * 0.75) = 7
    assert [s.index for s in samples_in(dump, split)] == [7, 8, 9]
    train = choose_split(dump, "train", 0.75, tmp_path / "nowhere")
    assert [s.index for s in samples_in(dump, train)] == list(range(7))


def test_the_ratio_is_read_from_the_run_yaml_beside_the_checkpoint(tmp_path):
    dump = read_dump(_dump(tmp_path))
    draft = _draft(tmp_path, "train:\n  data:\n    train_data_ratio: 0.6\n")
    split = choose_split(dump, "val", None, draft)
    assert (split.start, split.ratio) == (6, 0.6) and split.ratio_source.endswith("run.yaml")


def test_a_run_yaml_without_the_ratio_means_speculators_default(tmp_path):
    dump = read_dump(_dump(tmp_path))
    draft = _draft(tmp_path, "train:\n  seed: 0\n")  # run.yaml omits defaults
    split = choose_split(dump, "val", None, draft)
    assert (
        split.ratio == SPECULATORS_DEFAULT_RATIO and split.start == 9 and "speculators' default" in split.ratio_source
    )


def test_no_recorded_ratio_is_refused_naming_the_option_and_the_default(tmp_path):
    dump = read_dump(_dump(tmp_path))
    with pytest.raises(
        ConfigError, match=r"split=val: the training run's train_data_ratio is not recorded .*--train-data-ratio .*0\.9"
    ):
        choose_split(dump, "val", None, _draft(tmp_path, None))


def test_a_missing_row_in_the_split_is_refused(tmp_path):
    data = _dump(tmp_path)
    (data / "hidden_states" / "hs_8.safetensors").unlink()
    dump = read_dump(data)
    with pytest.raises(ConfigError, match=r"1 of the split's rows have no usable sample here \(rows 8;"):
        choose_split(dump, "val", 0.7, tmp_path)
    assert len(samples_in(dump, choose_split(dump, "train", 0.7, tmp_path))) == 7  # the train rows are all there


@pytest.mark.parametrize("ratio, why", [(1.0, r"needs 0 < ratio < 1"), (0.05, r"the train split is empty")])
def test_a_ratio_speculators_refuses_is_refused(tmp_path, ratio, why):
    dump = read_dump(_dump(tmp_path))
    with pytest.raises(ConfigError, match=why):
        choose_split(dump, "val" if ratio == 1.0 else "train", ratio, tmp_path)


def test_specforge_data_has_no_split_to_reproduce(tmp_path):
    dump = read_dump(_dump(tmp_path, fmt="specforge"))
    with pytest.raises(ConfigError, match=r"split=val: only speculators data .*data\.eval_hidden_states_path"):
        choose_split(dump, "val", 0.5, tmp_path)


def test_samples_jsonl_with_a_gap_in_its_numbering_cannot_be_split(tmp_path):
    data = _dump(tmp_path)
    lines = (data / "samples.jsonl").read_text().splitlines()
    (data / "samples.jsonl").write_text("\n".join(lines[:3] + lines[4:]) + "\n")  # row 3 left out
    dump = read_dump(data)
    assert dump.dataset_rows is None
    with pytest.raises(ConfigError, match=r"the dataset part's row count is unknown"):
        choose_split(dump, "val", 0.5, tmp_path)


def test_train_acc_refuses_an_unreproducible_split_in_one_line_before_loading_models(tmp_path, capsys):
    from difftest import cli

    data = _dump(tmp_path)
    rc = cli.main(
        [
            "train-acc",
            "--data",
            str(data),
            "--draft",
            "fixture:tiny-llama-eagle3",
            "--target",
            "fixture:tiny-llama",
            "--split",
            "val",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(
        "difftest train-acc: train: split=val: the training run's train_data_ratio is not recorded"
    )
