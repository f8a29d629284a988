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
    engines: {ref: {}, vllm: {enforce_eager: true}}                   # per-engine settings (difftest.base.settings)
    tolerances: {"draft.logits*": {atol: 1e-4, rtol: 1e-4}}
    expect: {top1_agreement: 0.99, accept_length: {atol: 0.25, rtol: 0.1}}
    allow_missing: ["draft.layer0.*"]    # tensors an engine may not capture

Any string may name environment variables, `${VAR}` or `${VAR:-default}`: a case for a model
that lives elsewhere (`target: ${KIMI_TARGET}`) skips, naming the variable, where it is unset.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from difftest.base import check_registry
from difftest.base.errors import CaseNotConfigured, ConfigError
from difftest.base.registry import registered_engines
from difftest.case.expected_failure import ExpectedFailure
from difftest.case.expected_failure import parse as parse_expected
from difftest.base.names import NAME_FORMS, example_names, pattern_could_match
from difftest.base.settings import unknown_key
from difftest.rules.wiring import DEFAULT_PRESET
from difftest.base.yamlfile import load_yaml

DTYPES = ("float32", "bfloat16", "float16")
KNOWN_KEYS = {
    "name",
    "description",
    "target",
    "draft",
    "dtype",
    "wiring",
    "layer_ids",
    "prompts",
    "speculative",
    "engines",
    "tolerances",
    "expect",
    "allow_missing",
    "expect_failure",
}


@dataclass
class Prompt:
    text: str | None = None
    ids: list[int] | None = None
    # a chat request: rendered with the target's chat template as serving renders it (difftest.case.chat)
    messages: list[dict] | None = None
    chat_template_kwargs: dict | None = None


@dataclass
class Case:
    name: str
    path: str  # the YAML file
    target: str  # "fixture:NAME" or an absolute path
    draft: str
    dtype: str = "float32"
    wiring: str | list[str] = DEFAULT_PRESET
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
    # Not a YAML field: set on the float64 calibration run of a half-precision case
    # (difftest.run.session.calibration_case). The engines load the checkpoint in the case's dtype, so
    # they all compute with its weights rounded to it; the exact run computes that same model.
    weights_dtype: str | None = None

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
        if parts["weights_dtype"] is None:  # the weights as stored: keys as before the field existed
            parts.pop("weights_dtype")
        parts["files"] = {role: _files_signature(p) for role, p in (("target", self.target), ("draft", self.draft))}
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _files_signature(path: str) -> list:
    from difftest.base.content_digest import signature  # by content: size and mtime can stay put

    return signature(path)


