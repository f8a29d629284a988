"""The float64 noise-floor run streamed layer by layer (difftest_engines/ref/streamed.py) computes
what the whole float64 copy computes, bit for bit, while holding one decoder layer's weights (or
the output head's) in float64 at a time.

Families: Llama (tests/helpers.make_tiny_pair), DeepSeek-V3 with MoE routers and yarn rope
(tests/deepseek_helpers.make_deepseek_pair), Qwen3 with q/k norms and a tied head (built here);
each from a float32 checkpoint in a float32 case and a bfloat16 one (weights rounded first)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY_CASE, make_tiny_pair
from safetensors.torch import load_file, save_file

from difftest.case.case import load_case
from difftest.compare import noise
from difftest.run.case_run import calibration_case
from difftest.run.engine import parse_spec
from difftest_engines.ref.engine import RefEngine, rounded_through
from difftest_engines.ref.mapped import Mapped
from difftest_engines.ref.streamed import FileSource, StreamedTarget, streamable
from difftest_engines.ref.target import load_target, run_target

IDS = [1, 5, 9, 33, 77, 101, 7, 5, 0]
CASE_DTYPES = ("float32", "bfloat16")


def _qwen3_target(directory: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen3Config(
        vocab_size=384,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path | None]]:
    from deepseek_helpers import make_deepseek_pair

    root = tmp_path_factory.mktemp("streamed")
    return {
        "llama": make_tiny_pair(root / "llama", num_layers=4),
        "deepseek-v3": make_deepseek_pair(root / "deepseek", [1, 2, 3]),
        "qwen3-tied": (_qwen3_target(root / "qwen3"), None),
    }


def _whole(target: Path, weights_dtype: str | None) -> torch.nn.Module:
    return rounded_through(load_target(target, torch.float64), weights_dtype)


def _streamed(target: Path, case_dtype: str) -> StreamedTarget:
    weights = torch.bfloat16 if case_dtype == "bfloat16" else None
    return StreamedTarget(load_target(target, getattr(torch, case_dtype)), weights)


def _outputs(out) -> dict[str, torch.Tensor]:
    tensors = {f"h.{k}": h for k, h in enumerate(out.hidden)}
    tensors |= {"final_norm": out.final_norm, "logits": out.logits}
    for k, (scores, margin, experts) in (out.routers or {}).items():
        tensors |= {f"router.{k}.scores": scores, f"router.{k}.margin": margin, f"router.{k}.experts": experts}
    return tensors


@pytest.mark.parametrize("case_dtype", CASE_DTYPES)
@pytest.mark.parametrize("family", ["llama", "deepseek-v3", "qwen3-tied"])
def test_the_streamed_target_computes_every_tensor_of_the_whole_float64_target(pairs, family, case_dtype):
    target = pairs[family][0]
    whole = _outputs(run_target(_whole(target, "bfloat16" if case_dtype == "bfloat16" else None), torch.tensor([IDS])))
    streamed = _outputs(run_target(_streamed(target, case_dtype).model, torch.tensor([IDS])))
    assert streamed.keys() == whole.keys()
    if family == "deepseek-v3":
        assert any(n.startswith("router.") for n in whole)
    for name, t in whole.items():
        assert streamed[name].dtype == t.dtype, name
        assert torch.equal(streamed[name], t), name


@pytest.mark.parametrize("family", ["llama", "deepseek-v3", "qwen3-tied"])
def test_the_float64_weights_held_at_once_never_exceed_one_layer_or_the_head_plus_the_resident(pairs, family):
    stream = _streamed(pairs[family][0], "bfloat16")
    run_target(stream.model, torch.tensor([IDS]))
    assert 0 < stream.residency.peak <= stream.bound()
    assert stream.residency.live == stream.residency.resident  # every streamed weight dropped again
    # the reused float64 buffer holds the largest part (aligned), not the parts together
    assert stream.arena.size * 8 <= max([*stream.layer_bytes, stream.head_bytes]) + 64 * stream.arena.ALIGN * 8
    # structural, not timed: the bound is a fraction of the whole float64 copy (4 layers and more here)
    assert stream.bound() < stream.whole_bytes() / 2


def test_the_skeleton_holds_no_weights_between_forwards(pairs):
    stream = _streamed(pairs["llama"][0], "float32")
    run_target(stream.model, torch.tensor([IDS]))
    layer = stream.model.get_decoder().layers[0]
    assert all(p.device.type == "meta" for p in layer.parameters())
    assert stream.model.get_output_embeddings().weight.device.type == "meta"


def _case(root: Path, target: Path, draft: Path, dtype: str, tag: str):
    path = root / f"{tag}-{dtype}.yaml"
    path.write_text(TINY_CASE.format(target=target, draft=draft) + f"dtype: {dtype}\n")
    return calibration_case(load_case(str(path)))


class WholeFloat64(RefEngine):
    STREAM_FLOAT64 = False


def _captures_alike(engine, other, case) -> list:
    """(`engine`'s, `other`'s) captures of `case`'s prompts, each pair asserted bit-identical (tensors, next
    token, draft tokens)."""
    out = []
    for prompt in case.prompts:
        a, b = engine.capture(case, prompt.ids), other.capture(case, prompt.ids)
        assert a.tensors.keys() == b.tensors.keys()
        for name, t in b.tensors.items():
            assert torch.equal(a.tensors[name], t), name
        assert (a.meta.target_next_token, a.meta.draft_tokens) == (b.meta.target_next_token, b.meta.draft_tokens)
        out.append((a, b))
    return out


@pytest.mark.parametrize("case_dtype", CASE_DTYPES)
@pytest.mark.parametrize("family", ["llama", "deepseek-v3"])
def test_the_ref_engines_streamed_calibration_captures_what_the_whole_copy_captures(
    pairs, family, case_dtype, tmp_path
):
    target, draft = pairs[family]
    exact = _case(tmp_path, target, draft, case_dtype, family)
    for a, b in _captures_alike(RefEngine(parse_spec("ref")), WholeFloat64(parse_spec("ref")), exact):
        assert any(n.startswith(noise.STREAMED_FLOAT64) for n in a.meta.notes)
        assert not any(n.startswith(noise.STREAMED_FLOAT64) for n in b.meta.notes)


def _speculations(pairs, tmp_path, other: type) -> tuple:
    """The streamed reference's and `other`'s speculative runs of the bf16 Llama pair's case (3 steps, 8 tokens)."""
    target, draft = pairs["llama"]
    exact = _case(tmp_path, target, draft, "bfloat16", "llama")
    prompts = [p.ids for p in exact.prompts]
    return tuple(engine(parse_spec("ref")).speculate(exact, prompts, 3, 8) for engine in (RefEngine, other))


