"""W4A16 NVFP4 GEMV and small-M GEMM (`linear_nvfp4`): the Triton provider against the reference.

Tolerance: E2M1 value * E4M3 scale is exact in fp32 (at most 6 significant bits), so kernel and reference
sum the same exact products in fp32 in different orders; the reference folds `weight_scale_2` into each
element (one more fp32 rounding each) where the kernel multiplies the sum once. They differ by a few fp32
roundings, bounded by 1e-5 * sum_k |x| |w|, then by one rounding of the output dtype, which can put the two
on adjacent values: 2^-7 (~1e-2) of |y| for bf16, 2^-10 for fp16, ~1e-5 for fp32. A wrong element (a
nibble swapped, a scale on the wrong block, a K tile dropped) is off by O(sum |x||w|).
The M = 1 kernel for 16-bit x on programs of 16 rows or more (`uses_f16_gemv`) sums each half of a
16-element block, 8 products, in fp16: each of its 8 fmas rounds to 11 bits, at most 2^-11 of the partial
sum so far, so a block's sum is off
by at most 8 * 2^-11 = 2^-8 of its sum |x||w| (the fp32 sum of the blocks adds nothing of that order): its
bound is 2^-8 * sum |x||w| (F16_SUM_RTOL) where the others have 1e-5; a wrong element still misses by
O(sum |x||w|). That holds for x within 2^-24 of its K slice's largest, as here: x's pass puts the slice's
largest in [2^11, 2^12), so an element 2^25 or more below it (and its products) sinks into fp16's subnormals,
an error of up to 2^-25 of the largest each, outside this bound (the README says so).
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import ConfigError, InputError, MtpfError
from mtpfactory.kernels.linear import GemvPlan, make_plan, plan_for
from mtpfactory.kernels.linear_nvfp4 import (
    _default_plan,
    _linear_nvfp4_native,
    TILES_NVFP4,
    default_plan,
    linear_nvfp4,
    linear_nvfp4_triton,
    plan_refusal,
    uses_f16_dot,
    uses_f16_gemv,
)
from mtpfactory.quant import dequantize_nvfp4
from backend_refusal import storage_bytes
from gemv_common import (
    DTYPES,
    F16_SUM_RTOL,
    SUM_RTOL,
    assert_matches,
    assert_pdl_reads_its_own_x,
    explicit_plans,
    nvfp4_inputs,
    x_pass_reference,
)

linear_nvfp4_module = importlib.import_module("mtpfactory.kernels.linear_nvfp4")   # the package exports the Op



def check(x, weight, scale, scale_2, **kwargs) -> None:
    m, n = x.shape[0], weight.shape[0]
    out = torch.full((m, n), float("nan"), dtype=x.dtype, device=x.device)
    linear_nvfp4_triton(x, weight, scale, scale_2, out=out, **kwargs)
    abs_sum = x.float().abs() @ dequantize_nvfp4(weight, scale, scale_2).abs().T
    plan = kwargs.get("plan") or default_plan(x, n, x.shape[1], kwargs.get("split_k", False))
    f16_sums = uses_f16_gemv(x, plan)
    assert_matches(out, _linear_nvfp4_native(x, weight, scale, scale_2), abs_sum,
                   sum_rtol=F16_SUM_RTOL if f16_sums else SUM_RTOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 17, 32])
@pytest.mark.parametrize("n,k", [(1, 16), (7, 48), (33, 80), (130, 48)])
def test_matches_reference_with_explicit_tiles(dtype, m, n, k):
    x, *w = nvfp4_inputs(m, n, k, dtype, seed=m * 1000 + n)
    with ops.use_backend("triton"):
        for plan in explicit_plans(m, n, k, first_block_k=32, fma_m=False):
            check(x, *w, plan=plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 7, 1024), (3, 33, 48), (17, 130, 80), (32, 5, 512)])
@pytest.mark.parametrize("split_k", [False, True])
def test_matches_reference_with_planned_tiles(dtype, m, n, k, split_k):
    x, *w = nvfp4_inputs(m, n, k, dtype, seed=n + k)
    with ops.use_backend("triton"):
        check(x, *w, split_k=split_k)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.parametrize("k", [208, 224])
def test_tensor_core_path_loads_ahead(stages, splits, k):
    """num_stages - 1 (1 or 2) K steps loaded ahead: 7 steps of 32, in one slice, three, or seven single-step
    slices (the look-ahead clamped to the slice). K = 208: a partial last step; K = 224: whole steps, but
    three slices of 96 leave the last one step inside K (its steps past K masked, though K is a multiple of
    block_k)."""
    x, *w = nvfp4_inputs(5, 33, k, torch.bfloat16, seed=stages)
    with ops.use_backend("triton"):
        check(x, *w, plan=make_plan(5, 33, k, block_n=16, block_k=32, splits=splits, num_stages=stages))


@pytest.fixture
def lm_head(monkeypatch):
    """Every weight counts as an LM head (`LM_HEAD_MIN_ELEMENTS`): 16-bit x on tensor-core tiles of 32 rows
    runs x's pass and the fp16 dot (`_gemm_nvfp4_f16_kernel`)."""
    monkeypatch.setattr(linear_nvfp4_module, "LM_HEAD_MIN_ELEMENTS", 0)


@pytest.mark.parametrize("m,n,k,dtype", [(32, 33, 80, torch.bfloat16), (17, 130, 48, torch.bfloat16),
                                         (20, 7, 48, torch.float16), (17, 7, 224, torch.bfloat16)], ids=str)
