"""`difftest init --target DIR --draft DIR [--server URL] [--train-data DIR] [--out CASE.yaml]`: a
starter case that runs.

It reads the target's and the draft's config.json (the target's dtype, its chat template, the draft's
declared layer ids), writes the wiring the draft's config implies (its ids read by the default preset,
difftest.rules.wiring.DEFAULT_PRESET, the speculators convention; a comment names `wiring: specforge`
and `wiring: infer`, which finds it from the draft's behaviour but needs prompts the target answers
sensibly, so a starter that must run on any checkpoint does not default to it), copies the
shipped prompt set beside the case (difftest/case/prompt_sets/chat_small.jsonl: chat messages where the target has
a chat template, their plain text where it has none), lists the engines it can run (the calibrating
engine, every engine whose environment is built in the user cache, the engine that reads a running
server when --server is given and the one that reads training data when --train-data is), and writes
comments saying what it inferred and what to check. The case is written whole or not at all; an
existing file is kept unless --force.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from difftest.base.settings import suggest
from difftest.base import exit_codes
from difftest.base.dtypes import CASE_DTYPES
from difftest.base.errors import DifftestError
from difftest.base.paths import cache_root
from difftest.base.registry import calibration_engine, engine_schema, registered_engines
from difftest.case.case import load_case
from difftest.rules.wiring import DEFAULT_PRESET
from difftest.run.case_run import resolve_fixture


class InitUsageError(DifftestError):
    """A bad option value (exit_codes.USAGE), where a checkpoint or config that cannot be used is
    exit_codes.CONFIG."""


HELP = "write a starter case for a target and its draft (wiring inferred, engines found, a prompt set)"
PROMPT_SET = "chat_small.jsonl"
# the shipped prompt sets are package data (pyproject.toml), so an installed wheel has them too
SHIPPED_PROMPTS = Path(__file__).parent / "case" / "prompt_sets"


def add_parser(sub) -> None:
    p = sub.add_parser("init", help=HELP, allow_abbrev=False)
    p.add_argument("--target", required=True, help="the target checkpoint directory (or fixture:NAME)")
    p.add_argument("--draft", required=True, help="the EAGLE-3 draft checkpoint directory (or fixture:NAME)")
    p.add_argument("--server", default=None, metavar="URL", help="a running SGLang or vLLM server serving them")
    p.add_argument("--train-data", default=None, metavar="DIR", help="the draft's training data (a dump)")
    p.add_argument("--out", default="case.yaml", metavar="CASE.yaml", help="where to write (default: case.yaml)")
    p.add_argument(
        "--engines",
        default=None,
        help="the engines the case is meant for (default: the reference and every engine found)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing case file")
    p.set_defaults(handler=main)


@dataclass
class Starter:
    """What init found, and the notes the case's comments carry."""

    target: str  # as the case writes it: fixture:NAME, or a path relative to the case
    draft: str
    dtype: str
    prompt_field: str  # the prompt set's field: messages (chat template) or prompt (text)
    engines: list[str]
    settings: dict[str, dict] = field(default_factory=dict)  # engines: <name>: {...}
    notes: list[str] = field(default_factory=list)


def _checkpoint(ref: str, option: str) -> Path:
    """The directory behind --target / --draft (a fixture is built on first use)."""
    if ref.startswith("fixture:"):
        return Path(resolve_fixture(ref))
    path = Path(ref).expanduser()
    if not (path / "config.json").is_file():
        raise DifftestError(f"{option} {ref}: no config.json there (expected a checkpoint directory)")
    return path


