"""run_target's capture naming, checked by value against HF's output_hidden_states.

Convention (difftest_engines/ref/target.py, shared/notes/wiring-failures.md): target.h.k is the
residual stream entering decoder layer k, so h.0 is the embedding output and h.L the
last layer's output *before* the final norm; HF's hidden_states[L] is after it and is
what run_target calls final_norm.
"""

from __future__ import annotations

import pytest
import torch

from difftest_engines.ref.target import load_target, num_layers, run_target

NUM_LAYERS = 4
VOCAB = 256


def _tiny_config(arch: str):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM, LlamaConfig(**common)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM, Qwen3Config(**common)


@pytest.fixture(scope="module", params=["llama", "qwen3"], ids=["llama", "qwen3"])
def target(request, tmp_path_factory):
    """A tiny seeded random target saved to disk and loaded back through load_target."""
    cls, config = _tiny_config(request.param)
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # a non-trivial final norm, so pre- and post-norm differ by more than a scale
        model.model.norm.weight.copy_(torch.rand(config.hidden_size) + 0.5)
    path = tmp_path_factory.mktemp(f"target-{request.param}")
    model.save_pretrained(path)
    return load_target(path)


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def captured(target, input_ids):
    return run_target(target, input_ids)


@pytest.fixture(scope="module")
def hf(target, input_ids):
    with torch.no_grad():
        return target(input_ids=input_ids, output_hidden_states=True, use_cache=False)


def test_capture_has_one_tensor_per_layer_boundary(target, captured, input_ids):
    assert num_layers(target) == NUM_LAYERS
    assert len(captured.hidden) == NUM_LAYERS + 1
    for h in captured.hidden:
        assert tuple(h.shape) == (*input_ids.shape, 64)


@pytest.mark.parametrize("k", range(NUM_LAYERS), ids=[f"h{k}" for k in range(NUM_LAYERS)])
def test_hidden_k_below_L_equals_hf_hidden_states_k(captured, hf, k):
    assert torch.equal(captured.hidden[k], hf.hidden_states[k])


def test_hidden_0_is_the_embedding_output(target, captured, input_ids):
    with torch.no_grad():
        assert torch.equal(captured.hidden[0], target.model.embed_tokens(input_ids))


def test_hidden_L_is_the_last_layer_output_before_the_final_norm(target, captured, input_ids):
    seen = {}
    handle = target.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: seen.setdefault("out", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            target(input_ids=input_ids, use_cache=False)
    finally:
        handle.remove()
    assert torch.equal(captured.hidden[NUM_LAYERS], seen["out"])


def test_hidden_L_is_pre_norm_and_differs_from_hf_hidden_states_L(captured, hf):
    assert not torch.allclose(captured.hidden[NUM_LAYERS], hf.hidden_states[NUM_LAYERS])


def test_final_norm_of_hidden_L_equals_hf_hidden_states_L(target, captured, hf):
    with torch.no_grad():
        assert torch.equal(target.model.norm(captured.hidden[NUM_LAYERS]), hf.hidden_states[NUM_LAYERS])


def test_final_norm_equals_hf_hidden_states_L(captured, hf):
    assert torch.equal(captured.final_norm, hf.hidden_states[NUM_LAYERS])


def test_logits_equal_hf_logits(captured, hf):
    assert torch.equal(captured.logits, hf.logits)