def test_f16_dot_matches_reference(m, n, k, dtype, lm_head):
    """The fp16 dot on explicit tiles (several N tiles and K chunks, the last of each partial; split-K over 2
    or 3 slices, each with its own exponent; swapped operands), with and without look-ahead: exact products
    summed in fp32, so the reference's bound (SUM_RTOL); bf16 rows 2^120 apart, each its own power of two.
    K = 224: whole K steps, but slices of 96 or 128 whose last one ends past K (its steps there masked)."""
    x, *w = nvfp4_inputs(m, n, k, dtype, seed=m * 100 + n)
    if dtype == torch.bfloat16:                                      # fp16 holds no 2^60
        x = (x.float() * torch.exp2(torch.tensor([60.0, -60.0] * 16)[:m, None])).to(dtype)
    with ops.use_backend("triton"):
        for plan in explicit_plans(m, n, k, first_block_k=32, fma_m=False):
            for stages in (1, 2):
                plan = dataclasses.replace(plan, num_stages=stages)
                assert uses_f16_dot(x, n, k, plan)
                check(x, *w, plan=plan)
        assert not uses_f16_dot(x[:16], n, k, default_plan(x[:16], n, k, True))   # tiles of 16 rows: the bf16 dot


def test_f16_dot_decodes_every_code_and_scale_exactly(lm_head):
    """Rows of the identity pick single columns through the fp16 dot, so every code and every E4M3 scale
    (subnormal, zero, negative) must come out exactly, in its place: a misordered pair or nibble, a scale
    on the wrong block, fails."""
    weight, scale, scale_2 = _all_codes_and_scales()
    w = dequantize_nvfp4(weight, scale, scale_2)                                        # [16, 256]
    for first in (0, 224):
        x = torch.eye(256, dtype=torch.bfloat16)[first:first + 32]
        out = torch.full((32, 16), float("nan"), dtype=torch.bfloat16)
        with ops.use_backend("triton"):
            plan = default_plan(x, 16, 256, True)
            assert uses_f16_dot(x, 16, 256, plan)
            linear_nvfp4_triton(x, weight, scale, scale_2, out=out, split_k=True)
        assert torch.equal(out, w.T[first:first + 32].to(torch.bfloat16))


def _all_codes_and_scales():
    """[N=16, K=256]: every byte value (all 16 x 16 code pairs) 8 times, and as the 256 block scales all 254
    finite E4M3 patterns (subnormals, zeros and negatives included) plus two more, shuffled."""
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randperm(2048, generator=gen) % 256).to(torch.uint8).view(16, 128)  # [16, 128] bytes
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)   # [254]
    scale = torch.cat([bits, bits[:2]])[torch.randperm(256, generator=gen)].view(16, 16)
    return weight, scale.view(torch.float8_e4m3fn), torch.tensor(2.0**-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)   # M = 1: both GEMV kernels
