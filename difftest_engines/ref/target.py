"""The target model: any transformers causal LM, with its residual stream captured.

Canonical names: `target.h.{k}` is the residual stream *entering* decoder layer k, so
h.0 is the embedding output and h.L the last layer's output **before** the final norm.
HF's `output_hidden_states[L]` is taken after the final norm, so h.L comes from a hook
on the final norm's input instead; `target.final_norm` is that norm's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from difftest.api import refuse_on_errors, stored_tensors, target_findings, tied_head_findings
from difftest.api import ConfigError, EngineUnavailable
from difftest.api import LOAD_ERRORS, explain_load_failure


@dataclass
class TargetOutput:
    hidden: list[torch.Tensor]  # L+1 tensors [B, n, H]: h.0 .. h.L (h.L pre-norm)
    final_norm: torch.Tensor  # [B, n, H]
    logits: torch.Tensor  # [B, n, V]
    # MoE layers only: layer k -> (router selection scores [B*n, E], routing margin [B*n], chosen expert
    # ids [B*n, top-k]); see router_margin
    routers: dict = None


def router_margin(scores: torch.Tensor, chosen: torch.Tensor, num_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """Per row: how far the router's decision is from flipping, in its own score units.

    The smallest gap between a chosen and an unchosen expert's selection score and, for grouped
    routing (DeepSeek-V3 noaux_tc: groups ranked by the sum of their two best scores), between
    a selected and an unselected group's score. A gap within numerical noise means another
    engine may route this token to other experts: a discrete event, not a wiring fault
    (difftest.compare.noise: router ties)."""
    E = scores.shape[-1]
    is_chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
    gaps = (scores[:, :, None] - scores[:, None, :]).abs()  # [n, E, E]
    eligible = torch.ones_like(is_chosen)
    gmargin = None
    if num_group > 1 and topk_group < num_group:
        group = scores.view(-1, num_group, E // num_group).topk(min(2, E // num_group), dim=-1)[0].sum(-1)
        picked = group.topk(topk_group, dim=-1)[1]
        is_picked = torch.zeros_like(group, dtype=torch.bool).scatter_(-1, picked, True)
        ggaps = (group[:, :, None] - group[:, None, :]).abs()
        gpair = is_picked[:, :, None] & ~is_picked[:, None, :]
        gmargin = torch.where(gpair, ggaps, torch.inf).flatten(1).amin(-1)
        # an expert of an unpicked group competes only through its group (the group margin): its own
        # score near a chosen one's decides nothing
        eligible = is_picked.repeat_interleave(E // num_group, dim=-1)
    pair = is_chosen[:, :, None] & (~is_chosen & eligible)[:, None, :]
    margin = torch.where(pair, gaps, torch.inf).flatten(1).amin(-1)
    return margin if gmargin is None else torch.minimum(margin, gmargin)


def _router_hooks(model, seen: dict) -> list:
    """Hooks on DeepSeek-V3-style routers (a module returning (router_logits, weights, indices)) of
    decoder layer k: their selection scores sigmoid(logits) + e_score_correction_bias."""
    handles = []
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("TopkRouter") or ".layers." not in name:
            continue
        k = int(name.split(".layers.", 1)[1].split(".", 1)[0])

        def hook(mod, _args, output, k=k):
            logits, _weights, indices = output
            scores = logits.float().sigmoid() + getattr(mod, "e_score_correction_bias", torch.zeros(())).float()
            seen[k] = (
                scores,
                router_margin(
                    scores, indices, int(getattr(mod, "num_group", 1) or 1), int(getattr(mod, "topk_group", 1) or 1)
                ),
                indices,
            )

        handles.append(module.register_forward_hook(hook))
    return handles


def load_target(path: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise ConfigError(f"{path}: target checkpoint not found (no config.json)")
    config = target_config(path)
    # the reference never runs a tensor left at its initialisation: a checkpoint that does not hold
    # what its config describes is refused here, naming the tensor and the field
    check_fits(path, dtype)  # first: a target this machine cannot hold is refused with the way out
    refuse_on_errors(target_findings(path) + tied_head_findings(path), f"target {path}")
    kwargs = {}
    if dtype == torch.float64 and any(config.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts")):
        # torch._grouped_mm (transformers' default MoE experts kernel) has no float64: the noise-floor
        # run takes the per-expert loop, the same maths
        kwargs["experts_implementation"] = "eager"
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, output_loading_info=True, **kwargs
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RuntimeError, *LOAD_ERRORS) as e:
        # a truncated safetensors file or a refused pickle (named, in the words the draft loader and the
        # lint use), a config transformers cannot build a model from, ...
        # transformers' shape mismatch says "look at the above report", a log the user may never see
        mismatch = _shape_mismatch(path)
        if mismatch is not None:
            raise ConfigError(f"target {path}: {mismatch}") from None
        raise explain_load_failure(path, e, "transformers cannot load this target") from None
    # transformers' own report, for what the header checks cannot see (an MoE layer's experts, a
    # family's own tensors): anything it initialised or dropped is a refusal, not a log line
    for kind, why in (
        ("missing_keys", "missing (transformers would initialise them randomly)"),
        ("mismatched_keys", "shaped differently from the config"),
        ("unexpected_keys", "in the checkpoint but not in the architecture (transformers drops them)"),
    ):
        keys = sorted(map(str, loading.get(kind) or []))
        if keys:
            shown = ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
            raise ConfigError(f"target {path}: tensors {why}: {shown}")
    model.eval()
    return model


def _shape_mismatch(path: Path) -> str | None:
    """The first stored tensor whose shape differs from the one the config's architecture gives it
    (the model built on the meta device: no memory), in one line; None when none differs or the
    architecture cannot be built here."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, local_files_only=True))
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        stored, _ = stored_tensors(path)
    except Exception:  # the caller's own message stands
        return None
    for name, t in sorted(stored.items()):
        want = expected.get(name)
        if want is not None and tuple(t.shape) != want:
            return (
                f"{t.file.name}: {name} has shape {list(t.shape)}, expected {list(want)} "
                f"(from {path.name}/config.json's sizes)"
            )
    return None


