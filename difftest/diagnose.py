"""Say *why* fc inputs diverge: which reference tensor each engine chunk really is.

Each H-wide chunk of the engine's `draft.fc_in` is matched against every reference
`target.h.{k}` and `target.final_norm` by cosine similarity over all positions; the
best match is compared with what the reference wiring expected at that slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difftest.capture import Capture
from difftest.wiring import hidden_index, short_name


@dataclass
class ChunkMatch:
    chunk: int
    expected: str | None  # reference wiring at this slot
    best: str  # reference tensor the engine's chunk matches best
    cosine: float
    max_abs: float

    @property
    def correct(self) -> bool:
        return self.best == self.expected and self.cosine > 0.9999


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    d = float(a.norm() * b.norm())
    return float(a @ b) / d if d > 0 else 0.0


def describe(name: str, num_layers: int | None = None) -> str:
    k = hidden_index(name)
    if k == 0:
        return f"{name} (the embedding)"
    if num_layers is not None and k == num_layers:
        return f"{name} (last layer, pre-norm)"
    if name == "target.final_norm":
        return f"{name} (last layer, post-norm)"
    return name


def match_fc_chunks(ref: Capture, other: Capture) -> list[ChunkMatch]:
    size = ref.fc_chunk_size
    if "draft.fc_in" not in other.tensors or not size:
        return []
    fc = other.tensors["draft.fc_in"]
    if fc.shape[-1] % size:
        return []
    expected = (ref.meta.get("wiring") or {}).get("inputs") or []
    candidates = [n for n in ref.names() if n.startswith("target.h.") or n == "target.final_norm"]
    out = []
    for j in range(fc.shape[-1] // size):
        chunk = fc[..., j * size : (j + 1) * size]
        scored = [
            (_cosine(chunk, ref.get(c)), c) for c in candidates if tuple(ref.get(c).shape) == tuple(chunk.shape)
        ]
        if not scored:
            continue
        cos, best = max(scored)
        max_abs = float((chunk.float() - ref.get(best).float().to(chunk.device)).abs().max())
        out.append(ChunkMatch(j, expected[j] if j < len(expected) else None, best, cos, max_abs))
    return out


def wiring_pattern(matches: list[ChunkMatch]) -> str:
    """Name the miswiring: off-by-one, permutation, embedding dropped/extra, pre/post norm."""
    got = [m.best for m in matches]
    want = [m.expected for m in matches]
    if got == want:
        return ""
    notes = []
    gk = [hidden_index(g) for g in got]
    wk = [hidden_index(w) if w else None for w in want]
    if None not in gk and None not in wk:
        shifts = {g - w for g, w in zip(gk, wk)}
        if len(shifts) == 1:
            s = shifts.pop()
            notes.append(f"off-by-one {s:+d}" if abs(s) == 1 else f"every layer shifted by {s:+d}")
        elif sorted(gk) == sorted(wk):
            notes.append("permuted order")
    if "target.h.0" in want and "target.h.0" not in got:
        notes.append("embedding dropped")
    if "target.h.0" in got and "target.h.0" not in want:
        notes.append("embedding fed but not trained on")
    if "target.final_norm" in got and "target.final_norm" not in want:
        notes.append("final layer taken post-norm")
    if "target.final_norm" in want and "target.final_norm" not in got:
        notes.append("final layer taken pre-norm")
    if not notes:
        notes.append("different layers")
    return ", ".join(notes)


def diagnose_fc(ref: Capture, other: Capture) -> list[str]:
    """Human-readable lines; empty when the fc inputs match the reference wiring."""
    ref_fc, other_fc = ref.tensors.get("draft.fc_in"), other.tensors.get("draft.fc_in")
    if ref_fc is not None and other_fc is not None and ref_fc.shape[-1] != other_fc.shape[-1] and ref.fc_chunk_size:
        s = ref.fc_chunk_size
        return [f"chunk count mismatch: engine fc_in has {other_fc.shape[-1] / s:g} chunks of {s}, reference {ref_fc.shape[-1] // s}"]
    matches = match_fc_chunks(ref, other)
    if not matches or all(m.correct for m in matches):
        return []
    L = ref.meta.get("num_layers")
    lines = []
    for m in matches:
        if m.correct:
            continue
        expect = f"expected {describe(m.expected, L)}" if m.expected else "no reference slot"
        if m.cosine > 0.9999:
            lines.append(f"engine's fc chunk {m.chunk} matches reference {describe(m.best, L)} (cos {m.cosine:.4f}); {expect}")
        else:
            lines.append(
                f"engine's fc chunk {m.chunk} matches no reference tensor (closest {m.best}, cos {m.cosine:.4f}); {expect}"
            )
    got = "[" + ", ".join(short_name(m.best) if m.cosine > 0.9999 else "?" for m in matches) + "]"
    want = "[" + ", ".join(short_name(m.expected) if m.expected else "?" for m in matches) + "]"
    pattern = wiring_pattern(matches)
    lines.append(f"engine fed fc {got}; reference fed {want}" + (f"; pattern: {pattern}" if pattern else ""))
    return lines
