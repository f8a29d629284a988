"""Runs in SpecForge's own environment: reads an offline feature folder with SpecForge 0.2.0's reader.
DIR OUT MAX_LEN

`runtime/data_plane/offline_reader.py::list_feature_files` (which files are samples, in which
order: .ckpt and .ckpt.gz, sorted), `feature_store.load_feature_file` (gzip for .gz) and
`algorithms/eagle3/data.py::normalize_offline_sample` (max_len, last loss-mask position zeroed);
saves the path and tensors of each sample to OUT.
"""

import sys

import torch
from specforge.algorithms.eagle3.data import normalize_offline_sample
from specforge.runtime.data_plane.feature_store import load_feature_file
from specforge.runtime.data_plane.offline_reader import list_feature_files

got = []
for path in list_feature_files(sys.argv[1]):
    raw = load_feature_file(path)
    d = normalize_offline_sample(raw, max_len=int(sys.argv[3]))
    got.append(
        {
            "path": path,
            "input_ids": d["input_ids"][0].clone(),
            "loss_mask": d["loss_mask"][0].clone(),
            "aux_hidden_state": d["hidden_state"][0].clone(),
            "hidden_state": d["target"][0].clone(),
        }
    )
torch.save(got, sys.argv[2])
