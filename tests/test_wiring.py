"""Wiring presets and explicit wirings, for an 8-layer target (h0..h8; h8 = last layer, pre-norm).

Each preset translates a draft config's layer ids the way one ecosystem does
(shared/notes/wiring-failures.md); defaults for L=8 are [2, L//2, L-3] = [2, 4, 5].
"""

from __future__ import annotations

import pytest

from difftest.base.errors import ConfigError
from difftest.rules.wiring import FINAL_NORM, PRESETS, resolve, trained_layer_ids

L = 8


def h(*ks: int) -> list[str]:
    return [f"target.h.{k}" for k in ks]


PRESET_CASES = [
    # preset, ids, fc inputs, verifier
    ("vllm", [2, 4, 5], h(2, 4, 5), None),
    ("vllm", [5, 2, 2, 4], h(2, 4, 5), None),
    ("vllm", None, h(2, 4, 5), None),
    ("vllm", [0, 4, 8], h(0, 4, 8), None),
    ("speculators", [5, 2, 2, 4], h(2, 4, 5), None),
    ("speculators", None, h(2, 4, 5), None),
    ("sglang", [2, 4, 5], h(3, 5, 6), None),
    ("sglang", None, h(2, 4, 5), None),
    ("sglang", [-1, 3, 6], h(0, 4, 7), None),
    ("sglang-deepseek", [1, 4, 5], h(2, 5, 6), None),
    ("sglang-deepseek", [2, 4, 5], h(2, 4, 5), None),
    ("sglang-deepseek", [0, 4, 5], h(0, 4, 5), None),
    ("sglang-deepseek", None, h(2, 4, 5), None),
    ("specforge", [2, 4, 5], h(3, 5, 6), None),
    ("specforge", [1, 3, 4], h(2, 4, 5), None),
    ("specforge", None, h(2, 4, 5), None),
    ("specforge", [4, 1, 3], h(2, 4, 5), None),
    ("speculators-train", [2, 4, 5], h(2, 4, 5), "target.h.8"),
    ("speculators-train", [5, 2, 4], h(2, 4, 5), "target.h.8"),
    ("speculators-train", None, h(2, 4, 5), "target.h.8"),
    ("speculators-launch", [0, 2, 4, 7], h(0, 2, 4), "target.h.7"),
    ("speculators-launch", [2, 4, 5, 8], h(2, 4, 5), "target.h.8"),
    ("speculators-launch", [7, 0, 2, 4], h(0, 2, 4), "target.h.7"),
    ("speculators-launch", None, h(2, 4, 5), "target.h.8"),
    ("speculators-legacy", [2, 4, 5, 7], h(3, 5, 6), "target.h.8"),
    ("speculators-legacy", None, h(3, 5, 6), "target.h.8"),
    ("eagle", [0, 1, 3], h(2, 4, 5), None),
    ("eagle", None, h(2, 4, 5), None),
]
PRESET_IDS = [
    "vllm-ids",
    "vllm-sorted-dedup",
    "vllm-default",
    "vllm-embedding-and-prenorm-final",
    "speculators-sorted-dedup",
    "speculators-default",
    "sglang-plus-one",
    "sglang-default-no-plus-one",
    "sglang-id-minus-1-is-embedding",
    "sglang-deepseek-first-id-1-plus-one",
    "sglang-deepseek-first-id-not-1-as-is",
    "sglang-deepseek-embedding",
    "sglang-deepseek-default",
    "specforge-plus-one",
    "specforge-default-ids-plus-one",
    "specforge-default",
    "specforge-unsorted-ids-stored-in-layer-order",
    "speculators-train-config-ids-are-fc-verifier-appended",
    "speculators-train-unsorted-ids-stored-in-layer-order",
    "speculators-train-default",
    "speculators-launch-last-is-verifier",
    "speculators-launch-prenorm-final-verifier",
    "speculators-launch-stored-in-layer-order",
    "speculators-launch-default-launch-ids",
    "speculators-legacy-output-of-layer-k",
    "speculators-legacy-default-ids",
    "eagle-ignores-ids",
    "eagle-default",
]


@pytest.mark.parametrize("preset, ids, inputs, verifier", PRESET_CASES, ids=PRESET_IDS)
def test_preset_maps_layer_ids_to_target_tensors(preset, ids, inputs, verifier):
    wiring = resolve(preset, L, ids)
    assert wiring.inputs == inputs
    assert wiring.verifier == verifier


def test_every_preset_is_covered():
    assert {case[0] for case in PRESET_CASES} == set(PRESETS)


@pytest.mark.parametrize(
    "ids, source",
    [([2, 4, 5], "preset vllm from ids [2, 4, 5] (draft config)"), (None, "preset vllm, no ids: defaults")],
    ids=["from-ids", "defaults"],
)
def test_preset_wiring_says_where_it_came_from(ids, source):
    assert resolve("vllm", L, ids).source == source


