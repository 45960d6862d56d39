"""W4A16 linear in the ModelOpt NVFP4 layout (DESIGN 3): y = x @ dequantize_nvfp4(weight, weight_scale,
weight_scale_2)^T, weight uint8 [N, K/2] (element 2j in the low nibble), weight_scale float8_e4m3fn [N, K/16],
weight_scale_2 one fp32 number.

Hopper has no FP4 tensor cores and `tl.dot_scaled` with e2m1 does not compile there (Triton 3.6), so the
Triton provider decodes in registers, inside `linear.py`'s GEMV / small-M GEMM loop:
- a K tile is NB = BLOCK_K / 16 scale blocks of 8 bytes: bytes [BN, NB, 8], scales [BN, NB];
- an E2M1 code becomes fp16 bits with three integer ops, `(c & 7) << 9 | (c & 8) << 12`, whose value is
  exactly the E2M1 value times 2^-14 (code 1, the E2M1 subnormal 0.5, lands on an fp16 subnormal, which
  the fp16 -> fp32 conversion keeps exact); an E4M3 scale likewise becomes fp16 bits
  `(b & 0x7f) << 7 | (b & 0x80) << 8`, its value times 2^-8; decoded code * (decoded scale * 2^22) is
  then exactly E2M1 value * E4M3 scale, which fits fp32 and bf16/fp16 (at most 6 significant bits), so
  the tensor cores see exact weights;
- the low nibbles meet the even elements of x and the high nibbles the odd ones (x is loaded as
  [BM, BK/2, 2] and split), so codes are never interleaved;
- the per-tensor `weight_scale_2` multiplies the fp32 sum once (loaded on the device: no host sync).
E4M3 0x7f/0xff (NaN) decodes to +-480, not NaN: the quantizer never stores it and the loader refuses it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.kernels.linear import (
    GemvPlan,
    TileTable,
    check_out,
    dot_acc,
    dot_result,
    dot_zeros,
    lowp_dot,
    partial_buffer,
    plan_for,
    splitk_reduce,
    store_tile,
    supports_small_m,
)
from mtpfactory.ops import Op, triton_can_run
from mtpfactory.quant import NVFP4_BLOCK, dequantize_nvfp4


def _linear_nvfp4_native(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         weight_scale_2: torch.Tensor, split_work: bool = True) -> torch.Tensor:
    """x: [M, K] bf16/fp16/fp32; weight: uint8 [N, K/2]; weight_scale: float8_e4m3fn [N, K/16];
    weight_scale_2: fp32 scalar. Returns [M, N] in x's dtype."""
    return (x.float() @ dequantize_nvfp4(weight, weight_scale, weight_scale_2).T).to(x.dtype)


linear_nvfp4 = Op("linear_nvfp4", _linear_nvfp4_native)

# M = 1 is bound by the decode arithmetic (wide N tiles share each x load across rows); on the tl.dot path
# BLOCK_K >= 32, since each tl.dot sees half the tile (the even or the odd elements). H200 sweep 2026-12-02.
TILES_NVFP4 = TileTable(m1=(64, 256), m16=(128, 64), m32=(128, 64), min_tiles=512, max_block_k_dot=128,
                        min_block_k=32)


