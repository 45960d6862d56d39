"""paged_decode_attention: the reference against a dense softmax attention computed independently (in
float64, token by token from the slots), and the Triton provider against the reference over odd shapes,
every KV dtype (BF16, FP32, FP8 with unit and per-token scales), shuffled block ids and context splits.

Every cache slot that no sequence may read (the blocks outside the tables, the padding entries of the
tables, the slots past each context in its last block) holds NaN, and the output is NaN before the
launch: a stray read or a missed write shows up as NaN.

Tolerances: an fp32 output differs from the reference only in the order of fp32 sums and exp2 vs exp:
1e-5 (observed ~5e-7). A BF16 output is rounded once by the kernel but two or three times by the
reference (the attention output, sigmoid(gate), their product, each to BF16, 2**-9 relative at most):
atol = rtol = 1e-2 on values of order 1. FP8 caches dequantize exactly in fp32 on both sides, so they
take their output dtype's tolerance.
"""

from __future__ import annotations

import importlib
import inspect
import math

import os

import pytest
import torch
import triton.language as tl

from mtpfactory import ops
from mtpfactory.errors import InputError, MtpfError
from mtpfactory.kernels.paged_attention import (_REDUCE_BLOCK_D, _REDUCE_TILE, _bf16_wave_splits, _default_block_n,
                                               _default_tuning, _dot_dtype, paged_decode_attention,
                                               paged_decode_attention_triton, tuning_refusal)
from backend_refusal import assert_backend_refuses, assert_overlap_refused

# The interpreter reads a loop's run-time bound through a deprecated numpy conversion (DESIGN 4).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

FP8 = torch.float8_e4m3fn
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="Triton on the CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


def make_case(b: int, hq: int, hkv: int, d: int, bs: int, ctx: list[int], kv: str, q_dtype: torch.dtype,
              seed: int = 0, device: str = "cpu", spare_cols: int = 1):
    """Inputs of the op: q, K/V caches (kv: bf16, fp16, fp32, fp8, fp8_scaled), block tables with shuffled block
    ids and `spare_cols` padding entries (block 0, poisoned), context lens, scale, gate, k/v scales."""
    gen = torch.Generator(device=device).manual_seed(seed)
    nblk = [math.ceil(n / bs) for n in ctx]
    nb = sum(nblk) + 3  # block 0 and two spares are never in a table's used part
    width = max(nblk) + spare_cols
    ids = torch.randperm(nb - 1, generator=gen, device=device)[: sum(nblk)] + 1
    tables = torch.zeros(b, width, dtype=torch.int32, device=device)
    readable = torch.zeros(nb, bs, dtype=torch.bool, device=device)
    used = 0
    for i, n in enumerate(ctx):
        row = ids[used: used + nblk[i]]
        used += nblk[i]
        tables[i, : nblk[i]] = row.int()
        readable.view(-1)[(row[:, None] * bs + torch.arange(bs, device=device)).view(-1)[:n]] = True

    shape = (nb, bs, hkv, d)
    k = torch.randn(shape, generator=gen, device=device)
    v = torch.randn(shape, generator=gen, device=device)
    k_scale = v_scale = None
    if kv == "fp8_scaled":  # stored values up to ~64, scales ~1/32: dequantized K, V of order 1-2
        k, v = (k * 16).to(FP8), (v * 16).to(FP8)
        k_scale = torch.rand(nb, bs, hkv, generator=gen, device=device) / 16 + 1 / 64
        v_scale = torch.rand(nb, bs, hkv, generator=gen, device=device) / 16 + 1 / 64
    else:
        dtype = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32, fp8=FP8)[kv]
        k, v = k.to(dtype), v.to(dtype)
    poison = ~readable[..., None, None].expand(shape)
    k, v = _poison(k, poison), _poison(v, poison)
    if k_scale is not None:
        k_scale[~readable] = float("nan")
        v_scale[~readable] = float("nan")

    q = (torch.randn(b, hq, d, generator=gen, device=device) * 2).to(q_dtype)  # * 2: a peaked softmax
    gate = torch.randn(b, hq, d, generator=gen, device=device).to(q_dtype)
    lens = torch.tensor(ctx, dtype=torch.int32, device=device)
    return q, k, v, tables, lens, d ** -0.5, gate, k_scale, v_scale


