"""FP8 E4M3 weights (DESIGN 3): per-row scales for our own quantization, block-128 tables from checkpoints.

A stored value times its scale is the weight: `w ~= weight.float() * scale`. Scales are fp32 multipliers
(the `_inv` in `weight_scale_inv` is the checkpoints' name, not a reciprocal). Values are clamped to
+-448 before every cast to float8: PyTorch 2.13 saturates, older versions gave NaN, and we rely on neither.
These functions are the definition the kernels are tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtpfactory.errors import WeightsError

FP8_E4M3_MAX = 448.0


def matrix_refusal(w: Tensor, name: str) -> WeightsError | None:
    """Why no format can store `w` by its shape and dtype, or None: not a tensor, not 2-D, empty, not floating,
    already quantized (its values are checked apart, `check_finite`: reading them waits on a GPU)."""
    if not isinstance(w, Tensor):
        return WeightsError(name, type(w).__name__, "a torch.Tensor", f"convert it: torch.as_tensor({name})")
    if w.dim() != 2 or w.numel() == 0:
        return WeightsError(f"{name}.shape", tuple(w.shape), "must be a non-empty 2-D [N, K] matrix",
                            "quantize each weight matrix separately" if w.dim() != 2 else
                            "pass the whole weight: this one has no elements (check the slice that made it)")
    if not w.dtype.is_floating_point:
        return WeightsError(f"{name}.dtype", w.dtype, "must be a floating-point type", "pass the unquantized weight")
    if w.dtype.itemsize == 1:  # float8 (or packed float4) codes: read without their scales, they are not the weight
        return WeightsError(f"{name}.dtype", w.dtype, "already quantized (8-bit codes, not the weight without their "
                            "scales): quantize a float32, bfloat16, float16 or float64 weight",
                            "dequantize it first (dequantize_fp8, dequantize_fp8_block), or pass the unquantized "
                            "weight")
    return None


def checked_fp32(w: Tensor, name: str) -> Tensor:
    """`w` as a contiguous fp32 matrix outside autograd (a parameter's graph kept fp32 copies of the weight alive
    behind the quantized one), refusing what no format can store: not 2-D, empty, not floating, NaN/Inf, a
    finite float64 value past fp32's range (the scales are computed in fp32)."""
    if err := matrix_refusal(w, name):
        raise err
    w = w.detach()
    check_finite(w, name)
    x = w.float().contiguous()
    if w.dtype == torch.float64 and not bool(torch.isfinite(x).all()):
        raise WeightsError(name, f"{int((~torch.isfinite(x)).sum())} values past the range of fp32",
                           f"|w| <= {torch.finfo(torch.float32).max:.4g}: the formats' scales are computed in fp32",
                           "rescale the tensor, or check the export that produced it")
    return x


def scale_refusal(name: str, scale: object) -> WeightsError | None:
    """Why `scale` cannot be read as scale values, or None: a floating-point tensor (an integer or bool one, or an
    int32 view of an fp32 table, would be read as its bytes' numbers; a Python number has no shape to check).
    Values are not checked: a negative scale, which no quantizer here makes, negates what it scales, as every
    kernel reads it (the ops' references dequantize through here, and their tests decode all 254 finite E4M3 scale
    bytes, negative ones included)."""
    if not isinstance(scale, Tensor) or not scale.is_floating_point():
        got = f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, Tensor) else type(scale).__name__
        return WeightsError(name, got, "a floating-point tensor of the scale values, as the checkpoint stores them",
                            f"pass the checkpoint's {name} as stored (its raw bytes: .view(torch.float32), or "
                            ".view(torch.float8_e4m3fn) for E4M3 bytes)")
    return None


