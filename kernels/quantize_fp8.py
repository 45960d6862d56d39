"""Per-row FP8 E4M3 quantization (DESIGN 3): `weight_scale[n] = amax(|w[n]|) / 448` (1 for a zero row),
`weight = e4m3(clamp(w / scale, +-448))`. The definition is `mtpfactory.quant.quantize_fp8`.

The Triton provider is bit-identical to that reference on the device it runs on, so nothing here goes
through a float->fp8 cast (the interpreter's rounds wrongly, and a GPU's cvt may differ from torch's at
the edges): the e4m3 rounding is integer math on the fp32 bits (`fp_bits.e4m3_rne_bits`, shared with NVFP4's
block scales), and every division is IEEE round-to-nearest (`tl.math.div_rn`), as torch's are.
One device detail the reference carries: torch on CUDA divides a tensor by a Python float as a multiply
by the float's fp32 reciprocal (1 ulp off true division at times) and on the CPU truly divides;
`divides_by_reciprocal` asks torch which it does on the device and the kernels do the same.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from mtpfactory import quant
from mtpfactory.kernels.fp_bits import e4m3_rne_bits
from mtpfactory.errors import MtpfError, WeightsError
from mtpfactory.ops import FLOATS, Op, cdiv, check_outs, next_power_of_2, outs_overlap_refusal, outs_refusal, write_outs
from mtpfactory.quant.fp8 import FP8_E4M3_MAX, check_finite, matrix_refusal

_OUT_NAMES = ("weight", "weight_scale")


# --- e4m3 in integer math (also used by quantize_nvfp4) ----------------------------------------------------

def fp32_reciprocal(d: float) -> float:
    """1 / d rounded to fp32, as torch computes it before multiplying (exact as a Python float)."""
    return float(np.float32(1.0) / np.float32(d))


@functools.cache
def divides_by_reciprocal(device_type: str) -> bool:
    """Whether torch computes `fp32 tensor / python float` on this device type as a multiply by the fp32
    reciprocal (CUDA) rather than a true division (CPU). Asked once per device type, on witnesses where
    the two differ for each divisor the quantizers use."""
    xs = np.arange(1, 4096, dtype=np.float32)
    verdicts = set()
    for d in (6.0, FP8_E4M3_MAX, 6.0 * FP8_E4M3_MAX):
        true_div, by_recip = xs / np.float32(d), xs * np.float32(fp32_reciprocal(d))
        witness = xs[true_div != by_recip][:64]
        got = (torch.from_numpy(witness).to(device_type) / d).cpu().numpy()
        if np.array_equal(got, by_recip[true_div != by_recip][:64]):
            verdicts.add(True)
        elif np.array_equal(got, true_div[true_div != by_recip][:64]):
            verdicts.add(False)
        else:
            verdicts.add(None)
    if len(verdicts) != 1 or None in verdicts:
        raise RuntimeError(f"torch on {device_type} divides by a scalar neither truly nor by the fp32 reciprocal "
                           "consistently; the quantize kernels cannot match the reference there")
    return verdicts.pop()


# --- the tensor's absmax: its NaN/Inf check before anything is written (also used by quantize_nvfp4) ---------

FINITE_LIMIT = 0x7F800000             # fp32 bits of +Inf: |x| bits at or above it are Inf or NaN


@triton.jit
def _absmax_kernel(x_ptr, amax_ptr, numel, ITERS, BLOCK: tl.constexpr):
    """Program p folds elements [p * ITERS * BLOCK, (p + 1) * ITERS * BLOCK) into `*amax_ptr` (int32, zeroed)."""
    offs = tl.program_id(0).to(tl.int64) * ITERS * BLOCK + tl.arange(0, BLOCK)   # [BLOCK]
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for _ in range(0, ITERS):
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        offs += BLOCK
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


def global_absmax_bits(x: torch.Tensor, *, block: int = 4096, max_programs: int = 1024) -> torch.Tensor:
    """int32 0-dim tensor: the fp32 bits of max |x| over contiguous `x` (above 0x7F800000: a NaN or Inf)."""
    acc = torch.zeros((), dtype=torch.int32, device=x.device)
    numel = x.numel()
    iters = cdiv(cdiv(numel, block), max_programs)
    _absmax_kernel[(cdiv(numel, iters * block),)](x, acc, numel, iters, BLOCK=block)
    return acc


# --- per-row FP8 --------------------------------------------------------------------------------------------

@triton.jit
def _quantize_fp8_kernel(x_ptr, q_ptr, scale_ptr, N, K,
                         INV_448: tl.constexpr, BY_RECIPROCAL: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per BLOCK_M rows: amax over the row, then quantize it; x [N, K] contiguous."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)   # [BM]
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)                                             # [BK]

    amax = tl.zeros([BLOCK_M], dtype=tl.int32)        # max of |x| as fp32 bits: NaN/Inf stay visible
    for k0 in range(0, K, BLOCK_K):
        c = k0 + cols
        mask = row_ok[:, None] & (c[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * K + c[None, :], mask=mask, other=0.0).to(tl.float32)  # [BM, BK]
        amax = tl.maximum(amax, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
    amax_f = amax.to(tl.float32, bitcast=True)
    if BY_RECIPROCAL:
        scale = amax_f * INV_448
    else:
        scale = tl.math.div_rn(amax_f, 448.0)
    scale = tl.where(scale == 0.0, 1.0, scale)        # a zero row (or amax / 448 underflowing) gets scale 1
    tl.store(scale_ptr + rows, scale, mask=row_ok)

    for k0 in range(0, K, BLOCK_K):
        c = k0 + cols
        mask = row_ok[:, None] & (c[None, :] < K)
        offs = rows[:, None] * K + c[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -448.0), 448.0)
        tl.store(q_ptr + offs, e4m3_rne_bits(v).to(tl.uint8), mask=mask)


def weight_refusal(w: torch.Tensor, name: str) -> WeightsError | None:
    """Why the kernel cannot quantize `w`, as the error the provider raises (its predicate says no to the same
    calls), or None: a 2-D fp32, bf16 or fp16 [N, K] tensor with elements (also quantize_nvfp4's rule)."""
    if w.dtype not in FLOATS or w.dim() != 2 or w.numel() == 0:
        return WeightsError(name, f"{w.dtype} {tuple(w.shape)}", "a 2-D fp32, bf16 or fp16 [N, K] tensor with "
                            "elements", "pass the unquantized weight")
    return None


def quantize_fp8_triton(w: torch.Tensor, name: str = "weight", *,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton provider of `quantize_fp8`: (weight float8_e4m3fn [N, K], weight_scale fp32 [N]).

    `out`: that pair preallocated (contiguous), written and returned. A NaN/Inf in `w` is refused as the
    reference refuses it, with one sync: without `out`, checked on the row scales after the launch; with it,
    on the tensor's absmax before (one more read of `w`), so that a refused call leaves `out` as it was
    without a second copy of the weight's size.
    """
    if err := _quantize_fp8_refusal(w, name, out=out):
        raise err
    return quantize_fp8_launch(w, name, out=out)


def quantize_fp8_launch(w: torch.Tensor, name: str = "weight", *,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_triton` on a weight `weight_refusal` passed (the op's predicate checked it: one check a call)."""
    n, k = w.shape
    if out is not None:
        check_outs(out, (((n, k), torch.float8_e4m3fn), ((n,), torch.float32)), _OUT_NAMES, w.device, "contiguous")
    x = w.contiguous()
    if out is None:
        q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
        scale = torch.empty(n, dtype=torch.float32, device=w.device)
    else:
        if int(global_absmax_bits(x)) >= FINITE_LIMIT:
            check_finite(w, name)
        q, scale = out
    block_k = min(next_power_of_2(k), 1024)
    block_m = min(next_power_of_2(n), max(1, 4096 // block_k))
    _quantize_fp8_kernel[(cdiv(n, block_m),)](
        x, q.view(torch.uint8), scale, n, k,
        INV_448=fp32_reciprocal(FP8_E4M3_MAX), BY_RECIPROCAL=divides_by_reciprocal(w.device.type),
        BLOCK_M=block_m, BLOCK_K=block_k)
    if out is None and not bool(torch.isfinite(scale).all()):
        check_finite(w, name)
    return q, scale


def _quantize_fp8_native(w: torch.Tensor, name: str = "weight", *,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, `mtpfactory.quant.quantize_fp8`, written into `out` (checked as the Triton provider
    checks it) when given."""
    return write_outs(out, quant.quantize_fp8(w, name), _OUT_NAMES, "contiguous")


def _contract(w: torch.Tensor, name: str = "weight", *,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> MtpfError | None:
    """What the reference refuses before it reads a value (every provider refuses the same)."""
    if err := matrix_refusal(w, name):
        return err
    n, k = w.shape
    return outs_refusal(out, (((n, k), torch.float8_e4m3fn), ((n,), torch.float32)), _OUT_NAMES, w.device,
                        "contiguous")


quantize_fp8 = Op("quantize_fp8", _quantize_fp8_native, _contract)


def _quantize_fp8_refusal(w: torch.Tensor, name: str = "weight", *, out=None) -> MtpfError | None:
    """`weight_refusal`, and an `out` sharing memory with w: a program writes its rows' codes and scales while
    other programs still read theirs (neither is ever w itself: another dtype or shape)."""
    return weight_refusal(w, name) or outs_overlap_refusal(out, _OUT_NAMES, w=w)


quantize_fp8.register_provider("triton", quantize_fp8_launch, _quantize_fp8_refusal)
