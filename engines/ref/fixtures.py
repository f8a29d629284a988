"""Deterministic tiny models for tests, built lazily and cached.

Fixtures (under `$DIFFTEST_CACHE` or `~/.cache/difftest`, in `fixtures/<FIXTURES_VERSION>/<name>/`):

  tiny-llama                     LlamaForCausalLM target (8 layers, hidden 128) + WordLevel tokenizer
  tiny-qwen3                     Qwen3ForCausalLM target (4 layers, HF random init), same tokenizer
  tiny-llama-eagle3              EAGLE-3 draft trained on fc = [h2, h4, h5]; HF/EAGLE format, ids [2, 4, 5]
  tiny-llama-eagle3-speculators  the same weights in speculators format
  tiny-llama-eagle3-miswired     the seed bug: trained on fc = [h0, h2, h4] (speculators-launch, launch ids
                                 [0, 2, 4, 7]: fc = all but the last, verifier h7) but saved with ids
                                 [2, 4, 7], so vLLM's convention feeds [h2, h4, h7]: same width, wrong tensors

Why the target is constructed, not random. A random Llama at HF init is nearly a bigram
model (and greedy decoding falls into 2-3 token loops); at std ~0.1 its next token is a
chaotic function of the whole context that no 1-layer draft can learn in CPU seconds.
Neither proves that a draft needs its fc inputs. So `build_llama_target` writes seeded
random weights into a fixed circuit, a second-order "grammar" a draft can learn:

  * residual coordinates (before one global random rotation, so nothing is axis-aligned):
    s = [E(t_i) (32) ; P E(t_{i-1}) (32)] the signal, u (1) a constant coordinate every
    token embedding carries, 63 coordinates for nonlinear "noise" features.
  * layer 0: heads 0/2 attend to the previous position (queries/keys read only u, so rope
    alone makes the score peak at distance 1) and copy E(t_{i-1}) into the second half of s.
  * layers 1..7: heads 0/2 attend to their own position and rotate + grow the signal,
    s <- growth * R_k s (random orthogonal R_k), so h2, h4, h5, h7 hold the same
    information in different bases with norms growing with depth (1.4 at h0 -> ~19 at h8),
    like a real residual stream. Heads 1/3 (content queries) and the MLPs write small
    nonlinear features into the noise coordinates (they only perturb the RMS norms:
    ~0.1% of greedy tokens change when a token further back than t_{i-1} changes).
  * lm_head: logits = scale * (a_v . E(t_i) + b_v . E(t_{i-1})), random unit a_v, b_v over
    448 "frequent" tokens (others get short rows and are essentially never predicted).

So the greedy next token depends on the current and the previous token (changing t_{i-1}
changes it ~95% of the time), greedy continuations do not fall into short loops, a draft
can learn it (it is linear in what fc sees), and a draft fed the wrong layers sees the
right information in the wrong basis and collapses.

Drafts are trained with engines/ref/train.py on 1024 random 8-token prompts continued 40
tokens by the target (each token greedy, or uniformly random with probability 0.25),
labels = the target's own greedy predictions (also for the miswired draft: its verifier h7
is only recorded, so the draft is good under its training wiring and the failure is
purely the serving wiring). quality.json holds the held-out figures (disjoint seed).

This module is also the `difftest.fixtures` provider "builtin" (resolve_fixture, build_all).

Everything is seeded; the builds are deterministic (weights bit-identical across builds;
draft training is bit-exact for a given machine and thread count, which the build pins).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from difftest.paths import cache_root

FIXTURES_VERSION = "v1"
NAMES = [
    "tiny-llama",
    "tiny-qwen3",
    "tiny-llama-eagle3",
    "tiny-llama-eagle3-speculators",
    "tiny-llama-eagle3-miswired",
]

Log = Callable[[str], None]


# -- sizes and seeds -------------------------------------------------------------------
VOCAB = 1024
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 128, 8, 4, 2, 32, 256
QWEN3_LAYERS = 4
DRAFT_VOCAB = 512
TARGET_SEED, QWEN3_SEED, TOKENIZER_SEED = 0, 1, 2
TRAIN_SEQS, TRAIN_PROMPT, TRAIN_NEW, TRAIN_EPS, TRAIN_DATA_SEED = 1024, 8, 40, 0.25, 100
HELDOUT_SEQS, HELDOUT_PROMPT, HELDOUT_NEW, HELDOUT_SEED = 64, 8, 32, 999
SIM_PROMPTS, SIM_NEW_TOKENS, SIM_STEPS = 16, 32, 4
TRAIN = dict(steps=250, batch_size=16, ttt_steps=3, lr=3e-3, temperature=1.0)
DRAFT_SEED = 0
# One thread: reproducible, and far faster than two on a shared 2-core machine (OpenMP spin-waits
# make small-op decoding ~10x slower under contention).
BUILD_THREADS = 1

GOOD_WIRING = ["target.h.2", "target.h.4", "target.h.5"]  # vLLM default ids (2, L//2, L-3) for L = 8
GOOD_IDS = [2, 4, 5]
MISWIRED_TRAIN_WIRING = ["target.h.0", "target.h.2", "target.h.4"]  # speculators-launch, launch ids [0, 2, 4, 7]
MISWIRED_IDS = [2, 4, 7]
MISWIRED_SERVED_WIRING = ["target.h.2", "target.h.4", "target.h.7"]  # vLLM reading ids [2, 4, 7]
SGLANG_SERVED_WIRING = ["target.h.3", "target.h.5", "target.h.6"]  # SGLang 0.5.23 (Llama) reading ids [2, 4, 5]


@dataclass
class _Build:
    """What builders share within one ensure_fixtures call: the log and memoised intermediate results."""

    log: Log
    memo: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# Cache layout, lock, atomic publication
# ---------------------------------------------------------------------------------------


def fixtures_dir() -> Path:
    return cache_root() / "fixtures" / FIXTURES_VERSION


def fixture_path(name: str) -> Path:
    if name not in NAMES:
        raise KeyError(f"unknown fixture {name!r}; known: {', '.join(NAMES)}")
    return fixtures_dir() / name


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Exclusive flock on <directory>/.lock: one builder at a time across processes."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished build into place with rename(2): readers see all of it or nothing."""
    if final.exists():  # only with force: move the old one aside first, then drop it
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


