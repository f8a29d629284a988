"""Runs in speculators' own environment (scripts/setup-engine speculators): trains an EAGLE-3 draft with
speculators 0.9.0's own trainer on CPU. TARGET DUMP OUT EPOCHS TOTAL_SEQ_LEN TRAIN_RATIO

DUMP is a speculators-layout folder (hidden_states/hs_{i}.safetensors + samples.jsonl). What runs here:
* the dataset part is saved as the arrow dataset `speculators prepare-data` writes (input_ids, loss_mask,
  seq_len; data_generation/preprocessing.py), and every hidden-states file is checked with
  `data_generation/offline.py::check_hidden_states`, the check `generate-offline-data --validate-outputs`
  runs on what it saves;
* `speculators train` itself (train/cli.py::main on TrainConfig.resolve(argv), the `speculators train`
  entry point), with the `speculators train` defaults for eagle3 except what CPU needs: eager loss (the
  default is a Triton kernel), sdpa draft attention (flex attention has no CPU backward), no dataloader
  workers, float32 hidden states / autocast (CPU autocast in bf16 is the default; float32 makes the
  logged accuracy a float32 number), and AdamW (`--optimizer adamw`; the default Muon's Newton-Schulz
  iterations take ~1.7 s a step on these CPUs, the draft's whole forward and backward ~0.07 s).
  No --target-layer-ids: the draft config records the trainer's
  default [2, L//2, L-3], whatever the data holds.
* Two monkeypatches, nothing edited: train/trainer.py imports `get_local_rank` (an accelerator index) ->
  "cpu", and `torch.accelerator.synchronize` (its step timer) -> no-op when there is no accelerator.

OUT gets: dataset/ (arrow), ckpt/ (the trainer's checkpoints), master/ (the last epoch's float32 master
weights, the ones its last validation ran with, beside the bf16 checkpoint's config: the oracle for
what rounding the checkpoint to bf16 changes), train.log (its console log), metrics.jsonl
(every record the trainer sent to its metric logger `speculators.metrics`, as its tensorboard/wandb
handlers receive them), val/ (the validation split as the trainer's ArrowDataset(split="val") yields it,
written back as hs_{i}.safetensors + samples.jsonl for difftest) and result.json.
"""

import json
import logging
import shutil
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import load_file

target, dump, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
epochs, total_seq_len, train_ratio = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
out.mkdir(parents=True, exist_ok=True)

from speculators.data_generation.offline import check_hidden_states  # noqa: E402

# -- data: the arrow dataset prepare-data writes, hidden states checked as generate-offline-data checks them
rows = [json.loads(x) for x in (dump / "samples.jsonl").read_text().splitlines() if x.strip()]
rows.sort(key=lambda r: r["index"])
assert [r["index"] for r in rows] == list(range(len(rows))), "samples.jsonl indices must be 0..N-1"
hs_dir = dump / "hidden_states"
for r in rows:
    check_hidden_states(load_file(str(hs_dir / f"hs_{r['index']}.safetensors")), r["input_ids"])
ds = Dataset.from_dict(
    {
        "input_ids": [r["input_ids"] for r in rows],
        "loss_mask": [r["loss_mask"] for r in rows],
        "seq_len": [len(r["input_ids"]) for r in rows],
    }
)
ds.set_format(type="torch")
if (out / "dataset").exists():
    shutil.rmtree(out / "dataset")
ds.save_to_disk(str(out / "dataset"))

# -- the trainer, as `speculators train` runs it
import speculators.train.cli as train_cli  # noqa: E402
import speculators.train.trainer as trainer_mod  # noqa: E402
from speculators.train.config import TrainConfig  # noqa: E402

trainer_mod.get_local_rank = lambda: "cpu"
if not torch.accelerator.is_available():
    torch.accelerator.synchronize = lambda *a, **k: None

records = []


class _Records(logging.Handler):
    """What a metric backend (train/logger.py TensorBoardHandler ...) receives: the logged dict, unformatted."""

    def emit(self, record):
        if isinstance(record.msg, dict):
            records.append({"step": getattr(record, "step", None), **json.loads(json.dumps(record.msg, default=float))})


_setup_metric_logger = train_cli.setup_metric_logger


