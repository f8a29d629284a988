"""The HTML report: self-contained, structured, images embedded, every foreign string escaped;
`difftest report` re-renders it from the JSON and `difftest bundle` packs a case's files."""

from __future__ import annotations

import base64
import json
import tarfile
from html.parser import HTMLParser
from pathlib import Path

import pytest

from difftest import cli
from difftest.report import html_report
from difftest.report import writer as report
from difftest.records import Report
from difftest.records.report import SCHEMA, SCHEMA_VERSION

EVIL = "<script>alert('x')</script>&"


def tensor(name, status="ok", max_abs=0.0, cosine=1.0, rows=None, err=0.0, threshold=1e-5, introduced=False):
    return {
        "name": name,
        "status": status,
        "numel": 12,
        "max_abs": max_abs,
        "cosine": cosine,
        "row_max_abs": rows or [0.0, 0.0, 0.0],
        "criterion": "noise",
        "err": err,
        "noise_floor": threshold / 10,
        "threshold": threshold,
        "excess": err / threshold,
        "rows": 3,
        "rows_above": 3 if status == "mismatch" else 0,
        "introduced": introduced,
        "differs": err > 0,
        "row_err": [err, err / 2, err / 4],
    }


def render(data: dict) -> str:
    return html_report.render(Report.from_dict(data, "sample.json"))


def markdown(data: dict) -> str:
    return report.markdown(Report.from_dict(data, "sample.json"))


def check(engine: str, name: str, outcome: str, message: str, data: dict | None = None) -> dict:
    return {
        "schema_version": 2,
        "engine": engine,
        "check": name,
        "outcome": outcome,
        "message": message,
        **({"data": data} if data is not None else {}),
    }


def stats(verify: int, accepted: int, per_pos: list[int]) -> dict:
    return {
        "num_verify": verify,
        "num_accepted": accepted,
        "num_draft_steps": len(per_pos),
        "accepted_per_pos": per_pos,
    }


def sample_report_json() -> dict:
    bad = [
        tensor("target.h.1"),
        tensor("draft.embeds", err=3e-6),
        tensor("draft.fc_in.0", "mismatch", 0.5, 0.7, [0.5, 0.1, 0.2], err=0.4, introduced=True),
        tensor("draft.logits", "mismatch", 2.0, 0.3, err=0.9),
        {"name": "draft.step1.logits", "status": "tie", "detail": "not compared: a tie"},
    ]
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "case": "tiny",
        "case_file": "cases/tiny.yaml",
        "created": "2026-01-01T00:00:00",
        "reference": "ref",
        "accept_length_definition": "accepted draft tokens + 1 per verify step",
        "engines": {"ref": {"info": {"name": "ref", "version": "1"}}, f"evil[{EVIL}]": {"error": EVIL}},
        "checks": [
            check("ref", "capture", "passed", "ok", {"kind": "capture"}),
            check(
                f"evil[{EVIL}]",
                "fc_inputs",
                "failed",
                f"chunk 0 {EVIL}",
                {
                    "kind": "comparison",
                    "first_divergence": "draft.fc_in.0",
                    "similarity": {
                        "chunks": ["chunk 0"],
                        "candidates": ["target.h.0", "target.h.1"],
                        "cosine": [[0.2, 1.0]],
                    },
                    "fc_chunks": [
                        {
                            "chunk": 0,
                            "expected": "target.h.0",
                            "best": "target.h.1",
                            "cosine": 1.0,
                            "min_cosine": 1.0,
                            "rel_diff": 0.0,
                            "max_abs": 0.0,
                            "norm": 1.0,
                            "norm_spread": 0.0,
                        }
                    ],
                },
            ),
            check(
                f"evil[{EVIL}]",
                "top1_agreement",
                "passed",
                "ok",
                {
                    "kind": "top1_agreement",
                    "agree": 9,
                    "total": 9,
                    "rate": 1.0,
                    "ties": 2,
                    "ties_agree": 1,
                    "noise": "measured",
                },
            ),
            check(
                f"evil[{EVIL}]",
                "accept_length",
                "failed",
                "collapsed",
                {
                    "kind": "accept_length",
                    "reference": stats(10, 14, [9, 5]),
                    "engine": stats(10, 1, [1, 0]),
                    "allowed": 0.3,
                    "spread": 0.1,
                },
            ),
        ],
        "noise_floor": {
            "dtype": "float32",
            "measured": True,
            "source": "measured: ref in float32 vs float64 over 1 prompts",
            "excluded": [],
            "tensors": {
                "draft.fc_in.0": {"name": "draft.fc_in.0", "floor": 1e-6, "max": 2e-6, "rows": 3, "threshold": 1e-5}
            },
        },
        "comparisons": {
            f"evil[{EVIL}]": [
                {
                    "prompt": 0,
                    "first_divergence": "draft.fc_in.0",
                    "first_introduced": "draft.fc_in.0",
                    "first_above_noise": "draft.fc_in.0",
                    "first_differs": "draft.embeds",
                    "tie": f"the engine drafted token 5 {EVIL}",
                    "tensors": bad,
                }
            ]
        },
        "environment": {"torch": "2.x", "git_sha": EVIL},
        "reproduce": "difftest run cases/tiny.yaml '--engines=ref,ref[wiring=sglang]'",
        "case_yaml": f"description: {EVIL}\n",
    }


