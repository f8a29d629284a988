"""The layer-id rule models (difftest.rules.layer_rules) against the REAL engines: hypothesis draws draft
configs (ids sorted or not, repeated, -1..L, at the top level, in eagle_config, both, or none) and
each is run on vLLM 0.32.0 and SGLang 0.5.23 over the independent Llama, Qwen3 and DeepSeek-V3
targets (tests/independent_models.py). For each (engine, config) the model's prediction must be what
the engine did:

  * a feed of as many layers as fc expects: the case's wiring is the predicted feed, so the engine's
    `fc_inputs` check passes only if the engine fed exactly those hidden states (by value, within
    the measured noise), in that order;
  * a predicted failure (fewer layers than fc expects, an uncapturable id): the engine's capture errors.

Every outcome class the model predicts is drawn in every run (draw_configs: fed, fed in layer order,
the default fallback, a refusal), DIFFTEST_PROPERTY_EXAMPLES configs of each (default 1), then all
run in one pytest session per engine (each config is a fresh engine instance: ~10 s in vLLM,
~25 s in SGLang on 2 CPU cores). The seed is drawn per run, printed, and written to
reports/layer-rule-seeds.log; rerun one with DIFFTEST_PROPERTY_SEED=N. No shrinking: every example
costs engine starts; a failure lists every config that disagreed.

A predicted refusal is confirmed only by the engine's own words (the lines of the item's message that
start with the engine's name; the harness's own prefix restates the prediction and never counts): a
shape error (LayerIdRule.shape_error), or where the engine captures no layer at all, that error
(LayerIdRule.no_capture_error: SGLang's target forward fails to unpack). Refusals are drawn on Llama and Qwen3 only: on DeepSeek targets
the adapters refuse before starting what the model predicts would crash (vLLM's id 0, SGLang's packer
count), where no engine error could confirm anything. A crashed SGLang scheduler takes its worker down;
the next case (each config is its own) gets a fresh one.
Measured (seed 1, one per class): vLLM fed, sorted, and failed with "shape '[-1, 480]' is invalid" for
a fallback or ids it cannot fill fc with; SGLang fed and sorted as predicted, failed with "mat1 and mat2
shapes cannot be multiplied" when it captured two layers for three chunks, and, where it captured one
layer (as wide as the draft's hidden state), skipped fc without an error (llama_eagle3.py::
LlamaModel.forward applies fc only when the width differs): the "unfused" class, which the model
predicted as a shape error until this test ran it.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import independent_models as im
import pytest
import yaml
from helpers import run_pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from test_engine_vllm import vllm_python

from difftest.rules import layer_rules as lr
from difftest.rules.engine_releases import layer_rule
from difftest.rules.layer_rules import KEY
from difftest.rules.overlay import deep_merge

FAMILIES = {lr.LLAMA: "indep-llama", lr.QWEN3: "indep-qwen3", lr.DEEPSEEK: "indep-deepseek-v3"}
EXAMPLES = int(os.environ.get("DIFFTEST_PROPERTY_EXAMPLES", "1"))
SEED = int(os.environ.get("DIFFTEST_PROPERTY_SEED") or random.SystemRandom().randrange(2**31))
ROOT = Path(__file__).resolve().parent.parent


def configs(L: int):
    """A draft-config fragment: where the ids sit and what they are."""
    layer = st.integers(min_value=-1, max_value=L)
    ids = st.one_of(
        st.lists(layer, min_size=3, max_size=3, unique=True),  # distinct: a full feed is possible
        st.lists(layer, min_size=3, max_size=3),
    )  # repeats too
    # "layer_ids": eagle_config["layer_ids"], which only vLLM's Model Runner V2 reads
    placed = st.tuples(st.sampled_from(["top", "eagle_config", "both", "layer_ids"]), ids)
    return st.one_of(st.just(("none", None)), placed, placed.map(lambda p: (p[0], sorted(p[1]))))


def _draft_config(model: im.BuiltModel, where: str, ids) -> dict:
    """The draft's config with its own ids removed and the drawn ones placed."""
    base = json.loads((model.draft / "config.json").read_text())
    base.pop(KEY, None)
    if isinstance(base.get("eagle_config"), dict):
        base["eagle_config"] = {k: v for k, v in base["eagle_config"].items() if k not in (KEY, "layer_ids")}
    return deep_merge(base, _draft_config_dict(where, ids))


