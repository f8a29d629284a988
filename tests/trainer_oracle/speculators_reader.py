"""Runs in speculators' own environment: writes a speculators training-data folder the way its
pipeline does and reads it back with its trainer's reader. IN DATA HS OUT

IN: samples (input_ids [N], loss_mask [N], hidden_states [N, n_layers, H]). Writes DATA with
`datasets` as `speculators prepare-data` saves it (cli/prepare_data.py: input_ids, loss_mask as
long tensors, seq_len; set_format("torch"); save_to_disk) and HS/hs_{i}.safetensors in the
layout the hidden-states connector writes and hs_connectors `_load_hs_file` reads (hidden_states,
token_ids). Then reads every sample with `speculators.train.data.ArrowDataset` over
`hs_connectors.transfer.FileTransfer(HS)` (the trainer's `--hidden-states-path`) and saves what
the trainer gets (fc hidden_states, verifier_last_hidden_states, input_ids, loss_mask) to OUT.
"""

import sys
from pathlib import Path

import torch
from datasets import Dataset
from hs_connectors.transfer import FileTransfer
from safetensors.torch import save_file
from speculators.train.data import ArrowDataset

samples = torch.load(sys.argv[1], weights_only=True)
data, hs, out = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
ds = Dataset.from_dict(
    {
        "input_ids": [s["input_ids"].tolist() for s in samples],
        "loss_mask": [s["loss_mask"].tolist() for s in samples],
        "seq_len": [len(s["input_ids"]) for s in samples],
    }
)
ds.set_format(type="torch")
ds.save_to_disk(str(data))
torch.save({"counts": torch.ones(4)}, data / "token_freq.pt")  # train/cli.py writes it next to the dataset
hs.mkdir(parents=True, exist_ok=True)
for i, s in enumerate(samples):
    save_file(
        {"hidden_states": s["hidden_states"].contiguous(), "token_ids": s["input_ids"]}, str(hs / f"hs_{i}.safetensors")
    )

reader = ArrowDataset(max_len=4096, datapath=str(data), transfer=FileTransfer(hs), on_missing="raise")
got = []
for i in range(len(reader)):
    item = reader[i]
    got.append({k: item[k] for k in ("hidden_states", "verifier_last_hidden_states", "input_ids", "loss_mask")})
torch.save(got, out)
