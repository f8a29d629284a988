"""Which cores each tensor-parallel rank's OpenMP threads use on CPU, for the adapter's engine
(difftest_engines/sglang/engine.py) and its server (difftest_engines/sglang/serve.py) alike.

SGLang 0.5.23's CPU engine binds rank r to NUMA node r unless SGLANG_CPU_OMP_THREADS_BIND says
otherwise (srt/utils/numa_utils.py::init_threads_binding asserts tp_size <= the node count), so
tp_size 2 fails on a one-node machine (every CI runner). `core_groups` splits the cores this
process may use into tp_size groups ("0|1" on two cores; a core is shared when there are fewer
cores than ranks).
"""

from __future__ import annotations

import os

BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def core_groups(tp_size: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND's value for tp_size ranks over this process's cores."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // tp_size)
    groups = [cores[(r * per) % len(cores) : (r * per) % len(cores) + per] for r in range(tp_size)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def bind(tp_size: int) -> bool:
    """Set the binding for tp_size > 1 ranks unless the user set one; True when it was set here."""
    if tp_size <= 1 or os.environ.get(BIND_ENV):
        return False
    os.environ[BIND_ENV] = core_groups(tp_size)
    return True
