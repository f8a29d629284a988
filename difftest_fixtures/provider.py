"""What every `difftest.fixtures` provider of named fixtures exposes, written once.

Above the cache (difftest_fixtures/cache.py) and the draft pipeline (difftest_fixtures/drafts.py: the quality
summary a provider's command line prints), so neither of those needs the other's caller.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from difftest_fixtures.cache import fixtures_dir, log_stderr
from difftest_fixtures.drafts import summary


def resolve_from(name: str, names: list[str], ensure: Callable[..., dict[str, Path]]) -> Path | None:
    """A provider's resolve_fixture: build `name` through `ensure` if it is one of `names`."""
    return ensure([name], log=log_stderr)[name] if name in names else None


def provider_main(
    argv: list[str] | None, prog: str, doc: str | None, names: list[str], ensure: Callable[..., dict[str, Path]]
) -> int:
    """A provider's command line: build its fixtures (all, or those named) and print their quality."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").splitlines()[0] if doc else None)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("names", nargs="*", help=f"fixtures to build (default: all): {', '.join(names)}")
    args = parser.parse_args(argv)
    t0 = time.time()
    paths = ensure(args.names or None, force=args.force)
    print(f"[fixtures] cache: {fixtures_dir()}  ({time.time() - t0:.1f}s)")
    for name, path in paths.items():
        q = path / "quality.json"
        print(summary(name, json.loads(q.read_text())) if q.exists() else f"[fixtures] {name}: {path}")
    return 0


@dataclass(frozen=True)
class NamedProvider:
    """The `difftest.fixtures` interface of a provider of named fixtures, written once: a provider
    module binds `resolve_fixture`, `build_all` and `main` from one of these."""

    prog: str  # how `main` names itself, e.g. "python -m difftest_fixtures.tiny_llama"
    doc: str | None
    names: list[str]
    ensure: Callable[..., dict[str, Path]]  # the provider's ensure_fixtures

    def resolve_fixture(self, name: str) -> Path | None:
        """`fixture:NAME` in a case: the fixture's directory, built on first use; None if not ours."""
        return resolve_from(name, self.names, self.ensure)

    def build_all(self, force: bool = False) -> None:
        """`difftest fixtures [--force]`: build every fixture of the provider and print its quality figures."""
        self.main(["--force"] if force else [])

    def main(self, argv: list[str] | None = None) -> int:
        return provider_main(argv, self.prog, self.doc, self.names, self.ensure)
