"""Discover an engine release's layer-id rule by measurement: `difftest rules discover ENGINE[@LABEL]`.

A release nobody has read yet (the one a pre-upgrade check is for) has no rule on record
(difftest.rules.engine_releases.on_record); its verdicts are measured anyway. This module measures its
*rule* as well, so a reviewer can read it as data: the same target and draft weights are served under
designed draft configs (the ids at one place at a time, at two places, out of layer order, none), and each
engine fc chunk is matched to the reference's target hidden states (difftest.compare.diagnose, the
fc_inputs check's matching), which says what the engine fed, whatever the ids say. From the feeds:

  ids_from        the places whose ids moved the feed (a place whose probe was fed the defaults is unread),
                  in the order the two-place probe shows
  shift           fed[i] - sorted(ids)[i], one constant for every place read
  sorted_by_layer whether ids out of layer order are fed in layer order
  defaults        what the engine fed with no ids at all, and the formula of L that gives it

The result is a `DiscoveredRule` written as JSON and compared field by field with the nearest rule on
record (`difference`). Needs a target of at least 6 layers and a draft whose fc takes 3 chunks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from difftest.base.errors import ConfigError, DifftestError
from difftest.case.case import load_case
from difftest.compare.diagnose import match_fc_chunks
from difftest.records.engine_info import EngineInfo
from difftest.rules.layer_rules import (
    EAGLE_CONFIG,
    EAGLE_CONFIG_LAYER_IDS,
    KEY,
    TOP,
    LayerIdRule,
    place_words,
    placed,
)
from difftest.base.names import hidden_index
from difftest.base.registry import calibration_engine
from difftest.run.engine import EngineSpec
from difftest.run.case_run import CaseRun
from difftest.run.pool import EnginePool, Options
from difftest.rules.overlay import deep_merge

PLACES = (TOP, EAGLE_CONFIG, EAGLE_CONFIG_LAYER_IDS)
# formulas of L that engines and trainers use for their defaults (difftest.rules.layer_rules)
DEFAULT_FORMULAS = ("2, L//2, L-3", "1, L//2-1, L-4")


def probe_ids(L: int) -> dict[str, list[int]]:
    """Ids per place, chosen so that every place, shifted by -1, 0 or +1, names other layers than the
    defaults and than each other, and stays capturable."""
    return {TOP: [1, 3, L - 2], EAGLE_CONFIG: [0, 2, L - 4], EAGLE_CONFIG_LAYER_IDS: [1, 2, L - 5]}


@dataclass
class Probe:
    name: str
    config: dict  # the ids placed in the draft's config (everything else as the draft has it)
    fed: list[int] | None = None  # h indices the engine fed fc, by measurement
    error: str | None = None


@dataclass
class DiscoveredRule:
    engine: str  # the spec probed
    release: str  # as its worker reported it
    variant: str
    num_layers: int
    ids_from: list[str]
    shift: int | None
    sorted_by_layer: bool | None
    defaults: list[int] | None
    defaults_formula: str | None
    probes: list[Probe] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _strip_ids(cfg: dict) -> dict:
    out = {k: v for k, v in cfg.items() if k != KEY}
    if isinstance(out.get(EAGLE_CONFIG), dict):
        out[EAGLE_CONFIG] = {k: v for k, v in out[EAGLE_CONFIG].items() if k not in (KEY, "layer_ids")}
    return out


def _write_probe(root: Path, i: int, target: str, draft: str, probe: Probe) -> Path:
    """The probe's draft (the draft's files linked, its config without ids plus the probe's) and its case."""
    d = root / "drafts" / f"probe{i}"
    d.mkdir(parents=True, exist_ok=True)
    for f in Path(draft).iterdir():
        if f.name != "config.json" and not (d / f.name).exists():
            (d / f.name).symlink_to(f.resolve())
    base = _strip_ids(json.loads((Path(draft) / "config.json").read_text()))
    (d / "config.json").write_text(json.dumps(deep_merge(base, probe.config), indent=1))
    case = root / "cases" / f"probe{i}.yaml"
    case.parent.mkdir(parents=True, exist_ok=True)
    # the reference runs some wiring: only its target hidden states are matched against
    case.write_text(
        f"name: probe{i}\ntarget: {target}\ndraft: {d}\ndtype: float32\nwiring: [h0, h1, h2]\n"
        "prompts:\n  - ids: [5, 9, 13, 17, 21, 25, 29, 33]\n"
    )
    return case


def _probes(L: int) -> list[Probe]:
    ids = probe_ids(L)
    probes = [Probe("none", {})] + [Probe(f"only {place_words(p)}", placed(p, ids[p])) for p in PLACES]
    both = deep_merge(placed(TOP, ids[TOP]), placed(EAGLE_CONFIG, ids[EAGLE_CONFIG]))
    return probes + [Probe("top level and eagle_config", both)]


def _measure(
    pool: EnginePool, ref: EngineSpec, spec: EngineSpec, case_path: Path
) -> tuple[list[int] | None, str | None]:
    run = CaseRun(pool, load_case(case_path))
    pool.begin_case(str(case_path))
    try:
        theirs = run.capture(spec, 0)
    except DifftestError as e:
        return None, str(e).splitlines()[0][:300]
    ours = run.capture(ref, 0)
    fed = []
    for m in match_fc_chunks(ours, theirs):
        k = hidden_index(m.best) if m.matched and m.best else None
        if k is None:
            return None, f"fc chunk {m.chunk} matches no target hidden state ({m.best})"
        fed.append(k)
    return fed, None


