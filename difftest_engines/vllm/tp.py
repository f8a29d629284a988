"""Tensor-parallel captures made whole: vLLM 0.32.0's sharding rule, as data, and the gather.

With tensor_parallel_size = N every rank's worker runs the capture hooks (difftest_engines/vllm/hooks.py)
and `LLM.collective_rpc` returns N records. Each canonical tensor (difftest.base.names) is one of:

  replicated     every rank holds the whole tensor, because vLLM reduces it before we read it;
                 the ranks must agree (a disagreement is an EngineError naming rank and tensor),
                 and rank 0's copy is the record.
  vocab-sharded  the LM head holds a slice of the vocabulary per rank: each rank's slice
                 (`local_logits`, read before vLLM's gather) is put at its rows and the joined
                 tensor is the record; it must equal what vLLM's own gather produced where a rank
                 holds that (every rank on CPU: Platform.use_all_gather is True).

No tensor the hooks read is partial: the hooks sit after vLLM's all-reduces (RowParallelLinear
with reduce_results=True, the MoE's all-reduce, VocabParallelEmbedding's all-reduce), never on a
column-parallel output or a pre-reduce partial sum. The rule below says so per tensor, with the
vLLM 0.32.0 code that makes it so (paths relative to the vllm package).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from difftest.api import EngineError

VERIFIED = "0.32.0"
REPLICATED = "replicated"
VOCAB_SHARDED = "vocab-sharded"


@dataclass(frozen=True)
class Layout:
    pattern: str  # a canonical name; `*` matches a layer index
    kind: str  # REPLICATED | VOCAB_SHARDED
    why: str  # the vLLM code that leaves the tensor in this layout


_REDUCED_LAYER = (
    "model_executor/models/llama.py::LlamaDecoderLayer.forward (o_proj, down_proj: "
    "layers/linear.py::RowParallelLinear, reduce_results=True) and deepseek_v2.py::"
    "DeepseekV2DecoderLayer.forward (MLA o_proj RowParallelLinear; DeepseekV2MoE.forward "
    "all-reduces the experts' sum): the residual stream after each layer is whole"
)
_EMBED = (
    "layers/vocab_parallel_embedding.py::VocabParallelEmbedding.forward: masked lookup of the "
    "rank's rows, then tensor_model_parallel_all_reduce"
)
_HEAD = (
    "layers/vocab_parallel_embedding.py::ParallelLMHead: rows org_vocab_start_index.."
    "org_vocab_end_index per rank (VocabParallelEmbedding._get_indices); layers/logits_processor.py::"
    "LogitsProcessor._get_logits: the rank's slice, then _gather_logits (all-gather where "
    "Platform.use_all_gather, else gather to rank 0), padding cut at org_vocab_size"
)

RULE: tuple[Layout, ...] = (
    Layout("target.h.0", REPLICATED, _EMBED),
    Layout("target.h.*", REPLICATED, _REDUCED_LAYER),
    Layout("target.final_norm", REPLICATED, "RMSNorm of the whole residual stream (computed on every rank)"),
    Layout("target.logits", VOCAB_SHARDED, _HEAD),
    Layout(
        "aux.router.*.experts",
        REPLICATED,
        "model_executor/models/deepseek_v2.py::DeepseekV2MoE: the gate is a GateLinear (layers/fused_moe/router/"
        "gate_linear.py, a ReplicatedLinear) over the whole residual stream, and every rank routes every token "
        "(router/base_router.py::BaseRouter._select_experts; no sequence parallelism without expert parallelism)",
    ),
    Layout(
        "draft.fc_in",
        REPLICATED,
        "v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer.propose: "
        "cat of the target's aux hidden states, each whole (target.h.*)",
    ),
    Layout(
        "draft.fc_out",
        REPLICATED,
        "model_executor/models/llama_eagle3.py::LlamaModel.__init__ and "
        "deepseek_eagle3.py: fc is a ReplicatedLinear (the whole weight on every rank)",
    ),
    Layout("draft.embeds", REPLICATED, _EMBED),
    Layout("draft.layer0.attn_in", REPLICATED, "input_layernorm of whole tensors (embeds, fc_out)"),
    Layout("draft.layer0.attn_out", REPLICATED, "self_attn.o_proj is a RowParallelLinear with reduce_results=True"),
    Layout("draft.layer0.mlp_out", REPLICATED, "mlp.down_proj is a RowParallelLinear with reduce_results=True"),
    Layout("draft.hidden_prenorm", REPLICATED, "the draft layer's hidden + residual, both whole"),
    Layout("draft.logits", VOCAB_SHARDED, _HEAD),
    Layout(
        "draft.logits_target",
        REPLICATED,
        "llama_eagle3.py::Eagle3LlamaForCausalLM.compute_logits scatters "
        "the gathered draft logits through draft_id_to_target_id on every rank",
    ),
)

_STEP = re.compile(r"^draft\.step\d+\.")
_LAYER = re.compile(r"\.\d+(?=$|\.)")


def layout_of(name: str) -> Layout:
    """The rule's entry for a canonical name (draft step prefixes and layer indices aside)."""
    base = _STEP.sub("draft.", name)
    for entry in RULE:
        if entry.pattern == base or _LAYER.sub(".*", base) == entry.pattern:
            return entry
    raise EngineError(
        f"vllm: no tensor-parallel layout for {name} in difftest_engines/vllm/tp.py::RULE (vllm {VERIFIED})"
    )


