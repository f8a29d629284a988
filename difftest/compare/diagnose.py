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

Reduced precision: a float32 engine whose matmuls run in TF32 or bf16 moves every tensor from the
target's first layer on, smoothly, by about that format's unit roundoff (reduced_precision); it is
named as such, with what to declare, not as a divergence at the target's first layer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from difftest.rules.layer_rules import declared_ids, default_layers
from difftest.records.capture import Capture
from difftest.records.chunk_match import MATCH_REL_DIFF, ChunkMatch, Similarity, match_bound
from difftest.compare.noise import NoiseFloor
from difftest.base.dtypes import MATMUL_PRECISIONS, DType, matmul_unit_roundoff
from difftest.base.names import (
    FC_IN,
    FINAL_NORM,
    HIDDEN_PREFIX,
    TARGET_LOGITS,
    draft_name,
    fc_chunk_index,
    hidden_index,
    in_fc_in,
    split_draft,
)
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


def _bound(floor: NoiseFloor | None, name: str) -> float:
    """The match bound of candidate `name` (rmsnorm(t): t's) from its measured floor; without a floor
    the fixed MATCH_REL_DIFF."""
    if floor is None:
        return MATCH_REL_DIFF
    inner = name[len(NORM_PREFIX) : -1] if name.startswith(NORM_PREFIX) else name
    return match_bound(floor.floor(inner))


def _pick(scores: dict[str, tuple[float, float, float]], floor: NoiseFloor | None) -> tuple[str, float, str | None]:
    """The closest candidate, its bound, and the runner-up when that too is within noise of the chunk.
    Ambiguous when the runner-up's rel_diff is under the larger of the two bounds: a bound that reaches
    the second candidate would make two different reference tensors both "match" (at depth a layer's
    floor can approach the distance to the next layer), so the chunk is named as neither."""
    ranked = sorted(scores, key=lambda n: scores[n][0])
    best, bound = ranked[0], _bound(floor, ranked[0])
    if scores[best][0] >= bound or len(ranked) < 2:
        return best, bound, None
    second = ranked[1]
    return best, bound, (second if scores[second][0] < max(bound, _bound(floor, second)) else None)


def match_chunks(
    ref: Capture, other: Capture, floor: NoiseFloor | None = None
) -> tuple[list[ChunkMatch], Similarity | None]:
    """Match every H-wide chunk of the engine's fc_in; also the chunk x candidate cosine matrix (for plots).
    `floor`: the noise floor the comparison judged with; each candidate's match bound comes from its
    measured floor (difftest.records.chunk_match.match_bound), else MATCH_REL_DIFF."""
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
        best, bound, also = _pick(scores, floor)
        if scores[best][0] >= bound:  # nothing raw matches: was a norm applied before fc?
            normed = _score(chunk, ref, [f"{NORM_PREFIX}{n})" for n in names if n.startswith("target.h.")])
            if normed:
                nbest, nbound, nalso = _pick(normed, floor)
                if normed[nbest][0] < nbound:
                    scores, best, bound, also = normed, nbest, nbound, nalso
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
                bound,
                also,
                scores[also][0] if also is not None else None,
            )
        )
    return out, Similarity([f"chunk {m.chunk}" for m in out], names, matrix)


def match_fc_chunks(ref: Capture, other: Capture, floor: NoiseFloor | None = None) -> list[ChunkMatch]:
    return match_chunks(ref, other, floor)[0]


def wiring_pattern(matches: list[ChunkMatch], num_layers: int | None = None, draft_config: dict | None = None) -> str:
    """Name the miswiring, e.g. "off-by-one +1 and embedding dropped". `draft_config` (when known) tells
    a default-layer fallback from a config whose own ids name the default layers."""
    got = [m.best if m.matched else None for m in matches]
    want = [m.expected for m in matches]
    if got == want:
        return ""
    unsure = [m for m in matches if m.ambiguous]
    if unsure:  # any name would pick one of two layers the measured noise cannot tell apart
        return "not named (" + "; ".join(f"chunk {m.chunk} is {_fed(m)}" for m in unsure) + ")"
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


def _fed(m: ChunkMatch) -> str:
    """What a chunk was fed, short: its match, "hA or hB" where the noise cannot tell two apart, else "?"."""
    if m.ambiguous:
        return f"{_short(m.best)} or {_short(m.also)}"
    return _short(m.best) if m.matched else "?"


def _bound_note(m: ChunkMatch) -> str:
    """The bound beside a rel_diff, where it is the one the measured floor gave (not the fixed one)."""
    return f", bound {m.bound:.2e} from the measured floor" if m.bound != MATCH_REL_DIFF else ""


