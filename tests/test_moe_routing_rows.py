"""Rows after an MoE routing difference, judged apart, on a target of real width (difftest.compare.noise:
router ties, routing_rows; the floor's row count, MIN_FLOOR_ROWS).

The target: DeepSeek-V3 architecture at Kimi-K2's hidden size 7168, reduced depth (a dense layer and
two MoE layers, 16 routed experts top-8 in 4 groups of which 3 are picked, sigmoid scores with a
correction bias), random weights, vocab 512, in bfloat16. The reference's own captures
(difftest_engines.ref.target.run_target: hidden states, routers' scores, margins and chosen experts)
against its float64 twin give the floor; a "correct engine" is the same checkpoint computed with other
kernels (eager attention, the per-expert loop) that resolves its tightest routing decisions the other
way (_other_side_of_ties).
"""

from __future__ import annotations

import copy

import pytest
import torch

from difftest.compare import noise
from difftest.compare.compare import compare_captures
from difftest.records.capture import Capture
from difftest.records.report import PromptComparison, Report
from difftest.records.routing import RoutingLayer
from difftest.report import writer

HIDDEN, LAYERS, EXPERTS, TOPK = 7168, 3, 16, 8
VOCAB, PROMPTS, TOKENS = 512, 2, 12
TIE_GAP = 0.012  # selection-score gap under which the "correct engine" goes the other way (a near-tie)
GOOD = ["target.h.1", "target.h.2", "target.h.3"]
SHIFTED = ["target.h.0", "target.h.1", "target.h.2"]  # a draft fed one layer early: a real miswiring


def _target():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_nextn_predict_layers=0,
        q_lora_rank=256,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        topk_method="noaux_tc",
        n_group=4,
        topk_group=3,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(cfg)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)  # a trained router's bias is far from 0
    return model.to(torch.bfloat16).eval()


def _other_side_of_ties(gate: torch.nn.Module) -> None:
    """A correct engine's rounding resolving the tightest routing decisions the other way: where the
    gap between the last chosen expert and the best unchosen one of a picked group is under TIE_GAP,
    the token goes to the unchosen one (weights recomputed as the router does). Forced, because at
    this width the kernels' own rounding sent 0 of 48 tokens elsewhere (measured)."""
    forward = type(gate).forward

    def run(hidden_states):
        logits, _weights, idx = forward(gate, hidden_states)
        scores = logits.sigmoid()
        choice = scores + gate.e_score_correction_bias
        size = gate.num_experts // gate.num_group
        picked = torch.zeros(choice.shape[0], gate.num_group, dtype=torch.bool)
        picked.scatter_(1, (idx // size), True)
        eligible = picked.repeat_interleave(size, dim=-1)
        chosen = torch.zeros_like(eligible).scatter_(1, idx, True)
        last = choice.masked_fill(~chosen, torch.inf).argmin(-1)
        best = choice.masked_fill(chosen | ~eligible, -torch.inf).argmax(-1)
        rows = torch.arange(choice.shape[0])
        flip = (choice[rows, last] - choice[rows, best]) < TIE_GAP
        idx = torch.where(flip[:, None] & (idx == last[:, None]), best[:, None], idx)
        weights = scores.gather(1, idx)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
        return logits, weights, idx

    gate.forward = run


def _without_bias(gate: torch.nn.Module) -> None:
    """A DeepSeek-V3 engine that drops e_score_correction_bias (a real loading fault): other experts."""
    gate.e_score_correction_bias.zero_()


def _engine(model, change=None):
    other = copy.deepcopy(model)
    other.set_attn_implementation("eager")
    other.set_experts_implementation("eager")
    for layer in other.model.layers[1:]:
        (change or _other_side_of_ties)(layer.mlp.gate)
    return other


def _capture(model, ids: torch.Tensor, wiring: list[str]) -> Capture:
    from difftest_engines.ref.target import run_target

    out = run_target(model, ids)
    t = {f"target.h.{k}": h[0] for k, h in enumerate(out.hidden)}
    t["target.final_norm"], t["target.logits"] = out.final_norm[0], out.logits[0]
    for k, (scores, margin, experts) in out.routers.items():
        t |= {f"aux.router.{k}.scores": scores, f"aux.router.{k}.margin": margin, f"aux.router.{k}.experts": experts}
    t["draft.fc_in"] = torch.cat([t[n] for n in wiring], -1)
    meta = {"wiring": {"inputs": GOOD}, "num_layers": LAYERS, "target_hidden_size": HIDDEN, "draft_tokens": []}
    return Capture(t, meta)


def _without_experts(cap: Capture) -> Capture:
    """The engine's capture as vLLM's and SGLang's adapters give it: no routing recorded."""
    return Capture({n: t for n, t in cap.tensors.items() if not n.startswith("aux.")}, cap.meta.replace())


@pytest.fixture(scope="module")
def runs():
    model = _target()
    exact = copy.deepcopy(model).to(torch.float64)  # the weights rounded to bfloat16, computed in float64
    exact.set_experts_implementation("eager")  # torch._grouped_mm has no float64
    engine, unbiased = _engine(model), _engine(model, _without_bias)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (1, TOKENS), generator=g) for _ in range(PROMPTS)]
    with torch.no_grad():
        out = {
            "ref": [_capture(model, ids, GOOD) for ids in prompts],
            "exact": [_capture(exact, ids, GOOD) for ids in prompts],
            "engine": [_capture(engine, ids, GOOD) for ids in prompts],
            "unbiased": [_capture(unbiased, ids, GOOD) for ids in prompts],
        }
    out["floor"] = noise.measure_floor(list(zip(out["ref"], out["exact"])), "bfloat16", "test")
    return out


