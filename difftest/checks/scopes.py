"""Which canonical tensors a check judges: the fc inputs (target hidden states and draft.fc_in)
or what the draft computes after them."""

from __future__ import annotations

from difftest.base.names import TARGET_PREFIX, in_fc_in, split_draft


def in_fc_scope(name: str) -> bool:
    return name.startswith(TARGET_PREFIX) or in_fc_in(name)


def in_draft_scope(name: str) -> bool:
    d = split_draft(name)
    return d is not None and not d[1].startswith("fc_in") and d[1] != "embeds"
