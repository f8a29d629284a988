"""Tensor comparison, tolerances, first divergence and the fc-wiring diagnosis."""

from __future__ import annotations

import math

import pytest
import torch

import difftest.compare.compare as compare_mod
from difftest.records.capture import Capture
from difftest.compare.compare import compare_captures, compare_tensor
from difftest.compare.diagnose import diagnose_fc
from difftest.compare.tolerances import DEFAULTS, Tolerance, tolerance_for
from difftest.records.tolerance import TolerancePair
from helpers import randn


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["float32", "bfloat16", "float16"]
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


def tol(dtype: torch.dtype) -> Tolerance:
    return tolerance_for("draft.logits", str(dtype).removeprefix("torch."), {})


# ---------------------------------------------------------------------------------------
# compare_tensor
# ---------------------------------------------------------------------------------------


@dtypes
def test_identical_tensors_pass(dtype):
    a = randn(3, 5, 16, dtype=dtype)
    d = compare_tensor("draft.fc_out", a, a.clone(), tol(dtype))
    assert (d.status, d.ok, d.mismatched, d.numel, d.nonfinite_mismatch) == ("ok", True, 0, 240, 0)
    assert (d.max_abs, d.max_rel, d.mean_abs, d.rel_diff) == (0.0, 0.0, 0.0, 0.0)
    assert d.cosine == pytest.approx(1.0, abs=1e-12)
    assert d.shape == [3, 5, 16]


@dtypes
def test_single_perturbed_element_is_counted_located_and_reported(dtype):
    a = randn(3, 5, 16, dtype=dtype)
    b = a.clone()
    b[1, 2, 7] = a[1, 2, 7] + 8
    d = compare_tensor("draft.fc_out", a, b, tol(dtype))
    assert (d.status, d.ok, d.mismatched, d.nonfinite_mismatch) == ("mismatch", False, 1, 0)
    assert d.max_abs_index == [1, 2, 7]
    assert d.ref_value == float(a[1, 2, 7])
    assert d.other_value == float(b[1, 2, 7])
    assert d.max_abs == float((b.float() - a.float()).abs()[1, 2, 7])
    assert "1/240 elements" in d.summary() and "at [1, 2, 7]" in d.summary()


@dtypes
def test_difference_within_tolerance_passes(dtype):
    a = torch.ones(8, dtype=dtype)
    t = tol(dtype)
    b = a.clone()
    b[3] = float(a[3]) + (t.atol + t.rtol) / 2  # representable in every dtype to within the margin
    d = compare_tensor("x", a, b, t)
    assert (d.status, d.mismatched) == ("ok", 0)


@dtypes
def test_equal_minus_inf_entries_match(dtype):
    a = randn(2, 10, dtype=dtype)
    a[:, ::3] = float("-inf")  # as logits_target outside the draft vocab
    d = compare_tensor("draft.logits_target", a, a.clone(), tol(dtype))
    assert (d.status, d.mismatched, d.nonfinite_mismatch, d.max_abs) == ("ok", 0, 0, 0.0)
    assert d.cosine == pytest.approx(1.0, abs=1e-6)


@dtypes
@pytest.mark.parametrize("side", ["engine-finite", "reference-finite"])
def test_minus_inf_against_finite_is_a_nonfinite_mismatch(dtype, side):
    a = randn(2, 10, dtype=dtype)
    a[:, ::3] = float("-inf")
    b = a.clone()
    if side == "engine-finite":
        b[1, 3] = 0.5
    else:
        a, b = b, a
        a[1, 3] = 0.5
    d = compare_tensor("draft.logits_target", a, b, tol(dtype))
    assert (d.status, d.mismatched, d.nonfinite_mismatch) == ("mismatch", 1, 1)
    assert d.max_abs == math.inf
    assert d.max_abs_index == [1, 3]


@dtypes
@pytest.mark.parametrize("where", ["engine", "both"])
def test_nan_counts_as_a_mismatch(dtype, where):
    a = randn(4, 4, dtype=dtype)
    b = a.clone()
    b[2, 1] = float("nan")
    if where == "both":
        a[2, 1] = float("nan")
    d = compare_tensor("draft.logits", a, b, tol(dtype))
    assert (d.status, d.mismatched, d.nonfinite_mismatch) == ("mismatch", 1, 1)
    assert d.max_abs_index == [2, 1]