@pytest.mark.parametrize("m", [1, 17])
def test_every_code_and_scale_decodes(m, dtype):
    weight, scale, scale_2 = _all_codes_and_scales()
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
    with ops.use_backend("triton"):   # 16 rows: M = 1 with bf16 x runs the fp16-sum GEMV
        check(x, weight, scale, scale_2, plan=make_plan(m, 16, 256, block_n=16, block_k=64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("first,last", [(0, 1), (9, 10), (0, 8), (8, 16)])   # GEMV twice, tl.dot twice
def test_nibble_order_exact(first, last, dtype):
    # x = rows of the identity picks single columns: y[i, n] = w[n, first + i] exactly (a single product,
    # exact in fp16 too; every E2M1 * E4M3 * 2^-10 is exact in bf16), so a swapped nibble, a shifted scale
    # block, a wrong sign or a misordered fp16 pair shows as an exact mismatch.
    weight, scale, scale_2 = _all_codes_and_scales()
    w = dequantize_nvfp4(weight, scale, scale_2)                                        # [16, 256]
    x = torch.eye(256, dtype=dtype)[first:last]
    out = torch.full((last - first, 16), float("nan"), dtype=dtype)
    plan = make_plan(1, 16, 256, block_n=16, block_k=64, block_m=1) if last - first == 1 else None  # 16 rows
    with ops.use_backend("triton"):
        linear_nvfp4_triton(x, weight, scale, scale_2, out=out, plan=plan)
    assert torch.equal(out, w.T[first:last].to(dtype))


@pytest.fixture(params=[False, True], ids=["x_in_gemv", "x_pass"])
def x_pass(request, monkeypatch):
    """The 16-bit-x GEMV with x scaled and paired in each program, or by its own pass first (every weight
    counts as large)."""
    if request.param:
        monkeypatch.setattr(linear_nvfp4_module, "LM_HEAD_MIN_ELEMENTS", 0)
    return request.param


@pytest.mark.parametrize("x_scale", [1.0, 2.0**-100, 2.0**100], ids=lambda v: f"{v:g}")
def test_x_pass_scales_and_pairs_x(x_scale):
    """The x pass, launched alone on x [2, 48] (rows read with a stride of 64) in slices of 32 (a partial
    last one), into buffers poisoned with -1: each row's slices' exponents and its pairs bit for bit (the
    scaling is exact, the fp16 rounding of a bf16 value times a power of two in fp16's normal range too).
    The second row is 2^20 times further from 1. x stays clear of bf16's subnormals, which the interpreter
    does not load exactly (the GEMV tests above take x down to 2^-120 against the reference)."""
    gen = torch.Generator().manual_seed(3)
    second = 2.0**20 if x_scale < 1 else 2.0**-20
    x = (torch.randn(2, 64, generator=gen) * x_scale * torch.tensor([[1.0], [second]])).to(torch.bfloat16)
    x[0, 40] = 0.0
    x = x[:, :48]
    pairs = torch.full((2, 24), -1, dtype=torch.int32)
    exps = torch.full((2, 2), -1, dtype=torch.int32)
    linear_nvfp4_module._x_f16_pairs_kernel[(2, 2)](x, pairs, exps, 48, 32, x.stride(0), 1, BLOCK=16,
                                                    USE_ASM=False, PDL=False)
    for row in range(2):
        want_exps, want_pairs = x_pass_reference(x[row], 32)
        assert torch.equal(exps[row], want_exps)
        assert torch.equal(pairs[row], want_pairs)


def test_x_pass_takes_each_slices_own_exponent_from_x_strided_along_k():
    """The x pass on x [2, 48] read every other element of a wider row (stride 2 along K), in slices of 32,
    the last slice's values 2^10 times the first's: each slice's exponent comes from its own elements only
    (a scan running on to K gives the first slice the last one's, 10 less, which the test above, whose slices
    are alike, cannot tell), and its pairs bit for bit as `x_pass_reference` makes them."""
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(2, 96, generator=gen) * torch.where(torch.arange(96) < 64, 1.0, 2.0**10)
    x = wide.to(torch.bfloat16)[:, ::2]
    pairs = torch.full((2, 24), -1, dtype=torch.int32)
    exps = torch.full((2, 2), -1, dtype=torch.int32)
    linear_nvfp4_module._x_f16_pairs_kernel[(2, 2)](x, pairs, exps, 48, 32, x.stride(0), x.stride(1), BLOCK=16,
                                                    USE_ASM=False, PDL=False)
    for row in range(2):
        want_exps, want_pairs = x_pass_reference(x[row], 32)
        assert want_exps[0] - want_exps[1] >= 8
        assert torch.equal(exps[row], want_exps)
        assert torch.equal(pairs[row], want_pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_x_strided_along_k(m, dtype):
    """x every other column of a wider activation (x takes any strides; the other tests' x has unit stride
    along K), on the explicit plans' paths: the fp32 GEMV and the fp16-sum GEMV (M = 1), and the dots."""
    _, *w = nvfp4_inputs(m, 33, 48, dtype, seed=9)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(dtype)[:, ::2]
    assert x.stride(1) == 2
    with ops.use_backend("triton"):
        for plan in explicit_plans(m, 33, 48, first_block_k=32, fma_m=False):
            check(x, *w, plan=plan)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("k", [208, 192, 224])
def test_gemv_f16_sums_with_and_without_look_ahead(stages, splits, k, x_pass, dtype=torch.bfloat16):
    """The 16-bit-x GEMV loads the next K step's words ahead of its sums (num_stages > 1) or not: steps of 32
    in one slice or three (the look-ahead of a slice's last step reloads it). K = 208: a partial last step;
    192: every step whole, no K masks; 224: whole steps, but three slices of 96 leave the last one step
    inside K (its steps past K masked, though K is a multiple of block_k)."""
    x, *w = nvfp4_inputs(1, 33, k, dtype, seed=stages)
    with ops.use_backend("triton"):
        check(x, *w, plan=make_plan(1, 33, k, block_n=16, block_k=32, splits=splits, block_m=1, num_stages=stages))


@pytest.mark.parametrize("x_scale", [0.0, 2.0**-120, 2.0**-60, 2.0**60, 2.0**100], ids=lambda v: f"{v:g}")
def test_gemv_f16_sums_scale_x_by_a_power_of_two(x_scale, x_pass):
    """The fp16 block sums stay in range and keep their precision whatever the size of x: the kernel scales
    x by a power of two per K slice (x near the bottom of bf16's range, near the top, and all zero; the
    slices of the look-ahead test above each take their own)."""
    x, *w = nvfp4_inputs(1, 33, 256, torch.bfloat16, seed=5)
    with ops.use_backend("triton"):
        check((x.float() * x_scale).to(torch.bfloat16), *w,
              plan=make_plan(1, 33, 256, block_n=16, block_k=64, block_m=1))


@pytest.mark.parametrize("dtype,n,k,m", [(torch.bfloat16, 33, 208, m) for m in (2, 8)]      # M 3 pads as 7 does
                         + [(dtype, 7, k, m) for dtype, k in ((torch.float16, 192), (torch.bfloat16, 224))
                            for m in (2, 3, 8)], ids=str)
def test_gemv_rows_matches_reference(dtype, n, k, m):
    """2 <= M <= 8 rows of 16-bit x on the GEMV of several rows (block_m M rounded up to a power of two or
    8): single-block K steps, then steps of 32 in three slices with and without look-ahead; a partial last K
    step (208), none (192), and whole steps whose last slice of 96 has one step inside K (224: its steps past
    K masked, though K is a multiple of block_k); bf16 rows 2^120 apart in size, each scaled by its own power
    of two."""
    x, *w = nvfp4_inputs(m, n, k, dtype, seed=m + n)
    if dtype == torch.bfloat16:                                      # fp16 holds no 2^60
        x = (x.float() * torch.exp2(torch.tensor([60.0, -60.0] * 4)[:m, None])).to(dtype)
    bm = 1 << (m - 1).bit_length()
    with ops.use_backend("triton"):
        check(x, *w, plan=make_plan(m, n, k, block_n=8, block_k=16, block_m=bm))
        for stages in (1, 2):
            check(x, *w, plan=make_plan(m, n, k, block_n=16, block_k=32, splits=3, block_m=8, num_stages=stages))


@pytest.mark.parametrize("splits", [1, 2])
def test_gemv_rows_equal_the_m1_gemv_row_by_row(splits):
    """Each row's result on the GEMV of several rows is the M = 1 GEMV's on that row alone, bit for bit."""
    x, *w = nvfp4_inputs(5, 40, 256, torch.bfloat16, seed=splits)
    plan = make_plan(5, 40, 256, block_n=16, block_k=64, splits=splits, block_m=8, num_stages=2)
    one = make_plan(1, 40, 256, block_n=16, block_k=64, splits=splits, block_m=1, num_stages=2)
    with ops.use_backend("triton"):
        rows = linear_nvfp4_triton(x, *w, plan=plan)
        for r in range(5):
            assert torch.equal(rows[r:r + 1], linear_nvfp4_triton(x[r:r + 1], *w, plan=one)), r


def test_planned_gemv_rows():
    """16-bit x of up to GEMV_MAX_ROWS rows on a weight of LM_HEAD_MIN_ELEMENTS or more plans the GEMV of
    several rows (block_m M rounded up to a power of two, no look-ahead); fp32 x, more rows and smaller
    weights the tensor cores."""
    lm_head, q_proj = (151936, 2048), (8192, 2048)
    for m, dtype, (n, k), block_m in ((2, torch.bfloat16, lm_head, 2), (3, torch.float16, lm_head, 4),
                                      (4, torch.bfloat16, lm_head, 4), (5, torch.bfloat16, lm_head, 16),
                                      (3, torch.float32, lm_head, 16), (2, torch.bfloat16, q_proj, 16),
                                      (1, torch.bfloat16, lm_head, 1)):
        plan = default_plan(torch.empty(m, k, dtype=dtype), n, k, True)
        assert plan.block_m == block_m, (m, dtype, n)
        assert plan.num_stages == (1 if 1 < block_m < 16 else 2), (m, dtype, n)


def test_op_dispatch_and_fallback(monkeypatch):
    calls = []
    p = linear_nvfp4.providers["triton"]
    monkeypatch.setitem(linear_nvfp4.providers, "triton",
                        dataclasses.replace(p, fn=lambda *a: calls.append(1) or p.fn(*a)))
    x, weight, scale, scale_2 = nvfp4_inputs(33, 7, 32, torch.bfloat16)
    with ops.use_backend("triton"):
        y = linear_nvfp4(x[:2], weight, scale, scale_2)
        assert calls == [1]
        assert_matches(y, _linear_nvfp4_native(x[:2], weight, scale, scale_2),
                       x[:2].float().abs() @ dequantize_nvfp4(weight, scale, scale_2).abs().T)
        supports = linear_nvfp4.providers["triton"].supports
        assert supports(x[:32], weight, scale, scale_2)
        assert not supports(x, weight, scale, scale_2)                     # M = 33
        assert not supports(x[:1, :16], weight[:, :8].contiguous(), scale, scale_2)  # scale [N, K/8]
        assert not supports(x[:1], weight, scale.float(), scale_2)        # scale not E4M3
        assert not supports(x[:1, :24], weight[:, :12].contiguous(), scale, scale_2)  # K = 24
        with pytest.raises(ConfigError, match="linear_nvfp4"):
            linear_nvfp4(x, weight, scale, scale_2)
    with ops.use_backend("auto"):
        y = linear_nvfp4(x, weight, scale, scale_2)
    assert calls == [1] and torch.equal(y, _linear_nvfp4_native(x, weight, scale, scale_2))


def test_plan_block_k_must_hold_whole_blocks():
    x, *w = nvfp4_inputs(1, 7, 32, torch.float32)
    with ops.use_backend("triton"), pytest.raises(ValueError, match="multiple of 16"):
        linear_nvfp4_triton(x, *w, plan=make_plan(1, 7, 32, block_n=8, block_k=8))


def test_plan_must_cover_k_in_whole_steps():
    """A plan made for another K is refused naming its slices and K, and writes nothing: K = 64's on K = 128
    (half of K never read), K = 256's on K = 128 (two slices past K, which the kernels would read unmasked),
    and slices of partial block_k steps."""
    x, *w = nvfp4_inputs(1, 16, 128, torch.float32)
    out = torch.full((1, 16), float("nan"))
    for plan, slices in ((make_plan(1, 16, 64, block_n=16, block_k=64), "1 K slices of 64"),
                         (make_plan(1, 16, 256, block_n=16, block_k=32, splits=4), "4 K slices of 64"),
                         (dataclasses.replace(make_plan(1, 16, 128, block_n=16, block_k=32), splits=3, k_per_split=48),
                          "3 K slices of 48")):
        with ops.use_backend("triton"), pytest.raises(InputError, match=rf"plan='{slices}': .*cover K = 128"):
            linear_nvfp4_triton(x, *w, out=out, plan=plan)
    assert out.isnan().all()


def _bad_operands(x, weight, scale, scale_2):
    """(operands, the tensor named, the error's message) for each kind of operand the kernels cannot take."""
    wide = torch.zeros(weight.shape[0], weight.shape[1] + 1, dtype=torch.uint8)[:, 1:]
    wide.copy_(weight)
    shifted = torch.zeros(weight.numel() + 1, dtype=torch.uint8)[1:].view_as(weight)   # one byte off a word
    shifted.copy_(weight)
    return [((x[None], weight, scale, scale_2), "x", "a 2-D"),
            ((x.to(torch.float64), weight, scale, scale_2), "x", "a 2-D bf16, fp16 or fp32"),
            ((torch.zeros(33, x.shape[1]), weight, scale, scale_2), "x", "up to 32.*backend=auto"),
            ((x[:, :16], weight, scale, scale_2), "x", r"K = 32, as the weight \(7, 16\) holds"),
            ((torch.cat([x, x], dim=1), weight, scale, scale_2), "x", r"K = 32, as the weight"),
            ((x, weight.view(torch.int8), scale, scale_2), "weight", "uint8"),
            ((x[:, :24], weight[:, :12].contiguous(), scale, scale_2), "weight", "multiple of 16"),
            ((x, wide, scale, scale_2), "weight", r"rows a multiple of 4 bytes apart.*weight.contiguous\(\)"),
            ((x, shifted, scale, scale_2), "weight", r"4-byte boundaries.*weight.clone\(\)"),
            ((x, weight, scale.float(), scale_2), "weight_scale", "float8_e4m3fn"),
            ((x, weight, scale[:, :1], scale_2), "weight_scale", r"\[7, 2\]"),
            ((x, weight, scale.T.contiguous().T, scale_2), "weight_scale", "unit stride along K"),
            ((x, weight, scale, scale_2.half()), "weight_scale_2", "one fp32 number"),
            ((x, weight, scale, scale_2.expand(2)), "weight_scale_2", "one fp32 number")]


def test_operands_are_refused_by_the_provider_as_by_its_predicate():
    """One check (`operand_refusal`) serves the predicate and the provider, which is also called directly (the
    fused op, scripts): each operand the kernels cannot take is refused by both, the provider naming the tensor
    and what it needs (fp32 scales used to run and give wrong numbers), and nothing is written."""
    x, weight, scale, scale_2 = nvfp4_inputs(3, 7, 32, torch.bfloat16)
    for args, name, what in _bad_operands(x, weight, scale, scale_2):
        out = torch.full((3, 7), float("nan"), dtype=torch.bfloat16)
        with ops.use_backend("triton"):
            assert not linear_nvfp4.providers["triton"].supports(*args), name
            with pytest.raises(MtpfError, match=rf"^{name}=.*{what}"):
                linear_nvfp4_triton(*args, out=out)
        assert out.isnan().all(), name


def test_an_out_sharing_memory_with_x_is_refused():
    """`out` (which only the entry point takes) x itself (N = K): program 0 wrote its columns of out over x
    while the next programs still read x (off by 1e3 and more). Refused naming both, before anything is
    written."""
    x, *w = nvfp4_inputs(2, 64, 64, torch.float32)
    before = storage_bytes(x)
    with pytest.raises(InputError, match="^out='memory shared with x'.*pass an out of its own"):
        linear_nvfp4_triton(x, *w, out=x)
    assert torch.equal(storage_bytes(x), before)


def test_an_out_int32_cannot_index_is_refused():
    """The kernels index out in int32: 32 rows of a weight of 2^26 rows (an out of 2^31 elements) are refused by
    the predicate and the provider, naming out, before anything is allocated or launched; 31 rows are taken.
    The weight is expanded: one row's memory."""
    x, weight, scale, scale_2 = nvfp4_inputs(32, 1, 16, torch.bfloat16)
    weight, scale = weight.expand(2**26, 8), scale.expand(2**26, 1)
    with ops.use_backend("triton"):
        assert not linear_nvfp4.providers["triton"].supports(x, weight, scale, scale_2)
        assert linear_nvfp4.providers["triton"].supports(x[:31], weight, scale, scale_2)
    with pytest.raises(InputError, match=r"^out='\[32, 67108864\] \(2147483648 elements, N = 67108864\)': fewer "
                       r"than 2\^31 elements: the linear_nvfp4 kernels index out in int32"):
        linear_nvfp4_triton(x, weight, scale, scale_2)


@pytest.mark.parametrize("m", [1, 3, 20])
def test_k_zero_is_zeros_on_both_providers(m):
    """K = 0: the reference's zeros from the provider too, which its predicate accepts (a contiguous [N, 0]
    weight has strides (1, 1): nothing is read, so no layout is refused)."""
    x = torch.zeros(m, 0, dtype=torch.bfloat16)
    w = (torch.empty(5, 0, dtype=torch.uint8), torch.empty(5, 0, dtype=torch.float8_e4m3fn), torch.tensor(1.0))
    out = torch.full((m, 5), float("nan"), dtype=torch.bfloat16)
    with ops.use_backend("triton"):
        assert linear_nvfp4.providers["triton"].supports(x, *w)
        assert linear_nvfp4_triton(x, *w, out=out) is out
    assert torch.equal(out, _linear_nvfp4_native(x, *w))


def test_x_rows_further_apart_than_int32_indexes_are_read_right():
    """The kernels index x in int32 (row * stride): x whose rows lie 2^30 elements apart (row 2 at 2^31) is read
    through a contiguous copy, not at a wrapped offset (which reads outside x: the interpreter crashed). The
    4 GiB behind x are only reserved, never touched."""
    x, *w = nvfp4_inputs(3, 16, 32, torch.bfloat16, seed=1)
    far = torch.empty_strided((3, 32), (2**30, 1), dtype=torch.bfloat16)
    far.copy_(x)
    with ops.use_backend("triton"):
        check(far, *w)


def test_out_rows_further_apart_than_int32_indexes_are_written_right():
    """The kernels index out in int32 too: an out whose rows lie 2^30 elements apart is written through a
    contiguous stand-in and copied in (the wrapped offsets wrote 2^32 elements before out: a crash)."""
    x, *w = nvfp4_inputs(3, 16, 32, torch.bfloat16, seed=1)
    far = torch.empty_strided((3, 16), (2**30, 1), dtype=torch.bfloat16).fill_(float("nan"))
    with ops.use_backend("triton"):
        assert linear_nvfp4_triton(x, *w, out=far) is far
        assert torch.equal(far, linear_nvfp4_triton(x, *w))


def test_gpus_before_sm_90_are_refused(monkeypatch):
    """The kernels' inline PTX needs sm_90 (`mul.rn.bf16x2`; `cvt.rn.f16x2.e4m3x2` sm_89): on older GPUs the
    predicate says no (`auto` runs the reference) and the provider names the device (`operand_refusal`)."""
    refusal = linear_nvfp4_module.device_refusal.__wrapped__       # uncached: each capability asked afresh
    for capability, ok in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        err = refusal(torch.device("cuda", 0))
        assert (err is None) == ok, capability
        assert ok or re.search(rf"x.device='cuda:0, capability \({capability[0]}, {capability[1]}\)'.*sm_90", str(err))
    assert refusal(torch.device("cpu")) is None
    # the predicate and the provider ask it about x's device
    x, weight, scale, scale_2 = nvfp4_inputs(1, 5, 32, torch.float32)
    seen = []
    monkeypatch.setattr(linear_nvfp4_module, "device_refusal",
                        lambda device: seen.append(device) or InputError("x.device", str(device), "(a test)"))
    with ops.use_backend("triton"):
        assert not linear_nvfp4.providers["triton"].supports(x, weight, scale, scale_2)
    with pytest.raises(InputError, match=r"x.device='cpu': \(a test\)"):
        linear_nvfp4_triton(x, weight, scale, scale_2)
    assert seen == [x.device, x.device]


def test_planned_nvfp4_tiles():
    # wide weights: the decoded tile is the dot's first operand; small ones: 16-row tiles, split-K to fill
    lm_head = plan_for(32, 151936, 2048, True, TILES_NVFP4)
    assert (lm_head.block_m, lm_head.block_n, lm_head.block_k, lm_head.swap_ab, lm_head.splits) == (
        32, 64, 256, True, 1)
    q_proj = plan_for(32, 8192, 2048, True, TILES_NVFP4)
    assert (q_proj.block_n, q_proj.swap_ab, q_proj.splits) == (64, True, 2)
    fc = plan_for(8, 2048, 4096, True, TILES_NVFP4)
    assert (fc.block_m, fc.block_n, fc.swap_ab, fc.splits, fc.num_stages) == (16, 16, False, 2, 2)
    gemv = plan_for(1, 151936, 2048, True, TILES_NVFP4)
    assert (gemv.block_m, gemv.block_n, gemv.swap_ab) == (1, 64, False)
    head = default_plan(torch.empty(1, 2048, dtype=torch.bfloat16), 151936, 2048, True)   # x's pass: 32 rows
    assert (head.block_m, head.block_n, head.block_k, head.num_warps, head.num_stages, head.splits) == (
        1, 32, 256, 2, 2, 1)
    assert default_plan(torch.empty(1, 2048), 151936, 2048, True) == gemv                  # fp32 x: the table
    # 16-bit x on the LM heads at M = 32: the fp16 dot's 64 x 128 (TILES_NVFP4_LM_HEAD); fp32 x and smaller
    # weights keep TILES_NVFP4's
    for dtype, (n, k), tile in ((torch.bfloat16, (154880, 4096), (64, 128)), (torch.float32, (151936, 2048),
                                (64, 256)), (torch.bfloat16, (8192, 2048), (64, 256))):
        x = torch.empty(32, k, dtype=dtype)
        plan = default_plan(x, n, k, True)
        assert (plan.block_n, plan.block_k, plan.num_stages, plan.swap_ab) == (*tile, 2, True), (dtype, n)
        assert uses_f16_dot(x, n, k, plan) == (dtype == torch.bfloat16 and n > 8192), (dtype, n)
        assert not uses_f16_dot(x[:16], n, k, default_plan(x[:16], n, k, True))


@pytest.mark.parametrize("m,dtype,block_m", [(4, torch.float32, 4), (3, torch.bfloat16, 2), (2, torch.bfloat16, 1),
                                             (17, torch.bfloat16, 16), (9, torch.bfloat16, 8)])
def test_plan_block_m_must_be_a_gemv_or_a_dot(m, dtype, block_m):
    """A plan of fewer rows than x has, or of several GEMV rows for fp32 x, is refused (naming block_m and
    M) and writes nothing."""
    x, *w = nvfp4_inputs(m, 7, 32, dtype)
    out = torch.full((m, 7), float("nan"), dtype=dtype)
    with ops.use_backend("triton"), pytest.raises(ValueError, match=f"block_m = {block_m} for M = {m}"):
        linear_nvfp4_triton(x, *w, out=out, plan=make_plan(m, 7, 32, block_n=8, block_k=32, block_m=block_m))
    assert out.isnan().all()


# (M, a plan Triton cannot build, the field its refusal names), on K = 96: block_k 48 (a multiple of 16, not a
# power of two), tiles that are not powers of two or empty, block_m 3 for one row of bf16 x (which used to
# reach the tensor-core kernel as BLOCK_M = 3), no K slice, 3 warps, no stage.
BAD_PLANS = [
    (1, make_plan(1, 7, 96, block_n=8, block_k=48), "plan.block_k"),
    (1, make_plan(1, 7, 96, block_n=24, block_k=32), "plan.block_n"),
    (1, make_plan(1, 7, 96, block_n=8, block_k=32, block_m=3), "plan.block_m"),
    (3, make_plan(3, 7, 96, block_n=8, block_k=32, block_m=3), "plan.block_m"),
    (1, GemvPlan(1, 8, 0, 1, 96), "plan.block_k"),
    (1, GemvPlan(1, 0, 32, 1, 96), "plan.block_n"),
    (1, dataclasses.replace(make_plan(1, 7, 96, block_n=8, block_k=32), splits=0), "plan.splits"),
    (1, make_plan(1, 7, 96, block_n=8, block_k=32, num_warps=3), "plan.num_warps"),
    (17, make_plan(17, 7, 96, block_n=8, block_k=32, num_stages=0), "plan.num_stages"),
]


@pytest.mark.parametrize("m,plan,field", BAD_PLANS, ids=["bk48", "bn24", "bm3_m1", "bm3_m3", "bk0", "bn0", "splits0",
                                                         "warps3", "stages0"])
def test_plans_triton_cannot_build_are_refused(m, plan, field):
    """`plan_refusal` asks `plan_shape_refusal` first (the rule `linear_triton` applies): each plan Triton cannot
    build is refused naming the plan's field and value, before any launch, and nothing is written."""
    x, *w = nvfp4_inputs(m, 7, 96, torch.bfloat16)
    out = torch.full((m, 7), float("nan"), dtype=torch.bfloat16)
    with ops.use_backend("triton"), pytest.raises(InputError) as err:
        linear_nvfp4_triton(x, *w, out=out, plan=plan)
    assert err.value.field == field, str(err.value)
    assert err.value.value == getattr(plan, field.removeprefix("plan."))
    assert out.isnan().all()


def test_the_planners_plans_pass_plan_refusal(monkeypatch):
    """`plan_refusal` (with `plan_shape_refusal`) refuses nothing the planner makes: every M, each x dtype, the
    tests' shapes and the GPU's, split or not, on the small weights' tables and the LM heads' (every weight
    counted as one), with and without the wgmma kernel; nor the tests' own explicit plans."""
    shapes = [(1, 16), (7, 48), (33, 80), (130, 48), (33, 208), (40, 256), (7, 1024), (5, 512), (4096, 2048),
              (2048, 4096), (1000, 4112), (8192, 2048), (151936, 2048), (154880, 4096)]
    for lm_head_min in (linear_nvfp4_module.LM_HEAD_MIN_ELEMENTS, 0):
        monkeypatch.setattr(linear_nvfp4_module, "LM_HEAD_MIN_ELEMENTS", lm_head_min)
        for n, k in shapes:
            for m in range(1, 33):
                for dtype in DTYPES:
                    for split_k in (False, True):
                        x16 = dtype != torch.float32
                        plans = [default_plan(torch.empty(m, k, dtype=dtype), n, k, split_k),
                                 _default_plan(m, n, k, split_k, x16, x16)]
                        for plan in plans:
                            assert plan_refusal(plan, m, k, x16) is None, (m, n, k, dtype, split_k, plan)
    for m in (1, 3, 17, 32):
        for n, k in ((1, 16), (7, 48), (33, 80), (130, 48)):
            for plan in explicit_plans(m, n, k, first_block_k=32, fma_m=False):
                assert plan_refusal(plan, m, k, True) is None, (m, n, k, plan)


def test_weight_rows_must_start_on_words():
    x, weight, scale, scale_2 = nvfp4_inputs(1, 7, 32, torch.float32)
    wide = torch.zeros(7, 17, dtype=torch.uint8)
    wide[:, 1:] = weight
    with pytest.raises(ValueError, match="weight.contiguous"):
        linear_nvfp4_triton(x, wide[:, 1:], scale, scale_2)
    out = linear_nvfp4_triton(x, wide[:, 1:].contiguous(), scale, scale_2)
    assert torch.equal(out, linear_nvfp4_triton(x, weight, scale, scale_2))
    shifted = torch.zeros(7 * 16 + 1, dtype=torch.uint8)[1:].view(7, 16)    # contiguous, one byte off a word
    shifted.copy_(weight)
    assert not linear_nvfp4.providers["triton"].supports(x, shifted, scale, scale_2)   # `auto` takes the reference
    with pytest.raises(ValueError, match="4-byte boundaries"):
        linear_nvfp4_triton(x, shifted, scale, scale_2)


# --- compiled (GPU) ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("n,k", [(4096, 2048), (2048, 4096)])
@pytest.mark.parametrize("split_k", [False, True])
def test_gpu_matches_reference(dtype, m, n, k, split_k):
    x, *w = nvfp4_inputs(m, n, k, dtype, seed=m, device="cuda")
    check(x, *w, split_k=split_k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k,splits", [(4096, 2048, 1), (4096, 2048, 3), (1000, 4112, 2)])
@pytest.mark.parametrize("x_scale", [1.0, 2.0**-100, 2.0**100], ids=lambda v: f"{v:g}")
@pytest.mark.parametrize("block_n,warps", [(64, 4), (32, 2)])       # TILES_NVFP4's, TILES_NVFP4_LM_HEAD's
def test_gpu_x_pass(n, k, splits, x_scale, block_n, warps, x_pass):
    """The 16-bit-x GEMV with x paired in its programs and by x's own pass, compiled: whole and partial K
    steps, in one slice or several, x of any size."""
    x, *w = nvfp4_inputs(1, n, k, torch.bfloat16, seed=splits, device="cuda")
    x = (x.float() * x_scale).to(torch.bfloat16)
    check(x, *w, plan=make_plan(1, n, k, block_n=block_n, block_k=256, splits=splits, block_m=1, num_warps=warps,
                                num_stages=2))
    exps_pairs = x_pass_reference(x[0].cpu(), k)                  # what the pass writes, one slice
    pairs = torch.full((k // 2,), -1, dtype=torch.int32, device="cuda")
    exps = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    linear_nvfp4_module._x_f16_pairs_kernel[(1, 1)](x, pairs, exps, k, k, k, 1, BLOCK=512, USE_ASM=True,
                                                    PDL=False)
    assert torch.equal(exps.cpu(), exps_pairs[0]) and torch.equal(pairs.cpu(), exps_pairs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,wgmma", [(1, False), (3, False), (3, True), (32, False), (32, True)])
def test_gpu_pdl_reads_this_calls_pairs(m, wgmma, monkeypatch):
    """The kernel launched beside x's pass (`x_pass_pdl`) reads the pairs of its own call (the GEMV at M = 1,
    the rows GEMV, the fp16 dot at M = 32, and the wgmma kernel in the place of the last two on sm_90, on
    the LM heads' plans)."""
    if wgmma and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    monkeypatch.setattr(linear_nvfp4_module, "LM_HEAD_MIN_ELEMENTS", 0)
    monkeypatch.setattr(linear_nvfp4_module, "WGMMA", wgmma)
    n, k = 4096, 2048
    _, *w = nvfp4_inputs(1, n, k, torch.bfloat16, seed=m, device="cuda")
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 2.0 ** (8 * (i % 3) - 8) for i in range(12)]
    plan = default_plan(xs[0], n, k, False)
    assert plan.wgmma if wgmma else uses_f16_gemv(xs[0], plan) or uses_f16_dot(xs[0], n, k, plan)
    assert_pdl_reads_its_own_x(lambda x, out=None: linear_nvfp4_triton(x, *w, out=out), xs, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize("n,k,splits,stages", [(4096, 2048, 1, 2), (1000, 4112, 3, 2), (4096, 2048, 2, 1)])
def test_gpu_rows(m, n, k, splits, stages):
    """The GEMV of several rows, compiled: against the reference with rows 2^120 apart, and row by row equal
    to the M = 1 GEMV bit for bit."""
    x, *w = nvfp4_inputs(m, n, k, torch.bfloat16, seed=m, device="cuda")
    x = (x.float() * torch.exp2(torch.tensor([60.0, -60.0] * 4, device="cuda")[:m, None])).to(torch.bfloat16)
    plan = make_plan(m, n, k, block_n=64, block_k=256, splits=splits, block_m=8, num_stages=stages)
    check(x, *w, plan=plan)
    rows = linear_nvfp4_triton(x, *w, plan=plan)
    one = make_plan(1, n, k, block_n=64, block_k=256, splits=splits, block_m=1, num_stages=stages)
    for r in range(m):
        assert torch.equal(rows[r:r + 1], linear_nvfp4_triton(x[r:r + 1], *w, plan=one)), r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 8, 32])
def test_gpu_every_path(m):
    x, *w = nvfp4_inputs(m, 4096, 2048, torch.bfloat16, seed=m, device="cuda")
    for plan in explicit_plans(m, 4096, 2048, first_block_k=32, fma_m=False):
        check(x, *w, plan=plan)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_every_code_and_scale_decodes():
    # x = rows of the identity read back every column of the [16, 256] weight exactly, on the tl.dot path
    # (16 columns a launch) and on both GEMVs (one a launch): every code pair under every scale pattern
    weight, scale, scale_2 = (t.cuda() for t in _all_codes_and_scales())
    want = dequantize_nvfp4(weight, scale, scale_2).T.to(torch.bfloat16)                 # [256, 16]
    eye = torch.eye(256, device="cuda", dtype=torch.bfloat16)
    f16_gemv = make_plan(1, 16, 256, block_n=16, block_k=64, block_m=1)        # the fp16-sum GEMV's rows
    for m, plan in ((1, None), (1, f16_gemv), (16, None)):
        for first in range(0, 256, m):
            out = linear_nvfp4_triton(eye[first:first + m], weight, scale, scale_2, plan=plan)
            assert torch.equal(out, want[first:first + m]), (m, plan, first)


def _all_codes_and_scales_k512():
    """[N=64, K=512]: `_all_codes_and_scales` four times down N and twice along K, each copy's bytes and scales
    rolled along K (every code pair and scale in other places), for K a multiple of 512 (the wgmma kernel)."""
    weight, scale, scale_2 = _all_codes_and_scales()
    bits = scale.view(torch.uint8)
    weight = torch.cat([torch.cat([weight.roll(r, 1), weight.roll(r + 4, 1)], 1) for r in range(4)])   # [64, 256]
    bits = torch.cat([torch.cat([bits.roll(r, 1), bits.roll(r + 1, 1)], 1) for r in range(4)])        # [64, 32]
    return weight, bits.view(torch.float8_e4m3fn), scale_2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path,m", [("gemv_x_pass", 1), ("rows", 8), ("f16_dot", 32), ("wgmma", 8), ("wgmma", 32)])
def test_gpu_every_code_and_scale_decodes_on_the_16_bit_x_kernels(path, m, monkeypatch):
    """As test_gpu_every_code_and_scale_decodes, on the kernels whose decode is other PTX, compiled: the GEMV of
    one row on x's pass (`_E2M1X16_F16_DOT_PTX`), the GEMV of several rows (`_E2M1X16_F16X2_PTX`, then
    `_F16X2_BLOCK_SUM_PTX` a row), the fp16 dot (`_E2M1X8_F16_SCALED_PTX`, split K) and on sm_90 the wgmma kernel
    (`_E4M3X4_F16X2_PAIRS_PTX` and `_E2M1X8_F16_SCALED_PTX` on its fragments), all on an LM head's plans. Rows of
    the identity pick single columns: each result is one product E2M1 * scale * x * 2^e (exact in fp16), times
    powers of two and weight_scale_2, so every code under every scale must come out exactly, in its place."""
    if path == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    monkeypatch.setattr(linear_nvfp4_module, "LM_HEAD_MIN_ELEMENTS", 0)
    monkeypatch.setattr(linear_nvfp4_module, "WGMMA", path == "wgmma")
    weight, scale, scale_2 = (t.cuda() for t in _all_codes_and_scales_k512())
    n, k = 64, 512
    want = dequantize_nvfp4(weight, scale, scale_2).T.to(torch.bfloat16)                 # [512, 64]
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    split_k = path == "f16_dot"
    plan = (make_plan(m, n, k, block_n=64, block_k=256, block_m=8, num_stages=2) if path == "rows"
            else default_plan(eye[:m], n, k, split_k))
    assert {"gemv_x_pass": uses_f16_gemv(eye[:m], plan) and m == 1, "rows": uses_f16_gemv(eye[:m], plan),
            "f16_dot": uses_f16_dot(eye[:m], n, k, plan) and plan.splits > 1, "wgmma": plan.wgmma}[path], plan
    for first in range(0, k, m):
        out = linear_nvfp4_triton(eye[first:first + m], weight, scale, scale_2, split_k=split_k,
                                  plan=plan if path == "rows" else None)
        assert torch.equal(out, want[first:first + m]), (path, m, first)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_auto_backend_picks_triton(monkeypatch):
    calls = []
    p = linear_nvfp4.providers["triton"]
    monkeypatch.setitem(linear_nvfp4.providers, "triton",
                        dataclasses.replace(p, fn=lambda *a: calls.append(1) or p.fn(*a)))
    x, weight, scale, scale_2 = nvfp4_inputs(4, 4096, 2048, torch.bfloat16, device="cuda")
    with ops.use_backend("auto"):
        y = linear_nvfp4(x, weight, scale, scale_2)
    assert calls == [1]
    sum_rtol = F16_SUM_RTOL if uses_f16_gemv(x, default_plan(x, 4096, 2048, True)) else SUM_RTOL
    assert_matches(y, _linear_nvfp4_native(x, weight, scale, scale_2),
                   x.float().abs() @ dequantize_nvfp4(weight, scale, scale_2).abs().T, sum_rtol=sum_rtol)
