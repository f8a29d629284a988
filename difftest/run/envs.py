"""Engine environments for versioned specs: `difftest env create sglang==0.5.22 [--label old]`
and the project file that maps `NAME@LABEL` to an interpreter.

An environment is built from the engine's pinned requirements (engines/NAME/requirements-cpu.txt)
with the engine's own distribution pinned to the asked version, by the engine's setup-env.sh,
in `${DIFFTEST_CACHE:-~/.cache/difftest}/envs/NAME-<hash>`. The hash covers the rewritten
requirements and setup-env.sh exactly as scripts/setup-engine hashes them, so the pinned
version lands in the very environment `scripts/setup-engine NAME` builds (and reuses it).
`envs/NAME@LABEL` (LABEL defaults to the version) then links to it, which is where
`--engines=NAME@LABEL` finds its interpreter without flags.

Project file: `difftest.toml` in the project root (pytest's rootdir)::

    [engines]
    "sglang@old" = "/home/me/.cache/difftest/envs/sglang-1a2b3c4d5e6f"   # an environment ...
    "sglang@new" = "/opt/sglang-next/bin/python"                         # ... or an interpreter

Relative paths are relative to the file.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from difftest.rules import engine_releases
from difftest.run.engine import parse_spec
from difftest.base import exit_codes
from difftest.base.errors import ConfigError
from difftest.base.paths import ENV_BUILT_MARK
from difftest.base.paths import cache_root
from difftest.base.paths import import_root

PROJECT_FILE = "difftest.toml"
# The distribution that *is* the engine, per engine directory (vLLM's CPU build is another name);
# the trainers' environments (the training side's oracle) are planned the same way.
ENGINE_DISTRIBUTIONS = engine_releases.DISTRIBUTIONS  # engine -> the package its environment pins
_REQ_LINE = re.compile(r"^(?P<dist>[A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*(?P<version>[^\s;#]+)")
_ENGINE_REQ = re.compile(r"(?P<name>[A-Za-z_][\w-]*)(?:==(?P<version>[A-Za-z0-9][A-Za-z0-9.+!-]*))?")


def _canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


@dataclass(frozen=True)
class EnvPlan:
    engine: str  # engines/<engine>
    version: str  # the engine distribution's version the environment gets
    pinned: str  # the version engines/<engine>/requirements-cpu.txt pins
    label: str
    requirements: str  # the rewritten requirements file's text
    setup_script: Path
    directory: Path  # envs/<engine>-<hash>
    link: Path  # envs/<engine>@<label>

    @property
    def python(self) -> Path:
        return self.link / "bin" / "python"

    @property
    def built(self) -> bool:
        return (self.directory / ENV_BUILT_MARK).exists()


def parse_engine_requirement(text: str) -> tuple[str, str | None]:
    """'sglang==0.5.22' -> ('sglang', '0.5.22'); 'sglang' -> ('sglang', None): the pinned version."""
    m = _ENGINE_REQ.fullmatch(text.strip())
    if not m:
        raise ConfigError(
            f"difftest env create: cannot parse {text!r}; expected ENGINE or ENGINE==VERSION, e.g. sglang==0.5.23"
        )
    return m.group("name"), m.group("version")


def rewrite_requirements(text: str, dist: str, version: str, where: str) -> tuple[str, str]:
    """The requirements with `dist`'s pin replaced by `version`; returns (new text, old pin)."""
    out, old = [], None
    for line in text.splitlines(keepends=True):
        m = _REQ_LINE.match(line)
        if m and _canonical(m.group("dist")) == _canonical(dist):
            if old is not None:
                raise ConfigError(f"{where}: {dist} is pinned twice")
            old = m.group("version")
            line = line[: m.start("version")] + version + line[m.end("version") :]
        out.append(line)
    if old is None:
        raise ConfigError(f"{where}: no '{dist}==VERSION' line to re-pin")
    return "".join(out), old


def _with_recipe(pinned: str, recipe: str, dist: str, version: str, where: str) -> str:
    """The requirements an older release is built from: the recipe itself when it pins `dist` (a whole
    list), else `pinned` (already re-pinned to `version`) with the recipe's lines laid over it."""
    lines = {}
    for line in recipe.splitlines():
        m = _REQ_LINE.match(line)
        if m:
            lines[_canonical(m.group("dist"))] = line
    own = lines.get(_canonical(dist))
    matched = _REQ_LINE.match(own) if own is not None else None
    if matched is not None:
        listed = matched.group("version")
        if listed != version:
            raise ConfigError(f"{where}: pins {dist}=={listed}, not {version}")
        return recipe
    out = []
    for line in pinned.splitlines():
        m = _REQ_LINE.match(line)
        out.append(lines.pop(_canonical(m.group("dist"))) if m and _canonical(m.group("dist")) in lines else line)
    return "\n".join(out + list(lines.values())) + "\n"


