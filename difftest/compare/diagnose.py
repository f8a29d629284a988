"""Say *why* engines diverge: which reference tensor each engine chunk really is.

fc inputs: each H-wide chunk of the engine's `draft.fc_in` is matched against every
reference `target.h.{k}` and `target.final_norm` (and, when nothing matches, against
rmsnorm of each: a norm applied before fc). Per candidate we compute the per-token
(per-row) cosine and SGLang rel_diff (1 - 2 sum(xy) / sum(x^2 + y^2)); the best match is
the lowest median rel_diff (cosine alone is blind to per-token scaling, i.e. to a norm).
The matches are compared with the reference wiring and the pattern is named:
off-by-one, permutation, embedding dropped/extra, pre/post final norm, default-layer
fallback, slots shifted, norm applied before fc, chunk count mismatch.

Draft tensors: where the first divergence sits in the draft's data flow names the
suspect (fc, norms, attention, residual, lm_head, vocab map, later steps).
"""

from __future__ import annotations

import torch

from difftest.rules.layer_rules import declared_ids, default_layers
from difftest.records.capture import Capture
from difftest.records.chunk_match import MATCH_REL_DIFF, ChunkMatch, Similarity
from difftest.base.names import FC_IN, FINAL_NORM, HIDDEN_PREFIX, hidden_index, split_draft
from difftest.rules.wiring import hidden_indices, short_name

NORM_PREFIX = "rmsnorm("


def describe(name: str, num_layers: int | None = None) -> str:
    if name.startswith(NORM_PREFIX):
        return f"rmsnorm of {describe(name[len(NORM_PREFIX) : -1], num_layers)}"
    k = hidden_index(name)
    if k == 0:
        return f"{name} (the embedding)"
    if num_layers is not None and k == num_layers:
        return f"{name} (last layer, pre-norm)"
    if name == FINAL_NORM:
        return f"{name} (last layer, post-norm)"
    return name


