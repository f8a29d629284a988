"""Plain-torch versions of the `sgl_kernel` CPU ops SGLang 0.5.23's EAGLE-3 path calls.

SGLang's CPU backend expects a compiled `sgl_kernel` (an AMX Xeon build). These functions
do the same work with plain tensor ops, slowly and without AMX, so SGLang's real Python
wiring (scheduler, KV cache, EAGLE-3 worker, tree build and verify) runs on any CPU.
Only the kernels are replaced; everything the harness checks is SGLang's own code.

Signatures follow SGLang's call sites (argument names as SGLang spells them). Every op
here has a unit test against a direct torch computation (tests/test_sglang_shim.py).
The two tree ops are held to SGLang's own Triton kernels instead (tests/sglang_shim_checks.py runs
both on random trees; the Triton ones run under Triton's interpreter, TRITON_INTERPRET=1, set by
`difftest_engines.sglang.cpu_shim.activate`).
"""

from __future__ import annotations

import ctypes

import torch

# -- KV cache and token-pool bookkeeping ------------------------------------------------


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For every KV buffer (base address data_ptrs[i], bytes per slot strides[i]) copy slot
    src_loc[j] to slot tgt_loc[j]. All sources are read before any target is written."""
    src, tgt = src_loc.tolist(), tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """req_to_token[req b, start_b:end_b] = the next (end_b - start_b) entries of out_cache_loc."""
    o = 0
    for b in range(req_pool_indices.shape[0]):
        s, e = int(start_offset[b]), int(end_offset[b])
        req_to_token[int(req_pool_indices[b]), s:e] = out_cache_loc[o : o + e - s].to(req_to_token.dtype)
        o += e - s


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """The inverse gather: out_cache_loc <- req_to_token[req b, start_b:end_b], requests concatenated."""
    o = 0
    for b in range(req_pool_indices.shape[0]):
        s, e = int(start_offset[b]), int(end_offset[b])
        out_cache_loc[o : o + e - s] = req_to_token[int(req_pool_indices[b]), s:e]
        o += e - s


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_cols
) -> None:
    """out_cache_loc[b*n:(b+1)*n] = req_to_token[req b, seq_len_b : seq_len_b + n], n = topk * num_cols."""
    n = topk * num_cols
    for b in range(seq_lens.shape[0]):
        s = int(seq_lens[b])
        out_cache_loc[b * n : (b + 1) * n] = req_to_token[int(req_pool_indices[b]), s : s + n]


def build_draft_decode_metadata_cpu(
    req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len
) -> torch.Tensor:
    """Per (request, branch) row of the draft-decode page table: the committed prefix, then
    that branch's num_steps draft slots (laid out branch-major after the prefix)."""
    bs = seq_lens.shape[0]
    out = torch.zeros((bs * topk, pool_len), dtype=req_to_token.dtype)
    for b in range(bs):
        s, row = int(seq_lens[b]), req_to_token[int(req_pool_indices[b])]
        for k in range(topk):
            out[b * topk + k, :s] = row[:s]
            out[b * topk + k, s : s + num_steps] = row[s + k * num_steps : s + (k + 1) * num_steps]
    return out


# -- speculative verify bookkeeping -----------------------------------------------------


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, stride) -> None:
    """bonus[b] = the last accepted token of request b (row b of accept_tokens, width stride)."""
    flat = accept_tokens.reshape(-1)
    for b in range(accept_lens.shape[0]):
        bonus[b] = flat[stride * b + int(accept_lens[b]) - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out) -> None:
    """accept_out[:m] = out_cache_loc at the accepted indices (-1 marks a rejected slot)."""
    idx = accept_index.reshape(-1)
    sel = idx[idx != -1]
    accept_out[: sel.numel()] = out_cache_loc[sel]


def _spec_tree():
    """SGLang's own Triton tree kernels: sglang/kernels/ops/speculative/spec_tree.py from 0.5.17 on; in
    0.5.16 the same two functions live in sglang/srt/speculative/eagle_utils.py (sgl_build_tree_kernel_triton,
    verify_tree_greedy_triton; same signatures)."""
    try:
        from sglang.kernels.ops.speculative import spec_tree  # 0.5.16 has the module, without these two

        if hasattr(spec_tree, "sgl_build_tree_kernel_triton"):
            return spec_tree
    except ImportError:
        pass
    from sglang.srt.speculative import eagle_utils

    return eagle_utils


