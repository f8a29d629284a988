"""Tensor parallelism: each rank's hook records (difftest_engines/sglang/hooks.py) joined into whole tensors.

Under `tp_size = N` SGLang runs one scheduler process per rank, and the forward hooks run in every
one of them: rank r writes its records under `<hooks dir>/rank<r>/`. Every rank runs the same
forwards in the same order, so their records pair up one to one; `gather` turns each pair (triple,
...) into one record of whole canonical tensors, by the rule below for each field.

RULES is the sharding of every tensor a hook records, read from SGLang 0.5.23's code (each entry
cites the file::function that decides it). Three ways a tensor can be split across ranks:
  REPLICATED  every rank holds the whole tensor (after the all-reduce that follows a row-parallel
              layer, or because it is the input of a column-parallel one). Taken from rank 0 and
              checked equal, bit for bit, on every other rank: a difference is an EngineError naming
              the rank and the tensor (a partial sum read where a reduced one was assumed, or ranks
              that ran different forwards).
  CONCAT      each rank holds one contiguous slice of the last dimension (a vocabulary-parallel
              head's logits, a column-parallel linear's output without gather_output): joined in rank
              order, then cut to the record's `vocab_size` where it has one (the padded vocabulary).
  SUM         each rank holds a partial sum (a row-parallel linear built with reduce_results=False,
              whose all-reduce comes later): added. The target's own layer-0 attention and MLP (the
              `layer0` hook fires on both models) are such; the draft's are reduced.
A tensor field without a rule is refused: a hook that records something new declares its sharding.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

import torch

from difftest.api import EngineError

VERIFIED = "0.5.23"
REPLICATED, CONCAT, SUM = "replicated", "concat", "sum"
RANK_DIR = "rank{}"
# values every record carries that differ by rank by construction
PER_RANK = ("tp_rank",)


@dataclass(frozen=True)
class Rule:
    kind: str  # the hook record's kind (file name suffix)
    field: str  # the key in that record
    how: str  # REPLICATED | CONCAT | SUM
    why: str  # SGLang 0.5.23 file::function that decides it
    tensors: tuple[str, ...]  # the canonical tensors it becomes (difftest_engines/sglang/records.py; step 0 unprefixed)
    when: tuple[str, object] | None = None  # applies only to records whose (key, value) is this


_ROW = "layers/linear.py::RowParallelLinear.forward all-reduces when reduce_results (the default)"
RULES: tuple[Rule, ...] = (
    # the target's decoder stack (llama.py::LlamaModel.forward, deepseek_v2.py::DeepseekV2Model.forward)
    Rule("model", "input_ids", REPLICATED, "scheduler broadcasts one batch to every rank", ()),
    Rule("model", "positions", REPLICATED, "scheduler broadcasts one batch to every rank", ()),
    Rule("model", "final_norm", REPLICATED, f"RMSNorm over the residual stream; {_ROW}", ("target.final_norm",)),
    Rule("model", "aux", REPLICATED, f"hidden_states + residual at a layer's entry; {_ROW}", ("target.h.*",)),
    # the draft's decoder stack (llama_eagle3.py::LlamaModel.forward, kimi_k25_eagle3.py::Eagle3MLAModel.forward)
    Rule(
        "model",
        "fc_in",
        REPLICATED,
        "spec_info.hidden_states: the target's replicated aux states joined",
        ("draft.fc_in",),
    ),
    Rule("model", "normed", REPLICATED, f"the draft layer's output through RMSNorm; {_ROW}", ()),
    Rule(
        "model",
        "aux_out",
        REPLICATED,
        f"the draft layer's residual stream; {_ROW}",
        ("draft.hidden_prenorm", "draft.step*.hidden_prenorm"),
    ),
    # draft sub-modules
    Rule(
        "embed",
        "embeds",
        REPLICATED,
        "layers/vocab_parallel_embedding.py::VocabParallelEmbedding.forward all-reduces each rank's masked lookup",
        ("draft.embeds", "draft.step*.embeds"),
    ),
    Rule("fc", "fc_in_normed", REPLICATED, "the fc input: built from replicated aux states", ()),
    Rule(
        "fc",
        "fc_out",
        REPLICATED,
        "llama_eagle3.py::LlamaModel.__init__: fc is a torch.nn.Linear, whole on every rank",
        ("draft.fc_out",),
        when=("module", "Linear"),
    ),
    Rule(
        "fc",
        "fc_out",
        CONCAT,
        "kimi_k25_eagle3.py::Eagle3MLAModel.__init__: fc is a ColumnParallelLinear with "
        "gather_output=False (Eagle3MLAModel.forward gathers it after, with _fc_gatherer)",
        ("draft.fc_out",),
        when=("module", "ColumnParallelLinear"),
    ),
    Rule(
        "attn_in",
        "t",
        REPLICATED,
        "the input of QKVParallelLinear (column-parallel) or of the MLA draft's "
        "ReplicatedLinear fused_qkv_a_proj_with_mqa",
        ("draft.layer0.attn_in", "draft.step*.layer0.attn_in"),
    ),
    Rule(
        "attn_out",
        "t",
        REPLICATED,
        f"o_proj is a RowParallelLinear with reduce_results=True; {_ROW} "
        "(llama_eagle3.py::LlamaDecoderLayer.__init__: stage_boundaries=False; kimi_k25_eagle3.py::"
        "Eagle3MLADecoderLayer.__init__: reduce_results=True)",
        ("draft.layer0.attn_out", "draft.step*.layer0.attn_out"),
        when=("reduced", True),
    ),
    Rule(
        "attn_out",
        "t",
        SUM,
        "o_proj is a RowParallelLinear with reduce_results=False: the target's layers "
        "(llama.py::LlamaDecoderLayer.__init__ with stage_boundaries, deepseek_v2.py::DeepseekV2DecoderLayer) "
        "all-reduce later, at the stage boundary",
        (),
        when=("reduced", False),
    ),
    Rule(
        "mlp_out",
        "t",
        REPLICATED,
        f"down_proj is a RowParallelLinear with reduce_results=True; {_ROW} "
        "(llama_eagle3.py::LlamaDecoderLayer.__init__ builds LlamaMLP with the default True; "
        "kimi_k25_eagle3.py builds DeepseekV2MLP with the default True)",
        ("draft.layer0.mlp_out", "draft.step*.layer0.mlp_out"),
        when=("reduced", True),
    ),
    Rule(
        "mlp_out",
        "t",
        SUM,
        "down_proj (or the MoE) with reduce_results=False: the target's layers "
        "(llama.py::LlamaDecoderLayer.__init__, deepseek_v2.py::DeepseekV2DecoderLayer.__init__) all-reduce at "
        "the stage boundary",
        (),
        when=("reduced", False),
    ),
    # logits_processor (layers/logits_processor.py::LogitsProcessor)
    Rule("logits", "hidden", REPLICATED, "the final-norm output handed to the logits processor", ()),
    Rule(
        "logits",
        "all_logits",
        CONCAT,
        "hidden @ lm_head.weight on each rank: a ParallelLMHead holds vocabulary rows "
        "[r * V/N, (r+1) * V/N) of the padded vocabulary V (layers/vocab_parallel_embedding.py::"
        "VocabParallelEmbedding.__init__, get_shard_indices)",
        ("target.logits", "draft.logits", "draft.logits_target", "draft.step*.logits", "draft.step*.logits_target"),
    ),
    Rule(
        "logits",
        "next_token_logits",
        REPLICATED,
        "LogitsProcessor._get_logits all-gathers the vocabulary (do_tensor_parallel_all_gather when tp_size > 1)",
        (),
    ),
    Rule(
        "router",
        "topk_ids",
        REPLICATED,
        "models/deepseek_v2.py::MoEGate holds the whole gate weight on every rank and DeepseekV2MoE.forward_normal "
        "routes every token of the whole hidden states on each (layers/moe/topk.py::select_experts; no expert or "
        "data-parallel attention split)",
        ("aux.router.*.experts",),
    ),
    Rule(
        "root",
        "hot_token_id",
        REPLICATED,
        "a buffer loaded whole on every rank (llama_eagle3.py::LlamaForCausalLMEagle3.load_weights)",
        (),
    ),
)


def rule_for(kind: str, field: str, record: dict) -> Rule | None:
    found = [
        r
        for r in RULES
        if r.kind == kind and r.field == field and (r.when is None or record.get(r.when[0]) == r.when[1])
    ]
    return found[0] if found else None


def rank_dirs(out_dir: str) -> list[str]:
    """The ranks' record folders, rank 0 first; checks that ranks 0..N-1 are all there."""
    names = [n for n in os.listdir(out_dir) if n.startswith("rank") and n[4:].isdigit()]
    ranks = sorted(int(n[4:]) for n in names)
    if ranks != list(range(len(ranks))):
        raise EngineError(f"tensor parallel: hook records from ranks {ranks}; expected 0..{len(ranks) - 1}")
    return [os.path.join(out_dir, RANK_DIR.format(r)) for r in ranks]


