"""Turn the files SGLang's forward hooks wrote (difftest_engines/sglang/hooks.py) into canonical tensors.

Plain torch, no SGLang import: the worker reads the records after `generate` returns.
Alignment is planned from the records' own metadata (forward mode, input ids, positions)
and checked, never assumed: a record that does not line up with the prompt is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from difftest.api import EngineError
from difftest.api import draft_name

SUBMODULE_KINDS = ("embed", "fc", "attn_in", "attn_out", "mlp_out")


@dataclass
class Forward:
    """One forward of the target or the draft: its `model` record plus what fired inside it."""

    model: dict
    subs: dict = field(default_factory=dict)  # kind -> record
    logits: dict | None = None

    @property
    def role(self) -> str:
        return self.model["role"]

    @property
    def mode(self) -> str:
        return self.model["mode"]

    @property
    def rows(self) -> int:
        return int(self.model["input_ids"].shape[0])


def load_forwards(records: list[tuple[str, dict]]) -> list[Forward]:
    """Group the hooks' records, in the order they were written (whole tensors: the ranks' records
    joined by difftest_engines/sglang/tensor_parallel.py::gather), into forwards."""
    forwards: list[Forward] = []
    pending: dict = {}
    for kind, rec in records:
        if kind in SUBMODULE_KINDS:
            pending[kind] = rec
        elif kind == "router":  # one per MoE layer of the forward: layer -> record
            pending.setdefault("routers", {})[int(rec["layer"])] = rec
        elif kind == "model":
            forwards.append(Forward(rec, pending))
            pending = {}
        elif kind == "logits" and forwards:
            forwards[-1].logits = rec
    return forwards


def scatter_to_target(logits: torch.Tensor, hot_token_id: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocab logits -> target vocab through SGLang's hot_token_id (-inf elsewhere)."""
    ids = hot_token_id.long()
    if ids.numel() and int(ids.max()) >= vocab_size:
        bad = int((ids >= vocab_size).nonzero()[0, 0])
        # SGLang itself then drafts token ids past its vocabulary and fails in its embedding
        # (vocab_parallel_embedding: "index out of range"): say why before it does
        raise EngineError(
            f"the draft's d2t maps draft id {bad} to target id {int(ids[bad])} (hot_token_id = d2t + arange), past "
            f"the target vocabulary of {vocab_size}: d2t holds absolute ids where SGLang adds offsets"
        )
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., ids] = logits
    return full


@dataclass
class Extracted:
    tensors: dict
    next_token: int
    draft_tokens: list
    captured_layers: list
    checks: dict


