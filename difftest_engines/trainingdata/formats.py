"""Offline EAGLE-3 training data on disk: readers and writers for the trainers' formats.

Every format reduces to one `Sample` per sequence: the token ids, the loss mask, and the
dumped hidden states as a list of [seq, H] tensors *in the order the file holds them*;
the first `fc_count` are what the trainer concatenates into fc, the one after them is
what it treats as the verifier's last hidden state. Which target layer each tensor is,
the files do not say (see difftest_engines.trainingdata.layer_identity).

speculators (current; vllm-project/speculators `train/data.py::ArrowDataset`):
    DIR/hidden_states/hs_{i}.safetensors   hidden_states [seq, n_layers, H], token_ids [seq]
    DIR/ (datasets save_to_disk)           input_ids, loss_mask, seq_len per sample i
  The dataset part is the folder `prepare-data` writes with `datasets`' save_to_disk: state.json
  lists `_data_files` (data-00000-of-0000N.arrow, Arrow IPC streams), read here with pyarrow
  directly (a difftest dependency), so the default install reads real data without `datasets`.
  Or DIR/samples.jsonl ({"index", "input_ids", "loss_mask"} a line), which `difftest dump` writes.
  The hidden states may live elsewhere (`generate-offline-data --output`, the trainer's
  `--hidden-states-path`): read_dump(..., hidden_states=PATH).
  The trainer checks token_ids == input_ids, feeds fc hidden_states[:, :-1] (flattened)
  and uses hidden_states[:, -1] as the verifier.
speculators legacy (`SampleFileDataset` / `standardize_data_v1`):
    DIR/**/*.pt (torch.save)   input_ids [seq], loss_mask [seq], hidden_states: list of [seq, H]
  fc = cat(list[:-1]), verifier = list[-1].
SpecForge offline (0.2.0 `scripts/prepare_hidden_states.py`, read by
`runtime/data_plane/offline_reader.py::list_feature_files` / `feature_store.load_feature_file`):
    DIR/rows_A-B/data_{i}.ckpt, or .ckpt.gz with --compress (gzip of the torch.save bytes)
                               input_ids [seq], loss_mask [seq], aux_hidden_state [1, seq, A*H],
                               hidden_state [1, seq, H] (after the target's final norm)
  Files are taken in sorted path order, as SpecForge's reader does.
  fc = aux_hidden_state (split here into A chunks of H), verifier = hidden_state.

Auxiliary files the trainers write next to the samples (SpecForge `vocab_mapping/vocab_mapping.pt`,
speculators `token_freq.pt`, `d2t-*.npy`) are never taken for samples.

Torch files are loaded with `weights_only=True`. A sample that cannot be used (truncated
file, token ids != input ids, lengths that disagree, NaN/Inf, a layer count or hidden
size unlike the rest, non-float hidden states) is skipped with one line naming the file
and the field; the others load.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from difftest.api import ConfigError
from difftest.api import first_line

FORMATS = ("speculators", "speculators-legacy", "specforge")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class Sample:
    index: int
    source: str  # the file the hidden states came from
    input_ids: torch.Tensor  # [seq] int64
    loss_mask: torch.Tensor  # [seq] bool
    tensors: list[torch.Tensor]  # dumped hidden states in file order, each [seq, H]
    fc_count: int  # the trainer feeds cat(tensors[:fc_count]) to fc; tensors[fc_count] is its verifier

    @property
    def fc_in(self) -> torch.Tensor:
        return torch.cat(self.tensors[: self.fc_count], dim=-1)  # [seq, A*H]

    @property
    def verifier(self) -> torch.Tensor:
        return self.tensors[self.fc_count]  # [seq, H]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class Dump:
    path: str
    format: str
    samples: list[Sample]
    skipped: list[str] = field(default_factory=list)  # one line per unusable sample
    notes: list[str] = field(default_factory=list)
    # speculators: the rows of the dataset part, usable or not, as the trainer's len(load_from_disk(DIR)) counts
    # them (its train/validation split is taken from this, difftest_engines.trainingdata.split); None when unknown
    dataset_rows: int | None = None

    def find(self, prompt_ids: list[int]) -> tuple[Sample, int] | None:
        """The first sample whose token ids start with prompt_ids, and the prompt length."""
        want = torch.tensor(prompt_ids, dtype=torch.long)
        n = len(prompt_ids)
        for s in self.samples:
            if len(s) >= n and torch.equal(s.input_ids[:n], want):
                return s, n
        return None


class SampleError(Exception):
    """One sample is unusable; the message is `file: field: what`."""


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------


SPECFORGE_SUFFIXES = (".ckpt", ".ckpt.gz")
# written by the trainers next to their samples; never a sample (SpecForge vocab_mapping/vocab_mapping.pt,
# speculators train/cli.py token_freq.pt)
AUXILIARY_NAMES = {"vocab_mapping.pt", "token_freq.pt"}
AUXILIARY_DIRS = {"vocab_mapping"}


def _is_auxiliary(p: Path, root: Path) -> bool:
    rel = p.relative_to(root)
    return p.name in AUXILIARY_NAMES or any(part in AUXILIARY_DIRS for part in rel.parts[:-1])


def specforge_files(path: Path) -> list[Path]:
    return sorted((p for p in path.rglob("*") if p.name.endswith(SPECFORGE_SUFFIXES) and p.is_file()), key=str)


def legacy_files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*.pt") if p.is_file() and not _is_auxiliary(p, path)]


def detect_format(path: Path, hidden_states: Path | None = None) -> str:
    if hidden_states is not None or (path / "hidden_states").is_dir():
        return "speculators"
    if specforge_files(path):
        return "specforge"
    if legacy_files(path):
        return "speculators-legacy"
    if (path / "dataset_dict.json").is_file():
        _arrow_files(path)  # refused, naming the split folders to give instead
    dataset = describe_dataset_part(path)
    if dataset is not None:  # prepare-data's output alone: the hidden states went elsewhere
        raise ConfigError(
            f"{path}: holds {dataset} but no hidden states: expected {path / 'hidden_states'}/hs_*.safetensors; "
            f"if `generate-offline-data --output` put them elsewhere, give that folder with "
            "hidden_states=DIR (train-acc: --hidden-states DIR)"
        )
    raise ConfigError(
        f"{path}: no training data found (expected hidden_states/hs_*.safetensors (speculators), "
        "*.pt (speculators legacy) or rows_*/data_*.ckpt[.gz] (SpecForge offline))"
    )


def _numbered(paths) -> list[Path]:
    def key(p: Path):
        m = re.search(r"(\d+)$", p.name.split(".")[0])
        return (int(m.group(1)) if m else -1, str(p))

    return sorted(paths, key=key)


def _torch_load(path: Path) -> dict:
    try:
        if path.name.endswith(".gz"):  # SpecForge --compress: gzip of the torch.save stream
            with gzip.open(path, "rb") as f:
                data = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's text advises weights_only=False, which would run the pickle
        raise SampleError(
            f"{path}: refused: not a plain-tensor file (it holds objects other than tensors, "
            "which difftest never unpickles)"
        ) from None
    except Exception as e:  # torch raises RuntimeError/EOFError/UnpicklingError, gzip BadGzipFile/EOFError
        raise SampleError(f"{path}: cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    if not isinstance(data, dict):
        raise SampleError(f"{path}: expected a dict of tensors, got {type(data).__name__}")
    return data


def _field(data: dict, name: str, path: Path):
    if name not in data:
        raise SampleError(f"{path}: {name}: field missing (fields: {', '.join(sorted(map(str, data)))})")
    return data[name]


def _ids(value, name: str, path: Path) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise SampleError(f"{path}: {name}: expected shape [seq], got {list(t.shape)}")
    if t.is_floating_point() or t.dtype == torch.bool:
        raise SampleError(f"{path}: {name}: expected integer token ids, got dtype {t.dtype}")
    return t.long()


def _mask(value, seq: int, path: Path) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.shape[0] != seq:
        raise SampleError(f"{path}: loss_mask: shape {list(t.shape)}, expected [{seq}] (the length of input_ids)")
    return t != 0


def _hidden(t, name: str, seq: int, path: Path) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise SampleError(f"{path}: {name}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise SampleError(f"{path}: {name}: dtype {t.dtype}, expected a floating-point hidden state")
    if t.shape[0] != seq:
        raise SampleError(
            f"{path}: {name}: {t.shape[0]} positions, but input_ids has {seq} (truncated or mismatched dump)"
        )
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise SampleError(f"{path}: {name}: {bad} NaN/Inf values")
    return t


def _check_consistent(sample: Sample, first: Sample | None, path: Path) -> None:
    if first is None:
        return
    if len(sample.tensors) != len(first.tensors) or sample.fc_count != first.fc_count:
        raise SampleError(
            f"{path}: hidden_states: {len(sample.tensors)} layers ({sample.fc_count} for fc), but {first.source} "
            f"has {len(first.tensors)} ({first.fc_count} for fc)"
        )
    h, h0 = sample.tensors[0].shape[-1], first.tensors[0].shape[-1]
    if h != h0:
        raise SampleError(f"{path}: hidden_states: hidden size {h}, but {first.source} has {h0}")


def _read_speculators_sample(path: Path, index: int, rows: dict[int, dict] | None) -> Sample:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        data = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise SampleError(f"{path}: cannot be read ({str(e).splitlines()[0][:120]})") from None
    hs = _field(data, "hidden_states", path)
    token_ids = _ids(_field(data, "token_ids", path), "token_ids", path)
    if rows is None:  # no dataset part (said in the dump's notes): token ids stand for input_ids, every position counts
        row = {"input_ids": token_ids, "loss_mask": torch.ones(len(token_ids))}
    elif index not in rows:
        raise SampleError(f"{path}: input_ids: sample {index} is not in the dataset")
    else:
        row = rows[index]
    if "loss_mask" not in row:
        # scoring it as all ones would count the prompt's positions as trained: refused, not assumed
        raise SampleError(f"{row.get('where', path)}: loss_mask missing (every position would count as trained)")
    input_ids = _ids(row["input_ids"], "input_ids (dataset)", path)
    if token_ids.shape != input_ids.shape or not torch.equal(token_ids, input_ids):
        n = min(len(token_ids), len(input_ids))
        first = next((i for i in range(n) if int(token_ids[i]) != int(input_ids[i])), n)
        raise SampleError(
            f"{path}: token_ids: {len(token_ids)} tokens do not equal the dataset's input_ids ({len(input_ids)} tokens); "
            f"first difference at position {first}"
        )
    if hs.dim() != 3:
        raise SampleError(f"{path}: hidden_states: expected [seq, n_layers, H], got {list(hs.shape)}")
    if hs.shape[1] < 2:
        raise SampleError(f"{path}: hidden_states: {hs.shape[1]} layer(s); the trainer needs fc inputs plus a verifier")
    hs = _hidden(hs, "hidden_states", len(input_ids), path)
    mask = _mask(row["loss_mask"], len(input_ids), path)
    tensors = [hs[:, j] for j in range(hs.shape[1])]
    return Sample(index, str(path), input_ids, mask, tensors, len(tensors) - 1)


def _dataset_rows(path: Path) -> tuple[dict[int, dict], list[str], int | None]:
    """input_ids/loss_mask per sample index from the speculators dataset part, and its row count (for
    samples.jsonl: its lines when they are numbered 0..N-1 with none left out, else None)."""
    jsonl = path / "samples.jsonl"
    if jsonl.exists():
        rows: dict[int, dict] = {}
        bad: list[str] = []
        lines = 0
        for n, line in enumerate(jsonl.read_text().splitlines()):
            if not line.strip():
                continue
            lines += 1
            try:
                row = json.loads(line)
                index = row["index"]
                if not isinstance(index, int) or isinstance(index, bool) or "input_ids" not in row:
                    raise TypeError
                rows[index] = {**row, "where": f"{jsonl}: line {n + 1}"}
            except (json.JSONDecodeError, KeyError, TypeError):
                # its sample is then skipped as "not in the dataset"; the other rows stand
                bad.append(
                    f'{jsonl}: line {n + 1}: expected {{"index": N, "input_ids": [...], "loss_mask": [...]}} '
                    "(row skipped)"
                )
        numbered = not bad and sorted(rows) == list(range(lines))
        return rows, bad, lines if numbered else None
    if is_arrow_dataset(path):
        return read_arrow_rows(path)
    return {}, [f"{path}: no dataset (samples.jsonl or arrow): input_ids = token_ids, loss_mask = all ones"], None


# ---------------------------------------------------------------------------------------
# The speculators dataset part: a `datasets` save_to_disk folder, read with pyarrow
# ---------------------------------------------------------------------------------------
# Layout (datasets `arrow_dataset.py::Dataset.save_to_disk`, as speculators 0.9.0
# `cli/prepare_data.py` calls it): DIR/state.json {"_data_files": [{"filename": ...}], ...},
# DIR/dataset_info.json (features), DIR/data-XXXXX-of-YYYYY.arrow, each an Arrow IPC *stream*.
# Row i over the files in state.json's order is the sample whose hidden states are hs_{i}
# (speculators `train/data.py::ArrowDataset` indexes load_from_disk(DIR) the same way).


def is_arrow_dataset(path: Path) -> bool:
    """A save_to_disk folder (or a DatasetDict's, which _arrow_files refuses naming its splits)."""
    return (
        any((path / n).is_file() for n in ("state.json", "dataset_dict.json"))
        or next(path.glob("*.arrow"), None) is not None
    )


def _arrow_files(path: Path) -> list[Path]:
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():  # DatasetDict.save_to_disk: one folder per split
        try:
            splits = ", ".join(str(x) for x in json.loads(dict_file.read_text()).get("splits", []))
        except (ValueError, AttributeError):
            splits = "?"
        raise ConfigError(
            f"{path}: is a dataset dictionary (splits: {splits}); give one split's folder, e.g. {path}/train"
        )
    state_file = path / "state.json"
    if not state_file.is_file():  # no state.json: the shards by name (zero-padded, so name order is shard order)
        return sorted(path.glob("*.arrow"))
    try:
        state = json.loads(state_file.read_text())
        names = [str(f["filename"]) for f in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f'{state_file}: expected datasets\' save_to_disk state (a "_data_files" list of '
            f'{{"filename": ...}}), could not read it ({type(e).__name__})'
        ) from None
    if state.get("_indices_data_files"):  # an index mapping: rows are not the files' rows in order
        raise ConfigError(
            f"{state_file}: the dataset has an indices mapping (_indices_data_files); re-save it with "
            "`datasets` save_to_disk, which writes the selected rows themselves"
        )
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise ConfigError(f"{state_file}: lists {missing[0]}, which is not in {path}")
    return [path / n for n in names]


def _import_pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.ipc
    except ImportError:  # a venv from before pyarrow was a dependency
        raise ConfigError(
            "pyarrow is not installed (a difftest dependency, needed for the speculators arrow dataset); "
            "run `bash scripts/setup`"
        ) from None
    return pa


def _record_batches(pa, f: Path):
    """The record batches of one shard: an Arrow IPC stream as datasets writes it, or the IPC file format."""
    try:
        source = pa.memory_map(str(f))
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            return [reader.get_batch(i) for i in range(reader.num_record_batches)]
        return list(reader)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"{f}: cannot be read as an Arrow stream ({first_line(e)})") from None


