"""`difftest dump`: write offline training data from the reference target.

Each sample is a prompt followed by the target's own greedy continuation (loss mask 0 on
the prompt, 1 on the continuation, like chat data with loss on the assistant turn). The
dumped tensors are any canonical target tensors in any order, so a dump can be correct
(`h2+h4+h5+h8` for speculators' launch ids [2, 4, 5, 8]) or miswired on purpose
(`h0+h2+h4+h7`: the seed's embedding-first, verifier-not-final layout).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from difftest.api import ConfigError
from difftest.api import resolve, short_name
from difftest_engines.ref.speculate import gather_fc_in
from difftest_engines.ref.target import load_target, num_layers, run_target
from difftest_engines.trainingdata.formats import write_dump


def parse_layers(text: str, L: int) -> list[str]:
    """'h0+h2+h4+h7' or 'h2,h4,h5,final_norm' -> canonical names, checked against the target's depth."""
    names = list(resolve(re.sub(r"[,\s]+", "+", text.strip()), L, None, where="--layers").inputs)
    if len(names) < 2:
        raise ConfigError(f"--layers {text}: need at least two tensors (fc inputs, then the verifier)")
    return names


@torch.no_grad()
def greedy_continue(target, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(run_target(target, torch.tensor([out])).logits[0, -1].argmax()))
    return out


@torch.no_grad()
def dump_from_target(
    target_path: str | Path,
    out: str | Path,
    fmt: str,
    layers: str | list[str],
    prompts: list[list[int]],
    continue_tokens: int = 8,
    dtype: torch.dtype = torch.float32,
) -> Path:
    target = load_target(target_path, dtype)
    L = num_layers(target)
    names = parse_layers(layers, L) if isinstance(layers, str) else list(layers)
    samples = []
    for p in prompts:
        ids = greedy_continue(target, p, continue_tokens)
        res = run_target(target, torch.tensor([ids]))
        tensors = [gather_fc_in(res, [name])[0].to(dtype) for name in names]  # each [seq, H]
        samples.append((ids, [0] * len(p) + [1] * continue_tokens, tensors))
    truth = {"layers": [short_name(n) for n in names], "target": str(target_path), "num_layers": L}
    return write_dump(out, fmt, samples, len(names) - 1, truth)


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=g).tolist()
