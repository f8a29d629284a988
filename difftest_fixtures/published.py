"""Tiny drafts shaped like published EAGLE-3 drafts (difftest_fixtures/published_configs/, verbatim).

Each published-shape fixture is a trained tiny draft's weights under a config built from one published config.json:
every published key is kept and so is its structure: where the layer ids live (or that there are
none), d2t/t2d present or not (a draft_vocab_size or a full vocabulary), the rope settings (verbatim:
they carry no size), the kv-head ratio when it is MHA (kv heads == heads), and max_position_embeddings
relative to its target's. What is shrunk: widths, heads, vocabulary, token ids and the layer ids.

  published-deepseek-v3-8l          tiny-deepseek-v3's construction at 8 layers (the target of the three
                                    DeepSeek-family drafts below)
  published-deepseek-v3-8l-eagle3   its draft, trained on [h2, h4, h5] (ids [2, 4, 5] at both places):
                                    the weights of the three below
  published-specforge-deepseek-v3   SpecForge configs/deepseek-v3-671b-eagle3.json: ids [1, 3, 4] only in
                                    eagle_config (published [1, 29, 57])
  published-specforge-kimi-k25      SpecForge configs/kimi-k25-eagle3.json: ids [2, 4, 5] only in
                                    eagle_config (published [2, 30, 58]), kv heads == heads
  published-torchspec-kimi-k25      TorchSpec configs/draft_models/kimi_k25_eagle3.json: no ids, no
                                    draft_vocab_size, no d2t/t2d (lm_head over the whole 1024-token
                                    vocabulary), kv heads == heads
  published-eagle3-llama31-8b       EAGLE's traineagle3/config.json (the EAGLE3-LLaMA3.1-Instruct-8B
                                    draft) over tiny-llama: no ids, max_position_embeddings 32 (published
                                    2048 under a 131072-position target: 1/64 of tiny-llama's 2048)
  published-specforge-llama3-70b    SpecForge configs/llama3-70B-ealge3.json over tiny-llama: rope_scaling
                                    llama3 (factor 8, original_max_position_embeddings 4096) and
                                    rope_theta 500000 verbatim, max_position_embeddings 64 (1/32)

How the layer ids are scaled. The published lists are formulas of the 61-layer target: Kimi's
[2, 30, 58] is vLLM's default (2, L//2, L-3); DeepSeek's [1, 29, 57] is SpecForge's default
(1, L//2-1, L-4), each id one less. The same formulas at L = 8 give [2, 4, 5] and [1, 3, 4], three
distinct layers (at tiny-deepseek-v3's L = 6 they collide: [2, 3, 3]), hence the 8-layer target. So an
engine's defaults land where they land at full size: on the Kimi ids. The weights are trained on
[h2, h4, h5]: what SpecForge's reading of [1, 3, 4] names (id k = output of layer k = h[k+1]) and what
vLLM's reading of [2, 4, 5] names; that SpecForge's reading of Kimi's [2, 4, 5] is [h3, h5, h6] is
what the lint says of it. The Llama drafts carry no ids; the engines' defaults for tiny-llama (L = 8)
are [h2, h4, h5], what tiny-llama-eagle3 (and the rope500k draft) were trained on.

The weights change only where the structure does, exactly: kv heads == heads repeats each kv head
over its query group (the same attention as GQA); a full vocabulary scatters the draft's lm_head rows
to their target ids (d2t) and leaves the other rows zero, so the draft ranks the tokens it was
trained on as before and a token outside them only when every trained logit is negative.

Usage: python -m difftest_fixtures.published [NAME ...] [--force]
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from difftest_fixtures import cache, deepseek, drafts, targets
from difftest_fixtures import tiny_llama as base
from difftest_fixtures.provider import NamedProvider

PUBLISHED_DIR = Path(__file__).parent / "published_configs"

SPECFORGE_DEEPSEEK = "published-specforge-deepseek-v3"
SPECFORGE_KIMI = "published-specforge-kimi-k25"
TORCHSPEC_KIMI = "published-torchspec-kimi-k25"
EAGLE_LLAMA31 = "published-eagle3-llama31-8b"
SPECFORGE_LLAMA3 = "published-specforge-llama3-70b"
# the 8-layer DeepSeek-V3 target and its draft the DeepSeek-family drafts are made of (module docstring)
TARGET_8L = "published-deepseek-v3-8l"
DRAFT_8L = "published-deepseek-v3-8l-eagle3"
TARGET_8L_LAYERS = 8
LANE = deepseek.LANE  # trains a DeepSeek draft: in the DeepSeek lane, after its target
NAMES = [TARGET_8L, DRAFT_8L, SPECFORGE_DEEPSEEK, SPECFORGE_KIMI, TORCHSPEC_KIMI, EAGLE_LLAMA31, SPECFORGE_LLAMA3]


class Source:
    """One published config and what its tiny fixture is made of."""

    def __init__(
        self,
        file: str,
        target: str,
        weights: str,
        target_max_positions: int,
        layer_ids: list[int] | None,
        trained_on: list[str],
    ) -> None:
        self.file = file  # in published_configs/
        self.target = target  # the tiny target fixture it pairs with
        self.weights = weights  # the built draft fixture whose weights it takes
        self.target_max_positions = target_max_positions  # the published draft's real target's
        self.layer_ids = layer_ids  # the published ids scaled into the tiny target (see the docstring)
        self.trained_on = trained_on  # what the weights were trained on

    def published(self) -> dict:
        return json.loads((PUBLISHED_DIR / self.file).read_text())


GOOD = list(deepseek.GOOD_WIRING)
SOURCES: dict[str, Source] = {
    # DeepSeek-V3's and Kimi-K2.5's max_position_embeddings: 163840 and 262144 (their config.json)
    SPECFORGE_DEEPSEEK: Source("specforge-deepseek-v3-671b-eagle3.json", TARGET_8L, DRAFT_8L, 163840, [1, 3, 4], GOOD),
    SPECFORGE_KIMI: Source("specforge-kimi-k25-eagle3.json", TARGET_8L, DRAFT_8L, 262144, [2, 4, 5], GOOD),
    TORCHSPEC_KIMI: Source("torchspec-kimi-k25-eagle3.json", TARGET_8L, DRAFT_8L, 262144, None, GOOD),
    # Llama-3.1-8B-Instruct's and Llama-3.x-70B-Instruct's: 131072
    EAGLE_LLAMA31: Source(
        "eagle-traineagle3-llama31-8b.json", "tiny-llama", "tiny-llama-eagle3", 131072, None, list(base.GOOD_WIRING)
    ),
    SPECFORGE_LLAMA3: Source(
        "specforge-llama3-70B-ealge3.json",
        "tiny-llama",
        "tiny-llama-eagle3-rope500k",
        131072,
        None,
        list(base.GOOD_WIRING),
    ),
}


def shrunk_config(
    published: dict, draft: dict, target: dict, target_max_positions: int, layer_ids: list[int] | None
) -> dict:
    """The published config with its sizes replaced by the tiny draft's (`draft`, its built config) and
    tiny target's (`target`): the published keys, in their order, and no others but what the sizes need."""
    out = dict(published)
    heads = draft["num_attention_heads"]
    mha = published["num_key_value_heads"] == published["num_attention_heads"]
    sizes = {
        "hidden_size": draft["hidden_size"],
        "intermediate_size": draft["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads if mha else draft["num_key_value_heads"],
        "head_dim": draft["head_dim"],
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft["draft_vocab_size"],
        "max_window_layers": target["num_hidden_layers"],
        "bos_token_id": target["bos_token_id"],
        "pad_token_id": target["pad_token_id"],
    }
    for key, value in sizes.items():
        if key in out:
            out[key] = value
    if "eos_token_id" in out:
        out["eos_token_id"] = (
            [target["eos_token_id"]] if isinstance(out["eos_token_id"], list) else target["eos_token_id"]
        )
    # the draft's positions as the same fraction of its target's
    out["max_position_embeddings"] = max(
        1, published["max_position_embeddings"] * target["max_position_embeddings"] // target_max_positions
    )
    if "eagle_config" in out:
        out["eagle_config"] = {**out["eagle_config"], "eagle_aux_hidden_state_layer_ids": list(layer_ids or [])}
    if "head_dim" not in published and draft["hidden_size"] // heads != draft["head_dim"]:
        out["head_dim"] = draft["head_dim"]  # the published file leaves it to hidden / heads; tiny sizes may not
    return out


def shrunk_weights(tensors: dict[str, torch.Tensor], draft: dict, config: dict) -> dict[str, torch.Tensor]:
    """The built draft's weights in the shape `config` declares (see the module docstring)."""
    t = dict(tensors)
    kv, kv_new = draft["num_key_value_heads"], config["num_key_value_heads"]
    if kv_new != kv:
        head_dim = draft["head_dim"]
        for name in ("midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight"):
            w = t[name].view(kv, head_dim, -1)
            t[name] = w.repeat_interleave(kv_new // kv, dim=0).reshape(kv_new * head_dim, -1).contiguous()
    if "draft_vocab_size" not in config:
        d2t = t.pop("d2t")
        t.pop("t2d", None)
        head = t["lm_head.weight"]
        full = torch.zeros(config["vocab_size"], head.shape[1], dtype=head.dtype)
        full[torch.arange(d2t.numel()) + d2t] = head
        t["lm_head.weight"] = full
    return t


def _measured(draft_dir: Path, target_dir: Path, wiring: list[str]) -> dict:
    """Step-0 agreement and simulated acceptance of the built draft, fed `wiring` (drafts.evaluate_draft)."""
    from difftest_engines.ref.draft_loading import load_draft
    from difftest_engines.ref.target import load_target

    target = load_target(target_dir)
    heldout = drafts.heldout_sequences(target)
    scored = drafts.evaluate_draft(target, load_draft(draft_dir).model, wiring, heldout, drafts.heldout_prompts(target))
    return {
        "step0_agreement": scored["step0_agreement"],
        "accept_length": scored["accept_length"],
        "acceptance_rate_per_pos": scored["acceptance_rate_per_pos"],
        "simulation": scored["stats"],
    }


def _builder(name: str) -> cache.Builder:
    source = SOURCES[name]

    def build(out: Path, build: cache.Build) -> None:
        src = cache.fixtures_dir() / source.weights
        draft = json.loads((src / "config.json").read_text())
        target = json.loads((cache.fixtures_dir() / source.target / "config.json").read_text())
        config = shrunk_config(source.published(), draft, target, source.target_max_positions, source.layer_ids)
        save_file(
            shrunk_weights(load_file(str(src / "model.safetensors")), draft, config), str(out / "model.safetensors")
        )
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (src / f).exists():
                shutil.copy2(src / f, out / f)
        quality = {
            "version": cache.FIXTURES_VERSION,
            "published_config": source.file,
            "edited_from": source.weights,
            "target": source.target,
            "config_layer_ids": source.layer_ids,
            "train_wiring": source.trained_on,
            "train_wiring_short": "[" + ", ".join("h" + w.removeprefix("target.h.") for w in source.trained_on) + "]",
            "train_time_s": 0.0,
        }
        # measured under the published shape (its own rope, eps, heads, vocabulary), not copied from the source
        quality.update(_measured(out, cache.fixtures_dir() / source.target, source.trained_on))
        cache.write_json(out / "quality.json", quality)

    return build


def _build_target_8l(out: Path, build: cache.Build) -> None:
    model = deepseek.build_deepseek_target(layers=TARGET_8L_LAYERS)
    targets.save_target(
        model,
        out,
        "tiny-deepseek-v3's construction at 8 layers (difftest_fixtures/deepseek.py::build_deepseek_target, "
        "layers=8): the depth at which the published DeepSeek-family layer-id formulas stay distinct",
    )
    config = json.loads((out / "config.json").read_text())
    config["moe_layer_freq"] = 1  # SGLang's deepseek_v2.py reads it (difftest_fixtures/deepseek.py)
    cache.write_json(out / "config.json", config)


DRAFT_8L_RECIPE = drafts.DraftRecipe(
    name=DRAFT_8L,
    target=TARGET_8L,
    train_wiring=GOOD,
    layer_ids=deepseek.GOOD_IDS,
    context_dependence=True,
)

_BUILDERS: dict[str, Callable[[Path, cache.Build], None]] = {
    TARGET_8L: _build_target_8l,
    DRAFT_8L: lambda out, build: drafts.build_draft(DRAFT_8L_RECIPE, out, build),
    **{name: _builder(name) for name in SOURCES},
}
_DEPS: dict[str, list[str]] = {
    TARGET_8L: [],
    DRAFT_8L: [TARGET_8L],
    **{name: [s.weights] if s.weights in (DRAFT_8L,) else [] for name, s in SOURCES.items()},
}


def fixture_path(name: str) -> Path:
    if name not in NAMES:
        raise KeyError(f"unknown fixture {name!r}; known: {', '.join(NAMES)}")
    return cache.fixtures_dir() / name


def ensure_fixtures(names: list[str] | None = None, log: cache.Log = print, force: bool = False) -> dict[str, Path]:
    """Build the named published-shape drafts (default: all) unless cached; returns name -> directory."""
    wanted = list(NAMES if names is None else names)
    # their targets and source drafts are built under their own providers
    base.ensure_fixtures(["tiny-llama", "tiny-llama-eagle3"], log=log)
    if SPECFORGE_LLAMA3 in wanted:
        from difftest_fixtures import catalogue

        catalogue.ensure_fixtures([catalogue.ROPE_TRAINED], log=log)
    return cache.ensure_built(wanted, NAMES, _BUILDERS, _DEPS, log=log, force=force)


# -- the `difftest.fixtures` provider interface (pyproject entry point "published") ---------------
_PROVIDER = NamedProvider("python -m difftest_fixtures.published", __doc__, NAMES, ensure_fixtures)
resolve_fixture, build_all, main = _PROVIDER.resolve_fixture, _PROVIDER.build_all, _PROVIDER.main


if __name__ == "__main__":
    raise SystemExit(main())
