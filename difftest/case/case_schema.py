"""The case file, declared once: every field with its type, default and checks (difftest.base.settings'
Setting and Schema, as engine settings are), nested mappings as nested schemas. difftest.case.case
reads a file through CASE; each refusal is one line naming the file and the field."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import replace
from pathlib import Path

from difftest.base import check_registry
from difftest.base.dtypes import CASE_DTYPES, MATMUL_PRECISIONS, DType
from difftest.base.names import NAME_FORMS, example_names, pattern_could_match
from difftest.base.registry import registered_engines
from difftest.base.settings import Place, Schema, Setting, read, suggest
from difftest.case.prompt import Prompt, read_prompt
from difftest.case.prompt_sets import PromptFile, read_prompt_file
from difftest.case.expected_failure import ExpectedFailure
from difftest.case.expected_failure import parse as parse_expected
from difftest.records.tolerance import Expectations, TolerancePair
from difftest.rules.wiring import DEFAULT_PRESET

MAX_NAME = 100
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# expect: what the core's checks read (difftest.checks.checks); a check an engine contributes declares its
# own (difftest.base.check_registry.CheckSpec.expect, e.g. the train engine's train_accuracy: {atol, min})
EXPECT_KEYS = ("top1_agreement", "accept_length")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- readers of the fields no type says all of -----------------------------------------------------------
def _name(value: object, place: Place) -> str | None:
    """A case's name keys its report files and baseline entries: a short, plain file name (None: the
    file's stem)."""
    if value in (None, ""):
        return None
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise place.error(f"expected a string, got {_shown(value)}")
    name = str(value)
    if len(name) > MAX_NAME or not _NAME.fullmatch(name):
        raise place.error(
            f"expected at most {MAX_NAME} letters, digits, '.', '_' or '-' (it names report files), got {_shown(name)}"
        )
    return name


def _model_ref(value: object, place: Place) -> str:
    """A fixture (fixture:NAME) as it is, or a checkpoint directory, relative to the case file."""
    if not isinstance(value, str) or not value:
        raise place.error("expected a fixture name (fixture:NAME) or a checkpoint path")
    if value.startswith("fixture:"):
        return value
    p = Path(value)
    if not p.is_absolute():
        p = (Path(place.file).parent / p).resolve()
    if not (p / "config.json").exists():
        raise place.error(f"checkpoint {p} not found (no config.json)")
    return str(p)


def _dtype(value: object, place: Place) -> DType:
    if not isinstance(value, str) or value not in CASE_DTYPES:
        raise place.error(f"{_shown(value)} is not one of {', '.join(CASE_DTYPES)}")
    return DType(value)


def _prompt_file(value: dict, place: Place) -> list[Prompt]:
    """{file: PATH, field: NAME, limit: N}: a prompt set (difftest.case.prompt_sets)."""
    spec = read(PROMPT_FILE, value, place)
    assert isinstance(spec, PromptFile)
    return read_prompt_file(spec, place)


def _prompts(value: object, place: Place) -> list[Prompt]:
    if isinstance(value, dict):
        return _prompt_file(value, place)
    if not isinstance(value, list) or not value:
        raise place.error("expected a non-empty list or {file: PATH, field: NAME, limit: N}")
    return [read_prompt(p, place.item(i)) for i, p in enumerate(value)]


def _spec_prompts(value: object, place: Place) -> list[Prompt]:
    """speculative.prompts: none given, the case's `prompts` are drafted."""
    value = [] if value is None else value
    if isinstance(value, dict):
        return _prompt_file(value, place)
    if not isinstance(value, list):
        raise place.error(f"expected a list or {{file: PATH, field: NAME, limit: N}}, got {_shown(value)}")
    return [read_prompt(p, place.item(i)) for i, p in enumerate(value)]