# The two tree ops run once per speculative round. SGLang's Triton versions (_spec_tree) run on CPU
# only under Triton's interpreter, which emulates every scalar load and store in numpy: measured, half
# of the scheduler's time in a speculative run of the tiny Llama case. These are the same walks over
# the same flat buffers in plain Python on lists (the trees have a few tokens per request);
# tests/sglang_shim_checks.py holds them to SGLang's Triton kernels, output for output, on random trees.


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int = 0,
) -> None:
    """For each request: each draft token's parent (selected_index // topk names a row of parent_list,
    whose token is found again in selected_index), linked as first child (next_token) and siblings
    (next_sibling, the newest child first); its position (the root's seq_len plus its depth); and its
    row of the tree mask (itself and its ancestors). Mode 0 writes the mask rows after each request's
    prefix columns (FULL_MASK), mode 1 a draft_token_num square per request (QLEN_ONLY)."""
    mode = int(tree_mask_mode)
    if mode not in (0, 1):
        raise NotImplementedError(f"tree mask mode {mode} (bit-packed) is not supported on CPU")
    n = draft_token_num
    seq_lens = verified_seq_len.tolist()
    pl_stride = parent_list.shape[-1]
    parents = parent_list.contiguous().view(-1).tolist()
    sel_stride = selected_index.shape[-1]
    selected = selected_index.contiguous().view(-1).tolist()
    pos = positions.view(-1).tolist()
    index = retrive_index.view(-1).tolist()
    next_token = retrive_next_token.view(-1).tolist()
    next_sibling = retrive_next_sibling.view(-1).tolist()
    mask_writes: dict[int, int] = {}
    prefix = 0
    for b, seq_len in enumerate(seq_lens):
        sel = selected[b * sel_stride : b * sel_stride + n - 1]
        row_of = {}  # a token's first row in selected_index (the kernels search in order)
        for pp in range(n - 2, -1, -1):
            row_of[sel[pp]] = pp
        # each draft row's parent row: -1 the root, None where its parent token is not among the selected
        parent_of = [
            -1 if sel[r] // topk == 0 else row_of.get(parents[b * pl_stride + sel[r] // topk]) for r in range(n - 1)
        ]
        base = b * n
        pos[base] = seq_len
        for i in range(n - 1, 0, -1):
            index[base + i] = base + i
            p = parent_of[i - 1]
            if p is None:
                continue
            slot = base + p + 1
            if next_token[slot] != -1:
                next_sibling[base + i] = next_token[slot]
            next_token[slot] = i
        index[base] = base
        for x in range(n):
            if mode == 0:
                row = n * n * b + prefix * n + (seq_len + n) * x + seq_len + 1
            else:
                row = n * n * b + n * x + 1
            mask_writes[row - 1] = 1
            for i in range(n - 1):
                mask_writes[row + i] = 0
            if x == 0:
                continue
            cur, d = x - 1, 0
            for _ in range(depth):
                d += 1
                mask_writes[row + cur] = 1
                p = parent_of[cur]
                if p is None or p == -1:
                    break
                cur = p
            pos[base + x] = d + seq_len
        prefix += seq_len
    positions.view(-1).copy_(torch.tensor(pos, dtype=positions.dtype))
    retrive_index.view(-1).copy_(torch.tensor(index, dtype=retrive_index.dtype))
    retrive_next_token.view(-1).copy_(torch.tensor(next_token, dtype=retrive_next_token.dtype))
    retrive_next_sibling.view(-1).copy_(torch.tensor(next_sibling, dtype=retrive_next_sibling.dtype))
    if mask_writes:
        flat = tree_mask.view(-1)
        flat[torch.tensor(list(mask_writes))] = torch.tensor(list(mask_writes.values())).to(flat.dtype)


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy verification: from the root, follow the child whose draft token equals the target's
    prediction at the last accepted node (siblings in list order), as deep as they agree. Writes the
    accepted nodes' flat indices (accept_index), their count, and the target's token at each accepted
    node and at the last one (predicts: the bonus token)."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    index = retrive_index.reshape(-1).tolist()
    next_token = retrive_next_token.reshape(-1).tolist()
    next_sibling = retrive_next_sibling.reshape(-1).tolist()
    cand = candidates.reshape(-1).tolist()
    target = target_predict.reshape(-1).tolist()
    writes: dict[int, int] = {}
    accepted = accept_index.view(-1).tolist()
    counts = accept_token_num.tolist()
    for b in range(bs):
        last = index[b * n]
        accepted[b * steps] = last
        count, cur = 0, 0
        for _ in range(1, steps):
            cur = next_token[b * n + cur]
            want = target[last]
            found = False
            for _ in range(n):  # the kernel's bound on a sibling list
                if cur == -1:
                    break
                if cand[b * n + cur] == want:
                    found = True
                    break
                cur = next_sibling[b * n + cur]
            if not found:
                break
            writes[last] = want
            count += 1
            last = index[b * n + cur]
            accepted[b * steps + count] = last
        counts[b] = count
        writes[last] = target[last]
    accept_index.view(-1).copy_(torch.tensor(accepted, dtype=accept_index.dtype))
    accept_token_num.copy_(torch.tensor(counts, dtype=accept_token_num.dtype))
    flat = predicts.view(-1)
    flat[torch.tensor(list(writes))] = torch.tensor(list(writes.values())).to(flat.dtype)


