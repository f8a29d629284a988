"""Tensor-by-tensor comparison of two captures, in data-flow order.

The verdict per tensor is difftest.compare.noise's: per-row relative error against a noise floor
the reference measured (status "mismatch" = above noise), and where the error was
*introduced* along the data flow. The elementwise statistics (|diff| against atol/rtol,
cosine, rel_diff) are kept as information; a case's `tolerances:` pattern makes the
tensors it matches judged elementwise instead, as the user asked.

Large tensors (full-vocab logits, 3 x 7168-wide fc inputs) are compared on the device
they live on (difftest.compare.rowstats): no full-size float32 copy is ever made; on the CPU a
native kernel computes every statistic in one read of each tensor, elsewhere large
tensors go through a fused, compiled (Inductor) kernel.
Every statistic is kept per row (= per token position): the error profile along the
prompt, and for logits the distribution metrics (top-1, top-k membership, KL, TV).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch

from difftest.compare import noise
from difftest.records.capture import Capture
from difftest.base.names import (
    FC_CHUNK_PREFIX,
    FC_IN,
    TARGET_LOGITS,
    draft_name,
    fc_chunk_index,
    hidden_name,
    inputs_of,
    split_draft,
)
from difftest.records.tensor_diff import MEASURED_FLOOR, TensorDiff, TensorStatus
from difftest.compare.rowstats import row_stats
from difftest.compare.tolerances import Tolerance, tolerance_for
from difftest.records.routing import RoutingLayer
from difftest.records.tolerance import TolerancePair

CHUNK_ELEMENTS = 1 << 20


TOPK = 5  # top-k membership: the reference's top-1 within the engine's top-k
PROFILE_MAX_ROWS = 4096  # per-row profiles longer than this are stored as a strided sample


def is_logits(name: str) -> bool:
    """Tensors whose rows are distributions: softmax metrics (top-k, KL, TV) apply."""
    return name == TARGET_LOGITS or name.endswith(".logits") or name.endswith(".logits_target")


def noise_summary(d: TensorDiff) -> str:
    """One line on a tensor's verdict: its error against the noise floor."""
    if not d.status.compared:
        return f"{d.name}: {d.detail}"
    if not d.by_noise:
        return d.summary()
    rows = f"{d.rows_above}/{d.rows} rows" if d.rows > 1 else "its row"
    verb = "above" if d.status == TensorStatus.MISMATCH else "within"
    return (
        f"{d.name}: {rows} above the noise threshold; row error up to {d.err:.3g} "
        f"({d.excess:.3g}x the threshold {d.threshold:.3g} = {noise.SAFETY:g} x {d.floor_basis} "
        f"{d.noise_floor:.3g}) -> {verb} noise; cos {d.cosine:.4f}" + (f"; {d.detail}" if d.detail else "")
    )


def floor_basis(floor: noise.NoiseFloor, name: str) -> str:
    """What a tensor's floor stands on, for its verdict line: a floor that was guessed must not read as
    measured (at 8B in bf16 the calibration may not fit, and then every threshold is the dtype's guess)."""
    f = floor.tensors.get(name)
    if f is not None:
        return MEASURED_FLOOR if f.measured else f"floor measured on too few rows ({f.rows})"
    if floor.measured and floor.threshold(name) != noise.unmeasured_threshold(floor.dtype):
        return "the same draft part's measured floor"
    return f"the {floor.dtype} guess (floor not measured)"


