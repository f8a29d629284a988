"""Runs in speculators' own environment: SAMPLES_JSONL OUT_DATASET.

Saves samples (one JSON object a line: input_ids, loss_mask) as the arrow dataset `speculators
prepare-data` writes and `generate-offline-data --preprocessed-data` reads (`datasets`
`save_to_disk` with columns input_ids, loss_mask, seq_len; data_generation/preprocessing.py),
row i being line i.
"""

import json
import sys
from pathlib import Path

from datasets import Dataset

rows = [json.loads(x) for x in Path(sys.argv[1]).read_text().splitlines() if x.strip()]
ds = Dataset.from_dict(
    {
        "input_ids": [r["input_ids"] for r in rows],
        "loss_mask": [r["loss_mask"] for r in rows],
        "seq_len": [len(r["input_ids"]) for r in rows],
    }
)
ds.set_format(type="torch")
ds.save_to_disk(sys.argv[2])
print(f"saved {len(rows)} rows to {sys.argv[2]}")
