"""Capture persistence, fc_in chunk views, data-flow naming order, and case-file validation."""

from __future__ import annotations

import json
import random

import pytest
import torch

from difftest.base import names

from difftest.base import tensorfile
from difftest.records.capture import SCHEMA, Capture
from difftest.case.case import load_case
from difftest.base.errors import ConfigError
from difftest.records import CaptureMeta
from difftest.records.tolerance import TolerancePair

# ---------------------------------------------------------------------------------------
# Capture save / load
# ---------------------------------------------------------------------------------------

DATAFLOW = [
    "target.h.0",
    "target.h.2",
    "target.h.10",
    "target.final_norm",
    "target.logits",
    "draft.embeds",
    "draft.fc_in",
    "draft.fc_out",
    "draft.layer0.attn_in",
    "draft.layer0.attn_out",
    "draft.layer0.mlp_out",
    "draft.hidden_prenorm",
    "draft.logits",
    "draft.logits_target",
    "draft.step1.embeds",
    "draft.step1.logits",
    "draft.step2.logits",
    "zz.unknown",
]
DTYPE_OF = {
    "target.h.2": torch.bfloat16,
    "target.h.10": torch.float16,
    "draft.logits": torch.float16,
    "zz.unknown": torch.int64,
}
META = {
    "engine": "ref",
    "dtype": "float32",
    "prompt_ids": [1, 2, 3],
    "wiring": {"inputs": ["target.h.0", "target.h.2", "target.h.10"], "source": "explicit"},
    "target_hidden_size": 4,
    "num_layers": 10,
    "versions": {"torch": torch.__version__},
}


def make_capture(meta: dict | None = None) -> Capture:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name in random.Random(1).sample(DATAFLOW, len(DATAFLOW)):  # stored out of order
        if name == "zz.unknown":
            tensors[name] = torch.arange(6).reshape(2, 3)
        elif name == "draft.fc_in":
            tensors[name] = torch.randn(3, 12, generator=g)
        else:
            tensors[name] = torch.randn(3, 4, generator=g).to(DTYPE_OF.get(name, torch.float32))
    return Capture(tensors, dict(META) if meta is None else meta)


def test_round_trip_preserves_values_dtypes_and_meta(tmp_path):
    original = make_capture()
    loaded = Capture.load(original.save(tmp_path / "cap"))
    assert set(loaded.tensors) == set(original.tensors)
    for name, t in original.tensors.items():
        assert loaded.tensors[name].dtype == t.dtype, name
        assert torch.equal(loaded.tensors[name], t), name
    assert loaded.meta == CaptureMeta.from_dict(META, "META")


def test_round_trip_stores_names_in_dataflow_order(tmp_path):
    loaded = Capture.load(make_capture().save(tmp_path / "cap"))
    assert list(loaded.tensors) == DATAFLOW
    manifest = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert manifest["schema"] == SCHEMA
    assert [t["name"] for t in manifest["tensors"]] == DATAFLOW
    assert manifest["tensors"][DATAFLOW.index("target.h.2")] == {
        "name": "target.h.2",
        "shape": [3, 4],
        "dtype": "bfloat16",
    }


def test_save_leaves_only_the_capture_directory(tmp_path):
    make_capture().save(tmp_path / "cap")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap"]
    assert sorted(p.name for p in (tmp_path / "cap").iterdir()) == ["manifest.json", "tensors.safetensors"]


def test_save_over_an_existing_capture_replaces_it(tmp_path):
    Capture({"target.h.0": torch.zeros(2)}).save(tmp_path / "cap")
    make_capture().save(tmp_path / "cap")
    assert list(Capture.load(tmp_path / "cap").tensors) == DATAFLOW
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap"]


def _failing_write(path, tensors):
    with open(path, "wb") as f:
        f.write(b"half a file")  # a writer that fails half-way
    raise OSError("disk full")


def test_failed_save_leaves_no_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tensorfile, "write", _failing_write)
    with pytest.raises(OSError, match="disk full"):
        make_capture().save(tmp_path / "cap")
    assert list(tmp_path.iterdir()) == []