def as_dtype(out: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    """A finite fp32 dequantization `out` as `dtype`, refusing values past dtype's range (they became inf)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise WeightsError("dtype", dtype, "a floating-point dtype",
                           "use torch.float32, torch.bfloat16 or torch.float16")
    y = out.to(dtype)
    if dtype.itemsize < 4 and not bool(torch.isfinite(y).all()):
        raise WeightsError(name, f"{int((~torch.isfinite(y)).sum())} values past the range of {dtype} after "
                           f"dequantization", f"|w| <= {torch.finfo(dtype).max:.4g} in {dtype}",
                           "dequantize to torch.float32 (or torch.bfloat16, whose range is fp32's)")
    return y


def check_finite(x: Tensor, name: str, where: str = "") -> None:
    """Refuse NaN or Inf in `x`, naming the tensor and how many of each it holds."""
    bad = ~torch.isfinite(x)
    if bad.any():
        nan = int(torch.isnan(x).sum())
        raise WeightsError(name, f"{nan} NaN, {int(bad.sum()) - nan} Inf{where}", "must be finite",
                           "re-export the checkpoint: a NaN/Inf weight is a corrupt or diverged tensor")


def to_e4m3(x: Tensor) -> Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even, clamped to +-448 first."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _unit_if_zero(scale: Tensor) -> Tensor:
    # An all-zero row or tile (or one so small that amax / 448 underflows fp32) gets scale 1; its values are 0.
    return torch.where(scale > 0, scale, 1.0)


def _check_fp8_weight(weight: Tensor, name: str) -> None:
    if weight.dim() != 2 or not (weight.dtype.is_floating_point and weight.dtype.itemsize == 1):
        raise WeightsError(name, f"{weight.dtype} {tuple(weight.shape)}", "must be a 2-D float8 [N, K] tensor",
                           "pass the checkpoint's stored weight, not a dequantized copy")


def _tiles(n: int, k: int, block: int) -> tuple[int, int]:
    return -(-n // block), -(-k // block)


def _expand(scale: Tensor, block: int, n: int, k: int) -> Tensor:
    # [ceil(N/b), ceil(K/b)] -> [N, K]: each tile's multiplier over its (possibly partial) tile.
    return scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:n, :k]


def _check_block(block: int) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise WeightsError("block", block, "the tile size must be a positive integer", "use 128, the checkpoints' tile")


def quantize_fp8(w: Tensor, name: str = "weight") -> tuple[Tensor, Tensor]:
    """Per-row FP8: `weight_scale[n] = amax(|w[n]|) / 448` (1 for an all-zero row), `weight = e4m3(w / scale)`.

    Returns (weight float8_e4m3fn [N, K], weight_scale float32 [N]).
    """
    x = checked_fp32(w, name)                                        # [N, K]
    scale = _unit_if_zero(x.abs().amax(dim=1) / FP8_E4M3_MAX)        # [N]
    return to_e4m3(x / scale[:, None]), scale


def dequantize_fp8(weight: Tensor, weight_scale: Tensor, dtype: torch.dtype = torch.float32,
                   name: str = "weight") -> Tensor:
    """`weight.float() * weight_scale[:, None]`, computed in fp32, returned as `dtype` [N, K]."""
    _check_fp8_weight(weight, name)
    if err := scale_refusal(f"{name}_scale", weight_scale):
        raise err
    n = weight.shape[0]
    if tuple(weight_scale.shape) != (n,):
        raise WeightsError(f"{name}_scale.shape", tuple(weight_scale.shape), f"per-row scales must be [N] = [{n}]",
                           "expand a per-tensor scalar to [N] at load; block tables go to dequantize_fp8_block")
    out = weight.float() * weight_scale.float()[:, None]             # [N, K]
    check_finite(out, name, " after dequantization (in the stored values or their scales)")
    return as_dtype(out, dtype, name)


def quantize_fp8_block(w: Tensor, block: int = 128, name: str = "weight") -> tuple[Tensor, Tensor]:
    """Block FP8 as DeepSeek-style checkpoints store it: one scale per `block` x `block` tile (edges partial),
    `scale = amax(|tile|) / 448` (1 for an all-zero tile), `weight = e4m3(w / scale)`.

    Returns (weight float8_e4m3fn [N, K], weight_scale_inv float32 [ceil(N/block), ceil(K/block)]).
    """
    _check_block(block)
    x = checked_fp32(w, name)                                        # [N, K]
    n, k = x.shape
    nb, kb = _tiles(n, k, block)
    padded = torch.nn.functional.pad(x.abs(), (0, kb * block - k, 0, nb * block - n))  # [nb*block, kb*block]
    amax = padded.view(nb, block, kb, block).amax(dim=(1, 3))        # [nb, kb]
    scale = _unit_if_zero(amax / FP8_E4M3_MAX)                       # [nb, kb]
    return to_e4m3(x / _expand(scale, block, n, k)), scale


def dequantize_fp8_block(weight: Tensor, weight_scale_inv: Tensor, block: int = 128,
                         dtype: torch.dtype = torch.float32, name: str = "weight") -> Tensor:
    """`weight.float()` times its tile's multiplier from `weight_scale_inv` [ceil(N/block), ceil(K/block)]
    (fp32 or bf16), computed in fp32, returned as `dtype` [N, K]."""
    _check_block(block)
    _check_fp8_weight(weight, name)
    if err := scale_refusal(f"{name}_scale_inv", weight_scale_inv):
        raise err
    n, k = weight.shape
    tiles = _tiles(n, k, block)
    if tuple(weight_scale_inv.shape) != tiles:
        raise WeightsError(f"{name}_scale_inv.shape", tuple(weight_scale_inv.shape),
                           f"a [{n}, {k}] weight in {block}x{block} tiles needs a {list(tiles)} scale table",
                           "check the tile size (block=) or that the scale belongs to this weight")
    out = weight.float() * _expand(weight_scale_inv.float(), block, n, k)  # [N, K]
    check_finite(out, name, " after dequantization (in the stored values or their scales)")
    return as_dtype(out, dtype, name)
