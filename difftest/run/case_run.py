"""One case's run over the engine pool (difftest.run.pool.EnginePool): the case prepared (fixtures
resolved, `wiring: infer` inferred), its prompts, every engine's captures, golden inputs and
speculative runs, its noise floor and comparisons, each computed once and cached on disk by the
pool. The checks (difftest.checks.checks) judge a CaseRun; its record (CaseRun.record) is what the
report shows.
"""

from __future__ import annotations

import dataclasses
import json
import time
from importlib import metadata
from pathlib import Path
from collections.abc import Callable
from typing import Any

from difftest.base import tensorfile
from difftest.base.content_digest import paths_signature
from difftest.base.errors import ConfigError, DifftestError, Unsupported
from difftest.base.names import FC_IN
from difftest.base.outputs import atomic_write
from difftest.base.registry import engine_schema
from difftest.case import chat
from difftest.case.case import Case
from difftest.compare import noise
from difftest.compare.compare import CaptureDiff, compare_captures
from difftest.records.acceptance import AcceptStats
from difftest.records.capture import Capture, cache_key, partial_prefix
from difftest.records.case_record import CaseRecord
from difftest.records.check_result import CheckResult
from difftest.records.check_data import ReplayRow
from difftest.records.engine_info import EngineInfo
from difftest.records.noise_floor import DeclaredFloor, NoiseFloorRecord
from difftest.records.report import EngineEntry, PromptComparison
from difftest.records.tensor_diff import TensorDiff
from difftest.records.timings import Timings
from difftest.records.wiring_inference import WiringInference
from difftest.run import infer_case as infer_mod
from difftest.run.engine import EngineSpec, parse_spec
from difftest.run.pool import EnginePool, Options
from difftest.run.protocol import CaptureDraftFromRequest, CaptureRequest, ReplayRequest, SpeculateRequest
from difftest.run.worker import WorkerClient

FIXTURE_GROUP = "difftest.fixtures"
# The calibration engine's setting that computes its float32 matmuls in a reduced format (the
# reference's `ref[matmul=tf32]`): how the floor of a case's declared `precision:` is measured.
MATMUL_SETTING = "matmul"


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


class _EvidenceRuns:
    """What `wiring: infer` (difftest.run.infer_case) captures its evidence through: the run's
    options and a capture of any case it builds, each case run over the same pool."""

    def __init__(self, pool: EnginePool):
        self.pool = pool
        self.options = pool.options
        self._runs: dict[str, CaseRun] = {}

    def capture(self, case: Case, spec: EngineSpec, index: int) -> Capture:
        run = self._runs.setdefault(case.path, CaseRun(self.pool, case))
        return run.capture(spec, index)


