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
                        trained on (error for vLLM's h[k] reading, warning for others); each engine
                        read on the code path the run takes (vLLM 0.32.0: Model Runner V2 unless
                        a spec names runner=v1), the other paths' readings listed as warnings
  norm-flag-default     norm_before_residual absent: its default differs by checkpoint
                        format (HF/EAGLE False, speculators True)
  vocab-map             d2t/t2d absent while draft vocab < target vocab, or inconsistent
                        (t2d.sum() != draft_vocab; arange + d2t out of range or not unique;
                        t2d not True exactly at arange + d2t)
  fc-width              fc in_features != number of ids x target hidden size
  sglang-topk           SGLang speculative_eagle_topk == 1 forces num_draft_tokens = num_steps + 1
  draft-tensor-unused   a draft tensor the reference draft never applies (q_norm, k_norm, a bias
                        attention_bias does not enable): an engine that applies it computes another draft

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
  draft-config-key      a key an engine's draft class reads unguarded is absent (SGLang: draft_vocab_size)
  draft-positions       max_position_embeddings below the target's context length (an engine that holds the
                        draft to it refuses to start) or below the positions the case runs (warning)

and, from difftest.rules.checkpoint_integrity (both checkpoints, headers only):

  checkpoint-index      an index naming a missing shard, or a tensor its shard lacks
  target-weights        a target tensor missing (untied head, embedding, a layer), layers past
                        num_hidden_layers, shapes that disagree with vocab_size / hidden_size
  checkpoint-dtype      stored dtype differs from the config's (warning)
  target-tied-head      tie_word_embeddings true while the target stores its own, different lm_head
  target-shape          a dense Llama-shaped target's decoder tensor shaped otherwise than its config says
  draft-tied-head       the draft config sets tie_word_embeddings while the draft stores its own lm_head
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from difftest.case.case import Case
from difftest.rules.checkpoint_integrity import stored_tensors, target_findings
from difftest.base.errors import ConfigError
from difftest.rules.draft_rules import CHAIN_BUDGETS
from difftest.rules.draft_rules import SERVING
from difftest.rules.wiring import hidden_indices, resolve, trained_layer_ids
from difftest.records.finding import Finding
from difftest.base.jsonfile import read_json_object
from difftest.rules.engine_releases import serving_layer_rules
from difftest.rules.lint_checkpoint import (
    config_key_findings,
    d2t_convention_findings,
    embedding_findings,
    flag_findings,
    format_findings,
    position_findings,
    rope_findings,
    weight_findings,
)
from difftest.rules.weight_files import open_safetensors
from difftest.base.names import DRAFT_LOGITS_TARGET, TARGET_LOGITS, hidden_name
from difftest.rules.layer_rules import (
    ID_PLACES,
    KEY,
    SPECFORGE,
    TOP,
    config_edit,
    default_layers,
    place_words,
    target_family,
    variant_siblings,
)

__all__ = [
    "Finding",
    "case_positions",
    "check_config_numbers",
    "lint_case",
    "lint_draft",
    "tied_draft_head_words",
    "tied_head_findings",
    "trained_wiring",
    "unused_tensor_words",
]


# The draft config's numbers: transformers refuses a target whose sizes are strings, and int("4")
# would let the reference run a config that another reader refuses or reads otherwise.
_INT_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "draft_vocab_size",
    "target_hidden_size",
    "num_aux_hidden_states",
    "num_hidden_layers",
)
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
# flags read with bool(): "false" would turn a flag on
_BOOL_FIELDS = (
    "tie_word_embeddings",
    "attention_bias",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "use_aux_norm",
    "norm_output",
)


def check_config_numbers(sections: list[tuple[dict, str]], where: str) -> None:
    """Refuse a number the config gives as a string (or a bool, or a float where a count belongs) and a
    flag given as anything but true or false, in one line naming the file, the key and the type
    expected. `sections`: (dict, its key prefix)."""
    # transformers 5 keeps rope_theta inside rope_parameters; eagle_config holds flags too
    inner = [
        (h[sub], f"{p}{sub}.")
        for h, p in sections
        for sub in ("rope_parameters", "eagle_config")
        if isinstance(h.get(sub), dict)
    ]
    for holder, prefix in [*sections, *inner]:
        for key in (*_INT_FIELDS, *_FLOAT_FIELDS, *_BOOL_FIELDS):
            value = holder.get(key)
            if value is None:  # absent or null: the default applies
                continue
            if key in _BOOL_FIELDS:
                ok, expected = isinstance(value, bool), "true or false"
            elif key in _INT_FIELDS:
                ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
            else:
                ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
            if not ok:
                got = f"{value!r} (a {'string' if isinstance(value, str) else type(value).__name__})"
                raise ConfigError(f"{where}: {prefix}{key}: expected {expected}, got {got}")


