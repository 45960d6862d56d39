"""reshape_and_cache's Triton provider against its reference (DESIGN 4). Exact: a cast to the cache dtype
rounds once to nearest even in both, so the caches must be bit-equal. The caches start all NaN: a written
slot must hold the rows, every other slot must still be NaN."""

from __future__ import annotations

import os

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import InputError
from mtpfactory.kernels.reshape_and_cache import reshape_and_cache

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
