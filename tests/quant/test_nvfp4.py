"""NVFP4 reference (DESIGN 3): hand-computed vectors, every tie rule, zero and underflowing blocks,
error bounds, round trips and refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mtpfactory.errors import WeightsError
from mtpfactory.quant import E2M1_VALUES, NVFP4_BLOCK, dequantize_nvfp4, quantize_nvfp4

PROPERTY = settings(max_examples=60, deadline=None)
E4M3_MIN_NORMAL = 2.0**-6


def codes_of(packed: torch.Tensor) -> list[list[int]]:
    """[N, K/2] bytes -> [N, K] codes, element 2j from the low nibble."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1).tolist()


@st.composite
def weights(draw, spreads=(0, 4, 12, 24)) -> torch.Tensor:
    """[N, K] fp32: Gaussian blocks whose amaxes span 2**spread, about one block in ten all zero, overall
    magnitude 2**-30 .. 2**30."""
    n, blocks = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    spread, magnitude = draw(st.sampled_from(spreads)), draw(st.integers(-30, 30))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    w = torch.randn(n, blocks, NVFP4_BLOCK, generator=gen)                     # [N, K/16, 16]
    w = w * torch.exp2(-spread * torch.rand(n, blocks, 1, generator=gen))
    w = w * (torch.rand(n, blocks, 1, generator=gen) > 0.1)
    return (w * 2.0**magnitude).view(n, blocks * NVFP4_BLOCK)


# --- hand-computed vectors -------------------------------------------------------------------------------

def test_known_blocks_codes_bytes_and_scales():
    # amax 10.5 -> global = 10.5 / 2688 = 2**-8.
    # Block 0: amax 10.5 -> scale e4m3(10.5 / 6 / 2**-8) = 448, unit = scale * global = 1.75; every grid value.
    grid = [0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -1.5, -2, -3, -4, -6, -.25]
    # Block 1: scale 10, unit = 10/256; values off the grid round to the nearest grid point.
    off_grid = [6, .2, .3, 2.4, 2.6, 4.9, 5.1, -.6, -.9, -1.1, -1.4, -1.6, -1.9, 3.2, -3.8, 0]
    # Block 2: amax/6/global = 10.5 is an E4M3 tie -> stored 10 (even mantissa); the elements divide by the
    # stored 10, so the amax lands at 6.3 (clamped to code 7) and 2.55 * 10/256 rounds to 3 (code 5).
    rounded = [63 / 256, 2.55 * 10 / 256] + [0] * 14
    w = torch.tensor([[1.75 * v for v in grid] + [10 / 256 * v for v in off_grid] + rounded])

    weight, scale, scale_2 = quantize_nvfp4(w)

    assert weight.dtype == torch.uint8 and weight.shape == (1, 24)
    assert scale.dtype == torch.float8_e4m3fn and scale.float().tolist() == [[448.0, 10.0, 10.0]]
    assert scale_2.dtype == torch.float32 and scale_2.shape == () and scale_2.item() == 2.0**-8
    assert codes_of(weight)[0] == ([0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 0]
                                   + [7, 0, 1, 4, 5, 6, 7, 9, 10, 10, 11, 11, 12, 5, 14, 0]
                                   + [7, 5] + [0] * 14)
    assert weight[0].tolist() == ([0x10, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0x0F]
                                  + [0x07, 0x41, 0x65, 0x97, 0xAA, 0xBB, 0x5C, 0x0E]
                                  + [0x57] + [0] * 7)
    expected = ([1.75 * v for v in grid[:15]] + [0.0]
                + [10 / 256 * v for v in [6, 0, .5, 2, 3, 4, 6, -.5, -1, -1, -1.5, -1.5, -2, 3, -4, 0]]
                + [10 / 256 * 6, 10 / 256 * 3] + [0] * 14)
    assert dequantize_nvfp4(weight, scale, scale_2).tolist() == [expected]


