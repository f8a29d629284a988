"""Config lint: what an engine would silently do differently with this draft checkpoint.

Reads the draft's config.json and, without loading weights, the shapes and vocab maps
in its safetensors files; the target's config.json for its depth, width and vocab. No
engine is imported. Each finding is an error (an engine would wire or compute the draft
differently from training: the lint item fails) or a warning (fragile, listed in the
message of a passing item):

  layer-ids-missing     no eagle_aux_hidden_state_layer_ids: engines fall back to
                        h[2], h[L//2], h[L-3] (error unless training used exactly those)
  layer-ids-conflict    top-level ids differ from eagle_config's (engines read different ones)
  layer-ids-order       ids not sorted / duplicated: vLLM sorts and de-duplicates them
  layer-ids-training    the ids, read as engines read them, are not the layers the draft was
                        trained on (error for vLLM's h[k] reading, warning for others)
  norm-flag-default     norm_before_residual absent: its default differs by checkpoint
                        format (HF/EAGLE False, speculators True)
  vocab-map             d2t/t2d absent while draft vocab < target vocab, or inconsistent
                        (t2d.sum() != draft_vocab; arange + d2t out of range or not unique;
                        t2d not True exactly at arange + d2t)
  fc-width              fc in_features != number of ids x target hidden size
  sglang-topk           SGLang speculative_eagle_topk == 1 forces num_draft_tokens = num_steps + 1

and, from difftest.rules.lint_checkpoint (the engines' rules in difftest.rules.draft_rules):

  flag-ignored          an EAGLE-3(.1) flag (norm_before_fc, fc_norm / use_aux_norm,
                        norm_before_residual, norm_output) set where an engine does not read it
  checkpoint-format     a speculators-format config served by an engine that cannot read it
  lm-head-missing       no lm_head: vLLM borrows the target's, SGLang keeps a random head
  draft-weights         missing (error) or unexpected (warning) draft tensors
  embedding-substituted the draft's own embedding differs from the target's: SGLang replaces it
  embedding-shared      no embedding in the draft: engines use the target's (warning)
  rope-conflict / rope-dropped / rope-differs   the draft's rope as engines read it
  d2t-convention        d2t stored as absolute target ids instead of offsets

and, from difftest.rules.checkpoint_integrity (both checkpoints, headers only):

  checkpoint-index      an index naming a missing shard, or a tensor its shard lacks
  target-weights        a target tensor missing (untied head, embedding, a layer), layers past
                        num_hidden_layers, shapes that disagree with vocab_size / hidden_size
  checkpoint-dtype      stored dtype differs from the config's (warning)
"""

from __future__ import annotations

from pathlib import Path

from difftest.case.case import Case
from difftest.rules.checkpoint_integrity import stored_tensors, target_findings
from difftest.base.errors import ConfigError
from difftest.rules.draft_rules import CHAIN_BUDGETS
from difftest.rules.draft_rules import SERVING
from difftest.rules.wiring import hidden_indices, resolve, trained_layer_ids
from difftest.records.finding import Finding
from difftest.base.jsonfile import read_json_object
from difftest.rules.lint_checkpoint import (
    d2t_convention_findings,
    embedding_findings,
    flag_findings,
    format_findings,
    rope_findings,
    weight_findings,
)
from difftest.rules.weight_files import open_safetensors
from difftest.base.names import DRAFT_LOGITS_TARGET, hidden_name
from difftest.rules.layer_rules import ENGINE_RULES, KEY, SPECFORGE, TOP, config_edit, default_layers, target_family

__all__ = ["Finding", "lint_case", "lint_draft", "trained_wiring"]


def tensor_meta(model_dir: Path) -> dict[str, tuple]:
    """name -> shape for every tensor in the draft's safetensors files (headers only)."""
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open_safetensors(f) as h:
            for k in h.keys():
                out[k.removeprefix("model.")] = (f, k, tuple(h.get_slice(k).get_shape()))
    return out


def _load(meta: dict, name: str):
    f, key, _ = meta[name]
    with open_safetensors(f) as h:
        return h.get_tensor(key)


