"""vLLM and SGLang record the experts each MoE layer chose (`aux.router.{k}.experts`, the reference's
name and layout: one row per prompt token, top-k expert ids), so routing is compared with the
reference row by row (difftest.compare.noise.routing_rows) instead of excused on the score noise.

The hooks' logic on stand-in modules (no engine), then the real engines on the shipped DeepSeek-V3
case (cases/tiny_deepseek_v3.yaml), read from the one real run of the user's command over every
shipped case (tests/shipped_run.py): no engine starts here.
"""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import ROOT

from difftest_engines.sglang import hooks as sglang_hooks
from difftest_engines.sglang import tensor_parallel as sglang_tp
from difftest_engines.sglang.records import load_forwards
from difftest_engines.vllm import hooks as vllm_hooks
from difftest_engines.vllm import tp as vllm_tp

CASE = "tiny_deepseek_v3"
# the fixture target (difftest_fixtures: 6 layers, first_k_dense_replace 1): layers 1..5 are MoE
MOE_LAYERS = [1, 2, 3, 4, 5]


def _prompt_lengths() -> list[int]:
    return [len(p["ids"]) for p in yaml.safe_load((ROOT / "cases" / f"{CASE}.yaml").read_text())["prompts"]]


# -- vLLM: the router's capture_fn (base_router.py::BaseRouter._select_experts) ----------------------


class _Router:
    """vLLM 0.32.0's BaseRouter as the hook sees it: a capture_fn it calls with the chosen ids."""

    def __init__(self):
        self.capture_fn = None

    def set_capture_fn(self, fn):
        self.capture_fn = fn


class _Runner(torch.nn.Module):
    def __init__(self, layer: int):
        super().__init__()
        self.router, self.layer_id = _Router(), layer


def _vllm_target() -> torch.nn.Module:
    target = torch.nn.Module()
    target.model = torch.nn.Module()
    target.model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
    for k in (1, 2):  # layer 0 dense, as first_k_dense_replace = 1
        target.model.layers[k].mlp = torch.nn.Module()
        target.model.layers[k].mlp.experts = _Runner(k)
    return target


def _recorder() -> vllm_hooks.Recorder:
    rec = vllm_hooks.Recorder.__new__(vllm_hooks.Recorder)
    rec.reset(False)
    return rec


def test_vllm_records_each_moe_layers_expert_ids_of_the_armed_prefill_only():
    target, rec = _vllm_target(), _recorder()
    assert vllm_hooks._hook_routers(target, rec) == [1, 2]
    route = lambda k, ids: target.model.layers[k].mlp.experts.router.capture_fn(ids)  # noqa: E731
    route(1, torch.tensor([[0, 1]]))  # not armed: a warm-up or a speculative run
    rec.reset(True)
    rec.phase = "target-running"
    prefill = {1: torch.tensor([[3, 5], [0, 7]]), 2: torch.tensor([[1, 2], [6, 4]])}
    for k, ids in prefill.items():
        route(k, ids)
    route(1, torch.tensor([[9, 9], [9, 9]]))  # a second call in the same forward keeps the first
    rec.phase = "draft"
    route(2, torch.tensor([[8, 8]]))  # after the target's prefill
    assert sorted(rec.t["routers"]) == [1, 2]
    for k, ids in prefill.items():
        assert torch.equal(rec.t["routers"][k], ids)


def test_vllm_keeps_calling_a_capture_fn_set_before_its_own():
    target, rec = _vllm_target(), _recorder()
    seen = []
    target.model.layers[1].mlp.experts.router.capture_fn = seen.append  # vLLM's routed-experts capturer
    vllm_hooks._hook_routers(target, rec)
    ids = torch.tensor([[2, 3]])
    target.model.layers[1].mlp.experts.router.capture_fn(ids)
    assert seen == [ids]


def test_vllm_tensor_parallel_rule_takes_the_expert_ids_as_replicated():
    assert vllm_tp.layout_of("aux.router.3.experts").kind == vllm_tp.REPLICATED


# -- SGLang: the TopK module's output (layers/moe/topk.py::TopK) ---------------------------------------

