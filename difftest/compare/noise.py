"""Numerical noise vs real divergence: a noise floor the harness measures, judged per row.

Two correct engines never compute bit-identical tensors: kernels sum in other orders, fuse
adds into norms, keep residuals in other widths. Elementwise `allclose` with a fixed
atol/rtol then fails single elements of correct engines (a 1e-4 atol on values ~20 is 5e-6
relative) while a 61-layer bf16 target fails almost every tensor. So the verdict is not
elementwise. Per tensor and per row (= token position):

    err_i = ||engine_i - ref_i||_2 / ||ref_i||_2            (finite entries; equal infinities
                                                             such as -inf outside the draft
                                                             vocab are equal; NaN or an
                                                             unmatched infinity: err_i = inf)

is compared with what the *reference itself* moves when it computes the same thing in
another precision. The reference runs every prompt twice: in the case's dtype and in
float64 (`measure_floor`). For each canonical tensor

    floor(t)     = FLOOR_QUANTILE quantile over all rows of all prompts of
                   ||ref_dtype_i - ref_float64_i|| / ||ref_float64_i||
    threshold(t) = SAFETY * max(floor(t), UNIT_ROUNDOFF[dtype])

The floor is measured along the data flow, so it already holds the noise each tensor
inherits from its inputs (a deep target layer has a higher floor than the embedding).

Why SAFETY = 10: the float64 run is the exact answer to within 1e-16, so floor(t) is the
reference's own rounding error. A correct engine in the same dtype errs by about as much
again; the two errors add to at most 2x floor (triangle inequality), typically sqrt(2)x
for independent roundings. The rest of the factor covers kernels that round at other
places (tiled GEMMs, fused add+RMSNorm, online softmax, fp32 vs bf16 residuals) and the
spread of per-row errors above the quantile. The divergences this harness exists for
(another layer fed to fc, a norm flag flipped, a vocab map dropped) move rows by 1e-2..1
relative: 1e2..1e6 x the floor. torch.testing reasons the same way: its float32 default
rtol 1.3e-6 is ~10x the unit roundoff 6e-8, its bfloat16 1.6e-2 ~4x 3.9e-3.

Why a row quorum: a tensor diverges when more than ROW_QUORUM of its rows (and at least
QUORUM_MIN_ROWS, or its only row) exceed the threshold, or when one draft row exceeds it
ISOLATED_FACTOR times over. Rows whose error comes from a row an upstream tensor had above
threshold but was judged within noise for are not counted again (compare.judge_along_flow). Discrete
numerical events flip single rows of correct engines far above the rounding floor: an MoE
router choosing another expert at a near-tie (seen: a bf16 DeepSeek-V3 target in SGLang, one
row of 13 at 0.5 relative in the final norm), an argmax near a tie. The faults this harness
exists for move every row. So in the target only the quorum counts; in the draft a single
row counts when it starts there (draft ties are handled apart: compare.tie_step).

Why a row shift as well: the quorum and the isolated-row rule look at rows one by one against
SAFETY x floor, the threshold for a row's worst case. A fault whose effect on every row is a few
floors, not ten, passes both: measured at stop 55, a flipped `norm_before_residual` on a bf16
DeepSeek-V3 target moved the draft's step-0 MLP output by 4.9-8.0x its floor at the
FLOOR_QUANTILE quantile of a prompt's rows, none of them above the threshold. A correct engine
cannot move the *bulk* of the rows so far: its rows' errors and the reference's add to at most
TWO_ROUNDINGS x floor at that quantile (the triangle inequality; measured 0.4-2.0 over every
correct run of the noise matrix, 3 targets x fp32/bf16 on vLLM and SGLang). So in the draft's own
tensors (the engine computes them from draft.fc_in), with at least SHIFT_MIN_ROWS rows counted
(rows no discrete event excused), a tensor also diverges when

    shift(t) = quantile(counted row errors, FLOOR_QUANTILE) / floor(t)
             > SHIFT_MARGIN x max(TWO_ROUNDINGS, shift(draft.fc_in) on the same rows)

The second term is what the draft's input already carries: a correct target that rounds
differently (another GEMM, a wider engine) moves fc_in by more than two roundings, and every
draft tensor with it; the draft is judged on what it adds. Only where both floors were measured
on enough rows (a guessed floor has no bulk to compare). Margins measured: correct runs reach at
most 0.61 of the bound, the bf16 DeepSeek-V3 flip 1.32 and 2.31 (docs/verdict.md, stop 56).

Where error is introduced (Polygraphy's layerwise localisation, judged against noise):
excess(t) = max_i err_i / threshold(t). A diverging tensor *introduced* the error when
no input of it (difftest.base.names.inputs_of) diverges, or its excess exceeds JUMP times the
largest excess among its diverging inputs. Propagated error keeps (or loses) its size in
noise units because the floor grows along the same data flow.

Router ties (MoE targets): a token whose reference routing margin (the gap between a chosen
and an unchosen expert's selection score, or a selected and an unselected group's; recorded
by the reference as `aux.router.{k}.margin`) lies within ROUTER_TIE_FACTOR x the router's
measured score noise (the same float64 comparison, on `aux.router.{k}.scores`) may go to other
experts in another engine. Where both captures hold the experts each chose (`aux.router.{k}.experts`,
the top-k ids per row) the routing is compared row by row (routing_rows): a row whose expert set
differs is judged apart from target.h.{k+1} on (tolerated the way an upstream discrete event is,
compare.judge_along_flow) only where the reference's margin says near-tie, or where a row judged
apart at an earlier MoE layer reaches it (its own position, or an earlier one through causal
attention: the same event carried on); one that differs where the margin is clear and no earlier
event reaches is a divergence of target.h.{k+1} (clear_flip_verdicts), however few such rows.
Near-tie there means within ROUTER_TIE_FACTOR x the margin noise: how far the float64 comparison
moved the margin of the rows both runs routed alike. The score noise overstates what can flip: a
rounding error along the residual's own direction scales every router logit alike, moving scores
(a Kimi-width bf16 target, measured: every row within 4x the score noise) while keeping their
order (0 of 48 rows routed elsewhere); the margin noise is the move of the gap that decides.
Rows at a near-tie that routed the same stay in the verdict. An engine that does not record its
experts is judged on the reference's margin alone, against the score noise (every row a score
move could flip): every such near-tie row is judged apart. Either way
the report counts the rows per MoE layer (difftest.records.routing.RoutingLayer).

The floor leaves out the rows the float64 run routed to other experts than the case's dtype run
(observed flips where both runs record their experts, else every near-tie): their error is a
discrete event, not rounding.

How many rows a floor stands on: the floor of a tensor is the FLOOR_QUANTILE quantile of its row
errors, an order statistic. With n rows, the estimate's level (the fraction of the true error
distribution below it) has mean about 0.9 - 0.8/(n+1) and standard deviation about 0.3/sqrt(n+2)
(Beta order statistics). At MIN_FLOOR_ROWS = 20 that is 0.86 +- 0.064, and 2 rows lie above it
(it is not the largest row); at 8 rows (a Kimi-width bf16 target after router near-ties, measured
on an H200) it is 0.81 +- 0.095, the interpolation between the two largest rows, and at 4 rows
0.74 +- 0.12, usually below the 0.8 quantile. A tensor measured on fewer rows is not called measured:
its source says "measured on N rows (too few; ...)" and its threshold falls back to the larger of
what those rows give and a fallback: for a later draft step, the largest threshold of the same draft
part measured on enough rows at another step; for everything else the dtype's UNMEASURED_REL guess.

The float64 run need not hold a float64 copy of the target: the reference may stream it, one
decoder layer's weights upcast at a time, computing the same tensors bit for bit; it says so with
a capture note starting STREAMED_FLOAT64, and the floor's source says "streamed".

When the reference cannot run twice (a training dump or a stored baseline as reference,
or a target too large for the CPU reference), the floor is not measured and the threshold
falls back to UNMEASURED_REL[dtype]; every verdict then says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from difftest.compare import rowstats
from difftest.records.noise_floor import NoiseFloorRecord, TensorFloor
from difftest.records.routing import RoutingLayer
from difftest.records.tensor_diff import TensorDiff, TensorStatus
from difftest.base import dtypes
from difftest.base.dtypes import DType
from difftest.base.names import hidden_name, in_fc_in, split_draft

UNIT_ROUNDOFF: dict[str, float] = {
    DType.FLOAT64: 2.0**-53,
    DType.FLOAT32: 2.0**-24,
    DType.FLOAT16: 2.0**-11,
    DType.BFLOAT16: 2.0**-8,
}
SAFETY = 10.0
FLOOR_QUANTILE = 0.9
ROW_QUORUM = 0.1
QUORUM_MIN_ROWS = 2  # a quorum is never one row of several (that is the isolated-row rule's business)
ISOLATED_FACTOR = 10.0
JUMP = 10.0
# Guessed, not measured: relative row error of a correct engine at the end of a deep target in
# this dtype (about 1000 and 10 unit roundoffs). Used only when no floor can be measured.
UNMEASURED_REL: dict[str, float] = {DType.FLOAT32: 1e-4, DType.FLOAT16: 1e-2, DType.BFLOAT16: 5e-2}
# A draft position is a tie when the reference's top-1 margin is within what noise can move two
# logits: each moves by at most ~threshold x the row's RMS (the row's error norm spread over it),
# and the difference of two such moves by up to twice that.
TIE_FACTOR = 2.0
# A routing decision is a near-tie when its margin is within what two engines' score noise can
# bridge: each score moves by about the measured router noise (90th percentile), a pair's gap by up
# to twice that; 2x more covers the noise's spread. Tighter than the logits' tie rule on purpose: a
# router tie takes the row out of the verdict, a top-1 tie only out of the agreement count.
ROUTER_TIE_FACTOR = 4.0
# The row shift (module docstring): a correct engine's bulk of rows errs by at most two roundings'
# worth at the floor's quantile; a draft tensor diverges past SHIFT_MARGIN times that, or times what
# its input fc_in already carries, judged on prompts with enough rows for a quantile.
TWO_ROUNDINGS = 2.0
SHIFT_MARGIN = 2.0
SHIFT_MIN_ROWS = 10
# Fewer rows than this and a tensor's floor is not called measured (module docstring: the quantile's
# estimation error); its threshold falls back, said in its source.
MIN_FLOOR_ROWS = 20
CALIBRATION_DTYPE = dtypes.CALIBRATION
HALF_DTYPES = dtypes.HALF  # their calibration run rounds the weights first (run.session.calibration_case)
AUX_PREFIX = "aux."  # reference-side facts stored in a capture, never compared (difftest.base.names)
ROUTER_PREFIX = "aux.router."
ROUTER_EXPERTS = ".experts"  # aux.router.{k}.experts: the top-k expert ids each row went to [R, k]

BLOCK_ELEMENTS = 1 << 22
# The start of the capture note of a float64 run computed layer by layer (difftest_engines/ref/streamed.py):
# the same tensors as a whole float64 copy, said in the floor's source so a reader knows how it was run.
STREAMED_FLOAT64 = "float64 streamed layer by layer"


def measured_source(engine: str, dtype: str, prompts: int, exact_notes: list[str]) -> str:
    """The floor's source line: which engine, dtype and prompts; and "streamed" when the float64
    captures say they were (their notes)."""
    streamed = any(n.startswith(STREAMED_FLOAT64) for n in exact_notes)
    return f"measured: {engine} in {dtype} vs float64 over {prompts} prompts" + (
        f" ({STREAMED_FLOAT64})" if streamed else ""
    )


def row_rel_err(x: torch.Tensor, ref: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """Per-row ||x - ref|| / ||ref|| in float64 over the last dim ([R] on CPU).

    path: None takes the native kernel (difftest.compare.rowkernel: one read of each tensor, no float64
    copies) for CPU pairs of rowstats.NATIVE_MIN elements or more, else "eager" (the definition)."""
    cols = ref.shape[-1] if ref.dim() else 1
    x2, r2 = x.reshape(-1, cols), ref.reshape(-1, cols)
    if path is None:
        path = "native" if rowstats.takes_native(x2, r2, mixed=True) else "eager"
    if path == "native":
        s = rowstats.require_native(x2, r2, mixed=True).rel_err_sums(x2, r2)
        return _rel_err(s["num"], s["den"], s["bad"] > 0)
    rows = max(1, BLOCK_ELEMENTS // max(cols, 1))
    out = []
    for r in range(0, r2.shape[0], rows):
        a, b = x2[r : r + rows].double(), r2[r : r + rows].to(x2.device).double()
        same = a == b
        finite = torch.isfinite(a) & torch.isfinite(b)
        d = torch.where(same | ~finite, 0.0, a - b)
        num = (d * d).sum(-1)
        den = torch.where(finite, b * b, 0.0).sum(-1)
        bad = (~same & ~finite).any(-1)
        out.append(_rel_err(num, den, bad).cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def _rel_err(num: torch.Tensor, den: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    err = torch.where(den > 0, (num / den.clamp_min(1e-300)).sqrt(), torch.where(num > 0, torch.inf, 0.0))
    return torch.where(bad, torch.inf, err)


@dataclass
class NoiseFloor:
    dtype: str
    measured: bool
    source: str  # one line: how the floor was obtained, or why it was not
    tensors: dict[str, TensorFloor] = field(default_factory=dict)
    excluded: list[str] = field(default_factory=list)  # "prompt 2: steps >= 2 (float64 drafted another token)"
    router_noise: dict[str, float] = field(default_factory=dict)  # MoE layer k -> score noise (quantile over rows)
    # MoE layer k -> routing-margin noise (quantile over rows of |margin - float64's margin|), measured
    # where both runs record their experts and routed the row alike (module docstring: router ties)
    router_margin_noise: dict[str, float] = field(default_factory=dict)

    def router_tie_threshold(self, layer: int, observed: bool = False) -> float | None:
        """The margin under which a routing decision at MoE layer `layer` is a near-tie. observed: the
        engine records its experts, so a flip is judged by how far noise moves the deciding gap (the
        margin noise); otherwise by how far it moves any score (every row a score move could flip)."""
        noise_k = self.router_margin_noise.get(str(layer)) if observed else None
        if noise_k is None:
            noise_k = self.router_noise.get(str(layer))
        if noise_k is None:
            return None
        return ROUTER_TIE_FACTOR * max(noise_k, UNIT_ROUNDOFF[DType.FLOAT32])

    def threshold(self, name: str) -> float:
        """The tensor's threshold; names the calibration did not see take the largest threshold of
        the same draft part at another step, else the unmeasured default."""
        if name in self.tensors:
            return self.tensors[name].threshold

        d = split_draft(name)
        if d is not None:
            same_part = [f.threshold for n, f in self.tensors.items() if (split_draft(n) or (None, None))[1] == d[1]]
            if same_part:
                return max(same_part)
        return unmeasured_threshold(self.dtype)

    def floor(self, name: str) -> float:
        f = self.tensors.get(name)
        return f.floor if f else self.threshold(name) / SAFETY

    def record(self) -> NoiseFloorRecord:
        """The floor as the report keeps it, with the settings it was judged with."""
        return NoiseFloorRecord(
            self.dtype,
            self.measured,
            self.source,
            list(self.excluded),
            dict(self.router_noise),
            dict(self.tensors),
            {
                "safety": SAFETY,
                "floor_quantile": FLOOR_QUANTILE,
                "row_quorum": ROW_QUORUM,
                "isolated_factor": ISOLATED_FACTOR,
                "jump": JUMP,
                "tie_factor": TIE_FACTOR,
                "router_tie_factor": ROUTER_TIE_FACTOR,
                "min_floor_rows": MIN_FLOOR_ROWS,
                "two_roundings": TWO_ROUNDINGS,
                "shift_margin": SHIFT_MARGIN,
                "shift_min_rows": SHIFT_MIN_ROWS,
            },
            router_margin_noise=dict(self.router_margin_noise) or None,
        )

    def to_dict(self) -> dict:
        return self.record().to_dict()

    @classmethod
    def from_dict(cls, d: dict) -> "NoiseFloor":
        return cls(
            d["dtype"],
            bool(d["measured"]),
            d["source"],
            {n: TensorFloor(**f) for n, f in (d.get("tensors") or {}).items()},
            list(d.get("excluded") or []),
            {str(k): float(v) for k, v in (d.get("router_noise") or {}).items()},
            {str(k): float(v) for k, v in (d.get("router_margin_noise") or {}).items()},
        )


def unit_roundoff(dtype: str) -> float:
    return UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF[DType.FLOAT32])


def unmeasured_threshold(dtype: str) -> float:
    return UNMEASURED_REL.get(dtype, UNMEASURED_REL[DType.FLOAT32])


def unmeasured(dtype: str, why: str) -> NoiseFloor:
    return NoiseFloor(
        dtype,
        False,
        f"not measured ({why}); threshold {unmeasured_threshold(dtype):g} relative per row "
        f"for every tensor, a guess for {dtype}",
    )


def _quantile(x: torch.Tensor, q: float) -> float:
    x = x[torch.isfinite(x)]
    return float(torch.quantile(x, q)) if x.numel() else 0.0


def _diverged_step(a: list | None, b: list | None) -> int | None:
    """The first draft step whose drafted token differs between two runs (None: all equal or unknown)."""
    if not a or not b:
        return None
    return next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _router_layers(cap) -> list[int]:
    return sorted(
        int(n[len(ROUTER_PREFIX) : -len(".margin")])
        for n in cap.tensors
        if n.startswith(ROUTER_PREFIX) and n.endswith(".margin")
    )


def expert_set_agreement(ref_ids: torch.Tensor, other_ids: torch.Tensor) -> torch.Tensor:
    """Per row: the fraction of the reference's top-k experts the other run chose too ([R] float64)."""
    a, b = ref_ids.reshape(ref_ids.shape[0], -1).long(), other_ids.reshape(other_ids.shape[0], -1).long()
    shared = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1)
    return shared.double() / max(a.shape[-1], 1)


