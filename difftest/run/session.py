"""One harness run: engine workers, captures (memoised and cached on disk), comparisons.

The pytest plugin and the CLI both drive a Session; nothing here is global.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from difftest.case import chat
from difftest.rules import engine_releases
from difftest.run import engine_identity
from difftest.run import infer_case as infer_mod
from difftest.compare import noise
from difftest.records.acceptance import AcceptStats
from difftest.base import tensorfile
from difftest.records.capture import Capture, CaptureCache, cache_key, partial_prefix, remove_partial
from difftest.base.content_digest import paths_signature
from difftest.case.case import Case
from difftest.compare.compare import CaptureDiff, compare_captures
from difftest.base.registry import calibration_engine, engine_schema, engine_target
from difftest.run.engine import EngineSpec, parse_spec
from difftest.base.errors import ConfigError, DifftestError, EngineError, EngineUnavailable, Unsupported
from difftest.base.paths import cache_root, log_file_name
from difftest.base.outputs import atomic_write
from difftest.records.fields import decode_value
from difftest.records.timings import Timings, WorkerPhase
from difftest.run.phase_clock import PhaseClock, case_of
from difftest.run.worker import PROJECT_ROOT, WorkerClient
from difftest.base.names import FC_IN
from difftest.records.check_data import ReplayRow
from difftest.records.engine_info import EngineInfo

if TYPE_CHECKING:  # annotations only: difftest.run.baseline builds on the session
    from difftest.run.baseline import BaselineSource

FIXTURE_GROUP = "difftest.fixtures"


def resolve_fixture(ref: str) -> str:
    """'fixture:NAME' -> a checkpoint directory, built on first use by a registered provider.

    A provider is a module registered under the `difftest.fixtures` entry points with
    `resolve_fixture(name) -> Path | None` and `build_all(force: bool)`.
    """
    name = ref.removeprefix("fixture:")
    providers = list(metadata.entry_points(group=FIXTURE_GROUP))
    for ep in providers:
        path = ep.load().resolve_fixture(name)
        if path is not None:
            return str(path)
    raise ConfigError(f"fixture {name!r} is not provided by any installed fixture provider ({len(providers)} found)")


def calibration_case(case: Case) -> Case:
    """The case in float64 under its own path (its captures and runs are cached apart): what the
    reference computes to measure the noise floor and the accept gate's numerical move.

    In half precision, with the weights rounded to the case's dtype first (Case.weights_dtype):
    every engine loads the checkpoint in that dtype, so a float32 checkpoint served in bfloat16 is
    one rounded model for all of them, and only how each computes it differs. Measured on a
    float32 Llama target and draft run in bfloat16: the float64 run of the unrounded weights
    accepted 3.59 against 2.56, a "numerical move" of 1.04 that every engine shares and that hid
    accept-length collapses; of the rounded weights, 2.56, the same per position."""
    rounded = case.dtype if case.dtype in noise.HALF_DTYPES else None
    return dataclasses.replace(
        case, dtype=noise.CALIBRATION_DTYPE, path=f"{case.path}#{noise.CALIBRATION_DTYPE}", weights_dtype=rounded
    )


def _target_limits(target: str) -> tuple[int | None, int | None]:
    """(vocab_size, max_position_embeddings) from the target's config.json where it states them;
    a config too broken to say is left to the engine that loads it (a one-line error of its own)."""
    try:
        config = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    if not isinstance(config, dict):
        return None, None
    vocab, max_pos = config.get("vocab_size"), config.get("max_position_embeddings")
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0  # noqa: E731
    return (vocab if ok(vocab) else None), (max_pos if ok(max_pos) else None)


@dataclass
class Options:
    engines: list[EngineSpec]
    reference: EngineSpec
    engine_python: dict[str, str] = field(default_factory=dict)  # spec key or name -> interpreter
    timeout: float = 900.0
    use_cache: bool = True
    log_dir: Path = Path("reports") / "logs"
    progress: Callable[[str], None] | None = None  # one line per slow step (engine start, capture, speculate)


class Session:
    def __init__(self, options: Options):
        self.options = options
        self.cache = CaptureCache(cache_root() / "captures")
        self._clients: dict[str, WorkerClient] = {}
        self._start_errors: dict[str, DifftestError] = {}
        # spec id -> what its worker said when it last started in this same environment, used for
        # cache keys until a result is not cached and the worker has to start (difftest.run.engine_identity)
        self._remembered: dict[str, EngineInfo] = {}
        self._identities: dict[str, str | None] = {}
        self.infos = engine_identity.InfoMemo(cache_root() / "engine-info")
        self._current_case: str | None = None  # the case whose items run now (begin_case)
        self._cases: dict[str, Case] = {}
        self._prompts: dict[tuple[str, bool], list[list[int]]] = {}
        self._captures: dict[tuple, Capture] = {}
        self._golden: dict[tuple, Capture | None] = {}  # None: the engine takes no golden input
        self._stats: dict[tuple, AcceptStats] = {}
        self._diffs: dict[tuple, list[CaptureDiff]] = {}
        self._floors: dict[str, noise.NoiseFloor] = {}
        # spec id -> a stored run standing in for an engine (difftest.run.baseline.BaselineSource)
        self._stored: dict[str, BaselineSource] = {}
        # case path -> `wiring: infer` result ((case, difftest.rules.infer_wiring.WiringInference)) or the error it raised
        self._inferences: dict[str, tuple[Case, Any] | DifftestError] = {}
        self.clock = PhaseClock()  # where each case's time goes (difftest.run.phase_clock; in its report)

    def add_stored(self, source: BaselineSource) -> None:
        """Serve `source.spec` from disk (captures, accept stats, info) instead of a worker."""
        self._stored[source.spec.id] = source

    # -- engines ---------------------------------------------------------------------
    def python_for(self, spec: EngineSpec) -> str:
        env_var = "DIFFTEST_PYTHON_" + spec.key.upper().replace("@", "_").replace("-", "_").replace(".", "_")
        return (
            self.options.engine_python.get(spec.key)
            or self.options.engine_python.get(spec.name)
            or os.environ.get(env_var)
            or self._env_python(spec)
            or sys.executable
        )

    def _env_python(self, spec: EngineSpec) -> str | None:
        """An engine environment made by `scripts/setup-engine` (later issues) lives in the user cache."""
        candidate = cache_root() / "envs" / spec.key / "bin" / "python"
        return str(candidate) if candidate.exists() else None

    def _new_client(self, spec: EngineSpec) -> WorkerClient:
        return WorkerClient(
            spec,
            engine_target(spec.name),
            self.python_for(spec),
            self.options.log_dir / log_file_name(spec.id),
            self.options.timeout,
        )

    def client(self, spec: EngineSpec) -> WorkerClient:
        if spec.id in self._start_errors:
            raise self._start_errors[spec.id]
        if spec.id not in self._clients:
            client = self._new_client(spec)
            self._progress(f"starting {spec.id} ({self.python_for(spec)})")
            t = time.monotonic()
            try:
                with self.clock.phase("engine.start", engine=spec.id):
                    client.start()
                self._check_release(spec, client.started_info)
                self._remember(spec, client.started_info)
            except DifftestError as e:
                client.kill()
                self._start_errors[spec.id] = e
                raise
            self._progress(f"{spec.id} ready in {time.monotonic() - t:.1f}s")
            self._clients[spec.id] = client
        return self._clients[spec.id]

    def info(self, spec: EngineSpec) -> EngineInfo:
        """What `spec` says about itself: a stored run's info, its started worker's, or, while every
        result asked for is cached, what its worker said when it last started in this same
        environment (difftest.run.engine_identity), so a fully cached run starts no engine."""
        if spec.id in self._stored:
            return self._stored[spec.id].info
        if spec.id not in self._clients and spec.id not in self._start_errors:
            remembered = self._remembered_info(spec)
            if remembered is not None:
                return remembered
        return self.client(spec).started_info

    def _identity(self, spec: EngineSpec) -> str | None:
        if spec.id not in self._identities:
            client = self._new_client(spec)
            self._identities[spec.id] = engine_identity.identity(
                spec.to_dict(), client.target, client.python, client.environment(), PROJECT_ROOT
            )
        return self._identities[spec.id]

    def _remembered_info(self, spec: EngineSpec) -> EngineInfo | None:
        if not self.options.use_cache:
            return None  # nothing is read from the cache: every result needs the worker anyway
        if spec.id not in self._remembered:
            ident = self._identity(spec)
            info = self.infos.get(ident) if ident else None
            if info is None:
                return None
            try:
                self._check_release(spec, info)
            except DifftestError as e:
                self._start_errors[spec.id] = e
                raise
            self._progress(
                f"{spec.id}: {info.version} (as its worker said in this environment; it starts "
                "when a result is not cached)"
            )
            self._remembered[spec.id] = info
        return self._remembered[spec.id]

    def _remember(self, spec: EngineSpec, info: EngineInfo) -> None:
        """Keep what a started worker said for later runs; a remembered info this run already used for
        cache keys that the worker now contradicts means those keys named another engine."""
        ident = self._identity(spec)
        if ident is None:
            return
        self.infos.put(ident, info)
        used = self._remembered.get(spec.id)
        if used is not None and used.to_dict() != info.to_dict():
            raise EngineError(
                f"{spec.id}: its worker reports {info.version} {info.versions}, but what this environment's "
                f"worker said before ({used.version} {used.versions}) named the results this run read from "
                "the cache; run again (the record is corrected now) or with --no-capture-cache"
            )

    def _check_release(self, spec: EngineSpec, info: EngineInfo) -> None:
        """An engine with release rules (difftest.rules.engine_releases) running a release outside them is run,
        not refused: every verdict is measured (fc chunks against the reference's layers, golden inputs,
        accept length), and its reports say no rule is on record (engine_releases.unrecorded). Only a
        version that is not a release at all is refused, in one line."""
        if info.name not in engine_releases.SUPPORTED:
            return
        if engine_releases.on_record(info.name, info.version):
            return
        try:
            engine_releases.newer_than_pinned(info.name, info.version)  # refuses a version that is not a release
        except ConfigError as e:
            raise ConfigError(f"{spec.id} ({self.python_for(spec)}): {e}") from None
        self._progress(f"{spec.id}: {engine_releases.unrecorded(info.name, info.version)}")

    def begin_case(self, path: str) -> None:
        """A worker that died during an earlier case (e.g. an SGLang scheduler crash that case provoked)
        is replaced for this one, so one crashing case does not fail every later case's items. Within
        a case a dead worker stays dead: each restart would crash the same way, minutes each."""
        if path == self._current_case:
            return
        self._current_case = path
        self.clock.current_case = case_of(path)
        for spec_id, client in list(self._clients.items()):
            if client.proc is not None and client.proc.poll() is not None:
                how = "ended after an engine that cannot restart in it failed" if client.ended_with else "died"
                self._progress(f"{spec_id}: its worker {how} during an earlier case; a fresh one starts for {path}")
                client.kill()
                del self._clients[spec_id]

    def _progress(self, message: str) -> None:
        if self.options.progress is not None:
            self.options.progress(message)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def abort(self) -> None:
        """Kill every worker now (an interrupted run: none is waited for)."""
        for client in self._clients.values():
            client.kill()
        self._clients.clear()

    # -- cases -----------------------------------------------------------------------
    def prepare(self, case: Case) -> Case:
        """Resolve fixtures (building them on first use); memoised per case file."""
        if case.path not in self._cases:

            def fix(v):
                if not (isinstance(v, str) and v.startswith("fixture:")):
                    return v
                t = time.monotonic()
                path = resolve_fixture(v)
                if time.monotonic() - t > 5:  # a cold build: say which step took the time
                    self._progress(f"{v} built in {time.monotonic() - t:.0f}s (cached from now on)")
                return path

            resolved = dataclasses.replace(
                case,
                target=fix(case.target),
                draft=fix(case.draft),
                # per-engine settings may name their own checkpoints (e.g. engines.sglang.draft)
                engines={e: {k: fix(v) for k, v in s.items()} for e, s in case.engines.items()},
            )
            if infer_mod.wants_inference(resolved):
                resolved = self._infer(resolved)
            self._cases[case.path] = resolved
        return self._cases[case.path]

    def _infer(self, case: Case) -> Case:
        """`wiring: infer`: the case with the inferred wiring (difftest.run.infer_case); a failure is kept and
        raised again for every item of the case instead of re-running the inference."""
        if case.path not in self._inferences:
            self._progress(f"{case.name}: inferring the draft's training wiring")
            try:
                self._inferences[case.path] = infer_mod.inferred_case(self, case)
            except DifftestError as e:
                self._inferences[case.path] = e
        found = self._inferences[case.path]
        if isinstance(found, DifftestError):
            raise found
        return found[0]

    def inference(self, case: Case):
        """The WiringInference behind a `wiring: infer` case (None for any other case)."""
        found = self._inferences.get(case.path)
        return found[1] if isinstance(found, tuple) else None

    def prompt_ids(self, case: Case, speculative: bool = False) -> list[list[int]]:
        key = (case.path, speculative)
        if key not in self._prompts:
            prompts = (case.spec_prompts or case.prompts) if speculative else case.prompts
            tokenizer: Any = None  # a transformers tokenizer, loaded when a prompt is text
            if any(p.text is not None or p.messages is not None for p in prompts):
                from transformers import AutoTokenizer

                try:
                    tokenizer = AutoTokenizer.from_pretrained(case.target, local_files_only=True)
                except (OSError, ValueError) as e:
                    raise ConfigError(
                        f"{case.path}: prompts: cannot load the target's tokenizer from {case.target} ({e})"
                    ) from None
            out = []
            field_name = "speculative.prompts" if speculative and case.spec_prompts else "prompts"
            vocab, max_pos = _target_limits(case.target)
            # positions a run reaches: the prompt, then the draft's steps (and, speculating, the new tokens)
            extra = case.num_steps + (case.max_new_tokens if speculative else 0)
            for i, p in enumerate(prompts):
                where = f"{case.path}: {field_name}[{i}]"
                if p.messages is not None:
                    try:
                        ids = chat.render(tokenizer, p.messages, p.chat_template_kwargs)
                    except Exception as e:  # a template that raises (jinja errors, missing kwargs) is the user's input
                        raise ConfigError(
                            f"{where}: cannot render the messages with the target's chat template: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        ) from None
                else:
                    ids = p.ids if p.ids is not None else tokenizer(p.text, add_special_tokens=True)["input_ids"]
                if len(ids) < 2:
                    raise ConfigError(f"{where}: needs at least 2 tokens, got {len(ids)}")
                if vocab is not None and max(ids) >= vocab:
                    raise ConfigError(
                        f"{where}: token id {max(ids)} is outside the target's vocabulary (vocab_size {vocab})"
                    )
                if max_pos is not None and len(ids) + extra > max_pos:
                    raise ConfigError(
                        f"{where}: {len(ids)} tokens + {extra} generated exceed the target's max_position_embeddings "
                        f"({max_pos})"
                    )
                out.append(list(ids))
            self._prompts[key] = out
        return self._prompts[key]

    def engine_case(self, case: Case, spec: EngineSpec) -> Case:
        """What the worker of `spec` is sent: a labelled spec's case section `engines["NAME@LABEL"]`
        overrides `engines[NAME]` key by key, so two labels of one engine can run with different
        settings (e.g. `sglang@new: {draft_config_overrides: ...}` simulating a changed release)."""
        if not spec.label or spec.key not in case.engines:
            return case
        merged = {**case.engines.get(spec.name, {}), **case.engines[spec.key]}
        return dataclasses.replace(case, engines={**case.engines, spec.name: merged})

    # -- results ---------------------------------------------------------------------
    def inputs_key(self, case: Case, spec: EngineSpec) -> list:
        """What a cached result of `spec` on `case` depends on besides the engine's version: the
        case's fingerprint as the engine reads it (the target and draft by content, its own settings
        section, a draft its settings run instead of the case's: Case.fingerprint) and, by content
        too, any file or directory its settings or spec parameters name (its own draft, training data).
        Cases that differ only in what an engine never reads share its results (the exports of one
        draft, each run as trained on the reference)."""
        section, params = dict(case.engines.get(spec.name) or {}), dict(spec.params)
        # a stored baseline names no adapter: its stored results carry their own key
        schema, replaced = (None if spec.id in self._stored else engine_schema(spec.name)), dict[str, Any]()
        for layer in (section, params):  # the spec's parameters win over the case's section
            for key in list(layer):
                field_name = schema.replacing(key) if schema is not None else None
                # an empty value is "not given" (settings: `draft: ${VAR:-}`): the case's field stands
                if field_name is not None and layer[key] not in (None, ""):
                    replaced[field_name] = layer.pop(key)
        # An adapter reads its own section only (difftest.run.engine.check_settings); the other engines'
        # sections and the fields its settings replace never reach it.
        as_read = dataclasses.replace(case, engines={spec.name: section} if section else {}, **replaced)
        return [as_read.fingerprint(), paths_signature({"settings": section, "params": params})]

    def capture(self, case: Case, spec: EngineSpec, index: int) -> Capture:
        case = self.prepare(case)
        ids = self.prompt_ids(case)[index]
        memo = (case.path, spec.id, index)
        if memo not in self._captures and spec.id in self._stored:
            self._captures[memo] = self._stored[spec.id].capture(case, index)
        if memo not in self._captures:
            with self.clock.phase("session", case.path, spec.id, case.dtype):
                key = self._capture_key(case, spec, ids)
                case = self.engine_case(case, spec)
                cached = self._cached(key)
                if cached is None:
                    client = self.client(spec)
                    out = self.cache.path(key)
                    self._progress(f"{spec.id}: capturing {case.name} prompt {index + 1}/{len(self.prompt_ids(case))}")
                    self._request(
                        client, {"op": "capture", "case": case.to_dict(), "prompt_ids": ids, "out": str(out)}, out
                    )
                    cached = self._load(out)
            self._captures[memo] = cached
        return self._captures[memo]

    def _capture_key(self, case: Case, spec: EngineSpec, ids: list[int]) -> str:
        """The cache key of `spec`'s capture of prompt `ids` of `case` (prepared; started or stored)."""
        return cache_key(
            "capture", spec.id, self._version(spec), self.inputs_key(self.engine_case(case, spec), spec), ids
        )

    def _cached(self, key: str) -> Capture | None:
        if not self.options.use_cache:
            return None
        with self.clock.phase("transfer.read") as frame:
            found = self.cache.get(key)
            frame.bytes = found.nbytes if found is not None else 0
        return found

    def _load(self, out: Path) -> Capture:
        with self.clock.phase("transfer.read") as frame:
            capture = Capture.load(out)
            frame.bytes = capture.nbytes
        return capture

    def _request(self, client: WorkerClient, msg: dict, out: Path | None = None) -> dict:
        """A worker request, timed (the worker's own phases come back in its reply); what a worker
        that died writing `out` left half-written is removed."""
        try:
            with self.clock.phase("request"):
                reply = client.request(msg)
                try:
                    measured = decode_value(list[WorkerPhase], reply.get("timings", []), "worker reply", "timings")
                except ConfigError:
                    measured = []  # a worker of another difftest version: its phases are not counted
                self.clock.add_inner(measured)
        finally:
            if out is not None:
                remove_partial(out)
        return reply

    def timings(self, case: Case) -> Timings:
        """Where the case's time went so far (difftest.run.phase_clock)."""
        return self.clock.timings(case.path)

    def capture_golden(
        self,
        case: Case,
        spec: EngineSpec,
        index: int,
        source: EngineSpec | None = None,
        source_case: Case | None = None,
    ) -> Capture | None:
        """Layerwise golden inputs: the engine's draft re-run on the *reference's* draft.fc_in (or on
        `source`'s capture of `source_case`: the noise floor feeds the float64 fc_in to the draft in
        the case's dtype). None when the engine does not support it (Engine.capture_draft_from)."""
        case = self.prepare(case)
        source = source or self.options.reference
        source_case = self.prepare(source_case) if source_case is not None else case
        memo = (case.path, spec.id, index, "golden", source.id, source_case.path)
        if memo not in self._golden:
            with self.clock.phase("session", case.path, spec.id, case.dtype):
                self._golden[memo] = self._capture_golden(case, spec, index, source, source_case)
        return self._golden[memo]

    def _capture_golden(
        self, case: Case, spec: EngineSpec, index: int, source: EngineSpec, source_case: Case
    ) -> Capture | None:
        ref = self.capture(source_case, source, index)
        if FC_IN not in ref.tensors:
            return None
        ids = self.prompt_ids(case)[index]
        ref_key = self._capture_key(source_case, source, ids)
        case = self.engine_case(case, spec)
        key = cache_key("golden", spec.id, self.info(spec).version, self.inputs_key(case, spec), ref_key)
        cached = self._cached(key)
        if cached is None:
            client = self.client(spec)
            out = self.cache.path(key)
            # the harness's pid in its name: left behind by a harness killed now, it is removed later
            fc_file = out.with_name(partial_prefix(out) + "fc_in.safetensors")
            fc_file.parent.mkdir(parents=True, exist_ok=True)
            try:
                with self.clock.phase("transfer.write") as frame:
                    frame.bytes = tensorfile.write(fc_file, {FC_IN: ref.tensors[FC_IN]})
                self._request(
                    client,
                    {
                        "op": "capture_draft_from",
                        "case": case.to_dict(),
                        "prompt_ids": ids,
                        "fc_in": str(fc_file),
                        "out": str(out),
                    },
                    out,
                )
            except Unsupported:
                return None
            finally:
                fc_file.unlink(missing_ok=True)
            cached = self._load(out)
        return cached

    def speculate(self, case: Case, spec: EngineSpec) -> AcceptStats:
        case = self.prepare(case)
        memo = (case.path, spec.id)
        if memo not in self._stats and spec.id in self._stored:
            self._stats[memo] = self._stored[spec.id].speculate(case)
        if memo not in self._stats:
            with self.clock.phase("session", case.path, spec.id, case.dtype):
                self._stats[memo] = self._speculate(self.engine_case(case, spec), spec)
        return self._stats[memo]

    def _speculate(self, case: Case, spec: EngineSpec) -> AcceptStats:
        info = self.info(spec)
        prompts = self.prompt_ids(case, speculative=True)
        key = cache_key("speculate", spec.id, info.version, self.inputs_key(case, spec), prompts)
        path = self.cache.path(key).with_suffix(".json")
        live = info.live  # a running server: ask it again every run, never cache
        if self.options.use_cache and not live and path.exists():
            return AcceptStats.from_dict(json.loads(path.read_text()))
        self._progress(f"{spec.id}: speculative decoding on {case.name} ({len(prompts)} prompts)")
        reply = self._request(
            self.client(spec),
            {
                "op": "speculate",
                "case": case.to_dict(),
                "prompts": prompts,
                "num_steps": case.num_steps,
                "max_new_tokens": case.max_new_tokens,
            },
        )
        stats = AcceptStats.from_dict(reply["stats"])
        if not live:
            atomic_write(path, json.dumps(stats.to_dict(), indent=1))
        return stats

    def is_live(self, spec: EngineSpec) -> bool:
        """A running server (EngineInfo.live): no tensors to compare, acceptance only."""
        return spec.id not in self._stored and self.info(spec).live

    def replay(
        self,
        case: Case,
        spec: EngineSpec,
        requests: list[tuple[list[int], list[int]]],
        num_steps: int,
        topk: int,
        num_draft_tokens: int,
    ) -> list[ReplayRow]:
        """`spec`'s prediction on another engine's tokens (Engine.replay), per (prompt, output)."""
        case = self.engine_case(self.prepare(case), spec)
        if spec.id in self._stored:
            raise Unsupported(f"{spec.id}: a stored baseline cannot replay a server's tokens; use --reference=ref")
        self._progress(f"{spec.id}: replaying {len(requests)} server outputs through the draft")
        with self.clock.phase("session", case.path, spec.id, case.dtype):
            reply = self._request(
                self.client(spec),
                {
                    "op": "replay",
                    "case": case.to_dict(),
                    "requests": requests,
                    "num_steps": num_steps,
                    "topk": topk,
                    "num_draft_tokens": num_draft_tokens,
                },
            )
        return [ReplayRow.from_json(r, f"{spec.id}'s replay", f"replays[{i}]") for i, r in enumerate(reply["replays"])]

    # -- the noise floor (difftest.compare.noise) ----------------------------------------------------
    def calibration_spec(self) -> EngineSpec:
        """The engine that measures the noise floor: the reference when it is the calibration engine
        (difftest.base.registry.calibration_engine, with its wiring and flags), else a plain one beside it."""
        ref, name = self.options.reference, calibration_engine()
        return ref if ref.name == name and ref.id not in self._stored else EngineSpec(name)

    def noise_floor(self, case: Case) -> noise.NoiseFloor:
        """Per canonical tensor, how far the reference moves when it computes the case in float64
        instead of the case's dtype; memoised per case (the captures behind it are cached on disk)."""
        case = self.prepare(case)
        if case.path not in self._floors:
            spec = self.calibration_spec()
            with self.clock.phase("noise_floor", case.path, spec.id, case.dtype):
                self._floors[case.path] = self._measure_floor(case, spec)
        return self._floors[case.path]

    def _measure_floor(self, case: Case, spec: EngineSpec) -> noise.NoiseFloor:
        exact = calibration_case(case)
        try:
            pairs = [(self.capture(case, spec, i), self.capture(exact, spec, i)) for i in range(len(case.prompts))]
            # the draft alone: its own rounding, on the float64 run's fc_in (difftest.compare.noise: draft floor)
            own = [
                (self.capture_golden(case, spec, i, source=spec, source_case=exact), exact_cap)
                for i, (_, exact_cap) in enumerate(pairs)
            ]
        except DifftestError as e:
            return noise.unmeasured(case.dtype, f"{spec.id} cannot run this case in float64: {str(e).splitlines()[0]}")
        return noise.measure_floor(
            pairs,
            case.dtype,
            f"measured: {spec.id} in {case.dtype} vs float64 over {len(pairs)} prompts",
            [p for p in own if p[0] is not None],
        )

    def accept_noise(self, case: Case) -> tuple[tuple[AcceptStats, AcceptStats] | None, str]:
        """The reference's speculative run in the case's dtype and in float64 (difftest.compare.accept_judge:
        the numerical part of the accept-length noise), or None with the reason it cannot run."""
        case = self.prepare(case)
        if case.dtype == noise.CALIBRATION_DTYPE:
            return None, f"the case runs in {case.dtype}: no numerical move to measure"
        spec = self.calibration_spec()
        exact = calibration_case(case)
        try:
            pair = (self.speculate(case, spec), self.speculate(exact, spec))
        except DifftestError as e:
            return (
                None,
                f"numerical move not measured: {spec.id} cannot speculate this case in float64 ({str(e).splitlines()[0]})",
            )
        return pair, f"numerical move measured: {spec.id} in {case.dtype} vs float64"

    def comparisons(self, case: Case, spec: EngineSpec) -> list[CaptureDiff]:
        """Per prompt: the engine's capture against the reference's."""
        memo = (case.path, spec.id)
        if memo not in self._diffs:
            ref = self.options.reference
            out = []
            for i in range(len(case.prompts)):
                a, b = self.capture(case, ref, i), self.capture(case, spec, i)
                # An engine's capture meta may list `partial: [patterns]`: reference tensors it cannot
                # expose (e.g. vLLM: target layers it does not capture); missing those is allowed.
                partial = list(b.meta.partial)
                floor = self.noise_floor(case)
                with self.clock.phase("compare", case.path, spec.id, case.dtype):
                    out.append(
                        compare_captures(
                            a, b, case.dtype, case.tolerances, [*case.allow_missing, *partial], floor=floor
                        )
                    )
            self._diffs[memo] = out
        return self._diffs[memo]

    def computed_comparisons(self, case: Case) -> dict[str, list[CaptureDiff]]:
        """spec id -> per-prompt diffs, for the comparisons this session has already made."""
        return {engine_id: diffs for (path, engine_id), diffs in self._diffs.items() if path == case.path}

    def _version(self, spec: EngineSpec) -> str:
        """The engine's version, as its cache keys name it (a stored run: the version it was saved as)."""
        return self.info(spec).version

    def engine_info(self, spec: EngineSpec) -> EngineInfo | None:
        """What is known of `spec` without starting it (None: it neither started nor ran before here)."""
        if spec.id in self._stored:
            return self._stored[spec.id].info
        c = self._clients.get(spec.id)
        return c.info if c else self._remembered.get(spec.id)

    def case_engine_info(self, case: Case, spec: EngineSpec) -> EngineInfo | None:
        """The engine that produced `spec`'s results for this case: a stored baseline answers with the
        info of the engine it was saved from (its name and release), a running engine with its own."""
        stored = self._stored.get(spec.id)
        if stored is not None and hasattr(stored, "entry"):
            try:
                _, entry, _ = stored.entry(self.prepare(case))
            except ConfigError:
                return None
            return entry.info
        return self.engine_info(spec)

    def _stored_engine(self, case: Case, spec: EngineSpec) -> EngineSpec | None:
        """The engine a stored baseline standing in as `spec` was saved from, for this case (None:
        `spec` runs here, or the baseline has no usable entry for the case)."""
        stored = self._stored.get(spec.id)
        if stored is None or not hasattr(stored, "entry"):
            return None
        try:
            engine_id, _, _ = stored.entry(self.prepare(case))
            return parse_spec(engine_id)
        except ConfigError:
            return None

    def reference_names(self, case: Case) -> tuple[str, ...]:
        """What the run's reference answers to in a case's `expect_failure: reference`: its name and
        spec id, and for a stored baseline also those of the engine it was saved from, so a failure
        declared against `sglang@0.5.16` holds whether that release runs now or was stored on it."""
        ref = self.options.reference
        saved = self._stored_engine(case, ref)
        return (ref.name, ref.id) + ((saved.name, saved.id) if saved is not None else ())

    def reference_label(self, case: Case) -> str:
        """The reference as check messages name it: its spec id, or for a stored baseline the engine
        it was saved from and the baseline (`sglang@0.5.16 (baseline sgl0516)`)."""
        ref = self.options.reference
        saved = self._stored_engine(case, ref)
        return ref.id if saved is None else f"{saved.id} (baseline {self._stored[ref.id].name})"

    def start_error(self, spec: EngineSpec) -> str | None:
        e = self._start_errors.get(spec.id)
        return str(e) if e else None


__all__ = ["Options", "Session", "EngineUnavailable", "cache_root", "resolve_fixture"]
