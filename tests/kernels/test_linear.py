"""BF16 / FP16 / FP32 GEMV and small-M GEMM (`linear`): the Triton provider against the reference.

On the CPU the kernels run under Triton's interpreter (tests/conftest.py) at tiny odd shapes; the `gpu`
tests repeat the comparisons compiled, at real shapes (`pytest -m gpu` on the device machine).

Tolerance: kernel and reference both sum exact products in fp32, in different orders, so they differ by
a few fp32 roundings of the partial sums: bounded by 1e-5 * sum_k |x||w| (K <= 4096: K * 2^-24 ~ 2.4e-4
worst case, ~sqrt(K) * 2^-24 in practice), and then by one rounding of the output dtype, which can land
the two on adjacent values: 2^-7 (~1e-2) of |y| for bf16, 2^-10 (~1e-3) for fp16, ~1e-5 for fp32. An
element the kernel gets wrong (a K tile dropped or counted twice, a wrong row) is off by O(sum |x||w|).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import ConfigError, InputError, WeightsError
from mtpfactory.kernels.linear import (
    TILES_16BIT,
    TILES_FP8,
    TMA_MAX_N,
    TMA_MIN_N,
    TMA_TILE,
    GemvPlan,
    has_pdl,
    _linear_native,
    linear,
    linear_triton,
    make_plan,
    plan_for,
    plan_shape_refusal,
    x_pass_pdl,
)
from mtpfactory.kernels.linear_fp8 import linear_fp8
from backend_refusal import storage_bytes
from gemv_common import DTYPES, MS, SHAPES, assert_matches, explicit_plans, poisoned

linear_module = importlib.import_module("mtpfactory.kernels.linear")   # the package exports the Op as `linear`


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)               # [M, K]
    w = torch.randn(n, k, generator=gen).to(dtype)               # [N, K]
    return x.to(device), w.to(device)


def check(x: torch.Tensor, w: torch.Tensor, **kwargs) -> torch.Tensor:
    out = linear_triton(x, w, out=poisoned(x.shape[0], w.shape[0], x.dtype, x.device.type), **kwargs)
    ref = _linear_native(x, w)
    assert_matches(out, ref, x.float().abs() @ w.float().abs().T)
    return out


# --- interpreted (CPU) -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_reference_with_explicit_tiles(dtype, m, n, k):
    x, w = make_inputs(m, n, k, dtype, seed=m * 1000 + n)
    with ops.use_backend("triton"):
        for plan in explicit_plans(m, n, k):
            check(x, w, plan=plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 7, 1024), (3, 33, 48), (17, 130, 80), (32, 5, 512)])
@pytest.mark.parametrize("split_k", [False, True])
def test_matches_reference_with_planned_tiles(dtype, m, n, k, split_k):
    x, w = make_inputs(m, n, k, dtype, seed=n + k)
    with ops.use_backend("triton"):
        check(x, w, split_k=split_k)


def test_planned_split_k_splits_tall_skinny_weights():
    assert plan_for(8, 2048, 4096, False).splits == 1
    fc = plan_for(8, 2048, 4096, True)                       # the fc of an MTP head: [2048, 4096]
    assert fc.splits > 1 and fc.k_per_split % fc.block_k == 0 and fc.splits * fc.k_per_split >= 4096
    assert plan_for(1, 2048, 4096, True).splits == 1         # a GEMV fills the SMs with narrow N tiles instead
    assert plan_for(32, 5, 512, True).splits > 1             # the planned split-K case tested above


@pytest.mark.parametrize("m", [1, 17])
def test_split_k_agrees_with_unsplit(m):
    x, w = make_inputs(m, 33, 80, torch.float32, seed=3)
    with ops.use_backend("triton"):
        whole = linear_triton(x, w, plan=make_plan(m, 33, 80, block_n=16, block_k=16))
        split = linear_triton(x, w, plan=make_plan(m, 33, 80, block_n=16, block_k=16, splits=5))
    assert_matches(split, whole, x.abs() @ w.abs().T)


@pytest.mark.parametrize("m", [3, 17])                      # the FMA path, the dot path
def test_strided_input_and_output(m):
    # x a column slice of a wider activation (row stride 96); out a column slice of a wider buffer, and the
    # transpose of a poisoned [N, M] buffer (columns M apart: the kernels step along N by out's stride).
    x_wide, w = make_inputs(m, 33, 96, torch.bfloat16, seed=5)
    x = x_wide[:, :48]
    w = w[:, :48].contiguous()
    ref, abs_sum = _linear_native(x, w), x.float().abs() @ w.float().abs().T
    out_wide = torch.full((m, 50), float("nan"), dtype=torch.bfloat16)
    out_t = torch.full((33, m), float("nan"), dtype=torch.bfloat16)
    with ops.use_backend("triton"):
        linear_triton(x, w, out=out_wide[:, 10:43])
        linear_triton(x, w, out=out_t.T)
    assert_matches(out_wide[:, 10:43], ref, abs_sum)
    assert out_wide[:, :10].isnan().all() and out_wide[:, 43:].isnan().all()
    assert_matches(out_t.T, ref, abs_sum)


@pytest.mark.parametrize("m", [1, 3, 17])                     # GEMV, FMA rows, tl.dot
def test_input_strided_along_k(m):
    """x every other column of a wider activation (stride 2 along K; x takes any strides): the slice above has
    unit stride along K, so a kernel that stepped x's K by 1 passed it. Every explicit plan's path
    (`explicit_plans`)."""
    x_wide, w = make_inputs(m, 33, 96, torch.bfloat16, seed=7)
    x = x_wide[:, ::2]
    w = w[:, :48].contiguous()
    assert x.stride(1) == 2
    for plan in explicit_plans(m, 33, 48):
        with ops.use_backend("triton"):
            check(x, w, plan=plan)


def test_out_rows_further_apart_than_int32_indexes_are_written_right():
    """The kernels index out in int32 (row * stride): an out whose rows lie 2^30 elements apart (row 2 at 2^31)
    is written through a contiguous stand-in and copied in, not at a wrapped offset (2^32 elements before out:
    the interpreter crashed). The 4 GiB behind out are only reserved, never touched."""
    x, w = make_inputs(3, 16, 32, torch.bfloat16, seed=6)
    far = torch.empty_strided((3, 16), (2**30, 1), dtype=torch.bfloat16).fill_(float("nan"))
    with ops.use_backend("triton"):
        assert linear_triton(x, w, out=far) is far
        assert torch.equal(far, linear_triton(x, w))


def test_an_explicit_plan_for_k_0_is_taken():
    """K = 0 reads nothing: make_plan's plan for it (one slice) runs, as the planner's does, and gives zeros."""
    x, w = torch.zeros(2, 0), torch.zeros(5, 0)
    out = torch.full((2, 5), float("nan"))
    assert linear_triton(x, w, plan=make_plan(2, 5, 0, block_n=8, block_k=16), out=out) is out
    assert bool((out == 0).all())


def tma_plan(m: int, n: int, k: int, block_n: int = 64, block_k: int = 128, stages: int = 4):
    return make_plan(m, n, k, block_n, block_k, num_warps=4, num_stages=stages, tma=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k", [(2, 64, 128), (5, 100, 200), (17, 130, 48), (32, 70, 264)])
def test_tma_kernel_matches_reference(dtype, m, n, k):
    """The TMA kernel under the interpreter: N and K off its 64 x 128 tiles (rows and K past the ends read
    as zeros), 16 and 32 rows of x a block, poisoned out; and on 32 x 64 tiles of 2 stages."""
    x, w = make_inputs(m, n, k, dtype, seed=m + n + k)
    check(x, w, plan=tma_plan(m, n, k))
    check(x, w, plan=tma_plan(m, n, k, block_n=32, block_k=64, stages=2))


def test_planner_gives_projections_the_tma_kernel():
    """16-bit weights of TMA_MIN_N to TMA_MAX_N rows at M = 2-32, where the call can run it; never M = 1,
    the LM heads (their pointer dot is as fast), small weights, FP8 weights or a call that cannot."""
    t = TMA_TILE
    for m in (2, 8, 16, 17, 32):
        p = plan_for(m, 8192, 2048, True, tma=True)
        assert p.tma and (p.block_n, p.block_k, p.num_warps, p.num_stages, p.splits) == (t.block_n, t.block_k,
                                                                                         t.warps, t.stages, 1)
        assert not plan_for(m, 8192, 2048, True).tma
    assert plan_for(8, TMA_MIN_N, 2048, True, tma=True).tma and plan_for(8, TMA_MAX_N, 2048, True, tma=True).tma
    assert plan_for(8, TMA_MAX_N, 2048, True).block_n < 128 == plan_for(8, TMA_MAX_N + 1, 2048, True).block_n
    for m, n in ((1, 8192), (8, TMA_MIN_N - 1), (8, TMA_MAX_N + 1), (32, 151936), (32, 2048)):
        assert not plan_for(m, n, 2048, True, tma=True).tma, (m, n)
    assert not plan_for(8, 8192, 2048, True, TILES_FP8, tma=True).tma


def test_the_planner_plans_tma_only_where_the_call_can_run_it(monkeypatch):
    seen = []
    monkeypatch.setattr(linear_module, "plan_for", lambda *a: seen.append(a[-1]) or plan_for(*a[:-1]))
    x, w = make_inputs(4, 16, 64, torch.bfloat16)
    linear_triton(x, w)                                       # 16-bit, aligned: the planner may give TMA tiles
    linear_triton(x.float(), w.float())                       # fp32: it may not
    linear_triton(torch.zeros(4, 68, dtype=torch.bfloat16)[:, :64], w)     # rows 136 bytes apart: not
    monkeypatch.setattr(linear_module, "TMA", False)
    linear_triton(x, w)
    assert seen == [True, False, False, False]


def test_tma_plans_it_cannot_run_are_refused():
    """Each refused call names its reason and writes nothing into the out it was given."""
    x, w = make_inputs(4, 70, 64, torch.bfloat16)
    cases = [(x.float(), w.float(), tma_plan(4, 70, 64), r"x torch.float32.*16-bit x and weight"),
             (torch.zeros(4, 68, dtype=torch.bfloat16)[:, :64], w, tma_plan(4, 70, 64),
              r"x starts 0 bytes past a 16-byte boundary, with strides \(68, 1\).*rows a multiple of 16 bytes apart"),
             (x, w, dataclasses.replace(make_plan(4, 70, 64, 64, 32, splits=2), tma=True),
              r"2 K slices and block_m 16 for M = 4: it takes one K slice"),
             (x[:1], w, tma_plan(1, 70, 64), r"M = 1: it takes 2 to 32 rows"),
             (torch.cat([x] * 5), w, tma_plan(16, 70, 64), r"block_m 16 for M = 20.*block_m at least M"),
             (x[:, :0], w[:, :0], tma_plan(4, 70, 0), r"K = 0: a TMA descriptor takes no empty dimension")]
    for xi, wi, plan, match in cases:
        out = torch.full((xi.shape[0], 70), 7.0, dtype=xi.dtype)
        with pytest.raises(ValueError, match=match):
            linear_triton(xi, wi, plan=plan, out=out)
        assert bool((out == 7.0).all()), match


@pytest.mark.parametrize("m, block_m", [(4, 2), (20, 16)])  # the CUDA-core path; the dot path
def test_plans_whose_block_m_is_under_m_are_refused(m, block_m):
    """The grid has no M axis: a given plan's tile must hold every row of x, or the rest stay unwritten."""
    x, w = make_inputs(m, 7, 16, torch.float32)
    out = torch.full((m, 7), 7.0)
    with pytest.raises(InputError, match=f"plan.block_m={block_m}: must be at least M = {m}"):
        linear_triton(x, w, plan=make_plan(m, 7, 16, 8, 16, block_m=block_m), out=out)
    assert bool((out == 7.0).all())