def _config(path: Path, option: str) -> dict:
    try:
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DifftestError(f"{option} {path}/config.json: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise DifftestError(f"{option} {path}/config.json: expected a JSON object")
    return data


def _written_path(ref: str, case_dir: Path) -> str:
    """fixture:NAME as it is; a path relative to the case's folder where it can be (the case moves
    with its checkpoints), else absolute."""
    if ref.startswith("fixture:"):
        return ref
    path = Path(ref).expanduser().resolve()
    try:
        return os.path.relpath(path, case_dir.resolve())
    except ValueError:  # another drive
        return str(path)


def _dtype(config: dict) -> tuple[str, str]:
    """The case's dtype from the target config (transformers writes torch_dtype, newer ones dtype)."""
    text_config = config.get("text_config")
    nested = text_config.get("torch_dtype") if isinstance(text_config, dict) else None
    stored = config.get("torch_dtype") or config.get("dtype") or nested
    if isinstance(stored, str) and stored in CASE_DTYPES:
        return stored, f"dtype: {stored}, the target config's"
    return "float32", f"dtype: float32 (the target config states {stored!r}, not one of {', '.join(CASE_DTYPES)})"


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return bool(isinstance(config, dict) and config.get("chat_template"))


def _declared_ids(config: dict) -> str:
    eagle = config.get("eagle_config")
    eagle = eagle if isinstance(eagle, dict) else {}
    for where, ids in (
        ("eagle_config.eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids")),
        ("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids")),
    ):
        if ids is not None:
            return f"the draft's config declares layer ids {ids} ({where})"
    return "the draft's config declares no layer ids (each engine reads its default)"


def _engine_with(setting: str) -> str | None:
    """The registered engine whose settings include `setting` (url: reads a running server; data: reads
    training data): found by what it declares, not by name."""
    for name in registered_engines():
        schema = engine_schema(name)
        if schema is not None and setting in schema.names():
            return name
    return None


def _built_engines() -> list[str]:
    """Registered engines whose environment is built in the user cache (what `difftest run` starts)."""
    envs = cache_root() / "envs"
    return [n for n in registered_engines() if (envs / n / "bin" / "python").exists()]


def _engines(args: argparse.Namespace, notes: list[str]) -> tuple[list[str], dict[str, dict]]:
    reference = calibration_engine()
    settings: dict[str, dict] = {}
    found = [reference]
    for option, setting, value in (("--server", "url", args.server), ("--train-data", "data", args.train_data)):
        if value is None:
            continue
        if not value.strip():  # an unset variable: refused, not written into the case as an empty setting
            raise InitUsageError(f"{option}: empty value (an unset variable?); give a value or leave the option out")
        engine = _engine_with(setting)
        if engine is None:
            raise DifftestError(f"{option}: no installed engine reads a {setting!r} setting")
        settings[engine] = {setting: value if setting == "url" else str(Path(value).expanduser().resolve())}
        found.append(engine)
    built = _built_engines()
    found += [n for n in built if n not in found]
    notes.append(
        f"engines: {', '.join(built)} have environments in {cache_root() / 'envs'}"
        if built
        else "engines: no engine environment is built yet (`difftest env create sglang` builds one)"
    )
    if args.engines is None:
        return found, settings
    chosen = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not chosen:  # what an unset variable gives (--engines=$ENGINES): refused, as `difftest run` refuses it
        raise InitUsageError(
            "--engines: empty value (an unset variable?); give engines, e.g. ref,sglang, or leave the option out"
        )
    known = registered_engines()
    for e in chosen:
        if e.split("[")[0].split("@")[0] not in known:
            raise InitUsageError(f"--engines: unknown engine {e!r}{suggest(e, known)} (known: {', '.join(known)})")
    return chosen, settings


