"""Write rows of K and V into FP8 E4M3 paged caches at their slots (slot = block * block_size + offset).

DESIGN 3, FP8 KV: with no scale caches the values are clamped to +-448 and cast (unit scales); with fp32
per-token scale caches [blocks, block_size, kv_heads] (`levers.kv_exact`) each (token, KV head) row
stores scale = amax(|row|) / 448 (1 for an all-zero row) and the values row / scale, clamped and cast. NaN and
Inf follow torch: a NaN stays NaN (code 0x7F with its sign) and makes its row's amax and scale NaN; Inf
clamps to +-448 under unit scales and, with scales, makes the scale Inf and itself NaN (Inf / Inf).

The Triton provider rounds fp32 to E4M3 in integer math (round to nearest, ties to even) and stores the
codes as bytes: exact on the GPU and under the interpreter alike, whose own fp32->fp8 cast rounds wrongly
(DESIGN 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.errors import InputError
from mtpfactory.kernels.fp_bits import e4m3_rne_bits
from mtpfactory.kernels.reshape_and_cache import (cache_dims_refusal, check_slots, kv_rows_refusal, rows_refusal,
                                                  slot_dtype_refusal, write_slots)
from mtpfactory.ops import Op, next_power_of_2
from mtpfactory.quant.fp8 import FP8_E4M3_MAX, to_e4m3

_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)  # 448, readable inside @triton.jit
_FP8 = torch.float8_e4m3fn


def _cache_refusal(name: str, cache: torch.Tensor) -> InputError | None:
    """Why no provider can quantize into `cache`, or None: a float8_e4m3fn [blocks, block_size, kv_heads, D]."""
    if cache.dtype != _FP8:
        return InputError(name, f"{cache.dtype} {list(cache.shape)}",
                          "a float8_e4m3fn [blocks, block_size, kv_heads, D] tensor",
                          "write 16- and 32-bit caches with reshape_and_cache")
    return cache_dims_refusal(name, cache)


def _scale_refusal(name: str, scale: torch.Tensor | None, x: torch.Tensor, cache: torch.Tensor) -> InputError | None:
    """Why no provider can store `scale` (k_scale or v_scale) beside `cache`, or None: None, or fp32 [blocks,
    block_size, kv_heads] = cache's first three dims, one scale a slot and KV head; x's rows then of D >= 1 (a
    row's scale is its amax / 448)."""
    if scale is None:
        return None
    if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(cache.shape[:3]):
        return InputError(name, f"{scale.dtype} {list(scale.shape)}",
                          f"None or a float32 [blocks, block_size, kv_heads] = {list(cache.shape[:3])} tensor, one "
                          f"scale a slot and KV head of {name[0]}_cache {list(cache.shape)}",
                          "pass the cache's scales (PagedKVCache's k_scale / v_scale), or None for unit scales")
    if x.dim() > 0 and x.shape[-1] == 0:
        return InputError(name[0], f"{x.dtype} {list(x.shape)}",
                          f"rows of D >= 1 with {name} (a row's scale is its amax / 448)",
                          f"pass {name}=None for rows of no elements")
    return None


def _shape_refusal(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                   ) -> InputError | None:
    """Why no provider can write k and v at these slots, or None (the reference's part of
    `reshape_and_cache_fp8_refusal`: rows that broadcast, slots of any shape, each cache of its own shape)."""
    if err := (slot_dtype_refusal(slots) or _cache_refusal("k_cache", k_cache)
               or _cache_refusal("v_cache", v_cache)):
        return err
    return (rows_refusal("k", k, k_cache, slots, exact=False) or rows_refusal("v", v, v_cache, slots, exact=False)
            or _scale_refusal("k_scale", k_scale, k, k_cache) or _scale_refusal("v_scale", v_scale, v, v_cache))


def _reshape_and_cache_fp8_native(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor | None = None,
                                  v_scale: torch.Tensor | None = None) -> None:
    """k, v: [N, kv_heads, D] (any float dtype); k_cache, v_cache: float8_e4m3fn [blocks, block_size,
    kv_heads, D]; slots: [N] int in [-blocks * block_size, blocks * block_size) of the cache with fewer slots
    (a negative slot counts from the end); k_scale, v_scale: fp32 [blocks, block_size, kv_heads] or None.
    Shapes and dtypes as `_shape_refusal` says. In place."""
    if err := _shape_refusal(k, v, k_cache, v_cache, slots, k_scale, v_scale):
        raise err
    check_slots(slots, min(k_cache, v_cache, key=lambda c: c.shape[0] * c.shape[1]))
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        y = x.float()  # [N, kv_heads, D]
        if scale is not None:
            amax = y.abs().amax(dim=-1)  # [N, kv_heads]
            # Divide by a tensor: CUDA turns division by a Python scalar into a multiply by its
            # reciprocal, which rounds differently from the division the CPU (and the kernel) does.
            s = amax / torch.full_like(amax, FP8_E4M3_MAX)
            s = torch.where(s == 0, torch.ones_like(s), s)
            y = y / s[..., None]
            write_slots(scale, slots, s)
        write_slots(cache, slots, to_e4m3(y))  # clamped to +-448, then cast


# --- Triton -------------------------------------------------------------------------------------------

@triton.jit
def _quantize_store(x_ptr, c_ptr, s_ptr, row, blk, off, s_xn, s_xh, s_xd, s_cb, s_ct, s_ch, s_cd,
                    s_sb, s_st, s_sh, KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr, HAS_SCALE: tl.constexpr):
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    h_mask = h < KV_HEADS
    mask = h_mask[:, None] & (d < HEAD_DIM)[None, :]
    hh = h.to(tl.int64)  # heads may lie past 2^31 elements apart (h * stride), in x as in the cache
    x = tl.load(x_ptr + row * s_xn + hh[:, None] * s_xh + d[None, :] * s_xd, mask=mask,
                other=0.0).to(tl.float32)  # [H_PAD, D_PAD]
    if HAS_SCALE:
        # amax as the max of |x|'s bits: for non-negative floats the integer order is the float order and a
        # NaN lies above inf, so a NaN makes its row's amax NaN, as torch's amax does (tl.max on floats drops
        # NaN: maxnum on the GPU, nanmax in the interpreter); and the canonical NaN, as torch's is.
        amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1).to(tl.float32, bitcast=True)
        amax = tl.where(amax != amax, float("nan"), amax)  # [H_PAD]
        s = tl.math.div_rn(amax, _FP8_MAX)  # correctly rounded like torch
        s = tl.where(s == 0.0, 1.0, s)
        x = tl.math.div_rn(x, s[:, None])
        tl.store(s_ptr + blk * s_sb + off * s_st + hh * s_sh, s, mask=h_mask)
    # Clamp by compare and select, so that a NaN fails both compares and stays NaN, as in torch's clamp. The
    # sign is taken before it: on the H200 the compiler turns the selects into min/max, which give the
    # canonical (positive) NaN, where torch keeps a -NaN's sign (code 0xFF).
    neg = x.to(tl.int32, bitcast=True) < 0
    x = tl.where(x > _FP8_MAX, _FP8_MAX, tl.where(x < -_FP8_MAX, -_FP8_MAX, x))
    code = (e4m3_rne_bits(x) & 0x7F) | tl.where(neg, 0x80, 0)
    dst = c_ptr + blk * s_cb + off * s_ct + hh[:, None] * s_ch + d[None, :] * s_cd
    tl.store(dst, code.to(tl.uint8), mask=mask)


