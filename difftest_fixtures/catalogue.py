"""Tiny drafts for the failure catalogue (docs/failure-catalogue.md): one per public failure class.

Each is the tiny Llama draft with one fault a trainer, converter or exporter has shipped:

  tiny-llama-eagle3-nbr         trained with norm_before_residual=true (speculators' default),
                                written in the HF layout: SGLang 0.5.23 never reads the flag
  tiny-llama-eagle3-own-embed   an exporter wrote a fresh random embed_tokens.weight (the draft
                                was trained on the target's embedding): vLLM keeps it, SGLang
                                replaces it with the target's
  tiny-llama-eagle3-no-lm-head  the exporter left out lm_head.weight (draft_vocab_size set)
  tiny-llama-eagle3-d2t-absolute  d2t written as absolute target ids instead of offsets
  tiny-llama-eagle3-no-d2t      the exporter left out d2t and t2d (draft_vocab_size still set): engines
                                read draft id i as target id i
  tiny-llama-eagle3-nbfc        trained with norm_before_fc=true (an RMSNorm over the whole fc input),
                                written in the HF layout: SGLang reads it from 0.5.17 (sglang PR 32334),
                                0.5.16 and older run the draft without it
  tiny-llama-eagle3-spec-normout trained with norm_output=true, saved in the speculators format: vLLM
                                propagates it from a speculators config from 0.25.0 (vllm PR 46488);
                                0.22.0 - 0.24.0 read it from HF configs only and run the draft without it
  tiny-llama-eagle3-spec-fcnorm trained with fc_norm=true (an RMSNorm per fc input chunk), saved in the
                                speculators format: vLLM 0.25.0 and later build the norms from a
                                speculators config (vllm PR 46488); 0.22.0 - 0.24.0 do not, and their
                                loader has no place for the norms' weights
  tiny-llama-eagle3-spec-nbfc   the nbfc draft (trained with norm_before_fc=true) saved in the speculators
                                format: vLLM reads it from a speculators config from 0.19.0 (vllm PR
                                38111), so every release that runs EAGLE-3 on a CPU (0.22.0 on) honours it
  tiny-llama-eagle3-rope500k    trained with the draft's own rope theta 500000 (rope_theta and
                                rope_parameters agree): the draft as trained
  tiny-llama-eagle3-rope-conflict  that draft as a converter exported it: rope_theta 500000 kept,
                                rope_parameters rebuilt with theta 10000 (speculators PR 574): the
                                engines (transformers 5) read rope_parameters
  tiny-llama-eagle3-llama3-rope  not a fault: the rope500k draft's weights with SpecForge's Llama-3 draft rope
                                (configs/llama3-70B-ealge3.json: rope_scaling llama3, factor 8, low/high
                                freq factor 1/4, original_max_position_embeddings 8192, rope_theta 500000):
                                the engines must compute that rope as transformers does (the reference)
  tiny-llama-eagle3-nested-ids  the seed draft (trained on [h0, h2, h4]) exported as SpecForge writes its
                                published DeepSeek-V3 / Kimi-K2.5 drafts: ids [0, 2, 4] only in
                                eagle_config.eagle_aux_hidden_state_layer_ids. vLLM's Model Runner V1 reads
                                them there; Model Runner V2 (0.32's GPU default, the only runner from 0.33)
                                never does and feeds its defaults [h2, h4, h5]
  tiny-llama-eagle3-unsorted    trained on [h5, h2, h4] with config ids [5, 2, 4] (a trainer that
                                feeds fc in the listed order): both engines feed layer order. Made
                                from the good draft by moving fc.weight's input blocks, which is
                                exactly the draft that training on that order would give

Usage: python -m difftest_fixtures.catalogue [NAME ...] [--force]
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from difftest_fixtures import cache, drafts
from difftest_fixtures import tiny_llama as base
from difftest_fixtures.provider import NamedProvider

NBR = "tiny-llama-eagle3-nbr"
OWN_EMBED = "tiny-llama-eagle3-own-embed"
NO_LM_HEAD = "tiny-llama-eagle3-no-lm-head"
D2T_ABSOLUTE = "tiny-llama-eagle3-d2t-absolute"
NO_D2T = "tiny-llama-eagle3-no-d2t"
ROPE_TRAINED = "tiny-llama-eagle3-rope500k"
ROPE_CONFLICT = "tiny-llama-eagle3-rope-conflict"
LLAMA3_ROPE = "tiny-llama-eagle3-llama3-rope"
UNSORTED = "tiny-llama-eagle3-unsorted"
NBFC = "tiny-llama-eagle3-nbfc"
SPEC_NORMOUT = "tiny-llama-eagle3-spec-normout"
SPEC_FCNORM = "tiny-llama-eagle3-spec-fcnorm"
SPEC_NBFC = "tiny-llama-eagle3-spec-nbfc"
NESTED_IDS = "tiny-llama-eagle3-nested-ids"
LANE = base.LANE  # edits and retrains of the tiny-llama drafts
NAMES = [
    NBR,
    OWN_EMBED,
    NO_LM_HEAD,
    D2T_ABSOLUTE,
    NO_D2T,
    UNSORTED,
    NBFC,
    SPEC_NORMOUT,
    SPEC_FCNORM,
    SPEC_NBFC,
    ROPE_TRAINED,
    ROPE_CONFLICT,
    LLAMA3_ROPE,
    NESTED_IDS,
]
ROPE_THETA = 500000.0
# SpecForge's configs/llama3-70B-ealge3.json rope, as it spells it (transformers 4's rope_scaling)
SPECFORGE_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
UNSORTED_ORDER = [2, 0, 1]  # the good draft's chunks [h2, h4, h5] taken as [h5, h2, h4]
EMBED_SEED = 11


FAULTS = {
    NBR: "trained with norm_before_residual=true, saved in the HF layout",
    OWN_EMBED: "embed_tokens.weight replaced by random values (trained on the target's embedding)",
    NO_LM_HEAD: "lm_head.weight left out of the checkpoint",
    D2T_ABSOLUTE: "d2t holds absolute target ids instead of offsets",
    NO_D2T: "d2t and t2d left out of the checkpoint (draft_vocab_size still set)",
    ROPE_TRAINED: "trained with rope theta 500000 (its own, not the target's 10000)",
    ROPE_CONFLICT: "rope_theta 500000 but rope_parameters.rope_theta 10000 (a converter rebuilt rope_parameters)",
    UNSORTED: "trained on [h5, h2, h4] (ids [5, 2, 4]); engines feed fc in layer order",
    NBFC: "trained with norm_before_fc=true (an RMSNorm over the concatenated fc input), saved in the HF layout",
    SPEC_NORMOUT: "trained with norm_output=true (later draft steps fed the normed output), saved in the speculators format",
    SPEC_FCNORM: "trained with fc_norm=true (one RMSNorm per fc input chunk), saved in the speculators format",
    SPEC_NBFC: "trained with norm_before_fc=true (an RMSNorm over the concatenated fc input), saved in the speculators format",
    LLAMA3_ROPE: "none: SpecForge's Llama-3 draft rope (llama3, factor 8, theta 500000) on the rope500k weights",
    NESTED_IDS: "trained on [h0, h2, h4]; ids [0, 2, 4] only in eagle_config.eagle_aux_hidden_state_layer_ids (SpecForge's export)",
}


def _edited_copy(out: Path, fault: str, config=None, tensors=None, source: str = "tiny-llama-eagle3") -> None:
    """The good tiny draft (or `source`) with its config and weights edited (the fault an exporter makes)."""
    src = base.fixture_path(source) if source == "tiny-llama-eagle3" else cache.fixtures_dir() / source
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tensors is not None:
        t = load_file(str(out / "model.safetensors"))
        tensors(t)
        save_file(t, str(out / "model.safetensors"))
    quality = json.loads((src / "quality.json").read_text())
    quality.update(catalogue_fault=FAULTS[fault], edited_from=source)
    (out / "quality.json").write_text(json.dumps(quality, indent=2) + "\n")


NBR_RECIPE = drafts.DraftRecipe(
    name=NBR,
    target="tiny-llama",
    train_wiring=base.GOOD_WIRING,
    layer_ids=base.GOOD_IDS,
    config=lambda: dataclasses.replace(drafts.draft_config(), norm_before_residual=True),
    extra={"catalogue_fault": FAULTS[NBR]},
)


NBFC_RECIPE = dataclasses.replace(
    NBR_RECIPE,
    name=NBFC,
    config=lambda: dataclasses.replace(drafts.draft_config(), norm_before_fc=True),
    extra={"catalogue_fault": FAULTS[NBFC]},
)


def _save_speculators(draft, out: Path, layer_ids: list[int], target_dir: Path) -> None:
    from difftest_engines.ref.train import save_speculators_format

    save_speculators_format(draft, out, layer_ids, verifier_name_or_path="tiny-llama")


SPEC_NORMOUT_RECIPE = dataclasses.replace(
    NBR_RECIPE,
    name=SPEC_NORMOUT,
    save=_save_speculators,
    fmt="speculators",
    config=lambda: dataclasses.replace(drafts.draft_config(), norm_output=True),
    extra={"catalogue_fault": FAULTS[SPEC_NORMOUT]},
)

SPEC_FCNORM_RECIPE = dataclasses.replace(
    SPEC_NORMOUT_RECIPE,
    name=SPEC_FCNORM,
    config=lambda: dataclasses.replace(drafts.draft_config(), fc_norm=True),
    extra={"catalogue_fault": FAULTS[SPEC_FCNORM]},
)


def _build_spec_nbfc(out: Path, build: cache.Build) -> None:
    """The nbfc draft's weights in the speculators layout: the same recipe, seed and data would train
    the same weights again (builds are deterministic), so it is a format, not a second training."""
    drafts.save_speculators_copy(
        cache.fixtures_dir() / NBFC,
        out,
        base.GOOD_IDS,
        format="speculators",
        same_weights_as=NBFC,
        catalogue_fault=FAULTS[SPEC_NBFC],
    )


def _build_own_embed(out: Path, build: cache.Build) -> None:
    def random_embedding(t):
        g = torch.Generator().manual_seed(EMBED_SEED)
        e = t["embed_tokens.weight"]
        t["embed_tokens.weight"] = torch.randn(e.shape, generator=g, dtype=e.dtype) * e.std()

    _edited_copy(out, OWN_EMBED, tensors=random_embedding)


def _build_no_lm_head(out: Path, build: cache.Build) -> None:
    _edited_copy(out, NO_LM_HEAD, tensors=lambda t: t.pop("lm_head.weight"))


def _build_d2t_absolute(out: Path, build: cache.Build) -> None:
    def absolute(t):
        t["d2t"] = t["d2t"] + torch.arange(t["d2t"].numel(), dtype=t["d2t"].dtype)

    _edited_copy(out, D2T_ABSOLUTE, tensors=absolute)


def _build_no_d2t(out: Path, build: cache.Build) -> None:
    def drop_maps(t):
        t.pop("d2t")
        t.pop("t2d", None)

    _edited_copy(out, NO_D2T, tensors=drop_maps)


ROPE_RECIPE = dataclasses.replace(
    NBR_RECIPE,
    name=ROPE_TRAINED,
    config=lambda: dataclasses.replace(drafts.draft_config(), rope_theta=ROPE_THETA),
    extra={"catalogue_fault": FAULTS[ROPE_TRAINED]},
)


def _build_rope_conflict(out: Path, build: cache.Build) -> None:
    def rebuilt_rope_parameters(cfg):
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}

    _edited_copy(out, ROPE_CONFLICT, config=rebuilt_rope_parameters, source=ROPE_TRAINED)


def _build_llama3_rope(out: Path, build: cache.Build) -> None:
    """The rope500k weights (trained with theta 500000) under SpecForge's llama3 rope: at the tiny cases'
    positions only the slow pairs (wavelength > 2048) move, so the draft stays close to as good."""

    def specforge_rope(cfg):
        cfg.pop("rope_parameters", None)  # SpecForge writes transformers 4's spelling only
        cfg["rope_theta"] = ROPE_THETA
        cfg["rope_scaling"] = dict(SPECFORGE_LLAMA3_ROPE)

    _edited_copy(out, LLAMA3_ROPE, config=specforge_rope, source=ROPE_TRAINED)


def _build_unsorted(out: Path, build: cache.Build) -> None:
    good = [2, 4, 5]
    ids = [good[j] for j in UNSORTED_ORDER]

    def reorder(t):
        w = t["fc.weight"]
        size = w.shape[1] // len(good)
        t["fc.weight"] = torch.cat([w[:, j * size : (j + 1) * size] for j in UNSORTED_ORDER], dim=1).contiguous()

    def config(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
        cfg.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = ids

    _edited_copy(out, UNSORTED, config=config, tensors=reorder)


NESTED_TRAINED_IDS = [0, 2, 4]  # the miswired draft's training wiring [h0, h2, h4], in vLLM's reading


def _build_nested_ids(out: Path, build: cache.Build) -> None:
    def only_in_eagle_config(cfg):
        cfg.pop("eagle_aux_hidden_state_layer_ids", None)
        cfg.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = list(NESTED_TRAINED_IDS)

    _edited_copy(out, NESTED_IDS, config=only_in_eagle_config, source="tiny-llama-eagle3-miswired")


_BUILDERS: dict[str, cache.Builder] = {
    NBR: lambda out, build: drafts.build_draft(NBR_RECIPE, out, build),
    OWN_EMBED: _build_own_embed,
    NO_LM_HEAD: _build_no_lm_head,
    D2T_ABSOLUTE: _build_d2t_absolute,
    NO_D2T: _build_no_d2t,
    UNSORTED: _build_unsorted,
    NBFC: lambda out, build: drafts.build_draft(NBFC_RECIPE, out, build),
    SPEC_NORMOUT: lambda out, build: drafts.build_draft(SPEC_NORMOUT_RECIPE, out, build),
    SPEC_FCNORM: lambda out, build: drafts.build_draft(SPEC_FCNORM_RECIPE, out, build),
    SPEC_NBFC: _build_spec_nbfc,
    ROPE_TRAINED: lambda out, build: drafts.build_draft(ROPE_RECIPE, out, build),
    ROPE_CONFLICT: _build_rope_conflict,
    LLAMA3_ROPE: _build_llama3_rope,
    NESTED_IDS: _build_nested_ids,
}
_DEPS: dict[str, list[str]] = {
    **dict.fromkeys(NAMES, []),
    ROPE_CONFLICT: [ROPE_TRAINED],
    LLAMA3_ROPE: [ROPE_TRAINED],
    SPEC_NBFC: [NBFC],
}


def ensure_fixtures(names: list[str] | None = None, log=print, force: bool = False) -> dict[str, Path]:
    # built under their own provider
    base.ensure_fixtures(["tiny-llama", "tiny-llama-eagle3", "tiny-llama-eagle3-miswired"], log=log)
    return cache.ensure_built(list(NAMES if names is None else names), NAMES, _BUILDERS, _DEPS, log=log, force=force)


# -- the `difftest.fixtures` provider interface (pyproject entry point "catalogue") ---------------
_PROVIDER = NamedProvider("python -m difftest_fixtures.catalogue", __doc__, NAMES, ensure_fixtures)
resolve_fixture, build_all, main = _PROVIDER.resolve_fixture, _PROVIDER.build_all, _PROVIDER.main


if __name__ == "__main__":
    raise SystemExit(main())
