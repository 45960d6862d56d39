"""SwiGLU's activation (`silu_mul`) against its reference, torch's silu then the product (DESIGN 4): gate and up
as columns of one stacked gate|up output, odd widths, every dtype; outputs poisoned with NaN; in place; what the
provider refuses, refused by the predicate too."""

from __future__ import annotations

import re

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import InputError
from mtpfactory.kernels.silu_mul import silu_mul, silu_mul_refusal
from backend_refusal import assert_backend_refuses, assert_overlap_refused

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1, 1), (3, 7), (5, 1030), (32, 512)]   # (N, I): one element, odd, past one program's 1024, the MoE's


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Both round the SiLU to the dtype, then the product, as torch's two eager ops; the SiLU's exp comes from
    another library (numpy under the interpreter, libdevice on the GPU and in torch's CUDA kernel, SLEEF in
    torch on the CPU), a few fp32 ulps, which move a 16-bit SiLU by one ulp only near a rounding boundary. So
    for 16-bit dtypes at most 1% of the elements (at least one allowed) differ, each by at most 2 ulps (the
    SiLU's, carried through the product); fp32: relative 1e-6 (8 ulps) and 2^-20 of the largest output (a
    SiLU near zero of an ulp that large). A gate and up swapped, or a sigmoid alone, misses by far more."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any(), "an output element was left unwritten"
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=2**-20 * want.abs().max().item())
        return
    torch.testing.assert_close(got, want, rtol=2 * torch.finfo(want.dtype).eps, atol=0)
    assert (got != want).sum() <= max(1, want.numel() // 100)


def _stacked(n, i, dtype, seed):
    """(gate, up): the two halves of a [n, 1 + 2i + 2] output's columns (row stride 2i + 3, an odd offset)."""
    y = (3 * torch.randn(n, 2 * i + 3, generator=torch.Generator().manual_seed(seed))).to(dtype)
    return y[:, 1:i + 1], y[:, i + 1:2 * i + 1]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_on_columns_of_a_stacked_output(dtype, shape):
    gate, up = _stacked(*shape, dtype, sum(shape))
    out = torch.full(shape, float("nan"), dtype=dtype)
    with ops.use_backend("triton"):
        y = silu_mul(gate, up, out=out)
    assert y is out
    assert_matches(y, silu_mul.reference(gate, up))


def test_the_reference_is_torchs_silu_then_the_product():
    gate, up = _stacked(3, 7, torch.bfloat16, 1)
    assert torch.equal(silu_mul.reference(gate, up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("into", ["gate", "up"])
def test_in_place_on_gate_or_up(into):
    """Each element of gate and up is read by its own program before it writes that element of out. (Gate and up of
    their own buffers: as columns of one output their byte spans interleave, which `overlaps` counts as shared.)"""
    gate, up = (t.clone() for t in _stacked(4, 9, torch.bfloat16, 2))
    want = silu_mul.reference(gate, up)
    out = gate if into == "gate" else up
    with ops.use_backend("triton"):
        assert silu_mul(gate, up, out=out) is out
    assert_matches(out, want)


def test_an_out_over_other_rows_is_left_to_the_reference():
    """`out` one row past gate: program 0 writes row 1's gate before its program reads it."""
    buf = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    gate, out, up = buf[:3], buf[1:4], torch.randn(3, 8)
    want = silu_mul.reference(gate.clone(), up)
    assert_overlap_refused(silu_mul, "out", "gate", gate, up, out=out)
    with ops.use_backend("auto"):
        assert torch.equal(silu_mul(gate, up, out=out), want)


BAD = {
    "gate 3-D": (lambda g, u: (g[None], u[None]), "gate", r"\[N, I\]"),
    "gate int": (lambda g, u: (g.int(), u.int()), "gate", "bf16, fp16 or fp32"),
    "up of another shape": (lambda g, u: (g, u[:, :3]), "up", "gate's shape and dtype"),
    "up of another dtype": (lambda g, u: (g, u.double()), "up", "gate's shape and dtype"),
    "gate strided along I": (lambda g, u: (torch.cat([g, g], 1)[:, ::2], u), "gate", "unit stride along I"),
    "up elsewhere": (lambda g, u: (g, u.to("meta")), "up", "on gate's device, cpu"),
}


@pytest.mark.parametrize("case", BAD)
def test_operands_the_kernel_cannot_take_are_refused_by_the_predicate_the_provider_and_the_backend(case):
    make, field, allowed = BAD[case]
    gate, up = make(*_stacked(3, 6, torch.float32, 4))
    why = silu_mul_refusal(gate, up)
    assert isinstance(why, InputError) and why.field == field, why
    assert re.search(allowed, str(why)), str(why)
    assert not silu_mul.providers["triton"].supports(gate, up)
    with ops.use_backend("triton"):
        assert_backend_refuses(silu_mul, field, gate, up)
    if silu_mul.contract(gate, up) is None and up.device.type == "cpu":
        with ops.use_backend("auto"):
            assert torch.equal(silu_mul(gate, up), silu_mul.reference(gate, up))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 32])
def test_gpu_matches_reference(dtype, n):
    """The MoE's shared expert (I 512) and Qwen3.5's dense FFN (I 12288), compiled (libdevice's exp)."""
    for i in (512, 12288):
        gate, up = (t.cuda() for t in _stacked(n, i, dtype, n + i))
        out = torch.full((n, i), float("nan"), dtype=dtype, device="cuda")
        with ops.use_backend("triton"):
            y = silu_mul(gate, up, out=out)
        assert_matches(y, silu_mul.reference(gate, up))
