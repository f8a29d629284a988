"""The reference draft as `wiring: infer` scores it (difftest.run.infer_case): a `difftest.drafts` entry point."""

from __future__ import annotations

from pathlib import Path

import torch

from difftest.api import ConfigError
from difftest.api import DraftLoader


def _target_tensor(target: Path, suffix: str) -> torch.Tensor | None:
    """One tensor of the target checkpoint by name suffix (e.g. embed_tokens.weight), read lazily."""
    from safetensors import safe_open

    for f in sorted(target.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key.endswith(suffix):
                    return fh.get_tensor(key).float()
    return None


def load_inference_draft(draft: str | Path, target: str | Path):
    """The draft in float32 (difftest_engines.ref.eagle3), with the target's embedding / lm_head where it shares them."""
    from difftest_engines.ref.draft_loading import load_draft

    try:
        return load_draft(draft)
    except ConfigError as e:
        if "embed" not in str(e) and "lm_head" not in str(e):
            raise
    t = Path(target)
    return load_draft(
        draft, target_embed=_target_tensor(t, "embed_tokens.weight"), target_lm_head=_target_tensor(t, "lm_head.weight")
    )


# registered under the `difftest.drafts` entry points (pyproject.toml)
LOADER = DraftLoader("eagle3", load_inference_draft)
