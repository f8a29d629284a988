"""difftest_engines/ref/speculate.py: fc gathering, the draft chain, greedy speculative decoding.

Unit tests use a small seeded random draft; the end-to-end ones use the built-in fixtures
(built once into the cache by ensure_fixtures).
"""

from __future__ import annotations

import pytest
import torch

from difftest.base.errors import ConfigError
from difftest_engines.ref.eagle3 import Eagle3Config, Eagle3Draft
from difftest_engines.ref.speculate import gather_fc_in, greedy_decode, run_draft_chain, simulate_greedy
from difftest_engines.ref.target import TargetOutput

H, N_AUX, VOCAB, DRAFT_VOCAB = 32, 3, 50, 20
STEP0_NAMES = {
    "fc_out",
    "embeds",
    "layer0.attn_in",
    "layer0.attn_out",
    "layer0.mlp_out",
    "hidden_prenorm",
    "logits",
    "logits_target",
}


@pytest.fixture(scope="module")
def small_draft() -> Eagle3Draft:
    cfg = Eagle3Config(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=H,
        num_aux=N_AUX,
    )
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
        draft.d2t.copy_(torch.arange(DRAFT_VOCAB) + 5)  # draft id d -> target id 2d + 5
    return draft.eval()


def _inputs(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, N_AUX * H, generator=g), torch.randint(0, VOCAB, (1, n), generator=g)


# -- gather_fc_in ----------------------------------------------------------------------------


def _target_output() -> TargetOutput:
    hidden = [torch.full((2, 3, 4), float(k)) for k in range(5)]
    return TargetOutput(hidden=hidden, final_norm=torch.full((2, 3, 4), -1.0), logits=torch.zeros(2, 3, 7))


def test_gather_fc_in_concatenates_named_tensors_in_wiring_order():
    fc_in = gather_fc_in(_target_output(), ["target.h.3", "target.h.0", "target.final_norm"])
    assert fc_in.shape == (2, 3, 12)
    assert fc_in[0, 0].tolist() == [3.0] * 4 + [0.0] * 4 + [-1.0] * 4


def test_gather_fc_in_rejects_a_layer_the_target_does_not_have():
    with pytest.raises(ConfigError, match=r"target\.h\.5 does not exist; the target has h0\.\.h4"):
        gather_fc_in(_target_output(), ["target.h.5"])


def test_gather_fc_in_rejects_a_name_that_is_not_a_target_tensor():
    with pytest.raises(ConfigError, match=r"'draft\.fc_out' is not a target tensor"):
        gather_fc_in(_target_output(), ["draft.fc_out"])


# -- run_draft_chain ---------------------------------------------------------------------------


def test_run_draft_chain_records_all_positions_at_step_0_and_one_position_after(small_draft):
    fc_in, next_ids = _inputs(6)
    seen: dict[tuple[int, str], torch.Tensor] = {}
    drafted = run_draft_chain(small_draft, fc_in, next_ids, 3, lambda s, name, t: seen.__setitem__((s, name), t))
    assert len(drafted) == 3
    assert {name for s, name in seen if s == 0} == STEP0_NAMES
    assert {name for s, name in seen if s == 2} == STEP0_NAMES - {"fc_out"}
    assert seen[(0, "logits")].shape == (1, 6, DRAFT_VOCAB)
    assert seen[(0, "logits_target")].shape == (1, 6, VOCAB)
    assert seen[(1, "logits")].shape == (1, 1, DRAFT_VOCAB)
    assert seen[(2, "layer0.attn_in")].shape == (1, 1, 2 * H)


def test_run_draft_chain_drafts_the_argmax_of_each_step_mapped_to_target_ids(small_draft):
    fc_in, next_ids = _inputs(6)
    seen: dict[tuple[int, str], torch.Tensor] = {}
    drafted = run_draft_chain(small_draft, fc_in, next_ids, 3, lambda s, name, t: seen.__setitem__((s, name), t))
    for step, token in enumerate(drafted):
        assert token == 2 * int(seen[(step, "logits")][0, -1].argmax()) + 5
        assert token == int(seen[(step, "logits_target")][0, -1].argmax())


def test_run_draft_chain_feeds_the_drafted_token_and_previous_hidden_to_the_next_step(small_draft):
    fc_in, next_ids = _inputs(6)
    seen: dict[tuple[int, str], torch.Tensor] = {}
    drafted = run_draft_chain(small_draft, fc_in, next_ids, 2, lambda s, name, t: seen.__setitem__((s, name), t))
    assert torch.equal(seen[(1, "embeds")][0, 0], small_draft.embed_tokens.weight[drafted[0]])
    hidden_half = seen[(1, "layer0.attn_in")][0, 0, H:]  # hidden_norm(previous hidden_prenorm at the last position)
    expected = small_draft.layer.hidden_norm(seen[(0, "hidden_prenorm")][0, -1])
    torch.testing.assert_close(hidden_half, expected, rtol=0, atol=0)


