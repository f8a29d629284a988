"""Each op of the SGLang CPU kernel shim (difftest_engines/sglang/cpu_shim/ops.py) against a direct
torch computation. Needs only torch: runs in the core environment."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess

import pytest
import torch

from difftest_engines.sglang.cpu_shim import ops
from helpers import HANG_GUARD_S, ROOT, TESTS, sglang_python_or_skip


def _pool(reqs=3, pool_len=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(reqs * pool_len, generator=g).view(reqs, pool_len).to(torch.int32)


def test_copy_all_layer_kv_cache_moves_slots_in_every_buffer():
    bufs = [torch.randn(10, 2, 4), torch.randn(10, 3).to(torch.bfloat16)]
    expected = [b.clone() for b in bufs]
    src, tgt = torch.tensor([1, 2, 7]), torch.tensor([2, 5, 1])  # slot 2 is both read and written
    for e in expected:
        e[tgt] = e[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs])
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs])
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, e in zip(bufs, expected):
        assert torch.equal(b, e)


def test_assign_req_to_token_pool_and_extend_cache_locs_are_inverse():
    r2t = torch.zeros(4, 16, dtype=torch.int32)
    rpi, start, end = torch.tensor([2, 0]), torch.tensor([3, 0]), torch.tensor([6, 2])
    locs = torch.tensor([40, 41, 42, 50, 51], dtype=torch.int64)
    ops.assign_req_to_token_pool_cpu(rpi, r2t, start, end, locs, 16)
    expected = torch.zeros(4, 16, dtype=torch.int32)
    expected[2, 3:6] = torch.tensor([40, 41, 42])
    expected[0, 0:2] = torch.tensor([50, 51])
    assert torch.equal(r2t, expected)
    out = torch.zeros(5, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(rpi, r2t, start, end, out, 16)
    assert torch.equal(out, locs)


def test_assign_draft_cache_locs_contiguous():
    r2t = _pool()
    rpi, seq_lens, topk, cols = torch.tensor([1, 2]), torch.tensor([5, 9]), 2, 3
    out = torch.zeros(2 * topk * cols, dtype=torch.int32)
    ops.assign_draft_cache_locs_contiguous_cpu(rpi, r2t, seq_lens, out, 32, topk, cols)
    assert torch.equal(out, torch.cat([r2t[1, 5:11], r2t[2, 9:15]]))


def test_build_draft_decode_metadata():
    r2t = _pool()
    rpi, seq_lens, topk, steps = torch.tensor([0, 2]), torch.tensor([4, 6]), 2, 3
    out = ops.build_draft_decode_metadata_cpu(r2t, rpi, seq_lens, topk, steps, 32)
    assert out.shape == (4, 32)
    for b, (req, s) in enumerate([(0, 4), (2, 6)]):
        for k in range(topk):
            row = out[b * topk + k]
            assert torch.equal(row[:s], r2t[req, :s])
            assert torch.equal(row[s : s + steps], r2t[req, s + k * steps : s + (k + 1) * steps])
            assert not row[s + steps :].any()


def test_fill_bonus_tokens_takes_the_last_accepted():
    accept_tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    accept_lens = torch.tensor([3, 1])
    bonus = torch.zeros(2, dtype=torch.int64)
    ops.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, 4)
    assert bonus.tolist() == [accept_tokens[0, 2].item(), accept_tokens[1, 0].item()]


def test_fill_accept_out_cache_loc_skips_rejected():
    accept_index = torch.tensor([[0, 1, -1], [3, -1, -1]])
    locs = torch.tensor([100, 101, 102, 103, 104])
    out = torch.full((6,), -7)
    ops.fill_accept_out_cache_loc_cpu(accept_index, locs, out)
    assert out.tolist() == [100, 101, 103, -7, -7, -7]


def _sdpa(q, k, v, scaling, mask):  # q [n,H,D], k/v [m,Hkv,D], mask [n,m] -> [n,H,D]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scaling
    )
    return o.transpose(0, 1)


def _kv_setup(seed=0, H=4, Hkv=2, D=8, slots=64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, Hkv, D, generator=g), torch.randn(slots, Hkv, D, generator=g), g, H, Hkv, D)


def test_decode_attention_matches_sdpa_and_stores_kv():
    kbuf, vbuf, g, H, Hkv, D = _kv_setup()
    r2t = torch.randperm(60, generator=g)[:40].view(2, 20).to(torch.int32)
    rpi, seq_lens = torch.tensor([1, 0]), torch.tensor([7, 12])
    loc = torch.stack([r2t[1, 6], r2t[0, 11]]).long()  # the new token's slot: the last one
    q, key, value = (
        torch.randn(2, H, D, generator=g),
        torch.randn(2, Hkv, D, generator=g),
        torch.randn(2, Hkv, D, generator=g),
    )
    o = torch.zeros(2, H, D)
    scaling = 1 / math.sqrt(D)
    ops.decode_attention_cpu(
        q,
        kbuf,
        vbuf,
        1.0,
        1.0,
        o,
        key,
        value,
        loc,
        torch.empty(0),
        r2t,
        rpi,
        seq_lens,
        scaling,
        0.0,
        False,
        -1,
        None,
        None,
    )
    assert torch.equal(kbuf[loc], key) and torch.equal(vbuf[loc], value)
    for b, (req, s) in enumerate([(1, 7), (0, 12)]):
        slots = r2t[req, :s].long()
        want = _sdpa(q[b : b + 1], kbuf[slots], vbuf[slots], scaling, None)
        torch.testing.assert_close(o[b : b + 1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["causal", "tree_mask", "kv_args"])
def test_extend_attention_matches_sdpa(mode):
    kbuf, vbuf, g, H, Hkv, D = _kv_setup(seed=1)
    r2t = torch.randperm(60, generator=g)[:40].view(2, 20).to(torch.int32)
    rpi, seq_lens, ext = torch.tensor([0, 1]), torch.tensor([9, 6]), torch.tensor([4, 3])
    starts = torch.tensor([0, 4])
    q = torch.randn(7, H, D, generator=g)
    k_new, v_new = torch.randn(7, Hkv, D, generator=g), torch.randn(7, Hkv, D, generator=g)
    if mode != "kv_args":  # SGLang stores the new tokens' k/v in the cache before attending
        for b in range(2):
            slots = r2t[int(rpi[b]), int(seq_lens[b] - ext[b]) : int(seq_lens[b])].long()
            kbuf[slots], vbuf[slots] = k_new[starts[b] : starts[b] + ext[b]], v_new[starts[b] : starts[b] + ext[b]]
    masks = [torch.ones(4, 4).tril().bool(), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool()]
    custom = torch.cat([m.reshape(-1) for m in masks]) if mode == "tree_mask" else None
    o = torch.zeros(7, H, D)
    scaling = 0.3
    ops.extend_attention_cpu(
        q,
        k_new if mode == "kv_args" else None,
        v_new if mode == "kv_args" else None,
        o,
        kbuf,
        vbuf,
        1.0,
        1.0,
        r2t,
        rpi,
        seq_lens,
        ext,
        starts,
        4,
        scaling,
        0.0,
        False,
        -1,
        None,
        None,
        custom,
        mode != "tree_mask",
    )
    for b in range(2):
        S, E, st = int(seq_lens[b]), int(ext[b]), int(starts[b])
        slots = r2t[int(rpi[b]), :S].long()
        kk, vv = kbuf[slots].clone(), vbuf[slots].clone()
        kk[S - E :], vv[S - E :] = k_new[st : st + E], v_new[st : st + E]
        mask = torch.ones(E, S, dtype=torch.bool)
        mask[:, S - E :] = masks[b] if mode == "tree_mask" else torch.ones(E, E).tril().bool()
        want = _sdpa(q[st : st + E], kk, vv, scaling, mask)
        torch.testing.assert_close(o[st : st + E], want, atol=1e-5, rtol=1e-5)


def test_extend_attention_mla_prefill_reads_new_tokens_from_kv_args_not_the_latent_cache():
    # SGLang's MLA prefill (forward_mha.py::forward_normal_core): per-head k [E, H, 96] and v [E, H*32]
    # that are never stored in the latent cache [slots, 1, 576]; no prefix is cached (P = 0).
    g = torch.Generator().manual_seed(3)
    H, E = 4, 5
    kbuf, vbuf = torch.randn(16, 1, 576, generator=g), torch.randn(16, 1, 512, generator=g)
    r2t = torch.arange(16, dtype=torch.int32).view(1, 16)
    q, k, v = (
        torch.randn(E, H, 96, generator=g),
        torch.randn(E, H, 96, generator=g),
        torch.randn(E, H * 32, generator=g),
    )
    o = torch.zeros(E, H, 32)
    ops.extend_attention_cpu(
        q,
        k,
        v,
        o,
        kbuf,
        vbuf,
        1.0,
        1.0,
        r2t,
        torch.tensor([0]),
        torch.tensor([E]),
        torch.tensor([E]),
        torch.tensor([0]),
        E,
        0.2,
        0.0,
        False,
        -1,
        None,
        None,
        None,
        True,
    )
    want = _sdpa(q, k, v.view(E, H, 32), 0.2, torch.ones(E, E).tril().bool())
    torch.testing.assert_close(o, want, atol=1e-5, rtol=1e-5)


def test_attention_ops_register_under_torch_ops_sgl_kernel():
    ops.register_torch_ops()
    ops.register_torch_ops()  # idempotent
    for name in ops.TORCH_OPS:
        assert hasattr(torch.ops.sgl_kernel, name)


def _nms_schema_defined() -> bool:
    try:
        torch.ops.torchvision.nms  # noqa: B018  (raises when the schema is missing)
        return True
    except (AttributeError, RuntimeError):
        return False


def test_torchvision_nms_schema_is_defined_once():
    defined_before = _nms_schema_defined()  # by a real torchvision, or an earlier registration
    assert ops.register_torchvision_nms_schema() is (not defined_before)
    assert ops.register_torchvision_nms_schema() is False
    assert _nms_schema_defined()


def _run_sglang_check(name: str) -> None:
    """A check of tests/sglang_shim_checks.py where SGLang is: in-process when the core environment has
    it, else under the SGLang environment's interpreter."""
    import sglang_shim_checks

    if importlib.util.find_spec("sglang") is not None:
        getattr(sglang_shim_checks, name)()
        return
    python = sglang_python_or_skip()
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    proc = subprocess.run(
        [python, sglang_shim_checks.__file__, name], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"ok {name}" in proc.stdout


def test_verify_tree_greedy_chain_accepts_the_matching_prefix():
    _run_sglang_check("verify_tree_greedy_chain_accepts_the_matching_prefix")


def test_tree_build_and_greedy_verify_match_sglangs_triton_kernels_on_random_trees():
    """Both tree ops are ours (SGLang's Triton versions run only under Triton's interpreter on CPU,
    most of a speculative round's time); SGLang's kernels are the oracle, output for output."""
    _run_sglang_check("tree_kernels_match_sglangs_triton_kernels")


def test_the_functions_run_eagerly_match_sglangs_compiled_ones():
    """SGLang's torch.compile'd drafting helper runs as written under the shim (a compile in every
    scheduler otherwise); SGLang's compiled function is the oracle, output for output, ties included."""
    _run_sglang_check("eager_functions_match_sglangs_compiled_ones")
