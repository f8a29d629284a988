"""Training accuracy against a hand-computed example, under both trainers' rules."""

from __future__ import annotations

import math
import re

import pytest
import torch

from difftest.case.case import Case
from difftest.records.tolerance import Expectations
from difftest.run.engine import EngineSpec
from difftest.base.errors import ConfigError
from difftest_engines.trainingdata.train_accuracy import RULES, StepCounts, VerifierHead, rules_for, score_steps
from difftest_engines.trainingdata.train_check import check_train_accuracy

# N = 5 tokens; T_p = target draft id at p (T_0 is never a target); loss mask on positions 2..4.
TARGETS = torch.tensor([9, 1, 2, 3, 4])
MASK = torch.tensor([0, 0, 1, 1, 1], dtype=torch.bool)
# predictions at origins 0..3 for TTT steps 0 and 1
PREDS = [torch.tensor([1, 2, 0, 4]), torch.tensor([2, 0, 4, 7])]


def test_speculators_rules_by_hand():
    # prev_correct starts as the origin's shifted mask m[i+1] = [0, 1, 1, 1] and is ANDed with every step's equality
    # step 0 (origin i vs T[i+1], mask m[i+1]): equal [y y n y] -> prev [0 1 0 1]; counted 3, right 2 (i=1, i=3)
    # step 1 (origin i vs T[i+2], mask m[i+2], origins 0..2): equal [y n y -]; prev [0 0 0 1]: i=0 is right but was never
    #   in the mask, i=2 is right but was wrong at step 0, i=3 has no step-1 target -> 0 of 3 (full_acc ANDs earlier steps)
    # cond step 1: denominator = prev_correct before step 1 on origins 0..2 = 1 (i=1), not every step's mask
    c = score_steps(PREDS, TARGETS, MASK, RULES["speculators"])
    assert (c.correct, c.counted) == ([2, 0], [3, 3])
    assert (c.cond_correct, c.cond_counted) == ([2, 0], [3, 1])
    assert c.full_acc == pytest.approx([2 / 3, 0.0])
    assert c.cond_acc == pytest.approx([2 / 3, 0.0])


def test_specforge_rules_by_hand():
    # mask unshifted: step 0 counts origin i where mask[i]: i=2 (0!=3), i=3 (4==4) -> 1/2
    # step 1 counts mask[i+1]: i=1 (0!=3), i=2 (4==4) -> 1/2; cond: origin 3 has no step-1 target -> 0/0
    c = score_steps(PREDS, TARGETS, MASK, RULES["specforge"], in_vocab=torch.ones(5, dtype=torch.bool))
    assert (c.correct, c.counted) == ([1, 1], [2, 2])
    assert c.cond_counted == [2, 0] and math.isnan(c.cond_acc[1])


def test_specforge_counts_a_target_outside_the_draft_vocab_as_a_miss():
    # SpecForge `_compute_metric_counts`: denominator loss_mask.sum(); no draft id maps to the target id
    in_vocab = torch.tensor([True, True, True, True, False])
    c = score_steps(PREDS, TARGETS, MASK, RULES["specforge"], in_vocab=in_vocab)
    assert (c.correct, c.counted) == ([0, 0], [2, 2])


def test_trainer_version_chooses_the_token_feeding_rule():
    assert not rules_for("speculators@0.9").on_policy_tokens  # teacher forcing since v0.7.0
    assert rules_for("speculators@0.6.2").on_policy_tokens
    assert rules_for("speculators@0.3").verifier_norm is False  # v0.3.x: lm_head without the final norm
    assert (rules_for("speculators").default_ttt_steps, rules_for("specforge@0.2").default_ttt_steps) == (3, 7)


def test_unknown_trainer_is_refused_with_the_closest_name():
    with pytest.raises(ConfigError, match="did you mean 'specforge'"):
        rules_for("specforg@0.2")


@pytest.mark.parametrize("trainer", ["speculators@99.0", "speculators@0.10", "speculators@0.2", "specforge@0.3"])
def test_trainer_version_outside_the_covered_ranges_is_refused_naming_them(trainer):
    with pytest.raises(ConfigError) as e:
        rules_for(trainer, where="--trainer")
    assert str(e.value) == (
        f"--trainer: {trainer} is outside the trainer versions whose rules difftest has "
        f"(speculators 0.3 to 0.9.x, specforge 0.2.x); give a version in those ranges"
    )


