"""NVFP4 quantization (DESIGN 3): `global = amax / (6 * 448)`, block scale `s = e4m3(block_amax / 6 / global)`
(a block with s = 0 stores 1 and codes 0), codes = E2M1 of `x / (s * global)`, ties to the even code, two
codes a byte with the even element in the low nibble. The definition is `mtpfactory.quant.quantize_nvfp4`.

Two launches: `global_absmax_bits` (quantize_fp8.py) folds |x| into one int32 by atomic max on the fp32
bits (for non-negative floats the integer order is the float order, and NaN/Inf land above every finite
value, which is how they are caught); `_quantize_nvfp4_kernel` then handles a tile of consecutive 16-element blocks per
program (blocks run row-major over [N, K], so a tile is rows x blocks of one contiguous span, and the
block index is also the index of its scale and, times 8, of its first packed byte).

Bit-identical to the reference on the device it runs on: the e4m3 block scale is rounded in integer
math (`e4m3_rne_bits`), the E2M1 codes by exact comparisons against the midpoints, divisions are IEEE
round-to-nearest, and division by the constants 6 and 2688 follows torch's per-device choice between
true division and the fp32 reciprocal (see `quantize_fp8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory import quant
from mtpfactory.errors import InputError, MtpfError, WeightsError
from mtpfactory.kernels.fp_bits import e4m3_rne_bits, e4m3_value
from mtpfactory.kernels.quantize_fp8 import (
    FINITE_LIMIT,
    divides_by_reciprocal,
    fp32_reciprocal,
    global_absmax_bits,
    weight_refusal,
)
from mtpfactory.ops import Op, cdiv, check_outs, outs_overlap_refusal, outs_refusal, write_outs
from mtpfactory.quant.fp8 import FP8_E4M3_MAX, check_finite
from mtpfactory.quant.nvfp4 import E2M1_MAX, NVFP4_BLOCK, nvfp4_matrix_refusal
_OUT_NAMES = ("weight", "weight_scale", "weight_scale_2")


@triton.jit
def _quantize_nvfp4_kernel(x_ptr, amax_ptr, q_ptr, scale_ptr, global_ptr, n_blocks,
                           INV_6: tl.constexpr, INV_2688: tl.constexpr, BY_RECIPROCAL: tl.constexpr,
                           BLOCKS: tl.constexpr):
    """One program per BLOCKS consecutive 16-element blocks of x (contiguous [N, K], flattened)."""
    pid = tl.program_id(0)
    amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
    if BY_RECIPROCAL:
        g = amax * INV_2688
    else:
        g = tl.math.div_rn(amax, 2688.0)
    g = tl.where(g == 0.0, 1.0, g)                    # a zero tensor (or amax / 2688 underflowing) gets 1
    tl.store(global_ptr, g, mask=pid == 0)

    blk = pid.to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)                     # [B]
    blk_ok = blk < n_blocks
    x = tl.load(x_ptr + blk[:, None] * 16 + tl.arange(0, 16)[None, :],
                mask=blk_ok[:, None], other=0.0).to(tl.float32)               # [B, 16]

    block_amax = tl.max(tl.abs(x), axis=1)                                     # [B]
    if BY_RECIPROCAL:
        s = block_amax * INV_6
    else:
        s = tl.math.div_rn(block_amax, 6.0)
    s_bits = e4m3_rne_bits(tl.minimum(tl.math.div_rn(s, g), 448.0))           # [B], in [0, 0x7E]
    zero_block = s_bits == 0
    s_bits = tl.where(zero_block, 0x38, s_bits)                               # stored scale 1.0
    unit = e4m3_value(s_bits) * g                                              # [B]

    q = tl.math.div_rn(x, unit[:, None])                                       # [B, 16]
    mag = tl.abs(q)
    # Count the midpoints below |q|; a tie counts (moves up) only where the code above it is even.
    code = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
            + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
            + (mag > 5.0).to(tl.int32))
    code = tl.where((q < 0.0) & (code > 0), code + 8, code)
    code = tl.where(zero_block[:, None], 0, code)

    even, odd = tl.split(tl.reshape(code, (BLOCKS, 8, 2)))                     # [B, 8] each
    packed = (even | (odd << 4)).to(tl.uint8)
    tl.store(q_ptr + blk[:, None] * 8 + tl.arange(0, 8)[None, :], packed, mask=blk_ok[:, None])
    tl.store(scale_ptr + blk, s_bits.to(tl.uint8), mask=blk_ok)


def _refusal(w: torch.Tensor, name: str) -> WeightsError | None:
    """Why the kernels cannot quantize `w`, as the error the provider raises (its predicate says no to the same
    calls), or None: a 2-D fp32, bf16 or fp16 [N, K] tensor with elements, K a multiple of 16 (a block that
    crossed a row would mix two rows' values)."""
    return weight_refusal(w, name) or nvfp4_matrix_refusal(w, name)


def quantize_nvfp4_triton(w: torch.Tensor, name: str = "weight", *,
                          out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton provider of `quantize_nvfp4`: (weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16],
    weight_scale_2 fp32 0-dim).

    `out`: that triple preallocated (contiguous), written in place and returned. A NaN/Inf in `w` is
    refused as the reference refuses it, read off the absmax before the quantizing launch (one sync), so a
    refused call writes nothing.
    """
    if err := _quantize_nvfp4_refusal(w, name, out=out):
        raise err
    return quantize_nvfp4_launch(w, name, out=out)


def quantize_nvfp4_launch(w: torch.Tensor, name: str = "weight", *,
                          out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_nvfp4_triton` on a weight `_refusal` passed (the op's predicate checked it: one check a call)."""
    n, k = w.shape
    x = w.contiguous()
    if out is None:
        out = (torch.empty(n, k // 2, dtype=torch.uint8, device=w.device),
               torch.empty(n, k // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=w.device),
               torch.empty((), dtype=torch.float32, device=w.device))
    check_outs(out, (((n, k // 2), torch.uint8), ((n, k // NVFP4_BLOCK), torch.float8_e4m3fn), ((), torch.float32)),
               _OUT_NAMES, w.device, "contiguous")
    q, scale, global_scale = out

    amax = global_absmax_bits(x)
    if int(amax) >= FINITE_LIMIT:
        check_finite(w, name)
    n_blocks, blocks = n * (k // NVFP4_BLOCK), 128
    _quantize_nvfp4_kernel[(cdiv(n_blocks, blocks),)](
        x, amax, q, scale.view(torch.uint8), global_scale, n_blocks,
        INV_6=fp32_reciprocal(E2M1_MAX), INV_2688=fp32_reciprocal(E2M1_MAX * FP8_E4M3_MAX),
        BY_RECIPROCAL=divides_by_reciprocal(w.device.type), BLOCKS=blocks)
    return q, scale, global_scale


def _quantize_nvfp4_native(w: torch.Tensor, name: str = "weight", *,
                           out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The definition, `mtpfactory.quant.quantize_nvfp4`, written into `out` (checked as the Triton provider
    checks it) when given."""
    return write_outs(out, quant.quantize_nvfp4(w, name), _OUT_NAMES, "contiguous")


def _contract(w: torch.Tensor, name: str = "weight", *,
              out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> WeightsError | InputError | None:
    """What the reference refuses before it reads a value (every provider refuses the same)."""
    if err := nvfp4_matrix_refusal(w, name):
        return err
    n, k = w.shape
    return outs_refusal(out, (((n, k // 2), torch.uint8), ((n, k // NVFP4_BLOCK), torch.float8_e4m3fn),
                              ((), torch.float32)), _OUT_NAMES, w.device, "contiguous")


quantize_nvfp4 = Op("quantize_nvfp4", _quantize_nvfp4_native, _contract)


def _quantize_nvfp4_refusal(w: torch.Tensor, name: str = "weight", *, out=None) -> MtpfError | None:
    """`_refusal`, and an `out` sharing memory with w: a program writes its blocks' codes and scales (program 0
    the global scale) while other programs still read theirs (none is ever w itself: another dtype or shape)."""
    return _refusal(w, name) or outs_overlap_refusal(out, _OUT_NAMES, w=w)


quantize_nvfp4.register_provider("triton", quantize_nvfp4_launch, _quantize_nvfp4_refusal)
