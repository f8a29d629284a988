"""`expect_failure:` follows pytest's strict xfail: green only while the declared failure happens
with its declared cause."""

from __future__ import annotations

from pathlib import Path

import pytest

from difftest.base.check_registry import BUILTIN
from difftest.base.errors import ConfigError
from difftest.case.expected_failure import ExpectedFailure, judge, parse

ALL_CHECKS = tuple(BUILTIN)  # the core's check items

CASE = Path("cases/x.yaml")


def test_a_single_mapping_and_a_list_both_parse():
    one = {"engine": "sglang", "check": "fc_inputs", "cause": "off-by-one"}
    assert (
        parse(one, CASE, ALL_CHECKS)
        == parse([one], CASE, ALL_CHECKS)
        == [ExpectedFailure("sglang", "fc_inputs", "off-by-one")]
    )


@pytest.mark.parametrize(
    "value, fragment",
    [
        ({"engine": "sglang", "chek": "fc_inputs", "cause": "x"}, "unknown key 'chek' (did you mean 'check'?)"),
        (
            {"engine": "sglang", "check": "fc_input", "cause": "x"},
            "unknown check 'fc_input' (did you mean 'fc_inputs'?)",
        ),
        ({"engine": "sglang", "check": "fc_inputs"}, "expect_failure[0].cause: expected a non-empty string"),
        (
            {"engine": "sglang", "check": "fc_inputs", "cause": 3},
            "expect_failure[0].cause: expected a non-empty string",
        ),
        ("sglang fails", "expected a mapping"),
        ([], "expected a mapping"),
    ],
)
def test_malformed_declarations_are_refused_naming_the_field(value, fragment):
    with pytest.raises(ConfigError) as e:
        parse(value, CASE, ALL_CHECKS)
    assert str(e.value).startswith("cases/x.yaml: expect_failure") and fragment in str(e.value)


def test_a_failure_naming_the_cause_is_expected():
    assert judge(ExpectedFailure("sglang", "fc_inputs", "off-by-one"), False, "pattern: off-by-one +1").expected


def test_a_vanished_failure_fails():
    out = judge(ExpectedFailure("sglang", "fc_inputs", "off-by-one"), True, "within noise")
    assert not out.expected and "did not occur" in out.message


def test_a_changed_cause_fails():
    out = judge(ExpectedFailure("sglang", "fc_inputs", "off-by-one"), False, "embedding dropped")
    assert not out.expected and "cause changed" in out.message


@pytest.mark.parametrize(
    "name, spec_id, check, hit",
    [
        ("sglang", "sglang", "fc_inputs", True),
        ("sglang", "sglang[topk=4]", "fc_inputs", True),
        ("vllm", "vllm", "fc_inputs", False),
        ("sglang", "sglang", "draft_logits", False),
    ],
)
def test_an_engine_name_matches_each_of_its_specs(name, spec_id, check, hit):
    assert ExpectedFailure("sglang", "fc_inputs", "x").matches(name, spec_id, check) is hit


def test_a_full_spec_id_matches_only_that_spec():
    e = ExpectedFailure("ref[wiring=vllm]", "fc_inputs", "x")
    assert e.matches("ref", "ref[wiring=vllm]", "fc_inputs") and not e.matches("ref", "ref", "fc_inputs")


def test_wildcards_match_every_engine_and_check():
    assert ExpectedFailure("*", "*", "x").matches("vllm", "vllm", "accept_length")


def test_a_misspelt_reference_key_is_refused_naming_the_closest():
    with pytest.raises(
        ConfigError, match=r"expect_failure\[0\]: unknown key 'referance' \(did you mean 'reference'\?\)$"
    ):
        parse(
            {"engine": "sglang", "check": "fc_inputs", "cause": "x", "referance": "sglang@0.5.16"},
            Path("c.yaml"),
            ALL_CHECKS,
        )


def test_an_entry_with_a_reference_applies_only_to_runs_against_that_reference():
    (e,) = parse(
        {"engine": "sglang", "check": "fc_inputs", "cause": "x", "reference": "sglang@0.5.16"},
        Path("c.yaml"),
        ALL_CHECKS,
    )
    assert e.matches("sglang", "sglang", "fc_inputs", ("sglang", "sglang@0.5.16"))
    assert not e.matches("sglang", "sglang", "fc_inputs", ("ref", "ref"))
    with pytest.raises(ConfigError, match=r"expect_failure\[0\]\.reference: expected a non-empty string"):
        parse({"engine": "sglang", "check": "fc_inputs", "cause": "x", "reference": ""}, Path("c.yaml"), ALL_CHECKS)


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("engine", "reff", "expect_failure[0].engine: unknown engine 'reff' (did you mean 'ref'?); registered: "),
        ("engine", "vlm@0.24.0", "expect_failure[0].engine: unknown engine 'vlm' (did you mean 'vllm'?)"),
        ("reference", "sglan@0.5.16", "expect_failure[0].reference: unknown engine 'sglan' (did you mean 'sglang'?)"),
        ("engine", "vllm 0.24", "expect_failure[0].engine: cannot read engine 'vllm 0.24'"),
    ],
)
def test_an_entry_for_an_engine_that_is_not_registered_is_refused(key, value, fragment):
    entry = {"engine": "sglang", "check": "fc_inputs", "cause": "x", key: value}
    with pytest.raises(ConfigError) as e:
        parse(entry, CASE, ALL_CHECKS, engines={"ref", "sglang", "vllm"})
    assert str(e.value).startswith(f"{CASE}: {fragment}")


@pytest.mark.parametrize("engine", ["vllm", "vllm@0.24.0", "sglang@old", "ref[wiring=vllm]", "*", "baseline:main"])
def test_an_entry_for_a_registered_engine_parses_whether_or_not_this_run_has_it(engine):
    (e,) = parse(
        {"engine": engine, "check": "fc_inputs", "cause": "x"}, CASE, ALL_CHECKS, engines={"ref", "sglang", "vllm"}
    )
    assert e.engine == engine


def test_engines_default_to_the_registered_adapters():
    from difftest.base.registry import registered_engines

    assert "ref" in registered_engines()
    with pytest.raises(ConfigError, match="unknown engine 'reff'"):
        parse({"engine": "reff", "check": "fc_inputs", "cause": "x"}, CASE, ALL_CHECKS)
