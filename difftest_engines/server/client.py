"""A client for a running SGLang or vLLM server with EAGLE-3: prompts as token ids, greedy,
and the acceptance each request got. Standard library only (urllib): it runs anywhere.

Nothing is captured inside the server, so this works on any deployment (TP-8 on GPUs, behind
a load balancer); what it can read is what the server publishes:

SGLang (0.5.23, `sglang/srt/entrypoints/http_server.py`)
  * POST /generate {"input_ids", "sampling_params": {temperature 0, max_new_tokens, ignore_eos}}
    -> `output_ids` and `meta_info` with `spec_verify_ct`, `spec_num_correct_drafts` and
    `spec_correct_drafts_histogram`: counters of *this request*, exact under any traffic.
  * GET /server_info (or the deprecated /get_server_info): the *resolved* server arguments
    (`server_info`: "the field values are the resolution result") plus `launch_command`, what was
    asked for: the two together show what SGLang changed (topk 1 forces num_draft_tokens).
vLLM (0.32.0)
  * POST /v1/completions {"prompt": [ids], temperature 0, max_tokens, ignore_eos,
    return_token_ids} -> choices[0].token_ids. Per-request spec-decode metrics
    (`RequestSpecDecodeMetrics`) never reach the HTTP response in 0.32, so acceptance is read from
  * GET /metrics: the Prometheus counters `vllm:spec_decode_num_drafts`, `_num_draft_tokens`,
    `_num_accepted_tokens`, `_num_accepted_tokens_per_pos{position}` (v1/spec_decode/metrics.py::
    SpecDecodingProm) read before and after each request, requests sent one at a time. These are
    *deltas*: another client's request running at the same time lands in them too. The probe
    detects that (the finished-request, prompt- and generation-token counters must move by exactly
    this request, and nothing may be running or waiting before it) and marks such a request.
  * Settings: GET /v1/models (served model, its root path, max_model_len); the per-position
    counters' labels give num_speculative_tokens; GET /server_info (only with
    VLLM_SERVER_DEV_MODE=1: entrypoints/serve/dev/server_info/api_router.py::show_server_info)
    gives the whole resolved VllmConfig, speculative config and draft path included.
"""

from __future__ import annotations

import http.client
import json
import re
import shlex
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field

KINDS = ("sglang", "vllm")
DEFAULT_TIMEOUT = 120.0  # seconds per HTTP request: a greedy request of a case's length, on a loaded CPU

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# counters that must move by exactly one request's worth when nobody else is using the server
TRAFFIC = ("vllm:request_success", "vllm:prompt_tokens", "vllm:generation_tokens")
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# what a proxy or gateway answers for a host it cannot reach
GATEWAY_ERRORS = (502, 503, 504)


def _proxy_for(url: str) -> str | None:
    """The proxy urllib sends `url` through (the *_proxy environment variables), if any."""
    host = urllib.parse.urlsplit(url).hostname or ""
    proxy = urllib.request.getproxies().get(urllib.parse.urlsplit(url).scheme)
    return None if proxy is None or urllib.request.proxy_bypass(host) else proxy


class ServerError(Exception):
    """One line naming the server and the cause (unreachable, timeout, no speculative decoding...)."""


@dataclass
class ServerSettings:
    """What the server resolved, and where each number came from."""

    kind: str
    url: str
    model: str  # the served model's path or name
    algorithm: str | None  # e.g. EAGLE3; None: no speculative decoding
    num_steps: int | None
    topk: int | None
    num_draft_tokens: int | None  # SGLang counts the root; vLLM: num_steps + 1 (a chain)
    draft_model: str | None
    tp: int | None = None  # tensor-parallel size (SGLang tp_size; vLLM tensor_parallel_size, from /server_info)
    launch: dict = field(default_factory=dict)  # what the launch command asked for (SGLang), by server-arg name
    details: dict = field(default_factory=dict)  # other effective settings worth showing
    sources: list[str] = field(default_factory=list)  # endpoint and function each group came from
    version: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RequestAcceptance:
    """One request: its tokens and the acceptance counters for it."""

    prompt: list[int]
    output: list[int]
    num_verify: int
    num_accepted: int
    accepted_per_pos: list[int]
    exact: bool  # True: the server's own per-request counters; False: /metrics deltas around the request
    contaminated: str = ""  # why another request may be in these deltas ("" when none seen)

    @property
    def accept_length(self) -> float:
        return self.num_accepted / self.num_verify + 1.0 if self.num_verify else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["accept_length"] = self.accept_length
        return d


