"""NVFP4 weights (DESIGN 3): E2M1 codes in blocks of 16 along K, one E4M3 scale per block, one fp32 scale per tensor.

ModelOpt layout: `weight` uint8 [N, K/2] (two codes a byte, element 2j in the low nibble, 2j+1 in the high),
`weight_scale` float8_e4m3fn [N, K/16] row-major (no Blackwell swizzle), `weight_scale_2` fp32 0-dim.
A code is sign (bit 3) and magnitude index (bits 0-2) into `E2M1_VALUES`; the weight is
`E2M1_VALUES[code] * weight_scale * weight_scale_2`. These functions are the definition the kernels are
tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtpfactory.errors import WeightsError
from mtpfactory.quant.fp8 import (
    FP8_E4M3_MAX,
    as_dtype,
    check_finite,
    checked_fp32,
    matrix_refusal,
    scale_refusal,
    to_e4m3,
)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
E2M1_MAX = E2M1_VALUES[-1]
# Midpoint i lies between codes i and i+1; a tie goes to the even code (mantissa bit 0).
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))  # .25 .75 1.25 1.75 2.5 3.5 5
_SIGNED_VALUES = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)                   # indexed by the 4-bit code


def e2m1_codes(x: Tensor) -> Tensor:
    """Round `x` (already divided by its block's scale) to 4-bit E2M1 codes, uint8, same shape.

    Nearest grid point, ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4),
    magnitudes clamped to 6, sign in bit 3. Exact comparisons against the midpoints, no float cast.
    Anything that rounds to magnitude 0 (negative zero included) is stored as code 0.
    """
    mag = x.abs()
    mids = torch.tensor(_MIDPOINTS, device=x.device)                 # [7]
    code = torch.bucketize(mag, mids)            # midpoints strictly below |x|: a tie lands on the lower code
    tie = mag == mids[code.clamp(max=len(_MIDPOINTS) - 1)]
    code = code + (tie & (code % 2 == 1))        # ...and moves up to the even code when the lower one is odd
    negative = (x < 0) & (code > 0)
    return (code + 8 * negative).to(torch.uint8)


def nvfp4_matrix_refusal(w: Tensor, name: str) -> WeightsError | None:
    """Why NVFP4 cannot store `w` by its shape and dtype, or None: `matrix_refusal`'s rule, and K a multiple of 16
    (a block that crossed a row would mix two rows' values)."""
    if err := matrix_refusal(w, name):
        return err
    if w.shape[1] % NVFP4_BLOCK:
        return WeightsError(f"{name}.shape[1]", w.shape[1], "NVFP4 needs K to be a multiple of 16",
                            "keep this tensor unquantized or pad K")
    return None


def quantize_nvfp4(w: Tensor, name: str = "weight") -> tuple[Tensor, Tensor, Tensor]:
    """Quantize `w` [N, K] to NVFP4 (K a multiple of 16).

    - `global = amax(|w|) / (6 * 448)` in fp32; a tensor of zeros (or one so small that this underflows
      fp32 to 0) gets `global = 1`, and then all its blocks are zero blocks.
    - block scale `s = e4m3(block_amax / 6 / global)`, rounded to nearest even. A block whose `s` is 0
      (all zeros, or E4M3 underflow against the tensor's amax) stores `s = 1` and all its codes are 0.
    - codes = `e2m1_codes(x / (s * global))`, dividing by the *stored* scale.

    Returns (weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 float32 0-dim).
    """
    if err := nvfp4_matrix_refusal(w, name):
        raise err
    x = checked_fp32(w, name)                                        # [N, K]
    n, k = x.shape
    global_scale = x.abs().amax() / (E2M1_MAX * FP8_E4M3_MAX)        # 0-dim
    global_scale = torch.where(global_scale > 0, global_scale, 1.0)
    blocks = x.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)             # [N, K/16, 16]
    scale = to_e4m3(blocks.abs().amax(dim=-1) / E2M1_MAX / global_scale).float()  # [N, K/16], exact e4m3 values
    zero_block = scale == 0
    scale = torch.where(zero_block, 1.0, scale)
    codes = e2m1_codes(blocks / (scale * global_scale)[..., None])   # [N, K/16, 16]
    codes = codes.masked_fill(zero_block[..., None], 0).view(n, k)   # [N, K]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)                  # [N, K/2]
    return packed, scale.to(torch.float8_e4m3fn), global_scale


def dequantize_nvfp4(weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor,
                     dtype: torch.dtype = torch.float32, name: str = "weight") -> Tensor:
    """`E2M1_VALUES[code] * weight_scale * weight_scale_2` [N, K], in fp32, returned as `dtype`.

    `value * scale` is exact in fp32 (at most 2 + 4 significant bits), so each element is the correctly
    rounded fp32 of the product; quantizing the result gives back the same codes and scales where every block's
    E4M3 scale is normal (a subnormal one may round its block's amax / 6 to 0 and be stored again as scale 1).
    """
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] % (NVFP4_BLOCK // 2):
        raise WeightsError(name, f"{weight.dtype} {tuple(weight.shape)}",
                           "NVFP4 stores a uint8 [N, K/2] matrix with K a multiple of 16",
                           "pass the checkpoint's packed `weight`")
    n, k = weight.shape[0], 2 * weight.shape[1]
    if err := scale_refusal(f"{name}_scale", weight_scale):
        raise err
    if tuple(weight_scale.shape) != (n, k // NVFP4_BLOCK):
        raise WeightsError(f"{name}_scale.shape", tuple(weight_scale.shape),
                           f"a [{n}, {k}] NVFP4 weight needs [N, K/16] = [{n}, {k // NVFP4_BLOCK}] block scales",
                           "check that the scale belongs to this weight and is not swizzled")
    if err := scale_refusal(f"{name}_scale_2", weight_scale_2):
        raise err
    if weight_scale_2.numel() != 1:
        raise WeightsError(f"{name}_scale_2.shape", tuple(weight_scale_2.shape), "must hold one fp32 number",
                           "pass the per-tensor scale")
    codes = torch.stack([weight & 0xF, weight >> 4], dim=-1).view(n, k)      # [N, K], element 2j from the low nibble
    values = torch.tensor(_SIGNED_VALUES, device=weight.device)[codes.long()]  # [N, K]
    scale = weight_scale.float().repeat_interleave(NVFP4_BLOCK, dim=1)      # [N, K]
    out = values * scale * weight_scale_2.float().reshape(())               # (value * scale) first: exact
    check_finite(out, name, " after dequantization (in the stored scales)")
    return as_dtype(out, dtype, name)
