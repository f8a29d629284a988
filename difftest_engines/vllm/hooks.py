"""Capture hooks installed inside vLLM's model worker (pinned to vLLM 0.32.0).

Every function here is module level so `LLM.collective_rpc(fn)` can ship it to the worker
(in-process by default; pickled by reference when vLLM runs workers in processes, which
needs VLLM_ALLOW_INSECURE_SERIALIZATION=1). Each receives vLLM's worker object.

What is hooked, and where it lives in vllm 0.32.0 (paths relative to the vllm package):
  * target forward: `model_executor/models/llama.py::LlamaForCausalLM.forward` returns
    (post-final-norm hidden, aux list) when aux layers are set; the aux list is built by
    `model_executor/models/interfaces.py::_maybe_add_hidden_state` (id 0 = embedding,
    id i = hidden + residual after layer i-1, in layer order). LlamaForCausalLM itself is not
    compiled, so a forward hook on it fires with and without torch.compile.
  * target layers (eager only): `LlamaModel` is `@support_torch_compile`; hooks on the
    compiled module never fire and hooks on its children would be traced, so the per-layer
    residual stream (all target.h.k) is recorded only with enforce_eager.
  * draft (Model Runner V1; V2's speculator makes the same calls, see `drafter_owner`):
    `v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer.propose` calls
    `model.combine_hidden_states(cat(aux))` (`model_executor/models/llama_eagle3.py`:
    optional input_norm / fc_norm, then `fc`), then `model(input_ids, positions,
    hidden_states)` once per draft step (step 0 over every scheduled token, later steps
    one row per request) and `model.compute_logits` (draft-vocab `logits_processor`,
    scattered into the target vocab through `draft_id_to_target_id`) on the sampled rows.
    Eagle3LlamaForCausalLM is not compiled (its inner LlamaModel is), so wrapping
    combine_hidden_states / compute_logits and hooking the module itself works in both modes.

Tensor parallel (tensor_parallel_size > 1): these functions run in every rank's worker process and
`collective_rpc` returns one answer per rank; `fetch` adds each rank's own vocabulary slice of
every logits tensor (`local_logits`), which difftest_engines/vllm/tp.py joins into the whole tensor and
checks against vLLM's own gather. Every rank runs the same `fetch`, so the collectives inside
vLLM's modules (all-reduce, all-gather) stay matched across ranks.

  * MoE routing (DeepSeek-V2/V3, Kimi-K2 targets): each MoE layer's runner
    (`model_executor/layers/fused_moe/runner/moe_runner.py::MoERunner`, `.router`, `.layer_id`)
    routes through `layers/fused_moe/router/base_router.py::BaseRouter._select_experts`, which calls
    the router's `capture_fn(topk_ids)` (vLLM's own hook for routed-expert capture, set with
    `set_capture_fn`) with the logical expert ids right after `_compute_routing` (on CPU
    `router/cpu_router.py::CPURouter._compute_routing` -> `_grouped_topk`), before any EPLB
    remapping: one row per scheduled token, top_k columns. The MoE runs behind vLLM's `moe_forward`
    custom op (not traced by torch.compile), so the callback should fire compiled too (measured
    eager only). A layer whose
    experts take the monolithic path (`routed_experts.quant_method.is_monolithic`: the router
    is never called) records nothing and the report says its expert ids were not captured.

Only the first target forward after `arm` (the prompt's prefill) and the first `propose`
(the draft chain right after it) are recorded. `arm(golden)` also feeds the reference's
draft.fc_in to that first combine_hidden_states (layerwise golden inputs).
"""

from __future__ import annotations

import torch

_ATTR = "_difftest_recorder"


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def runner_of(model_runner) -> str:
    """ "v2" for Model Runner V2 (vllm/v1/worker/gpu/model_runner.py::GPUModelRunner and its CPU subclass
    v1/worker/cpu/model_runner.py::CPUModelRunner), "v1" for V1 (v1/worker/gpu_model_runner.py)."""
    return "v2" if type(model_runner).__module__.startswith(("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.")) else "v1"


