"""The order the suite's modules are handed to scripts/test's two streams, and the fixtures several
engine modules share.

`pytest-xdist --dist loadfile` keeps a module on one stream and hands the next module to whichever
stream is free. By default it hands them out by test count, most first, which puts the modules
that run engine sessions over a few tests (the `difftest fix` runs, the writer and trainer
end-to-end runs, the rule property test) last, where one stream runs the last of them while the
other has finished. scripts/test passes `--no-loadscope-reorder`, so the streams take the modules
in this order instead: the long ones first, longest first (longest-processing-time order), then
the rest by test count as before, so that short modules fill in while the long ones finish.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

# Seconds on one stream in the last fresh-clone CI measure (stop 36: module setup, calls and
# teardowns summed from --durations=0), longest first. An estimate only orders the queue; a wrong one
# costs balance, not results.
LONG_MODULES = (
    # ~1000 (stop 55: every cell, 699 s alone with the models built; CI's load stretches it ~1.5x)
    "test_noise_matrix.py",  # the independent models' session on ref, vLLM and SGLang
    "test_upgrade_real_releases.py",  # 611: four sessions on the old and pinned releases
    "test_fix_command.py",  # 448: `difftest fix` on SGLang (three cases, one run; 448 was three runs) and vLLM
    "test_speculators_writer_e2e.py",  # 252: vLLM server, speculators' writer and trainer
    "test_probe_servers.py",  # 244: live vLLM and SGLang servers probed from outside
    "test_trainer_e2e.py",  # 196: a trainer run, serving e2e and the metric oracle
    "test_engine_vllm_v2.py",  # ~420 (estimated): V1 on four cases, the fix on both runners, compiled vs eager
    "test_rules_discover.py",  # ~330 (estimated): three releases' rules measured, one engine start per probe
    "test_layer_rules_engines.py",  # ~300: the rule property test on SGLang and both vLLM runners
    "test_engine_vllm_tp.py",  # 176: vLLM at TP = 2
    "test_vllm_release_preview.py",  # ~90: two wheels downloaded and their config code run
    "test_infer_wiring.py",  # 166: wirings inferred from independent drafts
    "test_upgrade_check.py",  # 142: the simulated two-label SGLang upgrade
    "test_cases.py",  # 146: the reference presets over every shipped case, after the shipped run
)


def _check_listed() -> None:
    missing = [name for name in LONG_MODULES if not (HERE / name).exists()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: LONG_MODULES names {missing[0]}, which is not in tests/")


_check_listed()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    counts = Counter(item.path for item in items)
    rank = {name: i for i, name in enumerate(LONG_MODULES)}

    def order(item: pytest.Item) -> tuple:
        if item.path.name in rank and item.path.parent == HERE:
            return (0, rank[item.path.name], 0, "")
        return (1, 0, -counts[item.path], str(item.path))

    items.sort(key=order)  # stable: a module's own tests keep their order


# Tiny random checkpoints: one pair per module (module scope), as each module built its own before.
@pytest.fixture(scope="module")
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny random target and draft on disk (helpers.make_tiny_pair). A module whose checks need
    another depth (its draft's ids placed apart) or seed sets TINY_PAIR_LAYERS or TINY_PAIR_SEED."""
    from helpers import make_tiny_pair

    layers = getattr(request.module, "TINY_PAIR_LAYERS", 6)
    seed = getattr(request.module, "TINY_PAIR_SEED", 0)
    return make_tiny_pair(tmp_path_factory.mktemp("models"), num_layers=layers, seed=seed)


@pytest.fixture(scope="module")
def loaded_models(models: tuple[Path, Path]) -> tuple:
    """The tiny pair loaded for in-process decoding: (target model, draft module), the draft sharing
    the target's embedding and lm_head as it would inside an engine."""
    from difftest_engines.ref.draft_loading import load_draft
    from difftest_engines.ref.target import load_target

    target_dir, draft_dir = models
    target = load_target(target_dir)
    w = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    return target, load_draft(draft_dir, *w).model


@pytest.fixture(scope="module")
def shipped_run():
    """The one real run of the user's command over every shipped case (tests/shipped_run.py), or a skip
    naming the setup commands; the engine modules read their cases' results from it."""
    from shipped_run import shipped_or_skip

    return shipped_or_skip()


@pytest.fixture(scope="module")
def sglang_python() -> str:
    """SGLang's interpreter, for the modules that start SGLang sessions (helpers.sglang_python_or_skip)."""
    from helpers import sglang_python_or_skip

    return sglang_python_or_skip()
