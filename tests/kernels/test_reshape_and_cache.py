"""reshape_and_cache's Triton provider against its reference (DESIGN 4). Exact: a cast to the cache dtype
rounds once to nearest even in both, so the caches must be bit-equal. The caches start all NaN: a written
slot must hold the rows, every other slot must still be NaN."""

from __future__ import annotations

import os

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import InputError, MtpfError
from mtpfactory.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_triton
from backend_refusal import assert_backend_refuses

# (k / v dtype, cache dtype): same dtype, and the casts that round (fp32 -> bf16 / fp16) or widen.
CASTS = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
         (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
         (torch.bfloat16, torch.float16)]
# (N, kv_heads, D, blocks, block_size)
SHAPES = [(1, 1, 1, 1, 1), (5, 2, 7, 3, 4), (33, 3, 64, 5, 8), (5, 1, 130, 2, 16)]

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="Triton on the CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def nan_cache(blocks: int, block_size: int, heads: int, D: int, dtype: torch.dtype, device="cpu"):
    return torch.full((blocks, block_size, heads, D), float("nan"), dtype=dtype, device=device)


def check(k, v, k_cache, v_cache, slots) -> None:
    """Runs the Triton provider and the reference on copies of the (NaN-filled) caches and compares bits."""
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache.reference(k, v, want_k, want_v, slots)
    with ops.use_backend("triton"):
        assert reshape_and_cache(k, v, k_cache, v_cache, slots) is None
    nb, bs = k_cache.shape[:2]
    written = torch.zeros(nb * bs, dtype=torch.bool, device=k_cache.device)
    written[slots] = True
    for got, want in ((k_cache, want_k), (v_cache, want_v)):
        flat = got.view(nb * bs, -1)
        assert not flat[written].isnan().any(), "a slot was left unwritten"
        assert flat[~written].isnan().all(), "a slot outside `slots` was written"
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("N,heads,D,blocks,block_size", SHAPES)
@pytest.mark.parametrize("src_dtype,cache_dtype", CASTS)
def test_matches_reference(src_dtype, cache_dtype, N, heads, D, blocks, block_size):
    gen = torch.Generator().manual_seed(N * D + heads)
    k = torch.randn(N, heads, D, generator=gen).to(src_dtype)
    v = (100 * torch.randn(N, heads, D, generator=gen)).to(src_dtype)
    slots = torch.randperm(blocks * block_size, generator=gen)[:N]  # distinct: duplicates leave either row
    slots[::2] -= blocks * block_size  # negative slots count from the end, as the reference's indexing does
    check(k, v, nan_cache(blocks, block_size, heads, D, cache_dtype),
          nan_cache(blocks, block_size, heads, D, cache_dtype), slots)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_rounding_ties_to_even_and_overflow(cache_dtype):
    """fp32 values half-way between two cache values round to the even one; past the max go to inf."""
    ties = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 3 * 2**-8), 1 + 2**-8 + 2**-20,
            3.4e38, 70000.0, 2**-140, 0.0]
    k = torch.tensor(ties, dtype=torch.float32).view(1, 1, -1)
    v = -k
    check(k, v, nan_cache(2, 2, 1, len(ties), cache_dtype), nan_cache(2, 2, 1, len(ties), cache_dtype),
          torch.tensor([2], dtype=torch.int32))


def test_strided_k_v_from_a_fused_projection():
    """k and v as slices of a fused [N, q_heads + 2 * kv_heads, D] output: not contiguous."""
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(6, 4 + 2 * 2, 12, generator=gen).to(torch.bfloat16)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([3, 0, 7, 12, 2, 9])
    check(k, v, nan_cache(4, 4, 2, 12, torch.bfloat16), nan_cache(4, 4, 2, 12, torch.bfloat16), slots)


def test_k_and_v_with_heads_further_apart_than_a_row():
    """k and v [N, kv_heads, D] views of [kv_heads, N, D] buffers: a head's row lies N * D elements past the
    previous head's, not D."""
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(2, 5, 8, generator=gen).transpose(0, 1)
    v = torch.randn(2, 5, 8, generator=gen).transpose(0, 1)
    assert k.stride(1) == 5 * 8
    check(k, v, nan_cache(4, 4, 2, 8, torch.float32), nan_cache(4, 4, 2, 8, torch.float32),
          torch.tensor([3, 0, 7, 12, -2]))


