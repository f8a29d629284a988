"""SGLang adapter: the real `sglang.Engine` running EAGLE-3, captured through forward hooks.

Runs inside a difftest worker process in SGLang's own environment (`scripts/setup-engine
sglang`). One `sglang.Engine` per (target, draft, settings), kept for every prompt of a
case. Tensors come from SGLang's `forward_hooks` server argument (difftest_engines/sglang/hooks.py):
the hooks run in SGLang's scheduler process and write files that difftest_engines/sglang/records.py
aligns to prompt positions and names canonically. Acceptance comes from SGLang's own
per-request counters (`meta_info`).

Settings: the case's `engines.sglang` mapping, overridden by the engine spec's parameters:
  draft_config_overrides / target_config_overrides   deep-merged into config.json (overlay)
  speculative_num_steps (spec: num_steps)            default: the case's speculative.num_steps
  speculative_eagle_topk (spec: topk)                default 1
  speculative_num_draft_tokens (spec: num_draft_tokens)  default num_steps + 1
  tp_size, attention_backend, mem_fraction_static, max_total_tokens
  server_args: {...}                                 any other sglang.Engine argument
Capture meta reports what was requested and what SGLang resolved (`settings`).

tp_size > 1 runs one scheduler process per rank: each rank's hooks write their own records, joined
into whole tensors by difftest_engines/sglang/tensor_parallel.py (its RULES cite SGLang's sharding per
tensor); a rank that dies is named by difftest_engines/sglang/rank_crash.py.

On a machine without SGLang's compiled kernels the CPU shim (difftest_engines/sglang/cpu_shim) stands
in for them; meta `kernels` says "cpu-shim" or "sgl-kernel".
"""

from __future__ import annotations

import importlib.util
import json
import math
import multiprocessing.util
import os
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from difftest.api import AcceptStats
from difftest.api import Capture, cache_key
from difftest.api import Case
from difftest.api import Engine, EngineInfo
from difftest.api import EngineError, EngineSpent, EngineUnavailable
from difftest.api import overlay_checkpoint, stored_tensors
from difftest.api import cache_root
from difftest.api import CaptureMeta, Wiring
from difftest.api import FC_IN
from difftest_engines.sglang import cpu_ranks, cpu_shim, deepseek, process_start, rank_crash, tensor_parallel, versions
from difftest_engines.sglang.hooks import hook_specs
from difftest_engines.sglang.records import extract, load_forwards
from difftest_engines.sglang.settings import SCHEMA

ADAPTER_REVISION = 4  # part of the capture cache key: bump when what a capture contains changes
# 4: an MoE target's expert ids per MoE layer (aux.router.{k}.experts; hooks.py router_hook)
SETUP_HINT = "scripts/setup-engine sglang"
# Partial by construction: SGLang captures only the aux layers the draft asks for, and the
# draft steps exist only while drafting is a chain.
PARTIAL = ["target.h.*"]


def _config(checkpoint: str, what: str) -> dict:
    from difftest.api import read_json

    return read_json(Path(checkpoint) / "config.json", what)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _log_size() -> int:
    """The worker's stderr is its log file (difftest.run.worker); where it ends now."""
    try:
        return os.fstat(2).st_size
    except OSError:
        return 0


def _log_since(offset: int, limit: int = 4 << 20) -> str:
    try:
        with open("/proc/self/fd/2", "rb") as f:
            f.seek(offset)
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def _root_cause(offset: int) -> str:
    """The first exception line SGLang's processes wrote to the log since `offset`: the
    scheduler's own error, which the Engine's exception ("scheduler died") does not carry."""
    for line in _log_since(offset).splitlines():
        m = re.match(r"^([A-Za-z_.]*(?:Error|Exception)): (.+)$", line.strip())
        if m:
            return f"{m.group(1)}: {m.group(2)}"[:400]
    return ""


def _bind_ranks_to_cores(tp_size: int) -> None:
    """Each rank's cores on CPU (difftest_engines/sglang/cpu_ranks.py); a value the user set is kept. The
    schedulers fork from the forkserver (process_start), which holds the environment it started
    with: one started without the binding is stopped, and the next start brings up a fresh one."""
    if cpu_ranks.bind(tp_size):
        process_start.restart_forkserver()