def drafter_owner(model_runner):
    """What proposes the draft tokens: V1's `runner.drafter` (v1/spec_decode/eagle.py::EagleProposer), V2's
    `runner.speculator` (v1/worker/gpu/spec_decode/eagle/speculator.py::EagleSpeculator, whose
    TargetDependentARSpeculator.propose calls model.combine_hidden_states(cat(aux)), then
    model(input_ids=, positions=, hidden_states=, inputs_embeds=) per draft step and
    model.compute_logits on the sampled rows: the same draft-model calls V1 makes)."""
    return model_runner.speculator if runner_of(model_runner) == "v2" else model_runner.drafter


class Recorder:
    def __init__(self, runner, eager: bool):
        self.runner, self.eager = runner, eager
        self.target = runner.model
        self.drafter_owner = drafter_owner(runner)
        self.drafter = self.drafter_owner.model
        if hasattr(self.drafter, "unwrap"):  # BreakableCUDAGraphWrapper (GPU graphs)
            self.drafter = self.drafter.unwrap()
        self.moe_layers: list[int] = []  # the target's MoE layers whose router is hooked (_hook_routers)
        self.reset(False)

    def reset(self, armed: bool, golden: torch.Tensor | None = None) -> None:
        self.armed = armed
        # layerwise golden inputs: the reference's draft.fc_in replaces the first rows of what
        # propose() hands combine_hidden_states (the prompt's n positions), in the draft's dtype
        self.golden = golden
        self.phase = "target"  # target -> draft -> done
        self.internal = False  # our own recomputation: not recorded
        self.t: dict = {"layers": {}, "routers": {}}
        self.steps: list[dict] = []
        self.combine: dict = {}
        self.logits_dv: list[torch.Tensor] = []
        self.logits_tv: list[torch.Tensor] = []
        self.draft_tokens = None
        self.errors: list[str] = []

    # -- target ------------------------------------------------------------------------
    def target_pre(self, module, args, kwargs):
        if self.armed and self.phase == "target":
            self.phase = "target-running"
            ids = kwargs.get("input_ids", args[0] if args else None)
            pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
            self.t["input_ids"] = None if ids is None else _clone(ids)
            self.t["positions"] = None if pos is None else _clone(pos)

    def target_post(self, module, args, kwargs, out):
        if self.armed and self.phase == "target-running":
            if isinstance(out, tuple):
                hidden, aux = out
                self.t["aux"] = [_clone(a) for a in aux]
            else:
                hidden = out
                self.t["aux"] = []
            self.t["final_norm"] = _clone(hidden)
            self.phase = "draft"

    def embed_post(self, module, args, out):
        if self.armed and self.phase == "target-running":
            self.t["layers"][0] = _clone(out)

    def layer_post(self, index: int):
        def hook(module, args, out):
            if self.armed and self.phase == "target-running":
                hidden, residual = out
                self.t["layers"][index + 1] = _clone(hidden + residual if residual is not None else hidden)

        return hook

    def router_capture(self, layer: int, chained):
        """The capture_fn of MoE layer `layer`'s router: keeps the expert ids it chose for the
        prompt's prefill (the first call while the target runs armed), then calls what was set
        before (vLLM's own routed-experts capturer, when enabled)."""

        def capture(topk_ids: torch.Tensor) -> None:
            if self.armed and self.phase == "target-running" and layer not in self.t["routers"]:
                self.t["routers"][layer] = _clone(topk_ids)
            if chained is not None:
                chained(topk_ids)

        return capture

    # -- draft -------------------------------------------------------------------------
    def drafting(self) -> bool:
        return self.armed and self.phase == "drafting" and not self.internal

    def wrap_propose(self, orig):
        def propose(*args, **kwargs):
            start = self.armed and self.phase == "draft"
            if start:
                self.phase = "drafting"
            try:
                out = orig(*args, **kwargs)
            finally:
                if start:
                    self.phase = "done"
            if start:
                self.draft_tokens = _clone(out)
            return out

        return propose

    def wrap_combine(self, orig):
        def combine(hidden_states):
            if self.drafting() and not self.combine and self.golden is not None:
                g = self.golden
                if (
                    hidden_states.dim() != 2
                    or hidden_states.shape[0] < g.shape[0]
                    or hidden_states.shape[1] != g.shape[1]
                ):
                    self.errors.append(
                        f"golden fc_in {tuple(g.shape)} does not fit the draft's fc input {tuple(hidden_states.shape)}"
                    )
                else:
                    hidden_states = hidden_states.clone()
                    hidden_states[: g.shape[0]] = g.to(hidden_states.device, hidden_states.dtype)
            out = orig(hidden_states)
            if self.drafting() and not self.combine:
                self.combine = {"fc_in": _clone(hidden_states), "fc_out": _clone(out)}
            return out

        return combine

    def wrap_compute_logits(self, orig):
        def compute_logits(hidden_states):
            out = orig(hidden_states)
            # None on ranks > 0 where LogitsProcessor gathers to rank 0 only (no all-gather)
            if self.drafting() and out is not None:
                self.logits_tv.append(_clone(out))
            return out

        return compute_logits

    def draft_logits_post(self, module, args, out):
        if self.drafting() and out is not None:
            self.logits_dv.append(_clone(out))

    def draft_pre(self, module, args, kwargs):
        if self.drafting():
            names = ("input_ids", "positions", "hidden_states", "inputs_embeds")
            step = {n: kwargs.get(n, args[i] if i < len(args) else None) for i, n in enumerate(names)}
            self.steps.append({n: _clone(v) for n, v in step.items() if isinstance(v, torch.Tensor)})

    def draft_post(self, module, args, kwargs, out):
        if self.drafting() and self.steps:
            last, aux_out = out if isinstance(out, tuple) else (out, out)
            self.steps[-1]["last_hidden"] = _clone(last)
            self.steps[-1]["aux_out"] = _clone(aux_out)

    def attn_pre(self, module, args, kwargs):
        if self.drafting() and self.steps:
            x = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
            if x is not None:
                self.steps[-1]["attn_in"] = _clone(x)

    def attn_post(self, module, args, kwargs, out):
        if self.drafting() and self.steps:
            self.steps[-1]["attn_out"] = _clone(out)

    def mlp_post(self, module, args, out):
        if self.drafting() and self.steps:
            self.steps[-1]["mlp_out"] = _clone(out)


