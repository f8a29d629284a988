"""Forward-hook factories for SGLang's `forward_hooks` server argument.

They run inside SGLang's scheduler process, on the target's and the draft's modules
alike (SGLang registers every spec on both models), and save what they see as numbered
files in config["out_dir"]/rank<r>: `{seq:06d}_{kind}.pt`, each a dict of CPU tensors and plain
values. The adapter (difftest_engines/sglang/capture.py) groups and names them afterwards.

Module calls happen in a fixed order in one model forward: sub-modules (embed_tokens,
fc, layers.0.*), then `model` (the decoder stack), then `logits_processor`, then the root
module. So a `model` record closes the group of sub-module records before it, and
`logits`/`root` records belong to the `model` record just before them.

Hook specs (see `hook_specs`):
  model            target LlamaModel: final-norm output, aux hidden states + layers_to_capture;
                   draft LlamaModel: the fc input as SGLang holds it (spec_info.hidden_states,
                   before input_norm/fc_norm), its input ids and positions, normed and
                   pre-norm outputs
  fc               draft `model.fc`: input (after any norm) and output
  embed            `model.embed_tokens` output
  layer0           `model.layers.0.self_attn.qkv_proj` input (attn_in), `...self_attn` and
                   `...mlp` outputs; for the MLA draft (kimi_k25_eagle3.py) `model.midlayer.self_attn`
                   and `.mlp` outputs and `...self_attn.fused_qkv_a_proj_with_mqa` input (attn_in)
  logits           `logits_processor`: the hidden states it was given, every row's logits
                   (the same lm_head product SGLang computes for the rows it keeps) and
                   SGLang's own next_token_logits
  root             the root module: the draft's hot_token_id (its d2t map)
  router           each MoE layer's `model.layers.<k>.mlp.topk` (target only: SGLang 0.5.23
                   models/deepseek_v2.py::DeepseekV2MoE builds it as `self.topk`, a
                   layers/moe/topk.py::TopK; DeepseekV2MoE.forward_normal / forward_cpu call it as
                   `self.topk(hidden_states, router_logits)`): the layer id and the routed expert ids
                   of its StandardTopKOutput (TopK.forward_cpu -> topk.py::select_experts: grouped
                   top-k over sigmoid scores + correction bias, then _post_process_topk_ids, whose
                   logical -> physical map is the identity without EPLB), one row per token, the
                   shared-expert slots TopKConfig.num_shared_topk_slots appends cut off
  golden           target `model` again: replaces the aux states by a golden fc input when one is
                   waiting (layerwise golden inputs)
"""

from __future__ import annotations

import functools
import itertools
import os

import torch

_counter = itertools.count()


def _cpu(t):
    return t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t


