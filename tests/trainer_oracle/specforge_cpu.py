"""SpecForge's offline capture (SGLang 0.5.14) in one CPU process: the run-time stand-ins both writer
runners apply (specforge_capture.py, the installed package's classes; specforge_prepare_hs.py, the
checkout's script). Nothing is installed and nothing upstream is edited; each stand-in only acts
where the CUDA call would raise on a machine without CUDA.

* torch.distributed: a one-process gloo group (RANK/WORLD_SIZE/MASTER_* set here);
  SPECFORGE_DEVICE=cpu makes specforge.distributed (init_distributed) pick gloo and a cpu device mesh;
* SGLang: SGLANG_USE_CPU_ENGINE=1 (its CPU platform); the runners pass the torch_native attention
  backend;
* `torch.cuda.current_device()` -> 0: specforge/offline_capture/sglang_backend/capture.py
  (OfflineSGLangCaptureBackend.build) passes it as SGLang's gpu_id, which the CPU platform ignores;
* `Tensor.cuda()` -> the tensor itself, and `torch.tensor(..., device="cuda")` -> on the CPU:
  the script's HiddenStatesGenerator.generate moves each batch with `.cuda(non_blocking=True)` and
  builds its skip flags with device="cuda";
* torchvision: PyPI's wheel is a CUDA build; sglang.srt.multimodal imports torchvision.transforms,
  which loads once the two operator schemas its meta registrations name exist (defined here).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path


def _torchvision_schemas(torch) -> None:
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in (
        "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    ):
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


def cpu_process() -> None:
    """Make this process a one-rank CPU job for SpecForge and SGLang (before either is imported)."""
    for key, value in {
        "SPECFORGE_DEVICE": "cpu",
        "SGLANG_USE_CPU_ENGINE": "1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
    }.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    import torch

    _torchvision_schemas(torch)
    _cuda_to_cpu(torch)


def register_templates(templates: str) -> None:
    """TEMPLATES: a JSON file {name: ChatTemplate fields}, or "-". Registered in SpecForge's
    TEMPLATE_REGISTRY (specforge/data/template.py), as its docs tell users of a custom chat template to."""
    if templates == "-":
        return
    from specforge.data.template import TEMPLATE_REGISTRY, ChatTemplate

    for name, fields in json.loads(Path(templates).read_text()).items():
        TEMPLATE_REGISTRY.register(name=name, template=ChatTemplate(**fields))