def _unsorted_probe(rule_places: list[str], L: int) -> Probe | None:
    if not rule_places:
        return None
    first = rule_places[0]
    return Probe(f"out of layer order at {place_words(first)}", placed(first, probe_ids(L)[first][::-1]))


def discover(
    spec: EngineSpec,
    target: str,
    draft: str,
    work: Path,
    engine_python: dict[str, str] | None = None,
    timeout: float = 900.0,
    progress=print,
) -> DiscoveredRule:
    """Probe `spec` with designed draft configs of `draft` on `target`; the rule its feeds imply."""
    try:
        tcfg = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{target}/config.json: cannot be read ({e})") from None
    L = int(tcfg.get("text_config", tcfg)["num_hidden_layers"])
    if L < 6:
        raise ConfigError(f"{target}: {L} layers; discovery needs a target of at least 6 layers")
    ref = EngineSpec(calibration_engine())
    pool = EnginePool(
        Options(
            engines=[spec],
            reference=ref,
            engine_python=engine_python or {},
            timeout=timeout,
            log_dir=work / "logs",
            progress=progress,
        )
    )

    def run(i: int, probe: Probe) -> None:
        probe.fed, probe.error = _measure(pool, ref, spec, _write_probe(work, i, target, draft, probe))
        progress(f"[rules discover] {spec.id}: {probe.name}: {probe.fed if probe.error is None else probe.error}")

    try:
        probes = _probes(L)
        for i, probe in enumerate(probes):
            run(i, probe)
        info: EngineInfo | None = pool.engine_info(spec)
        rule = _infer(spec, info, L, probes)
        extra = _unsorted_probe(rule.ids_from, L)
        if extra is not None:
            run(len(probes), extra)
            rule.probes.append(extra)
            ids = sorted(probe_ids(L)[rule.ids_from[0]])
            if extra.fed is not None and rule.shift is not None:
                rule.sorted_by_layer = extra.fed == [k + rule.shift for k in ids]
            else:
                rule.unresolved.append("sorted_by_layer: the out-of-order probe was not fed")
        return rule
    finally:
        pool.close()


def _infer(spec: EngineSpec, info: EngineInfo | None, L: int, probes: list[Probe]) -> DiscoveredRule:
    none, singles, both = probes[0], probes[1 : 1 + len(PLACES)], probes[1 + len(PLACES)]
    ids = probe_ids(L)
    unresolved = []
    defaults = none.fed
    formula = next((f for f in DEFAULT_FORMULAS if [int(eval(x, {"L": L})) for x in f.split(",")] == defaults), None)
    read, shifts = [], set()
    for place, probe in zip(PLACES, singles):
        if probe.fed is None:
            unresolved.append(f"{place_words(place)}: {probe.error}")
            continue
        want = sorted(ids[place])
        if probe.fed == defaults and want != defaults:
            continue  # the engine did not read this place
        diffs = {f - w for f, w in zip(probe.fed, want)}
        if len(diffs) == 1 and len(probe.fed) == len(want):
            read.append(place)
            shifts.add(diffs.pop())
        else:
            unresolved.append(f"{place_words(place)}: fed {probe.fed} for ids {ids[place]} (no single shift)")
    if len(shifts) > 1:
        unresolved.append(f"shift: the places read shift differently {sorted(shifts)}")
    shift = shifts.pop() if len(shifts) == 1 else None
    if TOP in read and EAGLE_CONFIG in read and both.fed is not None and shift is not None:
        first = TOP if both.fed == [k + shift for k in sorted(ids[TOP])] else EAGLE_CONFIG
        read.sort(key=lambda p: 0 if p == first else 1 + PLACES.index(p))
    return DiscoveredRule(
        engine=spec.id,
        release=info.version if info else "?",
        variant=info.variant if info else "",
        num_layers=L,
        ids_from=read,
        shift=shift,
        sorted_by_layer=None,
        defaults=defaults,
        defaults_formula=formula,
        probes=list(probes),
        unresolved=unresolved,
    )


def difference(found: DiscoveredRule, known: LayerIdRule) -> list[str]:
    """Field by field against a rule on record; [] when the measurement recovers it exactly (over the
    places probed: the top level, eagle_config's own key, eagle_config.layer_ids)."""
    lines = []
    on_record = [p for p in known.ids_from if p in PLACES]
    if found.ids_from != on_record:
        lines.append(f"ids_from: measured {found.ids_from}, {known.label} {on_record}")
    if found.shift != known.shift.by or known.shift.when_first_is is not None:
        lines.append(f"shift: measured {found.shift}, {known.label} {known.shift.words()}")
    if found.sorted_by_layer != known.sorted_by_layer:
        lines.append(f"sorted_by_layer: measured {found.sorted_by_layer}, {known.label} {known.sorted_by_layer}")
    if found.defaults != known.default_ids(found.num_layers):
        lines.append(
            f"defaults: measured {found.defaults}, {known.label} {known.defaults} = {known.default_ids(found.num_layers)}"
        )
    return lines
