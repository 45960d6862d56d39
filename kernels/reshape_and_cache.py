"""Write rows of K and V into the paged cache at their slots (slot = block * block_size + offset)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtpfactory.errors import InputError
from mtpfactory.kernels.fp_bits import cast_rne
from mtpfactory.ops import FLOATS, Op, cdiv, check_indices, next_power_of_2

_SLOT_DTYPES = (torch.int32, torch.int64)


def check_slots(slots: torch.Tensor, cache: torch.Tensor) -> None:
    """Refuse a slot outside [-blocks * block_size, blocks * block_size) (a negative slot counts from the end)."""
    n = cache.shape[0] * cache.shape[1]
    check_indices("slots", slots, -n, n, f"cache slots of these {cache.shape[0]} blocks of {cache.shape[1]}",
                  "write at slot = block * block_size + offset of a block this cache holds")


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slot // block_size, slot % block_size] = rows, a slot a row (a negative slot counts from the end of
    this cache's blocks * block_size): the references' write, indexed by the block and offset dims, so a cache of
    any strides takes it (a view of a [blocks, 2, block_size, ...] K|V cache, which cannot be viewed as rows)."""
    bs = cache.shape[1]
    s = slots.long()
    s = torch.where(s < 0, s + cache.shape[0] * bs, s)
    cache[s // bs, s % bs] = rows


def slot_dtype_refusal(slots: torch.Tensor) -> InputError | None:
    """Why no provider can write at these slots, or None: slots are int32 or int64 (torch indexes by no other
    dtype, and would read bool or uint8 ones as a mask)."""
    if slots.dtype not in _SLOT_DTYPES:
        return InputError("slots", f"{slots.dtype} {list(slots.shape)}",
                          "an int32 or int64 tensor of slot numbers (torch would read bool or uint8 as a mask)",
                          "pass the slot numbers as int64 (of a mask of slots: mask.nonzero().flatten())")
    return None


def broadcasts(shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """`shape` broadcasts to `want` as torch broadcasts the value of an indexed assignment (leading 1s dropped)."""
    lead = max(len(shape) - len(want), 0)
    return (all(s == 1 for s in shape[:lead])
            and all(s in (1, w) for s, w in zip(reversed(shape[lead:]), reversed(want))))


def rows_refusal(field: str, x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                 exact: bool) -> InputError | None:
    """Why `x` (k or v) cannot be written at `slots` of `cache`, or None: its rows are [N, kv_heads, D] = the
    slots' count and the cache's last two dims; `exact` (the kernels) that shape itself, else (the references)
    any shape that broadcasts to it."""
    want = (*slots.shape, *cache.shape[2:])
    if tuple(x.shape) == want or (not exact and broadcasts(tuple(x.shape), want)):
        return None
    return InputError(field, f"{x.dtype} {list(x.shape)}",
                      f"[N, kv_heads, D] = {list(want)}: one row a slot of slots {list(slots.shape)}, the kv_heads and "
                      f"head_dim of {field}_cache {list(cache.shape)}",
                      f"pass {field} as [N, kv_heads, D] rows of the cache's shape, one a slot")


def cache_dims_refusal(name: str, cache: torch.Tensor) -> InputError | None:
    """Why the references cannot index `cache` by slot, or None: it is [blocks, block_size, ...]."""
    if cache.dim() < 2:
        return InputError(name, f"{cache.dtype} {list(cache.shape)}", "a [blocks, block_size, kv_heads, D] tensor",
                          "allocate the cache as PagedKVCache does")
    return None


def _shape_refusal(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> InputError | None:
    """Why no provider can write k and v at these slots, or None (the reference's part of
    `reshape_and_cache_refusal`: rows that broadcast, slots of any shape): v_cache holds as many slots as k_cache
    (a slot names a row of both), and neither cache FP8 (`reshape_and_cache_fp8` writes those: DESIGN 3 clamps to
    ±448 before the cast, which past it gives NaN on some torch versions and 448 on others)."""
    if err := (slot_dtype_refusal(slots) or cache_dims_refusal("k_cache", k_cache)
               or cache_dims_refusal("v_cache", v_cache)):
        return err
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype.is_floating_point and cache.dtype.itemsize == 1:
            return InputError(name, f"{cache.dtype} {list(cache.shape)}", "a 16-bit, fp32 or fp64 cache: an FP8 one "
                              "takes its values clamped to ±448 (DESIGN 3), which a plain cast does not do",
                              "write FP8 caches with reshape_and_cache_fp8")
    if v_cache.shape[0] * v_cache.shape[1] != k_cache.shape[0] * k_cache.shape[1]:
        return InputError("v_cache", f"{v_cache.dtype} {list(v_cache.shape)}",
                          f"as many slots as k_cache {list(k_cache.shape)}, {k_cache.shape[0]} blocks of "
                          f"{k_cache.shape[1]}: a slot names a row of both", "pass the V cache of this K cache")
    return rows_refusal("k", k, k_cache, slots, exact=False) or rows_refusal("v", v, v_cache, slots, exact=False)


def _reshape_and_cache_native(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [N, kv_heads, D]; k_cache, v_cache: [blocks, block_size, kv_heads, D]; slots: [N] int in
    [-blocks * block_size, blocks * block_size) (a negative slot counts from the end). Shapes and slot dtypes
    as `_shape_refusal` says.

    Values are cast to the cache dtype; in place."""
    if err := _shape_refusal(k, v, k_cache, v_cache, slots):
        raise err
    check_slots(slots, k_cache)
    write_slots(k_cache, slots, k.to(k_cache.dtype))
    write_slots(v_cache, slots, v.to(v_cache.dtype))


reshape_and_cache = Op("reshape_and_cache", _reshape_and_cache_native, _shape_refusal)


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


def kv_rows_refusal(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor) -> InputError | None:
    """Why k and v are not float rows [N, kv_heads, D] of their caches, one a slot (both cache writes' rule)."""
    for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if x.dtype not in FLOATS:
            return InputError(name, f"{x.dtype} {list(x.shape)}", "a bf16, fp16 or fp32 tensor",
                              f"pass {name}.float()")
        if err := rows_refusal(name, x, cache, slots, exact=True):
            return err
    return None
_MAX_BLOCK = tl.TRITON_MAX_TENSOR_NUMEL    # the most elements of one tile
_MAX_TOKENS = 2**31 - 1                    # grid axis 0 (tokens)
_MAX_HEAD_PROGRAMS = 65535                 # grid axis 1 (blocks of heads)


def _blocks(k_heads: int, k_dim: int, v_heads: int, v_dim: int) -> tuple[int, int, int]:
    """(BLOCK_HEADS, BLOCK_KD, BLOCK_VD) of a launch: a head's K and V row each in one block, as many heads a
    program as keep its tiles near 4096 elements."""
    block_kd, block_vd = next_power_of_2(max(k_dim, 1)), next_power_of_2(max(v_dim, 1))
    heads = max(k_heads, v_heads, 1)
    return min(next_power_of_2(heads), max(1, 4096 // max(block_kd, block_vd))), block_kd, block_vd


def reshape_and_cache_refusal(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slots: torch.Tensor) -> InputError | None:
    """Why `reshape_and_cache_triton` cannot take these operands, as the error it raises (its predicate says no
    to the same calls), or None: slots a 1-D int32 or int64 [N] (any stride); k_cache and v_cache contiguous
    (the kernel writes a slot's rows at slot * kv_heads * D) bf16, fp16 or fp32 [blocks, block_size, kv_heads,
    D] of the same [blocks, block_size] (K and V may differ in kv_heads and D); k and v bf16, fp16 or fp32
    [N, kv_heads, D] of their cache's kv_heads and D, with unit stride along D (tokens and heads at any
    stride), N < 2^31 and heads in at most 65535 programs (the grid), D <= 2^20 (one row in a program); all
    on k's device."""
    if err := slot_dtype_refusal(slots):
        return err
    if slots.dim() != 1:
        return InputError("slots", f"{slots.dtype} {list(slots.shape)}", "a 1-D [N] tensor, one slot a row of k and v",
                          "pass slots.flatten(), with k and v as [N, kv_heads, D] rows")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.dtype not in FLOATS:
            fix = ("write FP8 caches with reshape_and_cache_fp8" if cache.dtype == torch.float8_e4m3fn else
                   "call the op (`reshape_and_cache`) under runtime.backend=auto: it runs the reference for others")
            return InputError(name, f"{cache.dtype} {list(cache.shape)}",
                              "a bf16, fp16 or fp32 [blocks, block_size, kv_heads, D] tensor", fix)
        if not cache.is_contiguous():
            return InputError(name, f"strides {cache.stride()} of {list(cache.shape)}",
                              "a contiguous tensor (the kernel writes a slot's rows at slot * kv_heads * D)",
                              "allocate the cache contiguous (a .contiguous() copy would not receive the writes)")
    if v_cache.shape[:2] != k_cache.shape[:2]:
        return InputError("v_cache", f"{v_cache.dtype} {list(v_cache.shape)}",
                          f"k_cache's [blocks, block_size] = {list(k_cache.shape[:2])}: a slot names a row of both",
                          "pass the V cache of this K cache")
    if err := kv_rows_refusal(k, v, k_cache, v_cache, slots):
        return err
    for name, x in (("k", k), ("v", v)):
        if x.shape[2] > 1 and x.stride(2) != 1:
            return InputError(name, f"strides {x.stride()} of {list(x.shape)}",
                              "unit stride along D (the kernel reads a head's row in a row; tokens and heads at any "
                              "stride)", f"pass {name}.contiguous()")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots)):
        if t.device != k.device:
            return InputError(name, f"on {t.device}", f"on k's device, {k.device} (the kernel reads and writes "
                              "there)", f"pass {name} on k's device")
    (n, k_heads, k_dim), (v_heads, v_dim) = k.shape, v.shape[1:]
    block_heads = _blocks(k_heads, k_dim, v_heads, v_dim)[0]
    if (n > _MAX_TOKENS or max(k_dim, v_dim) > _MAX_BLOCK
            or cdiv(max(k_heads, v_heads), block_heads) > _MAX_HEAD_PROGRAMS):
        return InputError("k", f"[N, kv_heads, D] = {list(k.shape)}, v {list(v.shape)}",
                          f"N <= {_MAX_TOKENS} and heads in at most {_MAX_HEAD_PROGRAMS} programs of {block_heads} "
                          f"(the grid), D <= {_MAX_BLOCK} (one row in a program)",
                          "call the op (`reshape_and_cache`) under runtime.backend=auto: it runs the reference "
                          "for others")
    return None


def reshape_and_cache_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slots: torch.Tensor) -> None:
    """The reference's contract. k, v may be strided views (slices of a fused QKV) with the last dim
    contiguous; the caches are contiguous. A slot out of range, which the reference refuses (a sync), writes
    nothing here; duplicate slots leave one of the writers' rows, unspecified which, as in the reference.
    Operands as `reshape_and_cache_refusal` says."""
    if err := reshape_and_cache_refusal(k, v, k_cache, v_cache, slots):
        raise err
    reshape_and_cache_launch(k, v, k_cache, v_cache, slots)


def reshape_and_cache_launch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slots: torch.Tensor) -> None:
    """`reshape_and_cache_triton` on operands `reshape_and_cache_refusal` passed (the op's predicate checked
    them: one check a call)."""
    N, k_heads, k_dim = k.shape
    _, v_heads, v_dim = v.shape
    if N == 0 or k.numel() + v.numel() == 0:
        return
    block_heads, block_kd, block_vd = _blocks(k_heads, k_dim, v_heads, v_dim)
    nb, bs = k_cache.shape[:2]
    _reshape_and_cache_kernel[(N, cdiv(max(k_heads, v_heads), block_heads))](
        k, v, k_cache, v_cache, slots.contiguous(), nb * bs, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_heads, k_dim, v_heads, v_dim, BLOCK_HEADS=block_heads, BLOCK_KD=block_kd, BLOCK_VD=block_vd,
        num_warps=4)


reshape_and_cache.register_provider("triton", reshape_and_cache_launch, reshape_and_cache_refusal)