def test_the_ref_engines_streamed_speculation_accepts_what_the_whole_copy_accepts(pairs, tmp_path):
    a, b = _speculations(pairs, tmp_path, WholeFloat64)
    assert (a.num_verify, a.num_accepted, a.accepted_per_pos) == (b.num_verify, b.num_accepted, b.accepted_per_pos)
    assert a.source.endswith(noise.STREAMED_FLOAT64)


def test_the_streamed_run_shares_the_cases_own_model_instead_of_loading_another(pairs, tmp_path):
    target, draft = pairs["llama"]
    engine = RefEngine(parse_spec("ref"))
    path = tmp_path / "bf16.yaml"
    path.write_text(TINY_CASE.format(target=target, draft=draft) + "dtype: bfloat16\n")
    case = load_case(str(path))
    engine.capture(case, IDS)
    engine.capture(calibration_case(case), IDS)
    assert len(engine._targets) == 2  # the bfloat16 model and the float64 skeleton over it, no float64 copy
    assert [k[1] for k in engine._streams] == ["float64"]


def test_a_checkpoint_stored_in_float64_is_not_streamed_and_the_capture_says_why(pairs, tmp_path):
    target, draft = pairs["llama"]
    wide = tmp_path / "f64-target"
    wide.mkdir()
    for f in target.iterdir():
        (wide / f.name).write_bytes(f.read_bytes())
    for f in wide.glob("*.safetensors"):
        save_file({k: v.double() for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    assert "F64" in (streamable(wide) or "")
    exact = _case(tmp_path, wide, draft, "float32", "wide")
    cap = RefEngine(parse_spec("ref")).capture(exact, IDS)
    assert any(n.startswith("float64 run from a whole float64 copy: cannot stream") for n in cap.meta.notes)


def test_the_floor_source_says_streamed_when_the_float64_captures_were():
    note = f"{noise.STREAMED_FLOAT64} from the bfloat16 load"
    assert noise.measured_source("ref", "bfloat16", 2, [note]) == (
        f"measured: ref in bfloat16 vs float64 over 2 prompts ({noise.STREAMED_FLOAT64})"
    )


def test_the_floor_source_of_a_whole_float64_run_is_unchanged():
    assert noise.measured_source("ref", "float32", 2, ["ignored checkpoint tensors: x"]) == (
        "measured: ref in float32 vs float64 over 2 prompts"
    )


def test_the_float64_draft_beside_a_streamed_target_holds_no_embedding_table(pairs, tmp_path):
    target, draft = pairs["llama"]
    engine = RefEngine(parse_spec("ref"))
    exact = _case(tmp_path, target, draft, "bfloat16", "llama")
    engine.capture(exact, IDS)
    (f64,) = [d for k, d in engine._drafts.items() if k[2] == "float64"]
    assert f64.model.embed_tokens.weight.is_meta  # its rows are looked up from the draft checkpoint's file
    assert not WholeFloat64(parse_spec("ref"))._models(exact)[1].model.embed_tokens.weight.is_meta


@pytest.mark.parametrize("family", ["llama", "qwen3-tied"])
def test_a_head_streamed_in_vocabulary_chunks_moves_no_logit_beyond_float64_rounding(pairs, family):
    target = pairs[family][0]
    whole = _outputs(run_target(_whole(target, "bfloat16"), torch.tensor([IDS])))
    source = load_target(target, torch.bfloat16)
    stream = StreamedTarget(source, torch.bfloat16, head_rows=64)  # vocabulary 384 or more: 6+ chunks
    streamed = _outputs(run_target(stream.model, torch.tensor([IDS])))
    for name, t in whole.items():
        if name != "logits":
            assert torch.equal(streamed[name], t), name
    moved = (streamed["logits"] - whole["logits"]).abs().max() / whole["logits"].abs().max()
    assert moved <= 1e-14  # measured at most 2.1e-15 on 2048-wide heads (streamed.py)
    assert stream.head_bytes == 64 * source.config.hidden_size * 8
    assert stream.residency.live == stream.residency.resident


# -- the float64 run read from the checkpoint's files (FileSource), holding no load of the target ------
def _stored_as(source: Path | None, directory: Path, dtype: torch.dtype) -> Path | None:
    """A copy of checkpoint `source` with its floating-point tensors stored in `dtype`."""
    if source is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(str(f)).items()}
            save_file(tensors, str(directory / f.name), metadata={"format": "pt"})
        elif f.is_file():
            (directory / f.name).write_bytes(f.read_bytes())
    return directory


@pytest.fixture(scope="module")
def stored_pairs(pairs, tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Path | None]]:
    """Each family's pair stored in float32 (as built) and in bfloat16 (as real checkpoints ship)."""
    root = tmp_path_factory.mktemp("stored-bf16")
    out: dict[tuple[str, str], tuple[Path, Path | None]] = {}
    for family, (target, draft) in pairs.items():
        out[(family, "float32")] = (target, draft)
        bf16_target = _stored_as(target, root / family / "target", torch.bfloat16)
        assert bf16_target is not None
        out[(family, "bfloat16")] = (bf16_target, _stored_as(draft, root / family / "draft", torch.bfloat16))
    return out


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("case_dtype", CASE_DTYPES)
@pytest.mark.parametrize("family", ["llama", "deepseek-v3", "qwen3-tied"])
def test_the_float64_run_read_from_the_checkpoint_files_computes_what_the_run_from_a_loaded_source_computes(
    stored_pairs, family, case_dtype, stored
):
    target = stored_pairs[(family, stored)][0]
    weights = torch.bfloat16 if case_dtype == "bfloat16" else None
    loaded = _outputs(run_target(_streamed(target, case_dtype).model, torch.tensor([IDS])))
    stream = StreamedTarget.from_checkpoint(target, weights)
    from_files = _outputs(run_target(stream.model, torch.tensor([IDS])))
    assert isinstance(stream.source, FileSource)
    assert from_files.keys() == loaded.keys()
    for name, t in loaded.items():
        assert from_files[name].dtype == t.dtype, name
        assert torch.equal(from_files[name], t), name
    assert 0 < stream.residency.peak <= stream.bound()


