"""`difftest cache`: what difftest keeps in its cache (`$DIFFTEST_CACHE`, else ~/.cache/difftest),
by kind, and `difftest cache prune` to remove what can be remade.

Prune removes only what difftest wrote and can rebuild without asking anyone: captured tensors
(`captures/`, recomputed by the next run) and engine-info records (`engine-info/`, rewritten when a
worker starts). Environments, fixtures and release recipes are never pruned here: an environment may
be in use by a running worker, and each takes minutes to remake (`difftest env list` shows them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from difftest.base.paths import cache_root
from difftest.run.envs import tree_size

# the kinds `difftest cache` sizes, each a folder of the cache
KINDS = ("captures", "envs", "fixtures", "releases", "engine-info")
PRUNABLE = ("captures", "engine-info")


@dataclass
class KindSize:
    kind: str
    path: str
    bytes: int
    entries: int


def sizes(root: Path) -> list[KindSize]:
    out = []
    for kind in KINDS:
        path = root / kind
        entries = list(path.iterdir()) if path.is_dir() else []
        out.append(KindSize(kind, str(path), tree_size(path) if path.is_dir() else 0, len(entries)))
    return out


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def prune_candidates(root: Path, kinds: tuple[str, ...], older_than_days: float | None) -> list[Path]:
    """The entries of `kinds` last modified before the cut-off (every entry without one)."""
    cut = None if older_than_days is None else time.time() - older_than_days * 86400
    found = []
    for kind in kinds:
        folder = root / kind
        if not folder.is_dir():
            continue
        for dirpath, _dirs, files in os.walk(folder):
            for name in files:
                path = Path(dirpath) / name
                try:
                    if cut is None or path.lstat().st_mtime < cut:
                        found.append(path)
                except OSError:
                    continue
    return found


def _nonnegative_days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of days, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more days, got {text}")
    return value


def add_parser(sub) -> None:
    c = sub.add_parser("cache", help="the cache's size by kind; `cache prune` removes captures and engine infos")
    c.add_argument("--json", action="store_true", help="print the sizes as JSON")
    c.set_defaults(handler=show, cache_command=None)
    csub = c.add_subparsers(dest="cache_command")
    p = csub.add_parser("prune", help="remove captured tensors and engine-info records (never environments)")
    p.add_argument("--captures", action="store_true", help="only captured tensors (default: captures and engine infos)")
    p.add_argument("--older-than", type=_nonnegative_days, default=None, metavar="DAYS", help="only entries older")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed and remove nothing")
    p.set_defaults(handler=prune)


def show(args: argparse.Namespace) -> int:
    root = cache_root()
    rows = sizes(root)
    if args.json:
        print(json.dumps({"root": str(root), "kinds": [asdict(r) for r in rows]}))
        return 0
    print(f"difftest cache: {root}")
    for r in rows:
        print(f"  {r.kind:<12} {human(r.bytes):>10}  {r.entries} entries  {r.path}")
    print(f"  {'total':<12} {human(sum(r.bytes for r in rows)):>10}")
    return 0


def prune(args: argparse.Namespace) -> int:
    root = cache_root()
    kinds = ("captures",) if args.captures else PRUNABLE
    files = prune_candidates(root, kinds, args.older_than)
    total = 0
    for path in files:
        try:
            size = path.lstat().st_size
            if not args.dry_run:
                path.unlink()
            total += size
        except FileNotFoundError:  # pruned meanwhile by another run
            continue
        except OSError as e:
            print(f"difftest cache prune: {path}: {e.strerror or e}", file=sys.stderr)
            return 1
    if not args.dry_run:
        for kind in kinds:  # folders the removed files leave empty
            for dirpath, _dirs, _files in sorted(os.walk(root / kind), key=lambda w: -len(w[0])):
                if Path(dirpath) != root / kind and not os.listdir(dirpath):
                    shutil.rmtree(dirpath, ignore_errors=True)
    verb = "would remove" if args.dry_run else "removed"
    print(f"difftest cache prune: {verb} {len(files)} files, {human(total)} ({', '.join(kinds)} under {root})")
    return 0