class CaseRun:
    """One case over the pool's engines; every result is computed on first use and kept."""

    def __init__(self, pool: EnginePool, case: Case):
        self.pool = pool
        self.case = case  # as loaded; `prepared` is what the engines are given
        self._prepared: Case | None = None
        # `wiring: infer`: (case, its WiringInference), or the error the inference raised
        self._inference: tuple[Case, WiringInference] | DifftestError | None = None
        self._prompts: dict[bool, list[list[int]]] = {}
        self._captures: dict[tuple[str, int], Capture] = {}
        self._golden: dict[tuple, Capture | None] = {}  # None: the engine takes no golden input
        self._stats: dict[str, AcceptStats] = {}
        self._diffs: dict[str, list[CaptureDiff]] = {}
        self._floor: noise.NoiseFloor | None = None
        self._calibration: CaseRun | None = None
        self._precision_floors: dict[str, noise.NoiseFloor] = {}  # declared matmul format -> its floor
        self._completed: set[str] = set()  # engines whose results for this case were all computed (_complete)

    @property
    def options(self) -> Options:
        return self.pool.options

    @property
    def path(self) -> str:
        return self.case.path

    # -- the case --------------------------------------------------------------------
    @property
    def prepared(self) -> Case:
        """The case with its fixtures resolved (built on first use) and, for `wiring: infer`, its wiring
        inferred; a failed inference is raised again for every item of the case."""
        if self._prepared is None:
            case = self.case

            def fix(v):
                if not (isinstance(v, str) and v.startswith("fixture:")):
                    return v
                t = time.monotonic()
                path = resolve_fixture(v)
                if time.monotonic() - t > 5:  # a cold build: say which step took the time
                    self.pool.progress(f"{v} built in {time.monotonic() - t:.0f}s (cached from now on)")
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
            self._prepared = resolved
        return self._prepared

    def _infer(self, case: Case) -> Case:
        if self._inference is None:
            self.pool.progress(f"{case.name}: inferring the draft's training wiring")
            try:
                self._inference = infer_mod.inferred_case(_EvidenceRuns(self.pool), case)
            except DifftestError as e:
                self._inference = e
        if isinstance(self._inference, DifftestError):
            raise self._inference
        return self._inference[0]

    def inference(self) -> WiringInference | None:
        """The WiringInference behind a `wiring: infer` case (None for any other case)."""
        return self._inference[1] if isinstance(self._inference, tuple) else None

    def prompt_ids(self, speculative: bool = False) -> list[list[int]]:
        if speculative not in self._prompts:
            self._prompts[speculative] = self._tokenize(self.prepared, speculative)
        return self._prompts[speculative]

    @staticmethod
    def _tokenize(case: Case, speculative: bool) -> list[list[int]]:
        prompts = (case.spec_prompts or case.prompts) if speculative else case.prompts
        tokenizer: Any = None  # a transformers tokenizer, loaded when a prompt is text
        if any(p.text is not None or p.messages is not None for p in prompts):
            from transformers import AutoTokenizer  # seconds to import; only text and chat prompts need it

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
        return out

    def engine_case(self, spec: EngineSpec) -> Case:
        """What the worker of `spec` is sent (the prepared case; see engine_case_of)."""
        return engine_case_of(self.prepared, spec)

    def inputs_key(self, spec: EngineSpec) -> list:
        """What a cached result of `spec` on this case depends on besides the engine's version
        (inputs_key_of on the case as `spec` is sent it)."""
        return inputs_key_of(self.engine_case(spec), spec, self.pool.stored(spec) is not None)

    # -- results ---------------------------------------------------------------------
    def capture(self, spec: EngineSpec, index: int) -> Capture:
        case = self.prepared
        ids = self.prompt_ids()[index]
        memo = (spec.id, index)
        stored = self.pool.stored(spec)
        if memo not in self._captures and stored is not None:
            self._captures[memo] = stored.capture(case, index)
        if memo not in self._captures:
            with self.pool.clock.phase("session", case.path, spec.id, case.dtype):
                key = self.capture_key(spec, ids)
                case = self.engine_case(spec)
                cached = self.pool.cached(key)
                if cached is None:
                    client = self._client(spec, case)
                    out = self.pool.cache.path(key)
                    self.pool.progress(f"{spec.id}: capturing {case.name} prompt {index + 1}/{len(self.prompt_ids())}")
                    self.pool.request(client, CaptureRequest(case, ids, str(out)), out)
                    cached = self.pool.load(out)
            self._captures[memo] = cached
        return self._captures[memo]

    def _client(self, spec: EngineSpec, case: Case) -> WorkerClient:
        """`spec`'s worker for `case` (the pool's). Under a one-at-a-time memory plan
        (difftest.run.memory_plan) it first computes all this case asks of `spec` while its worker
        runs (_complete): each engine then starts once per case, not once per switch between engines."""
        if spec.id not in self._completed and self.pool.one_at_a_time(case):
            self._completed.add(spec.id)
            self.pool.client(spec, case)  # started (or refused) before anything is asked of it
            if not self.pool.is_live(spec):
                self._complete(spec)
        return self.pool.client(spec, case)  # again: completing may have restarted it

    def _complete(self, spec: EngineSpec) -> None:
        """What the checks ask of `spec` for this case without another engine's worker: every prompt's
        capture, the speculative run, the golden re-runs on reference captures already taken; for the
        engine that calibrates, the float64 run's too. A failure stops it: the check asking again says it.

        The float64 run goes first, each part of the case's dtype after it: where the case's load and the
        float64 run do not fit one worker, the pool runs each in a fresh worker (the float64 one reads the
        checkpoint's files, no case-dtype load: difftest.run.memory_plan.worker_bytes), and the golden
        re-runs on the float64 captures need the case's models. Interleaved per prompt they switched
        workers at every request (each switch a load of the case's models: 16 GB at the Llama-3.1-8B
        shape); in this order the case's models load once."""
        prompts = range(len(self.prompt_ids()))
        ref = self.options.reference
        calibrating = spec.id == self.pool.calibration_spec().id and self.prepared.dtype != noise.CALIBRATION_DTYPE
        exact = None
        if calibrating:
            try:
                exact = self.calibration()
                for i in prompts:
                    exact.capture(spec, i)
                exact.speculate(spec)
            except DifftestError:
                pass  # refused or failed: the case's own dtype still runs; the checks asking for it say why
        try:
            for i in prompts:
                self.capture(spec, i)
            for i in prompts:
                if spec.id != ref.id and ((ref.id, i) in self._captures or self.pool.stored(ref) is not None):
                    self.capture_golden(spec, i)
            self.speculate(spec)
            if exact is not None:
                for i in prompts:
                    self.capture_golden(spec, i, source=spec, source_run=exact)
        except DifftestError:
            return

    def capture_key(self, spec: EngineSpec, ids: list[int]) -> str:
        """The cache key of `spec`'s capture of prompt `ids` of this case (started or stored)."""
        return cache_key("capture", spec.id, self.pool.version(spec), self.inputs_key(spec), ids)

    def timings(self) -> Timings:
        """Where the case's time went so far (difftest.run.phase_clock)."""
        return self.pool.clock.timings(self.path)

    def capture_golden(
        self, spec: EngineSpec, index: int, source: EngineSpec | None = None, source_run: CaseRun | None = None
    ) -> Capture | None:
        """Layerwise golden inputs: the engine's draft re-run on the *reference's* draft.fc_in (or on
        `source`'s capture in `source_run`: the noise floor feeds the float64 fc_in to the draft in
        the case's dtype). None when the engine does not support it (Engine.capture_draft_from)."""
        case = self.prepared
        source = source or self.options.reference
        source_run = source_run or self
        memo = (spec.id, index, source.id, source_run.path)
        if memo not in self._golden:
            with self.pool.clock.phase("session", case.path, spec.id, case.dtype):
                self._golden[memo] = self._capture_golden(spec, index, source, source_run)
        return self._golden[memo]

    def _capture_golden(self, spec: EngineSpec, index: int, source: EngineSpec, source_run: CaseRun) -> Capture | None:
        ref = source_run.capture(source, index)
        if FC_IN not in ref.tensors:
            return None
        ids = self.prompt_ids()[index]
        ref_key = source_run.capture_key(source, ids)
        case = self.engine_case(spec)
        key = cache_key("golden", spec.id, self.pool.info(spec).version, self.inputs_key(spec), ref_key)
        cached = self.pool.cached(key)
        if cached is None:
            client = self._client(spec, case)
            out = self.pool.cache.path(key)
            # the harness's pid in its name: left behind by a harness killed now, it is removed later
            fc_file = out.with_name(partial_prefix(out) + "fc_in.safetensors")
            fc_file.parent.mkdir(parents=True, exist_ok=True)
            try:
                with self.pool.clock.phase("transfer.write") as frame:
                    frame.bytes = tensorfile.write(fc_file, {FC_IN: ref.tensors[FC_IN]})
                self.pool.request(client, CaptureDraftFromRequest(case, ids, str(fc_file), str(out)), out)
            except Unsupported:
                return None
            finally:
                fc_file.unlink(missing_ok=True)
            cached = self.pool.load(out)
        return cached

    def speculate(self, spec: EngineSpec) -> AcceptStats:
        case = self.prepared
        stored = self.pool.stored(spec)
        if spec.id not in self._stats and stored is not None:
            self._stats[spec.id] = stored.speculate(case)
        if spec.id not in self._stats:
            with self.pool.clock.phase("session", case.path, spec.id, case.dtype):
                self._stats[spec.id] = self._speculate(spec)
        return self._stats[spec.id]

    def _speculate(self, spec: EngineSpec) -> AcceptStats:
        case = self.engine_case(spec)
        info = self.pool.info(spec)
        prompts = self.prompt_ids(speculative=True)
        key = cache_key("speculate", spec.id, info.version, self.inputs_key(spec), prompts)

        def run() -> AcceptStats:
            self.pool.progress(f"{spec.id}: speculative decoding on {case.name} ({len(prompts)} prompts)")
            request = SpeculateRequest(case, prompts, case.num_steps, case.max_new_tokens)
            return self.pool.request(self._client(spec, case), request).stats

        return self._cached_stats(key, info.live, run)

    def _cached_stats(self, key: str, live: bool, run: Callable[[], AcceptStats]) -> AcceptStats:
        """`run`'s acceptance, kept on disk under `key`; a running server (`live`) is asked again every
        run, never cached."""
        path = self.pool.cache.path(key).with_suffix(".json")
        if self.options.use_cache and not live and path.exists():
            return AcceptStats.from_dict(json.loads(path.read_text()))
        stats = run()
        if not live:
            atomic_write(path, json.dumps(stats.to_dict(), indent=1))
        return stats

    def replay(
        self,
        spec: EngineSpec,
        requests: list[tuple[list[int], list[int]]],
        num_steps: int,
        topk: int,
        num_draft_tokens: int,
    ) -> list[ReplayRow]:
        """`spec`'s prediction on another engine's tokens (Engine.replay), per (prompt, output)."""
        case = self.engine_case(spec)
        if self.pool.stored(spec) is not None:
            raise Unsupported(f"{spec.id}: a stored baseline cannot replay a server's tokens; use --reference=ref")
        self.pool.progress(f"{spec.id}: replaying {len(requests)} server outputs through the draft")
        with self.pool.clock.phase("session", case.path, spec.id, case.dtype):
            request = ReplayRequest(case, requests, num_steps, topk, num_draft_tokens)
            return self.pool.request(self._client(spec, case), request).replays

    # -- the noise floor (difftest.compare.noise) ----------------------------------------------------
    def calibration(self) -> CaseRun:
        """The float64 run of this case (calibration_case) over the same pool."""
        if self._calibration is None:
            # its captures and speculative runs take as long as the case's own: say what they are for
            self.pool.progress(
                f"{self.prepared.name}: float64 calibration (the noise floor), the case again in float64"
            )
            self._calibration = CaseRun(self.pool, calibration_case(self.prepared))
        return self._calibration

    def noise_floor(self) -> noise.NoiseFloor:
        """Per canonical tensor, how far the reference moves when it computes the case in float64
        instead of the case's dtype; measured once (the captures behind it are cached on disk)."""
        case = self.prepared
        if self._floor is None:
            spec = self.pool.calibration_spec()
            with self.pool.clock.phase("noise_floor", case.path, spec.id, case.dtype):
                self._floor = self._measure_floor(spec)
        return self._floor

    def declared_precision(self, spec: EngineSpec) -> str | None:
        """The matmul format the case declares `spec` serves it in (`precision:`, by spec id, name@label
        or name), or None."""
        declared = self.case.precision
        return declared.get(spec.id) or declared.get(spec.key) or declared.get(spec.name)

    def noise_floor_for(self, spec: EngineSpec) -> noise.NoiseFloor:
        """The floor `spec` is judged against: the case's, or for an engine the case declares a matmul
        precision for, the calibration engine's run with its matmuls in that format (its `matmul`
        setting, e.g. ref[matmul=tf32]) against the same float64 run: that format's own rounding."""
        precision = self.declared_precision(spec)
        if precision is None:
            return self.noise_floor()
        if precision not in self._precision_floors:
            calibration = self.pool.calibration_spec()
            with self.pool.clock.phase("noise_floor", self.prepared.path, calibration.id, self.prepared.dtype):
                self._precision_floors[precision] = self._measure_precision_floor(calibration, precision)
        floor = self._precision_floors[precision]
        return dataclasses.replace(floor, source=f"{floor.source}; declared precision {precision} for {spec.id}")

    def _measure_precision_floor(self, calibration: EngineSpec, precision: str) -> noise.NoiseFloor:
        case = self.prepared
        schema = engine_schema(calibration.name)
        if schema is None or MATMUL_SETTING not in schema.names():
            return noise.unmeasured(
                case.dtype, f"{calibration.name} cannot compute matmuls in {precision} (no `{MATMUL_SETTING}` setting)"
            )
        params = tuple(p for p in calibration.params if p[0] != MATMUL_SETTING) + ((MATMUL_SETTING, precision),)
        return self._measure_floor(dataclasses.replace(calibration, params=params), exact_spec=calibration)

    def _measure_floor(self, spec: EngineSpec, exact_spec: EngineSpec | None = None) -> noise.NoiseFloor:
        """`spec` in the case's dtype against `exact_spec` (default: itself) in float64, prompt by prompt."""
        case = self.prepared
        exact_spec = exact_spec or spec
        try:
            exact = self.calibration()
            pairs = [(self.capture(spec, i), exact.capture(exact_spec, i)) for i in range(len(case.prompts))]
            # the draft alone: its own rounding, on the float64 run's fc_in (difftest.compare.noise: draft floor)
            own = [
                (self.capture_golden(spec, i, source=exact_spec, source_run=exact), exact_cap)
                for i, (_, exact_cap) in enumerate(pairs)
            ]
        except DifftestError as e:
            against = "in" if exact_spec is spec else "against"
            return noise.unmeasured(
                case.dtype, f"{spec.id} cannot run this case {against} float64: {str(e).splitlines()[0]}"
            )
        return noise.measure_floor(
            pairs,
            case.dtype,
            noise.measured_source(spec.id, case.dtype, len(pairs), [n for _, e in pairs for n in e.meta.notes]),
            [p for p in own if p[0] is not None],
        )

    def accept_noise(
        self, outputs: list[list[int]] | None = None
    ) -> tuple[tuple[AcceptStats, AcceptStats] | None, str]:
        """The numerical part of the accept-length noise (difftest.compare.accept_judge): the reference's
        speculative run in the case's dtype and a float64 run, or None with the reason it cannot run.

        `outputs`: the tokens the engine judged generated, where they are the reference's own. Then the
        float64 reference is replayed on them (Engine.replay): the move is measured over the same tokens
        the engine's counts are. Otherwise (or where that replay cannot run) the float64 run speculates
        on its own, over its own trajectory, which in half precision parts from the case's at a near-tie;
        a draft fitted to one trajectory accepts less on the other, so that move is the trajectory's, not
        the numerics' on these tokens (bf16 Qwen3 and DeepSeek-V3 targets: 0.65-0.68 over their own
        trajectories, 0.000-0.090 on the same tokens; docs/verdict.md, stops 52 and 53)."""
        case = self.prepared
        if case.dtype == noise.CALIBRATION_DTYPE:
            return None, f"the case runs in {case.dtype}: no numerical move to measure"
        spec = self.pool.calibration_spec()
        not_same = ""
        if outputs:
            pair, why = self._accept_noise_on_tokens(spec, outputs)
            if pair is not None:
                return pair, why
            not_same = f" (not on the same tokens: {why})"
        try:
            pair = (self.speculate(spec), self.calibration().speculate(spec))
        except DifftestError as e:
            return (
                None,
                f"numerical move not measured: {spec.id} cannot speculate this case in float64 ({str(e).splitlines()[0]})",
            )
        return (
            pair,
            f"numerical move measured: {spec.id} in {case.dtype} vs float64, each over its own trajectory{not_same}",
        )

    def _accept_noise_on_tokens(
        self, spec: EngineSpec, outputs: list[list[int]]
    ) -> tuple[tuple[AcceptStats, AcceptStats] | None, str]:
        """(`spec` in the case's dtype, float64 `spec` replayed on that run's outputs), where they are `outputs`."""
        case = self.prepared
        try:
            own = self.speculate(spec)
            if own.outputs != outputs:
                return None, f"{spec.id}'s outputs in {case.dtype} are not the ones judged"
            if "tree" in own.source:  # a replay is a chain here, the run a tree
                return None, f"{spec.id} simulated a tree"
            requests = list(zip(self.prompt_ids(speculative=True), outputs))
            exact = self.calibration().replay_accept(spec, requests, own.num_draft_steps)
        except DifftestError as e:
            return None, f"{spec.id} cannot replay them in float64 ({str(e).splitlines()[0]})"
        return (own, exact), (
            f"numerical move measured: {spec.id} in {case.dtype} vs float64 on the same tokens "
            f"(float64 replayed on the {case.dtype} run's own outputs)"
        )

    def replay_accept(self, spec: EngineSpec, requests: list[tuple[list[int], list[int]]], steps: int) -> AcceptStats:
        """`spec`'s acceptance summed over its replay of `requests` as a chain of `steps` draft tokens,
        cached on disk as a speculative run is (the float64 calibration's replay: a deep target's is minutes)."""
        info = self.pool.info(spec)
        key = cache_key("replay", spec.id, info.version, self.inputs_key(spec), requests, steps)

        def run() -> AcceptStats:
            total = AcceptStats(0, 0, steps, [0] * steps, 0, "")
            for row in self.replay(spec, requests, steps, 1, steps + 1):
                total = total.merge(row.stats)
            total.source = f"{spec.id} in {self.prepared.dtype}, replayed on given outputs"
            return total

        return self._cached_stats(key, info.live, run)

    def comparisons(self, spec: EngineSpec) -> list[CaptureDiff]:
        """Per prompt: the engine's capture against the reference's."""
        if spec.id not in self._diffs:
            case = self.prepared
            ref = self.options.reference
            out = []
            for i in range(len(case.prompts)):
                a, b = self.capture(ref, i), self.capture(spec, i)
                # An engine's capture meta may list `partial: [patterns]`: reference tensors it cannot
                # expose (e.g. vLLM: target layers it does not capture); missing those is allowed.
                partial = list(b.meta.partial)
                floor = self.noise_floor_for(spec)
                with self.pool.clock.phase("compare", case.path, spec.id, case.dtype):
                    out.append(
                        compare_captures(
                            a, b, case.dtype, case.tolerances, [*case.allow_missing, *partial], floor=floor
                        )
                    )
            self._diffs[spec.id] = out
        return self._diffs[spec.id]

    def computed_comparisons(self) -> dict[str, list[CaptureDiff]]:
        """spec id -> per-prompt diffs, for the comparisons this run has already made."""
        return dict(self._diffs)

    # -- the engines as this case saw them ----------------------------------------------
    def case_engine_info(self, spec: EngineSpec) -> EngineInfo | None:
        """The engine that produced `spec`'s results for this case: a stored baseline answers with the
        info of the engine it was saved from (its name and release), a running engine with its own."""
        stored = self.pool.stored(spec)
        if stored is not None and hasattr(stored, "entry"):
            try:
                _, entry, _ = stored.entry(self.prepared)
            except ConfigError:
                return None
            return entry.info
        return self.pool.engine_info(spec)

    def _stored_engine(self, spec: EngineSpec) -> EngineSpec | None:
        """The engine a stored baseline standing in as `spec` was saved from, for this case (None:
        `spec` runs here, or the baseline has no usable entry for the case)."""
        stored = self.pool.stored(spec)
        if stored is None or not hasattr(stored, "entry"):
            return None
        try:
            engine_id, _, _ = stored.entry(self.prepared)
            return parse_spec(engine_id)
        except ConfigError:
            return None

    def reference_names(self) -> tuple[str, ...]:
        """What the run's reference answers to in a case's `expect_failure: reference`: its name and
        spec id, and for a stored baseline also those of the engine it was saved from, so a failure
        declared against `sglang@0.5.16` holds whether that release runs now or was stored on it."""
        ref = self.options.reference
        saved = self._stored_engine(ref)
        return (ref.name, ref.id) + ((saved.name, saved.id) if saved is not None else ())

    def reference_label(self) -> str:
        """The reference as check messages name it: its spec id, or for a stored baseline the engine
        it was saved from and the baseline (`sglang@0.5.16 (baseline sgl0516)`)."""
        ref = self.options.reference
        saved = self._stored_engine(ref)
        stored = self.pool.stored(ref)
        return ref.id if saved is None or stored is None else f"{saved.id} (baseline {stored.name})"

    # -- the record the report is built from (difftest.report.writer.build) --------------
    def record(self, results: list[CheckResult]) -> CaseRecord:
        """Everything the case's report shows, gathered once its checks ran: each engine's info or
        start error, the comparisons made, the noise floor behind them, the wiring inference."""
        pool, case = self.pool, self.case
        with pool.clock.phase("report", self.path):
            engines = {}
            for spec in self.options.engines:
                info, err = pool.engine_info(spec), pool.start_error(spec)
                engines[spec.id] = EngineEntry(info=info) if info else EngineEntry(error=err or "not started")
            computed = self.computed_comparisons()
            record = CaseRecord(
                case=case.name,
                case_file=case.path,
                case_yaml=_read_text(case.path),
                reference=self.options.reference.id,
                engine_ids=[s.id for s in self.options.engines],
                engines=engines,
                checks=list(results),
                comparisons={
                    engine_id: [prompt_comparison(i, cd) for i, cd in enumerate(diffs)]
                    for engine_id, diffs in computed.items()
                },
                noise_floor=self._floor_record() if computed else None,
                wiring_inference=self.inference(),
                memory_plan=pool.plan_record(case),
            )
        record.timings = self.timings()
        return record

    def _floor_record(self) -> NoiseFloorRecord:
        """The case's noise floor as its report shows it (measured already once any engine was
        compared); should computing it fail, the report says why instead of failing."""
        try:
            record = self.noise_floor().record()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            return NoiseFloorRecord(
                self.case.dtype, False, f"could not be computed ({error.splitlines()[0]})", error=error
            )
        record.declared = self._declared_floors()
        return record

    def _declared_floors(self) -> list[DeclaredFloor] | None:
        """The floor each engine with a declared matmul precision was judged against (noise_floor_for),
        as measured for its checks; never measured here (a floor no check asked for says so)."""
        out = []
        for spec in self.options.engines:
            precision = self.declared_precision(spec)
            if precision is None:
                continue
            floor = self._precision_floors.get(precision)
            if floor is None:
                out.append(DeclaredFloor(spec.id, precision, False, "not measured: no tensor check of it ran"))
            else:
                out.append(DeclaredFloor(spec.id, precision, floor.measured, floor.source))
        return out or None


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        return f"(case file unreadable: {e.strerror})"