# -- attention (the intel_amx backend's two ops) ----------------------------------------


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention in float32. q [n, H, D], k/v [m, Hkv, D] (GQA: H % Hkv == 0),
    mask [n, m] bool (True = may attend) -> [n, H, D]."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, 1).float()  # [m, H, D]
    v = v.repeat_interleave(rep, 1).float()
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k) * scaling  # [H, n, m]
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v)


def decode_attention_cpu(
    q,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    o,
    key,
    value,
    loc,
    attn_logits,
    req_to_token,
    req_pool_indices,
    seq_lens,
    scaling,
    logit_cap,
    is_cross,
    sliding_window,
    encoder_lens,
    sinks,
) -> None:
    """One new token per request: store its k/v at `loc`, attend over the request's cached tokens."""
    if key is not None:
        k_buffer[loc] = key.to(k_buffer.dtype)
        v_buffer[loc] = value.to(v_buffer.dtype)
    for b in range(q.shape[0]):
        slots = req_to_token[int(req_pool_indices[b]), : int(seq_lens[b])].long()
        o[b] = attend(q[b : b + 1], k_buffer[slots], v_buffer[slots], scaling)[0].to(o.dtype)


def extend_attention_cpu(
    q,
    k,
    v,
    o,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_seq_lens,
    extend_start_loc,
    max_len_extend,
    scaling,
    logit_cap,
    is_cross,
    sliding_window,
    encoder_lens,
    sinks,
    custom_mask,
    is_causal,
) -> None:
    """E new tokens per request after P cached ones (S = P + E): each new token attends to the
    prefix and, causally or through the tree mask, to the new tokens. As the compiled kernel:
    the prefix comes from the cache, the new tokens' k/v from the k/v arguments when given,
    else from the cache, where SGLang has already written them. MLA prefill (SGLang's
    forward_mha.py::forward_normal_core) passes per-head k [E, H, nope + rope] / v [E, H, v_head]
    that it never stores in the latent cache [slots, 1, kv_lora_rank + rope], so with no cached
    prefix nothing may be read from the cache at all (the shapes do not even match)."""
    off = 0
    if k is not None and v is not None:  # [tokens, heads * D] or [tokens, heads, D]: heads from q's / o's D
        k = k.reshape(k.shape[0], -1, q.shape[-1])
        v = v.reshape(v.shape[0], -1, o.shape[-1])
    for b in range(seq_lens.shape[0]):
        S, E, st = int(seq_lens[b]), int(extend_seq_lens[b]), int(extend_start_loc[b])
        P = S - E
        slots = req_to_token[int(req_pool_indices[b]), :S].long()
        if k is not None and v is not None:
            kk, vv = k[st : st + E], v[st : st + E]
            if P > 0:
                kk = torch.cat([k_buffer[slots[:P]].to(kk.dtype), kk])
                vv = torch.cat([v_buffer[slots[:P]].to(vv.dtype), vv])
        else:
            kk, vv = k_buffer[slots], v_buffer[slots]
        mask = torch.ones(E, S, dtype=torch.bool)
        if is_causal:
            mask[:, P:] = torch.ones(E, E, dtype=torch.bool).tril()
        if custom_mask is not None:  # CPU uses TreeMaskMode.QLEN_ONLY: an [E, E] block per request
            mask[:, P:] = custom_mask[off : off + E * E].view(E, E).bool()
            off += E * E
        o[st : st + E] = attend(q[st : st + E], kk, vv, scaling, mask).to(o.dtype)