def test_k_and_v_of_other_kv_heads_and_head_dims():
    """K [N, 2, 8] and V [N, 1, 24] rows, each in a cache of its own shape (the op allows K and V to differ in
    kv_heads and D), each walked by its own. The V cache is the first 4 blocks of 8 and the K cache the first 4
    of 12 of NaN buffers, so a row written by the other's shape lands in the poison after them (not past the
    buffer), which must stay NaN."""
    gen = torch.Generator().manual_seed(14)
    k = torch.randn(5, 2, 8, generator=gen)
    v = torch.randn(5, 1, 24, generator=gen)
    k_guarded, v_guarded = nan_cache(12, 4, 2, 8, torch.float32), nan_cache(8, 4, 1, 24, torch.float32)
    check(k, v, k_guarded[:4], v_guarded[:4], torch.tensor([3, 0, 15, 12, -2]))
    assert k_guarded[4:].isnan().all() and v_guarded[4:].isnan().all()


def test_strided_slots():
    """slots a column of a wider tensor (stride 2)."""
    k = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(10))
    slots = torch.tensor([[7, 0], [-3, 0], [2, 0]])[:, 0]
    check(k, -k, nan_cache(3, 4, 1, 8, torch.float32), nan_cache(3, 4, 1, 8, torch.float32), slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [12, 13, -13, 2**40])
def test_slot_out_of_range_refused_by_the_reference_and_written_nowhere_by_the_kernel(bad, device):
    """Slots lie in [-12, 12) for 3 blocks of 4. The reference refuses another, naming the field; the kernel,
    which cannot raise without a sync, writes the good rows and nothing for the bad one, neither in the cache
    nor in the guard blocks around it (a write past the cache would land there)."""
    k = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(12)).to(device)
    slots = torch.tensor([5, bad, 0], device=device)
    with pytest.raises(InputError, match=rf"^slots={bad}: cache slots .* lie in \[-12, 12\)"):
        reshape_and_cache.reference(k, -k, nan_cache(3, 4, 1, 8, torch.float32, device),
                                    nan_cache(3, 4, 1, 8, torch.float32, device), slots)
    guarded = [nan_cache(3 * 3, 4, 1, 8, torch.float32, device) for _ in range(2)]  # blocks 3-5 are the cache
    with ops.use_backend("triton"):
        reshape_and_cache(k, -k, guarded[0][3:6], guarded[1][3:6], slots)
    for g, x in zip(guarded, (k, -k)):
        flat = g[3:6].reshape(12, 8)
        assert torch.equal(flat[[5, 0]], x[[0, 2], 0]) and flat[[i for i in range(12) if i not in (0, 5)]].isnan().all()
        assert g[:3].isnan().all() and g[6:].isnan().all()


def _ops():
    """k [3, 2, 8] fp32, v [3, 1, 4] bf16 (K and V may differ in heads and D), NaN caches of 2 blocks of 4 (K fp32,
    V bf16), slots [3] int64: operands the kernel takes."""
    gen = torch.Generator().manual_seed(13)
    return (torch.randn(3, 2, 8, generator=gen), torch.randn(3, 1, 4, generator=gen).bfloat16(),
            nan_cache(2, 4, 2, 8, torch.float32), nan_cache(2, 4, 1, 4, torch.bfloat16), torch.tensor([5, 0, 7]))


def _huge(n: int, d: int):
    """k and v [n, 1, d] (zeros, stride 0 but along D), caches of d, slots [n]: past a limit without the memory."""
    x = torch.zeros(1, 1, d).expand(n, 1, d)
    return x, x, nan_cache(1, 2, 1, d, torch.float32), nan_cache(1, 2, 1, d, torch.float32), \
        torch.zeros(1, dtype=torch.int64).expand(n)


