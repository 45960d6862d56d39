"""quantize_nvfp4's Triton provider against its definition (`mtpfactory.quant.quantize_nvfp4`), bit for bit:
codes and scales compared as bytes, the global scale as fp32 bits, into outputs poisoned with 0xFF.

On the CPU the provider runs under Triton's interpreter at tiny shapes; the `gpu` tests repeat the edge
cases on CUDA and add real sizes (`pytest -m gpu` on the device machine)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from mtpfactory import ops, quant
from mtpfactory.errors import InputError, WeightsError
from mtpfactory.kernels.quantize_fp8 import divides_by_reciprocal
from mtpfactory.kernels.quantize_nvfp4 import global_absmax_bits, quantize_nvfp4, quantize_nvfp4_triton
from backend_refusal import assert_overlap_refused

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="Triton on the CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]
E4M3_SUB = 2.0**-9                     # the smallest e4m3 subnormal
# Block [6, every midpoint, their negatives, -0] times its scale: under a unit global scale each
# element lands exactly on its E2M1 tie. Expected codes: 6 -> 7; ties to the even code; sign in bit 3.
TIE_BLOCK = [6.0, .25, .75, 1.25, 1.75, 2.5, 3.5, 5.0, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]
TIE_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 0, 10, 10, 12, 12, 14, 14, 0]


def poisoned(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Outputs of an [n, k] quantization, every byte 0xFF (scales and the global scale read as NaN)."""
    return (torch.full((n, k // 2), 0xFF, dtype=torch.uint8, device=device),
            torch.full((n, k // 16), 0xFF, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
            torch.full((1,), -1, dtype=torch.int32, device=device).view(torch.float32).reshape(()))


def triton_matches_reference(w: torch.Tensor):
    """Quantize `w` with the Triton provider into poisoned outputs; assert it equals the reference bit for
    bit and return the result."""
    ref = quant.quantize_nvfp4(w)
    out = poisoned(*w.shape, w.device.type)
    with ops.use_backend("triton"):
        got = quantize_nvfp4(w, out=out)
    assert all(g is o for g, o in zip(got, out))
    assert got[2].view(torch.int32).item() == ref[2].view(torch.int32).item(), (got[2].item(), ref[2].item())
    for what, g, r in (("scales", got[1].view(torch.uint8), ref[1].view(torch.uint8)), ("codes", got[0], ref[0])):
        bad = (g != r).nonzero()
        assert bad.numel() == 0, (f"{len(bad)} {what} bytes differ, first at {bad[0].tolist()}: "
                                  f"{g[tuple(bad[0])].item():#04x} != reference {r[tuple(bad[0])].item():#04x}")
    return got


def random_weight(n: int, k: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """[n, k]: Gaussian blocks whose amaxes span 2**-24 .. 1 (the small ones underflow E4M3), about one block
    in eight all zero, and row 0 zero whenever there are other rows."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k // 16, 16, generator=gen)
    w = w * torch.exp2(-24 * torch.rand(n, k // 16, 1, generator=gen) ** 2)
    w = w * (torch.rand(n, k // 16, 1, generator=gen) > 0.125)
    if n > 1:
        w[0] = 0
    return w.reshape(n, k).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 5, 33])
@pytest.mark.parametrize("k", [16, 48, 80])
def test_random_odd_shapes(device, dtype, n, k):
    triton_matches_reference(random_weight(n, k, dtype, seed=1000 * n + k, device=device) * 3.0)


@pytest.mark.parametrize("device", DEVICES)
def test_element_ties_round_to_the_even_code(device):
    # Block 0 holds 2688 = 6 * 448, so the global scale is exactly 1 and every block's scale is its amax / 6.
    scales = [1.0, 0.5, 2.0, 1.5, 0.125, 10.0, 3 * E4M3_SUB]       # the last one an e4m3 subnormal
    head = [2688.0] + [0.0] * 15
    w = torch.tensor([head + sum(([s * v for v in TIE_BLOCK] for s in scales), [])], device=device)
    weight, scale, scale_2 = triton_matches_reference(w)
    assert scale_2.item() == 1.0 and scale.float().tolist()[0] == [448.0] + scales
    codes = torch.stack([weight & 0xF, weight >> 4], dim=-1).view(-1).tolist()
    assert codes[16:] == TIE_CODES * len(scales)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_scale_ties_subnormals_and_underflow(device, dtype):
    # amax / 6 lands on an E4M3 midpoint (ties to the even mantissa), in the subnormal range, or below half
    # the smallest subnormal (scale 0: stored as 1, codes 0). Values picked to be exact in bf16 too.
    planted = {1.0625: 1.0, 1.1875: 1.25, 232.0: 224.0, 432.0: 448.0,          # normal ties
               2.5 * E4M3_SUB: 2 * E4M3_SUB, 1.5 * E4M3_SUB: 2 * E4M3_SUB,    # subnormal ties
               7.5 * E4M3_SUB: 2.0**-6, 1.25 * E4M3_SUB: E4M3_SUB,            # up to the smallest normal; below a tie
               0.5 * E4M3_SUB: 1.0, 0.25 * E4M3_SUB: 1.0, 0.0: 1.0}           # underflow: stored 1
    gen = torch.Generator().manual_seed(7)
    blocks = [torch.tensor([2688.0] + [0.0] * 15)]
    for t in planted:
        b = (torch.rand(16, generator=gen) * 2 - 1) * 6 * t
        b[int(torch.randint(16, (1,), generator=gen))] = -6 * t
        blocks.append(b)
    w = torch.cat(blocks).view(3, 64).to(dtype).to(device)
    weight, scale, scale_2 = triton_matches_reference(w)
    assert scale_2.item() == 1.0
    assert scale.float().view(-1).tolist() == [448.0, *planted.values()]
    underflowed = [i + 1 for i, t in enumerate(planted) if t <= 0.5 * E4M3_SUB]
    assert (weight.view(-1, 8)[underflowed] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_scales_follow_the_devices_division_by_constants(device):
    # torch divides by the constants 6 and 2688 truly on the CPU and via their fp32 reciprocals on CUDA.
    # These amaxes (found by search) sit an ulp from an E4M3 tie, where the two ways store different scales.
    by_reciprocal = divides_by_reciprocal(device)
    w = torch.zeros(2, 32)
    w[0, 0], w[0, 16] = 2688.0, 7.124999523162842          # global 1; 7.1249995 / 6 vs 7.1249995 * fl(1/6)
    w[1, 0], w[1, 16] = 41.9735221862793, 0.11125794053077698   # here the global scale's rounding decides
    _, scale, _ = triton_matches_reference(w[:1].to(device))
    assert scale.view(torch.uint8)[0, 1].item() == (58 if by_reciprocal else 57)
    _, scale, _ = triton_matches_reference(w[1:].to(device))
    assert scale.view(torch.uint8)[0, 1].item() == (57 if by_reciprocal else 58)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_rows_zero_blocks_negative_zeros(device):
    w = torch.zeros(5, 48, device=device)
    w[1, :16] = -0.0
    w[2, 16:32] = torch.linspace(-3, 3, 16)
    w[3, 40] = -1e-3
    w[4, 47] = 1e4                                       # makes row 3's block underflow
    triton_matches_reference(w)
    weight, scale, scale_2 = triton_matches_reference(torch.zeros(3, 32, device=device))   # global scale 1
    assert scale_2.item() == 1.0 and (scale.float() == 1).all() and (weight == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("magnitude", [-135, -100, -60, 60, 100])
def test_extreme_magnitudes(device, magnitude):
    # -135: fp32 subnormal inputs and global scale (no flush-to-zero may creep in anywhere).
    triton_matches_reference(random_weight(4, 48, torch.float32, seed=magnitude + 200, device=device) * 2.0**magnitude)


@pytest.mark.parametrize("device", DEVICES)
def test_half_input_and_fresh_outputs(device):
    w = random_weight(5, 32, torch.float16, seed=3, device=device)
    ref = quant.quantize_nvfp4(w)
    with ops.use_backend("triton"):
        got = quantize_nvfp4(w)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1].view(torch.uint8), ref[1].view(torch.uint8))
    assert got[1].dtype == torch.float8_e4m3fn and got[2].shape == () and got[2].item() == ref[2].item()


@pytest.mark.parametrize("device", DEVICES)
def test_absmax_over_many_programs_and_iterations(device):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1000, generator=gen).to(device)
    x[900] = -40.0                                             # program 2's third block of 64
    bits = global_absmax_bits(x, block=64, max_programs=3)     # 3 programs x 6 iterations, the last masked
    assert bits.item() == torch.tensor(40.0).view(torch.int32).item()
    x[100] = float("nan")                                      # program 0's second block
    assert global_absmax_bits(x, block=64, max_programs=3).item() >= 0x7F800000


def untouched(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> bool:
    """Every byte of `poisoned` outputs still 0xFF."""
    return all(bool((t.reshape(-1).view(torch.uint8) == 0xFF).all()) for t in out)


@pytest.mark.parametrize("device", DEVICES)
def test_refusals(device):
    """A NaN/Inf weight, K not a multiple of 16, a weight that is not 2-D, and an `out` of another shape are
    refused naming what is wrong; the outputs given stay as they were."""
    w = torch.ones(2, 32, device=device)
    w[1, 3] = float("inf")
    out = poisoned(2, 32, device)
    with ops.use_backend("triton"), pytest.raises(WeightsError, match="lm_head.*1 Inf"):
        quantize_nvfp4(w, "lm_head", out=out)
    assert untouched(out)
    with ops.use_backend("triton"), pytest.raises(WeightsError, match=r"^weight.shape\[1\]=24: .*multiple of 16"):
        quantize_nvfp4(torch.ones(2, 24, device=device))               # K not a multiple of 16: wrong everywhere
    for bad, what in ((torch.ones(2, 24, device=device), r"w\.shape\[1\]=24: .*multiple of 16"),
                      (torch.ones(2, 2, 16, device=device), r"w='torch.float32 \(2, 2, 16\)': a 2-D")):
        with pytest.raises(WeightsError, match=what):                  # the provider called directly
            quantize_nvfp4_triton(bad, "w", out=out)
    assert untouched(out)
    bad_out = poisoned(2, 32, device)[0], *poisoned(2, 16, device)[1:]
    with ops.use_backend("triton"), pytest.raises(InputError, match="weight_scale"):
        quantize_nvfp4(torch.ones(2, 32, device=device), out=bad_out)
    assert untouched(bad_out)


@pytest.mark.parametrize("i, field", [(0, "out[0] (weight)"), (2, "out[2] (weight_scale_2)")])
def test_an_out_sharing_memory_with_the_weight_is_left_to_the_reference(i, field):
    """The codes laid over the bytes of w's rows 2 on, or the global scale over w[2, 0] (4 rows of 1024: two
    programs of 128 blocks, rows 0-1 and 2-3, so program 0 wrote into row 2 before program 1 read it): the
    provider refuses it naming both, writing nothing; `auto` runs the reference, which quantizes before it
    writes."""
    w = torch.randn(4, 1024, generator=torch.Generator().manual_seed(12))
    over = (w.view(torch.uint8).view(-1)[2 * 4 * 1024:][: 4 * 512].view(4, 512), None, w[2, 0])
    out = tuple(over[j] if j == i else poisoned(4, 1024, "cpu")[j] for j in range(3))
    want = quant.quantize_nvfp4(w.clone())
    assert_overlap_refused(quantize_nvfp4, field, "w", w, out=out)
    with pytest.raises(InputError, match=rf"^{re.escape(field)}='memory shared with w'"):
        quantize_nvfp4_triton(w, out=out)
    with ops.use_backend("auto"):
        got = quantize_nvfp4(w, out=out)
    assert all(torch.equal(g.reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8))
               for g, r in zip(got, want))


@pytest.mark.parametrize("device", DEVICES)
def test_the_reference_takes_out_too(device):
    """A call with `out` that dispatch sends to the reference writes it as the Triton provider does, bit for
    bit; an `out` of another shape is refused there too, before anything is written."""
    w = torch.randn(4, 48, generator=torch.Generator().manual_seed(10)).to(device)
    ref = quant.quantize_nvfp4(w)
    out = poisoned(4, 48, device)
    with ops.use_backend("native"):
        bad = (out[0], poisoned(5, 48, device)[1], out[2])
        with pytest.raises(InputError, match="weight_scale"):
            quantize_nvfp4(w, out=bad)
        assert untouched(out)
        got = quantize_nvfp4(w, out=out)
    assert all(g is o for g, o in zip(got, out))
    assert all(torch.equal(g.reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)) for g, r in zip(got, ref))


# --- real sizes, on the GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu_memory
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_lm_head_151936x2048():
    gen = torch.Generator(device="cuda").manual_seed(0)
    triton_matches_reference(torch.randn(151936, 2048, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02)


@pytest.mark.gpu_memory
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_512_experts_of_512x2048_stacked(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(512, 512, 2048, generator=gen, device="cuda", dtype=dtype)
    spread = torch.exp2(-12 * torch.rand(512, 512, 128, 1, generator=gen, device="cuda"))   # per block
    w.view(512, 512, 128, 16).mul_(spread.to(dtype))
    triton_matches_reference(w.view(512 * 512, 2048))