def tp_rank() -> tuple[int, int]:
    """(this scheduler's tensor-parallel rank, tp size): SGLang's own tp group (0.5.23
    srt/distributed/parallel_state.py::get_tensor_model_parallel_rank); (0, 1) without one."""
    from sglang.srt.distributed import parallel_state

    try:
        group = parallel_state.get_tp_group()
    except Exception as e:
        import sys

        print(f"[difftest hooks] no SGLang tp group ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return 0, 1
    return int(group.rank_in_group), int(group.world_size)


def recording(config: dict) -> bool:
    """Whether the adapter is capturing: it makes config["out_dir"] for a capture's generation and
    removes it after. Every other forward (the speculative runs: hundreds of them) records nothing,
    not even the logits product, and changes nothing: the hooks only observe."""
    return os.path.isdir(config["out_dir"])


def _while_recording(factory):
    """A recording hook's factory whose hook does nothing, reads nothing, outside a capture."""

    @functools.wraps(factory)
    def make(config: dict):
        hook = factory(config)

        def gated(module, inputs, output):
            return hook(module, inputs, output) if recording(config) else None

        return gated

    return make


def _save(config: dict, kind: str, record: dict) -> None:
    # one folder per rank: every rank's hooks fire, and difftest_engines/sglang/tensor_parallel.py joins them
    rank, size = tp_rank()
    out_dir = os.path.join(config["out_dir"], f"rank{rank}")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{next(_counter):06d}_{kind}.pt")
    record = {**record, "tp_rank": rank, "tp_size": size}
    torch.save({k: _cpu(v) for k, v in record.items()}, path + ".tmp")
    os.replace(path + ".tmp", path)


def _mode(forward_batch) -> str:
    mode = getattr(forward_batch, "forward_mode", None)
    return getattr(mode, "name", str(mode))


@_while_recording
def model_hook(config: dict):
    def hook(module, inputs, output):
        input_ids, positions, forward_batch = inputs[0], inputs[1], inputs[2]
        rec = {"mode": _mode(forward_batch), "input_ids": input_ids, "positions": positions}
        if hasattr(module, "fc"):  # the EAGLE-3 draft's decoder stack
            spec_hidden = getattr(getattr(forward_batch, "spec_info", None), "hidden_states", None)
            # nn.Linear in llama_eagle3.py; ColumnParallelLinear (input_size) in kimi_k25_eagle3.py (the MLA draft)
            fc_width = getattr(module.fc, "in_features", None) or module.fc.input_size
            rec.update(role="draft", fc_applied=spec_hidden is not None and spec_hidden.shape[-1] == fc_width)
            if rec["fc_applied"]:
                rec["fc_in"] = spec_hidden
            normed, aux = output
            rec["normed"] = normed
            rec["aux_out"] = aux[0] if isinstance(aux, (list, tuple)) else aux
            rec["norm_output"] = bool(getattr(module, "norm_output", False))
        else:
            rec["role"] = "target"
            if isinstance(output, tuple):
                normed, aux = output
                if isinstance(aux, torch.Tensor):  # packed [tokens, K * H]
                    aux = list(aux.split(normed.shape[-1], dim=-1))
                rec["aux"] = list(aux)
            else:
                normed = output
            rec["final_norm"] = normed
            rec["layers_to_capture"] = [int(i) for i in getattr(module, "layers_to_capture", [])]
            rec["num_layers"] = len(getattr(module, "layers", []))
        _save(config, "model", rec)

    return hook


@_while_recording
def fc_hook(config: dict):
    def hook(module, inputs, output):
        out = output[0] if isinstance(output, tuple) else output  # SGLang's parallel linears return (out, bias)
        # the module's class decides fc_out's sharding (difftest_engines/sglang/tensor_parallel.py RULES)
        _save(config, "fc", {"fc_in_normed": inputs[0], "fc_out": out, "module": type(module).__name__})

    return hook


@_while_recording
def embed_hook(config: dict):
    def hook(module, inputs, output):
        _save(config, "embed", {"embeds": output})

    return hook


@_while_recording
def layer0_hook(config: dict):
    """On qkv_proj (its input is attn_in), self_attn and mlp; tells them apart by output shape."""

    def hook(module, inputs, output):
        name = type(module).__name__
        if "QKV" in name:
            _save(config, "attn_in", {"t": inputs[0]})
        elif "MLP" in name:
            _save(config, "mlp_out", {"t": output, "reduced": _reduced(module, "down_proj")})
        else:
            out = output[0] if isinstance(output, tuple) else output
            _save(config, "attn_out", {"t": out, "reduced": _reduced(module, "o_proj")})

    return hook


def _reduced(module, proj: str) -> bool | None:
    """Whether the module's output is whole on every rank: its row-parallel output projection's own
    reduce_results (SGLang 0.5.23 layers/linear.py::RowParallelLinear.forward all-reduces only then;
    llama.py::LlamaDecoderLayer builds the target's with reduce_results=False and all-reduces at its
    stage boundary, the EAGLE-3 draft's layer with True). None: no such attribute."""
    value = getattr(getattr(module, proj, None), "reduce_results", getattr(module, "reduce_results", None))
    return None if value is None else bool(value)


@_while_recording
def attn_in_hook(config: dict):
    """On the MLA draft's fused q/kv down-projection: its input is attn_in (the attention itself is
    called with keyword arguments only, which forward hooks do not see)."""

    def hook(module, inputs, output):
        _save(config, "attn_in", {"t": inputs[0]})

    return hook


@_while_recording
def logits_hook(config: dict):
    def hook(module, inputs, output):
        hidden, lm_head = inputs[1], inputs[2]
        rec = {"mode": _mode(inputs[3]), "hidden": hidden, "vocab_size": int(module.config.vocab_size)}
        weight = getattr(lm_head, "weight", None)
        if weight is not None:
            full = torch.matmul(hidden.to(weight.dtype), weight.T)
            scale = getattr(module, "logit_scale", None)
            if scale is not None:
                full = full * scale
            # this rank's rows of a vocabulary-parallel head: cut to vocab_size once the ranks' slices
            # are joined (difftest_engines/sglang/tensor_parallel.py)
            rec["all_logits"] = full
        rec["next_token_logits"] = getattr(output, "next_token_logits", None)
        _save(config, "logits", rec)

    return hook


@_while_recording
def root_hook(config: dict):
    def hook(module, inputs, output):
        hot = getattr(module, "hot_token_id", None)
        _save(config, "root", {"cls": type(module).__name__, "hot_token_id": hot})

    return hook


@_while_recording
def router_hook(config: dict):
    """On an MoE layer's TopK: the expert ids it chose (module docstring: router). An output with no
    topk_ids (a BYPASSED format: routing left to the experts kernel, GPU backends only) records
    nothing, and the report says that layer's expert ids were not captured."""

    def hook(module, inputs, output):
        ids = getattr(output, "topk_ids", None)
        if not isinstance(ids, torch.Tensor):
            return
        cfg = getattr(module, "topk_config", None)
        routed = int(cfg.top_k) - int(getattr(cfg, "num_shared_topk_slots", 0) or 0) if cfg is not None else None
        _save(config, "router", {"layer": int(module.layer_id), "topk_ids": ids[:, :routed]})

    return hook


def golden_hook(config: dict):
    """Target `model`: layerwise golden inputs. When the adapter has written the reference's
    draft.fc_in to golden_path (one per rank) (difftest_engines/sglang/engine.py::SglangEngine.capture_draft_from), the
    next target forward's aux hidden states (what SGLang concatenates into the draft's fc input,
    spec_info.hidden_states) get those values in their first rows; the file is consumed, so only
    that forward (the prompt's prefill) changes. Registered after `model`, which has recorded
    the target's own values by then."""

    def hook(module, inputs, output):
        path = golden_path(config["out_dir"], tp_rank()[0])
        if hasattr(module, "fc") or not isinstance(output, tuple) or not os.path.exists(path):
            return None
        golden = torch.load(path, weights_only=True)
        normed, aux = output
        n, width = golden.shape
        if normed.shape[0] < n:  # not the prompt's prefill (a cached prefix, another request): wait for it
            return None
        os.remove(path)
        if isinstance(aux, torch.Tensor):  # packed [tokens, K * H]
            if aux.shape[0] < n or aux.shape[-1] != width:
                raise RuntimeError(
                    f"difftest golden input {tuple(golden.shape)} does not fit the aux states {tuple(aux.shape)}"
                )
            aux = aux.clone()
            aux[:n] = golden.to(aux.device, aux.dtype)
        else:
            chunks = golden.split(normed.shape[-1], dim=-1)
            if len(chunks) != len(aux) or any(a.shape[0] < n for a in aux):
                raise RuntimeError(
                    f"difftest golden input {tuple(golden.shape)} does not fit {len(aux)} aux states "
                    f"{[tuple(a.shape) for a in aux]} ({type(aux).__name__}), normed {tuple(normed.shape)}"
                )
            new = []
            for a, c in zip(aux, chunks):
                a = a.clone()
                a[:n] = c.to(a.device, a.dtype)
                new.append(a)
            aux = type(output[1])(new) if isinstance(output[1], (list, tuple)) else new
        return (normed, aux)

    return hook


def hook_specs(out_dir: str) -> list[dict]:
    cfg = {"out_dir": out_dir}
    spec = lambda name, modules, factory: {  # noqa: E731
        "name": f"difftest-{name}",
        "target_modules": modules,
        "hook_factory": f"difftest_engines.sglang.hooks:{factory}",
        "config": cfg,
    }
    return [
        spec("embed", ["model.embed_tokens"], "embed_hook"),
        spec("fc", ["model.fc"], "fc_hook"),
        spec(
            "layer0",
            ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn", "model.layers.0.mlp"],
            "layer0_hook",
        ),
        # the MLA draft (kimi_k25_eagle3.py: Eagle3MLAModel.midlayer, DeepseekV2AttentionMLA, DeepseekV2MLP)
        spec("layer0-mla", ["model.midlayer.self_attn", "model.midlayer.mlp"], "layer0_hook"),
        spec("attn-in-mla", ["model.midlayer.self_attn.fused_qkv_a_proj_with_mqa"], "attn_in_hook"),
        spec("router", ["model.layers.*.mlp.topk"], "router_hook"),  # fires inside the target's `model`
        spec("model", ["model"], "model_hook"),
        spec("golden", ["model"], "golden_hook"),  # after `model`: it records the target's own values first
        spec("logits", ["logits_processor"], "logits_hook"),
        spec("root", [""], "root_hook"),
    ]


def golden_path(out_dir: str, rank: int = 0) -> str:
    """Where the adapter leaves a golden fc input for golden_hook: beside the records, not among them;
    one copy per tensor-parallel rank (each rank's hook consumes its own)."""
    return out_dir.rstrip("/") + f".golden.rank{rank}.pt"
