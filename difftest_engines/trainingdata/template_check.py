"""The `chat_template` check: the training dump holds each chat prompt as serving renders it.

On the `train` engine of a case that names training data and gives prompts as chat `messages`.
Each such prompt is rendered as SGLang and vLLM render a chat request (difftest.case.chat) and the
train engine is asked for its capture: it finds the dump's sample that starts with those ids,
or explains why none does (difftest_engines/trainingdata/chat_template.py: the first differing token and
the rendering the dump matches). Only capture requests travel to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from difftest.api import chat
from difftest.api import Case
from difftest.api import EngineSpec
from difftest.api import ConfigError
from difftest.api import ENGINE, CheckSpec
from difftest.api import CheckData
from difftest.api import CaseRun
from difftest.api import Verdict
from difftest_engines.trainingdata.chat_template import CAUSE, chat_prompts
from difftest_engines.trainingdata.train_check import TRAIN
from difftest_engines.trainingdata.train_check import applies as names_training_data


@dataclass
class PromptRendering:
    prompt: int  # index into the case's prompts
    ok: bool  # a sample of the dump starts with serving's rendering
    sample: str | None = None  # that sample's file
    message: str = ""  # the drift, when not ok


@dataclass
class ChatTemplateData(CheckData):
    """`chat_template`: per chat prompt, whether the dump holds it as serving renders it."""

    KIND: ClassVar[str] = "chat_template"
    prompts: list[PromptRendering] = field(default_factory=list)


def applies(case: Case) -> bool:
    return names_training_data(case) and bool(chat_prompts(case.prompts))


def check_chat_template(run: CaseRun, spec: EngineSpec) -> Verdict:
    case = run.case
    lines, drifted, data = [], [], []
    for i, p in chat_prompts(case.prompts):
        try:
            cap = run.capture(spec, i)
        except ConfigError as e:
            if CAUSE not in str(e):
                raise
            drifted.append(str(e))
            data.append(PromptRendering(i, False, message=str(e)))
            continue
        sample = (cap.meta.extra.get("train_data") or {}).get("sample")  # the train engine's own meta key
        lines.append(
            f"prompt {i}: the dump's sample {sample} starts with the ids serving renders "
            f"({chat.describe(p.chat_template_kwargs)})"
        )
        data.append(PromptRendering(i, True, sample=sample))
    return Verdict(not drifted, "\n".join(drifted + lines), ChatTemplateData(data))


CHECK = CheckSpec(
    "chat_template",
    check_chat_template,
    ENGINE,
    "the training dump holds each chat prompt as the target's chat template renders it for serving",
    when=applies,
    engines=(TRAIN,),
    data=ChatTemplateData,
)
