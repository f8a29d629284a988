"""Runs in speculators' own environment (scripts/setup-engine speculators): speculators 0.9.0's metric code on a
draft its trainer saved. DRAFT DATASET HS OUT RATIO TOTAL_SEQ_LEN STEPS

DRAFT: a checkpoint folder (`speculators train --save-path`/EPOCH, or the same config with other weights),
loaded by speculators' own `Eagle3DraftModel.from_pretrained` in float32 (its verifier head and norm from
the verifier the config names); sdpa attention, as the training run used. DATASET, HS: the arrow dataset and
hidden states the trainer read. OUT gets the per-step sums and totals of full_acc_k / cond_acc_k (the
forward's `compute_metrics`) for:

* all: every row, one sample per batch (ArrowDataset(train_ratio=1.0) -> CollateFn(shift_batch) -> forward);
* val: the trainer's validation split (ArrowDataset(split="val", train_ratio=RATIO)), one sample per batch;
* val_packed: the trainer's own validation batches: `train/dataloader.py::_setup_dataloader` (its multipack
  sampler, TOTAL_SEQ_LEN per packed row, shift_batch) over that split, each batch through the forward
  with the trainer's validation kwargs, summed as `Trainer.val_epoch` sums them;
* val_docs: per validation row, its sums and totals (one sample per batch).
"""

import json
import sys
from pathlib import Path

import torch
from hs_connectors.transfer import FileTransfer
from speculators.losses.eager import kl_div_loss
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import ArrowDataset, CollateFn
from speculators.train.dataloader import _setup_dataloader

draft, dataset, hs, out = sys.argv[1:5]
ratio, total_seq_len, steps = float(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])

config = Eagle3DraftModel.config_class.from_pretrained(draft)
config.transformer_layer_config._attn_implementation = "sdpa"
model = Eagle3DraftModel.from_pretrained(draft, config=config, torch_dtype=torch.float32)
model.eval()
H = model.config.transformer_layer_config.hidden_size
n_layers = len(model.config.eagle_aux_hidden_state_layer_ids)
# Eagle3DraftModel.get_trainer_kwargs(val): ttt_steps, ttt_step_loss_decay, loss_config; eager kl_div (the run's
# --loss-implementation eager)
kwargs = {"ttt_steps": steps, "ttt_step_loss_decay": 1.0, "loss_config": {"kl_div": (kl_div_loss, 1.0)}}
KEYS = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")


def add(totals, metrics):
    for k in range(steps):
        for name in ("full_acc", "cond_acc"):
            for part in ("sum", "total"):
                totals.setdefault(f"{name}_{part}", [0] * steps)[k] += int(round(float(metrics[f"{name}_{k}_{part}"])))


@torch.no_grad()
def forward(batch):
    with torch.autocast("cpu", dtype=torch.float32):  # Trainer.val_epoch: autocast(hidden_states_dtype), float32 here
        _, _, metrics = model(**{k: batch[k] for k in KEYS}, **kwargs)
    return metrics


def one_by_one(reader):
    totals, per_doc = {}, []
    for i in range(len(reader)):
        item = reader[i]
        n = int(item["input_ids"].shape[0]) - 1
        batch = CollateFn(
            max_len=min(n, total_seq_len),
            hidden_size=H,
            num_target_layers=n_layers,
            dtype=torch.float32,
            preprocess=shift_batch,
        )([item])
        metrics = forward(batch)
        doc = {}
        add(doc, metrics)
        add(totals, metrics)
        per_doc.append(doc)
    return totals, per_doc


def reader(split, r):
    return ArrowDataset(
        max_len=total_seq_len,
        datapath=dataset,
        transfer=FileTransfer(Path(hs)),
        on_missing="raise",
        train_ratio=r,
        split=split,
        hidden_states_dtype=torch.float32,
    )


result = {}
result["all"], _ = one_by_one(reader("train", 1.0))
val = reader("val", ratio)
result["val"], result["val_docs"] = one_by_one(val)
loader = _setup_dataloader(
    val, total_seq_len, H, num_workers=0, num_target_layers=n_layers, prefetch_factor=None, preprocess=shift_batch
)
packed, batches = {}, []
for batch in loader:
    add(packed, forward(batch))
    batches.append(int((batch["document_ids"] >= 0).sum()))
result["val_packed"] = packed
result["val_rows"] = [val._map_to_file_idx(0), val._map_to_file_idx(len(val) - 1) + 1]
result["packed_batches"] = batches
Path(out).write_text(json.dumps(result))