def test_failed_save_keeps_the_previous_capture(tmp_path, monkeypatch):
    make_capture().save(tmp_path / "cap")
    monkeypatch.setattr(tensorfile, "write", _failing_write)
    with pytest.raises(OSError):
        Capture({"target.h.0": torch.zeros(2)}).save(tmp_path / "cap")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap"]
    assert list(Capture.load(tmp_path / "cap").tensors) == DATAFLOW


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "manifest.json").unlink(), "capture manifest not found"),
        (lambda d: (d / "manifest.json").write_text("{"), "invalid JSON"),
        (
            lambda d: (d / "manifest.json").write_text(json.dumps({"schema": "other/9", "tensors": [], "meta": {}})),
            "schema 'other/9', expected 'difftest.capture/2'",
        ),
    ],
    ids=["no-manifest", "invalid-manifest", "wrong-schema"],
)
def test_load_of_a_damaged_capture_is_a_config_error(tmp_path, damage, message):
    make_capture().save(tmp_path / "cap")
    damage(tmp_path / "cap")
    with pytest.raises(ConfigError) as info:
        Capture.load(tmp_path / "cap")
    assert str(tmp_path / "cap" / "manifest.json") in str(info.value)
    assert message in str(info.value)


def test_load_when_manifest_lists_an_absent_tensor_names_it(tmp_path):
    make_capture().save(tmp_path / "cap")
    path = tmp_path / "cap" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["tensors"].append({"name": "draft.step3.logits", "shape": [1], "dtype": "float32"})
    path.write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="listed in the manifest but absent: draft.step3.logits"):
        Capture.load(tmp_path / "cap")


# ---------------------------------------------------------------------------------------
# fc_in chunk views
# ---------------------------------------------------------------------------------------


def test_fc_in_chunks_are_listed_right_after_fc_in():
    listed = make_capture().names()
    i = listed.index("draft.fc_in")
    assert listed[i : i + 5] == ["draft.fc_in", "draft.fc_in.0", "draft.fc_in.1", "draft.fc_in.2", "draft.fc_out"]


@pytest.mark.parametrize("j", range(3), ids=[f"chunk{j}" for j in range(3)])
def test_fc_in_chunk_is_a_view_of_its_columns(j):
    cap = make_capture()
    fc = cap.tensors["draft.fc_in"]
    chunk = cap.get(f"draft.fc_in.{j}")
    assert torch.equal(chunk, fc[:, 4 * j : 4 * (j + 1)])
    assert chunk.untyped_storage().data_ptr() == fc.untyped_storage().data_ptr()
    assert f"draft.fc_in.{j}" in cap
    assert f"draft.fc_in.{j}" not in cap.tensors


def test_fc_in_chunk_past_the_end_is_a_key_error():
    cap = make_capture()
    assert "draft.fc_in.3" not in cap
    with pytest.raises(KeyError, match="draft.fc_in.3"):
        cap.get("draft.fc_in.3")


@pytest.mark.parametrize(
    "meta",
    [{}, {"target_hidden_size": 5}],
    ids=["no-target_hidden_size", "width-not-a-multiple"],
)
def test_no_chunk_views_without_a_chunk_size_that_divides_fc_in(meta):
    cap = make_capture(meta)
    assert not any(n.startswith("draft.fc_in.") for n in cap.names())
    with pytest.raises(KeyError, match="draft.fc_in.0"):
        cap.get("draft.fc_in.0")


def test_chunk_views_are_not_saved(tmp_path):
    loaded = Capture.load(make_capture().save(tmp_path / "cap"))
    assert "draft.fc_in.0" not in loaded.tensors
    assert torch.equal(loaded.get("draft.fc_in.2"), loaded.tensors["draft.fc_in"][:, 8:12])