def _list_column(pa, batch, name: str, f: Path) -> list[torch.Tensor | None]:
    """One list-of-integers column as per-row int64 tensors (None for a null row)."""
    col = batch.column(batch.schema.get_field_index(name))
    ok = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
    if not ok or not (pa.types.is_integer(col.type.value_type) or pa.types.is_boolean(col.type.value_type)):
        raise ConfigError(f"{f}: column {name}: type {col.type}, expected a list of integers")
    # offsets index into the whole child array (a sliced column keeps its parent's), so both are taken whole
    offsets = col.offsets.to_numpy(zero_copy_only=False)
    values = torch.from_numpy(col.values.to_numpy(zero_copy_only=False).astype("int64"))
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    return [values[int(offsets[r]) : int(offsets[r + 1])] if valid[r] else None for r in range(len(col))]


def read_arrow_rows(path: Path) -> tuple[dict[int, dict], list[str], int]:
    """input_ids / loss_mask per row index from a save_to_disk folder, and the number of rows. A row whose
    input_ids is null is left out (its sample is then skipped as not in the dataset) with one line naming it."""
    pa = _import_pyarrow()
    files = _arrow_files(path)
    if not files:
        raise ConfigError(f"{path}: no data-*.arrow files (the dataset part is empty)")
    rows: dict[int, dict] = {}
    problems: list[str] = []
    index = 0
    has_mask = True
    for f in files:
        for batch in _record_batches(pa, f):
            names = batch.schema.names
            if "input_ids" not in names:
                raise ConfigError(f"{f}: no input_ids column (columns: {', '.join(names)})")
            ids = _list_column(pa, batch, "input_ids", f)
            has_mask = has_mask and "loss_mask" in names
            masks = _list_column(pa, batch, "loss_mask", f) if "loss_mask" in names else [None] * len(ids)
            for r, (i, m) in enumerate(zip(ids, masks)):
                if i is None:
                    problems.append(f"{f}: row {index + r}: input_ids is null (row skipped)")
                elif "loss_mask" not in names:  # no mask column (said in the notes below): every position counts
                    rows[index + r] = {"input_ids": i, "loss_mask": torch.ones(len(i))}
                elif m is None:  # a null mask in a masked dataset: its sample is skipped, naming the row
                    rows[index + r] = {"input_ids": i, "where": f"{f}: row {index + r}"}
                else:
                    rows[index + r] = {"input_ids": i, "loss_mask": m}
            index += batch.num_rows
    if not has_mask:
        problems.append(f"{path}: the dataset has no loss_mask column: every position counts")
    return rows, problems, index


