"""Built-in chat fixtures for the chat-template drift case (a `difftest.fixtures` provider).

    tiny-llama-chat                   the tiny Llama target with a chat template that behaves like
                                      Qwen3's: `enable_thinking=false` adds an empty think block
                                      (THINK ENDTHINK) to the generation prompt; thinking on (the
                                      default) adds nothing
    tiny-llama-train-data-thinking    speculators data, [h2, h4, h5, h8], of CONVERSATIONS rendered
                                      with thinking on (the template's default), each followed by 8
                                      greedy tokens of the target: what a trainer writes when its data
                                      pipeline leaves the template's default while serving turns
                                      thinking off (sgl-project/SpecForge issue 296)

The tiny tokenizer is a word-level one over made-up words, so the template's markers are words
of its vocabulary (named in MARKERS). Built on first use into the user cache, keyed by the
template, the conversations and the target checkpoint's files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from difftest.api import chat, signature
from difftest.api import resolve_fixture as resolve_core_fixture  # this module has its own resolve_fixture
from difftest_fixtures.cache import publish_keyed

LANE = "tiny-llama"  # derived from tiny-llama: in difftest_fixtures.tiny_llama's lane (`difftest fixtures`)
CHAT_TARGET = "tiny-llama-chat"
THINKING_DATA = "tiny-llama-train-data-thinking"
NAMES = [CHAT_TARGET, THINKING_DATA]
BASE_TARGET = "fixture:tiny-llama"
LAYERS = "h2+h4+h5+h8"
CONTINUE = 8

# vocabulary words standing in for Qwen3's <|im_start|>, <|im_end|>, roles, <think>, </think>
MARKERS = {
    "start": "dale",
    "end": "zikugur",
    "user": "sovu",
    "assistant": "nukaza",
    "system": "mope",
    "tool": "vuli",
    "think": "gafis",
    "end_think": "sufovo",
}
TEMPLATE = (
    "{%- set roles = {'system': '"
    + MARKERS["system"]
    + "', 'user': '"
    + MARKERS["user"]
    + "', 'assistant': '"
    + MARKERS["assistant"]
    + "', 'tool': '"
    + MARKERS["tool"]
    + "'} -%}"
    "{%- for m in messages -%}"
    + MARKERS["start"]
    + " {{ roles[m['role']] }} {{ m['content'] }} "
    + MARKERS["end"]
    + " {% endfor -%}"
    "{%- if add_generation_prompt -%}"
    + MARKERS["start"]
    + " "
    + MARKERS["assistant"]
    + "{% if enable_thinking is defined and enable_thinking is false %} "
    + MARKERS["think"]
    + " "
    + MARKERS["end_think"]
    + "{% endif %}{%- endif -%}"
)
# the case's four conversations first (cases/catalogue_chat_template_drift.yaml), then others
CONVERSATIONS = [
    "lavezus luve lola pibe vezo dubi narabi",
    "devu dinupo gibu sogat geli lirus neme",
    "gigo lapo mebila dugu ropoge",
    "gode zode vefola kofe tubir mete",
    "tonabi nepa rali gese sogaro mogo safor",
    "guzebo tesis gito mika borami makon",
    "pose zalu piret zige zoro madati futamur",
    "fepa toparir zekat nefo ralo",
]


def build_chat_target(force: bool = False) -> Path:
    base = Path(resolve_core_fixture(BASE_TARGET))

    def write(tmp: Path) -> None:
        from transformers import AutoTokenizer

        for f in base.iterdir():
            if f.is_file() and not f.name.startswith("tokenizer"):
                shutil.copy2(f, tmp / f.name)
        tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
        tokenizer.chat_template = TEMPLATE
        tokenizer.save_pretrained(str(tmp))

    return publish_keyed("chat", CHAT_TARGET, [TEMPLATE, signature(base)], write, force)


def build_thinking_data(force: bool = False) -> Path:
    target = build_chat_target(force)

    def write(tmp: Path) -> None:
        from transformers import AutoTokenizer

        from difftest_engines.trainingdata.dump import dump_from_target

        tokenizer = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
        # the template's default (thinking on): what a data pipeline renders when nobody sets the flag
        prompts = [chat.render(tokenizer, [{"role": "user", "content": c}]) for c in CONVERSATIONS]
        dump_from_target(target, tmp, "speculators", LAYERS, prompts, CONTINUE)

    return publish_keyed("chat", THINKING_DATA, [LAYERS, CONVERSATIONS, CONTINUE, signature(target)], write, force)


def resolve_fixture(name: str) -> Path | None:
    if name == CHAT_TARGET:
        return build_chat_target()
    if name == THINKING_DATA:
        return build_thinking_data()
    return None


def build_all(force: bool = False) -> None:
    build_thinking_data(force)