def test_elements_divide_by_the_product_of_the_scales():
    # amax 6 -> global = fl(6 / 2688) = fl(1/448), a little above 1/448; scale e4m3(6 / 6 / global) = 448, and
    # fl(448 * global) = 1: 1.75 and 3.5 divide to exact ties, to the even codes 4 (2.0) and 6 (4.0). Divided
    # by the scale first and then by the global (1.75 / 448 = 2^-8, exact), they land an ulp under the ties
    # (codes 3 and 5).
    weight, scale, scale_2 = quantize_nvfp4(torch.tensor([[6.0, 1.75, 3.5] + [0.0] * 13]))
    assert scale.float().tolist() == [[448.0]] and scale_2.item() == torch.tensor(1 / 448).item()
    assert codes_of(weight)[0][:3] == [7, 4, 6]


def test_block_scales_divide_by_6_then_by_the_global():
    # amax 256 -> global = fl(256 / 2688) = fl(2/21). Block 1's amax 2^-8: fl(fl(2^-8 / 6) / global) is
    # 2^-8 * 2688 / (6 * 256) = 3.5 * 2^-9 exactly, an E4M3 subnormal tie -> 4 * 2^-9 = 2^-7 (even). Divided by
    # fl(6 * global) instead, it lands under the tie: 3 * 2^-9.
    w = torch.tensor([[256.0] + [0.0] * 15 + [2.0**-8] + [0.0] * 15])
    _, scale, scale_2 = quantize_nvfp4(w)
    assert scale_2.item() == torch.tensor(2 / 21).item()
    assert scale.float().tolist() == [[448.0, 2.0**-7]]


TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize(("tie", "value"), TIES)
def test_ties_go_to_the_even_code(tie, value, sign):
    # global = 1 and scale = 448 (amax 2688), so the element divides to exactly `tie`.
    w = torch.tensor([[2688.0, sign * 448 * tie] + [0.0] * 14])
    weight, scale, scale_2 = quantize_nvfp4(w)
    code = codes_of(weight)[0][1]
    assert code & 1 == 0                                            # the even code
    assert code == (E2M1_VALUES.index(value) + (8 if sign < 0 and value else 0))
    assert dequantize_nvfp4(weight, scale, scale_2)[0, 1].item() == sign * 448 * value


def test_zero_tensor_stores_unit_scales_and_code_zero():
    weight, scale, scale_2 = quantize_nvfp4(torch.zeros(2, 32, dtype=torch.bfloat16))
    assert weight.eq(0).all() and scale.float().eq(1).all() and scale_2.item() == 1.0
    assert dequantize_nvfp4(weight, scale, scale_2).eq(0).all()


def test_underflowing_and_zero_blocks_store_scale_one_subnormal_scales_are_kept():
    # global = 1. Block 1 (|x| = 0.005): 0.005 / 6 < 2**-10, so its E4M3 scale underflows -> scale 1, codes 0.
    # Block 2: amax 6 * 2**-9 -> the smallest subnormal scale 2**-9, kept. Block 3: all zero -> scale 1.
    small = [0.005, -0.005] * 8
    subnormal = [6 * 2.0**-9, -3 * 2.0**-9] + [0.0] * 14
    w = torch.tensor([[2688.0] + [0.0] * 15 + small + subnormal + [0.0] * 16])
    weight, scale, scale_2 = quantize_nvfp4(w)
    assert scale.float().tolist() == [[448.0, 1.0, 2.0**-9, 1.0]]
    assert codes_of(weight)[0][16:] == [0] * 16 + [7, 13] + [0] * 14 + [0] * 16
    assert dequantize_nvfp4(weight, scale, scale_2)[0, 16:32].eq(0).all()


def test_sign_bit_and_negative_zero():
    w = torch.tensor([[-2688.0, 2688.0, -0.0, -1.0] + [0.0] * 12])   # -1.0 / 448 rounds to magnitude 0
    weight, _, _ = quantize_nvfp4(w)
    assert codes_of(weight)[0][:4] == [15, 7, 0, 0]
    assert weight[0, :2].tolist() == [0x7F, 0x00]