def _norm_note(m: ChunkMatch) -> str:
    if m.expected_norm is None:
        return ""
    return f"; per-token RMS {m.norm:.3g} ± {m.norm_spread:.2g} vs expected {m.expected_norm:.3g}"


def _norms_differ(m: ChunkMatch) -> bool:
    """Telling norm gaps only (the seed's: embedding RMS ~1 vs deep layers ~40-100), not layer-to-layer drift."""
    e = m.expected_norm
    return e is not None and e > 0 and m.norm > 0 and max(m.norm / e, e / m.norm) > 2.0


def diagnose_fc(
    ref: Capture, other: Capture, draft_config: dict | None = None, floor: NoiseFloor | None = None
) -> list[str]:
    """Human-readable lines; empty when the fc inputs match the reference wiring. `draft_config`: the
    draft's config.json when known (see wiring_pattern); `floor`: the noise floor the comparison judged
    with, for each candidate's match bound (match_chunks)."""
    ref_fc, other_fc = ref.tensors.get(FC_IN), other.tensors.get(FC_IN)
    L = ref.meta.num_layers
    s = ref.fc_chunk_size
    if ref_fc is not None and other_fc is not None and ref_fc.shape[-1] != other_fc.shape[-1] and s:
        lines = []
        if other_fc.shape[-1] % s == 0:
            fake = Capture(other.tensors, other.meta.replace(target_hidden_size=s))
            got = [_fed(m) for m in match_chunks(ref, fake, floor)[0]]
            want = ref.meta.wiring.inputs if ref.meta.wiring else []
            lines.append(f"engine fed fc [{', '.join(got)}]; reference fed [{', '.join(map(_short, want))}]")
        lines.append(
            f"chunk count mismatch: engine fc_in has {other_fc.shape[-1] / s:g} chunks of {s}, reference {ref_fc.shape[-1] // s}"
        )
        return lines
    matches = match_fc_chunks(ref, other, floor)
    if not matches or all(m.correct for m in matches):
        return []
    lines = []
    for m in matches:
        if m.correct:
            continue
        expect = f"expected {describe(m.expected, L)}" if m.expected else "no reference slot"
        if m.ambiguous:
            lines.append(
                f"engine's fc chunk {m.chunk} is within noise of both reference {m.best} (rel_diff "
                f"{m.rel_diff:.2e}, bound {m.bound:.2e}) and {m.also} (rel_diff {m.also_rel_diff:.2e}): named as "
                f"neither; {expect}"
            )
        elif m.matched:
            lines.append(
                f"engine's fc chunk {m.chunk} matches reference {describe(m.best, L)} (cos {m.cosine:.4f}); {expect}"
                + (_norm_note(m) if _norms_differ(m) else "")
            )
        else:
            lines.append(
                f"engine's fc chunk {m.chunk} matches no reference tensor (closest {m.best}, cos {m.cosine:.4f}, "
                f"rel_diff {m.rel_diff:.2e}{_bound_note(m)}); {expect}{_norm_note(m)}"
            )
    fed = "[" + ", ".join(_fed(m) for m in matches) + "]"
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


# -- reduced precision: an engine whose matmuls compute below the case's float32 ----------------------
# What a float32 engine on TF32 tensor cores (or a bf16 GEMM) looks like against the float32 reference,
# measured with ref[matmul=tf32|bf16] on the tiny Llama (8 layers) and on an H200 (TF32 matmuls): the
# error enters at the first layer with a matmul (target.h.1) at 0.5 x the format's unit roundoff u on
# every row (cos 1.0000), then grows smoothly, never jumping (no tensor after it "introduces" error),
# to 2.8 u at the last layer and the draft. A miswiring is a discrete jump instead (another layer fed
# to fc: 1e-2..1 relative, 1e2..1e6 x the float32 threshold, introduced at fc_in), as is a flipped norm
# flag or a dropped vocab map: those stay failures with their own cause.
PRECISION_ENTRY = (1 / 64, 4.0)  # the entry's row error in units of u: one layer's matmuls (measured 0.5 u)
PRECISION_DRIFT = 64.0  # any later tensor: the drift of a deep model's layers (measured 2.8 u over 8 layers)
PRECISION_ROWS = 0.5  # at least this share of the entry's rows above threshold: every token moves, not one
PRECISION_TYPICAL = 0.5  # the entry's err / u measured for both formats: the format named is the nearest


