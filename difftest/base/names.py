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

import fnmatch
import re

# The canonical names code refers to by name (the rest are built from DRAFT_ORDER and indices).
TARGET_PREFIX = "target."
DRAFT_PREFIX = "draft."
HIDDEN_PREFIX = "target.h."  # + k
FINAL_NORM = "target.final_norm"
TARGET_LOGITS = "target.logits"
EMBEDS = "draft.embeds"
FC_IN = "draft.fc_in"
FC_CHUNK_PREFIX = "draft.fc_in."  # + j
FC_OUT = "draft.fc_out"
DRAFT_LOGITS = "draft.logits"
DRAFT_LOGITS_TARGET = "draft.logits_target"


def hidden_name(k: int) -> str:
    """target.h.{k}: the residual stream entering target layer k."""
    return f"{HIDDEN_PREFIX}{k}"


def hidden_index(name: str) -> int | None:
    """k of `target.h.{k}`; None for any other name."""
    m = _HIDDEN.fullmatch(name)
    return int(m.group(1)) if m else None


def short_name(name: str) -> str:
    """target.h.{k} as h{k}, other target names without `target.` (the wiring as reports write it)."""
    k = hidden_index(name)
    return f"h{k}" if k is not None else name.removeprefix(TARGET_PREFIX)


def fc_chunk_name(j: int) -> str:
    return f"{FC_CHUNK_PREFIX}{j}"


def in_fc_in(name: str) -> bool:
    """draft.fc_in or one of its chunks."""
    return name == FC_IN or name.startswith(FC_CHUNK_PREFIX)


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

_HIDDEN = re.compile(r"target\.h\.(\d+)")
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
# (difftest.compare.noise). fc_in chunks take the reference's wiring (target tensors); the draft's own
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
        return [draft_name(step, p) for p in _DRAFT_INPUTS[part] if p != "fc_out"] + [
            draft_name(prev, "hidden_prenorm")
        ]
    return [draft_name(step, p) for p in _DRAFT_INPUTS.get(part, [])]


# -- the vocabulary as a grammar: which names a case's captures can hold ------------------------
# A case's `tolerances:` and `allow_missing:` patterns are fnmatch globs over these names; one that
# matches none of them would be ignored without a word (a typo such as draft.logitz), so the case
# loader refuses it (difftest.case.case). Indices make the vocabulary infinite (target.h.<k> for any
# layer k), so validity is decided against templates, not against one capture's names: a pattern
# is valid if some name of some template matches it.
STEP_PARTS = [p for p in DRAFT_ORDER if p not in ("fc_in", "fc_out")]  # fc runs at step 0 only
_NAT, _POS = "<k>", "<s>"  # template slots: an integer >= 0, and one >= 1 (a later draft step)
_MAX_LISTED_STEPS = 64  # past this many draft steps the step slot stands for any step >= 1
_DIGITS, _NONZERO = frozenset("0123456789"), frozenset("123456789")
NAME_FORMS = (
    "target.h.<k>, target.final_norm, target.logits, draft.<name>, draft.fc_in.<k>, draft.step<s>.<name> "
    "(<name>: " + ", ".join(DRAFT_ORDER) + ")"
)


def name_templates(num_steps: int | None = None) -> list[str]:
    """The canonical names a capture can hold, `<k>` standing for an index >= 0 and `<s>` for a
    draft step >= 1. With `num_steps` (the case's), its later steps are listed one by one
    (draft.step1.* .. draft.step{num_steps-1}.*); the target's layer count is not known without
    loading its config, so target.h.<k> stays open."""
    out = ["target.h.<k>", "target.final_norm", "target.logits"]
    out += [f"draft.{p}" for p in DRAFT_ORDER] + ["draft.fc_in.<k>"]
    if num_steps is None or num_steps - 1 > _MAX_LISTED_STEPS:
        steps = [_POS] if num_steps is None or num_steps > 1 else []
    else:
        steps = [str(s) for s in range(1, num_steps)]
    out += [f"draft.step{s}.{p}" for s in steps for p in STEP_PARTS]
    return out