_ATTENTION_SCHEMAS = {
    "decode_attention_cpu": (
        "decode_attention_cpu(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale, float v_scale, "
        "Tensor(c!) o, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float scaling, float logit_cap, bool is_cross, int sliding_window, "
        "Tensor? encoder_lens, Tensor? sinks) -> ()",
        decode_attention_cpu,
    ),
    "extend_attention_cpu": (
        "extend_attention_cpu(Tensor q, Tensor? k, Tensor? v, Tensor(a!) o, Tensor k_buffer, Tensor v_buffer, "
        "float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, float scaling, float logit_cap, "
        "bool is_cross, int sliding_window, Tensor? encoder_lens, Tensor? sinks, Tensor? custom_mask, "
        "bool is_causal) -> ()",
        extend_attention_cpu,
    ),
}
_libraries: list = []  # keep the torch.library fragments alive


# -- older releases' call signatures of the two attention ops ----------------------------
# SGLang's intel_amx backend calls torch.ops.sgl_kernel.{extend,decode}_attention_cpu positionally
# (srt/layers/attention/intel_amx_backend.py::IntelAMXAttnBackend.forward_extend / forward_decode), and
# the argument list grew release by release (read in each released wheel):
#   <= 0.5.12.post1  extend (q, k, v, o, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
#                    extend_seq_lens, extend_start_loc, max_len_extend, scaling, logit_cap);
#                    decode (q, k_buffer, v_buffer, o, key, value, loc, attn_logits, req_to_token,
#                    req_pool_indices, seq_lens, scaling, logit_cap)
#   0.5.13           both + is_cross, sliding_window, encoder_lens, sinks
#   0.5.16           extend + custom_mask (the EAGLE tree mask; also the first release whose
#                    speculative/draft_utils.py gives EAGLE an intel_amx draft backend)
#   0.5.19           extend + is_causal
#   0.5.20           both + k_scale, v_scale after the buffers (the layout above, _ATTENTION_SCHEMAS)
# Each older form is the current op with the missing arguments at the values the older backend implied
# (scales 1.0, no mask, causal, no window, no sinks).


def _extend_0_5_19(
    q,
    k,
    v,
    o,
    k_buffer,
    v_buffer,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_seq_lens,
    extend_start_loc,
    max_len_extend,
    scaling,
    logit_cap,
    is_cross,
    sliding_window,
    encoder_lens,
    sinks,
    custom_mask,
    is_causal,
) -> None:
    extend_attention_cpu(
        q,
        k,
        v,
        o,
        k_buffer,
        v_buffer,
        1.0,
        1.0,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_seq_lens,
        extend_start_loc,
        max_len_extend,
        scaling,
        logit_cap,
        is_cross,
        sliding_window,
        encoder_lens,
        sinks,
        custom_mask,
        is_causal,
    )


def _extend_0_5_16(*args) -> None:
    _extend_0_5_19(*args, True)


def _extend_0_5_13(*args) -> None:
    _extend_0_5_19(*args, None, True)


def _extend_0_5_1(*args) -> None:
    _extend_0_5_19(*args, False, -1, None, None, None, True)


def _decode_0_5_13(
    q,
    k_buffer,
    v_buffer,
    o,
    key,
    value,
    loc,
    attn_logits,
    req_to_token,
    req_pool_indices,
    seq_lens,
    scaling,
    logit_cap,
    is_cross,
    sliding_window,
    encoder_lens,
    sinks,
) -> None:
    decode_attention_cpu(
        q,
        k_buffer,
        v_buffer,
        1.0,
        1.0,
        o,
        key,
        value,
        loc,
        attn_logits,
        req_to_token,
        req_pool_indices,
        seq_lens,
        scaling,
        logit_cap,
        is_cross,
        sliding_window,
        encoder_lens,
        sinks,
    )


