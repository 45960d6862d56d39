"""FP8 E4M3 reference (DESIGN 3): per-row and block-128 scales, hand-computed vectors, error bounds,
round trips and refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from mtpfactory.errors import WeightsError
from mtpfactory.quant import (
    FP8_E4M3_MAX,
    dequantize_fp8,
    dequantize_fp8_block,
    quantize_fp8,
    quantize_fp8_block,
)
from mtpfactory.quant.fp8 import to_e4m3

PROPERTY = settings(max_examples=60, deadline=None)
E4M3_MIN_NORMAL = 2.0**-6


@st.composite
def weights(draw) -> torch.Tensor:
    """[N, K] fp32 (odd sizes): Gaussian rows whose amaxes span up to 2**24, about one row in ten all zero,
    overall magnitude 2**-30 .. 2**30."""
    n, k = draw(st.integers(1, 9)), draw(st.integers(1, 40))
    spread, magnitude = draw(st.sampled_from([0, 8, 24])), draw(st.integers(-30, 30))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    w = torch.randn(n, k, generator=gen)
    w = w * torch.exp2(-spread * torch.rand(n, 1, generator=gen)) * (torch.rand(n, 1, generator=gen) > 0.1)
    return w * 2.0**magnitude


def assert_e4m3_error_bound(w: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> None:
    """With `scale` expanded to [N, K] and m = |x| / scale <= 448: E4M3 keeps 3 mantissa bits, so a normal
    value (m >= 2**-6) is off by at most half a step, 2**-4 of its binade's base, hence <= 2**-4 * |x|; a
    subnormal one by at most half the subnormal step, 2**-10 * scale."""
    x, deq, scale = w.double(), deq.double(), scale.double()
    m = x.abs() / scale
    err = (deq - x).abs()
    slack = 1e-6 * (x.abs() + 2.0**-9 * scale)  # fp32 rounding of x / scale and of value * scale
    normal = m >= E4M3_MIN_NORMAL
    assert (m <= FP8_E4M3_MAX * (1 + 1e-6)).all()
    assert (err <= 2.0**-4 * x.abs() + slack)[normal].all()
    assert (err <= 2.0**-10 * scale + slack)[~normal].all()


def tile_index(n: int, k: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n)[:, None] // block, torch.arange(k)[None, :] // block


# --- per row ------------------------------------------------------------------------------------------------

def test_per_row_known_values():
    row = [448.0, 17.0, -1.0, 0.5, 19.0, -240.0, 0.001, 0.0]
    w = torch.tensor([row, [0.0] * 8, [2 * v for v in row]])
    weight, scale = quantize_fp8(w)
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.tolist() == [1.0, 1.0, 2.0]                      # amax / 448; the zero row gets 1
    # 17 and 19 are ties: to the even mantissa (16, 20); 0.001 rounds to the smallest subnormal 2**-9.
    stored = [448.0, 16.0, -1.0, 0.5, 20.0, -240.0, 2.0**-9, 0.0]
    assert weight.float().tolist() == [stored, [0.0] * 8, stored]
    assert dequantize_fp8(weight, scale).tolist() == [stored, [0.0] * 8, [2 * v for v in stored]]
    assert dequantize_fp8(weight, scale, dtype=torch.bfloat16).dtype == torch.bfloat16


class E4m3Casts(TorchFunctionMode):
    """Under it, `inputs` collects every tensor cast to float8_e4m3fn (`Tensor.to`)."""

    def __init__(self):
        super().__init__()
        self.inputs: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and torch.float8_e4m3fn in (*args[1:], kwargs.get("dtype")):
            self.inputs.append(args[0])
        return func(*args, **kwargs)


def test_clamps_before_the_cast():
    """Past +-448 is +-448, and the cast never sees it: what a cast makes of a value past the range differs
    between torch builds (this CPU one saturates, others give NaN)."""
    with E4m3Casts() as casts:
        q = to_e4m3(torch.tensor([500.0, -1e30, 464.0, 448.0]))
    assert q.float().tolist() == [448.0, -448.0, 448.0, 448.0]
    assert len(casts.inputs) == 1 and casts.inputs[0].abs().max().item() <= FP8_E4M3_MAX


@PROPERTY
@given(weights())
def test_per_row_error_bound(w):
    weight, scale = quantize_fp8(w)
    assert_e4m3_error_bound(w, dequantize_fp8(weight, scale), scale[:, None].expand_as(w))


@PROPERTY
@given(weights())
def test_per_row_round_trip(w):
    weight, scale = quantize_fp8(w)
    again, again_scale = quantize_fp8(dequantize_fp8(weight, scale))
    assert torch.equal(again.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(again_scale, scale)


# --- block-128 tables -----------------------------------------------------------------------------------------

def test_block_known_tiles_with_partial_edges():
    w = torch.zeros(130, 260)                      # tiles [2, 3]; the last row and column of tiles are partial
    w[0, 0], w[5, 130], w[129, 259] = -448.0, 44.8, 896.0
    weight, scale = quantize_fp8_block(w)
    assert weight.shape == (130, 260) and scale.dtype == torch.float32
    expected = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 2.0]])  # zero tiles get 1
    expected[0, 1] = torch.tensor(44.8) / 448
    assert torch.equal(scale, expected)
    deq = dequantize_fp8_block(weight, scale)
    assert deq[0, 0].item() == -448.0 and deq[129, 259].item() == 896.0
    assert deq[5, 130].item() == pytest.approx(44.8, rel=1e-6)
    assert torch.count_nonzero(deq) == 3


def test_block_bf16_table_multiplies_each_tile():
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(200, 300, generator=gen) * 50).to(torch.float8_e4m3fn)
    table = torch.rand(2, 3, generator=gen).to(torch.bfloat16)
    rows, cols = tile_index(200, 300, 128)
    ref = weight.float() * table.float()[rows, cols]
    assert torch.equal(dequantize_fp8_block(weight, table), ref)
    assert torch.equal(dequantize_fp8_block(weight, table, dtype=torch.bfloat16), ref.to(torch.bfloat16))


@PROPERTY
@given(weights(), st.sampled_from([1, 3, 16, 128]))
def test_block_error_bound(w, block):
    weight, scale = quantize_fp8_block(w, block=block)
    n, k = w.shape
    assert scale.shape == (-(-n // block), -(-k // block))
    rows, cols = tile_index(n, k, block)
    assert_e4m3_error_bound(w, dequantize_fp8_block(weight, scale, block=block), scale[rows, cols])


@PROPERTY
@given(weights(), st.sampled_from([1, 3, 16, 128]))
def test_block_round_trip(w, block):
    weight, scale = quantize_fp8_block(w, block=block)
    again, again_scale = quantize_fp8_block(dequantize_fp8_block(weight, scale, block=block), block=block)
    assert torch.equal(again.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(again_scale, scale)


# --- refusals -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantize", [quantize_fp8, quantize_fp8_block])
@pytest.mark.parametrize(("bad", "count"), [(float("nan"), "1 NaN, 0 Inf"), (float("-inf"), "0 NaN, 1 Inf")])
def test_refuses_nan_and_inf_naming_the_tensor(quantize, bad, count):
    w = torch.ones(3, 5)
    w[2, 4] = bad
    with pytest.raises(WeightsError, match=rf"^mlp\.down_proj\.weight='{count}': must be finite"):
        quantize(w, name="mlp.down_proj.weight")


@pytest.mark.parametrize("quantize", [quantize_fp8, quantize_fp8_block])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_refuses_an_already_quantized_weight_naming_it(quantize, dtype):
    """FP8 codes without their scales were torch's NotImplementedError ("isfinite" not implemented)."""
    with pytest.raises(WeightsError, match=rf"^q_proj\.weight\.dtype=torch\.{dtype.__repr__().split('.')[1]}: "
                                           "already quantized.*dequantize"):
        quantize(torch.ones(2, 16).to(dtype), name="q_proj.weight")


