"""W4A16 linear in the ModelOpt NVFP4 layout (DESIGN 3): y = x @ dequantize_nvfp4(weight, weight_scale,
weight_scale_2)^T, weight uint8 [N, K/2] (element 2j in the low nibble), weight_scale float8_e4m3fn [N, K/16],
weight_scale_2 one fp32 number.

Hopper has no FP4 tensor cores and `tl.dot_scaled` with e2m1 does not compile there (Triton 3.6), so the
Triton provider decodes in registers; it shares `linear.py`'s plan and split-K reduction. The weight is
read as int32 words of 8 codes (element 8w + i in bits 4i .. 4i + 3: element 2j in byte j's low nibble).
- M = 1 with bf16 / fp16 x on programs of 16 rows or more (`_gemv_nvfp4_f16_kernel`, `uses_f16_gemv`),
  CUDA cores: x is scaled by a power of two that puts its largest magnitude in the program's K slice in
  [2^11, 2^12) (exact; on weights of 2^26 elements or more a pass of its own, `_x_f16_pairs_kernel`, scales
  and pairs x once, `uses_x_pass`, else each program does it); each word becomes E4M3 bytes, the even and
  the odd elements (6 integer ops a word: `_E2M1X16_F16_DOT_PTX`), the hardware widens those to fp16 pairs
  (`cvt.rn.f16x2.e4m3x2`), and fp16x2 fmas sum each half of a 16-element block (8 products, within 2^-8 of
  the block's sum |x||w|: see the tests); each block's sum times its scale is added in fp32. Its K loop:
  2.73 sm_90 instructions per element at its tile with x's pass and the next step's words and scales
  loaded ahead, 3.12 converting x itself with its pairs loaded ahead too (the fp32 kernel below: 5.4).
- 2 <= M <= 8 with bf16 / fp16 x (`_gemv_nvfp4_rows_kernel`; the planner's for M <= GEMV_MAX_ROWS on the
  LM heads), CUDA cores: x's pass scales
  and pairs each row (its own power of two), each block's words are decoded to fp16 pairs once for all the
  rows (`_block_f16x2`) and each row adds only its fmas (`_block_sum_f16x2`); row m equals the M = 1
  kernel on x[m] bit for bit.
- after x's pass, both fp16-sum GEMVs and the fp16 dot are programmatic dependent launches on sm_90 and later
  (`linear.x_pass_pdl`): their programs start while the pass runs and wait for it (`gdc_wait`) before
  anything else.
- M = 1 otherwise (`_gemv_nvfp4_kernel`: fp32 x, and programs of few rows), exact fp32 FMAs:
  `_e2m1_words_to_e4m3` turns a word into two words of E4M3 bytes the same way, the hardware widens them to
  fp32 through fp16 (the interpreter, which has no inline asm, decodes the same bits through fp16), each
  16-element block's sum times its scale once.
- 17 <= M <= 32 with 16-bit x on the LM heads (`_gemm_nvfp4_f16_kernel`, `uses_f16_dot`: tiles of 32 rows
  of x), tensor cores in fp16: after x's pass, x's pairs read as fp16 are the dot's x, each word decoded
  as the M = 1 kernel does (6 integer ops, 4 widenings) and its pairs multiplied by the block scale in fp16x2,
  exact, in the pairs' element order; 3.2-4.0 sm_90 instructions an element against the kernel below's 4.8.
- WGMMA_MIN_M <= M <= 32 with 16-bit x on the LM heads on sm_90, K a multiple of 512: the Gluon wgmma kernel
  in place of the three above (`GemvPlan.wgmma`, set by `default_plan`; `gemm_nvfp4_wgmma.py`): each thread
  decodes its own fragment of the MMA's register operand, no shared-memory round trip for the weight; x's pass
  writes x in that kernel's K order (`_pair_slot`, `XPairs.order`).
- 1 <= M <= 32 otherwise (`_gemm_nvfp4_kernel`, the planner's from M = 2 wherever neither the GEMV of several
  rows nor the fp16 dot runs), tensor cores: `_e2m1x8_scaled`
  builds bf16 pairs from the word with two shifts and masks a pair (elements i and i + 4, whose nibbles
  lie 16 bits apart), each the E2M1 value times 2^-126, and one bf16x2 multiply by the block scale times
  2^118 makes them E2M1 * scale * 2^-8, exact; the dot takes them in that order (0, 4, 1, 5, 2, 6, 3, 7
  within a word) with x loaded in the same order, so the decoded tile goes to shared memory in 16-byte
  stores with no shuffle; the loads run one or two K steps ahead of the decode.
- the decode's power of two and the per-tensor `weight_scale_2` multiply the fp32 sums once
  (`weight_scale_2` loaded on the device: no host sync).
An E4M3 NaN scale (0x7f/0xff) is undefined here: the bit decodes above read it as +-480, the hardware's
conversions (the fp16-sum GEMVs, the fp16 dot) as NaN, and the reference refuses it. The quantizer never stores
it and the loader refuses it; the kernels do not scan for it (a pass over the scales every call).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mtpfactory.errors import InputError, MtpfError, WeightsError
from mtpfactory.kernels.fp_bits import pow2, times_pow2
from mtpfactory.kernels.linear import (
    MAX_M,
    GemvPlan,
    Tile,
    TileTable,
    activation_refusal,
    amax_exponent,
    dot_acc,
    dot_result,
    dot_zeros,
    int32_reach,
    k_slices_refusal,
    lowp_dot,
    out_overlap_refusal,
    partial_buffer,
    plan_for,
    plan_shape_refusal,
    reach_refusal,
    splitk_reduce,
    store_tile,
    tma_layout_refusal,
    x_exponent,
    x_pass_pdl,
    x_refusal,
    x_scan_block,
)
from mtpfactory.ops import Op, cdiv, out_or_empty
from mtpfactory.quant import NVFP4_BLOCK, dequantize_nvfp4


def nvfp4_contract(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                   split_work: bool = True) -> MtpfError | None:
    """Why the reference cannot multiply these, or None (every provider refuses the same calls): x a bf16, fp16
    or fp32 [..., K]; weight uint8 [N, K/2], K a multiple of 16; weight_scale float8_e4m3fn [N, K/16];
    weight_scale_2 one fp32 number (the ModelOpt layout, DESIGN 3)."""
    if err := activation_refusal(x):
        return err
    k = x.shape[-1]
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        return WeightsError("weight", f"{weight.dtype} {tuple(weight.shape)}", "a 2-D uint8 [N, K/2] tensor",
                            "pass the checkpoint's packed weight")
    n, half_k = weight.shape
    if 2 * half_k != k:
        return InputError("x", f"{list(x.shape)}", f"K = {2 * half_k}, as the weight {tuple(weight.shape)} holds (two "
                          "codes a byte)", "pass this weight's input")
    if k % NVFP4_BLOCK:
        return WeightsError("weight", f"K = {k}", "NVFP4 takes K a multiple of 16",
                            "keep this tensor unquantized or pad K")
    if weight_scale.dtype != torch.float8_e4m3fn or weight_scale.shape != (n, k // NVFP4_BLOCK):
        return WeightsError("weight_scale", f"{weight_scale.dtype} {tuple(weight_scale.shape)}",
                            f"float8_e4m3fn [N, K/16] = [{n}, {k // NVFP4_BLOCK}]",
                            "pass the checkpoint's weight_scale as stored (one E4M3 byte a 16-element block)")
    if weight_scale_2.dtype != torch.float32 or weight_scale_2.numel() != 1:
        return WeightsError("weight_scale_2", f"{weight_scale_2.dtype} {tuple(weight_scale_2.shape)}",
                            "one fp32 number", "pass the checkpoint's weight_scale_2 as stored")
    return None


def _linear_nvfp4_native(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         weight_scale_2: torch.Tensor, split_work: bool = True) -> torch.Tensor:
    """x: [..., K] bf16/fp16/fp32; weight: uint8 [N, K/2]; weight_scale: float8_e4m3fn [N, K/16];
    weight_scale_2: fp32 scalar (`nvfp4_contract`). Returns [..., N] in x's dtype."""
    if err := nvfp4_contract(x, weight, weight_scale, weight_scale_2):
        raise err
    return (x.float() @ dequantize_nvfp4(weight, weight_scale, weight_scale_2).T).to(x.dtype)


linear_nvfp4 = Op("linear_nvfp4", _linear_nvfp4_native, nvfp4_contract)

# The fastest tiles of the H200 sweeps (scripts/tune_gemv.py, 2026-12-03; BENCHMARKS.md). M = 1, 16-bit x
# without x's pass (the LM heads run it and take `TILES_NVFP4_LM_HEAD`): the fp16-sum GEMV at (64, 256), 4
# warps, one step ahead, 58.9 us on 151936 x 2048 and 122.8 on 154880 x 4096, where the fp32 GEMV takes 76.5
# and 146.8; no other tile was ahead on both (128 x 256: 58.6 / 134.4; 32 x 256: 64.5 / 121.8; 2 warps 58.1 /
# 130.5; 8 warps slower; looking ahead at the words only, not x: 61.4 / 115.1).
# The tensor-core kernel: 64-row tiles, the decoded tile the dot's first operand, K steps of 256, loads one
# step ahead (151936 x 2048: 119.7 us at M = 8, 137.8 at M = 32; 128-row or shorter-K tiles 130-148 us);
# weights with fewer than 128 such tiles narrow to 32 and 16 rows and split K (8192 x 2048, M = 32: 12.5 us
# at (64, 256) in 2 slices; 2048 x 4096, M = 32: 13.7 at (16, 256) in 2).
TILES_NVFP4 = TileTable(m1=Tile(64, 256), m16=Tile(64, 256, stages=2, swap_ab=True),
                        m32=Tile(64, 256, stages=2, swap_ab=True), min_tiles=512, min_block_k=32, min_tiles_dot=128,
                        min_block_n_dot=16)


@triton.jit
def _e4m3_bits_to_f32(b):
    """E4M3 bit patterns (int32) -> fp32 values times 2^-8, through fp16 bits."""
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_words_to_e4m3(w):
    """int32 words of 8 E2M1 codes (4 bytes; element 2j in byte j's low nibble) -> two words of 4 E4M3
    bytes, the even elements and the odd ones, each E4M3 byte exactly the E2M1 value times 2^-6: the code's
    exponent and mantissa (e1 e0 m) become the E4M3 exponent's low bits and mantissa's top bit (e = 0,
    the E2M1 subnormal, lands on the E4M3 subnormals), its sign the E4M3 sign; four bytes per operation.
    The form of `_e2m1_word_f16_fma_ptx`, which the interpreter runs this for: the signs masked once, then
    per output the exponent-mantissa bits (0x1C) from the shifted word, the rest from the shifted signs
    (whose bits inside 0x1C are dropped), one `lop3` each on the GPU."""
    signs = w & -0x77777778                                          # 0x88888888
    even = ((w << 2) & 0x1C1C1C1C) | ((signs << 4) & ~0x1C1C1C1C)
    odd = ((w >> 2) & 0x1C1C1C1C) | (signs & ~0x1C1C1C1C)
    return even, odd


# E4M3 bytes -> fp32 on the GPU: the hardware's E4M3x2 -> FP16x2 conversion, then FP16 -> FP32.
_E4M3X4_PTX = tl.constexpr("""{
    .reg .b16 lo, hi, a0, a1, b0, b1;
    .reg .b32 a, b;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 a, lo;
    cvt.rn.f16x2.e4m3x2 b, hi;
    mov.b32 {a0, a1}, a;
    mov.b32 {b0, b1}, b;
    cvt.f32.f16 $0, a0;
    cvt.f32.f16 $1, a1;
    cvt.f32.f16 $2, b0;
    cvt.f32.f16 $3, b1;
}""")


