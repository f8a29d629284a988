"""A case's prompt: text, token ids sent as they are, or a chat request rendered with the target's
chat template as serving renders it (difftest.case.chat); read from the case file by `read_prompt`."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from difftest.base.settings import Place, unknown_key
from difftest.case.chat import ROLES


@dataclass
class Prompt:
    text: str | None = None
    ids: list[int] | None = None
    # a chat request: rendered with the target's chat template as serving renders it (difftest.case.chat)
    messages: list[dict] | None = None
    chat_template_kwargs: dict | None = None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse_unknown(value: dict, known: Collection[str], place: Place) -> None:
    for key in value:
        if key not in known:
            raise unknown_key(str(place.at(key)), key, known, "field")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML's true is not 1


def read_prompt(value: object, place: Place) -> Prompt:
    """A prompt as a case writes it: text, {ids: [...]} or {messages: [...][, chat_template_kwargs]}."""
    if isinstance(value, str):
        if not value.strip():
            raise place.error("empty prompt")
        return Prompt(text=value)
    if isinstance(value, dict) and "ids" in value:
        # ids are sent as they are; messages and their kwargs go through the chat template: with
        # both, one of them would be dropped without a word
        chat = next((k for k in ("messages", "chat_template_kwargs") if k in value), None)
        if chat is not None:
            raise place.error(
                f"both ids and {chat} given; a prompt is either {{ids: [...]}} (sent as they are) "
                "or {messages: [...]} (rendered with the chat template)"
            )
    if isinstance(value, dict) and "ids" not in value and ("messages" in value or "chat_template_kwargs" in value):
        return _chat_prompt(value, place)
    if isinstance(value, dict):
        _refuse_unknown(value, {"ids", "messages", "chat_template_kwargs"}, place)
        ids = value.get("ids")
        if not isinstance(ids, list) or not ids or not all(_is_int(i) and i >= 0 for i in ids):
            raise place.at("ids").error("expected a non-empty list of non-negative integers")
        return Prompt(ids=list(ids))
    raise place.error(f"expected a string, {{ids: [...]}} or {{messages: [...]}}, got {_shown(value)}")


def _chat_prompt(value: dict, place: Place) -> Prompt:
    """{messages: [{role, content}, ...], chat_template_kwargs: {name: scalar}} (difftest.case.chat)."""
    _refuse_unknown(value, {"messages", "chat_template_kwargs"}, place)
    messages = value.get("messages")
    if not isinstance(messages, list) or not messages:
        raise place.at("messages").error("expected a non-empty list of {role, content}")
    for j, m in enumerate(messages):
        at = place.at("messages").item(j)
        if not isinstance(m, dict):
            raise at.error(f"expected a mapping {{role, content}}, got {_shown(m)}")
        _refuse_unknown(m, {"role", "content"}, at)
        if m.get("role") not in ROLES:
            raise at.at("role").error(f"expected one of {', '.join(ROLES)}, got {_shown(m.get('role'))}")
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            raise at.at("content").error("expected a non-empty string")
    kwargs = value.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise place.at("chat_template_kwargs").error(f"expected a mapping, got {_shown(kwargs)}")
    for k, v in kwargs.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, (bool, int, float, str))):
            raise place.at("chat_template_kwargs").at(k).error(f"expected a scalar, got {_shown(v)}")
    return Prompt(messages=[dict(m) for m in messages], chat_template_kwargs=dict(kwargs))