StandardTopKOutput = namedtuple("StandardTopKOutput", "topk_weights topk_ids router_logits")


def _topk_module(layer: int, top_k: int, shared_slots: int = 0):
    cfg = SimpleNamespace(top_k=top_k + shared_slots, num_shared_topk_slots=shared_slots)
    return SimpleNamespace(layer_id=layer, topk_config=cfg)


def test_sglang_router_hook_records_the_layer_and_its_routed_ids_without_shared_slots(tmp_path, monkeypatch):
    monkeypatch.setattr(sglang_hooks, "tp_rank", lambda: (0, 1))  # SGLang's tp group, outside SGLang
    out_dir = tmp_path / "hooks"
    out_dir.mkdir()
    hook = sglang_hooks.router_hook({"out_dir": str(out_dir)})
    ids = torch.tensor([[4, 1, 8], [2, 6, 8]])  # two routed experts, then the fused shared slot (8)
    hook(_topk_module(3, 2, shared_slots=1), (None, None), StandardTopKOutput(torch.ones(2, 3), ids, None))
    [(kind, record)] = sglang_tp.load_rank(str(out_dir / "rank0"))
    assert kind == "router" and record["layer"] == 3
    assert torch.equal(record["topk_ids"], ids[:, :2])


def test_sglang_router_hook_without_topk_ids_records_nothing(tmp_path):
    out_dir = tmp_path / "hooks"
    out_dir.mkdir()
    bypassed = SimpleNamespace(hidden_states=None, router_logits=None)  # a BYPASSED output holds no ids
    sglang_hooks.router_hook({"out_dir": str(out_dir)})(_topk_module(1, 2), (None, None), bypassed)
    assert list(out_dir.iterdir()) == []


def test_sglang_router_records_belong_to_the_forward_they_fired_in_keyed_by_layer():
    ids = {1: torch.tensor([[0, 1]]), 2: torch.tensor([[3, 2]])}
    records = [("router", {"layer": k, "topk_ids": v}) for k, v in ids.items()]
    records += [("model", {"role": "target"}), ("model", {"role": "draft"})]
    target, draft = load_forwards(records)
    assert sorted(target.subs["routers"]) == [1, 2] and "routers" not in draft.subs
    assert torch.equal(target.subs["routers"][2]["topk_ids"], ids[2])


def test_sglang_tensor_parallel_rule_takes_the_expert_ids_as_replicated():
    rule = sglang_tp.rule_for("router", "topk_ids", {})
    assert rule is not None and rule.how == sglang_tp.REPLICATED and rule.tensors == ("aux.router.*.experts",)


# -- the real engines on the shipped DeepSeek-V3 case ---------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_records_the_experts_of_every_prompt_token_at_every_moe_layer(shipped_run, engine):
    comparisons = shipped_run.report(CASE).comparisons[engine]
    lengths = _prompt_lengths()
    assert [p.prompt for p in comparisons] == list(range(len(lengths)))
    for prompt in comparisons:
        assert [r.layer for r in prompt.routing] == MOE_LAYERS, prompt.routing
        for r in prompt.routing:
            assert r.observed and r.agreement is not None and r.differs is not None, r
            assert r.rows == lengths[prompt.prompt], r


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_expert_sets_equal_the_references_wherever_its_margin_is_clear(shipped_run, engine):
    """A row an engine sent to other experts is only ever one at a reference near-tie (judged apart):
    at every clear margin its top-k set is the reference's."""
    for prompt in shipped_run.report(CASE).comparisons[engine]:
        for r in prompt.routing:
            assert r.clear == 0, r
            assert r.differs == r.apart, r


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_report_routing_table_shows_agreement_counts_not_not_captured(shipped_run, engine):
    md = (shipped_run.root / "reports" / f"{CASE}.md").read_text()
    table = md.split(f"Routing of `{engine}` against the reference, per MoE layer:", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| prompt")]
    assert len(rows) == len(MOE_LAYERS) * len(shipped_run.report(CASE).comparisons[engine])
    assert not any("not captured" in line for line in rows), table
