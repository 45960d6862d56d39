"""W8A16 linear: y = (x @ W8^T) * weight_scale, W8 float8_e4m3fn [N, K] with one fp32 scale per output row.

The Triton provider is `linear.py`'s GEMV / small-M GEMM with the FP8 tile widened in registers (to fp32,
or on the GPU's dot path to x's dtype: every E4M3 value is exact in bf16 and fp16), the row scale applied
once to the fp32 sum, as the reference does; split-K defers the scale to the reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.kernels.linear import (
    GemvPlan,
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


def _linear_fp8_native(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       split_work: bool = True) -> torch.Tensor:
    """x: [M, K] bf16/fp16/fp32; weight: float8_e4m3fn [N, K]; weight_scale: fp32 [N]. Returns [M, N] in x's dtype."""
    return (x.float() @ weight.float().T * weight_scale).to(x.dtype)


linear_fp8 = Op("linear_fp8", _linear_fp8_native)


@triton.jit
def _linear_fp8_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
                       stride_xm, stride_xk, stride_wn, stride_om, stride_on,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_DOT: tl.constexpr, LOWP_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
                       SPLIT: tl.constexpr):
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
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_start + k0 + tl.arange(0, BLOCK_K)                # [BK]
        mask_k = offs_k < K
        x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)                        # [BM, BK]
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)                        # [BN, BK], E4M3 values, exact
        if USE_DOT:
            acc = dot_acc(x, w, acc, x_ptr.dtype.element_ty, LOWP_DOT, SWAP_AB)
        else:
            acc3 += x[:, None, :] * w[None, :, :]                    # [BM, BN, BK]
    if USE_DOT:
        acc = dot_result(acc, SWAP_AB)                               # [BM, BN]
    else:
        acc = tl.sum(acc3, axis=2)                                   # [BM, BN]
    if not SPLIT:
        acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    store_tile(acc, out_ptr, part_ptr, pid_k, offs_m, offs_n, mask_m, mask_n, M, N, stride_om, stride_on, SPLIT)


def linear_fp8_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *, split_k: bool = False,
                      out: torch.Tensor | None = None, plan: GemvPlan | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * weight_scale [N])^T -> [M, N] in x's dtype; arguments as `linear_triton`."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"x is [{m}, {k}], weight {tuple(weight.shape)} with strides {weight.stride()}: "
                         "the weight must be [N, K] with unit stride along K")
    out = check_out(out, m, n, x)
    if m == 0 or n == 0:
        return out
    plan = plan or plan_for(m, n, k, split_k)
    part = partial_buffer(plan, m, n, x)
    grid = (triton.cdiv(n, plan.block_n), plan.splits)
    _linear_fp8_kernel[grid](
        x, weight, weight_scale, out, part if part is not None else out, m, n, k, plan.k_per_split,
        x.stride(0), x.stride(1), weight.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, USE_DOT=plan.use_dot,
        LOWP_DOT=lowp_dot(x), SWAP_AB=plan.swap_ab, SPLIT=part is not None, num_warps=plan.num_warps,
        num_stages=plan.num_stages)
    if part is not None:
        splitk_reduce(part, out, weight_scale, scale_mode=1)
    return out


def _linear_fp8_supports(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         split_work: bool = True) -> bool:
    return (triton_can_run(x, weight, weight_scale) and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype == torch.float8_e4m3fn and weight_scale.dtype == torch.float32
            and tuple(weight_scale.shape) == (weight.shape[0],) and weight_scale.is_contiguous()
            and supports_small_m(x, weight.shape[1]))


def _linear_fp8_triton_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          split_work: bool = True) -> torch.Tensor:
    return linear_fp8_triton(x, weight, weight_scale, split_k=split_work)


linear_fp8.register_provider("triton", _linear_fp8_triton_op, _linear_fp8_supports)
