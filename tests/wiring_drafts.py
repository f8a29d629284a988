"""Tiny EAGLE-3 drafts really trained on known wirings, for judging `wiring: infer` (difftest.rules.infer_wiring).

Each recipe trains a draft (difftest_engines/ref/train.py, step 0 only: inference scores step 0) on one
wiring of one target and saves it with config ids that an engine reads as something else, so
the config says nothing true about the training. Targets are the built-in constructed Llama and
DeepSeek-V3 fixtures and the random-weight Qwen3 of tests/independent_models.py. Drafts are cached
under `${DIFFTEST_CACHE:-~/.cache/difftest}/infer-wiring/` keyed by their recipe (a hash of every
field and the builder version), built in a temporary directory and renamed into place.

`evidence(target)` holds what inference reads: the target's hidden states on held-out sequences
(a seed disjoint from training), computed once per target and process.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

from difftest.base.paths import cache_root

BUILDER_VERSION = 3
TRAIN_SEQS, PROMPT_LEN, NEW_TOKENS, DATA_SEED, EPS = 256, 8, 24, 321, 0.25
EVIDENCE_SEQS, EVIDENCE_NEW, EVIDENCE_SEED = 256, 32, 654
TRAIN = dict(steps=150, batch_size=32, ttt_steps=1, lr=4e-3, temperature=1.0, warmup=10)


QWEN3 = "tiny-qwen3-circuit"


@dataclass(frozen=True)
class Recipe:
    name: str
    target: str  # tiny-llama | tiny-deepseek-v3 | indep-qwen3
    wiring: tuple[str, ...]  # short names, fc order: h0, h5, final_norm
    ids: tuple[int, ...]  # what the saved config says
    seed: int = 0
    steps: int = TRAIN["steps"]

    @property
    def inputs(self) -> list[str]:
        return ["target.final_norm" if w == "final_norm" else f"target.h.{w[1:]}" for w in self.wiring]

    def key(self) -> str:
        blob = json.dumps(
            {
                "v": BUILDER_VERSION,
                "recipe": asdict(self),
                "train": TRAIN,
                "data": [TRAIN_SEQS, PROMPT_LEN, NEW_TOKENS, DATA_SEED, EPS],
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


RECIPES = {
    r.name: r
    for r in (
        # tiny-llama: 8 layers (h0..h8, h8 = last layer before the final norm)
        Recipe("llama-embed", "tiny-llama", ("h0", "h3", "h6"), (3, 6, 7)),
        Recipe("llama-unsorted", "tiny-llama", ("h5", "h2", "h7"), (2, 5, 7)),
        Recipe("llama-postnorm", "tiny-llama", ("h2", "h6", "final_norm"), (2, 6, 7)),
        Recipe("llama-prenorm", "tiny-llama", ("h2", "h6", "h8"), (2, 6, 7)),
        # Qwen3 (q/k norm) carrying tiny-llama's circuit: 8 layers
        Recipe("qwen3-embed", QWEN3, ("h0", "h4", "h7"), (4, 7, 8)),
        Recipe("qwen3-unsorted-postnorm", QWEN3, ("h6", "h3", "final_norm"), (3, 6, 7)),
        # tiny DeepSeek-V3 (MLA + MoE): 6 layers
        Recipe("deepseek-embed", "tiny-deepseek-v3", ("h0", "h2", "h5"), (2, 4, 5)),
        Recipe("deepseek-unsorted-prenorm", "tiny-deepseek-v3", ("h4", "h2", "h6"), (1, 3, 5)),
    )
}


def root() -> Path:
    return cache_root() / "infer-wiring"


def target_path(name: str) -> Path:
    if name == QWEN3:
        return _ensure_qwen3_circuit()
    if name.startswith("indep-"):
        from independent_models import ensure_model

        return ensure_model(name).target
    from difftest.run.case_run import resolve_fixture

    return Path(resolve_fixture(f"fixture:{name}"))


@torch.no_grad()
def build_qwen3_circuit():
    """A Qwen3ForCausalLM carrying tiny-llama's constructed circuit (difftest_fixtures/targets.py): the same
    weights, plus q/k-norm weights set to the median RMS of the Llama's queries (positional heads) and
    keys per layer, so the normalised queries and keys keep their scale and the positional heads still
    attend where the circuit needs (the Qwen3 and the Llama agree on every greedy token here).
    Random-weight targets are no use: a tiny draft learns a chaotic target too poorly in CPU seconds
    for its wiring to show (agreement ~0.1 on tests/independent_models.py's Qwen3)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from difftest_fixtures import cache, drafts, targets

    with cache.pinned_threads(1):
        llama = targets.build_llama_target()
        c = targets.llama_config()
        cfg = Qwen3Config(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            max_position_embeddings=2048,
            rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        with torch.random.fork_rng(devices=[]):
            model = Qwen3ForCausalLM(cfg).eval()
        missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
        assert not unexpected and all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing)
        seqs = drafts.generate_sequences(llama, 32, 8, 24, seed=7)
        rms: dict[tuple[str, int], torch.Tensor] = {}
        hooks = []
        d = c.head_dim
        for i, layer in enumerate(llama.model.layers):

            def q_hook(_m, _a, o, i=i):  # heads 0 and 2 are the circuit's positional heads
                rms[("q", i)] = o.view(*o.shape[:-1], -1, d)[..., [0, 2], :].pow(2).mean(-1).sqrt().flatten()

            def k_hook(_m, _a, o, i=i):
                rms[("k", i)] = o.view(*o.shape[:-1], -1, d).pow(2).mean(-1).sqrt().flatten()

            hooks += [
                layer.self_attn.q_proj.register_forward_hook(q_hook),
                layer.self_attn.k_proj.register_forward_hook(k_hook),
            ]
        llama(input_ids=seqs)
        for h in hooks:
            h.remove()
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.q_norm.weight.fill_(float(rms[("q", i)].median()))
            layer.self_attn.k_norm.weight.fill_(float(rms[("k", i)].median()))
    return model


def _ensure_qwen3_circuit() -> Path:
    from difftest_fixtures.cache import build_once

    final = root() / f"targets/{QWEN3}-v{BUILDER_VERSION}"
    final.parent.mkdir(parents=True, exist_ok=True)
    return build_once(final, lambda tmp: build_qwen3_circuit().save_pretrained(tmp))


@lru_cache(maxsize=None)
def _target(name: str):
    from difftest_engines.ref.target import load_target

    return load_target(target_path(name))


@torch.no_grad()
def sequences(target, num: int, new_tokens: int, seed: int, eps: float) -> torch.Tensor:
    """[num, PROMPT_LEN + new_tokens]: random prompts continued greedily by the target, each new token
    replaced by a random one with probability eps."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    x = torch.randint(4, vocab, (num, PROMPT_LEN), generator=gen)
    out = target(input_ids=x, use_cache=True)
    for i in range(new_tokens):
        nxt = out.logits[:, -1].argmax(-1)
        if eps > 0:
            swap = torch.rand(num, generator=gen) < eps
            nxt = torch.where(swap, torch.randint(4, vocab, (num,), generator=gen), nxt)
        x = torch.cat([x, nxt[:, None]], dim=1)
        if i + 1 < new_tokens:
            out = target(input_ids=nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
    return x


@lru_cache(maxsize=None)
@torch.no_grad()
def _training_run(target_name: str):
    """The training sequences and every target tensor on them, once per target and process
    (difftest_engines.ref.train.prepare_data would run the target again for every recipe)."""
    from difftest_engines.ref.target import run_target

    target = _target(target_name)
    tokens = sequences(target, TRAIN_SEQS, NEW_TOKENS, DATA_SEED, EPS)
    return tokens, run_target(target, tokens)


def _draft_config(target):
    from difftest_engines.ref.eagle3 import Eagle3Config

    H = target.config.hidden_size
    return Eagle3Config(
        hidden_size=H,
        intermediate_size=2 * H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=target.config.vocab_size,
        draft_vocab_size=min(512, target.config.vocab_size // 2),
        target_hidden_size=H,
        num_aux=3,
    )


def _build(recipe: Recipe, out: Path) -> None:
    from difftest_engines.ref.speculate import gather_fc_in
    from difftest_engines.ref.train import TrainData, save_eagle_format, train_draft

    target = _target(recipe.target)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # reproducible and fastest for tiny ops on a shared machine
    try:
        tokens, run = _training_run(recipe.target)
        data = TrainData(
            tokens, gather_fc_in(run, recipe.inputs).float(), run.logits.argmax(-1), run.final_norm.float()
        )
        with torch.enable_grad():
            draft = train_draft(
                target, _draft_config(target), recipe.inputs, data, seed=recipe.seed, **{**TRAIN, "steps": recipe.steps}
            )
    finally:
        torch.set_num_threads(before)
    save_eagle_format(draft, out, list(recipe.ids))
    (out / "recipe.json").write_text(
        json.dumps({**asdict(recipe), "key": recipe.key(), "train": TRAIN}, indent=1) + "\n"
    )


def ensure_draft(name: str, log=print) -> Path:
    from difftest_fixtures.cache import build_once

    recipe = RECIPES[name]
    final = root() / f"{name}-{recipe.key()}"
    if not final.exists():
        root().mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        build_once(final, lambda tmp: _build(recipe, tmp))
        log(f"[infer-wiring] trained {name} on {list(recipe.wiring)} in {time.time() - t0:.1f}s: {final}")
    return final


@lru_cache(maxsize=None)
def evidence(target_name: str):
    """difftest.rules.infer_wiring.Evidence: every target tensor on held-out sequences, as a reference capture
    holds them; cached on disk beside the drafts (keyed by the target's directory and the sequence recipe)."""
    from safetensors.torch import load_file, save_file

    from difftest.rules.infer_wiring import Evidence

    where = target_path(target_name)
    key = hashlib.sha256(
        json.dumps([BUILDER_VERSION, str(where), EVIDENCE_SEQS, EVIDENCE_NEW, EVIDENCE_SEED, PROMPT_LEN]).encode()
    ).hexdigest()[:12]
    path = root() / "evidence" / f"{target_name}-{key}.safetensors"
    if not path.exists():
        from difftest_engines.ref.target import run_target

        target = _target(target_name)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                seqs = sequences(target, EVIDENCE_SEQS, EVIDENCE_NEW, EVIDENCE_SEED, 0.0)
                out = run_target(target, seqs)
        finally:
            torch.set_num_threads(before)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
        save_file(
            {
                "tokens": seqs.contiguous(),
                "labels": out.logits.argmax(-1).contiguous(),
                "hidden": torch.stack(out.hidden).float().contiguous(),
                "final_norm": out.final_norm.float().contiguous(),
            },
            str(tmp),
        )
        os.replace(tmp, path)
    t = load_file(str(path))
    hidden, L = t["hidden"], t["hidden"].shape[0] - 1
    tensors = [
        {**{f"target.h.{k}": hidden[k, b] for k in range(L + 1)}, "target.final_norm": t["final_norm"][b]}
        for b in range(t["tokens"].shape[0])
    ]
    return Evidence(
        [s.tolist() for s in t["tokens"]], list(t["labels"]), tensors, L, f"{target_name} held-out sequences"
    )


def evidence_head(target_name: str, n: int):
    """The first n sequences of evidence(target_name): enough to see that an untrained draft tells nothing."""
    from difftest.rules.infer_wiring import Evidence

    e = evidence(target_name)
    return Evidence(e.tokens[:n], e.labels[:n], e.tensors[:n], e.num_layers, f"{e.source} (first {n})")


def family(target_name: str) -> str:
    return "deepseek" if "deepseek" in target_name else "llama"