def tied_draft_head_words(head: str) -> str:
    """A draft config that ties its head while the checkpoint stores one (lint and ref alike)."""
    return (
        f"tie_word_embeddings is true, but the draft stores its own {head}: engines that tie as the config says "
        "serve the embedding as the draft's head, the reference the stored head; set tie_word_embeddings to false "
        "(or drop the stored head if the draft was trained tied)"
    )


def check_layer_ids(raw: dict, where: Path) -> None:
    """Refuse layer ids that are not a list of integers at any place an engine reads them from, in one
    line naming the key and the value (engines index layers with them: "1" is no layer id)."""
    for place in ID_PLACES:
        holder = raw if place == TOP else raw.get(place.partition(".")[0])
        key = place.partition(".")[2] if "." in place else KEY
        value = holder.get(key) if isinstance(holder, dict) else None
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(k, int) and not isinstance(k, bool) for k in value):
            raise ConfigError(f"{where}: {place_words(place)}: expected a list of integer layer ids, got {value!r}")


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
    draft_dir: str | Path,
    target_dir: str | Path,
    trained_on: list[str] | None = None,
    engines: dict | None = None,
    specs: Sequence[tuple[str, dict]] = (),
    positions: int | None = None,
) -> list[Finding]:
    """Findings for one draft/target pair; `trained_on` = the case's resolved training wiring, `engines` the
    case's `engines:` settings, `specs` the run's engine specs ((name, parameters): each engine is read on
    the code path its pinned release takes for a spec without parameters, and on each one a spec names),
    `positions` the longest sequence the case runs (None: not known)."""
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    # read in the words the reference engine's loaders use, so the lint and capture items fail alike
    raw = read_json_object(draft_dir / "config.json")
    _check_draft_config(raw, draft_dir / "config.json")
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
            for r in (rule.predict(raw, L, fc_chunks(draft_dir, H_t)) for rule in _serving_rules(tcfg, specs))
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
        for rule in _eagle_config_only_rules(tcfg, specs):
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
        out += _readings(list(ids), L, list(trained_on), tcfg, raw, fc_chunks(draft_dir, H_t), specs)
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
        out += _unused_by_reference(meta, layer)
        out += embedding_findings(meta, target_dir)
        out += rope_findings(layer, tcfg, speculators)
        out += config_key_findings(raw, layer)
    out += position_findings(layer, tcfg, engines, positions)
    if (raw.get("tie_word_embeddings") or layer.get("tie_word_embeddings")) and "lm_head.weight" in meta:
        head = meta["lm_head.weight"][1]
        out.append(
            Finding(
                "draft-tied-head",
                "error",
                f"{draft_dir / 'config.json'}: {tied_draft_head_words(head)}",
                tensor=DRAFT_LOGITS_TARGET,
            )
        )
    out += format_findings(raw)
    out += _chain_budget_findings(engines or {})
    # the checkpoints themselves: each holds what its config describes (difftest.rules.checkpoint_integrity)
    out += stored_tensors(draft_dir)[1]
    out += target_findings(target_dir)
    out += tied_head_findings(target_dir)
    out += target_shape_findings(target_dir)
    return out


# Tensors of the one-layer Llama EAGLE-3 layout that the reference draft never applies
# (difftest_engines/ref/eagle3.py: no q/k norm, no o_proj bias; q/k/v biases only with
# attention_bias). The lint's weight rules accept them as optional, since some architectures carry
# them (a Qwen3-style draft's q_norm/k_norm); an engine whose draft class applies them computes
# another draft than the reference judges every engine by.
_ALWAYS_UNUSED = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.o_proj.bias")
_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_LAYER_PREFIXES = ("midlayer.", "layers.0.")


def unused_tensor_words(name: str) -> str:
    """The one sentence for a draft tensor the reference draft does not apply (lint and ref alike)."""
    return f"draft tensor {name} is not used by the reference draft (engines that apply it compute another draft)"


def _unused_by_reference(meta: dict, layer: dict) -> list[Finding]:
    """An error, not a warning: the reference is what every engine is compared with, so a tensor it
    leaves out while an engine applies it makes every verdict about a draft nobody serves."""
    unused = _ALWAYS_UNUSED + (() if layer.get("attention_bias") else _BIASES)
    names = sorted(n for n in meta if n.startswith(_LAYER_PREFIXES) and n.split(".", 1)[1] in unused)
    return [Finding("draft-tensor-unused", "error", unused_tensor_words(n)) for n in names]


