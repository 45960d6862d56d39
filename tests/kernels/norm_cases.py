"""Norm operands the RMSNorm kernel cannot take, shared by test_rms_norm.py and test_rms_norm_linear_nvfp4.py, and
the tolerance of a norm against its reference (test_rms_norm.py, test_embed_norm_cat.py)."""

import torch

NORM_CASES = ["strided x", "strided weight", "short weight", "fp64 weight", "int x", "empty rows", "fp32 residual",
              "broadcast residual", "strided residual"]


def bad_norm_operands(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor) -> dict:
    """{case: ((x, weight, residual), the field named, the error's message)} for each of NORM_CASES, made from
    good operands x [M, H], w [H], res [M, H]. The kernel steps x's and the residual's rows by H and reads the
    weight with unit stride: the strided and short ones ran and gave wrong numbers or read past the end."""
    h = x.shape[-1]
    w_wide = torch.zeros(2 * h, dtype=w.dtype)
    w_wide[::2] = w
    return {"strided x": ((torch.cat([x, x], -1)[..., :h], w, None), "x", r"a contiguous tensor.*x.contiguous\(\)"),
            "strided weight": ((x, w_wide[::2], None), "weight", rf"\[H\] = \[{h}\].*weight.contiguous\(\)"),
            "short weight": ((x, w[: h // 2], None), "weight", rf"\[H\] = \[{h}\]"),
            "fp64 weight": ((x, w.double(), None), "weight", "bf16, fp16 or fp32"),
            "int x": ((x.to(torch.int32), w, None), "x", "bf16, fp16 or fp32"),
            "empty rows": ((x[..., :0], w[:0], None), "x", "1 <= H <= 65536"),
            "fp32 residual": ((x, w, res.float()), "residual", r"x's shape and dtype.*residual.to\(x.dtype\)"),
            "broadcast residual": ((x, w, res[0]), "residual", "x's shape and dtype"),
            "strided residual": ((x, w, torch.cat([res, res], -1)[..., :h]), "residual", r"residual.contiguous\(\)")}


def assert_norm_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """A norm against its reference: both compute in fp32 and round once to the output dtype; the row's sum of
    squares is reduced in another order and rsqrt may differ in its last bits, a few fp32 ulps. That moves a
    16-bit result by one ulp only where the fp32 value lies within a few fp32 ulps of a rounding boundary: so at
    most 1% of the elements (and at least one allowed) may differ, each by at most one ulp (relative 2**-7 for
    bf16, 2**-10 for fp16). fp32 keeps the reduction-order error: relative 1e-6, about 8 ulps."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any(), "an output element was left unwritten"
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        return
    torch.testing.assert_close(got, want, rtol=torch.finfo(want.dtype).eps, atol=0)
    assert (got != want).sum() <= max(1, want.numel() // 100)