@dtypes
def test_shape_mismatch_is_reported_as_shape(dtype):
    d = compare_tensor("draft.fc_in", randn(5, 96, dtype=dtype), randn(5, 64, dtype=dtype), tol(dtype))
    assert (d.status, d.ok) == ("shape", False)
    assert d.detail == "shape [5, 64] vs reference [5, 96]"
    assert d.summary() == "draft.fc_in: shape [5, 64] vs reference [5, 96]"


def _same_number(x, y) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


@dtypes
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite-differences", "with-nan-and-inf"])
def test_chunked_comparison_gives_the_same_numbers(dtype, nonfinite, monkeypatch):
    a = randn(6, 50, dtype=dtype, seed=1)
    a[:, ::7] = float("-inf")  # equal on both sides
    b = (a.float() + randn(6, 50, dtype=torch.float32, seed=2) * 1e-3).to(dtype)
    b[2, 5] = float(a[2, 5]) + 3
    b[4, 22] = float(a[4, 22]) + 9  # the greatest finite difference, in a late chunk
    if nonfinite:
        b[0, 3] = float("nan")
        b[5, 14] = 1.0  # finite where the reference has -inf
    whole = compare_tensor("draft.logits_target", a, b, tol(dtype))
    monkeypatch.setattr(compare_mod, "CHUNK_ELEMENTS", 7)  # 300 elements: 43 chunks, the last partial
    chunked = compare_tensor("draft.logits_target", a, b, tol(dtype))
    for k in (
        "status",
        "mismatched",
        "nonfinite_mismatch",
        "max_abs",
        "max_abs_index",
        "ref_value",
        "other_value",
        "max_rel",
    ):
        assert _same_number(getattr(chunked, k), getattr(whole, k)), k
    for k in ("mean_abs", "cosine", "rel_diff"):
        assert getattr(chunked, k) == pytest.approx(getattr(whole, k), rel=1e-5, abs=1e-9)
    assert whole.nonfinite_mismatch == (2 if nonfinite else 0)
    assert whole.max_abs_index == ([0, 3] if nonfinite else [4, 22])
    assert whole.mismatched >= (4 if nonfinite else 2)


@dtypes
@pytest.mark.parametrize(
    "ref, other, cosine, rel_diff",
    [
        ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 1.0, 0.0),
        ([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], 1.0, 0.2),  # 1 - 2*28 / (14 + 56)
        ([3.0, 4.0], [4.0, 3.0], 0.96, 0.04),  # 24/25; 1 - 48/50
        ([1.0, 0.0], [0.0, 1.0], 0.0, 1.0),
        ([1.0, 2.0], [-1.0, -2.0], -1.0, 2.0),
    ],
    ids=["equal", "scaled-by-2", "swapped", "orthogonal", "negated"],
)
def test_cosine_and_rel_diff_of_a_known_pair(dtype, ref, other, cosine, rel_diff):
    d = compare_tensor("x", torch.tensor(ref, dtype=dtype), torch.tensor(other, dtype=dtype), tol(dtype))
    assert d.cosine == pytest.approx(cosine, abs=1e-7)
    assert d.rel_diff == pytest.approx(rel_diff, abs=1e-7)


# ---------------------------------------------------------------------------------------
# Tolerances
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, atol, rtol",
    [("float32", 1e-4, 1e-4), ("bfloat16", 5e-2, 5e-2), ("float16", 1e-2, 1e-2)],
    ids=DTYPE_IDS,
)
def test_tolerance_defaults_per_dtype(dtype, atol, rtol):
    t = tolerance_for("draft.logits", dtype, {})
    assert (t.atol, t.rtol, t.source) == (atol, rtol, f"{dtype} default")
    assert t == DEFAULTS[dtype]


def test_tolerance_case_pattern_overrides_the_default():
    overrides = {"draft.logits*": TolerancePair(atol=1e-3)}
    t = tolerance_for("draft.logits_target", "float32", overrides)
    assert (t.atol, t.rtol, t.source) == (1e-3, 1e-4, "case: draft.logits*")
    assert tolerance_for("draft.fc_out", "float32", overrides) == DEFAULTS["float32"]


