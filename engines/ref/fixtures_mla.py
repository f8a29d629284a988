"""Built-in tiny MLA EAGLE-3 draft (the Kimi-K2.5 draft family) for the tiny DeepSeek-V3 target.

  tiny-deepseek-v3-eagle3-mla   Eagle3DeepseekV2ForCausalLM (engines/ref/eagle3_mla.py): one layer of
                                MLA with the target's shapes (q_lora_rank 64, kv_lora_rank 512 +
                                qk_rope_head_dim 64: vLLM's CPU MLA backend takes head size 576 only;
                                qk_nope 32, v_head 32), dense silu MLP 256, draft vocab 512, the target's
                                yarn rope; TTT-trained (engines/ref/train.py) on fc = [h2, h4, h5] of
                                tiny-deepseek-v3 and saved with ids [2, 4, 5] at the top level (vLLM)
                                and in eagle_config (SGLang), weights as `layers.0.*`.

Trained exactly like tiny-deepseek-v3-eagle3 (same sequences, seeds, steps: fixtures.py's TRAIN),
only the draft's attention differs, so the two drafts' quality figures compare like for like.
quality.json holds the held-out figures and, for contrast, SGLang's Llama +1 reading ([h3, h5, h6]).

This module is the `difftest.fixtures` provider "mla" (resolve_fixture, build_all).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from engines.ref import fixtures as base
from engines.ref import fixtures_deepseek as deepseek

DRAFT = "tiny-deepseek-v3-eagle3-mla"
NAMES = [DRAFT]
INTERMEDIATE = 256


def mla_draft_config():
    """The draft's shapes: the target's MLA (so the draft's KV cache is the target's latent layout)."""
    from engines.ref.eagle3_mla import Eagle3MLAConfig

    return Eagle3MLAConfig(
        hidden_size=deepseek.HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_attention_heads=deepseek.HEADS,
        num_key_value_heads=deepseek.HEADS,
        head_dim=deepseek.NOPE + deepseek.ROPE,
        vocab_size=base.VOCAB,
        draft_vocab_size=base.DRAFT_VOCAB,
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


def _train(target, build: base._Build):
    from engines.ref.train import prepare_data, train_draft

    t0 = time.time()
    sequences = base.generate_sequences(
        target, base.TRAIN_SEQS, base.TRAIN_PROMPT, base.TRAIN_NEW, base.TRAIN_DATA_SEED, eps=base.TRAIN_EPS
    )
    data = prepare_data(target, deepseek.GOOD_WIRING, sequences)
    with torch.enable_grad():
        draft = train_draft(
            target, mla_draft_config(), deepseek.GOOD_WIRING, data, seed=base.DRAFT_SEED, log=build.log, log_every=100, **base.TRAIN
        )
    return draft, time.time() - t0


def _build_draft(out: Path, build: base._Build) -> None:
    from engines.ref.eagle3_mla import save_mla_draft
    from engines.ref.target import load_target

    target_dir = deepseek.fixture_path(deepseek.TARGET)
    target = load_target(target_dir)
    draft, train_time = _train(target, build)
    save_mla_draft(draft, out, deepseek.GOOD_IDS, target_config=json.loads((target_dir / "config.json").read_text()))
    heldout = base.heldout_sequences(target)
    prompts = heldout[: base.SIM_PROMPTS, : base.HELDOUT_PROMPT].tolist()
    served = base.evaluate_draft(target, draft, deepseek.GOOD_WIRING, heldout, prompts)
    shifted = base.evaluate_draft(target, draft, deepseek.SHIFTED_WIRING, heldout, prompts)
    quality = base._quality_common(deepseek.GOOD_WIRING, deepseek.GOOD_IDS, "eagle-mla", train_time, target=deepseek.TARGET)
    quality.update(
        architecture="Eagle3DeepseekV2ForCausalLM",
        step0_agreement=served["step0_agreement"],
        accept_length=served["accept_length"],
        acceptance_rate_per_pos=served["acceptance_rate_per_pos"],
        simulation=served["stats"],
        served_off_by_one={
            "note": "what SGLang 0.5.23's Llama rule (id k -> h[k+1]) would feed for ids [2, 4, 5]",
            **{k: shifted[k] for k in ("wiring", "wiring_short", "step0_agreement", "accept_length", "acceptance_rate_per_pos")},
        },
    )
    base._write_json(out / "quality.json", quality)
    base._write_json(
        out / "fixture.json",
        {"version": base.FIXTURES_VERSION, "description": "MLA EAGLE-3 draft (Kimi-K2.5 family) TTT-trained on tiny-deepseek-v3 "
         "fc [h2, h4, h5]; see engines/ref/fixtures_mla.py"},
    )  # fmt: skip
    build.log(base._summary(DRAFT, quality))


def ensure_fixtures(names: list[str] | None = None, log: base.Log = print, force: bool = False) -> dict[str, Path]:
    wanted = list(NAMES if names is None else names)
    for name in wanted:
        if name not in NAMES:
            raise KeyError(f"unknown fixture {name!r}; known: {', '.join(NAMES)}")
    # The target belongs to another provider: built first, outside this build's lock (the lock is not reentrant).
    deepseek.ensure_fixtures([deepseek.TARGET], log=log)
    return base.ensure_built(wanted, NAMES, {DRAFT: _build_draft}, {DRAFT: []}, log=log, force=force)


# -- the `difftest.fixtures` provider interface (pyproject entry point "mla") ---------------


def resolve_fixture(name: str) -> Path | None:
    """`fixture:NAME` in a case: the draft's directory, built on first use; None if not ours."""
    return base.resolve_from(name, NAMES, ensure_fixtures)


def build_all(force: bool = False) -> None:
    """`difftest fixtures [--force]`: build the MLA draft and print its quality figures."""
    main(["--force"] if force else [])


def main(argv: list[str] | None = None) -> int:
    return base.provider_main(argv, "python -m engines.ref.fixtures_mla", __doc__, NAMES, ensure_fixtures)


if __name__ == "__main__":
    raise SystemExit(main())