@pytest.mark.parametrize("shape", [(0, 16), (4, 0)])
def test_refuses_an_empty_matrix_with_a_fix_that_fits_it(shape):
    """An empty [N, K] matrix was told to "quantize each weight matrix separately", the fix for a 3-D stack."""
    with pytest.raises(WeightsError, match=r"^fc\.weight\.shape=.*non-empty.*Fix: pass the whole weight"):
        quantize_fp8(torch.ones(shape), name="fc.weight")


def test_refuses_a_wrong_scale_table_shape():
    weight = torch.zeros(200, 300, dtype=torch.float8_e4m3fn)
    with pytest.raises(WeightsError, match=r"^q_proj\.weight_scale_inv\.shape=\(2, 2\): .* needs a \[2, 3\]"):
        dequantize_fp8_block(weight, torch.ones(2, 2), name="q_proj.weight")
    with pytest.raises(WeightsError, match=r"weight_scale_inv\.shape=\(2, 3\): .* 64x64 tiles needs a \[4, 5\]"):
        dequantize_fp8_block(weight, torch.ones(2, 3), block=64)
    with pytest.raises(WeightsError, match=r"^weight_scale\.shape=\(1,\): per-row scales must be \[N\] = \[200\]"):
        dequantize_fp8(weight, torch.ones(1))


