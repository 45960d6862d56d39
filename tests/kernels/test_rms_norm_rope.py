"""The fused q / k norm and RoPE (`rms_norm_rope`) against its reference, the two ops' references one after the
other (DESIGN 4): q as a slice of q_proj's q|gate rows, partial and full rotation, odd head sizes, both norms,
every dtype; outputs poisoned with NaN; in place; what the provider refuses, refused by the predicate too."""

from __future__ import annotations

import re

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import InputError
from mtpfactory.kernels.rms_norm import rms_norm
from mtpfactory.kernels.rms_norm_rope import rms_norm_rope, rms_norm_rope_refusal
from mtpfactory.kernels.rope import rope_inv_freq, rope_neox
from backend_refusal import assert_backend_refuses, assert_overlap_refused

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (N, heads, D, rotary_dim): one head of 2 dims all rotated, partial with an odd tail, full, Qwen3-Next's q and k
# heads at a quarter rotated (small N)
SHAPES = [(1, 1, 2, 2), (5, 3, 20, 8), (2, 4, 64, 64), (3, 5, 7, 6), (2, 16, 256, 64), (3, 2, 256, 64)]


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernel rounds where the two ops' references round (the norm to x's dtype; cos, sin, each product and
    their sum), but sums each row's squares in another order than torch's mean, and its cos / sin come from
    another library (numpy under the interpreter, libdevice on the GPU, SLEEF for torch on the CPU): each a few
    fp32 ulps, which move a rounded 16-bit value by one ulp only near a rounding boundary. A normed element one
    ulp off moves the products it enters by at most an ulp each. Hence for 16-bit dtypes: at most 2% of the
    elements (at least one allowed) differ, each by at most 2 ulps of the largest output plus one ulp of itself
    (rtol eps); fp32: relative 2e-6 (16 ulps) and 8 ulps of the largest output. A wrong half, sign, weight
    (w against 1 + w) or row misses by far more."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any(), "an output element was left unwritten"
    eps = torch.finfo(want.dtype).eps
    ymax = want.float().abs().max().item()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=8 * eps * ymax)
        return
    torch.testing.assert_close(got, want, rtol=eps, atol=2 * eps * ymax)
    assert (got != want).sum() <= max(1, want.numel() // 50)


def _operands(n, heads, d, rd, dtype, seed):
    """q [n, heads, d] as the first half of each head of a poisoned-free [n, heads, 2d] q|gate buffer (strided),
    its norm weight, positions up to 10^5 (the trig's range reduction counts) and inv_freq for rotary_dim rd."""
    gen = torch.Generator().manual_seed(seed)
    qg = (2 * torch.randn(n, heads, 2 * d, generator=gen)).to(dtype)
    weight = (0.5 * torch.randn(d, generator=gen)).to(dtype)
    positions = torch.randint(0, 100_000, (n,), generator=gen)
    return qg[..., :d], weight, positions, rope_inv_freq(rd, 1e6)


def test_the_reference_is_the_two_ops_one_after_the_other():
    q, w, positions, inv_freq = _operands(3, 2, 20, 8, torch.bfloat16, 1)
    want = rope_neox.reference(rms_norm.reference(q, w, 1e-6, True), positions, inv_freq)
    assert torch.equal(rms_norm_rope.reference(q, w, 1e-6, True, positions, inv_freq), want)


@pytest.mark.parametrize("zero_centred", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_on_a_slice_of_the_q_gate_rows(dtype, shape, zero_centred):
    n, heads, d, rd = shape
    q, w, positions, inv_freq = _operands(n, heads, d, rd, dtype, n * 100 + d)
    assert not q.is_contiguous() or heads * n == 1
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    with ops.use_backend("triton"):
        y = rms_norm_rope(q, w, 1e-6, zero_centred, positions, inv_freq, out=out)
    assert y is out
    assert_matches(y, rms_norm_rope.reference(q, w, 1e-6, zero_centred, positions, inv_freq))


def test_dispatch_allocates_contiguous_and_takes_int32_positions():
    q, w, positions, inv_freq = _operands(4, 3, 24, 16, torch.bfloat16, 2)
    with ops.use_backend("triton"):
        y = rms_norm_rope(q, w, 1e-5, True, positions.int(), inv_freq)
    assert y.is_contiguous()
    assert_matches(y, rms_norm_rope.reference(q, w, 1e-5, True, positions, inv_freq))


def test_in_place_on_a_slice_of_the_q_gate_rows_leaves_the_gates():
    """`out` x itself: each program reads its heads' rows whole before it writes them, and no other program reads
    them; the gates beside them stay as they were."""
    q, w, positions, inv_freq = _operands(3, 4, 20, 8, torch.bfloat16, 3)
    want = rms_norm_rope.reference(q, w, 1e-6, True, positions, inv_freq)
    qg = q._base  # the q|gate rows q is a slice of
    assert qg.shape == (3, 4, 40)
    gates = qg[..., 20:].clone()
    with ops.use_backend("triton"):
        assert rms_norm_rope(q, w, 1e-6, True, positions, inv_freq, out=q) is q
    assert_matches(q, want)
    assert torch.equal(qg[..., 20:], gates)


@pytest.mark.parametrize("shares", ["x", "weight"])
def test_an_out_sharing_memory_with_an_input_but_in_place_is_left_to_the_reference(shares):
    """`out` one token past x (program 0 would write token 1's rows before its program read them), or over the
    weight (which every program reads): refused naming both, nothing written; `auto` runs the reference."""
    n, heads, d = 3, 2, 12
    buf = torch.randn((n + 1) * heads * d + d, generator=torch.Generator().manual_seed(4))
    positions, inv_freq = torch.tensor([5, 9, 100]), rope_inv_freq(8, 1e4)
    if shares == "x":
        x, out, w = buf[: n * heads * d], buf[heads * d: (n + 1) * heads * d], torch.randn(d)
    else:
        x, out, w = torch.randn(n * heads * d), buf[: n * heads * d], buf[:d]
    x, out = x.view(n, heads, d), out.view(n, heads, d)
    want = rms_norm_rope.reference(x.clone(), w.clone(), 1e-6, True, positions, inv_freq)
    assert_overlap_refused(rms_norm_rope, "out", shares, x, w, 1e-6, True, positions, inv_freq, out=out)
    with ops.use_backend("auto"):
        assert torch.equal(rms_norm_rope(x, w, 1e-6, True, positions, inv_freq, out=out), want)


def _ops():
    """x [3, 2, 12] fp32, weight [12], positions [3] int64, inv_freq for rotary_dim 8: operands the kernel takes."""
    gen = torch.Generator().manual_seed(8)
    return torch.randn(3, 2, 12, generator=gen), torch.randn(12, generator=gen), torch.arange(3), rope_inv_freq(8, 1e4)


# case: a change to (x, weight, positions, inv_freq) of `_ops()`, the field refused, what its message says
BAD = {
    "x 4-D": (lambda x, w, p, f: (x[None], w, p, f), "x", r"\[N, heads, D\]"),
    "x fp64": (lambda x, w, p, f: (x.double(), w, p, f), "x", "bf16, fp16 or fp32"),
    "x strided along D": (lambda x, w, p, f: (torch.cat([x, x], -1)[..., ::2], w, p, f), "x", "unit stride along D"),
    "x D past a block": (lambda x, w, p, f: (torch.zeros(1, 1, 8194), torch.zeros(8194), p[:1], f), "x",
                         "D <= 8192"),
    "weight short": (lambda x, w, p, f: (x, w[:6], p, f), "weight", r"\[H\] = \[12\]"),
    "weight strided": (lambda x, w, p, f: (x, torch.stack([w, w], -1)[:, 0], p, f), "weight", "contiguous"),
    "weight elsewhere": (lambda x, w, p, f: (x, w.to("meta"), p, f), "weight", "on x's device, cpu"),
    "positions [1]": (lambda x, w, p, f: (x, w, p[:1], f), "positions", r"int32 or int64 \[N\] = \[3\]"),
    "positions float": (lambda x, w, p, f: (x, w, p.float(), f), "positions", "int32 or int64"),
    "positions elsewhere": (lambda x, w, p, f: (x, w, p.to("meta"), f), "positions", "on x's device, cpu"),
    "inv_freq rotary_dim > D": (lambda x, w, p, f: (x, w, p, rope_inv_freq(14, 1e4)), "inv_freq", "rotary_dim <= D"),
    "inv_freq fp64": (lambda x, w, p, f: (x, w, p, f.double()), "inv_freq", "bf16, fp16 or fp32"),
}


@pytest.mark.parametrize("case", BAD)
def test_operands_the_kernel_cannot_take_are_refused_by_the_predicate_the_provider_and_the_backend(case):
    """One rule (`rms_norm_rope_refusal`): the predicate says no, and an explicit `runtime.backend=triton` names
    the operand (or the contract's error, where the reference refuses it too); `auto` runs the reference where
    it takes the call, writing what it would."""
    make, field, allowed = BAD[case]
    x, w, positions, inv_freq = make(*_ops())
    why = rms_norm_rope_refusal(x, w, 1e-6, True, positions, inv_freq)
    assert isinstance(why, InputError) and why.field == field, why
    assert re.search(allowed, str(why)), str(why)
    assert not rms_norm_rope.providers["triton"].supports(x, w, 1e-6, True, positions, inv_freq)
    with ops.use_backend("triton"):
        assert_backend_refuses(rms_norm_rope, field, x, w, 1e-6, True, positions, inv_freq)
    if rms_norm_rope.contract(x, w, 1e-6, True, positions, inv_freq) is None and "meta" not in (
            str(w.device), str(positions.device)):
        with ops.use_backend("auto"):
            got = rms_norm_rope(x, w, 1e-6, True, positions, inv_freq)
        assert torch.equal(got, rms_norm_rope.reference(x, w, 1e-6, True, positions, inv_freq))


def test_an_eps_that_is_not_a_number_is_left_to_the_reference():
    """A 0-D tensor eps would reach the kernel as a pointer: the provider refuses it, `auto` runs the reference."""
    x, w, positions, inv_freq = _ops()
    eps = torch.tensor(1e-6)
    why = rms_norm_rope_refusal(x, w, eps, True, positions, inv_freq)
    assert isinstance(why, InputError) and why.field == "eps"
    with ops.use_backend("auto"):
        got = rms_norm_rope(x, w, eps, True, positions, inv_freq)
    assert torch.equal(got, rms_norm_rope.reference(x, w, 1e-6, True, positions, inv_freq))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 7, 32])
def test_gpu_matches_reference(dtype, n):
    """Qwen3-Next's q (16 heads of 256, a slice of the q|gate rows) and k (2 heads), a quarter of each rotated,
    compiled (libdevice's cos / sin against torch's CUDA ones, the FMA-free products)."""
    for heads in (16, 2):
        q, w, positions, inv_freq = (t.cuda() for t in _operands(n, heads, 256, 64, dtype, n + heads))
        out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
        with ops.use_backend("triton"):
            y = rms_norm_rope(q, w, 1e-6, True, positions, inv_freq, out=out)
        assert_matches(y, rms_norm_rope.reference(q, w, 1e-6, True, positions, inv_freq))