def install(worker, eager: bool) -> dict:
    """Install the hooks once; returns what the adapter needs to know about the wiring."""
    runner = worker.model_runner
    rec = getattr(worker, _ATTR, None)
    if rec is None:
        rec = Recorder(runner, eager)
        setattr(worker, _ATTR, rec)
        target = rec.target
        target.register_forward_pre_hook(rec.target_pre, with_kwargs=True)
        target.register_forward_hook(rec.target_post, with_kwargs=True)
        if eager:
            inner = target.model
            inner.embed_tokens.register_forward_hook(rec.embed_post)
            for i, layer in enumerate(inner.layers):
                layer.register_forward_hook(rec.layer_post(i))
        rec.moe_layers = _hook_routers(target, rec)
        owner, drafter = rec.drafter_owner, rec.drafter
        owner.propose = rec.wrap_propose(owner.propose)
        drafter.combine_hidden_states = rec.wrap_combine(drafter.combine_hidden_states)
        drafter.compute_logits = rec.wrap_compute_logits(drafter.compute_logits)
        drafter.logits_processor.register_forward_hook(rec.draft_logits_post)
        drafter.register_forward_pre_hook(rec.draft_pre, with_kwargs=True)
        drafter.register_forward_hook(rec.draft_post, with_kwargs=True)
        if eager:
            layer0 = drafter.model.layers[0]
            layer0.self_attn.register_forward_pre_hook(rec.attn_pre, with_kwargs=True)
            layer0.self_attn.register_forward_hook(rec.attn_post, with_kwargs=True)
            layer0.mlp.register_forward_hook(rec.mlp_post)
    inner = rec.target.model
    dm = rec.drafter.model
    return {
        "aux_layers": [int(i) for i in getattr(inner, "aux_hidden_state_layers", ())],
        "num_layers": len(inner.layers),
        "target_hidden_size": int(rec.target.config.hidden_size),
        "target_class": type(rec.target).__name__,
        "draft_class": type(rec.drafter).__name__,
        "norm_before_fc": bool(getattr(dm, "norm_before_fc", False)),
        "fc_norm": getattr(dm, "fc_norm", None) is not None,
        "norm_output": bool(getattr(dm, "norm_output", False)),
        # attributes of llama_eagle3.py::LlamaModel from vllm 0.22.0; before it fc is always 3 chunks wide
        "num_aux_hidden_states": int(getattr(dm, "num_aux_hidden_states", 0) or (3 if hasattr(dm, "fc") else 0)),
        "fc_input_size": int(getattr(dm, "fc_input_size", 0) or getattr(getattr(dm, "fc", None), "input_size", 0) or 0),
        "draft_vocab_size": int(rec.drafter.config.draft_vocab_size),
        "has_d2t": getattr(rec.drafter, "draft_id_to_target_id", None) is not None,
        "eager": eager,
        "runner": runner_of(runner),
        "moe_layers": list(rec.moe_layers),
    }