def test_refuses_non_fp8_weights_and_bad_tiles():
    with pytest.raises(WeightsError, match=r"must be a 2-D float8"):
        dequantize_fp8(torch.zeros(2, 4, dtype=torch.uint8), torch.ones(2))
    with pytest.raises(WeightsError, match=r"^block=0"):
        quantize_fp8_block(torch.ones(2, 4), block=0)


def test_dequantizing_past_the_output_dtypes_range_is_refused():
    """fp16 output of a value past 65504 was inf, silently: the finite check ran on the fp32 product."""
    q, s = quantize_fp8(torch.tensor([[1e6, 1.0]]))
    qb, sb = quantize_fp8_block(torch.full((1, 1), 1e6))
    for call in (lambda: dequantize_fp8(q, s, dtype=torch.float16),
                 lambda: dequantize_fp8_block(qb, sb, dtype=torch.float16)):
        with pytest.raises(WeightsError, match=r"^weight='1 values past the range of torch.float16.*torch.float32"):
            call()
    assert dequantize_fp8(q, s, dtype=torch.bfloat16).isfinite().all()
    with pytest.raises(WeightsError, match=r"^dtype=torch.int32: a floating-point dtype"):
        dequantize_fp8(q, s, dtype=torch.int32)


def test_scales_that_are_not_floating_point_tensors_are_refused():
    """An int32 view of an fp32 table has its shape and was read as its bytes' numbers (4e11 for 0.08)."""
    q, s = quantize_fp8(torch.randn(4, 8) * 0.02)
    qb, sb = quantize_fp8_block(torch.randn(256, 256) * 0.02)
    for call, name in ((lambda: dequantize_fp8(q, s.view(torch.int32)), "weight_scale"),
                       (lambda: dequantize_fp8_block(qb, sb.view(torch.int32)), "weight_scale_inv"),
                       (lambda: dequantize_fp8_block(qb, torch.ones(2, 2, dtype=torch.bool)), "weight_scale_inv")):
        with pytest.raises(WeightsError, match=rf"^{name}='torch.(int32|bool) .*a floating-point tensor"):
            call()


def test_quantizing_a_parameter_keeps_no_graph_and_float64_past_fp32_is_named():
    """A parameter's outputs carried a grad_fn holding fp32 copies of the weight; a finite float64 value past
    fp32's range was refused as "0 NaN, 1 Inf ... a corrupt or diverged tensor"."""
    weight = torch.nn.Parameter(torch.randn(8, 32))
    for out in (*quantize_fp8(weight), *quantize_fp8_block(weight, 16)):
        assert out.grad_fn is None and not out.requires_grad
    with pytest.raises(WeightsError, match=r"^weight='1 values past the range of fp32'"):
        quantize_fp8(torch.tensor([[1e39, 1.0]], dtype=torch.float64))
    with pytest.raises(WeightsError, match=r"^weight='ndarray': a torch.Tensor"):
        quantize_fp8(torch.ones(2, 16).numpy())
    with pytest.raises(WeightsError, match=r"^block=True"):
        quantize_fp8_block(torch.ones(2, 16), True)
