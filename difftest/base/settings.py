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

The same records declare a whole file (the case file, difftest.case.case_schema): `read` walks a
mapping against a `Schema` whose settings may be nested mappings ("schema": another Schema, or
`each` for a mapping of free keys), free text ("text") or a field with its own reader ("custom",
for what no type says: a checkpoint path resolved against the file). A Schema with a `record`
builds that dataclass from the values it read (`Schema.build`), so a section is a typed record
from the moment it is read.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from difftest.base.errors import ConfigError

TYPES = ("int", "float", "bool", "str", "choice", "ids", "wiring", "mapping", "path", "text", "schema", "custom")
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
    # -- for a file read by `read` (a case file); engine settings leave these as they are
    required: bool = False  # absent: "required field missing"
    null: bool = False  # a YAML null reads as the default (an optional field written empty)
    expected: str = ""  # what a refusal says is expected, where the type's own words are not the file's
    schema: Schema | None = None  # type "schema": the nested mapping's fields
    # type "custom": the reader, given the value and its place; it returns the value or raises place.error
    read: Callable[[object, Place], object] | None = None

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise ValueError(f"setting {self.name}: unknown type {self.type!r}")
        if (self.type == "schema") != (self.schema is not None) or (self.type == "custom") != (self.read is not None):
            raise ValueError(f"setting {self.name}: a schema goes with type schema, a reader with type custom")


@dataclass(frozen=True)
class Place:
    """Where a value sits: the file (or spec) and the field inside it, e.g. cases/x.yaml and
    engines.ref.wiring; `key` is the last key as the file wrote it (not always a string)."""

    file: str
    field: str = ""
    key: object = None

    def at(self, key: object) -> Place:
        return Place(self.file, f"{self.field}.{key}" if self.field else str(key), key)

    def item(self, i: int) -> Place:
        return Place(self.file, f"{self.field}[{i}]", i)

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self}: {message}")

    def __str__(self) -> str:
        return f"{self.file}: {self.field}" if self.field else self.file


@dataclass(frozen=True)
class Schema:
    engine: str  # the engine whose settings these are, or the section of a file they declare
    settings: tuple[Setting, ...] = field(default_factory=tuple)
    # -- for a file read by `read`
    what: str = "setting"  # the word an unknown key is refused with ("unknown field")
    shape: str = "a mapping"  # what a value that is not a mapping is refused with: "expected {shape}, got ..."
    nonempty: bool = False  # an empty mapping (or null) is refused with `shape`; else it reads as the defaults
    each: Setting | None = None  # a mapping of free keys (tensor patterns, engine names), each value read by it
    record: type | None = None  # the dataclass `read` builds from the values (Schema.build); None: a dict
    # checks across fields, once every field is read: each gets the values and the section's place
    checks: tuple[Callable[[dict, Place], None], ...] = ()

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

    def build(self, values: dict) -> object:
        """The typed record of `values` (keyed by setting name); the values themselves without a record."""
        return values if self.record is None else self.record(**values)

    @classmethod
    def of(cls, record: type, engine: str, settings: tuple[Setting, ...], **options) -> Schema:
        """The Schema that builds the dataclass `record`: one Setting per field of it (by name, none
        more, none missing), declared in the record's field order; `options` are Schema's others."""
        fields = [f.name for f in dataclasses.fields(record)]
        by_name = {s.name: s for s in settings}
        if sorted(fields) != sorted(by_name) or len(by_name) != len(settings):
            raise ValueError(f"{record.__name__}: settings {sorted(by_name)} are not its fields {fields}")
        return cls(engine, tuple(by_name[n] for n in fields), record=record, **options)

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
    if t == "text":
        if not isinstance(value, str) or from_spec:
            raise ValueError("a string")
        return value
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
    raise AssertionError(t)  # Setting.__post_init__ admits only TYPES; "schema" and "custom" are read by `read`


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


def refuse_unknown(schema: Schema, section: dict, place: Place) -> None:
    """The first key `schema` does not declare, refused with the closest declared one."""
    names = schema.names()
    for key in section:
        if not isinstance(key, str) or key not in names:
            raise unknown_key(str(place.at(key)), key, names, schema.what)


def read(schema: Schema, section: object, place: Place) -> object:
    """A file's mapping (`section`, at `place`) read against `schema`: unknown keys refused, required
    ones present, each value in its setting's type (nested schemas read in turn), then the checks
    across fields. Returns schema.build(values): its record, or {setting name: value}. Every
    refusal is one ConfigError line naming the file and the field."""
    if section is None and not schema.nonempty:
        section = {}
    if not isinstance(section, dict) or (schema.nonempty and not section):
        raise place.error(f"expected {schema.shape}, got {_shown(section)}")
    if schema.each is not None:
        return {str(k): _read_value(schema.each, v, place.at(k)) for k, v in section.items()}
    refuse_unknown(schema, section, place)
    names = schema.names()
    given: dict[str, str] = {}  # setting name -> the key that set it (aliases and names collide)
    for key in section:
        name = names[key].name
        if name in given:
            raise place.error(f"{key} and {given[name]} both set {name}")
        given[name] = key
    for s in schema.settings:
        if s.required and s.name not in given:
            raise place.at(s.name).error("required field missing")
    values = {}
    for s in schema.settings:
        key = given.get(s.name)
        values[s.name] = _absent(s, place.at(s.name)) if key is None else _read_value(s, section[key], place.at(key))
    for check in schema.checks:
        check(values, place)
    return schema.build(values)


def _absent(s: Setting, place: Place) -> object:
    """A setting the file leaves out: its default; a nested mapping that may be empty, its defaults."""
    if s.schema is not None and not s.schema.nonempty and s.default is None:
        return read(s.schema, {}, place)
    return copy.deepcopy(s.default)


def _read_value(s: Setting, value: object, place: Place) -> object:
    if s.read is not None:
        return s.read(value, place)
    if s.schema is not None:
        return read(s.schema, value, place)
    if value is None and s.null:
        return copy.deepcopy(s.default)
    try:
        return _convert(s, value, from_spec=False)
    except ValueError as e:
        raise place.error(f"expected {s.expected or e}, got {_shown(value)}") from None


# The Python type a setting of each difftest.base.settings type holds once validated (None: not given).
_SETTING_TYPES: dict[str, Any] = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "choice": str,
    "ids": list[int],
    "wiring": str | list[str],
    "mapping": dict[str, Any],
    "path": str,
}
_RECORDS: dict[int, tuple[Schema, type]] = {}  # id(schema) -> (the schema, its record): built once each


def settings_record(schema: Schema) -> type:
    """The dataclass whose fields are `schema`'s settings, in their order, each of its type or None:
    what an adapter reads its validated settings as (attribute access, not a dict by key), generated
    from the one declaration of the keys, the schema. Not frozen: an adapter fills in a default it
    derives from the case (`s.draft = s.draft or case.draft`). `dataclasses.asdict` gives the dict back."""
    built = _RECORDS.get(id(schema))
    if built is None or built[0] is not schema:
        fields = [(s.name, _SETTING_TYPES.get(s.type, Any) | None) for s in schema.settings]
        name = "".join(part.title() for part in schema.engine.replace("-", "_").split("_")) + "Settings"
        built = (schema, dataclasses.make_dataclass(name or "Settings", fields))
        _RECORDS[id(schema)] = built
    return built[1]


def settings_of(schema: Schema, values: dict) -> Any:
    """Validated settings (difftest.base.settings.validate: every setting present) as `schema`'s record."""
    return settings_record(schema)(**values)