@dataclass
class PrecisionDrift:
    """A float32 engine's divergence explained as matmuls in a reduced format (`precision`)."""

    precision: str  # a key of MATMUL_PRECISIONS
    entry: str  # the tensor where the error enters
    err: float  # its largest row error
    threshold: float  # its float32 threshold
    cosine: float
    worst: str  # the tensor with the largest row error the drift explains
    worst_err: float
    explained: list[str]  # every diverging tensor the drift accounts for, the entry first, up to `beyond`
    beyond: str | None  # the first diverging tensor after the entry that it does not (a real fault)

    @property
    def excess(self) -> float:
        return self.err / self.threshold if self.threshold > 0 else math.inf

    def finding(self, engine: str) -> str:
        """The verdict's line: what the engine computes in, how far it moved, and what to declare."""
        side = "draft" if split_draft(self.entry) is not None and not in_fc_in(self.entry) else "target"
        return (
            f"{engine}'s {side} computes below float32 (consistent with {PRECISION_NAMES[self.precision]} "
            f"matmuls: rel err {self.err:.3g} at {self.entry}, {self.excess:.3g}x the float32 threshold "
            f"{self.threshold:.3g}; cos {self.cosine:.4f}; growing smoothly to {self.worst_err:.3g} at "
            f"{self.worst}); not a wiring divergence; declare `precision: {{{_yaml_key(engine)}: "
            f"{self.precision}}}` in the case if this is how it serves"
        )


PRECISION_NAMES = {"tf32": "TF32", "bf16": "bf16"}


def _yaml_key(engine: str) -> str:
    """An engine id as a YAML mapping key (ref[matmul=tf32] needs quotes)."""
    return engine if re.fullmatch(r"[A-Za-z0-9_.@-]+", engine) else f'"{engine}"'


def _can_enter(name: str, wired_right: bool) -> bool:
    """Where a reduced-precision matmul first shows: a target layer's output (not the embedding), the
    draft's fc (its first matmul: a golden re-run compares no target), or an fc chunk when the engine
    exposes no target layers and every chunk is the layer the reference fed (wired_right)."""
    k = hidden_index(name)
    if k is not None:
        return k >= 1
    if name in (FINAL_NORM, TARGET_LOGITS, draft_name(0, "fc_out")):
        return True
    return in_fc_in(name) and wired_right


def precision_of(err: float) -> str | None:
    """The matmul format whose unit roundoff a first layer's row error `err` is of the order of."""
    lo, hi = PRECISION_ENTRY
    fits = [p for p in MATMUL_PRECISIONS if lo * matmul_unit_roundoff(p) <= err <= hi * matmul_unit_roundoff(p)]
    return min(fits, key=lambda p: abs(math.log(err / (PRECISION_TYPICAL * matmul_unit_roundoff(p)))), default=None)


def reduced_precision(cd, dtype: str, wired_right: bool = True) -> PrecisionDrift | None:
    """Whether one prompt's comparison (a difftest.compare.compare.CaptureDiff) has the signature of
    reduced-precision matmuls: a float32 case; the error introduced at a first matmul on most rows, of
    the order of a reduced format's unit roundoff; every later diverging tensor propagated from it
    (none introduces error of its own) and within PRECISION_DRIFT x that unit roundoff. The first
    diverging tensor that breaks this is `beyond`: a fault the drift does not explain (None: none).
    `wired_right`: the fc chunks each match the layer the reference fed (match_chunks), so a chunk may
    carry the drift; a miswired chunk never does."""
    if dtype != DType.FLOAT32:
        return None
    entry = cd.first_introduced()
    if entry is None or not entry.by_noise or not _can_enter(entry.name, wired_right):
        return None
    if not math.isfinite(entry.err) or entry.rows_above < PRECISION_ROWS * max(entry.rows, 1):
        return None
    precision = precision_of(entry.err)
    if precision is None:
        return None
    bound = PRECISION_DRIFT * matmul_unit_roundoff(precision)
    names = [d.name for d in cd.diffs]
    chunked = any(fc_chunk_index(n) is not None for n in names)  # then the chunks judge fc_in, by layer
    explained, beyond = [entry], None
    for d in cd.diffs[names.index(entry.name) + 1 :]:
        if d.ok:
            continue
        fits = d.by_noise and not d.introduced and math.isfinite(d.err) and d.err <= bound
        if d.name == FC_IN and chunked:  # whole, it drifts as its chunks do; a fault is named by its chunk
            if fits and wired_right:
                explained.append(d)
            continue
        if not (fits and (wired_right or not in_fc_in(d.name))):
            beyond = d  # what follows computes on the fault's output: the drift no longer explains it
            break
        explained.append(d)
    worst = max(explained, key=lambda d: d.err)
    return PrecisionDrift(
        precision,
        entry.name,
        entry.err,
        entry.threshold,
        entry.cosine,
        worst.name,
        worst.err,
        [d.name for d in explained],
        beyond.name if beyond else None,
    )
