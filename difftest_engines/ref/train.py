"""Train an EAGLE-3 draft on CPU against a target, and save it in both checkpoint formats.

Training-time test (TTT), as speculators / SpecForge do it. For a sequence t_0..t_{n-1}
with target features f_i = cat(wiring tensors at i) and target greedy labels
y_i = argmax(target logits at i) (the target's own prediction of token i+1):

    step 0:  hidden_i = fc(f_i), token t_{i+1}, rope position i,   label y_{i+1}
    step k:  hidden_i = hidden_next of step k-1 at i, token t_{i+k+1},
             rope position i+k,                                     label y_{i+k+1}

A query of step k at chain origin i attends to the step-0 keys at positions <= i and to
the keys of steps 1..k at the same origin i: exactly what the drafted position i+k sees
at inference (the committed prefix through the draft's KV cache, then its own chain).
This is passed to the draft's Attention as one KV cache holding the keys of all steps
and an explicit boolean mask (`ttt_mask`). Loss = sum_k w^k * CE(step k), either against
the target's distribution restricted to the draft vocab (soft labels, as SpecForge; the
default, `temperature=1.0`) or against the greedy label y (`temperature=None`; labels
outside the draft vocab are ignored). Soft labels learn the same argmax several times
faster on CPU.

Vocabulary: the draft vocab is the `draft_vocab_size` most frequent target-greedy tokens
of the training data (`build_vocab_map`), sorted by target id; draft id d means target id
d + d2t[d]. Embedding: the draft keeps its own frozen copy of the target's input
embedding and saves it (`embed_tokens.weight`), so the checkpoint loads without the
target; `save_*_format(..., include_embed=False)` leaves it out for engines that share.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from difftest_engines.ref.eagle3 import Eagle3Config, Eagle3Draft, KVCache
from difftest_engines.ref.draft_loading import build_draft
from difftest_engines.ref.speculate import gather_fc_in
from difftest_engines.ref.target import run_target

IGNORE = -100


@dataclass
class TrainData:
    tokens: torch.Tensor  # [N, n] target ids
    fc_in: torch.Tensor  # [N, n, A*H] target features in wiring order
    labels: torch.Tensor  # [N, n] target greedy prediction at each position (target ids)
    final_norm: torch.Tensor  # [N, n, H] target final-norm output: logits = final_norm @ lm_head.T


@torch.no_grad()
def prepare_data(target_model, inputs: Sequence[str], tokens: torch.Tensor, batch_size: int = 64) -> TrainData:
    """Run the target over token sequences [N, n]; keep the wiring's features, greedy labels, final norm."""
    feats, labels, norms = [], [], []
    for b in range(0, tokens.shape[0], batch_size):
        out = run_target(target_model, tokens[b : b + batch_size])
        feats.append(gather_fc_in(out, inputs).float())
        labels.append(out.logits.argmax(dim=-1))
        norms.append(out.final_norm.float())
    return TrainData(tokens, torch.cat(feats), torch.cat(labels), torch.cat(norms))