def _compare(runs, engine: str, change=lambda c: c):
    return [compare_captures(r, change(e), "bfloat16", floor=runs["floor"]) for r, e in zip(runs["ref"], runs[engine])]


def test_the_wide_target_has_router_near_ties_and_the_engine_routes_some_tokens_elsewhere(runs):
    ties = [int(v.sum()) for r in runs["ref"] for v in noise.router_tie_rows(r, runs["floor"]).values()]
    assert sum(ties) > 0, ties
    layers = [layer for cd in _compare(runs, "engine") for layer in cd.routing]
    assert sum(layer.differs for layer in layers) > 0, [layer.line() for layer in layers]


def test_the_floor_leaves_out_only_rows_the_float64_run_routed_elsewhere_and_stands_on_enough_rows(runs):
    f = runs["floor"].tensors["target.h.3"]
    assert f.total_rows == PROMPTS * TOKENS and f.measured and f.source == ""
    assert noise.MIN_FLOOR_ROWS <= f.rows <= f.total_rows
    flipped = sum(int(noise._routed_apart(r, e, k).sum()) for r, e in zip(runs["ref"], runs["exact"]) for k in (1, 2))
    assert f.total_rows - f.rows <= flipped  # near-ties that routed the same stay in


def test_a_correct_engine_stays_within_noise_with_rows_routed_apart_at_near_ties_counted(runs):
    cds = _compare(runs, "engine")
    assert all(cd.ok for cd in cds), [d.name for cd in cds for d in cd.diffs if not d.ok]
    layers = [layer for cd in cds for layer in cd.routing]
    assert [layer.layer for layer in cds[0].routing] == [1, 2]
    assert all(layer.observed and layer.clear == 0 for layer in layers)
    assert all(layer.apart == layer.differs for layer in layers)  # every row routed elsewhere was a near-tie
    assert all(0 < layer.agreement <= 1 and layer.min_agreement <= layer.agreement for layer in layers)


def test_an_engine_that_records_no_experts_has_every_near_tie_row_judged_apart(runs):
    cds = _compare(runs, "engine", _without_experts)
    assert all(cd.ok for cd in cds)
    layers = [layer for cd in cds for layer in cd.routing]
    assert all(not layer.observed and layer.apart == layer.near_tie and layer.agreement is None for layer in layers)


def test_a_miswired_draft_input_still_fails_at_its_first_chunk(runs):
    miswired = [
        Capture({**e.tensors, "draft.fc_in": torch.cat([e.tensors[n] for n in SHIFTED], -1)}, e.meta.replace())
        for e in runs["engine"]
    ]
    cds = [compare_captures(r, m, "bfloat16", floor=runs["floor"]) for r, m in zip(runs["ref"], miswired)]
    assert all(not cd.ok for cd in cds)
    assert all(cd.first_introduced().name.startswith("draft.fc_in") for cd in cds)
    assert all(cd.get(n).ok for cd in cds for n in GOOD)  # the target itself stays within noise


def test_experts_chosen_otherwise_where_the_reference_margin_is_clear_diverge(runs):
    cds = _compare(runs, "unbiased")
    layers = [layer for cd in cds for layer in cd.routing]
    assert sum(layer.clear for layer in layers) > 0, [layer.line() for layer in layers]
    failing = [cd for cd in cds if not cd.ok]
    assert failing
    first = failing[0].first_introduced()
    assert first is not None and first.name in ("target.h.2", "target.h.3") and "routing:" in first.detail


def test_a_floor_on_too_few_rows_says_so_and_its_threshold_falls_back(runs):
    floor = noise.measure_floor([(runs["ref"][0], runs["exact"][0])], "bfloat16", "test")
    f = floor.tensors["target.h.3"]
    assert not f.measured and f.rows == TOKENS < noise.MIN_FLOOR_ROWS
    assert f.source.startswith(f"measured on {TOKENS} rows (too few;")
    assert f.threshold >= noise.unmeasured_threshold("bfloat16")
    assert "too few rows" in floor.source


