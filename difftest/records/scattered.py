"""A `*.logits_target` stored as the columns its `*.logits` fill in the target vocabulary.

An EAGLE-3 draft with its own vocabulary computes `draft.logits` [n, V_draft] and scatters them
through d2t into the target vocabulary, -inf elsewhere: `draft.logits_target` [n, V]. At real
vocabularies that tensor is the largest a capture holds beside `target.logits` (34% of a
Llama-3.2-1B-shaped capture, [19 x 128256] bf16: docs/benchmarks.md, "Captures at real
vocabularies") and carries nothing its draft-vocabulary source does not, so captures and baselines
store it as the column index (int32, V_draft entries) and rebuild it on load.

Only an exact rebuild is stored so: the rebuilt tensor must equal the captured one bit for bit
(-inf outside the columns, NaN payloads and signed zeros included), else the full tensor is stored.
So whatever an engine really scattered (a d2t that drops or moves a token, a NaN, a finite value
outside its columns) is kept as it was, and every comparison reads what it read before.
"""

from __future__ import annotations

import torch

TARGET_SUFFIX = "_target"  # draft.logits_target is draft.logits scattered
COLUMNS_SUFFIX = "#columns"  # the stored column index of a scattered tensor
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float dtype's bits, by element size
_ROWS = 64  # rows rebuilt at a time while checking (bounds the check's memory at long prompts)


def source_of(name: str) -> str | None:
    """The draft-vocabulary tensor `name` is scattered from (`draft.step1.logits` for
    `draft.step1.logits_target`); None for any other name."""
    return name.removesuffix(TARGET_SUFFIX) if name.endswith(".logits" + TARGET_SUFFIX) else None


def scatter(src: torch.Tensor, cols: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab]: src's columns at `cols`, -inf elsewhere."""
    out = torch.full((src.shape[0], vocab), float("-inf"), dtype=src.dtype, device=src.device)
    out[:, cols.to(device=src.device, dtype=torch.long)] = src
    return out


def scatter_columns(src: torch.Tensor, full: torch.Tensor) -> torch.Tensor | None:
    """The columns `full` ([n, V]) holds `src` ([n, v], v < V) in, when scatter() rebuilds `full`
    from them bit for bit; None otherwise."""
    if (
        full.dim() != 2
        or src.dim() != 2
        or full.shape[0] != src.shape[0]
        or full.dtype != src.dtype
        or not full.is_floating_point()
        or full.element_size() not in _BITS
        or not full.numel()
        or src.shape[1] >= full.shape[1]
    ):
        return None
    cols = torch.isfinite(full[0]).nonzero().flatten()
    if cols.numel() != src.shape[1]:
        return None
    bits = _BITS[full.element_size()]
    for start in range(0, full.shape[0], _ROWS):
        rebuilt = scatter(src[start : start + _ROWS], cols, full.shape[1])
        if not torch.equal(rebuilt.view(bits), full[start : start + _ROWS].contiguous().view(bits)):
            return None
    return cols


def pack(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors to store, scattered name -> its source): each `*.logits_target` that its
    `*.logits` rebuilds exactly is stored as `<name>#columns` (int32) instead."""
    stored: dict[str, torch.Tensor] = {}
    derived: dict[str, str] = {}
    for name, t in tensors.items():
        src = source_of(name)
        cols = scatter_columns(tensors[src], t) if src is not None and src in tensors else None
        if src is None or cols is None:
            stored[name] = t
            continue
        stored[name + COLUMNS_SUFFIX] = cols.to(torch.int32)
        derived[name] = src
    return stored, derived