def _hook_routers(target, rec: Recorder) -> list[int]:
    """Set the recorder's capture_fn on every MoE router of the target (module docstring: MoE
    routing); the decoder layer index comes from the runner's layer_id (extract_layer_index of its
    layer_name, "model.layers.3.mlp.experts" -> 3), the reference's layer k of aux.router.{k}."""
    layers = []
    for name, module in target.named_modules():
        router = getattr(module, "router", None)
        if router is None or not callable(getattr(router, "set_capture_fn", None)):
            continue
        try:
            layer = int(module.layer_id)
        except (AttributeError, TypeError, ValueError):  # not a runner with a layer name: read the module's
            if ".layers." not in name:
                continue
            layer = int(name.split(".layers.", 1)[1].split(".", 1)[0])
        router.set_capture_fn(rec.router_capture(layer, getattr(router, "capture_fn", None)))
        layers.append(layer)
    return sorted(layers)


def rank_of(worker) -> dict:
    """This worker's place in the tensor-parallel group (v1/worker/worker_base.py::WorkerBase.rank)."""
    import os

    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return {
        "rank": int(get_tensor_model_parallel_rank()),
        "world_size": int(get_tensor_model_parallel_world_size()),
        "pid": os.getpid(),
        "worker_rank": int(getattr(worker, "rank", 0)),
    }


def _local_logits(model, hidden: torch.Tensor) -> dict | None:
    """This rank's slice of the vocabulary: `LogitsProcessor.forward(..., skip_gather=True)`
    (model_executor/layers/logits_processor.py::LogitsProcessor._get_logits before _gather_logits),
    and which vocabulary rows it holds (layers/vocab_parallel_embedding.py::
    VocabParallelEmbeddingShardIndices: org_vocab_start_index .. org_vocab_end_index; the padded
    rows after them are dropped). None at TP = 1, where the whole tensor is already there."""
    head = getattr(model, "lm_head", None)
    if head is None or int(getattr(head, "tp_size", 1)) <= 1:
        return None
    idx = head.shard_indices
    local = model.logits_processor(head, hidden, skip_gather=True)
    return {
        "tensor": local[..., : idx.num_org_elements].detach().to("cpu"),
        "start": int(idx.org_vocab_start_index),
        "end": int(idx.org_vocab_end_index),
        "vocab": int(model.logits_processor.org_vocab_size),
    }


