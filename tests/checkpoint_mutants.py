"""Checkpoint mutants, enumerated from a checkpoint itself (tests/test_checkpoint_fuzz.py).

For one checkpoint folder (a target or a draft), every mutation a converter, an exporter or a hand
edit makes, one fault each:

  tensors (every tensor of its safetensors files)
    dropped        the tensor is not in the file
    truncated      its first dim one shorter (a shard cut short, a vocab or layer count off by one)
    grown          its last dim one longer (a padded vocab, a head dim off by one)
    transposed     a 2-D tensor stored [in, out] instead of [out, in] (square ones are left out: a
                   transposed square matrix is another matrix of the same shape, only values differ)
    nan            every value NaN (floating-point tensors only: an integer map such as d2t holds no NaN)
  config.json (every key, and every key of a nested object one level down: eagle_config.*, rope_parameters.*)
    missing            the key removed
    string-for-number  a number (or a bool) written as its string: 128 -> "128", true -> "true"
    number-for-string  a string written as the number 1
    list-for-scalar    a scalar written as a one-element list: 128 -> [128]

A mutant is materialised as a folder beside the others (`Mutant.write`): the mutated file written,
every other file of the source linked, so a few hundred mutants of a 12 MB target cost one file each.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

TENSOR_KINDS = ("dropped", "truncated", "grown", "transposed", "nan")
CONFIG_KINDS = ("missing", "string-for-number", "number-for-string", "list-for-scalar")
KINDS = TENSOR_KINDS + CONFIG_KINDS
NESTED = ("eagle_config", "rope_parameters", "rope_scaling")  # nested objects whose keys are mutated too


@dataclass(frozen=True)
class Mutant:
    """One fault in one checkpoint: `side` (target or draft) of a pair, `kind` (KINDS), `name` (the
    tensor as stored, or the config key, dotted when nested: eagle_config.eagle_aux_hidden_state_layer_ids)."""

    source: Path
    side: str
    kind: str
    name: str

    @property
    def key(self) -> str:
        """The leaf a message must name: the tensor's stored name, or the config key's last part."""
        return self.name if self.kind in TENSOR_KINDS else self.name.rsplit(".", 1)[-1]

    def label(self) -> str:
        return f"{self.side} {self.kind} {self.name}"

    def write(self, out: Path) -> Path:
        """The mutated checkpoint at `out` (created): the mutated file written, the others linked."""
        out.mkdir(parents=True)
        changed = "config.json" if self.kind in CONFIG_KINDS else _tensor_file(self.source, self.name).name
        for f in self.source.iterdir():
            if f.name != changed:
                os.symlink(f.resolve(), out / f.name)
        if self.kind in CONFIG_KINDS:
            config = json.loads((self.source / "config.json").read_text())
            _mutate_config(config, self.kind, self.name)
            (out / "config.json").write_text(json.dumps(config, indent=2))
        else:
            _write_mutated_tensors(self.source / changed, out / changed, self.kind, self.name)
        return out


# -- enumeration ---------------------------------------------------------------------------------
def _header(f: Path) -> dict:
    """A safetensors file's JSON header: name -> {dtype, shape, data_offsets}, and __metadata__."""
    with f.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(n))


def tensor_headers(checkpoint: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor in the checkpoint's safetensors files (headers only)."""
    out = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        out.update({k: (v["dtype"], v["shape"]) for k, v in _header(f).items() if k != "__metadata__"})
    return out


def tensor_mutants(checkpoint: Path, side: str) -> Iterator[Mutant]:
    for name, (dtype, shape) in sorted(tensor_headers(checkpoint).items()):
        yield Mutant(checkpoint, side, "dropped", name)
        if shape and shape[0] > 1:
            yield Mutant(checkpoint, side, "truncated", name)
        if shape:
            yield Mutant(checkpoint, side, "grown", name)
        if len(shape) == 2 and shape[0] != shape[1]:
            yield Mutant(checkpoint, side, "transposed", name)
        if dtype.startswith(("F", "BF")):
            yield Mutant(checkpoint, side, "nan", name)


def _config_kinds(value) -> list[str]:
    kinds = ["missing"]
    if isinstance(value, (bool, int, float)):
        kinds.append("string-for-number")
    if isinstance(value, str):
        kinds.append("number-for-string")
    if isinstance(value, (bool, int, float, str)):
        kinds.append("list-for-scalar")
    return kinds


def config_mutants(checkpoint: Path, side: str) -> Iterator[Mutant]:
    config = json.loads((checkpoint / "config.json").read_text())
    for key, value in config.items():
        for kind in _config_kinds(value):
            yield Mutant(checkpoint, side, kind, key)
        if key in NESTED and isinstance(value, dict):
            for sub, sub_value in value.items():
                for kind in _config_kinds(sub_value):
                    yield Mutant(checkpoint, side, kind, f"{key}.{sub}")


def mutants(checkpoint: Path, side: str) -> list[Mutant]:
    """Every mutant of one checkpoint, in a fixed order."""
    return [*tensor_mutants(checkpoint, side), *config_mutants(checkpoint, side)]


def sample(all_mutants: Iterable[Mutant], per_kind: int, rng: random.Random) -> list[Mutant]:
    """Up to `per_kind` mutants of each (side, kind) present, drawn by `rng`; every (side, kind) that
    has a mutant keeps at least one. per_kind <= 0: all of them."""
    groups: dict[tuple[str, str], list[Mutant]] = {}
    for m in all_mutants:
        groups.setdefault((m.side, m.kind), []).append(m)
    out: list[Mutant] = []
    for key in sorted(groups):
        group = groups[key]
        out += group if per_kind <= 0 or len(group) <= per_kind else rng.sample(group, per_kind)
    return out


# -- materialising -------------------------------------------------------------------------------
def _tensor_file(checkpoint: Path, name: str) -> Path:
    return next(f for f in sorted(checkpoint.glob("*.safetensors")) if name in _header(f))


def _write_mutated_tensors(src: Path, dst: Path, kind: str, name: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), "pt") as h:
        metadata = h.metadata()
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    t = tensors[name]
    if kind == "dropped":
        del tensors[name]
    elif kind == "truncated":
        tensors[name] = t[: t.shape[0] - 1].clone()
    elif kind == "grown":
        import torch

        pad = torch.zeros(*t.shape[:-1], 1, dtype=t.dtype)
        tensors[name] = torch.cat([t, pad], dim=-1)
    elif kind == "transposed":
        tensors[name] = t.t().contiguous()
    elif kind == "nan":
        tensors[name] = t.clone().fill_(float("nan"))
    else:
        raise ValueError(f"not a tensor mutation: {kind}")
    save_file(tensors, str(dst), metadata=metadata)


def _mutate_config(config: dict, kind: str, name: str) -> None:
    *parents, leaf = name.split(".")
    holder = config
    for p in parents:
        holder = holder[p]
    value = holder[leaf]
    if kind == "missing":
        del holder[leaf]
    elif kind == "string-for-number":
        holder[leaf] = json.dumps(value)  # 128 -> "128", True -> "true", 1e-06 -> "1e-06"
    elif kind == "number-for-string":
        holder[leaf] = 1
    elif kind == "list-for-scalar":
        holder[leaf] = [value]
    else:
        raise ValueError(f"not a config mutation: {kind}")