@contextmanager
def _pinned_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ensure_fixtures(names: list[str] | None = None, log: Log = print, force: bool = False) -> dict[str, Path]:
    """Build the named fixtures (default: all) unless cached; returns name -> directory.

    Safe to call from concurrent processes: builds happen under a file lock, each in a
    temporary directory next to its final place, renamed into place when complete.
    Dependencies (a draft needs tiny-llama) are built first.
    """
    wanted = list(NAMES if names is None else names)
    for name in wanted:
        fixture_path(name)  # validates the name
    return ensure_built(wanted, NAMES, _BUILDERS, _DEPS, log=log, force=force)


def ensure_built(
    wanted: list[str],
    known: list[str],
    builders: dict[str, Callable[[Path, "_Build"], None]],
    deps: dict[str, list[str]],
    log: Log = print,
    force: bool = False,
) -> dict[str, Path]:
    """The cache/lock/publish machinery for any provider's fixtures (see ensure_fixtures).

    `known` is the provider's build order, `builders[name](tmp_dir, build)` writes one fixture,
    `deps[name]` names the fixtures (of the same provider) it needs built first.
    """
    order = [n for n in known if n in _with_dependencies(wanted, deps)]
    paths = {n: fixtures_dir() / n for n in order}
    if not force and all(p.exists() for p in paths.values()):
        return {n: paths[n] for n in wanted}
    root = fixtures_dir()
    with _locked(root), torch.random.fork_rng(devices=[]), _pinned_threads(BUILD_THREADS), torch.no_grad():
        for stale in root.glob(".tmp-*"):  # left by a killed builder; we hold the lock, so nobody owns them
            shutil.rmtree(stale, ignore_errors=True)
        build = _Build(log)
        for name in order:
            final = paths[name]
            if final.exists() and not (force and name in wanted):
                continue
            t0 = time.time()
            log(f"[fixtures] building {name} ...")
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
            try:
                builders[name](tmp, build)
                os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
                _publish(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log(f"[fixtures] {name} ready in {time.time() - t0:.1f}s: {final}")
    return {n: paths[n] for n in wanted}


def _log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the `difftest.fixtures` provider interface (pyproject entry point "builtin") ---------------


def resolve_fixture(name: str) -> Path | None:
    """`fixture:NAME` in a case: the directory of a built-in fixture, built on first use; None if not ours."""
    return resolve_from(name, NAMES, ensure_fixtures)


def resolve_from(name: str, names: list[str], ensure: Callable[..., dict[str, Path]]) -> Path | None:
    """A provider's resolve_fixture: build `name` through `ensure` if it is one of `names`."""
    return ensure([name], log=_log_stderr)[name] if name in names else None


def build_all(force: bool = False) -> None:
    """`difftest fixtures [--force]`: build every built-in fixture and print its quality figures."""
    main(["--force"] if force else [])


_DEPS: dict[str, list[str]] = {
    "tiny-qwen3": [],
    "tiny-llama": [],
    "tiny-llama-eagle3": ["tiny-llama"],
    "tiny-llama-eagle3-speculators": ["tiny-llama", "tiny-llama-eagle3"],
    "tiny-llama-eagle3-miswired": ["tiny-llama"],
}


def _with_dependencies(names: list[str], deps: dict[str, list[str]] = _DEPS) -> set[str]:
    out: set[str] = set()
    stack = list(names)
    while stack:
        n = stack.pop()
        if n not in out:
            out.add(n)
            stack.extend(deps[n])
    return out


# ---------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------


def make_words(n: int, seed: int = TOKENIZER_SEED) -> list[str]:
    """n distinct pronounceable made-up words (consonant-vowel syllables), deterministic."""
    import random

    rng = random.Random(seed)
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        syllables = rng.choice((2, 2, 3))
        w = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(syllables))
        if rng.random() < 0.3:
            w += rng.choice("nrst")
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def build_tokenizer():
    """WordLevel tokenizer over <pad> <s> </s> <unk> + made-up words, whitespace-split."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + make_words(VOCAB - len(SPECIALS)))}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


# ---------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _positional_qk(delta: int, gap: float, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q, k (head_dim) such that, after rope, q_i . k_j / sqrt(d) peaks at i - j = delta
    and beats every other distance (up to 4096) by `gap` logits. Only the 8 fastest rope pairs are used."""
    d = HEAD_DIM
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    magnitude = gap * math.sqrt(d) / 0.686  # 0.686 = sum over the 8 pairs of (1 - cos theta_j), the margin to delta +- 1
    q = torch.zeros(d, dtype=torch.float64)
    k = torch.zeros(d, dtype=torch.float64)
    a = math.sqrt(magnitude)
    for j in range(8):
        phi = float(inv_freq[j]) * delta
        q[j] = a
        k[j], k[j + d // 2] = a * math.cos(phi), a * math.sin(phi)
    return q, k


def build_llama_target(
    seed: int = TARGET_SEED,
    growth: float = 1.45,
    num_frequent: int = 448,
    logit_scale: float = 14.0,
    noise: float = 0.01,
    content_heads: float = 0.005,
):
    """The tiny-llama target: a LlamaForCausalLM with a seeded second-order circuit (module docstring).

    Built in float64 on one thread (so the float32 weights do not depend on the caller's thread count).
    """
    with _pinned_threads(1):
        return _build_llama_target(seed, growth, num_frequent, logit_scale, noise, content_heads)


def _build_llama_target(seed: int, growth: float, num_frequent: int, logit_scale: float, noise: float, content_heads: float):
    from transformers import LlamaForCausalLM

    H, d, V = HIDDEN, HEAD_DIM, VOCAB
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def unit_rows(n: int, k: int) -> torch.Tensor:
        x = randn(n, k)
        return x / x.norm(dim=1, keepdim=True)

    def orthogonal(n: int) -> torch.Tensor:
        return torch.linalg.qr(randn(n, n))[0]

    SIG, TOK, PREV, U, NOISE = slice(0, 64), slice(0, 32), slice(32, 64), 64, slice(65, 128)
    n_noise = 63
    sd: dict[str, torch.Tensor] = {}
    E = torch.zeros(V, H, dtype=torch.float64)
    E[:, TOK] = unit_rows(V, 32)  # token identity, unit norm
    E[:, U] = 1.0  # the constant coordinate positional heads key on
    sd["model.embed_tokens.weight"] = E
    P = orthogonal(32)  # basis of the previous-token copy
    # norm of the signal s entering layer k (layer 0: E only; then [E; P E_prev] grown by `growth` per layer)
    sig_norm = [1.0] + [math.sqrt(2.0) * growth ** (k - 1) for k in range(1, LAYERS + 1)]
    rotation = torch.eye(64, dtype=torch.float64)  # s entering the current layer = growth^.. * rotation @ [E; P E_prev]
    q_prev, k_prev = _positional_qk(1, gap=15.0)
    q_self, k_self = _positional_qk(0, gap=15.0)
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        rms = math.sqrt((sig_norm[layer] ** 2 + 1.0) / H)  # RMS of the residual entering this layer
        cu = 1.0 / rms  # u's coordinate after the input RMSNorm
        q = torch.zeros(HEADS * d, H, dtype=torch.float64)
        k = torch.zeros(KV_HEADS * d, H, dtype=torch.float64)
        v = torch.zeros(KV_HEADS * d, H, dtype=torch.float64)
        o = torch.zeros(H, HEADS * d, dtype=torch.float64)
        qp, kp = (q_prev, k_prev) if layer == 0 else (q_self, k_self)
        k[0:d, U] = kp / cu  # both kv heads: positional keys
        k[d : 2 * d, U] = kp / cu
        q[0:d, U] = qp / cu  # heads 0 (kv 0) and 2 (kv 1): positional queries
        q[2 * d : 3 * d, U] = qp / cu
        q[d : 2 * d] = randn(d, H) * 3 / math.sqrt(H)  # heads 1 and 3: content queries, soft attention
        q[3 * d :] = randn(d, H) * 3 / math.sqrt(H)
        o[NOISE, d : 2 * d] = randn(n_noise, d) / math.sqrt(d) * content_heads * sig_norm[layer]
        o[NOISE, 3 * d :] = randn(n_noise, d) / math.sqrt(d) * content_heads * sig_norm[layer]
        v[0:d, TOK] = torch.eye(32, dtype=torch.float64) * rms  # kv 0 carries s[:32] (undoing the norm's 1/rms)
        if layer == 0:
            o[PREV, 0:d] = P  # head 0 reads the previous position: residual[PREV] += P E(t_{i-1})
        else:
            v[d : 2 * d, PREV] = torch.eye(32, dtype=torch.float64) * rms  # kv 1 carries s[32:]
            R = orthogonal(64)
            rotation = R @ rotation
            update = growth * R - torch.eye(64, dtype=torch.float64)  # s <- growth * R s
            o[SIG, 0:d] = update[:, 0:32]
            o[SIG, 2 * d : 3 * d] = update[:, 32:64]
        sd[p + "self_attn.q_proj.weight"] = q
        sd[p + "self_attn.k_proj.weight"] = k
        sd[p + "self_attn.v_proj.weight"] = v
        sd[p + "self_attn.o_proj.weight"] = o
        sd[p + "mlp.gate_proj.weight"] = randn(INTERMEDIATE, H) * 2 / math.sqrt(H)
        sd[p + "mlp.up_proj.weight"] = randn(INTERMEDIATE, H) / math.sqrt(H)
        down = torch.zeros(H, INTERMEDIATE, dtype=torch.float64)
        down[NOISE] = randn(n_noise, INTERMEDIATE) / math.sqrt(INTERMEDIATE) * 2 * noise * sig_norm[layer]
        sd[p + "mlp.down_proj.weight"] = down
        sd[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.float64)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.float64)
    sd["model.norm.weight"] = torch.ones(H, dtype=torch.float64)
    # Readout over [E(t_i); E(t_{i-1})]: a_v, b_v unit for the frequent tokens, short for the rest, 0 for specials.
    frequent = torch.randperm(V - len(SPECIALS), generator=gen)[:num_frequent] + len(SPECIALS)
    A = unit_rows(V, 32) * 0.3
    B = unit_rows(V, 32) * 0.3
    A[frequent], B[frequent] = unit_rows(num_frequent, 32), unit_rows(num_frequent, 32)
    A[: len(SPECIALS)] = 0
    B[: len(SPECIALS)] = 0
    readout = torch.cat([A, B @ P.T], dim=1)  # reads [E; P E_prev]
    rms_final = math.sqrt((sig_norm[LAYERS] ** 2 + 1.0) / H)
    lm_head = torch.zeros(V, H, dtype=torch.float64)
    lm_head[:, SIG] = logit_scale * rms_final / growth ** (LAYERS - 1) * readout @ rotation.T
    sd["lm_head.weight"] = lm_head
    # One global rotation of the residual basis.
    Q = orthogonal(H)
    for name, t in sd.items():
        if t.dim() != 2:
            continue
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name] = Q @ t  # writes into the residual
        else:
            sd[name] = t @ Q.T  # reads the residual (q/k/v, gate/up, lm_head) or is a residual row (embedding)
    with torch.random.fork_rng(devices=[]):  # HF's init draws from the global generator; it is overwritten anyway
        model = LlamaForCausalLM(_llama_config())
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    model.eval()
    return model


