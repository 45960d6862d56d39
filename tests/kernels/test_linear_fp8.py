"""W8A16 GEMV and small-M GEMM (`linear_fp8`): the Triton provider against the reference.

Tolerance: every E4M3 value is exact in fp32 (and bf16), so kernel and reference sum the same exact
products x * w8 in fp32 in different orders and multiply by the same row scale: they differ by a few fp32
roundings, bounded by 1e-5 * sum_k |x| |w8| scale, and then by one rounding of the output dtype, which can
put the two on adjacent values: 2^-7 (~1e-2) of |y| for bf16, 2^-10 for fp16, ~1e-5 for fp32. A wrong
element (a K tile dropped, a wrong scale or row) is off by O(sum |x||w|). The fp16 dot of large weights
(`F16_DOT_MIN_ELEMENTS`) takes x times a power of two per row in fp16: exact for the x here (every element
within 2^-25 of its row's largest), so the same bound holds.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import ConfigError, InputError
from mtpfactory.kernels.linear_fp8 import _linear_fp8_native, linear_fp8, linear_fp8_triton
from mtpfactory.quant import quantize_fp8
from backend_refusal import storage_bytes
from gemv_common import DTYPES, assert_matches, assert_pdl_reads_its_own_x, explicit_plans

linear_module = importlib.import_module("mtpfactory.kernels.linear")   # the package exports the Op `linear`


@pytest.fixture
def f16_dot(monkeypatch):
    """Every FP8 weight counts as large: bf16 x takes the fp16 dot (x's pass first) on the dot path."""
    monkeypatch.setattr(linear_module, "F16_DOT_MIN_ELEMENTS", 0)


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """x [M, K] in `dtype`; a Gaussian weight [N, K] quantized per row (rows of different magnitudes)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=gen).float())
    weight, scale = quantize_fp8(w)
    return x.to(device), weight.to(device), scale.to(device)


def check(x, weight, scale, **kwargs) -> None:
    m, n = x.shape[0], weight.shape[0]
    out = torch.full((m, n), float("nan"), dtype=x.dtype, device=x.device)
    linear_fp8_triton(x, weight, scale, out=out, **kwargs)
    abs_sum = x.float().abs() @ (weight.float().abs() * scale[:, None]).T
    assert_matches(out, _linear_fp8_native(x, weight, scale), abs_sum)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 17, 32])
@pytest.mark.parametrize("n,k", [(1, 16), (7, 48), (33, 80), (130, 48)])
def test_matches_reference_with_explicit_tiles(dtype, m, n, k):
    x, weight, scale = make_inputs(m, n, k, dtype, seed=m * 1000 + n)
    with ops.use_backend("triton"):
        for plan in explicit_plans(m, n, k):
            check(x, weight, scale, plan=plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 7, 1024), (3, 33, 48), (17, 130, 80), (32, 5, 512)])
@pytest.mark.parametrize("split_k", [False, True])
def test_matches_reference_with_planned_tiles(dtype, m, n, k, split_k):
    x, weight, scale = make_inputs(m, n, k, dtype, seed=n + k)
    with ops.use_backend("triton"):
        check(x, weight, scale, split_k=split_k)


@pytest.mark.parametrize("m", [3, 17])                      # the FMA path, the dot path
def test_out_whose_columns_lie_apart(m):
    """out the transpose of a poisoned [N, M] buffer (columns M apart): the kernels step along N by out's
    stride."""
    x, weight, scale = make_inputs(m, 33, 48, torch.bfloat16, seed=m)
    out_t = torch.full((33, m), float("nan"), dtype=torch.bfloat16)
    with ops.use_backend("triton"):
        linear_fp8_triton(x, weight, scale, out=out_t.T)
    abs_sum = x.float().abs() @ (weight.float().abs() * scale[:, None]).T
    assert_matches(out_t.T, _linear_fp8_native(x, weight, scale), abs_sum)


def test_an_out_over_the_scales_is_refused():
    """`out` (which only the entry point takes) laid one element past the row scales' start: the program of one
    tile of columns wrote over the next tile's first scale before that tile's program read it (off by 2e5).
    Refused naming both, before anything is written."""
    x, weight, scale = make_inputs(2, 33, 48, torch.float32, seed=1)
    buf = torch.randn(1 + 2 * 33)
    scale, out = buf[:33].copy_(scale), buf[1:].view(2, 33)
    before = storage_bytes(out)
    with pytest.raises(InputError, match="^out='memory shared with weight_scale'"):
        linear_fp8_triton(x, weight, scale, out=out)
    assert torch.equal(storage_bytes(out), before)


@pytest.mark.parametrize("first,last", [(0, 8), (8, 16), (0, 16)])   # FMA path twice, tl.dot path
def test_every_e4m3_value_decodes_exactly(first, last, device="cpu"):
    # All 254 finite E4M3 bit patterns (subnormals, both zeros, +-448) as a [16, 16] weight; x = rows of the
    # identity picks columns, so y[i, n] = w[n, first + i] * scale[n] with no rounding anywhere.
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)   # [254]
    weight = torch.cat([bits, bits[:2]]).view(16, 16).view(torch.float8_e4m3fn)          # [N=16, K=16]
    scale = torch.exp2(torch.arange(16.0) - 8)                                           # [16]
    weight, scale = weight.to(device), scale.to(device)
    x = torch.eye(16, device=device)[first:last]
    out = torch.full((last - first, 16), float("nan"), device=device)
    with ops.use_backend("triton"):
        linear_fp8_triton(x, weight, scale, out=out)
    assert torch.equal(out, (weight.float() * scale[:, None]).T[first:last])


def x_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What `_x_f16_rows_kernel` writes for x [M, K]: each row's exponent e (its largest |x| times 2^e in
    [2^11, 2^12), e at most 127) and x * 2^e in fp16."""
    amax = x.float().abs().amax(dim=1)
    e = torch.where(amax == 0, 127, 11 - torch.floor(torch.log2(amax.clamp_min(2.0**-149))).int()).clamp(max=127)
    return e.int(), (x.float() * torch.exp2(e.float())[:, None]).to(torch.float16)


def test_x_rows_pass_scales_x():
    """x's pass for the fp16 dot alone, on x [4, 40] whose rows differ in size by 2^-100 .. 2^100 (and one all
    zero), into buffers poisoned with -1: each row's exponent and its fp16 values bit for bit. Row 1's largest
    is its last element, in the last, partial block of 16: the exponent reads up to K's end."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(4, 40, generator=gen) * torch.tensor([[2.0**-100], [1.0], [2.0**100], [0.0]])).to(torch.bfloat16)
    x[1, -1] = 4 * x[1].abs().max()
    x16 = torch.full((4, 40), -1.0, dtype=torch.float16)
    exps = torch.full((4,), -1, dtype=torch.int32)
    linear_module._x_f16_rows_kernel[(4,)](x, x16, exps, 40, x.stride(0), x.stride(1), BLOCK=16, PDL=False)
    want_exps, want_x16 = x_rows_reference(x)
    assert torch.equal(exps, want_exps)
    assert torch.equal(x16.view(torch.int16), want_x16.view(torch.int16))


@pytest.mark.parametrize("m", [3, 17, 32])
@pytest.mark.parametrize("n,k", [(7, 48), (130, 80)])
def test_f16_dot_matches_reference(m, n, k, f16_dot):
    """bf16 x on the dot path in fp16, rows of x 2^-100 to 2^100 in size, every dot tile (split and not)."""
    x, weight, scale = make_inputs(m, n, k, torch.bfloat16, seed=m + n)
    sizes = torch.exp2(torch.linspace(-100, 100, m).round())[:, None]
    x = (x.float() * sizes).to(torch.bfloat16)
    with ops.use_backend("triton"):
        for plan in explicit_plans(m, n, k, fma_m=False)[:3]:
            check(x, weight, scale, plan=plan)


def test_op_dispatch_and_fallback(monkeypatch):
    calls = []
    p = linear_fp8.providers["triton"]
    monkeypatch.setitem(linear_fp8.providers, "triton",
                        dataclasses.replace(p, fn=lambda *a: calls.append(1) or p.fn(*a)))
    x, weight, scale = make_inputs(33, 7, 32, torch.bfloat16)
    with ops.use_backend("triton"):
        y = linear_fp8(x[:2], weight, scale)
        assert calls == [1]
        assert_matches(y, _linear_fp8_native(x[:2], weight, scale),
                       x[:2].float().abs() @ (weight.float().abs() * scale[:, None]).T)
        supports = linear_fp8.providers["triton"].supports
        assert supports(x[:32], weight, scale)
        assert not supports(x, weight, scale)                           # M = 33
        assert not supports(x[:1], weight, scale.double())              # scale not fp32
        assert not supports(x[:1], weight, scale[:6])                   # scale not [N]
        assert not supports(x[:1], weight.view(torch.uint8), scale)     # not float8_e4m3fn
        with pytest.raises(ConfigError, match="linear_fp8"):
            linear_fp8(x, weight, scale)
    with ops.use_backend("auto"):
        y = linear_fp8(x, weight, scale)
    assert calls == [1] and torch.equal(y, _linear_fp8_native(x, weight, scale))


# --- compiled (GPU) ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("n,k", [(4096, 2048), (2048, 4096)])
@pytest.mark.parametrize("split_k", [False, True])
def test_gpu_matches_reference(dtype, m, n, k, split_k):
    x, weight, scale = make_inputs(m, n, k, dtype, seed=m, device="cuda")
    check(x, weight, scale, split_k=split_k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 8, 32])
def test_gpu_every_path(m):
    x, weight, scale = make_inputs(m, 4096, 2048, torch.bfloat16, seed=m, device="cuda")
    for plan in explicit_plans(m, 4096, 2048):
        check(x, weight, scale, plan=plan)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("first,last", [(0, 8), (8, 16), (0, 16)])
def test_gpu_every_e4m3_value_decodes_exactly(first, last):
    test_every_e4m3_value_decodes_exactly(first, last, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [8, 32])
@pytest.mark.parametrize("split_k", [False, True])
def test_gpu_f16_dot(m, split_k, f16_dot):
    """The fp16 dot compiled: bf16 x of rows 2^-100 to 2^100 in size, planned tiles; x's pass bit for bit;
    and every E4M3 value widened exactly (bf16 rows of the identity read back each weight column)."""
    x, weight, scale = make_inputs(m, 4096, 2048, torch.bfloat16, seed=m, device="cuda")
    x = (x.float() * torch.exp2(torch.linspace(-100, 100, m).round()).cuda()[:, None]).to(torch.bfloat16)
    check(x, weight, scale, split_k=split_k)
    x16 = torch.full((m, 2048), -1.0, dtype=torch.float16, device="cuda")
    exps = torch.full((m,), -1, dtype=torch.int32, device="cuda")
    linear_module._x_f16_rows_kernel[(m,)](x, x16, exps, 2048, x.stride(0), x.stride(1), BLOCK=1024, PDL=False)
    want_exps, want_x16 = x_rows_reference(x.cpu())
    assert torch.equal(exps.cpu(), want_exps) and torch.equal(x16.cpu().view(torch.int16), want_x16.view(torch.int16))
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)   # [254]
    w8 = torch.cat([bits, bits[:2]]).view(16, 16).view(torch.float8_e4m3fn).cuda()        # [N=16, K=16]
    s8 = torch.exp2(torch.arange(16.0) - 8).cuda()
    eye = torch.eye(16, device="cuda", dtype=torch.bfloat16)
    out = linear_fp8_triton(eye, w8, s8)                                                  # M = 16: the dot
    assert torch.equal(out, (w8.float() * s8[:, None]).T.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [3, 32])
def test_gpu_pdl_reads_this_calls_x(m, f16_dot, monkeypatch):
    """The fp16 dot launched beside x's pass (`x_pass_pdl`) reads the fp16 x of its own call."""
    _, weight, scale = make_inputs(1, 4096, 2048, torch.bfloat16, seed=m, device="cuda")
    xs = [torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16) * 2.0 ** (8 * (i % 3) - 8) for i in range(12)]
    assert_pdl_reads_its_own_x(lambda x, out=None: linear_fp8_triton(x, weight, scale, out=out), xs, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_auto_backend_picks_triton(monkeypatch):
    calls = []
    p = linear_fp8.providers["triton"]
    monkeypatch.setitem(linear_fp8.providers, "triton",
                        dataclasses.replace(p, fn=lambda *a: calls.append(1) or p.fn(*a)))
    x, weight, scale = make_inputs(4, 4096, 2048, torch.bfloat16, device="cuda")
    with ops.use_backend("auto"):
        y = linear_fp8(x, weight, scale)
    assert calls == [1]
    assert_matches(y, _linear_fp8_native(x, weight, scale),
                   x.float().abs() @ (weight.float().abs() * scale[:, None]).T)
