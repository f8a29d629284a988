"""`wiring: infer` (difftest.rules.infer_wiring): drafts really trained on known wirings are named exactly;
drafts that learned nothing are not named at all."""

from __future__ import annotations

import json

import pytest
import torch

import wiring_drafts as wd
from difftest.rules.infer_wiring import Scores, Search, infer, infer_from_evidence, paired_z, starts_for
from difftest_engines.ref.draft_loading import load_draft


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops on a shared 2-core machine: one thread is reproducible and several times faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(wd.RECIPES))
def test_trained_wiring_is_inferred_exactly(name):
    recipe = wd.RECIPES[name]
    loaded = load_draft(wd.ensure_draft(name))
    result = infer_from_evidence(
        loaded.model, loaded.config.layer_ids, wd.evidence(recipe.target), wd.family(recipe.target)
    )
    assert result.decided, "\n".join(result.lines())
    assert result.wiring == recipe.inputs
    assert all(s.decided_by for s in result.slots)


def test_inference_does_not_follow_the_config_ids():
    # llama-embed's config says [3, 6, 7]: every engine reading scores far below the trained wiring
    recipe = wd.RECIPES["llama-embed"]
    loaded = load_draft(wd.ensure_draft("llama-embed"))
    result = infer_from_evidence(loaded.model, loaded.config.layer_ids, wd.evidence(recipe.target))
    vllm = next(r for r in result.readings if r.engine == "vllm")
    assert vllm.wiring == ["target.h.3", "target.h.6", "target.h.7"]
    assert vllm.agreement < result.agreement - 0.3


def test_untrained_draft_cannot_tell():
    from difftest_fixtures.drafts import draft_config
    from difftest_engines.ref.train import init_draft

    target = wd._target("tiny-llama")
    draft = init_draft(target, draft_config(), torch.arange(512) * 0, seed=5)
    result = infer_from_evidence(draft, [2, 4, 5], wd.evidence_head("tiny-llama", 16))
    assert not result.decided
    assert "unrelated positions" in result.reasons[0]
    assert result.headline().startswith("cannot tell what the draft was trained on")


def test_random_draft_of_an_independent_target_cannot_tell():
    from independent_models import build_draft, ensure_model
    from transformers import AutoModelForCausalLM

    model = ensure_model("indep-qwen3")  # its saved draft is fitted to the cases' prompts: build the random one
    target = AutoModelForCausalLM.from_pretrained(model.target, dtype=torch.float32)
    draft = build_draft(model.spec, target).eval()
    result = infer_from_evidence(draft, list(model.spec.trained), wd.evidence_head("indep-qwen3", 16))
    assert not result.decided


# -- the search and the statistic, on synthetic scorers ----------------------------------------


def synthetic(truth: tuple[str, ...], n: int = 2000, seed: int = 0, gain: float = 0.85):
    """Agreement grows with the number of correct slots; common random numbers make comparisons paired."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed))

    def score(w):
        p = 0.05 + gain * (sum(a == b for a, b in zip(w, truth)) / len(truth)) ** 2
        hits = u < p
        return Scores(hits, hits.float())

    return score


def test_search_finds_the_truth_far_from_the_start_without_the_grid():
    L = 61
    candidates = [f"target.h.{k}" for k in range(L + 1)] + ["target.final_norm"]
    truth = ("target.h.0", "target.h.17", "target.final_norm")
    search = Search(synthetic(truth), candidates, 3)
    assert search.run(starts_for([3, 31, 59], L, 3)) == truth
    assert search.forwards < 0.01 * len(candidates) ** 3


def test_paired_z_counts_only_discordant_positions():
    a = torch.tensor([True] * 50 + [False] * 50)
    assert paired_z(a, a) == 0.0
    b = a.clone()
    b[:16] = False  # a alone right on 16 positions
    assert paired_z(a, b) == pytest.approx(4.0)


def test_weak_evidence_cannot_tell():
    truth = ("target.h.1", "target.h.2")
    candidates = [f"target.h.{k}" for k in range(4)]
    result = infer(synthetic(truth, n=200, gain=0.05), candidates, 2, [truth])
    assert not result.decided
    assert "within sampling spread" in result.reasons[0]


def test_cli_names_the_seed_drafts_training_wiring(capsys):
    from difftest.cli import main

    code = main(
        [
            "infer-wiring",
            "--target",
            "fixture:tiny-llama",
            "--draft",
            "fixture:tiny-llama-eagle3",
            "--random",
            "24",
            "--length",
            "40",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["wiring"] == ["target.h.2", "target.h.4", "target.h.5"]
    assert {r["engine"]: r["wiring"] for r in out["readings"]}["sglang"] == ["target.h.3", "target.h.5", "target.h.6"]


def test_cli_refuses_bad_prompt_ids_in_one_line(capsys):
    from difftest.cli import main

    code = main(
        [
            "infer-wiring",
            "--target",
            "fixture:tiny-llama",
            "--draft",
            "fixture:tiny-llama-eagle3",
            "--prompts",
            "ids:1,x",
        ]
    )
    assert code == 4  # a bad option value (difftest.base.exit_codes.USAGE), checked before the models load
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "ids:1,2,3" in err


def test_a_capture_with_some_layers_and_no_logits_is_searched_over_what_it_holds():
    # a training dump read by `train`: the dumped layers (identified by content), the data's next tokens as labels
    from difftest.records.capture import Capture
    from difftest.rules.infer_wiring import evidence_from_captures

    full = wd.evidence("tiny-llama")
    kept = ["target.h.0", "target.h.3", "target.h.6", "target.h.8"]
    caps = [Capture({n: t[n] for n in kept}, {"prompt_ids": ids}) for ids, t in zip(full.tokens, full.tensors)]
    evidence = evidence_from_captures(caps, "train capture")
    assert evidence.candidates == kept and "next tokens" in evidence.label_source
    loaded = load_draft(wd.ensure_draft("llama-embed"))
    result = infer_from_evidence(loaded.model, loaded.config.layer_ids, evidence)
    assert result.decided and result.wiring == ["target.h.0", "target.h.3", "target.h.6"]
    assert result.source == "train capture"


def test_a_case_with_wiring_infer_on_an_untrained_draft_stops_saying_it_cannot_tell(tmp_path):
    from difftest.case.case import load_case
    from difftest.run.engine import EngineSpec
    from difftest.base.errors import ConfigError
    from difftest.run.session import Options, Session
    from difftest_fixtures.drafts import draft_config
    from difftest_engines.ref.train import init_draft, save_eagle_format

    draft = init_draft(wd._target("tiny-llama"), draft_config(), torch.zeros(512, dtype=torch.long), seed=5)
    save_eagle_format(draft, tmp_path / "draft", [2, 4, 5])
    prompts = "\n".join(f"  - ids: {ids}" for ids in wd.evidence("tiny-llama").tokens[:8])
    (tmp_path / "case.yaml").write_text(
        f"target: fixture:tiny-llama\ndraft: draft\nwiring: infer\nprompts:\n{prompts}\n"
    )
    case = load_case(tmp_path / "case.yaml")
    session = Session(Options(engines=[EngineSpec("ref")], reference=EngineSpec("ref"), log_dir=tmp_path / "logs"))
    try:
        with pytest.raises(ConfigError, match="wiring: infer: cannot tell what the draft was trained on") as e:
            _ = session.run(case).prepared
        assert "\n" not in str(e.value) and "state `wiring:` explicitly" in str(e.value)
        with pytest.raises(ConfigError):  # every item of the case gets the same one line, not a second inference
            _ = session.run(case).prepared
        assert session.run(case).inference() is None
    finally:
        session.close()