def env_hash(requirements: str, setup_script: Path) -> str:
    """What scripts/setup-engine computes: `cat requirements setup-env.sh | sha256sum | cut -c1-12`."""
    return hashlib.sha256(requirements.encode() + setup_script.read_bytes()).hexdigest()[:12]


def spec_dir(name: str, root: Path | None = None) -> Path:
    """difftest_engines/NAME, or difftest_engines/trainingdata/envs/NAME for a trainer (as scripts/setup-engine
    looks), under `root`: by default the import root, a checkout or the installed wheel's packages."""
    root = root or import_root()
    d = root / "difftest_engines" / name
    return d if d.is_dir() else root / "difftest_engines" / "trainingdata" / "envs" / name


def plan(requirement: str, label: str | None = None, cache: Path | None = None, root: Path | None = None) -> EnvPlan:
    """Where `difftest env create REQUIREMENT` puts its environment, and with which pins; builds nothing.
    The recipes are read under `root` (by default the import root: from a checkout or an installed wheel)."""
    root = root or import_root()
    name, version = parse_engine_requirement(requirement)
    spec = spec_dir(name, root) if name in ENGINE_DISTRIBUTIONS else root / "difftest_engines" / name
    reqs, setup = spec / "requirements-cpu.txt", spec / "setup-env.sh"
    if name not in ENGINE_DISTRIBUTIONS or not reqs.is_file() or not setup.is_file():
        known = sorted(n for n in ENGINE_DISTRIBUTIONS if (spec_dir(n, root) / "requirements-cpu.txt").is_file())
        raise ConfigError(
            f"difftest env create: unknown engine {name!r} (environments can be built for: {', '.join(known)})"
        )
    with open(reqs, newline="") as f:  # byte-exact, as setup-engine hashes it
        original = f.read()
    text, pinned = rewrite_requirements(original, ENGINE_DISTRIBUTIONS[name], version or "0", str(reqs))
    if version is None:
        version, text = pinned, original
    elif version != pinned:
        if name in engine_releases.SUPPORTED:
            engine_releases.check_runs_here(name, version)
        # an older release with pins of its own (its dependencies moved): engines/NAME/releases/VERSION.txt,
        # either its whole list (it pins the engine's distribution itself) or the lines that differ from
        # the pinned list (each replaces that distribution's pin, or is added); built by
        # releases/setup-env-VERSION.sh or releases/setup-env-release.sh when the release needs other steps
        recipe = spec / "releases" / f"{version}.txt"
        if recipe.is_file():
            text = _with_recipe(text, recipe.read_text(), ENGINE_DISTRIBUTIONS[name], version, str(recipe))
            # the release's own setup steps, else the engine's script for older releases, else the pinned one's
            for own in (spec / "releases" / f"setup-env-{version}.sh", spec / "releases" / "setup-env-release.sh"):
                if own.is_file():
                    setup = own
                    break
    label = label or version
    parse_spec(f"{name}@{label}")  # the label must be usable in --engines
    envs = (cache or cache_root()) / "envs"
    return EnvPlan(
        name, version, pinned, label, text, setup, envs / f"{name}-{env_hash(text, setup)}", envs / f"{name}@{label}"
    )