def target_config(path: Path) -> dict:
    """config.json of a target checkpoint: a JSON object, not a draft's, with numeric sizes."""
    from difftest.api import read_json

    where = path / "config.json"
    config = read_json(where, "target config")
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(config).__name__}")
    archs = config.get("architectures") or []
    if config.get("speculators_model_type") or any("eagle" in str(a).lower() for a in archs):
        raise ConfigError(
            f"{where}: this is an EAGLE-3 draft's config ({', '.join(map(str, archs)) or 'speculators'}), "
            "not a target model's; give it as the case's draft"
        )
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings"):
        value = text.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{where}: {key}: expected a positive integer, got {value!r}")
    return config


def checkpoint_bytes(path: Path, dtype: torch.dtype) -> int:
    """Bytes the weights take once loaded in dtype (stored tensors are assumed 2-byte, the
    usual bf16/fp16 checkpoint, unless the config says float32)."""
    stored = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern))
    config = target_config(path)
    stored_width = 4 if str(config.get("torch_dtype") or config.get("dtype")) == "float32" else 2
    return stored * torch.finfo(dtype).bits // 8 // stored_width


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(path: Path, dtype: torch.dtype) -> None:
    """The reference holds the whole target in CPU memory: refuse early, with the way out, for a
    target that cannot fit (Kimi-K2.5's ~1 TB) instead of swapping or being OOM-killed mid-run."""
    need, have = checkpoint_bytes(path, dtype), available_memory()
    if have is not None and need > 0.9 * have:
        raise EngineUnavailable(
            f"ref cannot hold target {path}: {need / 2**30:.1f} GiB of weights in {str(dtype).removeprefix('torch.')}, "
            f"{have / 2**30:.1f} GiB of memory available; take the reference from a training-data dump "
            f"(--engines=train,sglang with engines.train.data in the case) or another engine (--reference=sglang)"
        )


def final_norm_module(model) -> torch.nn.Module:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    norm = getattr(base, "norm", None)
    if norm is None:
        raise ConfigError(
            f"{type(model).__name__}: no final norm at model.norm; cannot capture the pre-norm last layer"
        )
    return norm


def num_layers(model) -> int:
    return int(model.config.num_hidden_layers)


@torch.no_grad()
def run_target(
    model, input_ids: torch.Tensor, cache=None, with_routers: bool = True, logits_to_keep: int = 0
) -> TargetOutput:
    """input_ids: [B, n]. `cache`: a transformers KV cache of the positions before input_ids, which this
    forward extends (None: no cache, the whole sequence is input_ids). `with_routers`: record the MoE
    routers (the speculative simulation never reads them). `logits_to_keep`: the output head over the
    last that many positions only (0: every position); the hidden states are the same either way."""
    seen: dict[str, torch.Tensor] = {}

    def hook(_module, args, output):
        seen["prenorm"], seen["postnorm"] = args[0], output

    routers: dict = {}
    handles = [final_norm_module(model).register_forward_hook(hook)]
    if with_routers:
        handles += _router_hooks(model, routers)
    cached = {"past_key_values": cache, "use_cache": True} if cache is not None else {"use_cache": False}
    try:
        out = model(input_ids=input_ids, output_hidden_states=True, logits_to_keep=logits_to_keep, **cached)
    finally:
        for handle in handles:
            handle.remove()
    hs = list(out.hidden_states)
    L = num_layers(model)
    if len(hs) != L + 1:
        raise ConfigError(f"{type(model).__name__}: output_hidden_states has {len(hs)} entries, expected {L + 1}")
    hidden = hs[:L] + [seen["prenorm"]]
    return TargetOutput(hidden=hidden, final_norm=seen["postnorm"], logits=out.logits, routers=routers)