def _write_cases(root: Path, engine: str, batch: list[tuple[str, int, str, list[int] | None]]) -> dict[str, dict]:
    """One case per drawn config, wired as the engine's rule predicts; returns name -> expectation."""
    (root / "cases").mkdir(parents=True)
    expected = {}
    for family, i, where, ids in batch:
        model = im.ensure_model(FAMILIES[family], log=lambda _: None)
        L, chunks = model.spec.num_layers, len(model.spec.trained)
        seen = _draft_config(model, where, ids)
        draft = root / "drafts" / f"{family}-{i}"
        draft.mkdir(parents=True)
        for f in model.draft.iterdir():
            if f.name != "config.json":
                os.symlink(f, draft / f.name)
        (draft / "config.json").write_text(json.dumps(seen))
        reading = _rule(engine, family).predict(seen, L, chunks)
        wiring = reading.fed if reading.refusal is None and reading.unfused is None else list(model.spec.trained)
        # predicted failures last: a crashed SGLang scheduler may take its worker down with it
        tag = re.sub(r"\W", "_", engine)
        name = f"{'z' if reading.refusal or reading.unfused else 'a'}_{tag}_{family.replace('-', '_')}_{i}"
        cap, _ = im.prompts(model.spec)
        case = {
            "name": name,
            "target": str(model.target),
            "draft": str(draft),
            "dtype": "float32",
            "wiring": [f"h{k}" for k in wiring],
            "prompts": [{"ids": cap[0]}],
        }
        (root / "cases" / f"{name}.yaml").write_text(yaml.safe_dump(case, sort_keys=False))
        expected[name] = {
            "config": {"where": where, "ids": ids},
            "reading": reading.explain(),
            "fails": reading.refusal is not None,
            "fed": reading.fed_names(),
            "class": reading.outcome,
            "says": reading.says,
            "unfused": reading.unfused is not None,
        }
    return expected


def _judge(run, engine: str, expected: dict[str, dict]) -> list[str]:
    wrong = []
    for name, want in expected.items():
        r = run.outcome(name, engine, "fc_inputs")
        if want["unfused"]:
            if r.outcome != "error" or "SGLang ran its draft without fc" not in _engine_lines(r.message, engine):
                wrong.append(
                    f"{name} {want['config']}: predicted fc skipped ({want['reading']}), engine "
                    f"{r.outcome}: {r.message.splitlines()[-1][:300]}"
                )
        elif want["fails"]:
            if r.outcome != "error":
                wrong.append(f"{name} {want['config']}: predicted a failure ({want['reading']}), engine {r.outcome}")
            elif not re.search(want["says"], _engine_lines(r.message, engine), re.IGNORECASE):
                # any error is not a confirmation: the engine's own must say what the model predicted
                wrong.append(
                    f"{name} {want['config']}: predicted {want['reading']}; the engine failed otherwise: "
                    f"{r.message.splitlines()[0][:300]}"
                )
        elif r.outcome != "passed":
            chunks = [c.best for c in r.data.fc_chunks or []] if r.data else []
            wrong.append(
                f"{name} {want['config']}: predicted {want['fed']} ({want['reading']}), engine "
                f"{r.outcome}: fed {chunks or '?'}: {r.message.splitlines()[0]}"
            )
    return wrong


def _record_seed(engine: str, draw_seed: int = SEED) -> None:
    log = ROOT / "reports" / "layer-rule-seeds.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("a") as f:
        f.write(f"{engine} seed {draw_seed} examples {EXAMPLES} per family\n")
    print(f"layer-rule property test ({engine}): DIFFTEST_PROPERTY_SEED={draw_seed}")


CLASSES = ("fed", "sorted", "default", "refused", "unfused")


def _classes(engine: str) -> set[str]:
    """The outcome classes the engine's rule model can predict ("unfused": SGLang only)."""
    return {c for c in CLASSES if c != "unfused" or _rule(engine, lr.LLAMA).skips_fc_at_draft_width}


def _engine_lines(message: str, engine: str) -> str:
    """The engine's own words in an item's message: the harness prefixes the rule model's prediction,
    which must never count as its own confirmation."""
    name = re.escape(re.split(r"[@\[]", engine)[0])
    own = re.compile(rf"^{name}(@[^\s\[]+)?(\[[^\]]*\])?:")
    return "\n".join(line for line in message.splitlines() if own.match(line))


