"""Checkpoint integrity: does a checkpoint hold what its config describes, and nothing else?

The failure class the harness exists for starts here: a checkpoint an engine loads without an
error and then serves wrongly. A target without `lm_head.weight` or `embed_tokens` is loaded by
transformers, and by SGLang, with that tensor left at its initialisation; a config that says fewer
layers than the weights hold runs the shorter model; an index that names a missing shard is read
as far as it goes. This module reads only safetensors headers (8-byte length, JSON; no tensor data
and no torch), so it is cheap enough to run before any engine loads a checkpoint and in `lint`.

Checks, each a Finding naming the file, the tensor and the config field:
  checkpoint-file     a safetensors file that is truncated or not one (named, with its sizes)
  checkpoint-index    model.safetensors.index.json naming a shard that does not exist, or a tensor
                      its shard does not hold; a shard file the index does not name (warning)
  target-weights      a tensor every engine expects (embedding, final norm, untied head, each decoder
                      layer's attention and norms) missing; layers past num_hidden_layers present;
                      embedding/head/norm shapes that disagree with vocab_size/hidden_size
  checkpoint-dtype    stored floating dtype differs from the config's torch_dtype (warning: engines cast)
What each engine's loader does with a missing or unexpected target tensor comes from the rule
data (difftest.rules.draft_rules.TARGET_LOADING), cited to the engine's source.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from difftest.rules.draft_rules import TARGET_LOADING
from difftest.base.dtypes import DType
from difftest.base.errors import ConfigError
from difftest.records.finding import Finding
from difftest.base.names import TARGET_LOGITS

INDEX_NAME = "model.safetensors.index.json"
# A header larger than this is not a real one (safetensors itself caps it at 100 MB).
_MAX_HEADER = 100 << 20
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
_CONFIG_DTYPES: dict[str, str] = {
    DType.FLOAT32: "F32",
    DType.FLOAT16: "F16",
    DType.BFLOAT16: "BF16",
    DType.FLOAT64: "F64",
}
# Tensors every decoder layer of every supported family holds (Llama, Qwen3, DeepSeek-V3 with MLA
# included); the MLP differs between dense and MoE layers and is left to the loader's own report.
_LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' code: F32, BF16, I64, ...


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Every tensor a safetensors file declares, after checking the file holds the bytes its header
    says (a truncated download passes a glob and fails deep inside a loader otherwise)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path}: not a safetensors file ({size} bytes, shorter than its 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise ConfigError(f"{path}: truncated or not a safetensors file (a {n}-byte header in a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ConfigError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: not a safetensors file (its header is not a JSON object)")
    out: dict[str, StoredTensor] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, dtype, (_, stop) = tuple(int(d) for d in entry["shape"]), str(entry["dtype"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ConfigError(
                f"{path}: not a safetensors file (tensor {name!r} has no shape, dtype and offsets)"
            ) from None
        out[name] = StoredTensor(path, name, shape, dtype)
        end = max(end, int(stop))
    if 8 + n + end > size:
        raise ConfigError(
            f"{path}: truncated: its header describes {8 + n + end} bytes, the file holds {size}; "
            "download or save it again"
        )
    return out


def stored_tensors(model_dir: Path) -> tuple[dict[str, StoredTensor], list[Finding]]:
    """The checkpoint's tensors as a loader sees them: through the index when there is one (the
    shards it names, each holding what it says), else every *.safetensors file."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_NAME
    findings: list[Finding] = []
    files = sorted(model_dir.glob("*.safetensors"))
    weight_map: dict[str, str] | None = None
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{index_path}: not a safetensors index (a JSON object with a weight_map)") from None
        named = sorted(set(map(str, weight_map.values())))
        absent = [s for s in named if not (model_dir / s).is_file()]
        if absent:
            findings.append(
                Finding(
                    "checkpoint-index",
                    "error",
                    f"{index_path} names shard{'s' if len(absent) > 1 else ''} {', '.join(absent)}, which "
                    f"{'do' if len(absent) > 1 else 'does'} not exist: {sum(1 for s in weight_map.values() if s in absent)} "
                    "tensors are missing from the checkpoint",
                )
            )
        stray = [f.name for f in files if f.name not in named]
        if stray:
            findings.append(
                Finding(
                    "checkpoint-index",
                    "warning",
                    f"{index_path} does not name {', '.join(stray)}: loaders that follow the index never read it",
                )
            )
        files = [model_dir / s for s in named if s not in absent]
    tensors: dict[str, StoredTensor] = {}
    for f in files:
        tensors.update(read_header(f))
    if weight_map is not None:
        misplaced = sorted(
            k
            for k, s in weight_map.items()
            if (model_dir / s).is_file() and (k not in tensors or tensors[k].file.name != s)
        )
        if misplaced:
            findings.append(
                Finding(
                    "checkpoint-index",
                    "error",
                    f"{index_path}: {len(misplaced)} tensor(s) are not in the shard the index names, e.g. "
                    f"{misplaced[0]} (in {weight_map[misplaced[0]]}): loaders that follow the index miss them",
                )
            )
    return tensors, findings