def test_operands_the_kernels_cannot_take_are_refused_by_the_provider_as_by_the_predicate():
    """One rule (`operand_refusal`) for the predicate and the provider: each operand named, nothing written."""
    x, w = make_inputs(2, 7, 16, torch.float32)
    f8 = w.to(torch.float8_e4m3fn)
    cases = [((x, w[:, :8]), r"^weight='torch.float32 \(7, 8\), strides \(16, 1\)': a torch.float32 \[N, K = 16\]"),
             ((x, w.t().contiguous().t()), r"^weight=.*strides \(1, 7\)'.*unit stride along K"),
             ((x, w.bfloat16()), r"^weight='torch.bfloat16 .*: a torch.float32 \[N, K = 16\]"),
             ((torch.cat([x] * 17), w), r"^x='34 rows': the linear kernels take up to 32"),
             ((x[0], w), r"^x='torch.float32 \(16,\)': a 2-D"),
             ((x.double(), w.double()), r"^x='torch.float64 .*: a 2-D bf16, fp16 or fp32"),
             ((x, f8, torch.ones(7, dtype=torch.float64)),
              r"^weight_scale='torch.float64 \(7,\)'.*float32 \[N\] = \[7\]"),
             ((x, f8, torch.ones(8)), r"^weight_scale='torch.float32 \(8,\)'"),
             ((x, w, torch.ones(7)), r"^weight='torch.float32 .*: a torch.float8_e4m3fn \[N, K = 16\]")]
    for args, match in cases:
        with ops.use_backend("triton"):
            assert not (linear.providers["triton"].supports(*args) if len(args) == 2 else
                        linear_fp8.providers["triton"].supports(*args))
        out = torch.full((args[0].shape[0] if args[0].dim() == 2 else 1, 7), 7.0, dtype=args[0].dtype)
        with pytest.raises((InputError, WeightsError), match=match):
            linear_triton(args[0], args[1], weight_scale=args[2] if len(args) == 3 else None, out=out)
        assert bool((out == 7.0).all()), match


