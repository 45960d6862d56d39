"""NeoX RoPE's Triton provider against its reference (DESIGN 4): partial and full rotation, odd head sizes,
strided inputs (a slice of a fused QKV), large positions, every dtype; outputs poisoned with NaN."""

from __future__ import annotations

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import InputError
from mtpfactory.kernels.rope import rope_inv_freq, rope_neox, rope_neox_refusal, rope_neox_triton
from backend_refusal import assert_backend_refuses, assert_overlap_refused

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


def test_in_place_on_a_slice_of_a_fused_projection():
    """`out` x itself, x the q heads of a fused QKV buffer: each program reads both halves of its heads' rotated
    dims before it writes either, and each pass-through element before it writes it, and no other program reads
    those heads; the provider takes it and gives the reference's answer, leaving the K and V heads as they were."""
    gen = torch.Generator().manual_seed(10)
    qkv = torch.randn(4, 3 + 2 * 2, 13, generator=gen).to(torch.bfloat16)
    q = qkv[:, :3]
    positions, inv_freq = torch.tensor([0, 3, 77, 4096]), rope_inv_freq(8, 10_000.0)
    want, kv = rope_neox.reference(q, positions, inv_freq), qkv[:, 3:].clone()
    with ops.use_backend("triton"):
        assert rope_neox(q, positions, inv_freq, out=q) is q
    assert_matches(q, want, want, 8)
    assert torch.equal(qkv[:, 3:], kv)


