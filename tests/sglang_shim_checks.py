"""Shim checks that need SGLang itself (its Triton kernels, run by Triton's interpreter on CPU).

Plain functions, no pytest: tests/test_sglang_shim.py runs them in-process where SGLang is
importable, else under the SGLang environment's interpreter (`python tests/sglang_shim_checks.py
NAME`), the environment the engine's worker runs in."""

from __future__ import annotations

import sys


def verify_tree_greedy_chain_accepts_the_matching_prefix() -> None:
    import torch

    from difftest_engines.sglang import cpu_shim
    from difftest_engines.sglang.cpu_shim import ops

    if cpu_shim.choose_kernels() == cpu_shim.CPU_SHIM:  # as the engine does (difftest_engines/sglang/engine.py)
        cpu_shim.activate()

    # one request, a chain of 3 drafts after the root: candidates [root, a, b, c]; target agrees on a, b
    candidates = torch.tensor([[10, 11, 12, 13]])
    retrive_index = torch.tensor([[0, 1, 2, 3]])
    nxt = torch.tensor([[1, 2, 3, -1]])
    sib = torch.full((1, 4), -1)
    target_predict = torch.tensor([[11, 12, 99, 5]])
    predicts = torch.full((4,), -1)
    accept_index = torch.full((1, 4), -1)
    accept_num = torch.zeros(1, dtype=torch.int32)
    ops.verify_tree_greedy_cpu(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=candidates,
        retrive_index=retrive_index,
        retrive_next_token=nxt,
        retrive_next_sibling=sib,
        target_predict=target_predict,
    )
    assert int(accept_num[0]) == 2, accept_num
    assert accept_index[0, :3].tolist() == [0, 1, 2], accept_index


def _random_tree_inputs(g, bs: int, topk: int, depth: int, n: int, mode: int):
    """Inputs as SGLang's draft stage hands them to the tree build: each step's topk candidates per
    parent, the n - 1 best of all steps' tokens (selected_index, sorted), and each step's parents."""
    import torch

    # parent_list row: 0 (the root), then the topk chosen tokens of each step but the last, as flat ids
    # into the step-by-step candidate list (step s's children of node j: topk + (s-1)*topk*topk + j*topk ...)
    width = topk + (depth - 1) * topk * topk  # every candidate the steps produced
    parent_list = torch.zeros(bs, topk * (depth - 1) + 1, dtype=torch.int64)
    for b in range(bs):
        parent_list[b, 1:] = torch.randperm(width, generator=g)[: topk * (depth - 1)].sort().values
    selected_index = torch.stack([torch.randperm(width, generator=g)[: n - 1].sort().values for _ in range(bs)])
    # some selected tokens are parents of others: make a few parent_list entries name selected ones
    for b in range(bs):
        k = int(torch.randint(0, topk * (depth - 1) + 1, (1,), generator=g))
        picks = torch.randperm(n - 1, generator=g)[:k]
        for j, pick in enumerate(picks.tolist()):
            if 1 + j < parent_list.shape[1]:
                parent_list[b, 1 + j] = selected_index[b, pick]
    seq_lens = torch.randint(1, 9, (bs,), generator=g, dtype=torch.int64)
    size = int(((seq_lens + n) * n).sum()) if mode == 0 else bs * n * n
    outs = dict(
        tree_mask=torch.ones(size, dtype=torch.bool),
        positions=torch.zeros(bs * n, dtype=torch.int64),
        retrieve_index=torch.full((bs, n), -1, dtype=torch.int64),
        retrieve_next_token=torch.full((bs, n), -1, dtype=torch.int64),
        retrieve_next_sibling=torch.full((bs, n), -1, dtype=torch.int64),
    )
    return parent_list, selected_index, seq_lens, outs


