"""RMSNorm's Triton provider against its reference (DESIGN 4): odd widths, every dtype, w and 1 + w, the fused
residual add; outputs poisoned with NaN so that an unwritten element fails."""

from __future__ import annotations

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import ConfigError, InputError
from mtpfactory.kernels.rms_norm import rms_norm, rms_norm_triton
from backend_refusal import assert_overlap_refused
from norm_cases import NORM_CASES, assert_norm_matches as assert_matches, bad_norm_operands

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (leading dims, H): H in {1, 7, 64, 130}, rows in {1, 5, 33}, and a 3-D input.
SHAPES = [((1,), 1), ((5,), 7), ((33,), 64), ((1,), 130), ((2, 3), 130)]


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("lead,H", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_matches_reference(dtype, lead, H, zero_centred):
    gen = torch.Generator().manual_seed(H * 7 + len(lead))
    x = (3 * torch.randn(*lead, H, generator=gen)).to(dtype)
    w = (0.5 * torch.randn(H, generator=gen)).to(dtype)
    out = poisoned(x)
    with ops.use_backend("triton"):
        y = rms_norm(x, w, 1e-6, zero_centred, out=out)
    assert y is out
    assert_matches(y, rms_norm.reference(x, w, 1e-6, zero_centred))


@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("lead,H", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_residual_matches_reference(dtype, lead, H, zero_centred):
    gen = torch.Generator().manual_seed(H * 11 + len(lead))
    x = torch.randn(*lead, H, generator=gen).to(dtype)
    res = (4 * torch.randn(*lead, H, generator=gen)).to(dtype)
    w = torch.randn(H, generator=gen).to(dtype)
    out, res_out = poisoned(x), poisoned(x)
    with ops.use_backend("triton"):
        y, s = rms_norm(x, w, 1e-5, zero_centred, res, out=out, residual_out=res_out)
    want_y, want_s = rms_norm.reference(x, w, 1e-5, zero_centred, res)
    # The sum is one add rounded to x's dtype in both: exact.
    assert s is res_out and torch.equal(s, want_s)
    # Normalizing the unrounded sum instead would differ in about half the elements: assert_matches allows 1%.
    assert_matches(y, want_y)


def test_eps_and_a_weight_of_another_dtype():
    """eps comparable to mean(x^2) (it must enter the sum), and an fp32 weight on a bf16 input."""
    gen = torch.Generator().manual_seed(3)
    x = (1e-3 * torch.randn(5, 130, generator=gen)).to(torch.bfloat16)
    w = torch.randn(130, generator=gen)
    with ops.use_backend("triton"):
        y = rms_norm(x, w, 1e-6, True, out=poisoned(x))
    assert_matches(y, rms_norm.reference(x, w, 1e-6, True))


def test_dispatch_allocates_and_refuses_what_it_cannot_serve():
    x = torch.randn(4, 64)
    w = torch.randn(64)
    with ops.use_backend("triton"):
        assert_matches(rms_norm(x, w, 1e-6, False), rms_norm.reference(x, w, 1e-6, False))
        with pytest.raises(ConfigError, match="rms_norm"):
            rms_norm(x.t(), w[:4], 1e-6, False)  # not contiguous


def test_out_means_the_same_on_every_provider():
    """`out` / `residual_out` are part of the op, not of one provider: the reference writes them and returns
    them too, so a call that falls back to it (`auto` on the CPU; a non-contiguous `out`, which the Triton
    kernel cannot write) returns what it returns without them; an `out` of another shape is refused by both,
    writing nothing."""
    gen = torch.Generator().manual_seed(4)
    x, res = (torch.randn(3, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(64, generator=gen).to(torch.bfloat16)
    want_y, want_s = rms_norm.reference(x, w, 1e-6, True, res)
    out, res_out = poisoned(x), poisoned(x)
    with ops.use_backend("auto"):                                      # the CPU: the reference
        y, s = rms_norm(x, w, 1e-6, True, res, out=out, residual_out=res_out)
    assert y is out and s is res_out and torch.equal(y, want_y) and torch.equal(s, want_s)
    strided = torch.full((64, 3), float("nan"), dtype=torch.bfloat16).T
    assert rms_norm.reference(x, w, 1e-6, True, out=strided) is strided
    assert torch.equal(strided, rms_norm.reference(x, w, 1e-6, True))
    for field, kw in (("out", dict(out=strided)), ("residual_out", dict(residual_out=strided))):
        with ops.use_backend("triton"), pytest.raises(ConfigError,
                                                      match=rf"rms_norm .*it refuses {field}=.*contiguous"):
            rms_norm(x, w, 1e-6, True, res, **kw)
    for backend in ("native", "triton"):
        wrong = torch.full((3, 32), float("nan"), dtype=torch.bfloat16)
        with ops.use_backend(backend), pytest.raises(InputError, match=r"out='bfloat16 \[3, 32\] on cpu"):
            rms_norm(x, w, 1e-6, True, out=wrong)
        assert wrong.isnan().all()
    # a residual_out with no residual would stay unwritten (there is no sum): refused by both, nothing written
    out, res_out = poisoned(x), poisoned(x)
    for call in (rms_norm.reference, rms_norm_triton):
        with pytest.raises(InputError, match=r"^residual_out=.*only with residual.*pass the residual"):
            call(x, w, 1e-6, True, out=out, residual_out=res_out)
    with ops.use_backend("triton"):
        assert not rms_norm.providers["triton"].supports(x, w, 1e-6, True, out=out, residual_out=res_out)
    assert out.isnan().all() and res_out.isnan().all()


@pytest.mark.parametrize("out_is, residual_out_is", [("x", None), ("x", "residual"), ("residual", "x")])
def test_out_and_residual_out_in_place_on_x_or_the_residual_are_taken(out_is, residual_out_is):
    """Program r reads its whole row of x and of the residual before it writes that row of the norm and the sum,
    and no other program reads the row: `out` and `residual_out` may be x or the residual themselves, and the
    Triton provider in place gives the reference's answer."""
    gen = torch.Generator().manual_seed(8)
    x, res = (torch.randn(3, 40, generator=gen).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(40, generator=gen).to(torch.bfloat16)
    want_y, want_s = rms_norm.reference(x, w, 1e-6, True, res)
    operands = {"x": x, "residual": res, None: None}
    with ops.use_backend("triton"):
        y, s = rms_norm(x, w, 1e-6, True, res, out=operands[out_is], residual_out=operands[residual_out_is])
    assert y is operands[out_is] and (residual_out_is is None or s is operands[residual_out_is])
    assert torch.equal(s, want_s)
    assert_matches(y, want_y)


@pytest.mark.parametrize("field, shares", [("out", "x"), ("residual_out", "residual"), ("out", "weight")])
def test_an_out_sharing_memory_with_an_input_but_in_place_is_left_to_the_reference(field, shares):
    """`out` or `residual_out` laid one element past the start of x or the residual (program 0 wrote into row 1
    before its program read it), or over the weight (which every program reads): the provider refuses it naming
    both, writing nothing; `auto` runs the reference, which computes the norm and the sum before it writes
    either (it wrote the sum first: torch.add refused a residual_out partly over the residual)."""
    m, h = 3, 40
    buf = torch.randn(3 * m * h + 1, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x, res, w = buf[: m * h].view(m, h), buf[m * h: 2 * m * h].view(m, h), buf[2 * m * h: 2 * m * h + h]
    over = {"x": buf[1: m * h + 1], "residual": buf[m * h + 1: 2 * m * h + 1], "weight": buf[2 * m * h: 3 * m * h]}
    kw = {field: over[shares].view(m, h)}
    want_y, want_s = rms_norm.reference(x.clone(), w.clone(), 1e-6, True, res.clone())
    assert_overlap_refused(rms_norm, field, shares, x, w, 1e-6, True, res, **kw)
    with pytest.raises(InputError, match=f"^{field}='memory shared with {shares}'"):
        rms_norm_triton(x, w, 1e-6, True, res, **kw)
    with ops.use_backend("auto"):
        y, s = rms_norm(x, w, 1e-6, True, res, **kw)
    assert torch.equal(y, want_y) and torch.equal(s, want_s)


@pytest.mark.parametrize("case", NORM_CASES)
def test_operands_the_kernel_cannot_take_are_refused_by_the_provider_as_by_the_predicate(case):
    """One rule (`rms_norm_refusal`) for the predicate and `rms_norm_triton` called directly (the fused LM head
    op, scripts): each operand it cannot take is refused by both, naming the operand, and nothing is written."""
    gen = torch.Generator().manual_seed(6)
    x, res = (torch.randn(3, 48, generator=gen).to(torch.bfloat16) for _ in range(2))
    (xi, wi, ri), field, message = bad_norm_operands(x, torch.randn(48, generator=gen).to(torch.bfloat16), res)[case]
    out, res_out = poisoned(x), poisoned(x)
    with ops.use_backend("triton"):
        assert not rms_norm.providers["triton"].supports(xi, wi, 1e-6, True, ri)
        with pytest.raises(InputError, match=rf"^{field}=.*{message}"):
            rms_norm_triton(xi, wi, 1e-6, True, ri, out=out, residual_out=None if ri is None else res_out)
    assert out.isnan().all() and res_out.isnan().all()


def test_a_residual_of_another_dtype_or_shape_is_refused_by_every_provider():
    """The norm and the sum come back in x's dtype from every provider, so a residual of another dtype (bf16 x,
    fp32 residual: the reference used to promote and return both in fp32, the kernel bf16) or shape (broadcast)
    is refused naming it: by the reference (`native`, and `auto`, which falls back to it on the CPU) as by the
    Triton provider (called directly: under `triton` the op's predicate says no)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(64, generator=gen).to(torch.bfloat16)
    res = torch.randn(3, 64, generator=gen)
    for bad in (res, res[0].to(torch.bfloat16)):
        for backend in ("native", "auto"):
            with ops.use_backend(backend), pytest.raises(InputError, match=r"^residual=.*x's shape and dtype"):
                rms_norm(x, w, 1e-6, True, bad)
        with ops.use_backend("triton"), pytest.raises(InputError, match=r"^residual=.*x's shape and dtype"):
            rms_norm_triton(x, w, 1e-6, True, bad)
    y, s = rms_norm.reference(x, w, 1e-6, True, res.to(torch.bfloat16))
    assert y.dtype == s.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("H", [2048, 5120, 7168])
@pytest.mark.parametrize("M", [1, 32, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_reference(dtype, M, H, zero_centred):
    gen = torch.Generator(device="cuda").manual_seed(M + H)
    x = torch.randn(M, H, device="cuda", generator=gen).to(dtype)
    res = torch.randn(M, H, device="cuda", generator=gen).to(dtype)
    w = (0.1 * torch.randn(H, device="cuda", generator=gen)).to(dtype)
    with ops.use_backend("triton"):
        y = rms_norm(x, w, 1e-6, zero_centred, out=poisoned(x))
        y2, s2 = rms_norm(x, w, 1e-6, zero_centred, res, out=poisoned(x), residual_out=poisoned(x))
    assert_matches(y, rms_norm.reference(x, w, 1e-6, zero_centred))
    want_y2, want_s2 = rms_norm.reference(x, w, 1e-6, zero_centred, res)
    assert torch.equal(s2, want_s2)
    assert_matches(y2, want_y2)


def test_an_eps_that_is_not_a_number_is_left_to_the_reference():
    """eps as a 0-D tensor: the reference adds it as torch does, while the kernel, which takes eps as a number,
    met it with a raw Triton error (a pointer where a float goes; on a GPU under `auto`, a CUDA eps reached the
    kernel). The provider refuses it by name: `auto` runs the reference, `triton` says why."""
    x, w = torch.randn(2, 16), torch.randn(16)
    eps = torch.tensor(1e-6)
    with ops.use_backend("triton"):
        with pytest.raises(ConfigError, match=r"op rms_norm has no triton provider .*it refuses eps="):
            rms_norm(x, w, eps, False)
        with pytest.raises(InputError, match=r"^eps=.*a Python float"):
            rms_norm_triton(x, w, eps, False)
    with ops.use_backend("auto"):
        assert torch.equal(rms_norm(x, w, eps, False), rms_norm.reference(x, w, 1e-6, False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("out_is, residual_out_is", [("x", "residual"), ("residual", "x")])
@pytest.mark.parametrize("M, H", [(32, 2048), (512, 7168)])
def test_gpu_in_place_equals_out_of_place(M, H, out_is, residual_out_is):
    """The in-place calls `_outs_overlap_refusal` takes, where all of a row's warps run at once: bit for bit the
    provider's answer into buffers of their own."""
    gen = torch.Generator(device="cuda").manual_seed(M)
    x, res = (torch.randn(M, H, device="cuda", generator=gen).bfloat16() for _ in range(2))
    w = (0.1 * torch.randn(H, device="cuda", generator=gen)).bfloat16()
    with ops.use_backend("triton"):
        want_y, want_s = rms_norm(x, w, 1e-6, True, res, out=poisoned(x), residual_out=poisoned(x))
        operands = {"x": x, "residual": res}
        y, s = rms_norm(x, w, 1e-6, True, res, out=operands[out_is], residual_out=operands[residual_out_is])
    assert y is operands[out_is] and s is operands[residual_out_is]
    assert torch.equal(y, want_y) and torch.equal(s, want_s)
