"""Cases: one YAML file each, validated into a plain dataclass.

    name: tiny-llama                     # default: the file's stem
    description: ...
    target: fixture:tiny-llama           # a built-in fixture or a path (relative to the YAML file)
    draft: fixture:tiny-llama-eagle3
    dtype: float32                       # float32 | bfloat16 | float16 (difftest.base.dtypes)
    wiring: vllm                         # what the draft was trained on: preset or [h0, h3, h31]
    layer_ids: [2, 4, 5]                 # optional: override the draft config's ids
    prompts: ["text ...", {ids: [1, 2, 3]}]
    speculative: {num_steps: 4, max_new_tokens: 32, prompts: [...]}   # prompts default to `prompts`
    engines: {ref: {}, vllm: {enforce_eager: true}}                   # per-engine settings (difftest.base.settings)
    tolerances: {"draft.logits*": {atol: 1e-4, rtol: 1e-4}}
    expect: {top1_agreement: 0.99, accept_length: {atol: 0.25, rtol: 0.1}}
    allow_missing: ["draft.layer0.*"]    # tensors an engine may not capture
    precision: {vllm: tf32}              # a float32 case an engine serves with TF32 (or bf16) matmuls

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

from difftest.base.content_digest import signature  # files by content: size and mtime can stay put
from difftest.base.dtypes import DType
from difftest.base.errors import CaseNotConfigured, ConfigError
from difftest.base.settings import Place, read, refuse_unknown
from difftest.base.yamlfile import load_yaml
from difftest.case.case_schema import CASE
from difftest.case.expected_failure import ExpectedFailure
from difftest.case.prompt import Prompt
from difftest.records.tolerance import Expectations, TolerancePair
from difftest.rules.wiring import DEFAULT_PRESET


@dataclass
class Case:
    name: str
    path: str  # the YAML file
    target: str  # "fixture:NAME" or an absolute path
    draft: str
    dtype: DType = DType.FLOAT32
    wiring: str | list[str] = DEFAULT_PRESET
    layer_ids: list[int] | None = None
    prompts: list[Prompt] = field(default_factory=list)
    num_steps: int = 4
    max_new_tokens: int = 32
    spec_prompts: list[Prompt] = field(default_factory=list)
    engines: dict[str, dict] = field(default_factory=dict)
    tolerances: dict[str, TolerancePair] = field(default_factory=dict)  # tensor pattern -> its tolerance
    expect: Expectations = field(default_factory=Expectations)
    allow_missing: list[str] = field(default_factory=list)
    description: str = ""
    expect_failure: list[ExpectedFailure] = field(default_factory=list)
    # engine name or spec id -> the matmul format it serves a float32 case in (difftest.base.dtypes
    # MATMUL_PRECISIONS): that engine is judged against the floor of that precision (difftest.run.case_run)
    precision: dict[str, str] = field(default_factory=dict)
    # Not a YAML field: set on the float64 calibration run of a half-precision case
    # (difftest.run.session.calibration_case). The engines load the checkpoint in the case's dtype, so
    # they all compute with its weights rounded to it; the exact run computes that same model.
    weights_dtype: DType | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        d = dict(d)
        d["prompts"] = [Prompt(**p) for p in d.get("prompts", [])]
        d["spec_prompts"] = [Prompt(**p) for p in d.get("spec_prompts", [])]
        d["expect_failure"] = [ExpectedFailure(**e) for e in d.get("expect_failure", [])]
        d["tolerances"] = {p: TolerancePair.from_dict(t) for p, t in (d.get("tolerances") or {}).items()}
        d["expect"] = Expectations.from_dict(d.get("expect") or {})
        for key in ("dtype", "weights_dtype"):  # JSON (the worker protocol) carries the names
            if d.get(key) is not None:
                d[key] = DType(d[key])
        return cls(**d)

    def engine_settings(self, engine_name: str) -> dict:
        return dict(self.engines.get(engine_name) or {})

    def fingerprint(self) -> str:
        """Changes whenever anything that affects a capture changes, checkpoint files included."""
        parts = self.to_dict()
        for judged_only in ("name", "path", "description", "tolerances", "expect", "allow_missing", "expect_failure"):
            parts.pop(judged_only)
        parts.pop("precision")  # judged only
        if parts["weights_dtype"] is None:  # the weights as stored: keys as before the field existed
            parts.pop("weights_dtype")
        parts["files"] = {role: _files_signature(p) for role, p in (("target", self.target), ("draft", self.draft))}
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _files_signature(path: str) -> list:

    return signature(path)


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand_mapping(raw: dict, path: Path) -> dict:
    """The case's top-level mapping with ${VAR} expanded (a mapping stays a mapping)."""
    return {k: _expand(v, path, str(k)) for k, v in raw.items()}


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


def expand_vars(value: str, path: Path, where: str) -> str:
    """`value` with ${VAR} and ${VAR:-default} expanded as load_case expands the case at `path` (an unset
    variable: CaseNotConfigured naming `where`). For a command that rewrites a case and keeps what the
    user wrote, but needs to know what it means here (difftest fix)."""
    out = _expand(value, path, where)
    assert isinstance(out, str)
    return out


def load_case(path: str | Path) -> Case:
    """Read the YAML, expand ${VARS}, read it through the case schema (difftest.case.case_schema.CASE)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    raw = load_yaml(path, text)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    place = Place(str(path))
    refuse_unknown(CASE, raw, place)  # before ${VARS}: a misspelt field is an error even where one is unset
    v = read(CASE, _expand_mapping(raw, path), place)
    assert isinstance(v, dict)  # CASE builds no record: the case flattens `speculative`
    spec = v["speculative"]
    return Case(
        name=v["name"] or path.stem,
        path=str(path),
        target=v["target"],
        draft=v["draft"],
        dtype=v["dtype"],
        wiring=v["wiring"],
        layer_ids=v["layer_ids"],
        prompts=v["prompts"],
        num_steps=spec["num_steps"],
        max_new_tokens=spec["max_new_tokens"],
        spec_prompts=spec["prompts"],
        engines=v["engines"],
        tolerances=v["tolerances"],
        expect=v["expect"],
        allow_missing=v["allow_missing"],
        description=v["description"],
        expect_failure=v["expect_failure"],
        precision=v["precision"],
    )
