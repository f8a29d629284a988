"""A draft checkpoint to a running draft module: which draft class its config names, its weights.

Above both draft modules: eagle3.py (the Llama draft, both checkpoint formats' configs and keys)
and eagle3_mla.py (the MLA draft, which builds on eagle3.py), so neither imports the other's user.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from difftest.api import ConfigError
from difftest.api import read_json
from difftest.api import first_line, tied_draft_head_words, unused_tensor_words
from difftest_engines.ref.eagle3 import Eagle3Config, Eagle3Draft, canonical_key, load_state_dict, parse_config
from difftest_engines.ref.eagle3_mla import Eagle3MLAConfig, Eagle3MLADraft, is_mla_config, parse_mla_config


# tensors that exist only when a config flag is on (eagle3.py Eagle3Draft.__init__)
_FLAG_GATED = ("fc_norm.", "input_norm.")


def build_draft(cfg: Eagle3Config) -> Eagle3Draft:
    """The module a config describes: MLA attention (eagle3_mla.py) for an Eagle3MLAConfig, else Llama's."""
    return Eagle3MLADraft(cfg) if isinstance(cfg, Eagle3MLAConfig) else Eagle3Draft(cfg)


@dataclass
class LoadedDraft:
    model: Eagle3Draft
    config: Eagle3Config
    shared: list[str]  # weights taken from the target ("embed_tokens", "lm_head")
    notes: list[str]


def _check_d2t(model_dir: Path, d2t: torch.Tensor, t2d: torch.Tensor | None, vocab: int) -> None:
    """Refuse a vocab map that sends draft ids outside the target vocabulary (or two onto one)."""
    from difftest.api import d2t_convention_findings

    targets = torch.arange(d2t.numel()) + d2t
    if bool(((targets >= 0) & (targets < vocab)).all()) and targets.unique().numel() == targets.numel():
        return
    absolute = d2t_convention_findings(d2t, None if t2d is None else t2d.bool(), vocab)
    why = (
        "it holds absolute target ids, not offsets (engines add the draft id): store d2t - arange(draft_vocab)"
        if absolute
        else "arange + d2t leaves the target vocabulary or repeats an id"
    )
    raise ConfigError(f"{model_dir}: d2t maps draft ids outside the target vocabulary of {vocab}: {why}")


def load_draft(
    model_dir: str | Path,
    target_embed: torch.Tensor | None = None,
    target_lm_head: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    lookup_embedding: bool = False,
) -> LoadedDraft:
    """The draft at `dtype`. `lookup_embedding`: its embedding table is left out (a meta placeholder)
    before the model is cast, for a caller that looks the rows up elsewhere (the streamed float64 run:
    difftest_engines/ref/streamed.py StreamedTarget.stream_embedding), so no table is ever made in `dtype`
    (4.2 GB in float64 at the Llama-3.1-8B shape)."""
    model_dir = Path(model_dir)
    raw_config = read_json(model_dir / "config.json")
    if not isinstance(raw_config, dict):
        raise ConfigError(f"{model_dir / 'config.json'}: expected a JSON object, got {type(raw_config).__name__}")
    try:
        if is_mla_config(raw_config):  # architectures names Eagle3DeepseekV2ForCausalLM (the Kimi-K2.5 family)
            cfg = parse_mla_config(raw_config, model_dir / "config.json")
        else:
            cfg = parse_config(raw_config, model_dir / "config.json")
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:  # e.g. hidden_size: "big"
        raise ConfigError(f"{model_dir / 'config.json'}: malformed draft config ({first_line(e)})") from None
    stored = load_state_dict(model_dir)
    raw = {canonical_key(k): v for k, v in stored.items()}
    as_stored = {canonical_key(k): k.removeprefix("model.") for k in stored}  # named as the checkpoint names it
    layer = raw_config.get("transformer_layer_config")
    tie = raw_config.get("tie_word_embeddings") or (isinstance(layer, dict) and layer.get("tie_word_embeddings"))
    if tie and "lm_head.weight" in raw:
        # the reference would serve the stored head, an engine that ties as the config says the embedding
        raise ConfigError(f"{model_dir / 'config.json'}: {tied_draft_head_words(as_stored['lm_head.weight'])}")
    notes: list[str] = []
    shared: list[str] = []
    fc_w = raw.get("fc.weight")
    if fc_w is None:
        raise ConfigError(f"{model_dir}: tensor fc.weight missing")
    expected = cfg.num_aux * cfg.target_hidden_size
    if fc_w.shape[1] != expected:
        raise ConfigError(
            f"{model_dir}: fc.weight has in_features {fc_w.shape[1]}, expected num_aux({cfg.num_aux}) x "
            f"target_hidden_size({cfg.target_hidden_size}) = {expected}"
        )
    model = build_draft(cfg)
    if "embed_tokens.weight" not in raw:
        if target_embed is None:
            raise ConfigError(f"{model_dir}: no embed_tokens.weight and no target embedding to share")
        raw["embed_tokens.weight"] = target_embed
        shared.append("embed_tokens")
    if "lm_head.weight" not in raw:
        if target_lm_head is None or cfg.draft_vocab_size != cfg.vocab_size:
            raise ConfigError(
                f"{model_dir}: no lm_head.weight (and draft vocab != target vocab, so it cannot be shared)"
            )
        raw["lm_head.weight"] = target_lm_head
        shared.append("lm_head")
    if "d2t" not in raw:
        if cfg.draft_vocab_size != cfg.vocab_size:
            notes.append("d2t missing while draft vocab < target vocab: draft ids map to the first target ids")
        raw["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    t2d = raw.pop("t2d", None)
    _check_d2t(model_dir, raw["d2t"].long(), t2d, cfg.vocab_size)
    state = model.state_dict()
    missing = sorted(set(state) - set(raw))
    if missing:
        raise ConfigError(f"{model_dir}: tensors missing from the checkpoint: {', '.join(missing)}")
    unexpected = sorted(set(raw) - set(state))
    # the tensors of a flag the config leaves off (fc_norm, norm_before_fc): engines gate them on the
    # same flag, so leaving them out is what every reader does, said in a note
    gated = [k for k in unexpected if k.startswith(_FLAG_GATED)]
    if gated:
        notes.append(f"ignored checkpoint tensors: {', '.join(gated)}")
    unknown = [k for k in unexpected if k not in gated]
    if unknown:
        # anything else (q_norm, k_norm, a bias the config does not enable) the reference would leave
        # out while an engine that applies it serves another draft: refused, as the lint names it
        more = f" (and {len(unknown) - 1} more: difftest lint lists them)" if len(unknown) > 1 else ""
        raise ConfigError(f"{model_dir}: {unused_tensor_words(as_stored[unknown[0]])}{more}")
    for k, v in state.items():
        if tuple(raw[k].shape) != tuple(v.shape):
            raise ConfigError(f"{model_dir}: tensor {k} has shape {tuple(raw[k].shape)}, expected {tuple(v.shape)}")
    model.load_state_dict({k: raw[k] for k in state})
    embed = getattr(model, "embed_tokens", None)
    if lookup_embedding and isinstance(embed, torch.nn.Embedding):
        table = embed.weight
        embed.weight = torch.nn.Parameter(torch.empty(table.shape, dtype=dtype, device="meta"), requires_grad=False)
        del table
    model = model.to(dtype)
    model.d2t = model.d2t.long()
    model.eval()
    return LoadedDraft(model, cfg, shared, notes)
