"""Built-in tiny DeepSeek-V3 (Kimi-K2 architecture: MLA + MoE) target and its EAGLE-3 draft.

Fixtures (same cache as difftest_fixtures/tiny_llama.py, `fixtures/<FIXTURES_VERSION>/<name>/`):

  tiny-deepseek-v3          DeepseekV3ForCausalLM, 6 layers, hidden 128, Kimi-K2-like config (below)
                            + the tiny-llama WordLevel tokenizer (vocab 1024)
  tiny-deepseek-v3-eagle3   LlamaForCausalLMEagle3 draft trained on fc = [h2, h4, h5], saved with ids
                            [2, 4, 5] at the top level (vLLM) and in eagle_config (the only place SGLang reads)

The config is what all three engines run on CPU (see /work/shared/spikes/kimi-cpu): q_lora_rank 64,
kv_lora_rank 512 + qk_rope_head_dim 64 = 576 (the only head size vLLM's CPU MLA backend supports),
qk_nope 32, v_head 32, 8 routed experts top-2 + 1 shared, first_k_dense_replace 1, noaux_tc grouped
routing (n_group 2, topk_group 1, sigmoid scores + e_score_correction_bias), routed_scaling_factor 2.5,
Kimi-style yarn rope (SGLang's CPU path only supports deepseek_yarn), `moe_layer_freq: 1` (SGLang's
deepseek_v2.py reads it; real DeepSeek-V3/Kimi-K2 configs carry it), no MTP layers.

Why constructed, not random: see fixtures.py. The same second-order circuit is written into MLA/MoE
weights (residual coordinates before one global rotation: s = [E(t_i); P E(t_{i-1})] (64), a constant
coordinate u, 63 noise coordinates):

  * MLA queries/keys. k_rot (shared by all heads, read straight from the normed residual) keys on u;
    a positional head's q_rot reads the first coordinate of the q latent, which is u (the latent's
    other 63 coordinates are a small content projection, so q_a_layernorm leaves it nearly constant).
    With rope the score then peaks at distance 1 (layer 0) or 0 (layers 1..5), `gap` logits above
    every other distance, for the interleaved yarn frequencies and yarn's softmax mscale.
  * MLA values. The kv latent is the normed residual through a random 512x128 isometry, so
    kv_a_layernorm (RMS over 512) multiplies it by exactly 2; kv_b_proj reads coordinates back through
    the isometry: head 0's value is E(t_i), head 2's is the copied previous token (layers >= 1).
  * layer 0 head 0 copies E(t_{i-1}) into the second half of s; layers 1..5 (heads 0/2, attending to
    themselves) rotate and grow s <- growth * R_k s, so h2, h4, h5 hold the same information in
    different bases with growing norms.
  * heads 1/3 are content heads (q_nope/k_nope from content), and the dense MLP, the routed experts and
    the shared expert write small nonlinear features into the noise coordinates: the router (random,
    sigmoid, grouped top-k with correction bias) really picks different experts per token, but what it
    picks only perturbs the RMS norms.
  * lm_head reads [E(t_i); E(t_{i-1})] as in tiny-llama.

So the greedy next token depends on the current and the previous token, a correctly wired draft
learns it, and a draft fed the wrong layers (e.g. SGLang's Llama +1: [h3, h5, h6]) collapses.

This module is the `difftest.fixtures` provider "deepseek" (resolve_fixture, build_all).
`build_deepseek_target()` and the name constants are public: other fixture modules build on them.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from difftest_fixtures import cache, drafts, targets
from difftest_fixtures.provider import NamedProvider

TARGET = "tiny-deepseek-v3"
DRAFT = "tiny-deepseek-v3-eagle3"
LANE = TARGET  # `difftest fixtures` builds this lane beside the tiny-llama one
NAMES = [TARGET, DRAFT]

# -- sizes ---------------------------------------------------------------------------------
HIDDEN, LAYERS, HEADS = targets.HIDDEN, 6, 4
Q_LORA, KV_LORA, ROPE, NOPE, V_HEAD = 64, 512, 64, 32, 32
INTERMEDIATE, MOE_INTERMEDIATE = 256, 64
EXPERTS, TOPK, SHARED, N_GROUP, TOPK_GROUP = 8, 2, 1, 2, 1
ROUTED_SCALING = 2.5
MAX_POSITIONS = 1024
# Kimi-K2's rope_scaling shape (beta 1/1, mscale = mscale_all_dim = 1), scaled down: the spike's values.
ROPE_PARAMETERS = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
TARGET_SEED = 10

GOOD_WIRING = ["target.h.2", "target.h.4", "target.h.5"]  # vLLM ids [2, 4, 5]; SGLang deepseek_v2 (ids[0] != 1) too
GOOD_IDS = [2, 4, 5]
SHIFTED_WIRING = [
    "target.h.3",
    "target.h.5",
    "target.h.6",
]  # SGLang 0.5.23's Llama rule (id k -> h[k+1]) on ids [2, 4, 5]


def deepseek_config(layers: int = LAYERS):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=targets.VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        moe_intermediate_size=MOE_INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        num_nextn_predict_layers=0,
        q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        v_head_dim=V_HEAD,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        n_shared_experts=SHARED,
        first_k_dense_replace=1,
        routed_scaling_factor=ROUTED_SCALING,
        topk_method="noaux_tc",
        n_group=N_GROUP,
        topk_group=TOPK_GROUP,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_parameters=dict(ROPE_PARAMETERS),
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    # Not a DeepseekV3Config field, so transformers drops it unless set as an extra attribute; SGLang's
    # deepseek_v2.py (DeepseekV2DecoderLayer.__init__, `config.moe_layer_freq`) fails without it.
    cfg.moe_layer_freq = 1
    return cfg


def _positional_qk(
    delta: int, gap: float, inv_freq: torch.Tensor, softmax_scale: float, pairs: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_rot, k_rot (ROPE wide, interleaved pairs (2j, 2j+1) as HF's rope_interleave lays them out) such
    that softmax_scale * q_i . k_j peaks at i - j = delta and beats every other distance in [0, MAX_POSITIONS)
    by `gap` logits. Uses the `pairs` fastest frequencies (unchanged by yarn: their wavelength is short)."""
    theta = inv_freq[:pairs].double()
    d = torch.arange(-delta, MAX_POSITIONS, dtype=torch.float64)
    d = d[d != 0]
    margin = float((1 - torch.cos(d[:, None] * theta[None, :])).sum(dim=1).min())  # worst distance's deficit
    a = math.sqrt(gap / (softmax_scale * margin))
    q = torch.zeros(ROPE, dtype=torch.float64)
    k = torch.zeros(ROPE, dtype=torch.float64)
    for j in range(pairs):
        phi = float(theta[j]) * delta
        q[2 * j] = a
        k[2 * j], k[2 * j + 1] = a * math.cos(phi), a * math.sin(phi)
    return q, k