def load_rank(rank_dir: str) -> list[tuple[str, dict]]:
    """One rank's records in the order its hooks wrote them: (kind, record)."""
    out = []
    for name in sorted(f for f in os.listdir(rank_dir) if f.endswith(".pt")):
        kind = name.split("_", 1)[1][: -len(".pt")]
        out.append((kind, torch.load(os.path.join(rank_dir, name), weights_only=True)))  # tensors, lists, scalars
    return out


@dataclass
class Gathered:
    records: list[tuple[str, dict]]
    tp_size: int
    how: dict  # (kind, field, condition) -> Rule used


def gather(out_dir: str) -> Gathered:
    per_rank = [load_rank(d) for d in rank_dirs(out_dir)]
    if not per_rank:
        raise EngineError("SGLang ran no hooked forward (forward_hooks not registered?)")
    n = len(per_rank)
    for r, recs in enumerate(per_rank[1:], 1):
        if [k for k, _ in recs] != [k for k, _ in per_rank[0]]:
            raise EngineError(
                f"tensor parallel: rank {r} recorded {len(recs)} hook records "
                f"({_kinds(recs)}), rank 0 {len(per_rank[0])} ({_kinds(per_rank[0])}): "
                "the ranks did not run the same forwards"
            )
    how: dict = {}
    merged = [
        (kind, _merge(i, kind, [recs[i][1] for recs in per_rank], how)) for i, (kind, _) in enumerate(per_rank[0])
    ]
    return Gathered(merged, n, how)