def test_calls_whose_x_or_out_int32_cannot_index_are_refused():
    """The kernels index x and out in int32: an out of 2^31 elements (32 rows of a weight of 2^26 rows) and an
    x of 2^31 (32 rows of K = 2^26) are refused by the predicate and the provider, naming the tensor and the
    fix, before anything is allocated or launched (the provider launched them: offsets past 2^31 wrap). The
    weights are expanded or only reserved, never touched."""
    wide = torch.ones(1, 16).expand(2**26, 16)                         # N = 2^26 rows, one row's memory
    long_x = torch.empty(1, 2**26, dtype=torch.bfloat16).expand(32, 2**26)
    for x, w, match in ((torch.ones(32, 16), wide, r"^out='\[32, 67108864\] \(2147483648 elements, N = 67108864\)': "
                         r"fewer than 2\^31 elements: the linear kernels index out in int32.*split the weight's rows"),
                        (long_x, long_x[:1], r"^x='\[32, 67108864\] \(2147483648 elements, K = 67108864\)'.*"
                         r"index x in int32.*split the weight's K")):
        with ops.use_backend("triton"):
            assert not linear.providers["triton"].supports(x, w)
        with pytest.raises(InputError, match=match):
            linear_triton(x, w)
    with ops.use_backend("triton"):                                     # one row fewer: taken
        assert linear.providers["triton"].supports(torch.ones(31, 16), wide)


