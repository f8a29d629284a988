"""The draft's forward in SpecForge's own arithmetic (difftest_engines/trainingdata/trainer_forward.py) and SpecForge's
bf16 targets, pinned without the trainer: the same computation as the reference draft where SpecForge reads the
config alike (checked in float64, where no rounding order shows), its own reading of norm_output where it does
not, and the first-id tie break of bf16 target logits. Against SpecForge 0.2.0 itself, op for op in bf16:
tests/test_trainers_oracle.py and tests/test_specforge_writer_e2e.py."""

from __future__ import annotations

import json
from dataclasses import replace

import torch

from difftest_engines.trainingdata.train_accuracy import RULES, VerifierHead, unroll
from difftest_engines.trainingdata.trainer_forward import config_norm_output, specforge_unroll

N, STEPS = 12, 4
# SpecForge forms its rotary cos/sin table in float32 (LlamaRotaryEmbedding._set_cos_sin_cache) and the reference
# in the activations' width: in float64 the logits part by float32 roundoff of the angles (measured <= 5e-7 here);
# a norm or key in the wrong place moves them by 1e-2 or more
ANGLES = 1e-6


def _draft(norm_output: bool = False, fc_norm: bool = False):
    from difftest_engines.ref.draft_loading import build_draft
    from difftest_engines.ref.eagle3 import Eagle3Config

    cfg = Eagle3Config(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=40,
        draft_vocab_size=24,
        target_hidden_size=16,
        num_aux=3,
        fc_norm=fc_norm,
        norm_output=norm_output,
    )
    torch.manual_seed(3)
    draft = build_draft(cfg)
    with torch.no_grad():  # norms away from 1 and sharper attention: a misplaced norm or key shows in the logits
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand_like(p))
        draft.layer.self_attn.q_proj.weight.mul_(4.0)
        draft.layer.self_attn.k_proj.weight.mul_(4.0)
        draft.d2t.copy_(torch.arange(24) // 2)  # draft id d -> target id d + d // 2
    return draft.double().eval()


def _sample(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 48, generator=g, dtype=torch.float64), torch.randint(0, 40, (N,), generator=g)


def _reference_outputs(draft, fc, ids, steps: int) -> list:
    """The reference draft's outputs per step (DraftOutput: logits, hidden_prenorm), teacher-forced, positions
    from 0: SpecForge's alignment, through train_accuracy.unroll with the reference forward."""
    captured = []
    forward = draft.forward

    def keep(*a, **k):
        captured.append(forward(*a, **k))
        return captured[-1]

    draft.forward = keep  # nn.Module.__call__ calls the instance's forward
    try:
        unroll(draft, fc, ids, steps, replace(RULES["specforge"], draft_forward="reference"))
    finally:
        del draft.forward
    return captured


def _reference_logits(draft, fc, ids, steps: int) -> list[torch.Tensor]:
    return [out.logits[0] for out in _reference_outputs(draft, fc, ids, steps)]


def test_specforges_forward_is_the_reference_drafts_in_float64_where_both_read_the_config_alike():
    """norm_output absent in SpecForge (the final norm before lm_head, the pre-norm hidden onward) is the reference's
    norm_output false; fc_norm and the TTT attention (step-0 keys causal, one diagonal per later step, positions
    i + k) are read alike. In float64 the order of roundings does not show: the logits agree to the float32 rotary
    angles (ANGLES)."""
    for fc_norm in (False, True):
        draft = _draft(norm_output=False, fc_norm=fc_norm)
        fc, ids = _sample()
        _, theirs = specforge_unroll(draft, fc, ids, STEPS, logits_norm=True)
        ours = _reference_logits(draft, fc, ids, STEPS)
        for k in range(STEPS):
            valid = N - 1 - k  # origins whose step-k token is the data's (past the end both pad differently)
            assert torch.allclose(theirs[k][:valid], ours[k][:valid], atol=ANGLES, rtol=0), (fc_norm, k)


def test_specforges_norm_output_false_leaves_the_final_norm_out_of_the_logits():
    """SpecForge 0.2.0 compute_logits: lm_head(h) when the config says norm_output: false; the reference (as vLLM
    reads the flag) always norms before lm_head. Same weights, different logits from step 0."""
    draft = _draft(norm_output=False)
    fc, ids = _sample(1)
    _, plain = specforge_unroll(draft, fc, ids, STEPS, logits_norm=False)
    _, normed = specforge_unroll(draft, fc, ids, STEPS, logits_norm=True)
    ours = _reference_outputs(draft, fc, ids, STEPS)
    for k in range(STEPS):  # the pre-norm hidden feeds each next step either way: only the logits differ
        valid = N - 1 - k
        assert torch.allclose(normed[k][:valid], ours[k].logits[0, :valid], atol=ANGLES, rtol=0), k
        unnormed = draft.lm_head(ours[k].hidden_prenorm[0, :valid])
        assert torch.allclose(plain[k][:valid], unnormed, atol=ANGLES, rtol=0), k
    assert not torch.allclose(plain[0], normed[0], atol=1e-3)


def test_the_draft_configs_norm_output_is_read_as_written(tmp_path):
    for written, read in ((None, None), (False, False), (True, True)):
        cfg = {"hidden_size": 16} if written is None else {"hidden_size": 16, "norm_output": written}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert config_norm_output(tmp_path) is read, written


def test_an_absent_norm_output_is_specforges_default_true_under_its_rules():
    draft = _draft(norm_output=False)
    fc, ids = _sample(2)
    rules = RULES["specforge"]
    absent = unroll(draft, fc, ids, STEPS, rules, norm_output=None)
    true = unroll(draft, fc, ids, STEPS, rules, norm_output=True)
    false = unroll(draft, fc, ids, STEPS, rules, norm_output=False)
    assert all(torch.equal(a, t) for a, t in zip(absent, true))
    assert any(not torch.equal(a, f) for a, f in zip(absent, false))  # the reading shows on this draft


def test_specforge_targets_are_the_first_id_among_bf16_tied_logits():
    """TargetHead runs in bfloat16: two logits 1.0 and 1.0 + 2^-9 round to the same bf16 value, and
    target.float().argmax() takes the first. In float32 the second would win."""
    lm_head = torch.eye(4)
    head = VerifierHead(lm_head, torch.ones(4), 1e-6)
    x = torch.tensor([[0.0, 1.0, 1.0 + 2.0**-9, 0.5]])
    d2t = torch.zeros(4, dtype=torch.long)  # identity map: every target id is in the draft vocab
    t, in_vocab = head.targets(x, d2t, RULES["specforge"])
    assert int(t[0]) == 1 and bool(in_vocab[0])
    assert int(head.targets(x, d2t, replace(RULES["specforge"], target_logits_dtype=None))[0][0]) == 2


def test_specforge_targets_are_the_full_vocab_argmax_whatever_a_tie_among_the_draft_columns_gives():
    """SpecForge compares target ids: the target is the full-vocab argmax (first id on a tie), mapped to its
    draft id; an argmax over the draft's columns in draft order could pick the other tied id (d2t unsorted)."""
    lm_head = torch.eye(4)
    head = VerifierHead(lm_head, torch.ones(4), 1e-6)
    x = torch.tensor([[0.0, 2.0, 2.0, 0.0]])  # target ids 1 and 2 tie: the full-vocab argmax is 1
    d2t = torch.tensor([2, 0])  # draft id 0 -> target 2, draft id 1 -> target 1
    t, in_vocab = head.targets(x, d2t, RULES["specforge"])
    assert int(t[0]) == 1 and bool(in_vocab[0])  # draft id 1 = target id 1, not draft id 0 (target 2)


def test_only_a_llama_draft_is_run_in_specforges_arithmetic():
    """SpecForge 0.2.0's one EAGLE-3 draft class is Llama's (llama3_eagle.py::LlamaForCausalLMEagle3): an MLA draft
    keeps the reference forward under its rules (train-acc says so in a `draft forward:` line)."""
    from difftest_engines.ref.draft_loading import load_draft
    from difftest.run.case_run import resolve_fixture

    from difftest_engines.trainingdata.trainer_forward import is_llama_draft

    assert is_llama_draft(_draft())
    mla = load_draft(resolve_fixture("fixture:tiny-deepseek-v3-eagle3-mla")).model
    assert not is_llama_draft(mla)
