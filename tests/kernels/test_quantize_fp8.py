"""quantize_fp8's Triton provider against its definition (`mtpfactory.quant.quantize_fp8`), bit for bit:
values compared as e4m3 bytes, row scales as fp32 bits, into outputs poisoned with 0xFF.

On the CPU the provider runs under Triton's interpreter at tiny shapes; the `gpu` tests repeat the edge
cases on CUDA and add real sizes (`pytest -m gpu` on the device machine)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from mtpfactory import ops, quant
from mtpfactory.errors import InputError, WeightsError
from mtpfactory.kernels.quantize_fp8 import divides_by_reciprocal, quantize_fp8, quantize_fp8_triton
from backend_refusal import assert_overlap_refused

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="Triton on the CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def poisoned(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs of an [n, k] quantization, every byte 0xFF (e4m3 and fp32 NaNs)."""
    return (torch.full((n, k), 0xFF, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
            torch.full((n,), -1, dtype=torch.int32, device=device).view(torch.float32))


def triton_matches_reference(w: torch.Tensor):
    """Quantize `w` with the Triton provider into poisoned outputs; assert it equals the reference bit for
    bit and return the result."""
    ref = quant.quantize_fp8(w)
    out = poisoned(*w.shape, w.device.type)
    with ops.use_backend("triton"):
        got = quantize_fp8(w, out=out)
    assert all(g is o for g, o in zip(got, out))
    for what, g, r in (("scales", got[1].view(torch.int32), ref[1].view(torch.int32)),
                       ("values", got[0].view(torch.uint8), ref[0].view(torch.uint8))):
        bad = (g != r).nonzero()
        assert bad.numel() == 0, (f"{len(bad)} {what} differ, first at {bad[0].tolist()}: "
                                  f"{g[tuple(bad[0])].item():#x} != reference {r[tuple(bad[0])].item():#x}")
    return got


def random_weight(n: int, k: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """[n, k] Gaussian with row magnitudes over 2**-20 .. 2**20 and a few entries 2**-30 of their row's
    amax (rounding into and below e4m3's subnormals); row 0 zero whenever there are other rows."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-20, 21, (n, 1), generator=gen).float())
    w = torch.where(torch.rand(n, k, generator=gen) < 0.1, w * 2.0**-30, w)
    if n > 1:
        w[0] = 0
    return w.to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (1, 16), (5, 7), (5, 48), (33, 5), (33, 80), (3, 1500)])
def test_random_odd_shapes(device, dtype, n, k):
    # (3, 1500): two K chunks per row, the second partial. About half the rows have amax / scale above 448
    # (the scale rounded down) and go through the clamp.
    triton_matches_reference(random_weight(n, k, dtype, seed=100 * n + k, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_every_e4m3_value_midpoint_and_neighbour(device):
    # Row amax 448: the scale is exactly 1, so each value reaches the e4m3 rounding as it is.
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()                                       # [253], -448 .. 448
    mids = (grid[1:] + grid[:-1]) / 2                                                # every tie
    bits = mids.view(torch.int32)
    near = torch.cat([(bits + 1).view(torch.float32), (bits - 1).view(torch.float32)])
    edges = torch.tensor([2.0**-10, -2.0**-10, 2.0**-11, 2.0**-6 - 2.0**-12, 1e-40, -1e-40, -0.0, 447.9, -447.99])
    row = torch.cat([grid, mids, near, edges])
    row = torch.where(row.abs() <= 448, row, 0.0)[None, :].to(device)              # neighbours past +-448 dropped
    q, scale = triton_matches_reference(row)
    assert scale.item() == 1.0 and torch.equal(q.float()[0, :253], grid.to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_zero_rows_negative_zeros_and_underflowing_scales(device):
    w = torch.zeros(5, 9, device=device)
    w[1] = -0.0
    w[2, 4] = -1e-44                 # amax / 448 underflows fp32: scale 1, the value rounds to -0
    w[3] = torch.linspace(-1, 1, 9)
    w[4, 0] = 3e38                   # near fp32's max
    w = torch.cat([w, torch.linspace(-1, 1, 9, device=device)[None] * 2.0**-130])   # fp32 subnormals
    q, scale = triton_matches_reference(w)
    assert scale[:3].tolist() == [1.0, 1.0, 1.0]
    assert q.view(torch.uint8)[1].tolist() == [0x80] * 9 and q.view(torch.uint8)[2, 4].item() == 0x80


@pytest.mark.parametrize("device", DEVICES)
def test_half_input_and_fresh_outputs(device):
    w = random_weight(4, 24, torch.float32, seed=9).clamp(-6e4, 6e4).to(torch.float16).to(device)
    ref = quant.quantize_fp8(w)
    with ops.use_backend("triton"):
        got = quantize_fp8(w)
    assert got[0].dtype == torch.float8_e4m3fn and got[1].dtype == torch.float32
    assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("device", DEVICES)
def test_refusals(device):
    w = torch.ones(3, 8, device=device)
    w[2, 5] = float("nan")
    with ops.use_backend("triton"), pytest.raises(WeightsError, match="q_proj.*1 NaN"):
        quantize_fp8(w, "q_proj")
    for backend in ("triton", "native"):  # a refused call leaves `out` as it was, bytes and scales
        out = poisoned(3, 8, device)
        with ops.use_backend(backend), pytest.raises(WeightsError, match="q_proj.*1 NaN"):
            quantize_fp8(w, "q_proj", out=out)
        assert (out[0].view(torch.uint8) == 0xFF).all() and (out[1].view(torch.int32) == -1).all()
    with ops.use_backend("triton"), pytest.raises(WeightsError, match=r"^weight.shape=\(8,\): must be a non-empty 2-D"):
        quantize_fp8(torch.ones(8, device=device))                    # 1-D: wrong under every backend, as native says
    with ops.use_backend("triton"), pytest.raises(InputError, match="weight_scale"):
        quantize_fp8(torch.ones(3, 8, device=device), out=(poisoned(3, 8, device)[0], poisoned(4, 8, device)[1]))


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_an_out_of_another_arity_or_a_weight_the_kernel_cannot_take_is_refused_by_every_provider(backend):
    """`out` must be the (weight, weight_scale) pair, checked before anything is written; the provider called
    directly refuses a tensor its predicate refuses, naming it."""
    w = random_weight(4, 24, torch.float32, seed=11)
    out = poisoned(4, 24, "cpu")
    for bad in (out[:1], (*out, out[1]), out[0]):
        with ops.use_backend(backend), pytest.raises(InputError, match=r"^out=.*a tuple \(weight, weight_scale\) of 2"):
            quantize_fp8(w, out=bad)
    assert (out[0].view(torch.uint8) == 0xFF).all() and (out[1].view(torch.int32) == -1).all()
    if backend == "triton":
        for bad in (w[0], w.double(), w[:0]):
            with pytest.raises(WeightsError, match=r"^q_proj=.*a 2-D fp32, bf16 or fp16 \[N, K\] tensor"):
                quantize_fp8_triton(bad, "q_proj")


@pytest.mark.parametrize("i, field", [(0, "out[0] (weight)"), (1, "out[1] (weight_scale)")])
def test_an_out_sharing_memory_with_the_weight_is_left_to_the_reference(i, field):
    """The codes laid over the bytes of w's rows 4 on, or the scales over row 4 (9 rows of 1500: three programs
    of 4 rows, so program 0 wrote into row 4 before program 1 read it): the provider refuses it naming both,
    writing nothing; `auto` runs the reference, which quantizes before it writes."""
    w = random_weight(9, 1500, torch.float32, seed=12)
    over = (w.view(torch.uint8).view(-1)[4 * 4 * 1500:][: 9 * 1500].view(9, 1500).view(torch.float8_e4m3fn),
            w[4, :9])
    out = tuple(over[j] if j == i else poisoned(9, 1500, "cpu")[j] for j in range(2))
    want = quant.quantize_fp8(w.clone())
    assert_overlap_refused(quantize_fp8, field, "w", w, out=out)
    with pytest.raises(InputError, match=rf"^{re.escape(field)}='memory shared with w'"):
        quantize_fp8_triton(w, out=out)
    with ops.use_backend("auto"):
        got = quantize_fp8(w, out=out)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("device", DEVICES)
def test_the_reference_takes_out_too(device):
    """A call with `out` that dispatch sends to the reference writes it as the Triton provider does."""
    w = random_weight(4, 24, torch.float32, seed=10, device=device)
    ref = quant.quantize_fp8(w)
    out = poisoned(4, 24, device)
    with ops.use_backend("native"):
        got = quantize_fp8(w, out=out)
        with pytest.raises(InputError, match="weight_scale"):
            quantize_fp8(w, out=(out[0], poisoned(5, 24, device)[1]))
    assert all(g is o for g, o in zip(got, out))
    assert torch.equal(out[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(out[1], ref[1])


def test_torch_division_by_a_python_float_on_the_cpu_is_true_division():
    assert divides_by_reciprocal("cpu") is False


# --- real sizes, on the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu_memory
@pytest.mark.gpu
def test_gpu_lm_head_151936x2048():
    gen = torch.Generator(device="cuda").manual_seed(0)
    triton_matches_reference(torch.randn(151936, 2048, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02)


@pytest.mark.gpu_memory
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_512_experts_of_512x2048_stacked(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(512, 512, 2048, generator=gen, device="cuda", dtype=dtype)
    w.mul_(torch.exp2(torch.randint(-20, 21, (512, 512, 1), generator=gen, device="cuda")).to(dtype))
    triton_matches_reference(w.view(512 * 512, 2048))
