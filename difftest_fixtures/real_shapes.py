"""Targets and EAGLE-3 drafts of the published models' real shapes, with seeded random weights, built on demand.

Fixtures (same cache as the other providers, `fixtures/<FIXTURES_VERSION>/<name>/`):

  llama-3.2-1b-shape              meta-llama/Llama-3.2-1B's config.json (1,235,814,400 parameters, tied)
  llama-3.1-8b-shape              meta-llama/Llama-3.1-8B's config.json (8,030,261,248 parameters)
  qwen3-8b-shape                  Qwen/Qwen3-8B's config.json (8,190,735,360 parameters)
  kimi-width-deepseek-v3          Kimi-K2.5's text model at full width (hidden 7168, vocab 163840, MLA, Kimi's
                                  yarn rope), cut to 3 layers (the first dense) and 16 routed experts top-8
                                  (+1 shared); model_type deepseek_v3, which transformers reads without remote
                                  code (Kimi's own config says kimi_k2 and ships its modelling code)
  <each>-eagle3                   its EAGLE-3 draft: one Llama layer of the target's width, fc 3*H -> H, a
                                  32000-token draft vocabulary with d2t/t2d, the ids of the project's default
                                  wiring (vLLM's [2, L//2, L-3]) at the top level and in eagle_config

What they are for: what only a real shape exercises (a 128256- or 163840-token vocabulary and its d2t
over 32000 draft tokens, 32/8 GQA at head_dim 64 or 128, llama3 and yarn ropes at their published
factors, an fc 3*7168 wide, a bf16 checkpoint of gigabytes), not drafting quality: the weights are
random (normal, std = the config's initializer_range, norms 1), so a draft accepts little.

Weights are written tensor by tensor straight into one model.safetensors (`write_safetensors`: the
header first, from the shapes alone, then each tensor's bytes in chunks), so no build holds more than
a chunk of random numbers (64 MiB of bfloat16) besides the interpreter: the 1B pair builds at a peak
RSS under 500 MiB. Each tensor is drawn from
its own seed (the shape's seed and the tensor's name), so a draft's embed_tokens is its target's,
byte for byte, as SpecForge and EAGLE copy it, without reading the target.

The checkpoint's tensor names and shapes are what transformers instantiates from the config (on the
meta device: no memory), under the names checkpoints use (DeepSeek-V3's experts one by one, as
save_pretrained and the published checkpoints write them, not transformers' fused tensors).

Nothing here builds at import or in `difftest fixtures` (build_all says how to build one): `fixture:NAME`
in a case or `python -m difftest_fixtures.real_shapes NAME` builds it, once, into the cache.
The provider takes fixture names only, so there is no depth override: a shallower shape would be
another named fixture.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from difftest.api import rule_for, target_family
from difftest_fixtures import cache
from difftest_fixtures.provider import provider_main, resolve_from

DRAFT_VOCAB = 32000
SEED = 0
# random numbers drawn (and written) per chunk: bounds a build's memory whatever the tensor's size
CHUNK_ELEMENTS = 1 << 25

LLAMA_1B = "llama-3.2-1b-shape"
LLAMA_8B = "llama-3.1-8b-shape"
QWEN3_8B = "qwen3-8b-shape"
KIMI = "kimi-width-deepseek-v3"
DRAFT_SUFFIX = "-eagle3"

# -- the published config.json files (transformers' own keys, as the hub pages carry them) ----------------

_LLAMA_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA_1B_CONFIG = {
    **_LLAMA_COMMON,
    "head_dim": 64,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "transformers_version": "4.45.0.dev0",
}
LLAMA_8B_CONFIG = {
    **_LLAMA_COMMON,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.43.0.dev0",
}
QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# Kimi-K2.5's text_config (moonshotai/Kimi-K2.5; Kimi-K2's with 262144 positions, yarn factor 64) with what
# the cut changes: num_hidden_layers 61 -> 3, n_routed_experts 384 -> 16 (top-8 kept), model_type kimi_k2 ->
# deepseek_v3 (the same architecture, read without remote code; tiny-deepseek-v3's moe_layer_freq kept).
KIMI_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 262144,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 3,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}
# the published Kimi-K2.5 draft's layer (difftest_fixtures/published_configs/specforge-kimi-k25-eagle3.json):
# MHA (64 kv heads), head_dim 128, intermediate 18432, its own plain rope (theta 1e6, 131072 positions)
KIMI_DRAFT_LAYER = {
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 128,
    "intermediate_size": 18432,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 131072,
}


@dataclass(frozen=True)
class Shape:
    """One real-shape target and what its draft's layer takes from elsewhere than the target."""

    name: str
    config: dict
    draft_layer: dict | None = None  # None: the draft's layer is the target's (heads, intermediate, rope)

    @property
    def draft(self) -> str:
        return self.name + DRAFT_SUFFIX


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape(LLAMA_1B, LLAMA_1B_CONFIG),
        Shape(LLAMA_8B, LLAMA_8B_CONFIG),
        Shape(QWEN3_8B, QWEN3_8B_CONFIG),
        Shape(KIMI, KIMI_CONFIG, KIMI_DRAFT_LAYER),
    )
}
# every fixture of the provider (not `NAMES`: `difftest fixtures` builds every name a provider lists)
FIXTURES: list[str] = [n for s in SHAPES.values() for n in (s.name, s.draft)]


