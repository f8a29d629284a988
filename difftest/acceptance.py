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
    outputs: list[list[int]] = field(default_factory=list)  # generated token ids per prompt, where the engine returns them
    # per request, where a live server reports them (difftest.server_client.RequestAcceptance.to_dict)
    per_request: list[dict] = field(default_factory=list)

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
            outputs=self.outputs + other.outputs,
        )


def accept_length_spread(stats: AcceptStats) -> float:
    """Standard error of the accept length from the per-position acceptance and the verify count.

    In a chain, accepted tokens per verify K satisfy P(K > j) = acceptance_rate_per_pos[j] = p_j,
    so E[K] = sum p_j and E[K^2] = sum (2j + 1) p_j (K^2 = sum_{j<K} (2j + 1)); the mean over
    num_verify steps has variance Var[K] / num_verify. Verify steps of one prompt are not quite
    independent, so this is the spread of an ideal sample: a floor, not a bound.
    """
    n = stats.num_verify
    if not n:
        return 0.0
    p = stats.acceptance_rate_per_pos
    mean = sum(p)
    second = sum((2 * j + 1) * pj for j, pj in enumerate(p))
    return max(second - mean * mean, 0.0) ** 0.5 / n**0.5


# ---------------------------------------------------------------------------------------
# Normalisation between definitions, applied before engines are compared.
# ---------------------------------------------------------------------------------------

# (definition, what it counts, conversion to the harness's definition)
NORMALISATION = [
    ("difftest", DEFINITION, "as is"),
    ("vllm.mean_acceptance_length", "1 + accepted / drafts (the bonus/correction token included)", "as is"),
    ("vllm.num_accepted_tokens_per_draft", "accepted / drafts (no bonus token)", "+ 1"),
    ("sglang.spec_accept_length", "completion_tokens / verify_ct: the prefill's first token counts too",
     "(completion_tokens - requests) / verify_ct"),
    ("sglang.spec_num_correct_drafts", "accepted draft tokens summed over verifies", "/ verify_ct + 1"),
    ("acceptance_rate", "accepted / proposed draft tokens (per verify: num_draft_tokens - 1 proposed in a chain)",
     "rate * (num_draft_tokens - 1) + 1, chains only"),
]  # fmt: skip


def normalise(definition: str, value: float | None = None, **counts: float) -> float:
    """Convert an engine's accept-length figure to the harness's definition.

    >>> normalise("sglang.spec_accept_length", completion_tokens=130, requests=10, verify_ct=40)
    3.0
    >>> normalise("vllm.num_accepted_tokens_per_draft", 1.5)
    2.5
    """

    def need(*keys: str) -> list[float]:
        missing = [k for k in keys if k not in counts]
        if missing:
            raise ValueError(f"{definition}: needs {', '.join(missing)} to convert to '{DEFINITION}'")
        return [float(counts[k]) for k in keys]

    if definition in ("difftest", "vllm.mean_acceptance_length"):
        return float(value)
    if definition == "vllm.num_accepted_tokens_per_draft":
        return float(value) + 1.0
    if definition == "sglang.spec_accept_length":
        completion, requests, verify = need("completion_tokens", "requests", "verify_ct")
        return (completion - requests) / verify
    if definition == "sglang.spec_num_correct_drafts":
        (verify,) = need("verify_ct")
        return float(value) / verify + 1.0
    if definition == "acceptance_rate":
        (tokens,) = need("num_draft_tokens")
        return float(value) * (tokens - 1) + 1.0
    known = ", ".join(d for d, _, _ in NORMALISATION)
    raise ValueError(f"unknown accept-length definition {definition!r} (known: {known})")
