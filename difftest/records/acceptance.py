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

from difftest.base import definitions

DEFINITION = "accepted draft tokens + 1 per verify step"  # difftest.base.definitions.ACCEPT_LENGTH, in short


@dataclass
class AcceptStats:
    num_verify: int  # verify steps (target forwards that checked a draft)
    num_accepted: int  # draft tokens accepted over all verify steps
    num_draft_steps: int  # draft tokens proposed per verify step (chain length k)
    accepted_per_pos: list[int] = field(default_factory=list)  # verifies where draft position j was accepted
    num_prompts: int = 0
    source: str = ""  # e.g. "ref simulation" or "vllm counters"
    definition: str = DEFINITION
    # the engine's own figures these counts were read from (names in difftest.base.definitions), so a report
    # can say what the engine itself calls them and how they were converted
    native: list[str] = field(default_factory=list)
    outputs: list[list[int]] = field(
        default_factory=list
    )  # generated token ids per prompt, where the engine returns them
    # per request, where a live server reports them (difftest_engines/server/client.py: RequestAcceptance.to_dict)
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
            native=list(dict.fromkeys(self.native + other.native)),
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

# (definition, what it counts, conversion to the harness's definition): the accept-length figures of
# difftest.base.definitions, declared there once; "difftest" is the harness's own
_CONVERTIBLE = (
    "vllm.mean_acceptance_length",
    "vllm.num_accepted_tokens_per_draft",
    "sglang.spec_accept_length",
    "sglang.spec_num_correct_drafts",
    "acceptance_rate",
    "speculators.full_acc",
    "speculators.cond_acc",
    "specforge.acc",
)
NORMALISATION = [("difftest", DEFINITION, "as is")] + [
    (d.name, d.counts, d.converts) for d in (definitions.definition(n) for n in _CONVERTIBLE)
]


def normalise(definition: str, value: float | None = None, steps: list[float] | None = None, **counts: float) -> float:
    """Convert an engine's or trainer's accept-length figure to the harness's definition.

    >>> normalise("sglang.spec_accept_length", completion_tokens=130, requests=10, verify_ct=40)
    3.0
    >>> normalise("vllm.num_accepted_tokens_per_draft", 1.5)
    2.5
    >>> normalise("speculators.full_acc", steps=[0.8, 0.6, 0.4])
    2.8

    Trainer accuracies take their per-step list (`steps`, one figure per TTT step, as many as the
    engine drafts): a prediction of the accept length the engine should reach, not a measurement.
    """

    def need(*keys: str) -> list[float]:
        missing = [k for k in keys if k not in counts]
        if missing:
            raise ValueError(f"{definition}: needs {', '.join(missing)} to convert to '{DEFINITION}'")
        return [float(counts[k]) for k in keys]

    def figure() -> float:
        if value is None:
            raise ValueError(f"{definition}: needs the figure itself to convert to '{DEFINITION}'")
        return float(value)

    def per_step() -> list[float]:
        if not steps:
            raise ValueError(f"{definition}: needs steps (the per-step figures) to convert to '{DEFINITION}'")
        return [float(x) for x in steps]

    if definition in ("difftest", definitions.ACCEPT_LENGTH, "vllm.mean_acceptance_length"):
        return figure()
    if definition == "vllm.num_accepted_tokens_per_draft":
        return figure() + 1.0
    if definition == "sglang.spec_accept_length":
        completion, requests, verify = need("completion_tokens", "requests", "verify_ct")
        return (completion - requests) / verify
    if definition == "sglang.spec_num_correct_drafts":
        (verify,) = need("verify_ct")
        return figure() / verify + 1.0
    if definition == "acceptance_rate":
        (tokens,) = need("num_draft_tokens")
        return figure() * (tokens - 1) + 1.0
    if definition == "speculators.full_acc":  # full_acc_k is already P(K > k)
        return definitions.accept_length_from_per_position(per_step())
    if definition in ("speculators.cond_acc", "specforge.acc"):  # products of the per-step figures
        return definitions.accept_length_from_per_position(definitions.per_position_from_conditional(per_step()))
    known = ", ".join(d for d, _, _ in NORMALISATION)
    raise ValueError(f"unknown accept-length definition {definition!r} (known: {known})")
