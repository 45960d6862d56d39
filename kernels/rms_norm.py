"""RMSNorm, plain (`x * rsqrt(mean(x^2) + eps) * w`) or zero-centred (`... * (1 + w)`), optionally fused
with the residual add that precedes it (a residual of the input's shape and dtype). Computed in fp32,
returned in the input dtype.

The Triton provider can also make, from the normed row it holds in registers, the x pass of the NVFP4
GEMV that follows (`x_pairs`: an LM head after the final norm, `rms_norm_linear_nvfp4`), and let that GEMV
launch while it runs (`pdl`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from mtpfactory.errors import InputError
from mtpfactory.kernels.fp_bits import cast_rne
from mtpfactory.kernels.linear_nvfp4 import XPairs, x_pairs_of_row
from mtpfactory.ops import (FLOATS, Op, check_out, next_power_of_2, number_refusal, out_refusal, outs_apart_refusal,
                            overlap_refusal)


def residual_refusal(x: torch.Tensor, residual: torch.Tensor | None,
                     residual_out: torch.Tensor | None = None) -> InputError | None:
    """Why the op cannot add `residual` to x, or None: every provider returns the sum and the norm in x's
    dtype, so the residual has x's shape and dtype (no broadcast, no promotion: a bf16 x and an fp32 residual
    would otherwise come back fp32 from the reference and bf16 from the kernel); `residual_out`, which receives
    the sum, only with a residual (without one there is no sum, and it would silently stay unwritten)."""
    if residual is None and residual_out is not None:
        return InputError("residual_out", f"{residual_out.dtype} {list(residual_out.shape)}", "a buffer for "
                          "x + residual, given only with residual (without one there is no sum to write)",
                          "pass the residual, or leave residual_out=None")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return InputError("residual", f"{residual.dtype} {list(residual.shape)}", f"x's shape and dtype, {x.dtype} "
                          f"{list(x.shape)}: the sum x + residual is returned in x's dtype",
                          "pass residual.to(x.dtype), of x's shape")
    return None


def norm_contract(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                  residual_out: torch.Tensor | None = None, weight_field: str = "weight") -> InputError | None:
    """Why the reference cannot normalize these, or None (every provider refuses the same calls): x a bf16, fp16
    or fp32 [..., H]; weight (named `weight_field`) a bf16, fp16 or fp32 [H]; residual as `residual_refusal`."""
    if x.dim() == 0 or x.dtype not in FLOATS:
        return InputError("x", f"{x.dtype} {list(x.shape)}", "a bf16, fp16 or fp32 [..., H] tensor",
                          "pass the hidden rows in the run's dtype, H last")
    h = x.shape[-1]
    if weight.dtype not in FLOATS or tuple(weight.shape) != (h,):
        return InputError(weight_field, f"{weight.dtype} {list(weight.shape)}", f"a bf16, fp16 or fp32 [H] = [{h}] "
                          f"tensor (x is {list(x.shape)})", f"pass the norm's [{h}] weight")
    return residual_refusal(x, residual, residual_out)


def _rms_norm_contract(x, weight, eps, zero_centred, residual=None, out=None, residual_out=None) -> InputError | None:
    """What the reference refuses before anything runs (every provider refuses the same)."""
    return (norm_contract(x, weight, residual, residual_out)
            or out_refusal(out, x.shape, x.dtype, x.device)
            or out_refusal(residual_out, x.shape, x.dtype, x.device, "residual_out")
            or outs_apart_refusal("residual_out", residual_out, out=out))


def _rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                     residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     residual_out: torch.Tensor | None = None):
    """x, residual: [..., H]; weight: [H] (`norm_contract`). With `residual` (x's shape and dtype), returns
    (norm(x + residual), x + residual). `out` / `residual_out` (optional, x's shape and dtype) receive the norm
    and the sum and are returned."""
    if err := _rms_norm_contract(x, weight, eps, zero_centred, residual, out, residual_out):
        raise err
    s = x if residual is None else x + residual
    xf = s.float()
    w = weight.float() + 1.0 if zero_centred else weight.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
    # both written only once both are computed: an out or residual_out may share memory with any input
    if residual_out is not None:
        s = residual_out.copy_(s)
    if out is not None:
        y = out.copy_(y)
    return y if residual is None else (y, s)


rms_norm = Op("rms_norm", _rms_norm_native, _rms_norm_contract)


# --- Triton ---------------------------------------------------------------------------------------------------

@triton.jit
def norm_row(x, w_ptr, cols, mask, H, eps, dtype: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """One row x (fp32 [BLOCK_H], zero past H) normalized as the reference does it, x * rstd * w (w + 1 when
    ZERO_CENTRED) in fp32, rounded to `dtype`."""
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        w = w + 1.0
    return cast_rne(x * rstd * w, dtype)


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
    y = norm_row(x, w_ptr, cols, mask, H, eps, y_ptr.dtype.element_ty, ZERO_CENTRED)
    tl.store(y_ptr + row * H + cols, y, mask=mask)
    if X_PAIRS:
        x_pairs_of_row(y.to(tl.float32), cols, H, pairs_ptr + row * (H // 2),
                       exp_ptr + row * tl.cdiv(H, k_per_split), k_per_split, BLOCK_H, USE_ASM, ORDER)


_MAX_H = 65536  # one row in registers; wider rows fall back to native


def rms_norm_refusal(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                     weight_field: str = "weight", residual_out: torch.Tensor | None = None) -> InputError | None:
    """Why `rms_norm_triton` cannot take these operands, as the error it raises (its predicate says no to the
    same calls, and `rms_norm_linear_nvfp4_triton` asks it about its norm, the weight named `weight_field`), or
    None: x a contiguous bf16, fp16 or fp32 [..., H], 1 <= H <= 65536 (the row in registers; the kernel steps
    rows by H); weight a contiguous bf16, fp16 or fp32 [H] (read with unit stride); residual a contiguous
    tensor of x's shape and dtype; residual_out only with a residual (`residual_refusal`)."""
    if err := norm_contract(x, weight, residual, residual_out, weight_field):
        return err
    if not 1 <= x.shape[-1] <= _MAX_H:
        return InputError("x", f"{x.dtype} {list(x.shape)}", f"a bf16, fp16 or fp32 [..., H] tensor, 1 <= H <= "
                          f"{_MAX_H} (one row in registers)", "call the op (`rms_norm`) under runtime.backend=auto: "
                          "it runs the reference for others")
    if not x.is_contiguous():
        return InputError("x", f"strides {x.stride()} of {list(x.shape)}", "a contiguous tensor (the kernel steps "
                          "rows by H)", "pass x.contiguous()")
    if not weight.is_contiguous():
        return InputError(weight_field, f"{weight.dtype} {list(weight.shape)}, strides {weight.stride()}",
                          f"a contiguous [H] = [{x.shape[-1]}] tensor (read with unit stride)",
                          f"pass the norm's weight with unit stride: {weight_field}.contiguous()")
    if residual is not None and not residual.is_contiguous():
        return InputError("residual", f"strides {residual.stride()} of {list(residual.shape)}",
                          "a contiguous tensor (the kernel steps rows by H)", "pass residual.contiguous()")
    return None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                    residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    residual_out: torch.Tensor | None = None, x_pairs: XPairs | None = None, pdl: bool = False):
    """The reference's contract; `out` / `residual_out` (optional) receive the norm and the sum. `x_pairs`
    (optional) receives what the NVFP4 GEMV's x pass would write for the norm, viewed as [M, H] (H a multiple
    of 16); `pdl`: the next launch is a programmatic dependent launch (`linear.x_pass_pdl`). Operands as
    `rms_norm_refusal` says."""
    if err := (rms_norm_refusal(x, weight, residual, residual_out=residual_out) or number_refusal("eps", eps)
               or _outs_overlap_refusal(x, weight, residual, out, residual_out)):
        raise err
    return rms_norm_launch(x, weight, eps, zero_centred, residual, out, residual_out, x_pairs, pdl)


def rms_norm_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                    residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    residual_out: torch.Tensor | None = None, x_pairs: XPairs | None = None, pdl: bool = False):
    """`rms_norm_triton` on operands `rms_norm_refusal` passed (the op's predicate, or the fused LM head op's
    provider, checked them: one check a call)."""
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
        block = next_power_of_2(H)
        warps = 4 if block < 2048 else 8 if block < 8192 else 16
        pairs, exps = (y, y) if x_pairs is None else (x_pairs.pairs, x_pairs.exps)
        _rms_norm_kernel[(M,)](x, x if residual is None else residual, weight, y, y if s is None else s,
                               pairs, exps, H, eps, 1 if x_pairs is None else x_pairs.k_per_split,
                               HAS_RESIDUAL=residual is not None, ZERO_CENTRED=bool(zero_centred),
                               BLOCK_H=block, X_PAIRS=x_pairs is not None, USE_ASM=x.is_cuda, PDL=pdl,
                               ORDER=0 if x_pairs is None else x_pairs.order,
                               num_warps=warps)
    return y if residual is None else (y, s)


