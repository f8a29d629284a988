"""Tiny random DeepSeek-V3 (MLA + MoE, the Kimi-K2 architecture) targets with EAGLE-3 drafts,
built locally so the engine tests do not depend on the trained built-in fixture.

The shape is the smallest that all three engines accept on CPU (see
/work/shared/notes/engines-on-cpu.md, "DeepSeek-V3 / Kimi-K2 architecture"):
  * kv_lora_rank 512 + qk_rope_head_dim 64: vLLM's CPU MLA backend supports head size 576 only;
  * yarn rope: SGLang's CPU path supports only deepseek_yarn;
  * moe_layer_freq 1: SGLang's DeepSeek model reads it (real DeepSeek-V3/Kimi-K2 configs have it;
    transformers' DeepseekV3Config does not, and ignores it: every layer >= first_k_dense_replace is MoE).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

HIDDEN = 128
NUM_LAYERS = 6
VOCAB = 512
DRAFT_VOCAB = 256


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def deepseek_v3_config(yarn: bool = True):
    """yarn=False: plain rope (what a DeepSeek-V2-Lite-like checkpoint has; SGLang's CPU path needs a measure)."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_nextn_predict_layers=0,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        topk_method="noaux_tc",
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        hidden_act="silu",
        attention_bias=False,
        rope_parameters=dict(YARN) if yarn else {"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg.moe_layer_freq = 1
    return cfg


def build_random_deepseek_target(directory: Path, seed: int = 0, zero_final_norm: bool = False, plain: bool = False):
    """A random DeepseekV3ForCausalLM saved as safetensors; weights scaled so that layers matter
    (default init leaves a 6-layer tiny model close to its embedding). plain=True: plain rope and
    no moe_layer_freq in config.json, as transformers writes a DeepseekV3Config."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_v3_config(yarn=not plain)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
            elif "e_score_correction_bias" in name:
                p.normal_(0, 0.05)
            else:
                p.uniform_(0.8, 1.2)
        if zero_final_norm:  # logits all 0: greedy always picks token 0
            model.model.norm.weight.zero_()
    model.save_pretrained(directory, safe_serialization=True)
    # moe_layer_freq is not a DeepseekV3Config attribute that survives every save path: make sure it is there
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if plain:
        cfg.pop("moe_layer_freq", None)
    else:
        cfg["moe_layer_freq"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return model


def make_deepseek_pair(
    directory: Path, layer_ids: list[int], degenerate: str | None = None, seed: int = 0, plain: bool = False
) -> tuple[Path, Path]:
    """A tiny random DeepSeek-V3 target and an untrained EAGLE-3 draft (ids at top level and in eagle_config).

    degenerate=None: random weights (greedy tokens and hidden states are non-trivial).
    degenerate="right" / "wrong": target and draft logits all 0 (final norm weights 0), so the
    target always emits token 0 and the draft proposes its lowest target id: d2t maps draft id 0
    to 0 (always right) or to 1 (always wrong), as tests/helpers.make_degenerate_pair.
    plain=True: plain rope, no moe_layer_freq (see build_random_deepseek_target).
    """
    from difftest_engines.ref.eagle3 import Eagle3Config
    from difftest_engines.ref.train import init_draft, save_eagle_format

    directory.mkdir(parents=True, exist_ok=True)
    target = build_random_deepseek_target(
        directory / "target", seed, zero_final_norm=degenerate is not None, plain=plain
    )
    dcfg = Eagle3Config(
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=HIDDEN,
        num_aux=len(layer_ids),
    )
    d2t = torch.arange(DRAFT_VOCAB) + (1 if degenerate == "wrong" else 0)
    draft = init_draft(target, dcfg, d2t, seed=seed + 1)
    if degenerate is not None:
        with torch.no_grad():
            draft.norm.weight.zero_()
    save_eagle_format(draft, directory / "draft", list(layer_ids))
    return directory / "target", directory / "draft"


def hf_greedy(target_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt (fp32): what any engine must reproduce."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p) :].tolist())
    return out