def test_sglang_id_L_minus_1_is_unreachable():
    with pytest.raises(ConfigError) as info:
        resolve("sglang", L, [2, 4, 7])
    assert str(info.value) == (
        "sglang convention: SGLang 0.5.23 (Llama rule: ids from eagle_config, layer order, "
        "k -> h[k+1]) turns [2, 4, 7] (eagle_config) into [h3, h5]; [h8] cannot be captured and "
        "are dropped: fewer fc chunks than ids, a shape error in the engine"
    )


def test_speculators_launch_ids_need_an_fc_input_and_a_verifier():
    with pytest.raises(ConfigError, match="speculators-launch: needs at least two launch ids"):
        resolve("speculators-launch", L, [3])


def test_speculators_train_reads_one_config_id_as_one_fc_input_and_appends_the_final_layer():
    w = resolve("speculators-train", L, [3])
    assert (list(w.inputs), w.verifier) == (["target.h.3"], f"target.h.{L}")


@pytest.mark.parametrize(
    "spec, inputs",
    [
        ("h0+h3+h7", h(0, 3, 7)),
        ("[h0, h3, h7]", h(0, 3, 7)),
        ("h7 h0 h3", h(7, 0, 3)),
        (["h0", "target.h.3", "final_norm"], [*h(0, 3), FINAL_NORM]),
        (["h.2", "target.final_norm", "h8"], [*h(2), FINAL_NORM, *h(8)]),
    ],
    ids=["plus-joined", "bracketed-list-string", "order-kept", "mixed-list", "prenorm-h8-and-final_norm"],
)
def test_explicit_wiring_is_taken_as_written(spec, inputs):
    wiring = resolve(spec, L, [2, 4, 5])  # the config's ids play no part
    assert wiring.inputs == inputs
    assert wiring.source == "explicit"
    assert wiring.verifier is None


def test_wiring_reports_layer_indices_and_short_form():
    wiring = resolve(["h0", "target.h.3", "final_norm"], L, None)
    assert wiring.layer_indices() == [0, 3, None]
    assert wiring.short() == "[h0, h3, final_norm]"


@pytest.mark.parametrize(
    "spec, ids, message",
    [
        (
            "vlm",
            None,
            "wiring: unknown wiring preset 'vlm'; expected one of vllm, speculators, sglang, sglang-deepseek, "
            "specforge, speculators-train, speculators-launch, speculators-legacy, eagle or a list like [h0, h3, h31]",
        ),
        ("h0+h9", None, "wiring: h9 does not exist; the target has 8 layers (h0..h8)"),
        ("vllm", [2, 4, 9], "wiring: h9 does not exist; the target has 8 layers (h0..h8)"),
        ("specforge", [2, 4, 8], "wiring: h9 does not exist; the target has 8 layers (h0..h8)"),
        ("speculators-train", [2, 4, 5, 9], "wiring: h9 does not exist; the target has 8 layers (h0..h8)"),
        (
            "",
            None,
            "wiring: empty wiring; expected a preset (vllm, speculators, sglang, sglang-deepseek, specforge, "
            "speculators-train, speculators-launch, speculators-legacy, eagle) or a list like [h0, h3, h31]",
        ),
        (
            [],
            None,
            "wiring: empty wiring; expected a preset (vllm, speculators, sglang, sglang-deepseek, specforge, "
            "speculators-train, speculators-launch, speculators-legacy, eagle) or a list like [h0, h3, h31]",
        ),
        (
            ["h0", "layer3"],
            None,
            "wiring: wiring input 'layer3' is not a target tensor (expected hK, target.h.K or final_norm)",
        ),
    ],
    ids=[
        "unknown-preset",
        "explicit-h9",
        "vllm-id-9",
        "specforge-id-8",
        "speculators-train-verifier-h9",
        "empty-string",
        "empty-list",
        "not-a-target-tensor",
    ],
)
def test_bad_wiring_is_a_one_line_config_error(spec, ids, message):
    with pytest.raises(ConfigError) as info:
        resolve(spec, L, ids)
    assert str(info.value) == message


def test_error_names_the_place_the_wiring_came_from():
    with pytest.raises(ConfigError, match=r"^cases/x\.yaml: wiring: h9 does not exist"):
        resolve("h9", L, None, where="cases/x.yaml: wiring")


@pytest.mark.parametrize(
    "case_ids, eagle_config_ids, top_ids, setting_ids, expected",
    [
        ([1, 2], [3, 4], [5, 6], [7, 8], ([7, 8], "engine settings")),
        ([1, 2], [3, 4], [5, 6], None, ([1, 2], "case layer_ids")),
        (None, [3, 4], [5, 6], None, ([3, 4], "draft config eagle_config")),
        (None, [], [5, 6], None, ([5, 6], "draft config")),
        (None, None, [5, 6], None, ([5, 6], "draft config")),
        (None, None, None, None, (None, "draft config")),
    ],
    ids=["setting-first", "then-case", "then-eagle_config", "empty-eagle_config-falls-through", "then-top", "none"],
)
def test_layer_ids_come_from_the_first_place_that_gives_them(
    case_ids, eagle_config_ids, top_ids, setting_ids, expected
):
    """One precedence for the reference engine, the lint and `wiring: infer` (rules.wiring.trained_layer_ids)."""
    assert trained_layer_ids(case_ids, eagle_config_ids, top_ids, setting_ids) == expected