def _err(path: Path, field_name: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {field_name}: {msg}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML's true is not 1


def _unknown(path: Path, where: str, keys, known) -> None:
    """Refuse the first key not in `known`, naming the closest known one."""
    for key in keys:
        if key not in known:
            raise unknown_key(f"{path}: {where}.{key}" if where else f"{path}: {key}", key, known, "field")


def _prompt(value: object, path: Path, where: str) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise _err(path, where, "empty prompt")
        return Prompt(text=value)
    if isinstance(value, dict) and "ids" in value:
        # ids are sent as they are; messages and their kwargs go through the chat template: with
        # both, one of them would be dropped without a word
        chat = next((k for k in ("messages", "chat_template_kwargs") if k in value), None)
        if chat is not None:
            raise _err(
                path,
                where,
                f"both ids and {chat} given; a prompt is either {{ids: [...]}} (sent as they are) "
                "or {messages: [...]} (rendered with the chat template)",
            )
    if isinstance(value, dict) and "ids" not in value and ("messages" in value or "chat_template_kwargs" in value):
        return _chat_prompt(value, path, where)
    if isinstance(value, dict):
        _unknown(path, where, value, {"ids", "messages", "chat_template_kwargs"})
        ids = value.get("ids")
        if not isinstance(ids, list) or not ids or not all(_is_int(i) and i >= 0 for i in ids):
            raise _err(path, f"{where}.ids", "expected a non-empty list of non-negative integers")
        return Prompt(ids=list(ids))
    raise _err(path, where, f"expected a string, {{ids: [...]}} or {{messages: [...]}}, got {_shown(value)}")


def _chat_prompt(value: dict, path: Path, where: str) -> Prompt:
    """{messages: [{role, content}, ...], chat_template_kwargs: {name: scalar}} (difftest.case.chat)."""
    from difftest.case.chat import ROLES

    _unknown(path, where, value, {"messages", "chat_template_kwargs"})
    messages = value.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _err(path, f"{where}.messages", "expected a non-empty list of {role, content}")
    for j, m in enumerate(messages):
        at = f"{where}.messages[{j}]"
        if not isinstance(m, dict):
            raise _err(path, at, f"expected a mapping {{role, content}}, got {_shown(m)}")
        _unknown(path, at, m, {"role", "content"})
        if m.get("role") not in ROLES:
            raise _err(path, f"{at}.role", f"expected one of {', '.join(ROLES)}, got {_shown(m.get('role'))}")
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            raise _err(path, f"{at}.content", "expected a non-empty string")
    kwargs = value.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise _err(path, f"{where}.chat_template_kwargs", f"expected a mapping, got {_shown(kwargs)}")
    for k, v in kwargs.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, (bool, int, float, str))):
            raise _err(path, f"{where}.chat_template_kwargs.{k}", f"expected a scalar, got {_shown(v)}")
    return Prompt(messages=[dict(m) for m in messages], chat_template_kwargs=dict(kwargs))


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _tolerance(value: object, path: Path, where: str) -> float:
    """A finite number >= 0 (YAML 1.1 reads 1e-3, without a dot, as a string: float() takes it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _err(path, where, f"expected a number, got {_shown(value)}")
    try:
        x = float(value)
    except ValueError:
        raise _err(path, where, f"expected a number, got {_shown(value)}") from None
    if not math.isfinite(x) or x < 0:
        raise _err(path, where, f"expected a finite number >= 0, got {_shown(value)}")
    return x


def _tolerance_pair(value: object, path: Path, where: str, required: bool) -> dict:
    """{atol: X, rtol: Y}: both finite and >= 0; with `required`, atol must be given when rtol is."""
    if not isinstance(value, dict) or not value:
        raise _err(path, where, f"expected {{atol: X, rtol: Y}}, got {_shown(value)}")
    _unknown(path, where, value, {"atol", "rtol"})
    if required and "rtol" in value and "atol" not in value:
        # as torch.testing: rtol alone is ambiguous near zero
        raise _err(path, where, "rtol given without atol; set both")
    return {k: _tolerance(v, path, f"{where}.{k}") for k, v in value.items()}


# expect: what the core's checks read (difftest.checks.checks); a check an engine contributes declares its
# own (difftest.base.check_registry.CheckSpec.expect, e.g. the train engine's train_accuracy: {atol, min})
EXPECT_KEYS = ("top1_agreement", "accept_length")


def contributed_expect() -> dict[str, tuple[str, ...]]:
    """`expect.<check>` -> the keys it may hold, for every check an installed engine contributes."""
    return {name: keys for name, keys in check_registry.contributed_expect().items() if name not in EXPECT_KEYS}


def expect_keys() -> tuple[str, ...]:
    """Every key a case's `expect:` may hold: the core's and those contributed checks declare."""
    return EXPECT_KEYS + tuple(contributed_expect())


def _tensor_pattern(pattern: str, path: Path, where: str, num_steps: int) -> str:
    """A `tolerances:` or `allow_missing:` pattern (an fnmatch glob over canonical names,
    difftest.base.names) that matches some tensor this case's captures can hold: one that matches none
    (draft.logitz, draft.layr0.*, draft.step4.* with 4 steps) would be ignored without a word."""
    if not pattern.strip():
        raise _err(path, where, "empty pattern; expected a tensor name pattern like draft.logits* or draft.layer0.*")
    if pattern_could_match(pattern, num_steps):
        return pattern
    if pattern_could_match(pattern):
        later = (
            ""
            if num_steps == 1
            else ", draft.step1.*"
            if num_steps == 2
            else f", draft.step1.* .. draft.step{num_steps - 1}.*"
        )
        raise _err(
            path,
            where,
            f"pattern {pattern!r} matches no tensor of this case: with speculative.num_steps "
            f"{num_steps} it captures target.*, draft.*{later}",
        )
    close = difflib.get_close_matches(pattern, example_names(num_steps), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    raise _err(path, where, f"pattern {pattern!r} matches no canonical tensor name{hint} (names: {NAME_FORMS})")


def _expect(raw: object, path: Path) -> dict:
    if not isinstance(raw, dict):
        raise _err(path, "expect", f"expected a mapping, got {_shown(raw)}")
    # the registry (importing the engines' checks) only when the case names an expectation beyond the core's
    contributed = contributed_expect() if any(k not in EXPECT_KEYS for k in raw) else {}
    _unknown(path, "expect", raw, EXPECT_KEYS + tuple(contributed))
    out: dict = {}
    if "top1_agreement" in raw:
        x = _tolerance(raw["top1_agreement"], path, "expect.top1_agreement")
        if x > 1:
            raise _err(
                path, "expect.top1_agreement", f"expected a fraction in [0, 1], got {_shown(raw['top1_agreement'])}"
            )
        out["top1_agreement"] = x
    if "accept_length" in raw:
        out["accept_length"] = _tolerance_pair(raw["accept_length"], path, "expect.accept_length", required=False)
    for name, keys in contributed.items():  # each a mapping of the keys its check declares, numbers >= 0
        if name in raw:
            value, where = raw[name], f"expect.{name}"
            if not isinstance(value, dict) or not value:
                shape = ", ".join(f"{k}: X" for k in keys)
                raise _err(path, where, f"expected {{{shape}}} (any of them), got {_shown(value)}")
            _unknown(path, where, value, keys)
            out[name] = {k: _tolerance(v, path, f"{where}.{k}") for k, v in value.items()}
    return out


def _name(raw: dict, path: Path) -> str:
    """A case's name keys its report files and baseline entries: a short, plain file name."""
    if "name" not in raw or raw["name"] in (None, ""):
        return path.stem
    name = raw["name"]
    if not isinstance(name, (str, int)) or isinstance(name, bool):
        raise _err(path, "name", f"expected a string, got {_shown(name)}")
    name = str(name)
    if len(name) > MAX_NAME or not _NAME.fullmatch(name):
        raise _err(
            path,
            "name",
            f"expected at most {MAX_NAME} letters, digits, '.', '_' or '-' (it names report files), got {_shown(name)}",
        )
    return name