def create(p: EnvPlan, log=print) -> Path:
    """Build the planned environment once (locked, atomic rename) and link it; returns its python.

    A version other than the pinned one is really pip-installed: its wheel must be reachable.
    """
    envs = p.directory.parent
    envs.mkdir(parents=True, exist_ok=True)
    with open(envs / f".{p.directory.name}.lock", "w") as lock:
        # one lock per environment, the one scripts/setup-engine takes: releases build side by side
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not p.built:
            partial = p.directory.with_name(p.directory.name + ".partial")
            log(
                f"difftest env: building {p.directory} ({p.engine} {p.version}; minutes and GBs, once per requirements)"
            )
            shutil.rmtree(partial, ignore_errors=True)
            try:
                subprocess.run([os.environ.get("PYTHON", "python3"), "-m", "venv", str(partial)], check=True)
                reqs = partial / "requirements-cpu.txt"
                reqs.write_text(p.requirements)
                subprocess.run(
                    ["bash", str(p.setup_script), str(partial / "bin" / "python"), str(reqs)],
                    check=True,
                    env=dict(os.environ, DIFFTEST_ENV_DIR=str(partial)),
                )
            except (subprocess.CalledProcessError, OSError) as e:
                shutil.rmtree(partial, ignore_errors=True)
                raise ConfigError(
                    f"difftest env create: building {p.engine}=={p.version} failed ({e}); nothing was kept"
                ) from None
            (partial / ENV_BUILT_MARK).touch()
            os.rename(partial, p.directory)
        tmp = p.link.with_name(p.link.name + ".tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(p.directory)
        os.replace(tmp, p.link)
    return p.python


# -- the project file -------------------------------------------------------------------------
def project_pythons(root: Path) -> dict[str, str]:
    """`[engines]` of ROOT/difftest.toml: spec key -> interpreter ({} without the file)."""
    path = Path(root) / PROJECT_FILE
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML ({e})") from None
    unknown = sorted(set(data) - {"engines"})
    if unknown:
        raise ConfigError(f"{path}: unknown table or key {unknown[0]!r} (known: engines)")
    table = data.get("engines", {})
    if not isinstance(table, dict):
        raise ConfigError(f'{path}: engines: expected a table of "NAME@LABEL" = "path"')
    out = {}
    for key, value in table.items():
        spec = parse_spec(key)
        if spec.params or spec.key != key:
            raise ConfigError(f"{path}: engines.{key}: expected NAME or NAME@LABEL without [parameters]")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{path}: engines.{key}: expected a path to an interpreter or environment, got {value!r}")
        out[key] = interpreter(value, f"{path}: engines.{key}", path.parent)
    return out


def interpreter(value: str, where: str, base: Path | None = None) -> str:
    """An engine's interpreter: an executable file, or an environment directory holding bin/python.
    Anything else (missing, a directory without bin/python, not executable) is refused at `where`."""
    p = Path(value).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    if p.is_dir():
        if not (p / "bin" / "python").exists():
            raise ConfigError(f"{where}: {p} is a directory, not an interpreter (and holds no bin/python)")
        p = p / "bin" / "python"
    if not p.exists():
        raise ConfigError(f"{where}: {p} does not exist")
    if not p.is_file() or not os.access(p, os.X_OK):
        raise ConfigError(f"{where}: {p} is not an executable file")
    return str(p)


def main(args) -> int:
    """`difftest env create ENGINE[==VERSION] [--label L] [--dry-run]`."""
    try:
        p = plan(args.requirement, args.label)
    except ConfigError as e:  # ENGINE[==VERSION] or --label unusable: a bad argument value
        print(str(e), file=sys.stderr)
        return exit_codes.USAGE
    try:
        print(
            f"{p.engine}=={p.version}{'' if p.version == p.pinned else f' (pinned: {p.pinned})'} -> {p.directory}"
            f"{' (built)' if p.built else ''}; link {p.link}"
        )
        if args.dry_run:
            return 0
        python = create(p, log=lambda m: print(m, file=sys.stderr))
    except ConfigError as e:  # the build failed: the command could not answer
        print(str(e), file=sys.stderr)
        return exit_codes.TROUBLE
    print(f"use it with --engines={p.engine}@{p.label} (or --engine-python {p.engine}@{p.label}={python})")
    return 0


@dataclass
class BuiltEnv:
    """One entry of the environments folder, as `difftest env list` shows it."""

    name: str  # the folder or link name: ENGINE-<hash>, or the ENGINE / ENGINE@LABEL link
    engine: str
    release: str | None  # the engine's distribution version installed there (None: not found)
    path: str
    size: int | None  # bytes (None for a link: its target is listed on its own)
    complete: bool  # finished by its setup script (ENV_BUILT_MARK), not a .partial build
    link_to: str | None = None


def tree_size(path: Path) -> int:
    """Bytes under `path`, links not followed (an environment's link to another counts once)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:  # removed while we walked (a build finishing, a prune)
                continue
    return total


def _release_in(env: Path, engine: str) -> str | None:
    """The version of the engine's distribution in `env`, from its dist-info folder name (no import)."""
    dist = _canonical(ENGINE_DISTRIBUTIONS.get(engine, engine)).replace("-", "_")
    for info in env.glob("lib/python*/site-packages/*.dist-info"):
        name, _, version = info.name[: -len(".dist-info")].rpartition("-")
        if _canonical(name).replace("-", "_") == dist:
            return version
    return None


def list_envs(cache: Path | None = None, sized: bool = True) -> list[BuiltEnv]:
    """Every environment and link in the environments folder, built or half-built."""
    folder = (cache or cache_root()) / "envs"
    if not folder.is_dir():
        return []
    out = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):  # the build locks
            continue
        engine = re.split(r"[-@]", entry.name.removesuffix(".partial"), maxsplit=1)[0]
        if entry.is_symlink():
            target = entry.resolve()
            out.append(
                BuiltEnv(
                    entry.name,
                    engine,
                    _release_in(target, engine),
                    str(entry),
                    None,
                    (target / ENV_BUILT_MARK).exists(),
                    str(target),
                )
            )
            continue
        complete = not entry.name.endswith(".partial") and (entry / ENV_BUILT_MARK).exists()
        size = tree_size(entry) if sized else None
        out.append(BuiltEnv(entry.name, engine, _release_in(entry, engine), str(entry), size, complete))
    return out
