"""Wiring diagnosis on real captures: the reference engine, miswired on purpose, on a tiny target.

Each failure class of shared/notes/wiring-failures.md that the reference engine can express
gets a variant (`ref[wiring=...]`, `ref[norm_before_residual=...]`, `ref[d2t=identity]`) and
the exact diagnosis text is asserted, in float32 and bfloat16; a correctly wired engine
raises no alarm. Captures run in-process (no worker) to keep this fast. Classes the
reference engine cannot express as a capture (a chunk count mismatch, a norm applied before
fc) use synthetic captures; the config-side classes are in test_lint.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from difftest.records.capture import Capture
from difftest.case.case import load_case
from difftest.compare.compare import compare_captures
from difftest.compare.diagnose import diagnose_draft, diagnose_fc, diagnose_hidden, match_chunks
from difftest.compare.noise import SAFETY, NoiseFloor
from difftest.records.chunk_match import MATCH_REL_DIFF
from difftest.records.noise_floor import TensorFloor
from difftest.run.engine import parse_spec
from difftest_engines.ref.engine import RefEngine

IDS = [1, 5, 9, 33, 77, 101, 7, 250, 3]
L = 8  # target depth: defaults h[2], h[L//2], h[L-3] = [h2, h4, h5]; the draft's config ids are [1, 2, 3]
FALLBACK = "default-layer fallback (engine fed h[2], h[L//2], h[L-3] of L=8: it did not use the config's layer ids)"


TINY_PAIR_LAYERS = L  # the conftest `models` fixture builds the tiny pair this deep


@pytest.fixture(scope="module")
def cases_workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cases")


def _case(models, tmp: Path, dtype: str, wiring: str = "vllm"):
    target, draft = models
    (tmp / "cases").mkdir(exist_ok=True)
    path = tmp / "cases" / f"diag_{dtype}_{abs(hash(wiring))}.yaml"
    path.write_text(
        f"target: {target}\ndraft: {draft}\ndtype: {dtype}\nwiring: {wiring}\nprompts: [{{ids: {IDS}}}]\n"
        "speculative: {num_steps: 3, max_new_tokens: 8}\n"
    )
    return load_case(path)


_MEMO: dict = {}


def _capture(models, tmp, dtype: str, engine: str, trained: str) -> Capture:
    key = (dtype, engine, trained)
    if key not in _MEMO:
        _MEMO[key] = RefEngine(parse_spec(engine)).capture(_case(models, tmp, dtype, trained), IDS)
    return _MEMO[key]


def _captures(models, tmp, dtype: str, engine: str, trained: str = "vllm") -> tuple[Capture, Capture]:
    return _capture(models, tmp, dtype, "ref", trained), _capture(models, tmp, dtype, engine, trained)


dtypes = pytest.mark.parametrize("dtype", ["float32", "bfloat16"])

FC_CLASSES = [
    # (failure class, what training used, engine spec, the diagnosis's last line)
    (
        "1-off-by-one+1",
        "vllm",
        "ref[wiring=sglang]",
        "engine fed fc [h2, h3, h4]; reference fed [h1, h2, h3]; pattern: off-by-one +1",
    ),
    (
        "1-off-by-one-1",
        "[h2, h3, h6]",
        "ref[wiring=h1+h2+h5]",
        "engine fed fc [h1, h2, h5]; reference fed [h2, h3, h6]; pattern: off-by-one -1",
    ),
    (
        "2-embedding-dropped",
        "[h0, h2, h4]",
        "ref[wiring=h2+h4+h8]",
        "engine fed fc [h2, h4, h8]; reference fed [h0, h2, h4]; pattern: embedding dropped and slots shifted by one "
        "(engine's chunk j = reference's chunk j+1)",
    ),
    (
        "2-embedding-extra",
        "vllm",
        "ref[wiring=h0+h2+h3]",
        "engine fed fc [h0, h2, h3]; reference fed [h1, h2, h3]; pattern: embedding fed but not trained on",
    ),
    (
        "3-permuted",
        "vllm",
        "ref[wiring=h3+h1+h2]",
        "engine fed fc [h3, h1, h2]; reference fed [h1, h2, h3]; pattern: permuted order",
    ),
    (
        "5-sorted-ids",
        "[h3, h1, h2]",
        "ref[wiring=vllm,layer_ids=3+1+2]",
        "engine fed fc [h1, h2, h3]; reference fed [h3, h1, h2]; pattern: permuted order (engine sorted the ids)",
    ),
    (
        "4-post-norm",
        "[h1, h2, h8]",
        "ref[wiring=h1+h2+final_norm]",
        "engine fed fc [h1, h2, final_norm]; reference fed [h1, h2, h8]; pattern: final layer taken post-norm",
    ),
    (
        "4-pre-norm",
        "[h1, h2, final_norm]",
        "ref[wiring=h1+h2+h8]",
        "engine fed fc [h1, h2, h8]; reference fed [h1, h2, final_norm]; pattern: final layer taken pre-norm",
    ),
    (
        "5-default-fallback",
        "vllm",
        "ref[wiring=eagle]",
        f"engine fed fc [h2, h4, h5]; reference fed [h1, h2, h3]; pattern: {FALLBACK}",
    ),
]


@dtypes
@pytest.mark.parametrize("trained, engine, last_line", [c[1:] for c in FC_CLASSES], ids=[c[0] for c in FC_CLASSES])
def test_fc_miswiring_is_named(models, cases_workdir, dtype, trained, engine, last_line):
    ref, cap = _captures(models, cases_workdir, dtype, engine, trained)
    first = compare_captures(ref, cap, dtype).first_divergence()
    assert first is not None and first.name.startswith("draft.fc_in.")
    assert diagnose_fc(ref, cap)[-1] == last_line


@dtypes
def test_off_by_one_names_each_chunk(models, cases_workdir, dtype):
    ref, cap = _captures(models, cases_workdir, dtype, "ref[wiring=sglang]")
    lines = diagnose_fc(ref, cap)
    assert lines[0] == "engine's fc chunk 0 matches reference target.h.2 (cos 1.0000); expected target.h.1"
    assert len(lines) == 4


@dtypes
def test_post_norm_chunk_names_the_norm_gap(models, cases_workdir, dtype):
    ref, cap = _captures(models, cases_workdir, dtype, "ref[wiring=h1+h2+final_norm]", "[h1, h2, h8]")
    line = diagnose_fc(ref, cap)[0]
    assert line.startswith(
        "engine's fc chunk 2 matches reference target.final_norm (last layer, post-norm) (cos 1.0000); "
        "expected target.h.8 (last layer, pre-norm); per-token RMS "
    )


@dtypes
@pytest.mark.parametrize("engine", ["ref[wiring=vllm]", "ref[wiring=h1+h2+h3]"], ids=["preset", "explicit"])
def test_correct_wiring_raises_no_alarm(models, cases_workdir, dtype, engine):
    ref, cap = _captures(models, cases_workdir, dtype, engine)
    diff = compare_captures(ref, cap, dtype)
    assert diff.ok and diff.first_divergence() is None
    assert diagnose_fc(ref, cap) == []
    assert all(m.correct for m in match_chunks(ref, cap)[0])


DRAFT_CLASSES = [
    (
        "7-norm-before-residual",
        "ref[norm_before_residual=true]",
        "draft.layer0.mlp_out",
        "suspect: the residual or MLP differs after matching attention: norm_before_residual handled differently?",
    ),
    (
        "7-norm-output",
        "ref[norm_output=true]",
        "draft.step1.layer0.mlp_out",
        "draft step 0 matches but step 1 diverges (draft.step1.layer0.mlp_out): what feeds the next step differs "
        "(norm_output, the drafted token, or the draft KV cache / positions)",
    ),
    (
        "8-d2t-missing",
        "ref[d2t=identity]",
        "draft.logits_target",
        "suspect: draft.logits match but the target-vocab logits do not: the draft-to-target vocab map (d2t) differs",
    ),
]


@dtypes
@pytest.mark.parametrize("engine, first, line", [c[1:] for c in DRAFT_CLASSES], ids=[c[0] for c in DRAFT_CLASSES])
def test_draft_side_divergence_names_the_suspect(models, cases_workdir, dtype, engine, first, line):
    ref, cap = _captures(models, cases_workdir, dtype, engine)
    diff = compare_captures(ref, cap, dtype)
    assert diff.first_divergence().name == first
    assert diagnose_fc(ref, cap) == []  # the fc inputs are right: no wiring alarm
    assert diagnose_draft(first) == [line]


def test_wrong_vocab_map_shows_in_the_distribution_metrics(models, cases_workdir):
    ref, cap = _captures(models, cases_workdir, "float32", "ref[d2t=identity]")
    d = compare_captures(ref, cap, "float32").get("draft.logits_target")
    assert d.rows == len(IDS) and d.rows_mismatched == len(IDS)
    assert d.top1_agree == 0 and d.topk_member == 0 and d.kl_mean == float("inf")
    assert compare_captures(ref, cap, "float32").get("draft.logits").ok


def test_golden_input_rerun_reproduces_the_reference_draft(models, cases_workdir):
    """Layerwise golden inputs: a miswired engine's draft on the reference's fc_in is the reference's draft."""
    case = _case(models, cases_workdir, "float32")
    ref = RefEngine(parse_spec("ref")).capture(case, IDS)
    golden = RefEngine(parse_spec("ref[wiring=sglang]")).capture_draft_from(case, IDS, ref.tensors["draft.fc_in"])
    diff = compare_captures(ref, golden, "float32", allow_missing=["target.*"])
    assert diff.ok, diff.first_divergence().summary()
    flipped = RefEngine(parse_spec("ref[norm_before_residual=true]")).capture_draft_from(
        case, IDS, ref.tensors["draft.fc_in"]
    )
    assert (
        compare_captures(ref, flipped, "float32", allow_missing=["target.*"]).first_divergence().name
        == "draft.layer0.mlp_out"
    )