def test_dequantize_dtype_and_scale_2_as_one_element():
    w = torch.randn(3, 48, generator=torch.Generator().manual_seed(0))
    weight, scale, scale_2 = quantize_nvfp4(w)
    ref = dequantize_nvfp4(weight, scale, scale_2)
    assert torch.equal(dequantize_nvfp4(weight, scale, scale_2.reshape(1), dtype=torch.bfloat16),
                       ref.to(torch.bfloat16))
    transposed = quantize_nvfp4(w.T.contiguous().T)                # a non-contiguous view quantizes the same
    assert torch.equal(transposed[0], weight)


# --- properties ---------------------------------------------------------------------------------------------

def assert_within_half_a_step(w: torch.Tensor) -> None:
    """For every element of a block with a normal E4M3 scale s, with unit = s * global and m = |x| / unit:
    the stored magnitude is a nearest E2M1 grid point to m, so |dequant - x| <= half the grid spacing at m
    (0.25 below 2, 0.5 below 4, 1 from 4 up) times unit. m can exceed 6 only because s is rounded (by at
    most 1/17 of itself), so m <= 6 * 17/16 = 6.375: the clamp to 6 costs at most 0.375 units, inside the
    top interval's half step of 1."""
    weight, scale, scale_2 = quantize_nvfp4(w)
    deq = dequantize_nvfp4(weight, scale, scale_2).double()
    x = w.double()
    unit = (scale.double() * scale_2.double()).repeat_interleave(NVFP4_BLOCK, dim=1)  # [N, K], exact
    m = x.abs() / unit
    half_step = torch.where(m < 2, 0.25, torch.where(m < 4, 0.5, 1.0))
    nearest = (m[..., None] - torch.tensor(E2M1_VALUES, dtype=torch.float64)).abs().amin(-1)
    normal = (scale.float() >= E4M3_MIN_NORMAL).repeat_interleave(NVFP4_BLOCK, dim=1)
    slack = 1e-6 * (x.abs() + unit)              # fp32 rounding of x / unit and of code * scale * global
    err = (deq - x).abs()
    assert (err <= half_step * unit + slack)[normal].all()
    assert (err <= nearest * unit + slack)[normal].all()
    assert (m[normal] <= 6.375 * (1 + 1e-6)).all()


@PROPERTY
@given(weights())
def test_error_within_half_a_grid_step(w):
    assert_within_half_a_step(w)


@PROPERTY
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=32, max_size=32))
def test_error_within_half_a_grid_step_extreme_values(values):
    w = torch.tensor([values])
    amax = w.abs().max().item()
    assume(amax == 0 or amax >= 2688 * 2.0**-126)    # global must be a normal fp32 number
    assert_within_half_a_step(w)


