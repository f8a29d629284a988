"""Runs in SpecForge's own environment (scripts/setup-engine specforge): `specforge train` (0.2.0) on the
offline files its writer made, then `specforge export --to hf`, on a CPU in one process.

usage: specforge_train.py CONFIG_YAML DRAFT_CONFIG EXPORT_DIR

CONFIG_YAML is SpecForge's own run config (config/Config: model, data.hidden_states_path, training,
output_dir; training.fsdp_sharding NO_SHARD, DDP over a one-process gloo group, as its CPU device
allows). Both commands are specforge/cli.py::main, as a user runs them: `train --config` (with
RANK/WORLD_SIZE set, its launch plan runs the worker in this process instead of spawning torchrun),
then `export --to hf --checkpoint <the last checkpoint> --draft-config DRAFT_CONFIG --output-dir
EXPORT_DIR --vocab-mapping <the data's mapping> --embedding-source <the target>` (the frozen
embedding is the target's), which writes the draft as a model directory
(config.json with SpecForge's capture ids, model.safetensors with d2t/t2d).

One CPU stand-in, the one tests/trainer_oracle/specforge_forward.py applies: the Triton kernel
core/loss.py LogSoftmaxLoss has no CPU driver, so algorithms/eagle3/model.py gets SpecForge's own
eager reference of the same loss, core/loss.py _compute_loss (TORCH_COMPILE_DISABLE=1 keeps it eager).
"""

import os
import socket
import sys
from pathlib import Path

for key, value in {
    "SPECFORGE_DEVICE": "cpu",
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
}.items():
    os.environ.setdefault(key, value)
if "MASTER_PORT" not in os.environ:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])

import specforge.algorithms.eagle3.model as eagle3_model  # noqa: E402
import yaml  # noqa: E402
from specforge.cli import main  # noqa: E402
from specforge.core.loss import _compute_loss  # noqa: E402
from specforge.training.checkpoint import CheckpointManager  # noqa: E402

eagle3_model.LogSoftmaxLoss = type("EagerLogSoftmaxLoss", (), {"apply": staticmethod(_compute_loss)})

config, draft_config, export_dir = sys.argv[1:4]
rc = main(["train", "--config", config])
if rc:
    raise SystemExit(rc)
cfg = yaml.safe_load(Path(config).read_text())
# the run's newest complete checkpoint, as SpecForge resolves one (training/checkpoint.py
# CheckpointManager.resolve_resume_dir: its *-latest pointer, else the highest <run_id>-stepN)
checkpoint = CheckpointManager.resolve_resume_dir(cfg["output_dir"])
print(f"specforge_train: exporting {checkpoint}", flush=True)
raise SystemExit(
    main(
        [
            "export",
            "--to",
            "hf",
            "--checkpoint",
            checkpoint,
            "--draft-config",
            draft_config,
            "--output-dir",
            export_dir,
            "--vocab-mapping",
            cfg["model"]["vocab_mapping_path"],
            "--embedding-source",
            cfg["model"]["target_model_path"],
        ]
    )
)