class Parsed(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.ids, self.images, self.scripts, self.text = [], set(), [], 0, []
        self.elements: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        self.elements.append((tag, attrs))
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        if tag == "script":
            self.scripts += 1

    def handle_data(self, data):
        self.text.append(data)

    def with_class(self, tag: str, cls: str) -> list[dict]:
        return [a for t, a in self.elements if t == tag and cls in (a.get("class") or "").split()]


@pytest.fixture(scope="module")
def parsed() -> Parsed:
    p = Parsed()
    p.feed(render(sample_report_json()))
    return p


def test_html_has_every_section(parsed):
    assert {
        "verdict",
        "first-divergence",
        "noise",
        "noise-source",
        "checks",
        "plots",
        "environment",
        "reproduce",
        "case",
    } <= parsed.ids
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
    assert "2 of 4 checks failed" in text
    assert "difftest run cases/tiny.yaml '--engines=ref,ref[wiring=sglang]'" in text


def test_report_command_rerenders_from_json(tmp_path, capsys):
    """The pages are rebuilt from the JSON alone: what the record says is on them."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(sample_report_json()))
    assert cli.main(["report", str(path)]) == 0
    p = Parsed()
    p.feed((tmp_path / "tiny.html").read_text())
    text = "".join(p.text)
    assert "2 of 4 checks failed" in text and "draft.fc_in.0" in text and EVIL in text and p.scripts == 0
    md = (tmp_path / "tiny.md").read_text()
    assert md.startswith("# difftest: tiny\n")
    assert "| `evil[<script>alert('x')</script>&]` | accept_length | failed | collapsed |" in md
    assert "| `draft.fc_in.0` | 0.4 | 1e-06 | 1e-05 | 4e+04x | above noise | **<- introduced** |" in md
    assert "difftest run cases/tiny.yaml '--engines=ref,ref[wiring=sglang]'" in md


@pytest.mark.parametrize(
    "version, lacks",
    [
        (3, "the memory plan and the declared-precision floors"),
        (
            2,
            "the per-MoE-layer routing and the noise floor's row counts; "
            "the memory plan and the declared-precision floors",
        ),
    ],
)
@pytest.mark.parametrize("command", ["report", "bundle"])
def test_an_older_schema_version_is_read_with_one_line_saying_what_it_lacks(tmp_path, capsys, command, version, lacks):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({**sample_report_json(), "schema_version": version}))
    assert cli.main([command, str(path)]) == 0
    assert capsys.readouterr().err == (
        f"difftest {command}: {path}: report schema version {version} (this difftest writes {SCHEMA_VERSION}): "
        f"not recorded in it: {lacks}; `difftest run cases/tiny.yaml '--engines=ref,ref[wiring=sglang]'` "
        "writes it again\n"
    )


@pytest.mark.parametrize("command", ["report", "bundle"])
def test_a_current_report_is_read_with_nothing_said(tmp_path, capsys, command):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(sample_report_json()))
    assert cli.main([command, str(path)]) == 0
    assert capsys.readouterr().err == ""


def test_report_command_refuses_other_json(tmp_path, capsys):
    path = tmp_path / "x.json"
    path.write_text('{"schema": "other/1"}')
    assert cli.main(["report", str(path)]) == 2
    assert "x.json: schema: 'other/1', expected 'difftest.report'" in capsys.readouterr().err


def test_bundle_packs_json_html_case_and_logs(tmp_path, capsys):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(sample_report_json()))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "ref.log").write_text("engine log")
    out = tmp_path / "b.tar.gz"
    assert cli.main(["bundle", str(path), "-o", str(out)]) == 0
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        assert tar.extractfile("tiny/case/tiny.yaml").read().decode() == f"description: {EVIL}\n"
    assert names == {"tiny/tiny.json", "tiny/tiny.md", "tiny/tiny.html", "tiny/case/tiny.yaml", "tiny/logs/ref.log"}


# -- the noise view --------------------------------------------------------------------------------
def old_report() -> dict:
    """A report whose comparisons carry no noise numbers: no noise floor, no per-tensor err/threshold."""
    r = sample_report_json()
    r["noise_floor"] = None
    for p in r["comparisons"][f"evil[{EVIL}]"]:
        p["tensors"] = [
            {k: v for k, v in t.items() if k in ("name", "status", "numel", "max_abs", "cosine", "row_max_abs")}
            for t in p["tensors"]
        ]
        p.update(first_introduced=None, first_above_noise=None, first_differs=None, tie="")
    return r


def test_html_plots_each_engines_error_against_noise_floor_and_threshold_as_inline_svg(parsed):
    (svg,) = parsed.with_class("svg", "noise")  # one engine compared
    assert svg["xmlns"] == "http://www.w3.org/2000/svg"
    lines = [a for t, a in parsed.elements if t == "polyline"]
    assert any(a.get("stroke-dasharray") for a in lines) and any(
        not a.get("stroke-dasharray") for a in lines
    )  # floor, threshold
    assert len(parsed.with_class("circle", "within")) == 1  # draft.embeds moved within noise
    assert len(parsed.with_class("circle", "identical")) == 1  # target.h.1, drawn on the axis


def test_html_noise_plot_highlights_tensors_above_noise(parsed):
    assert len(parsed.with_class("circle", "above")) == 2  # draft.fc_in.0, draft.logits


def test_html_noise_plot_marks_the_introduced_tensor(parsed):
    assert (
        len(parsed.with_class("circle", "introduced")) == 1 and len(parsed.with_class("line", "introduced-marker")) == 1
    )
    assert "error introduced: draft.fc_in.0" in "".join(parsed.text)


def test_html_noise_plot_shades_tie_skipped_steps_and_explains_every_point(parsed):
    rects = [a for t, a in parsed.elements if t == "rect" and a.get("fill") == "#eaeef2" and a.get("height") != "12"]
    assert len(rects) == 1  # draft.step1.logits
    assert parsed.tags.count("title") >= 5  # hover text per tensor


def test_html_shows_the_noise_floor_source(parsed):
    text = "".join(parsed.text)
    assert "noise floor (measured, float32): measured: ref in float32 vs float64 over 1 prompts" in text
    assert "measured floor per tensor" in text


def test_html_lists_ties(parsed):
    text = "".join(parsed.text)
    assert "top-1 ties within noise: 2 (1 agree), not judged" in text
    assert f"prompt 0: 1 step tensors not compared: the engine drafted token 5 {EVIL}" in text
    assert parsed.scripts == 0


def test_html_noise_table_marks_introduced_and_highlights_above_noise(parsed):
    assert len(parsed.with_class("tr", "above")) == 2
    assert "◀ introduced" in "".join(parsed.text)


def test_html_diagnosis_names_introduced_first_above_noise_and_first_differs():
    r = sample_report_json()
    r["checks"][1]["data"].update(
        {"introduced": "draft.fc_in.0", "first_above_noise": "draft.fc_in.0", "first_differs": "draft.embeds"}
    )
    p = Parsed()
    p.feed(render(r))
    text = "".join(p.text)
    assert "fc_inputs · error introduced at draft.fc_in.0" in text
    assert "first above noise draft.fc_in.0 · first differs draft.embeds" in text


def test_html_renders_a_report_from_before_the_noise_criterion():
    p = Parsed()
    p.feed(render(old_report()))
    assert not p.with_class("svg", "noise")
    assert "noise floor: not in this report" in "".join(p.text)
    assert len(p.images) == 4
    assert "## Error against the noise floor" in markdown(old_report())


def test_markdown_tabulates_error_floor_threshold_excess_verdict_and_introduced():
    md = markdown(sample_report_json())
    assert "noise floor (measured, float32): measured: ref in float32 vs float64 over 1 prompts" in md
    assert "| tensor | err | floor | threshold | excess | verdict | introduced |" in md
    assert "| `draft.fc_in.0` | 0.4 | 1e-06 | 1e-05 | 4e+04x | above noise | **<- introduced** |" in md
    assert "| `draft.logits` | 0.9 | 1e-06 | 1e-05 | 9e+04x | above noise |  |" in md
    assert "draft.embeds` |" not in md and "target.h.1` |" not in md  # within noise while others are above it
    assert "- top-1 ties within noise: 2 (1 agree), not judged" in md


def test_markdown_table_is_limited_to_the_interesting_rows():
    from difftest.report.writer import MAX_ROWS, TOP_MOVERS

    r = sample_report_json()
    entry = r["comparisons"][f"evil[{EVIL}]"][0]
    entry["tensors"] = [
        tensor(f"draft.t{i}", "mismatch", err=0.1 * (i + 1), introduced=i == 0) for i in range(MAX_ROWS + 5)
    ]
    md = markdown(r)
    assert (
        "`draft.t0` | 0.1 |" in md and "**<- introduced**" in md
    )  # the introduced tensor stays, though it moved least
    assert md.count("| above noise |") == MAX_ROWS
    assert "5 more tensors above noise not shown" in md
    # nothing above noise: the top movers by excess
    entry["first_divergence"] = None
    entry["tensors"] = [tensor(f"draft.t{i}", err=1e-7 * (i + 1)) for i in range(TOP_MOVERS + 3)]
    md = markdown(r)
    assert md.count("| within noise |") == TOP_MOVERS and "`draft.t0`" not in md and f"`draft.t{TOP_MOVERS + 2}`" in md
    assert "prompt 0: every tensor within noise" in md


# -- reports people paste (issue 43): three lines, versions, no machine paths, one diagnosis ------------
def pasted_report_json(case_file: str = "cases/tiny.yaml", extra_message: str = "") -> dict:
    """The sample with a real-looking engine (its versions) and a draft_logits item repeating the
    fc_inputs diagnosis, as a run writes them."""
    data = sample_report_json()
    data["case_file"] = case_file
    engine = f"evil[{EVIL}]"
    data["engines"][engine] = {
        "info": {
            "name": "sglang",
            "version": "0.5.23",
            "versions": {"torch": "2.13.0+cpu", "transformers": "5.19.0", "runner": "v1"},
            "kernels": "cpu-shim",
        }
    }
    fc = data["checks"][1]
    fc["message"] = "sglang diverges from ref at draft.fc_in.0 (the diagnosis)\nchunk 0 is target.h.1" + extra_message
    fc["data"]["fed"] = ["target.h.1"]
    data["checks"].insert(
        2,
        check(
            engine, "draft_logits", "failed", "sglang diverges from ref at draft.fc_in.0 (the diagnosis)\nlogits too"
        ),
    )
    return data


def test_markdown_starts_with_fed_vs_trained_the_accept_length_change_and_the_fix():
    lines = markdown(pasted_report_json()).splitlines()
    assert lines[0] == "# difftest: tiny"
    assert lines[2].startswith("**Fed vs trained**: ") and "fed fc [h1], the draft was trained on [h0]" in lines[2]
    assert lines[4] == f"**Accept length**: `evil[{EVIL}]` 1.10 vs reference 2.40 (-54.2%)."
    assert lines[6].startswith("**Fix**: ")


def test_markdown_environment_table_with_every_engines_versions_follows_the_three_lines():
    lines = markdown(pasted_report_json()).splitlines()
    assert lines[8] == "| engine | release | runner | kernels | torch | transformers | python |"
    assert f"| `evil[{EVIL}]` | sglang 0.5.23 | v1 | cpu-shim | 2.13.0+cpu | 5.19.0 | - |" in lines[10:14]
    assert any(line.startswith("| harness | difftest ") for line in lines[10:14])


def test_markdown_folds_definitions_and_timings_into_details_after_the_checks():
    md = markdown(pasted_report_json())
    checks = md.index("| engine | check | outcome | message |")
    assert "<summary>Definitions</summary>" in md[checks:]
    assert md.index("<details>") > checks and "## Definitions" not in md[:checks]


def test_markdown_table_cells_are_short_and_the_whole_message_is_in_the_details():
    long = " ".join(["word"] * 300)
    md = markdown(pasted_report_json(extra_message=" " + long))
    table = [line for line in md.splitlines() if line.startswith("| `")]
    assert max(len(line) for line in table) < 300
    details = md[md.index("<summary>Check messages in full</summary>") :]
    assert long in details


def test_no_absolute_path_in_markdown_or_html():
    home = str(Path.home())
    case = "/somewhere/proj/cases/tiny.yaml"
    data = pasted_report_json(case, f"\nlog /somewhere/proj/cases/fixtures/x.log; cache {home}/.cache/difftest/y")
    data["reproduce"] = f"difftest run {case} --engines=ref,sglang"
    for text in (markdown(data), render(data)):
        assert "/somewhere" not in text and f"{home}/" not in text
        assert "fixtures/x.log" in text and "~/.cache/difftest/y" in text
        assert "difftest run tiny.yaml --engines=ref,sglang" in text


def test_html_banner_says_the_cause_and_the_acceptance_drop():
    banner = render(pasted_report_json()).split("id='verdict'>", 1)[1].split("</div>", 1)[0]
    assert "fed fc [h1], the draft was trained on [h0]" in banner
    assert "1.10 vs reference 2.40 (-54.2%)" in banner


def test_html_shows_the_diagnosis_paragraph_once():
    html = render(pasted_report_json())
    assert html.count("sglang diverges from ref at draft.fc_in.0 (the diagnosis)") == 1
    assert "logits too" in html  # what the draft_logits item adds is still there


def test_html_environment_is_tables_not_python_reprs():
    html = render(pasted_report_json())
    env = html[html.index("id='environment'") : html.index("id='reproduce'")]
    assert "{'" not in env and "&#x27;:" not in env
    assert "<td>transformers</td><td><code>5.19.0</code></td>" in env


def test_log_axis_ticks_read_1e_minus_6_without_mathtext():
    plt = html_report._plt()
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [1e-8, 1e-6, 1e-3])
    html_report._log_axis(ax)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    plt.close(fig)
    assert "1e-6" in labels and not any("mathdefault" in x or "$" in x for x in labels)


def test_passing_tensors_are_not_drawn_at_a_made_up_floor():
    data = sample_report_json()
    for t in data["comparisons"][f"evil[{EVIL}]"][0]["tensors"]:
        if "max_abs" in t:
            t.update(max_abs=0.0, cosine=1.0)
    assert html_report.plot_dataflow(Report.from_dict(data, "sample.json")) is None