def lint_draft(
    draft_dir: str | Path, target_dir: str | Path, trained_on: list[str] | None = None, engines: dict | None = None
) -> list[Finding]:
    """Findings for one draft/target pair; `trained_on` = the case's resolved training wiring."""
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    # read in the words the reference engine's loaders use, so the lint and capture items fail alike
    raw = read_json_object(draft_dir / "config.json")
    tcfg = _text_config(read_json_object(target_dir / "config.json", "target config"), target_dir / "config.json")
    L, H_t, V = (_size(tcfg, k, target_dir / "config.json") for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    speculators = raw.get("speculators_model_type") is not None
    layer = raw.get("transformer_layer_config", raw) if speculators else raw
    out: list[Finding] = []

    ids_top = raw.get("eagle_aux_hidden_state_layer_ids")
    ids_ec = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids_ec or ids_top
    defaults = [hidden_name(k) for k in default_layers(L)]
    if ids is None:
        same = trained_on is not None and list(trained_on) == defaults
        # the fallback can be narrower than fc (L//2 == L-3 on small targets: de-duplicated to two layers)
        readings = [
            r.explain()
            for r in (rule.predict(raw, L, fc_chunks(draft_dir, H_t)) for rule in _serving_rules(tcfg))
            if r.refusal or r.unfused
        ]
        out.append(
            Finding(
                "layer-ids-missing",
                "warning" if same else "error",
                f"no eagle_aux_hidden_state_layer_ids: engines fall back to h[2], h[L//2], h[L-3] = "
                f"[h2, h{L // 2}, h{L - 3}] (L={L})"
                + (
                    ""
                    if same
                    else f", not what the draft was trained on ({', '.join(n.removeprefix('target.') for n in trained_on or [])})"
                )
                + "".join(f"; {r}" for r in readings),
            )
        )
    if ids_top is not None and ids_ec is not None and list(ids_top) != list(ids_ec):
        out.append(
            Finding(
                "layer-ids-conflict",
                "error",
                f"eagle_aux_hidden_state_layer_ids {ids_top} (top level) != {ids_ec} (eagle_config): "
                "engines reading one place or the other feed different layers",
            )
        )
    if ids is not None and list(ids) != sorted(set(ids)):
        out.append(
            Finding(
                "layer-ids-order",
                "error",
                f"layer ids {ids} are not sorted and unique: vLLM and SGLang both capture while walking the layers "
                f"and feed fc in layer order, each layer once ({sorted(set(ids))} before their index shift), so a "
                "draft trained on the listed order gets its fc chunks permuted or fewer (difftest.rules.layer_rules)",
            )
        )
    if ids_top is not None and ids_ec is None:
        for rule in _eagle_config_only_rules():
            out.append(
                Finding(
                    f"layer-ids-{rule.engine}-location",
                    "warning",
                    f"eagle_aux_hidden_state_layer_ids {ids_top} only at the top level: {rule.label} reads only "
                    "eagle_config.eagle_aux_hidden_state_layer_ids and silently falls back to its default layers; "
                    "write the ids in both places",
                )
            )
    if ids is not None and trained_on:
        out += _readings(list(ids), L, list(trained_on), tcfg, raw, fc_chunks(draft_dir, H_t))
    if _is_mla_draft(raw) and (raw.get("norm_before_residual") or layer.get("norm_before_residual")):
        out.append(
            Finding(
                "norm-flag-ignored",
                "warning",
                "norm_before_residual is true in an MLA draft: vLLM applies it, SGLang 0.5.23's kimi_k25_eagle3.py "
                "ignores it (the residual is the unnormed hidden state there): the engines' drafts differ",
            )
        )
    if "norm_before_residual" not in raw and "norm_before_residual" not in layer:
        fmt = "speculators" if speculators else "HF/EAGLE"
        out.append(
            Finding(
                "norm-flag-default",
                "warning",
                f"norm_before_residual absent: {fmt} format defaults it to {speculators}, the other format to "
                f"{not speculators}; converting the checkpoint flips the draft's residual silently: write it explicitly",
            )
        )

    meta = tensor_meta(draft_dir)
    draft_vocab = int(raw.get("draft_vocab_size") or layer.get("draft_vocab_size") or layer.get("vocab_size") or V)
    target_hidden = int(raw.get("target_hidden_size") or layer.get("target_hidden_size") or H_t)
    n_ids = len(ids) if ids is not None else 3
    if "fc.weight" in meta:
        in_features = meta["fc.weight"][2][1]
        if in_features != n_ids * H_t:
            out.append(
                Finding(
                    "fc-width",
                    "error",
                    f"fc in_features {in_features} != {n_ids} ids x target hidden size {H_t} = {n_ids * H_t}"
                    + (f" (draft config says target_hidden_size {target_hidden})" if target_hidden != H_t else ""),
                )
            )
    out += _vocab_findings(meta, draft_vocab, V)
    if not _is_mla_draft(raw):
        out += flag_findings(raw)
        out += weight_findings(meta, raw, layer, draft_vocab, V)
        out += embedding_findings(meta, target_dir)
        out += rope_findings(layer, tcfg, speculators)
    out += format_findings(raw)
    out += _chain_budget_findings(engines or {})
    # the checkpoints themselves: each holds what its config describes (difftest.rules.checkpoint_integrity)
    out += stored_tensors(draft_dir)[1]
    out += target_findings(target_dir)
    return out


def _text_config(config: dict, where: Path) -> dict:
    text = config.get("text_config", config)
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: text_config: expected a JSON object, got {type(text).__name__}")
    return text


def _size(config: dict, key: str, where: Path) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(
            f"{where}: {key}: expected a positive integer, got {value!r}"
            if key in config
            else f"{where}: {key} missing"
        )
    return value


def _is_mla_draft(raw: dict) -> bool:
    return any("Deepseek" in a or "DeepSeek" in a for a in raw.get("architectures") or []) or "kv_lora_rank" in raw


def _eagle_config_only_rules() -> list:
    """One rule per serving engine that reads layer ids from eagle_config only (difftest.rules.layer_rules)."""
    return list({r.engine: r for r in ENGINE_RULES.values() if TOP not in r.ids_from}.values())


def _serving_rules(tcfg: dict) -> list:
    fam = target_family(tcfg)
    return [r for (_, f), r in ENGINE_RULES.items() if f == fam]


def fc_chunks(draft_dir: Path, H: int) -> int | None:
    """How many H-wide chunks the draft's fc.weight takes (None: no fc.weight, another width, or an
    unreadable checkpoint, which the lint's other findings and the engines report)."""
    try:
        meta = tensor_meta(Path(draft_dir))
    except Exception:
        return None
    if "fc.weight" not in meta or meta["fc.weight"][2][1] % H:
        return None
    return meta["fc.weight"][2][1] // H


def _readings(
    ids: list[int], L: int, trained_on: list[str], tcfg: dict, raw: dict, chunks: int | None
) -> list[Finding]:
    """How each serving engine's layer-id rule (difftest.rules.layer_rules) reads the config, against the
    training wiring, with the edit that makes it feed what training fed; plus the trainers' reading."""

    def short(names) -> str:
        return "[" + ", ".join(n.removeprefix("target.").replace("h.", "h") for n in names) + "]"

    layers = hidden_indices(trained_on)
    out, others = [], []
    for rule in _serving_rules(tcfg):
        reading = rule.predict(raw, L, chunks)
        if reading.fed_names() == list(trained_on) and reading.refusal is None:
            continue
        text = f"{reading.explain()}; the draft was trained on {short(trained_on)}"
        if layers is not None:
            edit = config_edit(raw, target_family(tcfg), rule.engine, layers, L)
            text += (
                f"; fix: {edit.patch} (`difftest fix CASE --engines {rule.engine}` writes and verifies it)"
                if edit.possible
                else f"; no config fixes it: {edit.impossible}"
            )
        if rule.misreading == "error":  # difftest.rules.layer_rules: vLLM reads the ids as written
            out.append(Finding("layer-ids-training", "error", text))
        else:
            others.append(text)
    fed = SPECFORGE.predict_ids(ids, L).fed_names()
    if fed != list(trained_on):
        others.append(f"SpecForge's data generation reads them as {short(fed)}")
    if others:
        out.append(
            Finding(
                "layer-ids-training",
                "warning",
                f"trained on {short(trained_on)}; other engines read ids {ids} differently: {'; '.join(others)}",
            )
        )
    return out


def _vocab_findings(meta: dict, draft_vocab: int, V: int) -> list[Finding]:
    import torch  # torch takes seconds to import; the lint reads configs torch-free until a vocab map is stored

    has_d2t, has_t2d = "d2t" in meta, "t2d" in meta
    if draft_vocab >= V:
        return []
    if has_d2t and not has_t2d:
        convention = d2t_convention_findings(_load(meta, "d2t").long(), None, V)
        if convention:
            return convention
    if not has_d2t or not has_t2d:
        missing = " and ".join(n for n, has in (("d2t", has_d2t), ("t2d", has_t2d)) if not has)
        return [
            Finding(
                "vocab-map",
                "error" if not has_d2t else "warning",
                f"{missing} absent while draft vocab {draft_vocab} < target vocab {V}"
                + (
                    ": draft ids map to the first target ids (vLLM and SGLang read draft id i as target id i)"
                    if not has_d2t
                    else ""
                ),
                engines=SERVING if not has_d2t else (),
                tensor=DRAFT_LOGITS_TARGET if not has_d2t else None,
            )
        ]
    out = []
    d2t, t2d = _load(meta, "d2t").long(), _load(meta, "t2d").bool()
    convention = d2t_convention_findings(d2t, t2d, V)
    if convention:
        return convention
    targets = torch.arange(d2t.numel()) + d2t
    if d2t.numel() != draft_vocab:
        out.append(Finding("vocab-map", "error", f"d2t has {d2t.numel()} entries, draft vocab is {draft_vocab}"))
    if int(t2d.sum()) != draft_vocab:
        out.append(Finding("vocab-map", "error", f"t2d.sum() = {int(t2d.sum())} != draft vocab {draft_vocab}"))
    if bool((targets < 0).any()) or bool((targets >= V).any()):
        bad = int(((targets < 0) | (targets >= V)).sum())
        out.append(Finding("vocab-map", "error", f"arange + d2t leaves the target vocab [0, {V}) for {bad} draft ids"))
    elif targets.unique().numel() != targets.numel():
        out.append(
            Finding(
                "vocab-map",
                "error",
                f"arange + d2t maps {targets.numel() - targets.unique().numel()} draft ids onto taken target ids",
            )
        )
    elif t2d.numel() == V and not bool(t2d[targets].all()):
        out.append(
            Finding(
                "vocab-map",
                "error",
                "t2d is not True at arange + d2t: the two maps disagree (SGLang hot_token_id != arange + d2t)",
            )
        )
    return out


def _chain_budget_findings(engines: dict) -> list[Finding]:
    """A case's engine settings that the engine overrides for a chain (difftest.rules.draft_rules.CHAIN_BUDGETS)."""
    out = []
    for rule in CHAIN_BUDGETS:
        s = engines.get(rule.engine) or {}
        topk, steps, tokens = s.get(rule.topk), s.get(rule.num_steps), s.get(rule.num_draft_tokens)
        if topk == 1 and steps is not None and tokens is not None and int(tokens) != int(steps) + 1:
            out.append(
                Finding(
                    f"{rule.engine}-topk",
                    "warning",
                    f"engines.{rule.engine}: {rule.topk} == 1 forces num_draft_tokens = num_steps + 1 = {int(steps) + 1}; "
                    f"the configured {tokens} is silently ignored",
                )
            )
    return out


def trained_wiring(case: Case) -> list[str] | None:
    """The case's training wiring resolved against the target's depth and the draft's ids (as its
    config.json holds them: the lint loads no draft)."""
    raw = read_json_object(Path(case.draft) / "config.json")
    tcfg = read_json_object(Path(case.target) / "config.json", "target config")
    ids, source = trained_layer_ids(case.layer_ids, (raw.get("eagle_config") or {}).get(KEY), raw.get(KEY))
    try:
        where = Path(case.target) / "config.json"
        L = _size(_text_config(tcfg, where), "num_hidden_layers", where)
        return list(resolve(case.wiring, L, ids, ids_source=source).inputs)
    except ConfigError:
        return None


def lint_case(case: Case) -> list[Finding]:
    """`case` with fixtures resolved (CaseRun.prepared)."""
    return lint_draft(case.draft, case.target, trained_wiring(case), case.engines)