def test_kv_cached_chain_step_equals_an_uncached_forward_over_all_positions(small_draft):
    fc_in, next_ids = _inputs(6)
    seen: dict[tuple[int, str], torch.Tensor] = {}
    drafted = run_draft_chain(small_draft, fc_in, next_ids, 2, lambda s, name, t: seen.__setitem__((s, name), t))
    with torch.no_grad():
        hidden = torch.cat([small_draft.combine(fc_in), seen[(0, "hidden_prenorm")][:, -1:]], dim=1)
        ids = torch.cat([next_ids, torch.tensor([[drafted[0]]])], dim=1)
        full = small_draft(ids, hidden, torch.arange(7)[None, :])
    torch.testing.assert_close(seen[(1, "logits")][0, 0], full.logits[0, -1], rtol=1e-5, atol=1e-5)


def test_run_draft_chain_rejects_next_ids_of_another_length(small_draft):
    fc_in, next_ids = _inputs(6)
    with pytest.raises(ValueError, match=r"next_ids must be \[1, 6\] to match fc_in, got \(1, 5\)"):
        run_draft_chain(small_draft, fc_in, next_ids[:, :5], 2)


def test_training_unroll_attends_exactly_like_the_inference_chain(small_draft):
    """TTT step k at origin i must equal chain step k after committing positions 0..i (train.py's mask)."""
    from difftest_engines.ref.train import ttt_forward

    n, origin, steps = 8, 4, 3
    fc_in, tokens = _inputs(n, seed=2)
    seen: dict[tuple[int, str], torch.Tensor] = {}
    record = lambda s, name, t: seen.__setitem__((s, name), t)  # noqa: E731
    drafted = run_draft_chain(small_draft, fc_in[:, : origin + 1], tokens[:, 1 : origin + 2], steps, record)
    # The training sequence continues with the drafted tokens, so TTT feeds the same tokens as the chain.
    tokens = tokens.clone()
    tokens[0, origin + 2 : origin + 1 + steps] = torch.tensor(drafted[: steps - 1])
    with torch.no_grad():
        unrolled = ttt_forward(small_draft, fc_in, tokens, steps)
    for k in range(steps):
        torch.testing.assert_close(unrolled[k][0, origin], seen[(k, "logits")][0, -1], rtol=1e-5, atol=1e-5)


def test_ttt_mask_lets_step_k_see_causal_step_0_keys_and_its_own_chain():
    from difftest_engines.ref.train import ttt_mask

    mask = ttt_mask(3, 2)
    assert mask.int().tolist() == [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]


# -- simulate_greedy (on the built-in fixtures) --------------------------------------------------


@pytest.fixture(scope="session")
def fixture_models():
    from difftest_fixtures.drafts import heldout_prompts
    from difftest_engines.ref.draft_loading import load_draft
    from difftest_fixtures.tiny_llama import ensure_fixtures
    from difftest_engines.ref.target import load_target

    paths = ensure_fixtures()
    target = load_target(paths["tiny-llama"])
    return {
        "target": target,
        "draft": load_draft(paths["tiny-llama-eagle3"]).model,
        "miswired": load_draft(paths["tiny-llama-eagle3-miswired"]).model,
        "prompts": heldout_prompts(target),
    }


GOOD = ["target.h.2", "target.h.4", "target.h.5"]
MISWIRED_SERVED = ["target.h.2", "target.h.4", "target.h.7"]


def test_simulate_greedy_output_equals_plain_greedy_decoding(fixture_models):
    m = fixture_models
    prompts = m["prompts"][:4]
    stats, outputs = simulate_greedy(m["target"], m["draft"], GOOD, prompts, 4, 20)
    assert outputs == [greedy_decode(m["target"], p, 20) for p in prompts]
    assert stats.accept_length > 2.0


def test_simulate_greedy_is_lossless_even_with_a_miswired_draft(fixture_models):
    m = fixture_models
    prompts = m["prompts"][:2]
    stats, outputs = simulate_greedy(m["target"], m["miswired"], MISWIRED_SERVED, prompts, 4, 12)
    assert outputs == [greedy_decode(m["target"], p, 12) for p in prompts]
    assert stats.accept_length < 1.3


def test_simulate_greedy_counts_every_verify_in_full(fixture_models):
    """Tokens emitted = 1 (prefill) + accepted + one target token per verify; the last verify may overshoot."""
    m = fixture_models
    for prompt in m["prompts"][:3]:
        stats, outputs = simulate_greedy(m["target"], m["draft"], GOOD, [prompt], 4, 17)
        emitted = 1 + stats.num_accepted + stats.num_verify
        assert len(outputs[0]) == 17
        assert 17 <= emitted < 17 + 4 + 1
        assert stats.num_accepted == sum(stats.accepted_per_pos)
        assert stats.accepted_per_pos == sorted(stats.accepted_per_pos, reverse=True)
        assert (stats.num_draft_steps, stats.num_prompts, stats.source) == (4, 1, "ref simulation")


def test_simulate_greedy_with_one_new_token_only_prefills(fixture_models):
    m = fixture_models
    prompt = m["prompts"][0]
    stats, outputs = simulate_greedy(m["target"], m["draft"], GOOD, [prompt], 4, 1)
    assert outputs == [greedy_decode(m["target"], prompt, 1)]
    assert (stats.num_verify, stats.num_accepted, stats.accepted_per_pos) == (0, 0, [0, 0, 0, 0])
