"""RMSNorm, plain (`x * rsqrt(mean(x^2) + eps) * w`) or zero-centred (`... * (1 + w)`), optionally fused
with the residual add that precedes it. Computed in fp32, returned in the input dtype.

The Triton provider can also make, from the normed row it holds in registers, the x pass of the NVFP4
GEMV that follows (`x_pairs`: an LM head after the final norm, `rms_norm_linear_nvfp4`), and let that GEMV
launch while it runs (`pdl`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from mtpfactory.kernels.fp_bits import cast_rne
from mtpfactory.kernels.linear_nvfp4 import XPairs, x_pairs_of_row
from mtpfactory.ops import Op, check_out, triton_can_run


def _rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                     residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     residual_out: torch.Tensor | None = None):
    """x, residual: [..., H]; weight: [H]. With `residual`, returns (norm(x + residual), x + residual). `out` /
    `residual_out` (optional, x's shape and dtype) receive the norm and the sum and are returned."""
    if out is not None:
        check_out(out, x.shape, x.dtype, x.device)
    if residual is not None and residual_out is not None:
        check_out(residual_out, x.shape, x.dtype, x.device, "residual_out")
    if residual is not None:
        x = x + residual if residual_out is None else torch.add(x, residual, out=residual_out)
    xf = x.float()
    w = weight.float() + 1.0 if zero_centred else weight.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
    if out is not None:
        y = out.copy_(y)
    return y if residual is None else (y, x)


rms_norm = Op("rms_norm", _rms_norm_native)


# --- Triton ---------------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, pairs_ptr, exp_ptr, H, eps, k_per_split,
                     HAS_RESIDUAL: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK_H: tl.constexpr,
                     X_PAIRS: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr, ORDER: tl.constexpr):
    """One row of H per program; the row lives in registers (BLOCK_H >= H, masked). X_PAIRS: also the NVFP4
    GEMV's x pass of the normed row (`x_pairs_of_row`: pairs [M, H/2] in ORDER, exps [M, slices of
    k_per_split]).
    PDL: the kernel after it may launch at once (it waits for this one to end before reading)."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        s = cast_rne(x + r, y_ptr.dtype.element_ty)  # the sum in x's dtype, as the reference rounds it
        tl.store(sum_ptr + row * H + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        w = w + 1.0
    y = cast_rne(x * rstd * w, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * H + cols, y, mask=mask)
    if X_PAIRS:
        x_pairs_of_row(y.to(tl.float32), cols, H, pairs_ptr + row * (H // 2),
                       exp_ptr + row * tl.cdiv(H, k_per_split), k_per_split, BLOCK_H, USE_ASM, ORDER)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_MAX_H = 65536  # one row in registers; wider rows fall back to native


def _rms_norm_supports(x, weight, eps, zero_centred, residual=None, out=None, residual_out=None) -> bool:
    tensors = [t for t in (x, weight, residual, out, residual_out) if t is not None]
    if not triton_can_run(*tensors) or x.dim() == 0:
        return False
    H = x.shape[-1]
    return (x.dtype in _FLOATS and weight.dtype in _FLOATS and 1 <= H <= _MAX_H
            and x.is_contiguous() and weight.is_contiguous() and tuple(weight.shape) == (H,)
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.is_contiguous()))
            and (out is None or out.is_contiguous())
            and (residual_out is None or residual_out.is_contiguous()))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                    residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    residual_out: torch.Tensor | None = None, x_pairs: XPairs | None = None, pdl: bool = False):
    """The reference's contract; `out` / `residual_out` (optional) receive the norm and the sum. `x_pairs`
    (optional) receives what the NVFP4 GEMV's x pass would write for the norm, viewed as [M, H] (H a multiple
    of 16); `pdl`: the next launch is a programmatic dependent launch (`linear.x_pass_pdl`)."""
    y = torch.empty_like(x) if out is None else out
    s = None if residual is None else (torch.empty_like(x) if residual_out is None else residual_out)
    check_out(y, x.shape, x.dtype, x.device, layout="contiguous")      # its predicate says no to others, so
    if s is not None:                                                # `auto` runs the reference on them
        check_out(s, x.shape, x.dtype, x.device, "residual_out", "contiguous")
    H = x.shape[-1]
    M = x.numel() // H
    if x_pairs is not None:
        if H % 16:
            raise ValueError(f"x_pairs: H = {H}; the NVFP4 GEMV's x pass takes rows of whole 16-element blocks: "
                             "pass x_pairs=None")
        if x_pairs.k_per_split % 8 or x_pairs.k_per_split <= 0:
            raise ValueError(f"x_pairs: k_per_split = {x_pairs.k_per_split}; slices hold whole 8-element words "
                             "(a positive multiple of 8): make the pairs with `planned_x_pairs`")
        if x_pairs.order and (x_pairs.order % 128 or H % x_pairs.order):
            raise ValueError(f"x_pairs: order {x_pairs.order} for rows of H = {H}; an order is 0 or the wgmma "
                             "kernel's K tile, a multiple of 128 dividing H: make the pairs with "
                             "`planned_x_pairs`")
        x_pairs.check(M, H, x_pairs.k_per_split, x.device, x_pairs.order)
    if M:
        block = triton.next_power_of_2(H)
        warps = 4 if block < 2048 else 8 if block < 8192 else 16
        pairs, exps = (y, y) if x_pairs is None else (x_pairs.pairs, x_pairs.exps)
        _rms_norm_kernel[(M,)](x, x if residual is None else residual, weight, y, y if s is None else s,
                               pairs, exps, H, eps, 1 if x_pairs is None else x_pairs.k_per_split,
                               HAS_RESIDUAL=residual is not None, ZERO_CENTRED=bool(zero_centred),
                               BLOCK_H=block, X_PAIRS=x_pairs is not None, USE_ASM=x.is_cuda, PDL=pdl,
                               ORDER=0 if x_pairs is None else x_pairs.order,
                               num_warps=warps)
    return y if residual is None else (y, s)


rms_norm.register_provider("triton", rms_norm_triton, _rms_norm_supports)