# --- synthetic captures: what the reference engine cannot produce -------------------------

TH, N = 16, 6


def _synthetic(fc_parts: list[torch.Tensor], states: dict, inputs: list[str]) -> Capture:
    meta = {"target_hidden_size": TH, "num_layers": 4, "wiring": {"inputs": inputs}}
    return Capture({**states, "draft.fc_in": torch.cat(fc_parts, -1)}, meta)


@pytest.fixture(scope="module")
def states():
    g = torch.Generator().manual_seed(3)
    return {f"target.h.{k}": torch.randn(N, TH, generator=g) * (1 + 10 * k) for k in range(5)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_norm_applied_before_fc_is_named(states, dtype):
    states = {k: v.to(dtype) for k, v in states.items()}
    inputs = ["target.h.1", "target.h.2", "target.h.3"]
    ref = _synthetic([states[n] for n in inputs], states, inputs)
    h2 = states["target.h.2"].float()
    normed = (h2 * torch.rsqrt(h2.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    other = _synthetic([states["target.h.1"], normed, states["target.h.3"]], states, inputs)
    lines = diagnose_fc(ref, other)
    assert lines[0].startswith(
        "engine's fc chunk 1 matches reference rmsnorm of target.h.2 (cos 1.0000); expected target.h.2"
    )
    assert lines[-1] == (
        "engine fed fc [h1, rmsnorm(h2), h3]; reference fed [h1, h2, h3]; pattern: norm applied before fc "
        "(engine's chunk = rmsnorm(reference tensor))"
    )


def test_chunk_count_mismatch_still_says_what_was_fed(states):
    inputs = ["target.h.0", "target.h.2", "target.h.3"]
    ref = _synthetic([states[n] for n in inputs], states, inputs)
    other = _synthetic([states[n] for n in inputs + ["target.h.4"]], states, inputs)
    assert diagnose_fc(ref, other) == [
        "engine fed fc [h0, h2, h3, h4]; reference fed [h0, h2, h3]",
        "chunk count mismatch: engine fc_in has 4 chunks of 16, reference 3",
    ]


def test_a_diverging_target_state_names_the_layer_shift(states):
    ref = Capture(dict(states), {"num_layers": 4})
    other = Capture({**states, "target.h.2": states["target.h.3"]}, {})
    assert diagnose_hidden(ref, other, "target.h.2") == [
        "engine's target.h.2 matches reference target.h.3 (cos 1.0000): the engine's layer numbering is shifted by +1"
    ]


def test_similarity_matrix_covers_every_chunk_and_candidate(states):
    inputs = ["target.h.1", "target.h.2", "target.h.3"]
    ref = _synthetic([states[n] for n in inputs], states, inputs)
    matches, sim = match_chunks(
        ref, _synthetic([states[n] for n in ["target.h.2", "target.h.3", "target.h.4"]], states, inputs)
    )
    assert sim.chunks == ["chunk 0", "chunk 1", "chunk 2"]
    assert sim.candidates == [f"target.h.{k}" for k in range(5)]
    assert sim.cosine[0][2] == pytest.approx(1.0, abs=1e-6)
    assert [m.best for m in matches] == ["target.h.2", "target.h.3", "target.h.4"]


def _rerouted(x: torch.Tensor, row: int) -> torch.Tensor:
    """`x` with one token's row moved by half its norm: an MoE router sent that token elsewhere."""
    x = x.clone()
    x[row] = x[row] + 0.5 * x[row].norm() / TH**0.5 * torch.ones(TH)
    return x


def test_a_chunk_with_one_rerouted_token_still_names_the_layer_fed(states):
    # one token of six moved: its mean rel_diff over the prompt is far above MATCH_REL_DIFF
    inputs = ["target.h.1", "target.h.2", "target.h.3"]
    ref = _synthetic([states[n] for n in inputs], states, inputs)
    fed = ["target.h.2", "target.h.3", "target.h.4"]
    other = _synthetic([_rerouted(states[n], row=4) for n in fed], states, inputs)
    assert (
        diagnose_fc(ref, other)[-1] == "engine fed fc [h2, h3, h4]; reference fed [h1, h2, h3]; pattern: off-by-one +1"
    )


def test_a_chunk_fed_another_tensor_on_every_token_matches_no_layer(states):
    inputs = ["target.h.1", "target.h.2", "target.h.3"]
    ref = _synthetic([states[n] for n in inputs], states, inputs)
    every = states["target.h.2"] + 0.5 * states["target.h.2"].norm(dim=-1, keepdim=True) / TH**0.5
    matches, _ = match_chunks(ref, _synthetic([states["target.h.1"], every, states["target.h.3"]], states, inputs))
    assert not matches[1].matched and matches[0].correct and matches[2].correct


# --- at depth: the match bound from the measured floor (a bf16 Llama-3.1-8B shape, stop 53) ----------
# There the reference's own row error against float64 was 0.05 at h.29 and a correct chunk sat at a
# median rel_diff of 1.2e-3 (over the fixed 1e-3), while adjacent layers were 0.20-0.27 apart per row.
DEEP_L, DEEP_STEP, DEEP_NOISE = 8, 0.22, 0.05


def _orthogonal(x: torch.Tensor, rel: float, g: torch.Generator) -> torch.Tensor:
    """A move of each row of `x` by `rel` of its norm, orthogonal to it (a rounding error, or a layer's update)."""
    d = torch.randn(x.shape, generator=g)
    d = d - (d * x).sum(-1, keepdim=True) / (x * x).sum(-1, keepdim=True) * x
    return d * (rel * x.norm(dim=-1, keepdim=True) / d.norm(dim=-1, keepdim=True))


@pytest.fixture(scope="module")
def deep_states():
    """A residual stream whose adjacent layers differ by DEEP_STEP per row."""
    g = torch.Generator().manual_seed(7)
    h = [torch.randn(N, TH, generator=g) * 40]
    for _ in range(DEEP_L):
        h.append(h[-1] + _orthogonal(h[-1], DEEP_STEP, g))
    return {f"target.h.{k}": v for k, v in enumerate(h)}


def _deep_pair(states: dict, fed: list[str], inputs: list[str]) -> tuple[Capture, Capture]:
    """The reference fed `inputs`; the engine fed `fed`, each with its own rounding of DEEP_NOISE per row."""
    g = torch.Generator().manual_seed(11)
    meta = {"target_hidden_size": TH, "num_layers": DEEP_L, "wiring": {"inputs": inputs}}
    ref = Capture({**states, "draft.fc_in": torch.cat([states[n] for n in inputs], -1)}, meta)
    chunks = [states[n] + _orthogonal(states[n], DEEP_NOISE, g) for n in fed]
    return ref, Capture({**states, "draft.fc_in": torch.cat(chunks, -1)}, meta)


def _floor(value: float) -> NoiseFloor:
    names = [f"target.h.{k}" for k in range(DEEP_L + 1)]
    tensors = {n: TensorFloor(n, value, 1.2 * value, 40, SAFETY * value) for n in names}
    return NoiseFloor("bfloat16", True, "measured (test)", tensors)


DEEP_INPUTS = ["target.h.2", "target.h.4", "target.h.6"]


def test_a_correct_chunk_above_the_fixed_bound_but_within_its_measured_floor_matches(deep_states):
    ref, cap = _deep_pair(deep_states, DEEP_INPUTS, DEEP_INPUTS)
    matches, _ = match_chunks(ref, cap, _floor(DEEP_NOISE))
    assert all(m.rel_diff > MATCH_REL_DIFF for m in matches)
    assert all(m.correct and m.bound > MATCH_REL_DIFF for m in matches)


def test_an_off_by_one_feed_at_depth_is_named_off_by_one(deep_states):
    ref, cap = _deep_pair(deep_states, ["target.h.3", "target.h.5", "target.h.7"], DEEP_INPUTS)
    assert diagnose_fc(ref, cap, floor=_floor(DEEP_NOISE))[-1] == (
        "engine fed fc [h3, h5, h7]; reference fed [h2, h4, h6]; pattern: off-by-one +1"
    )


def test_a_floor_as_large_as_the_layers_separation_names_no_layer(deep_states):
    ref, cap = _deep_pair(deep_states, ["target.h.3", "target.h.5", "target.h.7"], DEEP_INPUTS)
    matches, _ = match_chunks(ref, cap, _floor(DEEP_STEP))
    assert not any(m.matched for m in matches) and all(m.ambiguous for m in matches)
    last = diagnose_fc(ref, cap, floor=_floor(DEEP_STEP))[-1]
    assert last.startswith("engine fed fc [h3 or h")
    assert "pattern: not named (chunk 0 is h3 or h" in last and "off-by-one" not in last


def test_tiny_floors_keep_the_fixed_bound_and_the_same_matches(states):
    inputs = ["target.h.1", "target.h.2", "target.h.3"]
    ref = _synthetic([states[n] for n in inputs], states, inputs)
    other = _synthetic([states[n] for n in ["target.h.2", "target.h.3", "target.h.4"]], states, inputs)
    tiny = NoiseFloor("float32", True, "measured (test)", {n: TensorFloor(n, 1e-5, 2e-5, 40, 1e-4) for n in states})
    with_floor, without = match_chunks(ref, other, tiny)[0], match_chunks(ref, other)[0]
    assert [m.bound for m in with_floor] == [MATCH_REL_DIFF] * 3
    assert with_floor == without
    assert diagnose_fc(ref, other, floor=tiny) == diagnose_fc(ref, other)


def test_a_norm_applied_before_fc_at_depth_is_named_within_the_floors_bound(deep_states):
    ref, cap = _deep_pair(deep_states, DEEP_INPUTS, DEEP_INPUTS)
    g = torch.Generator().manual_seed(13)
    h4 = deep_states["target.h.4"]
    normed = h4 * torch.rsqrt(h4.pow(2).mean(-1, keepdim=True) + 1e-6)
    fc = cap.tensors["draft.fc_in"].clone()
    fc[:, TH : 2 * TH] = normed + _orthogonal(normed, DEEP_NOISE, g)
    other = Capture({**cap.tensors, "draft.fc_in": fc}, cap.meta)
    assert diagnose_fc(ref, other, floor=_floor(DEEP_NOISE))[-1] == (
        "engine fed fc [h2, rmsnorm(h4), h6]; reference fed [h2, h4, h6]; pattern: norm applied before fc "
        "(engine's chunk = rmsnorm(reference tensor))"
    )