def _poison(cache: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    if cache.dtype == FP8:
        bits = cache.view(torch.uint8).clone()
        bits[where] = 0x7F  # E4M3 (fn) NaN
        return bits.view(FP8)
    return cache.masked_fill(where, float("nan"))


def run_triton(*args, **kwargs) -> torch.Tensor:
    """The Triton provider into a NaN-poisoned out: through the op, or with tuning arguments (num_splits,
    block_n, fast_dot), which the op does not take, called directly."""
    out = torch.full_like(args[0], float("nan"))
    with ops.use_backend("triton"):
        call = paged_decode_attention_triton if kwargs else paged_decode_attention
        res = call(*args, out=out, **kwargs)
    assert res is out
    return out


def run_native(*args) -> torch.Tensor:
    with ops.use_backend("native"):
        return paged_decode_attention(*args)


def dense_attention_f64(q, k_cache, v_cache, tables, lens, scale, gate, k_scale, v_scale) -> torch.Tensor:
    """Independent oracle: gather each token's K/V from its slot, dequantize, expand GQA, float64 softmax."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        blk = torch.tensor([int(tables[i, t // bs]) for t in range(n)])
        off = torch.tensor([t % bs for t in range(n)])
        k = k_cache[blk, off].double()  # [n, kv_heads, D]
        v = v_cache[blk, off].double()
        if k_scale is not None:
            k = k * k_scale[blk, off].double()[..., None]
        if v_scale is not None:
            v = v * v_scale[blk, off].double()[..., None]
        for j in range(hq):
            w = torch.softmax(k[:, j // (hq // hkv)] @ q[i, j].double() * scale, dim=0)  # [n]
            out[i, j] = w @ v[:, j // (hq // hkv)]
    return out * torch.sigmoid(gate.double()) if gate is not None else out


# --- the reference ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv", ["fp32", "fp8", "fp8_scaled"])
@pytest.mark.parametrize("gated", [False, True])
def test_reference_equals_dense_attention(kv, gated):
    ctx = [13, 1, 22, 0]  # mid-block ends, one token, several blocks, an empty row (zeros)
    q, k, v, tables, lens, scale, gate, ks, vs = make_case(4, 6, 2, 40, 4, ctx, kv, torch.float32, seed=7)
    gate = gate if gated else None
    expect = dense_attention_f64(q, k, v, tables, lens, scale, gate, ks, vs)
    got = run_native(q, k, v, tables, lens, scale, gate, ks, vs)
    torch.testing.assert_close(got.double(), expect, atol=1e-5, rtol=1e-5)  # fp32 vs float64 sums


# --- the Triton provider ------------------------------------------------------------------------------

KV_CASES = [("bf16", torch.bfloat16), ("fp32", torch.float32), ("fp8", torch.bfloat16),
            ("fp8_scaled", torch.bfloat16), ("fp8_scaled", torch.float32)]
CTX = {1: [21], 3: [13, 4, 26]}  # block 4: ends mid-block, exactly one block, up to 7 blocks


@pytest.mark.parametrize("kv, q_dtype", KV_CASES)
@pytest.mark.parametrize("d", [16, 40])
@pytest.mark.parametrize("hq, hkv", [(4, 2), (6, 1), (2, 2)])
@pytest.mark.parametrize("b", [1, 3])
def test_triton_matches_reference(b, hq, hkv, d, kv, q_dtype):
    args = make_case(b, hq, hkv, d, 4, CTX[b], kv, q_dtype, seed=b * 1000 + hq * 10 + d)
    torch.testing.assert_close(run_triton(*args), run_native(*args), **TOL[q_dtype])


@pytest.mark.parametrize("num_splits, block_n, num_stages", [(2, 16, None), (3, 16, None), (5, 16, 1), (2, 32, 3)])
@pytest.mark.parametrize("kv, q_dtype", [("fp32", torch.float32), ("fp8_scaled", torch.bfloat16)])
@pytest.mark.parametrize("d", [24, 40])
def test_triton_split_context(num_splits, block_n, num_stages, kv, q_dtype, d):
    """Flash-decoding splits: uneven contexts leave some splits empty for short rows; a row with no
    context gives zeros; block size 5 (not a power of two) makes tiles straddle blocks. Two q heads a KV head
    leave 14 of the 16 padded rows of a split's partial unwritten; D 40 gives the reduce two programs of 32
    dims, the second cut at 40. (num_stages reaches the launch; the interpreter ignores it: its GPU test is
    test_gpu_pipeline_depths_and_tiles_match_reference.)"""
    args = make_case(4, 4, 2, d, 5, [37, 3, 0, 60], kv, q_dtype, seed=num_splits, spare_cols=2)
    out = run_triton(*args, num_splits=num_splits, block_n=block_n, num_stages=num_stages)
    torch.testing.assert_close(out, run_native(*args), **TOL[q_dtype])
    assert (out[2] == 0).all()


@pytest.mark.parametrize("kv, q_dtype", [("fp8", torch.bfloat16), ("fp8_scaled", torch.bfloat16),
                                         ("fp8_scaled", torch.float16)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_triton_fast_dot_on_an_fp8_cache_runs_fp16_dots(kv, q_dtype, num_splits, device):
    """fast_dot on an FP8 cache: fp16 dots, which the interpreter runs right (its bf16 dots it does not). A
    group's q heads span 2^32 in size (x 2^16, past fp16's range, a one-hot softmax; x 1; x 2^-16; 2^20 for
    an fp16 q) and the V scales up to 2^40, shuffled over the blocks: each row of q and of a tile's p is put
    into fp16's range on its own. Compared relative to each head's largest output: against the reference at
    the BF16 tolerance, and against the fp32-dot provider within 2^-7 (observed 2^-8, one BF16 rounding
    flipped; each of the four scalings left out fails, a p sunk to zero by 1.0)."""
    args = list(make_case(3, 6, 2, 40, 4, [13, 4, 26], kv, q_dtype, seed=11, device=device))
    top = 16 if q_dtype == torch.bfloat16 else 10  # bf16's x 2^16 leaves fp16's range
    heads = 2.0 ** torch.linspace(top, -top, 3, device=device).repeat(2)  # a group: x 2^top, x 1, x 2^-top
    args[0] = (args[0].float() * heads[:, None]).to(q_dtype)
    if args[8] is not None:  # V scales from 2^-20 to 2^20 across the blocks (2^-8 to 2^8: an fp16 out holds it)
        span = 20 if q_dtype == torch.bfloat16 else 8
        args[8] = args[8] * 2.0 ** torch.linspace(-span, span, args[8].shape[0], device=device)[:, None, None]
    out = run_triton(*args, num_splits=num_splits, fast_dot=True).float()
    want = run_native(*args).float()
    size = want.abs().amax(dim=-1, keepdim=True)
    torch.testing.assert_close(out / size, want / size, atol=1e-2, rtol=1e-2)
    fp32_dots = run_triton(*args, num_splits=num_splits).float()
    torch.testing.assert_close(out / size, fp32_dots / size, atol=2**-7, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_fast_dot_on_an_fp16_cache_runs_fp16_dots(num_splits):
    """fast_dot on an fp16 q and cache: fp16 dots (p rounded to fp16), in the interpreter as on the GPU."""
    args = make_case(3, 6, 2, 40, 4, [13, 4, 26], "fp16", torch.float16, seed=12)
    out = run_triton(*args, num_splits=num_splits, fast_dot=True)
    torch.testing.assert_close(out, run_native(*args), atol=1e-2, rtol=1e-2)


def test_fast_dot_takes_fp16_for_an_fp8_cache_and_q_dtype_for_a_16_bit_one():
    q = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    bf16_cache, fp8_cache = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16), torch.zeros(1, 1, 1, 16, dtype=FP8)
    assert _dot_dtype(q, fp8_cache, False) == tl.float32
    assert _dot_dtype(q, fp8_cache, True) == tl.float16
    assert _dot_dtype(q, bf16_cache, True) == tl.float32  # bf16 dots: GPU only
    assert _dot_dtype(q.half(), bf16_cache.half(), True) == tl.float16
    assert _dot_dtype(q.float(), fp8_cache, True) == tl.float32  # fp32 q: exact dots


@pytest.mark.parametrize("kv, q_dtype", [("bf16", torch.bfloat16), ("fp8_scaled", torch.float32)])
def test_triton_many_splits_reduce_in_chunks(kv, q_dtype):
    """45 splits of 16 tokens (block_n 16: at the default 32 the splits would be 32 long, 23 of them): the reduce
    takes 32 splits a step (32 q heads a KV head: G_PAD 32, 8 dims a program), so two steps, the last cut at 13;
    the shorter row leaves its last 24 splits empty. D 40: eight reduce programs a (sequence, KV head) over D_PAD
    64, the fifth ending at 40 and the last three wholly past it. Row 0's largest scores lie in its last split
    (token 690, the mean of its KV head's q heads: scores near |q|^2 / 2, twice the others' largest), so the
    reduce's running max rises in its last step, which must rescale the sum and the output of the step before it."""
    q, k, v, tables, lens, scale, gate, ks, vs = make_case(2, 64, 2, 40, 16, [700, 333], kv, q_dtype, seed=21)
    splits, chunk = tables.shape[1], _REDUCE_TILE // (32 * _REDUCE_BLOCK_D)  # a split a block of the table
    assert splits == 45 and chunk == 32 and -(-splits // chunk) == 2
    blk, off = int(tables[0, 690 // 16]), 690 % 16
    hot = q[0].float().view(2, 32, 40).mean(1)  # [kv_heads, D]
    k[blk, off] = (hot if ks is None else hot / ks[blk, off][:, None]).to(k.dtype)
    args = (q, k, v, tables, lens, scale, gate, ks, vs)
    out = run_triton(*args, num_splits=45, block_n=16)
    torch.testing.assert_close(out, run_native(*args), **TOL[q_dtype])


def test_triton_ungated_and_strided_q():
    """q and gate as views of a fused [B, heads, 2 * D] projection (q first, then gate), as attention makes."""
    q, k, v, tables, lens, scale, _, _, _ = make_case(3, 4, 2, 16, 4, [9, 16, 2], "bf16", torch.bfloat16, seed=5)
    qg = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    for gate in (None, qg[..., 16:]):
        args = (qg[..., :16], k, v, tables, lens, scale, gate)
        torch.testing.assert_close(run_triton(*args), run_native(*args), **TOL[torch.bfloat16])
    args = (q, k, v, tables, lens, scale)
    torch.testing.assert_close(run_triton(*args), run_native(*args), **TOL[torch.bfloat16])


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("kv, q_dtype", [("bf16", torch.bfloat16), ("fp8_scaled", torch.float32)])
def test_triton_context_of_length_one(kv, q_dtype, num_splits):
    """One token: the softmax is a single 1 and the output that token's V (gated); beside a row of 5. Tables
    of 6 blocks of 4 make 24 tokens, two splits of 16 when asked for two (the second empty for every row)."""
    args = make_case(3, 4, 2, 16, 4, [1, 5, 1], kv, q_dtype, seed=11, spare_cols=4)
    torch.testing.assert_close(run_triton(*args, num_splits=num_splits), run_native(*args), **TOL[q_dtype])


def test_triton_strided_context_lens_and_column_major_block_tables():
    q, k, v, tables, lens, scale, gate, _, _ = make_case(3, 4, 2, 16, 4, [13, 4, 9], "bf16", torch.bfloat16, seed=3)
    args = (q, k, v, tables.t().contiguous().t(), torch.stack([lens, 0 * lens], 1)[:, 0], scale, gate)
    assert args[3].stride(0) == 1 and args[4].stride(0) == 2
    torch.testing.assert_close(run_triton(*args), run_native(*args), **TOL[torch.bfloat16])


def _laid_out(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """t's values in a view of t's shape whose dims lie in memory in `order` (outermost first), each element
    followed by a NaN along the innermost: every stride differs from t's and from a contiguous tensor's."""
    shape = [t.shape[i] for i in order]
    store = torch.full((*shape[:-1], 2 * shape[-1]), float("nan"), dtype=t.dtype)  # FP8: 0x7F, its NaN
    view = store[..., ::2].permute(*sorted(range(t.dim()), key=order.__getitem__))
    return view.copy_(t)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("kv, q_dtype", [("fp8_scaled", torch.bfloat16), ("fp32", torch.float32)])
def test_triton_reads_and_writes_every_operand_by_its_own_strides(kv, q_dtype, num_splits):
    """The provider takes any strides: q, gate and out, the K and V caches and the K and V scales each laid
    out in another order of dims (no two alike, none contiguous, a NaN between neighbours along the innermost):
    an operand read by another's strides, or by a unit stride along D, reads NaN or other values. out's NaN
    gaps stay unwritten. Both stores: the split kernel's (one split) and the reduce's (two)."""
    q, k, v, tables, lens, scale, gate, ks, vs = make_case(3, 6, 2, 24, 5, [13, 1, 22], kv, q_dtype, seed=8)
    want = run_native(q, k, v, tables, lens, scale, gate, ks, vs)
    q, gate = _laid_out(q, (0, 2, 1)), _laid_out(gate, (1, 0, 2))
    k, v = _laid_out(k, (0, 1, 3, 2)), _laid_out(v, (2, 0, 1, 3))
    if ks is not None:
        ks, vs = _laid_out(ks, (0, 2, 1)), _laid_out(vs, (2, 0, 1))
    out = _laid_out(torch.full_like(q, float("nan")), (2, 0, 1))
    got = paged_decode_attention_triton(q, k, v, tables, lens, scale, gate, ks, vs, out=out, num_splits=num_splits)
    assert got is out
    torch.testing.assert_close(out, want, **TOL[q_dtype])
    assert out.as_strided((out.numel(),), (2,), out.storage_offset() + 1).isnan().all()  # the gaps


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_output_in_q_dtype_whatever_the_gate_and_out_which_every_provider_takes(backend):
    """A bf16 q with an fp32 gate gives bf16 from every provider (the reference's product would promote);
    `out` a strided view is written by its strides; an `out` of another shape or dtype is refused by both."""
    q, k, v, tables, lens, scale, gate, _, _ = make_case(2, 4, 2, 16, 4, [5, 9], "bf16", torch.bfloat16, seed=4)
    args = (q, k, v, tables, lens, scale, gate.float())
    want = paged_decode_attention.reference(*args)
    assert want.dtype == torch.bfloat16
    wide = torch.full((2, 4, 32), float("nan"), dtype=torch.bfloat16)
    with ops.use_backend(backend):
        got = paged_decode_attention(*args, out=wide[..., 8:24])
        assert got.dtype == torch.bfloat16 and wide[..., :8].isnan().all() and wide[..., 24:].isnan().all()
        torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
        for bad in (torch.empty(2, 4, 16), torch.empty(2, 4, 8, dtype=torch.bfloat16)):
            with pytest.raises(InputError, match="out="):
                paged_decode_attention(*args, out=bad)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("into", ["q", "gate"])
def test_triton_in_place_on_q_or_the_gate(into, num_splits):
    """`out` q or the gate itself: a (sequence, KV head) reads its group's q rows before its first dot and each gate
    element just before it writes that element of out (the reduce kernel's, with two splits), and no other
    program reads them; the provider takes it and gives the reference's answer."""
    args = make_case(3, 4, 2, 16, 4, [9, 16, 2], "bf16", torch.bfloat16, seed=16)
    want = run_native(*args)
    out = args[NAMES.index(into)]
    with ops.use_backend("triton"):
        got = paged_decode_attention_triton(*args, out=out, num_splits=num_splits, block_n=16)  # 20 tokens: 2 splits
    assert got is out
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("shares", ["q", "k_cache"])
def test_an_out_sharing_memory_with_an_input_but_in_place_is_left_to_the_reference(shares):
    """`out` one sequence past q's start (sequence 0's programs wrote sequence 1's q rows before its programs read
    them), or over the K cache's used blocks (which every program of a sequence reads): the provider refuses it
    naming both, writing nothing; `auto` runs the reference, which attends every row before it writes."""
    q, k, v, tables, lens, scale, gate, _, _ = make_case(3, 4, 2, 16, 4, [9, 16, 2], "bf16", torch.bfloat16, seed=17)
    if shares == "q":
        buf = torch.cat([q.flatten(), torch.randn(4 * 16).bfloat16()])
        q, out = buf[: q.numel()].view(q.shape), buf[4 * 16:].view(q.shape)
    else:
        out = k.view(-1)[4 * 2 * 16:][: q.numel()].view(q.shape)      # blocks 1 on, block 0 being unused
    args = (q, k, v, tables, lens, scale, gate)
    want = run_native(*(t.clone() if isinstance(t, torch.Tensor) else t for t in args))
    assert_overlap_refused(paged_decode_attention, "out", shares, *args, out=out)
    with pytest.raises(InputError, match=f"^out='memory shared with {shares}'"):
        paged_decode_attention_triton(*args, out=out)
    with ops.use_backend("auto"):
        assert torch.equal(paged_decode_attention(*args, out=out), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_scores_below_any_finite_floor(num_splits, device):
    """fp32 q = 1e16 (2e16 for the second head) against K = -1e15: every score is about -6e31 (log2-scaled),
    below a finite stand-in for -inf such as -1e30, which would zero every weight. Each row's scores are
    equal, so the output is the mean of its V. Rows of 1 and 20 tokens and an empty one (zeros); tables of
    8 blocks of 4 make two splits of 16 when asked for two: row 0's second split is empty, row 1 spans both."""
    q, k, v, tables, lens, scale, gate, _, _ = make_case(3, 2, 1, 16, 4, [1, 20, 0], "fp32", torch.float32,
                                                         seed=9, device=device, spare_cols=3)
    q = torch.full_like(q, 1e16)
    q[:, 1] *= 2
    k = torch.where(k.isnan(), k, -1e15)  # the poison stays
    args = (q, k, v, tables, lens, scale, gate)
    want = run_native(*args)
    assert want[:2].isfinite().all() and (want[:2] != 0).all() and (want[2] == 0).all()
    torch.testing.assert_close(run_triton(*args, num_splits=num_splits), want, **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_context_past_the_block_table_refused_by_the_reference_and_clamped_by_the_kernel(device):
    """Tables of 2 blocks of 4 hold 8 tokens. The reference refuses a longer context; the kernel, which cannot
    raise without a sync, attends to the 8 the table holds. The tables are the first 2 columns of a wider
    tensor whose third column names block 0, which is NaN: a read past a row's width would show."""
    q, k, v, tables, lens, scale, gate, _, _ = make_case(2, 4, 2, 16, 4, [8, 8], "bf16", torch.bfloat16, seed=6,
                                                         spare_cols=0, device=device)
    wide = torch.zeros(2, 3, dtype=tables.dtype, device=device)
    wide[:, :2] = tables
    long = torch.tensor([11, 9], dtype=lens.dtype, device=device)
    with pytest.raises(InputError, match=r"^context_lens=11: token counts that 2 blocks of 4 hold lie in \[0, 9\)"):
        run_native(q, k, v, wide[:, :2], long, scale, gate)
    got = run_triton(q, k, v, wide[:, :2], long, scale, gate)
    torch.testing.assert_close(got, run_native(q, k, v, wide[:, :2], lens, scale, gate), **TOL[torch.bfloat16])
    # an int64 length past int32 is clamped before the kernel counts in int32 (2^32 + 3 would wrap to 3)
    got = run_triton(q, k, v, wide[:, :2], torch.tensor([2**32 + 3, 9], device=device), scale, gate)
    torch.testing.assert_close(got, run_native(q, k, v, wide[:, :2], lens, scale, gate), **TOL[torch.bfloat16])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [-1, "nb"])
def test_block_id_out_of_range_refused_by_the_reference_and_its_tokens_dropped_by_the_kernel(bad, device):
    """A row whose second block id lies outside the cache: the reference refuses it; the kernel drops that
    block's tokens, so the row attends to its first block alone. The caches are blocks 1 to nb of a tensor
    whose first and last blocks are NaN, where block -1 or nb would read."""
    q, k, v, tables, lens, scale, gate, _, _ = make_case(2, 4, 2, 16, 4, [8, 6], "bf16", torch.bfloat16, seed=7,
                                                         device=device)
    nb = k.shape[0]
    guarded = [torch.full((nb + 2, *k.shape[1:]), float("nan"), dtype=k.dtype, device=device) for _ in range(2)]
    kg, vg = guarded[0][1:nb + 1], guarded[1][1:nb + 1]
    kg.copy_(k), vg.copy_(v)
    tables[0, 1] = nb if bad == "nb" else bad
    with pytest.raises(InputError, match=rf"^block_tables\[0\]={tables[0, 1].item()}: the ids .* lie in \[0, {nb}\)"):
        run_native(q, kg, vg, tables, lens, scale, gate)
    got = run_triton(q, kg, vg, tables, lens, scale, gate)
    first_block_only = torch.tensor([4, 6], dtype=lens.dtype, device=device)
    torch.testing.assert_close(got, run_native(q, kg, vg, tables, first_block_only, scale, gate), **TOL[torch.bfloat16])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_a_first_tile_of_dropped_blocks_adds_nothing(num_splits):
    """Row 0's first four block ids (-1 and nb, alternately) lie outside the cache: at block_n 16, its first tile
    (and, with two splits of 16 tokens, its whole first split) has no token, so its running max is still -inf
    when that tile's max is -inf too; the exponents subtract 0 there (never -inf - -inf, NaN) and the row
    attends to its last 6 tokens alone: the reference on the table without those blocks. Row 1 is untouched."""
    q, k, v, tables, lens, scale, gate, _, _ = make_case(2, 4, 2, 16, 4, [22, 9], "bf16", torch.bfloat16, seed=10)
    nb = k.shape[0]
    shifted, short = tables.clone(), lens.clone()
    shifted[0, :-4], shifted[0, -4:], short[0] = tables[0, 4:], 0, 6
    tables[0, :4] = torch.tensor([-1, nb, -1, nb])
    assert tables.shape[1] == 7  # 28 tokens: two splits of 16 when asked for two
    got = run_triton(q, k, v, tables, lens, scale, gate, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(got, run_native(q, k, v, shifted, short, scale, gate), **TOL[torch.bfloat16])


# --- operands the kernel cannot take ---------------------------------------------------------------------

NAMES = ("q", "k_cache", "v_cache", "block_tables", "context_lens", "scale", "gate", "k_scale", "v_scale")


def _ops() -> dict:
    """B = 2, 4 q heads over 2 KV heads of D = 16, blocks of 4, an FP8 cache with scales, bf16 q and gate:
    operands the kernel takes, by name."""
    return dict(zip(NAMES, make_case(2, 4, 2, 16, 4, [5, 9], "fp8_scaled", torch.bfloat16, seed=14)))


def _with(**parts):
    """A case: `_ops()` with the named parts replaced (each a function of the parts), as positional args."""
    def make():
        args = _ops()
        args.update({n: f(args) for n, f in parts.items()})
        return [args[n] for n in NAMES]
    return make


def _cache(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(15)).to(dtype)


def _huge_batch():
    """B = 2^31 (zeros, stride 0): past the grid without the memory."""
    b = 2**31
    return [torch.zeros(1, 2, 16).expand(b, 2, 16), _cache(2, 4, 1, 16), _cache(2, 4, 1, 16),
            torch.zeros(1, 1, dtype=torch.int32).expand(b, 1), torch.zeros(1, dtype=torch.int32).expand(b), 0.25,
            None, None, None]


def _heads(hq: int, hkv: int, d: int):
    """One sequence of hq q heads over a cache of hkv KV heads of D = d, one block of one token."""
    return [torch.randn(1, hq, d), _cache(1, 1, hkv, d), _cache(1, 1, hkv, d), torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), d ** -0.5, None, None, None]


# case: a function making the operands, the field refused, what its message says it allows
BAD = {
    "q 2-D": (_with(q=lambda a: a["q"][0]), "q", r"a \[B, q_heads, D\] tensor"),
    "q fp64": (_with(q=lambda a: a["q"].double()), "q", "bf16, fp16 or fp32"),
    "q int": (_with(q=lambda a: a["q"].int()), "q", r"a \[B, q_heads, D\] tensor of floating point"),
    "q heads not a multiple of KV heads": (_with(q=lambda a: a["q"][:, :3]), "q",
                                           "a multiple of the cache's kv_heads = 2"),
    "q D past 512": (lambda: _heads(2, 1, 520), "q", "D <= 512"),
    "q group of 33 at D 300 on a bf16 cache": (
        lambda: [t.bfloat16() if i < 3 else t for i, t in enumerate(_heads(33, 1, 300))], "q",
        r"at most 32 q heads a KV head at D past 256, .*\(here 33 at D 300 on a torch.bfloat16 cache\)"),
    "q group of 65 on an FP8 cache": (
        lambda: [t.to(torch.float8_e4m3fn) if i in (1, 2) else t.bfloat16() if i == 0 else t
                 for i, t in enumerate(_heads(65, 1, 16))], "q",
        r"and at most 64 on an FP8 cache \(here 65 at D 16 on a torch.float8_e4m3fn"),
    "q B past the grid": (_huge_batch, "q", "B <= 2147483647"),
    "k_cache of other D": (_with(k_cache=lambda a: a["k_cache"][..., :8]), "k_cache", "of q's head_dim D = 16"),
    "k_cache of no KV heads": (_with(k_cache=lambda a: a["k_cache"][:, :, :0]), "k_cache", "kv_heads >= 1"),
    "k_cache 5-D": (_with(k_cache=lambda a: a["k_cache"][..., None]), "k_cache", r"\[blocks, block_size >= 1, kv_"),
    "k_cache of no block size": (_with(k_cache=lambda a: a["k_cache"][:, :0], v_cache=lambda a: a["v_cache"][:, :0],
                                       k_scale=lambda a: a["k_scale"][:, :0], v_scale=lambda a: a["v_scale"][:, :0]),
                                 "k_cache", "block_size >= 1"),
    "k_cache fp64": (_with(k_cache=lambda a: a["k_cache"].double()), "k_cache", "bf16, fp16, fp32 or float8_e4m3fn"),
    "k_cache e5m2": (_with(k_cache=lambda a: a["k_cache"].view(torch.float8_e5m2)), "k_cache", "float8_e4m3fn"),
    "k_cache KV heads past the grid": (lambda: _heads(65536, 65536, 16), "k_cache", "at most 65535 KV heads"),
    "k_cache group past a tile": (lambda: _heads(4096, 1, 512), "k_cache", "of at most 1048576 elements"),
    "k_cache group past the default tile's rows": (lambda: _heads(65536, 1, 16), "k_cache",
                                                    "and of at most 32768 q heads at the default tile"),
    "v_cache of other block size": (_with(v_cache=lambda a: a["v_cache"].view(-1, 2, 2, 16)), "v_cache",
                                    r"k_cache's \[4, 2, 16\]"),
    "v_cache of more blocks": (_with(v_cache=lambda a: torch.cat([a["v_cache"], a["v_cache"]])), "v_cache",
                               "k_cache's shape and dtype"),
    "v_cache of other dtype": (_with(v_cache=lambda a: a["v_cache"].float()), "v_cache", "k_cache's shape and dtype"),
    "gate of other heads": (_with(gate=lambda a: a["gate"][:, :2]), "gate", "q's shape .*, or one that broadcasts"),
    "gate broadcast": (_with(gate=lambda a: a["gate"][:, :, :1]), "gate", r"of q's shape \[2, 4, 16\]"),
    "gate fp64": (_with(gate=lambda a: a["gate"].double()), "gate", "bf16, fp16 or fp32"),
    "k_scale bf16": (_with(k_scale=lambda a: a["k_scale"].bfloat16()), "k_scale", "None or a float32"),
    "k_scale 2-D": (_with(k_scale=lambda a: a["k_scale"].flatten(1)), "k_scale", r"k_cache's \[4, 2\]"),
    "v_scale of more blocks": (_with(v_scale=lambda a: torch.cat([a["v_scale"], a["v_scale"]])), "v_scale",
                               r"float32 \[blocks, block_size, kv_heads\] = \[\d+, 4, 2\]"),
    "block_tables 1-D": (_with(block_tables=lambda a: a["block_tables"][0]), "block_tables",
                         r"a \[B, max_blocks\] tensor"),
    "block_tables of fewer rows": (_with(block_tables=lambda a: a["block_tables"][:1]), "block_tables", "B = 2"),
    "block_tables of more rows": (_with(block_tables=lambda a: a["block_tables"].repeat(2, 1)), "block_tables",
                                  r"int32 or int64 \[B, max_blocks\] tensor, B = q's 2"),
    "block_tables past 2^30 tokens": (_with(block_tables=lambda a: a["block_tables"][:, :1].expand(2, 2**28 + 1)),
                                      "block_tables", r"of at most 1073741824 tokens \(max_blocks x block_size"),
    "block_tables bool": (_with(block_tables=lambda a: a["block_tables"] > 0), "block_tables", "int32 or int64"),
    "context_lens of fewer rows": (_with(context_lens=lambda a: a["context_lens"][:1]), "context_lens",
                                   r"a \[B\] tensor"),
    "context_lens of more rows": (_with(context_lens=lambda a: a["context_lens"].repeat(2)), "context_lens",
                                  r"int32 or int64 \[B\] tensor, B = q's 2"),
    "context_lens float": (_with(context_lens=lambda a: a["context_lens"].float()), "context_lens", "int32 or int64"),
    "k_cache elsewhere": (_with(k_cache=lambda a: a["k_cache"].to("meta")), "k_cache", "on q's device, cpu"),
    "block_tables elsewhere": (_with(block_tables=lambda a: a["block_tables"].to("meta")), "block_tables",
                               "on q's device, cpu"),
    "v_scale elsewhere": (_with(v_scale=lambda a: a["v_scale"].to("meta")), "v_scale", "on q's device, cpu"),
    "scale a tensor": (_with(scale=lambda a: torch.tensor(a["scale"])), "scale", r"a Python float.*float\(scale\)"),
}


def _poisoned_for(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, what to check is still NaN): q's shape in q's dtype (fp32 for a q of no dims' worth or of integers),
    one NaN seen through stride 0 where q is huge."""
    shape = q.shape if q.dim() == 3 else (2, 4, 16)
    dtype = q.dtype if q.dtype.is_floating_point else torch.float32
    if q.numel() <= 2**22:
        out = torch.full(shape, float("nan"), dtype=dtype)
        return out, out
    one = torch.full((1, 1, 1), float("nan"), dtype=dtype)
    return one.expand(shape), one


@pytest.mark.parametrize("case", BAD)
def test_operands_the_kernel_cannot_take_are_refused_by_the_predicate_the_provider_and_the_backend(case):
    """One rule (`paged_decode_attention_refusal`): the predicate says no, `paged_decode_attention_triton` called
    directly raises it naming the operand and writes nothing, and an explicit `runtime.backend=triton` says
    which operand it refuses (with the reference's own error where it refuses the call too)."""
    make, field, allowed = BAD[case]
    args = make()
    out, poison = _poisoned_for(args[0])
    with ops.use_backend("triton"):
        assert not paged_decode_attention.providers["triton"].supports(*args, out=out)
        with pytest.raises(MtpfError, match=rf"^{field}=.*{allowed}"):
            paged_decode_attention_triton(*args, out=out)
        assert_backend_refuses(paged_decode_attention, field, *args, out=out)
    assert poison.isnan().all()


# tuning argument: (value, what its message says it allows)
BAD_TUNING = {
    "num_splits": [(0, "None .* or 1 to 65535"), (-2, "1 to 65535"), (65536, "1 to 65535"), (2.0, "1 to 65535"),
                   (True, "1 to 65535")],
    "block_n": [(8, "a power of two >= 16"), (24, "a power of two >= 16"), (0, "a power of two"),
                (2**17, "at most 65536 here"), (16.0, "a power of two")],
    "num_warps": [(3, "one of 1, 2, 4, 8, 16, 32"), (64, "one of"), (0, "one of"), (4.0, "one of")],
    "fast_dot": [(1, "True or False"), ("yes", "True or False")],
    "num_stages": [(0, "None .* or 1 to 8"), (9, "1 to 8"), (2.0, "1 to 8"), (True, "1 to 8")],
}


@pytest.mark.parametrize("name, value, allowed", [(n, v, a) for n, cases in BAD_TUNING.items() for v, a in cases])
def test_tuning_arguments_the_kernel_cannot_launch_with_are_refused_by_the_provider(name, value, allowed):
    """The provider's tuning arguments (which the op does not take) are checked as its operands are: named, before
    anything is written."""
    args = [_ops()[n] for n in NAMES]
    out = torch.full_like(args[0], float("nan"))
    with ops.use_backend("triton"), pytest.raises(InputError, match=rf"^{name}=.*{allowed}"):
        paged_decode_attention_triton(*args, out=out, **{name: value})
    assert out.isnan().all()


def test_num_splits_past_what_int32_addresses_in_the_partials_is_refused():
    """The splits' partial rows [B, kv_heads, splits, G_PAD, D_PAD] (fp32) are addressed in int32: num_splits
    that would take them to 2^31 elements or more is refused naming it (on a GPU such a call wrote out of bounds).
    Here B = 2^15 (stride 0), 2 KV heads, tiles of 16 x 16: 127 splits fit, 128 do not."""
    a = _ops()
    b = 2**15
    big = dict(a, q=a["q"][:1].expand(b, 4, 16), gate=a["gate"][:1].expand(b, 4, 16),
               block_tables=a["block_tables"][:1].expand(b, -1), context_lens=a["context_lens"][:1].expand(b))
    args = [big[n] for n in NAMES]
    assert tuning_refusal(big["q"], big["k_cache"], 127, 16, 4, False) is None
    out, poison = _poisoned_for(big["q"])
    with pytest.raises(InputError, match=r"^num_splits=128: None .* or 1 to 127 here .*addressed in int32"):
        paged_decode_attention_triton(*args, out=out, num_splits=128)
    assert poison.isnan().all()


@pytest.mark.parametrize("case", ["q 2-D", "q heads not a multiple of KV heads", "k_cache of other D",
                                  "k_cache of no KV heads", "k_cache of no block size", "k_cache 5-D",
                                  "v_cache of other block size",
                                  "gate of other heads", "k_scale 2-D", "block_tables 1-D",
                                  "block_tables of fewer rows", "context_lens of fewer rows", "q int",
                                  "block_tables bool", "context_lens float"])
@pytest.mark.parametrize("backend", ["native", "auto"])
def test_shapes_no_provider_can_attend_with_are_refused_by_the_reference(case, backend):
    """Shapes that do not agree, which the reference met with a raw torch error (einsum, repeat_interleave,
    reshape, indexing) or read wrongly (a cache of another D reshaped into more tokens), are refused naming the
    operand, before anything is written; so are an integer q and bool or float block ids and lengths, which it
    read as numbers (bool ids as blocks 0 and 1)."""
    make, field, _ = BAD[case]
    args = make()
    out, poison = _poisoned_for(args[0])
    with ops.use_backend(backend), pytest.raises(InputError, match=rf"^{field}="):
        paged_decode_attention(*args, out=out)
    assert poison.isnan().all()


def test_block_ids_are_checked_against_the_cache_of_fewest_blocks():
    """A V cache (or scale) of fewer blocks than K's: an id past it, which the reference met with a raw
    IndexError, is refused naming the table's row (the first that uses the last block)."""
    args = _ops()
    nb = args["k_cache"].shape[0]
    args["block_tables"][1, 0] = nb - 1
    for name in ("v_cache", "v_scale"):
        short = dict(args, **{name: args[name][: nb - 1]})
        with pytest.raises(InputError, match=rf"^block_tables\[[01]\]={nb - 1}: .* lie in \[0, {nb - 1}\)"):
            paged_decode_attention.reference(*[short[n] for n in NAMES])


def test_the_reference_takes_what_only_the_kernel_refuses():
    """fp64 q, gate and cache, D past 512, FP8 E5M2 caches, a V cache of another dtype or more blocks, a gate that
    broadcasts, bf16 scales or more blocks of them, int16 context lengths, tables of more rows: the reference
    attends with them as with their plain form (under `auto` the op falls back to it)."""
    ref = paged_decode_attention.reference
    a = _ops()
    want = ref(*[a[n] for n in NAMES])

    def same(tol=None, **parts):
        got = ref(*[parts.get(n, a[n]) for n in NAMES])
        torch.testing.assert_close(got.to(want.dtype), want, **(tol or dict(atol=0, rtol=0)))

    same(gate=a["gate"].double(), tol=TOL[torch.bfloat16])  # the product rounds once, not twice
    same(v_cache=torch.cat([a["v_cache"], a["v_cache"]]), v_scale=torch.cat([a["v_scale"], a["v_scale"]]))
    same(block_tables=a["block_tables"].repeat(2, 1), context_lens=a["context_lens"].repeat(2))
    same(context_lens=a["context_lens"].short())
    same(q=a["q"].double(), tol=TOL[torch.bfloat16])
    same(k_scale=a["k_scale"].bfloat16(), tol=TOL[torch.bfloat16])
    gate = a["gate"][:, :, :1]
    torch.testing.assert_close(ref(*[dict(a, gate=gate)[n] for n in NAMES]),
                               ref(*[dict(a, gate=gate.expand_as(a["q"]))[n] for n in NAMES]), atol=0, rtol=0)
    wide = _heads(2, 1, 520)
    assert ref(*wide).isfinite().all()
    e5m2 = [t.to(torch.float8_e5m2) if i in (1, 2) else t for i, t in enumerate(wide)]
    assert ref(*e5m2).isfinite().all()
    with ops.use_backend("auto"):
        torch.testing.assert_close(paged_decode_attention(*[dict(a, gate=gate)[n] for n in NAMES]),
                                   ref(*[dict(a, gate=gate.expand_as(a["q"]))[n] for n in NAMES]), atol=0, rtol=0)


# --- GPU: realistic shapes (Qwen3-Next: 16 q / 2 kv heads, head_dim 256, block 16) -------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp8_scaled"])
@pytest.mark.parametrize("b", [1, 8, 32])
@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("fast_dot", [False, True])
def test_gpu_triton_matches_reference(b, kv, num_splits, fast_dot):
    lens = torch.randint(1000, 4001, (b,), generator=torch.Generator().manual_seed(b)).tolist()
    args = make_case(b, 16, 2, 256, 16, lens, kv, torch.bfloat16, seed=b, device="cuda")
    # tf32 dots on GPU: q.K is exact (16-bit and FP8 values fit tf32), p.V truncates p to 10 mantissa
    # bits (2**-10 relative); fast_dot rounds p to bf16 (2**-9) on a BF16 cache and to fp16 (2**-11) on an
    # FP8 one: all well inside the BF16 output tolerance.
    out = run_triton(*args, num_splits=num_splits, fast_dot=fast_dot)
    torch.testing.assert_close(out, run_native(*args), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp8_scaled"])
@pytest.mark.parametrize("num_stages, block_n", [(1, 16), (1, 32), (2, 64), (4, 16), (4, 64)])
@pytest.mark.parametrize("fast_dot", [False, True])
def test_gpu_pipeline_depths_and_tiles_match_reference(kv, num_stages, block_n, fast_dot):
    """The software pipeline's depth (`num_stages`, which the interpreter ignores) and the tile the sweep
    (scripts/sweep_attention.py) times: each launch still attends every token once."""
    lens = [4096, 1, 3001, 16, 2500, 0, 4095, 777]
    args = make_case(8, 16, 2, 256, 16, lens, kv, torch.bfloat16, seed=num_stages * 100 + block_n, device="cuda")
    out = run_triton(*args, num_stages=num_stages, block_n=block_n, fast_dot=fast_dot)
    torch.testing.assert_close(out, run_native(*args), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("kv, hq, d", [("bf16", 33, 256), ("bf16", 64, 128), ("bf16", 64, 256), ("bf16", 128, 128),
                                       ("bf16", 128, 256), ("fp8", 48, 256), ("fp8", 64, 128)])
def test_gpu_large_groups_up_to_d_256_run_the_kernel(kv, hq, d):
    """Large groups the provider takes (33-128 q heads on one KV head at D up to 256; 64 on FP8) match the
    reference at its defaults (4 warps, tf32 dots). scripts/probe_attention_groups.py measured these tiles right
    on an H100 (2026-12-05) but FP8's [64, 128]; this test itself has not yet run on a GPU."""
    args = make_case(2, hq, 1, d, 16, [300, 77], kv, torch.bfloat16, device="cuda")
    torch.testing.assert_close(run_triton(*args), run_native(*args), **TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_fp32_matches_reference():
    args = make_case(8, 16, 2, 256, 16, [1000 + 377 * i for i in range(8)], "fp32", torch.float32, device="cuda")
    torch.testing.assert_close(run_triton(*args), run_native(*args), **TOL[torch.float32])


def test_default_tiles_follow_the_cache():
    """The tiles the H100 sweep chose (BENCHMARKS.md, 2026-12-05): 32 tokens but where a [32, D] tile passes 32 KiB
    (fp32 at D 512, whose ring the GPU cannot hold: the tile of 16 that ran there)."""
    cache = lambda dtype: torch.zeros(1, 16, 1, 8, dtype=dtype)  # noqa: E731
    assert [_default_block_n(cache(dt), d) for dt, d in ((torch.float32, 512), (torch.float32, 256),
                                                         (torch.bfloat16, 512), (torch.float8_e4m3fn, 512))] == [
        16, 32, 32, 32]


def test_default_dots_follow_the_cache(monkeypatch):
    """fast_dot None: on for an FP8 cache (fp16 dots, tf32's numerics), off for the others; a given value kept."""
    import mtpfactory.kernels.paged_attention as pa
    seen, dot_dtype = [], pa._dot_dtype
    monkeypatch.setattr(pa, "_dot_dtype", lambda q, k, fast: seen.append(fast) or dot_dtype(q, k, fast))
    for kv, fast in (("fp8", None), ("bf16", None), ("fp16", None), ("fp32", None), ("fp8", False), ("bf16", True)):
        paged_decode_attention_triton(*make_case(1, 4, 2, 16, 16, [20], kv, torch.bfloat16), fast_dot=fast)
    assert seen == [True, False, False, False, False, True]


# (sequences, FP8's pick, BF16's pick) on an H100's 132 SMs, 2 KV heads a sequence, 4096 tokens, tiles of 32:
# (splits asked for, stages). FP8's picks were the fastest tunings the H100 sweeps timed, but at 32 sequences
# (0.2% off), and 56, 64 and 128 with unit scales (4-5%) (BENCHMARKS.md, twenty-third run)
TUNINGS = [
    (1, (64, 3), (64, 3)),      # 132 SMs would take 132 splits: 4096 tokens hold 64 of 64
    (8, (16, 3), (17, 3)),      # 3 stages: 264 places / 16 programs = 16 splits; 1 stage's 24 run as 22, 352 of 396
    (14, (9, 3), (10, 3)),      # one stage's 14 splits run as 13 (whole tiles): 364 of 396, under 252 of 264
    (16, (8, 3), (9, 3)),       # 256 of 264 and 384 of 396: a tie keeps 3 stages
    (24, (8, 1), (6, 3)),       # 240 of 264 against 384 of 396
    (32, (4, 3), (5, 3)),
    (40, (3, 3), (4, 3)),       # 240 of 264 against 320 of 396
    (48, (4, 1), (3, 3)),       # 192 of 264 against 384 of 396
    (64, (2, 3), (3, 3)),       # a tie
    (96, (2, 1), (2, 3)),       # 192 of 264 against 384 of 396
    (128, (1, 3), (2, 3)),      # 256 of 264 against 256 of 396
    (192, (1, 1), (1, 3)),      # 384 programs: two waves at 3 stages, one at 1
    (256, (1, 3), (1, 3)),      # 512: two waves either way, 512 of 528 against 512 of 792
    (320, (1, 1), (1, 3)),      # 640: 640 of 792 either way, in 3 waves against 2
]


@pytest.mark.parametrize("sequences, fp8_pick, bf16_pick", TUNINGS)
def test_default_tuning_fills_the_waves(sequences, fp8_pick, bf16_pick):
    """An FP8 cache: of one stage (3 programs an SM) and three (2), with the splits rounded down to each, the grid
    that fills its last wave best, then fewer waves, then 3 stages; a 16-bit cache outside the heads' kernel (fp32
    dots in "ieee" or 16-bit ones, or other tiles): 3 stages, the splits rounded up to two programs an SM."""
    assert _default_tuning(132, 2 * sequences, 4096, 32, True, None, None) == fp8_pick
    assert _default_tuning(132, 2 * sequences, 4096, 32, False, None, None) == bf16_pick


@pytest.mark.parametrize("sequences, tokens, pick", [
    (2, 4096, (64, 3)),      # 4096 tokens hold 64 splits of 64 either way
    (8, 4096, (17, 3)),      # 396 / 16 = 24 splits of 192 tokens, under 256: rounded up to 264 (16 run)
    (12, 4096, (16, 3)),     # 396 / 24 = 16 splits of 256: 384 programs (rounded up: 11)
    (24, 4096, (8, 3)),      # 81.57 us against 6 splits' 87.24 (H100)
    (48, 4096, (4, 3)),      # 148.84 against 3 splits' 165.84
    (64, 4096, (3, 3)),      # 164.22 us against 2 splits' 189.26 and 4 splits' 199.61 (H200)
    (96, 4096, (2, 3)),      # 243.74 against 4 splits' 247.65 (H200)
    (128, 4096, (3, 3)),     # one split left: the waves weighed (below)
    (192, 4096, (1, 3)),     # 384 programs: one split either way
    (4, 16384, (49, 3)),     # 47 splits of 352 tokens run
    (8, 16384, (24, 3)),     # 104.89 us against 17 splits' 112.65
    (12, 16384, (16, 3)),
    (16, 16384, (12, 3)),    # 166.02 us against 9 splits' 205.10 (H200)
    (128, 16384, (3, 3)),
])
def test_default_tuning_of_the_16_bit_kernel_rounds_down_to_3_programs_an_sm(sequences, tokens, pick):
    """A 16-bit q and cache with tf32 dots at _WAVE_TILES (3 programs an SM): the splits rounded down to 396 places
    where a split keeps 256 tokens and 2 splits are left, else rounded up to 264 as for the other kernels where
    they hold two splits or more, and the waves weighed where fewer; a depth given other than 3 keeps the rule
    before, whose SMs hold other counts."""
    assert _default_tuning(132, 2 * sequences, tokens, 32, False, None, None, tf32_16bit=True) == pick
    assert _default_tuning(132, 2 * sequences, tokens, 32, False, None, 3, tf32_16bit=True) == pick
    before = _default_tuning(132, 2 * sequences, tokens, 32, False, None, None)
    assert _default_tuning(132, 2 * sequences, tokens, 32, False, None, 1, tf32_16bit=True) == (before[0], 1)
    other = (16, 128, 32, 4)
    assert _default_tuning(132, 2 * sequences, tokens, 32, False, None, None, other, tf32_16bit=True) == before


@pytest.mark.parametrize("sequences, tokens, pick", [
    (99, 4096, 2),       # 198 programs: 396 places hold two splits, rounded down
    (100, 4096, 7),      # 320.12 us against 2 splits' 414.92, 3's 338.81, 5's 325.82 (H100)
    (128, 4096, 3),      # 377.51 against 2's 468.22, 7's 401.55 (H100); 335.64 against 1's 376.33, 2's 365.96 (H200)
    (160, 4096, 1),      # 488.71 against 7's 490.19, 2's 508.98 (H100)
    (180, 4096, 1),      # 520.69 against 2's 530.83 (H100)
    (192, 4096, 1),      # 481.39 against 2's 491.20 (H200)
    (100, 16384, 7),     # 1192.60 against 2's 1625.44, 5's 1226.27 (H100)
    (128, 16384, 3),     # 1445.48 against 2's 1759.77, 7's 1519.82 (H100)
    (112, 4096, 5),      # 331.95 against 2's 433.12 (H100; the rule before took 2 from 67 to 131 sequences)
    (118, 4096, 3),      # 347.11 against 5's 346.05, 8's 356.54 (H100; at most 7 splits)
    (136, 4096, 4),      # 401.11 against 1's 450.87 (H100; the rule before took 1 from 132 sequences)
    (154, 4096, 5),      # 450.81 against 1's 467.73 (H100)
    (200, 4096, 7),      # 604.71 against 1's 807.13, 8's 611.03 (H100)
    (256, 4096, 3),      # 723.45 against 1's 889.55 (H100)
    (320, 4096, 3),      # 902.66 against 1's 969.70, 8's 946.42 (H100)
    (112, 16384, 5),     # 1245.23 against 7's 1227.89, 2's 1653.62 (H100)
    (136, 16384, 7),     # 1516.02 against 4's 1535.13, 2's 1733.79 (H100)
    (100, 300, 1),       # no split of 256 tokens in 300
])
def test_default_tuning_of_the_16_bit_kernel_weighs_the_waves_where_its_sms_hold_fewer_than_two_splits(
        sequences, tokens, pick):
    """From 100 sequences at 2 KV heads the 396 places of 132 SMs hold fewer than two splits: of 1 to 7 splits
    of at least 256 tokens, the fewest whose waves take least time, a wave under 80% full counted as 80%. The
    figures are the sweep's (BENCHMARKS.md, twenty-seventh run)."""
    assert _default_tuning(132, 2 * sequences, tokens, 32, False, None, None, tf32_16bit=True) == (pick, 3)
    assert _bf16_wave_splits(396, 2 * sequences, tokens, 32) == pick
    assert _default_tuning(132, 2 * sequences, tokens, 32, False, 5, None, tf32_16bit=True) == (5, 3)  # given


def test_the_waves_weighed_count_a_wave_under_80_percent_full_as_80_percent():
    """396 places, 4096 tokens, 32 a tile: one split of 316 programs fills one wave 79.8%, counted as 80% (316
    places); 7 splits of 608 tokens run 6 waves, the last 59% full, counted as 80% too."""
    assert _bf16_wave_splits(396, 316, 4096, 32) == 1     # 4096 x 316 against 608 x (5 x 396 + 316): 1.29M, 1.40M
    assert _bf16_wave_splits(396, 200, 4096, 32) == 7     # 4096 x 316 against 608 x (3 x 396 + 316): 1.29M, 0.91M
    assert _bf16_wave_splits(396, 396, 4096, 32) == 1     # a full wave


@pytest.mark.parametrize("sequences, tokens, tie", [(16, 4096, (12, 1)), (32, 4096, (6, 1)), (56, 4096, (3, 1)),
                                                    (64, 4096, (3, 1)), (8, 16384, (24, 1)), (16, 16384, (12, 1)),
                                                    (32, 16384, (6, 1)), (64, 16384, (3, 1))])
def test_default_tuning_breaks_a_tie_of_fills_toward_one_stage_with_unit_scales(sequences, tokens, tie):
    """Where both depths fill their last wave alike, unit scales take one stage (the faster in 6 of these 8 on an
    H100, by up to 5%; 0.2-0.6% slower in the other 2), per-token scales 3 stages (1-3% faster there)."""
    assert _default_tuning(132, 2 * sequences, tokens, 32, True, None, None, unit_scales=True) == tie
    scaled = _default_tuning(132, 2 * sequences, tokens, 32, True, None, None)
    assert scaled[1] == 3 and scaled != tie
    assert _default_tuning(132, 2 * 24, 4096, 32, True, None, None, unit_scales=True) == (8, 1)   # no tie: as before
    assert _default_tuning(132, 2 * 8, 4096, 32, True, None, None, unit_scales=True) == (16, 3)


def test_default_tuning_keeps_what_the_caller_gave():
    assert _default_tuning(132, 2 * 192, 4096, 32, True, 1, None) == (1, 1)   # splits given: stages by the waves
    assert _default_tuning(132, 2 * 256, 4096, 32, True, 1, None) == (1, 3)
    assert _default_tuning(132, 2 * 32, 4096, 32, True, None, 1) == (6, 1)    # one stage: rounded down to 396
    assert _default_tuning(132, 2 * 24, 4096, 32, True, None, 3) == (5, 3)    # three: to 264
    assert _default_tuning(132, 2 * 24, 4096, 32, True, 7, 2) == (7, 2)
    assert _default_tuning(132, 2 * 24, 4096, 32, False, 7, 1) == (7, 1)


@pytest.mark.parametrize("tiles", [(16, 128, 32, 4), (32, 256, 32, 4), (16, 256, 64, 4), (16, 256, 32, 8)])
def test_default_tuning_of_fp8_at_other_tiles_is_the_one_before_the_sweeps(tiles):
    """Tiles whose SMs hold other counts (and were not timed): one stage, the splits rounded up."""
    assert _default_tuning(132, 2 * 24, 4096, tiles[2], True, None, None, tiles) == (6, 1)
    assert _default_tuning(132, 2 * 24, 4096, tiles[2], True, None, 3, tiles) == (6, 3)
    assert _default_tuning(132, 2 * 24, 4096, 32, True, None, None) == (8, 1)       # at _WAVE_TILES


def test_the_launcher_passes_its_tiles_to_the_default_tuning(monkeypatch):
    """The heads' shapes (16 q heads on 2 or 4 KV heads, D 256) at the default tile and warps are _WAVE_TILES; unit
    scales are said as such."""
    import mtpfactory.kernels.paged_attention as pa
    seen = []
    monkeypatch.setattr(pa, "_default_tuning", lambda *a, **k: seen.append((a[-1], k["unit_scales"])) or (1, 3))
    for hkv, d, warps, kv in ((2, 256, 4, "fp8"), (4, 256, 4, "fp8_scaled"), (2, 128, 4, "fp8"), (2, 256, 8, "fp8")):
        args = make_case(1, 16, hkv, d, 16, [40], kv, torch.bfloat16)
        paged_decode_attention_triton(*args, num_warps=warps)
    assert seen == [(pa._WAVE_TILES, True), (pa._WAVE_TILES, False), ((16, 128, 32, 4), True),
                    ((16, 256, 32, 8), True)]


def test_the_launcher_says_which_16_bit_calls_run_the_heads_kernel(monkeypatch):
    """tf32_16bit: a 16-bit q and cache with fp32 dots (tf32), the kernel whose 3 programs an SM the 16-bit rounding
    down counts; an fp32 q or cache runs "ieee" dots, and an FP8 cache (tf32 dots too without fast_dot) its own
    kernel."""
    import mtpfactory.kernels.paged_attention as pa
    seen = []
    monkeypatch.setattr(pa, "_default_tuning", lambda *a, **k: seen.append(k["tf32_16bit"]) or (1, 3))
    for kv, q_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("bf16", torch.float32),
                        ("fp32", torch.bfloat16), ("fp8", torch.bfloat16)):
        paged_decode_attention_triton(*make_case(1, 16, 2, 256, 16, [40], kv, q_dtype), fast_dot=False)
    assert seen == [True, True, False, False, False]


def test_default_tuning_keeps_64_tokens_a_split_and_at_most_64():
    assert _default_tuning(132, 2, 16384, 32, True, None, None) == (64, 3)    # 256 of 64 tokens would fit: 64
    assert _default_tuning(132, 2, 1000, 32, False, None, None) == (15, 3)    # 1000 // 64
    assert _default_tuning(132, 2, 4096, 32, False, None, None) == (64, 3)    # one sequence: 64 splits of 64 tokens
    assert _default_tuning(132, 2, 50, 32, True, None, None) == (1, 3)        # shorter than a split of 64
    assert _default_tuning(132, 2, 4096, 256, False, None, None) == (16, 3)   # tiles of 256: a split a tile at least
    assert _default_tuning(0, 2, 4096, 32, True, None, None) == (1, 3)        # the CPU: one split
    assert _default_tuning(0, 2, 4096, 32, True, 5, 1) == (5, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("into", ["q", "gate"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_in_place_on_q_or_the_gate(kv, into, num_splits):
    """`out` q or the gate itself at Qwen3-Next's heads, 8 sequences of up to 4000 tokens (the default splits, and
    one): bit for bit the provider's answer into a buffer of its own."""
    lens = torch.randint(1000, 4001, (8,), generator=torch.Generator().manual_seed(8)).tolist()
    args = make_case(8, 16, 2, 256, 16, lens, kv, torch.bfloat16, seed=8, device="cuda")
    want = run_triton(*args, num_splits=num_splits)
    out = args[NAMES.index(into)]
    with ops.use_backend("triton"):
        assert paged_decode_attention_triton(*args, out=out, num_splits=num_splits) is out
    assert torch.equal(out, want)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("b", [1, 32])
def test_a_growing_sequence_compiles_few_variants_of_its_kernels(monkeypatch, kv, b):
    """Triton compiles a kernel once for each constexpr value and launch option, and for each integer argument that
    is 1 or a multiple of 16 (unless `do_not_specialize` names it). With the split count a constexpr, Qwen3-Next's
    attention kernel took 75 variants over one sequence's first 4096 tokens at an H100's 132 SMs (16 over 1024,
    and the reduce 15: BENCHMARKS, thirty-first run), each a compile of 0.1-0.5 s in the middle of decoding. The
    keys of the launches over those contexts, as Triton forms them (the launches stubbed): at most 3 of the
    attention kernel, one split or several and the pipeline depth the rule picks (an FP8 cache at 32 sequences
    lowers it as the context grows); of the reduce, one for each power of two of chunk up to the 64 splits a
    default takes at most, each chunk folded without a loop."""
    pa = importlib.import_module("mtpfactory.kernels.paged_attention")
    monkeypatch.setattr(pa, "sm_count", lambda device: 132)
    keys = {"attention": set(), "reduce": set()}

    def stub(name, kernel):
        params = list(inspect.signature(kernel.fn).parameters)
        loose = set(kernel.kwargs.get("do_not_specialize") or ())

        def launch(*args, **kwargs):
            ints = tuple((a == 1, a % 16 == 0) for p, a in zip(params, args) if type(a) is int and p not in loose)
            keys[name].add((ints, tuple(sorted((k, str(v)) for k, v in kwargs.items()))))
        return type("Stub", (), {"__getitem__": lambda self, grid: launch})()
    monkeypatch.setattr(pa, "_paged_decode_kernel", stub("attention", pa._paged_decode_kernel))
    monkeypatch.setattr(pa, "_paged_decode_reduce_kernel", stub("reduce", pa._paged_decode_reduce_kernel))
    dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    bs, width = 16, 4096 // 16
    q = torch.zeros(b, 16, 256, dtype=torch.bfloat16)
    k = torch.zeros(b * width, bs, 2, 256, dtype=dtype)
    table = torch.arange(b * width, dtype=torch.int32).view(b, width)
    for context in range(1, 4097, 3):
        w = (context - 1) // bs + 1
        pa.paged_decode_attention_launch(q, k, k, table[:, :w].contiguous(), torch.full((b,), context), 0.0625,
                                         gate=q)
    assert 2 <= len(keys["attention"]) <= 3, keys["attention"]  # both forms ran: one split at first, then more
    assert 1 <= len(keys["reduce"]) <= 6, keys["reduce"]        # chunks of 2, 4, ... 64 splits
    assert all(("LOOP", "False") in kw for _, kw in keys["reduce"]), keys["reduce"]
