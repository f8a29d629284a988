"""Benchmark: peak memory and time of the float64 noise-floor run, whole copy vs streamed layer by layer.

Not part of the test suite (pyproject's testpaths is tests/). Run:

    .venv/bin/python -m pytest benchmarks/test_bench_streamed_float64.py -s

A random Llama target (DIFFTEST_BENCH_STREAM_SHAPE="hidden,layers,vocab,intermediate", default
2048,8,128256,8192: 1.1B parameters, the Llama 3 vocab) is written once as bfloat16 safetensors to
a temporary directory. Each path then runs in a fresh process, as the reference worker holds it
for a bfloat16 case: the case's own bfloat16 model loaded first, then the float64 run of T prompt
tokens (DIFFTEST_BENCH_STREAM_TOKENS, default 32):

  whole     rounded_through(load_target(path, float64), "bfloat16"): the copy the ref engine held
            before difftest_engines/ref/streamed.py
  streamed  StreamedTarget(the bfloat16 model, bfloat16): one decoder layer's weights (or the
            output head's) in float64 at a time

Printed per path: RSS after the bfloat16 load, peak RSS (ru_maxrss: the whole process, model
loads included), the float64 run's setup time (the load, or building the skeleton) and the
median of 3 forwards; and how far the two paths' logits are apart (<= 1e-14 of their scale). Nothing
timing- or size-related is asserted.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPE = tuple(int(x) for x in os.environ.get("DIFFTEST_BENCH_STREAM_SHAPE", "2048,8,128256,8192").split(","))
TOKENS = int(os.environ.get("DIFFTEST_BENCH_STREAM_TOKENS", "32"))


def write_target(directory: Path) -> Path:
    """A random bfloat16 Llama checkpoint of SHAPE (filled in place: no slow initialisers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, vocab, inter = SHAPE
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        head_dim=128,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    # to_empty leaves non-persistent buffers (the rotary inv_freq) uninitialised; harmless here, since
    # save_pretrained writes no non-persistent buffer and every path below runs on a model loaded back,
    # whose rotary embedding is computed from the config (child() checks it).
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[-1] ** -0.5, generator=gen)
    model.save_pretrained(directory)
    return directory


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _check_rotary(model: torch.nn.Module) -> None:
    """The float64 run's rotary buffers equal the config's: not the garbage to_empty() leaves behind."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    expected = LlamaRotaryEmbedding(model.config).inv_freq
    got = model.model.rotary_emb.inv_freq
    assert torch.equal(got.to(expected.dtype), expected), "rotary inv_freq not initialised from the config"


def child(path: str, mode: str, logits_out: str) -> dict:
    from difftest_engines.ref.engine import rounded_through
    from difftest_engines.ref.streamed import StreamedTarget
    from difftest_engines.ref.target import load_target, run_target

    torch.manual_seed(1)
    ids = torch.randint(0, SHAPE[2], (1, TOKENS))
    source = load_target(path, torch.bfloat16)  # the case's own model, held by the worker either way
    after_source = _rss_gib()
    t0 = time.perf_counter()
    stream = None
    if mode == "whole":
        model = rounded_through(load_target(path, torch.float64), "bfloat16")
    else:
        stream = StreamedTarget(source, torch.bfloat16)
        model = stream.model
    setup = time.perf_counter() - t0
    _check_rotary(model)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = run_target(model, ids)
        times.append(time.perf_counter() - t0)
    torch.save(out.logits, logits_out)
    return {
        "mode": mode,
        "rss_after_bf16_load_gib": round(after_source, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "setup_s": round(setup, 2),
        "forward_s": round(sorted(times)[1], 2),
        "float64_param_peak_gib": round(stream.residency.peak / 2**30, 3) if stream else None,
        "whole_float64_gib": round(StreamedTarget(source, torch.bfloat16).whole_bytes() / 2**30, 2),
    }


def test_streamed_float64_memory_and_time(tmp_path):
    target = write_target(tmp_path / "target")
    rows = []
    for mode in ("whole", "streamed"):
        proc = subprocess.run(
            [sys.executable, __file__, str(target), mode, str(tmp_path / f"{mode}.pt")],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    whole, streamed = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "streamed.pt")
    # the head streams in vocabulary chunks of a layer's size: its GEMM blocked otherwise, ~1e-15 apart
    moved = ((streamed - whole).abs().max() / whole.abs().max()).item()
    n = sum(f.stat().st_size for f in target.glob("*.safetensors")) // 2
    print(f"\nshape hidden,layers,vocab,intermediate = {SHAPE} ({n / 1e9:.2f}B parameters), {TOKENS} tokens")
    for r in rows:
        print(json.dumps(r))
    print(
        f"logits moved {moved:.1e} of their scale; streamed/whole forward: {rows[1]['forward_s'] / rows[0]['forward_s']:.2f}"
    )
    assert moved <= 1e-14


if __name__ == "__main__":
    print(json.dumps(child(*sys.argv[1:4])))