def build_deepseek_target(
    seed: int = TARGET_SEED,
    growth: float = 1.45,
    num_frequent: int = 448,
    logit_scale: float = 14.0,
    noise: float = 0.01,
    content_heads: float = 0.005,
    gap: float = 15.0,
    layers: int = LAYERS,
):
    """The tiny-deepseek-v3 target (module docstring). Built in float64 on one thread, so the float32
    weights do not depend on the caller's thread count. `layers` deepens it (the same circuit, one more
    rotate-and-grow step per layer): difftest_fixtures/published.py's 8-layer target."""
    with cache.pinned_threads(1), torch.no_grad():
        return _build(seed, growth, num_frequent, logit_scale, noise, content_heads, gap, layers)


def _build(
    seed: int,
    growth: float,
    num_frequent: int,
    logit_scale: float,
    noise: float,
    content_heads: float,
    gap: float,
    layers: int = LAYERS,
):
    from transformers import DeepseekV3ForCausalLM

    H, V = HIDDEN, targets.VOCAB
    qk_head = NOPE + ROPE
    draws = targets.SeededDraws(seed)
    randn, orthogonal = draws.randn, draws.orthogonal

    cfg = deepseek_config(layers)
    with torch.random.fork_rng(devices=[]):  # HF's init draws from the global generator; all overwritten below
        model = DeepseekV3ForCausalLM(cfg)
    inv_freq = model.model.rotary_emb.inv_freq.double()  # yarn-corrected frequencies, as the model applies them
    # DeepseekV3Attention.scaling: qk_head^-0.5 times yarn's mscale^2; cos/sin carry attention_scaling (1 here).
    softmax_scale = model.model.layers[0].self_attn.scaling * model.model.rotary_emb.attention_scaling**2

    TOK, PREV, SIG, U, NOISE = targets.TOK, targets.PREV, targets.SIG, targets.U, targets.NOISE
    n_noise = targets.N_NOISE
    sd: dict[str, torch.Tensor] = {}
    E, P = targets.circuit_embedding(draws, V, H)
    sd["model.embed_tokens.weight"] = E
    sig_norm = targets.signal_norms(layers, growth)
    rotation = torch.eye(64, dtype=torch.float64)
    q_prev, k_prev = _positional_qk(1, gap, inv_freq, softmax_scale)
    q_self, k_self = _positional_qk(0, gap, inv_freq, softmax_scale)
    content_q = 0.3  # norm of the q latent's content part relative to its u coordinate
    latent_u = math.sqrt(Q_LORA / (1.0 + content_q**2))  # u's coordinate after q_a_layernorm (RMS over Q_LORA)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        rms = math.sqrt((sig_norm[layer] ** 2 + 1.0) / H)  # RMS of the residual entering this layer
        cu = 1.0 / rms  # u's coordinate after input_layernorm
        sig_n = sig_norm[layer] / rms  # norm of s after input_layernorm
        qp, kp = (q_prev, k_prev) if layer == 0 else (q_self, k_self)
        # q latent: [u (scaled to 1), 63 content coordinates of norm ~content_q]
        q_a = torch.zeros(Q_LORA, H, dtype=torch.float64)
        q_a[0, U] = 1.0 / cu
        q_a[1:, SIG] = torch.linalg.qr(randn(64, 64))[0][: Q_LORA - 1] * content_q / sig_n
        q_b = torch.zeros(HEADS * qk_head, Q_LORA, dtype=torch.float64)
        for h in (0, 2):
            q_b[h * qk_head + NOPE : (h + 1) * qk_head, 0] = qp / latent_u
        for h in (1, 3):
            q_b[h * qk_head : h * qk_head + NOPE, 1:] = randn(NOPE, Q_LORA - 1) * 3 / math.sqrt(Q_LORA - 1) / content_q
        # kv latent = W x_n (W an isometry), so kv_a_layernorm(latent) = 2 W x_n exactly; k_rot keys on u.
        W = torch.linalg.qr(randn(KV_LORA, H))[0]  # [512, 128], orthonormal columns
        kv_a = torch.zeros(KV_LORA + ROPE, H, dtype=torch.float64)
        kv_a[:KV_LORA] = W
        kv_a[KV_LORA:, U] = kp / cu
        to_x = W.T * (rms / 2)  # kv latent (after its norm) -> residual coordinates of x (undoing both norms)
        kv_b = torch.zeros(HEADS * (NOPE + V_HEAD), KV_LORA, dtype=torch.float64)
        o = torch.zeros(H, HEADS * V_HEAD, dtype=torch.float64)

        def v_rows(h: int) -> slice:
            return slice(h * (NOPE + V_HEAD) + NOPE, (h + 1) * (NOPE + V_HEAD))

        kv_b[v_rows(0)] = to_x[TOK]  # head 0's value: s[:32] = E(t)
        if layer == 0:
            o[PREV, 0:V_HEAD] = P  # head 0 attends to the previous position: residual[PREV] += P E(t_{i-1})
        else:
            kv_b[v_rows(2)] = to_x[PREV]  # head 2's value: s[32:]
            R = orthogonal(64)
            rotation = R @ rotation
            update = growth * R - torch.eye(64, dtype=torch.float64)
            o[SIG, 0:V_HEAD] = update[:, 0:32]
            o[SIG, 2 * V_HEAD : 3 * V_HEAD] = update[:, 32:64]
        for h in (1, 3):  # content heads: keys and values from the whole normed residual, output into noise
            base_row = h * (NOPE + V_HEAD)
            kv_b[base_row : base_row + NOPE] = randn(NOPE, H) @ W.T / math.sqrt(H)
            kv_b[v_rows(h)] = randn(V_HEAD, H) @ W.T / math.sqrt(H)
            o[NOISE, h * V_HEAD : (h + 1) * V_HEAD] = (
                randn(n_noise, V_HEAD) / math.sqrt(V_HEAD) * content_heads * sig_norm[layer]
            )
        a = p + "self_attn."
        sd[a + "q_a_proj.weight"] = q_a
        sd[a + "q_a_layernorm.weight"] = torch.ones(Q_LORA, dtype=torch.float64)
        sd[a + "q_b_proj.weight"] = q_b
        sd[a + "kv_a_proj_with_mqa.weight"] = kv_a
        sd[a + "kv_a_layernorm.weight"] = torch.ones(KV_LORA, dtype=torch.float64)
        sd[a + "kv_b_proj.weight"] = kv_b
        sd[a + "o_proj.weight"] = o
        m = p + "mlp."
        out_scale = 2 * noise * sig_norm[layer]
        if layer == 0:  # first_k_dense_replace = 1: a dense MLP
            sd[m + "gate_proj.weight"] = randn(INTERMEDIATE, H) * 2 / math.sqrt(H)
            sd[m + "up_proj.weight"] = randn(INTERMEDIATE, H) / math.sqrt(H)
            down = torch.zeros(H, INTERMEDIATE, dtype=torch.float64)
            down[NOISE] = randn(n_noise, INTERMEDIATE) / math.sqrt(INTERMEDIATE) * out_scale
            sd[m + "down_proj.weight"] = down
        else:
            # Router logits ~ N(0, 1) per expert; the bias tilts group choice as noaux_tc's correction does.
            sd[m + "gate.weight"] = randn(EXPERTS, H) / math.sqrt(H)
            sd[m + "gate.e_score_correction_bias"] = randn(EXPERTS) * 0.05
            # HF's fused layout: experts.gate_up_proj [E, 2I, H] (gate rows first), experts.down_proj [E, H, I];
            # save_pretrained writes the per-expert checkpoint keys (experts.{e}.gate_proj ...) engines load.
            sd[m + "experts.gate_up_proj"] = torch.cat(
                [randn(EXPERTS, MOE_INTERMEDIATE, H) * 2, randn(EXPERTS, MOE_INTERMEDIATE, H)], dim=1
            ) / math.sqrt(H)
            down = torch.zeros(EXPERTS, H, MOE_INTERMEDIATE, dtype=torch.float64)
            down[:, NOISE] = (
                randn(EXPERTS, n_noise, MOE_INTERMEDIATE) / math.sqrt(MOE_INTERMEDIATE) * out_scale / ROUTED_SCALING
            )
            sd[m + "experts.down_proj"] = down
            sd[m + "shared_experts.gate_proj.weight"] = randn(MOE_INTERMEDIATE, H) * 2 / math.sqrt(H)
            sd[m + "shared_experts.up_proj.weight"] = randn(MOE_INTERMEDIATE, H) / math.sqrt(H)
            sdown = torch.zeros(H, MOE_INTERMEDIATE, dtype=torch.float64)
            sdown[NOISE] = randn(n_noise, MOE_INTERMEDIATE) / math.sqrt(MOE_INTERMEDIATE) * out_scale
            sd[m + "shared_experts.down_proj.weight"] = sdown
        sd[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.float64)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.float64)
    sd["model.norm.weight"] = torch.ones(H, dtype=torch.float64)
    lm_head = targets.circuit_readout(
        draws,
        P,
        rotation,
        vocab=V,
        hidden=H,
        layers=layers,
        growth=growth,
        num_frequent=num_frequent,
        logit_scale=logit_scale,
    )
    sd["lm_head.weight"] = lm_head
    # One global rotation of the residual basis: weights that read the residual turn with it, weights that
    # write into it turn the other way; q_b_proj / kv_b_proj read latents and stay as they are.
    Q = orthogonal(H)
    writes = ("o_proj.weight", "down_proj.weight", "experts.down_proj")
    reads = (
        "embed_tokens.weight",
        "q_a_proj.weight",
        "kv_a_proj_with_mqa.weight",
        "gate_proj.weight",
        "up_proj.weight",
        "experts.gate_up_proj",
        "mlp.gate.weight",
        "lm_head.weight",
    )
    for name, t in sd.items():
        if name.endswith(writes):
            sd[name] = Q @ t
        elif name.endswith(reads):
            sd[name] = t @ Q.T
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    model.eval()
    return model