@triton.jit
def _reshape_and_cache_fp8_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slots_ptr, block_size, n_slots,
        s_kn, s_kh, s_kd, s_vn, s_vh, s_vd,
        s_kcb, s_kct, s_kch, s_kcd, s_vcb, s_vct, s_vch, s_vcd,
        s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh,
        KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        HAS_K_SCALE: tl.constexpr, HAS_V_SCALE: tl.constexpr):
    """One program per row: all KV heads of K and of V. A negative slot counts from the end, as the
    reference's indexing does (Triton's // and % round toward zero, so it must be wrapped first); a slot
    outside [-n_slots, n_slots) writes nothing."""
    row = tl.program_id(0).to(tl.int64)  # row * k's row stride may pass 2^31
    slot = tl.load(slots_ptr + row).to(tl.int64)
    slot = tl.where(slot < 0, slot + n_slots, slot)
    if (slot >= 0) & (slot < n_slots):
        blk = slot // block_size
        off = slot % block_size
        _quantize_store(k_ptr, kc_ptr, ks_ptr, row, blk, off, s_kn, s_kh, s_kd, s_kcb, s_kct, s_kch, s_kcd,
                        s_ksb, s_kst, s_ksh, KV_HEADS, H_PAD, HEAD_DIM, D_PAD, HAS_K_SCALE)
        _quantize_store(v_ptr, vc_ptr, vs_ptr, row, blk, off, s_vn, s_vh, s_vd, s_vcb, s_vct, s_vch, s_vcd,
                        s_vsb, s_vst, s_vsh, KV_HEADS, H_PAD, HEAD_DIM, D_PAD, HAS_V_SCALE)


_MAX_BLOCK = tl.TRITON_MAX_TENSOR_NUMEL    # the most elements of one tile
_MAX_TOKENS = 2**31 - 1                    # grid axis 0 (tokens)