def example_names(num_steps: int | None = None) -> list[str]:
    """Concrete names and the usual group patterns, to suggest the closest to a pattern that
    matches nothing."""
    last = 3 if num_steps is None else min(num_steps - 1, 3)
    names = ["target.h.0", "target.final_norm", "target.logits", *(f"draft.{p}" for p in DRAFT_ORDER), "draft.fc_in.0"]
    names += [f"draft.step{s}.{p}" for s in range(1, last + 1) for p in STEP_PARTS]
    groups = [
        "*",
        "target.*",
        "target.h.*",
        "draft.*",
        "draft.fc_in.*",
        "draft.layer0.*",
        "draft.logits*",
        "draft.step*",
        *(f"draft.step{s}.*" for s in range(1, last + 1)),
    ]
    return names + groups


def pattern_could_match(pattern: str, num_steps: int | None = None) -> bool:
    """Whether the fnmatch pattern (fnmatchcase semantics: *, ?, [seq], [!seq]) matches some
    canonical name (name_templates). Exact: each template and the pattern are read as automata and
    their product is searched, so `target.h.6?` and `draft.step1[0-9].*` are judged without
    listing indices."""
    glob = _glob_tokens(pattern)
    return any(_intersects(glob, t) for template in name_templates(num_steps) for t in _template_tokens(template))


def _glob_tokens(pattern: str) -> list[tuple]:
    """('lit', c) | ('any',) | ('star',) | ('set', matcher), splitting [...] as fnmatch.translate does."""
    out: list[tuple] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not out or out[-1] != ("star",):  # ** is *
                out.append(("star",))
        elif c == "?":
            out.append(("any",))
        elif c == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out.append(("lit", "["))  # fnmatch reads an unclosed [ literally
            else:
                out.append(("set", re.compile(fnmatch.translate(pattern[i - 1 : j + 1])).match))
                i = j + 1
        else:
            out.append(("lit", c))
    return out


def _template_tokens(template: str) -> list[list[tuple]]:
    """A template's alternatives as ('lit', c) | ('nz',) one digit 1-9 | ('dstar',) digits, any
    number: <k> is 0 or a number without a leading zero, <s> the latter only (names are str(int))."""
    variants: list[list[tuple]] = [[]]
    rest = template
    while rest:
        if rest.startswith(_NAT):
            variants = [v + alt for v in variants for alt in ([("lit", "0")], [("nz",), ("dstar",)])]
            rest = rest[len(_NAT) :]
        elif rest.startswith(_POS):
            variants = [v + [("nz",), ("dstar",)] for v in variants]
            rest = rest[len(_POS) :]
        else:
            variants = [v + [("lit", rest[0])] for v in variants]
            rest = rest[1:]
    return variants


def _chars(token: tuple) -> frozenset[str]:
    return frozenset(token[1]) if token[0] == "lit" else _NONZERO if token[0] == "nz" else _DIGITS


def _accepts(token: tuple, ch: str) -> bool:
    kind = token[0]
    return kind == "any" or (kind == "lit" and token[1] == ch) or (kind == "set" and token[1](ch) is not None)


def _intersects(glob: list[tuple], template: list[tuple]) -> bool:
    """Some string both the glob and the template produce: a search over (glob position,
    template position); a star or a digit run consumes without advancing, so it is finite."""
    seen: set[tuple[int, int]] = set()
    stack = [(0, 0)]
    while stack:
        i, j = stack.pop()
        if (i, j) in seen:
            continue
        seen.add((i, j))
        if i == len(glob) and j == len(template):
            return True
        star = i < len(glob) and glob[i][0] == "star"
        if star:
            stack.append((i + 1, j))  # the star matches nothing more
        if j < len(template):
            t = template[j]
            after = j if t[0] == "dstar" else j + 1
            if t[0] == "dstar":
                stack.append((i, j + 1))  # the digit run ends
            if star:
                stack.append((i, after))  # the star takes this character
            elif i < len(glob) and any(_accepts(glob[i], ch) for ch in _chars(t)):
                stack.append((i + 1, after))
    return False