@PROPERTY
@given(weights(spreads=(0, 4, 12)))
def test_round_trip(w):
    """quantize(dequantize(q)) == q, when every block has a normal scale or is all code 0 (a block with a
    subnormal scale never reaches code 7, so its rescaled copy gets a smaller scale)."""
    weight, scale, scale_2 = quantize_nvfp4(w)
    empty = (weight == 0).view(w.shape[0], -1, NVFP4_BLOCK // 2).all(-1)
    assume(((scale.float() >= E4M3_MIN_NORMAL) | empty).all())
    again = quantize_nvfp4(dequantize_nvfp4(weight, scale, scale_2))
    assert torch.equal(again[0], weight)
    assert torch.equal(again[1].view(torch.uint8), scale.view(torch.uint8))
    assert again[2].item() == scale_2.item()


@PROPERTY
@given(weights())
def test_negation_flips_only_the_sign_bit(w):
    weight, scale, scale_2 = quantize_nvfp4(w)
    neg = quantize_nvfp4(-w)
    codes, neg_codes = torch.tensor(codes_of(weight)), torch.tensor(codes_of(neg[0]))
    assert torch.equal(neg_codes, torch.where(codes == 0, 0, codes ^ 8))
    assert torch.equal(neg[1].view(torch.uint8), scale.view(torch.uint8)) and neg[2].item() == scale_2.item()


# --- refusals -------------------------------------------------------------------------------------------------

def test_refuses_k_not_a_multiple_of_16():
    with pytest.raises(WeightsError, match=r"mlp\.up_proj\.weight\.shape\[1\]=24: NVFP4 needs K"):
        quantize_nvfp4(torch.ones(4, 24), name="mlp.up_proj.weight")


@pytest.mark.parametrize(("bad", "count"), [(float("nan"), "1 NaN, 0 Inf"), (float("inf"), "0 NaN, 1 Inf"),
                                            (float("-inf"), "0 NaN, 1 Inf")])
def test_refuses_nan_and_inf_naming_the_tensor(bad, count):
    w = torch.ones(2, 16)
    w[1, 3] = bad
    with pytest.raises(WeightsError, match=rf"^layers\.0\.o_proj\.weight='{count}': must be finite"):
        quantize_nvfp4(w, name="layers.0.o_proj.weight")


def test_refuses_non_matrix_and_integer_weights():
    with pytest.raises(WeightsError, match=r"weight\.shape"):
        quantize_nvfp4(torch.ones(16))
    with pytest.raises(WeightsError, match=r"weight\.dtype"):
        quantize_nvfp4(torch.ones(2, 16, dtype=torch.int32))
    # FP8 codes without their scales: was torch's NotImplementedError ("isfinite" not implemented)
    with pytest.raises(WeightsError, match=r"^o_proj\.weight\.dtype=torch\.float8_e4m3fn: already quantized"):
        quantize_nvfp4(torch.ones(2, 16).to(torch.float8_e4m3fn), name="o_proj.weight")


def test_dequantize_refuses_mismatched_layout():
    weight, scale, scale_2 = quantize_nvfp4(torch.ones(4, 32))
    with pytest.raises(WeightsError, match=r"w_scale\.shape=\(2, 4\): a \[4, 32\] NVFP4 weight needs .*\[4, 2\]"):
        dequantize_nvfp4(weight, scale.view(2, 4), scale_2, name="w")
    with pytest.raises(WeightsError, match=r"^weight=.*uint8 \[N, K/2\]"):
        dequantize_nvfp4(weight.float(), scale, scale_2)
    with pytest.raises(WeightsError, match=r"weight_scale_2\.shape"):
        dequantize_nvfp4(weight, scale, torch.ones(2))


def test_dequantize_reads_scales_as_values_and_refuses_their_raw_bytes():
    """The block scales are values: float8_e4m3fn as stored, or any floating dtype holding them, give the same
    weight; the bytes as uint8 (0x38 is 1.0, read as 56) are refused naming the scale, not read as numbers."""
    weight, scale, scale_2 = quantize_nvfp4(torch.randn(4, 32, generator=torch.Generator().manual_seed(3)))
    want = dequantize_nvfp4(weight, scale, scale_2)
    assert torch.equal(dequantize_nvfp4(weight, scale.float(), scale_2), want)
    with pytest.raises(WeightsError, match=r"^w_scale=.*uint8.*\.view\(torch\.float8_e4m3fn\)"):
        dequantize_nvfp4(weight, scale.view(torch.uint8), scale_2, name="w")


def test_dequantize_refuses_overflow_in_the_output_dtype_and_a_scale_2_that_is_not_a_float_tensor():
    """fp16 output of 1e6 was inf, silently; an int32 view of weight_scale_2 was read as 1e9, and a Python float
    raised AttributeError."""
    packed, scale, scale_2 = quantize_nvfp4(torch.full((1, 16), 1e6))
    with pytest.raises(WeightsError, match=r"^weight='16 values past the range of torch.float16"):
        dequantize_nvfp4(packed, scale, scale_2, dtype=torch.float16)
    for bad, got in ((scale_2.view(torch.int32), "torch.int32"), (0.5, "float")):
        with pytest.raises(WeightsError, match=rf"^weight_scale_2='{got}.*a floating-point tensor"):
            dequantize_nvfp4(packed, scale, bad)
    weight = torch.nn.Parameter(torch.randn(4, 32))
    assert all(t.grad_fn is None for t in quantize_nvfp4(weight))
