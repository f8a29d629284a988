"""Shim checks that need SGLang itself (its Triton kernels, run by Triton's interpreter on CPU).

Plain functions, no pytest: tests/test_sglang_shim.py runs them in-process where SGLang is
importable, else under the SGLang environment's interpreter (`python tests/sglang_shim_checks.py
NAME`), the environment the engine's worker runs in."""

from __future__ import annotations

import sys


def verify_tree_greedy_chain_accepts_the_matching_prefix() -> None:
    import torch

    from engines.sglang import cpu_shim
    from engines.sglang.cpu_shim import ops

    if cpu_shim.choose_kernels() == cpu_shim.CPU_SHIM:  # as the engine does (engines/sglang/engine.py)
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
    ops.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
                               candidates=candidates, retrive_index=retrive_index, retrive_next_token=nxt,
                               retrive_next_sibling=sib, target_predict=target_predict)  # fmt: skip
    assert int(accept_num[0]) == 2, accept_num
    assert accept_index[0, :3].tolist() == [0, 1, 2], accept_index


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("ok", sys.argv[1])