def tree_kernels_match_sglangs_triton_kernels() -> None:
    """The shim's tree build and greedy verify against SGLang's own Triton kernels (run by Triton's
    interpreter), output for output, on random trees: batch sizes, topk, depth, draft tokens, both
    mask modes."""
    import torch

    from difftest_engines.sglang import cpu_shim
    from difftest_engines.sglang.cpu_shim import ops

    if cpu_shim.choose_kernels() == cpu_shim.CPU_SHIM:
        cpu_shim.activate()
    triton = ops._spec_tree()
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 1, 4, 5, 0), (3, 1, 3, 4, 0), (2, 2, 3, 6, 0), (4, 3, 4, 8, 1), (2, 4, 2, 7, 0), (5, 2, 5, 9, 1)]
    checked = 0
    for bs, topk, depth, n, mode in shapes:
        for _ in range(4):
            parent_list, selected, seq_lens, outs = _random_tree_inputs(g, bs, topk, depth, n, mode)
            ours = {k: v.clone() for k, v in outs.items()}
            theirs = {k: v.clone() for k, v in outs.items()}
            ops.build_tree_kernel_efficient_cpu(
                parent_list,
                selected,
                seq_lens,
                ours["tree_mask"],
                ours["positions"],
                ours["retrieve_index"],
                ours["retrieve_next_token"],
                ours["retrieve_next_sibling"],
                topk,
                depth,
                n,
                mode,
            )
            triton.sgl_build_tree_kernel_triton(
                parent_list,
                selected,
                seq_lens,
                theirs["tree_mask"],
                theirs["positions"],
                theirs["retrieve_index"],
                theirs["retrieve_next_token"],
                theirs["retrieve_next_sibling"],
                topk,
                depth,
                n,
                mode,
            )
            for k in outs:
                assert torch.equal(ours[k], theirs[k]), (bs, topk, depth, n, mode, k, ours[k], theirs[k])
            # greedy verify over that tree: candidates and target predictions from a 3-token vocabulary,
            # so that some branches agree and some do not
            for steps in (2, depth + 1):
                candidates = torch.randint(0, 3, (bs, n), generator=g)
                target_predict = torch.randint(0, 3, (bs * n,), generator=g)
                res = [
                    dict(
                        predicts=torch.full((bs * n,), -1, dtype=torch.int32),
                        accept_index=torch.full((bs, steps), -1, dtype=torch.int32),
                        accept_token_num=torch.zeros(bs, dtype=torch.int32),
                    )
                    for _ in range(2)
                ]
                tree = dict(candidates=candidates, target_predict=target_predict)
                ops.verify_tree_greedy_cpu(
                    **res[0],
                    **tree,
                    retrive_index=ours["retrieve_index"],
                    retrive_next_token=ours["retrieve_next_token"],
                    retrive_next_sibling=ours["retrieve_next_sibling"],
                )
                triton.verify_tree_greedy_triton(
                    **res[1],
                    **tree,
                    retrieve_index=ours["retrieve_index"],
                    retrieve_next_token=ours["retrieve_next_token"],
                    retrieve_next_sibling=ours["retrieve_next_sibling"],
                )
                for k in res[0]:
                    assert torch.equal(res[0][k], res[1][k]), (bs, topk, depth, n, steps, k, res[0][k], res[1][k])
                checked += 1
    assert checked == len(shapes) * 4 * 2


def eager_functions_match_sglangs_compiled_ones() -> None:
    """Each SGLang function the shim runs eagerly (difftest_engines/sglang/cpu_shim/eager.py) against SGLang's
    own torch.compile'd one, output for output: batch sizes, topk 1 (torch.max) and more
    (torch.topk), later drafting steps, hidden states present, empty or absent, and scores with
    ties (a few distinct values), where a changed order would pick other indices."""
    import importlib

    import torch

    from difftest_engines.sglang import cpu_shim
    from difftest_engines.sglang.cpu_shim import eager

    if cpu_shim.choose_kernels() == cpu_shim.CPU_SHIM:
        cpu_shim.activate()
    eager.install()
    spec_utils = importlib.import_module("sglang.srt.speculative.spec_utils")
    name = "_select_top_k_tokens_later"
    ours = getattr(spec_utils, name)
    theirs = eager.COMPILED[(spec_utils.__name__, name)]
    assert eager.uncompiled(ours) is ours and eager.uncompiled(theirs) is not theirs, (ours, theirs)
    g = torch.Generator().manual_seed(0)
    levels = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4])  # few values: ties in the products
    checked = 0
    shapes = [(1, 1, 1, 8), (3, 1, 2, 8), (1, 2, 1, 8), (2, 2, 3, 0), (3, 4, 2, 16), (2, 3, 1, None)]
    for bs, topk, i, hidden in shapes:
        for _ in range(3):
            topk_p = levels[torch.randint(0, len(levels), (bs * topk, topk), generator=g)]
            topk_index = torch.randint(0, 1000, (bs * topk, topk), generator=g)
            scores = levels[torch.randint(0, len(levels), (bs, topk), generator=g)]
            states = None if hidden is None else torch.randn(bs * topk if hidden else 0, hidden or 8, generator=g)
            args = (i, topk_p, topk_index, states, scores, topk)
            a, b = ours(*args), theirs(*args)
            flat_a = [a[0], a[1], a[2], *a[3]]
            flat_b = [b[0], b[1], b[2], *b[3]]
            for k, (x, y) in enumerate(zip(flat_a, flat_b)):
                if x is None or y is None:
                    assert x is None and y is None, (bs, topk, i, k)
                else:
                    assert x.dtype == y.dtype and torch.equal(x, y), (bs, topk, i, hidden, k, x, y)
            checked += 1
    assert checked == len(shapes) * 3


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("ok", sys.argv[1])
