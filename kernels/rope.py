"""NeoX-style rotary embedding on the first `rotary_dim` dims of each head (the rest pass through)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mtpfactory.errors import InputError
from mtpfactory.kernels.fp_bits import cast_rne
from mtpfactory.ops import FLOATS, Op, cdiv, next_power_of_2, out_or_empty, out_refusal, overlap_refusal, write_out


def _rope_neox_shape_refusal(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> InputError | None:
    """Why no provider can rotate x by these shapes, or None: x [..., N, heads, D]; positions [N], or [1] (one
    position for every token); inv_freq [rotary_dim / 2] with rotary_dim <= D."""
    if x.dim() < 3:
        return InputError("x", f"{x.dtype} {list(x.shape)}", "a [N, heads, D] tensor",
                          "view the token's heads as [N, heads, D] (x.view(N, heads, D))")
    n, d = x.shape[-3], x.shape[-1]
    if positions.dim() != 1 or positions.shape[0] not in (n, 1):
        return InputError("positions", f"{positions.dtype} {list(positions.shape)}",
                          f"a [N] = [{n}] tensor, one position a token of x {list(x.shape)} (or [1], one for all)",
                          "pass the positions of x's tokens, one each")
    if inv_freq.dim() != 1 or 2 * inv_freq.numel() > d:
        return InputError("inv_freq", f"{inv_freq.dtype} {list(inv_freq.shape)}",
                          f"a [rotary_dim / 2] tensor, rotary_dim <= D = {d} (the head size of x {list(x.shape)})",
                          "make it with rope_inv_freq(rotary_dim, theta) for a rotary_dim of at most the head size")
    return None


def _rope_neox_native(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, heads, D]; positions: [N] (or [1]); inv_freq: [rotary_dim / 2], rotary_dim <= D. Returns x
    rotated, x's dtype (written into `out` when given). Shapes as `_rope_neox_shape_refusal` says (x of more
    dims, [..., N, heads, D], broadcasts against positions as torch does).

    Pairs (i, i + rotary_dim/2) rotate by angle position * inv_freq[i]; cos and sin are rounded to x's
    dtype before use, as the Hugging Face models do.
    """
    if err := _contract(x, positions, inv_freq, out):
        raise err
    rd = 2 * inv_freq.numel()
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(x.device, torch.float32)[None, :]  # [N, rd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]  # [N, 1, rd]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return write_out(out, torch.cat([rot * cos + rotated * sin, rest], dim=-1))


def _contract(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              out: torch.Tensor | None = None) -> InputError | None:
    """What the reference refuses before anything runs (every provider refuses the same)."""
    return _rope_neox_shape_refusal(x, positions, inv_freq) or out_refusal(out, x.shape, x.dtype, x.device)


