"""Greedy chain speculative decoding with the reference draft, step by step.

Two pieces:
  * `run_draft_chain`: one drafting round. Step 0 runs fc over the target's features and
    the draft layer over every committed position (causal); steps 1..k-1 each add one
    position, fed with the previous step's drafted token and `hidden_next`, attending to
    everything before through the draft's KV cache. This is what an engine's draft worker
    does after a prefill (vLLM `v1/spec_decode/eagle.py::propose`, chain / top-1 case).
  * `simulate_greedy`: the whole decode loop: prefill, draft, verify, accept the longest
    matching prefix plus the target's own token, repeat. Its output is exactly the
    target's greedy decode (speculation is lossless); its AcceptStats use the harness's
    definition (difftest.records.acceptance). By default it keeps the target's and the draft's
    KV caches across rounds, checking every choice for a near-tie and recomputing that round
    without them where one is: the tokens and statistics of the uncached loop
    (kv_cache=False), at the cost of the new positions only.

Indexing. With committed tokens t_0..t_{n-1} and the target's greedy next token t_n,
draft position j (0 <= j < n) sees the target features at j and the embedding of t_{j+1},
and predicts t_{j+2}. So the last position predicts the first drafted token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from difftest.api import AcceptStats
from difftest.api import FC_IN, draft_name
from difftest.api import ConfigError
from difftest.api import FINAL_NORM, hidden_index
from difftest_engines.ref.eagle3 import Eagle3Draft, KVCache
from difftest_engines.ref.target import TargetOutput, run_target

StepRecorder = Callable[[int, str, torch.Tensor], None]


def gather_fc_in(target_out: TargetOutput, inputs: Sequence[str]) -> torch.Tensor:
    """Concatenate the named target tensors in wiring order: A x [B, n, H] -> [B, n, A*H]."""
    if not inputs:
        raise ConfigError("wiring: no fc inputs given")
    parts = []
    for name in inputs:
        k = hidden_index(name)
        if k is not None:
            if not 0 <= k < len(target_out.hidden):
                raise ConfigError(f"wiring: {name} does not exist; the target has h0..h{len(target_out.hidden) - 1}")
            parts.append(target_out.hidden[k])
        elif name == FINAL_NORM:
            parts.append(target_out.final_norm)
        else:
            raise ConfigError(f"wiring: {name!r} is not a target tensor (expected target.h.K or {FINAL_NORM})")
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def run_draft_chain(
    draft: Eagle3Draft,
    fc_in: torch.Tensor,  # [1, n, A*H]: target features of the committed positions 0..n-1
    next_ids: torch.Tensor,  # [1, n]: target ids of tokens 1..n (the last is the target's greedy next token)
    num_steps: int,
    record: StepRecorder | None = None,
) -> list[int]:
    """Draft `num_steps` tokens greedily; returns their target-vocab ids.

    `record(step, name, tensor)` receives every tensor the draft records (fc_out at step 0;
    embeds, layer0.*, hidden_prenorm, logits at each step) plus `logits_target` (the draft
    logits scattered into the target vocab). Step 0 tensors cover all n positions
    ([1, n, ...]); step s >= 1 tensors cover the one new position ([1, 1, ...]).
    """
    if fc_in.dim() != 3 or fc_in.shape[0] != 1:
        raise ValueError(f"fc_in must be [1, n, A*H], got {tuple(fc_in.shape)}")
    n = fc_in.shape[1]
    if tuple(next_ids.shape) != (1, n):
        raise ValueError(f"next_ids must be [1, {n}] to match fc_in, got {tuple(next_ids.shape)}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")

    def recorder_for(step: int) -> Callable[[str, torch.Tensor], None] | None:
        if record is None:
            return None
        return lambda name, t: record(step, name, t)

    drafted: list[int] = []
    cache: KVCache | None = None
    hidden = next_input = None
    for step in range(num_steps):
        rec = recorder_for(step)
        if step == 0:
            # Prefill of the draft: every committed position, causal, fc over the target features.
            hidden = draft.combine(fc_in, record=rec)  # [1, n, H]
            input_ids = next_ids
            positions = torch.arange(n, device=fc_in.device)[None, :]  # [1, n]
        else:
            # One new position after the cached ones, fed with the previous step's own output.
            input_ids = next_input  # [1, 1]
            positions = torch.tensor([[n - 1 + step]], device=fc_in.device)
        out = draft(input_ids, hidden, positions, cache=cache, record=rec)
        cache = out.cache
        if record is not None:
            record(step, "logits_target", draft.logits_in_target_vocab(out.logits))
        draft_id = out.logits[:, -1].argmax(dim=-1)  # [1], draft vocab
        target_id = draft.to_target_ids(draft_id)  # [1], target vocab
        drafted.append(int(target_id.item()))
        next_input = target_id[:, None]  # [1, 1]
        hidden = out.hidden_next[:, -1:]  # [1, 1, H]
    return drafted


def capture_draft_chain(
    draft: Eagle3Draft, fc_in: torch.Tensor, prompt_ids: list[int], next_token: int, num_steps: int
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The draft chain in canonical names (`draft.*`, `draft.step{s}.*`, batch dim dropped).

    Step 0 runs over every prompt position: row i pairs the features at i with token i+1,
    the last row with `next_token` (the target's choice after the prompt).
    """
    tensors: dict[str, torch.Tensor] = {FC_IN: fc_in[0]}

    def record(step: int, name: str, t: torch.Tensor) -> None:
        tensors[draft_name(step, name)] = t[0]

    next_ids = torch.tensor([prompt_ids[1:] + [next_token]], dtype=torch.long)
    drafted = run_draft_chain(draft, fc_in, next_ids, num_steps, record)
    return tensors, drafted


