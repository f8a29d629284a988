"""SGLang functions the CPU shim runs as written instead of compiled by torch.compile.

SGLang decorates a few small tensor functions with `@torch.compile(dynamic=True)`. On a GPU
inductor makes them Triton kernels; on a CPU it makes C++ that g++ compiles, and dynamo's caches
live in the process: every sglang.Engine start forks a fresh scheduler, which traces and compiles
again at its first drafting round, its precompiled header included (inductor keeps those under the
temp dir, the adapter's own per worker). Measured (stop 39, idle 2-core machine, SGLang 0.5.23,
`pytest cases/ --engines=sglang --no-capture-cache`): 338 core-s with the compile, 235 without; one
tiny_llama capture 37 s -> 23 s.

Only functions whose compiled and eager forms are the same arithmetic are listed: an elementwise
product, a top-k, gathers and integer index math, with no reduction whose order inductor could
change. tests/sglang_shim_checks.py::eager_functions_match_sglangs_compiled_ones holds each to
SGLang's compiled function, output for output. A real `sgl_kernel` (a GPU) never loads this.
"""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType

# module -> its compiled functions run eagerly (the same names in 0.5.16 and 0.5.23)
EAGER: dict[str, tuple[str, ...]] = {
    "sglang.srt.speculative.spec_utils": ("_select_top_k_tokens_later",),
}


# (module, name) -> SGLang's compiled function, kept for the check that holds the eager one to it
COMPILED: dict[tuple[str, str], object] = {}


def uncompiled(fn):
    """The function torch.compile wrapped (dynamo keeps it on the wrapper); `fn` if not compiled."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def patch(module: ModuleType) -> None:
    """Rebind the module's listed functions to their uncompiled forms. Callers look them up in the
    module's globals at each call, so every caller sees the change."""
    for name in EAGER.get(module.__name__, ()):
        fn = getattr(module, name, None)
        if fn is not None and uncompiled(fn) is not fn:
            COMPILED[(module.__name__, name)] = fn
            setattr(module, name, uncompiled(fn))


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a listed module so `patch` runs right after
    the module's body, before anything can call the compiled function."""

    def find_spec(self, name, path=None, target=None):
        if name not in EAGER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        patch(module)


def install() -> None:
    """In this process and the processes forked from it: the listed functions run eagerly, whether
    their modules are imported already or later."""
    for name in EAGER:
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
