"""Runs in speculators' own environment: builds a speculators EAGLE-3 draft for a verifier and scores
it on training data with speculators' own training forward. TARGET DATA DRAFT_OUT OUT STEPS VD IDS [MAX_LENS [WINDOW]]

The draft: `Eagle3DraftModel.from_training_args` (what `speculators train` builds; sdpa attention,
draft vocab = target ids 0..VD-1, fc ids IDS, sliding window WINDOW on its layer, default 2048 as
`speculators train`'s), seeded random weights (the window takes none: the same seed gives the same
weights for any window), saved with save_pretrained.
The data: DATA holds hidden_states/hs_{i}.safetensors and samples.jsonl (difftest dump); the
dataset part is saved as the arrow dataset `prepare-data` writes. Each sample then goes through
the trainer's own path: `ArrowDataset` -> `CollateFn(preprocess=shift_batch)` -> the model's
training forward, whose metrics (full_acc_k / cond_acc_k sums and totals) are added up into OUT.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from hs_connectors.transfer import FileTransfer
from speculators.losses.eager import kl_div_loss
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.models.eagle3.data import shift_batch
from speculators.train.cli import create_transformer_layer_config
from speculators.train.data import ArrowDataset, CollateFn
from transformers import AutoConfig

target, data, draft_out, out = sys.argv[1:5]
steps, vd, ids = int(sys.argv[5]), int(sys.argv[6]), [int(x) for x in sys.argv[7].split(",")]
max_lens = [int(x) for x in sys.argv[8].split(",") if x] if len(sys.argv) > 8 else []  # also score truncated to these
window = int(sys.argv[9]) if len(sys.argv) > 9 else 2048
vcfg = AutoConfig.from_pretrained(target)
# `speculators train` defaults for eagle3 (train/config/schema.py): one llama layer, silu, sliding
# window 2048 on every layer (here WINDOW), norm_output on
layer_cfg = create_transformer_layer_config(
    verifier_name_or_path=target,
    num_layers=1,
    draft_arch="llama",
    hidden_act="silu",
    sliding_window=window,
    full_attention_indices=[],
)
t2d = torch.zeros(vcfg.vocab_size, dtype=torch.bool)
t2d[:vd] = True
d2t = torch.zeros(vd, dtype=torch.long)
torch.manual_seed(0)
model = Eagle3DraftModel.from_training_args(
    layer_cfg,
    t2d=t2d,
    d2t=d2t,
    num_layers=1,
    norm_before_residual=False,
    norm_output=True,
    draft_vocab_size=vd,
    ttt_steps=steps,
    verifier_name_or_path=target,
    target_layer_ids=ids,
    draft_attn_impl="sdpa",
)
with torch.no_grad():  # livelier than the init's small weights, so predictions spread over the draft vocab
    for _name, p in model.named_parameters():
        if p.requires_grad and p.dim() == 2:
            p.mul_(8.0)
model.eval()
model.save_pretrained(draft_out)

rows = [json.loads(x) for x in (Path(data) / "samples.jsonl").read_text().splitlines() if x.strip()]
tmp = Path(tempfile.mkdtemp())
ds = Dataset.from_dict(
    {
        "input_ids": [r["input_ids"] for r in rows],
        "loss_mask": [r["loss_mask"] for r in rows],
        "seq_len": [len(r["input_ids"]) for r in rows],
    }
)
ds.set_format(type="torch")
ds.save_to_disk(str(tmp / "ds"))
reader = ArrowDataset(
    max_len=4096,
    datapath=str(tmp / "ds"),
    transfer=FileTransfer(Path(data) / "hidden_states"),
    on_missing="raise",
    hidden_states_dtype=torch.float32,
)
H = vcfg.hidden_size


def score(max_len):
    """One sample per batch, as difftest scores it; CollateFn truncates the shifted sample to max_len."""
    totals = {}
    for i in range(len(reader)):
        item = reader[i]
        n = int(item["input_ids"].shape[0]) - 1
        collate = CollateFn(
            max_len=min(n, max_len or n),
            hidden_size=H,
            num_target_layers=len(ids),
            dtype=torch.float32,
            preprocess=shift_batch,
        )
        batch = collate([item])
        keys = (
            "hidden_states",
            "input_ids",
            "document_ids",
            "loss_mask",
            "position_ids",
            "verifier_last_hidden_states",
        )
        with torch.no_grad():
            _, _, metrics = model(
                **{k: batch[k] for k in keys}, ttt_steps=steps, loss_config={"kl_div": (kl_div_loss, 1.0)}
            )
        for k in range(steps):
            for name in ("full_acc", "cond_acc"):
                for part in ("sum", "total"):
                    key = f"{name}_{part}"
                    totals.setdefault(key, [0.0] * steps)[k] += float(metrics[f"{name}_{k}_{part}"])
    return totals


json.dump({"full": score(None), **{str(m): score(m) for m in max_lens}}, open(out, "w"))
