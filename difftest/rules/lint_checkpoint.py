"""Lint rules for the draft checkpoint itself: flags, weights, embedding, rope, d2t, format.

Each rule is one of the public failure classes (docs/failure-catalogue.md): a fault an
engine loads without an error and then serves with a lower accept length. The engines'
behaviour comes from difftest.rules.draft_rules (one table, cited to the engine's source); the
checkpoint is read from its config and safetensors headers, plus a few embedding rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from difftest.rules.draft_rules import (
    EAGLE_CONFIG,
    ENGINES,
    FLAG_TENSORS,
    FLAG_WEIGHTS,
    SERVING,
    SPECULATORS,
    TOP,
    EngineDraftRules,
    context_length,
    engine_reading,
    flag_locations,
)
from difftest.records.finding import Finding
from difftest.rules.engine_releases import flag_readers
from difftest.rules.weight_files import open_safetensors
from difftest.base.names import DRAFT_LOGITS, DRAFT_LOGITS_TARGET, EMBEDS

# The tensors of a Llama-style EAGLE-3 decoder layer (HF: `midlayer.`, speculators: `layers.0.`).
_LAYER_TENSORS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_LAYER_OPTIONAL = (
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.bias",
)
_LAYER_PREFIXES = ("midlayer.", "layers.0.")
# How many embedding rows are compared with the target's: enough that a random or retrained
# embedding cannot match by chance, few enough that a 150k x 7k table is never loaded whole.
_EMBED_ROWS = 64


def _engines_line(names: list[str]) -> tuple[str, ...]:
    return tuple(sorted(names))


@dataclass(frozen=True)
class FlagMisreading:
    """A flag the draft's config sets that one engine release runs with another value than training meant."""

    flag: str
    meant: object  # the trainer's value (what the reference reads)
    got: object  # what the engine runs the draft with (None: the flag's default, off)
    places: dict[str, object]  # where the config sets it, and the value there
    rules: EngineDraftRules
    speculators: bool  # a speculators-format config

    def place(self) -> str | None:
        """Where in this config the release reads the flag (the first such place); None where it reads it
        from no place this config has: no edit of the config gives it the flag."""
        rule = self.rules.flag(self.flag)
        # a speculators config's top level is the "speculators config" place, an HF config's the "top level"
        here = (EAGLE_CONFIG, SPECULATORS if self.speculators else TOP)
        return next((w for w in (rule.read_from if rule is not None else ()) if w in here), None)

    def patch(self) -> dict | None:
        """The JSON merge patch that writes the trained value where the release reads it (None: no place)."""
        place = self.place()
        if place is None:
            return None
        return {EAGLE_CONFIG: {self.flag: self.meant}} if place == EAGLE_CONFIG else {self.flag: self.meant}

    def cannot(self) -> str | None:
        """Why no config edit helps, in one clause; None where writing the flag elsewhere does."""
        if self.place() is not None:
            return None
        rules, rule = self.rules, self.rules.flag(self.flag)
        if rule is None or not rule.read_from:
            return (
                f"{rules.engine} {rules.version} cannot read {self.flag} ({self.meant!r} in the draft config) from "
                "any place in the draft config, so no config edit makes it run the draft as trained"
            )
        return (
            f"{rules.engine} {rules.version} reads {self.flag} only from {' or '.join(rule.read_from)}, which a "
            "speculators-format config does not have"
        )

    def alternatives(self) -> list[str]:
        """What serves the draft as trained when no config edit does: the releases that read the flag (from
        the release rules, difftest.rules.engine_releases), or a draft trained without it."""
        rules, flag, rule = self.rules, self.flag, self.rules.flag(self.flag)
        if rule is not None and rule.read_from:  # a speculators config it cannot read the flag from
            return [
                "convert the draft to the HF EAGLE-3 layout (the flag at the top level)",
                f"or serve it with a {rules.engine} release that reads speculators configs",
            ]
        own = flag_readers(rules.engine, flag)
        others = [r for e in ENGINES if e != rules.engine for r in flag_readers(e, flag)]
        if own:
            serve = f"serve the draft with a release that reads it: {'; '.join(r.words() for r in own + others)}"
        else:
            serve = f"no {rules.engine} release on record reads it" + (
                f"; serve the draft with {'; '.join(r.words() for r in others)}" if others else ""
            )
        return [serve, f"or train the draft without {flag}"]

    def remedy(self) -> str:
        """What the user can do, in one clause (the Fix: of the finding)."""
        cannot = self.cannot()
        if cannot is None:
            return (
                f"write {self.flag}: {self.meant!r} where {self.rules.engine} {self.rules.version} reads it "
                f"({self.place()}), or train the draft without it"
            )
        rule = self.rules.flag(self.flag)
        if rule is not None and rule.read_from:
            return ", ".join(self.alternatives())  # the finding's own words already say where it reads it
        return "; ".join([cannot, *self.alternatives()])


