"""Embedding gather's Triton provider against its reference (DESIGN 4). Exact: the kernel copies bits, so the
rows must be bit-equal to index_select's. Outputs poisoned with NaN."""

from __future__ import annotations

import os

import pytest
import torch

from mtpfactory import ops
from mtpfactory.errors import InputError, MtpfError
from mtpfactory.kernels.embedding import embedding, embedding_refusal, embedding_triton
from backend_refusal import assert_backend_refuses

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


# (3, 2050, 1): a row longer than one program's 4 KiB block (2048 16-bit or 1024 fp32 elements), so its grid
# ends in a partial block that rounding H / block down would leave unwritten
@pytest.mark.parametrize("V,H,N", [(1, 1, 1), (3, 7, 5), (1000, 64, 33), (1000, 130, 5), (3, 130, 33), (3, 2050, 1)])
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


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_out_whose_columns_lie_apart(backend):
    """`out` the transpose of a poisoned [H, N] buffer: its columns lie N apart (the column slice above has unit
    stride along H, so a kernel that ignored out's column stride passed it; on the GPU only the 2^31 test
    reached another stride). bf16 so the copy goes through 16-bit ints."""
    table = torch.randn(10, 7, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    ids = torch.tensor([3, 9, 0, 3, 5])
    buf = torch.full((7, 5), float("nan"), dtype=torch.bfloat16)
    out = buf.T
    with ops.use_backend(backend):
        assert embedding(ids, table, out=out) is out
    assert bits_equal(out, embedding.reference(ids, table))


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


def _ops():
    """ids [3] int64, table [5, 6] fp32: operands the kernel takes."""
    return torch.tensor([3, 0, 4]), torch.randn(5, 6, generator=torch.Generator().manual_seed(9))


# case: (ids, table) from `_ops()`, the field refused, what its message says it allows. The row past the grid is
# 65535 blocks of 512 fp64 and one more: 268 MB that torch.empty reserves and nothing touches.
BAD = {
    "ids 2-D": (lambda i, t: (i[None], t), "ids", r"an int32 or int64 \[N\] tensor"),
    "ids 0-D": (lambda i, t: (i[0], t), "ids", r"a 1-D \[N\] tensor"),
    "ids float": (lambda i, t: (i.float(), t), "ids", "int32 or int64"),
    "ids int16": (lambda i, t: (i.short(), t), "ids", "int32 or int64"),
    "ids elsewhere": (lambda i, t: (i.to("meta"), t), "ids", "on table's device, cpu"),
    "ids past the grid": (lambda i, t: (i[:1].expand(2**31), t), "ids", "at most 2147483647"),
    "table 0-D": (lambda i, t: (i, t[0, 0]), "table", r"a \[V, H\] tensor"),
    "table 1-D": (lambda i, t: (i, t[:, 0]), "table", r"a 2-D \[V, H\] tensor"),
    "table 3-D": (lambda i, t: (i, t.view(5, 2, 3)), "table", r"a 2-D \[V, H\] tensor"),
    "table complex128": (lambda i, t: (i, t.to(torch.complex128)), "table", "1, 2, 4 or 8-byte elements"),
    "table strided along H": (lambda i, t: (i, torch.cat([t, t], 1)[:, ::2]), "table", "unit stride along H"),
    "table row past the grid": (lambda i, t: (i[:1], torch.empty(1, 65535 * 512 + 1, dtype=torch.float64)),
                                "table", "at most 65535 programs of 512"),
}


def _poisoned_for(ids: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, what to check is still NaN): [N, H] in table's dtype (fp32 where that has no NaN), one NaN seen
    through stride 0 where that is huge."""
    shape = (ids.numel(), table.shape[-1] if table.dim() else 1)
    dtype = table.dtype if table.dtype.is_floating_point or table.dtype.is_complex else torch.float32
    if shape[0] * shape[1] <= 2**16:
        out = torch.full(shape, float("nan"), dtype=dtype)
        return out, out
    one = torch.full((1, 1), float("nan"), dtype=dtype)
    return one.expand(shape), one


@pytest.mark.parametrize("case", BAD)
def test_operands_the_kernel_cannot_take_are_refused_by_the_predicate_the_provider_and_the_backend(case):
    """One rule (`embedding_refusal`): the predicate says no, `embedding_triton` called directly raises it naming
    the operand and writes nothing, and an explicit `runtime.backend=triton` says which operand it refuses."""
    make, field, allowed = BAD[case]
    ids, table = make(*_ops())
    out, poison = _poisoned_for(ids, table)
    assert embedding_refusal(ids, table).field == field
    with ops.use_backend("triton"):
        assert not embedding.providers["triton"].supports(ids, table, out)
        with pytest.raises(InputError, match=rf"^{field}=.*{allowed}"):
            embedding_triton(ids, table, out=out)
        assert_backend_refuses(embedding, field, ids, table, out=out)
    assert poison.isnan().all()


@pytest.mark.parametrize("case", ["ids 2-D", "ids float", "ids int16", "table 0-D"])
@pytest.mark.parametrize("backend", ["native", "auto"])
def test_ids_and_tables_no_provider_can_gather_are_refused_by_the_reference(case, backend):
    """Ids of two dims or not int32 / int64 and a 0-D table, which index_select (or the id check before it) met
    with a raw torch error, are refused naming the operand, before anything is written."""
    make, field, _ = BAD[case]
    ids, table = make(*_ops())
    out = torch.full((ids.numel(), 6), float("nan"))
    with ops.use_backend(backend), pytest.raises(InputError, match=rf"^{field}="):
        embedding(ids, table, out=out)
    assert out.isnan().all()


def test_the_reference_takes_what_only_the_kernel_refuses():
    """One 0-D id (a [1, H] row, as index_select gives), tables of one or three dims, of 16-byte elements, strided
    along H: the reference gathers them (under `auto` the op falls back to it)."""
    ids, table = _ops()
    ref = embedding.reference
    assert torch.equal(ref(ids[0], table), table[3:4])
    assert torch.equal(ref(ids, table[:, 0]), table[ids, 0])
    assert torch.equal(ref(ids, table.view(5, 2, 3)), table[ids].view(3, 2, 3))
    assert torch.equal(ref(ids, table.to(torch.complex128)), table[ids].to(torch.complex128))
    wide = torch.cat([table, table], 1)
    assert torch.equal(ref(ids, wide[:, ::2]), wide[ids, ::2])
    with ops.use_backend("auto"):
        assert torch.equal(embedding(ids[0], table), table[3:4])


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


@pytest.mark.gpu_memory
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_out_offsets_past_int32():
    """out= a transposed view [N, H] of [H, N] with N * H > 2^31 elements: the kernel's column offsets (col * N)
    pass int32's range, so they must be computed in int64 (they wrapped before: writes landed out of bounds)."""
    H, N = 2**15 + 3, 2**16 + 1
    assert (H - 1) * N >= 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = torch.randint(-100, 100, (4, H), device="cuda", dtype=torch.int8, generator=gen)
    ids = torch.randint(0, 4, (N,), device="cuda", generator=gen)
    ids[-1] = 3
    out = torch.full((H, N), 127, dtype=torch.int8, device="cuda").t()   # 127: a poison the table never holds
    with ops.use_backend("triton"):
        got = embedding(ids, table, out=out)
    assert got is out
    assert torch.equal(out, table[ids])


def test_an_out_sharing_memory_with_the_table_is_left_to_the_reference():
    """`out` a slice of the table itself (gathering rows over the table's own first rows): the reference reads
    every row before it writes, while the kernel's programs overwrite rows that later programs read (row 0
    taken by id 1 was then read by id 0, which got row 1 again). The provider refuses it by name, so `auto` runs
    the reference and an explicit `triton` says why."""
    table = torch.arange(24, dtype=torch.float32).view(6, 4)
    ids = torch.tensor([1, 0, 3])
    want = table[ids].clone()
    assert embedding_refusal(ids, table) is None
    with ops.use_backend("triton"):
        before = table.clone()
        with pytest.raises(MtpfError, match=r"has no triton provider .*it refuses out=.*memory shared with table"):
            embedding(ids, table, out=table[:3])
        assert torch.equal(table, before)
    with ops.use_backend("auto"):
        assert torch.equal(embedding(ids, table, out=table[:3]), want)