# rows of the head and the embedding compared: enough that a different head cannot agree by chance,
# few enough that a 150k-row table is never read whole
_HEAD_ROWS = 64


# The dense decoder layer of the Llama-shaped families, each tensor's shape from the config's sizes
# (transformers' LlamaAttention / LlamaMLP, and Qwen3's, which adds per-head q/k norms): a
# wrong-shaped tensor is otherwise refused by transformers in words that name none.
_DENSE_FAMILIES = ("llama", "qwen3", "qwen2", "mistral")


def _dense_layer_shapes(text: dict) -> dict[str, tuple[int, ...]] | None:
    try:
        H, nh = int(text["hidden_size"]), int(text["num_attention_heads"])
        nkv = int(text.get("num_key_value_heads") or nh)
        hd = int(text.get("head_dim") or H // nh)
        inter = int(text["intermediate_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return {
        "self_attn.q_proj.weight": (nh * hd, H),
        "self_attn.k_proj.weight": (nkv * hd, H),
        "self_attn.v_proj.weight": (nkv * hd, H),
        "self_attn.o_proj.weight": (H, nh * hd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
    }


def target_shape_findings(target_dir: str | Path) -> list[Finding]:
    """Decoder-layer tensors of a dense Llama-shaped target whose stored shape is not the config's."""
    target_dir = Path(target_dir)
    config = read_json_object(target_dir / "config.json", "target config")
    sub = config.get("text_config")
    text: dict = sub if isinstance(sub, dict) else config
    shapes = _dense_layer_shapes(text) if text.get("model_type") in _DENSE_FAMILIES else None
    if shapes is None:
        return []
    tensors, _ = stored_tensors(target_dir)
    out = []
    for name, t in sorted(tensors.items()):
        parts = name.split(".", 4)  # model.layers.K.<tensor>
        want = shapes.get(parts[3] + "." + parts[4]) if len(parts) == 5 and parts[:2] == ["model", "layers"] else None
        if want is not None and t.shape != want:
            out.append(
                Finding(
                    "target-shape",
                    "error",
                    f"{t.file}: {name} has shape {list(t.shape)}, expected {list(want)} (from "
                    f"{target_dir / 'config.json'}'s sizes): transformers refuses it without naming it",
                )
            )
    return out[:1] + (
        [Finding("target-shape", "error", f"{target_dir}: {len(out) - 1} more wrong-shaped tensors")]
        if len(out) > 1
        else []
    )


def tied_head_findings(target_dir: str | Path) -> list[Finding]:
    """A target whose config ties lm_head to the embedding but which stores a different lm_head.weight:
    transformers then keeps the stored head (it warns and does not tie), engines that tie as the config
    says serve the embedding as the head: two targets under one name."""
    target_dir = Path(target_dir)
    where = target_dir / "config.json"
    config = read_json_object(where, "target config")
    sub = config.get("text_config")
    text: dict = sub if isinstance(sub, dict) else config
    if not text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
        return []
    tensors, _ = stored_tensors(target_dir)
    head = next((t for k, t in tensors.items() if k == "lm_head.weight" or k.endswith(".lm_head.weight")), None)
    embed = next((t for k, t in tensors.items() if k.endswith("embed_tokens.weight")), None)
    if head is None or embed is None:
        return []
    if head.shape == embed.shape:
        rows = min(_HEAD_ROWS, head.shape[0])
        with open_safetensors(head.file) as h, open_safetensors(embed.file) as e:
            a, b = h.get_slice(head.name)[:rows], e.get_slice(embed.name)[:rows]
        if a.float().equal(b.float()):
            return []
    return [
        Finding(
            "target-tied-head",
            "error",
            f"{where}: tie_word_embeddings is true, but {head.name} differs from {embed.name} "
            f"({head.file.name}): transformers keeps the stored head, engines that tie as the config says serve "
            "the embedding as the head; set tie_word_embeddings to false, or drop lm_head.weight",
            tensor=TARGET_LOGITS,
        )
    ]


def _check_draft_config(raw: dict, where: Path) -> None:
    """The draft config's numbers and layer ids, refused in one line as the reference's loader refuses them."""
    layer = raw.get("transformer_layer_config")
    sections = [(raw, "")] + ([(layer, "transformer_layer_config.")] if isinstance(layer, dict) else [])
    check_config_numbers(sections, str(where))
    check_layer_ids(raw, where)


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


def _eagle_config_only_rules(tcfg: dict, specs: Sequence[tuple[str, dict]] = ()) -> list:
    """One rule per serving engine that reads layer ids from eagle_config only (difftest.rules.layer_rules)."""
    return list({r.engine: r for r in _serving_rules(tcfg, specs) if TOP not in r.ids_from}.values())


def _serving_rules(tcfg: dict, specs: Sequence[tuple[str, dict]] = ()) -> list:
    """The rules the run reads the draft by: each engine's pinned release on the code path its spec takes
    (difftest.rules.engine_releases.serving_layer_rules), the same rule the engine's own checks use."""
    return serving_layer_rules(target_family(tcfg), specs)


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
    ids: list[int],
    L: int,
    trained_on: list[str],
    tcfg: dict,
    raw: dict,
    chunks: int | None,
    specs: Sequence[tuple[str, dict]] = (),
) -> list[Finding]:
    """How each serving engine's layer-id rule (difftest.rules.layer_rules) reads the config, against the
    training wiring, with the edit that makes it feed what training fed; plus the readings of the code paths
    the run does not take (another runner of the same release) and the trainers' reading."""

    def short(names) -> str:
        return "[" + ", ".join(n.removeprefix("target.").replace("h.", "h") for n in names) + "]"

    def fix(rule) -> str:
        if layers is None:
            return ""
        edit = config_edit(raw, target_family(tcfg), rule.engine, layers, L, rule=rule)
        return (
            f"; fix: {edit.patch} (`difftest fix CASE --engines {rule.engine}` writes and verifies it)"
            if edit.possible
            else f"; no config fixes it: {edit.impossible}"
        )

    layers = hidden_indices(trained_on)
    out, others = [], []
    run = _serving_rules(tcfg, specs)
    said: set[tuple] = set()  # (engine, fed, refusal): one engine's code paths that read the ids alike, said once
    for rule in run:
        reading = rule.predict(raw, L, chunks)
        if (rule.engine, tuple(reading.fed), reading.refusal) in said:
            continue
        said.add((rule.engine, tuple(reading.fed), reading.refusal))
        if reading.fed_names() == list(trained_on) and reading.refusal is None:
            # the ids sit where it never reads and its defaults happen to feed training (ids only at the top level
            # for an engine that reads eagle_config only: layer-ids-<engine>-location says so already)
            if reading.ids is None and [p for p, _ in reading.unread if p != TOP]:
                others.append(
                    f"{reading.explain()}: what the draft was trained on only because its defaults are those layers"
                    + fix(rule)
                )
            continue
        text = f"{reading.explain()}; the draft was trained on {short(trained_on)}" + fix(rule)
        if rule.misreading == "error":  # difftest.rules.layer_rules: vLLM reads the ids as written
            out.append(Finding("layer-ids-training", "error", text))
        else:
            others.append(text)
    # the same release's other code paths (vLLM's other model runner), which this run does not take
    for rule in dict.fromkeys(s for r in run for s in variant_siblings(r) if s not in run):
        reading = rule.predict(raw, L, chunks)
        alike = (rule.engine, tuple(reading.fed), reading.refusal) in said
        if not alike and (reading.fed_names() != list(trained_on) or reading.refusal is not None):
            others.append(f"{reading.explain()} (a code path this run does not take)")
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
    _check_draft_config(raw, Path(case.draft) / "config.json")
    tcfg = read_json_object(Path(case.target) / "config.json", "target config")
    ids, source = trained_layer_ids(case.layer_ids, (raw.get("eagle_config") or {}).get(KEY), raw.get(KEY))
    try:
        where = Path(case.target) / "config.json"
        L = _size(_text_config(tcfg, where), "num_hidden_layers", where)
        return list(resolve(case.wiring, L, ids, ids_source=source).inputs)
    except ConfigError:
        return None


def case_positions(case: Case) -> int | None:
    """The longest sequence the case runs: a captured prompt, or a speculative prompt with the tokens generated
    and the draft steps proposed after it (None: no prompt given as ids; text prompts' lengths need the
    tokenizer, which the lint does not load)."""
    captured = [len(p.ids) for p in case.prompts if p.ids is not None]
    generated = [len(p.ids) + case.max_new_tokens + case.num_steps for p in case.spec_prompts or case.prompts if p.ids]
    return max(captured + generated) if captured + generated else None


def lint_case(case: Case, specs: Sequence[tuple[str, dict]] = ()) -> list[Finding]:
    """`case` with fixtures resolved (CaseRun.prepared); `specs` the run's engine specs (name, parameters)."""
    return lint_draft(case.draft, case.target, trained_wiring(case), case.engines, specs, case_positions(case))
