"""Training accuracy of an EAGLE-3 draft on offline training data, as the trainers compute it.

Per sample of N tokens t_0..t_{N-1} with dumped fc features f_p, verifier tensor v_p and
loss mask m_p, the draft runs over origins i = 0..N-2 (features f_i, token t_{i+1}); step k
at origin i predicts the target at j = i+k+1. Checked against the trainers' own code
(speculators 0.9.0, SpecForge 0.2.0; tests/test_trainers_oracle.py runs it):

  speculators (>= 0.7; `models/eagle3/core.py::Eagle3DraftModel.forward`,
  `models/eagle3/metrics.py::compute_metrics/align_for_step`,
  `models/metrics.py::compute_accuracy_single_step`, `models/eagle3/data.py::shift_batch`):
    targets   T_p = argmax over the draft vocab of lm_head(verifier_norm(v_p))
    tokens    step k >= 1 feeds the data's t_{i+k+1} (teacher forcing, v0.7.0 PR #818);
              before v0.7 the draft's own argmax of step k-1
    positions 1 + i + k (shift_batch drops position 0)
    full_acc  correct[k] = #{i: m_{i+1} and steps 0..k all right at i, and m_{i+k+1}}
              (prev_correct is ANDed in place), counted[k] = #{i: m_{i+k+1}}
    cond_acc  cond_correct[k] = correct[k], cond_counted[k] = #{i: m_{i+1} and steps
              0..k-1 right at i} (prev_correct.sum(), no loss mask at step k)
  SpecForge (0.2.0; `algorithms/eagle3/model.py::_compute_metric_counts`, `Eagle3Model.forward`,
  `modeling/target/target_head.py::TargetHead.preprocess`, `algorithms/eagle3/data.py`):
    targets   the full-vocab argmax of lm_head(v_p) (v is already after the final norm), the head in
              bf16 (ties: the first id); a prediction is right when its target id equals it, so a
              target outside the draft vocab is a miss that still counts (denominator loss_mask.sum())
    draft     SpecForge's own arithmetic and reading of norm_output (trainer_forward.py)
    tokens    step k feeds t_{i+k+1}; positions i + k
    full_acc  correct[k] / counted[k] over i with m_{i+k} (mask unshifted, last zeroed); SpecForge
              logs it per step as acc_k. cond_acc (not a SpecForge metric): the same over the
              origins whose earlier steps were all counted and right.
Counts add over samples (micro average, what the trainers' reductions do).
Packed: speculators trains and validates on rows of several samples (`train/data.py::CollateFn`, multipack
to --total-seq-len; `Trainer.val_epoch` sums each row's metrics). Attention and positions are per sample,
but `align_for_step` slices the row, not the sample: an origin's step-k target may lie in the next sample.
Its full counts then gain that sample's loss positions among its first k targets (none for chat data,
whose first tokens are prompt), and its cond denominators (prev_correct.sum()) also count origins whose
target lies past their own sample's end: StepCounts.packed_cond_extra and packing_line say how many.
Attention over the sample: full causal, except under speculators >= 0.7 for a draft config whose
layer records a sliding window (the `speculators train` default, 2048): see scoring_window.

The draft is any module with the reference draft's interface (difftest_engines/ref/eagle3.py):
`combine(fc_in)`, `forward(ids, hidden, positions, cache=, mask=)` returning logits,
hidden_next and cache, `d2t`, `cfg` (and its modules by name for trainer_forward.py). This module
imports no serving engine.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass, field, replace

import torch

from difftest.api import ConfigError
from difftest_engines.trainingdata.trainer_forward import is_llama_draft, specforge_unroll


@dataclass(frozen=True)
class TrainerRules:
    name: str  # trainer@version range, named in reports
    mask_offset: int  # position i at step k is counted when loss_mask[i + k + mask_offset]
    verifier_norm: bool  # targets from lm_head(final_norm(v)) (True) or lm_head(v)
    on_policy_tokens: bool  # steps >= 1 feed the draft's own argmax (else the data's next tokens)
    out_of_vocab_is_miss: bool  # a target whose full-vocab argmax is outside the draft vocab is a counted miss
    and_previous_steps: bool  # full_acc[k] needs steps 0..k all right (speculators' prev_correct)
    position_offset: int  # the first origin's rotary position
    default_ttt_steps: int  # the trainer's default unroll depth
    default_max_len: int  # the trainer's default truncation of a sample
    max_len_after_shift: bool  # truncation applies to the shifted sample (N-1 positions), not the raw N tokens
    applies_sliding_window: bool  # the trainer's draft attends within the window its config records (scoring_window)
    # the dtype the trainer's verifier head computes target logits in before its argmax (ties: first index);
    # None: float32 (the reference's matmul)
    target_logits_dtype: str | None = None
    # the draft's forward: "reference" (difftest_engines/ref's draft) or "specforge" (that trainer's own arithmetic
    # and its reading of norm_output: difftest_engines/trainingdata/trainer_forward.py)
    draft_forward: str = "reference"
    # the one dtype the trainer's own training forward runs in, where it has only one (None: the draft's torch_dtype,
    # any); train-acc scored in another says its counts are not the trainer's
    forward_dtype: str | None = None


SPECULATORS_CURRENT = TrainerRules(
    "speculators>=0.7",
    mask_offset=1,
    verifier_norm=True,
    on_policy_tokens=False,
    out_of_vocab_is_miss=False,
    and_previous_steps=True,
    position_offset=1,
    default_ttt_steps=3,
    default_max_len=8192,
    max_len_after_shift=True,
    applies_sliding_window=True,
)
# speculators 0.9.0 train/config/schema.py: ttt_steps 3, total_seq_len 8192; CollateFn truncates to max_len
# after the preprocess shift_batch. Sliding window: since v0.7.0 (PR #684), see scoring_window.
SPECULATORS_BEFORE_0_7 = replace(
    SPECULATORS_CURRENT, name="speculators<0.7", on_policy_tokens=True, applies_sliding_window=False
)
# SpecForge 0.2.0 config/schema.py: ttt_length 7, data.max_length 2048;
# algorithms/eagle3/data.py::normalize_offline_sample truncates the raw sample.
# Targets: modeling/target/target_head.py::TargetHead.from_pretrained casts the frozen lm_head to bfloat16
# whatever the model's torch_dtype, so `target_head(hidden_state)` (training/strategies/base.py::
# _prepare_eagle_target) gives bf16 logits, and algorithms/eagle3/model.py::_compute_target_p takes
# `target.float().argmax(-1)` of them: ties among bf16-rounded logits go to the first id.
SPECFORGE = TrainerRules(
    "specforge@0.2",
    mask_offset=0,
    verifier_norm=False,
    on_policy_tokens=False,
    out_of_vocab_is_miss=True,
    and_previous_steps=False,
    position_offset=0,
    default_ttt_steps=7,
    default_max_len=2048,
    max_len_after_shift=False,
    applies_sliding_window=False,
    target_logits_dtype="bfloat16",
    draft_forward="specforge",
    # the bf16 TargetHead takes the stored hidden_state as it is, so the files are bf16, and the draft's fc takes the
    # same files' aux_hidden_state: offline, model.torch_dtype float32 fails at fc ("expected m1 and m2 to have the
    # same dtype"), measured with tests/trainer_oracle/specforge_forward.py
    forward_dtype="bfloat16",
)

RULES = {
    "speculators": SPECULATORS_CURRENT,
    "speculators-legacy": SPECULATORS_BEFORE_0_7,
    "specforge": SPECFORGE,
}
DEFAULT_TRAINER = {
    "speculators": "speculators@0.9",
    "speculators-legacy": "speculators@0.6",
    "specforge": "specforge@0.2",
}


# The releases these rules were read from (the module docstring): speculators v0.3.x to 0.9.0 (the
# rules change at 0.4 and 0.7), SpecForge 0.2.0. Outside them a trainer may count differently, and
# scoring with the nearest rules would name rules that were never checked: such versions are refused.
COVERED = {"speculators": ((0, 3), (0, 9)), "specforge": ((0, 2), (0, 2))}  # first, last major.minor; any patch
# a release as pip and the draft configs write it: 0.9, 0.9.0, v0.9.0, 0.9.0rc1, 0.3.1.dev5+g1234abc
_VERSION = re.compile(r"v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[.-]?(?:a|b|rc|post|dev)\d*)*(?:\+[A-Za-z0-9.]+)?")


def covered_ranges() -> str:
    """'speculators 0.3 to 0.9.x, specforge 0.2.x': what a refusal names."""

    def one(name: str, first: tuple[int, int], last: tuple[int, int]) -> str:
        return (
            f"{name} {first[0]}.{first[1]}.x"
            if first == last
            else f"{name} {first[0]}.{first[1]} to {last[0]}.{last[1]}.x"
        )

    return ", ".join(one(name, *span) for name, span in COVERED.items())


def _version_tuple(text: str, where: str) -> tuple[int, ...]:
    m = _VERSION.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"{where}: cannot read a version from {text!r}; expected e.g. 0.9 or 0.9.0")
    return tuple(int(x or 0) for x in m.groups())


def _covered(name: str, version: str, where: str) -> tuple[int, ...]:
    v = _version_tuple(version, where)
    first, last = COVERED[name]
    if not first <= v[:2] <= last:
        raise ConfigError(
            f"{where}: {name}@{version} is outside the trainer versions whose rules difftest has "
            f"({covered_ranges()}); give a version in those ranges"
        )
    return v


def rules_for(trainer: str, where: str = "trainer") -> TrainerRules:
    """`speculators@0.9`, `speculators@0.6.2`, `specforge@0.2` (or a bare name: its current version) -> rules.
    A version outside COVERED is refused, naming the covered ranges."""
    name, at, version = trainer.strip().partition("@")
    if at and not version.strip():
        raise ConfigError(
            f"{where}: {trainer!r} has an empty version; expected e.g. {name}@0.9, or {name} alone for its latest covered"
        )
    if name == "speculators":
        v = _covered(name, version or "0.9", where)
        if v >= (0, 7):
            return SPECULATORS_CURRENT
        # v0.3.x `models/eagle3/core.py`: targets = verifier_lm_head(verifier_last_hidden_states), no norm;
        # v0.6.0 adds verifier_norm; both feed the draft's own argmax (mapped through d2t) at steps >= 1
        return replace(SPECULATORS_BEFORE_0_7, name=f"speculators@{version}", verifier_norm=v >= (0, 4))
    if name == "specforge":
        _covered(name, version or "0.2", where)
        return SPECFORGE
    close = difflib.get_close_matches(name, ["speculators", "specforge"], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"{where}: unknown trainer {name!r}{hint}; expected speculators@VERSION or specforge@VERSION")


@dataclass
class StepCounts:
    correct: list[int] = field(default_factory=list)
    counted: list[int] = field(default_factory=list)
    cond_correct: list[int] = field(default_factory=list)
    cond_counted: list[int] = field(default_factory=list)
    samples: int = 0
    # per step: counted positions with a step <= k whose top-2 draft logits lie within the precision's reach
    # (difftest_engines.trainingdata.precision); empty when the scoring was not asked to find them
    near_ties: list[int] = field(default_factory=list)
    # speculators packs samples into rows (--total-seq-len) for training and validation; the forward masks
    # attention by document, but its metrics run over the whole row (module docstring, "packed"):
    # packed_cond_extra: origins whose step-k target lies past their sample's end and whose steps so far were
    #   all inside it and right: the packed cond_acc_k denominator counts them (unless the sample ends its row)
    # packed_cond_extra_max: that plus the origins that need a right prediction of the next sample's tokens
    # lead_masked: loss-mask positions among each sample's first k shifted positions: a step-k target there is
    #   counted in full_acc_k when the sample follows another in a row (0: full counts are packing-free)
    packed_cond_extra: list[int] = field(default_factory=list)
    packed_cond_extra_max: list[int] = field(default_factory=list)
    lead_masked: list[int] = field(default_factory=list)

    def add(self, other: "StepCounts") -> "StepCounts":
        if not self.counted:
            return StepCounts(
                *(list(x) for x in (other.correct, other.counted, other.cond_correct, other.cond_counted)),
                other.samples,
                *(
                    list(x)
                    for x in (other.near_ties, other.packed_cond_extra, other.packed_cond_extra_max, other.lead_masked)
                ),
            )
        z = lambda a, b: [x + y for x, y in zip(a, b)]  # noqa: E731
        return StepCounts(
            z(self.correct, other.correct),
            z(self.counted, other.counted),
            z(self.cond_correct, other.cond_correct),
            z(self.cond_counted, other.cond_counted),
            self.samples + other.samples,
            z(self.near_ties, other.near_ties),
            z(self.packed_cond_extra, other.packed_cond_extra),
            z(self.packed_cond_extra_max, other.packed_cond_extra_max),
            z(self.lead_masked, other.lead_masked),
        )

    @property
    def full_acc(self) -> list[float]:
        return [c / n if n else float("nan") for c, n in zip(self.correct, self.counted)]

    @property
    def cond_acc(self) -> list[float]:
        return [c / n if n else float("nan") for c, n in zip(self.cond_correct, self.cond_counted)]

    def to_dict(self) -> dict:
        return {**asdict(self), "full_acc": self.full_acc, "cond_acc": self.cond_acc}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCounts":
        return cls(
            d["correct"],
            d["counted"],
            d["cond_correct"],
            d["cond_counted"],
            d.get("samples", 0),
            d.get("near_ties", []),
            d.get("packed_cond_extra", []),
            d.get("packed_cond_extra_max", []),
            d.get("lead_masked", []),
        )

    def short(self) -> str:
        f = " ".join(f"{a:.3f}" for a in self.full_acc)
        c = " ".join(f"{a:.3f}" for a in self.cond_acc)
        return f"full_acc [{f}] cond_acc [{c}] over {self.counted[0] if self.counted else 0} positions"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).type_as(x)


@dataclass
class VerifierHead:
    """The target's lm_head (and final norm) that turns a verifier tensor into targets."""

    lm_head: torch.Tensor  # [V, H]
    norm_weight: torch.Tensor  # [H]
    eps: float

    @torch.no_grad()
    def logits(self, verifier: torch.Tensor, rules: TrainerRules) -> torch.Tensor:
        """[N, H] -> [N, V] full-vocab logits, as the trainer's verifier head computes them."""
        x = rms_norm(verifier, self.norm_weight, self.eps) if rules.verifier_norm else verifier
        if rules.target_logits_dtype is not None:  # the trainer's head in its dtype (SPECFORGE's comment)
            dtype = getattr(torch, rules.target_logits_dtype)
            return torch.nn.functional.linear(x.to(dtype), self.lm_head.to(dtype)).float()
        return x.float() @ self.lm_head.float().T

    @torch.no_grad()
    def targets(
        self, verifier: torch.Tensor, d2t: torch.Tensor, rules: TrainerRules
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """verifier [N, H] -> (T [N] draft ids: argmax over the draft vocab's rows, in_vocab [N] bool)."""
        logits = self.logits(verifier, rules)  # [N, V]
        cols = torch.arange(d2t.shape[0]) + d2t.cpu()  # draft id d -> target id d + d2t[d]
        draft_targets = logits[:, cols].argmax(-1)  # [N]
        if rules.out_of_vocab_is_miss:
            # the trainer compares target ids (SpecForge 0.2.0 algorithms/eagle3/model.py::
            # OnlineEagle3Model._acc_and_loss: pred + d2t[pred] == the full-vocab argmax): an in-vocab target is
            # the draft id of that argmax, whichever draft id a tie among the draft's columns would give
            draft_of = torch.full((logits.shape[-1],), -1, dtype=torch.long)
            draft_of[cols] = torch.arange(cols.shape[0])
            full = draft_of[logits.argmax(-1)]
            return torch.where(full >= 0, full, draft_targets), full >= 0
        in_vocab = torch.zeros(logits.shape[-1], dtype=torch.bool)
        in_vocab[cols] = True
        return draft_targets, in_vocab[logits.argmax(-1)]


def score_steps(
    preds: list[torch.Tensor],  # per step k: [N-1] draft-vocab argmax at origins 0..N-2
    targets: torch.Tensor,  # [N] draft ids T_p
    loss_mask: torch.Tensor,  # [N] bool
    rules: TrainerRules,
    in_vocab: torch.Tensor | None = None,  # [N] bool: the full-vocab target lies in the draft vocab
    near: list[torch.Tensor] | None = None,  # per step k: [N-1] bool, the prediction is within the precision's reach
) -> StepCounts:
    """Count correct predictions per TTT step with the trainer's alignment and masks (module docstring).
    near: also count, per step, the counted positions whose steps 0..k hold a prediction in `near`: a
    prediction that can flip moves the counts of its own and every later step at that origin."""
    N = int(targets.shape[0])
    origins = torch.arange(N - 1)
    mask = loss_mask.bool()
    out = StepCounts(samples=1)
    all_right = torch.ones(N - 1, dtype=torch.bool)  # SpecForge cond: steps 0..k-1 counted and right at origin i
    # speculators' prev_correct: the origin's own mask (shifted, m_{i+1}), ANDed with each step's equality
    prev_correct = mask[1:].clone()
    reach = torch.zeros(N - 1, dtype=torch.bool)
    for k, pred in enumerate(preds):
        j = origins + k + 1  # target index
        m = origins + k + rules.mask_offset  # loss-mask index
        exists = (j <= N - 1) & (m <= N - 1)
        valid = exists & mask[m.clamp(max=N - 1)]
        if near is not None:
            reach |= near[k].cpu()
            out.near_ties.append(int((reach & valid).sum()))
        equal = pred.cpu() == targets[j.clamp(max=N - 1)]
        if rules.out_of_vocab_is_miss and in_vocab is not None:
            equal &= in_vocab[j.clamp(max=N - 1)]  # SpecForge compares target ids: no draft id can hit it
        if rules.and_previous_steps:
            out.cond_counted.append(int((prev_correct & exists).sum()))
            # the origin whose step-k target is the first past the end: every earlier step was inside, so known
            out.packed_cond_extra.append(int((prev_correct & (origins + k == N - 1)).sum()))
            out.packed_cond_extra_max.append(int((prev_correct & ~exists).sum()))
            out.lead_masked.append(int(mask[1 : 1 + k].sum()))
            prev_correct &= equal | ~exists  # origins past the end keep their state (align_for_step slices them off)
            right = prev_correct & valid
            out.correct.append(int(right.sum()))
            out.counted.append(int(valid.sum()))
            out.cond_correct.append(int(right.sum()))
            continue
        right = equal & valid
        out.correct.append(int(right.sum()))
        out.counted.append(int(valid.sum()))
        out.cond_correct.append(int((right & all_right).sum()))
        out.cond_counted.append(int((valid & all_right).sum()))
        all_right &= right
    return out


def ttt_mask(n: int, step: int, window: int | None = None) -> torch.Tensor:
    """[n, n*(step+1)] bool: step-0 keys causal (within the last `window` origins, the query's own
    included, when a window is given), steps 1..step only the query's own origin."""
    idx = torch.arange(n)
    base = idx[None, :] <= idx[:, None]
    if window is not None:
        base &= idx[None, :] > idx[:, None] - window
    return torch.cat([base] + [torch.eye(n, dtype=torch.bool)] * step, dim=1)


# The attention of the trainers' drafts over a training sample (checked in the releases named):
#   speculators >= 0.7 (v0.7.0 PR #684 to 0.9.0): `models/eagle3/core.py::Eagle3DraftModel.__init__` takes
#     the layers whose transformer_layer_config.layer_types entry is "sliding_attention" and its
#     `sliding_window`; `forward` builds their mask from `models/eagle3/attention.py::create_combined_mask_mod`
#     (flex BlockMask by default, the same mask_mod densified for sdpa/eager): key k is visible to query q
#     when q - W < k <= q (same document), and `extend_mask_for_draft_tokens` /
#     `extend_dense_mask_for_draft_tokens` add, per TTT step, only the diagonal (the query's own origin),
#     unwindowed. `speculators train` (train/config/schema.py) defaults to --sliding-window 2048 on every
#     draft layer (train/cli.py::create_transformer_layer_config) and --total-seq-len 8192: samples past
#     2048 tokens are scored differently from full causal attention.
#   speculators < 0.7 (0.6.0 checked): no window in the EAGLE-3 draft (only DFlash has one).
#   SpecForge 0.2.0: none. training/model_loading.py copies `sliding_window`, `use_sliding_window`,
#     `max_window_layers` from the target into the draft config (_TARGET_ARCHITECTURE_FIELDS), but
#     `modeling/draft/llama3_eagle.py` never reads them: sdpa / eager take the causal + suffix mask,
#     flex `modeling/draft/flex_attention.py::generate_eagle3_mask` is causal + padding + diagonal,
#     and the flash paths pass window_size=(-1, -1).
def scoring_window(cfg, rules: TrainerRules) -> int | None:
    """The window the trainer's draft attends within when scoring: the config's (Eagle3Config.sliding_window,
    read as speculators reads it) under rules whose trainer applies one, else None (full causal)."""
    window = getattr(cfg, "sliding_window", None)
    return window if rules.applies_sliding_window else None


def describe_attention(cfg, rules: TrainerRules) -> str:
    """One line for reports: the attention the scoring used and why."""
    recorded = getattr(cfg, "sliding_window", None)
    window = scoring_window(cfg, rules)
    if window is not None:
        return f"sliding window {window} (the draft config's layer_types[0] = sliding_attention, as {rules.name} applies it)"
    if recorded is not None:
        return (
            f"full causal (the draft config records a sliding window of {recorded}, which {rules.name} does not apply)"
        )
    return "full causal (the draft config records no sliding window)"


@torch.no_grad()
def unroll(
    draft,
    fc_in: torch.Tensor,
    input_ids: torch.Tensor,
    ttt_steps: int,
    rules: TrainerRules,
    margins: list | None = None,
    norm_output: bool | None = None,
) -> list[torch.Tensor]:
    """Run the TTT unroll over one sample. fc_in [N, A*H], input_ids [N] -> per step [N-1] draft ids.
    margins: appended per step with [N-1] (top-1 - top-2 logit) / the row's largest |logit|.
    norm_output: the draft config's norm_output key as written (None: absent), for a trainer that reads it
    its own way (rules.draft_forward "specforge": trainer_forward.py)."""
    if rules.draft_forward == "specforge" and is_llama_draft(draft):
        # SpecForge 0.2.0 llama3_eagle.py::LlamaForCausalLMEagle3.__init__: getattr(config, "norm_output", True)
        logits_norm = True if norm_output is None else norm_output
        return specforge_unroll(draft, fc_in, input_ids, ttt_steps, logits_norm, margins)[0]
    N = int(input_ids.shape[0])
    n = N - 1
    dtype = next(draft.parameters()).dtype
    hidden = draft.combine(fc_in[None, :n].to(dtype))  # [1, n, H]
    data_next = input_ids[None, 1:]  # [1, n]: t_{i+1}
    cache, ids, preds = None, data_next, []
    window = scoring_window(draft.cfg, rules)
    for k in range(ttt_steps):
        if k > 0:
            if rules.on_policy_tokens:
                ids = draft.to_target_ids(preds[-1])[None]  # the draft's own token, in the target vocab
            else:  # t_{i+k+1}, padded past the end (those positions are never counted)
                ids = torch.cat([data_next[:, k:], data_next.new_zeros(1, k)], dim=1)
        positions = (torch.arange(n) + k + rules.position_offset)[None, :]
        out = draft(ids, hidden, positions, cache=cache, mask=ttt_mask(n, k, window))
        cache, hidden = out.cache, out.hidden_next
        preds.append(out.logits[0].argmax(-1))  # [n] draft ids
        if margins is not None:
            logits = out.logits[0].float()
            top = logits.topk(2, dim=-1).values if logits.shape[-1] > 1 else logits.repeat(1, 2)
            margins.append((top[:, 0] - top[:, 1]) / logits.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny))
    return preds