def test_a_weight_with_rows_apart_is_taken():
    """A weight that is a column slice of a wider tensor (unit stride along K, rows 24 apart): the kernels step
    between rows by its stride, so the predicate takes it and the result is the reference's."""
    x, w = make_inputs(3, 7, 24, torch.float32)
    with ops.use_backend("triton"):
        assert linear.providers["triton"].supports(x[:, :16], w[:, :16])
        y = linear(x[:, :16], w[:, :16])
    assert_matches(y, _linear_native(x[:, :16], w[:, :16]), x[:, :16].abs() @ w[:, :16].abs().T)


@pytest.mark.parametrize("plan_k, splits, k_per_split", [(16, 1, 16), (32, 3, 12)])
def test_plans_that_do_not_cover_k_in_whole_steps_are_refused(plan_k, splits, k_per_split):
    """A plan made for a shorter K leaves K past its slices unread, and slices that are not whole block_k steps
    overlap: both refused before anything is written."""
    x, w = make_inputs(2, 7, 32, torch.float32)
    plan = dataclasses.replace(make_plan(2, 7, plan_k, 8, 16), splits=splits, k_per_split=k_per_split)
    out = torch.full((2, 7), 7.0)
    with pytest.raises(InputError, match=f"plan='{splits} K slices of {k_per_split}'.*cover K = 32"):
        linear_triton(x, w, plan=plan, out=out)
    assert bool((out == 7.0).all())


