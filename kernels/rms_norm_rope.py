"""RMSNorm over each head's dims, then NeoX RoPE on their first `rotary_dim` (Qwen3-Next's q / k norm and
rotation): `rope_neox(rms_norm(x, weight, eps, zero_centred), positions, inv_freq)`, rounded where those two ops
round. The Triton provider reads x at its strides (q as a slice of q_proj's q|gate rows, k of k_proj's rows) and
makes the two in one launch, where the ops took two and q's copy a third."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.errors import InputError
from mtpfactory.kernels.fp_bits import cast_rne
from mtpfactory.kernels.rms_norm import norm_contract, rms_norm
from mtpfactory.kernels.rope import rope_blocks, rope_cos_sin, rope_neox, rope_rotate, rope_tables_refusal
from mtpfactory.ops import Op, cdiv, number_refusal, out_or_empty, out_refusal, overlap_refusal


def _contract(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool, positions: torch.Tensor,
              inv_freq: torch.Tensor, out: torch.Tensor | None = None) -> InputError | None:
    """What the reference refuses before anything runs (every provider refuses the same): each of the two ops'
    (x a bf16, fp16 or fp32 [..., N, heads, D], weight [D], positions [N] or [1], inv_freq [rotary_dim / 2] with
    rotary_dim <= D), and an `out` of x's shape and dtype."""
    return (norm_contract(x, weight) or rope_neox.contract(x, positions, inv_freq)
            or out_refusal(out, x.shape, x.dtype, x.device))


def _rms_norm_rope_native(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                          positions: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """x: [N, heads, D]; weight: [D]; positions: [N] (or [1]); inv_freq: [rotary_dim / 2]. Each head's row
    normalized (`rms_norm`'s reference), then rotated (`rope_neox`'s), in x's dtype (written into `out` when
    given)."""
    if err := _contract(x, weight, eps, zero_centred, positions, inv_freq, out):
        raise err
    return rope_neox.reference(rms_norm.reference(x, weight, eps, zero_centred), positions, inv_freq, out=out)


rms_norm_rope = Op("rms_norm_rope", _rms_norm_rope_native, _contract)


# --- Triton ---------------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_rope_kernel(x_ptr, w_ptr, pos_ptr, inv_freq_ptr, y_ptr, heads, D, half, eps,
                          stride_xn, stride_xh, stride_yn, stride_yh, stride_yd,
                          ZERO_CENTRED: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          BLOCK_REST: tl.constexpr, LIBDEVICE_TRIG: tl.constexpr):
    """Program (token n, block of heads). Each head's row is read once, as its two rotated halves and its
    pass-through tail; the norm rounds to x's dtype as `rms_norm`'s kernel does (x * rstd * w in fp32), the
    rotation as `rope_neox`'s (cos, sin, each product and their sum, each to x's dtype)."""
    n = tl.program_id(0).to(tl.int64)
    dtype = y_ptr.dtype.element_ty
    h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)  # [BH]
    i = tl.arange(0, BLOCK_HALF)                                    # a rotated half's dims
    j = 2 * half + tl.arange(0, BLOCK_REST)                          # the pass-through dims
    hm, im, jm = h < heads, i < half, j < D
    m, mr = hm[:, None] & im[None, :], hm[:, None] & jm[None, :]
    src = x_ptr + n * stride_xn + h[:, None].to(tl.int64) * stride_xh  # [BH, 1]
    x1 = tl.load(src + i[None, :], mask=m, other=0.0).to(tl.float32)  # [BH, BHALF]
    x2 = tl.load(src + half + i[None, :], mask=m, other=0.0).to(tl.float32)
    xr = tl.load(src + j[None, :], mask=mr, other=0.0).to(tl.float32)  # [BH, BREST]
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xr * xr, axis=1)
    rstd = tl.rsqrt(ss / D + eps)[:, None]  # [BH, 1]

    w1 = tl.load(w_ptr + i, mask=im, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + half + i, mask=im, other=0.0).to(tl.float32)[None, :]
    wr = tl.load(w_ptr + j, mask=jm, other=0.0).to(tl.float32)[None, :]
    if ZERO_CENTRED:
        w1, w2, wr = w1 + 1.0, w2 + 1.0, wr + 1.0
    y1 = cast_rne(x1 * rstd * w1, dtype).to(tl.float32)
    y2 = cast_rne(x2 * rstd * w2, dtype).to(tl.float32)

    c, s = rope_cos_sin(pos_ptr, n, inv_freq_ptr, i, im, dtype, LIBDEVICE_TRIG)  # [1, BHALF] each
    o1, o2 = rope_rotate(y1, y2, c, s, dtype)
    dst = y_ptr + n * stride_yn + h[:, None].to(tl.int64) * stride_yh  # [BH, 1]
    tl.store(dst + i[None, :].to(tl.int64) * stride_yd, o1, mask=m)
    tl.store(dst + (half + i)[None, :].to(tl.int64) * stride_yd, o2, mask=m)
    tl.store(dst + j[None, :].to(tl.int64) * stride_yd, cast_rne(xr * rstd * wr, dtype), mask=mr)