def test_tolerance_last_matching_pattern_wins():
    overrides = {
        "draft.*": TolerancePair(1e-3, 1e-3),
        "draft.logits": TolerancePair(2e-2, 3e-2),
        "target.*": TolerancePair(1.0, 1.0),
    }
    assert tolerance_for("draft.logits", "bfloat16", overrides) == Tolerance(2e-2, 3e-2, "case: draft.logits")
    assert tolerance_for("draft.fc_out", "bfloat16", overrides) == Tolerance(1e-3, 1e-3, "case: draft.*")


def test_compare_captures_applies_case_tolerances():
    a = Capture({"draft.logits": torch.zeros(4)})
    b = Capture({"draft.logits": torch.full((4,), 5e-3)})
    assert not compare_captures(a, b, "float32").ok
    assert compare_captures(a, b, "float32", {"draft.logits": TolerancePair(atol=1e-2)}).ok


# ---------------------------------------------------------------------------------------
# First divergence and fc diagnosis on synthetic captures
# ---------------------------------------------------------------------------------------

NUM_LAYERS = 8
TH = 16  # target hidden size
N = 5  # positions


@pytest.fixture(scope="module")
def target_states() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {f"target.h.{k}": torch.randn(N, TH, generator=g) for k in range(NUM_LAYERS + 1)}


def capture(target_states, fed: list[int], expected: list[int], **extra) -> Capture:
    fc_in = torch.cat([target_states[f"target.h.{k}"] for k in fed], dim=-1)
    meta = {
        "target_hidden_size": TH,
        "num_layers": NUM_LAYERS,
        "wiring": {"inputs": [f"target.h.{k}" for k in expected]},
    }
    return Capture({**target_states, "draft.fc_in": fc_in, **extra}, meta)


def test_first_divergence_names_the_first_failing_fc_in_chunk(target_states):
    ref = capture(target_states, [2, 4, 5], [2, 4, 5], **{"draft.fc_out": torch.ones(N, 8)})
    other = capture(target_states, [2, 5, 6], [2, 5, 6], **{"draft.fc_out": torch.zeros(N, 8)})
    diff = compare_captures(ref, other, "float32")
    assert [d.name for d in diff.diffs if not d.ok] == ["draft.fc_in", "draft.fc_in.1", "draft.fc_in.2", "draft.fc_out"]
    assert diff.first_divergence().name == "draft.fc_in.1"
    assert diff.first_divergence(names={"draft.fc_out"}).name == "draft.fc_out"


def test_first_divergence_is_none_when_everything_matches(target_states):
    ref = capture(target_states, [2, 4, 5], [2, 4, 5])
    assert compare_captures(ref, capture(target_states, [2, 4, 5], [2, 4, 5]), "float32").first_divergence() is None


DIAGNOSES = [
    # reference wiring, what the engine fed, the diagnosis's last line
    ([2, 4, 5], [3, 5, 6], "engine fed fc [h3, h5, h6]; reference fed [h2, h4, h5]; pattern: off-by-one +1"),
    (
        [3, 5, 6],
        [2, 4, 5],
        "engine fed fc [h2, h4, h5]; reference fed [h3, h5, h6]; pattern: off-by-one -1 or default-layer "
        "fallback (engine fed h[2], h[L//2], h[L-3] of L=8: it did not use the config's layer ids)",
    ),
    ([3, 5, 7], [2, 4, 6], "engine fed fc [h2, h4, h6]; reference fed [h3, h5, h7]; pattern: off-by-one -1"),
    (
        [0, 3, 7],
        [3, 7, 8],
        "engine fed fc [h3, h7, h8]; reference fed [h0, h3, h7]; pattern: embedding dropped and slots "
        "shifted by one (engine's chunk j = reference's chunk j+1)",
    ),
    ([2, 4, 5], [5, 2, 4], "engine fed fc [h5, h2, h4]; reference fed [h2, h4, h5]; pattern: permuted order"),
    (
        [2, 4, 5],
        [0, 4, 5],
        "engine fed fc [h0, h4, h5]; reference fed [h2, h4, h5]; pattern: embedding fed but not trained on",
    ),
    ([1, 4, 6], [6, 1, 4], "engine fed fc [h6, h1, h4]; reference fed [h1, h4, h6]; pattern: permuted order"),
    (
        [4, 1, 6],
        [1, 4, 6],
        "engine fed fc [h1, h4, h6]; reference fed [h4, h1, h6]; pattern: permuted order (engine sorted the ids)",
    ),
    (
        [1, 3, 6],
        [2, 4, 5],
        "engine fed fc [h2, h4, h5]; reference fed [h1, h3, h6]; pattern: default-layer fallback (engine fed "
        "h[2], h[L//2], h[L-3] of L=8: it did not use the config's layer ids)",
    ),
    ([2, 4, 5], [2, 4], "chunk count mismatch: engine fc_in has 2 chunks of 16, reference 3"),
    ([0, 2, 4], [0, 2, 4, 7], "chunk count mismatch: engine fc_in has 4 chunks of 16, reference 3"),
]