def build_vocab_map(labels: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [draft_vocab] int64, t2d [vocab] bool): the most frequent label ids, ascending by target id.

    Ties (and unused slots when fewer distinct labels exist) go to the lower target id.
    """
    counts = torch.bincount(labels.flatten(), minlength=vocab_size).double()
    # Stable order: count descending, then id ascending.
    key = counts * (vocab_size + 1) - torch.arange(vocab_size, dtype=torch.double)
    chosen = key.argsort(descending=True)[:draft_vocab_size].sort().values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.long(), t2d


def ttt_mask(n: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """[n, n*(step+1)] bool: step-0 keys causal (j <= i), steps 1..step only the same origin i."""
    idx = torch.arange(n, device=device)
    blocks = [idx[None, :] <= idx[:, None]] + [torch.eye(n, dtype=torch.bool, device=device)] * step
    return torch.cat(blocks, dim=1)


def _shift(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """x[:, i + k] at column i, `fill` past the end. x: [B, n]."""
    if k == 0:
        return x
    return torch.cat([x[:, k:], x.new_full((x.shape[0], k), fill)], dim=1)


def ttt_forward(
    draft: Eagle3Draft,
    fc_in: torch.Tensor,  # [B, n, A*H]
    tokens: torch.Tensor,  # [B, n] target ids
    ttt_steps: int,
) -> list[torch.Tensor]:
    """Run the TTT unroll; returns the draft logits [B, n, Vd] of each step.

    Step k's logits at origin i predict the target's label at position i+k+1; origins with
    i+k+1 >= n are padding (fed token id 0) and must be left out of the loss.
    """
    B, n = tokens.shape
    hidden = draft.combine(fc_in)  # [B, n, H]
    cache: KVCache | None = None
    results = []
    for k in range(ttt_steps):
        ids = _shift(tokens, k + 1, 0)  # token t_{i+k+1}
        positions = (torch.arange(n, device=tokens.device) + k)[None, :].expand(B, n)
        out = draft(ids, hidden, positions, cache=cache, mask=ttt_mask(n, k, tokens.device))
        cache = out.cache
        hidden = out.hidden_next
        results.append(out.logits)
    return results


def init_draft(target_model, cfg: Eagle3Config, d2t: torch.Tensor, seed: int) -> Eagle3Draft:
    """A fresh draft: seeded default init, frozen copy of the target embedding, lm_head from the target's rows."""
    torch.manual_seed(seed)
    draft = build_draft(cfg)  # Llama or MLA attention, as the config says
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight.float())
        # lm_head rows from the target's rows of the draft vocab, rescaled to mean row norm 1 so the
        # initial logits have unit scale whatever the target's logit scale (the final norm's weight
        # learns the temperature).
        target_ids = torch.arange(cfg.draft_vocab_size) + d2t
        rows = target_model.get_output_embeddings().weight.float()[target_ids]
        draft.lm_head.weight.copy_(rows / rows.norm(dim=-1).mean().clamp_min(1e-12))
    draft.embed_tokens.weight.requires_grad_(False)
    return draft