def _draws(family: str, salt: int, draw_seed: int = SEED) -> list[tuple[str, list[int] | None]]:
    """Distinct configs for `family` drawn by hypothesis from configs(L) (its generator favours the
    edges: -1, 0, L, repeats) under the recorded seed."""
    seen: list = []

    @settings(
        max_examples=200, deadline=None, phases=[Phase.generate], database=None, suppress_health_check=list(HealthCheck)
    )
    @seed(draw_seed + salt)
    @given(cfg=configs(im.TARGETS[FAMILIES[family]].num_layers))
    def collect(cfg):
        if cfg not in seen:
            seen.append(cfg)

    collect()
    return seen


def _rule(engine: str, family: str) -> lr.LayerIdRule:
    """The rule model of `engine` ("sglang", a release "sglang@0.5.16": engine_releases' rule for it, or a
    spec with parameters "vllm[runner=v1]": the rule of the code path it runs)."""
    from difftest.run.engine import parse_spec

    spec = parse_spec(engine)
    variant = lr.spec_variant(spec.name, dict(spec.params), spec.label or None)
    return layer_rule(spec.name, family, spec.label or None, variant)


def _runs(engine: str, family: str) -> bool:
    """Whether the release runs this family's target on CPU at all (vLLM before 0.32: no MLA)."""
    from difftest_engines.vllm.releases import runs_mla_on_cpu

    name, _, version = engine.split("[")[0].partition("@")
    return not (name == "vllm" and version and family == lr.DEEPSEEK and not runs_mla_on_cpu(version))


def _reading(engine: str, family: str, cfg) -> lr.Reading:
    spec = im.TARGETS[FAMILIES[family]]
    return _rule(engine, family).predict(_draft_config_dict(*cfg), spec.num_layers, len(spec.trained))


def draw_configs(engine: str, draw_seed: int = SEED) -> list[tuple[str, int, str, list[int] | None]]:
    """EXAMPLES configs of each outcome class the engine's rule model predicts (CLASSES: fed, fed in
    layer order, the default fallback, a refusal), each class on a family drawn by the seed, so
    every class is observed on the real engine in every run. Predicted refusals are drawn on Llama and
    Qwen3 only: on DeepSeek targets the adapters refuse before starting what the model predicts would
    crash, so there the engine's own error could not confirm the prediction. On SGLang the default
    class prefers ids at the top level only (which it never reads). Engines run afterwards on the
    whole batch: one engine session per engine, not one per draw."""
    rng = random.Random(draw_seed)
    pools = {
        family: _draws(family, salt=n, draw_seed=draw_seed)
        for n, family in enumerate(FAMILIES)
        if _runs(engine, family)
    }
    batch, i = [], 0
    for cls in sorted(_classes(engine), key=CLASSES.index):
        families = list(pools)
        rng.shuffle(families)
        for _ in range(EXAMPLES):
            for family in families:  # the first family (in the seed's order) that has this class
                fits = [
                    c
                    for c in pools[family]
                    if _reading(engine, family, c).outcome == cls
                    and not (
                        family == lr.DEEPSEEK
                        and (_reading(engine, family, c).refusal or _reading(engine, family, c).unfused)
                    )
                    and (family, c) not in [(b[0], (b[2], b[3])) for b in batch]
                ]
                # the default class where the engine's readings part: SGLang never reads the top level,
                # vLLM's V2 never reads eagle_config's own key
                unread = "eagle_config" if "eagle_config" not in _rule(engine, family).ids_from else "top"
                if cls == "default" and any(c[0] == unread for c in fits):
                    fits = [c for c in fits if c[0] == unread]
                if fits:
                    where, ids = rng.choice(fits)
                    batch.append((family, i, where, ids))
                    i += 1
                    families.append(families.pop(families.index(family)))  # the next example: another family
                    break
    return batch


def _draft_config_dict(where: str, ids) -> dict:
    cfg: dict = {}
    if where in ("top", "both"):
        cfg[KEY] = ids
    if where in ("eagle_config", "both"):
        cfg["eagle_config"] = {KEY: ids}
    if where == "layer_ids":
        cfg["eagle_config"] = {"layer_ids": ids}
    return cfg


