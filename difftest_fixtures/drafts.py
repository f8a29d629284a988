"""How every built-in draft fixture is made: one pipeline, train -> save -> evaluate -> quality.json.

Drafts are trained with difftest_engines/ref/train.py on 1024 random 8-token prompts continued 40
tokens by their target (each token greedy, or uniformly random with probability 0.25),
labels = the target's own greedy predictions. A draft's verifier tensor is only recorded,
so a draft is good under its training wiring and any failure is purely the serving wiring.
quality.json holds the held-out figures (a disjoint seed): step-0 agreement and the simulated
accept length under the training wiring and under each wiring an engine is known to feed.

A fixture differs from another only in its `DraftRecipe`: target, wiring, layer ids, draft
config, saver, and the alternative wirings it is scored under.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from difftest.api import short_name, signature
from difftest_fixtures.cache import BUILD_THREADS, FIXTURES_VERSION, Build, fixtures_dir, publish_keyed, write_json
from difftest_fixtures.targets import HEAD_DIM, HEADS, HIDDEN, KV_HEADS, SPECIALS, VOCAB

DRAFT_VOCAB = 512
TRAIN_SEQS, TRAIN_PROMPT, TRAIN_NEW, TRAIN_EPS, TRAIN_DATA_SEED = 1024, 8, 40, 0.25, 100
HELDOUT_SEQS, HELDOUT_PROMPT, HELDOUT_NEW, HELDOUT_SEED = 64, 8, 32, 999
SIM_PROMPTS, SIM_NEW_TOKENS, SIM_STEPS = 16, 32, 4
TRAIN = dict(steps=250, batch_size=16, ttt_steps=3, lr=3e-3, temperature=1.0)
DRAFT_SEED = 0
# the figures an alternative wiring is reported with in quality.json
ALTERNATIVE_FIGURES = ("wiring", "wiring_short", "step0_agreement", "accept_length", "acceptance_rate_per_pos")


# ---------------------------------------------------------------------------------------
# Data: target continuations of random prompts
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def generate_sequences(target, num: int, prompt_len: int, new_tokens: int, seed: int, eps: float = 0.0) -> torch.Tensor:
    """[num, prompt_len + new_tokens]: random prompts continued by the target, greedy except that
    each new token is replaced by a uniformly random one with probability eps (diversity)."""
    gen = torch.Generator().manual_seed(seed)
    low = len(SPECIALS)
    x = torch.randint(low, VOCAB, (num, prompt_len), generator=gen)
    out = target(input_ids=x, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    for _ in range(new_tokens):
        nxt = logits.argmax(-1)
        if eps > 0:
            swap = torch.rand(num, generator=gen) < eps
            nxt = torch.where(swap, torch.randint(low, VOCAB, (num,), generator=gen), nxt)
        x = torch.cat([x, nxt[:, None]], dim=1)
        out = target(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    return x


def heldout_sequences(target) -> torch.Tensor:
    """The held-out evaluation set: prompts from a seed disjoint from training, greedy continuations."""
    return generate_sequences(target, HELDOUT_SEQS, HELDOUT_PROMPT, HELDOUT_NEW, HELDOUT_SEED)


def heldout_prompts(target) -> list[list[int]]:
    """The prompts simulate_greedy runs on for quality.json (the first SIM_PROMPTS held-out prompts)."""
    return heldout_sequences(target)[:SIM_PROMPTS, :HELDOUT_PROMPT].tolist()


@torch.no_grad()
def context_dependence(target, sequences: torch.Tensor, seed: int = 7) -> float:
    """Fraction of positions whose greedy token changes when the previous token is replaced at random."""
    gen = torch.Generator().manual_seed(seed)
    base = target(input_ids=sequences).logits.argmax(-1)
    changed = total = 0
    n = sequences.shape[1]
    for j in range(1, n - 1, 3):
        perturbed = sequences.clone()
        perturbed[:, j] = torch.randint(len(SPECIALS), VOCAB, (sequences.shape[0],), generator=gen)
        y = target(input_ids=perturbed).logits.argmax(-1)
        changed += int((y[:, j + 1] != base[:, j + 1]).sum())
        total += sequences.shape[0]
    return changed / total


# ---------------------------------------------------------------------------------------
# Drafts
# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# The draft and its scoring
# ---------------------------------------------------------------------------------------


def draft_config():
    from difftest_engines.ref.eagle3 import Eagle3Config

    return Eagle3Config(
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=HIDDEN,
        num_aux=3,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )


def _short(inputs: list[str]) -> str:
    return "[" + ", ".join(short_name(n) for n in inputs) + "]"


def evaluate_draft(target, draft, inputs: list[str], heldout: torch.Tensor, prompts: list[list[int]]) -> dict:
    """Step-0 agreement on the held-out sequences and the simulated acceptance, with wiring `inputs`."""
    from difftest_engines.ref.speculate import simulate_greedy
    from difftest_engines.ref.train import prepare_data, step0_agreement

    agreement = step0_agreement(draft, prepare_data(target, inputs, heldout))
    stats, _ = simulate_greedy(target, draft, inputs, prompts, SIM_STEPS, SIM_NEW_TOKENS)
    return {
        "wiring": inputs,
        "wiring_short": _short(inputs),
        "step0_agreement": agreement,
        "accept_length": stats.accept_length,
        "acceptance_rate_per_pos": stats.acceptance_rate_per_pos,
        "stats": stats.to_dict(),
    }


def save_eagle(draft, out: Path, layer_ids: list[int], target_dir: Path) -> None:
    """The HF/EAGLE layout (config.json + model.safetensors), what vLLM and SGLang load."""
    from difftest_engines.ref.train import save_eagle_format

    save_eagle_format(draft, out, layer_ids)


def save_speculators_copy(src: Path, out: Path, layer_ids: list[int], **quality: Any) -> None:
    """A built draft's weights in the speculators layout (a format, not a new training), with its
    quality.json marked by `quality` (format and same_weights_as at least)."""
    from difftest_engines.ref.draft_loading import load_draft
    from difftest_engines.ref.train import save_speculators_format

    save_speculators_format(load_draft(src).model, out, layer_ids, verifier_name_or_path="tiny-llama")
    figures = json.loads((src / "quality.json").read_text())
    figures.update(quality)
    write_json(out / "quality.json", figures)


@dataclass(frozen=True)
class Alternative:
    """A wiring an engine is known to feed the draft, scored into quality.json under `key`."""

    key: str
    note: str
    wiring: list[str]
    with_simulation: bool = False


@dataclass(frozen=True)
class DraftRecipe:
    """Everything that makes one draft fixture differ from another."""

    name: str
    target: str  # a named fixture in the same cache, built first
    train_wiring: list[str]
    layer_ids: list[int]  # what the saved config declares
    save: Callable[[Any, Path, list[int], Path], None] = save_eagle  # (draft, out, layer_ids, target_dir)
    fmt: str = "eagle"
    config: Callable[[], Any] = draft_config
    alternatives: tuple[Alternative, ...] = ()
    context_dependence: bool = False  # record how much the target's next token depends on t_{i-1}
    train_notes: dict = field(default_factory=dict)  # added to quality["train"]
    extra: dict = field(default_factory=dict)  # top-level quality entries (architecture, catalogue fault)
    description: str | None = None  # fixture.json's description, for a draft that is not a plain EAGLE save


@dataclass
class _Data:
    train: torch.Tensor
    heldout: torch.Tensor


# Sequences per target checkpoint (by content), for the life of the process: every draft of a target trains on the
# same data, so a process building several (one `difftest fixtures` lane) generates it once.
_SEQUENCES: dict[str, _Data] = {}


def _data(target, target_dir: Path) -> _Data:
    """The training and held-out sequences of a target (seeded: a fresh generation makes the same),
    per checkpoint contents (difftest.base.content_digest)."""
    target_signature = signature(target_dir)
    key = json.dumps(target_signature)
    if key not in _SEQUENCES:
        _SEQUENCES[key] = _stored_data(target, target_dir, target_signature)
    return _SEQUENCES[key]


def _stored_data(target, target_dir: Path, target_signature: list) -> _Data:
    """The sequences, generated once per target checkpoint into the fixture cache and read back.

    `difftest fixtures` builds one fixture per process, so every process that trains a draft of a
    target generated them again: for the DeepSeek target (MoE, MLA) that is a minute of one core
    per draft. Keyed by the checkpoint's contents, the generation settings and the thread count
    (the builds pin one; another count may round differently), so what is read is what a fresh
    generation in this process would give, bit for bit."""
    from safetensors.torch import load_file, save_file

    settings = [TRAIN_SEQS, TRAIN_PROMPT, TRAIN_NEW, TRAIN_EPS, TRAIN_DATA_SEED]
    settings += [HELDOUT_SEQS, HELDOUT_PROMPT, HELDOUT_NEW, HELDOUT_SEED, torch.get_num_threads()]

    def generate(out: Path) -> None:
        train = generate_sequences(target, TRAIN_SEQS, TRAIN_PROMPT, TRAIN_NEW, TRAIN_DATA_SEED, eps=TRAIN_EPS)
        save_file({"train": train, "heldout": heldout_sequences(target)}, str(out / "sequences.safetensors"))

    stored = publish_keyed("sequences", target_dir.name, [target_signature, settings], generate)
    tensors = load_file(str(stored / "sequences.safetensors"))
    return _Data(tensors["train"], tensors["heldout"])


def build_draft(recipe: DraftRecipe, out: Path, build: Build) -> dict:
    """Train the recipe's draft, save it into `out`, score it and write quality.json; returns the figures."""
    from difftest_engines.ref.target import load_target
    from difftest_engines.ref.train import prepare_data, train_draft

    target_dir = fixtures_dir() / recipe.target
    target = load_target(target_dir)
    t0 = time.time()
    data = _data(target, target_dir)
    examples = prepare_data(target, recipe.train_wiring, data.train)
    with torch.enable_grad():
        draft = train_draft(
            target,
            recipe.config(),
            recipe.train_wiring,
            examples,
            seed=DRAFT_SEED,
            log=build.log,
            log_every=100,
            **TRAIN,
        )
    train_time = time.time() - t0
    recipe.save(draft, out, recipe.layer_ids, target_dir)

    prompts = data.heldout[:SIM_PROMPTS, :HELDOUT_PROMPT].tolist()
    trained = evaluate_draft(target, draft, recipe.train_wiring, data.heldout, prompts)
    quality = quality_common(recipe.train_wiring, recipe.layer_ids, recipe.fmt, train_time, target=recipe.target)
    quality["train"].update(recipe.train_notes)
    quality.update(recipe.extra)
    quality.update(
        step0_agreement=trained["step0_agreement"],
        accept_length=trained["accept_length"],
        acceptance_rate_per_pos=trained["acceptance_rate_per_pos"],
        simulation=trained["stats"],
    )
    for alt in recipe.alternatives:
        scored = evaluate_draft(target, draft, alt.wiring, data.heldout, prompts)
        quality[alt.key] = {"note": alt.note, **{k: scored[k] for k in ALTERNATIVE_FIGURES}}
        if alt.with_simulation:
            quality[alt.key]["simulation"] = scored["stats"]
    if recipe.context_dependence:
        quality["target_context_dependence"] = context_dependence(target, data.heldout)
    write_json(out / "quality.json", quality)
    if recipe.description is not None:
        write_json(out / "fixture.json", {"version": FIXTURES_VERSION, "description": recipe.description})
    build.log(summary(recipe.name, quality))
    return quality