def _engines_say(kind: str) -> str:
    return "; ".join(f"{r.engine} {r.version} {getattr(r, kind)} ({r.source})" for r in TARGET_LOADING.values())


def target_findings(target_dir: Path) -> list[Finding]:
    """Integrity findings for a target checkpoint (an HF causal LM) against its config.json."""
    target_dir = Path(target_dir)
    where = target_dir / "config.json"
    try:
        config = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: cannot read the target config ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(config).__name__}")
    sub = config.get("text_config")
    text: dict = sub if isinstance(sub, dict) else config
    tensors, out = stored_tensors(target_dir)
    if not tensors:
        return out  # no safetensors: a .bin checkpoint, read by its loader alone
    # a multimodal wrapper stores the language model under a prefix (model.language_model.*)
    prefix = next(
        (p for p in ("model.language_model.", "language_model.model.") if any(k.startswith(p) for k in tensors)),
        "model.",
    )
    names = {("model." + k[len(prefix) :] if k.startswith(prefix) else k): t for k, t in tensors.items()}
    L, V, H = (text.get(k) for k in ("num_hidden_layers", "vocab_size", "hidden_size"))
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    expected = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not tied:
        expected["lm_head.weight"] = (V, H)
    layers: dict[int, set[str]] = {}
    for name in names:
        m = _LAYER.match(name)
        if m:
            layers.setdefault(int(m.group(1)), set()).add(m.group(2))
    missing = [n for n in expected if n not in names]
    if isinstance(L, int):
        # the attention and norms every layer of the family holds (the union over its layers)
        attn = set().union(*layers.values()) if layers else set()
        common = {s for s in attn if s.startswith("self_attn.") or s in _LAYER_NORMS}
        for k in range(L):
            have = layers.get(k, set())
            if not have:
                missing.append(f"model.layers.{k}.*")
            else:
                missing += [f"model.layers.{k}.{s}" for s in sorted(common - have)]
        # DeepSeek checkpoints carry their multi-token-prediction layers after the last decoder layer
        nextn = int(text.get("num_nextn_predict_layers") or 0)
        extra = sorted(k for k in layers if k >= L + nextn)
        if extra:
            out.append(
                Finding(
                    "target-weights",
                    "error",
                    f"{where}: num_hidden_layers is {L}, but the weights hold layers up to {max(layers)} "
                    f"({len(extra)} layer(s) past the config: model.layers.{extra[0]}.*): transformers and "
                    f"SGLang run the first {L} and drop the rest without an error; {_engines_say('unexpected')}. "
                    "Fix num_hidden_layers or the weights",
                )
            )
    if missing:
        shown = missing[:4] + (["..."] if len(missing) > 4 else [])
        out.append(
            Finding(
                "target-weights",
                "error",
                f"{target_dir}: tensors missing from the target checkpoint: {', '.join(shown)} "
                f"(config: tie_word_embeddings {str(tied).lower()}, num_hidden_layers {L}): transformers "
                f"initialises them randomly; {_engines_say('missing')}",
                tensor="target.h.0"
                if "model.embed_tokens.weight" in missing
                else TARGET_LOGITS
                if "lm_head.weight" in missing
                else None,
            )
        )
    fields = {
        "model.embed_tokens.weight": ("vocab_size", "hidden_size"),
        "lm_head.weight": ("vocab_size", "hidden_size"),
        "model.norm.weight": ("hidden_size",),
    }
    for name, want in expected.items():
        got = names.get(name)
        if got is None or None in want or got.shape == want:
            continue
        says = ", ".join(f"{f} {v}" for f, v in zip(fields[name], want))
        out.append(
            Finding(
                "target-weights",
                "error",
                f"{got.file}: {name} has shape {list(got.shape)}, but {where.name} says {says}: fix the config "
                "field that disagrees with the weights",
            )
        )
    declared = _CONFIG_DTYPES.get(str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or ""))
    floats = sorted(
        {t.dtype for t in names.values() if t.dtype.startswith(("F", "BF")) and not t.dtype.startswith("F8")}
    )
    if declared and floats and floats != [declared]:
        out.append(
            Finding(
                "checkpoint-dtype",
                "warning",
                f"{target_dir}: weights stored as {', '.join(floats)}, config says {declared.lower()}: engines cast to "
                "the dtype they run in, so the values are the stored ones rounded",
            )
        )
    return out


def refuse_on_errors(findings: list[Finding], what: str) -> None:
    """One line for the first error (and how many more): a checkpoint with an integrity error is
    not loaded by the reference, which never runs a randomly initialised tensor."""
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        more = f" (and {len(errors) - 1} more: difftest lint lists them)" if len(errors) > 1 else ""
        raise ConfigError(f"{what}: {errors[0].message}{more}")
