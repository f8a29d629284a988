"""What an engine says about itself when its worker starts (Engine.info), as the session keeps it,
cache keys and release checks read it, baselines store it and reports carry it."""

from __future__ import annotations

from dataclasses import dataclass, field

from difftest.records.fields import decode, encode_fields


@dataclass
class StoredBaseline:
    """Where a stored golden baseline's results came from (difftest.run.baseline)."""

    path: str
    created: str
    git_sha: str
    engines: dict[str, object] = field(default_factory=dict)  # engine id -> the version it was saved from


@dataclass
class EngineInfo:
    name: str
    version: str
    versions: dict[str, object] = field(default_factory=dict)  # torch, transformers, ... in its environment
    kernels: str = ""
    # which of an engine release's code paths ran, where a release has several (vLLM's "runner v2"):
    # named beside the version in every report, and part of the key of that engine's rules
    variant: str = ""
    # A live system outside the harness (a running server): nothing is captured inside it, and its
    # results are never cached (each run asks it again).
    live: bool = False
    settings: dict[str, object] = field(default_factory=dict)  # a live server's effective settings
    baseline: StoredBaseline | None = None  # a stored baseline standing in for the engine

    def label(self) -> str:
        """The release as a report names it, with the code path that ran: "vllm 0.32.0 (runner v2)"."""
        return f"{self.name} {self.version}" + (f" ({self.variant})" if self.variant else "")

    def code_path(self) -> str:
        """The runner and the execution mode that ran, as a report's "runner" column names them:
        "runner v2, eager", "runner v2, compiled (torch.compile)"; "-" when the engine names neither."""
        runner = self.variant or self.versions.get("runner")
        execution = self.versions.get("execution")
        return ", ".join(str(part) for part in (runner, execution) if part) or "-"

    def to_dict(self) -> dict:
        return encode_fields(self, omit_none=("baseline",))

    @classmethod
    def from_json(cls, data: object, where: str, at: str = "") -> "EngineInfo":
        return decode(cls, data, where, at)
