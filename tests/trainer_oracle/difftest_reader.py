"""difftest's own reader, run where `datasets` is installed (the speculators environment): a real
speculators dataset part is an arrow folder, which difftest reads through `datasets` when present.
DATA HS OUT  (PYTHONPATH = the difftest checkout)
"""

import sys

import torch

from engines.trainingdata.formats import read_dump

dump = read_dump(sys.argv[1], hidden_states=sys.argv[2] if sys.argv[2] != "-" else None)
torch.save({"format": dump.format, "skipped": dump.skipped,
            "samples": [{"input_ids": s.input_ids, "loss_mask": s.loss_mask, "fc_in": s.fc_in, "verifier": s.verifier}
                        for s in dump.samples]}, sys.argv[3])  # fmt: skip