# ---------------------------------------------------------------------------------------
# names.order_key
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "earlier, later",
    [
        ("target.h.2", "target.h.10"),
        ("target.h.0", "target.h.1"),
        ("target.h.61", "target.final_norm"),
        ("target.final_norm", "target.logits"),
        ("target.logits", "draft.embeds"),
        ("draft.embeds", "draft.fc_in"),
        ("draft.fc_in", "draft.fc_in.0"),
        ("draft.fc_in.0", "draft.fc_in.1"),
        ("draft.fc_in.9", "draft.fc_in.10"),
        ("draft.fc_in.10", "draft.fc_out"),
        ("draft.logits", "draft.logits_target"),
        ("draft.logits_target", "draft.step1.embeds"),
        ("draft.step1.logits_target", "draft.step2.embeds"),
        ("draft.step2.logits", "draft.step10.embeds"),
        ("draft.step3.logits", "aaa.unknown"),
        ("aaa.unknown", "bbb.unknown"),
    ],
    ids=lambda v: v,
)
def test_order_key_sorts_in_dataflow_order(earlier, later):
    assert names.order_key(earlier) < names.order_key(later)


def test_in_dataflow_order_of_a_shuffled_list():
    shuffled = random.Random(3).sample(DATAFLOW, len(DATAFLOW))
    assert names.in_dataflow_order(shuffled) == DATAFLOW


# ---------------------------------------------------------------------------------------
# Case files
# ---------------------------------------------------------------------------------------

VALID = """\
target: ./target
draft: fixture:tiny-llama-eagle3
dtype: bfloat16
prompts: ["hello", {ids: [1, 2, 3]}]
tolerances: {"draft.*": {atol: 1e-3, rtol: 1e-3}}
"""


@pytest.fixture
def case_dir(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    return tmp_path


def test_valid_case_loads_with_paths_relative_to_the_file(case_dir):
    path = case_dir / "mycase.yaml"
    path.write_text(VALID)
    case = load_case(path)
    assert case.name == "mycase"
    assert case.target == str((case_dir / "target").resolve())
    assert case.draft == "fixture:tiny-llama-eagle3"
    assert case.dtype == "bfloat16"
    assert [(p.text, p.ids) for p in case.prompts] == [("hello", None), (None, [1, 2, 3])]
    assert case.tolerances == {"draft.*": TolerancePair(atol=1e-3, rtol=1e-3)}  # YAML 1.1 reads 1e-3 as a string
    assert (case.wiring, case.num_steps, case.max_new_tokens) == ("vllm", 4, 32)


BAD_CASES = [
    (
        "malformed-yaml",
        'target: ./target\ndraft: fixture:d\nprompts: ["a", "b"\ndtype: float32\n',
        ["malformed YAML at line 4"],
    ),
    ("unknown-field", VALID + "promts: [x]\n", ["promts: unknown field"]),
    ("missing-prompts", "target: ./target\ndraft: fixture:d\n", ["prompts: required field missing"]),
    ("empty-prompts", "target: ./target\ndraft: fixture:d\nprompts: []\n", ["prompts: expected a non-empty list"]),
    ("bad-dtype", VALID.replace("bfloat16", "fp8"), ["dtype: 'fp8' is not one of float32, bfloat16, float16"]),
    (
        "rtol-without-atol",
        VALID.replace("{atol: 1e-3, rtol: 1e-3}", "{rtol: 1e-3}"),
        ["tolerances.draft.*: rtol given without atol; set both"],
    ),
    (
        "missing-target-path",
        VALID.replace("./target", "./nope"),
        ["target: checkpoint ", "nope not found (no config.json)"],
    ),
    (
        "non-numeric-atol",
        VALID.replace("atol: 1e-3", "atol: loose"),
        ["tolerances.draft.*.atol: expected a number, got 'loose'"],
    ),
    ("bad-layer_ids", VALID + "layer_ids: [2, x]\n", ["layer_ids: expected a non-empty list of non-negative integers"]),
    (
        "bad-num_steps",
        VALID + "speculative: {num_steps: 0}\n",
        ["speculative.num_steps: expected a positive integer, got 0"],
    ),
    (
        "bad-prompt-ids",
        VALID.replace("[1, 2, 3]", "[1, -2]"),
        ["prompts[1].ids: expected a non-empty list of non-negative integers"],
    ),
]


@pytest.mark.parametrize("text, fragments", [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_case_is_a_one_line_config_error_naming_file_and_field(case_dir, text, fragments):
    path = case_dir / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_case(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in message
