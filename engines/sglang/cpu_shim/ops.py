"""Plain-torch versions of the `sgl_kernel` CPU ops SGLang 0.5.23's EAGLE-3 path calls.

SGLang's CPU backend expects a compiled `sgl_kernel` (an AMX Xeon build). These functions
do the same work with plain tensor ops, slowly and without AMX, so SGLang's real Python
wiring (scheduler, KV cache, EAGLE-3 worker, tree build and verify) runs on any CPU.
Only the kernels are replaced; everything the harness checks is SGLang's own code.

Signatures follow SGLang's call sites (argument names as SGLang spells them). Every op
here has a unit test against a direct torch computation (tests/test_sglang_shim.py).
The two tree ops delegate to SGLang's own Triton kernels, run by Triton's interpreter
(TRITON_INTERPRET=1, set by `engines.sglang.cpu_shim.activate`).
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


def build_tree_kernel_efficient_cpu(*args) -> None:
    _spec_tree().sgl_build_tree_kernel_triton(*args)


def verify_tree_greedy_cpu(**kw) -> None:
    _spec_tree().verify_tree_greedy_triton(
        predicts=kw["predicts"],
        accept_index=kw["accept_index"],
        accept_token_num=kw["accept_token_num"],
        candidates=kw["candidates"],
        retrieve_index=kw["retrive_index"],  # (sic: SGLang's kernel spells it retrive)
        retrieve_next_token=kw["retrive_next_token"],
        retrieve_next_sibling=kw["retrive_next_sibling"],
        target_predict=kw["target_predict"],
    )


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


def decode_attention_cpu(q, k_buffer, v_buffer, k_scale, v_scale, o, key, value, loc, attn_logits, req_to_token,
                         req_pool_indices, seq_lens, scaling, logit_cap, is_cross, sliding_window, encoder_lens, sinks) -> None:  # fmt: skip
    """One new token per request: store its k/v at `loc`, attend over the request's cached tokens."""
    if key is not None:
        k_buffer[loc] = key.to(k_buffer.dtype)
        v_buffer[loc] = value.to(v_buffer.dtype)
    for b in range(q.shape[0]):
        slots = req_to_token[int(req_pool_indices[b]), : int(seq_lens[b])].long()
        o[b] = attend(q[b : b + 1], k_buffer[slots], v_buffer[slots], scaling)[0].to(o.dtype)


def extend_attention_cpu(q, k, v, o, k_buffer, v_buffer, k_scale, v_scale, req_to_token, req_pool_indices, seq_lens,
                         extend_seq_lens, extend_start_loc, max_len_extend, scaling, logit_cap, is_cross, sliding_window,
                         encoder_lens, sinks, custom_mask, is_causal) -> None:  # fmt: skip
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


def _extend_0_5_19(q, k, v, o, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, extend_seq_lens,
                   extend_start_loc, max_len_extend, scaling, logit_cap, is_cross, sliding_window, encoder_lens,
                   sinks, custom_mask, is_causal) -> None:  # fmt: skip
    extend_attention_cpu(q, k, v, o, k_buffer, v_buffer, 1.0, 1.0, req_to_token, req_pool_indices, seq_lens,
                         extend_seq_lens, extend_start_loc, max_len_extend, scaling, logit_cap, is_cross,
                         sliding_window, encoder_lens, sinks, custom_mask, is_causal)  # fmt: skip


def _extend_0_5_16(*args) -> None:
    _extend_0_5_19(*args, True)


def _extend_0_5_13(*args) -> None:
    _extend_0_5_19(*args, None, True)


def _extend_0_5_1(*args) -> None:
    _extend_0_5_19(*args, False, -1, None, None, None, True)


def _decode_0_5_13(q, k_buffer, v_buffer, o, key, value, loc, attn_logits, req_to_token, req_pool_indices, seq_lens,
                   scaling, logit_cap, is_cross, sliding_window, encoder_lens, sinks) -> None:  # fmt: skip
    decode_attention_cpu(q, k_buffer, v_buffer, 1.0, 1.0, o, key, value, loc, attn_logits, req_to_token,
                         req_pool_indices, seq_lens, scaling, logit_cap, is_cross, sliding_window, encoder_lens, sinks)  # fmt: skip


def _decode_0_5_1(*args) -> None:
    _decode_0_5_13(*args, False, -1, None, None)


_EXT_HEAD = ("extend_attention_cpu(Tensor q, Tensor? k, Tensor? v, Tensor(a!) o, Tensor k_buffer, Tensor v_buffer, "
             "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, "
             "Tensor extend_start_loc, int max_len_extend, float scaling, float logit_cap")  # fmt: skip
_DEC_HEAD = ("decode_attention_cpu(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor(c!) o, Tensor? key, "
             "Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, Tensor req_pool_indices, "
             "Tensor seq_lens, float scaling, float logit_cap")  # fmt: skip
_NEW_ARGS = ", bool is_cross, int sliding_window, Tensor? encoder_lens, Tensor? sinks"
_DEC_0_5_13 = (_DEC_HEAD + _NEW_ARGS + ") -> ()", _decode_0_5_13)
# (first release, {op: (schema, function)}), newest first
ATTENTION_ABIS = [
    ((0, 5, 20), _ATTENTION_SCHEMAS),
    ((0, 5, 19), {"extend_attention_cpu": (_EXT_HEAD + _NEW_ARGS + ", Tensor? custom_mask, bool is_causal) -> ()", _extend_0_5_19),
                  "decode_attention_cpu": _DEC_0_5_13}),
    ((0, 5, 16), {"extend_attention_cpu": (_EXT_HEAD + _NEW_ARGS + ", Tensor? custom_mask) -> ()", _extend_0_5_16),
                  "decode_attention_cpu": _DEC_0_5_13}),
    ((0, 5, 13), {"extend_attention_cpu": (_EXT_HEAD + _NEW_ARGS + ") -> ()", _extend_0_5_13),
                  "decode_attention_cpu": _DEC_0_5_13}),
    ((0,), {"extend_attention_cpu": (_EXT_HEAD + ") -> ()", _extend_0_5_1),
            "decode_attention_cpu": (_DEC_HEAD + ") -> ()", _decode_0_5_1)}),
]  # fmt: skip


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
