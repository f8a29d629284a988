"""The train engine's settings (difftest.settings): the case's `engines.train` merged with `train[...]`."""

from difftest.settings import Schema, Setting

SCHEMA = Schema("train", (
    Setting("data", "path", "the dump directory (relative to the case file; fixture:NAME for built-in dumps)"),
    Setting("format", "choice", "the dump's format", default="auto",
            choices=("auto", "speculators", "speculators-legacy", "specforge")),
    Setting("identify", "choice", "identify dumped tensors by a target run or by statistics", default="target",
            choices=("target", "stats")),
    Setting("wiring", "wiring", "feed fc with these tensors instead of the trainer's (e.g. h2+h4+h7)"),
    Setting("ttt_steps", "int", "training-accuracy unroll depth (default: the case's speculative.num_steps)", min=1),
))  # fmt: skip
