"""Where difftest keeps what outlives a run: one answer for every module and engine."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import functools
import hashlib
import os
import re
from pathlib import Path


def cache_root() -> Path:
    """`$DIFFTEST_CACHE` (with `~` expanded), else `~/.cache/difftest`: fixtures, capture cache,
    engine environments and engine-side overlays all live under it."""
    env = os.environ.get("DIFFTEST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "difftest"


# The file written last into an engine environment difftest built (scripts/setup-engine, `difftest env
# create`): an environment without it is unfinished, or not ours.
ENV_BUILT_MARK = ".complete"


def log_file_name(spec_id: str) -> str:
    """A file name for an engine's log: the spec id, made safe (no '/', at most ~120 bytes: a long
    spec parameter must not make the log, and so the engine, impossible to start)."""
    name = re.sub(r"[^\w.\[\]=,@+-]", "_", spec_id)
    if len(name.encode()) > 120:
        name = name[:80] + "-" + hashlib.sha256(spec_id.encode()).hexdigest()[:12]
    return name + ".log"


# The top-level packages an engine worker imports: the core, and every package an entry point of
# difftest's groups names (the built-in engines and fixtures, and any installed plugin's).
_ENTRY_POINT_GROUPS = "difftest."
# Where the engines' setup scripts find the uv-pip wrapper, relative to the import root (a checkout's
# scripts/uv-pip; in an installed wheel, the packaged copy linked there).
UV_PIP = "scripts/uv-pip"


def _worker_packages() -> dict[str, Path]:
    """Top-level package name -> its directory, for the core and every package its entry points name."""

    names = {"difftest"}
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group.startswith(_ENTRY_POINT_GROUPS):
                names.add(ep.value.split(":")[0].split(".")[0])
    out = {}
    for name in sorted(names):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            out[name] = Path(next(iter(spec.submodule_search_locations)))
    return out


@functools.cache
def import_root() -> Path:
    """A directory that, put on PYTHONPATH, makes difftest and its engines and fixtures importable, laid
    out as a checkout's root is (the packages, scripts/uv-pip): engine workers run in the engines' own
    environments, which do not have difftest installed, and the engines' setup scripts find the wrapper
    at ROOT/scripts/uv-pip.

    From a checkout, the checkout itself. From an installed wheel, never site-packages (it would put the
    core venv's torch before the engine's): a cache folder of links to the installed packages, keyed by
    where they are installed, so two venvs never share one."""
    here = Path(__file__).resolve().parents[2]
    if (here / "pyproject.toml").is_file() and (here / UV_PIP).is_file():
        return here
    packages = _worker_packages()
    key = hashlib.sha256("\0".join(f"{n}={p}" for n, p in packages.items()).encode()).hexdigest()[:12]
    root = cache_root() / "import-roots" / key
    links = dict(packages)
    links[UV_PIP] = Path(__file__).resolve().parents[1] / "run" / "uv-pip"
    for rel, target in links.items():
        link = root / rel
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        # a fresh link renamed over the old one: a worker starting beside us never sees a missing package
        tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, link)
    return root