def _outs_overlap_refusal(x, weight, residual, out, residual_out) -> InputError | None:
    """`out` or `residual_out` sharing memory with an input, but for x or the residual itself: program r reads
    its whole row of x and of the residual before it writes that row of the sum and of the norm, and no other
    program reads the row, so either may be written in place. Any other overlap with them is refused (program r
    would write into a row another program has yet to read), as is any with the weight, which every program
    reads, after it has written the sum."""
    return (overlap_refusal("out", out, in_place=("x", "residual"), x=x, residual=residual, weight=weight)
            or overlap_refusal("residual_out", residual_out, in_place=("x", "residual"), x=x, residual=residual,
                               weight=weight)
            or outs_apart_refusal("residual_out", residual_out, out=out))


def _rms_norm_call_refusal(x, weight, eps, zero_centred, residual=None, out=None, residual_out=None):
    """The op's call: `rms_norm_refusal`, `out` / `residual_out` contiguous (the kernel writes rows H apart;
    `auto` gives others to the reference, which writes any strides), and apart from the inputs but in place
    (`_outs_overlap_refusal`)."""
    if err := rms_norm_refusal(x, weight, residual, residual_out=residual_out) or number_refusal("eps", eps):
        return err
    for field, t in (("out", out), ("residual_out", residual_out)):
        if t is not None and not t.is_contiguous():
            return InputError(field, f"strides {t.stride()} of {list(t.shape)}", "a contiguous tensor (the "
                              "kernel writes rows H apart)", f"pass a contiguous {field}, or leave {field}=None")
    return _outs_overlap_refusal(x, weight, residual, out, residual_out)


rms_norm.register_provider("triton", rms_norm_launch, _rms_norm_call_refusal)
