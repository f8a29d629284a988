"""vLLM 0.32.0's hidden-states connector on a CPU-only build, for `speculators generate-offline-data`.

vLLM writes the hidden states speculators trains on through
`distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py::
ExampleHiddenStatesConnector`. Its `_submit_async_write` copies them out of the cache-only
attention layer's buffer on a side CUDA stream into pinned host memory, records a CUDA event, and
`get_finished` / the writer thread poll and wait on that event. A CPU build has neither streams,
events nor pinned memory, so the stock connector fails on the first finished request (torch 2.13
CPU: "Tried to instantiate dummy base class Event"; "pin_memory=True requires a CUDA or other
accelerator backend").

On CPU the buffer already lives in host memory and every copy is synchronous: the copy is complete
when the call returns. So this module gives the connector's module, and only it, a view of torch in
which a stream is a no-op context, an event is always complete, and `empty_like(pin_memory=True)`
allocates ordinary memory. Everything else, the extraction, the file names, the lock files and the
thread that writes the safetensors file, is vLLM's own code, unchanged; nothing installed is edited.

Load it with vLLM's own plug-in mechanism:
    --kv_transfer_config '{"kv_connector": "CpuHiddenStatesConnector",
                           "kv_connector_module_path": "difftest_engines.vllm.cpu_hidden_states", ...}'
(the server's processes need the repository root on PYTHONPATH, as `difftest_engines.vllm.serve` has).
"""

from __future__ import annotations

import contextlib
import types

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as _upstream


class _DoneEvent:
    """A CUDA event whose work is always finished: on CPU the copy it marks ran synchronously."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """A side stream on a device without streams: work submitted "to it" runs in order, at once."""

    device = torch.device("cpu")

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _empty_like_unpinned(tensor: torch.Tensor, *args, pin_memory: bool = False, **kwargs) -> torch.Tensor:
    # Pinning host memory needs a CUDA driver; it only speeds up an asynchronous device copy, which
    # CPU does not have.
    return torch.empty_like(tensor, *args, **kwargs)


class _TorchOnHost(types.ModuleType):
    """torch as the connector module sees it: `torch.cuda` streams/events and pinned allocation
    replaced as above, every other attribute torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(
            Event=_DoneEvent,
            Stream=_HostStream,
            stream=lambda stream=None: contextlib.nullcontext(),
            is_available=lambda: False,
        )
        self.empty_like = _empty_like_unpinned

    def __getattr__(self, name: str):
        return getattr(torch, name)


if torch.cuda.is_available():
    # A CUDA build keeps the stock connector: this module only stands in where CUDA is absent.
    CpuHiddenStatesConnector = _upstream.ExampleHiddenStatesConnector
else:
    _upstream.torch = _TorchOnHost()  # the connector module's global `torch`, in this process only

    class CpuHiddenStatesConnector(_upstream.ExampleHiddenStatesConnector):
        """vLLM's ExampleHiddenStatesConnector, run against host-memory torch (see the module doc)."""