rope_neox = Op("rope_neox", _rope_neox_native, _contract)


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """The inverse frequencies of NeoX RoPE: theta^(-2i / rotary_dim), fp32 [rotary_dim / 2]."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


# --- Triton ---------------------------------------------------------------------------------------------------

@triton.jit
def rope_cos_sin(pos_ptr, n, inv_freq_ptr, i, im, dtype: tl.constexpr, LIBDEVICE_TRIG: tl.constexpr):
    """cos and sin of token n's angles (position times inv_freq[i], pairs i masked by im), each rounded to `dtype`
    as the reference rounds them: [1, BHALF] in fp32."""
    angle = tl.load(pos_ptr + n).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=im, other=0.0).to(tl.float32)
    if LIBDEVICE_TRIG:  # the GPU: __nv_cosf / __nv_sinf, which torch's CUDA cos / sin call too
        c, s = libdevice.cos(angle), libdevice.sin(angle)
    else:  # the interpreter, which has no libdevice
        c, s = tl.cos(angle), tl.sin(angle)
    return cast_rne(c, dtype).to(tl.float32)[None, :], cast_rne(s, dtype).to(tl.float32)[None, :]


@triton.jit
def rope_rotate(x1, x2, c, s, dtype: tl.constexpr):
    """The rotated halves (x1 cos - x2 sin, x2 cos + x1 sin) in `dtype`, each product and sum rounded to it as the
    reference's eager ops round."""
    a1 = cast_rne(x1 * c, dtype).to(tl.float32)
    b1 = cast_rne(-x2 * s, dtype).to(tl.float32)
    a2 = cast_rne(x2 * c, dtype).to(tl.float32)
    b2 = cast_rne(x1 * s, dtype).to(tl.float32)
    return cast_rne(a1 + b1, dtype), cast_rne(a2 + b2, dtype)


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
    d1 = i.to(tl.int64) * stride_yd  # out's offsets along D in int64: out= may be a view where they pass 2^31
    d2 = (half + i).to(tl.int64) * stride_yd
    hm, im = h < heads, i < half
    c, s = rope_cos_sin(pos_ptr, n, inv_freq_ptr, i, im, dtype, LIBDEVICE_TRIG)

    src = x_ptr + n * stride_xn + h[:, None].to(tl.int64) * stride_xh  # [BH, 1]
    dst = y_ptr + n * stride_yn + h[:, None].to(tl.int64) * stride_yh  # [BH, 1]
    m = hm[:, None] & im[None, :]
    x1 = tl.load(src + i[None, :], mask=m, other=0.0).to(tl.float32)  # [BH, BHALF]
    x2 = tl.load(src + half + i[None, :], mask=m, other=0.0).to(tl.float32)
    o1, o2 = rope_rotate(x1, x2, c, s, dtype)
    tl.store(dst + d1[None, :], o1, mask=m)
    tl.store(dst + d2[None, :], o2, mask=m)

    j = 2 * half + tl.arange(0, BLOCK_REST)  # the pass-through dims
    mr = hm[:, None] & (j < D)[None, :]
    tl.store(dst + j[None, :].to(tl.int64) * stride_yd, tl.load(src + j[None, :], mask=mr, other=0.0), mask=mr)


_MAX_BLOCK = tl.TRITON_MAX_TENSOR_NUMEL    # the most elements of one tl.arange
_MAX_TOKENS = 2**31 - 1                    # grid axis 0 (tokens)
_MAX_HEAD_PROGRAMS = 65535                 # grid axis 1 (blocks of heads)


