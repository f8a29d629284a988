"""Engine settings, declared once per engine and validated by the core.

An adapter declares its settings as a `Schema` of `Setting` records (name, type, default,
aliases, range or choices, one-line doc). A case's `engines.<name>` mapping and the engine
spec's parameters (`name[k=v,...]`, which win) are merged and validated here: an unknown key
is refused with the closest valid name, a duplicate or empty key, a value of the wrong type
or out of range, and a section that is not a mapping each give one line naming the place
(the case file and field, or the `--engines` spec). Adapters read the validated values and
never parse settings themselves.

Types: "int", "float", "bool", "str", "choice" (one of `choices`), "ids" (a list of integers,
or `2+4+5` in a spec), "wiring" (a preset name, `h0+h3+h31`, or a list like [h0, h3, h31]),
"mapping" (a free-form mapping handed to the engine, case file only) and "path".
"""

from __future__ import annotations

import copy
import difflib
import math
from dataclasses import dataclass, field

from difftest.base.errors import ConfigError

TYPES = ("int", "float", "bool", "str", "choice", "ids", "wiring", "mapping", "path")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class Setting:
    name: str
    type: str
    doc: str
    default: object = None  # None: the adapter derives it from the case (e.g. the case's num_steps)
    aliases: tuple[str, ...] = ()  # other names a spec parameter or case key may use
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()
    # A case field this setting stands in for when set (e.g. "draft": the engine runs this checkpoint
    # and never reads the case's): what a cached result depends on is this value, not the field's.
    replaces: str | None = None

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise ValueError(f"setting {self.name}: unknown type {self.type!r}")


@dataclass(frozen=True)
class Schema:
    engine: str
    settings: tuple[Setting, ...] = field(default_factory=tuple)

    def names(self) -> dict[str, Setting]:
        """Every accepted key (names and aliases) -> its setting."""
        out = {}
        for s in self.settings:
            for key in (s.name, *s.aliases):
                out[key] = s
        return out

    def replacing(self, key: str) -> str | None:
        """The case field the setting under `key` (a name or alias) stands in for (Setting.replaces)."""
        s = self.names().get(key)
        return s.replaces if s is not None else None

    def defaults(self) -> dict:
        return {s.name: copy.deepcopy(s.default) for s in self.settings}  # a mapping default is never shared

    def doc(self) -> list[str]:
        lines = []
        for s in self.settings:
            alias = f" (also {', '.join(s.aliases)})" if s.aliases else ""
            lines.append(f"{s.name}{alias}: {s.type}; {s.doc}")
        return lines


def suggest(key: str, known) -> str:
    """'; did you mean 'x'?' for the closest known name, or ''."""
    close = difflib.get_close_matches(str(key), sorted(map(str, known)), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_key(at: str, key: object, known, what: str = "setting") -> ConfigError:
    """`at` names the key's place, e.g. 'cases/x.yaml: engines.ref.wirng' or '--engines ref[wirng=x]: wirng'."""
    known = sorted(map(str, known))
    return ConfigError(f"{at}: unknown {what}{suggest(str(key), known)} (known: {', '.join(known) or 'none'})")


def _convert(s: Setting, value: object, from_spec: bool) -> object:
    """The value in the setting's type, or ValueError with what was expected."""
    t = s.type
    if t == "mapping":
        if from_spec:
            raise ValueError("a mapping; set it in the case file's engines section, not in the spec")
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError("a mapping with string keys")
        return dict(value)
    if t == "bool":
        if isinstance(value, bool):
            return value
        if from_spec and isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ValueError("true or false")
    if t == "int":
        if isinstance(value, bool):
            raise ValueError("an integer")
        if isinstance(value, int):
            v = value
        elif from_spec and isinstance(value, str):
            try:
                v = int(value)
            except ValueError:
                raise ValueError("an integer") from None
        else:
            raise ValueError("an integer")
        return _in_range(s, v)
    if t == "float":
        if isinstance(value, bool):
            raise ValueError("a number")
        if isinstance(value, (int, float)):
            x = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                x = float(value)
            except ValueError:
                raise ValueError("a number") from None
        else:
            raise ValueError("a number")
        if not math.isfinite(x):
            raise ValueError("a finite number")
        return _in_range(s, x)
    if t == "path" and value == "" and not from_spec:
        return None  # `data: ${VAR:-}` with VAR unset: not given (the adapter says what it needs)
    if t in ("str", "path", "choice"):
        if not isinstance(value, str) or not value:
            raise ValueError("a non-empty string" if t != "choice" else f"one of {', '.join(s.choices)}")
        if t == "choice" and value not in s.choices:
            raise ValueError(f"one of {', '.join(s.choices)}{suggest(value, s.choices)}")
        return value
    if t == "ids":
        if from_spec and isinstance(value, str):
            parts = value.replace("+", " ").split()
            if not parts or not all(p.isdigit() for p in parts):
                raise ValueError("layer ids like 2+4+5")
            return [int(p) for p in parts]
        if (
            isinstance(value, list)
            and value
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
        ):
            return list(value)
        raise ValueError("a non-empty list of non-negative integers")
    if t == "wiring":
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(isinstance(i, str) and i for i in value):
            return list(value)
        raise ValueError("a preset name, h0+h3+h31, or a list like [h0, h3, h31]")
    raise AssertionError(t)  # Setting.__post_init__ admits only TYPES


def _in_range(s: Setting, v):
    if s.min is not None and v < s.min:
        raise ValueError(f"a value >= {s.min:g}")
    if s.max is not None and v > s.max:
        raise ValueError(f"a value <= {s.max:g}")
    return v


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate(
    schema: Schema,
    section: object,
    params: tuple[tuple[str, str], ...] = (),
    *,
    section_where: str = "",
    spec_where: str = "",
) -> dict:
    """Merge a case's engines section (`section`, found at `section_where`, e.g. 'cases/x.yaml:
    engines.ref') with the spec parameters (`params`, from `spec_where`, e.g. "--engines
    ref[wiring=sglang]") into {setting name: value}; settings given nowhere hold their default.
    Raises ConfigError naming the place at the first problem."""
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(f"{section_where}: expected a mapping of settings, got {type(section).__name__}")
    names = schema.names()
    out = schema.defaults()
    given: dict[str, str] = {}  # setting name -> the key that set it (aliases and names collide)
    for key, value in section.items():
        if not isinstance(key, str) or key not in names:
            raise unknown_key(f"{section_where}.{key}", key, names)
        s = names[key]
        if s.name in given:
            raise ConfigError(f"{section_where}: {key} and {given[s.name]} both set {s.name}")
        given[s.name] = key
        try:
            out[s.name] = _convert(s, value, from_spec=False)
        except ValueError as e:
            raise ConfigError(f"{section_where}.{key}: expected {e}, got {_shown(value)}") from None
    seen: set[str] = set()
    for key, value in params:
        if not key:
            raise ConfigError(f"{spec_where}: empty parameter name (in '={value}')")
        if key not in names:
            raise unknown_key(f"{spec_where}: {key}", key, names, "parameter")
        s = names[key]
        if s.name in seen:
            raise ConfigError(f"{spec_where}: parameter {s.name} given twice")
        seen.add(s.name)
        try:
            out[s.name] = _convert(s, value, from_spec=True)
        except ValueError as e:
            raise ConfigError(f"{spec_where}: {key}: expected {e}, got {_shown(value)}") from None
    return out


def validate_params(schema: Schema, params: tuple[tuple[str, str], ...], spec_where: str) -> dict:
    """The spec's parameters alone (at start-up, before any case is read)."""
    return validate(schema, {}, params, spec_where=spec_where)