def _tolerance(value: object, place: Place) -> float:
    """A finite number >= 0 (YAML 1.1 reads 1e-3, without a dot, as a string: float() takes it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise place.error(f"expected a number, got {_shown(value)}")
    try:
        x = float(value)
    except ValueError:
        raise place.error(f"expected a number, got {_shown(value)}") from None
    if not math.isfinite(x) or x < 0:
        raise place.error(f"expected a finite number >= 0, got {_shown(value)}")
    return x


def _fraction(value: object, place: Place) -> float:
    x = _tolerance(value, place)
    if x > 1:
        raise place.error(f"expected a fraction in [0, 1], got {_shown(value)}")
    return x


def _atol_with_rtol(values: dict, place: Place) -> None:
    if values["rtol"] is not None and values["atol"] is None:
        # as torch.testing: rtol alone is ambiguous near zero
        raise place.error("rtol given without atol; set both")


def _engine_section(value: object, place: Place) -> dict:
    """`engines.<name>`: the engine's settings, validated against its schema when its spec is known
    (difftest.run.engine.check_case_settings)."""
    if not isinstance(place.key, str) or not isinstance(value, (dict, type(None))):
        raise place.error(f"expected a mapping of settings, got {_shown(value)}")
    return dict(value or {})


def _allow_missing(value: object, place: Place) -> list[str]:
    value = [] if value is None else value
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        # a bare string would be read character by character, and "*" allows every tensor
        raise place.error(f"expected a list of tensor name patterns like [draft.layer0.*], got {_shown(value)}")
    return list(value)


def _precision(value: object, place: Place) -> dict[str, str]:
    """`precision: {ENGINE: tf32}`: the matmul format an engine serves this float32 case in (an engine
    name, or a spec id such as "ref[matmul=tf32]"), so it is judged against that format's floor."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not value:
        raise place.error(f"expected a mapping of engine -> {' | '.join(MATMUL_PRECISIONS)}, got {_shown(value)}")
    engines = registered_engines()
    out = {}
    for key, p in value.items():
        at = place.at(key)
        name = re.split(r"[@\[]", str(key), maxsplit=1)[0]
        if name not in engines:
            raise at.error(f"unknown engine {name!r}{suggest(name, engines)} (known: {', '.join(sorted(engines))})")
        if not isinstance(p, str) or p not in MATMUL_PRECISIONS:
            raise at.error(
                f"expected one of {', '.join(MATMUL_PRECISIONS)}, got {_shown(p)}{suggest(str(p), MATMUL_PRECISIONS)}"
            )
        out[str(key)] = p
    return out


def _precision_dtype(values: dict, place: Place) -> None:
    """A declared matmul precision is below float32: it means nothing for a case in a half dtype."""
    if values["precision"] and values["dtype"] != DType.FLOAT32:
        raise place.at("precision").error(
            f"declares matmul formats below float32, but the case computes in {values['dtype']}: "
            "a precision applies to a float32 case"
        )


def _expect_failure(value: object, place: Place) -> list[ExpectedFailure]:
    return parse_expected(value, Path(place.file), check_registry.known_checks(), registered_engines())