# -- configs ----------------------------------------------------------------------------------------------


def default_ids(target_config: dict) -> list[int]:
    """The draft's layer ids: the project's default wiring (vLLM's rule for the target's family) at the
    target's depth, sorted and each once (3-layer Kimi's [2, 1, 0] -> [0, 1, 2])."""
    rule = rule_for("vllm", target_family(target_config))
    assert rule is not None  # vLLM has a rule for every family
    return sorted(set(rule.default_ids(target_config["num_hidden_layers"])))


def draft_config(shape: Shape) -> dict:
    """The draft's config.json: the layout difftest_engines/ref/train.py::save_eagle_format writes
    (LlamaForCausalLMEagle3), at the target's width, in bfloat16."""
    t = shape.config
    layer = shape.draft_layer or {
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t.get("head_dim", t["hidden_size"] // t["num_attention_heads"]),
        "intermediate_size": t["intermediate_size"],
        "rope_theta": t["rope_theta"],
        "rope_scaling": t.get("rope_scaling"),
        "max_position_embeddings": t["max_position_embeddings"],
    }
    ids = default_ids(t)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": t["hidden_size"],
        "intermediate_size": layer["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": layer["num_attention_heads"],
        "num_key_value_heads": layer["num_key_value_heads"],
        "head_dim": layer["head_dim"],
        "hidden_act": "silu",
        "vocab_size": t["vocab_size"],
        "rms_norm_eps": t["rms_norm_eps"],
        "rope_theta": layer["rope_theta"],
        "rope_scaling": layer["rope_scaling"],
        "max_position_embeddings": layer["max_position_embeddings"],
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": t["bos_token_id"],
        "eos_token_id": t["eos_token_id"],
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": t["hidden_size"],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }


# -- tensor layouts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: its name, shape, dtype and how it is filled."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16
    fill: str = "normal"  # "normal" (std), "ones", "zeros", or "given" (value)
    std: float = 0.02
    value: torch.Tensor | None = None
    seed_name: str | None = None  # draws the numbers of the tensor so named (default: its own name)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _fill_for(name: str) -> str:
    # norms start at one (as transformers initialises them); DeepSeek's router correction bias at zero
    if name.endswith(("norm.weight", "layernorm.weight")):
        return "ones"
    if name.endswith("e_score_correction_bias"):
        return "zeros"
    return "normal"


def meta_model(config: dict):
    """The target as transformers builds it from `config`, on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def target_entries(config: dict) -> list[Entry]:
    """The target checkpoint's tensors: the meta model's state dict under checkpoint names (a tied head
    left out, as save_pretrained leaves it; fused MoE experts split one by one, as checkpoints store them)."""
    std = float(config.get("initializer_range", 0.02))
    entries: list[Entry] = []
    for name, t in meta_model(config).state_dict().items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        shape = tuple(t.shape)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows first
            prefix, (experts, two_i, hidden) = name.removesuffix("gate_up_proj"), shape
            for e in range(experts):
                for part in ("gate_proj", "up_proj"):
                    entries.append(Entry(f"{prefix}{e}.{part}.weight", (two_i // 2, hidden), std=std))
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            prefix, (experts, hidden, inter) = name.removesuffix("down_proj"), shape
            entries += [Entry(f"{prefix}{e}.down_proj.weight", (hidden, inter), std=std) for e in range(experts)]
        else:
            fill = _fill_for(name)
            dtype = torch.float32 if fill == "zeros" else torch.bfloat16  # the correction bias is float32 in Kimi's
            entries.append(Entry(name, shape, dtype, fill, std))
    return sorted(entries, key=lambda e: e.name)


def draft_vocabulary(vocab: int, draft_vocab: int = DRAFT_VOCAB, seed: int = SEED) -> torch.Tensor:
    """The target ids of the draft's tokens: a seeded sorted subset (real drafts keep the most frequent)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values


def draft_entries(shape: Shape) -> list[Entry]:
    """The draft checkpoint's tensors (the names difftest_engines/ref/train.py::save_eagle_format writes)."""
    c = draft_config(shape)
    H, V, std = c["hidden_size"], c["vocab_size"], float(shape.config.get("initializer_range", 0.02))
    q, kv, inter = (
        c["num_attention_heads"] * c["head_dim"],
        c["num_key_value_heads"] * c["head_dim"],
        c["intermediate_size"],
    )
    ids = draft_vocabulary(V)
    d2t = (ids - torch.arange(DRAFT_VOCAB)).long()  # offsets: draft token i is target id i + d2t[i]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    a = "midlayer.self_attn."
    return sorted(
        [
            Entry("d2t", (DRAFT_VOCAB,), torch.int64, "given", value=d2t),
            Entry("t2d", (V,), torch.bool, "given", value=t2d),
            # the target's embedding, byte for byte (drawn under its name), as SpecForge and EAGLE copy it
            Entry("embed_tokens.weight", (V, H), std=std, seed_name="model.embed_tokens.weight"),
            Entry("fc.weight", (H, 3 * H), std=std),
            Entry(a + "q_proj.weight", (q, 2 * H), std=std),
            Entry(a + "k_proj.weight", (kv, 2 * H), std=std),
            Entry(a + "v_proj.weight", (kv, 2 * H), std=std),
            Entry(a + "o_proj.weight", (H, q), std=std),
            Entry("midlayer.mlp.gate_proj.weight", (inter, H), std=std),
            Entry("midlayer.mlp.up_proj.weight", (inter, H), std=std),
            Entry("midlayer.mlp.down_proj.weight", (H, inter), std=std),
            Entry("midlayer.hidden_norm.weight", (H,), fill="ones"),
            Entry("midlayer.input_layernorm.weight", (H,), fill="ones"),
            Entry("midlayer.post_attention_layernorm.weight", (H,), fill="ones"),
            Entry("norm.weight", (H,), fill="ones"),
            Entry("lm_head.weight", (DRAFT_VOCAB, H), std=std),
        ],
        key=lambda e: e.name,
    )


# -- the streamed writer ----------------------------------------------------------------------------------

_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64", torch.bool: "BOOL"}


def _seed(key: str, name: str) -> int:
    # a tensor's own seed: the same name under the same key draws the same numbers, in any build order
    return int(hashlib.sha256(f"{key}:{name}".encode()).hexdigest()[:15], 16)


def _chunks(entry: Entry, key: str) -> Iterator[torch.Tensor]:
    """The tensor's values, flat, CHUNK_ELEMENTS (or a whole row) at a time."""
    if entry.fill == "given":
        assert entry.value is not None and tuple(entry.value.shape) == entry.shape
        yield entry.value.to(entry.dtype).reshape(-1)
        return
    n = entry.numel
    row = entry.shape[-1] if entry.shape else 1
    step = max(row, CHUNK_ELEMENTS // row * row)
    gen = torch.Generator().manual_seed(_seed(key, entry.seed_name or entry.name))
    for start in range(0, n, step):
        size = min(step, n - start)
        if entry.fill == "ones":
            yield torch.ones(size, dtype=entry.dtype)
        elif entry.fill == "zeros":
            yield torch.zeros(size, dtype=entry.dtype)
        else:
            yield torch.empty(size, dtype=entry.dtype).normal_(0.0, entry.std, generator=gen)


def write_safetensors(path: Path, entries: list[Entry], key: str) -> None:
    """One safetensors file written tensor by tensor, chunk by chunk: the header (names, dtypes, shapes,
    offsets) from the entries alone, then the bytes in the same order (the format: an 8-byte
    little-endian header length, the JSON header padded with spaces to 8 bytes, the data)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        nbytes = e.numel * torch.empty((), dtype=e.dtype).element_size()
        header[e.name] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for e in entries:
            for chunk in _chunks(e, key):
                fh.write(chunk.contiguous().view(torch.uint8).numpy().data)
    if path.stat().st_size != 8 + len(blob) + offset:
        raise RuntimeError(f"{path}: wrote {path.stat().st_size} bytes, the header declares {8 + len(blob) + offset}")


# -- builders ---------------------------------------------------------------------------------------------


def _seed_key(shape: Shape) -> str:
    # the target and its draft draw under one key: the draft's embed_tokens is the target's embedding
    return f"{shape.name}:{SEED}"


def _build_target(shape: Shape):
    def build(out: Path, build: cache.Build) -> None:
        entries = target_entries(shape.config)
        write_safetensors(out / "model.safetensors", entries, _seed_key(shape))
        cache.write_json(out / "config.json", shape.config)
        cache.write_json(
            out / "fixture.json",
            {
                "version": cache.FIXTURES_VERSION,
                "description": f"{shape.name}: the published config.json with seeded random bfloat16 weights "
                "(difftest_fixtures/real_shapes.py); no tokenizer (cases give token ids)",
                "parameters": sum(e.numel for e in entries),
            },
        )

    return build


def _build_draft(shape: Shape):
    def build(out: Path, build: cache.Build) -> None:
        entries = draft_entries(shape)
        write_safetensors(out / "model.safetensors", entries, _seed_key(shape))
        config = draft_config(shape)
        cache.write_json(out / "config.json", config)
        cache.write_json(
            out / "fixture.json",
            {
                "version": cache.FIXTURES_VERSION,
                "description": f"EAGLE-3 draft of {shape.name} with seeded random bfloat16 weights "
                "(difftest_fixtures/real_shapes.py); embed_tokens equals the target's",
                "target": shape.name,
                "layer_ids": config["eagle_aux_hidden_state_layer_ids"],
                "parameters": sum(e.numel for e in entries if e.dtype == torch.bfloat16),
            },
        )

    return build


_BUILDERS: dict[str, cache.Builder] = {
    **{s.name: _build_target(s) for s in SHAPES.values()},
    **{s.draft: _build_draft(s) for s in SHAPES.values()},
}
_DEPS: dict[str, list[str]] = {n: [] for n in FIXTURES}  # a draft needs nothing of its target's files


def ensure_fixtures(names: list[str], log: cache.Log = print, force: bool = False) -> dict[str, Path]:
    """Build the named real-shape fixtures unless cached (never all by default); returns name -> directory."""
    return cache.ensure_built(list(names), FIXTURES, _BUILDERS, _DEPS, log=log, force=force)


# -- the `difftest.fixtures` provider interface (pyproject entry point "real-shapes") ----------------------


def resolve_fixture(name: str) -> Path | None:
    """`fixture:NAME` in a case: the fixture's directory, built on first use; None if not ours."""
    return resolve_from(name, FIXTURES, ensure_fixtures)


def build_all(force: bool = False) -> None:
    """`difftest fixtures` builds no real shape (gigabytes each): it says how to build one."""
    cache.log_stderr(
        "[fixtures] real shapes build on demand (fixture:NAME in a case, or python -m difftest_fixtures.real_shapes "
        f"NAME): {', '.join(FIXTURES)}"
    )


def main(argv: list[str] | None = None) -> int:
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not [a for a in args if not a.startswith("-")]:
        print(f"real_shapes: name the fixtures to build (gigabytes each): {', '.join(FIXTURES)}", file=sys.stderr)
        return 2
    return provider_main(args, "python -m difftest_fixtures.real_shapes", __doc__, FIXTURES, ensure_fixtures)


if __name__ == "__main__":
    raise SystemExit(main())
