"""Runs in SpecForge's own environment (scripts/setup-engine specforge): its EAGLE-3 accuracy on the
cases tests/test_trainers_oracle.py writes. IN OUT: IN a torch file of cases, OUT json counts.

Per case: the feature file's fields (input_ids, loss_mask [N]; hidden_state [N, H] after the final
norm), the target lm_head [V, H] (both run in bf16, as its TargetHead runs), the draft vocab map
d2t / t2d, and the draft's logits per TTT step [steps, N-1, Vd] (origin N-1, never counted, gets
zeros). The rest is SpecForge 0.2.0's own path from `Eagle3Model.forward`:
`algorithms/eagle3/data.py::normalize_offline_sample` (max_len, last mask zeroed),
`modeling/target/target_head.py::TargetHead.preprocess` (the shift),
`algorithms/eagle3/model.py::_compute_target_p_padded`, `_compute_metric_counts` per step with
`utils.padding` moving the loss mask, as the TTT loop does.
"""

import json
import sys

import torch
from specforge.algorithms.eagle3.data import normalize_offline_sample
from specforge.algorithms.eagle3.model import _compute_metric_counts, _compute_target_p_padded
from specforge.modeling.target.target_head import TargetHead
from specforge.utils import padding

cases = torch.load(sys.argv[1], weights_only=True)
out = []
for c in cases:
    N = c["input_ids"].shape[0]
    raw = {
        "input_ids": c["input_ids"],
        "loss_mask": c["loss_mask"],
        "hidden_state": c["verifier"][None],
        "aux_hidden_state": torch.zeros(1, N, 1),
    }
    d = normalize_offline_sample(raw, max_len=int(c["max_len"]))
    with torch.no_grad():
        # TargetHead.forward: its fc, which TargetHead.from_pretrained casts to bfloat16 (target_head.py); the
        # stored hidden_state is bf16 as the writer's files hold it
        target = torch.nn.functional.linear(d["target"].bfloat16(), c["lm_head"].bfloat16())
    input_ids, target, loss_mask = TargetHead.preprocess(None, d["input_ids"], target, d["loss_mask"])
    steps = c["logits"].shape[0]
    _, _, target_ids_padded, _ = _compute_target_p_padded(target, c["t2d"], loss_mask, steps)
    n = target.shape[1]
    counts = {"correct": [], "denom": []}
    for k in range(steps):
        logits = torch.zeros(1, n, c["logits"].shape[-1])
        logits[0, : n - 1] = c["logits"][k][: n - 1].float()
        correct, denom = _compute_metric_counts(logits, target_ids_padded[:, k : k + n], loss_mask, c["d2t"])
        counts["correct"].append(float(correct))
        counts["denom"].append(float(denom))
        loss_mask = padding(loss_mask, left=False)
    out.append(counts)
json.dump(out, open(sys.argv[2], "w"))
