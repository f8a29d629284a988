"""Built-in tiny MLA EAGLE-3 draft (the Kimi-K2.5 draft family) for the tiny DeepSeek-V3 target.

  tiny-deepseek-v3-eagle3-mla   Eagle3DeepseekV2ForCausalLM (difftest_engines/ref/eagle3_mla.py): one layer of
                                MLA with the target's shapes (q_lora_rank 64, kv_lora_rank 512 +
                                qk_rope_head_dim 64: vLLM's CPU MLA backend takes head size 576 only;
                                qk_nope 32, v_head 32), dense silu MLP 256, draft vocab 512, the target's
                                yarn rope; TTT-trained (difftest_engines/ref/train.py) on fc = [h2, h4, h5] of
                                tiny-deepseek-v3 and saved with ids [2, 4, 5] at the top level (vLLM)
                                and in eagle_config (SGLang), weights as `layers.0.*`.

Trained exactly like tiny-deepseek-v3-eagle3 (same sequences, seeds, steps: fixtures.py's TRAIN),
only the draft's attention differs, so the two drafts' quality figures compare like for like.
quality.json holds the held-out figures and, for contrast, SGLang's Llama +1 reading ([h3, h5, h6]).

This module is the `difftest.fixtures` provider "mla" (resolve_fixture, build_all).
"""

from __future__ import annotations

import json
from pathlib import Path

from difftest_fixtures import cache, deepseek, drafts, targets
from difftest_fixtures.provider import NamedProvider

DRAFT = "tiny-deepseek-v3-eagle3-mla"
LANE = deepseek.LANE  # trained on the DeepSeek target: after it, in its process
NAMES = [DRAFT]
INTERMEDIATE = 256


def mla_draft_config():
    """The draft's shapes: the target's MLA (so the draft's KV cache is the target's latent layout)."""
    from difftest_engines.ref.eagle3_mla import Eagle3MLAConfig

    return Eagle3MLAConfig(
        hidden_size=deepseek.HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_attention_heads=deepseek.HEADS,
        num_key_value_heads=deepseek.HEADS,
        head_dim=deepseek.NOPE + deepseek.ROPE,
        vocab_size=targets.VOCAB,
        draft_vocab_size=drafts.DRAFT_VOCAB,
        target_hidden_size=deepseek.HIDDEN,
        num_aux=len(deepseek.GOOD_IDS),
        rms_norm_eps=1e-6,
        rope_theta=float(deepseek.ROPE_PARAMETERS["rope_theta"]),
        format="eagle-mla",
        q_lora_rank=deepseek.Q_LORA,
        kv_lora_rank=deepseek.KV_LORA,
        qk_nope_head_dim=deepseek.NOPE,
        qk_rope_head_dim=deepseek.ROPE,
        v_head_dim=deepseek.V_HEAD,
        rope_parameters=dict(deepseek.ROPE_PARAMETERS),
        max_position_embeddings=deepseek.MAX_POSITIONS,
    )


def _save(draft, out: Path, layer_ids: list[int], target_dir: Path) -> None:
    from difftest_engines.ref.eagle3_mla import save_mla_draft

    save_mla_draft(draft, out, layer_ids, target_config=json.loads((target_dir / "config.json").read_text()))


# The description is written into the fixture (fixture.json / quality.json), whose bytes keyed
# fixtures hash (difftest_fixtures/cache.py publish_keyed): it keeps the path the code had when
# FIXTURES_VERSION v1 was cut, so a rebuild stays byte-identical. The code is now in difftest_fixtures/mla.py.
RECIPE = drafts.DraftRecipe(
    name=DRAFT,
    target=deepseek.TARGET,
    train_wiring=deepseek.GOOD_WIRING,
    layer_ids=deepseek.GOOD_IDS,
    save=_save,
    fmt="eagle-mla",
    config=mla_draft_config,
    alternatives=(
        drafts.Alternative(
            "served_off_by_one",
            "what SGLang 0.5.23's Llama rule (id k -> h[k+1]) would feed for ids [2, 4, 5]",
            deepseek.SHIFTED_WIRING,
        ),
    ),
    extra={"architecture": "Eagle3DeepseekV2ForCausalLM"},
    description="MLA EAGLE-3 draft (Kimi-K2.5 family) TTT-trained on tiny-deepseek-v3 fc [h2, h4, h5]; "
    "see difftest_engines/ref/fixtures_mla.py",
)


def ensure_fixtures(names: list[str] | None = None, log: cache.Log = print, force: bool = False) -> dict[str, Path]:
    # The target belongs to another provider: built first, outside this build's lock (the lock is not reentrant).
    deepseek.ensure_fixtures([deepseek.TARGET], log=log)
    builders: dict[str, cache.Builder] = {DRAFT: lambda out, build: drafts.build_draft(RECIPE, out, build)}
    return cache.ensure_built(
        list(NAMES if names is None else names), NAMES, builders, {DRAFT: []}, log=log, force=force
    )


# -- the `difftest.fixtures` provider interface (pyproject entry point "mla") ---------------
_PROVIDER = NamedProvider("python -m difftest_fixtures.mla", __doc__, NAMES, ensure_fixtures)
resolve_fixture, build_all, main = _PROVIDER.resolve_fixture, _PROVIDER.build_all, _PROVIDER.main


if __name__ == "__main__":
    raise SystemExit(main())