def _profile(values: torch.Tensor, kind=float) -> list:
    step = max(1, -(-values.numel() // PROFILE_MAX_ROWS))
    return [kind(v) for v in values[::step].tolist()]


def _mean_max(x: torch.Tensor) -> tuple[float, float]:
    """Over rows, ignoring NaN rows (a NaN row is already counted as a NaN mismatch)."""
    x = x[~torch.isnan(x)]
    return (float(x.mean()), float(x.max())) if x.numel() else (math.nan, math.nan)


def _row_rel_err(s: dict) -> torch.Tensor:
    """Per-row ||engine - ref|| / ||ref|| from the row statistics (inf for a row with NaN/Inf mismatches)."""
    num, den = s["sum_sq"], s["sum_aa"]
    err = torch.where(den > 0, (num / den.clamp_min(1e-300)).sqrt(), torch.where(num > 0, torch.inf, 0.0))
    return torch.where(s["nonfinite"] > 0, torch.inf, err)


def _row_cosine(ab: torch.Tensor, aa: torch.Tensor, bb: torch.Tensor) -> torch.Tensor:
    denom = (aa * bb).sqrt()
    return torch.where(denom > 0, ab / denom, torch.where(aa == bb, 1.0, 0.0))


def unravel(flat: int, shape: list[int]) -> list[int]:
    """The index in `shape` of the flat position `flat` (row-major). Not torch.unravel_index: its
    argument checks import torch.fx's symbolic shapes and sympy, seconds of a run's first comparison."""
    index = []
    for size in reversed(shape):
        flat, at = divmod(flat, size) if size else (flat, 0)
        index.append(at)
    return index[::-1]


def compare_tensor(
    name: str,
    ref: torch.Tensor,
    other: torch.Tensor,
    tol: Tolerance,
    topk: int = TOPK,
    threshold: float | None = None,
    noise_floor: float = 0.0,
    row_errors: dict[str, torch.Tensor] | None = None,
    floor_basis: str = MEASURED_FLOOR,
) -> TensorDiff:
    """threshold: the per-row relative error above which a row is off (difftest.compare.noise); None judges
    elementwise against `tol` (a case's explicit tolerance). `row_errors` collects the full per-row
    errors by tensor name, for the data-flow pass (judge_along_flow); the report keeps a profile only."""
    if tuple(ref.shape) != tuple(other.shape):
        return TensorDiff(
            name,
            TensorStatus.SHAPE,
            list(ref.shape),
            detail=f"shape {list(other.shape)} vs reference {list(ref.shape)}",
            excess=math.inf,
            err=math.inf,
        )
    other = other.to(ref.device)
    n = ref.numel()
    cols = ref.shape[-1] if ref.dim() else 1
    a2, b2 = ref.reshape(-1, cols) if n else ref.reshape(0, 1), other.reshape(-1, cols) if n else other.reshape(0, 1)
    logits = is_logits(name) and ref.dim() >= 1 and n > 0
    s = row_stats(a2, b2, tol.atol, tol.rtol, logits, chunk=CHUNK_ELEMENTS) if n else None
    if s is None:
        return TensorDiff(name, TensorStatus.OK, list(ref.shape), tolerance=str(tol), threshold=threshold or 0.0)
    R = a2.shape[0]
    worst = int(s["max_abs"].argmax()) if R else 0
    max_at = worst * cols + int(s["max_col"][worst])
    sum_ab, sum_aa, sum_bb = float(s["sum_ab"].sum()), float(s["sum_aa"].sum()), float(s["sum_bb"].sum())
    denom = math.sqrt(sum_aa * sum_bb)
    cosine = sum_ab / denom if denom > 0 else (1.0 if sum_aa == sum_bb else 0.0)
    rel_diff = 1.0 - 2.0 * sum_ab / (sum_aa + sum_bb) if (sum_aa + sum_bb) > 0 else 0.0
    mismatched = int(s["mismatched"].sum())
    index = unravel(max_at, list(ref.shape))
    flat_a, flat_b = ref.reshape(-1), other.reshape(-1)
    d = TensorDiff(
        name=name,
        status=TensorStatus.MISMATCH if mismatched else TensorStatus.OK,
        shape=list(ref.shape),
        numel=n,
        mismatched=mismatched,
        max_abs=max(float(s["max_abs"][worst]), 0.0),
        max_abs_index=index,
        ref_value=float(flat_a[max_at]),
        other_value=float(flat_b[max_at]),
        max_rel=float(s["max_rel"].max()),
        mean_abs=float(s["sum_abs"].sum()) / n,
        cosine=cosine,
        rel_diff=rel_diff,
        nonfinite_mismatch=int(s["nonfinite"].sum()),
        tolerance=str(tol),
        nan_ref=int(s["nan_a"].sum()),
        nan_other=int(s["nan_b"].sum()),
        inf_ref=int(s["inf_a"].sum()),
        inf_other=int(s["inf_b"].sum()),
        rows=R,
        rows_mismatched=int((s["mismatched"] > 0).sum()),
        worst_row=worst if mismatched else -1,
        row_max_abs=_profile(s["max_abs"]),
        row_mismatched=_profile(s["mismatched"], int),
        row_cosine=_profile(_row_cosine(s["sum_ab"], s["sum_aa"], s["sum_bb"])),
        differs=bool(float(s["max_abs"].max()) > 0 or int(s["nonfinite"].sum()) > 0),
    )
    errs = _row_rel_err(s)
    d.row_err = _profile(errs)
    if threshold is None:
        d.criterion = f"elementwise ({tol.source})"
        j = noise.judge_rows(errs, math.inf)
    else:
        j = noise.judge_rows(errs, threshold)
        d.status = TensorStatus.MISMATCH if j.diverges else TensorStatus.OK
        d.worst_row = int(errs.argmax()) if j.diverges else -1
    d.err, d.err_q, d.rows_above, d.excess = j.err, j.err_q, j.rows_above, j.excess
    if row_errors is not None:
        row_errors[name] = errs
    d.threshold, d.noise_floor, d.floor_basis = (threshold or 0.0), noise_floor, floor_basis
    if not d.by_noise:
        d.excess = math.inf if mismatched else 0.0
    if logits:
        d.topk = min(topk, cols)
        d.top1_agree = int((s["rank"] == 0).sum())
        d.topk_member = int((s["rank"] < d.topk).sum())
        d.kl_mean, d.kl_max = _mean_max(s["kl"])
        d.tv_mean, d.tv_max = _mean_max(s["tv"])
    return d


@dataclass
class CaptureDiff:
    diffs: list[TensorDiff]  # data-flow order
    noise_source: str = ""  # how the noise floor was obtained (difftest.compare.noise.NoiseFloor.source)
    tie: str = ""  # draft steps left out: the engine drafted another token where the reference's was a tie
    router_ties: dict = field(default_factory=dict)  # MoE layer k -> rows judged apart after a routing difference
    routing: list[RoutingLayer] = field(default_factory=list)  # per MoE layer (difftest.compare.noise.routing_rows)
    # per judged tensor: rows above its threshold because of a numerical event upstream (an MoE router near-tie, or input rows the input's own verdict took as noise);
    # judge_along_flow sets it, the top-1 agreement leaves those positions out
    excused_rows: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.diffs)

    def get(self, name: str) -> TensorDiff | None:
        return next((d for d in self.diffs if d.name == name), None)

    def _first(self, hit, names=None, chunk_hit=None, by_chunk=lambda d: True) -> TensorDiff | None:
        """The first tensor in data-flow order for which hit(d) holds; a whole draft.fc_in (where
        by_chunk(d)) is named by its first chunk for which chunk_hit (default: hit) holds, if any."""
        for d in self.diffs:
            if not hit(d) or (names is not None and d.name not in names):
                continue
            if d.name == FC_IN and by_chunk(d):
                return next((c for c in self.diffs if c.name.startswith(FC_CHUNK_PREFIX) and (chunk_hit or hit)(c)), d)
            return d
        return None

    def first_divergence(self, names=None) -> TensorDiff | None:
        """The first tensor above noise in data-flow order (a failing fc_in is named by its first failing chunk)."""
        return self._first(lambda d: not d.ok, names, by_chunk=lambda d: d.status == TensorStatus.MISMATCH)

    def first_introduced(self, names=None) -> TensorDiff | None:
        """The first tensor where the error is introduced (above noise, not explained by its inputs)."""
        return self._first(lambda d: d.introduced, names)

    def first_differs(self) -> TensorDiff | None:
        """The first tensor whose values differ at all (not bit-identical), noise included."""
        return self._first(
            lambda d: d.differs or d.status in (TensorStatus.MISSING, TensorStatus.SHAPE), chunk_hit=lambda c: c.differs
        )


def _thresholds(
    name: str, dtype: str, tolerances: Mapping[str, TolerancePair], floor: noise.NoiseFloor
) -> tuple[Tolerance, float | None]:
    tol = tolerance_for(name, dtype, tolerances or {})
    explicit = tol.source.startswith("case:")
    return tol, (None if explicit else floor.threshold(name))


def compare_captures(
    ref: Capture,
    other: Capture,
    dtype: str,
    tolerances: Mapping[str, TolerancePair] | None = None,
    allow_missing: list[str] | None = None,
    floor: noise.NoiseFloor | None = None,
) -> CaptureDiff:
    floor = floor or noise.unmeasured(dtype, "no calibration given")
    skip_after, tie = _tie_step(ref, other, floor)
    diffs = []
    row_errors: dict[str, torch.Tensor] = {}
    other_names = set(other.names())
    for name in ref.names():
        if name.startswith(noise.AUX_PREFIX):
            continue
        step = split_draft(name)
        if skip_after is not None and step is not None and step[0] > skip_after:
            diffs.append(TensorDiff(name, TensorStatus.TIE, detail=f"not compared: {tie}"))
            continue
        if name not in other_names:
            allowed = any(fnmatchcase(name, p) for p in allow_missing or [])
            diffs.append(
                TensorDiff(
                    name,
                    TensorStatus.ALLOWED_MISSING if allowed else TensorStatus.MISSING,
                    detail="not captured by the engine" + (" (allowed by the case)" if allowed else ""),
                    excess=0.0 if allowed else math.inf,
                )
            )
            continue
        tol, threshold = _thresholds(name, dtype, tolerances or {}, floor)
        diffs.append(
            compare_tensor(
                name,
                ref.get(name),
                other.get(name),
                tol,
                threshold=threshold,
                noise_floor=floor.floor(name),
                row_errors=row_errors,
                floor_basis=floor_basis(floor, name),
            )
        )
    routing = noise.routing_rows(ref, other, floor)  # rows after a routing difference judged apart
    cd = CaptureDiff(diffs, floor.source, tie)
    cd.router_ties = {k: int(v.sum()) for k, v in routing.apart.items() if bool(v.any())}
    cd.routing = routing.layers
    wiring, num_layers = (ref.meta.wiring.inputs if ref.meta.wiring else []), ref.meta.num_layers
    judge_along_flow(
        cd, row_errors, wiring, num_layers, {hidden_name(k + 1): v for k, v in routing.apart.items()}, dtype
    )
    noise.clear_flip_verdicts(cd.diffs, routing)
    localise(cd, wiring, num_layers)
    return cd


def aligned_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    """An input's per-row flags seen from a tensor of n rows: positions align at the end (a later
    draft step's one row is the last prompt position of the step before)."""
    if rows.numel() == n:
        return rows
    if rows.numel() > n:
        return rows[-n:]
    return torch.zeros(n, dtype=torch.bool)


def _attends(name: str) -> bool:
    """Tensors computed by causal attention over earlier positions (a target layer's output, the
    draft layer's attention output at any step)."""
    return (name.startswith("target.h.") and name != "target.h.0") or name.endswith("layer0.attn_out")


def judge_along_flow(
    cd: CaptureDiff,
    row_errors: dict[str, torch.Tensor],
    wiring: list[str],
    num_layers: int | None,
    router_ties: dict[str, torch.Tensor] | None = None,
    dtype: str = "float32",
) -> None:
    """Final noise verdicts in data-flow order (difftest.compare.noise): the quorum everywhere, the isolated-row
    rule in the draft only. A row is *excused* (not counted) where a discrete numerical event
    explains it: an MoE router near-tie feeding this tensor (router_ties: possible events), or an
    event that actually happened upstream (a row above threshold there that was excused or judged
    within noise). Only events that happened propagate: a row is passed on as excused only where it
    is above threshold here too, so a wiring fault on a token that could have been re-routed, but
    was not, still counts."""
    events: dict[str, torch.Tensor] = {}  # rows above threshold that were excused, per judged tensor
    seeds = router_ties or {}
    fc_in = cd.get(FC_IN)

    def upstream(name: str, seen: set) -> list[torch.Tensor]:
        """Events of the nearest judged ancestors (through tensors the engine did not capture, whose
        router-tie seeds count as possible events)."""
        out = []
        for i in inputs_of(name, wiring, num_layers):
            if i not in seen:
                seen.add(i)
                if i in events:
                    out.append(events[i])
                else:
                    out += ([seeds[i]] if i in seeds else []) + upstream(i, seen)
        return out

    for d in cd.diffs:
        errs = row_errors.get(d.name)
        if errs is None:
            continue
        excused = torch.zeros(errs.numel(), dtype=torch.bool)
        if d.name in seeds:  # tokens an MoE router sent at a near-tie
            excused |= aligned_rows(seeds[d.name], errs.numel())
        mixing = _attends(d.name)
        for rows in upstream(d.name, {d.name}):
            if mixing:  # attention reads every earlier position: an event at row j reaches rows >= j
                rows = torch.cummax(rows.to(torch.int8), 0).values.bool() if rows.numel() else rows
            excused |= aligned_rows(rows, errs.numel())
        above = errs > d.threshold if d.by_noise else torch.zeros_like(excused)
        if not d.by_noise:
            events[d.name] = excused & above
            continue
        j = noise.judge_rows(errs, d.threshold, excused, isolated_rule=d.name.startswith("draft."))
        shift = _row_shift(d, errs, ~excused, fc_in, row_errors)
        diverges = j.diverges or (shift is not None and shift.diverges)
        if diverges and not j.diverges and shift is not None:
            d.detail = f"{d.detail}; {shift.describe()}" if d.detail else shift.describe()
        d.status = TensorStatus.MISMATCH if diverges else TensorStatus.OK
        d.worst_row = int(errs.argmax()) if diverges else -1
        # An excused row passes its excuse on where it really moved: above the threshold, or above the
        # dtype's rounding (SAFETY x unit roundoff) where the threshold took events into its floor.
        moved = errs > min(d.threshold, noise.SAFETY * noise.unit_roundoff(dtype))
        events[d.name] = (excused & moved) | (above if not diverges else torch.zeros_like(above))
        if bool((excused & above).any()):
            cd.excused_rows[d.name] = excused & above
        if fc_chunk_index(d.name) is not None and FC_IN in events:  # fc reads the chunks together
            events[FC_IN] = events[FC_IN] | aligned_rows(events[d.name], events[FC_IN].numel())


def _judged_on_own_floor(d: TensorDiff | None) -> bool:
    return d is not None and d.by_noise and d.threshold > 0 and d.floor_basis == MEASURED_FLOOR


def _row_shift(
    d: TensorDiff,
    errs: torch.Tensor,
    counted: torch.Tensor,
    fc_in: TensorDiff | None,
    row_errors: dict[str, torch.Tensor],
) -> noise.RowShift | None:
    """The row shift (difftest.compare.noise) of one of the draft's own tensors, those the engine computes
    from draft.fc_in (not fc_in, its chunks or the embedding lookup), where both floors were measured."""
    part = split_draft(d.name)
    if part is None or part[1] in ("fc_in", "embeds") or fc_chunk_index(d.name) is not None:
        return None
    if fc_in is None or FC_IN not in row_errors or not (_judged_on_own_floor(d) and _judged_on_own_floor(fc_in)):
        return None
    floor, input_floor = d.threshold / noise.SAFETY, fc_in.threshold / noise.SAFETY
    return noise.row_shift(errs, floor, counted, row_errors[FC_IN], input_floor)


def _tie_step(ref: Capture, other: Capture, floor: noise.NoiseFloor) -> tuple[int | None, str]:
    """The first draft step where the engine drafted another token than the reference *at a tie*:
    later steps compute on another token and are not compared. A drafted token that differs where
    the reference's margin is clear is no tie: that step's logits diverge and say so."""
    a, b = ref.meta.draft_tokens, other.meta.draft_tokens
    s = noise._diverged_step(a, b)
    if s is None:
        return None, ""
    name = draft_name(s, "logits_target")
    if name not in ref.tensors:
        return None, ""
    row = ref.tensors[name].reshape(-1, ref.tensors[name].shape[-1])[-1:]
    if not bool(noise.tie_rows(row, floor.threshold(name)).all()):
        return None, ""
    margin, rms = noise.top1_margins(row)
    return s, (
        f"the engine drafted token {b[s]} and the reference {a[s]} at step {s}, where the reference's top-1 "
        f"margin {float(margin[0]):.3g} is within noise ({noise.TIE_FACTOR:g} x threshold "
        f"{floor.threshold(name):.3g} x row RMS {float(rms[0]):.3g}): a tie, so later steps compute on other tokens"
    )


def localise(cd: CaptureDiff, wiring: list[str], num_layers: int | None) -> None:
    """Mark the tensors where error is introduced: above noise, and no diverging input, or an excess
    more than noise.JUMP times that of every diverging input. Inputs the engine did not capture are
    looked through to their own inputs."""
    by_name = {d.name: d for d in cd.diffs}

    def effective(name: str, seen: set) -> list[TensorDiff]:
        out = []
        for i in inputs_of(name, wiring, num_layers):
            if i in seen:
                continue
            seen.add(i)
            d = by_name.get(i)
            if d is None or d.status in (TensorStatus.MISSING, TensorStatus.ALLOWED_MISSING):
                out += effective(i, seen)
            elif d.status != TensorStatus.TIE:
                out.append(d)
        return out

    for d in cd.diffs:
        if d.ok:
            continue
        upstream = [i.excess for i in effective(d.name, {d.name}) if not i.ok]
        d.introduced = not upstream or d.excess > noise.JUMP * max(upstream)


def top1_agreement(ref: Capture, other: Capture, names: list[str]) -> tuple[int, int]:
    """(agreeing rows, rows) of argmax over the last dim, summed over the given logits tensors."""
    agree = total = 0
    for name in names:
        if name in ref and name in other:
            a, b = ref.get(name), other.get(name)
            if a.shape[:-1] != b.shape[:-1]:
                continue
            agree += int((a.argmax(-1) == b.argmax(-1).to(a.device)).sum())
            total += a.shape[:-1].numel()
    return agree, total