def test_the_checkpoint_files_are_read_as_views_of_their_pages_not_copies(pairs):
    target = pairs["llama"][0]
    files = Mapped(target)
    (f,) = target.glob("*.safetensors")
    stored = load_file(str(f))
    norm = files.tensor("model.norm.weight")
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"):
        view = files.tensor(name)
        assert torch.equal(view, stored[name])
        # views lie in one mapping of the file, as far apart as their bytes in it: no buffer per tensor
        assert view.data_ptr() - norm.data_ptr() == files.offset(name) - files.offset("model.norm.weight")


class LoadedSource(RefEngine):
    STREAM_FROM_FILES = False  # today's streamed run: the weights read from the case's dtype loaded for it


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "deepseek-v3"])
def test_a_fresh_reference_calibrates_from_the_files_with_the_captures_of_the_run_from_a_loaded_source(
    stored_pairs, family, stored, tmp_path
):
    target, draft = stored_pairs[(family, stored)]
    assert draft is not None
    exact = _case(tmp_path, target, draft, "bfloat16", family)
    files, loaded = RefEngine(parse_spec("ref")), LoadedSource(parse_spec("ref"))
    for a, _ in _captures_alike(files, loaded, exact):
        assert any(n.startswith(noise.STREAMED_FLOAT64) and "safetensors files" in n for n in a.meta.notes)
    # the worker holds the float64 skeleton and the float64 draft only: no target or draft in bfloat16
    assert [k[1] for k in files._targets] == ["float64"] and [k[2] for k in files._drafts] == ["float64"]
    assert sorted(k[1] for k in loaded._targets) == ["bfloat16", "float64"]


def test_a_fresh_reference_speculates_from_the_files_as_from_a_loaded_source(pairs, tmp_path):
    a, b = _speculations(pairs, tmp_path, LoadedSource)
    assert (a.num_verify, a.num_accepted, a.accepted_per_pos, a.outputs) == (
        b.num_verify,
        b.num_accepted,
        b.accepted_per_pos,
        b.outputs,
    )


def test_a_draft_loaded_for_lookup_never_makes_its_embedding_table_in_float64(pairs):
    from difftest_engines.ref.draft_loading import load_draft

    draft = pairs["llama"][1]
    loaded = load_draft(draft, dtype=torch.float64, lookup_embedding=True)
    assert loaded.model.embed_tokens.weight.is_meta
    assert loaded.model.fc.weight.dtype == torch.float64 and not loaded.model.fc.weight.is_meta