# (M, a plan Triton cannot build, the field its refusal names): tiles that are not powers of two (tl.arange and
# block shapes; TMA's TensorDescriptor) or empty, a dot of K < 16 (runs interpreted, fails to compile for the
# GPU), a TMA block of 8 bytes a row or past 256 a side, a tile past Triton's largest tensor, no K slice, 3 warps,
# no stage.
BAD_PLANS = [
    (1, make_plan(1, 70, 64, block_n=24, block_k=16), "plan.block_n"),
    (1, make_plan(1, 70, 64, block_n=16, block_k=48), "plan.block_k"),
    (3, make_plan(3, 70, 64, block_n=16, block_k=16, block_m=3), "plan.block_m"),
    (4, make_plan(4, 70, 64, block_n=16, block_k=16, block_m=64), "plan.block_m"),
    (1, GemvPlan(1, 16, 0, 1, 64), "plan.block_k"),
    (1, GemvPlan(1, 0, 16, 1, 64), "plan.block_n"),
    (4, make_plan(4, 70, 64, block_n=16, block_k=8), "plan.block_k"),
    (4, make_plan(4, 70, 64, 24, 128, tma=True), "plan.block_n"),
    (4, make_plan(4, 70, 64, 64, 128, block_m=24, tma=True), "plan.block_m"),
    (4, make_plan(4, 70, 64, 64, 4, tma=True), "plan.block_k"),
    (4, make_plan(4, 70, 64, 512, 64, tma=True), "plan.block_n"),
    (4, make_plan(4, 70, 512, 64, 512, tma=True), "plan.block_k"),
    (1, make_plan(1, 70, 64, block_n=2048, block_k=1024), "plan"),
    (1, dataclasses.replace(make_plan(1, 70, 64, block_n=16, block_k=16), splits=0), "plan.splits"),
    (1, make_plan(1, 70, 64, block_n=16, block_k=16, num_warps=3), "plan.num_warps"),
    (1, make_plan(1, 70, 64, block_n=16, block_k=16, num_stages=0), "plan.num_stages"),
]
BAD_PLAN_IDS = ["bn24", "bk48", "bm3", "bm64", "bk0", "bn0", "dot_bk8", "tma_bn24", "tma_bm24", "tma_bk4",
                "tma_bn512", "tma_bk512", "numel",
                "splits0", "warps3", "stages0"]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("m,plan,field", BAD_PLANS, ids=BAD_PLAN_IDS)
def test_plans_triton_cannot_build_are_refused(m, plan, field, fp8):
    """One rule (`plan_shape_refusal`) for every given plan, checked before its K slices: each plan Triton
    cannot build is refused naming the plan's field and value (these used to crash in the interpreter, divide
    by zero, or fail in TensorDescriptor or the GPU compile), and nothing is written."""
    x, w = make_inputs(m, 70, 64, torch.bfloat16)
    scale = None
    if fp8:
        w, scale = w.to(torch.float8_e4m3fn), torch.ones(70)
    out = torch.full((m, 70), 7.0, dtype=torch.bfloat16)
    with ops.use_backend("triton"), pytest.raises(InputError) as err:
        linear_triton(x, w, plan=plan, out=out, weight_scale=scale)
    assert err.value.field == field, str(err.value)
    if field != "plan":
        assert err.value.value == getattr(plan, field.removeprefix("plan."))
    assert plan_shape_refusal(plan) is not None
    assert bool((out == 7.0).all())


def test_the_planners_plans_are_plans_triton_can_build():
    """`plan_shape_refusal` refuses nothing the planner makes (every M, the tests' shapes and the GPU's, split
    or not, both tile tables, TMA or not) nor the tests' own explicit plans."""
    shapes = SHAPES + GPU_SHAPES + [(7, 1024), (5, 512), (1000, 1000), (151936, 2048), (TMA_MIN_N, 2048),
                                    (TMA_MAX_N, 2048), (TMA_MAX_N + 1, 4096), (8, 0)]
    for n, k in shapes:
        for m in range(1, 33):
            for split_k in (False, True):
                for tiles in (TILES_16BIT, TILES_FP8):
                    for tma in (False, True):
                        plan = plan_for(m, n, k, split_k, tiles, tma)
                        assert plan_shape_refusal(plan) is None, (m, n, k, split_k, tma, plan)
    for m in MS:
        for n, k in SHAPES:
            for plan in explicit_plans(m, n, k) + [tma_plan(m, n, k), tma_plan(m, n, k, 32, 64, 2)]:
                assert plan_shape_refusal(plan) is None, (m, n, k, plan)


