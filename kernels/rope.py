"""NeoX-style rotary embedding on the first `rotary_dim` dims of each head (the rest pass through)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mtpfactory.kernels.fp_bits import cast_rne
from mtpfactory.ops import Op, out_or_empty, triton_can_run, write_out


def _rope_neox_native(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, heads, D]; positions: [N] int; inv_freq: [rotary_dim / 2] fp32. Returns x rotated, x's dtype
    (written into `out` when given).

    Pairs (i, i + rotary_dim/2) rotate by angle position * inv_freq[i]; cos and sin are rounded to x's
    dtype before use, as the Hugging Face models do.
    """
    rd = 2 * inv_freq.numel()
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(x.device, torch.float32)[None, :]  # [N, rd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]  # [N, 1, rd]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return write_out(out, torch.cat([rot * cos + rotated * sin, rest], dim=-1))


rope_neox = Op("rope_neox", _rope_neox_native)


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """The inverse frequencies of NeoX RoPE: theta^(-2i / rotary_dim), fp32 [rotary_dim / 2]."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


# --- Triton ---------------------------------------------------------------------------------------------------

@triton.jit
def _rope_neox_kernel(x_ptr, pos_ptr, inv_freq_ptr, y_ptr, heads, D, half, stride_xn, stride_xh,
                      stride_yn, stride_yh, stride_yd,
                      BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                      LIBDEVICE_TRIG: tl.constexpr):
    """Program (token n, block of heads). Rounds where the reference's eager ops round (each to x's
    dtype): cos, sin; each product; their sum. Products of two bf16 / fp16 values are exact in fp32, so
    the result is bit-equal to the reference wherever cos and sin are."""
    n = tl.program_id(0).to(tl.int64)
    dtype = y_ptr.dtype.element_ty
    h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)  # [BH]
    i = tl.arange(0, BLOCK_HALF)  # [BHALF]
    hm, im = h < heads, i < half
    angle = tl.load(pos_ptr + n).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=im, other=0.0).to(tl.float32)
    if LIBDEVICE_TRIG:  # the GPU: __nv_cosf / __nv_sinf, which torch's CUDA cos / sin call too
        c, s = libdevice.cos(angle), libdevice.sin(angle)
    else:  # the interpreter, which has no libdevice
        c, s = tl.cos(angle), tl.sin(angle)
    c = cast_rne(c, dtype).to(tl.float32)[None, :]  # [1, BHALF]
    s = cast_rne(s, dtype).to(tl.float32)[None, :]

    src = x_ptr + n * stride_xn + h[:, None].to(tl.int64) * stride_xh  # [BH, 1]
    dst = y_ptr + n * stride_yn + h[:, None].to(tl.int64) * stride_yh  # [BH, 1]
    m = hm[:, None] & im[None, :]
    x1 = tl.load(src + i[None, :], mask=m, other=0.0).to(tl.float32)  # [BH, BHALF]
    x2 = tl.load(src + half + i[None, :], mask=m, other=0.0).to(tl.float32)
    a1 = cast_rne(x1 * c, dtype).to(tl.float32)
    b1 = cast_rne(-x2 * s, dtype).to(tl.float32)
    tl.store(dst + i[None, :] * stride_yd, cast_rne(a1 + b1, dtype), mask=m)
    a2 = cast_rne(x2 * c, dtype).to(tl.float32)
    b2 = cast_rne(x1 * s, dtype).to(tl.float32)
    tl.store(dst + (half + i[None, :]) * stride_yd, cast_rne(a2 + b2, dtype), mask=m)

    j = 2 * half + tl.arange(0, BLOCK_REST)  # the pass-through dims
    mr = hm[:, None] & (j < D)[None, :]
    tl.store(dst + j[None, :] * stride_yd, tl.load(src + j[None, :], mask=mr, other=0.0), mask=mr)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _rope_neox_supports(x, positions, inv_freq, out=None) -> bool:
    tensors = [t for t in (x, positions, inv_freq, out) if t is not None]
    return (triton_can_run(*tensors) and x.dim() == 3 and x.dtype in _FLOATS and x.stride(-1) == 1
            and positions.shape == (x.shape[0],) and positions.dtype in (torch.int32, torch.int64)
            and inv_freq.dim() == 1 and inv_freq.dtype in _FLOATS and 2 * inv_freq.numel() <= x.shape[2])


def rope_neox_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's contract; x may be a strided view (a slice of a fused QKV) with its last dim
    contiguous. `out` (optional, any strides) has x's shape and dtype."""
    N, heads, D = x.shape
    y = out_or_empty(out, x.shape, x.dtype, x.device)
    if N == 0 or heads == 0 or D == 0:
        return y
    half = inv_freq.numel()
    block_half = triton.next_power_of_2(max(half, 1))
    block_rest = triton.next_power_of_2(max(D - 2 * half, 1))
    block_heads = min(triton.next_power_of_2(heads), max(1, 4096 // max(block_half, block_rest)))
    _rope_neox_kernel[(N, triton.cdiv(heads, block_heads))](
        x, positions.contiguous(), inv_freq.contiguous(), y, heads, D, half, x.stride(0), x.stride(1), *y.stride(),
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, BLOCK_REST=block_rest, LIBDEVICE_TRIG=x.is_cuda,
        num_warps=4, enable_fp_fusion=False)  # no FMA contraction: fp32 rounds each product, as torch does
    return y


rope_neox.register_provider("triton", rope_neox_triton, _rope_neox_supports)
