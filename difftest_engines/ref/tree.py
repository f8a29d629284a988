"""Greedy speculative decoding with a draft *tree* (EAGLE-2/3 dynamic tree, as SGLang's
`speculative_eagle_topk > 1`): accept length beyond chains.

One round, from the committed tokens t_0..t_{n-1} and the pending token t_n:
  * expand: step 0 runs fc and the draft layer over every committed position (as the chain
    does) and keeps the `topk` most likely tokens at the last position; each later step
    expands the `topk` best frontier nodes (cumulative draft log-probability) by their own
    `topk` best children, `num_steps` levels deep. Branches share the step-0 KV cache;
    each node extends its parent's (KVCache.extend makes new tensors, so siblings never
    see each other).
  * select: the `num_draft_tokens - 1` best nodes by cumulative log-probability (the
    root, i.e. the pending token, is SGLang's first "draft token"). A child never scores
    higher than its parent, so the selection is a tree (ties broken towards shallower nodes).
  * verify: walk from the root, following the child whose token is the target's greedy
    token, until none matches; accepted = the path length. The target's own next token
    is appended (correction or bonus), as in the chain.
With topk == 1 and num_draft_tokens == num_steps + 1 this is exactly the chain
(difftest_engines/ref/speculate.py::simulate_greedy): same tokens, same statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from difftest.api import AcceptStats
from difftest_engines.ref.eagle3 import Eagle3Draft, KVCache
from difftest_engines.ref.speculate import gather_fc_in
from difftest_engines.ref.target import run_target


@dataclass
class Node:
    token: int  # target-vocab id
    score: float  # cumulative draft log-probability
    depth: int  # 1 = first drafted token
    parent: "Node | None"
    cache: KVCache | None = None
    hidden: torch.Tensor | None = None  # what this node's expansion feeds the draft ([1, 1, H])
    children: list["Node"] = field(default_factory=list)

    def path(self) -> list[int]:
        out, n = [], self
        while n is not None and n.depth > 0:
            out.append(n.token)
            n = n.parent
        return out[::-1]


def _children(draft: Eagle3Draft, parent: Node, logits: torch.Tensor, out, topk: int) -> list[Node]:
    logp = torch.log_softmax(logits.float(), dim=-1)  # [draft_vocab]
    values, ids = logp.topk(min(topk, logp.numel()))
    targets = draft.to_target_ids(ids)
    return [
        Node(int(t), parent.score + float(v), parent.depth + 1, parent, out.cache, out.hidden_next[:, -1:])
        for v, t in zip(values, targets)
    ]


@torch.no_grad()
def draft_tree(
    draft: Eagle3Draft, fc_in: torch.Tensor, next_ids: torch.Tensor, num_steps: int, topk: int, num_draft_tokens: int
) -> Node:
    """Build and prune one draft tree; returns the root (the pending token, depth 0)."""
    n = fc_in.shape[1]
    root = Node(int(next_ids[0, -1]), 0.0, 0, None)
    hidden = draft.combine(fc_in)  # [1, n, H]
    out = draft(next_ids, hidden, torch.arange(n)[None, :])
    everything = _children(draft, root, out.logits[0, -1], out, topk)
    frontier = everything
    for depth in range(1, num_steps):
        expanded = []
        for node in sorted(frontier, key=lambda x: -x.score)[:topk]:
            o = draft(torch.tensor([[node.token]]), node.hidden, torch.tensor([[n - 1 + depth]]), cache=node.cache)
            expanded += _children(draft, node, o.logits[0, -1], o, topk)
        everything += expanded
        frontier = expanded
    keep = sorted(everything, key=lambda x: (-x.score, x.depth))[: max(num_draft_tokens - 1, 0)]
    kept = set(map(id, keep))
    for node in keep:
        p = node.parent
        if p is not None and (p is root or id(p) in kept):
            p.children.append(node)
    return root


@torch.no_grad()
def simulate_tree(
    target_model,
    draft: Eagle3Draft,
    inputs: Sequence[str],
    prompts: list[list[int]],
    num_steps: int,
    max_new_tokens: int,
    topk: int,
    num_draft_tokens: int,
) -> tuple[AcceptStats, list[list[int]]]:
    """Tree speculative decoding over each prompt; statistics in the harness's definition."""
    if topk < 1 or num_draft_tokens < 2:
        raise ValueError(f"topk must be >= 1 and num_draft_tokens >= 2, got {topk}, {num_draft_tokens}")
    stats = AcceptStats(0, 0, num_steps, [0] * num_steps, len(prompts), source="ref tree simulation")
    outputs = []
    for prompt in prompts:
        committed = list(prompt)
        out = run_target(target_model, torch.tensor([committed]))
        pending = int(out.logits[0, -1].argmax())
        generated = [pending]
        while len(generated) < max_new_tokens:
            next_ids = torch.tensor([committed[1:] + [pending]])
            root = draft_tree(draft, gather_fc_in(out, inputs), next_ids, num_steps, topk, num_draft_tokens)
            node, accepted = root, []
            while True:  # greedy walk: one target forward per level (a tree-masked forward gives the same tokens)
                verify = run_target(target_model, torch.tensor([committed + [pending] + accepted]))
                want = int(verify.logits[0, -1].argmax())
                child = next((c for c in node.children if c.token == want), None)
                if child is None:
                    break
                stats.accepted_per_pos[len(accepted)] += 1
                accepted.append(want)
                node = child
            stats.num_verify += 1
            stats.num_accepted += len(accepted)
            generated += accepted + [want]
            committed += [pending] + accepted
            pending = want
            out = run_target(target_model, torch.tensor([committed]))
        outputs.append(generated[:max_new_tokens])
    return stats, outputs