def test_op_dispatch_uses_triton_under_triton_backend(monkeypatch):
    calls = []
    p = linear.providers["triton"]
    monkeypatch.setitem(linear.providers, "triton",
                        dataclasses.replace(p, fn=lambda *a: calls.append(1) or p.fn(*a)))
    x, w = make_inputs(2, 7, 16, torch.bfloat16)
    with ops.use_backend("triton"):
        y = linear(x, w)
    assert calls == [1]
    assert_matches(y, _linear_native(x, w), x.float().abs() @ w.float().abs().T)


def test_supports_refuses_m_over_32_and_auto_falls_back(monkeypatch):
    x33, w = make_inputs(33, 7, 16, torch.bfloat16)
    with ops.use_backend("triton"):
        assert linear.providers["triton"].supports(x33[:32], w)
        assert not linear.providers["triton"].supports(x33, w)
        assert not linear.providers["triton"].supports(x33[:1], w.float())                  # dtypes differ
        assert not linear.providers["triton"].supports(x33[:1], w.t().contiguous().t())     # weight not contiguous
        with pytest.raises(ConfigError, match="linear"):
            linear(x33, w)                                                       # never a silent fallback
    calls = []
    p = linear.providers["triton"]
    monkeypatch.setitem(linear.providers, "triton",
                        dataclasses.replace(p, fn=lambda *a: calls.append(1) or p.fn(*a)))
    with ops.use_backend("auto"):
        y = linear(x33, w)
    assert calls == [] and torch.equal(y, _linear_native(x33, w))


def test_out_is_checked_and_empty_m():
    x, w = make_inputs(2, 7, 16, torch.float32)
    with ops.use_backend("triton"):
        with pytest.raises(ValueError, match="out"):
            linear_triton(x, w, out=torch.empty(2, 8))
        with pytest.raises(ValueError, match="out"):
            linear_triton(x, w, out=torch.empty(2, 7, dtype=torch.bfloat16))
        assert linear_triton(x[:0], w).shape == (0, 7)


@pytest.mark.parametrize("shares", ["x", "weight"])
def test_an_out_sharing_memory_with_an_operand_is_refused(shares):
    """`out`, which only `linear_triton` takes (the op returns a new tensor): x itself (N = K: program 0 wrote
    its columns of out over x while the next programs still read x, off by 613) or laid over the weight's rows
    (off by 18) is refused naming both, before anything is written."""
    x, w = make_inputs(1, 64, 64, torch.float32)
    out = x if shares == "x" else w.view(-1)[16 * 64:][:64].view(1, 64)
    before = [storage_bytes(t) for t in (x, w)]
    with pytest.raises(InputError, match=f"^out='memory shared with {shares}'.*pass an out of its own"):
        linear_triton(x, w, out=out)
    assert all(torch.equal(storage_bytes(t), b) for t, b in zip((x, w), before))


