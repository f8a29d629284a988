"""The train engine's settings (difftest.base.settings): the case's `engines.train` merged with `train[...]`."""

from difftest.api import Schema, Setting, settings_record

SCHEMA = Schema(
    "train",
    (
        Setting("data", "path", "the dump directory (relative to the case file; fixture:NAME for built-in dumps)"),
        Setting(
            "format",
            "choice",
            "the dump's format",
            default="auto",
            choices=("auto", "speculators", "speculators-legacy", "specforge"),
        ),
        Setting(
            "identify",
            "choice",
            "identify dumped tensors by a target run or by statistics",
            default="target",
            choices=("target", "stats"),
        ),
        Setting("wiring", "wiring", "feed fc with these tensors instead of the trainer's (e.g. h2+h4+h7)"),
        Setting(
            "ttt_steps",
            "int",
            "training-accuracy unroll depth (default: the trainer's own, 3 speculators / 7 SpecForge)",
            min=1,
        ),
        Setting(
            "max_len", "int", "truncate every sample to this many tokens before scoring, as the trainer does", min=1
        ),
        Setting(
            "hidden_states", "path", "the hidden-state folder when it is not DATA/hidden_states (speculators --output)"
        ),
        Setting(
            "split",
            "choice",
            "score all samples, or the trainer's train / val split (speculators --train-data-ratio)",
            default="all",
            choices=("all", "train", "val"),
        ),
        Setting(
            "train_data_ratio", "float", "the trainer's --train-data-ratio (default: the run.yaml beside the draft)"
        ),
        Setting(
            "trainer", "str", "the trainer rules: speculators@VERSION or specforge@VERSION (default: from the data)"
        ),
    ),
)

# what the adapter reads them as (Engine.settings_for): one attribute per setting
Settings = settings_record(SCHEMA)
