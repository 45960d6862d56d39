"""The final RMSNorm with the NVFP4 LM head after it (`rms_norm_linear_nvfp4`): the norm's x pass
(`rms_norm_triton(x_pairs=...)`) bit for bit against x's pass's reference, the op's Triton provider against
its reference (tolerances: test_rms_norm.py's for the norm, test_linear_nvfp4.py's fp16-sum bound for the
logits) and bit for bit against the two Triton providers in turn.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import ConfigError, InputError, WeightsError
from mtpfactory.kernels.linear_nvfp4 import XPairs, linear_nvfp4_triton, x_pass_split
from mtpfactory.kernels.rms_norm import rms_norm_triton
from mtpfactory.kernels.rms_norm_linear_nvfp4 import (
    rms_norm_linear_nvfp4,
    rms_norm_linear_nvfp4_triton,
)
from mtpfactory.quant import dequantize_nvfp4
from gemv_common import F16_SUM_RTOL, assert_matches, assert_pdl_reads_its_own_x, nvfp4_inputs, x_pass_reference
from norm_cases import NORM_CASES, bad_norm_operands

linear_nvfp4_module = importlib.import_module("mtpfactory.kernels.linear_nvfp4")   # the package exports the Op
fused_module = importlib.import_module("mtpfactory.kernels.rms_norm_linear_nvfp4")


@pytest.fixture
def x_pass_everywhere(monkeypatch):
    """Every weight counts as an LM head: up to GEMV_MAX_ROWS rows run the GEMV of several rows, one row runs
    x's pass too, and 17 or more rows the fp16 dot on x's pass."""
    monkeypatch.setattr(linear_nvfp4_module, "LM_HEAD_MIN_ELEMENTS", 0)


def poisoned_pairs(m: int, k: int, k_per_split: int) -> XPairs:
    x_pairs = XPairs.empty(m, k, k_per_split, torch.device("cpu"))
    x_pairs.pairs.fill_(-1)
    x_pairs.exps.fill_(-1)
    return x_pairs


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("w_scale", [1.0, 2.0**-100, 2.0**100], ids=lambda v: f"w{v:g}")
def test_norm_makes_x_pass_of_its_output(w_scale, residual):
    """The norm of x [4, 48] (slices of 32, a partial last one; BLOCK_H 64 holds 16 masked columns) writes
    into poisoned buffers what x's pass writes for its output, bit for bit, and the same output as without
    the pairs. The weight's scale moves the output far from 1 (the exponents with it), and row 2 is zero
    (its exponents 127). Each other row's largest output is its column 32, the first of the second slice, 4
    times or more the first slice's largest: a slice reaching one column too far takes its exponent."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 48, generator=gen).to(torch.bfloat16)
    x[:, 32] = 8 * x.abs().max()
    x[2] = 0.0
    res = torch.randn(4, 48, generator=gen).to(torch.bfloat16) if residual else None
    if res is not None:
        res[2] = 0.0
    w = (torch.randn(48, generator=gen) * w_scale).to(torch.bfloat16)
    w[32] = w.abs().max()
    x_pairs = poisoned_pairs(4, 48, 32)
    with ops.use_backend("triton"):
        got = rms_norm_triton(x, w, 1e-6, False, res, x_pairs=x_pairs)
        want = rms_norm_triton(x, w, 1e-6, False, res)
    y = got[0] if residual else got
    assert (y[[0, 1, 3], 32].float().abs() >= 4 * y[[0, 1, 3], :32].float().abs().amax(dim=1)).all()
    for a, b in zip(got if residual else [got], want if residual else [want]):
        assert torch.equal(a, b)
    assert y[2].eq(0).all() and x_pairs.exps[2].eq(127).all()
    for row in range(4):
        want_exps, want_pairs = x_pass_reference(y[row], 32)
        assert torch.equal(x_pairs.exps[row], want_exps), row
        assert torch.equal(x_pairs.pairs[row], want_pairs), row


