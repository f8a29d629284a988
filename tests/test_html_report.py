"""The HTML report: self-contained, structured, images embedded, every foreign string escaped;
`difftest report` re-renders it from the JSON and `difftest bundle` packs a case's files."""

from __future__ import annotations

import base64
import json
import tarfile
from html.parser import HTMLParser

import pytest

from difftest import cli
from difftest.html_report import render
from difftest.report import SCHEMA, markdown

EVIL = "<script>alert('x')</script>&"


def tensor(name, status="ok", max_abs=0.0, cosine=1.0, rows=None):
    return {"name": name, "status": status, "numel": 12, "max_abs": max_abs, "cosine": cosine,
            "row_max_abs": rows or [0.0, 0.0, 0.0]}  # fmt: skip


def sample_report() -> dict:
    bad = [tensor("target.h.1"), tensor("draft.fc_in.0", "mismatch", 0.5, 0.7, [0.5, 0.1, 0.2]), tensor("draft.logits", "mismatch", 2.0, 0.3)]
    return {
        "schema": SCHEMA,
        "case": "tiny",
        "case_file": "cases/tiny.yaml",
        "created": "2026-01-01T00:00:00",
        "reference": "ref",
        "accept_length_definition": "accepted draft tokens + 1 per verify step",
        "engines": {"ref": {"info": {"version": "1"}}, f"evil[{EVIL}]": {"error": EVIL}},
        "checks": [
            {"engine": "ref", "check": "capture", "outcome": "passed", "message": "ok", "data": {}},
            {"engine": f"evil[{EVIL}]", "check": "fc_inputs", "outcome": "failed", "message": f"chunk 0 {EVIL}",
             "data": {"first_divergence": "draft.fc_in.0",
                      "similarity": {"chunks": ["chunk 0"], "candidates": ["target.h.0", "target.h.1"], "cosine": [[0.2, 1.0]]},
                      "fc_chunks": [{"expected": "target.h.0"}]}},
            {"engine": f"evil[{EVIL}]", "check": "accept_length", "outcome": "failed", "message": "collapsed",
             "data": {"reference": {"accept_length": 2.5, "acceptance_rate_per_pos": [0.9, 0.5]},
                      "engine": {"accept_length": 1.1, "acceptance_rate_per_pos": [0.1, 0.0]}}},
        ],  # fmt: skip
        "comparisons": {f"evil[{EVIL}]": [{"prompt": 0, "first_divergence": "draft.fc_in.0", "tensors": bad}]},
        "environment": {"torch": "2.x", "git_sha": EVIL},
        "reproduce": "difftest run cases/tiny.yaml '--engines=ref,ref[wiring=sglang]'",
        "case_yaml": f"description: {EVIL}\n",
    }


class Parsed(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.ids, self.images, self.scripts, self.text = [], set(), [], 0, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        if tag == "script":
            self.scripts += 1

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def parsed() -> Parsed:
    p = Parsed()
    p.feed(render(sample_report()))
    return p


def test_html_has_every_section(parsed):
    assert {"verdict", "first-divergence", "checks", "plots", "environment", "reproduce", "case"} <= parsed.ids
    assert parsed.tags[0] == "html" and "table" in parsed.tags


def test_html_embeds_its_plots_as_png(parsed):
    assert len(parsed.images) == 4  # data flow, per-token, similarity heat map, acceptance
    for src in parsed.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"


def test_html_escapes_engine_and_config_strings(parsed):
    assert parsed.scripts == 0
    text = "".join(parsed.text)
    assert EVIL in text  # shown literally, as text
    assert "2 of 3 checks failed" in text
    assert "difftest run cases/tiny.yaml '--engines=ref,ref[wiring=sglang]'" in text


def test_report_command_rerenders_from_json(tmp_path, capsys):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(sample_report()))
    assert cli.main(["report", str(path)]) == 0
    assert (tmp_path / "tiny.html").read_text() == render(sample_report())
    assert (tmp_path / "tiny.md").read_text() == markdown(sample_report())


def test_report_command_refuses_other_json(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text('{"schema": "other/1"}')
    assert cli.main(["report", str(path)]) == 2
    assert "schema 'other/1', expected 'difftest.report/1'" in capsys.readouterr().err


def test_bundle_packs_json_html_case_and_logs(tmp_path, capsys):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(sample_report()))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "ref.log").write_text("engine log")
    out = tmp_path / "b.tar.gz"
    assert cli.main(["bundle", str(path), "-o", str(out)]) == 0
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        assert tar.extractfile("tiny/case/tiny.yaml").read().decode() == f"description: {EVIL}\n"
    assert names == {"tiny/tiny.json", "tiny/tiny.md", "tiny/tiny.html", "tiny/case/tiny.yaml", "tiny/logs/ref.log"}