def _greedy(logits: torch.Tensor) -> list[int]:
    """[n, V] -> argmax ids."""
    return logits.argmax(dim=-1).tolist()


@torch.no_grad()
def greedy_decode(target_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with full recompute: the ground truth speculation must reproduce."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        out = run_target(target_model, torch.tensor([tokens]))
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@dataclass
class CacheTrace:
    """What the cached loop did: rounds, and those recomputed without the cache at a near-tie."""

    rounds: int = 0
    recomputed: int = 0


@torch.no_grad()
def simulate_greedy(
    target_model,
    draft: Eagle3Draft,
    inputs: Sequence[str],
    prompts: list[list[int]],
    num_steps: int,
    max_new_tokens: int,
    kv_cache: bool = True,
    trace: CacheTrace | None = None,
) -> tuple[AcceptStats, list[list[int]]]:
    """Greedy chain speculative decoding over each prompt; returns (stats, generated tokens).

    Per prompt: the prefill yields the first token; then each round drafts `num_steps`
    tokens from the target features of the committed sequence and verifies them with one
    target forward over committed + pending token + drafts. The longest prefix of drafts
    equal to the target's greedy tokens is accepted, plus the target's own next token
    (correction, or bonus when all drafts match). One verify = one target forward after
    the prefill, as engines count it.

    Budget: decoding stops once max_new_tokens are generated and the output is truncated
    to max_new_tokens, but the last verify is counted in full (all its accepted drafts),
    as vLLM's counters do: the statistics measure the draft, not the budget. No EOS stop.

    kv_cache (default): the same rounds with the target's and the draft's KV caches, each choice
    checked for a near-tie and the round recomputed without them where one is (see
    NEAR_TIE_ULPS): the same statistics and tokens as kv_cache=False, which recomputes every
    forward over the whole sequence. `trace` counts the rounds and the recomputed ones.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stats = AcceptStats(
        num_verify=0,
        num_accepted=0,
        num_draft_steps=num_steps,
        accepted_per_pos=[0] * num_steps,
        num_prompts=len(prompts),
        source="ref simulation",
    )
    trace = trace if trace is not None else CacheTrace()
    outputs: list[list[int]] = []
    for prompt in prompts:
        if len(prompt) < 1:
            raise ValueError("empty prompt")
        one = _simulate_one_cached if kv_cache else _simulate_one
        outputs.append(one(target_model, draft, inputs, prompt, num_steps, max_new_tokens, stats, trace))
    # an engine's outputs are compared with these (difftest.checks.checks: judged on the engine's own tokens)
    stats.outputs = [list(o) for o in outputs]
    return stats, outputs


def _prefix(out: TargetOutput, m: int) -> TargetOutput:
    """The first m positions of a forward: for a causal target, the features of those tokens."""
    return TargetOutput(
        hidden=[h[:, :m] for h in out.hidden], final_norm=out.final_norm[:, :m], logits=out.logits[:, :m]
    )


def _accept(drafts: list[int], want: list[int]) -> int:
    """The longest prefix of drafts equal to the target's greedy tokens."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == want[accepted]:
        accepted += 1
    return accepted


def _count(stats: AcceptStats, accepted: int) -> None:
    for j in range(accepted):
        stats.accepted_per_pos[j] += 1
    stats.num_verify += 1
    stats.num_accepted += accepted


def _simulate_one(
    target_model, draft, inputs, prompt: list[int], num_steps: int, max_new_tokens: int, stats, trace
) -> list[int]:
    """The uncached loop: every target forward over the whole sequence, the draft over every position."""
    committed = list(prompt)  # tokens the target has processed and whose features the draft may use
    out = run_target(target_model, torch.tensor([committed]))  # prefill
    pending = int(out.logits[0, -1].argmax())  # the target's next token, not yet fed to it
    generated = [pending]
    while len(generated) < max_new_tokens:
        n = len(committed)
        next_ids = torch.tensor([committed[1:] + [pending]])  # [1, n]
        drafts = run_draft_chain(draft, gather_fc_in(out, inputs), next_ids, num_steps)
        # Verify: the target's greedy token after the pending token and after each draft.
        verify = run_target(target_model, torch.tensor([committed + [pending] + drafts]))
        want = _greedy(verify.logits[0, n:])  # num_steps + 1 predictions
        accepted = _accept(drafts, want)
        _count(stats, accepted)
        trace.rounds += 1
        generated += drafts[:accepted] + [want[accepted]]
        committed += [pending] + drafts[:accepted]
        pending = want[accepted]
        # Causal target: the verify forward's prefix is exactly the committed sequence's features.
        out = _prefix(verify, len(committed))
    return generated[:max_new_tokens]


# -- the KV-cached loop ----------------------------------------------------------------------------
#
# The uncached loop recomputes the target over the whole sequence at every verify and the draft over
# every committed position at every round. The cached loop keeps the target's KV cache
# (transformers' DynamicCache, cropped to the committed positions after each verify) with the
# features of every committed position, and the draft's step-0 KV cache of the committed positions,
# so a round computes its new positions only.
#
# It is not bit-identical to the uncached loop: a forward over other shapes rounds differently (so
# does the uncached loop's own value of a position from one round's length to the next). A greedy
# choice can only differ where its top two logits are within that noise, so every choice a round's
# tokens depend on is checked, and where one is a near-tie the round takes the uncached loop's
# choices, computed as it computes them: a draft near-tie recomputes the round (its features from a
# full forward over the previous verify's tokens, the draft over every position, the verify over the
# whole sequence); a verify near-tie recomputes the verify only (the drafts were the uncached ones).
# A round's full verify forward is the next round's uncached features, so a run of near-ties costs
# about what the uncached loop does.

# How far the two loops' logits moved apart, in units of the logits' dtype epsilon times the row's
# largest |logit|, at every choice of the shipped models' speculative prompts (tiny Llama, tiny
# DeepSeek-V3 with both drafts, the independent Llama, Qwen3 and DeepSeek-V3; fp32 and bf16): at most
# 29 in float32 (10.5 on the target's logits), 3.9 in bfloat16. A choice is a near-tie where its top
# two are within twice the bound (each may move by it), the bound taken at twice the largest measure.
NOISE_UNITS = {torch.bfloat16: 8.0}
NOISE_UNITS_DEFAULT = 64.0  # float32, and the dtypes not measured


def _near_tie(logits: torch.Tensor) -> bool:
    """Whether any row's top two logits ([r, V]) are within what the other loop's rounding may move."""
    wide = logits.float()
    top = wide.topk(2, dim=-1).values
    unit = wide.abs().amax(dim=-1) * torch.finfo(logits.dtype).eps
    bound = 2 * NOISE_UNITS.get(logits.dtype, NOISE_UNITS_DEFAULT) * unit
    return bool(((top[:, 0] - top[:, 1]) <= bound).any())


def _target_forward(model, input_ids: torch.Tensor, cache) -> TargetOutput:
    """The target over the positions after those in `cache`, which it extends (run_target's capture)."""
    return run_target(model, input_ids, cache=cache, with_routers=False)


def _crop(cache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class _DraftChain:
    """The draft chain of one prompt across rounds. Step 0's input at a committed position j (the
    features at j, token j+1) never changes once j+1 is committed or pending, so its KV entries are
    kept and each round's step 0 runs over the new positions only."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.cache = None  # step 0's entries (KVCache, or eagle3_mla's LatentCache) of positions 0..done-1
        self.done = 0

    def run(self, fc_in: torch.Tensor, next_ids: torch.Tensor, num_steps: int) -> tuple[list[int], bool]:
        """The drafts, and whether any step's choice was a near-tie; fc_in/next_ids cover positions 0..n-1."""
        draft, n, done = self.draft, fc_in.shape[1], self.done
        positions = torch.arange(done, n, device=fc_in.device)[None, :]
        out = draft(next_ids[:, done:], draft.combine(fc_in[:, done:]), positions, cache=self.cache)
        # both caches' extend makes new tensors: the later steps never write into this one
        self.cache, self.done = out.cache, n
        drafted, tie = [], False
        for step in range(num_steps):
            logits = out.logits[:, -1]
            tie = tie or _near_tie(logits)
            target_id = draft.to_target_ids(logits.argmax(dim=-1))
            drafted.append(int(target_id.item()))
            if step + 1 < num_steps:
                position = torch.tensor([[n + step]], device=fc_in.device)
                out = draft(target_id[:, None], out.hidden_next[:, -1:], position, cache=out.cache)
        return drafted, tie


def _simulate_one_cached(
    target_model, draft, inputs, prompt: list[int], num_steps: int, max_new_tokens: int, stats, trace
) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache()
    committed = list(prompt)
    # the prefill: one forward from an empty cache, the uncached loop's very forward (the tests hold it)
    out = _target_forward(target_model, torch.tensor([committed]), cache)
    features = gather_fc_in(out, inputs)  # [1, n, A*H]: the committed positions
    pending = int(out.logits[0, -1].argmax())
    generated = [pending]
    chain = _DraftChain(draft)
    last_full, exact = list(committed), out  # the uncached loop's last target forward: its tokens, and it if computed
    tied = False  # whether the last round's own target choices (uncached) were near-ties
    while len(generated) < max_new_tokens:
        n = len(committed)
        next_ids = torch.tensor([committed[1:] + [pending]])
        trace.rounds += 1
        verify = None
        if exact is not None and tied:  # near-ties come in runs (a flat stretch): straight to the uncached round
            drafts = run_draft_chain(draft, gather_fc_in(_prefix(exact, n), inputs), next_ids, num_steps)
            tie = True
        else:
            drafts, tie = chain.run(features, next_ids, num_steps)
            if tie:  # the drafts as the uncached loop drafts them, from its features
                if exact is None:
                    exact = run_target(target_model, torch.tensor([last_full]))
                drafts = run_draft_chain(draft, gather_fc_in(_prefix(exact, n), inputs), next_ids, num_steps)
            else:
                verify = _target_forward(target_model, torch.tensor([[pending] + drafts]), cache)
                want = _greedy(verify.logits[0])
                tie = _near_tie(verify.logits[0, : _accept(drafts, want) + 1])  # choices up to the first rejection
        exact, tied = None, False
        if tie:  # the verify as the uncached loop computes it: over the whole sequence
            trace.recomputed += 1
            exact = run_target(target_model, torch.tensor([committed + [pending] + drafts]))
            want = _greedy(exact.logits[0, n:])
            # the next round tries the caches again unless this one's own target choices were near-ties
            tied = _near_tie(exact.logits[0, n : n + _accept(drafts, want) + 1])
        accepted = _accept(drafts, want)
        _count(stats, accepted)
        last_full = committed + [pending] + drafts
        kept = [pending] + drafts[:accepted]  # the newly committed tokens
        if verify is not None:  # the cached verify fed these very drafts
            new = _prefix(verify, accepted + 1)
            _crop(cache, n + accepted + 1)
        else:
            _crop(cache, n)
            new = _target_forward(target_model, torch.tensor([kept]), cache)
        features = torch.cat([features, gather_fc_in(new, inputs)], dim=1)
        generated += drafts[:accepted] + [want[accepted]]
        committed += kept
        pending = want[accepted]
    return generated[:max_new_tokens]