def _decode_0_5_1(*args) -> None:
    _decode_0_5_13(*args, False, -1, None, None)


_EXT_HEAD = (
    "extend_attention_cpu(Tensor q, Tensor? k, Tensor? v, Tensor(a!) o, Tensor k_buffer, Tensor v_buffer, "
    "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, "
    "Tensor extend_start_loc, int max_len_extend, float scaling, float logit_cap"
)
_DEC_HEAD = (
    "decode_attention_cpu(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor(c!) o, Tensor? key, "
    "Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, Tensor req_pool_indices, "
    "Tensor seq_lens, float scaling, float logit_cap"
)
_NEW_ARGS = ", bool is_cross, int sliding_window, Tensor? encoder_lens, Tensor? sinks"
_DEC_0_5_13 = (_DEC_HEAD + _NEW_ARGS + ") -> ()", _decode_0_5_13)
# (first release, {op: (schema, function)}), newest first
ATTENTION_ABIS = [
    ((0, 5, 20), _ATTENTION_SCHEMAS),
    (
        (0, 5, 19),
        {
            "extend_attention_cpu": (
                _EXT_HEAD + _NEW_ARGS + ", Tensor? custom_mask, bool is_causal) -> ()",
                _extend_0_5_19,
            ),
            "decode_attention_cpu": _DEC_0_5_13,
        },
    ),
    (
        (0, 5, 16),
        {
            "extend_attention_cpu": (_EXT_HEAD + _NEW_ARGS + ", Tensor? custom_mask) -> ()", _extend_0_5_16),
            "decode_attention_cpu": _DEC_0_5_13,
        },
    ),
    (
        (0, 5, 13),
        {
            "extend_attention_cpu": (_EXT_HEAD + _NEW_ARGS + ") -> ()", _extend_0_5_13),
            "decode_attention_cpu": _DEC_0_5_13,
        },
    ),
    (
        (0,),
        {
            "extend_attention_cpu": (_EXT_HEAD + ") -> ()", _extend_0_5_1),
            "decode_attention_cpu": (_DEC_HEAD + ") -> ()", _decode_0_5_1),
        },
    ),
]


def release(version: str) -> tuple[int, ...]:
    """'0.5.12.post1' -> (0, 5, 12, 1): comparable with the tuples above."""
    import re

    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0]))


def installed_sglang() -> str | None:
    """The installed SGLang's version, from its distribution metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def attention_schemas(version: str | None = None) -> dict:
    """The attention ops' schemas and implementations for an SGLang release (None: the newest form)."""
    if version is None:
        return _ATTENTION_SCHEMAS
    v = release(version)
    return next(table for first, table in ATTENTION_ABIS if v >= first)


def register_torch_ops(version: str | None = None) -> None:
    """Register the attention ops as torch.ops.sgl_kernel.* (SGLang looks them up there), in the
    call signature of the installed SGLang (`version`, default: read from its metadata).
    Idempotent: an op that already exists (a real kernel, or an earlier call) is left alone."""
    schemas = attention_schemas(version or installed_sglang())
    missing = {n: s for n, s in schemas.items() if not hasattr(torch.ops.sgl_kernel, n)}
    if not missing:
        return
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, (schema, fn) in missing.items():
        lib.define(schema)
        lib.impl(name, fn, "CompositeExplicitAutograd")
    _libraries.append(lib)


def register_torchvision_nms_schema() -> bool:
    """PyPI torchvision wheels link CUDA torch; beside the CPU wheel `import torchvision` dies
    with "operator torchvision::nms does not exist" while registering fake kernels. Defining
    the schema (no kernel: calling it still fails) lets it import. Returns True if defined here."""
    try:
        torch.ops.torchvision.nms  # noqa: B018  (raises when the schema is missing)
        return False
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _libraries.append(lib)
    return True


PYTHON_OPS = [
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_draft_decode_metadata_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
]
TORCH_OPS = list(_ATTENTION_SCHEMAS)
