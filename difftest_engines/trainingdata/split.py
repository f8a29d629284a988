"""The trainer's train / validation split of the training data, reproduced row for row.

speculators (0.9.0 `train/data.py::ArrowDataset.__init__`, called by `train/dataloader.py::
create_train_val_loaders` with `--train-data-ratio`, default 0.9 in `train/config/schema.py`): the split is
contiguous and involves no seed (the seed orders the training batches only; validation keeps a fixed
order). With N the dataset's rows (`len(load_from_disk(DATA))`, every row, usable or not) and
`split_idx = int(N * train_data_ratio)`, the training split is rows [0, split_idx) and the validation
split rows [split_idx, N); row i's hidden states are hs_{i}.safetensors. `speculators train` records the
ratio in SAVE_PATH/run.yaml (`train/config/artifacts.py::dump_yaml`: `train.data.train_data_ratio`,
written only when not the default, which run.yaml omits by design) beside the epoch folders it saves the
draft in, and the argv in train_command.txt.

A split is reproduced only when every row in it is a usable sample here: a row the trainer would
generate (`--on-missing generate`, the default) or skip is not in the data, so the counts could not be the
trainer's. SpecForge 0.2.0 takes its evaluation data as a separate offline folder (`data.eval_hidden_states_path`
with `training.eval_interval`, config/schema.py), no split of the training data: score that folder whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from difftest.api import ConfigError
from difftest_engines.trainingdata.formats import Dump, Sample

SPLITS = ("all", "train", "val")
SPECULATORS_DEFAULT_RATIO = 0.9  # speculators 0.9.0 train/config/schema.py: train_data_ratio


@dataclass(frozen=True)
class Split:
    name: str  # all | train | val
    start: int  # first dataset row
    stop: int  # one past the last
    rows: int  # the dataset's rows
    ratio: float | None
    ratio_source: str  # where the ratio came from

    def describe(self) -> str:
        if self.name == "all":
            return "all samples"
        return (
            f"the trainer's {'validation' if self.name == 'val' else 'training'} split: rows {self.start}..{self.stop - 1} "
            f"of {self.rows} (train_data_ratio {self.ratio:g} from {self.ratio_source}; speculators' "
            f"split_idx = int({self.rows} * {self.ratio:g}) = {self.stop if self.name == 'train' else self.start})"
        )


def run_data_settings(draft: str | Path) -> tuple[dict, Path] | None:
    """The `train.data` section of the run.yaml `speculators train` saved beside this draft (in the draft folder,
    or the save path above an epoch folder), and its path; None when neither holds one."""
    import yaml

    for folder in (Path(draft), Path(draft).parent):
        f = folder / "run.yaml"
        if not f.is_file():
            continue
        try:
            data = ((yaml.safe_load(f.read_text()) or {}).get("train") or {}).get("data") or {}
            if not isinstance(data, dict):
                raise TypeError
        except (yaml.YAMLError, AttributeError, TypeError, OSError) as e:
            raise ConfigError(f"{f}: cannot be read as speculators' run.yaml ({type(e).__name__})") from None
        return data, f
    return None


def recorded_ratio(draft: str | Path) -> tuple[float, str] | None:
    """The train_data_ratio of the `speculators train` run that saved this draft, and where it was read."""
    found = run_data_settings(draft)
    if found is None:
        return None
    data, f = found
    if "train_data_ratio" not in data:  # run.yaml omits defaults (artifacts.py::dump_yaml)
        return SPECULATORS_DEFAULT_RATIO, f"{f} (no train.data.train_data_ratio: speculators' default)"
    value = data["train_data_ratio"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{f}: train.data.train_data_ratio: expected a number, got {value!r}")
    return float(value), f"{f}"


def choose_split(dump: Dump, split: str, ratio: float | None, draft: str | Path, where: str = "split") -> Split:
    """The rows `split` names, with the ratio given, else the one recorded beside the draft; refused in one
    line when the trainer's split cannot be reproduced from this data."""
    if split not in SPLITS:
        raise ConfigError(f"{where}: {split!r}: expected one of {', '.join(SPLITS)}")
    if split == "all":
        return Split(
            "all", 0, dump.dataset_rows or len(dump.samples), dump.dataset_rows or len(dump.samples), ratio, ""
        )
    if dump.format != "speculators":
        raise ConfigError(
            f"{where}={split}: only speculators data has a trainer split to reproduce (this data is {dump.format}; "
            "SpecForge evaluates on its own folder, data.eval_hidden_states_path); score that folder whole (split=all)"
        )
    if dump.dataset_rows is None:
        raise ConfigError(
            f"{where}={split}: {dump.path}: the dataset part's row count is unknown "
            f"({'; '.join(dump.notes) or 'no arrow dataset or samples.jsonl numbered 0..N-1'}), "
            "so speculators' split cannot be reproduced"
        )
    if ratio is not None:
        source = "the train_data_ratio setting (train-acc: --train-data-ratio)"
    else:
        found = recorded_ratio(draft)
        if found is None:
            raise ConfigError(
                f"{where}={split}: the training run's train_data_ratio is not recorded beside the draft "
                f"(no run.yaml in {Path(draft)} or its parent); give it with --train-data-ratio "
                f"(train_data_ratio=...; speculators' default {SPECULATORS_DEFAULT_RATIO})"
            )
        ratio, source = found
    if not 0.0 < ratio < 1.0:  # train/dataloader.py::create_train_val_loaders refuses the same
        raise ConfigError(
            f"{where}={split}: train_data_ratio {ratio:g} (from {source}): speculators needs 0 < ratio < 1"
        )
    n = dump.dataset_rows
    split_idx = int(n * ratio)  # train/data.py::ArrowDataset, the one expression both splits use
    start, stop = (0, split_idx) if split == "train" else (split_idx, n)
    if start >= stop:
        raise ConfigError(
            f"{where}={split}: the {split} split is empty ({n} rows, train_data_ratio {ratio:g} gives "
            f"split_idx {split_idx})"
        )
    chosen = Split(split, start, stop, n, ratio, source)
    missing = sorted(set(range(start, stop)) - {s.index for s in dump.samples})
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(
            f"{where}={split}: {len(missing)} of the split's rows have no usable sample here (rows {shown}; "
            f"{len(dump.skipped)} skipped when reading); the trainer would have generated or skipped them, "
            "so its counts on this split cannot be reproduced"
        )
    return chosen


def samples_in(dump: Dump, split: Split) -> list[Sample]:
    if split.name == "all":
        return list(dump.samples)
    return [s for s in dump.samples if split.start <= s.index < split.stop]
