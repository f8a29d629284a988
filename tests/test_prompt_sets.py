"""Prompt sets: a case's `prompts:` / `speculative.prompts:` read from a JSONL or JSON file
(difftest.case.prompt_sets), and `difftest infer-wiring --prompts FILE`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from difftest.base.errors import ConfigError
from difftest.case.case import load_case
from difftest_engines.ref.infer_command import prompt_ids
from helpers import ROOT, one_line


@pytest.fixture
def checkpoints(tmp_path) -> tuple[Path, Path]:
    """A target and a draft as far as case validation reads them: their config.json."""
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir(), draft.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 512, "max_position_embeddings": 64}))
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    return target, draft


def jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def case_with(directory: Path, checkpoints, prompts: str, spec: str = "") -> Path:
    target, draft = checkpoints
    path = directory / "c.yaml"
    path.write_text(f"target: {target}\ndraft: {draft}\nprompts: {prompts}\n{spec}")
    return path


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_messages_records_become_chat_prompts_in_file_order(tmp_path, checkpoints):
    jsonl(tmp_path / "p.jsonl", [{"messages": [user("a b")]}, {"messages": [user("c d")]}])
    case = load_case(case_with(tmp_path, checkpoints, "{file: p.jsonl}"))
    assert [p.messages for p in case.prompts] == [[user("a b")], [user("c d")]]


def test_limit_keeps_the_first_records(tmp_path, checkpoints):
    jsonl(tmp_path / "p.jsonl", [{"messages": [user(f"q{i}")]} for i in range(5)])
    case = load_case(case_with(tmp_path, checkpoints, "{file: p.jsonl, limit: 2}"))
    assert [p.messages[0]["content"] for p in case.prompts] == ["q0", "q1"]


def test_sharegpt_conversation_maps_speakers_and_drops_the_closing_reply(tmp_path, checkpoints):
    conv = [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "bye"},
        {"from": "gpt", "value": "the reply the target writes"},
    ]
    jsonl(tmp_path / "p.jsonl", [{"id": 1, "conversations": conv}])
    case = load_case(case_with(tmp_path, checkpoints, "{file: p.jsonl}"))
    roles = [(m["role"], m["content"]) for m in case.prompts[0].messages]
    assert roles == [("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "bye")]


def test_mt_bench_turns_ask_the_first_question(tmp_path, checkpoints):
    jsonl(tmp_path / "p.jsonl", [{"question_id": 81, "turns": ["first question", "follow-up"]}])
    case = load_case(case_with(tmp_path, checkpoints, "{file: p.jsonl}"))
    assert case.prompts[0].messages == [user("first question")]


def test_named_field_reads_text_and_token_ids(tmp_path, checkpoints):
    jsonl(tmp_path / "p.jsonl", [{"q": "some text"}, {"q": [5, 6, 7]}])
    case = load_case(case_with(tmp_path, checkpoints, "{file: p.jsonl, field: q}"))
    assert (case.prompts[0].text, case.prompts[1].ids) == ("some text", [5, 6, 7])


def test_json_list_file_is_read_like_jsonl(tmp_path, checkpoints):
    (tmp_path / "p.json").write_text(json.dumps([{"prompt": "x y"}, {"prompt": "z w"}]))
    case = load_case(case_with(tmp_path, checkpoints, "{file: p.json}"))
    assert [p.text for p in case.prompts] == ["x y", "z w"]


def test_path_is_relative_to_the_case_file(tmp_path, checkpoints, monkeypatch):
    jsonl(tmp_path / "sets" / "p.jsonl", [{"text": "from the set"}])
    monkeypatch.chdir(checkpoints[0])  # not the case's directory
    case = load_case(case_with(tmp_path, checkpoints, "{file: sets/p.jsonl}"))
    assert case.prompts[0].text == "from the set"


def test_speculative_prompts_read_a_file_too(tmp_path, checkpoints):
    jsonl(tmp_path / "s.jsonl", [{"ids": [1, 2, 3]}, {"ids": [4, 5, 6]}])
    case = load_case(case_with(tmp_path, checkpoints, "[{ids: [9, 9]}]", "speculative: {prompts: {file: s.jsonl}}\n"))
    assert [p.ids for p in case.spec_prompts] == [[1, 2, 3], [4, 5, 6]]


@pytest.mark.parametrize(
    "content, prompts, fragment",
    [
        (None, "{file: nope.jsonl}", "c.yaml: prompts: nope.jsonl: no such file"),
        ("\n\n", "{file: p.jsonl}", "c.yaml: prompts: p.jsonl: no prompts"),
        ('{"text": "ok"}\n{"text": oops}\n', "{file: p.jsonl}", "c.yaml: prompts: p.jsonl:2: not JSON"),
        (
            '{"mesages": []}\n',
            "{file: p.jsonl, field: messages}",
            "p.jsonl:1: no field 'messages'; did you mean 'mesages'?",
        ),
        ('{"question": "q"}\n', "{file: p.jsonl}", "p.jsonl: no prompt field in the first record (fields: question)"),
        ('{"text": "a"}\n', "{file: p.jsonl, feild: text}", "prompts.feild: unknown field; did you mean 'field'?"),
        ('{"text": "a"}\n', "{file: p.jsonl, limit: 0}", "prompts.limit: expected a positive integer"),
        ('{"text": "a"}\n', "{field: text}", "prompts.file: required field missing"),
        ('{"text": ""}\n', "{file: p.jsonl}", "p.jsonl:1: empty prompt"),
        (
            '{"conversations": [{"from": "bot", "value": "x"}]}\n',
            "{file: p.jsonl}",
            "p.jsonl:1: message 0: 'from' 'bot'",
        ),
        ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "{file: p.jsonl}", "only assistant messages"),
    ],
)
def test_bad_prompt_set_is_refused_in_one_line_naming_file_and_field(tmp_path, checkpoints, content, prompts, fragment):
    if content is not None:
        (tmp_path / "p.jsonl").write_text(content)
    with pytest.raises(ConfigError) as e:
        load_case(case_with(tmp_path, checkpoints, prompts))
    assert fragment in one_line(e)


def test_prompts_that_only_move_keep_the_capture_key(tmp_path, checkpoints):
    records = [{"ids": [1, 2, 3]}]
    jsonl(tmp_path / "a" / "p.jsonl", records), jsonl(tmp_path / "b" / "elsewhere.jsonl", records)
    here = load_case(case_with(tmp_path, checkpoints, "{file: a/p.jsonl}"))
    moved = load_case(case_with(tmp_path, checkpoints, "{file: b/elsewhere.jsonl}"))
    assert here.fingerprint() == moved.fingerprint()


def test_edited_prompt_file_changes_the_capture_key(tmp_path, checkpoints):
    path = jsonl(tmp_path / "p.jsonl", [{"ids": [1, 2, 3]}])
    before = load_case(case_with(tmp_path, checkpoints, "{file: p.jsonl}")).fingerprint()
    jsonl(path, [{"ids": [1, 2, 4]}])
    assert load_case(case_with(tmp_path, checkpoints, "{file: p.jsonl}")).fingerprint() != before


def infer_args(*prompts: str) -> argparse.Namespace:
    return argparse.Namespace(prompts=list(prompts), random=16, length=48, seed=0)


def test_infer_wiring_reads_a_prompt_set(tmp_path, checkpoints, monkeypatch):
    jsonl(tmp_path / "p.jsonl", [{"ids": [1, 2, 3]}, {"ids": [7, 8]}])
    monkeypatch.chdir(tmp_path)
    assert prompt_ids(infer_args("p.jsonl"), str(checkpoints[0]), 512) == [[1, 2, 3], [7, 8]]


def test_infer_wiring_refuses_a_malformed_prompt_set_naming_its_line(tmp_path, checkpoints, monkeypatch):
    (tmp_path / "p.jsonl").write_text('{"ids": [1, 2]}\n{\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        prompt_ids(infer_args("p.jsonl"), str(checkpoints[0]), 512)
    assert one_line(e).startswith("--prompts: p.jsonl:2: not JSON")


def test_shipped_chat_prompt_set_holds_sixteen_chat_prompts():
    case_dir = ROOT / "difftest" / "case"
    path = case_dir / "c.yaml"  # not read: the set's path is relative to a case beside the package's sets
    from difftest.base.settings import Place
    from difftest.case.prompt_sets import PromptFile, read_prompt_file

    prompts = read_prompt_file(PromptFile("prompt_sets/chat_small.jsonl"), Place(str(path)))
    assert len(prompts) == 16 and all(p.messages and p.messages[-1]["role"] == "user" for p in prompts)


def test_shipped_case_reads_its_prompts_from_a_file():
    case = load_case(ROOT / "cases" / "tiny_llama_chat_prompts.yaml")
    assert (len(case.prompts), len(case.spec_prompts)) == (4, 12)
    assert all(p.messages for p in case.prompts + case.spec_prompts)