class ServerClient:
    def __init__(self, url: str, kind: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        if not re.match(r"^https?://[^/\s]+", url or ""):
            raise ServerError(f"--server {url!r}: expected http://HOST:PORT")
        if kind is not None and kind not in KINDS:
            raise ServerError(f"server kind {kind!r}: expected one of {', '.join(KINDS)}")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.kind = kind or self._detect_kind()

    # -- HTTP ------------------------------------------------------------------------
    def _request(self, path: str, body: dict | None = None, timeout: float | None = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        t = self.timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(req, timeout=t) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (socket.timeout, TimeoutError):
            raise ServerError(f"{self.url}{path}: no answer within {t:g}s (timeout)") from None
        except http.client.BadStatusLine as e:
            if isinstance(e, ConnectionError):  # RemoteDisconnected: closed without answering
                raise self._unreachable(e) from None
            # another protocol on that port (SSH, a database, TLS): its bytes, shown escaped and cut short
            raise ServerError(
                f"{self.url}{path} is not an HTTP server (it answered bytes that are not an HTTP status line: "
                f"{_first_bytes(e.line)})"
            ) from None
        except http.client.HTTPException as e:  # a broken HTTP answer: a bad header, a body cut short
            raise ServerError(
                f"{self.url}{path}: a broken HTTP answer ({type(e).__name__}: {_first_bytes(str(e))})"
            ) from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise ServerError(f"{self.url}{path}: no answer within {t:g}s (timeout)") from None
            raise self._unreachable(reason) from None
        except (ConnectionError, OSError) as e:
            raise self._unreachable(e) from None

    def _unreachable(self, reason) -> ServerError:
        """The host cannot be reached, said in words: refused, not resolved, timed out, ..."""
        if isinstance(reason, socket.gaierror):
            why = f"host name {urllib.parse.urlsplit(self.url).hostname!r} not resolved"
        elif isinstance(reason, ConnectionRefusedError):
            why = "connection refused: nothing listens at that host and port"
        elif isinstance(reason, (socket.timeout, TimeoutError)):
            why = "connection timed out"
        elif isinstance(reason, OSError) and reason.strerror:
            why = reason.strerror[0].lower() + reason.strerror[1:]
        else:
            why = str(reason)
        return ServerError(f"{self.url}: cannot reach the server ({why})")

    def _json(self, path: str, body: dict | None = None, array_ok: bool = False):
        """The JSON object an endpoint answered (or a list, where `array_ok`: SGLang's batch answer)."""
        status, raw = self._request(path, body)
        if status != 200:
            text = raw.decode(errors="replace").strip().replace("\n", " ")[:300]
            raise ServerError(f"{self.url}{path}: HTTP {status}: {text}")
        return self._decode(path, status, raw, array_ok)

    def _decode(self, path: str, status: int, raw: bytes, array_ok: bool = False):
        """`raw` as the JSON object it must be; anything else is one line naming the endpoint."""
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past what Python parses
            raise ServerError(
                f"{self.url}{path} answered {status} with a body that is not JSON (first bytes: {_first_bytes(raw)})"
            ) from None
        if not isinstance(data, dict) and not (array_ok and isinstance(data, list)):
            raise ServerError(
                f"{self.url}{path} answered {status} with JSON that is not an object (first bytes: {_first_bytes(raw)})"
            )
        return data

    def _detect_kind(self) -> str:
        info_status, _ = self._request("/get_model_info")
        if info_status == 200:
            return "sglang"
        status, raw = self._request("/metrics")
        if status == 200 and b"vllm:" in raw:
            return "vllm"
        proxy = _proxy_for(self.url)
        via = f" through the proxy {proxy}" if proxy else ""
        if info_status in GATEWAY_ERRORS and status in GATEWAY_ERRORS:
            raise ServerError(
                f"{self.url}: cannot reach the server{via} (a proxy or gateway answered HTTP {info_status} "
                f"for it: the host is unreachable from there)"
            )
        # Something answered, but not SGLang or vLLM: another service on that port, or a proxy (transparent
        # or configured) answering for a host it cannot reach; both look the same from here.
        raise ServerError(
            f"{self.url}: no SGLang or vLLM server reachable there{via}: /get_model_info answered HTTP "
            f"{info_status}, /metrics HTTP {status}{' without vllm: counters' if status == 200 else ''} "
            "(another service, or a proxy answering for an unreachable host); check the URL, or give "
            "kind=sglang|vllm"
        )

    def healthy(self) -> bool:
        try:
            status, _ = self._request("/health", timeout=min(self.timeout, 5.0))
        except ServerError:
            return False
        return status == 200

    # -- settings --------------------------------------------------------------------
    def settings(self) -> ServerSettings:
        return self._sglang_settings() if self.kind == "sglang" else self._vllm_settings()

    def _sglang_settings(self) -> ServerSettings:
        status, raw = self._request("/server_info")
        path = "/server_info"
        if status != 200:
            path = "/get_server_info"
            status, raw = self._request(path)
        if status != 200:
            raise ServerError(f"{self.url}{path}: HTTP {status}: not an SGLang server with server info")
        info = self._decode(path, status, raw)
        launch = parse_launch_command(info.get("launch_command"))
        algo = info.get("speculative_algorithm")
        internal = info.get("internal_states") or [{}]
        details = {
            k: info.get(k)
            for k in (
                "tp_size",
                "dp_size",
                "dtype",
                "attention_backend",
                "device",
                "speculative_draft_model_revision",
                "disable_overlap_schedule",
            )
        }
        details["avg_spec_accept_length (server-wide)"] = (internal[0] or {}).get("avg_spec_accept_length")
        return ServerSettings(
            kind="sglang",
            url=self.url,
            model=str(info.get("model_path")),
            algorithm=str(algo) if algo else None,
            num_steps=_opt_int(info.get("speculative_num_steps")),
            topk=_opt_int(info.get("speculative_eagle_topk")),
            num_draft_tokens=_opt_int(info.get("speculative_num_draft_tokens")),
            draft_model=info.get("speculative_draft_model_path"),
            tp=_opt_int(info.get("tp_size")),
            launch=launch,
            details={k: v for k, v in details.items() if v is not None},
            sources=[
                f"GET {path} (sglang srt/entrypoints/http_server.py::server_info: resolved server args; "
                "launch_command: what was asked for)"
            ],
            version=str(info.get("version", "")),
        )

    def _vllm_settings(self) -> ServerSettings:
        models = self._json("/v1/models").get("data") or []
        if not models:
            raise ServerError(f"{self.url}/v1/models: the server lists no model")
        m = models[0]
        metrics = parse_prometheus(self._text("/metrics"))
        positions = sorted(
            {int(lab["position"]) for name, lab, _ in metrics if name == PER_POS + "_total" and "position" in lab}
        )
        has_spec = any(name.startswith("vllm:spec_decode_num_drafts") for name, _, _ in metrics)
        sources = [
            "GET /v1/models (served model and root)",
            "GET /metrics (v1/spec_decode/metrics.py::SpecDecodingProm: one per-position counter per "
            "speculative token)",
        ]
        cache_info = next((lab for name, lab, _ in metrics if name == "vllm:cache_config_info"), {})
        details = {
            "max_model_len": m.get("max_model_len"),
            "served_model_name": m.get("id"),
            "block_size": cache_info.get("block_size"),
            "cache_dtype": cache_info.get("cache_dtype"),
        }
        spec = None
        status, raw = self._request("/server_info?config_format=json")
        if status == 200:
            cfg = self._decode("/server_info?config_format=json", status, raw).get("vllm_config") or {}
            spec = cfg.get("speculative_config") if isinstance(cfg, dict) else None
            sources.append(
                "GET /server_info (VLLM_SERVER_DEV_MODE=1: entrypoints/serve/dev/server_info/api_router.py"
                "::show_server_info, the resolved VllmConfig)"
            )
            if isinstance(cfg, dict):
                par = cfg.get("parallel_config") or {}
                details["tensor_parallel_size"] = par.get("tensor_parallel_size")
                details["dtype"] = (cfg.get("model_config") or {}).get("dtype")
        else:
            sources.append(
                "/server_info not served (start the server with VLLM_SERVER_DEV_MODE=1 to report the "
                "draft path and the whole speculative config)"
            )
        steps = len(positions) or None
        draft = algo = None
        if isinstance(spec, dict):
            steps = _opt_int(spec.get("num_speculative_tokens")) or steps
            algo = spec.get("method")
            draft = spec.get("model")
            details["speculative_config"] = {
                k: spec.get(k)
                for k in ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size")
                if k in spec
            }
        elif has_spec:
            algo = "speculative (method not published without /server_info)"
        return ServerSettings(
            kind="vllm",
            url=self.url,
            model=str(m.get("root") or m.get("id")),
            algorithm=algo,
            num_steps=steps,
            topk=1 if steps else None,
            num_draft_tokens=steps + 1 if steps else None,
            draft_model=draft,
            tp=_opt_int(details.get("tensor_parallel_size")),
            details={k: v for k, v in details.items() if v is not None},
            sources=sources,
        )

    def _text(self, path: str) -> str:
        status, raw = self._request(path)
        if status != 200:
            raise ServerError(f"{self.url}{path}: HTTP {status}")
        return raw.decode(errors="replace")

    # -- generation ------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int, num_steps: int) -> RequestAcceptance:
        """One greedy request; acceptance exact (SGLang) or as /metrics deltas (vLLM)."""
        if self.kind == "sglang":
            return self._sglang_generate(prompt, max_new_tokens, num_steps)
        return self._vllm_generate(prompt, max_new_tokens, num_steps)

    def _sglang_generate(self, prompt: list[int], max_new_tokens: int, num_steps: int) -> RequestAcceptance:
        out = self._json(
            "/generate",
            {
                "input_ids": list(prompt),
                "sampling_params": {"temperature": 0, "max_new_tokens": int(max_new_tokens), "ignore_eos": True},
            },
            array_ok=True,
        )
        out = out[0] if isinstance(out, list) else out
        meta = out.get("meta_info") or {}
        if "spec_verify_ct" not in meta:
            raise ServerError(
                f"{self.url}/generate: meta_info has no spec_verify_ct: the server runs no speculative decoding"
            )
        hist = meta.get("spec_correct_drafts_histogram") or []  # hist[j]: verifies that accepted exactly j drafts
        per_pos = [sum(int(c) for c in hist[j + 1 :]) for j in range(num_steps)]
        return RequestAcceptance(
            list(prompt),
            [int(t) for t in out.get("output_ids") or []],
            int(meta["spec_verify_ct"]),
            int(meta.get("spec_num_correct_drafts") or 0),
            per_pos,
            exact=True,
        )

    def _vllm_snapshot(self) -> dict:
        return counters(parse_prometheus(self._text("/metrics")))

    def _vllm_generate(self, prompt: list[int], max_new_tokens: int, num_steps: int) -> RequestAcceptance:
        before = self._vllm_snapshot()
        out = self._json(
            "/v1/completions",
            {
                "model": self._served_name(),
                "prompt": list(prompt),
                "temperature": 0,
                "max_tokens": int(max_new_tokens),
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        after = self._vllm_snapshot()
        choice = (out.get("choices") or [{}])[0]
        tokens = choice.get("token_ids")
        if tokens is None:
            raise ServerError(
                f"{self.url}/v1/completions: no token_ids in the answer (vLLM < 0.10 lacks return_token_ids)"
            )
        if SPEC_COUNTERS[0] not in after:
            raise ServerError(
                f"{self.url}/metrics: no {SPEC_COUNTERS[0]} counter: the server runs no speculative decoding"
            )
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS + TRAFFIC}
        per_pos = [after.get(f"{PER_POS}[{j}]", 0.0) - before.get(f"{PER_POS}[{j}]", 0.0) for j in range(num_steps)]
        why = []
        busy = {k: before.get(k, 0.0) for k in BUSY if before.get(k, 0.0)}
        if busy:
            why.append("requests running or waiting before it: " + ", ".join(f"{k} {v:g}" for k, v in busy.items()))
        expected = {"vllm:request_success": 1, "vllm:prompt_tokens": len(prompt), "vllm:generation_tokens": len(tokens)}
        moved = [f"{k} +{d[k]:g} (this request: {v})" for k, v in expected.items() if k in after and d[k] != v]
        if moved:
            why.append("counters moved by more than this request: " + ", ".join(moved))
        return RequestAcceptance(
            list(prompt),
            [int(t) for t in tokens],
            int(d[SPEC_COUNTERS[0]]),
            int(d[SPEC_COUNTERS[2]]),
            [int(x) for x in per_pos],
            exact=False,
            contaminated="; ".join(why),
        )

    def _served_name(self) -> str:
        if not hasattr(self, "_name"):
            models = self._json("/v1/models").get("data") or [{}]
            self._name = str(models[0].get("id"))
        return self._name


def _first_bytes(raw: bytes | str, limit: int = 60) -> str:
    """What a server answered, for one line: its start, escaped (no newline or control byte gets
    through), with how much more there was."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    shown = repr(text[:limit])
    return shown + (f" and {len(text) - limit} more characters" if len(text) > limit else "")


def _opt_int(v) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def parse_launch_command(cmd) -> dict:
    """`--speculative-num-draft-tokens 16 ...` -> {"speculative_num_draft_tokens": "16", ...}."""
    if not cmd:
        return {}
    words = shlex.split(cmd) if isinstance(cmd, str) else [str(w) for w in cmd]
    out: dict = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            key, eq, val = w[2:].partition("=")
            if not eq:
                nxt = words[i + 1] if i + 1 < len(words) else None
                val = nxt if nxt is not None and not nxt.startswith("--") else "true"
            out[key.replace("-", "_")] = val
    return out


_LINE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """Prometheus text exposition -> (sample name, labels, value), comments skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        out.append((m.group("name"), dict(_LABEL.findall(m.group("labels") or "")), value))
    return out


def counters(samples: list[tuple[str, dict, float]]) -> dict[str, float]:
    """Sum over label sets (engines, models) of the counters the probe reads; per position as NAME[j].
    prometheus_client exports a counter NAME as NAME_total (NAME_created is its creation time)."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        base = name.removesuffix("_total") if name.endswith("_total") else name
        if base == PER_POS and name.endswith("_total"):
            key = f"{PER_POS}[{labels.get('position', '?')}]"
        elif (base in SPEC_COUNTERS or base in TRAFFIC) and name.endswith("_total"):
            key = base
        elif name in BUSY:
            key = name
        else:
            continue
        out[key] = out.get(key, 0.0) + value
    return out
