"""What a server's own command line asks for, read before the server parses it (engines/*/serve.py
pass their arguments through unchanged, but set the environment some of them need first)."""

from __future__ import annotations


def option(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The last value given for any of `names` (`--name V` or `--name=V`): the one argparse keeps."""
    value = None
    for i, word in enumerate(argv):
        name, eq, given = word.partition("=")
        if name in names:
            value = given if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return value


def int_option(argv: list[str], names: tuple[str, ...], default: int) -> int:
    """An integer option; `default` when absent or not an integer (the server refuses that itself)."""
    value = option(argv, names)
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