def rope_blocks(heads: int, d: int, half: int, tile: int = 4096) -> tuple[int, int, int]:
    """(BLOCK_HEADS, BLOCK_HALF, BLOCK_REST) of a launch: the rotated half and the pass-through tail each in one
    block, as many heads a program as keep its tiles near `tile` elements."""
    block_half = next_power_of_2(max(half, 1))
    block_rest = next_power_of_2(max(d - 2 * half, 1))
    return min(next_power_of_2(heads), max(1, tile // max(block_half, block_rest))), block_half, block_rest


def rope_tables_refusal(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> InputError | None:
    """Why a kernel that reads one position a token of x [N, ...] and the inverse frequencies (`rope_cos_sin`)
    cannot take them, or None: positions an int32 or int64 [N], inv_freq a bf16, fp16 or fp32 tensor, both on x's
    device (any strides: the launchers pass them contiguous)."""
    n = x.shape[0]
    if positions.shape[0] != n or positions.dtype not in (torch.int32, torch.int64):
        return InputError("positions", f"{positions.dtype} {list(positions.shape)}",
                          f"an int32 or int64 [N] = [{n}] tensor (the kernel reads one position a token)",
                          f"pass positions.long(), expanded to [{n}] (positions.expand({n}))")
    if inv_freq.dtype not in FLOATS:
        return InputError("inv_freq", f"{inv_freq.dtype} {list(inv_freq.shape)}", "a bf16, fp16 or fp32 tensor",
                          "pass inv_freq.float() (rope_inv_freq makes fp32)")
    for name, t in (("positions", positions), ("inv_freq", inv_freq)):
        if t.device != x.device:
            return InputError(name, f"on {t.device}", f"on x's device, {x.device} (the kernel reads it there)",
                              f"pass {name}.to(x.device)")
    return None


def rope_neox_refusal(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> InputError | None:
    """Why `rope_neox_triton` cannot take these operands, as the error it raises (its predicate says no to the
    same calls), or None: x a bf16, fp16 or fp32 [N, heads, D] with unit stride along D (the kernel reads a
    head's dims in a row; tokens and heads at any stride), D <= 2^20 (one head in a program), N < 2^31 and
    at most 65535 programs of heads (the grid); positions int32 or int64 [N] (not [1]: the kernel reads one a
    token) and inv_freq bf16, fp16 or fp32 [rotary_dim / 2], rotary_dim <= D, both on x's device (any
    strides)."""
    if x.dim() != 3 or x.dtype not in FLOATS:
        return InputError("x", f"{x.dtype} {list(x.shape)}", "a bf16, fp16 or fp32 [N, heads, D] tensor",
                          "call the op (`rope_neox`) under runtime.backend=auto: it runs the reference for others")
    n, heads, d = x.shape
    if d > 1 and x.stride(2) != 1:
        return InputError("x", f"strides {x.stride()} of {list(x.shape)}",
                          "unit stride along D (the kernel reads a head's dims in a row)", "pass x.contiguous()")
    if err := _rope_neox_shape_refusal(x, positions, inv_freq):
        return err
    if err := rope_tables_refusal(x, positions, inv_freq):
        return err
    block_heads = rope_blocks(heads, d, inv_freq.numel())[0]
    if d > _MAX_BLOCK or n > _MAX_TOKENS or cdiv(heads, block_heads) > _MAX_HEAD_PROGRAMS:
        return InputError("x", f"[N, heads, D] = {list(x.shape)}",
                          f"D <= {_MAX_BLOCK} (one head in a program), N <= {_MAX_TOKENS} and heads in at most "
                          f"{_MAX_HEAD_PROGRAMS} programs of {block_heads} (the grid)",
                          "call the op (`rope_neox`) under runtime.backend=auto: it runs the reference for others")
    return None


def rope_neox_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's contract; x may be a strided view (a slice of a fused QKV) with its last dim
    contiguous. `out` (optional, any strides) has x's shape and dtype. Operands as `rope_neox_refusal` says."""
    if err := _rope_neox_call_refusal(x, positions, inv_freq, out):
        raise err
    return rope_neox_launch(x, positions, inv_freq, out)


def rope_neox_launch(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`rope_neox_triton` on operands `rope_neox_refusal` passed (the op's predicate checked them: one check a
    call)."""
    N, heads, D = x.shape
    y = out_or_empty(out, x.shape, x.dtype, x.device)
    if N == 0 or heads == 0 or D == 0:
        return y
    half = inv_freq.numel()
    block_heads, block_half, block_rest = rope_blocks(heads, D, half)
    _rope_neox_kernel[(N, cdiv(heads, block_heads))](
        x, positions.contiguous(), inv_freq.contiguous(), y, heads, D, half, x.stride(0), x.stride(1), *y.stride(),
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, BLOCK_REST=block_rest, LIBDEVICE_TRIG=x.is_cuda,
        num_warps=4, enable_fp_fusion=False)  # no FMA contraction: fp32 rounds each product, as torch does
    return y


def _rope_neox_call_refusal(x, positions, inv_freq, out=None):
    """`rope_neox_refusal`, and an `out` sharing memory with an input but for x itself: program (n, heads) reads
    both halves of its heads' rotated dims before it writes either, and each pass-through element before it
    writes it, and no other program reads those heads, so out may be x (in place). Any other overlap with x, or
    one with positions or inv_freq, which other programs still read, is refused."""
    return (rope_neox_refusal(x, positions, inv_freq)
            or overlap_refusal("out", out, in_place=("x",), x=x, positions=positions, inv_freq=inv_freq))


rope_neox.register_provider("triton", rope_neox_launch, _rope_neox_call_refusal)
