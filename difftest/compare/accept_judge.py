"""The accept-length verdict: per position, against the noise of the measurement, no fixed threshold.

An accept length is a mean over verify steps, so two correct engines (or two releases of one)
differ by sampling and numerical noise, and a fixed "5% drop" gate both cries wolf on short runs
and misses a regression confined to the deep positions (vllm issues 26191, 40551; SpecForge 310:
position 3 halving moves the mean by less than 5%). So the gate is per draft position j, on
counts the engines report:

    p_ref[j] = a_j / n_ref, p_eng[j] = b_j / n_eng          (verify steps where positions 0..j
                                                            were all accepted, of all verify steps)
    se[j]    = sqrt(p (1 - p) (1/n_ref + 1/n_eng)),  p = (a_j + b_j) / (n_ref + n_eng)
    allowed[j] = Z * se[j] + numerical[j]

* se is the two-proportion standard error under "same acceptance" (pooled p): the spread two runs
  of one engine over these many verify steps would show.
* Z is Bonferroni-corrected over the k positions at the family-wise two-sided false-alarm rate
  FAMILY_ALPHA, so a k-position gate raises no more false alarms than one 3-sigma test
  (Z = 3.0 for k = 1, 3.32 for k = 3, 3.46 for k = 5).
* numerical[j] is *measured*: |p_j| of the reference run in the case's dtype minus the same run in
  float64 (difftest.run.case_run.CaseRun.accept_noise). Greedy decoding is deterministic, so what two
  correct engines differ by beyond sampling is numerical: a near-tie resolved the other way, after
  which the continuations differ. The reference's own float64 move is that effect measured on
  this case. For an engine whose outputs are the reference's it is measured over those same tokens
  (the float64 reference replayed on them): over the float64 run's own trajectory it measured the
  trajectory, 0.65-0.69 in bf16 on the Qwen3 and DeepSeek-V3 test targets against 0.000-0.090 on the
  same tokens, and hid ids-export collapses (docs/verdict.md, stop 53). An engine whose outputs differ
  is judged on the reference's replay of them, with no move at all. Not measured (a stored baseline, a
  target too big for the CPU reference): 0, said. The gate's `noise` says which move it used.

The accept length itself is judged the same way: allowed = ACCEPT_SIGMAS x its standard error
(difftest.records.acceptance.accept_length_spread of both runs) + the reference's measured float64 move,
widened only by a tolerance the case declares (`expect.accept_length: {atol, rtol}`).

A position fails when |p_eng - p_ref| > allowed; the gate names the first failing position, its
rates and its z. A collapse (the engine below the reference) is told from a gain.
"""

from __future__ import annotations

from statistics import NormalDist

from difftest.records.accept_gate import AcceptGate, PositionJudgement
from difftest.records.acceptance import AcceptStats, accept_length_spread
from difftest.records.tolerance import TolerancePair

ACCEPT_SIGMAS = 3.0  # standard errors of the accept-length difference allowed (~0.3% two-sided false alarms)
FAMILY_ALPHA = 2 * (1 - NormalDist().cdf(ACCEPT_SIGMAS))  # the same 0.27% for the whole per-position gate


def z_limit(positions: int) -> float:
    """Bonferroni: each of `positions` two-sided tests at FAMILY_ALPHA / positions."""
    return NormalDist().inv_cdf(1 - FAMILY_ALPHA / (2 * max(positions, 1)))


def _rates(stats: AcceptStats, k: int) -> list[float]:
    r = stats.acceptance_rate_per_pos
    return [r[j] if j < len(r) else 0.0 for j in range(k)]


def judge(
    ref: AcceptStats,
    eng: AcceptStats,
    numerical: tuple[AcceptStats, AcceptStats] | None = None,
    tolerance: TolerancePair | None = None,
    noise: str = "",
) -> AcceptGate:
    """`numerical`: the reference's own run in the case's dtype and in float64, or None (not measured).
    `tolerance`: the case's declared {atol, rtol} on the accept length, or None."""
    # a side without per-position counts (an engine that reports only totals) gets no per-position gate
    k = (
        max(len(ref.accepted_per_pos), len(eng.accepted_per_pos))
        if ref.accepted_per_pos and eng.accepted_per_pos
        else 0
    )
    zl = z_limit(k)
    p_ref, p_eng = _rates(ref, k), _rates(eng, k)
    if numerical is not None:
        a, b = numerical
        moved = [abs(x - y) for x, y in zip(_rates(a, k), _rates(b, k))]
        moved_accept = abs(a.accept_length - b.accept_length) if a.num_verify and b.num_verify else 0.0
        noise = noise or "numerical move measured: the reference in its dtype vs float64"
    else:
        moved, moved_accept = [0.0] * k, None
        noise = noise or "numerical move not measured (sampling spread only)"
    if not k:
        noise += "; per-position counts not reported by " + (
            "the reference" if not ref.accepted_per_pos else "the engine"
        )
    positions = []
    for j in range(k):
        n_a, n_b = ref.num_verify, eng.num_verify
        pooled = (p_ref[j] * n_a + p_eng[j] * n_b) / (n_a + n_b) if n_a + n_b else 0.0
        se = (pooled * (1 - pooled) * ((1 / n_a if n_a else 0.0) + (1 / n_b if n_b else 0.0))) ** 0.5
        allowed = zl * se + moved[j]
        positions.append(
            PositionJudgement(j, p_ref[j], p_eng[j], se, moved[j], allowed, abs(p_eng[j] - p_ref[j]) <= allowed + 1e-12)
        )
    a_ref, a_eng = ref.accept_length, eng.accept_length
    spread = (accept_length_spread(ref) ** 2 + accept_length_spread(eng) ** 2) ** 0.5
    allowed = ACCEPT_SIGMAS * spread + (moved_accept or 0.0)
    tol = None
    if tolerance:
        tol = (tolerance.atol or 0.0) + (tolerance.rtol or 0.0) * abs(a_ref)
        allowed = max(allowed, tol)
    return AcceptGate(a_ref, a_eng, allowed + 1e-12, spread, moved_accept, tol, zl, positions, noise)


def message(gate: AcceptGate, ref: AcceptStats, eng: AcceptStats) -> str:
    """The accept_length item's message: the figures with their definitions' names, then the gate."""
    a, b = gate.reference_accept, gate.engine_accept
    change = (b - a) / a * 100 if a else float("nan")
    tol = f", declared tolerance {gate.tolerance:.3f}" if gate.tolerance is not None else ""
    num = f" + numerical {gate.numerical_accept:.3f}" if gate.numerical_accept is not None else ""
    msg = (
        f"accept length {b:.3f} ({eng.source}) vs reference {a:.3f} ({ref.source}): {change:+.1f}%, "
        f"allowed |diff| <= {gate.allowed_accept:.3f} ({ACCEPT_SIGMAS:g} x expected spread {gate.spread:.3f} over "
        f"{ref.num_verify}/{eng.num_verify} verify steps{num}{tol}); per-position acceptance "
        f"{[round(p.engine, 3) for p in gate.positions]} vs {[round(p.reference, 3) for p in gate.positions]}: "
        f"{gate.summary()}"
    )
    if gate.collapsed:
        return "accept length collapsed: " + msg
    bad = gate.first_failing_position()
    if gate.accept_ok and bad is not None and bad.engine < bad.reference:
        return f"acceptance collapsed at position {bad.position}: " + msg
    return msg
