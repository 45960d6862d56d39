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

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import ConfigError
from mtpfactory.kernels.linear import (
    _has_pdl,
    _linear_native,
    _linear_triton_supports,
    linear,
    linear_triton,
    make_plan,
    plan_for,
    x_pass_pdl,
)
from mtpfactory.ops import Provider
from gemv_common import DTYPES, MS, SHAPES, assert_matches, explicit_plans, poisoned


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


def test_strided_input_and_output():
    # x a column slice of a wider activation (row stride 96), out a column slice of a wider buffer.
    x_wide, w = make_inputs(3, 33, 96, torch.bfloat16, seed=5)
    x = x_wide[:, :48]
    w = w[:, :48].contiguous()
    out_wide = torch.full((3, 50), float("nan"), dtype=torch.bfloat16)
    with ops.use_backend("triton"):
        linear_triton(x, w, out=out_wide[:, 10:43])
    assert_matches(out_wide[:, 10:43], _linear_native(x, w), x.float().abs() @ w.float().abs().T)
    assert out_wide[:, :10].isnan().all() and out_wide[:, 43:].isnan().all()


def test_op_dispatch_uses_triton_under_triton_backend(monkeypatch):
    calls = []
    p = linear.providers["triton"]
    monkeypatch.setitem(linear.providers, "triton",
                        Provider("triton", lambda *a: calls.append(1) or p.fn(*a), p.supports))
    x, w = make_inputs(2, 7, 16, torch.bfloat16)
    with ops.use_backend("triton"):
        y = linear(x, w)
    assert calls == [1]
    assert_matches(y, _linear_native(x, w), x.float().abs() @ w.float().abs().T)


def test_supports_refuses_m_over_32_and_auto_falls_back(monkeypatch):
    x33, w = make_inputs(33, 7, 16, torch.bfloat16)
    with ops.use_backend("triton"):
        assert _linear_triton_supports(x33[:32], w)
        assert not _linear_triton_supports(x33, w)
        assert not _linear_triton_supports(x33[:1], w.float())                  # dtypes differ
        assert not _linear_triton_supports(x33[:1], w.t().contiguous().t())     # weight not contiguous
        with pytest.raises(ConfigError, match="linear"):
            linear(x33, w)                                                       # never a silent fallback
    calls = []
    p = linear.providers["triton"]
    monkeypatch.setitem(linear.providers, "triton",
                        Provider("triton", lambda *a: calls.append(1) or p.fn(*a), p.supports))
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


@pytest.mark.parametrize("capability,pdl", [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)])
def test_pdl_only_where_the_gpu_has_it(capability, pdl, monkeypatch):
    """The kernels after x's pass launch beside it only on sm_90 and later (`griddepcontrol` does not assemble
    before: sm_89 runs the NVFP4 and FP8 paths, so it must not get it); never on the CPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    _has_pdl.cache_clear()
    try:
        assert _has_pdl(torch.device("cuda", 0)) is pdl
    finally:
        _has_pdl.cache_clear()
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
                        Provider("triton", lambda *a: calls.append(1) or p.fn(*a), p.supports))
    x, w = make_inputs(4, 4096, 2048, torch.bfloat16, device="cuda")
    with ops.use_backend("auto"):
        y = linear(x, w)
        linear(make_inputs(33, 64, 64, torch.bfloat16, device="cuda")[0], w[:, :64].contiguous())  # M > 32: native
    assert calls == [1]
    assert_matches(y, _linear_native(x.float(), w.float()).to(torch.bfloat16), x.float().abs() @ w.float().abs().T)