def test_norm_refuses_pairs_it_cannot_make():
    """Pairs of another shape, slices that are not whole words, and rows that are not whole NVFP4 blocks are
    refused, naming x_pairs, and nothing is written."""
    x, w = torch.randn(2, 48).to(torch.bfloat16), torch.ones(48, dtype=torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    with ops.use_backend("triton"):
        for bad, what in ((poisoned_pairs(3, 48, 32), r"pairs \(3, 24\)"),
                          (XPairs(torch.empty(2, 24, dtype=torch.int32), torch.empty(2, 4, dtype=torch.int32), 12),
                           "k_per_split = 12"),
                          (XPairs(torch.empty(2, 24, dtype=torch.int32), torch.empty(2, 3), 16), "float32")):
            with pytest.raises(ValueError, match="x_pairs") as err:
                rms_norm_triton(x, w, 1e-6, True, out=out, x_pairs=bad)
            assert err.match(what)
        with pytest.raises(ValueError, match="x_pairs: H = 40"):
            rms_norm_triton(x[:, :40].contiguous(), w[:40], 1e-6, True, out=out[:, :40].contiguous(),
                            x_pairs=poisoned_pairs(2, 40, 8))
    assert out.isnan().all()


def test_gemv_refuses_pairs_of_another_plan(x_pass_everywhere):
    """The GEMV takes only the pairs its plan's pass would make: other slices, or a plan without x's pass
    (fp32 x on the tensor cores), are refused naming x_pairs and what the call needs; out stays unwritten."""
    x, *w = nvfp4_inputs(1, 33, 208, torch.bfloat16)
    out = torch.full((1, 33), float("nan"), dtype=torch.bfloat16)
    split = x_pass_split(x, 33, 208, True)
    with ops.use_backend("triton"):
        with pytest.raises(ValueError,
                           match=f"x_pairs: .*k_per_split {split + 16}, order 0; .*k_per_split {split}, order 0"):
            linear_nvfp4_triton(x, *w, split_k=True, out=out, x_pairs=poisoned_pairs(1, 208, split + 16))
        x5 = torch.randn(5, 208)
        assert x_pass_split(x5, 33, 208, True) is None
        with pytest.raises(ValueError, match="x_pairs: given for .* whose plan runs no x pass"):
            linear_nvfp4_triton(x5, *w, split_k=True, x_pairs=poisoned_pairs(5, 208, 208))
    assert out.isnan().all()


def _inputs(m: int, n: int, k: int, seed: int, residual: bool):
    x, *w = nvfp4_inputs(m, n, k, torch.bfloat16, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    res = torch.randn(m, k, generator=gen).to(torch.bfloat16) if residual else None
    norm_w = (0.5 * torch.randn(k, generator=gen)).to(torch.bfloat16)
    return x, norm_w, w, res


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("m,lm_head", [(1, True), (3, True), (17, True), (1, False), (17, False)])
def test_fused_matches_reference_and_the_two_providers(m, lm_head, residual, monkeypatch):
    """On an LM head's plans (every weight counted as one) the norm makes x's pass for the GEMV at M = 1 and 3
    and for the fp16 dot at M = 17 (K = 208 in the plan's slices); on a small weight's plans no call runs a
    pass. The norm equals the reference's within test_rms_norm.py's bound (one 16-bit ulp, in at most 1% of
    the elements), the sum exactly, the logits within the fp16-sum bound of the provider's own norm through
    the dequantized weight, the reference's within the fp32-sum bound of its own norm's; and everything equals
    rms_norm_triton then linear_nvfp4_triton bit for bit."""
    if lm_head:
        monkeypatch.setattr(linear_nvfp4_module, "LM_HEAD_MIN_ELEMENTS", 0)
    x, norm_w, w, res = _inputs(m, 33, 208, m, residual)
    args = (x, norm_w, 1e-6, True, *w)
    assert (x_pass_split(x, 33, 208, True) is not None) == lm_head
    with ops.use_backend("triton"):
        got = rms_norm_linear_nvfp4(*args, residual=res)
        normed = rms_norm_triton(x, norm_w, 1e-6, True, res)
        y = normed[0] if residual else normed
        apart = (linear_nvfp4_triton(y, *w, split_k=True), *(normed if residual else [normed]))
    want = rms_norm_linear_nvfp4.reference(*args, residual=res)
    assert len(got) == len(want) == (3 if residual else 2)
    for a, b in zip(got, apart):
        assert torch.equal(a, b)
    y_want = want[1]
    torch.testing.assert_close(got[1], y_want, rtol=2.0**-7, atol=0)
    assert (got[1] != y_want).sum() <= max(1, y_want.numel() // 100)
    if residual:
        assert torch.equal(got[2], want[2])
    wd = dequantize_nvfp4(*w)
    assert_matches(got[0], (got[1].float() @ wd.T).to(torch.bfloat16), got[1].float().abs() @ wd.abs().T,
                   sum_rtol=F16_SUM_RTOL)
    # and the reference's logits are its own norm's through the dequantized weight (fp32 sums)
    assert_matches(want[0], (want[1].float() @ wd.T).to(torch.bfloat16), want[1].float().abs() @ wd.abs().T)


def test_dispatch_and_refusal():
    """`auto` on the CPU takes the reference; an explicit `triton` that cannot serve the call (3-D x) raises
    naming the op; the provider called directly refuses NVFP4 operands the GEMV cannot take (fp32 scales)
    as `linear_nvfp4_triton` does, naming the tensor."""
    x, norm_w, w, res = _inputs(2, 7, 32, 0, True)
    y = rms_norm_linear_nvfp4(x, norm_w, 1e-6, False, *w, residual=res)
    want = rms_norm_linear_nvfp4.reference(x, norm_w, 1e-6, False, *w, residual=res)
    assert all(torch.equal(a, b) for a, b in zip(y, want))
    with ops.use_backend("triton"), pytest.raises(ConfigError, match="rms_norm_linear_nvfp4"):
        rms_norm_linear_nvfp4(x[None], norm_w, 1e-6, False, *w, residual=res[None])
    with ops.use_backend("triton"), pytest.raises(WeightsError, match="^weight_scale=.*float8_e4m3fn"):
        rms_norm_linear_nvfp4_triton(x, norm_w, 1e-6, False, w[0], w[1].float(), w[2], residual=res)


def test_an_eps_that_is_not_a_number_is_left_to_the_reference():
    """eps as a 0-D tensor reached the norm kernel as a pointer (a raw Triton error): the provider refuses it
    by name, as `rms_norm`'s does, and `auto` runs the reference."""
    x, norm_w, w, _ = _inputs(2, 7, 32, 0, False)
    eps = torch.tensor(1e-6)
    with ops.use_backend("triton"):
        with pytest.raises(ConfigError, match=r"op rms_norm_linear_nvfp4 has no triton provider .*it refuses eps="):
            rms_norm_linear_nvfp4(x, norm_w, eps, False, *w)
        with pytest.raises(InputError, match=r"^eps=.*a Python float"):
            rms_norm_linear_nvfp4_triton(x, norm_w, eps, False, *w)
    want = rms_norm_linear_nvfp4.reference(x, norm_w, 1e-6, False, *w)
    assert all(torch.equal(a, b) for a, b in zip(rms_norm_linear_nvfp4(x, norm_w, eps, False, *w), want))

@pytest.mark.parametrize("case", NORM_CASES)
def test_norm_operands_are_refused_by_the_provider_as_by_the_predicate(case, monkeypatch):
    """Called directly, the provider refuses the norm's operands as the op's predicate does (`rms_norm_refusal`,
    the norm's weight named norm_weight), before it plans or launches anything: a strided x or norm weight used
    to run and give logits off by up to 15, a short norm weight to read past its end, an fp32 residual to be
    rounded to bf16 where the reference kept fp32."""
    x, norm_w, w, res = _inputs(2, 7, 48, 0, True)
    (xi, wi, ri), field, message = bad_norm_operands(x, norm_w, res)[case]
    field = "norm_weight" if field == "weight" else field
    message = message.replace("weight.contiguous", "norm_weight.contiguous")
    with ops.use_backend("triton"):
        assert not rms_norm_linear_nvfp4.providers["triton"].supports(xi, wi, 1e-6, True, *w, residual=ri)
    for name in ("planned", "rms_norm_launch", "_run_planned"):
        monkeypatch.setattr(fused_module, name, lambda *a, name=name, **k: pytest.fail(f"{name} called"))
    with ops.use_backend("triton"), pytest.raises(InputError, match=rf"^{field}=.*{message}"):
        rms_norm_linear_nvfp4_triton(xi, wi, 1e-6, True, *w, residual=ri)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_lm_head_after_its_norm(m):
    """On the 151936 x 2048 LM head: the fused op equals the two Triton providers in turn bit for bit, and
    the logits its reference within the fp16-sum bound."""
    x, *w = nvfp4_inputs(m, 151936, 2048, torch.bfloat16, seed=m, device="cuda")
    gen = torch.Generator().manual_seed(m)
    res = torch.randn(m, 2048, generator=gen).to(torch.bfloat16).cuda()
    norm_w = (0.5 * torch.randn(2048, generator=gen)).to(torch.bfloat16).cuda()
    assert x_pass_split(x, 151936, 2048, True) is not None
    with ops.use_backend("triton"):
        got = rms_norm_linear_nvfp4(x, norm_w, 1e-6, True, *w, residual=res)
        y, s = rms_norm_triton(x, norm_w, 1e-6, True, res)
        assert torch.equal(got[0], linear_nvfp4_triton(y, *w, split_k=True))
    assert torch.equal(got[1], y) and torch.equal(got[2], s)
    wd = dequantize_nvfp4(*w)
    assert_matches(got[0], (y.float() @ wd.T).to(torch.bfloat16), y.float().abs() @ wd.abs().T,
                   sum_rtol=F16_SUM_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,wgmma", [(1, False), (3, False), (3, True), (32, False), (32, True)])
def test_gpu_pdl_reads_this_norms_pairs(m, wgmma, monkeypatch):
    """The GEMV (M = 1, 3), fp16 dot (M = 32) or wgmma kernel (M = 3, 32 on sm_90) launched beside the norm
    (PDL) reads this call's pairs: 12 calls back to back in a CUDA graph equal the same calls launched one
    after another (`assert_pdl_reads_its_own_x`)."""
    if wgmma and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel needs sm_90")
    monkeypatch.setattr(linear_nvfp4_module, "LM_HEAD_MIN_ELEMENTS", 0)
    monkeypatch.setattr(linear_nvfp4_module, "WGMMA", wgmma)
    _, *w = nvfp4_inputs(1, 4096, 2048, torch.bfloat16, device="cuda")
    norm_w = torch.randn(2048, device="cuda").to(torch.bfloat16)
    xs = [torch.randn(m, 2048, device="cuda").to(torch.bfloat16) for _ in range(12)]
    split = not wgmma          # 4096 rows split K (and so never run wgmma); the real LM heads take one slice
    assert linear_nvfp4_module.default_plan(xs[0], 4096, 2048, split).wgmma == wgmma

    def call(x, out=None):
        logits, _ = rms_norm_linear_nvfp4(x, norm_w, 1e-6, True, *w, split_work=split)
        if out is not None:
            out.copy_(logits)
        return logits

    with ops.use_backend("triton"):
        assert_pdl_reads_its_own_x(call, xs, monkeypatch)


@pytest.mark.parametrize("fmt", ["unq", "nvfp4"])
def test_lm_head_after_its_norm_equals_norm_then_lm_head(fmt, x_pass_everywhere):
    """The component contract (`LMHead.after_norm`): (logits, y) equal the norm and then the LM head, bit for
    bit, whether the format fuses them (NVFP4: one op, the norm making x's pass) or not."""
    from mtpfactory.components.linear import make_linear
    from mtpfactory.components.lm_head import LMHead
    from mtpfactory.components.norms import RMSNorm

    gen = torch.Generator().manual_seed(9)
    head = LMHead(make_linear(torch.randn(33, 208, generator=gen), fmt, torch.bfloat16, "lm_head"), 33)
    norm = RMSNorm((0.5 * torch.randn(208, generator=gen)).to(torch.bfloat16), 1e-6, zero_centred=True)
    x, res = (torch.randn(1, 208, generator=gen).to(torch.bfloat16) for _ in range(2))
    with ops.use_backend("triton"):
        logits, y = head.after_norm(norm, x, res)
        want_y, _ = norm(x, residual=res)
        assert torch.equal(y, want_y) and torch.equal(logits, head(want_y))
