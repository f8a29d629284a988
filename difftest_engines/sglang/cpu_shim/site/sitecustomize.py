"""Runs at start-up of every interpreter that has engines/sglang/cpu_shim/site on its path
(the adapter's worker and the scheduler/detokenizer processes SGLang spawns from it).

PyPI's torchvision is a CUDA build; beside the CPU torch its import dies with "operator
torchvision::nms does not exist", and SGLang imports it (through transformers) before anything
of ours runs in a spawned process. So: define the nms schema right before torchvision loads.
Nothing is imported until then.
"""

import sys


class _TorchvisionNmsSchema:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            from difftest_engines.sglang.cpu_shim import ops

            ops.register_torchvision_nms_schema()
        return None  # the normal finders load it


sys.meta_path.insert(0, _TorchvisionNmsSchema())
