"""Built-in training-data dumps of the tiny target (a `difftest.fixtures` provider).

    tiny-llama-train-data                speculators, [h2, h4, h5, h8]: fc [h2, h4, h5], verifier the final layer
    tiny-llama-train-data-miswired       speculators, [h0, h2, h4, h7]: the seed's layout (launch ids [0, 2, 4, 7])
    tiny-llama-train-data-embed          speculators, [h0, h2, h4, h8]: fc [h0, h2, h4] as the seed's trainer
                                         fed it, verifier the final layer (what the miswired draft learned)
    tiny-llama-train-data-specforge      SpecForge offline, aux [h2, h4, h5], hidden_state = final_norm

Each holds the shipped cases' prompts (so every case prompt has a sample) and 16 random
ones, each followed by 8 greedy tokens of the target. Built on first use into the user
cache, keyed by the recipe and the target checkpoint's files.
"""

from __future__ import annotations

import json
from pathlib import Path

from difftest.api import resolve_fixture as resolve_core_fixture  # this module has its own resolve_fixture
from difftest.api import signature
from difftest_fixtures.cache import publish_keyed

LANE = "tiny-llama"  # dumps of tiny-llama: in difftest_fixtures.tiny_llama's lane (`difftest fixtures`)
RECIPES = {
    "tiny-llama-train-data": ("speculators", "h2+h4+h5+h8"),
    "tiny-llama-train-data-miswired": ("speculators", "h0+h2+h4+h7"),
    "tiny-llama-train-data-embed": ("speculators", "h0+h2+h4+h8"),
    "tiny-llama-train-data-specforge": ("specforge", "h2+h4+h5+final_norm"),
}
TARGET = "fixture:tiny-llama"
CONTINUE = 8
CASE_PROMPTS = [
    [331, 518, 978, 528, 666, 884, 979, 109, 909, 232, 920],
    [640, 573, 434, 806, 590, 564, 866, 752, 799, 790, 506, 773, 795, 604, 455, 249, 6, 632, 86],
    [298, 840, 104, 464, 15, 838, 916, 705, 506, 699, 325],
    [410, 261, 360, 955, 369, 828, 389, 767, 529, 657, 82, 744, 352],
    [574, 554, 303, 298, 472, 148, 901, 664],
    [737, 595, 320, 29, 872, 731, 381, 376, 476, 436, 96, 412, 916],
    [571, 514, 892, 123, 439, 522, 825, 772, 891, 618, 900, 506],
    [942, 541, 268, 868, 434, 581, 952, 494, 529, 534, 828],
]


def build(name: str, force: bool = False) -> Path:
    from difftest_engines.trainingdata.dump import dump_from_target, random_prompts

    fmt, layers = RECIPES[name]
    target = Path(resolve_core_fixture(TARGET))
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]

    def write(tmp: Path) -> None:
        prompts = CASE_PROMPTS + random_prompts(vocab, 16, 12, seed=1)
        dump_from_target(target, tmp, fmt, layers, prompts, CONTINUE)

    return publish_keyed("train-data", name, [fmt, layers, CASE_PROMPTS, CONTINUE, signature(target)], write, force)


def resolve_fixture(name: str) -> Path | None:
    return build(name) if name in RECIPES else None


def build_all(force: bool = False) -> None:
    for name in RECIPES:
        build(name, force)
