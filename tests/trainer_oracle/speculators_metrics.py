"""Runs in speculators' own environment (scripts/setup-engine speculators): its EAGLE-3 metrics on
the cases tests/test_trainers_oracle.py writes. IN OUT: IN a torch file of cases, OUT json counts.

Per case: the dataset sample (loss_mask [N]), the verifier tensor v [N, H] with the target's
lm_head rows of the draft vocab and final-norm weight, and the draft's logits per TTT step
[steps, N-1, Vd]. Everything the trainer does after its draft forward runs here through
speculators 0.9.0 itself: `models/eagle3/data.py::shift_batch` (the dataset shift), the
verifier norm class its Llama model definitions use, `models/eagle3/metrics.py::compute_metrics`
(align_for_step + models/metrics.py::compute_accuracy_single_step, prev_correct in place)
and its eager kl_div loss (the default loss is a Triton kernel).
"""

import json
import sys

import torch
from speculators.losses.eager import kl_div_loss
from speculators.models.eagle3.data import shift_batch
from speculators.models.eagle3.metrics import compute_metrics
from transformers.models.llama.modeling_llama import LlamaRMSNorm

cases = torch.load(sys.argv[1], weights_only=True)
out = []
for c in cases:
    N, H = c["verifier"].shape
    norm = LlamaRMSNorm(H, eps=float(c["eps"]))
    norm.weight.data.copy_(c["norm_weight"])
    batch = {
        "input_ids": c["input_ids"],
        "hidden_states": torch.zeros(N, 1),
        "verifier_last_hidden_states": c["verifier"],
        "loss_mask": c["loss_mask"],
        "lengths": torch.tensor([N]),
        "position_ids": torch.arange(N),
    }
    b = shift_batch(batch)
    with torch.no_grad():
        targets = torch.nn.functional.linear(
            norm(b["verifier_last_hidden_states"].float()), c["lm_head_draft_rows"].float()
        )[None]
    loss_mask = b["loss_mask"][None].bool()
    prev_correct = loss_mask.clone()  # Eagle3DraftModel.forward: prev_correct = loss_mask.clone()
    counts = {}
    for k in range(c["logits"].shape[0]):
        _, m = compute_metrics(
            c["logits"][k][None].float(), targets, loss_mask, prev_correct, k, 1.0, {"kl_div": (kl_div_loss, 1.0)}
        )
        for name in ("full_acc", "cond_acc"):
            for part in ("sum", "total"):
                counts.setdefault(f"{name}_{part}", []).append(float(m[f"{name}_{k}_{part}"]))
    out.append(counts)
json.dump(out, open(sys.argv[2], "w"))
