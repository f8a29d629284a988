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
    KV caches across rounds, checking the choices a round's outcome rests on for a near-tie and
    recomputing what is in doubt without them: the tokens and statistics of the uncached loop
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

    kv_cache (default): the same rounds with the target's and the draft's KV caches, the choices each
    round's outcome rests on checked for a near-tie and recomputed without them where in doubt (see
    NOISE_UNITS and the notes above _near_tie): the same statistics and tokens as kv_cache=False,
    which recomputes every forward over the whole sequence. `trace` counts the rounds and the recomputed ones.
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
    """The first m positions of a forward: for a causal target, the features of those tokens (no logits:
    the loops compute the output head over the positions they choose at only)."""
    return TargetOutput(
        hidden=[h[:, :m] for h in out.hidden], final_norm=out.final_norm[:, :m], logits=out.logits[:, :0]
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
    out = run_target(target_model, torch.tensor([committed]), logits_to_keep=1)  # prefill
    pending = int(out.logits[0, -1].argmax())  # the target's next token, not yet fed to it
    generated = [pending]
    while len(generated) < max_new_tokens:
        next_ids = torch.tensor([committed[1:] + [pending]])  # [1, len(committed)]
        drafts = run_draft_chain(draft, gather_fc_in(out, inputs), next_ids, num_steps)
        # Verify: the target's greedy token after the pending token and after each draft.
        verify = run_target(target_model, torch.tensor([committed + [pending] + drafts]), logits_to_keep=num_steps + 1)
        want = _greedy(verify.logits[0])  # num_steps + 1 predictions
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
# choice can only differ where its top two logits are within that noise, so each choice a round's
# outcome depends on is checked, and where the outcome is in doubt the round takes the uncached
# loop's choices, computed as it computes them. A round's outcome is its accepted count and the
# target's token after it, so only these choices can change it:
#   * the drafts before the first draft step s* with a near-tie, and the target's choices up to the
#     first rejection or s*, whichever comes first (rows after s* were fed a draft in doubt). A
#     near-tie among these recomputes the verify over the whole sequence (the drafts before s* are
#     the uncached loop's, so its rows up to s* are too);
#   * step s*'s draft, only where the drafts before it were all accepted and the target's token at
#     s* is one of the step's near-tied candidates (any of them could be the uncached loop's draft):
#     then the round is recomputed: its features from a full forward over the previous verify's
#     tokens, the draft over every position, the verify over the whole sequence. Anywhere else every
#     candidate is rejected alike, or the round stopped before s*.
# A full verify forward is the next round's uncached features, and it runs with a fresh cache that
# the loop keeps (cropped), so a recomputed round costs one forward over the sequence.

# How far the two loops' logits moved apart, in units of the logits' dtype epsilon times the row's
# largest |logit|, at every choice of the shipped models' speculative prompts (tiny Llama, tiny
# DeepSeek-V3 with both drafts, the independent Llama, Qwen3 and DeepSeek-V3; fp32 and bf16): at most
# 29 in float32 (10.5 on the target's logits), 3.9 in bfloat16. A choice is a near-tie where its top
# two are within twice the bound (each may move by it), the bound taken at twice the largest measure.
NOISE_UNITS = {torch.bfloat16: 8.0}
NOISE_UNITS_DEFAULT = 64.0  # float32, and the dtypes not measured


def _near_tie(logits: torch.Tensor) -> bool:
    """Whether any row's top two logits ([r, V]) are within what the other loop's rounding may move."""
    if logits.shape[0] == 0:
        return False
    wide = logits.float()
    top = wide.topk(2, dim=-1).values
    return bool(((top[:, 0] - top[:, 1]) <= _bound(logits, wide)).any())


def _bound(logits: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """Per row: twice the noise bound (each of two logits may move by it), in the logits' own units."""
    unit = wide.abs().amax(dim=-1) * torch.finfo(logits.dtype).eps
    return 2 * NOISE_UNITS.get(logits.dtype, NOISE_UNITS_DEFAULT) * unit


def _candidates(logits: torch.Tensor) -> torch.Tensor:
    """[V] -> the ids whose logit is within the near-tie bound of the top: one of them is the other loop's choice."""
    wide = logits.float()
    bound = _bound(logits[None], wide[None])[0]
    return (wide >= wide.max() - bound).nonzero().flatten()


def _target_forward(model, input_ids: torch.Tensor, cache, logits_to_keep: int = 0) -> TargetOutput:
    """The target over the positions after those in `cache`, which it extends (run_target's capture)."""
    return run_target(model, input_ids, cache=cache, with_routers=False, logits_to_keep=logits_to_keep)


def _crop(cache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class DraftChain:
    """The draft chain of one prompt across rounds. Step 0's input at a committed position j (the
    features at j, token j+1) never changes once j+1 is committed or pending, so its KV entries are
    kept and each round's step 0 runs over the new positions only."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.cache = None  # step 0's entries (KVCache, or eagle3_mla's LatentCache) of positions 0..done-1
        self.done = 0

    def run(self, fc_in: torch.Tensor, next_ids: torch.Tensor, num_steps: int) -> tuple[list[int], int, list[int]]:
        """The drafts; the first step whose choice is a near-tie (num_steps if none) and that step's
        candidates in target ids (any may be the uncached loop's draft). fc_in/next_ids cover positions 0..n-1."""
        draft, n, done = self.draft, fc_in.shape[1], self.done
        positions = torch.arange(done, n, device=fc_in.device)[None, :]
        out = draft(next_ids[:, done:], draft.combine(fc_in[:, done:]), positions, cache=self.cache)
        # both caches' extend makes new tensors: the later steps never write into this one
        self.cache, self.done = out.cache, n
        drafted: list[int] = []
        tie_step, candidates = num_steps, []
        for step in range(num_steps):
            logits = out.logits[:, -1]
            target_id = draft.to_target_ids(logits.argmax(dim=-1))
            drafted.append(int(target_id.item()))
            if tie_step == num_steps and _near_tie(logits):
                tie_step, candidates = step, draft.to_target_ids(_candidates(logits[0])).tolist()
            if step + 1 < num_steps:
                position = torch.tensor([[n + step]], device=fc_in.device)
                out = draft(target_id[:, None], out.hidden_next[:, -1:], position, cache=out.cache)
        return drafted, tie_step, candidates


def _full_forward(target_model, tokens: list[int], logits_to_keep: int):
    """The uncached loop's forward over `tokens` (the same bits: a fresh cache changes nothing, the tests
    hold it), with the cache it filled."""
    from transformers import DynamicCache

    cache = DynamicCache()
    return _target_forward(target_model, torch.tensor([tokens]), cache, logits_to_keep), cache


def _simulate_one_cached(
    target_model, draft, inputs, prompt: list[int], num_steps: int, max_new_tokens: int, stats, trace
) -> list[int]:
    committed = list(prompt)
    # the prefill: the uncached loop's very forward (the tests hold it)
    out, cache = _full_forward(target_model, committed, 1)
    features = gather_fc_in(out, inputs)  # [1, n, A*H]: the committed positions
    pending = int(out.logits[0, -1].argmax())
    generated = [pending]
    chain = DraftChain(draft)
    last_full, exact = list(committed), out  # the uncached loop's last target forward: its tokens, and it if computed
    tied = False  # whether the last round's own target choices (uncached) were near-ties
    k = num_steps
    while len(generated) < max_new_tokens:
        n = len(committed)
        next_ids = torch.tensor([committed[1:] + [pending]])
        trace.rounds += 1
        previous, exact = exact, None  # the uncached loop's forward over last_full, if computed; this round's
        verify = None  # the cached verify, where it decides the round
        if previous is not None and tied:  # near-ties come in runs (a flat stretch): straight to the uncached round
            drafts = run_draft_chain(draft, gather_fc_in(_prefix(previous, n), inputs), next_ids, k)
            tie_step, candidates = k, []  # the uncached loop's own drafts
        else:
            drafts, tie_step, candidates = chain.run(features, next_ids, k)
            verify = _target_forward(target_model, torch.tensor([[pending] + drafts]), cache, k + 1)
            want = _greedy(verify.logits[0])
            decided = min(_accept(drafts, want), tie_step)  # the target's choices the outcome rests on: rows 0..decided
            if _near_tie(verify.logits[0, : decided + 1]):
                verify = None
        recomputed = verify is None
        if verify is None:  # the verify as the uncached loop computes it: over the whole sequence
            exact, cache = _full_forward(target_model, committed + [pending] + drafts, k + 1)
            want = _greedy(exact.logits[0])
        accepted = _accept(drafts, want)
        if accepted >= tie_step and want[tie_step] in candidates:  # the draft in doubt where it counts
            recomputed = True
            if previous is None:
                previous, _ = _full_forward(target_model, last_full, 1)
            drafts = run_draft_chain(draft, gather_fc_in(_prefix(previous, n), inputs), next_ids, k)
            exact, cache = _full_forward(target_model, committed + [pending] + drafts, k + 1)
            want = _greedy(exact.logits[0])
            accepted = _accept(drafts, want)
        # the next round tries the caches again unless this one's own target choices were near-ties
        tied = exact is not None and _near_tie(exact.logits[0, : accepted + 1])
        trace.recomputed += recomputed
        _count(stats, accepted)
        last_full = committed + [pending] + drafts
        # the features of the newly committed positions n..n+accepted
        source, start = (verify, 0) if exact is None else (exact, n)
        new = TargetOutput(
            hidden=[h[:, start : start + accepted + 1] for h in source.hidden],
            final_norm=source.final_norm[:, start : start + accepted + 1],
            logits=source.logits[:, :0],
        )
        _crop(cache, n + accepted + 1)
        features = torch.cat([features, gather_fc_in(new, inputs)], dim=1)
        generated += drafts[:accepted] + [want[accepted]]
        committed += [pending] + drafts[:accepted]
        pending = want[accepted]
    return generated[:max_new_tokens]
