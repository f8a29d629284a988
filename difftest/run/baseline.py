"""Golden baselines: one run's captures and accept-length stats, stored to be the reference later.

    pytest cases/ --engines=sglang --save-baseline v0523     # write baselines/v0523/
    pytest cases/ --engines=sglang --baseline v0523          # compare a later run against it

Layout (schema difftest.baseline/1)::

    baselines/NAME/manifest.json                  versions, device, dtype, git sha, per case x engine
    baselines/NAME/<case>/<engine id>.safetensors tensors of every prompt, named p<i>/<canonical name>

What is stored is exactly what a comparison against the baseline reads: each prompt's canonical
capture (every tensor is compared, and the fc diagnosis matches fc chunks against the stored
target.h.*), in the case's dtype, plus the capture meta and the accept-length stats. No weights,
logs or reports. A `*.logits_target` that is exactly its `*.logits` scattered into the target
vocabulary (-inf elsewhere) is stored as that column index and rebuilt bit for bit on load. A baseline is immutable: writing over one needs --force, and it is written in a
temporary directory renamed into place, so a reader sees the old baseline or the new one, never half.

Its case fingerprint hashes checkpoint *contents* (not paths or mtimes, unlike the capture cache's),
so a baseline stays valid across clones and fixture rebuilds, and a changed case is refused.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors.torch import load_file, save_file

from difftest.records.acceptance import AcceptStats
from difftest.records import scattered
from difftest.records.capture import Capture
from difftest.case.case import Case
from difftest.run.engine import EngineSpec
from difftest.records.engine_info import EngineInfo, StoredBaseline
from difftest.base.errors import ConfigError
from difftest.records.baseline_manifest import (
    SCHEMA as SCHEMA,  # the manifest's schema, named where baselines are
    BaselineManifest,
    ScatteredLogits,
    StoredCase,
    StoredEngineRun,
    StoredPrompt,
    StoredSpec,
)
from difftest.base.outputs import atomic_write
from difftest.report.writer import environment

if TYPE_CHECKING:  # annotations only: a case's run reads stored baselines (difftest.run.pool)
    from difftest.run.case_run import CaseRun

DEFAULT_DIR = "baselines"
PREFIX = "baseline:"  # reference specs standing for a stored run: baseline:NAME or baseline:NAME:ENGINE
_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")
_FULL_HASH_LIMIT = 256 << 20  # bigger weight files: size + head and tail hashed (content, not mtime)
_EDGE = 4 << 20


def check_name(name: str, option: str) -> str:
    if not _NAME.fullmatch(name or ""):
        raise ConfigError(f"{option}: baseline name {name!r} must be letters, digits, '.', '_' or '-'")
    return name


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= _FULL_HASH_LIMIT:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(f.read(_EDGE))
            f.seek(size - _EDGE)
            h.update(f.read(_EDGE))
            h.update(str(size).encode())
    return h.hexdigest()[:16]


def _content(value: object) -> object:
    """A checkpoint directory (or file) named in a case, replaced by what its files contain."""
    if isinstance(value, dict):
        return {k: _content(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_content(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value) and os.path.exists(value):
        p = Path(value)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        return [[str(f.relative_to(p)) if p.is_dir() else f.name, _file_digest(f)] for f in files]
    return value


def case_fingerprint(case: Case) -> str:
    """Of a prepared case (fixtures resolved): everything that changes a capture, by content."""
    parts = case.to_dict()
    for judged_only in ("name", "path", "description", "tolerances", "expect", "allow_missing"):
        parts.pop(judged_only)
    # judged only too: declaring the new release's expected verdict after saving the old one's
    # baseline (the upgrade check) must not make the baseline stale. Emptied, not dropped, so a
    # baseline of a case that declares none keeps its fingerprint.
    parts["expect_failure"] = []
    return hashlib.sha256(json.dumps(_content(parts), sort_keys=True, default=str).encode()).hexdigest()[:16]


def _pack(tensors: dict) -> tuple[dict, dict[str, ScatteredLogits]]:
    """(tensors to store, derived name -> how to rebuild it): only exact rebuilds are derived
    (difftest.records.scattered, as captures store them)."""
    stored, derived = scattered.pack(tensors)
    return stored, {n: ScatteredLogits(scatter=src, vocab=tensors[n].shape[1]) for n, src in derived.items()}


def _file_stem(engine_id: str) -> str:
    return re.sub(r"[^\w.@=+-]", "_", engine_id)


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- writing ------------------------------------------------------------------------------------
@dataclass
class BaselineWriter:
    """Collects entries in a hidden temporary directory; commit() renames it into place."""

    root: Path  # the baselines directory
    name: str
    force: bool = False
    entries: dict[str, StoredCase] = field(default_factory=dict)  # by case name
    problems: list[str] = field(default_factory=list)
    _tmp: Path | None = None

    def __post_init__(self) -> None:
        check_name(self.name, "--save-baseline")
        self.refuse_existing()

    @property
    def path(self) -> Path:
        return self.root / self.name

    def refuse_existing(self) -> None:
        if self.path.exists() and not self.force:
            raise ConfigError(
                f"{self.path}: baseline {self.name!r} already exists and baselines are immutable; "
                "choose another name or pass --force to replace it"
            )

    def _staging(self) -> Path:
        if self._tmp is None:
            self.root.mkdir(parents=True, exist_ok=True)
            # a folder of its own: two writers of one name (runs, or threads of one process) never share it
            self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.name}.partial-", dir=self.root))
        return self._tmp

    def add(self, case_run: CaseRun, spec: EngineSpec) -> StoredEngineRun:
        """Capture every prompt and run speculative decoding for (case, engine); stage the result."""
        case, prepared = case_run.case, case_run.prepared
        prompts = case_run.prompt_ids()
        captures = [case_run.capture(spec, i) for i in range(len(prompts))]
        stats = case_run.speculate(spec)
        rel = Path(case.name.replace("/", "_")) / f"{_file_stem(spec.id)}.safetensors"
        out = self._staging() / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        flat, derived = {}, []
        for i, c in enumerate(captures):
            kept, how = _pack({n: t.detach().contiguous().cpu() for n, t in c.tensors.items()})
            flat.update({f"p{i}/{n}": t for n, t in kept.items()})
            derived.append(how)
        save_file(flat, str(out))
        run = StoredEngineRun(
            file=str(rel),
            captures=[StoredPrompt(list(c.tensors), d, c.meta) for c, d in zip(captures, derived)],
            accept=stats,
            info=case_run.pool.engine_info(spec),
            engine=StoredSpec(spec.name, spec.label, [list(p) for p in spec.params]),
            device=captures[0].meta.device or "unknown",
            dtype=captures[0].meta.dtype or prepared.dtype,
            bytes=out.stat().st_size,
        )
        stored = self.entries.setdefault(
            case.name,
            StoredCase(
                fingerprint=case_fingerprint(prepared),
                engines={},
                case_file=case.path,
                dtype=prepared.dtype,
                prompts=prompts,
                spec_prompts=case_run.prompt_ids(speculative=True),
            ),
        )
        stored.engines[spec.id] = run
        return run

    def commit(self) -> Path:
        """Manifest last, then one rename: the baseline appears complete or not at all. The rename is
        also what decides between two runs saving one name at once: renaming a folder onto one that
        holds files fails, so the second is refused, whatever it checked before."""
        self.refuse_existing()  # the common case, said before the manifest is written
        tmp = self._staging()
        env = environment()
        manifest = BaselineManifest(
            created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            harness={k: env[k] for k in ("difftest", "python", "platform", "torch", "transformers")},
            git_sha=env["git_sha"],
            cases=self.entries,
            name=self.name,
        )
        atomic_write(tmp / "manifest.json", json.dumps(manifest.to_dict(), indent=1, default=str))
        old = None
        if self.force and self.path.exists():  # --force: swap, then drop the old one
            old = Path(tempfile.mkdtemp(prefix=f".{self.name}.old-", dir=self.root)) / self.name
            os.rename(self.path, old)
        try:
            os.rename(tmp, self.path)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise ConfigError(
                f"{self.path}: baseline {self.name!r} already exists (another run wrote it meanwhile) and "
                "baselines are immutable; choose another name or pass --force to replace it"
            ) from None
        finally:
            if old is not None:
                shutil.rmtree(old.parent, ignore_errors=True)
        self._tmp = None
        return self.path

    def discard(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def size(self) -> int:
        return _dir_size(self.path) if self.path.exists() else 0


# -- reading ------------------------------------------------------------------------------------
def parse_reference(text: str) -> tuple[str, str | None]:
    """`--baseline NAME` or `NAME:ENGINE` (which engine's entry, when the baseline holds several)."""
    name, _, engine = text.partition(":")
    return check_name(name, "--baseline"), engine or None


class BaselineSource:
    """A stored run standing in for an engine: the reference of `--baseline NAME`."""

    def __init__(self, root: Path, name: str, engine: str | None = None):
        self.name, self.engine = name, engine
        self.path = Path(root) / name
        if not self.path.is_dir():
            have = (
                sorted(p.name for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith("."))
                if Path(root).is_dir()
                else []
            )
            raise ConfigError(f"--baseline: no baseline {name!r} in {root} (found: {', '.join(have) or 'none'})")
        self.manifest = BaselineManifest.load(self.path / "manifest.json")
        self.spec = EngineSpec(PREFIX + name + (f":{engine}" if engine else ""))
        self._tensors: dict[str, dict] = {}
        self._fingerprints: dict[str, str] = {}  # case path -> fingerprint: hashing checkpoints once per run

    @property
    def info(self) -> EngineInfo:
        created = self.manifest.created
        stored = StoredBaseline(
            path=str(self.path),
            created=created,
            git_sha=str(self.manifest.git_sha),
            engines=self.manifest.engine_versions(),
        )
        return EngineInfo(
            name=self.spec.name,
            version=f"{self.spec.name}@{created}",
            versions=dict(self.manifest.harness),
            kernels="stored",
            baseline=stored,
        )

    def entry(self, case: Case) -> tuple[str, StoredEngineRun, StoredCase]:
        """(engine id, engine entry, case entry) for a prepared case; refuses a case that changed."""
        where = self.path / "manifest.json"
        c = self.manifest.cases.get(case.name)
        if c is None:
            raise ConfigError(
                f"{where}: no entry for case {case.name!r} (saved: {', '.join(sorted(self.manifest.cases)) or 'none'})"
            )
        if case.path not in self._fingerprints:
            self._fingerprints[case.path] = case_fingerprint(case)
        fp = self._fingerprints[case.path]
        if c.fingerprint != fp:
            raise ConfigError(
                f"{where}: case {case.name!r} changed since the baseline was saved (fingerprint "
                f"{c.fingerprint} != {fp}: case settings or checkpoint contents); save a new baseline"
            )
        engines = c.engines
        if self.engine is not None:
            if self.engine not in engines:
                raise ConfigError(
                    f"{where}: case {case.name!r} has no entry for engine {self.engine!r} (saved: {', '.join(engines)})"
                )
            eid = self.engine
        elif len(engines) == 1:
            (eid,) = engines
        else:
            raise ConfigError(
                f"{where}: case {case.name!r} holds {', '.join(engines)}; choose one with --baseline {self.name}:ENGINE"
            )
        return eid, engines[eid], c

    def capture(self, case: Case, index: int) -> Capture:
        eid, e, c = self.entry(case)
        if index >= len(e.captures):
            raise ConfigError(f"{self.path}: {case.name} {eid}: prompt {index} not stored ({len(e.captures)} prompts)")
        key = f"{case.name}/{eid}"
        if key not in self._tensors:
            file = self.path / e.file
            try:
                self._tensors[key] = load_file(str(file))
            except Exception as err:
                raise ConfigError(f"{file}: unreadable baseline tensors ({err})") from None
        flat, stored = self._tensors[key], e.captures[index]
        derived = stored.derived
        need = [f"p{index}/{n}" + ("#columns" if n in derived else "") for n in stored.tensors]
        missing = [n for n in need if n not in flat]
        if missing:
            raise ConfigError(f"{self.path / e.file}: tensor {missing[0]} listed in the manifest but absent")
        tensors = {}
        for n in stored.tensors:
            if n in derived:
                src = flat[f"p{index}/{derived[n].scatter}"]
                tensors[n] = scattered.scatter(src, flat[f"p{index}/{n}#columns"], derived[n].vocab)
            else:
                tensors[n] = flat[f"p{index}/{n}"]
        meta = stored.meta
        return Capture(tensors, meta.replace(baseline=self.name, baseline_engine=eid))

    def speculate(self, case: Case) -> AcceptStats:
        eid, e, c = self.entry(case)
        stats = dataclasses.replace(e.accept)
        stats.source = f"baseline {self.name} ({eid}: {stats.source})"
        return stats
