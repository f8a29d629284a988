"""`server[url=...,kind=sglang|vllm]`: an already-running SGLang or vLLM server with EAGLE-3.

Nothing is captured inside the server (no tensors: the tensor checks report "not available"),
so it works on any deployment. It answers two things: the server's effective settings
(`info().settings`) and, per speculative prompt of the case, the generated tokens and the
acceptance the server reports for that request (difftest_engines.server.client). The reference's
prediction on those very tokens comes from the reference engine (Engine.replay), compared in
difftest_engines.server.probe.

Spec parameters:
  url      the server, http://HOST:PORT (required)
  kind     sglang | vllm (default: detected from the endpoints the server answers)
  timeout  seconds per HTTP request (default 120): a server that does not answer fails, never hangs
  model    the served model's expected name (default: the case's target path; a server often
           serves the same checkpoint under another path or a hub name)
Runs in the harness's own environment: it needs no engine installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from difftest.api import AcceptStats
from difftest.api import Capture
from difftest.api import Case
from difftest.api import Engine, EngineInfo
from difftest.api import ConfigError, EngineError
from difftest_engines.server.client import ServerClient, ServerError
from difftest_engines.server.settings import SCHEMA


class ServerEngine(Engine):
    SETTINGS = SCHEMA  # difftest_engines/server/settings.py: unknown or ill-typed parameters are refused by the core

    def __init__(self, spec):
        super().__init__(spec)
        # the spec's parameters, validated as the core validates them (a timeout that is not a
        # positive number is refused there) and read by attribute
        self._given = self.settings_for(None)
        if not self._given.url:
            raise ConfigError(f"--engines {spec.id}: url=http://HOST:PORT is required")
        self.timeout = self._given.timeout
        self._client: ServerClient | None = None
        self._settings = None

    def _connect(self) -> ServerClient:
        if self._client is None:
            try:
                self._client = ServerClient(self._given.url, self._given.kind, self.timeout)
                self._settings = self._client.settings()
            except ServerError as e:
                raise EngineError(str(e)) from None
            if not self._settings.algorithm:
                raise EngineError(
                    f"{self._client.url}: the server runs no speculative decoding "
                    f"({self._settings.sources[0]}: speculative_algorithm is unset)"
                )
        return self._client

    def info(self) -> EngineInfo:
        client = self._connect()
        s = self._settings
        return EngineInfo(
            name="server",
            version=f"{client.kind} {s.version}".strip(),
            versions={"kind": client.kind, "url": client.url},
            kernels=f"{client.kind} server",
            live=True,
            settings=s.to_dict(),
        )

    def capture(self, case: Case, prompt_ids: list[int]) -> Capture:
        raise NotImplementedError(
            f"{self.spec.id}: a running server exposes no tensors (nothing is captured inside it)"
        )

    def _check_model(self, case: Case) -> None:
        """The server must serve the case's target: same path, same directory, or the same last path component."""
        served = self._settings.model
        expected = self._given.model or case.target
        same = served == expected or Path(served).name == Path(str(expected).rstrip("/")).name
        if not same and os.path.exists(served) and os.path.exists(expected):
            same = os.path.realpath(served) == os.path.realpath(expected)
        if not same:
            raise EngineError(
                f"{self._client.url} serves model {served!r}, not the case's target {expected!r} "
                f"(if it is the same checkpoint under another name: {self.spec.name}[...,model={served}])"
            )

    def _vocab(self, case: Case) -> int | None:
        try:
            cfg = json.loads((Path(case.target) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        cfg = cfg.get("text_config", cfg)
        return cfg.get("vocab_size")

    def speculate(self, case: Case, prompts: list[list[int]], num_steps: int, max_new_tokens: int) -> AcceptStats:
        client = self._connect()
        self._check_model(case)
        steps = self._settings.num_steps or num_steps
        vocab = self._vocab(case)
        requests = []
        for i, prompt in enumerate(prompts):  # one at a time: vLLM's /metrics deltas must hold one request
            try:
                r = client.generate(prompt, max_new_tokens, steps)
            except ServerError as e:
                raise EngineError(f"prompt {i}: {e}") from None
            if not r.output:
                raise EngineError(f"{client.url}: prompt {i}: the server generated no tokens")
            if vocab and max(r.output) >= vocab:
                raise EngineError(
                    f"{client.url}: prompt {i}: output token {max(r.output)} is outside the case target's "
                    f"vocabulary ({vocab}): the server serves another model"
                )
            requests.append(r)
        total = AcceptStats(0, 0, steps, [0] * steps, 0, "")
        for r in requests:
            total = total.merge(
                AcceptStats(r.num_verify, r.num_accepted, steps, r.accepted_per_pos, 1, "", outputs=[r.output])
            )
        exact = all(r.exact for r in requests)
        total.source = f"{client.kind} server {client.url}: " + (
            "meta_info per-request counters (exact)"
            if exact
            else "/metrics counter deltas around each request, sent one at a time (other traffic would show)"
        )
        total.per_request = [r.to_dict() for r in requests]
        total.native = (
            ["sglang.spec_num_correct_drafts", "sglang.spec_correct_drafts_histogram"]
            if client.kind == "sglang"
            else ["vllm.mean_acceptance_length", "vllm.num_accepted_tokens_per_pos"]
        )
        return total