@triton.jit
def _e2m1_f16_bits(code):
    """4-bit E2M1 codes (int32) -> fp32 values times 2^-14, through fp16 bits."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_bits_to_f32(b):
    """E4M3 bit patterns (int32) -> fp32 values times 2^-8, through fp16 bits."""
    bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_pair_f32(wb):
    """Bytes of two E2M1 codes (int32, 0..255) -> the low and the high nibble's exact fp32 values, three
    integer ops and one multiply each: shifting the code's sign bit to bit 31 and then arithmetically back
    by 6 puts its exponent and mantissa at bits 24..22 (the mask clears the sign's copies and the other
    nibble), an fp32 that reads as the E2M1 value times 2^-126 (code 1, the subnormal 0.5, lands on an fp32
    subnormal, which the multiply keeps: no flush to zero); 2^126 makes it the value."""
    lo = (((wb << 28) >> 6) & -2118123520).to(tl.float32, bitcast=True)   # mask 0x81C00000
    hi = (((wb << 24) >> 6) & -2118123520).to(tl.float32, bitcast=True)
    return lo * 8.507059173023462e37, hi * 8.507059173023462e37        # 2^126


@triton.jit
def _linear_nvfp4_kernel(x_ptr, w_ptr, s_ptr, s2_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
                         stride_xm, stride_xk, stride_wn, stride_sn, stride_om, stride_on,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_DOT: tl.constexpr, LOWP_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
                         SPLIT: tl.constexpr):
    NB: tl.constexpr = BLOCK_K // 16                                 # scale blocks in a K tile
    HALF_K: tl.constexpr = BLOCK_K // 2                              # bytes (element pairs) in a K tile
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)                                   # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN]
    offs_b = tl.arange(0, NB)                                        # [NB]
    offs_i = tl.arange(0, 8)                                         # [8] bytes of a block
    offs_p = tl.arange(0, HALF_K)                                    # [BK/2] element pairs
    mask_m = offs_m < M
    mask_n = offs_n < N
    n64 = offs_n.to(tl.int64)
    x_rows = x_ptr + offs_m[:, None, None] * stride_xm               # [BM, 1, 1]
    w_rows = w_ptr + n64[:, None, None] * stride_wn                  # [BN, 1, 1]
    s_rows = s_ptr + n64[:, None] * stride_sn                        # [BN, 1]
    k_start = pid_k * k_per_split
    if USE_DOT:
        acc = dot_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    elif BLOCK_M == 1:
        acc_b = tl.zeros([BLOCK_N, NB], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, HALF_K], dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        blk = (k_start + k0) // 16 + offs_b                          # [NB] scale-block index along K
        mask_b = blk < K // 16
        byte = w_rows + (blk[None, :, None] * 8 + offs_i[None, None, :])
        wb = tl.load(byte, mask=mask_n[:, None, None] & mask_b[None, :, None], other=0).to(tl.int32)  # [BN, NB, 8]
        sb = tl.load(s_rows + blk[None, :], mask=mask_n[:, None] & mask_b[None, :], other=0).to(tl.int32)
        if BLOCK_M == 1:
            # GEMV: each 16-element block's sum of exact E2M1 values times x, then its scale once; x as
            # [NB, 8, 2] (block, byte, nibble) so that it lines up with the bytes without a shuffle
            xo = k_start + k0 + (offs_b[:, None, None] * 16 + offs_i[None, :, None] * 2
                                 + tl.arange(0, 2)[None, None, :])   # [NB, 8, 2] K index
            xv = tl.load(x_ptr + xo * stride_xk, mask=(xo < K) & (M > 0), other=0.0).to(tl.float32)
            x_lo, x_hi = tl.split(xv)                                # [NB, 8] even and odd elements
            c_lo, c_hi = _e2m1_pair_f32(wb)                          # [BN, NB, 8]
            block_sum = tl.sum(c_lo * x_lo[None, :, :] + c_hi * x_hi[None, :, :], axis=2)   # [BN, NB]
            acc_b += block_sum * (_e4m3_bits_to_f32(sb) * 256.0)     # exact E4M3 scale
        else:
            scale = (_e4m3_bits_to_f32(sb) * 4194304.0)[:, :, None]   # [BN, NB, 1], E4M3 * 2^14
            w_lo = tl.reshape(_e2m1_f16_bits(wb & 15) * scale, [BLOCK_N, HALF_K])  # [BN, BK/2] elements 2j
            w_hi = tl.reshape(_e2m1_f16_bits(wb >> 4) * scale, [BLOCK_N, HALF_K])  # [BN, BK/2] elements 2j+1
            pair = k_start + k0 + 2 * offs_p                         # [BK/2] even K index
            x_mask = mask_m[:, None, None] & (pair < K)[None, :, None]
            x = tl.load(x_rows + (pair[None, :, None] + tl.arange(0, 2)[None, None, :]) * stride_xk,
                        mask=x_mask, other=0.0).to(tl.float32)       # [BM, BK/2, 2]
            x_lo, x_hi = tl.split(x)                                 # [BM, BK/2] each
            if USE_DOT:
                acc = dot_acc(x_lo, w_lo, acc, x_ptr.dtype.element_ty, LOWP_DOT, SWAP_AB)
                acc = dot_acc(x_hi, w_hi, acc, x_ptr.dtype.element_ty, LOWP_DOT, SWAP_AB)
            else:
                acc3 += x_lo[:, None, :] * w_lo[None, :, :] + x_hi[:, None, :] * w_hi[None, :, :]
    if USE_DOT:
        acc = dot_result(acc, SWAP_AB)                               # [BM, BN]
    elif BLOCK_M == 1:
        acc = tl.sum(acc_b, axis=1)[None, :]                         # [1, BN]
    else:
        acc = tl.sum(acc3, axis=2)                                   # [BM, BN]
    if not SPLIT:
        acc = acc * tl.load(s2_ptr)
    store_tile(acc, out_ptr, part_ptr, pid_k, offs_m, offs_n, mask_m, mask_n, M, N, stride_om, stride_on, SPLIT)


def linear_nvfp4_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor, *, split_k: bool = False, out: torch.Tensor | None = None,
                        plan: GemvPlan | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize_nvfp4(weight [N, K/2], weight_scale [N, K/16], weight_scale_2)^T -> [M, N] in
    x's dtype; arguments as `linear_triton` (a `plan`'s block_k must be a multiple of 16)."""
    m, k = x.shape
    n = weight.shape[0]
    if k % NVFP4_BLOCK or weight.shape[1] * 2 != k or weight.stride(1) != 1:
        raise ValueError(f"x is [{m}, {k}], weight {tuple(weight.shape)} with strides {weight.stride()}: NVFP4 "
                         "needs K a multiple of 16 and a row-major uint8 [N, K/2] weight")
    out = check_out(out, m, n, x)
    if m == 0 or n == 0:
        return out
    plan = plan or plan_for(m, n, k, split_k, TILES_NVFP4)
    if plan.block_k % NVFP4_BLOCK or (plan.use_dot and plan.block_k < 32):
        raise ValueError(f"plan.block_k = {plan.block_k}: NVFP4 tiles hold whole 16-element blocks, and on the "
                         "tl.dot path (block_m >= 16) at least 32 elements (a dot takes K >= 16); use a "
                         "multiple of 16, 32 or more for the dot")
    part = partial_buffer(plan, m, n, x)
    scale_bits = weight_scale.view(torch.uint8)                      # [N, K/16] E4M3 bit patterns
    scale_2 = weight_scale_2.reshape(1)
    grid = (triton.cdiv(n, plan.block_n), plan.splits)
    _linear_nvfp4_kernel[grid](
        x, weight, scale_bits, scale_2, out, part if part is not None else out, m, n, k, plan.k_per_split,
        x.stride(0), x.stride(1), weight.stride(0), scale_bits.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, USE_DOT=plan.use_dot,
        LOWP_DOT=lowp_dot(x), SWAP_AB=plan.swap_ab, SPLIT=part is not None, num_warps=plan.num_warps,
        num_stages=plan.num_stages)
    if part is not None:
        splitk_reduce(part, out, scale_2, scale_mode=2)
    return out


def _linear_nvfp4_supports(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           weight_scale_2: torch.Tensor, split_work: bool = True) -> bool:
    if not (weight.dim() == 2 and weight_scale.dim() == 2):
        return False
    n, k = weight.shape[0], 2 * weight.shape[1]
    return (triton_can_run(x, weight, weight_scale, weight_scale_2) and k % NVFP4_BLOCK == 0
            and weight.dtype == torch.uint8 and weight.is_contiguous()
            and weight_scale.dtype == torch.float8_e4m3fn and tuple(weight_scale.shape) == (n, k // NVFP4_BLOCK)
            and weight_scale.stride(1) == 1
            and weight_scale_2.dtype == torch.float32 and weight_scale_2.numel() == 1
            and supports_small_m(x, k))


def _linear_nvfp4_triton_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            weight_scale_2: torch.Tensor, split_work: bool = True) -> torch.Tensor:
    return linear_nvfp4_triton(x, weight, weight_scale, weight_scale_2, split_k=split_work)


linear_nvfp4.register_provider("triton", _linear_nvfp4_triton_op, _linear_nvfp4_supports)
