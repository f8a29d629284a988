"""The vLLM adapter's settings (difftest.base.settings): the case's `engines.vllm` merged with `vllm[...]`."""

from difftest.api import CASE_DTYPES, Schema, Setting, settings_record

SCHEMA = Schema(
    "vllm",
    (
        Setting("enforce_eager", "bool", "no CUDA graphs / torch.compile", default=True),
        Setting(
            "runner",
            "choice",
            "vLLM's model runner (default: the one a GPU deployment of the release takes: "
            "v2 from 0.32.0); one per worker, chosen when it starts",
            choices=("v1", "v2"),
        ),
        Setting("max_model_len", "int", "vllm.LLM max_model_len", default=512, min=1),
        Setting("tensor_parallel_size", "int", "vllm.LLM tensor_parallel_size", default=1, min=1),
        Setting("seed", "int", "vllm.LLM seed", default=0, min=0),
        Setting("dtype", "choice", "model dtype (default: the case's)", choices=CASE_DTYPES),
        Setting(
            "num_speculative_tokens",
            "int",
            "draft steps (default: the case's speculative.num_steps)",
            min=1,
            aliases=("num_steps",),
        ),
        Setting("kv_cache_space_gib", "int", "VLLM_CPU_KVCACHE_SPACE", default=1, min=1),
        Setting(
            "draft_config_overrides", "mapping", "deep-merged into the draft's config.json (an overlay)", default={}
        ),
        Setting("target", "path", "serve this target instead of the case's"),
        Setting("draft", "path", "serve this draft instead of the case's", replaces="draft"),
        Setting("llm_args", "mapping", "any other vllm.LLM argument", default={}),
        Setting("speculative_config", "mapping", "merged into vllm's speculative_config", default={}),
    ),
)

# what the adapter reads them as (Engine.settings_for): one attribute per setting
Settings = settings_record(SCHEMA)
