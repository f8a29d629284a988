"""The real-shape fixtures (difftest_fixtures/real_shapes.py): the published configs, as transformers reads them, with
the published parameter counts; their drafts' shapes; the streamed writer; and the 1B pair built and run.

Only the 1B pair is built here (2.5 GB + 0.8 GB of bfloat16, about half a minute, cached after); the 8B,
Qwen3-8B and Kimi-width targets are checked on the meta device alone."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from difftest_fixtures import real_shapes as rs

# the published models' parameter counts (transformers on the meta device agrees: the test below)
PUBLISHED_PARAMETERS = {
    rs.LLAMA_1B: 1_235_814_400,  # Llama-3.2-1B: "1.24B", embedding tied
    rs.LLAMA_8B: 8_030_261_248,  # Llama-3.1-8B: "8.03B"
    rs.QWEN3_8B: 8_190_735_360,  # Qwen3-8B: "8.2B"
}
WIDTHS = {rs.LLAMA_1B: 2048, rs.LLAMA_8B: 4096, rs.QWEN3_8B: 4096, rs.KIMI: 7168}
DEFAULT_IDS = {rs.LLAMA_1B: [2, 8, 13], rs.LLAMA_8B: [2, 16, 29], rs.QWEN3_8B: [2, 18, 33], rs.KIMI: [0, 1, 2]}


def _auto_config(tmp_path, config: dict):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(config))
    return AutoConfig.from_pretrained(tmp_path, local_files_only=True)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_a_real_shape_target_has_its_published_parameter_count_on_meta(name):
    model = rs.meta_model(rs.SHAPES[name].config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]


@pytest.mark.parametrize("name", sorted(rs.SHAPES))
def test_the_checkpoint_layout_holds_every_tensor_transformers_builds_from_the_config(name):
    config = rs.SHAPES[name].config
    model = rs.meta_model(config)
    # named_parameters lists a tied head once, as the checkpoint stores it; of the buffers, the persistent
    # ones (DeepSeek's router correction bias), not the rope's inv_freq
    held = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    expected = sum(t.numel() for n, t in held.items() if n in model.state_dict())
    assert sum(e.numel for e in rs.target_entries(config)) == expected


@pytest.mark.parametrize("name", sorted(rs.SHAPES))
def test_a_real_shape_config_loads_with_autoconfig_as_published(tmp_path, name):
    config = rs.SHAPES[name].config
    cfg = _auto_config(tmp_path, config)
    assert cfg.model_type == config["model_type"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["vocab_size"],
    )
    assert cfg.num_key_value_heads == config["num_key_value_heads"]
    assert bool(cfg.tie_word_embeddings) == config["tie_word_embeddings"]


@pytest.mark.parametrize(
    "name, rope",
    [
        (rs.LLAMA_1B, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
        (rs.LLAMA_8B, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
        (rs.KIMI, {"rope_type": "yarn", "factor": 64.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale_all_dim": 1.0}),
    ],
)
def test_transformers_reads_the_published_rope_scaling(tmp_path, name, rope):
    params = _auto_config(tmp_path, rs.SHAPES[name].config).rope_parameters
    assert {k: params[k] for k in rope} == rope
    assert params["rope_theta"] == rs.SHAPES[name].config["rope_theta"]


def test_the_kimi_width_target_is_three_layers_dense_first_then_16_experts_top_8():
    model = rs.meta_model(rs.KIMI_CONFIG)
    layers = model.model.layers
    attn = layers[0].self_attn
    assert len(layers) == 3
    assert not hasattr(layers[0].mlp, "experts") and layers[0].mlp.gate_proj.weight.shape == (18432, 7168)
    for layer in layers[1:]:
        assert layer.mlp.experts.gate_up_proj.shape == (16, 2 * 2048, 7168)
        assert layer.mlp.shared_experts.gate_proj.weight.shape == (2048, 7168)
    assert model.config.num_experts_per_tok == 8
    assert attn.q_a_proj.weight.shape == (1536, 7168) and attn.q_b_proj.weight.shape == (64 * (128 + 64), 1536)
    assert attn.kv_a_proj_with_mqa.weight.shape == (512 + 64, 7168)
    assert attn.kv_b_proj.weight.shape == (64 * (128 + 128), 512)
    assert model.lm_head.weight.shape == (163840, 7168)


def test_the_kimi_width_checkpoint_stores_experts_one_by_one_as_published_checkpoints_do():
    names = {e.name for e in rs.target_entries(rs.KIMI_CONFIG)}
    assert "model.layers.1.mlp.experts.15.gate_proj.weight" in names
    assert "model.layers.2.mlp.experts.0.down_proj.weight" in names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)


def test_a_tied_target_stores_no_lm_head_and_an_untied_one_does():
    assert "lm_head.weight" not in {e.name for e in rs.target_entries(rs.LLAMA_1B_CONFIG)}
    assert "lm_head.weight" in {e.name for e in rs.target_entries(rs.LLAMA_8B_CONFIG)}


@pytest.mark.parametrize("name", sorted(rs.SHAPES))
def test_a_draft_has_fc_three_target_widths_wide_and_a_32000_token_d2t(name):
    shapes = {e.name: e.shape for e in rs.draft_entries(rs.SHAPES[name])}
    width, vocab = WIDTHS[name], rs.SHAPES[name].config["vocab_size"]
    assert shapes["fc.weight"] == (width, 3 * width)
    assert shapes["d2t"] == (32000,) and shapes["lm_head.weight"] == (32000, width)
    assert shapes["t2d"] == (vocab,) and shapes["embed_tokens.weight"] == (vocab, width)


@pytest.mark.parametrize("name", sorted(rs.SHAPES))
def test_a_draft_config_declares_the_default_wiring_ids_and_parses_as_the_reference_reads_it(tmp_path, name):
    from difftest_engines.ref.eagle3 import parse_config

    config = rs.draft_config(rs.SHAPES[name])
    cfg = parse_config(config, tmp_path / "config.json")
    assert cfg.layer_ids_top == cfg.layer_ids_eagle_config == DEFAULT_IDS[name]
    assert (cfg.hidden_size, cfg.target_hidden_size, cfg.num_aux) == (WIDTHS[name],) * 2 + (3,)
    assert cfg.draft_vocab_size == 32000 and cfg.vocab_size == rs.SHAPES[name].config["vocab_size"]


def test_the_draft_vocabulary_maps_into_the_target_vocabulary_through_d2t():
    entries = {e.name: e for e in rs.draft_entries(rs.SHAPES[rs.LLAMA_1B])}
    d2t, t2d = entries["d2t"].value, entries["t2d"].value
    targets = torch.arange(32000) + d2t
    assert bool((targets[1:] > targets[:-1]).all()) and int(targets[-1]) < 128256
    assert torch.equal(t2d.nonzero().flatten(), targets)


def test_the_streamed_writer_makes_a_file_safetensors_reads_back_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(rs, "CHUNK_ELEMENTS", 8)  # several chunks per tensor
    given = torch.tensor([3, -1, 7], dtype=torch.int64)
    entries = [
        rs.Entry("a.weight", (5, 4)),
        rs.Entry("b.norm.weight", (6,), fill="ones"),
        rs.Entry("c.bias", (2, 3), torch.float32, "zeros"),
        rs.Entry("d", (3,), torch.int64, "given", value=given),
        rs.Entry("e", (4,), torch.bool, "given", value=torch.tensor([True, False, False, True])),
        rs.Entry("f.weight", (5, 4), seed_name="a.weight"),
    ]
    rs.write_safetensors(tmp_path / "x.safetensors", entries, "key")
    out = load_file(str(tmp_path / "x.safetensors"))
    assert {k: (tuple(v.shape), v.dtype) for k, v in out.items()} == {e.name: (e.shape, e.dtype) for e in entries}
    assert out["a.weight"].float().std() > 0 and torch.equal(out["f.weight"], out["a.weight"])
    assert torch.equal(out["b.norm.weight"], torch.ones(6, dtype=torch.bfloat16))
    assert torch.equal(out["c.bias"], torch.zeros(2, 3)) and torch.equal(out["d"], given)


def test_the_provider_lists_no_names_so_difftest_fixtures_builds_none_of_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path))
    assert not hasattr(rs, "NAMES")  # `difftest fixtures` queues every name a provider's NAMES lists
    rs.build_all()
    assert not any(tmp_path.rglob("*.safetensors"))
    assert "build on demand" in capsys.readouterr().err


def test_the_command_line_refuses_to_build_every_shape_at_once(capsys):
    assert rs.main([]) == 2
    assert "name the fixtures to build" in capsys.readouterr().err


def test_an_unknown_fixture_name_is_not_ours():
    assert rs.resolve_fixture("llama-3.2-1b") is None


# -- the one real-shape pair the suite builds ---------------------------------------------------------------

_BUILD = (
    "import resource, sys; from difftest_fixtures import real_shapes as rs; "
    "rs.ensure_fixtures(sys.argv[1:], log=lambda m: None); "
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
)


@pytest.fixture(scope="module")
def llama_1b():
    """The 1B target and draft, built (once, cached) in a child process whose peak RSS it reports."""
    names = [rs.LLAMA_1B, rs.SHAPES[rs.LLAMA_1B].draft]
    t0 = time.time()
    done = subprocess.run([sys.executable, "-c", _BUILD, *names], capture_output=True, text=True, check=True)
    # reported, not asserted (no timed assertions): a cached pair takes a second
    print(
        f"\n[real shapes] {' + '.join(names)}: {time.time() - t0:.1f}s, "
        f"peak RSS {int(done.stdout.split()[-1]) / 1024:.0f} MiB"
    )
    return [rs.cache.fixtures_dir() / n for n in names]


def test_the_1b_fixture_files_hold_what_the_layouts_declare(llama_1b):
    target, draft = llama_1b
    for path, entries in (
        (target, rs.target_entries(rs.LLAMA_1B_CONFIG)),
        (draft, rs.draft_entries(rs.SHAPES[rs.LLAMA_1B])),
    ):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            stored = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
        assert stored == {e.name: (e.shape, rs._DTYPES[e.dtype]) for e in entries}
    assert json.loads((target / "config.json").read_text()) == rs.LLAMA_1B_CONFIG


def test_the_1b_draft_embedding_is_its_targets(llama_1b):
    target, draft = llama_1b
    with (
        safe_open(str(target / "model.safetensors"), "pt") as t,
        safe_open(str(draft / "model.safetensors"), "pt") as d,
    ):
        assert torch.equal(t.get_tensor("model.embed_tokens.weight"), d.get_tensor("embed_tokens.weight"))


def test_the_reference_target_runs_a_forward_on_the_1b_fixture(llama_1b):
    from difftest_engines.ref.target import load_target, run_target

    model = load_target(llama_1b[0], dtype=torch.bfloat16)
    out = run_target(model, torch.tensor([[128000, 791, 6864, 315, 9822, 374]]))
    assert out.logits.shape == (1, 6, 128256)
    assert bool(torch.isfinite(out.logits).all()) and float(out.logits.float().std()) > 0


def test_the_reference_loads_the_1b_draft_with_its_fc_and_d2t(llama_1b):
    from difftest_engines.ref.draft_loading import load_draft

    model = load_draft(llama_1b[1], dtype=torch.bfloat16).model
    assert model.cfg.layer_ids == [2, 8, 13] and model.cfg.rope.rope_type == "llama3"
    assert model.d2t.shape == (32000,)
    assert tuple(model.fc.weight.shape) == (2048, 3 * 2048)