# SGLang's static memory share (mem_fraction_static), computed where no setting gives one. SGLang
# measures the memory it sees before loading (srt/distributed/bootstrap.py::
# measure_pre_model_load_memory, through srt/utils/common.py::get_available_gpu_memory: on CPU
# get_free_cpu_memory(), psutil's available within the cgroup's limit, divided by the NUMA nodes of
# get_cpu_ids_by_node), loads the target and the draft, and refuses to start where what the loading
# took is more than that share of it (srt/mem_cache/kv_cache_configurator.py::
# _profile_available_bytes: rest = available after - pre * (1 - share) must be > 0, then holds the
# KV pool). A fixed 0.3 left a 1.0B model in bf16 (2.5 GB with its draft) no room on a 24 GB machine
# where the other engines' workers held the rest ("Raise --mem-fraction-static above 0.385").
SHARE_FLOOR = {"cpu": 0.3, "cuda": 0.5}  # the fixed shares used before: a larger share allocates nothing more
SHARE_CEILING = 0.95  # above it SGLang's activations have no room: refused instead
LOAD_MARGIN = 0.5 * (1 << 30)  # the loaders' temporaries and the scheduler's own buffers, plus 10% of the weights
_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def weight_bytes(checkpoint: str, dtype: str) -> int:
    """A checkpoint's tensors once loaded at `dtype` (floating-point ones; others at their stored width),
    from its safetensors headers."""
    per = _DTYPE_BYTES.get(str(dtype), 4)
    stored, _ = stored_tensors(Path(checkpoint))
    total = 0
    for t in stored.values():
        n = 1
        for d in t.shape:
            n *= d
        total += n * (per if t.dtype.startswith(("F", "BF")) else 8 if t.dtype.endswith("64") else 4)
    return total


def kv_bytes_per_token(cfg: dict, dtype: str) -> int:
    """One token's KV cache over a model's layers: keys and values per KV head, or MLA's latent and rope key;
    0 for a config this estimate cannot read (a speculators-format draft keeps its sizes under
    transformer_layer_config; another layout is SGLang's to refuse, in its own words, when it loads it)."""
    if not any(k in cfg for k in ("hidden_size", "head_dim", "kv_lora_rank")):
        cfg = cfg.get("transformer_layer_config") or {}
        if not any(k in cfg for k in ("hidden_size", "head_dim", "kv_lora_rank")):
            return 0
    layers = int(cfg.get("num_hidden_layers") or 1)
    if cfg.get("kv_lora_rank"):
        per_layer = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
    else:
        heads = int(cfg.get("num_attention_heads") or 1)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        per_layer = 2 * kv_heads * head_dim
    return layers * per_layer * _DTYPE_BYTES.get(str(dtype), 4)


def static_share(weights: int, kv: int, visible: float, device: str = "cpu") -> float:
    """The mem_fraction_static that leaves SGLang the KV cache `kv` after loading `weights` (bytes), out
    of the `visible` bytes it measures before loading; never below the share used before on `device`.
    ValueError where even SHARE_CEILING would not do."""
    need = weights * 1.1 + kv + LOAD_MARGIN
    share = math.ceil(need / max(visible, 1.0) * 1000) / 1000
    if share > SHARE_CEILING:
        raise ValueError(
            f"the weights ({weights / 1e9:.1f} GB) and the KV cache ({kv / 1e9:.2f} GB) need {need / 1e9:.1f} GB "
            f"of the {visible / 1e9:.1f} GB SGLang sees free (a share of {share:.3f}, above {SHARE_CEILING})"
        )
    return max(SHARE_FLOOR.get(device, 0.5), share)


def _visible_memory(device: str) -> float:
    """The bytes SGLang counts as free before it loads (see SHARE_FLOOR's comment), by its own function."""
    try:
        from sglang.srt.utils.common import get_available_gpu_memory

        return float(get_available_gpu_memory(device, 0, empty_cache=False)) * (1 << 30)
    except (ImportError, TypeError, AttributeError):  # another release's layout: the machine's available memory
        import psutil

        return float(psutil.virtual_memory().available)