def _fp8_nan(shape) -> torch.Tensor:
    return torch.full(shape, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # E4M3 (fn) NaN


# case: (k, v, k_cache, v_cache, slots) from `_ops()`, the field refused, what its message says it allows
BAD = {
    "slots bool": (lambda k, v, kc, vc, s: (k, v, kc, vc, s > 1), "slots", "int32 or int64 .* as a mask"),
    "slots uint8": (lambda k, v, kc, vc, s: (k, v, kc, vc, s.to(torch.uint8)), "slots", "int32 or int64"),
    "slots float": (lambda k, v, kc, vc, s: (k, v, kc, vc, s.float()), "slots", "int32 or int64"),
    "slots int16": (lambda k, v, kc, vc, s: (k, v, kc, vc, s.short()), "slots", "int32 or int64"),
    "slots 2-D": (lambda k, v, kc, vc, s: (k, v, kc, vc, s[:, None]), "slots", r"a 1-D \[N\] tensor"),
    "k_cache FP8": (lambda k, v, kc, vc, s: (k, v, _fp8_nan(kc.shape), vc, s), "k_cache",
                    r"bf16, fp16 or fp32 \[blocks, block_size, kv_heads, D\]"),
    "v_cache fp64": (lambda k, v, kc, vc, s: (k, v, kc, vc.double(), s), "v_cache", "bf16, fp16 or fp32"),
    "k_cache 3-D": (lambda k, v, kc, vc, s: (k, v, kc[:, :, 0], vc, s), "k_cache",
                    r"\[blocks, block_size, kv_heads, D\]"),
    "k_cache strided": (lambda k, v, kc, vc, s: (k, v, nan_cache(2, 4, 2, 16, torch.float32)[..., ::2], vc, s),
                        "k_cache", "a contiguous tensor"),
    "v_cache of other blocks": (lambda k, v, kc, vc, s: (k, v, kc, vc.view(4, 2, 1, 4), s), "v_cache",
                                r"k_cache's \[blocks, block_size\] = \[2, 4\]"),
    "v_cache of fewer slots": (lambda k, v, kc, vc, s: (k, v, kc, vc[:1], s), "v_cache",
                               r"k_cache's \[blocks, block_size\] = \[2, 4\]"),
    "k of other heads": (lambda k, v, kc, vc, s: (torch.randn(3, 3, 8), v, kc, vc, s), "k",
                         r"\[N, kv_heads, D\] = \[3, 2, 8\]"),
    "k of other D": (lambda k, v, kc, vc, s: (k[..., :4], v, kc, vc, s), "k", r"\[N, kv_heads, D\] = \[3, 2, 8\]"),
    "k 2-D": (lambda k, v, kc, vc, s: (k.view(3, 16), v, kc, vc, s), "k", r"\[N, kv_heads, D\] = \[3, 2, 8\]"),
    "v of fewer rows": (lambda k, v, kc, vc, s: (k, v[:2], kc, vc, s), "v", r"\[N, kv_heads, D\] = \[3, 1, 4\]"),
    "k one row for every slot": (lambda k, v, kc, vc, s: (k[:1], v, kc, vc, s), "k", r"= \[3, 2, 8\]"),
    "k int": (lambda k, v, kc, vc, s: (k.int(), v, kc, vc, s), "k", "bf16, fp16 or fp32"),
    "v fp64": (lambda k, v, kc, vc, s: (k, v.double(), kc, vc, s), "v", "bf16, fp16 or fp32"),
    "k strided along D": (lambda k, v, kc, vc, s: (torch.cat([k, k], -1)[..., ::2], v, kc, vc, s), "k",
                          "unit stride along D"),
    "v elsewhere": (lambda k, v, kc, vc, s: (k, v.to("meta"), kc, vc, s), "v", "on k's device, cpu"),
    "v_cache elsewhere": (lambda k, v, kc, vc, s: (k, v, kc, vc.to("meta"), s), "v_cache", "on k's device, cpu"),
    "slots elsewhere": (lambda k, v, kc, vc, s: (k, v, kc, vc, s.to("meta")), "slots", "on k's device, cpu"),
    "k N past the grid": (lambda *a: _huge(2**31, 1), "k", "N <= 2147483647"),
    "k D past a tile": (lambda *a: _huge(1, 2**20 + 1), "k", "D <= 1048576"),
}


def _untouched(t: torch.Tensor) -> bool:
    """t still holds its NaN poison (FP8: the NaN code)."""
    if t.device.type == "meta":
        return True
    if t.dtype == torch.float8_e4m3fn:
        return bool((t.view(torch.uint8) == 0x7F).all())
    return bool(t.isnan().all())


@pytest.mark.parametrize("case", BAD)
def test_operands_the_kernel_cannot_take_are_refused_by_the_predicate_the_provider_and_the_backend(case):
    """One rule (`reshape_and_cache_refusal`): the predicate says no, `reshape_and_cache_triton` called directly
    raises it naming the operand and writes nothing, and an explicit `runtime.backend=triton` says which operand
    it refuses."""
    make, field, allowed = BAD[case]
    args = make(*_ops())
    with ops.use_backend("triton"):
        assert not reshape_and_cache.providers["triton"].supports(*args)
        with pytest.raises(MtpfError, match=rf"^{field}=.*{allowed}"):
            reshape_and_cache_triton(*args)
        assert_backend_refuses(reshape_and_cache, field, *args)
    assert _untouched(args[2]) and _untouched(args[3])


@pytest.mark.parametrize("case", ["slots bool", "slots uint8", "slots float", "slots int16", "v_cache of fewer slots",
                                  "k of other heads", "k of other D", "k 2-D", "v of fewer rows", "k_cache FP8"])
@pytest.mark.parametrize("backend", ["native", "auto"])
def test_slots_and_shapes_no_provider_can_write_are_refused_by_the_reference(case, backend):
    """Slots torch would read as a mask or cannot index by, a V cache of fewer slots and rows that do not fit the
    cache, which the reference met with a raw torch error (IndexError, RuntimeError) or a mask, are refused
    naming the operand, before anything is written; so is an FP8 cache, which the reference cast to without
    DESIGN 3's clamp (NaN past ±448 on the GPU image's torch 2.11), and `auto` ran it there."""
    make, field, _ = BAD[case]
    args = make(*_ops())
    with ops.use_backend(backend), pytest.raises(InputError, match=rf"^{field}="):
        reshape_and_cache(*args)
    assert _untouched(args[2]) and _untouched(args[3])


def test_the_reference_takes_what_only_the_kernel_refuses():
    """An fp64 cache, strided caches (along D; the halves of a [blocks, 2, block_size, ...] K|V cache), a
    V cache of other blocks but as many slots, one row broadcast to every slot, int k, k strided along D, one 0-D
    slot: the reference writes them as torch's indexed assignment
    does (under `auto` the op falls back to it)."""
    k, v, kc, vc, slots = _ops()
    ref = reshape_and_cache.reference

    def want(x, cache, s):
        w = cache.clone()
        w.view(-1, *cache.shape[2:])[s] = x.to(cache.dtype)
        return w

    def check(k, v, kc, vc, s=slots):   # contiguous caches: compared as bytes, NaN poison included
        wk, wv = want(k, kc, s), want(v, vc, s)
        ref(k, v, kc, vc, s)
        assert torch.equal(kc.view(torch.uint8), wk.view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8), wv.view(torch.uint8))

    check(k, v, kc.double(), vc.clone())
    strided = nan_cache(2, 4, 2, 16, torch.float32)[..., ::2]
    ref(k, v, strided, vc.clone(), slots)
    assert torch.equal(strided.reshape(8, 2, 8)[slots], k)
    check(k, v, kc.clone(), vc.clone().view(4, 2, 1, 4))
    check(k[:1], v, kc.clone(), vc.clone())
    check(k.int(), v, kc.clone(), vc.clone())
    check(torch.cat([k, k], -1)[..., ::2], v, kc.clone(), vc.clone())
    check(k[0], v[0], kc.clone(), vc.clone(), slots[0])
    # FlashInfer's [blocks, K|V, block_size, heads, D] cache: its halves cannot be viewed as rows of slots, and
    # the reference used to meet V's with a raw torch error after writing K's
    kv = nan_cache(2, 2 * 4, 2, 8, torch.float32).view(2, 2, 4, 2, 8)
    ref(k, -k, kv[:, 0], kv[:, 1], slots)
    for half, rows in ((kv[:, 0], k), (kv[:, 1], -k)):
        assert torch.equal(bits(half), bits(want(rows, kc, slots)))
    with ops.use_backend("auto"):
        kc2 = kc.double()
        reshape_and_cache(k[:1], v, kc2, vc.clone(), slots)
        assert torch.equal(kc2.view(8, 2, 8)[slots], k[:1].double().expand(3, 2, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads,D,block_size", [(2, 256, 16), (8, 128, 64), (1, 576, 64)])
@pytest.mark.parametrize("N", [1, 32, 256])
@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_gpu_matches_reference(src_dtype, cache_dtype, N, heads, D, block_size):
    gen = torch.Generator(device="cuda").manual_seed(N + D)
    blocks = 1024
    k = torch.randn(N, heads, D, device="cuda", generator=gen).to(src_dtype)
    v = torch.randn(N, heads, D, device="cuda", generator=gen).to(src_dtype)
    slots = torch.randperm(blocks * block_size, device="cuda", generator=gen)[:N]
    check(k, v, nan_cache(blocks, block_size, heads, D, cache_dtype, "cuda"),
          nan_cache(blocks, block_size, heads, D, cache_dtype, "cuda"), slots)
