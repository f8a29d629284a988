"""MemoryPlanRecord: which memory plan a case's run followed, as its report keeps it (`memory_plan` of
the report JSON, report schema 4; shown in the report's environment section).

The pool (difftest.run.pool.EnginePool) makes the plan before a case's workers start
(difftest.run.memory_plan.Plan): each engine's estimated resident need, what the workers may hold
(the machine's available memory, measured, or the budget DIFFTEST_MEMORY_BUDGET declares), and
whether every worker fits side by side or they run one after another. A report of schema 2 or 3
has no plan recorded (None), nor has a case for which no worker was asked to start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from difftest.records.fields import encode_fields

GB = 10**9  # what the plan's lines print in (as difftest.run.memory_plan's)


def gb(n: int) -> str:
    return f"{n / GB:.1f} GB"


@dataclass
class EngineNeed:
    """One engine's estimated resident need for the case, in bytes, on the host and on a GPU."""

    engine: str  # its spec id
    host_bytes: int
    gpu_bytes: int = 0

    def shown(self) -> str:
        return gb(self.host_bytes) + (f" + {gb(self.gpu_bytes)} GPU" if self.gpu_bytes else "")


@dataclass
class MemoryPlanRecord:
    all_at_once: bool  # every worker side by side; False: one (or as many as fit) after another
    needs: list[EngineNeed] = field(default_factory=list)  # in the order the plan lists them
    budget_host_bytes: int | None = None  # None: not known (not measured, not declared)
    budget_gpu_bytes: int | None = None  # None: no GPU known or declared
    budget_source: str = "available"  # "available" (measured before any worker started) or the env variable

    def to_dict(self) -> dict:
        return encode_fields(self)

    def budget(self) -> str:
        """'22.0 GB available', '20.0 GB and 70.0 GB of GPU memory in DIFFTEST_MEMORY_BUDGET'."""
        if self.budget_host_bytes is None and self.budget_gpu_bytes is None:
            return "unknown memory (none measured, none declared)"
        parts = [gb(self.budget_host_bytes) if self.budget_host_bytes is not None else "unknown host memory"]
        if self.budget_gpu_bytes is not None:
            parts.append(f"{gb(self.budget_gpu_bytes)} of GPU memory")
        how = "available" if self.budget_source == "available" else f"in {self.budget_source}"
        return " and ".join(parts) + f" {how}"

    def total(self) -> EngineNeed:
        return EngineNeed("together", sum(n.host_bytes for n in self.needs), sum(n.gpu_bytes for n in self.needs))

    def said(self) -> str:
        """One line: which plan ran and why ('one after another: ref 9.0 GB, vllm 9.5 GB (18.5 GB
        together) exceed 12.0 GB available')."""
        engines = ", ".join(f"{n.engine} {n.shown()}" for n in self.needs) or "no engine"
        together = f"{engines} ({self.total().shown()} together)" if len(self.needs) > 1 else engines
        if not self.all_at_once:
            return f"one after another: estimated needs {together} exceed {self.budget()}"
        if self.budget_host_bytes is None and self.budget_gpu_bytes is None:
            return f"every worker side by side: estimated needs {together}; {self.budget()}, so not limited"
        return f"every worker side by side: estimated needs {together} fit {self.budget()}"


__all__ = ["EngineNeed", "MemoryPlanRecord"]
