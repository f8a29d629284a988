"""The reference's prediction on a server's own tokens: replay prompt + output through the draft.

A live server's accept length is compared with what the reference draft would accept on the
*same generated tokens*, so a target that picks another token somewhere (numerics, a tie, a
different model) does not blur the comparison. Greedy speculative decoding is lossless: the
output is the target's greedy continuation whatever the draft does, so the rounds are replayed
by teacher forcing, from the output alone:

  committed = prompt, pending = output[0]
  each round: draft `num_steps` tokens (a chain, or a tree for topk > 1) from the reference
  target's features of the committed tokens; accepted = the longest prefix (tree path) equal to
  the server's next tokens; commit pending + accepted, the next pending is the server's token after.

The target is run once over the whole sequence (causal: the prefix of that forward is exactly
what each round's features are). A chain keeps the draft's step-0 KV entries across rounds
(speculate.DraftChain) and runs over every position only where its rounding could change the
accepted count (a near-tied step the drafts before it reached, the server's token among its
candidates). The last round may draft past the end of the output; the
server counts that verify in full, so the tokens after the output are the reference target's
own greedy continuation. `target_mismatches` counts output positions where the reference
target's greedy token differs from the server's: nonzero means the server's target computes
something else (another model, a near tie, or lower precision), said beside the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from difftest.api import AcceptStats
from difftest_engines.ref.eagle3 import Eagle3Draft
from difftest_engines.ref.speculate import DraftChain, gather_fc_in, run_draft_chain
from difftest_engines.ref.target import TargetOutput, run_target


@dataclass
class Replay:
    stats: AcceptStats
    target_mismatches: int  # output positions where the reference target's greedy token differs
    first_mismatch: int | None  # index into the output, or None


def _slice(out: TargetOutput, n: int) -> TargetOutput:
    return TargetOutput(
        hidden=[h[:, :n] for h in out.hidden], final_norm=out.final_norm[:, :n], logits=out.logits[:, :n]
    )


def _accept(drafts: list[int], want: list[int]) -> int:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == want[accepted]:
        accepted += 1
    return accepted


@torch.no_grad()
def replay_request(
    target_model,
    draft: Eagle3Draft,
    inputs: Sequence[str],
    prompt: list[int],
    output: list[int],
    num_steps: int,
    topk: int = 1,
    num_draft_tokens: int | None = None,
) -> Replay:
    """Per-position acceptance and accept length the reference predicts on prompt + output."""
    if not output:
        raise ValueError("the server generated no tokens")
    budget = num_draft_tokens or num_steps + 1
    chain = topk == 1 and budget == num_steps + 1
    tokens = list(prompt) + list(output)
    full = run_target(target_model, torch.tensor([tokens]))
    greedy = full.logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()  # the reference's choice at each output position
    mismatches = [i for i, (a, b) in enumerate(zip(greedy, output)) if a != b]
    # past the end of the output: the reference's own greedy continuation, so the last verify counts in full
    extra = [int(full.logits[0, -1].argmax())]
    while len(extra) < num_steps + 1:
        extra.append(int(run_target(target_model, torch.tensor([tokens + extra])).logits[0, -1].argmax()))
    sequence = tokens + extra
    full = run_target(target_model, torch.tensor([sequence]))
    stats = AcceptStats(0, 0, num_steps, [0] * num_steps, 1, source="ref replay of the server's tokens")
    committed, pending = list(prompt), output[0]
    generated = 1
    kept = DraftChain(draft)  # the chain's step-0 KV entries, kept across rounds
    while generated < len(output):
        n = len(committed)
        fc_in = gather_fc_in(_slice(full, n), inputs)
        next_ids = torch.tensor([committed[1:] + [pending]])
        want = sequence[n + 1 : n + 2 + num_steps]  # the server's tokens after the pending one
        if chain:
            # the kept step-0 entries round differently from a chain over every position; where that could
            # change the accepted count (a near-tied step the drafts before it reached, the server's token
            # among its candidates), the round takes the chain over every position
            drafts, tie_step, candidates = kept.run(fc_in, next_ids, num_steps)
            accepted = _accept(drafts, want)
            if accepted >= tie_step and want[tie_step] in candidates:
                drafts = run_draft_chain(draft, fc_in, next_ids, num_steps)
                accepted = _accept(drafts, want)
        else:
            from difftest_engines.ref.tree import draft_tree

            node = draft_tree(draft, fc_in, next_ids, num_steps, topk, budget)
            accepted = 0
            while accepted < num_steps:
                child = next((c for c in node.children if c.token == want[accepted]), None)
                if child is None:
                    break
                node, accepted = child, accepted + 1
        for j in range(accepted):
            stats.accepted_per_pos[j] += 1
        stats.num_verify += 1
        stats.num_accepted += accepted
        generated += accepted + 1
        committed += [pending] + want[:accepted]
        pending = want[accepted]
    stats.outputs = [list(output)]
    return Replay(stats, len(mismatches), mismatches[0] if mismatches else None)
