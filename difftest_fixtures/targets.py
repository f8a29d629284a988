"""The tiny targets every built-in fixture starts from: a constructed Llama, a random Qwen3, one tokenizer.

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


Everything is seeded: the weights are bit-identical across builds and machines (built in float64
on one thread, stored in float32).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from difftest_fixtures.cache import FIXTURES_VERSION, pinned_threads, write_json

# -- sizes and seeds -------------------------------------------------------------------
VOCAB = 1024
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 128, 8, 4, 2, 32, 256
QWEN3_LAYERS = 4
TARGET_SEED, QWEN3_SEED, TOKENIZER_SEED = 0, 1, 2
# what the tiny Llama and Qwen3 share (each adds its depth; the Llama its rope theta)
_TINY_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=INTERMEDIATE,
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


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(**_TINY_SHAPE, num_hidden_layers=LAYERS, rope_theta=10000.0)


def _positional_qk(delta: int, gap: float, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q, k (head_dim) such that, after rope, q_i . k_j / sqrt(d) peaks at i - j = delta
    and beats every other distance (up to 4096) by `gap` logits. Only the 8 fastest rope pairs are used."""
    d = HEAD_DIM
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    magnitude = (
        gap * math.sqrt(d) / 0.686
    )  # 0.686 = sum over the 8 pairs of (1 - cos theta_j), the margin to delta +- 1
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
    with pinned_threads(1):
        return _build_llama_target(seed, growth, num_frequent, logit_scale, noise, content_heads)


class SeededDraws:
    """Every random draw of a constructed target, float64, from one seeded generator: the order of the
    calls is part of the recipe, so the weights are bit-identical across builds."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

    def unit_rows(self, n: int, k: int) -> torch.Tensor:
        x = self.randn(n, k)
        return x / x.norm(dim=1, keepdim=True)

    def orthogonal(self, n: int) -> torch.Tensor:
        return torch.linalg.qr(self.randn(n, n))[0]


# The residual layout of a constructed target (before its global rotation): the signal
# s = [E(t_i) ; P E(t_{i-1})], a constant coordinate u, and coordinates for nonlinear "noise".
SIG, TOK, PREV, U, NOISE = slice(0, 64), slice(0, 32), slice(32, 64), 64, slice(65, 128)
N_NOISE = 63


def circuit_embedding(draws: SeededDraws, vocab: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token embedding (unit token identity in TOK, u = 1) and P, the basis of the previous-token copy."""
    E = torch.zeros(vocab, hidden, dtype=torch.float64)
    E[:, TOK] = draws.unit_rows(vocab, 32)
    E[:, U] = 1.0  # the constant coordinate positional heads key on
    return E, draws.orthogonal(32)


def signal_norms(layers: int, growth: float) -> list[float]:
    """Norm of the signal s entering each layer (layer 0: E only; then [E; P E_prev] grown by `growth` per layer)."""
    return [1.0] + [math.sqrt(2.0) * growth ** (k - 1) for k in range(1, layers + 1)]


def circuit_readout(
    draws: SeededDraws,
    P: torch.Tensor,
    rotation: torch.Tensor,
    *,
    vocab: int,
    hidden: int,
    layers: int,
    growth: float,
    num_frequent: int,
    logit_scale: float,
) -> torch.Tensor:
    """lm_head: logits = scale * (a_v . E(t_i) + b_v . E(t_{i-1})), a_v, b_v unit for the frequent tokens,
    short for the rest, 0 for the specials; read through the layers' accumulated rotation of s."""
    specials = len(SPECIALS)
    frequent = torch.randperm(vocab - specials, generator=draws.gen)[:num_frequent] + specials
    A = draws.unit_rows(vocab, 32) * 0.3
    B = draws.unit_rows(vocab, 32) * 0.3
    A[frequent], B[frequent] = draws.unit_rows(num_frequent, 32), draws.unit_rows(num_frequent, 32)
    A[:specials] = 0
    B[:specials] = 0
    readout = torch.cat([A, B @ P.T], dim=1)  # reads [E; P E_prev]
    rms_final = math.sqrt((signal_norms(layers, growth)[layers] ** 2 + 1.0) / hidden)
    lm_head = torch.zeros(vocab, hidden, dtype=torch.float64)
    lm_head[:, SIG] = logit_scale * rms_final / growth ** (layers - 1) * readout @ rotation.T
    return lm_head


def _build_llama_target(
    seed: int, growth: float, num_frequent: int, logit_scale: float, noise: float, content_heads: float
):
    from transformers import LlamaForCausalLM

    H, d, V = HIDDEN, HEAD_DIM, VOCAB
    draws = SeededDraws(seed)
    randn, orthogonal = draws.randn, draws.orthogonal
    n_noise = N_NOISE
    sd: dict[str, torch.Tensor] = {}
    E, P = circuit_embedding(draws, V, H)
    sd["model.embed_tokens.weight"] = E
    sig_norm = signal_norms(LAYERS, growth)
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
    lm_head = circuit_readout(
        draws,
        P,
        rotation,
        vocab=V,
        hidden=H,
        layers=LAYERS,
        growth=growth,
        num_frequent=num_frequent,
        logit_scale=logit_scale,
    )
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
        model = LlamaForCausalLM(llama_config())
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    model.eval()
    return model


def build_qwen3_target(seed: int = QWEN3_SEED):
    """A small Qwen3ForCausalLM at HF's random init (std 0.02), seeded."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**_TINY_SHAPE, num_hidden_layers=QWEN3_LAYERS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    model.eval()
    return model


def save_target(model, out: Path, description: str) -> None:
    """A target fixture: the HF checkpoint, the shared tokenizer and fixture.json saying what it is."""
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    write_json(out / "fixture.json", {"version": FIXTURES_VERSION, "description": description})
