"""Paged decode attention: one query row per sequence over its cached K/V, GQA, with the output gate
(`out * sigmoid(gate)`) fused. The cache may be BF16/FP16/FP32 or FP8 E4M3 with optional fp32 scales
per token and KV head (DESIGN 3: K = k_cache * k_scale[..., None], same for V; no scales = unit scales).

Triton provider: one program per (sequence, KV head, context split) holds the whole GQA group of q heads,
so each K/V tile is read once per group. It walks its share of the context in tiles of BLOCK_N tokens,
looking up each token's block in the block table (so any block_size works, and a tile may span blocks),
and keeps an online softmax in fp32. With one split it normalizes, gates and stores directly; with
several (flash-decoding, for long contexts and few sequences) each split stores its unnormalized
(acc, max, sum) and a second kernel combines them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mtpfactory.errors import InputError
from mtpfactory.ops import (FLOATS, Op, broadcasts_to, cdiv, check_indices, next_power_of_2, number_refusal,
                            out_or_empty, out_refusal, overlap_refusal, sm_count, write_out)

_KV_DTYPES = (*FLOATS, torch.float8_e4m3fn)
_INTS = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _shape_refusal(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, gate: torch.Tensor | None, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None) -> InputError | None:
    """Why no provider can attend with these shapes, or None (the reference's part of
    `paged_decode_attention_refusal`): q a floating-point [B, q_heads, D]; k_cache [blocks, block_size >= 1,
    kv_heads >= 1, D], q_heads a multiple of kv_heads; v_cache and the scales ([blocks, block_size, kv_heads]) of
    k_cache's block_size and kv_heads (and D); block_tables [B, max_blocks] and context_lens [B] of integers (the
    reference reads the first B rows of longer ones); gate broadcast to q's shape. Caches and scales may differ in
    their count of blocks: the reference checks the block ids against the fewest."""
    if q.dim() != 3 or not q.dtype.is_floating_point:
        return InputError("q", f"{q.dtype} {list(q.shape)}", "a [B, q_heads, D] tensor of floating point, one query "
                          "row a sequence", "view the heads as [B, q_heads, D], in the attention's dtype")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
            return InputError(name, f"{t.dtype} {list(t.shape)}", "integers, int32 or int64 (bool would be read as "
                              "ids and counts 0 and 1, floats cut to integers)", f"pass {name} as int32 or int64")
    b, hq, d = q.shape
    if k_cache.dim() != 4 or k_cache.shape[1] == 0 or k_cache.shape[2] == 0 or k_cache.shape[3] != d:
        return InputError("k_cache", f"{k_cache.dtype} {list(k_cache.shape)}",
                          f"a [blocks, block_size >= 1, kv_heads >= 1, D] tensor of q's head_dim D = {d} "
                          f"(q {list(q.shape)})", "pass the K cache of q's attention layer")
    if hq % k_cache.shape[2]:
        return InputError("q", f"{q.dtype} {list(q.shape)}",
                          f"q_heads a multiple of the cache's kv_heads = {k_cache.shape[2]} (GQA: each KV head "
                          "serves a group of q heads)", "pass the q heads of the cache's attention layer")
    for name, t, want in (("v_cache", v_cache, k_cache.shape[1:]), ("k_scale", k_scale, k_cache.shape[1:3]),
                          ("v_scale", v_scale, k_cache.shape[1:3])):
        if t is not None and (t.dim() != len(want) + 1 or t.shape[1:] != want):
            what = "[blocks, block_size, kv_heads, D]" if name == "v_cache" else "[blocks, block_size, kv_heads]"
            return InputError(name, f"{t.dtype} {list(t.shape)}",
                              f"a {what} tensor of k_cache's {list(want)} (k_cache {list(k_cache.shape)})",
                              "pass the V cache of this K cache" if name == "v_cache" else
                              f"pass the cache's {name} (PagedKVCache's), or None for unit scales")
    if block_tables.dim() != 2 or block_tables.shape[0] < b:
        return InputError("block_tables", f"{block_tables.dtype} {list(block_tables.shape)}",
                          f"a [B, max_blocks] tensor, a row of block ids a sequence of q's B = {b}",
                          "pass a row of block ids for each sequence")
    if context_lens.dim() != 1 or context_lens.shape[0] < b:
        return InputError("context_lens", f"{context_lens.dtype} {list(context_lens.shape)}",
                          f"a [B] tensor, a token count a sequence of q's B = {b}",
                          "pass each sequence's count of tokens to attend")
    if gate is not None and not broadcasts_to(gate.shape, q.shape):
        return InputError("gate", f"{gate.dtype} {list(gate.shape)}",
                          f"q's shape {list(q.shape)}, or one that broadcasts to it",
                          "pass the gate of q's heads (the second half of the fused q|gate projection)")
    return None


def _paged_decode_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                   gate: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                                   v_scale: torch.Tensor | None = None, *,
                                   out: torch.Tensor | None = None) -> torch.Tensor:
    """q, gate: [B, q_heads, D] (gate in any float dtype); k_cache, v_cache: [blocks, block_size, kv_heads, D]
    (float or FP8 E4M3); k_scale, v_scale: fp32 [blocks, block_size, kv_heads] or None (unit scales);
    block_tables: [B, max_blocks] int (a row's blocks in order, ids in [0, blocks)); context_lens: [B] int
    (tokens to attend, from 0 to max_blocks * block_size).

    Softmax in fp32; returns [B, q_heads, D] in q's dtype (a row with no context gives zeros), written into
    `out` when given. Shapes as `_shape_refusal` says."""
    if err := _contract(q, k_cache, v_cache, block_tables, context_lens, scale, gate, k_scale, v_scale, out=out):
        raise err
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1:3]
    nb = min(t.shape[0] for t in (k_cache, v_cache, k_scale, v_scale) if t is not None)
    check_indices("context_lens", context_lens, 0, block_tables.shape[1] * bs + 1,
                  f"token counts that {block_tables.shape[1]} blocks of {bs} hold",
                  "widen block_tables to cover every sequence's context")
    y = torch.empty_like(q)
    for i in range(b):
        n = int(context_lens[i])
        blocks = block_tables[i, : (n + bs - 1) // bs].long()
        check_indices(f"block_tables[{i}]", blocks, 0, nb, f"the ids of the blocks row {i}'s {n} tokens use",
                      f"point them at blocks of this {nb}-block cache")
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].float()  # [n, kv_heads, D]
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].float()
        if k_scale is not None:
            k = k * k_scale[blocks].reshape(-1, hkv)[:n, :, None]
        if v_scale is not None:
            v = v * v_scale[blocks].reshape(-1, hkv)[:n, :, None]
        k = k.repeat_interleave(hq // hkv, dim=1)  # [n, q_heads, D]
        v = v.repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale  # [q_heads, n]
        y[i] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    if gate is not None:
        y = (y * torch.sigmoid(gate)).to(q.dtype)  # a gate of a wider dtype would promote the product
    return write_out(out, y)


# --- Triton -------------------------------------------------------------------------------------------

@triton.jit
def _store_out(acc, l_i, out_ptr, gate_ptr, pid_b, q_heads, d, row_mask, d_mask,
               s_ob, s_oh, s_od, s_gb, s_gh, s_gd, HAS_GATE: tl.constexpr):
    """out[b, q_heads, :] = acc / l (0 where l == 0), times sigmoid(gate); in out's dtype."""
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [G_PAD, D_PAD]
    mask = row_mask[:, None] & d_mask[None, :]
    if HAS_GATE:
        g = tl.load(gate_ptr + pid_b * s_gb + q_heads[:, None] * s_gh + d[None, :] * s_gd, mask=mask,
                    other=0.0).to(tl.float32)
        o = o * tl.sigmoid(g)
    tl.store(out_ptr + pid_b * s_ob + q_heads[:, None] * s_oh + d[None, :] * s_od,
             o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp16_top_binade(amax):
    """(2^j, 2^-j) for each element of amax (>= 0): x * 2^j puts a row whose largest |x| is amax into
    [2^14, 2^15), fp16's top binade (exactly: a power of two), so that it neither overflows fp16 nor sinks
    into its subnormals. j is held within [-126, 126], both powers normal fp32 (amax 0 or subnormal takes
    2^126, inf or NaN 2^-114)."""
    top = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # the biased exponent
    j = tl.minimum(tl.maximum(141 - top, -126), 126)  # 14 - (top - 127)
    return ((j + 127) << 23).to(tl.float32, bitcast=True), ((127 - j) << 23).to(tl.float32, bitcast=True)


# Triton compiles a kernel once for each constexpr value and for each integer argument that is 1 or a multiple of
# 16 (unless `do_not_specialize` names it). As a sequence grows its split count grows (one more every 64 tokens at
# one sequence) and its block table widens: with the count a constexpr and the table's row stride specialized,
# one sequence's first 1024 tokens compiled 16 variants of this kernel on an H100 (BENCHMARKS, thirty-first run,
# HG; 0.1-0.5 s each, in the middle of decoding). It needs of the count only whether there are several (SPLIT)
# and the grid's size. `max_tokens` and `split_len` stay specialized: multiples of 16 at every length (a block
# size of 16, tiles of 16 or 32), they add no variant. The reduce takes its count at run time too
# (`_paged_decode_reduce_kernel`).
@triton.jit(do_not_specialize=("s_btb",))
def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, gate_ptr, bt_ptr, cl_ptr, out_ptr,
        pacc_ptr, pm_ptr, pl_ptr,  # split partials: [B, kv_heads, S, G_PAD, D_PAD], [B, kv_heads, S, G_PAD] x2
        scale_log2e, num_blocks, max_tokens, split_len,
        s_qb, s_qh, s_qd, s_kb, s_kt, s_kh, s_kd, s_vb, s_vt, s_vh, s_vd,
        s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh, s_gb, s_gh, s_gd, s_ob, s_oh, s_od, s_btb, s_btn,
        GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_K_SCALE: tl.constexpr,
        HAS_V_SCALE: tl.constexpr, HAS_GATE: tl.constexpr, DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr, Q_POW2: tl.constexpr, P_POW2: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)  # KV head
    pid_s = tl.program_id(2)  # context split (SPLIT: more than one, the grid's third dim)
    # Clamped to what the block table holds, and a block id outside [0, num_blocks) masks its tokens: the
    # reference refuses both (a sync); here they read nothing out of bounds. Clamped in int64 (an int64 length
    # may not fit int32), then counted in int32 (tables of at most 2^30 tokens): a tile's positions, blocks and
    # offsets in int64 cost 20-60 instructions of a loop of 400-900 (compiled for sm_90).
    n = tl.minimum(tl.maximum(tl.load(cl_ptr + pid_b).to(tl.int64), 0), max_tokens).to(tl.int32)
    start = pid_s * split_len
    end = tl.minimum(start + split_len, n)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_heads = pid_h * GROUP + g  # q head j reads KV head j // GROUP
    q = tl.load(q_ptr + pid_b * s_qb + q_heads[:, None] * s_qh + d[None, :] * s_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [G_PAD, D_PAD]
    rows = tl.full([G_PAD], 1.0, tl.float32) * scale_log2e  # what each q row's scores are multiplied by
    if Q_POW2:
        # fp16 dots on a bf16 q: each row in fp16's top binade, its scores scaled back. q stays exact (bf16's 8
        # bits fit fp16's 11 down to 2^-31 of the row's largest element) and cannot overflow.
        q_up, q_down = _fp16_top_binade(tl.max(tl.abs(q), axis=1))
        q = q * q_up[:, None]
        rows = rows * q_down
    q = q.to(DOT_DTYPE)

    # The max starts at -inf (a finite stand-in would swallow rows whose scores all lie below it) and the
    # exponents subtract m_safe, 0 while the max is still -inf: every exp2 then sees -inf (0), never
    # -inf - -inf (NaN), so a split or tile with no token adds nothing.
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)  # running max of the log2-scaled scores
    l_i = tl.zeros([G_PAD], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)  # token positions in the sequence
        # the cache's block size a constant: a token's block and offset by shifts (a power of two) or by
        # constant division, where a run-time size cost a division sequence an element every tile
        blk = tl.load(bt_ptr + pid_b * s_btb + (t // BLOCK_SIZE) * s_btn, mask=t < end, other=0).to(tl.int64)
        t_mask = (t < end) & (blk >= 0) & (blk < num_blocks)
        off = t % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (blk * s_kb + off * s_kt + pid_h * s_kh)[:, None] + d[None, :] * s_kd,
                    mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_N, D_PAD]
        # The scale is factored out of the dot: q and K stay exact in the dot's dtype when they come
        # from 16-bit or FP8 values, so the products are exact and only the fp32 accumulation rounds.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * rows[:, None]  # [G_PAD, BLOCK_N]
        if HAS_K_SCALE:
            s = s * tl.load(ks_ptr + blk * s_ksb + off * s_kst + pid_h * s_ksh, mask=t_mask, other=0.0)[None, :]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # masked tokens: 0
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (blk * s_vb + off * s_vt + pid_h * s_vh)[:, None] + d[None, :] * s_vd,
                    mask=kv_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_N, D_PAD]
        if HAS_V_SCALE:
            p = p * tl.load(vs_ptr + blk * s_vsb + off * s_vst + pid_h * s_vsh, mask=t_mask, other=0.0)[None, :]
        if P_POW2:
            # fp16 dots on p times V's scales, which may lie anywhere in fp32's range: each row of the tile in
            # fp16's top binade, the dot's rows scaled back (exact: powers of two). A term sinks into fp16's
            # subnormals only 2^-28 below its row's largest in the tile.
            p_up, p_down = _fp16_top_binade(tl.max(tl.abs(p), axis=1))
            p = p * p_up[:, None]
        pv = tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)  # [G_PAD, D_PAD]
        if P_POW2:
            pv = pv * p_down[:, None]
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if not SPLIT:
        _store_out(acc, l_i, out_ptr, gate_ptr, pid_b, q_heads, d, g_mask, d_mask,
                   s_ob, s_oh, s_od, s_gb, s_gh, s_gd, HAS_GATE)
    else:
        # the split's partial row: its q heads and dims only (the padded lanes, which no one reads, stay unwritten)
        row = (pid_b * tl.num_programs(1) + pid_h) * tl.num_programs(2) + pid_s
        tl.store(pacc_ptr + row * G_PAD * D_PAD + g[:, None] * D_PAD + d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(pm_ptr + row * G_PAD + g, m_i, mask=g_mask)
        tl.store(pl_ptr + row * G_PAD + g, l_i, mask=g_mask)


@triton.jit
def _reduce_chunk(m_i, l_i, acc, pacc_ptr, pm_ptr, pl_ptr, row0, s0, num_splits, g, d, g_mask, d_mask,
                  G_PAD: tl.constexpr, D_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Fold splits s0 .. s0 + CHUNK - 1 of one (sequence, KV head) into the running (max, sum, acc), loaded
    together."""
    s = s0 + tl.arange(0, CHUNK)
    # splits past the last and padded lanes (never written) read as empty splits: max -inf, sum 0, acc 0
    sg_mask = (s < num_splits)[:, None] & g_mask[None, :]  # [CHUNK, G_PAD]
    sg = (row0 + s)[:, None] * G_PAD + g[None, :]
    m_s = tl.load(pm_ptr + sg, mask=sg_mask, other=float("-inf"))
    l_s = tl.load(pl_ptr + sg, mask=sg_mask, other=0.0)
    a_s = tl.load(pacc_ptr + sg[:, :, None] * D_PAD + d[None, None, :],
                  mask=sg_mask[:, :, None] & d_mask[None, None, :], other=0.0)  # [CHUNK, G_PAD, BLOCK_D]
    m_new = tl.maximum(m_i, tl.max(m_s, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    beta = tl.exp2(m_s - m_safe[None, :])  # an empty split (m_s = -inf, l_s = 0, acc 0) adds nothing
    l_i = l_i * alpha + tl.sum(l_s * beta, axis=0)
    acc = acc * alpha[:, None] + tl.sum(a_s * beta[:, :, None], axis=0)
    return m_new, l_i, acc


# The split count is a run-time argument (not specialized: a count that is 1 or a multiple of 16 would compile its
# own variant), so a growing sequence compiles one variant for each CHUNK, a power of two. Where one chunk holds
# every split (every default count: at most 64) it is folded without a loop: a loop over a run-time count, though
# it ran once, cost 1.3 us at one sequence on an H100 (BENCHMARKS, thirty-first run, HG); this form runs at the
# constexpr count's speed, 4 variants over one sequence's first 1024 tokens against 15 (thirty-second run).
@triton.jit(do_not_specialize=("num_splits",))
def _paged_decode_reduce_kernel(
        pacc_ptr, pm_ptr, pl_ptr, gate_ptr, out_ptr, num_splits,
        s_gb, s_gh, s_gd, s_ob, s_oh, s_od,
        GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, LOOP: tl.constexpr, HAS_GATE: tl.constexpr):
    """Combine the splits' (acc, max, sum) of one (sequence, KV head) over BLOCK_D of its dims and store the
    gated output: programs over the dims too, so that few sequences with many splits still spread. CHUNK
    splits a step, loaded together: with one split a step, the loop (compiled for sm_90) used each load right
    after issuing it, so every split waited a load's latency (hundreds of ns from L2) in turn. LOOP: more
    splits than one chunk."""
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    g = tl.arange(0, G_PAD)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)  # guarded as in _paged_decode_kernel
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    row0 = (pid_b * tl.num_programs(1) + pid_h) * num_splits
    if LOOP:
        for s0 in range(0, num_splits, CHUNK):
            m_i, l_i, acc = _reduce_chunk(m_i, l_i, acc, pacc_ptr, pm_ptr, pl_ptr, row0, s0, num_splits, g, d,
                                          g_mask, d_mask, G_PAD, D_PAD, CHUNK)
    else:
        m_i, l_i, acc = _reduce_chunk(m_i, l_i, acc, pacc_ptr, pm_ptr, pl_ptr, row0, 0, num_splits, g, d,
                                      g_mask, d_mask, G_PAD, D_PAD, CHUNK)
    _store_out(acc, l_i, out_ptr, gate_ptr, pid_b, pid_h * GROUP + g, d, g_mask, d_mask,
               s_ob, s_oh, s_od, s_gb, s_gh, s_gd, HAS_GATE)


def _split_len(max_tokens: int, splits: int, block_n: int) -> int:
    """Tokens a split: `splits` asked for, rounded up to whole tiles (so the count run, `cdiv(max_tokens,
    split_len)`, may be fewer: no split left empty for every row)."""
    return cdiv(cdiv(max_tokens, splits), block_n) * block_n


# The tiles (G_PAD, D_PAD, block_n, num_warps) an FP8 cache's wave rule was timed and its `_fp8_held` counts read
# at: Qwen3-Next's 16 / 2 heads x 256 and Qwen3.5's 16 / 4 compile to them at the defaults
_WAVE_TILES = (16, 256, 32, 4)


_BF16_HELD = 3           # programs an SM holds of the 16-bit kernel at _WAVE_TILES, tf32 dots, 3 stages (156 regs)
_MIN_SPLIT_TOKENS = 256  # the shortest split the 16-bit rounding down takes (192 was 1.07x slower: 8 x 4096)
_MIN_SPLIT_LEN = 64      # the shortest split any default takes, in tokens (128 was up to 1.26x slower, few sequences)
_MAX_DEFAULT_SPLITS = 64  # the most splits a default takes
_BUSY_WAVE = 0.8         # the fill from which a wave of the 16-bit kernel runs at the copy rate (`_bf16_wave_splits`)
_WAVE_SPLITS = 7         # the most splits `_bf16_wave_splits` weighs (8 was the fastest at none of 11 shapes)


def _bf16_wave_splits(held: int, programs: int, max_tokens: int, block_n: int) -> int:
    """Splits for the heads' 16-bit kernel where its SMs' `held` places take fewer than two splits of `programs`
    (sequences x KV heads): of 1 to `_WAVE_SPLITS` splits (each at least `_MIN_SPLIT_TOKENS` long), the fewest of
    those whose waves take least time, a wave taking its split's length times its programs, or times
    `_BUSY_WAVE` x `held` where fewer: a wave that full streams the cache as fast as a full one (the H100's one
    split of 160 sequences, 81% of a wave, 488.71 us, against 7 splits' six waves 94% full, 490.19), and one
    less full still takes that long (on the H200, one split of 128 sequences, 65% of a wave, 1.12x slower than 3
    splits' two waves 97% full). Timed on the H100 at 100 to 320 sequences of 4096 tokens and 100 to 136 of
    16384, and on the H200 at 128 and 192 of 4096 (BENCHMARKS.md's twenty-sixth and twenty-seventh runs): at 17
    of the 19 shapes whose pick was timed it was the fastest split count timed, at the other two 1.003x and
    1.014x slower than it. The cap of 7 was set after that sweep: with a cap of 8, 118 and 320 sequences of 4096
    took 8 splits, 1.03x and 1.05x slower than the fastest."""
    busy = int(_BUSY_WAVE * held)

    def cost(splits: int) -> int:
        length = _split_len(max_tokens, splits, block_n)
        full, last = divmod(programs * cdiv(max_tokens, length), held)
        return length * (full * held + (max(last, busy) if last else 0))

    fits = [s for s in range(2, _WAVE_SPLITS + 1) if _split_len(max_tokens, s, block_n) >= _MIN_SPLIT_TOKENS]
    return min([1, *fits], key=lambda s: (cost(s), s))


def _fp8_held(stages: int) -> int:
    """Programs an SM holds of the FP8 kernel at `_WAVE_TILES`, by pipeline depth: 3 at one stage, 2 at three.
    Read off the H100 sweeps' waves (BENCHMARKS.md's twenty-third run) and what the sm_90 cubins allow
    (`compile_sm90.py --stats`): 168 registers a thread at one stage, so 3 programs of 4 warps in an SM's 64K,
    214 (216 with per-token scales) at three, so 2; shared memory (16-26 KB) binds neither."""
    return 3 if stages == 1 else 2


@functools.lru_cache(maxsize=1024)   # its arguments repeat from step to step; the wave rule costs 11 us
def _default_tuning(sms: int, programs: int, max_tokens: int, block_n: int, fp8: bool, num_splits: int | None,
                    num_stages: int | None, tiles: tuple[int, int, int, int] = _WAVE_TILES, *,
                    unit_scales: bool = False, tf32_16bit: bool = False) -> tuple[int, int]:
    """(splits asked for, stages) where the caller left num_splits or num_stages None, for `programs` (sequences
    x KV heads) a split on `sms` SMs (0, the CPU: 1 split, 3 stages, which the interpreter ignores) and the
    kernel's `tiles` (G_PAD, D_PAD, block_n, num_warps). A split is at least `_MIN_SPLIT_LEN` (64) tokens long,
    and there are at most 64. On an H100 (BENCHMARKS.md's twenty-ninth run, the reduce at 8 dims a program), at 64
    tokens 1 to 4 sequences of 2048 tokens ran 1.06-1.26x faster than at 128 and 1 to 2 of 4096 1.06-1.17x; 6 of
    2048 and 3 to 4 of 4096 within 2% (no slower); from there the splits are the same.

    A 16-bit or fp32 cache: Triton's 3 stages, the splits rounded up to two programs an SM (rounded down to two was
    2-10% slower from 24 sequences). At `_WAVE_TILES` with a 16-bit q and cache and tf32 dots (`tf32_16bit`, the
    heads' BF16 kernel: 156 registers, so 3 programs an SM), rounded down to those 3 where a split keeps at least
    `_MIN_SPLIT_TOKENS` and there are still 2 splits: on the H100 sweeps of 2 to 96 sequences of 4096 and 16384
    tokens, of the 8 timed cases where that rule and the one before differ, 6 were faster (by up to 1.11x), one a
    tie and one 2% slower (4 sequences of 16384); 8 sequences of 4096, whose splits would be 192 tokens, were 1.07x
    slower rounded down (BENCHMARKS.md's twenty-fourth and twenty-fifth runs). On the H200 (twenty-sixth run) its
    picks at 3 to 96 and 192 sequences were the fastest split count timed. Where those 3 places an SM hold fewer
    than two splits of the programs (from 100 sequences at 2 KV heads on 132 SMs), `_bf16_wave_splits` weighs
    the waves of 1 to 7 splits. Rounded up to two programs an SM as before, 100 to 131 sequences took 2 splits
    and more took one, leaving a last wave 1-65% full: at the 15 shapes of 100 to 320 sequences where the two
    differ and both were timed, that was 1.04-1.36x slower on the H100 and 1.09x on the H200.

    An FP8 cache at `_WAVE_TILES`, whose SMs hold 3 programs at one stage and 2 at three (`_fp8_held`): at each
    depth, the splits rounded down to what its SMs hold; of the two, the grid that fills its last wave best, then
    the one of fewer waves, then 3 stages with per-token scales and one stage with `unit_scales` (of the 8 such
    ties timed, one stage was the faster in 6, by up to 5%, and 0.2-0.6% slower in 2; with per-token scales 3
    stages were 1-3% faster). On the H100 sweeps (1 to 320 sequences of 2048, 4096 and 16384 tokens; 46 cases
    whose pick was timed) the picks were within 5% of the fastest tuning timed in each (geometric mean 1.005x
    before the unit-scale tie-break); the default before (one stage, rounded up) 1.14x, up to 1.43x
    (BENCHMARKS.md's twenty-third and twenty-fourth runs). An FP8 cache at other tiles keeps that default before:
    its SMs hold other counts (sm_90 cubins: D 128 4 and 3, D 64 7 and 5, D 512 2 and 2), and no tuning was
    timed there."""
    if not sms:
        return num_splits or 1, num_stages or _TRITON_STAGES

    def splits_at(held: int, down: bool) -> int:
        if num_splits:
            return num_splits
        want = held // programs if down else -(-held // programs)
        return max(1, min(want, max_tokens // max(_MIN_SPLIT_LEN, block_n), _MAX_DEFAULT_SPLITS))

    if tf32_16bit and tiles == _WAVE_TILES and num_stages in (None, _TRITON_STAGES):
        down = splits_at(_BF16_HELD * sms, True)
        if down > 1 and _split_len(max_tokens, down, block_n) >= _MIN_SPLIT_TOKENS:
            return down, _TRITON_STAGES
        if not num_splits and 2 * programs > _BF16_HELD * sms:
            return _bf16_wave_splits(_BF16_HELD * sms, programs, max_tokens, block_n), _TRITON_STAGES
    if not fp8 or tiles != _WAVE_TILES:
        return splits_at(2 * sms, False), num_stages or (1 if fp8 else _TRITON_STAGES)

    def fill(stages: int) -> tuple[float, int]:
        held = _fp8_held(stages) * sms
        grid = programs * cdiv(max_tokens, _split_len(max_tokens, splits_at(held, True), block_n))
        waves = cdiv(grid, held)
        return grid / (waves * held), -waves  # equal fractions divide to equal floats (IEEE rounding)

    order = (1, _TRITON_STAGES) if unit_scales else (_TRITON_STAGES, 1)   # a tie keeps the first
    stages = num_stages or max(order, key=fill)
    return splits_at(_fp8_held(stages) * sms, True), stages


def _default_block_n(k_cache: torch.Tensor, d_pad: int) -> int:
    """Tokens a tile where the caller left block_n None: 32 (H100 sweep, 2026-12-05: tiles of 16 took 1.2-1.4x as
    long), or 16 where a [32, D] tile of the cache passes 32 KiB: fp32 at D 512, whose ring of K and V tiles then
    passes the 227 KB of shared memory a block (the GPU cannot load the kernel; at 16 it runs)."""
    return 32 if 32 * d_pad * k_cache.element_size() <= _TILE_BYTES else 16


def _dot_dtype(q: torch.Tensor, k_cache: torch.Tensor, fast_dot: bool) -> tl.dtype:
    """The dots' operand dtype. fp32 by default: "ieee" when q or the cache is fp32, tf32 otherwise (exact
    products for 16-bit and FP8 values, p rounded to 10 mantissa bits). With `fast_dot`: fp16 for an FP8
    cache, whose values fp16 holds exactly (one conversion a pair; q's rows and V's scales are brought into
    its range by the kernel), so the numerics stay tf32's; q's dtype for a cache of q's 16-bit dtype (p
    rounded to it), on the GPU only: the interpreter's bf16 dots are wrong, and a CPU call keeps fp32."""
    if not fast_dot or torch.float32 in (q.dtype, k_cache.dtype):
        return tl.float32
    if k_cache.dtype == torch.float8_e4m3fn:
        return tl.float16
    if k_cache.dtype == q.dtype and (q.is_cuda or q.dtype == torch.float16):
        return _TL_DTYPES[q.dtype]
    return tl.float32


_MAX_BLOCK = tl.TRITON_MAX_TENSOR_NUMEL    # the most elements of one tile
_TILE_BYTES = 32 * 1024                     # the most bytes of a default [block_n, D] tile of K (`_default_block_n`)
_MAX_SEQS = 2**31 - 1                      # grid axis 0 (sequences)
_MAX_PROGRAMS = 65535                      # grid axes 1 (KV heads) and 2 (context splits)
_MAX_D = 512
_MAX_TOKENS = 2**30                        # a block table's tokens: positions and split ends stay in int32
_WARPS = (1, 2, 4, 8, 16, 32)
_MAX_STAGES = 8
_TRITON_STAGES = 3                          # Triton's default num_stages on NVIDIA GPUs
_REDUCE_BLOCK_D = 8    # a reduce program's dims: D 256 gives 32 programs a (sequence, KV head); 32: 1.03-1.16x slower
_REDUCE_TILE = 8192                        # a reduce step's [splits, G_PAD, dims] at most: 64 fp32 a thread (4 warps)


def _pads(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int]:
    """(G_PAD, D_PAD): a group's q heads and a head's dims, each a power of two of at least 16 (tl.dot)."""
    return (max(16, next_power_of_2(q.shape[1] // k_cache.shape[2])),
            max(16, next_power_of_2(q.shape[2])))


def _whole(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def paged_decode_attention_refusal(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                   gate: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                                   v_scale: torch.Tensor | None = None, *,
                                   out: torch.Tensor | None = None) -> InputError | None:
    """Why `paged_decode_attention_triton` cannot take these operands, as the error it raises (its predicate
    says no to the same calls), or None: q a bf16, fp16 or fp32 [B, q_heads, D], D <= 512, B < 2^31 (the
    grid); k_cache a bf16, fp16, fp32 or float8_e4m3fn [blocks, block_size, kv_heads, D], kv_heads >= 1 dividing
    q_heads, at most 65535 (the grid), a group's [q_heads / kv_heads, D] tile (padded to powers of two >= 16)
    of at most 2^20 elements, and of at most 32 q heads at D past 256 (64 on FP8) unless q or the cache is fp32;
    FP8 only on the CPU or sm_89 and later (which convert E4M3); v_cache of k_cache's shape and dtype; gate None
    or bf16, fp16 or fp32 of q's shape; k_scale, v_scale None or float32 [blocks, block_size, kv_heads];
    block_tables an int32 or int64 [B, max_blocks] of at most 2^30 tokens (max_blocks x block_size); context_lens
    an int32 or int64 [B]; any strides; all on q's device; scale a Python number. `out` apart from the inputs, but
    it may be q or the gate themselves: a (sequence, KV head) reads its group's q rows before its first dot and
    each gate element just before it writes that element of out (in the reduce kernel, with several splits),
    and no other program reads them; any other overlap with them, or with the caches, scales, block table or
    lengths, which other programs still read, is refused. Its shape and dtype are checked where it is written
    (`check_out`)."""
    if err := _shape_refusal(q, k_cache, v_cache, block_tables, context_lens, gate, k_scale, v_scale):
        return err
    if err := number_refusal("scale", scale):
        return err
    b, hq, d = q.shape
    if q.dtype not in FLOATS or d > _MAX_D or b > _MAX_SEQS:
        return InputError("q", f"{q.dtype} {list(q.shape)}",
                          f"a bf16, fp16 or fp32 [B, q_heads, D] tensor, D <= {_MAX_D}, B <= {_MAX_SEQS} (the grid)",
                          "call the op (`paged_decode_attention`) under runtime.backend=auto: it runs the reference "
                          "for others")
    hkv = k_cache.shape[2]
    g_pad, d_pad = _pads(q, k_cache)
    if (k_cache.dtype not in _KV_DTYPES or hkv > _MAX_PROGRAMS or g_pad * d_pad > _MAX_BLOCK
            or g_pad * _default_block_n(k_cache, d_pad) > _MAX_BLOCK):   # the default tile's scores [G_PAD, BLOCK_N]
        return InputError("k_cache", f"{k_cache.dtype} {list(k_cache.shape)}",
                          f"a bf16, fp16, fp32 or float8_e4m3fn cache of at most {_MAX_PROGRAMS} KV heads (the grid), "
                          f"each serving a [q_heads / kv_heads, D] group (padded to powers of two >= 16) of at most "
                          f"{_MAX_BLOCK} elements, and of at most {_MAX_BLOCK // 32} q heads at the default tile of "
                          f"32 tokens (q {list(q.shape)})",
                          "call the op (`paged_decode_attention`) under runtime.backend=auto: it runs the reference "
                          "for others")
    # A [64, 512] tile (33-64 q heads a KV head at D 257-512) with the default tf32 dots on a 16-bit or FP8 cache
    # gave wrong results on an H100 (2026-12-05, Triton 3.6: 48 and 64 bf16 q heads at D 512, the outputs off by
    # up to 2x the largest; an FP8 cache read out of bounds) at the op's 4 warps. The same tile ran right at 8
    # warps and with `fast_dot`, as did every tile up to [128, 256] at 4 warps (scripts/probe_attention_groups.py).
    # Compiled for sm_90 it holds 255 registers a thread and spills 2.3 KB; the dots are wgmmas from G_PAD 64.
    # Until the cause is known, such groups run the reference, as do FP8 groups past 64 (not yet run on a GPU).
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if g_pad >= 64 and (d_pad >= 512 or fp8 and g_pad > 64) and torch.float32 not in (q.dtype, k_cache.dtype):
        return InputError("q", f"{q.dtype} {list(q.shape)}", f"at most 32 q heads a KV head at D past 256, and at "
                          f"most 64 on an FP8 cache (here {hq // hkv} at D {d} on a {k_cache.dtype} cache): "
                          "larger tiles gave wrong results on a GPU, or have not run on one",
                          "call the op (`paged_decode_attention`) under runtime.backend=auto: it runs the reference "
                          "for them")
    if fp8 and q.is_cuda and (cap := torch.cuda.get_device_capability(q.device)) < (8, 9):
        return InputError("k_cache", f"float8_e4m3fn on {q.device}, capability {cap}",
                          "FP8 caches need sm_89 or later (the kernel converts E4M3)",
                          "call the op (`paged_decode_attention`) under runtime.backend=auto: it runs the reference "
                          "here")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        return InputError("v_cache", f"{v_cache.dtype} {list(v_cache.shape)}",
                          f"k_cache's shape and dtype, {k_cache.dtype} {list(k_cache.shape)} (the kernel walks both "
                          "by one block table)", "pass the V cache of this K cache")
    if gate is not None and (gate.shape != q.shape or gate.dtype not in FLOATS):
        return InputError("gate", f"{gate.dtype} {list(gate.shape)}",
                          f"None or a bf16, fp16 or fp32 tensor of q's shape {list(q.shape)}",
                          "pass a bf16, fp16 or fp32 gate of q's shape (gate.expand_as(q))")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is not None and (t.dtype != torch.float32 or t.shape != k_cache.shape[:3]):
            return InputError(name, f"{t.dtype} {list(t.shape)}",
                              f"None or a float32 [blocks, block_size, kv_heads] = {list(k_cache.shape[:3])} tensor",
                              f"pass {name}.float(), one scale a slot and KV head of this cache")
    for name, t, dims in (("block_tables", block_tables, "[B, max_blocks]"), ("context_lens", context_lens, "[B]")):
        if t.dtype not in _INTS or t.shape[0] != b:
            return InputError(name, f"{t.dtype} {list(t.shape)}", f"an int32 or int64 {dims} tensor, B = q's {b}",
                              f"pass {name}[:{b}] as int32 or int64 ({name}.int())")
    if (tokens := block_tables.shape[1] * k_cache.shape[1]) > _MAX_TOKENS:
        return InputError("block_tables", f"{block_tables.shape[1]} blocks of {k_cache.shape[1]} tokens ({tokens})",
                          f"a table of at most {_MAX_TOKENS} tokens (max_blocks x block_size: the kernel counts "
                          "tokens in int32)", "call the op (`paged_decode_attention`) under runtime.backend=auto: it "
                          "runs the reference for longer tables")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("context_lens", context_lens), ("gate", gate), ("k_scale", k_scale), ("v_scale", v_scale)):
        if t is not None and t.device != q.device:
            return InputError(name, f"on {t.device}", f"on q's device, {q.device} (the kernel reads it there)",
                              f"pass {name} on q's device")
    return overlap_refusal("out", out, in_place=("q", "gate"), q=q, gate=gate, k_cache=k_cache, v_cache=v_cache,
                           k_scale=k_scale, v_scale=v_scale, block_tables=block_tables, context_lens=context_lens)


def tuning_refusal(q: torch.Tensor, k_cache: torch.Tensor, num_splits: int | None, block_n: int | None,
                   num_warps: int, fast_dot: bool | None, num_stages: int | None = None) -> InputError | None:
    """Why `paged_decode_attention_triton` cannot launch with these tuning arguments (which the op does not
    take), or None: num_splits None or 1 to 65535 (the grid), its partials under 2^31 elements; block_n None or
    a power of two >= 16 (tl.dot) whose [block_n, D] and [q_heads / kv_heads, block_n] tiles (padded) hold at
    most 2^20 elements; num_warps 1, 2, 4, 8, 16 or 32; fast_dot None or a bool; num_stages None or 1 to 8.
    Asked on operands `paged_decode_attention_refusal` passed."""
    g_pad, d_pad = _pads(q, k_cache)
    # the splits' partials [B, kv_heads, splits, G_PAD, D_PAD] (fp32) are addressed in int32
    most = max(1, min(_MAX_PROGRAMS, (2**31 - 1) // max(1, q.shape[0] * k_cache.shape[2] * g_pad * d_pad)))
    if num_splits is not None and not (_whole(num_splits) and 1 <= num_splits <= most):
        return InputError("num_splits", num_splits, f"None (picked from the GPU's size) or 1 to {most} here (the grid "
                          f"takes {_MAX_PROGRAMS}; the splits' partial rows, [B, kv_heads, splits, {g_pad}, {d_pad}], "
                          "are addressed in int32)", "leave num_splits=None")
    if block_n is not None and not (_whole(block_n) and block_n >= 16 and block_n & (block_n - 1) == 0
                                    and block_n * max(g_pad, d_pad) <= _MAX_BLOCK):
        rows = max(g_pad, d_pad)
        return InputError("block_n", block_n, f"a power of two >= 16 (tl.dot), at most {_MAX_BLOCK // rows} here (a "
                          f"tile of {rows} rows holds at most {_MAX_BLOCK} elements)", "leave block_n=None")
    if not _whole(num_warps) or num_warps not in _WARPS:
        return InputError("num_warps", num_warps, f"one of {', '.join(map(str, _WARPS))}", "leave num_warps=4")
    if fast_dot is not None and not isinstance(fast_dot, bool):
        return InputError("fast_dot", fast_dot, "None (on for an FP8 cache), True or False", "leave fast_dot=None")
    if num_stages is not None and not (_whole(num_stages) and 1 <= num_stages <= _MAX_STAGES):
        return InputError("num_stages", num_stages, f"None (picked from the grid: {_TRITON_STAGES}, or 1 for some FP8 "
                          f"grids) or 1 to {_MAX_STAGES} (tiles in flight a loop: 1 loads each tile "
                          "when its turn comes)",
                          "leave num_stages=None")
    return None


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  gate: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                                  v_scale: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                                  num_splits: int | None = None, block_n: int | None = None,
                                  num_warps: int = 4, fast_dot: bool | None = None,
                                  num_stages: int | None = None) -> torch.Tensor:
    """The Triton provider; same arguments as the reference (`out`: written in place and returned, any
    strides), plus `num_splits` (context splits per sequence; None picks from the GPU's size, 1 on the CPU),
    `block_n` (tokens per tile, a power of two >= 16; None: `_default_block_n`, 32 but where the tile passes
    32 KiB), `num_warps` and `num_stages` (the software pipeline's depth over the context loop; None:
    `_default_tuning`: Triton's 3, or 1 where an FP8 cache's grid fills its waves better there). Never
    synchronizes with the host, so it cannot refuse what the reference refuses: a context length past the block
    table is clamped to it, and a block id out of range drops its tokens (nothing is read out of bounds).

    The dots' dtype is `_dot_dtype`'s: fp32 without `fast_dot`; with it fp16 for an FP8 cache (tf32's
    numerics, without converting each value on to fp32) and q's dtype for a 16-bit cache of it, the
    flash-attention way (p rounded to bf16: less register and shared memory). `fast_dot` None (the default)
    is on for an FP8 cache only, where it keeps the numerics.
    Operands as `paged_decode_attention_refusal` says, tuning arguments as `tuning_refusal`."""
    if err := (paged_decode_attention_refusal(q, k_cache, v_cache, block_tables, context_lens, scale, gate, k_scale,
                                              v_scale, out=out)
               or tuning_refusal(q, k_cache, num_splits, block_n, num_warps, fast_dot, num_stages)):
        raise err
    return paged_decode_attention_launch(q, k_cache, v_cache, block_tables, context_lens, scale, gate, k_scale,
                                         v_scale, out=out, num_splits=num_splits, block_n=block_n,
                                         num_warps=num_warps, fast_dot=fast_dot, num_stages=num_stages)


def paged_decode_attention_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                  gate: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                                  v_scale: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                                  num_splits: int | None = None, block_n: int | None = None,
                                  num_warps: int = 4, fast_dot: bool | None = None,
                                  num_stages: int | None = None) -> torch.Tensor:
    """`paged_decode_attention_triton` on operands `paged_decode_attention_refusal` (and tuning arguments
    `tuning_refusal`) passed (the op's predicate checked the operands and takes no tuning: one check a call)."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    g_pad, d_pad = _pads(q, k_cache)
    out = out_or_empty(out, q.shape, q.dtype, q.device)
    if b == 0:
        return out
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    fast_dot = fp8 if fast_dot is None else fast_dot  # an FP8 cache's fp16 dots keep tf32's numerics (_dot_dtype)
    block_n = _default_block_n(k_cache, d_pad) if block_n is None else block_n
    max_tokens = max(1, block_tables.shape[1] * bs)
    sms = sm_count(q.device)
    exact = torch.float32 in (q.dtype, k_cache.dtype)
    dot_dtype = _dot_dtype(q, k_cache, fast_dot)
    splits, num_stages = _default_tuning(sms, b * hkv, max_tokens, block_n, fp8, num_splits, num_stages,
                                         (g_pad, d_pad, block_n, num_warps), unit_scales=k_scale is None,
                                         tf32_16bit=not (fp8 or exact) and dot_dtype == tl.float32)
    split_len = _split_len(max_tokens, splits, block_n)
    splits = cdiv(max_tokens, split_len)  # no split left empty for every row
    if splits > 1:
        pacc = torch.empty(b, hkv, splits, g_pad, d_pad, dtype=torch.float32, device=q.device)
        pm = torch.empty(b, hkv, splits, g_pad, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
    else:
        pacc = pm = pl = out  # unused
    ks = k_scale if k_scale is not None else k_cache  # a placeholder pointer when absent
    vs = v_scale if v_scale is not None else v_cache
    gt = gate if gate is not None else q
    ks_st = k_scale.stride() if k_scale is not None else (0, 0, 0)
    vs_st = v_scale.stride() if v_scale is not None else (0, 0, 0)
    consts = dict(GROUP=group, G_PAD=g_pad, HEAD_DIM=d, D_PAD=d_pad, HAS_GATE=gate is not None)
    _paged_decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, ks, vs, gt, block_tables, context_lens.contiguous(), out, pacc, pm, pl,
        scale * _LOG2E, k_cache.shape[0], block_tables.shape[1] * bs, split_len,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *ks_st, *vs_st, *gt.stride(), *out.stride(),
        *block_tables.stride(),
        BLOCK_SIZE=bs, BLOCK_N=block_n, SPLIT=splits > 1, HAS_K_SCALE=k_scale is not None,
        HAS_V_SCALE=v_scale is not None, DOT_DTYPE=dot_dtype,
        Q_POW2=dot_dtype == tl.float16 and q.dtype == torch.bfloat16,
        P_POW2=dot_dtype == tl.float16 and v_scale is not None,
        DOT_PRECISION="ieee" if exact else "tf32", num_warps=num_warps,
        num_stages=num_stages, **consts)
    if splits > 1:
        block_d = min(d_pad, _REDUCE_BLOCK_D)
        chunk = max(1, min(next_power_of_2(splits), _REDUCE_TILE // (g_pad * block_d)))
        _paged_decode_reduce_kernel[(b, hkv, d_pad // block_d)](pacc, pm, pl, gt, out, splits, *gt.stride(),
                                                                *out.stride(), BLOCK_D=block_d, CHUNK=chunk,
                                                                LOOP=splits > chunk, num_warps=4, **consts)
    return out


def _contract(q, k_cache, v_cache, block_tables, context_lens, scale, gate=None, k_scale=None, v_scale=None, *,
              out=None) -> InputError | None:
    """What the reference refuses before anything runs (`_shape_refusal`, `out`; every provider refuses the same)."""
    return (_shape_refusal(q, k_cache, v_cache, block_tables, context_lens, gate, k_scale, v_scale)
            or out_refusal(out, q.shape, q.dtype, q.device))


paged_decode_attention = Op("paged_decode_attention", _paged_decode_attention_native, _contract)
# Through the op, the provider's tuning arguments (num_splits, block_n, num_warps, fast_dot, num_stages) are not
# taken: the reference has none, so a call means the same under every backend. Tests and sweeps pass them to
# `paged_decode_attention_triton` itself.
paged_decode_attention.register_provider("triton", paged_decode_attention_launch, paged_decode_attention_refusal)

__all__ = ["paged_decode_attention", "paged_decode_attention_refusal", "paged_decode_attention_triton"]
