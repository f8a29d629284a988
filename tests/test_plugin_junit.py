"""What CI tooling reads from a run through the plugin: JUnit XML with one naming scheme and each
item's figures as properties, items selectable with `-k` by engine, and pytest-xdist's `-n`
refused for case files in one line (a case's checks share one engine run and one report)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from helpers import TINY_CASE, run_pytest


def _project(root: Path, models) -> Path:
    (root / "cases").mkdir(exist_ok=True)
    target, draft = models
    (root / "cases" / "tiny.yaml").write_text(TINY_CASE.format(target=target, draft=draft))
    return root


@pytest.fixture(scope="module")
def junit(models, tmp_path_factory) -> tuple[ET.Element, str, Path]:
    """One run with a correct and a miswired engine, its JUnit XML parsed and as text."""
    root = _project(tmp_path_factory.mktemp("junit"), models)
    cache = tmp_path_factory.mktemp("cache")
    run_pytest(
        root, "cases/", "--engines=ref,ref[wiring=sglang]", "--junitxml=out.xml", env={"DIFFTEST_CACHE": str(cache)}
    )
    text = (root / "out.xml").read_text()
    return ET.fromstring(text), text, root


def _cases(tree: ET.Element) -> dict[tuple[str, str], ET.Element]:
    return {(c.get("classname", ""), c.get("name", "")): c for c in tree.iter("testcase")}


def _properties(case: ET.Element) -> dict[str, str]:
    return {p.get("name", ""): p.get("value", "") for p in case.iter("property")}


def test_junit_classname_is_file_and_engine_and_name_the_check_for_every_engine(junit):
    cases = _cases(junit[0])
    assert ("cases.tiny.yaml.ref", "capture") in cases
    assert ("cases.tiny.yaml.ref[wiring=sglang]", "fc_inputs") in cases
    assert all(name.count("::") == 0 and "]" not in name for _, name in cases)


def test_junit_properties_carry_outcome_first_divergence_and_accept_length(junit):
    cases = _cases(junit[0])
    fc = _properties(cases[("cases.tiny.yaml.ref[wiring=sglang]", "fc_inputs")])
    assert fc["difftest.outcome"] == "failed" and fc["difftest.first_divergence"].startswith("draft.fc_in")
    assert fc["difftest.cause"]
    accept = _properties(cases[("cases.tiny.yaml.ref[wiring=sglang]", "accept_length")])
    assert float(accept["difftest.accept_length"]) >= 1.0 and float(accept["difftest.reference_accept_length"]) >= 1.0


def test_junit_xml_holds_no_absolute_path_of_the_project(junit):
    _, text, root = junit
    assert str(root) not in text and str(Path.home()) + "/" not in text


def _in_process(pytester: pytest.Pytester, models, *args: str) -> tuple[int, str]:
    _project(pytester.path, models)
    result = pytester.runpytest_inprocess("-p", "difftest.plugin", *args)
    return int(result.ret), "\n".join(result.outlines + result.errlines)


def test_k_selects_an_engine_by_its_spec_id_as_one_word(models, pytester):
    ret, output = _in_process(
        pytester,
        models,
        "cases/",
        "--engines=ref,ref[wiring=sglang]",
        "--collect-only",
        "-q",
        "-k",
        "ref_wiring_sglang",
    )
    items = [line for line in output.splitlines() if line.startswith("cases/tiny.yaml::")]
    assert ret == 0 and items
    assert all("::ref[wiring=sglang]::" in line for line in items)


def test_xdist_n_is_refused_for_case_files_in_one_line(models, pytester):
    pytest.importorskip("xdist")
    ret, output = _in_process(pytester, models, "cases/", "--engines=ref", "-n", "2")
    errors = [line for line in output.splitlines() if "pytest-xdist" in line]
    assert ret == 4 and len(errors) == 1
    assert "run them without -n" in errors[0] and "Traceback" not in output
