"""The memory plan: whether a run's engines fit the machine all at once, or run one (or as many as
fit) at a time.

Every engine's worker holds its models for the whole run, so three engines each holding an 8B model
in bf16 (16 GB each) do not fit a 24 GB machine and the kernel kills one mid-run. Before a worker
starts, the pool (difftest.run.pool.EnginePool) estimates each engine's resident need from the
case's checkpoints (parameter bytes read from the safetensors headers of the target and the draft,
at the dtype the engine loads them in) plus what the engine declares of itself: its class's MEMORY
mapping (MemoryFactors' fields; an engine that declares none is counted as DEFAULT_FACTORS). The
core names no engine here: each adapter in difftest_engines/ declares its own factors.

What is available: the machine's available memory (MemAvailable, within the cgroup's limit) and,
for an engine that runs on a GPU where there is one, the GPU's free memory, both measured before
any worker of the run starts; or the budget DIFFTEST_MEMORY_BUDGET declares (BUDGET_ENV: "20GB",
"host=20GB,gpu=70GB"; refused in one line when malformed), which tests and shared machines use.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping

from difftest.base.dtypes import CALIBRATION, DType
from difftest.base.errors import ConfigError
from difftest.base.settings import suggest
from difftest.rules.checkpoint_integrity import stored_tensors

BUDGET_ENV = "DIFFTEST_MEMORY_BUDGET"
BUDGET_EXAMPLES = "e.g. 20GB, 512MiB, host=20GB,gpu=70GB"
GB = 10**9  # what the plan's lines print in

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([A-Za-z]+)\s*$")
_PLACES = ("host", "gpu")

# bytes per element of the floating-point dtypes an engine loads weights in; other stored tensors
# (int64 vocabulary maps, ...) keep their stored width
_FLOAT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_STORED_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2}
_STORED_BYTES.update({"F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8})
_FLOAT_CODES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class MemoryFactors:
    """What an engine declares of its own resident memory (its adapter class's MEMORY mapping,
    these fields by name)."""

    overhead_gb: float = 0.5  # its processes with no model loaded: interpreters, libraries, runtimes
    kv_gb: float = 0.0  # the KV cache it reserves beside the weights
    kv_setting: str = ""  # a setting of the engine sizing its KV cache in GiB (read from the case; wins over kv_gb)
    weight_copies: float = 1.0  # resident copies of target + draft weights at the case's dtype
    # what the float64 calibration run (the engine that calibrates: the noise floor) holds, in whole
    # float64 copies of the models: 1.0 loads the whole copy, a run streamed layer by layer less
    calibration_copies: float = 1.0
    # the float64 run streamed (not whole copies: calibration_copies unused): it holds the target's largest
    # decoder layer or other tensor in float64 at a time, and the draft's whole float64 copy but its
    # embedding table (Load.streamed_bytes); it reads the weights from the case's own load where the worker
    # holds it, else from the checkpoint's files, memory-mapped: no source load is counted (worker_bytes)
    calibration_streamed: bool = False
    keeps_every_case: bool = False  # a worker keeps every case's models loaded (its memory grows over cases)
    on_gpu: bool = False  # where a GPU is present, its weights and KV cache live in GPU memory

    @classmethod
    def declared(cls, name: str, raw: object) -> "MemoryFactors":
        """`raw` (an adapter's MEMORY) as factors; an unknown or ill-typed key is refused in one line."""
        if raw is None:
            return DEFAULT_FACTORS
        if not isinstance(raw, Mapping):
            raise ConfigError(f"engine {name}: MEMORY must be a mapping of {', '.join(_FACTOR_NAMES)}")
        for key, value in raw.items():
            if key not in _FACTOR_NAMES:
                raise ConfigError(f"engine {name}: MEMORY: unknown factor {key!r}{suggest(str(key), _FACTOR_NAMES)}")
            kind = type(getattr(DEFAULT_FACTORS, key))
            ok = isinstance(value, kind) if kind is not float else isinstance(value, (int, float))
            if not ok or isinstance(value, bool) != (kind is bool):
                raise ConfigError(f"engine {name}: MEMORY: {key} must be a {kind.__name__}, got {value!r}")
        return cls(**dict(raw))


DEFAULT_FACTORS = MemoryFactors()  # an engine that declares nothing: its weights once and an interpreter
_FACTOR_NAMES = tuple(f.name for f in fields(MemoryFactors))


@dataclass(frozen=True)
class Need:
    """One engine's estimated resident bytes, on the host and on the GPU."""

    host: int
    gpu: int = 0

    def __add__(self, other: "Need") -> "Need":
        return Need(self.host + other.host, self.gpu + other.gpu)

    def fits(self, budget: "Budget") -> bool:
        return (budget.host is None or self.host <= budget.host) and (budget.gpu is None or self.gpu <= budget.gpu)

    def shown(self) -> str:
        return gb(self.host) + (f" + {gb(self.gpu)} GPU" if self.gpu else "")


ZERO = Need(0)


@dataclass(frozen=True)
class Budget:
    """What the run's workers may hold: bytes on the host and on a GPU (None: not known, not limited)."""

    host: int | None
    gpu: int | None = None
    source: str = "available"  # "available" (measured) or BUDGET_ENV

    def shown(self) -> str:
        if self.host is None and self.gpu is None:
            return "unknown memory"
        parts = [f"{gb(self.host)} GB" if self.host is not None else "unknown host memory"]
        if self.gpu is not None:
            parts.append(f"{gb(self.gpu)} GB of GPU memory")
        how = "available" if self.source == "available" else f"in {self.source}"
        return " and ".join(parts) + f" {how}"

    def shortfall(self, need: Need) -> tuple[str, str]:
        """What `need` exceeds, in words: ('9.1 GB', '6.0 GB is available')."""
        where = "is available" if self.source == "available" else f"is in {self.source}"
        if self.gpu is not None and need.gpu > self.gpu:
            return f"{gb(need.gpu)} GB of GPU memory", f"{gb(self.gpu)} GB {where}"
        return f"{gb(need.host)} GB", f"{gb(self.host or 0)} GB {where}"


def gb(n: int | float | None) -> str:
    return "?" if n is None else f"{n / GB:.1f}"


def parse_size(text: str, where: str) -> int:
    m = _SIZE.match(text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{where}: {text!r} is not a size with a unit ({BUDGET_EXAMPLES})")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_budget(text: str, where: str = BUDGET_ENV) -> Budget:
    """`20GB` (the host) or `host=20GB,gpu=70GB`; ConfigError in one line naming `where` otherwise."""
    if "=" not in text:
        return Budget(parse_size(text, where), None, where)
    sizes: dict[str, int] = {}
    for item in text.split(","):
        place, sep, size = (s.strip() for s in item.partition("="))
        if not sep or place not in _PLACES:
            raise ConfigError(
                f"{where}: {item.strip()!r} is not host=SIZE or gpu=SIZE{suggest(place, _PLACES)} ({BUDGET_EXAMPLES})"
            )
        if place in sizes:
            raise ConfigError(f"{where}: {place} given twice")
        sizes[place] = parse_size(size, where)
    return Budget(sizes.get("host"), sizes.get("gpu"), where)


def declared_budget() -> Budget | None:
    """The budget BUDGET_ENV declares (None: unset, the machine is measured)."""
    text = os.environ.get(BUDGET_ENV, "").strip()
    return parse_budget(text) if text else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_free() -> int | None:
    """What the cgroup (v2) still allows, as SGLang counts it (srt/utils/common.py::get_free_cpu_memory)."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = Path("/sys/fs/cgroup/memory.current").read_text().strip()
    except OSError:
        return None
    if not (limit.isdigit() and current.isdigit()):
        return None  # "max": no limit
    return max(0, int(limit) - int(current))


def available_host() -> int | None:
    found = [v for v in (_meminfo_available(), _cgroup_free()) if v is not None]
    return min(found) if found else None


def available_gpu() -> int | None:
    """The first visible GPU's free memory (nvidia-smi), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        return int(out.split()[0]) << 20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def measured_budget() -> Budget:
    return Budget(available_host(), available_gpu(), "available")


def weight_bytes(checkpoint: str | Path, dtype: str) -> int:
    """The bytes of a checkpoint's tensors once loaded at `dtype` (floating-point tensors at `dtype`,
    others at their stored width), from its safetensors headers; a checkpoint of other files counts
    its files' sizes. A checkpoint that cannot be read counts 0: its own check names the fault."""
    path = Path(checkpoint)
    per = _FLOAT_BYTES[DType(dtype).value]
    try:
        tensors, _ = stored_tensors(path)
    except (ConfigError, OSError):
        return 0
    if not tensors:
        return sum(f.stat().st_size for f in path.glob("*.bin") if f.is_file()) if path.is_dir() else 0
    total = 0
    for t in tensors.values():
        n = 1
        for d in t.shape:
            n *= d
        total += n * (per if t.dtype in _FLOAT_CODES else _STORED_BYTES.get(t.dtype, 4))
    return total


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def largest_part_bytes(checkpoint: str | Path, dtype: str) -> int:
    """The bytes at `dtype` of a checkpoint's largest streamed part: one decoder layer's tensors
    together (`...layers.N.`); without such layers, its largest tensor; what a float64 run streamed
    layer by layer holds of it at a time (0 where it cannot be read)."""
    per = _FLOAT_BYTES[DType(dtype).value]
    try:
        tensors, _ = stored_tensors(Path(checkpoint))
    except (ConfigError, OSError):
        return 0
    parts: dict[str, int] = {}
    for name, t in tensors.items():
        n = per if t.dtype in _FLOAT_CODES else _STORED_BYTES.get(t.dtype, 4)
        for d in t.shape:
            n *= d
        layer = _LAYER.search(name)
        key = f"layer {layer.group(1)}" if layer else name
        parts[key] = parts.get(key, 0) + n
    layers = [n for key, n in parts.items() if key.startswith("layer ")]
    # the output head is upcast in chunks no larger than a layer, the embedding only its looked-up rows
    # (difftest_engines/ref/streamed.py): with decoder layers, the largest of them is the most at once
    return max(layers or parts.values(), default=0)


_EXACT_CODES = {"F32", "BF16", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL"}  # a float32 load holds them


def looked_up_bytes(checkpoint: str | Path, dtype: str) -> int:
    """The bytes at `dtype` of a draft's stored embedding table (`embed_tokens.weight`), which a float64
    run streamed beside its target never holds whole: it looks the rows up from the source's draft. 0
    where the draft stores none (it shares the target's) or stores a tensor wider than float32 (the
    source would round it: the run keeps the whole table) or cannot be read."""
    try:
        tensors, _ = stored_tensors(Path(checkpoint))
    except (ConfigError, OSError):
        return 0
    table = tensors.get("embed_tokens.weight")
    if table is None or {t.dtype for t in tensors.values()} - _EXACT_CODES:
        return 0
    n = _FLOAT_BYTES[DType(dtype).value]
    for d in table.shape:
        n *= d
    return n


@dataclass(frozen=True)
class Load:
    """One set of models a worker loads: a case's target and draft at a dtype (`source`: for a float64
    load, the dtype of the case's weights, which a streamed float64 run rounds them through)."""

    target: str
    draft: str
    dtype: str
    source: str = ""

    def bytes(self) -> int:
        return _weight_bytes(self.target, self.dtype) + (_weight_bytes(self.draft, self.dtype) if self.draft else 0)

    def streamed_bytes(self) -> int:
        """What a streamed float64 run holds: the target's largest part and the draft's whole copy, in
        float64, less the draft's embedding table (its rows are looked up from the draft's file:
        difftest_engines/ref/streamed.py StreamedTarget.stream_embedding). Its weights are read from the
        checkpoint's files, memory-mapped (difftest_engines/ref/mapped.py), or from the case's own load
        where the same worker holds it (counted as that load): no load of the target is held for it."""
        target = _largest_part_bytes(self.target, CALIBRATION.value)
        if not self.draft:
            return target
        return target + _weight_bytes(self.draft, CALIBRATION.value) - _looked_up_bytes(self.draft, CALIBRATION.value)


@functools.lru_cache(maxsize=256)
def _weight_bytes(checkpoint: str, dtype: str) -> int:
    """weight_bytes, read once per run (the plan asks for every worker request)."""
    return weight_bytes(checkpoint, dtype)


@functools.lru_cache(maxsize=256)
def _looked_up_bytes(checkpoint: str, dtype: str) -> int:
    return looked_up_bytes(checkpoint, dtype)


@functools.lru_cache(maxsize=256)
def _largest_part_bytes(checkpoint: str, dtype: str) -> int:
    return largest_part_bytes(checkpoint, dtype)


def load_bytes(factors: MemoryFactors, load: Load) -> int:
    """The bytes `load` adds to a worker: a float64 load is the calibration run's (no case computes in
    float64), counted at the engine's declared calibration_copies, or streamed (its source apart:
    worker_bytes)."""
    if load.dtype != CALIBRATION.value:
        return load.bytes()
    if factors.calibration_streamed:
        return load.streamed_bytes()
    return int(load.bytes() * factors.calibration_copies)


def worker_bytes(factors: MemoryFactors, loads: list[Load]) -> int:
    """The bytes a worker holding `loads` holds: each load's. A streamed float64 run adds no source:
    it reads the case's own load where the worker holds it (counted once, as that load), else the
    checkpoint's safetensors files memory-mapped, whose pages are the kernel's page cache (clean, dropped
    under pressure), not the worker's. At the Llama-3.1-8B shape in bfloat16 this is what lets the
    calibration fit a 24 GB machine: a fresh worker holds ~6 GB for it where one reading a bfloat16 load
    held 22 GB (the plan starts that fresh worker when the case's load and the calibration do not fit
    together: difftest.run.pool.EnginePool._make_room)."""
    return sum(load_bytes(factors, ld) for ld in loads)


def held_words(factors: MemoryFactors, load: Load) -> str:
    """What an engine's estimate for `load` counts, in the words of a refusal."""
    if load.dtype == CALIBRATION.value and factors.calibration_streamed:
        return (
            f"the float64 run streamed from the files of {load.target} and its draft: the target's largest "
            "layer and the draft but its embedding table in float64, and the engine's declared overhead"
        )
    return f"{load.dtype} weights of {load.target} and its draft, and the engine's declared overhead"


def need_of(factors: MemoryFactors, weights: int, kv_gib: float | None, gpu_present: bool) -> Need:
    """An engine's resident need holding `weights` bytes of models (kv_gib: its KV setting's value)."""
    kv = int((kv_gib if kv_gib is not None else factors.kv_gb) * (1 << 30 if kv_gib is not None else GB))
    held = int(weights * factors.weight_copies) + kv
    overhead = int(factors.overhead_gb * GB)
    if factors.on_gpu and gpu_present:
        return Need(overhead, held)
    return Need(overhead + held)


def loads_for(target: str, draft: str, dtype: str, calibrates: bool, weights_dtype: str | None = None) -> list[Load]:
    """What an engine loads for a case: its models at the case's dtype, and for the engine that
    calibrates the same models in float64 too (the noise floor's run, difftest.compare.noise), read
    from the case's dtype (or, for the float64 case itself, from `weights_dtype`, its weights' dtype)."""
    if str(dtype) == CALIBRATION.value:
        return [Load(target, draft, CALIBRATION.value, str(weights_dtype or ""))]
    loads = [Load(target, draft, str(dtype))]
    if calibrates:
        loads.append(Load(target, draft, CALIBRATION.value, str(dtype)))
    return loads


@dataclass(frozen=True)
class Plan:
    """A case's plan: each engine's need, what is available, and whether all fit at once."""

    needs: dict[str, Need]
    budget: Budget

    @property
    def total(self) -> Need:
        out = ZERO
        for n in self.needs.values():
            out = out + n
        return out

    @property
    def all_at_once(self) -> bool:
        return self.total.fits(self.budget)

    def line(self) -> str:
        """'memory plan: ref 4.1 GB, vllm 5.0 GB of 22.0 GB available: all at once'."""
        engines = ", ".join(f"{k} {n.shown()} GB" for k, n in self.needs.items())
        how = "all at once" if self.all_at_once else "one at a time"
        return f"memory plan: {engines} of {self.budget.shown()}: {how}"


__all__ = [
    "BUDGET_ENV",
    "Budget",
    "DEFAULT_FACTORS",
    "Load",
    "MemoryFactors",
    "Need",
    "Plan",
    "declared_budget",
    "held_words",
    "largest_part_bytes",
    "load_bytes",
    "loads_for",
    "measured_budget",
    "need_of",
    "parse_budget",
    "weight_bytes",
    "worker_bytes",
]