def _check(engine: str, python_option: str, tmp_path_factory, draw_seed: int = SEED) -> None:
    batch = draw_configs(engine, draw_seed)
    drawn = {_reading(engine, family, (where, ids)).outcome for family, _, where, ids in batch}
    assert drawn == _classes(engine), f"DIFFTEST_PROPERTY_SEED={draw_seed}: no draw of {_classes(engine) - drawn}"
    # no brackets in paths: vLLM globs a checkpoint directory for its weights ("[runner=v1]" is a class)
    root = tmp_path_factory.mktemp("rules-" + re.sub(r"\W", "_", engine))
    expected = _write_cases(root, engine, batch)
    run = run_pytest(
        root,
        "cases/",
        f"--engines=ref,{engine}",
        *filter(None, [python_option]),
        "--require-engines",
        "--no-capture-cache",
        "--engine-timeout=600",
        "-k",
        "fc_inputs",
        timeout=2400,
    )
    for name, want in expected.items():  # the record of what was tried (pytest -s shows it)
        got = run.outcome(name, engine, "fc_inputs")
        print(
            f"{name} [{want['class']}]: {want['config']} -> {'failure' if want['fails'] else want['fed']}; engine: {got.outcome}"
            + (f" ({got.message.splitlines()[-1][:160]})" if got.outcome == "error" else "")
            + (" [not a verification: the worker was down]" if "after an earlier failure" in got.message else "")
        )
    wrong = _judge(run, engine, expected)
    assert not wrong, f"DIFFTEST_PROPERTY_SEED={draw_seed}\n" + "\n".join(wrong) + "\n" + run.output[-2000:]


def test_vllm_feeds_what_its_rule_model_predicts(tmp_path_factory):
    """vLLM 0.32.0 on its default runner, Model Runner V2 (what a GPU deployment runs)."""
    python = vllm_python()
    _record_seed("vllm")
    _check("vllm", f"--engine-python=vllm={python}", tmp_path_factory)


def test_vllm_model_runner_v1_feeds_what_its_rule_model_predicts(tmp_path_factory):
    python = vllm_python()
    _record_seed("vllm[runner=v1]")
    _check("vllm[runner=v1]", f"--engine-python=vllm={python}", tmp_path_factory)


def test_sglang_feeds_what_its_rule_model_predicts(tmp_path_factory, sglang_python):
    _record_seed("sglang")
    _check("sglang", f"--engine-python=sglang={sglang_python}", tmp_path_factory)


# Older releases (rule models keyed by engine version), in CI: each release .ci/run installs with
# `difftest env create sglang==0.5.16` / `vllm==0.24.0` (tests/test_upgrade_real_releases.py uses the same
# environments) is run against engine_releases' rule for it, under a fixed seed (the one that first ran
# them, stop 36) and this run's new seed. DIFFTEST_PROPERTY_RELEASES=sglang@0.5.16,... names others.
RELEASES = [r for r in os.environ.get("DIFFTEST_PROPERTY_RELEASES", "sglang@0.5.16,vllm@0.24.0").split(",") if r]
FIXED_SEEDS = (1,)


def _release_python(release: str) -> str:
    from difftest.base.paths import cache_root

    python = cache_root() / "envs" / release / "bin" / "python"
    if not python.exists():
        name, _, version = release.partition("@")
        why = f"{release}'s environment is not built ({python}); build it with: .venv/bin/difftest env create {name}=={version}"
        if os.environ.get("DIFFTEST_REQUIRE_ENGINES") == "1":
            pytest.fail(f"DIFFTEST_REQUIRE_ENGINES=1: {why}")
        pytest.skip(why)
    return str(python)


@pytest.mark.parametrize("draw_seed", [*FIXED_SEEDS, SEED], ids=[*map(str, FIXED_SEEDS), "new-seed"])
@pytest.mark.parametrize("release", RELEASES)
def test_an_older_release_feeds_what_its_rule_model_predicts(tmp_path_factory, release, draw_seed):
    from difftest.rules.engine_releases import check_supported

    name, _, version = release.partition("@")
    check_supported(name, version)
    _release_python(release)
    _record_seed(release, draw_seed)
    _check(release, "", tmp_path_factory, draw_seed)
