"""`Projections`: projections of one input by one GEMV where their storage allows (unquantized alike, FP8 alike),
apart otherwise (NVFP4, or mixed), each part's output and weight the same as its own projection's."""

from __future__ import annotations

import pytest
import torch

from mtpfactory import ops
from mtpfactory.components.linear import Linear, LinearFP8, Projections, make_linear


def _parts(fmts, sizes=(5, 3, 1), k=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [make_linear(torch.randn(n, k, generator=gen), fmt, torch.float32, f"p{i}")
            for i, (n, fmt) in enumerate(zip(sizes, fmts))]


@pytest.mark.parametrize("fmts,stacked", [(("unq",) * 3, True), (("fp8",) * 3, True), (("nvfp4",) * 3, False),
                                          (("unq", "fp8", "unq"), False)])
@pytest.mark.parametrize("backend", ["native", "triton"])
def test_each_part_equals_its_own_projection(fmts, stacked, backend):
    """Stacked, one GEMV makes every part's columns; its rows are the parts' rows (FP8: with their own scales), so
    each output equals the part's own projection but for the order of its sums (the matmul's blocking and the
    GEMV's split over K may differ with the row count): relative 1e-5 in fp32. Each weight given back exactly."""
    parts = _parts(fmts)
    p = Projections(parts)
    assert p.stacked == stacked and len(p.parts) == (1 if stacked else 3)
    if stacked and fmts[0] == "fp8":
        assert isinstance(p.parts[0], LinearFP8)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    with ops.use_backend(backend):
        got = p(x)
        want = [part(x) for part in parts]
    assert [g.shape for g in got] == [(4, 5), (4, 3), (4, 1)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item())
    weights = p.dequantize()
    assert list(weights) == ["p0", "p1", "p2"]
    for part in parts:
        assert torch.equal(weights[part.name], part.dequantize())


def test_one_part_runs_as_itself():
    part = _parts(("unq",), sizes=(5,))[0]
    p = Projections([part])
    assert not p.stacked and p.parts[0] is part


def test_parts_of_different_split_work_run_apart():
    a, b = _parts(("unq", "unq"), sizes=(2, 2))
    b = Linear(b.weight.data, b.name, split_work=False)
    assert not Projections([a, b]).stacked
