"""The SGLang adapter's settings (difftest.base.settings): the case's `engines.sglang` merged with `sglang[...]`."""

from difftest.api import Schema, Setting, settings_record

SCHEMA = Schema(
    "sglang",
    (
        Setting(
            "speculative_num_steps",
            "int",
            "draft steps (default: the case's speculative.num_steps)",
            min=1,
            aliases=("num_steps",),
        ),
        Setting("speculative_eagle_topk", "int", "draft tree branching", default=1, min=1, aliases=("topk",)),
        Setting(
            "speculative_num_draft_tokens",
            "int",
            "tree budget, root included (default: num_steps + 1)",
            min=2,
            aliases=("num_draft_tokens",),
        ),
        Setting("attention_backend", "str", "sglang attention backend (default: intel_amx under the CPU shim)"),
        Setting("tp_size", "int", "tensor parallel size", default=1, min=1),
        Setting(
            "mem_fraction_static",
            "float",
            "static memory share (default on CPU: computed from the weights, the KV cache and the free memory, at least 0.3; 0.5 on GPU)",
            min=0.0,
            max=1.0,
        ),
        Setting("max_total_tokens", "int", "KV cache tokens", default=4096, min=1),
        Setting("server_args", "mapping", "any other sglang.Engine argument", default={}),
        Setting(
            "draft_config_overrides", "mapping", "deep-merged into the draft's config.json (an overlay)", default={}
        ),
        Setting(
            "target_config_overrides", "mapping", "deep-merged into the target's config.json (an overlay)", default={}
        ),
    ),
)

# what the adapter reads them as (Engine.settings_for): one attribute per setting
Settings = settings_record(SCHEMA)
