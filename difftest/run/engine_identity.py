"""What an engine's worker said about itself (EngineInfo), remembered per environment.

Every cached result is keyed on the engine's version, which its worker reports when it starts
(20-40 s for vLLM or SGLang on two cores). A run whose every result is already cached would start
each engine only to learn that version. The worker's info follows from: the interpreter and what
is installed where it imports from (the distributions' names carry their versions), the harness's
own code (the adapters compute part of the info), the environment variables the engines and the
adapters read, and the spec and adapter it runs. `identity` digests exactly those; an info is
remembered under it only once a worker has said it, and never for a live server (whose answers
change) or a stored baseline.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
from pathlib import Path

from difftest.base.errors import ConfigError
from difftest.base.outputs import atomic_write
from difftest.records.engine_info import EngineInfo

# Environment variables an engine's import or an adapter's info can depend on (kernel choice, the
# platform, thread counts, library paths). Others (pytest-xdist's stream name, a test's temp dirs)
# would only make every identity unique.
ENV_PREFIXES = (
    "DIFFTEST_",
    "VLLM_",
    "SGLANG_",
    "TORCH",
    "CUDA",
    "HF_",
    "TRANSFORMERS",
    "OMP_",
    "MKL_",
    "KMP_",
    "LD_",
    "PYTHON",
    "TRITON",
)
# What marks an installed distribution (and its version) or an import hook in a sys.path folder.
DIST_MARKERS = (".dist-info", ".egg-info", ".pth", ".egg-link")
SYS_PATH_TIMEOUT_S = 60.0


@functools.lru_cache(maxsize=None)
def code_digest(root: Path) -> str:
    """The harness's own code, by content: the core and every adapter (computed once per process)."""
    h = hashlib.sha256()
    for folder in ("difftest", "difftest_engines"):
        for path in sorted((root / folder).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _interpreter_path(python: str, env: dict[str, str]) -> list[str] | None:
    """The folders `python` imports from, as the worker's environment sets them (None: it did not answer)."""
    try:
        done = subprocess.run(
            [python, "-c", "import json, sys; print(json.dumps(sys.path))"],
            env=env,
            capture_output=True,
            text=True,
            timeout=SYS_PATH_TIMEOUT_S,
        )
        entries = json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return [str(e) for e in entries if e] if isinstance(entries, list) else None


def _installed(folder: str, project_root: Path) -> list[str]:
    """What is installed in one sys.path folder: its distributions and import hooks by name."""
    path = Path(folder)
    if path.resolve().is_relative_to(project_root):
        return []  # the harness's own code: code_digest
    if path.is_file():  # a zip on sys.path
        st = path.stat()
        return [f"{st.st_size}:{st.st_mtime_ns}"]
    try:
        return sorted(n for n in os.listdir(path) if n.endswith(DIST_MARKERS))
    except OSError:
        return []


def identity(spec: dict, target: str, python: str, env: dict[str, str], project_root: Path) -> str | None:
    """A digest of everything a worker's info follows from (None when the interpreter cannot be asked)."""
    sys_path = _interpreter_path(python, env)
    if sys_path is None:
        return None
    real = Path(python).resolve()
    try:
        st = real.stat()
    except OSError:
        return None
    parts = {
        "spec": spec,
        "target": target,
        "python": [python, str(real), st.st_size, st.st_mtime_ns],
        "installed": [[p, _installed(p, project_root)] for p in sys_path],
        "code": code_digest(project_root),
        "env": sorted((k, v) for k, v in env.items() if k.startswith(ENV_PREFIXES)),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


class InfoMemo:
    """Remembered worker infos, one JSON file per identity."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, ident: str) -> Path:
        return self.root / f"{ident}.json"

    def get(self, ident: str) -> EngineInfo | None:
        path = self._path(ident)
        try:
            data = json.loads(path.read_text())
            return EngineInfo.from_json(data, str(path))
        except (OSError, ValueError, ConfigError):
            return None  # not remembered, or unreadable: the worker starts and says it again

    def put(self, ident: str, info: EngineInfo) -> None:
        if info.live or info.baseline is not None:
            return
        atomic_write(self._path(ident), json.dumps(info.to_dict(), indent=1, sort_keys=True))


__all__ = ["InfoMemo", "identity", "code_digest"]
