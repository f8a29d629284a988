"""Chat-template drift (sgl-project/SpecForge issue 296): the training dump rendered one way,
serving another. Judged on templates the harness was not built around (a DeepSeek-style
`thinking` flag, a dump of raw text with no template) as well as the shipped Qwen3-like one, and
end to end on the shipped catalogue case.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from difftest.case import chat
from difftest.case.case import Prompt, load_case
from difftest.base.errors import ConfigError
from difftest_engines.trainingdata.chat_template import CAUSE, find_drift
from helpers import ROOT, run_pytest

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "BOS", "U", "A", "THINK", "ENDTHINK", "EOT"] + [f"w{i}" for i in range(40)]
# a DeepSeek-V3.1-like template: `thinking=true` opens a think block in the generation prompt
DEEPSEEK_LIKE = (
    "BOS {% for m in messages %}{% if m['role'] == 'user' %}U {{ m['content'] }} {% else %}A {{ m['content'] }} EOT "
    "{% endif %}{% endfor %}{% if add_generation_prompt %}A{% if thinking is defined and thinking %} THINK"
    "{% else %} ENDTHINK{% endif %}{% endif %}"
)


def tokenizer(template: str) -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>")
    t.chat_template = template
    return t


class Sample:
    def __init__(self, ids: list[int], name: str = "data_0.ckpt"):
        self.input_ids, self.source = torch.tensor(ids), f"/dump/rows_0-2/{name}"

    def __len__(self) -> int:
        return len(self.input_ids)


USER = [{"role": "user", "content": "w1 w2 w3 w4"}]
CONTINUATION = [WORDS.index("w9"), WORDS.index("w8")]


def test_serving_renders_a_chat_prompt_with_the_generation_prompt_and_the_requests_flags():
    t = tokenizer(DEEPSEEK_LIKE)
    assert t.convert_ids_to_tokens(chat.render(t, USER, {"thinking": True})) == [
        "BOS",
        "U",
        "w1",
        "w2",
        "w3",
        "w4",
        "A",
        "THINK",
    ]
    assert t.convert_ids_to_tokens(chat.render(t, USER)) == ["BOS", "U", "w1", "w2", "w3", "w4", "A", "ENDTHINK"]


def test_a_dump_rendered_as_serving_renders_is_no_drift():
    t = tokenizer(DEEPSEEK_LIKE)
    dump = [Sample(chat.render(t, USER, {"thinking": True}) + CONTINUATION)]
    assert find_drift(t, Prompt(messages=USER, chat_template_kwargs={"thinking": True}), 0, dump) is None


def test_thinking_flag_drift_names_the_first_differing_token_and_the_dumps_rendering():
    t = tokenizer(DEEPSEEK_LIKE)
    dump = [Sample(chat.render(t, USER) + CONTINUATION)]  # data rendered without thinking
    drift = find_drift(t, Prompt(messages=USER, chat_template_kwargs={"thinking": True}), 0, dump)
    assert drift.position == 7
    assert (drift.dump_token, drift.serving_token) == ("'ENDTHINK' (id 8)", "'THINK' (id 7)")
    assert drift.matches == "the target's chat template with add_generation_prompt=True, thinking=False"
    message = drift.message()
    assert message.startswith(f"prompt 0: {CAUSE}: the training dump (data_0.ckpt)") and "Fix: regenerate" in message


def test_a_dump_of_raw_text_with_no_template_is_named_as_such():
    t = tokenizer(DEEPSEEK_LIKE)
    raw = t("w1 w2 w3 w4", add_special_tokens=False)["input_ids"]
    drift = find_drift(t, Prompt(messages=USER, chat_template_kwargs={}), 0, [Sample(raw + CONTINUATION)])
    assert drift.position == 0
    assert drift.matches.startswith("the raw message text with no chat template")


def test_a_dump_of_other_conversations_says_it_holds_none_of_this_one():
    t = tokenizer(DEEPSEEK_LIKE)
    other = [Sample(chat.render(t, [{"role": "user", "content": "w20 w21"}]) + CONTINUATION)]
    drift = find_drift(t, Prompt(messages=USER, chat_template_kwargs={}), 0, other)
    assert (
        drift.sample is None and "no sample of the dump holds this conversation's last user message" in drift.message()
    )


def test_a_drift_the_harness_cannot_reproduce_is_said_plainly():
    t = tokenizer(DEEPSEEK_LIKE)
    foreign = t("EOT U w1 w2 w3 w4 A", add_special_tokens=False)["input_ids"]  # another template altogether
    drift = find_drift(t, Prompt(messages=USER, chat_template_kwargs={}), 0, [Sample(foreign + CONTINUATION)])
    assert drift.matches is None and "none of the renderings the harness can make matches the dump" in drift.message()


def _case(tmp_path: Path, prompt: object) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(
        json.dumps({"target": "fixture:tiny-llama", "draft": "fixture:tiny-llama-eagle3", "prompts": [prompt]})
    )
    return path


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"messages": [{"role": "usr", "content": "x"}]}, "prompts[0].messages[0].role: expected one of system, user"),
        ({"messages": [{"role": "user", "content": "x", "name": "a"}]}, "prompts[0].messages[0].name"),
        ({"messages": []}, "prompts[0].messages: expected a non-empty list"),
        (
            {"messages": [{"role": "user", "content": ""}]},
            "prompts[0].messages[0].content: expected a non-empty string",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": [1]}},
            "prompts[0].chat_template_kwargs.enable_thinking: expected a scalar",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwarg": {}},
            "did you mean 'chat_template_kwargs'",
        ),
    ],
    ids=["role", "message-key", "empty", "content", "kwarg-type", "typo"],
)
def test_a_bad_chat_prompt_is_refused_in_one_line_naming_the_field(tmp_path, prompt, message):
    with pytest.raises(ConfigError) as e:
        load_case(_case(tmp_path, prompt))
    assert message in str(e.value) and "\n" not in str(e.value)


# -- the shipped catalogue case, end to end on the train engine ---------------------------

CASE = ROOT / "cases" / "catalogue_chat_template_drift.yaml"


@pytest.fixture(scope="module")
def drift_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_drift")
    (root / "cases").mkdir()
    shutil.copy(CASE, root / "cases" / CASE.name)
    return run_pytest(root, "cases/", "--engines=ref,train", "-k", "chat_template or fc_inputs")


def test_shipped_drift_case_names_the_first_differing_token_on_the_train_engine(drift_run):
    result = drift_run.outcome("catalogue_chat_template_drift", "train", "chat_template")
    assert result.outcome == "xfailed", drift_run.output[-3000:]
    assert (
        "first difference at token 12: the dump has 'zemedi' (id 213), serving renders 'gafis' (id 9) (the target's "
        "chat template with add_generation_prompt=True, enable_thinking=False)"
    ) in result.message
    assert result.message.count(f"{CAUSE}:") == 4  # each of the case's four conversations


def test_shipped_drift_case_fails_every_capture_with_the_same_cause(drift_run):
    result = drift_run.outcome("catalogue_chat_template_drift", "train", "fc_inputs")
    assert result.outcome == "xfailed" and CAUSE in result.message


def test_serving_with_the_training_settings_passes_the_chat_template_check(tmp_path):
    (tmp_path / "cases").mkdir()
    text = CASE.read_text().replace(
        "chat_template_kwargs: {enable_thinking: false}", "chat_template_kwargs: {enable_thinking: true}"
    )
    text = text[: text.index("expect_failure:")]
    (tmp_path / "cases" / "thinking_on.yaml").write_text(text)
    run = run_pytest(tmp_path, "cases/", "--engines=ref,train", "-k", "chat_template")
    result = run.outcome("thinking_on", "train", "chat_template")
    assert result.outcome == "passed", run.output[-3000:]
    assert result.message.count("starts with the ids serving renders") == 4
