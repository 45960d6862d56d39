"""Write rows of K and V into the paged cache at their slots (slot = block * block_size + offset)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.kernels.fp_bits import cast_rne
from mtpfactory.ops import Op, check_indices, triton_can_run


def check_slots(slots: torch.Tensor, cache: torch.Tensor) -> None:
    """Refuse a slot outside [-blocks * block_size, blocks * block_size) (a negative slot counts from the end)."""
    n = cache.shape[0] * cache.shape[1]
    check_indices("slots", slots, -n, n, f"cache slots of these {cache.shape[0]} blocks of {cache.shape[1]}",
                  "write at slot = block * block_size + offset of a block this cache holds")


def _reshape_and_cache_native(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [N, kv_heads, D]; k_cache, v_cache: [blocks, block_size, kv_heads, D]; slots: [N] int in
    [-blocks * block_size, blocks * block_size) (a negative slot counts from the end).

    Values are cast to the cache dtype; in place."""
    check_slots(slots, k_cache)
    nb, bs = k_cache.shape[:2]
    k_cache.view(nb * bs, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(nb * bs, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)


reshape_and_cache = Op("reshape_and_cache", _reshape_and_cache_native)


# --- Triton ---------------------------------------------------------------------------------------------------

@triton.jit
def _store_rows(src_ptr, stride_n, stride_h, cache_ptr, n, slot, heads, D, h,
                BLOCK_D: tl.constexpr):
    """One token's [heads, D] (the heads `h` of this program) into its cache slot, cast to the cache dtype."""
    d = tl.arange(0, BLOCK_D)
    m = (h < heads)[:, None] & (d < D)[None, :]
    x = tl.load(src_ptr + n * stride_n + h[:, None].to(tl.int64) * stride_h + d[None, :], mask=m, other=0.0)
    dst = cache_ptr + (slot * heads + h[:, None]) * D + d[None, :]
    tl.store(dst, cast_rne(x.to(tl.float32), cache_ptr.dtype.element_ty), mask=m)


@triton.jit
def _reshape_and_cache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, n_slots,
                              stride_kn, stride_kh, stride_vn, stride_vh, k_heads, k_dim, v_heads, v_dim,
                              BLOCK_HEADS: tl.constexpr, BLOCK_KD: tl.constexpr, BLOCK_VD: tl.constexpr):
    """Program (token n, block of heads); K and V in one launch. A negative slot counts from the end, as the
    reference's indexing does; a slot outside [-n_slots, n_slots) writes nothing."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    slot = tl.where(slot < 0, slot + n_slots, slot)
    if (slot >= 0) & (slot < n_slots):
        _store_rows(k_ptr, stride_kn, stride_kh, k_cache_ptr, n, slot, k_heads, k_dim, h, BLOCK_KD)
        _store_rows(v_ptr, stride_vn, stride_vh, v_cache_ptr, n, slot, v_heads, v_dim, h, BLOCK_VD)


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # FP8 caches: a later kernel


def _pair_fits(x: torch.Tensor, cache: torch.Tensor, n: int) -> bool:
    return (x.dim() == 3 and cache.dim() == 4 and x.shape[0] == n and tuple(x.shape[1:]) == tuple(cache.shape[2:])
            and x.dtype in _FLOATS and cache.dtype in _FLOATS and x.stride(-1) == 1 and cache.is_contiguous())


def _reshape_and_cache_supports(k, v, k_cache, v_cache, slots) -> bool:
    return (triton_can_run(k, v, k_cache, v_cache, slots) and slots.dim() == 1
            and slots.dtype in (torch.int32, torch.int64) and k_cache.shape[:2] == v_cache.shape[:2]
            and _pair_fits(k, k_cache, slots.shape[0]) and _pair_fits(v, v_cache, slots.shape[0]))


def reshape_and_cache_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slots: torch.Tensor) -> None:
    """The reference's contract. k, v may be strided views (slices of a fused QKV) with the last dim
    contiguous; the caches are contiguous. A slot out of range, which the reference refuses (a sync), writes
    nothing here; duplicate slots leave one of the writers' rows, unspecified which, as in the reference."""
    N, k_heads, k_dim = k.shape
    _, v_heads, v_dim = v.shape
    if N == 0 or max(k_heads, v_heads) == 0:
        return
    block_kd, block_vd = triton.next_power_of_2(k_dim), triton.next_power_of_2(v_dim)
    heads = max(k_heads, v_heads)
    block_heads = min(triton.next_power_of_2(heads), max(1, 4096 // max(block_kd, block_vd)))
    nb, bs = k_cache.shape[:2]
    _reshape_and_cache_kernel[(N, triton.cdiv(heads, block_heads))](
        k, v, k_cache, v_cache, slots.contiguous(), nb * bs, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_heads, k_dim, v_heads, v_dim, BLOCK_HEADS=block_heads, BLOCK_KD=block_kd, BLOCK_VD=block_vd,
        num_warps=4)


reshape_and_cache.register_provider("triton", reshape_and_cache_triton, _reshape_and_cache_supports)
