"""What every number the harness reports means, and how each engine's and trainer's own figure
converts to it. Declared once: reports, the upgrade summary, `difftest train-acc` and `probe`
print their definitions from here.

Why this matters (vllm issue 42508, vllm PR 16035): "accept length 2.6" in SGLang, "acceptance
length 2.6" in vLLM and "acc 0.74" in a trainer's log are three different quantities. SGLang's
`spec_accept_length` counts the prefill's first token; vLLM's `mean_acceptance_length` includes
the bonus token; a trainer's per-step accuracy is teacher-forced and, in SpecForge, not
conditioned on the earlier steps. A regression hunt that compares them as one number chases a
difference that is only the definition.

Each Definition names the figure as it is spelled where it comes from, says what it counts, and
how it converts to the harness's own quantity (`difftest.accept_length` per verify step, or the
per-position acceptance `difftest.acceptance_rate_per_pos`). Conversions of trainer accuracies to
accept length are exact only under the stated conditions and say so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Definition:
    name: str  # as spelled where it comes from: `source.figure`
    counts: str  # what the number counts, in one line
    converts: str  # how it becomes the harness's quantity ("as is", a formula, or why it does not)

    @property
    def source(self) -> str:
        return self.name.split(".", 1)[0]

    def line(self) -> str:
        return f"{self.name}: {self.counts}; to difftest: {self.converts}"


ACCEPT_LENGTH = "difftest.accept_length"
PER_POSITION = "difftest.acceptance_rate_per_pos"
TOP1 = "difftest.top1_agreement"
ROW_ERROR = "difftest.row_error"
EXCESS = "difftest.excess"

DEFINITIONS: tuple[Definition, ...] = (
    # the harness's own figures
    Definition(
        ACCEPT_LENGTH,
        "accepted draft tokens + 1 per verify step, averaged over the verify steps of every "
        "prompt (the +1 is the token the target itself contributes at each verify)",
        "as is",
    ),
    Definition(
        PER_POSITION,
        "for draft position j (0-based), the fraction of verify steps in which the first j+1 "
        "draft tokens were all accepted: P(K > j) for K accepted tokens per verify (a chain)",
        "as is; accept_length = 1 + the sum over positions",
    ),
    Definition(
        TOP1,
        "positions where the draft's step-0 top-1 token equals the reference draft's, over positions "
        "where the reference has a clear choice (its top-1 margin above noise)",
        "as is (no accept length)",
    ),
    Definition(ROW_ERROR, "per token row: ||engine - reference||_2 / ||reference||_2 over finite entries", "as is"),
    Definition(
        EXCESS,
        "a tensor's largest row error divided by its noise threshold (10 x the reference's own "
        "float64-measured rounding error); above 1 is outside noise",
        "as is",
    ),
    # engines' own figures
    Definition(
        "vllm.mean_acceptance_length",
        "1 + accepted draft tokens / drafts (the bonus or correction token included), from the spec_decode counters",
        "as is",
    ),
    Definition("vllm.num_accepted_tokens_per_draft", "accepted draft tokens / drafts (no bonus token)", "+ 1"),
    Definition(
        "vllm.num_accepted_tokens_per_pos",
        "per position j: drafts in which position j was accepted "
        "(vllm:spec_decode_num_accepted_tokens_per_pos{position=j})",
        "/ vllm:spec_decode_num_drafts = acceptance_rate_per_pos[j]",
    ),
    Definition(
        "sglang.spec_accept_length",
        "completion_tokens / spec_verify_ct: the prefill's first token counts as an accepted token",
        "(completion_tokens - requests) / spec_verify_ct",
    ),
    Definition(
        "sglang.spec_num_correct_drafts",
        "accepted draft tokens summed over verify steps (meta_info, per request)",
        "/ spec_verify_ct + 1",
    ),
    Definition(
        "sglang.spec_correct_drafts_histogram",
        "hist[j]: verify steps that accepted exactly j drafts",
        "acceptance_rate_per_pos[j] = sum(hist[j+1:]) / spec_verify_ct",
    ),
    Definition(
        "sglang.avg_spec_accept_length",
        "server-wide average of spec_accept_length since start (every request, other clients' too)",
        "not convertible per request: informational only",
    ),
    Definition(
        "acceptance_rate",
        "accepted / proposed draft tokens (a chain proposes num_draft_tokens - 1 per verify)",
        "rate * (num_draft_tokens - 1) + 1, chains only",
    ),
    # trainers' own figures (difftest_engines/trainingdata/train_accuracy.py recomputes them with each trainer's rules)
    Definition(
        "speculators.full_acc",
        "full_acc_k: origins where draft steps 0..k were all right (teacher-forced "
        "tokens since v0.7; prev_correct ANDed) / origins counted at step k",
        "a prediction: acceptance_rate_per_pos[k] ~ full_acc_k, accept_length ~ 1 + sum_k full_acc_k over "
        "the engine's num_steps (<= ttt_steps); training counts every origin, verify steps only those where "
        "the previous verify stopped",
    ),
    Definition(
        "speculators.cond_acc",
        "cond_acc_k: origins right at step k / origins right at steps 0..k-1",
        "a prediction: acceptance_rate_per_pos[k] ~ product of cond_acc_0..k",
    ),
    Definition(
        "specforge.acc",
        "acc_k: positions where step k's prediction equals the target's full-vocab argmax / "
        "loss_mask.sum(); teacher-forced, NOT conditioned on the earlier steps (out-of-vocab targets are misses)",
        "an estimate only: acceptance_rate_per_pos[k] ~ product of acc_0..k (treats the steps as independent)",
    ),
)

BY_NAME: dict[str, Definition] = {d.name: d for d in DEFINITIONS}

# the native figure each trainer logs, by the rules' name prefix (difftest_engines/trainingdata TrainerRules.name)
TRAINER_FIGURES = {"speculators": ("speculators.full_acc", "speculators.cond_acc"), "specforge": ("specforge.acc",)}


def definition(name: str) -> Definition:
    if name not in BY_NAME:
        raise KeyError(f"no definition for {name!r} (known: {', '.join(BY_NAME)})")
    return BY_NAME[name]


def trainer_figures(rules_name: str) -> tuple[str, ...]:
    """`speculators>=0.7`, `speculators@0.6`, `specforge@0.2` -> the figures that trainer logs."""
    for prefix, names in TRAINER_FIGURES.items():
        if rules_name.startswith(prefix):
            return names
    return ()


def lines(names: list[str] | tuple[str, ...]) -> list[str]:
    """One line per distinct known name, in first-mention order."""
    seen = dict.fromkeys(n for n in names if n in BY_NAME)
    return [BY_NAME[n].line() for n in seen]


def accept_length_from_per_position(rates: list[float]) -> float:
    """accept_length = 1 + sum_j P(K > j): K = number of accepted tokens, a non-negative integer."""
    return 1.0 + float(sum(rates))


def per_position_from_conditional(cond: list[float]) -> list[float]:
    """P(K > k) = prod_{i <= k} P(step i right | steps < i right)."""
    out, run = [], 1.0
    for c in cond:
        run *= c
        out.append(run)
    return out
