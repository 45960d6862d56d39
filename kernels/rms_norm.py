"""RMSNorm, plain (`x * rsqrt(mean(x^2) + eps) * w`) or zero-centred (`... * (1 + w)`), optionally fused
with the residual add that precedes it. Computed in fp32, returned in the input dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.kernels.fp_bits import cast_rne
from mtpfactory.ops import Op, triton_can_run


def _rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                     residual: torch.Tensor | None = None):
    """x, residual: [..., H]; weight: [H]. With `residual`, returns (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    w = weight.float() + 1.0 if zero_centred else weight.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
    return y if residual is None else (y, x)


rms_norm = Op("rms_norm", _rms_norm_native)


# --- Triton ---------------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, H, eps,
                     HAS_RESIDUAL: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK_H: tl.constexpr):
    """One row of H per program; the row lives in registers (BLOCK_H >= H, masked)."""
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
    tl.store(y_ptr + row * H + cols, cast_rne(x * rstd * w, y_ptr.dtype.element_ty), mask=mask)


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
                                      and residual.is_contiguous())))


def _check_out(out: torch.Tensor, like: torch.Tensor, name: str) -> None:
    if out.shape != like.shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"{name}: got {tuple(out.shape)} {out.dtype}, need a contiguous "
                         f"{tuple(like.shape)} {like.dtype} tensor")


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                    residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    residual_out: torch.Tensor | None = None):
    """The reference's contract; `out` / `residual_out` (optional) receive the norm and the sum."""
    y = torch.empty_like(x) if out is None else out
    s = None if residual is None else (torch.empty_like(x) if residual_out is None else residual_out)
    _check_out(y, x, "out")
    if s is not None:
        _check_out(s, x, "residual_out")
    H = x.shape[-1]
    M = x.numel() // H
    if M:
        block = triton.next_power_of_2(H)
        warps = 4 if block < 2048 else 8 if block < 8192 else 16
        _rms_norm_kernel[(M,)](x, x if residual is None else residual, weight, y, y if s is None else s,
                               H, eps, HAS_RESIDUAL=residual is not None, ZERO_CENTRED=bool(zero_centred),
                               BLOCK_H=block, num_warps=warps)
    return y if residual is None else (y, s)


rms_norm.register_provider("triton", rms_norm_triton, _rms_norm_supports)