def _short(name: str | None) -> str:
    if name is None:
        return "?"
    if name.startswith(NORM_PREFIX):
        return f"rmsnorm({short_name(name[len(NORM_PREFIX) : -1])})"
    return short_name(name)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).float()


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def token_similarity(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cosine and rel_diff of two [n, H] tensors (float32)."""
    xy, xx, yy = (x * y).sum(-1), (x * x).sum(-1), (y * y).sum(-1)
    denom = (xx * yy).sqrt()
    cos = torch.where(denom > 0, xy / denom, torch.where(xx == yy, 1.0, 0.0))
    rel = torch.where(xx + yy > 0, 1 - 2 * xy / (xx + yy), 0.0)
    return cos, rel


def _candidates(ref: Capture) -> list[str]:
    return [n for n in ref.names() if n.startswith(HIDDEN_PREFIX) or n == FINAL_NORM]


def _tensor(ref: Capture, name: str) -> torch.Tensor:
    if name.startswith(NORM_PREFIX):
        return _rms_norm(_rows(ref.get(name[len(NORM_PREFIX) : -1])))
    return _rows(ref.get(name))


def _score(chunk: torch.Tensor, ref: Capture, names: list[str]) -> dict[str, tuple[float, float, float]]:
    """name -> (median per-token rel_diff, mean cos, min cos), for candidates of the chunk's shape.

    The median, not the mean: a token an MoE router sent to other experts at a near-tie (a bf16
    DeepSeek-V3 target) moves a whole hidden row by up to 50%, and one or two such rows in a prompt
    lifted the mean above MATCH_REL_DIFF, so a chunk fed the right layer matched none ("different
    layers"). A chunk fed another layer differs on every token, so its median does too."""
    out = {}
    for name in names:
        cand = _tensor(ref, name)
        if cand.shape != chunk.shape:
            continue
        cos, rel = token_similarity(chunk, cand.to(chunk.device))
        out[name] = (float(rel.median()), float(cos.mean()), float(cos.min()))
    return out


def match_chunks(ref: Capture, other: Capture) -> tuple[list[ChunkMatch], Similarity | None]:
    """Match every H-wide chunk of the engine's fc_in; also the chunk x candidate cosine matrix (for plots)."""
    size = ref.fc_chunk_size
    if FC_IN not in other.tensors or not size:
        return [], None
    fc = other.tensors[FC_IN]
    if fc.shape[-1] % size:
        return [], None
    expected = ref.meta.wiring.inputs if ref.meta.wiring else []
    names = _candidates(ref)
    out, matrix = [], []
    for j in range(fc.shape[-1] // size):
        chunk = _rows(fc[..., j * size : (j + 1) * size])
        scores = _score(chunk, ref, names)
        if not scores:
            continue
        matrix.append([scores[n][1] if n in scores else None for n in names])
        best = min(scores, key=lambda n: scores[n][0])
        if scores[best][0] >= MATCH_REL_DIFF:  # nothing raw matches: was a norm applied before fc?
            normed = _score(chunk, ref, [f"{NORM_PREFIX}{n})" for n in names if n.startswith("target.h.")])
            nbest = min(normed, key=lambda n: normed[n][0]) if normed else None
            if nbest is not None and normed[nbest][0] < MATCH_REL_DIFF:
                scores, best = normed, nbest
        rel, cos, min_cos = scores[best]
        rms = chunk.pow(2).mean(-1).sqrt()
        want = expected[j] if j < len(expected) else None
        want_rms = float(_rows(ref.get(want)).pow(2).mean(-1).sqrt().mean()) if want and want in ref else None
        max_abs = float((chunk - _tensor(ref, best).to(chunk.device)).abs().max())
        out.append(
            ChunkMatch(
                j,
                want,
                best,
                cos,
                min_cos,
                rel,
                max_abs,
                float(rms.mean()),
                float(rms.std()) if rms.numel() > 1 else 0.0,
                want_rms,
            )
        )
    return out, Similarity([f"chunk {m.chunk}" for m in out], names, matrix)


def match_fc_chunks(ref: Capture, other: Capture) -> list[ChunkMatch]:
    return match_chunks(ref, other)[0]


def wiring_pattern(matches: list[ChunkMatch], num_layers: int | None = None, draft_config: dict | None = None) -> str:
    """Name the miswiring, e.g. "off-by-one +1 and embedding dropped". `draft_config` (when known) tells
    a default-layer fallback from a config whose own ids name the default layers."""
    got = [m.best if m.matched else None for m in matches]
    want = [m.expected for m in matches]
    if got == want:
        return ""
    notes = []
    normed = [
        j
        for j, (g, w) in enumerate(zip(got, want))
        if g and g.startswith(NORM_PREFIX) and g[len(NORM_PREFIX) : -1] == w
    ]
    if normed:
        notes.append("norm applied before fc (engine's chunk = rmsnorm(reference tensor))")
        got = [w if j in normed else g for j, (g, w) in enumerate(zip(got, want))]
    gk = hidden_indices(got)
    wk = hidden_indices(want)
    L = num_layers
    defaults = default_layers(L) if L else None
    if gk is not None and wk is not None and got != want:
        shifts = {g - w for g, w in zip(gk, wk)}
        if len(shifts) == 1:
            s = shifts.pop()
            notes.append(f"off-by-one {s:+d}" if abs(s) == 1 else f"every layer shifted by {s:+d}")
        elif sorted(gk) == sorted(wk):
            notes.append("permuted order (engine sorted the ids)" if gk == sorted(wk) else "permuted order")
        elif gk == sorted(gk) and len({g - w for g, w in zip(gk, sorted(wk))}) == 1:
            s = gk[0] - sorted(wk)[0]  # sorted, then every layer moved by the same amount (SGLang: sort and +1)
            notes.append(
                f"permuted order (engine sorted the ids) and off-by-one {s:+d}"
                if abs(s) == 1
                else f"permuted order (engine sorted the ids) and every layer shifted by {s:+d}"
            )
    if defaults and gk == defaults and wk != defaults and not _config_names(draft_config, defaults):
        why = (
            "the draft config names no layer ids"
            if draft_config is not None and declared_ids(draft_config) is None
            else "it did not use the config's layer ids"
        )
        fallback = f"default-layer fallback (engine fed h[2], h[L//2], h[L-3] of L={L}: {why})"
        # the same three layers can also be a shift of the trained ones: say both, the shift first
        notes = [f"{notes[0]} or {fallback}"] + notes[1:] if notes else [fallback]
    if "target.h.0" in want and "target.h.0" not in got:
        notes.append("embedding dropped")
    if "target.h.0" in got and "target.h.0" not in want:
        notes.append("embedding fed but not trained on")
    if FINAL_NORM in got and FINAL_NORM not in want:
        notes.append("final layer taken post-norm")
    if FINAL_NORM in want and FINAL_NORM not in got:
        notes.append("final layer taken pre-norm")
    layered = any(n.startswith(("off-by-one", "every layer", "permuted")) for n in notes)
    if not layered and len(got) > 1 and None not in got and got[:-1] == want[1:]:
        notes.append("slots shifted by one (engine's chunk j = reference's chunk j+1)")
    if not notes:
        notes.append("different layers")
    return " and ".join(notes)


def _config_names(draft_config: dict | None, layers: list[int]) -> bool:
    """Whether the config's own ids lead to these layers under either engine numbering (id k -> h[k] or
    h[k+1], in layer order): then an engine that fed them followed the config, it did not fall back."""
    ids = declared_ids(draft_config) if draft_config is not None else None
    return ids is not None and any(sorted({k + s for k in ids}) == layers for s in (0, 1))


def _norm_note(m: ChunkMatch) -> str:
    if m.expected_norm is None:
        return ""
    return f"; per-token RMS {m.norm:.3g} ± {m.norm_spread:.2g} vs expected {m.expected_norm:.3g}"


def _norms_differ(m: ChunkMatch) -> bool:
    """Telling norm gaps only (the seed's: embedding RMS ~1 vs deep layers ~40-100), not layer-to-layer drift."""
    e = m.expected_norm
    return e is not None and e > 0 and m.norm > 0 and max(m.norm / e, e / m.norm) > 2.0


def diagnose_fc(ref: Capture, other: Capture, draft_config: dict | None = None) -> list[str]:
    """Human-readable lines; empty when the fc inputs match the reference wiring. `draft_config`: the
    draft's config.json when known (see wiring_pattern)."""
    ref_fc, other_fc = ref.tensors.get(FC_IN), other.tensors.get(FC_IN)
    L = ref.meta.num_layers
    s = ref.fc_chunk_size
    if ref_fc is not None and other_fc is not None and ref_fc.shape[-1] != other_fc.shape[-1] and s:
        lines = []
        if other_fc.shape[-1] % s == 0:
            fake = Capture(other.tensors, other.meta.replace(target_hidden_size=s))
            got = [(m.best if m.matched else None) for m in match_chunks(ref, fake)[0]]
            want = ref.meta.wiring.inputs if ref.meta.wiring else []
            lines.append(
                f"engine fed fc [{', '.join(map(_short, got))}]; reference fed [{', '.join(map(_short, want))}]"
            )
        lines.append(
            f"chunk count mismatch: engine fc_in has {other_fc.shape[-1] / s:g} chunks of {s}, reference {ref_fc.shape[-1] // s}"
        )
        return lines
    matches = match_fc_chunks(ref, other)
    if not matches or all(m.correct for m in matches):
        return []
    lines = []
    for m in matches:
        if m.correct:
            continue
        expect = f"expected {describe(m.expected, L)}" if m.expected else "no reference slot"
        if m.matched:
            lines.append(
                f"engine's fc chunk {m.chunk} matches reference {describe(m.best, L)} (cos {m.cosine:.4f}); {expect}"
                + (_norm_note(m) if _norms_differ(m) else "")
            )
        else:
            lines.append(
                f"engine's fc chunk {m.chunk} matches no reference tensor (closest {m.best}, cos {m.cosine:.4f}, "
                f"rel_diff {m.rel_diff:.2e}); {expect}{_norm_note(m)}"
            )
    fed = "[" + ", ".join(_short(m.best) if m.matched else "?" for m in matches) + "]"
    expected = "[" + ", ".join(_short(m.expected) for m in matches) + "]"
    pattern = wiring_pattern(matches, L, draft_config)
    lines.append(f"engine fed fc {fed}; reference fed {expected}" + (f"; pattern: {pattern}" if pattern else ""))
    return lines


def diagnose_hidden(ref: Capture, other: Capture, name: str) -> list[str]:
    """A diverging target hidden state: which reference tensor is it really?"""
    if name not in other or not (name.startswith(HIDDEN_PREFIX) or name == FINAL_NORM):
        return []
    t = _rows(other.get(name))
    scores = _score(t, ref, _candidates(ref))
    if not scores:
        return []
    best = min(scores, key=lambda n: scores[n][0])
    rel, cos, _ = scores[best]
    if best == name or rel >= MATCH_REL_DIFF:
        return []
    line = f"engine's {name} matches reference {describe(best, ref.meta.num_layers)} (cos {cos:.4f})"
    a, b = hidden_index(name), hidden_index(best)
    if a is not None and b is not None:
        line += f": the engine's layer numbering is shifted by {b - a:+d}"
    return [line]


# Where the first divergence sits in the draft's data flow -> the likely culprit.
_DRAFT_SUSPECTS = {
    "embeds": "the draft's token embeddings or input tokens differ (embedding not shared from the target?)",
    "fc_out": "fc differs while its input matches: fc weights, norm_before_fc or fc_norm",
    "layer0.attn_in": "the draft's input norms differ (input_layernorm / hidden_norm)",
    "layer0.attn_out": "attention differs while its input matches: rope, positions or the mask",
    "layer0.mlp_out": "the residual or MLP differs after matching attention: norm_before_residual handled differently?",
    # an engine that applies norm_output carries the normed state to the next step and records no
    # pre-norm state (difftest_engines/sglang/records.py): the first tensor it cannot match is this one
    "hidden_prenorm": "the residual stream differs after matching MLP output: norm_before_residual handled "
    "differently, or norm_output (the state carried to the next step normed)?",
    "logits": "the final norm or lm_head differs",
    "logits_target": "draft.logits match but the target-vocab logits do not: the draft-to-target vocab map (d2t) differs",
}


def diagnose_draft(first: str) -> list[str]:
    """One line naming the suspect for a first divergence inside the draft (empty for fc_in / targets)."""
    d = split_draft(first)
    if d is None or d[1].startswith("fc_in"):
        return []
    step, part = d
    if step > 0:
        return [
            f"draft step 0 matches but step {step} diverges ({first}): what feeds the next step differs "
            "(norm_output, the drafted token, or the draft KV cache / positions)"
        ]
    suspect = _DRAFT_SUSPECTS.get(part)
    return [f"suspect: {suspect}"] if suspect else []
