"""The built-in fixtures (difftest_fixtures/tiny_llama.py) are what the cases rely on: check it.

Quality figures are read from each draft's quality.json (written at build time) and, where
cheap, recomputed here on the same held-out sequences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from difftest.rules.wiring import resolve
from difftest_fixtures import cache, drafts, targets
from difftest_fixtures import tiny_llama as fx
from difftest.base.jsonfile import read_json
from difftest_engines.ref.draft_loading import load_draft
from difftest_engines.ref.target import load_target, run_target

REPO = Path(__file__).resolve().parents[1]
TRAINED = ["tiny-llama-eagle3", "tiny-llama-eagle3-miswired"]


@pytest.fixture(scope="session")
def paths() -> dict[str, Path]:
    return fx.ensure_fixtures()


@pytest.fixture(scope="session")
def target(paths):
    return load_target(paths["tiny-llama"])


@pytest.fixture(scope="session")
def heldout(target) -> torch.Tensor:
    return drafts.heldout_sequences(target)


def quality(paths, name: str) -> dict:
    return json.loads((paths[name] / "quality.json").read_text())


# -- quality of the trained drafts -----------------------------------------------------------


@pytest.mark.parametrize("name", TRAINED)
def test_quality_json_step0_agreement_is_at_least_0_6(paths, name):
    assert quality(paths, name)["step0_agreement"] >= 0.6


@pytest.mark.parametrize("name", TRAINED)
def test_quality_json_accept_length_with_4_draft_steps_is_at_least_2(paths, name):
    q = quality(paths, name)
    assert q["simulation"]["num_draft_steps"] == 4
    assert q["accept_length"] >= 2.0


@pytest.mark.parametrize("name", TRAINED)
def test_step0_agreement_recomputed_on_heldout_matches_quality_json(paths, target, heldout, name):
    from difftest_engines.ref.train import prepare_data, step0_agreement

    q = quality(paths, name)
    draft = load_draft(paths[name]).model
    agreement = step0_agreement(draft, prepare_data(target, q["train_wiring"], heldout))
    assert agreement >= 0.6
    assert agreement == pytest.approx(q["step0_agreement"], abs=0.01)


def test_speculators_copy_reports_the_eagle_drafts_figures_and_scores_them(paths, target, heldout):
    from difftest_engines.ref.train import prepare_data, step0_agreement

    eagle, spec = quality(paths, "tiny-llama-eagle3"), quality(paths, "tiny-llama-eagle3-speculators")
    assert (spec["format"], spec["same_weights_as"]) == ("speculators", "tiny-llama-eagle3")
    assert (spec["step0_agreement"], spec["accept_length"]) == (eagle["step0_agreement"], eagle["accept_length"])
    # the figures are the copy's own: the speculators checkpoint, loaded as that format, scores them
    draft = load_draft(paths["tiny-llama-eagle3-speculators"]).model
    agreement = step0_agreement(draft, prepare_data(target, eagle["train_wiring"], heldout))
    assert agreement == pytest.approx(spec["step0_agreement"], abs=0.01)


# -- the miswired draft: the seed's bug ---------------------------------------------------------


def test_miswired_draft_collapses_when_served_with_its_config_layer_ids(paths):
    q = quality(paths, "tiny-llama-eagle3-miswired")
    served = q["served_with_config_ids"]
    assert served["wiring"] == ["target.h.2", "target.h.4", "target.h.7"]
    assert served["accept_length"] < 1.3
    assert q["accept_length"] >= 2.0  # the same draft under its training wiring


def test_miswired_draft_agreement_recomputed_under_serving_wiring_collapses(paths, target, heldout):
    from difftest_engines.ref.train import prepare_data, step0_agreement

    draft = load_draft(paths["tiny-llama-eagle3-miswired"]).model
    assert step0_agreement(draft, prepare_data(target, fx.MISWIRED_SERVED_WIRING, heldout)) < 0.2


def test_miswired_draft_config_ids_read_by_vllm_give_the_serving_wiring(paths):
    cfg = load_draft(paths["tiny-llama-eagle3-miswired"]).config
    assert list(resolve("vllm", 8, cfg.layer_ids).inputs) == fx.MISWIRED_SERVED_WIRING


def test_miswired_training_wiring_is_speculators_launch_ids_0_2_4_7():
    wiring = resolve("speculators-launch", 8, [0, 2, 4, 7])
    assert (list(wiring.inputs), wiring.verifier) == (fx.MISWIRED_TRAIN_WIRING, "target.h.7")


def test_good_draft_config_ids_read_by_vllm_give_its_training_wiring(paths):
    cfg = load_draft(paths["tiny-llama-eagle3"]).config
    assert list(resolve("vllm", 8, cfg.layer_ids).inputs) == fx.GOOD_WIRING == list(resolve("vllm", 8, None).inputs)


def test_good_draft_collapses_under_sglangs_off_by_one(paths):
    served = quality(paths, "tiny-llama-eagle3")["served_off_by_one"]
    assert (
        served["wiring"] == list(resolve("sglang", 8, fx.GOOD_IDS).inputs) == ["target.h.3", "target.h.5", "target.h.6"]
    )
    assert served["accept_length"] < 1.3


# -- checkpoint formats ---------------------------------------------------------------------------


def test_eagle_and_speculators_formats_load_to_identical_logits(paths):
    eagle = load_draft(paths["tiny-llama-eagle3"])
    spec = load_draft(paths["tiny-llama-eagle3-speculators"])
    assert (eagle.config.format, spec.config.format) == ("eagle", "speculators")
    g = torch.Generator().manual_seed(0)
    fc_in = torch.randn(2, 9, 3 * targets.HIDDEN, generator=g)
    ids = torch.randint(0, targets.VOCAB, (2, 9), generator=g)
    positions = torch.arange(9)[None, :].expand(2, 9)
    with torch.no_grad():
        a = eagle.model(ids, eagle.model.combine(fc_in), positions)
        b = spec.model(ids, spec.model.combine(fc_in), positions)
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(eagle.model.d2t, spec.model.d2t)


def test_speculators_config_states_every_norm_flag_and_the_verifier(paths):
    raw = read_json(paths["tiny-llama-eagle3-speculators"] / "config.json")
    assert raw["speculators_model_type"] == "eagle3"
    assert raw["architectures"] == ["Eagle3Speculator"]
    assert {k: raw[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == dict.fromkeys(
        ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), False
    )
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert raw["speculators_config"]["verifier"] == {
        "name_or_path": "tiny-llama",
        "architectures": ["LlamaForCausalLM"],
    }
    assert raw["speculators_config"]["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4}]


@pytest.mark.parametrize(("name", "ids"), [("tiny-llama-eagle3", [2, 4, 5]), ("tiny-llama-eagle3-miswired", [2, 4, 7])])
def test_eagle_config_has_layer_ids_top_level_and_in_eagle_config(paths, name, ids):
    raw = read_json(paths[name] / "config.json")
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["eagle_aux_hidden_state_layer_ids"] == ids
    assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    assert raw["norm_before_residual"] is False


@pytest.mark.parametrize("name", ["tiny-llama-eagle3", "tiny-llama-eagle3-speculators", "tiny-llama-eagle3-miswired"])
def test_draft_checkpoint_vocab_maps_agree(paths, name):
    from safetensors.torch import load_file

    weights = load_file(str(paths[name] / "model.safetensors"))
    d2t, t2d = weights["d2t"], weights["t2d"]
    assert (d2t.dtype, tuple(d2t.shape), t2d.dtype, tuple(t2d.shape)) == (torch.int64, (512,), torch.bool, (1024,))
    targets = torch.arange(512) + d2t
    assert int(t2d.sum()) == 512 and bool(t2d[targets].all())
    assert torch.equal(targets, targets.sort().values)


# -- targets ----------------------------------------------------------------------------------------


def test_target_weights_are_rebuilt_bit_identically(paths):
    from safetensors.torch import load_file

    saved = load_file(str(paths["tiny-llama"] / "model.safetensors"))
    rebuilt = targets.build_llama_target().state_dict()
    assert sorted(saved) == sorted(rebuilt)
    assert [k for k in saved if not torch.equal(saved[k], rebuilt[k])] == []


def test_target_greedy_token_depends_on_the_previous_token(target, heldout):
    assert drafts.context_dependence(target, heldout) >= 0.5


def test_target_tokenizer_loads_offline_with_autotokenizer(paths):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["tiny-llama"], local_files_only=True)
    words = targets.make_words(3)
    ids = tok(" ".join(words)).input_ids
    assert (len(tok), ids, tok.decode(ids)) == (1024, [4, 5, 6], " ".join(words))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)


def test_qwen3_fixture_exposes_every_residual_stream_with_the_last_before_the_norm(paths):
    model = load_target(paths["tiny-qwen3"])
    assert type(model).__name__ == "Qwen3ForCausalLM"
    ids = torch.tensor([[5, 9, 33, 100]])
    out = run_target(model, ids)
    assert len(out.hidden) == targets.QWEN3_LAYERS + 1
    with torch.no_grad():  # HF's own reading: its last hidden state is after the final norm
        hf = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    assert len(hf) == targets.QWEN3_LAYERS + 1
    torch.testing.assert_close(out.final_norm, hf[-1], rtol=0, atol=0)
    for k in range(targets.QWEN3_LAYERS):  # h.k enters layer k, as HF's hidden_states[k]
        torch.testing.assert_close(out.hidden[k], hf[k], rtol=0, atol=0)
    assert not torch.allclose(out.hidden[-1], hf[-1])  # h.L is the last layer's output before the norm


# -- cache mechanics ----------------------------------------------------------------------------------


def test_fixture_path_rejects_an_unknown_name():
    with pytest.raises(KeyError, match="unknown fixture 'tiny-gpt'"):
        fx.fixture_path("tiny-gpt")


def test_provider_resolves_only_its_own_names(paths):
    assert fx.resolve_fixture("tiny-llama-train-data") is None
    assert fx.resolve_fixture("tiny-llama-eagle3") == paths["tiny-llama-eagle3"]


def test_concurrent_builds_build_once_and_leave_no_temporary_directories(tmp_path):
    code = (
        "from difftest_fixtures.tiny_llama import ensure_fixtures; print(ensure_fixtures(['tiny-qwen3'])['tiny-qwen3'])"
    )
    env = {**os.environ, "DIFFTEST_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    built = tmp_path / "fixtures" / cache.FIXTURES_VERSION / "tiny-qwen3"
    assert sum(o.count("[fixtures] building tiny-qwen3") for o in outputs) == 1
    assert [o.strip().splitlines()[-1] for o in outputs] == [str(built)] * 2
    assert sorted(p.name for p in built.parent.iterdir()) == [".locks", "tiny-qwen3"]
    assert (built / "model.safetensors").exists() and (built / "tokenizer.json").exists()
