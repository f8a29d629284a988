"""The SGLang adapter on a DeepSeek-V3 target (MLA + MoE, the Kimi-K2 architecture) with an EAGLE-3 draft.

One `pytest cases/ --engines=ref,sglang` session over tiny random pairs built here
(tests/deepseek_helpers.py): a random pair with plain rope and no moe_layer_freq (so the adapter's
CPU measures all apply), an always-right pair (yarn rope, as DeepSeek-V3 / Kimi-K2 ship), and the
random pair with its eagle_config ids removed, which SGLang replaces by its default layers. Needs
SGLang's environment (`scripts/setup-engine sglang`): skipped with that command without it,
failed under DIFFTEST_REQUIRE_ENGINES=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deepseek_helpers import hf_greedy, make_deepseek_pair
from helpers import COUNTERS_CASE, run_pytest

K = 3
PROMPTS = [[1, 5, 9, 33, 77, 101, 7], [4, 8, 15, 16, 23, 42]]
MAX_NEW = 24
TOPLEVEL_ONLY = (
    "engines:\n  sglang:\n    draft_config_overrides:\n      eagle_config: {eagle_aux_hidden_state_layer_ids: null}\n"
)


@pytest.fixture(scope="module")
def sglang_deepseek_run(tmp_path_factory, sglang_python):
    root = tmp_path_factory.mktemp("sglang_deepseek")
    (root / "cases").mkdir()
    rand_t, rand_d = make_deepseek_pair(root / "models" / "random", [2, 4, 5], plain=True)
    right_t, right_d = make_deepseek_pair(root / "models" / "always_right", [2, 4, 5], degenerate="right")
    for name, (t, d, extra) in {
        "random": (rand_t, rand_d, ""),
        "always_right": (right_t, right_d, ""),
        "toplevel_only": (rand_t, rand_d, TOPLEVEL_ONLY),
    }.items():
        (root / "cases" / f"{name}.yaml").write_text(COUNTERS_CASE.format(target=t, draft=d, k=K, extra=extra))
    cache = tmp_path_factory.mktemp("cache")  # captures (with their meta) land here
    result = run_pytest(
        root,
        "cases/",
        f"--engine-python=sglang={sglang_python}",
        "--engines=ref,sglang",
        "--no-capture-cache",
        "--engine-timeout=600",
        env={"DIFFTEST_CACHE": str(cache)},
    )
    result.cache = cache
    result.models = {"random": rand_t, "always_right": right_t}
    return result


def _sglang_metas(cache: Path) -> dict[str, dict]:
    """SGLang capture meta by pair name (its original target directory's parent)."""
    out = {}
    for p in (cache / "captures").rglob("manifest.json"):
        meta = json.loads(p.read_text())["meta"]
        if meta.get("engine") == "sglang":
            draft = Path(meta["checkpoints"]["draft"]).resolve()
            out[draft.parent.name] = meta
    return out


def test_deepseek_greedy_tokens_match_hf(sglang_deepseek_run):
    engine = sglang_deepseek_run.outcome("random", "sglang", "accept_length").data.engine
    assert engine.outputs == hf_greedy(sglang_deepseek_run.models["random"], PROMPTS, MAX_NEW), (
        sglang_deepseek_run.output[-3000:]
    )


def test_deepseek_fed_layers_and_fc_in_match_the_reference_by_value(sglang_deepseek_run):
    for check in ("fc_inputs", "draft_logits"):
        result = sglang_deepseek_run.outcome("random", "sglang", check)
        assert result.outcome == "passed", f"{check}: {result.message}"
    for prompt in sglang_deepseek_run.report("random").comparisons["sglang"]:
        by_name = {t.name: t for t in prompt.tensors}
        # SGLang captures only what it feeds: ids [2, 4, 5] with first id != 1 -> h2, h4, h5 (no +1)
        for name in ["target.h.2", "target.h.4", "target.h.5", "draft.fc_in", "draft.fc_in.0", "draft.fc_in.2"]:
            assert by_name[name].status == "ok", by_name[name]
            assert by_name[name].max_abs < 1e-4, by_name[name]


def test_deepseek_always_right_draft_accepts_k_plus_1(sglang_deepseek_run):
    result = sglang_deepseek_run.outcome("always_right", "sglang", "accept_length")
    engine = result.data.engine
    assert engine.num_verify > 0
    assert engine.accept_length == pytest.approx(K + 1), engine
    assert engine.acceptance_rate_per_pos == [1.0] * K
    assert result.outcome == "passed", result.message


def test_deepseek_cpu_measures_are_recorded_in_capture_meta(sglang_deepseek_run):
    from difftest_engines.sglang import cpu_shim, deepseek

    metas = _sglang_metas(sglang_deepseek_run.cache)
    assert sorted(metas) == ["always_right", "random"]
    for name, meta in metas.items():
        shim = meta["kernels"] == cpu_shim.CPU_SHIM
        target_cfg = json.loads((sglang_deepseek_run.models[name] / "config.json").read_text())
        _, notes = deepseek.cpu_target_overrides(target_cfg)
        assert meta["compat"] == [deepseek.AMX_NOTE] * shim + notes + [deepseek.SHIM_MLA_NOTE] * shim
    # the random pair needed both config measures; the yarn pair with moe_layer_freq needed none
    assert len(metas["random"]["compat"]) - len(metas["always_right"]["compat"]) == 2
    assert metas["random"]["wiring"]["inputs"] == ["target.h.2", "target.h.4", "target.h.5"]


def test_deepseek_ids_only_at_top_level_are_refused_naming_the_default_layer_fallback(sglang_deepseek_run):
    result = sglang_deepseek_run.outcome("toplevel_only", "sglang", "fc_inputs")
    assert result.outcome == "error"
    message = result.message
    assert "SGLang would feed layers_to_capture [2, 3, 3] (default-layer fallback)" in message
    assert (
        "finds no ids (eagle_config)" in message
        and "top-level eagle_aux_hidden_state_layer_ids [2, 4, 5] ignored" in message
    )
    assert "captures only 2 of 3 aux hidden states (a repeated layer is captured once)" in message
    assert "\n" not in message
