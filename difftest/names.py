"""The canonical tensor vocabulary and its data-flow order.

    target.h.{k}            residual stream entering target layer k (k=0: embedding output,
                            k=L: last layer output before the final norm)
    target.final_norm       the final norm's output (HF's hidden_states[L])
    target.logits           [n, V]
    draft.embeds            embedding of the draft's input tokens (token i+1 at row i)
    draft.fc_in             exactly what enters fc (before any input norm), [n, A*H_target]
    draft.fc_in.{j}         its j-th H_target-wide chunk (a view, not stored)
    draft.fc_out            [n, H]
    draft.layer0.attn_in    cat(norm(embeds), norm(hidden)), [n, 2H]
    draft.layer0.attn_out   [n, H]
    draft.layer0.mlp_out    [n, H]
    draft.hidden_prenorm    residual stream after the layer, [n, H]
    draft.logits            draft vocab, [n, V_draft]
    draft.logits_target     scattered into the target vocab through d2t (-inf elsewhere), [n, V]

Draft step 0 runs over every prompt position (row i = prompt position i); steps s >= 1
run on the new last position only and are named `draft.step{s}.<name>`.
"""

from __future__ import annotations

import re

DRAFT_ORDER = [
    "embeds",
    "fc_in",
    "fc_out",
    "layer0.attn_in",
    "layer0.attn_out",
    "layer0.mlp_out",
    "hidden_prenorm",
    "logits",
    "logits_target",
]

_STEP = re.compile(r"draft\.step(\d+)\.(.+)")
_CHUNK = re.compile(r"draft\.fc_in\.(\d+)")


def draft_name(step: int, name: str) -> str:
    return f"draft.{name}" if step == 0 else f"draft.step{step}.{name}"


def split_draft(name: str) -> tuple[int, str] | None:
    """'draft.step2.logits' -> (2, 'logits'); 'draft.fc_out' -> (0, 'fc_out'); others -> None."""
    m = _STEP.fullmatch(name)
    if m:
        return int(m.group(1)), m.group(2)
    if name.startswith("draft."):
        return 0, name[len("draft.") :]
    return None


def fc_chunk_index(name: str) -> int | None:
    m = _CHUNK.fullmatch(name)
    return int(m.group(1)) if m else None


def order_key(name: str) -> tuple:
    """Sort key putting names in data-flow order; unknown names go last, alphabetically."""
    if name.startswith("target.h."):
        return (0, int(name.rsplit(".", 1)[1]))
    if name == "target.final_norm":
        return (1,)
    if name == "target.logits":
        return (2,)
    j = fc_chunk_index(name)
    if j is not None:
        return (3, 0, DRAFT_ORDER.index("fc_in"), j + 1)
    d = split_draft(name)
    if d is not None and d[1] in DRAFT_ORDER:
        return (3, d[0], DRAFT_ORDER.index(d[1]), 0)
    return (9, name)


def in_dataflow_order(names) -> list[str]:
    return sorted(names, key=order_key)


# What each canonical tensor is computed from, for localising where an error is introduced
# (difftest.noise). fc_in chunks take the reference's wiring (target tensors); the draft's own
# tensors follow Eagle3 decoder-layer data flow: attn_in = cat(norm(embeds), norm(fc_out)); the
# residual around attention is fc_out (or its norm, norm_before_residual); step s >= 1 reads
# the previous step's hidden state and the token drafted from its logits.
_DRAFT_INPUTS = {
    "fc_out": ["fc_in"],
    "layer0.attn_in": ["embeds", "fc_out"],
    "layer0.attn_out": ["layer0.attn_in"],
    "layer0.mlp_out": ["layer0.attn_out", "fc_out"],
    "hidden_prenorm": ["layer0.mlp_out", "layer0.attn_out", "fc_out"],
    "logits": ["hidden_prenorm"],
    "logits_target": ["logits"],
}


def inputs_of(name: str, wiring: list[str] | None = None, num_layers: int | None = None) -> list[str]:
    """The canonical tensors `name` is computed from (empty for sources: embeddings, token ids)."""
    if name.startswith("target.h."):
        k = int(name.rsplit(".", 1)[1])
        return [f"target.h.{k - 1}"] if k > 0 else []
    if name == "target.final_norm":
        return [f"target.h.{num_layers}"] if num_layers is not None else []
    if name == "target.logits":
        return ["target.final_norm"]
    j = fc_chunk_index(name)
    if j is not None:
        return [wiring[j]] if wiring and j < len(wiring) else []
    d = split_draft(name)
    if d is None:
        return []
    step, part = d
    if part == "fc_in":
        return list(wiring or [])
    if step == 0:
        return [draft_name(0, p) for p in _DRAFT_INPUTS.get(part, [])]
    prev = step - 1
    if part == "embeds":
        return [draft_name(prev, "logits_target")]
    if part == "layer0.attn_in":
        return [draft_name(step, "embeds"), draft_name(prev, "hidden_prenorm")]
    if part == "layer0.attn_out":
        # attention reads this position and the KV cache of every earlier one
        return [draft_name(step, "layer0.attn_in")] + [draft_name(s, "layer0.attn_in") for s in range(step)]
    if part in ("layer0.mlp_out", "hidden_prenorm"):
        return [draft_name(step, p) for p in _DRAFT_INPUTS[part] if p != "fc_out"] + [draft_name(prev, "hidden_prenorm")]
    return [draft_name(step, p) for p in _DRAFT_INPUTS.get(part, [])]