def prompt_comparison(i: int, cd: CaptureDiff) -> PromptComparison:
    """One prompt's comparison as the report shows it. `first_divergence` is the tensor where the
    error is introduced (difftest.compare.noise; the first tensor above noise when none is marked
    introduced): the tensor the failing checks lead with and the summary table shows."""
    introduced, above = cd.first_introduced(), cd.first_divergence()
    return PromptComparison(
        prompt=i,
        first_divergence=_name(introduced or above),
        first_introduced=_name(introduced),
        first_above_noise=_name(above),
        first_differs=_name(cd.first_differs()),
        tie=cd.tie,
        tensors=list(cd.diffs),
        routing=list(cd.routing),
    )


def _name(d: TensorDiff | None) -> str | None:
    return d.name if d is not None else None


def engine_case_of(case: Case, spec: EngineSpec) -> Case:
    """What the worker of `spec` is sent: a labelled spec's case section `engines["NAME@LABEL"]`
    overrides `engines[NAME]` key by key, so two labels of one engine can run with different
    settings (e.g. `sglang@new: {draft_config_overrides: ...}` simulating a changed release)."""
    if not spec.label or spec.key not in case.engines:
        return case
    merged = {**case.engines.get(spec.name, {}), **case.engines[spec.key]}
    return dataclasses.replace(case, engines={**case.engines, spec.name: merged})


def inputs_key_of(case: Case, spec: EngineSpec, stored: bool) -> list:
    """What a cached result of `spec` on `case` depends on besides the engine's version: the
    case's fingerprint as the engine reads it (the target and draft by content, its own settings
    section, a draft its settings run instead of the case's: Case.fingerprint) and, by content
    too, any file or directory its settings or spec parameters name (its own draft, training data).
    Cases that differ only in what an engine never reads share its results (the exports of one
    draft, each run as trained on the reference)."""
    section, params = dict(case.engines.get(spec.name) or {}), dict(spec.params)
    # a stored baseline names no adapter: its stored results carry their own key
    schema, replaced = (None if stored else engine_schema(spec.name)), dict[str, Any]()
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


__all__ = [
    "CaseRun",
    "calibration_case",
    "engine_case_of",
    "inputs_key_of",
    "prompt_comparison",
    "resolve_fixture",
    "FIXTURE_GROUP",
]
