"""Chat prompts rendered the way a serving engine renders a chat request.

SGLang's and vLLM's OpenAI chat endpoints render `messages` with the target tokenizer's chat
template and `add_generation_prompt=True` (plus any `chat_template_kwargs` of the request, e.g.
Qwen3's `enable_thinking`), then tokenize the text without adding special tokens again: the
template already wrote them. A case prompt given as `messages` becomes exactly those ids, so a
training dump can be checked against what serving will really feed the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Rendering:
    """One way to turn a conversation into token ids, named for a user."""

    label: str
    ids: list[int] = field(default_factory=list)


def render(
    tokenizer, messages: list[dict], kwargs: dict | None = None, add_generation_prompt: bool = True
) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the target's tokenizer has no chat_template (tokenizer_config.json): give the prompt as text or ids"
        )
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(kwargs or {})
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def describe(kwargs: dict | None, add_generation_prompt: bool = True) -> str:
    parts = [f"add_generation_prompt={add_generation_prompt}"] + [
        f"{k}={v!r}" for k, v in sorted((kwargs or {}).items())
    ]
    return "the target's chat template with " + ", ".join(parts)