@pytest.mark.parametrize("shares", ["x", "inv_freq"])
def test_an_out_sharing_memory_with_an_input_but_in_place_is_left_to_the_reference(shares):
    """`out` one token past x (program 0 wrote token 1's row before its program read it), or starting over
    inv_freq (program 0 wrote over it before the others read it): the provider refuses it naming both, writing
    nothing; `auto` runs the reference, which rotates every row before it writes."""
    n, heads, d = 3, 2, 12
    buf = torch.randn((n + 1) * heads * d, generator=torch.Generator().manual_seed(11))
    positions = torch.tensor([5, 9, 100])
    if shares == "x":
        x, out, inv_freq = buf[: n * heads * d], buf[heads * d:], rope_inv_freq(8, 10_000.0)
    else:
        x, out, inv_freq = torch.randn(n * heads * d), buf[: n * heads * d], buf[:4]
        inv_freq.copy_(rope_inv_freq(8, 10_000.0))
    x, out = x.view(n, heads, d), out.view(n, heads, d)
    want = rope_neox.reference(x.clone(), positions, inv_freq.clone())
    assert_overlap_refused(rope_neox, "out", shares, x, positions, inv_freq, out=out)
    with pytest.raises(InputError, match=f"^out='memory shared with {shares}'"):
        rope_neox_triton(x, positions, inv_freq, out=out)
    with ops.use_backend("auto"):
        assert torch.equal(rope_neox(x, positions, inv_freq, out=out), want)


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_out_whose_heads_lie_further_apart_than_a_row(backend):
    """`out` a [N, heads, D] view of a poisoned [heads, N, D] buffer: a head's row lies N * D elements past the
    previous head's, not D (the fused-QKV `out` above has heads exactly D apart, so a kernel stepping heads by
    D passed it). Partial rotation with an odd tail, so the pass-through stores step by the same stride."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 3, 13, generator=gen).to(torch.bfloat16)
    positions, inv_freq = torch.tensor([0, 3, 77, 4096, 9]), rope_inv_freq(8, 10_000.0)
    buf = torch.full((3, 5, 13), float("nan"), dtype=torch.bfloat16)
    out = buf.transpose(0, 1)
    assert out.stride(1) == 5 * 13
    with ops.use_backend(backend):
        assert rope_neox(x, positions, inv_freq, out=out) is out
    assert_matches(out, rope_neox.reference(x, positions, inv_freq), x, 8)


def _ops():
    """x [3, 2, 12] fp32, positions [3] int64, inv_freq for rotary_dim 8: operands the kernel takes."""
    return torch.randn(3, 2, 12, generator=torch.Generator().manual_seed(8)), torch.arange(3), rope_inv_freq(8, 1e4)


def _huge(shape, d_inv):
    """x of `shape` (zeros, stride 0 but along D), positions [N], inv_freq of `d_inv` entries: past a grid limit
    without the memory."""
    return (torch.zeros(1, 1, shape[2]).expand(*shape), torch.zeros(1, dtype=torch.int64).expand(shape[0]),
            rope_inv_freq(2 * d_inv, 1e4))


# case: (x, positions, inv_freq) from `_ops()`, the field refused, what its message says it allows
BAD = {
    "x 2-D": (lambda x, p, f: (x[:, 0], p, f), "x", r"a bf16, fp16 or fp32 \[N, heads, D\]"),
    "x 4-D": (lambda x, p, f: (x[None], p, f), "x", r"\[N, heads, D\]"),
    "x fp64": (lambda x, p, f: (x.double(), p, f), "x", "bf16, fp16 or fp32"),
    "x strided along D": (lambda x, p, f: (torch.cat([x, x], -1)[..., ::2], p, f), "x", "unit stride along D"),
    "x D past a block": (lambda x, p, f: (torch.zeros(1, 1, 2**20 + 2), p[:1], f), "x", "D <= 1048576"),
    "x N past the grid": (lambda x, p, f: _huge((2**31, 1, 2), 1), "x", "N <= 2147483647"),
    "x heads past the grid": (lambda x, p, f: _huge((1, 65536, 8192), 4096), "x", "at most 65535 programs of 1"),
    "positions [N + 1]": (lambda x, p, f: (x, torch.arange(4), f), "positions", r"\[N\] = \[3\] tensor, one"),
    "positions [1]": (lambda x, p, f: (x, p[:1], f), "positions", r"int32 or int64 \[N\] = \[3\]"),
    "positions 0-D": (lambda x, p, f: (x, p[0], f), "positions", r"\[N\] = \[3\]"),
    "positions 2-D": (lambda x, p, f: (x, p[:, None], f), "positions", r"\[N\] = \[3\]"),
    "positions float": (lambda x, p, f: (x, p.float(), f), "positions", "int32 or int64"),
    "positions int16": (lambda x, p, f: (x, p.short(), f), "positions", "int32 or int64"),
    "positions elsewhere": (lambda x, p, f: (x, p.to("meta"), f), "positions", "on x's device, cpu"),
    "inv_freq 2-D": (lambda x, p, f: (x, p, f[None]), "inv_freq", r"rotary_dim <= D = 12"),
    "inv_freq rotary_dim > D": (lambda x, p, f: (x, p, rope_inv_freq(14, 1e4)), "inv_freq", "rotary_dim <= D = 12"),
    "inv_freq fp64": (lambda x, p, f: (x, p, f.double()), "inv_freq", "bf16, fp16 or fp32"),
    "inv_freq elsewhere": (lambda x, p, f: (x, p, f.to("meta")), "inv_freq", "on x's device, cpu"),
}


def _poisoned_like(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, what to check is still NaN): x's shape and dtype, one NaN seen through stride 0 where x is huge."""
    if x.numel() <= 2**16:
        out = torch.full(x.shape, float("nan"), dtype=x.dtype)
        return out, out
    one = torch.full((1,) * x.dim(), float("nan"), dtype=x.dtype)
    return one.expand(x.shape), one


@pytest.mark.parametrize("case", BAD)
def test_operands_the_kernel_cannot_take_are_refused_by_the_predicate_the_provider_and_the_backend(case):
    """One rule (`rope_neox_refusal`): the predicate says no, `rope_neox_triton` called directly raises it naming
    the operand and writes nothing, and an explicit `runtime.backend=triton` says which operand it refuses."""
    make, field, allowed = BAD[case]
    x, positions, inv_freq = make(*_ops())
    out, poison = _poisoned_like(x)
    assert rope_neox_refusal(x, positions, inv_freq).field == field
    with ops.use_backend("triton"):
        assert not rope_neox.providers["triton"].supports(x, positions, inv_freq, out)
        with pytest.raises(InputError, match=rf"^{field}=.*{allowed}"):
            rope_neox_triton(x, positions, inv_freq, out=out)
        assert_backend_refuses(rope_neox, field, x, positions, inv_freq, out=out)
    assert poison.isnan().all()