@torch.no_grad()
def sample_accuracy(
    draft,
    head: VerifierHead,
    fc_in: torch.Tensor,
    verifier: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    ttt_steps: int,
    rules: TrainerRules,
    tie_resolution: float | None = None,
    norm_output: bool | None = None,
) -> StepCounts:
    """tie_resolution: also count the positions whose top-2 draft logits are within this fraction of the row's
    largest |logit| (StepCounts.near_ties; difftest_engines.trainingdata.precision)."""
    if input_ids.shape[0] < 2:
        zeros = [0] * ttt_steps
        return StepCounts(
            zeros, list(zeros), list(zeros), list(zeros), 1, list(zeros) if tie_resolution is not None else []
        )
    targets, in_vocab = head.targets(verifier, draft.d2t, rules)
    margins: list | None = [] if tie_resolution is not None else None
    preds = unroll(draft, fc_in, input_ids, ttt_steps, rules, margins, norm_output)
    near = [m <= tie_resolution for m in margins] if margins is not None else None
    return score_steps(preds, targets, loss_mask, rules, in_vocab, near)


def packing_line(c: StepCounts) -> str | None:
    """One line for train-acc: how speculators' packed batches (training and its logged validation) count
    these samples, from StepCounts' packed_* and lead_masked; None for rules without packing accounting."""
    if not c.packed_cond_extra:
        return None
    low = [n + e for n, e in zip(c.cond_counted, c.packed_cond_extra)]
    high = [n + e for n, e in zip(c.cond_counted, c.packed_cond_extra_max)]
    full = (
        f"full counts are the same packed (no sample has a loss position among its first {len(c.counted) - 1} targets)"
        if not any(c.lead_masked)
        else f"packed, full_acc counts can gain up to {c.lead_masked} positions (loss positions among a sample's "
        "first targets, reached from the sample before it)"
    )
    return (
        f"packing: the trainer scores samples packed into --total-seq-len rows: {full}; its cond_acc denominators "
        f"also count origins whose target lies past their sample's end: cond counted {low} packed"
        + ("" if low == high else f", up to {high} if predictions hit the next packed sample's tokens")
        + " (less for a sample that ends its row)"
    )