def quality_common(
    inputs: list[str], layer_ids: list[int], fmt: str, train_time: float, target: str = "tiny-llama"
) -> dict:
    return {
        "version": FIXTURES_VERSION,
        "target": target,
        "format": fmt,
        "train_wiring": inputs,
        "train_wiring_short": _short(inputs),
        "config_layer_ids": layer_ids,
        "train_time_s": round(train_time, 2),
        "train": {
            **TRAIN,
            "seed": DRAFT_SEED,
            "threads": BUILD_THREADS,
            "data": {
                "sequences": TRAIN_SEQS,
                "prompt_len": TRAIN_PROMPT,
                "new_tokens": TRAIN_NEW,
                "random_token_prob": TRAIN_EPS,
                "seed": TRAIN_DATA_SEED,
            },
            "labels": "target greedy (argmax of the final logits); soft targets = target distribution over the draft vocab",
        },
        "heldout": {
            "sequences": HELDOUT_SEQS,
            "prompt_len": HELDOUT_PROMPT,
            "new_tokens": HELDOUT_NEW,
            "seed": HELDOUT_SEED,
            "simulation": {"prompts": SIM_PROMPTS, "max_new_tokens": SIM_NEW_TOKENS, "num_steps": SIM_STEPS},
        },
        "definition": {
            "step0_agreement": "draft argmax at position i (mapped to target ids) == target greedy token at i+1, over all positions of the held-out sequences",
            "accept_length": "accepted draft tokens + 1 per verify step (difftest_engines.ref.speculate.simulate_greedy)",
        },
    }


def summary(name: str, q: dict) -> str:
    """One log line: the training wiring's figures, then each alternative wiring's."""
    rates = " ".join(f"{r:.2f}" for r in q["acceptance_rate_per_pos"])
    line = (
        f"[fixtures] {name}: trained on {q['train_wiring_short']} in {q['train_time_s']:.1f}s; "
        f"step-0 agreement {q['step0_agreement']:.3f}, accept length {q['accept_length']:.2f} "
        f"(per position {rates})"
    )
    for s in q.values():
        if isinstance(s, dict) and "wiring_short" in s:
            line += f"; served with {s['wiring_short']}: agreement {s['step0_agreement']:.3f}, accept length {s['accept_length']:.2f}"
    return line
