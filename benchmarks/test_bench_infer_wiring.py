"""Benchmark (pytest-benchmark): the cost of `wiring: infer` (difftest.rules.infer_wiring).

Not part of the test suite (pyproject's testpaths is tests/). Run:

    .venv/bin/python -m pytest benchmarks/test_bench_infer_wiring.py --benchmark-only -s

  tiny[NAME]        seconds to infer the wiring of a draft of tests/wiring_drafts.py (trained on a known
                    wiring) from its target's tensors on the held-out evidence (1 thread; the evidence
                    and the draft are built/loaded before timing): the search, the draft forwards and
                    the decision. extra_info: draft forwards, full-grid size, positions.
  forwards_61       how many draft forwards the search needs on a 61-layer target (h0..h61 and the final
                    norm: 63 tensors per slot, 3 slots, a 250047-wiring grid), with a synthetic scorer
                    (agreement grows with the number of correctly wired slots; common random numbers),
                    for 20 random true wirings (embedding or not, unsorted, final norm pre/post) started
                    from the config's readings of ids that engines read as something else.
Nothing is asserted about time; the forward count is checked against the grid.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import wiring_drafts as wd
from difftest.rules.infer_wiring import Scores, Search, infer_from_evidence, starts_for
from difftest_engines.ref.draft_loading import load_draft

TINY = ["llama-embed", "qwen3-unsorted-postnorm", "deepseek-unsorted-prenorm"]
LAYERS = 61
RESULTS: dict[str, dict] = {}


@pytest.mark.parametrize("name", TINY)
def test_tiny(benchmark, name):
    torch.set_num_threads(1)
    recipe = wd.RECIPES[name]
    loaded = load_draft(wd.ensure_draft(name))
    evidence = wd.evidence(recipe.target)
    result = benchmark.pedantic(
        infer_from_evidence,
        args=(loaded.model, loaded.config.layer_ids, evidence, wd.family(recipe.target)),
        rounds=3,
        iterations=1,
    )
    assert result.wiring == recipe.inputs
    benchmark.extra_info.update(forwards=result.forwards, grid=result.grid_size, positions=result.positions)
    RESULTS[name] = {
        "seconds": benchmark.stats.stats.min,
        "forwards": result.forwards,
        "grid": result.grid_size,
        "positions": result.positions,
    }


def _synthetic(truth: tuple[str, ...], n: int = 2000, seed: int = 0):
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed))

    def score(w):
        p = 0.05 + 0.85 * (sum(a == b for a, b in zip(w, truth)) / len(truth)) ** 2
        hits = u < p
        return Scores(hits, hits.float())

    return score


def _truths(count: int, rng: random.Random) -> list[tuple[str, ...]]:
    names = [f"target.h.{k}" for k in range(LAYERS + 1)] + ["target.final_norm"]
    out = []
    for i in range(count):
        w = rng.sample(names[1:], 3)
        if i % 2 == 0:
            w[0] = "target.h.0"  # with the embedding
        out.append(tuple(w))
    return out


def test_forwards_61(benchmark):
    candidates = [f"target.h.{k}" for k in range(LAYERS + 1)] + ["target.final_norm"]
    truths = _truths(20, random.Random(0))
    ids = [3, 31, 59]  # the example: what the config says, not what the draft learned

    def run_all() -> list[int]:
        counts = []
        for t in truths:
            search = Search(_synthetic(t), candidates, 3)
            assert search.run(starts_for(ids, LAYERS, 3)) == t
            counts.append(search.forwards)
        return counts

    counts = benchmark.pedantic(run_all, rounds=1, iterations=1)
    grid = len(candidates) ** 3
    assert max(counts) < grid / 100
    benchmark.extra_info.update(
        forwards_min=min(counts), forwards_mean=sum(counts) / len(counts), forwards_max=max(counts), grid=grid
    )
    RESULTS["61 layers (synthetic scorer)"] = {
        "forwards min": min(counts),
        "mean": sum(counts) / len(counts),
        "max": max(counts),
        "grid": grid,
    }


def teardown_module(module):
    for name, r in RESULTS.items():
        print(
            f"[infer-wiring bench] {name}: "
            + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
        )