def flag_misreadings(raw: dict, engines: Iterable[EngineDraftRules] | None = None) -> list[FlagMisreading]:
    """Each flag the draft's config sets that an engine (default: each pinned release) runs otherwise than
    training meant: it never reads it, or reads it from another place."""
    out: list[FlagMisreading] = []
    located = flag_locations(raw)
    speculators = raw.get("speculators_model_type") is not None
    for flag, places in located.items():
        # The trainer's meaning: the reference reads every place a trainer may write (eagle_config first).
        meant = (
            next(iter(places.values())) if len(places) == 1 else places.get("eagle_config", next(iter(places.values())))
        )
        for rules in ENGINES.values() if engines is None else engines:
            if speculators and not rules.reads_speculators_format:
                continue  # format_findings says the engine cannot read the config at all
            got, _ = engine_reading(rules, flag, places)
            if bool(got) != bool(meant):
                out.append(FlagMisreading(flag, meant, got, places, rules, speculators))
    return out


def flag_findings(raw: dict, engines: Iterable[EngineDraftRules] | None = None) -> list[Finding]:
    """A flag the draft's config sets that an engine (default: each pinned release) never reads, or
    reads from another place."""
    out: list[Finding] = []
    for m in flag_misreadings(raw, engines):
        flag, meant, got, places, rules = m.flag, m.meant, m.got, m.places, m.rules
        rule = rules.flag(flag)
        how = (
            "never reads it"
            if rule is None or not rule.read_from
            else f"reads it only from {' or '.join(rule.read_from)}"
        )
        cite = rule.source if rule is not None else "(not in its draft class)"
        where_set = " and ".join(f"{w}" for w in places)
        weights = FLAG_WEIGHTS.get(flag, ()) if meant and not got else ()
        load = rules.unexpected_weights
        if weights and load.refuses:
            # the draft's weights for the flag have no parameter to go to: a refusal, not a divergence
            what = (
                f"it builds the draft without {flag}, and the checkpoint's {' / '.join(w + '*' for w in weights)} "
                f"weights are {load.unexpected} ({load.source})"
            )
        else:
            what = f"it runs the draft with {flag}={bool(got)}; the first tensor that differs is {FLAG_TENSORS[flag]}"
        fix = m.remedy()
        out.append(
            Finding(
                "flag-ignored",
                "error",
                f"{flag}: {meant!r} in the draft config ({where_set}), but {rules.engine} {rules.version} {how} "
                f"({cite}): {what}. Fix: {fix}",
                engines=(rules.engine,),
                tensor=FLAG_TENSORS[flag],
                weights=weights,
            )
        )
    return out


def format_findings(raw: dict) -> list[Finding]:
    if raw.get("speculators_model_type") is None:
        return []
    cannot = [r for r in ENGINES.values() if not r.reads_speculators_format]
    return (
        [
            Finding(
                "checkpoint-format",
                "warning",
                f"speculators-format config (speculators_model_type {raw['speculators_model_type']!r}): "
                f"{', '.join(f'{r.engine} {r.version}' for r in cannot)} does not read this format (no speculators_model_type "
                "handling): convert the draft to the HF EAGLE-3 layout (midlayer.*, flags at the top level) for it",
                engines=_engines_line([r.engine for r in cannot]),
            )
        ]
        if cannot
        else []
    )


