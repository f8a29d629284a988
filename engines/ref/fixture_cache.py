"""Where built fixtures live and how they get there: one cache, one lock, atomic publication.

Every fixture provider (the tiny Llama family, DeepSeek-V3, MLA, the failure catalogue, the
training-data dumps, the chat target) builds through this module, so a fixture is either
absent or complete, concurrent processes build each one once, and a killed build leaves
nothing a later reader could mistake for a fixture.

Two layouts:
  * named fixtures, `fixtures/<FIXTURES_VERSION>/<name>/` (`ensure_built`): deterministic builds
    whose recipe is the code at FIXTURES_VERSION;
  * keyed fixtures, `fixtures/<group>/<name>-<key>/` (`publish_keyed`): derived from another
    fixture, keyed by the recipe and the *contents* of what they derive from, so a rebuilt
    source gets a fresh derivative instead of a stale one.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from difftest.paths import cache_root

FIXTURES_VERSION = "v1"
# One thread: reproducible, and far faster than two on a shared 2-core machine (OpenMP spin-waits
# make small-op decoding ~10x slower under contention).
BUILD_THREADS = 1

Log = Callable[[str], None]
Builder = Callable[[Path, "Build"], None]


@dataclass
class Build:
    """What a builder is handed besides its output directory."""

    log: Log


def fixtures_dir() -> Path:
    return cache_root() / "fixtures" / FIXTURES_VERSION


@contextmanager
def locked(directory: Path, name: str) -> Iterator[None]:
    """Exclusive flock on <directory>/.locks/<name>.lock: one builder of a thing at a time across processes
    (builders of different things run side by side)."""
    locks = directory / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def publish(tmp: Path, final: Path) -> None:
    """Move a finished build into place with rename(2): readers see all of it or nothing."""
    if final.exists():  # only with force: move the old one aside first, then drop it
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


@contextmanager
def pinned_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def with_dependencies(names: list[str], deps: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    stack = list(names)
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            stack.extend(deps[n])
    return out


def build_once(final: Path, write: Callable[[Path], None], force: bool = False, log: Log | None = None) -> Path:
    """`write(tmp)` builds `final` once across processes: under its own lock, in a temporary directory
    next to it, renamed into place when complete (readers see all of it or nothing)."""
    if final.exists() and not force:
        return final
    parent = final.parent
    with locked(parent, final.name):
        if final.exists() and not force:  # another process built it while we waited
            return final
        for stale in parent.glob(f".tmp-{final.name}.*"):  # a killed builder's; we hold its lock, nobody owns them
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.time()
        if log:
            log(f"[fixtures] building {final.name} ...")
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}.", dir=parent))
        try:
            write(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            publish(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if log:
            log(f"[fixtures] {final.name} ready in {time.time() - t0:.1f}s: {final}")
    return final


def ensure_built(
    wanted: list[str],
    known: list[str],
    builders: dict[str, Builder],
    deps: dict[str, list[str]],
    log: Log = print,
    force: bool = False,
) -> dict[str, Path]:
    """Build the `wanted` named fixtures unless cached; returns name -> directory.

    `known` is the provider's build order, `builders[name](tmp_dir, build)` writes one fixture,
    `deps[name]` names the fixtures (of the same provider) it needs built first. Each fixture is
    built once across processes (build_once); different fixtures build side by side.
    """
    for name in wanted:
        if name not in known:
            raise KeyError(f"unknown fixture {name!r}; known: {', '.join(known)}")
    order = [n for n in known if n in with_dependencies(wanted, deps)]
    paths = {n: fixtures_dir() / n for n in order}
    if not force and all(p.exists() for p in paths.values()):
        return {n: paths[n] for n in wanted}
    fixtures_dir().mkdir(parents=True, exist_ok=True)
    build = Build(log)
    with torch.random.fork_rng(devices=[]), pinned_threads(BUILD_THREADS), torch.no_grad():
        for name in order:
            rebuild = force and name in wanted
            build_once(paths[name], lambda tmp, name=name: builders[name](tmp, build), force=rebuild, log=log)
    return {n: paths[n] for n in wanted}


def publish_keyed(group: str, name: str, key_parts: list, write: Callable[[Path], None], force: bool = False) -> Path:
    """A keyed fixture: `write(tmp)` builds it once per `key_parts` into `fixtures/<group>/<name>-<key>/`.
    A fixture derived from another keys on its source's contents: difftest.content_digest.signature."""
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:12]
    parent = cache_root() / "fixtures" / group
    parent.mkdir(parents=True, exist_ok=True)
    return build_once(parent / f"{name}-{key}", write, force)


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- what every `difftest.fixtures` provider exposes, written once ------------------------------


def resolve_from(name: str, names: list[str], ensure: Callable[..., dict[str, Path]]) -> Path | None:
    """A provider's resolve_fixture: build `name` through `ensure` if it is one of `names`."""
    return ensure([name], log=log_stderr)[name] if name in names else None


def provider_main(argv: list[str] | None, prog: str, doc: str | None, names: list[str],
                  ensure: Callable[..., dict[str, Path]]) -> int:  # fmt: skip
    """A provider's command line: build its fixtures (all, or those named) and print their quality."""
    import argparse

    from engines.ref.draft_pipeline import summary

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

    prog: str  # how `main` names itself, e.g. "python -m engines.ref.fixtures"
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
