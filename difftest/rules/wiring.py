"""Which target hidden states feed the draft's fc, in which order.

A wiring is an explicit, ordered list of canonical tensor names (`target.h.{k}`,
`target.final_norm`). Users write it directly (`[h0, h3, h31]`, or `h0+h3+h31` inside
an engine spec) or name a preset, which translates a draft config's layer ids the way
one engine or trainer does. The engine presets are the rule models of difftest.rules.layer_rules
(one copy of each rule, verified against the real engines):

| preset            | explicit id k means                         | no ids in the config           |
|-------------------|---------------------------------------------|--------------------------------|
| vllm, speculators | h[k], layer order, each once                | h[2], h[L//2], h[L-3]          |
| sglang            | h[k+1], layer order (0.5.23, Llama, Qwen3)  | h[2], h[L//2], h[L-3] (no +1)  |
| sglang-deepseek   | h[k+1] if ids[0]==1 else h[k], layer order  | h[2], h[L//2], h[L-3]          |
| specforge         | h[k+1], layer order                         | ids [1, L//2-1, L-4] -> +1     |
| speculators-train | config ids = fc ids, h[k]; verifier h[L]    | fc h[2], h[L//2], h[L-3]       |
| speculators-launch| launch ids h[k] sorted; fc = all but the last, verifier = last |
| speculators-legacy| v0.3/v0.4: h[k+1] sorted; fc = all but the last, verifier = last | [2, L//2, L-3, L-1] |
| eagle             | ids ignored                                 | h[2], h[L//2], h[L-3]          |

Both engines capture auxiliary states while walking the layers, so unsorted or repeated ids
reach fc sorted and once each, in serving and in the trainers' data generation alike.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from difftest.rules import layer_rules
from difftest.base.errors import ConfigError
from difftest.base.fc_wiring import Wiring
from difftest.rules.layer_rules import LayerIdRule
from difftest.base.names import FINAL_NORM, hidden_index, hidden_name, short_name


def hidden_indices(names: Sequence[str | None]) -> list[int] | None:
    """k of every `target.h.{k}` in names; None when any slot is something else (or unknown)."""
    ks = [hidden_index(n) if n else None for n in names]
    return None if None in ks else [k for k in ks if k is not None]


def _canonical_input(token: str, where: str) -> str:
    t = token.strip()
    m = re.fullmatch(r"(?:target\.)?h\.?(\d+)", t)
    if m:
        return hidden_name(int(m.group(1)))
    if t in ("final_norm", FINAL_NORM):
        return FINAL_NORM
    raise ConfigError(f"{where}: wiring input {token!r} is not a target tensor (expected hK, target.h.K or final_norm)")


def _defaults(L: int) -> list[int]:
    return layer_rules.default_layers(L)


def _engine_rule(rule: LayerIdRule) -> Callable[[list[int] | None, int], tuple[list[int], str | None]]:
    """A preset that reads ids the way `rule` does (difftest.rules.layer_rules: the one copy of each rule)."""

    def preset(ids: list[int] | None, L: int) -> tuple[list[int], str | None]:
        reading = rule.predict_ids(ids, L)
        if any(not 0 <= k <= L for k in reading.dropped):
            return reading.asked, None  # a layer the target does not have: resolve() names it
        if reading.dropped or reading.refusal:
            raise ConfigError(
                f"{rule.engine} convention: {reading.explain()}"
                + ("" if reading.refusal else ": fewer fc chunks than ids, a shape error in the engine")
            )
        return reading.fed, (hidden_name(L) if rule.verifier == "L" else None)

    return preset


_vllm = _engine_rule(layer_rules.VLLM_LLAMA)
_sglang = _engine_rule(layer_rules.SGLANG_LLAMA)
_sglang_deepseek = _engine_rule(layer_rules.SGLANG_DEEPSEEK)
_specforge = _engine_rule(layer_rules.SPECFORGE)
# speculators 0.9.0: the draft config's target_layer_ids are the fc ids only; data generation
# appends L and the trainer takes the last hidden state as the verifier (layer_rules.SPECULATORS)
_speculators_train = _engine_rule(layer_rules.SPECULATORS)


def _speculators_launch(ids: list[int] | None, L: int) -> tuple[list[int], str | None]:
    # The ids data generation was launched with (verifier included): stored in layer order, the
    # trainer feeds fc all but the last and uses the last as the verifier.
    launch = sorted(ids) if ids else _defaults(L) + [L]
    if len(launch) < 2:
        raise ConfigError(f"speculators-launch: needs at least two launch ids (fc inputs + verifier), got {launch}")
    return launch[:-1], hidden_name(launch[-1])


def _speculators_legacy(ids: list[int] | None, L: int) -> tuple[list[int], str | None]:
    # speculators v0.3/v0.4 data generation captured the output of layer k = h[k+1], defaults
    # [2, L//2, L-3, L-1] (the last, L-1 -> h[L], is the verifier); fc = all but the last.
    launch = sorted(i + 1 for i in (ids or [2, L // 2, L - 3, L - 1]))
    if len(launch) < 2:
        raise ConfigError(f"speculators-legacy: needs at least two layer ids (fc inputs + verifier), got {ids}")
    return launch[:-1], hidden_name(launch[-1])


def _eagle(ids: list[int] | None, L: int) -> tuple[list[int], str | None]:
    return _defaults(L), None


# the preset each serving engine (and SpecForge's data generation) reads a config's layer ids with,
# by target family (difftest.rules.layer_rules.target_family); a family not listed reads as "llama"
READING_PRESETS: dict[str, dict[str, str]] = {
    "llama": {"vllm": "vllm", "sglang": "sglang", "specforge": "specforge"},
    "deepseek": {"vllm": "vllm", "sglang": "sglang-deepseek", "specforge": "specforge"},
}

# a case that states no `wiring:` was trained as vLLM serves it (the speculators convention, h[k])
DEFAULT_PRESET = "vllm"


def trained_layer_ids(
    case_ids: list[int] | None,
    eagle_config_ids: list[int] | None,
    top_ids: list[int] | None,
    setting_ids: list[int] | None = None,
) -> tuple[list[int] | None, str]:
    """The layer ids a case's preset reads, and where they came from (the words a Wiring's source quotes).

    First given wins: an engine's own `layer_ids` setting (only the reference engine has one), the
    case's `layer_ids`, the draft config's eagle_config ids, its top-level ids. The draft's ids are
    taken as the caller read its config (the reference loader ignores eagle_config in a speculators
    config, the lint reads the JSON as written); an empty or absent eagle_config list falls through
    to the top level, as an engine reading either location would. None: no ids anywhere, and the
    preset applies its defaults (resolve)."""
    if setting_ids is not None:
        return setting_ids, "engine settings"
    if case_ids is not None:  # the case reader refuses an empty list, so None is the only "not given"
        return case_ids, "case layer_ids"
    if eagle_config_ids:
        return eagle_config_ids, "draft config eagle_config"
    return top_ids, "draft config"


PRESETS: dict[str, Callable[[list[int] | None, int], tuple[list[int], str | None]]] = {
    "vllm": _vllm,
    "speculators": _vllm,
    "sglang": _sglang,
    "sglang-deepseek": _sglang_deepseek,
    "specforge": _specforge,
    "speculators-train": _speculators_train,
    "speculators-launch": _speculators_launch,
    "speculators-legacy": _speculators_legacy,
    "eagle": _eagle,
}


def resolve(
    spec: str | Sequence[str],
    num_layers: int,
    layer_ids: list[int] | None,
    where: str = "wiring",
    ids_source: str = "draft config",
) -> Wiring:
    """Turn a preset name or an explicit list into a Wiring checked against the target's depth."""
    if isinstance(spec, str) and spec == "infer":  # a case's `wiring: infer` is replaced before engines run
        raise ConfigError(
            f"{where}: 'infer' is only valid as a case's wiring (the harness infers it, difftest.run.infer_case); "
            f"give a preset ({', '.join(PRESETS)}) or a list like [h0, h3, h31] here"
        )
    if isinstance(spec, str) and spec in PRESETS:
        ks, verifier = PRESETS[spec](layer_ids, num_layers)
        inputs = [hidden_name(k) for k in ks]
        src = f"preset {spec} from ids {layer_ids} ({ids_source})" if layer_ids else f"preset {spec}, no ids: defaults"
        wiring = Wiring(inputs, src, verifier)
    else:
        tokens = re.split(r"[+\s,]+", spec.strip("[] ")) if isinstance(spec, str) else list(spec)
        tokens = [t for t in tokens if str(t).strip()]
        if not tokens:
            raise ConfigError(
                f"{where}: empty wiring; expected a preset ({', '.join(PRESETS)}) or a list like [h0, h3, h31]"
            )
        if isinstance(spec, str) and len(tokens) == 1 and not re.search(r"\d|final_norm", tokens[0]):
            raise ConfigError(
                f"{where}: unknown wiring preset {spec!r}; expected one of {', '.join(PRESETS)} or a list like [h0, h3, h31]"
            )
        wiring = Wiring([_canonical_input(str(t), where) for t in tokens], "explicit")
    for name in [*wiring.inputs, *([wiring.verifier] if wiring.verifier else [])]:
        k = hidden_index(name)
        if k is not None and not 0 <= k <= num_layers:
            raise ConfigError(
                f"{where}: {short_name(name)} does not exist; the target has {num_layers} layers (h0..h{num_layers})"
            )
    return wiring