def train_draft(
    target_model,
    cfg: Eagle3Config,
    inputs: Sequence[str],
    data: torch.Tensor | TrainData,
    steps: int,
    seed: int = 0,
    *,
    batch_size: int = 32,
    lr: float = 3e-3,
    ttt_steps: int = 4,
    step_weight: float = 0.8,
    temperature: float | None = 1.0,
    warmup: int = 50,
    log: Callable[[str], None] | None = None,
    log_every: int = 100,
) -> Eagle3Draft:
    """Train a draft whose fc reads the target tensors `inputs` (canonical names, fc order).

    data: token sequences [N, n] (the target is run over them) or a prepared TrainData.
    The draft vocab map is built from the data's greedy labels. Loss per TTT step k (weight
    step_weight**k): cross-entropy against the target's distribution over the draft vocab
    at temperature `temperature` (soft labels, as SpecForge), or against the target's greedy
    token when temperature is None (labels outside the draft vocab ignored). Deterministic
    for a given seed and thread count. Returns the draft in eval mode.
    """
    if not isinstance(data, TrainData):
        data = prepare_data(target_model, inputs, data)
    if data.fc_in.shape[-1] != cfg.num_aux * cfg.target_hidden_size:
        raise ValueError(
            f"fc input width {data.fc_in.shape[-1]} != num_aux({cfg.num_aux}) x target_hidden_size({cfg.target_hidden_size})"
        )
    d2t, _ = build_vocab_map(data.labels, cfg.vocab_size, cfg.draft_vocab_size)
    target_ids = torch.arange(cfg.draft_vocab_size) + d2t
    # target id -> draft id, IGNORE where the token is outside the draft vocab
    t2d_index = torch.full((cfg.vocab_size,), IGNORE, dtype=torch.long)
    t2d_index[target_ids] = torch.arange(cfg.draft_vocab_size)
    draft_labels = t2d_index[data.labels]  # [N, n]
    head = target_model.get_output_embeddings().weight.detach().float()[target_ids]  # [Vd, H_target]

    draft = init_draft(target_model, cfg, d2t, seed)
    draft.train()
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    gen = torch.Generator().manual_seed(seed)
    N, n = data.tokens.shape
    t0 = time.time()
    order, cursor = torch.randperm(N, generator=gen), 0
    for step in range(steps):
        if cursor + batch_size > N:
            order, cursor = torch.randperm(N, generator=gen), 0
        idx = order[cursor : cursor + batch_size]
        cursor += batch_size
        all_logits = ttt_forward(draft, data.fc_in[idx], data.tokens[idx], ttt_steps)
        loss = torch.zeros(())
        accs = []
        for k, logits in enumerate(all_logits):
            m = n - k - 1  # origins 0..m-1 have a label at position i+k+1 <= n-1
            pred = logits[:, :m].flatten(0, 1)  # [B*m, Vd]
            labels = draft_labels[idx, k + 1 :].flatten()  # [B*m]
            if temperature is None:
                step_loss = F.cross_entropy(pred, labels, ignore_index=IGNORE)
            else:
                with torch.no_grad():
                    target_logits = data.final_norm[idx, k + 1 :].flatten(0, 1) @ head.T  # [B*m, Vd]
                    soft = torch.softmax(target_logits / temperature, dim=-1)
                step_loss = -(soft * torch.log_softmax(pred, dim=-1)).sum(-1).mean()
            loss = loss + step_weight**k * step_loss
            valid = labels != IGNORE
            accs.append((pred.argmax(-1)[valid] == labels[valid]).float().mean().item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if log and (step % log_every == 0 or step == steps - 1):
            log(
                f"  step {step:5d} loss {loss.item():.3f} acc/ttt-step "
                + " ".join(f"{a:.2f}" for a in accs)
                + f"  {time.time() - t0:.0f}s"
            )
    draft.eval()
    return draft


@torch.no_grad()
def step0_agreement(draft: Eagle3Draft, data: TrainData) -> float:
    """Top-1 agreement at step 0: draft argmax (mapped to target ids) vs the target's greedy token.

    Position i of the draft predicts the target's label at i+1; every position with a label counts
    (labels outside the draft vocab count as misses).
    """
    hits = total = 0
    for b in range(0, data.tokens.shape[0], 64):
        tokens, fc_in, labels = data.tokens[b : b + 64], data.fc_in[b : b + 64], data.labels[b : b + 64]
        B, n = tokens.shape
        positions = torch.arange(n)[None, :].expand(B, n)
        out = draft(tokens[:, 1:], draft.combine(fc_in[:, :-1]), positions[:, :-1])
        pred = draft.to_target_ids(out.logits.argmax(-1))  # [B, n-1]
        hits += int((pred == labels[:, 1:]).sum())
        total += pred.numel()
    return hits / total


# ---------------------------------------------------------------------------------------
# Saving: the HF/EAGLE format (LlamaForCausalLMEagle3) and the speculators format.
# ---------------------------------------------------------------------------------------


def _layer_config(cfg: Eagle3Config, max_position_embeddings: int) -> dict:
    """The Llama config of the draft's one decoder layer (vocab_size = the target's)."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _weights(draft: Eagle3Draft, layer_prefix: str, include_embed: bool) -> dict[str, torch.Tensor]:
    cfg = draft.cfg
    out: dict[str, torch.Tensor] = {}
    for key, value in draft.state_dict().items():
        if key == "embed_tokens.weight" and not include_embed:
            continue
        if key.startswith("layer."):
            key = layer_prefix + key[len("layer.") :]
        out[key] = value.detach().float().contiguous() if value.is_floating_point() else value.contiguous()
    out["d2t"] = draft.d2t.long().contiguous()
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(cfg.draft_vocab_size) + draft.d2t] = True
    out["t2d"] = t2d
    return out


def _norm_flags(cfg: Eagle3Config) -> dict:
    return {
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
    }


def _write(out_dir: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def save_eagle_format(
    draft: Eagle3Draft,
    out_dir: str | Path,
    layer_ids: list[int],
    *,
    include_embed: bool = True,
    max_position_embeddings: int = 2048,
) -> Path:
    """config.json (LlamaForCausalLMEagle3; layer ids top-level and in eagle_config) + model.safetensors (midlayer.*)."""
    cfg = draft.cfg
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layer_config(cfg, max_position_embeddings),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        **_norm_flags(cfg),
        "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
    }
    out_dir = Path(out_dir)
    _write(out_dir, config, _weights(draft, "midlayer.", include_embed))
    return out_dir


def save_speculators_format(
    draft: Eagle3Draft,
    out_dir: str | Path,
    layer_ids: list[int],
    *,
    verifier_name_or_path: str = "tiny-llama",
    verifier_architectures: Sequence[str] = ("LlamaForCausalLM",),
    speculative_tokens: int = 4,
    include_embed: bool = True,
    max_position_embeddings: int = 2048,
) -> Path:
    """config.json (speculators_model_type eagle3, transformer_layer_config) + model.safetensors (layers.0.*)."""
    cfg = draft.cfg
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "transformer_layer_config": _layer_config(cfg, max_position_embeddings),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        **_norm_flags(cfg),  # explicit: the speculators default for norm_before_residual is True
        "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures)},
        },
    }
    out_dir = Path(out_dir)
    _write(out_dir, config, _weights(draft, "layers.0.", include_embed))
    return out_dir
