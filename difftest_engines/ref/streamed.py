"""The float64 noise-floor run, streamed: one decoder layer's weights in float64 at a time.

The noise floor (difftest.compare.noise) runs the reference again in float64. A whole float64
copy of the target costs 8 bytes a parameter (64 GB for an 8B target) on top of the case's own
model, so at real sizes the floor went unmeasured. `StreamedTarget` computes the same float64
run from a `source` of the weights: the model the case already loaded, in the case's dtype
(`ModuleSource`), or, where the worker holds no such load, the checkpoint's safetensors files
memory-mapped (`FileSource`, difftest_engines/ref/mapped.py: page cache, not the worker's memory;
a bf16 Llama-3.1-8B target is 16 GB the calibration worker then never holds). Both give the same
values bit for bit (tests/test_streamed_float64.py):

- a float64 *skeleton*: the same transformers class built from the same config on the meta
  device, so it holds no weights; its buffers (rope frequencies, MoE correction biases) are
  copied from the source in the dtypes a float64 load gives them;
- a decoder layer's parameters are upcast from the source just before the layer runs and
  dropped right after it (forward hooks), so the float64 activations of all positions flow
  layer to layer through the model's own forward, unchanged;
- the input embedding upcasts only the rows of the tokens it looks up (a gather is exact); the
  float64 draft's embedding too (`stream_embedding`, from the case's own draft load);
- the output head is upcast in chunks of vocabulary rows no larger than the largest decoder layer
  (`_stream_head_rows`), each chunk's logits its own matmul: MKL's float64 GEMM is not invariant
  to splitting the vocab dimension, so where the head is wider than one chunk (real vocabularies)
  the logits move from the whole-model run's by ~1e-15 of their scale (measured: 19-37 rows x 2048
  @ 2048 x 32768 in 4096-16384-row chunks, at most 2.1e-15; a single row is bit-identical); where
  it fits one chunk (the tiny test models) the run equals the whole-model run bit for bit;
- the few parameters outside the layers (the final norm) stay resident.

Every parameter is upcast as `rounded_through` rounds the whole-model run's: through the case's
weights dtype first (`weights_dtype`), so the result is bit-identical to loading the target in
float64 and rounding it (tests/test_streamed_float64.py holds that, tensor by tensor).

The source is exact only when it holds the checkpoint's values: `streamable` refuses a checkpoint
stored wider than float32 (or quantised), or one not in safetensors; the ref engine then loads the
whole float64 copy as before. `Residency` counts the float64 parameter bytes alive, so a test can
hold the bound (one layer, or the head, plus the resident few) structurally.

Cost (benchmarks/test_bench_streamed_float64.py; a 1.0B bfloat16 Llama, hidden 2048, 8 layers,
vocab 128256, 32 tokens, 2 shared cores): peak RSS 3.8 GiB streamed against 10.3 GiB whole; a
forward 13.0 s against 10.9 s (1.19x: every weight is upcast once per forward, into the reused
arena), but no 46 s float64 load first, so a calibration of up to ~20 forwards is faster streamed.

On a GPU (`ref[device=cuda]`) the source lives there, and so does the run: the arena is allocated on
the source's device, and everything else is copied from the source where it lies.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from difftest.api import stored_tensors

# safetensors dtype codes whose values a float32 (or the case's half dtype) load holds exactly
EXACT_STORED = {"F32", "BF16", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL"}


def streamable(path: str | Path) -> str | None:
    """None when the float64 run can be streamed from a float32/half load of this checkpoint,
    else why not (one line)."""
    tensors, _ = stored_tensors(Path(path))
    if not tensors:
        return "no safetensors files (the source load's values cannot be checked)"
    wide = sorted({t.dtype for t in tensors.values()} - EXACT_STORED)
    if wide:
        return f"tensors stored as {', '.join(wide)} (a float32 load would round or dequantise them)"
    return None


@dataclass
class Residency:
    """Float64 parameter bytes alive in the skeleton: now, the most at once, and those that stay."""

    live: int = 0
    peak: int = 0
    resident: int = 0

    def add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def drop(self, n: int) -> None:
        self.live -= n


class NotStreamable(Exception):
    """The source model does not mirror the skeleton (another class layout): load the whole copy."""


def _upcast(src: torch.Tensor, like: torch.Tensor, weights_dtype: torch.dtype | None) -> torch.Tensor:
    """`src` as the whole float64 run holds it: rounded through the weights dtype (rounded_through
    rounds floating-point parameters only), in the skeleton's dtype for it."""
    if weights_dtype is not None and src.is_floating_point():
        src = src.to(weights_dtype)
    return src.to(like.dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Arena:
    """One float64 buffer the streamed parts are upcast into, reused part after part.

    Measured (a 128256 x 2048 bfloat16 head, 2 cores): upcasting into fresh memory takes 3.2 s,
    into memory already touched 0.5 s; the difference is the kernel zeroing fresh pages. So the
    buffer stays for the run's life, sized for the largest part: the same bytes the peak holds."""

    ALIGN = 512  # elements: every view starts on a 4 KiB boundary, as a fresh allocation's data would

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.size = 0
        self.buffer: torch.Tensor | None = None
        self.device = torch.device(device)  # the source's: on a GPU (ref[device=cuda]) the run stays there

    def plan(self, shapes: list[torch.Size]) -> list[int]:
        """Offsets of one part's float64 tensors; the arena grows to hold the largest part."""
        offsets, end = [], 0
        for shape in shapes:
            offsets.append(end)
            end += -(-max(1, shape.numel()) // self.ALIGN) * self.ALIGN
        self.size = max(self.size, end)
        return offsets

    def view(self, offset: int, shape: torch.Size) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < self.size:
            self.buffer = torch.empty(self.size, dtype=torch.float64, device=self.device)
        return self.buffer[offset : offset + shape.numel()].view(shape)

    def release(self) -> None:
        self.buffer = None


class Stacked:
    """A parameter transformers builds from several stored tensors (an MoE layer's experts fused into
    one [experts, ...] tensor: gate_up_proj from each expert's gate_proj and up_proj, concatenated by
    rows), read from the files only when its part is upcast (a copy of that part in the stored dtype)."""

    def __init__(self, parts: list[list[torch.Tensor]]) -> None:
        self.parts = parts
        first = parts[0]
        self.shape = torch.Size((len(parts), sum(t.shape[0] for t in first), *first[0].shape[1:]))
        self.dtype = first[0].dtype

    def read(self) -> torch.Tensor:
        return torch.stack([torch.cat(group) if len(group) > 1 else group[0] for group in self.parts])


def _read(src: "torch.Tensor | Stacked") -> torch.Tensor:
    return src.read() if isinstance(src, Stacked) else src.detach()


class Source:
    """Where the float64 run reads the model's weights: a parameter by its module's name (in the
    float64 skeleton's names) and a buffer by name; None where it has none as the skeleton needs."""

    config: object
    device: torch.device

    def bind(self, skeleton: torch.nn.Module) -> None:
        """The skeleton the run computes (its names and shapes), once it is built."""

    def param(self, module: str, pname: str, shape: tuple[int, ...]) -> "torch.Tensor | Stacked | None":
        raise NotImplementedError

    def buffer(self, name: str, like: torch.Tensor, owner: torch.nn.Module) -> torch.Tensor | None:
        raise NotImplementedError


class ModuleSource(Source):
    """The model loaded in the case's (weights') dtype, read in place: the worker holds it whole."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.config = module.config
        self.device = next(module.parameters()).device

    def param(self, module: str, pname: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        try:
            mod = self.module.get_submodule(module) if module else self.module
        except AttributeError:
            return None
        return mod._parameters.get(pname)

    def buffer(self, name: str, like: torch.Tensor, owner: torch.nn.Module) -> torch.Tensor | None:
        try:
            return self.module.get_buffer(name)
        except AttributeError:
            return None


class FileSource(Source):
    """The checkpoint's own safetensors files, memory-mapped (difftest_engines/ref/mapped.py): the
    worker holds no load of the target at all, the kernel pages a layer's stored bytes in while it is
    upcast. Stored names are the skeleton's, a tied head reads the embedding it is tied to, an MoE
    layer's fused experts are stacked from the per-expert tensors (Stacked); anything else is not
    found (NotStreamable: the engine reads a loaded model instead).

    Buffers: a persistent one from the file; the rotary frequencies as transformers initialises them
    (PreTrainedModel._init_weights: the rope type's function of the config, in float32)."""

    def __init__(self, path: str | Path, config: object) -> None:
        from difftest_engines.ref.mapped import Mapped

        self.files = Mapped(path)
        self.config = config
        self.device = torch.device("cpu")
        self._alias: dict[str, str] = {}

    def bind(self, skeleton: torch.nn.Module) -> None:
        tied: dict[int, list[str]] = {}
        for name, p in skeleton.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(name)
        for names in tied.values():
            stored = [n for n in names if n in self.files]
            for n in names:
                if n not in self.files and stored:
                    self._alias[n] = stored[0]  # a tied parameter: the one the file stores

    def _view(self, name: str) -> torch.Tensor | None:
        name = self._alias.get(name, name)
        if name not in self.files:
            return None
        try:
            return self.files.tensor(name)
        except TypeError as e:
            raise NotStreamable(str(e)) from None

    def param(self, module: str, pname: str, shape: tuple[int, ...]) -> "torch.Tensor | Stacked | None":
        full = f"{module}.{pname}" if module else pname
        found = self._view(full)
        if found is not None or not module or not shape:
            return found
        fused = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}.get(pname)
        if fused is None or f"{module}.0.{fused[0]}.weight" not in self.files:
            return None
        parts = []
        for e in range(shape[0]):
            group = [self._view(f"{module}.{e}.{proj}.weight") for proj in fused]
            if any(t is None for t in group):
                return None
            parts.append(group)
        return Stacked(parts)

    def buffer(self, name: str, like: torch.Tensor, owner: torch.nn.Module) -> torch.Tensor | None:
        stored = self._view(name)
        if stored is not None and stored.is_floating_point() and stored.element_size() < 4:
            # a buffer stored in half precision: its values, exactly (the whole float64 load holds them so)
            return stored.float()
        if stored is not None:
            return stored
        short = name.rpartition(".")[2]
        if "RotaryEmbedding" in type(owner).__name__ and short in ("inv_freq", "original_inv_freq"):
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            init = {
                "axial": getattr(owner, "compute_axial_rope_parameters", None),
                "default": getattr(owner, "compute_default_rope_parameters", None),
                **ROPE_INIT_FUNCTIONS,
            }.get(getattr(owner, "rope_type", None))
            if init is None:
                return None
            value, _ = init(owner.config)
            return value
        return None


class _Slots:
    """The parameters of one streamed part: (module, name, source tensor, meta placeholder), the
    float64 ones placed in the arena."""

    def __init__(
        self,
        skeleton: torch.nn.Module,
        prefix: str,
        source: "Source",
        weights_dtype,
        residency: Residency,
        arena: Arena,
    ):
        self.items = []
        for name, mod in skeleton.named_modules():
            for pname, ph in mod._parameters.items():
                if ph is None:
                    continue
                full = ".".join(p for p in (prefix, name) if p)
                src = source.param(full, pname, tuple(ph.shape))
                if src is None or tuple(src.shape) != tuple(ph.shape):
                    raise NotStreamable(f"{type(mod).__name__}.{pname}: not in the source model as shaped")
                self.items.append((mod, pname, src, ph))
        self.weights_dtype = weights_dtype
        self.residency = residency
        self.arena = arena
        wide = [ph.shape for _, _, _, ph in self.items if ph.dtype == torch.float64]
        offsets = iter(arena.plan(wide))
        self.offsets = [next(offsets) if ph.dtype == torch.float64 else None for _, _, _, ph in self.items]
        self.bytes = sum(ph.numel() * ph.element_size() for _, _, _, ph in self.items)
        self.held = 0

    def materialize(self) -> None:
        self.release()  # a forward that raised left its weights: take them down first
        for (mod, pname, src, ph), offset in zip(self.items, self.offsets):
            src = _read(src)
            if offset is not None:
                t = self.arena.view(offset, ph.shape)
                # rounded through the weights dtype first, as _upcast; the copy into float64 is exact
                t.copy_(
                    src.to(self.weights_dtype) if self.weights_dtype is not None and src.is_floating_point() else src
                )
            else:
                t = _upcast(src, ph, self.weights_dtype)
            mod._parameters[pname] = torch.nn.Parameter(t, requires_grad=False)
            if t.data_ptr() != src.data_ptr():
                self.held += _nbytes(t)
        self.residency.add(self.held)

    def release(self) -> None:
        for mod, pname, _, ph in self.items:
            mod._parameters[pname] = ph
        self.residency.drop(self.held)
        self.held = 0


class StreamedTarget:
    """A float64 model computing exactly what `rounded_through(load_target(path, float64), weights_dtype)`
    computes, holding one decoder layer's weights (or the output head's) in float64 at a time.

    `model` is an ordinary transformers model to its callers (run_target, the speculative
    simulations, the router and final-norm hooks); `source` stays the caller's and is only read."""

    def __init__(
        self,
        source: "torch.nn.Module | Source",
        weights_dtype: torch.dtype | None,
        dtype: torch.dtype = torch.float64,
        head_rows: int | None = None,
    ) -> None:
        if isinstance(source, torch.nn.Module):
            source = ModuleSource(source)
        self.source = source
        self.residency = Residency()
        # the float64 weights are upcast where the source's live: on the CPU, or the GPU the engine runs on
        # (its buffers and resident parameters follow the source by themselves: they are copied from it)
        self.arena = Arena(source.device)
        self.model = _skeleton(source.config, dtype, source.module if isinstance(source, ModuleSource) else None)
        source.bind(self.model)
        self._handles: list = []
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
            raise NotStreamable(f"{type(self.model).__name__}: no decoder layers at model.layers")
        self._copy_buffers()
        self.layer_bytes: list[int] = []
        for layer in layers:
            slots = _Slots(layer, _name_of(self.model, layer), source, weights_dtype, self.residency, self.arena)
            self._stream(layer, slots)
            self.layer_bytes.append(slots.bytes)
        head = self.model.get_output_embeddings()
        self.head_bytes = 0
        width = head.weight.shape[1] if isinstance(head, torch.nn.Linear) and head.bias is None else 0
        rows = head_rows or max(1, max(self.layer_bytes) // max(1, width * 8))
        if width and rows < head.weight.shape[0]:
            src = source.param(_name_of(self.model, head), "weight", tuple(head.weight.shape))
            if src is None or isinstance(src, Stacked) or tuple(src.shape) != tuple(head.weight.shape):
                raise NotStreamable("the output head: not in the source model as shaped")
            self._stream_head_rows(head, src, weights_dtype, rows)
            self.head_bytes = rows * width * head.weight.element_size()
        elif head is not None:
            slots = _Slots(head, _name_of(self.model, head), source, weights_dtype, self.residency, self.arena)
            self._stream(head, slots)
            self.head_bytes = slots.bytes
        embed = self.model.get_input_embeddings()
        self.embedding_bytes = 0
        if not isinstance(embed, torch.nn.Embedding) or embed.max_norm is not None:
            embed = None  # renormalised or another lookup: resident below, whole
        else:
            src = source.param(_name_of(self.model, embed), "weight", tuple(embed.weight.shape))
            if src is None or isinstance(src, Stacked) or tuple(src.shape) != tuple(embed.weight.shape):
                raise NotStreamable("the input embedding: not in the source model as shaped")
            self._stream_rows(embed, src, weights_dtype)
            self.embedding_bytes = _nbytes(embed.weight)
        # the rest (final norm, ...) stays: small, and read by every forward
        inside = _name_of(self.model, layers) + "."
        for name, mod in self.model.named_modules():
            for pname, ph in list(mod._parameters.items()):
                if ph is None or mod is head or mod is embed or name.startswith(inside):
                    continue
                src = source.param(name, pname, tuple(ph.shape))
                if src is None or tuple(src.shape) != tuple(ph.shape):
                    raise NotStreamable(f"{name}.{pname}: not in the source model as shaped")
                t = _upcast(_read(src), ph, weights_dtype)
                mod._parameters[pname] = torch.nn.Parameter(t, requires_grad=False)
                self.residency.resident += _nbytes(t)
                self.residency.add(_nbytes(t))

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, weights_dtype: torch.dtype | None, dtype: torch.dtype = torch.float64
    ) -> "StreamedTarget":
        """The float64 run read from the checkpoint's files (FileSource): no load of the target held."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(Path(path), local_files_only=True)
        return cls(FileSource(path, config), weights_dtype, dtype)

    def source_weight(self, module: torch.nn.Module) -> torch.Tensor | None:
        """A skeleton module's weight as the source holds it (a view of the file, or the loaded
        tensor): what the draft shares of the target (its embedding, its head)."""
        if module is None or getattr(module, "weight", None) is None:
            return None
        found = self.source.param(_name_of(self.model, module), "weight", tuple(module.weight.shape))
        return None if found is None else _read(found)

    def stream_embedding(self, embed: torch.nn.Module, src: torch.Tensor, weights_dtype: torch.dtype | None) -> int:
        """Another float64 model's embedding (the draft's) looked up as the skeleton's: only the rows of
        the tokens given, upcast from `src` (the same table in the source's dtype) as `_upcast` rounds
        them; its float64 table dropped. The bytes no longer held (0: not an embedding this can stream).

        At the Llama-3.1-8B shape the draft's table is 128256 x 4096: 4.2 GB in float64 of the draft's
        7.6 GB (difftest.run.memory_plan counts the float64 draft without it)."""
        if (
            not isinstance(embed, torch.nn.Embedding)
            or embed.max_norm is not None
            or tuple(src.shape) != tuple(embed.weight.shape)
        ):
            return 0
        whole = embed.weight
        embed._parameters["weight"] = torch.nn.Parameter(
            torch.empty(whole.shape, dtype=whole.dtype, device="meta"), requires_grad=False
        )
        self._stream_rows(embed, src, weights_dtype)
        return _nbytes(whole)

    def bound(self) -> int:
        """Float64 parameter bytes the run may hold at once: the resident few plus the largest of one
        decoder layer, the output head, the input embedding (its looked-up rows, at most all)."""
        return self.residency.resident + max([*self.layer_bytes, self.head_bytes, self.embedding_bytes])

    def whole_bytes(self) -> int:
        """What the whole float64 copy holds (tied tensors once)."""
        seen = {id(p): p for p in self.model.parameters()}
        return sum(p.numel() * 8 for p in seen.values())

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.arena.release()

    # -- building ----------------------------------------------------------------------------
    def _copy_buffers(self) -> None:
        """Buffers (rope frequencies, correction biases) from the source, in the dtypes the float64
        model declares them in: rounded_through leaves buffers alone, so they are not rounded here."""
        for name, buf in list(self.model.named_buffers()):
            owner_name = name.rpartition(".")[0]
            src = self.source.buffer(name, buf, self.model.get_submodule(owner_name) if owner_name else self.model)
            if src is None:
                raise NotStreamable(f"buffer {name}: not in the source model")
            if tuple(src.shape) != tuple(buf.shape):
                raise NotStreamable(f"buffer {name}: shaped {tuple(src.shape)} in the source")
            if src.is_floating_point() and src.element_size() < min(buf.element_size(), 4):
                # a half-precision buffer in the source lost what the float64 load keeps
                raise NotStreamable(f"buffer {name}: {src.dtype} in the source, {buf.dtype} in float64")
            owner, _, bname = name.rpartition(".")
            mod = self.model.get_submodule(owner) if owner else self.model
            mod._buffers[bname] = src.detach().to(buf.dtype, copy=True)

    def _stream(self, module: torch.nn.Module, slots: _Slots) -> None:
        self._handles.append(module.register_forward_pre_hook(lambda _m, _a: slots.materialize()))
        self._handles.append(module.register_forward_hook(lambda _m, _a, _o: slots.release(), always_call=True))

    def _stream_head_rows(self, head: torch.nn.Linear, src: torch.Tensor, weights_dtype, rows: int) -> None:
        """The output head `rows` vocabulary rows at a time, upcast into the arena, each chunk's logits
        its own matmul: no more float64 of it at once than the largest decoder layer holds (by default).
        Each logit is one dot product over the hidden size, but MKL's float64 GEMM blocks it by the
        shapes it is given: a chunk's logits move from the whole matmul's by ~1e-15 of their scale
        (tests/test_streamed_float64.py measures it), where the vocabulary is wider than one chunk."""
        ph = head.weight
        offset = self.arena.plan([torch.Size((rows, ph.shape[1]))])[0]
        residency = self.residency

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = torch.empty(*x.shape[:-1], ph.shape[0], dtype=x.dtype, device=x.device)
            for start in range(0, ph.shape[0], rows):
                part = src.detach()[start : start + rows]
                w = self.arena.view(offset, part.shape)
                w.copy_(part.to(weights_dtype) if weights_dtype is not None else part)  # as _upcast rounds
                residency.add(_nbytes(w))
                out[..., start : start + part.shape[0]] = torch.nn.functional.linear(x, w)
                residency.drop(_nbytes(w))
            return out

        head.forward = forward  # type: ignore[method-assign]

    def _stream_rows(self, embed: torch.nn.Embedding, src: torch.Tensor, weights_dtype) -> None:
        """The embedding looks up rows: only those of the tokens given are upcast (a gather is exact),
        the ids renumbered into them for the one call."""
        ph = embed.weight
        residency = self.residency
        state: dict = {}

        def pre(mod, args):
            if not args:  # called by keyword: the whole table
                rows, ids = _upcast(src.detach(), ph, weights_dtype), None
            else:
                uniq, inverse = torch.unique(args[0], return_inverse=True)
                rows, ids = _upcast(src.detach()[uniq], ph, weights_dtype), inverse
            mod._parameters["weight"] = torch.nn.Parameter(rows, requires_grad=False)
            # padding_idx changes gradients only; the renumbered table may be shorter than it
            state["padding_idx"], mod.padding_idx = mod.padding_idx, None
            state["bytes"] = _nbytes(rows)
            residency.add(state["bytes"])
            return None if ids is None else (ids, *args[1:])

        def post(mod, _args, _out):
            mod._parameters["weight"] = ph
            if "padding_idx" in state:
                mod.padding_idx = state.pop("padding_idx")
            residency.drop(state.pop("bytes", 0))

        self._handles.append(embed.register_forward_pre_hook(pre))
        self._handles.append(embed.register_forward_hook(post, always_call=True))


def _skeleton(config, dtype: torch.dtype, source: torch.nn.Module | None = None) -> torch.nn.Module:
    """The class `config` builds (the source's, where there is a loaded one), in `dtype`, on the meta
    device (no weights), computing as load_target(path, dtype) would: same attention kernel; MoE
    experts in the per-expert loop in float64 (torch._grouped_mm has none; difftest_engines/ref/target.py
    load_target)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    kwargs = {"attn_implementation": getattr(config, "_attn_implementation", None)}
    if dtype == torch.float64 and any(
        getattr(config, k, None) for k in ("n_routed_experts", "num_experts", "num_local_experts")
    ):
        kwargs["experts_implementation"] = "eager"
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **{k: v for k, v in kwargs.items() if v})
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, NotImplementedError) as e:
        # a class transformers cannot build from its config alone (remote code, ...): the whole copy
        named = type(source).__name__ if source is not None else type(config).__name__
        raise NotStreamable(f"{named}: no float64 skeleton ({str(e).splitlines()[0][:120]})") from None
    if source is not None and type(model) is not type(source):
        raise NotStreamable(f"{type(source).__name__}: its config builds {type(model).__name__}")
    return model.eval()


def _name_of(model: torch.nn.Module, module: torch.nn.Module) -> str:
    for name, mod in model.named_modules():
        if mod is module:
            return name
    raise NotStreamable(f"{type(module).__name__}: not a submodule of {type(model).__name__}")