def _tensor_pattern(pattern: str, place: Place, num_steps: int) -> None:
    """A `tolerances:` or `allow_missing:` pattern (an fnmatch glob over canonical names,
    difftest.base.names) must match some tensor this case's captures can hold: one that matches none
    (draft.logitz, draft.layr0.*, draft.step4.* with 4 steps) would be ignored without a word."""
    if not pattern.strip():
        raise place.error("empty pattern; expected a tensor name pattern like draft.logits* or draft.layer0.*")
    if pattern_could_match(pattern, num_steps):
        return
    if pattern_could_match(pattern):
        later = (
            ""
            if num_steps == 1
            else ", draft.step1.*"
            if num_steps == 2
            else f", draft.step1.* .. draft.step{num_steps - 1}.*"
        )
        raise place.error(
            f"pattern {pattern!r} matches no tensor of this case: with speculative.num_steps "
            f"{num_steps} it captures target.*, draft.*{later}"
        )
    close = difflib.get_close_matches(pattern, example_names(num_steps), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    raise place.error(f"pattern {pattern!r} matches no canonical tensor name{hint} (names: {NAME_FORMS})")


def _patterns(values: dict, place: Place) -> None:
    """Across fields: the tensor patterns against the steps `speculative.num_steps` takes."""
    num_steps = values["speculative"]["num_steps"]
    for p in values["tolerances"]:
        _tensor_pattern(p, place.at("tolerances"), num_steps)
    for i, p in enumerate(values["allow_missing"]):
        _tensor_pattern(p, place.at("allow_missing").item(i), num_steps)


# -- expect: the core's expectations and those the installed engines' checks declare ---------------------
def contributed_expect() -> dict[str, tuple[str, ...]]:
    """`expect.<check>` -> the keys it may hold, for every check an installed engine contributes."""
    return {name: keys for name, keys in check_registry.contributed_expect().items() if name not in EXPECT_KEYS}


def expect_keys() -> tuple[str, ...]:
    """Every key a case's `expect:` may hold: the core's and those contributed checks declare."""
    return EXPECT_KEYS + tuple(contributed_expect())


def _contributed(name: str, keys: tuple[str, ...]) -> Setting:
    """`expect.<name>` of a contributed check: a mapping of the keys it declares, numbers >= 0."""
    shape = "{" + ", ".join(f"{k}: X" for k in keys) + "} (any of them)"
    fields = tuple(Setting(k, "custom", "a number >= 0", read=_tolerance) for k in keys)
    return Setting(name, "schema", "declared by the check", schema=Schema(name, fields, "field", shape, nonempty=True))


def _expect(value: object, place: Place) -> Expectations:
    # the registry (importing the engines' checks) only when the case names an expectation beyond the core's
    given = value if isinstance(value, dict) else {}
    contributed = contributed_expect() if any(k not in EXPECT_KEYS for k in given) else {}
    schema = replace(EXPECT, settings=EXPECT.settings + tuple(_contributed(n, k) for n, k in contributed.items()))
    values = read(schema, value, place)
    assert isinstance(values, dict)  # EXPECT builds no record: its contributed part is keyed by check
    top1, accept = values.pop("top1_agreement"), values.pop("accept_length")
    declared = {n: {k: x for k, x in v.items() if x is not None} for n, v in values.items() if v is not None}
    return Expectations(top1, accept, declared)


# -- the schemas ------------------------------------------------------------------------------------------
def _number(name: str) -> Setting:
    return Setting(name, "custom", "a finite number >= 0", read=_tolerance)


def _tolerance_pair(rtol_needs_atol: bool) -> Schema:
    """{atol: X, rtol: Y}; for a tensor pattern, atol must be given when rtol is."""
    return Schema(
        "tolerance",
        (_number("atol"), _number("rtol")),
        what="field",
        shape="{atol: X, rtol: Y}",
        nonempty=True,
        record=TolerancePair,
        checks=(_atol_with_rtol,) if rtol_needs_atol else (),
    )


TOLERANCE = _tolerance_pair(rtol_needs_atol=True)
PROMPT_FILE = Schema(
    "prompts",
    (
        Setting("file", "str", "a .jsonl or .json file, relative to the case file", required=True),
        Setting("field", "str", "the record key holding each prompt (default: messages, conversations, ...)"),
        Setting("limit", "int", "the first N records (default: all)", min=1, expected="a positive integer"),
    ),
    what="field",
    shape="{file: PATH, field: NAME, limit: N}",
    record=PromptFile,
)
EXPECT = Schema(
    "expect",
    (
        Setting("top1_agreement", "custom", "a fraction in [0, 1]", read=_fraction),
        Setting("accept_length", "schema", "widens the accept-length gate", schema=_tolerance_pair(False)),
    ),
    what="field",
)
SPECULATIVE = Schema(
    "speculative",
    (
        Setting("num_steps", "int", "draft steps per verify", default=4, min=1, expected="a positive integer"),
        Setting("max_new_tokens", "int", "tokens per prompt", default=32, min=1, expected="a positive integer"),
        Setting(
            "prompts",
            "custom",
            "what is drafted (default: prompts); a list or {file, field, limit}",
            default=[],
            read=_spec_prompts,
        ),
    ),
    what="field",
)
CASE = Schema(
    "case",
    (
        Setting("name", "custom", "names report files (default: the file's stem)", read=_name),
        Setting("description", "text", "one line for people", default=""),
        Setting("target", "custom", "fixture:NAME or a checkpoint path", required=True, read=_model_ref),
        Setting("draft", "custom", "fixture:NAME or a checkpoint path", required=True, read=_model_ref),
        Setting("dtype", "custom", " | ".join(CASE_DTYPES), default=DType.FLOAT32, read=_dtype),
        Setting(
            "wiring",
            "wiring",
            "what the draft was trained on: a preset or [h0, h3, h31]",
            default=DEFAULT_PRESET,
            expected="a preset name or a list like [h0, h3, h31]",
        ),
        Setting("layer_ids", "ids", "override the draft config's ids", null=True),
        Setting(
            "prompts",
            "custom",
            "text, {ids: [...]} or {messages: [...]}; or {file: PATH, field: NAME, limit: N}",
            required=True,
            read=_prompts,
        ),
        Setting("speculative", "schema", "the speculative run", schema=SPECULATIVE),
        Setting(
            "engines",
            "schema",
            "per-engine settings (difftest.base.settings)",
            schema=Schema(
                "engines",
                shape="a mapping of engine name -> settings",
                each=Setting("engine", "custom", "its settings", read=_engine_section),
            ),
        ),
        Setting(
            "tolerances",
            "schema",
            "tensor pattern -> {atol, rtol}",
            schema=Schema(
                "tolerances",
                shape="a mapping of tensor pattern -> {atol, rtol}",
                each=Setting("pattern", "schema", "its tolerance", schema=TOLERANCE),
            ),
        ),
        Setting("expect", "custom", "the checks' thresholds", default=Expectations(), read=_expect),
        Setting("allow_missing", "custom", "tensors an engine may not capture", default=[], read=_allow_missing),
        Setting(
            "expect_failure",
            "custom",
            "known failures (difftest.case.expected_failure)",
            default=[],
            read=_expect_failure,
        ),
        Setting(
            "precision",
            "custom",
            f"engine -> the matmul format it serves this float32 case in ({' | '.join(MATMUL_PRECISIONS)})",
            default={},
            read=_precision,
        ),
    ),
    what="field",
    checks=(_patterns, _precision_dtype),
)
KNOWN_KEYS = frozenset(CASE.names())
