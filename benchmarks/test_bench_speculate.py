"""Benchmark (pytest-benchmark): the reference's speculative simulation with and without its KV caches.

Not part of the test suite (pyproject's testpaths is tests/). Run:

    .venv/bin/python -m pytest benchmarks/test_bench_speculate.py --benchmark-only -s

A random Llama target (DIFFTEST_BENCH_SPEC_SHAPE="hidden,layers,vocab,intermediate", default
1024,4,128256,4096: the Llama 3 vocab, whose output head is most of this model's cost) and a
random EAGLE-3 draft of the same width (draft vocab 32000) are built in memory (filled in place: no
slow initialisers). `simulate_greedy` then runs DIFFTEST_BENCH_SPEC_PROMPTS (default 2) random
prompts of DIFFTEST_BENCH_SPEC_PROMPT_LEN (default 64) tokens, 3 draft steps, 32 new tokens, per
dtype, with kv_cache=False (every forward over the whole sequence) and kv_cache=True (the caches,
with the near-tie guard), in the same run. Printed: the seconds of each (min of the rounds), their
ratio, the rounds and those the guard recomputed, and whether both gave the same statistics and
tokens (they must). Nothing about time is asserted.
"""

from __future__ import annotations

import os

import pytest
import torch

from difftest_engines.ref.eagle3 import Eagle3Config, Eagle3Draft
from difftest_engines.ref.speculate import CacheTrace, simulate_greedy

SHAPE = tuple(int(x) for x in os.environ.get("DIFFTEST_BENCH_SPEC_SHAPE", "1024,4,128256,4096").split(","))
PROMPTS = int(os.environ.get("DIFFTEST_BENCH_SPEC_PROMPTS", "2"))
PROMPT_LEN = int(os.environ.get("DIFFTEST_BENCH_SPEC_PROMPT_LEN", "64"))
STEPS, NEW_TOKENS, DRAFT_VOCAB = 3, 32, 32000
WIRING = ["target.h.1", "target.h.2", "target.h.3"]
RESULTS: dict[str, dict] = {}


def _fill(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[-1] ** -0.5, generator=gen)


def build(dtype: torch.dtype) -> tuple:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hidden, layers, vocab, inter = SHAPE
    heads, kv_heads = hidden // 128, max(1, hidden // 512)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        target = LlamaForCausalLM(cfg)
    target = target.to(dtype).to_empty(device="cpu")
    target.model.rotary_emb = LlamaRotaryEmbedding(cfg)  # to_empty leaves its inv_freq buffer uninitialised
    gen = torch.Generator().manual_seed(0)
    _fill(target, gen)
    draft_cfg = Eagle3Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128,
        vocab_size=vocab,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=hidden,
        num_aux=len(WIRING),
    )
    with torch.device("meta"):
        draft = Eagle3Draft(draft_cfg)
    draft = draft.to(dtype).to_empty(device="cpu")
    _fill(draft, gen)
    draft.d2t.zero_()
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(PROMPTS)]
    return target.eval(), draft.eval(), prompts


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def models(request):
    return request.param, build(getattr(torch, request.param))


@pytest.mark.parametrize("kv_cache", [False, True], ids=["uncached", "cached"])
def test_simulate_greedy(benchmark, models, kv_cache):
    dtype, (target, draft, prompts) = models
    trace = CacheTrace()

    def run():
        trace.rounds = trace.recomputed = 0
        return simulate_greedy(target, draft, WIRING, prompts, STEPS, NEW_TOKENS, kv_cache=kv_cache, trace=trace)

    stats, outputs = benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    counts = (stats.num_verify, stats.num_accepted, stats.accepted_per_pos)
    benchmark.extra_info.update(rounds=trace.rounds, recomputed=trace.recomputed)
    RESULTS[f"{dtype}-{'cached' if kv_cache else 'uncached'}"] = {
        "seconds": benchmark.stats.stats.min,
        "trace": (trace.rounds, trace.recomputed),
        "result": (counts, outputs),
    }

    if kv_cache and f"{dtype}-uncached" in RESULTS:
        _print_ratio(dtype)


def _print_ratio(dtype: str) -> None:
    before, after = RESULTS[f"{dtype}-uncached"], RESULTS[f"{dtype}-cached"]
    rounds, recomputed = after["trace"]
    print(
        f"\n{dtype}: shape (hidden, layers, vocab, intermediate) {SHAPE}, {PROMPTS} prompts x {PROMPT_LEN} tokens, "
        f"{STEPS} steps, {NEW_TOKENS} new tokens; torch {torch.__version__}, {torch.get_num_threads()} threads: "
        f"uncached {before['seconds']:.2f} s, cached {after['seconds']:.2f} s "
        f"({before['seconds'] / after['seconds']:.1f}x); {recomputed} of {rounds} rounds recomputed at a "
        f"near-tie; same statistics and tokens: {before['result'] == after['result']}"
    )
    assert before["result"] == after["result"]
