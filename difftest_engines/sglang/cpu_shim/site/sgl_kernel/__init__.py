"""difftest's CPU stand-in for the compiled `sgl_kernel` package (see engines/sglang/cpu_shim).

Importable only when `difftest_engines.sglang.cpu_shim.activate()` put its folder on the path, which
it does only when no real kernel package is importable. Known ops are plain-torch versions;
any other name resolves to a function that raises when *called*, so SGLang's imports of
GPU-only symbols succeed and the CPU code paths that never call them run.
"""

from difftest_engines.sglang.cpu_shim import eager as _eager
from difftest_engines.sglang.cpu_shim import ops as _ops

__version__ = "0.0.0+difftest.cpu-shim"
DIFFTEST_CPU_SHIM = True

globals().update({name: getattr(_ops, name) for name in _ops.PYTHON_OPS})
_ops.register_torch_ops()
_ops.register_torchvision_nms_schema()
# SGLang's torch.compile'd drafting helpers run as written: no compile in every scheduler (eager.py)
_eager.install()

import torch as _torch  # noqa: E402

if not _torch.cuda.is_available():
    # SGLang 0.5.23 srt/models/kimi_k25_eagle3.py (Eagle3DeepseekV2ForCausalLM.set_embed and
    # set_embed_and_head, the MLA EAGLE-3 draft) calls torch.cuda.synchronize() unconditionally
    # when the draft takes the target's embedding; CPU torch raises "Torch not compiled with CUDA
    # enabled". Without a CUDA device there is no stream to wait for, so it returns at once.
    _torch.cuda.synchronize = lambda device=None: None


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by difftest's CPU shim (engines/sglang/cpu_shim); "
            "this SGLang code path needs the real kernels"
        )

    unavailable.__name__ = name
    return unavailable
