"""Accept length beyond chains: the reference tree simulation and the normalisation table."""

from __future__ import annotations

import pytest

from difftest.records.acceptance import NORMALISATION, normalise

from difftest_engines.ref.speculate import greedy_decode, simulate_greedy

from difftest_engines.ref.tree import simulate_tree


INPUTS = ["target.h.1", "target.h.2", "target.h.3"]
PROMPTS = [[1, 5, 9, 33, 77, 101, 7], [4, 8, 15, 16, 23, 42]]


def test_a_topk_1_tree_is_the_chain(loaded_models):
    target, draft = loaded_models
    chain, chain_out = simulate_greedy(target, draft, INPUTS, PROMPTS, 3, 10)
    tree, tree_out = simulate_tree(target, draft, INPUTS, PROMPTS, 3, 10, topk=1, num_draft_tokens=4)
    assert tree_out == chain_out
    assert (tree.num_verify, tree.num_accepted, tree.accepted_per_pos) == (
        chain.num_verify,
        chain.num_accepted,
        chain.accepted_per_pos,
    )


@pytest.mark.parametrize("topk, budget", [(2, 4), (3, 10)], ids=["topk2-budget4", "topk3-budget10"])
def test_tree_decoding_is_lossless_and_its_counts_are_consistent(loaded_models, topk, budget):
    target, draft = loaded_models
    stats, outputs = simulate_tree(target, draft, INPUTS, PROMPTS, 3, 10, topk=topk, num_draft_tokens=budget)
    assert outputs == [greedy_decode(target, p, 10) for p in PROMPTS]
    assert sum(stats.accepted_per_pos) == stats.num_accepted
    rates = stats.acceptance_rate_per_pos
    assert len(rates) == 3 and all(a >= b for a, b in zip(rates, rates[1:]))  # a deeper position needs its parent
    assert 1.0 <= stats.accept_length <= 4.0


@pytest.mark.parametrize(
    "definition, value, counts, expected",
    [
        ("difftest", 2.5, {}, 2.5),
        ("vllm.mean_acceptance_length", 2.5, {}, 2.5),
        ("vllm.num_accepted_tokens_per_draft", 1.5, {}, 2.5),
        ("sglang.spec_accept_length", None, {"completion_tokens": 110, "requests": 10, "verify_ct": 40}, 2.5),
        ("sglang.spec_num_correct_drafts", 60, {"verify_ct": 40}, 2.5),
        ("acceptance_rate", 0.5, {"num_draft_tokens": 4}, 2.5),
        ("speculators.full_acc", None, {"steps": [0.8, 0.5, 0.2]}, 2.5),
        ("speculators.cond_acc", None, {"steps": [0.8, 0.625, 0.4]}, 2.5),
        ("specforge.acc", None, {"steps": [0.8, 0.625, 0.4]}, 2.5),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_every_definition_normalises_to_the_harness_one(definition, value, counts, expected):
    assert normalise(definition, value, **counts) == pytest.approx(expected)
    assert definition in [d for d, _, _ in NORMALISATION]


def test_normalise_says_what_it_needs():
    with pytest.raises(ValueError, match="sglang.spec_accept_length: needs requests, verify_ct"):
        normalise("sglang.spec_accept_length", completion_tokens=10)
    with pytest.raises(ValueError, match="unknown accept-length definition 'x'"):
        normalise("x", 1.0)
