"""Embedding gather's Triton provider against its reference (DESIGN 4). Exact: the kernel copies bits, so the
rows must be bit-equal to index_select's. Outputs poisoned with NaN."""

from __future__ import annotations

import os

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import InputError
from mtpfactory.kernels.embedding import embedding

DTYPES = [torch.bfloat16, torch.float16, torch.float32]

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="Triton on the CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


def run(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    out = torch.full((ids.shape[0], table.shape[1]), float("nan"), dtype=table.dtype, device=table.device)
    with ops.use_backend("triton"):
        got = embedding(ids, table, out=out)
    assert got is out
    return got


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("V,H,N", [(1, 1, 1), (3, 7, 5), (1000, 64, 33), (1000, 130, 5), (3, 130, 33)])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype, id_dtype, V, H, N):
    gen = torch.Generator().manual_seed(V + H + N)
    table = torch.randn(V, H, generator=gen).to(dtype)
    ids = torch.randint(0, V, (N,), generator=gen).to(id_dtype)
    ids[0] = V - 1  # the last row
    assert bits_equal(run(ids, table), embedding.reference(ids, table))


def test_row_strided_table_special_values_and_dispatch():
    """A table that is a column slice of a wider one (stride(0) > H); NaN / inf / -0 rows survive as bits."""
    wide = torch.randn(10, 200).to(torch.bfloat16)
    wide[4, 5:8] = torch.tensor([float("nan"), float("-inf"), -0.0])
    table = wide[:, 5:135]
    ids = torch.tensor([4, 0, 9, 4])
    assert bits_equal(run(ids, table), embedding.reference(ids, table))
    with ops.use_backend("triton"):
        assert bits_equal(embedding(ids, table), embedding.reference(ids, table))


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_strided_ids_and_out_which_every_provider_takes(backend):
    """ids a column of a wider tensor; `out` a column slice of a wider buffer, written by its strides by the
    Triton provider and the reference alike; an `out` of another shape or dtype refused by both."""
    table = torch.randn(10, 6)
    ids = torch.tensor([[3, 0], [7, 0], [1, 0]])[:, 0]
    wide = torch.full((3, 10), float("nan"))
    with ops.use_backend(backend):
        got = embedding(ids, table, out=wide[:, 2:8])
        assert bits_equal(got, embedding.reference(ids, table)) and wide[:, [0, 1, 8, 9]].isnan().all()
        for bad in (torch.empty(3, 6, dtype=torch.float64), torch.empty(4, 6)):
            with pytest.raises(InputError, match="out="):
                embedding(ids, table, out=bad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [-1, 5, 2**40])
def test_id_out_of_range_refused_by_the_reference_and_a_zero_row_from_the_kernel(bad, device):
    """Ids lie in [0, 5). The reference refuses another, naming the field; the kernel, which cannot raise
    without a sync, writes zeros for that row and reads nothing outside the table: the table is rows 2-6 of a
    NaN-filled tensor, so a read before or past it would show as NaN."""
    wide = torch.full((9, 6), float("nan"), device=device)
    table = wide[2:7]
    table.copy_(torch.randn(5, 6, generator=torch.Generator().manual_seed(3)))
    ids = torch.tensor([4, bad, 0], device=device)
    with pytest.raises(InputError, match=rf"^ids={bad}: token ids of this 5-row table lie in \[0, 5\)"):
        embedding.reference(ids, table)
    got = run(ids, table)
    assert bits_equal(got[[0, 2]], table[[4, 0]]) and torch.equal(got[1], torch.zeros(6, device=device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("H", [2048, 7168])
@pytest.mark.parametrize("N", [1, 32, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_reference(dtype, N, H):
    gen = torch.Generator(device="cuda").manual_seed(N + H)
    table = torch.randn(151_936, H, device="cuda", generator=gen).to(dtype)
    ids = torch.randint(0, table.shape[0], (N,), device="cuda", generator=gen)
    assert bits_equal(run(ids, table), embedding.reference(ids, table))
