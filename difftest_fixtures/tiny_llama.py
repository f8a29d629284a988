"""Deterministic tiny models for tests, built lazily and cached.

Fixtures (under `$DIFFTEST_CACHE` or `~/.cache/difftest`, in `fixtures/<FIXTURES_VERSION>/<name>/`):

  tiny-llama                     LlamaForCausalLM target (8 layers, hidden 128) + WordLevel tokenizer
  tiny-qwen3                     Qwen3ForCausalLM target (4 layers, HF random init), same tokenizer
  tiny-llama-eagle3              EAGLE-3 draft trained on fc = [h2, h4, h5]; HF/EAGLE format, ids [2, 4, 5]
  tiny-llama-eagle3-speculators  the same weights in speculators format
  tiny-llama-eagle3-miswired     the seed bug: trained on fc = [h0, h2, h4] (speculators-launch, launch ids
                                 [0, 2, 4, 7]: fc = all but the last, verifier h7) but saved with ids
                                 [2, 4, 7], so vLLM's convention feeds [h2, h4, h7]: same width, wrong tensors

The targets are built by difftest_fixtures/targets.py (why the Llama is constructed, not
random, is explained there), the drafts by the one pipeline in difftest_fixtures/drafts.py,
and everything is cached and published by difftest_fixtures/cache.py. This module names the
fixtures, their wirings, and is the `difftest.fixtures` provider "builtin" (resolve_fixture,
build_all).

Everything is seeded; the builds are deterministic (weights bit-identical across builds;
draft training is bit-exact for a given machine and thread count, which the build pins).
"""

from __future__ import annotations

from pathlib import Path

from difftest_fixtures import cache, drafts, targets
from difftest_fixtures.provider import NamedProvider

# `difftest fixtures` builds each lane in its own process; providers building on these fixtures join it
LANE = "tiny-llama"
NAMES = [
    "tiny-llama",
    "tiny-qwen3",
    "tiny-llama-eagle3",
    "tiny-llama-eagle3-speculators",
    "tiny-llama-eagle3-miswired",
]
_DEPS: dict[str, list[str]] = {
    "tiny-qwen3": [],
    "tiny-llama": [],
    "tiny-llama-eagle3": ["tiny-llama"],
    "tiny-llama-eagle3-speculators": ["tiny-llama", "tiny-llama-eagle3"],
    "tiny-llama-eagle3-miswired": ["tiny-llama"],
}

GOOD_WIRING = ["target.h.2", "target.h.4", "target.h.5"]  # vLLM default ids (2, L//2, L-3) for L = 8
GOOD_IDS = [2, 4, 5]
MISWIRED_TRAIN_WIRING = ["target.h.0", "target.h.2", "target.h.4"]  # speculators-launch, launch ids [0, 2, 4, 7]
MISWIRED_IDS = [2, 4, 7]
MISWIRED_SERVED_WIRING = ["target.h.2", "target.h.4", "target.h.7"]  # vLLM reading ids [2, 4, 7]
SGLANG_SERVED_WIRING = ["target.h.3", "target.h.5", "target.h.6"]  # SGLang 0.5.23 (Llama) reading ids [2, 4, 5]

GOOD_DRAFT = drafts.DraftRecipe(
    name="tiny-llama-eagle3",
    target="tiny-llama",
    train_wiring=GOOD_WIRING,
    layer_ids=GOOD_IDS,
    alternatives=(
        drafts.Alternative(
            "served_off_by_one",
            "what SGLang 0.5.23's Llama feeds for ids [2, 4, 5] (id k -> h[k+1])",
            SGLANG_SERVED_WIRING,
        ),
    ),
    context_dependence=True,
)
MISWIRED_DRAFT = drafts.DraftRecipe(
    name="tiny-llama-eagle3-miswired",
    target="tiny-llama",
    train_wiring=MISWIRED_TRAIN_WIRING,
    layer_ids=MISWIRED_IDS,
    alternatives=(
        drafts.Alternative(
            "served_with_config_ids",
            "what an engine using vLLM's convention feeds for ids [2, 4, 7]",
            MISWIRED_SERVED_WIRING,
            with_simulation=True,
        ),
    ),
    train_notes={
        "speculators_train_launch_ids": [0, 2, 4, 7],
        "verifier": "target.h.7 (recorded only: labels come from the target's final logits)",
    },
)


def fixture_path(name: str) -> Path:
    if name not in NAMES:
        raise KeyError(f"unknown fixture {name!r}; known: {', '.join(NAMES)}")
    return cache.fixtures_dir() / name


def _build_tiny_llama(out: Path, build: cache.Build) -> None:
    # The description is written into the fixture (fixture.json / quality.json), whose bytes keyed
    # fixtures hash (difftest_fixtures/cache.py publish_keyed): it keeps the path the code had when
    # FIXTURES_VERSION v1 was cut, so a rebuild stays byte-identical. The code is now in difftest_fixtures/targets.py.
    targets.save_target(
        targets.build_llama_target(),
        out,
        "LlamaForCausalLM with a seeded second-order circuit: greedy next token = f(t_i, t_{i-1}); "
        "see difftest_engines/ref/fixture_targets.py::build_llama_target",
    )


def _build_tiny_qwen3(out: Path, build: cache.Build) -> None:
    targets.save_target(targets.build_qwen3_target(), out, "Qwen3ForCausalLM at HF random init (seeded); no draft")


def _build_speculators_draft(out: Path, build: cache.Build) -> None:
    """The good draft's weights in the speculators layout (a format, not a new training)."""
    src = fixture_path("tiny-llama-eagle3")
    drafts.save_speculators_copy(src, out, GOOD_IDS, format="speculators", same_weights_as="tiny-llama-eagle3")


_BUILDERS: dict[str, cache.Builder] = {
    "tiny-llama": _build_tiny_llama,
    "tiny-qwen3": _build_tiny_qwen3,
    "tiny-llama-eagle3": lambda out, build: drafts.build_draft(GOOD_DRAFT, out, build),
    "tiny-llama-eagle3-speculators": _build_speculators_draft,
    "tiny-llama-eagle3-miswired": lambda out, build: drafts.build_draft(MISWIRED_DRAFT, out, build),
}


def ensure_fixtures(names: list[str] | None = None, log: cache.Log = print, force: bool = False) -> dict[str, Path]:
    """Build the named fixtures (default: all) unless cached; returns name -> directory.

    Dependencies (a draft needs tiny-llama) are built first; see difftest_fixtures.cache.ensure_built.
    """
    return cache.ensure_built(list(NAMES if names is None else names), NAMES, _BUILDERS, _DEPS, log=log, force=force)


# -- the `difftest.fixtures` provider interface (pyproject entry point "builtin") ---------------
_PROVIDER = NamedProvider("python -m difftest_fixtures.tiny_llama", __doc__, NAMES, ensure_fixtures)
resolve_fixture, build_all, main = _PROVIDER.resolve_fixture, _PROVIDER.build_all, _PROVIDER.main


if __name__ == "__main__":
    raise SystemExit(main())