@pytest.mark.parametrize(
    "trainer, fragment",
    [
        ("speculators@0.9junk", "cannot read a version from '0.9junk'"),
        ("speculators@", "'speculators@' has an empty version"),
    ],
)
def test_trainer_version_that_is_not_a_version_is_refused(trainer, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        rules_for(trainer)


@pytest.mark.parametrize(
    "trainer",
    [
        "speculators@0.3.0",
        "speculators@0.9.2",
        "speculators@v0.6.0rc1",
        "speculators@0.3.1.dev5+g12ab",
        "specforge@0.2.1",
    ],
)
def test_trainer_versions_inside_the_covered_ranges_are_scored(trainer):
    assert rules_for(trainer).name


def test_train_acc_refuses_an_uncovered_trainer_before_reading_anything(tmp_path, capsys):
    from difftest import cli

    code = cli.main(
        [
            "train-acc",
            "--data",
            str(tmp_path / "nowhere"),
            "--draft",
            "fixture:x",
            "--target",
            "fixture:y",
            "--trainer",
            "speculators@99.0",
        ]
    )
    err = capsys.readouterr().err
    assert code == 4 and "Traceback" not in err  # a bad option value: difftest.base.exit_codes.USAGE
    assert err.strip() == (
        "difftest train-acc: --trainer: speculators@99.0 is outside the trainer versions whose rules "
        "difftest has (speculators 0.3 to 0.9.x, specforge 0.2.x); give a version in those ranges"
    )


def _settings(**given):
    """The train engine's settings record with nothing set but `given`."""
    import dataclasses

    from difftest_engines.trainingdata.settings import Settings

    return Settings(**{f.name: given.get(f.name) for f in dataclasses.fields(Settings)})


def test_draft_config_speculators_version_outside_the_ranges_is_refused_naming_the_config(tmp_path):
    from types import SimpleNamespace

    from difftest_engines.trainingdata.engine import TrainingDataEngine

    (tmp_path / "config.json").write_text('{"speculators_version": "0.12.0"}')
    case = Case(name="c", path=str(tmp_path / "c.yaml"), target="fixture:t", draft=str(tmp_path))
    engine = TrainingDataEngine(EngineSpec("train"))
    with pytest.raises(ConfigError) as e:
        engine.rules(case, _settings(), SimpleNamespace(format="speculators"))
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: speculators_version: speculators@0.12.0 is outside")
    assert str(e.value).endswith("or choose the rules with train[trainer=...] (train-acc: --trainer)")
    assert (
        engine.rules(case, _settings(trainer="speculators@0.9"), SimpleNamespace(format="speculators"))[0].name
        == "speculators>=0.7"
    )


def test_counts_add_over_samples_micro_average():
    a = score_steps(PREDS, TARGETS, MASK, RULES["speculators"])
    total = StepCounts().add(a).add(a)
    assert total.counted == [6, 6] and total.samples == 2
    assert StepCounts.from_dict(total.to_dict()).full_acc == total.full_acc


def test_verifier_targets_are_argmax_over_the_draft_vocab_of_the_normed_verifier():
    lm_head = torch.eye(4)  # logits = norm(x) itself
    head = VerifierHead(lm_head, torch.ones(4), 1e-6)
    x = torch.tensor([[0.0, 3.0, 2.0, 1.0]])  # full-vocab argmax 1
    d2t = torch.tensor([0, 1])  # draft ids 0, 1 -> target ids 0, 2
    t, in_vocab = head.targets(x, d2t, RULES["speculators"])
    assert int(t[0]) == 1 and not bool(in_vocab[0])  # target id 2 is draft id 1; the true argmax (1) is outside
    # the norm only rescales a row here, so speculators' lm_head(norm(x)) and SpecForge's lm_head(x) agree
    assert torch.equal(head.targets(x, d2t, RULES["specforge"])[0], t)


# -- the train_accuracy check ---------------------------------------------------------------------


class _Captures:
    """What check_train_accuracy asks a case run for: the train engine's captures (trainer wiring and
    rewired as the engine under test) and that engine's capture naming its fc inputs."""

    def __init__(self, trained: list[float], rewired: list[float], case: Case):
        from types import SimpleNamespace

        self.case = case
        self.options = SimpleNamespace(engines=[EngineSpec("train")], reference=EngineSpec("ref"))
        acc = lambda full: {  # noqa: E731
            "rules": "speculators>=0.7",
            "wiring": ["target.h.2", "target.h.4", "target.h.5"],
            "full_acc": full,
            "cond_acc": full,
        }
        td = {
            "identification": {"summary": "dumped tensors = [h2, h4, h5, h8]; verifier = h8"},
            "path": "/data",
            "format": "speculators",
            "samples": 4,
            "skipped": 0,
        }
        self._meta = {
            "trained": {"extra": {"train_accuracy": acc(trained), "train_data": td}},
            "rewired": {"extra": {"train_accuracy": acc(rewired)}},
            "engine": {"wiring": {"inputs": ["target.h.2", "target.h.4", "target.h.5"]}},
        }

    def capture(self, spec, index):
        from types import SimpleNamespace

        from difftest.records import CaptureMeta

        key = "engine" if spec.name != "train" else ("rewired" if spec.param("wiring") else "trained")
        return SimpleNamespace(meta=CaptureMeta.from_dict(self._meta[key], "test"))


def _case(expect: dict | None = None) -> Case:
    return Case(
        name="c",
        path="/cases/c.yaml",
        target="t",
        draft="d",
        expect=Expectations(contributed={"train_accuracy": expect} if expect else {}),
    )


def test_train_accuracy_check_fails_naming_the_data_when_the_trainer_wiring_scores_near_zero():
    v = check_train_accuracy(_Captures([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], _case()), EngineSpec("vllm"))
    assert not v.passed  # 0 vs 0 is no evidence that the engine feeds the draft right
    assert v.message.startswith(
        "training accuracy under the trainer's own wiring is 0.000 (below expect.train_accuracy.min 0.05)"
    )
    assert "verifier tensor" in v.message and "train[trainer=...]" in v.message


def test_train_accuracy_check_passes_when_the_engine_wiring_keeps_the_trainers_accuracy():
    v = check_train_accuracy(_Captures([0.7, 0.5, 0.4], [0.69, 0.5, 0.4], _case()), EngineSpec("vllm"))
    assert v.passed, v.message


def _yaml_case(tmp_path, expect: str):
    for role in ("target", "draft"):
        (tmp_path / role).mkdir(exist_ok=True)
        (tmp_path / role / "config.json").write_text("{}")
    path = tmp_path / "c.yaml"
    path.write_text(f"target: target\ndraft: draft\nprompts: [{{ids: [1, 2]}}]\nexpect: {expect}\n")
    return path


def test_a_case_file_sets_the_keys_the_train_accuracy_check_declares(tmp_path):
    from difftest.case.case import load_case

    case = load_case(_yaml_case(tmp_path, "{train_accuracy: {atol: 0.1, min: 0.2}}"))
    assert case.expect.get("train_accuracy") == {"atol": 0.1, "min": 0.2}


def test_a_case_file_key_the_train_accuracy_check_does_not_declare_is_refused_naming_the_file(tmp_path):
    from difftest.case.case import load_case

    path = _yaml_case(tmp_path, "{train_accuracy: {minimum: 0.2}}")
    with pytest.raises(
        ConfigError, match=re.escape(f"{path}: expect.train_accuracy.minimum: unknown field; did you mean 'min'?")
    ):
        load_case(path)


def test_train_accuracy_check_refuses_an_unknown_expect_key():
    with pytest.raises(ConfigError, match="expect.train_accuracy.minimum: unknown key"):
        check_train_accuracy(_Captures([0.7], [0.7], _case({"minimum": 0.1})), EngineSpec("vllm"))


def test_train_acc_refuses_layer_ids_that_are_not_whole_numbers_in_one_line(tmp_path, capsys):
    from difftest import cli

    argv = ["train-acc", "--data", str(tmp_path), "--draft", str(tmp_path / "d"), "--target", str(tmp_path / "t")]
    with pytest.raises(SystemExit) as done:  # the parser's refusal: a bad option value
        cli.main([*argv, "--layer-ids", "2,x,7"])
    err = capsys.readouterr().err
    assert done.value.code == 4 and "Traceback" not in err and err.count("\n") == 1
    assert "--layer-ids: expected whole numbers separated by commas (e.g. 2,4,7), got '2,x,7'" in err


# -- attention over long samples: the draft config's sliding window --------------------------------------


def _layer_config(**layer) -> dict:
    """A speculators-format draft config; `layer` adds to its transformer_layer_config."""
    return {
        "speculators_model_type": "eagle3",
        "draft_vocab_size": 32,
        "norm_output": True,
        "transformer_layer_config": {
            "hidden_size": 16,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": 32,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            **layer,
        },
    }


def test_ttt_mask_with_a_window_keeps_the_last_w_step0_keys_and_every_steps_diagonal():
    from difftest_engines.trainingdata.train_accuracy import ttt_mask

    n, step, w = 7, 2, 3
    by_hand = torch.zeros(n, n * (step + 1), dtype=torch.bool)
    for q in range(n):
        for k in range(n):  # speculators create_combined_mask_mod: q >= kv and kv > q - window
            by_hand[q, k] = q - w < k <= q
        for s in range(1, step + 1):  # extend_*_mask_for_draft_tokens: the query's own origin, unwindowed
            by_hand[q, s * n + q] = True
    assert torch.equal(ttt_mask(n, step, window=w), by_hand)
    assert torch.equal(ttt_mask(n, step, window=n), ttt_mask(n, step))  # a window as long as the sample is causal


@pytest.mark.parametrize(
    "layer, window",
    [
        (
            {"sliding_window": 2048, "use_sliding_window": True, "layer_types": ["sliding_attention"]},
            2048,
        ),  # speculators train
        (
            {"sliding_window": 2048, "use_sliding_window": True, "layer_types": ["full_attention"]},
            None,
        ),  # --full-attention-indices 0
        (
            {"sliding_window": None, "layer_types": ["sliding_attention"]},
            None,
        ),  # speculators' mask_mod skips a None window
        (
            {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 28},
            None,
        ),  # no layer_types: not read
    ],
    ids=["sliding", "full-layer", "no-window", "qwen2-fields-only"],
)
def test_draft_config_window_is_read_from_layer_types_as_speculators_reads_it(layer, window, tmp_path):
    from difftest_engines.ref.eagle3 import parse_config

    assert parse_config(_layer_config(**layer), tmp_path / "config.json").sliding_window == window


@pytest.mark.parametrize(
    "layer, fragment",
    [
        (
            {"layer_types": ["chunked_attention"], "sliding_window": 8},
            "transformer_layer_config.layer_types[0] is 'chunked_attention'; the reference draft runs 'full_attention' or 'sliding_attention' only",
        ),
        (
            {"layer_types": ["sliding_attention"], "sliding_window": 0},
            "transformer_layer_config.sliding_window is 0 for a sliding_attention layer; expected a whole number of tokens >= 1",
        ),
        (
            {"layer_types": "sliding_attention", "sliding_window": 8},
            "transformer_layer_config.layer_types must be a list of strings, got 'sliding_attention'",
        ),
    ],
    ids=["unknown-type", "zero-window", "not-a-list"],
)
def test_draft_config_attention_the_reference_cannot_run_is_refused_in_one_line(layer, fragment, tmp_path):
    from difftest_engines.ref.eagle3 import parse_config

    with pytest.raises(ConfigError) as e:
        parse_config(_layer_config(**layer), tmp_path / "config.json")
    assert str(e.value) == f"{tmp_path / 'config.json'}: {fragment}"


def test_the_window_is_applied_only_under_rules_whose_trainer_applies_it(tmp_path):
    from difftest_engines.ref.eagle3 import parse_config
    from difftest_engines.trainingdata.train_accuracy import describe_attention, scoring_window

    cfg = parse_config(_layer_config(sliding_window=8, layer_types=["sliding_attention"]), tmp_path / "config.json")
    assert (
        scoring_window(cfg, rules_for("speculators@0.9")) == 8
        and scoring_window(cfg, rules_for("speculators@0.7.0")) == 8
    )
    assert scoring_window(cfg, rules_for("speculators@0.6")) is None  # 0.6.0's EAGLE-3 draft has no window
    assert scoring_window(cfg, rules_for("specforge@0.2")) is None  # SpecForge 0.2.0's draft never reads one
    assert describe_attention(cfg, rules_for("specforge")) == (
        "full causal (the draft config records a sliding window of 8, which specforge@0.2 does not apply)"
    )


def _random_draft(window: int | None):
    from difftest_engines.ref.eagle3 import Eagle3Config
    from difftest_engines.ref.draft_loading import build_draft

    cfg = Eagle3Config(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=32,
        draft_vocab_size=32,
        target_hidden_size=16,
        num_aux=3,
        norm_output=True,
        sliding_window=window,
    )
    torch.manual_seed(0)
    draft = build_draft(cfg)
    with torch.no_grad():  # sharper attention than the init's, so which keys are visible shows in the argmax
        draft.layer.self_attn.q_proj.weight.mul_(6.0)
        draft.layer.self_attn.k_proj.weight.mul_(6.0)
    return draft.double().eval()


def test_a_sample_longer_than_the_window_scores_each_origin_as_if_it_saw_only_its_window():
    """Origin q under window W sees base keys q-W+1..q: exactly what a windowless run on the slice of the
    sample starting at q-W+1 gives its origin W-1 (rotary attention depends on relative positions only)."""
    from difftest_engines.trainingdata.train_accuracy import unroll

    W, N, steps = 3, 16, 3
    g = torch.Generator().manual_seed(1)
    fc, ids = torch.randn(N, 48, generator=g, dtype=torch.float64), torch.randint(0, 32, (N,), generator=g)
    rules = RULES["speculators"]
    windowed = unroll(_random_draft(W), fc, ids, steps, rules)
    causal = _random_draft(None)
    full = unroll(causal, fc, ids, steps, rules)
    for q in range(W - 1, N - steps):  # origins whose steps all have a teacher-forced token in the slice
        a = q - W + 1
        sliced = unroll(causal, fc[a : q + steps + 1], ids[a : q + steps + 1], steps, rules)
        assert [int(p[q]) for p in windowed] == [int(p[W - 1]) for p in sliced], q
    assert any(not torch.equal(w[W:], f[W:]) for w, f in zip(windowed, full))  # the window changes predictions here
