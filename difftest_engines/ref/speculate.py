"""Greedy chain speculative decoding with the reference draft, step by step.

Two pieces:
  * `run_draft_chain`: one drafting round. Step 0 runs fc over the target's features and
    the draft layer over every committed position (causal); steps 1..k-1 each add one
    position, fed with the previous step's drafted token and `hidden_next`, attending to
    everything before through the draft's KV cache. This is what an engine's draft worker
    does after a prefill (vLLM `v1/spec_decode/eagle.py::propose`, chain / top-1 case).
  * `simulate_greedy`: the whole decode loop: prefill, draft, verify, accept the longest
    matching prefix plus the target's own token, repeat. Its output is exactly the
    target's greedy decode (speculation is lossless); its AcceptStats use the harness's
    definition (difftest.records.acceptance).

Indexing. With committed tokens t_0..t_{n-1} and the target's greedy next token t_n,
draft position j (0 <= j < n) sees the target features at j and the embedding of t_{j+1},
and predicts t_{j+2}. So the last position predicts the first drafted token.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from difftest.api import AcceptStats
from difftest.api import FC_IN, draft_name
from difftest.api import ConfigError
from difftest.api import FINAL_NORM, hidden_index
from difftest_engines.ref.eagle3 import Eagle3Draft, KVCache
from difftest_engines.ref.target import TargetOutput, run_target

StepRecorder = Callable[[int, str, torch.Tensor], None]


def gather_fc_in(target_out: TargetOutput, inputs: Sequence[str]) -> torch.Tensor:
    """Concatenate the named target tensors in wiring order: A x [B, n, H] -> [B, n, A*H]."""
    if not inputs:
        raise ConfigError("wiring: no fc inputs given")
    parts = []
    for name in inputs:
        k = hidden_index(name)
        if k is not None:
            if not 0 <= k < len(target_out.hidden):
                raise ConfigError(f"wiring: {name} does not exist; the target has h0..h{len(target_out.hidden) - 1}")
            parts.append(target_out.hidden[k])
        elif name == FINAL_NORM:
            parts.append(target_out.final_norm)
        else:
            raise ConfigError(f"wiring: {name!r} is not a target tensor (expected target.h.K or {FINAL_NORM})")
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def run_draft_chain(
    draft: Eagle3Draft,
    fc_in: torch.Tensor,  # [1, n, A*H]: target features of the committed positions 0..n-1
    next_ids: torch.Tensor,  # [1, n]: target ids of tokens 1..n (the last is the target's greedy next token)
    num_steps: int,
    record: StepRecorder | None = None,
) -> list[int]:
    """Draft `num_steps` tokens greedily; returns their target-vocab ids.

    `record(step, name, tensor)` receives every tensor the draft records (fc_out at step 0;
    embeds, layer0.*, hidden_prenorm, logits at each step) plus `logits_target` (the draft
    logits scattered into the target vocab). Step 0 tensors cover all n positions
    ([1, n, ...]); step s >= 1 tensors cover the one new position ([1, 1, ...]).
    """
    if fc_in.dim() != 3 or fc_in.shape[0] != 1:
        raise ValueError(f"fc_in must be [1, n, A*H], got {tuple(fc_in.shape)}")
    n = fc_in.shape[1]
    if tuple(next_ids.shape) != (1, n):
        raise ValueError(f"next_ids must be [1, {n}] to match fc_in, got {tuple(next_ids.shape)}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")

    def recorder_for(step: int) -> Callable[[str, torch.Tensor], None] | None:
        if record is None:
            return None
        return lambda name, t: record(step, name, t)

    drafted: list[int] = []
    cache: KVCache | None = None
    hidden = next_input = None
    for step in range(num_steps):
        rec = recorder_for(step)
        if step == 0:
            # Prefill of the draft: every committed position, causal, fc over the target features.
            hidden = draft.combine(fc_in, record=rec)  # [1, n, H]
            input_ids = next_ids
            positions = torch.arange(n, device=fc_in.device)[None, :]  # [1, n]
        else:
            # One new position after the cached ones, fed with the previous step's own output.
            input_ids = next_input  # [1, 1]
            positions = torch.tensor([[n - 1 + step]], device=fc_in.device)
        out = draft(input_ids, hidden, positions, cache=cache, record=rec)
        cache = out.cache
        if record is not None:
            record(step, "logits_target", draft.logits_in_target_vocab(out.logits))
        draft_id = out.logits[:, -1].argmax(dim=-1)  # [1], draft vocab
        target_id = draft.to_target_ids(draft_id)  # [1], target vocab
        drafted.append(int(target_id.item()))
        next_input = target_id[:, None]  # [1, 1]
        hidden = out.hidden_next[:, -1:]  # [1, 1, H]
    return drafted


def capture_draft_chain(
    draft: Eagle3Draft, fc_in: torch.Tensor, prompt_ids: list[int], next_token: int, num_steps: int
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The draft chain in canonical names (`draft.*`, `draft.step{s}.*`, batch dim dropped).

    Step 0 runs over every prompt position: row i pairs the features at i with token i+1,
    the last row with `next_token` (the target's choice after the prompt).
    """
    tensors: dict[str, torch.Tensor] = {FC_IN: fc_in[0]}

    def record(step: int, name: str, t: torch.Tensor) -> None:
        tensors[draft_name(step, name)] = t[0]

    next_ids = torch.tensor([prompt_ids[1:] + [next_token]], dtype=torch.long)
    drafted = run_draft_chain(draft, fc_in, next_ids, num_steps, record)
    return tensors, drafted


