"""y = x @ W^T: the GEMV (M = 1) and small-M GEMM of every projection and of the LM head.

Triton provider (M <= 32, memory-bound on the H200): each program owns a BLOCK_N tile of output rows and
walks K in BLOCK_K chunks, loading each weight tile once for all M rows of x, accumulating in fp32.
- M = 1 (BLOCK_M < 16): CUDA-core FMAs into a [BLOCK_M, BLOCK_N, BLOCK_K] accumulator, reduced over K
  once at the end.
- 2 <= M <= 32: `tl.dot` on a [BLOCK_M in {16, 32}, BLOCK_K] x [BLOCK_K, BLOCK_N] tile, operands in x's
  dtype on the GPU (bf16 x bf16 products are exact in the fp32 accumulator), fp32 ("ieee") in the
  interpreter, whose dot reads bf16 as raw bits. Large FP8 weights with bf16 x run it in fp16
  (`_x_f16_rows_kernel` scales each row of x into fp16 by a power of two first, `F16_DOT_MIN_ELEMENTS`).
- 2 <= M <= 32 on 16-bit weights of `TMA_MIN_N` to `TMA_MAX_N` rows (projections such as 8192 x 2048) on
  sm_90 and later: `_linear_tma_kernel`, the same dot with its weight and x tiles brought in by TMA and the
  loop pipelined by Triton (`GemvPlan.tma`).
- split-K (`split_k=True`, for tall-skinny weights such as 2048 x 4096): a second grid axis cuts K into
  SPLIT slices; each program writes its fp32 partial sums to a [SPLIT, M, N] buffer and a second kernel
  sums the slices in a fixed order (deterministic, unlike atomics), scales and casts.
The FP8 and NVFP4 linears (`linear_fp8.py`, `linear_nvfp4.py`) share the plan and the split-K reduction.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from mtpfactory import ops
from mtpfactory.errors import InputError, MtpfError, WeightsError
from mtpfactory.kernels.fp_bits import pow2, times_pow2
from mtpfactory.ops import FLOATS, Op, cdiv, next_power_of_2

MAX_M = 32
_SM_COUNT_H200 = 132


def activation_refusal(x: torch.Tensor) -> InputError | None:
    """Why x cannot be a linear's activations, or None: a bf16, fp16 or fp32 [..., K] tensor (the first rule of
    every linear's contract, `linear_contract` and `nvfp4_contract`)."""
    if x.dim() == 0 or x.dtype not in FLOATS:
        return InputError("x", f"{x.dtype} {tuple(x.shape)}", "a bf16, fp16 or fp32 [..., K] tensor",
                          "pass the activations in the run's dtype, K last")
    return None


def linear_contract(x: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor | None = None) -> InputError | WeightsError | None:
    """Why the reference cannot multiply these, or None (every provider refuses the same calls): x a
    bf16, fp16 or fp32 [..., K]; weight [N, K] of x's dtype, or with `weight_scale` (`linear_fp8`)
    float8_e4m3fn beside a float32 [N] scale."""
    if err := activation_refusal(x):
        return err
    k = x.shape[-1]
    want = x.dtype if weight_scale is None else torch.float8_e4m3fn
    if weight.dim() != 2 or weight.dtype != want or weight.shape[1] != k:
        return WeightsError("weight", f"{weight.dtype} {tuple(weight.shape)}, strides {weight.stride()}",
                            f"a {want} [N, K = {k}] tensor (x is {x.dtype} {list(x.shape)})",
                            f"pass a {want} weight of K = {k}, the layer's [out_features, in_features]")
    if weight_scale is not None and (weight_scale.dtype != torch.float32
                                     or tuple(weight_scale.shape) != (weight.shape[0],)):
        return WeightsError("weight_scale", f"{weight_scale.dtype} {tuple(weight_scale.shape)}",
                            f"a float32 [N] = [{weight.shape[0]}] tensor, one scale a row",
                            "pass the scale quantize_fp8 made with this weight")
    return None


def _linear_native(x: torch.Tensor, weight: torch.Tensor, split_work: bool = True) -> torch.Tensor:
    """x: [..., K]; weight: [N, K] in x's dtype (`linear_contract`). Returns [..., N]. `split_work`
    (levers.gemv_split_work) picks the fast providers' split-K variant; the result is the same either way."""
    if err := linear_contract(x, weight):
        raise err
    return torch.nn.functional.linear(x, weight)


linear = Op("linear", _linear_native, lambda x, weight, split_work=True: linear_contract(x, weight))


# --- plan: tile sizes by shape -------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemvPlan:
    """Tile sizes and K split of one launch. `block_m >= 16` selects the `tl.dot` path, `swap_ab` computes
    it as (W x^T)^T, the weight tile the dot's first operand; `k_per_split` is a multiple of `block_k` (the
    whole of K, rounded up, when `splits == 1`). `wgmma` (NVFP4 only, one K slice): NVFP4's Gluon kernel
    (`gemm_nvfp4_wgmma.py`) runs the call on its own tile, not the Triton kernel these sizes would pick.
    `tma` (16-bit weights, the dot path, one K slice): `_linear_tma_kernel` runs it on these tiles, its loop
    `num_stages` deep (`tma_refusal` says where it cannot). `plan_shape_refusal` says which tiles Triton can build
    (a plan given to a provider is checked)."""
    block_m: int
    block_n: int
    block_k: int
    splits: int
    k_per_split: int
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    wgmma: bool = False
    tma: bool = False

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16