def weight_findings(meta: dict, raw: dict, layer: dict, draft_vocab: int, V: int) -> list[Finding]:
    """Missing and unexpected tensors against the Llama EAGLE-3 architecture (headers only)."""
    names = set(meta)
    prefix = next((p for p in _LAYER_PREFIXES if any(n.startswith(p) for n in names)), None)
    expected = {"fc.weight", "norm.weight"}
    if prefix is not None:
        expected |= {prefix + t for t in _LAYER_TENSORS}
    tied = bool(layer.get("tie_word_embeddings", False))
    if not tied:
        expected.add("lm_head.weight")
    if draft_vocab < V:
        expected.add("d2t")
    optional = {"embed_tokens.weight", "t2d", "input_norm.weight"}
    optional |= {f"{p}{t}" for p in _LAYER_PREFIXES for t in _LAYER_OPTIONAL}
    optional |= {n for n in names if n.startswith(("fc_norm.", "aux_norm_"))}
    out: list[Finding] = []
    if prefix is None:
        out.append(
            Finding(
                "draft-weights",
                "error",
                "no decoder layer tensors (midlayer.* or layers.0.*): engines leave the draft's layer at its random initialisation",
            )
        )
    missing = sorted(expected - names - {"d2t"})  # a missing d2t is the vocab-map rule's
    if "lm_head.weight" in missing:
        missing.remove("lm_head.weight")
        readings = "; ".join(
            f"{r.label} {r.version}: {r.lm_head.missing} ({r.lm_head.source})" for r in ENGINES.values()
        )
        out.append(
            Finding(
                "lm-head-missing",
                "error",
                f"no lm_head.weight in the draft checkpoint (draft vocab {draft_vocab}, tie_word_embeddings false): "
                f"{readings}. The draft's logits are not the ones it trained: save the draft's head",
                engines=SERVING,
                tensor=DRAFT_LOGITS,
            )
        )
    if missing:
        out.append(
            Finding(
                "draft-weights",
                "error",
                f"missing draft tensors {missing}: engines keep their random initialisation for them without a warning",
                tensor=None,
            )
        )
    unexpected = sorted(names - expected - optional)
    if unexpected:
        shown = unexpected[:6] + (["..."] if len(unexpected) > 6 else [])
        out.append(
            Finding(
                "draft-weights",
                "warning",
                f"unexpected tensors {shown} (not part of a one-layer Llama EAGLE-3 draft): engines ignore them; a "
                "converter that renamed weights leaves the real ones missing",
            )
        )
    return out


def _target_embedding_rows(target_dir: Path, rows: int):
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with open_safetensors(f) as h:
            for key in h.keys():
                if key.endswith("embed_tokens.weight"):
                    sl = h.get_slice(key)
                    return tuple(sl.get_shape()), sl[:rows]
    return None, None


def _same_at_coarser_dtype(a, b) -> bool:
    """A copy of the target's embedding saved in a coarser dtype is the same embedding: speculators 0.9.0
    saves every checkpoint in bfloat16 (train/checkpointer.py save_checkpoint, float_dtype=torch.bfloat16),
    so a float32 target's frozen embedding comes back rounded to bf16 (relative error up to 2^-9, above
    the 1e-3 rtol above)."""
    import torch  # torch takes seconds to import; the rules floor loads torch-free

    if a.dtype == b.dtype or not (a.is_floating_point() and b.is_floating_point()):
        return False
    coarse = max((a.dtype, b.dtype), key=lambda d: torch.finfo(d).eps)
    return torch.equal(a.to(coarse), b.to(coarse))


def embedding_findings(meta: dict, target_dir: Path) -> list[Finding]:
    """A draft that ships its own embedding: SGLang replaces it with the target's."""
    if "embed_tokens.weight" not in meta:
        return [
            Finding(
                "embedding-shared",
                "warning",
                "no embed_tokens.weight in the draft: every engine uses the target's embedding, right only if the draft "
                "was trained on the target's (frozen) embedding",
            )
        ]
    f, key, shape = meta["embed_tokens.weight"]
    t_shape, t_rows = _target_embedding_rows(target_dir, _EMBED_ROWS)
    if t_shape is None or tuple(t_shape) != tuple(shape):
        return []  # another width: SGLang keeps the draft's own (llama.py::set_embed), as vLLM does
    with open_safetensors(f) as h:
        d_rows = h.get_slice(key)[:_EMBED_ROWS]
    if d_rows.float().allclose(t_rows.float(), rtol=1e-3, atol=1e-6) or _same_at_coarser_dtype(d_rows, t_rows):
        return []
    swapping = [r for r in ENGINES.values() if r.embed_tokens.replaces_draft_weight]
    if not swapping:
        return []
    keeping = [r for r in ENGINES.values() if not r.embed_tokens.replaces_draft_weight]
    readings = "; ".join(
        [
            *(f"{r.label} {r.version}: {r.embed_tokens.present} ({r.embed_tokens.source})" for r in swapping),
            *(f"{r.label} {r.version}: {r.embed_tokens.present}" for r in keeping),
        ]
    )
    return [
        Finding(
            "embedding-substituted",
            "error",
            f"the draft ships its own embed_tokens.weight, different from the target's (first {_EMBED_ROWS} rows): "
            f"{readings}. The engines' drafts differ from draft.embeds on. Fix: train on the "
            "target's embedding, or serve with an engine that keeps the draft's",
            engines=tuple(r.engine for r in swapping),
            tensor=EMBEDS,
        )
    ]