MAX_NAME = 100
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


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


def _expect_failure(value: object, path: Path) -> list[ExpectedFailure]:
    return parse_expected(value, path, check_registry.known_checks(), registered_engines())


def load_case(path: str | Path) -> Case:
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
    _unknown(path, "", raw, KNOWN_KEYS)
    raw = _expand_mapping(raw, path)
    for required in ("target", "draft", "prompts"):
        if required not in raw:
            raise _err(path, required, "required field missing")
    dtype = raw.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _err(path, "dtype", f"{_shown(dtype)} is not one of {', '.join(DTYPES)}")
    prompts = raw["prompts"]
    if not isinstance(prompts, list) or not prompts:
        raise _err(path, "prompts", "expected a non-empty list")
    spec = raw.get("speculative")
    spec = {} if spec is None else spec
    if not isinstance(spec, dict):
        raise _err(path, "speculative", f"expected a mapping, got {_shown(spec)}")
    _unknown(path, "speculative", spec, ("num_steps", "max_new_tokens", "prompts"))
    for key in ("num_steps", "max_new_tokens"):
        if key in spec and (not _is_int(spec[key]) or spec[key] < 1):
            raise _err(path, f"speculative.{key}", f"expected a positive integer, got {_shown(spec[key])}")
    spec_prompts = spec.get("prompts")
    spec_prompts = [] if spec_prompts is None else spec_prompts
    if not isinstance(spec_prompts, list):
        raise _err(path, "speculative.prompts", f"expected a list, got {_shown(spec_prompts)}")
    wiring = raw.get("wiring", DEFAULT_PRESET)
    if not (isinstance(wiring, str) and wiring) and not (
        isinstance(wiring, list) and wiring and all(isinstance(w, str) and w for w in wiring)
    ):
        raise _err(path, "wiring", f"expected a preset name or a list like [h0, h3, h31], got {_shown(wiring)}")
    layer_ids = raw.get("layer_ids")
    if layer_ids is not None and (
        not isinstance(layer_ids, list) or not layer_ids or not all(_is_int(i) and i >= 0 for i in layer_ids)
    ):
        raise _err(path, "layer_ids", f"expected a non-empty list of non-negative integers, got {_shown(layer_ids)}")
    engines = raw.get("engines")
    engines = {} if engines is None else engines
    if not isinstance(engines, dict):
        raise _err(path, "engines", f"expected a mapping of engine name -> settings, got {_shown(engines)}")
    for name, section in engines.items():
        if not isinstance(name, str) or not isinstance(section, (dict, type(None))):
            raise _err(path, f"engines.{name}", f"expected a mapping of settings, got {_shown(section)}")
    tolerances = raw.get("tolerances")
    tolerances = {} if tolerances is None else tolerances
    if not isinstance(tolerances, dict):
        raise _err(
            path, "tolerances", f"expected a mapping of tensor pattern -> {{atol, rtol}}, got {_shown(tolerances)}"
        )
    tolerances = {str(p): _tolerance_pair(t, path, f"tolerances.{p}", required=True) for p, t in tolerances.items()}
    num_steps = spec.get("num_steps", 4)
    for p in tolerances:
        _tensor_pattern(p, path, "tolerances", num_steps)
    expect = _expect({} if raw.get("expect") is None else raw["expect"], path)
    allow_missing = raw.get("allow_missing")
    allow_missing = [] if allow_missing is None else allow_missing
    if not isinstance(allow_missing, list) or not all(isinstance(p, str) for p in allow_missing):
        # a bare string would be read character by character, and "*" allows every tensor
        raise _err(
            path,
            "allow_missing",
            f"expected a list of tensor name patterns like [draft.layer0.*], got {_shown(allow_missing)}",
        )
    for i, p in enumerate(allow_missing):
        _tensor_pattern(p, path, f"allow_missing[{i}]", num_steps)
    description = raw.get("description", "")
    if not isinstance(description, str):
        raise _err(path, "description", f"expected a string, got {_shown(description)}")
    return Case(
        name=_name(raw, path),
        path=str(path),
        target=_model_ref(raw["target"], path, "target"),
        draft=_model_ref(raw["draft"], path, "draft"),
        dtype=dtype,
        wiring=wiring,
        layer_ids=layer_ids,
        prompts=[_prompt(p, path, f"prompts[{i}]") for i, p in enumerate(prompts)],
        num_steps=spec.get("num_steps", 4),
        max_new_tokens=spec.get("max_new_tokens", 32),
        spec_prompts=[_prompt(p, path, f"speculative.prompts[{i}]") for i, p in enumerate(spec_prompts)],
        engines={k: dict(v or {}) for k, v in engines.items()},
        tolerances=tolerances,
        expect=expect,
        allow_missing=list(allow_missing),
        description=description,
        expect_failure=_expect_failure(raw["expect_failure"], path) if "expect_failure" in raw else [],
    )