def _experts(cap, k: int) -> torch.Tensor | None:
    ids = cap.tensors.get(f"{ROUTER_PREFIX}{k}{ROUTER_EXPERTS}")
    return None if ids is None else ids.reshape(ids.shape[0], -1).cpu()


def _routed_apart(cap, other, k: int) -> torch.Tensor | None:
    """Bool per row: the two captures' expert sets at MoE layer k differ (None: not both recorded)."""
    a, b = _experts(cap, k), _experts(other, k)
    if a is None or b is None or a.shape[0] != b.shape[0]:
        return None
    return (expert_set_agreement(a, b) < 1) | (a.shape[-1] != b.shape[-1])


def _measure_routers(pairs: list[tuple]) -> tuple[dict[str, float], dict[str, float], list[torch.Tensor]]:
    """Router score noise per MoE layer, and per prompt the first layer at which each row's routing
    parted between the two runs (inf: never): an observed flip where both runs record their experts,
    else a near-tie. Layer by layer: a row parted at layer k computes on other experts from there on
    in one of the two runs, so its scores at later layers are not rounding noise and are left out.
    Also per layer the margin noise: over rows both runs routed alike, how far the margin moved."""
    noise_by_layer: dict[str, float] = {}
    margin_noise: dict[str, float] = {}
    tie_from = [
        torch.full(
            (cap.tensors["target.h.0"].reshape(-1, cap.tensors["target.h.0"].shape[-1]).shape[0],),
            math.inf,
            dtype=torch.float64,
        )
        if "target.h.0" in cap.tensors
        else None
        for cap, _ in pairs
    ]
    layers = sorted({k for cap, _ in pairs for k in _router_layers(cap)})
    for k in layers:
        name = f"{ROUTER_PREFIX}{k}"
        deltas = []
        for (cap, exact), ties in zip(pairs, tie_from):
            if f"{name}.scores" not in cap.tensors or f"{name}.scores" not in exact.tensors:
                continue
            delta = (cap.tensors[f"{name}.scores"].double() - exact.tensors[f"{name}.scores"].double()).abs().amax(-1)
            deltas.append(delta if ties is None else delta[~(ties < k)])
        if not deltas:
            continue
        noise_by_layer[str(k)] = _quantile(torch.cat(deltas), FLOOR_QUANTILE)
        flips = [_routed_apart(cap, exact, k) for cap, exact in pairs]  # None where not both recorded
        moves = []
        for (cap, exact), ties, flipped in zip(pairs, tie_from, flips):
            a, b = cap.tensors.get(f"{name}.margin"), exact.tensors.get(f"{name}.margin")
            if flipped is None or a is None or b is None or a.numel() != flipped.numel() or b.numel() != a.numel():
                continue
            alike = ~flipped if ties is None else ~flipped & ~(ties < k)
            moves.append((a.reshape(-1).double().cpu() - b.reshape(-1).double().cpu()).abs()[alike])
        if moves:
            margin_noise[str(k)] = _quantile(torch.cat(moves), FLOOR_QUANTILE)
        threshold = ROUTER_TIE_FACTOR * max(noise_by_layer[str(k)], UNIT_ROUNDOFF[DType.FLOAT32])
        for (cap, _), ties, flipped in zip(pairs, tie_from, flips):
            margin = cap.tensors.get(f"{name}.margin")
            if ties is not None and flipped is not None and flipped.numel() == ties.numel():
                ties[flipped & torch.isinf(ties)] = k
            elif ties is not None and margin is not None and margin.numel() == ties.numel():
                ties[(margin.reshape(-1).double().cpu() <= threshold) & torch.isinf(ties)] = k
    return noise_by_layer, margin_noise, tie_from