@pytest.mark.parametrize("capability,pdl", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)])
def test_pdl_only_where_the_gpu_has_it(capability, pdl, monkeypatch):
    """The kernels after x's pass launch beside it only on sm_90 and later (`griddepcontrol` does not assemble
    before: sm_89 runs the NVFP4 and FP8 paths, so it must not get it); never on the CPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    has_pdl.cache_clear()
    try:
        assert has_pdl(torch.device("cuda", 0)) is pdl
    finally:
        has_pdl.cache_clear()
    assert x_pass_pdl(torch.zeros(1, 16)) is False


# --- compiled (GPU) ----------------------------------------------------------------------------------------------

GPU_SHAPES = [(4096, 2048), (2048, 4096)]            # (N, K): a projection, and the tall-skinny fc


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("split_k", [False, True])
def test_gpu_matches_reference(dtype, m, n, k, split_k):
    x, w = make_inputs(m, n, k, dtype, seed=m, device="cuda")
    out = linear_triton(x, w, split_k=split_k, out=poisoned(m, n, dtype, "cuda"))
    ref = _linear_native(x.float(), w.float()).to(dtype)          # fp32 oracle: cuBLAS may reduce in bf16
    assert_matches(out, ref, x.float().abs() @ w.float().abs().T)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 8, 32])
def test_gpu_every_path(m):
    x, w = make_inputs(m, 4096, 2048, torch.bfloat16, seed=m, device="cuda")
    for plan in explicit_plans(m, 4096, 2048):
        out = linear_triton(x, w, plan=plan, out=poisoned(m, 4096, torch.bfloat16, "cuda"))
        ref = _linear_native(x.float(), w.float()).to(torch.bfloat16)
        assert_matches(out, ref, x.float().abs() @ w.float().abs().T)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_auto_backend_picks_triton(monkeypatch):
    calls = []
    p = linear.providers["triton"]
    monkeypatch.setitem(linear.providers, "triton",
                        dataclasses.replace(p, fn=lambda *a: calls.append(1) or p.fn(*a)))
    x, w = make_inputs(4, 4096, 2048, torch.bfloat16, device="cuda")
    with ops.use_backend("auto"):
        y = linear(x, w)
        linear(make_inputs(33, 64, 64, torch.bfloat16, device="cuda")[0], w[:, :64].contiguous())  # M > 32: native
    assert calls == [1]
    assert_matches(y, _linear_native(x.float(), w.float()).to(torch.bfloat16), x.float().abs() @ w.float().abs().T)


def _has_tma_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_tma_gpu(), reason="needs a GPU with TMA (sm_90 on)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [2, 8, 17, 32])
def test_gpu_projections_run_the_tma_kernel(dtype, m, monkeypatch):
    """q_proj's shape (8192 x 2048) through the planner, which plans the TMA kernel; poisoned out."""
    n, k = 8192, 2048
    x, w = make_inputs(m, n, k, dtype, seed=m, device="cuda")
    plans = []
    real = linear_module.plan_for
    monkeypatch.setattr(linear_module, "plan_for", lambda *a: plans.append(real(*a)) or plans[-1])
    out = linear_triton(x, w, split_k=True, out=poisoned(m, n, dtype, "cuda"))
    assert plans[-1].tma
    assert_matches(out, _linear_native(x.float(), w.float()).to(dtype), x.float().abs() @ w.float().abs().T)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_tma_gpu(), reason="needs a GPU with TMA (sm_90 on)")
@pytest.mark.parametrize("m", [3, 16, 32])
def test_gpu_tma_kernel_on_odd_shapes(m):
    """N and K off the tiles (1000 x 1000: rows and K past the ends come in as zeros), two tiles; and an x
    whose rows are not 16-byte multiples apart, which the planner sends to the pointer-loaded dot."""
    x, w = make_inputs(m, 1000, 1000, torch.bfloat16, seed=m, device="cuda")
    bound = x.float().abs() @ w.float().abs().T
    ref = _linear_native(x.float(), w.float()).to(torch.bfloat16)
    for plan in (tma_plan(m, 1000, 1000), tma_plan(m, 1000, 1000, block_n=128, block_k=64, stages=3)):
        assert_matches(linear_triton(x, w, plan=plan, out=poisoned(m, 1000, torch.bfloat16, "cuda")), ref, bound)
    x2, w2 = make_inputs(m, 8192, 2048, torch.bfloat16, seed=m, device="cuda")
    wide = torch.zeros(m, 2052, dtype=torch.bfloat16, device="cuda")
    wide[:, :2048] = x2
    xs = wide[:, :2048]                                          # rows 4104 bytes apart
    assert linear_module.tma_refusal(xs, w2, False) is not None
    assert_matches(linear_triton(xs, w2, out=poisoned(m, 8192, torch.bfloat16, "cuda")),
                   _linear_native(x2.float(), w2.float()).to(torch.bfloat16), x2.float().abs() @ w2.float().abs().T)
