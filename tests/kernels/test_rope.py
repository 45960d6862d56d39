"""NeoX RoPE's Triton provider against its reference (DESIGN 4): partial and full rotation, odd head sizes,
strided inputs (a slice of a fused QKV), large positions, every dtype; outputs poisoned with NaN."""

from __future__ import annotations

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import InputError
from mtpfactory.kernels.rope import rope_inv_freq, rope_neox

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (N, heads, D, rotary_dim): full rotation of a tiny head, partial with odd D, a pass-through tail of one.
SHAPES = [(1, 1, 2, 2), (5, 3, 20, 8), (33, 2, 64, 64), (5, 4, 130, 32), (1, 5, 7, 6)]


def assert_matches(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, rd: int) -> None:
    """The kernel rounds where the reference's eager ops round (cos and sin, each product, the sum, all to x's
    dtype), and products of 16-bit values are exact in fp32: so it is bit-equal wherever its cos / sin
    round to the same value as torch's. The interpreter takes cos / sin from numpy, the GPU from libdevice,
    torch from SLEEF (CPU) or libdevice (CUDA): all within about an fp32 ulp, which moves a rounded 16-bit
    cos / sin by one ulp (<= eps / 2, since |cos| <= 1) only near a rounding boundary. Hence for 16-bit
    dtypes: the pass-through dims exactly equal; at most 1% of the rotated elements (at least one allowed)
    differ; and each by at most eps * max|x| (one ulp in each of the two products) plus one ulp of the result
    (rtol eps). Rounding once at the end instead of after each op misses in about a third of the elements.
    fp32 keeps the trig libraries' ulp: atol 4 fp32 ulps of max|x|, rtol 2 ulps."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any(), "an output element was left unwritten"
    eps = torch.finfo(want.dtype).eps
    xmax = x.float().abs().max().item()
    assert torch.equal(got[..., rd:], want[..., rd:])
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2 * eps, atol=4 * eps * xmax)
        return
    torch.testing.assert_close(got, want, rtol=eps, atol=eps * xmax)
    rot_got, rot_want = got[..., :rd], want[..., :rd]
    assert (rot_got != rot_want).sum() <= max(1, rot_want.numel() // 100)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, shape):
    N, heads, D, rd = shape
    gen = torch.Generator().manual_seed(N * 100 + D)
    x = (2 * torch.randn(N, heads, D, generator=gen)).to(dtype)
    positions = torch.randint(0, 100_000, (N,), generator=gen)  # angles up to 1e5 rad: range reduction counts
    inv_freq = rope_inv_freq(rd, 10_000.0)
    out = torch.full_like(x, float("nan"))
    with ops.use_backend("triton"):
        y = rope_neox(x, positions, inv_freq, out=out)
    assert y is out
    assert_matches(y, rope_neox.reference(x, positions, inv_freq), x, rd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_input_and_int32_positions(dtype):
    """q as a slice of a fused [N, q_heads + 2 * kv_heads, D] projection: the heads' and tokens' strides are
    not the contiguous ones."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(5, 3 + 2 * 2, 24, generator=gen).to(dtype)
    q, k = qkv[:, :3], qkv[:, 3:5]
    positions = torch.tensor([0, 1, 7, 4096, 131_071], dtype=torch.int32)
    inv_freq = rope_inv_freq(16, 1e6)
    with ops.use_backend("triton"):
        for x in (q, k):
            assert not x.is_contiguous()
            y = rope_neox(x, positions, inv_freq, out=torch.full(x.shape, float("nan"), dtype=dtype))
            assert_matches(y, rope_neox.reference(x, positions, inv_freq), x, 16)


def test_dispatch_allocates():
    x = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    positions, inv_freq = torch.arange(3), rope_inv_freq(8, 10_000.0)
    with ops.use_backend("triton"):
        y = rope_neox(x, positions, inv_freq)
    assert_matches(y, rope_neox.reference(x, positions, inv_freq), x, 8)


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_strided_positions_and_out_which_every_provider_takes(backend):
    """positions a column of a wider tensor; `out` the q part of a fused [N, heads + 2, D] buffer, written by
    its strides by the Triton provider and the reference alike; an `out` of another shape or dtype refused."""
    x = torch.randn(3, 2, 12, generator=torch.Generator().manual_seed(6))
    positions = torch.tensor([[5, 0], [9, 0], [100, 0]])[:, 0]
    inv_freq = rope_inv_freq(8, 10_000.0)
    fused = torch.full((3, 4, 12), float("nan"))
    with ops.use_backend(backend):
        y = rope_neox(x, positions, inv_freq, out=fused[:, 1:3])
        assert_matches(y, rope_neox.reference(x, positions, inv_freq), x, 8)
        assert fused[:, [0, 3]].isnan().all()
        for bad in (torch.empty(3, 2, 12, dtype=torch.bfloat16), torch.empty(3, 3, 12)):
            with pytest.raises(InputError, match="out="):
                rope_neox(x, positions, inv_freq, out=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads,D,rd,theta", [(16, 256, 64, 1e7), (2, 256, 64, 1e7), (32, 128, 64, 1e6),
                                              (128, 64, 64, 1e4)])
@pytest.mark.parametrize("N", [1, 32, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_reference(dtype, N, heads, D, rd, theta):
    """Qwen3-Next (partial 0.25 of 256, q and k), GLM (64 of 128), DeepSeek's rope part (64 of 64)."""
    gen = torch.Generator(device="cuda").manual_seed(N + heads)
    x = torch.randn(N, heads, D, device="cuda", generator=gen).to(dtype)
    positions = torch.randint(0, 131_072, (N,), device="cuda", generator=gen)
    inv_freq = rope_inv_freq(rd, theta).cuda()
    with ops.use_backend("triton"):
        y = rope_neox(x, positions, inv_freq, out=torch.full_like(x, float("nan")))
    assert_matches(y, rope_neox.reference(x, positions, inv_freq), x, rd)