def build_qwen3_target(seed: int = QWEN3_SEED):
    """A small Qwen3ForCausalLM at HF's random init (std 0.02), seeded."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=QWEN3_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    model.eval()
    return model


def _save_target(model, out: Path, description: str) -> None:
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    _write_json(out / "fixture.json", {"version": FIXTURES_VERSION, "description": description})


def _build_tiny_llama(out: Path, build: _Build) -> None:
    _save_target(
        build_llama_target(),
        out,
        "LlamaForCausalLM with a seeded second-order circuit: greedy next token = f(t_i, t_{i-1}); "
        "see engines/ref/fixtures.py::build_llama_target",
    )


def _build_tiny_qwen3(out: Path, build: _Build) -> None:
    _save_target(build_qwen3_target(), out, "Qwen3ForCausalLM at HF random init (seeded); no draft")


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


def draft_config():
    from engines.ref.eagle3 import Eagle3Config

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
    from difftest.wiring import short_name

    return "[" + ", ".join(short_name(n) for n in inputs) + "]"


def evaluate_draft(target, draft, inputs: list[str], heldout: torch.Tensor, prompts: list[list[int]]) -> dict:
    """Step-0 agreement on the held-out sequences and the simulated acceptance, with wiring `inputs`."""
    from engines.ref.speculate import simulate_greedy
    from engines.ref.train import prepare_data, step0_agreement

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


def _train(target, inputs: list[str], build: _Build):
    """Train a draft on `inputs`; the training sequences and held-out set are shared by both drafts."""
    from engines.ref.train import prepare_data, train_draft

    t0 = time.time()
    if "train_sequences" not in build.memo:
        build.memo["train_sequences"] = generate_sequences(
            target, TRAIN_SEQS, TRAIN_PROMPT, TRAIN_NEW, TRAIN_DATA_SEED, eps=TRAIN_EPS
        )
        build.memo["heldout"] = heldout_sequences(target)
    data = prepare_data(target, inputs, build.memo["train_sequences"])
    with torch.enable_grad():
        draft = train_draft(target, draft_config(), inputs, data, seed=DRAFT_SEED, log=build.log, log_every=100, **TRAIN)
    return draft, time.time() - t0, build.memo["heldout"]


def _quality_common(
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
            "accept_length": "accepted draft tokens + 1 per verify step (engines.ref.speculate.simulate_greedy)",
        },
    }


def _build_good_draft(out: Path, build: _Build) -> None:
    from engines.ref.target import load_target
    from engines.ref.train import save_eagle_format

    target = load_target(fixture_path("tiny-llama"))
    draft, train_time, heldout = _train(target, GOOD_WIRING, build)
    save_eagle_format(draft, out, GOOD_IDS)
    prompts = heldout[:SIM_PROMPTS, :HELDOUT_PROMPT].tolist()
    served = evaluate_draft(target, draft, GOOD_WIRING, heldout, prompts)
    off_by_one = evaluate_draft(target, draft, SGLANG_SERVED_WIRING, heldout, prompts)
    quality = _quality_common(GOOD_WIRING, GOOD_IDS, "eagle", train_time)
    quality.update(
        step0_agreement=served["step0_agreement"],
        accept_length=served["accept_length"],
        acceptance_rate_per_pos=served["acceptance_rate_per_pos"],
        simulation=served["stats"],
        served_off_by_one={
            "note": "what SGLang 0.5.23's Llama feeds for ids [2, 4, 5] (id k -> h[k+1])",
            **{k: off_by_one[k] for k in ("wiring", "wiring_short", "step0_agreement", "accept_length", "acceptance_rate_per_pos")},
        },
        target_context_dependence=context_dependence(target, heldout),
    )
    _write_json(out / "quality.json", quality)
    build.log(_summary("tiny-llama-eagle3", quality))


def _build_speculators_draft(out: Path, build: _Build) -> None:
    from engines.ref.eagle3 import load_draft
    from engines.ref.train import save_speculators_format

    src = fixture_path("tiny-llama-eagle3")
    draft = load_draft(src).model
    save_speculators_format(draft, out, GOOD_IDS, verifier_name_or_path="tiny-llama")
    quality = json.loads((src / "quality.json").read_text())
    quality.update(format="speculators", same_weights_as="tiny-llama-eagle3")
    _write_json(out / "quality.json", quality)


def _build_miswired_draft(out: Path, build: _Build) -> None:
    from engines.ref.target import load_target
    from engines.ref.train import save_eagle_format

    target = load_target(fixture_path("tiny-llama"))
    draft, train_time, heldout = _train(target, MISWIRED_TRAIN_WIRING, build)
    save_eagle_format(draft, out, MISWIRED_IDS)
    prompts = heldout[:SIM_PROMPTS, :HELDOUT_PROMPT].tolist()
    trained = evaluate_draft(target, draft, MISWIRED_TRAIN_WIRING, heldout, prompts)
    served = evaluate_draft(target, draft, MISWIRED_SERVED_WIRING, heldout, prompts)
    quality = _quality_common(MISWIRED_TRAIN_WIRING, MISWIRED_IDS, "eagle", train_time)
    quality["train"]["speculators_train_launch_ids"] = [0, 2, 4, 7]
    quality["train"]["verifier"] = "target.h.7 (recorded only: labels come from the target's final logits)"
    quality.update(
        step0_agreement=trained["step0_agreement"],
        accept_length=trained["accept_length"],
        acceptance_rate_per_pos=trained["acceptance_rate_per_pos"],
        simulation=trained["stats"],
        served_with_config_ids={
            "note": "what an engine using vLLM's convention feeds for ids [2, 4, 7]",
            **{k: served[k] for k in ("wiring", "wiring_short", "step0_agreement", "accept_length", "acceptance_rate_per_pos")},
            "simulation": served["stats"],
        },
    )
    _write_json(out / "quality.json", quality)
    build.log(_summary("tiny-llama-eagle3-miswired", quality))


def _summary(name: str, q: dict) -> str:
    rates = " ".join(f"{r:.2f}" for r in q["acceptance_rate_per_pos"])
    line = (
        f"[fixtures] {name}: trained on {q['train_wiring_short']} in {q['train_time_s']:.1f}s; "
        f"step-0 agreement {q['step0_agreement']:.3f}, accept length {q['accept_length']:.2f} "
        f"(per position {rates})"
    )
    for key in ("served_with_config_ids", "served_off_by_one"):
        if key in q:
            s = q[key]
            line += f"; served with {s['wiring_short']}: agreement {s['step0_agreement']:.3f}, accept length {s['accept_length']:.2f}"
    return line


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


_BUILDERS: dict[str, Callable[[Path, _Build], None]] = {
    "tiny-llama": _build_tiny_llama,
    "tiny-qwen3": _build_tiny_qwen3,
    "tiny-llama-eagle3": _build_good_draft,
    "tiny-llama-eagle3-speculators": _build_speculators_draft,
    "tiny-llama-eagle3-miswired": _build_miswired_draft,
}


def main(argv: list[str] | None = None) -> int:
    return provider_main(argv, "python -m engines.ref.fixtures", __doc__, NAMES, ensure_fixtures)


def provider_main(argv: list[str] | None, prog: str, doc: str | None, names: list[str],
                  ensure: Callable[..., dict[str, Path]]) -> int:  # fmt: skip
    """A provider's command line: build its fixtures (all, or those named) and print their quality."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").splitlines()[0] if doc else None)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("names", nargs="*", help=f"fixtures to build (default: all): {', '.join(names)}")
    args = parser.parse_args(argv)
    t0 = time.time()
    paths = ensure(args.names or None, force=args.force)
    print(f"[fixtures] cache: {fixtures_dir()}  ({time.time() - t0:.1f}s)")
    for name, path in paths.items():
        q = path / "quality.json"
        print(_summary(name, json.loads(q.read_text())) if q.exists() else f"[fixtures] {name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
