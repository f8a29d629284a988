"""Prompt sets: a case's `prompts:` (or `speculative.prompts:`) read from a JSONL or JSON file,

    prompts: {file: prompts/chat_small.jsonl, field: messages, limit: 16}

the path relative to the case file. Each record is one prompt; `field` names the record's key that
holds it (default: the first of FIELDS a record has). What the field holds decides the prompt:

- a string: text, tokenized with the target's tokenizer;
- a list of integers: token ids, sent as they are;
- a list of {role, content}: chat messages (OpenAI style), rendered with the target's chat template
  as serving renders a chat request (difftest.case.chat);
- a list of {from, value}: a ShareGPT conversation (human/gpt/system), read as chat messages;
- a list of strings: MT-Bench-style `turns`; the first turn is the user's message (later turns answer
  a reply the target has not written yet).

A conversation that ends with the assistant's reply (a training sample) is cut before that reply: the
prompt is what the target is asked to continue. The records are read into the case's prompts when the
case loads, so a capture's cache key holds the prompts themselves (their token ids), not the file's
path: editing the file re-captures, moving it does not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from difftest.base.errors import ConfigError
from difftest.base.settings import Place, suggest
from difftest.case.prompt import Prompt, read_prompt

# the record keys a prompt is looked for under when the case names no `field`, in this order
FIELDS = ("messages", "conversations", "turns", "prompt", "text", "input_ids", "ids")
# ShareGPT's speakers -> chat roles (the names FastChat and its exports write)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class PromptFile:
    """`{file, field, limit}` as a case writes it (difftest.case.case_schema.PROMPT_FILE)."""

    file: str
    field: str | None = None
    limit: int | None = None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_prompt_file(spec: PromptFile, place: Place) -> list[Prompt]:
    """The prompts of `spec.file` (relative to the case file at `place`); each refusal is one line
    naming the case's field and the file (with the line of a JSONL record)."""
    path = Path(spec.file).expanduser()
    if not path.is_absolute():
        path = Path(place.file).parent / path
    where = f"{place}: {spec.file}"
    if not path.is_file():
        raise ConfigError(f"{where}: no such file" + (" (a directory)" if path.is_dir() else ""))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read ({e.strerror})") from None
    records = _records(text, path.suffix.lower(), where)
    if not records:
        raise ConfigError(f"{where}: no prompts (the file holds no records)")
    if spec.limit is not None:
        records = records[: spec.limit]
    field = spec.field or _default_field(records[0][1], where)
    return [_prompt(value, field, f"{where}:{at}") for at, value in records]


def _records(text: str, suffix: str, where: str) -> list[tuple[str, object]]:
    """(where in the file, record) for each record: JSONL's non-blank lines, or a JSON list."""
    if suffix == ".json":
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}:{e.lineno}: not JSON ({e.msg})") from None
        if not isinstance(data, list):
            raise ConfigError(f"{where}: expected a JSON list of records, got {type(data).__name__}")
        return [(f"[{i}]", r) for i, r in enumerate(data)]
    if suffix != ".jsonl":
        raise ConfigError(f"{where}: expected a .jsonl or .json file")
    out: list[tuple[str, object]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((str(n), json.loads(line)))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}:{n}: not JSON ({e.msg})") from None
    return out


def _default_field(record: object, where: str) -> str | None:
    """The first of FIELDS the first record has; None where records are bare strings or id lists."""
    if not isinstance(record, dict):
        return None
    found = next((f for f in FIELDS if f in record), None)
    if found is None:
        raise ConfigError(
            f"{where}: no prompt field in the first record (fields: {', '.join(map(str, record)) or 'none'}); "
            f"name one with `field:` (looked for {', '.join(FIELDS)})"
        )
    return found


def _prompt(record: object, field: str | None, where: str) -> Prompt:
    if field is None:
        value = record
    elif not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object with field {field!r}, got {_shown(record)}")
    elif field not in record:
        raise ConfigError(
            f"{where}: no field {field!r}{suggest(field, record)} (fields: {', '.join(map(str, record)) or 'none'})"
        )
    else:
        value = record[field]
    # refusals name the record's place in the file (file:line), what there is to fix
    return read_prompt(_as_case_prompt(value, where), Place(where))


def _as_case_prompt(value: object, where: str) -> object:
    """A record's value as a case would write the prompt (a string, {ids}, {messages})."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected text, token ids or a conversation, got {_shown(value)}")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return {"ids": value}
    if all(isinstance(v, str) for v in value):  # MT-Bench turns: the first is the question asked
        return {"messages": [{"role": "user", "content": value[0]}]}
    if not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{where}: expected text, token ids or a list of messages, got {_shown(value)}")
    messages = [_message(m, f"{where}: message {i}") for i, m in enumerate(value)]
    while messages and messages[-1]["role"] == "assistant":  # the reply is what the target writes
        messages.pop()
    if not messages:
        raise ConfigError(f"{where}: the conversation holds only assistant messages: nothing to prompt with")
    return {"messages": messages}


def _message(m: dict, where: str) -> dict:
    if "from" in m or "value" in m:  # ShareGPT
        speaker = m.get("from")
        if speaker not in SHAREGPT_ROLES:
            raise ConfigError(f"{where}: 'from' {_shown(speaker)} is not one of {', '.join(SHAREGPT_ROLES)}")
        return {"role": SHAREGPT_ROLES[speaker], "content": m.get("value")}
    if "role" not in m or "content" not in m:
        raise ConfigError(
            f"{where}: expected {{role, content}} or ShareGPT's {{from, value}}, got keys {', '.join(map(str, m))}"
        )
    # other keys (name, tool_calls, weights) are the data set's, not the template's input here
    return {"role": m["role"], "content": m["content"]}
