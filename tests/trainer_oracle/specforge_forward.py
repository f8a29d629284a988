"""Runs in SpecForge's own environment (scripts/setup-engine specforge): its EAGLE-3 training forward's
accuracy counts on a rows_a-b folder its writer made. DRAFT TARGET DATA OUT STEPS MAX_LEN DTYPE

SpecForge 0.2.0's offline path, with nothing of difftest's: the draft loaded by
`modeling/auto.AutoDraftModel.from_pretrained`; each file read by its offline reader
(`runtime/data_plane/offline_reader.OfflineManifestReader` + `feature_store.LocalFeatureStore`) and
normalized by `algorithms/eagle3/data.normalize_offline_sample`; the frozen `TargetHead.from_pretrained`
(bf16, as the trainer builds it: `algorithms/model_providers.build_eagle3_model`); and
`training/strategies/base.Eagle3TrainStrategy.forward_loss` around `OnlineEagle3Model` (sdpa, DTYPE
like the trainer's model.torch_dtype), one sample a step, as `specforge train` with batch_size 1.
OUT: per TTT step, the summed `acc_corrects` and `acc_denoms` over every file.

One CPU stand-in, for the loss only (the accuracy counts do not read it): the Triton kernel
`core/loss.LogSoftmaxLoss` has no CPU driver, so `algorithms/eagle3/model` gets SpecForge's own
eager reference of the same loss, `core/loss._compute_loss`.
"""

import json
import os
import sys

for k, v in {"SPECFORGE_DEVICE": "cpu", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402
from specforge.algorithms.eagle3.data import normalize_offline_sample  # noqa: E402
import specforge.algorithms.eagle3.model as eagle3_model  # noqa: E402
from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: E402
from specforge.core.loss import _compute_loss  # noqa: E402
from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig  # noqa: E402
from specforge.modeling.target.target_head import TargetHead  # noqa: E402
from specforge.runtime.contracts import TrainBatch  # noqa: E402
from specforge.runtime.data_plane.feature_store import LocalFeatureStore  # noqa: E402
from specforge.runtime.data_plane.offline_reader import OfflineManifestReader  # noqa: E402
from specforge.training.model_loading import warm_start_draft_model  # noqa: E402
from specforge.training.strategies.base import Eagle3TrainStrategy  # noqa: E402

eagle3_model.LogSoftmaxLoss = type("EagerLogSoftmaxLoss", (), {"apply": staticmethod(_compute_loss)})
draft_dir, target_dir, data, out, steps, max_len, dtype = sys.argv[1:8]
steps, max_len, dtype = int(steps), int(max_len), getattr(torch, dtype)
config = AutoDraftModelConfig.from_file(os.path.join(draft_dir, "config.json"))
draft = AutoDraftModel.from_config(config, attention_backend="sdpa", torch_dtype=dtype)
warm_start_draft_model(draft, draft_dir, draft_config=config, strategy="eagle3", allow_missing_embedding=True)
model = OnlineEagle3Model(draft_model=draft, length=steps, attention_backend="sdpa").to(dtype=dtype).eval()
strategy = Eagle3TrainStrategy(model, target_head=TargetHead.from_pretrained(target_dir))
refs = OfflineManifestReader(data, validate_files=True, max_len=max_len, ttt_length=steps).read()
store = LocalFeatureStore()
correct, denom = [0.0] * steps, [0.0] * steps
with torch.no_grad():
    for ref in refs:
        tensors, handle = store.get(ref)
        batch = TrainBatch(
            sample_ids=[str(ref.sample_id)],
            strategy="eagle3",
            tensors=normalize_offline_sample(tensors, max_len),
            metadata={"target_repr": "hidden_state"},
        )
        store.release(handle)
        m = strategy.forward_loss(batch).metrics
        for k in range(steps):
            correct[k] += float(m["acc_corrects"][k])
            denom[k] += float(m["acc_denoms"][k]) if float(m["acc_denoms"][k]) >= 1 else 0.0  # clamp_min(1e-6)
json.dump({"files": len(refs), "correct": correct, "denom": denom}, open(out, "w"))