def _kinds(recs: list) -> str:
    kinds = [k for k, _ in recs]
    return ", ".join(kinds[:6]) + (", ..." if len(kinds) > 6 else "")


def _merge(i: int, kind: str, recs: list[dict], how: dict) -> dict:
    out = {}
    for field, value in recs[0].items():
        if field in PER_RANK:
            continue
        values = [rec.get(field) for rec in recs]
        tensors = isinstance(value, torch.Tensor) or (
            isinstance(value, list) and value and isinstance(value[0], torch.Tensor)
        )
        if not tensors:
            for r, v in enumerate(values[1:], 1):
                if v != value:
                    raise EngineError(
                        f"tensor parallel: record #{i} ({kind}) has {field}={v!r} on rank {r}, {value!r} on rank 0"
                    )
            out[field] = value
            continue
        rule = rule_for(kind, field, recs[0])
        if rule is None:
            facts = {k: recs[0][k] for k in ("module", "reduced") if k in recs[0]}
            raise EngineError(
                f"tensor parallel: no sharding rule for {kind}.{field} {facts} in "
                "difftest_engines/sglang/tensor_parallel.py RULES"
            )
        how[(kind, field, rule.when)] = rule
        if isinstance(value, list):
            out[field] = [
                _join(rule, i, f"{kind}.{field}[{j}]", [v[j] for v in values], None) for j in range(len(value))
            ]
        else:
            out[field] = _join(rule, i, f"{kind}.{field}", values, recs[0].get("vocab_size"))
    return out


def _join(rule: Rule, i: int, name: str, parts: list, vocab_size: int | None) -> torch.Tensor:
    if rule.how == REPLICATED:
        for r, t in enumerate(parts[1:], 1):
            if t.shape != parts[0].shape or not torch.equal(t, parts[0]):
                diff = (
                    float((t.float() - parts[0].float()).abs().max())
                    if t.shape == parts[0].shape
                    else f"shape {tuple(t.shape)} vs {tuple(parts[0].shape)}"
                )
                raise EngineError(
                    f"tensor parallel: rank {r}'s {name} (record #{i}) differs from rank 0's "
                    f"(max abs {diff}); SGLang {VERIFIED}'s {name} is replicated: {rule.why}"
                )
        return parts[0]
    if rule.how == CONCAT:
        whole = torch.cat(parts, dim=-1)
        return whole[..., :vocab_size] if vocab_size is not None else whole
    if rule.how == SUM:
        return torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
    raise EngineError(f"tensor parallel: unknown sharding {rule.how!r} for {name}")


def describe(how: dict, tp_size: int, tensor_names: list[str]) -> dict:
    """For capture meta: per canonical tensor, what was done to the ranks' records to make it."""
    out = {}
    for name in tensor_names:
        rules = [r for r in how.values() if any(fnmatch.fnmatchcase(name, p) for p in r.tensors)]
        if not rules:
            continue
        r = rules[0]
        action = {
            REPLICATED: f"replicated: rank 0's, checked equal on {tp_size} ranks",
            CONCAT: f"gathered: {tp_size} shards joined on the last dimension",
            SUM: f"reduced: {tp_size} partial sums added",
        }[r.how]
        out[name] = f"{action} ({r.why})" if tp_size > 1 else "whole (tp_size 1)"
    return out