def describe_dataset_part(path: Path) -> str | None:
    """'a speculators arrow dataset (N samples in data-....arrow)' for a folder holding a dataset part
    (an arrow save_to_disk folder or samples.jsonl), else None. Only names things: an unreadable
    dataset is still described, its problem is reported when it is read."""
    if (path / "samples.jsonl").is_file():
        return "a speculators dataset part (samples.jsonl)"
    if not is_arrow_dataset(path):
        return None
    try:
        pa = _import_pyarrow()
        files = _arrow_files(path)
        n = sum(b.num_rows for f in files for b in _record_batches(pa, f))
        shown = files[0].name + (f" .. {files[-1].name}" if len(files) > 1 else "")
        return f"a speculators arrow dataset ({n} samples in {shown})"
    except (ConfigError, IndexError):
        return "a speculators arrow dataset (state.json / *.arrow)"


def read_dump(
    path: str | Path, fmt: str = "auto", limit: int | None = None, hidden_states: str | Path | None = None
) -> Dump:
    """hidden_states: the speculators hs_*.safetensors folder when it is not PATH/hidden_states."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: training data directory not found")
    hs_dir = Path(hidden_states) if hidden_states else None
    if hs_dir is not None and not hs_dir.is_dir():
        raise ConfigError(f"hidden_states={hs_dir}: directory not found")
    fmt = detect_format(path, hs_dir) if fmt in ("auto", None, "") else fmt
    if hs_dir is not None and fmt != "speculators":
        raise ConfigError(
            f"hidden_states={hs_dir}: only the speculators format keeps hidden states apart from the dataset (format {fmt})"
        )
    if fmt not in FORMATS:
        raise ConfigError(f"training data format {fmt!r}: expected one of {', '.join(FORMATS)} or auto")
    samples: list[Sample] = []
    skipped: list[str] = []
    notes: list[str] = []
    dataset_rows = None
    if fmt == "speculators":
        rows, row_problems, dataset_rows = _dataset_rows(path)
        skipped += [p for p in row_problems if p.endswith("(row skipped)")]
        notes = [p for p in row_problems if not p.endswith("(row skipped)")]
        files = _numbered((hs_dir or path / "hidden_states").glob("hs_*.safetensors"))

        def read(p: Path, n: int) -> Sample:
            m = re.fullmatch(r"hs_(\d+)\.safetensors", p.name)
            return _read_speculators_sample(p, int(m.group(1)) if m else -1, rows or None)
    elif fmt == "speculators-legacy":
        files = _numbered(legacy_files(path))

        def read(p: Path, n: int) -> Sample:
            data = _torch_load(p)
            ids = _ids(_field(data, "input_ids", p), "input_ids", p)
            hs = _field(data, "hidden_states", p)
            if not isinstance(hs, (list, tuple)) or len(hs) < 2:
                raise SampleError(f"{p}: hidden_states: expected a list of at least 2 [seq, H] tensors")
            tensors = [
                _hidden(t[0] if t.dim() == 3 else t, f"hidden_states[{j}]", len(ids), p) for j, t in enumerate(hs)
            ]
            mask = _mask(_field(data, "loss_mask", p), len(ids), p)
            return Sample(n, str(p), ids, mask, tensors, len(tensors) - 1)
    else:
        files = specforge_files(path)

        def read(p: Path, n: int) -> Sample:
            data = _torch_load(p)
            ids = _ids(_field(data, "input_ids", p), "input_ids", p)
            aux = _field(data, "aux_hidden_state", p)
            last = _field(data, "hidden_state", p)
            aux = aux[0] if isinstance(aux, torch.Tensor) and aux.dim() == 3 else aux
            last = last[0] if isinstance(last, torch.Tensor) and last.dim() == 3 else last
            aux = _hidden(aux, "aux_hidden_state", len(ids), p)
            last = _hidden(last, "hidden_state", len(ids), p)
            H = last.shape[-1]
            if aux.shape[-1] % H:
                raise SampleError(
                    f"{p}: aux_hidden_state: width {aux.shape[-1]} is not a multiple of hidden_state's {H}"
                )
            chunks = list(aux.split(H, dim=-1))
            mask = _mask(_field(data, "loss_mask", p), len(ids), p)
            return Sample(n, str(p), ids, mask, chunks + [last], len(chunks))

    if not files and fmt == "speculators":
        where = hs_dir or path / "hidden_states"
        given = "hidden_states=DIR (train-acc: --hidden-states DIR)"
        raise ConfigError(
            f"{where}: no hs_*.safetensors files (the speculators hidden states); "
            + (
                f"check the folder given as {given}"
                if hs_dir
                else f"if they are elsewhere, give their folder with {given}"
            )
        )
    if not files:
        raise ConfigError(f"{path}: no {fmt} sample files found")
    read_ok: list[tuple[int, Path, Sample]] = []
    problems: list[tuple[int, str]] = []  # (file position, line): reported in file order
    for n, p in enumerate(files):
        if limit is not None and len(read_ok) >= limit:
            break
        try:
            try:
                read_ok.append((n, p, read(p, n)))
            except SampleError:
                raise
            except (TypeError, ValueError, RuntimeError, AttributeError, KeyError, IndexError) as e:
                # a field of the wrong type or shape that no specific check above names
                first = (str(e).strip().splitlines() or [""])[0][:120]
                raise SampleError(f"{p}: unusable sample ({type(e).__name__}: {first})") from None
        except SampleError as e:
            problems.append((n, f"{e} (sample skipped)"))
    # the layout (layers, fc count, hidden size) most samples share is the dump's: one odd file,
    # first or not, is skipped rather than making every other one look wrong
    layouts = [(len(x.tensors), x.fc_count, x.tensors[0].shape[-1]) for _, _, x in read_ok]
    usual = max(set(layouts), key=lambda lay: (layouts.count(lay), -layouts.index(lay))) if layouts else None
    first_usual = next((x for (_, _, x), lay in zip(read_ok, layouts) if lay == usual), None)
    for (n, p, x), lay in zip(read_ok, layouts):
        try:
            _check_consistent(x, None if lay == usual else first_usual, p)
        except SampleError as e:
            problems.append((n, f"{e} (sample skipped)"))
            continue
        samples.append(x)
    skipped += [line for _, line in sorted(problems, key=lambda t: t[0])]
    return Dump(str(path), fmt, samples, skipped, notes, dataset_rows)


# ---------------------------------------------------------------------------------------
# Writing (difftest dump): the same layouts, so tests run without anyone's real data
# ---------------------------------------------------------------------------------------


SPECFORGE_ROWS_PER_DIR = 2000  # prepare_hidden_states.py: rows_0-2000/, rows_2000-4000/, ...


def write_dump(
    path: str | Path,
    fmt: str,
    samples: list[tuple[list[int], list[int], list[torch.Tensor]]],
    fc_count: int,
    truth: dict | None = None,
    compress: bool = False,
) -> Path:
    """samples: (input_ids, loss_mask, tensors in file order [seq, H] each). `truth` (which layer each
    tensor really is) goes to difftest_dump.json for tests and people; readers never look at it.
    compress: SpecForge's --compress (.ckpt.gz)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if fmt == "speculators":
        from safetensors.torch import save_file

        (path / "hidden_states").mkdir(exist_ok=True)
        lines = []
        for i, (ids, mask, tensors) in enumerate(samples):
            hs = torch.stack([t.detach().contiguous() for t in tensors], dim=1)  # [seq, n_layers, H]
            save_file(
                {"hidden_states": hs.contiguous(), "token_ids": torch.tensor(ids, dtype=torch.long)},
                str(path / "hidden_states" / f"hs_{i}.safetensors"),
            )
            lines.append(json.dumps({"index": i, "input_ids": list(ids), "loss_mask": list(mask), "seq_len": len(ids)}))
        (path / "samples.jsonl").write_text("\n".join(lines) + "\n")
    elif fmt == "speculators-legacy":
        for i, (ids, mask, tensors) in enumerate(samples):
            torch.save(
                {
                    "input_ids": torch.tensor(ids, dtype=torch.long),
                    "loss_mask": torch.tensor(mask, dtype=torch.long),
                    "hidden_states": [t.detach().clone() for t in tensors],
                },
                path / f"data_{i}.pt",
            )
    elif fmt == "specforge":
        if fc_count != len(samples[0][2]) - 1:
            raise ConfigError("specforge: every tensor but the last goes to aux_hidden_state; fc_count must be len - 1")
        for i, (ids, mask, tensors) in enumerate(samples):
            aux = torch.cat([t.detach() for t in tensors[:-1]], dim=-1)[None]  # [1, seq, A*H]
            a = i // SPECFORGE_ROWS_PER_DIR * SPECFORGE_ROWS_PER_DIR
            rows = path / f"rows_{a}-{a + SPECFORGE_ROWS_PER_DIR}"
            rows.mkdir(exist_ok=True)
            buf = io.BytesIO()
            torch.save(
                {
                    "input_ids": torch.tensor(ids, dtype=torch.long),
                    "loss_mask": torch.tensor(mask, dtype=torch.long),
                    "aux_hidden_state": aux.clone(),
                    "hidden_state": tensors[-1].detach()[None].clone(),
                },
                buf,
            )
            if compress:
                with gzip.open(rows / f"data_{i}.ckpt.gz", "wb") as f:
                    f.write(buf.getvalue())
            else:
                (rows / f"data_{i}.ckpt").write_bytes(buf.getvalue())
    else:
        raise ConfigError(f"dump format {fmt!r}: expected one of {', '.join(FORMATS)}")
    meta = {"format": fmt, "num_samples": len(samples), "fc_count": fc_count, **(truth or {})}
    (path / "difftest_dump.json").write_text(json.dumps(meta, indent=1) + "\n")
    return path