def reshape_and_cache_fp8_refusal(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  slots: torch.Tensor, k_scale: torch.Tensor | None = None,
                                  v_scale: torch.Tensor | None = None) -> InputError | None:
    """Why `reshape_and_cache_fp8_triton` cannot take these operands, as the error it raises (its predicate
    says no to the same calls), or None: slots a 1-D int32 or int64 [N]; k_cache a float8_e4m3fn [blocks,
    block_size, kv_heads, D] and v_cache of its shape (the kernel walks both by K's kv_heads and D); k and v
    bf16, fp16 or fp32 [N, kv_heads, D], N < 2^31 (the grid), kv_heads x D, each rounded up to a power of two,
    at most 2^20 (a token's heads in a program); k_scale, v_scale None or float32 [blocks, block_size,
    kv_heads], D >= 1 with them; any strides; all on k's device."""
    if err := slot_dtype_refusal(slots):
        return err
    if slots.dim() != 1:
        return InputError("slots", f"{slots.dtype} {list(slots.shape)}", "a 1-D [N] tensor, one slot a row of k and v",
                          "pass slots.flatten(), with k and v as [N, kv_heads, D] rows")
    if err := _cache_refusal("k_cache", k_cache) or _cache_refusal("v_cache", v_cache):
        return err
    if k_cache.dim() != 4:
        return InputError("k_cache", f"{k_cache.dtype} {list(k_cache.shape)}",
                          "a 4-D [blocks, block_size, kv_heads, D] tensor", "allocate the cache as PagedKVCache does")
    if v_cache.shape != k_cache.shape:
        return InputError("v_cache", f"{v_cache.dtype} {list(v_cache.shape)}",
                          f"k_cache's shape {list(k_cache.shape)} (the kernel walks both by K's kv_heads and D)",
                          "pass the V cache of this K cache")
    if err := kv_rows_refusal(k, v, k_cache, v_cache, slots):
        return err
    if err := _scale_refusal("k_scale", k_scale, k, k_cache) or _scale_refusal("v_scale", v_scale, v, v_cache):
        return err
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots), ("k_scale", k_scale),
                    ("v_scale", v_scale)):
        if t is not None and t.device != k.device:
            return InputError(name, f"on {t.device}", f"on k's device, {k.device} (the kernel reads and writes "
                              "there)", f"pass {name} on k's device")
    n, hkv, d = k.shape
    if n > _MAX_TOKENS or next_power_of_2(hkv) * next_power_of_2(d) > _MAX_BLOCK:
        return InputError("k", f"[N, kv_heads, D] = {list(k.shape)}",
                          f"N <= {_MAX_TOKENS} (the grid) and kv_heads x D, each rounded up to a power of two, at "
                          f"most {_MAX_BLOCK} (a token's heads in a program)",
                          "call the op (`reshape_and_cache_fp8`) under runtime.backend=auto: it runs the reference "
                          "for others")
    return None


def reshape_and_cache_fp8_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slots: torch.Tensor, k_scale: torch.Tensor | None = None,
                                 v_scale: torch.Tensor | None = None) -> None:
    """The Triton provider; same arguments as the reference. In place. A slot out of range, which the
    reference refuses (a sync), writes nothing here. Duplicate slots are the caller's error, as in the
    reference they leave one writer's row, unspecified which; with scales, the slot's codes and its scale are
    separate stores, so they may even come from different writers. Operands as `reshape_and_cache_fp8_refusal`
    says."""
    if err := reshape_and_cache_fp8_refusal(k, v, k_cache, v_cache, slots, k_scale, v_scale):
        raise err
    reshape_and_cache_fp8_launch(k, v, k_cache, v_cache, slots, k_scale, v_scale)


def reshape_and_cache_fp8_launch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slots: torch.Tensor, k_scale: torch.Tensor | None = None,
                                 v_scale: torch.Tensor | None = None) -> None:
    """`reshape_and_cache_fp8_triton` on operands `reshape_and_cache_fp8_refusal` passed (the op's predicate
    checked them: one check a call)."""
    n, hkv, d = k.shape
    if k.numel() == 0:      # no rows, or rows of nothing (D = 0 only without scales)
        return
    kc, vc = k_cache.view(torch.uint8), v_cache.view(torch.uint8)  # the kernel stores E4M3 codes as bytes
    ks = k_scale if k_scale is not None else kc  # a placeholder pointer when absent
    vs = v_scale if v_scale is not None else vc
    _reshape_and_cache_fp8_kernel[(n,)](
        k, v, kc, vc, ks, vs, slots.contiguous(), k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1],
        *k.stride(), *v.stride(), *kc.stride(), *vc.stride(),
        *(k_scale.stride() if k_scale is not None else (0, 0, 0)),
        *(v_scale.stride() if v_scale is not None else (0, 0, 0)),
        KV_HEADS=hkv, H_PAD=next_power_of_2(hkv), HEAD_DIM=d, D_PAD=next_power_of_2(d),
        HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None, num_warps=4)


reshape_and_cache_fp8 = Op("reshape_and_cache_fp8", _reshape_and_cache_fp8_native, _shape_refusal)
reshape_and_cache_fp8.register_provider("triton", reshape_and_cache_fp8_launch,
                                        reshape_and_cache_fp8_refusal)

__all__ = ["reshape_and_cache_fp8", "reshape_and_cache_fp8_refusal", "reshape_and_cache_fp8_triton"]