@dataclass(frozen=True)
class Tile:
    """The launch of one M class: (BLOCK_N, BLOCK_K) for a weight with many rows, warps, pipelining depth
    (`num_stages`; the NVFP4 kernels load `stages - 1` K steps ahead themselves) and, on the dot path,
    `swap_ab`: a dot tile of 64 rows or more computes (W x^T)^T, the weight tile the dot's first operand."""
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    swap_ab: bool = False


@dataclass(frozen=True)
class TileTable:
    """The tiles of one weight format by M class: M = 1 (`m1`, the GEMV), 2 to `max_gemv_m` (`rows`, the GEMV
    of several rows; m1's when None), M <= 16 and M <= 32 (`m16`, `m32`: tl.dot), for weights with many rows
    (LM heads). A weight with fewer than `min_tiles` N tiles (GEMV) or `min_tiles_dot` (tl.dot) gets half
    the rows and twice the K per tile until it has them (BLOCK_K up to `max_block_k_fma` / `max_block_k_dot`,
    BLOCK_N down to 1 / `min_block_n_dot`). Split-K then adds K slices while the N tiles are fewer than one
    per SM (GEMV) or `dot_programs` (at most 8 slices). BLOCK_K counts weight elements. The values are the
    fastest of the H200 sweeps of 2026-12-02 and -03 (`scripts/tune_gemv.py`: CUDA graphs, weights rotated
    past the L2) at 151936 x 2048, 8192 x 2048 and 2048 x 4096. `tma`: the TMA kernel's tile at M = 2-32 for
    weights of `TMA_MIN_N` to `tma_max_n` rows (None: the format has no TMA kernel)."""
    m1: Tile
    m16: Tile
    m32: Tile
    rows: Tile | None = None
    max_gemv_m: int = 1
    min_tiles: int = 1024
    min_tiles_dot: int = 2 * _SM_COUNT_H200
    max_block_k_fma: int = 2048
    max_block_k_dot: int = 256
    dot_programs: int = 256
    min_block_k: int = 16                       # the smallest BLOCK_K: a GPU tl.dot needs K >= 16
    min_block_n_dot: int = 32
    tma: Tile | None = None

    @property
    def tma_max_n(self) -> int:
        """The most rows a weight can have and still take `tma`: the last count whose `m32` tiles get fewer rows."""
        return (self.min_tiles_dot - 1) * self.m32.block_n


# 16-bit weights of TMA_MIN_N rows up to TMA_MAX_N (where `TILES_16BIT`'s dot tiles have fewer than 128 rows)
# run at M = 2-32 on the TMA kernel, on TMA_TILE, where the GPU has TMA (sm_90 on) and the operands' layout
# lets it (`tma_refusal`). H200, one process, 3 alternating rounds (BENCHMARKS.md, thirteenth run AD): 8192 x
# 2048 at M = 2 / 8 / 16 / 32 10.75 / 10.75 / 10.76 / 10.96 us on 64 x 128 tiles of 4 stages, against 11.07 /
# 11.09 / 11.24 / 11.92 for the pointer-loaded dot and 11.25 / 11.18 / 11.23 / 11.34 for cuBLAS; 128-row TMA
# tiles 11.24-11.49, 64 x 64 ones 11.44-13.57 at 4-6 stages. On 151936 x 2048 the two Triton kernels were
# within 1% (the pointer dot ahead at M <= 16), and on 512 x 2048 (8 tiles) the TMA kernel was behind.
TMA_TILE = Tile(64, 128, warps=4, stages=4)
TILES_16BIT = TileTable(m1=Tile(2, 1024), m16=Tile(128, 128), m32=Tile(128, 128), tma=TMA_TILE)
# FP8 with the NVFP4 rules (64-row swapped tiles at M = 32, 16-row tiles on small weights) ran slower on 5
# of the 10 M = 8 / 32 shapes of the 2026-12-03 benchmark (2048 x 4096, M = 8: 9.7 against 7.6 us): kept.
TILES_FP8 = TileTable(m1=Tile(16, 256), m16=Tile(64, 256), m32=Tile(128, 128))
_MAX_SPLITS = 8
TMA_MIN_N, TMA_MAX_N = 8192, TILES_16BIT.tma_max_n
TMA = True                  # False plans without the TMA kernel (benchmarks compare the two in one process)


