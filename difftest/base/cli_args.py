"""What every `difftest` parser shares: no abbreviations (a prefix of an option is refused, naming
the closest option), usage errors in one line with exit code 4 (difftest.base.exit_codes: the code
pytest gives its own usage errors, so `difftest run` and `pytest` agree), and old option spellings
kept one release as hidden aliases that warn, naming the new one."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Any, NoReturn

from difftest.base.exit_codes import USAGE


class Parser(argparse.ArgumentParser):
    """argparse with allow_abbrev off (subparsers made from it are Parsers too) and one-line errors
    that name the closest option."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def add_subparsers(self, **kwargs: Any):
        kwargs.setdefault("parser_class", Parser)
        return super().add_subparsers(**kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {_with_closest(message, self.option_names())} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(USAGE)

    def option_names(self) -> list[str]:
        """The options this parser documents (hidden deprecated spellings are not suggested)."""
        return [s for a in self._actions if a.help != argparse.SUPPRESS for s in a.option_strings if s.startswith("--")]


def whole_number(least: int):
    """An argparse `type` for a whole number >= `least`: a refusal is the parser's one-line usage error
    (exit 4) naming the option, before the command runs, not a failure deep inside it."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected {least} or more, got {value}")
        return value

    parse.__name__ = "whole number"  # argparse names the type in some messages
    return parse


def non_empty(hint: str):
    """An argparse `type` for a value that may not be empty: what an unset variable gives (`--model=$M`)
    is refused by the parser (exit 4) naming the option, never read as the option left out. `hint`: what
    to give instead."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"empty value (an unset variable?); {hint}")
        return text

    parse.__name__ = "value"  # argparse names the type in some messages
    return parse


def id_list(text: str) -> list[int]:
    """An argparse `type` for layer ids, `2,4,7` (or `2+4+7`, `2 4 7`): whole numbers >= 0."""
    parts = [p for p in re.split(r"[,+\s]+", text.strip()) if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas (e.g. 2,4,7), got {text!r}"
        ) from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 0 separated by commas (e.g. 2,4,7), got {text!r}")
    return ids


def closest(name: str, known: list[str]) -> str | None:
    """The known option `name` most likely meant: one it is a prefix of, else the nearest spelling."""
    bare = name.split("=", 1)[0]
    prefixed = [k for k in known if k.startswith(bare)]
    if len(prefixed) == 1:
        return prefixed[0]
    near = difflib.get_close_matches(bare, known, n=1, cutoff=0.6)
    return near[0] if near else None


def _with_closest(message: str, known: list[str]) -> str:
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return message
    unknown = message[len(prefix) :].split()
    hints = [f"{u} (did you mean {c}?)" for u in unknown if u.startswith("--") and (c := closest(u, known))]
    return f"unknown option {', '.join(hints) if hints else ' '.join(unknown)}"


def unknown_options(args: list[str], known: list[str]) -> str | None:
    """For a command that passes what it does not know on (`difftest run` to pytest): the first of
    `args` that is a misspelling or a prefix of one of `known`, as one line naming the closest."""
    for arg in args:
        if not arg.startswith("--"):
            continue
        bare = arg.split("=", 1)[0]
        if bare in known:
            continue
        near = closest(bare, known)
        if near is not None and (near.startswith(bare) or difflib.SequenceMatcher(None, bare, near).ratio() >= 0.8):
            return f"unknown option {bare} (did you mean {near}?)"
    return None


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option, kept one release: it stores into the new option's dest and
    prints one warning line naming the new spelling. Hidden from --help."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs: Any) -> None:
        self.new = new
        kwargs["help"] = argparse.SUPPRESS
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"difftest: {option_string} is deprecated and goes in the next release; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated_alias(parser: argparse.ArgumentParser, old: list[str], new: str, dest: str) -> None:
    """Accept `old` (e.g. ["--report-dir"]) for one release as a hidden alias of option `new`."""
    parser.add_argument(*old, dest=dest, action=DeprecatedAlias, new=new, default=argparse.SUPPRESS)