def arm(worker, golden: torch.Tensor | None = None) -> None:
    getattr(worker, _ATTR).reset(True, golden)


def disarm(worker) -> None:
    getattr(worker, _ATTR).armed = False


@torch.no_grad()
def fetch(worker, n: int) -> dict:
    """What the first prefill + draft chain recorded, as CPU tensors; rows cut to the n prompt tokens.

    Step 0 of the draft runs over all n rows but vLLM computes logits only for the sampled
    (last) row; the other rows' logits are computed here with vLLM's own modules
    (compute_logits / logits_processor + lm_head) on vLLM's own draft hidden states, and the
    last row is checked against what vLLM computed itself.
    """
    rec: Recorder = getattr(worker, _ATTR)
    rec.armed = False
    cpu = lambda t: t.detach().to("cpu")  # noqa: E731
    out: dict = {
        "phase": rec.phase,
        "steps": [],
        "target": {},
        "draft_tokens": None,
        "checks": {},
        "errors": list(rec.errors),
    }
    if rec.phase != "done":
        return out
    t = rec.t
    out["target"]["positions"] = cpu(t["positions"][:n]) if t.get("positions") is not None else None
    out["target"]["input_ids"] = cpu(t["input_ids"][:n]) if t.get("input_ids") is not None else None
    out["target"]["num_rows"] = int(t["final_norm"].shape[0])
    out["target"]["aux"] = [cpu(a[:n]) for a in t["aux"]]
    out["target"]["layers"] = {k: cpu(v[:n]) for k, v in t["layers"].items()}
    out["target"]["routers"] = {k: cpu(v[:n]) for k, v in t["routers"].items()}
    final = t["final_norm"][:n]
    out["target"]["final_norm"] = cpu(final)
    rec.internal = True
    try:
        logits = rec.target.compute_logits(final)
        out["target"]["logits"] = None if logits is None else cpu(logits)
        out["target"]["local_logits"] = _local_logits(rec.target, final)
        steps = []
        for s, st in enumerate(rec.steps):
            rows = n if s == 0 else 1
            d = {k: cpu(v[:rows]) for k, v in st.items()}
            d["num_rows"] = int(st["input_ids"].shape[0]) if "input_ids" in st else -1
            last = st["last_hidden"][:rows]
            ids = st["input_ids"][:rows]
            d["embeds"] = cpu(rec.drafter.embed_input_ids(ids))
            dv = rec.drafter.logits_processor(rec.drafter.lm_head, last)
            tv = rec.drafter.compute_logits(last)
            d["logits"] = None if dv is None else cpu(dv)
            d["logits_target"] = None if tv is None else cpu(tv)
            d["local_logits"] = _local_logits(rec.drafter, last)
            steps.append(d)
        out["steps"] = steps
    finally:
        rec.internal = False
    if rec.combine:
        out["fc_in"] = cpu(rec.combine["fc_in"][:n])
        out["fc_out"] = cpu(rec.combine["fc_out"][:n])
    out["draft_tokens"] = cpu(rec.draft_tokens) if rec.draft_tokens is not None else None
    # vLLM's own logits for the sampled rows vs ours recomputed from the same hidden states.
    if rec.logits_tv and out["steps"] and out["steps"][0]["logits_target"] is not None:
        own = rec.logits_tv[0][-1].float().cpu()
        mine = out["steps"][0]["logits_target"][-1].float()
        fin = torch.isfinite(own)
        same_support = torch.equal(fin, torch.isfinite(mine))
        out["checks"]["step0_last_row_logits_max_abs"] = (
            float((own[fin] - mine[fin]).abs().max()) if same_support and bool(fin.any()) else float("inf")
        )
    out["checks"]["num_compute_logits_calls"] = len(rec.logits_tv)
    return out