def _rope(section: dict) -> tuple[float | None, dict | None, str]:
    """(theta, scaling, where) as transformers 5 resolves them: rope_parameters first."""
    params = section.get("rope_parameters")
    if isinstance(params, dict) and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        default = scaling.get("rope_type", "default") == "default"
        return params.get("rope_theta"), None if default else scaling, "rope_parameters"
    return section.get("rope_theta"), section.get("rope_scaling") or None, "rope_theta/rope_scaling"


# How a trainer builds the draft's rope: from the draft config it trains from (theta 10000 when the config
# names none), and from the target's config only when it generates the draft config itself (SpecForge 0.2.0).
_TRAINER_ROPE = (
    "SpecForge: specforge/modeling/draft/llama3_eagle.py::get_rope_config, getattr(config, 'rope_theta', 10000); "
    "the target's rope only when it writes the draft config itself, specforge/training/model_loading.py::"
    "_generate_draft_config"
)


def rope_findings(layer: dict, tcfg: dict, speculators: bool) -> list[Finding]:
    out: list[Finding] = []
    where = "transformer_layer_config" if speculators else "config"
    params = layer.get("rope_parameters")
    top = layer.get("rope_theta")
    if (
        isinstance(params, dict)
        and params.get("rope_theta") is not None
        and top is not None
        and float(top) != float(params["rope_theta"])
    ):
        out.append(
            Finding(
                "rope-conflict",
                "error",
                f"draft {where}: rope_theta {top} but rope_parameters.rope_theta {params['rope_theta']}: transformers 5 "
                f"({', '.join(f'{r.label} {r.version}' for r in ENGINES.values())}) use rope_parameters, older readers "
                "rope_theta: the draft's attention differs (draft.layer0.attn_out). Fix: keep one value",
                engines=SERVING,
                tensor="draft.layer0.attn_out",
            )
        )
    theta, scaling, _ = _rope(layer)
    t_theta, t_scaling, _ = _rope(tcfg)
    if theta is None and scaling is None:
        if t_theta is not None and float(t_theta) != 10000.0 or t_scaling:
            # a warning: the draft's rope as served is the one a trainer reading this config trained with;
            # only a converter that dropped another rope makes it differ, which the config cannot tell
            out.append(
                Finding(
                    "rope-dropped",
                    "warning",
                    f"the draft {where} has no rope_theta / rope_parameters: engines use theta 10000 with no scaling, "
                    f"and so does a trainer that trains from this config ({_TRAINER_ROPE}); the target uses theta "
                    f"{t_theta} scaling {t_scaling}. Right if the draft was trained from this config (SpecForge's "
                    "published DeepSeek-V3 config is, by its example scripts' --draft-model-config); wrong if a "
                    "converter dropped the rope it was trained with (transformers writes a saved config's rope "
                    "always): then write that rope back. Else the draft's attention differs (draft.layer0.attn_out)",
                    engines=SERVING,
                    tensor="draft.layer0.attn_out",
                )
            )
    elif (theta is not None and t_theta is not None and float(theta) != float(t_theta)) or (scaling or None) != (
        t_scaling or None
    ):
        out.append(
            Finding(
                "rope-differs",
                "warning",
                f"draft rope theta {theta} scaling {scaling}; target theta {t_theta} scaling {t_scaling}: engines give the "
                "draft its own rope, trainers usually the target's; an engine that shares the target's cos/sin cache "
                "changes the draft's attention",
            )
        )
    return out


def d2t_convention_findings(d2t, t2d, V: int) -> list[Finding] | None:
    """d2t stored as absolute target ids instead of offsets; None when the map reads as offsets.

    Both engines add: target id = draft id + d2t[draft id]. A map of absolute ids is recognised
    by t2d (True exactly at the stored ids), else by offsets leaving the vocabulary while the
    stored values are valid, distinct target ids.
    """
    import torch  # torch takes seconds to import; the rules floor loads torch-free

    idx = torch.arange(d2t.numel())
    as_offsets, as_absolute = idx + d2t, d2t
    valid = lambda t: bool(((t >= 0) & (t < V)).all()) and t.unique().numel() == t.numel()  # noqa: E731
    if t2d is not None and t2d.numel() == V:
        hot = t2d.nonzero().flatten()
        if hot.numel() == d2t.numel() and valid(as_offsets) and torch.equal(as_offsets.sort().values, hot):
            return None
        if hot.numel() == d2t.numel() and valid(as_absolute) and torch.equal(as_absolute.sort().values, hot):
            return [_absolute(d2t)]
        return None
    if not valid(as_offsets) and valid(as_absolute) and bool((d2t[1:] > d2t[:-1]).all()):
        return [_absolute(d2t)]
    return None