def setup_metric_logger(*a, **k):
    _setup_metric_logger(*a, **k)  # dictConfig: replaces the metric logger's handlers, so ours goes in after
    logging.getLogger("speculators.metrics").addHandler(_Records())


train_cli.setup_metric_logger = setup_metric_logger

master = {}
_val_epoch = trainer_mod.Trainer.val_epoch


def val_epoch(self, epoch):
    """The trainer's own validation; then keep the float32 weights it validated with (each epoch's
    replaces the last; checkpoints are saved in bf16, train/checkpointer.py::save_checkpoint)."""
    metrics = _val_epoch(self, epoch)
    master.clear()
    master.update({k: v.detach().float().clone() for k, v in self.model.state_dict().items()})
    return metrics


trainer_mod.Trainer.val_epoch = val_epoch

ckpt = out / "ckpt"
if ckpt.exists():
    shutil.rmtree(ckpt)
argv = [
    "--verifier-name-or-path",
    target,
    "--data-path",
    str(out / "dataset"),
    "--hidden-states-path",
    str(hs_dir),
    "--save-path",
    str(ckpt),
    "--log-dir",
    str(out / "logs"),
    "--epochs",
    str(epochs),
    "--checkpoint-freq",
    str(epochs),
    "--total-seq-len",
    str(total_seq_len),
    "--train-data-ratio",
    str(train_ratio),
    "--optimizer",
    "adamw",
    "--lr",
    "3e-3",
    "--seed",
    "0",
    "--mask-token-id",
    "0",
    "--on-missing",
    "raise",
    "--no-resume-from-checkpoint",
    "--loss-implementation",
    "eager",
    "--draft-attn-impl",
    "sdpa",
    "--num-workers",
    "0",
    "--hidden-states-dtype",
    "float32",
]
t0 = time.time()
train_cli.main(TrainConfig.resolve(argv))
wall = time.time() - t0

# -- the float32 master weights as a draft folder: the bf16 checkpoint's config and tensor names
from safetensors.torch import save_file  # noqa: E402

last = ckpt / str(epochs - 1)
names = load_file(str(last / "model.safetensors")).keys()
mdir = out / "master"
if mdir.exists():
    shutil.rmtree(mdir)
mdir.mkdir()
cfg = json.loads((last / "config.json").read_text())
cfg["dtype"] = "float32"
(mdir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
save_file({k: master[k].contiguous() for k in names}, str(mdir / "model.safetensors"))

# -- the validation split exactly as the trainer read it (train/data.py ArrowDataset: rows [int(N*ratio), N),
# hidden states file index = row + start_file_idx), renumbered from 0 for difftest
from hs_connectors.transfer import FileTransfer  # noqa: E402
from speculators.train.data import ArrowDataset  # noqa: E402

val = ArrowDataset(
    max_len=total_seq_len,
    datapath=str(out / "dataset"),
    transfer=FileTransfer(hs_dir),
    on_missing="raise",
    train_ratio=train_ratio,
    split="val",
    hidden_states_dtype=torch.float32,
)
vdir = out / "val"
if vdir.exists():
    shutil.rmtree(vdir)
(vdir / "hidden_states").mkdir(parents=True)
lines = []
for i in range(len(val)):
    src = hs_dir / f"hs_{val._map_to_file_idx(i)}.safetensors"
    shutil.copyfile(src, vdir / "hidden_states" / f"hs_{i}.safetensors")
    item = val.data[i]
    lines.append(
        json.dumps(
            {
                "index": i,
                "input_ids": item["input_ids"].tolist(),
                "loss_mask": item["loss_mask"].tolist(),
                "seq_len": int(item["seq_len"]),
            }
        )
    )
(vdir / "samples.jsonl").write_text("\n".join(lines) + "\n")

(out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
vals = [r for r in records if "val" in r]
trains = [r for r in records if "train" in r]
result = {
    "checkpoint": str(ckpt / str(epochs - 1)),
    "epochs": epochs,
    "train_steps": len(trains),
    "train_samples": int(len(rows) * train_ratio),
    "val_samples": len(val),
    "val": vals[-1]["val"] if vals else None,
    "train_wall_s": round(wall, 1),
}
(out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
print("RESULT", json.dumps(result))
