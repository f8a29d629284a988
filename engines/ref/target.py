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

from difftest.errors import ConfigError, EngineUnavailable


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
    check_fits(path, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.eval()
    return model


def checkpoint_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes the weights take once loaded in dtype (stored tensors are assumed 2-byte, the
    usual bf16/fp16 checkpoint, unless the config says float32)."""
    import json

    stored = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern))
    config = json.loads((path / "config.json").read_text())
    stored_width = 4 if str(config.get("torch_dtype") or config.get("dtype")) == "float32" else 2
    return stored * torch.finfo(dtype).bits // 8 // stored_width


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(path: Path, dtype: torch.dtype) -> None:
    """The reference holds the whole target in CPU memory: refuse early, with the way out, for a
    target that cannot fit (Kimi-K2.5's ~1 TB) instead of swapping or being OOM-killed mid-run."""
    need, have = checkpoint_bytes(path, dtype), available_memory()
    if have is not None and need > 0.9 * have:
        raise EngineUnavailable(
            f"ref cannot hold target {path}: {need / 2**30:.1f} GiB of weights in {str(dtype).removeprefix('torch.')}, "
            f"{have / 2**30:.1f} GiB of memory available; take the reference from a training-data dump "
            f"(--engines=train,sglang with engines.train.data in the case) or another engine (--reference=sglang)"
        )


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