def _absolute(d2t) -> Finding:
    return Finding(
        "d2t-convention",
        "error",
        f"d2t holds absolute target ids (d2t[:4] = {d2t[:4].tolist()}), not offsets: vLLM and SGLang compute target id = "
        "draft id + d2t[draft id], so every drafted token maps to the wrong target token (draft.logits_target). "
        "Fix: store d2t - arange(draft_vocab)",
        engines=SERVING,
        tensor=DRAFT_LOGITS_TARGET,
    )


def config_key_findings(raw: dict, layer: dict, engines: Iterable[EngineDraftRules] | None = None) -> list[Finding]:
    """A draft-config key an engine's draft class reads unguarded, absent (difftest.rules.draft_rules.ConfigKeyRule):
    that engine does not start."""
    speculators = raw.get("speculators_model_type") is not None
    out = []
    for rules in engines or ENGINES.values():
        if speculators and not rules.reads_speculators_format:
            continue  # it cannot read the format at all (checkpoint-format says so)
        for rule in rules.config_keys:
            if rule.key in raw or rule.key in layer or rule.unless and (raw.get(rule.unless) or layer.get(rule.unless)):
                continue
            out.append(
                Finding(
                    "draft-config-key",
                    "error",
                    f"no {rule.key} in the draft config: {rules.label} {rules.version} {rule.fails} ({rule.source}). "
                    f"Fix: {rule.fix}",
                    engines=(rules.engine,),
                )
            )
    return out


def _setting(settings: dict, path: tuple[str, ...]) -> int | None:
    value: object = settings
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def position_findings(
    layer: dict,
    tcfg: dict,
    settings: dict | None = None,
    positions: int | None = None,
    engines: Iterable[EngineDraftRules] | None = None,
) -> list[Finding]:
    """A draft whose max_position_embeddings is below the target's context length, or below the positions the
    case runs (`positions`: its longest prompt plus the tokens generated and drafted after it): each engine's
    reading (difftest.rules.draft_rules.PositionRule); an error when one of them does not start.
    `settings`: the case's `engines:` section."""
    draft_max = layer.get("max_position_embeddings")
    if not isinstance(draft_max, int) or isinstance(draft_max, bool):
        return []
    refused, served = [], []
    for rules in engines or ENGINES.values():
        rule = rules.positions
        if rule is None:
            continue
        own = context_length(layer, rule)
        held_to = _setting((settings or {}).get(rules.engine) or {}, rule.context_setting) or context_length(tcfg, rule)
        if own is None or held_to is None or own >= held_to:
            continue
        words = f"{rules.label} {rules.version} {rule.shorter} ({rule.source})"
        derived = f", a context length of {own} as it derives it" if own != draft_max else ""
        if rule.refuses:
            refused.append((rules, f"{words}{derived}; it holds the draft to {held_to}"))
        else:
            served.append((rules, f"{words}{derived}"))
    beyond = positions is not None and positions > draft_max
    if not refused and not served and not beyond:
        return []
    target_max = tcfg.get("max_position_embeddings")
    head = f"the draft config's max_position_embeddings is {draft_max}" + (
        f", below the target's {target_max}" if isinstance(target_max, int) and target_max > draft_max else ""
    )
    if beyond:
        head += (
            f"; the case runs positions up to {positions} (its longest prompt, the tokens generated and the "
            "draft steps): the reference's rope computes any position, but the draft was likely never trained there"
        )
    readings = "; ".join(w for _, w in refused + served)
    fix = (
        f"write max_position_embeddings = {target_max} (the target's) in the draft config"
        if isinstance(target_max, int) and target_max > draft_max
        else "write the target's max_position_embeddings in the draft config"
    )
    return [
        Finding(
            "draft-positions",
            "error" if refused else "warning",
            head + (f": {readings}" if readings else "") + (f". Fix: {fix}" if refused else ""),
            engines=tuple(sorted(r.engine for r, _ in refused)),
        )
    ]
