"""The reference's replay of a server's tokens (difftest_engines/ref/replay.py): on the reference's own
greedy output it must count exactly what its own speculative decoding counted, chain and tree,
and it must say where a server's tokens are not the reference target's greedy choice."""

from __future__ import annotations

import pytest


from difftest_engines.ref.replay import replay_request
from difftest_engines.ref.speculate import simulate_greedy

from difftest_engines.ref.tree import simulate_tree


INPUTS = ["target.h.1", "target.h.2", "target.h.3"]
PROMPTS = [[1, 5, 9, 33, 77, 101, 7], [4, 8, 15, 16, 23, 42]]


def _counts(s):
    return s.num_verify, s.num_accepted, s.accepted_per_pos


def test_replaying_the_references_own_output_counts_what_its_chain_decoding_counted(loaded_models):
    target, draft = loaded_models
    for prompt in PROMPTS:
        stats, (output,) = simulate_greedy(target, draft, INPUTS, [prompt], 3, 12)
        r = replay_request(target, draft, INPUTS, prompt, output, 3)
        assert _counts(r.stats) == _counts(stats)
        assert r.target_mismatches == 0 and r.first_mismatch is None


@pytest.mark.parametrize("topk, budget", [(2, 4), (3, 10)])
def test_replaying_the_references_own_output_counts_what_its_tree_decoding_counted(loaded_models, topk, budget):
    target, draft = loaded_models
    stats, (output,) = simulate_tree(target, draft, INPUTS, [PROMPTS[0]], 3, 12, topk=topk, num_draft_tokens=budget)
    r = replay_request(target, draft, INPUTS, PROMPTS[0], output, 3, topk, budget)
    assert _counts(r.stats) == _counts(stats)


def test_a_server_token_the_reference_would_not_pick_is_counted_and_located(loaded_models):
    target, draft = loaded_models
    _, (output,) = simulate_greedy(target, draft, INPUTS, [PROMPTS[1]], 3, 12)
    changed = list(output)
    changed[5] = (changed[5] + 1) % 64
    r = replay_request(target, draft, INPUTS, PROMPTS[1], changed, 3)
    assert r.first_mismatch == 5 and r.target_mismatches >= 1
