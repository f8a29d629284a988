"""Training accuracy against a hand-computed example, under both trainers' rules."""

from __future__ import annotations

import math

import pytest
import torch

from engines.trainingdata.train_accuracy import RULES, StepCounts, VerifierHead, score_steps

# N = 5 tokens; T_p = target draft id at p (T_0 is never a target); loss mask on positions 2..4.
TARGETS = torch.tensor([9, 1, 2, 3, 4])
MASK = torch.tensor([0, 0, 1, 1, 1], dtype=torch.bool)
# predictions at origins 0..3 for TTT steps 0 and 1
PREDS = [torch.tensor([1, 2, 0, 4]), torch.tensor([2, 0, 4, 7])]


def test_speculators_rules_by_hand():
    # step 0 (origin i vs T[i+1], mask[i+1]): i=0 masked; i=1 2==2 ok; i=2 0!=3; i=3 4==4 ok -> 2/3
    # step 1 (origin i vs T[i+2], mask[i+2]): i=0 2==2 ok; i=1 0!=3; i=2 4==4 ok; i=3 past the end -> 2/3
    # cond step 1: only origins right (and counted) at step 0 -> i=1 (wrong) -> 0/1; i=3 has no step-1 target
    c = score_steps(PREDS, TARGETS, MASK, RULES["speculators"])
    assert (c.correct, c.counted) == ([2, 2], [3, 3])
    assert (c.cond_correct, c.cond_counted) == ([2, 0], [3, 1])
    assert c.full_acc == pytest.approx([2 / 3, 2 / 3])
    assert c.cond_acc == pytest.approx([2 / 3, 0.0])


def test_specforge_rules_by_hand():
    # mask unshifted: step 0 counts origin i where mask[i]: i=2 (0!=3), i=3 (4==4) -> 1/2
    # step 1 counts mask[i+1]: i=1 (0!=3), i=2 (4==4) -> 1/2; cond: origin 3 has no step-1 target -> 0/0
    c = score_steps(PREDS, TARGETS, MASK, RULES["specforge"], in_vocab=torch.ones(5, dtype=torch.bool))
    assert (c.correct, c.counted) == ([1, 1], [2, 2])
    assert c.cond_counted == [2, 0] and math.isnan(c.cond_acc[1])
    # a target whose full-vocab argmax lies outside the draft vocab is not counted (SpecForge position_mask)
    in_vocab = torch.tensor([True, True, True, True, False])
    c = score_steps(PREDS, TARGETS, MASK, RULES["specforge"], in_vocab=in_vocab)
    assert (c.correct, c.counted) == ([0, 0], [1, 1])


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
