"""SGLang 0.5.23 and DeepSeek-V2/V3 / Kimi-K2 targets (MLA + MoE): which layers it feeds the
draft, and what its CPU path needs. Plain Python over config dicts; no SGLang import.

Layer ids (the rule itself lives in difftest.rules.layer_rules.SGLANG_DEEPSEEK / SGLANG_LLAMA; verified
against sglang 0.5.23, paths under sglang/srt/):
  * SGLang reads the draft's ids only from `eagle_config.eagle_aux_hidden_state_layer_ids`
    (model_executor/model_runner_components/spec_aux_hidden_state.py); the top-level key that
    vLLM reads is ignored, and without eagle_config ids the target falls back to its defaults.
  * models/deepseek_v2.py::DeepseekV2ForCausalLM.set_eagle3_layers_to_capture: ids as given, +1
    only when ids[0] == 1; no ids -> [2, L//2, L-3]. Layer k in layers_to_capture is captured
    as it enters decoder layer k, i.e. target.h.k (k = 0: the embedding); k >= L never is, and
    AuxHiddenStatePacker.finalize (layers/aux_hidden_states.py) then kills the scheduler with
    "captured n of m aux hidden states" (also for a repeated layer, each layer captures once).
  * models/llama.py::LlamaForCausalLM.set_eagle3_layers_to_capture: always +1; no ids -> the
    same defaults without +1.

CPU path of an MLA target (measures, reported in capture meta["compat"]):
  * layers/rotary_embedding/factory.py (CPU) accepts only rope_type deepseek_yarn: a target with
    plain rope gets an equivalent yarn rope (factor 1: the same frequencies and attention scale)
    through a config overlay;
  * models/deepseek_v2.py reads config.moe_layer_freq, which transformers' DeepseekV3Config lacks:
    1 is added (the meaning of a config without it: every layer >= first_k_dense_replace is MoE);
  * the cpu-shim's extend_attention_cpu takes the new tokens' k/v from its arguments: MLA prefill
    passes k/v it never stores in the latent cache (difftest_engines/sglang/cpu_shim/ops.py).
"""

from __future__ import annotations

DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")


def text_config(cfg: dict) -> dict:
    inner = cfg.get("text_config")
    return inner if isinstance(inner, dict) else cfg


def is_deepseek(target_cfg: dict) -> bool:
    t = text_config(target_cfg)
    return t.get("model_type") in DEEPSEEK_MODEL_TYPES or any("Deepseek" in a for a in t.get("architectures") or [])


def is_mla(target_cfg: dict) -> bool:
    return text_config(target_cfg).get("kv_lora_rank") is not None


def _reading(target_cfg: dict, draft_cfg: dict, version: str | None = None):
    """SGLang's reading of the draft's layer ids (difftest.rules.layer_rules: the one copy of the rule; an
    older release's differences from it: difftest_engines/sglang/versions.py)."""
    from difftest.api import target_family
    from difftest_engines.sglang.versions import layer_rule

    rule = layer_rule(target_family(target_cfg), version)
    return rule.predict(draft_cfg, int(text_config(target_cfg)["num_hidden_layers"]))


def layers_to_capture(target_cfg: dict, draft_cfg: dict, version: str | None = None) -> tuple[list[int], str]:
    """SGLang's layers_to_capture for this pair and the rule that produced it, in words."""
    reading = _reading(target_cfg, draft_cfg, version)
    return reading.asked, reading.explain()


def unrunnable(target_cfg: dict, draft_cfg: dict, draft_path: str, version: str | None = None) -> str | None:
    """Why SGLang's DeepSeek model would kill its scheduler on this pair's first prefill, or None:
    its AuxHiddenStatePacker expects one capture per entry of layers_to_capture, and a repeated
    layer or one >= L is captured once or never.

    Only for DeepSeek targets: the Llama path's crash is left to SGLang (and its log)."""
    if not is_deepseek(target_cfg):
        return None
    reading = _reading(target_cfg, draft_cfg, version)
    layers, L = reading.asked, reading.L
    if reading.refusal and reading.rule.low_crash and any(0 <= k < int(reading.rule.capturable[0]) for k in layers):
        return f"SGLang would feed layers_to_capture {layers} for {draft_path}/config.json ({reading.explain()})"
    if len(reading.fed) == len(layers):
        return None
    fallback = " (default-layer fallback)" if reading.ids is None else ""
    top = draft_cfg.get("eagle_aux_hidden_state_layer_ids")
    ignored = f"; top-level eagle_aux_hidden_state_layer_ids {top} ignored" if reading.ids is None and top else ""
    why = []
    if len(set(layers)) < len(layers):
        why.append("a repeated layer is captured once")
    if any(k >= L or k < 0 for k in layers):
        why.append(f"layers >= L={L} are never captured")
    return (
        f"SGLang would feed layers_to_capture {layers}{fallback} for {draft_path}/config.json "
        f"({reading.explain()}{ignored}), captures only {len(reading.fed)} of {len(layers)} aux hidden states "
        f"({'; '.join(why)}) and its scheduler dies (AuxHiddenStatePacker: captured n of m aux hidden states)"
    )


def rope_type(target_cfg: dict) -> str:
    t = text_config(target_cfg)
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    return str(rope.get("rope_type") or rope.get("type") or "default")


def cpu_target_overrides(target_cfg: dict) -> tuple[dict, list[str]]:
    """Config overrides an MLA DeepSeek target needs on SGLang's CPU path, and their descriptions."""
    if not (is_deepseek(target_cfg) and is_mla(target_cfg)):
        return {}, []
    t = text_config(target_cfg)
    nested = t is not target_cfg
    overrides: dict = {}
    notes = []
    if "moe_layer_freq" not in t:
        overrides["moe_layer_freq"] = 1
        notes.append(
            "target config moe_layer_freq: 1 added (SGLang's deepseek_v2.py reads it; absent means every "
            "layer >= first_k_dense_replace is MoE)"
        )
    kind = rope_type(target_cfg)
    if kind not in ("yarn", "deepseek_yarn"):
        if kind != "default":
            raise ValueError(
                f"rope_type {kind!r}: SGLang's CPU path supports only (deepseek_)yarn rope for DeepSeek targets"
            )
        rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
        theta = rope.get("rope_theta", t.get("rope_theta", 10000.0))
        max_pos = int(t.get("max_position_embeddings", 4096))
        yarn = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": 1.0,
            "original_max_position_embeddings": max_pos,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
        key = "rope_parameters" if "rope_parameters" in t or "rope_scaling" not in t else "rope_scaling"
        overrides[key] = yarn
        notes.append(
            f"target rope {key} default -> yarn factor 1.0 (identical frequencies and scale; SGLang's CPU "
            "rope supports only deepseek_yarn)"
        )
    if nested and overrides:
        overrides = {"text_config": overrides}
    return overrides, notes


SHIM_MLA_NOTE = (
    "cpu-shim extend_attention_cpu: new tokens' k/v from its k/v arguments, prefix from the cache "
    "(MLA prefill never stores them in the latent cache)"
)
AMX_NOTE = "attention_backend=intel_amx with the AMX platform override (cpu-shim provides its two ops)"
