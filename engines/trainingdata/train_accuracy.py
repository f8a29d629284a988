"""Training accuracy of an EAGLE-3 draft on offline training data, as the trainers compute it.

Per sample of N tokens t_0..t_{N-1} with dumped fc features f_p, verifier tensor v_p and
loss mask m_p, the draft runs over origins i = 0..N-2 (position i predicts token i+1's
successor: features f_i, token t_{i+1}):

    targets   T_p = argmax over the draft vocab of lm_head(norm(v_p))  (speculators)
                    or of lm_head(v_p)                                 (SpecForge: v is post-norm)
              -- the target's *own* prediction from the dumped verifier tensor, not the data token.
    step 0    hidden = fc(f_i), token t_{i+1}; prediction compared with T_{i+1}
    step k    hidden = the previous step's hidden_next at i, token = the previous step's own
              argmax (speculators) or t_{i+k+1} (SpecForge); compared with T_{i+k+1}
    counted   where the target index exists and the loss mask is set: m_{i+k+1} for
              speculators (the dataset shifts the mask with the tokens: `loss_mask[1:]`),
              m_{i+k} for SpecForge (mask unshifted, last position zeroed), and for SpecForge
              only where the verifier's full-vocab argmax lies inside the draft vocab.

`full_acc[k]` = correct / counted at step k; `cond_acc[k]` = the same over the positions
whose steps 0..k-1 were all counted and correct. Counts add over samples (micro average).
Sources: speculators `train/eagle3/core.py` (align_for_step, compute_accuracy),
SpecForge `OfflineEagle3Dataset.process_data` and `modeling/draft/eagle3` TTT loop.

The draft is any module with the reference draft's interface (engines/ref/eagle3.py):
`combine(fc_in)`, `forward(ids, hidden, positions, cache=, mask=)` returning logits,
hidden_next and cache, `d2t`, `cfg`. This module imports no engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class TrainerRules:
    name: str
    mask_offset: int  # position i at step k is counted when loss_mask[i + k + mask_offset]
    verifier_norm: bool  # targets from lm_head(final_norm(v)) (True) or lm_head(v)
    on_policy_tokens: bool  # steps >= 1 feed the draft's own argmax (else the data's next tokens)
    mask_out_of_vocab: bool  # drop positions whose full-vocab target is outside the draft vocab


RULES = {
    "speculators": TrainerRules("speculators", mask_offset=1, verifier_norm=True, on_policy_tokens=True, mask_out_of_vocab=False),
    "specforge": TrainerRules("specforge", mask_offset=0, verifier_norm=False, on_policy_tokens=False, mask_out_of_vocab=True),
}
RULES["speculators-legacy"] = RULES["speculators"]


@dataclass
class StepCounts:
    correct: list[int] = field(default_factory=list)
    counted: list[int] = field(default_factory=list)
    cond_correct: list[int] = field(default_factory=list)
    cond_counted: list[int] = field(default_factory=list)
    samples: int = 0

    def add(self, other: "StepCounts") -> "StepCounts":
        if not self.counted:
            return StepCounts(*(list(x) for x in (other.correct, other.counted, other.cond_correct, other.cond_counted)),
                              other.samples)  # fmt: skip
        z = lambda a, b: [x + y for x, y in zip(a, b)]  # noqa: E731
        return StepCounts(z(self.correct, other.correct), z(self.counted, other.counted),
                          z(self.cond_correct, other.cond_correct), z(self.cond_counted, other.cond_counted),
                          self.samples + other.samples)  # fmt: skip

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
        return cls(d["correct"], d["counted"], d["cond_correct"], d["cond_counted"], d.get("samples", 0))

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
        return x.float() @ self.lm_head.float().T

    @torch.no_grad()
    def targets(self, verifier: torch.Tensor, d2t: torch.Tensor, rules: TrainerRules) -> tuple[torch.Tensor, torch.Tensor]:
        """verifier [N, H] -> (T [N] draft ids: argmax over the draft vocab's rows, in_vocab [N] bool)."""
        logits = self.logits(verifier, rules)  # [N, V]
        cols = torch.arange(d2t.shape[0]) + d2t.cpu()  # draft id d -> target id d + d2t[d]
        draft_targets = logits[:, cols].argmax(-1)  # [N]
        in_vocab = torch.zeros(logits.shape[-1], dtype=torch.bool)
        in_vocab[cols] = True
        return draft_targets, in_vocab[logits.argmax(-1)]


def score_steps(
    preds: list[torch.Tensor],  # per step k: [N-1] draft-vocab argmax at origins 0..N-2
    targets: torch.Tensor,  # [N] draft ids T_p
    loss_mask: torch.Tensor,  # [N] bool
    rules: TrainerRules,
    in_vocab: torch.Tensor | None = None,  # [N] bool
) -> StepCounts:
    """Count correct predictions per TTT step with the trainer's alignment and masks."""
    N = int(targets.shape[0])
    origins = torch.arange(N - 1)
    out = StepCounts(samples=1)
    all_right = torch.ones(N - 1, dtype=torch.bool)  # steps 0..k-1 counted and correct at origin i
    for k, pred in enumerate(preds):
        j = origins + k + 1  # target index
        m = origins + k + rules.mask_offset  # loss-mask index
        valid = (j <= N - 1) & (m <= N - 1)
        valid &= loss_mask[m.clamp(max=N - 1)].bool()
        if rules.mask_out_of_vocab and in_vocab is not None:
            valid &= in_vocab[j.clamp(max=N - 1)]
        right = (pred.cpu() == targets[j.clamp(max=N - 1)]) & valid
        out.correct.append(int(right.sum()))
        out.counted.append(int(valid.sum()))
        out.cond_correct.append(int((right & all_right).sum()))
        out.cond_counted.append(int((valid & all_right).sum()))
        all_right &= right
    return out


def ttt_mask(n: int, step: int) -> torch.Tensor:
    """[n, n*(step+1)] bool: step-0 keys causal, steps 1..step only the query's own origin."""
    idx = torch.arange(n)
    return torch.cat([idx[None, :] <= idx[:, None]] + [torch.eye(n, dtype=torch.bool)] * step, dim=1)


@torch.no_grad()
def unroll(draft, fc_in: torch.Tensor, input_ids: torch.Tensor, ttt_steps: int, rules: TrainerRules) -> list[torch.Tensor]:
    """Run the TTT unroll over one sample. fc_in [N, A*H], input_ids [N] -> per step [N-1] draft ids."""
    N = int(input_ids.shape[0])
    n = N - 1
    dtype = next(draft.parameters()).dtype
    hidden = draft.combine(fc_in[None, :n].to(dtype))  # [1, n, H]
    data_next = input_ids[None, 1:]  # [1, n]: t_{i+1}
    cache, ids, preds = None, data_next, []
    for k in range(ttt_steps):
        if k > 0:
            if rules.on_policy_tokens:
                ids = draft.to_target_ids(preds[-1])[None]  # the draft's own token, in the target vocab
            else:  # t_{i+k+1}, padded past the end (those positions are never counted)
                ids = torch.cat([data_next[:, k:], data_next.new_zeros(1, k)], dim=1)
        positions = (torch.arange(n) + k)[None, :]
        out = draft(ids, hidden, positions, cache=cache, mask=ttt_mask(n, k))
        cache, hidden = out.cache, out.hidden_next
        preds.append(out.logits[0].argmax(-1))  # [n] draft ids
    return preds


@torch.no_grad()
def sample_accuracy(
    draft, head: VerifierHead, fc_in: torch.Tensor, verifier: torch.Tensor, input_ids: torch.Tensor,
    loss_mask: torch.Tensor, ttt_steps: int, rules: TrainerRules,
) -> StepCounts:  # fmt: skip
    if input_ids.shape[0] < 2:
        return StepCounts([0] * ttt_steps, [0] * ttt_steps, [0] * ttt_steps, [0] * ttt_steps, 1)
    targets, in_vocab = head.targets(verifier, draft.d2t, rules)
    preds = unroll(draft, fc_in, input_ids, ttt_steps, rules)
    return score_steps(preds, targets, loss_mask, rules, in_vocab)