@pytest.mark.parametrize("case", ["x 2-D", "positions [N + 1]", "positions 0-D", "positions 2-D", "inv_freq 2-D",
                                  "inv_freq rotary_dim > D"])
@pytest.mark.parametrize("backend", ["native", "auto"])
def test_shapes_no_provider_can_rotate_are_refused_by_the_reference(case, backend):
    """The shapes that do not agree, which the reference met with a raw torch error (IndexError, RuntimeError),
    are refused naming the operand, before anything is written."""
    make, field, _ = BAD[case]
    x, positions, inv_freq = make(*_ops())
    out = torch.full(x.shape, float("nan"))
    with ops.use_backend(backend), pytest.raises(InputError, match=rf"^{field}="):
        rope_neox(x, positions, inv_freq, out=out)
    assert out.isnan().all()


def test_the_reference_takes_what_only_the_kernel_refuses():
    """One position for all tokens, float positions, fp64 x and inv_freq, x strided along D, leading dims: the
    reference rotates them as it rotates their plain form (under `auto` the op falls back to it)."""
    x, positions, inv_freq = _ops()
    ref = rope_neox.reference
    want = ref(x, positions, inv_freq)
    assert torch.equal(ref(x, positions[:1], inv_freq), ref(x, positions[:1].expand(3), inv_freq))
    assert torch.equal(ref(x, positions.float(), inv_freq), want)
    torch.testing.assert_close(ref(x.double(), positions, inv_freq.double()), want.double(), rtol=1e-6, atol=1e-6)
    assert torch.equal(ref(torch.cat([x, x], -1)[..., ::2], positions, inv_freq),
                       ref(torch.cat([x, x], -1)[..., ::2].contiguous(), positions, inv_freq))
    assert torch.equal(ref(torch.stack([x, 2 * x]), positions, inv_freq), torch.stack([want, ref(2 * x, positions,
                                                                                                  inv_freq)]))
    with ops.use_backend("auto"):
        assert torch.equal(rope_neox(x, positions[:1], inv_freq), ref(x, positions[:1], inv_freq))


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


@pytest.mark.gpu_memory
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_out_offsets_past_int32():
    """out= a view of [D, N, heads] as [N, heads, D], with (D - 1) * N * heads > 2^31: the kernel's offsets along D
    (d * N * heads) pass int32's range, so they must be computed in int64 (they wrapped before). Partial rotation,
    so the pass-through dims' stores are covered too."""
    N, heads, D, rd = 2**19, 66, 64, 32
    assert (D - 1) * N * heads >= 2**31
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(N, heads, D, device="cuda", generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 131_072, (N,), device="cuda", generator=gen)
    inv_freq = rope_inv_freq(rd, 1e6).cuda()
    out = torch.full((D, N, heads), float("nan"), dtype=torch.bfloat16, device="cuda").permute(1, 2, 0)
    with ops.use_backend("triton"):
        y = rope_neox(x, positions, inv_freq, out=out)
    assert y is out
    assert_matches(y, rope_neox.reference(x, positions, inv_freq), x, rd)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("N", [1, 32, 256])
def test_gpu_in_place_on_the_q_heads_of_a_fused_projection(N):
    """Qwen3-Next's q heads (16 of 256, 64 rotated) in a fused QKV buffer, out the q heads themselves: bit for bit
    the provider's answer into a buffer of its own, the K and V heads left as they were."""
    gen = torch.Generator(device="cuda").manual_seed(N)
    qkv = torch.randn(N, 16 + 2 * 2, 256, device="cuda", generator=gen).bfloat16()
    q, kv = qkv[:, :16], qkv[:, 16:].clone()
    positions = torch.randint(0, 131_072, (N,), device="cuda", generator=gen)
    inv_freq = rope_inv_freq(64, 1e7).cuda()
    with ops.use_backend("triton"):
        want = rope_neox(q, positions, inv_freq, out=torch.full_like(q, float("nan")))
        assert rope_neox(q, positions, inv_freq, out=q) is q
    assert torch.equal(q, want) and torch.equal(qkv[:, 16:], kv)
