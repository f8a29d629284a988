"""Runs in speculators 0.6.0's environment (`difftest env create speculators==0.6.0`: the speculators recipe,
0.6.0 installed --no-deps on the same CPU stack, torch 2.13 / transformers 5.19, although 0.6.0's metadata
asks torch<=2.12 and transformers<5.11). Pre-0.7, the TTT steps after the first feed the draft's own argmax,
mapped through d2t, unless `use_off_policy_tokens`. Builds a 0.6.0 EAGLE-3 draft for a verifier and scores
it on training data with 0.6.0's own training forward. TARGET DATA DRAFT_OUT OUT STEPS VD IDS

As speculators_forward.py does for 0.9.0: `Eagle3DraftModel.from_training_args` (0.6.0 signature: the
decoder config first, here the verifier's cut to one layer; draft vocab = target ids 0..VD-1), seeded random weights made livelier, save_pretrained;
DATA (hidden_states/hs_{i}.safetensors + samples.jsonl) saved as the arrow dataset its ArrowDataset reads;
each sample through 0.6.0's own path: ArrowDataset -> create_collate_fn(preprocess=shift_batch) -> the
training forward with its default use_off_policy_tokens=False; full_acc_k / cond_acc_k sums and totals
added up into OUT. 0.6.0 attention is flex attention only (models/eagle3/core.py forward,
create_block_mask), compiled by torch on CPU; torch 2.13's flex_attention also refuses a block mask made
for a longer, block-rounded length, so every batch is padded to the block size (see below).
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from importlib.metadata import version
from speculators.models.eagle3.core import Eagle3DraftModel
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import ArrowDataset, create_collate_fn
from transformers import AutoConfig

assert version("speculators") == "0.6.0", version("speculators")
target, data, draft_out, out = sys.argv[1:5]
steps, vd, ids = int(sys.argv[5]), int(sys.argv[6]), [int(x) for x in sys.argv[7].split(",")]
vcfg = AutoConfig.from_pretrained(target)
layer_cfg = AutoConfig.from_pretrained(target)
layer_cfg.num_hidden_layers = 1  # the draft's decoder config: one layer (from_training_args takes it as given)
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
    draft_vocab_size=vd,
    ttt_steps=steps,
    verifier_name_or_path=target,
    target_layer_ids=ids,
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
    hidden_states_path=str(Path(data) / "hidden_states"),
    on_missing="raise",
    hidden_states_dtype=torch.float32,
)
totals: dict = {}
for i in range(len(reader)):
    item = reader[i]
    # one sample per batch, padded to flex attention's block size: torch 2.13's flex_attention refuses a block
    # mask made for a rounded-up length (0.6.0 was built for torch <= 2.12). Padding has loss mask 0.
    batch = create_collate_fn(
        128, vcfg.hidden_size, num_target_layers=len(ids), dtype=torch.float32, preprocess=shift_batch
    )([item])
    keys = ("hidden_states", "input_ids", "lengths", "loss_mask", "position_ids", "verifier_last_hidden_states")
    with torch.no_grad():
        _, _, metrics = model(**{k: batch[k] for k in keys}, ttt_steps=steps)
    for k in range(steps):
        for name in ("full_acc", "cond_acc"):
            for part in ("sum", "total"):
                totals.setdefault(f"{name}_{part}", [0.0] * steps)[k] += float(metrics[f"{name}_{k}_{part}"])
json.dump(totals, open(out, "w"))