@dataclass
class Shard:
    """One rank's slice of a vocabulary-parallel tensor: rows [start, end) of `vocab`."""

    tensor: torch.Tensor
    start: int
    end: int
    vocab: int


@dataclass
class RankRecord:
    rank: int
    pid: int
    tensors: dict[str, torch.Tensor]  # canonical names; a gathered-to-rank-0 tensor is absent elsewhere
    shards: dict[str, Shard] = field(default_factory=dict)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    same_inf = torch.equal(torch.isinf(a), torch.isinf(b)) and torch.equal(a[torch.isinf(a)], b[torch.isinf(b)])
    fin = torch.isfinite(a) & torch.isfinite(b)
    if not same_inf or not torch.equal(torch.isnan(a), torch.isnan(b)):
        return float("inf")
    return float((a[fin] - b[fin]).abs().max()) if bool(fin.any()) else 0.0


def _join(name: str, shards: list[tuple[int, Shard]]) -> tuple[torch.Tensor, list[list[int]]]:
    vocab = shards[0][1].vocab
    ordered = sorted(shards, key=lambda rs: rs[1].start)
    at = 0
    for rank, s in ordered:
        if s.start != at or s.end - s.start != s.tensor.shape[-1] or s.vocab != vocab:
            raise EngineError(
                f"vllm: rank {rank}'s slice of {name} covers vocabulary rows [{s.start}, {s.end}) with "
                f"{s.tensor.shape[-1]} columns; expected rows from {at} of {vocab}"
            )
        at = s.end
    if at != vocab:
        raise EngineError(f"vllm: the ranks' slices of {name} cover vocabulary rows [0, {at}) of {vocab}")
    return torch.cat([s.tensor for _, s in ordered], dim=-1), [[s.start, s.end] for _, s in ordered]


def gather(ranks: list[RankRecord]) -> tuple[dict[str, torch.Tensor], dict]:
    """One whole tensor per canonical name from every rank's record, and what was done per tensor
    (for the capture's meta). Raises EngineError on ranks that disagree about a replicated tensor,
    on slices that do not tile the vocabulary, and on a join that differs from vLLM's own gather."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    if [r.rank for r in ranks] != list(range(len(ranks))):
        raise EngineError(f"vllm: tensor-parallel records from ranks {[r.rank for r in ranks]}")
    first = ranks[0]
    names = list(first.tensors) + [n for n in first.shards if n not in first.tensors]
    whole: dict[str, torch.Tensor] = {}
    done: dict[str, dict] = {}
    for name in names:
        layout = layout_of(name)
        if layout.kind == VOCAB_SHARDED:
            missing = [r.rank for r in ranks if name not in r.shards]
            if missing:
                raise EngineError(f"vllm: no vocabulary slice of {name} from rank {missing[0]}")
            joined, rows = _join(name, [(r.rank, r.shards[name]) for r in ranks])
            gathered = {r.rank: _max_abs(joined, r.tensors[name]) for r in ranks if name in r.tensors}
            for rank, diff in gathered.items():
                if diff != 0.0:
                    raise EngineError(
                        f"vllm: {name} joined from the ranks' vocabulary slices differs from vLLM's "
                        f"own gather on rank {rank} (max abs {diff:.3g})"
                    )
            whole[name] = joined
            done[name] = {"layout": VOCAB_SHARDED, "joined_rows": rows, "equals_vllm_gather_on_ranks": sorted(gathered)}
            continue
        ref = first.tensors[name]
        for r in ranks[1:]:
            other = r.tensors.get(name)
            if other is None or other.shape != ref.shape:
                got = "nothing" if other is None else f"shape {tuple(other.shape)}"
                raise EngineError(
                    f"vllm: rank {r.rank} recorded {got} for {name}, rank 0 shape {tuple(ref.shape)}; "
                    f"vLLM {VERIFIED} replicates it ({layout.why})"
                )
            diff = _max_abs(ref, other)
            if diff != 0.0:
                raise EngineError(
                    f"vllm: rank {r.rank} disagrees with rank 0 on {name} (max abs {diff:.3g}), "
                    f"which vLLM {VERIFIED} replicates ({layout.why})"
                )
        whole[name] = ref
        done[name] = {"layout": REPLICATED, "ranks_agree": True, "taken_from_rank": 0}
    return whole, done


def describe() -> dict[str, str]:
    """The rule as text, for the capture's meta: pattern -> layout (why)."""
    return {e.pattern: f"{e.kind}: {e.why}" for e in RULE}