@pytest.mark.parametrize(
    "expected, fed, last_line",
    DIAGNOSES,
    ids=[
        "off-by-one-plus",
        "off-by-one-minus-onto-defaults",
        "off-by-one-minus",
        "embedding-dropped",
        "permuted",
        "embedding-extra",
        "permuted-2",
        "sorted",
        "default-fallback",
        "fewer-chunks",
        "more-chunks",
    ],
)
def test_diagnose_fc_names_the_miswiring(target_states, expected, fed, last_line):
    ref = capture(target_states, expected, expected)
    other = capture(target_states, fed, fed)
    lines = diagnose_fc(ref, other)
    assert lines[-1] == last_line


def test_diagnose_fc_says_which_reference_tensor_each_wrong_chunk_is(target_states):
    ref = capture(target_states, [0, 3, 7], [0, 3, 7])
    lines = diagnose_fc(ref, capture(target_states, [3, 7, 8], [3, 7, 8]))
    assert lines[0] == (
        "engine's fc chunk 0 matches reference target.h.3 (cos 1.0000); expected target.h.0 (the embedding)"
    )
    assert lines[2] == (
        "engine's fc chunk 2 matches reference target.h.8 (last layer, pre-norm) (cos 1.0000); expected target.h.7"
    )
    assert len(lines) == 4


def test_diagnose_fc_reports_a_chunk_matching_nothing(target_states):
    ref = capture(target_states, [2, 4, 5], [2, 4, 5])
    other = capture(target_states, [2, 4, 5], [2, 4, 5])
    other.tensors["draft.fc_in"] = other.tensors["draft.fc_in"].clone()
    other.tensors["draft.fc_in"][:, TH : 2 * TH] = torch.randn(N, TH, generator=torch.Generator().manual_seed(99))
    lines = diagnose_fc(ref, other)
    assert lines[0].startswith("engine's fc chunk 1 matches no reference tensor (closest ")
    assert lines[-1].startswith("engine fed fc [h2, ?, h5]; reference fed [h2, h4, h5]")


def test_diagnose_fc_is_silent_when_the_wiring_matches(target_states):
    ref = capture(target_states, [0, 3, 7], [0, 3, 7])
    assert diagnose_fc(ref, capture(target_states, [0, 3, 7], [0, 3, 7])) == []


def test_a_config_whose_own_ids_name_the_default_layers_is_not_called_a_fallback(target_states):
    # trained on [h5, h2, h4] with ids [5, 2, 4]; the engine feeds them in layer order = the defaults [h2, h4, h5]
    config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 2, 4]}}
    lines = diagnose_fc(
        capture(target_states, [5, 2, 4], [5, 2, 4]), capture(target_states, [2, 4, 5], [2, 4, 5]), config
    )
    assert (
        lines[-1]
        == "engine fed fc [h2, h4, h5]; reference fed [h5, h2, h4]; pattern: permuted order (engine sorted the ids)"
    )


def test_a_config_without_ids_is_named_as_the_reason_for_the_fallback(target_states):
    lines = diagnose_fc(capture(target_states, [1, 3, 6], [1, 3, 6]), capture(target_states, [2, 4, 5], [2, 4, 5]), {})
    assert lines[-1] == (
        "engine fed fc [h2, h4, h5]; reference fed [h1, h3, h6]; pattern: default-layer fallback "
        "(engine fed h[2], h[L//2], h[L-3] of L=8: the draft config names no layer ids)"
    )


def test_a_config_whose_ids_were_ignored_keeps_the_fallback_reading(target_states):
    config = {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}
    lines = diagnose_fc(
        capture(target_states, [1, 3, 6], [1, 3, 6]), capture(target_states, [2, 4, 5], [2, 4, 5]), config
    )
    assert lines[-1].endswith(
        "pattern: default-layer fallback (engine fed h[2], h[L//2], h[L-3] of L=8: it did not use the "
        "config's layer ids)"
    )