@dataclass
class LaunchPlan:
    """What one sglang.Engine starts with (its key, with the checkpoints): the arguments asked of it,
    where it runs, the config overlays, and the measures the target needed (the capture's meta names them)."""

    requested: dict  # sglang.Engine arguments: the adapter's, then the case's server_args
    device: str  # "cpu" or "cuda"
    draft_overrides: dict  # deep-merged into the draft's config.json
    target_overrides: dict  # deep-merged into the target's config.json
    compat: list[str] = field(default_factory=list)  # filled by SglangEngine._checkpoints


class SglangEngine(Engine):
    SETTINGS = SCHEMA
    # what its worker holds (difftest.run.memory_plan.MemoryFactors): the adapter's process, the
    # forkserver, the scheduler and the detokenizer, each an interpreter with torch; one sglang.Engine
    # at a time; a KV cache of max_total_tokens (4096 by default: well under 0.5 GB for an 8B model)
    MEMORY = {"overhead_gb": 2.5, "kv_gb": 0.5, "on_gpu": True}

    def __init__(self, spec):
        super().__init__(spec)
        self._kernels: str | None = None
        self._engine = None
        self._engine_key: str | None = None
        self._effective: dict = {}
        self._share: float | None = None  # the running engine's mem_fraction_static
        self._workdir: Path | None = None
        self._tp_logged = False
        self._crash_watch: rank_crash.Watch | None = None  # tp_size > 1: names a rank that died

    # -- environment -----------------------------------------------------------------
    def _import(self):
        if importlib.util.find_spec("sglang") is None:
            raise EngineUnavailable(f"sglang is not installed in {sys.executable}; set it up with: {SETUP_HINT}")
        if self._kernels is None:
            self._kernels = cpu_shim.choose_kernels()
            if self._kernels == cpu_shim.CPU_SHIM:
                cpu_shim.activate()
            self._private_dirs()
        import sglang

        return sglang

    def _private_dirs(self) -> None:
        """Caches, temp files and sockets under the difftest cache; never the network."""
        base = cache_root() / "sglang"
        for var, sub in (
            ("HF_HOME", "hf"),
            ("XDG_CACHE_HOME", "xdg"),
            ("TRITON_CACHE_DIR", "triton"),
            ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
            ("OUTLINES_CACHE_DIR", "outlines"),
        ):
            os.environ.setdefault(var, str(base / sub))
        os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", SGLANG_DISABLE_REQUEST_LOGGING="1")
        (base / "tmp").mkdir(parents=True, exist_ok=True)
        self._workdir = Path(tempfile.mkdtemp(prefix=f"w{os.getpid()}-", dir=base / "tmp"))
        os.environ["TMPDIR"] = str(self._workdir)  # zmq ipc sockets, spawned processes' temp files
        tempfile.tempdir = None

    def info(self) -> EngineInfo:
        sglang = self._import()
        import transformers

        versions = {"sglang": sglang.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
        for mod in ("triton", "sgl_kernel"):
            try:
                versions[mod] = getattr(__import__(mod), "__version__", "?")
            except ImportError:
                pass
        return EngineInfo(
            name="sglang",
            version=f"{sglang.__version__}+{self._kernels}.a{ADAPTER_REVISION}",
            versions=versions,
            kernels=self._kernels,
        )

    # -- settings --------------------------------------------------------------------
    def _static_share(self, settings: LaunchPlan, target: str, draft: str, dtype: str) -> float:
        """mem_fraction_static for this start (static_share): on CPU computed from the weights, the KV
        cache of max_total_tokens and the memory SGLang will see; on a GPU the share used before."""
        if settings.device != "cpu":
            return SHARE_FLOOR["cuda"]
        weights = weight_bytes(target, dtype) + weight_bytes(draft, dtype)
        per_token = kv_bytes_per_token(_config(target, "target config"), dtype)
        per_token += kv_bytes_per_token(_config(draft, "draft config"), dtype)
        kv = per_token * int(settings.requested.get("max_total_tokens") or 4096)
        try:
            share = static_share(weights, kv, _visible_memory(settings.device), settings.device)
        except ValueError as e:
            raise EngineError(
                f"sglang: not started: {e}; set engines.sglang.mem_fraction_static to try anyway"
            ) from None
        print(
            f"[sglang adapter] mem_fraction_static {share} (weights {weights / 1e9:.2f} GB, KV {kv / 1e9:.2f} GB)",
            file=sys.stderr,
            flush=True,
        )
        return share

    def _settings(self, case: Case, num_steps: int | None = None) -> LaunchPlan:
        s = self.settings_for(case)  # difftest_engines/sglang/settings.py
        steps = s.speculative_num_steps or num_steps or case.num_steps
        topk = s.speculative_eagle_topk
        on_cpu = not torch.cuda.is_available()
        requested = {
            "speculative_num_steps": steps,
            "speculative_eagle_topk": topk,
            "speculative_num_draft_tokens": s.speculative_num_draft_tokens or steps + 1,
            "dtype": case.dtype,
            "tp_size": s.tp_size,
            # None: computed when the engine starts (_static_share), from the weights and the memory SGLang sees
            "mem_fraction_static": s.mem_fraction_static,
            "max_total_tokens": s.max_total_tokens,
        }
        if on_cpu:
            # SGLang's scheduler polls its sockets in a busy loop between requests; on a CPU machine
            # that loop takes a core from every other process (the reference worker beside it ran
            # its accept-length simulation 60x slower: 63 s instead of 1 s on 2 cores). SGLang's own
            # sleep_on_idle (srt/managers/scheduler.py::init_idle_sleeper) blocks on the sockets
            # instead; it changes no computation. A case's server_args may still set it.
            requested["sleep_on_idle"] = True
        backend = s.attention_backend or ("intel_amx" if self._kernels == cpu_shim.CPU_SHIM else None)
        if backend is not None:
            requested["attention_backend"] = backend
        requested.update(s.server_args)
        return LaunchPlan(
            requested=requested,
            device="cpu" if on_cpu else "cuda",
            draft_overrides=s.draft_config_overrides,
            target_overrides=s.target_config_overrides,
        )

    def _checkpoints(self, case: Case, settings: LaunchPlan) -> tuple[str, str]:
        """Overlaid target and draft; fills settings.compat with the measures the target needed."""
        overlays = cache_root() / "sglang"
        target_overrides = settings.target_overrides
        settings.compat = []
        target_cfg = _config(case.target, "target config")
        if settings.device == "cpu" and deepseek.is_mla(target_cfg):
            try:
                needed, notes = deepseek.cpu_target_overrides(target_cfg)
            except ValueError as e:
                raise EngineError(f"{case.target}/config.json: {e}") from None
            # the case's own target_config_overrides win over ours
            target_overrides = _merge(needed, target_overrides)
            settings.compat += notes
            if self._kernels == cpu_shim.CPU_SHIM:
                settings.compat.append(deepseek.SHIM_MLA_NOTE)
        if self._kernels == cpu_shim.CPU_SHIM and settings.requested.get("attention_backend") == "intel_amx":
            settings.compat.insert(0, deepseek.AMX_NOTE)
        target = str(overlay_checkpoint(case.target, target_overrides, overlays))
        draft = str(overlay_checkpoint(case.draft, settings.draft_overrides, overlays))
        return target, draft

    # -- the engine ------------------------------------------------------------------
    def _engine_for(self, case: Case, num_steps: int | None = None):
        sglang = self._import()
        settings = self._settings(case, num_steps)
        target, draft = self._checkpoints(case, settings)
        caveat = versions.cpu_caveat(sglang.__version__) if settings.device == "cpu" else None
        if caveat:
            settings.compat.append(caveat)
        key = cache_key(target, draft, asdict(settings))
        if self._engine is not None and self._engine_key == key:
            settings.requested["mem_fraction_static"] = self._share
            return self._engine, settings, target, draft
        if settings.device == "cpu" and self._kernels == cpu_shim.CPU_SHIM:
            why = versions.unsupported_on_cpu(sglang.__version__)
            if why:
                raise EngineUnavailable(why)
        why = deepseek.unrunnable(
            _config(target, "target config"), _config(draft, "draft config"), draft, sglang.__version__
        )
        if why:  # refused before start: SGLang's own message would not say which layers or why
            raise EngineError(why)
        self._shutdown()
        if settings.requested.get("mem_fraction_static") is None:  # a setting (or server_args) wins
            settings.requested["mem_fraction_static"] = self._static_share(settings, target, draft, case.dtype)
        self._share = settings.requested["mem_fraction_static"]
        self._hooks_dir = self._workdir / "hooks"
        kwargs = dict(
            model_path=target,
            speculative_draft_model_path=draft,
            speculative_algorithm="EAGLE3",
            device=settings.device,
            skip_tokenizer_init=True,
            random_seed=0,
            disable_overlap_schedule=True,  # one forward at a time: hook records in program order
            forward_hooks=hook_specs(str(self._hooks_dir)),
            log_level=os.environ.get("DIFFTEST_SGLANG_LOG_LEVEL", "warning"),
            **settings.requested,
        )
        if settings.device == "cpu":
            kwargs["disable_cuda_graph"] = True
        if self._kernels == cpu_shim.CPU_SHIM:
            cpu_shim.install_platform_override()
        if settings.device == "cpu" and int(settings.requested["tp_size"]) > 1:
            _bind_ranks_to_cores(int(settings.requested["tp_size"]))
        print(
            f"[sglang adapter] sglang.Engine({json.dumps({k: v for k, v in kwargs.items() if k != 'forward_hooks'}, default=str)})",
            file=sys.stderr,
            flush=True,
        )
        log_offset = _log_size()
        try:
            with process_start.engine_start():  # its processes fork from a server with SGLang imported
                self._engine = sglang.Engine(**kwargs)
        except Exception as e:
            cause = _root_cause(log_offset)
            failed = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            if cause and cause not in failed:
                failed = f"{cause} (then {failed})"
            # a second sglang.Engine in a process whose first start failed can hang: this worker ends
            # after answering, and the next case starts a fresh one
            raise EngineSpent(f"sglang.Engine failed to start: {failed}") from None
        self._engine_key = key
        self._tp_logged = False
        self._crash_watch = None
        if int(settings.requested["tp_size"]) > 1:
            self._crash_watch = rank_crash.install(self._engine, lambda: _log_since(log_offset))
        print(f"[sglang adapter] engine processes started by {process_start.describe()}", file=sys.stderr, flush=True)
        resolved = self._engine.get_server_info()
        self._effective = {k: resolved.get(k) for k in (*settings.requested, "speculative_algorithm", "device")}
        return self._engine, settings, target, draft

    def _guarded(self, call, *args, **kwargs):
        """A request to the engine; where a tensor-parallel rank died meanwhile, its own error."""
        try:
            out = call(*args, **kwargs)
        except Exception:
            if self._crash_watch is not None:
                self._crash_watch.check()  # a rank died: its error, not the stopped event loop's
            raise
        if self._crash_watch is not None:
            self._crash_watch.check()
        return out

    def _generate(self, engine, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
        sampling = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        out = self._guarded(engine.generate, input_ids=prompts, sampling_params=sampling)
        return out if isinstance(out, list) else [out]

    def _settings_meta(self, settings: LaunchPlan) -> dict:
        req = {k: v for k, v in settings.requested.items()}
        eff = dict(self._effective)
        changed = {k: {"requested": req[k], "effective": eff.get(k)} for k in req if k in eff and eff[k] != req[k]}
        return {"requested": req, "effective": eff, "changed_by_sglang": changed}

    # -- the interface ---------------------------------------------------------------
    def capture(self, case: Case, prompt_ids: list[int]) -> Capture:
        engine, settings, target, draft = self._engine_for(case)
        req = settings.requested
        steps = int(self._effective.get("speculative_num_steps") or req["speculative_num_steps"])
        topk = int(self._effective.get("speculative_eagle_topk") or req["speculative_eagle_topk"])
        draft_cfg = json.loads((Path(draft) / "config.json").read_text())
        target_cfg = json.loads((Path(target) / "config.json").read_text())
        hot, hot_source = self._hot_token_id(draft, draft_cfg)
        # The hooks record while their directory exists (difftest_engines/sglang/hooks.py::recording): this
        # generation only. A speculative run's forwards, recorded, took most of its time (each saved
        # every module's tensors and a full logits product).
        shutil.rmtree(self._hooks_dir, ignore_errors=True)
        self._hooks_dir.mkdir(parents=True)
        try:
            # a prompt SGLang has served before (a case whose speculative prompts are its capture
            # prompts, or the same prompt captured for another check) is in the radix cache: the
            # prefill would run over the uncached suffix only and no forward would hold the whole prompt
            self._guarded(engine.flush_cache)
            out = self._generate(engine, [list(prompt_ids)], 2)[0]  # the prefill and one drafting round
            gathered = tensor_parallel.gather(str(self._hooks_dir))  # every rank's records, joined
            forwards = load_forwards(gathered.records)
        finally:
            shutil.rmtree(self._hooks_dir, ignore_errors=True)
        ex = extract(forwards, list(prompt_ids), steps, topk, hot, target_cfg["vocab_size"])
        if out["output_ids"] and out["output_ids"][0] != ex.next_token:
            raise EngineError(
                f"SGLang's first output token {out['output_ids'][0]} is not the recorded prefill's argmax {ex.next_token}"
            )
        L = target_cfg["num_hidden_layers"]
        h = target_cfg["hidden_size"]
        planned, rule = deepseek.layers_to_capture(target_cfg, draft_cfg, self.info().versions["sglang"])
        chunks = ex.tensors[FC_IN].shape[-1] // h
        meta = CaptureMeta(
            engine=self.spec.id,
            engine_version=self.info().version,
            versions=self.info().versions,
            kernels=self._kernels,
            device=settings.device,
            dtype=case.dtype,
            prompt_ids=list(prompt_ids),
            target_next_token=ex.next_token,
            draft_tokens=ex.draft_tokens,
            num_layers=L,
            target_hidden_size=h,
            wiring=Wiring(
                inputs=[f"target.h.{k}" for k in ex.captured_layers][:chunks],
                source=f"{rule} -> layers_to_capture {planned}; captured {ex.captured_layers}",
                verifier=None,
            ),
            compat=list(settings.compat),
            settings=self._settings_meta(settings),
            checkpoints={"target": target, "draft": draft},
            partial=PARTIAL + ([] if topk == 1 else ["draft.step*"]),
            # SGLang's own: which layers its hook recorded, where hot_token_id came from, its self-checks
            extra={
                "captured_target_layers": ex.captured_layers,
                "hot_token_id_source": hot_source,
                "consistency": ex.checks,
                "tensor_parallel": {
                    "tp_size": gathered.tp_size,
                    "rule_verified_on": tensor_parallel.VERIFIED,
                    "tensors": tensor_parallel.describe(gathered.how, gathered.tp_size, list(ex.tensors)),
                },
            },
        )
        if gathered.tp_size > 1 and not self._tp_logged:  # once per engine: what the joins were, in the log
            self._tp_logged = True
            for name, how in meta.extra["tensor_parallel"]["tensors"].items():
                print(f"[sglang adapter] tp_size {gathered.tp_size}: {name}: {how}", file=sys.stderr, flush=True)
        return Capture(ex.tensors, meta)

    @staticmethod
    def _hot_token_id(draft: str, draft_cfg: dict) -> tuple[torch.Tensor, str]:
        """SGLang's hot_token_id, computed as its LlamaForCausalLMEagle3.load_weights does: d2t + arange."""
        from safetensors import safe_open

        for f in sorted(Path(draft).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                if "d2t" in st.keys():
                    d2t = st.get_tensor("d2t")
                    return d2t.long() + torch.arange(
                        d2t.shape[0]
                    ), "draft checkpoint d2t + arange (as SGLang's load_weights)"
        n = draft_cfg.get("draft_vocab_size") or draft_cfg["vocab_size"]
        return torch.arange(n), "identity (no d2t in the draft checkpoint)"

    def capture_draft_from(self, case: Case, prompt_ids: list[int], fc_in: torch.Tensor) -> Capture:
        """Layerwise golden inputs: the same prefill and drafting round, with the reference's draft.fc_in
        in place of the aux hidden states SGLang hands its draft (difftest_engines/sglang/hooks.py::golden_hook)."""
        from difftest_engines.sglang.hooks import golden_path

        if fc_in.dim() != 2 or fc_in.shape[0] != len(prompt_ids):
            raise EngineError(
                f"sglang: golden fc_in of shape {tuple(fc_in.shape)} for a prompt of {len(prompt_ids)} tokens"
            )
        engine, settings, _, _ = self._engine_for(case)  # the engine and its hooks directory exist first
        # the same prompt was captured before: without a flush the radix cache serves its prefix and
        # the prefill runs over the last token only, so the draft would never see the golden rows
        self._guarded(engine.flush_cache)
        # every rank's target replaces its own (replicated) aux states: one copy per rank
        ranks = range(int(self._effective.get("tp_size") or settings.requested["tp_size"]))
        goldens = [Path(golden_path(str(self._hooks_dir), r)) for r in ranks]
        for golden in goldens:
            torch.save(fc_in.contiguous().cpu(), golden)
        try:
            capture = self.capture(case, prompt_ids)
        finally:
            unused = [r for r, golden in zip(ranks, goldens) if golden.exists()]
            for golden in goldens:
                golden.unlink(missing_ok=True)
        if unused:
            raise EngineError(
                f"sglang: the golden fc input was never consumed on rank(s) {unused} "
                "(no target forward reached the hook)"
            )
        return capture

    def speculate(self, case: Case, prompts: list[list[int]], num_steps: int, max_new_tokens: int) -> AcceptStats:
        engine, settings, _, _ = self._engine_for(case, num_steps)
        steps = int(self._effective.get("speculative_num_steps") or num_steps)
        outs = self._generate(engine, [list(p) for p in prompts], max_new_tokens)
        verify = accepted = 0
        per_pos = [0] * steps
        for o in outs:
            m = o["meta_info"]
            if "spec_verify_ct" not in m:
                raise EngineError(f"SGLang's meta_info has no spec_verify_ct (keys: {sorted(m)})")
            verify += int(m["spec_verify_ct"])
            accepted += int(m.get("spec_num_correct_drafts", 0))
            hist = m.get("spec_correct_drafts_histogram") or []  # hist[j]: verifies that accepted j drafts
            for j in range(steps):
                per_pos[j] += sum(int(c) for c in hist[j + 1 :])
        src = (
            f"sglang meta_info (spec_num_correct_drafts / spec_verify_ct + 1; {self._kernels}; "
            f"topk {self._effective.get('speculative_eagle_topk')}, "
            f"draft tokens {self._effective.get('speculative_num_draft_tokens')})"
        )
        return AcceptStats(
            verify,
            accepted,
            steps,
            per_pos,
            len(prompts),
            src,
            outputs=[list(o["output_ids"]) for o in outs],
            native=["sglang.spec_num_correct_drafts", "sglang.spec_correct_drafts_histogram"],
        )

    def _shutdown(self) -> None:
        if self._crash_watch is not None:
            self._crash_watch.stop()
        if self._engine is not None:
            try:
                with process_start.keeping_forkserver():  # the next case's processes fork from it too
                    self._engine.shutdown()
            finally:
                self._engine = None
                self._engine_key = None

    def close(self) -> None:
        try:
            self._shutdown()
        finally:
            if self._workdir is not None:
                # multiprocessing keeps its own temp dir (pymp-*, the forkserver's socket) in TMPDIR,
                # our workdir, and removes it in an exit finalizer (multiprocessing/util.py::
                # get_temp_dir, exitpriority -100): removing the workdir here first made that
                # finalizer print a FileNotFoundError traceback into the engine log at every
                # session's end. Finalizers of lower priority run later, so ours goes after it.
                multiprocessing.util.Finalize(
                    None, shutil.rmtree, args=(str(self._workdir),), kwargs={"ignore_errors": True}, exitpriority=-200
                )
