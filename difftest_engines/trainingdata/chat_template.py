"""Chat-template drift: the training dump tokenised one way, serving rendering another.

A draft learns on the token ids its training data holds. When that data was rendered with
another chat template than serving uses (thinking on in the data, off in serving; the raw prompt
without any template; another model's template), the draft is asked at serving time to
continue contexts it never saw, and acceptance drops with every engine wired correctly
(sgl-project/SpecForge issue 296). Nothing errors: the ids are all in the vocabulary.

For a case prompt given as chat `messages`, the serving ids are what SGLang and vLLM render
(difftest.case.chat: the target's chat template, add_generation_prompt=True, the prompt's
chat_template_kwargs). The dump's sample of that conversation is the one that holds the last
user message's content tokens. Rendered alike, the sample starts with the serving ids; otherwise
the first differing token is named, and the renderings the harness can make (each boolean
template flag flipped, no generation prompt, the raw text with no template) are tried against
the sample to say which one the dump was made with.
"""

from __future__ import annotations

import re
from pathlib import Path
from dataclasses import asdict, dataclass

import torch

from difftest.api import chat
from difftest.api import Prompt

CAUSE = "chat-template drift"
# boolean flags chat templates read (Qwen3 `enable_thinking`, DeepSeek-V3.1 `thinking`, ...): found in
# the template source, each is tried flipped
_FLAG = re.compile(r"\b(enable_thinking|thinking|add_thinking|reasoning)\b")


@dataclass
class Drift:
    prompt: int
    serving: str  # how serving renders it
    sample: str | None  # the dump's sample of this conversation (None: none holds its user message)
    position: int | None  # first differing token index
    dump_token: str | None
    serving_token: str | None
    matches: str | None  # the rendering the sample starts with, if the harness can make it

    def message(self) -> str:
        if self.sample is None:
            return (
                f"prompt {self.prompt}: {CAUSE}? no sample of the dump holds this conversation's last user message "
                f"as the target's tokenizer tokenises it: the dump is of other conversations or another tokenizer"
            )
        head = (
            f"prompt {self.prompt}: {CAUSE}: the training dump ({self.sample}) renders this conversation differently "
            f"from serving; first difference at token {self.position}: the dump has {self.dump_token}, serving "
            f"renders {self.serving_token} ({self.serving})"
        )
        if self.matches:
            return (
                f"{head}; the dump matches {self.matches}: the draft learned on contexts serving never shows it. "
                f"Fix: regenerate the training data with the serving settings, or serve with the training "
                f"settings (chat_template_kwargs)"
            )
        return (
            f"{head}; none of the renderings the harness can make matches the dump (another template or "
            f"tokenizer?). Fix: regenerate the training data with the serving template"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def _token(tokenizer, ids: list[int], i: int) -> str:
    if i >= len(ids):
        return "the end of the sequence"
    return f"{tokenizer.convert_ids_to_tokens(int(ids[i]))!r} (id {int(ids[i])})"


def _contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return n > 0 and any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def candidate_renderings(tokenizer, prompt: Prompt) -> list[chat.Rendering]:
    """The renderings the dump may have been made with, serving's first."""
    kwargs = dict(prompt.chat_template_kwargs or {})
    out = [chat.Rendering(chat.describe(kwargs), chat.render(tokenizer, prompt.messages, kwargs))]
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
    for flag in sorted(set(_FLAG.findall(template))):
        for value in (True, False):
            if kwargs.get(flag, None) is value:
                continue
            alt = {**kwargs, flag: value}
            out.append(chat.Rendering(chat.describe(alt), chat.render(tokenizer, prompt.messages, alt)))
    out.append(
        chat.Rendering(
            chat.describe(kwargs, add_generation_prompt=False),
            chat.render(tokenizer, prompt.messages, kwargs, add_generation_prompt=False),
        )
    )
    text = "\n".join(m["content"] for m in prompt.messages)
    for special in (True, False):
        ids = list(tokenizer(text, add_special_tokens=special)["input_ids"])
        out.append(chat.Rendering(f"the raw message text with no chat template (add_special_tokens={special})", ids))
    return out


def find_drift(tokenizer, prompt: Prompt, index: int, samples: list) -> Drift | None:
    """None when a sample starts with serving's rendering of `prompt`; else what differs."""
    renderings = candidate_renderings(tokenizer, prompt)
    serving = renderings[0]
    want = torch.tensor(serving.ids, dtype=torch.long)
    for s in samples:
        if len(s) >= len(serving.ids) and torch.equal(s.input_ids[: len(serving.ids)], want):
            return None
    user = [m["content"] for m in prompt.messages if m["role"] == "user"] or [prompt.messages[-1]["content"]]
    content = list(tokenizer(user[-1], add_special_tokens=False)["input_ids"])
    sample = next((s for s in samples if _contains(s.input_ids.tolist(), content)), None)
    if sample is None:
        return Drift(index, serving.label, None, None, None, None, None)
    ids = sample.input_ids.tolist()
    pos = next((i for i, (a, b) in enumerate(zip(ids, serving.ids)) if a != b), min(len(ids), len(serving.ids)))
    matches = next((r.label for r in renderings[1:] if r.ids and ids[: len(r.ids)] == r.ids), None)
    return Drift(
        index,
        serving.label,
        Path(str(sample.source)).name,
        pos,
        _token(tokenizer, ids, pos),
        _token(tokenizer, serving.ids, pos),
        matches,
    )


def chat_prompts(prompts: list[Prompt]) -> list[tuple[int, Prompt]]:
    return [(i, p) for i, p in enumerate(prompts) if p.messages is not None]
