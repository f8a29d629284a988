"""Fuzz: case YAML, engine specs and training-data rows. Every outcome is either a one-line error
that names the place (the case file, the --engines spec, the sample file), or a value that holds
every invariant the harness relies on; never a traceback, never a silent acceptance.

Validation paths only (no engine runs), so a few hundred examples take seconds."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from difftest.base.dtypes import CASE_DTYPES
from difftest.case.case import Case, load_case
from difftest.case.case_schema import KNOWN_KEYS, expect_keys
from difftest.base.registry import engine_schema
from difftest.run.engine import check_case_settings, check_settings, parse_engine_list
from difftest.base.errors import CaseNotConfigured, ConfigError
from difftest.base.names import pattern_could_match
from difftest.records.tolerance import TolerancePair
from difftest_engines.trainingdata.formats import read_dump

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- values a user might write anywhere ----------------------------------------------------------
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "x", "*", "draft.layer0.*", "vllm", "sglang", "h0+h2+h4", "1e-3", "${NOPE}", "true"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["atol", "rtol", "ids", "wiring", "x"]), inner, max_size=3),
    ),
    max_leaves=8,
)
floats = st.one_of(
    st.floats(0, 1), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["1e-3", "x", True])
)
tolerance_pairs = st.dictionaries(st.sampled_from(["atol", "rtol", "atl"]), floats, max_size=2)
prompt_lists = st.lists(
    st.one_of(
        st.just("hello there"),
        st.just(""),
        st.just({"ids": [1, 2, 3]}),
        st.just({"ids": [1, True]}),
        st.just({"ids": [1], "text": "x"}),
        st.integers(),
        st.just({"ids": [1], "messages": [{"role": "user", "content": "hi"}]}),
    ),
    max_size=3,
)
# per field, values that are right and values that are nearly right (the mistakes people make)
field_values = {
    "name": st.one_of(
        st.sampled_from(["tiny", "a.b-c_1", "x" * 300, "../up", "has space", "", "${NOPE:-ok}"]), st.integers()
    ),
    "description": st.one_of(st.text(max_size=5), st.integers(), st.lists(st.text(max_size=2), max_size=2)),
    "dtype": st.sampled_from(["float32", "bfloat16", "float16", "float64", "fp32", ""]),
    "wiring": st.one_of(
        st.sampled_from(["vllm", "sglang", "h0+h2+h4", ""]),
        st.lists(st.sampled_from(["h0", "h2", ""]), max_size=3),
        st.integers(),
    ),
    "layer_ids": st.one_of(
        st.none(), st.lists(st.one_of(st.integers(-1, 8), st.booleans()), max_size=3), st.just("2+4")
    ),
    "prompts": prompt_lists,
    "speculative": st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "num_steps": st.one_of(st.integers(-1, 6), st.booleans(), st.just("3")),
                "max_new_tokens": st.one_of(st.integers(0, 40), st.floats(1, 4)),
                "prompts": st.one_of(prompt_lists, st.just("p")),
                "num_step": st.just(3),
            },
        ),
        st.just([1]),
    ),
    "engines": st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "ref": st.one_of(
                    st.fixed_dictionaries(
                        {},
                        optional={
                            "wiring": st.sampled_from(["sglang", "h0+h2+h4"]),
                            "topk": st.one_of(st.integers(0, 3), st.booleans()),
                            "wirng": st.just("x"),
                        },
                    ),
                    st.just("sglang"),
                    st.none(),
                ),
                "train": st.fixed_dictionaries(
                    {}, optional={"format": st.sampled_from(["auto", "specforg"]), "ttt_steps": st.integers(0, 3)}
                ),
                "reff": st.just({}),
            },
        ),
        st.just("ref"),
    ),
    "tolerances": st.one_of(
        st.dictionaries(
            st.sampled_from(["draft.*", "target.h.*", "draft.logitz", "draft.step9.*", ""]),
            st.one_of(tolerance_pairs, floats),
            max_size=2,
        ),
        st.just([1]),
    ),
    "expect": st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "top1_agreement": floats,
                "accept_length": tolerance_pairs,
                "train_accuracy": tolerance_pairs,
                "top1_agrement": st.just(0.5),
            },
        ),
        st.just(0.9),
    ),
    "allow_missing": st.one_of(
        st.lists(st.sampled_from(["draft.layer0.*", "target.h.*", "", 3, "draft.layr0.*"]), max_size=2),
        st.just("draft.layer0.*"),
        st.none(),
    ),
}
mutations_st = st.one_of(
    st.fixed_dictionaries({}, optional=field_values),
    st.fixed_dictionaries({}, optional=field_values),
    st.dictionaries(st.sampled_from(sorted(KNOWN_KEYS) + ["promts", "expectt", "allow-missing"]), values, max_size=3),
)


def check_one_line(e: Exception, place: str) -> None:
    message = str(e)
    assert "\n" not in message, message
    assert message.startswith(place), (place, message)


def check_case_invariants(case: Case) -> None:
    """What the checks read, in the shape they read it (a silently accepted bad value fails here)."""
    assert case.dtype in CASE_DTYPES
    for n in (case.num_steps, case.max_new_tokens):
        assert type(n) is int and n >= 1
    assert isinstance(case.allow_missing, list) and all(isinstance(p, str) and p for p in case.allow_missing)
    # every pattern names some tensor the case's captures can hold (a typo is never ignored)
    assert all(pattern_could_match(p, case.num_steps) for p in [*case.allow_missing, *case.tolerances])
    for tol in list(case.tolerances.values()) + (
        [case.expect.accept_length] if case.expect.accept_length is not None else []
    ):
        assert isinstance(tol, TolerancePair) and (tol.atol, tol.rtol) != (None, None)
        given = [v for v in (tol.atol, tol.rtol) if v is not None]
        assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in given)
    assert set(case.expect.given()) <= set(expect_keys())
    if case.expect.top1_agreement is not None:
        assert 0 <= case.expect.top1_agreement <= 1
    for p in case.prompts + case.spec_prompts:
        assert (p.text and p.text.strip()) or (p.ids and all(type(i) is int and i >= 0 for i in p.ids))
        assert not (p.ids and (p.messages or p.chat_template_kwargs))  # neither is dropped silently
    assert isinstance(case.wiring, str) or all(isinstance(w, str) for w in case.wiring)
    assert all(isinstance(s, dict) for s in case.engines.values())
    assert len(case.name) <= 100 and "/" not in case.name


@pytest.fixture(scope="module")
def empty_checkpoints_dir():
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for role in ("target", "draft"):
            (root / role).mkdir()
            (root / role / "config.json").write_text("{}")
        yield root


@FAST
@given(mutations=mutations_st, drop=st.sets(st.sampled_from(["target", "draft", "prompts"]), max_size=1))
def test_fuzzed_case_yaml_is_a_valid_case_or_one_line_naming_the_file(empty_checkpoints_dir, mutations, drop):
    raw = {
        "target": str(empty_checkpoints_dir / "target"),
        "draft": str(empty_checkpoints_dir / "draft"),
        "prompts": [{"ids": [1, 2, 3]}],
    }
    raw.update(mutations)
    for key in drop:
        raw.pop(key, None)
    path = empty_checkpoints_dir / "fuzz.yaml"
    path.write_text(yaml.safe_dump(raw))
    try:
        case = load_case(path)
        check_case_settings(case)
    except (ConfigError, CaseNotConfigured) as e:
        event("refused")
        check_one_line(e, f"{path}: ")
        return
    event("loaded")
    check_case_invariants(case)
    assert set(raw) <= KNOWN_KEYS  # an unknown field never loads


# -- engine specs ---------------------------------------------------------------------------------
spec_keys = st.sampled_from(
    [
        "wiring",
        "wirng",
        "topk",
        "num_draft_tokens",
        "layer_ids",
        "norm_output",
        "d2t",
        "data",
        "format",
        "identify",
        "ttt_steps",
        "",
        "foo",
        "num_steps",
        "tp_size",
    ]
)
spec_values = st.sampled_from(
    [
        "vllm",
        "sglang",
        "h0+h2+h4",
        "2+4+5",
        "true",
        "0",
        "1",
        "3",
        "-1",
        "identity",
        "auto",
        "speculators",
        "target",
        "x",
        "$\\frac{$",
        "1.5",
    ]
)
engine_names = st.sampled_from(["ref", "train", "vllm", "sglang", "nope", "ref@old"])


@st.composite
def spec_texts(draw) -> str:
    name = draw(engine_names)
    params = draw(st.lists(st.tuples(spec_keys, spec_values), max_size=3))
    body = ",".join(f"{k}={v}" for k, v in params)
    return name + (f"[{body}]" if params or draw(st.booleans()) else "")


@FAST
@given(texts=st.lists(spec_texts(), min_size=1, max_size=3))
def test_fuzzed_engine_specs_are_valid_or_one_line_naming_the_option(texts):
    try:
        specs = parse_engine_list(",".join(texts))
        validated = [(spec, check_settings(engine_schema(spec.name), spec)) for spec in specs]
    except ConfigError as e:
        event("refused")
        check_one_line(e, "--engines")
        return
    event("accepted")
    for spec, values_ in validated:
        names = engine_schema(spec.name).names()
        keys = [k for k, _ in spec.params]
        assert all(k in names for k in keys) and len({names[k].name for k in keys}) == len(keys)
        assert set(values_) == {s.name for s in engine_schema(spec.name).settings}


# -- training-data rows ---------------------------------------------------------------------------
def tensors(seq: int):
    return st.one_of(
        st.builds(lambda n, h: torch.randn(n, h), st.sampled_from([seq, seq - 1, 0]), st.sampled_from([8, 16])),
        st.builds(lambda n: torch.ones(n, 8, dtype=torch.int32), st.just(seq)),
        st.just(torch.full((seq, 8), float("nan"))),
        st.just("not a tensor"),
        st.just([1, 2]),
    )


@st.composite
def legacy_rows(draw) -> dict:
    seq = draw(st.sampled_from([4, 5]))
    row: dict = {}
    good = {
        "input_ids": torch.arange(seq),
        "loss_mask": torch.ones(seq, dtype=torch.long),
        "hidden_states": [torch.randn(seq, 8) for _ in range(3)],
    }
    if draw(st.integers(0, 2)) == 0:
        return good  # a third of the rows are right: the rest must not take them down
    row = dict(good)
    which = draw(st.sampled_from(["input_ids", "loss_mask", "hidden_states", "drop", "width"]))
    if which == "input_ids":
        row["input_ids"] = draw(
            st.sampled_from([torch.rand(seq), "ids", torch.arange(seq * 2).reshape(2, seq), [1, 2]])
        )
    elif which == "loss_mask":
        row["loss_mask"] = draw(st.sampled_from([torch.ones(seq + 1), {"a": 1}, "mask"]))
    elif which == "hidden_states":
        row["hidden_states"] = draw(st.one_of(st.lists(tensors(seq), min_size=0, max_size=4), tensors(seq)))
    elif which == "drop":
        row.pop(draw(st.sampled_from(sorted(row))))
    else:  # another hidden size, or another layer count, than the other rows
        row["hidden_states"] = draw(
            st.sampled_from([[torch.randn(seq, 16) for _ in range(3)], [torch.randn(seq, 8)] * 4])
        )
    return row


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(legacy_rows(), min_size=1, max_size=4))
def test_fuzzed_training_rows_load_or_are_skipped_with_one_line_each(empty_checkpoints_dir, rows):
    data = empty_checkpoints_dir / "legacy"
    if data.exists():
        for f in data.iterdir():
            f.unlink()
    data.mkdir(exist_ok=True)
    for i, row in enumerate(rows):
        torch.save(row, data / f"data_{i}.pt")
    try:
        dump = read_dump(data, "speculators-legacy")
    except ConfigError as e:
        event("refused")
        check_one_line(e, str(data))
        return
    event(f"{len(dump.samples)} loaded, {len(dump.skipped)} skipped")
    assert len(dump.samples) + len(dump.skipped) == len(rows)
    for line in dump.skipped:
        assert "\n" not in line and line.startswith(str(data / "data_")) and line.endswith("(sample skipped)")
    for s in dump.samples:  # what the train engine relies on
        n = len(s.input_ids)
        assert s.input_ids.dtype == torch.long and s.loss_mask.shape == (n,)
        assert all(
            t.shape == (n, s.tensors[0].shape[-1]) and t.is_floating_point() and torch.isfinite(t).all()
            for t in s.tensors
        )
    widths = {(len(s.tensors), s.tensors[0].shape[-1]) for s in dump.samples}
    assert len(widths) <= 1  # one layout per dump


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=st.lists(
        st.one_of(
            st.builds(
                lambda i: json.dumps({"index": i, "input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}), st.integers(0, 2)
            ),
            st.just('{"index": "0"}'),
            st.just("[1, 2]"),
            st.just("not json"),
            st.just('{"input_ids": [1]}'),
            st.just('{"index": true, "input_ids": [1, 2, 3]}'),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_fuzzed_dataset_rows_are_used_or_skipped_with_one_line(empty_checkpoints_dir, lines):
    from safetensors.torch import save_file

    data = empty_checkpoints_dir / "spec"
    (data / "hidden_states").mkdir(parents=True, exist_ok=True)
    for i in range(3):
        save_file(
            {"hidden_states": torch.randn(3, 3, 8), "token_ids": torch.tensor([1, 2, 3])},
            str(data / "hidden_states" / f"hs_{i}.safetensors"),
        )
    (data / "samples.jsonl").write_text("\n".join(lines) + "\n")
    try:
        dump = read_dump(data, "speculators")
    except ConfigError as e:
        check_one_line(e, str(data))
        return
    assert all("\n" not in line and line.startswith(str(data)) for line in dump.skipped)
    assert len(dump.samples) <= 3
