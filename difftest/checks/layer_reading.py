"""A case seen through one engine's layer-id rule (difftest.rules.layer_rules): what that engine
reads from the draft config it is actually given (the case's draft with the engine's
`draft_config_overrides`), what it feeds, what training fed, and the config edit that
would make the two agree. Used by the fc_inputs diagnosis, the crash explanation and
`difftest fix`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from difftest.case.case import Case
from difftest.base.errors import ConfigError
from difftest.base.jsonfile import read_json, read_json_object
from difftest.rules.engine_releases import layer_rule
from difftest.rules.layer_rules import ConfigEdit, LayerIdRule, Reading, config_edit, target_family
from difftest.rules.overlay import deep_merge
from difftest.rules.wiring import hidden_indices
from difftest.checks.lint import fc_chunks


@dataclass(frozen=True)
class EngineView:
    engine: str
    rule: LayerIdRule
    draft_config: dict  # as the engine is given it
    L: int
    fc_chunks: int | None
    reading: Reading
    trained: list[int] | None  # h indices training fed, when the training wiring is all target.h.K

    def rule_line(self) -> str:
        line = f"rule: {self.reading.explain()}"
        if self.trained is not None:
            line += f"; training fed [{', '.join(f'h{k}' for k in self.trained)}]"
        return line

    def edit(self) -> ConfigEdit | None:
        if self.trained is None:
            return None
        return config_edit(self.draft_config, self.rule.family, self.engine, self.trained, self.L, self.rule)


def draft_config_seen(case: Case, engine: str) -> dict | None:
    """The draft's config.json as `engine` is given it (its case section's draft_config_overrides
    merged in); `case` prepared. None when the config cannot be read."""
    try:
        draft = read_json(Path(case.draft) / "config.json", "draft config")
    except ConfigError:
        return None
    if not isinstance(draft, dict):
        return None
    section = case.engines.get(engine.split("[")[0].split("@")[0]) or {}
    overrides = section.get("draft_config_overrides") or {}
    return deep_merge(draft, overrides) if isinstance(overrides, dict) else draft


def engine_view(
    case: Case, engine: str, trained_wiring: list[str] | None, version: str | None = None, variant: str = ""
) -> EngineView | None:
    """`case` prepared (fixtures resolved) and already merged for a labelled spec
    (CaseRun.engine_case); `version` the engine's release (None: the pinned one, whose rules
    difftest.rules.layer_rules states), `variant` the code path it ran (EngineInfo.variant). None when
    no rule models this engine on this target."""
    try:
        tcfg = read_json_object(Path(case.target) / "config.json", "target config")
    except ConfigError:
        return None
    seen = draft_config_seen(case, engine)
    rule = layer_rule(engine, target_family(tcfg), version, variant)
    if rule is None or seen is None:
        return None
    text = tcfg.get("text_config", tcfg)
    L, H = int(text["num_hidden_layers"]), int(text["hidden_size"])

    chunks = fc_chunks(Path(case.draft), H)
    trained = None
    if trained_wiring:
        trained = hidden_indices(trained_wiring)
    reading = rule.predict(seen, L, chunks)
    return EngineView(engine, rule, seen, L, chunks, reading, trained)


def fix_lines(view: EngineView, edit: ConfigEdit | None) -> list[str]:
    """The config edit (view.edit(), or why none exists), one line each."""
    if edit is None or view.reading.fed == view.trained and view.reading.refusal is None:
        return []
    if not edit.possible:
        return [f"no config fixes {view.rule.label}: {edit.impossible}"] + [f"instead: {a}" for a in edit.alternatives]
    where = " / ".join(_paths(edit.patch))
    feeds = ", ".join(f"h{k}" for k in edit.feeds)
    reorder = (
        f"reorder fc.weight's input blocks into layer order (new block j = trained block {edit.fc_order}[j]) and "
        if edit.fc_order
        else ""
    )
    lines = [
        f"fix: {reorder}set {where} = {edit.ids} (then {view.rule.label} feeds [{feeds}]); "
        f"`difftest fix CASE --engines {view.engine}` writes and verifies it"
    ]
    lines += [f"note: the edit also changes another reading: {s}" for s in edit.side_effects]
    return lines


def _paths(patch: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in patch.items():
        out += _paths(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out