def weights_checksum(model) -> str:
    """sha256 over the float32 state dict (sorted names, shapes, raw bytes): the determinism fingerprint."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------


def _build_target(out: Path, build: cache.Build) -> None:
    model = build_deepseek_target()
    # The description is written into the fixture (fixture.json / quality.json), whose bytes keyed
    # fixtures hash (difftest_fixtures/cache.py publish_keyed): it keeps the path the code had when
    # FIXTURES_VERSION v1 was cut, so a rebuild stays byte-identical. The code is now in difftest_fixtures/deepseek.py.
    targets.save_target(
        model,
        out,
        "DeepseekV3ForCausalLM (MLA + MoE, Kimi-K2-like config) with a seeded second-order circuit: greedy next "
        "token = f(t_i, t_{i-1}); see difftest_engines/ref/fixtures_deepseek.py::build_deepseek_target",
    )
    config = json.loads((out / "config.json").read_text())
    if config.get("moe_layer_freq") != 1:  # save_pretrained keeps extra attributes today; make sure of it
        config["moe_layer_freq"] = 1
        cache.write_json(out / "config.json", config)
    meta = json.loads((out / "fixture.json").read_text())
    meta["weights_sha256"] = weights_checksum(model)
    cache.write_json(out / "fixture.json", meta)


DRAFT_RECIPE = drafts.DraftRecipe(
    name=DRAFT,
    target=TARGET,
    train_wiring=GOOD_WIRING,
    layer_ids=GOOD_IDS,
    alternatives=(
        drafts.Alternative(
            "served_off_by_one",
            "what SGLang 0.5.23's Llama rule (id k -> h[k+1]) would feed for ids [2, 4, 5]; "
            "its DeepSeek model (ids[0] != 1 -> h[k]) and vLLM feed the trained [h2, h4, h5]",
            SHIFTED_WIRING,
        ),
    ),
    context_dependence=True,
)


_BUILDERS: dict[str, cache.Builder] = {
    TARGET: _build_target,
    DRAFT: lambda out, build: drafts.build_draft(DRAFT_RECIPE, out, build),
}
_DEPS: dict[str, list[str]] = {TARGET: [], DRAFT: [TARGET]}


def fixture_path(name: str) -> Path:
    if name not in NAMES:
        raise KeyError(f"unknown fixture {name!r}; known: {', '.join(NAMES)}")
    return cache.fixtures_dir() / name


def ensure_fixtures(names: list[str] | None = None, log: cache.Log = print, force: bool = False) -> dict[str, Path]:
    """Build the named DeepSeek fixtures (default: both) unless cached; returns name -> directory."""
    return cache.ensure_built(list(NAMES if names is None else names), NAMES, _BUILDERS, _DEPS, log=log, force=force)


# -- the `difftest.fixtures` provider interface (pyproject entry point "deepseek") ---------------
_PROVIDER = NamedProvider("python -m difftest_fixtures.deepseek", __doc__, NAMES, ensure_fixtures)
resolve_fixture, build_all, main = _PROVIDER.resolve_fixture, _PROVIDER.build_all, _PROVIDER.main


if __name__ == "__main__":
    raise SystemExit(main())