def _greedy(logits: torch.Tensor) -> list[int]:
    """[n, V] -> argmax ids."""
    return logits.argmax(dim=-1).tolist()


@torch.no_grad()
def greedy_decode(target_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with full recompute: the ground truth speculation must reproduce."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        out = run_target(target_model, torch.tensor([tokens]))
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@torch.no_grad()
def simulate_greedy(
    target_model,
    draft: Eagle3Draft,
    inputs: Sequence[str],
    prompts: list[list[int]],
    num_steps: int,
    max_new_tokens: int,
) -> tuple[AcceptStats, list[list[int]]]:
    """Greedy chain speculative decoding over each prompt; returns (stats, generated tokens).

    Per prompt: the prefill yields the first token; then each round drafts `num_steps`
    tokens from the target features of the committed sequence and verifies them with one
    target forward over committed + pending token + drafts. The longest prefix of drafts
    equal to the target's greedy tokens is accepted, plus the target's own next token
    (correction, or bonus when all drafts match). One verify = one target forward after
    the prefill, as engines count it.

    Budget: decoding stops once max_new_tokens are generated and the output is truncated
    to max_new_tokens, but the last verify is counted in full (all its accepted drafts),
    as vLLM's counters do: the statistics measure the draft, not the budget. No EOS stop.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stats = AcceptStats(
        num_verify=0,
        num_accepted=0,
        num_draft_steps=num_steps,
        accepted_per_pos=[0] * num_steps,
        num_prompts=len(prompts),
        source="ref simulation",
    )
    outputs: list[list[int]] = []
    for prompt in prompts:
        if len(prompt) < 1:
            raise ValueError("empty prompt")
        committed = list(prompt)  # tokens the target has processed and whose features the draft may use
        out = run_target(target_model, torch.tensor([committed]))  # prefill
        pending = int(out.logits[0, -1].argmax())  # the target's next token, not yet fed to it
        generated = [pending]
        while len(generated) < max_new_tokens:
            n = len(committed)
            next_ids = torch.tensor([committed[1:] + [pending]])  # [1, n]
            drafts = run_draft_chain(draft, gather_fc_in(out, inputs), next_ids, num_steps)
            # Verify: the target's greedy token after the pending token and after each draft.
            verify = run_target(target_model, torch.tensor([committed + [pending] + drafts]))
            want = _greedy(verify.logits[0, n:])  # num_steps + 1 predictions
            accepted = 0
            while accepted < num_steps and drafts[accepted] == want[accepted]:
                stats.accepted_per_pos[accepted] += 1
                accepted += 1
            stats.num_verify += 1
            stats.num_accepted += accepted
            generated += drafts[:accepted] + [want[accepted]]
            committed += [pending] + drafts[:accepted]
            pending = want[accepted]
            # Causal target: the verify forward's prefix is exactly the committed sequence's features.
            m = len(committed)
            out = TargetOutput(
                hidden=[h[:, :m] for h in verify.hidden],
                final_norm=verify.final_norm[:, :m],
                logits=verify.logits[:, :m],
            )
        outputs.append(generated[:max_new_tokens])
    # an engine's outputs are compared with these (difftest.checks.checks: judged on the engine's own tokens)
    stats.outputs = [list(o) for o in outputs]
    return stats, outputs