def extract(
    forwards: list[Forward],
    prompt_ids: list[int],
    num_steps: int,
    topk: int,
    hot_token_id: torch.Tensor,
    vocab_size: int,
) -> Extracted:
    n = len(prompt_ids)
    prompt = torch.tensor(prompt_ids)
    tensors: dict[str, torch.Tensor] = {}
    checks: dict = {}

    # -- the target's prefill over the prompt ------------------------------------------
    i_t = next(
        (
            i
            for i, f in enumerate(forwards)
            if f.role == "target"
            and f.mode == "EXTEND"
            and f.rows == n
            and torch.equal(f.model["input_ids"].long(), prompt)
        ),
        None,
    )
    if i_t is None:
        raise EngineError(f"no target prefill over the {n} prompt tokens among {len(forwards)} recorded forwards")
    tgt = forwards[i_t]
    layers = sorted(set(tgt.model["layers_to_capture"]))
    aux = tgt.model.get("aux") or []
    captured = [k for k in layers if k < tgt.model["num_layers"]][: len(aux)]  # layer L never runs: never captured
    for k, h in zip(captured, aux):
        tensors[f"target.h.{k}"] = h
    tensors["target.final_norm"] = tgt.model["final_norm"]
    for k, rec in sorted(tgt.subs.get("routers", {}).items()):
        ids = rec["topk_ids"]
        if ids.shape[0] != n:
            raise EngineError(f"MoE layer {k} routed {ids.shape[0]} rows in the target prefill, expected {n}")
        tensors[f"aux.router.{k}.experts"] = ids  # the reference's name (difftest_engines/ref/engine.py::_capture)
    if tgt.logits is None:
        raise EngineError("the target prefill's logits were not recorded")
    tensors["target.logits"] = tgt.logits["all_logits"]
    next_logits = tgt.logits["next_token_logits"][-1]
    checks["target_logits_last_row_max_abs"] = float((tgt.logits["all_logits"][-1] - next_logits).abs().max())
    next_token = int(next_logits.argmax())

    # -- draft step 0: fc over every prompt position (draft-extend after the prefill) ---
    later = forwards[i_t + 1 :]
    i_d = next(
        (i for i, f in enumerate(later) if f.role == "draft" and f.model.get("fc_applied") and f.rows == n), None
    )
    if i_d is None:
        unfused = next(
            (f for f in later if f.role == "draft" and f.rows == n and f.model.get("fc_applied") is False), None
        )
        if unfused is not None and aux:
            # sglang/srt/models/llama_eagle3.py::LlamaModel.forward applies fc only when the hidden states are
            # not already the draft's width: one captured layer is, so the draft runs on it without fc
            raise EngineError(
                f"SGLang ran its draft without fc: it captured {len(aux)} layer(s) ({', '.join(f'h{k}' for k in captured)}), "
                f"{len(aux) * aux[0].shape[-1]} wide, the draft's hidden size, so LlamaModel.forward skipped fc and "
                "fed that hidden state to the draft as is (fc never ran), with no error"
            )
        raise EngineError("no draft forward over the prompt positions after the target prefill (fc never ran)")
    drf = later[i_d]
    want_ids = torch.tensor(prompt_ids[1:] + [next_token])
    got_ids = drf.model["input_ids"].long()
    if not torch.equal(got_ids, want_ids):
        raise EngineError(
            f"draft step 0 input ids {got_ids.tolist()} are not the prompt shifted by one plus the "
            f"target's next token {want_ids.tolist()}"
        )
    if not torch.equal(drf.model["positions"].long(), torch.arange(n)):
        raise EngineError(f"draft step 0 positions {drf.model['positions'].tolist()} are not 0..{n - 1}")
    record_draft_forward(tensors, 0, drf, hot_token_id, vocab_size)
    if "fc" in drf.subs:
        tensors["draft.fc_out"] = drf.subs["fc"]["fc_out"]
    checks["draft_logits_last_row_max_abs"] = float(
        (drf.logits["all_logits"][-1] - drf.logits["next_token_logits"][-1]).abs().max()
    )
    drafted = [int(hot_token_id[int(tensors["draft.logits"][-1].argmax())])]

    # -- draft steps 1..k-1: one decode forward each (chain drafting only) --------------
    if topk == 1:
        step = 1
        for f in later[i_d + 1 :]:
            if step >= num_steps or f.role != "draft" or f.mode != "DECODE":
                break
            record_draft_forward(tensors, step, f, hot_token_id, vocab_size)
            drafted.append(int(hot_token_id[int(tensors[draft_name(step, "logits")][-1].argmax())]))
            step += 1
        checks["draft_steps_captured"] = step
    return Extracted(tensors, next_token, drafted, captured, checks)


def record_draft_forward(tensors: dict, step: int, f: Forward, hot_token_id: torch.Tensor, vocab_size: int) -> None:
    put = lambda name, t: tensors.__setitem__(draft_name(step, name), t)  # noqa: E731
    if step == 0 and "fc_in" in f.model:
        put("fc_in", f.model["fc_in"])
    if "embed" in f.subs:
        put("embeds", f.subs["embed"]["embeds"])
    for kind, name in (("attn_in", "layer0.attn_in"), ("attn_out", "layer0.attn_out"), ("mlp_out", "layer0.mlp_out")):
        if kind in f.subs:
            put(name, f.subs[kind]["t"])
    if not f.model.get("norm_output"):  # else SGLang's aux output is the normed state: no pre-norm tensor
        put("hidden_prenorm", f.model["aux_out"])
    if f.logits is None:
        raise EngineError(f"draft step {step}: logits were not recorded")
    put("logits", f.logits["all_logits"])
    put("logits_target", scatter_to_target(f.logits["all_logits"], hot_token_id, vocab_size))