def _floor_rows(name: str, ties: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Rows of `name` that a router near-tie upstream has not touched (None: all of them)."""
    if ties is None or not bool(torch.isfinite(ties).any()):
        return None
    if name.startswith("target.h."):
        return ~(ties < int(name.rsplit(".", 1)[1]))
    touched = torch.isfinite(ties)
    if n == touched.numel():
        return ~touched
    return ~touched[-n:] if n < touched.numel() else None


def _draft_own_floor(own: list[tuple]) -> dict[str, torch.Tensor]:
    """Per draft tensor, the row errors of the draft alone: the draft in the case's dtype fed the
    float64 run's fc_in, against the float64 draft (no target noise, no router events)."""
    out: dict[str, list[torch.Tensor]] = {}
    for cap, exact in own:
        flip = _diverged_step(cap.meta.draft_tokens, exact.meta.draft_tokens)
        for name in cap.tensors:
            d = split_draft(name)
            if d is None or name not in exact.tensors or (flip is not None and d[0] > flip):
                continue
            if cap.tensors[name].shape == exact.tensors[name].shape:
                out.setdefault(name, []).append(row_rel_err(cap.tensors[name], exact.tensors[name]))
    return {n: torch.cat(v) for n, v in out.items()}


def measure_floor(pairs: list[tuple], dtype: str, source: str, own: list[tuple] | None = None) -> NoiseFloor:
    """pairs: per prompt (capture in the case's dtype, the same capture in float64).

    Discrete events are not rounding noise and stay out of the floor: draft steps after the two
    runs drafted different tokens, and rows after an MoE router near-tie (_measure_routers)."""
    router_noise, margin_noise, tie_from = _measure_routers(pairs)
    rows: dict[str, list[torch.Tensor]] = {}
    every: dict[str, list[torch.Tensor]] = {}
    excluded = []
    for i, (cap, exact) in enumerate(pairs):
        # A draft step after the two runs drafted different tokens computes on another token: it says
        # nothing about rounding, so it is left out (its threshold comes from the other prompts).
        flip = _diverged_step(cap.meta.draft_tokens, exact.meta.draft_tokens)
        if flip is not None:
            excluded.append(f"prompt {i}: draft steps > {flip} (float64 drafted another token at step {flip})")
        ties = tie_from[i]
        if ties is not None and bool(torch.isfinite(ties).any()):
            layers = sorted({int(k) for k in ties[torch.isfinite(ties)].tolist()})
            observed = all(_routed_apart(cap, exact, k) is not None for k in layers)
            what = "routed to other experts than the float64 run" if observed else "after an MoE router near-tie"
            excluded.append(
                f"prompt {i}: {int(torch.isfinite(ties).sum())} of {ties.numel()} rows {what} "
                f"(from MoE layer {', '.join(map(str, layers))})"
            )
        for name in cap.names():
            if name not in exact or name.startswith(AUX_PREFIX):
                continue
            d = split_draft(name)
            if flip is not None and d is not None and d[0] > flip:
                continue
            a, b = cap.get(name), exact.get(name)
            if a.shape != b.shape:
                continue
            errs = row_rel_err(a, b)
            every.setdefault(name, []).append(errs)
            keep = _floor_rows(name, ties, errs.numel())
            rows.setdefault(name, []).append(errs if keep is None else errs[keep])
    u = unit_roundoff(dtype)
    tensors = {}
    own_rows = _draft_own_floor(own or [])
    for name, parts in rows.items():
        errs, all_errs = torch.cat(parts), torch.cat(every[name])
        total = all_errs.numel()
        if name in own_rows and not in_fc_in(name):  # at least the draft's own rounding
            errs = torch.cat([errs, own_rows[name]])
            total += own_rows[name].numel()
        floor = _quantile(errs, FLOOR_QUANTILE)
        finite = all_errs[torch.isfinite(all_errs)]
        tensors[name] = TensorFloor(
            name,
            floor,
            float(finite.max()) if finite.numel() else 0.0,
            int(errs.numel()),
            SAFETY * max(floor, u),
            int(total),
        )
    few = _fall_back_where_too_few(tensors, dtype)
    if few:
        fewest = min(few, key=lambda n: tensors[n].rows)
        f = tensors[fewest]
        source += (
            f"; {len(few)} tensors measured on too few rows (under {MIN_FLOOR_ROWS}), fewest {fewest} on {f.rows} "
            f"of {f.total_rows}: their thresholds fall back (each tensor's source says how)"
        )
    return NoiseFloor(dtype, True, source, tensors, excluded, router_noise, margin_noise)


def _fall_back_where_too_few(tensors: dict[str, TensorFloor], dtype: str) -> list[str]:
    """Marks the floors that stand on fewer than MIN_FLOOR_ROWS rows as not measured, their threshold
    the larger of what their rows give and the fallback (module docstring); returns their names."""
    enough = {n: f for n, f in tensors.items() if f.rows >= MIN_FLOOR_ROWS}
    few = [n for n in tensors if n not in enough]
    for name in few:
        f = tensors[name]
        d = split_draft(name)
        same_part = [
            (g.threshold, n)
            for n, g in enough.items()
            if d is not None and not in_fc_in(name) and (split_draft(n) or (None, None))[1] == d[1]
        ]
        if same_part:
            fallback, whose = max(same_part)
            said = f"{whose}'s threshold {fallback:.3g} (the same draft part, measured on {enough[whose].rows} rows)"
        else:
            fallback = unmeasured_threshold(dtype)
            said = f"the {dtype} guess {fallback:.3g} (as an unmeasured floor)"
        total = f.total_rows or 0
        excluded = f", {total - f.rows} left out after discrete events" if total > f.rows else ""
        f.measured = False
        f.threshold = max(f.threshold, fallback)
        f.source = (
            f"measured on {f.rows} rows (too few; under {MIN_FLOOR_ROWS} the {FLOOR_QUANTILE:g} quantile is "
            f"near the largest row{excluded}); threshold {f.threshold:.3g}: the larger of {SAFETY:g} x that floor "
            f"and {said}"
        )
    return few


@dataclass
class RoutingRows:
    """How an engine routed one prompt against the reference, per MoE layer k: `apart[k]` rows judged
    apart from target.h.{k+1} on (excused), `clear[k]` rows sent to other experts where the reference's
    margin is clear (a divergence), `layers` the report's record."""

    apart: dict[int, torch.Tensor] = field(default_factory=dict)
    clear: dict[int, torch.Tensor] = field(default_factory=dict)
    layers: list[RoutingLayer] = field(default_factory=list)


def routing_rows(ref, other, floor: NoiseFloor) -> RoutingRows:
    """Per MoE layer: the engine's expert sets against the reference's where both captures hold them,
    judged by the reference's own routing margin (module docstring: router ties)."""
    out = RoutingRows()
    observed: dict[int, torch.Tensor] | None = None  # the near-ties by the margin noise, computed once if needed
    # A row judged apart at an earlier MoE layer carries that event to every later router of its own
    # position and, through causal attention, of every later position: their inputs there already
    # differ by it, so a later expert set chosen otherwise on one of those rows is the same event
    # carried on, not a clear-margin flip. Seen (DeepSeek-V3 bf16, both engines, prompt 1): a near-tie
    # at MoE layer 1 sent row 3 apart; at layer 2 row 5 (its h.2 within noise, 0.007) went to other
    # experts where the reference's margin is clear, its h.3 then 0.47 off. Rows before the first
    # such row, and every row at the layer of the event or before it, keep the clear-margin verdict:
    # attention reads no later position, and a layer's experts act on their own row only.
    carried_from: int | None = None  # the first position judged apart so far (None: no event yet)
    for k, tie in sorted(router_tie_rows(ref, floor).items()):
        flipped = _routed_apart(ref, other, k)
        if flipped is not None and flipped.numel() == tie.numel():
            observed = router_tie_rows(ref, floor, observed=True) if observed is None else observed
            tie = observed[k]
        if flipped is None or flipped.numel() != tie.numel():
            out.apart[k] = tie
            out.layers.append(RoutingLayer(k, tie.numel(), False, int(tie.sum()), int(tie.sum()), 0))
            continue
        agreement = expert_set_agreement(_experts(ref, k), _experts(other, k))
        reached = torch.arange(tie.numel()) >= (tie.numel() if carried_from is None else carried_from)
        out.apart[k], out.clear[k] = flipped & (tie | reached), flipped & ~(tie | reached)
        if bool(out.apart[k].any()):
            first = int(out.apart[k].nonzero()[0])
            carried_from = first if carried_from is None else min(carried_from, first)
        out.layers.append(
            RoutingLayer(
                k,
                tie.numel(),
                True,
                int(tie.sum()),
                int(out.apart[k].sum()),
                int(out.clear[k].sum()),
                int(flipped.sum()),
                float(agreement.mean()) if agreement.numel() else 1.0,
                float(agreement.min()) if agreement.numel() else 1.0,
            )
        )
    return out


def clear_flip_verdicts(diffs: list[TensorDiff], routing: RoutingRows) -> None:
    """A row routed to other experts where the reference's margin is clear is no numerical event: the
    tensor the MoE layer writes (target.h.{k+1}) diverges, however few such rows (the quorum is for
    events). Not where that tensor already diverges (the error came from upstream)."""
    by_name = {d.name: d for d in diffs}
    for k, rows in routing.clear.items():
        d = by_name.get(hidden_name(k + 1))
        if d is None or not bool(rows.any()) or not d.status.compared:
            continue
        said = (
            f"routing: {int(rows.sum())}/{rows.numel()} rows sent to other experts at MoE layer {k} where the "
            f"reference's routing margin is clear (above {ROUTER_TIE_FACTOR:g} x the router's measured noise)"
        )
        d.detail = f"{d.detail}; {said}" if d.detail else said
        if d.status == TensorStatus.OK:
            d.status = TensorStatus.MISMATCH
            d.excess = max(d.excess, 1.0)


def router_tie_rows(cap, floor: NoiseFloor, observed: bool = False) -> dict[int, torch.Tensor]:
    """MoE layer k -> bool per row: the reference's routing margin is within the router's noise
    (observed: the margin noise, for an engine that records its experts; NoiseFloor.router_tie_threshold)."""
    out = {}
    for name in cap.tensors:
        if name.startswith(ROUTER_PREFIX) and name.endswith(".margin"):
            k = int(name[len(ROUTER_PREFIX) : -len(".margin")])
            threshold = floor.router_tie_threshold(k, observed)
            if threshold is not None:
                out[k] = cap.tensors[name].reshape(-1).double().cpu() <= threshold
    return out


@dataclass
class RowJudgement:
    """One tensor of one prompt judged against its threshold."""

    threshold: float
    err: float  # largest row error
    err_q: float  # FLOOR_QUANTILE quantile of the row errors (comparable with the floor)
    rows_above: int
    diverges: bool
    excess: float  # err / threshold: noise units, for localisation

    @property
    def isolated(self) -> bool:
        return self.err > ISOLATED_FACTOR * self.threshold


def judge_rows(
    errs: torch.Tensor, threshold: float, tolerated: torch.Tensor | None = None, isolated_rule: bool = True
) -> RowJudgement:
    """tolerated: bool per row, True where the row's error comes from a row an upstream tensor already
    had above its threshold *and was judged within noise for* (a discrete event upstream): such rows
    are not counted again. isolated_rule False: the quorum alone decides (target tensors)."""
    if errs.numel() == 0:
        return RowJudgement(threshold, 0.0, 0.0, 0, False, 0.0)
    counted = errs if tolerated is None else torch.where(tolerated, 0.0, errs)
    above = int((counted > threshold).sum())
    quorum = above >= min(QUORUM_MIN_ROWS, errs.numel()) and above > ROW_QUORUM * errs.numel()
    isolated = isolated_rule and float(counted.max()) > ISOLATED_FACTOR * threshold
    worst = float(errs.max())
    q = _quantile(errs, FLOOR_QUANTILE) if bool(torch.isfinite(errs).any()) else math.inf
    return RowJudgement(
        threshold,
        worst,
        q,
        int((errs > threshold).sum()),
        above > 0 and (quorum or isolated),
        worst / threshold if threshold > 0 else math.inf,
    )


@dataclass(frozen=True)
class RowShift:
    """The bulk of one draft tensor's rows against its floor, beside what its input carries."""

    shift: float  # FLOOR_QUANTILE quantile of the counted rows' errors / the tensor's floor
    carried: float  # the same of draft.fc_in over the same rows
    rows: int  # rows counted
    bound: float  # SHIFT_MARGIN x max(TWO_ROUNDINGS, carried)

    @property
    def diverges(self) -> bool:
        return self.shift > self.bound

    def describe(self) -> str:
        return (
            f"its rows shifted as a whole: over {self.rows} rows the {FLOOR_QUANTILE:g} quantile of the row error is "
            f"{self.shift:.3g}x the floor, above {self.bound:.3g} = {SHIFT_MARGIN:g} x the larger of two roundings "
            f"({TWO_ROUNDINGS:g}x) and what draft.fc_in carries on those rows ({self.carried:.3g}x)"
        )


def row_shift(
    errs: torch.Tensor, floor: float, counted: torch.Tensor, input_errs: torch.Tensor, input_floor: float
) -> RowShift | None:
    """The row shift of a draft tensor (module docstring), or None where it cannot be judged: too few
    counted rows, a floor of zero, or an input whose rows are not this tensor's."""
    n = int(counted.sum())
    if n < SHIFT_MIN_ROWS or floor <= 0 or input_floor <= 0 or input_errs.numel() != errs.numel():
        return None
    shift = _quantile(errs[counted], FLOOR_QUANTILE) / floor
    carried = _quantile(input_errs[counted], FLOOR_QUANTILE) / input_floor
    return RowShift(shift, carried, n, SHIFT_MARGIN * max(TWO_ROUNDINGS, carried))


def top1_margins(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of [R, V] logits: (top-1 minus top-2 over finite entries, RMS of the finite entries)."""
    x = logits.reshape(-1, logits.shape[-1]).double()
    finite = torch.isfinite(x)
    masked = torch.where(finite, x, -torch.inf)
    top = masked.topk(min(2, x.shape[-1]), dim=-1).values
    margin = top[:, 0] - top[:, 1] if top.shape[-1] > 1 else torch.full_like(top[:, 0], torch.inf)
    n = finite.sum(-1).clamp_min(1)
    rms = (torch.where(finite, x * x, 0.0).sum(-1) / n).sqrt()
    return margin, rms


def tie_rows(ref_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool per row: the reference's top-1 margin is within what noise can move (TIE_FACTOR x threshold x RMS)."""
    margin, rms = top1_margins(ref_logits)
    return margin <= TIE_FACTOR * threshold * rms