_MAX_BLOCK = 8192                # a program holds its heads' rows in registers; wider heads run the reference
_MAX_TOKENS = 2**31 - 1          # grid axis 0 (tokens)
_MAX_HEAD_PROGRAMS = 65535       # grid axis 1 (blocks of heads)


def _blocks(heads: int, d: int, half: int) -> tuple[int, int, int]:
    """`rope_blocks` near 2048 elements a tile: three of them live at once here, in fp32 (x's halves and tail)."""
    return rope_blocks(heads, d, half, tile=2048)


def rms_norm_rope_refusal(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                          positions: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor | None = None
                          ) -> InputError | None:
    """Why the Triton provider cannot take this call, or None: x a bf16, fp16 or fp32 [N, heads, D] with unit
    stride along D (tokens and heads at any stride), D <= 8192 (a program's heads in registers), N < 2^31 and at
    most 65535 programs of heads (the grid); weight a contiguous [D], positions an int32 or int64 [N] (one a
    token) and inv_freq a bf16, fp16 or fp32 [rotary_dim / 2], all on x's device; eps a Python number; `out`
    (any strides) apart from every input but x itself: program (n, heads) reads its heads' rows whole before it
    writes them, and no other program reads them, so out may be x (in place)."""
    if err := _contract(x, weight, eps, zero_centred, positions, inv_freq, out) or number_refusal("eps", eps):
        return err
    fix = "call the op (`rms_norm_rope`) under runtime.backend=auto: it runs the reference for others"
    if x.dim() != 3:
        return InputError("x", f"{x.dtype} {list(x.shape)}", "a [N, heads, D] tensor", fix)
    n, heads, d = x.shape
    if d > 1 and x.stride(2) != 1:
        return InputError("x", f"strides {x.stride()} of {list(x.shape)}",
                          "unit stride along D (the kernel reads a head's dims in a row)", "pass x.contiguous()")
    block_heads = _blocks(heads, d, inv_freq.numel())[0]
    if d > _MAX_BLOCK or n > _MAX_TOKENS or cdiv(heads, block_heads) > _MAX_HEAD_PROGRAMS:
        return InputError("x", f"[N, heads, D] = {list(x.shape)}", f"D <= {_MAX_BLOCK} (a program's heads in "
                          f"registers), N <= {_MAX_TOKENS} and heads in at most {_MAX_HEAD_PROGRAMS} programs of "
                          f"{block_heads} (the grid)", fix)
    if err := rope_tables_refusal(x, positions, inv_freq):
        return err
    if not weight.is_contiguous():
        return InputError("weight", f"{weight.dtype} {list(weight.shape)}, strides {weight.stride()}",
                          f"a contiguous [D] = [{d}] tensor (read with unit stride)", "pass weight.contiguous()")
    if weight.device != x.device:
        return InputError("weight", f"on {weight.device}", f"on x's device, {x.device} (the kernel reads it there)",
                          "pass weight.to(x.device)")
    return overlap_refusal("out", out, in_place=("x",), x=x, weight=weight, positions=positions, inv_freq=inv_freq)


def rms_norm_rope_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                         positions: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """The op on operands `rms_norm_rope_refusal` passed (the op's predicate checked them: one check a call); the
    result is contiguous unless `out` says otherwise."""
    N, heads, D = x.shape
    y = out_or_empty(out, x.shape, x.dtype, x.device)
    if N == 0 or heads == 0:
        return y
    half = inv_freq.numel()
    block_heads, block_half, block_rest = _blocks(heads, D, half)
    _rms_norm_rope_kernel[(N, cdiv(heads, block_heads))](
        x, weight, positions.contiguous(), inv_freq.contiguous(), y, heads, D, half, eps, x.stride(0), x.stride(1),
        *y.stride(),
        ZERO_CENTRED=bool(zero_centred), BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, BLOCK_REST=block_rest,
        LIBDEVICE_TRIG=x.is_cuda, num_warps=4,
        enable_fp_fusion=False)  # no FMA contraction: fp32 rounds each product, as torch does
    return y


rms_norm_rope.register_provider("triton", rms_norm_rope_launch, rms_norm_rope_refusal)
