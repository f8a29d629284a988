"""The engines one harness run holds: their worker clients (started once, reused by every case,
closed or killed at the end), the stored baselines standing in for engines, what each worker said
about itself (EngineInfo, remembered per environment by difftest.run.engine_identity), the capture
cache on disk and the phase clock. Every case's run (difftest.run.case_run.CaseRun) shares one pool.

The memory plan (difftest.run.memory_plan): before a worker starts for a case, each engine's
resident need is estimated; when all fit what is available, every worker stays alive for the run
(one start each). When they do not, a worker is closed before the next one starts (the least
recently used first: its results are memoised by the case runs and stored in the capture cache, so
the verdicts are the same), and an engine that cannot fit even alone is refused before it starts.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from difftest.base.dtypes import CALIBRATION
from difftest.base.errors import ConfigError, DifftestError, EngineError
from difftest.base.paths import cache_root, import_root, log_file_name
from difftest.base.registry import calibration_engine, engine_declared, engine_schema, engine_target
from difftest.records.capture import Capture, CaptureCache, remove_partial
from difftest.records.engine_info import EngineInfo
from difftest.records.memory_plan import EngineNeed, MemoryPlanRecord
from difftest.rules import engine_releases
from difftest.run import engine_identity
from difftest.run import memory_plan as mp
from difftest.run.engine import EngineSpec, check_settings
from difftest.run.phase_clock import PhaseClock, case_of
from difftest.run.protocol import Request, Timed
from difftest.run.worker import WorkerClient

if TYPE_CHECKING:  # annotations only: the case sits below the run floor and is passed in
    from difftest.case.case import Case

T = TypeVar("T", bound=Timed)  # the reply a request is answered with (difftest.run.protocol)


class BaselineSource(Protocol):
    """A stored run standing in for an engine (difftest.run.baseline.BaselineSource, which builds on
    the case runs: declared here by what the pool and a case run ask of it, so the pool needs no
    import of the module above it)."""

    name: str
    spec: EngineSpec

    @property
    def info(self) -> EngineInfo: ...

    def capture(self, case: Any, index: int) -> Capture: ...

    def speculate(self, case: Any) -> Any: ...

    def entry(self, case: Any) -> tuple[str, Any, Any]: ...


@dataclass
class Options:
    engines: list[EngineSpec]
    reference: EngineSpec
    engine_python: dict[str, str] = field(default_factory=dict)  # spec key or name -> interpreter
    timeout: float = 900.0
    use_cache: bool = True
    log_dir: Path = Path("reports") / "logs"
    progress: Callable[[str], None] | None = None  # one line per slow step (engine start, capture, speculate)
    # what the workers may hold (difftest.run.memory_plan.Budget); None: DIFFTEST_MEMORY_BUDGET, else measured
    memory_budget: mp.Budget | None = None


class EnginePool:
    """The run's engines and what they share across cases; nothing here is global."""

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
        # spec id -> a stored run standing in for an engine (difftest.run.baseline.BaselineSource)
        self._stored: dict[str, BaselineSource] = {}
        self.clock = PhaseClock()  # where each case's time goes (difftest.run.phase_clock; in its report)
        # the memory plan (difftest.run.memory_plan): the budget, measured before any worker starts
        self._budget: mp.Budget | None = options.memory_budget
        self._plans: dict[str, mp.Plan] = {}  # case path -> its plan (its calibration run's too), said once
        self._held: dict[str, dict[mp.Load, int]] = {}  # spec id -> the models its live worker holds
        self._needs: dict[str, mp.Need] = {}  # spec id -> its live worker's estimated need
        self._used: dict[str, int] = {}  # spec id -> when it was last asked for (closing order)
        self._uses = 0
        self._closed: dict[str, EngineInfo] = {}  # what a worker closed for memory said of itself
        self._refused: dict[str, EngineError] = {}  # this case's engines that cannot fit even alone
        self._case_now: Case | None = None  # the case the last worker request was for

    # -- stored baselines --------------------------------------------------------------
    def add_stored(self, source: BaselineSource) -> None:
        """Serve `source.spec` from disk (captures, accept stats, info) instead of a worker."""
        self._stored[source.spec.id] = source

    def stored(self, spec: EngineSpec) -> BaselineSource | None:
        """The stored run standing in for `spec` (None: `spec` runs here)."""
        return self._stored.get(spec.id)

    # -- workers -----------------------------------------------------------------------
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

    def client(self, spec: EngineSpec, case: Case | None = None) -> WorkerClient:
        """`spec`'s worker, started on first use; for `case` (the case as the worker is sent it), room
        is made first under the memory plan (_make_room)."""
        if spec.id in self._start_errors:
            raise self._start_errors[spec.id]
        if spec.id in self._refused:
            raise self._refused[spec.id]
        if case is not None:
            self._case_now = case
            self._make_room(spec, case)
        elif spec.id not in self._clients and self._case_now is not None:
            # a start asked for without a case (info, version: a cache key): room as the last case
            # needed it, refused only when that case is the current one
            self._make_room(spec, self._case_now, refuse=self._case_now.path == self._current_case)
        self._uses += 1
        self._used[spec.id] = self._uses
        if spec.id not in self._clients:
            client = self._new_client(spec)
            self.progress(f"starting {spec.id} ({self.python_for(spec)})")
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
            self.progress(f"{spec.id} ready in {time.monotonic() - t:.1f}s")
            self._clients[spec.id] = client
            self._closed.pop(spec.id, None)
        return self._clients[spec.id]

    # -- the memory plan (difftest.run.memory_plan) ----------------------------------------
    def memory_budget(self) -> mp.Budget:
        """What the workers may hold: the options', DIFFTEST_MEMORY_BUDGET's (ConfigError in one line
        when malformed), else what the machine had available before this run's first worker started."""
        if self._budget is None:
            declared = mp.declared_budget()
            self._budget = declared if declared is not None else mp.measured_budget()
        return self._budget

    def _factors(self, spec: EngineSpec) -> mp.MemoryFactors:
        return mp.MemoryFactors.declared(spec.name, engine_declared(spec.name, "MEMORY"))

    def _kv_gib(self, spec: EngineSpec, factors: mp.MemoryFactors, case: Case) -> float | None:
        """The engine's KV size setting for `case` (MemoryFactors.kv_setting), None where it has none."""
        schema = engine_schema(spec.name) if factors.kv_setting else None
        if schema is None:
            return None
        try:
            value = check_settings(schema, spec, case).get(factors.kv_setting)
        except ConfigError:  # that engine's own items say so; another engine's start is not failed by it
            return None
        return float(value) if isinstance(value, (int, float)) else None

    def _need(self, spec: EngineSpec, case: Case, loads: dict[mp.Load, int]) -> mp.Need:
        factors = self._factors(spec)
        gpu = self.memory_budget().gpu is not None
        return mp.need_of(factors, mp.worker_bytes(factors, list(loads)), self._kv_gib(spec, factors, case), gpu)

    def _loads(self, spec: EngineSpec, case: Case, calibrates: bool) -> dict[mp.Load, int]:
        """What `spec` holds at most for `case`: every set it loads when it keeps them all, else the largest."""
        loads = mp.loads_for(case.target, case.draft or "", case.dtype, calibrates, case.weights_dtype)
        if not self._factors(spec).keeps_every_case:
            loads = [max(loads, key=lambda ld: mp.load_bytes(self._factors(spec), ld))]
        return {ld: mp.load_bytes(self._factors(spec), ld) for ld in loads}

    def plan(self, case: Case) -> mp.Plan:
        """The case's plan over the engines this run starts (stored baselines hold no memory); its
        line is said once per case."""
        key = case.path
        if key not in self._plans:
            calibrating = self.calibration_spec()
            specs = [s for s in self.options.engines if s.id not in self._stored]
            if case.dtype == CALIBRATION.value:
                specs = []  # the float64 calibration case: only the calibrating engine runs it
            if calibrating.id not in [s.id for s in specs]:
                specs.append(calibrating)
            needs = {s.id: self._need(s, case, self._loads(s, case, s.id == calibrating.id)) for s in specs}
            self._plans[key] = mp.Plan(needs, self.memory_budget())
            self.progress(self._plans[key].line())
        return self._plans[key]

    def plan_record(self, case: Case) -> MemoryPlanRecord | None:
        """The plan `case` followed, as its report keeps it; None where none was made (no worker was
        asked to start for it). Never makes one: a plan is made when a worker is asked for."""
        plan = self._plans.get(case.path)
        if plan is None:
            return None
        return MemoryPlanRecord(
            all_at_once=plan.all_at_once,
            needs=[EngineNeed(engine, need.host, need.gpu) for engine, need in plan.needs.items()],
            budget_host_bytes=plan.budget.host,
            budget_gpu_bytes=plan.budget.gpu,
            budget_source=plan.budget.source,
        )

    def one_at_a_time(self, case: Case) -> bool:
        """Whether `case`'s engines run one (or as many as fit) at a time: not all fit at once."""
        return not self.plan(case).all_at_once

    def _make_room(self, spec: EngineSpec, case: Case, refuse: bool = True) -> None:
        """Before `spec` serves `case`: where its worker, with the models this case adds, does not fit
        beside the live ones, the least recently used others are closed first; one that cannot fit
        even alone is refused before it starts, in one line (an engine error: exit 7)."""
        budget = self.memory_budget()
        plan = self.plan(case)
        if budget.host is None and budget.gpu is None:
            return  # nothing known of the machine: every worker stays, as without a plan
        live = spec.id in self._clients
        factors = self._factors(spec)
        asked = mp.loads_for(case.target, case.draft or "", case.dtype, False, case.weights_dtype)
        new = {ld: mp.load_bytes(factors, ld) for ld in asked}
        held = self._held.get(spec.id, {}) if live else {}
        if live and all(ld in held for ld in new):
            return  # it holds this case's models already
        wanted = {**held, **new} if factors.keeps_every_case else new
        need = self._need(spec, case, wanted)
        if live and not need.fits(budget) and (self._need(spec, case, new).fits(budget) or not refuse):
            # a fresh worker holds this case's models only (a live worker stays where not even that fits:
            # the request is refused below and the worker still serves what it holds, e.g. the case's own
            # dtype when its float64 calibration is refused)
            self._close_for_memory(spec.id, f"it holds earlier cases' models; a fresh one starts for {case.name}")
            live, wanted = False, new
            need = self._need(spec, case, wanted)
        if not need.fits(budget) and not refuse:  # another case's estimate: the case's own request judges
            for other in [s for s in self._clients if s != spec.id]:
                self._close_for_memory(other, f"{spec.id} starts")
            self._held[spec.id], self._needs[spec.id] = wanted, need
            return
        if not need.fits(budget):
            needed, available = budget.shortfall(need)
            error = EngineError(
                f"{spec.id}: not started: the memory plan estimates it needs {needed} for {case.name} "
                f"({mp.held_words(factors, asked[0])}), "
                f"and {available}; run it on a larger machine, or set {mp.BUDGET_ENV} if more is free than measured"
            )
            if case.path == self._current_case:
                # only the case's own request refuses the engine for the case's items: a refused float64
                # calibration (under the case's path + '#') leaves the engine to serve the case's own dtype,
                # whether its worker is live now or was closed for another engine (one at a time)
                self._refused[spec.id] = error
            raise error
        while True:
            others = [s for s in self._clients if s != spec.id]
            total = need
            for other in others:
                total = total + self._needs.get(other, mp.ZERO)
            if not others or total.fits(budget):
                break
            victim = min(others, key=lambda s: self._used.get(s, 0))
            self._close_for_memory(victim, f"{spec.id} starts for {case.name} ({plan.line().partition(': ')[2]})")
        self._held[spec.id] = wanted
        self._needs[spec.id] = need

    def _close_for_memory(self, spec_id: str, why: str) -> None:
        """Close a live worker to free its memory; what it said of itself stays for reports and keys."""
        client = self._clients.pop(spec_id)
        self.progress(f"{spec_id}: its worker closes to free memory: {why}")
        if client.info is not None:
            self._closed[spec_id] = client.info
        client.close()
        self._held.pop(spec_id, None)
        self._needs.pop(spec_id, None)

    def started(self, spec: EngineSpec) -> bool:
        """Whether `spec`'s worker runs now."""
        return spec.id in self._clients

    def begin_case(self, path: str) -> None:
        """A worker that died during an earlier case (e.g. an SGLang scheduler crash that case provoked)
        is replaced for this one, so one crashing case does not fail every later case's items. Within
        a case a dead worker stays dead: each restart would crash the same way, minutes each."""
        if path == self._current_case:
            return
        self._current_case = path
        self.clock.current_case = case_of(path)
        self._refused.clear()  # a case too large for the machine does not refuse the next one
        for spec_id, client in list(self._clients.items()):
            if client.proc is not None and client.proc.poll() is not None:
                how = "ended after an engine that cannot restart in it failed" if client.ended_with else "died"
                self.progress(f"{spec_id}: its worker {how} during an earlier case; a fresh one starts for {path}")
                client.kill()
                del self._clients[spec_id]
                self._held.pop(spec_id, None)
                self._needs.pop(spec_id, None)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._held.clear()
        self._needs.clear()

    def abort(self) -> None:
        """Kill every worker now (an interrupted run: none is waited for)."""
        for client in self._clients.values():
            client.kill()
        self._clients.clear()
        self._held.clear()
        self._needs.clear()

    def progress(self, message: str) -> None:
        if self.options.progress is not None:
            self.options.progress(message)

    # -- what each engine says about itself ----------------------------------------------
    def info(self, spec: EngineSpec) -> EngineInfo:
        """What `spec` says about itself: a stored run's info, its started worker's, or, while every
        result asked for is cached, what its worker said when it last started in this same
        environment (difftest.run.engine_identity), so a fully cached run starts no engine."""
        if spec.id in self._stored:
            return self._stored[spec.id].info
        if spec.id not in self._clients and spec.id in self._closed:
            return self._closed[spec.id]  # closed by the memory plan: what its worker said
        if spec.id not in self._clients and spec.id not in self._start_errors:
            remembered = self._remembered_info(spec)
            if remembered is not None:
                return remembered
        return self.client(spec).started_info

    def version(self, spec: EngineSpec) -> str:
        """The engine's version, as its cache keys name it (a stored run: the version it was saved as)."""
        return self.info(spec).version

    def engine_info(self, spec: EngineSpec) -> EngineInfo | None:
        """What is known of `spec` without starting it (None: it neither started nor ran before here)."""
        if spec.id in self._stored:
            return self._stored[spec.id].info
        c = self._clients.get(spec.id)
        return c.info if c else self._closed.get(spec.id) or self._remembered.get(spec.id)

    def start_error(self, spec: EngineSpec) -> str | None:
        e = self._start_errors.get(spec.id) or self._refused.get(spec.id)
        return str(e) if e else None

    def is_live(self, spec: EngineSpec) -> bool:
        """A running server (EngineInfo.live): no tensors to compare, acceptance only."""
        return spec.id not in self._stored and self.info(spec).live

    def calibration_spec(self) -> EngineSpec:
        """The engine that measures the noise floor: the reference when it is the calibration engine
        (difftest.base.registry.calibration_engine, with its wiring and flags), else a plain one beside it."""
        ref, name = self.options.reference, calibration_engine()
        return ref if ref.name == name and ref.id not in self._stored else EngineSpec(name)

    def identity(self, spec: EngineSpec) -> str | None:
        """The digest of everything `spec`'s worker info follows from (difftest.run.engine_identity)."""
        if spec.id not in self._identities:
            client = self._new_client(spec)
            self._identities[spec.id] = engine_identity.identity(
                spec.to_dict(), client.target, client.python, client.environment(), import_root()
            )
        return self._identities[spec.id]

    def _remembered_info(self, spec: EngineSpec) -> EngineInfo | None:
        if not self.options.use_cache:
            return None  # nothing is read from the cache: every result needs the worker anyway
        if spec.id not in self._remembered:
            ident = self.identity(spec)
            info = self.infos.get(ident) if ident else None
            if info is None:
                return None
            try:
                self._check_release(spec, info)
            except DifftestError as e:
                self._start_errors[spec.id] = e
                raise
            self.progress(
                f"{spec.id}: {info.version} (as its worker said in this environment; it starts "
                "when a result is not cached)"
            )
            self._remembered[spec.id] = info
        return self._remembered[spec.id]

    def _remember(self, spec: EngineSpec, info: EngineInfo) -> None:
        """Keep what a started worker said for later runs; a remembered info this run already used for
        cache keys that the worker now contradicts means those keys named another engine."""
        ident = self.identity(spec)
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
        self.progress(f"{spec.id}: {engine_releases.unrecorded(info.name, info.version)}")

    # -- transfers: requests to a worker and the captures it writes -----------------------
    def request(self, client: WorkerClient, msg: Request[T], out: Path | None = None) -> T:
        """A worker request (difftest.run.protocol), timed (the worker's own phases come back in its
        reply); what a worker that died writing `out` left half-written is removed."""
        try:
            with self.clock.phase("request"):
                reply = client.request(msg)
                self.clock.add_inner(reply.timings)
        finally:
            if out is not None:
                remove_partial(out)
        return reply

    def cached(self, key: str) -> Capture | None:
        if not self.options.use_cache:
            return None
        with self.clock.phase("transfer.read") as frame:
            found = self.cache.get(key)
            frame.bytes = found.nbytes if found is not None else 0
        return found

    def load(self, out: Path) -> Capture:
        with self.clock.phase("transfer.read") as frame:
            capture = Capture.load(out)
            frame.bytes = capture.nbytes
        return capture


__all__ = ["EnginePool", "Options"]