def make_plan(m: int, n: int, k: int, block_n: int, block_k: int, splits: int = 1, block_m: int | None = None,
              num_warps: int = 4, num_stages: int = 3, swap_ab: bool = False, tma: bool = False) -> GemvPlan:
    """A plan with explicit tiles (the planner, tests and tuning sweeps); K is cut into `splits` slices of
    whole BLOCK_K chunks (fewer when K has fewer chunks)."""
    block_m = block_m or _block_m(m)
    k_chunks = max(1, cdiv(k, block_k))
    k_per_split = cdiv(k_chunks, max(1, min(splits, k_chunks))) * block_k
    splits = max(1, cdiv(k, k_per_split))                   # no empty slice
    return GemvPlan(block_m, block_n, block_k, splits, k_per_split, num_warps, num_stages, swap_ab, tma=tma)


def _block_m(m: int) -> int:
    """1 for a GEMV (CUDA-core FMAs); else 16 or 32 rows of x on the tensor cores, which beat FMAs from
    M = 2 on (M = 8: 8.4 us against 18 us at 4096 x 2048 BF16)."""
    return 1 if m <= 1 else 16 if m <= 16 else 32


@functools.lru_cache(maxsize=1024)
def plan_for(m: int, n: int, k: int, split_k: bool, tiles: TileTable = TILES_16BIT, tma: bool = False) -> GemvPlan:
    """The launch of `tiles`' M class, narrowed for weights with few rows as `TileTable` says; BLOCK_K
    shrinks to K (rounded up to a power of two, at least `tiles.min_block_k`); `split_k` adds K slices
    where the N tiles alone leave SMs idle. M up to `tiles.max_gemv_m` runs as a GEMV on the CUDA cores
    (block_m M rounded up to a power of two), larger M on the tensor cores. `tma` (the call can run the TMA
    kernel: `tma_refusal` is None): weights of `TMA_MIN_N` to `tiles.tma_max_n` rows take `tiles.tma` there,
    where the table has one (16-bit weights: `TMA_TILE`, up to `TMA_MAX_N`)."""
    bm = 1 << (m - 1).bit_length() if m <= tiles.max_gemv_m else _block_m(m)
    gemv = bm < 16
    if tma and not gemv and tiles.tma and TMA_MIN_N <= n <= tiles.tma_max_n:
        t = tiles.tma
        return make_plan(m, n, k, t.block_n, t.block_k, block_m=bm, num_warps=t.warps, num_stages=t.stages,
                         tma=True)
    tile = (tiles.m1 if bm == 1 else tiles.rows or tiles.m1) if gemv else tiles.m16 if bm == 16 else tiles.m32
    bn, bk = tile.block_n, tile.block_k
    min_tiles, min_bn, max_bk, programs = ((tiles.min_tiles, 1, tiles.max_block_k_fma, _SM_COUNT_H200) if gemv
                                           else (tiles.min_tiles_dot, tiles.min_block_n_dot, tiles.max_block_k_dot,
                                                 tiles.dot_programs))
    while cdiv(n, bn) < min_tiles and bn > min_bn:
        bn, bk = bn // 2, min(2 * bk, max_bk)
    bk = min(bk, max(tiles.min_block_k, next_power_of_2(max(k, 1))))
    n_tiles = cdiv(n, bn)
    splits = min(cdiv(programs, n_tiles), _MAX_SPLITS) if split_k else 1
    return make_plan(m, n, k, bn, bk, splits=splits, block_m=bm, num_warps=tile.warps, num_stages=tile.stages,
                     swap_ab=tile.swap_ab and not gemv and bn >= 64)


# --- kernels -------------------------------------------------------------------------------------------------

@triton.jit
def _linear_kernel(x_ptr, exp_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
                   stride_xm, stride_xk, stride_wn, stride_om, stride_on,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   USE_DOT: tl.constexpr, LOWP_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
                   SPLIT: tl.constexpr, ROW_SCALE: tl.constexpr, X_EXP: tl.constexpr, PDL: tl.constexpr):
    """out = x @ W^T for a BF16/FP16/FP32 weight, or (ROW_SCALE) an FP8 weight times its per-row scale,
    applied here or, split-K, by the reduce pass. E4M3 values are exact in fp32 and in 16-bit dots. X_EXP
    (the dot path): x is `_x_f16_rows_kernel`'s fp16 rows, row m times 2^exp[m], undone on the fp32 sums.
    PDL: launched beside x's pass (`x_pass_pdl`), so it reads x after that pass ends."""
    if PDL:
        gdc_wait()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)                                   # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN]
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm                     # [BM, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn        # [BN, 1]
    k_start = pid_k * k_per_split
    if USE_DOT:
        acc = dot_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    elif BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_start + k0 + tl.arange(0, BLOCK_K)                # [BK]
        mask_k = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)   # [BN, BK]
        if not X_EXP:   # (with X_EXP the dot widens the E4M3 tile straight to fp16: one conversion a pair)
            w = w.to(tl.float32)
        if BLOCK_M == 1:                                             # x as a vector: no layout shuffle
            x1 = tl.load(x_ptr + offs_k * stride_xk, mask=mask_k & (M > 0), other=0.0).to(tl.float32)
            acc2 += x1[None, :] * w                                  # [BN, BK]
        else:
            x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0).to(tl.float32)                    # [BM, BK]
            if USE_DOT:
                acc = dot_acc(x, w, acc, x_ptr.dtype.element_ty, LOWP_DOT, SWAP_AB)
            else:
                acc3 += x[:, None, :] * w[None, :, :]                # [BM, BN, BK]
    if USE_DOT:
        acc = dot_result(acc, SWAP_AB)                               # [BM, BN]
        if X_EXP:   # row m's 2^-exp[m]
            acc = times_pow2(acc, -tl.load(exp_ptr + offs_m, mask=mask_m, other=0)[:, None])
    elif BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]                          # [1, BN]
    else:
        acc = tl.sum(acc3, axis=2)                                   # [BM, BN]
    if ROW_SCALE and not SPLIT:
        acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    store_tile(acc, out_ptr, part_ptr, pid_k, offs_m, offs_n, mask_m, mask_n, M, N, stride_om, stride_on, SPLIT)