def _report(runs) -> Report:
    cds = _compare(runs, "engine")
    return Report(
        case="wide_moe",
        case_file="wide_moe.yaml",
        created="now",
        reference="ref",
        accept_length_definition="",
        engines={},
        checks=[],
        noise_floor=runs["floor"].record(),
        comparisons={
            "eng": [
                PromptComparison(i, None, None, None, None, "", cd.diffs, routing=cd.routing)
                for i, cd in enumerate(cds)
            ]
        },
    )


def test_the_report_keeps_the_routing_per_moe_layer_and_the_floors_row_counts_through_json(runs):
    report = _report(runs)
    back = Report.from_dict(report.to_dict(), "r.json")
    assert back.comparisons["eng"][0].routing == report.comparisons["eng"][0].routing
    assert isinstance(back.comparisons["eng"][0].routing[0], RoutingLayer)
    assert back.noise_floor.tensors["target.h.3"].total_rows == PROMPTS * TOKENS


def test_the_markdown_shows_the_agreement_per_moe_layer_and_the_floors_row_count(runs):
    md = "\n".join(writer.markdown_noise(_report(runs)))
    assert "| prompt | MoE layer | rows | expert-set agreement |" in md
    assert "floor rows: fewest" in md
    layer = _report(runs).comparisons["eng"][0].routing[0]
    assert f"| 0 | {layer.layer} | {TOKENS} | {layer.agreement:.3f} |" in md


class _Floor:
    """A floor whose router noise puts a near-tie at margins up to 1.0 (observed or not)."""

    def router_tie_threshold(self, layer: int, observed: bool = False) -> float:
        return 1.0


def _routed(margins: list[list[float]], experts: list[list[list[int]]]) -> Capture:
    tensors = {}
    for k, (m, e) in enumerate(zip(margins, experts)):
        tensors[f"{noise.ROUTER_PREFIX}{k}.margin"] = torch.tensor(m, dtype=torch.float64)
        tensors[f"{noise.ROUTER_PREFIX}{k}{noise.ROUTER_EXPERTS}"] = torch.tensor(e)
    return Capture(tensors=tensors)


def test_a_row_routed_apart_at_a_near_tie_stays_apart_at_later_layers_even_where_their_margin_is_clear():
    # row 1: a near-tie at layer 0 (margin 0.5) routed elsewhere; at layer 1 its margin is clear (9.0)
    # and it goes elsewhere again: the same event carried on
    ref = _routed([[9.0, 0.5, 9.0], [9.0, 9.0, 9.0]], [[[0, 1], [0, 1], [0, 1]], [[2, 3], [2, 3], [2, 3]]])
    other = _routed([[9.0, 0.5, 9.0], [9.0, 9.0, 9.0]], [[[0, 1], [0, 2], [0, 1]], [[2, 3], [2, 4], [2, 3]]])
    rows = noise.routing_rows(ref, other, _Floor())
    assert rows.apart[0].tolist() == [False, True, False]
    assert rows.apart[1].tolist() == [False, True, False]
    assert not rows.clear[1].any()


def test_an_event_reaches_later_positions_at_later_layers_through_attention_and_no_earlier_one():
    # a near-tie sends row 1 apart at layer 0; at layer 1 rows 0 and 2 go elsewhere at a clear margin:
    # row 2 attends to row 1 (carried, apart), row 0 cannot (a clear-margin flip: diverges)
    ref = _routed([[9.0, 0.5, 9.0], [9.0, 9.0, 9.0]], [[[0, 1], [0, 1], [0, 1]], [[2, 3], [2, 3], [2, 3]]])
    other = _routed([[9.0, 0.5, 9.0], [9.0, 9.0, 9.0]], [[[0, 1], [0, 2], [0, 1]], [[2, 4], [2, 3], [2, 4]]])
    rows = noise.routing_rows(ref, other, _Floor())
    assert rows.apart[1].tolist() == [False, False, True]
    assert rows.clear[1].tolist() == [True, False, False]


def test_a_clear_margin_flip_at_the_layer_of_the_near_tie_itself_still_diverges():
    # the experts of a layer act on their own row: row 1's near-tie at layer 0 does not reach row 2 there
    ref = _routed([[9.0, 0.5, 9.0]], [[[0, 1], [0, 1], [0, 1]]])
    other = _routed([[9.0, 0.5, 9.0]], [[[0, 1], [0, 2], [0, 2]]])
    rows = noise.routing_rows(ref, other, _Floor())
    assert rows.apart[0].tolist() == [False, True, False]
    assert rows.clear[0].tolist() == [False, False, True]
