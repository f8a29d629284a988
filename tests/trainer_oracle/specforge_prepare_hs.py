"""Run SpecForge's own hidden-state writer, scripts/prepare_hidden_states.py, on a CPU (one process).

usage: specforge_prepare_hs.py SCRIPT WORKDIR TEMPLATES -- ARGS...   (ARGS: the script's own flags)

Runs in the `specforge-writer` environment (SpecForge 0.2.0 + SGLang 0.5.14, scripts/setup-engine
specforge-writer). SCRIPT is SpecForge's scripts/prepare_hidden_states.py (not in the wheel: a
SpecForge checkout's). It is copied unmodified into WORKDIR/scripts/ and run from there as __main__,
because it puts its dataset cache beside itself (`<script>/../../cache/hf_dataset`). TEMPLATES is
a JSON file {name: ChatTemplate fields} registered in SpecForge's TEMPLATE_REGISTRY first, as its
docs tell users of a custom chat template to do (specforge/data/template.py), or "-".

The CPU stand-ins, all applied in this process at run time (nothing installed and nothing in the
script is edited; each one only acts where the CUDA call would raise on a machine without CUDA):
* torch.distributed: a one-process gloo group (RANK/WORLD_SIZE/MASTER_* set here);
  SPECFORGE_DEVICE=cpu makes specforge.distributed pick gloo and a cpu device mesh;
* SGLang: SGLANG_USE_CPU_ENGINE=1 (its CPU platform); the caller passes
  --sglang-attention-backend torch_native;
* `torch.cuda.current_device()` -> 0: specforge/offline_capture/sglang_backend/capture.py
  (OfflineSGLangCaptureBackend.build) passes it as SGLang's gpu_id, which the CPU platform ignores;
* `Tensor.cuda()` -> the tensor itself, and `torch.tensor(..., device="cuda")` -> on the CPU:
  the script's HiddenStatesGenerator.generate moves each batch with `.cuda(non_blocking=True)` and
  builds its skip flags with device="cuda";
* torchvision: PyPI's wheel is a CUDA build; sglang.srt.multimodal imports torchvision.transforms,
  which loads once the two operator schemas its meta registrations name exist (defined here).
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
from pathlib import Path


def _torchvision_schemas(torch) -> None:
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                   "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"):  # fmt: skip
        try:
            lib.define(schema)
        except RuntimeError:  # a real torchvision build defined it already
            pass
    _torchvision_schemas.keep = lib  # type: ignore[attr-defined]  # the library must outlive this call


def _cuda_to_cpu(torch) -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: 0
    torch.Tensor.cuda = lambda self, *a, **k: self
    tensor = torch.tensor

    def cpu_tensor(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return tensor(*args, **kwargs)

    torch.tensor = cpu_tensor


def main(argv: list[str]) -> int:
    script, work, templates, sep, *args = argv
    assert sep == "--", "usage: specforge_prepare_hs.py SCRIPT WORKDIR TEMPLATES -- ARGS..."
    for key, value in {"SPECFORGE_DEVICE": "cpu", "SGLANG_USE_CPU_ENGINE": "1", "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():  # fmt: skip
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    import torch

    _torchvision_schemas(torch)
    _cuda_to_cpu(torch)
    if templates != "-":
        import json

        from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate

        for name, fields in json.loads(Path(templates).read_text()).items():
            TEMPLATE_REGISTRY.register(name=name, template=ChatTemplate(**fields))
    copy = Path(work) / "scripts" / "prepare_hidden_states.py"
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(script, copy)
    sys.argv = [str(copy), *args]
    runpy.run_path(str(copy), run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