@triton.jit
def x_exponent(x_ptr, k_start, k_end, stride_xk, BLOCK: tl.constexpr):
    """The power of two e (int32) that puts the largest |x| of x[k_start:k_end] in [2^11, 2^12): amax lies in
    [2^(E - 127), 2^(E - 126)) for its biased exponent E, so x * 2^(138 - E) stays below 2^12. e is at most
    127 (a scale fp32 holds): a slice whose largest |x| is below 2^-116 keeps x * 2^127 smaller. BLOCK
    (`x_scan_block`) covers the slice in one load where it can: each further one waits for the last."""
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        xv = tl.load(x_ptr + offs * stride_xk, mask=offs < k_end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(xv))
    return amax_exponent(tl.max(amax, axis=0))


@triton.jit
def amax_exponent(amax):
    """`x_exponent`'s e from the slice's largest |x| (fp32, not negative)."""
    return tl.minimum(138 - (amax.to(tl.int32, bitcast=True) >> 23), 127)


@triton.jit
def _x_f16_rows_kernel(x_ptr, x16_ptr, exp_ptr, K, stride_xm, stride_xk, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """x's pass for the FP8 dot, one program a row m of x [M, K]: its exponent e (`x_exponent`) to exp[m]
    and x[m] * 2^e in fp16 to x16[m] ([M, K], contiguous). Exact for every x whose magnitude is at least
    2^-25 of its row's largest (fp16's normal range below the top); the dot's fp32 sums undo 2^e. PDL: the
    dot may launch at once (`x_pass_pdl`)."""
    if PDL:
        gdc_launch_dependents()
    m = tl.program_id(0)
    row = x_ptr + m * stride_xm
    e = x_exponent(row, 0, K, stride_xk, BLOCK)
    tl.store(exp_ptr + m, e)
    x_scale = pow2(e)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        v = tl.load(row + offs * stride_xk, mask=offs < K, other=0.0).to(tl.float32) * x_scale
        tl.store(x16_ptr + m * K + offs, v.to(tl.float16), mask=offs < K)


@triton.jit
def _linear_tma_kernel(x_desc, w_desc, out_ptr, M, N, K, stride_om, stride_on,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOWP_DOT: tl.constexpr):
    """out = x @ W^T for 2 <= M <= BLOCK_M and a 16-bit weight, as `_linear_kernel`'s swapped dot, its tiles
    loaded by TMA through the descriptors (x [M, K] in blocks [BLOCK_M, BLOCK_K], W [N, K] in [BLOCK_N,
    BLOCK_K]; rows and K past the ends read as zeros); Triton pipelines the loop `num_stages` deep."""
    pid_n = tl.program_id(0)
    acc = dot_zeros(BLOCK_M, BLOCK_N, True)                          # [BN, BM]
    for k0 in range(0, K, BLOCK_K):
        w = w_desc.load([pid_n * BLOCK_N, k0])                       # [BN, BK]
        x = x_desc.load([0, k0])                                     # [BM, BK]
        acc = dot_acc(x, w, acc, x_desc.dtype, LOWP_DOT, True)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    store_tile(dot_result(acc, True), out_ptr, out_ptr, 0, offs_m, offs_n, offs_m < M, offs_n < N, M, N,
               stride_om, stride_on, False)


@triton.jit
def dot_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """The dot path's fp32 accumulator: [BM, BN], or [BN, BM] with SWAP_AB."""
    if SWAP_AB:
        return tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@triton.jit
def dot_acc(x, w, acc, x_dtype: tl.constexpr, LOWP_DOT: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc += x [BM, BK] @ w [BN, BK]^T (with SWAP_AB: acc^T += w @ x^T). With LOWP_DOT the operands go to
    the tensor cores in x's dtype (the weight values must be exact in it); otherwise an fp32 dot without
    TF32 rounding (a 16-bit decoded weight widened first)."""
    if LOWP_DOT:
        x = x.to(x_dtype)
        w = w.to(x_dtype)
        if SWAP_AB:
            return tl.dot(w, tl.trans(x), acc)
        else:
            return tl.dot(x, tl.trans(w), acc)
    else:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
        if SWAP_AB:
            return tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            return tl.dot(x, tl.trans(w), acc, input_precision="ieee")


@triton.jit
def dot_result(acc, SWAP_AB: tl.constexpr):
    """The dot path's accumulator as [BM, BN]."""
    if SWAP_AB:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def store_tile(acc, out_ptr, part_ptr, pid_k, offs_m, offs_n, mask_m, mask_n, M, N, stride_om, stride_on,
                SPLIT: tl.constexpr):
    """Write a [BM, BN] fp32 tile: cast into `out`, or (split-K) into slice `pid_k` of the [SPLIT, M, N]
    partial buffer, which `_splitk_reduce_kernel` finishes."""
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        ptrs = part_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)
    else:
        ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(part_ptr, scale_ptr, out_ptr, M, N, splits, stride_om, stride_on,
                          SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum_s part[s, m, n] (slices in order) * scale; SCALE: 0 none, 1 per output row n
    (scale_ptr [N]), 2 one fp32 scalar (scale_ptr [1])."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)            # flat index into [M, N]
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if SCALE == 1:
        acc = acc * tl.load(scale_ptr + n, mask=mask, other=0.0)
    elif SCALE == 2:
        acc = acc * tl.load(scale_ptr)
    tl.store(out_ptr + (offs // N) * stride_om + n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --- host side -----------------------------------------------------------------------------------------------

def x_scan_block(span: int, cap: int = 8192) -> int:
    """BLOCK for `x_exponent` and x's passes: the whole span of x in one load, up to `cap` elements."""
    return min(next_power_of_2(span), cap)


# Triton 3.6 on NVIDIA GPUs: a `tl.dot` of 16-bit or fp32 operands takes K >= 16 (`min_dot_size`; the
# interpreter takes any K, so a smaller block_k passes the CPU tests and fails to compile on the GPU).
MIN_DOT_K = 16
TMA_MAX_BOX = 256            # a TMA box's sides, in elements (cuTensorMapEncodeTiled's boxDim)


def _is_pow2(v: int) -> bool:
    return isinstance(v, int) and v > 0 and v & (v - 1) == 0


def plan_shape_refusal(plan: GemvPlan) -> InputError | None:
    """Why Triton cannot build a given plan's kernels whatever the call, as the error `linear_triton` and
    `linear_nvfp4_triton` (`plan_refusal`) raise, or None: block_m 1, 2, 4, 8 (CUDA cores) or 16, 32 (`tl.dot`);
    block_n and block_k powers of two (`tl.arange`, block shapes, TMA blocks); block_k at least MIN_DOT_K on
    the dot path; the weight tile block_n x block_k (times block_m on the CUDA-core rows path, whose
    accumulator holds all three) at most Triton's largest tensor; splits at least 1; num_warps a power of
    two up to 32 (1024 threads); num_stages at least 1. A TMA plan's blocks then meet TensorDescriptor's
    rules: power-of-two sides, and rows of 16 bytes or more (block_k >= 16 of its 16-bit elements), and the
    hardware's: boxes of at most 256 elements a side. The planner's plans pass."""
    for name, value, ok, says in (
            ("block_m", plan.block_m, plan.block_m in (1, 2, 4, 8, 16, 32),
             f"1, 2, 4 or 8 (CUDA cores), 16 or 32 (tl.dot): power-of-two tiles of up to {MAX_M} rows"),
            ("block_n", plan.block_n, _is_pow2(plan.block_n), "a power of two (Triton's tiles are)"),
            ("block_k", plan.block_k, _is_pow2(plan.block_k), "a power of two (Triton's tiles are)")):
        if not ok:
            return InputError(f"plan.{name}", value, says, f"make the plan with another {name}, or leave plan=None")
    if plan.use_dot and plan.block_k < MIN_DOT_K:
        return InputError("plan.block_k", plan.block_k, f"at least {MIN_DOT_K} on the tl.dot path (block_m "
                          f"{plan.block_m}): the GPU's dot takes K >= {MIN_DOT_K}",
                          f"make the plan with block_k >= {MIN_DOT_K}, or leave plan=None")
    if plan.tma:
        for name, value in (("block_n", plan.block_n), ("block_k", plan.block_k)):
            if value > TMA_MAX_BOX:
                return InputError(f"plan.{name}", value, f"at most {TMA_MAX_BOX} on a TMA plan (a TMA box's "
                                  "sides: the hardware's limit)", f"make the plan with {name} <= {TMA_MAX_BOX}, or "
                                  "tma=False")
    rows = plan.block_m if plan.block_m < 16 else 1
    if rows * plan.block_n * plan.block_k > tl.TRITON_MAX_TENSOR_NUMEL:
        return InputError("plan", f"block_m {plan.block_m} x block_n {plan.block_n} x block_k {plan.block_k}",
                          f"a tile of at most {tl.TRITON_MAX_TENSOR_NUMEL} elements (block_n x block_k, times "
                          "block_m below 16): Triton's largest tensor", "make the plan with smaller tiles")
    for name, value, ok, says in (("splits", plan.splits, plan.splits >= 1, "at least 1"),
                                  ("num_warps", plan.num_warps, _is_pow2(plan.num_warps) and plan.num_warps <= 32,
                                   "a power of two up to 32"),
                                  ("num_stages", plan.num_stages, plan.num_stages >= 1, "at least 1")):
        if not ok:
            return InputError(f"plan.{name}", value, says, f"make the plan with {name} {says}")
    return None


def k_slices_refusal(plan: GemvPlan, k: int) -> InputError | None:
    """Why a given plan's K slices cannot serve K, or None: each slice whole block_k steps (a slice reads its
    steps to the end, so another length overlaps the next slice), together covering K (K past them is never
    read), none empty past K (the NVFP4 kernels read a slice's steps unmasked). `make_plan` makes such plans."""
    covers = (plan.splits - 1) * plan.k_per_split < k <= plan.splits * plan.k_per_split
    if k == 0:                  # nothing to read: one slice, which reads nothing (make_plan's plan for K = 0)
        covers = plan.splits == 1
    if plan.k_per_split <= 0 or plan.k_per_split % plan.block_k or not covers:
        return InputError("plan", f"{plan.splits} K slices of {plan.k_per_split}", f"slices of whole block_k = "
                          f"{plan.block_k} steps that cover K = {k}, none of them empty",
                          f"make the plan for K = {k}: make_plan(m, n, {k}, ...)")
    return None


def int32_reach(t: torch.Tensor) -> bool:
    """Whether int32 offsets reach every element of a 2-D tensor, as the kernels index x and out: its last
    element less than 2^31 elements past its first. A contiguous [M, N] of fewer than 2^31 elements is reached."""
    return (t.shape[0] - 1) * t.stride(0) + (t.shape[1] - 1) * t.stride(1) < 2**31


def lowp_dot(x: torch.Tensor) -> bool:
    """Feed `tl.dot` 16-bit operands: on the GPU for bf16/fp16 x; never in the interpreter (raw bits)."""
    return x.is_cuda and x.dtype != torch.float32


def partial_buffer(plan: GemvPlan, m: int, n: int, x: torch.Tensor) -> torch.Tensor | None:
    if plan.splits == 1:
        return None
    return torch.empty((plan.splits, m, n), dtype=torch.float32, device=x.device)   # [SPLIT, M, N]


def splitk_reduce(part: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None = None,
                  scale_mode: int = 0) -> None:
    """Finish a split-K launch: out = sum over slices of `part` [SPLIT, M, N] (times the scale)."""
    splits, m, n = part.shape
    block = 256
    _splitk_reduce_kernel[(cdiv(m * n, block),)](
        part, part if scale is None else scale, out, m, n, splits, out.stride(0), out.stride(1),
        SCALE=scale_mode, BLOCK=block, num_warps=4)


# FP8 weights of this many elements or more run the dot path with bf16 x in fp16 (x scaled by a power of
# two per row in a pass of its own, `_x_f16_rows_kernel`): the hardware widens E4M3 pairs straight to fp16,
# where a bf16 dot needs each element through fp16 and fp32 to bf16 (sm_90: 5.13 instructions an element in
# the K loop at 32 x 128 x 128, against 3.77). One more launch, so only where the weight is large.
F16_DOT_MIN_ELEMENTS = 1 << 26
# On the GPU a kernel after x's pass (this dot, and the NVFP4 GEMVs) is a programmatic dependent launch: its
# programs start while the pass runs (`gdc_launch_dependents` there, `gdc_wait` before it reads x) instead of
# after the pass ends. x's pass alone, in a CUDA graph on the H200: 1.73 us a launch (2026-12-03).
X_PASS_PDL = True


def x_pass_pdl(x: torch.Tensor) -> bool:
    """Whether the kernel that follows x's pass is a programmatic dependent launch (`launch_pdl`): while
    `X_PASS_PDL` is set, on a GPU that has it (sm_90 and later: `griddepcontrol` does not assemble before).
    Then the pass's kernel, compiled with PDL, calls `gdc_launch_dependents` first, and the kernel after it
    calls `gdc_wait` before anything else, so it reads the pass's output only after the pass ends. (The
    interpreter drops the launch option.)"""
    return x.is_cuda and X_PASS_PDL and has_pdl(x.device)


@functools.lru_cache(maxsize=None)
def has_pdl(device: torch.device) -> bool:
    """Whether a CUDA device has programmatic dependent launch (`griddepcontrol`: sm_90 on)."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


def tma_refusal(x: torch.Tensor, weight: torch.Tensor, scaled: bool) -> str | None:
    """Why `_linear_tma_kernel` cannot run x [M, K] @ weight [N, K]^T, or None: it takes 16-bit x and
    weight of one dtype (no per-row scale), 2 <= M <= 32, K > 0, on a GPU with TMA (sm_90 on) or in the
    interpreter, both with unit stride along K and 16-byte aligned starts and row strides."""
    m = x.shape[0]
    if scaled or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        scale = " with a row scale" if scaled else ""
        return f"x {x.dtype}, weight {weight.dtype}{scale}: it takes 16-bit x and weight of one dtype"
    if not 2 <= m <= MAX_M:
        return f"M = {m}: it takes 2 to {MAX_M} rows"
    if x.shape[1] == 0:
        return "K = 0: a TMA descriptor takes no empty dimension"
    if x.is_cuda and not has_pdl(x.device):                         # TMA came with PDL, in sm_90
        return f"x on {x.device}, capability {torch.cuda.get_device_capability(x.device)}: it needs TMA (sm_90 on)"
    return tma_layout_refusal("x", x) or tma_layout_refusal("weight", weight)


def tma_layout_refusal(name: str, t: torch.Tensor) -> str | None:
    """Why TMA cannot read the matrix `t` [rows, K] (named `name` in the reason), or None: it reads from a
    16-byte aligned start, rows a multiple of 16 bytes apart, unit stride along K (the TMA kernels' rule)."""
    row_bytes = t.stride(0) * t.element_size()
    if t.stride(1) != 1 or row_bytes % 16 or t.data_ptr() % 16:
        return (f"{name} starts {t.data_ptr() % 16} bytes past a 16-byte boundary, with strides {t.stride()} (rows "
                f"{row_bytes} bytes apart): TMA reads from a 16-byte aligned start, rows a multiple of 16 bytes "
                f"apart and unit stride along K; pass {name}.clone()")
    return None


def linear_triton(x: torch.Tensor, weight: torch.Tensor, *, split_k: bool = False, out: torch.Tensor | None = None,
                  plan: GemvPlan | None = None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype. `split_k` cuts K across programs (tall-skinny
    weights); `out` receives the result; `plan` overrides the tiles (tests, sweeps); `weight_scale` (fp32
    [N]) scales each output column, for FP8 weights."""
    if err := operand_refusal(x, weight, weight_scale) or out_overlap_refusal(out, x=x, weight=weight,
                                                                               weight_scale=weight_scale):
        raise err
    return _linear_launch(x, weight, split_k, out, plan, weight_scale)


def out_overlap_refusal(out: torch.Tensor | None, **operands: torch.Tensor | None) -> InputError | None:
    """An `out` of the linears' entry points (`linear_triton`, `linear_nvfp4_triton`; the ops take none) sharing
    memory with an operand, even out x itself (N = K): the GEMV and dot kernels write their tile of out's columns
    while other programs still read all of x and their own weight rows and scales (only the split-K reduction
    writes out after every read of x, and the plan picks which runs)."""
    return ops.overlap_refusal("out", out, fix="pass an out of its own, or none (the result comes back in a new "
                               "tensor)", **operands)


def _linear_launch(x: torch.Tensor, weight: torch.Tensor, split_k: bool, out: torch.Tensor | None,
                   plan: GemvPlan | None, weight_scale: torch.Tensor | None) -> torch.Tensor:
    """`linear_triton` on operands `operand_refusal` passed (the ops' predicates checked them: one check a call)."""
    m, k = x.shape
    n = weight.shape[0]
    out = ops.out_or_empty(out, (m, n), x.dtype, x.device)
    if m == 0 or n == 0:
        return out
    if not int32_reach(out):    # the kernels index out in int32 (fewer than 2^31 elements): a contiguous one, copied
        return out.copy_(_linear_launch(x, weight, split_k, None, plan, weight_scale))
    if not int32_reach(x):                        # and x
        x = x.contiguous()
    scaled = weight_scale is not None
    if plan is None:            # the planner plans the TMA kernel only where the call can run it
        plan = plan_for(m, n, k, split_k, TILES_FP8 if scaled else TILES_16BIT,
                        TMA and tma_refusal(x, weight, scaled) is None)
    elif err := plan_shape_refusal(plan):       # a plan given (tests, sweeps): checked
        raise err
    elif plan.tma:
        why = tma_refusal(x, weight, scaled) or (None if plan.splits == 1 and plan.block_m >= max(16, m) else
                                                  f"the plan has {plan.splits} K slices and block_m "
                                                  f"{plan.block_m} for M = {m}: it takes one K slice on the dot "
                                                  "path, block_m at least M")
        if why:
            raise ValueError(f"plan: tma = True, but {why}. Plan it with tma = False (the planner does where "
                             "the call cannot run the TMA kernel)")
    elif plan.block_m < m:      # a plan given: the grid has no M axis, so one tile holds every row
        raise InputError("plan.block_m", plan.block_m,
                         f"must be at least M = {m}: the launch has no M axis, so rows {plan.block_m} to {m - 1} "
                         "would be left unwritten", "make the plan for this M (make_plan's default block_m "
                         "fits it), or leave plan=None")
    elif err := k_slices_refusal(plan, k):
        raise err
    if plan.tma:
        xd = TensorDescriptor.from_tensor(x, [plan.block_m, plan.block_k])
        wd = TensorDescriptor.from_tensor(weight, [plan.block_n, plan.block_k])
        _linear_tma_kernel[(cdiv(n, plan.block_n),)](
            xd, wd, out, m, n, k, out.stride(0), out.stride(1), BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
            BLOCK_K=plan.block_k, LOWP_DOT=lowp_dot(x), num_warps=plan.num_warps, num_stages=plan.num_stages)
        return out
    part = partial_buffer(plan, m, n, x)
    grid = (cdiv(n, plan.block_n), plan.splits)
    x_op, exps, pdl = x, out, False
    if scaled and plan.use_dot and x.dtype == torch.bfloat16 and n * k >= F16_DOT_MIN_ELEMENTS:
        x_op = torch.empty((m, k), dtype=torch.float16, device=x.device)
        exps = torch.empty(m, dtype=torch.int32, device=x.device)
        pdl = x_pass_pdl(x)
        _x_f16_rows_kernel[(m,)](x, x_op, exps, k, x.stride(0), x.stride(1), BLOCK=x_scan_block(k), PDL=pdl,
                                 num_warps=8)
    _linear_kernel[grid](
        x_op, exps, weight, weight_scale if scaled else out, out, part if part is not None else out, m, n, k,
        plan.k_per_split, x_op.stride(0), x_op.stride(1), weight.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, USE_DOT=plan.use_dot,
        LOWP_DOT=lowp_dot(x), SWAP_AB=plan.swap_ab, SPLIT=part is not None, ROW_SCALE=scaled,
        X_EXP=x_op is not x, PDL=pdl, num_warps=plan.num_warps, num_stages=plan.num_stages, launch_pdl=pdl)
    if part is not None:
        splitk_reduce(part, out, weight_scale, scale_mode=1 if scaled else 0)
    return out


def x_refusal(x: torch.Tensor, op: str) -> InputError | None:
    """Why the small-M kernels of `op` cannot take x, or None: a 2-D bf16, fp16 or fp32 [M <= 32, K] tensor."""
    if x.dim() != 2 or x.dtype not in FLOATS:
        return InputError("x", f"{x.dtype} {tuple(x.shape)}", "a 2-D bf16, fp16 or fp32 [M, K] tensor",
                          "flatten the leading dimensions into M")
    if x.shape[0] > MAX_M:
        return InputError("x", f"{x.shape[0]} rows", f"the {op} kernels take up to {MAX_M}",
                          f"call the op (`{op}`) under runtime.backend=auto: it runs the reference for more")
    return None


def reach_refusal(m: int, n: int, k: int, op: str) -> InputError | None:
    """Why the `op` kernels cannot index this call's x [M, K] and out [M, N], or None: they index both in int32
    (a strided one is first made contiguous), so each holds fewer than 2^31 elements. The weight's rows are
    int64 offsets: a weight of any size is read."""
    for name, size, dim in (("out", m * n, f"N = {n}"), ("x", m * k, f"K = {k}")):
        if size >= 2**31:
            return InputError(name, f"[{m}, {size // m}] ({size} elements, {dim})",
                              f"fewer than 2^31 elements: the {op} kernels index {name} in int32",
                              f"split the weight's {'rows' if name == 'out' else 'K'} across calls, or call the op "
                              f"(`{op}`) under runtime.backend=auto: it runs the reference")
    return None


def operand_refusal(x: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor | None = None) -> InputError | WeightsError | None:
    """Why `linear_triton` cannot take these operands, as the error it raises (the predicates of `linear` and
    `linear_fp8` say no to the same calls), or None: x a 2-D bf16, fp16 or fp32 [M <= 32, K] (any strides);
    weight [N, K] with unit stride along K, of x's dtype, or with `weight_scale` float8_e4m3fn beside an fp32
    [N] scale (on the CPU or a GPU of sm_89 or later, which converts E4M3)."""
    scaled = weight_scale is not None
    op = "linear_fp8" if scaled else "linear"
    if err := x_refusal(x, op) or linear_contract(x, weight, weight_scale):
        return err
    m, k = x.shape
    if k and weight.stride(1) != 1:
        return WeightsError("weight", f"{weight.dtype} {tuple(weight.shape)}, strides {weight.stride()}",
                            "unit stride along K", "pass weight.contiguous()")
    if err := reach_refusal(m, weight.shape[0], k, op):
        return err
    if scaled and not weight_scale.is_contiguous():
        return WeightsError("weight_scale", f"strides {weight_scale.stride()}", "a contiguous [N] tensor",
                            "pass weight_scale.contiguous()")
    if scaled and x.is_cuda and (cap := torch.cuda.get_device_capability(x.device)) < (8, 9):
        return InputError("x.device", f"{x.device}, capability {cap}", "FP8 weights need sm_89 or later",
                          "call the op (`linear_fp8`) under runtime.backend=auto: it runs the reference here")
    return None


def _linear_triton_op(x: torch.Tensor, weight: torch.Tensor, split_work: bool = True) -> torch.Tensor:
    return _linear_launch(x, weight, split_work, None, None, None)


def _linear_triton_refusal(x: torch.Tensor, weight: torch.Tensor, split_work: bool = True) -> MtpfError | None:
    return operand_refusal(x, weight)


linear.register_provider("triton", _linear_triton_op, _linear_triton_refusal)
