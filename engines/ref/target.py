"""The target model: any transformers causal LM, with its residual stream captured.

Canonical names: `target.h.{k}` is the residual stream *entering* decoder layer k, so
h.0 is the embedding output and h.L the last layer's output **before** the final norm.
HF's `output_hidden_states[L]` is taken after the final norm, so h.L comes from a hook
on the final norm's input instead; `target.final_norm` is that norm's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from difftest.errors import ConfigError


@dataclass
class TargetOutput:
    hidden: list[torch.Tensor]  # L+1 tensors [B, n, H]: h.0 .. h.L (h.L pre-norm)
    final_norm: torch.Tensor  # [B, n, H]
    logits: torch.Tensor  # [B, n, V]


def load_target(path: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise ConfigError(f"{path}: target checkpoint not found (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.eval()
    return model


def final_norm_module(model) -> torch.nn.Module:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    norm = getattr(base, "norm", None)
    if norm is None:
        raise ConfigError(f"{type(model).__name__}: no final norm at model.norm; cannot capture the pre-norm last layer")
    return norm


def num_layers(model) -> int:
    return int(model.config.num_hidden_layers)


@torch.no_grad()
def run_target(model, input_ids: torch.Tensor) -> TargetOutput:
    """input_ids: [B, n]."""
    seen: dict[str, torch.Tensor] = {}

    def hook(_module, args, output):
        seen["prenorm"], seen["postnorm"] = args[0], output

    handle = final_norm_module(model).register_forward_hook(hook)
    try:
        out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    hs = list(out.hidden_states)
    L = num_layers(model)
    if len(hs) != L + 1:
        raise ConfigError(f"{type(model).__name__}: output_hidden_states has {len(hs)} entries, expected {L + 1}")
    hidden = hs[:L] + [seen["prenorm"]]
    return TargetOutput(hidden=hidden, final_norm=seen["postnorm"], logits=out.logits)
