"""Cases: one YAML file each, validated into a plain dataclass.

    name: tiny-llama                     # default: the file's stem
    description: ...
    target: fixture:tiny-llama           # a built-in fixture or a path (relative to the YAML file)
    draft: fixture:tiny-llama-eagle3
    dtype: float32                       # float32 | bfloat16 | float16
    wiring: vllm                         # what the draft was trained on: preset or [h0, h3, h31]
    layer_ids: [2, 4, 5]                 # optional: override the draft config's ids
    prompts: ["text ...", {ids: [1, 2, 3]}]
    speculative: {num_steps: 4, max_new_tokens: 32, prompts: [...]}   # prompts default to `prompts`
    engines: {ref: {}, vllm: {enforce_eager: true}}                   # per-engine settings
    tolerances: {"draft.logits*": {atol: 1e-4, rtol: 1e-4}}
    expect: {top1_agreement: 0.99, accept_length: {atol: 0.25, rtol: 0.1}}
    allow_missing: ["draft.layer0.*"]    # tensors an engine may not capture

Any string may name environment variables, `${VAR}` or `${VAR:-default}`: a case for a model
that lives elsewhere (`target: ${KIMI_TARGET}`) skips, naming the variable, where it is unset.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from difftest.check_names import ALL_CHECKS
from difftest.errors import CaseNotConfigured, ConfigError
from difftest.expected_failure import ExpectedFailure
from difftest.expected_failure import parse as parse_expected

DTYPES = ("float32", "bfloat16", "float16")
KNOWN_KEYS = {
    "name", "description", "target", "draft", "dtype", "wiring", "layer_ids", "prompts",
    "speculative", "engines", "tolerances", "expect", "allow_missing", "expect_failure",
}  # fmt: skip


@dataclass
class Prompt:
    text: str | None = None
    ids: list[int] | None = None


@dataclass
class Case:
    name: str
    path: str  # the YAML file
    target: str  # "fixture:NAME" or an absolute path
    draft: str
    dtype: str = "float32"
    wiring: str | list[str] = "vllm"
    layer_ids: list[int] | None = None
    prompts: list[Prompt] = field(default_factory=list)
    num_steps: int = 4
    max_new_tokens: int = 32
    spec_prompts: list[Prompt] = field(default_factory=list)
    engines: dict[str, dict] = field(default_factory=dict)
    tolerances: dict[str, dict] = field(default_factory=dict)
    expect: dict = field(default_factory=dict)
    allow_missing: list[str] = field(default_factory=list)
    description: str = ""
    expect_failure: list[ExpectedFailure] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        d = dict(d)
        d["prompts"] = [Prompt(**p) for p in d.get("prompts", [])]
        d["spec_prompts"] = [Prompt(**p) for p in d.get("spec_prompts", [])]
        d["expect_failure"] = [ExpectedFailure(**e) for e in d.get("expect_failure", [])]
        return cls(**d)

    def engine_settings(self, engine_name: str) -> dict:
        return dict(self.engines.get(engine_name) or {})

    def fingerprint(self) -> str:
        """Changes whenever anything that affects a capture changes, checkpoint files included."""
        parts = self.to_dict()
        for judged_only in ("name", "path", "description", "tolerances", "expect", "allow_missing", "expect_failure"):
            parts.pop(judged_only)
        parts["files"] = {role: _files_signature(p) for role, p in (("target", self.target), ("draft", self.draft))}
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _files_signature(path: str) -> list:
    p = Path(path)
    if not p.is_dir():
        return [path]
    return sorted((f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in p.iterdir() if f.is_file())


def _err(path: Path, field_name: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {field_name}: {msg}")


def _prompt(value: object, path: Path, where: str) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise _err(path, where, "empty prompt")
        return Prompt(text=value)
    if isinstance(value, dict) and isinstance(value.get("ids"), list):
        ids = value["ids"]
        if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise _err(path, where, "ids must be a non-empty list of non-negative integers")
        return Prompt(ids=list(ids))
    raise _err(path, where, f"expected a string or {{ids: [...]}}, got {value!r}")


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand(value: object, path: Path, where: str) -> object:
    """${VAR} and ${VAR:-default} in every string of the raw case, recursively."""
    if isinstance(value, dict):
        return {k: _expand(v, path, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, path, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if name in os.environ and os.environ[name] != "":
            return os.environ[name]
        if default is not None:
            return default
        raise CaseNotConfigured(f"{path}: {where} needs ${{{name}}}, which is not set here")

    return _VAR.sub(sub, value)


def _model_ref(value: object, path: Path, field_name: str) -> str:
    if not isinstance(value, str) or not value:
        raise _err(path, field_name, "expected a fixture name (fixture:NAME) or a checkpoint path")
    if value.startswith("fixture:"):
        return value
    p = Path(value)
    if not p.is_absolute():
        p = (path.parent / p).resolve()
    if not (p / "config.json").exists():
        raise _err(path, field_name, f"checkpoint {p} not found (no config.json)")
    return str(p)


def load_case(path: str | Path) -> Case:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: malformed YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise _err(path, unknown[0], f"unknown field (known: {', '.join(sorted(KNOWN_KEYS))})")
    raw = _expand(raw, path, "")
    for required in ("target", "draft", "prompts"):
        if required not in raw:
            raise _err(path, required, "required field missing")
    dtype = raw.get("dtype", "float32")
    if dtype not in DTYPES:
        raise _err(path, "dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    prompts = raw["prompts"]
    if not isinstance(prompts, list) or not prompts:
        raise _err(path, "prompts", "expected a non-empty list")
    spec = raw.get("speculative") or {}
    if not isinstance(spec, dict):
        raise _err(path, "speculative", "expected a mapping")
    for key in ("num_steps", "max_new_tokens"):
        if key in spec and (not isinstance(spec[key], int) or spec[key] < 1):
            raise _err(path, f"speculative.{key}", f"expected a positive integer, got {spec[key]!r}")
    wiring = raw.get("wiring", "vllm")
    if not isinstance(wiring, (str, list)):
        raise _err(path, "wiring", "expected a preset name or a list like [h0, h3, h31]")
    layer_ids = raw.get("layer_ids")
    if layer_ids is not None and (not isinstance(layer_ids, list) or not all(isinstance(i, int) for i in layer_ids)):
        raise _err(path, "layer_ids", "expected a list of integers")
    for key in ("engines", "tolerances", "expect"):
        if not isinstance(raw.get(key) or {}, dict):
            raise _err(path, key, "expected a mapping")
    for pattern, tol in (raw.get("tolerances") or {}).items():
        if not isinstance(tol, dict) or not set(tol) <= {"atol", "rtol"} or not tol:
            raise _err(path, f"tolerances.{pattern}", "expected {atol: X, rtol: Y}")
        if "rtol" in tol and "atol" not in tol:
            # as torch.testing: rtol alone is ambiguous near zero
            raise _err(path, f"tolerances.{pattern}", "rtol given without atol; set both")
        for key, value in tol.items():
            try:  # YAML 1.1 reads 1e-3 (no dot) as a string; anything float() takes is fine
                tol[key] = float(value)
            except (TypeError, ValueError):
                raise _err(path, f"tolerances.{pattern}.{key}", f"expected a number, got {value!r}") from None
    return Case(
        name=str(raw.get("name") or path.stem),
        path=str(path),
        target=_model_ref(raw["target"], path, "target"),
        draft=_model_ref(raw["draft"], path, "draft"),
        dtype=dtype,
        wiring=wiring,
        layer_ids=layer_ids,
        prompts=[_prompt(p, path, f"prompts[{i}]") for i, p in enumerate(prompts)],
        num_steps=int(spec.get("num_steps", 4)),
        max_new_tokens=int(spec.get("max_new_tokens", 32)),
        spec_prompts=[_prompt(p, path, f"speculative.prompts[{i}]") for i, p in enumerate(spec.get("prompts") or [])],
        engines={k: dict(v or {}) for k, v in (raw.get("engines") or {}).items()},
        tolerances=dict(raw.get("tolerances") or {}),
        expect=dict(raw.get("expect") or {}),
        allow_missing=list(raw.get("allow_missing") or []),
        description=str(raw.get("description", "")),
        expect_failure=parse_expected(raw["expect_failure"], path, ALL_CHECKS) if "expect_failure" in raw else [],
    )
