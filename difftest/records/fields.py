"""Strict JSON <-> dataclass conversion for the typed records (difftest.records).

A record's fields and their type hints are its schema, declared once: `decode` refuses an unknown
key (naming the closest field), a missing required field and a value of the wrong type, each as
one ConfigError line that names the file and the field's path (`checks[2].data.allowed`). Supported
hints: str, int, float (an int is a float), bool, None, object (any JSON value), X | Y, list[X],
tuple[X, ...], dict[str, X], a str Enum (one of its values) and nested dataclasses (a class's own
`from_json` when it has one).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import types
import typing
from typing import Any, Callable, get_args, get_origin

from difftest.base.errors import ConfigError

# A field may restrict a str to a set of values: field(metadata={CHOICES: (...)}), or bring its own
# reader for a type defined elsewhere: field(metadata={READER: fn(value, where, at)})
CHOICES = "choices"
READER = "reader"


def fail(where: str, at: str, problem: str) -> ConfigError:
    """The one line every refusal is: the file, the field's path, what is wrong."""
    return ConfigError(f"{where}: {at}: {problem}" if at else f"{where}: {problem}")


def join(at: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{at}[{key}]"
    return f"{at}.{key}" if at else str(key)


def kind_of(value: object) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _describe(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if _is_union(hint):
        return " or ".join(_describe(a) for a in get_args(hint))
    origin = get_origin(hint)
    if origin in (list, tuple):
        return "a list"
    if origin is dict or hint is dict or dataclasses.is_dataclass(hint):
        return "an object"
    if _is_enum(hint):
        return "one of " + ", ".join(repr(m.value) for m in hint)
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}.get(hint, str(hint))


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (typing.Union, types.UnionType)


def _shaped(hint: Any, value: object) -> bool:
    """Whether `value` has the outer JSON shape of `hint` (its contents unchecked)."""
    if hint is Any or hint is object:
        return True
    origin = get_origin(hint) or hint
    if _is_union(hint):
        return any(_shaped(o, value) for o in get_args(hint))
    if origin in (list, tuple):
        return isinstance(value, list)
    if origin is dict or dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    if _is_enum(hint):
        return isinstance(value, str)
    return isinstance(value, hint)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def decode_value(hint: Any, value: object, where: str, at: str) -> Any:
    """`value` (parsed JSON) as `hint`, or a ConfigError naming `where` and `at`."""
    if hint is Any or hint is object:
        return value
    if _is_union(hint):
        if value is None and type(None) in get_args(hint):
            return None
        # the options whose outer shape the value has; a value of none of them is named against all,
        # one inside the right shape is named by the option's own, more precise, complaint
        options = [o for o in get_args(hint) if o is not type(None) and _shaped(o, value)]
        if not options:
            raise fail(where, at, f"expected {_describe(hint)}, got {kind_of(value)}")
        for option in options[:-1]:
            try:
                return decode_value(option, value, where, at)
            except ConfigError:
                pass
        return decode_value(options[-1], value, where, at)
    if hint is type(None):
        if value is not None:
            raise fail(where, at, f"expected null, got {kind_of(value)}")
        return None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        own = getattr(hint, "from_json", None)
        return own(value, where, at) if own is not None else decode(hint, value, where, at)
    origin = get_origin(hint) or hint
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise fail(where, at, f"expected a list, got {kind_of(value)}")
        args = get_args(hint)
        item = args[0] if args else object
        out = [decode_value(item, v, where, join(at, i)) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise fail(where, at, f"expected an object, got {kind_of(value)}")
        args = get_args(hint)
        item = args[1] if args else object
        return {str(k): decode_value(item, v, where, join(at, str(k))) for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise fail(where, at, f"expected a boolean, got {kind_of(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(where, at, f"expected an integer, got {kind_of(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail(where, at, f"expected a number, got {kind_of(value)}")
        return float(value)
    if _is_enum(hint):
        values = [m.value for m in hint]
        if value not in values:
            close = difflib.get_close_matches(str(value), values, n=1, cutoff=0.6)
            also = f" (did you mean {close[0]!r}?)" if close else ""
            raise fail(where, at, f"{value!r} is not one of {', '.join(map(repr, values))}{also}")
        return hint(value)
    if hint is str:
        if not isinstance(value, str):
            raise fail(where, at, f"expected a string, got {kind_of(value)}")
        return value
    raise TypeError(f"difftest.records: unsupported type hint {hint!r} at {at}")  # a harness bug, not bad input


def unknown_key(key: str, known: list[str], where: str, at: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
    return fail(where, join(at, key), "unknown field" + hint)


def decode(cls: type, data: object, where: str, at: str = "", skip: tuple[str, ...] = ()) -> Any:
    """A dataclass from a JSON object: every key a field, every required field present, each of its
    type. `skip`: keys the caller has consumed (a discriminator, a version)."""
    if not isinstance(data, dict):
        raise fail(where, at, f"expected an object, got {kind_of(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields and key not in skip:
            raise unknown_key(str(key), list(fields), where, at)
    kwargs = {}
    types_ = hints(cls)
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise fail(where, join(at, name), "field missing")
            continue
        reader = f.metadata.get(READER)
        value = (
            reader(data[name], where, join(at, name))
            if reader is not None
            else decode_value(types_[name], data[name], where, join(at, name))
        )
        choices = f.metadata.get(CHOICES)
        if choices and value not in choices:
            raise fail(where, join(at, name), f"{value!r} is not one of {', '.join(map(repr, choices))}")
        kwargs[name] = value
    return cls(**kwargs)


def reader_without_properties(cls: type) -> Callable[[object, str, str], Any]:
    """A READER for a record whose to_dict adds its properties (AcceptStats' accept_length, ...):
    those keys are dropped and recomputed; every other key must be a field."""
    derived = {n for n, v in vars(cls).items() if isinstance(v, property)}

    def read(data: object, where: str, at: str) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k not in derived}
        return decode(cls, data, where, at)

    return read


def encode(value: object) -> object:
    """JSON-ready: dataclasses through their own to_dict when they have one, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        own = getattr(value, "to_dict", None)
        if own is not None:
            return own()
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


def encode_fields(record: Any, omit_none: tuple[str, ...] = ()) -> dict:
    """A record's fields, each encoded; those named in `omit_none` left out while None."""
    out = {}
    for f in dataclasses.fields(record):
        v = getattr(record, f.name)
        if v is None and f.name in omit_none:
            continue
        out[f.name] = encode(v)
    return out
