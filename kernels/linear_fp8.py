"""W8A16 linear: y = (x @ W8^T) * weight_scale, W8 float8_e4m3fn [N, K] with one fp32 scale per output row.

The Triton provider is `linear.py`'s GEMV / small-M GEMM with the FP8 tile widened in registers (to fp32,
or on the GPU's dot path to x's dtype: every E4M3 value is exact in bf16 and fp16; with bf16 x on weights of
2^26 elements or more to fp16, x scaled into fp16 per row by a pass of its own, `F16_DOT_MIN_ELEMENTS`), the
row scale applied once to the fp32 sum, as the reference does; split-K defers the scale to the reduction.
"""

from __future__ import annotations

import torch

from mtpfactory.kernels.linear import GemvPlan, _linear_launch, linear_contract, linear_triton, operand_refusal
from mtpfactory.ops import Op


def _linear_fp8_native(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       split_work: bool = True) -> torch.Tensor:
    """x: [..., K] bf16/fp16/fp32; weight: float8_e4m3fn [N, K]; weight_scale: fp32 [N] (`linear_contract`).
    Returns [..., N] in x's dtype."""
    if err := linear_contract(x, weight, weight_scale):
        raise err
    return (x.float() @ weight.float().T * weight_scale).to(x.dtype)


linear_fp8 = Op("linear_fp8", _linear_fp8_native,
                lambda x, weight, weight_scale, split_work=True: linear_contract(x, weight, weight_scale))


def linear_fp8_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *, split_k: bool = False,
                      out: torch.Tensor | None = None, plan: GemvPlan | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * weight_scale [N])^T -> [M, N] in x's dtype; arguments as `linear_triton`,
    whose kernel this is (the scale applied per output column)."""
    return linear_triton(x, weight, split_k=split_k, out=out, plan=plan, weight_scale=weight_scale)


def _linear_fp8_triton_op(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          split_work: bool = True) -> torch.Tensor:
    return _linear_launch(x, weight, split_work, None, None, weight_scale)   # the predicate checked the operands


def _linear_fp8_refusal(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, split_work: bool = True):
    return operand_refusal(x, weight, weight_scale)


linear_fp8.register_provider("triton", _linear_fp8_triton_op, _linear_fp8_refusal)
