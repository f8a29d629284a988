"""Accept-length statistics in one definition, whatever engine produced them.

The harness's definition: **accept length = accepted draft tokens + 1, averaged over
verify steps** (the +1 is the token the target itself contributes at each verify).
Engines report other quantities; adapters convert before building AcceptStats:
  * SGLang `spec_accept_length` = completion_tokens / verify_ct counts the prefill token:
    use spec_num_correct_drafts / spec_verify_ct + 1.
  * vLLM `mean_acceptance_length` already includes the bonus token: it is this definition.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

DEFINITION = "accepted draft tokens + 1 per verify step"


@dataclass
class AcceptStats:
    num_verify: int  # verify steps (target forwards that checked a draft)
    num_accepted: int  # draft tokens accepted over all verify steps
    num_draft_steps: int  # draft tokens proposed per verify step (chain length k)
    accepted_per_pos: list[int] = field(default_factory=list)  # verifies where draft position j was accepted
    num_prompts: int = 0
    source: str = ""  # e.g. "ref simulation" or "vllm counters"
    definition: str = DEFINITION

    @property
    def accept_length(self) -> float:
        return self.num_accepted / self.num_verify + 1.0 if self.num_verify else float("nan")

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / self.num_verify for a in self.accepted_per_pos] if self.num_verify else []

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accept_length"] = self.accept_length
        d["acceptance_rate_per_pos"] = self.acceptance_rate_per_pos
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptStats":
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in keys})

    def merge(self, other: "AcceptStats") -> "AcceptStats":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        return AcceptStats(
            self.num_verify + other.num_verify,
            self.num_accepted + other.num_accepted,
            max(self.num_draft_steps, other.num_draft_steps),
            [a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))],
            self.num_prompts + other.num_prompts,
            self.source or other.source,
        )