def _prompt_set(case_dir: Path, notes: list[str]) -> Path:
    """The shipped prompt set, copied beside the case (prompts/chat_small.jsonl); a copy already there
    is the user's to edit and is kept."""
    source = SHIPPED_PROMPTS / PROMPT_SET
    dest = case_dir / "prompts" / PROMPT_SET
    if dest.exists():
        if not source.is_file() or dest.read_bytes() != source.read_bytes():
            notes.append(f"prompts: {dest} was already there and is kept as it is")
        return dest
    if not source.is_file():
        raise DifftestError(f"the shipped prompt set {source} is missing (a broken install?)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    return dest


def starter(args: argparse.Namespace, case_dir: Path) -> Starter:
    target_dir, draft_dir = _checkpoint(args.target, "--target"), _checkpoint(args.draft, "--draft")
    target_config, draft_config = _config(target_dir, "--target"), _config(draft_dir, "--draft")
    dtype, dtype_note = _dtype(target_config)
    chat = _has_chat_template(target_dir)
    notes = [
        f"target: {target_config.get('architectures', ['?'])[0]}, "
        f"{target_config.get('num_hidden_layers', '?')} layers; {dtype_note}",
        f"draft: {draft_config.get('architectures', ['?'])[0]}; {_declared_ids(draft_config)}",
        f"wiring: {DEFAULT_PRESET}: the draft's ids read as {DEFAULT_PRESET} reads them (h[k], the "
        "speculators convention); CHECK: a draft trained by SpecForge is `wiring: specforge`; `wiring: infer` "
        "finds what it was trained on from its behaviour (it needs prompts the target answers sensibly)",
        "prompts: "
        + (
            "chat messages rendered with the target's chat template, as serving renders a chat request"
            if chat
            else "the target has no chat template: the prompts' plain text, tokenized"
        )
        + "; CHECK: point `file:` at prompts like your traffic (JSONL: messages, ShareGPT conversations, text)",
    ]
    engines, settings = _engines(args, notes)
    return Starter(
        _written_path(args.target, case_dir),
        _written_path(args.draft, case_dir),
        dtype,
        "messages" if chat else "prompt",
        engines,
        settings,
        notes,
    )


def render(s: Starter, out: Path, prompt_file: Path) -> str:
    """The case file's text: the notes as comments, then the fields."""
    engines = ",".join(s.engines)
    lines = [f"# Written by `difftest init` on {date.today().isoformat()}. What it found and what to check:"]
    for note in s.notes:  # wrapped at 100 columns: a case is read in an editor
        lines += textwrap.wrap(note, 100, initial_indent="# - ", subsequent_indent="#   ", break_on_hyphens=False)
    lines += [f"# Run: difftest run {out.name} --engines={engines}", ""]
    lines += [
        f"target: {json.dumps(s.target)}",
        f"draft: {json.dumps(s.draft)}",
        f"dtype: {s.dtype}",
        f"wiring: {DEFAULT_PRESET}",
        f"prompts: {{file: {json.dumps(os.path.relpath(prompt_file, out.parent))}, field: {s.prompt_field}}}",
        "speculative: {num_steps: 4, max_new_tokens: 32}",
    ]
    if s.settings:
        lines.append("engines:")
        lines += [f"  {name}: {json.dumps(values)}" for name, values in s.settings.items()]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        if out.exists() and not args.force:
            raise InitUsageError(f"--out {out}: already exists (--force replaces it)")
        if out.exists() and not out.is_file():
            raise InitUsageError(f"--out {out}: not a file")
        case_dir = out.parent.resolve()
        case_dir.mkdir(parents=True, exist_ok=True)
        s = starter(args, case_dir)
        prompt_file = _prompt_set(case_dir, s.notes)
        text = render(s, out, prompt_file)
        partial = out.with_name(f".{out.name}.partial")
        partial.write_text(text, encoding="utf-8")
        try:
            load_case(partial)  # the case loads, or nothing is written
        except DifftestError:
            partial.unlink()
            raise
        partial.replace(out)
    except DifftestError as e:
        print(f"difftest init: {e}", file=sys.stderr)
        return exit_codes.USAGE if isinstance(e, InitUsageError) else exit_codes.CONFIG
    print(f"wrote {out}: " + "; ".join(s.notes[:1]))
    print(f"next: difftest run {out} --engines={','.join(s.engines)}")
    return 0