@triton.jit
def _e4m3x4_f32(w, USE_ASM: tl.constexpr):
    """int32 words of 4 E4M3 bytes -> their 4 fp32 values (byte 0 first): on the GPU through the hardware's
    conversions (PTX), in the interpreter (no inline asm) the same values through fp16 bits."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm=_E4M3X4_PTX, constraints="=r,=r,=r,=r,r", args=[w],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return (_e4m3_bits_to_f32(w & 0xFF) * 256.0, _e4m3_bits_to_f32((w >> 8) & 0xFF) * 256.0,
                _e4m3_bits_to_f32((w >> 16) & 0xFF) * 256.0, _e4m3_bits_to_f32((w >> 24) & 0xFF) * 256.0)


@triton.jit
def nvfp4_words(w_rows, s_rows, mask_n, kk, K, BLOCK_K: tl.constexpr):
    """The K tile from element kk on of rows of an NVFP4 matrix: its codes as int32 words of 8 [BN, BK/8]
    (`w_rows` [BN, 1], pointers in words) and its scale bytes [BN, BK/16] (`s_rows` [BN, 1]); zero past K and
    off the rows where mask_n."""
    word = kk // 8 + tl.arange(0, BLOCK_K // 8)
    blk = kk // 16 + tl.arange(0, BLOCK_K // 16)
    wv = tl.load(w_rows + word[None, :], mask=mask_n[:, None] & (word < K // 8)[None, :], other=0)
    sb = tl.load(s_rows + blk[None, :], mask=mask_n[:, None] & (blk < K // 16)[None, :], other=0)
    return wv, sb


@triton.jit
def gemv_nvfp4_step(acc, x_ptr, stride_xk, w_rows, s_rows, mask_n, kk, K, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """acc [BN, BK/16] + the K tile from element kk on of one row of x (x_ptr, stride_xk) times rows of an NVFP4
    weight (`w_rows` [BN, 1]: the codes as int32 words of 8, pointers in words; `s_rows` [BN, 1]: the scale
    bytes; rows where mask_n), per 16-element block: each word becomes two words of E4M3 bytes (four codes per
    integer op), the hardware widens those to fp32, the FMAs run on exact E2M1 values * 2^-6, and each block's
    sum is multiplied by its scale once. The caller multiplies the row's sum by 2^6 and the global scale."""
    NB: tl.constexpr = BLOCK_K // 16                                 # scale blocks of a K tile
    wv, sb = nvfp4_words(w_rows, s_rows, mask_n, kk, K, BLOCK_K)     # [BN, BK/8] int32, [BN, NB] bytes
    word = kk // 8 + tl.arange(0, BLOCK_K // 8)                      # [BK/8] word index along the row
    mask_w = word < K // 8
    even, odd = _e2m1_words_to_e4m3(wv)
    e0, e2, e4, e6 = _e4m3x4_f32(even, USE_ASM)                      # [BN, W] elements 8w + 0, 2, 4, 6
    e1, e3, e5, e7 = _e4m3x4_f32(odd, USE_ASM)                       # elements 8w + 1, 3, 5, 7
    xp = x_ptr + word * 8 * stride_xk                                # [W]
    p = e0 * tl.load(xp, mask=mask_w, other=0.0).to(tl.float32)[None, :]
    p += e1 * tl.load(xp + stride_xk, mask=mask_w, other=0.0).to(tl.float32)[None, :]
    p += e2 * tl.load(xp + 2 * stride_xk, mask=mask_w, other=0.0).to(tl.float32)[None, :]
    p += e3 * tl.load(xp + 3 * stride_xk, mask=mask_w, other=0.0).to(tl.float32)[None, :]
    p += e4 * tl.load(xp + 4 * stride_xk, mask=mask_w, other=0.0).to(tl.float32)[None, :]
    p += e5 * tl.load(xp + 5 * stride_xk, mask=mask_w, other=0.0).to(tl.float32)[None, :]
    p += e6 * tl.load(xp + 6 * stride_xk, mask=mask_w, other=0.0).to(tl.float32)[None, :]
    p += e7 * tl.load(xp + 7 * stride_xk, mask=mask_w, other=0.0).to(tl.float32)[None, :]    # [BN, W]
    block_sum = tl.sum(tl.reshape(p, [BLOCK_N, NB, 2]), axis=2)      # [BN, NB]: two words a block
    return acc + block_sum * (_e4m3_bits_to_f32(sb.to(tl.int32)) * 256.0)


@triton.jit
def _gemv_nvfp4_kernel(x_ptr, w_ptr, s_ptr, s2_ptr, out_ptr, part_ptr, N, K, k_per_split,
                       stride_xk, stride_wn, stride_sn, stride_on,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, USE_ASM: tl.constexpr):
    """M = 1: out[n] = sum_k x[k] * w[n, k], the weight read as int32 words of 8 codes (w_ptr: the bytes
    viewed as int32, stride_wn in words), K tile by K tile (`gemv_nvfp4_step`); 2^6 and `weight_scale_2` by
    the row's sum."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN]
    mask_n = offs_n < N
    n64 = offs_n.to(tl.int64)
    w_rows = w_ptr + n64[:, None] * stride_wn                        # [BN, 1]
    s_rows = s_ptr + n64[:, None] * stride_sn
    k_start = pid_k * k_per_split
    acc = tl.zeros([BLOCK_N, BLOCK_K // 16], dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        acc = gemv_nvfp4_step(acc, x_ptr, stride_xk, w_rows, s_rows, mask_n, k_start + k0, K, BLOCK_N, BLOCK_K,
                              USE_ASM)
    acc = tl.sum(acc, axis=1) * 64.0                                 # [BN]; the decode's 2^-6 undone
    if SPLIT:
        tl.store(part_ptr + pid_k * N + offs_n, acc, mask=mask_n)
    else:
        acc = acc * tl.load(s2_ptr)
        tl.store(out_ptr + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _e2m1_word_f16x2_ptx(w: str, h: list[str]) -> str:
    """PTX: the 8 codes of word `w` to E4M3 bytes (the even elements' bytes and the odd ones', each the E2M1
    value times 2^-6: the signs of all eight masked once, then per output one shift and one `lop3` that takes
    the exponent-mantissa bits (0x1C) from the shifted word and the rest (the sign) from the shifted signs),
    widened by the hardware to the fp16 pairs (0, 2), (4, 6), (1, 3), (5, 7) in the registers `h`. Uses the
    scratch registers v, a, b, e, o (.b32) and l0 .. l3 (.b16)."""
    return f"""
    and.b32 v, {w}, 0x88888888;
    shl.b32 a, {w}, 2;
    shl.b32 b, v, 4;
    lop3.b32 e, a, b, 0x1C1C1C1C, 0xE4;
    shr.b32 a, {w}, 2;
    lop3.b32 o, a, v, 0x1C1C1C1C, 0xE4;
    mov.b32 {{l0, l1}}, e;
    mov.b32 {{l2, l3}}, o;
    cvt.rn.f16x2.e4m3x2 {h[0]}, l0;
    cvt.rn.f16x2.e4m3x2 {h[1]}, l1;
    cvt.rn.f16x2.e4m3x2 {h[2]}, l2;
    cvt.rn.f16x2.e4m3x2 {h[3]}, l3;"""


def _f16x2_fma_ptx(h: list[str], x_pairs: list[str]) -> str:
    """PTX: each fp16 pair of `h` times its x pair, added to the fp16 pair in register acc."""
    return "".join(f"\n    fma.rn.f16x2 acc, {hi}, {xi}, acc;" for hi, xi in zip(h, x_pairs))


_H = ["h0", "h1", "h2", "h3"]
_F16_SUM_TO_F32 = "\n    mov.b32 {l0, l1}, acc;\n    cvt.f32.f16 $0, l0;\n    cvt.f32.f16 $1, l1;\n}"

# One 16-element block of one row for the M = 1 kernel with 16-bit x, on the GPU: $2, $3 the block's two words,
# $4..$11 the scaled x as fp16 pairs (`_x_pairs`: word 0's then word 1's); $0, $1 the two fp16 halves of the
# block's sum, each the sum of 8 products, as fp32. `lop3` 0xE4 is (a & c) | (b & ~c).
_E2M1X16_F16_DOT_PTX = tl.constexpr(
    "{\n    .reg .b32 v, a, b, e, o, h0, h1, h2, h3, acc;\n    .reg .b16 l0, l1, l2, l3;\n    mov.b32 acc, 0;"
    + _e2m1_word_f16x2_ptx("$2", _H) + _f16x2_fma_ptx(_H, ["$4", "$5", "$6", "$7"])
    + _e2m1_word_f16x2_ptx("$3", _H) + _f16x2_fma_ptx(_H, ["$8", "$9", "$10", "$11"])
    + _F16_SUM_TO_F32)

# The same block in two halves for the GEMV of several rows, whose decode serves every row: $8, $9 the two
# words -> $0..$7 their fp16 pairs (word 0's four, then word 1's) ...
_E2M1X16_F16X2_PTX = tl.constexpr(
    "{\n    .reg .b32 v, a, b, e, o;\n    .reg .b16 l0, l1, l2, l3;"
    + _e2m1_word_f16x2_ptx("$8", ["$0", "$1", "$2", "$3"]) + _e2m1_word_f16x2_ptx("$9", ["$4", "$5", "$6", "$7"])
    + "\n}")
# ... and one row's sums: $2..$9 the pairs, $10..$17 the row's x pairs -> $0, $1 as above.
_F16X2_BLOCK_SUM_PTX = tl.constexpr(
    "{\n    .reg .b32 acc;\n    .reg .b16 l0, l1;\n    mov.b32 acc, 0;"
    + _f16x2_fma_ptx([f"${i}" for i in range(2, 10)], [f"${i}" for i in range(10, 18)]) + _F16_SUM_TO_F32)


@triton.jit
def _f16x2(lo, hi, USE_ASM: tl.constexpr):
    """Two fp32 tensors -> int32 words holding them rounded to fp16 (lo in the low half)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(asm="cvt.rn.f16x2.f32 $0, $2, $1;", constraints="=r,r,r",
                                         args=[lo, hi], dtype=tl.int32, is_pure=True, pack=1)
    else:
        lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return lo_bits | (hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _f16x2_f32(p):
    """int32 words of two fp16 bit patterns -> (low half, high half) as fp32."""
    return ((p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
            (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _x_load(xp, mask, x_scale, EVEN_K: tl.constexpr):
    """x at the pointers xp (masked unless EVEN_K) as fp32 times x_scale."""
    if EVEN_K:
        return tl.load(xp).to(tl.float32) * x_scale
    else:
        return tl.load(xp, mask=mask, other=0.0).to(tl.float32) * x_scale


@triton.jit
def _x_pairs(xp, stride_xk, mask, x_scale, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr):
    """x[k .. k + 8] of each word at xp ([NB] pointers), times x_scale, as the fp16 pairs (0, 2), (4, 6),
    (1, 3), (5, 7): the order in which `_E2M1X16_F16_DOT_PTX` widens a word."""
    x0 = _x_load(xp, mask, x_scale, EVEN_K)
    x1 = _x_load(xp + stride_xk, mask, x_scale, EVEN_K)
    x2 = _x_load(xp + 2 * stride_xk, mask, x_scale, EVEN_K)
    x3 = _x_load(xp + 3 * stride_xk, mask, x_scale, EVEN_K)
    x4 = _x_load(xp + 4 * stride_xk, mask, x_scale, EVEN_K)
    x5 = _x_load(xp + 5 * stride_xk, mask, x_scale, EVEN_K)
    x6 = _x_load(xp + 6 * stride_xk, mask, x_scale, EVEN_K)
    x7 = _x_load(xp + 7 * stride_xk, mask, x_scale, EVEN_K)
    return (_f16x2(x0, x2, USE_ASM), _f16x2(x4, x6, USE_ASM), _f16x2(x1, x3, USE_ASM),
            _f16x2(x5, x7, USE_ASM))


@triton.jit
def _f16_fma_pairs(acc_lo, acc_hi, w, x_pair):
    """The interpreter's `fma.rn.f16x2`: fp32 fma (the product is exact), rounded to fp16."""
    w_lo, w_hi = _f16x2_f32(w)
    x_lo, x_hi = _f16x2_f32(x_pair)
    return ((acc_lo + w_lo * x_lo).to(tl.float16).to(tl.float32),
            (acc_hi + w_hi * x_hi).to(tl.float16).to(tl.float32))


@triton.jit
def _block_sum_f16(wa, wb, a0, a1, a2, a3, b0, b1, b2, b3, USE_ASM: tl.constexpr):
    """A 16-element block: its two words [BN, NB] and x pairs [NB] (`_x_pairs`) -> the two fp16 halves of
    sum_k x_k * E2M1_k * 2^-6 as fp32 [BN, NB]: the PTX on the GPU; in the interpreter the same E4M3 bytes
    widened through fp16 bits and each fp16 fma rounded the same way."""
    if USE_ASM:
        z = tl.zeros(wa.shape, dtype=tl.int32)
        return tl.inline_asm_elementwise(
            asm=_E2M1X16_F16_DOT_PTX, constraints="=r,=r,r,r,r,r,r,r,r,r,r,r",
            args=[wa, wb, z + a0[None, :], z + a1[None, :], z + a2[None, :], z + a3[None, :],
                  z + b0[None, :], z + b1[None, :], z + b2[None, :], z + b3[None, :]],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return _block_sum_f16x2(_block_f16x2(wa, wb, False), (a0, a1, a2, a3, b0, b1, b2, b3), False)


@triton.jit
def _block_f16x2(wa, wb, USE_ASM: tl.constexpr):
    """A 16-element block's two words [BN, NB] -> its 8 fp16 pairs as int32 [BN, NB] (word 0's (0, 2), (4, 6),
    (1, 3), (5, 7), then word 1's), each element the E2M1 value times 2^-6: the first half of
    `_E2M1X16_F16_DOT_PTX`, for the GEMV of several rows (`_block_sum_f16x2` the second, once a row)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm=_E2M1X16_F16X2_PTX, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r", args=[wa, wb],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=1)
    else:
        h0, h1, h2, h3 = _word_f16x2(wa)
        h4, h5, h6, h7 = _word_f16x2(wb)
        return h0, h1, h2, h3, h4, h5, h6, h7


@triton.jit
def _block_sum_f16x2(h, p, USE_ASM: tl.constexpr):
    """One row's sums of its blocks as `_block_sum_f16` returns them, from the blocks' 8 fp16 pairs h (a tuple
    of [BN, NB], `_block_f16x2`) and the row's 8 x pairs p (a tuple of [NB], `_x_pairs` order)."""
    if USE_ASM:
        z = tl.zeros(h[0].shape, dtype=tl.int32)
        return tl.inline_asm_elementwise(
            asm=_F16X2_BLOCK_SUM_PTX, constraints="=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            args=[h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7],
                  z + p[0][None, :], z + p[1][None, :], z + p[2][None, :], z + p[3][None, :],
                  z + p[4][None, :], z + p[5][None, :], z + p[6][None, :], z + p[7][None, :]],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = tl.zeros(h[0].shape, dtype=tl.float32)
        hi = tl.zeros(h[0].shape, dtype=tl.float32)
        lo, hi = _f16x2_fma4(lo, hi, h[0], h[1], h[2], h[3], p[0][None, :], p[1][None, :], p[2][None, :],
                             p[3][None, :])
        return _f16x2_fma4(lo, hi, h[4], h[5], h[6], h[7], p[4][None, :], p[5][None, :], p[6][None, :],
                           p[7][None, :])


@triton.jit
def _word_f16x2(w):
    """The interpreter's `_e2m1_word_f16x2_ptx`: words -> their fp16 pairs (0, 2), (4, 6), (1, 3), (5, 7) as
    int32 words of fp16 bits."""
    even, odd = _e2m1_words_to_e4m3(w)
    h0, h1 = _e4m3_word_f16x2(even)
    h2, h3 = _e4m3_word_f16x2(odd)
    return h0, h1, h2, h3


@triton.jit
def _f16x2_fma4(lo, hi, h0, h1, h2, h3, p0, p1, p2, p3):
    """The interpreter's `_f16x2_fma_ptx` over four fp16 pairs and their x pairs."""
    lo, hi = _f16_fma_pairs(lo, hi, h0, p0)
    lo, hi = _f16_fma_pairs(lo, hi, h1, p1)
    lo, hi = _f16_fma_pairs(lo, hi, h2, p2)
    return _f16_fma_pairs(lo, hi, h3, p3)


@triton.jit
def _e4m3_word_f16x2(w):
    """The interpreter's `cvt.rn.f16x2.e4m3x2` on both halves of int32 words of 4 E4M3 bytes: fp16 pairs
    (bytes 0, 1) and (bytes 2, 3) as int32 words of fp16 bits (E4M3 -> fp16 is a re-bias: exact)."""
    return (_e4m3_f16_bits(w & 0xFF) | (_e4m3_f16_bits((w >> 8) & 0xFF) << 16),
            _e4m3_f16_bits((w >> 16) & 0xFF) | (_e4m3_f16_bits((w >> 24) & 0xFF) << 16))


@triton.jit
def _e4m3_f16_bits(b):
    """E4M3 bit patterns (int32, 0..255) -> the fp16 bit patterns of the same values (int32, 0..65535)."""
    v = _e4m3_bits_to_f32(b) * 256.0
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _gemv_load_step(w_rows, s_rows, kk, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The words [BN, BK/8] and scale bytes [BN, BK/16] of the K step from element kk (EVEN_K: inside K)."""
    word = kk // 8 + tl.arange(0, BLOCK_K // 8)
    blk = kk // 16 + tl.arange(0, BLOCK_K // 16)
    if EVEN_K:
        return tl.load(w_rows + word[None, :]), tl.load(s_rows + blk[None, :])
    else:
        return (tl.load(w_rows + word[None, :], mask=(word < K // 8)[None, :], other=0),
                tl.load(s_rows + blk[None, :], mask=(blk < K // 16)[None, :], other=0))


@triton.jit
def _x_pairs_step(pairs_ptr, kk, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The 8 x pairs [NB] of each block of the K step from element kk that x's pass wrote for one row
    (`_x_f16_pairs_kernel`: the block's first word's four, then its second word's), as a tuple."""
    blk = kk // 16 + tl.arange(0, BLOCK_K // 16)                     # [NB]
    pp = pairs_ptr + blk * 8
    if EVEN_K:
        return (tl.load(pp), tl.load(pp + 1), tl.load(pp + 2), tl.load(pp + 3),
                tl.load(pp + 4), tl.load(pp + 5), tl.load(pp + 6), tl.load(pp + 7))
    else:
        mask_b = blk < K // 16
        return (tl.load(pp, mask=mask_b, other=0), tl.load(pp + 1, mask=mask_b, other=0),
                tl.load(pp + 2, mask=mask_b, other=0), tl.load(pp + 3, mask=mask_b, other=0),
                tl.load(pp + 4, mask=mask_b, other=0), tl.load(pp + 5, mask=mask_b, other=0),
                tl.load(pp + 6, mask=mask_b, other=0), tl.load(pp + 7, mask=mask_b, other=0))


@triton.jit
def _gemv_x_step(x_ptr, pairs_ptr, kk, K, stride_xk, x_scale, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 X_PAIRS: tl.constexpr, USE_ASM: tl.constexpr, X_CONTIG: tl.constexpr):
    """Each block's x pairs of the K step from element kk (`_x_pairs`: the block's first word's four, then
    its second word's): with X_PAIRS those `_x_f16_pairs_kernel` wrote, else built here from x, in one 2-D
    load where x is contiguous (X_CONTIG, `x_f16_pairs_step`), else element by element."""
    if X_PAIRS:
        return _x_pairs_step(pairs_ptr, kk, K, BLOCK_K, EVEN_K)
    elif X_CONTIG:
        return x_f16_pairs_step(x_ptr, kk, K, x_scale, BLOCK_K, EVEN_K, USE_ASM)
    else:
        blk = kk // 16 + tl.arange(0, BLOCK_K // 16)                 # [NB]
        mask_b = None if EVEN_K else blk < K // 16
        xp = x_ptr + blk * 16 * stride_xk
        a0, a1, a2, a3 = _x_pairs(xp, stride_xk, mask_b, x_scale, EVEN_K, USE_ASM)
        b0, b1, b2, b3 = _x_pairs(xp + 8 * stride_xk, stride_xk, mask_b, x_scale, EVEN_K, USE_ASM)
        return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _gemv_operands(w_rows, s_rows, x_ptr, pairs_ptr, kk, K, stride_xk, x_scale, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, X_PAIRS: tl.constexpr, USE_ASM: tl.constexpr, X_CONTIG: tl.constexpr):
    """The K step from element kk: its words and scale bytes, and its x pairs."""
    wv, sb = _gemv_load_step(w_rows, s_rows, kk, K, BLOCK_K, EVEN_K)
    a0, a1, a2, a3, b0, b1, b2, b3 = _gemv_x_step(x_ptr, pairs_ptr, kk, K, stride_xk, x_scale, BLOCK_K, EVEN_K,
                                                  X_PAIRS, USE_ASM, X_CONTIG)
    return wv, sb, a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def x_f16_pairs_step(x_ptr, kk, K, x_scale, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr):
    """The 8 x pairs of each block of the K step from element kk, made from a contiguous row of x (16-bit) times
    x_scale (2^e, `x_exponent`), as a tuple of [BK/16] int32 words of two fp16 (`_x_pairs` order): what
    `nvfp4_f16_block_sums` takes, for the GEMVs whose x has no pass of its own (the MoE experts). The step is
    one [BK/16, 16] load, split into the pairs in registers: as 16 loads of one element a block (`_x_pairs`)
    each program waited on them every step (the thirtieth run's profile, H100: their first use held 55% of the
    warps' stall samples), and the GEMVs were 1.18-1.31x slower."""
    NB: tl.constexpr = BLOCK_K // 16
    blk = kk // 16 + tl.arange(0, NB)
    xp = x_ptr + blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    if EVEN_K:
        xv = tl.load(xp)
    else:
        xv = tl.load(xp, mask=(blk < K // 16)[:, None], other=0.0)
    # element 8 w + 4 a + 2 b + c of a block (word w): the pair (b = 0, b = 1) of each (w, c, a)
    x5 = tl.permute(tl.reshape(xv.to(tl.float32) * x_scale, [NB, 2, 2, 2, 2]), [0, 1, 4, 2, 3])  # [NB, w, c, a, b]
    lo, hi = tl.split(x5)
    a0, a1 = tl.split(_f16x2(lo, hi, USE_ASM))                       # [NB, w, c] each
    c00, c10 = tl.split(a0)
    c01, c11 = tl.split(a1)
    p00, p10 = tl.split(c00)                                         # [NB] each: (c, a) = (0, 0) of word 0, 1
    p01, p11 = tl.split(c01)                                         # (0, 1): elements 4 and 6
    p02, p12 = tl.split(c10)                                         # (1, 0): elements 1 and 3
    p03, p13 = tl.split(c11)                                         # (1, 1): elements 5 and 7
    return p00, p01, p02, p03, p10, p11, p12, p13


@triton.jit
def nvfp4_f16_block_sums(acc, wv, sb, p, BLOCK_N: tl.constexpr, NB: tl.constexpr, USE_ASM: tl.constexpr):
    """acc [BN, NB] + each 16-element block of a K step of BN NVFP4 rows against one row of x: the words wv
    [BN, 2 NB] and scale bytes sb [BN, NB], the x pairs p (`x_f16_pairs_step` or x's pass) each block summed in
    fp16 pairs (`_block_sum_f16`: E2M1 * 2^-6 times x * 2^e), its two halves times its scale added in fp32.
    The caller multiplies the row's sum by 2^(6 - e) and the global scale."""
    wa, wb = tl.split(tl.reshape(wv, [BLOCK_N, NB, 2]))          # each block's first and second word
    lo, hi = _block_sum_f16(wa, wb, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], USE_ASM)
    return acc + (lo + hi) * sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _x_f16_pairs_kernel(x_ptr, pairs_ptr, exp_ptr, K, k_per_split, stride_xm, stride_xk, BLOCK: tl.constexpr,
                        USE_ASM: tl.constexpr, PDL: tl.constexpr, ORDER: tl.constexpr = 0):
    """The x pass of the 16-bit-x GEMVs, one program a K slice of a row m of x (grid: slices, rows): the
    slice's exponent e (`x_exponent`) to exp_ptr[m, slice] ([M, slices]), and x[m] * 2^e as the fp16 pairs
    the block sums take (`_x_pairs`, word j's four at pairs_ptr[m, 4j .. 4j + 4], [M, K/2]; ORDER > 0: where
    `_pair_slot` puts them for the wgmma kernel). Once per call instead of in every program of the GEMV. PDL:
    it lets the GEMV launch at once (`x_pass_pdl`)."""
    if PDL:
        gdc_launch_dependents()
    pid_k = tl.program_id(0)
    row = tl.program_id(1)
    x_ptr += row * stride_xm
    pairs_ptr += row * (K // 2)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    e = x_exponent(x_ptr, k_start, k_end, stride_xk, BLOCK)
    tl.store(exp_ptr + row * tl.num_programs(0) + pid_k, e)
    x_scale = pow2(e)
    for w0 in range(k_start // 8, k_end // 8, BLOCK // 8):
        word = w0 + tl.arange(0, BLOCK // 8)
        mask = word < k_end // 8
        p0, p1, p2, p3 = _x_pairs(x_ptr + word * 8 * stride_xk, stride_xk, mask, x_scale, False, USE_ASM)
        tl.store(pairs_ptr + _pair_slot(word, 0, ORDER), p0, mask=mask)
        tl.store(pairs_ptr + _pair_slot(word, 1, ORDER), p1, mask=mask)
        tl.store(pairs_ptr + _pair_slot(word, 2, ORDER), p2, mask=mask)
        tl.store(pairs_ptr + _pair_slot(word, 3, ORDER), p3, mask=mask)


@triton.jit
def _pair_slot(word, r: tl.constexpr, ORDER: tl.constexpr):
    """Where x's pass stores pair r (0 .. 3: elements (0, 2), (4, 6), (1, 3), (5, 7)) of each word in [K/2]:
    4 word + r for the GEMVs and the fp16 dot (ORDER 0); for the wgmma kernel on K tiles of ORDER, its
    `dot_order` (`gemm_nvfp4_wgmma.py`): word per * c + b of a tile (per = ORDER / 32) to pair 16 b + 4 r + c."""
    if ORDER == 0:
        return 4 * word + r
    else:
        PER: tl.constexpr = ORDER // 32
        wl = word % (ORDER // 8)
        return 4 * (word - wl) + 16 * (wl % PER) + 4 * r + wl // PER


@triton.jit
def x_pairs_of_row(x, cols, K, pairs_ptr, exp_ptr, k_per_split, BLOCK: tl.constexpr, USE_ASM: tl.constexpr,
                   ORDER: tl.constexpr = 0):
    """x's pass on a row a kernel holds in registers (the final RMSNorm: `rms_norm_triton(x_pairs=...)`): x
    [BLOCK] fp32, x[k] at cols == k and 0 past K, as the 16-bit value the row is stored as -> what
    `_x_f16_pairs_kernel` writes for it, each K slice's exponent to exp_ptr[slice] and the scaled fp16 pairs
    to pairs_ptr[0 .. K/2] (word j's (0, 2), (4, 6), (1, 3), (5, 7) at 4j .. 4j + 4, or where `_pair_slot`
    puts them for ORDER). No reload of x."""
    scale = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, tl.cdiv(K, k_per_split)):
        in_slice = (cols >= s * k_per_split) & (cols < (s + 1) * k_per_split)
        e = amax_exponent(tl.max(tl.where(in_slice, tl.abs(x), 0.0), axis=0))
        tl.store(exp_ptr + s, e)
        scale = tl.where(in_slice, pow2(e), scale)
    # element 8j + 4a + 2b + c at [j, a, b, c]: split off c, then b (the pair's low and high half), then a
    c0, c1 = tl.split(tl.reshape(x * scale, [BLOCK // 8, 2, 2, 2]))
    c0_lo, c0_hi = tl.split(c0)
    c1_lo, c1_hi = tl.split(c1)
    x0, x4 = tl.split(c0_lo)
    x2, x6 = tl.split(c0_hi)
    x1, x5 = tl.split(c1_lo)
    x3, x7 = tl.split(c1_hi)
    word = tl.arange(0, BLOCK // 8)
    mask = word < K // 8
    tl.store(pairs_ptr + _pair_slot(word, 0, ORDER), _f16x2(x0, x2, USE_ASM), mask=mask)
    tl.store(pairs_ptr + _pair_slot(word, 1, ORDER), _f16x2(x4, x6, USE_ASM), mask=mask)
    tl.store(pairs_ptr + _pair_slot(word, 2, ORDER), _f16x2(x1, x3, USE_ASM), mask=mask)
    tl.store(pairs_ptr + _pair_slot(word, 3, ORDER), _f16x2(x5, x7, USE_ASM), mask=mask)


@triton.jit
def _gemv_rows(w_ptr, s_ptr, N, stride_wn, stride_sn, BLOCK_N: tl.constexpr):
    """The weight rows of this program of the fp16-sum GEMVs: their indices [BN], which lie inside N, and the
    pointers to their words and scale bytes [BN, 1] (rows past N read row N - 1, stored nowhere)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n64 = tl.minimum(offs_n, N - 1).to(tl.int64)
    return offs_n, offs_n < N, w_ptr + n64[:, None] * stride_wn, s_ptr + n64[:, None] * stride_sn


@triton.jit
def _gemv_nvfp4_f16_kernel(x_ptr, pairs_ptr, exp_ptr, w_ptr, s_ptr, s2_ptr, out_ptr, part_ptr, N, K, k_per_split,
                           stride_xk, stride_wn, stride_sn, stride_on,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                           AHEAD: tl.constexpr, X_PAIRS: tl.constexpr, XBLOCK: tl.constexpr, SPLIT: tl.constexpr,
                           USE_ASM: tl.constexpr, PDL: tl.constexpr, X_CONTIG: tl.constexpr):
    """M = 1 with 16-bit x: out[n] = sum_k x[k] * w[n, k]. x is first scaled by a power of two 2^e that
    puts its largest magnitude in this program's K slice in [2^11, 2^12) (exact; X_PAIRS: `_x_f16_pairs_kernel`
    did that once for every program and left e and the fp16 pairs at exp_ptr and pairs_ptr), then each
    16-element block of a row is summed in fp16 pairs (`_E2M1X16_F16_DOT_PTX`: per word 6 integer ops, 4
    hardware widenings, 4 fp16x2 fmas), the block's two halves times its scale added in fp32, and 2^(6 - e)
    and `weight_scale_2` multiply the row's sum. Rows past N read row N - 1 (stored nowhere)."""
    NB: tl.constexpr = BLOCK_K // 16                                 # scale blocks of a K tile
    pid_k = tl.program_id(1)
    offs_n, mask_n, w_rows, s_rows = _gemv_rows(w_ptr, s_ptr, N, stride_wn, stride_sn, BLOCK_N)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PDL:   # launched beside x's pass (`x_pass_pdl`): its pairs are read after it ends
        gdc_wait()
    if AHEAD:   # the first step's words in flight during the scan of x (or the load of e) below
        wv, sb = _gemv_load_step(w_rows, s_rows, k_start, K, BLOCK_K, EVEN_K)
    if X_PAIRS:   # x's pass (`_x_f16_pairs_kernel`) found e and wrote the scaled pairs
        e = tl.load(exp_ptr + pid_k)
    else:
        e = x_exponent(x_ptr, k_start, k_end, stride_xk, XBLOCK)
    x_scale = pow2(e)
    acc = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    if AHEAD and not X_PAIRS:
        a0, a1, a2, a3, b0, b1, b2, b3 = _gemv_x_step(x_ptr, pairs_ptr, k_start, K, stride_xk, x_scale, BLOCK_K,
                                                      EVEN_K, X_PAIRS, USE_ASM, X_CONTIG)
    for k0 in range(0, k_per_split, BLOCK_K):
        if AHEAD:   # the next step's operands in flight while this one computes (the last step reloads itself)
            kk = k_start + tl.minimum(k0 + BLOCK_K, k_per_split - BLOCK_K)
            if X_PAIRS:   # the words and scales: x's pairs are L1 hits, loaded where they are used
                nxt_w, nxt_s = _gemv_load_step(w_rows, s_rows, kk, K, BLOCK_K, EVEN_K)
                a0, a1, a2, a3, b0, b1, b2, b3 = _gemv_x_step(x_ptr, pairs_ptr, k_start + k0, K, stride_xk, x_scale,
                                                              BLOCK_K, EVEN_K, X_PAIRS, USE_ASM, X_CONTIG)
            else:
                nxt = _gemv_operands(w_rows, s_rows, x_ptr, pairs_ptr, kk, K, stride_xk, x_scale, BLOCK_K, EVEN_K,
                                     X_PAIRS, USE_ASM, X_CONTIG)
        else:
            wv, sb, a0, a1, a2, a3, b0, b1, b2, b3 = _gemv_operands(w_rows, s_rows, x_ptr, pairs_ptr, k_start + k0, K,
                                                                   stride_xk, x_scale, BLOCK_K, EVEN_K, X_PAIRS,
                                                                   USE_ASM, X_CONTIG)
        acc = nvfp4_f16_block_sums(acc, wv, sb, (a0, a1, a2, a3, b0, b1, b2, b3), BLOCK_N, NB, USE_ASM)
        if AHEAD and X_PAIRS:
            wv, sb = nxt_w, nxt_s
        elif AHEAD:
            wv, sb, a0, a1, a2, a3, b0, b1, b2, b3 = nxt
    acc = times_pow2(tl.sum(acc, axis=1), 6 - e)       # the decode's 2^-6 and x's 2^e undone
    if SPLIT:
        tl.store(part_ptr + pid_k * N + offs_n, acc, mask=mask_n)
    else:
        acc = acc * tl.load(s2_ptr)
        tl.store(out_ptr + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _gemv_nvfp4_rows_kernel(pairs_ptr, exp_ptr, w_ptr, s_ptr, s2_ptr, out_ptr, part_ptr, N, K, k_per_split,
                            stride_wn, stride_sn, stride_om, stride_on,
                            ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                            AHEAD: tl.constexpr, SPLIT: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    """2 <= M <= 8 with 16-bit x, CUDA cores: `_gemv_nvfp4_f16_kernel`'s sums for each of the ROWS rows of x,
    from the pairs and exponents x's pass wrote for each row ([ROWS, K/2], [ROWS, slices]). Each block's words
    are decoded to fp16 pairs once (`_block_f16x2`) and serve every row (`_block_sum_f16x2`), so a row costs
    its fmas, not its decode. Row m's result is the M = 1 kernel's for x[m], bit for bit."""
    NB: tl.constexpr = BLOCK_K // 16                                 # scale blocks of a K tile
    pid_k = tl.program_id(1)
    offs_n, mask_n, w_rows, s_rows = _gemv_rows(w_ptr, s_ptr, N, stride_wn, stride_sn, BLOCK_N)
    k_start = pid_k * k_per_split
    if PDL:   # launched beside x's pass (`x_pass_pdl`): its pairs are read after it ends
        gdc_wait()
    if AHEAD:
        wv, sb = _gemv_load_step(w_rows, s_rows, k_start, K, BLOCK_K, EVEN_K)
    accs = ()
    for r in tl.static_range(ROWS):
        accs = accs + (tl.zeros([BLOCK_N, NB], dtype=tl.float32),)
    for k0 in range(0, k_per_split, BLOCK_K):
        if AHEAD:   # the next step's words and scales in flight while this one computes
            kk = k_start + tl.minimum(k0 + BLOCK_K, k_per_split - BLOCK_K)
            nxt_w, nxt_s = _gemv_load_step(w_rows, s_rows, kk, K, BLOCK_K, EVEN_K)
        else:
            wv, sb = _gemv_load_step(w_rows, s_rows, k_start + k0, K, BLOCK_K, EVEN_K)
        wa, wb = tl.split(tl.reshape(wv, [BLOCK_N, NB, 2]))          # each block's first and second word
        h = _block_f16x2(wa, wb, USE_ASM)
        scale = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        summed = ()
        for r in tl.static_range(ROWS):
            p = _x_pairs_step(pairs_ptr + r * (K // 2), k_start + k0, K, BLOCK_K, EVEN_K)
            lo, hi = _block_sum_f16x2(h, p, USE_ASM)
            summed = summed + (accs[r] + (lo + hi) * scale,)
        accs = summed
        if AHEAD:
            wv, sb = nxt_w, nxt_s
    s2 = tl.load(s2_ptr)
    for r in tl.static_range(ROWS):
        acc = times_pow2(tl.sum(accs[r], axis=1), 6 - tl.load(exp_ptr + r * tl.num_programs(1) + pid_k))
        if SPLIT:
            tl.store(part_ptr + (pid_k * ROWS + r) * N + offs_n, acc, mask=mask_n)
        else:
            tl.store(out_ptr + r * stride_om + offs_n * stride_on, (acc * s2).to(out_ptr.dtype.element_ty),
                     mask=mask_n)


def _e2m1_pair_ptx(t: int) -> str:
    """PTX of pair t: the exponent-mantissa fields shifted by 6 - 4t, the signs by 12 - 4t, the multiply."""
    mag, sign = 6 - 4 * t, 12 - 4 * t
    shift_mag = f"shl.b32 m, $8, {mag};" if mag >= 0 else f"shr.b32 m, $8, {-mag};"
    shift_sign = f"shl.b32 s, $8, {sign};" if sign else "mov.b32 s, $8;"
    return f"""
    {shift_mag}
    and.b32 m, m, 0x01C001C0;
    {shift_sign}
    and.b32 s, s, 0x80008000;
    or.b32 p, m, s;
    mul.rn.bf16x2 p, p, $9;
    mov.b32 {{${2 * t}, ${2 * t + 1}}}, p;"""


# E2M1 -> bf16 for the tensor-core path, on the GPU. Pair t (0..3) of a word is elements 8w + t (low half)
# and 8w + t + 4 (high half), whose nibbles lie 16 bits apart, so one shift and mask move both exponent-mantissa
# fields to bits 8:6 / 24:22 and another both signs to 15 / 31: bf16 numbers equal to the E2M1 values times
# 2^-126 (the E2M1 subnormal 0.5 lands on a bf16 subnormal; both formats are linear there). One bf16x2
# multiply by the block's scale * 2^118 (in $9, both halves) gives E2M1 * scale * 2^-8, exact: at most 6
# significant bits, at least 2^-18. Outputs: $0..$7 = elements 0, 4, 1, 5, 2, 6, 3, 7 of the word.
_E2M1X8_BF16_PTX = tl.constexpr("{\n    .reg .b32 m, s, p;" + "".join(_e2m1_pair_ptx(t) for t in range(4)) + "\n}")


@triton.jit
def _bf16_pair_f32(p):
    """int32 holding two bf16 bit patterns -> (low half, high half) as fp32."""
    return (p << 16).to(tl.float32, bitcast=True), (p & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1x8_scaled(w, scale, USE_ASM: tl.constexpr):
    """int32 words of 8 E2M1 codes and each word's block scale times 2^118 (`_scale_operand`) -> the word's
    elements 0, 4, 1, 5, 2, 6, 3, 7, each E2M1 * scale * 2^-8: bf16 from `_E2M1X8_BF16_PTX` on the GPU;
    in the interpreter (no inline asm) fp32 from the same pair bit patterns."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm=_E2M1X8_BF16_PTX, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r", args=[w, scale],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        sign = -0x7FFF8000                                           # 0x80008000
        e0, e4 = _bf16_pair_f32(((w << 6) & 0x01C001C0) | ((w << 12) & sign))
        e1, e5 = _bf16_pair_f32(((w << 2) & 0x01C001C0) | ((w << 8) & sign))
        e2, e6 = _bf16_pair_f32(((w >> 2) & 0x01C001C0) | ((w << 4) & sign))
        e3, e7 = _bf16_pair_f32(((w >> 6) & 0x01C001C0) | (w & sign))
        return e0 * scale, e4 * scale, e1 * scale, e5 * scale, e2 * scale, e6 * scale, e3 * scale, e7 * scale


@triton.jit
def _scale_operand(sb, USE_ASM: tl.constexpr):
    """E4M3 scale bytes (uint8) -> the block scale times 2^118 as `_e2m1x8_scaled` takes it: a bf16 pair
    (int32 bits, both halves) on the GPU, fp32 in the interpreter. Exact for every E4M3 value (0, or 2^-9 to
    448 in magnitude, 3 mantissa bits): at most 2^126.8 once scaled, inside bf16's range."""
    s = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 3.3230699894622897e35   # 2^118
    if USE_ASM:
        bits = s.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return bits * 0x10001
    else:
        return s


@triton.jit
def decoded_tile(wv, sb, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """A K tile's words [BN, BK/8] (int32) and scale bytes [BN, BK/16] -> [BN, BK], each element E2M1 * scale *
    2^-8 (`_e2m1x8_scaled`: exact in bf16 and fp16), K permuted within each word: position f of a word holds
    its element f // 2 + 4 (f % 2). `permuted_x` puts x in the same order."""
    W: tl.constexpr = BLOCK_K // 8
    NB: tl.constexpr = BLOCK_K // 16
    scale = _scale_operand(sb, USE_ASM)                                                  # [BN, NB]
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, NB, 2]), [BLOCK_N, W])   # per word
    e0, e4, e1, e5, e2, e6, e3, e7 = _e2m1x8_scaled(wv, scale, USE_ASM)                     # [BN, W] each
    # tl.join stacks on a new last axis: flattened position f of a word holds the f-th output of the decode,
    # element f // 2 + 4 (f % 2), and each output pair stays one 32-bit register into shared memory
    t = tl.join(tl.join(tl.join(e0, e2), tl.join(e1, e3)), tl.join(tl.join(e4, e6), tl.join(e5, e7)))
    return tl.reshape(t, [BLOCK_N, BLOCK_K])


@triton.jit
def permuted_x(xv, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x's K tile [BM, BK] in `decoded_tile`'s order, as fp32 (Triton 3.6 fails to compile the permute of a
    bf16 tile that feeds the dot directly). Repacking the permuted pairs costs about one PRMT per x element a
    program (sass_stats, 64 x 256 tile: 40 at 16 rows of x, 76 at 32), less than shuffling the decoded tile."""
    return tl.reshape(tl.permute(tl.reshape(xv.to(tl.float32), [BLOCK_M, BLOCK_K // 8, 2, 4]), (0, 1, 3, 2)),
                      [BLOCK_M, BLOCK_K])


@triton.jit
def _load_step(w_rows, s_rows, x_rows, mask_n, mask_m, kk, K, stride_xk,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, MASK_N: tl.constexpr):
    """One K step of the tensor-core kernels from element kk on: the words [BN, BK/8], scale bytes [BN, BK/16]
    and x [BM, BK] (EVEN_K: the step lies inside K, no K masks; MASK_N: rows past N masked, else the caller's
    rows all lie inside N, `_gemv_rows`, and the weight's loads carry no mask: 13-24 fewer sm_90 instructions
    a K step in `_gemm_nvfp4_f16_kernel`)."""
    word = kk // 8 + tl.arange(0, BLOCK_K // 8)
    blk = kk // 16 + tl.arange(0, BLOCK_K // 16)
    offs_k = kk + tl.arange(0, BLOCK_K)
    if EVEN_K:
        if MASK_N:
            wv = tl.load(w_rows + word[None, :], mask=mask_n[:, None], other=0)
            sb = tl.load(s_rows + blk[None, :], mask=mask_n[:, None], other=0)
        else:
            wv = tl.load(w_rows + word[None, :])
            sb = tl.load(s_rows + blk[None, :])
        xv = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)
    else:
        mask_w = (word < K // 8)[None, :]
        mask_s = (blk < K // 16)[None, :]
        if MASK_N:
            mask_w = mask_n[:, None] & mask_w
            mask_s = mask_n[:, None] & mask_s
        wv = tl.load(w_rows + word[None, :], mask=mask_w, other=0)
        sb = tl.load(s_rows + blk[None, :], mask=mask_s, other=0)
        xv = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
    return wv, sb, xv


@triton.jit
def _gemm_nvfp4_kernel(x_ptr, w_ptr, s_ptr, s2_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
                       stride_xm, stride_xk, stride_wn, stride_sn, stride_om, stride_on,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr,
                       EVEN_K: tl.constexpr, LOWP_DOT: tl.constexpr, SWAP_AB: tl.constexpr, SPLIT: tl.constexpr,
                       USE_ASM: tl.constexpr):
    """1 <= M <= 32 on the tensor cores: the weight read as int32 words of 8 codes (w_ptr: the bytes viewed
    as int32, stride_wn in words), decoded by `_e2m1x8_scaled` to exact bf16 values times their block
    scales, in the order 0, 4, 1, 5, 2, 6, 3, 7 within each word; x's K tile is loaded in that order too
    (a permutation of registers), so the dot needs no shuffle of the decoded tile. The loads run AHEAD
    (1 or 2) K steps before the decode that uses them (Triton's pipeliner does not take loads that feed
    arithmetic before the dot); EVEN_K: every K step lies inside K (no K masks)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)                                   # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN]
    mask_m = offs_m < M
    mask_n = offs_n < N
    n64 = offs_n.to(tl.int64)
    w_rows = w_ptr + n64[:, None] * stride_wn                        # [BN, 1]
    s_rows = s_ptr + n64[:, None] * stride_sn
    x_rows = x_ptr + offs_m[:, None] * stride_xm                     # [BM, 1]
    k_start = pid_k * k_per_split
    k_last = k_per_split - BLOCK_K                                   # the last step in the slice
    wv, sb, xv = _load_step(w_rows, s_rows, x_rows, mask_n, mask_m, k_start, K, stride_xk, BLOCK_K, EVEN_K, True)
    wv2, sb2, xv2 = wv, sb, xv
    if AHEAD == 2:
        wv2, sb2, xv2 = _load_step(w_rows, s_rows, x_rows, mask_n, mask_m, k_start + tl.minimum(BLOCK_K, k_last),
                                   K, stride_xk, BLOCK_K, EVEN_K, True)
    acc = dot_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, k_per_split, BLOCK_K):
        # the step AHEAD on (past the slice's end the last one again: no mask, an L2 hit)
        kk = k_start + tl.minimum(k0 + AHEAD * BLOCK_K, k_last)
        wv_a, sb_a, xv_a = _load_step(w_rows, s_rows, x_rows, mask_n, mask_m, kk, K, stride_xk, BLOCK_K, EVEN_K,
                                      True)
        w = decoded_tile(wv, sb, BLOCK_N, BLOCK_K, USE_ASM)          # [BN, BK], K permuted within each word
        acc = dot_acc(permuted_x(xv, BLOCK_M, BLOCK_K), w, acc, x_ptr.dtype.element_ty, LOWP_DOT, SWAP_AB)
        if AHEAD == 2:
            wv, sb, xv = wv2, sb2, xv2
            wv2, sb2, xv2 = wv_a, sb_a, xv_a
        else:
            wv, sb, xv = wv_a, sb_a, xv_a
    acc = dot_result(acc, SWAP_AB) * 256.0                           # [BM, BN]; the decode's 2^-8 undone
    if not SPLIT:
        acc = acc * tl.load(s2_ptr)
    store_tile(acc, out_ptr, part_ptr, pid_k, offs_m, offs_n, mask_m, mask_n, M, N, stride_om, stride_on, SPLIT)


# E2M1 -> fp16 times the block scale for the fp16 tensor-core kernel, on the GPU: $8 a word, $9 its block's
# scale as an fp16 pair (both halves). The GEMV's decode (`_e2m1_word_f16x2_ptx`: fp16 pairs of E2M1 * 2^-6),
# then one fp16x2 multiply a pair by the scale, exact (at most 6 significant bits, at least 2^-20: fp16
# holds it). Outputs: $0..$7 = elements 0, 2, 4, 6, 1, 3, 5, 7 of the word, the order of x's pass's pairs.
_E2M1X8_F16_SCALED_PTX = tl.constexpr(
    "{\n    .reg .b32 v, a, b, e, o, h0, h1, h2, h3;\n    .reg .b16 l0, l1, l2, l3;"
    + _e2m1_word_f16x2_ptx("$8", _H)
    + "".join(f"\n    mul.rn.f16x2 h{i}, h{i}, $9;\n    mov.b32 {{${2 * i}, ${2 * i + 1}}}, h{i};" for i in range(4))
    + "\n}")


@triton.jit
def _e2m1x8_f16_scaled(w, scale, USE_ASM: tl.constexpr):
    """int32 words of 8 E2M1 codes and each word's block scale (`_f16_scale_operand`) -> the word's elements
    0, 2, 4, 6, 1, 3, 5, 7, each E2M1 * 2^-6 * scale, exact in fp16: fp16 from `_E2M1X8_F16_SCALED_PTX` on the
    GPU; in the interpreter fp32 of the same values (the same E4M3 bytes widened through fp16 bits)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm=_E2M1X8_F16_SCALED_PTX, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r", args=[w, scale],
            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        even, odd = _e2m1_words_to_e4m3(w)
        e0, e2, e4, e6 = _e4m3x4_f32(even, USE_ASM)
        e1, e3, e5, e7 = _e4m3x4_f32(odd, USE_ASM)
        return e0 * scale, e2 * scale, e4 * scale, e6 * scale, e1 * scale, e3 * scale, e5 * scale, e7 * scale


@triton.jit
def _f16_scale_operand(sb, USE_ASM: tl.constexpr):
    """E4M3 scale bytes (uint8) -> the block scale as `_e2m1x8_f16_scaled` takes it: an fp16 pair (int32
    bits, both halves) on the GPU, fp32 in the interpreter. Exact: E4M3 values lie inside fp16's range."""
    s = sb.to(tl.float8e4nv, bitcast=True)
    if USE_ASM:
        return (s.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) * 0x10001
    else:
        return s.to(tl.float32)


@triton.jit
def _gemm_nvfp4_f16_kernel(x16_ptr, exp_ptr, w_ptr, s_ptr, s2_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
                           stride_wn, stride_sn, stride_om, stride_on,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           AHEAD: tl.constexpr, EVEN_K: tl.constexpr, LOWP_DOT: tl.constexpr,
                           SWAP_AB: tl.constexpr, SPLIT: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    """1 <= M <= 32 rows of 16-bit x on the tensor cores in fp16: x16 is x's pass's pairs read as fp16 [M, K]
    (`_x_f16_pairs_kernel`: row m's K slice s times 2^exp[m, s], each word's elements in the order 0, 2, 4,
    6, 1, 3, 5, 7); each word of the weight is decoded in that order to fp16 E2M1 * 2^-6 times its block scale
    (`_e2m1x8_f16_scaled`, exact), so the dot multiplies exactly what the reference does and sums in fp32; 2^(6
    - e) and `weight_scale_2` multiply the sums once. Rows past N read row N - 1 (stored nowhere). The loads run
    AHEAD (0 or 1) K steps before the decode that uses them. PDL: launched beside x's pass (`x_pass_pdl`)."""
    W: tl.constexpr = BLOCK_K // 8                                   # words of a K tile
    NB: tl.constexpr = BLOCK_K // 16                                 # scale blocks of a K tile
    if PDL:   # launched beside x's pass: its pairs are read after it ends
        gdc_wait()
    pid_k = tl.program_id(1)
    offs_n, mask_n, w_rows, s_rows = _gemv_rows(w_ptr, s_ptr, N, stride_wn, stride_sn, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)                                   # [BM]
    mask_m = offs_m < M
    x_rows = x16_ptr + offs_m[:, None] * K                           # [BM, 1]
    k_start = pid_k * k_per_split
    k_last = k_per_split - BLOCK_K                                   # the last step in the slice
    if AHEAD:
        wv, sb, xv = _load_step(w_rows, s_rows, x_rows, mask_n, mask_m, k_start, K, 1, BLOCK_K, EVEN_K, False)
    acc = dot_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in range(0, k_per_split, BLOCK_K):
        if AHEAD:   # the next step's operands in flight while this one computes (the last step reloads itself)
            nxt = _load_step(w_rows, s_rows, x_rows, mask_n, mask_m, k_start + tl.minimum(k0 + BLOCK_K, k_last), K, 1,
                             BLOCK_K, EVEN_K, False)
        else:
            wv, sb, xv = _load_step(w_rows, s_rows, x_rows, mask_n, mask_m, k_start + k0, K, 1, BLOCK_K, EVEN_K,
                                    False)
        scale = _f16_scale_operand(sb, USE_ASM)                      # [BN, NB]
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, NB, 2]), [BLOCK_N, W])   # per word
        o0, o1, o2, o3, o4, o5, o6, o7 = _e2m1x8_f16_scaled(wv, scale, USE_ASM)                 # [BN, W] each
        # tl.join stacks on a new last axis: this nesting puts output f at flattened position f of its word
        t = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))
        w = tl.reshape(t, [BLOCK_N, BLOCK_K])                        # [BN, BK], K in x16's order
        acc = dot_acc(xv, w, acc, tl.float16, LOWP_DOT, SWAP_AB)
        if AHEAD:
            wv, sb, xv = nxt
    acc = dot_result(acc, SWAP_AB)                                   # [BM, BN]
    e = tl.load(exp_ptr + offs_m * tl.num_programs(1) + pid_k, mask=mask_m, other=0)
    acc = times_pow2(acc, 6 - e[:, None])                            # the decode's 2^-6 and x's 2^e undone
    if not SPLIT:
        acc = acc * tl.load(s2_ptr)
    store_tile(acc, out_ptr, part_ptr, pid_k, offs_m, offs_n, mask_m, mask_n, M, N, stride_om, stride_on, SPLIT)


# The fp16-sum GEMV scans its K slice of x once per program for the scale; on programs of fewer rows than
# this the scan outweighs the rows' work and the fp32 GEMV is faster (2026-12-03: 2048 x 4096, planned at
# 4 rows a program, 7.5 us against 5.6; 512 x 2048 at 1 row, 4.7 against 3.3).
F16_GEMV_MIN_ROWS = 16

# 16-bit x of up to GEMV_MAX_ROWS rows on the LM heads runs the GEMV of several rows
# (`_gemv_nvfp4_rows_kernel`) rather than the tensor cores, whose kernel pads M to 16 and is bound by its
# shared-memory round trip. H200, 151936 x 2048 (BENCHMARKS.md, 2026-12-03 sixth run): M = 2 63.1 us and M = 4
# 88.3 against 115.1 and 115.7 on the tensor cores; M = 8 150.8 against 116.7. On 8192 x 2048 (2^24) the
# tensor cores stay ahead from M = 4 (11.2 us against 13.1): x's pass is one more launch there, on a call
# that short.
GEMV_MAX_ROWS = 4
ROWS_KERNEL_MAX = 8                          # what the kernel takes (explicit plans: tests, sweeps)


def uses_f16_gemv(x: torch.Tensor, plan: GemvPlan) -> bool:
    """Whether a GEMV plan sums blocks in fp16: 16-bit x, and `_gemv_nvfp4_rows_kernel` (M >= 2) or
    `_gemv_nvfp4_f16_kernel` on programs of F16_GEMV_MIN_ROWS rows or more, not the fp32 `_gemv_nvfp4_kernel`
    (nor the wgmma kernel in their place, `GemvPlan.wgmma`)."""
    return (not plan.use_dot and not plan.wgmma and x.dtype in (torch.bfloat16, torch.float16)
            and (x.shape[0] > 1 or plan.block_n >= F16_GEMV_MIN_ROWS))


# 16-bit x on weights of this many elements or more (the LM heads) runs x's pass first at every M
# (`_x_f16_pairs_kernel`: x scaled and paired once per call instead of in every program, one more launch) and
# takes `TILES_NVFP4_LM_HEAD`.
LM_HEAD_MIN_ELEMENTS = 1 << 26


def uses_x_pass(n: int, k: int) -> bool:
    """Whether 16-bit x times an [n, k] weight runs x's pass first at M = 1 (`LM_HEAD_MIN_ELEMENTS`; the GEMV
    of several rows always does)."""
    return n * k >= LM_HEAD_MIN_ELEMENTS


# 16-bit x on the LM heads (`LM_HEAD_MIN_ELEMENTS`), never narrowed (they have thousands of tiles):
# - one row, 32 x 256 with 2 warps, one step ahead: the same K loop as TILES_NVFP4's 64 x 256 with 4 warps
#   (2.73 instructions an element, 96 registers), half the rows a program, ahead of it in every H200 sweep
#   (151936 x 2048: 50.1-50.2 us against 50.9-51.0; 154880 x 4096: 106.7 against 106.8; BENCHMARKS.md, sixth
#   run); 2 to GEMV_MAX_ROWS rows without look-ahead (the registers go to the rows' sums: M = 4, 64 x 256:
#   88.5 us, 96.2 loading one step ahead).
# - M >= 17, the fp16 dot on x's pass's pairs (`_gemm_nvfp4_f16_kernel`): at M = 32, 64 x 128 with 4 warps,
#   one step ahead: 130.8 us on 151936 x 2048 and 265.7 on 154880 x 4096, against 140.7 and 280.9 for the
#   bf16 dot at its 64 x 256 (tune_gemv.py, 2026-12-03; 128 x 64 with 8 warps: 125.7 and 270.9).
TILES_NVFP4_LM_HEAD = dataclasses.replace(
    TILES_NVFP4, m1=Tile(32, 256, warps=2, stages=2), rows=Tile(64, 256, stages=1),
    m32=Tile(64, 128, stages=2, swap_ab=True), max_gemv_m=GEMV_MAX_ROWS, min_tiles=1)


@dataclasses.dataclass(frozen=True)
class XPairs:
    """What x's pass (`_x_f16_pairs_kernel`) writes for x [M, K], made by the kernel that computes x (the final
    RMSNorm: `rms_norm_triton(x_pairs=...)`) so that the GEMV need not launch the pass: the scaled fp16
    pairs (int32 [M, K/2]) and each K slice's exponent (int32 [M, slices]), in slices of k_per_split (the
    GEMV's plan's: `x_pass_split`), the pairs in the order `order` names (0 for the GEMVs and the fp16 dot,
    the K tile of the wgmma kernel's `dot_order`); `planned_x_pairs` makes them as a call will read them."""
    pairs: torch.Tensor
    exps: torch.Tensor
    k_per_split: int
    order: int = 0

    @classmethod
    def empty(cls, m: int, k: int, k_per_split: int, device: torch.device, order: int = 0) -> "XPairs":
        return cls(torch.empty((m, k // 2), dtype=torch.int32, device=device),
                   torch.empty((m, cdiv(k, k_per_split)), dtype=torch.int32, device=device), k_per_split,
                   order)

    def fill(self, x: torch.Tensor, pdl: bool = False) -> "XPairs":
        """Run x's pass of x [M, K] into these buffers (its slices and order); pdl: launched beside the kernel
        that wrote x (`x_pass_pdl`)."""
        m, k = x.shape
        _x_f16_pairs_kernel[(self.exps.shape[1], m)](x, self.pairs, self.exps, k, self.k_per_split, x.stride(0),
                                                     x.stride(1), BLOCK=x_scan_block(self.k_per_split),
                                                     USE_ASM=x.is_cuda, PDL=pdl, ORDER=self.order, num_warps=8)
        return self

    def check(self, m: int, k: int, k_per_split: int, device: torch.device, order: int = 0) -> None:
        """Refuse pairs that are not those of x [m, k] in slices of k_per_split and the given order, naming
        what differs."""
        want = ((m, k // 2), (m, cdiv(k, k_per_split)), k_per_split, order)
        got = (tuple(self.pairs.shape), tuple(self.exps.shape), self.k_per_split, self.order)
        if (got != want or self.pairs.dtype != torch.int32 or self.exps.dtype != torch.int32
                or not (self.pairs.is_contiguous() and self.exps.is_contiguous())
                or self.pairs.device != device or self.exps.device != device):
            raise ValueError(f"x_pairs: pairs {got[0]} {self.pairs.dtype}, exps {got[1]} {self.exps.dtype} on "
                             f"{self.pairs.device}, k_per_split {got[2]}, order {got[3]}; this call needs "
                             f"contiguous int32 pairs {want[0]} and exps {want[1]} on {device}, k_per_split "
                             f"{want[2]}, order {want[3]}: make them with `planned_x_pairs`, or pass "
                             "x_pairs=None")


def uses_f16_dot(x: torch.Tensor, n: int, k: int, plan: GemvPlan) -> bool:
    """Whether a tensor-core plan runs the fp16 dot on x's pass's pairs (`_gemm_nvfp4_f16_kernel`: 16-bit x
    on the LM heads, `LM_HEAD_MIN_ELEMENTS`, tiles of 32 rows of x), not the bf16 dot that decodes with shifts
    and reads x itself (`_gemm_nvfp4_kernel`), where the Gluon kernel does not run (`GemvPlan.wgmma`). H200,
    2026-12-03, 4 alternating rounds on 151936 x 2048: M = 32 130.6 us against 139.5; but M = 8 (tiles of 16
    rows) 118.5 against 115.9; and on smaller weights x's pass costs more than the dot saves (8192 x 2048,
    M = 32: 14.6 us against 13.3)."""
    return (not plan.wgmma and plan.use_dot and plan.block_m >= 32 and x.dtype in (torch.bfloat16, torch.float16)
            and uses_x_pass(n, k))


@functools.lru_cache(maxsize=None)
def _is_sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


# WGMMA_MIN_M to 32 rows of 16-bit x on the LM heads run the Gluon wgmma kernel on Hopper (sm_90) where K
# allows it (`GemvPlan.wgmma`, set by `default_plan`); WGMMA = False plans the Triton kernels there instead
# (their sweeps and comparisons). From 2 rows: H200, 2026-12-04, 3 alternating rounds (BENCHMARKS.md, twelfth
# run P), M = 2 56.5 us against 60.8 for the GEMV of several rows on 151936 x 2048, 109.7 against 121.0 on
# 154880 x 4096; M = 8 56.7 / 114.2 against 116.7 / 235.3 for the bf16 dot. WGMMA_MIN_M is read inside
# `_default_plan`'s cache: after changing it, call `_default_plan.cache_clear()`.
WGMMA = True
WGMMA_MIN_M = 2


def wgmma_refusal(x: torch.Tensor, k: int, plan: GemvPlan, words: torch.Tensor, scale_bits: torch.Tensor) -> str | None:
    """Why a plan with `wgmma` cannot run on x [M, k] and these words and scale bytes (the Gluon kernel's
    conditions), or None."""
    if not (x.is_cuda and _is_sm90(x.device)):
        return f"x on {x.device}: the kernel needs an sm_90 GPU"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype}: the kernel takes bf16 or fp16 x"
    return _wgmma_shape_refusal(x.shape[0], k, plan.splits) or wgmma_operand_refusal(words, scale_bits)


def wgmma_operand_refusal(words: torch.Tensor, scale_bits: torch.Tensor) -> str | None:
    """Why the Gluon kernel's TMA cannot read these words [N, K/8] (int32) and scale bytes [N, K/16] (uint8),
    or None (`tma_layout_refusal`'s rule)."""
    return tma_layout_refusal("weight", words) or tma_layout_refusal("weight_scale", scale_bits)


def _wgmma_shape_refusal(m: int, k: int, splits: int) -> str | None:
    """The shapes the Gluon kernel takes (the planner's rule and `wgmma_refusal`'s)."""
    from mtpfactory.kernels.gemm_nvfp4_wgmma import MIN_K_MULTIPLE
    if k % MIN_K_MULTIPLE or splits != 1 or m > MAX_M:
        return (f"M = {m}, K = {k}, {splits} K slices: the kernel takes up to {MAX_M} rows, K a multiple of "
                f"{MIN_K_MULTIPLE} and one K slice")
    return None


def _pairs_order(plan: GemvPlan) -> int:
    """The `XPairs.order` a call on this plan reads: the wgmma kernel's K tile where it runs, else 0."""
    if not plan.wgmma:
        return 0
    from mtpfactory.kernels.gemm_nvfp4_wgmma import ORDER
    return ORDER


def runs_x_pass(x: torch.Tensor, n: int, k: int, plan: GemvPlan) -> bool:
    """Whether the call runs x's pass first: the wgmma kernel and the fp16-sum GEMVs of several rows always, the
    GEMV of one row and the fp16 dot on the LM heads (`uses_x_pass`)."""
    return (plan.wgmma or (uses_f16_gemv(x, plan) and (x.shape[0] > 1 or uses_x_pass(n, k)))
            or uses_f16_dot(x, n, k, plan))


def x_pass_split(x: torch.Tensor, n: int, k: int, split_k: bool) -> int | None:
    """The k_per_split of the `XPairs` the planned call of x [M, k] on an [n, k] weight would make, or None
    where it makes none (its plan runs no x pass)."""
    plan = default_plan(x, n, k, split_k)
    return plan.k_per_split if runs_x_pass(x, n, k, plan) else None


def planned_x_pairs(x: torch.Tensor, n: int, k: int, split_k: bool, weight: torch.Tensor | None = None,
                    weight_scale: torch.Tensor | None = None) -> XPairs | None:
    """Empty `XPairs` for the kernel that computes x [M, k] to fill (the final norm), as the planned call of x
    on an [n, k] weight reads them: its plan's K slices, and the order of the kernel it runs (`XPairs.order`);
    None where that call runs no x pass. Given the weight and its scales, the plan is the one the call makes
    for them (`planned`: no wgmma kernel where its TMA cannot read them); without, one for a weight it can."""
    plan = default_plan(x, n, k, split_k) if weight is None else planned(x, n, k, split_k, weight, weight_scale)[0]
    return x_pairs_for(x, n, k, plan)


def x_pairs_for(x: torch.Tensor, n: int, k: int, plan: GemvPlan) -> XPairs | None:
    """Empty `XPairs` of x [M, k] as a call of `plan` on an [n, k] weight reads them, or None where it runs no
    x pass."""
    if not runs_x_pass(x, n, k, plan):
        return None
    return XPairs.empty(x.shape[0], k, plan.k_per_split, x.device, _pairs_order(plan))


def planned(x: torch.Tensor, n: int, k: int, split_k: bool, weight: torch.Tensor,
            weight_scale: torch.Tensor) -> tuple[GemvPlan, str | None]:
    """The plan of a call without one: `default_plan`, made again without the wgmma kernel where its TMA cannot
    read the weight or its scales (a view the Triton kernels read), and why it was dropped (else None)."""
    plan = default_plan(x, n, k, split_k)                            # wgmma only where x and the shapes allow
    if plan.wgmma and (why := wgmma_operand_refusal(weight, weight_scale)):
        return default_plan(x, n, k, split_k, wgmma=False), why
    return plan, None


def default_plan(x: torch.Tensor, n: int, k: int, split_k: bool, wgmma: bool = True) -> GemvPlan:
    """The planner's tiles for x [M, K] times an [n, k] NVFP4 weight: `TILES_NVFP4_LM_HEAD` for 16-bit x on
    the LM heads (`LM_HEAD_MIN_ELEMENTS`), else `TILES_NVFP4`; on the LM heads on sm_90, WGMMA_MIN_M to 32 rows
    run the wgmma kernel (`GemvPlan.wgmma`) where its shapes allow (`wgmma_refusal`; `linear_nvfp4_triton`
    plans again with wgmma=False for a weight its TMA cannot read)."""
    lm_head = x.dtype in (torch.bfloat16, torch.float16) and uses_x_pass(n, k)
    return _default_plan(x.shape[0], n, k, split_k, lm_head,
                         WGMMA and wgmma and lm_head and x.is_cuda and _is_sm90(x.device))


@functools.lru_cache(maxsize=1024)
def _default_plan(m: int, n: int, k: int, split_k: bool, lm_head: bool, sm90_lm_head: bool) -> GemvPlan:
    """`default_plan` from plain values (the module's threshold and switch read by the caller), cached: it runs
    on every call."""
    plan = plan_for(m, n, k, split_k, TILES_NVFP4_LM_HEAD if lm_head else TILES_NVFP4)
    if sm90_lm_head and m >= WGMMA_MIN_M and _wgmma_shape_refusal(m, k, plan.splits) is None:
        return dataclasses.replace(plan, wgmma=True)
    return plan


@functools.lru_cache(maxsize=None)
def device_refusal(device: torch.device) -> InputError | None:
    """Why the kernels cannot run on `device`, or None: the CPU (the interpreter) or a GPU whose PTX the
    kernels' inline assembly needs (`cvt.rn.f16x2.e4m3x2` sm_89, `mul.rn.bf16x2` sm_90)."""
    if device.type != "cuda" or (capability := torch.cuda.get_device_capability(device)) >= (9, 0):
        return None
    return InputError("x.device", f"{device}, capability {capability}", "the NVFP4 kernels' PTX needs sm_90 or "
                      "later", "call the op (`linear_nvfp4`) under runtime.backend=auto: it runs the reference here")


def operand_refusal(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    weight_scale_2: torch.Tensor) -> MtpfError | None:
    """Why the Triton kernels cannot take these operands, as the error `linear_nvfp4_triton` raises (the
    provider's predicate says no to the same calls), or None: x a 2-D bf16, fp16 or fp32 [M <= 32, K]; weight
    uint8 [N, K/2], K a multiple of 16, unit stride along K, rows on 4-byte boundaries (read as int32 words);
    weight_scale float8_e4m3fn [N, K/16], unit stride along K; weight_scale_2 one fp32 number; x on the CPU
    (the interpreter) or a GPU of sm_90 or later (the inline PTX)."""
    if err := x_refusal(x, "linear_nvfp4") or nvfp4_contract(x, weight, weight_scale, weight_scale_2):
        return err
    m, k = x.shape
    n = weight.shape[0]
    if err := reach_refusal(m, n, k, "linear_nvfp4"):
        return err
    if k:                                                            # K = 0 reads nothing: any layout
        if weight.stride(1) != 1:
            return WeightsError("weight", f"strides {weight.stride()}", "unit stride along K",
                                "pass weight.contiguous()")
        if err := words_refusal("weight", weight, WeightsError):
            return err
    if k and weight_scale.stride(1) != 1:
        return WeightsError("weight_scale", f"strides {weight_scale.stride()}", "unit stride along K",
                            "pass weight_scale.contiguous()")
    return device_refusal(x.device)


def words_refusal(name: str, codes: torch.Tensor, error: type[MtpfError]) -> MtpfError | None:
    """Why the kernels cannot read packed codes [..., R, K/2] (unit stride along K, checked before) as int32
    words of 8, as an `error` naming `name`, or None: every other dim (rows, experts) a multiple of 4 bytes apart,
    from a 4-byte boundary of the storage."""
    if any(stride % 4 for stride in codes.stride()[:-1]):
        dims = "rows and experts" if codes.dim() == 3 else "rows"
        return error(name, f"strides {codes.stride()}", f"{dims} a multiple of 4 bytes apart (the kernels read the "
                     "codes as int32 words)", f"pass {name}.contiguous()")
    if codes.storage_offset() % 4:
        return error(name, f"at byte {codes.storage_offset()} of its storage", "rows that start on 4-byte "
                     "boundaries (the kernels read the codes as int32 words)", f"pass {name}.clone()")
    return None


def plan_refusal(plan: GemvPlan, m: int, k: int, x16: bool) -> MtpfError | None:
    """Why `linear_nvfp4_triton` cannot run a given plan on x [m, k] (16-bit x: x16), as the error it raises,
    or None: tiles Triton can build (`plan_shape_refusal`), then NVFP4's own rules. The planner's plans always
    run."""
    if err := plan_shape_refusal(plan):
        return err
    if plan.block_k % NVFP4_BLOCK or (plan.use_dot and plan.block_k < 32):
        return InputError("plan.block_k", plan.block_k, "NVFP4 tiles hold whole 16-element blocks: a multiple of "
                          "16, at least 32 on the tl.dot path (block_m 16 or 32), where a dot takes K >= 16",
                          "use one of those")
    if plan.block_m < m or (1 < plan.block_m < 16 and (not x16 or plan.block_m > ROWS_KERNEL_MAX)):
        return InputError("plan", f"block_m = {plan.block_m} for M = {m}", f"a GEMV (block_m 1 for M = 1; 2, 4 "
                          f"or 8, at least M, for up to {ROWS_KERNEL_MAX} rows of bf16 or fp16 x) or the tensor "
                          "cores (block_m 16 or 32, at least M)", "use one of those")
    return k_slices_refusal(plan, k)


def linear_nvfp4_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor, *, split_k: bool = False, out: torch.Tensor | None = None,
                        plan: GemvPlan | None = None, x_pairs: XPairs | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize_nvfp4(weight [N, K/2], weight_scale [N, K/16], weight_scale_2)^T -> [M, N] in
    x's dtype (operands as `operand_refusal` says); arguments as `linear_triton`. A `plan` (`plan_refusal`):
    tiles Triton can build (`plan_shape_refusal`); block_k a multiple of 16; K slices of whole block_k steps
    that cover K, none empty; block_m at least M: 1, 2, 4 or 8 (the GEMVs; more than one row for 16-bit x
    only), 16 or 32 (the tensor cores); on the bf16 tensor-core path its num_stages - 1, 1 or 2, is how many K
    steps ahead the kernel loads: Triton's own pipeliner does not take loads that feed arithmetic before the
    dot; the fp16-sum GEMVs and the fp16 dot load one step ahead when num_stages > 1. `x_pairs`: x's pass
    already made (`XPairs`, for a plan that runs one): the kernel reads them and the pass is not launched."""
    pairs, exps = (None, None) if x_pairs is None else (x_pairs.pairs, x_pairs.exps)
    if err := (operand_refusal(x, weight, weight_scale, weight_scale_2)
               or out_overlap_refusal(out, x=x, weight=weight, weight_scale=weight_scale,
                                      weight_scale_2=weight_scale_2, **{"x_pairs.pairs": pairs, "x_pairs.exps": exps})):
        raise err
    return _linear_nvfp4_launch(x, weight, weight_scale, weight_scale_2, split_k, out, plan, x_pairs)


def _linear_nvfp4_launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         weight_scale_2: torch.Tensor, split_k: bool, out: torch.Tensor | None,
                         plan: GemvPlan | None, x_pairs: XPairs | None) -> torch.Tensor:
    """`linear_nvfp4_triton` on operands `operand_refusal` passed (the op's predicate checked them: one check a
    call): a given `plan` checked, else the call's own (`planned`)."""
    m, k = x.shape
    n = weight.shape[0]
    if m and n and k:                                                # an empty call launches nothing
        if plan is None:
            plan, why = planned(x, n, k, split_k, weight, weight_scale)
            if why and x_pairs is not None and x_pairs.order:
                raise ValueError(f"x_pairs: made in the wgmma kernel's order ({x_pairs.order}), which cannot run "
                                 f"here: {why}")
        else:
            if err := plan_refusal(plan, m, k, x.dtype in (torch.bfloat16, torch.float16)):
                raise err
            if plan.wgmma and (why := wgmma_refusal(x, k, plan, weight.view(torch.int32),
                                                    weight_scale.view(torch.uint8))):
                raise ValueError(f"plan: wgmma = True, but {why}: plan without it (default_plan sets it where it "
                                 "runs)")
    return _run_planned(x, weight, weight_scale, weight_scale_2, out, plan, x_pairs)


def _run_planned(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                 out: torch.Tensor | None, plan: GemvPlan | None, x_pairs: XPairs | None) -> torch.Tensor:
    """The call on a plan made or checked for these operands (`_linear_nvfp4_launch`; the fused op plans once for
    its norm's pairs and the GEMV); None only for an empty call."""
    m, k = x.shape
    n = weight.shape[0]
    out = out_or_empty(out, (m, n), x.dtype, x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if not int32_reach(out):   # the kernels index out in int32 (fewer than 2^31 elements): a contiguous one, copied
        return out.copy_(_run_planned(x, weight, weight_scale, weight_scale_2, None, plan, x_pairs))
    words = weight.view(torch.int32)                                 # [N, K/8]: 8 codes a word
    scale_bits = weight_scale.view(torch.uint8)                      # [N, K/16] E4M3 bit patterns
    if not int32_reach(x):                                           # and x
        x = x.contiguous()
    x_pass = runs_x_pass(x, n, k, plan)
    order = _pairs_order(plan)
    if x_pairs is not None:
        if not x_pass:
            raise ValueError(f"x_pairs: given for [{m}, {k}] {x.dtype} x on an [{n}, {k}] weight, whose plan runs no "
                             "x pass (16-bit x does on the GEMV of several rows and the wgmma kernel, and on a "
                             f"weight of {LM_HEAD_MIN_ELEMENTS} elements or more on the one-row GEMV and on "
                             "tensor-core tiles of 32 rows): pass x_pairs=None")
        x_pairs.check(m, k, plan.k_per_split, x.device, order)
    part = partial_buffer(plan, m, n, x)                              # None for the wgmma kernel: one slice
    scale_2 = weight_scale_2.reshape(1)
    grid = (cdiv(n, plan.block_n), plan.splits)
    pairs, exps = words, words                                       # read only with x's pass
    pdl = x_pass and x_pass_pdl(x)
    if x_pairs is not None:
        pairs, exps = x_pairs.pairs, x_pairs.exps
    elif x_pass:
        made = XPairs.empty(m, k, plan.k_per_split, x.device, order).fill(x, pdl)
        pairs, exps = made.pairs, made.exps
    if plan.wgmma:
        from mtpfactory.kernels.gemm_nvfp4_wgmma import gemm_nvfp4_wgmma
        gemm_nvfp4_wgmma(pairs.view(torch.float16), exps, words, scale_bits, scale_2, out, pdl)
    elif uses_f16_dot(x, n, k, plan):
        _gemm_nvfp4_f16_kernel[grid](
            pairs.view(torch.float16), exps, words, scale_bits, scale_2, out, part if part is not None else out,
            m, n, k, plan.k_per_split, words.stride(0), scale_bits.stride(0), out.stride(0), out.stride(1),
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, AHEAD=plan.num_stages > 1,
            EVEN_K=k % plan.k_per_split == 0, LOWP_DOT=lowp_dot(x), SWAP_AB=plan.swap_ab, SPLIT=part is not None,
            USE_ASM=x.is_cuda, PDL=pdl, num_warps=plan.num_warps, num_stages=1, launch_pdl=pdl)
    elif uses_f16_gemv(x, plan):
        if m > 1:
            _gemv_nvfp4_rows_kernel[grid](
                pairs, exps, words, scale_bits, scale_2, out, part if part is not None else out, n, k,
                plan.k_per_split, words.stride(0), scale_bits.stride(0), out.stride(0), out.stride(1),
                ROWS=m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, EVEN_K=k % plan.k_per_split == 0,
                AHEAD=plan.num_stages > 1, SPLIT=part is not None, USE_ASM=x.is_cuda, PDL=pdl,
                num_warps=plan.num_warps, num_stages=1, launch_pdl=pdl)
        else:
            _gemv_nvfp4_f16_kernel[grid](
                x, pairs, exps, words, scale_bits, scale_2, out, part if part is not None else out, n, k,
                plan.k_per_split, x.stride(1), words.stride(0), scale_bits.stride(0), out.stride(1),
                BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, EVEN_K=k % plan.k_per_split == 0,
                AHEAD=plan.num_stages > 1, X_PAIRS=x_pass, XBLOCK=x_scan_block(plan.k_per_split, 2048),
                SPLIT=part is not None, USE_ASM=x.is_cuda, PDL=pdl, X_CONTIG=x.stride(1) == 1,
                num_warps=plan.num_warps, num_stages=1, launch_pdl=pdl)
    elif plan.block_m == 1:
        _gemv_nvfp4_kernel[grid](
            x, words, scale_bits, scale_2, out, part if part is not None else out, n, k, plan.k_per_split,
            x.stride(1), words.stride(0), scale_bits.stride(0), out.stride(1),
            BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SPLIT=part is not None, USE_ASM=x.is_cuda,
            num_warps=plan.num_warps, num_stages=plan.num_stages)
    else:
        ahead = min(max(plan.num_stages - 1, 1), 2)
        _gemm_nvfp4_kernel[grid](
            x, words, scale_bits, scale_2, out, part if part is not None else out, m, n, k, plan.k_per_split,
            x.stride(0), x.stride(1), words.stride(0), scale_bits.stride(0), out.stride(0), out.stride(1),
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, AHEAD=ahead,
            EVEN_K=k % plan.k_per_split == 0, LOWP_DOT=lowp_dot(x), SWAP_AB=plan.swap_ab, SPLIT=part is not None,
            USE_ASM=x.is_cuda, num_warps=plan.num_warps, num_stages=1)
    if part is not None:
        splitk_reduce(part, out, scale_2, scale_mode=2)
    return out


def _linear_nvfp4_triton_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            weight_scale_2: torch.Tensor, split_work: bool = True) -> torch.Tensor:
    return _linear_nvfp4_launch(x, weight, weight_scale, weight_scale_2, split_work, None, None, None)


def _linear_nvfp4_refusal(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          weight_scale_2: torch.Tensor, split_work: bool = True) -> MtpfError | None:
    return operand_refusal(x, weight, weight_scale, weight_scale_2)


linear_nvfp4.register_provider("triton", _linear_nvfp4_triton_op, _linear_nvfp4_refusal)
